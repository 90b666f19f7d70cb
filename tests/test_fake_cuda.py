"""Device honesty without a GPU: the torch backend's forward, cache allocation, make_batch and the sampler
run on fake `cuda` tensors (tests/fake_cuda.py), where a CPU tensor meeting a CUDA one raises, a generator
on the wrong device raises, and every read of device data on the host is counted. Each sampling feature a
client can ask for runs through real engine steps, prefill, decode and forks, and the sampler reads the
device exactly once per step."""

import pytest
import torch

import pocketllm
from fake_cuda import CUDA, fake_cuda, model_to

TINY = pocketllm.DEFAULT_CKPT
PROMPTS = [[5, 6, 7], list(range(20, 39))]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def tiny_parts():
    ckpt = pocketllm.Checkpoint(TINY)
    tokenizer = pocketllm.Tokenizer(TINY)
    eos = pocketllm._eos_ids(ckpt, tokenizer)
    return ckpt, tokenizer, eos


@pytest.fixture(scope="module")
def tiny():
    return tiny_parts()


def cpu_model(tiny):
    """pocket-tiny's first two layers (one of each mixer) loaded for real, fp16 activations and the projections
    stacked as on a GPU (loading reads files: outside fake_cuda; pocket-tiny's FP8 heads of 32 keep q and gate
    interleaved, as a GPU loads them). Every op runs twice here, fake and real: two layers keep it quick."""
    return pocketllm.Model(tiny[0], pocketllm.TorchOps(), torch.float16, torch.device("cpu"), num_layers=2,
                           progress=False, stack=True)


def overlap_engine(model, eos, overlap: bool) -> pocketllm.Engine:
    """Inside fake_cuda: an Engine on CUDA for the async scheduling tests (tests/test_overlap.py,
    tests/test_graph_sampler.py): speculation off, `--async-scheduling` on or off."""
    options = pocketllm.EngineOptions(backend="torch", device="cuda", quiet=True, max_context=96, max_batch_size=8,
                                      speculative_tokens=0, async_scheduling=overlap)
    return pocketllm.Engine(model_to(model, CUDA), options, eos, torch.float16)


def fake_engine(tiny, model, **opts):
    """Inside fake_cuda: an Engine whose model, cache and sampler live on CUDA."""
    options = pocketllm.EngineOptions(backend="torch", device="cuda", quiet=True, max_context=96,
                                      max_batch_size=24, kv_block_size=16, **opts)
    return pocketllm.Engine(model_to(model, CUDA), options, tiny[2], torch.float16)


def run(engine, real, requests, max_steps=200):
    """Step the engine until every request has finished; check the sampler's one device read per step."""
    sample, reads = engine.sampler.sample, []

    def counted(rows, logits):
        before = len(real.host_reads)
        out = sample(rows, logits)
        reads.append(len(real.host_reads) - before - processor_reads[0])
        processor_reads[0] = 0
        return out
    processor_reads = [0]
    for req in requests:
        req.params.logits_processors = [_counting(p, real, processor_reads) for p in req.params.logits_processors]
        engine.add(req)
    for _ in range(max_steps):
        if not engine.has_work():
            break
        engine.sampler.sample = counted
        engine.step()
    assert not engine.has_work()
    assert reads and reads == [1] * len(reads)                 # one device-to-host transfer per step
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["slots_used"] == 0
    return [_drain(req) for req in requests]


def _counting(proc, real, counter):
    """A processor's own host reads are its own (section 11), not the sampler's: count them apart."""
    def call(ids, logits):
        before = len(real.host_reads)
        out = proc(ids, logits)
        counter[0] += len(real.host_reads) - before
        return out
    return call


def _drain(req):
    events = []
    while not req.events.empty():
        events.append(req.events.get())
    assert all(ev.finish_reason != "error" for ev in events), [ev.error for ev in events]
    return events


