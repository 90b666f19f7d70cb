"""The whole model, native backend vs torch backend on a GPU: the same logits, and the same greedy tokens up to
the first near-tie.

A tiny random Qwen3.5 FP8 checkpoint (tests/checkpoints.py), fp16 activations on both backends, each prompt alone
and all prompts batched, with chunked prefill (a small token budget splits the longer prompts over several steps).
The two backends sum in different orders in fp16, so a random model's greedy continuation may flip where its top
two logits are nearly tied: the tokens must agree up to the first position whose reference margin (top-1 minus
top-2 logit) is within twice the largest logit difference the two backends show on the same tokens, and the
logits themselves (teacher-forced, decode path at every position) must agree to 1% of their range. Skipped
without a CUDA GPU or a loadable native library.
"""

from __future__ import annotations

import pytest
import torch

import pocketllm

pytestmark = pytest.mark.gpu

PROMPTS = [[5 + (i * 7 + j * 13) % 380 for j in range(3 + 20 * i)] for i in range(4)]   # 3 .. 63 tokens
STEPS = 64
LOGIT_RTOL = 1e-2         # max |native - torch| over max |torch|, fp16 activations on both


@pytest.fixture(scope="module")
def llms(ckpt_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    ok, why = pocketllm.native_status("cuda")
    if not ok:
        pytest.skip(f"native backend unavailable: {why}")
    path, _ = ckpt_factory("qwen3_5", fp8=True)
    opts = {"device": "cuda", "dtype": "float16", "quiet": True, "max_context": 256, "max_batch_size": 4,
            "speculative_tokens": 0, "gpu_memory_utilization": 0.2}   # two engines on one card
    return (pocketllm.LLM(path, backend="torch", **opts),
            pocketllm.LLM(path, backend="native", prefill_token_budget=16, **opts))


@pytest.fixture(scope="module")
def reference(llms):
    """Per prompt: the torch backend's greedy tokens, its logits at each of them (STEPS, V) and the largest
    native-vs-torch logit difference over the same tokens, teacher-forced through native's decode path."""
    torch_llm, native_llm = llms
    out = []
    for p in PROMPTS:
        want = torch_llm.generate(p, max_tokens=STEPS, temperature=0, ignore_eos=True)["token_ids"]
        ids = p + want[:-1]
        ref = torch_llm.logits(ids)[len(p) - 1:]                              # (STEPS, V) float32
        got = native_llm.logits(ids, chunk_size=1)[len(p) - 1:]
        diff = float((got - ref).abs().max())
        scale = float(ref.abs().max())
        print(f"prompt of {len(p)}: max |native - torch| logit {diff:.3g} of max |logit| {scale:.3g}")
        assert diff <= LOGIT_RTOL * scale, f"logits differ by {diff:.3g} (max |logit| {scale:.3g})"
        out.append((want, ref, diff))
    return out


def agrees_until_a_near_tie(got: list[int], want: list[int], ref: torch.Tensor, diff: float) -> None:
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if first is None:
        assert len(got) == len(want)
        return
    top2 = ref[first].topk(2).values
    margin = float(top2[0] - top2[1])
    assert margin <= 2 * diff, (f"greedy tokens differ at step {first} where the reference's margin is {margin:.3g}, "
                                f"more than twice the backends' logit difference {diff:.3g}")


def test_greedy_parity_64_steps(llms, reference):
    native_llm = llms[1]
    assert native_llm.model.ops.name == "native"
    sampling = {"max_tokens": STEPS, "temperature": 0, "ignore_eos": True}
    for p, (want, ref, diff) in zip(PROMPTS, reference):
        agrees_until_a_near_tie(native_llm.generate(p, **sampling)["token_ids"], want, ref, diff)
    streams = [native_llm.submit(p, pocketllm.SamplingParams(**sampling)) for p in PROMPTS]   # one batch
    for stream, (want, ref, diff) in zip(streams, reference):
        agrees_until_a_near_tie([t for ev in stream for t in ev.token_ids], want, ref, diff)
