"""Deliberately broken kernels are caught on the CPU build (issue 10).

Each case copies csrc/ to a temporary directory, breaks csrc/linear.cu by one text substitution, builds the
CPU library from it (only the mutated file recompiles; the rest comes from the object cache) and runs the
per-op check: the linear op through NativeOps against a float64 reference, with the fp16/fp32 tolerances of
tests/test_native_ops.py. The unbroken library passes the same check (the control), every mutant fails it.

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

MUTANTS = {
    "missing_syncthreads": (
        "      stage_tiles<FP8, VEC>(x, T, K, w, N, m0, n0, k0, xs, ws);\n      __syncthreads();\n",
        "      stage_tiles<FP8, VEC>(x, T, K, w, N, m0, n0, k0, xs, ws);\n",
        torch.float16),
    "off_by_one_tile_loop": (
        "for (int k0 = 0; k0 < K; k0 += TK) {",
        "for (int k0 = 0; k0 + TK < K; k0 += TK) {",
        torch.float32),
    "wrong_fragment_index": (
        "a[mi][1] = *(const uint32_t*)&xs[wm + mi * 16 + g + 8][ks + 2 * t];",
        "a[mi][1] = *(const uint32_t*)&xs[wm + mi * 16 + g][ks + 2 * t];",
        torch.float16),
}


def build_variant(tmp: Path, name: str, mutation: tuple[str, str] | None) -> pocketllm.NativeLibrary:
    """The CPU library from csrc/ with `mutation` (old, new) applied once to linear.cu."""
    src = tmp / name / "csrc"
    src.mkdir(parents=True)
    for path in (ROOT / "csrc").iterdir():
        if path.suffix in (".cuh", ".h") or path.name in ("linear.cu", "runtime.cu"):   # what pl_linear needs
            shutil.copyfile(path, src / path.name)
    if mutation:
        old, new = mutation
        text = (src / "linear.cu").read_text()
        assert text.count(old) == 1, f"mutation target of {name} not found once in csrc/linear.cu: {old!r}"
        (src / "linear.cu").write_text(text.replace(old, new))
    out = builder.build(cpu=True, src_dir=src, out_dir=tmp / name / "build", obj_dir=ROOT / "build" / "obj",
                        quiet=True)
    return pocketllm.NativeLibrary(out)


@pytest.fixture(scope="module")
def variants(tmp_path_factory) -> dict[str, pocketllm.NativeLibrary]:
    tmp = tmp_path_factory.mktemp("mutants")
    libs = {"control": build_variant(tmp, "control", None)}
    for name, (old, new, _) in MUTANTS.items():
        libs[name] = build_variant(tmp, name, (old, new))
    return libs


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


def test_control_passes_the_per_op_check(variants):
    for act in (torch.float32, torch.float16):
        assert linear_error(variants["control"], act) < TOL[act]


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_each_mutant_is_caught(variants, name):
    act = MUTANTS[name][2]
    err = linear_error(variants[name], act)
    assert err > 10 * TOL[act], f"{name}: relative error {err:.2e} slipped under the per-op tolerance"


def test_missing_barrier_also_shows_as_a_schedule_difference(variants, monkeypatch):
    """Without any reference: the same launch under two fiber schedules disagrees when a barrier is missing."""
    def run(name, schedule):
        monkeypatch.setenv("PL_EMU_SCHEDULE", schedule)
        gen = torch.Generator().manual_seed(3)
        w = fp8_linear(128, 64, gen)
        x = torch.randn(64, 64, generator=gen).half()
        return pocketllm.NativeOps("cpu", lib=variants[name]).linear(x, w)

    assert torch.equal(run("control", "forward"), run("control", "reverse"))
    assert not torch.equal(run("missing_syncthreads", "forward"), run("missing_syncthreads", "reverse"))
