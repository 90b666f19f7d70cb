"""pocketllm: serve a Qwen FP8 checkpoint behind an OpenAI-compatible API, from one file.

Quickstart:

    pip install -r requirements.txt && python pocketllm.py            # serves the bundled pocket-tiny
    python pocketllm.py --ckpt /models/Qwen3.5-27B-FP8 --port 8000       # your checkpoint

    import pocketllm
    llm = pocketllm.LLM("/models/Qwen3.5-27B-FP8")
    print(llm.generate("The capital of France is", max_tokens=8)["text"])

Sections, in dependency order (each name is defined above its first use):

     0. Header: imports, version, the error hierarchy.
     1. Configuration: the model config from config.json, engine options, sampling parameters.
     2. Checkpoint loading: safetensors, HF names, FP8 block scales, shard helpers.
     3. Backends: the op list; the torch reference ops, then the native (cffi) ops.
     4. The model: norms, RoPE, gated DeltaNet, gated attention, MLP, layers, forward over a batch.
     5. Memory: paged KV blocks and recurrent-state slots.
     6. Scheduler: sequences, continuous batching, chunked prefill, preemption.
     7. Sampler.
     8. Runner and tensor parallelism.
     9. Engine: step = schedule, run, postprocess; request queues; abort. Token ids only.
    10. Text: tokenizer, incremental UTF-8-safe detokenizer, stop strings, sandboxed chat templates.
    11. Output parsing: reasoning and tool calls, streaming by partial re-parse and diff; tool_choice.
    12. OpenAI protocol: request validation into native types; response and chunk builders.
    13. HTTP server: ThreadingHTTPServer, route table, error translator, SSE.
    14. The LLM object (the Python API) and the CLI.
"""

from __future__ import annotations

__version__ = "0.1.0"
__license__ = "Apache-2.0"

import argparse
import dataclasses
import hmac
import http.server
import itertools
import json
import math
import os
import queue
import random
import re
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent


# -----------------------------------------------------------------------------------------------
# 0. Errors. User mistakes are PocketError subclasses with one clear line; anything else is a bug.
# -----------------------------------------------------------------------------------------------

class PocketError(Exception):
    """A user-facing error: the message is one line that names the file, flag, tensor or field."""


class CheckpointError(PocketError):
    """The checkpoint directory is missing something or holds something we cannot load."""


class RequestError(PocketError):
    """A request is invalid. `param` names the offending field; `status` is the HTTP status."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


# ===== SECTION 1: configuration (owner: core) =====

# -----------------------------------------------------------------------------------------------
# 1. Configuration: what the checkpoint says about the model, and what the user says about the engine.
# -----------------------------------------------------------------------------------------------

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3")


@dataclass
class QuantConfig:
    """FP8 block quantisation as written by the checkpoint's quantization_config."""
    block: tuple[int, int] = (128, 128)          # (rows, cols) of one scale block
    modules_to_not_convert: tuple[str, ...] = ()  # name fragments that stay in their stored dtype


@dataclass
class ModelConfig:
    """The text model, read from config.json. 27B values in the comments."""
    model_type: str                    # qwen3_5 | qwen3_5_text | qwen3
    vocab_size: int                    # 248320
    hidden_size: int                   # 5120
    intermediate_size: int             # 17408
    num_hidden_layers: int             # 64
    num_attention_heads: int           # 24
    num_key_value_heads: int           # 4
    head_dim: int                      # 256
    rms_norm_eps: float                # 1e-6
    tie_word_embeddings: bool          # false
    layer_types: list[str]             # "linear_attention" x3, then "full_attention", repeated
    rope_theta: float                  # 1e7
    rotary_dim: int                    # head_dim * partial_rotary_factor = 64
    max_position_embeddings: int       # 262144
    gated_attention: bool              # qwen3_5: q_proj rows are [q | gate] per head
    zero_centred_norm: bool            # qwen3_5: x * (1 + w); qwen3: x * w
    linear_num_key_heads: int = 0      # 16
    linear_num_value_heads: int = 0    # 48
    linear_key_head_dim: int = 0       # 128
    linear_value_head_dim: int = 0     # 128
    linear_conv_kernel_dim: int = 0    # 4
    weight_prefix: str = "model."      # "model.language_model." for the nested qwen3_5 layout
    quant: QuantConfig | None = None   # None: every tensor is stored unquantised

    @property
    def linear_conv_dim(self) -> int:  # channels of the GDN causal conv: q, k and v concatenated
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def num_full_layers(self) -> int:
        return sum(t == "full_attention" for t in self.layer_types)

    @property
    def num_linear_layers(self) -> int:
        return sum(t == "linear_attention" for t in self.layer_types)


def _config_field(cfg: dict, key: str, path: Path, default: Any = ...):
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is ...:
        raise CheckpointError(f"{path}: missing required field '{key}'")
    return default


