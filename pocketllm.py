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
    """FP8 weight * its 128x128 block scale -> dense (N, K), for one layer at a time. One (N, K) buffer is
    allocated and scaled in place, one row of blocks at a time (edge blocks may be ragged)."""
    if w.scale is None:
        return w.weight.to(dtype)
    (n, k), (bn, bk) = w.weight.shape, w.block
    out = w.weight.to(dtype)                                             # (N, K)
    cols = w.scale.to(dtype).repeat_interleave(bk, dim=1)[:, :k]         # (N/bn, K): each scale over its columns
    for i in range(cols.shape[0]):
        out[i * bn:(i + 1) * bn].mul_(cols[i])
    return out


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
        if w.scale is None:
            return x @ w.weight.to(x.dtype).t()                          # (T, N)
        (n, k), bn = w.weight.shape, w.block[0]
        step = max(1, (1 << 20) // (k * bn)) * bn                        # FP8: dequantise ~1M weights at a time
        out = x.new_empty(x.shape[0], n)
        for r in range(0, n, step):
            tile = Linear(w.weight[r:r + step], w.scale[r // bn:(r + step) // bn], w.block)
            out[:, r:r + step] = x @ dequantize(tile, x.dtype).t()
        return out

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

# -----------------------------------------------------------------------------------------------
# 3b. The native backend: the same ops, run by the CUDA library in csrc/ (libpocketllm.so), reached
#     through cffi's ABI mode, so importing pocketllm needs no compiler and any Python version works.
#     The CPU test build (libpocketllm_cpu.so) runs the same kernels on host tensors; CI uses it.
# -----------------------------------------------------------------------------------------------

NATIVE_ABI_VERSION = 2          # must equal PL_ABI_VERSION in csrc/pocketllm.h
NATIVE_MIN_CAPABILITY = (7, 5)  # Turing: mma.sync m16n8k8 and ldmatrix

# torch dtype -> the library's pl_dtype code.
NATIVE_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float8_e4m3fn: 3,
                 torch.int32: 4, torch.int64: 5}


class NativeError(PocketError):
    """A native library call failed; the message is the library's pl_last_error() line."""


def native_library_path(cpu_build: bool = False) -> Path:
    """$POCKETLLM_NATIVE_LIB, else build/libpocketllm.so (or build/libpocketllm_cpu.so) next to this file."""
    override = os.environ.get("POCKETLLM_NATIVE_LIB")
    if override and not cpu_build:
        return Path(override)
    return HERE / "build" / ("libpocketllm_cpu.so" if cpu_build else "libpocketllm.so")


def native_cdef(header_text: str) -> str:
    """The declarations cffi reads: the header between its "cdef begin" and "cdef end" markers."""
    begin, end = "/* ---- cdef begin ---- */", "/* ---- cdef end ---- */"
    if begin not in header_text or end not in header_text:
        raise PocketError(f"pocketllm.h lacks the {begin!r} / {end!r} markers")
    return header_text[header_text.index(begin) + len(begin):header_text.index(end)]


class NativeLibrary:
    """The loaded library: `call(name, *args)` runs a pl_* function and raises NativeError on a nonzero status."""

    def __init__(self, path: Path):
        import cffi
        header = path.with_name("pocketllm.h")   # build.py copies it next to the library
        if not header.exists():
            header = HERE / "csrc" / "pocketllm.h"
        if not path.exists():
            hint = "python build.py --cpu" if path.name.endswith("_cpu.so") else "python build.py"
            raise PocketError(f"native library {path} not found: build it with `{hint}`")
        if not header.exists():
            raise PocketError(f"native library header not found next to {path} or in {HERE / 'csrc'}")
        self.path = path
        self.ffi = cffi.FFI()
        self.ffi.cdef(native_cdef(header.read_text()))
        try:
            self.lib = self.ffi.dlopen(str(path))
        except OSError as e:
            raise PocketError(f"cannot load native library {path}: {e}") from None
        version = self.lib.pl_abi_version()
        if version != NATIVE_ABI_VERSION:
            raise PocketError(f"native library {path} has ABI version {version}, this pocketllm.py needs "
                              f"{NATIVE_ABI_VERSION}: rebuild it with `python build.py`")
        self.is_cpu_build = bool(self.lib.pl_is_cpu_build())

    def last_error(self) -> str:
        return self.ffi.string(self.lib.pl_last_error()).decode(errors="replace")

    def call(self, name: str, *args) -> None:
        if getattr(self.lib, name)(*args) != 0:
            raise NativeError(f"native library: {self.last_error()}")

    def device_count(self) -> int:
        count = self.ffi.new("int32_t*")
        self.call("pl_device_count", count)
        return int(count[0])

    def capability(self, device: int = 0) -> tuple[int, int]:
        major, minor = self.ffi.new("int32_t*"), self.ffi.new("int32_t*")
        self.call("pl_device_capability", device, major, minor)
        return int(major[0]), int(minor[0])


_native_libraries: dict[Path, NativeLibrary] = {}
_native_lock = threading.Lock()


def load_native(cpu_build: bool = False) -> NativeLibrary:
    """Load (once per process) the CUDA library, or with cpu_build=True the CPU test build.

    Raises PocketError saying what is missing (library not built, wrong ABI version, cannot be loaded).
    """
    path = native_library_path(cpu_build).resolve()
    with _native_lock:
        if path not in _native_libraries:
            _native_libraries[path] = NativeLibrary(path)
        return _native_libraries[path]


def native_status(device: torch.device | str | None = None) -> tuple[bool, str]:
    """(True, what) when the native backend can run on `device`, else (False, why). select_ops uses it.

    CUDA devices need the library, a GPU of sm_75 or newer and torch with CUDA. A CPU device runs the CPU test
    build only when POCKETLLM_NATIVE_CPU=1 (tests: the same kernels, emulated and slow), never by default."""
    device = torch.device(device or "cuda")
    if device.type == "cpu":
        if os.environ.get("POCKETLLM_NATIVE_CPU") != "1":
            return False, "the native backend needs a CUDA device (set POCKETLLM_NATIVE_CPU=1 for the CPU test build)"
        try:
            return True, f"{load_native(cpu_build=True).path.name}: the CPU test build, kernels emulated (slow)"
        except PocketError as e:
            return False, str(e)
    if device.type != "cuda":
        return False, f"the native backend runs on CUDA devices, not {device.type}"
    try:
        lib = load_native()
        count = lib.device_count()
    except PocketError as e:
        return False, str(e)
    if count == 0:
        return False, "no CUDA device is visible"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} has no CUDA support, so tensors cannot live on the GPU"
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = lib.capability(index)
    if (major, minor) < NATIVE_MIN_CAPABILITY:
        return False, f"GPU compute capability {major}.{minor} is below the required 7.5"
    return True, f"{lib.path.name} (ABI {NATIVE_ABI_VERSION}) on {torch.cuda.get_device_name(index)} (sm_{major}{minor})"


class NativeOps:
    """The backend op list of TorchOps on the native library: the same methods and signatures. Each method
    passes data pointers, shapes and dtype codes on torch's current stream. Inputs may be strided views (they
    are made contiguous); tensors written in place (caches, states, the residual) must be contiguous. On a CPU
    device the CPU test build runs the same kernels on host tensors."""
    name = "native"

    def __init__(self, device: torch.device | str | None = None, lib: NativeLibrary | None = None):
        self.device = torch.device(device or "cuda")
        self.lib = lib or load_native(cpu_build=self.device.type == "cpu")
        self._threads = threading.local()   # threads that made this device current in the library's runtime

    # ---- Plumbing: pointers, dtype codes, the stream ----

    def _p(self, t: torch.Tensor) -> int:
        """The address of a tensor the library reads or writes in place."""
        if t.is_cuda == self.lib.is_cpu_build:
            where = "CPU" if self.lib.is_cpu_build else "CUDA"
            raise PocketError(f"native backend ({self.lib.path.name}) needs {where} tensors, got one on {t.device}")
        if not t.is_contiguous():
            raise PocketError(f"native backend: a tensor written in place must be contiguous, got shape "
                              f"{tuple(t.shape)} strides {t.stride()}")
        return t.data_ptr()

    @staticmethod
    def _dt(t: torch.Tensor) -> int:
        if t.dtype not in NATIVE_DTYPES:
            raise PocketError(f"native backend does not handle dtype {t.dtype}")
        return NATIVE_DTYPES[t.dtype]

    def _stream(self, t: torch.Tensor) -> int:
        """torch's current stream on t's device, that device made current for the library on this thread."""
        if not t.is_cuda:
            return 0
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        if getattr(self._threads, "device", None) != index:
            self.lib.call("pl_set_device", index)
            self._threads.device = index
        return torch.cuda.current_stream(t.device).cuda_stream

    @staticmethod
    def _as(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An input in `dtype` (default: its own), contiguous; no copy when it already is."""
        return t.to(dtype or t.dtype).contiguous()

    # ---- The ops ----

    def embed(self, ids: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ids, table = self._as(ids, torch.int64), self._as(table)
        (V, D), T = table.shape, ids.numel()
        out = torch.empty(T, D, dtype=dtype, device=table.device)                   # (T, D)
        self.lib.call("pl_embed", self._p(ids), T, self._p(table), self._dt(table), V, D, self._p(out),
                      self._dt(out), self._stream(out))
        return out

    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        x, w = self._as(x), self._as(w)
        D = x.shape[-1]
        out = torch.empty_like(x)                                                    # (T, D)
        self.lib.call("pl_rmsnorm", self._p(x), self._p(w), self._dt(w), self._p(out), self._dt(x),
                      x.numel() // D, D, eps, self._stream(x))
        return out

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual (T, D) fp32 is updated in place and returned."""
        x, w = self._as(x), self._as(w)
        D = x.shape[-1]
        if residual.dtype != torch.float32:
            raise PocketError(f"add_rmsnorm: the residual stream must be float32, got {residual.dtype}")
        out = torch.empty_like(x)                                                    # (T, D)
        self.lib.call("pl_add_rmsnorm", self._p(x), self._p(residual), self._p(w), self._dt(w), self._p(out),
                      self._dt(x), x.numel() // D, D, eps, self._stream(x))
        return out, residual

    def linear(self, x: torch.Tensor, w: Linear) -> torch.Tensor:
        if w.scale is not None and tuple(w.block) != (128, 128):
            raise PocketError(f"the native FP8 kernels need 128x128 weight blocks, not {list(w.block)} "
                              f"(use --backend torch)")
        x, weight = self._as(x), self._as(w.weight)
        N, K = weight.shape
        out = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)          # (T, N)
        scale = self._as(w.scale, torch.float32) if w.scale is not None else None    # (ceil(N/128), ceil(K/128))
        self.lib.call("pl_linear", self._p(x), self._dt(x), x.numel() // K, K, self._p(weight), self._dt(weight),
                      0 if scale is None else self._p(scale), N, self._p(out), self._stream(x))
        return out

    def silu_mul(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        g, u = self._as(g), self._as(u, g.dtype)
        out = torch.empty_like(g)                                                    # (T, I)
        self.lib.call("pl_silu_mul", self._p(g), self._p(u), self._p(out), self._dt(g), g.numel(), self._stream(g))
        return out

    def sigmoid_mul(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        x, gate = self._as(x), self._as(gate, x.dtype)
        out = torch.empty_like(x)                                                    # (T, N)
        self.lib.call("pl_sigmoid_mul", self._p(x), self._p(gate), self._p(out), self._dt(x), x.numel(),
                      self._stream(x))
        return out

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, eps: float,
                     positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, q_w = self._as(q), self._as(k, q.dtype), self._as(q_w)
        k_w, positions = self._as(k_w, q_w.dtype), self._as(positions, torch.int64)
        inv_freq = self._as(inv_freq, torch.float32)                                 # (R/2,)
        (T, Hq, Dh), Hk = q.shape, k.shape[1]
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)                     # (T, Hq, Dh), (T, Hk, Dh)
        self.lib.call("pl_qk_norm_rope", self._p(q), self._p(k), self._p(q_out), self._p(k_out), self._dt(q), T, Hq,
                      Hk, Dh, self._p(q_w), self._p(k_w), self._dt(q_w), eps, self._p(positions), self._p(inv_freq),
                      inv_freq.numel(), self._stream(q))
        return q_out, k_out

    def kv_write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        k, v, slot_mapping = self._as(k), self._as(v, k.dtype), self._as(slot_mapping, torch.int64)
        T, Hk, Dh = k.shape
        self.lib.call("pl_kv_write", self._p(k), self._p(v), self._dt(k), T, Hk, Dh, self._p(k_cache),
                      self._p(v_cache), self._dt(k_cache), self._p(slot_mapping), self._stream(k))

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, query_start: torch.Tensor, scale: float) -> torch.Tensor:
        if k_cache.dtype != q.dtype:      # the kernel reads the cache in the activation dtype
            raise PocketError(f"the native attention needs the KV cache in the activation dtype ({q.dtype}), "
                              f"not {k_cache.dtype}: leave --kv-dtype at auto")
        q, block_tables = self._as(q), self._as(block_tables, torch.int32)
        context_lens, query_start = self._as(context_lens, torch.int32), self._as(query_start, torch.int32)
        (T, Hq, Dh), (_, block_size, Hk, _) = q.shape, k_cache.shape
        B, max_blocks = block_tables.shape
        ws_bytes = self.lib.lib.pl_attention_workspace_bytes(T, Hq, Dh, max_blocks, block_size)
        workspace = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=q.device)   # split-K partials
        out = torch.empty_like(q)                                                    # (T, Hq, Dh)
        self.lib.call("pl_attention", self._p(q), self._dt(q), T, Hq, Hk, Dh, self._p(k_cache), self._p(v_cache),
                      block_size, self._p(block_tables), max_blocks, self._p(context_lens), self._p(query_start), B,
                      scale, self._p(out), self._p(workspace), ws_bytes, self._stream(q))
        return out

    def conv1d(self, x: torch.Tensor, w: torch.Tensor, conv_state: torch.Tensor, slot_ids: torch.Tensor,
               query_start: torch.Tensor) -> torch.Tensor:
        x, slot_ids, query_start = self._as(x), self._as(slot_ids, torch.int32), self._as(query_start, torch.int32)
        T, C = x.shape
        w = self._as(w).reshape(C, -1)                                               # (C, W)
        out = torch.empty_like(x)                                                    # (T, C)
        self.lib.call("pl_conv1d", self._p(x), self._dt(x), T, C, self._p(w), self._dt(w), w.shape[1],
                      self._p(conv_state), self._dt(conv_state), self._p(slot_ids), self._p(query_start),
                      slot_ids.numel(), self._p(out), self._stream(x))
        return out

    def gdn_gates(self, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                  dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self._as(a), self._as(b, a.dtype)
        A_log, dt_bias = self._as(A_log, torch.float32), self._as(dt_bias, torch.float32)   # (Hv,): one dtype code
        T, Hv = a.shape
        g = torch.empty(T, Hv, dtype=torch.float32, device=a.device)                # (T, Hv)
        beta = torch.empty_like(g)                                                   # (T, Hv)
        self.lib.call("pl_gdn_gates", self._p(a), self._p(b), self._dt(a), T, Hv, self._p(A_log), self._p(dt_bias),
                      self._dt(A_log), self._p(g), self._p(beta), self._stream(a))
        return g, beta

    def gated_delta(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, slot_ids: torch.Tensor, query_start: torch.Tensor) -> torch.Tensor:
        q, k, v = self._as(q), self._as(k, q.dtype), self._as(v, q.dtype)
        g, beta = self._as(g, torch.float32), self._as(beta, torch.float32)
        slot_ids, query_start = self._as(slot_ids, torch.int32), self._as(query_start, torch.int32)
        (T, Hk, Dk), (_, Hv, Dv) = q.shape, v.shape
        out = torch.empty_like(v)                                                    # (T, Hv, Dv)
        self.lib.call("pl_gated_delta", self._p(q), self._p(k), self._p(v), self._dt(q), T, Hk, Hv, Dk, Dv,
                      self._p(g), self._p(beta), self._p(state), self._p(slot_ids), self._p(query_start),
                      slot_ids.numel(), self._p(out), self._stream(q))
        return out

    def gated_rmsnorm(self, x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        x, z, w = self._as(x), self._as(z, x.dtype), self._as(w)
        D = x.shape[-1]
        out = torch.empty_like(x)                                                    # (T, Hv, Dv)
        self.lib.call("pl_gated_rmsnorm", self._p(x), self._p(z), self._p(w), self._dt(w), self._p(out),
                      self._dt(x), x.numel() // D, D, eps, self._stream(x))
        return out

    # ---- NCCL (native only): tensor parallelism refuses to start when nccl_available() is False ----

    def nccl_available(self) -> bool:
        return nccl_status(self.lib)[0]

    def nccl_unique_id(self) -> bytes:
        self._require_nccl()
        buf = self.lib.ffi.new("uint8_t[]", self.lib.lib.PL_NCCL_ID_BYTES)
        self.lib.call("pl_nccl_unique_id", buf)
        return bytes(self.lib.ffi.buffer(buf))

    def nccl_init(self, unique_id: bytes, nranks: int, rank: int, device: int | None) -> int:
        """A communicator of `nranks` on `device` (None: torch's current device); returns its handle."""
        self._require_nccl()
        device = torch.cuda.current_device() if device is None else device
        if len(unique_id) != self.lib.lib.PL_NCCL_ID_BYTES:
            raise PocketError(f"NCCL unique id must be {self.lib.lib.PL_NCCL_ID_BYTES} bytes, got {len(unique_id)}")
        comm = self.lib.ffi.new("uint64_t*")
        self.lib.call("pl_nccl_init", unique_id, nranks, rank, device, comm)
        return int(comm[0])

    def all_reduce(self, x: torch.Tensor, comm: int) -> torch.Tensor:
        self.lib.call("pl_nccl_all_reduce_sum", comm, self._p(x), x.numel(), self._dt(x), self._stream(x))
        return x

    def nccl_destroy(self, comm: int) -> None:
        self.lib.call("pl_nccl_destroy", comm)

    def _require_nccl(self) -> None:
        ok, why = nccl_status(self.lib)
        if not ok:
            raise PocketError(f"tensor parallelism needs NCCL: {why}")


def nccl_library_candidates() -> list[str | None]:
    """Where to look for libnccl.so.2: $NCCL_ROOT/lib, the nvidia-nccl-cu* wheel, then the loader's search."""
    found: list[str | None] = []
    if os.environ.get("NCCL_ROOT"):
        found.append(str(Path(os.environ["NCCL_ROOT"]) / "lib" / "libnccl.so.2"))
    # The wheel's files are located, not imported: it is an optional place to find the .so, not a dependency.
    for site in sys.path:
        lib = Path(site or ".") / "nvidia" / "nccl" / "lib" / "libnccl.so.2"
        if lib.exists():
            found.append(str(lib))
    return found + [None]


def nccl_status(lib: NativeLibrary) -> tuple[bool, str]:
    """(True, "NCCL <version> from <where>") once the library has loaded NCCL, else (False, every reason)."""
    reasons = []
    for cand in nccl_library_candidates():
        try:
            lib.call("pl_nccl_load", lib.ffi.NULL if cand is None else cand.encode())
        except NativeError:
            reasons.append(lib.last_error())
            continue
        version = lib.ffi.new("int32_t*")
        lib.call("pl_nccl_version", version)
        return True, f"NCCL {version[0]} from {cand or 'libnccl.so.2'}"
    return False, "; ".join(reasons)


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
                 run_batch: Callable | None = None, copy: Callable = copy_state):
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
        self.copy_state = copy                    # with tensor parallelism: on every rank's cache
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
            self.copy_state(self.cache, parent.slot, slot, parent.blocks[-1] if partial else None, block)
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

import atexit
import datetime
import subprocess

import torch.distributed as dist

# -----------------------------------------------------------------------------------------------
# 8b. Tensor parallelism, Megatron style: one rank per device, each holding a Shard of every layer (section
#     4 loads only its slices). Rank 0 is this process: it schedules, samples and serves. Ranks 1..N-1 are
#     worker processes that replay rank 0's step plans on their shard and their own cache. Activations cross
#     ranks only in the model's two all-reduces per layer (after the mixer's output projection and after
#     down_proj). The embedding and lm_head are replicated, not vocab-parallel: rank 0's own lm_head gives
#     the full logits, so sampling needs no gather and the embedding no all-reduce; the price is one copy of
#     each per rank (2 x 2.5 GB bf16 at 27B), and the workers' logits rows are computed and dropped.
#
#     Lifecycle: one group, one lifetime. start_group returns only after every rank has loaded; a worker
#     that fails or dies ends the group (named in the message); workers stop when rank 0 says so, when rank 0
#     disappears, or when their connection to it breaks. See docs/architecture.md, "Tensor parallelism".
# -----------------------------------------------------------------------------------------------

def parse_devices(spec: str) -> list[torch.device]:
    """--devices: "cpu,cpu" (CPU ranks, gloo) or "0,1,2,3" / "cuda:0,cuda:1" (one GPU each, NCCL)."""
    names = [s.strip() for s in spec.split(",")]
    if not all(names):
        raise PocketError(f"--devices {spec!r}: empty entry (expected e.g. cpu,cpu or 0,1)")
    devices = []
    for name in names:
        try:
            devices.append(torch.device("cuda", int(name)) if name.isdigit() else torch.device(name))
        except (RuntimeError, ValueError):
            raise PocketError(f"--devices {spec!r}: {name!r} is not a device (expected cpu, 0, cuda:1, ...)") from None
    kinds = {d.type for d in devices}
    if kinds - {"cpu", "cuda"} or len(kinds) > 1:
        raise PocketError(f"--devices {spec!r}: every rank must be a cpu, or every rank a cuda device")
    if "cuda" in kinds:
        indices = [d.index or 0 for d in devices]
        devices = [torch.device("cuda", i) for i in indices]
        if len(set(indices)) < len(indices):
            raise PocketError(f"--devices {spec!r}: one rank per GPU (NCCL refuses two ranks on one device); "
                              f"for tests on one machine use --devices cpu,cpu")
        if max(indices) >= torch.cuda.device_count():
            raise PocketError(f"--devices {spec!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return devices


def _cache_blocks(opts: EngineOptions) -> int:
    """The KV blocks of the engine cache: the same count on every rank (see Engine.__init__)."""
    return opts.num_kv_blocks or opts.max_batch_size * -(-opts.max_context // opts.kv_block_size)


# Every rank needs a step's Batch. Rank 0 broadcasts it as a fixed header (command and sizes), then one
# int64 payload holding the Batch's tensors end to end; the workers rebuild the Batch on their device.

PLAN_STEP, PLAN_SCRATCH, PLAN_COPY, PLAN_STOP = range(4)
HEADER_WORDS = 8                      # command, then up to 7 integer arguments
ENGINE_CACHE, SCRATCH_CACHE = 0, 1    # which cache a step runs on: the engine's, or logits()'s temporary one
_BATCH_WIRE = (("token_ids", torch.long), ("positions", torch.long), ("query_start", torch.int32),
               ("context_lens", torch.int32), ("block_tables", torch.int32), ("slot_mapping", torch.long),
               ("state_slots", torch.int32), ("logit_rows", torch.long), ("fresh_slots", torch.long))


def pack_batch(batch: Batch) -> tuple[list[int], torch.Tensor]:
    """-> ([T, B, W, R, F], payload (n,) int64 on the CPU)."""
    B, W = batch.block_tables.shape
    sizes = [batch.token_ids.numel(), B, W, batch.logit_rows.numel(), batch.fresh_slots.numel()]
    payload = torch.cat([getattr(batch, name).reshape(-1).to("cpu", torch.long) for name, _ in _BATCH_WIRE])
    return sizes, payload


def wire_lengths(sizes: list[int]) -> list[int]:
    """The payload length of each _BATCH_WIRE field, from [T, B, W, R, F]."""
    T, B, W, R, F = sizes
    return [T, T, B + 1, B, B * W, T, B, R, F]


def unpack_batch(sizes: list[int], payload: torch.Tensor, device) -> Batch:
    parts = payload.to(device).split(wire_lengths(sizes))
    fields = {name: part.to(dtype) for (name, dtype), part in zip(_BATCH_WIRE, parts)}
    fields["block_tables"] = fields["block_tables"].view(sizes[1], sizes[2])   # (B, W)
    return Batch(**fields)


class Comm:
    """One rank's collectives. Plans travel over gloo (CPU tensors, from rank 0). Activations are summed over
    the same gloo group on CPU ranks, and over NCCL on GPU ranks: the native library's when the native ops
    run (it must have NCCL), torch.distributed's when the torch ops do."""

    # Workers wait for the next plan for as long as the server idles; a dead peer still fails at once
    # (its sockets close), so the timeout only bounds a peer that hangs.
    TIMEOUT = datetime.timedelta(days=30)

    def __init__(self, store, rank: int, world: int, device: torch.device, ops):
        self.plans = dist.ProcessGroupGloo(dist.PrefixStore("plans/", store), rank, world, self.TIMEOUT)
        self.all_reduce = self._gloo_all_reduce
        if device.type == "cuda" and hasattr(ops, "nccl_init"):
            self.comm = ops.nccl_init(store.get("nccl_id"), world, rank, device.index)
            self.all_reduce = lambda x: ops.all_reduce(x, self.comm)        # in place, on the ops' stream
        elif device.type == "cuda":
            self.nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, world)
            self.all_reduce = self._torch_nccl_all_reduce

    def _gloo_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.plans.allreduce([x]).wait()
        return x

    def _torch_nccl_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.nccl.allreduce([x]).wait()
        return x

    def send_plan(self, command: int, args: list[int], payload: torch.Tensor | None = None):
        header = torch.tensor((command, *args) + (0,) * (HEADER_WORDS - 1 - len(args)), dtype=torch.long)
        self.plans.broadcast(header, 0).wait()
        if payload is not None and payload.numel():
            self.plans.broadcast(payload, 0).wait()

    def recv_plan(self) -> tuple[int, list[int], torch.Tensor | None]:
        header = torch.empty(HEADER_WORDS, dtype=torch.long)
        self.plans.broadcast(header, 0).wait()
        command, args = int(header[0]), header[1:].tolist()
        payload = None
        if command == PLAN_STEP:
            payload = torch.empty(sum(wire_lengths(args[1:6])), dtype=torch.long)
            if payload.numel():
                self.plans.broadcast(payload, 0).wait()
        return command, args, payload


def _load_rank_model(ckpt_dir, opts: EngineOptions, ops, dtype, device, rank: int, world: int, all_reduce,
                     quiet: bool) -> Model:
    ckpt = Checkpoint(ckpt_dir)
    try:
        return Model(ckpt, ops, dtype, device, shard=Shard(rank, world), num_layers=opts.smoke_layers or None,
                     all_reduce=all_reduce, progress=not quiet)
    except CheckpointError as e:
        if world > 1 and "tensor-parallel degree" not in str(e):   # e.g. an FP8 slice off its 128-blocks
            raise CheckpointError(f"{e} at tensor-parallel degree {world}") from None
        raise
    finally:
        ckpt.close()


def _is_program() -> bool:
    """pocketllm.py is the program (the CLI), not a library imported into someone else's process."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return main_file is not None and Path(main_file).resolve() == Path(__file__).resolve()


# Workers run this file as a fresh program, whatever imported it in rank 0 (a script without a __main__
# guard, a notebook): subprocess + a bootstrap that loads the file by path, never multiprocessing, whose
# spawn mode re-imports the parent's __main__. The worker is in rank 0's process group, so a terminal's
# Ctrl-C reaches it; it ignores SIGINT and lets rank 0 decide.
_WORKER_BOOT = ("import importlib.util, sys\n"
                "spec = importlib.util.spec_from_file_location('pocketllm', sys.argv[1])\n"
                "mod = importlib.util.module_from_spec(spec); sys.modules['pocketllm'] = mod\n"
                "spec.loader.exec_module(mod)\n"
                "sys.exit(mod.run_rank_worker(sys.argv[2]))")


class RankGroup:
    """Rank 0's side of the group: its own Model shard, the worker processes, and the step protocol.
    run_batch / logits / copy_state mirror every cache operation on every rank; close() stops them all."""

    POLL_S = 0.2

    def __init__(self, ckpt_dir, opts: EngineOptions, dtype: torch.dtype, kv_dtype: torch.dtype):
        self.opts, self.dtype, self.kv_dtype = opts, dtype, kv_dtype
        self.devices = parse_devices(opts.devices)
        self.world = len(self.devices)
        self.workers: dict[int, subprocess.Popen] = {}
        self.dead_reason: str | None = None     # set once a rank has failed; every later call raises
        self.dead_kind = ""                     # the failed rank's error type, when it reported one
        self.on_death: Callable[[str], None] | None = None   # told the reason (e.g. to mark the LLM dead)
        self.comm: Comm | None = None
        self.model: Model | None = None
        self._lock = threading.Lock()           # one plan + forward at a time, in the same order on every rank
        self._closing = False
        self._scratch: Cache | None = None
        self.store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60),
                                   wait_for_workers=False)   # port 0: the OS picks a free port
        atexit.register(self.close)

    # Start: spawn the workers, load rank 0's shard meanwhile, wait until every rank has loaded, connect.

    def start(self, ckpt_dir):
        device = self.devices[0]
        ops, why = select_ops(self.opts, device)
        _log(self.opts, f"backend: {why}; tensor parallelism over {self.world} ranks ({self.opts.devices})")
        if device.type == "cuda":   # GPU ranks without NCCL are refused, never run without their all-reduce
            if hasattr(ops, "nccl_unique_id"):
                self.store.set("nccl_id", ops.nccl_unique_id())   # rank 0 makes the id; raises without NCCL
            elif not dist.is_nccl_available():
                raise PocketError(f"--devices {self.opts.devices}: tensor parallelism on GPUs needs NCCL, and this "
                                  f"torch build has none (torch.distributed.is_nccl_available() is False)")
        for rank in range(1, self.world):
            spec = {"ckpt": str(Path(ckpt_dir).resolve()), "rank": rank, "world": self.world,
                    "device": str(self.devices[rank]), "dtype": str(self.dtype).removeprefix("torch."),
                    "kv_dtype": str(self.kv_dtype).removeprefix("torch."), "port": self.store.port,
                    "parent": os.getpid(),   # every rank runs rank 0's backend, so their all-reduces match
                    "options": dict(dataclasses.asdict(self.opts), backend=ops.name)}
            self.workers[rank] = subprocess.Popen([sys.executable, "-c", _WORKER_BOOT, str(Path(__file__).resolve()),
                                                   json.dumps(spec)], stdin=subprocess.DEVNULL)
        threading.Thread(target=self._watch, name="pocketllm-ranks", daemon=True).start()
        self.model = _load_rank_model(ckpt_dir, self.opts, ops, self.dtype, device, 0, self.world,
                                      lambda x: self.comm.all_reduce(x), self.opts.quiet)
        self._wait_until_loaded()
        self.comm = Comm(self.store, 0, self.world, device, ops)

    def _wait_until_loaded(self):
        """Until every worker says it has loaded; a worker that failed (seen by the watcher) fails the start."""
        pending = set(self.workers)
        while pending:
            if self.dead_reason:
                raise (CheckpointError if self.dead_kind == "CheckpointError" else PocketError)(self.dead_reason)
            pending = {rank for rank in pending if not self.store.check([f"ready/{rank}"])}
            time.sleep(0.05)

    def _rank_error(self, rank: int) -> tuple[str, str]:
        """(error type name, one line naming the rank and what happened to it)."""
        where = f"rank {rank} ({self.devices[rank]})"
        if self.store.check([f"error/{rank}"]):
            err = json.loads(self.store.get(f"error/{rank}"))
            return err["type"], f"{where} failed: {err['type']}: {err['message']}"
        code = self.workers[rank].returncode
        if code is not None and code < 0:
            return "", f"{where} was killed by {signal.Signals(-code).name}"
        return "", f"{where} exited with code {code}"

    # Any rank's death ends the group, while loading or serving. In the CLI it ends the program (exit code 2
    # for a checkpoint or option error, as main() gives, else 1); in a library user's process the group is
    # marked dead and every later call raises PocketError naming the rank.

    def _watch(self):
        while not self._closing:
            for rank, proc in self.workers.items():
                if proc.poll() is not None and not self._closing:
                    self._fail(*self._rank_error(rank))
                    return
            time.sleep(self.POLL_S)

    def _fail(self, kind: str, reason: str):
        self.dead_kind, self.dead_reason = kind, reason
        self._stop_workers(grace_s=0)
        if self.on_death is not None:
            self.on_death(reason)
        if _is_program():
            print(f"pocketllm: error: {reason}; stopped every rank", file=sys.stderr, flush=True)
            os._exit(2 if kind in ("PocketError", "CheckpointError") else 1)

    def _check_alive(self):
        if self.dead_reason:
            raise PocketError(f"the tensor-parallel group has stopped: {self.dead_reason}")
        if self._closing:
            raise PocketError("the tensor-parallel group is closed")

    def _failed(self, error: Exception) -> Exception:
        """A step raised. A peer's death surfaces as a collective error: wait for the watcher to name the rank.
        Anything else is rank 0's own failure, which also ends the group."""
        if self._closing:                  # close() stopped the workers under a step still in flight
            return PocketError("the tensor-parallel group is closed")
        deadline = time.time() + 3.0
        while self.dead_reason is None and time.time() < deadline:
            time.sleep(self.POLL_S)
        if self.dead_reason is None:
            self._fail("", f"rank 0 ({self.devices[0]}) failed: {type(error).__name__}: {error}")
            return error
        return PocketError(f"the tensor-parallel group has stopped: {self.dead_reason}")

    # The steps. Every rank runs the same Batch in the same order, so the all-reduces inside forward pair up.

    def run_batch(self, batch: Batch, cache: Cache) -> torch.Tensor:
        with self._lock:
            return self._step(batch, cache, ENGINE_CACHE)

    def _step(self, batch: Batch, cache: Cache, which: int) -> torch.Tensor:
        self._check_alive()
        try:
            sizes, payload = pack_batch(batch)
            self.comm.send_plan(PLAN_STEP, [which, *sizes], payload)
            return self.model.forward(batch, cache)                        # (R, V): full logits, rank 0 only
        except Exception as e:
            raise self._failed(e) from e

    def copy_state(self, cache: Cache, src_slot: int, dst_slot: int, src_block: int | None, dst_block: int | None):
        """copy_state (section 5) on every rank's engine cache: forked choices (n > 1) start from the parent's
        state. The engine calls this in place of copy_state when a group runs the model."""
        with self._lock:
            self._check_alive()
            try:
                self.comm.send_plan(PLAN_COPY, [src_slot, dst_slot, -1 if src_block is None else src_block,
                                                -1 if dst_block is None else dst_block])
            except Exception as e:
                raise self._failed(e) from e
            copy_state(cache, src_slot, dst_slot, src_block, dst_block)

    def logits(self, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """LLM.logits over the group: every rank runs the prefill chunks on a temporary cache of its own."""
        ids, bs, device = list(token_ids), self.opts.kv_block_size, self.devices[0]
        nblocks = -(-len(ids) // bs)
        with self._lock:
            self._set_scratch(nblocks)
            try:
                blocks, step, out = list(range(nblocks)), chunk_size or len(ids), []
                for s in range(0, len(ids), step):
                    n = min(step, len(ids) - s)
                    t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
                    batch = Batch(t(ids[s:s + n], torch.long), t(list(range(s, s + n)), torch.long),
                                  t([0, n], torch.int32), t([s + n], torch.int32), t([blocks], torch.int32),
                                  t([blocks[i // bs] * bs + i % bs for i in range(s, s + n)], torch.long),
                                  t([0], torch.int32), t(list(range(n)), torch.long),
                                  t([0] if s == 0 else [], torch.long))
                    out.append(self._step(batch, self._scratch, SCRATCH_CACHE))
            finally:
                if self.dead_reason is None and not self._closing:
                    self._set_scratch(0)
        return torch.cat(out).float().cpu()                                 # (len, V)

    def _set_scratch(self, nblocks: int):
        self._check_alive()
        try:
            self.comm.send_plan(PLAN_SCRATCH, [nblocks])
        except Exception as e:
            raise self._failed(e) from e
        self._scratch = allocate_cache(self.model.cfg, self.model.layers, nblocks, self.opts.kv_block_size, 1,
                                       self.kv_dtype, self.devices[0]) if nblocks else None

    # Shutdown: tell the workers to stop, give them a moment, then make sure.

    def close(self):
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        told = False
        if self.comm is not None and self.dead_reason is None and self._lock.acquire(timeout=2.0):
            try:
                self.comm.send_plan(PLAN_STOP, [])
                told = True
            except Exception:       # a worker already gone: the kill below covers it
                pass
            finally:
                self._lock.release()
        self._stop_workers(grace_s=5.0 if told else 0.0)

    def _stop_workers(self, grace_s: float):
        deadline = time.time() + grace_s
        for proc in self.workers.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def start_group(ckpt_dir, opts: EngineOptions, dtype: torch.dtype, kv_dtype: torch.dtype) -> RankGroup:
    """Start every rank of --devices and return once all have loaded their shard (rank 0 is this process)."""
    bs = opts.kv_block_size
    if _cache_blocks(opts) * bs < opts.max_context:     # Engine.__init__'s check, before any worker starts
        raise PocketError(f"--num-kv-blocks {_cache_blocks(opts)} x --kv-block-size {bs} cannot hold one "
                          f"sequence of --max-context {opts.max_context} tokens")
    group = RankGroup(ckpt_dir, opts, dtype, kv_dtype)
    try:
        group.start(ckpt_dir)
    except BaseException:
        group.close()
        raise
    return group


# A worker rank: load the shard, say so, then replay plans until told to stop.

def run_rank_worker(spec_json: str) -> int:
    spec = json.loads(spec_json)
    rank, world, parent = spec["rank"], spec["world"], spec["parent"]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent,), name="pocketllm-parent", daemon=True).start()
    store = dist.TCPStore("127.0.0.1", spec["port"], None, False, datetime.timedelta(days=1))
    try:
        opts = EngineOptions(**spec["options"])
        device = torch.device(spec["device"])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dtype, kv_dtype = _DTYPES[spec["dtype"]], _DTYPES[spec["kv_dtype"]]
        comm: list[Comm] = []          # set once every rank has loaded; forward only runs after that
        ops, _ = select_ops(opts, device)
        model = _load_rank_model(spec["ckpt"], opts, ops, dtype, device, rank, world,
                                 lambda x: comm[0].all_reduce(x), quiet=True)
        caches = {ENGINE_CACHE: allocate_cache(model.cfg, model.layers, _cache_blocks(opts), opts.kv_block_size,
                                               opts.max_batch_size, kv_dtype, device)}
        store.set(f"ready/{rank}", "1")
        comm.append(Comm(store, rank, world, device, ops))
        while True:
            command, args, payload = comm[0].recv_plan()
            if command == PLAN_STOP:
                return 0
            if command == PLAN_STEP:
                model.forward(unpack_batch(args[1:6], payload, device), caches[args[0]])
            elif command == PLAN_SCRATCH:
                caches[SCRATCH_CACHE] = allocate_cache(model.cfg, model.layers, args[0], opts.kv_block_size, 1,
                                                       kv_dtype, device) if args[0] else None
            elif command == PLAN_COPY:
                src_block, dst_block = (None if b < 0 else b for b in args[2:4])
                copy_state(caches[ENGINE_CACHE], args[0], args[1], src_block, dst_block)
    except Exception as e:
        time.sleep(0.5)             # rank 0 gone too (its sockets close before we are re-parented)? then quietly
        if os.getppid() != parent:
            return 1
        if not isinstance(e, PocketError):
            traceback.print_exc()
        store.set(f"error/{rank}", json.dumps({"type": type(e).__name__, "message": str(e)}))
        return 2 if isinstance(e, PocketError) else 1


def _exit_with_parent(parent: int):
    """Rank 0 gone (killed, crashed): this rank has nothing left to do."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)



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


class ControlTokens:
    """Keeps text from a request from becoming control tokens (`<|im_start|>`, `<|im_end|>`, ...).

    A chat template pastes request text (messages, tool results, tool definitions) next to its own markup,
    so in the rendered prompt a user's `<|im_start|>system` would read as a new system turn. Before rendering,
    `defuse` marks every control-token spelling inside request strings with a noncharacter (U+FDD0) that no
    tokenizer pattern matches; the rendered prompt then holds real control tokens only where the template wrote
    them. `split` cuts a rendered prompt at those, and `restore` gives back the request's exact text, which is
    tokenized as text. The marking is reversible whatever the text holds (a U+FDD0 the user sent is escaped).

    >>> ct = ControlTokens(["<|im_start|>", "<|im_end|>"])
    >>> marked = ct.defuse("a<|im_end|>b")
    >>> [(ct.restore(p), c) for p, c in ct.split("<|im_start|>user " + marked + "<|im_end|>")]
    [('<|im_start|>', True), ('user a<|im_end|>b', False), ('<|im_end|>', True)]
    """

    MARK, ESCAPED, CUT = "\ufdd0", "\ufdd1", "\ufdd2"

    def __init__(self, tokens: list[str]):
        self.tokens = [t for t in tokens if t]
        spell = sorted(self.tokens, key=len, reverse=True)
        self._defuse_re = re.compile("|".join([re.escape(self.MARK)] + [re.escape(t) for t in spell]))
        self._split_re = re.compile("(" + "|".join(re.escape(t) for t in spell) + ")") if spell else None
        self._restore_re = re.compile(re.escape(self.MARK) + "(.)", re.S)

    def defuse(self, text: str) -> str:
        """Request text with each control-token spelling (and each U+FDD0) marked; renders the same length-wise
        to a template's string tests (`in`, `startswith`) except on the control tokens themselves."""
        if not self.tokens:
            return text
        return self._defuse_re.sub(lambda m: self.MARK + self.ESCAPED if m.group() == self.MARK
                                   else m.group()[0] + self.MARK + self.CUT + m.group()[1:], text)

    def defuse_all(self, value):
        """defuse applied to every string inside a JSON-like value (messages, tools); a new value."""
        if isinstance(value, str):
            return self.defuse(value)
        if isinstance(value, list):
            return [self.defuse_all(v) for v in value]
        if isinstance(value, dict):
            return {self.defuse_all(k) if isinstance(k, str) else k: self.defuse_all(v) for k, v in value.items()}
        return value

    def marked(self, text: str) -> bool:
        return self.MARK in text

    def restore(self, text: str) -> str:
        return self._restore_re.sub(lambda m: self.MARK if m.group(1) == self.ESCAPED else
                                    ("" if m.group(1) == self.CUT else m.group()), text)

    def split(self, text: str) -> Iterator[tuple[str, bool]]:
        """(piece, is_control_token) in order; marked spellings are not control tokens."""
        if self._split_re is None:
            yield text, False
            return
        for i, piece in enumerate(self._split_re.split(text)):
            if piece:
                yield piece, i % 2 == 1


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
        self.control_tokens = ControlTokens([added[i].content for i in sorted(self.special_ids)])
        self._plain = tokenizers.Tokenizer.from_file(str(path))        # spells control tokens as text
        self._plain.encode_special_tokens = True
        self._byte_level = (spec.get("decoder") or {}).get("type") == "ByteLevel"
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._bytes_cache: dict[int, bytes] = {}
        self._texts: list[str] | None = None

    def encode(self, text: str) -> list[int]:
        """Token ids of text that may hold control tokens (a rendered prompt): control-token markup becomes
        control tokens, and text the template received from a request (marked by ControlTokens.defuse)
        becomes ordinary text tokens even where it spells a control token."""
        if not self.control_tokens.marked(text):
            return self._tok.encode(text, add_special_tokens=False).ids
        ids = []
        for piece, is_control in self.control_tokens.split(text):
            ids += [self._tok.token_to_id(piece)] if is_control else self.encode_text(self.control_tokens.restore(piece))
        return ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of user text: a control token spelled in it stays text (HF's split_special_tokens)."""
        return self._plain.encode(text, add_special_tokens=False).ids

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
import ast
import copy
import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils


# -----------------------------------------------------------------------------------------------
# Chat templates: the checkpoint's jinja2 template is untrusted code, so it runs in an immutable
# sandbox with the globals and filters HF templates expect.
# -----------------------------------------------------------------------------------------------

def _template_raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _template_strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def _template_tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """HF's tojson: keeps non-ASCII and key order, no HTML escaping (jinja2's own tojson does both)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}...{% endgeneration %}` (marks assistant text for training masks): renders the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace() refusing underscore names, which could shadow its internals (as HF does)."""

    def __init__(*args, **kwargs):
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.sandbox.SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class _TemplateSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Refuses unsafe attribute access at once; the stock sandbox renders it as an empty Undefined."""

    def unsafe_undefined(self, obj, attribute):
        raise jinja2.sandbox.SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _named_templates(source) -> dict[str, str]:
    """tokenizer_config.json's chat_template is a string or a list of {"name", "template"}."""
    if isinstance(source, str):
        return {"default": source}
    if isinstance(source, dict):
        return {str(k): v for k, v in source.items() if isinstance(v, str)}
    if isinstance(source, list):
        return {t["name"]: t["template"] for t in source
                if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
    return {}


_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe_fn", "description": "probe", "parameters": {
    "type": "object", "properties": {"probe_arg": {"type": "string"}}, "required": ["probe_arg"]}}}]
_PROBE_MESSAGES = [
    {"role": "user", "content": "probe"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call_probe", "type": "function", "function": {
        "name": "probe_fn", "arguments": {"probe_arg": "probe_value"}}}]},
    {"role": "tool", "tool_call_id": "call_probe", "content": "probe result"},
]


class ChatTemplate:
    """The checkpoint's chat template: messages (+ tools) -> prompt text.

    `source` is a template string or tokenizer_config.json's list of named templates ("tool_use" is used
    when tools are given, else "default"). `tool_parser` is the tool-call format the template teaches the
    model ("qwen_xml" or "hermes"), found by rendering a probe conversation; callers may override it.
    """

    def __init__(self, source, tokenizer=None):
        env = _TemplateSandbox(trim_blocks=True, lstrip_blocks=True,
                               extensions=[jinja2.ext.loopcontrols, _GenerationTag])
        env.filters["tojson"] = _template_tojson
        env.globals["raise_exception"] = _template_raise_exception
        env.globals["strftime_now"] = _template_strftime_now
        env.globals["namespace"] = _TemplateNamespace
        self.sources = _named_templates(source)
        if not self.sources:
            raise CheckpointError("chat template: expected a string or a list of {name, template} objects")
        self.templates = {}
        for name, text in self.sources.items():
            try:
                self.templates[name] = env.from_string(text)
            except jinja2.TemplateSyntaxError as exc:
                raise CheckpointError(f"chat template {name!r}: syntax error at line {exc.lineno}: {exc.message}") from None
        self.special_tokens = {key: getattr(tokenizer, key, None) for key in ("bos_token", "eos_token", "pad_token")}
        self.tokenizer = tokenizer
        self.tool_parser = self._detect_tool_parser()

    def _pick(self, tools):
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        return self.templates.get("default") or next(iter(self.templates.values()))

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt=True,
               continue_final_message=False, **template_kwargs) -> str:
        """Render in the sandbox. Any template failure is the request's fault: RequestError(param="messages")."""
        if add_generation_prompt and continue_final_message:
            raise RequestError("add_generation_prompt and continue_final_message cannot both be true",
                               param="continue_final_message")
        messages = messages_for_template(messages)
        control = getattr(self.tokenizer, "control_tokens", None)
        if control is not None:    # request text stays text, even where it spells <|im_start|>
            messages, tools, template_kwargs = control.defuse_all([messages, tools, template_kwargs])
        if continue_final_message:
            _tag_final_message(messages)
        context = {**self.special_tokens, **template_kwargs, "messages": messages, "tools": tools or None,
                   "add_generation_prompt": bool(add_generation_prompt)}
        try:
            text = self._pick(tools).render(**context)
        except Exception as exc:   # the template is untrusted code: whatever it raises is reported, not a 500
            message = str(exc).replace("\n", " ").strip() or type(exc).__name__
            raise RequestError(f"chat template error: {message}", param="messages") from None
        if continue_final_message:
            text = _cut_at_continue_tag(text)
        return text

    def _detect_tool_parser(self) -> str:
        try:
            text = self.render(_PROBE_MESSAGES, tools=_PROBE_TOOLS, add_generation_prompt=True)
        except RequestError:
            text = ""
        if "<function=probe_fn>" in text:
            return "qwen_xml"
        if re.search(r'<tool_call>\s*\{\s*"name"\s*:\s*"probe_fn"', text):
            return "hermes"
        sources = "\n".join(self.sources.values())
        if "<function=" not in sources and "<tool_call>" in sources:
            return "hermes"
        return "qwen_xml"


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "   # trailing space: shows whether the template trimmed the content


def _tag_final_message(messages: list[dict]) -> None:
    """continue_final_message (as HF): mark where the final message's content ends, then cut the prompt there."""
    if not messages or not isinstance(messages[-1], dict) or not isinstance(messages[-1].get("content"), str):
        raise RequestError("continue_final_message needs a final message with text content", param="messages")
    messages[-1]["content"] += _CONTINUE_TAG


def _cut_at_continue_tag(text: str) -> str:
    at = text.rfind(_CONTINUE_TAG.strip())
    if at == -1:
        raise RequestError("continue_final_message: the chat template does not render the final message's content",
                           param="messages")
    return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()


def load_chat_template(tokenizer, override_path: str | None = None, ckpt_dir=None) -> ChatTemplate | None:
    """The chat template: --chat-template FILE (a .jinja text, or a .json with "chat_template"), else the
    tokenizer's (chat_template.jinja before tokenizer_config.json), else those files in ckpt_dir. None if none."""
    source = None
    if override_path:
        path = Path(override_path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise PocketError(f"--chat-template {path}: cannot read it ({exc.strerror})") from None
        source = text
        if path.suffix == ".json":
            try:
                source = json.loads(text)["chat_template"]
            except (ValueError, KeyError, TypeError):
                raise PocketError(f"--chat-template {path}: a .json file must hold a \"chat_template\" key") from None
    else:
        source = getattr(tokenizer, "chat_template_source", None)
        if source is None and ckpt_dir is not None:
            source = _chat_template_from_dir(Path(ckpt_dir))
    return ChatTemplate(source, tokenizer) if source else None


def _chat_template_from_dir(ckpt_dir: Path):
    if (ckpt_dir / "chat_template.jinja").is_file():
        return (ckpt_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if (ckpt_dir / "tokenizer_config.json").is_file():
        try:
            return json.loads((ckpt_dir / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
        except (ValueError, AttributeError):
            raise CheckpointError(f"{ckpt_dir / 'tokenizer_config.json'}: not a JSON object") from None
    return None


def messages_for_template(messages: list[dict]) -> list[dict]:
    """A converted deep copy of OpenAI messages for the template; the request's own objects are untouched.

    - tool_calls[].function.arguments: a JSON string holding an object becomes that object (key order kept),
      as templates iterate it with `|items`; any other string (invalid JSON, or JSON that is not an object)
      is left as the string, so the template decides (a template that needs a mapping then fails with a 400).
    - content parts [{"type": "text", "text": ...}, ...] become their texts joined with "\\n"; other part
      types are refused. None content becomes "".

    >>> messages_for_template([{"role": "assistant", "content": None, "tool_calls": [
    ...     {"function": {"name": "f", "arguments": '{"b": 1, "a": 2}'}}]}])[0]["tool_calls"][0]["function"]
    {'name': 'f', 'arguments': {'b': 1, 'a': 2}}
    """
    converted = copy.deepcopy(messages)
    for i, message in enumerate(converted if isinstance(converted, list) else []):
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if content is None:
            message["content"] = ""
        elif isinstance(content, list):
            message["content"] = _flatten_content(content, f"messages[{i}].content")
        for call in message.get("tool_calls") or []:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                try:
                    arguments = json.loads(function["arguments"])
                except ValueError:
                    continue
                if isinstance(arguments, dict):
                    function["arguments"] = arguments
    return converted


def _flatten_content(parts: list, where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(f"{where}[{j}]: content parts of type {kind!r} are not supported (text only)",
                               param="messages")
    return "\n".join(texts)


def prompt_ends_in_reasoning(prompt_text: str) -> bool:
    """True when the prompt's last turn opened <think> and did not close it (the model starts in reasoning)."""
    turn = prompt_text[prompt_text.rfind("<|im_start|>"):] if "<|im_start|>" in prompt_text else prompt_text
    return turn.rfind("<think>") > turn.rfind("</think>")


# -----------------------------------------------------------------------------------------------
# Output parsing: generated text -> reasoning_content, content and tool_calls. One scanner reads the
# text left to right and commits only what more text cannot change. Streaming re-runs it over the
# accumulated text (resuming where it last committed) and sends the difference, so a stream always
# assembles to exactly the non-streamed parse.
# -----------------------------------------------------------------------------------------------

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"
_FUNC_OPEN, _FUNC_CLOSE = "<function=", "</function>"
_PARAM_OPEN, _PARAM_CLOSE = "<parameter=", "</parameter>"
_VALUE_ENDS = (_PARAM_CLOSE, _PARAM_OPEN, _FUNC_CLOSE, _CALL_CLOSE)   # an XML value ends at the first of these
_VALUE_END_RE = re.compile("|".join(map(re.escape, _VALUE_ENDS)))
_CALL_MARKERS = (_PARAM_OPEN, _PARAM_CLOSE, _FUNC_CLOSE, _CALL_CLOSE, _CALL_OPEN, _FUNC_OPEN)
_MAX_NAME = 256                       # a "name" longer than this is prose, not markup
_HERMES_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\\n]|\\.)*)"')
_HERMES_HEAD_PREFIX = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*(?::\s*(?:"(?:[^"\\\n]|\\.)*\\?)?)?)?)?)?)?)?)?\Z')
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_JSON_DECODER = json.JSONDecoder(strict=False)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _is_partial(text: str, i: int, marker: str) -> bool:
    """text[i:] is a proper prefix of marker: more text could complete it."""
    return len(text) - i < len(marker) and marker.startswith(text[i:])


