"""The sampler inside the decode step's CUDA graph (issue 49 item 3; DecodeGraphs and Sampler.sample_static):
the step's row parameters ride in the static payload and the captured step samples, so a decode step is one
graph replay and one read of its tokens.

Without a GPU the graph is tests/fake_cuda.py's OpGraph: it records the torch ops of the step as it is captured
(refusing host reads and host-to-device copies inside it) and replays them on the same tensors, as a CUDA graph
replays its kernels on the same addresses, so a value the sampler took from the host at capture would be
replayed stale. pocket-tiny's torch forward reads the host (the torch backend is not captured; the native
one is, on a GPU: tests/gpu/gpu_check.py graphs): it is recorded whole (OpGraph.opaque) and rerun at replay.

- On the CPU: the same outputs with the sampler in the replayed step as with the eager sampler, one step at a
  time and with async scheduling (greedy; seeded temperature 1 with penalties, top-p, top-k, min-p,
  logit_bias, min_tokens and stop tokens; n > 1; stop strings; a chat, whose call-token ban is a token mask).
- Padding rows (a bucket larger than the batch) change no token and no penalty count.
- On fake CUDA: the replayed steps sample on the device (no host read and no upload inside them, or OpGraph
  refuses the capture), and the host reads each step's result once.
"""

import dataclasses
import functools
import types

import pytest
import torch

import pocketllm
from fake_cuda import OpGraph
from test_overlap import strip_ids

STORY = [{"role": "user", "content": "Tell me a story."}]


def graphed(engine, graph=OpGraph) -> pocketllm.DecodeGraphs:
    """engine's decode steps replayed from `graph` recordings with the sampler inside; a bucket per batch size
    (the torch backend's KV write has no skip for a padding row's slot -1: padding is checked apart, below)."""
    o = engine.opts
    engine.graphs = pocketllm.DecodeGraphs(engine.model, engine.cache, o.max_batch_size, o.max_context,
                                           o.kv_block_size, sampler=engine.sampler, graph=graph)
    engine.graphs.buckets = list(range(1, o.max_batch_size + 1))
    return engine.graphs


def replayable(model, forward=None):
    """model.forward recorded whole by OpGraph (OpGraph.opaque). The torch backend keeps a step's RoPE angles
    keyed by the positions tensor's identity, which a static payload keeps from step to step: forgotten before
    each call here (the native backend, which graphs capture, has no such memo)."""
    forward = forward or model.forward

    def fresh(*args):
        model.ops.__dict__.pop("_rope_memo", None)
        return forward(*args)
    model.forward = OpGraph.opaque(fresh)


@pytest.fixture(scope="module")
def trio():
    """pocket-tiny three times: the eager sampler one step at a time (the reference), then the sampler inside
    the replayed step one step at a time and with async scheduling."""
    llms = [pocketllm.LLM(None, backend="torch", quiet=True, max_batch_size=8, max_context=512, speculative_tokens=0,
                          async_scheduling=flag) for flag in (False, False, True)]
    for llm in llms[1:]:
        assert llm.model is not llms[0].model
        replayable(llm.model)
        graphed(llm.engine)
    yield llms
    for llm in llms:
        llm.close()


def all_three(trio, call):
    """call(llm) on the three; asserts the graphed ones sampled inside replayed steps; returns the answers."""
    before = [(llm.engine.graphs.sampled, llm.engine.graphs.graphed) for llm in trio[1:]]
    answers = [strip_ids(call(llm)) for llm in trio]
    for llm, (sampled, replays) in zip(trio[1:], before):
        assert llm.engine.graphs.sampled - sampled > 3 and llm.engine.graphs.graphed - replays > 3
    return answers


SAMPLINGS = {"greedy": dict(temperature=0, max_tokens=40),
             "seeded": dict(temperature=1.0, seed=11, max_tokens=40, presence_penalty=0.6, frequency_penalty=0.4,
                            repetition_penalty=1.3, top_k=50, top_p=0.95, min_tokens=6, logit_bias={220: -2.0}),
             "min_p": dict(temperature=0.8, seed=2, max_tokens=30, min_p=0.05, stop_token_ids=[13, 11],
                           min_tokens=4, logit_bias={11: 1.5, 13: 1.0, 264: -100}),
             "n": dict(n=3, temperature=1.0, seed=5, max_tokens=24, frequency_penalty=0.5, top_p=0.9)}


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_the_sampler_in_the_graph_gives_the_eager_tokens(trio, sampling):
    ref, plain, overlapped = all_three(trio, lambda llm: llm.generate("Once upon a time", **SAMPLINGS[sampling]))
    choices = ref.get("choices", [ref])
    assert ref == plain == overlapped and min(c["completion_tokens"] for c in choices) >= 4
    assert len({tuple(c["token_ids"]) for c in choices}) == len(choices)


