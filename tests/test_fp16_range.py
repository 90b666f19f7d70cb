"""fp16 activations never overflow silently (issue 18, item 2).

On the GPU the activations are fp16 (sm_75 has no bf16), and Qwen-family MLPs produce values beyond fp16's 65504.
Here a random checkpoint has its MLP gate/up weights scaled by 2^8 (through their FP8 block scales, so the
scaling is exact), which drives the SwiGLU intermediate silu(gate) * up and every MLP output (a row-parallel
down_proj output) past 1e5; the test measures that on the float64 reference. At fp16 activations both backends
must then give finite logits close to float64 math: the torch backend (TorchOps) and the native kernels (the CPU
build runs the same kernel sources as the GPU build), for a one-shot prefill (GEMM paths) and token by token (the
decode GEMV paths).

Reference: transformers' own Qwen3.5 model in float64 holding exactly the dequantised, scaled weights.
Tolerance: max |logit - ref| <= 2e-2 * max |ref|. An fp16 rounding is 2^-11 ~ 4.9e-4 relative; each layer rounds
its normed input, q/k/v, the attention/DeltaNet output and the MLP intermediate once, four layers deep, and the
logits read the final norm through an fp16 lm_head; measured: 3e-3 native, 5e-3 torch (whose weights are
rounded to fp16 when dequantised). A single overflow gives inf/NaN, as this test got before fp32 outputs existed.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import checkpoints
import pocketllm

GATE_UP_SCALE = 256.0                                # 2^8: exact on the FP8 block scales and in float64
IDS = [5 + (i * 37) % 390 for i in range(32)]       # a fixed 32-token prompt inside the tiny vocabulary
TOL = 2e-2
OPTS = {"quiet": True, "max_context": 128, "max_batch_size": 2, "dtype": "float16"}


@pytest.fixture(scope="module")
def hot(tmp_path_factory):
    """(checkpoint path, float64 reference logits (32, V), largest |intermediate|, largest |MLP output|)."""
    path, ref = checkpoints.make_checkpoint(tmp_path_factory.mktemp("fp16_range"), "qwen3_5_text", fp8=True)
    weights = path / "model.safetensors"
    state = load_file(str(weights))
    for name in state:
        if name.endswith(("mlp.gate_proj.weight_scale_inv", "mlp.up_proj.weight_scale_inv")):
            state[name] = state[name] * GATE_UP_SCALE
    save_file(state, str(weights))
    ref = ref.double()
    peaks = {"intermediate": 0.0, "mlp_out": 0.0}

    def watch(module, inputs, output):
        peaks["intermediate"] = max(peaks["intermediate"], float(inputs[0].abs().max()))
        peaks["mlp_out"] = max(peaks["mlp_out"], float(output.abs().max()))

    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
                p.mul_(GATE_UP_SCALE)
        hooks = [layer.mlp.down_proj.register_forward_hook(watch) for layer in ref.model.layers]
        want = ref(torch.tensor([IDS])).logits[0]
        for h in hooks:
            h.remove()
    return path, want, peaks


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def check_logits(llm: pocketllm.LLM, want: torch.Tensor, chunk_size: int | None):
    got = llm.logits(IDS, chunk_size=chunk_size)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.isfinite(got).all(), "fp16 overflow: non-finite logits"
    err = rel_err(got, want)
    assert err <= TOL, f"logits differ from float64 by {err:.2e} (tolerance {TOL})"


def test_the_checkpoint_drives_fp16_out_of_range(hot):
    """The premise: in exact math the MLP intermediate and the layer outputs pass 1e5 (fp16 stops at 65504)."""
    _, want, peaks = hot
    assert peaks["intermediate"] > 1e5 and peaks["mlp_out"] > 1e5, peaks
    assert torch.isfinite(want).all()


@pytest.mark.parametrize("chunk_size", [None, 1], ids=["prefill", "decode"])
def test_torch_backend_fp16_matches_float64(hot, chunk_size):
    path, want, _ = hot
    llm = pocketllm.LLM(path, backend="torch", **OPTS)
    assert llm.model.dtype == torch.float16
    check_logits(llm, want, chunk_size)


@pytest.mark.parametrize("chunk_size", [None, 1], ids=["prefill", "decode"])
def test_native_cpu_build_fp16_matches_float64(hot, chunk_size, monkeypatch):
    path, want, _ = hot
    import build
    build.build(cpu=True, quiet=True)                # the CPU test build of csrc/ as it is now (skips without ASan)
    monkeypatch.setenv("POCKETLLM_NATIVE_CPU", "1")
    llm = pocketllm.LLM(path, backend="native", **OPTS)
    assert llm.model.ops.name == "native" and llm.model.ops.lib.is_cpu_build and llm.model.dtype == torch.float16
    check_logits(llm, want, chunk_size)
