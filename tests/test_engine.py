"""The serving engine: continuous batching, chunked prefill, preemption, abort, forking, and the sampler."""

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pocketllm

PROMPTS = [[5 + (i * 7 + j * 13) % 380 for j in range(3 + 5 * i)] for i in range(8)]   # 8 lengths: 3 .. 38


@pytest.fixture(scope="module")
def path(ckpt_factory):
    return ckpt_factory("qwen3_5", fp8=True)[0]


def make(path, **opts):
    opts = {"backend": "torch", "quiet": True, "max_context": 128, "max_batch_size": 8, **opts}
    return pocketllm.LLM(path, **opts)


@pytest.fixture(scope="module")
def llm(path):
    return make(path)


def run_all(llm, prompts, **sampling):
    """Submit every prompt at once (one batch), then collect each stream's tokens."""
    streams = [llm.submit(p, pocketllm.SamplingParams(**sampling)) for p in prompts]
    return [[t for ev in s for t in ev.token_ids] for s in streams]


def alone(llm, prompts, **sampling):
    return [llm.generate(p, **sampling)["token_ids"] for p in prompts]


def test_batch_invariance(llm):
    together = run_all(llm, PROMPTS, max_tokens=12, temperature=0, ignore_eos=True)
    assert together == alone(llm, PROMPTS, max_tokens=12, temperature=0, ignore_eos=True)
    assert len({tuple(t) for t in together}) > 1


def test_chunked_prefill_small_budget(path, llm):
    chunked = make(path, prefill_token_budget=5)
    want = alone(llm, PROMPTS, max_tokens=8, temperature=0, ignore_eos=True)
    assert run_all(chunked, PROMPTS, max_tokens=8, temperature=0, ignore_eos=True) == want


def test_preemption_gives_same_tokens(path, llm):
    """8 sequences of up to ~58 tokens in 12 blocks of 16: they cannot all fit at once."""
    small = make(path, num_kv_blocks=12, max_context=64)
    want = alone(llm, PROMPTS, max_tokens=20, temperature=0, ignore_eos=True)
    assert run_all(small, PROMPTS, max_tokens=20, temperature=0, ignore_eos=True) == want
    assert small.stats()["kv_blocks_used"] == 0 and small.stats()["slots_used"] == 0


def test_seeded_n4_reproducible_and_batch_independent(llm):
    kw = dict(max_tokens=10, temperature=1.0, seed=1234, n=4, ignore_eos=True)
    first = [c["token_ids"] for c in llm.generate(PROMPTS[3], **kw)["choices"]]
    assert len({tuple(c) for c in first}) == 4                     # the choices differ
    again = [c["token_ids"] for c in llm.generate(PROMPTS[3], **kw)["choices"]]
    assert again == first
    others = [llm.submit(p, pocketllm.SamplingParams(max_tokens=10, temperature=0.7)) for p in PROMPTS[:5]]
    mixed = llm.submit(PROMPTS[3], pocketllm.SamplingParams(**kw))
    got = [[] for _ in range(4)]
    for ev in mixed:
        got[ev.index] += ev.token_ids
    for s in others:
        list(s)
    assert got == first


def test_n_forks_the_prompt_once(llm):
    before = llm.stats()["prompt_tokens_total"]
    out = llm.generate(PROMPTS[5], max_tokens=4, temperature=1.0, seed=7, n=3)
    assert len(out["choices"]) == 3 and all(c["completion_tokens"] == 4 for c in out["choices"])
    assert llm.stats()["prompt_tokens_total"] - before == len(PROMPTS[5])
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["slots_used"] == 0


def greedy_text(llm, prompt, n):
    out = llm.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True)
    return out["text"], out["token_ids"]


def test_stop_string_across_token_boundaries(llm):
    text, ids = greedy_text(llm, PROMPTS[2], 16)
    # A stop string that starts inside one token and ends inside a later one.
    pieces = [llm.tokenizer.decode([t]) for t in ids]
    start = len(pieces[0]) + len(pieces[1]) - 1
    stop = text[start:start + max(3, len(pieces[2]) + 2)]
    assert stop and len(stop) >= 2
    out = llm.generate(PROMPTS[2], max_tokens=16, temperature=0, ignore_eos=True, stop=[stop])
    assert out["finish_reason"] == "stop"
    assert out["text"] == text[:text.find(stop)]
    streamed = "".join(ev.text for ev in llm.submit(PROMPTS[2], pocketllm.SamplingParams(
        max_tokens=16, temperature=0, ignore_eos=True, stop=[stop])))
    assert streamed == out["text"]


