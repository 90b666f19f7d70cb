"""Deliberately broken kernels are caught on the CPU build (issue 10).

The case copies csrc/ to a temporary directory and rewrites three places of csrc/linear.cu so that each can be
broken at run time: the original code stays, next to its broken form, chosen by the PL_MUTANT environment variable
as the kernel runs (unset: the original). One CPU library is built from it (only linear.cu recompiles; the rest
comes from the object cache: one compile instead of one per mutant, which kept the suite a minute longer), and
the per-op check runs under each setting: the linear op through NativeOps against a float64 reference, with the
fp16/fp32 tolerances of tests/test_native_ops.py. The unbroken library and the switchable one with no mutant
switched on pass the same check (the controls), every mutant fails it.

The three mutations:
- a removed __syncthreads() after staging the tensor-core GEMM's shared-memory tiles (a race: warps read
  tiles others have not written yet; also visible as a difference between two fiber schedules);
- an off-by-one in the fp32 tiled GEMM's K-tile loop (`k0 + TK < K`: the last K tile is dropped);
- a wrong mma fragment index (A's second register read from row g instead of row g + 8).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import build as builder  # noqa: E402
import pocketllm  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}   # max |out - ref| / max |ref|, as in test_native_ops.py

# name: (the original text, found once in csrc/linear.cu; the same with the mutation behind mutant(name); dtype)
MUTANTS = {
    "missing_syncthreads": (
        "      stage_tiles<FP8, VEC>(x, T, K, w, N, m0, n0, k0, xs, ws);\n      __syncthreads();\n",
        "      stage_tiles<FP8, VEC>(x, T, K, w, N, m0, n0, k0, xs, ws);\n"
        "      if (!pl_mutant(\"missing_syncthreads\")) __syncthreads();\n",
        torch.float16),
    "off_by_one_tile_loop": (
        "for (int k0 = 0; k0 < K; k0 += TK) {",
        "for (int k0 = 0; k0 + (pl_mutant(\"off_by_one_tile_loop\") ? TK : 0) < K; k0 += TK) {",
        torch.float32),
    "wrong_fragment_index": (
        "a[mi][1] = *(const uint32_t*)&xs[wm + mi * 16 + g + 8][ks + 2 * t];",
        "a[mi][1] = *(const uint32_t*)&xs[wm + mi * 16 + g + (pl_mutant(\"wrong_fragment_index\") ? 0 : 8)]"
        "[ks + 2 * t];",
        torch.float16),
}

# Read as the kernel runs (the CPU build's kernels are host code), so one library carries every mutant.
SWITCH = '''#include <cstdlib>
#include <cstring>
static bool pl_mutant(const char* name) { const char* m = getenv("PL_MUTANT"); return m && !strcmp(m, name); }
'''


def build_switchable(tmp: Path) -> pocketllm.NativeLibrary:
    """The CPU library from csrc/ with every mutation of MUTANTS behind its PL_MUTANT switch in linear.cu."""
    src = tmp / "csrc"
    src.mkdir(parents=True)
    for path in (ROOT / "csrc").iterdir():
        if path.suffix in (".cuh", ".h") or path.name in ("linear.cu", "runtime.cu"):   # what pl_linear needs
            shutil.copyfile(path, src / path.name)
    text = (src / "linear.cu").read_text()
    for name, (old, new, _) in MUTANTS.items():
        assert text.count(old) == 1, f"mutation target of {name} not found once in csrc/linear.cu: {old!r}"
        text = text.replace(old, new)
    (src / "linear.cu").write_text(SWITCH + text)
    out = builder.build(cpu=True, src_dir=src, out_dir=tmp / "build", obj_dir=ROOT / "build" / "obj", quiet=True)
    return pocketllm.NativeLibrary(out)


@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, pocketllm.NativeLibrary]:
    """"control": the library of csrc/ as it is; "switchable": the one carrying the mutants."""
    return {"control": pocketllm.NativeLibrary(builder.build(cpu=True, quiet=True)),
            "switchable": build_switchable(tmp_path_factory.mktemp("mutants"))}


def fp8_linear(N: int, K: int, gen: torch.Generator) -> pocketllm.Linear:
    """A random FP8 linear with ragged 128x128 scale blocks (N, K not multiples of 128)."""
    weight = (torch.randn(N, K, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    scale = torch.rand((N + 127) // 128, (K + 127) // 128, generator=gen) * 0.02 + 0.01
    return pocketllm.Linear(weight=weight, scale=scale)


def linear_error(lib: pocketllm.NativeLibrary, act: torch.dtype) -> float:
    """max |native - float64 reference| / max |reference| for a prefill-sized linear (T > 16: GEMM paths)."""
    gen = torch.Generator().manual_seed(7)
    T, K, N = 72, 300, 200                                  # two M tiles, ragged K and N
    w = fp8_linear(N, K, gen)
    x = torch.randn(T, K, generator=gen).to(act)
    ref = x.double() @ pocketllm.dequantize(w, torch.float64).t()
    ops = pocketllm.NativeOps("cpu", lib=lib)
    out = ops.linear(x, w)
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def test_controls_pass_the_per_op_check(libs, monkeypatch):
    monkeypatch.delenv("PL_MUTANT", raising=False)
    for act in (torch.float32, torch.float16):
        assert linear_error(libs["control"], act) < TOL[act]
        assert linear_error(libs["switchable"], act) < TOL[act]


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_each_mutant_is_caught(libs, name, monkeypatch):
    monkeypatch.setenv("PL_MUTANT", name)
    act = MUTANTS[name][2]
    err = linear_error(libs["switchable"], act)
    assert err > 10 * TOL[act], f"{name}: relative error {err:.2e} slipped under the per-op tolerance"


def test_missing_barrier_also_shows_as_a_schedule_difference(libs, monkeypatch):
    """Without any reference: the same launch under two fiber schedules disagrees when a barrier is missing."""
    def run(mutant, schedule):
        monkeypatch.setenv("PL_MUTANT", mutant)
        monkeypatch.setenv("PL_EMU_SCHEDULE", schedule)
        gen = torch.Generator().manual_seed(3)
        w = fp8_linear(128, 64, gen)
        x = torch.randn(64, 64, generator=gen).half()
        return pocketllm.NativeOps("cpu", lib=libs["switchable"]).linear(x, w)

    assert torch.equal(run("", "forward"), run("", "reverse"))
    assert not torch.equal(run("missing_syncthreads", "forward"), run("missing_syncthreads", "reverse"))
