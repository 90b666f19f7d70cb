"""The CPU execution layer (csrc/runtime.cuh) against hand-computed small cases.

The kernels in tests/emu/emu_kernels.cu use the ordinary CUDA spellings; here they run on the CPU build, and
(parametrized "cuda") through nvcc on a real GPU when one is present, so the emulated mma / ldmatrix fragment
layouts, conversions and warp operations are checked against both the PTX ISA's documented layouts and the
hardware. Misuse (divergent barriers, bad masks, shared-memory overflow, races) must be reported, not hang.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import build as builder  # noqa: E402

EMU_SRC = ROOT / "tests" / "emu" / "emu_kernels.cu"


def stage_sources(dest: Path) -> Path:
    """csrc's runtime files plus the test kernels in one stable directory (so object caching works)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("runtime.cu", "runtime.cuh", "pocketllm.h"):
        shutil.copyfile(ROOT / "csrc" / name, dest / name)
    shutil.copyfile(EMU_SRC, dest / "emu_kernels.cu")
    return dest


def emu_cdef() -> str:
    header = (ROOT / "csrc" / "pocketllm.h").read_text()
    begin, end = "/* ---- cdef begin ---- */", "/* ---- cdef end ---- */"
    text = EMU_SRC.read_text()
    decls = text[text.index('extern "C" {') + len('extern "C" {'):text.index("}\n#pragma GCC visibility pop")]
    return header[header.index(begin) + len(begin):header.index(end)] + decls


class EmuLib:
    """The test library on one device; `run(name, *args)` asserts a zero status."""

    def __init__(self, path: Path, device: str):
        import cffi
        self.ffi = cffi.FFI()
        self.ffi.cdef(emu_cdef())
        self.lib = self.ffi.dlopen(str(path))
        self.device = device

    def error(self) -> str:
        return self.ffi.string(self.lib.pl_last_error()).decode()

    def status(self, name, *args) -> int:
        args = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        return getattr(self.lib, name)(*args)

    def run(self, name, *args) -> None:
        rc = self.status(name, *args)
        assert rc == 0, self.error()


@pytest.fixture(scope="session")
def cpu_lib() -> EmuLib:
    src = stage_sources(ROOT / "build" / "emu-test" / "src")
    return EmuLib(builder.build(cpu=True, src_dir=src, out_dir=ROOT / "build" / "emu-test", quiet=True), "cpu")


@pytest.fixture(scope="session")
def cuda_lib() -> EmuLib:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: the wrappers' GPU versions are checked by tests/gpu/check.sh")
    if not builder.find_nvcc():
        pytest.skip("nvcc not found")
    major, minor = torch.cuda.get_device_capability()
    src = stage_sources(ROOT / "build" / "emu-test-gpu" / "src")
    out = builder.build(arch=f"{major}{minor}", src_dir=src, out_dir=ROOT / "build" / "emu-test-gpu", quiet=True)
    return EmuLib(out, "cuda")


@pytest.fixture(params=["cpu", "cuda"])
def emu(request) -> EmuLib:
    return request.getfixturevalue(f"{request.param}_lib")


# ---- Fragment layouts of the PTX ISA (mma.m16n8k8 .f16, ldmatrix .m8n8 .b16), written out independently ----

