"""The native library builds, exports its C ABI, and fails clearly where it cannot run (CI has no GPU).

- the CPU test build compiles, loads through the same cffi path, and says NCCL is unavailable;
- the build's options (another nvcc, another CUDA runtime) key its cache;
- the real CUDA build (`python build.py` with this machine's nvcc) is checked in tests/test_with_nvcc.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import build as builder  # noqa: E402
import pocketllm  # noqa: E402


def declared_functions() -> set[str]:
    cdef = pocketllm.native_cdef((ROOT / "csrc" / "pocketllm.h").read_text())
    return set(re.findall(r"\b(pl_\w+)\s*\(", cdef))


def exported_functions(lib: Path) -> set[str]:
    nm = shutil.which("nm")
    if not nm:
        pytest.skip("nm (binutils) not found")
    out = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.split()[1:2] == ["T"]}


@pytest.fixture(scope="session")
def cpu_build() -> Path:
    return builder.build(cpu=True, quiet=True)


def test_header_is_plain_c_for_cffi():
    cdef = pocketllm.native_cdef((ROOT / "csrc" / "pocketllm.h").read_text())
    assert not [line for line in cdef.splitlines() if line.strip().startswith("#")]
    assert {"pl_abi_version", "pl_last_error", "pl_device_count", "pl_nccl_all_reduce_sum"} <= declared_functions()
    import cffi
    cffi.FFI().cdef(cdef)                                   # parses


def test_cpu_device_uses_the_cpu_build_only_when_asked(cpu_build, monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("POCKETLLM_NATIVE_CPU", raising=False)
    ops, reason = pocketllm.select_ops(pocketllm.EngineOptions(backend="auto"), cpu)
    assert ops.name == "torch" and "needs a CUDA device" in reason
    monkeypatch.setenv("POCKETLLM_NATIVE_CPU", "1")
    ops, reason = pocketllm.select_ops(pocketllm.EngineOptions(backend="native"), cpu)
    assert ops.name == "native" and ops.lib.is_cpu_build


def test_missing_library_says_how_to_build(monkeypatch, tmp_path):
    monkeypatch.setenv("POCKETLLM_NATIVE_LIB", str(tmp_path / "libpocketllm.so"))
    ok, why = pocketllm.native_status("cuda")
    assert not ok and "not found" in why and "python build.py" in why


def test_abi_version_mismatch_is_refused(cpu_build, monkeypatch):
    monkeypatch.setattr(pocketllm, "NATIVE_ABI_VERSION", pocketllm.NATIVE_ABI_VERSION + 1)
    with pytest.raises(pocketllm.PocketError, match="ABI version"):
        pocketllm.NativeLibrary(cpu_build)


def test_cpu_build_loads_through_the_same_path(cpu_build):
    assert exported_functions(cpu_build) >= declared_functions()
    lib = pocketllm.load_native(cpu_build=True)
    assert lib.is_cpu_build and lib.path == cpu_build.resolve()
    with pytest.raises(pocketllm.PocketError, match="CPU test build"):
        lib.device_count()
    ops = pocketllm.NativeOps("cpu")
    assert ops.nccl_available() is False
    with pytest.raises(pocketllm.PocketError, match="tensor parallelism needs NCCL: .*not available in the CPU"):
        ops.nccl_unique_id()
    # an op end to end, and the error path with the library's message
    x, w = torch.randn(3, 64), torch.randn(64)
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    torch.testing.assert_close(ops.rmsnorm(x, w, 1e-6), ref, rtol=1e-5, atol=1e-5)
    xt = x.t().contiguous().t()                             # a strided view of the same values is accepted
    torch.testing.assert_close(ops.rmsnorm(xt, w, 1e-6), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(pocketllm.PocketError, match="must be contiguous"):
        ops.add_rmsnorm(x, torch.zeros(64, 3).t(), w, 1e-6)   # but a tensor written in place must be contiguous
    with pytest.raises(pocketllm.NativeError, match=r"pl_\w+ \(\w+\.cu:\d+\)"):
        ops.rmsnorm(x.long(), w, 1e-6)                      # an activation dtype the library refuses


PROMPTS = [[5 + (i * 7 + j * 13) % 380 for j in range(3 + 12 * i)] for i in range(3)]   # 3, 15, 27 tokens


def test_cpu_build_greedy_parity_end_to_end(ckpt_factory, cpu_build, monkeypatch):
    """The whole model through NativeOps on the CPU build (fp32) gives the torch backend's greedy tokens for 32
    steps: one prompt alone, then all three batched with chunked prefill (an 8-token budget splits prompts)."""
    path, _ = ckpt_factory("qwen3_5", fp8=True)
    monkeypatch.setenv("POCKETLLM_NATIVE_CPU", "1")
    opts = {"quiet": True, "max_context": 128, "max_batch_size": 4}
    sampling = {"max_tokens": 32, "temperature": 0, "ignore_eos": True}
    torch_llm = pocketllm.LLM(path, backend="torch", **opts)
    native_llm = pocketllm.LLM(path, backend="native", prefill_token_budget=8, **opts)
    assert native_llm.model.ops.name == "native" and native_llm.model.ops.lib.is_cpu_build
    expect = [torch_llm.generate(p, **sampling)["token_ids"] for p in PROMPTS]
    assert all(len(e) == 32 for e in expect)
    assert native_llm.generate(PROMPTS[2], **sampling)["token_ids"] == expect[2]
    streams = [native_llm.submit(p, pocketllm.SamplingParams(**sampling)) for p in PROMPTS]
    assert [[t for ev in s for t in ev.token_ids] for s in streams] == expect


def test_native_ops_refuse_what_the_kernels_cannot_read(cpu_build):
    """A KV cache in another dtype than the activations, or FP8 blocks other than 128x128, would be misread
    by the kernels: NativeOps refuses them with a clear error instead."""
    ops = pocketllm.NativeOps("cpu")
    q = torch.randn(2, 2, 16)
    cache = torch.zeros(1, 16, 1, 16, dtype=torch.float16)
    with pytest.raises(pocketllm.PocketError, match="KV cache in the activation dtype"):
        ops.attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2], dtype=torch.int32),
                      torch.tensor([0, 2], dtype=torch.int32), 0.25)
    w = pocketllm.Linear(torch.zeros(64, 64, dtype=torch.float8_e4m3fn), torch.ones(1, 1), (64, 64))
    with pytest.raises(pocketllm.PocketError, match="128x128 weight blocks"):
        ops.linear(torch.randn(1, 64), w)


# ---- Drivers and toolkits: the library names the driver it needs; build.py builds against another toolkit. ----

def test_old_driver_is_refused_naming_the_minimum(cpu_build, monkeypatch):
    """The CPU build stands for the CUDA 13.0 runtime, and its test hook PL_EMU_DRIVER_VERSION simulates the
    driver: one that supports only CUDA 12.4 is refused in one line naming driver 580.65.06, and `auto` falls back
    to torch saying so (the CUDA build runs the same check with the real driver's version)."""
    lib = pocketllm.load_native(cpu_build=True)
    monkeypatch.delenv("PL_EMU_DRIVER_VERSION", raising=False)
    assert lib.cuda_versions() == (13000, 13000)
    monkeypatch.setenv("PL_EMU_DRIVER_VERSION", "12040")
    assert lib.cuda_versions() == (12040, 13000)
    with pytest.raises(pocketllm.NativeError, match=r"the NVIDIA driver supports CUDA 12\.4, but this library carries "
                                                    r"the CUDA 13\.0 runtime, which needs driver 580\.65\.06 or newer"):
        lib.device_count()
    assert "\n" not in lib.last_error() and "--nvcc" in lib.last_error()
    monkeypatch.setattr(pocketllm, "load_native", lambda cpu_build=False: lib)   # stands in for the CUDA build
    ok, why = pocketllm.native_status("cuda")
    assert not ok and "580.65.06" in why
    ops, reason = pocketllm.select_ops(pocketllm.EngineOptions(backend="auto", device="cuda"), torch.device("cuda"))
    assert ops.name == "torch" and "driver 580.65.06 or newer" in reason
    monkeypatch.setenv("PL_EMU_DRIVER_VERSION", "13020")                         # a newer driver passes the check
    with pytest.raises(pocketllm.NativeError, match="CPU test build"):
        lib.device_count()


FAKE_NVCC = """#!/bin/sh
case "$*" in *--version*) echo "Cuda compilation tools, release $FAKE_CUDA, V$FAKE_CUDA.1"; exit 0;; esac
echo "$*" >> "$FAKE_LOG"
while [ $# -gt 0 ]; do if [ "$1" = "-o" ]; then echo fake > "$2"; fi; shift; done
"""


def test_build_with_another_toolkit(tmp_path, monkeypatch):
    """--nvcc picks the compiler, --cudart links that runtime directory's static cudart, and the toolkit's
    version keys the cache: a library built with CUDA 12.4 is not taken for a CUDA 13.0 one, or vice versa.
    (A stand-in nvcc records the commands; the real CUDA 12 build is described in docs/abi.md.)"""
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(0o755)
    log = tmp_path / "commands.log"
    monkeypatch.setenv("FAKE_LOG", str(log))
    monkeypatch.setenv("FAKE_CUDA", "12.4")
    rt = tmp_path / "nvidia" / "cuda_runtime"
    out_dir = tmp_path / "out"
    lib = builder.build(nvcc=str(nvcc), cudart=rt, out_dir=out_dir, quiet=True)
    commands = log.read_text().splitlines()
    assert len(commands) == len(list((ROOT / "csrc").glob("*.cu"))) + 1                  # each source, one link
    assert all(f"-I {rt / 'include'}" in c for c in commands[:-1])
    assert f"-cudart none {rt / 'lib' / 'libcudart_static.a'}" in commands[-1]
    assert lib.with_name(lib.name + ".stamp").read_text().splitlines()[1] == "cuda 12.4"
    builder.build(nvcc=str(nvcc), cudart=rt, out_dir=out_dir, quiet=True)
    assert len(log.read_text().splitlines()) == len(commands)                           # up to date: nothing ran
    monkeypatch.setenv("FAKE_CUDA", "13.0")
    builder.build(nvcc=str(nvcc), cudart=rt, out_dir=out_dir, quiet=True)
    assert len(log.read_text().splitlines()) == 2 * len(commands)                       # another toolkit: rebuilt
    with pytest.raises(builder.BuildError, match="nvcc not found at"):
        builder.build(nvcc=str(tmp_path / "missing"), out_dir=tmp_path / "out2", quiet=True)