def _held_start(text: str, start: int, markers) -> int:
    """Where an unfinished marker may begin at the end of text (len(text) if none). Markers start with '<'."""
    i = text.find("<", max(start, len(text) - max(map(len, markers)) + 1))
    while i != -1:
        if any(_is_partial(text, i, marker) for marker in markers):
            return i
        i = text.find("<", i + 1)
    return len(text)


def _strip_format_newlines(raw: str) -> str:
    """An XML value sits on its own lines: drop the one newline after <parameter=P> and the one before </parameter>."""
    raw = raw[1:] if raw.startswith("\n") else raw
    return raw[:-1] if raw.endswith("\n") else raw


def _member_json(key: str, value) -> str:
    return json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)


# Argument values by JSON-schema type. A string parameter keeps the model's raw text; anything else is parsed,
# and a value that does not parse as its declared type stays the raw string (never an exception).

def _no_json_constant(name):
    raise ValueError(f"{name} is not JSON")


def _strict_json(text: str):
    return json.loads(text, parse_constant=_no_json_constant)


def _json_or_literal(text: str):
    """JSON, else a Python literal (models sometimes write {'a': 1}); must serialize back to JSON."""
    try:
        return _strict_json(text)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(text)
        json.dumps(value, allow_nan=False)
        return value
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None


