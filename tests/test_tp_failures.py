"""A failing rank never hangs the group (CPU ranks, gloo): a worker killed or hung mid-step, or before it joins
the collectives, makes the embedding process raise a PocketError naming it within the bound
(--collective-timeout, --collective-warmup-timeout), marks the LLM dead (what /health reports) and leaves no
rank process behind (checked in /proc). The NCCL variant is tests/gpu/gpu_check.py's `nccl` step."""

import os
import signal
import subprocess
import time

import pytest
import torch

import pocketllm
from test_tp import ENGINE, HEADS, cpu_ranks, rank_processes, wait_no_ranks

STEADY_S, WARMUP_S = 3.0, 20.0        # short bounds, so a hang shows within a test's time
SLACK_S = 8.0                         # a busy 2-core machine: the poll, the kill and the engine's thread
SAMPLING = dict(max_tokens=200, temperature=1.0, top_p=0.9, presence_penalty=0.5, repetition_penalty=1.1,
                seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(ckpt_factory):
    return ckpt_factory("qwen3_5", seed=7, **HEADS)[0]


def start(ckpt, **bounds):
    options = dict(ENGINE, collective_timeout=STEADY_S, collective_warmup_timeout=WARMUP_S) | bounds
    return pocketllm.LLM(ckpt, devices=cpu_ranks(2), **options)


def generate_until(llm, act, after_tokens: int = 8) -> tuple[float, Exception | None]:
    """Stream a long sampled generation; after `after_tokens` tokens (past the warm-up steps) call act().
    Returns (seconds from act() to the stream's end, the exception it ended with)."""
    stream = llm.submit(llm.tokenizer.encode("a long story"), pocketllm.SamplingParams(**SAMPLING))
    seen, acted = 0, None
    try:
        for ev in stream:
            seen += len(ev.token_ids)
            if acted is None and seen >= after_tokens:
                act()
                acted = time.monotonic()
    except pocketllm.PocketError as e:
        assert acted is not None, f"failed before the fault: {e}"
        return time.monotonic() - acted, e
    return time.monotonic() - (acted or time.monotonic()), None


def test_worker_killed_mid_generation_raises_naming_it(ckpt):
    llm = start(ckpt)
    try:
        (worker,) = rank_processes(ckpt, 2)
        elapsed, error = generate_until(llm, lambda: os.kill(worker, signal.SIGKILL))
        assert error is not None, "the generation finished although rank 1 was killed in it"
        assert "rank 1 (cpu) was killed by SIGKILL" in str(error)
        assert elapsed < STEADY_S + SLACK_S              # gloo: the dead peer's sockets close at once
        assert "rank 1 (cpu) was killed by SIGKILL" in llm.dead_reason
        with pytest.raises(pocketllm.PocketError, match="rank 1"):
            llm.generate([1, 2, 3], max_tokens=2)
        wait_no_ranks(ckpt, 2)
    finally:
        llm.close()


def test_worker_hung_mid_generation_ends_the_group_at_the_bound(ckpt):
    """SIGSTOP: the worker is alive but never answers. Rank 0's all-reduce gives up at --collective-timeout,
    the group stops (the stopped worker is killed) and the error names the bound."""
    llm = start(ckpt)
    try:
        (worker,) = rank_processes(ckpt, 2)
        elapsed, error = generate_until(llm, lambda: os.kill(worker, signal.SIGSTOP))
        assert error is not None, "the generation finished although rank 1 was stopped in it"
        assert "took more than 3 s (--collective-timeout): one of the other ranks is hung" in str(error)
        assert STEADY_S * 0.9 <= elapsed < STEADY_S + SLACK_S
        assert "--collective-timeout" in llm.dead_reason
        wait_no_ranks(ckpt, 2)
    finally:
        llm.close()


def test_the_first_failure_names_the_end(ckpt):
    """Rank 0 ends a hung group by killing the stopped worker; the watcher then sees a rank killed by SIGKILL.
    The group's reason, and what the LLM is told, stay the first failure's (the hang), told once."""
    opts = pocketllm.EngineOptions(devices=cpu_ranks(2), backend="torch", **ENGINE)
    group = pocketllm.RankGroup(ckpt, opts, torch.float32, torch.float32)
    told = []
    group.on_death = told.append
    try:
        group.workers = {1: subprocess.Popen(["sleep", "60"])}
        group._fail("", "rank 0 (cpu): an all-reduce took more than 3 s (--collective-timeout)")
        assert group.workers[1].returncode == -signal.SIGKILL                  # the hung rank was killed
        group._fail(*group._rank_error(1))                                      # what the watcher then sees
        assert "--collective-timeout" in group.dead_reason and len(told) == 1 and "--collective" in told[0]
    finally:
        group.close()


def kill_before_joining(monkeypatch, ckpt, sig: signal.Signals) -> list[float]:
    """Rank 0's Comm first sends `sig` to worker 1, which has loaded and said so but is not yet connected
    (it may be connecting): a rank lost during the collectives' initialisation. Returns [time of the signal]."""
    real, when = pocketllm.Comm, []

    def comm_after_signal(*args, **kw):
        (worker,) = rank_processes(ckpt, 2)
        os.kill(worker, sig)
        when.append(time.monotonic())
        return real(*args, **kw)
    monkeypatch.setattr(pocketllm, "Comm", comm_after_signal)
    return when


def test_worker_killed_before_joining_fails_the_start_at_once(ckpt, monkeypatch):
    when = kill_before_joining(monkeypatch, ckpt, signal.SIGKILL)
    with pytest.raises(pocketllm.PocketError, match=r"rank 1 \(cpu\) was killed by SIGKILL"):
        start(ckpt, collective_warmup_timeout=120.0)
    assert time.monotonic() - when[0] < SLACK_S          # the watcher's, long before the 120 s bound
    wait_no_ranks(ckpt, 2)


def test_worker_hung_before_joining_fails_the_start_at_the_bound(ckpt, monkeypatch):
    when = kill_before_joining(monkeypatch, ckpt, signal.SIGSTOP)
    with pytest.raises(pocketllm.PocketError, match=r"connecting to the other ranks took more than 4 s "
                                                    r"\(--collective-warmup-timeout\)"):
        start(ckpt, collective_warmup_timeout=4.0)
    assert 4.0 * 0.9 <= time.monotonic() - when[0] < 4.0 + SLACK_S
    wait_no_ranks(ckpt, 2)


@pytest.mark.parametrize("flag", ["collective_timeout", "collective_warmup_timeout"])
def test_bounds_must_be_positive(ckpt, flag):
    with pytest.raises(pocketllm.PocketError, match=f"--{flag.replace('_', '-')} must be > 0 seconds"):
        start(ckpt, **{flag: 0})
    assert rank_processes(ckpt, 2) == []
