"""Fake CUDA on a CPU-only machine, for device-honesty tests.

torch's FakeTensorMode makes `cuda` tensors that hold no data and raises FakeTensorDeviceMismatchError when
a CPU tensor meets a CUDA one, as a real GPU would. On its own it cannot run code that reads values on the
host (`int(t)`, `t.tolist()`: the torch backend's prefill loops, the sampler's one transfer). RealValues,
entered inside it, keeps a real CPU copy beside every fake tensor made from real data and computes each op
on those copies too, so the fake run is also a real CPU run with real values, while every device check is
FakeTensorMode's own. It also counts device-to-host reads and refuses a generator on the wrong device
(FakeTensorMode lets `torch.multinomial(cuda_probs, generator=cpu_generator)` through; CUDA does not).

torch's C++ bindings open a CUDA device guard around indexing, `copy_`, `int(t)`, `contiguous()` and more. On a
CUDA build without a GPU, FakeTensorMode swaps torch's CUDA guard for c10's no-op one when it starts
(torch._C._ensureCUDADeviceGuardSet); a CPU-only build, as the README installs on a machine without a GPU, has
no CUDA guard to swap ("PyTorch is not linked with support for cuda devices"), so no_op_cuda_guard() compiles
and registers that same no-op guard (c10::impl::NoOpDeviceGuardImpl<CUDA>): both builds then run the fake
device through the same guard.

OpGraph stands in for torch.cuda.CUDAGraph (DecodeGraphs(graph=...)): it records a captured step's torch ops,
refuses host reads and uploads inside the capture, and replays the ops on the same tensors
(tests/test_graph_sampler.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import subprocess
import weakref
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

import build
import pocketllm

CUDA = torch.device("cuda:0")
GUARD_SOURCE = """#include <c10/core/impl/DeviceGuardImplInterface.h>
// The CUDA device guard FakeTensorMode sets on a CUDA build without a GPU, for a build of torch without CUDA.
C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);
"""


@functools.cache
def no_op_cuda_guard() -> None:
    """On a CPU-only build of torch, register c10's no-op CUDA device guard (see the module's docstring): a small
    library built once per torch version under build/, loaded into this process. A CUDA build has its own."""
    if torch.backends.cuda.is_built():
        return
    cxx = build.find_cxx()
    if not cxx:
        pytest.skip("fake CUDA on a CPU-only build of torch needs a C++ compiler (g++ or $CXX) for its no-op CUDA "
                    "device guard")
    torch_dir = Path(torch.__file__).parent
    out = build.ROOT / "build" / f"fake_cuda_guard-{torch.__version__}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        src, tmp = out.with_suffix(f".{os.getpid()}.cpp"), out.with_suffix(f".{os.getpid()}.tmp")
        src.write_text(GUARD_SOURCE)
        lib, abi = torch_dir / "lib", int(torch._C._GLIBCXX_USE_CXX11_ABI)
        cmd = [cxx, "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               "-I", str(torch_dir / "include"), str(src), "-o", str(tmp), "-L", str(lib), "-lc10", f"-Wl,-rpath,{lib}"]
        made = subprocess.run(cmd, capture_output=True, text=True)
        src.unlink()
        if made.returncode != 0:
            raise RuntimeError(f"cannot build fake CUDA's no-op device guard: {' '.join(cmd)}\n{made.stderr}")
        os.replace(tmp, out)                   # whole or absent, also when two test processes build it at once
    ctypes.CDLL(str(out))                      # its static registrar stores the guard in c10's registry


class RealValues(TorchDispatchMode):
    """Inside a FakeTensorMode: real CPU values for fake tensors, and a count of device-to-host reads."""

    def __init__(self):
        super().__init__()
        self.values: dict[int, tuple] = {}    # id(fake tensor) -> (weakref to it, its real CPU value)
        self.host_reads: list[str] = []       # one entry per read of a CUDA tensor's data on the host

    def value(self, t):
        entry = self.values.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = tree_flatten((args, kwargs))[0]
        generator = kwargs.get("generator")
        devices = {t.device.type for t in flat if isinstance(t, torch.Tensor)}
        if generator is not None and {generator.device.type} != devices:
            raise RuntimeError(f"{func}: a {generator.device.type} generator cannot draw for {devices} tensors")
        if self._reads_host(func, args, kwargs):
            self.host_reads.append(str(func))
        known = all(self.value(t) is not None for t in flat if isinstance(t, FakeTensor))
        if func is torch.ops.aten._local_scalar_dense.default and known:
            with _disable_current_modes():
                return self.value(args[0]).item()
        out = func(*args, **kwargs)
        if known:
            def real(x):
                if isinstance(x, FakeTensor):
                    return self.value(x)
                return torch.device("cpu") if isinstance(x, torch.device) else x
            with _disable_current_modes():
                result = func(*tree_map(real, args), **tree_map(real, kwargs))
            for fake, value in zip(tree_flatten(out)[0], tree_flatten(result)[0]):
                if isinstance(fake, FakeTensor) and isinstance(value, torch.Tensor):
                    self.values[id(fake)] = (weakref.ref(fake), value)
        return out

    @staticmethod
    def _reads_host(func, args, kwargs) -> bool:
        if func is torch.ops.aten.copy_.default:                 # copy_(destination, source)
            return args[0].device.type == "cpu" and args[1].device.type == "cuda"
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if src is None or src.device.type != "cuda":
            return False
        if func is torch.ops.aten._local_scalar_dense.default:
            return True
        return func is torch.ops.aten._to_copy.default and (kwargs.get("device") or src.device).type == "cpu"


@contextlib.contextmanager
def fake_cuda():
    """with fake_cuda() as real: ... -- fake CUDA tensors with real values; real.host_reads counts reads."""
    no_op_cuda_guard()
    with FakeTensorMode(allow_non_fake_inputs=True), RealValues() as real:
        yield real


def model_to(model: pocketllm.Model, device: torch.device) -> pocketllm.Model:
    """Move a loaded Model's weights to `device` (inside fake_cuda: fake CUDA copies of the real weights)."""
    model.layers = [pocketllm._to_device(L, device, model.dtype) for L in model.layers]   # returns a copy
    if model.mtp is not None:
        model.mtp = pocketllm._to_device(model.mtp, device, model.dtype)
        model.cache_layers = model.layers + [model.mtp.layer]
    model.embed_tokens = model.embed_tokens.to(device)
    model.lm_head = model.lm_head.to(device, model.dtype)
    model.norm, model.inv_freq, model.device = model.norm.to(device), model.inv_freq.to(device), device
    return model


