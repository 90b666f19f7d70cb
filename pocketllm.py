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


# ===== SECTION 2: checkpoint loading (owner: core) =====


# ===== SECTION 3: torch backend ops (owner: core) =====


# ===== SECTION 3b: native backend ops (owner: native) =====

# -----------------------------------------------------------------------------------------------
# 3b. The native backend: the same ops, run by the CUDA library in csrc/ (libpocketllm.so), reached
#     through cffi's ABI mode, so importing pocketllm needs no compiler and any Python version works.
#     The CPU test build (libpocketllm_cpu.so) runs the same kernels on host tensors; CI uses it.
# -----------------------------------------------------------------------------------------------

NATIVE_ABI_VERSION = 1          # must equal PL_ABI_VERSION in csrc/pocketllm.h
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


def native_status() -> tuple[bool, str]:
    """(True, what) when the native backend can run here: library loads, a GPU of sm_75+ and torch CUDA;
    otherwise (False, why)."""
    try:
        lib = load_native()
        count = lib.device_count()
    except PocketError as e:
        return False, str(e)
    if count == 0:
        return False, "no CUDA device is visible"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} has no CUDA support, so tensors cannot live on the GPU"
    major, minor = lib.capability(torch.cuda.current_device())
    if (major, minor) < NATIVE_MIN_CAPABILITY:
        return False, f"GPU compute capability {major}.{minor} is below the required 7.5"
    return True, f"{lib.path.name} (ABI {NATIVE_ABI_VERSION}) on {torch.cuda.get_device_name()} (sm_{major}{minor})"


def choose_backend(requested: str = "auto") -> tuple[str, str]:
    """Resolve --backend: returns ("native" | "torch", the reason to print at startup).

    "auto" picks native only when native_status() is ok; "native" raises PocketError when it is not.
    """
    if requested == "torch":
        return "torch", "torch backend (requested)"
    if requested not in ("auto", "native"):
        raise PocketError(f"--backend must be auto, native or torch, not {requested!r}")
    ok, why = native_status()
    if ok:
        return "native", f"native backend: {why}"
    if requested == "native":
        raise PocketError(f"--backend native is unavailable: {why}")
    return "torch", f"torch backend (native unavailable: {why})"