def _as_type(text: str, kind: str):
    """(True, value) when text reads as a value of JSON-schema type `kind`, else (False, None)."""
    if kind == "string":
        return True, text
    word = text.strip()
    if kind == "boolean" and word.lower() in ("true", "false"):
        return True, word.lower() == "true"
    if kind == "null" and word.lower() in ("null", "none"):
        return True, None
    if kind in ("integer", "number"):
        try:
            value = _strict_json(word)
        except ValueError:
            return False, None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False, None
        if kind == "integer" and isinstance(value, float):
            return (True, int(value)) if value.is_integer() else (False, None)
        return True, value
    if kind in ("object", "array"):
        value = _json_or_literal(word)
        return (True, value) if isinstance(value, dict if kind == "object" else list) else (False, None)
    return False, None


def _json_or_text(text: str):
    try:
        return _strict_json(text.strip())
    except ValueError:
        return text


def _convert_value(text: str, types: list[str] | None):
    """The value of a parameter whose schema accepts `types` (tried in order); None = not in the schema."""
    if not types:
        return _json_or_text(text)
    for kind in types:
        ok, value = _as_type(text, kind)
        if ok:
            return value
    return text


def _json_type_name(value) -> str:
    if isinstance(value, bool):
        return "boolean"
    return {int: "integer", float: "number", str: "string", dict: "object", list: "array"}.get(type(value), "null")