class HostWorkInCapture(AssertionError):
    """An op inside a captured step that a CUDA graph could not replay with fresh data: a read of device data
    on the host, or a copy from host memory (baked into the graph at capture)."""


class OpGraph:
    """A stand-in for torch.cuda.CUDAGraph, for DecodeGraphs(graph=...) on the CPU and on fake CUDA: capture()
    records every torch op the step dispatches, with its very tensors (a graph's kernels and addresses), and
    refuses host reads and host-to-device copies inside it (HostWorkInCapture); replay() runs the recorded ops
    again on those tensors, writing each op's result into the tensor it made at capture. So a step whose replay
    gives the eager step's results read only its static inputs, as a CUDA graph requires; a value taken from
    the host at capture would be replayed stale. Unlike CUDA's capture this one runs the step
    (runs_on_capture). `opaque(fn)`: a call recorded whole and rerun at replay (the torch backend's forward,
    which reads the host; the native one is captured for real on a GPU). `real`: fake_cuda's RealValues."""
    runs_on_capture = True
    capturing: "OpGraph | None" = None

    def __init__(self, real: RealValues | None = None):
        self.real, self.ops, self.paused = real, [], False

    @contextlib.contextmanager
    def capture(self):
        OpGraph.capturing = self
        try:
            with _Recorder(self):
                yield
        finally:
            OpGraph.capturing = None

    def replay(self):
        for func, args, kwargs, out in self.ops:
            fresh = func(*args, **kwargs)
            if not isinstance(func, torch._ops.OpOverload) or all(r.alias_info is None for r in func._schema.returns):
                self._copy_into(out, fresh)        # views and in-place ops: their recorded tensors saw it already

    def _value(self, t: torch.Tensor) -> torch.Tensor:
        return self.real.value(t) if isinstance(t, FakeTensor) else t

    def _copy_into(self, recorded, fresh):
        for old, new in zip(tree_flatten(recorded)[0], tree_flatten(fresh)[0]):
            if isinstance(old, torch.Tensor) and old is not new:
                with _disable_current_modes():
                    self._value(old).copy_(self._value(new))

    @staticmethod
    def opaque(fn):
        def call(*args, **kwargs):
            graph = OpGraph.capturing
            if graph is None or graph.paused:
                return fn(*args, **kwargs)
            graph.paused = True
            try:
                out = fn(*args, **kwargs)
            finally:
                graph.paused = False
            graph.ops.append((fn, args, kwargs, out))
            return out
        return call


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: OpGraph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.graph.paused:
            return func(*args, **kwargs)
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        devices = {t.device.type for t in flat}
        if isinstance(kwargs.get("device"), torch.device):
            devices.add(kwargs["device"].type)
        if func is torch.ops.aten._local_scalar_dense.default or RealValues._reads_host(func, args, kwargs):
            raise HostWorkInCapture(f"{func} reads device data on the host inside a captured step")
        if "cuda" in devices and any(t.device.type == "cpu" and t.dim() > 0 for t in flat):
            raise HostWorkInCapture(f"{func} copies host memory into a captured step")
        out = func(*args, **kwargs)
        self.graph.ops.append((func, args, kwargs, out))
        return out
