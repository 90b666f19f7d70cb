"""The real CUDA build: `python build.py` with this machine's nvcc (sm_75 + sm_90 + PTX) exports exactly the
functions csrc/pocketllm.h declares, is cached, and without a GPU loads but refuses a device clearly.

The build starts in the background at low priority as collection ends (conftest.py) and takes minutes of CPU;
this module's name sorts it last, so the rest of the suite runs meanwhile and these tests rarely wait.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import build as builder
import pocketllm
from test_native_build import declared_functions, exported_functions


@pytest.fixture(scope="session")
def cuda_build() -> Path:
    if not builder.find_nvcc():
        pytest.skip("nvcc not found: the CUDA build cannot be checked here")
    return builder.build(arch=builder.DEFAULT_ARCH, quiet=True)


def test_cuda_build_exports_exactly_the_abi(cuda_build):
    exported = exported_functions(cuda_build)
    assert declared_functions() <= exported, f"declared but not exported: {declared_functions() - exported}"
    # Nothing else leaks: in particular not the statically linked CUDA runtime, which would clash with torch's.
    assert exported == declared_functions(), f"exported beyond the ABI: {sorted(exported - declared_functions())}"


def test_cuda_build_is_cached_and_targets_both_archs(cuda_build):
    builder.build(arch=builder.DEFAULT_ARCH, quiet=True)     # up to date with the sources as they are now
    before = cuda_build.stat().st_mtime_ns
    assert builder.build(arch=builder.DEFAULT_ARCH, quiet=True) == cuda_build
    assert cuda_build.stat().st_mtime_ns == before          # nothing changed, nothing rebuilt
    flags = " ".join(builder.compile_command(False, builder.DEFAULT_ARCH, Path("x.cu"), Path("x.o")))
    assert "code=sm_75" in flags and "code=sm_90" in flags and "code=compute_75" in flags
    data = cuda_build.read_bytes()
    assert b"sm_75" in data and b"sm_90" in data            # the embedded cubins name their targets


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU; tests/gpu covers it")
def test_without_gpu_a_device_is_refused_clearly_and_auto_picks_torch(cuda_build):
    lib = pocketllm.load_native()
    assert lib.lib.pl_abi_version() == pocketllm.NATIVE_ABI_VERSION and not lib.is_cpu_build
    with pytest.raises(pocketllm.PocketError, match="no usable GPU|no CUDA-capable device"):
        lib.device_count()
    ok, why = pocketllm.native_status("cuda")
    assert not ok and "pl_device_count" in why
    ops, reason = pocketllm.select_ops(pocketllm.EngineOptions(backend="auto", device="cuda"), torch.device("cuda"))
    assert ops.name == "torch" and "no usable GPU" in reason
    with pytest.raises(pocketllm.PocketError, match="--backend native: .*no usable GPU"):
        pocketllm.select_ops(pocketllm.EngineOptions(backend="native", device="cuda"), torch.device("cuda"))
