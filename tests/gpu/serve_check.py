"""The GPU check's serving steps (tests/gpu/check.sh): start `python pocketllm.py` as a user would and drive it
over HTTP the way clients do, with the sampling users send.

    python tests/gpu/serve_check.py synth DIR [--small]     # a synthetic FP8 checkpoint: the 27B's layer shapes,
                                                            # 4 layers (3 GDN + 1 attention), a small vocab
    python tests/gpu/serve_check.py serve LOGDIR NAME -- SERVER FLAGS...
    python tests/gpu/serve_check.py dry-run LOGDIR          # everything above on the CPU (torch backend), with a
                                                            # small synthetic checkpoint: checks this script here

`serve` starts the server (port 0, its log in LOGDIR/NAME.server.log), waits for /health, then runs each check
and writes LOGDIR/NAME.json: /health and /metrics; a chat at the default temperature (1) with top_p 0.95;
presence, frequency and repetition penalties; n=2 with logprobs and top_logprobs; streaming (SSE to [DONE]);
a forced tool call (tool_choice naming the function). Exit code 0 only when every check passed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPES_27B = dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4,
                  head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                  linear_value_head_dim=128, num_hidden_layers=4,
                  layer_types=["linear_attention"] * 3 + ["full_attention"])
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city", "days"]}}}
USER = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


def synth(path: Path, small: bool = False) -> Path:
    """Write the synthetic FP8 checkpoint into path (tests/checkpoints.py, transformers as the writer)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import checkpoints
    t0 = time.time()
    made, _ = checkpoints.make_checkpoint(path, "qwen3_5", fp8=True,
                                          **({"num_hidden_layers": 4} if small else SHAPES_27B))
    print(f"synthetic checkpoint {made}: {'small' if small else '27B layer shapes'}, 4 layers, "
          f"{time.time() - t0:.0f} s", flush=True)
    return made


# ---- Talking to the server: the standard library only ----

