"""Speculative decoding with the checkpoint's MTP layer (--speculative-tokens, issue 25).

What must hold: greedy output token-for-token identical to decoding without speculation (every checkpoint kind,
stop tokens, max_tokens inside a window, n > 1, logprobs, preemption, aborts, tensor-parallel CPU ranks); the
GDN states after a rolled-back window equal the states after decoding the kept tokens (torch and native ops);
sampled output distributed as the target's (a chi-square test on a small vocabulary).

Random MTP layers almost never guess right, so the tests that need accepted drafts replace the drafts, after the
real MTP pass ran, by the target's own continuation with deliberate mistakes ("oracle drafts"): the verify, the
acceptance bookkeeping and the rollback then see every pattern of accepted and rejected drafts. The bundled
pocket-tiny has a trained MTP layer, so its end-to-end test runs the drafts as they come.
"""

from __future__ import annotations

import math
import threading
import types

import pytest
import torch

import pocketllm as pl

K = 3


def _llm(path, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("gpu_memory_utilization", 0.1)   # on a GPU (the GPU check): several engines share the card
    return pl.LLM(path, quiet=True, **kw)


def _run(llm, prompts, **params):
    """Submit every prompt at once (one continuous batch); returns per prompt the list of choices' token ids
    and logprobs."""
    streams = [llm.submit(p, pl.SamplingParams(**params)) for p in prompts]
    out = []
    for stream in streams:
        choices: dict[int, list] = {}
        logprobs: dict[int, list] = {}
        for ev in stream:
            choices.setdefault(ev.index, []).extend(ev.token_ids)
            if ev.logprobs:
                logprobs.setdefault(ev.index, []).extend(ev.logprobs)
        out.append(([choices[i] for i in sorted(choices)], [logprobs.get(i) for i in sorted(choices)]))
    return out


PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 57)), [101, 7, 101, 7, 33]]


def oracle(llm, truth: dict, wrong_every: int = 3):
    """Replace the engine's drafts (after its real MTP pass) by the target's own continuation `truth[(prompt,
    index)]`, wrong at every `wrong_every`-th position of the sequence, so windows accept 0..K drafts."""
    engine = llm.engine
    real = engine._draft

    def draft(self, plan, kept):
        real(plan, kept)
        for p in plan:
            seq = p.seq
            want = truth.get((tuple(seq.request.prompt_ids), seq.index))
            if not seq.drafts or want is None:
                continue
            n = len(seq.output_ids)
            good = want[n:n + len(seq.drafts)]
            seq.drafts = [t if (n + i) % wrong_every else (t + 1) % llm.config.vocab_size
                          for i, t in enumerate(good)]
            seq.draft_probs = None
    engine._draft = types.MethodType(draft, engine)
    return engine


def _same(want, got):
    """The same token ids for every choice, and the same logprobs (token, value within 1e-4, top ids)."""
    for (ids_w, lp_w), (ids_g, lp_g) in zip(want, got):
        assert ids_g == ids_w
        for a, b in zip(lp_w, lp_g):
            assert (a is None) == (b is None)
            for x, y in zip(a or [], b or []):
                assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
                assert [t[0] for t in x.top] == [t[0] for t in y.top]


def _truth(results, prompts):
    return {(tuple(p), i): ids for p, (choices, _) in zip(prompts, results) for i, ids in enumerate(choices)}


# ---- Exact greedy output ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", [("qwen3_5", False), ("qwen3_5", True), ("qwen3_5_text", False), ("qwen3", False)],
                         ids=["qwen3_5", "qwen3_5-fp8", "qwen3_5_text", "qwen3"])
