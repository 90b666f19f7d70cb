"""The torch backend computes what transformers computes (float32), for every supported layout and dtype."""

import pytest
import torch

import pocketllm

LAYOUTS = [(mt, fp8) for mt in ("qwen3_5", "qwen3_5_text", "qwen3") for fp8 in (False, True)]
IDS = [5 + (i * 37) % 390 for i in range(64)]   # a fixed 64-token prompt inside the tiny vocabulary


def rel_err(got, want):
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def loaded(ckpt_factory):
    cache = {}

    def get(mt, fp8):
        if (mt, fp8) not in cache:
            path, ref = ckpt_factory(mt, fp8=fp8)
            cache[mt, fp8] = pocketllm.LLM(path, backend="torch", quiet=True, max_context=256, max_batch_size=4), ref
        return cache[mt, fp8]
    return get


@pytest.mark.parametrize("mt,fp8", LAYOUTS)
def test_logits_match_transformers(loaded, mt, fp8):
    llm, ref = loaded(mt, fp8)
    got = llm.logits(IDS)
    with torch.no_grad():
        want = ref(torch.tensor([IDS])).logits[0].float()
    assert got.shape == (64, llm.config.vocab_size)
    assert rel_err(got, want) <= 1e-4


@pytest.mark.parametrize("mt,fp8", LAYOUTS)
def test_chunked_prefill_and_recurrent_decode_match_one_shot(loaded, mt, fp8):
    llm, _ = loaded(mt, fp8)
    one_shot = llm.logits(IDS)
    assert rel_err(llm.logits(IDS, chunk_size=7), one_shot) <= 1e-5     # state and KV carried across chunks
    assert rel_err(llm.logits(IDS, chunk_size=1), one_shot) <= 1e-5     # the decode path at every position


@pytest.mark.parametrize("mt,fp8", [("qwen3_5", True), ("qwen3_5_text", False), ("qwen3", True)])
def test_greedy_tokens_match_transformers_generate(loaded, mt, fp8):
    llm, ref = loaded(mt, fp8)
    prompt = IDS[:12]
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(prompt):].tolist()
    got = llm.generate(prompt, max_tokens=40, temperature=0, ignore_eos=True)
    assert got["token_ids"] == want
    assert got["finish_reason"] == "length" and got["completion_tokens"] == 40


def test_fp8_weights_stay_fp8(ckpt_factory):
    path, _ = ckpt_factory("qwen3_5", fp8=True)
    llm = pocketllm.LLM(path, backend="torch", quiet=True, max_context=256, max_batch_size=4, fp8_dense_memory=0)
    L = llm.model.layers[0]
    assert not llm.model.dense
    assert L.mixer.in_proj_qkv.weight.dtype == torch.float8_e4m3fn and L.mixer.in_proj_qkv.scale is not None
    assert L.mlp.gate_proj.weight.dtype == torch.float8_e4m3fn
    # unquantised linears take the activation dtype (float32 here); the embedding stays as stored
    assert L.mixer.in_proj_a.weight.dtype == torch.float32 and L.mixer.in_proj_a.scale is None
    assert llm.model.lm_head.weight.dtype == torch.float32 and llm.model.embed_tokens.dtype == torch.bfloat16
    llm.close()


def test_fp8_dequantised_once_gives_the_logits_of_dequantising_per_use(loaded, ckpt_factory):
    """Under --fp8-dense-memory the FP8 weights are dense copies (stacked, as on a GPU) and the logits are those
    of dequantising each weight at each use; one byte under the dense copy's size, every weight stays FP8."""
    dense, _ = loaded("qwen3_5", True)
    path, _ = ckpt_factory("qwen3_5", fp8=True)
    per_use = pocketllm.LLM(path, backend="torch", quiet=True, max_context=256, max_batch_size=4, fp8_dense_memory=0)
    L = dense.model.layers[0]
    assert dense.model.dense and L.mixer.in_proj_qkv.scale is None and L.mixer.in_proj_qkv.weight.dtype == torch.float32
    assert len(L.mixer.in_proj.groups) == 1 and len(L.mlp.gate_up.groups) == 1     # stacked: one matmul each
    fp8 = fp8_linears(per_use.model)
    copies = {(i, n): w for i, L in enumerate(dense.model.layers) for n, w in pocketllm.named_weights(L)}
    same = [k for k, w in fp8 if torch.equal(copies[k].weight, pocketllm.dequantize(w, torch.float32))]
    assert fp8 and same == [k for k, _ in fp8 if k[1] != "mixer.q_proj"]   # q_proj's rows regrouped [q | gate]
    # the same weights; stacked matmuls sum in another order (float32 rounding, ~1e-6)
    assert rel_err(dense.logits(IDS), per_use.logits(IDS)) <= 1e-5
    assert rel_err(dense.logits(IDS, chunk_size=1), per_use.logits(IDS, chunk_size=1)) <= 1e-5   # decode path
    got = dense.generate(IDS[:12], max_tokens=24, temperature=0, ignore_eos=True)["token_ids"]
    assert got == per_use.generate(IDS[:12], max_tokens=24, temperature=0, ignore_eos=True)["token_ids"]
    per_use.close()
    ckpt = pocketllm.Checkpoint(path)
    load = lambda budget: pocketllm.Model(ckpt, pocketllm.TorchOps(), torch.float32, torch.device("cpu"),  # noqa: E731
                                          progress=False, dense_budget=budget)
    assert load(dense.model.dense_bytes).dense and not load(dense.model.dense_bytes - 1).dense
    assert dense.model.dense_bytes == 4 * sum(w.weight.numel() for _, w in fp8)


