"""The decode step as a CUDA graph (DecodeGraphs, section 8): what can be checked without a GPU.

A graph runs a fixed batch size, so a step of B sequences is padded to the next bucket with rows that must
change nothing anyone reads. Here the padded batch runs eagerly on the native library's CPU build (the same
kernels the graph replays) against the unpadded one: the real rows' logits and every KV block and real state
slot must come out equal, and the padding may write only the free state slots it was given. The capture and
replay themselves need a GPU: tests/gpu/gpu_check.py checks graph replay == eager, token for token.
"""

import pytest
import torch

import pocketllm
from conftest import native_cpu_ops_or_skip

BS = 16


@pytest.fixture(scope="module")
def native_llm():
    native_cpu_ops_or_skip()
    import os
    os.environ["POCKETLLM_NATIVE_CPU"] = "1"
    try:
        llm = pocketllm.LLM(None, backend="native", quiet=True, max_context=96, max_batch_size=6,
                            kv_block_size=BS, dtype="float16", speculative_tokens=0)   # graphs: plain decode
    finally:
        del os.environ["POCKETLLM_NATIVE_CPU"]
    yield llm
    llm.close()


def decode_plan(engine, prompts):
    """Admit the prompts and step until every sequence decodes: the next step's plan (one row each)."""
    for i, prompt in enumerate(prompts):
        engine.add(pocketllm.Request(f"r{i}", prompt, pocketllm.SamplingParams(max_tokens=40, temperature=1.0,
                                                                              seed=i, ignore_eos=True), i))
    for _ in range(20):
        engine.step()
        if all(s.output_ids for s in engine.scheduler.running) and len(engine.scheduler.running) == len(prompts):
            break
    plan = engine.scheduler.schedule()
    assert len(plan) == len(prompts) and all(p.count == 1 and p.start > 0 for p in plan)
    return plan


def clone_cache(cache):
    return pocketllm.Cache(*({i: t.clone() for i, t in part.items()} for part in (cache.k, cache.v, cache.conv,
                                                                               cache.ssm)))


def test_padding_rows_change_nothing_read(native_llm):
    engine = native_llm.engine
    assert not engine.graphs.use_graphs                        # graphs are CUDA only (here: launch lists)
    plan = decode_plan(engine, [[5, 6, 7, 8], list(range(20, 39)), [100, 3]])
    free = list(engine.slots.free)
    real_slots = {p.seq.slot for p in plan}
    pad_to, width = 6, -(-96 // BS)
    assert len(free) >= pad_to - len(plan) and not real_slots & set(free)

    eager_cache, padded_cache = clone_cache(engine.cache), clone_cache(engine.cache)
    with torch.no_grad():
        want = engine.model.forward(pocketllm.make_batch(plan, BS, "cpu"), eager_cache)            # (3, V)
        fields, w = pocketllm.batch_fields(plan, BS, pad_to, width, free)
        batch = pocketllm.batch_view(pocketllm.pack_fields(fields), [len(f) for f in fields], pad_to, w)
        got = engine.model.forward(batch, padded_cache)                                            # (6, V)
    assert w == width and batch.block_tables.shape == (pad_to, width) and batch.is_decode
    assert batch.slot_mapping[len(plan):].tolist() == [-1] * (pad_to - len(plan))
    pad_slots = set(batch.state_slots[len(plan):].tolist())
    assert pad_slots == set(free[:pad_to - len(plan)])

    assert got.shape == (pad_to, want.shape[1]) and torch.isfinite(got).all()
    err = (got[:len(plan)] - want).abs().max() / want.abs().max()
    assert err < 1e-3, err                                      # fp16 activations; splits may differ with T
    assert torch.equal(got[:len(plan)].argmax(-1), want.argmax(-1))
    for i in eager_cache.k:                                     # padding wrote no KV anywhere
        assert torch.equal(eager_cache.k[i], padded_cache.k[i]) and torch.equal(eager_cache.v[i], padded_cache.v[i])
    for part in ("conv", "ssm"):                                # real slots as eager; padding only its own
        for i, t in getattr(eager_cache, part).items():
            other = getattr(padded_cache, part)[i]
            for slot in range(t.shape[0]):
                if slot in pad_slots:
                    continue
                close = torch.allclose(t[slot].float(), other[slot].float(), rtol=1e-3, atol=1e-4)
                assert close, (part, i, slot)
            before = getattr(engine.cache, part)[i]
            assert all(not torch.equal(before[s], t[s]) for s in real_slots)   # the step did update them


def test_buckets():
    """Steps pad to the next bucket; the largest bucket is max_batch_size."""
    class Fake:
        device, ops, shard = torch.device("cpu"), None, None
    graphs = pocketllm.DecodeGraphs(Fake(), None, max_batch_size=40, max_context=100, block_size=16)
    assert graphs.buckets == [1, 2, 4, 8, 16, 24, 32, 40] and graphs.width == 7