def test_greedy_identical_to_unspeculated(ckpt_factory, kind):
    model_type, fp8 = kind
    path, _ = ckpt_factory(model_type, fp8=fp8, mtp=True)
    params = dict(max_tokens=23, temperature=0, ignore_eos=True, logprobs=2, n=2)
    base = _llm(path, speculative_tokens=0)
    want = _run(base, PROMPTS, **params)
    base.close()
    llm = _llm(path, speculative_tokens=K)
    assert llm.engine.draft_tokens == (0 if model_type == "qwen3" else K)   # qwen3 has no MTP layer
    got = _run(llm, PROMPTS, **params)
    stats = llm.stats()
    llm.close()
    _same(want, got)
    if model_type != "qwen3":
        assert stats["draft_tokens_total"] > 0


@pytest.mark.parametrize("missing", ["mtp.pre_fc_norm_embedding.weight", "mtp.layers.0.self_attn.o_proj.weight"])
def test_an_incomplete_mtp_layer_serves_without_speculation(ckpt_factory, tmp_path, capsys, missing):
    """A checkpoint that lacks one of the MTP layer's tensors loads, says in one start-up line which tensor is
    missing, and serves what the complete checkpoint serves without speculation."""
    import shutil
    from safetensors.torch import load_file, save_file
    src, _ = ckpt_factory("qwen3_5_text", mtp=True)
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    state = load_file(str(path / "model.safetensors"))
    del state[missing]
    save_file(state, str(path / "model.safetensors"))
    params = dict(max_tokens=12, temperature=0, ignore_eos=True)
    base = _llm(src, speculative_tokens=0)
    want = _run(base, PROMPTS, **params)
    base.close()
    capsys.readouterr()
    llm = pl.LLM(path, dtype="float32", speculative_tokens=K)
    said = [line for line in capsys.readouterr().err.splitlines() if "speculative" in line]
    assert said == [f"pocketllm: speculative decoding off: the checkpoint's MTP layer is incomplete (missing tensor "
                    f"'{missing}')"]
    assert llm.model.mtp is None and llm.engine.draft_tokens == 0
    assert _run(llm, PROMPTS, **params) == want
    llm.close()


@pytest.mark.parametrize("wrong_every", [2, 3, 5])
def test_oracle_drafts_accept_and_roll_back_exactly(ckpt_factory, wrong_every):
    """Drafts that are right except at chosen positions: every window accepts exactly its right prefix, the
    output is the unspeculated one (so the GDN rollback left the states exact), and the counters say so."""
    path, _ = ckpt_factory("qwen3_5", mtp=True)
    params = dict(max_tokens=26, temperature=0, ignore_eos=True, logprobs=1, n=2)
    base = _llm(path, speculative_tokens=0)
    want = _run(base, PROMPTS, **params)
    base.close()
    llm = _llm(path, speculative_tokens=K)
    oracle(llm, _truth(want, PROMPTS), wrong_every)
    got = _run(llm, PROMPTS, **params)
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["slots_used"] == 0
    llm.close()
    _same(want, got)
    assert stats["accepted_tokens_total"] > 0
    assert stats["accepted_tokens_total"] < stats["draft_tokens_total"]
    # Each step emits its accepted drafts plus one target token.
    assert stats["generation_tokens_total"] == stats["accepted_tokens_total"] + stats["target_forwards_total"]
    if wrong_every == 5:
        assert stats["generation_tokens_total"] / stats["target_forwards_total"] > 2


def test_stop_token_and_max_tokens_inside_a_window(ckpt_factory):
    path, _ = ckpt_factory("qwen3_5", mtp=True)
    base = _llm(path, speculative_tokens=0)
    free = _run(base, PROMPTS, max_tokens=30, temperature=0, ignore_eos=True)
    truth = _truth(free, PROMPTS)
    stop = free[1][0][0][13]                                   # a token the second prompt emits at index 13
    cases = [dict(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, 2, 5, 6, 7)] + \
            [dict(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=[stop])]
    want = [_run(base, PROMPTS, **c) for c in cases]
    base.close()
    llm = _llm(path, speculative_tokens=K)
    oracle(llm, truth, wrong_every=7)
    for c, w in zip(cases, want):
        _same(w, _run(llm, PROMPTS, **c))
    llm.close()