def pack_halves(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Two fp16 tensors -> uint32 words (as int64) with `lo` in bits 0..15."""
    lo_bits = lo.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    hi_bits = hi.to(torch.float16).view(torch.int16).to(torch.int64) & 0xFFFF
    return lo_bits | (hi_bits << 16)


def mma_fragments(A, B, C):
    """Per-lane registers: a (32, 2), b (32,), c (32, 4) for A (16, 8), B (8, 8), C (16, 8)."""
    a, b, c = [], [], []
    for lane in range(32):
        g, t = lane // 4, lane % 4
        a.append([pack_halves(A[g, 2 * t], A[g, 2 * t + 1]), pack_halves(A[g + 8, 2 * t], A[g + 8, 2 * t + 1])])
        b.append(pack_halves(B[2 * t, g], B[2 * t + 1, g]))
        c.append([C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]])
    return (torch.tensor(a, dtype=torch.int64).to(torch.int32), torch.tensor(b, dtype=torch.int64).to(torch.int32),
            torch.tensor(c, dtype=torch.float32))


def run_mma(emu: EmuLib, A, B, C) -> torch.Tensor:
    a, b, c = (x.to(emu.device) for x in mma_fragments(A, B, C))
    d = torch.full((32, 4), float("nan"), device=emu.device)
    emu.run("emu_mma", a, b, c, d)
    return d.cpu()


def test_mma_hand_computed(emu):
    A = torch.arange(128, dtype=torch.float32).reshape(16, 8)   # A[i][k] = 8i + k
    B = torch.eye(8)                                            # D = A + C
    C = torch.zeros(16, 8)
    d = run_mma(emu, A, B, C)
    assert d[0].tolist() == [0.0, 1.0, 64.0, 65.0]              # lane 0: g=0, t=0: D[0][0:2], D[8][0:2]
    assert d[5].tolist() == [10.0, 11.0, 74.0, 75.0]            # lane 5: g=1, t=1: D[1][2:4], D[9][2:4]
    assert d[31].tolist() == [62.0, 63.0, 126.0, 127.0]         # lane 31: g=7, t=3: D[7][6:8], D[15][6:8]
    B2 = torch.zeros(8, 8)
    B2[3, 0] = 2.0                                              # column 0 of D = 2 * A[:, 3]
    C2 = torch.full((16, 8), 0.25)
    d2 = run_mma(emu, A, B2, C2)
    assert d2[4].tolist() == [2 * 11 + 0.25, 0.25, 2 * 75 + 0.25, 0.25]   # lane 4: g=1, t=0


def test_mma_random(emu):
    gen = torch.Generator().manual_seed(1)
    A = torch.randn(16, 8, generator=gen).half().float()
    B = torch.randn(8, 8, generator=gen).half().float()
    C = torch.randn(16, 8, generator=gen)
    D = (A.double() @ B.double() + C.double()).float()
    _, _, expect = mma_fragments(D, D, D)                        # D's fragment layout is C's
    torch.testing.assert_close(run_mma(emu, A, B, C), expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("nmat,trans", [(4, 0), (4, 1), (2, 0), (2, 1)])
def test_ldmatrix(emu, nmat, trans):
    tile = torch.arange(256, dtype=torch.int32).reshape(32, 8)  # element (r, c) of the stack = 8r + c
    out = torch.zeros(32, 4, dtype=torch.int32)
    out_dev = out.to(emu.device)
    emu.run("emu_ldmatrix", tile.to(torch.int16).to(emu.device), nmat, trans, out_dev)
    got = out_dev.cpu().to(torch.int64) & 0xFFFFFFFF
    for lane in range(32):
        for i in range(nmat):
            if trans:   # {M_i[2(l%4)][l/4], M_i[2(l%4)+1][l/4]}
                lo, hi = (8 * i + 2 * (lane % 4)) * 8 + lane // 4, (8 * i + 2 * (lane % 4) + 1) * 8 + lane // 4
            else:       # {M_i[l/4][2(l%4)], M_i[l/4][2(l%4)+1]}
                lo = (8 * i + lane // 4) * 8 + 2 * (lane % 4)
                hi = lo + 1
            assert got[lane, i].item() == lo | (hi << 16), (lane, i)
    if not trans:
        assert got[5, 1].item() == 74 | (75 << 16)              # hand-computed: matrix 1, row 1, cols 2-3
    else:
        assert got[5, 1].item() == 81 | (89 << 16)              # matrix 1, rows 2-3, col 1


def test_e4m3_every_byte(emu):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, device=emu.device)
    emu.run("emu_e4m3", codes.to(emu.device), out, 256)
    expect = codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(out.cpu().isnan(), expect.isnan()) and expect.isnan().sum() == 2   # 0x7f and 0xff
    finite = ~expect.isnan()
    assert torch.equal(out.cpu()[finite], expect[finite])
    assert out.cpu()[0x7e].item() == 448.0 and out.cpu()[0x01].item() == 2.0 ** -9   # max and min subnormal


def test_e4m3x2_to_half2_is_value_times_2_pow_minus_8(emu):
    pairs = torch.arange(65536, dtype=torch.int32)
    out = torch.zeros(65536, dtype=torch.int32, device=emu.device)
    emu.run("emu_e4m3x2", pairs.to(torch.int16).to(emu.device), out, 65536)
    words = out.cpu().to(torch.int64) & 0xFFFFFFFF
    lo = (words & 0xFFFF).to(torch.int16).view(torch.float16).float()
    hi = (words >> 16).to(torch.int16).view(torch.float16).float()
    dec = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    exp_lo, exp_hi = dec[pairs & 0xFF] / 256, dec[pairs >> 8] / 256
    ok = ~(exp_lo.isnan() | exp_hi.isnan())                     # NaN bytes are documented as not preserved
    assert torch.equal(lo[ok], exp_lo[ok]) and torch.equal(hi[ok], exp_hi[ok])


FP16_CASES = [1.0, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, -(1.0 + 2 ** -10), 65504.0, 65519.0, 65520.0, 1e6,
              2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -26, -0.0, float("inf"), float("-inf"), 0.1, -3.14159]


def test_fp16_round_to_nearest_even(emu):
    x = torch.tensor(FP16_CASES + torch.randn(1000, generator=torch.Generator().manual_seed(2)).mul(100).tolist())
    bits = torch.zeros(len(x), dtype=torch.int16, device=emu.device)
    back = torch.empty(len(x), device=emu.device)
    emu.run("emu_fp16", x.to(emu.device), bits, back, len(x))
    assert torch.equal(bits.cpu(), x.half().view(torch.int16))
    got = back.cpu()
    # hand-computed: ties go to the even mantissa; 65520 and beyond overflow; 2^-25 ties to zero
    assert got[1].item() == 1.0 and got[2].item() == 1.0 + 2 ** -9
    assert got[5].item() == 65504.0 and got[6].item() == float("inf") and got[7].item() == float("inf")
    assert got[8].item() == 2.0 ** -24 and got[9].item() == 0.0 and got[10].item() == 2.0 ** -23
    assert str(got[12].item()) == "-0.0"


def test_bf16_round_to_nearest_even(emu):
    x = torch.tensor(FP16_CASES + [float("nan"), 3e38, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8])
    bits = torch.zeros(len(x), dtype=torch.int16, device=emu.device)
    back = torch.empty(len(x), device=emu.device)
    emu.run("emu_bf16", x.to(emu.device), bits, back, len(x))
    expect = x.bfloat16()
    got = bits.cpu().view(torch.bfloat16)
    assert torch.equal(got.isnan(), expect.isnan())
    assert torch.equal(got[~expect.isnan()].float(), expect[~expect.isnan()].float())
    assert back.cpu()[-2].item() == 1.0 and back.cpu()[-1].item() == 1.0 + 2 ** -6


def test_warp_shuffles_and_votes(emu):
    n = 64
    v = torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    v[40] = 12345                                               # only warp 1 has it
    out = torch.zeros(12, n, dtype=torch.int32, device=emu.device)
    emu.run("emu_warp_ops", v.to(emu.device), out, n)
    got, vals = out.cpu(), v.tolist()

    def at(t, src_lane):
        return vals[(t // 32) * 32 + src_lane]

    for t in range(n):
        lane = t % 32
        b8, b4, b16 = lane & ~7, lane & ~3, lane & ~15
        warp = vals[(t // 32) * 32:(t // 32) * 32 + 32]
        expect = [
            at(t, (lane * 7 + 3) & 31),
            at(t, lane - 3) if lane >= 3 else vals[t],
            at(t, lane + 5) if lane + 5 < 32 else vals[t],
            at(t, lane ^ 6),
            at(t, b8 + 2),
            at(t, lane - 1) if lane - b4 >= 1 else vals[t],
            at(t, lane + 2) if lane - b16 + 2 < 16 else vals[t],
            at(t, lane ^ 9) if (lane ^ 9) < b8 + 8 else vals[t],
            sum(1 << i for i, w in enumerate(warp) if w & 1) - (1 << 32 if warp[31] & 1 else 0),
            int(12345 in warp),
            1,
            at(t, lane ^ 1),
        ]
        assert got[:, t].tolist() == expect, t


@pytest.mark.parametrize("nthreads", [96, 1024])
def test_block_barrier(emu, nthreads):
    rounds = 3
    out = torch.full((2 * nthreads,), float("nan"), device=emu.device)
    emu.run("emu_barrier", out, nthreads, rounds)
    acc = [float(t) for t in range(nthreads)]
    for _ in range(rounds):
        acc = [acc[t] + 0.5 * acc[(t + 1) % nthreads] for t in range(nthreads)]
    assert out.cpu().tolist() == acc + acc


# ---- Misuse is reported (CPU build only) ----

def test_schedules_expose_a_shared_memory_race(cpu_lib, monkeypatch):
    salts = iter(range(1, 100))

    def run(order, with_barrier):   # a new salt per launch, so stale shared memory never looks right
        monkeypatch.setenv("PL_EMU_SCHEDULE", order)
        out = torch.zeros(64)
        cpu_lib.run("emu_race", out, 64, with_barrier, float(next(salts)))
        return out - out[63] + 1.0  # relative to thread 63, which reads thread 0's slot

    assert not torch.equal(run("forward", 0), run("reverse", 0))    # the race shows up
    correct = run("forward", 1)
    assert correct.tolist() == [1.0 + (t + 1) % 64 for t in range(64)]
    assert torch.equal(run("reverse", 1), correct) and torch.equal(run("shuffle", 1), correct)


@pytest.mark.parametrize("mode,phrase", [
    (0, "has exited without reaching it"),
    (1, "divergent __syncthreads()"),
    (2, "waits at a warp operation"),
    (3, "names a missing lane"),
])
def test_divergence_is_an_error_not_a_hang(cpu_lib, mode, phrase):
    assert cpu_lib.status("emu_divergent", mode) != 0
    assert phrase in cpu_lib.error() and "emu_divergent" in cpu_lib.error()
    out = torch.zeros(64)                                       # the layer recovers for the next launch
    cpu_lib.run("emu_race", out, 64, 1, 10.0)
    assert out[0].item() == 11.0


def test_launch_limits(cpu_lib):
    assert cpu_lib.status("emu_launch_config", 2048) != 0
    assert "invalid configuration argument" in cpu_lib.error()
    out = torch.zeros(1)
    cpu_lib.run("emu_dyn_smem", out, 1000, 4000, 0)
    assert out.item() == sum(i & 1023 for i in range(1000))
    cpu_lib.run("emu_dyn_smem", out, 14000, 56000, 0)          # above 48 KiB with the opt-in attribute
    assert out.item() == sum(i & 1023 for i in range(14000))
    assert cpu_lib.status("emu_dyn_smem", out, 1000, 70000, 0) != 0   # beyond sm_75's 64 KiB
    assert "64 KiB" in cpu_lib.error() or "invalid argument" in cpu_lib.error()


def test_shared_memory_overflow_is_caught_by_asan(cpu_lib):
    """Reading one float past the dynamic shared memory kills the process with an ASan report."""
    lib_path = ROOT / "build" / "emu-test" / "libpocketllm_cpu.so"
    code = (f"import sys, torch; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_emu_layer as t; "
            f"lib = t.EmuLib(__import__('pathlib').Path({str(lib_path)!r}), 'cpu'); out = torch.zeros(1); "
            "print('status', lib.status('emu_dyn_smem', out, 1000, 4000, 1))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0 and "AddressSanitizer" in proc.stderr, proc.stderr[-2000:]
    assert "dyn_smem_kernel" in proc.stderr


def test_heap_overflow_is_caught_with_the_asan_preload(cpu_lib):
    """With LD_PRELOAD of libasan (build.asan_env) torch's tensors get redzones too: a kernel reading past the
    end of its input tensor is reported."""
    if not builder.asan_runtime():
        pytest.skip("the compiler does not report a shared libasan")
    lib_path = ROOT / "build" / "emu-test" / "libpocketllm_cpu.so"
    code = (f"import sys, torch; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_emu_layer as t; "
            f"lib = t.EmuLib(__import__('pathlib').Path({str(lib_path)!r}), 'cpu'); "
            "codes = torch.zeros(256, dtype=torch.uint8); out = torch.zeros(300); "
            "print('status', lib.status('emu_e4m3', codes, out, 300))")   # reads 44 bytes past `codes`
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=builder.asan_env({**os.environ, "OMP_NUM_THREADS": "1"}))
    assert proc.returncode != 0 and "heap-buffer-overflow" in proc.stderr, proc.stderr[-2000:]
    assert "e4m3_kernel" in proc.stderr