class NativeOps:
    """The backend op list (see TorchOps) on the native library. Tensors must be contiguous and live where
    the library runs: CUDA tensors for libpocketllm.so, CPU tensors for the CPU test build. Each method
    passes data pointers, shapes and dtype codes, on torch's current stream."""

    def __init__(self, act_dtype: torch.dtype | None = None, lib: NativeLibrary | None = None,
                 cpu_build: bool = False):
        self.lib = lib or load_native(cpu_build)
        self.act_dtype = act_dtype or (torch.float32 if self.lib.is_cpu_build else torch.float16)
        self.device = torch.device("cpu") if self.lib.is_cpu_build else None

    # ---- Plumbing: pointers, dtype codes, the stream, output allocation ----

    def _p(self, t: torch.Tensor) -> int:
        if t.is_cuda == self.lib.is_cpu_build:
            where = "CPU" if self.lib.is_cpu_build else "CUDA"
            raise PocketError(f"native backend ({self.lib.path.name}) needs {where} tensors, got one on {t.device}")
        if not t.is_contiguous():
            raise PocketError(f"native backend needs contiguous tensors, got shape {tuple(t.shape)} "
                              f"strides {t.stride()}")
        return t.data_ptr()

    @staticmethod
    def _dt(t: torch.Tensor) -> int:
        if t.dtype not in NATIVE_DTYPES:
            raise PocketError(f"native backend does not handle dtype {t.dtype}")
        return NATIVE_DTYPES[t.dtype]

    @staticmethod
    def _stream(t: torch.Tensor) -> int:
        return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0

    @staticmethod
    def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.contiguous() if t.dtype == dtype else t.to(dtype).contiguous()

    # ---- The ops ----

    def embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        ids = self._as(ids, torch.int64)
        (V, D), T = table.shape, ids.numel()
        out = torch.empty(T, D, dtype=self.act_dtype, device=table.device)          # (T, D)
        self.lib.call("pl_embed", self._p(ids), T, self._p(table), self._dt(table), V, D, self._p(out),
                      self._dt(out), self._stream(out))
        return out

    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        D = x.shape[-1]
        out = torch.empty_like(x)                                                    # (T, D)
        self.lib.call("pl_rmsnorm", self._p(x), self._p(w), self._dt(w), self._p(out), self._dt(x),
                      x.numel() // D, D, eps, self._stream(x))
        return out

    def add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        D = x.shape[-1]
        if residual.dtype != torch.float32:
            raise PocketError(f"add_rmsnorm: the residual stream must be float32, got {residual.dtype}")
        out = torch.empty_like(x)                                                    # (T, D)
        self.lib.call("pl_add_rmsnorm", self._p(x), self._p(residual), self._p(w), self._dt(w), self._p(out),
                      self._dt(x), x.numel() // D, D, eps, self._stream(x))
        return out, residual

    def linear(self, x: torch.Tensor, w) -> torch.Tensor:
        weight, scale = w.weight, w.scale
        N, K = weight.shape
        T = x.numel() // K
        out = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)          # (T, N)
        scale_ptr = 0
        if scale is not None:
            scale = self._as(scale, torch.float32)
            scale_ptr = self._p(scale)
        self.lib.call("pl_linear", self._p(x), self._dt(x), T, K, self._p(weight), self._dt(weight), scale_ptr, N,
                      self._p(out), self._stream(x))
        return out

    def silu_mul(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(g)                                                    # (T, I)
        self.lib.call("pl_silu_mul", self._p(g), self._p(u), self._p(out), self._dt(g), g.numel(), self._stream(g))
        return out

    def sigmoid_mul(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)                                                    # (T, N)
        self.lib.call("pl_sigmoid_mul", self._p(x), self._p(gate), self._p(out), self._dt(x), x.numel(),
                      self._stream(x))
        return out

    def qk_norm_rope(self, q: torch.Tensor, k: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, eps: float,
                     positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, Hq, Dh = q.shape
        Hk = k.shape[1]
        k_w = self._as(k_w, q_w.dtype)
        positions, inv_freq = self._as(positions, torch.int64), self._as(inv_freq, torch.float32)
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)                     # (T, Hq, Dh), (T, Hk, Dh)
        self.lib.call("pl_qk_norm_rope", self._p(q), self._p(k), self._p(q_out), self._p(k_out), self._dt(q), T, Hq,
                      Hk, Dh, self._p(q_w), self._p(k_w), self._dt(q_w), eps, self._p(positions), self._p(inv_freq),
                      inv_freq.numel(), self._stream(q))
        return q_out, k_out

    def kv_write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        T, Hk, Dh = k.shape
        slot_mapping = self._as(slot_mapping, torch.int64)
        self.lib.call("pl_kv_write", self._p(k), self._p(v), self._dt(k), T, Hk, Dh, self._p(k_cache),
                      self._p(v_cache), self._dt(k_cache), self._p(slot_mapping), self._stream(k))

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, query_start: torch.Tensor, scale: float) -> torch.Tensor:
        T, Hq, Dh = q.shape
        _, block_size, Hk, _ = k_cache.shape
        block_tables = self._as(block_tables, torch.int32)
        context_lens, query_start = self._as(context_lens, torch.int32), self._as(query_start, torch.int32)
        B, max_blocks = block_tables.shape
        ws_bytes = self.lib.lib.pl_attention_workspace_bytes(T, Hq, Dh, max_blocks, block_size)
        workspace = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=q.device)
        out = torch.empty_like(q)                                                    # (T, Hq, Dh)
        self.lib.call("pl_attention", self._p(q), self._dt(q), T, Hq, Hk, Dh, self._p(k_cache), self._p(v_cache),
                      block_size, self._p(block_tables), max_blocks, self._p(context_lens), self._p(query_start), B,
                      scale, self._p(out), self._p(workspace), ws_bytes, self._stream(q))
        return out

    def conv1d(self, x: torch.Tensor, w: torch.Tensor, conv_state: torch.Tensor, slot_ids: torch.Tensor,
               query_start: torch.Tensor) -> torch.Tensor:
        T, C = x.shape
        w = w.reshape(C, -1)                                                         # (C, W); HF stores (C, 1, W)
        slot_ids, query_start = self._as(slot_ids, torch.int32), self._as(query_start, torch.int32)
        out = torch.empty_like(x)                                                    # (T, C)
        self.lib.call("pl_conv1d", self._p(x), self._dt(x), T, C, self._p(w), self._dt(w), w.shape[1],
                      self._p(conv_state), self._dt(conv_state), self._p(slot_ids), self._p(query_start),
                      slot_ids.numel(), self._p(out), self._stream(x))
        return out

    def gdn_gates(self, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                  dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, Hv = a.shape
        if A_log.dtype != dt_bias.dtype:   # one dtype code for both: use fp32 (Hv values)
            A_log, dt_bias = self._as(A_log, torch.float32), self._as(dt_bias, torch.float32)
        g = torch.empty(T, Hv, dtype=torch.float32, device=a.device)                # (T, Hv)
        beta = torch.empty_like(g)                                                   # (T, Hv)
        self.lib.call("pl_gdn_gates", self._p(a), self._p(b), self._dt(a), T, Hv, self._p(A_log), self._p(dt_bias),
                      self._dt(A_log), self._p(g), self._p(beta), self._stream(a))
        return g, beta

    def gated_delta(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, slot_ids: torch.Tensor, query_start: torch.Tensor) -> torch.Tensor:
        T, Hk, Dk = q.shape
        _, Hv, Dv = v.shape
        slot_ids, query_start = self._as(slot_ids, torch.int32), self._as(query_start, torch.int32)
        out = torch.empty_like(v)                                                    # (T, Hv, Dv)
        self.lib.call("pl_gated_delta", self._p(q), self._p(k), self._p(v), self._dt(q), T, Hk, Hv, Dk, Dv,
                      self._p(g), self._p(beta), self._p(state), self._p(slot_ids), self._p(query_start),
                      slot_ids.numel(), self._p(out), self._stream(q))
        return out

    def gated_rmsnorm(self, x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
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

    def nccl_init(self, unique_id: bytes, nranks: int, rank: int, device: int) -> int:
        self._require_nccl()
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
    try:
        import nvidia.nccl
        found += [str(Path(p) / "lib" / "libnccl.so.2") for p in nvidia.nccl.__path__]
    except ImportError:
        pass
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


# ===== SECTION 5-9: memory, scheduler, sampler, runner, engine (owner: core) =====


# ===== SECTION 10: text (owner: core: tokenizer + detokenizer; text: chat templates) =====


# ===== SECTION 11: output parsing and tool_choice (owner: text) =====


# ===== SECTION 12-13: OpenAI protocol and HTTP server (owner: server) =====


# ===== SECTION 14: the LLM object and the CLI (owner: core; server adds chat/serve) =====