def test_preemption_and_abort_keep_outputs_and_free_everything(ckpt_factory):
    """Few KV blocks: sequences are preempted mid-speculation and recomputed; an aborted request frees its
    blocks and slot; the outputs stay the unspeculated ones."""
    path, _ = ckpt_factory("qwen3_5", mtp=True)
    opts = dict(num_kv_blocks=9, kv_block_size=8, max_batch_size=4, max_context=64)
    prompts = [list(range(10 + i, 30 + i)) for i in range(4)]
    params = dict(max_tokens=28, temperature=0, ignore_eos=True)
    base = _llm(path, speculative_tokens=0, **opts)
    want = _run(base, prompts, **params)
    base.close()
    llm = _llm(path, speculative_tokens=K, **opts)
    oracle(llm, _truth(want, prompts), wrong_every=4)
    _same(want, _run(llm, prompts, **params))
    stream = llm.submit(prompts[0], pl.SamplingParams(**params))
    for ev in stream:
        if ev.token_ids:
            stream.abort()
            break
    for _ in stream:
        pass
    deadline = threading.Event()
    for _ in range(100):
        if llm.stats()["kv_blocks_used"] == 0 and llm.stats()["slots_used"] == 0:
            break
        deadline.wait(0.05)
    assert llm.stats()["kv_blocks_used"] == 0 and llm.stats()["slots_used"] == 0
    llm.close()


@pytest.mark.slow
def test_tensor_parallel_cpu_ranks(ckpt_factory):
    path, _ = ckpt_factory("qwen3_5", mtp=True)
    params = dict(max_tokens=20, temperature=0, ignore_eos=True, n=2)
    base = _llm(path, speculative_tokens=0)
    want = _run(base, PROMPTS, **params)
    base.close()
    llm = _llm(path, speculative_tokens=K, devices="cpu,cpu")
    assert llm.engine.draft_tokens == K
    oracle(llm, _truth(want, PROMPTS), wrong_every=3)
    got = _run(llm, PROMPTS, **params)
    stats = llm.stats()
    llm.close()
    _same(want, got)
    assert stats["accepted_tokens_total"] > 0


# ---- The GDN states of a rolled-back window ----------------------------------------------------------------

