"""Tiny random checkpoints for tests, written the way real Qwen checkpoints are (HF layout, optional FP8).

`transformers` is the writer and the reference: `make_checkpoint` builds a random transformers model, writes
its weights in the requested layout (nested qwen3_5 with vision/mtp tensors, flat qwen3_5_text, or qwen3),
optionally FP8 block-quantised, plus a small byte-level BPE tokenizer and a Qwen3.5-style chat template, and
returns the path together with a reference transformers model that holds exactly the weights pocketllm will
compute with (the dequantised ones for FP8).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

# A compact Qwen3.5-style template: tools as JSON lines, XML tool calls from arguments|items, tool results
# in a user turn, <think> handling. Enough for server and tool tests on random checkpoints.
CHAT_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

To call a function reply with <tool_call>
<function=NAME>
<parameter=NAME>
VALUE
</parameter>
</function>
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'system' %}{% continue %}{% endif %}
{%- if m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user
{% endif %}<tool_response>
{{ m.content }}
</tool_response>
{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif %}
{%- elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content }}
{%- for tc in m.tool_calls or [] %}
<tool_call>
<function={{ tc.function.name }}>
{% for k, v in tc.function.arguments|items %}<parameter={{ k }}>
{{ v if v is string else v | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

CORPUS = [
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "What is the weather in Paris today? It is sunny and 21 degrees.",
    "Bonjour, ça va? 你好，世界！ こんにちは 🙂🚀 emoji and CJK text.",
    '{"name": "get_weather", "arguments": {"city": "Berlin", "days": 3}}',
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nTokyo\n</parameter>\n</function>\n</tool_call>",
] * 20


def make_tokenizer(path: Path, vocab_size: int = 400) -> int:
    """Train a byte-level BPE with the Qwen special and added tokens; return its full vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from tokenizers import AddedToken
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return tok.get_vocab_size(with_added_tokens=True)


def text_config(model_type: str, vocab_size: int, **over) -> dict:
    """Dims chosen so that several are not multiples of 128 (ragged FP8 edge blocks)."""
    cfg = dict(vocab_size=vocab_size, hidden_size=160, intermediate_size=200, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
               max_position_embeddings=4096, tie_word_embeddings=False)
    if model_type == "qwen3":
        cfg.update(rope_theta=10000.0, rope_scaling=None, attention_bias=False)
    else:
        cfg.update(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                   linear_value_head_dim=48, linear_conv_kernel_dim=4,
                   layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                    "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    cfg.update(over)
    return cfg


def reference_model(model_type: str, cfg: dict):
    import transformers
    if model_type == "qwen3":
        conf = transformers.Qwen3Config(**cfg)
        model = transformers.Qwen3ForCausalLM(conf)
    else:
        conf = transformers.Qwen3_5TextConfig(**cfg)
        model = transformers.Qwen3_5ForCausalLM(conf)
    return model.float().eval()


FP8_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
             "gate_proj", "up_proj", "down_proj")