def _schema_types(schema) -> list[str]:
    """The JSON-schema types a parameter accepts, in the order to try them: type / type lists / anyOf / oneOf,
    else the types of its enum or const values."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    if isinstance(kind, str):
        kinds = [kind]
    elif isinstance(kind, list):
        kinds = [k for k in kind if isinstance(k, str)]
    elif isinstance(schema.get("anyOf"), list) or isinstance(schema.get("oneOf"), list):
        kinds = [k for sub in (schema.get("anyOf") or schema.get("oneOf")) for k in _schema_types(sub)]
    elif isinstance(schema.get("enum"), list) or "const" in schema:
        kinds = [_json_type_name(v) for v in schema.get("enum") or [schema.get("const")]]
    else:
        kinds = ["object"] if "properties" in schema else ["array"] if "items" in schema else []
    return list(dict.fromkeys(kinds))


def _tool_schemas(tools) -> dict[str, dict]:
    """function name -> its parameters' "properties" (empty when it declares none)."""
    schemas = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            schemas[function["name"]] = properties if isinstance(properties, dict) else {}
    return schemas


class _ParsedCall:
    """One tool call as parsed so far: its name and its arguments as JSON members in generation order."""

    def __init__(self, name: str):
        self.name = name
        self.members: list[str] = []   # '"key": value' JSON texts
        self.keys: set[str] = set()
        self.open_member = ""           # the member whose string value is still arriving (not committed)
        self.closed = False

    def add(self, key: str, value) -> None:
        if key not in self.keys:        # a repeated parameter keeps its first value (it may be streamed already)
            self.keys.add(key)
            self.members.append(_member_json(key, value))

    def arguments(self) -> str:
        """The arguments JSON text so far: "" before the first member, closed with "}" once the call ends."""
        parts = self.members + ([self.open_member] if self.open_member and not self.closed else [])
        if not parts and not self.closed:
            return ""
        return "{" + ", ".join(parts) + ("}" if self.closed else "")


class _OutputScan:
    """The scanner. `run(text, final)` continues from `pos`; every step either commits text it has fully
    understood (and advances) or returns False to wait for more. With final=True nothing waits: unfinished
    markup is resolved the forgiving way (a truncated call is closed with what it has, an unconfirmed
    <tool_call> is text). Modes: start, think, text (prose); xml, call_end, hermes_keys, hermes_args,
    call_junk (inside a call)."""

    def __init__(self, schemas: dict, tool_parser: str, in_reasoning: bool, parse_tools: bool):
        self.schemas, self.tool_parser = schemas, tool_parser
        self.pos, self.mode = 0, "think" if in_reasoning else "start"
        self.reasoning, self.content = "", ""      # raw; shown stripped of surrounding whitespace
        self.calls: list[_ParsedCall] = []
        markers = [_THINK_CLOSE]
        if parse_tools:
            markers += [_CALL_OPEN] + ([_FUNC_OPEN] if tool_parser == "qwen_xml" else [])
        self.markers = markers
        self.marker_re = re.compile("|".join(map(re.escape, markers)))

    def run(self, text: str, final: bool) -> None:
        if self.calls:
            self.calls[-1].open_member = ""
        while self.pos < len(text) and getattr(self, "_" + self.mode)(text, final):
            pass
        if final and self.mode not in ("start", "think", "text"):
            self.calls[-1].closed = True
            self.mode = "text"

    # Prose: reasoning and content, and the call headers that end them.

    def _start(self, text, final):
        rest = text[self.pos:].lstrip()
        if rest.startswith(_THINK_OPEN):         # the template did not pre-fill <think>: the model opens it
            self.pos, self.mode = len(text) - len(rest) + len(_THINK_OPEN), "think"
            return True
        if not final and _THINK_OPEN.startswith(rest):
            return False
        self.mode = "text"
        return True

    def _think(self, text, final):
        return self._prose(text, final, "reasoning")

    def _text(self, text, final):
        return self._prose(text, final, "content")

    def _prose(self, text, final, field):
        match = self.marker_re.search(text, self.pos)
        end = match.start() if match else len(text) if final else _held_start(text, self.pos, self.markers)
        setattr(self, field, getattr(self, field) + text[self.pos:end])
        self.pos = end
        if not match:
            return False
        if match.group() == _THINK_CLOSE:        # ends reasoning; a stray one in content is dropped
            self.pos += len(_THINK_CLOSE)
            self.mode = "text"
            return True
        header = self._call_header(text, self.pos, final)
        if header is None:                        # could still become a call: hold it back
            return False
        if header is False:                       # a literal <tool_call> in prose stays text
            setattr(self, field, getattr(self, field) + match.group())
            self.pos += len(match.group())
            return True
        self.pos, name, self.mode = header       # a call also ends reasoning
        self.calls.append(_ParsedCall(name))
        return True

    def _call_header(self, text, at, final):
        """(end, name, mode) for a confirmed call header at `at`, None while undecided, False if not a call."""
        if not text.startswith(_CALL_OPEN, at):
            return self._xml_header(text, at, final, bare=True)
        j = _skip_ws(text, at + len(_CALL_OPEN))
        if text.startswith(_FUNC_OPEN, j):
            return self._xml_header(text, j, final, bare=False)
        if text.startswith("{", j):
            head = _HERMES_HEAD.match(text, j)
            if head:
                try:
                    return head.end(), json.loads('"' + head.group(1) + '"'), "hermes_keys"
                except ValueError:
                    return False
            return None if not final and _HERMES_HEAD_PREFIX.match(text, j) else False
        return None if not final and (j == len(text) or _is_partial(text, j, _FUNC_OPEN)) else False

    def _xml_header(self, text, at, final, bare):
        start = at + len(_FUNC_OPEN)
        close = text.find(">", start, start + _MAX_NAME + 1)
        if close == -1:
            seen = text[start:start + _MAX_NAME + 1]
            return None if not (final or len(seen) > _MAX_NAME or "\n" in seen or "<" in seen) else False
        name = text[start:close].strip()
        if not name or "\n" in name or "<" in name:
            return False
        if bare and self.schemas and name not in self.schemas:   # a bare <function=X> only for a known tool
            return False
        return close + 1, name, "xml"

    # Qwen XML calls: <parameter=P>\nVALUE\n</parameter> ... </function> </tool_call>.

    def _xml(self, text, final):
        call = self.calls[-1]
        j = _skip_ws(text, self.pos)
        if j == len(text):
            return False
        if text.startswith(_PARAM_OPEN, j):
            return self._xml_parameter(text, j, final, call)
        if text.startswith(_PARAM_CLOSE, j):                   # a duplicate </parameter>
            self.pos = j + len(_PARAM_CLOSE)
            return True
        if text.startswith(_FUNC_CLOSE, j):
            call.closed, self.pos, self.mode = True, j + len(_FUNC_CLOSE), "call_end"
            return True
        if text.startswith(_CALL_CLOSE, j):                    # </function> missing
            call.closed, self.pos, self.mode = True, j + len(_CALL_CLOSE), "text"
            return True
        if text.startswith(_CALL_OPEN, j) or text.startswith(_FUNC_OPEN, j):   # the next call: this one ended
            call.closed, self.pos, self.mode = True, j, "text"
            return True
        if not final and any(_is_partial(text, j, marker) for marker in _CALL_MARKERS):
            self.pos = j
            return False
        after = text.find("<", j + 1)                           # stray text inside a call is dropped
        self.pos = len(text) if after == -1 else after
        return True

    def _xml_parameter(self, text, j, final, call):
        start = j + len(_PARAM_OPEN)
        close = text.find(">", start, start + _MAX_NAME + 1)
        if close == -1:
            seen = text[start:start + _MAX_NAME + 1]
            if final or len(seen) > _MAX_NAME or "\n" in seen:   # not a parameter header
                self.pos = start
                return True
            self.pos = j
            return False
        key, start = text[start:close].strip(), close + 1
        types = self._param_types(call.name, key)
        end = _VALUE_END_RE.search(text, start)
        if end:
            call.add(key, _convert_value(_strip_format_newlines(text[start:end.start()]), types))
            self.pos = end.end() if end.group() == _PARAM_CLOSE else end.start()
            return True
        value = _strip_format_newlines(text[start:_held_start(text, start, _VALUE_ENDS)])
        if final:                                              # truncated: keep what arrived
            call.add(key, _convert_value(value, types))
            self.pos = len(text)
            return True
        if types and types[0] == "string" and key not in call.keys:   # stream a string as it grows
            call.open_member = _member_json(key, value)[:-1]
        self.pos = j
        return False

    def _param_types(self, function, key):
        properties = self.schemas.get(function)
        return _schema_types(properties[key]) if properties is not None and key in properties else None

    def _call_end(self, text, final):
        j = _skip_ws(text, self.pos)
        if text.startswith(_CALL_CLOSE, j):
            self.pos, self.mode = j + len(_CALL_CLOSE), "text"
            return True
        if j == len(text) or not final and _is_partial(text, j, _CALL_CLOSE):
            return False
        self.mode = "text"                                      # </tool_call> missing
        return True

    # Hermes JSON calls: {"name": ..., "arguments": {...}}, the arguments streamed member by member.

    def _hermes_keys(self, text, final):
        return self._hermes_object(text, final, inner=False)

    def _hermes_args(self, text, final):
        return self._hermes_object(text, final, inner=True)

    def _hermes_object(self, text, final, inner):
        """One member of the call object {"name", "arguments"} (outer) or of its arguments object (inner)."""
        call = self.calls[-1]
        j = _skip_ws(text, self.pos)
        if j == len(text):
            return False
        if text[j] in ",}":
            if text[j] == "}":
                call.closed, self.mode = True, "hermes_keys" if inner else "call_end"
            self.pos = j + 1
            return True
        member = self._json_member(text, j, final)
        if member is None:
            return False
        if member is False:
            return self._junk(call)
        key, v = member
        arguments = not inner and key in ("arguments", "parameters")
        if arguments and text[v] == "{" and not call.closed:
            self.pos, self.mode = v + 1, "hermes_args"
            return True
        if inner and text[v] == '"' and not _JSON_STRING.match(text, v):   # a string value still arriving: stream it
            value = _json_string_prefix(text, v + 1)
            if final:
                call.add(key, value)
                self.pos = len(text)
                return True
            if key not in call.keys:
                call.open_member = _member_json(key, value)[:-1]
            return False
        value = self._json_value(text, v, final)
        if value is None:
            return False
        if value is False:
            return self._junk(call)
        if inner:
            call.add(key, value[0])
        elif arguments and isinstance(value[0], str):                    # arguments sent as a JSON string
            inner_value = _json_or_text(value[0])
            for name, item in (inner_value.items() if isinstance(inner_value, dict) else ()):
                call.add(name, item)
        self.pos = value[1]
        return True

    def _json_member(self, text, j, final):
        """('key', value start) for '"key" :' at j; None while incomplete, False if malformed."""
        key = _JSON_STRING.match(text, j) if text[j] == '"' else None
        if key is None:
            return None if text[j] == '"' and not final else False
        colon = _skip_ws(text, key.end())
        if colon == len(text) or text[colon] == ":" and _skip_ws(text, colon + 1) == len(text):
            return None if not final else False
        if text[colon] != ":":
            return False
        try:
            return _JSON_DECODER.decode(key.group()), _skip_ws(text, colon + 1)
        except ValueError:
            return False

    def _json_value(self, text, v, final):
        """(value, end) for the JSON value at v; None while it may still be arriving, False if malformed."""
        try:
            value, end = _JSON_DECODER.raw_decode(text, v)
        except ValueError:
            # unfinished, unless the call's closing tag has already arrived
            return None if not final and text.find(_CALL_CLOSE, v) == -1 else False
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not final and \
                (end == len(text) or text[end] in "0123456789.eE+-"):
            return None                                         # a number may go on: 1 -> 12, 0 -> 0.5
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return value, end

    def _junk(self, call):
        call.closed, self.mode = True, "call_junk"
        return True

    def _call_junk(self, text, final):
        """After malformed call JSON: drop text up to </tool_call>."""
        end = text.find(_CALL_CLOSE, self.pos)
        if end != -1:
            self.pos, self.mode = end + len(_CALL_CLOSE), "text"
            return True
        self.pos = len(text) if final else _held_start(text, self.pos, (_CALL_CLOSE,))
        return False


def _json_string_prefix(text: str, start: int) -> str:
    """The decoded part of an unterminated JSON string body text[start:], cut before an unfinished escape."""
    body = text[start:]
    for cut in range(len(body), max(len(body) - 7, -1), -1):
        try:
            value = _JSON_DECODER.decode('"' + body[:cut] + '"')
        except ValueError:
            continue
        return value[:-1] if value and "\ud800" <= value[-1] <= "\udbff" else value   # half a surrogate pair
    return ""


