"""Tensor parallelism on CPU ranks (gloo): TP2 and TP4 against TP1 (the single-process engine, itself tested
against transformers in test_reference.py), and the group's lifecycle: every way a group ends leaves no rank
process behind (checked in /proc).

Starting a group costs one Python + torch import per worker rank, so groups are shared across tests and the
destructive tests run last on a group that is done anyway."""

import json
import os
import re
import signal
import socket
import struct
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
# The native backend's CPU test build (fibers under ASan) costs about 0.2 s of CPU per token a forward reads, prefill
# or decode, so its tests prefill shorter prompts: still chunked under the 8-token budget, still finishing at
# different steps (several buckets), and prefill is eager in both engines anyway.
NATIVE_PROMPTS = [p[:8] for p in PROMPTS]


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


def use_native_cpu_build(monkeypatch):
    """Run the native backend on the library's CPU test build (workers inherit the environment)."""
    import build
    try:
        build.build(cpu=True, quiet=True)
    except build.BuildError as e:
        pytest.skip(f"the native CPU test build does not build here: {str(e).splitlines()[0]}")
    monkeypatch.setenv("POCKETLLM_NATIVE_CPU", "1")
    monkeypatch.setenv("ASAN_OPTIONS", "detect_leaks=0:verify_asan_link_order=0")


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


# Vocab-parallel embedding and lm_head: each rank holds ceil(V / n) rows of both (the last rank the rest); the
# lookup and the logits come back whole through the all-reduce. V = 601 divides by neither 2 nor 4.

ODD_VOCAB = 601


@pytest.mark.parametrize("model_type, fp8, n, dims", [
    ("qwen3_5", False, 4, HEADS), ("qwen3_5", True, 2, FP8_DIMS),
    ("qwen3", False, 2, dict(num_key_value_heads=4, tie_word_embeddings=True)),
    ("qwen3", True, 2, dict(FP8_DIMS, num_key_value_heads=4, num_attention_heads=4, head_dim=64))],
    ids=["qwen3_5-bf16-tp4", "qwen3_5-fp8-tp2", "qwen3-tied-bf16-tp2", "qwen3-fp8-tp2"])