def test_stop_strings_and_a_batch_finishing_at_different_steps(trio):
    full = trio[0].generate("Once upon a time", temperature=0, max_tokens=30, ignore_eos=True)
    stop = full["text"][len(full["text"]) // 2:][:4]
    assert stop.strip()

    def run(llm):
        streams = [llm.submit(llm.tokenizer.encode(p), pocketllm.SamplingParams(
            max_tokens=4 + 7 * i, temperature=1.0 if i % 2 else 0.0, seed=i, presence_penalty=0.3 * (i % 2),
            logit_bias={i + 300: 3.0})) for i, p in enumerate(["Hello, who are you?", "The weather in Paris",
                                                                 "1, 2, 3,", "Tell me a joke"])]
        stopped = llm.generate("Once upon a time", temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
        return [[(ev.index, ev.token_ids, ev.finish_reason) for ev in s] for s in streams], stopped
    ref, plain, overlapped = all_three(trio, run)
    assert ref == plain == overlapped
    assert ref[1]["finish_reason"] == "stop" and ref[1]["text"] == full["text"][:full["text"].find(stop)]


def test_a_chat_samples_in_the_graph_with_its_token_mask(trio):
    """A chat without tools bans the call token with a token mask (a logits processor that reads no ids): its
    steps sample inside the graph, the mask copied into the bucket's static mask buffer before each replay."""
    ref, plain, overlapped = all_three(trio, lambda llm: llm.chat(STORY, temperature=1.0, seed=3, max_tokens=40,
                                                                  repetition_penalty=1.1))
    assert ref == plain == overlapped
    assert all(llm.engine.graphs.allowed for llm in trio[1:])


def test_logprobs_and_grammars_sample_after_the_replay(trio):
    """Rows the sampler cannot take into a graph (logprobs; a grammar whose mask reads the last token) replay
    the forward only and sample eagerly: still the same tokens."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    answers = [[strip_ids(llm.generate("Once upon a time", temperature=1.0, seed=4, max_tokens=20, logprobs=2)),
                strip_ids(llm.chat(ask, tools=tools, tool_choice="required", temperature=0, max_tokens=40,
                                   chat_template_kwargs={"enable_thinking": False}))] for llm in trio]
    assert answers[0] == answers[1] == answers[2]


def seq(slot: int, output_ids: list[int], prompt: list[int], seed: int, **sampling):
    """A Sequence as the sampler reads it, with its prepared RowParams."""
    params = pocketllm.SamplingParams(seed=seed, **sampling)
    request = types.SimpleNamespace(prompt_ids=prompt, sampling=pocketllm.prepare_row_params(params, [2], 64))
    return types.SimpleNamespace(slot=slot, output_ids=output_ids, request=request, params=params, seed=seed, index=0)


def test_padding_rows_change_no_token_and_no_count():
    """sample_static on a bucket of 7 rows, 3 of them real, against the eager sampler on the 3: the same
    tokens, and the same penalty counts in every slot (padding rows read free slots and add nothing)."""
    torch.manual_seed(0)
    seqs = [seq(0, [5, 9, 9], [1, 2, 3], 1, temperature=1.0, presence_penalty=0.7, repetition_penalty=1.4,
                top_k=10, logit_bias={7: 2.0, 8: -1.0}),
            seq(3, [4], [6, 6], 2, temperature=0.0, min_tokens=3, stop_token_ids=[11]),
            seq(5, [1, 1, 1, 1], [2], 3, temperature=0.7, top_p=0.8, min_p=0.1, frequency_penalty=0.3)]
    logits = torch.randn(7, 64) * 3                                                     # (bucket, V)
    results = []
    for static in (False, True):
        sampler = pocketllm.Sampler(8, 64, "cpu")
        rows = [pocketllm.SampleRow(s, i, s.request.sampling) for i, s in enumerate(seqs)]
        for step in range(4):
            if not static:
                tokens = sampler.sample(rows, logits[:3]).tokens
            else:
                stages = sampler.static_stages(rows)
                assert stages == (True, True, True, 8, False)
                sampler.prepare_static(rows, stages)
                table, ids, values = (torch.tensor(f, dtype=d) for f, d in zip(
                    sampler.static_fields(rows, 7, stages), pocketllm.SAMPLE_DTYPES))
                slots = torch.tensor([0, 3, 5, 1, 2, 4, 6])                               # padding: free slots
                tokens = sampler.sample_static(logits, slots, table.view(7, -1), ids.view(7, 8), values.view(7, 8),
                                               None, stages).tolist()[:3]
            for s, t in zip(seqs, tokens):
                s.output_ids = s.output_ids + [t]
            rows = [pocketllm.SampleRow(s, i, s.request.sampling) for i, s in enumerate(seqs)]
            results.append(tokens)
        results.append(sampler.counts.clone())
        for s, n in zip(seqs, (3, 1, 4)):
            s.output_ids = s.output_ids[:n]
    eager, graph = results[:5], results[5:]
    assert eager[:4] == graph[:4] and torch.equal(eager[4], graph[4])
    assert graph[4][[1, 2, 4, 6]].sum() == 0


def test_rows_the_graph_cannot_sample():
    s = seq(0, [5], [1], 1, temperature=1.0)
    sampler = pocketllm.Sampler(2, 64, "cpu")
    row = pocketllm.SampleRow(s, 0, s.request.sampling)
    assert sampler.static_stages([row]) == (False, False, False, 0, False)
    assert sampler.static_stages([dataclasses.replace(row, draft=3)]) is None
    many = seq(0, [5], [1], 1, logit_bias={t: 1.0 for t in range(40)})
    assert sampler.static_stages([pocketllm.SampleRow(many, 0, many.request.sampling)])[3] == 64
    s.params.logprobs = 1
    assert sampler.static_stages([row]) is None


def fake_cuda_steps(graphs: bool):
    """Four requests decoding on fake CUDA tensors (tests/fake_cuda.py), async scheduling on, the decode steps
    replayed from OpGraph recordings with the sampler inside (graphs) or eager: (their tokens, steps, host reads
    outside the forwards, the DecodeGraphs)."""
    from fake_cuda import fake_cuda
    from test_fake_cuda import cpu_model, overlap_engine, tiny_parts
    tiny = tiny_parts()
    model = cpu_model(tiny)
    with fake_cuda() as real:
        engine = overlap_engine(model, tiny[2], overlap=True)
        inside, forward = [], model.forward

        def counted(*args):                      # the torch backend's own reads (its forward is not captured)
            before = len(real.host_reads)
            logits = forward(*args)
            inside.append(len(real.host_reads) - before)
            return logits
        replayable(model, counted)
        engine.run_batch = lambda batch: model.forward(batch, engine.cache)
        g = graphed(engine, functools.partial(OpGraph, real=real)) if graphs else None
        features = [dict(temperature=0, max_tokens=16), dict(temperature=1.0, seed=3, n=2, max_tokens=16,
                                                             presence_penalty=0.5, repetition_penalty=1.2),
                    dict(temperature=0.8, seed=1, top_k=20, top_p=0.9, max_tokens=12, min_tokens=2,
                         logit_bias={40: 2.0})]
        requests = [pocketllm.Request(f"r{i}", [5 + i, 6, 7], pocketllm.SamplingParams(ignore_eos=True, **kw), 7)
                    for i, kw in enumerate(features)]
        for req in requests:
            engine.add(req)
        steps = 0
        while engine.has_work():
            engine.step()
            steps += 1
        del model.forward
    tokens = [[[t for ev in r.events.queue if ev.index == i for t in ev.token_ids] for i in range(r.params.n)]
              for r in requests]
    return tokens, engine.device.reads, len(real.host_reads) - sum(inside), len(inside), g


def test_fake_cuda_replays_sample_on_the_device_and_read_once():
    """On fake CUDA the decode steps replay the forward and the sampler from their recordings: OpGraph
    refuses a host read or an upload inside a captured step, the replays read nothing on the host, and the
    host reads each step's result once (reads outside the forwards == the engine's reads == forwards, as
    without graphs); the tokens are those of the eager sampler."""
    tokens, reads, outside, forwards, g = fake_cuda_steps(graphs=True)
    assert g.sampled >= 12 and g.graphed >= 8 and g.steps and all(not isinstance(k, int) for k in g.steps)
    assert outside == reads == forwards
    reference, reads_eager, outside_eager, forwards_eager, _ = fake_cuda_steps(graphs=False)
    assert tokens == reference and outside_eager == reads_eager == forwards_eager
    assert all(len(t) >= 8 for choices in tokens for t in choices)


def test_a_capture_that_reads_the_host_is_refused():
    """OpGraph's own check: a step that reads a device value on the host while it is captured fails."""
    from fake_cuda import CUDA, HostWorkInCapture, fake_cuda
    with fake_cuda() as real:
        x = torch.arange(4.0).to(CUDA)
        graph = OpGraph(real)
        with pytest.raises(HostWorkInCapture):
            with graph.capture():
                torch.where(x > 1, x, x * float(x.sum()))
        with pytest.raises(HostWorkInCapture):
            with graph.capture():
                x + torch.tensor([1.0, 2.0, 3.0, 4.0])
