"""--load-format dummy: a directory with only config.json serves with random weights of exactly the dtypes, shapes
and FP8 block scales the real checkpoint holds. The reference is real checkpoints: tests/checkpoints.py writes
them (FP8 and bf16, Qwen3.5 and Qwen3, with and without MTP) and pocket-tiny is one; the dummy must list the
same tensors, load into the same model (every weight's shape, dtype and scale grid, whole and as a
tensor-parallel rank's shard), and print the same memory line."""

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import checkpoints
import pocketllm

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "models" / "pocket-tiny"
SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F16": torch.float16,
                      "F32": torch.float32}

# (model_type, fp8, mtp): every layout the loader reads.
KINDS = [("qwen3_5", True, True), ("qwen3_5", False, False), ("qwen3_5_text", True, False),
         ("qwen3_5_text", False, True), ("qwen3", True, False), ("qwen3", False, False)]


def config_only(real: Path, dest: Path, mtp: bool = False, tokenizer: bool = False) -> Path:
    """A directory with the real checkpoint's config.json and no weights. Real Qwen3.5 configs say
    mtp_num_hidden_layers (pocket-tiny's does); the test writer's do not, so it is added where the real one has
    an MTP layer."""
    dest.mkdir()
    raw = json.loads((real / "config.json").read_text())
    if mtp:
        (raw.get("text_config") or raw)["mtp_num_hidden_layers"] = 1
    (dest / "config.json").write_text(json.dumps(raw))
    if tokenizer:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(real / name, dest / name)
    return dest


@pytest.fixture(scope="module", params=KINDS, ids=lambda k: f"{k[0]}-{'fp8' if k[1] else 'bf16'}"
                f"{'-mtp' if k[2] else ''}")
def pair(request, tmp_path_factory):
    model_type, fp8, mtp = request.param
    root = tmp_path_factory.mktemp(request.node.name if hasattr(request.node, "name") else "ck")
    real, _ = checkpoints.make_checkpoint(root / "real", model_type, fp8=fp8, mtp=mtp, extra_tensors=False)
    return real, config_only(real, root / "dummy", mtp), mtp


def stored_table(ckpt: pocketllm.Checkpoint) -> dict[str, tuple[list[int], torch.dtype]]:
    return {name: (ckpt.shape(name), SAFETENSORS_DTYPES[ckpt._slice(name).get_dtype()]) for name in ckpt.weight_map}


def test_the_dummy_lists_every_tensor_of_the_checkpoint_with_its_shape_and_dtype(pair):
    real, dummy_dir, _ = pair
    want = stored_table(pocketllm.Checkpoint(real))
    dummy = pocketllm.DummyCheckpoint(dummy_dir)
    got = {name: (dummy.shape(name), spec.dtype) for name, spec in dummy.weight_map.items()}
    assert set(got) == set(want)
    for name, (shape, dtype) in want.items():
        # block scales: the test writer stores fp32 (both are accepted and loaded as fp32), the dummy bf16 as
        # Qwen's FP8 checkpoints do (pocket-tiny's test below compares those too)
        assert got[name][0] == shape and (got[name][1] == dtype or name.endswith("_scale_inv")), name


def test_pocket_tiny_from_its_config_alone_is_pocket_tiny_tensor_for_tensor(tmp_path):
    """A real FP8 checkpoint with an MTP layer and bf16 block scales: names, shapes and stored dtypes all equal."""
    dummy = pocketllm.DummyCheckpoint(config_only(TINY, tmp_path / "tiny"))
    want = stored_table(pocketllm.Checkpoint(TINY))
    assert {n: (dummy.shape(n), s.dtype) for n, s in dummy.weight_map.items()} == want
    for name in want:
        t = dummy.read(name)
        assert list(t.shape) == want[name][0] and t.dtype == want[name][1], name


def model_weights(model: pocketllm.Model) -> dict[str, tuple]:
    """Every weight of a loaded model: (shape, dtype, scale shape, scale dtype, block) by path."""
    def describe(w):
        if isinstance(w, pocketllm.Linear):
            return (tuple(w.weight.shape), w.weight.dtype, None if w.scale is None else tuple(w.scale.shape),
                    None if w.scale is None else w.scale.dtype, tuple(w.block))
        return tuple(w.shape), w.dtype
    out = {"embed_tokens": describe(model.embed_tokens), "lm_head": describe(model.lm_head),
           "norm": describe(model.norm)}
    for i, layer in enumerate(model.layers):
        out.update({f"layers.{i}.{n}": describe(w) for n, w in pocketllm.named_weights(layer)})
    if model.mtp is not None:
        out.update({f"mtp.{n}": describe(w) for n, w in pocketllm.named_weights(model.mtp)})
    return out


def weight_bytes(model: pocketllm.Model) -> int:
    total = 0
    for layer in model.layers + ([model.mtp] if model.mtp else []):
        for _, w in pocketllm.named_weights(layer):
            for t in ([w.weight] + ([w.scale] if w.scale is not None else [])) if isinstance(w, pocketllm.Linear) \
                    else [w]:
                total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("rank,world", [(0, 1), (1, 2)])
