"""pocketllm: serve a Qwen FP8 checkpoint behind an OpenAI-compatible API, from one file.

Quickstart:

    pip install -r requirements.txt && python pocketllm.py            # serves the bundled pocket-tiny
    python pocketllm.py --ckpt /models/Qwen3.5-27B-FP8 --port 8000       # your checkpoint

    import pocketllm
    llm = pocketllm.LLM("/models/Qwen3.5-27B-FP8")
    print(llm.generate("The capital of France is", max_tokens=8)["text"])

Sections, in the order a request flows; each name is defined above its first use (two tables refer to
themselves: SamplingParams' rows, and the route table that /openapi.json lists):

     0. Header: imports, version, the error hierarchy.
     1. Configuration: the model config (ARCHITECTURES: one entry per model_type), engine options, and the
        sampling parameters, each field with its row (type, range, default, layer, policy) of the field tables.
     2. Checkpoint loading: safetensors, HF names kept, FP8 block scales, shard helpers (ragged splits too).
     3. Backends: the op list and the torch reference ops; 3b the native (cffi) ops; 3c choosing the
        device, dtypes and backend before any weight loads.
     4. The model: layer weights as dataclasses per kind (MIXERS), RoPE, gated DeltaNet, gated attention,
        MLP, the forward over an explicit Batch.
     5. Memory: paged KV blocks and recurrent-state slots.
     6. Scheduler: sequences, continuous batching, chunked prefill, preemption.
     7. Sampler: one batched pass over the step's logits on their device, one transfer to the host.
     8. Runner: a plan becomes a Batch; 8b tensor parallelism: the runner in other processes, reached by
        method calls (RankGroup.call).
     9. Engine: step = schedule, run, postprocess; request queues; abort; per-request faults. Token ids only.
    10. Text: tokenizer (control tokens only from templates), UTF-8-safe detokenizer, stop strings;
        10b tool calls in text: the tools a request offers, one class per call format (TOOL_FORMATS);
        10c sandboxed chat templates.
    11. Output parsing: reasoning and tool calls, streaming by partial re-parse and diff; 11b structured
        output: one JSON-Schema constrained decoder (response_format, tool_choice, strict and auto-mode calls),
        in eight parts: 11b.1 grammar nodes, .2 patterns, .3 values, .4 stacks, .5 the grammar's states and
        masks, .6 the vocabulary's facts, .7 JSON Schema -> nodes, .8 the decoder.
    12. OpenAI protocol: the field tables (validation, docs/api.md, /openapi.json), request reading into
        SamplingParams and prompt ids, response and chunk builders. No sockets.
        12b the Responses and Messages protocols: each body translated into a chat body, the chat stream
        shaped into their items, blocks and events; the response store.
    13. HTTP server: ThreadingHTTPServer, route table, error translator, SSE, limits on slow clients, the
        chat page at /; probes (/health readiness, /live liveness), the drain on SIGTERM, X-Prefix-Hash.
    14. The LLM object (the Python API), memory sizing and warm-up, and the CLI.

Three features cross sections; their steps in the order they run (docs/architecture.md tells each in full):

    Speculative decoding (--speculative-tokens K; the checkpoint's MTP layer drafts, the next forward verifies):
      6  Scheduler.schedule      a drafting sequence's entry: its last token and K drafts (Scheduled.drafts)
      8  make_batch              the window's K + 1 positions, logits at each
      9  Engine._window          which rows are windows; 4 Model.open_window keeps their GDN state and inputs
      7  Sampler._judge          judge_drafts: accept a draft, or draw from the residual
      9  Engine._postprocess     emit the accepted drafts and one token; 4 Model.rollback (8b RankRunner.rollback)
      9  Engine._draft           the MTP layer catches up and drafts K tokens: 8 make_draft_batch,
                                 4 Model.draft (8b RankRunner.draft), 7 Sampler.draw_drafts

    The prefix cache (KV blocks by content key, recurrent-state snapshots):
     12  chat_snapshot_point     where a chat prompt's last message starts (Request.snapshot_at)
      6  Scheduler._resume       admission: 5 PrefixCache.match, the longest cached prefix; share its blocks
      9  Engine._run_copies      restore the snapshot's state and partial block before the forward
      6  Scheduler._chunk        prefill chunks end where a snapshot is wanted
      9  Engine._cache_prefix    full blocks get their keys; Engine._snapshot: 5 PrefixCache.add, the state copied
      9  Engine._release         a snapshot at the end of a generation, for the next turn

    Async scheduling (--async-scheduling; decode step N + 1 is launched before step N is read):
      9  Engine._overlaps        a plain decode step whose rows need nothing from the host goes first
      9  Engine._follow_up       the next plan while a step runs; 6 Scheduler.extend reserves its blocks
      9  Engine._launch          8 batch_fields with unread tokens, gathered from the last step on the device;
                                 8 DeviceQueue.launch queues the forward and 7 Sampler.sample_on_device
      9  Engine._settle          8 DeviceQueue.read: the step's one host read, then events, stops, finishes
"""

from __future__ import annotations

__version__ = "0.1.0"
__license__ = "Apache-2.0"

import argparse
import array
import ast
import atexit
import bisect
import codecs
import collections
import concurrent.futures
import contextlib
import copy
import ctypes
import dataclasses
import datetime
import errno
import fractions
import functools
import gc
import hashlib
import hmac
import http.server
import io
import itertools
import json
import math
import os
import pickle
import queue
import random
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
import urllib.parse
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

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


# -----------------------------------------------------------------------------------------------
# 1. Configuration: what the checkpoint says about the model, and what the user says about the engine.
# -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Architecture:
    """What sets one supported model_type apart. A new architecture is a new row of ARCHITECTURES (and, for a
    new kind of layer, a new row of section 4's MIXERS), not edits across the model."""
    nested: bool               # config.json keeps the text model under "text_config"
    weight_prefix: str         # HF names of the decoder's tensors start with this
    layer_types: tuple[str, ...]   # the mixers its layers may use (keys of MIXERS, section 4)
    gated_attention: bool      # q_proj rows are [q | gate] per head; o = o_proj(attn * sigmoid(gate))
    zero_centred_norm: bool    # norms compute x * (1 + w); otherwise x * w


ARCHITECTURES = {
    "qwen3_5": Architecture(nested=True, weight_prefix="model.language_model.",
                            layer_types=("linear_attention", "full_attention"), gated_attention=True,
                            zero_centred_norm=True),
    "qwen3_5_text": Architecture(nested=False, weight_prefix="model.",
                                 layer_types=("linear_attention", "full_attention"), gated_attention=True,
                                 zero_centred_norm=True),
    "qwen3": Architecture(nested=False, weight_prefix="model.", layer_types=("full_attention",),
                          gated_attention=False, zero_centred_norm=False),
}
SUPPORTED_MODEL_TYPES = tuple(ARCHITECTURES)


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


def parse_model_config(raw: dict, path: Path) -> ModelConfig:
    """Translate an HF config.json (nested qwen3_5, flat qwen3_5_text, or qwen3) into a ModelConfig."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"{path}: unsupported model_type {model_type!r} "
                              f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    arch = ARCHITECTURES[model_type]
    text = raw.get("text_config") if arch.nested else raw
    if not isinstance(text, dict):
        raise CheckpointError(f"{path}: model_type {model_type} needs a 'text_config' object")
    get = lambda k, d=...: _config_field(text, k, path, d)  # noqa: E731
    n_layers = int(get("num_hidden_layers"))
    hybrid = "linear_attention" in arch.layer_types
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4)) if hybrid else 1
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    if len(layer_types) != n_layers or set(layer_types) - set(arch.layer_types):
        raise CheckpointError(f"{path}: layer_types must list {n_layers} entries of "
                              f"{'/'.join(map(repr, arch.layer_types))}")
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
        gated_attention=arch.gated_attention, zero_centred_norm=arch.zero_centred_norm,
        linear_num_key_heads=int(get("linear_num_key_heads", 0)) if hybrid else 0,
        linear_num_value_heads=int(get("linear_num_value_heads", 0)) if hybrid else 0,
        linear_key_head_dim=int(get("linear_key_head_dim", 0)) if hybrid else 0,
        linear_value_head_dim=int(get("linear_value_head_dim", 0)) if hybrid else 0,
        linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)) if hybrid else 0,
        weight_prefix=arch.weight_prefix, quant=quant)


GPU_SPECULATIVE_TOKENS = 2     # --speculative-tokens' default on a GPU (the K that measured best there)
MAX_SPECULATIVE_TOKENS = 8     # --speculative-tokens at most: drafts past a few are rarely all accepted
DEFAULT_MAX_BATCH_SIZE = 16    # running sequences when not sized from GPU memory (the CPU, --devices)
MAX_SIZED_BATCH_SIZE = 256     # the most sequences memory sizing picks (vLLM's max_num_seqs default)


def default_speculative_tokens(devices: str) -> int:
    """The draft length when none is given, by rank 0's device (--devices' first, else --device): on a GPU a
    verify window costs about one step, so drafts pay; on the CPU the torch backend's window and drafts cost
    more than pocket-tiny's accepted drafts save (docs/benchmarks.md, "CPU decode against transformers")."""
    first = devices.split(",")[0].strip()
    on_gpu = first != "cpu" and (first != "auto" or torch.cuda.is_available())
    return GPU_SPECULATIVE_TOKENS if on_gpu else 0


def _option(default, help: str, metavar: str = "", vllm: str = "", alias: str = ""):
    """An EngineOptions field with its one description: `--help`, and docs/api.md's option and flag tables, read
    it. vllm: docs' "vLLM's name" column; alias: a vLLM flag parsed as this one."""
    return field(default=default, metadata={"help": help, "metavar": metavar, "vllm": vllm, "alias": alias})


@dataclass
class EngineOptions:
    """How the engine runs. Every field is also a CLI flag (--max-batch-size, ...) and an LLM(...) keyword."""
    backend: str = _option("auto", "`torch` (the reference, anywhere), `native` (the CUDA library in csrc/, "
                           "`python build.py`), or `auto`: native on a GPU when the library loads and takes the "
                           "dtypes, else torch; the start-up line says which and why", "B")
    device: str = _option("auto", "rank 0's device: `auto` (the first GPU, else the CPU), `cpu`, `cuda`, `cuda:N`",
                          "D")
    devices: str | None = _option(None, "tensor parallelism, one rank per device: `0,1,2,3` (GPUs, NCCL) or "
                                  "`cpu,cpu` (tests, gloo)", "LIST")
    dtype: str = _option("auto", "activation dtype: `auto` (float16 on a GPU, float32 on the CPU), `float16` "
                         "(`half`), `bfloat16` (`bf16`) or `float32` (`float`); the native kernels take float16 or "
                         "float32, so `--backend native --dtype bfloat16` is refused", "T",
                         vllm="same (`half`, `bf16`, `float` too)")
    kv_dtype: str = _option("auto", "KV-cache dtype: `auto` (the activation dtype), `float16`, `bfloat16` or "
                            "`float32`; the native attention needs `auto`", "T")
    max_context: int = _option(4096, "longest prompt + completion of one sequence, in tokens; longer requests are "
                               "refused up front", "N", alias="--max-model-len")
    max_batch_size: int = _option(0, "sequences running at once (= recurrent-state slots); 0: sized from free "
                                  f"memory on a GPU (at most {MAX_SIZED_BATCH_SIZE}), {DEFAULT_MAX_BATCH_SIZE} on "
                                  "the CPU", "N", alias="--max-num-seqs")
    kv_block_size: int = _option(16, "tokens per KV-cache block", "N", alias="--block-size")
    num_kv_blocks: int = _option(0, "KV-cache blocks; 0: on a GPU what `--gpu-memory-utilization` leaves after the "
                                 "weights, on the CPU `--max-batch-size` sequences of `--max-context`", "N")
    gpu_memory_utilization: float = _option(0.9, "share of the GPU's memory this server may hold: weights, cache "
                                            "and workspace, at most what is free, in (0, 1]; per server, as in vLLM "
                                            "(two at 0.45 share a card)", "F", vllm="same")
    prefill_token_budget: int = _option(512, "tokens per engine step: prefill chunks plus one per decoding "
                                        "sequence", "N", alias="--max-num-batched-tokens")
    prefix_cache: bool = _option(True, "prefix caching: a prompt that starts like an earlier one (an agent's next "
                                 "turn) resumes from cached KV blocks and recurrent-state snapshots and prefills only "
                                 "the rest; exact (the answer is the one without it). "
                                 "`usage.prompt_tokens_details.cached_tokens` says how many prompt tokens were "
                                 "resumed (`docs/architecture.md`, \"The prefix cache\"); `--no-prefix-cache` turns "
                                 "it off", alias="--enable-prefix-caching")
    prefix_cache_memory: int = _option(-1, "MiB per device for the prefix cache's recurrent-state snapshots (hybrid "
                                       "models: one snapshot is the state of every linear-attention layer, 147 MiB "
                                       "for the 27B at TP1, 37 MiB at TP4); -1: one snapshot per state slot "
                                       "(`--max-batch-size`), taken out of the memory the KV cache is sized from",
                                       "MIB")
    smoke_layers: int = _option(0, "run only the first N decoder layers (smoke tests of huge checkpoints); 0: all",
                                "N")
    load_format: str = _option("auto", "`auto` (the checkpoint's safetensors files) or `dummy`: random weights "
                               "of the exact dtypes, shapes and FP8 block scales the checkpoint would hold, made on "
                               "the device from `config.json` alone (+ its tokenizer, else a built-in byte-level "
                               "one), seeded by `--seed`: benchmarks without the download", "F", vllm="same")
    fp8_dense_memory: int = _option(4096, "MiB the torch backend may hold as dense copies of the FP8 weights, "
                                    "dequantised once at load so that no step dequantises a weight again (in the "
                                    "activation dtype: 4 bytes per weight on the CPU); when the copy of every FP8 "
                                    "weight would not fit, they all stay FP8 in memory, dequantised per use (a 27B "
                                    "checkpoint does); 0: always FP8. The start-up line says which", "MIB")
    seed: int = _option(0, "seeds the seeds drawn for requests that send no `seed`: the same `--seed`, the same "
                        "answers", "N", vllm="same")
    speculative_tokens: int | None = _option(None, "speculative decoding: the checkpoint's MTP layer (`mtp.*`) "
                                             "drafts K tokens per sequence and step, the next forward verifies them "
                                             "(greedy output identical, sampling distributed as the target's; "
                                             "`docs/architecture.md`, \"Speculative decoding\"); 0 turns it off; a "
                                             "checkpoint without `mtp.*` runs without it and says so once. None "
                                             f"(the default): {GPU_SPECULATIVE_TOKENS} on a GPU, 0 on the CPU, "
                                             "where a draft costs more than its accepted tokens save (both measured: "
                                             f"`docs/benchmarks.md`); at most {MAX_SPECULATIVE_TOKENS}", "K",
                                             vllm="`--num-speculative-tokens` (in `--speculative-config`)")
    enforce_eager: bool = _option(False, "run every decode step op by op: no CUDA graphs (CUDA) and no launch-list "
                                  "replay (native backend) of the decode forward (`docs/architecture.md`, \"CUDA "
                                  "graphs\")", vllm="same")
    async_scheduling: bool = _option(True, "plan and launch each plain decode step before reading the one before "
                                     "it, so that the host's work (streaming, stop checks) overlaps the device's; "
                                     "outputs are the same (up to float rounding: a stopped sequence's dropped row "
                                     "is still in the next step's batch). Steps with prefill, speculation or tensor "
                                     "parallelism run one at a time; a step with a grammar (structured output, "
                                     "tools) is split: its forward launches at once, its sampling after the host's "
                                     "read "
                                     "(`docs/architecture.md`, \"Async scheduling\"); `--no-async-scheduling` turns "
                                     "it off", vllm="same")
    quiet: bool = _option(False, "no start-up log lines")
    collective_timeout: float = _option(30.0, "tensor parallelism: seconds an all-reduce may wait for the other "
                                        "ranks; past it the group is stopped and the engine reports it "
                                        "(`docs/architecture.md`, \"Tensor parallelism\")", "S")
    collective_warmup_timeout: float = _option(300.0, "the same bound while the ranks connect and for their first "
                                               "two steps, which include kernel JIT compilation", "S")

    def __post_init__(self):
        if self.speculative_tokens is None:                    # the per-device default
            self.speculative_tokens = default_speculative_tokens(self.devices or self.device)


def _log(opts: EngineOptions, msg: str):
    if not opts.quiet:
        print(f"pocketllm: {msg}", file=sys.stderr, flush=True)


# The request-field tables. Every field a request may carry is one Field row, written once: its JSON type,
# range or enum, default, the layer that consumes it and its policy. Request validation (read_fields), the
# SamplingParams the engine receives, the field tables of docs/api.md and /openapi.json all come from the rows.
# SamplingParams' fields carry their own rows; section 12 composes them with the protocol's rows per endpoint.

HONOURED = "honoured"
NO_EFFECT = "accepted, no effect"
DEFAULT_ONLY = "refused unless default"
JSON_KINDS = {"boolean": bool, "integer": int, "number": float, "string": str, "array": list, "object": dict}
MAX_N = 16                     # choices per request
MAX_STOP = 16                  # stop strings per request
MAX_TOP_LOGPROBS = 20          # alternatives per token (OpenAI's chat limit)


@dataclass(frozen=True)
class Field:
    """One request field. A value of the wrong kind, out of range or not in the enum is a RequestError naming it."""
    name: str = ""                     # filled in from the SamplingParams field / the table key
    kind: str = "any"                  # JSON type (a JSON_KINDS key), or "any" when `read` checks the shape
    default: Any = None                # what an absent or null field means; None = unset
    lo: float | None = None            # inclusive lower bound (exclusive when lo_open)
    hi: float | None = None            # inclusive upper bound
    lo_open: bool = False
    enum: tuple = ()                   # the allowed values
    layer: str = "sampler"             # who consumes it: sampler | engine | template | parser | server
    policy: str = HONOURED             # HONOURED | NO_EFFECT | DEFAULT_ONLY
    allowed: tuple = ()                # DEFAULT_ONLY: the values that leave the answer unchanged
    required: bool = False
    read: Callable | None = None       # nested values: read(value, param, vocab_size) -> the normalised value
    relate: Callable | None = None     # checks against other fields: relate(values, param) -> the final value
    schema: dict | None = None         # JSON schema of a nested value (else made from kind, range and enum)
    shape: str = ""                    # docs: the type column, when kind and range do not say it all
    default_text: str = ""             # docs: the default column, when `default` does not say it
    why: str = ""                      # docs: what it does, or why it has no effect or is refused


def _json_type(value) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _check_type(value, kind: type, param: str):
    """value as `kind` (bool, int, float, str, list, dict); an int is a valid float, a bool is neither."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value) if abs(value) < 2 ** 1000 else math.inf     # 10**400: no float, refused below
    if not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
        raise RequestError(f"'{param}' must be {_json_type(kind())}, got {_json_type(value)}", param=param)
    if kind is float and not math.isfinite(value):
        raise RequestError(f"'{param}' must be a finite number", param=param)
    return value


def _number_text(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _range_text(row: Field) -> str:
    """'between 0 and 2', 'greater than 0 and at most 1', 'at least 1'."""
    low = None if row.lo is None else f"{'greater than' if row.lo_open else 'at least'} {_number_text(row.lo)}"
    high = None if row.hi is None else f"at most {_number_text(row.hi)}"
    if low and high and not row.lo_open:
        return f"between {_number_text(row.lo)} and {_number_text(row.hi)}"
    return " and ".join(t for t in (low, high) if t)


def read_field(row: Field, value, param: str, vocab_size: int | None = None):
    """One value checked against its row (absent or null: the row's default; null is refused where the row is
    required, as for a value inside a map or an array)."""
    if value is None and row.required:
        raise RequestError(f"'{param}' must not be null", param=param)
    if value is None:
        return type(row.default)(row.default) if isinstance(row.default, (list, dict)) else row.default
    if row.policy == DEFAULT_ONLY and row.allowed and value not in row.allowed:
        raise RequestError(f"'{param}' is not supported by this server (accepted only as "
                           f"{' or '.join(json.dumps(a) for a in row.allowed)})", param=param, code="unsupported_field")
    if row.kind in JSON_KINDS:
        value = _check_type(value, JSON_KINDS[row.kind], param)
    if row.enum and value not in row.enum:
        raise RequestError(f"'{param}' must be one of {', '.join(map(str, row.enum))}, got {value!r}", param=param)
    if ((row.lo is not None and (value <= row.lo if row.lo_open else value < row.lo)) or
            (row.hi is not None and value > row.hi)):
        raise RequestError(f"'{param}' must be {_range_text(row)}, got {value!r}", param=param)
    return row.read(value, param, vocab_size) if row.read else value


def _token_id(value, param: str, vocab_size: int | None) -> int:
    value = _check_type(value, int, param)
    if value < 0 or (vocab_size is not None and value >= vocab_size):
        raise RequestError(f"'{param}' must hold token ids between 0 and {(vocab_size or 0) - 1}, got {value}",
                           param=param)
    return value


def _token_ids(value, param: str, vocab_size: int | None) -> list[int]:
    """A JSON array of token ids, each in [0, vocab_size); a bad one is named by its index."""
    return [_token_id(t, f"{param}[{i}]", vocab_size) for i, t in enumerate(_check_type(value, list, param))]


def _some_token_ids(value, param: str, vocab_size: int | None) -> list[int]:
    """A non-empty JSON array of token ids, each in [0, vocab_size)."""
    ids = _token_ids(value, param, vocab_size)
    if not ids:
        raise RequestError(f"'{param}' must hold at least one token id (null: every token)", param=param)
    return ids


def _stop_strings(value, param: str, vocab_size: int | None) -> list[str]:
    """A string or an array of at most MAX_STOP non-empty strings -> the list."""
    if isinstance(value, str):
        if not value:
            raise RequestError(f"'{param}' must not be empty", param=param)
        return [value]
    stop = _check_type(value, list, param)
    if len(stop) > MAX_STOP:
        raise RequestError(f"'{param}' holds at most {MAX_STOP} strings, got {len(stop)}", param=param)
    for i, s in enumerate(stop):
        if not _check_type(s, str, f"{param}[{i}]"):
            raise RequestError(f"'{param}[{i}]' must not be empty", param=f"{param}[{i}]")
    return list(stop)


LOGIT_BIAS_VALUE = Field(kind="number", lo=-100, hi=100, required=True)


def _logit_bias(value, param: str, vocab_size: int | None) -> dict[int, float]:
    """{token id (an int, or its decimal string as JSON sends it): bias in [-100, 100]}; a bad entry is named by
    its key (`logit_bias.5`)."""
    out = {}
    for key, bias in value.items():
        where = f"{param}.{key}"
        if isinstance(key, str) and re.fullmatch(r"\d+", key):
            key = int(key)
        if not isinstance(key, int) or isinstance(key, bool):
            raise RequestError(f"'{param}' keys must be token ids as strings, got {key!r}", param=where)
        out[_token_id(key, where, vocab_size)] = read_field(LOGIT_BIAS_VALUE, bias, where)
    return out


def _top_k(value: int, param: str, vocab_size: int | None) -> int:
    return 0 if value == -1 else value


def _logits_processors(value, param: str, vocab_size: int | None) -> list:
    if not all(callable(p) for p in value):
        raise RequestError(f"'{param}' must hold callables f(choice_ids, logits) -> logits", param=param)
    return list(value)


TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "x-token-id": True}}


def _sampling(default, kind: str, **row):
    """A SamplingParams field carrying its row of the request-field tables."""
    if isinstance(default, (list, dict)):
        return field(default_factory=type(default), metadata={"row": Field(kind=kind, default=default, **row)})
    return field(default=default, metadata={"row": Field(kind=kind, default=default, **row)})


@dataclass
class SamplingParams:
    """One request's sampling options. Each field carries its row of the request-field tables (type, range,
    meaning): validate() checks them, and the HTTP endpoints, docs/api.md and /openapi.json use the same rows."""
    max_tokens: int = _sampling(16, "integer", lo=1, layer="engine",
                                why="completion tokens at most; prompt + max_tokens must fit the context")
    temperature: float = _sampling(1.0, "number", lo=0, hi=2, why="0 is greedy")
    top_p: float = _sampling(1.0, "number", lo=0, lo_open=True, hi=1, why="nucleus mass kept")
    top_k: int = _sampling(0, "integer", lo=-1, read=_top_k, why="keep the k most likely; 0 or -1: off (vLLM extra)")
    min_p: float = _sampling(0.0, "number", lo=0, hi=1,
                             why="drop tokens below min_p * p(most likely) (vLLM extra)")
    seed: int | None = _sampling(None, "integer", lo=-2 ** 63, hi=2 ** 64 - 1,
                                 why="a seeded request samples the same tokens whatever else runs")
    presence_penalty: float = _sampling(0.0, "number", lo=-2, hi=2,
                                        why="subtracted once per token already generated (OpenAI)")
    frequency_penalty: float = _sampling(0.0, "number", lo=-2, hi=2,
                                         why="subtracted per occurrence in the generated tokens (OpenAI)")
    repetition_penalty: float = _sampling(1.0, "number", lo=0, lo_open=True, hi=10,
                                          why="divides positive (multiplies negative) logits of tokens in the "
                                              "prompt and the output (HF; vLLM extra)")
    logit_bias: dict[int, float] = _sampling({}, "object", read=_logit_bias,
                                             shape="object: token id (decimal string; an int in Python) -> number -100..100",
                                             schema={"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                                                     "additionalProperties": {"type": "number", "minimum": -100,
                                                                              "maximum": 100}},
                                             why="added to the token's logit")
    allowed_token_ids: list[int] | None = _sampling(None, "array", read=_some_token_ids,
                                                    schema={**TOKEN_IDS_SCHEMA, "minItems": 1},
                                                    shape="non-empty array of token ids (0..vocab-1)",
                                                    why="only these tokens are sampled; null: every token (vLLM extra)")
    min_tokens: int = _sampling(0, "integer", lo=0, layer="engine",
                                why="EOS and stop tokens are masked until this many tokens exist; at most the "
                                    "max tokens (vLLM extra)")
    stop: list[str] = _sampling([], "any", read=_stop_strings, layer="engine",
                                shape=f"string or array of up to {MAX_STOP} non-empty strings",
                                schema={"anyOf": [{"type": "string", "minLength": 1},
                                                  {"type": "array", "maxItems": MAX_STOP,
                                                   "items": {"type": "string", "minLength": 1}}]},
                                why="matched across token boundaries; not returned")
    stop_token_ids: list[int] = _sampling([], "array", read=_token_ids, layer="engine", schema=TOKEN_IDS_SCHEMA,
                                          shape="array of token ids (0..vocab-1)",
                                          why="token ids that end the choice (vLLM extra)")
    ignore_eos: bool = _sampling(False, "boolean", layer="engine",
                                 why="do not stop on the checkpoint's EOS tokens (vLLM extra)")
    logprobs: int | None = _sampling(None, "integer", lo=0, hi=MAX_TOP_LOGPROBS,
                                     why="the sampled token's logprob and this many alternatives, from the raw "
                                         "distribution (before penalties and temperature)")
    n: int = _sampling(1, "integer", lo=1, hi=MAX_N, layer="engine",
                       why="choices; the prompt is prefilled once and forked")
    logits_processors: list = _sampling([], "array", read=_logits_processors, shape="array of callables",
                                        why="Python only: f(choice_ids, logits (V,) fp32) -> logits, after "
                                            "penalties and bias")

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Every field checked against its row and normalised in place (a stop string becomes a list, top_k -1
        becomes 0); min_tokens against max_tokens. RequestError names the field."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, read_field(SAMPLING_FIELDS[f.name], getattr(self, f.name), f.name, vocab_size))
        if self.min_tokens > self.max_tokens:
            raise RequestError(f"'min_tokens' ({self.min_tokens}) must not exceed the max tokens ({self.max_tokens})",
                               param="min_tokens")
        return self


# name -> row, for every SamplingParams field.
SAMPLING_FIELDS = {f.name: dataclasses.replace(f.metadata["row"], name=f.name)
                   for f in dataclasses.fields(SamplingParams)}
# The fields a checkpoint's generation_config.json may default (as vLLM reads it).
GENERATION_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


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
    packed: Any = None                 # dense fp16 weight: torch's fp16 GEMM copy of it (CPU, pack_half)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)

    def to(self, device, dtype: torch.dtype | None = None) -> "Linear":
        """Move to a device; a dense weight also takes the activation dtype (FP8 stays FP8)."""
        if self.scale is None:
            return Linear(self.weight.to(device, dtype or self.weight.dtype))
        return Linear(self.weight.to(device), self.scale.to(device), self.block)


class MissingTensorError(CheckpointError):
    """A tensor the loader asks for is not in the checkpoint (`name`): an optional part (the MTP layer) is then
    left out, anything else refused."""

    def __init__(self, path: Path, name: str, why: str = ""):
        super().__init__(f"{path}: missing tensor '{name}'{why}")
        self.name = name


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
            raise MissingTensorError(self.path, name)
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


def _merge_ranges(ranges: Ranges | None, full: int) -> Ranges | None:
    """Join adjacent ranges; None when they cover the whole dimension (tensor parallelism of degree 1)."""
    out: Ranges = []
    for a, b in ranges or []:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return None if not out or out == [(0, full)] else out


def _scale_pieces(ranges: Ranges | None, block: int, full: int, whole_blocks: bool, name: str,
                  what: str) -> tuple[int, list[int]]:
    """A rank's slice along one dimension of an FP8 weight, cut into g-element pieces that each lie inside one
    stored scale block: (g, the stored block of each piece). g is block itself when every slice boundary falls
    on a block boundary; a ragged split (192 of 384 rows) gets the largest divisor of block on which they all
    fall (64), so each rank keeps exactly the scales that cover its rows. The tensor's end needs no alignment
    (its last stored block is partial too). whole_blocks refuses a ragged split (the native kernels' grid)."""
    ranges = ranges or [(0, full)]
    g = block
    for a, b in ranges:
        g = math.gcd(g, a, 0 if b == full else b)
    if g != block and whole_blocks:
        a, b = next((a, b) for a, b in ranges if a % block or (b % block and b != full))
        raise CheckpointError(f"tensor '{name}': {what} slice [{a}, {b}) does not fall on {block}-element block "
                              f"boundaries (the native FP8 kernels need whole blocks; --backend torch splits "
                              f"anywhere)")
    return g, [i // block for a, b in ranges for i in range(a, b, g)]


def load_linear(ckpt: Checkpoint, prefix: str, shape: tuple[int, int], rows: Ranges | None = None,
                cols: Ranges | None = None, whole_blocks: bool = False) -> Linear:
    """Load `prefix.weight` (+ `prefix.weight_scale_inv` when FP8), checking the full shape, reading only
    the requested row/column ranges. FP8 stays FP8, with the block scales that cover the slice (on a finer
    grid for a ragged split, see _scale_pieces); dense weights stay in their stored dtype."""
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
        raise MissingTensorError(ckpt.path, sname, f" (FP8 weight '{name}' needs its block scales)")
    if ckpt.shape(sname) != want:
        raise CheckpointError(f"tensor '{sname}' has shape {ckpt.shape(sname)}, expected {want} "
                              f"(one scale per {bn}x{bk} block of {list(shape)})")
    gn, srows = _scale_pieces(rows, bn, shape[0], whole_blocks, name, "row")
    gk, scols = _scale_pieces(cols, bk, shape[1], whole_blocks, name, "column")
    scale = ckpt.read(sname).to(torch.float32)[srows][:, scols]          # (ceil(N'/gn), ceil(K'/gk))
    return Linear(weight, scale.contiguous(), (gn, gk))


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


# -----------------------------------------------------------------------------------------------
# 3. Backends. The model calls a short list of ops; TorchOps is the reference that runs anywhere.
#    The native backend (3b) implements the same methods with the CUDA library. docs/abi.md lists them.
# -----------------------------------------------------------------------------------------------

def dequantize(w: Linear, dtype: torch.dtype) -> torch.Tensor:
    """FP8 weight * its 128x128 block scale -> dense (N, K), for one layer at a time. One (N, K) buffer is
    allocated and scaled in place, one row of blocks at a time (edge blocks may be ragged)."""
    if w.scale is None:
        return w.weight.to(dtype)
    k, (bn, bk) = w.weight.shape[1], w.block
    out = w.weight.to(dtype)                                             # (N, K)
    cols = w.scale.to(dtype).repeat_interleave(bk, dim=1)[:, :k]         # (N/bn, K): each scale over its columns
    for i in range(cols.shape[0]):
        out[i * bn:(i + 1) * bn].mul_(cols[i])
    return out


SAFE_ROW_MAX = 2.0 ** 15   # an fp16 intermediate row is scaled to at most this (fp16 stops at 65504)


def safe_row_scale(h: torch.Tensor) -> torch.Tensor:
    """(T, 1): per row, the power of two that brings max |h| to at most SAFE_ROW_MAX (1 when it already is, and
    for rows with inf/NaN). Dividing by a power of two is exact, so the row keeps its relative precision."""
    amax = h.abs().amax(-1, keepdim=True).float()                        # (T, 1)
    exponent = torch.frexp(amax / SAFE_ROW_MAX).exponent                 # amax / 2^15 = m * 2^e, m in [0.5, 1)
    need = (amax > SAFE_ROW_MAX) & amax.isfinite()
    return torch.where(need, torch.exp2(exponent.float()), torch.ones_like(amax))


def _rope(x, cos, sin):
    """Rotate-half RoPE on the first 2 * cos.shape[-1] dims of each head; the rest pass through."""
    r = cos.shape[-1]
    x1, x2, rest = x[..., :r].float(), x[..., r:2 * r].float(), x[..., 2 * r:]
    return torch.cat([(x1 * cos - x2 * sin).to(x.dtype), (x2 * cos + x1 * sin).to(x.dtype), rest], -1)


def decode_delta_step(q, k, v, g, beta, S):
    """One token of the gated delta rule for B sequences, updating S in place. q, k (B, H, Dk); v (B, H, Dv);
    g, beta (B, H); S (B, H, Dk, Dv) fp32 -> o (B, H, Dv). Batched (1, Dk) x (Dk, Dv) matmuls over the B * H
    heads: v - k S and S + k^T delta are one baddbmm each (einsum's own overhead was a third of the step)."""
    B, H, Dk, Dv = S.shape
    S3 = S.view(B * H, Dk, Dv).mul_(g.exp().view(B * H, 1, 1))            # decayed
    k_row = k.reshape(B * H, 1, Dk)
    delta = torch.baddbmm(v.reshape(B * H, 1, Dv), k_row, S3, alpha=-1).mul_(beta.reshape(B * H, 1, 1))
    S3.baddbmm_(k_row.transpose(1, 2), delta)                              # (B*H, Dk, Dv)
    return torch.bmm(q.reshape(B * H, 1, Dk), S3).view(B, H, Dv)


def prefill_delta_chunked(q, k, v, g, beta, S, chunk: int = 64):
    """The gated delta rule over m tokens of one sequence in chunks (the WY/UT form).
    q, k (m, H, Dk) normalised; v (m, H, Dv); g, beta (m, H); S (H, Dk, Dv) fp32 initial state.
    Within a chunk with cumulative log-decay c: the corrections u = (I + L)^-1 (beta v - beta k_decayed S),
    where L is the strictly lower part of (beta k k^T) * exp(c_i - c_j); outputs read S and the chunk's u.
    Everything that does not read S is computed for all N chunks at once, (N, H, C, .) tensors; the loop over
    chunks is the state's recurrence alone (a few matmuls each: per-call cost, not arithmetic, is what a CPU
    prefill of small heads pays). The last chunk is padded with tokens of g = beta = k = v = 0, which leave S,
    the decay and the real tokens' outputs as they are."""
    m, H, Dv = v.shape
    pad = -m % chunk
    N = (m + pad) // chunk

    def split(t):                                                          # (m, H, ...) -> (N, H, C, ...)
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (0, pad))
        return t.view(N, chunk, *t.shape[1:]).transpose(1, 2)
    qc, kc, vc, gc, bc = (split(t) for t in (q, k, v, g, beta))           # (N, H, C, D), gc, bc (N, H, C)
    cum = gc.cumsum(-1)                                                     # (N, H, C)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (N, H, C, C)
    kb = kc * bc[..., None]
    lower = (kb @ kc.transpose(-1, -2) * decay).tril(-1)                    # L; solved as I + L (unitriangular)
    rhs = torch.cat([vc * bc[..., None], kb * cum.exp()[..., None]], -1)    # (N, H, C, Dv + Dk)
    sol = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)
    sol_v, sol_k = sol[..., :Dv], sol[..., Dv:]                             # u = sol_v - sol_k @ S
    attn = (qc @ kc.transpose(-1, -2)) * decay                              # (N, H, C, C) causal, incl. diagonal
    last = cum[..., -1:]                                                    # (N, H, 1)
    q_decayed = qc * cum.exp()[..., None]
    k_to_end = (kc * (last - cum).exp()[..., None]).transpose(-1, -2)      # (N, H, Dk, C)
    fade = last.exp()[..., None]                                            # (N, H, 1, 1)
    out = v.new_empty(N, H, chunk, Dv)
    for i in range(N):
        u = sol_v[i] - sol_k[i] @ S                                         # (H, C, Dv): delta-rule corrections
        out[i] = q_decayed[i] @ S + attn[i] @ u
        S = S * fade[i] + k_to_end[i] @ u
    return out.transpose(1, 2).reshape(N * chunk, H, Dv)[:m], S


def merge_attention(parts):
    """Softmax attention over disjoint sets of keys, combined exactly: parts [(out (H, m, D), logsumexp (H, m))],
    each out weighted by exp(its logsumexp - the logsumexp of them all). -> (H, m, D) fp32."""
    if len(parts) == 1:
        return parts[0][0].float()
    lse = torch.stack([l for _, l in parts])                             # (P, H, m)
    w = torch.softmax(lse, 0)[..., None]                                 # (P, H, m, 1)
    return sum(o.float() * w[p] for p, (o, _) in enumerate(parts))


FEW_ROWS = 8   # up to this many rows (a decode step's), norms take a vector norm: torch's rms_norm runs ~6 kernels


def _as(x, dtype):
    """x in dtype, without a torch call when it is already (x.to(dtype) costs a dispatch even then)."""
    return x if x.dtype == dtype else x.to(dtype)


def _l2norm(x, eps: float = 1e-6):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class TorchOps:
    """The reference ops in plain torch. Shapes: T tokens of a flattened batch, B sequences.

    Activations are fp16 on GPUs (sm_75 has no bf16), so wherever a value can pass fp16's 65504 the ops work in
    fp32: `linear(..., torch.float32)` (row-parallel outputs, logits), `silu_mul_linear` (the MLP) and the fp32
    residual stream of `add_rmsnorm`. See docs/architecture.md, "Number formats"."""
    name = "torch"

    def embed(self, ids, table, dtype):
        return table[ids].to(dtype)                                      # (T, D)

    def zeros(self, shape, dtype, device):
        return torch.zeros(shape, dtype=dtype, device=device)

    def contiguous(self, t):
        return t.contiguous()

    def write_columns(self, dst, src, start):
        """dst[:, start:start + N] = src (R, N): a rank's columns of the vocab-parallel logits."""
        dst[:, start:start + src.shape[1]] = src

    def embed_shard(self, ids, table, lo, dtype):
        """The vocab-parallel lookup on one rank: table holds rows [lo, lo + V') of the vocabulary; rows of ids
        outside them are zero."""
        local = ids - lo                                                 # (T,)
        own = (local >= 0) & (local < table.shape[0])
        x = torch.zeros(ids.numel(), table.shape[1], dtype=dtype, device=table.device)   # (T, D)
        if table.shape[0]:
            x[own] = table[local[own]].to(dtype)
        return x

    def rmsnorm(self, x, w, eps):
        """Zero-centred: weights are stored as w, the norm multiplies by (1 + w); in fp32. A decode step's few rows
        take rsqrt(mean(x^2) + eps) from one vector norm (torch's rms_norm runs ~6 kernels on any size)."""
        if x.shape[0] > FEW_ROWS:
            return _as(F.rms_norm(x.float(), w.shape, self._one_plus(w), eps), x.dtype)
        xf = _as(x, torch.float32)
        return _as((xf * self._inv_rms(xf, eps, xf.shape[-1])).mul_(self._one_plus(w)), x.dtype)

    def _inv_rms(self, x, eps: float, divisor: float):
        """(..., 1) rsqrt(sum(x^2) / divisor + eps) over x's last dim from one vector norm: 3 torch calls, where
        torch's rms_norm runs ~6 kernels on any size."""
        n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        e = self._derived(x.device, ("eps", eps), lambda: torch.tensor(eps, device=x.device))
        return torch.addcmul(e, n, n, value=1.0 / divisor).rsqrt_()

    def _one_plus(self, w):
        """1 + w of a norm weight, made once per weight."""
        return self._derived(w, "1+w", lambda: 1.0 + w.float())

    def _f32(self, w):
        """A small bf16 weight (conv taps, dt_bias, a norm's weight) in fp32, converted once, not at every step."""
        return w if w.dtype == torch.float32 else self._derived(w, "fp32", lambda: w.float())

    def add_rmsnorm(self, x, residual, w, eps, dtype=None):
        """residual + x (x fp32 or the activation dtype) in the fp32 residual stream; the norm in `dtype`
        (default x's)."""
        residual = residual + _as(x, torch.float32)                      # the residual stream stays fp32
        return _as(self.rmsnorm(residual, w, eps), dtype or x.dtype), residual

    def prenorm(self, x, residual, w, eps, dtype=None):
        """add_rmsnorm whose output feeds only projections (linear, linear_parts, mlp, gdn_gates_linear): the
        native backend computes it inside them."""
        return self.add_rmsnorm(x, residual, w, eps, dtype)

    def linear(self, x, w: Linear, dtype=None):
        """x @ w^T in `dtype` (default x's); float32 computes in float32, so sums past 65504 stay finite."""
        x = _as(x, torch.float32) if dtype == torch.float32 else x
        if w.packed is not None and x.dtype == torch.float32 and x.shape[0]:
            return torch.ops.quantized.linear_dynamic_fp16(x, w.packed)  # (T, N): fp16 weights, fp32 sums
        if w.scale is None:
            return F.linear(x, w.weight if w.weight.dtype == x.dtype else w.weight.to(x.dtype))   # (T, N)
        (n, k), bn = w.weight.shape, w.block[0]
        step = max(1, (1 << 20) // (k * bn)) * bn                        # FP8: dequantise ~1M weights at a time
        out = x.new_empty(x.shape[0], n)
        for r in range(0, n, step):
            tile = Linear(w.weight[r:r + step], w.scale[r // bn:(r + step) // bn], w.block)
            out[:, r:r + step] = x @ dequantize(tile, x.dtype).t()
        return out

    def linear_parts(self, x, w: Linear, sizes: list[int], dtype=None) -> tuple[torch.Tensor, ...]:
        """linear() of stacked projections, split into their (T, N_p) outputs (views here)."""
        return self.linear(x, w, dtype).split_with_sizes(sizes, -1)     # (Tensor.split's wrapper is Python)

    def silu_mul(self, g, u):
        return (F.silu(g.float()) * u.float()).to(g.dtype)

    def silu_mul_linear(self, g, u, w: Linear, dtype):
        """down_proj(silu(g) * u) -> (T, N) fp32, g, u (T, I) fp32. The intermediate is held in `dtype`; in fp16
        each row is first divided by its safe_row_scale and the output row multiplied back (as the kernels do)."""
        h = F.silu(_as(g, torch.float32)).mul_(_as(u, torch.float32))    # (T, I) fp32
        if dtype == torch.float32:
            return self.linear(h, w, torch.float32)
        s = safe_row_scale(h)                                            # (T, 1)
        return self.linear((h / s).to(dtype), w, torch.float32) * s

    def mlp(self, x, gate_up: Linear, down: Linear, dtype):
        """down(silu(x gate^T) * (x up^T)) -> (T, N) fp32, gate_up the rows [gate | up] stacked."""
        g, u = self.linear(x, gate_up, torch.float32).chunk(2, -1)       # (T, I) each
        return self.silu_mul_linear(g, u, down, dtype)

    def sigmoid_mul(self, x, gate):
        return _as(_as(x, torch.float32) * torch.sigmoid(_as(gate, torch.float32)), x.dtype)

    def qk_norm_rope(self, q, k, q_w, k_w, eps, positions, inv_freq):
        """q (T, Hq, Dh) and k (T, Hk, Dh) normed per head and rotated, as one (T, Hq + Hk, Dh) tensor: the
        norm's weight is (1 + q_w) on q's heads and (1 + k_w) on k's."""
        Hq, Hk = q.shape[1], k.shape[1]
        w = self._derived(q_w, ("qk", id(k_w), Hq, Hk), lambda: torch.cat(
            [self._one_plus(q_w).expand(Hq, -1), self._one_plus(k_w).expand(Hk, -1)]))   # (Hq + Hk, Dh)
        qk = _as(torch.cat([q, k], 1), torch.float32)                   # (T, Hq + Hk, Dh)
        if qk.shape[0] > FEW_ROWS:
            qk = _rope(F.rms_norm(qk, q_w.shape, None, eps) * w, *self._cos_sin(positions, inv_freq))
        else:                                                            # a decode step's few rows
            qk = (qk * self._inv_rms(qk, eps, qk.shape[-1])).mul_(w)     # (T, H, Dh)
            M = self._rotation(positions, inv_freq)                       # (T, R, R)
            rot = qk.narrow(2, 0, M.shape[-1])                           # (T, H, R) rotated in place
            rot.copy_(torch.bmm(rot, M))
        return _as(qk.narrow(1, 0, Hq), q.dtype), _as(qk.narrow(1, Hq, Hk), k.dtype)

    def _rotation(self, positions, inv_freq):
        """(T, R, R) RoPE of a decode step's few positions as matrices: [x1 | x2] @ M = [x1 cos - x2 sin |
        x2 cos + x1 sin], one batched matmul per layer instead of ~12 calls; made once per step (from _cos_sin's
        memo, so forgetting that one forgets both)."""
        last, cos_sin = self.__dict__.get("_rotation_memo"), self._cos_sin(positions, inv_freq)
        if last is None or last[0] is not cos_sin[0]:
            (T, _, r), device = cos_sin[0].shape, cos_sin[0].device
            basis = self._derived(device, ("rotation", r), lambda: self._rotation_basis(r, device))   # (R, R * R)
            M = torch.cat(cos_sin, -1).view(T, 2 * r).mm(basis).view(T, 2 * r, 2 * r)   # [cos | sin] (T, R) @ basis
            last = self._rotation_memo = (cos_sin[0], M)
        return last[1]

    @staticmethod
    def _rotation_basis(r: int, device) -> torch.Tensor:
        """(2r, 4r^2): row i (a cos) and row r + i (a sin) put their value where the rotation matrix M holds it,
        so M's entries are one matmul of a step's [cos | sin] by it: M[i, i] = M[r+i, r+i] = cos_i, M[i, r+i] = sin_i,
        M[r+i, i] = -sin_i (exact: every entry is one value times 1 or -1)."""
        basis = torch.zeros(2 * r, 2 * r, 2 * r)
        i = torch.arange(r)
        basis[i, i, i] = basis[i, i + r, i + r] = 1.0
        basis[i + r, i, i + r], basis[i + r, i + r, i] = 1.0, -1.0
        return basis.view(2 * r, 4 * r * r).to(device)

    def _cos_sin(self, positions, inv_freq):
        """(T, 1, R/2) cos and sin of the positions' angles: every attention layer of a step reads the same
        positions tensor, so they are computed once per step (the memo holds the tensors it compares)."""
        last = self.__dict__.get("_rope_memo")
        if last is None or last[0] is not positions or last[1] is not inv_freq:
            angles = positions.float()[:, None] * inv_freq[None, :]      # (T, R/2)
            last = self._rope_memo = (positions, inv_freq, angles.cos()[:, None, :], angles.sin()[:, None, :])
        return last[2], last[3]

    def qk_norm_rope_kv(self, q, k, v, q_w, k_w, eps, positions, inv_freq, k_cache, v_cache, slot_mapping):
        """qk_norm_rope, then kv_write of the rotated k and v: returns q."""
        q, k = self.qk_norm_rope(q, k, q_w, k_w, eps, positions, inv_freq)
        self.kv_write(k, v, k_cache, v_cache, slot_mapping)
        return q

    def kv_write(self, k, v, k_cache, v_cache, slot_mapping):
        for cache, x in ((k_cache, k), (v_cache, v)):                  # index_put_: no Python indexing
            cache.view(-1, *cache.shape[2:]).index_put_((slot_mapping,), _as(x, cache.dtype))   # (nb * bs, ...)

    def attention(self, q, k_cache, v_cache, block_tables, context_lens, query_start, scale, gate=None):
        """Paged causal attention (T, Hq, Dh); with gate (T, Hq * Dh), times sigmoid(gate) (gated attention)."""
        if gate is not None:
            o = self.attention(q, k_cache, v_cache, block_tables, context_lens, query_start, scale)
            return self.sigmoid_mul(o.reshape(gate.shape), gate).view_as(o)
        if q.shape[0] == context_lens.numel():                          # decode: every sequence at once
            return self._decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
        out = torch.empty_like(q)                                        # (T, Hq, Dh)
        for b in range(len(context_lens)):
            q0, q1, n = int(query_start[b]), int(query_start[b + 1]), int(context_lens[b])
            out[q0:q1] = self._prefill_attention(q[q0:q1], k_cache, v_cache, block_tables[b], n, scale)
        return out

    LONG_DECODE = 2048    # cached positions past which decode on the CPU reads K/V in place, sequence by sequence

    def _decode_attention(self, q, k_cache, v_cache, block_tables, context_lens, scale):
        """One query per sequence, B sequences in one batched pass over their block tables (B, nb): each reads
        its first context_lens[b] cached positions, in fp32 (torch's fused attention, one call for the scores,
        the softmax and the sum). q (B, Hq, Dh) -> (B, Hq, Dh). On the CPU, past LONG_DECODE positions, each
        sequence as a one-row prefill chunk instead: its K/V read in place where its blocks run consecutively
        (a long shared prompt is one run), where the batched pass copies every sequence's positions each step."""
        lens = context_lens.tolist() if q.device.type == "cpu" else None
        if lens and max(lens) >= self.LONG_DECODE:
            return torch.cat([self._prefill_attention(q.narrow(0, b, 1), k_cache, v_cache, block_tables[b], n, scale)
                              for b, n in enumerate(lens)])
        if lens and len(lens) == 1:                                      # one sequence: its n positions, no mask
            n = lens[0]
            blocks = block_tables.select(0, 0).narrow(0, 0, -(-n // k_cache.shape[1]))   # (nb,): index_select,
            k, v = (_as(c.index_select(0, blocks).flatten(0, 1).narrow(0, 0, n), torch.float32)   # not c[blocks]
                    .transpose(0, 1).unsqueeze(0) for c in (k_cache, v_cache))             # (1, Hk, n, Dh)
            o = F.scaled_dot_product_attention(_as(q, torch.float32).unsqueeze(2), k, v, scale=scale, enable_gqa=True)
            return _as(o.select(2, 0), q.dtype)
        B, nb = block_tables.shape
        blocks = block_tables.reshape(-1)                                # (B * nb,)
        k = k_cache.index_select(0, blocks).view(B, -1, *k_cache.shape[2:]).float().transpose(1, 2)  # (B, Hk, L, Dh)
        v = v_cache.index_select(0, blocks).view(B, -1, *v_cache.shape[2:]).float().transpose(1, 2)
        seen = torch.arange(k.shape[2], device=q.device) < context_lens[:, None]   # (B, L)
        o = F.scaled_dot_product_attention(q.float()[:, :, None], k, v, attn_mask=seen[:, None, None, :],
                                           scale=scale, enable_gqa=True)  # (B, Hq, 1, Dh)
        return _as(o[:, :, 0], q.dtype)

    def _prefill_attention(self, q, k_cache, v_cache, table, n, scale):
        """m queries of one sequence, the last m of its n positions: row i sees positions <= n - m + i.
        q (m, Hq, Dh); table (nb,) the sequence's block table -> (m, Hq, Dh).

        On the CPU, two kinds of call to torch's flash kernel, neither with a mask (a mask costs a float (m, n)
        copy per chunk and keeps the kernel from skipping tiles): the chunk's own m positions, causal, and the
        n - m before them, which every row sees whole, read in place where the block table runs through
        consecutive blocks. Their outputs merge exactly by their log-sum-exps (merge_attention). Elsewhere one
        masked call over a gathered copy (torch's CPU flash kernel is the one that returns the log-sum-exp)."""
        m = q.shape[0]
        if q.device.type != "cpu":
            return self._masked_attention(q, *self._gather_kv(k_cache, v_cache, table, 0, n), scale)
        parts = [self._flash_cpu(q, *self._gather_kv(k_cache, v_cache, table, n - m, n), scale, causal=True)]
        parts += [self._flash_cpu(q, k, v, scale) for k, v in self._kv_spans(k_cache, v_cache, table, n - m)]
        return merge_attention(parts).transpose(0, 1).to(q.dtype)

    @staticmethod
    def _gather_kv(k_cache, v_cache, table, start, stop):
        """Positions [start, stop) of a sequence's paged K and V, copied: (stop - start, Hk, Dh) each."""
        bs = k_cache.shape[1]
        blocks = table[start // bs: -(-stop // bs)].long()
        skip = start % bs
        return tuple(c[blocks].flatten(0, 1)[skip: skip + stop - start] for c in (k_cache, v_cache))

    @staticmethod
    def _kv_spans(k_cache, v_cache, table, n, max_spans: int = 8):
        """Positions [0, n) of a sequence's paged K and V as pieces (k, v), each (L, Hk, Dh), in order: views of
        the cache where the block table runs through consecutive blocks (a fresh pool hands them out in order,
        so a long prompt is one piece: no copy of its K and V per chunk), one gathered copy when the table has
        more than max_spans runs."""
        if n == 0:
            return []
        bs = k_cache.shape[1]
        blocks = table[: -(-n // bs)].long()                             # (nb,)
        cuts = ((blocks[1:] != blocks[:-1] + 1).nonzero()[:, 0] + 1).tolist()   # where a run of blocks ends
        if len(cuts) >= max_spans:
            return [TorchOps._gather_kv(k_cache, v_cache, table, 0, n)]
        pieces = []
        for a, b in zip([0] + cuts, cuts + [len(blocks)]):
            first, size = int(blocks[a]), min(n, b * bs) - a * bs          # tokens of this run
            pieces.append(tuple(c[first: first + b - a].flatten(0, 1)[:size] for c in (k_cache, v_cache)))
        return pieces

    @staticmethod
    def _flash_cpu(q, k, v, scale, causal: bool = False):
        """torch's CPU flash attention of q (m, Hq, Dh) over k, v (L, Hk, Dh): every row over all L positions,
        or causal (L == m). -> (out (Hq, m, Dh), logsumexp (Hq, m) fp32). In fp32, or in bf16 with fp32
        accumulation when the cache is bf16 (--kv-dtype bfloat16: its values are bf16 already). Unmasked, the q
        heads of one KV head go in as one query of rep * m rows: the kernel reads each K tile once for all of
        them, in larger query tiles. Causal, K and V are repeated per q head (m rows: the kernel's own GQA is
        not in every torch this file supports)."""
        work = torch.bfloat16 if k.dtype == torch.bfloat16 else torch.float32
        (m, Hq, Dh), Hk = q.shape, k.shape[1]
        qh = q.to(work).transpose(0, 1)                                  # (Hq, m, Dh)
        kh, vh = (t.to(work).transpose(0, 1) for t in (k, v))            # (Hk, L, Dh), strided views
        if causal:
            kh, vh = kh.repeat_interleave(Hq // Hk, 0), vh.repeat_interleave(Hq // Hk, 0)
        else:
            qh = qh.reshape(Hk, Hq // Hk * m, Dh)                        # q head h reads KV head h // rep
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qh[None], kh[None], vh[None], is_causal=causal, scale=scale)
        return o[0].reshape(Hq, m, Dh), lse[0].reshape(Hq, m)

    def _masked_attention(self, q, k, v, scale):
        """_prefill_attention off the CPU, over its gathered k, v (n, Hk, Dh): torch's fused attention with a
        boolean mask (memory in tiles, not an (m, n) score matrix per head), 4-D inputs."""
        m, n = q.shape[0], k.shape[0]
        work = torch.bfloat16 if k.dtype == torch.bfloat16 else torch.float32
        seen = torch.arange(n, device=q.device)[None, :] <= (n - m + torch.arange(m, device=q.device))[:, None]
        qh, kh, vh = (t.to(work).transpose(0, 1)[None] for t in (q, k, v))   # (1, H, m|n, Dh)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=seen, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1).to(q.dtype)                          # (m, Hq, Dh)

    def conv1d(self, x, w, conv_state, slot_ids, query_start):
        width = w.shape[1]
        if x.shape[0] == slot_ids.numel():                               # decode: one token per sequence
            rows, put = self._state_rows(conv_state, slot_ids)            # (B, C, W-1), the cache's dtype
            xs = torch.cat([_as(rows, x.dtype), x.unsqueeze(2)], -1)      # (B, C, W)
            put(rows.copy_(xs.narrow(2, 1, width - 1)))
            return _as(F.silu(torch.linalg.vecdot(_as(xs, torch.float32), self._f32(w))), x.dtype)   # (B, C)
        out = torch.empty_like(x)                                        # (T, C)
        for b in range(len(slot_ids)):
            q0, q1, s = int(query_start[b]), int(query_start[b + 1]), int(slot_ids[b])
            xs = torch.cat([conv_state[s].t().to(x.dtype), x[q0:q1]], 0).float()   # (W-1 + m, C)
            y = F.conv1d(xs.t()[None], w.float()[:, None, :], groups=w.shape[0])[0].t()  # (m, C)
            out[q0:q1] = F.silu(y).to(x.dtype)
            conv_state[s] = xs[-(width - 1):].t().to(conv_state.dtype)
        return out

    def gdn_in_proj(self, x, w: Linear, sizes: list[int], conv_w, conv_state, slot_ids, query_start):
        """GDN's stacked [qkv | z] projection, then the causal conv over qkv: (qkv (T, C), z)."""
        qkv, z = self.linear_parts(x, w, sizes)
        return self.conv1d(qkv, conv_w, conv_state, slot_ids, query_start), z

    def gdn_in_proj_gates(self, x, w: Linear, sizes: list[int], conv_w, conv_state, slot_ids, query_start,
                          w_ab: Linear, A_log, dt_bias):
        """gdn_in_proj, and gdn_gates_linear of the same input: GDN's projections (qkv (T, C), z, g, beta)."""
        qkv, z = self.gdn_in_proj(x, w, sizes, conv_w, conv_state, slot_ids, query_start)
        return (qkv, z, *self.gdn_gates_linear(x, w_ab, A_log, dt_bias))

    def gdn_gates(self, a, b, A_log, dt_bias):
        decay = self._derived(A_log, "decay", lambda: -A_log.float().exp())   # (Hv,) -exp(A_log), once
        g = F.softplus(_as(a, torch.float32) + self._f32(dt_bias)).mul_(decay)   # (T, Hv) fp32
        return g, torch.sigmoid(_as(b, torch.float32))

    def gdn_gates_linear(self, x, w_ab: Linear, A_log, dt_bias):
        """gdn_gates of the projections a|b (rows stacked in w_ab), computed from x; a, b kept in fp32."""
        a, b = self.linear(x, w_ab, torch.float32).chunk(2, -1)          # (T, Hv) each
        return self.gdn_gates(a, b, A_log, dt_bias)

    def gated_delta(self, q, k, v, g, beta, state, slot_ids, query_start):
        rep = v.shape[1] // k.shape[1]                                   # value head h reads key head h // rep
        if q.shape[0] == slot_ids.numel():                               # decode: one vectorised step
            q, k = self._unit_qk(q, k, rep)                              # (B, Hv, Dk) each
            S, put = self._state_rows(state, slot_ids)                   # (B, Hv, Dk, Dv), updated in place
            o = decode_delta_step(q, k, _as(v, torch.float32), g, beta, S)
            put(S)
            return _as(o, v.dtype)
        q = self._l2norm(q.float(), 1.0).repeat_interleave(rep, 1)      # (T, Hv, Dk), scaled by Dk^-0.5
        k = self._l2norm(k.float(), 0.5).repeat_interleave(rep, 1)
        vf = v.float()
        out = torch.empty_like(vf)
        for b, s in enumerate(slot_ids.tolist()):
            q0, q1 = int(query_start[b]), int(query_start[b + 1])
            out[q0:q1], state[s] = prefill_delta_chunked(q[q0:q1], k[q0:q1], vf[q0:q1], g[q0:q1], beta[q0:q1], state[s])
        return out.to(v.dtype)

    def gated_delta_rmsnorm(self, q, k, v, g, beta, state, slot_ids, query_start, z, w, eps):
        """gated_delta, then gated_rmsnorm of its output with the gate z (T, Hv, Dv): GDN's recurrent part and
        its output norm."""
        return self.gated_rmsnorm(self.gated_delta(q, k, v, g, beta, state, slot_ids, query_start), z, w, eps)

    def gated_rmsnorm(self, x, z, w, eps):
        xf = _as(x, torch.float32)
        if xf.shape[0] > FEW_ROWS:
            return _as(F.rms_norm(xf, w.shape, w.float(), eps) * F.silu(z.float()), x.dtype)
        gate = F.silu(_as(z, torch.float32)).mul_(self._f32(w))              # (T, H, D)
        return _as(gate.mul_(self._inv_rms(xf, eps, xf.shape[-1])).mul_(xf), x.dtype)

    def _l2norm(self, x, power: float, eps: float = 1e-6):
        """x * rsqrt(sum(x^2) + eps) * D^-(power - 0.5) over the last dim D: as one rms_norm, whose mean over D
        is the sum / D (hence eps / D) and whose weight carries the D^-0.5 factors (q's extra scale)."""
        D = x.shape[-1]
        w = self._derived(x.device, ("l2norm", D, power), lambda: torch.full((D,), D ** -power, device=x.device))
        return F.rms_norm(x, (D,), w, eps / D)

    def _unit_qk(self, q, k, rep: int):
        """_l2norm for a decode step's few rows: q, k (B, Hk, Dk) times rsqrt(sum(x^2) + eps) (q also by Dk^-0.5),
        normed together in one set of calls and repeated for the rep value heads of each key head: -> (B, Hk * rep,
        Dk) each."""
        B, Hk, Dk = q.shape
        qk = _as(torch.stack([q, k], 1), torch.float32)                   # (B, 2, Hk, Dk)
        scale = self._derived(q.device, ("qk-scale", Dk), lambda: torch.tensor(
            [[Dk ** -0.5], [1.0]], device=q.device)[:, None])              # (2, 1, 1): q's rows, k's rows
        qk = qk * self._inv_rms(qk, 1e-6, 1.0).mul_(scale)
        return (qk.repeat_interleave(rep, 2) if rep > 1 else qk).unbind(1)

    def _state_rows(self, state, slot_ids):
        """(the sequences' rows of a state tensor, put(rows) that stores them back): one sequence's row on the CPU
        is a view, updated in place (put does nothing; elsewhere its slot number would wait for the device); else
        they are gathered and scattered back."""
        if slot_ids.numel() == 1 and slot_ids.device.type == "cpu":
            return state.narrow(0, slot_ids.item(), 1), lambda rows: None
        return state.index_select(0, slot_ids), lambda rows: state.index_copy_(0, slot_ids.long(), rows)

    def _derived(self, source, key, make):
        """A value made once from a weight (by its id: the dict holds the weight, so the id stays its own) or from
        a device (by value), and kept."""
        memo = self.__dict__.setdefault("_derived_memo", {})
        k = (id(source) if isinstance(source, torch.Tensor) else source, key)
        if k not in memo:
            memo[k] = (source, make())
        return memo[k][1]

    def copy_rows(self, src_t, dst_t, src, dst):
        """dst_t[dst[i]] = src_t[src[i]] in place, rows of the first dimension (state slots, KV blocks) of two
        tensors of one row shape, or of one tensor; src, dst (N,) int64, within one tensor no destination also a
        source."""
        dst_t[dst] = src_t[src].to(dst_t.dtype)


# -----------------------------------------------------------------------------------------------
# 3b. The native backend: the same ops, run by the CUDA library in csrc/ (libpocketllm.so), reached
#     through cffi's ABI mode, so importing pocketllm needs no compiler and any Python version works.
#     The CPU test build (libpocketllm_cpu.so) runs the same kernels on host tensors; CI uses it.
# -----------------------------------------------------------------------------------------------

NATIVE_ABI_VERSION = 5          # must equal PL_ABI_VERSION in csrc/pocketllm.h
NATIVE_MIN_CAPABILITY = (7, 5)  # Turing: mma.sync m16n8k8 and ldmatrix

NATIVE_COUNTERS = 4096          # the last-block counters of pl_mlp and pl_attention_merged (csrc/pocketllm.h)
GEMV_SCRATCH_BYTES = 4 << 20    # the split-K GEMV's partial sums, per thread and device (pl_set_gemv_scratch)
GEMV_MAX_TOKENS = 16            # GEMV_MAX_T in csrc/linear.cu: up to this many tokens a linear is a GEMV

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
        self.recording = threading.local()   # .calls, .active: the LaunchRecording on this thread

    def last_error(self) -> str:
        return self.ffi.string(self.lib.pl_last_error()).decode(errors="replace")

    def call(self, name: str, *args) -> None:
        """Run pl_<name>(*args); inside a LaunchRecording on this thread, also append (function, args) to it."""
        fn = getattr(self.lib, name)
        calls = getattr(self.recording, "calls", None)
        if calls is not None:
            calls.append((fn, args))
        if fn(*args) != 0:
            raise NativeError(f"native library: {self.last_error()}")

    def device_count(self) -> int:
        count = self.ffi.new("int32_t*")
        self.call("pl_device_count", count)
        return int(count[0])

    def cuda_versions(self) -> tuple[int, int]:
        """(driver, runtime) CUDA versions as 1000 * major + 10 * minor; driver 0 = no driver found."""
        driver, runtime = self.ffi.new("int32_t*"), self.ffi.new("int32_t*")
        self.call("pl_cuda_versions", driver, runtime)
        return int(driver[0]), int(runtime[0])

    def capability(self, device: int = 0) -> tuple[int, int]:
        major, minor = self.ffi.new("int32_t*"), self.ffi.new("int32_t*")
        self.call("pl_device_capability", device, major, minor)
        return int(major[0]), int(minor[0])


class LaunchRecording(TorchDispatchMode):
    """`with LaunchRecording(lib): <forward>` runs the forward and records the native calls this thread makes
    (NativeLibrary.call), so that replay() re-issues them with the same arguments: a decode step's host cost
    becomes one cffi call per launch (section 8's DecodeGraphs). The arguments are addresses, so every tensor
    created inside the recording (outputs, packed temporaries) is kept alive here, and a replay reads the same
    inputs (a static batch payload refreshed in place) and writes the same outputs. Any torch op that would
    launch a kernel (anything but views, allocations and metadata) would be skipped by a replay, so it makes
    the recording `refused` (its name); the forward itself still ran eagerly and its output is correct. A step
    that is not a native launch but must run again at each replay (gloo's all-reduce between CPU ranks) is
    recorded by host()."""
    FREE = {"detach", "alias", "_unsafe_view", "split", "split_with_sizes", "unbind", "chunk", "is_contiguous",
            "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "is_same_size"}

    def __init__(self, lib: NativeLibrary):
        super().__init__()
        self.lib = lib
        self.calls: list[tuple[Callable, tuple]] = []   # (cffi function, its arguments) in call order
        self.kept: list = []                            # every op's output inside the recording
        self.refused: str | None = None                 # the first torch op that launches a kernel
        self.hosting = False                            # inside host(): its torch ops are its own

    @staticmethod
    def active(lib: "NativeLibrary | None") -> "LaunchRecording | None":
        """The recording on this thread, if any."""
        return getattr(lib.recording, "active", None) if lib is not None else None

    def __enter__(self):
        if getattr(self.lib.recording, "calls", None) is not None:
            raise PocketError("a LaunchRecording is already active on this thread")
        self.lib.recording.calls, self.lib.recording.active = self.calls, self
        return super().__enter__()

    def __exit__(self, *exc):
        self.lib.recording.calls = self.lib.recording.active = None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not (self.hosting or func.is_view or name in self.FREE or name.startswith("empty")) \
                and self.refused is None:
            self.refused = name
        self.kept.append(out)
        return out

    def host(self, fn: Callable, x: torch.Tensor) -> torch.Tensor:
        """fn(x) now and again at every replay, in its place among the launches: x is a recorded tensor, so a
        replay reads and writes the same memory. Returns x (fn works in place)."""
        self.hosting = True
        try:
            fn(x)
        finally:
            self.hosting = False

        def again() -> int:
            fn(x)
            return 0
        self.calls.append((again, ()))
        return x

    def replay(self) -> None:
        """Every recorded call again, in order; NativeError on the first that fails."""
        for fn, args in self.calls:
            if fn(*args) != 0:
                raise NativeError(f"native library (replay): {self.lib.last_error()}")


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


@dataclass
class Prenormed:
    """NativeOps.prenorm's output: the input h = rmsnorm(residual + x) of the projections that follow, never
    stored. Their GEMVs compute it in their prologue (pl_norm_linear_*); the first of them also writes
    residual + x into residual_out, the new residual stream."""
    x: torch.Tensor               # (T, D) fp32
    residual: torch.Tensor        # (T, D) fp32, the stream before x
    residual_out: torch.Tensor    # (T, D) fp32, written by the first projection
    w: torch.Tensor               # (D,) the norm's weight
    eps: float
    dtype: torch.dtype            # h's dtype: the activations'
    written: bool = False         # residual_out holds residual + x (or its write is queued)

    @property
    def shape(self) -> torch.Size:
        return self.x.shape


_GEMV_SCRATCH = threading.local()   # per thread: (id(lib), device) -> the split-K GEMV's (workspace, counters)


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
        self._local = threading.local()     # the last-block counters (_counters), per thread
        self._cpu_build = self.lib.is_cpu_build
        self._scales: dict[int, tuple] = {}   # id(scale) -> (scale, its fp32 copy): _weight's conversions
        # Which decode fusions run, as measured on an H200 (docs/benchmarks.md, tests/gpu/gpu_check.py bench and
        # decode; every fused kernel stays tested behind its switch). Token counts are at most GEMV_MAX_TOKENS.
        # Every block of the next GEMVs recomputing the add + RMSNorm costs more than its own launch at any batch
        # (batch-8 graphed step 6.90 -> 2.37 ms with the first two off); the fp32-product GLU MLP wins at one
        # token only (its down_proj re-reads fp32 rows per output row); pl_mlp (34-136 blocks, byte loads in its
        # down_proj) ran 1.34 ms against 0.17 for the 3-launch MLP at one token; and decode attention with its
        # split-K merge in the last split block 0.086 ms against 0.046 for the kernel + merge launch.
        self.prologue_tokens = 0                 # add + RMSNorm computed inside the projections that follow
        self.glu_tokens = 1                      # the MLP as pl_linear_glu (fp32 product) + down_proj, 2 launches
        self.mlp_tokens = 0                      # the MLP as pl_mlp, one launch
        self.merged_attention = False            # attention's split-K merge inside its launch (pl_attention_merged)

    def launch_count(self) -> int:
        """Kernel launches queued by the library in this process so far (pl_launch_count)."""
        count = self.lib.ffi.new("uint64_t*")
        self.lib.call("pl_launch_count", count)
        return int(count[0])

    # ---- Plumbing: pointers, dtype codes, the stream ----

    def _p(self, t: torch.Tensor) -> int:
        """The address of a tensor the library reads or writes in place."""
        if t.is_cuda == self._cpu_build:
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
        """torch's current stream on t's device (read each call: a CUDA graph capture changes it), that device
        made current for the library on this thread, with this thread's GEMV scratch there."""
        if not t.is_cuda:
            if getattr(self._threads, "device", None) is None:
                self._use_scratch(t.device)
                self._threads.device = "cpu"
            return 0
        index = t.device.index
        if getattr(self._threads, "device", None) != index:
            self.lib.call("pl_set_device", index)
            self._threads.device = index
            self._use_scratch(t.device)
        return torch._C._cuda_getCurrentRawStream(index)   # torch.cuda.current_stream's handle, ~10x cheaper

    def _use_scratch(self, device: torch.device) -> None:
        """Give the library this thread's split-K scratch on `device` (pl_set_gemv_scratch): a zeroed workspace
        and counters allocated at the thread's first call there (an eager one: DecodeGraphs runs each bucket
        eagerly before capturing it) and kept for the thread's life, so every NativeOps of the thread, and every
        graph or launch list recorded from it, points at live memory."""
        per_thread = getattr(_GEMV_SCRATCH, "by", None)
        if per_thread is None:
            per_thread = _GEMV_SCRATCH.by = {}
        key = (id(self.lib), str(device))
        if key not in per_thread:
            per_thread[key] = (torch.zeros(GEMV_SCRATCH_BYTES // 4, dtype=torch.float32, device=device),
                               torch.zeros(NATIVE_COUNTERS, dtype=torch.int32, device=device))
        ws, counters = per_thread[key]
        self.lib.call("pl_set_gemv_scratch", ws.data_ptr(), GEMV_SCRATCH_BYTES, counters.data_ptr(), NATIVE_COUNTERS)

    def _as(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An input in `dtype` (default: its own), contiguous; itself, checked in two attribute reads, when it
        already is (the model's tensors almost always are: no conversion on the hot path). A view whose rows are
        contiguous but strided (a column slice of a projection's output) is packed by pl_copy_2d, so a decode
        forward stays native; other conversions are torch's. The caller keeps the result alive until the call
        that reads it (a temporary's address alone does not)."""
        if dtype is not None and t.dtype != dtype:
            return t.to(dtype).contiguous()
        if t.is_contiguous():
            return t
        shape, stride = t.shape, t.stride()
        row = 1                                                                      # elements per row
        for n, st in zip(reversed(shape[1:]), reversed(stride[1:])):
            if n != 1 and st != row:
                return t.contiguous()                                                # not rows of one block each
            row *= n
        if len(shape) < 2 or not shape[0] or stride[0] < row:
            return t.contiguous()
        if t.is_cuda == self._cpu_build:
            self._p(t)                                                               # raises: wrong device
        out = torch.empty(shape, dtype=t.dtype, device=t.device)                     # (rows, ...) packed
        size = t.element_size()
        self.lib.call("pl_copy_2d", t.data_ptr(), stride[0] * size, self._p(out), row * size, shape[0], row * size,
                      self._stream(out))
        return out

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device)
        self.lib.call("pl_zero", self._p(out), out.numel() * out.element_size(), self._stream(out))
        return out

    def contiguous(self, t: torch.Tensor) -> torch.Tensor:
        """t packed; strided rows (a column slice) by pl_copy_2d, so a recorded decode step stays native."""
        return self._as(t)

    def write_columns(self, dst: torch.Tensor, src: torch.Tensor, start: int) -> None:
        """dst[:, start:start + N] = src (R, N), one pl_copy_2d (a recorded decode step stays native)."""
        src = self._as(src, dst.dtype)
        (R, N), size = src.shape, dst.element_size()
        if not (dst.is_contiguous() and dst.dim() == 2 and dst.shape[0] == R and 0 <= start <= dst.shape[1] - N):
            raise PocketError(f"write_columns: {tuple(src.shape)} at column {start} of {tuple(dst.shape)}")
        self._p(dst)                                                                 # checks the device
        self.lib.call("pl_copy_2d", self._p(src), N * size, dst.data_ptr() + start * size, dst.shape[1] * size, R,
                      N * size, self._stream(dst))

    # ---- The ops ----

    def embed(self, ids: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ids, table = self._as(ids, torch.int64), self._as(table)
        (V, D), T = table.shape, ids.numel()
        out = torch.empty(T, D, dtype=dtype, device=table.device)                   # (T, D)
        self.lib.call("pl_embed", self._p(ids), T, self._p(table), self._dt(table), V, D, self._p(out),
                      self._dt(out), self._stream(out))
        return out

    def embed_shard(self, ids: torch.Tensor, table: torch.Tensor, lo: int, dtype: torch.dtype) -> torch.Tensor:
        ids, table = self._as(ids, torch.int64), self._as(table)
        (V, D), T = table.shape, ids.numel()
        out = torch.empty(T, D, dtype=dtype, device=table.device)                   # (T, D)
        self.lib.call("pl_embed_shard", self._p(ids), T, self._p(table), self._dt(table), lo, V, D, self._p(out),
                      self._dt(out), self._stream(out))
        return out

    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        x, w = self._as(x), self._as(w)
        D = x.shape[-1]
        out = torch.empty_like(x)                                                    # (T, D)
        self.lib.call("pl_rmsnorm", self._p(x), self._p(w), self._dt(w), self._p(out), self._dt(x),
                      x.numel() // D, D, eps, self._stream(x))
        return out

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float,
                    dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """residual (T, D) fp32 += x (fp32 or the activation dtype), in place, and is returned with its norm in
        `dtype` (default x's)."""
        x, w = self._as(x), self._as(w)
        D = x.shape[-1]
        if residual.dtype != torch.float32:
            raise PocketError(f"add_rmsnorm: the residual stream must be float32, got {residual.dtype}")
        out = torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device)         # (T, D)
        self.lib.call("pl_add_rmsnorm", self._p(x), self._dt(x), self._p(residual), self._p(w), self._dt(w),
                      self._p(out), self._dt(out), x.numel() // D, D, eps, self._stream(x))
        return out, residual

    def prenorm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float,
                dtype: torch.dtype | None = None) -> tuple[Prenormed | torch.Tensor, torch.Tensor]:
        """add_rmsnorm for the projections that follow, run by their GEMVs (no launch of its own) up to
        prologue_tokens tokens with fp32 x; returns the Prenormed input and the new residual stream (a new tensor,
        written by the first projection). Otherwise add_rmsnorm."""
        T = x.numel() // x.shape[-1]
        if not (0 < T <= self.prologue_tokens and x.dtype == residual.dtype == torch.float32 and x.is_contiguous()):
            return self.add_rmsnorm(x, residual, w, eps, dtype)
        out = torch.empty_like(residual)                                             # (T, D) fp32
        return Prenormed(x, self._as(residual), out, self._as(w), eps, dtype or x.dtype), out

    def _prenorm_args(self, h: Prenormed) -> tuple:
        """The pl_norm_linear_* input arguments (x .. act_dtype); the first projection of h writes residual_out."""
        out = 0 if h.written else self._p(h.residual_out)
        h.written = True
        return (self._p(h.x), self._p(h.residual), out, self._p(h.w), self._dt(h.w), h.eps, NATIVE_DTYPES[h.dtype])

    def _weight(self, w: Linear) -> tuple[torch.Tensor, int]:
        """A weight as the kernels take it: the (N, K) tensor and its FP8 block scales' address (0 if dense)."""
        if w.scale is None:
            return self._as(w.weight), 0
        if tuple(w.block) != (128, 128):
            raise PocketError(f"the native FP8 kernels need 128x128 weight blocks, not {list(w.block)} "
                              f"(use --backend torch)")
        scale = w.scale                                                    # (ceil(N/128), ceil(K/128)) fp32
        if scale.dtype != torch.float32 or not scale.is_contiguous():     # (load_linear's always are)
            # converted once and kept: only its address goes to the call, which may come later (a replay)
            scale = self._scales.setdefault(id(scale), (scale, scale.float().contiguous()))[1]
        return self._as(w.weight), self._p(scale)

    def _input(self, x: Prenormed | torch.Tensor) -> tuple:
        """The GEMV input arguments of pl_gdn_in_proj's form: (x, residual, residual_out, norm_w, its dtype, eps,
        act_dtype), the middle ones 0 for a plain activation input x."""
        if isinstance(x, Prenormed):
            return self._prenorm_args(x)
        x = self._as(x)
        return self._p(x), 0, 0, 0, 0, 0.0, self._dt(x)

    def linear(self, x: torch.Tensor, w: Linear, dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ w^T in `dtype`: x's own, or float32 (fp32 accumulation either way)."""
        return self._linear(x, w, dtype or x.dtype, None)

    def _linear(self, x: torch.Tensor, w: Linear, dtype: torch.dtype, row_scale: torch.Tensor | None,
                sizes: list[int] | None = None) -> torch.Tensor:
        """pl_linear_parts; row_scale (T,) fp32 multiplies output row t (pl_silu_mul's scales), None for none.
        sizes: the output columns of each stacked part (at most 4), whose (T, N_p) blocks follow one another
        in the returned flat buffer; None for the plain (T, N) output."""
        weight, scale = self._weight(w)
        N, K = weight.shape
        ends = [N, N, N] if sizes is None else (list(itertools.accumulate(sizes[:-1])) + [N, N, N])[:3]
        if isinstance(x, Prenormed):                                                 # add + norm in the prologue
            out = torch.empty(*x.shape[:-1], N, dtype=dtype, device=x.x.device)      # (T, N) or the parts
            self.lib.call("pl_norm_linear_parts", *self._prenorm_args(x), x.x.numel() // K, K, self._p(weight),
                          self._dt(weight), scale, N, *ends, self._p(out), self._dt(out), self._stream(out))
            return out
        x = self._as(x)
        out = torch.empty(*x.shape[:-1], N, dtype=dtype, device=x.device)            # (T, N) or the parts
        self.lib.call("pl_linear_parts", self._p(x), self._dt(x), 0 if row_scale is None else self._p(row_scale),
                      x.numel() // K, K, self._p(weight), self._dt(weight), scale, N, *ends, self._p(out),
                      self._dt(out), self._stream(x))
        return out

    def linear_parts(self, x: torch.Tensor, w: Linear, sizes: list[int],
                     dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
        """linear() of stacked projections in one launch, each part's (T, N_p) output a contiguous tensor."""
        if len(sizes) > 4:
            raise PocketError(f"linear_parts: at most 4 parts, got {len(sizes)}")
        out = self._linear(x, w, dtype or x.dtype, None, sizes).view(-1)
        T = math.prod(x.shape[:-1])
        offsets = itertools.accumulate([0] + [T * n for n in sizes])
        return tuple(out[o:o + T * n].view(T, n) for o, n in zip(offsets, sizes))

    def _silu_mul(self, g: torch.Tensor, u: torch.Tensor, dtype: torch.dtype, row_scale: torch.Tensor | None):
        g, u = self._as(g), self._as(u, g.dtype)
        I = g.shape[-1]
        out = torch.empty(g.shape, dtype=dtype, device=g.device)                    # (T, I)
        self.lib.call("pl_silu_mul", self._p(g), self._p(u), self._dt(g), g.numel() // I, I, self._p(out),
                      self._dt(out), 0 if row_scale is None else self._p(row_scale), self._stream(g))
        return out

    def silu_mul(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self._silu_mul(g, u, g.dtype, None)

    def silu_mul_linear(self, g: torch.Tensor, u: torch.Tensor, w: Linear, dtype: torch.dtype) -> torch.Tensor:
        """down_proj(silu(g) * u) -> (T, N) fp32. In fp16 the intermediate's rows are divided by a power of two
        (pl_silu_mul's row scales) and the GEMM's epilogue multiplies them back: tensor cores, no overflow."""
        row_scale = None
        if dtype != torch.float32:
            row_scale = torch.empty(g.numel() // g.shape[-1], dtype=torch.float32, device=g.device)   # (T,)
        return self._linear(self._silu_mul(g, u, dtype, row_scale), w, torch.float32, row_scale)

    def mlp(self, x: torch.Tensor, gate_up: Linear, down: Linear, dtype: torch.dtype) -> torch.Tensor:
        """down(silu(x gate^T) * (x up^T)) -> (T, N) fp32. T <= mlp_tokens (FP8 weights): pl_mlp, one launch;
        else T <= glu_tokens: pl_linear_glu writes the fp32 product in one launch (no fp16 intermediate, so no row
        scale), then down_proj; larger T: gate|up in one launch, pl_silu_mul, down_proj (silu_mul_linear)."""
        T = math.prod(x.shape[:-1])
        if T <= self.mlp_tokens and self._fused_mlp(gate_up, down):
            return self._mlp_one_launch(x, gate_up, down, T)
        if T > self.glu_tokens:
            g, u = self.linear_parts(x, gate_up, [gate_up.shape[0] // 2] * 2, torch.float32)
            return self.silu_mul_linear(g, u, down, dtype)
        weight, scale = self._weight(gate_up)
        N, K = weight.shape
        normed = isinstance(x, Prenormed)
        h = torch.empty(T, N // 2, dtype=torch.float32, device=x.x.device if normed else x.device)   # (T, I)
        if normed:                                                                   # add + norm in the prologue
            self.lib.call("pl_norm_linear_glu", *self._prenorm_args(x), T, K, self._p(weight), self._dt(weight),
                          scale, N, self._p(h), self._stream(h))
        else:
            x = self._as(x)
            self.lib.call("pl_linear_glu", self._p(x), self._dt(x), T, K, self._p(weight), self._dt(weight), scale, N,
                          self._p(h), self._stream(x))
        return self._linear(h, down, torch.float32, None)

    @staticmethod
    def _fused_mlp(gate_up: Linear, down: Linear) -> bool:
        """pl_mlp's weights: both FP8 with 128x128 blocks, down's K the intermediate size."""
        return (gate_up.scale is not None and down.scale is not None and tuple(gate_up.block) == (128, 128)
                and tuple(down.block) == (128, 128) and 2 * down.shape[1] == gate_up.shape[0])

    def _counters(self, device: torch.device) -> torch.Tensor:
        """The last-block counters of pl_mlp and pl_attention_merged (NATIVE_COUNTERS uint32): zeroed once, left
        zero by every launch. One buffer per thread (a thread's launches are on one stream at a time), allocated
        by its first, eager, call: never inside a CUDA graph capture (DecodeGraphs runs each bucket eagerly first),
        and never replaced, so captured graphs keep a live address."""
        c = getattr(self._local, "counters", None)
        if c is None or c.device != device:
            c = self._local.counters = torch.zeros(NATIVE_COUNTERS, dtype=torch.int32, device=device)
        return c

    def _mlp_one_launch(self, x: Prenormed | torch.Tensor, gate_up: Linear, down: Linear, T: int) -> torch.Tensor:
        """pl_mlp: gate|up, the SiLU product and down in one launch (decode sizes, FP8 weights)."""
        K, (D, I) = gate_up.shape[1], down.shape
        device = x.x.device if isinstance(x, Prenormed) else x.device
        out = torch.empty(T, D, dtype=torch.float32, device=device)                 # (T, D)
        ws = torch.empty(-(-I // 128) * T * D, dtype=torch.float32, device=device)  # the blocks' (T, D) partials
        counters = self._counters(device)
        wg, sg = self._weight(gate_up)
        wd, sd = self._weight(down)
        self.lib.call("pl_mlp", *self._input(x), T, K, self._p(wg), sg, I, self._p(wd), sd, D, self._p(out),
                      self._p(ws), self._p(counters), self._stream(out))
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

    def qk_norm_rope_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_w: torch.Tensor,
                        k_w: torch.Tensor, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """qk_norm_rope and kv_write in one launch (pl_qk_norm_rope_kv): returns q; k and v go to the cache."""
        q, k, v, q_w = self._as(q), self._as(k, q.dtype), self._as(v, q.dtype), self._as(q_w)
        k_w, positions = self._as(k_w, q_w.dtype), self._as(positions, torch.int64)
        inv_freq, slot_mapping = self._as(inv_freq, torch.float32), self._as(slot_mapping, torch.int64)
        (T, Hq, Dh), Hk = q.shape, k.shape[1]
        q_out = torch.empty_like(q)                                                  # (T, Hq, Dh)
        self.lib.call("pl_qk_norm_rope_kv", self._p(q), self._p(k), self._p(v), self._p(q_out), self._dt(q), T, Hq,
                      Hk, Dh, self._p(q_w), self._p(k_w), self._dt(q_w), eps, self._p(positions), self._p(inv_freq),
                      inv_freq.numel(), self._p(k_cache), self._p(v_cache), self._dt(k_cache), self._p(slot_mapping),
                      self._stream(q))
        return q_out

    def kv_write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        k, v, slot_mapping = self._as(k), self._as(v, k.dtype), self._as(slot_mapping, torch.int64)
        T, Hk, Dh = k.shape
        self.lib.call("pl_kv_write", self._p(k), self._p(v), self._dt(k), T, Hk, Dh, self._p(k_cache),
                      self._p(v_cache), self._dt(k_cache), self._p(slot_mapping), self._stream(k))

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, query_start: torch.Tensor, scale: float,
                  gate: torch.Tensor | None = None) -> torch.Tensor:
        """Paged attention; with gate, times sigmoid(gate). The split-K merge is a second launch, or inside the
        first with merged_attention (pl_attention_merged)."""
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
        args = (self._p(q), self._dt(q), T, Hq, Hk, Dh, self._p(k_cache), self._p(v_cache), block_size,
                self._p(block_tables), max_blocks, self._p(context_lens), self._p(query_start), B, scale, self._p(out))
        gate = None if gate is None else self._as(gate, q.dtype)                     # alive until the call
        if self.merged_attention:                                                   # split-K merged in the launch
            self.lib.call("pl_attention_merged", *args, 0 if gate is None else self._p(gate), self._p(workspace),
                          ws_bytes, self._p(self._counters(q.device)), self._stream(q))
        elif gate is None:
            self.lib.call("pl_attention", *args, self._p(workspace), ws_bytes, self._stream(q))
        else:
            self.lib.call("pl_attention_gated", *args, self._p(gate), self._p(workspace), ws_bytes, self._stream(q))
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

    def gdn_in_proj(self, x: Prenormed | torch.Tensor, w: Linear, sizes: list[int], conv_w: torch.Tensor,
                    conv_state: torch.Tensor, slot_ids: torch.Tensor,
                    query_start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """linear_parts of [qkv | z], then conv1d over qkv: one launch (pl_gdn_in_proj, the conv in the GEMV's
        epilogue) for a decode step of at most 16 sequences, else two."""
        T = math.prod(x.shape[:-1])
        if not (0 < T <= GEMV_MAX_TOKENS and T == slot_ids.numel() and len(sizes) == 2):
            qkv, z = self.linear_parts(x, w, sizes)
            return self.conv1d(qkv, conv_w, conv_state, slot_ids, query_start), z
        weight, scale = self._weight(w)
        (N, K), C = weight.shape, sizes[0]
        conv_w, slot_ids = self._as(conv_w).reshape(C, -1), self._as(slot_ids, torch.int32)   # (C, W)
        out = torch.empty(T * N, dtype=x.dtype, device=conv_state.device)                   # qkv | z
        self.lib.call("pl_gdn_in_proj", *self._input(x), T, K, self._p(weight), self._dt(weight), scale, C, N,
                      self._p(out), self._p(conv_w), self._dt(conv_w), conv_w.shape[1], self._p(conv_state),
                      self._dt(conv_state), self._p(slot_ids), self._stream(out))
        return out[:T * C].view(T, C), out[T * C:].view(T, N - C)

    def gdn_in_proj_gates(self, x: Prenormed | torch.Tensor, w: Linear, sizes: list[int], conv_w: torch.Tensor,
                          conv_state: torch.Tensor, slot_ids: torch.Tensor, query_start: torch.Tensor, w_ab: Linear,
                          A_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """gdn_in_proj and gdn_gates_linear in one launch for a decode step of at most 16 sequences
        (pl_gdn_in_proj_gates: the a|b rows' blocks beside the q|k|v|z ones in one grid; a|b dense), else as two
        ops."""
        T = math.prod(x.shape[:-1])
        if not (0 < T <= GEMV_MAX_TOKENS and T == slot_ids.numel() and len(sizes) == 2 and w_ab.scale is None):
            return TorchOps.gdn_in_proj_gates(self, x, w, sizes, conv_w, conv_state, slot_ids, query_start, w_ab,
                                              A_log, dt_bias)
        weight, scale = self._weight(w)
        w_ab, _ = self._weight(w_ab)
        (N, K), C, Hv = weight.shape, sizes[0], w_ab.shape[0] // 2
        conv_w, slot_ids = self._as(conv_w).reshape(C, -1), self._as(slot_ids, torch.int32)   # (C, W)
        A_log, dt_bias = self._as(A_log, torch.float32), self._as(dt_bias, torch.float32)
        out = torch.empty(T * N, dtype=x.dtype, device=conv_state.device)                   # qkv | z
        gates = torch.empty(2, T, Hv, dtype=torch.float32, device=conv_state.device)        # [g | beta]
        self.lib.call("pl_gdn_in_proj_gates", *self._input(x), T, K, self._p(weight), self._dt(weight), scale, C, N,
                      self._p(out), self._p(conv_w), self._dt(conv_w), conv_w.shape[1], self._p(conv_state),
                      self._dt(conv_state), self._p(slot_ids), self._p(w_ab), self._dt(w_ab), Hv, self._p(A_log),
                      self._p(dt_bias), self._p(gates), self._stream(out))
        return out[:T * C].view(T, C), out[T * C:].view(T, N - C), gates[0], gates[1]

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

    def gdn_gates_linear(self, x: torch.Tensor, w_ab: Linear, A_log: torch.Tensor,
                         dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """in_proj_a|b and gdn_gates in one launch (pl_linear_gdn_gates): (g, beta), (T, Hv) fp32 each."""
        weight, scale = self._weight(w_ab)
        (N, K), T = weight.shape, math.prod(x.shape[:-1])
        A_log, dt_bias = self._as(A_log, torch.float32), self._as(dt_bias, torch.float32)
        out = torch.empty(2, T, N // 2, dtype=torch.float32, device=A_log.device)            # [g | beta]
        args = (K, self._p(weight), self._dt(weight), scale, N // 2, self._p(A_log), self._p(dt_bias), self._p(out),
                self._stream(out))
        if isinstance(x, Prenormed):                                                 # add + norm in the prologue
            self.lib.call("pl_norm_linear_gdn_gates", *self._prenorm_args(x), T, *args)
        else:
            x = self._as(x)
            self.lib.call("pl_linear_gdn_gates", self._p(x), self._dt(x), T, *args)
        return out[0], out[1]

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

    def gated_delta_rmsnorm(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor, query_start: torch.Tensor,
                            z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """gated_delta and gated_rmsnorm in one launch (pl_gated_delta_rmsnorm: a block holds a head's whole
        output row), for value heads of at most 128; wider ones take the two ops."""
        (T, Hk, Dk), (_, Hv, Dv) = q.shape, v.shape
        if Dv > 128:                                                                 # two launches
            return TorchOps.gated_delta_rmsnorm(self, q, k, v, g, beta, state, slot_ids, query_start, z, w, eps)
        q, k, v, z = self._as(q), self._as(k, q.dtype), self._as(v, q.dtype), self._as(z, q.dtype)
        g, beta, w = self._as(g, torch.float32), self._as(beta, torch.float32), self._as(w)
        slot_ids, query_start = self._as(slot_ids, torch.int32), self._as(query_start, torch.int32)
        out = torch.empty_like(v)                                                    # (T, Hv, Dv)
        self.lib.call("pl_gated_delta_rmsnorm", self._p(q), self._p(k), self._p(v), self._dt(q), T, Hk, Hv, Dk, Dv,
                      self._p(g), self._p(beta), self._p(state), self._p(slot_ids), self._p(query_start),
                      slot_ids.numel(), self._p(z), self._p(w), self._dt(w), eps, self._p(out), self._stream(q))
        return out

    def gated_rmsnorm(self, x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        x, z, w = self._as(x), self._as(z, x.dtype), self._as(w)
        D = x.shape[-1]
        out = torch.empty_like(x)                                                    # (T, Hv, Dv)
        self.lib.call("pl_gated_rmsnorm", self._p(x), self._p(z), self._p(w), self._dt(w), self._p(out),
                      self._dt(x), x.numel() // D, D, eps, self._stream(x))
        return out

    # ---- NCCL (native only): tensor parallelism refuses to start when nccl_available() is False ----

    def copy_rows(self, src_t: torch.Tensor, dst_t: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        if src_t.dtype != dst_t.dtype or src_t.shape[1:] != dst_t.shape[1:]:
            raise PocketError(f"copy_rows: rows of {src_t.dtype} {tuple(src_t.shape[1:])} cannot go to rows of "
                              f"{dst_t.dtype} {tuple(dst_t.shape[1:])}")
        src, dst = self._as(src, torch.int64), self._as(dst, torch.int64)
        self.lib.call("pl_copy_rows", self._p(src_t), self._p(dst_t), dst_t[0].numel() * dst_t.element_size(),
                      self._p(src), self._p(dst), src.numel(), self._stream(dst_t))

    def nccl_available(self) -> bool:
        return nccl_status(self.lib)[0]

    def nccl_unique_id(self) -> bytes:
        self._require_nccl()
        buf = self.lib.ffi.new("uint8_t[]", self.lib.lib.PL_NCCL_ID_BYTES)
        self.lib.call("pl_nccl_unique_id", buf)
        return bytes(self.lib.ffi.buffer(buf))

    def nccl_init(self, unique_id: bytes, nranks: int, rank: int, device: int | None, timeout_s: float) -> int:
        """A communicator of `nranks` on `device` (None: torch's current device), once every rank has joined
        within timeout_s (else NativeError, the communicator aborted); returns its handle."""
        self._require_nccl()
        device = torch.cuda.current_device() if device is None else device
        if len(unique_id) != self.lib.lib.PL_NCCL_ID_BYTES:
            raise PocketError(f"NCCL unique id must be {self.lib.lib.PL_NCCL_ID_BYTES} bytes, got {len(unique_id)}")
        comm = self.lib.ffi.new("uint64_t*")
        self.lib.call("pl_nccl_init", unique_id, nranks, rank, device, timeout_s, comm)
        return int(comm[0])

    def all_reduce(self, x: torch.Tensor, comm: int) -> torch.Tensor:
        self.lib.call("pl_nccl_all_reduce_sum", comm, self._p(x), x.numel(), self._dt(x), self._stream(x))
        return x

    def nccl_wait(self, comm: int, timeout_s: float) -> None:
        """Until the all-reduces queued on this device's stream have completed; past timeout_s, or on NCCL's
        asynchronous error (a peer gone), the communicator is aborted and NativeError says which."""
        self.lib.call("pl_nccl_wait", comm, self._stream(torch.empty(0, device=self.device)), timeout_s)

    def _require_nccl(self) -> None:
        ok, why = nccl_status(self.lib)
        if not ok:
            raise PocketError(f"tensor parallelism needs NCCL: {why}")


# -----------------------------------------------------------------------------------------------
# 3c. Choosing the backend: which device, dtypes and ops a configuration runs with, all checked before
#     a weight loads (--device auto, --backend auto); tensor-parallel ranks choose the same way.
# -----------------------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32", "fp32": "float32"}
NATIVE_ACTIVATION_DTYPES = (torch.float16, torch.float32)   # csrc/pocketllm.h: act_dtype is fp32 or fp16


def resolve_dtype(name: str, device: torch.device, what: str) -> torch.dtype:
    """--dtype / --kv-dtype: auto (float16 on a GPU, float32 on the CPU), a torch name, or vLLM's half / bf16."""
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _DTYPES:
        raise PocketError(f"--{what} must be one of auto, {', '.join(_DTYPES)} (or {', '.join(_DTYPE_ALIASES)}); "
                          f"got {name!r}")
    return _DTYPES[name]


def resolve_dtypes(opts: EngineOptions, device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(activation dtype, KV-cache dtype) on device."""
    dtype = resolve_dtype(opts.dtype, device, "dtype")
    return dtype, dtype if opts.kv_dtype == "auto" else resolve_dtype(opts.kv_dtype, device, "kv-dtype")


def resolve_device(name: str) -> torch.device:
    """--device: auto (the first CUDA device torch sees, else the CPU), cpu, cuda or cuda:N."""
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "auto":
        return torch.device("cuda", 0) if cuda_count else torch.device("cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise PocketError(f"--device {name!r} is not a device (expected auto, cpu, cuda or cuda:N)") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise PocketError(f"--device {name}: pocketllm runs on cpu or cuda devices, not {device.type}")
    if cuda_count == 0:
        raise PocketError(f"--device {name}: torch {torch.__version__} sees no CUDA device "
                          f"(torch.cuda.is_available() is False); use --device cpu, or leave --device auto")
    if (device.index or 0) >= cuda_count:
        raise PocketError(f"--device {name}: only {cuda_count} CUDA device(s) visible "
                          f"(cuda:0 .. cuda:{cuda_count - 1})")
    return torch.device("cuda", device.index or 0)


def _native_refusal(dtype: torch.dtype, kv_dtype: torch.dtype) -> str | None:
    """Why the native kernels cannot run with these dtypes, or None when they can."""
    act, kv = str(dtype).removeprefix("torch."), str(kv_dtype).removeprefix("torch.")
    if dtype not in NATIVE_ACTIVATION_DTYPES:
        return (f"the native kernels take float16 or float32 activations, not {act}: "
                f"use --dtype float16, or --backend torch")
    if kv_dtype != dtype:
        return (f"the native attention reads the KV cache in the activation dtype ({act}), not {kv}: "
                f"leave --kv-dtype at auto")
    return None


def choose_backend(backend: str, device: torch.device, dtype: torch.dtype,
                   kv_dtype: torch.dtype) -> tuple[str, str]:
    """--backend: torch (the reference, anywhere), native (the CUDA library), or auto: native when the library
    loads on this device and its kernels take these dtypes, else torch. (name, why); an explicit native that
    cannot run is refused here, before any weight loads, never at the first request."""
    if backend not in ("auto", "torch", "native"):
        raise PocketError(f"--backend must be auto, torch or native (got {backend!r})")
    if backend == "torch":
        return "torch", "asked for"
    ok, status = native_status(device)
    refusal = _native_refusal(dtype, kv_dtype) if ok else status
    if refusal is None:
        return "native", status
    if backend == "native":
        raise PocketError(f"--backend native: {refusal}")
    return "torch", refusal


@dataclass
class Placement:
    """Where and how the model runs, decided from the options alone, before any weight loads."""
    device: torch.device               # rank 0's device
    backend: str                       # torch | native
    dtype: torch.dtype                 # activations
    kv_dtype: torch.dtype              # KV cache and convolution state
    why: str                           # why this backend: the start-up line says it

    def describe(self) -> str:
        name = lambda dt: str(dt).removeprefix("torch.")  # noqa: E731
        where = f"{self.device} ({torch.cuda.get_device_name(self.device)})" if self.device.type == "cuda" \
            else str(self.device)
        return (f"backend {self.backend} on {where}, {name(self.dtype)} activations, {name(self.kv_dtype)} KV cache: "
                f"{self.why}")


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


def plan_placement(opts: EngineOptions) -> Placement:
    """Validate every device x backend x dtype x kv-dtype choice and resolve the autos. PocketError naming the
    flag for anything that cannot run."""
    if opts.backend not in ("auto", "torch", "native"):
        raise PocketError(f"--backend must be auto, torch or native (got {opts.backend!r})")
    device = parse_devices(opts.devices)[0] if opts.devices else resolve_device(opts.device)
    dtype, kv_dtype = resolve_dtypes(opts, device)
    backend, why = choose_backend(opts.backend, device, dtype, kv_dtype)
    return Placement(device, backend, dtype, kv_dtype, why)


def select_ops(opts: EngineOptions, device: torch.device):
    """The backend's ops on `device` and why they were chosen (choose_backend). Tensor-parallel ranks use it."""
    backend, why = choose_backend(opts.backend, device, *resolve_dtypes(opts, device))
    return (NativeOps(device) if backend == "native" else TorchOps()), f"{backend} ({why})"


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
                                  # (a decode batch with R = T: rows 0..T-1 in order, read without a gather)
    fresh_slots: torch.Tensor     # (F,) int64, state slots of sequences starting at position 0: zeroed first

    @property
    def is_decode(self) -> bool:
        return self.token_ids.numel() == self.state_slots.numel()


@dataclass
class VerifyWindow:
    """The S sequences that verify drafts this step. A window of n tokens advances a sequence's GDN states by
    n, but only the first `kept` of them stay: Model.rollback restores the states saved here before the step
    and replays the kept tokens' recorded conv and delta-rule inputs (no projection runs twice)."""
    slots: torch.Tensor            # (S,) int64 state slots
    rows: torch.Tensor             # (W,) int64 batch rows of the windows, sequence by sequence
    lens: list[int]                # (S,) tokens in each window
    conv: dict[int, torch.Tensor] = field(default_factory=dict)    # layer -> (S, C', W-1) before the step
    ssm: dict[int, torch.Tensor] = field(default_factory=dict)     # layer -> (S, Hv', Dk, Dv) before the step
    inputs: dict[int, tuple] = field(default_factory=dict)         # layer -> qkv (W, C'), a, b (W, Hv')


@dataclass
class Cache:
    """Per-layer KV cache (full attention) and recurrent state (linear attention), indexed by layer. The MTP
    layer (speculative decoding) has its KV under index num_hidden_layers, paged by the same block tables."""
    k: dict[int, torch.Tensor]     # layer -> (num_blocks, block_size, Hk, Dh)
    v: dict[int, torch.Tensor]
    conv: dict[int, torch.Tensor]  # layer -> (slots, conv_dim, W-1)
    ssm: dict[int, torch.Tensor]   # layer -> (slots, Hv, Dk, Dv) fp32
    window: VerifyWindow | None = None   # this step's verify windows (speculative decoding), else None
    hidden: torch.Tensor | None = None   # (slots, D) with an MTP layer: the target's hidden state at each slot's
                                         # last computed position, which the MTP layer reads there (Engine._draft)


@dataclass
class Shard:
    """Which part of the model this rank holds (tensor parallelism, Megatron style); rank 0 of 1 = all."""
    rank: int = 0
    world: int = 1
    whole_blocks: bool = False    # FP8 slices must fall on whole scale blocks (the native kernels' grid)

    def split(self, n: int, what: str) -> tuple[int, int]:
        """This rank's [start, stop) of n units (heads, rows); refuses an uneven split."""
        if n % self.world:
            raise CheckpointError(f"{what}: {n} does not divide by the tensor-parallel degree {self.world}")
        per = n // self.world
        return self.rank * per, (self.rank + 1) * per

    def vocab(self, V: int) -> tuple[int, int]:
        """This rank's [start, stop) of the vocabulary (embedding and lm_head rows): ceil(V / world) rows each,
        the last rank the rest (a ragged split is fine). The native backend cuts on 128-row boundaries, whole
        FP8 blocks should the lm_head be quantised. One rank's slice may be empty when V is tiny."""
        per = -(-V // self.world)
        if self.whole_blocks:
            per = -(-per // 128) * 128
        return min(self.rank * per, V), min((self.rank + 1) * per, V)


# Layer weights, one dataclass per kind of block. Field names are the HF tensor names under the block's
# module (`layers.{i}.self_attn.q_proj.weight` -> AttentionWeights.q_proj), loaded unfused, so a checkpoint
# name always finds its field. Shapes are this rank's shard (H' = H / world heads, I' = I / world rows);
# D = hidden_size. Then fuse_projections stacks the rows of the projections that read the same input into one
# weight (a FusedLinear field: one kernel launch instead of two to four), and the HF fields become views of it.


@dataclass
class FusedLinear:
    """Projections of one input run together: each group is one Linear of stacked rows whose output splits into
    `sizes` columns (ops.linear_parts: one launch per group, each part its own tensor). Parts that cannot share a
    weight (FP8 beside dense, or an FP8 part ending inside a scale block) fall into separate groups."""
    groups: list[tuple[Linear, list[int]]]   # (stacked weight (sum(sizes), K), output columns of each part)

@dataclass
class AttentionWeights:
    """Gated attention (qwen3_5: o = o_proj(attn(q, k, v) * sigmoid(gate))), or plain attention (qwen3)."""
    q_proj: Linear                 # (H'*Dh*2, D) rows [q | gate] per head; (H'*Dh, D) when not gated. After
                                   # fuse_projections: [q (all heads) | gate (all heads)], a view into qkv
    k_proj: Linear                 # (Hk'*Dh, D)
    v_proj: Linear                 # (Hk'*Dh, D)
    o_proj: Linear                 # (D, H'*Dh) rowwise: its output is all-reduced
    q_norm: torch.Tensor           # (Dh,) fp32, zero-centred (y = norm(x) * (1 + w))
    k_norm: torch.Tensor           # (Dh,) fp32, zero-centred
    heads: int                     # H': this rank's query heads
    kv_heads: int                  # Hk': this rank's key/value heads
    qkv: FusedLinear | None = None  # parts q (H'*Dh) | gate (H'*Dh) | k | v; q|gate still per head when
    gate_interleaved: bool = False  # FP8 heads smaller than a scale block could not be regrouped (then 3 parts)


@dataclass
class GatedDeltaNetWeights:
    """Gated DeltaNet (linear attention): causal conv over [q | k | v], then the gated delta rule."""
    in_proj_qkv: Linear            # (2*Hk'*Dk + Hv'*Dv, D) rows [q | k | v], each part this rank's heads
    in_proj_z: Linear              # (Hv'*Dv, D) the output gate
    in_proj_a: Linear              # (Hv', D) decay input
    in_proj_b: Linear              # (Hv', D) beta input
    out_proj: Linear               # (D, Hv'*Dv) rowwise: its output is all-reduced
    conv1d: torch.Tensor           # (C', W) fp32, HF's (C, 1, W) depthwise kernel without its middle axis
    A_log: torch.Tensor            # (Hv',) fp32
    dt_bias: torch.Tensor          # (Hv',) fp32
    norm: torch.Tensor             # (Dv,) fp32, the gated RMSNorm (plain x * w, not zero-centred)
    k_heads: int                   # Hk': this rank's key heads
    v_heads: int                   # Hv': this rank's value heads
    in_proj: FusedLinear | None = None   # parts qkv | z | a | b (FP8 qkv|z and dense a|b: two groups)


@dataclass
class MLPWeights:
    """SwiGLU: down_proj(silu(gate_proj(x)) * up_proj(x))."""
    gate_proj: Linear              # (I', D) colwise
    up_proj: Linear                # (I', D) colwise
    down_proj: Linear              # (D, I') rowwise: its output is all-reduced
    gate_up: FusedLinear | None = None   # parts gate | up


def load_norm(ckpt: Checkpoint, cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Norm weights as fp32 in the zero-centred form the ops use: y = norm(x) * (1 + w)."""
    w = load_dense(ckpt, name, shape, dtype=torch.float32)
    return w if cfg.zero_centred_norm else w - 1.0   # Qwen3's plain x * w, rewritten as x * (1 + (w - 1))


def load_mlp(ckpt: Checkpoint, cfg: ModelConfig, p: str, shard: Shard) -> MLPWeights:
    I, D, wb = cfg.intermediate_size, cfg.hidden_size, shard.whole_blocks
    i0, i1 = shard.split(I, f"tensor '{p}gate_proj.weight' rows")
    return MLPWeights(gate_proj=load_linear(ckpt, p + "gate_proj", (I, D), rows=[(i0, i1)], whole_blocks=wb),
                      up_proj=load_linear(ckpt, p + "up_proj", (I, D), rows=[(i0, i1)], whole_blocks=wb),
                      down_proj=load_linear(ckpt, p + "down_proj", (D, I), cols=[(i0, i1)], whole_blocks=wb))


def load_attention(ckpt: Checkpoint, cfg: ModelConfig, p: str, shard: Shard) -> AttentionWeights:
    Hq, Hk, Dh, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    wb = shard.whole_blocks
    q0, q1 = shard.split(Hq, f"tensor '{p}q_proj.weight' heads")
    k0, k1 = shard.split(Hk, f"tensor '{p}k_proj.weight' kv heads")
    qw = 2 * Dh if cfg.gated_attention else Dh                          # rows per q head: [q | gate]
    return AttentionWeights(
        q_proj=load_linear(ckpt, p + "q_proj", (Hq * qw, D), rows=[(q0 * qw, q1 * qw)], whole_blocks=wb),
        k_proj=load_linear(ckpt, p + "k_proj", (Hk * Dh, D), rows=[(k0 * Dh, k1 * Dh)], whole_blocks=wb),
        v_proj=load_linear(ckpt, p + "v_proj", (Hk * Dh, D), rows=[(k0 * Dh, k1 * Dh)], whole_blocks=wb),
        o_proj=load_linear(ckpt, p + "o_proj", (D, Hq * Dh), cols=[(q0 * Dh, q1 * Dh)], whole_blocks=wb),
        q_norm=load_norm(ckpt, cfg, p + "q_norm.weight", (Dh,)),
        k_norm=load_norm(ckpt, cfg, p + "k_norm.weight", (Dh,)),
        heads=q1 - q0, kv_heads=k1 - k0)


def load_gdn(ckpt: Checkpoint, cfg: ModelConfig, p: str, shard: Shard) -> GatedDeltaNetWeights:
    Hk, Hv, Dk, Dv, D = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                         cfg.linear_value_head_dim, cfg.hidden_size)
    k0, k1 = shard.split(Hk, f"tensor '{p}in_proj_qkv.weight' key heads")
    v0, v1 = shard.split(Hv, f"tensor '{p}in_proj_z.weight' value heads")
    # The qkv rows are [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]: a rank takes its heads from each of the three parts.
    qkv_rows = [(k0 * Dk, k1 * Dk), (Hk * Dk + k0 * Dk, Hk * Dk + k1 * Dk), (2 * Hk * Dk + v0 * Dv, 2 * Hk * Dk + v1 * Dv)]
    C, W, wb = cfg.linear_conv_dim, cfg.linear_conv_kernel_dim, shard.whole_blocks
    return GatedDeltaNetWeights(
        in_proj_qkv=load_linear(ckpt, p + "in_proj_qkv", (C, D), rows=qkv_rows, whole_blocks=wb),
        in_proj_z=load_linear(ckpt, p + "in_proj_z", (Hv * Dv, D), rows=[(v0 * Dv, v1 * Dv)], whole_blocks=wb),
        in_proj_a=load_linear(ckpt, p + "in_proj_a", (Hv, D), rows=[(v0, v1)], whole_blocks=wb),
        in_proj_b=load_linear(ckpt, p + "in_proj_b", (Hv, D), rows=[(v0, v1)], whole_blocks=wb),
        out_proj=load_linear(ckpt, p + "out_proj", (D, Hv * Dv), cols=[(v0 * Dv, v1 * Dv)], whole_blocks=wb),
        conv1d=load_dense(ckpt, p + "conv1d.weight", (C, 1, W), rows=qkv_rows, dtype=torch.float32)[:, 0],
        A_log=load_dense(ckpt, p + "A_log", (Hv,), rows=[(v0, v1)], dtype=torch.float32),
        dt_bias=load_dense(ckpt, p + "dt_bias", (Hv,), rows=[(v0, v1)], dtype=torch.float32),
        norm=load_dense(ckpt, p + "norm.weight", (Dv,), dtype=torch.float32),
        k_heads=k1 - k0, v_heads=v1 - v0)


@dataclass(frozen=True)
class Mixer:
    """One kind of layer mixer: where its tensors live, how they load, and which Model method runs it."""
    module: str                    # the HF module under `layers.{i}.`
    load: Callable                 # (ckpt, cfg, prefix, shard) -> its weights dataclass
    forward: str                   # the Model method that runs it: (layer, x, batch, cache) -> (T, D)


# The layer types of config.json's layer_types, and what each one is. Architecture.layer_types (section 1)
# says which of them a model_type may use.
MIXERS = {"full_attention": Mixer("self_attn", load_attention, "attention"),
          "linear_attention": Mixer("linear_attn", load_gdn, "gated_deltanet")}


@dataclass
class DecoderLayer:
    """One decoder layer: x += mixer(norm(x)); x += mlp(norm(x))."""
    index: int                     # i in `layers.{i}.`: the key of its cache tensors
    kind: str                      # a key of MIXERS: "full_attention" | "linear_attention"
    input_layernorm: torch.Tensor  # (D,) fp32, zero-centred
    post_attention_layernorm: torch.Tensor  # (D,) fp32, zero-centred
    mixer: AttentionWeights | GatedDeltaNetWeights
    mlp: MLPWeights


def load_layer(ckpt: Checkpoint, cfg: ModelConfig, i: int, shard: Shard, p: str | None = None,
               kind: str | None = None) -> DecoderLayer:
    """Read layer i's tensors (this rank's shard of them). Colwise = split output rows; rowwise = split inputs.
    p and kind name another layer (the MTP layer: "mtp.layers.0.", full attention)."""
    p, D, kind = p or f"{cfg.weight_prefix}layers.{i}.", cfg.hidden_size, kind or cfg.layer_types[i]
    norm = lambda name: load_norm(ckpt, cfg, p + name, (D,))  # noqa: E731
    input_norm, post_norm = norm("input_layernorm.weight"), norm("post_attention_layernorm.weight")
    mlp = load_mlp(ckpt, cfg, p + "mlp.", shard)        # before the mixer: a refused shard names the MLP first
    return DecoderLayer(index=i, kind=kind, input_layernorm=input_norm, post_attention_layernorm=post_norm,
                        mixer=MIXERS[kind].load(ckpt, cfg, f"{p}{MIXERS[kind].module}.", shard), mlp=mlp)


@dataclass
class MTPWeights:
    """Qwen3.5's multi-token prediction layer (`mtp.*`), the draft model of speculative decoding. At position i
    it reads the target's final hidden state h_i and the next token t_{i+1}: x = fc([norm_e(embed(t_{i+1})) |
    norm_h(h_i)]), one full-attention decoder layer, then norm; the target's lm_head gives the logits of
    t_{i+2}. Its output feeds its next position the same way, so it drafts K tokens in K passes."""
    fc: Linear                     # (D, 2D) replicated on every rank (its input is replicated)
    pre_fc_norm_embedding: torch.Tensor   # (D,) fp32, zero-centred
    pre_fc_norm_hidden: torch.Tensor      # (D,) fp32, zero-centred
    norm: torch.Tensor             # (D,) fp32, zero-centred
    layer: DecoderLayer            # mtp.layers.0, sharded like the target's layers; index num_hidden_layers


MTP_PREFIX = "mtp."


def has_mtp(ckpt: Checkpoint) -> bool:
    """Whether the checkpoint holds MTP tensors (all of them or not: Model loads them, or says which is missing)."""
    return ckpt.config.model_type != "qwen3" and any(name.startswith(MTP_PREFIX) for name in ckpt.weight_map)


def load_mtp(ckpt: Checkpoint, cfg: ModelConfig, shard: Shard) -> MTPWeights:
    D, p = cfg.hidden_size, MTP_PREFIX
    return MTPWeights(fc=load_linear(ckpt, p + "fc", (D, 2 * D), whole_blocks=shard.whole_blocks),
                      pre_fc_norm_embedding=load_norm(ckpt, cfg, p + "pre_fc_norm_embedding.weight", (D,)),
                      pre_fc_norm_hidden=load_norm(ckpt, cfg, p + "pre_fc_norm_hidden.weight", (D,)),
                      norm=load_norm(ckpt, cfg, p + "norm.weight", (D,)),
                      layer=load_layer(ckpt, cfg, cfg.num_hidden_layers, shard, p + "layers.0.", "full_attention"))


def _to_device(weights, device, dtype: torch.dtype):
    """A copy of a layer's weights on device: dense Linears take the activation dtype, FP8 stays FP8."""
    def move(value):
        if isinstance(value, Linear):
            return value.to(device, dtype)
        if isinstance(value, FusedLinear):
            return FusedLinear([(w.to(device, dtype), sizes) for w, sizes in value.groups])
        if isinstance(value, torch.Tensor):
            return value.to(device)
        return _to_device(value, device, dtype) if dataclasses.is_dataclass(value) else value
    return dataclasses.replace(weights, **{f.name: move(getattr(weights, f.name)) for f in dataclasses.fields(weights)})


def fp8_dense_bytes(parts: list, dtype: torch.dtype) -> int:
    """Bytes that dense copies of every FP8 Linear in parts (layer weights, Linears, lists of them) would take."""
    total = 0
    for part in parts:
        if isinstance(part, list):
            total += fp8_dense_bytes(part, dtype)
        elif isinstance(part, Linear):
            total += part.weight.numel() * dtype.itemsize if part.scale is not None else 0
        elif dataclasses.is_dataclass(part):
            total += fp8_dense_bytes([getattr(part, f.name) for f in dataclasses.fields(part)], dtype)
    return total


def fp8_dense_line(model, budget_mib: int) -> str:
    """The start-up line that says whether the FP8 weights were dequantised at load, and the budget it used."""
    size, dtype = f"{model.dense_bytes / 2 ** 20:.1f} MiB", str(model.dtype).removeprefix("torch.")
    if model.dense:
        return (f"FP8 weights dequantised once at load: a dense {dtype} copy of {size} "
                f"(--fp8-dense-memory {budget_mib} MiB)")
    return (f"FP8 weights stay FP8, dequantised per use: a dense {dtype} copy would take {size}, more than "
            f"--fp8-dense-memory {budget_mib} MiB")


def densify(weights, dtype: torch.dtype):
    """weights (a Linear, a layer's dataclass, or a list of them) with every FP8 Linear dequantised to a dense
    (N, K) `dtype` copy: the values dequantize() computes at each use, computed once."""
    if isinstance(weights, list):
        return [densify(w, dtype) for w in weights]
    if isinstance(weights, Linear):
        return Linear(dequantize(weights, dtype)) if weights.scale is not None else weights
    if not dataclasses.is_dataclass(weights):
        return weights
    return dataclasses.replace(weights, **{f.name: densify(getattr(weights, f.name), dtype)
                                           for f in dataclasses.fields(weights)})


HALF_PACK_MIN = 1 << 20   # weights; smaller matrices run faster in fp32 (the fp16 GEMM's per-call cost)


def pack_half(w: Linear) -> Linear:
    """A dense float32 weight of at least HALF_PACK_MIN values that fp16 holds (exactly where |w| >= 2^-14, as
    every bf16 weight in that range; at most 2^-25 off below it) as fp16 with torch's fp16 GEMM copy (fbgemm:
    fp16 weights, fp32 inputs and sums), which reads half the bytes: on the CPU a large GEMV is bound by them.
    Anything else is returned as it is, so the logits do not change beyond the sums' order."""
    if w.scale is not None or w.weight.dtype != torch.float32 or w.weight.numel() < HALF_PACK_MIN or \
            w.weight.device.type != "cpu" or "fbgemm" not in torch.backends.quantized.supported_engines:
        return w
    half = w.weight.to(torch.float16)
    if not bool(((half.float() - w.weight).abs() <= 2.0 ** -25).all()):
        return w
    return Linear(half, None, w.block, torch.ops.quantized.linear_prepack_fp16(w.weight, None))


def linear_rows(w: Linear, r0: int, r1: int) -> Linear:
    """Rows [r0, r1) of w as a view (FP8: r0 on a scale block boundary, so its scale rows are a view too)."""
    if w.scale is None:
        return Linear(w.weight[r0:r1], None, w.block)
    bn = w.block[0]
    return Linear(w.weight[r0:r1], w.scale[r0 // bn:-(-r1 // bn)], w.block)


def stackable(a: Linear, b: Linear) -> bool:
    """Whether b's rows can follow a's in one weight: same dtype, K and scale grid, and (FP8) a ends on a block."""
    if a.weight.dtype != b.weight.dtype or a.shape[1] != b.shape[1] or (a.scale is None) != (b.scale is None):
        return False
    return a.scale is None or (tuple(a.block) == tuple(b.block) and a.shape[0] % a.block[0] == 0)


def fuse_linears(parts: list[Linear], stack: bool = True) -> tuple[FusedLinear, list[Linear]]:
    """Stack consecutive stackable parts (at most four per group: pl_linear_parts' limit) into one weight each;
    returns the FusedLinear and each part as a view of its group's weight (the originals can be freed).
    stack=False: one group per part, nothing copied."""
    groups, views = [], []
    for w in parts:
        if stack and groups and len(groups[-1]) < 4 and stackable(groups[-1][-1], w):
            groups[-1].append(w)
        else:
            groups.append([w])
    fused = []
    for group in groups:
        scales = None if group[0].scale is None else torch.cat([w.scale for w in group])
        stacked = Linear(torch.cat([w.weight for w in group]), scales, group[0].block)
        sizes = [w.shape[0] for w in group]
        if len(group) == 1:
            stacked = group[0]                                             # nothing to stack: no copy
        fused.append((stacked, sizes))
        ends = list(itertools.accumulate(sizes))
        views += [linear_rows(stacked, e - n, e) for n, e in zip(sizes, ends)]
    return FusedLinear(fused), views


def split_q_gate(w: Linear, heads: int, Dh: int) -> tuple[Linear, Linear] | None:
    """q_proj's rows [q | gate] per head regrouped into all q rows and all gate rows; None for FP8 whose heads
    are not whole scale blocks (a block's scale would cover q and gate rows)."""
    if w.scale is not None and Dh % w.block[0]:
        return None
    rows = w.weight.view(heads, 2, Dh, -1)                               # (H', [q|gate], Dh, D)
    if w.scale is None:
        return Linear(rows[:, 0].reshape(heads * Dh, -1)), Linear(rows[:, 1].reshape(heads * Dh, -1))
    sc = w.scale.view(heads, 2, Dh // w.block[0], -1)                    # (H', [q|gate], Dh/128, D/128)
    return tuple(Linear(rows[:, i].reshape(heads * Dh, -1), sc[:, i].reshape(-1, sc.shape[-1]), w.block)
                 for i in (0, 1))


def fuse_projections(layer: DecoderLayer, Dh: int, stack: bool = True) -> DecoderLayer:
    """The layer with its same-input projections stacked (q|gate|k|v, qkv|z|a|b, gate|up); the HF fields become
    views of the stacked weights (q_proj then holds [q (all heads) | gate (all heads)]), so memory stays one copy.
    stack=False keeps every weight where it is (one group per part; q_proj stays [q | gate] per head)."""
    m, mlp = layer.mixer, layer.mlp
    gate_up, (gate, up) = fuse_linears([mlp.gate_proj, mlp.up_proj], stack)
    mlp = dataclasses.replace(mlp, gate_proj=gate, up_proj=up, gate_up=gate_up)
    if isinstance(m, GatedDeltaNetWeights):
        in_proj, (qkv, z, a, b) = fuse_linears([m.in_proj_qkv, m.in_proj_z, m.in_proj_a, m.in_proj_b], stack)
        m = dataclasses.replace(m, in_proj=in_proj, in_proj_qkv=qkv, in_proj_z=z, in_proj_a=a, in_proj_b=b)
    else:
        gated = m.q_proj.shape[0] == 2 * m.heads * Dh
        q_gate = split_q_gate(m.q_proj, m.heads, Dh) if gated and stack else None
        qkv, views = fuse_linears(([m.q_proj] if q_gate is None else list(q_gate)) + [m.k_proj, m.v_proj], stack)
        # q and gate always share the first group (same dtype and grid; FP8 heads are whole blocks)
        q_proj = views[0] if q_gate is None else linear_rows(qkv.groups[0][0], 0, 2 * m.heads * Dh)
        m = dataclasses.replace(m, qkv=qkv, gate_interleaved=gated and q_gate is None, q_proj=q_proj,
                                k_proj=views[-2], v_proj=views[-1])
    return dataclasses.replace(layer, mixer=m, mlp=mlp)


# --load-format dummy (vLLM's name): the tensors a checkpoint of this config.json would hold, with random values
# of the exact dtypes, shapes and FP8 block scales, made on the target device when read. Everything that speed
# and memory depend on is real; only the text is noise (speculative drafts are rejected).

LOAD_FORMATS = ("auto", "dummy")   # auto: the safetensors files; dummy: random weights from config.json alone


@dataclass(frozen=True)
class DummyTensor:
    """One tensor a checkpoint of this config holds: its stored shape and dtype, and how its values are drawn."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    init: str                  # linear | embedding | scale | norm (zero-centred) | ones_norm | conv | A_log | dt_bias


def _stored_dtype(raw: dict) -> torch.dtype:
    """The unquantised tensors' dtype: config.json's dtype (torch_dtype in older files); bf16 when it says none."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    name = text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
    dtype = getattr(torch, str(name), None)
    return dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16


def mtp_layers_in_config(raw: dict) -> int:
    """config.json's mtp_num_hidden_layers (Qwen3.5's checkpoints ship one MTP layer and say so)."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    return int(text.get("mtp_num_hidden_layers") or 0)


def dummy_tensors(cfg: ModelConfig, stored: torch.dtype = torch.bfloat16, mtp: bool = False) -> dict[str, DummyTensor]:
    """Name -> DummyTensor of every tensor the decoder (and with `mtp` the MTP layer) reads, named as HF names
    them. A 2-D projection is FP8 with bf16 block scales when the config quantises and modules_to_not_convert
    does not name it, as the FP8 checkpoints store them; everything else has the stored dtype, the embedding and
    lm_head too (Qwen's FP8 checkpoints keep both in bf16 whether the list names them or not)."""
    D, I, V, Dh = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    out: dict[str, DummyTensor] = {}

    def linear(name: str, n: int, k: int):
        quant = cfg.quant
        if quant is None or name.endswith(("embed_tokens", "lm_head")) or \
                any(part in name for part in quant.modules_to_not_convert):
            out[name + ".weight"] = DummyTensor((n, k), stored, "embedding" if "embed" in name else "linear")
            return
        bn, bk = quant.block
        out[name + ".weight"] = DummyTensor((n, k), torch.float8_e4m3fn, "linear")
        out[name + ".weight_scale_inv"] = DummyTensor((-(-n // bn), -(-k // bk)), torch.bfloat16, "scale")

    def tensor(name: str, shape: tuple[int, ...], init: str):
        out[name] = DummyTensor(shape, stored, init)

    norm = "norm" if cfg.zero_centred_norm else "ones_norm"

    def layer(p: str, kind: str):
        tensor(p + "input_layernorm.weight", (D,), norm)
        tensor(p + "post_attention_layernorm.weight", (D,), norm)
        linear(p + "mlp.gate_proj", I, D), linear(p + "mlp.up_proj", I, D), linear(p + "mlp.down_proj", D, I)
        if kind == "full_attention":
            Hq, Hk = cfg.num_attention_heads, cfg.num_key_value_heads
            a = p + "self_attn."
            linear(a + "q_proj", Hq * Dh * (2 if cfg.gated_attention else 1), D)
            linear(a + "k_proj", Hk * Dh, D), linear(a + "v_proj", Hk * Dh, D), linear(a + "o_proj", D, Hq * Dh)
            tensor(a + "q_norm.weight", (Dh,), norm), tensor(a + "k_norm.weight", (Dh,), norm)
        else:
            Hv, Dv, C = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_dim
            g = p + "linear_attn."
            linear(g + "in_proj_qkv", C, D), linear(g + "in_proj_z", Hv * Dv, D)
            linear(g + "in_proj_a", Hv, D), linear(g + "in_proj_b", Hv, D), linear(g + "out_proj", D, Hv * Dv)
            tensor(g + "conv1d.weight", (C, 1, cfg.linear_conv_kernel_dim), "conv")
            tensor(g + "A_log", (Hv,), "A_log"), tensor(g + "dt_bias", (Hv,), "dt_bias")
            tensor(g + "norm.weight", (Dv,), "ones_norm")            # the gated norm is plain x * w everywhere

    p = cfg.weight_prefix
    linear(p + "embed_tokens", V, D)
    for i, kind in enumerate(cfg.layer_types):
        layer(f"{p}layers.{i}.", kind)
    tensor(p + "norm.weight", (D,), norm)
    if not cfg.tie_word_embeddings:
        linear("lm_head", V, D)
    if mtp and cfg.model_type != "qwen3":
        linear(MTP_PREFIX + "fc", D, 2 * D)
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            tensor(f"{MTP_PREFIX}{name}.weight", (D,), norm)
        layer(MTP_PREFIX + "layers.0.", "full_attention")
    return out


def dummy_values(spec: DummyTensor, generator: torch.Generator, device) -> torch.Tensor:
    """Random values for one tensor, drawn on `device`: weights ~ N(0, 0.02) after their block scale (FP8 values
    span about +-200 of e4m3's +-448, scales about 3e-4), decays and biases in the ranges trained models have.
    Weights are drawn in 16 bits (an FP8 weight in bf16), so a rank's transient copy of a whole lm_head is no
    larger than the stored tensor."""
    kind, shape = spec.init, spec.shape
    big = kind in ("linear", "embedding")
    work = (torch.bfloat16 if spec.dtype == torch.float8_e4m3fn else spec.dtype) if big else torch.float32
    draw = lambda: torch.randn(shape, generator=generator, device=device, dtype=work)  # noqa: E731
    unit = lambda: torch.rand(shape, generator=generator, device=device, dtype=torch.float32)   # noqa: E731
    if kind == "linear" and spec.dtype == torch.float8_e4m3fn:
        values = draw().mul_(64).clamp_(-448, 448)                # in place: one 16-bit copy at a time
    elif kind in ("linear", "embedding"):
        values = draw().mul_(0.02)
    elif kind == "scale":
        values = (0.5 + unit()) * (0.02 / 64)
    elif kind == "norm":
        values = draw() * 0.02                                   # zero-centred: x * (1 + w)
    elif kind == "ones_norm":
        values = 1 + draw() * 0.02
    elif kind == "conv":
        values = draw() * 0.2
    elif kind == "A_log":
        values = torch.log(1 + 15 * unit())                      # decays exp(A_log) in [1, 16]
    else:                                                        # dt_bias
        values = 1 + draw() * 0.1
    return values.to(spec.dtype)


class _DummySlice:
    """What safetensors' get_slice returns, for a generated tensor: its shape, and indexing that draws the
    whole tensor once (so every rank's slice is a slice of the same tensor) and returns a copy of the part."""

    def __init__(self, spec: DummyTensor, seed: int, device):
        self.spec, self.seed, self.device, self.full = spec, seed, device, None

    def get_shape(self) -> list[int]:
        return list(self.spec.shape)

    def __getitem__(self, index) -> torch.Tensor:
        if self.full is None:
            g = torch.Generator(device=self.device).manual_seed(self.seed)
            self.full = dummy_values(self.spec, g, self.device)
        part = self.full[index]
        return part if part.numel() == self.full.numel() else part.clone()   # a view would keep all of it


class DummyCheckpoint(Checkpoint):
    """--load-format dummy: a checkpoint directory read for its config.json alone; every tensor dummy_tensors
    lists is drawn on `device` when the loader reads it (seeded by --seed and its name; nothing is written or
    copied from the host). Set `device` before loading a model (the rank's device)."""

    def __init__(self, path: str | os.PathLike, device="cpu", seed: int = 0):
        self.device, self.seed = torch.device(device), seed
        super().__init__(path)

    def _find_tensors(self) -> dict[str, DummyTensor]:
        stored = _stored_dtype(self.raw_config)
        return dummy_tensors(self.config, stored, mtp=mtp_layers_in_config(self.raw_config) > 0)

    def _slice(self, name: str) -> _DummySlice:
        if name not in self.weight_map:
            raise CheckpointError(f"{self.path}: missing tensor '{name}' (--load-format dummy makes only the tensors "
                                  f"a {self.config.model_type} checkpoint of this config.json holds)")
        seed = (self.seed * 1_000_003 + int.from_bytes(hashlib.sha256(name.encode()).digest()[:6], "little")) % 2 ** 63
        return _DummySlice(self.weight_map[name], seed, self.device)


def open_checkpoint(path: str | os.PathLike, load_format: str = "auto", device="cpu", seed: int = 0) -> Checkpoint:
    """The checkpoint a --load-format reads: auto, the safetensors files; dummy, random weights from config.json."""
    if load_format not in LOAD_FORMATS:
        raise PocketError(f"--load-format must be one of {', '.join(LOAD_FORMATS)} (got {load_format!r})")
    if load_format == "dummy":
        return DummyCheckpoint(path, device, seed)
    return Checkpoint(path)


def torch_inference(method):
    """A Model entry point that runs under torch.inference_mode with the torch backend on the CPU (no autograd
    bookkeeping per op: about a tenth of a small model's decode step there). Its returned tensors are copied out
    of it, so callers may change them in place; nested calls run as they are."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self.ops.name != "torch" or self.device.type != "cpu" or torch.is_inference_mode_enabled():
            return method(self, *args, **kwargs)
        with torch.inference_mode():
            out = method(self, *args, **kwargs)
        return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone() if out is not None else None
    return run


class Model:
    """The decoder: embedding, layers, final norm, lm_head. forward(batch) -> logits of batch.logit_rows.
    With tensor parallelism each rank holds a shard and `all_reduce` sums the row-parallel outputs."""

    def __init__(self, ckpt: Checkpoint, ops, dtype: torch.dtype, device: torch.device, shard: Shard = Shard(),
                 num_layers: int | None = None, all_reduce: Callable | None = None, progress: bool = True,
                 mtp: bool = False, stack: bool | None = None, dense_budget: int = 0):
        """stack: stack same-input projections into one weight (fuse_projections); None: everywhere but the
        torch backend reading FP8 on the CPU (tests of another device's layout pass True). dense_budget: bytes
        the torch backend may hold as dense copies of the FP8 weights (--fp8-dense-memory; 0: FP8 stays FP8)."""
        cfg = self.cfg = ckpt.config
        self.ops, self.dtype, self.device, self.shard = ops, dtype, device, shard
        self.all_reduce = all_reduce or (lambda x: x)
        n = num_layers or cfg.num_hidden_layers
        V, D, p = cfg.vocab_size, cfg.hidden_size, cfg.weight_prefix
        self.vocab = v0, v1 = shard.vocab(V)                               # this rank's rows of both (section 8b)
        self.embed_tokens = load_dense(ckpt, p + "embed_tokens.weight", (V, D),
                                       rows=[(v0, v1)]).to(device)         # (V', D) stored dtype
        head = p + "embed_tokens" if cfg.tie_word_embeddings else "lm_head"
        self.lm_head = load_linear(ckpt, head, (V, D), rows=[(v0, v1)],
                                   whole_blocks=shard.whole_blocks).to(device, dtype)   # (V', D)
        self.norm = load_norm(ckpt, cfg, p + "norm.weight", (D,)).to(device)
        t0, layers = time.time(), []
        for i in range(n):
            layers.append(_to_device(load_layer(ckpt, cfg, i, shard), device, dtype))
            if progress and time.time() - t0 > 2.0:
                print(f"\rpocketllm: loading layer {i + 1}/{n}", end="" if i + 1 < n else "\n", file=sys.stderr, flush=True)
        # The MTP draft layer, when asked for and present (and the whole model runs: it reads the last layer). An
        # incomplete one is left out (no speculation): mtp_missing names the first tensor it lacks.
        self.mtp, self.mtp_missing = None, None
        if mtp and n == cfg.num_hidden_layers and has_mtp(ckpt):
            try:
                self.mtp = _to_device(load_mtp(ckpt, cfg, shard), device, dtype)
            except MissingTensorError as e:
                self.mtp_missing = e.name
        # FP8 -> dense once, here, when the torch backend's dense copy of every FP8 weight fits dense_budget bytes.
        self.dense_bytes = fp8_dense_bytes(layers + [self.mtp, self.lm_head], dtype)
        self.dense = ops.name == "torch" and 0 < self.dense_bytes <= dense_budget
        if self.dense:
            layers, self.mtp, self.lm_head = (densify(w, dtype) if w is not None else None
                                              for w in (layers, self.mtp, self.lm_head))
        # On the CPU the torch backend reads FP8 weights in place from the mapped checkpoint: stacking them would
        # copy every projection (twice the checkpoint's bytes resident). Elsewhere the weights are copies anyway.
        if stack is None:
            stack = self.dense or not (torch.device(device).type == "cpu" and ops.name == "torch")
        self.layers = [fuse_projections(L, cfg.head_dim, stack) for L in layers]
        self.mixers = [getattr(self, MIXERS[L.kind].forward) for L in self.layers]   # one method per layer
        if self.mtp is not None:
            self.mtp = dataclasses.replace(self.mtp, layer=fuse_projections(self.mtp.layer, cfg.head_dim, stack))
        self.cache_layers = self.layers + ([self.mtp.layer] if self.mtp else [])   # layers with cache tensors
        self.hidden_dtype = dtype if self.mtp else None                    # Cache.hidden's (the MTP layer reads it)
        if ops.name == "torch" and dtype == torch.float32:                 # (V', D) in fp16 when exact: half the
            self.lm_head = pack_half(self.lm_head)                         # bytes of the largest GEMV
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.float64) / cfg.rotary_dim))
        self.inv_freq = inv.float().to(device)                             # (R/2,)

    # The forward pass, one named path per mixer; prefill and decode differ only inside the ops.

    @torch_inference
    def forward(self, batch: Batch, cache: Cache) -> torch.Tensor:
        h = self.hidden(batch, cache)                                      # (T, D)
        if not (batch.is_decode and batch.logit_rows.numel() == h.shape[0]):   # decode: every row, in order
            h = h[batch.logit_rows]                                        # (R, D)
        return self.head(h)                                                # (R, V) fp32

    @torch_inference
    def hidden(self, batch: Batch, cache: Cache) -> torch.Tensor:
        """The final-normed hidden state of every token (T, D): the lm_head's input, and the MTP layer's."""
        if batch.fresh_slots.numel():                                      # a slot's previous owner's state
            for t in itertools.chain(cache.conv.values(), cache.ssm.values()):
                t[batch.fresh_slots] = 0
        x = self.embed(batch.token_ids)                                    # (T, D)
        residual = self.ops.zeros(x.shape, torch.float32, x.device)       # (T, D) fp32
        for L, mixer in zip(self.layers, self.mixers):
            x, residual = self.layer(L, mixer, x, residual, batch, cache)
        return self.ops.add_rmsnorm(x, residual, self.norm, self.cfg.rms_norm_eps, self.dtype)[0]   # (T, D)

    def layer(self, L: DecoderLayer, mixer: Callable, x, residual, batch: Batch, cache: Cache):
        """One decoder layer on the fp32 residual stream: returns the MLP's output and the stream before it."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        h, residual = ops.prenorm(x, residual, L.input_layernorm, eps, self.dtype)    # computed by the projections
        x = self.all_reduce(mixer(L, h, batch, cache))
        h, residual = ops.prenorm(x, residual, L.post_attention_layernorm, eps, self.dtype)
        return self.all_reduce(self.mlp(L.mlp, h)), residual

    # Speculative decoding: the MTP layer drafts, the target verifies a window of K+1 tokens per sequence.

    @torch_inference
    def draft(self, batch: Batch, cache: Cache, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer over a batch whose token at position i is t_{i+1}, with hidden (T, D) the state that
        predicted it (the target's, or the MTP's own for a chained draft). Returns the MTP's normed output
        at batch.logit_rows (R, D), which chains the next draft, and its logits (R, V) fp32."""
        m, ops, eps = self.mtp, self.ops, self.cfg.rms_norm_eps
        e = ops.rmsnorm(self.embed(batch.token_ids), m.pre_fc_norm_embedding, eps)            # (T, D)
        h = ops.rmsnorm(hidden.to(self.dtype), m.pre_fc_norm_hidden, eps)                    # (T, D)
        x = ops.linear(torch.cat([e, h], -1), m.fc)                                          # (T, D)
        residual = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        x, residual = self.layer(m.layer, self.attention, x, residual, batch, cache)
        out = ops.add_rmsnorm(x, residual, m.norm, eps, self.dtype)[0][batch.logit_rows]      # (R, D)
        return out, self.head(out)

    def open_window(self, cache: Cache, window: VerifyWindow) -> None:
        """Save the window sequences' GDN states before the step; gated_deltanet records their inputs."""
        for i in cache.conv:
            window.conv[i], window.ssm[i] = cache.conv[i][window.slots], cache.ssm[i][window.slots]
        cache.window = window

    @torch_inference
    def rollback(self, cache: Cache, kept: list[int]) -> None:
        """Leave each window sequence's GDN states after its first kept[s] tokens (1 <= kept[s] <= lens[s]):
        restore the states from before the step and replay the kept tokens' conv and delta rule."""
        w, cache.window = cache.window, None
        redo = [s for s, n in enumerate(kept) if n < w.lens[s]] if w is not None else []
        if not redo:
            return
        starts = [0, *itertools.accumulate(w.lens)]
        rows = torch.tensor([starts[s] + i for s in redo for i in range(kept[s])], dtype=torch.long)
        pick = torch.tensor(redo, dtype=torch.long)
        lens = torch.tensor([0] + [kept[s] for s in redo])
        dev = w.slots.device
        rows, pick, query_start = rows.to(dev), pick.to(dev), lens.cumsum(0).to(dev, torch.int32)
        slots = w.slots[pick]                                              # (S',)
        for L in self.layers:
            if L.index in w.inputs:
                cache.conv[L.index][slots], cache.ssm[L.index][slots] = w.conv[L.index][pick], w.ssm[L.index][pick]
                qkv, g, beta = w.inputs[L.index]
                self.delta_rule(L, qkv[rows], g[rows], beta[rows], cache, slots.int(), query_start)

    # Vocab-parallel embedding and lm_head: each rank holds rows [v0, v1) of both. Lookup: a rank fills the
    # rows of the ids it owns, zeros elsewhere, and an all-reduce sums them (exact: one rank is non-zero per
    # row). Head: a rank computes its (R, V') columns into a zeroed (R, V) and the same all-reduce gathers
    # them, so rank 0 samples from the full logits. Both in fp32, like the layers' all-reduces.

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard.world == 1:
            return self.ops.embed(ids, self.embed_tokens, self.dtype)     # (T, D)
        x = self.ops.embed_shard(ids, self.embed_tokens, self.vocab[0], torch.float32)   # (T, D), zero rows
        return self.all_reduce(x)                                                       # for others' ids

    @torch_inference
    def head(self, h: torch.Tensor) -> torch.Tensor:
        if self.shard.world == 1:
            return self.ops.linear(h, self.lm_head, torch.float32)        # (R, V)
        v0, v1 = self.vocab
        logits = self.ops.zeros((h.shape[0], self.cfg.vocab_size), torch.float32, h.device)   # (R, V)
        if not h.shape[0]:                                                 # every rank has the same rows
            return logits
        if v1 > v0:                                                        # (R, V') this rank's columns
            self.ops.write_columns(logits, self.ops.linear(h, self.lm_head, torch.float32), v0)
        return self.all_reduce(logits)

    def project(self, x, w: FusedLinear, dtype=None) -> list[torch.Tensor]:
        """Every part of a FusedLinear, (T, N_p) each: one launch per group."""
        return [part for lin, sizes in w.groups for part in self.ops.linear_parts(x, lin, sizes, dtype)]

    def mlp(self, w: MLPWeights, x):
        if len(w.gate_up.groups) == 1:                                     # [gate | up] stacked: ops.mlp
            return self.ops.mlp(x, w.gate_up.groups[0][0], w.down_proj, self.dtype)
        g, u = self.project(x, w.gate_up, torch.float32)                 # gate, up, output: may pass 65504
        return self.ops.silu_mul_linear(g, u, w.down_proj, self.dtype)

    def attention(self, L: DecoderLayer, x, batch: Batch, cache: Cache):
        ops, cfg, w, T = self.ops, self.cfg, L.mixer, x.shape[0]
        Dh = cfg.head_dim
        parts = self.project(x, w.qkv)                                     # q | gate | k | v
        if w.gate_interleaved:                                             # per head: [q | gate]
            qg = parts.pop(0).reshape(T * w.heads, 2, Dh)                 # a view unless torch's split
            parts[:0] = [ops.contiguous(qg[:, i]).view(T, w.heads * Dh) for i in (0, 1)]   # q, gate
        q, gate = parts[0].view(T, w.heads, Dh), parts[1] if cfg.gated_attention else None
        k, v = (t.view(T, w.kv_heads, Dh) for t in parts[-2:])
        q = ops.qk_norm_rope_kv(q, k, v, w.q_norm, w.k_norm, cfg.rms_norm_eps, batch.positions, self.inv_freq,
                                cache.k[L.index], cache.v[L.index], batch.slot_mapping)   # k, v into the cache
        o = ops.attention(q, cache.k[L.index], cache.v[L.index], batch.block_tables, batch.context_lens,
                          batch.query_start, Dh ** -0.5, gate).reshape(T, w.heads * Dh)   # * sigmoid(gate)
        return ops.linear(o, w.o_proj, torch.float32)                      # row-parallel: fp32

    def gated_deltanet(self, L: DecoderLayer, x, batch: Batch, cache: Cache):
        ops, cfg, w, T = self.ops, self.cfg, L.mixer, x.shape[0]
        Dv = cfg.linear_value_head_dim
        groups = w.in_proj.groups
        # FP8 [qkv | z] with the conv in its epilogue, except in a speculative verify, which keeps the conv's
        # inputs for rollback; then [a | b] with the gates in its epilogue.
        conv = cache.window is not None or [len(sizes) for _, sizes in groups] != [2, 2]
        if not conv:                                                       # (T, C') after the conv, (T, Hv'*Dv)
            qkv, z, g, beta = ops.gdn_in_proj_gates(x, *groups[0], w.conv1d, cache.conv[L.index], batch.state_slots,
                                                    batch.query_start, groups[1][0], w.A_log, w.dt_bias)
        elif len(groups) == 2 and len(groups[1][1]) == 2:
            qkv, z = ops.linear_parts(x, *groups[0])
            g, beta = ops.gdn_gates_linear(x, groups[1][0], w.A_log, w.dt_bias)
        else:
            qkv, z, a, b = self.project(x, w.in_proj)
            g, beta = ops.gdn_gates(a, b, w.A_log, w.dt_bias)
        if cache.window is not None:                                       # speculative verify: keep for rollback
            rows = cache.window.rows
            cache.window.inputs[L.index] = (qkv[rows], g[rows], beta[rows])
        o = self.delta_rule(L, qkv, g, beta, cache, batch.state_slots, batch.query_start, conv,
                            z.view(T, w.v_heads, Dv))                      # (T, Hv', Dv), gated-normed
        return ops.linear(o.reshape(T, w.v_heads * Dv), w.out_proj, torch.float32)   # row-parallel: fp32

    def delta_rule(self, L: DecoderLayer, qkv, g, beta, cache: Cache, slots, query_start, conv: bool = True,
                   z=None):
        """The GDN's recurrent part: causal conv over the projected qkv (T, C') (conv=False: done already), then
        the gated delta rule with gates g, beta (T, Hv'); advances the sequences' conv and SSM states. Returns o
        (T, Hv', Dv), or with the output gate z (T, Hv', Dv) its gated RMSNorm (the same launch)."""
        ops, cfg, w, T = self.ops, self.cfg, L.mixer, qkv.shape[0]
        Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if conv:
            qkv = ops.conv1d(qkv, w.conv1d, cache.conv[L.index], slots, query_start)   # (T, C')
        nk = w.k_heads * Dk                                                # views: the ops pack them if strided
        q, k, v = qkv.split_with_sizes([nk, nk, w.v_heads * Dv], 1)
        q, k, v = q.view(T, w.k_heads, Dk), k.view(T, w.k_heads, Dk), v.view(T, w.v_heads, Dv)   # (T, H', D)
        if z is not None:
            return ops.gated_delta_rmsnorm(q, k, v, g, beta, cache.ssm[L.index], slots, query_start, z, w.norm,
                                           cfg.rms_norm_eps)
        return ops.gated_delta(q, k, v, g, beta, cache.ssm[L.index], slots, query_start)


def named_weights(weights, prefix: str = "") -> Iterator[tuple[str, Linear | torch.Tensor]]:
    """Every Linear and tensor of a layer's weights, by dotted field path ("mlp.gate_proj")."""
    for f in dataclasses.fields(weights):
        value = getattr(weights, f.name)
        if isinstance(value, FusedLinear):           # the HF fields are views of it: counted there
            continue
        if isinstance(value, (Linear, torch.Tensor)):
            yield prefix + f.name, value
        elif dataclasses.is_dataclass(value):
            yield from named_weights(value, f"{prefix}{f.name}.")


# -----------------------------------------------------------------------------------------------
# 5. Memory: a pool of paged KV blocks (reference counted, so forked choices share their prompt) and a
#    pool of recurrent-state slots. Pure bookkeeping; the tensors live in Cache.
# -----------------------------------------------------------------------------------------------

class BlockPool:
    """KV-cache blocks, reference counted: forked choices and requests with a common prefix share blocks. A block
    may also carry a key (PrefixCache.key: a hash of every token up to its last one) once its tokens are written.
    Released, a keyed block is not freed but kept, least recently used first, where a later request with the
    same prefix finds it again by its key; alloc() takes such a block (forgetting its key) only when no block is
    free. A block held by more than one owner is always full and never written again."""

    def __init__(self, num_blocks: int):
        self.total = num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))   # holding nothing anyone may ask for
        self.refs = [0] * num_blocks
        self.cached: dict[int, None] = {}       # released keyed blocks, least recently used first
        self.by_key: dict[bytes, int] = {}      # key -> the block holding those tokens' KV
        self.key_of: dict[int, bytes] = {}
        self.on_evict: Callable[[bytes], None] = lambda key: None   # told when a keyed block is reused
        self.evictions = 0

    def alloc(self) -> int | None:
        if self.free:
            b = self.free.pop()
        elif self.cached:
            b = next(iter(self.cached))
            del self.cached[b]
            key = self.key_of.pop(b)
            del self.by_key[key]
            self.evictions += 1
            self.on_evict(key)
        else:
            return None
        self.refs[b] = 1
        return b

    def share(self, b: int) -> int:
        self.cached.pop(b, None)               # a cached block comes back into use
        self.refs[b] += 1
        return b

    def release(self, blocks: list[int]):
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if b in self.key_of:
                    self.cached[b] = None
                else:
                    self.free.append(b)
        blocks.clear()

    def register(self, b: int, key: bytes) -> None:
        """Block b (held, its tokens written) holds the KV of the tokens `key` names; a key already held by
        another block stays with that one."""
        if key not in self.by_key and b not in self.key_of:
            self.by_key[key], self.key_of[b] = b, key

    @property
    def available(self) -> int:
        """Blocks alloc() can hand out: free ones and cached ones."""
        return len(self.free) + len(self.cached)

    @property
    def used(self) -> int:
        return self.total - self.available


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


def sequence_blocks(opts: EngineOptions) -> int:
    """KV blocks of one sequence of --max-context tokens."""
    return -(-opts.max_context // opts.kv_block_size)


def kv_cache_blocks(opts: EngineOptions) -> int:
    """The KV blocks of the engine cache, the same count on every rank: --num-kv-blocks, else --max-batch-size
    sequences of --max-context. PocketError when they cannot hold one sequence."""
    blocks = opts.num_kv_blocks or opts.max_batch_size * sequence_blocks(opts)
    if blocks * opts.kv_block_size < opts.max_context:
        raise PocketError(f"--num-kv-blocks {blocks} x --kv-block-size {opts.kv_block_size} cannot hold one sequence "
                          f"of --max-context {opts.max_context} tokens")
    return blocks


def snapshot_count(opts: EngineOptions, slot_bytes: int) -> int:
    """How many state snapshots the prefix cache keeps, each the size of one recurrent-state slot (slot_bytes):
    --prefix-cache-memory MiB of them on each rank (the same count on every rank: each holds its 1/N of every
    snapshot), by default (-1) one per state slot; none without the prefix cache or without linear-attention
    layers (slot_bytes 0). A chat turn keeps two (the end of its last message and of its generation), so S
    snapshots keep about S / 2 interleaved conversations resumable (docs/serving.md)."""
    if not opts.prefix_cache or not slot_bytes:
        return 0
    if opts.prefix_cache_memory < 0:
        return opts.max_batch_size
    return opts.prefix_cache_memory * (1 << 20) // slot_bytes


def allocate_cache(cfg: ModelConfig, layers: list, num_blocks: int, block_size: int, num_slots: int,
                   kv_dtype: torch.dtype, device, hidden: torch.dtype | None = None) -> Cache:
    """KV tensors for full-attention layers and state tensors for linear-attention layers (this rank's heads);
    with `hidden` (a model with an MTP layer), a hidden-state row per slot of that dtype."""
    cache = Cache({}, {}, {}, {})
    if hidden is not None:
        cache.hidden = torch.zeros(num_slots, cfg.hidden_size, dtype=hidden, device=device)
    for L in layers:
        if L.kind == "full_attention":
            shape = (num_blocks, block_size, L.mixer.kv_heads, cfg.head_dim)
            cache.k[L.index] = torch.zeros(shape, dtype=kv_dtype, device=device)
            cache.v[L.index] = torch.zeros(shape, dtype=kv_dtype, device=device)
        else:
            conv_dim = L.mixer.conv1d.shape[0]
            cache.conv[L.index] = torch.zeros(num_slots, conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=kv_dtype,
                                              device=device)
            cache.ssm[L.index] = torch.zeros(num_slots, L.mixer.v_heads, cfg.linear_key_head_dim,
                                             cfg.linear_value_head_dim, dtype=torch.float32, device=device)
    return cache


def state_slot_bytes(cfg: ModelConfig, layers: list, kv_dtype: torch.dtype) -> int:
    """Bytes of one recurrent-state slot on this rank: the conv and SSM state of every linear-attention layer."""
    cache = allocate_cache(cfg, layers, 0, 1, 1, kv_dtype, "meta")
    return sum(t.numel() * t.element_size() for t in itertools.chain(cache.conv.values(), cache.ssm.values()))


def snapshot_slots(opts: EngineOptions, cfg: ModelConfig, layers: list, kv_dtype: torch.dtype) -> int:
    """snapshot_count of these layers' state slots on this rank."""
    return snapshot_count(opts, state_slot_bytes(cfg, layers, kv_dtype))


def copy_cache(src: Cache, dst: Cache, ops, slots: list[tuple[int, int]], blocks: list[tuple[int, int]]):
    """Copy recurrent-state slots (with their hidden rows) and KV blocks, (source, destination) pairs, from one
    cache to another (or within one), one ops.copy_rows per tensor: forked choices (n > 1) start from their
    parent's state and last block; the prefix cache saves and restores state snapshots and copies partial
    blocks."""
    for pairs, parts in ((slots, ("conv", "ssm")), (blocks, ("k", "v"))):
        if not pairs:
            continue
        index = torch.tensor(pairs, dtype=torch.long).t()                # (2, N): sources, destinations
        for part in parts:
            for layer, t in getattr(dst, part).items():
                rows = index.to(t.device)
                ops.copy_rows(getattr(src, part)[layer], t, rows[0], rows[1])
    if slots and src.hidden is not None and dst.hidden is not None:
        index = torch.tensor(slots, dtype=torch.long, device=dst.hidden.device).t()    # (2, N)
        dst.hidden[index[1]] = src.hidden[index[0]]


# The prefix cache. A prompt that begins with tokens the engine has computed before (an agent's next turn
# resends the whole conversation) starts where the cache can resume it and prefills only the rest. Resuming at
# position p needs two things of tokens [0, p): their KV in the attention layers, and the recurrent state of the
# linear-attention layers after token p - 1.
#
# - KV: a full block is found by its key, a hash chain over every token up to the block's end (and the model's
#   identity), so two requests with the same first 1,000 tokens share the first 62 blocks of 16 (BlockPool).
# - State: a Gated DeltaNet layer keeps no per-token state to rewind, only the state after the last token, so
#   the engine copies it to a snapshot slot at chosen positions: the end of every prompt, the end of every
#   generation, and every block boundary where a prefill chunk ends (the scheduler ends chunks on block
#   boundaries, and a prompt's last chunk first at its last boundary, so a follow-up prompt that diverges
#   inside the previous prompt's final tokens, as a chat template's assistant header does, still resumes
#   within a block of it). A snapshot at a position inside a block also keeps a copy of that partial block,
#   which a request resuming there copies (never shares) before writing after it. Snapshots live in a cache
#   of their own (state rows only, Engine.snapshots), as many as --prefix-cache-memory holds, reused least
#   recently used first, but for those several requests resumed from (a shared system prompt's), which go last.
#
# A model without linear-attention layers needs no snapshot: any run of cached full blocks resumes, and a
# partial block kept at the end of a prompt or generation extends it.

@dataclass
class Snapshot:
    """A position the prefix cache can resume from: tokens [0, position) end with `tail` after the full block
    `parent` (the root when position < block_size)."""
    key: bytes                 # PrefixCache.key of tokens [0, position); also the partial block's key
    parent: bytes              # key of the last full block before position (PrefixCache.root if none)
    tail: tuple[int, ...]      # tokens after that block, fewer than block_size (empty: a block boundary)
    position: int
    slot: int | None           # snapshot slot of the state tensors; None: the model has no recurrent state
    resumes: int = 0           # requests that resumed from it: two or more, eviction spares it (PrefixCache.victim)


class PrefixCache:
    """Bookkeeping of the prefix cache (the copies are the engine's): block keys, snapshots, their slots, the
    longest match of a prompt, and the counters /metrics reports."""

    def __init__(self, blocks: BlockPool, block_size: int, identity: str, snapshot_slots: range, state: bool):
        self.blocks, self.block_size, self.state = blocks, block_size, state   # state: a hit needs a snapshot
        self.root = hashlib.blake2b(identity.encode(), digest_size=16).digest()
        self.slots_total = len(snapshot_slots)
        self.free_slots = list(reversed(snapshot_slots))
        self.points: dict[bytes, dict[tuple[int, ...], Snapshot]] = {}   # parent -> tail -> snapshot
        self.by_key: collections.OrderedDict[bytes, Snapshot] = collections.OrderedDict()   # least recently used first
        self.counters = {"queried_tokens": 0, "hit_tokens": 0, "snapshot_evictions": 0}
        blocks.on_evict = self.forget

    def key(self, parent: bytes, tokens) -> bytes:
        return hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}q", *tokens), digest_size=16).digest()

    def block_keys(self, tokens: list[int], keys: list[bytes]) -> list[bytes]:
        """keys (the keys of tokens' first full blocks, as far as known) extended to every full block of tokens."""
        bs = self.block_size
        for j in range(len(keys), len(tokens) // bs):
            keys.append(self.key(keys[-1] if keys else self.root, tokens[j * bs:(j + 1) * bs]))
        return keys

    def match(self, tokens: list[int], keys: list[bytes]) -> tuple[int, int, Snapshot | None]:
        """The longest prefix of tokens, short of the last token (its logits are wanted), that the cache can
        resume: (position, how many full blocks it shares, the snapshot to restore or None)."""
        bs, limit = self.block_size, len(tokens) - 1
        m = 0
        while m < len(keys) and (m + 1) * bs <= limit and keys[m] in self.blocks.by_key:
            m += 1
        for j in range(m, -1, -1):
            best = None
            for tail, snap in self.points.get(keys[j - 1] if j else self.root, {}).items():
                end = j * bs + len(tail)
                if 0 < end <= limit and (best is None or len(tail) > len(best.tail)) and \
                        tuple(tokens[j * bs:end]) == tail and (not tail or snap.key in self.blocks.by_key):
                    best = snap
            if best is not None:
                self.by_key.move_to_end(best.key)                          # most recently used
                best.resumes += 1
                return best.position, j, best
            if j and not self.state:
                return j * bs, j, None
        return 0, 0, None

    def add(self, tokens: list[int], position: int, keys: list[bytes], keep: bool = True) -> Snapshot | None:
        """A new snapshot at position (tokens [0, position) computed), or None: one is there already (now the
        most recently used), none is needed (a block boundary without recurrent state), or no slot is free.
        keep=False (a prefill chunk's boundary in the middle of a prompt) files it as the least recently used:
        the first to go, so a long prefill cannot push out the snapshots that follow-up turns resume from."""
        j, bs = position // self.block_size, self.block_size
        parent, tail = keys[j - 1] if j else self.root, tuple(tokens[j * bs:position])
        if not position or (not tail and not self.state):
            return None
        known = self.points.get(parent, {}).get(tail)
        if known is not None:
            if keep:
                self.by_key.move_to_end(known.key)
            return None
        slot = self.take_slot() if self.state else None
        if self.state and slot is None:
            return None
        snap = Snapshot(self.key(parent, tail) if tail else parent, parent, tail, position, slot)
        self.points.setdefault(parent, {})[tail] = self.by_key[snap.key] = snap
        self.by_key.move_to_end(snap.key, last=keep)
        return snap

    def take_slot(self) -> int | None:
        """A free snapshot slot, evicting a snapshot if none is; None if there is none. (With recurrent state
        every snapshot has a slot.)"""
        if not self.free_slots and self.state and self.by_key:
            self.counters["snapshot_evictions"] += 1
            self.forget(self.victim())
        return self.free_slots.pop() if self.free_slots else None

    def victim(self) -> bytes:
        """The snapshot to evict: the least recently used, but sparing those that several requests resumed from
        (a shared system prompt's) while they hold at most half the slots. A wave of requests behind one long
        system prompt all resume from its snapshot and then each add their own (the end of the prompt and of the
        generation), more than there are slots: plain LRU evicted the shared one among them, and every later
        request prefilled the whole prompt again. A conversation's turn is resumed once, by the next turn, so
        agent conversations still see plain LRU."""
        shared = [key for key, snap in self.by_key.items() if snap.resumes > 1]
        if len(shared) > self.slots_total // 2 or len(shared) == len(self.by_key):
            return shared[0]
        return next(key for key, snap in self.by_key.items() if snap.resumes <= 1)

    def forget(self, key: bytes) -> None:
        """Drop the snapshot with this key (its slot is evicted, or its block is reused), if there is one."""
        snap = self.by_key.pop(key, None)
        if snap is None:
            return
        tails = self.points[snap.parent]
        del tails[snap.tail]
        if not tails:
            del self.points[snap.parent]
        if snap.slot is not None:
            self.free_slots.append(snap.slot)

    def count(self, queried: int, hit: int) -> None:
        self.counters["queried_tokens"] += queried
        self.counters["hit_tokens"] += hit

    @property
    def snapshots_used(self) -> int:
        return self.slots_total - len(self.free_slots)


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
        self.block_keys: list[bytes] = []  # prefix-cache keys of its full blocks, as far as computed (section 5)
        self.order = next(Sequence._ids)   # admission order: the newest is preempted first
        self.finished = False
        self.seed = self.params.seed if self.params.seed is not None else request.default_seed   # section 7
        self.drafts: list[int] = []        # speculative decoding: the MTP layer's guesses after tokens[-1]
        self.draft_probs: torch.Tensor | None = None   # (len(drafts), V) what they were drawn from (sampling)
        self.mtp_from: int | None = None   # resumed or forked: the MTP layer's KV is stale from here (Engine._draft)

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.request.prompt_ids) + len(self.output_ids)

    @property
    def max_tokens(self) -> int:
        """Positions this sequence can ever hold: its prompt and every completion token it may emit."""
        return len(self.request.prompt_ids) + self.params.max_tokens


@dataclass
class Scheduled:
    seq: Sequence
    start: int          # first token position computed this step
    count: int          # tokens computed this step (a verify window: its last token and its drafts)
    sample: bool        # the chunk reaches the end of the sequence's tokens: sample the next one
    drafts: list[int] = field(default_factory=list)   # drafts verified after the last token (count - 1 of them)


@dataclass
class CacheCopies:
    """Copies inside the cache that must run before the next forward (restored snapshots, copied partial
    blocks); `pinned` blocks are copy sources held until the copies ran."""
    slots: list[tuple[int, int]] = field(default_factory=list)
    blocks: list[tuple[int, int]] = field(default_factory=list)
    pinned: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, opts: EngineOptions, blocks: BlockPool, slots: SlotPool, prefix: PrefixCache | None = None,
                 draft_tokens: int = 0):
        self.opts, self.blocks, self.slots, self.prefix = opts, blocks, slots, prefix
        self.draft_tokens = draft_tokens    # K of speculative decoding (0: off)
        self.waiting: list[Sequence] = []   # FIFO; preempted sequences go back to the front
        self.running: list[Sequence] = []
        self.copies = CacheCopies()         # what admissions from the prefix cache need copied (the engine runs them)

    def add(self, seq: Sequence):
        self.waiting.append(seq)

    def schedule(self) -> list[Scheduled]:
        budget, plan = self.opts.prefill_token_budget, []
        for seq in sorted(self.running, key=lambda s: s.order):
            if seq not in self.running:      # preempted below by an older sequence's need
                continue
            count = self._chunk(seq, max(budget, 1))
            drafts = seq.drafts[:max(budget - 1, 0)] if seq.num_computed + 1 == seq.num_tokens else []
            if not self._reserve(seq, self._span(seq, count + len(drafts)), plan):
                continue
            plan.append(Scheduled(seq, seq.num_computed, count + len(drafts),
                                  seq.num_computed + count == seq.num_tokens, drafts))
            budget -= count + len(drafts)
        while self.waiting and budget > 0 and len(self.running) < self.opts.max_batch_size and self.slots.free:
            seq = self.waiting[0]
            mark = len(self.copies.blocks), len(self.copies.pinned)
            snap = self._resume(seq)
            count = self._chunk(seq, budget)
            if not self._blocks_fit(seq, self._span(seq, count)):      # undo the resume: it waits, holding nothing
                self.blocks.release(seq.blocks + self.copies.pinned[mark[1]:])
                del self.copies.blocks[mark[0]:], self.copies.pinned[mark[1]:]
                seq.num_computed, seq.mtp_from = 0, None
                break
            self.waiting.pop(0)
            seq.slot = self.slots.alloc()
            if snap is not None and snap.slot is not None:
                self.copies.slots.append((snap.slot, seq.slot))
            if seq.request.cached_tokens is None:     # its first admission: what /metrics and usage report
                seq.request.cached_tokens = seq.num_computed
                if self.prefix is not None:
                    self.prefix.count(seq.num_tokens, seq.num_computed)
            self.running.append(seq)
            self._grow(seq, self._span(seq, count))
            plan.append(Scheduled(seq, seq.num_computed, count, seq.num_computed + count == seq.num_tokens))
            budget -= count
        return plan

    def _span(self, seq: Sequence, count: int) -> int:
        """Positions from num_computed that this step may write: its `count` tokens, and when it reaches the end
        of the sequence, the K - 1 positions the MTP layer writes while drafting for the next step."""
        if not self.draft_tokens or seq.num_computed + count < seq.num_tokens:
            return count
        return max(count, min(count + self.draft_tokens - 1, seq.max_tokens - seq.num_computed))

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """How many of seq's tokens to compute now: up to `budget`. With state snapshots, a prefill chunk ends
        where the prefix cache wants one (section 5): at the request's snapshot_at (a chat prompt's last message
        ends there); else on a block boundary when it stops short of the sequence's end; and a last chunk
        without a snapshot_at first stops at the last boundary before the end."""
        start, bs = seq.num_computed, self.opts.kv_block_size
        end = min(seq.num_tokens, start + budget)
        if self.prefix is None or not self.prefix.state or not self.prefix.slots_total or end - start < 2:
            return end - start
        hint = seq.request.snapshot_at
        if hint is not None and start < hint < end:
            return hint - start
        boundary = end // bs * bs if end < seq.num_tokens else (end - 1) // bs * bs if hint is None else start
        return (boundary if boundary > start else end) - start

    def _resume(self, seq: Sequence) -> Snapshot | None:
        """A sequence about to be admitted starts where the prefix cache can resume it: it shares the cached
        full blocks and (through self.copies) gets a copy of a snapshot's partial block; the snapshot to
        restore into its slot is returned."""
        if self.prefix is None or seq.num_computed:
            return None
        tokens = seq.tokens
        keys = self.prefix.block_keys(tokens, seq.block_keys)
        position, shared, snap = self.prefix.match(tokens, keys)
        # With speculation the MTP layer rewrites its KV at position - 1 (it read the token after it there,
        # Engine._draft), so the block holding it is copied, never shared, as a partial tail block always is.
        rewrite = bool(self.draft_tokens and snap is not None and snap.slot is not None)
        own = int(rewrite and not snap.tail)      # the last full block (the snapshot's key is its key)
        # the matched full blocks are shared first: the tail's alloc below may evict any block still cached
        seq.blocks = [self.blocks.share(self.blocks.by_key[k]) for k in keys[:shared - own]]
        if position and snap is not None and (snap.tail or own):
            source = self.blocks.by_key[snap.key]
            self.blocks.share(source)          # pinned until the copy ran: no alloc may take it before
            block = self.blocks.alloc()
            if block is None:
                self.blocks.release([source])
                position, snap = shared * self.opts.kv_block_size, None
                if self.prefix.state:          # the full blocks alone are no resume point with state
                    position = 0
                    self.blocks.release(seq.blocks)
            else:
                self.copies.pinned.append(source)
                self.copies.blocks.append((source, block))
                seq.blocks.append(block)
        seq.num_computed = position
        seq.mtp_from = position - 1 if rewrite and position else None
        return snap if position else None

    def _blocks_needed(self, seq: Sequence, count: int) -> int:
        return self.blocks_short(seq, seq.num_computed + count)

    def blocks_short(self, seq: Sequence, end: int) -> int:
        """Blocks seq lacks to hold positions [0, end)."""
        return max(0, -(-end // self.opts.kv_block_size) - len(seq.blocks))

    def extend(self, seq: Sequence, end: int):
        """Give seq the blocks it lacks for positions [0, end) (async scheduling: the caller checked they fit)."""
        for _ in range(self.blocks_short(seq, end)):
            seq.blocks.append(self.blocks.alloc())

    def _blocks_fit(self, seq: Sequence, count: int) -> bool:
        return self._blocks_needed(seq, count) <= self.blocks.available

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
        seq.num_computed, seq.mtp_from = 0, None
        seq.drafts, seq.draft_probs = [], None
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
# 7. The sampler, which takes a step's logits and returns every row's next token (and logprobs): one pass
#    over the (B, V) logits on their device, and one device-to-host transfer per step.
#
#    The order is OpenAI's and vLLM's: penalties (repetition over prompt + generated tokens, presence and
#    frequency over generated tokens), logit_bias, min_tokens bans, the request's logits processors, the token
#    masks (allowed_token_ids, structured output), then temperature, top-k, top-p and min-p, then the draw.
#    Greedy rows (temperature 0) take the argmax.
#
#    Seeding is counter-based: a row's uniform is a hash of (seed, choice index, step) computed on the host
#    from plain integers, and the device inverts the row's float64 CDF at it. So a seeded request draws the
#    same tokens whatever else is in the batch, on any device, with no generator objects and one uniform per
#    row instead of V random numbers (Gumbel noise would need V hashes per row).
# -----------------------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """A host tensor copied to `device` without the host waiting: on a GPU a plain .to() from pageable memory
    waits for every kernel queued before it (async scheduling would wait for the step in flight); from pinned
    memory without blocking it is queued behind them."""
    if torch.device(device).type == "cuda" and torch.cuda.is_available():   # (not on tests' fake CUDA)
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def splitmix64(x: int) -> int:
    """SplitMix64's finaliser (Steele, Lea, Flood 2014): an integer -> 64 well-mixed bits."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_uniform(seed: int, index: int, step: int) -> float:
    """The uniform in [0, 1) for choice `index`'s `step`-th token of a request seeded with `seed`. 40 bits:
    u * total stays below total in float64, so the inverse CDF never runs past the last token."""
    h = splitmix64(splitmix64(splitmix64(seed & _MASK64) ^ index) ^ step)
    return (h >> 24) / float(1 << 40)


@dataclass
class RowParams:
    """One request's sampling options as the sampler reads them, prepared once when the engine admits it. The
    numbers become the columns of RowTable (by name); the flags let a step skip stages no row needs."""
    temperature: float       # 0: greedy
    top_k: float             # the vocabulary size: off
    top_p: float             # 1: off
    min_p: float             # 0: off
    presence: float          # presence_penalty
    frequency: float         # frequency_penalty
    repetition: float        # repetition_penalty, 1: off
    penalties: bool          # presence, frequency or repetition penalty on
    sorts: bool              # top_k or top_p on: the filters sort the row
    bias_ids: list[int]      # logit_bias
    bias_values: list[float]
    banned: list[int]        # -inf until min_tokens tokens exist: stop tokens (and EOS unless ignore_eos)
    allowed: list[int] | None = None             # allowed_token_ids: the only tokens drawn (None: all)
    allowed_mask: torch.Tensor | None = None     # (V,) bool on the sampler's device, made at the first step


@dataclass
class RowTable:
    """A step's row parameters on the device: one (B,) float64 column per name, built from the rows' RowParams
    and uniforms and sent as one (B, C) host-to-device copy."""
    temperature: torch.Tensor        # (B,) 0: greedy
    top_k: torch.Tensor              # (B,) the vocabulary size: off
    top_p: torch.Tensor              # (B,) 1: off
    min_p: torch.Tensor              # (B,) 0: off
    presence: torch.Tensor           # (B,)
    frequency: torch.Tensor          # (B,)
    repetition: torch.Tensor         # (B,) 1: off
    uniform: torch.Tensor            # (B,) where the draw inverts the row's CDF, in [0, 1)

    @classmethod
    def build(cls, params: list[RowParams], uniforms: list[float], device) -> "RowTable":
        names = [f.name for f in dataclasses.fields(cls) if f.name != "uniform"]
        host = torch.tensor([[float(getattr(p, n)) for n in names] + [u] for p, u in zip(params, uniforms)],
                            dtype=torch.float64).reshape(len(params), len(names) + 1)   # (B, C)
        return cls(*to_device(host, device).unbind(1))

    def __getitem__(self, index) -> "RowTable":
        """The rows at `index` (a (b,) tensor of row numbers)."""
        return RowTable(*(getattr(self, f.name)[index] for f in dataclasses.fields(self)))


def apply_penalties(x: torch.Tensor, counts: torch.Tensor, prompt_seen: torch.Tensor,
                    table: RowTable) -> torch.Tensor:
    """x (B, V) fp32; counts (B, V) int32 of generated tokens; prompt_seen (B, V) bool.
    Rows whose penalties are off (0, 0, 1) come out bit-identical."""
    presence, frequency, repetition = (c[:, None].float() for c in (table.presence, table.frequency, table.repetition))
    generated = counts > 0                                                     # (B, V)
    x = torch.where(prompt_seen | generated, torch.where(x > 0, x / repetition, x * repetition), x)
    return x - generated * presence - counts * frequency


def filter_logits(x: torch.Tensor, table: RowTable, sort: bool = True, min_p: bool = True) -> torch.Tensor:
    """Temperature-scaled x (B, V) -> x with filtered tokens at -inf, by the table's top_k (V = off), top_p (1 =
    off) and min_p (0 = off). top-k keeps ties with the k-th value; top-p keeps the smallest prefix of the sorted
    top-k probabilities that reaches top_p; min-p drops the tokens whose probability is below min_p x the
    largest, i.e. whose logit is below the largest + log(min_p). A row whose filters are off comes out
    unchanged; sort=False (no row has top-k or top-p) and min_p=False skip those stages for the whole batch."""
    drop = x < x.max(-1, keepdim=True).values + table.min_p[:, None].float().log() if min_p else \
        torch.zeros_like(x, dtype=torch.bool)                                  # (B, V); log(0) = -inf keeps all
    if sort:
        V, top_p = x.shape[-1], table.top_p[:, None].float()
        sorted_x, order = x.sort(dim=-1, descending=True)                      # (B, V)
        kth = sorted_x.gather(1, (table.top_k.long().clamp(1, V) - 1)[:, None])      # (B, 1)
        sorted_p = sorted_x.masked_fill(sorted_x < kth, float("-inf")).softmax(-1)
        past_p = (sorted_p.cumsum(-1) - sorted_p >= top_p) & (top_p < 1)      # (B, V) in sorted order
        drop |= (x < kth) | past_p.scatter(1, order, past_p)
    return x.masked_fill(drop, float("-inf"))


def scale_by_temperature(x: torch.Tensor, table: RowTable) -> torch.Tensor:
    """x (B, V) / each row's temperature; greedy rows (temperature 0) are divided by 1."""
    return x / torch.where(table.temperature == 0, 1.0, table.temperature).float()[:, None]


def draw_tokens(x: torch.Tensor, table: RowTable) -> torch.Tensor:
    """x (B, V) scaled, filtered logits -> (B,) int64: the argmax for greedy rows, else the first token where
    the row's float64 CDF of softmax(x) passes the row's uniform."""
    cdf = x.softmax(-1).double().cumsum(-1)                                    # (B, V)
    drawn = torch.searchsorted(cdf, (table.uniform * cdf[:, -1])[:, None], right=True)[:, 0]
    return torch.where(table.temperature == 0, x.argmax(-1), drawn.clamp(max=x.shape[-1] - 1))


def apply_token_masks(x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """x (B, V) with the tokens not `allowed` (B, V) at -inf. A row whose other constraints (logit_bias,
    min_tokens) banned every allowed token is left unmasked rather than sampled from nothing."""
    masked = x.masked_fill(~allowed, float("-inf"))                             # (B, V)
    return torch.where(torch.isfinite(masked).any(-1, keepdim=True), masked, x)


def prepare_row_params(params: SamplingParams, eos_ids: list[int], vocab_size: int) -> RowParams:
    """Checks every token id against the vocabulary, so that a malformed request fails alone, here."""
    p = params
    bias = {int(t): float(b) for t, b in p.logit_bias.items()}
    banned = list(dict.fromkeys(int(t) for t in [*p.stop_token_ids, *([] if p.ignore_eos else eos_ids)]))
    for name, ids in (("logit_bias", bias), ("stop_token_ids", banned),
                      ("allowed_token_ids", p.allowed_token_ids or [])):
        if any(not 0 <= t < vocab_size for t in ids):
            raise RequestError(f"'{name}' must hold token ids in [0, {vocab_size})", param=name)
    top_k = p.top_k if 0 < p.top_k < vocab_size else vocab_size
    return RowParams(temperature=p.temperature, top_k=top_k, top_p=p.top_p, min_p=p.min_p,
                     presence=p.presence_penalty, frequency=p.frequency_penalty, repetition=p.repetition_penalty,
                     penalties=bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0),
                     sorts=top_k < vocab_size or p.top_p < 1.0, bias_ids=list(bias), bias_values=list(bias.values()),
                     banned=banned if p.min_tokens > 0 else [], allowed=p.allowed_token_ids)


@dataclass
class SampleRow:
    """One token to draw this step: its sequence, the row of the step's logits it reads (forked choices
    share their parent's), and its prepared parameters. With speculative decoding a row may sit inside a verify
    window: `ahead` are the drafts before it (the hypothetical continuation its penalties, bans, processors and
    seeding see), and `draft` the drafted token it judges, drawn from `draft_probs`. `emitted` (the tokens before
    the row's: its seeding step and min_tokens count) is fixed when the row is made: with async scheduling the
    row is sampled while the host appends the previous step's token, which it counts already (unread = 1)."""
    seq: Sequence
    logit_row: int
    params: RowParams
    ahead: list[int] = field(default_factory=list)
    draft: int | None = None
    draft_probs: torch.Tensor | None = None             # (V,) on the logits' device; None for greedy rows
    unread: int = 0                                     # tokens sampled on the device but not yet in output_ids
    emitted: int = field(init=False)

    def __post_init__(self):
        self.emitted = len(self.seq.output_ids) + len(self.ahead) + self.unread


@dataclass
class SampleResult:
    tokens: list[int]                                   # one per row
    logprobs: list                                      # per row: None, or (logprob, [(token id, logprob)] top k)
    failed: dict[int, Exception]                        # row -> what its logits processor raised
    accepted: list[bool] | None = None                  # per row: its draft was accepted (rows with drafts only)


# The payload of the sampler inside a decode step's graph (Sampler.static_fields): the row table's columns (the
# uniform, then 1 for a live row, 0 for padding), the entry table's ids and values; rows with more logit_bias
# entries and bans than STATIC_EDITS sample eagerly.
SAMPLE_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "presence", "frequency", "repetition", "uniform", "live")
SAMPLE_DTYPES = (torch.float64, torch.long, torch.float64)
STATIC_EDITS = 256

# Counter-based uniforms of one (seed, choice, step) for the other draws of speculative decoding.
DRAFT_SALT, ACCEPT_SALT = 0x5BD1E995, 0x27D4EB2F


def judge_drafts(x: torch.Tensor, table: RowTable, tokens: torch.Tensor, drafts: torch.Tensor,
                 draft_probs: torch.Tensor, accept_u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative rejection rule on B rows that each judge one draft. x (B, V) scaled, filtered target
    logits; table: the B rows' parameters; tokens (B,) the rows' ordinary draws; drafts (B,); draft_probs q
    (B, V); accept_u (B,).
    Greedy rows accept a draft equal to the argmax. Sampled rows accept with probability min(1, p/q) at the
    draft, else draw from norm(max(0, p - q)) at the row's uniform, so that the emitted token is distributed as
    p (Leviathan et al. 2023). Returns (accepted (B,) bool, the row's token (B,): the draft when accepted)."""
    p = x.softmax(-1)                                                          # (B, V)
    pd, qd = p.gather(1, drafts[:, None])[:, 0], draft_probs.gather(1, drafts[:, None])[:, 0]   # (B,)
    greedy = table.temperature == 0
    accepted = torch.where(greedy, tokens == drafts, accept_u * qd < pd)
    residual = (p - draft_probs).clamp(min=0)                                  # (B, V)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)    # p == q: never rejected anyway
    cdf = residual.double().cumsum(-1)
    redrawn = torch.searchsorted(cdf, (table.uniform * cdf[:, -1])[:, None], right=True)[:, 0]
    redrawn = torch.where(greedy, tokens, redrawn.clamp(max=x.shape[-1] - 1))
    return accepted, torch.where(accepted, drafts, redrawn)


class Sampler:
    """Samples a step's rows together. The penalties' per-sequence state lives on the device, one row per
    state slot, updated in place: each running sequence's generated-token counts and its prompt's token set.
    A slot's row belongs to the sequence that last used the slot and is rebuilt from the sequence's tokens
    only when another sequence took the slot in between (admission, preemption, fork)."""

    def __init__(self, num_slots: int, vocab_size: int, device):
        self.device = torch.device(device)
        self.counts = torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device)      # (S, V)
        self.prompt_seen = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)  # (S, V)
        self.owner: list[Sequence | None] = [None] * num_slots

    def sample(self, rows: list[SampleRow], logits: torch.Tensor) -> SampleResult:
        """Draw one token per row. The step's one device-to-host transfer is the .cpu() here."""
        packed, failed = self.sample_on_device(rows, logits)
        return self.unpack(rows, packed.cpu(), failed)

    def sample_on_device(self, rows: list[SampleRow], logits: torch.Tensor, masks=None) -> tuple[torch.Tensor, dict]:
        """logits (R, V) fp32 -> (packed (N,) int32 on their device: the B sampled ids, [with drafts: B accepted
        flags,] then the requested logprobs as float32 bits and their top-k ids; the rows whose processors
        raised). Everything before the host transfer, so that tests can run it under FakeTensorMode. masks:
        token_masks' result when the host built it already (async scheduling's split step)."""
        if masks is None and all(self._plain_greedy(r) for r in rows):
            return self._greedy(rows, logits), {}
        raw, x, table, slots, failed = self.scores(rows, logits, masks=masks)
        tokens = draw_tokens(x, table)                                             # (B,) int64
        counted, flags = torch.ones_like(tokens, dtype=torch.int32), []
        if any(r.draft is not None for r in rows):
            accepted, tokens, counted = self._judge(rows, x, table, tokens)
            flags = [accepted.int()]
        self.counts.index_put_((slots, tokens), counted, accumulate=True)
        return torch.cat([tokens.int(), *flags, *self._logprobs(raw, tokens, rows)]), failed

    @staticmethod
    def _plain_greedy(r: SampleRow) -> bool:
        """A row that is the argmax of the model's logits: greedy, and nothing else changes its logits or asks
        for more (no penalties, bias, bans, allowed ids, processors, logprobs or draft)."""
        p = r.params
        return (p.temperature == 0 and not p.penalties and not p.bias_ids and p.allowed is None and r.draft is None
                and not (p.banned and r.emitted < r.seq.params.min_tokens) and not r.seq.params.logits_processors
                and r.seq.params.logprobs is None)

    def _greedy(self, rows: list[SampleRow], logits: torch.Tensor) -> torch.Tensor:
        """sample_on_device's packed result for plain greedy rows: their argmax, in two torch calls. Their slots'
        penalty counts are not kept (a row without penalties never reads them; _own rebuilds them for one with)."""
        for r in rows:
            self._own(r.seq.slot, r)
        picks = [r.logit_row for r in rows]
        raw = logits if picks == list(range(logits.shape[0])) else logits[picks]   # (B, V)
        return raw.argmax(-1).int()                                                # (B,) int32

    def scores(self, rows: list[SampleRow], logits: torch.Tensor, salt: int = 0, masks=None):
        """The rows' logits through every stage before the draw: (raw (B, V) the model's own, x (B, V) scaled and
        filtered, the RowTable with uniforms salted by `salt`, slots (B,), failed rows)."""
        if masks is None:                         # host work first: on a GPU the forward still runs
            masks = self.token_masks(rows, logits.shape[-1])
        picks = [r.logit_row for r in rows]
        raw = logits if picks == list(range(logits.shape[0])) else logits[picks]   # (B, V) the model's own
        table = RowTable.build([r.params for r in rows], [self._uniform(r, salt) for r in rows], self.device)
        slots = to_device(torch.tensor([r.seq.slot for r in rows], dtype=torch.long), self.device)   # (B,)
        for r in rows:
            self._own(r.seq.slot, r)
        x, failed = self.process(raw.clone(), rows, table, slots, masks)
        x = scale_by_temperature(x, table)
        sort, min_p = any(r.params.sorts for r in rows), any(r.params.min_p > 0 for r in rows)
        if sort or min_p:
            x = filter_logits(x, table, sort, min_p)
        return raw, x, table, slots, failed

    def draw_drafts(self, rows: list[SampleRow], logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Drafts from the MTP layer's logits, through the same stages as the target's tokens (so masks and
        penalties shape them too), at uniforms of their own: (B tokens, q (B, V) they were drawn from)."""
        _, x, table, _, _ = self.scores(rows, logits, DRAFT_SALT)
        return draw_tokens(x, table).tolist(), x.softmax(-1)

    def _judge(self, rows: list[SampleRow], x, table: RowTable, tokens):
        """judge_drafts on the rows that have a draft. Returns (accepted (B,), tokens (B,), counted (B,) int32:
        1 for the rows whose token is emitted, i.e. every earlier row of its window accepted its draft)."""
        have = [i for i, r in enumerate(rows) if r.draft is not None]
        at = to_device(torch.tensor(have, dtype=torch.long), self.device)
        V = x.shape[-1]
        q = torch.stack([r.draft_probs if r.draft_probs is not None else x.new_zeros(V) for r in rows])[at]
        drafts = to_device(torch.tensor([rows[i].draft for i in have], dtype=torch.long), self.device)
        accept_u = torch.tensor([self._uniform(rows[i], ACCEPT_SALT) for i in have], dtype=torch.float32)
        ok, judged = judge_drafts(x[at], table[at], tokens[at], drafts, q, to_device(accept_u, self.device))
        accepted = torch.zeros_like(tokens, dtype=torch.bool).index_put((at,), ok)
        tokens = tokens.index_put((at,), judged)
        rejected = (~accepted).int().cumsum(0) - (~accepted).int()                 # (B,) rejections before a row
        first = to_device(torch.tensor([i - len(r.ahead) for i, r in enumerate(rows)], dtype=torch.long), self.device)
        return accepted, tokens, (rejected == rejected[first]).int()

    def unpack(self, rows: list[SampleRow], packed: torch.Tensor, failed: dict) -> SampleResult:
        """packed (N,) int32 on the host -> each row's token and logprobs."""
        B, want = len(rows), [r.seq.params.logprobs for r in rows]
        tokens, logprobs = packed[:B].tolist(), [None] * B
        accepted = None
        if any(r.draft is not None for r in rows):
            accepted, packed = [bool(a) for a in packed[B:2 * B].tolist()], torch.cat([packed[:B], packed[2 * B:]])
        asked = [i for i, k in enumerate(want) if k is not None]
        if asked:
            L, K = len(asked), max(want[i] for i in asked)
            values = packed[B:B + L * (K + 1)].view(torch.float32).tolist()          # (L, 1 + K) flat
            top_ids = packed[B + L * (K + 1):].tolist()                               # (L, K) flat
            for j, i in enumerate(asked):
                v, ids = values[j * (K + 1):(j + 1) * (K + 1)], top_ids[j * K:j * K + want[i]]
                logprobs[i] = (v[0], list(zip(ids, v[1:1 + want[i]])))
        return SampleResult(tokens, logprobs, failed, accepted)

    def process(self, x: torch.Tensor, rows: list[SampleRow], table: RowTable,
                slots: torch.Tensor, masks=None) -> tuple[torch.Tensor, dict]:
        """Penalties, logit_bias, min_tokens bans and logits processors on x (B, V), in that order; the
        processors' token masks (token_masks) last, as one (B, V) op."""
        if any(r.params.penalties for r in rows):
            counts = self.counts[slots]                                            # (B, V)
            ahead = [(i, t) for i, r in enumerate(rows) for t in r.ahead]         # drafts count as generated
            if ahead:
                at = to_device(torch.tensor(ahead, dtype=torch.long), x.device)
                counts = counts.index_put((at[:, 0], at[:, 1]), torch.ones_like(at[:, 0], dtype=torch.int32),
                                          accumulate=True)
            x = apply_penalties(x, counts, self.prompt_seen[slots], table)
        x = self._bias_and_bans(x, rows)
        allowed, failed = masks if masks is not None else self.token_masks(rows, x.shape[-1])
        failed.update(self._run_processors(x, rows))
        return (x if allowed is None else apply_token_masks(x, allowed)), failed

    def token_masks(self, rows: list[SampleRow], size: int) -> tuple[torch.Tensor | None, dict]:
        """The rows' allowed tokens, from allowed_token_ids and their logits processors that are token masks
        (structured output: a `token_mask(ids, size, device)` method), as one (B, V) bool on the device, or None
        when no row has one; and the rows whose mask raised. Host work and cached device masks only, no
        synchronisation."""
        found, failed = {}, {}
        for r in rows:                    # every row's host work before the first copy (which waits for the forward)
            for proc in r.seq.params.logits_processors:
                if hasattr(proc, "prepare_mask"):
                    try:
                        proc.prepare_mask(list(r.seq.output_ids) + r.ahead)
                    except Exception:
                        pass                                      # raised again, and recorded, by token_mask below
        for i, r in enumerate(rows):
            if r.params.allowed is not None:
                found[i] = self._allowed_mask(r.params, size)
            for proc in r.seq.params.logits_processors:
                token_mask = getattr(proc, "token_mask", None)
                if token_mask is None:
                    continue
                try:
                    mask = token_mask(list(r.seq.output_ids) + r.ahead, size, self.device)
                except Exception as e:
                    failed[i] = e
                    break
                if mask is not None:
                    found[i] = mask if i not in found else found[i] & mask
        if not found:
            return None, failed
        everything = torch.ones(size, dtype=torch.bool, device=self.device)
        return torch.stack([found.get(i, everything) for i in range(len(rows))]), failed

    def _allowed_mask(self, params: RowParams, size: int) -> torch.Tensor:
        """allowed_token_ids as a (V,) bool on the device, made once per request."""
        if params.allowed_mask is None:
            mask = torch.zeros(size, dtype=torch.bool)
            mask[params.allowed] = True
            params.allowed_mask = to_device(mask, self.device)
        return params.allowed_mask

    @staticmethod
    def _uniform(r: SampleRow, salt: int = 0) -> float:
        return 0.0 if r.params.temperature == 0 else draw_uniform(r.seq.seed ^ salt, r.seq.index, r.emitted)

    def _own(self, slot: int, r: SampleRow):
        """Make the slot's penalty state r.seq's, rebuilt from its tokens if another sequence used it since."""
        if self.owner[slot] is r.seq:
            return
        self.owner[slot] = r.seq
        if not r.params.penalties:
            return                                  # its rows are read with zero penalties: any content will do
        self.counts[slot] = 0
        self.prompt_seen[slot] = False
        if r.seq.output_ids:
            out = to_device(torch.tensor(r.seq.output_ids, dtype=torch.long), self.device)
            self.counts[slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        if r.params.repetition != 1.0:
            prompt = to_device(torch.tensor(r.seq.request.prompt_ids, dtype=torch.long), self.device)
            self.prompt_seen[slot, prompt] = True

    @staticmethod
    def _bias_and_bans(x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """logit_bias and the min_tokens bans (as -inf) of every row: one sparse scatter-add."""
        at_row, at_id, values = [], [], []
        for i, r in enumerate(rows):
            ids, vals = Sampler._edits(r)
            at_row += [i] * len(ids)
            at_id += ids
            values += vals
        if not at_row:
            return x
        index = to_device(torch.tensor([at_row, at_id], dtype=torch.long), x.device)       # (2, E)
        values = to_device(torch.tensor(values, dtype=x.dtype), x.device)                  # (E,)
        return x.index_put((index[0], index[1]), values, accumulate=True)

    @staticmethod
    def _run_processors(x: torch.Tensor, rows: list[SampleRow]) -> dict[int, Exception]:
        """Each row's logits processors, only on rows that have them; one that raises fails only its request."""
        failed = {}
        for i, r in enumerate(rows):
            for proc in r.seq.params.logits_processors:
                if hasattr(proc, "token_mask"):            # applied with the others' in process()
                    continue
                try:
                    x[i] = proc(list(r.seq.output_ids) + r.ahead, x[i])
                except Exception as e:
                    failed[i] = e
                    break
        return failed

    # The sampler inside the decode step's CUDA graph (DecodeGraphs, section 8). A graph replays fixed kernels on
    # fixed addresses, so the host writes each step's row parameters into a static payload before the replay
    # (static_fields: one (bucket, SAMPLE_COLUMNS) float64 table, with the uniforms, and a fixed-width table of
    # logit_bias and min_tokens ban entries), and the captured sample_static reads only that payload, the slots'
    # penalty state and a static mask buffer: no host read, no shape that depends on values. The batch-wide
    # choices the eager sampler makes per step (skip the penalties, the sort, min-p, the masks) are the graph's
    # key (`stages`), so a captured step computes exactly what the eager one does. Rows that need host-side
    # work inside the sampling (drafts, logprobs, a logits processor that is not a token mask) sample eagerly.

    def static_stages(self, rows: list[SampleRow]) -> tuple | None:
        """The stages a captured step of `rows` runs, (penalties, sort, min_p, E entries of bias and bans per row,
        masks), or None when a row cannot be sampled inside a graph."""
        if any(r.draft is not None or r.ahead or r.seq.params.logprobs is not None or
               any(not hasattr(proc, "token_mask") for proc in r.seq.params.logits_processors) for r in rows):
            return None
        edits = max(len(self._edits(r)[0]) for r in rows)
        if edits > STATIC_EDITS:
            return None
        width = 0 if not edits else max(8, 1 << (edits - 1).bit_length())      # few widths: few graphs
        return (any(r.params.penalties for r in rows), any(r.params.sorts for r in rows),
                any(r.params.min_p > 0 for r in rows), width,
                any(r.params.allowed is not None or r.seq.params.logits_processors for r in rows))

    def static_fields(self, rows: list[SampleRow], bucket: int, stages: tuple) -> list[list]:
        """The payload sample_static reads, as lists in SAMPLE_DTYPES: the (bucket, C) table (padding rows are
        greedy, penalties off, not counted), then the (bucket, E) entry ids and values (padding: token 0, + 0)."""
        width, table, ids, values = stages[3], [], [], []
        for r in rows:
            p = r.params
            table += [p.temperature, p.top_k, p.top_p, p.min_p, p.presence, p.frequency, p.repetition,
                      self._uniform(r), 1.0]
            at, by = self._edits(r)
            ids += at + [0] * (width - len(at))
            values += by + [0.0] * (width - len(by))
        pad = bucket - len(rows)
        table += [0.0, float(self.counts.shape[1]), 1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0] * pad
        return [table, ids + [0] * (width * pad), values + [0.0] * (width * pad)]

    def prepare_static(self, rows: list[SampleRow], stages: tuple) -> tuple[torch.Tensor | None, dict]:
        """The device work before a captured step's replay: the rows' slots made theirs (_own), and their masks
        (token_masks: (B, V) bool or None; the rows whose mask raised)."""
        for r in rows:
            self._own(r.seq.slot, r)
        return self.token_masks(rows, self.counts.shape[1]) if stages[4] else (None, {})

    def sample_static(self, logits: torch.Tensor, slots: torch.Tensor, table: torch.Tensor, edit_ids: torch.Tensor,
                      edit_values: torch.Tensor, allowed: torch.Tensor | None, stages: tuple) -> torch.Tensor:
        """Capture-safe sampling of a padded step: logits (bucket, V) fp32, slots (bucket,) the rows' state slots,
        table (bucket, C) float64 (static_fields), edit_ids (bucket, E) int64 and edit_values (bucket, E)
        float64, allowed (bucket, V) bool or None -> (bucket,) int32 tokens; counts the live rows' tokens.
        The same stages in the same order as sample_on_device, so the tokens are the same."""
        penalties, sort, min_p, width, masks = stages
        rows = RowTable(*table[:, :-1].unbind(1))
        x = logits
        if penalties:
            x = apply_penalties(x, self.counts[slots], self.prompt_seen[slots], rows)
        if width:                                                   # as _bias_and_bans' sparse add
            x = x.scatter_add(1, edit_ids, edit_values.to(x.dtype))
        if masks:
            x = apply_token_masks(x, allowed)
        x = scale_by_temperature(x, rows)
        if sort or min_p:
            x = filter_logits(x, rows, sort, min_p)
        tokens = draw_tokens(x, rows)                                              # (bucket,) int64
        at = slots.long() * self.counts.shape[1] + tokens                          # (bucket,) into counts' (S * V)
        self.counts.view(-1).scatter_add_(0, at, table[:, -1].int())              # padding: + 0
        return tokens.int()

    @staticmethod
    def _edits(r: SampleRow) -> tuple[list[int], list[float]]:
        """The row's logit_bias entries, then its min_tokens bans as -inf (as _bias_and_bans adds them)."""
        banned = r.params.banned if r.emitted < r.seq.params.min_tokens else []
        return r.params.bias_ids + banned, r.params.bias_values + [float("-inf")] * len(banned)

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: list[SampleRow]) -> list[torch.Tensor]:
        """The model's own log-probabilities (before penalties and temperature) of the sampled tokens and the
        top k, for the L rows that asked: [(L, 1 + K) float32 bits, (L, K) ids] as int32 words."""
        want = [(i, r.seq.params.logprobs) for i, r in enumerate(rows) if r.seq.params.logprobs is not None]
        if not want:
            return []
        index = to_device(torch.tensor([i for i, _ in want], dtype=torch.long), raw.device)   # (L,)
        lp = raw[index].log_softmax(-1)                                                     # (L, V)
        top = lp.topk(max(k for _, k in want), dim=-1)                                     # (L, K)
        values = torch.cat([lp.gather(1, tokens[index, None]), top.values], dim=1)          # (L, 1 + K)
        return [values.contiguous().view(torch.int32).reshape(-1), top.indices.int().reshape(-1)]


# -----------------------------------------------------------------------------------------------
# 8. The runner, which turns a plan into a Batch and runs the model. With tensor parallelism every rank
#    runs the same Batch on its shard (section 8b); sampling happens once, on rank 0.
# -----------------------------------------------------------------------------------------------

_BATCH_DTYPES = (torch.long, torch.long, torch.int32, torch.int32, torch.int32, torch.long, torch.int32,
                 torch.long, torch.long)   # Batch's fields in order


def batch_fields(plan: list[Scheduled], block_size: int, pad_to: int = 0, width: int = 0,
                 pad_slots: list[int] = (), unread: bool = False) -> tuple[list[list[int]], int]:
    """Batch's fields in order as int lists (block tables flattened to (B, width)), and the width. pad_to > len(plan)
    adds decode rows that change nothing anyone reads (a CUDA graph's fixed batch size): token 0 at position 0,
    no KV slot (-1: kv_write skips it), context 1 read from block 0, and a free state slot from pad_slots.
    unread: the plan's tokens are still on the device (async scheduling): token ids 0, overwritten there."""
    ids, pos, slots, starts, ctx, rows = [], [], [], [0], [], []
    for p in plan:
        n = len(p.seq.request.prompt_ids)                  # a decode reads its output, not prompt + output
        ids += [0] * p.count if unread else p.seq.output_ids[p.start - n:p.start - n + p.count] if p.start >= n \
            else p.seq.tokens[p.start:p.start + p.count]
        ids += p.drafts                                     # a verify window: the last token, then its drafts
        positions = range(p.start, p.start + p.count)
        pos += positions
        slots += [p.seq.blocks[i // block_size] * block_size + i % block_size for i in positions]
        starts.append(starts[-1] + p.count)
        ctx.append(p.start + p.count)
        rows += range(starts[-1] - 1 - len(p.drafts), starts[-1])   # a window's logits at every position
    width = max(width, max(len(p.seq.blocks) for p in plan))
    tables = [b for p in plan for b in p.seq.blocks + [0] * (width - len(p.seq.blocks))]   # (B, width) flat
    state_slots = [p.seq.slot for p in plan] + list(pad_slots[:max(0, pad_to - len(plan))])
    for _ in range(len(plan), pad_to):
        ids.append(0), pos.append(0), slots.append(-1), ctx.append(1), rows.append(starts[-1])
        starts.append(starts[-1] + 1)
        tables += [0] * width
    fresh = [p.seq.slot for p in plan if p.start == 0]
    return [ids, pos, starts, ctx, tables, slots, state_slots, rows, fresh], width


_ARRAY_CODES = {torch.long: "q", torch.int32: "i", torch.float64: "d"}


def pack_fields(fields: list[list], dtypes: tuple = _BATCH_DTYPES) -> torch.Tensor:
    """Batch's fields (batch_fields' lists; after them, those of the sampler in a graph: SAMPLE_DTYPES) as one
    host byte buffer: each field in its dtype, starting on an 8-byte boundary, so one copy moves a step's whole
    input and field_views reads it in place."""
    buf = bytearray()
    for values, dtype in zip(fields, dtypes):
        buf += array.array(_ARRAY_CODES[dtype], values).tobytes()
        buf += bytes(-len(buf) % 8)
    return torch.frombuffer(buf, dtype=torch.uint8)                              # (bytes,)


def field_views(payload: torch.Tensor, sizes: list[int], dtypes: tuple = _BATCH_DTYPES) -> list[torch.Tensor]:
    """pack_fields' fields as views of its buffer (sizes: each field's length), without conversion."""
    parts, at = [], 0
    for n, dtype in zip(sizes, dtypes):
        nbytes = n * dtype.itemsize
        parts.append(payload.narrow(0, at, nbytes).view(dtype))               # (narrow: no Python indexing)
        at += nbytes + -nbytes % 8
    return parts


def batch_view(payload: torch.Tensor, sizes: list[int], B: int, width: int) -> Batch:
    """The Batch whose fields are views of pack_fields' buffer: no conversion, so a recorded or captured forward
    reads the buffer that each step refreshes."""
    parts = field_views(payload, sizes[:len(_BATCH_DTYPES)])
    parts[4] = parts[4].view(B, width)                                          # block tables (B, width)
    return Batch(*parts)


def fields_batch(fields: list[list[int]], width: int, B: int, device) -> Batch:
    """batch_fields' lists as a Batch: built on the host, then one copy to the device (from pinned memory and
    without waiting, on a GPU)."""
    return batch_view(to_device(pack_fields(fields), device), [len(f) for f in fields], B, width)


def make_batch(plan: list[Scheduled], block_size: int, device, unread: bool = False) -> Batch:
    """Flatten the plan into the tensors the model reads (unread: see batch_fields)."""
    return fields_batch(*batch_fields(plan, block_size, unread=unread), len(plan), device)


def write_token_ids(payload: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """Async scheduling: the step's token ids (B,) int64, sampled on the device by the step before, written over
    the placeholders at the start of a packed payload (token_ids is its first field) without the host."""
    if ids is not None:
        payload[:ids.numel() * 8].view(torch.long).copy_(ids)
    return payload


class DecodeGraphs:
    """The decode step replayed per batch-size bucket: a pure decode step (one new token per sequence) of B
    sequences is padded to the next bucket, its fields copied into the bucket's static payload in one upload,
    and the bucket's recorded step replayed: the host's cost of a step is one copy plus either one CUDA graph
    launch (CUDA, counted in `graphed`) or one cffi call per native launch (launch-list replay, LaunchRecording:
    the CPU build, and every rank under tensor parallelism; counted in `replayed`) instead of a Python call per
    op. Prefill and mixed steps and speculative verify windows run eagerly. Padding rows write only free state
    slots, whose next owner zeroes them.

    The sampler is in the step too (`sampler`, one rank only; `sampling = False` leaves it out): when pack() is
    given the step's sample rows and the sampler can take them in a graph (Sampler.static_stages), their
    parameters ride in the same payload and the step returns the (B,) sampled tokens instead of the (B, V)
    logits. A CUDA graph then covers forward and sampling, one graph per (bucket, stages), all in one memory
    pool (one step replays at a time, and each step's result is read before the next replay); a launch list
    holds native launches only, so there the sampling runs after the replay, from the same payload (one
    recording per (bucket, stages) too: the payload's size depends on the stages). Counted in `sampled`.

    With tensor parallelism rank 0's DecodeGraphs picks the bucket and packs the payload, and `call` sends it to
    every rank (RankRunner.decode), where each rank's own DecodeGraphs records and replays its shard's forward
    with step(); the all-reduces are in every rank's list in the same order (NCCL's are native launches, gloo's
    between CPU ranks a LaunchRecording.host step). A rank whose recording was refused runs that bucket
    eagerly from the payload: the same calls, so the collectives still pair up.

    A bucket's first step records it: with graphs, that step runs eagerly (it loads and warms every kernel of
    that shape) and the second is captured (capture runs nothing) and replayed; with launch lists, the first
    step runs eagerly while recording and is itself the result. A recording that met a torch op that launches a
    kernel is `refused` (bucket -> the op's name) and that bucket stays eager. `enabled = False` (the engine's
    --enforce-eager) switches both off. `graph`: the graph class (torch.cuda.CUDAGraph; the tests' stand-in
    records and replays torch ops, and runs the step while it captures: `runs_on_capture`)."""
    BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

    def __init__(self, model: "Model", cache: Cache | None, max_batch_size: int, max_context: int, block_size: int,
                 call: Callable | None = None, graphs: bool = True, sampler: Sampler | None = None,
                 graph: Callable | None = None):
        self.model, self.cache, self.block_size, self.call = model, cache, block_size, call
        self.width = -(-max_context // block_size)             # block-table width: every bucket reads the same
        self.buckets = [b for b in self.BUCKETS if b < max_batch_size] + [max_batch_size]
        # CUDA graphs without a rank group; launch lists elsewhere (NCCL inside a captured graph: not yet run)
        cuda = model.device.type == "cuda" and torch.cuda.is_available()
        self.graph = graph or (torch.cuda.CUDAGraph if cuda else None)
        self.use_graphs = graphs and self.graph is not None
        self.pool = None                                        # the graphs' shared memory pool, made at capture
        self.sampler = sampler if call is None else None        # under tensor parallelism rank 0 samples eagerly
        self.sampling = True
        self.steps: dict = {}                                   # bucket or (bucket, stages) -> (replay(), payload, out)
        self.seen: set = set()                                  # graphs: keys run eagerly once
        self.refused: dict[int, str] = {}                       # bucket -> the torch op that refused its recording
        self.allowed: dict[int, torch.Tensor] = {}              # bucket -> (bucket, V) bool: the rows' token masks
        self.replayed = self.graphed = self.sampled = 0         # steps from a launch list / a graph / with sampling
        self.enabled = True

    @staticmethod
    def usable(model: "Model") -> bool:
        return model.ops.name == "native"

    def buckets_recorded(self) -> list[int]:
        return sorted({k if isinstance(k, int) else k[0] for k in self.steps})

    def run(self, plan: list[Scheduled], free_slots: list[int], rows: list[SampleRow] | None = None):
        """A decode step by replay (or by recording it): see replay; None when this step is not one a replay
        runs (see pack)."""
        packed = self.pack(plan, free_slots, rows=rows)
        return None if packed is None else self.replay(packed)

    def pack(self, plan: list[Scheduled], free_slots: list[int], unread: bool = False,
             rows: list[SampleRow] | None = None) -> tuple | None:
        """The host half of run(): (packed fields, their sizes, bucket, B, stages, rows), or None when this step
        is not one a replay runs: replay off, a prefill row, more sequences than the largest bucket, too few
        free state slots to pad, a refused bucket, or a key's first step with graphs. unread: see batch_fields.
        rows: the step's sample rows, one per plan entry in order, to sample inside the step (stages: None when
        the sampler cannot or is off, and the step returns logits)."""
        B = len(plan)
        if not self.enabled or B > self.buckets[-1] or any(p.count != 1 or p.start == 0 for p in plan):
            return None
        bucket = next(b for b in self.buckets if b >= B)
        if len(free_slots) < bucket - B or bucket in self.refused:
            return None
        stages = self.sampler.static_stages(rows) if rows and self.sampler and self.sampling else None
        if self.use_graphs and (bucket, stages) not in self.seen:
            self.seen.add((bucket, stages))
            return None
        fields, _ = batch_fields(plan, self.block_size, bucket, self.width, free_slots, unread)
        if stages is not None:
            fields += self.sampler.static_fields(rows, bucket, stages)
        return pack_fields(fields, _BATCH_DTYPES + SAMPLE_DTYPES), [len(f) for f in fields], bucket, B, stages, rows

    def replay(self, packed: tuple, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict | None]:
        """The device half of run(): ((B, V) logits, None) of pack()'s step, or with the sampler in it ((B,) int32
        tokens, the rows whose mask raised); ids (B,) on the device: its token ids (async scheduling; one rank
        only)."""
        host, sizes, bucket, B, stages, rows = packed
        if self.call is not None:                               # every rank's step(), rank 0's logits
            return self.call("decode", host, sizes, bucket)[:B], None
        out, failed = self.step(host, sizes, bucket, ids, stages, rows)
        return out[:B], failed

    def step(self, host: torch.Tensor, sizes: list[int], bucket: int, ids: torch.Tensor | None = None,
             stages: tuple | None = None, rows: list[SampleRow] = ()) -> tuple[torch.Tensor, dict | None]:
        """This rank's (bucket, V) logits of a padded decode step from its packed fields (ids: see replay), or
        with `stages` its (bucket,) tokens and the rows whose mask raised: the key's recording replayed, or made
        by this step; a refused bucket runs eagerly from the payload."""
        failed = None
        if stages is not None:                                  # device work queued before the replay
            allowed, failed = self.sampler.prepare_static(rows, stages)
            if stages[4]:
                static = self.allowed.get(bucket)
                if static is None:
                    static = self.allowed[bucket] = torch.ones(bucket, self.sampler.counts.shape[1], dtype=torch.bool,
                                                               device=self.model.device)   # (bucket, V)
                if allowed is None:
                    static.fill_(True)
                else:
                    static[:len(rows)].copy_(allowed)
                    static[len(rows):].fill_(True)
        key = bucket if stages is None else (bucket, stages)    # the payload's size and, in a graph, the kernels
        if key not in self.steps and bucket not in self.refused:
            payload, out = self.record(host, sizes, key, stages, ids)
            if out is not None:                                 # the recording ran the step
                return self._after(payload, sizes, bucket, stages, out), failed
        if bucket in self.refused:
            payload = write_token_ids(host.to(self.model.device, copy=True), ids)
            return self._whole(payload, sizes, bucket, stages), failed
        replay, payload, out = self.steps[key]
        if self.use_graphs and torch.cuda.is_available():
            host = host.pin_memory()
        write_token_ids(payload.copy_(host, non_blocking=True), ids)
        replay()
        if self.use_graphs:
            self.graphed += 1
        else:
            self.replayed += 1
        return self._after(payload, sizes, bucket, stages, out), failed

    def record(self, host: torch.Tensor, sizes: list[int], key, stages: tuple | None,
               ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Graphs: capture a `bucket`-row decode step (forward, and sampling with `stages`) reading a static
        payload (it runs nothing: returns (payload, None)). Launch lists: run the forward while recording and
        return (payload, its (bucket, V) logits)."""
        payload = write_token_ids(host.to(self.model.device, copy=True), ids)   # the key's static input
        bucket = key if isinstance(key, int) else key[0]
        if self.use_graphs:
            graph = self.graph()
            if getattr(graph, "runs_on_capture", False):
                with graph.capture():
                    out = self._whole(payload, sizes, bucket, stages)
                self.steps[key] = (graph.replay, payload, out)
                return payload, out
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):   # other threads
                out = self._whole(payload, sizes, bucket, stages)                        # may use CUDA
            self.steps[key] = (graph.replay, payload, out)
            return payload, None
        recording = LaunchRecording(self.model.ops.lib)
        with recording:
            logits = self._whole(payload, sizes, bucket, None)                 # (bucket, V)
        if recording.refused:
            self.refused[bucket] = recording.refused
        else:
            self.steps[key] = (recording.replay, payload, logits)
        return payload, logits

    def _whole(self, payload: torch.Tensor, sizes: list[int], bucket: int, stages: tuple | None) -> torch.Tensor:
        """The step from its payload: (bucket, V) logits, or with `stages` the (bucket,) sampled tokens."""
        logits = self.model.forward(batch_view(payload, sizes, bucket, self.width), self.cache)   # (bucket, V)
        return logits if stages is None else self._sample(payload, sizes, bucket, stages, logits)

    def _after(self, payload: torch.Tensor, sizes: list[int], bucket: int, stages: tuple | None,
               out: torch.Tensor) -> torch.Tensor:
        """A replayed step's result: a graph's as it is; after a launch list's forward, the sampling."""
        if stages is not None:
            self.sampled += 1
            if not self.use_graphs:
                return self._sample(payload, sizes, bucket, stages, out)
        return out

    def _sample(self, payload: torch.Tensor, sizes: list[int], bucket: int, stages: tuple,
                logits: torch.Tensor) -> torch.Tensor:
        parts = field_views(payload, sizes, _BATCH_DTYPES + SAMPLE_DTYPES)
        table, ids, values = parts[len(_BATCH_DTYPES):]
        return self.sampler.sample_static(logits, parts[6], table.view(bucket, len(SAMPLE_COLUMNS)),
                                          ids.view(bucket, stages[3]), values.view(bucket, stages[3]),
                                          self.allowed.get(bucket) if stages[4] else None, stages)


def make_draft_batch(entries: list[tuple[Sequence, int, list[int]]], block_size: int, device) -> Batch:
    """An MTP pass: per entry (seq, start, ids), ids[i] is the token *after* position start + i (the MTP layer
    reads t_{i+1} at position i). Logits are taken at each entry's last position."""
    plan = [Scheduled(seq, start, len(ids), sample=True) for seq, start, ids in entries]
    fields, width = batch_fields(plan, block_size)
    fields[0] = [token for _, _, ids in entries for token in ids]
    fields[-1] = []                      # no state slot starts fresh: the MTP layer has no recurrent state
    return fields_batch(fields, width, len(plan), device)


class DeviceQueue:
    """The device's queue of work as async scheduling sees it (section 9): `launch` queues a step's work and
    returns at once, `read` is the host's one read of a step's result and waits for that step only, `run` queues
    work whose result only later work reads (a split step's forward), `later` runs device work the host issues
    while steps are in flight (a finished sequence's snapshot copy) behind them.
    On CUDA the kernels a host thread calls are queued on the stream anyway: launch runs the work (which only
    enqueues), copies its result to pinned memory without waiting and records an event, which read waits for
    (on the tests' fake CUDA, read copies it then). On the CPU torch runs each op when it is called, so one
    worker thread plays the stream; `warm` runs first on it (the native backend's per-thread scratch is a torch
    allocation, which must not happen inside a bucket's launch-list recording)."""

    def __init__(self, device, warm: Callable[[], object] | None = None):
        self.cuda = torch.device(device).type == "cuda"
        self.events = self.cuda and torch.cuda.is_available()
        self.warm = warm
        self.worker: concurrent.futures.ThreadPoolExecutor | None = None
        self.queued: list[concurrent.futures.Future] = []     # CPU: work submitted and not yet waited for
        self.launches = self.reads = 0                         # steps launched / host reads of results, for tests

    def launch(self, work: Callable[[], tuple[torch.Tensor, dict]]):
        """Queue work() -> (packed result on the device, host-side facts); read() gets them back."""
        self.launches += 1
        if self.cuda:
            packed, facts = work()
            if not self.events:
                return None, packed, facts
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            return done, host, facts
        return self.run(work)

    def run(self, work: Callable[[], object]):
        """Queue work() behind what is queued, without a result for the host (CUDA: it only enqueues kernels)."""
        if self.cuda:
            return work()
        if self.worker is None:
            self.worker = concurrent.futures.ThreadPoolExecutor(1, "pocketllm-device", initializer=self.warm)
        self.queued.append(self.worker.submit(work))
        return self.queued[-1]

    def read(self, launched) -> tuple[torch.Tensor, dict]:
        """The packed result on the host, and the facts: waits for that step's work, not what came after."""
        self.reads += 1
        if self.cuda:
            done, host, facts = launched
            if done is None:
                return host.cpu(), facts
            done.synchronize()
            return host, facts
        concurrent.futures.wait([launched])
        self.drain(done_only=True)          # raises what failed first (a split step's forward before its sampling)
        return launched.result()

    def later(self, work: Callable[[], None]):
        if self.cuda or all(f.done() for f in self.queued):
            work()
        else:
            self.run(work)

    def drain(self, done_only: bool = False):
        """Wait for everything queued (before the host runs device work itself), or forget what is done; raises
        what the work raised."""
        queued = self.queued
        self.queued = [f for f in queued if done_only and not f.done()]
        for f in queued:
            if f not in self.queued:
                f.result()

    def close(self):
        """Wait for the queue without raising, and stop the worker."""
        for f in self.queued:
            f.exception()
        self.queued = []
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None


# -----------------------------------------------------------------------------------------------
# 8b. Tensor parallelism, Megatron style: one rank per device, each holding a Shard of every layer (section
#     4 loads only its slices). Rank 0 is this process: it schedules, samples and serves. Ranks 1..N-1 are
#     worker processes that run rank 0's calls (RankRunner methods) on their shard and cache. Activations cross
#     ranks only in the model's all-reduces: two per layer (after the mixer's output projection and after
#     down_proj), and two per step for the vocab-parallel embedding and lm_head (each rank holds 1/N of their
#     rows: the lookup is summed from the ranks' rows, the (R, V) logits gathered from their columns), so
#     rank 0 samples from the full logits and no rank holds a whole 2.5 GB table at 27B (Model.embed/head).
#
#     Lifecycle: one group, one lifetime. start_group returns only after every rank has loaded; a worker
#     that fails or dies ends the group (named in the message); workers stop when rank 0 says so, when rank 0
#     disappears, or when their connection to it breaks. Workers join over loopback with the group's secret.
#     See docs/architecture.md, "Tensor parallelism".
# -----------------------------------------------------------------------------------------------



# Cross-rank work is a method call. Rank 0 calls `group.call("run", batch, ENGINE_CACHE)`: the method's name
# and arguments go to every worker over its control connection, then rank 0 runs the same RankRunner method on
# its own shard. Workers run calls as they arrive and calls are serialised on rank 0, so every rank runs the
# same calls in the same order and the all-reduces inside forward pair up. A new cross-rank operation (a
# prefix-cache state copy, a speculative verify) is a new RankRunner method: the wire does not change. Only
# rank 0's result is kept; a worker answers only "ready" after loading, or its error before it exits.

ENGINE_CACHE, SCRATCH_CACHE = 0, 1    # which cache a step runs on: the engine's, or logits()'s temporary one
SNAPSHOT_CACHE = 2                    # the prefix cache's state snapshots (section 5): copied to and from only
STOP = "stop"                         # the call that ends a worker's loop (not a RankRunner method)
STEP_CALLS = ("run", "draft", "decode")   # the calls whose all-reduces a step waits for (Comm.finish_step)


class RankRunner:
    """One rank's model shard and caches. Its public methods are the calls rank 0 makes on every rank."""

    def __init__(self, model: Model, opts: EngineOptions, kv_dtype: torch.dtype, device: torch.device,
                 engine_cache: Cache | None = None, snapshot_cache: Cache | None = None):
        self.model, self.opts, self.kv_dtype, self.device = model, opts, kv_dtype, device
        self.caches: dict[int, Cache | None] = {ENGINE_CACHE: engine_cache, SCRATCH_CACHE: None,
                                                SNAPSHOT_CACHE: snapshot_cache}
        self.hidden: torch.Tensor | None = None    # (T, D) the last engine step's hidden states (speculation)
        self.carried: torch.Tensor | None = None   # (B, D) its sequences' Cache.hidden rows before it (draft())
        self.drafted: torch.Tensor | None = None   # (R, D) the last MTP pass's outputs at its logit rows
        self.graphs: DecodeGraphs | None = None     # this rank's recorded decode steps (decode())

    @staticmethod
    def is_call(method: str) -> bool:
        return not method.startswith("_") and method != "is_call" and callable(vars(RankRunner).get(method))

    def run(self, batch: Batch, which: int, window: VerifyWindow | None = None) -> torch.Tensor:
        """One forward step on cache `which`: (R, V) logits, kept on rank 0 and dropped on the workers. With
        speculative decoding the hidden states stay here for draft(), and `window` names the sequences that
        verify drafts (their GDN states are kept for rollback())."""
        if self.model.mtp is None or which != ENGINE_CACHE:
            return self.model.forward(batch, self.caches[which])
        cache = self.caches[which]
        if window is not None:
            self.model.open_window(cache, window)
        self.hidden = self.model.hidden(batch, cache)                        # (T, D)
        last, slots = batch.query_start[1:].long() - 1, batch.state_slots.long()   # (B,) last rows, slots
        self.carried = cache.hidden[slots]                                   # (B, D) as the step found them
        cache.hidden[slots] = self.hidden[last]                              # (a window's: until rollback())
        return self.model.head(self.hidden[batch.logit_rows])

    def decode(self, host: torch.Tensor, sizes: list[int], bucket: int) -> torch.Tensor:
        """A padded decode step of `bucket` rows on the engine cache from rank 0's packed fields (DecodeGraphs):
        this rank's recording of the bucket replayed, or made now. (bucket, V) logits."""
        if self.graphs is None:
            o = self.opts
            self.graphs = DecodeGraphs(self.model, self.caches[ENGINE_CACHE], o.max_batch_size, o.max_context,
                                       o.kv_block_size, graphs=False)
        return self.graphs.step(host, sizes, bucket)[0]

    def replay_stats(self) -> list[tuple[int, int, int]]:
        """Every rank's decode replays as (buckets recorded, buckets refused, steps replayed), gathered to rank 0
        through the model's all-reduce (as vocab_shards)."""
        g, m = self.graphs, self.model
        table = torch.zeros(m.shard.world, 3, dtype=torch.float32, device=self.device)   # (world, 3)
        if g is not None:
            table[m.shard.rank] = torch.tensor([len(g.steps), len(g.refused), g.replayed], dtype=torch.float32)
        return [tuple(int(v) for v in row) for row in m.all_reduce(table).cpu().tolist()]

    def rollback(self, kept: list[int]) -> None:
        """After the verify: each window sequence's GDN states after its kept tokens (Model.rollback), and its
        hidden row at its last kept token."""
        cache = self.caches[ENGINE_CACHE]
        w = cache.window
        if w is not None:
            starts = [0, *itertools.accumulate(w.lens)]
            last = torch.tensor([starts[s] + n - 1 for s, n in enumerate(kept)], dtype=torch.long)   # (S,)
            cache.hidden[w.slots] = self.hidden[w.rows[last.to(w.rows.device)]]
        self.model.rollback(cache, kept)

    def draft(self, batch: Batch, rows: torch.Tensor, chained: bool, carried: bool = False) -> torch.Tensor:
        """One MTP pass on the engine cache, reading rows (T,) of the target's last hidden states, or of the
        last draft pass's outputs when chained. With `carried`, a row T + b reads the step's sequence b's hidden
        row from before the step (the position before a resumed or forked sequence's first, Engine._draft).
        Returns its (R, V) logits."""
        source = self.drafted if chained else torch.cat([self.hidden, self.carried]) if carried else self.hidden
        self.drafted, logits = self.model.draft(batch, self.caches[ENGINE_CACHE], source[rows])
        return logits

    def set_scratch(self, nblocks: int) -> None:
        """LLM.logits()'s temporary cache: nblocks KV blocks and one state slot; 0 frees it."""
        self.caches[SCRATCH_CACHE] = allocate_cache(self.model.cfg, self.model.layers, nblocks,
                                                    self.opts.kv_block_size, 1, self.kv_dtype,
                                                    self.device) if nblocks else None

    def vocab_shards(self) -> list[tuple[int, int, int, int]]:
        """Every rank's (v0, v1, embed_tokens rows, lm_head rows) as loaded, gathered to rank 0 through the
        model's all-reduce: what each rank holds, for the start-up log and the tests."""
        m = self.model
        table = torch.zeros(m.shard.world, 4, dtype=torch.float32, device=self.device)   # (world, 4) exact < 2^24
        table[m.shard.rank] = torch.tensor([*m.vocab, m.embed_tokens.shape[0], m.lm_head.shape[0]],
                                           dtype=torch.float32)
        return [tuple(int(v) for v in row) for row in m.all_reduce(table).cpu().tolist()]

    def copy_state(self, src: int, dst: int, slots: list[tuple[int, int]], blocks: list[tuple[int, int]]) -> None:
        """copy_cache (section 5) from cache `src` to cache `dst` (ENGINE_CACHE, SNAPSHOT_CACHE): forks, the
        prefix cache's snapshots and partial blocks."""
        copy_cache(self.caches[src], self.caches[dst], self.model.ops, slots, blocks)


def _move(value, device):
    """value with every tensor in it (also inside a dataclass such as Batch, a list or a tuple) on device: a
    call's arguments travel as CPU tensors, and each worker moves them to its own device."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _move(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value)})
    if isinstance(value, (list, tuple)):
        return type(value)(_move(v, device) for v in value)
    return value


def _tensor_from_bytes(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)


class _Pickler(pickle.Pickler):
    """Pickles a tensor as its raw bytes (a CPU copy), several times faster than torch's own reduction."""

    def reducer_override(self, obj):
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        t = obj.detach().to("cpu").contiguous()
        data = ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())
        return _tensor_from_bytes, (data, str(t.dtype).removeprefix("torch."), tuple(t.shape))


def _dumps(message) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, pickle.HIGHEST_PROTOCOL).dump(message)
    return buf.getvalue()


class _Unpickler(pickle.Unpickler):
    """Finds this file's classes (Batch, ...) whatever the module is called on the sending rank: `__main__`
    under the CLI, `pocketllm` in a worker, any name in a program that loaded the file by path."""

    def __init__(self, data: bytes, peer_module: str):
        super().__init__(io.BytesIO(data))
        self.peer_module = peer_module

    def find_class(self, module: str, name: str):
        return globals()[name] if module == self.peer_module else super().find_class(module, name)


class Channel:
    """The control connection between rank 0 and one worker: pickled messages, each behind its 8-byte length.
    It exists only after the handshake below, so only a group member's bytes are ever unpickled."""

    def __init__(self, sock: socket.socket, peer_module: str = __name__):
        self.sock, self.peer_module = sock, peer_module   # the other rank's name for this file's module

    def send(self, message) -> None:
        self.send_bytes(_dumps(message))

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(struct.pack("!Q", len(data)) + data)

    def recv(self):
        return _Unpickler(self.read(struct.unpack("!Q", self.read(8))[0]), self.peer_module).load()

    def read(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise ConnectionError("the other rank closed the connection")
            buf += chunk
        return bytes(buf)

    def pending(self) -> bool:
        """Something (a message, or the end of the connection) can be read without waiting."""
        return bool(select.select([self.sock], [], [], 0)[0])

    def close(self) -> None:
        self.sock.close()


# The rendezvous. Rank 0 listens on 127.0.0.1 only, and a connection joins the group only by proving it holds
# the group's secret (32 random bytes that rank 0 writes to each worker's stdin, never on a command line):
# rank 0 sends a nonce, the worker answers with its rank, HMAC(secret, nonce, rank) and a nonce of its own,
# which rank 0 answers in turn (a worker never talks to an impostor holding rank 0's port). Any other
# connection is closed and the group keeps waiting for the real worker. The collectives rendezvous through a
# FileStore in a private (0700) directory, and gloo's sockets bind to 127.0.0.1 too; NCCL's bootstrap uses
# the loopback interface unless NCCL_SOCKET_IFNAME says otherwise.

RENDEZVOUS_HOST = "127.0.0.1"
HANDSHAKE_TIMEOUT_S = 10.0
_HANDSHAKE = b"pocketllm-tp-1"


def _mac(secret: bytes, role: bytes, nonce: bytes, rank: int) -> bytes:
    return hmac.new(secret, _HANDSHAKE + role + nonce + struct.pack("!i", rank), "sha256").digest()


def admit_worker(sock: socket.socket, secret: bytes, world: int) -> tuple[int, Channel] | None:
    """Rank 0's side of the handshake: (rank, channel) for a worker holding the secret, else None."""
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    channel, nonce = Channel(sock), os.urandom(16)
    try:
        sock.sendall(nonce)
        reply = channel.read(4 + 32 + 16)                               # rank, its MAC, the worker's nonce
    except (OSError, ConnectionError):
        return None
    rank = struct.unpack("!i", reply[:4])[0]
    if not 0 < rank < world or not hmac.compare_digest(reply[4:36], _mac(secret, b"worker", nonce, rank)):
        return None
    sock.sendall(_mac(secret, b"rank0", reply[36:], rank))
    sock.settimeout(None)
    return rank, channel


def join_group(port: int, rank: int, secret: bytes, rank0_module: str) -> Channel:
    """A worker's side of the handshake: its control channel to rank 0."""
    sock = socket.create_connection((RENDEZVOUS_HOST, port), timeout=HANDSHAKE_TIMEOUT_S)
    channel, nonce = Channel(sock, rank0_module), os.urandom(16)
    sock.sendall(struct.pack("!i", rank) + _mac(secret, b"worker", channel.read(16), rank) + nonce)
    if not hmac.compare_digest(channel.read(32), _mac(secret, b"rank0", nonce, rank)):
        raise PocketError(f"the process on port {port} is not this group's rank 0 (wrong secret)")
    sock.settimeout(None)
    return channel


class CollectiveTimeout(PocketError):
    """A collective waited past its bound for the other ranks: one of them is hung (a dead one fails it sooner)."""

    def __init__(self, what: str, bound_s: float, flag: str):
        super().__init__(f"{what} took more than {bound_s:g} s ({flag}): one of the other ranks is hung")


class Comm:
    """One rank's all-reduce: over gloo on CPU ranks; over NCCL on GPU ranks, the native library's when the
    native ops run (it must have NCCL), torch.distributed's when the torch ops do.

    Every wait is bounded, so no rank waits forever on a peer: --collective-warmup-timeout while the ranks
    connect and for the first WARMUP_STEPS steps (they JIT-compile kernels), --collective-timeout after. On
    gloo a dead peer fails the all-reduce at once (its sockets close) and a hung one at the bound. On the
    native NCCL path the step's all-reduces are queued on the stream and finish_step waits for them, polling
    NCCL's asynchronous error; an error or the bound aborts the communicator."""

    WARMUP_STEPS = 2          # a prefill and a decode: each JIT-compiles kernels the other does not run

    def __init__(self, store, rank: int, world: int, device: torch.device, ops, opts: EngineOptions):
        self.opts, self.steps, self.sync = opts, 0, lambda: None
        self.lib = getattr(ops, "lib", None)                  # a LaunchRecording there records gloo's all-reduce
        self.waiting_for = "connecting to the other ranks"      # what a timeout names
        warmup = datetime.timedelta(seconds=opts.collective_warmup_timeout)
        store.set_timeout(warmup)                   # a peer that never publishes its address
        if device.type == "cuda" and hasattr(ops, "nccl_init"):
            init = lambda: ops.nccl_init(store.get("nccl_id"), world, rank, device.index, self.timeout_s)  # noqa: E731
            self.comm = self._bounded(init)
            self.all_reduce = lambda x: ops.all_reduce(x, self.comm)        # in place, on the ops' stream
            self.sync = lambda: self._bounded(lambda: ops.nccl_wait(self.comm, self.timeout_s))
        else:
            self.group = self._bounded(lambda: self._torch_group(store, rank, world, device, warmup))
            self.all_reduce = self._torch_all_reduce
        self.all_reduce(torch.zeros(1, device=device))   # every rank has joined (gloo may connect only now)
        self.sync()
        self.waiting_for = "an all-reduce"

    @staticmethod
    def _torch_group(store, rank: int, world: int, device: torch.device, timeout: datetime.timedelta):
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, world, options)
        options = dist.ProcessGroupGloo._Options()
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=RENDEZVOUS_HOST)]
        options._timeout = timeout
        return dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world, options)

    @property
    def timeout_s(self) -> float:
        return self.opts.collective_warmup_timeout if self.steps < self.WARMUP_STEPS else self.opts.collective_timeout

    def finish_step(self) -> None:
        """After a step (a RankRunner.run): its collectives have completed (NCCL: waited for, bounded)."""
        self.sync()
        self.steps += 1

    def _torch_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        recording = LaunchRecording.active(self.lib)       # a decode replay on CPU ranks repeats it (section 8)
        return self._group_all_reduce(x) if recording is None else recording.host(self._group_all_reduce, x)

    def _group_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        options = dist.AllreduceOptions()
        options.timeout = datetime.timedelta(seconds=self.timeout_s)
        self._bounded(lambda: self.group.allreduce([x], options).wait())
        return x

    def _flag(self) -> str:
        """The option that bounds the next wait."""
        return "--collective-warmup-timeout" if self.steps < self.WARMUP_STEPS else "--collective-timeout"

    def _bounded(self, wait: Callable):
        """wait(), which gives up at the bound: its failure there is a CollectiveTimeout. One sooner is a peer's
        death (its connections closed, or NCCL's asynchronous error), which the group's watcher names."""
        bound, started = self.timeout_s, time.monotonic()
        try:
            return wait()
        except Exception as e:
            if time.monotonic() - started < 0.9 * bound:
                raise
            raise CollectiveTimeout(self.waiting_for, bound, self._flag()) from e


def _load_rank_model(ckpt_dir, opts: EngineOptions, ops, dtype, device, rank: int, world: int, all_reduce,
                     quiet: bool) -> Model:
    ckpt = open_checkpoint(ckpt_dir, opts.load_format, device, opts.seed)
    try:
        shard = Shard(rank, world, whole_blocks=ops.name == "native")
        return Model(ckpt, ops, dtype, device, shard=shard, num_layers=opts.smoke_layers or None,
                     all_reduce=all_reduce, progress=not quiet, mtp=opts.speculative_tokens > 0,
                     dense_budget=opts.fp8_dense_memory << 20)
    except CheckpointError as e:
        if world > 1 and "tensor-parallel degree" not in str(e):   # e.g. native: an FP8 slice off its blocks
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
    """Rank 0's side of the group: its own RankRunner, the worker processes and their channels. call() runs a
    RankRunner method on every rank; run_batch / logits / copy_state are the engine's calls. close() stops all."""

    POLL_S = 0.2

    def __init__(self, ckpt_dir, opts: EngineOptions, dtype: torch.dtype, kv_dtype: torch.dtype):
        self.opts, self.dtype, self.kv_dtype = opts, dtype, kv_dtype
        self.devices = parse_devices(opts.devices)
        self.world = len(self.devices)
        self.workers: dict[int, subprocess.Popen] = {}
        self.channels: dict[int, Channel] = {}  # rank -> its control channel, once it has proven the secret
        self.reports: dict[int, tuple] = {}     # rank -> its last report: ("ready",) | ("error", type, message)
        self.refused = 0                        # connections closed for lacking the secret
        self.dead_reason: str | None = None     # set once a rank has failed; every later call raises
        self.dead_kind = ""                     # the failed rank's error type, when it reported one
        self.on_death: Callable[[str], None] | None = None   # told the reason (e.g. to mark the LLM dead)
        self.comm: Comm | None = None
        self.model: Model | None = None
        self.runner: RankRunner | None = None
        self._lock = threading.RLock()          # one call at a time (logits() makes several under it)
        self._read_lock = threading.Lock()      # the watcher and the start both read reports
        self._fail_lock = threading.Lock()      # the watcher and a failed call may both end the group
        self._closing = False
        self.secret = os.urandom(32)
        self.rendezvous_dir = Path(tempfile.mkdtemp(prefix="pocketllm-tp-"))   # 0700: this user only
        self.store = dist.FileStore(str(self.rendezvous_dir / "store"), -1)
        self.listener = socket.create_server((RENDEZVOUS_HOST, 0))              # port 0: the OS picks
        self.listener.settimeout(self.POLL_S)
        self.port = self.listener.getsockname()[1]
        self._admitter = threading.Thread(target=self._admit, name="pocketllm-rendezvous", daemon=True)
        atexit.register(self.close)

    # Start: spawn the workers, admit them, load rank 0's shard meanwhile, wait until every rank has loaded.

    def start(self, ckpt_dir):
        device = self.devices[0]
        ops, why = select_ops(self.opts, device)
        _log(self.opts, f"backend: {why}; tensor parallelism over {self.world} ranks ({self.opts.devices})")
        if device.type == "cuda":   # GPU ranks without NCCL are refused, never run without their all-reduce
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")   # one machine: NCCL's bootstrap stays on loopback
            if hasattr(ops, "nccl_unique_id"):
                self.store.set("nccl_id", ops.nccl_unique_id())   # rank 0 makes the id; raises without NCCL
            elif not dist.is_nccl_available():
                raise PocketError(f"--devices {self.opts.devices}: tensor parallelism on GPUs needs NCCL, and this "
                                  f"torch build has none (torch.distributed.is_nccl_available() is False)")
        self._admitter.start()
        for rank in range(1, self.world):
            spec = {"ckpt": str(Path(ckpt_dir).resolve()), "rank": rank, "world": self.world,
                    "device": str(self.devices[rank]), "dtype": str(self.dtype).removeprefix("torch."),
                    "kv_dtype": str(self.kv_dtype).removeprefix("torch."), "port": self.port,
                    "store": str(self.rendezvous_dir / "store"), "parent": os.getpid(), "module": __name__,
                    "options": dict(dataclasses.asdict(self.opts), backend=ops.name)}   # every rank: rank 0's ops
            proc = subprocess.Popen([sys.executable, "-c", _WORKER_BOOT, str(Path(__file__).resolve()),
                                     json.dumps(spec)], stdin=subprocess.PIPE)
            self.workers[rank] = proc
            proc.stdin.write(self.secret.hex().encode() + b"\n")       # the secret, privately
            proc.stdin.close()
        threading.Thread(target=self._watch, name="pocketllm-ranks", daemon=True).start()
        self.model = _load_rank_model(ckpt_dir, self.opts, ops, self.dtype, device, 0, self.world,
                                      lambda x: self.comm.all_reduce(x), self.opts.quiet)
        self.runner = RankRunner(self.model, self.opts, self.kv_dtype, device)
        self._wait_until_loaded()
        self._stop_listening()      # everyone is in
        self.comm = self._connect(ops)

    def _connect(self, ops) -> Comm:
        """Rank 0's Comm, made on a helper thread: a worker that dies before it joins fails the start as soon as
        the watcher sees it, and a hung one at the warm-up bound (the helper is left to give up on its own)."""
        made: list = []
        bound = self.opts.collective_warmup_timeout     # each of gloo's stages has it: bound the whole here
        deadline = time.monotonic() + bound

        def connect():
            try:
                made.append(Comm(self.store, 0, self.world, self.devices[0], ops, self.opts))
            except Exception as e:
                made.append(e)
        helper = threading.Thread(target=connect, name="pocketllm-connect", daemon=True)
        helper.start()
        while helper.is_alive() and self.dead_reason is None and time.monotonic() < deadline:
            helper.join(self.POLL_S)
        if self.dead_reason is None and not made:
            made.append(CollectiveTimeout("connecting to the other ranks", bound, "--collective-warmup-timeout"))
        if self.dead_reason is None and isinstance(made[0], Exception):
            raise self._failed(made[0])
        self._check_alive()
        return made[0]

    def _admit(self):
        """Accept connections on the loopback port until every worker has joined; each handshake runs on its
        own thread, so a connection that never answers cannot hold up the real worker."""
        try:
            while not self._closing and len(self.channels) < self.world - 1:
                try:
                    sock, _ = self.listener.accept()
                except socket.timeout:
                    continue
                threading.Thread(target=self._handshake, args=(sock,), daemon=True).start()
        except OSError:             # _stop_listening shut it down
            pass
        finally:
            self.listener.close()

    def _stop_listening(self):
        """Stop listening now (shutdown also wakes the accept), and let the admitting thread close the socket."""
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:             # already closed
            pass
        if self._admitter.is_alive():
            self._admitter.join(timeout=2.0)
        self.listener.close()

    def _handshake(self, sock: socket.socket):
        joined = admit_worker(sock, self.secret, self.world)
        with self._read_lock:
            if joined is not None and joined[0] not in self.channels and not self._closing:
                self.channels[joined[0]] = joined[1]
                return
            self.refused += 1
        sock.close()
        _log(self.opts, "tensor-parallel rendezvous: refused a connection without the group's secret")

    def _read_reports(self, rank: int):
        """Take what rank has sent so far ("ready", or its error) off its channel."""
        channel = self.channels.get(rank)
        with self._read_lock:
            try:
                while channel is not None and channel.pending():
                    self.reports[rank] = channel.recv()
            except (OSError, ConnectionError, EOFError, pickle.UnpicklingError):
                pass                # the rank is gone; the watcher says how

    def _wait_until_loaded(self):
        """Until every worker says it has loaded; a worker that failed (seen by the watcher) fails the start."""
        pending = set(self.workers)
        while pending:
            if self.dead_reason:
                raise (CheckpointError if self.dead_kind == "CheckpointError" else PocketError)(self.dead_reason)
            for rank in list(pending):
                self._read_reports(rank)
                if self.reports.get(rank) == ("ready",):
                    pending.discard(rank)
            time.sleep(0.05)

    def _rank_error(self, rank: int) -> tuple[str, str]:
        """(error type name, one line naming the rank and what happened to it)."""
        where = f"rank {rank} ({self.devices[rank]})"
        self._read_reports(rank)
        report = self.reports.get(rank, ())
        if report[:1] == ("error",):
            return report[1], f"{where} failed: {report[1]}: {report[2]}"
        code = self.workers[rank].returncode
        if code is not None and code < 0:
            return "", f"{where} was killed by {signal.Signals(-code).name}"
        return "", f"{where} exited with code {code}"

    # Any rank's death ends the group, while loading or serving. In the CLI it ends the program (exit code 2
    # for a checkpoint or option error, as main() gives, else 1); in a library user's process the group is
    # marked dead and every later call raises PocketError naming the rank.

    def _watch(self):
        while not self._closing and self.dead_reason is None:
            for rank, proc in self.workers.items():
                if proc.poll() is not None and not self._closing:
                    self._fail(*self._rank_error(rank))
                    return
            time.sleep(self.POLL_S)

    def _fail(self, kind: str, reason: str):
        """The first failure names the group's end: a hung rank that rank 0 then kills must not be reported
        by the watcher as a rank killed by SIGKILL."""
        with self._fail_lock:
            if self.dead_reason is not None:
                return
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
        """A call raised. A peer's death surfaces as a collective or socket error: wait for the watcher to name
        the rank. Anything else is rank 0's own failure, which also ends the group."""
        if self._closing:                  # close() stopped the workers under a call still in flight
            return PocketError("the tensor-parallel group is closed")
        if isinstance(error, CollectiveTimeout) and self.dead_reason is None:   # hung, not dead: nothing to wait for
            self._fail("", f"rank 0 ({self.devices[0]}): {error}")
        deadline = time.time() + 3.0
        while self.dead_reason is None and time.time() < deadline:
            time.sleep(self.POLL_S)
        if self.dead_reason is None:
            self._fail("", f"rank 0 ({self.devices[0]}) failed: {type(error).__name__}: {error}")
            return error
        return PocketError(f"the tensor-parallel group has stopped: {self.dead_reason}")

    # Calls. Every rank runs the same calls in the same order, so the all-reduces inside forward pair up.

    def call(self, method: str, *args):
        """RankRunner.<method>(*args) on every rank; returns rank 0's result."""
        if not RankRunner.is_call(method):
            raise ValueError(f"RankRunner has no call {method!r}")
        with self._lock:
            self._check_alive()
            try:
                message = _dumps((method, args))                           # encoded once for every worker
                for channel in self.channels.values():
                    channel.send_bytes(message)
                result = getattr(self.runner, method)(*args)
                if method in STEP_CALLS:
                    self.comm.finish_step()
                return result
            except Exception as e:
                raise self._failed(e) from e

    def run_batch(self, batch: Batch, cache: Cache) -> torch.Tensor:
        """One engine step on every rank; `cache` is the engine's, rank 0's engine cache."""
        self.runner.caches[ENGINE_CACHE] = cache
        return self.call("run", batch, ENGINE_CACHE)                        # (R, V): full logits, rank 0 only

    def call_engine(self, cache: Cache, method: str, *args):
        """A RankRunner call on every rank's engine cache (speculative decoding: run, rollback, draft)."""
        self.runner.caches[ENGINE_CACHE] = cache
        return self.call(method, *args)

    def copy_state(self, caches: dict[int, Cache], src: int, dst: int, slots: list[tuple[int, int]],
                   blocks: list[tuple[int, int]]):
        """copy_cache (section 5) on every rank's caches (each copies its own shard of the state and KV);
        `caches` are rank 0's (the engine's). The engine calls this in place of copy_cache when a group runs
        the model."""
        self.runner.caches.update(caches)
        self.call("copy_state", src, dst, slots, blocks)

    def logits(self, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """LLM.logits over the group: every rank runs the prefill chunks on a temporary cache of its own."""
        ids, bs, device = list(token_ids), self.opts.kv_block_size, self.devices[0]
        nblocks = -(-len(ids) // bs)
        with self._lock:
            self.call("set_scratch", nblocks)
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
                    out.append(self.call("run", batch, SCRATCH_CACHE))
            finally:
                if self.dead_reason is None and not self._closing:
                    self.call("set_scratch", 0)
        return torch.cat(out).float().cpu()                                 # (len, V)

    # Shutdown: tell the workers to stop, give them a moment, then make sure.

    def close(self):
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        told = False
        if self.comm is not None and self.dead_reason is None and self._lock.acquire(timeout=2.0):
            try:
                message = _dumps((STOP, ()))
                for channel in self.channels.values():
                    channel.send_bytes(message)
                told = True
            except Exception:       # a worker already gone: the kill below covers it
                pass
            finally:
                self._lock.release()
        self._stop_workers(grace_s=5.0 if told else 0.0)
        self._stop_listening()
        for channel in self.channels.values():
            channel.close()
        shutil.rmtree(self.rendezvous_dir, ignore_errors=True)

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
    kv_cache_blocks(opts)                       # Engine.__init__'s check, before any worker starts
    group = RankGroup(ckpt_dir, opts, dtype, kv_dtype)
    try:
        group.start(ckpt_dir)
    except BaseException:
        group.close()
        raise
    return group


# A worker rank: join with the secret, load the shard, say so, then run rank 0's calls until told to stop.

def _exit_with_parent(parent: int):
    """Rank 0 gone (killed, crashed): this rank has nothing left to do."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def run_rank_worker(spec_json: str) -> int:
    spec = json.loads(spec_json)
    rank, world, parent = spec["rank"], spec["world"], spec["parent"]
    secret = bytes.fromhex(sys.stdin.readline().strip())   # from rank 0's pipe, never the command line
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent,), name="pocketllm-parent", daemon=True).start()
    channel: Channel | None = None
    try:
        channel = join_group(spec["port"], rank, secret, spec["module"])
        opts = EngineOptions(**spec["options"])
        device = torch.device(spec["device"])
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dtype, kv_dtype = getattr(torch, spec["dtype"]), getattr(torch, spec["kv_dtype"])
        comm: list[Comm] = []          # set once every rank has loaded; forward only runs after that
        ops = TorchOps() if opts.backend == "torch" else NativeOps(device)   # rank 0's choice, made there
        model = _load_rank_model(spec["ckpt"], opts, ops, dtype, device, rank, world,
                                 lambda x: comm[0].all_reduce(x), quiet=True)
        runner = RankRunner(model, opts, kv_dtype, device,
                            allocate_cache(model.cfg, model.cache_layers, kv_cache_blocks(opts), opts.kv_block_size,
                                           opts.max_batch_size, kv_dtype, device, model.hidden_dtype),
                            allocate_cache(model.cfg, model.layers, 0, opts.kv_block_size,
                                           snapshot_slots(opts, model.cfg, model.layers, kv_dtype), kv_dtype, device,
                                           model.hidden_dtype))
        channel.send(("ready",))
        comm.append(Comm(dist.FileStore(spec["store"], -1), rank, world, device, ops, opts))
        while True:
            method, args = channel.recv()
            if method == STOP:
                return 0
            if not RankRunner.is_call(method):
                raise PocketError(f"rank 0 called {method!r}, which RankRunner does not have")
            getattr(runner, method)(*_move(args, device))
            if method in STEP_CALLS:
                comm[0].finish_step()
    except Exception as e:
        time.sleep(0.5)             # rank 0 gone too (its sockets close before we are re-parented)? then quietly
        if os.getppid() != parent:
            return 1
        if not isinstance(e, PocketError):
            traceback.print_exc()
        try:
            channel.send(("error", type(e).__name__, str(e)))
        except Exception:           # never joined, or rank 0 gone: stderr and the exit code say it
            print(f"pocketllm: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, PocketError) else 1


# -----------------------------------------------------------------------------------------------
# 9. The engine: requests in, token ids out. step() = schedule, run, postprocess. It never sees text.
#    A fault of one request (its parameters, its logits processor) ends that request with an error event
#    and frees what it holds; anything that escapes step() is the engine's own fault, and the LLM object
#    then fails every request (section 14).
# -----------------------------------------------------------------------------------------------

@dataclass
class EngineEvent:
    """What the engine reports for one choice after a step (token ids only; the text layer decodes)."""
    index: int
    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error"
    stop_reason: int | None = None     # the stop token id that ended the choice
    error: str | None = None           # finish_reason "error": what failed
    fatal: bool = False                # the error is the engine's: every request got it


class RequestFailed(PocketError):
    """One request failed inside the engine (its parameters, its logits processor); the others go on."""

    def __init__(self, request_id: str, message: str):
        super().__init__(f"request {request_id} failed: {message}")
        self.request_id, self.reason = request_id, message


class Request:
    """One submitted prompt with n choices. The engine thread writes events; the client thread reads them."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, default_seed: int):
        self.id, self.prompt_ids, self.params = request_id, list(prompt_ids), params
        self.default_seed = default_seed
        self.sampling: RowParams | None = None   # prepared by the engine on admission
        self.events: queue.Queue = queue.Queue()
        self.seqs: list[Sequence] = []
        self.finished_choices: set[int] = set()
        self.arrival = time.time()
        self.cached_tokens: int | None = None    # prompt tokens resumed from the prefix cache, once admitted
        self.snapshot_at: int | None = None      # a position to snapshot besides the prefix cache's own (section 6)


@dataclass
class InFlight:
    """A decode step launched by async scheduling and not yet read: its plan, its sample rows (one per plan
    entry, in order; a split step's only once sampled, without the sequences that finished meanwhile), what the
    device queue returned, and its packed result on the device (set by its work, read by the next step's work:
    the sampled tokens feed the next input without the host). A split step's forward leaves its logits."""
    plan: list[Scheduled]
    rows: list[SampleRow]
    launched: object = None
    packed: torch.Tensor | None = None        # (N,) int32 on the device: the rows' tokens first
    split: bool = False                       # sampled only once the host has read the step before (_sample)
    logits: torch.Tensor | None = None        # (B, V) a split step's, until it is sampled


class Engine:
    """Continuous batching over a Model. Thread-safe entry points: add(), abort(); step() runs on one thread."""

    def __init__(self, model: Model, opts: EngineOptions, eos_ids: list[int], kv_dtype: torch.dtype,
                 run_batch: Callable | None = None, copy: Callable | None = None, call: Callable | None = None):
        self.model, self.opts, self.eos_ids = model, opts, list(eos_ids)
        bs, num_blocks = opts.kv_block_size, kv_cache_blocks(opts)
        self.blocks, self.slots = BlockPool(num_blocks), SlotPool(opts.max_batch_size)
        self.cache = allocate_cache(model.cfg, model.cache_layers, num_blocks, bs, opts.max_batch_size, kv_dtype,
                                    model.device, model.hidden_dtype)
        snapshots = snapshot_slots(opts, model.cfg, model.layers, kv_dtype)
        self.snapshots = allocate_cache(model.cfg, model.layers, 0, bs, snapshots, kv_dtype, model.device,
                                        model.hidden_dtype)
        self.caches = {ENGINE_CACHE: self.cache, SNAPSHOT_CACHE: self.snapshots}
        self.snapshot_bytes = state_slot_bytes(model.cfg, model.layers, kv_dtype)
        self.prefix = PrefixCache(self.blocks, bs, f"{model.cfg!r} {len(model.layers)} {kv_dtype}", range(snapshots),
                                  bool(self.snapshot_bytes)) if opts.prefix_cache else None
        self.sampler = Sampler(opts.max_batch_size, model.cfg.vocab_size, model.device)
        self.draft_tokens = opts.speculative_tokens if model.mtp is not None else 0   # K (0: no speculation)
        self.scheduler = Scheduler(opts, self.blocks, self.slots, self.prefix, self.draft_tokens)
        self.run_batch = run_batch or (lambda batch: model.forward(batch, self.cache))
        ranked = run_batch is not None            # a rank group runs the model (with call, its RankRunner calls)
        self.overlap = opts.async_scheduling and not ranked and not self.draft_tokens   # async scheduling
        self.device = DeviceQueue(model.device, lambda: model.ops.zeros((1,), torch.float32, model.device))
        self.inflight: InFlight | None = None     # async scheduling: the step launched and not yet read
        self.graphs = DecodeGraphs(model, self.cache, opts.max_batch_size, opts.max_context, bs,
                                   call if ranked else None, graphs=not ranked, sampler=self.sampler) \
            if not opts.enforce_eager and DecodeGraphs.usable(model) else None
        self.copy = copy or (lambda caches, src, dst, slots, blocks:      # with tensor parallelism: every rank's
                             copy_cache(caches[src], caches[dst], model.ops, slots, blocks))
        if call is None:                          # RankRunner calls (speculative decoding), here on these caches
            runner = RankRunner(model, opts, kv_dtype, model.device, self.cache, self.snapshots)
            call = lambda method, *args: getattr(runner, method)(*args)   # noqa: E731
        self.call = call
        self.requests: dict[str, Request] = {}
        self.inbox: queue.Queue = queue.Queue()   # ("add", Request) | ("abort", request_id, index | None)
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "draft_tokens": 0, "accepted_tokens": 0,
                         "target_forwards": 0}   # target_forwards: steps in which a sequence emitted tokens
        self.windowed: set[Sequence] = set()     # the sequences whose end waits (a verify window's rollback, the
                                                 # MTP pass of a speculative step, async scheduling's next read)
        self.held: list[tuple] | None = None      # a speculative step's copies, run after its MTP pass (step)
        self.finishing: list[tuple] = []          # those of them that finished: _end args, run after it

    # Thread-safe entry points: they only post to the inbox, which step() drains.

    def add(self, request: Request):
        self.inbox.put(("add", request))

    def abort(self, request_id: str, index: int | None = None):
        self.inbox.put(("abort", request_id, index))

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting or not self.inbox.empty() or self.inflight)

    # The step.

    def step(self) -> None:
        self._drain_inbox()
        if self.inflight is not None:               # async scheduling: launch the next decode, then read this one
            follow = self._follow_up(self.inflight)
            launched = self._launch(follow, self.inflight) if follow else None
            self._settle(self.inflight, launched)
            if launched is not None and launched.split:
                self._sample(launched)
            self.inflight = launched
            if launched is not None:
                return
            self.device.drain()                     # the copies queued behind it ran: the host's turn
        plan = self.scheduler.schedule()
        self._run_copies()
        if not plan:
            return
        if self._overlaps(plan):
            self.inflight = self._launch(plan)
            self.windowed = {p.seq for p in plan}
            return
        if not self.draft_tokens:                   # graphs replay plain decode steps (not verify windows)
            out = self.graphs.run(plan, self.slots.free, self._step_rows(plan)) if self.graphs else None
            if out is None:
                out = self.run_batch(make_batch(plan, self.opts.kv_block_size, self.model.device)), None
            self._postprocess(plan, *out)          # (B, V) logits, or the graph's (B,) tokens and failed rows
            return
        batch = make_batch(plan, self.opts.kv_block_size, self.model.device)
        window = self._window(plan)
        # Until the MTP layer has written its KV for the step's kept positions (_draft), the sequences that
        # finish keep what they hold and the copies of blocks and slots wait (forks, snapshots): both would
        # otherwise keep or copy blocks without the MTP layer's KV of this step.
        self.windowed, self.held = {p.seq for p in plan}, []
        kept = self._postprocess(plan, self.call("run", batch, ENGINE_CACHE, window))   # (R, V) logits
        if window is not None:
            self.call("rollback", [k for p, k in zip(plan, kept) if p.drafts])
        self._draft(plan, kept)
        held, self.held = self.held, None
        for copy in held:
            self._copy(*copy)
        self._close_window()

    # Async scheduling (--async-scheduling): while decode step N runs, step N + 1 is planned as if every
    # sequence goes on (its token is N's, still on the device, gathered there into N + 1's input) and launched;
    # only then does the host read N's tokens once and postprocess them (events, stops, finishes). A sequence
    # that finished at N is in N + 1 too: N + 1 computes its last token (KV in its reserved blocks, its state
    # slot advanced past it, so its end snapshot covers every token) and its N + 1 token is dropped; its slot and
    # blocks are freed once N + 1 is read (self.windowed and self.finishing, as for a verify window).
    # A step with a row whose logits processor reads the last token on the host (a grammar's mask: tools,
    # response_format) is split, as vLLM does for structured output: N + 1's forward is launched at once, and its
    # sampling once the host has read N and built N + 1's masks (_sample), so the grammar's work overlaps the
    # forward; a sequence that finished at N gets no row.

    def _overlaps(self, plan: list[Scheduled]) -> bool:
        """A step async scheduling may launch: plain decode of every running sequence."""
        return self.overlap and {p.seq for p in plan} == set(self.scheduler.running) and all(
            p.count == 1 and p.sample and p.start > 0 and p.seq.output_ids for p in plan)

    @staticmethod
    def _reads_ids(seq: Sequence) -> bool:
        """Its logits processors read the last token on the host, unless one says it does not (`reads_ids` false:
        the call-token ban of a chat request without tools)."""
        return any(getattr(proc, "reads_ids", True) for proc in seq.params.logits_processors)

    def _follow_up(self, prev: InFlight) -> list[Scheduled] | None:
        """Step N + 1's plan while step N is in flight: every sequence of N that is neither finished nor known to
        end with N's token (max_tokens); None when the engine must read N first: a waiting sequence could be
        admitted, or the blocks for N + 1 would need a preemption."""
        s = self.scheduler
        if s.waiting and len(s.running) < self.opts.max_batch_size and self.slots.free:
            return None
        plan = [Scheduled(p.seq, p.start + 1, 1, True) for p in prev.plan
                if not p.seq.finished and len(p.seq.output_ids) + 1 < p.seq.params.max_tokens]
        if not plan or sum(s.blocks_short(p.seq, p.start + 1) for p in plan) > self.blocks.available:
            return None
        for p in plan:
            s.extend(p.seq, p.start + 1)
        return plan

    def _launch(self, plan: list[Scheduled], prev: InFlight | None = None) -> InFlight:
        """Queue a decode step's forward and sampling on the device; prev: the step in flight whose tokens are
        this step's input (gathered on the device). Everything the work reads from the host is taken here. A
        split step (see above) queues only its forward."""
        unread = int(prev is not None)
        flight, device = InFlight(plan, []), self.model.device
        flight.split = prev is not None and any(self._reads_ids(p.seq) for p in plan)
        if not flight.split:
            flight.rows = [SampleRow(p.seq, i, p.seq.request.sampling, unread=unread) for i, p in enumerate(plan)]
            self.counters["target_forwards"] += len(plan)
        if prev is not None:
            row_of = {r.seq: i for i, r in enumerate(prev.rows)}
            where = to_device(torch.tensor([row_of[p.seq] for p in plan], dtype=torch.long), device)   # (B,)
        packed = self.graphs.pack(plan, list(self.slots.free), bool(unread), flight.rows) if self.graphs else None
        batch = None if packed else make_batch(plan, self.opts.kv_block_size, device, bool(unread))

        def forward() -> tuple[torch.Tensor, dict | None]:
            """((B, V) logits, None), or the graph's ((B,) sampled tokens, the rows whose mask raised)."""
            ids = None if prev is None else prev.packed[where].long()                   # (B,) int64
            if packed is not None:
                return self.graphs.replay(packed, ids)
            if ids is not None:
                batch.token_ids.copy_(ids)
            return self.run_batch(batch), None

        def work() -> tuple[torch.Tensor, dict]:
            out, failed = forward()
            if failed is None:
                flight.packed, failed = self.sampler.sample_on_device(flight.rows, out)
            else:                                   # the graph's static output: the next replay writes over it
                flight.packed = out.clone()
            return flight.packed, failed
        if flight.split:
            self.device.run(lambda: setattr(flight, "logits", forward()[0]))
        else:
            flight.launched = self.device.launch(work)
        return flight

    def _sample(self, flight: InFlight):
        """The second half of a split step, once the step before it is read: its rows (the sequences that did not
        finish meanwhile), their masks built here on the host while the forward runs, then the sampling queued
        behind the forward."""
        flight.rows = [SampleRow(p.seq, i, p.seq.request.sampling) for i, p in enumerate(flight.plan)
                       if not p.seq.finished]
        self.counters["target_forwards"] += len(flight.rows)
        masks = self.sampler.token_masks(flight.rows, self.model.cfg.vocab_size) if flight.rows else None

        def work() -> tuple[torch.Tensor, dict]:
            if not flight.rows:
                return torch.zeros(0, dtype=torch.int32, device=self.model.device), {}
            flight.packed, failed = self.sampler.sample_on_device(flight.rows, flight.logits, masks)
            flight.logits = None
            return flight.packed, failed
        flight.launched = self.device.launch(work)

    def _settle(self, flight: InFlight, launched: InFlight | None):
        """Read a launched step's tokens and postprocess them while `launched` (its follow-up, if any) runs. The
        sequences that finished while `flight` ran end now; those of `launched`, once it is read."""
        packed, failed = self.device.read(flight.launched)
        self.counters["target_forwards"] -= sum(r.seq.finished for r in flight.rows)   # their tokens are dropped
        ready, self.finishing = self.finishing, []
        self.windowed = set() if launched is None else {p.seq for p in launched.plan}
        self._advance(flight.plan)
        self._apply(flight.plan, flight.rows, self.sampler.unpack(flight.rows, packed, failed))
        for ending in ready:
            self._end(*ending)

    # Speculative decoding (--speculative-tokens K): a decoding sequence's step verifies its last token and K
    # drafts in one window; _postprocess keeps the accepted drafts and one token from the target; rollback
    # drops the rejected positions from the GDN states (their KV is overwritten later); then the MTP layer
    # catches up on the step's kept positions and drafts K tokens for the next step.

    def _window(self, plan: list[Scheduled]) -> VerifyWindow | None:
        rows, start = [], 0
        for p in plan:
            if p.drafts:
                rows += range(start, start + p.count)
            start += p.count
        if not rows or not self.model.cfg.num_linear_layers:
            return None
        t = lambda v: torch.tensor(v, dtype=torch.long).to(self.model.device)   # noqa: E731
        return VerifyWindow(t([p.seq.slot for p in plan if p.drafts]), t(rows), [p.count for p in plan if p.drafts])

    def _close_window(self) -> None:
        """After the rollback and the MTP pass: the sequences that finished in the step take their
        end-of-generation snapshot from the rolled-back state (the state after their kept tokens) and free what
        they hold."""
        finishing, self.finishing, self.windowed = self.finishing, [], set()
        for ending in finishing:
            self._end(*ending)

    def _draft(self, plan: list[Scheduled], kept: list[int]) -> None:
        """The MTP layer over every kept position of the step (its KV, and the first draft), then K - 1 chained
        passes of one token per drafting sequence."""
        entries, rows, drafting, start, carried = [], [], [], 0, False
        T = sum(p.count for p in plan)                                     # rows of the step's hidden states
        for b, (p, n) in enumerate(zip(plan, kept)):
            seq = p.seq
            if seq.slot is not None:         # (one that finished holds its blocks till this pass: its KV too)
                # A resumed or forked sequence's first pass starts one position early: the MTP layer's KV there
                # read the token after it, which this sequence may not share; its hidden row is the slot's.
                first, seq.mtp_from = (p.start if seq.mtp_from is None else seq.mtp_from), None
                entries.append((seq, first, seq.tokens[first + 1:p.start + n + 1]))
                rows += [T + b] * (p.start - first) + list(range(start, start + n))
                carried |= first < p.start
                k = min(self.draft_tokens, seq.params.max_tokens - len(seq.output_ids) - 1)
                if p.sample and k > 0 and not seq.finished:
                    drafting.append((len(entries) - 1, seq, k))
            start += p.count
        if not entries:
            return
        bs, device = self.opts.kv_block_size, self.model.device
        t = lambda v: torch.tensor(v, dtype=torch.long).to(device)   # noqa: E731
        logits = self.call("draft", make_draft_batch(entries, bs, device), t(rows), False, carried)   # (E, V)
        row_of = {seq: e for e, seq, _ in drafting}                        # seq -> its row of the last pass
        probs: dict[Sequence, list] = {}
        for i in range(self.draft_tokens):
            drafting = [d for d in drafting if d[2] > i]
            if not drafting:
                break
            if i:                                                          # draft i + 1 from draft i
                batch = make_draft_batch([(seq, seq.num_computed + i - 1, seq.drafts[-1:]) for _, seq, _ in drafting],
                                         bs, device)
                logits = self.call("draft", batch, t([row_of[seq] for _, seq, _ in drafting]), True)
                row_of = {seq: j for j, (_, seq, _) in enumerate(drafting)}
            rows = [SampleRow(seq, row_of[seq], seq.request.sampling, list(seq.drafts)) for _, seq, _ in drafting]
            tokens, q = self.sampler.draw_drafts(rows, logits)
            for j, ((_, seq, _), tok) in enumerate(zip(drafting, tokens)):
                seq.drafts.append(tok)
                probs.setdefault(seq, []).append(q[j])
        for seq, q in probs.items():
            seq.draft_probs = torch.stack(q) if seq.request.sampling.temperature > 0 else None

    def _run_copies(self):
        """The copies the admissions asked for (snapshots restored, partial blocks copied), before the forward."""
        copies = self.scheduler.copies
        self._copy(SNAPSHOT_CACHE, ENGINE_CACHE, copies.slots, [])
        self._copy(ENGINE_CACHE, ENGINE_CACHE, [], copies.blocks)
        self.blocks.release(copies.pinned)
        self.scheduler.copies = CacheCopies()

    def _drain_inbox(self):
        while True:
            try:
                msg = self.inbox.get_nowait()
            except queue.Empty:
                return
            if msg[0] == "add":
                self._admit(msg[1])
            elif msg[1] in self.requests:
                for seq in list(self.requests[msg[1]].seqs):
                    if msg[2] is None or seq.index == msg[2]:
                        self._finish(seq, "abort")

    def _admit(self, req: Request):
        self.requests[req.id] = req
        req.seqs = [Sequence(req, 0)]
        self.counters["prompt_tokens"] += len(req.prompt_ids)
        try:
            req.sampling = prepare_row_params(req.params, self.eos_ids, self.model.cfg.vocab_size)
        except Exception as e:
            self.fail_request(req, "its sampling parameters", e)
            return
        self.scheduler.add(req.seqs[0])

    def _postprocess(self, plan: list[Scheduled], logits: torch.Tensor, failed: dict | None = None) -> list[int]:
        """Sample every sequence whose chunk reached its end (and the first token of forked choices) at once. A
        verify window's rows judge its drafts in order: the accepted ones are emitted, then the target's token
        at the first rejection (or after the last draft). Returns, per plan entry, its tokens that stay
        computed: the chunk, or the window's last token and accepted drafts. With `failed` (a dict) the rows
        were sampled inside the step's graph (_step_rows): `logits` is their packed tokens."""
        self._advance(plan)
        rows = self._rows(plan)
        if not rows:
            return [p.count for p in plan]
        self.device.reads += 1                    # the sampler's one read
        out = self.sampler.sample(rows, logits) if failed is None else self.sampler.unpack(rows, logits.cpu(), failed)
        return self._apply(plan, rows, out)

    @staticmethod
    def _step_rows(plan: list[Scheduled]) -> list[SampleRow] | None:
        """A decode step's sample rows made before its launch, for the sampler inside the step's graph: one per
        plan entry, as _rows will make them; None when _rows makes others (a window, a fork, a finished one)."""
        if all(p.sample and p.seq.output_ids and not p.drafts and not p.seq.finished for p in plan):
            return [SampleRow(p.seq, i, p.seq.request.sampling) for i, p in enumerate(plan)]
        return None

    def _advance(self, plan: list[Scheduled]):
        """The plan's tokens are computed: count them, and file the blocks they filled with the prefix cache."""
        for p in plan:
            p.seq.num_computed += p.count
            if self.prefix is not None and p.seq.slot is not None and not p.drafts:   # windows: once judged
                self._cache_prefix(p)             # (finished and holding its blocks: its end is deferred)

    def _rows(self, plan: list[Scheduled]) -> list[SampleRow]:
        """The rows to sample: every sequence whose chunk reached its end, forked choices' first tokens, and a
        verify window's rows."""
        rows, first = [], 0
        for p in plan:
            seq, r = p.seq, first
            first += 1 + len(p.drafts)
            if not p.sample or seq.finished:
                continue
            if not seq.output_ids and seq.request.params.n > 1 and len(seq.request.seqs) == 1:
                children = self._fork(seq)
                rows += [SampleRow(child, r, child.request.sampling) for child in children]
                self.counters["target_forwards"] += len(children)
            probs = seq.draft_probs
            rows += [SampleRow(seq, r + i, seq.request.sampling, p.drafts[:i], d, None if probs is None else probs[i])
                     for i, d in enumerate(p.drafts)]
            rows.append(SampleRow(seq, r + len(p.drafts), seq.request.sampling, list(p.drafts)))
            seq.drafts, seq.draft_probs = [], None
            self.counters["target_forwards"] += 1
            self.counters["draft_tokens"] += len(p.drafts)
        return rows

    def _apply(self, plan: list[Scheduled], rows: list[SampleRow], out: SampleResult) -> list[int]:
        """The sampled tokens to their sequences (a finished one's is dropped); returns _postprocess's kept."""
        kept = [p.count for p in plan]
        for i, error in out.failed.items():
            self.fail_request(rows[i].seq.request, "its logits processor", error)
        rejected = set()                                   # sequences whose window met a rejection
        for i, (row, token, logprobs) in enumerate(zip(rows, out.tokens, out.logprobs)):
            if row.seq.finished or row.seq in rejected:
                continue
            self._append(row.seq, token, logprobs)
            if row.draft is not None:
                self.counters["accepted_tokens"] += out.accepted[i]
                if not out.accepted[i]:
                    rejected.add(row.seq)
        for j, p in enumerate(plan):
            if p.drafts:                                   # its drafts that were not emitted are not computed
                kept[j] = len(p.seq.output_ids) - (p.start - len(p.seq.request.prompt_ids)) - 1
                p.seq.num_computed = p.start + kept[j]
                if self.prefix is not None and (not p.seq.finished or p.seq in self.windowed):   # its blocks (held
                    self._cache_prefix(p, snapshot=False)   # till the rollback); no snapshot: the state is rolled back
        return kept

    # The prefix cache (section 5): full blocks get their keys as they fill; snapshots at the end of a prompt,
    # where a prefill chunk ends on a block boundary, and at the end of a generation (_finish).

    def _cache_prefix(self, p: Scheduled, snapshot: bool = True):
        seq, bs = p.seq, self.opts.kv_block_size
        end = seq.num_computed
        if end // bs > p.start // bs:        # blocks filled this step (a decode fills one every bs steps)
            keys = self.prefix.block_keys(seq.tokens[:end // bs * bs], seq.block_keys)
            for j in range(p.start // bs, end // bs):
                self.blocks.register(seq.blocks[j], keys[j])
        prompt, hint = len(seq.request.prompt_ids), seq.request.snapshot_at
        if snapshot and (end in (prompt, hint) or (p.count > 1 and end % bs == 0)):
            # Filed as most recently used: a chat prompt's last message (its next turn resumes there, or at the
            # end of the generation), else a prompt's last block boundary and end; the others go first.
            self._snapshot(seq, keep=end == hint if hint is not None else end >= (prompt - 1) // bs * bs)

    def _snapshot(self, seq: Sequence, keep: bool = True):
        """Snapshot seq's state (and partial last block) at seq.num_computed, unless the cache has it."""
        snap = self.prefix.add(seq.tokens, seq.num_computed, seq.block_keys, keep)
        if snap is None:
            return
        blocks, copy = [], None
        if snap.tail:                        # the partial block: a copy the cache owns (cached, evictable)
            copy = self.blocks.alloc()
            if copy is None:
                self.prefix.forget(snap.key)
                return
            blocks = [(seq.blocks[snap.position // self.opts.kv_block_size], copy)]
        self._copy(ENGINE_CACHE, SNAPSHOT_CACHE, [] if snap.slot is None else [(seq.slot, snap.slot)], [])
        self._copy(ENGINE_CACHE, ENGINE_CACHE, [], blocks)
        if copy is not None:
            self.blocks.register(copy, snap.key)
            self.blocks.release([copy])

    def _copy(self, src: int, dst: int, slots: list[tuple[int, int]], blocks: list[tuple[int, int]]):
        if self.held is not None:            # a speculative step's, after its MTP pass (step)
            self.held.append((src, dst, slots, blocks))
        elif slots or blocks:                # behind the steps in flight (async scheduling), which may write them
            self.device.later(lambda: self.copy(self.caches, src, dst, slots, blocks))

    def _append(self, seq: Sequence, tok: int, logprobs: tuple | None):
        params = seq.params
        seq.output_ids.append(tok)
        self.counters["generation_tokens"] += 1
        reason, stop = None, None
        if tok in params.stop_token_ids or (not params.ignore_eos and tok in self.eos_ids):
            reason, stop = "stop", tok
        elif len(seq.output_ids) >= params.max_tokens:
            reason = "length"
        seq.request.events.put(EngineEvent(seq.index, [tok], None if logprobs is None else [logprobs]))
        if reason:
            self._finish(seq, reason, stop)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """n > 1: the prompt was prefilled once; each extra choice shares its full KV blocks, copies the last
        partial block and the recurrent state, and samples its own first token from the same logits (the
        choices returned). Without a free slot or block a choice is recomputed from the prompt instead. With
        speculation the last computed position's block is copied even when full (and the blocks reserved past
        it for the drafts), and so is every block from a resumed parent's own pending MTP rewrite: _draft
        writes the MTP layer's KV there for each choice."""
        req, bs, ready = parent.request, self.opts.kv_block_size, []
        last = (parent.num_computed - 1) // bs            # the block of the last computed position
        own = last if parent.num_computed % bs or self.draft_tokens else len(parent.blocks)
        if parent.mtp_from is not None:
            own = min(own, parent.mtp_from // bs)          # blocks [own:) are copied, the others shared
        for i in range(1, req.params.n):
            child = Sequence(req, i)
            req.seqs.append(child)
            slot = self.slots.alloc() if len(self.scheduler.running) < self.opts.max_batch_size else None
            fresh = [self.blocks.alloc() for _ in parent.blocks[own:]] if slot is not None else []
            if slot is None or None in fresh:
                if slot is not None:
                    self.slots.release(slot)
                self.blocks.release([b for b in fresh if b is not None])
                self.scheduler.waiting.insert(0, child)   # recomputes the prompt, then samples
                continue
            child.blocks = [self.blocks.share(b) for b in parent.blocks[:own]] + fresh
            self._copy(ENGINE_CACHE, ENGINE_CACHE, [(parent.slot, slot)], list(zip(parent.blocks[own:], fresh)))
            child.slot, child.num_computed = slot, parent.num_computed
            child.mtp_from = parent.num_computed - 1 if self.draft_tokens else None
            child.block_keys = parent.block_keys[:own]
            self.scheduler.running.append(child)
            ready.append(child)
        return ready

    def _finish(self, seq: Sequence, reason: str, stop: int | None = None, error: str | None = None,
                fatal: bool = False):
        if seq.finished:
            return
        seq.finished = True
        if seq in self.windowed:             # its state and MTP KV are complete only after the step (step)
            self.finishing.append((seq, reason, stop, error, fatal))
        else:
            self._end(seq, reason, stop, error, fatal)

    def _end(self, seq: Sequence, reason: str, stop: int | None, error: str | None, fatal: bool):
        """Free what a finished sequence holds, then tell its request: whoever sees the end sees it freed."""
        self._release(seq, reason)
        req = seq.request
        req.finished_choices.add(seq.index)
        req.events.put(EngineEvent(seq.index, [], None, reason, stop, error, fatal))
        if reason in ("abort", "error"):   # choices not yet forked will never run
            for i in range(len(req.seqs), req.params.n):
                if i not in req.finished_choices:
                    req.finished_choices.add(i)
                    req.events.put(EngineEvent(i, [], None, reason, None, error, fatal))
        if len(req.finished_choices) == req.params.n:
            self.requests.pop(req.id, None)

    def _release(self, seq: Sequence, reason: str):
        """Free a finished sequence's blocks and slot; a completed generation first leaves its snapshot: a
        follow-up turn may resume there."""
        if self.prefix is not None and reason in ("stop", "length") and seq.slot is not None:
            self._snapshot(seq)
        self.scheduler.release(seq)

    # Failures: one request's, or the engine's.

    def fail_request(self, req: Request, stage: str, error: Exception):
        """End one request with an error (logged with its traceback) and free its blocks and slots."""
        print(f"pocketllm: request {req.id} failed in {stage}:", file=sys.stderr)
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
        message = f"{stage} raised {type(error).__name__}: {error}"
        for seq in list(req.seqs):
            self._finish(seq, "error", error=message)

    def fail_all(self, reason: str):
        """The engine cannot go on: every request, those still in the inbox included, ends with `reason`.
        Called once the engine thread has stopped stepping."""
        for seq, *_ in self.finishing:       # a step that failed inside a window: no snapshot of that state
            seq.finished = False             # so the loop below ends it with the failure and frees it
        self.finishing, self.windowed, self.inflight, self.held = [], set(), None, None   # (held copies: dropped)
        self.device.close()
        self._drain_inbox()
        for req in list(self.requests.values()):
            for seq in list(req.seqs):
                self._finish(seq, "error", error=reason, fatal=True)

    def stats(self) -> dict:
        s = self.scheduler
        return {"running": len(s.running), "waiting": len(s.waiting), "kv_blocks_used": self.blocks.used,
                "kv_blocks_total": self.blocks.total, "slots_used": self.slots.used, "slots_total": self.slots.total,
                "prompt_tokens_total": self.counters["prompt_tokens"],
                "generation_tokens_total": self.counters["generation_tokens"],
                "speculative_tokens": self.draft_tokens, "draft_tokens_total": self.counters["draft_tokens"],
                "accepted_tokens_total": self.counters["accepted_tokens"],
                "target_forwards_total": self.counters["target_forwards"], **self.prefix_stats()}

    def prefix_stats(self) -> dict:
        """The prefix cache's figures for stats() and /metrics (zeros when it is off)."""
        pc = self.prefix
        counters = pc.counters if pc else {"queried_tokens": 0, "hit_tokens": 0, "snapshot_evictions": 0}
        used = pc.snapshots_used if pc else 0
        return {"prefix_cache_queried_tokens_total": counters["queried_tokens"],
                "prefix_cache_hit_tokens_total": counters["hit_tokens"],
                "prefix_cache_snapshots": used, "prefix_cache_snapshot_bytes": used * self.snapshot_bytes,
                "prefix_cache_evictions_total": counters["snapshot_evictions"] + self.blocks.evictions,
                "kv_blocks_cached": len(self.blocks.cached)}


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


_BYTE_DECODER = _byte_decoder()


def byte_level_tokenizer_json() -> str:
    """The built-in tokenizer of --load-format dummy on a directory without tokenizer.json: byte-level, one token
    per byte (id = the byte's value), then <|endoftext|>, <|im_start|>, <|im_end|> as 256-258; larger ids are
    the model's and decode to nothing."""
    import tokenizers
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab={c: b for c, b in _BYTE_DECODER.items()}, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return tok.to_str()


class Tokenizer:
    """tokenizer.json (+ tokenizer_config.json, chat_template.jinja) of a checkpoint; with `builtin` and no
    tokenizer.json, the byte-level byte_level_tokenizer_json (--load-format dummy)."""

    def __init__(self, ckpt_dir: str | os.PathLike, builtin: bool = False):
        import tokenizers
        path = Path(ckpt_dir) / "tokenizer.json"
        if not path.exists() and not builtin:
            raise CheckpointError(f"{path}: file not found")
        try:
            text = path.read_text(encoding="utf-8") if path.exists() else byte_level_tokenizer_json()
            self._tok = tokenizers.Tokenizer.from_str(text)
            spec = json.loads(text)
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
        self._plain = tokenizers.Tokenizer.from_str(text)              # spells control tokens as text
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
                if ev.fatal:
                    raise PocketError(f"the engine failed: {ev.error}")
                raise RequestFailed(self.request_id, ev.error)
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


# -----------------------------------------------------------------------------------------------
# 10b. Tool calls in text: the tools a request offers (checked once, by tool_functions), how argument
#      values are read by their schema types, and one class per format a model writes calls in
#      (TOOL_FORMATS). The chat templates below detect their format; the scanner in section 11 reads it.
# -----------------------------------------------------------------------------------------------

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_CALL_OPEN, _CALL_CLOSE = "<tool_call>", "</tool_call>"   # the wrapper of both formats below
_MAX_NAME = 256                       # a "name" longer than this is prose, not markup
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
    """Where an unfinished marker may begin at the end of text (len(text) if none)."""
    for i in range(max(start, len(text) - max(map(len, markers)) + 1), len(text)):
        if any(_is_partial(text, i, marker) for marker in markers):
            return i
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


_KIND_ORDER = ("object", "array", "integer", "number", "boolean", "null", "string")   # an open schema's kinds


def _local_ref(root, ref):
    """The schema a local $ref (#, #/$defs/Name, ...) points to in `root`; None if it points nowhere."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    target = root
    for part in ref[2:].split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, list) and part.isdigit() and int(part) < len(target):
            target = target[int(part)]
        elif isinstance(target, dict) and part in target:
            target = target[part]
        else:
            return None
    return target


def _meet(kinds: list[str] | None, other: list[str] | None) -> list[str] | None:
    """The kinds both lists accept (None: any), integer within number."""
    if kinds is None or other is None:
        return other if kinds is None else kinds
    both = [k for k in kinds if k in other or k == "integer" and "number" in other]
    return both + (["integer"] if "number" in kinds and "integer" in other and "integer" not in both else [])


def _schema_kinds(schema, root, depth: int = 0) -> list[str] | None:
    """The JSON types a schema admits, in the order a reader tries them (None: any). $ref resolved in root,
    allOf intersected, anyOf / oneOf joined in branch order, type lists, enum / const values, nullable (null
    last), and the types the structured-output compiler infers from keywords (properties -> object, ...)."""
    if schema is True or not isinstance(schema, dict) or depth > 16:
        return None
    kinds = None
    if "$ref" in schema:
        kinds = _schema_kinds(_local_ref(root, schema["$ref"]), root, depth + 1)
    for part in schema.get("allOf") if isinstance(schema.get("allOf"), list) else []:
        kinds = _meet(kinds, _schema_kinds(part, root, depth + 1))
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            found = [_schema_kinds(sub, root, depth + 1) for sub in schema[key]]
            joined = [k for sub in found for k in (_KIND_ORDER if sub is None else sub)]
            kinds = _meet(kinds, list(dict.fromkeys(joined)))
    kind, own = schema.get("type"), None
    if isinstance(kind, (str, list)):
        own = [kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)]
    if isinstance(schema.get("enum"), list) or "const" in schema:
        own = _meet(own, [_json_type_name(v) for v in ([schema["const"]] if "const" in schema else schema["enum"])])
    elif own is None:
        keys = set(schema)
        own = ["object"] if {"properties", "additionalProperties", "required"} & keys else \
            ["array"] if {"items", "prefixItems", "minItems", "maxItems"} & keys else \
            ["string"] if {"minLength", "maxLength", "pattern"} & keys else \
            ["number"] if {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & keys else None
    kinds = _meet(kinds, own)
    if kinds is not None and schema.get("nullable") is True and "null" not in kinds:
        kinds = [*kinds, "null"]
    return None if kinds is None else list(dict.fromkeys(kinds))


def _schema_types(schema, root=None) -> list[str]:
    """The JSON-schema types a parameter accepts, in the order to try them ([]: any), `root` (the function's
    parameters) holding what its $refs point to. The parser reads a Qwen XML value by these types and the
    structured-output decoder writes only values that read back as themselves (_xml_value_node)."""
    return _schema_kinds(schema, schema if root is None else root) or []


@dataclass
class ToolFunction:
    """One function a request offers, as tool_functions() checked and normalised it."""
    name: str
    properties: dict                   # parameter name -> its JSON schema (an object, or true/false)
    required: list[str]                # required parameters: in schema order, then any required ones not described
    parameters: dict = field(default_factory=dict)   # the whole parameters schema (what $refs point into)


TOOL_KEYS = ("type", "function")
FUNCTION_KEYS = ("name", "description", "parameters", "strict")


def _only_keys(obj: dict, known: tuple, where: str) -> None:
    for key in obj:
        if key not in known:
            raise RequestError(f"'{where}.{key}' is not supported", param=f"{where}.{key}")


def _tool_function(name: str, parameters, where: str) -> ToolFunction:
    """A function's `parameters` schema: `properties` an object of schemas, `required` an array of names."""
    parameters = {} if parameters is None else _check_type(parameters, dict, where)
    properties = parameters.get("properties")
    properties = {} if properties is None else _check_type(properties, dict, f"{where}.properties")
    for key, schema in properties.items():
        if not isinstance(schema, (dict, bool)):
            raise RequestError(f"'{where}.properties.{key}' must be a JSON schema (an object), got "
                               f"{_json_type(schema)}", param=f"{where}.properties.{key}")
    required = parameters.get("required")
    required = [] if required is None else _check_type(required, list, f"{where}.required")
    for j, item in enumerate(required):
        _check_type(item, str, f"{where}.required[{j}]")
    ordered = [p for p in properties if p in required] + [p for p in required if p not in properties]
    return ToolFunction(name, properties, list(dict.fromkeys(ordered)), parameters)


def tool_functions(tools) -> dict[str, ToolFunction]:
    """The one walk over a request's `tools`: every tool checked (a RequestError naming the path, such as
    `tools[0].function.parameters.required`) and normalised. name -> ToolFunction, in the request's order."""
    functions = {}
    for i, tool in enumerate([] if tools is None else _check_type(tools, list, "tools")):
        where = f"tools[{i}]"
        tool = _check_type(tool, dict, where)
        if tool.get("type") != "function":
            raise RequestError(f"'{where}.type' must be \"function\" (only function tools are supported)",
                               param=f"{where}.type")
        function = _check_type(tool.get("function"), dict, f"{where}.function")
        _only_keys(tool, TOOL_KEYS, where)
        _only_keys(function, FUNCTION_KEYS, f"{where}.function")
        name = _check_type(function.get("name"), str, f"{where}.function.name")
        if not name or name in functions:
            raise RequestError(f"'{where}.function.name' must be a unique non-empty name",
                               param=f"{where}.function.name")
        for key, kind in (("description", str), ("strict", bool)):
            if function.get(key) is not None:
                _check_type(function[key], kind, f"{where}.function.{key}")
        functions[name] = _tool_function(name, function.get("parameters"), f"{where}.function.parameters")
    return functions


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


# Tool-call formats: one class per way a model writes a call, holding everything about it. The scanner below
# and the structured-output grammar only call these classes; TOOL_FORMATS names them (the tool_parser values).

class ToolCallFormat:
    """A tool-call format, and the parts shared by formats wrapped in <tool_call> ... </tool_call>.

    Reading: the scanner stops in prose at `call_open` (and, for the request's own format, at `bare_opens`) and
    asks `header()` whether a call starts there. The call's body is then read by `scan()`, which calls the
    method `_<mode>(scan, text, final)` for the scanner's mode: each commits what it has fully understood
    (advancing scan.pos, adding to scan.calls[-1]) and returns True, or returns False to wait for more text.
    Writing (structured output, section 11b): a call is `call_head(lead, name)`, then per argument
    `param_open(key, first)`, the value (raw text for a string parameter unless `json_values`, else JSON) and
    `value_close`, then `call_tail`. The grammar of calls is built from these pieces alone, so a new format
    needs nothing more; in auto mode a call opens at `call_open` or a bare opener found in `call_head`.
    Detection: `renders_call` / `in_template` recognise the format in a chat template's output / source.
    """

    name = ""                          # the tool_parser value (ChatOutputParser, --tool-parser)
    call_open, call_close = _CALL_OPEN, _CALL_CLOSE   # the wrapper around a call ("": none)
    bare_opens: tuple[str, ...] = ()   # prose markers that open a call with no call_open (header gets bare=True)
    json_values = False                # values are JSON texts, else raw text for string parameters
    value_close = ""                   # ends each value ("": the next separator ends it)
    call_tail = ""                     # ends a call, after its last argument

    # Reading

    def header(self, text: str, at: int, final: bool, schemas: dict, bare: bool):
        """(end, name, mode) for a call header at `at` (just after call_open and whitespace, or at a bare
        opener), None while more text could still make it one, False if it is not one of this format."""
        raise NotImplementedError

    def scan(self, scan: "_OutputScan", text: str, final: bool) -> bool:
        return getattr(self, "_" + scan.mode)(scan, text, final)

    def _call_end(self, scan, text, final):
        """After the call's body: the closing tag, if it comes."""
        j = _skip_ws(text, scan.pos)
        if text.startswith(self.call_close, j):
            scan.pos, scan.mode = j + len(self.call_close), "text"
            return True
        if j == len(text) or not final and _is_partial(text, j, self.call_close):
            return False
        scan.mode = "text"                                      # the closing tag is missing
        return True

    def _junk(self, scan, text, final):
        """After a malformed body: drop text up to the closing tag."""
        end = text.find(self.call_close, scan.pos)
        if end != -1:
            scan.pos, scan.mode = end + len(self.call_close), "text"
            return True
        scan.pos = len(text) if final else _held_start(text, scan.pos, (self.call_close,))
        return False

    # Writing (tool_choice)

    def call_head(self, lead: str, name: str) -> str:
        """The text of a forced call up to its first argument; `lead` is what comes before call_open."""
        raise NotImplementedError

    def param_open(self, key: str, first: bool) -> str:
        """The text before an argument's value (`first`: the call's first argument)."""
        raise NotImplementedError

    # Detection

    def renders_call(self, text: str, name: str) -> bool:
        """Whether a rendered conversation shows a call to `name` in this format."""
        raise NotImplementedError

    def in_template(self, source: str) -> bool:
        """Whether a chat template's source holds this format's markup (tried in TOOL_FORMATS order)."""
        raise NotImplementedError


class QwenXmlFormat(ToolCallFormat):
    """Qwen3.5's XML calls:
    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>. A value is
    raw text, typed by the tool's schema. A bare <function=NAME> (no <tool_call>) is a call when NAME is a
    known tool."""

    name = "qwen_xml"
    function_tag, function_close = "<function=", "</function>"
    parameter_tag, parameter_close = "<parameter=", "</parameter>"
    bare_opens = (function_tag,)
    value_close = "\n" + parameter_close + "\n"
    call_tail = function_close + "\n" + _CALL_CLOSE
    _value_ends = (parameter_close, parameter_tag, function_close, _CALL_CLOSE)   # a value ends at the first
    _value_end_re = re.compile("|".join(map(re.escape, _value_ends)))
    _markers = (parameter_tag, parameter_close, function_close, _CALL_CLOSE, _CALL_OPEN, function_tag)

    def header(self, text, at, final, schemas, bare):
        if not text.startswith(self.function_tag, at):
            return None if not final and _is_partial(text, at, self.function_tag) else False
        start = at + len(self.function_tag)
        close = text.find(">", start, start + _MAX_NAME + 1)
        if close == -1:
            seen = text[start:start + _MAX_NAME + 1]
            return None if not (final or len(seen) > _MAX_NAME or "\n" in seen or "<" in seen) else False
        name = text[start:close].strip()
        if not name or "\n" in name or "<" in name:
            return False
        if bare and schemas and name not in schemas:           # a bare <function=X> only for a known tool
            return False
        return close + 1, name, "parameters"

    def _parameters(self, scan, text, final):
        call = scan.calls[-1]
        j = _skip_ws(text, scan.pos)
        if j == len(text):
            return False
        if text.startswith(self.parameter_tag, j):
            return self._parameter(scan, text, j, final, call)
        if text.startswith(self.parameter_close, j):           # a duplicate </parameter>
            scan.pos = j + len(self.parameter_close)
            return True
        if text.startswith(self.function_close, j):
            call.closed, scan.pos, scan.mode = True, j + len(self.function_close), "call_end"
            return True
        if text.startswith(self.call_close, j):                # </function> missing
            call.closed, scan.pos, scan.mode = True, j + len(self.call_close), "text"
            return True
        if text.startswith(self.call_open, j) or text.startswith(self.function_tag, j):   # the next call
            call.closed, scan.pos, scan.mode = True, j, "text"                              # ends this one
            return True
        if not final and any(_is_partial(text, j, marker) for marker in self._markers):
            scan.pos = j
            return False
        after = text.find("<", j + 1)                           # stray text inside a call is dropped
        scan.pos = len(text) if after == -1 else after
        return True

    def _parameter(self, scan, text, j, final, call):
        start = j + len(self.parameter_tag)
        close = text.find(">", start, start + _MAX_NAME + 1)
        if close == -1:
            seen = text[start:start + _MAX_NAME + 1]
            if final or len(seen) > _MAX_NAME or "\n" in seen:   # not a parameter header
                scan.pos = start
                return True
            scan.pos = j
            return False
        key, start = text[start:close].strip(), close + 1
        types = scan.param_types(call.name, key)
        end = self._value_end_re.search(text, start)
        if end:
            call.add(key, _convert_value(_strip_format_newlines(text[start:end.start()]), types))
            scan.pos = end.end() if end.group() == self.parameter_close else end.start()
            return True
        value = _strip_format_newlines(text[start:_held_start(text, start, self._value_ends)])
        if final:                                              # truncated: keep what arrived
            call.add(key, _convert_value(value, types))
            scan.pos = len(text)
            return True
        if types and types[0] == "string" and key not in call.keys:   # stream a string as it grows
            call.open_member = _member_json(key, value)[:-1]
        scan.pos = j
        return False

    def call_head(self, lead, name):
        return f"{lead}{self.call_open}\n{self.function_tag}{name}>\n"

    def param_open(self, key, first):
        return f"{self.parameter_tag}{key}>\n"

    def renders_call(self, text, name):
        return f"{self.function_tag}{name}>" in text

    def in_template(self, source):
        return self.function_tag in source


class HermesFormat(ToolCallFormat):
    """Hermes JSON calls (Qwen2.5, Qwen3): <tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>. The
    arguments (or "parameters", or a JSON string holding them) are streamed member by member."""

    name = "hermes"
    json_values = True
    call_tail = "}}\n" + _CALL_CLOSE
    _head = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\\n]|\\.)*)"')
    _head_prefix = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*(?::\s*(?:"(?:[^"\\\n]|\\.)*\\?)?)?)?)?)?)?)?)?\Z')

    def header(self, text, at, final, schemas, bare):
        if not text.startswith("{", at):
            return None if not final and at == len(text) else False
        head = self._head.match(text, at)
        if head:
            try:
                return head.end(), json.loads('"' + head.group(1) + '"'), "members"
            except ValueError:
                return False
        return None if not final and self._head_prefix.match(text, at) else False

    def _members(self, scan, text, final):
        return self._object(scan, text, final, inner=False)

    def _arguments(self, scan, text, final):
        return self._object(scan, text, final, inner=True)

    def _object(self, scan, text, final, inner):
        """One member of the call object {"name", "arguments"} (outer) or of its arguments object (inner)."""
        call = scan.calls[-1]
        j = _skip_ws(text, scan.pos)
        if j == len(text):
            return False
        if text[j] in ",}":
            if text[j] == "}":
                call.closed, scan.mode = True, "members" if inner else "call_end"
            scan.pos = j + 1
            return True
        member = self._json_member(text, j, final)
        if not member:                                          # None: wait for more text; False: malformed
            return self._give_up(scan, call) if member is False else False
        key, v = member
        arguments = not inner and key in ("arguments", "parameters")
        if arguments and text[v] == "{" and not call.closed:
            scan.pos, scan.mode = v + 1, "arguments"
            return True
        if inner and text[v] == '"' and not _JSON_STRING.match(text, v):   # a string value still arriving: stream it
            value = _json_string_prefix(text, v + 1)
            if final:
                call.add(key, value)
                scan.pos = len(text)
                return True
            if key not in call.keys:
                call.open_member = _member_json(key, value)[:-1]
            return False
        value = self._json_value(text, v, final)
        if not value:
            return self._give_up(scan, call) if value is False else False
        if inner:
            call.add(key, value[0])
        elif arguments and isinstance(value[0], str):                    # arguments sent as a JSON string
            inner_value = _json_or_text(value[0])
            for name, item in (inner_value.items() if isinstance(inner_value, dict) else ()):
                call.add(name, item)
        scan.pos = value[1]
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
            return None if not final and (not self.call_close or text.find(self.call_close, v) == -1) else False
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not final and \
                (end == len(text) or text[end] in "0123456789.eE+-"):
            return None                                         # a number may go on: 1 -> 12, 0 -> 0.5
        if isinstance(value, float) and not math.isfinite(value):
            return False
        return value, end

    def _give_up(self, scan, call):
        call.closed, scan.mode = True, "junk"
        return True

    def call_head(self, lead, name):
        return f'{lead}{self.call_open}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {{'

    def param_open(self, key, first):
        return ("" if first else ", ") + json.dumps(key, ensure_ascii=False) + ": "

    def renders_call(self, text, name):
        head = re.escape(self.call_open) + r'\s*\{\s*"name"\s*:\s*' + re.escape(json.dumps(name, ensure_ascii=False))
        return re.search(head, text) is not None

    def in_template(self, source):
        return self.call_open in source


# The formats by tool_parser name. Detection tries them in this order, so a format whose markup contains
# another's (Qwen XML's calls sit inside Hermes' <tool_call>) comes first; the first is the default.
TOOL_FORMATS: dict[str, ToolCallFormat] = {fmt.name: fmt for fmt in (QwenXmlFormat(), HermesFormat())}


def tool_format(name: str) -> ToolCallFormat:
    """The format registered as `name`; PocketError naming the known ones otherwise."""
    fmt = TOOL_FORMATS.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise PocketError(f"unknown tool parser {name!r}: use {' or '.join(TOOL_FORMATS)}")
    return fmt


def detect_tool_format(rendered: str, source: str, probe_name: str) -> str:
    """The name of the format a chat template teaches: the first whose call to `probe_name` shows in
    `rendered` (the template's rendering of a probe conversation), else the first whose markup is in the
    template's `source`, else the first format."""
    formats = TOOL_FORMATS.values()
    found = next((fmt for fmt in formats if fmt.renders_call(rendered, probe_name)), None) or \
        next((fmt for fmt in formats if fmt.in_template(source)), None) or next(iter(formats))
    return found.name


# -----------------------------------------------------------------------------------------------
# 10c. Chat templates: the checkpoint's jinja2 template is untrusted code, so it runs in an immutable
#      sandbox with the globals and filters HF templates expect.
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


class ChatTemplate:
    """The checkpoint's chat template: messages (+ tools) -> prompt text.

    `source` is a template string or tokenizer_config.json's list of named templates ("tool_use" is used
    when tools are given, else "default"). `tool_parser` is the tool-call format the template teaches the
    model (a TOOL_FORMATS key), found by rendering a probe conversation; callers may override it.
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
        return detect_tool_format(text, "\n".join(self.sources.values()), _PROBE_TOOLS[0]["function"]["name"])


def _chat_template_from_dir(ckpt_dir: Path):
    if (ckpt_dir / "chat_template.jinja").is_file():
        return (ckpt_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if (ckpt_dir / "tokenizer_config.json").is_file():
        try:
            return json.loads((ckpt_dir / "tokenizer_config.json").read_text(encoding="utf-8")).get("chat_template")
        except (ValueError, AttributeError):
            raise CheckpointError(f"{ckpt_dir / 'tokenizer_config.json'}: not a JSON object") from None
    return None


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


def prompt_ends_in_reasoning(prompt_text: str) -> bool:
    """True when the prompt's last turn opened <think> and did not close it (the model starts in reasoning)."""
    turn = prompt_text[prompt_text.rfind("<|im_start|>"):] if "<|im_start|>" in prompt_text else prompt_text
    return turn.rfind("<think>") > turn.rfind("</think>")


# -----------------------------------------------------------------------------------------------
# 11. Output parsing: generated text -> reasoning_content, content and tool_calls. One scanner reads the
#     text left to right and commits only what more text cannot change. Streaming re-runs it over the
#     accumulated text (resuming where it last committed) and sends the difference, so a stream always
#     assembles to exactly the non-streamed parse.
# -----------------------------------------------------------------------------------------------

_PROSE_MODES = ("start", "think", "text")


class _OutputScan:
    """The scanner. `run(text, final)` continues from `pos`; every step either commits text it has fully
    understood (and advances) or returns False to wait for more. With final=True nothing waits: unfinished
    markup is resolved the forgiving way (a truncated call is closed with what it has, an unconfirmed
    <tool_call> is text). Modes: start, think, text (prose); inside a call, the modes of the call's format,
    whose scan() reads it."""

    def __init__(self, schemas: dict, fmt: ToolCallFormat, in_reasoning: bool, parse_tools: bool):
        self.schemas, self.format = schemas, fmt   # schemas: function name -> ToolFunction (tool_functions)
        self.call_format = fmt                     # the format of the call being read
        self.pos, self.mode = 0, "think" if in_reasoning else "start"
        self.reasoning, self.content = "", ""      # raw; shown stripped of surrounding whitespace
        self.calls: list[_ParsedCall] = []
        # after call_open, a call in any format that shares it is read (the request's format is tried first)
        self.wrapped = [fmt] + [other for other in TOOL_FORMATS.values()
                                if other is not fmt and other.call_open == fmt.call_open]
        markers = [_THINK_CLOSE]
        if parse_tools:
            markers += [m for m in (fmt.call_open, *fmt.bare_opens) if m]   # "": no wrapper
        self.markers = markers
        self.marker_re = re.compile("|".join(map(re.escape, markers)))

    @property
    def in_call(self) -> bool:
        return self.mode not in _PROSE_MODES

    def run(self, text: str, final: bool) -> None:
        if self.calls:
            self.calls[-1].open_member = ""
        while self.pos < len(text) and self._step(text, final):
            pass
        if final and self.in_call:
            self.calls[-1].closed = True
            self.mode = "text"

    def _step(self, text, final):
        if self.in_call:
            return self.call_format.scan(self, text, final)
        return getattr(self, "_" + self.mode)(text, final)

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
        """(end, name, mode) for a confirmed call header at `at` (and call_format set to its format), None while
        undecided, False if not a call."""
        if self.format.call_open and text.startswith(self.format.call_open, at):
            j = _skip_ws(text, at + len(self.format.call_open))
            found = [(fmt, fmt.header(text, j, final, self.schemas, bare=False)) for fmt in self.wrapped]
        else:
            found = [(self.format, self.format.header(text, at, final, self.schemas, bare=True))]
        for fmt, header in found:
            if header:
                self.call_format = fmt
                return header
        return None if any(header is None for _, header in found) else False

    def param_types(self, function, key):
        """The schema types of a function's parameter, None when the parameter is not in its schema."""
        found = self.schemas.get(function)
        if found is None or key not in found.properties:
            return None
        return _schema_types(found.properties[key], found.parameters)


class ChatOutputParser:
    """Splits one choice's generated text into reasoning_content, content and tool_calls, streaming or not.

    feed(text) -> OpenAI delta fragments; finish() flushes what was held back; message() is the non-streamed
    parse of everything fed. Text is held back only while it could still be markup (a partial <tool_call>,
    a header not yet confirmed by <function=NAME> or {"name": ...}) or whitespace that is trimmed around
    content. tool_parser names the request's format in TOOL_FORMATS; after its call_open a call in any format
    that shares it is recognised, while its bare openers (Qwen XML's <function=NAME>, NAME a known tool) count
    only for that format.

    >>> p = ChatOutputParser(None, "qwen_xml", in_reasoning=True)
    >>> p.feed("Paris?\\n</think>\\n\\nIt is ") + p.feed("Paris.") + p.finish()
    [{'reasoning_content': 'Paris?'}, {'content': 'It is'}, {'content': ' Paris.'}]
    """

    def __init__(self, tools: list[dict] | None, tool_parser: str, in_reasoning: bool, parse_tools: bool = True):
        self._options = (tool_functions(tools), tool_format(tool_parser), in_reasoning, parse_tools)
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
# 11b. Structured output: one JSON-Schema constrained decoder for response_format, strict tools, tool_choice
#      and the calls of auto mode. A schema compiles to a byte-level grammar (nodes below); a state of the
#      grammar is a set of stacks of (node, data) frames, and the mask of a state is found by walking the
#      vocabulary sorted by bytes (its implicit trie) along only the bytes the state's top frames take (kept
#      per frame: context-free), a string's clean tokens as one translate, once per state and cached, as host
#      bytes (never whole-vocabulary tensor ops: thread-pool round trips on a busy CPU). The mask is a pure
#      function of the generated ids, computed on the host before the sampler's first transfer, so on a GPU
#      it overlaps the forward pass still in flight; the sampler applies all rows' masks as one (B, V) op.
# -----------------------------------------------------------------------------------------------

# ---- 11b.1 Grammar nodes: the byte-level pieces a schema compiles to, each frame taking one byte at a time. -------

_THINK_FORCED_CLOSE = "\n</think>"
_WS = frozenset(b" \n\t")            # whitespace between JSON tokens: any run of it loops on its state
_MAX_STACK = 32          # frames; deeper (recursive schemas) only the shortest value is written
_MAX_NUMBER = 24         # bytes in a JSON number; exponents have at most 2 digits (1e999 is infinity)
_MAX_NODES = 20000       # compiled nodes per request: a bigger schema is a 400
_NON_ASCII = frozenset(range(0x80, 0x100))
_QUOTE, _BACKSLASH, _LT = 0x22, 0x5C, 0x3C


def _is_continuation(b: int) -> bool:
    return 0x80 <= b < 0xC0    # the 2nd..4th byte of a UTF-8 character: not a character of its own


class _Node:
    """A grammar node. A frame (node, data) is one node in progress: step(data, b) -> [(data', child)] (child:
    a node that the byte b is handed to, pushed above the frame), can_end(data) (the frame may end here,
    before b), child_done(data, child_frame) -> data when the child above ends, rest(data) -> the shortest
    bytes that end it, finish(data) -> its data after rest. shortest() is the shortest text of the node."""

    nests = False                    # a container: past _MAX_STACK only its shortest text is written
    nullable = False                 # its text may be empty (so a sequence may end before entering it)

    def starts(self):
        return [None]

    def step(self, data, b):
        return []

    def can_end(self, data) -> bool:
        return False

    def child_done(self, data, child):
        return data

    def rest(self, data) -> bytes:
        return b""

    def finish(self, data):
        return data

    def first_key(self, data):
        """What of `data` decides which bytes the frame takes (frames alike here share their first bytes)."""
        return data

    def takes(self, data, entry) -> frozenset | None:
        """The bytes the frame takes next without ending (entry(node): the bytes that start a child), or None:
        found by trying every byte."""
        return None

    def shortest(self) -> bytes | None:
        """The shortest text (None: no finite one, e.g. a required self-reference)."""
        found = getattr(self, "_shortest", ...)
        if found is ...:
            self._shortest = None            # in progress: a cycle through this node has no finite text
            self._shortest = found = self._shortest_text()
        return found

    def _shortest_text(self):
        return self.rest(self.starts()[0])


class _Lit(_Node):
    def __init__(self, text: bytes):
        self.text = text

    def starts(self):
        return [0]

    def step(self, i, b):
        return [(i + 1, None)] if i < len(self.text) and self.text[i] == b else []

    def can_end(self, i):
        return i == len(self.text)

    def takes(self, i, entry):
        return frozenset(self.text[i:i + 1])

    def rest(self, i):
        return self.text[i:]


def _as_lit(node: _Node) -> _Lit:
    """The node reduced to its shortest text (past the depth bound), one per node."""
    if getattr(node, "_lit", None) is None:
        node._lit = _Lit(node.shortest())
    return node._lit


class _Choice(_Node):
    """One of fixed texts (enum, const, true/false/null, keys, markup); data is the text so far."""

    def __init__(self, texts):
        self.texts = list(dict.fromkeys(texts))
        self.prefixes = {t[:k] for t in self.texts for k in range(len(t) + 1)}
        self.complete = set(self.texts)

    def starts(self):
        return [b""]

    def step(self, p, b):
        q = p + bytes((b,))
        return [(q, None)] if q in self.prefixes else []

    def can_end(self, p):
        return p in self.complete

    def takes(self, p, entry):
        return frozenset(t[len(p)] for t in self.texts if len(t) > len(p) and t.startswith(p))

    def rest(self, p):
        return min((t[len(p):] for t in self.texts if t.startswith(p)), key=lambda t: (len(t), t))

    def finish(self, p):
        return p + self.rest(p)


class _Union(_Node):
    """Alternatives; never a frame: entering it enters every option (the state is a set of stacks)."""

    def __init__(self, options):
        self.options = options

    def _shortest_text(self):
        found = [t for t in (o.shortest() for o in self.options) if t is not None]
        return min(found, key=lambda t: (len(t), t)) if found else None


class _Ref(_Node):
    """A $ref: a placeholder while its target compiles, so recursive schemas compile."""

    def __init__(self):
        self.target: _Node | None = None

    def _shortest_text(self):
        return self.target.shortest()


class _Seq(_Node):
    def __init__(self, parts):
        self.parts = [p for p in parts if not (isinstance(p, _Lit) and not p.text)]

    def starts(self):
        return [0]

    def step(self, i, b):
        return [(i, self.parts[i])] if i < len(self.parts) else []

    def can_end(self, i):
        return all(part.nullable for part in self.parts[i:])

    def takes(self, i, entry):
        """The bytes that start part i (None where it may be empty: then its followers' bytes count too)."""
        return entry(self.parts[i]) if i < len(self.parts) else frozenset()

    def child_done(self, i, child):
        return i + 1

    def rest(self, i):
        texts = [p.shortest() for p in self.parts[i:]]
        return None if None in texts else b"".join(texts)

    def _shortest_text(self):
        return self.rest(0)


class _Repeat(_Node):
    """`first`, then up to hi - 1 of `more` (hi None: any number); data (count, in progress)."""

    def __init__(self, first, more, hi):
        self.first, self.more, self.hi = first, more, hi

    def starts(self):
        return [(0, False)]

    def step(self, data, b):
        n = data[0]
        if n == 0:
            return [((0, True), self.first)]
        return [((n, True), self.more)] if self.hi is None or n < self.hi else []

    def can_end(self, data):
        return data[0] >= 1 and not data[1]

    def takes(self, data, entry):
        """The bytes that start the next item, as step() enters it."""
        n = data[0]
        return entry(self.first) if n == 0 else entry(self.more) if self.hi is None or n < self.hi else frozenset()

    def child_done(self, data, child):
        return (min(data[0] + 1, self.hi or 1), False)

    def rest(self, data):
        return self.first.shortest() if data[0] == 0 else b""


# ---- 11b.2 Patterns: JSON Schema's `pattern`, a regular expression over code points fed UTF-8 bytes. --------------

_ANY_CHAR = ((0x20, 0xD7FF), (0xE000, 0x10FFFF))     # the characters a pattern's ., [^...] and \D \W \S may take


def _char_ranges(chars) -> tuple:
    """Code points (an iterable of ints, or (lo, hi) pairs) as sorted, merged, inclusive ranges."""
    pairs = sorted((c, c) if isinstance(c, int) else tuple(c) for c in chars)
    merged: list[list[int]] = []
    for lo, hi in pairs:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return tuple((lo, hi) for lo, hi in merged)


def _char_complement(ranges: tuple) -> tuple:
    """_ANY_CHAR minus the ranges."""
    out, todo = [], list(_ANY_CHAR)
    for lo, hi in todo:
        for a, b in ranges:
            if b < lo or a > hi:
                continue
            if a > lo:
                out.append((lo, a - 1))
            lo = b + 1
            if lo > hi:
                break
        if lo <= hi:
            out.append((lo, hi))
    return tuple(out)


def _char_in(ranges: tuple, c: int) -> bool:
    k = bisect.bisect_right(ranges, (c, 0x110000)) - 1
    return k >= 0 and ranges[k][0] <= c <= ranges[k][1]


class _Regex:
    """A regular expression (JSON Schema `pattern`: unanchored unless ^...$) as a Thompson NFA over characters
    (code points; _Str hands it each character once its UTF-8 bytes are complete). Supported: literals (any
    language) and escapes, ., [classes] with ranges of any characters, \\d \\w \\s (ASCII, as ECMA-262; negated
    too), groups, |, * + ? {m,n}, ^ and $ at the ends."""

    _CLASSES = {"d": _char_ranges(b"0123456789"),
                "w": _char_ranges(b"0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"),
                "s": _char_ranges(b" \t\n\r\f\v")}

    def __init__(self, pattern: str):
        self.pattern, self.i = pattern, 0
        self.edges: list[list] = []                            # state -> [(char ranges or None (epsilon), next)]
        anchored_start = pattern.startswith("^")
        self.i = 1 if anchored_start else 0
        start, end = self._alternation()
        if self.i < len(pattern):
            raise ValueError(f"unexpected {pattern[self.i]!r} at {self.i}")
        if not anchored_start:
            start = self._wrap_any(start, before=True)
        if not self.anchored_end:
            end = self._wrap_any(end, before=False)
        self.start, self.accept = self._closure({start}), end
        self._steps: dict = {}

    # Parsing, each part -> (start state, end state)

    def _state(self) -> int:
        self.edges.append([])
        return len(self.edges) - 1

    def _wrap_any(self, at: int, before: bool) -> int:
        loop = self._state()
        self.edges[loop].append((_ANY_CHAR, loop))
        if before:
            self.edges[loop].append((None, at))
            return loop
        self.edges[at].append((None, loop))
        return loop

    def _alternation(self):
        self.anchored_end = False
        branches = [self._concat()]
        while self.i < len(self.pattern) and self.pattern[self.i] == "|":
            self.i += 1
            branches.append(self._concat())
        if len(branches) == 1:
            return branches[0]
        start, end = self._state(), self._state()
        for s, e in branches:
            self.edges[start].append((None, s))
            self.edges[e].append((None, end))
        return start, end

    def _concat(self):
        start = end = self._state()
        while self.i < len(self.pattern) and self.pattern[self.i] not in "|)":
            if self.pattern[self.i] == "$" and self.i == len(self.pattern) - 1:
                self.i += 1
                self.anchored_end = True
                break
            s, e = self._quantified()
            self.edges[end].append((None, s))
            end = e
        return start, end

    def _quantified(self):
        at = self.i
        atom = self._atom()
        p = self.pattern
        if self.i >= len(p) or p[self.i] not in "*+?{":
            return atom
        if p[self.i] == "{":
            m = re.match(r"\{(\d+)(,(\d*))?\}", p[self.i:])
            if not m:
                raise ValueError(f"bad repetition at {self.i}")
            lo = int(m.group(1))
            hi = lo if m.group(2) is None else int(m.group(3)) if m.group(3) else None
            if lo > 64 or (hi or 0) > 64 or (hi is not None and hi < lo):
                raise ValueError("repetition counts must be ordered and at most 64")
            self.i += m.end()
        else:
            lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[p[self.i]]
            self.i += 1
        if self.i < len(p) and p[self.i] == "?":               # lazy: the same language
            self.i += 1
        copies = [atom]

        def copy():
            return copies.pop() if copies else self._reparse(at)
        start = end = self._state()
        for _ in range(lo):                                    # the required copies
            s, e = copy()
            self.edges[end].append((None, s))
            end = e
        if hi is None:                                         # then a loop
            s, e = copy()
            loop = self._state()
            self.edges[end].append((None, loop))
            self.edges[loop].append((None, s))
            self.edges[e].append((None, loop))
            return start, loop
        final = self._state()
        for _ in range(hi - lo):                               # then optional ones
            s, e = copy()
            self.edges[end].append((None, s))
            self.edges[end].append((None, final))
            end = e
        self.edges[end].append((None, final))
        return start, final

    def _reparse(self, at):
        """A fresh copy of the atom at `at` (a repetition needs its own states per copy)."""
        saved = self.i
        self.i = at
        part = self._atom()
        self.i = saved
        return part

    def _atom(self):
        p, c = self.pattern, self.pattern[self.i]
        if c == "(":
            self.i += 1
            if p.startswith("?:", self.i):
                self.i += 2
            elif p.startswith("?", self.i):
                raise ValueError("lookarounds and named groups are not supported")
            saved = self.anchored_end
            part = self._alternation()
            self.anchored_end = saved
            if self.i >= len(p) or p[self.i] != ")":
                raise ValueError("unbalanced parenthesis")
            self.i += 1
            return part
        if c == "[":
            return self._edge(self._class())
        if c == ".":
            self.i += 1
            return self._edge(_ANY_CHAR)
        if c == "\\":
            return self._edge(self._escape())
        if c in "*+?{)|^$":
            raise ValueError(f"unexpected {c!r} at {self.i}")
        self.i += 1
        return self._edge(_char_ranges([ord(c)]))

    def _edge(self, ranges: tuple):
        s, e = self._state(), self._state()
        self.edges[s].append((ranges, e))
        return s, e

    def _escape(self) -> tuple:
        self.i += 1
        if self.i >= len(self.pattern):
            raise ValueError("a trailing backslash")
        c = self.pattern[self.i]
        self.i += 1
        if c.lower() in self._CLASSES:
            found = self._CLASSES[c.lower()]
            return found if c.islower() else _char_complement(found)
        if c in "nrtfv":
            return _char_ranges([ord({"n": "\n", "r": "\r", "t": "\t", "f": "\f", "v": "\v"}[c])])
        if c.isalnum():
            raise ValueError(f"the escape \\{c} is not supported")
        return _char_ranges([ord(c)])

    def _class(self) -> tuple:
        p = self.pattern
        self.i += 1
        negate = p.startswith("^", self.i)
        self.i += negate
        found, first = [], True
        while self.i < len(p) and (p[self.i] != "]" or first):
            first = False
            if p[self.i] == "\\":
                found += self._escape()
                continue
            lo = p[self.i]
            self.i += 1
            if p.startswith("-", self.i) and self.i + 1 < len(p) and p[self.i + 1] != "]":
                hi = p[self.i + 1]
                self.i += 2
                if hi < lo:
                    raise ValueError("ranges must be ordered")
                found.append((ord(lo), ord(hi)))
            else:
                found.append((ord(lo), ord(lo)))
        if self.i >= len(p):
            raise ValueError("unterminated character class")
        self.i += 1
        return _char_complement(_char_ranges(found)) if negate else _char_ranges(found)

    # Running

    def _closure(self, states) -> frozenset:
        todo, seen = list(states), set(states)
        while todo:
            for byteset, nxt in self.edges[todo.pop()]:
                if byteset is None and nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return frozenset(seen)

    def step(self, states: frozenset, c: int) -> frozenset | None:
        """The states after character c (a code point); None: no match can go on."""
        key = (states, c)
        found = self._steps.get(key, ...)
        if found is ...:
            moved = {nxt for s in states for ranges, nxt in self.edges[s] if ranges is not None and _char_in(ranges, c)}
            found = self._closure(moved) if moved else None
            if len(self._steps) < 1 << 16:
                self._steps[key] = found
        return found

    def accepts(self, states: frozenset) -> bool:
        return self.accept in states

    def shortest(self, states: frozenset, allowed, within=None) -> bytes | None:
        """The shortest UTF-8 text from `states` to acceptance, of ASCII characters in `allowed` (preferring
        letters) and any others; `within` (lo, hi): its first character's code point must lie there."""
        seen, frontier = {states}, [(states, b"")]
        ascii_order = sorted((b for b in allowed if b < 0x80), key=lambda b: (not chr(b).isalnum(), b))
        while frontier:
            nxt = []
            for s, text in frontier:
                if self.accepts(s) and not (within and not text):
                    return text
                lo, hi = within if within and not text else (0, 0x10FFFF)
                for c in self._candidates(s, ascii_order, lo, hi):
                    t = self.step(s, c)
                    if t is not None and t not in seen:
                        seen.add(t)
                        nxt.append((t, text + chr(c).encode()))
            frontier = nxt
        return None

    def _candidates(self, states, ascii_order, lo: int, hi: int) -> list[int]:
        """The characters worth trying from `states` in [lo, hi]: the allowed ASCII ones, then the first
        non-ASCII character of each range an edge takes."""
        found = [c for c in ascii_order if lo <= c <= hi]
        for s in states:
            for ranges, _ in self.edges[s]:
                for a, b in ranges or ():
                    c = max(a, lo, 0x80)
                    if c <= min(b, hi):
                        found.append(c)
        return list(dict.fromkeys(found))

    def takes_between(self, states: frozenset, lo: int, hi: int) -> bool:
        """Whether some character in [lo, hi] moves the NFA on from `states` (a character begun is one
        that can be finished)."""
        key = (states, lo, hi)
        found = self._steps.get(key)
        if found is None:
            found = self._steps[key] = any(a <= hi and lo <= b for s in states for ranges, _ in self.edges[s]
                                           for a, b in ranges or ())
        return found


_UTF8_LEADS = {0xE0: (2, 0xA0, 0xBF), 0xED: (2, 0x80, 0x9F), 0xF0: (3, 0x90, 0xBF), 0xF4: (3, 0x80, 0x8F)}   # RFC 3629


def _utf8_owed(lead: int) -> tuple[int, int, int]:
    """(continuation bytes after the lead byte, the second byte's low and high) for a UTF-8 lead byte."""
    return _UTF8_LEADS.get(lead) or ((1 if lead < 0xE0 else 2 if lead < 0xF0 else 3), 0x80, 0xBF)


def _utf8_step(pending: bytes, b: int) -> tuple[bytes, int | None] | None:
    """The bytes of an unfinished character plus byte b -> (the bytes still unfinished, the character's code
    point once complete else None); None where b breaks well-formed UTF-8 (RFC 3629)."""
    if not pending:
        return (b"", b) if b < 0x80 else (bytes((b,)), None) if 0xC2 <= b <= 0xF4 else None
    owed, low, high = _utf8_owed(pending[0])
    if not (low <= b <= high if len(pending) == 1 else 0x80 <= b <= 0xBF):
        return None
    text = pending + bytes((b,))
    return (b"", ord(text.decode())) if len(text) == owed + 1 else (text, None)


def _utf8_span(pending: bytes) -> tuple[int, int]:
    """The code points of the characters whose UTF-8 starts with the unfinished `pending`, as (lo, hi)."""
    owed, low, high = _utf8_owed(pending[0])
    ends = [bytes((low,)), bytes((high,))] if len(pending) == 1 else [b"", b""]
    lo = pending + ends[0] + b"\x80" * (owed + 1 - len(pending) - len(ends[0]))
    hi = pending + ends[1] + b"\xbf" * (owed + 1 - len(pending) - len(ends[1]))
    return ord(lo.decode()), ord(hi.decode())

# ---- 11b.3 Values: strings, integers, numbers (bounded ones written as decimals), objects, arrays, prose. ---------

_JSON_CLEAN = frozenset(range(0x20, 0x100)) - {_QUOTE, _BACKSLASH}   # bytes a JSON string holds unescaped
_JSON_DIRTY = frozenset(range(0x20)) | {_QUOTE, _BACKSLASH}
_RAW_DIRTY = frozenset(range(0x20)) - frozenset(b"\n\t\r") | {_LT}


class _Str(_Node):
    """A string: JSON (quoted, escapes) or raw (a Qwen XML value: no quotes, no '<', ended by what follows).
    data (phase, count, sub): phase 0 before the quote, 1 content, 2 after a backslash, 3..6 in \\uXXXX, 7 closed;
    count: characters so far (only with bounds); sub: the pattern's NFA states, or for a free key the text so
    far while it may still become a declared key (`exclude`). nonblank (a tool argument the schema leaves
    open): at least one character that is not whitespace, counted as count 1."""

    def __init__(self, lo=0, hi=None, regex=None, raw=False, exclude=(), nonblank=False, no_lt=False):
        self.lo, self.hi, self.regex, self.raw = lo, hi, regex, raw
        self.no_lt = no_lt or raw                             # inside a call no markup can start in a string
        self.exclude = frozenset(exclude)
        self.exclude_prefixes = {e[:k] for e in self.exclude for k in range(len(e) + 1)}
        self.counted = bool(lo) or hi is not None
        # not held as is; a raw string ends where its value_close starts ("\n</parameter>"): counted, a token
        # holding a newline may leave it after the last character that fits, so it is run through the grammar
        self.dirty = (_RAW_DIRTY | {0x0A} if self.counted else _RAW_DIRTY) if raw else \
            _JSON_DIRTY | {_LT} if no_lt else _JSON_DIRTY
        self.ascii = False                                # any string takes any characters (the walk reads it)
        self.utf8 = self.counted and regex is None and not self.exclude   # sub: the bytes the character owes
        self.nonblank = nonblank and not self.counted and regex is None
        self.plain = regex is None and not self.exclude and not self.counted and not self.nonblank   # content loops

    def starts(self):
        sub = (self.regex.start, b"") if self.regex else b"" if self.exclude else 0 if self.utf8 else None
        return [(1 if self.raw else 0, 0, sub)]

    def _content(self, count, sub, b):
        if self.regex is not None:                  # sub (NFA states, the unfinished character's bytes)
            return self._pattern_content(count, sub, b)
        if self.utf8:               # well-formed UTF-8 (RFC 3629), so that the count is of characters
            if sub:
                owed, low, high = sub
                return [(1, count, (owed - 1, 0x80, 0xBF) if owed > 1 else 0)] if low <= b <= high else []
            if b >= 0x80:
                if not 0xC2 <= b <= 0xF4:
                    return []
                sub = _UTF8_LEADS.get(b) or ((1 if b < 0xE0 else 2 if b < 0xF0 else 3), 0x80, 0xBF)
        if _is_continuation(b):
            return [(1, count, sub)]
        if self.nonblank and b not in b" \n\t\r":
            count = 1
        if self.counted:
            count += 1
            if self.hi is not None and count > self.hi:
                return []
            count = min(count, max(self.lo, self.hi or 0))
        if self.exclude:
            sub = sub + bytes((b,)) if sub is not None and sub + bytes((b,)) in self.exclude_prefixes else None
        return [(1, count, sub)]

    def _pattern_content(self, count, sub, b):
        """The pattern moves once per character, when its UTF-8 bytes are complete; a character is begun only
        if one it may become moves the pattern on."""
        states, pending = sub
        moved = _utf8_step(pending, b)
        if moved is None:
            return []
        pending, c = moved
        if c is None:
            return [(1, count, (states, pending))] if self.regex.takes_between(states, *_utf8_span(pending)) else []
        states = self.regex.step(states, c)
        return [] if states is None else [(1, count, (states, b""))]

    def _may_end(self, count, sub) -> bool:
        pattern_ok = self.regex is None or not sub[1] and self.regex.accepts(sub[0])
        return count >= self.lo and not (self.utf8 and sub) and (count or not self.nonblank) and pattern_ok and \
            not (self.exclude and sub in self.exclude)

    def step(self, data, b):
        phase, count, sub = data
        if self.raw:
            ok = b != _LT and (b >= 0x20 or b in b"\n\t\r") and not (self.utf8 and sub and b < 0x80)
            return [(d, None) for d in self._content(count, sub, b)] if ok else []
        if phase == 0:
            return [((1, count, sub), None)] if b == _QUOTE else []
        if phase == 1:
            if self.utf8 and sub:                   # inside a character: only its continuation bytes
                return [(d, None) for d in self._content(count, sub, b)]
            if b == _QUOTE:                         # closed: what was counted no longer matters (one state)
                return [((7, 0, None), None)] if self._may_end(count, sub) else []
            if b == _BACKSLASH:                     # no escapes under a pattern or in a key that may be declared
                room = self.hi is None or count < self.hi
                return [((2, count, sub), None)] if self.regex is None and not self.exclude and room else []
            return [(d, None) for d in self._content(count, sub, b)] if b >= 0x20 and b not in self.dirty else []
        if phase == 2:
            if b == ord("u"):
                return [((3, count, sub), None)]
            return [(d, None) for d in self._content(count, sub, ord("a"))] if b in b'"\\/bfnrt' else []
        if 3 <= phase <= 6 and b in b"0123456789abcdefABCDEF":
            return [((phase + 1, count, sub), None)] if phase < 6 else \
                [(d, None) for d in self._content(count, sub, ord("a"))]
        return []

    def can_end(self, data):
        phase, count, sub = data
        return self._may_end(count, sub) if self.raw else phase == 7

    def _fill(self, count, sub) -> bytes:
        if self.regex is not None:
            allowed = _JSON_CLEAN if not self.raw else frozenset(range(0x20, 0x80)) - {_LT}
            states, pending = sub
            if not pending:
                return self.regex.shortest(states, allowed) or b""
            text = self.regex.shortest(states, allowed, within=_utf8_span(pending))   # the character's end first
            return text[len(pending):] if text else b""
        text = bytes((sub[1],)) + b"\x80" * (sub[0] - 1) if self.utf8 and sub else b""   # the character's end
        text += b"a" * max(0, self.lo - count, int(self.nonblank) - count)
        return text + b"_" if self.exclude and sub is not None and sub + text in self.exclude else text

    def rest(self, data):
        phase, count, sub = data
        close = b"" if self.raw else b'"'
        if phase == 7:
            return b""
        if phase == 0:
            return b'"' + self._fill(count, sub) + close
        if phase == 2:
            return b"n" + self._fill(count + 1, sub) + close
        if 3 <= phase <= 6:
            return b"0" * (7 - phase) + self._fill(count + 1, sub) + close
        return self._fill(count, sub) + close


class _Int(_Node):
    """A JSON integer in [lo, hi] (None: unbounded), at most 19 digits. data (text, length): bounded, the text
    so far; unbounded, its kind ("", "-", "0", "1" digits, "-1" negative digits) so that states repeat."""

    def __init__(self, lo=None, hi=None):
        self.lo, self.hi = lo, hi
        self.bounded = lo is not None or hi is not None

    def starts(self):
        return [(b"", 0)]

    def _span(self, text: bytes, extra: int):
        """The integers written text + `extra` more digits, as (low, high); None if text is no number's start."""
        digits, neg = text.lstrip(b"-"), text.startswith(b"-")
        if not digits:
            return None
        d = int(digits)
        if digits == b"0":
            if extra:
                return None
        low, high = d * 10 ** extra, (d + 1) * 10 ** extra - 1 if extra else d
        return (-high, -low) if neg else (low, high)

    def _pick(self, text: bytes) -> bytes | None:
        """The in-range integer closest to zero that starts with text (None if none does)."""
        lo = self.lo if self.lo is not None else -10 ** 19
        hi = self.hi if self.hi is not None else 10 ** 19
        if text in (b"", b"-"):
            top = hi if text == b"" else min(hi, -1)
            best = min(max(0, lo), top) if text == b"" else top
            return str(best).encode() if lo <= best <= top else None
        for extra in range(0, 20 - len(text)):
            span = self._span(text, extra)
            if span is None:
                return None
            low, high = max(span[0], lo), min(span[1], hi)
            if low <= high:
                return str(low if low >= 0 else high).encode()
        return None

    def step(self, data, b):
        text, n = data
        if n >= 19 or not (0x30 <= b <= 0x39 or (b == 0x2D and not n)):
            return []
        if text in (b"0", b"-0") or (text == b"-" and b == 0x30):
            return []
        new = text + bytes((b,))
        if not self.bounded:
            kind = new if new in (b"-", b"0") else b"-1" if new.startswith(b"-") else b"1"
            return [((kind, n + 1), None)]
        return [((new, n + 1), None)] if self._pick(new) is not None else []

    def can_end(self, data):
        text = data[0]
        if text in (b"", b"-"):
            return False
        return not self.bounded or self._pick(text) == text

    def rest(self, data):
        text = data[0]
        if not self.bounded:
            return {b"": b"0", b"-": b"1"}.get(text, b"")
        return self._pick(text)[len(text):]


class _Num(_Node):
    """A JSON number; data (state, length). States: s start, - sign, 0 zero, i int digits, . dot, f fraction,
    e exponent mark, E exponent sign, x exponent digits (x2 the second, the last allowed)."""

    _MOVES = {"s": {"-": "-", "0": "0", "9": "i"}, "-": {"0": "0", "9": "i"}, "0": {".": ".", "e": "e"},
              "i": {"0": "i", "9": "i", ".": ".", "e": "e"}, ".": {"0": "f", "9": "f"},
              "f": {"0": "f", "9": "f", "e": "e"}, "e": {"-": "E", "+": "E", "0": "x", "9": "x"},
              "E": {"0": "x", "9": "x"}, "x": {"0": "x2", "9": "x2"}, "x2": {}}   # "9": a digit 1-9
    _ENDS = {"0", "i", "f", "x", "x2"}
    _REST = {"s": b"0", "-": b"0", ".": b"0", "e": b"0", "E": b"0"}

    def starts(self):
        return [("s", 0)]

    def step(self, data, b):
        state, n = data
        c = chr(b)
        kind = "0" if c == "0" else "9" if c in "123456789" else "e" if c in "eE" else c
        nxt = self._MOVES[state].get(kind)
        if nxt is None or n + 1 + len(self._REST.get(nxt, b"")) > _MAX_NUMBER:   # never a dead end at the cap
            return []
        return [((nxt, n + 1), None)]

    def can_end(self, data):
        return data[0] in self._ENDS

    def rest(self, data):
        return self._REST.get(data[0], b"")


_DECIMAL = re.compile(rb"-?(0|[1-9][0-9]*)(\.[0-9]+)?")
_DECIMAL_START = re.compile(rb"-?((0|[1-9][0-9]*)(\.[0-9]*)?)?")      # every prefix of a _DECIMAL


def _decimal_text(neg: bool, whole: int, places: int) -> bytes:
    """The number whole / 10**places written with `places` decimals, e.g. (False, 305, 2) -> b"3.05"."""
    digits = str(whole).rjust(places + 1, "0")
    return (b"-" if neg else b"") + (digits if not places else digits[:-places] + "." + digits[-places:]).encode()


_DECIMAL_PICKS: dict[tuple, dict] = {}


def _decimal_picks(lo, hi) -> dict:
    """The shortest-number search's results for one pair of bounds, shared by every _Decimal with them (a tool
    list repeats its bounds; finding them is thousands of fraction steps); the last 64 pairs are kept."""
    found = _DECIMAL_PICKS.pop((lo, hi), None)
    found = _DECIMAL_PICKS[(lo, hi)] = {} if found is None else found
    while len(_DECIMAL_PICKS) > 64:
        _DECIMAL_PICKS.pop(next(iter(_DECIMAL_PICKS)))
    return found


class _Decimal(_Node):
    """A JSON number in [lo, hi] (inclusive fractions, None: open), written without an exponent in at most
    _MAX_NUMBER bytes. data (text, length): a byte is taken only when some number in range still starts
    with the text (so no dead end and no out-of-range value); the search is exact, in integers: with k more
    integer digits and m decimals, the numbers a prefix leads to are J / 10**m for J in one integer range."""

    def __init__(self, lo: fractions.Fraction | None, hi: fractions.Fraction | None):
        self.lo, self.hi = lo, hi
        self._picks: dict[bytes, bytes | None] = _decimal_picks(lo, hi)

    def starts(self):
        return [(b"", 0)]

    def step(self, data, b):
        text = data[0] + bytes((b,))
        if len(text) > _MAX_NUMBER or not _DECIMAL_START.fullmatch(text) or self._pick(text) is None:
            return []
        return [((text, len(text)), None)]

    def can_end(self, data):
        text = data[0]
        return bool(_DECIMAL.fullmatch(text)) and self._inside(fractions.Fraction(text.decode()))

    def rest(self, data):
        found = self._pick(data[0])
        return None if found is None else found[len(data[0]):]

    def _inside(self, value) -> bool:
        return (self.lo is None or value >= self.lo) and (self.hi is None or value <= self.hi)

    def _fit(self, low: int, high: int, m: int, neg: bool) -> int | None:
        """The J in [low, high] nearest zero with J / 10**m (negated if neg) in range, or None."""
        a, b = (self.hi, self.lo) if neg else (self.lo, self.hi)
        a = None if a is None else -a if neg else a           # magnitudes: J / 10**m in [a, b]
        b = None if b is None else -b if neg else b
        scale = 10 ** m
        if a is not None and a > 0:
            low = max(low, math.ceil(a * scale))
        if b is not None:
            high = min(high, math.floor(b * scale))
        return low if low <= high else None

    def _pick(self, text: bytes) -> bytes | None:
        """The shortest number in range that starts with text (None: none)."""
        found = self._picks.get(text, ...)
        if found is ...:
            found = None
            if text in (b"", b"-"):
                picks = [self._pick(text + bytes((d,))) for d in b"0123456789"] + \
                    ([self._pick(b"-")] if not text else [])
                picks = [p for p in picks if p is not None]
                found = min(picks, key=lambda p: (len(p), p)) if picks else None
            elif self._reachable(text):
                for extra, low, high, m, neg in self._shapes(text):
                    j = self._fit(low, high, m, neg)
                    if j is not None:
                        found = _decimal_text(neg, j, m)
                        break
            self._picks[text] = found
        return found

    def _reachable(self, text: bytes) -> bool:
        """False when every number that starts with text is past a bound (its magnitude is at least its whole
        part), so that the search over its shapes (thousands of fraction steps) would find none."""
        whole = int(text.lstrip(b"-").partition(b".")[0])
        if text.startswith(b"-"):
            return self.lo is None or -whole >= self.lo
        return self.hi is None or whole <= self.hi

    def _shapes(self, text: bytes):
        """(bytes added, low J, high J, decimals m, negative) of the numbers that start with text, fewest bytes
        added first: J / 10**m for J in [low, high]. text holds at least one digit."""
        neg = text.startswith(b"-")
        whole, dot, places = text.lstrip(b"-").partition(b".")
        room = _MAX_NUMBER - len(text)
        if dot:                                # only more decimals
            digits, have = int(whole + places), len(places)
            for e in range(0 if have else 1, room + 1):
                yield e, digits * 10 ** e, (digits + 1) * 10 ** e - 1, have + e, neg
            return
        head = int(whole)
        for extra in range(room + 1):          # k more integer digits, then (m > 0) a dot and m decimals
            if extra == 0:
                yield 0, head, head, 0, neg
                continue
            if head:
                yield extra, head * 10 ** extra, (head + 1) * 10 ** extra - 1, 0, neg
            for m in range(1, extra):
                k = extra - 1 - m
                if not (head == 0 and k):      # after a leading 0 only decimals
                    yield extra, head * 10 ** (k + m), (head + 1) * 10 ** (k + m) - 1, m, neg


def _next_members(members, i):
    """Indexes of the members that may come next from position i: in order, no required one skipped."""
    found = []
    for j in range(i, len(members)):
        found.append(j)
        if members[j][2]:
            break
    return found


def _required_from(members, i):
    return [j for j in range(i, len(members)) if members[j][2]]


class _Obj(_Node):
    """A JSON object: declared members [(key, value node, required)] in schema order (optional ones may be
    skipped), then other keys if `extra` (a value node) allows them. Whitespace between tokens (it leaves the
    data as it is: a run of it is one state). data (phase, i, j): i the next declared member, j the member whose
    value is being written (-1: extra).
    Phases: 0 '{', 1 after '{', 2 key, 3 ':', 4 before value, 5 value, 6 after value, 7 after ',', 8 closed."""

    nests = True

    def __init__(self, members, extra, no_lt=False):
        self.members, self.extra, self.no_lt = members, extra, no_lt
        self._keys: dict[int, _Node] = {}
        self._choices: dict[int, tuple] = {}
        self._tails: dict[tuple, bytes | None] = {}

    def starts(self):
        return [(0, 0, -1)]

    def keys_at(self, i) -> _Node:
        node = self._keys.get(i)
        if node is None:
            texts = {json.dumps(self.members[j][0], ensure_ascii=False).encode(): j for j in _next_members(self.members, i)}
            choice = _Choice(texts)
            self._choices[id(choice)] = texts
            options = [choice] if texts else []
            if self.extra is not None:
                options.append(_Str(exclude=[m[0].encode() for m in self.members], no_lt=self.no_lt))
            node = self._keys[i] = _Union(options)
        return node

    def step(self, data, b):
        phase, i, j = data
        if b in _WS and phase in (1, 3, 4, 6, 7):
            return [(data, None)]
        if phase == 0:
            return [((1, i, j), None)] if b == 0x7B else []
        if phase in (1, 7):
            if b == _QUOTE and self.keys_at(i).options:
                return [((2, i, j), self.keys_at(i))]
            return [((8, i, j), None)] if b == 0x7D and phase == 1 and not _required_from(self.members, i) else []
        if phase == 3:
            return [((4, i, j), None)] if b == 0x3A else []
        if phase == 4:
            return [((5, i, j), self.members[j][1] if j >= 0 else self.extra)]
        if phase == 6:
            if b == 0x2C and (i < len(self.members) or self.extra is not None):
                return [((7, i, j), None)]
            return [((8, i, j), None)] if b == 0x7D and not _required_from(self.members, i) else []
        return []

    def can_end(self, data):
        return data[0] == 8

    def takes(self, data, entry):
        """As step() takes them, phase by phase."""
        phase, i, j = data
        found = set(_WS) if phase in (1, 3, 4, 6, 7) else set()
        if phase == 0:
            found.add(0x7B)
        elif phase in (1, 7):
            if self.keys_at(i).options:
                found.add(_QUOTE)
            if phase == 1 and not _required_from(self.members, i):
                found.add(0x7D)
        elif phase == 3:
            found.add(0x3A)
        elif phase == 4:
            value = entry(self.members[j][1] if j >= 0 else self.extra)
            if value is None:
                return None
            found |= value - _WS
        elif phase == 6:
            if i < len(self.members) or self.extra is not None:
                found.add(0x2C)
            if not _required_from(self.members, i):
                found.add(0x7D)
        return frozenset(found)

    def child_done(self, data, child):
        phase, i, j = data
        if phase == 2:
            texts = self._choices.get(id(child[0]))
            j = texts[child[1]] if texts is not None else -1
            return (3, j + 1 if j >= 0 else i, j)
        return (6, i, j)

    def _member_text(self, j) -> bytes | None:
        key, value, _ = self.members[j] if j >= 0 else ("", self.extra, False)
        v = value.shortest()
        return None if v is None else json.dumps(key, ensure_ascii=False).encode() + b":" + v

    def _tail(self, i, need_member) -> bytes | None:
        """The shortest members from i (joined by ','), at least one if need_member, without the '}' (kept:
        every completion of a state inside the object asks)."""
        found = self._tails.get((i, need_member), ...)
        if found is ...:
            found = self._tails[(i, need_member)] = self._find_tail(i, need_member)
        return found

    def _find_tail(self, i, need_member) -> bytes | None:
        todo = _required_from(self.members, i)
        if not todo and need_member:
            options = [self._member_text(j) for j in _next_members(self.members, i)]
            options += [b'"":' + self.extra.shortest()] if self.extra is not None and self.extra.shortest() is not None else []
            options = [t for t in options if t is not None]
            return min(options, key=len) if options else None
        texts = [self._member_text(j) for j in todo]
        return None if None in texts else b",".join(texts)

    def rest(self, data):
        phase, i, j = data
        if phase == 8:
            return b""
        if phase in (0, 1, 7):
            tail = self._tail(i, phase == 7)
            return None if tail is None else (b"{" if phase == 0 else b"") + tail + b"}"
        if phase in (3, 4):
            value = (self.members[j][1] if j >= 0 else self.extra).shortest()
            after = self.rest((6, i, j))
            return None if value is None or after is None else (b":" if phase == 3 else b"") + value + after
        tail = self._tail(i, False)
        return None if tail is None else (b"," + tail if tail else b"") + b"}"


class _Arr(_Node):
    """A JSON array: prefixItems, then `items` (None: none past the prefix), between lo and hi items.
    data (phase, n): phases 0 '[', 1 after '[', 2 item, 3 after item, 4 after ',', 5 closed; whitespace
    between tokens leaves the data as it is."""

    nests = True

    def __init__(self, prefix, items, lo=0, hi=None):
        self.prefix, self.items, self.lo = prefix, items, lo
        self.hi = len(prefix) if items is None and (hi is None or hi > len(prefix)) else hi
        self.cap = max(lo, len(prefix))       # counts above this are all alike when there is no maximum

    def starts(self):
        return [(0, 0)]

    def item(self, n) -> _Node:
        return self.prefix[n] if n < len(self.prefix) else self.items

    def step(self, data, b):
        phase, n = data
        if b in _WS and phase in (1, 3, 4):
            return [(data, None)]
        if phase == 0:
            return [((1, n), None)] if b == 0x5B else []
        if b == 0x5D and (phase == 1 or phase == 3) and n >= self.lo:
            return [((5, n), None)]
        if phase in (1, 4) and (self.hi is None or n < self.hi):
            return [((2, n), self.item(n))]
        if phase == 3 and b == 0x2C and (self.hi is None or n < self.hi):
            return [((4, n), None)]
        return []

    def can_end(self, data):
        return data[0] == 5

    def takes(self, data, entry):
        """As step() takes them, phase by phase."""
        phase, n = data
        found = set(_WS) if phase in (1, 3, 4) else set()
        room = self.hi is None or n < self.hi
        if phase == 0:
            found.add(0x5B)
        if phase in (1, 3) and n >= self.lo:
            found.add(0x5D)
        if phase in (1, 4) and room:
            item = entry(self.item(n))
            if item is None:
                return None
            found |= item - _WS
        if phase == 3 and room:
            found.add(0x2C)
        return frozenset(found)

    def child_done(self, data, child):
        n = data[1] + 1
        return (3, n if self.hi is not None else min(n, self.cap))

    def _items(self, n, count) -> bytes | None:
        texts = [self.item(k).shortest() for k in range(n, n + count)]
        return None if None in texts else b",".join(texts)

    def rest(self, data):
        phase, n = data
        if phase == 5:
            return b""
        if phase in (0, 1):
            items = self._items(n, max(0, self.lo - n))
            return None if items is None else (b"[" if phase == 0 else b"") + items + b"]"
        if phase == 3:
            items = self._items(n, max(0, self.lo - n))
            return None if items is None else (b"," + items if items else b"") + b"]"
        items = self._items(n, max(1, self.lo - n))
        return None if items is None else items + b"]"


class _Members(_Node):
    """A tool call's arguments in its format's markup: per argument param_open(key, first) + value +
    value_close, then call_tail (which ends the call). members [(key, value node, required)] in schema order.
    data (phase, i, first, j): 0 a key or the tail, 1 in it, 2 before value j, 3 in it, 4 before value_close,
    5 in it, 6 done."""

    def __init__(self, fmt: ToolCallFormat, members):
        self.fmt, self.members = fmt, members
        self._choices: dict[tuple, tuple] = {}
        self.close = _Lit(fmt.value_close.encode())

    def starts(self):
        return [(0, 0, True, -1)]

    def choice_at(self, i, first) -> tuple[_Choice, dict]:
        found = self._choices.get((i, first))
        if found is None:
            texts = {self.fmt.param_open(self.members[j][0], first).encode(): j for j in _next_members(self.members, i)}
            if not _required_from(self.members, i):
                texts[self.fmt.call_tail.encode()] = -1
            found = self._choices[(i, first)] = (_Choice(texts), texts)
        return found

    def step(self, data, b):
        phase, i, first, j = data
        if phase == 0:
            return [((1, i, first, j), self.choice_at(i, first)[0])]
        if phase == 2:
            return [((3, i, first, j), self.members[j][1])]
        if phase == 4:
            return [((5, i, first, j), self.close)]
        return []

    def can_end(self, data):
        return data[0] == 6

    def child_done(self, data, child):
        phase, i, first, j = data
        if phase == 1:
            j = self.choice_at(i, first)[1][child[1]]
            return (6, i, first, -1) if j < 0 else (2, j + 1, False, j)
        if phase == 3 and self.fmt.value_close:
            return (4, i, first, j)
        return (0, i, first, j)

    def _tail(self, i, first) -> bytes | None:
        texts = []
        for j in _required_from(self.members, i):
            value = self.members[j][1].shortest()
            if value is None:
                return None
            texts.append(self.fmt.param_open(self.members[j][0], first).encode() + value + self.fmt.value_close.encode())
            first = False
        return b"".join(texts) + self.fmt.call_tail.encode()

    def rest(self, data):
        phase, i, first, j = data
        if phase == 6:
            return b""
        if phase == 0:
            return self._tail(i, first)
        close = self.fmt.value_close.encode()
        value = self.members[j][1].shortest() if phase == 2 else b""
        tail = self._tail(i, False)
        return None if value is None or tail is None else value + (close if phase in (2, 4) else b"") + tail


class _Prose(_Node):
    """Free text (auto mode) in which each opener (<tool_call>, a bare <function=) starts a call: the node
    openers[k] is the rest of the call. Once a call has closed only whitespace, another call or the end may
    follow (a model steered to another function than the one it was writing would go on with its own call's
    markup, and that would land in the content); after max_calls calls only the end.
    data (partial, calls, opened): the text's tail that may be an opener's start, calls made (counted up to
    max_calls, or to 1 without a limit: the first call is what changes the text allowed), and -1 in prose, k after
    opener k, -2 inside its call."""

    nullable = True

    def __init__(self, openers: dict[bytes, _Node], max_calls):
        self.openers, self.calls = list(openers.items()), max_calls
        self.prefixes = {o[:k] for o, _ in self.openers for k in range(1, len(o))}
        self.firsts = frozenset(o[0] for o, _ in self.openers)

    def starts(self):
        return [(b"", 0, -1)]

    def step(self, data, b):
        partial, calls, opened = data
        if opened >= 0:
            return [((b"", calls, -2), self.openers[opened][1])]
        if opened == -2 or (self.calls is not None and calls >= self.calls):
            return []
        text = partial + bytes((b,))
        for k, (opener, _) in enumerate(self.openers):
            if text.endswith(opener):
                return [((b"", calls, k), None)]
        if calls:                            # between calls: whitespace or the next opener's start
            if text in self.prefixes:
                return [((text, calls, -1), None)]
            return [((b"", calls, -1), None)] if not partial and b in b" \t\r\n" else []
        for cut in range(max(0, len(text) - 32), len(text) + 1):
            if text[cut:] in self.prefixes or cut == len(text):
                return [((text[cut:], calls, -1), None)]
        return []

    def can_end(self, data):
        return data[2] == -1 and not (data[1] and data[0])

    def child_done(self, data, child):
        return (b"", min(data[1] + 1, self.calls or 1), -1)

    def rest(self, data):
        return self.openers[data[2]][1].shortest() if data[2] >= 0 else b""


# ---- 11b.4 Stacks: a byte fed to a stack of frames, whether it may end, and its shortest completion. --------------

def _feed(stack: tuple, b: int, out: list, enter: _Node | None = None) -> None:
    """The stacks that `stack` becomes on byte b (appended to out); with `enter`, that node is first pushed
    above the stack (a union: each option) and handed b."""
    if enter is not None:
        if isinstance(enter, (_Union, _Ref)):
            for option in enter.options if isinstance(enter, _Union) else [enter.target]:
                _feed(stack, b, out, option)
            return
        if enter.nests and len(stack) >= _MAX_STACK:
            enter = _as_lit(enter)
        for data in enter.starts():
            _feed(stack + ((enter, data),), b, out)
        return
    node, data = stack[-1]
    for new, child in node.step(data, b):
        base = stack[:-1] + ((node, new),)
        if child is None:
            out.append(base)
        else:
            _feed(base, b, out, child)
    if node.can_end(data) and len(stack) > 1:
        parent, parent_data = stack[-2]
        _feed(stack[:-2] + ((parent, parent.child_done(parent_data, stack[-1])),), b, out)


def _feeds(stack: tuple, b: int) -> bool:
    out = []
    _feed(stack, b, out)
    return bool(out)


def _stack_accepts(stack: tuple) -> bool:
    for k in range(len(stack) - 1, -1, -1):
        node, data = stack[k]
        if k < len(stack) - 1:
            data = node.child_done(data, stack[k + 1])
        if not node.can_end(data):
            return False
    return True


def _stack_completion(stack: tuple) -> bytes | None:
    """The shortest bytes that end every frame of the stack, top first."""
    out, child = b"", None
    for node, data in reversed(stack):
        if child is not None:
            data = node.child_done(data, child)
        rest = node.rest(data)
        if rest is None:
            return None
        out += rest
        child = (node, node.finish(data))
    return out


class _Guard(_Node):
    """A node whose text may not start with a byte in `banned` (a Qwen XML raw string after other types, which
    must not read as one of them); data: 0 before the first byte, 1 once the node has it."""

    def __init__(self, node: _Node, banned: frozenset):
        self.node, self.banned = node, banned

    def starts(self):
        return [0]

    def step(self, data, b):
        return [(1, self.node)] if data == 0 and b not in self.banned else []

    def can_end(self, data):
        return data == 1

    def child_done(self, data, child):
        return 1

    def rest(self, data):
        return self.shortest() if data == 0 else b""

    def finish(self, data):
        return 1

    def _shortest_text(self):
        texts = []
        for b in sorted(set(range(0x20, 0x7F)) - self.banned):
            stacks = []
            _feed((), b, stacks, self.node)
            texts += [bytes((b,)) + rest for rest in map(_stack_completion, stacks) if rest is not None]
        return min(texts, key=lambda t: (len(t), t)) if texts else None


# ---- 11b.5 The grammar: its states (sets of stacks) and each state's mask over the vocabulary. --------------------

class _Grammar:
    """A compiled output grammar with its per-state caches (transitions, masks, completions), shared by every
    request that sends the same schema with the same tokenizer."""

    def __init__(self, root: _Node, facts: "_TokenFacts"):
        self.root, self.facts = root, facts
        self.start = self.start_after("")
        self._next: dict = {}
        self._masks: dict = {}
        self._completions: dict = {}
        self._viable: dict = {}
        self._loops: dict = {}
        self._firsts: dict = {}
        self._entries: dict = {}
        self._exits: dict = {}
        self._escapes: dict = {}

    def start_after(self, text: str) -> frozenset:
        """The state before `text` and then the grammar (the forced close of reasoning)."""
        return frozenset({((_Seq([_Lit(text.encode()), self.root]), 0),)})

    def step(self, state: frozenset, b: int) -> frozenset | None:
        key = (state, b)
        found = self._next.get(key, ...)
        if found is ...:
            out = []
            for stack in state:
                _feed(stack, b, out)
            found = self._next[key] = frozenset(out) if out else None
        return found

    def whitespace_loop(self, state):
        """The state every JSON whitespace byte takes `state` to, if it is one that whitespace leaves as it is
        (between the tokens of an object or array; a number or a closed string first ends there); else None."""
        found = self._loops.get(state, ...)
        if found is ...:
            after = {self.step(state, b) for b in _WS}
            loop = after.pop() if len(after) == 1 else None
            found = self._loops[state] = loop if loop is not None and all(
                self.step(loop, b) == loop for b in _WS) else None
        return found

    def viable(self, state) -> frozenset:
        """The bytes that may follow `state` (step(state, b) is not None for exactly these): per stack, its top
        frame's own first bytes (context-free, kept per frame), and its parent's when the frame may end."""
        found = self._viable.get(state)
        if found is None:
            found = self._viable[state] = frozenset().union(*(self._stack_viable(stack) for stack in state))
        return found

    def _stack_viable(self, stack: tuple) -> frozenset:
        node, data = stack[-1]
        found = self._frame_firsts(node, data)
        if node.can_end(data) and len(stack) > 1:
            parent, parent_data = stack[-2]
            found = found | self._stack_viable(stack[:-2] + ((parent, parent.child_done(parent_data, stack[-1])),))
        return found

    def _frame_firsts(self, node: _Node, data) -> frozenset:
        """The bytes a frame takes without ending, kept per (node, first_key)."""
        key = (node, node.first_key(data))
        found = self._firsts.get(key)
        if found is None:
            found = node.takes(data, self._entry)
            if found is None:                # try every byte on a one-frame stack (which never ends)
                found = frozenset(b for b in range(256) if _feeds(((node, data),), b))
            self._firsts[key] = found
        return found

    def _entry(self, node: _Node) -> frozenset | None:
        """The bytes that may start `node` (None: it may be empty, or it is being found: a cycle)."""
        found = self._entries.get(node, ...)
        if found is ...:
            self._entries[node] = None
            if isinstance(node, (_Union, _Ref)):
                parts = [self._entry(o) for o in (node.options if isinstance(node, _Union) else [node.target])]
            else:
                starts = node.starts()             # a node that may be empty lets its parent's bytes through
                empty = node.nullable or any(node.can_end(d) for d in starts)
                parts = [None] if empty else [self._frame_firsts(node, d) for d in starts]
            found = self._entries[node] = None if None in parts else frozenset().union(*parts)
        return found

    def escape(self, state, suffix: bytes):
        """advance(state, suffix), kept per (state, suffix): a string's escapes meet the same counts again."""
        key = (state, suffix)
        found = self._escapes.get(key, ...)
        if found is ...:
            found = self._escapes[key] = self.advance(state, suffix)
        return found

    def advance(self, state, blob: bytes):
        for b in blob:
            state = self.step(state, b)
            if state is None:
                return None
        return state

    def accepts(self, state) -> bool:
        return any(_stack_accepts(stack) for stack in state)

    def completion(self, state) -> tuple[bytes, int]:
        """(the shortest text that completes the state, the tokens it takes + 1 for the end of sequence)."""
        found = self._completions.get(state)
        if found is None or found[1] is None:
            text = self.completion_text(state)
            found = self._completions[state] = (text, self.facts.cost(text) + 1)
        return found

    def completion_text(self, state) -> bytes:
        found = self._completions.get(state)
        if found is None:
            texts = [t for t in (_stack_completion(stack) for stack in state) if t is not None]
            found = self._completions[state] = (min(texts, key=lambda t: (len(t), t)) if texts else b"", None)
        return found[0]

    def need_at_most(self, state) -> int:
        """An upper bound of completion(state)[1] without a tokenizer call where the tokenizer allows one."""
        text = self.completion_text(state)
        return self.facts.cost_at_most(text) + 1

    def mask(self, state) -> "_StateMask":
        found = self._masks.get(state)
        if found is None:
            found = self._masks[state] = self.facts.walk(self, state)
        return found

    def budget_mask(self, state, left: int) -> bytearray:
        """(V,) bytes on the host, 1 allowed: the tokens that keep the output in the grammar and its shortest
        completion within the `left` tokens left (this one included). While every allowed token fits, the
        state's cached mask; near the end, the tokens whose state after still fits."""
        found = self.mask(state)
        if found.fits(left - 1):
            return found.bits
        fits = [t for t, need in zip(found.single_ids, found.single_needs) if need <= left - 1]
        if found.need > left - 1:            # no room for another string character either: only what fits
            return self.facts.ids_mask(fits + (self.facts.eos_ids if found.ends else []))
        bits = bytearray(found.bits)
        for t in found.single_ids:
            bits[t] = 0
        for t in fits:
            bits[t] = 1
        return bits


class _StateMask:
    """The mask of a grammar state and what the budget check needs: the tokens found one by one with the
    state after each; every other allowed token (a run of string characters, prose) needs no more than the
    state itself. The needs (tokens each completion takes, its end included) cost a tokenizer call per new
    state, so they are found only when `bound`, an upper bound of them all, does not already fit."""

    def __init__(self, grammar: _Grammar, state, bits: bytearray, singles: list, ends: bool):
        self.grammar, self.state = grammar, state
        self.bits = bits                                           # (V,) 1 allowed (the ends too when complete)
        self.single_ids = [i for i, _ in singles]                  # (S,)
        self.single_afters = [after for _, after in singles]       # (S,)
        self.ends = ends                                           # the state is complete: the ends are allowed
        self.bound = max(grammar.need_at_most(s) for s in {state, *self.single_afters})
        self._needs = None

    def fits(self, room: int) -> bool:
        """Every allowed token leaves a completion of at most `room` tokens (most <= room)."""
        return self.bound <= room or self.most <= room

    def _exact(self):
        if self._needs is None:
            needs = [self.grammar.completion(after)[1] for after in self.single_afters]
            need = self.grammar.completion(self.state)[1]
            self._needs = (needs, need, max([need, *needs]))
        return self._needs

    @property
    def single_needs(self) -> list[int]:
        return self._exact()[0]                                    # (S,)

    @property
    def need(self) -> int:
        return self._exact()[1]

    @property
    def most(self) -> int:
        """The largest need after any allowed token."""
        return self._exact()[2]


def _bool_view(bits: bytearray) -> torch.Tensor:
    """(len(bits),) bool sharing the bytes' memory: masks are built with byte operations on the host, never
    with whole-vocabulary tensor ops (each of those is a thread-pool round trip, milliseconds on a busy CPU)."""
    return torch.frombuffer(bits, dtype=torch.bool)


# ---- 11b.6 The vocabulary's facts: each token's bytes classified once per tokenizer, walked as a trie. ------------

_FITS = [bytes(int(v <= limit) for v in range(256)) for limit in range(256)]   # translate tables: byte <= limit
_LONG = 253                # a clean ASCII token's length code saturates here (longer ones are checked apart)


def _utf8_chars(blob: bytes) -> int | None:
    """The characters of well-formed UTF-8 (None: not whole characters)."""
    try:
        return len(blob.decode("utf-8"))
    except UnicodeDecodeError:
        return None


def _utf8_partial(blob: bytes) -> tuple | None:
    """For bytes that are whole characters and then the start of one: (characters counted with that one, what
    it still owes as a _Str's sub); None for anything else."""
    try:
        head = codecs.getincrementaldecoder("utf-8")().decode(blob, final=False)
    except UnicodeDecodeError:
        return None
    at = max(k for k in range(len(blob)) if not _is_continuation(blob[k]))
    owed, low, high = _UTF8_LEADS.get(blob[at]) or ((1 if blob[at] < 0xE0 else 2 if blob[at] < 0xF0 else 3), 0x80, 0xBF)
    have = len(blob) - at - 1
    return len(head) + 1, (owed, low, high) if not have else (owed - have, 0x80, 0xBF)


class _Dirty:
    """One set of `dirty` bytes (a string cannot hold them as they are: JSON '"', '\\\\' and control bytes;
    raw '<'; an opener's first byte in prose) against the vocabulary, per sorted token: the index of its
    last dirty byte (-1: none) and the positions of the tokens that have one; per token id a length code
    (255 a dirty byte or no bytes, 254 a byte past ASCII, else its length, _LONG and above for long ones),
    so that "the clean tokens of at most n characters" is one bytes.translate over the vocabulary."""

    def __init__(self, facts: "_TokenFacts", dirty: frozenset):
        self.dirty_set = dirty
        table = bytes(0 if b in dirty else 1 for b in range(256))
        self.lasts = [t.translate(table).rfind(0) for t in facts.sorted]                # (N,)
        self.where = [k for k, at in enumerate(self.lasts) if at >= 0]                  # (D,)
        self.where_lasts = [self.lasts[k] for k in self.where]                          # (D,)
        code = bytearray(b"\xff") * facts.vocab                                         # (V,)
        self.long = []                                                                  # [(id, characters)]
        self.partial: dict[tuple, tuple[bytes, list[int]]] = {}   # (characters, owed) -> (a token, ids)
        for k, (i, t) in enumerate(zip(facts.order, facts.sorted)):
            if self.lasts[k] < 0:
                chars = _utf8_chars(t)
                code[i] = 254 if chars is None else min(chars, _LONG)
                if chars is not None and chars >= _LONG:
                    self.long.append((i, chars))
                elif chars is None and (key := _utf8_partial(t)) is not None:
                    self.partial.setdefault(key, (t, []))[1].append(i)
        self.code = bytes(code)
        self._groups = None
        self._fits: dict[int, bytes] = {}

    def clean(self, spare: int | None) -> bytes:
        """(V,) 1 for the tokens without a dirty byte (spare: and well-formed UTF-8, whole characters, at most
        `spare` of them)."""
        limit = 254 if spare is None else min(spare, _LONG - 1)
        found = self._fits.get(limit)
        if found is None:
            found = self._fits[limit] = self.code.translate(_FITS[limit])
        return found

    def groups(self, facts: "_TokenFacts") -> list[tuple[bytes, list[int], list[int]]]:
        """The tokens whose first dirty byte is '"' or '\\\\', grouped by their bytes from it on, sorted, as
        (suffix, ids, lengths of the clean bytes before it, -1 where those are not ASCII): a JSON string's
        clean bytes loop on its state (or only count), so such a token's fate is that suffix's."""
        if self._groups is None:
            found: dict[bytes, tuple[list, list]] = {}
            table = bytes(0 if b in self.dirty_set else 1 for b in range(256))
            for k in self.where:
                blob = facts.sorted[k]
                at = blob.translate(table).find(0)
                if at >= 0 and blob[at] in (_QUOTE, _BACKSLASH):
                    ids, lengths = found.setdefault(blob[at:], ([], []))
                    ids.append(facts.order[k])
                    chars = _utf8_chars(blob[:at])
                    lengths.append(-1 if chars is None else chars)
            self._groups = [(suffix, ids, lengths) for suffix, (ids, lengths) in sorted(found.items())]
        return self._groups


def _prose_entered(state: frozenset) -> frozenset:
    """The same state (the same bytes lead to the same stacks) with auto mode's prose already entered, as the
    walk takes prose over the vocabulary in one translate: an auto grammar's start only enters it."""
    if len(state) == 1:
        stack = next(iter(state))
        node, i = stack[-1]
        if isinstance(node, _Seq) and i < len(node.parts) and isinstance(node.parts[i], _Prose):
            return frozenset({stack + ((node.parts[i], node.parts[i].starts()[0]),)})
    return state


class _TokenFacts:
    """What the masks need to know about a vocabulary, computed once per tokenizer: every token's bytes in
    sorted order (so the tokens sharing a prefix are a range: an implicit trie, its levels kept as visited),
    and per set of dirty bytes a _Dirty (the string and prose masks at a state are then a translate
    plus the few tokens that leave the string, run through the grammar)."""

    def __init__(self, tokenizer, eos_ids):
        self.tokenizer, self.eos_ids = tokenizer, sorted(set(eos_ids))
        V = self.vocab = tokenizer.vocab_size
        blobs = [tokenizer.token_bytes(i) for i in range(V)]
        self.raw_blobs = blobs                                                              # (V,)
        control = {i for i in getattr(tokenizer, "special_ids", ()) if blobs[i].startswith(b"<|")}
        self.blobs = [b"" if i in control or i in self.eos_ids else blob for i, blob in enumerate(blobs)]
        self.by_bytes = {}
        for i, blob in enumerate(self.blobs):
            if blob:
                self.by_bytes.setdefault(blob, i)
        self.order = sorted((i for i in range(V) if self.blobs[i]), key=self.blobs.__getitem__)   # (N,) ids
        self.sorted = [self.blobs[i] for i in self.order]                                         # (N,) bytes
        self._levels: dict[tuple[int, int], dict] = {}
        self.level(0, 0, len(self.sorted))
        self.ws_only, self.ws_runs = self._whitespace()
        self.whitespace_ids = [i for i, blob in enumerate(self.blobs) if blob and not blob.strip(b" \n\t\r")]
        self._dirty = {}
        for dirty in (_JSON_DIRTY, _JSON_DIRTY | {_LT}):                   # the sets every JSON schema uses
            self.dirty(dirty).groups(self)
        self.dirty(_NON_ASCII)
        self.dirty(frozenset({_LT}))           # auto mode's prose: every call opener starts with '<'
        self._costs: dict[bytes, int] = {}
        inner = getattr(tokenizer, "_tok", None)
        self.byte_bound = bool(getattr(tokenizer, "_byte_level", False)) and \
            type(getattr(inner, "normalizer", 0)).__name__ in ("NoneType", "NFC")
        self._ids: dict[str, list[int]] = {}
        self._grammars: dict = {}

    def _whitespace(self) -> tuple[list[int], dict[int, list[tuple[int, int, int]]]]:
        """(the tokens that are only JSON whitespace, per byte c the trie nodes whitespace+ c: (depth, lo, hi)).
        Between JSON tokens a run of whitespace loops on its state, so there these tokens are allowed as a
        whole and the others are walked from their first other byte, not along every run of whitespace."""
        ws_only, runs, last = [], {}, None
        for k, blob in enumerate(self.sorted):
            m = len(blob) - len(blob.lstrip(b" \n\t"))
            if not m:
                continue
            if m == len(blob):
                ws_only.append(self.order[k])
                continue
            prefix = blob[:m + 1]
            if prefix != last:
                runs.setdefault(blob[m], []).append([m + 1, k, k + 1])
                last = prefix
            else:
                runs[blob[m]][-1][2] = k + 1
        return ws_only, {c: [tuple(r) for r in found] for c, found in runs.items()}

    def cost_at_most(self, text: bytes) -> int:
        """An upper bound of cost(text), without a tokenizer call for a byte-level BPE whose normalizer is none
        or NFC: a token holds at least one byte; decoding with "replace" and NFC each at most triple the bytes
        (ASCII stays as it is); the pre-tokenizer may add a space, and a control-token split a piece."""
        if not self.byte_bound:
            return self.cost(text)
        return len(text) + 1 if text.isascii() else 10 * len(text) + 1

    def cost(self, text: bytes) -> int:
        """Tokens `text` takes in the tokenizer's own (canonical) tokenization."""
        found = self._costs.get(text)
        if found is None:
            found = self._costs[text] = len(self.tokenizer.encode(text.decode("utf-8", "replace"))) if text else 0
        return found

    def dirty(self, dirty: frozenset) -> _Dirty:
        found = self._dirty.get(dirty)
        if found is None:
            found = self._dirty[dirty] = _Dirty(self, dirty)
        return found

    def dirty_in(self, dirty: frozenset, depth: int, lo: int, hi: int) -> list[int]:
        """The sorted positions in [lo, hi) of the tokens with a byte in `dirty` at index `depth` or later."""
        d = self.dirty(dirty)
        a, b = bisect.bisect_left(d.where, lo), bisect.bisect_left(d.where, hi)
        return [d.where[k] for k in range(a, b) if d.where_lasts[k] >= depth]

    def ids_of(self, text: str) -> list[int]:
        """The tokens that are exactly `text` (a marker such as <tool_call>)."""
        found = self._ids.get(text)
        if found is None:
            blob = text.encode()
            found = self._ids[text] = [i for i, b in enumerate(self.raw_blobs) if b == blob]
        return found

    def ids_mask(self, ids) -> bytearray:
        bits = bytearray(self.vocab)                                                        # (V,)
        for i in ids:
            bits[i] = 1
        return bits

    def walk(self, grammar: _Grammar, state) -> _StateMask:
        """The state's mask, by walking the sorted vocabulary (see _walk): at most one whole-vocabulary
        chunk (a string's or prose's clean tokens, one translate) plus ids set one by one."""
        chunks, singles = [], []
        self._walk(grammar, _prose_entered(state), 0, 0, len(self.sorted), chunks, singles)
        whole = [c for c in chunks if isinstance(c, bytes)]
        bits = bytearray(whole[0]) if whole else bytearray(self.vocab)                     # (V,)
        for chunk in chunks:
            if not isinstance(chunk, bytes):
                for i in chunk:
                    bits[i] = 1
        for i, _ in singles:
            bits[i] = 1
        ends = grammar.accepts(state)
        if ends:
            for i in self.eos_ids:
                bits[i] = 1
        return _StateMask(grammar, state, bits, singles, ends)

    def _walk(self, grammar, state, depth, lo, hi, chunks, singles):
        """Mark the tokens sorted[lo:hi], which share the `depth` bytes that led to `state`, that keep it alive."""
        blobs = self.sorted
        while depth and lo < hi and len(blobs[lo]) == depth:
            singles.append((self.order[lo], state))
            lo += 1
        if lo >= hi:
            return
        if len(state) == 1:
            stack = next(iter(state))
            node, data = stack[-1]
            if isinstance(node, _Str) and node.regex is None and not node.exclude and data[0] == 1 and \
                    not (node.utf8 and data[2]):
                return self._walk_string(grammar, state, node, data, depth, lo, hi, chunks, singles)
            if isinstance(node, _Prose) and data[2] == -1 and not data[0] and not data[1] and len(stack) == 2:
                return self._walk_free(grammar, state, node.firsts, depth, lo, hi, chunks, singles)
        level, viable = self.level(depth, lo, hi), grammar.viable(state)
        loop = grammar.whitespace_loop(state) if depth == 0 else None
        if loop is not None:                  # whitespace then b: walked from b, in the state whitespace loops on
            if loop == state:
                chunks.append(self.ws_only)
            else:
                singles.extend((i, loop) for i in self.ws_only)
            viable = viable - _WS
            for b in grammar.viable(loop) - _WS:
                nxt = grammar.step(loop, b)
                for run_depth, run_lo, run_hi in self.ws_runs.get(b, ()):
                    self._walk(grammar, nxt, run_depth, run_lo, run_hi, chunks, singles)
        for b in viable if len(viable) < len(level) else level:
            span = level.get(b) if b in viable else None
            nxt = grammar.step(state, b) if span is not None else None
            if nxt is not None:
                self._walk(grammar, nxt, depth + 1, span[0], span[1], chunks, singles)

    def level(self, depth: int, lo: int, hi: int) -> dict[int, tuple[int, int]]:
        """The trie's children of the node sorted[lo:hi] at `depth`: next byte -> its range (kept: the trie
        never changes, and walks keep visiting the same nodes)."""
        found = self._levels.get((depth, lo))
        if found is None:
            blobs, found, i = self.sorted, {}, lo
            while i < hi:
                b = blobs[i][depth]
                j = hi if b == 255 else bisect.bisect_left(blobs, blobs[i][:depth] + bytes((b + 1,)), i, hi)
                found[b] = (i, j)
                i = j
            self._levels[(depth, lo)] = found
        return found

    def _clean_in(self, d: _Dirty, depth, lo, hi, spare) -> list[int]:
        """The ids in sorted[lo:hi] (below the first level: a small range) with no dirty byte from `depth`
        on (spare: and whole characters from there, at most `spare`)."""
        lasts, order = d.lasts, self.order
        if spare is None:
            return [order[k] for k in range(lo, hi) if lasts[k] < depth]
        return [order[k] for k in range(lo, hi)
                if lasts[k] < depth and (_utf8_chars(self.sorted[k][depth:]) or spare + 1) <= spare]

    def _partials(self, grammar, state, d: _Dirty, depth, lo, hi, spare, singles):
        """The clean tokens that end inside a character, for a counted string (the grammar checks the bytes):
        over the vocabulary one run per (characters, owed) group, in a small range token by token."""
        if depth == 0:
            for (chars, _), (blob, ids) in d.partial.items():
                after = grammar.advance(state, blob) if chars <= spare else None
                if after is not None:
                    singles.extend((i, after) for i in ids)
            return
        for k in range(lo, hi):
            blob = self.sorted[k]
            if d.lasts[k] < depth and _utf8_chars(blob[depth:]) is None:
                after = grammar.advance(state, blob[depth:])
                if after is not None:
                    singles.append((self.order[k], after))

    def _walk_free(self, grammar, state, dirty, depth, lo, hi, chunks, singles, spare=None, json_string=False):
        """Tokens whose bytes from `depth` on hold nothing in `dirty` keep the state alive (spare: also if they
        fit); the others are run through the grammar one by one (json_string: only those whose first dirty
        byte is '"' or '\\\\'; a JSON string takes no other)."""
        d = self.dirty(dirty)
        if depth == 0:
            chunks.append(d.clean(spare))
            if spare is not None and spare >= _LONG:
                chunks.append([i for i, n in d.long if n <= spare])
        else:
            chunks.append(self._clean_in(d, depth, lo, hi, spare))
        if spare is not None:                      # a counted string: also the tokens that end inside a character
            self._partials(grammar, state, d, depth, lo, hi, spare, singles)
        for at in self.dirty_in(dirty, depth, lo, hi):
            blob = self.sorted[at]
            if json_string:
                first = next(p for p in range(depth, len(blob)) if blob[p] in dirty)
                if blob[first] not in (_QUOTE, _BACKSLASH):
                    continue
            after = grammar.advance(state, blob[depth:])
            if after is not None:
                singles.append((self.order[at], after))

    def _walk_string(self, grammar, state, node, data, depth, lo, hi, chunks, singles):
        counted = node.counted and not node.raw
        if depth == 0 and (node.plain or counted):
            return self._walk_exits(grammar, state, node, data[1], chunks, singles)
        if not node.plain:
            spare = node.hi - data[1] if node.hi is not None else 1 << 30 if node.ascii else None
            return self._walk_free(grammar, state, node.dirty, depth, lo, hi, chunks, singles, spare,
                                   json_string=not node.raw)
        # unbounded JSON string content: clean bytes loop on this state, so a token's fate is its suffix from
        # its first byte that is not clean
        d = self.dirty(node.dirty)
        chunks.append(self._clean_in(d, depth, lo, hi, None))
        results: dict[bytes, frozenset | None] = {}
        for at_token in self.dirty_in(node.dirty, depth, lo, hi):
            blob = self.sorted[at_token]
            at = next(p for p in range(depth, len(blob)) if blob[p] in node.dirty)
            if blob[at] < 0x20 or blob[at] == _LT:
                continue
            suffix = blob[at:]
            if suffix not in results:
                results[suffix] = grammar.advance(state, suffix)
            if results[suffix] is not None:
                singles.append((self.order[at_token], results[suffix]))

    def _walk_exits(self, grammar, state, node: _Str, count: int, chunks, singles):
        """A JSON string's content (no pattern, no excluded keys) over the whole vocabulary: its clean tokens
        (that fit, when counted: whole characters) in one translate, then the tokens that leave it, by suffix
        ('"' then what follows: one run through the grammar per suffix from the closed string's state, kept per
        that state; an escape: one run per suffix and count of clean characters before it)."""
        d = self.dirty(node.dirty)
        spare = None
        if node.counted:
            spare = node.hi - count if node.hi is not None else 1 << 30
            if spare >= _LONG:
                chunks.append([i for i, n in d.long if n <= spare])
        chunks.append(d.clean(spare))
        if node.utf8:
            self._partials(grammar, state, d, 0, 0, len(self.sorted), spare, singles)
        least = max(0, node.lo - count) if node.counted else 0      # characters still owed before the quote
        start = grammar.advance(state, b"a" * least) if least <= (1 << 30 if spare is None else spare) else None
        closed = grammar.step(start, _QUOTE) if start is not None else None
        for ids, lengths, after in self._closed_exits(grammar, d, closed) if closed is not None else ():
            singles.extend((i, after) for i, n in zip(ids, lengths) if spare is None or least <= n <= spare)
        moved = [state]          # after n whole clean characters (as after n "a"s); a plain string loops
        for suffix, ids, lengths in d.groups(self):
            if suffix[0] != _BACKSLASH:
                continue
            for i, n in zip(ids, lengths):
                if spare is not None and not 0 <= n <= spare:
                    continue
                n = 0 if spare is None else n
                while len(moved) <= n:
                    moved.append(grammar.step(moved[-1], 0x61) if moved[-1] is not None else None)
                after = grammar.escape(moved[n], suffix) if moved[n] is not None else None
                if after is not None:
                    singles.append((i, after))

    def _closed_exits(self, grammar, d: _Dirty, closed) -> list[tuple[list[int], list[int], frozenset]]:
        """The '"'-first groups of d that live on from `closed` (the state after a string's closing quote) as
        (ids, lengths, state after), kept per state: a closed string forgets its count, so every count of a
        counted string (a new state each) meets the same exits."""
        found = grammar._exits.get((d.dirty_set, closed))
        if found is None:
            found, dead = [], None
            for suffix, ids, lengths in d.groups(self):      # sorted: a dead prefix skips its whole run
                if suffix[0] != _QUOTE or dead is not None and suffix.startswith(dead):
                    continue
                after = closed
                for k in range(1, len(suffix)):
                    after = grammar.step(after, suffix[k])
                    if after is None:
                        dead = suffix[:k + 1]
                        break
                else:
                    found.append((ids, lengths, after))
            grammar._exits[(d.dirty_set, closed)] = found
        return found

    def grammar(self, key, build) -> _Grammar:
        """The compiled grammar for `key` (built by build() on first use); the last 64 are kept."""
        found = self._grammars.pop(key, None) or _Grammar(build(), self)
        self._grammars[key] = found
        while len(self._grammars) > 64:
            self._grammars.pop(next(iter(self._grammars)))
        return found


_TOKEN_FACTS: dict[tuple, _TokenFacts] = {}


def _token_facts(tokenizer, eos_ids) -> _TokenFacts:
    key = (id(tokenizer), tuple(sorted(set(eos_ids))))
    facts = _TOKEN_FACTS.get(key)
    if facts is None or facts.tokenizer is not tokenizer:
        facts = _TOKEN_FACTS[key] = _TokenFacts(tokenizer, eos_ids)
        gc.collect()     # the build's many containers would make the next full collection (~0.1 s) due in a request
    return facts


# ---- 11b.7 JSON Schema -> grammar nodes: the compiler, and each tool-call argument's value. -----------------------

def _any_json(no_lt: bool) -> _Union:
    """Any JSON value (json_object's members, `{}`, `true`); no_lt: no '<' in its strings (inside calls)."""
    node = _Union([])
    node.options += [_Obj([], node, no_lt), _Arr([], node), _Str(no_lt=no_lt), _Num(), _Choice([b"true", b"false", b"null"])]
    return node


_ANY, _ANY_IN_CALL = _any_json(False), _any_json(True)
_SCHEMA_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")
SCHEMA_ANNOTATIONS = ("description", "title", "default", "examples", "format", "$schema", "$id", "$comment",
                      "deprecated", "readOnly", "writeOnly", "discriminator", "$defs", "definitions")
SCHEMA_KEYWORDS = ("type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
                   "maxItems", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "nullable", "minLength",
                   "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "pattern")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _number_bound(value, exclusive: bool, upper: bool) -> fractions.Fraction:
    """The inclusive bound, exact, that keeps a written number inside `value` once a client parses it: below
    2**53 the shortest decimal of the float bound (all numbers up to it round to at most the float), an
    exclusive bound first moved to the next float inside (so no number rounds onto it)."""
    if isinstance(value, int) and not exclusive:
        return fractions.Fraction(value)
    f = float(value)
    if exclusive:
        f = math.nextafter(f, -math.inf if upper else math.inf)
    return fractions.Fraction(repr(f)) if abs(f) < 2 ** 53 else fractions.Fraction(f)


def _shapes_disjoint(a, b) -> bool:
    """No JSON value matches both shapes (_SchemaCompiler._shape): their types or finite values exclude each
    other, both require a property whose finite values differ, or (objects only) one requires a property
    that the other's additionalProperties: false forbids."""
    (types_a, values_a, keys_a, fields_a), (types_b, values_b, keys_b, fields_b) = a, b
    if values_a is not None and values_b is not None:
        return not values_a & values_b
    if types_a is not None and types_b is not None:
        wide = {"number", "integer"}
        common = types_a & types_b | (wide if wide & types_a and wide & types_b else set())
        if not common:
            return True
        if common != {"object"}:
            return False
        (required_a, closed_a), (required_b, closed_b) = fields_a, fields_b
        if closed_b is not None and required_a - closed_b or closed_a is not None and required_b - closed_a:
            return True
    return any(name in keys_b and not keys_a[name] & keys_b[name] for name in keys_a)


class _SchemaCompiler:
    """One schema (`root`, named `where` in errors) -> grammar nodes. A mistake is a RequestError naming its
    JSON path (`response_format.json_schema.schema.properties.x.type`); a keyword outside SCHEMA_KEYWORDS is
    a 400 under `strict`, otherwise it is not enforced (docs/api.md lists them). Annotations are accepted."""

    def __init__(self, root, where: str, strict: bool, in_call: bool = False):
        self.root, self.where, self.strict, self.in_call = root, where, strict, in_call
        self.any = _ANY_IN_CALL if in_call else _ANY
        self.refs: dict[str, _Ref] = {}
        self.count = 0

    def fail(self, path: str, message: str):
        raise RequestError(f"'{path}' {message}", param=path)

    def unsupported(self, path: str, why: str) -> None:
        """Under strict a 400; otherwise the keyword is decoded without."""
        if self.strict:
            raise RequestError(f"'{path}' {why} (not supported with strict: true)", param=path,
                               code="unsupported_field")

    def compile(self, schema, path: str) -> _Node:
        self.count += 1
        if self.count > _MAX_NODES:
            self.fail(self.where, f"is too large for structured output (over {_MAX_NODES} schemas)")
        if schema is True:
            return self.any
        if schema is False:
            self.fail(path, "is false: no value is valid")
        if not isinstance(schema, dict):
            self.fail(path, f"must be a JSON schema (an object or a boolean), got {_json_type(schema)}")
        for key in schema:
            if key not in SCHEMA_KEYWORDS and key not in SCHEMA_ANNOTATIONS:
                self.unsupported(f"{path}.{key}", "is not a keyword structured output enforces")
        if "$ref" in schema:
            return self.ref(schema["$ref"], f"{path}.$ref")
        if "allOf" in schema:
            merged = {k: v for k, v in schema.items() if k != "allOf"}
            for k, part in enumerate(self._schemas(schema["allOf"], f"{path}.allOf")):
                merged = self._merge(merged, self._deref(part, f"{path}.allOf[{k}]"))
            return self.compile(merged, path)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                shared = {k: v for k, v in schema.items() if k not in (key, "nullable") and k not in SCHEMA_ANNOTATIONS}
                parts = [self._merge(shared, self._deref(part, f"{path}.{key}[{k}]")) if shared else part
                         for k, part in enumerate(self._schemas(schema[key], f"{path}.{key}"))]
                if key == "oneOf":
                    self._exclusive(parts, f"{path}.oneOf")
                options = [self.compile(part, f"{path}.{key}[{k}]") for k, part in enumerate(parts)]
                return _Union(options + ([_Choice([b"null"])] if schema.get("nullable") is True else []))
        types = self._types(schema, path)
        if "enum" in schema or "const" in schema:
            return self._choice(schema, types, path)
        if types is None:
            return self.any
        options = [getattr(self, "_" + kind)(schema, path) for kind in types]
        return options[0] if len(options) == 1 else _Union(options)

    def _exclusive(self, parts, path) -> None:
        """oneOf is decoded as anyOf, which is exact when no value can match two branches: checked here, pair by
        pair, by type (integer within number), by a required property whose const/enum values differ (a
        discriminated union) or that the other branch forbids (_shapes_disjoint). Branches that may overlap are a
        400 under strict (as anyOf they could give a value that matches two, and exactly-one is not a grammar);
        without strict they are decoded as anyOf, like the other keywords strict alone enforces: one overlapping
        oneOf in an agent's tool list must not refuse the whole request."""
        shapes = [self._shape(self._deref(part, f"{path}[{k}]")) for k, part in enumerate(parts)]
        for k, l in itertools.combinations(range(len(parts)), 2):
            if not _shapes_disjoint(shapes[k], shapes[l]):
                return self.unsupported(path, f"has branches {k} and {l} that one value may match (oneOf is "
                                        "enforced where its branches differ by type or by a required const/enum "
                                        "property; write anyOf if a value may match several)")

    def _shape(self, schema, depth: int = 0):
        """(types or None: any, finite values or None, {required property: its finite values}, (required
        properties, the properties allowed when additionalProperties is false else None)) of a schema."""
        try:
            schema = self._deref(schema, self.where) if isinstance(schema, dict) and depth <= 8 else True
        except RequestError:
            schema = True                                 # a dangling $ref: compile() names its path
        if not isinstance(schema, dict):
            return None, None, {}, (frozenset(), None)
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                inner = [self._shape(part, depth + 1) for part in schema[key]]
                types = None if any(t is None for t, *_ in inner) else set().union(*(t for t, *_ in inner))
                values = None if any(v is None for _, v, *_ in inner) else set().union(*(v for _, v, *_ in inner))
                return types, values, {}, (frozenset(), None)
        values = [schema["const"]] if "const" in schema else schema.get("enum")
        values = {json.dumps(v, sort_keys=True) for v in values} if isinstance(values, list) else None
        kind = schema.get("type")
        types = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else None
        if types is None and values is not None:
            types = {_json_type_name(json.loads(v)) for v in values}
        if types is not None and schema.get("nullable") is True:
            types.add("null")
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        keys = {}
        for name in required:
            _, found, *_ = self._shape(properties.get(name, True), depth + 1)
            if found is not None:
                keys[name] = found
        closed = frozenset(properties) if schema.get("additionalProperties") is False and \
            "patternProperties" not in schema else None
        return types, values, keys, (frozenset(n for n in required if isinstance(n, str)), closed)

    def _schemas(self, value, path) -> list:
        if not isinstance(value, list) or not value:
            self.fail(path, "must be a non-empty array of schemas")
        return value

    def _types(self, schema, path) -> list[str] | None:
        kind = schema.get("type")
        if kind is None:
            kinds = ["object"] if {"properties", "additionalProperties", "required"} & set(schema) else \
                ["array"] if {"items", "prefixItems", "minItems", "maxItems"} & set(schema) else \
                ["string"] if {"minLength", "maxLength", "pattern"} & set(schema) else \
                ["number"] if set(_BOUNDS) & set(schema) else None
        else:
            kinds = [kind] if isinstance(kind, str) else kind
            if not isinstance(kinds, list) or not kinds or any(k not in _SCHEMA_TYPES for k in kinds):
                self.fail(f"{path}.type", f"must be one of {', '.join(_SCHEMA_TYPES)} or a non-empty array of them")
        if kinds is not None and schema.get("nullable") is True and "null" not in kinds:
            kinds = [*kinds, "null"]
        return None if kinds is None else list(dict.fromkeys(kinds))

    def _choice(self, schema, types, path) -> _Node:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list) or not values:
            self.fail(f"{path}.enum", "must be a non-empty array")
        if types is not None:
            values = [v for v in values if _json_type_name(v) in types or
                      (_json_type_name(v) == "integer" and "number" in types)]
            if schema.get("nullable") is True:
                values.append(None)
        if not values:
            self.fail(path, "admits no value: none of its enum values has its type")
        try:
            return _Choice([json.dumps(v, ensure_ascii=False, allow_nan=False).encode() for v in values])
        except ValueError:
            self.fail(f"{path}.enum", "must hold finite numbers")

    def _count(self, schema, key, path) -> int | None:
        value = schema.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            self.fail(f"{path}.{key}", f"must be a non-negative integer, got {json.dumps(value)}")
        return value

    def _object(self, schema, path) -> _Node:
        properties = schema.get("properties") or {}
        if not isinstance(properties, dict):
            self.fail(f"{path}.properties", f"must be an object of schemas, got {_json_type(properties)}")
        required = schema.get("required") or []
        if not isinstance(required, list) or not all(isinstance(k, str) for k in required):
            self.fail(f"{path}.required", "must be an array of property names")
        extra = schema.get("additionalProperties", True if "properties" not in schema else False)
        missing = [k for k in required if k not in properties]     # written with any value (unless forbidden)
        if missing and schema.get("additionalProperties") is False:
            self.fail(f"{path}.required", f"requires {missing[0]!r}, which additionalProperties: false forbids")
        if extra is False:
            extra = None
        else:
            extra = self.any if extra is True else self.compile(extra, f"{path}.additionalProperties")
        members = [(k, self.compile(v, f"{path}.properties.{k}"), k in required) for k, v in properties.items()]
        members += [(k, self.any, True) for k in dict.fromkeys(required) if k not in properties]
        return _Obj(members, extra, self.in_call)

    def _array(self, schema, path) -> _Node:
        prefix = schema.get("prefixItems") or []
        if not isinstance(prefix, list):
            self.fail(f"{path}.prefixItems", "must be an array of schemas")
        prefix = [self.compile(s, f"{path}.prefixItems[{k}]") for k, s in enumerate(prefix)]
        items = schema.get("items", False if prefix else True)
        if isinstance(items, list):
            self.fail(f"{path}.items", "must be a schema (write a tuple's schemas as prefixItems)")
        items = None if items is False else self.any if items is True else self.compile(items, f"{path}.items")
        lo, hi = self._count(schema, "minItems", path) or 0, self._count(schema, "maxItems", path)
        if hi is not None and lo > hi or items is None and lo > len(prefix):
            self.fail(f"{path}.minItems", "admits no array: minItems is above the items there may be")
        return _Arr(prefix, items, lo, hi)

    def _string(self, schema, path, raw=False) -> _Node:
        lo, hi = self._count(schema, "minLength", path) or 0, self._count(schema, "maxLength", path)
        if hi is not None and lo > hi:
            self.fail(f"{path}.minLength", "is above maxLength")
        regex = None
        pattern = schema.get("pattern")
        if pattern is not None:
            if not isinstance(pattern, str):
                self.fail(f"{path}.pattern", "must be a string")
            try:
                re.compile(pattern)
            except re.error as e:
                self.fail(f"{path}.pattern", f"is not a regular expression ({e})")
            try:
                regex = _Regex(pattern)
            except ValueError as e:
                self.unsupported(f"{path}.pattern", f"is a pattern the decoder cannot follow ({e})")
            if regex is not None and (lo or hi is not None):
                self.unsupported(f"{path}.minLength", "with a pattern is not enforced")
                lo, hi = 0, None
        return _Str(lo, hi, regex, raw=raw, no_lt=self.in_call)

    def _bounds_checked(self, schema, path) -> None:
        for key in _BOUNDS:
            value = schema.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or
                                      not math.isfinite(value)):
                self.fail(f"{path}.{key}", "must be a finite number")

    def _integer(self, schema, path) -> _Node:
        self._bounds_checked(schema, path)
        lows = ([math.ceil(schema["minimum"])] if "minimum" in schema else []) + \
            ([math.floor(schema["exclusiveMinimum"]) + 1] if "exclusiveMinimum" in schema else [])
        highs = ([math.floor(schema["maximum"])] if "maximum" in schema else []) + \
            ([math.ceil(schema["exclusiveMaximum"]) - 1] if "exclusiveMaximum" in schema else [])
        lo, hi = max(lows, default=None), min(highs, default=None)
        if lo is not None and hi is not None and lo > hi:
            self.fail(f"{path}.minimum", "is above maximum: no integer is valid")
        return _Int(lo, hi)

    def _number(self, schema, path) -> _Node:
        """Bounds as exact fractions that keep the number in range however a client parses it (as a float or
        an exact integer); a bounded number is written without an exponent (_Decimal)."""
        self._bounds_checked(schema, path)
        lows = [_number_bound(schema[k], k == "exclusiveMinimum", False) for k in ("minimum", "exclusiveMinimum")
                if schema.get(k) is not None]
        highs = [_number_bound(schema[k], k == "exclusiveMaximum", True) for k in ("maximum", "exclusiveMaximum")
                 if schema.get(k) is not None]
        if not lows and not highs:
            return _Num()
        node = _Decimal(max(lows, default=None), min(highs, default=None))
        if node.shortest() is None:
            self.fail(f"{path}.minimum" if "minimum" in schema else path, "admits no number: the bounds exclude "
                      f"every value of at most {_MAX_NUMBER} characters")
        return node

    def _boolean(self, schema, path) -> _Node:
        return _Choice([b"true", b"false"])

    def _null(self, schema, path) -> _Node:
        return _Choice([b"null"])

    def _pointer(self, ref, path):
        """(target schema, its path) for a local $ref such as #/$defs/Name."""
        if not isinstance(ref, str):
            self.fail(path, "must be a string")
        if ref != "#" and not ref.startswith("#/"):
            self.fail(path, f"points to {ref!r}: only references inside the schema (#/$defs/...) are supported")
        target, where = self.root, self.where
        for part in ref[2:].split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target, where = target[int(part)], f"{where}[{part}]"
            elif isinstance(target, dict) and part in target:
                target, where = target[part], f"{where}.{part}"
            else:
                self.fail(path, f"points to {ref!r}, which is not in the schema")
        return target, where

    def ref(self, ref, path) -> _Node:
        found = self.refs.get(ref)
        if found is None:
            target, where = self._pointer(ref, path)
            found = self.refs[ref] = _Ref()
            found.target = self.compile(target, where)
        return found

    def _deref(self, schema, path, depth=0):
        """A schema with a $ref at its top replaced by what it points to (for merging allOf parts)."""
        if isinstance(schema, dict) and "$ref" in schema and depth < 16:
            target, _ = self._pointer(schema["$ref"], f"{path}.$ref")
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            return self._merge(self._deref(target, path, depth + 1), rest) if rest else self._deref(target, path, depth + 1)
        return schema

    def _merge(self, a, b) -> dict:
        """allOf of two schemas as one: properties and required joined, types intersected, bounds tightened."""
        if b is True:
            return a
        if not isinstance(a, dict) or not isinstance(b, dict):
            self.fail(self.where, "has an allOf part that is not an object schema")
        out = dict(a)
        for key, value in b.items():
            if key not in out:
                out[key] = value
            elif key == "properties" and isinstance(value, dict) and isinstance(out[key], dict):
                out[key] = {**out[key], **{k: {"allOf": [out[key][k], v]} if k in out[key] else v for k, v in value.items()}}
            elif key == "required" and isinstance(value, list) and isinstance(out[key], list):
                out[key] = list(dict.fromkeys(out[key] + value))
            elif key == "type":
                mine = {out[key]} if isinstance(out[key], str) else set(out[key])
                theirs = {value} if isinstance(value, str) else set(value)
                both = [t for t in _SCHEMA_TYPES if t in mine & theirs] or \
                    (["integer"] if "integer" in mine | theirs and "number" in mine | theirs else [])
                if not both:
                    self.fail(self.where, f"has allOf parts whose types {sorted(mine)} and {sorted(theirs)} exclude each other")
                out[key] = both
            elif key in ("minimum", "minLength", "minItems", "exclusiveMinimum"):
                out[key] = max(out[key], value)
            elif key in ("maximum", "maxLength", "maxItems", "exclusiveMaximum"):
                out[key] = min(out[key], value)
        return out


def compile_schema(schema, where: str, strict: bool) -> _Node:
    """A JSON schema -> its grammar node; RequestError naming the JSON path of what is wrong (or, under
    strict, not enforced), and for a schema that no finite value satisfies (a required self-reference)."""
    node = _SchemaCompiler(schema, where, strict).compile(schema, where)
    if node.shortest() is None:
        raise RequestError(f"'{where}' admits no finite value (a required property refers back to itself)",
                           param=where)
    return node


_NODE_KINDS = {_Str: "string", _Int: "integer", _Num: "number", _Decimal: "number", _Obj: "object", _Arr: "array"}


def _kind_leaves(node: _Node, kinds: set, seen: set) -> list[_Node]:
    """The alternatives of a compiled value (unions and $refs opened) that write values of `kinds` (an
    integer counting as a number): nodes as they are, enum / const values filtered."""
    if isinstance(node, (_Union, _Ref)):
        if id(node) in seen:
            return []
        seen.add(id(node))
        options = node.options if isinstance(node, _Union) else [node.target]
        return [leaf for option in options for leaf in _kind_leaves(option, kinds, seen)]
    if isinstance(node, _Choice):
        texts = [t for t in node.texts if _json_type_name(json.loads(t)) in kinds or
                 _json_type_name(json.loads(t)) == "integer" and "number" in kinds]
        return [_Choice(texts)] if texts else []
    kind = _NODE_KINDS.get(type(node))
    return [node] if kind in kinds or kind == "integer" and "number" in kinds else []


def _misread_starts(kinds) -> frozenset:
    """The first bytes of a raw string that the parser could read as one of `kinds` (it strips whitespace,
    reads null / None and booleans in any case, numbers as JSON, objects and arrays as JSON or Python
    literals): whitespace, Unicode whitespace's UTF-8 leads (C2 E1 E2 E3: conservative) and each kind's."""
    starts = {"integer": b"-0123456789", "number": b"-0123456789", "object": b"{(", "array": b"[(",
              "boolean": b"tTfF", "null": b"nN"}
    return frozenset(b" \t\n\r\xc2\xe1\xe2\xe3" + b"".join(starts.get(kind, b"") for kind in kinds))


def _xml_value(compiler: _SchemaCompiler, schema, root, path) -> _Node:
    """A Qwen XML argument's value, which the parser reads by _schema_types(schema, root) in order: raw text
    for the string alternatives (only if no earlier type could read it: its first byte is guarded), JSON for
    the non-string types before them; types after "string" are never read, so never written."""
    node = compiler.compile(schema, path)
    kinds = _schema_types(schema, root)
    if "string" not in kinds:                          # JSON values (any value: the parser tries JSON first)
        return node
    before = kinds[:kinds.index("string")]
    options = _kind_leaves(node, set(before), set()) if before else []
    for leaf in _kind_leaves(node, {"string"}, set()):
        if isinstance(leaf, _Choice):                  # enum / const strings, kept where they read back as themselves
            values = [v for v in map(json.loads, leaf.texts) if "<" not in v and _convert_value(v, kinds) == v]
            options += [_Choice([v.encode() for v in values])] if values else []
            continue
        raw = _Str(leaf.lo, leaf.hi, leaf.regex, raw=True, nonblank=not (leaf.lo or leaf.regex), no_lt=True)
        options.append(_Guard(raw, _misread_starts(before)) if before else raw)
    if not options:
        compiler.fail(path, "admits no value a Qwen XML argument can carry")
    return options[0] if len(options) == 1 else _Union(options)


def _call_members(fmt: ToolCallFormat, parameters, where: str, strict: bool) -> list:
    """A function's arguments [(key, value node, required)] in schema order, values as the format writes
    them (Qwen XML: _xml_value; JSON otherwise)."""
    parameters = {} if parameters is None else parameters
    compiler = _SchemaCompiler(parameters, where, strict, in_call=True)
    function = _tool_function("", parameters, where)
    members = []
    for key, schema in function.properties.items():
        path = f"{where}.properties.{key}"
        if fmt.json_values:
            node = compiler.compile(schema, path)
            if isinstance(node, _Str) and not (node.lo or node.regex):             # never an empty argument
                node = _Str(node.lo, node.hi, raw=node.raw, nonblank=True, no_lt=True)
        else:
            node = _xml_value(compiler, schema, parameters, path)
        if node.shortest() is None:
            raise RequestError(f"'{path}' admits no finite value", param=path)
        members.append((key, node, key in function.required))
    return members + [(key, _ANY_IN_CALL, True) for key in function.required if key not in function.properties]


def _call_node(fmt: ToolCallFormat, functions: dict, names, lead: str, opener: str = "") -> _Node:
    """One call to one of `names`: the format's head (after `opener`, when the model already wrote it),
    the arguments, the tail."""
    options = []
    for name in names:
        head = fmt.call_head(lead, name)
        at = head.find(opener) if opener else 0
        if at >= 0:
            options.append(_Seq([_Lit(head[at + len(opener):].encode()), _Members(fmt, functions[name])]))
    return _Union(options)


def _tool_members(tools, fmt) -> dict:
    """name -> argument members, for every function a request offers (schemas checked here)."""
    functions = {}
    for i, tool in enumerate(tools or []):
        function = tool["function"]
        functions[function["name"]] = _call_members(fmt, function.get("parameters"),
                                                    f"tools[{i}].function.parameters", function.get("strict") is True)
    return functions


# ---- 11b.8 The decoder: a request's response_format and tool_choice as one grammar, a logits processor. -----------

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")


def response_schema(response_format, param: str = "response_format") -> tuple[object, str, bool] | None:
    """(schema, its path, strict) of a response_format, None for text; RequestError naming the path."""
    if response_format is None:
        return None
    fmt = _check_type(response_format, dict, param)
    kind = fmt.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise RequestError(f"'{param}.type' must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r}",
                           param=f"{param}.type")
    _only_keys(fmt, ("type", "json_schema") if kind == "json_schema" else ("type",), param)
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}, f"{param}", False
    spec = _check_type(fmt.get("json_schema"), dict, f"{param}.json_schema")
    _only_keys(spec, JSON_SCHEMA_KEYS, f"{param}.json_schema")
    for key, kind in (("name", str), ("description", str), ("strict", bool)):
        if spec.get(key) is not None:
            _check_type(spec[key], kind, f"{param}.json_schema.{key}")
    schema = spec.get("schema", True)
    return schema, f"{param}.json_schema.schema", spec.get("strict") is True


def _output_grammar(tools, choice, fmt, parallel, response, in_reasoning):
    """(root node, whether reasoning comes first, whether the answer must be complete) for a request, or
    (None, ...) when only the call token is to be banned."""
    lead = "\n\n" if in_reasoning else ""
    json_root = compile_schema(*response) if response is not None else None
    if choice == "none" or not tools:
        return (None if json_root is None else _Seq([_Lit(lead.encode()), json_root])), in_reasoning, True
    functions = _tool_members(tools, fmt)
    names = list(functions) if choice in ("auto", "required") else [choice]
    calls = _Repeat(_call_node(fmt, functions, names, lead), _call_node(fmt, functions, names, "\n"),
                    None if parallel and choice in ("auto", "required") else 1)
    if choice != "auto":
        return calls, in_reasoning, True
    if json_root is not None:
        return _Union([calls, _Seq([_Lit(lead.encode()), json_root])]), in_reasoning, False
    openers = {o.encode(): _call_node(fmt, functions, names, "", o) for o in (fmt.call_open, *fmt.bare_opens) if o}
    return _Prose(openers, None if parallel else 1), False, False


class StructuredDecoder:
    """The SamplingParams.logits_processors entry of structured output. token_mask(ids, size, device) is the
    (size,) bool mask of the tokens that may follow a choice's generated `ids` (None: no constraint); it is a
    pure function of ids (a speculative draft may ask for ids + draft[:k]), computed on the host and cached
    per grammar state. Called as proc(ids, logits) it returns the masked logits (one row).

    Per choice a cursor (phase, state, tail) follows the ids: "think" (free, no end and no call token,
    until </think>, or until only the forced close and the shortest answer fit: then the close is forced),
    "grammar" (the grammar's state), "free" (only banned tokens), "off" (a token the mask did not allow was
    sampled, as when another constraint emptied it: no constraint from then on), "end". In the grammar a
    token is allowed when the shortest completion after it still fits in max_tokens, so the answer always
    closes within max_tokens. budget=False (auto mode) keeps that only inside calls: prose and reasoning run to
    max_tokens as without a grammar (cut: finish_reason length), and a call is opened only when it can close.
    min_tokens (a JSON answer only): while fewer tokens exist, a complete value may also be followed by
    whitespace-only tokens (JSON text allows trailing whitespace; phase "pad": only those, until min_tokens), so
    the sampler's ban of the end never empties the mask."""

    def __init__(self, facts: _TokenFacts, grammar: _Grammar | None, ban: list[int], think: bool, max_tokens: int,
                 budget: bool = True, min_tokens: int = 0):
        self.facts, self.grammar, self.ban = facts, grammar, ban
        self.max_tokens, self.budget, self.min_tokens = max_tokens, budget, min_tokens
        self.think = think and grammar is not None
        self.forced = grammar.start_after(_THINK_FORCED_CLOSE) if self.think else None
        self.reads_ids = grammar is not None     # else the mask is the ban, whatever came before (async scheduling)
        self._cursors: dict = {}
        self._host: dict[str, torch.Tensor] = {}
        self._device: dict = {}

    def smallest(self) -> int:
        """Tokens the shortest complete answer takes (its end included)."""
        return self.grammar.completion(self.forced if self.think else self.grammar.start)[1]

    def _start(self):
        return ("think", None, b"") if self.think else ("grammar", self.grammar.start, b"") if self.grammar \
            else ("free", None, b"")

    def _settle(self, cursor, used: int):
        if cursor[0] == "think" and self.budget and self.max_tokens - used - 1 < self.smallest():
            return ("grammar", self.forced, b"")
        return cursor

    def _advance(self, cursor, used: int, token: int):
        phase, state, tail = self._settle(cursor, used)
        if phase == "think":
            tail = (tail + self.facts.tokenizer.token_bytes(token))[-2 * len(_THINK_CLOSE):]
            return ("grammar", self.grammar.start, b"") if _THINK_CLOSE.encode() in tail else ("think", None, tail)
        if phase in ("grammar", "pad"):
            if token in self.facts.eos_ids:
                return ("end", None, b"")
            blob = self.facts.blobs[token] if 0 <= token < self.facts.vocab else b""
            after = self.grammar.advance(state, blob) if blob and phase == "grammar" else None
            if after is None and used < self.min_tokens and self.grammar.accepts(state) and blob and \
                    not blob.strip(b" \n\t\r"):
                return ("pad", state, b"")      # whitespace after the complete value, toward min_tokens
            return ("off", None, b"") if after is None else ("grammar", after, b"")
        return (phase, state, tail)

    def cursor(self, ids):
        key = (len(ids), tuple(ids[-16:]))
        found = self._cursors.get(key)
        if found is None:
            before = self._cursors.get((len(ids) - 1, tuple(ids[-17:-1]))) if ids else None
            if before is not None:
                found = self._advance(before, len(ids) - 1, ids[-1])
            else:                          # the first call for this choice, or choices that shared a prefix split
                found = self._start()
                for used, token in enumerate(ids):
                    found = self._advance(found, used, token)
            if len(self._cursors) > 4096:
                self._cursors.clear()
            self._cursors[key] = found
        return self._settle(found, len(ids))

    def allowed(self, ids):
        """The host-side answer: a cache key and the (V,) mask for it as bytes (1 allowed), or None."""
        phase, state, _ = self.cursor(ids)
        if phase in ("off", "end"):
            return None
        if phase in ("think", "free"):
            found = self._host.get(phase)
            if found is None:
                found = self._host[phase] = bytearray(b"\x01") * self.facts.vocab
                for t in self.ban + (self.facts.eos_ids if phase == "think" else []):
                    found[t] = 0
            return phase, found
        left = self.max_tokens - len(ids)
        if phase == "pad" or len(ids) < self.min_tokens and self.grammar.accepts(state):
            return self._padded(state, phase == "pad", len(ids) < self.min_tokens)
        found = self.grammar.mask(state)
        if found.fits(left - 1):
            return state, found.bits
        if not self.budget and found.ends:   # auto mode, in prose: no forced end; no call that cannot close
            bits = bytearray(found.bits)
            for t, need in zip(found.single_ids, found.single_needs):
                if need > left - 1:
                    bits[t] = 0
            return None, bits
        bits = self.grammar.budget_mask(state, left)
        return None, bits if 1 in bits else self.facts.ids_mask(self._closing(state, left))

    def _padded(self, state, padding: bool, grow: bool):
        """min_tokens at a complete value: before it, the value's own mask and the whitespace-only tokens; once
        whitespace follows the value (`padding`), only more of it while the answer must `grow`, then the end."""
        key = ("pad", None if padding else state, padding, grow)
        found = self._host.get(key)
        if found is None:
            if padding:
                found = self.facts.ids_mask(self.facts.whitespace_ids if grow else self.facts.eos_ids)
            else:
                found = bytearray(self.grammar.mask(state).bits)
                for t in self.facts.whitespace_ids:
                    found[t] = 1
            self._host[key] = found
        return key, found

    def _closing(self, state, left: int) -> list[int]:
        """Near the end of the budget: the tokens that start the shortest completion and keep it in budget."""
        grammar = self.grammar
        text, _ = grammar.completion(state)
        if not text:
            return self.facts.eos_ids
        found = []
        for k in range(1, min(len(text), 64) + 1):
            token = self.facts.by_bytes.get(text[:k])
            after = grammar.advance(state, text[:k]) if token is not None else None
            if after is not None and grammar.completion(after)[1] <= left - 1:
                found.append(token)
        return found or self.facts.tokenizer.encode(text.decode("utf-8", "replace"))[:1]

    def prepare_mask(self, ids) -> None:
        """The host work of token_mask (kept in the grammar's caches), for the sampler to do for every row while
        the forward pass is still in flight, before any copy to the device waits for it."""
        self.allowed(ids)

    def token_mask(self, ids, size: int, device) -> torch.Tensor | None:
        found = self.allowed(ids)
        if found is None:
            return None
        key, bits = found
        cached = self._device.get((key, size, str(device))) if key is not None else None
        if cached is None:
            row = bytearray(size)                                                   # (size,): logit rows
            n = min(size, len(bits))
            row[:n] = bits[:n]
            cached = _bool_view(row).to(device)
            if key is not None:
                if len(self._device) > 256:
                    self._device.clear()
                self._device[(key, size, str(device))] = cached
        return cached

    def __call__(self, ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        mask = self.token_mask(ids, logits.numel(), logits.device)
        if mask is None:
            return logits
        out = logits.masked_fill(~mask, float("-inf"))
        return out if bool(torch.isfinite(out).any()) else logits   # another constraint banned all we allow


def _resolve_tool_choice(tool_choice, names: list[str]):
    """The one tool_choice check: "none" | "auto" | "required" | {"type": "function", "function": {"name": X}}
    against the offered function names -> "none" | "auto" | "required" | X. RequestError(param="tool_choice")."""
    if tool_choice is None:
        return "auto" if names else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise RequestError(f"'tool_choice' must be \"none\", \"auto\", \"required\" or "
                               f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {tool_choice!r}",
                               param="tool_choice")
        name = None
    else:
        function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
            raise RequestError("'tool_choice' object must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                               param="tool_choice")
    if tool_choice != "none" and not names:
        raise RequestError(f"'tool_choice' {json.dumps(tool_choice, default=repr)} needs a non-empty 'tools'",
                           param="tool_choice")
    if name is not None and name not in names:
        raise RequestError(f"'tool_choice' names function {name!r}, which is not in 'tools'", param="tool_choice")
    return tool_choice if name is None else name


def structured_decoder(tokenizer, *, tools=None, tool_choice=None, tool_parser: str = "qwen_xml",
                       parallel_tool_calls: bool = True, response_format=None, in_reasoning: bool = False,
                       max_tokens: int, eos_token_ids=None, ban_calls: bool = True,
                       min_tokens: int = 0) -> StructuredDecoder | None:
    """The constraint of a chat request, a SamplingParams.logits_processors entry (None: nothing to enforce).

    - response_format json_object / json_schema: the content is one JSON value of the schema (after the
      reasoning, closed early when the budget runs low), then the end.
    - tool_choice "required" / {"type": "function", "function": {"name": X}}: the answer is a complete call
      (to X), closed before max_tokens; "required" with parallel_tool_calls may add calls.
    - "auto": free text, but once the model opens a call its name is an offered function and its arguments
      follow that function's schema; parallel_tool_calls=false ends the answer after the first call. With a
      response_format: a call or the JSON value.
    - "none", or no tools: the call token is banned (unless ban_calls is false: /v1/completions).
    - min_tokens: a JSON answer may end in whitespace until min_tokens tokens exist (the end is banned until
      then); with calls that must close (tool_choice required / named, parallel_tool_calls false, or auto with
      a response_format) it is refused (param min_tokens): the answer has no room to grow after its call.
    The call is written in the format named `tool_parser` (a TOOL_FORMATS key). RequestError naming the schema
    path for a schema it cannot take, and (param max_tokens) when the shortest complete answer cannot fit.
    The processor receives each choice's generated ids (not the prompt), as the engine passes."""
    fmt = tool_format(tool_parser)
    names = list(tool_functions(tools))
    choice = _resolve_tool_choice(tool_choice, names)
    response = response_schema(response_format)
    eos_ids = list(eos_token_ids or [i for i in (tokenizer.token_to_id(t) for t in (tokenizer.eos_token, "<|im_end|>"))
                                     if i is not None])
    facts = _token_facts(tokenizer, eos_ids)
    key = json.dumps([tools, choice, fmt.name, type(fmt).__qualname__, bool(parallel_tool_calls), response,
                      in_reasoning], sort_keys=True, default=repr)
    root, think, must_finish = _output_grammar(tools, choice, fmt, parallel_tool_calls is not False, response,
                                               in_reasoning)
    grammar = facts.grammar(key, lambda: root) if root is not None else None
    ban = facts.ids_of(fmt.call_open) if fmt.call_open and ban_calls else []
    if grammar is None and not ban:
        return None
    calls = grammar is not None and choice not in ("none",) and bool(names)
    if min_tokens > 0 and calls and (choice != "auto" or parallel_tool_calls is False or response is not None):
        raise RequestError(f"'min_tokens' cannot be combined with tool_choice {json.dumps(choice)}"
                           + (" and parallel_tool_calls false" if choice == "auto" and response is None else "")
                           + (" and a response_format" if choice == "auto" and response is not None else "")
                           + ": the answer ends when its call closes", param="min_tokens")
    decoder = StructuredDecoder(facts, grammar, ban, think, max_tokens, budget=must_finish,
                                min_tokens=min_tokens if grammar is not None and not calls else 0)
    if grammar is not None and must_finish and max_tokens < decoder.smallest():
        what = "the call tool_choice requires" if choice not in ("none", "auto") else "the JSON response_format requires"
        raise RequestError(f"max_tokens {max_tokens} is too small for {what} (at least {decoder.smallest()} tokens)",
                           param="max_tokens")
    return decoder


def tool_choice_processor(tokenizer, tools, tool_choice, tool_parser: str, parallel_tool_calls: bool,
                          in_reasoning: bool, max_tokens: int, *, eos_token_ids=None) -> StructuredDecoder | None:
    """structured_decoder for tools alone (no response_format)."""
    return structured_decoder(tokenizer, tools=tools, tool_choice=tool_choice, tool_parser=tool_parser,
                              parallel_tool_calls=parallel_tool_calls, in_reasoning=in_reasoning,
                              max_tokens=max_tokens, eos_token_ids=eos_token_ids)


# -----------------------------------------------------------------------------------------------
# 12. The OpenAI protocol: request bodies checked field by field into SamplingParams and prompt ids,
#     engine events shaped into OpenAI responses and stream chunks. No sockets here.
# -----------------------------------------------------------------------------------------------

SYSTEM_FINGERPRINT = f"pocketllm-{__version__}"
LOGPROB_FLOOR = -9999.0        # JSON has no -inf: a masked token reports this instead

MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")
# Keys a message may carry. The null-only ones appear when a client replays an SDK message object as a dict.
MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content"}
MESSAGE_NULL_ONLY_KEYS = {"refusal", "annotations", "audio", "function_call", "reasoning"}
RENDER_ARGUMENTS = {"messages", "tools", "add_generation_prompt", "continue_final_message"}
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")
STREAM_OPTIONS = ("include_usage", "include_obfuscation",      # obfuscation: accepted, we never pad chunks
                  "continuous_usage_stats")                     # vLLM's: usage on every chunk
THINKING_OFF_EFFORTS = ("none", "minimal")                      # without a template that reads reasoning_effort
VERBOSITIES = ("low", "medium", "high")


# The readers of the protocol's nested fields, read(value, param, vocab_size) -> value: each checks one JSON
# value's shape and names the offending part.

def _check_content(content, param: str, role: str) -> None:
    if content is None:
        if role != "assistant":
            raise RequestError(f"'{param}' must not be null for a {role} message", param=param)
        return
    if isinstance(content, str):
        return
    for j, part in enumerate(_check_type(content, list, param)):
        where = f"{param}[{j}]"
        part = _check_type(part, dict, where)
        if part.get("type") != "text":
            raise RequestError(f"'{where}': only text content parts are supported (got type {part.get('type')!r})",
                               param=where)
        _check_type(part.get("text"), str, f"{where}.text")


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


def _check_messages(messages, param: str = "messages", vocab_size: int | None = None) -> list[dict]:
    messages = _check_type(messages, list, param)
    if not messages:
        raise RequestError(f"'{param}' must not be empty", param=param)
    for i, message in enumerate(messages):
        where = f"{param}[{i}]"
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
            if message.get(key) is not None:
                _check_type(message[key], str, f"{where}.{key}")
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise RequestError(f"'{where}.tool_calls' is only allowed on assistant messages",
                                   param=f"{where}.tool_calls")
            _check_tool_calls(message["tool_calls"], f"{where}.tool_calls")
    return messages


def _read_tools(tools: list, param: str, vocab_size: int | None) -> list[dict] | None:
    """The tools as sent (the template renders them), once tool_functions() has checked them and their
    parameter schemas compile (whatever tool_choice); [] is no tools."""
    tool_functions(tools)
    for i, tool in enumerate(tools or []):
        function, where = tool["function"], f"{param}[{i}].function.parameters"
        compile_schema(function.get("parameters", True), where, function.get("strict") is True)
    return tools or None


def _read_stream_options(options: dict, param: str, vocab_size: int | None) -> dict:
    for key, value in options.items():
        if key not in STREAM_OPTIONS:
            raise RequestError(f"unknown field '{param}.{key}'", param=f"{param}.{key}")
        if value is not None:
            _check_type(value, bool, f"{param}.{key}")
    return options


def _read_response_format(fmt: dict, param: str, vocab_size: int | None) -> dict:
    """Checked whole here, its schema compiled (a 400 naming the schema's path), so that only valid formats
    reach structured_decoder."""
    response = response_schema(fmt, param)
    if response is not None:
        compile_schema(*response)
    return fmt


def _read_metadata(metadata: dict, param: str, vocab_size: int | None) -> dict:
    """OpenAI's metadata: string keys to string values (kept nowhere, but checked like any other field)."""
    for key, value in metadata.items():
        _check_type(value, str, f"{param}.{key}")
    return metadata


def _read_template_kwargs(kwargs: dict, param: str, vocab_size: int | None) -> dict:
    for key in kwargs:
        if key in RENDER_ARGUMENTS:
            raise RequestError(f"'{param}.{key}' must be given as a top-level field", param=param)
    return kwargs


def _read_prompt(prompt, param: str, vocab_size: int | None) -> str | list[int]:
    """A completions prompt: a string or token ids, alone or as a one-element batch."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt, param = prompt[0], f"{param}[0]"
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError(f"'{param}' batches of more than one prompt are not supported; send one request each",
                           param=param, code="unsupported_field")
    if isinstance(prompt, list):                        # token ids: a bad one is named by its index
        return _token_ids(prompt, param, vocab_size)
    raise RequestError(f"'{param}' must be a string or an array of token ids, got {_json_type(prompt)}", param=param)


# The checks between fields, relate(values, param) -> the field's final value.

def _only_with_stream(values: dict, param: str):
    if values[param] is not None and not values["stream"]:
        raise RequestError(f"'{param}' is only allowed when 'stream' is true", param=param)
    return values[param]


def _needs_logprobs(values: dict, param: str):
    if values[param] is not None and not values["logprobs"]:
        raise RequestError(f"'{param}' needs 'logprobs': true", param=param)
    return values[param]


def _agrees_with_max_tokens(values: dict, param: str):
    if None not in (values[param], values["max_tokens"]) and values[param] != values["max_tokens"]:
        raise RequestError(f"'{param}' and 'max_tokens' disagree; send one of them", param=param)
    return values[param]


def _best_of_is_n(values: dict, param: str):
    if values[param] not in (None, 1, values["n"]):
        raise RequestError(f"'{param}' is not supported by this server (accepted only when null, 1 or equal to "
                           f"'n')", param=param, code="unsupported_field")
    return values[param]


def _tool_choice_for(values: dict, param: str):
    """tool_choice as sent, checked against the tools (absent: "auto" with tools, else "none")."""
    names = [tool["function"]["name"] for tool in values["tools"] or []]
    resolved = _resolve_tool_choice(values[param], names)
    return resolved if values[param] is None else values[param]


def _prompt_or_messages(values: dict, param: str):
    if (values["prompt"] is None) == (values["messages"] is None):
        raise RequestError("send exactly one of 'prompt' and 'messages'", param="prompt")
    return values[param]


# The request-field tables, one per endpoint: name -> Field. The sampling rows are SamplingParams' own.

def _table(**rows: Field) -> dict[str, Field]:
    return {name: dataclasses.replace(row, name=name) for name, row in rows.items()}


def _sampling_rows(*names: str) -> dict[str, Field]:
    return {name: SAMPLING_FIELDS[name] for name in names}


CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
    "type": "object", "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]}
TOOL_CALLS_SCHEMA = {"type": "array", "items": {"type": "object", "required": ["function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"}, "function": {
        "type": "object", "required": ["name", "arguments"],
        "properties": {"name": {"type": "string"}, "arguments": {"type": ["string", "object"]}}}}}}
MESSAGES_SCHEMA = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role"], "additionalProperties": False,
    "properties": {"role": {"enum": list(MESSAGE_ROLES)}, "content": CONTENT_SCHEMA, "name": {"type": "string"},
                   "tool_call_id": {"type": "string"}, "reasoning_content": {"type": "string"},
                   "tool_calls": TOOL_CALLS_SCHEMA, **{key: {"type": "null"} for key in MESSAGE_NULL_ONLY_KEYS}}}}
TOOLS_SCHEMA = {"type": "array", "items": {
    "type": "object", "required": ["type", "function"], "additionalProperties": False,
    "properties": {"type": {"const": "function"}, "function": {
        "type": "object", "required": ["name"], "additionalProperties": False,
        "properties": {"name": {"type": "string", "minLength": 1}, "description": {"type": "string"},
                       "strict": {"type": "boolean"}, "parameters": {
                           "type": "object", "properties": {
                               "properties": {"type": "object", "additionalProperties": {
                                   "type": ["object", "boolean"]}},
                               "required": {"type": "array", "items": {"type": "string"}}}}}}}}}
TOOL_CHOICE_SCHEMA = {"anyOf": [{"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "function"],
    "properties": {"type": {"const": "function"}, "function": {
        "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]}
STREAM_OPTIONS_SCHEMA = {"type": "object", "additionalProperties": False,
                         "properties": {key: {"type": "boolean"} for key in STREAM_OPTIONS}}
PROMPT_SCHEMA = {"anyOf": [{"type": "string"}, TOKEN_IDS_SCHEMA,
                           {"type": "array", "minItems": 1, "maxItems": 1,
                            "items": {"anyOf": [{"type": "string"}, TOKEN_IDS_SCHEMA]}}]}

RESPONSE_FORMAT_SCHEMA = {"type": "object", "required": ["type"], "additionalProperties": False, "properties": {
    "type": {"enum": list(RESPONSE_FORMAT_TYPES)}, "json_schema": {
        "type": "object", "additionalProperties": False, "properties": {
            "name": {"type": "string"}, "description": {"type": "string"}, "strict": {"type": "boolean"},
            "schema": {"type": ["object", "boolean"]}}}}}
RESPONSE_FORMAT_FIELD = Field(
    kind="object", layer="parser", read=_read_response_format, schema=RESPONSE_FORMAT_SCHEMA, name="response_format",
    shape='`{"type": "text"}`, `{"type": "json_object"}`, `{"type": "json_schema", "json_schema": {"name"?, '
          '"description"?, "schema"?, "strict"?}}`', default_text="text",
    why="enforced by constrained decoding (see Structured output): the content is one JSON object / one value "
        "of the schema, closed within `max_tokens` (a smaller budget than the shortest valid value is 400 "
        "`param: max_tokens`); a schema error is 400 naming its path, e.g. "
        "`response_format.json_schema.schema.properties.x.type`")

METADATA_ROW = {"read": _read_metadata, "schema": {"type": "object", "additionalProperties": {"type": "string"}}}

# Fields of both generating endpoints.
GENERATION_FIELDS = {
    **_table(model=Field(kind="string", layer="server", default_text="the served model",
                         why="any other name is 404 (`code: model_not_found`)"),
             stream=Field(kind="boolean", default=False, layer="server", why="server-sent events"),
             stream_options=Field(kind="object", layer="server", read=_read_stream_options, relate=_only_with_stream,
                                  schema=STREAM_OPTIONS_SCHEMA, shape="object, only with `stream: true`",
                                  why="`include_usage` (boolean): every chunk carries `usage: null` and a last "
                                      "chunk the usage; `continuous_usage_stats` (boolean, vLLM's): every chunk "
                                      "carries the usage so far instead of null; `include_obfuscation` (boolean): "
                                      "accepted, chunks are never padded; other keys 400")),
    # Every SamplingParams row but Python's callables, so a new one is served as it is added; logprobs is each
    # endpoint's own, max_tokens defaults to the rest of the context.
    **{name: row for name, row in SAMPLING_FIELDS.items() if name not in ("logprobs", "logits_processors")},
    "max_tokens": dataclasses.replace(SAMPLING_FIELDS["max_tokens"], default=None,
                                      default_text="the rest of the context"),
    # Accepted with no effect: bookkeeping on OpenAI's side that cannot change the answer.
    **_table(**{name: Field(kind=kind, layer="server", policy=NO_EFFECT, why="bookkeeping on OpenAI's side",
                            **(METADATA_ROW if name == "metadata" else {}))
                for name, kind in (("user", "string"), ("metadata", "object"), ("store", "boolean"),
                                   ("service_tier", "string"), ("prompt_cache_key", "string"),
                                   ("prompt_cache_retention", "string"), ("prompt_cache_options", "object"),
                                   ("safety_identifier", "string"))}),
    **_table(moderation=Field(kind="object", layer="server", policy=NO_EFFECT,
                              why="OpenAI's moderation model: none runs here, nothing is scored or blocked")),
}

UNIMPLEMENTED = "not implemented: accepted only at the values that leave the answer unchanged"

CHAT_FIELDS = {
    **_table(messages=Field(kind="array", required=True, layer="template", read=_check_messages,
                            schema=MESSAGES_SCHEMA, shape="non-empty array of messages",
                            why="roles `system`, `developer` (rendered as `system`), `user`, `assistant`, `tool`. "
                                "`content`: a string, an array of `{\"type\": \"text\", \"text\"}` parts, or null "
                                "(assistant only). Also `name`, `tool_call_id`, `reasoning_content` (strings) and, on "
                                "assistant messages, `tool_calls` (arguments a JSON string or object). `refusal`, "
                                "`annotations`, `audio`, `function_call`, `reasoning` are accepted when null; any "
                                "other key is 400. The template sees a converted copy")),
    **GENERATION_FIELDS,
    **_table(
        max_completion_tokens=Field(kind="integer", lo=1, layer="engine", relate=_agrees_with_max_tokens,
                                    default_text="the rest of the context",
                                    why="the same as `max_tokens`; both given with different values is 400"),
        logprobs=Field(kind="boolean", default=False,
                       why="`choices[].logprobs.content[] = {token, logprob, bytes, top_logprobs[]}`, from the raw "
                           "distribution; masked tokens report -9999"),
        top_logprobs=Field(kind="integer", lo=0, hi=MAX_TOP_LOGPROBS, relate=_needs_logprobs, default_text="0",
                           why="alternatives per token; needs `logprobs: true`"),
        tools=Field(kind="array", layer="template", read=_read_tools, schema=TOOLS_SCHEMA,
                    shape='array of `{"type": "function", "function": {"name", "description"?, "parameters"?, '
                          '"strict"?}}`',
                    why="rendered by the template; names unique and non-empty; `parameters.properties` an object of "
                        "schemas, `parameters.required` an array of names; other tool types and keys 400 naming "
                        "the path"),
        tool_choice=Field(layer="parser", relate=_tool_choice_for, schema=TOOL_CHOICE_SCHEMA,
                          shape='`"none"`, `"auto"`, `"required"`, `{"type": "function", "function": {"name"}}`',
                          default_text='`"auto"` with tools, else `"none"`',
                          why="enforced by constrained decoding; anything but `\"none\"` without `tools`, or a name "
                              "not in `tools`, is 400"),
        parallel_tool_calls=Field(kind="boolean", default=True, layer="parser",
                                  why="false: at most one call per answer"),
        response_format=RESPONSE_FORMAT_FIELD,
        chat_template_kwargs=Field(kind="object", default={}, layer="template", read=_read_template_kwargs,
                                   why="passed to the template (`enable_thinking`, ...); the keys `messages`, "
                                       "`tools`, `add_generation_prompt`, `continue_final_message` are 400"),
        reasoning_effort=Field(kind="string", enum=REASONING_EFFORTS, layer="template",
                               why="passed to a template that reads it (over `chat_template_kwargs`); otherwise "
                                   "`none` and `minimal` set `enable_thinking: false` and `low`, `medium`, `high` "
                                   "set `enable_thinking: true` (over `chat_template_kwargs`), and with a template "
                                   "that reads neither it is 400 (`code: unsupported_field`)"),
        add_generation_prompt=Field(kind="boolean", layer="template",
                                    default_text="true (false with `continue_final_message`)", why="vLLM extra"),
        continue_final_message=Field(kind="boolean", default=False, layer="template",
                                     why="vLLM extra: the last message must be an assistant message, continued "
                                         "without closing it; with `add_generation_prompt: true` it is 400"),
        audio=Field(kind="object", policy=DEFAULT_ONLY, allowed=(None,), layer="server", why=UNIMPLEMENTED),
        modalities=Field(kind="array", policy=DEFAULT_ONLY, allowed=(None, ["text"]), layer="server",
                         why=UNIMPLEMENTED),
        prediction=Field(kind="object", policy=DEFAULT_ONLY, allowed=(None,), layer="server", why=UNIMPLEMENTED),
        functions=Field(kind="array", policy=DEFAULT_ONLY, allowed=(None, []), layer="server",
                        why="deprecated by OpenAI: use `tools`"),
        function_call=Field(policy=DEFAULT_ONLY, allowed=(None, "none", "auto"), layer="server",
                            shape="string or object", why="deprecated by OpenAI: use `tool_choice`"),
        web_search_options=Field(kind="object", policy=DEFAULT_ONLY, allowed=(None,), layer="server",
                                 why=UNIMPLEMENTED),
        verbosity=Field(kind="string", enum=VERBOSITIES, layer="template",
                        why="passed to a template that reads it (over `chat_template_kwargs`); with one that does "
                            "not, 400 (`code: unsupported_field`)")),
}

COMPLETION_FIELDS = {
    **_table(prompt=Field(required=True, layer="engine", read=_read_prompt, schema=PROMPT_SCHEMA,
                          shape="string or array of token ids, alone or as a one-element array",
                          why="batches of several prompts are 400 (send one request each); an empty prompt is 400")),
    **GENERATION_FIELDS,
    "logprobs": dataclasses.replace(SAMPLING_FIELDS["logprobs"], why=(
        "completions format `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`, offsets from "
        "the start of the completion; null: off")),
    **_table(best_of=Field(kind="integer", lo=1, policy=DEFAULT_ONLY, relate=_best_of_is_n, layer="engine",
                           why="accepted only when null, 1 or equal to `n`"),
             echo=Field(kind="boolean", policy=DEFAULT_ONLY, allowed=(None, False), layer="server", why=UNIMPLEMENTED),
             response_format=RESPONSE_FORMAT_FIELD,
             suffix=Field(kind="string", policy=DEFAULT_ONLY, allowed=(None, ""), layer="template",
                          why=UNIMPLEMENTED)),
}

TOKENIZE_FIELDS = _table(
    model=GENERATION_FIELDS["model"],
    prompt=Field(kind="string", layer="server", relate=_prompt_or_messages,
                 why="text to tokenize; send exactly one of `prompt` and `messages`"),
    messages=dataclasses.replace(CHAT_FIELDS["messages"], required=False,
                                 why="chat messages, rendered by the template as for chat completions"),
    tools=CHAT_FIELDS["tools"],
    add_generation_prompt=CHAT_FIELDS["add_generation_prompt"],
    continue_final_message=CHAT_FIELDS["continue_final_message"],
    chat_template_kwargs=CHAT_FIELDS["chat_template_kwargs"],
    add_special_tokens=Field(kind="boolean", layer="server", policy=NO_EFFECT,
                             why="pocketllm's tokenizers add no special tokens either way"),
    return_token_strs=Field(kind="boolean", default=False, layer="server", why="also return each token's string"),
)

DETOKENIZE_FIELDS = _table(
    model=GENERATION_FIELDS["model"],
    tokens=Field(kind="array", required=True, layer="server", read=_token_ids, schema=TOKEN_IDS_SCHEMA,
                 shape="array of token ids (0..vocab-1)", why="the ids to turn into text"),
)

# The template's own fields, read again by render_chat_prompt (which also serves /tokenize and raw bodies).
TEMPLATE_FIELDS = {name: CHAT_FIELDS[name] for name in ("messages", "chat_template_kwargs", "add_generation_prompt",
                                                        "continue_final_message", "reasoning_effort", "verbosity")}

# The tables rendered: docs/api.md's field lists (between `<!-- fields: NAME -->` markers) and /openapi.json.

FIELD_TABLES = {"sampling": SAMPLING_FIELDS, "chat": CHAT_FIELDS, "completions": COMPLETION_FIELDS,
                "tokenize": TOKENIZE_FIELDS, "detokenize": DETOKENIZE_FIELDS}


def _type_text(row: Field) -> str:
    if row.shape:
        return row.shape
    text = ", ".join(f'`"{value}"`' for value in row.enum) if row.enum else row.kind
    return f"{text}, {_range_text(row)}" if _range_text(row) else text


def _default_text(row: Field) -> str:
    if row.default_text or row.required:
        return row.default_text or "required"
    if row.policy == DEFAULT_ONLY and row.allowed:
        return " or ".join(f"`{json.dumps(value)}`" for value in row.allowed)
    return "null" if row.default is None else f"`{json.dumps(row.default)}`"


def fields_markdown(table: dict[str, Field]) -> str:
    """One endpoint's table as the markdown docs/api.md carries."""
    lines = ["| field | type and range | default | consumed by | policy | notes |", "|---|---|---|---|---|---|"]
    lines += [f"| `{name}` | {_type_text(row)} | {_default_text(row)} | {row.layer} | {row.policy} | {row.why} |"
              for name, row in table.items()]
    return "\n".join(lines)


def _with_vocab(schema, vocab_size: int | None):
    """A schema with every token id (`x-token-id`) bounded by the vocabulary."""
    if isinstance(schema, list):
        return [_with_vocab(s, vocab_size) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _with_vocab(value, vocab_size) for key, value in schema.items()}
    if out.pop("x-token-id", False) and vocab_size:
        out["maximum"] = vocab_size - 1
    return out


def field_schema(row: Field, vocab_size: int | None = None) -> dict:
    """A row as JSON Schema (OpenAPI 3.1): type, range, enum, default; null stands for an absent field."""
    schema = dict(row.schema) if row.schema else {"type": row.kind} if row.kind in JSON_KINDS else {}
    if row.lo is not None:
        schema["exclusiveMinimum" if row.lo_open else "minimum"] = row.lo
    if row.hi is not None:
        schema["maximum"] = row.hi
    if row.enum:
        schema["enum"] = list(row.enum)
    if row.policy == DEFAULT_ONLY and row.allowed:
        schema["enum"] = list(row.allowed)
    elif not row.required:                    # null is accepted wherever the field may be absent
        schema = {**schema, "type": [schema["type"], "null"]} if isinstance(schema.get("type"), str) else \
            {"anyOf": [schema, {"type": "null"}]}
    if row.default is not None and not callable(row.default):
        schema["default"] = row.default
    description = f"{row.why} (default: {_default_text(row).replace('`', '')})" if row.why else ""
    return {**_with_vocab(schema, vocab_size), "description": description, "x-pocketllm-layer": row.layer,
            "x-pocketllm-policy": row.policy}


def request_schema(table: dict[str, Field], vocab_size: int | None = None) -> dict:
    """An endpoint's body as JSON Schema: its table's fields, the required ones, no others."""
    return {"type": "object", "additionalProperties": False,
            "required": [name for name, row in table.items() if row.required],
            "properties": {name: field_schema(row, vocab_size) for name, row in table.items()}}


def _read_values(body: dict, table: dict[str, Field], vocab_size: int | None = None,
                 defaults: dict | None = None) -> dict:
    """name -> value for every row: checked, absent ones given the default (generation defaults first)."""
    values = {}
    for name, row in table.items():
        value = body.get(name)
        if value is None and row.required:
            raise RequestError(f"'{name}' is required", param=name)
        if value is None and defaults:
            value = defaults.get(name)
        values[name] = read_field(row, value, name, vocab_size)
    return values


def read_fields(body, table: dict[str, Field], vocab_size: int | None = None, defaults: dict | None = None) -> dict:
    """A request body read through its endpoint's table: unknown fields refused (a typo such as `temprature`),
    each field checked by its row, then the checks between fields. name -> value for every row of the table."""
    body = _check_type(body, dict, "body")
    for name in body:
        if name not in table:
            raise RequestError(f"unknown field '{name}'", param=name, code="unknown_field")
    values = _read_values(body, table, vocab_size, defaults)
    for name, row in table.items():
        if row.relate is not None:
            values[name] = row.relate(values, name)
    return values


def _check_model(llm, body: dict) -> None:
    model = body.get("model")
    if model is not None and model != llm.model_name:
        raise RequestError(f"model '{model}' does not exist; this server serves '{llm.model_name}'",
                           param="model", status=404, code="model_not_found")


def _request_sampling_params(llm, values: dict, prompt_len: int, max_tokens_field: str | None) -> SamplingParams:
    """The engine's SamplingParams from an endpoint's values: its sampling rows, the max tokens resolved (the rest
    of the context unless sent). logprobs is the endpoint's to set."""
    room = llm.options.max_context - prompt_len
    if room <= 0:
        raise RequestError(f"the prompt is {prompt_len} tokens; the context holds {llm.options.max_context}",
                           param="messages" if "messages" in values else "prompt", code="context_length_exceeded")
    params = SamplingParams(**{name: values[name] for name in SAMPLING_FIELDS if name in values and
                               name not in ("max_tokens", "logprobs")})
    params.max_tokens = values[max_tokens_field] if max_tokens_field else room
    return params


def _max_tokens_field(values: dict, names: tuple[str, ...]) -> str | None:
    """Which of the max-tokens fields the client set."""
    return next((name for name in names if values.get(name) is not None), None)


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


def _submit(llm, prompt_ids: list[int], params: SamplingParams, body: dict, max_tokens_field: str | None,
            snapshot_at: int | None = None):
    _check_alive(llm)
    try:
        return llm.submit(prompt_ids, params, snapshot_at=snapshot_at)
    except RequestError as e:
        raise _as_sent(e, body, max_tokens_field) from None


# Chat requests: the template rendered on a converted copy of the messages.

def _chat_template(llm):
    """The llm's chat template, loaded on first use (run_server may have set an override)."""
    template = getattr(llm, "chat_template", None)
    if template is None:
        template = llm.chat_template = load_chat_template(llm.tokenizer)
    if template is None:
        raise RequestError("this checkpoint has no chat template; start the server with --chat-template FILE "
                           "or use /v1/completions", param="messages")
    return template


def _template_reads(llm, name: str) -> bool:
    return name in "".join(getattr(_chat_template(llm), "sources", {}).values())


def _unsupported_by_template(name: str) -> RequestError:
    return RequestError(f"'{name}' is not supported: this model's chat template does not read it", param=name,
                        code="unsupported_field")


def _template_choices(llm, values: dict) -> dict:
    """The template kwargs of the top-level fields: reasoning_effort and verbosity go to a template that reads
    them; without one, reasoning_effort turns thinking off (none, minimal) or on, as enable_thinking."""
    kwargs = {}
    if values["verbosity"] is not None:
        if not _template_reads(llm, "verbosity"):
            raise _unsupported_by_template("verbosity")
        kwargs["verbosity"] = values["verbosity"]
    effort = values["reasoning_effort"]
    if effort is not None and _template_reads(llm, "reasoning_effort"):
        kwargs["reasoning_effort"] = effort
    elif effort is not None:
        if not _template_reads(llm, "enable_thinking"):
            raise _unsupported_by_template("reasoning_effort")
        kwargs["enable_thinking"] = effort not in THINKING_OFF_EFFORTS
    return kwargs


def render_chat_prompt(llm, body: dict, tools: list[dict] | None) -> str:
    """The prompt text for a chat body (its TEMPLATE_FIELDS are read here): the template rendered on a converted
    copy of the messages."""
    values = _read_values(body, TEMPLATE_FIELDS)
    messages, template_kwargs, continue_final = (values["messages"], values["chat_template_kwargs"],
                                                 values["continue_final_message"])
    add_generation_prompt = (not continue_final if values["add_generation_prompt"] is None
                             else values["add_generation_prompt"])
    if continue_final and (add_generation_prompt or messages[-1]["role"] != "assistant"):
        raise RequestError("'continue_final_message' needs a final assistant message and "
                           "'add_generation_prompt' false", param="continue_final_message")
    template_kwargs = {**template_kwargs, **_template_choices(llm, values)}
    copy = messages_for_template(messages)
    for message in copy:                     # OpenAI's developer role is the system role of older templates
        if message["role"] == "developer":
            message["role"] = "system"
    return _chat_template(llm).render(copy, tools=tools, add_generation_prompt=add_generation_prompt,
                                      continue_final_message=continue_final, **template_kwargs)


def chat_snapshot_point(llm, values: dict, tools: list[dict] | None, prompt_ids: list[int]) -> int | None:
    """Where the prefix cache should snapshot a chat prompt: the end of its last message, i.e. the prompt
    without the generation prompt. The conversation's next turn repeats everything up to there and then
    renders this turn's reply its own way (templates drop the reasoning, so it diverges right after the
    assistant header), so it resumes there and prefills only its new tokens. None: the cache is off, or the
    prompt has no generation prompt to take off."""
    if not llm.options.prefix_cache:
        return None
    ids = llm.tokenizer.encode(render_chat_prompt(llm, {**values, "add_generation_prompt": False,
                                                        "continue_final_message": False}, tools))
    return len(ids) if 0 < len(ids) < len(prompt_ids) and prompt_ids[:len(ids)] == ids else None


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


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: the prompt tokens the prefix cache resumed (section 5)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


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

    def __init__(self, llm, stream, kind: str, stream_mode: bool, stream_options: dict | None,
                 logprobs: int | None, parsers: list | None = None, metrics: ServerMetrics | None = None):
        self.llm, self.stream, self.kind, self.stream_mode = llm, stream, kind, stream_mode
        self.logprobs, self.parsers, self.metrics = logprobs, parsers, metrics
        self.include_usage = bool((stream_options or {}).get("include_usage"))
        self.continuous_usage = bool((stream_options or {}).get("continuous_usage_stats"))
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
        """The stream's events; this request's own failure becomes a 500, a fatal engine error a 503."""
        try:
            yield from self.stream
        except RequestError:
            raise
        except RequestFailed as e:
            raise self._failed("the engine", e) from None
        except PocketError as e:
            _check_alive(self.llm)
            raise RequestError(str(e), status=503, code="engine_dead") from None
        except Exception as e:                                  # detokenising this request's tokens
            raise self._failed("detokenising", e) from None

    def _failed(self, stage: str, error: Exception) -> RequestError:
        """A fault of this request alone: logged with its traceback; the client gets a 500 naming the request
        (the engine has freed, or the caller's abort() frees, its blocks and slot)."""
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
        return RequestError(f"request {self.id} failed in {stage} (the cause is logged on the server)",
                            status=500, code="request_failed")

    def _parse(self, index: int, text: str, final: bool) -> list[dict]:
        """Feed choice `index`'s new text to its output parser -> message deltas."""
        try:
            parser = self.parsers[index]
            return (parser.feed(text) if text else []) + (parser.finish() if final else [])
        except Exception as e:
            raise self._failed("parsing its output", e) from None

    def _finish_reason(self, index: int, reason: str) -> str:
        if self.parsers and self.parsers[index].has_tool_calls and reason == "stop":
            return "tool_calls"
        return reason

    def _envelope(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": self.object + (".chunk" if self.kind == "chat" and self.stream_mode else ""),
                "created": self.created, "model": self.llm.model_name, "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": choices}

    def _usage(self) -> dict:
        return _usage(self.stream.prompt_tokens, self.completion_tokens, self.stream.request.cached_tokens or 0)

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
                    deltas = self._parse(i, event.text, event.finish_reason is not None)
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
        if self.continuous_usage:
            chunk["usage"] = self._usage()
        elif self.include_usage:
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
                self._parse(i, texts.get(i, ""), True)
                message = {"role": "assistant", **{k: v for k, v in self.parsers[i].message().items()
                                                    if k == "content" or v is not None}}
                choice.update(message=message, logprobs={"content": _chat_logprobs(logprobs[i])}
                              if self.logprobs is not None else None)
            else:
                choice.update(text=texts.get(i, ""), logprobs=_completion_logprobs(logprobs[i], 0)
                              if self.logprobs is not None else None)
            choice.update(finish_reason=self._finish_reason(i, reason), stop_reason=stop_reason)
            choices.append(choice)
        return {**self._envelope(choices), "usage": self._usage()}


def _generation_values(llm, body, table: dict[str, Field]) -> dict:
    """What both completion endpoints read first: the body through its table (unset sampling fields take the
    checkpoint's generation defaults), for our model."""
    values = read_fields(body, table, llm.config.vocab_size, getattr(llm, "generation_defaults", None))
    _check_model(llm, values)
    return values


def start_chat_completion(llm, body, metrics: ServerMetrics | None = None) -> Completion:
    """Validate a /v1/chat/completions body, render the prompt and submit it."""
    values = _generation_values(llm, body, CHAT_FIELDS)
    tools, tool_choice = values["tools"], values["tool_choice"]
    prompt_text = render_chat_prompt(llm, values, tools)
    prompt_ids = llm.tokenizer.encode(prompt_text)
    max_tokens_field = _max_tokens_field(values, ("max_completion_tokens", "max_tokens"))
    params = _request_sampling_params(llm, values, len(prompt_ids), max_tokens_field)
    params.logprobs = (values["top_logprobs"] or 0) if values["logprobs"] else None
    template = _chat_template(llm)
    in_reasoning = prompt_ends_in_reasoning(prompt_text)
    try:                                  # response_format, tool_choice, valid calls in auto mode, no calls without tools
        processor = structured_decoder(llm.tokenizer, tools=tools, tool_choice=tool_choice,
                                       tool_parser=template.tool_parser, parallel_tool_calls=values["parallel_tool_calls"],
                                       response_format=values["response_format"], in_reasoning=in_reasoning,
                                       max_tokens=params.max_tokens, eos_token_ids=llm.eos_token_ids,
                                       min_tokens=params.min_tokens)
    except RequestError as e:
        raise _as_sent(e, values, max_tokens_field) from None
    if processor is not None:
        params.logits_processors = [*params.logits_processors, processor]
    parsers = [ChatOutputParser(tools, template.tool_parser, in_reasoning, parse_tools=tool_choice != "none")
               for _ in range(params.n)]
    return Completion(llm, _submit(llm, prompt_ids, params, values, max_tokens_field,
                                   chat_snapshot_point(llm, values, tools, prompt_ids)), "chat", values["stream"],
                      values["stream_options"], params.logprobs, parsers, metrics)


def start_completion(llm, body, metrics: ServerMetrics | None = None) -> Completion:
    """Validate a /v1/completions body and submit it."""
    values = _generation_values(llm, body, COMPLETION_FIELDS)
    prompt = values["prompt"]
    prompt_ids = llm.tokenizer.encode_text(prompt) if isinstance(prompt, str) else prompt   # text stays text
    if not prompt_ids:
        raise RequestError("'prompt' must not be empty", param="prompt")
    max_tokens_field = _max_tokens_field(values, ("max_tokens",))
    params = _request_sampling_params(llm, values, len(prompt_ids), max_tokens_field)
    params.logprobs = values["logprobs"]
    if response_schema(values["response_format"]) is not None:    # the completion is the JSON value
        try:
            params.logits_processors = [*params.logits_processors, structured_decoder(
                llm.tokenizer, response_format=values["response_format"], max_tokens=params.max_tokens,
                eos_token_ids=llm.eos_token_ids, ban_calls=False, min_tokens=params.min_tokens)]
        except RequestError as e:
            raise _as_sent(e, values, max_tokens_field) from None
    return Completion(llm, _submit(llm, prompt_ids, params, values, max_tokens_field), "text", values["stream"],
                      values["stream_options"], params.logprobs, None, metrics)


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
# 12b. The Responses and Messages protocols: OpenAI's /v1/responses and Anthropic's /v1/messages. Each body is
#      read through its table and translated into a chat body that section 12 reads (one template, one parser,
#      one policy); the chat stream is shaped back into the protocol's items, blocks and events. No sockets.
# -----------------------------------------------------------------------------------------------

RESPONSE_STORE_COUNT = 1000             # stored responses at most, the oldest dropped first
RESPONSE_STORE_BYTES = 64 * 2 ** 20     # and their JSON bytes at most
RESPONSES_INCLUDES = ("reasoning.encrypted_content",)
RESPONSES_TEXT_PARTS = ("input_text", "output_text", "text")
REASONING_SUMMARIES = ("auto", "concise", "detailed")
MESSAGES_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}      # and "tool": that function
MESSAGES_THINKING = ("enabled", "adaptive", "disabled")
MESSAGES_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}
MESSAGES_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 405: "invalid_request_error", 411: "invalid_request_error",
                         413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                         503: "overloaded_error"}
# A chat error's param -> the field of the protocol's body it came from (the first pattern that matches).
RESPONSES_RENAMES = ((r"messages\b.*", "input"), (r"max_tokens\b.*", "max_output_tokens"),
                     (r"response_format\b.*", "text.format"), (r"verbosity\b.*", "text.verbosity"),
                     (r"reasoning_effort\b.*", "reasoning.effort"), (r"tools\[(\d+)\]\.function\.", r"tools[\1]."))
MESSAGES_RENAMES = ((r"messages\b.*", "messages"), (r"stop\b.*", "stop_sequences"),
                    (r"response_format\b.*", "output_config.format"), (r"reasoning_effort\b.*", "output_config.effort"),
                    (r"chat_template_kwargs\b.*", "thinking"),
                    (r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
                    (r"tools\[(\d+)\]\.function\.", r"tools[\1]."))


def anthropic_error(status: int, error: dict) -> dict:
    """An OpenAI error object ({message, param, code}) in Anthropic's shape; param and code stay, as extras."""
    return {"type": "error", "error": {**error, "type": ANTHROPIC_ERROR_TYPES.get(status, "api_error")}}


def _renamed(error: RequestError, renames: tuple) -> RequestError:
    """A chat-side error renamed to the field of the protocol's body that the client sent."""
    for pattern, name in renames:
        if error.param and re.match(pattern, error.param):
            error.param = re.sub(pattern, name, error.param, count=1)
            break
    return error


def _on_chat_side(renames: tuple, step: Callable, *args):
    """step(*args), a step of the chat path: its RequestError renamed to the protocol's fields."""
    try:
        return step(*args)
    except RequestError as e:
        raise _renamed(e, renames) from None


def _text_content(content, param: str, part_types: tuple[str, ...]):
    """A string, or an array of text parts of part_types -> chat content (a string, or chat text parts)."""
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(_check_type(content, list, param)):
        part = _check_type(part, dict, f"{param}[{j}]")
        if part.get("type") not in part_types:
            raise RequestError(f"'{param}[{j}].type' {part.get('type')!r} is not supported: this server takes text "
                               f"only ({', '.join(part_types)})", param=f"{param}[{j}].type", code="unsupported_field")
        parts.append({"type": "text", "text": _check_type(part.get("text"), str, f"{param}[{j}].text")})
    return parts


def _text_of(part, param: str, part_type: str) -> str:
    part = _check_type(part, dict, param)
    if part.get("type") != part_type:
        raise RequestError(f"'{param}.type' must be \"{part_type}\"", param=f"{param}.type")
    return _check_type(part.get("text"), str, f"{param}.text")


def _joined_texts(parts, param: str, part_type: str) -> str:
    """The texts of an array of {"type": part_type, "text"} parts, joined by blank lines."""
    return "\n\n".join(_text_of(part, f"{param}[{j}]", part_type)
                       for j, part in enumerate(_check_type(parts, list, param)))


def _assistant_turn(messages: list[dict], reasoning: str | None) -> dict:
    """The assistant message that a replayed call or text joins: the last one if it is one, else a new one."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": None})
    if reasoning:
        messages[-1]["reasoning_content"] = reasoning
    return messages[-1]


# The Responses body's nested fields, read(value, param, vocab_size) -> the chat form.

def _responses_input(value, param: str, vocab_size: int | None) -> list[dict]:
    """`input` -> chat messages: a string is one user message; message items become messages, function_call
    items the assistant's tool_calls, function_call_output items tool messages, and a reasoning item the next
    assistant message's reasoning_content."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages, reasoning = [], None
    for i, item in enumerate(_check_type(value, list, param)):
        where = f"{param}[{i}]"
        item = _check_type(item, dict, where)
        kind = item.get("type", "message")
        if kind == "message":
            _only_keys(item, ("type", "role", "content", "id", "status"), where)
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"'{where}.role' must be one of user, system, developer, assistant, got {role!r}",
                                   param=f"{where}.role")
            content = _text_content(item.get("content"), f"{where}.content", RESPONSES_TEXT_PARTS)
            if role == "assistant":
                _assistant_turn(messages, reasoning)["content"] = content
                reasoning = None
            else:
                messages.append({"role": role, "content": content})
        elif kind == "function_call":
            _only_keys(item, ("type", "call_id", "name", "namespace", "arguments", "id", "status"), where)
            call = {"id": _check_type(item.get("call_id"), str, f"{where}.call_id"), "type": "function",
                    "function": {"name": _check_type(item.get("name"), str, f"{where}.name"),
                                 "arguments": _check_type(item.get("arguments"), str, f"{where}.arguments")}}
            turn = _assistant_turn(messages, reasoning)
            turn["tool_calls"] = [*(turn.get("tool_calls") or []), call]
            reasoning = None
        elif kind == "function_call_output":
            _only_keys(item, ("type", "call_id", "output", "id", "status"), where)
            messages.append({"role": "tool", "tool_call_id": _check_type(item.get("call_id"), str, f"{where}.call_id"),
                             "content": _text_content(item.get("output"), f"{where}.output", RESPONSES_TEXT_PARTS)})
        elif kind == "reasoning":
            _only_keys(item, ("type", "id", "summary", "content", "encrypted_content", "status"), where)
            reasoning = (_joined_texts(item["content"], f"{where}.content", "reasoning_text") if item.get("content")
                         else _joined_texts(item.get("summary") or [], f"{where}.summary", "summary_text"))
        else:
            raise RequestError(f"'{where}.type' {kind!r} is not supported (message, function_call, "
                               "function_call_output, reasoning)", param=f"{where}.type", code="unsupported_field")
    if not messages:
        raise RequestError(f"'{param}' holds no message", param=param)
    return messages


def _function_tools(tools, param: str) -> Iterator[tuple[str, dict, str | None]]:
    """(where, tool, namespace) for every tool, the members of namespace tools in place of their group."""
    for i, tool in enumerate(_check_type(tools, list, param)):
        where = f"{param}[{i}]"
        tool = _check_type(tool, dict, where)
        if tool.get("type") == "namespace":
            _only_keys(tool, ("type", "name", "description", "tools"), where)
            namespace = _check_type(tool.get("name"), str, f"{where}.name")
            yield from ((inner, member, namespace) for inner, member, _ in _function_tools(tool.get("tools"),
                                                                                          f"{where}.tools"))
        else:
            yield where, tool, None


def _tool_namespaces(tools) -> dict[str, str]:
    """function name -> the namespace tool that groups it, for a `tools` already checked."""
    return {tool["name"]: namespace for _, tool, namespace in _function_tools(tools or [], "tools") if namespace}


# Hosted tools: tools that run on the provider's side (Responses' web_search, file_search, ...; Messages'
# server tools, web_search_*, code_execution_*, ...). None runs here, so by default a request's hosted tools are
# left out: the model never sees them, the response's X-Pocketllm-Omitted-Tools header names them, and the
# server logs each distinct tool set once. The server's --hosted-tools refuse makes them 400 instead.
HOSTED_TOOL_POLICIES = ("omit", "refuse")
OMITTED_TOOLS_HEADER = "X-Pocketllm-Omitted-Tools"


def hosted_tools(tools, client_types: tuple) -> list[tuple[str, str]]:
    """(where, type) of each tool in a body's `tools` whose type is not one of client_types (the tools the
    client runs); namespace members are never hosted. Malformed tools are left to the field's read."""
    if not isinstance(tools, list):
        return []
    return [(f"tools[{i}]", str(tool.get("type"))) for i, tool in enumerate(tools)
            if isinstance(tool, dict) and tool.get("type") not in (*client_types, "namespace")]


def _omit_or_refuse(hosted: list[tuple[str, str]], policy: str, allowed: str) -> list[str]:
    """The types of the hosted tools to leave out; under the refuse policy the first one is 400 naming it."""
    if hosted and policy == "refuse":
        where, kind = hosted[0]
        raise RequestError(f"'{where}.type' {kind!r} is not supported: this server runs no hosted tools, only "
                           f"{allowed} (started with --hosted-tools refuse; the default leaves them out)",
                           param=f"{where}.type", code="unsupported_field")
    return list(dict.fromkeys(kind for _, kind in hosted))


def _read_client_tools(converted: list[dict], wheres: list[str], renames: tuple, param: str,
                       vocab_size: int | None) -> list[dict] | None:
    """The chat's _read_tools over the converted tools; an error names the client's entry (wheres[k] for the
    k-th converted tool: hosted tools left out and namespace members shift the positions)."""
    try:
        return _on_chat_side(renames, _read_tools, converted, param, vocab_size)
    except RequestError as e:
        at = re.match(rf"{re.escape(param)}\[(\d+)\]", e.param or "")
        if at:
            e.param = wheres[int(at[1])] + e.param[at.end():]
        raise


def _responses_tools(tools, param: str, vocab_size: int | None) -> list[dict] | None:
    """Function tools (namespace tools' members too) -> chat tools; hosted tools (web_search, file_search, ...)
    are left out here (start_response applies the server's policy to them)."""
    converted, wheres = [], []
    for where, tool, _ in _function_tools(tools, param):
        if tool.get("type") != "function":
            continue
        _only_keys(tool, ("type", *FUNCTION_KEYS), where)
        converted.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
        wheres.append(where)
    return _read_client_tools(converted, wheres, RESPONSES_RENAMES, param, vocab_size)


def _responses_tool_choice(choice, param: str, vocab_size: int | None):
    """"none" | "auto" | "required" | {"type": "function", "name"} -> the chat tool_choice."""
    if isinstance(choice, str):
        return choice                                   # the chat checks the word and the tools
    choice = _check_type(choice, dict, param)
    if choice.get("type") != "function":
        raise RequestError(f"'{param}.type' {choice.get('type')!r} is not supported (only \"function\")",
                           param=f"{param}.type", code="unsupported_field")
    _only_keys(choice, ("type", "name"), param)
    return {"type": "function", "function": {"name": _check_type(choice.get("name"), str, f"{param}.name")}}


def _responses_reasoning(reasoning: dict, param: str, vocab_size: int | None) -> dict:
    _only_keys(reasoning, ("effort", "summary", "generate_summary"), param)
    if reasoning.get("effort") not in (None, *REASONING_EFFORTS):
        raise RequestError(f"'{param}.effort' must be one of {', '.join(REASONING_EFFORTS)}", param=f"{param}.effort")
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) not in (None, *REASONING_SUMMARIES):
            raise RequestError(f"'{param}.{key}' must be one of {', '.join(REASONING_SUMMARIES)}",
                               param=f"{param}.{key}")
    return reasoning


def _responses_text(text: dict, param: str, vocab_size: int | None) -> dict:
    """`text` -> {"response_format": the chat's, "verbosity": ...} (only the keys sent)."""
    _only_keys(text, ("format", "verbosity"), param)
    out = {"verbosity": text["verbosity"]} if text.get("verbosity") is not None else {}
    fmt = text.get("format")
    if fmt is None:
        return out
    fmt = _check_type(fmt, dict, f"{param}.format")
    kind = fmt.get("type")
    if kind == "json_schema":
        _only_keys(fmt, ("type", "name", "schema", "strict", "description"), f"{param}.format")
        out["response_format"] = {"type": "json_schema", "json_schema": {
            k: v for k, v in fmt.items() if k != "type" and v is not None}}
    elif kind in ("text", "json_object"):
        _only_keys(fmt, ("type",), f"{param}.format")
        out["response_format"] = {"type": kind}
    else:
        raise RequestError(f"'{param}.format.type' must be text, json_schema or json_object, got {kind!r}",
                           param=f"{param}.format.type")
    return out


def _responses_include(include: list, param: str, vocab_size: int | None) -> list[str]:
    for i, name in enumerate(include):
        if name not in RESPONSES_INCLUDES:
            raise RequestError(f"'{param}[{i}]' {name!r} is not supported (only {', '.join(RESPONSES_INCLUDES)})",
                               param=f"{param}[{i}]", code="unsupported_field")
    return include


# The Messages body's nested fields.

def _messages_blocks(content, param: str, role: str) -> list[dict]:
    """One Anthropic message -> chat messages: text blocks the content, thinking the reasoning, tool_use blocks
    the tool_calls; a user message's tool_result blocks become tool messages before its text."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    text, results, calls, reasoning = [], [], [], None
    for j, block in enumerate(_check_type(content, list, param)):
        where = f"{param}[{j}]"
        block = _check_type(block, dict, where)
        kind = block.get("type")
        if kind == "text":
            text.append({"type": "text", "text": _check_type(block.get("text"), str, f"{where}.text")})
        elif kind == "thinking" and role == "assistant":
            reasoning = _check_type(block.get("thinking"), str, f"{where}.thinking")
        elif kind == "tool_use" and role == "assistant":
            calls.append({"id": _check_type(block.get("id"), str, f"{where}.id"), "type": "function", "function": {
                "name": _check_type(block.get("name"), str, f"{where}.name"),
                "arguments": json.dumps(_check_type(block.get("input"), dict, f"{where}.input"))}})
        elif kind == "tool_result" and role == "user":
            result = _text_content(block.get("content") or "", f"{where}.content", ("text",))
            if block.get("is_error") is not None and _check_type(block["is_error"], bool, f"{where}.is_error"):
                result = [{"type": "text", "text": "Error:"}, *([{"type": "text", "text": result}]
                                                                 if isinstance(result, str) else result)]
            results.append({"role": "tool", "tool_call_id": _check_type(block.get("tool_use_id"), str,
                                                                        f"{where}.tool_use_id"), "content": result})
        else:
            raise RequestError(f"'{where}.type' {kind!r} is not supported in a {role} message (this server takes "
                               "text, thinking, tool_use and tool_result blocks)", param=f"{where}.type",
                               code="unsupported_field")
    if role == "assistant":
        message = {"role": "assistant", "content": text or None}
        message.update({k: v for k, v in (("reasoning_content", reasoning), ("tool_calls", calls)) if v})
        return [message]
    return results + ([{"role": "user", "content": text}] if text or not results else [])


def _messages_system(system, param: str, vocab_size: int | None) -> list[dict]:
    """`system`, a string or text blocks -> [the chat system message] ([] when empty)."""
    content = _text_content(system, param, ("text",))
    return [{"role": "system", "content": content}] if content else []


def _messages_input(messages, param: str, vocab_size: int | None) -> list[dict]:
    """`messages` -> chat messages."""
    converted = []
    for i, message in enumerate(_check_type(messages, list, param)):
        where = f"{param}[{i}]"
        message = _check_type(message, dict, where)
        _only_keys(message, ("role", "content"), where)
        role = message.get("role")
        if role == "system":                               # a system message mid-conversation
            converted += _messages_system(message.get("content"), f"{where}.content", vocab_size)
        elif role in ("user", "assistant"):
            converted += _messages_blocks(message.get("content"), f"{where}.content", role)
        else:
            raise RequestError(f"'{where}.role' must be user, assistant or system, got {role!r}",
                               param=f"{where}.role")
    if not converted:
        raise RequestError(f"'{param}' must not be empty", param=param)
    return converted


def _messages_tools(tools, param: str, vocab_size: int | None) -> list[dict] | None:
    """Custom tools (name, description, input_schema) -> chat tools; Anthropic's own tool types (web_search_*,
    bash_*, ...) are left out here (start_message applies the server's policy to them)."""
    converted, wheres = [], []
    for i, tool in enumerate(_check_type(tools, list, param)):
        where = f"{param}[{i}]"
        tool = _check_type(tool, dict, where)
        if tool.get("type") not in (None, "custom"):
            continue
        _only_keys(tool, ("type", "name", "description", "input_schema", "cache_control", "defer_loading"), where)
        if tool.get("defer_loading") is not None:      # Claude Code's tool search: offered here like any tool
            _check_type(tool["defer_loading"], bool, f"{where}.defer_loading")
        function = {k: tool[k] for k in ("name", "description") if k in tool}
        converted.append({"type": "function", "function": {**function, "parameters": tool.get("input_schema")}})
        wheres.append(where)
    return _read_client_tools(converted, wheres, MESSAGES_RENAMES, param, vocab_size)


def _messages_tool_choice(choice: dict, param: str, vocab_size: int | None) -> dict:
    kind = choice.get("type")
    if kind not in (*MESSAGES_TOOL_CHOICES, "tool"):
        raise RequestError(f"'{param}.type' must be auto, any, tool or none, got {kind!r}", param=f"{param}.type")
    _only_keys(choice, ("type", "name", "disable_parallel_tool_use"), param)
    if kind == "tool":
        _check_type(choice.get("name"), str, f"{param}.name")
    if choice.get("disable_parallel_tool_use") is not None:
        _check_type(choice["disable_parallel_tool_use"], bool, f"{param}.disable_parallel_tool_use")
    return choice


def _messages_thinking(thinking: dict, param: str, vocab_size: int | None) -> dict:
    kind = thinking.get("type")
    if kind not in MESSAGES_THINKING:
        raise RequestError(f"'{param}.type' must be one of {', '.join(MESSAGES_THINKING)}, got {kind!r}",
                           param=f"{param}.type")
    _only_keys(thinking, {"enabled": ("type", "budget_tokens", "display"), "adaptive": ("type", "display"),
                          "disabled": ("type",)}[kind], param)
    if kind == "enabled" and not _check_type(thinking.get("budget_tokens"), int, f"{param}.budget_tokens") >= 1:
        raise RequestError(f"'{param}.budget_tokens' must be at least 1", param=f"{param}.budget_tokens")
    if thinking.get("display") not in (None, "summarized", "omitted"):
        raise RequestError(f"'{param}.display' must be summarized or omitted", param=f"{param}.display")
    return thinking


def _messages_output_config(config: dict, param: str, vocab_size: int | None) -> dict:
    """`output_config` -> {"reasoning_effort"?, "response_format"?} for the chat body."""
    _only_keys(config, ("effort", "format"), param)
    out = {}
    if config.get("effort") is not None:
        if _check_type(config["effort"], str, f"{param}.effort") not in MESSAGES_EFFORTS:
            raise RequestError(f"'{param}.effort' must be one of {', '.join(MESSAGES_EFFORTS)}",
                               param=f"{param}.effort")
        out["reasoning_effort"] = MESSAGES_EFFORTS[config["effort"]]
    if config.get("format") is not None:
        fmt = _check_type(config["format"], dict, f"{param}.format")
        _only_keys(fmt, ("type", "schema"), f"{param}.format")
        if fmt.get("type") != "json_schema":
            raise RequestError(f"'{param}.format.type' must be json_schema", param=f"{param}.format.type")
        out["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": _check_type(fmt.get("schema"), dict, f"{param}.format.schema")}}
    return out


def _messages_metadata(metadata: dict, param: str, vocab_size: int | None) -> dict:
    _only_keys(metadata, ("user_id",), param)
    if metadata.get("user_id") is not None:
        _check_type(metadata["user_id"], str, f"{param}.user_id")
    return metadata


def _messages_context_management(config: dict, param: str, vocab_size: int | None) -> dict:
    """Only the edits that change nothing: clearing thinking while keeping all of it."""
    _only_keys(config, ("edits",), param)
    for i, edit in enumerate(_check_type(config.get("edits") or [], list, f"{param}.edits")):
        edit = _check_type(edit, dict, f"{param}.edits[{i}]")
        _check_type(edit.get("type"), str, f"{param}.edits[{i}].type")
        if not edit["type"].startswith("clear_thinking_") or edit.get("keep") != "all":
            raise RequestError(f"'{param}.edits[{i}]' is not supported: the context is never edited (only "
                               "clear_thinking with keep \"all\" is accepted)", param=f"{param}.edits[{i}]",
                               code="unsupported_field")
    return config


def _budget_below_max_tokens(values: dict, param: str):
    thinking = values[param]
    if thinking and thinking["type"] == "enabled" and values.get("max_tokens") is not None \
            and thinking["budget_tokens"] >= values["max_tokens"]:
        raise RequestError(f"'{param}.budget_tokens' must be less than 'max_tokens'", param=f"{param}.budget_tokens")
    return thinking


# The two tables, rendered into docs/api.md and /openapi.json like the chat's.

TEXT_PARTS_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": {
    "type": "object", "required": ["type", "text"],
    "properties": {"type": {"enum": list(RESPONSES_TEXT_PARTS)}, "text": {"type": "string"}}}}]}
FUNCTION_PARAMETERS_SCHEMA = TOOLS_SCHEMA["items"]["properties"]["function"]["properties"]["parameters"]
RESPONSES_INPUT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"anyOf": [
    {"type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
        "type": {"const": "message"}, "role": {"enum": ["user", "system", "developer", "assistant"]},
        "content": TEXT_PARTS_SCHEMA}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"const": "function_call"}, "call_id": {"type": "string"}, "name": {"type": "string"},
        "arguments": {"type": "string"}}},
    {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"const": "function_call_output"}, "call_id": {"type": "string"}, "output": TEXT_PARTS_SCHEMA}},
    {"type": "object", "required": ["type", "summary"], "properties": {
        "type": {"const": "reasoning"}, "summary": {"type": "array", "items": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "summary_text"}, "text": {"type": "string"}}}}}}]}}]}
RESPONSES_TOOLS_SCHEMA = {"type": "array", "items": {
    "type": "object", "required": ["type", "name"], "additionalProperties": False,
    "properties": {"type": {"const": "function"}, "name": {"type": "string", "minLength": 1},
                   "description": {"type": "string"}, "strict": {"type": "boolean"},
                   "parameters": FUNCTION_PARAMETERS_SCHEMA}}}
RESPONSES_TEXT_SCHEMA = {"type": "object", "additionalProperties": False, "properties": {
    "verbosity": {"enum": list(VERBOSITIES)}, "format": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "json_schema", "json_object"]}, "name": {"type": "string"},
        "schema": {"type": "object"}, "strict": {"type": "boolean"}, "description": {"type": "string"}}}}}
MESSAGES_INPUT_SCHEMA = {"type": "array", "minItems": 1, "items": {
    "type": "object", "required": ["role", "content"], "additionalProperties": False,
    "properties": {"role": {"enum": ["user", "assistant"]}, "content": {"anyOf": [
        {"type": "string"}, {"type": "array", "items": {"type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["text", "thinking", "tool_use", "tool_result"]}, "text": {"type": "string"},
            "thinking": {"type": "string"}, "signature": {"type": "string"}, "id": {"type": "string"},
            "name": {"type": "string"}, "input": {"type": "object"}, "tool_use_id": {"type": "string"},
            "content": {"type": ["string", "array"]}, "is_error": {"type": "boolean"}}}}]}}}}
MESSAGES_TOOLS_SCHEMA = {"type": "array", "items": {
    "type": "object", "required": ["name", "input_schema"], "additionalProperties": False,
    "properties": {"type": {"const": "custom"}, "name": {"type": "string", "minLength": 1},
                   "description": {"type": "string"}, "input_schema": FUNCTION_PARAMETERS_SCHEMA,
                   "cache_control": {"type": "object"}, "defer_loading": {"type": "boolean"}}}}
TEXT_BLOCKS_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": {
    "type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"}, "text": {"type": "string"},
                                                                   "cache_control": {"type": "object"}}}}]}


def _refused_unless_null(why: str = UNIMPLEMENTED, kind: str = "object") -> Field:
    return Field(kind=kind, policy=DEFAULT_ONLY, allowed=(None,), layer="server", why=why)


RESPONSES_FIELDS = {
    **_table(
        model=GENERATION_FIELDS["model"],
        input=Field(required=True, layer="template", read=_responses_input, schema=RESPONSES_INPUT_SCHEMA,
                    shape="string, or array of items",
                    why="items: `message` (roles `user`, `system`, `developer`, `assistant`; content a string or "
                        "`input_text`/`output_text` parts), `function_call` (`call_id`, `name`, `arguments`), "
                        "`function_call_output` (`call_id`, `output`), `reasoning` (its `content` or `summary` "
                        "texts, replayed as the next assistant turn's reasoning). Other item and part types (images, "
                        "files, item references) are 400 naming them"),
        instructions=Field(kind="string", layer="template",
                           why="a system message before the input; not carried over by `previous_response_id`"),
        previous_response_id=Field(kind="string", layer="server",
                                   why="continue a stored response: its input and output come before this input "
                                       "(not its instructions); an id not stored is 400 "
                                       "(`code: previous_response_not_found`)"),
        store=Field(kind="boolean", default=True, layer="server",
                    why=f"keep the response in memory for `previous_response_id` and `GET`/`DELETE "
                        f"/v1/responses/{{id}}` (at most {RESPONSE_STORE_COUNT} responses and "
                        f"{RESPONSE_STORE_BYTES >> 20} MiB, the oldest dropped); false keeps nothing"),
        stream=Field(kind="boolean", default=False, layer="server",
                     why="server-sent events `response.created` ... `response.completed`, each with "
                         "`sequence_number`")),
    "stream_options": CHAT_FIELDS["stream_options"],
    **_table(
        tools=Field(kind="array", layer="template", read=_responses_tools, schema=RESPONSES_TOOLS_SCHEMA,
                    shape='array of `{"type": "function", "name", "description"?, "parameters"?, "strict"?}`',
                    why="as the chat's `tools`; `namespace` tools' member functions too. Hosted tools (`web_search`, "
                        "`file_search`, `computer_use`, `code_interpreter`, `mcp`, ...) run nowhere here: they are "
                        "left out (the model never sees them) and named in the `X-Pocketllm-Omitted-Tools` "
                        "header; a server started with `--hosted-tools refuse` answers 400 naming the type"),
        tool_choice=Field(layer="parser", read=_responses_tool_choice,
                          schema={"anyOf": [{"enum": ["none", "auto", "required"]}, {
                              "type": "object", "required": ["type", "name"],
                              "properties": {"type": {"const": "function"}, "name": {"type": "string"}}}]},
                          shape='`"none"`, `"auto"`, `"required"`, `{"type": "function", "name"}`',
                          default_text='`"auto"` with tools, else `"none"`', why="as the chat's `tool_choice`"),
        parallel_tool_calls=CHAT_FIELDS["parallel_tool_calls"],
        max_output_tokens=Field(kind="integer", lo=1, layer="engine", default_text="the rest of the context",
                                why="output tokens at most, thinking included; reaching it ends the response with "
                                    "`status: incomplete`, `incomplete_details.reason: max_output_tokens`")),
    **_sampling_rows("temperature", "top_p"),
    **_table(
        reasoning=Field(kind="object", layer="template", read=_responses_reasoning,
                        schema={"type": "object", "properties": {"effort": {"enum": list(REASONING_EFFORTS)},
                                                                 "summary": {"enum": list(REASONING_SUMMARIES)}}},
                        shape="`{effort?, summary?}`",
                        why="`effort` as the chat's `reasoning_effort`; `summary` accepted with no effect: the "
                            "`reasoning` item's summary is always the whole thinking text"),
        text=Field(kind="object", layer="parser", read=_responses_text, schema=RESPONSES_TEXT_SCHEMA,
                   shape="`{format?, verbosity?}`",
                   why="`format` `{type: text}`, `{type: json_schema, name, schema, strict?}` or "
                       "`{type: json_object}` becomes the chat's `response_format` (and its policy); `verbosity` as "
                       "the chat's"),
        include=Field(kind="array", layer="server", read=_responses_include,
                      schema={"type": "array", "items": {"enum": list(RESPONSES_INCLUDES)}},
                      why="`reasoning.encrypted_content`: reasoning items carry `encrypted_content` (the thinking "
                          "text itself, not encrypted: pocketllm keeps no secret), replayed when sent back; other "
                          "values 400"),
        truncation=Field(kind="string", policy=DEFAULT_ONLY, allowed=(None, "disabled"), layer="server",
                         why="a prompt over the context is 400, never cut"),
        background=Field(kind="boolean", policy=DEFAULT_ONLY, allowed=(None, False), layer="server",
                         why=UNIMPLEMENTED),
        top_logprobs=Field(kind="integer", policy=DEFAULT_ONLY, allowed=(None, 0), layer="server", why=UNIMPLEMENTED),
        max_tool_calls=_refused_unless_null(kind="integer"),
        conversation=_refused_unless_null(kind="any", why="conversations are not stored; use "
                                                          "`previous_response_id`"),
        prompt=_refused_unless_null(why="stored prompt templates live on OpenAI's side")),
    **{name: GENERATION_FIELDS[name] for name in ("user", "metadata", "service_tier", "prompt_cache_key",
                                                  "prompt_cache_retention", "safety_identifier")},
    **_table(client_metadata=Field(kind="object", layer="server", policy=NO_EFFECT,
                                   why="Codex's session bookkeeping")),
}

MESSAGES_FIELDS = {
    **_table(
        model=GENERATION_FIELDS["model"],
        messages=Field(kind="array", required=True, layer="template", read=_messages_input,
                       schema=MESSAGES_INPUT_SCHEMA, shape="non-empty array of `{role, content}`",
                       why="roles `user` and `assistant`; content a string or blocks: `text`, `thinking` "
                           "(assistant; replayed as its reasoning, the signature not checked), `tool_use` "
                           "(assistant), `tool_result` (user: content a string or text blocks; `is_error` puts "
                           "\"Error:\" before it). `image`, `document` and other blocks are 400 naming them; "
                           "`cache_control` is accepted (caching is automatic)"),
        system=Field(layer="template", read=_messages_system, schema=TEXT_BLOCKS_SCHEMA,
                     shape="string or array of text blocks", why="the system message"),
        max_tokens=Field(kind="integer", lo=1, required=True, layer="engine",
                         why="required, as Anthropic requires it; thinking included; reaching it is "
                             "`stop_reason: max_tokens`"),
        stop_sequences=dataclasses.replace(SAMPLING_FIELDS["stop"], why="the matched one is `stop_sequence` with "
                                                                         "`stop_reason: stop_sequence`"),
        stream=Field(kind="boolean", default=False, layer="server",
                     why="server-sent events `message_start` ... `message_stop`, with `ping`")),
    "temperature": dataclasses.replace(SAMPLING_FIELDS["temperature"], hi=1, why="0 is greedy (Anthropic's range)"),
    **_sampling_rows("top_p", "top_k"),
    **_table(
        tools=Field(kind="array", layer="template", read=_messages_tools, schema=MESSAGES_TOOLS_SCHEMA,
                    shape="array of `{name, description?, input_schema, defer_loading?}`",
                    why="as the chat's `tools` (`defer_loading`, which Claude Code sets on a placeholder tool, is "
                        "accepted: the tool is offered like the others). Anthropic's own tool types (server tools "
                        "`web_search_*`, `web_fetch_*`, `code_execution_*`; `bash_*`, `text_editor_*`, ...) are "
                        "left out (the model "
                        "never sees them) and named in the `X-Pocketllm-Omitted-Tools` header; a server started "
                        "with `--hosted-tools refuse` answers 400 naming the type"),
        tool_choice=Field(kind="object", layer="parser", read=_messages_tool_choice,
                          schema={"type": "object", "required": ["type"], "properties": {
                              "type": {"enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"},
                              "disable_parallel_tool_use": {"type": "boolean"}}},
                          shape="`{type: auto | any | tool | none, name?, disable_parallel_tool_use?}`",
                          default_text="auto with tools",
                          why="`any` is the chat's `required`, `tool` names the one function; "
                              "`disable_parallel_tool_use: true` is `parallel_tool_calls: false`"),
        thinking=Field(kind="object", layer="template", read=_messages_thinking, relate=_budget_below_max_tokens,
                       schema={"type": "object", "required": ["type"], "properties": {
                           "type": {"enum": list(MESSAGES_THINKING)}, "budget_tokens": {"type": "integer", "minimum": 1},
                           "display": {"enum": ["summarized", "omitted"]}}},
                       shape="`{type: enabled, budget_tokens, display?}`, `{type: adaptive, display?}` or "
                             "`{type: disabled}`", default_text="disabled",
                       why="`enabled` and `adaptive` set the template's `enable_thinking` true, `disabled` and absent "
                           "false (Anthropic's default); sent to a template that does not read it, 400. "
                           "`budget_tokens` must be below `max_tokens`, which alone bounds the thinking (Anthropic "
                           "calls the budget a target). `display: omitted`: thinking blocks come with empty text"),
        output_config=Field(kind="object", layer="template", read=_messages_output_config,
                            schema={"type": "object", "properties": {
                                "effort": {"enum": list(MESSAGES_EFFORTS)}, "format": {
                                    "type": "object", "required": ["type", "schema"], "properties": {
                                        "type": {"const": "json_schema"}, "schema": {"type": "object"}}}}},
                            shape="`{effort?, format?}`",
                            why="`effort` is the chat's `reasoning_effort` (`xhigh` and `max` as `high`) for a "
                                "template that reads it; with one that does not, the depth of thinking is the "
                                "model's own and only `thinking` turns it on or off. `format` `{type: json_schema, "
                                "schema}` becomes the chat's `response_format` (and its policy)"),
        context_management=Field(kind="object", layer="template", read=_messages_context_management,
                                 why="accepted when its edits change nothing (`clear_thinking_*` with `keep: "
                                     "\"all\"`, as Claude Code sends); any other edit is 400"),
        metadata=Field(kind="object", layer="server", policy=NO_EFFECT, read=_messages_metadata,
                       schema={"type": "object", "additionalProperties": False,
                               "properties": {"user_id": {"type": ["string", "null"]}}},
                       why="`user_id`: bookkeeping on Anthropic's side"),
        **{name: Field(kind=kind, layer="server", policy=NO_EFFECT, why=why) for name, kind, why in (
            ("cache_control", "object", "prompt caching is automatic here"),
            ("diagnostics", "object", "no diagnostics are returned"),
            ("service_tier", "string", "bookkeeping on Anthropic's side"),
            ("inference_geo", "string", "bookkeeping on Anthropic's side"),
            ("user_profile_id", "string", "bookkeeping on Anthropic's side"),
            ("workspace_id", "string", "bookkeeping on Anthropic's side"))},
        speed=Field(kind="string", enum=("standard", "fast"), layer="server", policy=NO_EFFECT,
                    why="one speed here"),
        container=_refused_unless_null(kind="any"),
        mcp_servers=_refused_unless_null(kind="array")),
}

MESSAGES_COUNT_FIELDS = {name: MESSAGES_FIELDS[name] for name in (
    "model", "messages", "system", "tools", "tool_choice", "thinking", "output_config", "context_management",
    "cache_control", "speed", "user_profile_id", "workspace_id")}
FIELD_TABLES.update(responses=RESPONSES_FIELDS, messages=MESSAGES_FIELDS, messages_count_tokens=MESSAGES_COUNT_FIELDS)


class ResponseStore:
    """Responses kept for previous_response_id and GET/DELETE /v1/responses/{id}: in memory, bounded by count and
    JSON bytes, the oldest dropped first. Each holds the response and its conversation as chat messages."""

    def __init__(self, max_count: int = RESPONSE_STORE_COUNT, max_bytes: int = RESPONSE_STORE_BYTES):
        self.max_count, self.max_bytes, self.bytes = max_count, max_bytes, 0
        self.lock, self.records = threading.Lock(), {}    # id -> (response, messages, bytes), oldest first

    def put(self, response: dict, messages: list[dict]) -> None:
        size = len(json.dumps([response, messages], ensure_ascii=False).encode())
        with self.lock:
            self.records[response["id"]] = (response, messages, size)
            self.bytes += size
            while self.records and (len(self.records) > self.max_count or self.bytes > self.max_bytes):
                self.bytes -= self.records.pop(next(iter(self.records)))[2]

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        with self.lock:
            record = self.records.get(response_id)
        return record[:2] if record else None

    def delete(self, response_id: str) -> bool:
        with self.lock:
            record = self.records.pop(response_id, None)
            self.bytes -= record[2] if record else 0
        return record is not None


def _chat_body(body: dict, values: dict, messages: list[dict], passed: tuple[str, ...]) -> dict:
    """The chat body a protocol's request becomes: its messages, always streamed with usage (both protocols are
    shaped from the stream), and the fields that mean the same as sent (absent ones take the chat's defaults)."""
    chat = {"messages": messages, "stream": True, "stream_options": {"include_usage": True}}
    chat.update({name: body[name] for name in passed if body.get(name) is not None})
    if values.get("tools"):
        chat["tools"] = values["tools"]
    return chat


def _chat_blocks(chunks: Iterator[dict]) -> Iterator[tuple]:
    """A one-choice chat stream as blocks: ("open", kind, call) when a "reasoning", "text" or "tool" block starts
    (call: {"id", "name"} for a tool), ("delta", kind, text), ("close", kind, None), then ("finish",
    finish_reason, stop_reason) and ("usage", None, usage)."""
    kind = None
    for chunk in chunks:
        if not chunk["choices"]:
            yield "usage", None, chunk["usage"]
            continue
        choice, delta = chunk["choices"][0], chunk["choices"][0]["delta"]
        for key, block in (("reasoning_content", "reasoning"), ("content", "text")):
            if delta.get(key):
                if kind != block:
                    if kind:
                        yield "close", kind, None
                    kind = block
                    yield "open", block, None
                yield "delta", block, delta[key]
        for call in delta.get("tool_calls") or []:
            if "id" in call:
                if kind:
                    yield "close", kind, None
                kind = "tool"
                yield "open", "tool", {"id": call["id"], "name": call["function"]["name"]}
            if call["function"].get("arguments"):
                yield "delta", "tool", call["function"]["arguments"]
        if choice["finish_reason"]:
            if kind:
                yield "close", kind, None
            kind = None
            yield "finish", choice["finish_reason"], choice.get("stop_reason")


def _cached_tokens(usage: dict) -> int:
    """Prompt tokens served from the prefix cache, as the chat usage reports them (0 when it does not)."""
    return ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0


class ProtocolTurn:
    """A submitted chat completion shaped into another protocol: `chunks()` its stream events (an error after the
    first becomes the protocol's error event), `response()` its whole answer (the same events, folded)."""

    def __init__(self, llm, completion: Completion, stream_mode: bool):
        self.llm, self.completion, self.stream_mode = llm, completion, stream_mode
        self.omitted_tools: list[str] = []     # the hosted tool types left out of the request

    def abort(self) -> None:
        self.completion.abort()

    def events(self) -> Iterator[dict]:
        raise NotImplementedError

    def error_event(self, error: RequestError) -> dict:
        raise NotImplementedError

    def chunks(self) -> Iterator[dict]:
        try:
            yield from self.events()
        except RequestError as e:
            yield self.error_event(e)
        finally:
            self.abort()

    def response(self) -> dict:
        try:
            for _ in self.events():
                pass
        finally:
            self.abort()
        return self.answer


class ResponsesTurn(ProtocolTurn):
    """One /v1/responses request: the Response object, built up as the chat stream's blocks arrive."""

    def __init__(self, llm, completion: Completion, values: dict, conversation: list[dict],
                 store: ResponseStore | None, namespaces: dict[str, str]):
        super().__init__(llm, completion, values["stream"])
        self.conversation, self.store, self.namespaces, self.sequence = conversation, store, namespaces, 0
        self.encrypted = "reasoning.encrypted_content" in (values["include"] or [])
        self.answer = {
            "id": "resp_" + uuid.uuid4().hex, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "background": False, "error": None, "incomplete_details": None,
            "instructions": values["instructions"], "max_output_tokens": values["max_output_tokens"],
            "max_tool_calls": None, "model": llm.model_name, "output": [],
            "parallel_tool_calls": values["parallel_tool_calls"],
            "previous_response_id": values["previous_response_id"],
            "reasoning": {"effort": (values["reasoning"] or {}).get("effort"),
                          "summary": (values["reasoning"] or {}).get("summary")},
            "service_tier": "default", "store": store is not None,
            "temperature": values["temperature"], "top_p": values["top_p"],
            "text": {"format": (values["text"] or {}).get("response_format") or {"type": "text"},
                     "verbosity": (values["text"] or {}).get("verbosity")},
            "tool_choice": values["tool_choice"] or ("auto" if values["tools"] else "none"),
            "tools": [{"type": "function", **tool["function"]} for tool in values["tools"] or []],
            "top_logprobs": 0, "truncation": "disabled", "usage": None, "user": values["user"],
            "metadata": values["metadata"] or {}}

    def _event(self, kind: str, **fields) -> dict:
        self.sequence += 1
        return {"type": "response." + kind, "sequence_number": self.sequence - 1, **copy.deepcopy(fields)}

    def error_event(self, error: RequestError) -> dict:
        self.sequence += 1
        return {"type": "error", "code": error.code, "message": str(error), "param": error.param,
                "sequence_number": self.sequence - 1}

    def events(self) -> Iterator[dict]:
        out = self.answer["output"]
        yield self._event("created", response=self.answer)
        yield self._event("in_progress", response=self.answer)
        for what, kind, data in _chat_blocks(self.completion.chunks()):
            item, where = (out[-1], {"item_id": out[-1]["id"], "output_index": len(out) - 1}) if out else (None, {})
            if what == "open":
                yield from self._open(kind, data)
            elif what == "delta" and kind == "text":
                item["content"][0]["text"] += data
                yield self._event("output_text.delta", **where, content_index=0, delta=data, logprobs=[])
            elif what == "delta" and kind == "reasoning":
                item["summary"][0]["text"] += data
                yield self._event("reasoning_summary_text.delta", **where, summary_index=0, delta=data)
            elif what == "delta":
                item["arguments"] += data
                yield self._event("function_call_arguments.delta", **where, delta=data)
            elif what == "close":
                yield from self._close(kind, item, where)
            elif what == "finish" and kind == "length":
                self.answer.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
            elif what == "usage":
                self.answer["usage"] = self._usage(data)
        if self.answer["status"] == "in_progress":
            self.answer["status"] = "completed"
        if self.store is not None:
            self.store.put(copy.deepcopy(self.answer), self.conversation + [self._assistant_message()])
        yield self._event(self.answer["status"], response=self.answer)

    def _open(self, kind: str, call: dict | None) -> Iterator[dict]:
        out = self.answer["output"]
        if kind == "text":
            item = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
        elif kind == "reasoning":
            item = {"id": "rs_" + uuid.uuid4().hex, "type": "reasoning", "summary": [], "status": "in_progress"}
        else:
            item = {"id": "fc_" + uuid.uuid4().hex, "type": "function_call", "call_id": call["id"],
                    "name": call["name"], "arguments": "", "status": "in_progress"}
            if call["name"] in self.namespaces:
                item["namespace"] = self.namespaces[call["name"]]
        out.append(item)
        where = {"item_id": item["id"], "output_index": len(out) - 1}
        yield self._event("output_item.added", output_index=len(out) - 1, item=item)
        if kind == "text":
            item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            yield self._event("content_part.added", **where, content_index=0, part=item["content"][0])
        elif kind == "reasoning":
            item["summary"].append({"type": "summary_text", "text": ""})
            yield self._event("reasoning_summary_part.added", **where, summary_index=0, part=item["summary"][0])

    def _close(self, kind: str, item: dict, where: dict) -> Iterator[dict]:
        if kind == "text":
            part = item["content"][0]
            yield self._event("output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            yield self._event("content_part.done", **where, content_index=0, part=part)
        elif kind == "reasoning":
            part = item["summary"][0]
            if self.encrypted:
                item["encrypted_content"] = part["text"]
            yield self._event("reasoning_summary_text.done", **where, summary_index=0, text=part["text"])
            yield self._event("reasoning_summary_part.done", **where, summary_index=0, part=part)
        else:
            yield self._event("function_call_arguments.done", **where, name=item["name"],
                              arguments=item["arguments"])
        item["status"] = "completed"
        yield self._event("output_item.done", output_index=where["output_index"], item=item)

    def _usage(self, usage: dict) -> dict:
        reasoning = "".join(item["summary"][0]["text"] for item in self.answer["output"] if item["type"] == "reasoning")
        return {"input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": _cached_tokens(usage)},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": len(self.llm.tokenizer.encode_text(reasoning))
                                          if reasoning else 0},
                "total_tokens": usage["total_tokens"]}

    def _assistant_message(self) -> dict:
        """This response's output as the chat message that a previous_response_id continues after."""
        message = {"role": "assistant", "content": None}
        for item in self.answer["output"]:
            if item["type"] == "reasoning":
                message["reasoning_content"] = item["summary"][0]["text"]
            elif item["type"] == "message":
                message["content"] = item["content"][0]["text"]
            else:
                message.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                    "name": item["name"], "arguments": item["arguments"]}})
        return message


def start_response(llm, body, store: ResponseStore | None = None, metrics: ServerMetrics | None = None,
                   hosted: str = "omit"):
    """Validate a /v1/responses body, continue its previous response, and submit it as a chat completion.
    hosted: the policy for hosted tools (HOSTED_TOOL_POLICIES)."""
    values = read_fields(body, RESPONSES_FIELDS, llm.config.vocab_size)
    omitted = _omit_or_refuse(hosted_tools(body.get("tools"), ("function",)), hosted, "function tools")
    history = []
    if values["previous_response_id"] is not None:
        record = store.get(values["previous_response_id"]) if store else None
        if record is None:
            raise RequestError(f"previous response {values['previous_response_id']!r} is not stored (it was sent "
                               "with store: false, deleted, or dropped as the store filled)",
                               param="previous_response_id", code="previous_response_not_found")
        history = record[1]
    conversation = history + values["input"]
    system = [{"role": "system", "content": values["instructions"]}] if values["instructions"] else []
    chat = _chat_body(body, values, system + conversation, ("model", "temperature", "top_p", "parallel_tool_calls"))
    chat.update(values["text"] or {})
    if values["max_output_tokens"] is not None:
        chat["max_tokens"] = values["max_output_tokens"]
    if values["tool_choice"] is not None:
        chat["tool_choice"] = values["tool_choice"]
    if (values["reasoning"] or {}).get("effort") is not None:
        chat["reasoning_effort"] = values["reasoning"]["effort"]
    completion = _on_chat_side(RESPONSES_RENAMES, start_chat_completion, llm, chat, metrics)
    turn = ResponsesTurn(llm, completion, values, conversation, store if values["store"] else None,
                         _tool_namespaces(body.get("tools")))
    turn.omitted_tools = omitted
    return turn


def _messages_usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict:
    """Anthropic's usage: input_tokens excludes those read from the cache."""
    return {"input_tokens": prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output_tokens}


def _arguments_object(arguments: str) -> dict:
    """A call's JSON arguments as the tool_use block's input ({} when cut off before they closed)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesTurn(ProtocolTurn):
    """One /v1/messages request: the Message object, built up as the chat stream's blocks arrive."""

    def __init__(self, llm, completion: Completion, values: dict):
        super().__init__(llm, completion, values["stream"])
        self.omit_thinking = (values["thinking"] or {}).get("display") == "omitted"
        self.answer = {"id": "msg_" + uuid.uuid4().hex, "type": "message", "role": "assistant",
                       "model": llm.model_name, "content": [], "stop_reason": None, "stop_sequence": None,
                       "usage": _messages_usage(completion.stream.prompt_tokens, 0, 0)}

    def error_event(self, error: RequestError) -> dict:
        return anthropic_error(error.status, {"message": str(error), "param": error.param, "code": error.code})

    def events(self) -> Iterator[dict]:
        content = self.answer["content"]
        yield {"type": "message_start", "message": copy.deepcopy(self.answer)}
        yield {"type": "ping"}
        arguments = ""
        for what, kind, data in _chat_blocks(self.completion.chunks()):
            index = len(content) - 1
            if what == "open":
                block = ({"type": "text", "text": ""} if kind == "text" else
                         {"type": "thinking", "thinking": "", "signature": ""} if kind == "reasoning" else
                         {"type": "tool_use", "id": "toolu_" + data["id"].removeprefix("call_"), "name": data["name"],
                          "input": {}})
                content.append(block)
                arguments = ""
                yield {"type": "content_block_start", "index": len(content) - 1, "content_block": copy.deepcopy(block)}
            elif what == "delta" and kind == "reasoning" and self.omit_thinking:
                continue
            elif what == "delta":
                key, delta_type = {"text": ("text", "text_delta"), "reasoning": ("thinking", "thinking_delta"),
                                   "tool": ("partial_json", "input_json_delta")}[kind]
                if kind == "tool":
                    arguments += data
                else:
                    content[index][key] += data
                yield {"type": "content_block_delta", "index": index, "delta": {"type": delta_type, key: data}}
            elif what == "close":
                if kind == "reasoning":          # a digest of the thinking, so replays look as signed ones do
                    content[index]["signature"] = hashlib.sha256(content[index]["thinking"].encode()).hexdigest()
                    yield {"type": "content_block_delta", "index": index,
                           "delta": {"type": "signature_delta", "signature": content[index]["signature"]}}
                elif kind == "tool":
                    content[index]["input"] = _arguments_object(arguments)
                yield {"type": "content_block_stop", "index": index}
            elif what == "finish":
                stop_sequence = data if isinstance(data, str) else None
                self.answer.update(stop_reason="stop_sequence" if stop_sequence else MESSAGES_STOP_REASONS[kind],
                                   stop_sequence=stop_sequence)
            else:
                self.answer["usage"] = _messages_usage(data["prompt_tokens"], data["completion_tokens"],
                                                       _cached_tokens(data))
        yield {"type": "message_delta", "delta": {"stop_reason": self.answer["stop_reason"],
                                                  "stop_sequence": self.answer["stop_sequence"]},
               "usage": self.answer["usage"]}
        yield {"type": "message_stop"}


def messages_chat_body(llm, body, table: dict[str, Field], hosted: str = "omit") -> tuple[dict, dict]:
    """A /v1/messages (or count_tokens) body read through its table -> (its values, the chat body it means);
    values["omitted_tools"]: the Anthropic tool types left out under the hosted-tools policy."""
    values = read_fields(body, table, llm.config.vocab_size)
    values["omitted_tools"] = _omit_or_refuse(hosted_tools(body.get("tools"), (None, "custom")), hosted,
                                              "custom tools (name, input_schema)")
    chat = _chat_body(body, values, (values["system"] or []) + values["messages"],
                      ("model", "temperature", "top_p", "top_k", "max_tokens"))
    choice = values["tool_choice"]
    if choice is not None:
        chat["tool_choice"] = MESSAGES_TOOL_CHOICES.get(choice["type"]) or {
            "type": "function", "function": {"name": choice.get("name")}}
        if choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    if values.get("stop_sequences"):
        chat["stop"] = values["stop_sequences"]
    thinking, output = values["thinking"], values["output_config"] or {}
    if thinking is not None and not _template_reads(llm, "enable_thinking"):
        raise _unsupported_by_template("thinking")
    if _template_reads(llm, "enable_thinking"):
        chat["chat_template_kwargs"] = {"enable_thinking": bool(thinking) and thinking["type"] != "disabled"}
    if "reasoning_effort" in output and _template_reads(llm, "reasoning_effort"):
        chat["reasoning_effort"] = output["reasoning_effort"]
    if "response_format" in output:
        chat["response_format"] = output["response_format"]
    return values, chat


def start_message(llm, body, metrics: ServerMetrics | None = None, hosted: str = "omit") -> MessagesTurn:
    """Validate a /v1/messages body and submit it as a chat completion (hosted: the hosted-tools policy)."""
    values, chat = messages_chat_body(llm, body, MESSAGES_FIELDS, hosted)
    turn = MessagesTurn(llm, _on_chat_side(MESSAGES_RENAMES, start_chat_completion, llm, chat, metrics), values)
    turn.omitted_tools = values["omitted_tools"]
    return turn


def _chat_prompt_tokens(llm, chat: dict) -> int:
    """The prompt tokens of a chat body, rendered as /tokenize renders it."""
    values = read_fields({k: v for k, v in chat.items() if k in TOKENIZE_FIELDS}, TOKENIZE_FIELDS)
    return len(llm.tokenizer.encode(render_chat_prompt(llm, values, values["tools"])))


def count_message_tokens(llm, body, hosted: str = "omit") -> dict:
    """/v1/messages/count_tokens: the prompt a /v1/messages body renders, counted."""
    values, chat = messages_chat_body(llm, body, MESSAGES_COUNT_FIELDS, hosted)
    _check_model(llm, values)
    return {"input_tokens": _on_chat_side(MESSAGES_RENAMES, _chat_prompt_tokens, llm, chat)}


# -----------------------------------------------------------------------------------------------
# 13. The HTTP server: ThreadingHTTPServer with one route table and one translator from exceptions to
#     OpenAI errors. Each request runs on its own thread and blocks on its RequestStream; SSE for streams.
# -----------------------------------------------------------------------------------------------

DEFAULT_MAX_REQUEST_BYTES = 16 * 2 ** 20
DEFAULT_SOCKET_TIMEOUT = 60.0      # seconds a client may stay silent (idle keep-alive, a slow body or read)
DEFAULT_MAX_CONNECTIONS = 256      # open connections; one more is answered 503 and closed
DEFAULT_SEND_BUFFER = 64 * 2 ** 10 # bytes the kernel holds for a client that stops reading (no autotuning to MBs)
DEFAULT_DRAIN_TIMEOUT = 30.0       # seconds a SIGTERM lets the requests in flight finish before the process exits
RETRY_AFTER_SECONDS = 1            # the Retry-After of a 503 that another replica (or this one, soon) can answer
PREFIX_HASH_HEADER = "X-Prefix-Hash"   # on every completion: the routing key of its prompt's first blocks
PREFIX_HASH_BLOCKS = 16            # full KV blocks the routing key covers (256 tokens at the default block size)
DEFAULT_KEEPALIVE = 5.0            # seconds a stream may go without an event before a keep-alive is sent
SSE_PING = b'event: ping\ndata: {"type": "ping"}\n\n'    # Anthropic's keep-alive event, which its clients skip
SSE_COMMENT = b": keep-alive\n\n"                           # an SSE comment: every SSE parser skips it
CLIENT_CLOSED = 499                # logged and counted when the client hangs up before its answer (nginx's code)
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


class ClientWatch:
    """One thread per request that watches its client while the request waits on the engine: it calls
    on_disconnect if the client closes its socket and, while a stream keeps alive (keeping_alive), writes the
    stream's keep-alive whenever it has been silent for its period. Between a stream's writes (the queue, a long
    prefill, tokens that add no text) a closed socket is noticed by nothing else, a write only fails on the second
    try after the close, and a client's read timeout or a proxy cuts a silent stream."""

    POLL_S = 0.05                        # how soon a hang-up is noticed (the chat page's Stop under load)

    def __init__(self, handler, on_disconnect: Callable[[], None]):
        self.handler, self.on_disconnect, self.done = handler, on_disconnect, threading.Event()
        self.keepalive: tuple[bytes, float] | None = None      # (payload, seconds of silence before it)

    def __enter__(self):
        threading.Thread(target=self._watch, name="pocketllm-client-watch", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()

    @contextlib.contextmanager
    def keeping_alive(self, payload: bytes, seconds: float):
        """Keep-alives for a stream whose headers are out, until its last event; its writes share
        handler.write_lock with them."""
        self.keepalive = (payload, seconds)
        try:
            yield self
        finally:
            with self.handler.write_lock:        # no keep-alive after the stream's last event
                self.keepalive = None

    def _watch(self) -> None:
        watching = True                          # the socket: no longer once the client's next request waits on it
        while not self.done.is_set():
            if watching:
                state = self._poll()
            else:
                self.done.wait(self.POLL_S)
                state = "pipelined"
            if state == "gone":
                if not self.done.is_set():
                    self.on_disconnect()
                return
            watching = state == "quiet"
            self._beat()

    def _poll(self) -> str:
        """'quiet' (nothing to read), 'pipelined' (the client's next request is there: it stays) or 'gone'."""
        sock = self.handler.connection
        try:
            if not select.select([sock], [], [], self.POLL_S)[0]:
                return "quiet"
            return "pipelined" if sock.recv(1, socket.MSG_PEEK) else "gone"
        except (OSError, ValueError):
            return "gone"                        # reset or closed: gone as well

    def _beat(self) -> None:
        """The keep-alive, if the stream has been silent for its period; never while it writes an event."""
        if self.keepalive is None or not self.handler.write_lock.acquire(blocking=False):
            return
        try:
            if self.keepalive and time.monotonic() - self.handler.last_write >= self.keepalive[1]:
                self.handler.write_sse(self.keepalive[0])
        except Exception:                         # the client left: the socket or the stream's next write says so
            self.keepalive = None
        finally:
            self.handler.write_lock.release()


def prefix_hash(llm, prompt_ids: list[int]) -> str | None:
    """The routing key of a prompt: the prefix cache's key (section 5) of its first PREFIX_HASH_BLOCKS full
    blocks, or of all its tokens when it is shorter than one block; 32 hex digits. Replicas of one model compute
    the same key, so a gateway hashing on it sends prompts that start alike, a conversation's turns among them,
    to the replica that cached their start. None with the prefix cache off.

    >>> llm = LLM()
    >>> prefix_hash(llm, list(range(1, 300))) == prefix_hash(llm, list(range(1, 257)) + [7, 7])   # 16 blocks of 16
    True
    """
    cache = llm.engine.prefix
    if cache is None:
        return None
    blocks = min(PREFIX_HASH_BLOCKS, len(prompt_ids) // cache.block_size)
    if not blocks:
        return cache.key(cache.root, prompt_ids).hex()
    return cache.block_keys(prompt_ids[:blocks * cache.block_size], [])[-1].hex()


def prefix_hash_header(llm, completion) -> dict:
    """{PREFIX_HASH_HEADER: key} for a submitted completion (a ProtocolTurn wraps one); {} without a key."""
    inner = getattr(completion, "completion", completion)
    key = prefix_hash(llm, inner.stream.request.prompt_ids)
    return {PREFIX_HASH_HEADER: key} if key else {}


# The endpoints. Each takes the handler, the path match and the raw body, and sends one response.

_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(value, param: str) -> str | None:
    """The path of the first string (key or value) holding a lone surrogate, which JSON's \\uD800 escapes can
    spell but no text is; None if there is none."""
    if isinstance(value, str):
        return param if _SURROGATE.search(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _SURROGATE.search(key):        # named escaped: the answer must be text
            key = key.encode("utf-8", "backslashreplace").decode()
            return f"{param}.{key}" if param else key
        where = f"{param}[{key}]" if isinstance(key, int) else f"{param}.{key}" if param else key
        found = _lone_surrogate(item, where)
        if found is not None:
            return found
    return None


def _json_body(raw: bytes) -> dict:
    def refuse_constant(name):
        raise ValueError(f"{name} is not valid JSON")
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=refuse_constant)
    except (UnicodeDecodeError, ValueError) as e:
        raise RequestError(f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError(f"the body must be a JSON object, got {_json_type(body)}", code="invalid_json")
    if b"\\u" in raw and (where := _lone_surrogate(body, "")) is not None:
        raise RequestError(f"'{where}' holds a lone UTF-16 surrogate escape, which is not text", param=where,
                           code="invalid_json")
    return body


def _health(handler, match, raw) -> None:
    """Readiness: 200 while new requests are welcome; 503 while the weights load or the warm-up runs, once the
    engine has died (its error), or while the server drains (a load balancer stops sending here at once)."""
    server = handler.server
    _check_alive(server.llm)
    status = server.phase if server.phase != "ready" else "draining" if server.draining or server.llm.draining \
        else "ok"
    if status != "ok":
        handler.close_connection = status == "draining"
        handler.send_json(503, {"status": status}, {"Retry-After": str(RETRY_AFTER_SECONDS)})
        return
    handler.send_json(200, {"status": "ok"})


def _live(handler, match, raw) -> None:
    """Liveness: 200 while this process can still serve anything, draining included; 503 once the engine has
    died, which only a restart mends."""
    _check_alive(handler.server.llm)
    handler.send_json(200, {"status": "alive"})


def generation_defaults_card(llm) -> dict:
    """What a request that leaves a sampling field out gets, and from where: the model card's
    `generation_defaults` (the chat page starts from them)."""
    given = getattr(llm, "generation_defaults", None) or {}
    return {name: {"value": given.get(name, SAMPLING_FIELDS[name].default),
                   "from": "generation_config.json" if name in given else "pocketllm"}
            for name in GENERATION_DEFAULT_FIELDS}


def _model_card(server) -> dict:
    return {"id": server.llm.model_name, "object": "model", "created": server.started, "owned_by": "pocketllm",
            "root": str(server.llm.ckpt_dir), "max_model_len": server.llm.options.max_context,
            "generation_defaults": generation_defaults_card(server.llm)}


def _models(handler, match, raw) -> None:
    handler.send_json(200, {"object": "list", "data": [_model_card(handler.server)]})


def _model(handler, match, raw) -> None:
    _check_model(handler.server.llm, {"model": urllib.parse.unquote(match["model"])})
    handler.send_json(200, _model_card(handler.server))


def _chat(handler, match, raw) -> None:
    handler.send_completion(start_chat_completion(handler.server.llm, _json_body(raw), handler.server.metrics))


def _completions(handler, match, raw) -> None:
    handler.send_completion(start_completion(handler.server.llm, _json_body(raw), handler.server.metrics))


def _omitted_tools_header(handler, body: dict, turn: ProtocolTurn) -> dict:
    """The header naming the hosted tools a request's turn left out ({} when none); the server logs them once
    per distinct tool set a client sends (an agent sends the same set with every request)."""
    if not turn.omitted_tools:
        return {}
    server = handler.server
    key = (handler.endpoint, json.dumps([[tool.get("type"), tool.get("name")] for tool in body["tools"]
                                        if isinstance(tool, dict)]))
    with server.count_lock:
        first = key not in server.tool_sets_logged and len(server.tool_sets_logged) < 1000
        if first:
            server.tool_sets_logged.add(key)
    if first and server.log_requests:
        sys.stderr.write(f"pocketllm: {handler.endpoint}: left out the hosted tools {', '.join(turn.omitted_tools)} "
                         "(none runs here: the model sees only the client's own tools; --hosted-tools refuse makes "
                         "them 400)\n")
    return {OMITTED_TOOLS_HEADER: ", ".join(turn.omitted_tools)}


def _responses(handler, match, raw) -> None:
    server, body = handler.server, _json_body(raw)
    turn = start_response(server.llm, body, server.responses, server.metrics, server.hosted_tools)
    handler.send_completion(turn, named_events=True, headers=_omitted_tools_header(handler, body, turn))


def _stored_id(handler, match) -> str:
    """The {id} of /v1/responses/{id}, if that response is stored; else 404."""
    response_id = urllib.parse.unquote(match["id"])
    if handler.server.responses.get(response_id) is None:
        raise RequestError(f"no stored response has id {response_id!r}", status=404, code="not_found")
    return response_id


def _response_get(handler, match, raw) -> None:
    handler.send_json(200, handler.server.responses.get(_stored_id(handler, match))[0])


def _response_delete(handler, match, raw) -> None:
    response_id = _stored_id(handler, match)
    handler.server.responses.delete(response_id)
    handler.send_json(200, {"id": response_id, "object": "response.deleted", "deleted": True})


def _messages(handler, match, raw) -> None:
    server, body = handler.server, _json_body(raw)
    turn = start_message(server.llm, body, server.metrics, server.hosted_tools)
    handler.send_completion(turn, named_events=True, headers=_omitted_tools_header(handler, body, turn))


def _count_tokens(handler, match, raw) -> None:
    handler.send_json(200, count_message_tokens(handler.server.llm, _json_body(raw), handler.server.hosted_tools))


def _tokenize(handler, match, raw) -> None:
    """vLLM's /tokenize: a prompt, or chat messages rendered by the template -> token ids."""
    llm = handler.server.llm
    values = read_fields(_json_body(raw), TOKENIZE_FIELDS, llm.config.vocab_size)
    _check_model(llm, values)
    if values["prompt"] is not None:
        ids = llm.tokenizer.encode_text(values["prompt"])
    else:
        ids = llm.tokenizer.encode(render_chat_prompt(llm, values, values["tools"]))
    strs = [llm.tokenizer.id_to_token(t) for t in ids] if values["return_token_strs"] else None
    handler.send_json(200, {"count": len(ids), "max_model_len": llm.options.max_context, "tokens": ids,
                            "token_strs": strs, "split_special_tokens": True})   # request text never makes control tokens


def _detokenize(handler, match, raw) -> None:
    """vLLM's /detokenize: token ids -> text."""
    llm = handler.server.llm
    values = read_fields(_json_body(raw), DETOKENIZE_FIELDS, llm.config.vocab_size)
    _check_model(llm, values)
    handler.send_json(200, {"prompt": llm.tokenizer.decode(values["tokens"])})


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
    family("spec_draft_tokens_total", "counter", "Tokens drafted by the MTP layer and verified (speculative "
           "decoding).", [f" {stats['draft_tokens_total']}"])
    family("spec_accepted_tokens_total", "counter", "Drafted tokens accepted by the target model.",
           [f" {stats['accepted_tokens_total']}"])
    family("spec_acceptance_ratio", "gauge", "Accepted / drafted tokens since start (0 without drafts).",
           [f" {stats['accepted_tokens_total'] / max(1, stats['draft_tokens_total'])}"])
    per_forward = stats["generation_tokens_total"] / max(1, stats["target_forwards_total"])
    family("tokens_per_target_forward", "gauge", "Tokens emitted per sequence per target-model step since start "
           "(1 without speculation).", [f" {per_forward}"])
    for name, kind, help in (
            ("prefix_cache_queried_tokens_total", "counter", "Prompt tokens looked up in the prefix cache."),
            ("prefix_cache_hit_tokens_total", "counter", "Prompt tokens resumed from the prefix cache, not prefilled."),
            ("prefix_cache_snapshots", "gauge", "Recurrent-state snapshots the prefix cache holds."),
            ("prefix_cache_snapshot_bytes", "gauge", "Memory those snapshots use (this rank)."),
            ("prefix_cache_evictions_total", "counter", "Cached KV blocks and snapshots reused for new contents."),
            ("kv_blocks_cached", "gauge", "KV blocks held only by the prefix cache (free for reuse when needed).")):
        family(name, kind, help, [f" {stats[name]}"])
    for name, histogram, help in (
            ("time_to_first_token_seconds", metrics.time_to_first_token, "Time from submission to the first token."),
            ("inter_token_latency_seconds", metrics.inter_token_latency, "Time between tokens of one choice.")):
        family(name, "histogram", help, [s[len(name):] for s in histogram.lines(name)])
    return "\n".join(lines) + "\n"


def _metrics(handler, match, raw) -> None:
    data = metrics_text(handler.server.llm, handler.server.metrics).encode()
    handler.send_bytes(200, data, "text/plain; version=0.0.4; charset=utf-8")


# The chat page at `/`: one self-contained document that streams chats through the endpoints above. The policy
# header lets the page reach its own server only (no CDN, font or image from elsewhere).
CHAT_PAGE_POLICY = "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"
CHAT_PAGE = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>pocketllm</title>
<link rel="icon" href="data:,">
<style>
:root { --fg: #1f2430; --muted: #6b7280; --line: #e2e5ea; --bg: #f6f7f9; --accent: #2563eb; --error: #b42318; }
* { box-sizing: border-box; }
body { margin: 0; height: 100vh; display: grid; grid-template: auto 1fr / 1fr 330px; color: var(--fg);
       background: var(--bg); font: 14px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; }
header { grid-column: 1 / -1; display: flex; gap: 14px; align-items: baseline; padding: 10px 20px;
         background: #fff; border-bottom: 1px solid var(--line); }
header b { font-size: 16px; }
.figures { font: 12px ui-monospace, monospace; color: var(--muted); }
#figures { margin-left: auto; }
main { display: flex; flex-direction: column; min-height: 0; }
#log { flex: 1; overflow-y: auto; padding: 20px 24px; }
.turn { max-width: 780px; margin: 0 auto 14px; }
.user { display: flex; justify-content: flex-end; }
.user .text { background: #e6eefc; border-radius: 14px; padding: 8px 14px; max-width: 80%; }
.text { white-space: pre-wrap; overflow-wrap: anywhere; }
.reasoning { color: var(--muted); border-left: 3px solid var(--line); padding-left: 10px; margin-bottom: 6px; }
.reasoning summary { cursor: pointer; font-size: 12px; }
.call { background: #fff; border: 1px solid var(--line); border-radius: 10px; padding: 8px 12px; margin: 6px 0; }
.call .name { font: 600 13px ui-monospace, monospace; }
.call .name::before { content: "tool call  "; font-weight: 400; color: var(--muted); }
.call pre { margin: 4px 0 8px; white-space: pre-wrap; font-size: 12px; }
.call textarea { height: 64px; }
.error { color: var(--error); background: #fef3f2; border: 1px solid #fecdca; border-radius: 8px; padding: 6px 10px;
         margin: 6px 0; white-space: pre-wrap; }
.note { color: var(--muted); font-size: 12px; }
#composer { display: flex; gap: 8px; padding: 12px 24px; background: #fff; border-top: 1px solid var(--line); }
#input { flex: 1; height: 54px; resize: vertical; font: inherit; }
textarea, input { width: 100%; padding: 5px 8px; border: 1px solid var(--line); border-radius: 6px;
                  font: 12px ui-monospace, monospace; }
button { padding: 6px 14px; border: 1px solid var(--line); border-radius: 6px; background: #fff; cursor: pointer;
         font: inherit; }
#send { background: var(--accent); border-color: var(--accent); color: #fff; }
#stop { background: var(--error); border-color: var(--error); color: #fff; }
aside { overflow-y: auto; padding: 12px 16px; background: #fff; border-left: 1px solid var(--line); }
aside label { display: block; margin: 10px 0 0; font-size: 12px; color: var(--muted); }
aside label.check { display: flex; gap: 6px; align-items: center; }
aside label.check input { width: auto; }
@media (max-width: 800px) {             /* phones: the settings go under the chat */
  body { grid-template: auto 1fr auto / 1fr; }
  aside { max-height: 35vh; border-left: 0; border-top: 1px solid var(--line); }
}
</style>
</head>
<body>
<header><b>pocketllm</b><span id="model" class="figures"></span>
  <span id="figures" class="figures"></span><span id="server" class="figures"></span></header>
<main>
  <div id="log"></div>
  <form id="composer">
    <textarea id="input" placeholder="Message (Enter sends, Shift+Enter adds a line).
Try: What is the weather in Paris for the next 3 days?"></textarea>
    <button id="send">Send</button><button id="stop" type="button" hidden>Stop</button>
  </form>
</main>
<aside>
  <button id="new" type="button">New chat</button> <button id="export" type="button">Export messages</button>
  <label>System prompt <textarea id="system" rows="3"></textarea></label>
  <label>Temperature <input id="temperature" type="number" min="0" max="2" step="0.1"
    placeholder="the server's default"></label>
  <div id="defaults" class="note"></div>
  <label>Max tokens <input id="max-tokens" type="number" min="1" placeholder="the rest of the context"></label>
  <label class="check"><input id="thinking" type="checkbox" checked> Thinking (enable_thinking)</label>
  <label>API key <input id="key" type="password" autocomplete="off" placeholder="when the server has --api-key"></label>
  <label class="check"><input id="use-tools" type="checkbox" checked> Send these tools</label>
  <textarea id="tools" rows="13" spellcheck="false"></textarea>
  <label>More request fields (JSON) <textarea id="extra" rows="2" spellcheck="false"
    placeholder='{"top_p": 0.9, "seed": 1}'></textarea></label>
</aside>
<script>
"use strict";
const $ = id => document.getElementById(id);
const TOOLS = [{type: "function", function: {name: "get_weather", description: "Weather forecast for a city",
  parameters: {type: "object", properties: {city: {type: "string"}, days: {type: "integer"}},
               required: ["city", "days"]}}}];
let history = [];          // the conversation as the OpenAI messages list, without the system prompt
let controller = null;     // aborts the answer being streamed
let model = null;          // the served model's id, from /v1/models
$("tools").value = JSON.stringify(TOOLS, null, 2);

// Talking to the server: every call sends the key; a non-2xx answer becomes the server's own error text.
function headers() {
  const key = $("key").value.trim();
  return key ? {"Content-Type": "application/json", "Authorization": "Bearer " + key}
             : {"Content-Type": "application/json"};
}
function errorText(status, text) {
  try {
    const e = JSON.parse(text).error;
    return `${status ? status + " " : ""}${e.type || "error"}: ${e.message}${e.param ? ` (param: ${e.param})` : ""}`;
  } catch (_) { return `${status} ${text}`; }
}
async function api(path, options = {}) {
  const res = await fetch(path, {...options, headers: headers()});
  if (!res.ok) throw new Error(errorText(res.status, await res.text()));
  return res;
}

// The figures: the server's state from /metrics, polled fast while an answer streams.
let polled = 0;
async function refreshServer() {
  polled = performance.now();
  try {
    const text = await (await api("/metrics")).text();
    const value = name => (text.match(new RegExp(`^pocketllm_${name} (\\S+)$`, "m")) || [])[1];
    $("server").textContent = `running ${value("requests_running")} · waiting ${value("requests_waiting")}` +
      ` · KV blocks ${value("kv_blocks_used")}/${value("kv_blocks_total")}`;
  } catch (e) { $("server").textContent = "server: " + e.message; }
}
async function refreshModel() {
  try {
    const card = (await (await api("/v1/models")).json()).data[0];
    model = card.id;
    $("model").textContent = model;
    showDefaults(card.generation_defaults || {});
  } catch (e) { $("model").textContent = e.message; }
}
// The server's sampling defaults (the checkpoint's generation_config.json, else pocketllm's own): the
// temperature field starts at the server's, and each default is listed with where it comes from.
function showDefaults(defaults) {
  const t = defaults.temperature;
  if (t && $("temperature").value === "" && !$("temperature").dataset.edited) $("temperature").value = String(t.value);
  $("defaults").textContent = "Server defaults: " +
    Object.entries(defaults).map(([name, d]) => `${name} ${d.value} (${d.from})`).join(", ");
}
$("temperature").addEventListener("input", () => { $("temperature").dataset.edited = "1"; });
setInterval(() => { if (controller || performance.now() - polled > 5000) refreshServer(); }, 1000);

// The conversation view: one element per turn; model text only ever goes in as textContent.
function element(tag, className, parent, text) {
  const el = document.createElement(tag);
  if (className) el.className = className;
  if (text !== undefined) el.textContent = text;
  if (parent) parent.appendChild(el);
  return el;
}
function turn(role) {
  const el = element("div", "turn " + role, $("log"));
  $("log").scrollTop = $("log").scrollHeight;
  return el;
}
function showError(parent, message) { element("div", "error", parent, message); }
function sampleResult(name, args) {
  try { args = JSON.parse(args); } catch (_) { args = {}; }
  return JSON.stringify(name === "get_weather" ? {city: args.city, days: args.days, forecast: "sunny", high_c: 21}
                                               : {...args, result: "ok"});
}

// One assistant answer, streamed: SSE events read from fetch's body, each delta shown as it comes.
function requestBody() {
  const body = {messages: messagesToSend(), stream: true, stream_options: {include_usage: true},
                chat_template_kwargs: {enable_thinking: $("thinking").checked}};
  if (model) body.model = model;
  if ($("temperature").value !== "") body.temperature = Number($("temperature").value);
  if ($("max-tokens").value !== "") body.max_tokens = Number($("max-tokens").value);
  if ($("use-tools").checked) body.tools = parseJSON("tools", $("tools").value);
  return Object.assign(body, parseJSON("more request fields", $("extra").value || "{}"));
}
function parseJSON(what, text) {
  try { return JSON.parse(text); } catch (e) { throw new Error(`${what}: not valid JSON (${e.message})`); }
}
function messagesToSend() {
  const system = $("system").value.trim();
  return system ? [{role: "system", content: system}, ...history] : history;
}
async function* serverEvents(res) {
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const data = buffer.slice(0, end).split("\n").filter(l => l.startsWith("data:")).map(l => l.slice(5).trim());
      buffer = buffer.slice(end + 2);
      if (data.length) yield data.join("\n");
    }
  }
}
function assistantView() {
  const el = turn("assistant");
  let reasoning = null, content = null;
  return {el, calls: [],
    reasoning(text) {
      if (!reasoning) {
        const details = element("details", "reasoning", el);
        element("summary", "", details, "Reasoning");
        reasoning = element("div", "text", details);
      }
      reasoning.textContent += text;
    },
    content(text) { (content = content || element("div", "text", el)).textContent += text; },
    call(delta) {       // a tool call's pieces: its id and name once, its arguments in fragments
      const call = this.calls[delta.index] = this.calls[delta.index] || toolCard(el);
      const f = delta.function || {};
      call.id = delta.id || call.id;
      call.nameEl.textContent = call.name += f.name || "";
      call.argsEl.textContent = call.arguments += f.arguments || "";
    }};
}
function toolCard(parent) {
  const card = element("div", "call", parent);
  return {card, id: "", name: "", arguments: "",
          nameEl: element("div", "name", card), argsEl: element("pre", "", card)};
}
async function stream(view, got, signal) {   // fills `got` as it goes: a stopped answer keeps what came
  const res = await api("/v1/chat/completions", {method: "POST", body: JSON.stringify(requestBody()), signal});
  for await (const data of serverEvents(res)) {
    if (data === "[DONE]") { got.finished = true; return; }
    const chunk = JSON.parse(data);
    if (chunk.error) throw new Error(errorText(0, data));
    got.usage = chunk.usage || got.usage;
    const choice = (chunk.choices || []).find(c => c.index === 0) || {}, delta = choice.delta || {};
    got.finish = choice.finish_reason || got.finish;
    if (delta.reasoning_content || delta.content || delta.tool_calls) {
      got.first = got.first || performance.now();
      got.chunks++;
    }
    if (delta.reasoning_content) view.reasoning(delta.reasoning_content);
    if (delta.content) { view.content(delta.content); got.content += delta.content; }
    (delta.tool_calls || []).forEach(d => view.call(d));
    $("log").scrollTop = $("log").scrollHeight;
  }
  throw new Error("the connection closed before the answer finished");
}
function showFigures(got, start) {
  const tokens = got.usage ? got.usage.completion_tokens : got.chunks;
  const seconds = (performance.now() - got.first) / 1000;
  $("figures").textContent = `first token ${Math.round(got.first - start)} ms · ` +
    `${tokens > 1 ? ((tokens - 1) / seconds).toFixed(1) : "–"} tokens/s · ${tokens} tokens`;
}
async function answer() {
  const view = assistantView(), conversation = history, start = performance.now(), mine = new AbortController();
  const got = {content: "", usage: null, first: 0, chunks: 0, finish: null, finished: false};
  controller = mine;
  busy(true);
  try {
    await stream(view, got, mine.signal);
    if (got.finish === "length") element("div", "note", view.el, "cut at the max tokens (finish_reason length)");
  } catch (e) {
    if (e.name === "AbortError") element("div", "note", view.el, "stopped");
    else showError(view.el, e instanceof TypeError ? `the connection to the server failed (${e.message})` : e.message);
  }
  if (controller === mine) { controller = null; busy(false); }      // not when New chat has started another
  refreshServer();
  if (!model) refreshModel();
  if (got.first) showFigures(got, start);
  const calls = got.finished ? view.calls : [];      // a call cut off by stop is not replayed
  if (!got.content && !calls.length) return;
  const message = {role: "assistant", content: got.content};
  if (calls.length) message.tool_calls = calls.map(c => ({id: c.id, type: "function",
                                                          function: {name: c.name, arguments: c.arguments}}));
  conversation.push(message);
  calls.forEach(call => askResult(call, message.tool_calls));
}
function askResult(call, calls) {     // the user plays the tool: a result box, pre-filled, per call
  const box = element("textarea", "result", call.card);
  box.value = sampleResult(call.name, call.arguments);
  const send = element("button", "", call.card, "Send result");
  send.type = "button";
  send.onclick = () => {
    if (controller) return;
    history.push({role: "tool", tool_call_id: call.id, content: box.value});
    box.readOnly = send.disabled = true;
    const answered = new Set(history.filter(m => m.role === "tool").map(m => m.tool_call_id));
    if (calls.every(c => answered.has(c.id))) answer();
  };
}

// The controls.
function busy(on) { $("send").hidden = on; $("stop").hidden = !on; }
$("composer").onsubmit = event => {
  event.preventDefault();
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  element("div", "text", turn("user"), text);
  history.push({role: "user", content: text});
  answer();
};
$("input").onkeydown = event => {
  if (event.key === "Enter" && !event.shiftKey) { event.preventDefault(); $("composer").requestSubmit(); }
};
$("stop").onclick = () => controller && controller.abort();
$("new").onclick = () => {
  if (controller) controller.abort();
  controller = null;
  busy(false);
  history = [];
  $("log").textContent = "";
  $("figures").textContent = "";
};
$("export").onclick = () => {
  const link = document.createElement("a");
  link.href = URL.createObjectURL(new Blob([JSON.stringify(messagesToSend(), null, 2)], {type: "application/json"}));
  link.download = "messages.json";
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 1000);
};
$("key").onchange = () => { refreshModel(); refreshServer(); };
refreshModel();
refreshServer();
</script>
</body>
</html>
"""


def _chat_page(handler, match, raw) -> None:
    handler.send_bytes(200, CHAT_PAGE.encode(), "text/html; charset=utf-8",
                       {"Content-Security-Policy": CHAT_PAGE_POLICY, "Cache-Control": "no-cache"})


def _chat_page_url(host: str, port: int) -> str:
    """The address to open in a browser: a wildcard host becomes the loopback one, IPv6 in brackets."""
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"

# /openapi.json: every route, and every request field from the endpoints' tables (section 12).

PUBLIC_PATHS = ("/", "/health", "/live")   # no API key: the chat page loads without it (then sends it), and probes
PROBE_PATHS = ("/health", "/live")               # answered from the moment the port opens, before the weights load
DRAIN_EXEMPT = PROBE_PATHS + ("/metrics",)        # still answered while draining; every other path is 503
REQUEST_TABLES = {"/v1/chat/completions": CHAT_FIELDS, "/v1/completions": COMPLETION_FIELDS,
                  "/v1/responses": RESPONSES_FIELDS, "/v1/messages": MESSAGES_FIELDS,
                  "/v1/messages/count_tokens": MESSAGES_COUNT_FIELDS,
                  "/tokenize": TOKENIZE_FIELDS, "/detokenize": DETOKENIZE_FIELDS}
ROUTE_SUMMARIES = {"/": "the chat page: one self-contained HTML document (no auth)",
                   "/health": "readiness: 200 while the server takes requests; 503 while it loads, warms up or "
                              "drains, or naming the cause once the engine has died (no auth)",
                   "/live": "liveness: 200 while the process can serve, loading and draining included; 503 once "
                            "the engine has died (no auth)",
                   "/v1/models": "the served model's card, as a list", "/v1/models/{model}": "the model card",
                   "/v1/chat/completions": "an OpenAI chat completion, or its SSE chunks with stream: true",
                   "/v1/completions": "an OpenAI text completion, or its SSE chunks with stream: true",
                   "/v1/responses": "an OpenAI Response, or its SSE events with stream: true",
                   "/v1/responses/{id}": "a stored Response (GET), or remove it (DELETE)",
                   "/v1/messages": "an Anthropic Message, or its SSE events with stream: true; Anthropic's error "
                                   "shape; 'x-api-key' authenticates too",
                   "/v1/messages/count_tokens": "the input tokens a /v1/messages body renders to",
                   "/tokenize": "vLLM's /tokenize: a prompt or chat messages -> token ids",
                   "/detokenize": "vLLM's /detokenize: token ids -> text",
                   "/metrics": "Prometheus text: engine and server counters, latency histograms",
                   "/openapi.json": "this document"}
ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def openapi_document(llm) -> dict:
    """An OpenAPI 3.1 description of the server: every route in ROUTES, each request body from its table."""
    paths = {}
    for method, path, _ in ROUTES:
        operation = {"summary": ROUTE_SUMMARIES.get(path, path), "responses": {
            "200": {"description": "success"},
            "default": {"description": "an error", "content": {"application/json": {"schema": ERROR_SCHEMA}}}}}
        if path not in PUBLIC_PATHS:
            operation["security"] = [{"bearer": []}]
        if names := re.findall(r"\{(\w+)\}", path):
            operation["parameters"] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                                       for name in names]
        if path in REQUEST_TABLES:
            schema = request_schema(REQUEST_TABLES[path], llm.config.vocab_size)
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
        paths.setdefault(path, {})[method.lower()] = operation
    return {"openapi": "3.1.0",
            "info": {"title": f"pocketllm serving {llm.model_name}", "version": __version__,
                     "description": "An absent field and a null one mean the same: the default. Fields outside "
                                    "a body's properties are 400 (code: unknown_field)."},
            "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
            "paths": paths}


def _openapi(handler, match, raw) -> None:
    handler.send_json(200, openapi_document(handler.server.llm))


# The route table: (method, path pattern, endpoint). The pattern doubles as the metrics label.
ROUTES = [
    ("GET", "/", _chat_page),
    ("GET", "/health", _health),
    ("GET", "/live", _live),
    ("GET", "/v1/models", _models),
    ("GET", "/v1/models/{model}", _model),
    ("POST", "/v1/chat/completions", _chat),
    ("POST", "/v1/completions", _completions),
    ("POST", "/v1/responses", _responses),
    ("GET", "/v1/responses/{id}", _response_get),
    ("DELETE", "/v1/responses/{id}", _response_delete),
    ("POST", "/v1/messages", _messages),
    ("POST", "/v1/messages/count_tokens", _count_tokens),
    ("POST", "/tokenize", _tokenize),
    ("POST", "/detokenize", _detokenize),
    ("GET", "/metrics", _metrics),
    ("GET", "/openapi.json", _openapi),
]
ROUTE_PATTERNS = [(method, re.compile(re.sub(r"\{(\w+)\}", r"(?P<\1>.+)", path) + "$"), path, endpoint)
                  for method, path, endpoint in ROUTES]


def find_route(method: str, path: str):
    """(label, match, endpoint) for the request; 404 for an unknown path, 405 for a known path's wrong method.
    HEAD is answered wherever GET is, without the body."""
    allowed = []
    for route_method, pattern, label, endpoint in ROUTE_PATTERNS:
        match = pattern.match(path)
        if match and (route_method == method or (method == "HEAD" and route_method == "GET")):
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
        self.write_lock, self.last_write = threading.Lock(), 0.0     # a stream's events and its keep-alives
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
        self.endpoint, self.answered, self.client_left = "other", False, False
        try:
            path = urllib.parse.urlsplit(self.path).path
            raw = self.read_body()
            self.server.deadlines.disarm(self)          # read in time; generating may take as long as it takes
            if path not in PUBLIC_PATHS:
                self.check_auth()
            self.endpoint, match, endpoint = find_route(method, path)
            if self.server.phase != "ready" and path not in PROBE_PATHS:
                raise RequestError(f"the server is starting ({self.server.phase}); retry shortly", status=503,
                                   code="loading")
            if path in DRAIN_EXEMPT:
                endpoint(self, match, raw)
            else:
                with self.server.admission():   # counted in flight until its answer, an error's too, is written:
                    try:                        # a stopping server waits for that before it exits
                        endpoint(self, match, raw)
                    except Exception as e:
                        self.answer_failure(e)
        except Exception as e:
            self.answer_failure(e)
        if self.server.draining:                # the client's next request goes to a replica that stays
            self.close_connection = True

    def answer_failure(self, e: Exception) -> None:
        """The error answer in the protocol's shape, or a 499 in the log when the client has gone."""
        if _client_gone(e) or self.client_left:
            self.close_connection = True
            self.count_client_closed()
            return
        self.send_error_response(e)

    def count_client_closed(self) -> None:
        """A client that hung up before its answer: 499 in the log and the metrics, not a server error."""
        if not self.answered:
            self.answered = True
            self.server.metrics.count(self.endpoint, CLIENT_CLOSED)
            self.log_request(CLIENT_CLOSED)

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
        """The key from 'Authorization: Bearer KEY' or, as Anthropic's clients send it, 'x-api-key: KEY'."""
        key = self.server.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "") or ("Bearer " + self.headers["x-api-key"]
                                                          if "x-api-key" in self.headers else "")
        if not given:
            raise RequestError("missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                               status=401, code="invalid_api_key")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise RequestError("invalid API key", status=401, code="invalid_api_key")

    # Answers: JSON, errors, and server-sent events.

    def send_bytes(self, status: int, data: bytes, content_type: str, headers: dict | None = None) -> None:
        self.answered = True
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
        path, headers, code = urllib.parse.urlsplit(self.path).path, {}, body["error"]["code"]
        if path.startswith("/v1/messages"):
            body = anthropic_error(status, body["error"])
        if status == 405:
            allowed = [m for m, pattern, _, _ in ROUTE_PATTERNS if pattern.match(path)]
            headers["Allow"] = ", ".join(allowed)
        if status == 503 and code in ("draining", "loading"):     # a gateway retries it on another replica
            headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
            self.close_connection = True
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

    def send_completion(self, completion: Completion | ProtocolTurn, named_events: bool = False,
                        headers: dict | None = None) -> None:
        headers = {**prefix_hash_header(self.server.llm, completion), **(headers or {})}

        def client_left() -> None:
            self.client_left = True
            completion.abort()
        with ClientWatch(self, client_left) as watch:
            if completion.stream_mode:
                self.send_stream(completion.chunks(), watch, named_events, headers)
                return
            response = completion.response()
        self.send_json(200, response, headers)

    def send_stream(self, chunks: Iterator[dict], watch: ClientWatch, named_events: bool = False,
                    headers: dict | None = None) -> None:
        """SSE over chunked transfer encoding, so the connection stays alive for the next request. Named events
        (the Responses and Messages protocols) carry an `event:` line, their type, and end without [DONE]. From
        the headers on, watch keeps the stream alive while it waits: Anthropic's ping on /v1/messages, an SSE
        comment on the OpenAI streams."""
        self.answered = True
        self.server.metrics.count(self.endpoint, 200)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.last_write = time.monotonic()
        payload = SSE_PING if self.endpoint.startswith("/v1/messages") else SSE_COMMENT
        try:
            with watch.keeping_alive(payload, self.server.keepalive_seconds):
                while True:
                    try:
                        chunk = next(chunks)
                    except StopIteration:
                        break
                    except Exception as e:            # after the headers an error can only travel as an event
                        self.send_event({"type": "error", **translate_error(e)[1]} if named_events
                                        else translate_error(e)[1], named_events)
                        break
                    self.send_event(chunk, named_events)
            if not named_events:
                self.send_event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
        except Exception as e:
            if not _client_gone(e):
                raise
            self.close_connection = True
        finally:
            chunks.close()                        # aborts the request if the client left

    def send_event(self, data: dict | str, named: bool = False) -> None:
        if self.client_left:                      # the ClientWatch saw it leave: no one reads this
            raise ConnectionResetError("the client closed the connection")
        text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
        payload = (b"event: " + data["type"].encode() + b"\n" if named else b"") + b"data: " + text.encode() + b"\n\n"
        with self.write_lock:
            self.write_sse(payload)

    def write_sse(self, payload: bytes) -> None:
        """One chunk of the stream (the caller holds write_lock)."""
        # A reader that stops reading fills the socket buffer and blocks this write: after the socket timeout
        # the connection is cut, the stream's request aborted, and what the engine buffered for it released.
        self.server.deadlines.arm(self)
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
            self.last_write = time.monotonic()
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
                 send_buffer_bytes: int = DEFAULT_SEND_BUFFER, drain_timeout: float = DEFAULT_DRAIN_TIMEOUT,
                 keepalive_seconds: float = DEFAULT_KEEPALIVE, hosted_tools: str = "omit"):
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
        self.responses = ResponseStore()           # /v1/responses stored with store: true
        self.drain_timeout, self.draining, self.in_flight = drain_timeout, False, 0
        self.phase = "ready" if llm is not None else "loading"   # then "warming up" (run_server), then "ready"
        self.idle = threading.Condition(self.count_lock)   # notified when in_flight drops to 0
        self.keepalive_seconds, self.hosted_tools = keepalive_seconds, hosted_tools
        self.tool_sets_logged: set[tuple] = set()  # the client tool sets whose omitted hosted tools were logged

    # Draining (SIGTERM, or drain()): /health says 503 at once, new requests are 503 with Retry-After, the ones
    # admitted before finish (streams included), and then the server stops.

    @contextlib.contextmanager
    def admission(self):
        """Count a request in flight while it is answered; 503 (code draining) once the server drains."""
        with self.count_lock:
            if self.draining:
                raise RequestError("the server is shutting down and takes no new requests; retry (another "
                                   "replica)", status=503, code="draining")
            self.in_flight += 1
        try:
            yield
        finally:
            with self.count_lock:
                self.in_flight -= 1
                if not self.in_flight:
                    self.idle.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Stop admitting requests and wait up to timeout seconds (default: drain_timeout) for those in flight;
        True if they all finished. The server keeps answering (503) until shutdown()."""
        deadline = time.monotonic() + (self.drain_timeout if timeout is None else timeout)
        with self.count_lock:
            self.draining = True
            while self.in_flight and (left := deadline - time.monotonic()) > 0:
                self.idle.wait(left)
            return not self.in_flight

    def _drain_and_stop(self) -> None:
        if self.log_requests:
            sys.stderr.write(f"pocketllm: draining: {self.in_flight} request(s) in flight, up to "
                             f"{self.drain_timeout:g} s\n")
        done = self.drain()
        if self.log_requests:
            sys.stderr.write("pocketllm: drained, stopping\n" if done else
                             f"pocketllm: --drain-timeout passed with {self.in_flight} request(s) in flight; "
                             "stopping\n")
        super().shutdown()                        # ends serve_forever on the main thread

    def _on_sigterm(self, signum, frame) -> None:
        """The first SIGTERM drains on a thread of its own (a signal handler must not block); a second one, like
        Ctrl-C, stops at once."""
        if self.draining:
            raise KeyboardInterrupt
        self.draining = True
        threading.Thread(target=self._drain_and_stop, name="pocketllm-drain", daemon=True).start()

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
        self.serving_thread = threading.Thread(target=self.serve_forever, name="pocketllm-http", daemon=True)
        self.serving_thread.start()
        return self

    def run(self, announce: Callable[[], None] | None = None) -> None:
        """Serve on this thread (or wait for the serving thread start() began) until Ctrl-C, or until SIGTERM has
        drained the requests in flight. announce: prints the address once SIGTERM is handled, so a supervisor
        that signals as soon as it reads the address gets a drain and exit 0, never the default kill."""
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, self._on_sigterm) if in_main else None
        try:
            if announce:
                announce()                        # a SIGTERM from here on: serve_forever below returns at once
            if self.serving:
                while self.serving_thread.is_alive():
                    self.serving_thread.join(0.5)
            else:
                self.serving = True
                self.serve_forever()
        except KeyboardInterrupt:
            super().shutdown()                    # the serving thread's loop; at once when it is this thread's
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
    """Serve llm over HTTP: blocking until interrupted, or (block=False) on a background thread. One warm-up
    request runs first, so /health never says 200 for an engine that cannot serve."""
    _log(llm.options, llm.warm_up())
    server = PocketServer(llm, host, port, api_key, **options)
    if block:
        server.run()
        return server
    return server.start()


VLLM_TOOL_PARSERS = {"qwen3_xml": "qwen_xml", "qwen3_coder": "qwen_xml"}   # vLLM's names for our formats


def _tool_parser_name(name: str) -> str:
    name = VLLM_TOOL_PARSERS.get(name, name)
    if name not in TOOL_FORMATS:
        raise argparse.ArgumentTypeError(f"{name!r} is not a tool-call format ({', '.join(TOOL_FORMATS)}; vLLM's "
                                         f"qwen3_xml and qwen3_coder are qwen_xml)")
    return name


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("HTTP server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    group.add_argument("--port", type=int, default=8000,
                       help="port; 0 picks a free port and prints it (default: %(default)s)")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every endpoint but /health and the page / "
                            "(default: env POCKETLLM_API_KEY)")
    group.add_argument("--served-model-name", default=None,
                       help="the model id clients send (default: the checkpoint directory name)")
    group.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a jinja chat template (.jinja, or .json with \"chat_template\") to use instead of the "
                            "checkpoint's (default: the checkpoint's)")
    group.add_argument("--tool-parser", "--tool-call-parser", type=_tool_parser_name, default=None,
                       metavar="{" + ",".join(TOOL_FORMATS) + "}",
                       help="tool-call format; vLLM's qwen3_xml and qwen3_coder mean qwen_xml (default: detected "
                            "from the chat template)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="accepted for vLLM's command lines: tool_choice auto is always on (default: on)")
    group.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help="largest request body accepted; larger is 413 (default: %(default)s)")
    group.add_argument("--socket-timeout", type=float, default=DEFAULT_SOCKET_TIMEOUT,
                       help="seconds a client may take to send a request, or stall reading a stream, and may "
                            "stay silent on a kept-alive connection (default: %(default)g)")
    group.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                       help="open connections at most; one more is answered 503 (default: %(default)s)")
    group.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT, metavar="SECONDS",
                       help="on SIGTERM: /health says 503, new requests are 503 with Retry-After, and the ones in "
                            "flight get this long to finish before the process exits 0; a second SIGTERM or Ctrl-C "
                            "stops at once (default: %(default)g)")
    group.add_argument("--hosted-tools", choices=HOSTED_TOOL_POLICIES, default="omit",
                       help="tools that run on the provider's side (Responses' web_search, Messages' web_search_*, "
                            "...), which none runs here: omit leaves them out, names them in the "
                            f"{OMITTED_TOOLS_HEADER} header and logs them; refuse makes them 400 "
                            "(default: %(default)s)")


def open_server(args: argparse.Namespace) -> PocketServer:
    """The server for the command line, listening before the weights load: the probes answer at once (/health
    503 {"status": "loading"}), every other path 503 until run_server has warmed the engine up."""
    return PocketServer(None, args.host, args.port, args.api_key or os.environ.get("POCKETLLM_API_KEY") or None,
                        max_request_bytes=args.max_request_bytes, socket_timeout=args.socket_timeout,
                        max_connections=args.max_connections, drain_timeout=args.drain_timeout,
                        hosted_tools=args.hosted_tools).start()


def run_server(llm, args: argparse.Namespace, server: PocketServer | None = None) -> int:
    """Apply the server flags to llm, warm it up, print the address, serve until interrupted; the exit code.
    server: open_server's, listening since before llm loaded."""
    if args.served_model_name:
        llm.model_name = args.served_model_name
    if args.chat_template:           # main() has read it already, before the weights loaded
        llm.chat_template = load_chat_template(llm.tokenizer, args.chat_template) \
            if isinstance(args.chat_template, str) else args.chat_template
    if args.tool_parser:
        _chat_template(llm).tool_parser = args.tool_parser
    server = server or open_server(args)
    server.llm, server.phase = llm, "warming up"
    _log(llm.options, llm.warm_up())
    server.phase = "ready"

    def announce():
        print(f"pocketllm: serving '{llm.model_name}' on http://{args.host}:{server.port}", flush=True)
        print(f"pocketllm: chat page at {_chat_page_url(args.host, server.port)}", flush=True)
    server.run(announce)
    if server.in_flight:         # --drain-timeout passed, or a second SIGTERM: the requests still running end with
        llm.close()              # an error that reaches their clients before this process exits (no cut answers)
        server.drain(timeout=5.0)
    return 0


# -----------------------------------------------------------------------------------------------
# 14. The LLM object, the Python API that the server and embedding users share, and the CLI.
# -----------------------------------------------------------------------------------------------

def bundled_model_dir() -> Path:
    """The bundled pocket-tiny: beside this file (a checkout, or pocketllm.py dropped into a project), else where
    `pip install .` put it (pyproject.toml's data-files: <prefix>/share/pocketllm/models/pocket-tiny)."""
    here = HERE / "models" / "pocket-tiny"
    installed = Path(sysconfig.get_paths()["data"]) / "share" / "pocketllm" / "models" / "pocket-tiny"
    return installed if not here.is_dir() and installed.is_dir() else here


DEFAULT_CKPT = bundled_model_dir()
# Memory. The cache's tensors are measured by allocating them on the meta device (no memory), so sizing and
# allocate_cache cannot disagree; memory_budget estimates every part from config.json alone (docs/serving.md).

GiB = 1 << 30
# The opt-in to a --max-context past config.json's max_position_embeddings (vLLM: VLLM_ALLOW_LONG_MAX_MODEL_LEN=1).
ALLOW_LONG_CONTEXT = "POCKETLLM_ALLOW_LONG_MAX_MODEL_LEN"


def cache_bytes(cfg: ModelConfig, layers: list, num_blocks: int, block_size: int, num_slots: int,
                kv_dtype: torch.dtype) -> int:
    """Bytes of allocate_cache(...) with these sizes, measured without allocating."""
    cache = allocate_cache(cfg, layers, num_blocks, block_size, num_slots, kv_dtype, "meta")
    return sum(t.numel() * t.element_size() for part in (cache.k, cache.v, cache.conv, cache.ssm)
               for t in part.values())


def workspace_bytes(cfg: ModelConfig, prefill_token_budget: int, max_batch_size: int, act_bytes: int = 2) -> int:
    """An upper estimate of one step's temporaries: the widest activations of a prefill_token_budget-token
    chunk (the MLP's gate and up, the mixer's projections, fp32 residual and norms), the logits of every running
    sequence (fp32, a few copies in the sampler), and 256 MiB for the allocator's slack and the kernels'
    split-K workspaces."""
    widest = max(2 * cfg.intermediate_size, 2 * cfg.num_attention_heads * cfg.head_dim + 2 * cfg.linear_conv_dim)
    per_token = (widest + 6 * cfg.hidden_size) * act_bytes + 4 * cfg.hidden_size * 4
    return prefill_token_budget * per_token + max(max_batch_size, 1) * cfg.vocab_size * 4 * 4 + 256 * (1 << 20)


def layer_matrices(cfg: ModelConfig) -> dict[str, list[tuple[int, int]]]:
    """(rows, cols) of the weight matrices of each kind of layer, its MLP's included: the FP8 ones of an FP8
    checkpoint (the GDN a/b projections and the vectors are not matrices here)."""
    D, I, Dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_attention_heads * Dh * (2 if cfg.gated_attention else 1), cfg.num_key_value_heads * Dh
    v_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    mlp = [(I, D), (I, D), (D, I)]
    return {"full_attention": [(q_rows, D), (kv_rows, D), (kv_rows, D), (D, cfg.num_attention_heads * Dh)] + mlp,
            "linear_attention": [(cfg.linear_conv_dim, D), (v_dim, D), (D, v_dim)] + mlp}


def layer_bytes(cfg: ModelConfig, world: int = 1) -> int:
    """One rank's share of the layers' weights from the config: FP8 matrices at 1 byte plus an fp32 scale per
    128x128 block (bf16 ones at 2 bytes), vectors and the small GDN a/b projections at 2 bytes; split `world`
    ways."""
    D, Dh = cfg.hidden_size, cfg.head_dim

    def matrix(rows: int, cols: int) -> int:
        if cfg.quant is None:
            return 2 * rows * cols
        br, bc = cfg.quant.block
        return rows * cols + 4 * -(-rows // br) * -(-cols // bc)
    vectors = {"full_attention": 2 * 2 * Dh,
               "linear_attention": 2 * 2 * cfg.linear_num_value_heads * D
               + 2 * cfg.linear_conv_dim * cfg.linear_conv_kernel_dim
               + 2 * 2 * cfg.linear_num_value_heads + 2 * cfg.linear_value_head_dim}
    matrices = layer_matrices(cfg)
    layers = sum(sum(matrix(*m) for m in matrices[t]) + vectors[t] + 2 * 2 * D      # + the MLP's two norms
                 for t in cfg.layer_types[:cfg.num_hidden_layers])
    return -(-layers // world) + 2 * D                                  # + the final norm


def fp8_dense_copy_bytes(cfg: ModelConfig, opts: EngineOptions, world: int = 1, act_bytes: int = 2,
                         mtp_layers: int = 0) -> int:
    """One rank's share of the dense copy the torch backend makes of an FP8 checkpoint's matrices when it fits
    --fp8-dense-memory (Model.dense), from the config: every layer's matrices, and the MTP layers' (a full-
    attention layer each) when loaded, at act_bytes per value; 0 when it makes none. On the CPU the copy is
    memory of its own (the FP8 weights stay in the mapped file); on a GPU the FP8 ones are freed after it."""
    if cfg.quant is None or opts.backend != "torch":
        return 0
    matrices = layer_matrices(cfg)
    kinds = list(cfg.layer_types[:cfg.num_hidden_layers]) + ["full_attention"] * mtp_layers
    dense = -(-sum(r * c for t in kinds for r, c in matrices[t]) // world) * act_bytes
    return dense if dense <= opts.fp8_dense_memory << 20 else 0


def vocab_bytes(cfg: ModelConfig, world: int = 1) -> int:
    """One rank's slice of the embedding, or of the lm_head (the same size): rank 0's ceil(V / world) rows at
    2 bytes (bf16, fp16 on GPUs), vocab-parallel (section 8b)."""
    return 2 * -(-cfg.vocab_size // world) * cfg.hidden_size


def memory_budget(cfg: ModelConfig, opts: EngineOptions, world: int = 1, *, kv_bytes: int = 2, act_bytes: int = 2,
                  mtp_layers: int = 0) -> dict[str, int]:
    """Bytes per GPU (rank) of each part under the engine options `opts`: the layers' weights, the embedding and
    lm_head slices (each rank loads both, also when tied), the torch backend's dense copy of FP8 weights
    (fp8_dense_copy_bytes; opts.backend names the backend), KV cache (kv_cache_blocks), recurrent state (one slot
    per sequence of --max-batch-size; 0, sized from memory on a GPU, counts as the CPU's 16), the prefix cache's
    state snapshots (snapshot_count), workspace, and their total. Heads and vocabulary split `world` ways (at
    least one head each). mtp_layers: MTP draft layers whose KV shares the blocks (their weights not counted,
    their dense copy is).

    >>> cfg = ModelConfig("qwen3", 1000, 64, 128, 2, 4, 2, 16, 1e-6, False, ["full_attention"] * 2, 1e4, 16,
    ...                   4096, False, False)
    >>> memory_budget(cfg, EngineOptions(max_context=64, max_batch_size=1))["kv_cache"]
    16384
    >>> 2 * 2 * 64 * 2 * 16 * 2                   # 2 layers x K,V x 64 tokens x 2 heads x 16 x 2 bytes
    16384
    """
    opts = dataclasses.replace(opts, max_batch_size=opts.max_batch_size or DEFAULT_MAX_BATCH_SIZE)
    kv_heads = max(1, cfg.num_key_value_heads // world)
    v_heads, conv_dim = max(1, cfg.linear_num_value_heads // world), cfg.linear_conv_dim // world
    tokens = kv_cache_blocks(opts) * opts.kv_block_size
    kv = (cfg.num_full_layers + mtp_layers) * 2 * tokens * kv_heads * cfg.head_dim * kv_bytes
    per_slot = cfg.num_linear_layers * (v_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
                                        + conv_dim * (cfg.linear_conv_kernel_dim - 1) * kv_bytes)
    parts = {"layers": layer_bytes(cfg, world), "embedding": vocab_bytes(cfg, world),
             "lm_head": vocab_bytes(cfg, world),
             "fp8_dense_copy": fp8_dense_copy_bytes(cfg, opts, world, act_bytes, mtp_layers), "kv_cache": kv,
             "recurrent_state": opts.max_batch_size * per_slot,
             "prefix_cache": snapshot_count(opts, per_slot) * per_slot,
             "workspace": workspace_bytes(cfg, opts.prefill_token_budget, opts.max_batch_size, act_bytes)}
    return {**parts, "total": sum(parts.values())}


def format_bytes(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


def format_budget(budget: dict[str, int]) -> str:
    return ", ".join(f"{name.replace('_', ' ')} {format_bytes(n)}" for name, n in budget.items())


def memory_sized(device: torch.device, opts: EngineOptions) -> bool:
    """Whether the cache and batch are sized from free memory: on one GPU (not yet across tensor-parallel ranks,
    whose caches are allocated as they load)."""
    return device.type == "cuda" and not opts.devices


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device, after returning torch's cached blocks to it."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def device_allocated(device: torch.device) -> int:
    """Bytes this process's torch tensors hold on a CUDA device (0 elsewhere)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def instance_budget(opts: EngineOptions, free: int, total: int, held: int = 0) -> int:
    """Bytes this engine may still take on a GPU: gpu_memory_utilization x total is its share of the card, whatever
    other engines or processes hold (vLLM's per-instance meaning: two engines at 0.4 share one GPU), less the
    `held` bytes it already has (its weights), and never more than is free."""
    return min(free, int(opts.gpu_memory_utilization * total) - held)


def size_from_memory(opts: EngineOptions, free: int, total: int, per_block: int, per_slot: int,
                     workspace: int, held: int) -> tuple[int, int]:
    """(max_batch_size, num_kv_blocks) for a GPU with `free` bytes left after this engine's `held` bytes of
    weights: the cache gets instance_budget minus one step's workspace. Recurrent state (per_slot bytes per
    sequence) takes at most half of it when --max-batch-size is 0; the KV blocks (per_block bytes each) take the
    rest when --num-kv-blocks is 0."""
    budget = instance_budget(opts, free, total, held) - workspace
    need = sequence_blocks(opts)
    if budget < need * per_block + per_slot:
        raise PocketError(
            f"--gpu-memory-utilization {opts.gpu_memory_utilization:g}: {free / GiB:.2f} GiB of {total / GiB:.2f} GiB "
            f"are free after the weights, too little for one sequence of --max-context {opts.max_context} and "
            f"{workspace / GiB:.2f} GiB of workspace; raise --gpu-memory-utilization or lower --max-context")
    batch = opts.max_batch_size or (min(MAX_SIZED_BATCH_SIZE, budget // 2 // per_slot) if per_slot
                                    else MAX_SIZED_BATCH_SIZE)
    if opts.num_kv_blocks:
        return batch, opts.num_kv_blocks
    blocks = (budget - batch * per_slot) // per_block if per_block else batch * need
    if blocks < need:
        raise PocketError(f"--max-batch-size {batch}: its recurrent state leaves room for {max(blocks, 0)} KV blocks, "
                          f"fewer than one sequence of --max-context {opts.max_context} needs ({need}); lower it")
    return batch, int(blocks)


def host_memory() -> int | None:
    """Bytes of RAM a process can still take without swapping: MemAvailable of /proc/meminfo (Linux), else the
    free pages sysconf counts; None where neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def memory_fix(opts: EngineOptions, need: dict[str, int], sized: bool) -> str:
    """The flags that size the largest of the cache's parts and the workspace in `need` (memory_budget), and
    their values: what to lower when they do not fit."""
    batch = f"--max-batch-size/--max-num-seqs (now {opts.max_batch_size or 1})"
    part = max(("kv_cache", "recurrent_state", "prefix_cache", "workspace", "fp8_dense_copy"),
               key=lambda name: need.get(name, 0))
    if part == "fp8_dense_copy":
        return (f"lower --fp8-dense-memory (now {opts.fp8_dense_memory} MiB) below the dense copy's "
                f"{format_bytes(need[part])} (FP8 weights then stay FP8, dequantised per use)")
    if part == "kv_cache":
        return (f"lower --num-kv-blocks (now {opts.num_kv_blocks})" if opts.num_kv_blocks else
                f"lower --max-context/--max-model-len (now {opts.max_context})" + ("" if sized else f" or {batch}"))
    if part == "prefix_cache" and opts.prefix_cache_memory >= 0:
        return f"lower --prefix-cache-memory (now {opts.prefix_cache_memory} MiB)"
    if part == "workspace":
        return f"lower --prefill-token-budget/--max-num-batched-tokens (now {opts.prefill_token_budget})"
    return f"lower {batch}"                         # its state slots, and by default one snapshot each


def check_memory_fits(cfg: ModelConfig, opts: EngineOptions, devices: list[torch.device], dtype: torch.dtype,
                      kv_dtype: torch.dtype, sized: bool, mtp_layers: int = 0) -> None:
    """Refuse, in one line and before any weight loads, a configuration whose per-rank memory_budget exceeds what
    its devices may use. A GPU: --gpu-memory-utilization of the card, at most what is free (instance_budget), for
    the whole budget. Free memory is asked of rank 0's device only (this process's); the other ranks' cards count
    as wholly free from their properties, since asking them would leave a CUDA context of this process on each.
    The CPU: what the machine has available (host_memory) for every CPU rank's cache, workspace and dense FP8 copy
    (the weights are read from the mapped checkpoint files, whose pages the kernel counts as available; the dense
    copy is memory of its own). A cache sized from
    memory (`sized`) needs at least one sequence of --max-context; otherwise the cache holds --max-batch-size of
    them (or --num-kv-blocks)."""
    world = len(devices)
    sizes = dataclasses.replace(opts, max_batch_size=opts.max_batch_size or 1,
                                num_kv_blocks=opts.num_kv_blocks or (sequence_blocks(opts) if sized else 0))
    need = memory_budget(cfg, sizes, world, kv_bytes=kv_dtype.itemsize, act_bytes=dtype.itemsize,
                         mtp_layers=mtp_layers)
    weights = need["layers"] + need["embedding"] + need["lm_head"]
    cpu_ranks = sum(device.type == "cpu" for device in devices)
    available = host_memory() if cpu_ranks else None
    if available is not None and cpu_ranks * (need["total"] - weights) > available:
        parts = {name: need[name] for name in ("fp8_dense_copy", "kv_cache", "recurrent_state", "prefix_cache",
                                               "workspace")}
        raise PocketError(f"the CPU has {format_bytes(available)} available (MemAvailable), but {cpu_ranks} rank(s) "
                          f"need {format_bytes(need['total'] - weights)} each besides the weights "
                          f"({format_budget(parts)}); {memory_fix(opts, need, sized)}")
    for device in devices:
        if device.type != "cuda":
            continue
        if device == devices[0]:
            free, total = torch.cuda.mem_get_info(device)
        else:
            free = total = torch.cuda.get_device_properties(device).total_memory
        usable = instance_budget(opts, free, total)
        if need["total"] <= usable:
            continue
        more = f"--devices with more than {world} GPUs (--tensor-parallel-size)"
        fix = (f"the weights alone ({format_bytes(weights)}) do not fit: use {more}" if weights > usable else
               f"{memory_fix(opts, need, sized)}, or use {more}")
        raise PocketError(f"{device} can use {format_bytes(max(usable, 0))} ({format_bytes(free)} free of "
                          f"{format_bytes(total)} at --gpu-memory-utilization {opts.gpu_memory_utilization:g}), "
                          f"but {world} rank(s) need {format_bytes(need['total'])} each "
                          f"({format_budget(need)}); {fix}")


def _check_options(opts: EngineOptions, cfg: ModelConfig):
    for name in ("max_context", "kv_block_size", "prefill_token_budget"):
        if getattr(opts, name) < 1:
            raise PocketError(f"--{name.replace('_', '-')} must be >= 1")
    if opts.max_context > cfg.max_position_embeddings and os.environ.get(ALLOW_LONG_CONTEXT) != "1":
        raise PocketError(f"--max-context/--max-model-len {opts.max_context} is beyond the model's "
                          f"max_position_embeddings ({cfg.max_position_embeddings}, config.json): positions past it "
                          f"were never trained; {ALLOW_LONG_CONTEXT}=1 in the environment allows it")
    if opts.fp8_dense_memory < 0:
        raise PocketError("--fp8-dense-memory must be >= 0 MiB (0: FP8 weights stay FP8)")
    if opts.prefix_cache_memory < -1:
        raise PocketError("--prefix-cache-memory must be >= 0 MiB, or -1 (one snapshot per state slot)")
    for name in ("max_batch_size", "num_kv_blocks"):
        if getattr(opts, name) < 0:
            raise PocketError(f"--{name.replace('_', '-')} must be >= 0 (0: sized for you)")
    if not 0 <= opts.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise PocketError(f"--speculative-tokens must be in [0, {MAX_SPECULATIVE_TOKENS}] (0: off)")
    for name in ("collective_timeout", "collective_warmup_timeout"):
        if not getattr(opts, name) > 0:
            raise PocketError(f"--{name.replace('_', '-')} must be > 0 seconds (got {getattr(opts, name):g})")
    if not 0.0 < opts.gpu_memory_utilization <= 1.0:
        raise PocketError(f"--gpu-memory-utilization must be in (0, 1] (got {opts.gpu_memory_utilization:g})")
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


def generation_defaults(ckpt: Checkpoint, source: str, opts: EngineOptions) -> dict:
    """The sampling defaults of requests that do not set them, as vLLM applies them: generation_config.json's
    temperature, top_p, top_k, min_p and repetition_penalty (source "auto"; a directory: its generation_config.json;
    "none": pocketllm's own defaults). Checked against the SamplingParams rows; logged."""
    if source == "none":
        config, where = {}, None
    elif source == "auto":
        config, where = ckpt.generation_config, ckpt.path / "generation_config.json"
    else:
        where = Path(source) / "generation_config.json"
        config = _read_json(where, required=True)
    defaults = {}
    for name in GENERATION_DEFAULT_FIELDS:
        if config.get(name) is not None:
            try:
                defaults[name] = read_field(SAMPLING_FIELDS[name], config[name], name)
            except RequestError as e:
                raise CheckpointError(f"{where}: {e} (--generation-config none ignores the file)") from None
    shown = ", ".join(f"{name}={defaults.get(name, SAMPLING_FIELDS[name].default)}"
                      for name in GENERATION_DEFAULT_FIELDS)
    _log(opts, f"generation defaults: {shown} ({f'from {where}' if defaults else 'built in'})")
    return defaults


def _sampling_params(sampling: dict, defaults: dict) -> SamplingParams:
    """LLM.generate's keywords as SamplingParams; the ones not given take the checkpoint's generation defaults."""
    unknown = set(sampling) - set(SAMPLING_FIELDS)
    if unknown:
        raise RequestError(f"unknown sampling option(s): {', '.join(sorted(unknown))}", param=sorted(unknown)[0])
    return SamplingParams(**{**defaults, **{name: value for name, value in sampling.items() if value is not None}})


class LLM:
    """A loaded model with its engine. generate() / logits() / submit() here; chat() / serve() for OpenAI.

    >>> llm = LLM()                                   # the bundled pocket-tiny model
    >>> out = llm.generate("Hello", max_tokens=4, temperature=0)
    >>> sorted(out)
    ['completion_tokens', 'finish_reason', 'logprobs', 'prompt_tokens', 'text', 'token_ids']
    """

    def __init__(self, ckpt_dir: str | os.PathLike | None = None, *, generation_config: str = "auto", **options):
        unknown = set(options) - {f.name for f in dataclasses.fields(EngineOptions)}
        if unknown:
            raise PocketError(f"unknown LLM option(s): {', '.join(sorted(unknown))}")
        self.options = opts = EngineOptions(**options)
        self.ckpt_dir = Path(ckpt_dir) if ckpt_dir is not None else DEFAULT_CKPT
        self.model_name = self.ckpt_dir.resolve().name
        ckpt = open_checkpoint(self.ckpt_dir, opts.load_format, seed=opts.seed)
        self.config = cfg = ckpt.config
        self.tokenizer = Tokenizer(self.ckpt_dir, builtin=opts.load_format == "dummy")
        _check_options(opts, cfg)
        self.eos_token_ids = _eos_ids(ckpt, self.tokenizer)
        # Every device, backend and dtype choice is checked here, before a single weight loads.
        self.placement = placement = plan_placement(opts)
        device, kv_dtype = placement.device, placement.kv_dtype
        self.device, self.dtype, self.kv_dtype = device, placement.dtype, kv_dtype
        opts.device, opts.backend = str(device), placement.backend     # what tensor-parallel ranks run
        if ckpt_dir is None:
            _log(opts, f"no --ckpt given: serving the bundled pocket-tiny model ({self.ckpt_dir})")
        self.generation_defaults = generation_defaults(ckpt, generation_config, opts)   # name -> value
        if opts.load_format == "dummy":
            _log(opts, f"--load-format dummy: random weights from {self.ckpt_dir / 'config.json'} (seed {opts.seed}), "
                       f"drawn on each device; the text is noise and speculative drafts are rejected")
        sized = memory_sized(device, opts)
        if not sized:
            opts.max_batch_size = opts.max_batch_size or DEFAULT_MAX_BATCH_SIZE
        full = (opts.smoke_layers or cfg.num_hidden_layers) == cfg.num_hidden_layers   # the MTP layer reads the last
        check_memory_fits(cfg, opts, parse_devices(opts.devices) if opts.devices else [device], self.dtype,
                          kv_dtype, sized, mtp_layers=int(opts.speculative_tokens > 0 and full and has_mtp(ckpt)))
        self.dead_reason: str | None = None
        self._allocated_before_load = device_allocated(device)
        self.group = None                      # tensor-parallel rank group (section 8b), when --devices is given
        if opts.devices:
            self.group = start_group(self.ckpt_dir, opts, self.dtype, kv_dtype)
            self.group.on_death = lambda reason: setattr(self, "dead_reason", reason)
            shards = self.group.call("vocab_shards")
            _log(opts, "vocab-parallel embedding and lm_head rows per rank: " +
                 ", ".join(f"{r}: [{a}, {b})" for r, (a, b, _, _) in enumerate(shards)))
            self.model, run_batch = self.group.model, lambda batch: self.group.run_batch(batch, self.engine.cache)
        else:
            _log(opts, placement.describe())
            ops = NativeOps(device) if placement.backend == "native" else TorchOps()
            ckpt.device = device                   # where --load-format dummy draws the weights
            self.model = Model(ckpt, ops, self.dtype, device, num_layers=opts.smoke_layers or None,
                               progress=not opts.quiet, mtp=opts.speculative_tokens > 0,
                               dense_budget=opts.fp8_dense_memory << 20)
            run_batch = None
        if opts.speculative_tokens and self.model.mtp is not None:
            _log(opts, f"speculative decoding: the MTP layer drafts {opts.speculative_tokens} tokens per step")
        elif opts.speculative_tokens:
            _log(opts, "speculative decoding off: " + (
                f"the checkpoint's MTP layer is incomplete (missing tensor '{self.model.mtp_missing}')"
                if self.model.mtp_missing else "--smoke-layers runs part of the model" if has_mtp(ckpt)
                else "the checkpoint has no MTP layer (mtp.* tensors)"))
        if self.group is None and placement.backend == "torch" and self.model.dense_bytes:
            _log(opts, fp8_dense_line(self.model, opts.fp8_dense_memory))
        ckpt.close()
        if sized:
            self._size_cache()
        self.engine = Engine(self.model, opts, self.eos_token_ids, kv_dtype, run_batch,
                             self.group.copy_state if self.group else None,
                             (lambda method, *args: self.group.call_engine(self.engine.cache, method, *args))
                             if self.group else None)
        _log(opts, f"{self.model_name}: {cfg.model_type}, {len(self.model.layers)} layers, {self.dtype}; "
                   f"KV cache {self.engine.blocks.total} blocks x {opts.kv_block_size} tokens = "
                   f"{self.engine.blocks.total * opts.kv_block_size} tokens, {opts.max_batch_size} state slots")
        world = len(parse_devices(opts.devices)) if opts.devices else 1
        budget = memory_budget(cfg, opts, world, kv_bytes=kv_dtype.itemsize, act_bytes=self.dtype.itemsize,
                               mtp_layers=len(self.model.cache_layers) - len(self.model.layers))
        _log(opts, f"memory per {'rank' if world > 1 else 'device'} (config estimate, docs/serving.md): "
                   f"{format_budget(budget)}")
        self._lock = threading.Lock()          # one forward pass at a time (engine thread or logits())
        self._life = threading.Lock()          # the engine thread's start, submissions, failure and close
        self._seeds = random.Random(opts.seed)  # unseeded requests' seeds: the same --seed, the same answers
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closing = False
        self.draining = False                  # close(drain=True) has begun: submissions are refused (503)
        self._ids = itertools.count()
        # A daemon thread still running at interpreter exit is killed inside torch code, which aborts the
        # process ("terminate called without an active exception"): stop it before that.
        atexit.register(self.close)

    def _size_cache(self):
        """--num-kv-blocks 0 / --max-batch-size 0 on a GPU: size both from the memory left after the weights."""
        opts, cfg, layers = self.options, self.config, self.model.cache_layers
        free, total = device_memory(self.device)
        per_block = cache_bytes(cfg, layers, 2, opts.kv_block_size, 1, self.kv_dtype) - \
            cache_bytes(cfg, layers, 1, opts.kv_block_size, 1, self.kv_dtype)
        per_slot = cache_bytes(cfg, layers, 1, opts.kv_block_size, 2, self.kv_dtype) - \
            cache_bytes(cfg, layers, 1, opts.kv_block_size, 1, self.kv_dtype)
        workspace = workspace_bytes(cfg, opts.prefill_token_budget, opts.max_batch_size or MAX_SIZED_BATCH_SIZE,
                                    self.dtype.itemsize)
        snapshots = snapshot_slots(dataclasses.replace(opts, max_batch_size=1), cfg, layers, self.kv_dtype)
        if opts.prefix_cache_memory < 0:       # prefix-cache snapshots: one per slot, sized with the slots
            per_slot += snapshots * state_slot_bytes(cfg, layers, self.kv_dtype)
        else:                                  # a fixed amount, set aside like the workspace
            workspace += snapshots * state_slot_bytes(cfg, layers, self.kv_dtype)
        held = device_allocated(self.device) - self._allocated_before_load          # the weights
        batch, blocks = size_from_memory(opts, free, total, per_block, per_slot, workspace, held)
        _log(opts, f"{free / GiB:.1f} GiB of {total / GiB:.1f} GiB free after the weights; at "
                   f"--gpu-memory-utilization {opts.gpu_memory_utilization:g}: KV cache {blocks} blocks = "
                   f"{blocks * opts.kv_block_size} tokens ({blocks * per_block / GiB:.2f} GiB), {batch} sequences "
                   f"({batch * per_slot / GiB:.2f} GiB of recurrent state), {workspace / GiB:.2f} GiB kept for work")
        opts.max_batch_size, opts.num_kv_blocks = batch, blocks

    def warm_up(self) -> str:
        """One short request through the real path before serving: a 16-token prefill and 4 decode steps sampled
        at temperature 1 with every penalty and logprobs, so a server that says healthy has served. Request
        counters are left as they were. Returns what ran; PocketError when it fails."""
        counters = dict(self.engine.counters)
        _token_facts(self.tokenizer, self.eos_token_ids)     # structured output's vocabulary tables, not in a request
        prompt = [i % self.config.vocab_size for i in range(1, 17)]
        params = SamplingParams(max_tokens=4, temperature=1.0, top_p=0.95, presence_penalty=0.5,
                                frequency_penalty=0.5, repetition_penalty=1.1, ignore_eos=True, seed=0, logprobs=1)
        start = time.perf_counter()
        try:
            tokens = sum(len(ev.token_ids) for ev in self.submit(prompt, params))
        except PocketError as e:
            raise PocketError(f"the warm-up request failed, so the server does not start: {e}") from None
        finally:
            self.engine.counters.update(counters)
        return (f"warm-up: {len(prompt)}-token prefill and {tokens} tokens sampled at temperature 1 with penalties "
                f"in {1000 * (time.perf_counter() - start):.0f} ms")

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
                except Exception as e:           # the engine's own fault (device, native, a rank, a bug)
                    traceback.print_exc()
                    self._fail_all(f"{type(e).__name__}: {e}")
                    return

    def _fail_all(self, reason: str):
        """Stop for good: every request, queued in the inbox or running, ends with the error at once; later
        submissions are refused. Runs on the engine thread after its last step, or after close() joined it."""
        with self._life:
            self.dead_reason = self.dead_reason or reason
            self.engine.fail_all(self.dead_reason)

    def submit(self, prompt_ids: list[int], params: SamplingParams, param: str = "max_tokens",
               snapshot_at: int | None = None) -> RequestStream:
        """Queue a request; iterate the returned stream for its events. Thread-safe. snapshot_at: a prompt
        position the prefix cache should also snapshot, where a follow-up request is likely to diverge (the
        end of a chat prompt's last message: chat_snapshot_point)."""
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
        with self._life:                       # a request added here is failed by _fail_all if need be
            if self.dead_reason or self._closing:
                raise PocketError(f"the engine failed: {self.dead_reason or 'the engine was closed'}")
            if self.draining:
                raise RequestError("the engine is draining before it closes and takes no new requests; retry "
                                   "(another replica)", status=503, code="draining")
            req = Request(f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}", prompt_ids, params,
                          default_seed=self._seeds.getrandbits(62))
            req.snapshot_at = snapshot_at if snapshot_at and 0 < snapshot_at < len(prompt_ids) else None
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="pocketllm-engine", daemon=True)
                self._thread.start()
            self.engine.add(req)
        self.wake()
        return RequestStream(self, req)

    def stats(self) -> dict:
        return self.engine.stats()

    def close(self, drain: bool = False, timeout: float = DEFAULT_DRAIN_TIMEOUT) -> bool:
        """Stop the engine thread (requests still running end with an error) and the tensor-parallel ranks, if
        any. drain=True first refuses new submissions (RequestError, 503 code draining) and lets the requests
        queued and running finish, for up to `timeout` seconds. Runs at interpreter exit too; later calls do
        nothing. Returns False if a request was still running when the engine stopped."""
        if drain:
            self._drain(timeout)
        with self._life:
            if self._closing:
                return True
            self._closing = True
            cut = self.engine.has_work()
        atexit.unregister(self.close)
        self.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._fail_all("the engine was closed")
        if self.group is not None:
            self.group.close()
        return not cut

    def _drain(self, timeout: float) -> None:
        """Refuse new submissions; wait until the engine holds no request, or until timeout seconds pass."""
        with self._life:
            self.draining = True
        deadline = time.monotonic() + timeout
        while self.engine.has_work() and not self.dead_reason and time.monotonic() < deadline:
            time.sleep(0.01)

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
        params = _sampling_params(sampling, self.generation_defaults)
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


# The command line. Every flag has help with its default, vLLM's names are aliases where the meaning is the
# same, and every mistake is one line naming the flag (exit 2) before any weight loads.

# vLLM flags with no pocketllm equivalent: what to do instead, in one line.
VLLM_ONLY_FLAGS = {
    "--kv-cache-dtype": "use --kv-dtype (float16, bfloat16 or float32; there is no fp8 KV cache)",
    "--quantization": "drop it: FP8 is read from the checkpoint's quantization_config",
    "--trust-remote-code": "drop it: pocketllm runs no checkpoint code (the chat template runs in a sandbox)",
    "--pipeline-parallel-size": "there is no pipeline parallelism: use --tensor-parallel-size N or --devices",
    "--data-parallel-size": "there is no data parallelism: run one pocketllm per GPU (--device cuda:N)",
    "--tokenizer": "drop it: the tokenizer is read from the checkpoint directory (--ckpt)",
    "--download-dir": "pocketllm loads a local directory: download the checkpoint, then --ckpt DIR",
    "--revision": "pocketllm loads a local directory: download the revision, then --ckpt DIR",
    "--reasoning-parser": "drop it: <think> blocks become reasoning_content without a parser flag",
    "--swap-space": "there is no CPU swap: lower --max-batch-size or --max-context",
    "--cpu-offload-gb": "there is no offloading: use more GPUs (--tensor-parallel-size)",
    "--max-logprobs": "drop it: requests may ask for up to 20 logprobs",
    "--disable-log-requests": "drop it: pocketllm logs one line per HTTP request (never its content)",
    "--uvicorn-log-level": "drop it: pocketllm logs its start-up and one line per request (--quiet: no start-up lines)",
    "--speculative-config": "use --speculative-tokens K: the checkpoint's MTP layer drafts K tokens (no separate "
                            "draft model)",
    "--limit-mm-per-prompt": "pocketllm serves text only",
}


class CommandLineParser(argparse.ArgumentParser):
    """argparse with every mistake on one line (not the usage block): 'pocketllm: error: argument --port: ...'."""

    def error(self, message: str):
        self.exit(2, f"pocketllm: error: {message} (see --help)\n")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _option_default(value, quote: str = "") -> str:
    """An option's default as `--help` and the docs write it: on / off, none, or the value (strings quoted)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else f"{quote}{value}{quote}" if isinstance(value, str) else str(value)


def _engine_flags(f: dataclasses.Field) -> list[str]:
    """An EngineOptions field's flag, then vLLM's name for it."""
    return [_flag(f.name)] + ([f.metadata["alias"]] if f.metadata["alias"] else [])


def add_engine_args(parser: argparse.ArgumentParser):
    parser.add_argument("--ckpt", "--model", default=None, metavar="DIR",
                        help="checkpoint directory (default: the bundled pocket-tiny)")
    kinds = {"int": int, "float": float, "int | None": int}
    for f in dataclasses.fields(EngineOptions):
        text = f"{f.metadata['help'].replace('`', '').replace('%', '%%')} (default: {_option_default(f.default)})"
        if f.type == "bool":          # on by default: --NAME / --no-NAME
            parser.add_argument(*_engine_flags(f), default=f.default, help=text,
                                action=argparse.BooleanOptionalAction if f.default else "store_true")
        else:
            parser.add_argument(*_engine_flags(f), type=kinds.get(f.type, str), default=f.default,
                                metavar=f.metadata["metavar"], help=text)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="vLLM's name: the first N GPUs, one rank each (= --devices 0,...,N-1) "
                             "(default: %(default)s)")
    parser.add_argument("--generation-config", default="auto", metavar="auto|none|DIR", help=(
        "sampling defaults of requests that do not set them: auto = the checkpoint's generation_config.json "
        "(temperature, top_p, top_k, min_p, repetition_penalty), none = pocketllm's own, "
        "DIR = DIR/generation_config.json (default: auto)"))


def engine_options_markdown() -> str:
    """docs/api.md's table of LLM(...) options: each EngineOptions field's default and help."""
    rows = ["| option | default | meaning |", "|---|---|---|"]
    rows += [f"| `{f.name}` | {_option_default(f.default, '`')} | {f.metadata['help']} |"
             for f in dataclasses.fields(EngineOptions)]
    return "\n".join(rows)


def engine_flags_markdown() -> str:
    """docs/api.md's table of engine flags: the same fields as flags, with vLLM's names."""
    rows = ["| flag | vLLM's name | what it does | default |", "|---|---|---|---|"]
    for f in dataclasses.fields(EngineOptions):
        flag, *alias = _engine_flags(f)
        negated = f.type == "bool" and f.default            # --NAME / --no-NAME
        shown = flag if f.type == "bool" else f"{flag} {f.metadata['metavar']}"
        names = [flag, "--no-" + flag[2:]] if negated else [shown]
        vllm = [a for name in alias for a in ([name, "--no-" + name[2:]] if negated else [name])]
        vllm_text = ", ".join(f"`{name}`" for name in vllm) or f.metadata["vllm"]
        cells = [", ".join(f"`{name}`" for name in names), vllm_text, f.metadata["help"],
                 _option_default(f.default, "`")]
        rows.append(("| " + " | ".join(cells) + " |").replace("|  |", "| |"))
    return "\n".join(rows)


def vllm_only_flags_markdown() -> str:
    rows = ["| vLLM flag | pocketllm's answer |", "|---|---|"]
    for name, answer in VLLM_ONLY_FLAGS.items():
        rows.append(f"| `{name}` | " + re.sub(r"(--[a-z-]+(?: [A-Z]+| cuda:N)?|<\w+>)", r"`\1`", answer) + " |")
    return "\n".join(rows)


# docs/api.md's tables that the CLI renders (between `<!-- table: NAME -->` and `<!-- end table -->`).
DOC_TABLES = {"engine options": engine_options_markdown, "engine flags": engine_flags_markdown,
              "vllm-only flags": vllm_only_flags_markdown}


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineOptions of parsed flags; --tensor-parallel-size N becomes --devices 0,...,N-1."""
    options = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineOptions)}
    options["generation_config"] = args.generation_config
    n = args.tensor_parallel_size
    if n < 1:
        raise PocketError(f"--tensor-parallel-size must be >= 1 (got {n})")
    if n > 1:
        if args.devices:
            raise PocketError("give --tensor-parallel-size or --devices, not both")
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n > visible:
            raise PocketError(f"--tensor-parallel-size {n}: only {visible} CUDA device(s) visible "
                              f"(for CPU ranks in tests: --devices cpu,cpu)")
        options["devices"] = ",".join(str(i) for i in range(n))
    return options


def check_ckpt_arg(ckpt: str | None) -> None:
    if ckpt is None:
        return
    path = Path(ckpt)
    if not path.is_dir():
        raise PocketError(f"--ckpt {ckpt}: no such directory")
    if not (path / "config.json").is_file():
        raise PocketError(f"--ckpt {ckpt}: not a checkpoint directory (no config.json in it)")


def check_listen(host: str, port: int) -> None:
    """--host / --port: in range, resolvable, and free now (checked again when the server binds)."""
    if not 0 <= port <= 65535:
        raise PocketError(f"--port {port}: must be in [0, 65535] (0 picks a free port)")
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise PocketError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as http.server does
        try:
            probe.bind(address)
        except OSError as e:
            flag = "--port" if e.errno == errno.EADDRINUSE else "--host"
            raise PocketError(f"{flag} {port if flag == '--port' else host}: cannot listen on {host}:{port} "
                              f"({e.strerror})") from None


def check_server_args(args: argparse.Namespace) -> None:
    check_listen(args.host, args.port)
    if args.max_request_bytes < 1:
        raise PocketError(f"--max-request-bytes must be >= 1 (got {args.max_request_bytes})")
    if not args.socket_timeout > 0:
        raise PocketError(f"--socket-timeout must be > 0 (got {args.socket_timeout:g})")
    if not args.drain_timeout >= 0:
        raise PocketError(f"--drain-timeout must be >= 0 seconds (got {args.drain_timeout:g})")


def command_line_parser() -> CommandLineParser:
    parser = CommandLineParser(prog="pocketllm", allow_abbrev=False,
                               description="Serve a Qwen checkpoint behind an OpenAI-compatible API. "
                                           "docs/api.md, 'Command line', lists every flag.")
    add_engine_args(parser)
    add_server_args(parser)
    return parser


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """Parsed flags; a vLLM flag pocketllm lacks is answered with what to use instead."""
    parser = command_line_parser()
    args, extra = parser.parse_known_args(argv)
    for arg in extra:
        name = arg.split("=", 1)[0]
        if name in VLLM_ONLY_FLAGS:
            raise PocketError(f"{name} is a vLLM flag pocketllm does not have: {VLLM_ONLY_FLAGS[name]}")
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["bench"]:
            raise PocketError("there is no 'bench' subcommand: the benchmarks are benchmarks/bench.py "
                              "(python benchmarks/bench.py --help; docs/benchmarks.md)")
        args = parse_command_line(argv)
        options = engine_options(args)
        check_ckpt_arg(args.ckpt)
        check_server_args(args)
        if args.chat_template:       # read and compiled now, not after minutes of loading
            args.chat_template = load_chat_template(Tokenizer(args.ckpt or DEFAULT_CKPT), args.chat_template)
        server = open_server(args)   # the probes answer while the weights load
        llm = LLM(args.ckpt, **options)
        return run_server(llm, args, server)
    except PocketError as e:
        print(f"pocketllm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