def test_stop_token_ids(llm):
    _, ids = greedy_text(llm, PROMPTS[4], 10)
    out = llm.generate(PROMPTS[4], max_tokens=10, temperature=0, ignore_eos=True, stop_token_ids=[ids[3]])
    assert out["finish_reason"] == "stop" and out["token_ids"] == ids[:ids.index(ids[3]) + 1]


def test_min_tokens_masks_eos(llm):
    eos = llm.eos_token_ids[0]
    forced = {eos: 100.0}              # EOS would win every step ...
    out = llm.generate(PROMPTS[1], max_tokens=10, temperature=0, logit_bias=forced)
    assert out["token_ids"] == [eos] and out["finish_reason"] == "stop"
    out = llm.generate(PROMPTS[1], max_tokens=10, temperature=0, logit_bias=forced, min_tokens=5)
    assert len(out["token_ids"]) == 6 and eos not in out["token_ids"][:5] and out["token_ids"][5] == eos


def test_logit_bias(llm):
    _, base = greedy_text(llm, PROMPTS[0], 6)
    target = next(t for t in range(10, 300) if t not in base)
    out = llm.generate(PROMPTS[0], max_tokens=6, temperature=0, ignore_eos=True, logit_bias={target: 100.0})
    assert out["token_ids"] == [target] * 6


def test_penalties_change_repetition(llm):
    bias = {42: 8.0}                    # makes token 42 the greedy choice, repeatedly
    plain = llm.generate(PROMPTS[0], max_tokens=8, temperature=0, ignore_eos=True, logit_bias=bias)["token_ids"]
    assert plain.count(42) == 8
    for kw in ({"frequency_penalty": 2.0}, {"repetition_penalty": 10.0}):
        out = llm.generate(PROMPTS[0], max_tokens=8, temperature=0, ignore_eos=True, logit_bias=bias, **kw)
        assert out["token_ids"].count(42) < 8, kw


def process_logits(logits: torch.Tensor, seq, eos_ids: list[int]) -> torch.Tensor:
    """The sampler's stages before the draw (penalties, logit_bias, min_tokens bans, processors) on one (V,) row."""
    row = pocketllm.SampleRow(seq, 0, pocketllm.prepare_row_params(seq.params, eos_ids, logits.numel()))
    sampler = pocketllm.Sampler(1, logits.numel(), logits.device)
    sampler._own(0, row)
    table = pocketllm.RowTable.build([row.params], [0.0], logits.device)
    x, failed = sampler.process(logits[None].clone(), [row], table, torch.zeros(1, dtype=torch.long))
    if failed:
        raise failed[0]
    return x[0]


def sample_token(logits: torch.Tensor, params, generator: torch.Generator) -> int:
    """Temperature, top_k, top_p and min_p on one (V,) row, then a draw at a uniform taken from `generator`."""
    row = pocketllm.prepare_row_params(params, [], logits.numel())
    u = float(torch.rand((), generator=generator, dtype=torch.float64)) * (1 - 2 ** -40)
    table = pocketllm.RowTable.build([row], [u], logits.device)
    x = pocketllm.scale_by_temperature(logits[None].float(), table)
    return int(pocketllm.draw_tokens(pocketllm.filter_logits(x, table, row.sorts, row.min_p > 0), table)[0])


def test_penalty_arithmetic(llm):
    """OpenAI's presence/frequency penalties over generated tokens; HF's repetition penalty over all tokens."""
    req = pocketllm.Request("r", [7, 9], pocketllm.SamplingParams(presence_penalty=0.5, frequency_penalty=0.25,
                                                                   repetition_penalty=2.0), 0)
    seq = pocketllm.Sequence(req, 0, output_ids=[3, 3, 5])
    logits = torch.tensor([1.0] * 6 + [-1.0] * 4)
    out = process_logits(logits, seq, eos_ids=[])
    want = logits.clone()
    want[[3, 5, 7, 9]] = torch.tensor([0.5, 0.5, -2.0, -2.0])   # positive halved, negative doubled
    want[3] -= 0.5 + 0.25 * 2
    want[5] -= 0.5 + 0.25 * 1
    assert torch.allclose(out, want)


def test_logprobs(llm):
    out = llm.generate(PROMPTS[0], max_tokens=5, temperature=0, ignore_eos=True, logprobs=3)
    raw = llm.logits(PROMPTS[0] + out["token_ids"])
    for i, lp in enumerate(out["logprobs"]):
        row = raw[len(PROMPTS[0]) - 1 + i].log_softmax(-1)
        assert lp.token_id == out["token_ids"][i] and len(lp.top) == 3
        assert abs(lp.logprob - float(row[lp.token_id])) < 1e-4
        assert lp.top[0][0] == int(row.argmax())