FEATURES = {
    "greedy": dict(temperature=0),
    "temperature": dict(temperature=1.0),
    "presence_penalty": dict(temperature=1.0, presence_penalty=1.5),
    "frequency_penalty": dict(temperature=1.0, frequency_penalty=1.0),
    "repetition_penalty": dict(temperature=0, repetition_penalty=1.3),
    "logit_bias": dict(temperature=1.0, logit_bias={42: 5.0, 7: -100.0}),
    "min_tokens": dict(temperature=1.0, min_tokens=5, stop_token_ids=[3]),
    "top_k": dict(temperature=1.0, top_k=5),
    "top_p": dict(temperature=1.0, top_p=0.8),
    "min_p": dict(temperature=1.0, min_p=0.1),
    "seed": dict(temperature=1.0, seed=1234),
    "n": dict(temperature=1.0, n=3, seed=5),
    "logprobs": dict(temperature=1.0, logprobs=3),
    "everything": dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, presence_penalty=0.5,
                       frequency_penalty=0.3, repetition_penalty=1.1, logit_bias={42: 2.0}, min_tokens=2,
                       seed=9, n=2, logprobs=2),
}


def test_every_sampling_feature_on_fake_cuda(tiny):
    """One request per feature, prompts of two lengths (one prefilled in chunks), all in one batch: prefill,
    forks, then decode steps, each feature in a batch with all the others."""
    model = cpu_model(tiny)
    with fake_cuda() as real:
        engine = fake_engine(tiny, model, prefill_token_budget=64)
        requests = [pocketllm.Request(name, PROMPTS[i % 2], pocketllm.SamplingParams(max_tokens=3, ignore_eos=True,
                                                                                  **kw), 7)
                    for i, (name, kw) in enumerate(FEATURES.items())]
        events = run(engine, real, requests)
    for req, evs in zip(requests, events):
        n = req.params.n
        tokens = [sum((ev.token_ids for ev in evs if ev.index == i), []) for i in range(n)]
        assert [len(t) for t in tokens] == [3] * n
        if req.params.logprobs is not None:
            assert all(len(ev.logprobs[0][1]) == req.params.logprobs for ev in evs if ev.token_ids)


def test_tool_choice_masks_on_fake_cuda(tiny):
    """tool_choice "required" (forced markup, then constrained values) and "none" (a ban), n=2, one batch."""
    _, tokenizer, eos = tiny
    model = cpu_model(tiny)
    with fake_cuda() as real:
        engine = fake_engine(tiny, model)
        requests = []
        for choice in ("required", "none"):
            processor = pocketllm.tool_choice_processor(tokenizer, TOOLS, choice, "qwen_xml", False, False,
                                                        max_tokens=64, eos_token_ids=eos)
            params = pocketllm.SamplingParams(max_tokens=64, temperature=1.0, seed=1, n=2,
                                              logits_processors=[processor])
            requests.append(pocketllm.Request(choice, PROMPTS[0], params, 0))
        events = run(engine, real, requests)[0]
    for i in range(2):
        text = tokenizer.decode([t for ev in events if ev.index == i for t in ev.token_ids])
        assert text.startswith("<tool_call>"), text


def test_interleaved_q_gate_prefill_on_fake_cuda(tiny, tmp_path):
    """FP8 attention heads narrower than a scale block (64) keep q_proj's [q | gate] rows interleaved per head
    inside the stacked q|gate|k|v weight, as a GPU loads it: torch's split of that output is a strided view, and
    prefill (several rows) must still run (the GPU parity check once failed here); greedy tokens as unstacked."""
    import checkpoints
    path, _ = checkpoints.make_checkpoint(tmp_path / "ckpt", "qwen3_5", fp8=True, head_dim=64, num_hidden_layers=2,
                                          layer_types=["linear_attention", "full_attention"])
    ckpt = pocketllm.Checkpoint(path)
    tokens = {}
    for stack in (True, False):
        model = pocketllm.Model(ckpt, pocketllm.TorchOps(), torch.float16, torch.device("cpu"), progress=False,
                                stack=stack)
        mixer = model.layers[1].mixer
        assert mixer.gate_interleaved and (len(mixer.qkv.groups) == 1) == stack     # stacked: one weight
        with fake_cuda() as real:
            engine = fake_engine((ckpt, None, []), model)
            req = pocketllm.Request("r", list(range(5, 25)), pocketllm.SamplingParams(max_tokens=4, temperature=0,
                                                                                      ignore_eos=True), 7)
            events = run(engine, real, [req])[0]
        tokens[stack] = sum((ev.token_ids for ev in events), [])
    assert len(tokens[True]) == 4 and tokens[True] == tokens[False]


