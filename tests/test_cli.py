"""The command line: every mistake is one line naming the flag, exit code 2, before any weight loads; every flag
explains itself with its default; vLLM's names work, and vLLM flags pocketllm lacks say what to use instead."""

import json
import os
import re
import socket
import subprocess
import sys
import urllib.request

import pytest

import pocketllm

ROOT = pocketllm.HERE
TINY = str(pocketllm.DEFAULT_CKPT)


def cli(*args, timeout=120, env=None):
    return subprocess.run([sys.executable, str(ROOT / "pocketllm.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


MISTAKES = [
    (["--port", "99999"], "--port 99999: must be in [0, 65535]"),
    (["--port", "-1"], "--port -1: must be in [0, 65535]"),
    (["--port", "eighty"], "argument --port: invalid int value: 'eighty'"),
    (["--port", "BUSY"], "--port BUSY: cannot listen on 127.0.0.1:BUSY (Address already in use)"),
    (["--host", "no-such-host.invalid"], "--host no-such-host.invalid: cannot resolve it"),
    (["--chat-template", "/no/such/template.jinja"], "--chat-template /no/such/template.jinja: cannot read it"),
    (["--chat-template", "BADJSON"], '--chat-template BADJSON: a .json file must hold a "chat_template" key'),
    (["--ckpt", "/no/such/checkpoint"], "--ckpt /no/such/checkpoint: no such directory"),
    (["--ckpt", "/tmp"], "--ckpt /tmp: not a checkpoint directory (no config.json in it)"),
    (["--device", "cuda"], "--device cuda: torch .* sees no CUDA device"),
    (["--device", "cuda:3"], "--device cuda:3: torch .* sees no CUDA device"),
    (["--device", "tpu:0"], "--device 'tpu:0' is not a device (expected auto, cpu, cuda or cuda:N)"),
    (["--device", "meta"], "--device meta: pocketllm runs on cpu or cuda devices, not meta"),
    (["--devices", "cpu,cuda:0"], "--devices 'cpu,cuda:0': every rank must be a cpu, or every rank a cuda"),
    (["--tensor-parallel-size", "4"], "--tensor-parallel-size 4: only 0 CUDA device"),
    (["--dtype", "fp8"], "--dtype must be one of auto, float32, bfloat16, float16"),
    (["--kv-dtype", "int4"], "--kv-dtype must be one of"),
    (["--backend", "native"], "--backend native: the native backend needs a CUDA device"),
    (["--backend", "vulkan"], "--backend must be auto, torch or native"),
    (["--max-model-len", "0"], "--max-context must be >= 1"),
    (["--max-model-len", "262144"], "--max-context/--max-model-len 262144 is beyond the model's "
                                    "max_position_embeddings (65536, config.json): .* "
                                    "POCKETLLM_ALLOW_LONG_MAX_MODEL_LEN=1 in the environment allows it"),
    (["--max-num-seqs", "-2"], "--max-batch-size must be >= 0"),
    (["--gpu-memory-utilization", "1.2"], "--gpu-memory-utilization must be in (0, 1]"),
    (["--smoke-layers", "99"], "--smoke-layers must be in [0, 6]"),
    (["--tool-call-parser", "mistral"], "argument --tool-parser/--tool-call-parser: 'mistral' is not a tool-call"),
    (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype is a vLLM flag pocketllm does not have: use --kv-dtype"),
    (["--trust-remote-code"], "--trust-remote-code is a vLLM flag"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["bench", "--help"], "there is no 'bench' subcommand: the benchmarks are benchmarks/bench.py"),
]


# Importing torch costs seconds per process, so one runner process imports pocketllm once and forks a child
# per command line: each child runs main() as `python pocketllm.py ARGS` does, with its own stderr and exit code.
# Three command lines also run as real `python pocketllm.py` processes, to keep the two honest.
RUNNER = """
import json, os, sys, tempfile
sys.path.insert(0, sys.argv[1])
import pocketllm
out = []
for args in json.loads(sys.argv[2]):
    with tempfile.TemporaryFile("w+") as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(err.fileno(), 2)
            try:
                code = pocketllm.main(args)
            except SystemExit as e:
                code = e.code
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 1)
        _, status = os.waitpid(pid, 0)
        err.seek(0)
        out.append([os.waitstatus_to_exitcode(status), err.read()])
print(json.dumps(out))
"""
REAL_PROCESSES = ("--port 99999", "--device cuda", "bench --help")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """Every MISTAKES command line run: {case: (args, returncode, stderr, substitutions)}."""
    bad_json = tmp_path_factory.mktemp("tpl") / "bad.json"
    bad_json.write_text('{"no_template": 1}')
    env = {k: v for k, v in os.environ.items() if k != "POCKETLLM_NATIVE_CPU"}
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        subs = {"BUSY": str(busy.getsockname()[1]), "BADJSON": str(bad_json)}
        cases = [[subs.get(a, a) for a in args] for args, _ in MISTAKES]
        forked = subprocess.run([sys.executable, "-c", RUNNER, str(ROOT), json.dumps(cases)], capture_output=True,
                                text=True, timeout=300, cwd=ROOT, env=env)
        assert forked.returncode == 0, forked.stderr
        results = json.loads(forked.stdout.splitlines()[-1])
        for i, args in enumerate(cases):
            if " ".join(MISTAKES[i][0]) in REAL_PROCESSES:
                real = cli(*args, env=env)
                assert [real.returncode, real.stderr] == results[i], (real.stderr, results[i])
    return {i: (cases[i], *results[i], subs) for i in range(len(cases))}


@pytest.mark.parametrize("case", range(len(MISTAKES)), ids=[" ".join(a) for a, _ in MISTAKES])
def test_every_mistake_is_one_line_and_exit_2(case, outcomes):
    args, returncode, stderr, subs = outcomes[case]
    message = MISTAKES[case][1]
    for name, value in subs.items():
        message = message.replace(name, value)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert returncode == 2, stderr
    assert len(lines) == 1 and lines[0].startswith("pocketllm: error: "), stderr
    assert re.search(".*".join(map(re.escape, message.split(".*"))), lines[0]), lines[0]


def test_a_cache_past_the_ram_available_is_one_line_before_any_weight_loads():
    """--max-model-len past what this machine's RAM holds (allowed past the model's positions): refused from
    MemAvailable in one line naming the flag, where it once ended in the allocator's traceback."""
    env = {k: v for k, v in os.environ.items() if k != "POCKETLLM_NATIVE_CPU"}
    r = cli("--max-model-len", "1000000000", "--port", "0", "--quiet",
            env={**env, "POCKETLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert r.stderr.startswith("pocketllm: error: the CPU has ") and "available (MemAvailable)" in r.stderr
    assert r.stderr.rstrip().endswith("lower --max-context/--max-model-len (now 1000000000) or "
                                      "--max-batch-size/--max-num-seqs (now 16)")


def test_every_flag_has_help_with_its_default():
    parser = pocketllm.command_line_parser()
    for action in parser._actions:
        if action.dest == "help":
            continue
        assert action.help and "default" in action.help, action.option_strings
    text = parser.format_help()
    assert "(default: auto)" in text and "(default: 0.9)" in text and "--max-model-len" in text


def test_vllm_names_are_aliases():
    args = pocketllm.parse_command_line([
        "--model", TINY, "--max-model-len", "2048", "--max-num-seqs", "4", "--dtype", "half", "--block-size", "32",
        "--max-num-batched-tokens", "256", "--gpu-memory-utilization", "0.8", "--served-model-name", "qwen",
        "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", "--port", "0"])
    options = pocketllm.engine_options(args)
    assert args.ckpt == TINY and args.served_model_name == "qwen" and args.tool_parser == "qwen_xml"
    assert (options["max_context"], options["max_batch_size"], options["kv_block_size"],
            options["prefill_token_budget"], options["gpu_memory_utilization"]) == (2048, 4, 32, 256, 0.8)
    assert pocketllm.resolve_dtype(options["dtype"], pocketllm.torch.device("cpu"), "dtype") == pocketllm.torch.float16
    assert pocketllm.resolve_dtype("bf16", pocketllm.torch.device("cpu"), "dtype") == pocketllm.torch.bfloat16
    assert pocketllm.engine_options(pocketllm.parse_command_line(["--enforce-eager"]))["enforce_eager"] is True
    assert pocketllm.engine_options(pocketllm.parse_command_line([]))["enforce_eager"] is False


def test_tensor_parallel_size_means_the_first_gpus(monkeypatch):
    monkeypatch.setattr(pocketllm.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pocketllm.torch.cuda, "device_count", lambda: 4)
    options = pocketllm.engine_options(pocketllm.parse_command_line(["--tensor-parallel-size", "3"]))
    assert options["devices"] == "0,1,2"
    assert pocketllm.engine_options(pocketllm.parse_command_line(["--tensor-parallel-size", "1"]))["devices"] is None
    with pytest.raises(pocketllm.PocketError, match="not both"):
        pocketllm.engine_options(pocketllm.parse_command_line(["--tensor-parallel-size", "2", "--devices", "0,1"]))


def test_a_vllm_command_line_serves(tmp_path):
    """vLLM's flags end to end: the server starts on them, names the model as asked, and answers."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "pocketllm.py"), "--model", TINY, "--served-model-name",
                             "my-qwen", "--max-model-len", "512", "--max-num-seqs", "2", "--dtype", "float",
                             "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_xml", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        assert "http://127.0.0.1:" in line, proc.stderr.read() if proc.poll() is not None else line
        url = line.split()[-1]
        models = json.load(urllib.request.urlopen(url + "/v1/models", timeout=30))
        assert [m["id"] for m in models["data"]] == ["my-qwen"]
        body = json.dumps({"model": "my-qwen", "max_tokens": 4, "temperature": 0,
                           "messages": [{"role": "user", "content": "Hi"}]}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        answer = json.load(urllib.request.urlopen(req, timeout=60))
        assert answer["model"] == "my-qwen" and answer["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    log = proc.stderr.read()
    assert "backend torch on cpu, float32 activations, float32 KV cache:" in log
    assert "warm-up: 16-token prefill" in log
    assert "KV cache 64 blocks x 16 tokens" in log and "2 state slots" in log


def test_the_docs_table_lists_every_flag_and_every_vllm_answer():
    text = (ROOT / "docs" / "api.md").read_text()
    section = text[text.index("\n## Command line\n"):]
    for action in pocketllm.command_line_parser()._actions:
        for name in action.option_strings:
            if name.startswith("--") and name != "--help":
                assert f"`{name}" in section, name
    for name in pocketllm.VLLM_ONLY_FLAGS:
        assert f"`{name}`" in section, name
