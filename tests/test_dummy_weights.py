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
    real = pocketllm.LLM(TINY, device="cpu", max_context=256, max_batch_size=2, speculative_tokens=2)
    real.close()
    want = memory_line(capsys.readouterr().err)
    directory = config_only(TINY, tmp_path / "tiny")
    llm = pocketllm.LLM(directory, device="cpu", max_context=256, max_batch_size=2, load_format="dummy",
                        speculative_tokens=2)
    try:
        assert [p.name for p in directory.iterdir()] == ["config.json"]          # nothing written beside it
        err = capsys.readouterr().err
        assert memory_line(err) == want
        assert "the MTP layer drafts 2 tokens" in err and "--load-format dummy: random weights from" in err
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


def bench_module():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench
    return bench


def test_the_27b_config_alone_holds_the_27b_s_bytes_at_tp1_and_per_tp4_rank(tmp_path):
    """benchmarks/bench.py --make-config: Qwen3.5-27B FP8 read per decoded token 26.9 GB at TP1 and 6.73 GB per rank
    at TP4 (docs/qwen-facts.md section 5), with section 4's per-rank shapes, all from the dummy's tensor table."""
    bench = bench_module()
    sizes = {}
    for name in ("27b", "27b-tp4"):
        bench.write_config(tmp_path / name, name)
        table = pocketllm.DummyCheckpoint(tmp_path / name).weight_map
        sizes[name] = sum(torch.tensor([], dtype=t.dtype).element_size() * torch.Size(t.shape).numel()
                          for n, t in table.items() if "embed_tokens" not in n and not n.startswith("mtp."))
        assert "mtp.layers.0.self_attn.q_proj.weight" in table and len(table) == 1273
    assert round(sizes["27b"] / 1e9, 1) == 26.9 and round(sizes["27b-tp4"] / 1e9, 2) == 6.73
    rank = pocketllm.DummyCheckpoint(tmp_path / "27b-tp4").weight_map
    layer = "model.language_model.layers."
    want = {"0.mlp.gate_proj.weight": (4352, 5120), "0.mlp.down_proj.weight": (5120, 4352),
            "3.self_attn.q_proj.weight": (3072, 5120), "3.self_attn.k_proj.weight": (256, 5120),
            "3.self_attn.o_proj.weight": (5120, 1536), "0.linear_attn.in_proj_qkv.weight": (512 + 512 + 1536, 5120),
            "0.linear_attn.in_proj_z.weight": (1536, 5120), "0.linear_attn.out_proj.weight": (5120, 1536),
            "0.linear_attn.A_log": (12,), "0.mlp.gate_proj.weight_scale_inv": (34, 40)}
    assert {k: rank[layer + k].shape for k in want} == want
    assert rank["lm_head.weight"].shape == (62080, 5120) and rank["lm_head.weight"].dtype == torch.bfloat16


def test_a_rank_s_shapes_config_loads_as_that_rank_s_shard(tmp_path):
    """bench.rank_shapes(config, 2) served whole holds the weights rank 0 of 2 loads from the real checkpoint, each
    of the same shape and dtype (vocab-parallel embedding and lm_head included): what the TP4-rank step of the GPU
    check runs. (pocket-tiny's 192-row halves are not whole 128-row blocks, so the shard's scale grid is finer
    than a whole model's; the 27B's splits are all whole blocks, see the test above.)"""
    bench = bench_module()
    d = tmp_path / "rank"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(bench.rank_shapes(json.loads((TINY / "config.json").read_text()), 2)))
    load = lambda ckpt, shard: pocketllm.Model(ckpt, pocketllm.TorchOps(), torch.float32,  # noqa: E731
                                               torch.device("cpu"), shard=shard, progress=False, mtp=True, stack=True)
    weights = lambda model: {n: w[:2] for n, w in model_weights(model).items()}   # noqa: E731  (shape, dtype)
    want = weights(load(pocketllm.Checkpoint(TINY), pocketllm.Shard(0, 2)))
    assert weights(load(pocketllm.DummyCheckpoint(d), pocketllm.Shard())) == want


def test_an_fp8_config_that_excludes_nothing_keeps_the_embedding_and_lm_head_in_bf16(tmp_path):
    """Without modules_to_not_convert the projections are FP8 and the embedding and lm_head bf16, as in Qwen's FP8
    checkpoints (the loader refuses an FP8 embedding), and the model serves."""
    raw = dict(checkpoints.text_config("qwen3", 400), model_type="qwen3",
               quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    table = pocketllm.DummyCheckpoint(tmp_path).weight_map
    assert table["model.embed_tokens.weight"].dtype == table["lm_head.weight"].dtype == torch.bfloat16
    assert table["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    llm = pocketllm.LLM(tmp_path, load_format="dummy", device="cpu", quiet=True, max_context=64, max_batch_size=1)
    try:
        assert llm.generate([1, 2, 3], max_tokens=3, temperature=0)["completion_tokens"] == 3
    finally:
        llm.close()
