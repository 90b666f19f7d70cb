"""Decode by launch-list replay (LaunchRecording, DecodeGraphs in section 8) on the native library's CPU build.

A bucket's first decode step runs while NativeLibrary.call records every native call; later steps of that bucket
copy their padded batch into the recording's static payload and re-issue the recorded calls. Checked here: the
two native ops that keep a decode forward native (pl_zero, pl_copy_2d, against torch with poisoned outputs), the
recording itself (replay rewrites the outputs, a torch kernel refuses it), and the engine: replay == eager
(--enforce-eager) token for token for requests with the sampling users send, over several buckets, with no KV
block or state slot leaked; a refused recording stays eager and still correct. The CUDA-graph half of
DecodeGraphs needs a GPU (tests/gpu/gpu_check.py).
"""

import os

import pytest
import torch

import pocketllm
from conftest import drain, native_cpu_ops_or_skip

BS = 16


@pytest.fixture(scope="module")
def ops():
    return native_cpu_ops_or_skip()


# ---- The ops that keep a decode forward native ----

@pytest.mark.parametrize("nbytes, offset", [(4096, 0), (100, 0), (77, 3), (0, 0)])
def test_zero(ops, nbytes, offset):
    buf = torch.full((nbytes + offset + 5,), 0xAB, dtype=torch.uint8)      # poisoned, with guards
    ops.lib.call("pl_zero", buf.data_ptr() + offset, nbytes, 0)
    want = torch.full_like(buf, 0xAB)
    want[offset:offset + nbytes] = 0
    assert torch.equal(buf, want)


@pytest.mark.parametrize("rows, row_elems, src_stride, dst_stride, dtype", [
    (3, 64, 96, 64, torch.float32),     # 16-byte words
    (5, 7, 11, 9, torch.float16),       # bytes, gaps in the destination stay untouched
    (1, 128, 128, 128, torch.float32),
    (300, 4, 12, 4, torch.int32),
])
def test_copy_2d(ops, rows, row_elems, src_stride, dst_stride, dtype):
    src = torch.arange(rows * src_stride).to(dtype).view(rows, src_stride)
    dst = torch.full((rows, dst_stride), float("nan") if dtype.is_floating_point else -1, dtype=dtype)
    size = src.element_size()
    ops.lib.call("pl_copy_2d", src.data_ptr(), src_stride * size, dst.data_ptr(), dst_stride * size, rows,
                 row_elems * size, 0)
    assert torch.equal(dst[:, :row_elems], src[:, :row_elems])
    rest = dst[:, row_elems:]
    assert (rest.isnan() if dtype.is_floating_point else rest == -1).all()


def test_copy_2d_refuses_overlapping_rows(ops):
    t = torch.zeros(4, 8)
    with pytest.raises(pocketllm.NativeError, match="row strides"):
        ops.lib.call("pl_copy_2d", t.data_ptr(), 8, t.data_ptr(), 32, 4, 32, 0)


def test_as_packs_strided_rows_natively(ops):
    qkv = torch.randn(5, 3 * 64)                                                 # (T, C) a projection's output
    k = qkv[:, 64:128].unflatten(1, (2, 32))                                     # (T, 2, 32) strided rows
    before = ops.launch_count()
    packed = ops._as(k)
    assert ops.launch_count() == before + 1 and packed.is_contiguous() and torch.equal(packed, k)
    assert ops._as(qkv) is qkv                                                   # contiguous: itself, no launch
    z = ops.zeros((3, 5), torch.float32, "cpu")
    assert torch.equal(z, torch.zeros(3, 5))


def test_recording_replays_and_refuses_torch_kernels(ops):
    x = torch.randn(4, 16)
    with pocketllm.LaunchRecording(ops.lib) as rec:
        out = ops._as(x[:, 4:12])                                                # pl_copy_2d into a new tensor
        zeros = ops.zeros((4, 8), torch.float32, "cpu")
        x.view(8, 8)                                                             # a view: no kernel
    assert rec.refused is None and len(rec.calls) == 2
    x.copy_(torch.randn(4, 16))                                                  # new input, same address
    out.fill_(float("nan")), zeros.fill_(float("nan"))
    rec.replay()
    assert torch.equal(out, x[:, 4:12]) and torch.equal(zeros, torch.zeros(4, 8))
    with pocketllm.LaunchRecording(ops.lib) as refused:
        ops.zeros((2,), torch.float32, "cpu")
        x + 1                                                                    # a torch kernel
    assert refused.refused == "add" and len(refused.calls) == 1
    assert getattr(ops.lib.recording, "calls", None) is None                     # recording over


# ---- The engine: replay == eager ----

