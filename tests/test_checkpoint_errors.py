"""Bad checkpoints fail with one clear line naming the file or tensor, and exit code 2 on the command line."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import pocketllm
from conftest import ROOT


@pytest.fixture
def good(ckpt_factory, tmp_path):
    """A fresh copy of a small single-file FP8 qwen3_5_text checkpoint that each test may break."""
    src, _ = ckpt_factory("qwen3_5_text", fp8=True)
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def load_error(path) -> str:
    with pytest.raises(pocketllm.CheckpointError) as e:
        pocketllm.LLM(path, backend="torch", quiet=True, max_context=64, max_batch_size=1)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def edit_config(path, fn):
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_weights(path, fn):
    state = load_file(str(path / "model.safetensors"))
    fn(state)
    save_file(state, str(path / "model.safetensors"))


LAYER0 = "model.layers.0.linear_attn."


def test_missing_directory(tmp_path):
    assert "checkpoint directory not found" in load_error(tmp_path / "nope")


def test_missing_config(good):
    (good / "config.json").unlink()
    assert load_error(good) == f"{good / 'config.json'}: file not found"


def test_missing_tokenizer(good):
    (good / "tokenizer.json").unlink()
    assert load_error(good) == f"{good / 'tokenizer.json'}: file not found"


def test_unknown_model_type(good):
    edit_config(good, lambda c: c.update(model_type="llama"))
    assert "unsupported model_type 'llama'" in load_error(good)


def test_unsupported_quantization(good):
    edit_config(good, lambda c: c["quantization_config"].update(quant_method="gptq"))
    assert "unsupported quantization quant_method='gptq'" in load_error(good)


def test_missing_tensor(good):
    edit_weights(good, lambda s: s.pop(LAYER0 + "A_log"))
    assert load_error(good) == f"{good}: missing tensor '{LAYER0}A_log'"


def test_shape_mismatch(good):
    edit_weights(good, lambda s: s.update({LAYER0 + "dt_bias": torch.zeros(7, dtype=torch.bfloat16)}))
    assert load_error(good) == f"tensor '{LAYER0}dt_bias' has shape [7], expected [4]"


def test_scale_shape_mismatch(good):
    name = LAYER0 + "in_proj_qkv.weight_scale_inv"
    edit_weights(good, lambda s: s.update({name: torch.ones(5, 5)}))
    msg = load_error(good)
    assert msg.startswith(f"tensor '{name}' has shape [5, 5], expected [3, 2] (one scale per 128x128 block of [320, 160])")


def test_missing_scale(good):
    edit_weights(good, lambda s: s.pop(LAYER0 + "out_proj.weight_scale_inv"))
    assert f"missing tensor '{LAYER0}out_proj.weight_scale_inv'" in load_error(good)


def test_truncated_safetensors(good):
    f = good / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    assert load_error(good).startswith(f"{f}: cannot read safetensors file")


def test_missing_shard(ckpt_factory, tmp_path):
    src, _ = ckpt_factory("qwen3_5", fp8=True, shards=2)
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    (dst / "model-00002-of-00002.safetensors").unlink()
    assert "model-00002-of-00002.safetensors: shard listed in model.safetensors.index.json is missing" in load_error(dst)


def test_sharded_checkpoint_loads_without_reading_vision_or_mtp(ckpt_factory):
    """Vision and MTP tensors sit in a deliberately truncated shard: loading works only if they are skipped."""
    path, _ = ckpt_factory("qwen3_5", fp8=True, shards=2)
    llm = pocketllm.LLM(path, backend="torch", quiet=True, max_context=64, max_batch_size=1)
    assert llm.generate([5, 6, 7], max_tokens=2, temperature=0)["completion_tokens"] == 2


def test_bf16_scales_accepted(ckpt_factory):
    path, ref = ckpt_factory("qwen3_5_text", fp8=True, scale_dtype=torch.bfloat16)
    llm = pocketllm.LLM(path, backend="torch", quiet=True, max_context=64, max_batch_size=1)
    ids = list(range(5, 30))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0]
    got = llm.logits(ids)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-4


def test_cli_reports_one_line_and_exit_code_2(good):
    edit_config(good, lambda c: c.update(model_type="mamba"))
    r = subprocess.run([sys.executable, str(ROOT / "pocketllm.py"), "--ckpt", str(good), "--quiet"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert lines == [f"pocketllm: error: {good / 'config.json'}: unsupported model_type 'mamba' "
                     f"(supported: qwen3_5, qwen3_5_text, qwen3)"]