def test_the_dummy_loads_into_the_same_model_whole_and_as_a_tensor_parallel_rank(pair, rank, world):
    real, dummy_dir, mtp = pair
    shard = pocketllm.Shard(rank, world)
    load = lambda ckpt: pocketllm.Model(ckpt, pocketllm.TorchOps(), torch.float32, torch.device("cpu"),  # noqa: E731
                                        shard=shard, progress=False, mtp=True, stack=True)
    want, got = load(pocketllm.Checkpoint(real)), load(pocketllm.DummyCheckpoint(dummy_dir))
    assert (want.mtp is not None) == (got.mtp is not None) == mtp
    assert model_weights(got) == model_weights(want)
    assert weight_bytes(got) == weight_bytes(want)


def test_dummy_values_are_seeded_finite_and_every_rank_slices_the_same_tensor(tmp_path):
    dummy_dir = config_only(TINY, tmp_path / "tiny")
    name = "model.language_model.layers.0.mlp.gate_proj"
    whole = pocketllm.load_linear(pocketllm.DummyCheckpoint(dummy_dir, seed=3), name, (384, 128))
    again = pocketllm.load_linear(pocketllm.DummyCheckpoint(dummy_dir, seed=3), name, (384, 128))
    other = pocketllm.load_linear(pocketllm.DummyCheckpoint(dummy_dir, seed=4), name, (384, 128))
    half = pocketllm.load_linear(pocketllm.DummyCheckpoint(dummy_dir, seed=3), name, (384, 128), rows=[(128, 256)])
    assert torch.equal(whole.weight.view(torch.uint8), again.weight.view(torch.uint8))
    assert not torch.equal(whole.weight.view(torch.uint8), other.weight.view(torch.uint8))
    assert torch.equal(half.weight.view(torch.uint8), whole.weight[128:256].view(torch.uint8))
    assert torch.equal(half.scale, whole.scale[1:2])
    dense = pocketllm.dequantize(whole, torch.float32)                    # (384, 128)
    assert torch.isfinite(dense).all() and 0.01 < dense.std().item() < 0.04   # N(0, 0.02)-like, not zeros
    assert whole.scale.min() > 0


def memory_line(text: str) -> str:
    return next(line for line in text.splitlines() if "memory per device" in line)


def test_llm_serves_a_config_only_directory_with_the_real_memory_line(tmp_path, capsys):
    """LLM(load_format="dummy") on config.json alone: the built-in tokenizer, the MTP layer drafting, tokens out,
    and the same memory line as the real pocket-tiny."""
    real = pocketllm.LLM(TINY, device="cpu", max_context=256, max_batch_size=2)
    real.close()
    want = memory_line(capsys.readouterr().err)
    llm = pocketllm.LLM(config_only(TINY, tmp_path / "tiny"), device="cpu", max_context=256, max_batch_size=2,
                        load_format="dummy")
    try:
        err = capsys.readouterr().err
        assert memory_line(err) == want
        assert "the MTP layer drafts 2 tokens" in err
        assert llm.tokenizer.encode("hi") == [104, 105]                  # byte-level: one id per byte
        out = llm.generate("Hello", max_tokens=6, temperature=0, ignore_eos=True)
        assert out["completion_tokens"] == 6
        assert llm.generate("Hello", max_tokens=6, temperature=0, ignore_eos=True)["token_ids"] == out["token_ids"]
    finally:
        llm.close()


def test_dummy_weights_are_the_same_on_every_tensor_parallel_layout(tmp_path):
    """Two CPU ranks slice the same drawn tensors: their logits equal one device's."""
    dummy_dir = config_only(TINY, tmp_path / "tiny")
    ids = [5, 17, 300, 42, 7, 99]
    one = pocketllm.LLM(dummy_dir, device="cpu", load_format="dummy", quiet=True, max_context=64, max_batch_size=1,
                        speculative_tokens=0)
    try:
        want = one.logits(ids)
    finally:
        one.close()
    two = pocketllm.LLM(dummy_dir, devices="cpu,cpu", load_format="dummy", quiet=True, max_context=64,
                        max_batch_size=1, speculative_tokens=0)
    try:
        got = two.logits(ids)
    finally:
        two.close()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "pocketllm.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_the_flag_is_checked_before_anything_loads_and_is_no_longer_refused_as_vllm_only():
    r = run_cli("--load-format", "npz")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == \
        "pocketllm: error: --load-format must be one of auto, dummy (got 'npz')"
    assert "--load-format" not in pocketllm.VLLM_ONLY_FLAGS
    assert pocketllm.parse_command_line(["--load-format", "dummy"]).load_format == "dummy"
    assert pocketllm.EngineOptions().load_format == "auto"


def test_without_dummy_a_config_only_directory_is_refused_naming_the_files(tmp_path):
    with pytest.raises(pocketllm.CheckpointError, match="no \\*.safetensors files"):
        pocketllm.LLM(config_only(TINY, tmp_path / "tiny"), device="cpu", quiet=True)