def test_large_bf16_weight_runs_as_fp16_gemm_with_the_fp32_result():
    """pack_half: a large float32 weight that holds bf16 values (an lm_head) runs as torch's fp16 GEMM with the
    float32 result; weights fp16 cannot hold (FP8 x scale products) and small ones stay float32."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(1024, 1024, generator=g) * 0.05).bfloat16().float()          # (N, K) bf16 values
    w[0, :4] = torch.tensor([1e-6, -3e-7, 2.0 ** -14, 300.0])                        # below fp16's normal range too
    x = torch.randn(3, 1024, generator=g)
    packed = pocketllm.pack_half(pocketllm.Linear(w))
    assert packed.packed is not None and packed.weight.dtype == torch.float16
    assert (packed.weight.float() - w).abs().max() <= 2.0 ** -25                    # exact above 2^-14
    want = x.double() @ w.double().t()
    assert rel_err(pocketllm.TorchOps().linear(x, packed, torch.float32), want) <= 1e-5   # float32 sums
    assert pocketllm.TorchOps().linear(x, packed, torch.float32).dtype == torch.float32
    inexact = torch.randn(1024, 1024, generator=g) * 0.05                             # 24-bit mantissas
    assert pocketllm.pack_half(pocketllm.Linear(inexact)).packed is None
    assert pocketllm.pack_half(pocketllm.Linear(w[:512])).packed is None             # under HALF_PACK_MIN


def fp8_linears(model):
    return [((i, n), w) for i, L in enumerate(model.layers) for n, w in pocketllm.named_weights(L)
            if isinstance(w, pocketllm.Linear) and w.scale is not None]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_smoke_layers_every_n(ckpt_factory, n):
    """--smoke-layers N runs the first N layers, whether N ends in a linear- or a full-attention run."""
    import checkpoints
    path, ref = ckpt_factory("qwen3_5", fp8=True)
    llm = pocketllm.LLM(path, backend="torch", quiet=True, smoke_layers=n, max_context=128, max_batch_size=2)
    assert len(llm.model.layers) == n
    cfg = checkpoints.text_config("qwen3_5", ref.config.vocab_size, num_hidden_layers=n,
                                  layer_types=ref.config.layer_types[:n])
    small = checkpoints.reference_model("qwen3_5", cfg)
    missing, _ = small.load_state_dict(ref.state_dict(), strict=False)
    assert not missing
    with torch.no_grad():
        want = small(torch.tensor([IDS[:20]]), use_cache=False).logits[0]
    assert rel_err(llm.logits(IDS[:20]), want) <= 1e-4
    assert llm.generate(IDS[:5], max_tokens=3, temperature=0)["completion_tokens"] == 3


def test_layer_types_derived_from_interval(tmp_path):
    raw = {"model_type": "qwen3_5_text", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
           "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
           "full_attention_interval": 4, "rope_parameters": {"rope_theta": 1e7, "partial_rotary_factor": 0.25}}
    cfg = pocketllm.parse_model_config(raw, tmp_path / "config.json")
    assert cfg.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert cfg.rotary_dim == 2 and cfg.rope_theta == 1e7
    old = dict(raw, rope_parameters=None, rope_theta=5e5, partial_rotary_factor=0.5)
    cfg = pocketllm.parse_model_config(old, tmp_path / "config.json")
    assert cfg.rope_theta == 5e5 and cfg.rotary_dim == 4