PROMPTS = [[5, 6, 7, 8], list(range(20, 39)), [100, 3], [7] * 9, [42, 43, 44]]
SAMPLING = [dict(temperature=1.0, seed=1, max_tokens=14, logprobs=2),
            dict(temperature=1.0, top_p=0.9, seed=2, max_tokens=11, n=2),
            dict(temperature=0.8, top_k=20, presence_penalty=0.5, frequency_penalty=0.3, seed=3, max_tokens=12),
            dict(temperature=1.0, repetition_penalty=1.2, min_p=0.05, seed=4, max_tokens=5),
            dict(temperature=0.0, max_tokens=3)]


def native_llm(**options):
    os.environ["POCKETLLM_NATIVE_CPU"] = "1"
    try:
        return pocketllm.LLM(None, backend="native", quiet=True, max_context=96, max_batch_size=6, kv_block_size=BS,
                             dtype="float32", speculative_tokens=0, prefix_cache=False, **options)
    finally:
        del os.environ["POCKETLLM_NATIVE_CPU"]


@pytest.fixture(scope="module")
def llms(ops):
    replayed, eager = native_llm(), native_llm(enforce_eager=True)
    yield replayed, eager
    replayed.close(), eager.close()


@pytest.fixture(scope="module")
def eager_tokens(llms):
    """The --enforce-eager engine's tokens for PROMPTS (run once: eager is deterministic)."""
    assert llms[1].engine.graphs is None
    return generate(llms[1].engine)


def generate(engine) -> tuple[list[list[list[int]]], list[float]]:
    """Every PROMPTS request at once, stepped on this thread until idle: each request's choices' tokens, and the
    logprobs (chosen and top-2) that the first request asked for, flattened."""
    requests = [pocketllm.Request(f"r{i}", p, pocketllm.SamplingParams(ignore_eos=True, **s), default_seed=i)
                for i, (p, s) in enumerate(zip(PROMPTS, SAMPLING))]
    for req in requests:
        engine.add(req)
    while engine.has_work():
        engine.step()
    out, logprobs = [], []
    for req in requests:
        tokens, entries = drain(req)
        for chosen, top in entries:
            logprobs += [chosen] + [lp for _, lp in top]
        out.append(tokens)
    assert engine.blocks.total == len(engine.blocks.free) and engine.slots.total == len(engine.slots.free)
    assert len(logprobs) == 14 * 3
    return out, logprobs


def assert_same(got, want):
    """Tokens equal; logprobs within fp32 rounding (a padded bucket may split its sums differently)."""
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], rel=1e-4, abs=1e-5)


def test_replay_equals_eager(llms, eager_tokens):
    graphs = llms[0].engine.graphs
    assert graphs is not None and not graphs.use_graphs                          # launch lists on the CPU
    got = generate(llms[0].engine)
    assert_same(got, eager_tokens)
    assert [len(c) for r in got[0] for c in r] == [14, 11, 11, 12, 5, 3]
    # 6, 5, 4, 3, 2, 1 sequences decoding: buckets 6, 6, 4, 4, 2, 1; each recorded once, then replayed
    assert not graphs.refused and sorted(graphs.steps) == [1, 2, 4, 6], (graphs.refused, list(graphs.steps))
    assert graphs.replayed >= 8


def test_the_sampler_runs_from_the_replayed_payload(llms):
    """Requests without logprobs are sampled from the replayed step's payload (DecodeGraphs with the sampler:
    Sampler.sample_static after the launch list; on CUDA inside the graph): the eager engine's tokens."""
    def run(engine):
        sampling = SAMPLING[1:] + [dict(temperature=1.0, seed=5, max_tokens=9, min_tokens=4, stop_token_ids=[11, 13],
                                        logit_bias={11: 3.0, 13: 3.0, 30: -2.0})]
        requests = [pocketllm.Request(f"s{i}", p, pocketllm.SamplingParams(ignore_eos=True, **s), default_seed=i)
                    for i, (p, s) in enumerate(zip(PROMPTS[1:] + [[9, 8, 7]], sampling))]
        for req in requests:
            engine.add(req)
        while engine.has_work():
            engine.step()
        return [drain(req)[0] for req in requests]
    graphs = llms[0].engine.graphs
    sampled, replayed = graphs.sampled, graphs.replayed
    assert run(llms[0].engine) == run(llms[1].engine)
    assert graphs.sampled - sampled >= 6 and graphs.replayed - replayed >= 6


def test_refused_recording_stays_eager(llms, eager_tokens, monkeypatch):
    engine = llms[0].engine
    fresh = pocketllm.DecodeGraphs(engine.model, engine.cache, 6, 96, BS)
    monkeypatch.setattr(engine, "graphs", fresh)
    # a torch op in the decode forward: the residual stream's zeros made by torch
    monkeypatch.setattr(engine.model.ops, "zeros", lambda shape, dtype, device: torch.zeros(shape, dtype=dtype))
    assert_same(generate(engine), eager_tokens)
    assert sorted(fresh.refused) == [1, 2, 4, 6] and not fresh.steps and fresh.replayed == 0
    assert set(fresh.refused.values()) <= {"zeros", "zero_", "fill_"}, fresh.refused
