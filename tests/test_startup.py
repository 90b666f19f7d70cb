"""Start-up: device, backend and dtype chosen and validated before any weight loads (with torch.cuda's queries
monkeypatched, so the GPU decisions are tested on this CPU-only machine), the cache sized from memory, the
config-based memory budget against the cache pocketllm really allocates, and the warm-up run for real."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import pocketllm

TINY = pocketllm.DEFAULT_CKPT
GiB = 1 << 30


@pytest.fixture
def gpus(monkeypatch):
    """gpus(n, native=True): torch sees n CUDA devices and the native library loads (or says why it does not)."""
    def fake(n: int, native: bool = True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Fake GPU")
        monkeypatch.setattr(pocketllm, "native_status",
                            lambda device: (True, "libpocketllm.so on Fake GPU") if native and torch.device(device).type == "cuda"
                            else (False, "no usable GPU (fake)"))
    return fake


def plan(**options):
    return pocketllm.plan_placement(pocketllm.EngineOptions(**options))


# ---- Device, backend, dtypes ----

def test_auto_is_the_first_gpu_with_the_native_backend_in_float16(gpus):
    gpus(2)
    p = plan()
    assert (p.device, p.backend, p.dtype, p.kv_dtype) == (torch.device("cuda", 0), "native", torch.float16,
                                                          torch.float16)
    assert p.describe() == ("backend native on cuda:0 (Fake GPU), float16 activations, float16 KV cache: "
                            "libpocketllm.so on Fake GPU")


def test_auto_without_a_gpu_is_the_cpu_with_torch(gpus):
    gpus(0)
    p = plan()
    assert (p.device, p.backend, p.dtype) == (torch.device("cpu"), "torch", torch.float32)
    assert "no usable GPU" in p.why


def test_auto_falls_back_to_torch_and_says_why(gpus):
    gpus(1, native=False)
    p = plan()
    assert (p.device.type, p.backend, p.dtype) == ("cuda", "torch", torch.float16) and "no usable GPU" in p.why
    gpus(1)
    p = plan(dtype="bf16")                    # vLLM's name; the kernels have no bfloat16 path
    assert (p.backend, p.dtype) == ("torch", torch.bfloat16) and "float16 or float32 activations" in p.why


@pytest.mark.parametrize("options, message", [
    ({"backend": "native", "dtype": "bfloat16"}, "--backend native: the native kernels take float16 or float32"),
    ({"backend": "native", "kv_dtype": "float32"}, "--backend native: .*leave --kv-dtype at auto"),
    ({"device": "cuda:2"}, r"--device cuda:2: only 2 CUDA device\(s\) visible"),
    ({"device": "mps"}, "--device mps: pocketllm runs on cpu or cuda"),
    ({"device": "gpu0"}, "--device 'gpu0' is not a device"),
    ({"dtype": "fp8"}, "--dtype must be one of"),
    ({"kv_dtype": "int8"}, "--kv-dtype must be one of"),
    ({"backend": "tensorrt"}, "--backend must be auto, torch or native"),
])
def test_unsupported_combinations_are_refused_naming_the_flag(gpus, options, message):
    gpus(2)
    with pytest.raises(pocketllm.PocketError, match=message):
        plan(**options)


def test_every_combination_either_runs_or_is_refused_at_plan_time(gpus):
    """The whole backend x device x dtype x kv-dtype table: native only with fp16/fp32 activations and the
    KV cache in the activation dtype; torch with anything."""
    gpus(1)
    for backend in ("auto", "torch", "native"):
        for device in ("auto", "cpu", "cuda"):
            for dtype in ("auto", "float32", "float16", "bfloat16"):
                for kv in ("auto", "float32", "float16", "bfloat16"):
                    opts = dict(backend=backend, device=device, dtype=dtype, kv_dtype=kv)
                    try:
                        p = plan(**opts)
                    except pocketllm.PocketError as e:
                        assert backend == "native" and str(e).startswith("--backend native:"), (opts, e)
                        continue
                    if p.backend == "native":
                        assert p.device.type == "cuda" and p.dtype in (torch.float16, torch.float32), opts
                        assert p.kv_dtype == p.dtype, opts
                    assert backend != "torch" or p.backend == "torch", opts


def test_a_cuda_device_without_a_gpu_is_one_clear_error(gpus):
    gpus(0)
    with pytest.raises(pocketllm.PocketError, match="--device cuda: torch .* sees no CUDA device"):
        plan(device="cuda")


def test_refused_before_any_weight_loads(gpus, monkeypatch):
    gpus(1)
    def no_weights(*a, **k):
        raise AssertionError("weights were loaded before the options were checked")
    monkeypatch.setattr(pocketllm, "Model", no_weights)
    monkeypatch.setattr(pocketllm, "start_group", no_weights)
    for options in ({"backend": "native", "dtype": "bfloat16"}, {"device": "cuda:1"},
                    {"gpu_memory_utilization": 0.0}, {"max_batch_size": -1}):
        with pytest.raises(pocketllm.PocketError):
            pocketllm.LLM(TINY, quiet=True, **options)


def test_the_cpu_keeps_todays_batch_size_and_cache():
    llm = pocketllm.LLM(TINY, quiet=True, max_context=256)
    try:
        assert llm.options.max_batch_size == pocketllm.DEFAULT_MAX_BATCH_SIZE == 16
        assert llm.engine.blocks.total == 16 * 256 // 16
        assert (llm.options.device, llm.options.backend) == ("cpu", "torch")
    finally:
        llm.close()


# ---- Sizing the cache from memory ----

def _opts(**kw):
    return pocketllm.EngineOptions(**{"max_context": 4096, "kv_block_size": 16, **kw})


def test_sizing_fills_the_budget_and_no_more():
    per_block, per_slot, ws = 2 << 20, 150 << 20, 3 * GiB        # 27B-like: 2 MiB a block, 150 MiB of state
    free, total = 110 * GiB, 141 * GiB
    opts = _opts(gpu_memory_utilization=0.9)
    batch, blocks = pocketllm.size_from_memory(opts, free, total, per_block, per_slot, ws, total - free)
    budget = free - int(0.1 * total) - ws                           # alone on the card: its weights are the rest
    assert batch == min(256, budget // 2 // per_slot)
    used = batch * per_slot + blocks * per_block
    assert used <= budget < used + per_block                        # the rest of the budget is under a block
    batch2, blocks2 = pocketllm.size_from_memory(_opts(gpu_memory_utilization=0.5), free, total, per_block,
                                                 per_slot, ws, total - free)
    assert batch2 < batch and blocks2 < blocks


def test_two_engines_share_a_gpu_by_their_utilization():
    """vLLM's per-instance meaning: at 0.4 each, a second engine on the card gets its own 0.4 of it, not what
    the first one left under a card-wide 0.4."""
    per_block, total, weights, ws = 2 << 20, 141 * GiB, 20 * GiB, GiB
    size_blocks = pocketllm.size_from_memory(_opts(gpu_memory_utilization=0.4, max_batch_size=8), total - weights,
                                             total, per_block, 0, ws, weights)
    used_by_first = int(0.4 * total)
    second = pocketllm.size_from_memory(_opts(gpu_memory_utilization=0.4, max_batch_size=8),
                                        total - used_by_first - weights, total, per_block, 0, ws, weights)
    assert second == size_blocks and size_blocks[1] == (int(0.4 * total) - weights - ws) // per_block
    free = total - used_by_first - weights                          # 0.9 + 0.4 > 1: it gets what is free
    greedy = pocketllm.size_from_memory(_opts(gpu_memory_utilization=0.9, max_batch_size=8), free, total,
                                        per_block, 0, ws, weights)
    assert greedy[1] == (free - ws) // per_block


def test_sizing_keeps_what_the_user_set():
    args = (100 * GiB, 141 * GiB, 1 << 20, 1 << 20, GiB, 41 * GiB)
    assert pocketllm.size_from_memory(_opts(max_batch_size=7), *args)[0] == 7
    assert pocketllm.size_from_memory(_opts(num_kv_blocks=1000), *args)[1] == 1000
    assert pocketllm.size_from_memory(_opts(), 100 * GiB, 141 * GiB, 1 << 20, 0, GiB, 41 * GiB)[0] == 256   # no state


def test_sizing_refuses_a_gpu_too_small_for_one_sequence():
    with pytest.raises(pocketllm.PocketError, match="--gpu-memory-utilization 0.9: 5.00 GiB of 80.00 GiB are free"):
        pocketllm.size_from_memory(_opts(), 5 * GiB, 80 * GiB, 2 << 20, 150 << 20, GiB, 75 * GiB)
    with pytest.raises(pocketllm.PocketError, match="--max-batch-size 256: its recurrent state"):
        pocketllm.size_from_memory(_opts(max_batch_size=256), 40 * GiB, 80 * GiB, 2 << 20, 150 << 20, GiB,
                                   40 * GiB)


def test_the_size_matches_the_cache_the_engine_allocates(monkeypatch):
    """_size_cache's per-block and per-slot bytes (meta tensors) against the real cache of a running engine."""
    llm = pocketllm.LLM(TINY, quiet=True, max_context=256, max_batch_size=4)
    try:
        cache = llm.engine.cache
        kv = sum(t.numel() * t.element_size() for t in [*cache.k.values(), *cache.v.values()])
        state = sum(t.numel() * t.element_size() for t in [*cache.conv.values(), *cache.ssm.values()])
        snaps = llm.engine.snapshots                  # the prefix cache's state snapshots: one per slot by default
        state += sum(t.numel() * t.element_size() for t in [*snaps.conv.values(), *snaps.ssm.values()])
        monkeypatch.setattr(pocketllm, "device_memory", lambda device: (3 * GiB, 4 * GiB))
        llm.options.max_batch_size, llm.options.num_kv_blocks = 0, 0
        llm._size_cache()
        opts, per_block, per_slot = llm.options, kv // llm.engine.blocks.total, state // 4
        ws = pocketllm.workspace_bytes(llm.config, opts.prefill_token_budget, 256, 4)
        budget = 3 * GiB - ws                       # min(free, 0.9 x total - 0 held on the CPU) = free
        assert opts.max_batch_size == min(256, budget // 2 // per_slot)
        assert opts.num_kv_blocks == (budget - opts.max_batch_size * per_slot) // per_block
    finally:
        llm.close()


def test_a_memory_sized_engine_starts_and_serves(monkeypatch):
    """LLM's GPU start-up order, run on the CPU: weights, then the cache sized from (faked) free memory, then the
    engine on that cache, which serves."""
    monkeypatch.setattr(pocketllm, "memory_sized", lambda device, opts: True)
    monkeypatch.setattr(pocketllm, "device_memory", lambda device: (1 * GiB, 2 * GiB))
    llm = pocketllm.LLM(TINY, quiet=True, max_context=256, gpu_memory_utilization=0.8)
    try:
        opts = llm.options
        assert opts.max_batch_size == 256 and llm.engine.slots.total == 256
        ws = pocketllm.workspace_bytes(llm.config, opts.prefill_token_budget, 256, 4)
        per_block = pocketllm.cache_bytes(llm.config, llm.model.cache_layers, 1, 16, 0, torch.float32)   # + MTP KV
        per_slot = pocketllm.cache_bytes(llm.config, llm.model.layers, 0, 16, 1, torch.float32)
        per_slot *= 2                                 # its state and, by default, one prefix-cache snapshot
        assert llm.engine.snapshots.ssm[0].shape[0] == 256
        assert llm.engine.blocks.total == (GiB - ws - 256 * per_slot) // per_block   # min(free, 0.8 x 2 GiB)
        assert llm.generate("Hello", max_tokens=3, temperature=1.0, presence_penalty=0.5)["completion_tokens"] == 3
    finally:
        llm.close()


# ---- The memory budget from config.json ----

def test_budget_kv_and_state_equal_the_allocated_cache():
    llm = pocketllm.LLM(TINY, quiet=True, max_context=256, max_batch_size=3)
    try:
        b = pocketllm.memory_budget(llm.config, llm.options, kv_bytes=4, act_bytes=4,
                                    mtp_layers=len(llm.model.cache_layers) - len(llm.model.layers))   # its MTP layer
        cache = llm.engine.cache
        assert b["kv_cache"] == sum(t.numel() * t.element_size() for t in [*cache.k.values(), *cache.v.values()])
        assert b["recurrent_state"] == sum(t.numel() * t.element_size()
                                           for t in [*cache.conv.values(), *cache.ssm.values()])
        assert b["total"] == sum(v for k, v in b.items() if k != "total")
    finally:
        llm.close()


def test_one_block_count_and_one_snapshot_count():
    """The engine's cache and the config budget count KV blocks (kv_cache_blocks) and prefix-cache snapshots
    (snapshot_count) with the same two helpers, which the memory check uses too."""
    llm = pocketllm.LLM(TINY, quiet=True, max_context=200, max_batch_size=3, prefix_cache_memory=1)
    try:
        opts, cfg = llm.options, llm.config
        assert llm.engine.blocks.total == pocketllm.kv_cache_blocks(opts) == 3 * 13
        slot = pocketllm.state_slot_bytes(cfg, llm.model.layers, torch.float32)
        snapshots = pocketllm.snapshot_count(opts, slot)
        assert llm.engine.prefix.slots_total == snapshots == (1 << 20) // slot
        b = pocketllm.memory_budget(cfg, opts, kv_bytes=4, act_bytes=4, mtp_layers=1)
        assert b["prefix_cache"] == snapshots * slot and b["recurrent_state"] == 3 * slot
        with pytest.raises(pocketllm.PocketError, match="--num-kv-blocks 12 x --kv-block-size 16 cannot hold one"):
            pocketllm.kv_cache_blocks(pocketllm.EngineOptions(max_context=200, num_kv_blocks=12))
    finally:
        llm.close()


def test_budget_weights_match_the_checkpoint_files():
    cfg = pocketllm.Checkpoint(TINY).config
    stored = 0
    with safe_open(str(TINY / "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_slice(name)
            n = 1
            for d in t.get_shape():
                n *= d
            stored += n * {"F8_E4M3": 1, "BF16": 2, "F16": 2, "F32": 4}[t.get_dtype()]
    estimate = weight_bytes(cfg)
    assert abs(estimate - stored) / stored < 0.02, (estimate, stored)


def weight_bytes(cfg, world: int = 1) -> int:
    """One rank's weights as stored, from the budget's parts: its layer share and its embedding and lm_head rows
    (one table when tied)."""
    return pocketllm.layer_bytes(cfg, world) + pocketllm.vocab_bytes(cfg, world) * (1 if cfg.tie_word_embeddings
                                                                                    else 2)


def config_27b() -> "pocketllm.ModelConfig":
    """Qwen3.5-27B FP8's text config (docs/qwen-facts.md): the bundled model's config.json (FP8, qwen3_5) with
    the 27B's shapes. docs/serving.md's memory table is computed from it."""
    raw = json.loads((TINY / "config.json").read_text())
    text = raw["text_config"]
    text.update(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16, tie_word_embeddings=False)
    return pocketllm.parse_model_config(raw, Path("27b/config.json"))


def config_08b() -> "pocketllm.ModelConfig":
    """A 0.8B-class Qwen3.5 (benchmarks/bench.py's SHAPE_0_8B, its 24 layers), FP8 like the bundled model."""
    raw = json.loads((TINY / "config.json").read_text())
    raw["text_config"].update(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                              num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                              linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                              layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6)
    return pocketllm.parse_model_config(raw, Path("0.8b/config.json"))


def weights(budget: dict) -> int:
    return budget["layers"] + budget["embedding"] + budget["lm_head"]


def test_budget_of_the_27b_on_one_and_four_gpus():
    cfg = config_27b()
    opts = pocketllm.EngineOptions(max_context=8192, max_batch_size=8)
    one = pocketllm.memory_budget(cfg, opts, 1)
    four = pocketllm.memory_budget(cfg, opts, 4)
    assert 26 * GiB < weights(one) < 31 * GiB                      # 27B params: ~25 GB FP8 layers + 5 GB bf16 embeddings
    assert weights(four) < weights(one) / 2                        # layers split
    # embedding and lm_head vocab-parallel: 248320 / 4 rows x 5120 x 2 bytes each
    assert one["embedding"] == one["lm_head"] == 248320 * 5120 * 2 and four["embedding"] == 62080 * 5120 * 2
    assert four["layers"] == -(-(one["layers"] - 2 * 5120) // 4) + 2 * 5120   # the final norm on every rank
    # 16 attention layers x K,V x 8 x 8192 tokens x 4 heads x 256 x 2 bytes = 4 GiB; TP4 holds one head each
    assert one["kv_cache"] == 16 * 2 * 8 * 8192 * 4 * 256 * 2 and four["kv_cache"] == one["kv_cache"] // 4
    assert one["recurrent_state"] > 8 * 48 * 48 * 128 * 128 * 4    # 48 GDN layers x 8 sequences x fp32 state


# ---- A configuration that cannot fit is refused before any weight loads ----

CARD_2080TI = int(10.75 * GiB)                # what CUDA reports for an "11 GB" RTX 2080 Ti


def fake_gpus(monkeypatch, total: int, free: int):
    """CUDA devices of `total` bytes, rank 0's with `free` of them free (the others are not asked)."""
    class Props:
        name, total_memory = "fake GPU", total
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Props())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)


def fits(cfg, devices: str, sized: bool = False, **options) -> None:
    opts = pocketllm.EngineOptions(devices=devices, **options)
    pocketllm.check_memory_fits(cfg, opts, pocketllm.parse_devices(devices), torch.float16, torch.float16, sized)


def test_the_27b_fits_four_11gb_cards_and_what_does_not_is_refused_naming_the_fix(monkeypatch):
    cfg = config_27b()
    fake_gpus(monkeypatch, CARD_2080TI, CARD_2080TI - 300 * (1 << 20))      # a CUDA context's worth in use
    fits(cfg, "0,1,2,3", max_context=8192, max_batch_size=8)
    fits(cfg, "0,1,2,3", max_context=16384, max_batch_size=4)
    with pytest.raises(pocketllm.PocketError) as e:                          # 64 x 32k tokens of KV cache per rank
        fits(cfg, "0,1,2,3", max_context=32768, max_batch_size=64)
    said = str(e.value)
    assert "\n" not in said and said.startswith("cuda:0 can use ") and "need" in said
    assert "--max-model-len (now 32768)" in said and "--max-num-seqs (now 64)" in said and "more than 4 GPUs" in said
    with pytest.raises(pocketllm.PocketError, match=r"the weights alone \(.*\) do not fit: use --devices with "
                                                    r"more than 2 GPUs"):
        fits(cfg, "0,1", max_context=4096, max_batch_size=1)
    fake_gpus(monkeypatch, 24 * GiB, 23 * GiB)
    fits(cfg, "0,1", max_context=8192, max_batch_size=8)
    fake_gpus(monkeypatch, 80 * GiB, 79 * GiB)                               # one card, cache sized from memory
    fits(cfg, "0", sized=True, max_context=32768, max_batch_size=0, num_kv_blocks=0)
    monkeypatch.setattr(pocketllm, "host_memory", lambda: 1 << 50)
    fits(cfg, "cpu,cpu", max_context=32768, max_batch_size=64)               # CPU ranks: the machine's RAM


def test_a_gpu_too_small_is_refused_before_any_weight_loads(monkeypatch):
    """LLM() on a (faked) 768 MiB GPU with pocket-tiny at a context whose KV cache needs more (one 200000-token
    sequence: 586 MiB, plus 261 MiB of workspace): one line, and the model is never built. 4096 tokens fit."""
    fake_gpus(monkeypatch, 768 << 20, 768 << 20)
    monkeypatch.setenv(pocketllm.ALLOW_LONG_CONTEXT, "1")           # past pocket-tiny's 65536 positions
    placement = pocketllm.Placement(torch.device("cuda", 0), "torch", torch.float16, torch.float16, "faked")
    monkeypatch.setattr(pocketllm, "plan_placement", lambda opts: placement)

    def loads(*args, **kwargs):
        raise AssertionError("a weight was loaded before the memory check")
    monkeypatch.setattr(pocketllm, "Model", loads)
    monkeypatch.setattr(pocketllm, "start_group", loads)
    with pytest.raises(pocketllm.PocketError, match=r"^cuda:0 can use .* lower --max-context/--max-model-len "
                                                    r"\(now 200000\)"):
        pocketllm.LLM(TINY, quiet=True, max_context=200000, max_batch_size=64, num_kv_blocks=0)
    with pytest.raises(AssertionError, match="a weight was loaded"):             # past the check: loading starts
        pocketllm.LLM(TINY, quiet=True, max_context=4096, max_batch_size=64, num_kv_blocks=0)


def no_loading(monkeypatch):
    def loads(*args, **kwargs):
        raise AssertionError("a weight was loaded before the memory check")
    monkeypatch.setattr(pocketllm, "Model", loads)
    monkeypatch.setattr(pocketllm, "start_group", loads)


def test_the_cpu_cache_is_checked_against_the_ram_available_before_any_weight_loads(monkeypatch):
    """On the CPU the cache's parts and the workspace are checked against MemAvailable (faked: 1 GiB), once per CPU
    rank, in one line naming the flag that sizes the largest part; what fits goes on to load."""
    no_loading(monkeypatch)
    monkeypatch.setenv(pocketllm.ALLOW_LONG_CONTEXT, "1")
    monkeypatch.setattr(pocketllm, "host_memory", lambda: GiB)
    with pytest.raises(pocketllm.PocketError) as e:          # 16 sequences of 1M tokens: 92 GiB of KV cache (3
        # attention layers; the MTP layer's is allocated only with speculation, off by default on the CPU)
        pocketllm.LLM(TINY, quiet=True, max_context=1000000)
    said = str(e.value)
    assert "\n" not in said and said.startswith("the CPU has 1.00 GiB available (MemAvailable), but 1 rank(s) need ")
    assert said.endswith("lower --max-context/--max-model-len (now 1000000) or --max-batch-size/--max-num-seqs "
                         "(now 16)") and "kv cache 91.55 GiB" in said
    for options, flag in (({"num_kv_blocks": 10 ** 6}, "--num-kv-blocks (now 1000000)"),
                          ({"prefix_cache_memory": 4096}, "--prefix-cache-memory (now 4096 MiB)"),
                          ({"prefill_token_budget": 10 ** 6}, "--prefill-token-budget/--max-num-batched-tokens "
                                                               "(now 1000000)")):
        with pytest.raises(pocketllm.PocketError, match=re.escape(f"; lower {flag}") + "$"):
            pocketllm.LLM(TINY, quiet=True, **options)
    with pytest.raises(pocketllm.PocketError, match=r"2 rank\(s\) need 558\.2 MiB each besides the weights "
                                                    r"\(fp8 dense copy 3\.9 MiB, "):   # one machine's RAM
        pocketllm.LLM(TINY, quiet=True, devices="cpu,cpu", max_context=6144)
    with pytest.raises(AssertionError, match="a weight was loaded"):   # under 1 GiB: past the check, loading starts
        pocketllm.LLM(TINY, quiet=True, max_context=4096)
    monkeypatch.setattr(pocketllm, "host_memory", lambda: None)       # unknown (no /proc/meminfo, no sysconf)
    with pytest.raises(AssertionError, match="a weight was loaded"):
        pocketllm.LLM(TINY, quiet=True, max_context=10 ** 6)


def test_the_budget_counts_the_dense_fp8_copy_the_torch_backend_makes():
    """pocket-tiny on the CPU: the config's estimate of the dense copy equals what Model dequantised, with and
    without the MTP layer (loaded when speculating)."""
    for spec in (0, 1):
        llm = pocketllm.LLM(TINY, quiet=True, max_context=256, max_batch_size=2, speculative_tokens=spec)
        try:
            mtp = len(llm.model.cache_layers) - len(llm.model.layers)
            assert llm.model.dense and mtp == spec
            b = pocketllm.memory_budget(llm.config, llm.options, kv_bytes=4, act_bytes=4, mtp_layers=mtp)
            assert b["fp8_dense_copy"] == llm.model.dense_bytes
        finally:
            llm.close()


def test_the_cpu_check_counts_the_dense_fp8_copy(monkeypatch):
    """The torch backend dequantises the FP8 weights once at load when the copy fits --fp8-dense-memory: on the
    CPU memory of its own (the FP8 weights stay in the mapped file), 1.85 GiB in fp32 for the 0.8B class. With RAM
    for everything else and half the copy, the check refuses, naming the flag; with the copy over
    --fp8-dense-memory (FP8 stays FP8), or on the native backend, there is no copy and the same RAM suffices."""
    cfg, cpu = config_08b(), [torch.device("cpu")]
    opts = pocketllm.EngineOptions(backend="torch", max_context=4096, max_batch_size=1)
    need = pocketllm.memory_budget(cfg, opts, kv_bytes=4, act_bytes=4)
    dense = need["fp8_dense_copy"]
    assert dense == 6 * 331350016                                   # Model.dense_bytes of its first 4 layers, x 6
    rest = need["total"] - weights(need) - dense
    monkeypatch.setattr(pocketllm, "host_memory", lambda: rest + dense // 2)
    with pytest.raises(pocketllm.PocketError, match=r"\(fp8 dense copy 1\.\d\d GiB, kv cache .*; lower "
                                                    r"--fp8-dense-memory \(now 4096 MiB\) below the dense copy's"):
        pocketllm.check_memory_fits(cfg, opts, cpu, torch.float32, torch.float32, sized=False)
    for other in ({"fp8_dense_memory": 1024}, {"backend": "native"}):
        without = dataclasses.replace(opts, **other)
        assert pocketllm.memory_budget(cfg, without, kv_bytes=4, act_bytes=4)["fp8_dense_copy"] == 0
        pocketllm.check_memory_fits(cfg, without, cpu, torch.float32, torch.float32, sized=False)


def test_the_ram_available_is_memavailable():
    meminfo = Path("/proc/meminfo").read_text()
    available = int(re.search(r"^MemAvailable:\s+(\d+) kB$", meminfo, re.M).group(1)) * 1024
    assert abs(pocketllm.host_memory() - available) < 256 << 20      # read again a moment later


def test_the_flag_named_is_the_one_that_sizes_the_largest_part():
    opts = pocketllm.EngineOptions(max_context=8192, max_batch_size=8)
    need = {"kv_cache": 1, "recurrent_state": 5, "prefix_cache": 4, "workspace": 2}
    assert pocketllm.memory_fix(opts, need, sized=False) == "lower --max-batch-size/--max-num-seqs (now 8)"
    assert pocketllm.memory_fix(opts, {**need, "prefix_cache": 6}, sized=False) == \
        "lower --max-batch-size/--max-num-seqs (now 8)"               # by default one snapshot per state slot
    assert pocketllm.memory_fix(opts, {**need, "kv_cache": 9}, sized=True) == \
        "lower --max-context/--max-model-len (now 8192)"              # sized: the batch follows the memory


def test_max_context_past_the_models_positions_needs_the_opt_in(monkeypatch):
    """vLLM's rule: --max-model-len past config.json's max_position_embeddings is refused unless asked for
    (VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 there, POCKETLLM_ALLOW_LONG_MAX_MODEL_LEN=1 here)."""
    no_loading(monkeypatch)
    monkeypatch.delenv(pocketllm.ALLOW_LONG_CONTEXT, raising=False)
    with pytest.raises(pocketllm.PocketError) as e:
        pocketllm.LLM(TINY, quiet=True, max_context=65537)
    assert str(e.value) == ("--max-context/--max-model-len 65537 is beyond the model's max_position_embeddings "
                            "(65536, config.json): positions past it were never trained; "
                            "POCKETLLM_ALLOW_LONG_MAX_MODEL_LEN=1 in the environment allows it")
    for allowed in ({"max_context": 65536}, {"max_context": 131072, "env": "1"}):
        if allowed.pop("env", None):
            monkeypatch.setenv(pocketllm.ALLOW_LONG_CONTEXT, "1")
        with pytest.raises(AssertionError, match="a weight was loaded"):
            pocketllm.LLM(TINY, quiet=True, **allowed)


# ---- The warm-up, for real ----

def test_serving_starts_with_a_warm_up_that_leaves_no_trace():
    llm = pocketllm.LLM(TINY, quiet=True, max_context=256, max_batch_size=2)
    try:
        said = llm.warm_up()
        assert said.startswith("warm-up: 16-token prefill and 4 tokens sampled at temperature 1 with penalties")
        assert llm.engine.counters["prompt_tokens"] == llm.engine.counters["generation_tokens"] == 0
        assert not any(llm.engine.counters.values())         # speculative decoding's counters too
        assert llm.engine.blocks.used == 0 and llm.engine.slots.used == 0
        assert llm.generate("Hello", max_tokens=3, temperature=0)["completion_tokens"] == 3
    finally:
        llm.close()


def test_a_server_whose_engine_fails_never_starts(monkeypatch):
    """The first request is the warm-up: a device fault there stops serve() before it listens."""
    llm = pocketllm.LLM(TINY, quiet=True, max_context=256, max_batch_size=2)
    try:
        def broken(*a, **k):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        monkeypatch.setattr(llm.model, "hidden", broken)    # every forward runs it (with speculation too)
        with pytest.raises(pocketllm.PocketError, match="the warm-up request failed, so the server does not start"):
            pocketllm.serve(llm, port=0, block=False)
    finally:
        llm.close()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("kv_dtype", ["auto", "float32", "float16", "bfloat16"])
def test_every_torch_combination_the_plan_accepts_serves_on_the_cpu(dtype, kv_dtype):
    """The other half of 'refused at load, never at the first request': what the plan accepts samples (temperature
    1, penalties) without error."""
    llm = pocketllm.LLM(TINY, quiet=True, device="cpu", dtype=dtype, kv_dtype=kv_dtype, max_context=128,
                        max_batch_size=2)
    try:
        out = llm.generate("Hello", max_tokens=3, temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5,
                           repetition_penalty=1.1, seed=1, logprobs=1)
        assert out["completion_tokens"] == 3 or out["finish_reason"] == "stop"
        assert all(lp is not None for lp in out["logprobs"])
    finally:
        llm.close()
