"""The whole model, native backend vs torch backend on a GPU: identical greedy tokens for 64 steps.

A tiny random Qwen3.5 FP8 checkpoint (tests/checkpoints.py; pocket-tiny when it is bundled), fp16 activations
on both backends, each prompt alone and all prompts batched, with chunked prefill (a small token budget splits
the longer prompts over several steps). Skipped without a CUDA GPU or a loadable native library.
"""

from __future__ import annotations

import pytest
import torch

import pocketllm

pytestmark = pytest.mark.gpu

PROMPTS = [[5 + (i * 7 + j * 13) % 380 for j in range(3 + 20 * i)] for i in range(4)]   # 3 .. 63 tokens


@pytest.fixture(scope="module")
def llms(ckpt_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    ok, why = pocketllm.native_status("cuda")
    if not ok:
        pytest.skip(f"native backend unavailable: {why}")
    path, _ = ckpt_factory("qwen3_5", fp8=True)
    opts = {"device": "cuda", "dtype": "float16", "quiet": True, "max_context": 256, "max_batch_size": 4}
    return (pocketllm.LLM(path, backend="torch", **opts),
            pocketllm.LLM(path, backend="native", prefill_token_budget=16, **opts))


def test_greedy_parity_64_steps(llms):
    torch_llm, native_llm = llms
    assert native_llm.model.ops.name == "native"
    sampling = {"max_tokens": 64, "temperature": 0, "ignore_eos": True}
    expect = [torch_llm.generate(p, **sampling)["token_ids"] for p in PROMPTS]
    assert [native_llm.generate(p, **sampling)["token_ids"] for p in PROMPTS] == expect
    streams = [native_llm.submit(p, pocketllm.SamplingParams(**sampling)) for p in PROMPTS]
    assert [[t for ev in s for t in ev.token_ids] for s in streams] == expect