class ChatOutputParser:
    """Splits one choice's generated text into reasoning_content, content and tool_calls, streaming or not.

    feed(text) -> OpenAI delta fragments; finish() flushes what was held back; message() is the non-streamed
    parse of everything fed. Text is held back only while it could still be markup (a partial <tool_call>,
    a header not yet confirmed by <function=NAME> or {"name": ...}) or whitespace that is trimmed around
    content. Calls in either form are recognised after <tool_call>; tool_parser ("qwen_xml" | "hermes")
    decides whether a bare <function=NAME> (no <tool_call>, NAME a known tool) counts as a call.

    >>> p = ChatOutputParser(None, "qwen_xml", in_reasoning=True)
    >>> p.feed("Paris?\\n</think>\\n\\nIt is ") + p.feed("Paris.") + p.finish()
    [{'reasoning_content': 'Paris?'}, {'content': 'It is'}, {'content': ' Paris.'}]
    """

    def __init__(self, tools: list[dict] | None, tool_parser: str, in_reasoning: bool, parse_tools: bool = True):
        if tool_parser not in ("qwen_xml", "hermes"):
            raise PocketError(f"unknown tool parser {tool_parser!r}: use qwen_xml or hermes")
        self._options = (_tool_schemas(tools), tool_parser, in_reasoning, parse_tools)
        self._scan = _OutputScan(*self._options)
        self._text = ""
        self._ids: list[str] = []
        self._sent_reasoning = self._sent_content = ""
        self._sent_arguments: list[str] = []

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._scan.calls)

    def feed(self, text: str) -> list[dict]:
        self._text += text
        self._scan.run(self._text, final=False)
        return self._deltas()

    def finish(self) -> list[dict]:
        self._scan.run(self._text, final=True)
        return self._deltas()

    def message(self) -> dict:
        scan = _OutputScan(*self._options)
        scan.run(self._text, final=True)
        calls = [{"id": self._id(i), "type": "function", "function": {"name": call.name, "arguments": call.arguments()}}
                 for i, call in enumerate(scan.calls)]
        content = scan.content.strip()
        return {"content": content or (None if calls else ""), "reasoning_content": scan.reasoning.strip() or None,
                "tool_calls": calls or None}

    def _id(self, index: int) -> str:
        while len(self._ids) <= index:
            self._ids.append("call_" + uuid.uuid4().hex[:24])
        return self._ids[index]

    def _deltas(self) -> list[dict]:
        """What the scan shows now minus what was already sent. Everything shown only ever grows."""
        deltas = []
        reasoning, content = self._scan.reasoning.strip(), self._scan.content.strip()
        if len(reasoning) > len(self._sent_reasoning) and reasoning.startswith(self._sent_reasoning):
            deltas.append({"reasoning_content": reasoning[len(self._sent_reasoning):]})
            self._sent_reasoning = reasoning
        if len(content) > len(self._sent_content) and content.startswith(self._sent_content):
            deltas.append({"content": content[len(self._sent_content):]})
            self._sent_content = content
        for index, call in enumerate(self._scan.calls):
            if index == len(self._sent_arguments):
                deltas.append({"tool_calls": [{"index": index, "id": self._id(index), "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
                self._sent_arguments.append("")
            arguments, sent = call.arguments(), self._sent_arguments[index]
            if len(arguments) > len(sent) and arguments.startswith(sent):
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": arguments[len(sent):]}}]})
                self._sent_arguments[index] = arguments
        return deltas


# -----------------------------------------------------------------------------------------------
# tool_choice by constrained decoding. A logits processor runs a small program per choice: it forces the
# call's markup token by token and lets the model choose only where the schema leaves a choice (which
# tool, which optional parameter, the values under masks shaped by their types), and it keeps enough of
# max_tokens in reserve to close the call (closing reasoning early if it must).
# -----------------------------------------------------------------------------------------------

_XML_VALUE_CLOSE = "\n</parameter>\n"
_XML_CALL_CLOSE = "</function>\n</tool_call>"
_THINK_FORCED_CLOSE = "\n</think>"
_HERMES_CALL_CLOSE = "}}\n</tool_call>"
_VALUE_TOKEN_CAP = {"integer": 12, "number": 16, "string": 256, "object": 256, "array": 256}
_NUMBER_CHARS = frozenset("0123456789.-+eE")
_BIG_EXPONENT = re.compile(r"[eE][+-]?\d{3}")
_EOS = -1   # an alternative of _choose that stands for "any end-of-sequence token"


def _number_state(text: str, integer: bool):
    """The state of a JSON-number automaton after `text` (None: not a number prefix). Complete states:
    'zero', 'int', 'frac', 'exp_digits'."""
    state = "start"
    for c in text:
        if c == "-" and state == "start":
            state = "sign"
        elif c.isdigit() and c.isascii():
            if state in ("start", "sign"):
                state = "zero" if c == "0" else "int"
            elif state == "zero":
                return None
            elif state in ("int", "frac", "exp_digits"):
                pass
            elif state == "dot":
                state = "frac"
            elif state in ("exp", "exp_sign"):
                state = "exp_digits"
        elif c == "." and state in ("zero", "int") and not integer:
            state = "dot"
        elif c in "eE" and state in ("zero", "int", "frac") and not integer:
            state = "exp"
        elif c in "+-" and state == "exp":
            state = "exp_sign"
        else:
            return None
    return state


class _TokenFacts:
    """What the masks need to know about every token of a vocabulary, computed once per tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.texts = tokenizer.token_texts()
        self.free = {   # tokens that may appear inside a string value: raw (Qwen XML) or in a JSON string (Hermes)
            "xml": torch.tensor([bool(t) and "<" not in t for t in self.texts]),
            "json": torch.tensor([bool(t) and "<" not in t and '"' not in t and "\\" not in t and
                                  all(c >= " " for c in t) for t in self.texts])}
        self.quote = [i for i, t in enumerate(self.texts) if t == '"']
        self.numeric = [i for i, t in enumerate(self.texts) if t and set(t) <= _NUMBER_CHARS]
        self.openers = {c: [i for i, t in enumerate(self.texts) if t.lstrip().startswith(c) and "<" not in t]
                        for c in "{["}
        self.close_any, self.close_lt = {}, {}   # token id -> the rest of _XML_VALUE_CLOSE after it
        for i, t in enumerate(self.texts):
            for skip in (0, 1):                  # the closer with or without its leading newline
                if t and _XML_VALUE_CLOSE.startswith(t, skip):
                    self.close_any.setdefault(i, _XML_VALUE_CLOSE[skip + len(t):])
                    if "<" in t:
                        self.close_lt.setdefault(i, _XML_VALUE_CLOSE[skip + len(t):])
        self.call_open = [i for i, t in enumerate(self.texts) if t == _CALL_OPEN]
        self._encoded: dict[str, list[int]] = {}
        self._masks: dict[tuple, torch.Tensor] = {}

    def text(self, token_id: int) -> str:
        return self.texts[token_id] if 0 <= token_id < len(self.texts) else ""

    def encode(self, text: str) -> list[int]:
        ids = self._encoded.get(text)
        if ids is None:
            ids = self._encoded[text] = self.tokenizer.encode(text)
        return ids

    def free_mask(self, kind: str, size: int, device) -> torch.Tensor:
        """free[kind] padded (or cut) to the logits' length, on their device."""
        mask = self._masks.get((kind, size, str(device)))
        if mask is None:
            mask = torch.zeros(size, dtype=torch.bool)
            n = min(size, len(self.texts))
            mask[:n] = self.free[kind][:n]
            mask = self._masks[(kind, size, str(device))] = mask.to(device)
        return mask


_TOKEN_FACTS: dict[int, _TokenFacts] = {}


def _token_facts(tokenizer) -> _TokenFacts:
    facts = _TOKEN_FACTS.get(id(tokenizer))
    if facts is None or facts.tokenizer is not tokenizer:
        facts = _TOKEN_FACTS[id(tokenizer)] = _TokenFacts(tokenizer)
    return facts


@dataclass
class _Allowed:
    """A constraint on the next token: the string-value tokens of `free` ("xml" | "json") and/or the ids in
    `allow`; neither = all tokens but those in `ban`."""
    allow: list[int] | None = None
    free: str | None = None
    ban: list[int] = field(default_factory=list)

    def apply(self, logits: torch.Tensor, facts: _TokenFacts) -> torch.Tensor:
        if self.allow is None and not self.free:
            out = logits.clone()
        else:
            out = logits.masked_fill(~facts.free_mask(self.free, logits.numel(), logits.device), float("-inf")) \
                if self.free else torch.full_like(logits, float("-inf"))
            ids = [i for i in self.allow or () if i < logits.numel()]
            index = torch.tensor(ids, dtype=torch.long, device=logits.device)
            if not self.free and not bool(torch.isfinite(logits[index]).any()):
                return logits          # everything we allow is banned by another constraint: do not block sampling
            out[index] = logits[index]
        ban = [i for i in self.ban if i < logits.numel()]
        if ban:
            out[torch.tensor(ban, device=logits.device)] = float("-inf")
        out[len(facts.texts):] = float("-inf")                     # padding rows of the embedding are no tokens
        return out


class _Deviation(Exception):
    """The sampled token is not one the program allowed (another constraint won): stop constraining."""


class _CallProgram:
    """The constraint program of one choice: a generator that yields _Allowed and receives the sampled ids.
    `used` counts the tokens generated so far."""

    def __init__(self, plan: "_ToolChoicePlan"):
        self.plan, self.facts, self.used = plan, plan.facts, 0
        self._gen = plan.program(self)
        self.constraint = next(self._gen)

    def advance(self, token_id: int) -> None:
        self.used += 1
        if self._gen is None:
            return
        try:
            self.constraint = self._gen.send(token_id)
        except (StopIteration, _Deviation):
            self._gen, self.constraint = None, None

    def left(self) -> int:
        return self.plan.max_tokens - self.used

    # Building blocks, each a sub-generator.

    def choose(self, alternatives: list, taken: tuple = ()):
        """Let the model pick one alternative (texts, or _EOS), forced token by token in canonical
        tokenization; returns its index. `taken`: its first tokens, already sampled."""
        seqs = [[_EOS] if a is _EOS else self.facts.encode(a) for a in alternatives]
        alive = [i for i, s in enumerate(seqs) if len(s) > len(taken) and tuple(s[:len(taken)]) == tuple(taken)]
        depth = len(taken)
        while True:
            done = [i for i in alive if len(seqs[i]) == depth]
            if done:
                return done[0]
            nexts = {seqs[i][depth] for i in alive}
            allow = sorted((nexts - {_EOS}) | (set(self.plan.eos_ids) if _EOS in nexts else set()))
            token = yield _Allowed(allow=allow)
            if token in self.plan.eos_ids:
                token = _EOS
            alive = [i for i in alive if seqs[i][depth] == token]
            if not alive:
                raise _Deviation
            depth += 1

    def force(self, text: str):
        if text:
            yield from self.choose([text])

    def think(self, reserve: int):
        """Free reasoning (no end-of-sequence, no <tool_call>) until </think>, or until only `reserve`
        tokens are left: then close it ourselves."""
        tail, ban = "", self.plan.eos_ids + self.facts.call_open
        while self.left() - 1 >= reserve + self.plan.cost(_THINK_FORCED_CLOSE):
            token = yield _Allowed(ban=ban)
            tail = (tail + self.facts.text(token))[-2 * len(_THINK_CLOSE):]
            if _THINK_CLOSE in tail:
                return
        yield from self.force(_THINK_FORCED_CLOSE)

    def xml_value(self, schema, reserve: int):
        """One parameter value and its closing tag, shaped by the schema; `reserve` = tokens needed after it."""
        kind, choices = _forced_value_shape(schema)
        if choices is not None:
            yield from self.choose([c + _XML_VALUE_CLOSE for c in choices])
            return
        text, count, close_cost = "", 0, self.plan.cost(_XML_VALUE_CLOSE) + 1
        closers = self.facts.close_lt if kind == "string" else self.facts.close_any
        while True:
            done = _value_done(kind, text)
            if count >= _VALUE_TOKEN_CAP[kind] or self.left() - 1 < reserve + close_cost:
                fix = "0" if kind in ("integer", "number") and not text[-1:].isdigit() else ""
                yield from self.force(fix + _XML_VALUE_CLOSE)
                return
            token = yield self._value_allowed(kind, text, done, closers)
            count += 1
            if done and token in closers:
                yield from self.force(closers[token])
                return
            text += self.facts.text(token)

    def _value_allowed(self, kind, text, done, closers) -> _Allowed:
        ban = self.plan.eos_ids
        if kind in ("integer", "number"):
            return _Allowed(allow=self._number_tokens(kind, text) + (list(closers) if done else []), ban=ban)
        if kind in ("object", "array"):
            if done:
                return _Allowed(allow=list(closers), ban=ban)
            if not text.strip():
                return _Allowed(allow=self.facts.openers["{" if kind == "object" else "["], ban=ban)
        return _Allowed(free="xml", allow=list(closers) if done else [], ban=ban)

    def _number_tokens(self, kind: str, text: str) -> list[int]:
        """The tokens that keep `text` a prefix of a JSON number (of an integer), exponents under 3 digits
        (1e999 would parse as infinity)."""
        return [i for i in self.facts.numeric if _number_state(text + self.facts.texts[i], kind == "integer")
                and not _BIG_EXPONENT.search(text + self.facts.texts[i])]

    def json_string(self, reserve: int):
        """A Hermes string value: "text" without quotes, backslashes, control characters or '<'."""
        yield from self.force('"')
        text, count = "", 0
        while count < _VALUE_TOKEN_CAP["string"] and self.left() - 1 >= reserve + 1:
            token = yield _Allowed(free="json", allow=self.facts.quote if text.strip() else [], ban=self.plan.eos_ids)
            if token in self.facts.quote:
                return
            text, count = text + self.facts.text(token), count + 1
        yield from self.force('"')

    def json_number_then(self, kind: str, alternatives: list, reserve: int):
        """A Hermes number value, which ends where the model starts one of `alternatives` (what may follow
        it: a separator or the closing); returns the index of that alternative."""
        text, count = "", 0
        firsts = {self.facts.encode(a)[0] for a in alternatives}
        while True:
            done = _value_done(kind, text)
            if count >= _VALUE_TOKEN_CAP[kind] or self.left() - 1 < reserve + 1:
                yield from self.force("0" if not text[-1:].isdigit() else "")
                return (yield from self.choose(alternatives))
            allow = self._number_tokens(kind, text) + (sorted(firsts) if done else [])
            token = yield _Allowed(allow=allow, ban=self.plan.eos_ids)
            if done and token in firsts:
                return (yield from self.choose(alternatives, taken=(token,)))
            text, count = text + self.facts.text(token), count + 1


def _forced_value_shape(schema, json_form: bool = False) -> tuple[str, list[str] | None]:
    """(kind, choices): the value kind a forced call writes for this schema, or the fixed texts to pick from
    (as raw text for Qwen XML, as JSON for Hermes)."""
    schema = schema if isinstance(schema, dict) else {}
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else [schema["const"]] if "const" in schema else None
    if values:
        return "string", [v if isinstance(v, str) and not json_form else json.dumps(v, ensure_ascii=False)
                          for v in values]
    types = [t for t in _schema_types(schema) if t in ("string", "integer", "number", "boolean", "object", "array", "null")]
    kind = next((t for t in types if t != "null"), "null" if types else "string")
    if kind == "boolean":
        return kind, ["true", "false"]
    if kind == "null":
        return kind, ["null"]
    return kind, None


def _value_done(kind: str, text: str) -> bool:
    """Whether the value so far may be closed."""
    if kind in ("integer", "number"):
        return _number_state(text, kind == "integer") in ("zero", "int", "frac", "exp_digits")
    if kind in ("object", "array"):
        return _as_type(text, kind)[0]
    return bool(text.strip())


class _ToolChoicePlan:
    """Everything a program needs that is shared by the choices of one request."""

    def __init__(self, facts, functions, mode, names=(), parallel=False, in_reasoning=False, max_tokens=0,
                 eos_ids=(), tool_parser="qwen_xml"):
        self.facts, self.functions, self.mode, self.names, self.parallel = facts, functions, mode, list(names), parallel
        self.in_reasoning, self.max_tokens, self.eos_ids = in_reasoning, max_tokens, list(eos_ids)
        self.tool_parser = tool_parser

    def program(self, run: _CallProgram):
        return {"force": self._forced_calls, "one_call": self._one_call, "no_call": self._no_call}[self.mode](run)

    def cost(self, text: str) -> int:
        """Tokens `text` takes in canonical tokenization (what the programs force)."""
        return len(self.facts.encode(text))

    def header(self, lead: str, name: str) -> str:
        if self.tool_parser == "hermes":
            return f'{lead}<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {{'
        return f"{lead}<tool_call>\n<function={name}>\n"

    def call_cost(self, lead: str, name: str) -> int:
        """Tokens the smallest call to `name` takes, the end-of-sequence token included."""
        return self.cost(self.header(lead, name)) + self.min_arguments_cost(name) + 1

    def min_arguments_cost(self, name, params=None) -> int:
        """Tokens the smallest valid arguments of `name` take (its required parameters), closers included."""
        properties, required = self.functions[name]
        hermes = self.tool_parser == "hermes"
        total = self.cost(_HERMES_CALL_CLOSE if hermes else _XML_CALL_CLOSE)
        for p in required if params is None else params:
            kind, choices = _forced_value_shape(properties.get(p), json_form=hermes)
            if hermes:
                value = max(map(self.cost, choices)) if choices else 3 + self.cost("{}")
                total += self.cost(", " + json.dumps(p, ensure_ascii=False) + ": ") + value
            else:
                value = max(self.cost(c + _XML_VALUE_CLOSE) for c in choices) if choices else \
                    2 + self.cost(_XML_VALUE_CLOSE)
                total += self.cost(f"<parameter={p}>\n") + value
        return total

    def _forced_calls(self, run: _CallProgram):
        """tool_choice required / named: [reasoning] <tool_call> <function=NAME> parameters </function> </tool_call>,
        then (required with parallel calls) another call or the end."""
        lead = ""
        if self.in_reasoning:
            yield from run.think(max(self.call_cost("\n\n", n) for n in self.names))
            lead = "\n\n"
        names = [n for n in self.names if self.call_cost(lead, n) <= run.left()] or self.names
        name = names[(yield from run.choose([self.header(lead, n) for n in names]))]
        while True:
            yield from (self._hermes_arguments if self.tool_parser == "hermes" else self._xml_arguments)(run, name)
            names = [n for n in self.names if self.call_cost("\n", n) <= run.left() - 1] if self.parallel else []
            if not names:
                break
            choice = yield from run.choose([_EOS] + [self.header("\n", n) for n in names])
            if choice == 0:
                break
            name = names[choice - 1]
        while True:
            yield _Allowed(allow=self.eos_ids)

    def _xml_arguments(self, run, name):
        properties, required = self.functions[name]
        for i, p in enumerate(required):
            yield from run.force(f"<parameter={p}>\n")
            yield from run.xml_value(properties.get(p), self.min_arguments_cost(name, required[i + 1:]) + 1)
        optional = [p for p in properties if p not in required]
        while optional:
            closing = self.cost(_XML_CALL_CLOSE) + 1
            fits = [p for p in optional if self.min_arguments_cost(name, [p]) + closing <= run.left()]
            choice = yield from run.choose([_XML_CALL_CLOSE] + [f"<parameter={p}>\n" for p in fits])
            if choice == 0:
                return
            p = fits[choice - 1]
            optional.remove(p)
            yield from run.xml_value(properties.get(p), closing)
        yield from run.force(_XML_CALL_CLOSE)

    def _hermes_arguments(self, run, name):
        """The arguments object after '"arguments": {': required members first, then optional ones while they
        fit, then '}}' and </tool_call>. A number has no closing mark: it ends where the next separator starts."""
        properties, required = self.functions[name]
        todo, optional = list(required), [p for p in properties if p not in required]
        separator, number = "", None
        while True:
            key = lambda p: separator + json.dumps(p, ensure_ascii=False) + ": "   # noqa: E731
            closing = self.cost(_HERMES_CALL_CLOSE) + 1
            if todo:
                candidates = todo[:1]
                alternatives = [key(todo[0])]
                reserve = self.min_arguments_cost(name, todo) + 1
            else:
                candidates = [p for p in optional if self.min_arguments_cost(name, [p]) + closing + 2 <= run.left()]
                alternatives = [_HERMES_CALL_CLOSE] + [key(p) for p in candidates]
                reserve = closing
            choice = yield from (run.json_number_then(number, alternatives, reserve) if number
                                 else run.choose(alternatives))
            if not todo and choice == 0:
                return
            p = candidates[choice - (0 if todo else 1)]
            (todo if todo else optional).remove(p)
            kind, choices = _forced_value_shape(properties.get(p), json_form=True)
            rest = self.min_arguments_cost(name, todo) + 1
            number = None
            if choices:
                yield from run.choose(choices)
            elif kind == "string":
                yield from run.json_string(rest)
            elif kind in ("integer", "number"):
                number = kind                       # written with the next separator
            else:
                yield from run.force("{}" if kind == "object" else "[]")
            separator = ", "

    def _one_call(self, run: _CallProgram):
        """parallel_tool_calls=false under auto: free text until the first call closes, then the end."""
        tools = [{"type": "function", "function": {"name": name}} for name in self.functions]
        parser = ChatOutputParser(tools, self.tool_parser, self.in_reasoning)   # reads the text as the server will
        while True:
            scan = parser._scan
            if scan.calls and scan.calls[-1].closed:
                if scan.mode in ("start", "think", "text"):
                    break
                token = yield _Allowed(ban=self.facts.call_open)   # let </tool_call> come, but no second call
            else:
                token = yield _Allowed()
            parser.feed(self.facts.text(token))
        while True:
            yield _Allowed(allow=self.eos_ids)

    def _no_call(self, run: _CallProgram):
        """tool_choice none: the model may not open a call."""
        while True:
            yield _Allowed(ban=self.facts.call_open)


class _ToolChoiceProcessor:
    """The SamplingParams.logits_processors entry. It is called with each choice's generated ids; programs
    are kept per choice, keyed by (length, last 16 ids), and rebuilt by replay when a key is unknown."""

    def __init__(self, plan: _ToolChoicePlan):
        self.plan = plan
        self._programs: dict[tuple, _CallProgram] = {}

    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        program = self._program(token_ids)
        if program.constraint is None:
            return logits
        return program.constraint.apply(logits, self.plan.facts)

    def _program(self, ids: list[int]) -> _CallProgram:
        key = (len(ids), tuple(ids[-16:]))
        program = self._programs.get(key)
        if program is None:
            program = self._programs.pop((len(ids) - 1, tuple(ids[-17:-1])), None) if ids else None
            if program is not None:
                program.advance(ids[-1])
            else:                          # first call for this choice, or choices that shared a prefix split
                program = _CallProgram(self.plan)
                for token in ids:
                    program.advance(token)
            self._programs[key] = program
        return program


def _resolve_tool_choice(tool_choice, names: list[str]):
    """tool_choice -> "none" | "auto" | "required" | a function name. RequestError(param="tool_choice")."""
    if tool_choice is None:
        return "auto" if names else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise RequestError(f"tool_choice must be \"none\", \"auto\", \"required\" or "
                               f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {tool_choice!r}",
                               param="tool_choice")
        if tool_choice == "required" and not names:
            raise RequestError("tool_choice \"required\" needs a non-empty tools list", param="tool_choice")
        return tool_choice
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise RequestError("tool_choice object must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                           param="tool_choice")
    if name not in names:
        raise RequestError(f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
    return name


def tool_choice_processor(tokenizer, tools, tool_choice, tool_parser: str, parallel_tool_calls: bool,
                          in_reasoning: bool, max_tokens: int, *, eos_token_ids=None) -> Callable | None:
    """A SamplingParams.logits_processors entry enforcing tool_choice and parallel_tool_calls, or None.

    - "required" / {"type": "function", "function": {"name": X}}: the answer is a complete call (to X),
      closed before max_tokens; with reasoning on, the model reasons first and </think> is forced when the
      budget left is what the call needs. Required parameters come first in schema order, then the model may
      add optional ones or close. RequestError(param="max_tokens") when even the smallest call cannot fit.
    - parallel_tool_calls=false: "required" forces one call; "auto" ends the answer once a call has closed.
    - "none": the <tool_call> token is banned.
    The call is written in the form of `tool_parser` ("qwen_xml" or "hermes"). eos_token_ids: the ids that end the answer (default: the tokenizer's eos and
    <|im_end|>). The processor receives each choice's generated ids (not the prompt), as the engine passes.
    """
    if tool_parser not in ("qwen_xml", "hermes"):
        raise PocketError(f"unknown tool parser {tool_parser!r}: use qwen_xml or hermes")
    functions = _forced_functions(tools)
    choice = _resolve_tool_choice(tool_choice, list(functions))
    if choice == "auto" and parallel_tool_calls is not False:
        return None
    eos_ids = list(eos_token_ids or [i for i in (tokenizer.token_to_id(t) for t in (tokenizer.eos_token, "<|im_end|>"))
                                     if i is not None])
    facts = _token_facts(tokenizer)
    if choice == "none":
        return _ToolChoiceProcessor(_ToolChoicePlan(facts, functions, "no_call")) if facts.call_open else None
    if choice == "auto":
        return _ToolChoiceProcessor(_ToolChoicePlan(facts, functions, "one_call", in_reasoning=in_reasoning,
                                                    max_tokens=max_tokens, eos_ids=eos_ids, tool_parser=tool_parser))
    names = list(functions) if choice == "required" else [choice]
    plan = _ToolChoicePlan(facts, functions, "force", names, parallel=bool(parallel_tool_calls) and choice == "required",
                           in_reasoning=in_reasoning, max_tokens=max_tokens, eos_ids=eos_ids, tool_parser=tool_parser)
    smallest = min(plan.call_cost("\n\n" if in_reasoning else "", n) for n in names)
    smallest += plan.cost(_THINK_FORCED_CLOSE) if in_reasoning else 0
    if max_tokens < smallest:
        raise RequestError(f"max_tokens {max_tokens} is too small for the call tool_choice requires "
                           f"(at least {smallest} tokens)", param="max_tokens")
    return _ToolChoiceProcessor(plan)


def _forced_functions(tools) -> dict[str, tuple[dict, list[str]]]:
    """name -> (properties, required parameters in schema order, then any required ones not described)."""
    functions = {}
    for tool in tools or []:
        function = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            parameters = function.get("parameters") if isinstance(function.get("parameters"), dict) else {}
            properties = parameters.get("properties") if isinstance(parameters.get("properties"), dict) else {}
            required = [p for p in parameters.get("required") or [] if isinstance(p, str)]
            ordered = [p for p in properties if p in required] + [p for p in required if p not in properties]
            functions[function["name"]] = (properties, list(dict.fromkeys(ordered)))
    return functions


# ===== SECTION 12-13: OpenAI protocol and HTTP server (owner: server) =====

import select
import urllib.parse

# -----------------------------------------------------------------------------------------------
# 12. The OpenAI protocol: request bodies checked field by field into SamplingParams and prompt ids,
#     engine events shaped into OpenAI responses and stream chunks. No sockets here.
# -----------------------------------------------------------------------------------------------

SYSTEM_FINGERPRINT = f"pocketllm-{__version__}"
MAX_N = 16                     # choices per request
MAX_STOP = 16                  # stop strings per request
MAX_TOP_LOGPROBS = 20          # alternatives per token (OpenAI's chat limit)
LOGPROB_FLOOR = -9999.0        # JSON has no -inf: a masked token reports this instead

# The fields each endpoint knows; any other field is refused as unknown (a typo such as `temprature`).
# Accepted and ignored because they cannot change the answer (bookkeeping on OpenAI's side).
NO_EFFECT_FIELDS = {"user", "metadata", "store", "service_tier", "prompt_cache_key",
                    "prompt_cache_retention", "safety_identifier"}
# OpenAI fields we do not implement: accepted only at the values that leave the answer unchanged.
CHAT_DEFAULT_ONLY = {"audio": [None], "modalities": [None, ["text"]], "prediction": [None],
                     "functions": [None, []], "function_call": [None, "none", "auto"],
                     "web_search_options": [None], "verbosity": [None]}
COMPLETION_DEFAULT_ONLY = {"echo": [None, False], "suffix": [None, ""]}      # best_of is checked against n
SAMPLING_FIELDS = {"model", "stream", "stream_options", "n", "max_tokens", "temperature", "top_p", "seed",
                   "stop", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
                   "top_k", "min_p", "repetition_penalty", "stop_token_ids", "min_tokens", "ignore_eos"}
CHAT_FIELDS = (SAMPLING_FIELDS | NO_EFFECT_FIELDS | set(CHAT_DEFAULT_ONLY) |
               {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "reasoning_effort",
                "parallel_tool_calls", "response_format", "chat_template_kwargs", "add_generation_prompt",
                "continue_final_message"})
COMPLETION_FIELDS = SAMPLING_FIELDS | NO_EFFECT_FIELDS | set(COMPLETION_DEFAULT_ONLY) | {"prompt", "best_of"}

MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
# Keys a message may carry. The null-only ones appear when a client replays an SDK message object as a dict.
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}
MESSAGE_NULL_ONLY_KEYS = {"refusal", "annotations", "audio", "function_call", "reasoning"}
RENDER_ARGUMENTS = {"messages", "tools", "add_generation_prompt", "continue_final_message"}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")


# The field readers: each checks one JSON value's type and range and names it in the error.

def _json_type(value) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _check_type(value, kind: type, param: str):
    """value as `kind` (bool, int, float, str, list, dict); an int is a valid float, a bool is neither."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
        raise RequestError(f"'{param}' must be {_json_type(kind())}, got {_json_type(value)}", param=param)
    if kind is float and not math.isfinite(value):
        raise RequestError(f"'{param}' must be a finite number", param=param)
    return value


def _field(body: dict, name: str, kind: type, default=None, lo=None, hi=None, param: str | None = None):
    """body[name] checked for type and inclusive range [lo, hi]; absent or null -> default."""
    raw = body.get(name)
    if raw is None:
        return default
    param = param or name
    value = _check_type(raw, kind, param)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise RequestError(f"'{param}' must be between {lo} and {hi}, got {raw}", param=param)
    return value


def _check_fields(body: dict, known: set[str], default_only: dict[str, list]) -> None:
    """Refuse unknown fields (typos) and unimplemented fields set to a value that would change the answer."""
    for name in body:
        if name not in known:
            raise RequestError(f"unknown field '{name}'", param=name, code="unknown_field")
    for name, allowed in default_only.items():
        if name in body and body[name] not in allowed:
            raise RequestError(f"'{name}' is not supported by this server (accepted only as "
                               f"{' or '.join(json.dumps(a) for a in allowed)})", param=name, code="unsupported_field")


def _check_model(llm, body: dict) -> None:
    model = _field(body, "model", str)
    if model is not None and model != llm.model_name:
        raise RequestError(f"model '{model}' does not exist; this server serves '{llm.model_name}'",
                           param="model", status=404, code="model_not_found")


def _token_id(value, param: str, vocab_size: int) -> int:
    value = _check_type(value, int, param)
    if not 0 <= value < vocab_size:
        raise RequestError(f"'{param}' must be a token id between 0 and {vocab_size - 1}, got {value}", param=param)
    return value


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else _check_type(stop, list, "stop")
    if len(stop) > MAX_STOP:
        raise RequestError(f"'stop' holds at most {MAX_STOP} strings, got {len(stop)}", param="stop")
    for s in stop:
        if not _check_type(s, str, "stop"):
            raise RequestError("'stop' strings must not be empty", param="stop")
    return stop


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float]:
    bias = _field(body, "logit_bias", dict, {})
    out = {}
    for key in bias:
        if not re.fullmatch(r"\d+", key):
            raise RequestError(f"'logit_bias' keys must be token ids as strings, got {key!r}", param="logit_bias")
        out[_token_id(int(key), "logit_bias", vocab_size)] = _field(bias, key, float, lo=-100, hi=100,
                                                                    param="logit_bias")
    return out


def _request_sampling_params(llm, body: dict, prompt_len: int, max_tokens_field: str | None) -> SamplingParams:
    """The sampling fields common to both endpoints, range-checked, with max_tokens resolved."""
    vocab = llm.config.vocab_size
    room = llm.options.max_context - prompt_len
    if room <= 0:
        raise RequestError(f"the prompt is {prompt_len} tokens; the context holds {llm.options.max_context}",
                           param="messages" if "messages" in body else "prompt", code="context_length_exceeded")
    max_tokens = room
    if max_tokens_field is not None:
        max_tokens = _field(body, max_tokens_field, int, lo=1)
    n = _field(body, "n", int, 1, lo=1, hi=MAX_N)
    top_k = _field(body, "top_k", int, 0, lo=-1)
    top_p = _field(body, "top_p", float, 1.0, lo=0, hi=1)
    if top_p == 0:
        raise RequestError("'top_p' must be greater than 0 and at most 1, got 0", param="top_p")
    repetition_penalty = _field(body, "repetition_penalty", float, 1.0, lo=0, hi=10)
    if repetition_penalty == 0:
        raise RequestError("'repetition_penalty' must be greater than 0 and at most 10, got 0",
                           param="repetition_penalty")
    min_tokens = _field(body, "min_tokens", int, 0, lo=0)
    if min_tokens > max_tokens:
        raise RequestError(f"'min_tokens' ({min_tokens}) must not exceed the max tokens ({max_tokens})",
                           param="min_tokens")
    return SamplingParams(
        max_tokens=max_tokens, n=n, top_k=0 if top_k == -1 else top_k, top_p=top_p,
        temperature=_field(body, "temperature", float, 1.0, lo=0, hi=2),
        min_p=_field(body, "min_p", float, 0.0, lo=0, hi=1),
        seed=_field(body, "seed", int, lo=-2 ** 63, hi=2 ** 64 - 1),
        presence_penalty=_field(body, "presence_penalty", float, 0.0, lo=-2, hi=2),
        frequency_penalty=_field(body, "frequency_penalty", float, 0.0, lo=-2, hi=2),
        repetition_penalty=repetition_penalty, logit_bias=_logit_bias(body, vocab), min_tokens=min_tokens,
        stop=_stop_strings(body),
        stop_token_ids=[_token_id(t, "stop_token_ids", vocab)
                        for t in _field(body, "stop_token_ids", list, [])],
        ignore_eos=_field(body, "ignore_eos", bool, False))


def _max_tokens_field(body: dict, names: tuple[str, ...]) -> str | None:
    """Which of the max-tokens fields the client set (both set to different values is an error)."""
    given = [name for name in names if body.get(name) is not None]
    if len(given) == 2 and body[given[0]] != body[given[1]]:
        raise RequestError(f"'{given[0]}' and '{given[1]}' disagree; send one of them", param=given[0])
    return given[0] if given else None


def _stream_options(body: dict, stream: bool) -> bool:
    """include_usage; stream_options is only meaningful on a stream."""
    options = _field(body, "stream_options", dict)
    if options is None:
        return False
    if not stream:
        raise RequestError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    for key in options:
        if key not in ("include_usage", "include_obfuscation"):      # obfuscation: we never pad chunks
            raise RequestError(f"unknown field 'stream_options.{key}'", param=f"stream_options.{key}")
    _field(options, "include_obfuscation", bool, param="stream_options.include_obfuscation")
    return _field(options, "include_usage", bool, False, param="stream_options.include_usage")


def _check_alive(llm) -> None:
    if getattr(llm, "dead_reason", None):
        raise RequestError(f"the engine is down: {llm.dead_reason}", status=503, code="engine_dead")


def _as_sent(error: RequestError, body: dict, max_tokens_field: str | None) -> RequestError:
    """An engine-side error renamed to the field this client actually sent (max_completion_tokens, messages)."""
    if error.param == "max_tokens" and max_tokens_field:
        error.param = max_tokens_field
    elif error.param in ("messages", "prompt", "max_tokens"):       # max_tokens unsent: the prompt is too long
        error.param = "messages" if "messages" in body else "prompt"
    return error


def _submit(llm, prompt_ids: list[int], params: SamplingParams, body: dict, max_tokens_field: str | None):
    _check_alive(llm)
    try:
        return llm.submit(prompt_ids, params)
    except RequestError as e:
        raise _as_sent(e, body, max_tokens_field) from None


# Chat requests: messages and tools checked, the template rendered on a converted copy.

def _check_content(content, param: str, role: str) -> None:
    if content is None:
        if role != "assistant":
            raise RequestError(f"'{param}' must not be null for a {role} message", param=param)
        return
    if isinstance(content, str):
        return
    for j, part in enumerate(_check_type(content, list, param)):
        part = _check_type(part, dict, f"{param}[{j}]")
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise RequestError(f"'{param}[{j}]': only text content parts are supported "
                               f"(got type {part.get('type')!r})", param=f"{param}[{j}]")


def _check_tool_calls(calls, param: str) -> None:
    for j, call in enumerate(_check_type(calls, list, param)):
        where = f"{param}[{j}]"
        call = _check_type(call, dict, where)
        if call.get("type", "function") != "function":
            raise RequestError(f"'{where}.type' must be \"function\"", param=f"{where}.type")
        function = _check_type(call.get("function"), dict, f"{where}.function")
        _check_type(function.get("name"), str, f"{where}.function.name")
        if not isinstance(function.get("arguments"), (str, dict)):
            raise RequestError(f"'{where}.function.arguments' must be a JSON string",
                               param=f"{where}.function.arguments")


def _check_messages(messages) -> list[dict]:
    messages = _check_type(messages, list, "messages")
    if not messages:
        raise RequestError("'messages' must not be empty", param="messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        message = _check_type(message, dict, where)
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            raise RequestError(f"'{where}.role' must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}",
                               param=f"{where}.role")
        for key, value in message.items():
            if key not in MESSAGE_KEYS and not (key in MESSAGE_NULL_ONLY_KEYS and value in (None, [])):
                raise RequestError(f"'{where}.{key}' is not supported", param=f"{where}.{key}")
        _check_content(message.get("content"), f"{where}.content", role)
        for key in ("name", "tool_call_id", "reasoning_content"):
            _field(message, key, str, param=f"{where}.{key}")
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise RequestError(f"'{where}.tool_calls' is only allowed on assistant messages",
                                   param=f"{where}.tool_calls")
            _check_tool_calls(message["tool_calls"], f"{where}.tool_calls")
    return messages


def _check_tools(body: dict) -> list[dict] | None:
    tools = _field(body, "tools", list)
    if not tools:
        return None
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        tool = _check_type(tool, dict, where)
        if tool.get("type") != "function":
            raise RequestError(f"'{where}.type' must be \"function\" (only function tools are supported)",
                               param=f"{where}.type")
        for key in tool:
            if key not in ("type", "function"):
                raise RequestError(f"'{where}.{key}' is not supported", param=f"{where}.{key}")
        function = _check_type(tool.get("function"), dict, f"{where}.function")
        for key in function:
            if key not in ("name", "description", "parameters", "strict"):
                raise RequestError(f"'{where}.function.{key}' is not supported", param=f"{where}.function.{key}")
        name = _check_type(function.get("name"), str, f"{where}.function.name")
        if not name or name in names:
            raise RequestError(f"'{where}.function.name' must be a unique non-empty name",
                               param=f"{where}.function.name")
        names.add(name)
        _field(function, "description", str, param=f"{where}.function.description")
        _field(function, "parameters", dict, param=f"{where}.function.parameters")
        _field(function, "strict", bool, param=f"{where}.function.strict")
    return tools


def _check_tool_choice(body: dict, tools: list[dict] | None):
    """'none' | 'auto' | 'required' | {"type": "function", "function": {"name": X}}."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise RequestError(f"'tool_choice' must be none, auto, required or a function, got {choice!r}",
                               param="tool_choice")
    else:
        choice = _check_type(choice, dict, "tool_choice")
        function = choice.get("function")
        if choice.get("type") != "function" or not isinstance(function, dict) or \
                not isinstance(function.get("name"), str):
            raise RequestError('\'tool_choice\' object must be {"type": "function", "function": {"name": ...}}',
                               param="tool_choice")
        if function["name"] not in {t["function"]["name"] for t in tools or []}:
            raise RequestError(f"'tool_choice' names '{function['name']}', which is not in 'tools'",
                               param="tool_choice")
    if choice != "none" and not tools:
        raise RequestError(f"'tool_choice' {json.dumps(choice)} needs 'tools'", param="tool_choice")
    return choice


def _check_response_format(body: dict) -> None:
    fmt = _field(body, "response_format", dict)
    if fmt is not None and fmt.get("type") != "text":
        raise RequestError(f"'response_format' type {fmt.get('type')!r} is not supported yet; only \"text\"",
                           param="response_format", code="unsupported_field")


def _chat_template(llm):
    """The llm's chat template, loaded on first use (run_server may have set an override)."""
    template = getattr(llm, "chat_template", None)
    if template is None:
        template = llm.chat_template = load_chat_template(llm.tokenizer)
    if template is None:
        raise RequestError("this checkpoint has no chat template; start the server with --chat-template FILE "
                           "or use /v1/completions", param="messages")
    return template


def _reasoning_effort(llm, effort: str) -> str:
    """OpenAI's reasoning_effort, honoured by templates that read it (newer Qwen templates do), else refused."""
    if effort not in REASONING_EFFORTS:
        raise RequestError(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                           param="reasoning_effort")
    if "reasoning_effort" not in "".join(getattr(_chat_template(llm), "sources", {}).values()):
        raise RequestError("'reasoning_effort' is not supported: this model's chat template does not read it",
                           param="reasoning_effort", code="unsupported_field")
    return effort


def render_chat_prompt(llm, body: dict, tools: list[dict] | None) -> str:
    """The prompt text for a chat body: the template rendered on a converted copy of the messages."""
    messages = _check_messages(body.get("messages"))
    template_kwargs = _field(body, "chat_template_kwargs", dict, {})
    for key in template_kwargs:
        if key in RENDER_ARGUMENTS:
            raise RequestError(f"'chat_template_kwargs.{key}' must be given as a top-level field",
                               param="chat_template_kwargs")
    continue_final = _field(body, "continue_final_message", bool, False)
    add_generation_prompt = _field(body, "add_generation_prompt", bool, not continue_final)
    if continue_final and (add_generation_prompt or messages[-1]["role"] != "assistant"):
        raise RequestError("'continue_final_message' needs a final assistant message and "
                           "'add_generation_prompt' false", param="continue_final_message")
    effort = _field(body, "reasoning_effort", str)
    if effort is not None:
        template_kwargs = {**template_kwargs, "reasoning_effort": _reasoning_effort(llm, effort)}
    copy = messages_for_template(messages)
    for message in copy:                     # OpenAI's developer role is the system role of older templates
        if message["role"] == "developer":
            message["role"] = "system"
    return _chat_template(llm).render(copy, tools=tools, add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final, **template_kwargs)


# The response shapes: logprobs in both formats, usage.

def _logprob(value: float) -> float:
    return LOGPROB_FLOOR if math.isnan(value) else max(value, LOGPROB_FLOOR)


def _chat_logprobs(logprobs: list) -> list[dict]:
    return [{"token": lp.token, "logprob": _logprob(lp.logprob), "bytes": lp.bytes,
             "top_logprobs": [{"token": t, "logprob": _logprob(v), "bytes": b} for _, t, b, v in lp.top]}
            for lp in logprobs]


def _completion_logprobs(logprobs: list, text_offset: int) -> dict:
    offsets = []
    for lp in logprobs:
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return {"tokens": [lp.token for lp in logprobs], "token_logprobs": [_logprob(lp.logprob) for lp in logprobs],
            "top_logprobs": [{t: _logprob(v) for _, t, _, v in lp.top} for lp in logprobs],
            "text_offset": offsets}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Histogram:
    """A Prometheus histogram: cumulative bucket counts, a sum and a count, thread-safe."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets, self.counts = buckets, [0] * (len(buckets) + 1)
        self.sum, self.lock = 0.0, threading.Lock()

    def observe(self, value: float) -> None:
        with self.lock:
            self.counts[next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))] += 1
            self.sum += value

    def lines(self, name: str) -> list[str]:
        with self.lock:
            counts, total = list(itertools.accumulate(self.counts)), self.sum
        edges = [repr(b) for b in self.buckets] + ["+Inf"]
        return ([f'{name}_bucket{{le="{e}"}} {c}' for e, c in zip(edges, counts)] +
                [f"{name}_sum {total}", f"{name}_count {counts[-1]}"])


class ServerMetrics:
    """What /metrics reports beyond llm.stats(): responses by endpoint and status, latency histograms."""

    def __init__(self):
        self.lock = threading.Lock()
        self.responses: dict[tuple[str, int], int] = {}
        self.time_to_first_token = Histogram((0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.inter_token_latency = Histogram((0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.2, 0.5, 1, 2.5))

    def count(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.responses[endpoint, status] = self.responses.get((endpoint, status), 0) + 1


# A submitted request: its engine stream plus what shapes the answer, consumed once as chunks or a response.

class Completion:
    """One validated, submitted request. `chunks()` streams it, `response()` waits for it; `abort()` cancels."""

    def __init__(self, llm, stream, kind: str, stream_mode: bool, include_usage: bool, logprobs: int | None,
                 parsers: list | None = None, metrics: ServerMetrics | None = None):
        self.llm, self.stream, self.kind, self.stream_mode = llm, stream, kind, stream_mode
        self.include_usage, self.logprobs, self.parsers, self.metrics = include_usage, logprobs, parsers, metrics
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        self.object = "chat.completion" if kind == "chat" else "text_completion"
        self.created, self.submitted = int(time.time()), time.monotonic()
        self.completion_tokens = 0
        self.text_offsets: dict[int, int] = {}     # choice -> characters of logprob tokens streamed so far

    def abort(self) -> None:
        self.stream.abort()

    def events(self) -> Iterator:
        """The engine's events, timed for the latency histograms; an engine-side abort is an error."""
        last: dict[int, float] = {}
        for event in self._engine_events():
            now = time.monotonic()
            if event.token_ids:
                self.completion_tokens += len(event.token_ids)
                if self.metrics:
                    if not last:
                        self.metrics.time_to_first_token.observe(now - self.submitted)
                    elif event.index in last:
                        self.metrics.inter_token_latency.observe((now - last[event.index]) / len(event.token_ids))
                last[event.index] = now
            if event.finish_reason == "abort":             # we aborted it (client gone) or the engine died
                _check_alive(self.llm)
                raise RequestError("the request was aborted", status=503, code="aborted")
            yield event

    def _engine_events(self) -> Iterator:
        """The stream's events; a fatal engine error while waiting becomes a 503."""
        try:
            yield from self.stream
        except RequestError:
            raise
        except PocketError as e:
            _check_alive(self.llm)
            raise RequestError(str(e), status=503, code="engine_dead") from None

    def _finish_reason(self, index: int, reason: str) -> str:
        if self.parsers and self.parsers[index].has_tool_calls and reason == "stop":
            return "tool_calls"
        return reason

    def _envelope(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": self.object + (".chunk" if self.kind == "chat" and self.stream_mode else ""),
                "created": self.created, "model": self.llm.model_name, "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": choices}

    def _usage(self) -> dict:
        return _usage(self.stream.prompt_tokens, self.completion_tokens)

    def chunks(self) -> Iterator[dict]:
        """OpenAI stream chunks; closing the iterator early aborts the request."""
        n = len(self.parsers) if self.parsers is not None else None
        try:
            pending = {}                      # choice -> logprobs not yet attached to a chunk
            if self.kind == "chat":
                for i in range(n):
                    yield self._chunk(i, {"role": "assistant", "content": ""})
            for event in self.events():
                i = event.index
                if self.logprobs is not None and event.logprobs:
                    pending.setdefault(i, []).extend(event.logprobs)
                if self.kind == "chat":
                    deltas = self.parsers[i].feed(event.text) if event.text else []
                    if event.finish_reason:
                        deltas += self.parsers[i].finish()
                    for delta in deltas:
                        yield self._chunk(i, delta, pending.pop(i, None))
                elif event.text:
                    yield self._chunk(i, event.text, pending.pop(i, None))
                if event.finish_reason:
                    yield self._chunk(i, {} if self.kind == "chat" else "", pending.pop(i, None),
                                      self._finish_reason(i, event.finish_reason), event.stop_reason)
            if self.include_usage:
                yield {**self._envelope([]), "usage": self._usage()}
        finally:
            self.abort()                      # a no-op once finished; frees the request if the client left

    def _chunk(self, index: int, delta, logprobs=None, finish_reason=None, stop_reason=None) -> dict:
        choice = {"index": index}
        if self.kind == "chat":
            choice.update(delta=delta, logprobs={"content": _chat_logprobs(logprobs)} if logprobs else None)
        elif logprobs:
            start = self.text_offsets.get(index, 0)
            self.text_offsets[index] = start + sum(len(lp.token) for lp in logprobs)
            choice.update(text=delta, logprobs=_completion_logprobs(logprobs, start))
        else:
            choice.update(text=delta, logprobs=None)
        choice.update(finish_reason=finish_reason)
        if finish_reason is not None:
            choice["stop_reason"] = stop_reason
        chunk = self._envelope([choice])
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def response(self) -> dict:
        """The whole answer, once every choice has finished."""
        texts, logprobs, finish = {}, {}, {}
        try:
            for event in self.events():
                texts[event.index] = texts.get(event.index, "") + event.text
                logprobs.setdefault(event.index, []).extend(event.logprobs or [])
                if event.finish_reason:
                    finish[event.index] = (event.finish_reason, event.stop_reason)
        finally:
            self.abort()
        choices = []
        for i in sorted(finish):
            reason, stop_reason = finish[i]
            choice = {"index": i}
            if self.kind == "chat":
                parser = self.parsers[i]
                parser.feed(texts.get(i, ""))
                parser.finish()
                message = {"role": "assistant", **{k: v for k, v in parser.message().items()
                                                    if k == "content" or v is not None}}
                choice.update(message=message, logprobs={"content": _chat_logprobs(logprobs[i])}
                              if self.logprobs is not None else None)
            else:
                choice.update(text=texts.get(i, ""), logprobs=_completion_logprobs(logprobs[i], 0)
                              if self.logprobs is not None else None)
            choice.update(finish_reason=self._finish_reason(i, reason), stop_reason=stop_reason)
            choices.append(choice)
        return {**self._envelope(choices), "usage": self._usage()}


def _check_envelope(llm, body, fields, default_only) -> tuple[dict, bool, bool]:
    """What both completion endpoints check first: a JSON object of known fields for our model; stream flags."""
    body = _check_type(body, dict, "body")
    _check_fields(body, fields, default_only)
    _check_model(llm, body)
    stream = _field(body, "stream", bool, False)
    return body, stream, _stream_options(body, stream)


def start_chat_completion(llm, body, metrics: ServerMetrics | None = None) -> Completion:
    """Validate a /v1/chat/completions body, render the prompt and submit it."""
    body, stream, include_usage = _check_envelope(llm, body, CHAT_FIELDS, CHAT_DEFAULT_ONLY)
    tools = _check_tools(body)
    tool_choice = _check_tool_choice(body, tools)
    parallel_tool_calls = _field(body, "parallel_tool_calls", bool, True)
    _check_response_format(body)
    want_logprobs = _field(body, "logprobs", bool, False)
    top_logprobs = _field(body, "top_logprobs", int, lo=0, hi=MAX_TOP_LOGPROBS)
    if top_logprobs is not None and not want_logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    prompt_text = render_chat_prompt(llm, body, tools)
    prompt_ids = llm.tokenizer.encode(prompt_text)
    max_tokens_field = _max_tokens_field(body, ("max_completion_tokens", "max_tokens"))
    params = _request_sampling_params(llm, body, len(prompt_ids), max_tokens_field)
    params.logprobs = (top_logprobs or 0) if want_logprobs else None
    template = _chat_template(llm)
    in_reasoning = prompt_ends_in_reasoning(prompt_text)
    if tools:                             # enforces required / named / parallel_tool_calls=false, bans calls for none
        try:
            processor = tool_choice_processor(llm.tokenizer, tools, tool_choice, template.tool_parser,
                                              parallel_tool_calls, in_reasoning, params.max_tokens,
                                              eos_token_ids=llm.eos_token_ids)
        except RequestError as e:
            raise _as_sent(e, body, max_tokens_field) from None
        if processor is not None:
            params.logits_processors = [*params.logits_processors, processor]
    parsers = [ChatOutputParser(tools, template.tool_parser, in_reasoning, parse_tools=tool_choice != "none")
               for _ in range(params.n)]
    return Completion(llm, _submit(llm, prompt_ids, params, body, max_tokens_field), "chat", stream,
                      include_usage, params.logprobs, parsers, metrics)


def _prompt_ids(llm, prompt) -> list[int]:
    """A completions prompt: a string or token ids, alone or as a one-element batch."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):          # text: a control token it spells stays text; send ids for control tokens
        ids = llm.tokenizer.encode_text(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = [_token_id(t, "prompt", llm.config.vocab_size) for t in prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError("'prompt' batches of more than one prompt are not supported; send one request each",
                           param="prompt", code="unsupported_field")
    else:
        raise RequestError(f"'prompt' must be a string or an array of token ids, got {_json_type(prompt)}",
                           param="prompt")
    if not ids:
        raise RequestError("'prompt' must not be empty", param="prompt")
    return ids


def start_completion(llm, body, metrics: ServerMetrics | None = None) -> Completion:
    """Validate a /v1/completions body and submit it."""
    body, stream, include_usage = _check_envelope(llm, body, COMPLETION_FIELDS, COMPLETION_DEFAULT_ONLY)
    prompt_ids = _prompt_ids(llm, body.get("prompt"))
    max_tokens_field = "max_tokens" if body.get("max_tokens") is not None else None
    params = _request_sampling_params(llm, body, len(prompt_ids), max_tokens_field)
    best_of = _field(body, "best_of", int)
    if best_of not in (None, 1, params.n):
        raise RequestError("'best_of' is not supported by this server (accepted only when equal to 'n')",
                           param="best_of", code="unsupported_field")
    params.logprobs = _field(body, "logprobs", int, lo=0, hi=MAX_TOP_LOGPROBS)
    return Completion(llm, _submit(llm, prompt_ids, params, body, max_tokens_field), "text", stream,
                      include_usage, params.logprobs, None, metrics)


def chat_completions(llm, body: dict) -> dict | Iterator[dict]:
    """An OpenAI /v1/chat/completions body -> the response dict, or an iterator of chunks when streaming."""
    completion = start_chat_completion(llm, body)
    return completion.chunks() if completion.stream_mode else completion.response()


def completions(llm, body: dict) -> dict | Iterator[dict]:
    """An OpenAI /v1/completions body -> the response dict, or an iterator of chunks when streaming."""
    completion = start_completion(llm, body)
    return completion.chunks() if completion.stream_mode else completion.response()


def llm_chat(llm, messages: list[dict], tools: list[dict] | None = None, stream: bool = False, **params):
    """LLM.chat: the same OpenAI-shaped dict (or chunk iterator) the HTTP endpoint sends."""
    body = {**params, "messages": messages, "stream": stream}
    if tools is not None:
        body["tools"] = tools
    return chat_completions(llm, body)


# -----------------------------------------------------------------------------------------------
# 13. The HTTP server: ThreadingHTTPServer with one route table and one translator from exceptions to
#     OpenAI errors. Each request runs on its own thread and blocks on its RequestStream; SSE for streams.
# -----------------------------------------------------------------------------------------------

DEFAULT_MAX_REQUEST_BYTES = 16 * 2 ** 20
DEFAULT_SOCKET_TIMEOUT = 60.0      # seconds a client may stay silent (idle keep-alive, a slow body or read)
DEFAULT_MAX_CONNECTIONS = 256      # open connections; one more is answered 503 and closed
DEFAULT_SEND_BUFFER = 64 * 2 ** 10 # bytes the kernel holds for a client that stops reading (no autotuning to MBs)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 411: "invalid_request_error", 413: "invalid_request_error",
               500: "internal_server_error", 503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def translate_error(error: Exception) -> tuple[int, dict]:
    """Any exception -> (HTTP status, OpenAI error body). Only our own bugs are 500, logged with a traceback."""
    if isinstance(error, RequestError):
        return error.status, error_body(error.status, str(error), error.param, error.code)
    if isinstance(error, PocketError):
        return 400, error_body(400, str(error))
    if isinstance(error, RecursionError):          # JSON nested deeper than Python will walk
        return 400, error_body(400, "the request is nested too deeply", code="invalid_json")
    traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    return 500, error_body(500, "internal server error (logged on the server)", code="internal_error")


def _client_gone(error: Exception) -> bool:
    """A failed read or write on the client's socket (reset, broken pipe, timeout)."""
    return isinstance(error, (ConnectionError, TimeoutError))


class DisconnectWatch:
    """While a non-streamed request waits on the engine, call on_disconnect if the client closes its socket."""

    def __init__(self, sock: socket.socket, on_disconnect: Callable[[], None]):
        self.sock, self.on_disconnect, self.done = sock, on_disconnect, threading.Event()

    def __enter__(self):
        threading.Thread(target=self._watch, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()

    def _watch(self) -> None:
        while not self.done.is_set():
            try:
                if not select.select([self.sock], [], [], 0.05)[0]:
                    continue
                if self.sock.recv(1, socket.MSG_PEEK):
                    return                       # a pipelined next request: the client is still there
            except (OSError, ValueError):
                pass                             # reset or closed: gone as well
            if not self.done.is_set():
                self.on_disconnect()
            return


# The endpoints. Each takes the handler, the path match and the raw body, and sends one response.

def _json_body(raw: bytes) -> dict:
    def refuse_constant(name):
        raise ValueError(f"{name} is not valid JSON")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=refuse_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise RequestError(f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {_json_type(body)}", code="invalid_json")
    return body


def _health(handler, match, raw) -> None:
    _check_alive(handler.server.llm)
    handler.send_json(200, {"status": "ok"})


def _model_card(server) -> dict:
    return {"id": server.llm.model_name, "object": "model", "created": server.started, "owned_by": "pocketllm",
            "root": str(server.llm.ckpt_dir), "max_model_len": server.llm.options.max_context}


def _models(handler, match, raw) -> None:
    handler.send_json(200, {"object": "list", "data": [_model_card(handler.server)]})


def _model(handler, match, raw) -> None:
    _check_model(handler.server.llm, {"model": urllib.parse.unquote(match["model"])})
    handler.send_json(200, _model_card(handler.server))


def _chat(handler, match, raw) -> None:
    handler.send_completion(start_chat_completion(handler.server.llm, _json_body(raw), handler.server.metrics))


def _completions(handler, match, raw) -> None:
    handler.send_completion(start_completion(handler.server.llm, _json_body(raw), handler.server.metrics))


TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "continue_final_message", "chat_template_kwargs", "tools", "return_token_strs"}


def _tokenize(handler, match, raw) -> None:
    """vLLM's /tokenize: a prompt, or chat messages rendered by the template -> token ids."""
    llm, body = handler.server.llm, _json_body(raw)
    _check_fields(body, TOKENIZE_FIELDS, {})
    _check_model(llm, body)
    if ("prompt" in body) == ("messages" in body):
        raise RequestError("send exactly one of 'prompt' and 'messages'", param="prompt")
    _field(body, "add_special_tokens", bool)     # our tokenizers add no special tokens either way
    if "prompt" in body:
        ids = llm.tokenizer.encode_text(_check_type(body["prompt"], str, "prompt"))
    else:
        ids = llm.tokenizer.encode(render_chat_prompt(llm, body, _check_tools(body)))
    strs = [llm.tokenizer.id_to_token(t) for t in ids] if _field(body, "return_token_strs", bool, False) else None
    handler.send_json(200, {"count": len(ids), "max_model_len": llm.options.max_context, "tokens": ids,
                            "token_strs": strs, "split_special_tokens": True})   # request text never makes control tokens


def _detokenize(handler, match, raw) -> None:
    """vLLM's /detokenize: token ids -> text."""
    llm, body = handler.server.llm, _json_body(raw)
    _check_fields(body, {"model", "tokens"}, {})
    _check_model(llm, body)
    ids = [_token_id(t, "tokens", llm.config.vocab_size) for t in _check_type(body.get("tokens"), list, "tokens")]
    handler.send_json(200, {"prompt": llm.tokenizer.decode(ids)})


def metrics_text(llm, metrics: ServerMetrics) -> str:
    """The Prometheus text exposition of the engine's counters and the server's."""
    stats = llm.stats()
    lines = []

    def family(name: str, kind: str, help: str, samples: list[str]) -> None:
        lines.extend([f"# HELP pocketllm_{name} {help}", f"# TYPE pocketllm_{name} {kind}"] +
                     [f"pocketllm_{name}{s}" for s in samples])

    with metrics.lock:
        responses = sorted(metrics.responses.items())
    family("requests_total", "counter", "HTTP responses by endpoint and status code.",
           [f'{{endpoint="{e}",status="{s}"}} {c}' for (e, s), c in responses])
    family("prompt_tokens_total", "counter", "Prompt tokens processed.", [f" {stats['prompt_tokens_total']}"])
    family("generation_tokens_total", "counter", "Tokens generated.", [f" {stats['generation_tokens_total']}"])
    family("requests_running", "gauge", "Requests being generated.", [f" {stats['running']}"])
    family("requests_waiting", "gauge", "Requests queued for a slot.", [f" {stats['waiting']}"])
    family("kv_blocks_used", "gauge", "Paged KV-cache blocks in use.", [f" {stats['kv_blocks_used']}"])
    family("kv_blocks_total", "gauge", "Paged KV-cache blocks in all.", [f" {stats['kv_blocks_total']}"])
    family("kv_cache_usage_ratio", "gauge", "Fraction of KV-cache blocks in use.",
           [f" {stats['kv_blocks_used'] / max(1, stats['kv_blocks_total'])}"])
    family("slots_used", "gauge", "Recurrent-state slots in use.", [f" {stats['slots_used']}"])
    family("slots_total", "gauge", "Recurrent-state slots in all.", [f" {stats['slots_total']}"])
    for name, histogram, help in (
            ("time_to_first_token_seconds", metrics.time_to_first_token, "Time from submission to the first token."),
            ("inter_token_latency_seconds", metrics.inter_token_latency, "Time between tokens of one choice.")):
        family(name, "histogram", help, [s[len(name):] for s in histogram.lines(name)])
    return "\n".join(lines) + "\n"


def _metrics(handler, match, raw) -> None:
    data = metrics_text(handler.server.llm, handler.server.metrics).encode()
    handler.send_bytes(200, data, "text/plain; version=0.0.4; charset=utf-8")


# The route table: (method, path pattern, endpoint). The pattern doubles as the metrics label.
ROUTES = [
    ("GET", "/health", _health),
    ("GET", "/v1/models", _models),
    ("GET", "/v1/models/{model}", _model),
    ("POST", "/v1/chat/completions", _chat),
    ("POST", "/v1/completions", _completions),
    ("POST", "/tokenize", _tokenize),
    ("POST", "/detokenize", _detokenize),
    ("GET", "/metrics", _metrics),
]
ROUTE_PATTERNS = [(method, re.compile(re.sub(r"\{(\w+)\}", r"(?P<\1>.+)", path) + "$"), path, endpoint)
                  for method, path, endpoint in ROUTES]


def find_route(method: str, path: str):
    """(label, match, endpoint) for the request; 404 for an unknown path, 405 for a known path's wrong method."""
    allowed = []
    for route_method, pattern, label, endpoint in ROUTE_PATTERNS:
        match = pattern.match(path)
        if match and route_method == method:
            return label, match, endpoint
        if match:
            allowed.append(route_method)
    if allowed:
        raise RequestError(f"method {method} not allowed on {path}; use {', '.join(allowed)}", status=405,
                           code="method_not_allowed")
    raise RequestError(f"no such endpoint: {path}", status=404, code="unknown_url")


class Handler(http.server.BaseHTTPRequestHandler):
    """One connection: HTTP/1.1 keep-alive, each request read, authorised, routed and answered."""

    protocol_version = "HTTP/1.1"
    server_version = f"pocketllm/{__version__}"
    endpoint = "other"                    # the route label for metrics, set once routed

    def setup(self) -> None:
        self.timeout = self.server.socket_timeout      # applied to the socket by StreamRequestHandler
        self.request.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.server.send_buffer_bytes)
        super().setup()

    def handle_one_request(self) -> None:
        # The whole request (line, headers, body) must arrive within the socket timeout: a client sending
        # one byte a second never trips the per-read timeout, so the server's reaper enforces a deadline.
        self.server.deadlines.arm(self)
        try:
            super().handle_one_request()
        finally:
            self.server.deadlines.disarm(self)

    def do_GET(self): self.handle_request("GET")
    def do_POST(self): self.handle_request("POST")
    def do_PUT(self): self.handle_request("PUT")
    def do_DELETE(self): self.handle_request("DELETE")
    def do_PATCH(self): self.handle_request("PATCH")
    def do_HEAD(self): self.handle_request("HEAD")
    def do_OPTIONS(self): self.handle_request("OPTIONS")

    def handle_request(self, method: str) -> None:
        self.endpoint = "other"
        try:
            path = urllib.parse.urlsplit(self.path).path
            raw = self.read_body()
            self.server.deadlines.disarm(self)          # read in time; generating may take as long as it takes
            if path != "/health":
                self.check_auth()
            self.endpoint, match, endpoint = find_route(method, path)
            endpoint(self, match, raw)
        except Exception as e:
            if _client_gone(e):
                self.close_connection = True
                return
            self.send_error_response(e)

    def read_body(self) -> bytes:
        """The request body, bounded by the server's limit; a body we do not read closes the connection."""
        if "Transfer-Encoding" in self.headers:
            self.close_connection = True
            raise RequestError("chunked request bodies are not supported; send Content-Length", status=411)
        length = self.headers.get("Content-Length", "0").strip()
        if not length.isdigit():
            self.close_connection = True
            raise RequestError(f"invalid Content-Length header {length!r}")
        length = int(length)
        if length > self.server.max_request_bytes:
            self.close_connection = True
            raise RequestError(f"request body of {length} bytes is over the limit of "
                               f"{self.server.max_request_bytes} bytes", status=413, code="request_too_large")
        raw = self.rfile.read(length)
        if len(raw) < length:
            raise ConnectionResetError("client closed the connection while sending the body")
        return raw

    def check_auth(self) -> None:
        key = self.server.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "")
        if not given:
            raise RequestError("missing API key: send 'Authorization: Bearer <key>'", status=401,
                               code="invalid_api_key")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise RequestError("invalid API key", status=401, code="invalid_api_key")

    # Answers: JSON, errors, and server-sent events.

    def send_bytes(self, status: int, data: bytes, content_type: str, headers: dict | None = None) -> None:
        self.server.metrics.count(self.endpoint, status)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def send_json(self, status: int, obj: dict, headers: dict | None = None) -> None:
        self.send_bytes(status, json.dumps(obj, ensure_ascii=False).encode(), "application/json", headers)

    def send_error_response(self, error: Exception) -> None:
        status, body = translate_error(error)
        headers = {}
        if status == 405:
            allowed = [m for m, pattern, _, _ in ROUTE_PATTERNS if pattern.match(urllib.parse.urlsplit(self.path).path)]
            headers["Allow"] = ", ".join(allowed)
        try:
            self.send_json(status, body, headers)
        except Exception as e:             # the client left while we answered
            if not _client_gone(e):
                raise
            self.close_connection = True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (malformed request line, oversized headers) in the OpenAI shape."""
        self.close_connection = True
        self.send_json(int(code), error_body(int(code), message or explain or "bad request"))

    def send_completion(self, completion: Completion) -> None:
        if completion.stream_mode:
            self.send_stream(completion.chunks())
            return
        with DisconnectWatch(self.connection, completion.abort):
            response = completion.response()
        self.send_json(200, response)

    def send_stream(self, chunks: Iterator[dict]) -> None:
        """SSE over chunked transfer encoding, so the connection stays alive for the next request."""
        self.server.metrics.count(self.endpoint, 200)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            while True:
                try:
                    chunk = next(chunks)
                except StopIteration:
                    break
                except Exception as e:            # after the headers an error can only travel as an event
                    self.send_event(translate_error(e)[1])
                    break
                self.send_event(chunk)
            self.send_event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
        except Exception as e:
            if not _client_gone(e):
                raise
            self.close_connection = True
        finally:
            chunks.close()                        # aborts the request if the client left

    def send_event(self, data: dict | str) -> None:
        text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
        payload = b"data: " + text.encode() + b"\n\n"
        # A reader that stops reading fills the socket buffer and blocks this write: after the socket timeout
        # the connection is cut, the stream's request aborted, and what the engine buffered for it released.
        self.server.deadlines.arm(self)
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
        finally:
            self.server.deadlines.disarm(self)

    def log_message(self, format: str, *args) -> None:
        if self.server.log_requests:
            sys.stderr.write(f"pocketllm: {self.address_string()} {format % args}\n")


class Deadlines:
    """Connections that must finish reading a request or writing an event by a deadline. One reaper thread
    shuts down the socket of any that is late, which wakes its blocked read or write with an error."""

    def __init__(self, seconds: float):
        self.seconds, self.lock, self.due = seconds, threading.Lock(), {}   # handler -> monotonic deadline
        self.stopped = threading.Event()
        threading.Thread(target=self._reap, name="pocketllm-reaper", daemon=True).start()

    def arm(self, handler) -> None:
        with self.lock:
            self.due[handler] = time.monotonic() + self.seconds

    def disarm(self, handler) -> None:
        with self.lock:
            self.due.pop(handler, None)

    def _reap(self) -> None:
        while not self.stopped.wait(min(1.0, self.seconds / 4)):
            now = time.monotonic()
            with self.lock:
                late = [h for h, t in self.due.items() if t < now]
                for h in late:
                    del self.due[h]
            for h in late:
                h.close_connection = True
                try:
                    h.connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class PocketServer(http.server.ThreadingHTTPServer):
    """The HTTP server for one LLM. `.port` is the bound port; `.shutdown()` stops and closes it."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, llm, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, socket_timeout: float = DEFAULT_SOCKET_TIMEOUT,
                 log_requests: bool = True, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 send_buffer_bytes: int = DEFAULT_SEND_BUFFER):
        if ":" in host:
            self.address_family = socket.AF_INET6
        try:
            super().__init__((host, port), Handler)
        except OSError as e:
            raise PocketError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        self.llm, self.api_key, self.max_request_bytes = llm, api_key, max_request_bytes
        self.socket_timeout, self.log_requests = socket_timeout, log_requests
        self.metrics, self.started, self.serving = ServerMetrics(), int(time.time()), False
        self.max_connections, self.connections, self.count_lock = max_connections, set(), threading.Lock()
        self.send_buffer_bytes = send_buffer_bytes
        self.deadlines = Deadlines(socket_timeout)

    # At most max_connections at once: one more is answered 503 on a short-lived thread and closed, so a
    # client opening hundreds of idle connections cannot starve the others of threads and sockets.

    def process_request(self, request, client_address) -> None:
        with self.count_lock:
            admitted = len(self.connections) < self.max_connections
            if admitted:
                self.connections.add(request)
        if admitted:
            super().process_request(request, client_address)
        else:
            threading.Thread(target=self._refuse, args=(request,), daemon=True).start()

    def _refuse(self, request) -> None:
        body = json.dumps(error_body(503, f"too many connections (the limit is {self.max_connections}); retry "
                                          "later")).encode()
        try:
            request.settimeout(2.0)
            request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                            b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            request.shutdown(socket.SHUT_WR)
            request.recv(65536)                # let the client's request arrive, so closing sends no reset
        except OSError:
            pass
        self.metrics.count("other", 503)
        super().shutdown_request(request)

    def shutdown_request(self, request) -> None:
        with self.count_lock:
            self.connections.discard(request)
        super().shutdown_request(request)

    @property
    def port(self) -> int:
        return self.server_address[1]

    def start(self) -> "PocketServer":
        """Serve on a background thread."""
        self.serving = True
        threading.Thread(target=self.serve_forever, name="pocketllm-http", daemon=True).start()
        return self

    def run(self) -> None:
        """Serve on this thread until Ctrl-C or SIGTERM."""
        self.serving = True
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, signal.default_int_handler) if in_main else None
        try:
            self.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            self.serving = False
            if in_main:
                signal.signal(signal.SIGTERM, previous)
            self.deadlines.stopped.set()
            self.server_close()

    def handle_error(self, request, client_address) -> None:
        # A client resetting a kept-alive connection (a pooled SDK connection at exit) is routine: no traceback.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)

    def shutdown(self) -> None:
        if self.serving:
            super().shutdown()
            self.serving = False
        self.deadlines.stopped.set()
        self.server_close()


def serve(llm, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, block: bool = True,
          **options) -> PocketServer:
    """Serve llm over HTTP: blocking until interrupted, or (block=False) on a background thread."""
    server = PocketServer(llm, host, port, api_key, **options)
    if block:
        server.run()
        return server
    return server.start()


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free port and prints it)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                            "(default: env POCKETLLM_API_KEY)")
    group.add_argument("--served-model-name", default=None,
                       help="the model id clients send (default: the checkpoint directory name)")
    group.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a jinja chat template to use instead of the checkpoint's")
    group.add_argument("--tool-parser", choices=("qwen_xml", "hermes"), default=None,
                       help="tool-call format (default: detected from the chat template)")
    group.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help=f"largest request body accepted (default {DEFAULT_MAX_REQUEST_BYTES}); larger is 413")
    group.add_argument("--socket-timeout", type=float, default=DEFAULT_SOCKET_TIMEOUT,
                       help=f"seconds a client may take to send a request, or stall reading a stream, and may "
                            f"stay silent on a kept-alive connection (default {DEFAULT_SOCKET_TIMEOUT:g})")
    group.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                       help=f"open connections at most; one more is answered 503 (default {DEFAULT_MAX_CONNECTIONS})")