def parse_model_config(raw: dict, path: Path) -> ModelConfig:
    """Translate an HF config.json (nested qwen3_5, flat qwen3_5_text, or qwen3) into a ModelConfig."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{path}: unsupported model_type {model_type!r} "
                              f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    text = raw.get("text_config") if model_type == "qwen3_5" else raw
    if not isinstance(text, dict):
        raise CheckpointError(f"{path}: model_type qwen3_5 needs a 'text_config' object")
    get = lambda k, d=...: _config_field(text, k, path, d)  # noqa: E731
    n_layers = int(get("num_hidden_layers"))
    hybrid = model_type != "qwen3"
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4)) if hybrid else 1
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if len(layer_types) != n_layers or set(layer_types) - {"full_attention", "linear_attention"}:
        raise CheckpointError(f"{path}: layer_types must list {n_layers} entries of "
                              f"'full_attention'/'linear_attention'")
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise CheckpointError(f"{path}: unsupported rope_type {rope_type!r} (supported: default)")
    head_dim = int(text.get("head_dim") or get("hidden_size") // get("num_attention_heads"))
    partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25 if hybrid else 1.0)))
    if text.get("attention_bias"):
        raise CheckpointError(f"{path}: attention_bias=true is not supported")
    quant = parse_quant_config(raw.get("quantization_config") or text.get("quantization_config"), path)
    tie = bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    return ModelConfig(
        model_type=model_type, vocab_size=int(get("vocab_size")), hidden_size=int(get("hidden_size")),
        intermediate_size=int(get("intermediate_size")), num_hidden_layers=n_layers,
        num_attention_heads=int(get("num_attention_heads")), num_key_value_heads=int(get("num_key_value_heads")),
        head_dim=head_dim, rms_norm_eps=float(get("rms_norm_eps", 1e-6)), tie_word_embeddings=tie,
        layer_types=list(layer_types), rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
        rotary_dim=int(head_dim * partial), max_position_embeddings=int(get("max_position_embeddings", 32768)),
        gated_attention=hybrid, zero_centred_norm=hybrid,
        linear_num_key_heads=int(get("linear_num_key_heads", 0)) if hybrid else 0,
        linear_num_value_heads=int(get("linear_num_value_heads", 0)) if hybrid else 0,
        linear_key_head_dim=int(get("linear_key_head_dim", 0)) if hybrid else 0,
        linear_value_head_dim=int(get("linear_value_head_dim", 0)) if hybrid else 0,
        linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)) if hybrid else 0,
        weight_prefix="model.language_model." if model_type == "qwen3_5" else "model.", quant=quant)


def parse_quant_config(q: dict | None, path: Path) -> QuantConfig | None:
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"{path}: unsupported quantization quant_method={method!r} (supported: fp8)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise CheckpointError(f"{path}: unsupported fp8 fmt {fmt!r} (supported: e4m3)")
    block = q.get("weight_block_size")
    if not block or len(block) != 2:
        raise CheckpointError(f"{path}: fp8 quantization needs weight_block_size [rows, cols] "
                              f"(per-tensor fp8 is not supported)")
    return QuantConfig(block=(int(block[0]), int(block[1])),
                       modules_to_not_convert=tuple(q.get("modules_to_not_convert") or ()))


@dataclass
class EngineOptions:
    """How the engine runs. Every field is also a CLI flag (--max-batch-size, ...) and an LLM(...) keyword."""
    backend: str = "auto"              # auto | torch | native
    device: str = "cpu"                # torch device of rank 0 ("cpu", "cuda", "cuda:1")
    devices: str | None = None         # tensor parallelism: "0,1,2,3" or "cpu,cpu" (one rank each)
    dtype: str = "auto"                # activation dtype: auto (fp16 on GPU, fp32 on CPU) | float32 | bfloat16 | float16
    kv_dtype: str = "auto"             # KV-cache dtype: auto (= activation dtype) | float32 | bfloat16 | float16
    max_context: int = 4096            # longest prompt + completion of one sequence, in tokens
    max_batch_size: int = 16           # running sequences at once (= recurrent-state slots)
    kv_block_size: int = 16            # tokens per KV-cache block
    num_kv_blocks: int = 0             # 0: enough for max_batch_size sequences of max_context
    prefill_token_budget: int = 512    # tokens per engine step (prefill chunks + decodes)
    smoke_layers: int = 0              # >0: run only the first N decoder layers (smoke tests of huge checkpoints)
    seed: int = 0                      # default seed for unseeded requests' generators
    quiet: bool = False                # no startup log lines


@dataclass
class SamplingParams:
    """One request's sampling options. Ranges are checked by validate(); see docs/api.md."""
    max_tokens: int = 16               # completion tokens at most
    temperature: float = 1.0           # 0 = greedy
    top_p: float = 1.0                 # nucleus mass kept, (0, 1]
    top_k: int = 0                     # keep the k most likely; 0 or -1 = off
    min_p: float = 0.0                 # drop tokens below min_p * p(most likely)
    seed: int | None = None            # a seeded request samples the same tokens whatever else runs
    presence_penalty: float = 0.0      # OpenAI: subtract once per token already generated
    frequency_penalty: float = 0.0     # OpenAI: subtract per occurrence in the generated tokens
    repetition_penalty: float = 1.0    # CTRL/HF: divide positive (multiply negative) logits of seen tokens
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0                # EOS and stop tokens are masked until this many tokens exist
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None        # None = off; k = the sampled token's logprob plus k alternatives
    n: int = 1                         # choices; the prompt is prefilled once and forked
    logits_processors: list = field(default_factory=list)  # f(choice_ids, logits (V,) fp32) -> logits

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        def need(ok: bool, param: str, what: str):
            if not ok:
                raise RequestError(f"'{param}' {what}", param=param)
        need(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        need(0.0 <= self.temperature <= 2.0, "temperature", "must be in [0, 2]")
        need(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        need(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "must be -1, 0 (off) or a positive integer")
        need(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        need(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        need(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        need(0.0 < self.repetition_penalty <= 10.0, "repetition_penalty", "must be in (0, 10]")
        need(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             "must be an integer in [0, max_tokens]")
        need(self.logprobs is None or isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20, "logprobs",
             "must be an integer in [0, 20]")
        need(isinstance(self.n, int) and 1 <= self.n <= 16, "n", "must be an integer in [1, 16]")
        need(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        need(all(isinstance(s, str) and s for s in self.stop) and len(self.stop) <= 16, "stop",
             "must be at most 16 non-empty strings")
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", list(self.logit_bias))):
            need(all(isinstance(i, int) and 0 <= i < (vocab_size or 1 << 62) for i in ids), name,
                 f"must hold token ids in [0, {vocab_size})")
        need(all(-100.0 <= b <= 100.0 for b in self.logit_bias.values()), "logit_bias", "values must be in [-100, 100]")
        return self



# ===== SECTION 2: checkpoint loading (owner: core) =====

# -----------------------------------------------------------------------------------------------
# 2. Checkpoint loading: lazily opened safetensors, HF names kept as they are, FP8 kept as FP8.
# -----------------------------------------------------------------------------------------------

Ranges = list[tuple[int, int]]  # [(start, stop), ...] concatenated along one dimension (TP shards)


@dataclass
class Linear:
    """A linear layer's weight as stored: FP8 with block scales, or dense. y = x @ W^T."""
    weight: torch.Tensor               # (N, K) float8_e4m3fn, or dense bf16/fp16/fp32
    scale: torch.Tensor | None = None  # (ceil(N/128), ceil(K/128)) fp32 multipliers, None when dense
    block: tuple[int, int] = (128, 128)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def to(self, device, dtype: torch.dtype | None = None) -> "Linear":
        """Move to a device; a dense weight also takes the activation dtype (FP8 stays FP8)."""
        if self.scale is None:
            return Linear(self.weight.to(device, dtype or self.weight.dtype))
        return Linear(self.weight.to(device), self.scale.to(device), self.block)


class Checkpoint:
    """A checkpoint directory. Tensors are read on demand, and only the requested slices of them."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: checkpoint directory not found")
        cfg_path = self.path / "config.json"
        self.raw_config = _read_json(cfg_path, required=True)
        self.config = parse_model_config(self.raw_config, cfg_path)
        self.generation_config = _read_json(self.path / "generation_config.json", required=False) or {}
        self._files: dict[str, Any] = {}           # file name -> open safe_open handle
        self.weight_map = self._find_tensors()      # tensor name -> file name

    def _find_tensors(self) -> dict[str, str]:
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = _read_json(index, required=True).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: missing 'weight_map'")
            for fname in sorted(set(weight_map.values())):
                if not (self.path / fname).exists():
                    raise CheckpointError(f"{self.path / fname}: shard listed in {index.name} is missing")
            return dict(weight_map)
        files = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no *.safetensors files")
        return {name: fname for fname in files for name in self._open(fname).keys()}

    def _open(self, fname: str):
        if fname not in self._files:
            from safetensors import safe_open
            try:
                self._files[fname] = safe_open(str(self.path / fname), framework="pt")
            except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
                raise CheckpointError(f"{self.path / fname}: cannot read safetensors file ({e})") from None
        return self._files[fname]

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def _slice(self, name: str):
        if name not in self.weight_map:
            raise CheckpointError(f"{self.path}: missing tensor '{name}'")
        return self._open(self.weight_map[name]).get_slice(name)

    def shape(self, name: str) -> list[int]:
        return list(self._slice(name).get_shape())

    def read(self, name: str, rows: Ranges | None = None, cols: Ranges | None = None) -> torch.Tensor:
        """Read a tensor, or only the given row/column ranges of it (concatenated), from disk."""
        sl = self._slice(name)
        shape = sl.get_shape()
        rows = rows or [(0, shape[0])]
        try:
            if len(shape) == 1 or cols is None:
                parts = [sl[a:b] for a, b in rows]
            else:
                parts = [sl[a:b, c:d] for a, b in rows for c, d in cols]
                parts = [torch.cat(parts[i * len(cols):(i + 1) * len(cols)], dim=1) for i in range(len(rows))]
        except Exception as e:
            raise CheckpointError(f"{self.path}: cannot read tensor '{name}' ({e})") from None
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)

    def close(self):
        self._files.clear()


def _read_json(path: Path, required: bool) -> dict | None:
    if not path.exists():
        if required:
            raise CheckpointError(f"{path}: file not found")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _merge_ranges(ranges: Ranges | None, full: int) -> Ranges | None:
    """Join adjacent ranges; None when they cover the whole dimension (tensor parallelism of degree 1)."""
    out: Ranges = []
    for a, b in ranges or []:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return None if not out or out == [(0, full)] else out


def _scale_ranges(ranges: Ranges, block: int, full: int, name: str, what: str) -> Ranges:
    """Map element ranges of a quantised weight onto the rows/cols of its block-scale tensor."""
    out = []
    for a, b in ranges:
        if a % block or (b % block and b != full):
            raise CheckpointError(f"tensor '{name}': {what} slice [{a}, {b}) does not fall on {block}-element "
                                  f"block boundaries (tensor parallelism needs whole FP8 blocks)")
        out.append((a // block, -(-b // block)))
    return out


def load_linear(ckpt: Checkpoint, prefix: str, shape: tuple[int, int], rows: Ranges | None = None,
                cols: Ranges | None = None) -> Linear:
    """Load `prefix.weight` (+ `prefix.weight_scale_inv` when FP8), checking the full shape, reading only
    the requested row/column ranges. FP8 stays FP8; dense weights stay in their stored dtype."""
    name = prefix + ".weight"
    full = tuple(ckpt.shape(name))
    if full != tuple(shape):
        raise CheckpointError(f"tensor '{name}' has shape {list(full)}, expected {list(shape)}")
    rows, cols = _merge_ranges(rows, shape[0]), _merge_ranges(cols, shape[1])
    weight = ckpt.read(name, rows, cols)
    if weight.dtype != torch.float8_e4m3fn:
        if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise CheckpointError(f"tensor '{name}' has unsupported dtype {weight.dtype}")
        return Linear(weight)
    quant = ckpt.config.quant
    if quant is None:
        raise CheckpointError(f"tensor '{name}' is float8_e4m3fn but config.json has no fp8 quantization_config")
    sname = prefix + ".weight_scale_inv"
    bn, bk = quant.block
    want = [-(-shape[0] // bn), -(-shape[1] // bk)]
    if not ckpt.has(sname):
        raise CheckpointError(f"{ckpt.path}: missing tensor '{sname}' (FP8 weight '{name}' needs its block scales)")
    if ckpt.shape(sname) != want:
        raise CheckpointError(f"tensor '{sname}' has shape {ckpt.shape(sname)}, expected {want} "
                              f"(one scale per {bn}x{bk} block of {list(shape)})")
    srows = _scale_ranges(rows, bn, shape[0], name, "row") if rows else None
    scols = _scale_ranges(cols, bk, shape[1], name, "column") if cols else None
    scale = ckpt.read(sname, srows, scols).to(torch.float32)
    return Linear(weight, scale.contiguous(), quant.block)


def load_dense(ckpt: Checkpoint, name: str, shape: tuple[int, ...], rows: Ranges | None = None,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Load an unquantised tensor (norms, conv1d, A_log, ...), checking its full shape."""
    full = tuple(ckpt.shape(name))
    if full != tuple(shape):
        raise CheckpointError(f"tensor '{name}' has shape {list(full)}, expected {list(shape)}")
    t = ckpt.read(name, _merge_ranges(rows, shape[0]))
    if t.dtype == torch.float8_e4m3fn:
        raise CheckpointError(f"tensor '{name}' is float8 but this tensor is never quantised")
    return t.to(dtype) if dtype is not None else t



# ===== SECTION 3: torch backend ops (owner: core) =====

# -----------------------------------------------------------------------------------------------
# 3. Backends. The model calls a short list of ops; TorchOps is the reference that runs anywhere.
#    The native backend (3b) implements the same methods with the CUDA library. docs/abi.md lists them.
# -----------------------------------------------------------------------------------------------

def dequantize(w: Linear, dtype: torch.dtype) -> torch.Tensor:
    """FP8 weight * its 128x128 block scale -> dense (N, K), for one layer at a time. Ragged edges padded."""
    if w.scale is None:
        return w.weight.to(dtype)
    (n, k), (bn, bk) = w.weight.shape, w.block
    sn, sk = w.scale.shape
    x = w.weight.to(torch.float32)
    if n % bn or k % bk:
        x = F.pad(x, (0, sk * bk - k, 0, sn * bn - n))
    x = (x.view(sn, bn, sk, bk) * w.scale.view(sn, 1, sk, 1)).view(sn * bn, sk * bk)
    return x[:n, :k].to(dtype)


class TorchOps:
    """The reference ops in plain torch. Shapes: T tokens of a flattened batch, B sequences."""
    name = "torch"

    def embed(self, ids, table, dtype):
        return table[ids].to(dtype)                                      # (T, D)

    def rmsnorm(self, x, w, eps):
        xf = x.float()                                                   # zero-centred: weights are stored as (w)
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)).to(x.dtype)

    def add_rmsnorm(self, x, residual, w, eps):
        residual = residual + x.float()                                  # the residual stream stays fp32
        return self.rmsnorm(residual, w, eps).to(x.dtype), residual

    def linear(self, x, w: Linear):
        return x @ dequantize(w, x.dtype).t()                            # (T, N)

    def silu_mul(self, g, u):
        return (F.silu(g.float()) * u.float()).to(g.dtype)

    def sigmoid_mul(self, x, gate):
        return (x.float() * torch.sigmoid(gate.float())).to(x.dtype)

    def qk_norm_rope(self, q, k, q_w, k_w, eps, positions, inv_freq):
        q, k = self.rmsnorm(q, q_w, eps), self.rmsnorm(k, k_w, eps)      # (T, Hq, Dh), (T, Hk, Dh)
        angles = positions.float()[:, None] * inv_freq[None, :]          # (T, R/2)
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        return _rope(q, cos, sin), _rope(k, cos, sin)

    def kv_write(self, k, v, k_cache, v_cache, slot_mapping):
        nb, bs = k_cache.shape[:2]
        k_cache.view(nb * bs, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
        v_cache.view(nb * bs, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)

    def attention(self, q, k_cache, v_cache, block_tables, context_lens, query_start, scale):
        out = torch.empty_like(q)                                        # (T, Hq, Dh)
        bs, hk = k_cache.shape[1], k_cache.shape[2]
        for b in range(len(context_lens)):
            q0, q1, n = int(query_start[b]), int(query_start[b + 1]), int(context_lens[b])
            blocks = block_tables[b, : -(-n // bs)].long()
            k = k_cache[blocks].flatten(0, 1)[:n].float()                # (n, Hk, Dh)
            v = v_cache[blocks].flatten(0, 1)[:n].float()
            qb = q[q0:q1].float()                                        # (m, Hq, Dh)
            rep = qb.shape[1] // hk
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            s = torch.einsum("mhd,nhd->hmn", qb, k) * scale              # (Hq, m, n)
            m = q1 - q0                                                  # row i sees positions <= n - m + i
            mask = torch.arange(n)[None, :] > (n - m + torch.arange(m))[:, None]
            s.masked_fill_(mask[None].to(s.device), float("-inf"))
            out[q0:q1] = torch.einsum("hmn,nhd->mhd", s.softmax(-1), v).to(q.dtype)
        return out

    def conv1d(self, x, w, conv_state, slot_ids, query_start):
        width = w.shape[1]
        if x.shape[0] == slot_ids.numel():                               # decode: one token per sequence
            slots = slot_ids.long()
            xs = torch.cat([conv_state[slots].to(x.dtype), x[:, :, None]], -1).float()   # (B, C, W)
            conv_state[slots] = xs[:, :, 1:].to(conv_state.dtype)
            return F.silu((xs * w.float()).sum(-1)).to(x.dtype)
        out = torch.empty_like(x)                                        # (T, C)
        for b in range(len(slot_ids)):
            q0, q1, s = int(query_start[b]), int(query_start[b + 1]), int(slot_ids[b])
            xs = torch.cat([conv_state[s].t().to(x.dtype), x[q0:q1]], 0).float()   # (W-1 + m, C)
            y = F.conv1d(xs.t()[None], w.float()[:, None, :], groups=w.shape[0])[0].t()  # (m, C)
            out[q0:q1] = F.silu(y).to(x.dtype)
            conv_state[s] = xs[-(width - 1):].t().to(conv_state.dtype)
        return out

    def gdn_gates(self, a, b, A_log, dt_bias):
        g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())  # (T, Hv) fp32
        return g, torch.sigmoid(b.float())

    def gated_delta(self, q, k, v, g, beta, state, slot_ids, query_start):
        rep = v.shape[1] // k.shape[1]                                   # value head h reads key head h // rep
        q = _l2norm(q.float()).repeat_interleave(rep, 1) * q.shape[-1] ** -0.5   # (T, Hv, Dk)
        k = _l2norm(k.float()).repeat_interleave(rep, 1)
        vf = v.float()
        lens = (query_start[1:] - query_start[:-1]).tolist()
        if all(n == 1 for n in lens):                                    # decode: one vectorised step
            slots = slot_ids.long()
            o, state[slots] = decode_delta_step(q, k, vf, g, beta, state[slots])
            return o.to(v.dtype)
        out = torch.empty_like(vf)
        for b, s in enumerate(slot_ids.tolist()):
            q0, q1 = int(query_start[b]), int(query_start[b + 1])
            out[q0:q1], state[s] = prefill_delta_chunked(q[q0:q1], k[q0:q1], vf[q0:q1], g[q0:q1], beta[q0:q1], state[s])
        return out.to(v.dtype)

    def gated_rmsnorm(self, x, z, w, eps):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (w.float() * y * F.silu(z.float())).to(x.dtype)


def _rope(x, cos, sin):
    """Rotate-half RoPE on the first 2 * cos.shape[-1] dims of each head; the rest pass through."""
    r = cos.shape[-1]
    x1, x2, rest = x[..., :r].float(), x[..., r:2 * r].float(), x[..., 2 * r:]
    return torch.cat([(x1 * cos - x2 * sin).to(x.dtype), (x2 * cos + x1 * sin).to(x.dtype), rest], -1)


def _l2norm(x, eps: float = 1e-6):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def decode_delta_step(q, k, v, g, beta, S):
    """One token of the gated delta rule for B sequences. q, k (B, H, Dk); v (B, H, Dv); S (B, H, Dk, Dv)."""
    S = S * g.exp()[..., None, None]
    delta = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", S, k))     # (B, H, Dv)
    S = S + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhkv,bhk->bhv", S, q), S


def prefill_delta_chunked(q, k, v, g, beta, S, chunk: int = 64):
    """The gated delta rule over m tokens of one sequence in chunks (the WY/UT form).
    q, k (m, H, Dk) normalised; v (m, H, Dv); g, beta (m, H); S (H, Dk, Dv) fp32 initial state.
    Within a chunk with cumulative log-decay c: the corrections u = (I + L)^-1 (beta v - beta k_decayed S),
    where L is the strictly lower part of (beta k k^T) * exp(c_i - c_j); outputs read S and the chunk's u."""
    m = q.shape[0]
    out = torch.empty_like(v)
    for c0 in range(0, m, chunk):
        qc, kc, vc = (t[c0:c0 + chunk].transpose(0, 1) for t in (q, k, v))  # (H, C, D)
        gc, bc = g[c0:c0 + chunk].t(), beta[c0:c0 + chunk].t()              # (H, C)
        cum = gc.cumsum(-1)                                                 # (H, C)
        n = cum.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # (H, C, C)
        kb = kc * bc[..., None]
        lower = (kb @ kc.transpose(-1, -2) * decay).tril(-1)
        eye = torch.eye(n, device=q.device).expand_as(lower)
        rhs = torch.cat([vc * bc[..., None], kb * cum.exp()[..., None]], -1)  # (H, C, Dv + Dk)
        sol = torch.linalg.solve_triangular(eye + lower, rhs, upper=False, unitriangular=True)
        u = sol[..., :vc.shape[-1]] - sol[..., vc.shape[-1]:] @ S          # (H, C, Dv): delta-rule corrections
        attn = (qc @ kc.transpose(-1, -2)) * decay                         # (H, C, C) causal, incl. diagonal
        out[c0:c0 + chunk] = ((qc * cum.exp()[..., None]) @ S + attn @ u).transpose(0, 1)
        last = cum[:, -1:]                                                 # (H, 1)
        S = S * last.exp()[..., None] + (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ u
    return out, S



# ===== SECTION 3b: native backend ops (owner: native) =====


# ===== SECTION 4: the model (owner: core) =====

# -----------------------------------------------------------------------------------------------
# 4. The model: weights per layer, and a forward pass over an explicit Batch of varlen sequences.
# -----------------------------------------------------------------------------------------------

@dataclass
class Batch:
    """One engine step's input: B sequences' new tokens concatenated (T tokens in all)."""
    token_ids: torch.Tensor       # (T,) int64
    positions: torch.Tensor       # (T,) int64, position of each token in its sequence
    query_start: torch.Tensor     # (B+1,) int32, sequence b owns rows query_start[b]:query_start[b+1]
    context_lens: torch.Tensor    # (B,) int32, tokens in the KV cache after this step (prefix + new)
    block_tables: torch.Tensor    # (B, max_blocks) int32, KV blocks of each sequence
    slot_mapping: torch.Tensor    # (T,) int64, KV-cache slot (block * block_size + offset) of each token
    state_slots: torch.Tensor     # (B,) int32, recurrent-state slot of each sequence
    logit_rows: torch.Tensor      # (R,) int64, rows whose logits are wanted (usually each sequence's last)
    fresh_slots: torch.Tensor     # (F,) int64, state slots of sequences starting at position 0: zeroed first

    @property
    def is_decode(self) -> bool:
        return self.token_ids.numel() == self.state_slots.numel()


@dataclass
class Cache:
    """Per-layer KV cache (full attention) and recurrent state (linear attention), indexed by layer."""
    k: dict[int, torch.Tensor]     # layer -> (num_blocks, block_size, Hk, Dh)
    v: dict[int, torch.Tensor]
    conv: dict[int, torch.Tensor]  # layer -> (slots, conv_dim, W-1)
    ssm: dict[int, torch.Tensor]   # layer -> (slots, Hv, Dk, Dv) fp32


@dataclass
class Shard:
    """Which part of the model this rank holds (tensor parallelism, Megatron style); rank 0 of 1 = all."""
    rank: int = 0
    world: int = 1

    def split(self, n: int, what: str) -> tuple[int, int]:
        """This rank's [start, stop) of n units (heads, rows); refuses an uneven split."""
        if n % self.world:
            raise CheckpointError(f"{what}: {n} does not divide by the tensor-parallel degree {self.world}")
        per = n // self.world
        return self.rank * per, (self.rank + 1) * per


class Layer:
    """One decoder layer's weights: a mixer (gated attention or gated DeltaNet) and a SwiGLU MLP."""


def load_layer(ckpt: Checkpoint, cfg: ModelConfig, i: int, shard: Shard) -> Layer:
    """Read layer i's tensors (this rank's shard of them). Colwise = split output rows; rowwise = split inputs."""
    p, L, D = f"{cfg.weight_prefix}layers.{i}.", Layer(), cfg.hidden_size
    norm = lambda name: load_norm(ckpt, cfg, name, (D,))  # noqa: E731
    L.kind, L.index = cfg.layer_types[i], i
    L.input_norm, L.post_norm = norm(p + "input_layernorm.weight"), norm(p + "post_attention_layernorm.weight")
    I = cfg.intermediate_size
    i0, i1 = shard.split(I, f"tensor '{p}mlp.gate_proj.weight' rows")
    L.gate = load_linear(ckpt, p + "mlp.gate_proj", (I, D), rows=[(i0, i1)])
    L.up = load_linear(ckpt, p + "mlp.up_proj", (I, D), rows=[(i0, i1)])
    L.down = load_linear(ckpt, p + "mlp.down_proj", (D, I), cols=[(i0, i1)])
    if L.kind == "full_attention":
        load_attention(ckpt, cfg, p + "self_attn.", L, shard)
    else:
        load_gdn(ckpt, cfg, p + "linear_attn.", L, shard)
    return L


def load_norm(ckpt: Checkpoint, cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Norm weights as fp32 in the zero-centred form the ops use: y = norm(x) * (1 + w)."""
    w = load_dense(ckpt, name, shape, dtype=torch.float32)
    return w if cfg.zero_centred_norm else w - 1.0   # Qwen3's plain x * w, rewritten as x * (1 + (w - 1))


def load_attention(ckpt: Checkpoint, cfg: ModelConfig, p: str, L: Layer, shard: Shard):
    Hq, Hk, Dh, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    q0, q1 = shard.split(Hq, f"tensor '{p}q_proj.weight' heads")
    k0, k1 = shard.split(Hk, f"tensor '{p}k_proj.weight' kv heads")
    qw = 2 * Dh if cfg.gated_attention else Dh                          # rows per q head: [q | gate]
    L.q_proj = load_linear(ckpt, p + "q_proj", (Hq * qw, D), rows=[(q0 * qw, q1 * qw)])
    L.k_proj = load_linear(ckpt, p + "k_proj", (Hk * Dh, D), rows=[(k0 * Dh, k1 * Dh)])
    L.v_proj = load_linear(ckpt, p + "v_proj", (Hk * Dh, D), rows=[(k0 * Dh, k1 * Dh)])
    L.o_proj = load_linear(ckpt, p + "o_proj", (D, Hq * Dh), cols=[(q0 * Dh, q1 * Dh)])
    L.q_norm = load_norm(ckpt, cfg, p + "q_norm.weight", (Dh,))
    L.k_norm = load_norm(ckpt, cfg, p + "k_norm.weight", (Dh,))
    L.heads, L.kv_heads = q1 - q0, k1 - k0


def load_gdn(ckpt: Checkpoint, cfg: ModelConfig, p: str, L: Layer, shard: Shard):
    Hk, Hv, Dk, Dv, D = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                         cfg.linear_value_head_dim, cfg.hidden_size)
    k0, k1 = shard.split(Hk, f"tensor '{p}in_proj_qkv.weight' key heads")
    v0, v1 = shard.split(Hv, f"tensor '{p}in_proj_z.weight' value heads")
    # The qkv rows are [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]: a rank takes its heads from each of the three parts.
    qkv_rows = [(k0 * Dk, k1 * Dk), (Hk * Dk + k0 * Dk, Hk * Dk + k1 * Dk), (2 * Hk * Dk + v0 * Dv, 2 * Hk * Dk + v1 * Dv)]
    C = cfg.linear_conv_dim
    L.in_proj_qkv = load_linear(ckpt, p + "in_proj_qkv", (C, D), rows=qkv_rows)
    L.in_proj_z = load_linear(ckpt, p + "in_proj_z", (Hv * Dv, D), rows=[(v0 * Dv, v1 * Dv)])
    L.in_proj_a = load_linear(ckpt, p + "in_proj_a", (Hv, D), rows=[(v0, v1)])
    L.in_proj_b = load_linear(ckpt, p + "in_proj_b", (Hv, D), rows=[(v0, v1)])
    L.out_proj = load_linear(ckpt, p + "out_proj", (D, Hv * Dv), cols=[(v0 * Dv, v1 * Dv)])
    W = cfg.linear_conv_kernel_dim
    L.conv_w = load_dense(ckpt, p + "conv1d.weight", (C, 1, W), rows=qkv_rows, dtype=torch.float32)[:, 0]  # (C', W)
    L.A_log = load_dense(ckpt, p + "A_log", (Hv,), rows=[(v0, v1)], dtype=torch.float32)
    L.dt_bias = load_dense(ckpt, p + "dt_bias", (Hv,), rows=[(v0, v1)], dtype=torch.float32)
    L.gdn_norm = load_dense(ckpt, p + "norm.weight", (Dv,), dtype=torch.float32)
    L.k_heads, L.v_heads = k1 - k0, v1 - v0


class Model:
    """The decoder: embedding, layers, final norm, lm_head. forward(batch) -> logits of batch.logit_rows.
    With tensor parallelism each rank holds a shard and `all_reduce` sums the row-parallel outputs."""

    def __init__(self, ckpt: Checkpoint, ops, dtype: torch.dtype, device: torch.device, shard: Shard = Shard(),
                 num_layers: int | None = None, all_reduce: Callable | None = None, progress: bool = True):
        cfg = self.cfg = ckpt.config
        self.ops, self.dtype, self.device, self.shard = ops, dtype, device, shard
        self.all_reduce = all_reduce or (lambda x: x)
        n = num_layers or cfg.num_hidden_layers
        V, D, p = cfg.vocab_size, cfg.hidden_size, cfg.weight_prefix
        self.embed_tokens = load_dense(ckpt, p + "embed_tokens.weight", (V, D)).to(device)   # (V, D) stored dtype
        head = p + "embed_tokens" if cfg.tie_word_embeddings else "lm_head"
        self.lm_head = load_linear(ckpt, head, (V, D)).to(device, dtype)   # replicated: sampling sees full logits
        self.norm = load_norm(ckpt, cfg, p + "norm.weight", (D,)).to(device)
        self.layers = []
        t0 = time.time()
        for i in range(n):
            self.layers.append(_to_device(load_layer(ckpt, cfg, i, shard), device, dtype))
            if progress and time.time() - t0 > 2.0:
                print(f"\rpocketllm: loading layer {i + 1}/{n}", end="" if i + 1 < n else "\n", file=sys.stderr, flush=True)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.float64) / cfg.rotary_dim))
        self.inv_freq = inv.float().to(device)                             # (R/2,)

    # The forward pass, one named path per mixer; prefill and decode differ only inside the ops.

    def forward(self, batch: Batch, cache: Cache) -> torch.Tensor:
        ops, eps = self.ops, self.cfg.rms_norm_eps
        if batch.fresh_slots.numel():                                      # a slot's previous owner's state
            for t in itertools.chain(cache.conv.values(), cache.ssm.values()):
                t[batch.fresh_slots] = 0
        x = ops.embed(batch.token_ids, self.embed_tokens, self.dtype)      # (T, D)
        residual = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for L in self.layers:
            h, residual = ops.add_rmsnorm(x, residual, L.input_norm, eps)
            mixer = self.attention if L.kind == "full_attention" else self.gated_deltanet
            x = self.all_reduce(mixer(L, h, batch, cache))
            h, residual = ops.add_rmsnorm(x, residual, L.post_norm, eps)
            x = self.all_reduce(self.mlp(L, h))
        h, _ = ops.add_rmsnorm(x, residual, self.norm, eps)
        return ops.linear(h[batch.logit_rows], self.lm_head).float()       # (R, V)

    def mlp(self, L: Layer, x):
        ops = self.ops
        return ops.linear(ops.silu_mul(ops.linear(x, L.gate), ops.linear(x, L.up)), L.down)

    def attention(self, L: Layer, x, batch: Batch, cache: Cache):
        ops, cfg, T = self.ops, self.cfg, x.shape[0]
        Dh = cfg.head_dim
        qg = ops.linear(x, L.q_proj)
        if cfg.gated_attention:                                            # per head: [q | gate]
            qg = qg.view(T, L.heads, 2, Dh)
            q, gate = qg[:, :, 0].contiguous(), qg[:, :, 1].reshape(T, L.heads * Dh)
        else:
            q, gate = qg.view(T, L.heads, Dh), None
        k = ops.linear(x, L.k_proj).view(T, L.kv_heads, Dh)
        v = ops.linear(x, L.v_proj).view(T, L.kv_heads, Dh)
        q, k = ops.qk_norm_rope(q, k, L.q_norm, L.k_norm, cfg.rms_norm_eps, batch.positions, self.inv_freq)
        ops.kv_write(k, v, cache.k[L.index], cache.v[L.index], batch.slot_mapping)
        o = ops.attention(q, cache.k[L.index], cache.v[L.index], batch.block_tables, batch.context_lens,
                          batch.query_start, Dh ** -0.5).reshape(T, L.heads * Dh)
        if gate is not None:
            o = ops.sigmoid_mul(o, gate)
        return ops.linear(o, L.o_proj)

    def gated_deltanet(self, L: Layer, x, batch: Batch, cache: Cache):
        ops, cfg, T = self.ops, self.cfg, x.shape[0]
        Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        qkv = ops.conv1d(ops.linear(x, L.in_proj_qkv), L.conv_w, cache.conv[L.index], batch.state_slots,
                         batch.query_start)                               # (T, C')
        nk, nv = L.k_heads * Dk, L.v_heads * Dv
        q = qkv[:, :nk].reshape(T, L.k_heads, Dk)
        k = qkv[:, nk:2 * nk].reshape(T, L.k_heads, Dk)
        v = qkv[:, 2 * nk:].reshape(T, L.v_heads, Dv)
        g, beta = ops.gdn_gates(ops.linear(x, L.in_proj_a), ops.linear(x, L.in_proj_b), L.A_log, L.dt_bias)
        o = ops.gated_delta(q, k, v, g, beta, cache.ssm[L.index], batch.state_slots, batch.query_start)
        z = ops.linear(x, L.in_proj_z).view(T, L.v_heads, Dv)
        o = ops.gated_rmsnorm(o, z, L.gdn_norm, cfg.rms_norm_eps).reshape(T, nv)
        return ops.linear(o, L.out_proj)


def _to_device(L: Layer, device, dtype: torch.dtype) -> Layer:
    for k, v in vars(L).items():
        if isinstance(v, Linear):
            setattr(L, k, v.to(device, dtype))
        elif isinstance(v, torch.Tensor):
            setattr(L, k, v.to(device))
    return L



# ===== SECTION 5-9: memory, scheduler, sampler, runner, engine (owner: core) =====

# -----------------------------------------------------------------------------------------------
# 5. Memory: a pool of paged KV blocks (reference counted, so forked choices share their prompt) and a
#    pool of recurrent-state slots. Pure bookkeeping; the tensors live in Cache.
# -----------------------------------------------------------------------------------------------

class BlockPool:
    """KV-cache blocks. A block returns to the free list when its last owner releases it."""

    def __init__(self, num_blocks: int):
        self.total = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))
        self.refs = [0] * num_blocks

    def alloc(self) -> int | None:
        if not self.free:
            return None
        b = self.free.pop()
        self.refs[b] = 1
        return b

    def share(self, b: int) -> int:
        self.refs[b] += 1
        return b

    def release(self, blocks: list[int]):
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)
        blocks.clear()

    @property
    def used(self) -> int:
        return self.total - len(self.free)


class SlotPool:
    """Recurrent-state slots (conv + SSM state of every linear-attention layer), one per running sequence."""

    def __init__(self, num_slots: int):
        self.total = num_slots
        self.free = list(range(num_slots - 1, -1, -1))

    def alloc(self) -> int | None:
        return self.free.pop() if self.free else None

    def release(self, slot: int):
        self.free.append(slot)

    @property
    def used(self) -> int:
        return self.total - len(self.free)


def allocate_cache(cfg: ModelConfig, layers: list, num_blocks: int, block_size: int, num_slots: int,
                   kv_dtype: torch.dtype, device) -> Cache:
    """KV tensors for full-attention layers and state tensors for linear-attention layers (this rank's heads)."""
    cache = Cache({}, {}, {}, {})
    for L in layers:
        if L.kind == "full_attention":
            shape = (num_blocks, block_size, L.kv_heads, cfg.head_dim)
            cache.k[L.index] = torch.zeros(shape, dtype=kv_dtype, device=device)
            cache.v[L.index] = torch.zeros(shape, dtype=kv_dtype, device=device)
        else:
            conv_dim = L.conv_w.shape[0]
            cache.conv[L.index] = torch.zeros(num_slots, conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=kv_dtype,
                                              device=device)
            cache.ssm[L.index] = torch.zeros(num_slots, L.v_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                                             dtype=torch.float32, device=device)
    return cache


def copy_state(cache: Cache, src_slot: int, dst_slot: int, src_block: int | None, dst_block: int | None):
    """Fork support: copy one sequence's recurrent state and (optionally) one KV block into another's."""
    for t in itertools.chain(cache.conv.values(), cache.ssm.values()):
        t[dst_slot] = t[src_slot]
    if src_block is not None:
        for t in itertools.chain(cache.k.values(), cache.v.values()):
            t[dst_block] = t[src_block]


# -----------------------------------------------------------------------------------------------
# 6. Scheduler: which sequences run this step, and how many of their tokens. Continuous batching with
#    chunked prefill under a token budget; when blocks run out, the newest sequence is preempted and
#    recomputed later.
# -----------------------------------------------------------------------------------------------

class Sequence:
    """One choice of one request: its tokens, its KV blocks and state slot, and its sampling state."""
    _ids = itertools.count()

    def __init__(self, request: "Request", index: int, output_ids: list[int] | None = None):
        self.request, self.index = request, index
        self.params: SamplingParams = request.params
        self.output_ids: list[int] = list(output_ids or [])
        self.blocks: list[int] = []        # KV blocks holding tokens [0, num_computed)
        self.slot: int | None = None       # recurrent-state slot while running
        self.num_computed = 0              # tokens whose KV/state are in the cache
        self.order = next(Sequence._ids)   # admission order: the newest is preempted first
        self.finished = False
        seed = self.params.seed if self.params.seed is not None else request.default_seed
        self.generator = torch.Generator().manual_seed(hash((seed, index)) & 0x7FFFFFFFFFFFFFFF)

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)


@dataclass
class Scheduled:
    seq: Sequence
    start: int          # first token position computed this step
    count: int          # tokens computed this step
    sample: bool        # the chunk reaches the end of the sequence's tokens: sample the next one


class Scheduler:
    def __init__(self, opts: EngineOptions, blocks: BlockPool, slots: SlotPool):
        self.opts, self.blocks, self.slots = opts, blocks, slots
        self.waiting: list[Sequence] = []   # FIFO; preempted sequences go back to the front
        self.running: list[Sequence] = []

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def schedule(self) -> list[Scheduled]:
        budget, plan = self.opts.prefill_token_budget, []
        for seq in sorted(self.running, key=lambda s: s.order):
            if seq not in self.running:      # preempted below by an older sequence's need
                continue
            count = min(seq.num_tokens - seq.num_computed, max(budget, 1))
            if not self._reserve(seq, count, plan):
                continue
            plan.append(Scheduled(seq, seq.num_computed, count, seq.num_computed + count == seq.num_tokens))
            budget -= count
        while self.waiting and budget > 0 and len(self.running) < self.opts.max_batch_size:
            seq = self.waiting[0]
            count = min(seq.num_tokens - seq.num_computed, budget)
            if not self._blocks_fit(seq, count) or not self.slots.free:
                break
            self.waiting.pop(0)
            seq.slot = self.slots.alloc()
            self.running.append(seq)
            self._grow(seq, count)
            plan.append(Scheduled(seq, seq.num_computed, count, seq.num_computed + count == seq.num_tokens))
            budget -= count
        return plan

    def _blocks_needed(self, seq: Sequence, count: int) -> int:
        return max(0, -(-(seq.num_computed + count) // self.opts.kv_block_size) - len(seq.blocks))

    def _blocks_fit(self, seq: Sequence, count: int) -> bool:
        return self._blocks_needed(seq, count) <= len(self.blocks.free)

    def _grow(self, seq: Sequence, count: int):
        for _ in range(self._blocks_needed(seq, count)):
            seq.blocks.append(self.blocks.alloc())

    def _reserve(self, seq: Sequence, count: int, plan: list[Scheduled]) -> bool:
        """Make room for seq's next `count` tokens, preempting the newest sequences if blocks run out."""
        while not self._blocks_fit(seq, count):
            victim = max(self.running, key=lambda s: s.order)
            if any(p.seq is victim for p in plan):
                victim = seq                  # never undo work already planned this step
            self.preempt(victim)
            if victim is seq:
                return False
        self._grow(seq, count)
        return True

    def preempt(self, seq: Sequence):
        """Free everything seq holds; it will be recomputed from its tokens when it is admitted again."""
        self.release(seq)
        seq.num_computed = 0
        self.waiting.insert(0, seq)

    def release(self, seq: Sequence):
        self.blocks.release(seq.blocks)
        if seq.slot is not None:
            self.slots.release(seq.slot)
            seq.slot = None
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)


# -----------------------------------------------------------------------------------------------
# 7. The sampler, which takes one sequence's logits and returns its next token (and logprobs).
# -----------------------------------------------------------------------------------------------

def process_logits(logits: torch.Tensor, seq: Sequence, eos_ids: list[int]) -> torch.Tensor:
    """Penalties, logit_bias, processors and min_tokens on a (V,) fp32 row. Returns a new tensor."""
    p, out = seq.params, seq.output_ids
    logits = logits.clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.tokens)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if out and (p.presence_penalty or p.frequency_penalty):
        ids, counts = torch.tensor(out, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= p.presence_penalty + p.frequency_penalty * counts.float()
    for tok, bias in p.logit_bias.items():
        logits[tok] += bias
    if len(out) < p.min_tokens:
        banned = list(p.stop_token_ids) + ([] if p.ignore_eos else eos_ids)
        logits[banned] = float("-inf")
    for proc in p.logits_processors:
        logits = proc(list(out), logits)
    return logits


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """temperature (0 = greedy), then top_k, top_p and min_p filters, then a draw from the seeded generator."""
    if params.temperature == 0:
        return int(logits.argmax())
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= params.top_p     # keep the smallest prefix reaching top_p
        probs = probs.scatter(0, idx, sorted_p.masked_fill(drop, 0.0))
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(raw: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's own log-probabilities (before penalties and temperature) of the token and the top k."""
    lp = raw.log_softmax(-1)
    top = lp.topk(k) if k else None
    return float(lp[token]), ([] if top is None else list(zip(top.indices.tolist(), top.values.tolist())))


# -----------------------------------------------------------------------------------------------
# 8. The runner, which turns a plan into a Batch and runs the model. With tensor parallelism every rank
#    runs the same Batch on its shard (section 8b); sampling happens once, on rank 0.
# -----------------------------------------------------------------------------------------------

def make_batch(plan: list[Scheduled], block_size: int, device) -> Batch:
    """Flatten the plan into the tensors the model reads."""
    ids, pos, slots, starts, ctx, rows = [], [], [], [0], [], []
    for p in plan:
        toks = p.seq.tokens[p.start:p.start + p.count]
        ids += toks
        positions = range(p.start, p.start + p.count)
        pos += positions
        slots += [p.seq.blocks[i // block_size] * block_size + i % block_size for i in positions]
        starts.append(starts[-1] + p.count)
        ctx.append(p.start + p.count)
        rows.append(starts[-1] - 1)
    width = max(len(p.seq.blocks) for p in plan)
    tables = [p.seq.blocks + [0] * (width - len(p.seq.blocks)) for p in plan]
    t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    fresh = [p.seq.slot for p in plan if p.start == 0]
    return Batch(t(ids, torch.long), t(pos, torch.long), t(starts, torch.int32), t(ctx, torch.int32),
                 t(tables, torch.int32), t(slots, torch.long), t([p.seq.slot for p in plan], torch.int32),
                 t(rows, torch.long), t(fresh, torch.long))


# -----------------------------------------------------------------------------------------------
# 9. The engine: requests in, token ids out. step() = schedule, run, postprocess. It never sees text.
# -----------------------------------------------------------------------------------------------

@dataclass
class EngineEvent:
    """What the engine reports for one choice after a step (token ids only; the text layer decodes)."""
    index: int
    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None
    finish_reason: str | None = None   # "stop" | "length" | "abort"
    stop_reason: int | None = None     # the stop token id that ended the choice


class Request:
    """One submitted prompt with n choices. The engine thread writes events; the client thread reads them."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, default_seed: int):
        self.id, self.prompt_ids, self.params = request_id, list(prompt_ids), params
        self.default_seed = default_seed
        self.events: queue.Queue = queue.Queue()
        self.seqs: list[Sequence] = []
        self.finished_choices: set[int] = set()
        self.arrival = time.time()


class Engine:
    """Continuous batching over a Model. Thread-safe entry points: add(), abort(); step() runs on one thread."""

    def __init__(self, model: Model, opts: EngineOptions, eos_ids: list[int], kv_dtype: torch.dtype,
                 run_batch: Callable | None = None):
        self.model, self.opts, self.eos_ids = model, opts, list(eos_ids)
        bs = opts.kv_block_size
        num_blocks = opts.num_kv_blocks or opts.max_batch_size * -(-opts.max_context // bs)
        if num_blocks * bs < opts.max_context:
            raise PocketError(f"--num-kv-blocks {num_blocks} x --kv-block-size {bs} cannot hold one sequence of "
                              f"--max-context {opts.max_context} tokens")
        self.blocks, self.slots = BlockPool(num_blocks), SlotPool(opts.max_batch_size)
        self.cache = allocate_cache(model.cfg, model.layers, num_blocks, bs, opts.max_batch_size, kv_dtype,
                                    model.device)
        self.scheduler = Scheduler(opts, self.blocks, self.slots)
        self.run_batch = run_batch or (lambda batch: model.forward(batch, self.cache))
        self.requests: dict[str, Request] = {}
        self.inbox: queue.Queue = queue.Queue()   # ("add", Request) | ("abort", request_id, index | None)
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0}

    # Thread-safe entry points: they only post to the inbox, which step() drains.

    def add(self, request: Request):
        self.inbox.put(("add", request))

    def abort(self, request_id: str, index: int | None = None):
        self.inbox.put(("abort", request_id, index))

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or not self.inbox.empty())

    # The step.

    def step(self) -> None:
        self._drain_inbox()
        plan = self.scheduler.schedule()
        if not plan:
            return
        logits = self.run_batch(make_batch(plan, self.opts.kv_block_size, self.model.device))   # (B, V)
        self._postprocess(plan, logits)

    def _drain_inbox(self):
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                req = msg[1]
                self.requests[req.id] = req
                req.seqs = [Sequence(req, 0)]
                self.scheduler.add(req.seqs[0])
                self.counters["prompt_tokens"] += len(req.prompt_ids)
            elif msg[1] in self.requests:
                for seq in list(self.requests[msg[1]].seqs):
                    if msg[2] is None or seq.index == msg[2]:
                        self._finish(seq, "abort")

    def _postprocess(self, plan: list[Scheduled], logits: torch.Tensor):
        for row, p in enumerate(plan):
            seq = p.seq
            seq.num_computed += p.count
            if not p.sample or seq.finished:
                continue
            if not seq.output_ids and seq.request.params.n > 1 and len(seq.request.seqs) == 1:
                self._fork(seq, logits[row])
            self._append(seq, logits[row])

    def _append(self, seq: Sequence, raw: torch.Tensor):
        params = seq.params
        tok = sample_token(process_logits(raw, seq, self.eos_ids), params, seq.generator)
        lp = [token_logprobs(raw, tok, params.logprobs)] if params.logprobs is not None else None
        seq.output_ids.append(tok)
        self.counters["generation_tokens"] += 1
        reason, stop = None, None
        if tok in params.stop_token_ids or (not params.ignore_eos and tok in self.eos_ids):
            reason, stop = "stop", tok
        elif len(seq.output_ids) >= params.max_tokens:
            reason = "length"
        seq.request.events.put(EngineEvent(seq.index, [tok], lp))
        if reason:
            self._finish(seq, reason, stop)

    def _fork(self, parent: Sequence, raw: torch.Tensor):
        """n > 1: the prompt was prefilled once; each extra choice shares its full KV blocks, copies the last
        partial block and the recurrent state, and samples its own first token from the same logits.
        Without a free slot or block a choice is recomputed from the prompt instead."""
        req, bs = parent.request, self.opts.kv_block_size
        for i in range(1, req.params.n):
            child = Sequence(req, i)
            req.seqs.append(child)
            partial = parent.num_computed % bs != 0
            slot = self.slots.alloc() if len(self.scheduler.running) < self.opts.max_batch_size else None
            block = self.blocks.alloc() if slot is not None and partial else None
            if slot is None or (partial and block is None):
                if slot is not None:
                    self.slots.release(slot)
                self.scheduler.waiting.insert(0, child)   # recomputes the prompt, then samples
                continue
            shared = parent.blocks[:-1] if partial else parent.blocks
            child.blocks = [self.blocks.share(b) for b in shared] + ([block] if partial else [])
            copy_state(self.cache, parent.slot, slot, parent.blocks[-1] if partial else None, block)
            child.slot, child.num_computed = slot, parent.num_computed
            self.scheduler.running.append(child)
            self._append(child, raw)

    def _finish(self, seq: Sequence, reason: str, stop: int | None = None):
        if seq.finished:
            return
        seq.finished = True
        self.scheduler.release(seq)
        req = seq.request
        req.finished_choices.add(seq.index)
        req.events.put(EngineEvent(seq.index, [], None, reason, stop))
        if reason == "abort":   # choices not yet forked will never run
            for i in range(len(req.seqs), req.params.n):
                req.finished_choices.add(i)
                req.events.put(EngineEvent(i, [], None, "abort"))
        if len(req.finished_choices) == req.params.n:
            self.requests.pop(req.id, None)

    def stats(self) -> dict:
        s = self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting), "kv_blocks_used": self.blocks.used,
                "kv_blocks_total": self.blocks.total, "slots_used": self.slots.used, "slots_total": self.slots.total,
                "prompt_tokens_total": self.counters["prompt_tokens"],
                "generation_tokens_total": self.counters["generation_tokens"]}



# ===== SECTION 8b: tensor parallelism (owner: tp) =====


# ===== SECTION 10: text (owner: core: tokenizer + detokenizer; text: chat templates) =====

# -----------------------------------------------------------------------------------------------
# 10. Text: the tokenizer, an incremental detokenizer that never splits a UTF-8 character, stop strings,
#     and the stream a client reads. Everything above this line sees token ids only.
# -----------------------------------------------------------------------------------------------

def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE spells every byte as one printable character; this maps them back."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


class Tokenizer:
    """tokenizer.json (+ tokenizer_config.json, chat_template.jinja) of a checkpoint."""

    def __init__(self, ckpt_dir: str | os.PathLike):
        import tokenizers
        path = Path(ckpt_dir) / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"{path}: file not found")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
            spec = json.loads(path.read_text(encoding="utf-8"))
        except Exception as e:
            raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None
        cfg = _read_json(Path(ckpt_dir) / "tokenizer_config.json", required=False) or {}
        name = lambda v: v.get("content") if isinstance(v, dict) else v  # noqa: E731
        self.bos_token, self.eos_token, self.pad_token = (name(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token"))
        template_file = Path(ckpt_dir) / "chat_template.jinja"
        self.chat_template_source = template_file.read_text(encoding="utf-8") if template_file.exists() \
            else cfg.get("chat_template")
        added = self._tok.get_added_tokens_decoder()                      # id -> AddedToken
        self.special_ids = {i for i, t in added.items() if t.special}
        self._added = {i: t.content for i, t in added.items()}
        self._byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._bytes_cache: dict[int, bytes] = {}
        self._texts: list[str] | None = None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The exact bytes a token stands for (a byte-level token may hold part of a UTF-8 character)."""
        b = self._bytes_cache.get(token_id)
        if b is None:
            piece = self._tok.id_to_token(token_id) or ""
            if token_id in self._added:
                b = self._added[token_id].encode()
            elif self._byte_level:
                table = _BYTE_DECODER
                b = bytes(table[c] for c in piece if c in table)
            else:
                b = self.decode([token_id]).encode()
            self._bytes_cache[token_id] = b
        return b

    def token_texts(self) -> list[str]:
        """Every token's text (partial UTF-8 shown with replacement characters), cached: for constraint masks."""
        if self._texts is None:
            self._texts = [self.token_bytes(i).decode("utf-8", "replace") for i in range(self.vocab_size)]
        return self._texts


_BYTE_DECODER = _byte_decoder()


class TextStream:
    """One choice's text, built token by token: an incremental UTF-8 decoder (so a character split across
    tokens is emitted whole, never as a replacement character) and stop strings matched across tokens.
    Text that could still be the start of a stop string is held back until it cannot."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str], skip_special: bool = True):
        import codecs
        self.tok, self.stop, self.skip_special = tokenizer, list(stop), skip_special
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.pending = ""          # decoded but not yet emitted (a possible stop-string prefix)
        self.stopped: str | None = None

    def add(self, token_id: int) -> str:
        """Feed one token; return the text that is now safe to emit."""
        if self.skip_special and token_id in self.tok.special_ids:
            return ""
        self.pending += self.utf8.decode(self.tok.token_bytes(token_id))
        return self._release()

    def flush(self) -> str:
        self.pending += self.utf8.decode(b"", final=True)
        return self._release(final=True)

    def _release(self, final: bool = False) -> str:
        for s in self.stop:
            at = self.pending.find(s)
            if at >= 0:
                self.stopped, out, self.pending = s, self.pending[:at], ""
                return out
        hold = 0 if final else max((k for s in self.stop for k in range(1, len(s)) if self.pending.endswith(s[:k])),
                                   default=0)
        out, self.pending = self.pending[:len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        return out


@dataclass
class TokenLogprob:
    token_id: int
    token: str
    bytes: list[int]
    logprob: float
    top: list[tuple[int, str, list[int], float]]   # (token_id, token, bytes, logprob), best first


@dataclass
class StreamEvent:
    """What a client sees for one choice: new text, new token ids, and at the end a finish reason."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None    # "stop" | "length" | "abort"
    stop_reason: str | int | None = None


class RequestStream:
    """Iterate it to read a request's StreamEvents as the engine produces them; abort() cancels it."""

    def __init__(self, llm: "LLM", request: Request):
        self.llm, self.request = llm, request
        self.request_id, self.prompt_tokens = request.id, len(request.prompt_ids)
        p = request.params
        self.texts = [TextStream(llm.tokenizer, p.stop) for _ in range(p.n)]
        self.completion_tokens = [0] * p.n
        self.done: set[int] = set()

    def __iter__(self) -> Iterator[StreamEvent]:
        n = self.request.params.n
        while len(self.done) < n:
            ev: EngineEvent = self.request.events.get()
            if ev.finish_reason == "error":
                raise PocketError(f"the engine failed: {self.llm.dead_reason}")
            if ev.index in self.done:
                continue                       # tokens produced after a stop string ended this choice
            out = self._convert(ev)
            if out.finish_reason:
                self.done.add(ev.index)
            if out.text or out.token_ids or out.finish_reason:
                yield out

    def _convert(self, ev: EngineEvent) -> StreamEvent:
        ts, tok = self.texts[ev.index], self.llm.tokenizer
        text = "".join(ts.add(t) for t in ev.token_ids)
        self.completion_tokens[ev.index] += len(ev.token_ids)
        lps = None
        if ev.logprobs is not None:
            piece = lambda t: (t, tok.token_bytes(t).decode("utf-8", "replace"), list(tok.token_bytes(t)))  # noqa: E731
            lps = [TokenLogprob(*piece(t), lp, [(*piece(i), v) for i, v in top])
                   for t, (lp, top) in zip(ev.token_ids, ev.logprobs)]
        if ts.stopped is not None:             # a stop string: end this choice now, free its cache
            self.llm.engine.abort(self.request_id, ev.index)
            self.llm.wake()
            return StreamEvent(ev.index, text, ev.token_ids, lps, "stop", ts.stopped)
        if ev.finish_reason:
            text += ts.flush()
        return StreamEvent(ev.index, text, ev.token_ids, lps, ev.finish_reason, ev.stop_reason)

    def abort(self):
        self.llm.engine.abort(self.request_id)
        self.llm.wake()



# ===== SECTION 11: output parsing and tool_choice (owner: text) =====


# ===== SECTION 12-13: OpenAI protocol and HTTP server (owner: server) =====


# ===== SECTION 14: the LLM object and the CLI (owner: core; server adds chat/serve) =====

# -----------------------------------------------------------------------------------------------
# 14. The LLM object, the Python API that the server and embedding users share, and the CLI.
# -----------------------------------------------------------------------------------------------

DEFAULT_CKPT = HERE / "models" / "pocket-tiny"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _log(opts: EngineOptions, msg: str):
    if not opts.quiet:
        print(f"pocketllm: {msg}", file=sys.stderr, flush=True)


def resolve_dtype(name: str, device: torch.device, what: str) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise PocketError(f"--{what} must be one of auto, {', '.join(_DTYPES)} (got {name!r})")
    return _DTYPES[name]


def select_ops(opts: EngineOptions, device: torch.device):
    """--backend: torch (reference, anywhere), native (the CUDA library), or auto (native when it loads and a
    GPU is present, else torch). Says which and why."""
    if opts.backend not in ("auto", "torch", "native"):
        raise PocketError(f"--backend must be auto, torch or native (got {opts.backend!r})")
    if opts.backend == "torch":
        return TorchOps(), "torch (asked for)"
    status = globals().get("native_status")   # section 3b; absent from builds without the native part
    ok, reason = status(device) if status else (False, "the native backend is not part of this file")
    if ok:
        return NativeOps(device), "native"
    if opts.backend == "native":
        raise PocketError(f"--backend native: {reason}")
    return TorchOps(), f"torch ({reason})"


class LLM:
    """A loaded model with its engine. generate() / logits() / submit() here; chat() / serve() for OpenAI.

    >>> llm = LLM()                                   # the bundled pocket-tiny model
    >>> out = llm.generate("Hello", max_tokens=4, temperature=0)
    >>> sorted(out)
    ['completion_tokens', 'finish_reason', 'logprobs', 'prompt_tokens', 'text', 'token_ids']
    """

    def __init__(self, ckpt_dir: str | os.PathLike | None = None, **options):
        unknown = set(options) - {f.name for f in dataclasses.fields(EngineOptions)}
        if unknown:
            raise PocketError(f"unknown LLM option(s): {', '.join(sorted(unknown))}")
        self.options = opts = EngineOptions(**options)
        self.ckpt_dir = Path(ckpt_dir) if ckpt_dir is not None else DEFAULT_CKPT
        if ckpt_dir is None:
            _log(opts, f"no --ckpt given: serving the bundled pocket-tiny model ({self.ckpt_dir})")
        self.model_name = self.ckpt_dir.resolve().name
        ckpt = Checkpoint(self.ckpt_dir)
        self.config = cfg = ckpt.config
        self.tokenizer = Tokenizer(self.ckpt_dir)
        _check_options(opts, cfg)
        self.eos_token_ids = _eos_ids(ckpt, self.tokenizer)
        self.device = device = torch.device(opts.device)
        self.dtype = resolve_dtype(opts.dtype, device, "dtype")
        kv_dtype = self.dtype if opts.kv_dtype == "auto" else resolve_dtype(opts.kv_dtype, device, "kv-dtype")
        self.group = None                      # tensor-parallel rank group (section 8b), when --devices is given
        if opts.devices:
            self.group = start_group(self.ckpt_dir, opts, self.dtype, kv_dtype)
            self.model, run_batch = self.group.model, lambda batch: self.group.run_batch(batch, self.engine.cache)
        else:
            ops, why = select_ops(opts, device)
            _log(opts, f"backend: {why}")
            self.model = Model(ckpt, ops, self.dtype, device, num_layers=opts.smoke_layers or None,
                               progress=not opts.quiet)
            run_batch = None
        ckpt.close()
        self.engine = Engine(self.model, opts, self.eos_token_ids, kv_dtype, run_batch)
        _log(opts, f"{self.model_name}: {cfg.model_type}, {len(self.model.layers)} layers, {self.dtype}; "
                   f"KV cache {self.engine.blocks.total} blocks x {opts.kv_block_size} tokens = "
                   f"{self.engine.blocks.total * opts.kv_block_size} tokens, {opts.max_batch_size} state slots")
        self.dead_reason: str | None = None
        self._lock = threading.Lock()          # one forward pass at a time (engine thread or logits())
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()

    # The engine thread: steps while there is work, sleeps otherwise.

    def wake(self):
        self._wake.set()

    def _loop(self):
        while True:
            self._wake.wait(timeout=0.5)
            self._wake.clear()
            while self.engine.has_work():
                try:
                    with self._lock:
                        self.engine.step()
                except Exception as e:           # a bug or a device error: fail every request, stay dead
                    traceback.print_exc()
                    self.dead_reason = f"{type(e).__name__}: {e}"
                    for req in list(self.engine.requests.values()):
                        req.events.put(EngineEvent(0, [], None, "error"))
                    return

    def submit(self, prompt_ids: list[int], params: SamplingParams, param: str = "max_tokens") -> RequestStream:
        """Queue a request; iterate the returned stream for its events. Thread-safe."""
        if self.dead_reason:
            raise PocketError(f"the engine failed: {self.dead_reason}")
        params.validate(self.config.vocab_size)
        if not prompt_ids:
            raise RequestError("the prompt is empty", param="prompt")
        if any(not 0 <= t < self.config.vocab_size for t in prompt_ids):
            raise RequestError(f"prompt token ids must be in [0, {self.config.vocab_size})", param="prompt")
        total, limit = len(prompt_ids) + params.max_tokens, self.options.max_context
        if total > limit:
            raise RequestError(f"this request needs {len(prompt_ids)} prompt tokens + {params.max_tokens} max tokens "
                               f"= {total} tokens, over the maximum context length of {limit} tokens", param=param,
                               code="context_length_exceeded")
        req = Request(f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}", prompt_ids, params,
                      default_seed=random.getrandbits(62))
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="pocketllm-engine", daemon=True)
            self._thread.start()
        self.engine.add(req)
        self.wake()
        return RequestStream(self, req)

    def stats(self) -> dict:
        return self.engine.stats()

    # Offline API.

    def generate(self, prompt: str | list[int], **sampling) -> dict:
        """Complete a prompt (text or token ids). Sampling keywords are SamplingParams fields.
        n == 1: {"text", "token_ids", "finish_reason", "prompt_tokens", "completion_tokens", "logprobs"};
        n > 1: {"choices": [such dicts], "prompt_tokens"}."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = _sampling_params(sampling)
        stream = self.submit(ids, params)
        choices = [{"text": "", "token_ids": [], "finish_reason": None, "logprobs": [] if params.logprobs is not None
                    else None} for _ in range(params.n)]
        for ev in stream:
            c = choices[ev.index]
            c["text"] += ev.text
            c["token_ids"] += ev.token_ids
            if ev.logprobs is not None:
                c["logprobs"] += ev.logprobs
            c["finish_reason"] = ev.finish_reason or c["finish_reason"]
        for i, c in enumerate(choices):
            c["prompt_tokens"], c["completion_tokens"] = len(ids), stream.completion_tokens[i]
        return choices[0] if params.n == 1 else {"choices": choices, "prompt_tokens": len(ids)}

    def logits(self, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """float32 logits (len, vocab) for every position of token_ids, computed as one prefill, or as
        prefill chunks of chunk_size tokens (chunk_size=1 runs the decode path at every position)."""
        ids = list(token_ids)
        if self.group is not None:
            with self._lock:
                return self.group.logits(ids, chunk_size)
        bs = self.options.kv_block_size
        nblocks = -(-len(ids) // bs)
        cache = allocate_cache(self.config, self.model.layers, nblocks, bs, 1, self.engine.cache.k[
            next(iter(self.engine.cache.k))].dtype if self.engine.cache.k else self.dtype, self.device)
        blocks, step, out = list(range(nblocks)), chunk_size or len(ids), []
        with self._lock:
            for s in range(0, len(ids), step):
                n = min(step, len(ids) - s)
                dev = lambda x, dt: torch.tensor(x, dtype=dt, device=self.device)  # noqa: E731
                batch = Batch(dev(ids[s:s + n], torch.long), dev(list(range(s, s + n)), torch.long),
                              dev([0, n], torch.int32), dev([s + n], torch.int32), dev([blocks], torch.int32),
                              dev([blocks[i // bs] * bs + i % bs for i in range(s, s + n)], torch.long),
                              dev([0], torch.int32), dev(list(range(n)), torch.long), dev([0] if s == 0 else [], torch.long))
                out.append(self.model.forward(batch, cache))
        return torch.cat(out).float().cpu()


def _sampling_params(sampling: dict) -> SamplingParams:
    unknown = set(sampling) - {f.name for f in dataclasses.fields(SamplingParams)}
    if unknown:
        raise RequestError(f"unknown sampling option(s): {', '.join(sorted(unknown))}", param=sorted(unknown)[0])
    return SamplingParams(**sampling)


def _check_options(opts: EngineOptions, cfg: ModelConfig):
    for name in ("max_context", "max_batch_size", "kv_block_size", "prefill_token_budget"):
        if getattr(opts, name) < 1:
            raise PocketError(f"--{name.replace('_', '-')} must be >= 1")
    if opts.smoke_layers < 0 or opts.smoke_layers > cfg.num_hidden_layers:
        raise PocketError(f"--smoke-layers must be in [0, {cfg.num_hidden_layers}]")


def _eos_ids(ckpt: Checkpoint, tok: Tokenizer) -> list[int]:
    """Stop tokens: generation_config.json's eos_token_id (int or list), else the tokenizer's eos token."""
    eos = ckpt.generation_config.get("eos_token_id")
    if eos is None:
        eos = ckpt.raw_config.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not ids and tok.eos_token and tok.token_to_id(tok.eos_token) is not None:
        ids = [tok.token_to_id(tok.eos_token)]
    return [int(i) for i in ids]


# The command line: serving (the default) and `bench`.

def add_engine_args(parser: argparse.ArgumentParser):
    parser.add_argument("--ckpt", default=None, help="checkpoint directory (default: the bundled pocket-tiny)")
    for f in dataclasses.fields(EngineOptions):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, action="store_true", default=f.default)
        else:
            kind = int if f.type == "int" else str
            parser.add_argument(flag, type=kind, default=f.default, metavar=f.name.upper())


def engine_options(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineOptions)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["bench"]:
            return bench_main(argv[1:])
        parser = argparse.ArgumentParser(prog="pocketllm.py", description="Serve a Qwen checkpoint (OpenAI API).")
        add_engine_args(parser)
        add_server_args(parser)
        args = parser.parse_args(argv)
        llm = LLM(args.ckpt, **engine_options(args))
        return run_server(llm, args)
    except PocketError as e:
        print(f"pocketllm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

