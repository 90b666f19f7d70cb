"""The torch backend's prefill ops against float64 computed from scratch.

Paged attention (TorchOps.attention with more query rows than sequences): chunks of any length starting anywhere
in a block, GQA, float32 and bfloat16 caches, block tables that run through consecutive blocks (read in place) or
are scattered (gathered), and mixed steps of prefill chunks and single decode rows. The chunked gated delta rule
(prefill_delta_chunked) against the rule token by token."""

import pytest
import torch

import pocketllm

BS = 16                                       # tokens per KV block
NUM_BLOCKS = 64


def ref_attention(q, k, v, scale):
    """float64 causal attention of q (m, Hq, D), the last m of the n positions of k, v (n, Hk, D)."""
    m, Hq, _ = q.shape
    n, Hk, _ = k.shape
    kr, vr = (t.double().repeat_interleave(Hq // Hk, 1) for t in (k, v))     # (n, Hq, D)
    s = torch.einsum("mhd,nhd->hmn", q.double(), kr) * scale
    row, col = torch.arange(m)[:, None], torch.arange(n)[None, :]
    s = s.masked_fill(col > n - m + row, float("-inf"))
    return torch.einsum("hmn,nhd->mhd", s.softmax(-1), vr)


def make_table(kind: str, nb: int, gen) -> torch.Tensor:
    """A sequence's block table: `run` consecutive blocks (as a fresh pool hands out), `few` three runs, `scattered`
    a random permutation (more runs than TorchOps reads in place)."""
    if kind == "run":
        return torch.arange(3, 3 + nb)
    if kind == "few":
        cut1, cut2 = nb // 3, 2 * nb // 3
        return torch.cat([torch.arange(40, 40 + cut1), torch.arange(5, 5 + cut2 - cut1),
                          torch.arange(20, 20 + nb - cut2)])
    return torch.randperm(NUM_BLOCKS, generator=gen)[:nb]


def paged(k, table, dtype):
    """Sequence rows k (n, Hk, D) written into a paged cache (NUM_BLOCKS, BS, Hk, D) at the table's blocks."""
    cache = torch.randn(NUM_BLOCKS, BS, *k.shape[1:]).to(dtype)        # other blocks hold noise
    pos = torch.arange(k.shape[0])
    cache.view(-1, *k.shape[1:])[table[pos // BS] * BS + pos % BS] = k.to(dtype)
    return cache


# (context length n, rows m) per sequence: chunks starting mid-block, ending mid-block, one row, the whole prompt.
CHUNKS = [(37, 37), (100, 63), (300, 1), (513, 512), (700, 33), (16, 5)]
TOL = {torch.float32: 5e-6, torch.bfloat16: 1.5e-2}


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hk", [(4, 2), (2, 1), (4, 4)])
@pytest.mark.parametrize("kind", ["run", "few", "scattered"])
def test_prefill_chunks_match_float64(kv_dtype, Hq, Hk, kind):
    """Each chunk alone (one sequence per call) within TOL of float64 over the cache's own values: float32 to
    5e-6 (sums in another order); bf16 to 1.5e-2 (q is rounded to bf16 and each piece's output too, as before)."""
    gen = torch.Generator().manual_seed(Hq * 10 + Hk)
    D, ops = 128, pocketllm.TorchOps()
    for n, m in CHUNKS:
        table = make_table(kind, -(-n // BS), gen)
        k, v = torch.randn(n, Hk, D, generator=gen), torch.randn(n, Hk, D, generator=gen)
        k_cache, v_cache = paged(k, table, kv_dtype), paged(v, table, kv_dtype)
        q = torch.randn(m, Hq, D, generator=gen)
        got = ops.attention(q, k_cache, v_cache, table[None].int(), torch.tensor([n]), torch.tensor([0, m]), D ** -0.5)
        qr = q.to(kv_dtype).float()                                  # the bf16 path rounds q as it reads it
        want = ref_attention(qr, k.to(kv_dtype), v.to(kv_dtype), D ** -0.5)
        err = (got.double() - want).abs().max().item()
        assert err <= TOL[kv_dtype], (n, m, err)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_a_mixed_step_of_prefill_chunks_and_decode_rows(kv_dtype):
    """One call over five sequences of one step, as the engine batches them: a first chunk, a resumed chunk
    starting mid-sequence (a prefix-cache hit), two decode rows and a verify window of 3 rows, each on its own
    table (consecutive, three runs, scattered), in one shared cache."""
    gen = torch.Generator().manual_seed(7)
    Hq, Hk, D, ops = 4, 2, 64, pocketllm.TorchOps()
    seqs = [(45, 45, "run"), (260, 100, "few"), (90, 1, "scattered"), (17, 1, "run"), (130, 3, "scattered")]
    k_cache = torch.randn(NUM_BLOCKS * len(seqs), BS, Hk, D).to(kv_dtype)
    v_cache = torch.randn(NUM_BLOCKS * len(seqs), BS, Hk, D).to(kv_dtype)
    width = max(-(-n // BS) for n, _, _ in seqs)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for b, (n, _, kind) in enumerate(seqs):
        t = make_table(kind, -(-n // BS), gen) + b * NUM_BLOCKS       # each sequence in its own blocks
        tables[b, :len(t)] = t
    lens = torch.tensor([n for n, _, _ in seqs])
    starts = torch.tensor([0] + [m for _, m, _ in seqs]).cumsum(0)
    q = torch.randn(int(starts[-1]), Hq, D, generator=gen)
    got = ops.attention(q, k_cache, v_cache, tables, lens, starts, D ** -0.5)
    for b, (n, m, _) in enumerate(seqs):
        pos = torch.arange(n)
        slots = tables[b, pos // BS].long() * BS + pos % BS
        k, v = k_cache.view(-1, Hk, D)[slots], v_cache.view(-1, Hk, D)[slots]
        want = ref_attention(q[starts[b]:starts[b + 1]].to(kv_dtype).float(), k, v, D ** -0.5)
        assert (got[starts[b]:starts[b + 1]].double() - want).abs().max().item() <= TOL[kv_dtype]


@pytest.mark.parametrize("long_decode", [64, 2048])
def test_decode_rows_past_the_long_context_bound_match_float64(long_decode):
    """Decode rows (one per sequence) of contexts long enough for the per-sequence in-place path
    (TorchOps.LONG_DECODE, lowered here to 64 so that small contexts take it) and not: consecutive, three-run and
    scattered tables, within 5e-6 of float64."""
    gen = torch.Generator().manual_seed(3)
    Hq, Hk, D, ops = 4, 2, 64, pocketllm.TorchOps()
    ops.LONG_DECODE = long_decode
    lens = [700, 65, 300]
    k_cache, v_cache = torch.randn(NUM_BLOCKS * 3, BS, Hk, D), torch.randn(NUM_BLOCKS * 3, BS, Hk, D)
    tables = torch.zeros(3, -(-max(lens) // BS), dtype=torch.int32)
    for b, (n, kind) in enumerate(zip(lens, ["run", "few", "scattered"])):
        t = make_table(kind, -(-n // BS), gen) + b * NUM_BLOCKS
        tables[b, :len(t)] = t
    q = torch.randn(3, Hq, D, generator=gen)
    for rows in ([0], [0, 1, 2]):
        got = ops.attention(q[rows], k_cache, v_cache, tables[rows], torch.tensor(lens)[rows],
                            torch.arange(len(rows) + 1), D ** -0.5)
        for i, b in enumerate(rows):
            pos = torch.arange(lens[b])
            slots = tables[b, pos // BS].long() * BS + pos % BS
            want = ref_attention(q[b:b + 1], k_cache.view(-1, Hk, D)[slots], v_cache.view(-1, Hk, D)[slots], D ** -0.5)
            assert (got[i:i + 1].double() - want).abs().max().item() <= TOL[torch.float32], (long_decode, rows, b)


def test_a_run_of_blocks_is_read_in_place_and_a_scattered_table_is_gathered_once():
    """The earlier positions of a chunk come as views of the cache while the block table runs through consecutive
    blocks (no copy of a long prompt's K and V per chunk), one piece per run, and as one copy past max_spans."""
    ops, gen = pocketllm.TorchOps(), torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(NUM_BLOCKS, BS, 2, 8), torch.randn(NUM_BLOCKS, BS, 2, 8)
    for kind, pieces, in_place in (("run", 1, True), ("few", 3, True), ("scattered", 1, False)):
        table = make_table(kind, 40, gen)
        got = ops._kv_spans(k_cache, v_cache, table, 630)
        assert len(got) == pieces and sum(k.shape[0] for k, _ in got) == 630
        assert all((k.untyped_storage().data_ptr() == k_cache.untyped_storage().data_ptr()) == in_place
                   for k, _ in got)
        pos = torch.arange(630)
        want = k_cache.view(-1, 2, 8)[table[pos // BS] * BS + pos % BS]
        assert torch.equal(torch.cat([k for k, _ in got]), want)


def ref_delta_rule(q, k, v, g, beta, S):
    """The gated delta rule token by token in float64: S <- S exp(g); S += k^T beta (v - k S); o = q S."""
    q, k, v, g, beta, S = (t.double() for t in (q, k, v, g, beta, S))
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        S = S * g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))    # (H, Dv)
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], S)
    return out, S


@pytest.mark.parametrize("m,chunk", [(1, 64), (63, 64), (64, 64), (65, 64), (200, 64), (512, 64), (100, 32)])
def test_prefill_delta_chunked_matches_the_rule_token_by_token(m, chunk):
    """Outputs and final state within 2e-5 of float64 (fp32 sums; values of order 1), from a nonzero state, for
    a chunk shorter than, equal to and past the chunk size (the padded last chunk)."""
    gen = torch.Generator().manual_seed(m)
    H, Dk, Dv = 4, 64, 32
    q, k = (torch.nn.functional.normalize(torch.randn(m, H, Dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(m, H, Dv, generator=gen)
    g = -torch.rand(m, H, generator=gen) * 0.3                      # log-decays
    beta = torch.rand(m, H, generator=gen)
    S = torch.randn(H, Dk, Dv, generator=gen) * 0.3
    out, state = pocketllm.prefill_delta_chunked(q, k, v, g, beta, S, chunk)
    want_out, want_state = ref_delta_rule(q, k, v, g, beta, S)
    assert out.shape == (m, H, Dv) and state.shape == (H, Dk, Dv)
    assert (out.double() - want_out).abs().max().item() <= 2e-5
    assert (state.double() - want_state).abs().max().item() <= 2e-5