def post(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        raise AssertionError(f"HTTP {e.code}: {e.read().decode(errors='replace')[:500]}") from None


def stream(url: str, body: dict, timeout: float = 300) -> list[dict]:
    """The chunks of an SSE stream, which must end with data: [DONE] and carry no error event."""
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    chunks, done = [], False
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line or line.startswith(":"):
                continue
            assert line.startswith("data: ") and not done, f"malformed SSE line {line[:200]!r}"
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, f"error event: {chunk['error']}"
            chunks.append(chunk)
    assert done, "the stream ended without data: [DONE]"
    return chunks


def start_server(flags: list[str], log: Path, timeout: float = 600) -> tuple[subprocess.Popen, str]:
    """`python pocketllm.py FLAGS --port 0` in its own process group; (process, base URL) once it listens."""
    out = open(log, "w")
    proc = subprocess.Popen([sys.executable, str(ROOT / "pocketllm.py"), *flags, "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=out, text=True, start_new_session=True)
    deadline = time.time() + timeout
    line = proc.stdout.readline()            # "pocketllm: serving 'NAME' on http://HOST:PORT", after the warm-up
    if "http://" not in line or time.time() > deadline:
        stop_server(proc)
        raise AssertionError(f"the server did not start: {log.read_text()[-2000:]}")
    return proc, line.split()[-1]


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---- The checks: each takes the base URL and the served model name, returns one line of detail ----

def check_health(url, model):
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        assert r.status == 200, r.status
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        metrics = r.read().decode()
    assert "pocketllm_prompt_tokens_total 0" in metrics, "the warm-up was counted as a request"
    return "/health 200; /metrics counts no warm-up tokens"


def check_default_sampling(url, model):
    r = post(url + "/v1/chat/completions", {"model": model, "messages": USER, "max_tokens": 24, "top_p": 0.95})
    choice = r["choices"][0]
    assert choice["finish_reason"] in ("stop", "length", "tool_calls"), choice
    assert r["usage"]["completion_tokens"] >= 1
    return f"temperature 1 (default), top_p 0.95: {r['usage']['completion_tokens']} tokens, {choice['finish_reason']}"


def check_penalties(url, model):
    r = post(url + "/v1/completions", {"model": model, "prompt": "The weather in Paris is", "max_tokens": 24,
                                       "temperature": 1.0, "presence_penalty": 1.0, "frequency_penalty": 0.5,
                                       "repetition_penalty": 1.2, "seed": 7})
    again = post(url + "/v1/completions", {"model": model, "prompt": "The weather in Paris is", "max_tokens": 24,
                                           "temperature": 1.0, "presence_penalty": 1.0, "frequency_penalty": 0.5,
                                           "repetition_penalty": 1.2, "seed": 7})
    assert r["choices"][0]["text"] == again["choices"][0]["text"], "the same seed gave different text"
    return f"presence 1.0, frequency 0.5, repetition 1.2, seed 7: {r['usage']['completion_tokens']} tokens, repeatable"


def check_n_logprobs(url, model):
    r = post(url + "/v1/chat/completions", {"model": model, "messages": USER, "max_tokens": 8, "n": 2,
                                            "logprobs": True, "top_logprobs": 2})
    assert [c["index"] for c in r["choices"]] == [0, 1], r["choices"]
    for c in r["choices"]:
        content = c["logprobs"]["content"]
        assert content and all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in content), c["logprobs"]
    return f"n=2 with logprobs, top_logprobs 2: {[len(c['logprobs']['content']) for c in r['choices']]} tokens"


def check_streaming(url, model):
    chunks = stream(url + "/v1/chat/completions", {"model": model, "messages": USER, "max_tokens": 16,
                                                   "presence_penalty": 0.5})
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1, finish
    return f"{len(chunks)} chunks, finish_reason {finish[0]}, [DONE]"


def check_forced_tool_call(url, model):
    r = post(url + "/v1/chat/completions", {"model": model, "messages": USER, "tools": [WEATHER], "max_tokens": 200,
                                            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    calls = r["choices"][0]["message"].get("tool_calls") or []
    assert len(calls) >= 1 and calls[0]["function"]["name"] == "get_weather", r["choices"][0]
    arguments = json.loads(calls[0]["function"]["arguments"])
    assert isinstance(arguments, dict) and {"city", "days"} <= set(arguments), arguments
    return f"get_weather({calls[0]['function']['arguments'][:60]})"


CHECKS = [check_health, check_default_sampling, check_penalties, check_n_logprobs, check_streaming,
          check_forced_tool_call]


def serve(logdir: Path, name: str, flags: list[str]) -> int:
    logdir.mkdir(parents=True, exist_ok=True)
    result = {"flags": flags, "checks": {}}
    t0 = time.time()
    try:
        proc, url = start_server(flags, logdir / f"{name}.server.log")
    except AssertionError as e:
        result["checks"]["start"] = f"FAIL {e}"
        print(f"[FAIL] start: {e}", flush=True)
        (logdir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        return 1
    result["start_s"] = round(time.time() - t0, 1)
    print(f"server up in {result['start_s']} s at {url}", flush=True)
    model = json.load(urllib.request.urlopen(url + "/v1/models", timeout=30))["data"][0]["id"]
    try:
        for check in CHECKS:
            label = check.__name__.removeprefix("check_")
            try:
                detail = check(url, model)
                result["checks"][label] = f"PASS {detail}"
                print(f"[PASS] {label}: {detail}", flush=True)
            except Exception as e:  # noqa: BLE001  (every failure is reported, the next check still runs)
                result["checks"][label] = f"FAIL {type(e).__name__}: {e}"
                print(f"[FAIL] {label}: {type(e).__name__}: {e}", flush=True)
    finally:
        stop_server(proc)
    (logdir / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    failed = [k for k, v in result["checks"].items() if v.startswith("FAIL")]
    print(f"{name}: {len(result['checks']) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


def dry_run(logdir: Path) -> int:
    """The serving steps of check.sh on the CPU: the same script, the torch backend, a small checkpoint."""
    import tempfile
    cpu = ["--device", "cpu", "--backend", "torch", "--max-context", "1024"]
    with tempfile.TemporaryDirectory() as d:
        ckpt = synth(Path(d), small=True)
        codes = [serve(logdir, "serve_tiny", cpu),
                 serve(logdir, "serve_synthetic", [*cpu, "--ckpt", str(ckpt), "--smoke-layers", "4"])]
    return max(codes)


def main(argv: list[str]) -> int:
    if argv[:1] == ["synth"]:
        synth(Path(argv[1]), small="--small" in argv)
        return 0
    if argv[:1] == ["serve"]:
        flags = argv[argv.index("--") + 1:] if "--" in argv else []
        return serve(Path(argv[1]), argv[2], flags)
    if argv[:1] == ["dry-run"]:
        return dry_run(Path(argv[1]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