def test_cache_and_batch_live_on_the_device(tiny):
    model = cpu_model(tiny)
    with fake_cuda():
        engine = fake_engine(tiny, model)
        for t in (*engine.cache.k.values(), *engine.cache.v.values(), *engine.cache.conv.values(),
                  *engine.cache.ssm.values(), engine.sampler.counts, engine.sampler.prompt_seen):
            assert t.device == CUDA
        engine.add(pocketllm.Request("b", PROMPTS[1], pocketllm.SamplingParams(max_tokens=2), 0))
        engine._drain_inbox()
        batch = pocketllm.make_batch(engine.scheduler.schedule(), 16, CUDA)
        for name in ("token_ids", "positions", "query_start", "context_lens", "block_tables", "slot_mapping",
                     "state_slots", "logit_rows", "fresh_slots"):
            assert getattr(batch, name).device == CUDA, name


def test_speculation_resumes_and_forks_on_fake_cuda(tiny):
    """Speculative decoding with the prefix cache on the device: n = 2 sampled with penalties (a fork, its MTP
    rewrite of the last prompt position from the parent's hidden row), then a follow-up turn resumed from the
    end-of-generation snapshot (its hidden row restored with the state)."""
    model = pocketllm.Model(tiny[0], pocketllm.TorchOps(), torch.float16, torch.device("cpu"), progress=False,
                            stack=True, mtp=True)                  # every layer: the MTP layer reads the last
    with fake_cuda() as real:
        engine = fake_engine(tiny, model, speculative_tokens=2)
        assert engine.draft_tokens == 2
        assert engine.cache.hidden.device == engine.snapshots.hidden.device == CUDA
        params = dict(max_tokens=6, ignore_eos=True, temperature=1.0, presence_penalty=0.5, seed=3)
        first = pocketllm.Request("a", PROMPTS[1], pocketllm.SamplingParams(n=2, **params), 7)
        events = run(engine, real, [first])[0]
        answer = sum((ev.token_ids for ev in events if ev.index == 0), [])
        follow = pocketllm.Request("b", PROMPTS[1] + answer + [5, 6], pocketllm.SamplingParams(**params), 7)
        events = run(engine, real, [follow])[0]
    assert len(answer) == 6 and len(sum((ev.token_ids for ev in events), [])) == 6
    assert follow.cached_tokens >= len(PROMPTS[1]) + 5


def test_a_cpu_tensor_meeting_a_cuda_one_raises():
    """The harness itself: it would catch the bugs it is here to catch."""
    with fake_cuda():
        logits = torch.zeros(4, device="cuda")
        with pytest.raises(Exception, match="device"):
            logits + torch.ones(4)
        with pytest.raises(RuntimeError, match="generator"):
            torch.multinomial(logits.softmax(-1), 1, generator=torch.Generator())


def test_fake_cuda_runs_on_any_build_of_torch():
    """Indexing, copy_ and int() of a fake CUDA tensor open a CUDA device guard in torch's C++ bindings, which a
    CPU-only build of torch (the README's install without a GPU) lacks; device mismatches still raise."""
    with fake_cuda():
        x = torch.arange(12, device="cuda").view(3, 4)
        x[1, 2:] = 0
        x[torch.tensor([0, 2], device="cuda")] += 1
        x.copy_(x * 2)
        assert x[1:].device == CUDA and int(x[2, 3]) == 24 and x[:, 0].tolist() == [2, 8, 18]
        with pytest.raises(Exception, match="device"):
            x[0] + torch.ones(4)


def test_ci_runs_on_the_cpu_build_of_torch():
    """CI installs torch's CPU build, as the README's first command does on a machine without a GPU, before the
    README's test command."""
    from pathlib import Path
    lines = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text().splitlines()
    install = next(i for i, line in enumerate(lines) if line.startswith("python3 -m pip install \"torch=="))
    assert "torch==2.13.0" in lines[install] and "cuda.is_built()" in lines[install + 1]   # the CPU build, checked
    assert install < len(lines) - 1 and lines[-1].startswith("python3 -m pip install -r requirements-test.txt")