def run_server(llm, args: argparse.Namespace) -> int:
    """Apply the server flags to llm, print the address, serve until interrupted; the exit code."""
    if args.served_model_name:
        llm.model_name = args.served_model_name
    if args.chat_template:
        llm.chat_template = load_chat_template(llm.tokenizer, args.chat_template)
    if args.tool_parser:
        _chat_template(llm).tool_parser = args.tool_parser
    server = PocketServer(llm, args.host, args.port, args.api_key or os.environ.get("POCKETLLM_API_KEY") or None,
                          max_request_bytes=args.max_request_bytes, socket_timeout=args.socket_timeout,
                          max_connections=args.max_connections)
    print(f"pocketllm: serving '{llm.model_name}' on http://{args.host}:{server.port}", flush=True)
    server.run()
    return 0



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
    ok, reason = native_status(device)
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
        # With --devices, rank 0 runs on the first listed device.
        self.device = device = parse_devices(opts.devices)[0] if opts.devices else torch.device(opts.device)
        self.dtype = resolve_dtype(opts.dtype, device, "dtype")
        self.kv_dtype = kv_dtype = self.dtype if opts.kv_dtype == "auto" else resolve_dtype(opts.kv_dtype, device,
                                                                                           "kv-dtype")
        self.dead_reason: str | None = None
        self.group = None                      # tensor-parallel rank group (section 8b), when --devices is given
        if opts.devices:
            self.group = start_group(self.ckpt_dir, opts, self.dtype, kv_dtype)
            self.group.on_death = lambda reason: setattr(self, "dead_reason", reason)
            self.model, run_batch = self.group.model, lambda batch: self.group.run_batch(batch, self.engine.cache)
        else:
            ops, why = select_ops(opts, device)
            _log(opts, f"backend: {why}")
            self.model = Model(ckpt, ops, self.dtype, device, num_layers=opts.smoke_layers or None,
                               progress=not opts.quiet)
            run_batch = None
        ckpt.close()
        self.engine = Engine(self.model, opts, self.eos_token_ids, kv_dtype, run_batch,
                             self.group.copy_state if self.group else copy_state)
        _log(opts, f"{self.model_name}: {cfg.model_type}, {len(self.model.layers)} layers, {self.dtype}; "
                   f"KV cache {self.engine.blocks.total} blocks x {opts.kv_block_size} tokens = "
                   f"{self.engine.blocks.total * opts.kv_block_size} tokens, {opts.max_batch_size} state slots")
        self._lock = threading.Lock()          # one forward pass at a time (engine thread or logits())
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._ids = itertools.count()
        # A daemon thread still running at interpreter exit is killed inside torch code, which aborts the
        # process ("terminate called without an active exception"): stop it before that.
        atexit.register(self.close)

    # The engine thread: steps while there is work, sleeps otherwise.

    def wake(self):
        self._wake.set()

    def _loop(self):
        while not self._closing:
            self._wake.wait(timeout=0.5)
            self._wake.clear()
            while self.engine.has_work() and not self._closing:
                try:
                    with self._lock:
                        self.engine.step()
                except Exception as e:           # a bug or a device error: fail every request, stay dead
                    traceback.print_exc()
                    self._fail_all(f"{type(e).__name__}: {e}")
                    return

    def _fail_all(self, reason: str):
        """Stop for good: every request still queued or running ends with an error event."""
        self.dead_reason = self.dead_reason or reason
        for req in list(self.engine.requests.values()):
            req.events.put(EngineEvent(0, [], None, "error"))

    def submit(self, prompt_ids: list[int], params: SamplingParams, param: str = "max_tokens") -> RequestStream:
        """Queue a request; iterate the returned stream for its events. Thread-safe."""
        if self.dead_reason or self._closing:
            raise PocketError(f"the engine failed: {self.dead_reason or 'the engine was closed'}")
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

    def close(self):
        """Stop the engine thread (requests still running end with an error) and the tensor-parallel ranks, if
        any. Runs at interpreter exit too; later calls do nothing."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        self.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._fail_all("the engine was closed")
        if self.group is not None:
            self.group.close()

    # The OpenAI surface (sections 12-13): exactly what the HTTP endpoints send.

    def chat(self, messages: list[dict], tools: list[dict] | None = None, stream: bool = False, **params):
        """An OpenAI chat completion: the response dict, or an iterator of chunk dicts when stream=True."""
        return llm_chat(self, messages, tools, stream, **params)

    def serve(self, host: str = "127.0.0.1", port: int = 8000, block: bool = True, **server_options):
        """Serve the OpenAI API over HTTP; with block=False returns the running server (.port, .shutdown())."""
        return serve(self, host, port, block=block, **server_options)

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
        cache = allocate_cache(self.config, self.model.layers, nblocks, bs, 1, self.kv_dtype, self.device)
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

