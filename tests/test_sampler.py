"""The batched sampler against independent references: its draws follow softmax (chi-square), its filters
and penalties equal a float64 reimplementation row by row, greedy rows are the argmax, and --seed makes
unseeded requests reproducible across servers."""

import math
import random

import pytest
import torch

import pocketllm
from pocketllm import draw_tokens, draw_uniform, filter_logits, apply_penalties

# Critical values of the chi-square distribution at p = 0.001 (a fixed-seed test: it passes or fails for good).
CHI2_999 = {5: 20.52, 7: 24.32}


def table(B, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, presence=0.0, frequency=0.0, repetition=1.0, u=None,
          V=8):
    """The RowTable the sampler sends to the device: each column a float64 (B,), a value or a list per row."""
    column = lambda c: torch.tensor(c if isinstance(c, list) else [c] * B, dtype=torch.float64)  # noqa: E731
    return pocketllm.RowTable(temperature=column(temperature), top_k=column(top_k or V), top_p=column(top_p),
                              min_p=column(min_p), presence=column(presence), frequency=column(frequency),
                              repetition=column(repetition), uniform=column(u or 0.0))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_draws_follow_the_softmax(temperature):
    V, N = 8, 40_000
    logits = torch.tensor([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0])
    u = [draw_uniform(1234, 0, step) for step in range(N)]          # one request's successive draws
    rows = table(N, temperature=temperature, u=u)
    x = pocketllm.scale_by_temperature(logits.expand(N, V).clone(), rows)
    counts = torch.bincount(draw_tokens(x, rows), minlength=V).double()
    expected = N * torch.softmax(logits.double() / temperature, -1)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_999[V - 1], (chi2, counts.tolist(), expected.tolist())


def test_filtered_draws_follow_the_renormalised_softmax():
    """top_k=6 and min_p: the dropped tokens never come, the kept ones follow their renormalised softmax."""
    V, N = 8, 40_000
    logits = torch.tensor([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0])
    rows = table(N, top_k=6, min_p=0.05, u=[draw_uniform(7, 1, s) for s in range(N)])
    x = filter_logits(pocketllm.scale_by_temperature(logits.expand(N, V).clone(), rows), rows)
    counts = torch.bincount(draw_tokens(x, rows), minlength=V).double()
    p = torch.softmax(logits.double(), -1)
    keep = torch.zeros(V, dtype=torch.bool)
    keep[:6] = True
    keep &= p >= 0.05 * p.max()                  # min_p: the ratio to the best is the same after top-k
    assert counts[~keep].sum() == 0
    expected = N * p[keep] / p[keep].sum()
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_999[int(keep.sum()) - 1], (chi2, counts.tolist())


def reference_filter(row, top_k, top_p, min_p):
    """float64, one row, written from the definitions: the set of kept token ids."""
    V = len(row)
    order = sorted(range(V), key=lambda i: -row[i])
    kth = row[order[min(max(top_k, 1), V) - 1]]
    kept = [i for i in range(V) if row[i] >= kth]
    z = sum(math.exp(row[i]) for i in kept)
    p = {i: math.exp(row[i]) / z for i in kept}
    if top_p < 1.0:
        mass, nucleus = 0.0, set()
        for i in sorted(kept, key=lambda i: -row[i]):
            if mass >= top_p:
                break
            nucleus.add(i)
            mass += p[i]
        kept = [i for i in kept if i in nucleus]
    best = max(p.values())
    return {i for i in kept if p[i] >= min_p * best}


def test_filters_equal_a_float64_reference_on_random_rows():
    g = torch.Generator().manual_seed(0)
    B, V = 256, 50
    x = torch.randn(B, V, generator=g) * 3
    rng = random.Random(0)
    top_k = [rng.choice([0, 1, 3, 10, 49, 50]) for _ in range(B)]
    top_p = [rng.choice([1.0, 0.95, 0.5, 0.1]) for _ in range(B)]
    min_p = [rng.choice([0.0, 0.01, 0.2]) for _ in range(B)]
    rows = table(B, top_k=[k or V for k in top_k], top_p=top_p, min_p=min_p, V=V)
    kept = torch.isfinite(filter_logits(x, rows))
    for b in range(B):
        want = reference_filter(x[b].double().tolist(), top_k[b] or V, top_p[b], min_p[b])
        assert set(kept[b].nonzero().flatten().tolist()) == want, (b, top_k[b], top_p[b], min_p[b])
    assert 0 < int(kept.sum()) < B * V
    unfiltered = table(B, V=V)                                   # every filter off: the row comes out unchanged
    assert torch.equal(filter_logits(x, unfiltered), x)