def quantize_fp8(w: torch.Tensor, block: int = 128, scale_dtype=torch.float32):
    """Block-quantise (N, K) to e4m3 with one scale per 128x128 block; returns (q, scale, dequantised)."""
    n, k = w.shape
    sn, sk = -(-n // block), -(-k // block)
    pad = torch.nn.functional.pad(w.float(), (0, sk * block - k, 0, sn * block - n))
    blocks = pad.view(sn, block, sk, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-8)
    scale = (amax / 448.0).to(scale_dtype)
    q = (blocks / scale.float()[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    deq = (q.float() * scale.float()[:, None, :, None]).view(sn * block, sk * block)[:n, :k]
    q = q.view(sn * block, sk * block)[:n, :k].contiguous()
    return q, scale, deq


def mtp_tensors(ref, cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """A random MTP layer in Qwen3.5's layout (`mtp.fc`, its norms, `mtp.layers.0.*` shaped like a full-attention
    decoder layer, `mtp.norm`), float32, named as the real checkpoints name it."""
    g = torch.Generator().manual_seed(seed + 1)
    full = cfg["layer_types"].index("full_attention")
    D = cfg["hidden_size"]
    shapes = {f"layers.0.{n}": t.shape for n, t in ref.model.layers[full].state_dict().items()}
    shapes.update({"fc.weight": (D, 2 * D), "pre_fc_norm_embedding.weight": (D,), "pre_fc_norm_hidden.weight": (D,),
                   "norm.weight": (D,)})
    return {"mtp." + n: torch.randn(shape, generator=g) * (0.2 if "norm" in n else 0.08)
            for n, shape in sorted(shapes.items())}


def make_checkpoint(path: Path, model_type: str = "qwen3_5", fp8: bool = False, seed: int = 0,
                    scale_dtype=torch.float32, dtype=torch.bfloat16, shards: int = 1, extra_tensors: bool = True,
                    mtp: bool = False, **over):
    """Write a random checkpoint to `path`; return (path, reference transformers model in float32). With `mtp`
    (qwen3_5 kinds) the checkpoint also holds a random MTP layer (`mtp.*`, FP8 like the layers when fp8)."""
    from safetensors.torch import save_file
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(path)
    torch.manual_seed(seed)
    cfg = text_config(model_type, over.pop("vocab_size", vocab + 3), **over)
    ref = reference_model(model_type, cfg)
    with torch.no_grad():   # random, non-trivial weights everywhere (norms included)
        for name, p in ref.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            elif "norm" in name:
                plain = model_type == "qwen3" or "linear_attn.norm" in name   # x * w, not x * (1 + w)
                p.normal_(1.0 if plain else 0.0, 0.2)
            else:
                p.normal_(0.0, 0.08)
        for p in ref.parameters():  # the stored precision is the reference's precision (buffers stay fp32)
            p.copy_(p.to(dtype).float())
    state = {}
    tensors = list(ref.state_dict().items())
    if mtp and model_type != "qwen3":
        tensors += [(n, t.to(dtype).float()) for n, t in mtp_tensors(ref, cfg, seed).items()]
    for name, t in tensors:
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        stored = name
        if model_type == "qwen3_5" and name.startswith("model."):
            stored = "model.language_model." + name[len("model."):]
        if fp8 and name.endswith(".weight") and any(f".{p}." in name for p in FP8_PARTS + ("fc",)):
            q, s, deq = quantize_fp8(t, scale_dtype=scale_dtype)
            state[stored] = q
            state[stored + "_scale_inv"] = s
            t.copy_(deq)           # the reference computes with exactly the dequantised weights
        else:
            state[stored] = t.to(dtype).contiguous()
    config = dict(cfg, model_type="qwen3_5_text" if model_type != "qwen3" else "qwen3")
    if model_type == "qwen3_5":
        config = {"model_type": "qwen3_5", "text_config": config, "tie_word_embeddings": False,
                  "vision_config": {"depth": 1, "hidden_size": 16}}
    if fp8:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128],
                                         "modules_to_not_convert": ["lm_head", "embed_tokens", "in_proj_a",
                                                                    "in_proj_b", "norm", "conv1d"]}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    eos = [2, 0]   # <|im_end|>, <|endoftext|> (SPECIAL order in the trained vocabulary)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    write_weights(path, state, shards, extra_tensors and model_type == "qwen3_5", mtp)
    return path, ref


def write_weights(path: Path, state: dict, shards: int, extra: bool, mtp: bool = False):
    """One file, or `shards` files plus model.safetensors.index.json. With `extra`, vision and MTP tensors go
    into a shard whose payload is deliberately cut short: loading succeeds only if they are never read."""
    from safetensors.torch import save_file
    names = sorted(state)
    if shards == 1 and not extra:
        save_file(state, str(path / "model.safetensors"))
        return
    weight_map = {}
    for i in range(shards):
        part = {n: state[n] for n in names[i::shards]}
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(path / fname))
        weight_map.update({n: fname for n in part})
    if extra:
        junk = {"model.visual.patch_embed.proj.weight": torch.randn(16, 3, 2, 2)}
        if not mtp:   # a real MTP layer is read (speculative decoding); a junk one must never be
            junk["mtp.layers.0.mlp.up_proj.weight"] = torch.randn(8, 8)
        save_file(junk, str(path / "model-extra.safetensors"))
        data = (path / "model-extra.safetensors").read_bytes()
        (path / "model-extra.safetensors").write_bytes(data[:len(data) // 2])
        weight_map.update({n: "model-extra.safetensors" for n in junk})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