def test_vocab_parallel_slices_match_tp1(ckpt_factory, model_type, fp8, n, dims):
    path = ckpt_factory(model_type, fp8=fp8, vocab_size=ODD_VOCAB, **dims)[0]
    tp1, tpn = pocketllm.LLM(path, **ENGINE), pocketllm.LLM(path, devices=cpu_ranks(n), **ENGINE)
    try:
        per = -(-ODD_VOCAB // n)
        want = [(r * per, min((r + 1) * per, ODD_VOCAB)) for r in range(n)]
        shards = tpn.group.call("vocab_shards")                     # what each rank loaded, gathered to rank 0
        assert [(a, b) for a, b, _, _ in shards] == want
        assert all(emb == head == b - a for a, b, emb, head in shards) and want[-1][1] - want[-1][0] < per
        assert tpn.model.embed_tokens.shape == (per, tp1.config.hidden_size) and tpn.model.lm_head.shape[0] == per
        ids = PROMPTS[0] + PROMPTS[2] + [ODD_VOCAB - 1, 0, per - 1, per]   # ids at the slices' edges
        want_logits = tp1.logits(ids)
        assert want_logits.shape == (len(ids), ODD_VOCAB)
        assert relative_error(want_logits, tpn.logits(ids, 5)) < REL_TOL
        assert relative_error(want_logits[:4], tpn.logits(ids[:4], 1)) < REL_TOL   # decode steps
        prompts = PROMPTS + [[ODD_VOCAB - 1, per, per - 1, 1]]
        assert generate_together(tpn, prompts, max_tokens=8, temperature=0, ignore_eos=True) == \
            generate_together(tp1, prompts, max_tokens=8, temperature=0, ignore_eos=True)
        sampled = dict(max_tokens=8, temperature=1.0, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.3,
                       repetition_penalty=1.1, seed=7, ignore_eos=True)
        assert generate_together(tpn, prompts, **sampled) == generate_together(tp1, prompts, **sampled)
    finally:
        tpn.group.close()
        tp1.close()
    wait_no_ranks(path, n)


def test_vocab_parallel_on_the_native_backend_cuts_whole_blocks(ckpt_factory, monkeypatch):
    """The native backend's vocabulary slices fall on 128-row boundaries (384 + 217 rows of 601 at TP2); logits
    and greedy tokens equal the native TP1's. Run on the native library's CPU test build."""
    use_native_cpu_build(monkeypatch)
    path = ckpt_factory("qwen3_5", fp8=True, vocab_size=ODD_VOCAB, **FP8_DIMS)[0]
    tp1 = pocketllm.LLM(path, backend="native", **ENGINE)
    tp2 = pocketllm.LLM(path, devices=cpu_ranks(2), backend="native", **ENGINE)
    try:
        assert tp2.group.call("vocab_shards") == [(0, 384, 384, 384), (384, ODD_VOCAB, 217, 217)]
        ids = PROMPTS[0] + [ODD_VOCAB - 1, 383, 384]
        assert relative_error(tp1.logits(ids), tp2.logits(ids, 5)) < REL_TOL
        assert generate_together(tp2, NATIVE_PROMPTS, max_tokens=6, temperature=0, ignore_eos=True) == \
            generate_together(tp1, NATIVE_PROMPTS, max_tokens=6, temperature=0, ignore_eos=True)
    finally:
        tp2.group.close()
        tp1.close()
    wait_no_ranks(path, 2)


def test_native_decode_replay_across_ranks_equals_eager(ckpt_factory, monkeypatch):
    """Decode by launch-list replay at TP2 (DecodeGraphs through RankRunner.decode; the all-reduces in every
    rank's list: gloo's between CPU ranks as host steps): the same tokens as --enforce-eager for seeded
    temperature-1 sampling with penalties over several batch-size buckets, every rank recording and replaying its
    own forward (none refused: the vocab-parallel head is native too), and nothing leaked."""
    use_native_cpu_build(monkeypatch)
    path = ckpt_factory("qwen3_5", fp8=True, vocab_size=ODD_VOCAB, **FP8_DIMS)[0]
    options = dict(ENGINE, devices=cpu_ranks(2), backend="native", speculative_tokens=0, prefix_cache=False)
    replayed, eager = pocketllm.LLM(path, **options), pocketllm.LLM(path, enforce_eager=True, **options)
    sampling = dict(temperature=1.0, seed=7, max_tokens=9, presence_penalty=0.4, repetition_penalty=1.1,
                    ignore_eos=True)
    prompts = NATIVE_PROMPTS + [[3, 1, 4, 1, 5]]
    try:
        assert eager.engine.graphs is None and replayed.engine.graphs.call is not None
        want = generate_together(eager, prompts, **sampling)
        assert generate_together(replayed, prompts, **sampling) == want
        assert generate_together(replayed, prompts[:3], **dict(sampling, seed=8, max_tokens=5)) == \
            generate_together(eager, prompts[:3], **dict(sampling, seed=8, max_tokens=5))
        stats = replayed.group.call("replay_stats")
        assert len(stats) == 2 and all(recorded >= 2 and refused == 0 and steps >= 8
                                       for recorded, refused, steps in stats), stats
        for llm in (replayed, eager):
            blocks, slots = llm.engine.blocks, llm.engine.slots
            assert len(blocks.free) == blocks.total and len(slots.free) == slots.total
    finally:
        replayed.group.close()
        eager.group.close()
    wait_no_ranks(path, 2)


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


def test_fp8_slices_off_block_boundaries_are_refused_by_the_native_backend(ckpt_factory, monkeypatch):
    """intermediate 200 at TP2: 100 gate_proj rows per rank, not whole 128-row FP8 blocks, which the native
    kernels need (the torch backend splits anywhere: test_ragged_fp8_split_matches_tp1). Refused at load,
    naming the tensor and the degree; run on the native library's CPU test build."""
    use_native_cpu_build(monkeypatch)
    path = ckpt_factory("qwen3_5", fp8=True, **HEADS)[0]
    with pytest.raises(pocketllm.CheckpointError, match=r"tensor '.*gate_proj.weight'.*128-element block.*"
                                                         r"tensor-parallel degree 2"):
        pocketllm.LLM(path, devices=cpu_ranks(2), backend="native", **ENGINE)
    wait_no_ranks(path, 2)


def test_ragged_fp8_split_matches_tp1(ckpt_factory):
    """intermediate 200 at TP2 on the torch backend: each rank keeps the scales that cover its 100 rows (and
    down_proj's 100 columns), on a 4-element grid inside the stored 128-blocks; logits and greedy tokens
    equal TP1's. FP8 kept FP8 (--fp8-dense-memory 0): the scales are what this checks."""
    path = ckpt_factory("qwen3_5", fp8=True, **HEADS)[0]
    tp1 = pocketllm.LLM(path, fp8_dense_memory=0, **ENGINE)
    tp2 = pocketllm.LLM(path, devices=cpu_ranks(2), fp8_dense_memory=0, **ENGINE)
    try:
        gate = tp2.model.layers[0].mlp.gate_proj
        assert gate.shape[0] == 100 and gate.block[0] == 4 and gate.scale.shape[0] == 25
        ids = PROMPTS[0] + PROMPTS[2]
        assert relative_error(tp1.logits(ids), tp2.logits(ids, 5)) < REL_TOL
        assert generate_together(tp2, PROMPTS, max_tokens=8, temperature=0, ignore_eos=True) == \
            generate_together(tp1, PROMPTS, max_tokens=8, temperature=0, ignore_eos=True)
    finally:
        tp2.group.close()
    wait_no_ranks(path, 2)


def test_pocket_tiny_runs_on_two_cpu_ranks():
    """The bundled model's MLP (384 rows: 192 per rank, half a block) and GDN heads (64 rows) split raggedly;
    `--devices cpu,cpu` gives one rank's greedy chat answer, tool call included."""
    messages = [{"role": "user", "content": "What's the weather in Paris for the next 3 days?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                             "required": ["city"]}}}]
    one = pocketllm.LLM(None, quiet=True, max_context=512, max_batch_size=2)
    two = pocketllm.LLM(None, devices=cpu_ranks(2), quiet=True, max_context=512, max_batch_size=2)
    try:
        want, got = (llm.chat(messages, tools=tools, temperature=0, max_tokens=96, logprobs=True)["choices"][0]
                     for llm in (one, two))
        assert [t["token"] for t in got["logprobs"]["content"]] == [t["token"] for t in want["logprobs"]["content"]]
        for message in (want["message"], got["message"]):     # call ids are random per response
            for call in message.get("tool_calls") or []:
                call.pop("id")
        assert got["message"] == want["message"]
        assert want["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    finally:
        two.group.close()


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


# The rendezvous: loopback only, and only with the group's secret.

def socket_inode(pid: int, fd: int) -> str:
    return os.readlink(f"/proc/{pid}/fd/{fd}")[len("socket:["):-1]


def listening_sockets(pid: int) -> dict[str, str]:
    """{socket inode: local address} of pid's listening TCP sockets (what `ss -ltnp` shows), from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = {}
    for table, family in (("tcp", "v4"), ("tcp6", "v6")):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:             # state 0A: LISTEN
                addr, port = cols[1].split(":")
                raw = bytes.fromhex(addr)
                if family == "v4":
                    host = ".".join(str(b) for b in raw[::-1])
                else:                                             # four little-endian 32-bit words
                    host = ":".join(raw[i:i + 4][::-1].hex() for i in range(0, 16, 4))
                found[cols[9]] = f"{host}:{int(port, 16)}"
    return found


def is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0]
    return host.startswith("127.") or host in ("00000000:00000000:00000000:00000001",
                                               "00000000:00000000:ffff0000:0100007f")


def test_rendezvous_is_loopback_only_and_needs_the_secret(bf16, monkeypatch):
    """Three connections reach rank 0's rendezvous port before the real worker: one answers the challenge
    without the secret, one claims rank 1 with another group's secret, one never answers. Each is closed
    and counted; the real worker still joins and the group computes TP1's logits. Every listening socket of
    every rank is on loopback, and the secret is on no worker's command line or environment."""
    monkeypatch.setattr(pocketllm, "HANDSHAKE_TIMEOUT_S", 2.0)
    opts = pocketllm.EngineOptions(devices="cpu,cpu", backend="torch", **ENGINE)
    group = pocketllm.RankGroup(bf16, opts, torch.float32, torch.float32)
    try:
        assert group.listener.getsockname()[0] == "127.0.0.1"
        rendezvous = socket_inode(os.getpid(), group.listener.fileno())
        assert listening_sockets(os.getpid())[rendezvous] == f"127.0.0.1:{group.port}"
        assert (group.rendezvous_dir.stat().st_mode & 0o077) == 0             # the store: this user only
        guess, silent = (socket.create_connection(("127.0.0.1", group.port)) for _ in range(2))
        errors = []
        impostor = threading.Thread(target=lambda: errors.append(pytest.raises(
            (ConnectionError, OSError), pocketllm.join_group, group.port, 1, os.urandom(32), "pocketllm")))
        starting = threading.Thread(target=group.start, args=(bf16,))
        starting.start()
        impostor.start()
        guess.settimeout(30)
        nonce = guess.recv(16)
        assert len(nonce) == 16
        guess.sendall(struct.pack("!i", 1) + bytes(32) + os.urandom(16))   # rank 1, a MAC made without it
        assert guess.recv(1) == b""                                         # closed, nothing told
        silent.settimeout(30)
        assert silent.recv(16) and silent.recv(1) == b""                    # closed after the timeout
        impostor.join(60)
        assert len(errors) == 1
        starting.join(120)
        assert not starting.is_alive() and group.dead_reason is None and list(group.channels) == [1]
        assert group.refused == 3

        worker = group.workers[1].pid
        for where in ("cmdline", "environ"):
            assert group.secret.hex().encode() not in Path(f"/proc/{worker}/{where}").read_bytes()
        ours, theirs = listening_sockets(os.getpid()), listening_sockets(worker)
        assert theirs, "gloo's listener should show"
        addresses = list(ours.values()) + list(theirs.values())
        assert all(map(is_loopback, addresses)), addresses
        assert rendezvous not in ours                                       # everyone joined: not listening

        tp1 = pocketllm.LLM(bf16, backend="torch", **ENGINE)
        assert relative_error(tp1.logits(PROMPTS[0]), group.logits(PROMPTS[0], 5)) < REL_TOL
    finally:
        group.close()
    assert not group.rendezvous_dir.exists()
    wait_no_ranks(bf16, 2)


def test_worker_without_the_secret_fails_the_start_naming_its_rank(bf16):
    """Rank 0 checks against a secret other than the one its worker was given: the worker is refused, exits,
    and the start fails with one line naming it; no rank is left behind."""
    class Forgetful(pocketllm.RankGroup):
        def _handshake(self, sock):
            self.secret = os.urandom(32)
            super()._handshake(sock)

    group = Forgetful(bf16, pocketllm.EngineOptions(devices="cpu,cpu", backend="torch", **ENGINE), torch.float32,
                      torch.float32)
    try:
        with pytest.raises(pocketllm.PocketError, match=r"rank 1 \(cpu\) exited with code 1"):
            group.start(bf16)
        assert group.refused == 1 and group.channels == {}
    finally:
        group.close()
    wait_no_ranks(bf16, 2)


def test_worker_refuses_an_impostor_rank0():
    """A process holding the port a worker was told (rank 0 gone, say) cannot prove the secret: the worker
    refuses it instead of running its calls."""
    server = socket.create_server(("127.0.0.1", 0))

    def impostor():
        conn, _ = server.accept()
        conn.sendall(os.urandom(16))
        conn.recv(4 + 32 + 16)
        conn.sendall(os.urandom(32))
        conn.close()
    threading.Thread(target=impostor, daemon=True).start()
    with pytest.raises(pocketllm.PocketError, match="not this group's rank 0"):
        pocketllm.join_group(server.getsockname()[1], 1, os.urandom(32), "pocketllm")
    server.close()


def test_calls_are_runner_methods_only():
    """group.call runs RankRunner's public methods; any other name is refused before anything is sent."""
    assert all(pocketllm.RankRunner.is_call(m) for m in ("run", "set_scratch", "copy_state"))
    assert not any(pocketllm.RankRunner.is_call(m) for m in ("_move", "__init__", "is_call", "stop", "forward"))


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