def _batch(model, rows, block_size=16):
    """rows: (tokens, start, slot, blocks) per sequence -> a Batch with logits at every position."""
    ids, pos, slot_map, starts, ctx, logit = [], [], [], [0], [], []
    for tokens, start, slot, blocks in rows:
        positions = range(start, start + len(tokens))
        ids += tokens
        pos += positions
        slot_map += [blocks[i // block_size] * block_size + i % block_size for i in positions]
        starts.append(starts[-1] + len(tokens))
        ctx.append(start + len(tokens))
    width = max(len(r[3]) for r in rows)
    t = torch.tensor
    return pl.Batch(t(ids), t(pos), t(starts, dtype=torch.int32), t(ctx, dtype=torch.int32),
                    t([r[3] + [0] * (width - len(r[3])) for r in rows], dtype=torch.int32), t(slot_map),
                    t([r[2] for r in rows], dtype=torch.int32), t(list(range(len(ids)))),
                    t([r[2] for r in rows if r[1] == 0], dtype=torch.long))


def _ops(backend):
    if backend == "torch":
        return pl.TorchOps()
    import build
    build.build(cpu=True, quiet=True)
    return pl.NativeOps("cpu")


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_rollback_leaves_the_states_of_the_kept_tokens(ckpt_factory, backend):
    """Two sequences verify 4-token windows and keep 2 and 4 of them: their conv and SSM states and the next
    step's logits equal those of decoding the kept tokens one at a time."""
    path, _ = ckpt_factory("qwen3_5", mtp=True)
    ckpt = pl.Checkpoint(path)
    model = pl.Model(ckpt, _ops(backend), torch.float32, torch.device("cpu"), mtp=True, progress=False)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
    windows = [[12, 13, 99, 98], [43, 44, 45, 46]]
    kept = [2, 4]
    blocks = [[0, 1], [2, 3]]

    def fresh():
        cache = pl.allocate_cache(model.cfg, model.cache_layers, 4, 16, 2, torch.float32, "cpu")
        model.forward(_batch(model, [(p, 0, s, blocks[s]) for s, p in enumerate(prompts)]), cache)
        return cache

    ref = fresh()                                             # decode the kept tokens one at a time
    for i in range(max(kept)):
        rows = [([w[i]], len(p) + i, s, blocks[s]) for s, (p, w) in enumerate(zip(prompts, windows)) if i < kept[s]]
        model.forward(_batch(model, rows), ref)
    spec = fresh()                                            # one window each, then the rollback
    batch = _batch(model, [(w, len(p), s, blocks[s]) for s, (p, w) in enumerate(zip(prompts, windows))])
    window = pl.VerifyWindow(torch.tensor([0, 1]), torch.arange(8), [4, 4])
    model.open_window(spec, window)
    model.hidden(batch, spec)
    model.rollback(spec, kept)
    assert spec.window is None
    for i in ref.conv:
        torch.testing.assert_close(spec.conv[i], ref.conv[i], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(spec.ssm[i], ref.ssm[i], atol=1e-5, rtol=1e-4)
    nxt = [([7], len(p) + n, s, blocks[s]) for s, (p, n) in enumerate(zip(prompts, kept))]
    torch.testing.assert_close(model.forward(_batch(model, nxt), spec), model.forward(_batch(model, nxt), ref),
                               atol=1e-4, rtol=1e-4)


# ---- Sampling: the rejection rule keeps the target's distribution ---------------------------------------

def _seq(seed, slot, prompt=(1, 2, 3), **params):
    req = pl.Request(f"r{seed}", list(prompt), pl.SamplingParams(seed=seed, **params), 0)
    seq = pl.Sequence(req, 0)
    seq.slot = slot
    return seq


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Upper tail of Pearson's chi-square statistic (Wilson-Hilferty normal approximation)."""
    n = counts.sum().item()
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token the target gives probability 0 was emitted"
    exp = probs[keep] * n
    stat = ((counts[keep] - exp) ** 2 / exp).sum().item()
    k = int(keep.sum()) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("filters", [{}, {"top_k": 4}, {"top_p": 0.8, "presence_penalty": 0.7}])
def test_rejection_sampling_emits_the_target_distribution(filters):
    """N sequences (their own seeds) each draft one token from a q unlike the target p and verify it: the
    first emitted token is distributed as p (after the sampler's own penalties and filters)."""
    V, N = 7, 6000
    target = torch.tensor([2.0, 1.2, 0.3, 0.0, -0.5, 1.0, -2.0])
    draft = torch.tensor([-1.0, 0.5, 2.0, 1.5, 0.0, -0.5, 1.0])
    sampler = pl.Sampler(N, V, "cpu")
    seqs = [_seq(1000 + i, i, temperature=1.0, **filters) for i in range(N)]
    prepared = pl.prepare_row_params(seqs[0].params, [], V)
    d_rows = [pl.SampleRow(s, i, prepared) for i, s in enumerate(seqs)]
    drafts, q = sampler.draw_drafts(d_rows, draft.expand(N, V))
    rows = [pl.SampleRow(s, i, prepared, [], d, q[i]) for i, (s, d) in enumerate(zip(seqs, drafts))]
    out = sampler.sample(rows, target.expand(N, V).clone())
    # The target distribution as the sampler defines it, from one row without a draft.
    raw, x, *_ = pl.Sampler(1, V, "cpu").scores([pl.SampleRow(_seq(7, 0, temperature=1.0, **filters), 0, prepared)],
                                                target[None].clone())
    p = x.softmax(-1)[0]
    counts = torch.bincount(torch.tensor(out.tokens), minlength=V).double()
    assert _chi_square_p(counts, p.double()) > 1e-3, (counts / N, p)
    rate = sum(out.accepted) / N
    overlap = torch.minimum(p, q[0]).sum().item()             # the expected acceptance rate: sum min(p, q)
    assert abs(rate - overlap) < 4 * math.sqrt(overlap * (1 - overlap) / N) + 1e-9


def test_window_rows_see_their_drafts_as_generated():
    """A window row's penalties, min_tokens bans, logits processors and seed step read the output plus the
    drafts before it: the same scores as a sequence that had already emitted them."""
    V = 11
    seen = []

    def proc(ids, row):
        seen.append(list(ids))
        return row
    params = dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                  min_tokens=4, logits_processors=[proc])
    spec, plain = _seq(5, 0, **params), _seq(5, 0, **params)
    spec.output_ids, plain.output_ids = [3], [3, 4, 4]
    prepared = pl.prepare_row_params(spec.params, [1], V)
    logits = torch.linspace(-1, 1, V)[None]
    a = pl.Sampler(1, V, "cpu").scores([pl.SampleRow(spec, 0, prepared, [4, 4])], logits.clone())
    b = pl.Sampler(1, V, "cpu").scores([pl.SampleRow(plain, 0, prepared)], logits.clone())
    torch.testing.assert_close(a[1], b[1])
    torch.testing.assert_close(vars(a[2]), vars(b[2]))       # the same uniform: the same counter step
    assert seen == [[3, 4, 4], [3, 4, 4]]


# ---- The bundled pocket-tiny, with its trained MTP layer -----------------------------------------------------

def test_speculation_default_is_per_device():
    """On by default on a GPU, off on the CPU (docs/benchmarks.md measures both); an explicit K is kept."""
    assert pl.EngineOptions(device="cuda:1").speculative_tokens == pl.GPU_SPECULATIVE_TOKENS > 0
    assert pl.EngineOptions(devices="0,1").speculative_tokens == pl.GPU_SPECULATIVE_TOKENS
    assert pl.EngineOptions(device="cpu").speculative_tokens == 0
    assert pl.EngineOptions(devices="cpu,cpu").speculative_tokens == 0
    assert pl.EngineOptions(device="cpu", speculative_tokens=2).speculative_tokens == 2
    flags = pl.engine_options(pl.parse_command_line(["--device", "cpu"]))
    assert flags["speculative_tokens"] is None                        # resolved by EngineOptions, as above


def test_pocket_tiny_speculates_at_the_gpu_default_and_matches():
    llm = pl.LLM(quiet=True, gpu_memory_utilization=0.1, speculative_tokens=pl.GPU_SPECULATIVE_TOKENS)
    if llm.model.mtp is None:
        llm.close()
        pytest.fail("models/pocket-tiny has no MTP layer: run tests/fixtures/train_pocket_tiny.py --mtp-only")
    assert llm.engine.draft_tokens == pl.GPU_SPECULATIVE_TOKENS
    messages = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    got = llm.chat(messages, tools=tools, max_tokens=80, temperature=0)
    again = llm.chat(messages, tools=tools, max_tokens=80, temperature=0, tool_choice="required")
    stats = llm.stats()
    llm.close()
    base = pl.LLM(quiet=True, speculative_tokens=0, gpu_memory_utilization=0.1)
    want = base.chat(messages, tools=tools, max_tokens=80, temperature=0)
    want_again = base.chat(messages, tools=tools, max_tokens=80, temperature=0, tool_choice="required")
    base.close()
    def message(response):                                  # tool-call ids are random
        m = dict(response["choices"][0]["message"])
        m["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in m.get("tool_calls") or []]
        return m
    assert message(got) == message(want)
    assert message(again) == message(want_again)
    assert message(again)["tool_calls"]
    assert stats["accepted_tokens_total"] / stats["draft_tokens_total"] > 0.3


def test_speculative_tokens_flag():
    args = pl.parse_command_line(["--speculative-tokens", "2"])
    assert pl.engine_options(args)["speculative_tokens"] == 2
    with pytest.raises(pl.PocketError, match="speculative-tokens"):
        pl.LLM(quiet=True, speculative_tokens=-1)