def test_penalties_equal_a_float64_reference_on_random_rows():
    g = torch.Generator().manual_seed(1)
    B, V = 32, 40
    x = torch.randn(B, V, generator=g) * 4
    counts = torch.randint(0, 4, (B, V), generator=g, dtype=torch.int32) * (torch.rand(B, V, generator=g) < 0.3)
    prompt = torch.rand(B, V, generator=g) < 0.2
    rng = random.Random(1)
    pres = [rng.uniform(-2, 2) for _ in range(B)]
    freq = [rng.uniform(-2, 2) for _ in range(B)]
    rep = [rng.choice([1.0, 0.5, 1.3, 10.0]) for _ in range(B)]
    out = apply_penalties(x.clone(), counts.int(), prompt, table(B, presence=pres, frequency=freq, repetition=rep,
                                                                 V=V))
    for b in range(B):
        for v in range(V):
            want, c = float(x[b, v]), int(counts[b, v])
            if c > 0 or prompt[b, v]:                       # repetition: prompt + generated
                want = want / rep[b] if want > 0 else want * rep[b]
            want -= (pres[b] if c > 0 else 0.0) + freq[b] * c  # OpenAI: generated tokens only
            assert abs(float(out[b, v]) - want) < 1e-5 * max(1.0, abs(want)), (b, v)
    off = table(B, V=V)                                      # penalties off: bit-identical
    assert torch.equal(apply_penalties(x.clone(), counts.int(), prompt, off), x)


def test_greedy_rows_are_the_argmax_exactly():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 1000, generator=g)
    temperature = [0.0 if i % 2 else 1.0 for i in range(64)]
    rows = table(64, temperature=temperature, u=[draw_uniform(3, i, 0) for i in range(64)], V=1000)
    got = draw_tokens(pocketllm.scale_by_temperature(x, rows), rows)
    assert torch.equal(got[1::2], x[1::2].argmax(-1))
    assert not torch.equal(got[0::2], x[0::2].argmax(-1))   # the sampled rows do sample


def test_uniforms_are_independent_of_everything_but_their_key():
    assert draw_uniform(5, 0, 3) == draw_uniform(5, 0, 3)
    assert len({draw_uniform(5, i, s) for i in range(4) for s in range(50)}) == 200
    assert all(0.0 <= draw_uniform(s, 0, 0) < 1.0 for s in range(-50, 50))


def test_seed_option_seeds_unseeded_requests(ckpt_factory):
    path = ckpt_factory("qwen3_5", fp8=True)[0]
    prompts = [[5, 9, 13], [7, 7, 8, 30], [100, 3]]

    def answers(seed):
        llm = pocketllm.LLM(path, backend="torch", quiet=True, max_context=64, max_batch_size=4, seed=seed)
        try:
            return [llm.generate(p, max_tokens=8, temperature=1.0, presence_penalty=0.5, ignore_eos=True)["token_ids"]
                    for p in prompts]
        finally:
            llm.close()
    first = answers(7)
    assert answers(7) == first
    assert answers(8) != first


def _row(seed: int, slot: int, vocab: int, **params) -> "pocketllm.SampleRow":
    req = pocketllm.Request(f"r{seed}", [1, 2], pocketllm.SamplingParams(seed=seed, **params).validate(vocab), 0)
    seq = pocketllm.Sequence(req, 0)
    seq.slot = slot
    return pocketllm.SampleRow(seq, slot, pocketllm.prepare_row_params(req.params, [], vocab))


def test_allowed_token_ids_sample_the_renormalised_softmax_at_temperature_1():
    """allowed_token_ids: the other tokens never come; the allowed ones follow softmax renormalised over them
    (chi-square against the float64 reference), beside rows without the option in the same batch."""
    V, N = 8, 20_000
    logits = torch.tensor([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0])
    allowed = [1, 3, 4, 7]
    sampler = pocketllm.Sampler(N, V, "cpu")
    rows = [_row(100 + i, i, V, temperature=1.0, allowed_token_ids=allowed if i % 2 else None) for i in range(N)]
    tokens = torch.tensor(sampler.sample(rows, logits.expand(N, V).clone()).tokens)
    restricted, free = tokens[1::2], tokens[0::2]
    assert set(restricted.tolist()) <= set(allowed)
    p = torch.softmax(logits.double(), -1)[allowed]
    counts = torch.bincount(restricted, minlength=V).double()[allowed]
    expected = len(restricted) * p / p.sum()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (chi2, counts.tolist(), expected.tolist())       # chi-square, 3 dof, p = 0.001
    assert set(free.tolist()) - set(allowed)                              # the other rows are not restricted


def test_allowed_token_ids_greedy_takes_the_best_allowed_and_drafts_obey():
    V = 8
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0]])
    sampler = pocketllm.Sampler(1, V, "cpu")
    assert sampler.sample([_row(1, 0, V, temperature=0.0, allowed_token_ids=[6, 3])], logits.clone()).tokens == [3]
    drafts, q = sampler.draw_drafts([_row(2, 0, V, temperature=1.0, allowed_token_ids=[5, 6])], logits.clone())
    assert drafts[0] in (5, 6) and float(q[0, [5, 6]].sum()) == pytest.approx(1.0)


def test_allowed_token_ids_are_checked():
    for bad, match, param in (([], "at least one token id", "allowed_token_ids"),
                              ([8], "between 0 and 7", "allowed_token_ids[0]"),       # a bad id: named by its index
                              (["1"], "integer", "allowed_token_ids[0]"), (3, "array", "allowed_token_ids")):
        with pytest.raises(pocketllm.RequestError, match=match) as e:
            pocketllm.SamplingParams(allowed_token_ids=bad).validate(8)
        assert e.value.param == param
