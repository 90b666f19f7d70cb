"""The prefix cache (section 5): a prompt that starts like an earlier one resumes from cached KV blocks and
recurrent-state snapshots, and prefills only the rest. Exactness: every engine below runs the same requests with
the cache on and off (LLM(prefix_cache=False)), on the torch backend in float32, and the answers are the same:
identical tokens (greedy, and seeded temperature-1 sampling with penalties) and every sampled row's logits within
1e-5 relative (max |on - off| / max |off|; the only difference is where prefill chunks split, which reorders
float32 sums). Cases: qwen3_5 (hybrid) and qwen3 (attention only) random checkpoints, whole and chunked
prefill, n > 1 forks, preemption, aborts, tensor-parallel CPU ranks. Every cache-on engine also checks, at each
KV write, that no written block is shared, and ends with nothing held: every block free or cached, every slot
free (the existing leak checks: `kv_blocks_used == 0`, all refs 0).
"""

from __future__ import annotations

import random
import urllib.request

import pytest
import torch

import pocketllm
from conftest import drain

BS = 16
# float32 rounding: the cache changes how a context is split into steps and batches, so the kernels sum in another
# order; 1.6e-5 relative was seen on one CI machine (1e-5 before). A wrong snapshot changes the logits far more.
REL = 1e-4


def make(path, **opts):
    opts = {"backend": "torch", "dtype": "float32", "quiet": True, "max_context": 320, "max_batch_size": 4, **opts}
    return pocketllm.LLM(path, **opts)