def test_sampling_filters():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([5.0, 4.9, 1.0, 0.5, -3.0])
    draw = lambda **kw: {sample_token(logits, pocketllm.SamplingParams(**kw), g) for _ in range(200)}  # noqa: E731
    assert draw(temperature=1.0, top_k=2) == {0, 1}
    assert draw(temperature=1.0, top_p=0.5) == {0}
    assert draw(temperature=1.0, min_p=0.5) == {0, 1}
    assert len(draw(temperature=2.0)) >= 4
    assert draw(temperature=0) == {0}


def test_invalid_params_and_context_overflow(llm):
    with pytest.raises(pocketllm.RequestError) as e:
        llm.generate(PROMPTS[0], max_tokens=200)
    assert e.value.param == "max_tokens" and "128" in str(e.value) and "200" in str(e.value)
    for bad, param in ((dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(n=0), "n"),
                       (dict(logprobs=21), "logprobs"), (dict(logit_bias={10**6: 1.0}), "logit_bias.1000000")):
        with pytest.raises(pocketllm.RequestError) as e:
            llm.generate(PROMPTS[0], max_tokens=2, **bad)
        assert e.value.param == param


def test_abort_and_completion_return_every_block_and_slot(path):
    llm = make(path, max_batch_size=6, num_kv_blocks=40, prefill_token_budget=32)
    rng = random.Random(0)
    streams = []
    for i in range(200):
        prompt = [rng.randrange(5, 380) for _ in range(rng.randrange(1, 40))]
        params = pocketllm.SamplingParams(max_tokens=rng.randrange(1, 12), temperature=rng.choice([0, 1.0]),
                                          n=rng.choice([1, 1, 2]), ignore_eos=True)
        streams.append(llm.submit(prompt, params))
        if i % 3 == 0:
            streams[-1].abort()          # aborted before or while running
    for i, s in enumerate(streams):
        for j, ev in enumerate(s):
            if i % 5 == 1 and j == 1:
                s.abort()                # aborted mid-stream
    stats = llm.stats()
    assert stats["running"] == 0 and stats["waiting"] == 0
    assert stats["kv_blocks_used"] == 0 and llm.engine.blocks.refs == [0] * 40
    assert stats["slots_used"] == 0 and sorted(llm.engine.slots.free) == list(range(6))


def test_close_ends_running_requests_and_refuses_new_ones(path):
    llm = make(path)
    stream = llm.submit(PROMPTS[3], pocketllm.SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    events = iter(stream)
    next(events)                          # running
    llm.close()
    with pytest.raises(pocketllm.PocketError, match="closed"):
        list(events)
    with pytest.raises(pocketllm.PocketError, match="closed"):
        llm.generate(PROMPTS[0], max_tokens=2)
    llm.close()                           # a second close does nothing
    assert not llm._thread.is_alive()


EXIT_WITHOUT_CLOSE = """
import sys
sys.path.insert(0, sys.argv[2])
import pocketllm
llm = pocketllm.LLM(sys.argv[1], backend="torch", quiet=True, max_context=64)
print(len(llm.generate([5, 6, 7], max_tokens=3, temperature=0, ignore_eos=True)["token_ids"]))
"""


def test_script_that_never_closes_exits_cleanly(path):
    # The engine thread, left running, used to abort the interpreter at exit (exit code 134).
    root = Path(pocketllm.__file__).resolve().parent
    r = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, str(path), str(root)], capture_output=True,
                       text=True, timeout=120)
    assert (r.returncode, r.stdout.strip()) == (0, "3"), r.stderr
    assert "terminate" not in r.stderr


def test_utf8_stream_never_splits_characters(llm):
    """Force the engine to emit the tokens of an emoji/CJK text (byte-level BPE splits its characters across
    tokens): every streamed piece is valid text, and the pieces join to the final text."""
    text = "héllo 🙂🚀 你好，世界！ こんにちは 🙂"
    target = llm.tokenizer.encode(text)
    assert len(target) > len(text) // 2

    def force(ids, logits):
        out = torch.full_like(logits, float("-inf"))
        out[target[len(ids)] if len(ids) < len(target) else llm.eos_token_ids[0]] = 0.0
        return out

    params = pocketllm.SamplingParams(max_tokens=len(target) + 1, temperature=0, logits_processors=[force])
    pieces = [ev.text for ev in llm.submit(PROMPTS[0], params)]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    assert any(len(p) == 0 for p in pieces) or len(pieces) < len(target) + 1   # some tokens held back a char


def test_text_stream_holds_back_partial_characters(llm):
    tok = llm.tokenizer
    ids = tok.encode("🚀")
    assert len(ids) >= 2
    ts = pocketllm.TextStream(tok, [])
    assert [ts.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert ts.add(ids[-1]) == "🚀"
