"""Tensor parallelism on CPU ranks (gloo): TP2 and TP4 against TP1 (the single-process engine, itself tested
against transformers in test_reference.py), and the group's lifecycle: every way a group ends leaves no rank
process behind (checked in /proc).

Starting a group costs one Python + torch import per worker rank, so groups are shared across tests and the
destructive tests run last on a group that is done anyway."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

import pocketllm

ROOT = Path(__file__).resolve().parent.parent

# Heads that divide by 2 and by 4; intermediate 200 divides by 2 and 4 (and not by 3).
HEADS = dict(num_key_value_heads=4, linear_num_key_heads=4, linear_num_value_heads=8)
# FP8 at TP2: every rank's rows and columns fall on whole 128x128 blocks (head_dim 32: four gated q heads are
# 256 rows, four kv heads 128 rows; GDN heads are 128 wide).
FP8_DIMS = dict(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=8, head_dim=32,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
                linear_value_head_dim=128)
ENGINE = dict(quiet=True, max_context=256, max_batch_size=4, prefill_token_budget=8)   # chunked prefill
PROMPTS = [[5, 9, 14, 200, 31, 7, 7, 120, 3, 44, 61, 18, 90], [17, 250, 3], [100 + i for i in range(21)]]
REL_TOL = 1e-4


def cpu_ranks(n: int) -> str:
    return ",".join(["cpu"] * n)


def rank_processes(ckpt, world: int, parent: int | None = None) -> list[int]:
    """Live (non-zombie) worker ranks of one group (checkpoint, degree, rank 0's pid), from the process table."""
    marks = [str(ckpt), f'"world": {world}', f'"parent": {parent or os.getpid()}']
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmdline = (d / "cmdline").read_bytes().decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if "run_rank_worker" in cmdline and all(m in cmdline for m in marks) and state != "Z":
            found.append(int(d.name))
    return found


def wait_no_ranks(*group, within_s: float = 10.0) -> float:
    """Seconds until no rank of the group is left; fails if some survive `within_s`."""
    t0 = time.time()
    while rank_processes(*group) and time.time() - t0 < within_s:
        time.sleep(0.1)
    assert rank_processes(*group) == [], f"rank processes survived: {rank_processes(*group)}"
    return time.time() - t0


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


def generate_together(llm, prompts, **sampling) -> list[list[int]]:
    """Submit every prompt at once (one batch, chunked prefill under the small token budget)."""
    streams = [llm.submit(p, pocketllm.SamplingParams(**sampling)) for p in prompts]
    out = []
    for s in streams:
        ids: dict[int, list[int]] = {}
        for ev in s:
            ids.setdefault(ev.index, []).extend(ev.token_ids)
        out.append([ids[i] for i in sorted(ids)])
    return out


@pytest.fixture(scope="module")
def bf16(ckpt_factory):
    return ckpt_factory("qwen3_5", **HEADS)[0]


@pytest.fixture(scope="module", params=[("fp8", 2), ("bf16", 4)], ids=["fp8-tp2", "bf16-tp4"])
def group(request, ckpt_factory):
    """(checkpoint, TP1 engine, TPn engine): FP8 at TP2 (block scales sliced), bf16 at TP4."""
    kind, n = request.param
    path = ckpt_factory("qwen3_5", fp8=True, **FP8_DIMS)[0] if kind == "fp8" else ckpt_factory("qwen3_5", **HEADS)[0]
    tp1, tpn = pocketllm.LLM(path, **ENGINE), pocketllm.LLM(path, devices=cpu_ranks(n), **ENGINE)
    assert len(rank_processes(path, n)) == n - 1
    yield path, tp1, tpn
    tpn.group.close()
    wait_no_ranks(path, n)


# Same numbers as TP1.

def test_logits_match_tp1(group):
    _, tp1, tpn = group
    ids = PROMPTS[0] + PROMPTS[2]
    want = tp1.logits(ids)
    for chunk in (None, 5):             # one prefill; prefill chunks
        got = tpn.logits(ids, chunk)
        assert got.shape == want.shape
        assert relative_error(want, got) < REL_TOL, chunk
    assert relative_error(want[:6], tpn.logits(ids[:6], 1)) < REL_TOL   # the decode path at every position


def test_batched_greedy_tokens_match_tp1(group):
    _, tp1, tpn = group
    want = generate_together(tp1, PROMPTS, max_tokens=12, temperature=0, ignore_eos=True)
    got = generate_together(tpn, PROMPTS, max_tokens=12, temperature=0, ignore_eos=True)
    assert got == want
    assert tpn.stats()["running"] == 0 and tpn.stats()["kv_blocks_used"] == 0


def test_forked_choices_match_tp1(group):
    """n > 1 forks a prefilled prompt: the copied state must be copied on every rank."""
    _, tp1, tpn = group
    if "copy_state" not in vars(tpn.engine):
        pytest.skip("the engine has no copy_state hook yet (section 9): forks are not mirrored on worker ranks")
    want = tp1.generate(PROMPTS[2], n=3, max_tokens=10, temperature=0, ignore_eos=True)
    got = tpn.generate(PROMPTS[2], n=3, max_tokens=10, temperature=0, ignore_eos=True)
    assert [c["token_ids"] for c in got["choices"]] == [c["token_ids"] for c in want["choices"]]


def test_one_rank_group_is_tp1(bf16):
    """--devices cpu: the group machinery with nothing to reduce (on a GPU, TP1 through the NCCL path)."""
    tp1, one = pocketllm.LLM(bf16, **ENGINE), pocketllm.LLM(bf16, devices="cpu", **ENGINE)
    try:
        assert one.group.workers == {}
        assert torch.equal(tp1.logits(PROMPTS[0], 4), one.logits(PROMPTS[0], 4))
        assert generate_together(one, PROMPTS, max_tokens=6, temperature=0) == \
            generate_together(tp1, PROMPTS, max_tokens=6, temperature=0)
    finally:
        one.group.close()


# Refusals and failures while starting.

def test_non_dividing_degree_is_refused(bf16):
    """Heads (and the intermediate size, 200) do not divide by 3: refused at load, naming tensor and degree;
    the CLI exits with 2 like any checkpoint error."""
    cli = subprocess.Popen([sys.executable, str(ROOT / "pocketllm.py"), "--ckpt", str(bf16), "--devices",
                            cpu_ranks(3), "--port", "0"], stderr=subprocess.PIPE, text=True)
    _, stderr = cli.communicate(timeout=120)
    assert cli.returncode == 2
    assert re.search(r"pocketllm: error: tensor '.*'.*tensor-parallel degree 3", stderr), stderr
    assert rank_processes(bf16, 3, cli.pid) == []
    with pytest.raises(pocketllm.CheckpointError, match=r"tensor '.*'.*tensor-parallel degree 3"):
        pocketllm.LLM(bf16, devices=cpu_ranks(3), **ENGINE)
    wait_no_ranks(bf16, 3)


def test_fp8_slices_off_block_boundaries_are_refused(ckpt_factory):
    """intermediate 200 at TP2: 100 gate_proj rows per rank, not whole 128-row FP8 blocks."""
    path = ckpt_factory("qwen3_5", fp8=True, **HEADS)[0]
    with pytest.raises(pocketllm.CheckpointError, match=r"tensor '.*gate_proj.weight'.*128-element block.*"
                                                         r"tensor-parallel degree 2"):
        pocketllm.LLM(path, devices=cpu_ranks(2), **ENGINE)
    wait_no_ranks(path, 2)


@pytest.mark.parametrize("spec, message", [("cpu,", "empty entry"), ("cpu,0", "every rank must be a cpu"),
                                           ("cpu,tpu", "not a device")])
def test_bad_devices_are_refused(bf16, spec, message):
    with pytest.raises(pocketllm.PocketError, match=message):
        pocketllm.LLM(bf16, devices=spec, **ENGINE)


def test_rank_failing_to_load_ends_the_group(ckpt_factory, monkeypatch):
    """Rank 0 loads, then a shard file becomes unreadable before worker rank 1 reads it (workers spend
    seconds importing torch first): rank 1 fails, and LLM() raises a CheckpointError naming rank 1."""
    path = ckpt_factory("qwen3_5", seed=1, shards=2, **HEADS)[0]
    shard = path / "model-00002-of-00002.safetensors"

    class LoadThenTruncate(pocketllm.Model):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            shard.write_bytes(shard.read_bytes()[:100])

    monkeypatch.setattr(pocketllm, "Model", LoadThenTruncate)
    t0 = time.time()
    with pytest.raises(pocketllm.CheckpointError, match=r"rank 1 \(cpu\) failed: .*cannot read safetensors"):
        pocketllm.LLM(path, devices=cpu_ranks(2), **ENGINE)
    wait_no_ranks(path, 2)
    assert time.time() - t0 < 60


# A rank dying, and rank 0 being terminated.

def test_killed_worker_ends_the_group(group):
    """Last on each group: SIGKILL the last rank; the others stop within seconds and every call names it."""
    path, _, tpn = group
    victim = max(tpn.group.workers)
    os.kill(tpn.group.workers[victim].pid, signal.SIGKILL)
    assert wait_no_ranks(path, tpn.group.world) < 5.0
    with pytest.raises(pocketllm.PocketError, match=f"rank {victim} \\(cpu\\) was killed by SIGKILL"):
        tpn.logits([1, 2, 3])
    with pytest.raises(pocketllm.PocketError, match=f"rank {victim}"):
        tpn.generate([1, 2, 3], max_tokens=2)


def spawn_cli(ckpt) -> subprocess.Popen:
    """`python pocketllm.py --devices cpu,cpu` on a free port."""
    return subprocess.Popen([sys.executable, str(ROOT / "pocketllm.py"), "--ckpt", str(ckpt), "--devices",
                             cpu_ranks(2), "--port", "0", "--quiet", "--max-context", "256",
                             "--prefill-token-budget", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_serving(proc: subprocess.Popen, ckpt) -> str:
    """The server's URL, once it prints it: every rank has loaded by then."""
    line = proc.stdout.readline()
    assert "http://" in line, line + proc.stderr.read()
    assert len(rank_processes(ckpt, 2, proc.pid)) == 1
    return line.strip().split()[-1]


def test_cli_serves_tp1_answers_and_exits_when_a_rank_dies(bf16):
    proc = spawn_cli(bf16)
    try:
        tp1 = pocketllm.LLM(bf16, **ENGINE)
        url = wait_serving(proc, bf16)
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            assert r.status == 200
        prompts = ["The quick brown fox", "Bonjour, ça va? emoji and CJK text."]
        results = {}

        def complete(p):
            body = json.dumps({"model": tp1.model_name, "prompt": p, "max_tokens": 10, "temperature": 0}).encode()
            req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                results[p] = json.loads(r.read())["choices"][0]["text"]
        threads = [threading.Thread(target=complete, args=(p,)) for p in prompts]   # batched on the server
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == {p: tp1.generate(p, max_tokens=10, temperature=0)["text"] for p in prompts}
        (worker,) = rank_processes(bf16, 2, proc.pid)
        os.kill(worker, signal.SIGKILL)
        assert proc.wait(timeout=10) == 1
        assert "rank 1 (cpu) was killed by SIGKILL" in proc.stderr.read()
        assert wait_no_ranks(bf16, 2, proc.pid) < 5.0
    finally:
        proc.kill()
        proc.wait()


DRIVER = """
import sys, time
sys.path.insert(0, {root!r})
import pocketllm
llm = pocketllm.LLM({ckpt!r}, devices="cpu,cpu", quiet=True)
llm.generate([5, 6, 7], max_tokens=2, temperature=0)
print("ready", flush=True)
time.sleep(600)
"""


def test_rank0_terminated_or_killed_leaves_no_ranks(bf16):
    """SIGTERM to the CLI: rank 0 stops its ranks, then exits 0. SIGKILL to a rank 0 that embeds the library
    (no chance to clean up, like the OOM killer): its workers notice and exit. Both groups start together to
    share the start-up time."""
    cli = spawn_cli(bf16)
    embedded = subprocess.Popen([sys.executable, "-c", DRIVER.format(root=str(ROOT), ckpt=str(bf16))],
                                stdout=subprocess.PIPE, text=True)
    try:
        wait_serving(cli, bf16)
        assert embedded.stdout.readline().strip() == "ready"
        assert len(rank_processes(bf16, 2, embedded.pid)) == 1
        cli.send_signal(signal.SIGTERM)
        embedded.kill()
        assert cli.wait(timeout=15) == 0
        assert wait_no_ranks(bf16, 2, cli.pid) < 1.0          # stopped by rank 0 before it exited
        assert wait_no_ranks(bf16, 2, embedded.pid) < 5.0
    finally:
        for proc in (cli, embedded):
            proc.kill()
            proc.wait()


# GPU ranks (skipped without GPUs): NCCL from the backend that runs the ops.

def gpus(n: int):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} CUDA device(s)")


@pytest.mark.gpu
@gpus(1)
def test_gpu_tp1_through_nccl_equals_plain(bf16):
    """--devices 0: one rank, its all-reduce through NCCL (a sum over one rank), otherwise the plain engine."""
    plain = pocketllm.LLM(bf16, **dict(ENGINE, device="cuda:0"))
    one = pocketllm.LLM(bf16, **dict(ENGINE, device="cuda:0", devices="0"))
    try:
        assert torch.equal(plain.logits(PROMPTS[2], 4), one.logits(PROMPTS[2], 4))
        assert generate_together(one, PROMPTS, max_tokens=8, temperature=0) == \
            generate_together(plain, PROMPTS, max_tokens=8, temperature=0)
    finally:
        one.group.close()


@pytest.mark.gpu
@gpus(2)
def test_gpu_tp2_matches_tp1(bf16):
    """Two GPU ranks against one GPU: torch ops in float32 (torch.distributed's NCCL), so that the order of
    the sums is the only difference."""
    opts = dict(ENGINE, device="cuda:0", dtype="float32", backend="torch")
    tp1 = pocketllm.LLM(bf16, **opts)
    tp2 = pocketllm.LLM(bf16, **dict(opts, devices="0,1"))
    try:
        assert relative_error(tp1.logits(PROMPTS[2]), tp2.logits(PROMPTS[2], 5)) < REL_TOL
        assert generate_together(tp2, PROMPTS, max_tokens=8, temperature=0, ignore_eos=True) == \
            generate_together(tp1, PROMPTS, max_tokens=8, temperature=0, ignore_eos=True)
    finally:
        tp2.group.close()
    wait_no_ranks(bf16, 2)