class Observed:
    """An LLM whose engine is stepped here, by hand: the rows the sampler reads (logits per request and
    choice) are recorded, and with the prefix cache on, every KV write is checked to touch only blocks that
    one sequence holds. Observation only: the model, engine and sampler are the real ones. With async
    scheduling a row is sampled before the host has its sequence's previous token (row.unread), so a row's
    context is read once the run is over, and the row that a sequence finished before is left out (its token
    is dropped, as the engine without overlap never samples it)."""

    def __init__(self, llm):
        self.llm, self.engine = llm, llm.engine
        self.logits: dict[tuple[str, int], list[torch.Tensor]] = {}
        self.contexts: dict[tuple[str, int], list[tuple[int, ...]]] = {}   # the tokens each row's logits follow
        self.outputs: dict[tuple[str, int], list[int]] = {}                # prompt + generated tokens per choice
        self.shared_writes: list[int] = []
        self.rows: list[tuple[pocketllm.SampleRow, torch.Tensor]] = []      # sampled this run, with their logits
        sample = self.engine.sampler.sample_on_device

        def record(rows, logits):
            self.rows += [(row, logits[row.logit_row].clone()) for row in rows]
            return sample(rows, logits)
        self.engine.sampler.sample_on_device = record
        ops = llm.model.ops
        kv_write = ops.kv_write

        def checked_write(k, v, k_cache, v_cache, slot_mapping):
            refs = self.engine.blocks.refs
            self.shared_writes += [b for b in (slot_mapping // k_cache.shape[1]).tolist() if refs[b] != 1]
            return kv_write(k, v, k_cache, v_cache, slot_mapping)
        if llm.group is None:
            ops.kv_write = checked_write

    def run(self, requests: list[pocketllm.Request], abort_after: dict[str, int] | None = None) -> list[list[list[int]]]:
        """Add the requests, step until idle (aborting request id after its step count), and return each
        request's choices' tokens."""
        for req in requests:
            req.params.validate(self.llm.config.vocab_size)
            self.engine.add(req)
        steps = 0
        while self.engine.has_work():
            self.engine.step()
            steps += 1
            for rid, at in (abort_after or {}).items():
                if steps == at:
                    self.engine.abort(rid)
        for row, logits in self.rows:
            seq, key = row.seq, (row.seq.request.id, row.seq.index)
            if row.unread and row.emitted >= len(seq.output_ids):
                continue                                   # sampled after its sequence finished: dropped
            self.logits.setdefault(key, []).append(logits)
            before = seq.output_ids[:row.emitted - len(row.ahead)]
            self.contexts.setdefault(key, []).append(tuple(seq.request.prompt_ids + before + row.ahead))
        self.rows = []
        out = []
        for req in requests:
            tokens = drain(req)[0]
            out.append(tokens)
            for i, t in enumerate(tokens):
                self.outputs[(req.id, i)] = req.prompt_ids + t
        return out


def request(rid: str, prompt: list[int], **sampling) -> pocketllm.Request:
    return pocketllm.Request(rid, prompt, pocketllm.SamplingParams(**sampling), default_seed=11)


def assert_close(a: torch.Tensor, b: torch.Tensor, what):
    err = ((a - b).abs().max() / b.abs().max()).item()
    assert err <= REL, f"{what}: logits differ by {err:.3g} relative"


def assert_same_logits(on: Observed, off: Observed):
    assert on.logits.keys() == off.logits.keys()
    for key, rows in off.logits.items():
        assert len(on.logits[key]) == len(rows), key
        for i, (a, b) in enumerate(zip(on.logits[key], rows)):
            assert_close(a, b, f"{key} token {i}")


def assert_same_logits_by_context(on: Observed, off: Observed):
    """Speculation under preemption: which windows verify which drafts depends on when blocks run out, so the
    two engines sample different rows. Every emitted token's row (the logits after the choice's own tokens) is
    in both, and every row both computed after the same tokens has the same logits."""
    assert on.outputs == off.outputs
    for key, final in off.outputs.items():
        rows = [dict(zip(o.contexts[key], o.logits[key])) for o in (on, off)]
        for context in rows[0].keys() & rows[1].keys():
            assert_close(rows[0][context], rows[1][context], f"{key} after {len(context)} tokens")
        for r in rows:
            emitted = {c for c in r if tuple(final[:len(c)]) == c and len(c) < len(final)}
            assert len(emitted) == len(final) - min(map(len, r)), key   # one row per generated token


def assert_nothing_held(llm):
    """No block or slot held by a request: every block free or cached (evictable), refs all 0, slots free."""
    e = llm.engine
    stats = llm.stats()
    assert stats["running"] == stats["waiting"] == 0
    assert stats["kv_blocks_used"] == 0 and e.blocks.refs == [0] * e.blocks.total
    assert sorted(e.blocks.free + list(e.blocks.cached)) == list(range(e.blocks.total))
    assert stats["slots_used"] == 0 and sorted(e.slots.free) == list(range(e.slots.total))
    if e.prefix is not None:
        used = {s.slot for s in e.prefix.by_key.values() if s.slot is not None}
        assert len(used) == e.prefix.snapshots_used and not used & set(e.prefix.free_slots)
        assert sorted(used | set(e.prefix.free_slots)) == list(range(e.prefix.slots_total))


def common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---- The native op: row copies between cache tensors ----

def test_copy_rows_native_equals_torch_and_reference():
    """pl_copy_rows through NativeOps (CPU build) and TorchOps.copy_rows against plain indexing: across two
    tensors and within one, 16-byte rows and odd byte counts, fp32 and fp16."""
    import build
    build.build(cpu=True, quiet=True)         # skips, saying why, where the CPU test build cannot be made
    native, torch_ops = pocketllm.NativeOps("cpu"), pocketllm.TorchOps()
    g = torch.Generator().manual_seed(0)
    for dtype, row in ((torch.float32, (4, 8)), (torch.float32, (5, 7)), (torch.float16, (3, 3)),
                       (torch.float32, (48, 40))):
        src = torch.randn(6, *row, generator=g).to(dtype)
        dst = torch.randn(9, *row, generator=g).to(dtype)
        pairs = torch.tensor([[5, 0], [0, 8], [3, 2]])
        want = dst.clone()
        for s, d in pairs.tolist():
            want[d] = src[s]
        for ops in (native, torch_ops):
            out = dst.clone()
            ops.copy_rows(src, out, pairs[:, 0], pairs[:, 1])
            assert torch.equal(out, want), (ops.name, dtype, row)
            same = src.clone()                                   # within one tensor: 5 -> 1, 0 -> 4
            ops.copy_rows(same, same, torch.tensor([5, 0]), torch.tensor([1, 4]))
            ref = src.clone()
            ref[1], ref[4] = src[5], src[0]
            assert torch.equal(same, ref), (ops.name, dtype, row)
            ops.copy_rows(src, out, torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))
    with pytest.raises(pocketllm.PocketError, match="cannot go to rows"):
        native.copy_rows(torch.zeros(2, 4), torch.zeros(2, 5), torch.tensor([0]), torch.tensor([1]))


# ---- Exactness on an agent-like trace ----

def agent_turns(observed: Observed, tag: str, **sampling) -> list[tuple[list[int], list[int], int]]:
    """Five turns of a token-level agent session: (prompt, generated, cached_tokens) per turn.
    1: system + user + an assistant header of 3 tokens (as a generation prompt "<|im_start|>assistant\\n<think>\\n"
       is); 2: the history keeps only the header's first token (templates drop the empty reasoning) then the
    reply and a new user turn: it diverges inside turn 1's last tokens; 3: turn 2 + its reply + more, exactly
    (resumes at the end of the generation); 4: turn 3 resent; 5: the first 40 tokens of turn 1, then others."""
    rng = random.Random(5)
    toks = lambda n: [rng.randrange(5, 380) for _ in range(n)]  # noqa: E731
    system, user, header = toks(45), toks(11), toks(3)
    kw = dict(max_tokens=6, ignore_eos=True, **sampling)
    turns = []

    def turn(i, prompt):
        req = request(f"{tag}-{i}", prompt, **kw)
        (gen,), = observed.run([req])
        turns.append((prompt, gen, req.cached_tokens))
        return gen
    gen1 = turn(1, system + user + header)
    p2 = system + user + header[:1] + gen1 + [2] + toks(9) + header
    gen2 = turn(2, p2)
    p3 = p2 + gen2 + toks(7) + header
    turn(3, p3)
    turn(4, p3)
    turn(5, system[:40] + toks(20))
    return turns


MODES = {"whole": {}, "chunked": {"prefill_token_budget": 20}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3"])
def test_agent_turns_exact_and_resumed(ckpt_factory, model_type, mode):
    path = ckpt_factory(model_type)[0]
    on, off = Observed(make(path, **MODES[mode])), Observed(make(path, prefix_cache=False, **MODES[mode]))
    sampling = dict(temperature=1.0, seed=3, presence_penalty=0.4, repetition_penalty=1.2)
    for kw in (dict(temperature=0), sampling):
        tag = "greedy" if not kw["temperature"] else "sampled"
        got, want = agent_turns(on, tag, **kw), agent_turns(off, tag, **kw)
        assert [g for _, g, _ in got] == [g for _, g, _ in want]
        assert all(cached == 0 for _, _, cached in want)
        (p1, g1, c1), (p2, g2, c2), (p3, _, c3), (_, _, c4), _ = got
        assert c1 == 0 or tag == "sampled"                        # the second pass resumes turn 1 too
        assert c2 >= common(p2, p1) - BS                          # only the new tokens, plus at most one block
        assert c3 == len(p2) + len(g2) - 1                        # the end of turn 2's generation
        assert c4 >= len(p3) - 1 - BS
    assert_same_logits(on, off)
    assert not on.shared_writes
    for o in (on, off):
        assert_nothing_held(o.llm)
    stats = on.llm.stats()
    assert stats["prefix_cache_hit_tokens_total"] > stats["prefix_cache_queried_tokens_total"] // 2
    assert stats["kv_blocks_cached"] > 0
    if model_type == "qwen3_5":
        assert stats["prefix_cache_snapshots"] > 0
        assert stats["prefix_cache_snapshot_bytes"] == stats["prefix_cache_snapshots"] * on.engine.snapshot_bytes
    else:
        assert stats["prefix_cache_snapshots"] == 0 and on.engine.prefix.slots_total == 0


# ---- Forks, preemption and aborts ----

def test_n_forks_exact(ckpt_factory):
    """n = 3 seeded choices with penalties on a prompt that resumes from the cache: the parent's resumed
    state and blocks are what the forks copy and share."""
    path = ckpt_factory("qwen3_5")[0]
    on, off = Observed(make(path)), Observed(make(path, prefix_cache=False))
    base = [7 + i % 300 for i in range(50)]
    kw = dict(max_tokens=8, temperature=1.0, seed=9, n=3, frequency_penalty=0.5, ignore_eos=True)
    for o in (on, off):
        o.run([request("a", base, max_tokens=3, temperature=0)])
    forks_on = on.run([request("b", base + [9, 8, 7, 6, 5], **kw)])
    assert forks_on == off.run([request("b", base + [9, 8, 7, 6, 5], **kw)])
    assert len({tuple(c) for c in forks_on[0]}) == 3
    assert on.engine.requests == {} and on.llm.stats()["prefix_cache_hit_tokens_total"] >= 48
    assert_same_logits(on, off)
    assert not on.shared_writes
    assert_nothing_held(on.llm)


def test_preemption_exact(ckpt_factory):
    """Six requests sharing a 40-token prefix in 14 blocks of 16: they cannot all run at once, so the newest
    are preempted, recomputed and (with the cache) resumed from their own cached blocks."""
    path = ckpt_factory("qwen3_5")[0]
    opts = dict(num_kv_blocks=14, max_context=96, max_batch_size=6)
    on, off = Observed(make(path, **opts)), Observed(make(path, prefix_cache=False, **opts))
    prefix = [11 + (i * 7) % 350 for i in range(40)]

    def batch():
        return [request(f"p{i}", prefix + [20 + i] * (i + 1), max_tokens=30, ignore_eos=True,
                        **(dict(temperature=0) if i % 2 else dict(temperature=1.0, seed=i, presence_penalty=0.3)))
                for i in range(6)]
    for o in (on, off):
        o.run([request("warm", prefix + [3], max_tokens=2, temperature=0)])
    got = on.run(batch())
    assert got == off.run(batch())
    assert_same_logits(on, off)
    assert not on.shared_writes
    assert on.llm.stats()["prefix_cache_hit_tokens_total"] >= 6 * 32
    assert_nothing_held(on.llm)


def test_abort_mid_prefill_then_resume_exact(ckpt_factory):
    """A request aborted in the middle of its chunked prefill frees what it holds; the blocks and snapshots it
    completed stay cached, and a later request with its prefix resumes from them, exactly."""
    path = ckpt_factory("qwen3_5")[0]
    on, off = Observed(make(path, prefill_token_budget=20)), Observed(make(path, prefill_token_budget=20,
                                                                            prefix_cache=False))
    long = [5 + (i * 11) % 370 for i in range(100)]
    for o in (on, off):
        (tokens,), = o.run([request("gone", long, max_tokens=5, temperature=0)], abort_after={"gone": 3})
        assert tokens == []
        assert_nothing_held(o.llm)
    assert on.llm.stats()["kv_blocks_cached"] >= 3                 # three chunks of 16 ran before the abort
    kw = dict(max_tokens=6, temperature=1.0, seed=2, repetition_penalty=1.3, ignore_eos=True)
    follow = long[:60] + [9] * 5
    req = request("next", follow, **kw)
    assert on.run([req]) == off.run([request("next", follow, **kw)])
    assert req.cached_tokens == 48
    assert_same_logits(on, off)
    assert_nothing_held(on.llm)


def test_snapshot_memory_bound_and_lru(ckpt_factory):
    """--prefix-cache-memory 1 (MiB) holds a handful of snapshots: distinct prompts evict the least recently
    used, the count never passes the bound, and what remains still resumes."""
    path = ckpt_factory("qwen3_5")[0]
    llm = make(path, prefix_cache_memory=1)
    o = Observed(llm)
    bound = llm.engine.prefix.slots_total
    assert bound == (1 << 20) // llm.engine.snapshot_bytes and bound >= 2
    prompts = [[5 + (i * 31 + j * 7) % 370 for j in range(37)] for i in range(10)]
    for i, p in enumerate(prompts):
        o.run([request(f"d{i}", p, max_tokens=2, temperature=0)])
        assert llm.stats()["prefix_cache_snapshots"] <= bound
    assert llm.stats()["prefix_cache_evictions_total"] > 0
    req = request("again", prompts[-1] + [4, 4], max_tokens=2, temperature=0)
    o.run([req])
    assert req.cached_tokens >= 32
    assert_nothing_held(llm)


# ---- Speculative decoding: snapshots of rolled-back states ----

K = 3


def oracle_drafts(observed: Observed, truth: dict[str, list[int]]) -> Observed:
    """Replace the engine's drafts, after its real MTP pass, by truth[request id]'s continuation, wrong at every
    third position (a random MTP layer almost never guesses right): windows then accept 0..K drafts, and
    generations end inside them. The cache-on and cache-off engines get the same drafts, hence the same rows.
    Sampled rows' drafts count as drawn from a one-hot q (a valid proposal: rejection sampling stays exact)."""
    engine = observed.engine
    real = engine._draft
    vocab = observed.llm.config.vocab_size

    def draft(plan, kept):
        real(plan, kept)
        for p in plan:
            seq, want = p.seq, truth.get(p.seq.request.id)
            if not seq.drafts or want is None:
                continue
            n = len(seq.output_ids)
            seq.drafts = [t if (n + i) % 3 else (t + 1) % vocab for i, t in enumerate(want[n:n + len(seq.drafts)])]
            sampled = seq.request.sampling.temperature > 0
            seq.draft_probs = torch.nn.functional.one_hot(torch.tensor(seq.drafts, dtype=torch.long), vocab).float() \
                if sampled and seq.drafts else None
    engine._draft = draft
    return observed


def speculated(path, **opts) -> tuple[Observed, Observed]:
    """Cache on and off, both speculating with oracle drafts from a first cache-off run's outputs (the truth
    is filled by `learn`)."""
    opts = dict(speculative_tokens=K, **opts)
    on, off = Observed(make(path, **opts)), Observed(make(path, prefix_cache=False, **opts))
    assert on.engine.draft_tokens == K
    return on, off


def test_speculative_follow_up_resumes_from_end_of_generation_exact(ckpt_factory):
    """With speculation on, a generation that ends inside a verify window leaves its end-of-generation
    snapshot from the rolled-back state: a follow-up turn that extends it resumes there, and the answers
    (greedy, and seeded temperature 1 with penalties) and every sampled row's logits equal the cache-off
    engine's; nothing stays held. Whole and chunked prefill."""
    path = ckpt_factory("qwen3_5", mtp=True)[0]
    sampling = dict(temperature=1.0, seed=3, presence_penalty=0.4, repetition_penalty=1.2)
    for mode in MODES.values():
        truth = Observed(make(path, prefix_cache=False, speculative_tokens=K, **mode))
        on, off = speculated(path, **mode)
        for kw in (dict(temperature=0), sampling):
            tag = "greedy" if not kw["temperature"] else "sampled"
            known = {f"{tag}-{i + 1}": g for i, (_, g, _) in enumerate(agent_turns(truth, tag, **kw))}
            for o in (on, off):
                oracle_drafts(o, known)
            got, want = agent_turns(on, tag, **kw), agent_turns(off, tag, **kw)
            assert [g for _, g, _ in got] == [g for _, g, _ in want]
            if tag == "greedy":                                # speculation never changes greedy output
                assert [g for _, g, _ in got] == list(known.values())
            (p1, _, _), (p2, g2, c2), (p3, g3, c3), (_, _, c4), _ = got
            assert c2 >= common(p2, p1) - BS
            assert c3 == len(p2) + len(g2) - 1                # the end of turn 2's speculated generation
            assert c4 >= len(p3) - 1 - BS
        stats = on.llm.stats()
        assert stats["accepted_tokens_total"] > 0 and stats["draft_tokens_total"] > stats["accepted_tokens_total"]
        assert_same_logits(on, off)
        assert not on.shared_writes
        for o in (on, off, truth):
            assert_nothing_held(o.llm)


def test_speculative_stop_inside_a_window_then_resume_exact(ckpt_factory):
    """A generation that stops at a draft accepted in the middle of its window (later drafts dropped, the GDN
    state rolled back past them): its end-of-generation snapshot is the rolled-back state, so a follow-up that
    resends it resumes exactly there with the cache-off engine's logits. Every stop position is tried once."""
    path = ckpt_factory("qwen3_5", mtp=True)[0]
    prompt = [9 + (i * 13) % 360 for i in range(37)]
    truth = Observed(make(path, prefix_cache=False, speculative_tokens=K))
    (want,), = truth.run([request("truth", prompt, max_tokens=14, temperature=0, ignore_eos=True)])
    stops = [j for j in range(1, 13) if want[j] not in want[:j]]
    on, off = speculated(path)
    for o in (on, off):
        oracle_drafts(o, {f"stop{j}": want for j in stops})
    rolled_back = []                                     # stops with drafts after them in their window
    postprocess = on.engine._postprocess

    def observe(plan, logits):
        kept = postprocess(plan, logits)
        rolled_back.extend(p.seq.request.id for p, k in zip(plan, kept) if p.drafts and p.seq.finished and k < p.count)
        return kept
    on.engine._postprocess = observe
    for j in stops:
        extra = [3 + j, 4, 5]
        for o in (on, off):
            (gen,), = o.run([request(f"stop{j}", prompt, max_tokens=14, temperature=0, stop_token_ids=[want[j]],
                                     ignore_eos=True)])
            assert gen == want[:j + 1]
            follow = request(f"next{j}", prompt + gen + extra, max_tokens=3, temperature=0)
            o.run([follow])
            if o is on:
                assert follow.cached_tokens == len(prompt) + j   # the end of the stopped generation
    assert len(rolled_back) >= 2, rolled_back
    assert_same_logits(on, off)
    assert not on.shared_writes
    for o in (on, off, truth):
        assert_nothing_held(o.llm)


def test_speculative_preemption_and_abort_exact(ckpt_factory):
    """Windows under block pressure (the newest sequences preempted mid-generation, their drafts dropped) and a
    request aborted while it verifies windows: the same answers and logits as without the cache, the aborted
    request leaves no snapshot of its unverified state, and nothing stays held."""
    path = ckpt_factory("qwen3_5", mtp=True)[0]
    opts = dict(num_kv_blocks=14, max_context=96, max_batch_size=6)
    prefix = [11 + (i * 7) % 350 for i in range(40)]

    def batch():
        return [request(f"p{i}", prefix + [20 + i] * (i + 1), max_tokens=30, ignore_eos=True,
                        **(dict(temperature=0) if i % 2 else dict(temperature=1.0, seed=i, presence_penalty=0.3)))
                for i in range(6)]
    truth = Observed(make(path, prefix_cache=False, speculative_tokens=K, **opts))
    known = {req.id: g for req, (g,) in zip(batch(), truth.run(batch()))}
    on, off = speculated(path, **opts)
    for o in (on, off):
        oracle_drafts(o, known)
        o.run([request("warm", prefix + [3], max_tokens=2, temperature=0)])
    got = on.run(batch())
    assert got == off.run(batch())
    assert on.llm.stats()["prefix_cache_hit_tokens_total"] >= 6 * 32
    before = set(on.engine.prefix.by_key)
    for o in (on, off):                                  # aborted after its prefill and a few windows
        (gone,), = o.run([request("gone", prefix + [7] * 9, max_tokens=40, temperature=0, ignore_eos=True)],
                         abort_after={"gone": 4})
        assert 0 < len(gone) < 40
        assert_nothing_held(o.llm)
    new = [s.position for key, s in on.engine.prefix.by_key.items() if key not in before]
    assert new and max(new) <= len(prefix) + 9              # its prompt's snapshots, none past it
    kw = dict(max_tokens=6, temperature=1.0, seed=2, repetition_penalty=1.3, ignore_eos=True)
    follow = prefix + [7] * 9 + gone[:3]
    req = request("next", follow, **kw)
    assert on.run([req]) == off.run([request("next", follow, **kw)])
    assert req.cached_tokens >= len(prefix) + 9 - BS
    for o in (on, off):                                  # the abort came after a different number of tokens
        del o.outputs[("gone", 0)]
    assert_same_logits_by_context(on, off)
    assert not on.shared_writes
    for o in (on, off, truth):
        assert_nothing_held(o.llm)



def test_pocket_tiny_speculated_follow_up_resumes():
    """pocket-tiny speculates with its trained MTP layer (drafts accepted and rejected as they come): a
    generation's follow-up that resends it whole resumes at its end, and answers as without the cache."""
    on, off = (Observed(pocketllm.LLM(None, backend="torch", dtype="float32", quiet=True, max_context=512,
                                      max_batch_size=2, prefix_cache=cache,
                                      speculative_tokens=pocketllm.GPU_SPECULATIVE_TOKENS))   # off on the CPU
               for cache in (True, False))
    assert on.engine.draft_tokens > 0
    tok = on.llm.tokenizer
    p1 = tok.encode("<|im_start|>user\nWhat is the weather in Paris for 3 days?<|im_end|>\n<|im_start|>assistant\n")
    outs = []
    for o in (on, off):
        (g1,), = o.run([request("t1", p1, max_tokens=48, temperature=0)])
        p2 = p1 + g1 + tok.encode("<|im_end|>\n<|im_start|>user\nAnd in Rome?<|im_end|>\n<|im_start|>assistant\n")
        req = request("t2", p2, max_tokens=24, temperature=0)
        (g2,), = o.run([req])
        outs.append((g1, g2, req.cached_tokens))
    (g1, g2, cached), want = outs[0], outs[1]
    assert (g1, g2) == want[:2] and want[2] == 0
    assert cached == len(p1) + len(g1) - 1                # the end of turn 1's speculated generation
    assert on.llm.stats()["accepted_tokens_total"] > 0
    assert not on.shared_writes
    for o in (on, off):
        assert_nothing_held(o.llm)
        o.llm.close()


# ---- Tensor parallelism: each rank copies its own shard of the state ----

@pytest.mark.slow
def test_tensor_parallel_cpu_ranks_exact(ckpt_factory):
    path = ckpt_factory("qwen3_5")[0]
    opts = dict(devices="cpu,cpu", prefill_token_budget=20)
    on, off = Observed(make(path, **opts)), Observed(make(path, prefix_cache=False, **opts))
    try:
        got, want = agent_turns(on, "tp", temperature=0), agent_turns(off, "tp", temperature=0)
        assert [g for _, g, _ in got] == [g for _, g, _ in want]
        assert got[2][2] == len(got[1][0]) + len(got[1][1]) - 1
        assert_same_logits(on, off)
        assert_nothing_held(on.llm)
    finally:
        on.llm.close()
        off.llm.close()


# ---- The flags, /metrics and usage over HTTP ----

def test_flags():
    args = pocketllm.parse_command_line(["--no-prefix-cache", "--prefix-cache-memory", "64"])
    options = pocketllm.engine_options(args)
    assert options["prefix_cache"] is False and options["prefix_cache_memory"] == 64
    assert pocketllm.engine_options(pocketllm.parse_command_line([]))["prefix_cache"] is True
    with pytest.raises(pocketllm.PocketError, match="--prefix-cache-memory"):
        pocketllm.LLM(quiet=True, prefix_cache_memory=-2)


@pytest.fixture(scope="module")
def llm():
    llm = pocketllm.LLM(backend="torch", quiet=True, max_context=1024)
    yield llm
    llm.close()


def test_usage_reports_cached_tokens_over_http(server, llm):
    """A follow-up chat turn and a completion that extends an earlier prompt report the prompt tokens they
    resumed as usage.prompt_tokens_details.cached_tokens, streamed or not (openai SDK), and /metrics counts them."""
    import openai
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", api_key="none")
    model = llm.model_name
    messages = [{"role": "system", "content": "You are a careful assistant. " * 20},
                {"role": "user", "content": "Name three rivers."}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": first.choices[0].message.content or "ok"},
                 {"role": "user", "content": "And three lakes?"}]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - BS - 8 and cached < second.usage.prompt_tokens
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= cached
    text = "The river flows past the old mill and on to the sea. " * 8
    one = client.completions.create(model=model, prompt=text, max_tokens=3, temperature=0)
    two = client.completions.create(model=model, prompt=text + "Then it rains.", max_tokens=3, temperature=0)
    assert one.usage.prompt_tokens_details.cached_tokens == 0
    assert two.usage.prompt_tokens_details.cached_tokens >= one.usage.prompt_tokens - BS
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics") as r:
        metrics = r.read().decode()
    samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#"))
    assert int(samples["pocketllm_prefix_cache_hit_tokens_total"]) >= cached
    assert int(samples["pocketllm_prefix_cache_queried_tokens_total"]) > int(
        samples["pocketllm_prefix_cache_hit_tokens_total"])
    assert int(samples["pocketllm_prefix_cache_snapshot_bytes"]) > 0
    assert "pocketllm_prefix_cache_evictions_total" in samples


def test_a_resume_shares_its_matched_blocks_before_the_tail_copy_may_evict_one():
    """Regression (found by test_fuzz): the scheduler took a block for the copy of a snapshot's partial tail before
    sharing the matched full blocks, and with no free block that alloc evicted one of them from the cache, so the
    admission raised KeyError and the engine went down. Now the match is pinned first; with no block left for the
    tail the sequence starts from 0 (GDN state: full blocks alone are no resume point) and holds nothing."""
    bs = 4
    blocks = pocketllm.BlockPool(3)
    prefix = pocketllm.PrefixCache(blocks, bs, "test", range(2), state=True)
    tokens = list(range(10, 20))                                     # 2 full blocks + a 2-token tail
    keys = prefix.block_keys(tokens, [])
    held = [blocks.alloc() for _ in range(3)]
    snap = prefix.add(tokens, len(tokens), keys)
    for b, key in zip(held, keys + [snap.key]):
        blocks.register(b, key)
    blocks.release(list(held))                                      # all cached, none free: alloc must evict
    opts = pocketllm.EngineOptions(kv_block_size=bs, max_batch_size=2, max_context=64)
    scheduler = pocketllm.Scheduler(opts, blocks, pocketllm.SlotPool(2), prefix)
    seq = pocketllm.Sequence(pocketllm.Request("r", tokens + [99], pocketllm.SamplingParams(max_tokens=4), 0), 0)
    assert scheduler._resume(seq) is None and seq.num_computed == 0 and seq.blocks == []
    assert blocks.available == 3 and all(r == 0 for r in blocks.refs)
    assert set(blocks.by_key) == set(keys + [snap.key])                 # nothing was evicted


def test_a_burst_behind_one_system_prompt_keeps_resuming_from_it(ckpt_factory):
    """Regression (issue 50's 47k-token system prompt: every request after the first prefilled it again): waves of
    as many requests as there are snapshots, all behind one system prompt, each add snapshots of their own (the
    end of the prompt and of the generation). Plain LRU evicted the system prompt's snapshot among them, so the
    next wave started from 0; the snapshot that several requests resumed from is now spared."""
    llm = make(ckpt_factory("qwen3_5")[0])
    engine = llm.engine
    assert engine.prefix.slots_total == 4
    system = [5 + (i * 13) % 300 for i in range(200)]

    def wave(tails: list[list[int]]) -> list[int]:
        reqs = [request(f"r{len(tails)}-{i}-{tail[0]}", system + tail, max_tokens=3, temperature=1.0, seed=i)
                for i, tail in enumerate(tails)]
        for req in reqs:
            req.snapshot_at = len(system)             # where the chat prompt's last message starts
            req.params.validate(llm.config.vocab_size)
            engine.add(req)
        while engine.has_work():
            engine.step()
        for req in reqs:
            drain(req)
        return [req.cached_tokens for req in reqs]

    assert wave([[7, 8, 9]]) == [0]
    for w in range(3):
        assert wave([[10 + w, 20 + i, 30 + i, 40] for i in range(4)]) == [len(system)] * 4, f"wave {w}"
    assert_nothing_held(llm)


def test_the_mtp_layer_drafts_after_a_resume_or_a_fork_as_without_the_cache(ckpt_factory):
    """The MTP layer's KV at position i reads the token after it, so at the position before a resumed sequence's
    first (or a forked choice's first token) it was computed for another continuation. The engine rewrites it
    there, from the hidden state kept with the snapshot (or the parent's), in a block of the sequence's own:
    with real MTP drafts (not oracle ones), every draft and its probabilities equal the cache-off engine's, for
    follow-ups resuming at a block boundary, inside a block, at the end of a generation, and for n = 2 (whose
    second choice's copy of the last block also holds the MTP layer's KV of the prompt's last chunk)."""
    path = ckpt_factory("qwen3_5", mtp=True)[0]
    prompt = [11 + (i * 7) % 350 for i in range(40)]
    drafted: dict[int, dict] = {}
    forks_checked = []

    def mtp_keys(o: Observed, seq, lo: int, hi: int) -> torch.Tensor:
        k = o.engine.cache.k[o.llm.config.num_hidden_layers]              # the MTP layer's (blocks, BS, Hk, Dh)
        return torch.stack([k[seq.blocks[i // BS], i % BS] for i in range(lo, hi)])

    def engine(**opts) -> Observed:
        o = Observed(make(path, speculative_tokens=K, max_batch_size=6, **opts))
        seen, real = drafted.setdefault(id(o), {}), o.engine._draft

        def draft(plan, kept):
            for p in plan:                                   # a forked choice's first step, before its pass
                seq = p.seq
                if seq.index == 1 and seq.mtp_from is not None and seq.request.seqs[0].slot is not None:
                    n = len(seq.request.prompt_ids) - 1          # the last prompt position is the choice's own
                    assert torch.equal(mtp_keys(o, seq, 32, n), mtp_keys(o, seq.request.seqs[0], 32, n))
                    forks_checked.append(o)
            real(plan, kept)
            for p in plan:
                seq = p.seq
                if seq.drafts:
                    seen[(seq.request.id, seq.index, len(seq.output_ids))] = (list(seq.drafts), seq.draft_probs)
        o.engine._draft = draft
        return o
    on, off = engine(), engine(prefix_cache=False)
    kw = dict(max_tokens=8, temperature=1.0, ignore_eos=True, presence_penalty=0.2)
    first = None
    for o in (on, off):
        (first,), = o.run([request("a", prompt, seed=1, **kw)])
    follow = {"turn": prompt + first + [5, 6, 7],            # the end of the generation (inside a block)
              "boundary": prompt[:32] + [9, 9, 9, 9],        # a prefill chunk's block boundary
              "inside": prompt + [3, 3]}                     # the end of the prompt (inside a block)
    for rid, tokens in follow.items():
        got = [o.run([request(rid, tokens, seed=2, **kw)]) for o in (on, off)]
        assert got[0] == got[1], rid
        assert on.engine.requests == {} and 0 < on.llm.stats()["prefix_cache_hit_tokens_total"]
    for rid, tokens in (("n2", prompt + [8]), ("n2-boundary", prompt + [8] * 7)):   # 41 and 47 tokens: the
        forked = [o.run([request(rid, tokens, seed=3, n=2, **kw)]) for o in (on, off)]   # second's drafts reserve
        assert forked[0] == forked[1], rid                                                # a block past its prompt
    assert forks_checked == [on, off] * 2
    seen_on, seen_off = drafted[id(on)], drafted[id(off)]
    assert seen_on.keys() == seen_off.keys() and len(seen_on) >= 20
    for key, (drafts, probs) in seen_off.items():
        assert seen_on[key][0] == drafts, key
        assert_close(seen_on[key][1], probs, f"draft probabilities {key}")
    assert not on.shared_writes
    assert_nothing_held(on.llm)


def test_snapshots_several_requests_resumed_from_go_last_but_hold_at_most_half_the_slots():
    """PrefixCache.victim: the least recently used snapshot that at most one request resumed from goes first; those
    resumed from by several are spared while they hold at most half the slots, and past that the least recently
    used of them goes."""
    prefix = pocketllm.PrefixCache(pocketllm.BlockPool(8), 4, "test", range(4), state=True)

    def add(first: int) -> pocketllm.Snapshot:
        tokens = [first] * 8                                          # two full blocks: a snapshot at their end
        return prefix.add(tokens, len(tokens), prefix.block_keys(tokens, []))
    a, b, c, d = (add(i) for i in (1, 2, 3, 4))                   # least recently used first
    a.resumes = b.resumes = 2
    c.resumes = 1                                                    # one request: a conversation's next turn
    keys = lambda *snaps: {s.key for s in snaps}                     # noqa: E731
    e = add(5)
    assert set(prefix.by_key) == keys(a, b, d, e)                    # c went, not the older a and b
    f = add(6)
    assert set(prefix.by_key) == keys(a, b, e, f)                    # then d
    e.resumes = 2                                                    # three of four slots shared: past half
    g = add(7)
    assert set(prefix.by_key) == keys(b, e, f, g)                    # the least recently used shared one went
    assert prefix.counters["snapshot_evictions"] == 3
