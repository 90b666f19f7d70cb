"""Every native op (csrc/*.cu through the C ABI) against an independent float64 reference.

Runs on the CPU build (build.py --cpu: the same kernels through the execution layer of csrc/runtime.cuh, with
AddressSanitizer) on every CI run, and on the CUDA build with cuda tensors when a GPU is present. Inputs are
random and non-zero; every output is poisoned with NaN first, so an element a kernel fails to write fails the
test. Shapes include ragged sizes (N, K not multiples of 128; odd T) and the TP-sharded head counts of the 27B
model at small head dims.

Tolerances (max |out - ref| / max |ref|): fp32 activations 2e-5 (the reference is float64 on the same inputs;
differences are fp32 summation order), fp16 activations 2e-3 (one fp16 rounding of the output, about 5e-4,
plus fp16 inputs rounded where the kernel rounds them).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

F32, F16, BF16, E4M3 = 0, 1, 2, 3
CODE = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16, torch.float8_e4m3fn: E4M3}
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


# ---- Loading the library: the header's cdef block through cffi's ABI mode, as pocketllm.py does. ----------

def _cdef_text() -> str:
    text = (ROOT / "csrc" / "pocketllm.h").read_text()
    return text.split("/* ---- cdef begin ---- */")[1].split("/* ---- cdef end ---- */")[0]


class Lib:
    """The C library for one device: call(name, *args) raises with pl_last_error() on a nonzero status."""

    def __init__(self, path: Path, device: str):
        import cffi
        self.ffi = cffi.FFI()
        self.ffi.cdef(_cdef_text())
        self.lib = self.ffi.dlopen(str(path))
        self.device = device

    def stream(self) -> int:
        return torch.cuda.current_stream().cuda_stream if self.device == "cuda" else 0

    def call(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args, self.stream())
        if rc != 0:
            raise RuntimeError(f"{name}: {self.ffi.string(self.lib.pl_last_error()).decode()}")
        if self.device == "cuda":
            torch.cuda.synchronize()


def _load(device: str) -> Lib:
    import build
    if device == "cpu":
        # Loaded without LD_PRELOAD of libasan: stack/global/shared-memory checks stay on (see build.py).
        os.environ.setdefault("ASAN_OPTIONS", "detect_leaks=0:verify_asan_link_order=0")
        return Lib(build.build(cpu=True, quiet=True), "cpu")
    # $POCKETLLM_NATIVE_LIB: another build of the library (the GPU check runs an sm_75-only build on newer GPUs).
    override = os.environ.get("POCKETLLM_NATIVE_LIB")
    return Lib(Path(override) if override else build.build(quiet=True), "cuda")


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                   reason="no CUDA GPU on this machine"))]
_LIBS: dict[str, Lib] = {}


@pytest.fixture(params=DEVICES)
def lib(request) -> Lib:
    if request.param not in _LIBS:
        _LIBS[request.param] = _load(request.param)
    return _LIBS[request.param]


def p(t: torch.Tensor) -> int:
    assert t.is_contiguous()
    return t.data_ptr()


def poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def rnd(*shape, dtype=torch.float32, device="cpu", scale=1.0, gen=None) -> torch.Tensor:
    """Random normal values bounded away from zero (no accidental zeros hide an unread input)."""
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    x = torch.where(x.abs() < 0.05, torch.full_like(x, 0.05) * torch.sign(x + 1e-30), x)
    return (x * scale).to(dtype).to(device)


def check(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "") -> None:
    out = out.detach().double().cpu()
    ref = ref.detach().double().cpu()
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    assert torch.isfinite(out).all(), f"{what}: {int((~torch.isfinite(out)).sum())} non-finite (unwritten?) values"
    err = (out - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


ACTS = [torch.float32, torch.float16]


# ---- Float64 references, written from the op table in briefs/native-ops.md. -------------------------------

def ref_rmsnorm(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.double())


def dequant(w, scale):
    N, K = w.shape
    if scale is None:
        return w.double()
    s = scale.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K]
    return w.double() * s


def ref_rope(x, positions, inv_freq):
    x = x.clone()
    half = inv_freq.numel()
    ang = (positions.float()[:, None] * inv_freq.float()[None, :]).double()  # (T, R/2), fp32 product as in HF
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., :half].clone(), x[..., half:2 * half].clone()
    x[..., :half] = a * cos - b * sin
    x[..., half:2 * half] = b * cos + a * sin
    return x


def ref_attention(q, k_cache, v_cache, block_tables, context_lens, query_start, scale):
    T, Hq, Dh = q.shape
    Hk = k_cache.shape[2]
    bs = k_cache.shape[1]
    out = torch.zeros(T, Hq, Dh, dtype=torch.float64)
    for b in range(len(context_lens)):
        ctx = int(context_lens[b])
        q0, q1 = int(query_start[b]), int(query_start[b + 1])
        pos = torch.arange(ctx)
        slots = block_tables[b, pos // bs].long() * bs + pos % bs
        K = k_cache.reshape(-1, Hk, Dh)[slots].double()                        # (ctx, Hk, Dh)
        V = v_cache.reshape(-1, Hk, Dh)[slots].double()
        for i in range(q1 - q0):
            vis = ctx - (q1 - q0) + i + 1
            for h in range(Hq):
                kh = h // (Hq // Hk)
                s = (K[:vis, kh] @ q[q0 + i, h].double()) * scale
                out[q0 + i, h] = torch.softmax(s, 0) @ V[:vis, kh]
    return out


def ref_conv1d(x, w, conv_state, slot_ids, query_start):
    W = w.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    state = conv_state.double().clone()
    for b in range(len(slot_ids)):
        q0, q1 = int(query_start[b]), int(query_start[b + 1])
        s = int(slot_ids[b])
        xs = torch.cat([state[s].T, x[q0:q1].double()], 0)                    # (W-1 + rows, C)
        for t in range(q1 - q0):
            out[q0 + t] = F.silu((xs[t:t + W] * w.double().T).sum(0))
        state[s] = xs[-(W - 1):].T
    return out, state


def ref_gated_delta(q, k, v, g, beta, state, slot_ids, query_start):
    T, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    state = state.double().clone()
    out = torch.zeros(T, Hv, Dv, dtype=torch.float64)
    qn = q.double() * torch.rsqrt(q.double().pow(2).sum(-1, keepdim=True) + 1e-6) * Dk ** -0.5
    kn = k.double() * torch.rsqrt(k.double().pow(2).sum(-1, keepdim=True) + 1e-6)
    for b in range(len(slot_ids)):
        s = int(slot_ids[b])
        for t in range(int(query_start[b]), int(query_start[b + 1])):
            for h in range(Hv):
                kh = h // (Hv // Hk)
                S = state[s, h] * math.exp(float(g[t, h]))
                delta = float(beta[t, h]) * (v[t, h].double() - S.T @ kn[t, kh])
                S = S + torch.outer(kn[t, kh], delta)
                out[t, h] = S.T @ qn[t, kh]
                state[s, h] = S
    return out, state


# ---- Elementwise and norms. --------------------------------------------------------------------------------

@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("table_dtype", [torch.float32, torch.bfloat16])
def test_embed(lib, act, table_dtype):
    dev = lib.device
    V, D, T = 37, 96, 7
    table = rnd(V, D, dtype=table_dtype, device=dev)
    ids = torch.tensor([3, 0, 36, 5, 5, 17, 1], dtype=torch.int64, device=dev)
    out = poisoned((T, D), act, dev)
    lib.call("pl_embed", p(ids), T, p(table), CODE[table_dtype], V, D, p(out), CODE[act])
    check(out, table.double()[ids], TOL[act], "embed")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("T,D", [(1, 64), (5, 200), (3, 5120)])
def test_rmsnorm(lib, act, T, D):
    dev = lib.device
    x, w = rnd(T, D, dtype=act, device=dev), rnd(D, device=dev, scale=0.3)
    out = poisoned((T, D), act, dev)
    lib.call("pl_rmsnorm", p(x), p(w), F32, p(out), CODE[act], T, D, 1e-6)
    check(out, ref_rmsnorm(x, w, 1e-6), TOL[act], "rmsnorm")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("T,D", [(1, 64), (7, 200)])
def test_add_rmsnorm(lib, act, T, D):
    dev = lib.device
    x, w = rnd(T, D, dtype=act, device=dev), rnd(D, dtype=torch.bfloat16, device=dev, scale=0.3)
    residual = rnd(T, D, device=dev, scale=3.0)
    new_residual = residual.double() + x.double()
    out = poisoned((T, D), act, dev)
    lib.call("pl_add_rmsnorm", p(x), CODE[act], p(residual), p(w), BF16, p(out), CODE[act], T, D, 1e-6)
    check(residual, new_residual, 1e-6, "add_rmsnorm residual")
    check(out, ref_rmsnorm(new_residual, w, 1e-6), TOL[act], "add_rmsnorm normed")


@pytest.mark.parametrize("act", ACTS)
def test_silu_mul_sigmoid_mul(lib, act):
    dev = lib.device
    T, I = 5, 333
    g, u = rnd(T, I, dtype=act, device=dev, scale=3), rnd(T, I, dtype=act, device=dev)
    out = poisoned((T, I), act, dev)
    lib.call("pl_silu_mul", p(g), p(u), CODE[act], T, I, p(out), CODE[act], 0)
    check(out, F.silu(g.double()) * u.double(), TOL[act], "silu_mul")
    out = poisoned((T, I), act, dev)
    lib.call("pl_sigmoid_mul", p(g), p(u), p(out), CODE[act], T * I)
    check(out, g.double() * torch.sigmoid(u.double()), TOL[act], "sigmoid_mul")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("Hq,Hk,Dh,R", [(6, 1, 64, 16), (4, 2, 32, 32), (3, 1, 256, 64)])
def test_qk_norm_rope(lib, act, Hq, Hk, Dh, R):
    dev = lib.device
    T = 5
    q, k = rnd(T, Hq, Dh, dtype=act, device=dev), rnd(T, Hk, Dh, dtype=act, device=dev, scale=2)
    qw, kw = rnd(Dh, device=dev, scale=0.2), rnd(Dh, device=dev, scale=0.2)
    positions = torch.tensor([0, 1, 7, 1000, 123456], dtype=torch.int64, device=dev)
    inv_freq = (1e7 ** (-torch.arange(0, R, 2, dtype=torch.float32) / R)).to(dev)
    q_out, k_out = poisoned(q.shape, act, dev), poisoned(k.shape, act, dev)
    lib.call("pl_qk_norm_rope", p(q), p(k), p(q_out), p(k_out), CODE[act], T, Hq, Hk, Dh, p(qw), p(kw), F32,
             1e-6, p(positions), p(inv_freq), R // 2)
    ang_pos = positions.cpu()
    check(q_out, ref_rope(ref_rmsnorm(q.cpu(), qw.cpu(), 1e-6), ang_pos, inv_freq.cpu()), TOL[act] * 2, "q")
    check(k_out, ref_rope(ref_rmsnorm(k.cpu(), kw.cpu(), 1e-6), ang_pos, inv_freq.cpu()), TOL[act] * 2, "k")
    # In place (outputs aliasing the inputs) gives the same result.
    lib.call("pl_qk_norm_rope", p(q), p(k), p(q), p(k), CODE[act], T, Hq, Hk, Dh, p(qw), p(kw), F32,
             1e-6, p(positions), p(inv_freq), R // 2)
    assert torch.equal(q, q_out) and torch.equal(k, k_out)


@pytest.mark.parametrize("act", ACTS)
def test_kv_write(lib, act):
    dev = lib.device
    T, Hk, Dh, nb, bs = 5, 2, 48, 4, 16
    k, v = rnd(T, Hk, Dh, dtype=act, device=dev), rnd(T, Hk, Dh, dtype=act, device=dev)
    k_cache, v_cache = poisoned((nb, bs, Hk, Dh), act, dev), poisoned((nb, bs, Hk, Dh), act, dev)
    slots = torch.tensor([0, 17, 63, -1, 40], dtype=torch.int64, device=dev)
    lib.call("pl_kv_write", p(k), p(v), CODE[act], T, Hk, Dh, p(k_cache), p(v_cache), CODE[act], p(slots))
    kc, vc = k_cache.reshape(-1, Hk, Dh).cpu(), v_cache.reshape(-1, Hk, Dh).cpu()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(kc[s], k[t].cpu()) and torch.equal(vc[s], v[t].cpu())
    written = set(s for s in slots.tolist() if s >= 0)
    untouched = [s for s in range(nb * bs) if s not in written]
    assert torch.isnan(kc[untouched]).all() and torch.isnan(vc[untouched]).all()


@pytest.mark.parametrize("act", ACTS)
def test_gdn_gates(lib, act):
    dev = lib.device
    T, Hv = 7, 12
    a, b = rnd(T, Hv, dtype=act, device=dev, scale=4), rnd(T, Hv, dtype=act, device=dev, scale=3)
    a[0, 0] = 30.0                                               # the softplus linear branch
    A_log, dt_bias = rnd(Hv, device=dev, scale=0.5), rnd(Hv, device=dev)
    g, beta = poisoned((T, Hv), torch.float32, dev), poisoned((T, Hv), torch.float32, dev)
    lib.call("pl_gdn_gates", p(a), p(b), CODE[act], T, Hv, p(A_log), p(dt_bias), F32, p(g), p(beta))
    ref_g = -A_log.double().exp() * F.softplus(a.double() + dt_bias.double())
    check(g, ref_g, 2e-6, "g")
    check(beta, torch.sigmoid(b.double()), 2e-6, "beta")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("Hv,Dv", [(12, 16), (3, 128)])
def test_gated_rmsnorm(lib, act, Hv, Dv):
    dev = lib.device
    T = 3
    x, z = rnd(T, Hv, Dv, dtype=act, device=dev), rnd(T, Hv, Dv, dtype=act, device=dev, scale=2)
    w = rnd(Dv, device=dev)
    out = poisoned(x.shape, act, dev)
    lib.call("pl_gated_rmsnorm", p(x), p(z), p(w), F32, p(out), CODE[act], T * Hv, Dv, 1e-6)
    xd = x.double()
    ref = w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * F.silu(z.double())
    check(out, ref, TOL[act], "gated_rmsnorm")


# ---- Linear: FP8 block-scaled and dense weights; GEMV (T <= 16) and tiled (T > 16) paths. -----------------

def fp8_weight(N, K, device, gen=None):
    w = rnd(N, K, scale=60.0, gen=gen).clamp(-440, 440).to(torch.float8_e4m3fn)
    scale = (torch.rand(-(-N // 128), -(-K // 128), generator=gen) * 0.01 + 0.001).to(torch.float32)
    return w.to(device), scale.to(device)


def weight_of(wdt, N, K, device):
    """A random (N, K) weight of dtype wdt: (weight, FP8 block scales or None, its float64 values on the CPU)."""
    if wdt == torch.float8_e4m3fn:
        w, scale = fp8_weight(N, K, device)
        return w, scale, dequant(w.cpu().float(), scale.cpu())
    w = rnd(N, K, dtype=wdt, device=device, scale=0.1)
    return w, None, w.double().cpu()


LINEAR_SHAPES = [  # (T, N, K): ragged N and K (K % 16 != 0 takes the element-wise paths), odd T, every path:
    (1, 130, 256), (3, 257, 384), (12, 150, 320), (9, 40, 144),        # GEMV (fp16: tensor-core GEMV, 1-2 tiles)
    (16, 64, 200), (5, 200, 136), (1, 96, 90),                         # GEMV, K % 16 != 0
    (17, 130, 300), (40, 70, 128), (70, 200, 384)]                     # tiled (fp16: mma), ragged tiles


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("T,N,K", LINEAR_SHAPES)
def test_linear_fp8(lib, act, T, N, K):
    dev = lib.device
    w, scale = fp8_weight(N, K, dev)
    x = rnd(T, K, dtype=act, device=dev)
    out = poisoned((T, N), act, dev)
    lib.call("pl_linear", p(x), CODE[act], 0, T, K, p(w), E4M3, p(scale), N, p(out), CODE[act])
    ref = x.double().cpu() @ dequant(w.cpu().float(), scale.cpu()).T
    check(out, ref, TOL[act], f"linear fp8 T={T} N={N} K={K}")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("T,N,K", [(2, 48, 80), (19, 33, 70), (33, 96, 256)])
def test_linear_dense(lib, act, wdt, T, N, K):
    dev = lib.device
    w = rnd(N, K, dtype=wdt, device=dev, scale=0.1)
    x = rnd(T, K, dtype=act, device=dev)
    out = poisoned((T, N), act, dev)
    lib.call("pl_linear", p(x), CODE[act], 0, T, K, p(w), CODE[wdt], 0, N, p(out), CODE[act])
    check(out, x.double().cpu() @ w.double().cpu().T, TOL[act], "linear dense")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("wdt", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("T,ends", [(1, (128, 384, 384)), (5, (0, 256, 300)), (12, (128, 256, 384)),
                                    (33, (256, 256, 300))])
def test_linear_parts(lib, act, wdt, T, ends):
    """A fused weight's output split into four parts, each its own contiguous (T, N_p) block, one after another:
    the same values as the plain product, moved (every path: GEMV, tensor-core GEMV, tiled/mma; an empty part)."""
    dev, N, K = lib.device, 420, 256
    w, scale, full = weight_of(wdt, N, K, dev)
    x = rnd(T, K, dtype=act, device=dev)
    out = poisoned((T * N,), torch.float32, dev)
    lib.call("pl_linear_parts", p(x), CODE[act], 0, T, K, p(w), CODE[wdt], 0 if scale is None else p(scale), N,
             *ends, p(out), F32)
    ref = x.double().cpu() @ full.T                                             # (T, N)
    bounds = [0, *ends, N]
    parts = [ref[:, a:b].reshape(-1) for a, b in zip(bounds, bounds[1:])]     # part p: (T, N_p) row-major
    check(out, torch.cat(parts), TOL[act], f"linear parts T={T} ends={ends}")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("wdt", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("T,I,K", [(1, 128, 256), (5, 256, 320), (12, 128, 136), (16, 384, 256)])
def test_linear_glu(lib, act, wdt, T, I, K):
    """silu(x gate^T) * (x up^T) from the stacked [gate | up] weight in one launch, fp32 out (every GEMV path:
    tensor-core for fp16 and K % 16 == 0, warp per row otherwise)."""
    dev = lib.device
    w, scale, full = weight_of(wdt, 2 * I, K, dev)
    x = rnd(T, K, dtype=act, device=dev)
    out = poisoned((T, I), torch.float32, dev)
    lib.call("pl_linear_glu", p(x), CODE[act], T, K, p(w), CODE[wdt], 0 if scale is None else p(scale), 2 * I, p(out))
    h = x.double().cpu() @ full.T                                               # (T, 2I)
    check(out, F.silu(h[:, :I]) * h[:, I:], TOL[act], f"linear glu T={T} I={I} K={K}")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("T", [1, 7, 20])
def test_linear_gdn_gates(lib, act, wdt, T):
    """GDN's a|b projection with the gates in the epilogue: [g | beta] (2, T, Hv) fp32 as pl_gdn_gates' formulas
    of the fp32 products (GEMV with a block per row for these few rows; T = 20: the tiled path)."""
    dev, Hv, K = lib.device, 64 if wdt == torch.float8_e4m3fn else 12, 256
    w, scale, full = weight_of(wdt, 2 * Hv, K, dev)
    x = rnd(T, K, dtype=act, device=dev)
    A_log, dt_bias = rnd(Hv, device=dev, scale=0.5), rnd(Hv, device=dev)
    out = poisoned((2, T, Hv), torch.float32, dev)
    lib.call("pl_linear_gdn_gates", p(x), CODE[act], T, K, p(w), CODE[wdt], 0 if scale is None else p(scale), Hv,
             p(A_log), p(dt_bias), p(out))
    ab = x.double().cpu() @ full.T                                                # (T, 2 Hv)
    g = -A_log.double().cpu().exp() * F.softplus(ab[:, :Hv] + dt_bias.double().cpu())
    check(out[0], g, TOL[act] * 2, "gdn gates g")
    check(out[1], torch.sigmoid(ab[:, Hv:]), TOL[act] * 2, "gdn gates beta")


def test_linear_glu_refuses_prefill_sizes(lib):
    x, w = rnd(17, 64, device=lib.device), rnd(16, 64, device=lib.device)
    out = poisoned((17, 8), torch.float32, lib.device)
    with pytest.raises(RuntimeError, match="at most 16 tokens .got 17.: use pl_linear_parts"):
        lib.call("pl_linear_glu", p(x), F32, 17, 64, p(w), F32, 0, 16, p(out))


def test_linear_parts_refuses_falling_ends(lib):
    x, w = rnd(1, 64, device=lib.device), rnd(8, 64, device=lib.device)
    out = poisoned((8,), torch.float32, lib.device)
    with pytest.raises(RuntimeError, match="part ends 4 2 8: must rise"):
        lib.call("pl_linear_parts", p(x), F32, 0, 1, 64, p(w), F32, 0, 8, 4, 2, 8, p(out), F32)


def prenorm_case(act, T, K, dev, gen=None):
    """x, residual (T, K) fp32 and a norm weight, with the float64 reference of the normed input rounded to act as
    pl_add_rmsnorm's output is (so the GEMV sees the same h) and of residual + x."""
    x, res = rnd(T, K, device=dev, scale=2.0, gen=gen), rnd(T, K, device=dev, scale=3.0, gen=gen)
    w = rnd(K, device=dev, scale=0.2, gen=gen)
    r = res.double().cpu() + x.double().cpu()
    h = ref_rmsnorm(r, w.double().cpu(), 1e-6).to(act).double()
    return x, res, w, h, r


def gemv_input(act, T, K, dev, res_out, normed):
    """(h, the input arguments of pl_gdn_in_proj's form, r, the tensors they point to: keep them alive): a plain
    activation x (h = x), or prenorm_case's normed input h = rmsnorm(res + x), with r = res + x due in res_out."""
    if normed:
        x, res, nw, h, r = prenorm_case(act, T, K, dev)
        return h, (p(x), p(res), p(res_out), p(nw), F32, 1e-6, CODE[act]), r, (x, res, nw)
    x = rnd(T, K, dtype=act, device=dev)
    return x.double().cpu(), (p(x), 0, 0, 0, 0, 0.0, CODE[act]), None, (x,)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("wdt", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("T,K", [(1, 256), (5, 256), (12, 384), (3, 200)])   # K = 200: the element-wise paths
def test_norm_linear(lib, act, wdt, T, K):
    """pl_norm_linear_parts, _glu and _gdn_gates: the residual add + RMSNorm as the GEMV's prologue gives the
    product of pl_add_rmsnorm's output (every GEMV path: tensor-core, warp per row, block per row); residual_out
    gets residual + x when asked for (residual itself is never written), and is left alone when 0."""
    dev = lib.device
    x, res, w, h, r = prenorm_case(act, T, K, dev)
    res_before = res.clone()
    wt, scale, full = weight_of(wdt, 384, K, dev)
    sp = 0 if scale is None else p(scale)
    ref = h @ full.T                                                             # (T, 384)
    pre = lambda res_out: (p(x), p(res), res_out, p(w), F32, 1e-6, CODE[act])  # noqa: E731
    out, res_out = poisoned((T * 384,), act, dev), poisoned((T, K), torch.float32, dev)
    lib.call("pl_norm_linear_parts", *pre(p(res_out)), T, K, p(wt), CODE[wdt], sp, 384, 128, 256, 384, p(out),
             CODE[act])
    parts = [ref[:, a:b].reshape(-1) for a, b in [(0, 128), (128, 256), (256, 384)]]
    check(out, torch.cat(parts), TOL[act] * 2, f"norm linear parts T={T} K={K}")
    check(res_out, r, 1e-6, "residual_out")
    assert torch.equal(res, res_before)
    wg, sg, fg = weight_of(wdt, 256, K, dev)                                     # [gate | up], I = 128
    glu, untouched = poisoned((T, 128), torch.float32, dev), poisoned((T, K), torch.float32, dev)
    lib.call("pl_norm_linear_glu", *pre(0), T, K, p(wg), CODE[wdt], 0 if sg is None else p(sg), 256, p(glu))
    gu = h @ fg.T                                                                # (T, 256)
    check(glu, F.silu(gu[:, :128]) * gu[:, 128:], TOL[act] * 2, f"norm linear glu T={T} K={K}")
    assert torch.isnan(untouched).all()
    Hv = 64 if wdt == torch.float8_e4m3fn else 12
    wab, sab, fab = weight_of(wdt, 2 * Hv, K, dev)
    A_log, dt_bias = rnd(Hv, device=dev, scale=0.5), rnd(Hv, device=dev)
    gates = poisoned((2, T, Hv), torch.float32, dev)
    lib.call("pl_norm_linear_gdn_gates", *pre(0), T, K, p(wab), CODE[wdt], 0 if sab is None else p(sab), Hv,
             p(A_log), p(dt_bias), p(gates))
    ab = h @ fab.T                                                               # (T, 2 Hv)
    g = -A_log.double().cpu().exp() * F.softplus(ab[:, :Hv] + dt_bias.double().cpu())
    check(gates[0], g, TOL[act] * 4, "norm gdn gates g")
    check(gates[1], torch.sigmoid(ab[:, Hv:]), TOL[act] * 4, "norm gdn gates beta")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("wdt", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("normed", [False, True])
def test_gdn_in_proj(lib, act, wdt, normed):
    """pl_gdn_in_proj: GDN's [qkv | z] with the decode step's conv1d + SiLU over qkv in its epilogue equals the
    product (rounded to act, as pl_conv1d reads it) then the conv reference, the conv states advanced alike (slots
    out of order; slot 1 untouched); normed: the input is the residual add + RMSNorm prologue's."""
    dev, T, K, C, N, W = lib.device, 3, 256, 256, 384, 4
    wt, scale, full = weight_of(wdt, N, K, dev)
    conv_w, state = rnd(C, W, device=dev, scale=0.5), rnd(4, C, W - 1, dtype=act, device=dev)
    slots = torch.tensor([2, 0, 3], dtype=torch.int32, device=dev)
    if normed:
        x, res, nw, h, _ = prenorm_case(act, T, K, dev)
        args = (p(x), p(res), 0, p(nw), F32, 1e-6, CODE[act])
    else:
        x = rnd(T, K, dtype=act, device=dev)
        h, args = x.double().cpu(), (p(x), 0, 0, 0, 0, 0.0, CODE[act])
    y = (h @ full.T).to(act).double()                                            # (T, N)
    ref_qkv, ref_state = ref_conv1d(y[:, :C], conv_w.cpu(), state.cpu(), slots.cpu(), torch.arange(T + 1))
    out = poisoned((T * N,), act, dev)
    lib.call("pl_gdn_in_proj", *args, T, K, p(wt), CODE[wdt], 0 if scale is None else p(scale), C, N, p(out),
             p(conv_w), F32, W, p(state), CODE[act], p(slots))
    check(out[:T * C].view(T, C), ref_qkv, TOL[act] * 2, "gdn in_proj qkv after the conv")
    check(out[T * C:].view(T, N - C), y[:, C:], TOL[act] * 2, "gdn in_proj z")
    check(state, ref_state, TOL[act], "gdn in_proj conv state")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("ab_dtype", ["act", torch.bfloat16])
@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("T", [1, 3, 12])
def test_gdn_in_proj_gates(lib, act, ab_dtype, normed, T):
    """pl_gdn_in_proj_gates: pl_gdn_in_proj's outputs and conv states, and GDN's gates of the dense a|b projection
    of the same input (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)) against the float64 references;
    one launch when the a|b weight is in the activation dtype, else two (the same results); normed: the residual
    stream written once."""
    dev, K, C, N, W, Hv = lib.device, 256, 256, 384, 4, 12
    wt, scale, full = weight_of(torch.float8_e4m3fn, N, K, dev)
    wab, _, fab = weight_of(act if ab_dtype == "act" else ab_dtype, 2 * Hv, K, dev)
    A_log, dt_bias = rnd(Hv, device=dev, scale=0.5), rnd(Hv, device=dev)
    conv_w, state = rnd(C, W, device=dev, scale=0.5), rnd(16, C, W - 1, dtype=act, device=dev)
    slots = torch.randperm(16, generator=torch.Generator().manual_seed(T))[:T].int().to(dev)
    res_out = poisoned((T, K), torch.float32, dev)
    h, args, r, _inputs = gemv_input(act, T, K, dev, res_out, normed)
    y = (h @ full.T).to(act).double()                                            # (T, N)
    ref_qkv, ref_state = ref_conv1d(y[:, :C], conv_w.cpu(), state.cpu(), slots.cpu(), torch.arange(T + 1))
    ab = h @ fab.T                                                               # (T, 2 Hv)
    ref_g = -A_log.double().cpu().exp() * F.softplus(ab[:, :Hv] + dt_bias.double().cpu())
    out, gates = poisoned((T * N,), act, dev), poisoned((2, T, Hv), torch.float32, dev)
    count = lib.ffi.new("uint64_t*")
    lib.lib.pl_launch_count(count)
    before = count[0]
    lib.call("pl_gdn_in_proj_gates", *args, T, K, p(wt), E4M3, p(scale), C, N, p(out), p(conv_w), F32, W, p(state),
             CODE[act], p(slots), p(wab), CODE[wab.dtype], Hv, p(A_log), p(dt_bias), p(gates))
    lib.lib.pl_launch_count(count)
    assert count[0] - before == (1 if ab_dtype == "act" else 2)
    check(out[:T * C].view(T, C), ref_qkv, TOL[act] * 2, "gdn in_proj qkv after the conv")
    check(out[T * C:].view(T, N - C), y[:, C:], TOL[act] * 2, "gdn in_proj z")
    check(state, ref_state, TOL[act], "gdn in_proj conv state")
    check(gates[0], ref_g, TOL[act] * 4, "gdn gates g")
    check(gates[1], torch.sigmoid(ab[:, Hv:]), TOL[act] * 4, "gdn gates beta")
    if normed:
        check(res_out, r, 1e-6, "residual_out")
    else:
        assert torch.isnan(res_out).all()


# ---- Split-K of the tensor-core GEMV: the tests above again with K split across blocks. ----------------------

@contextlib.contextmanager
def gemv_split(lib, warps: int, splits: int):
    """This thread's split-K scratch given to the library and the GEMV switches set (warps per block, splits
    forced or 0 = the library's choice); afterwards every last-block counter must be back at zero."""
    ws = torch.zeros(1 << 20, device=lib.device)                                   # 4 MiB of partial sums
    counters = torch.zeros(4096, dtype=torch.int32, device=lib.device)
    assert lib.lib.pl_set_gemv_scratch(p(ws), ws.numel() * 4, p(counters), counters.numel()) == 0
    assert lib.lib.pl_set_gemv_tuning(warps, splits) == 0
    try:
        yield
    finally:
        lib.lib.pl_set_gemv_tuning(0, 0)
        lib.lib.pl_set_gemv_scratch(0, 0, 0, 0)
    assert not counters.any(), "a split-K launch left a counter set"


def gemv_plan(lib, T: int, K: int, N: int, glu: bool = False) -> tuple[int, int]:
    warps, splits = lib.ffi.new("int32_t*"), lib.ffi.new("int32_t*")
    assert lib.lib.pl_gemv_plan(T, K, N, int(glu), warps, splits) == 0, lib.ffi.string(lib.lib.pl_last_error())
    return warps[0], splits[0]


@pytest.mark.parametrize("warps,splits", [(4, 3), (8, 2), (8, 16), (4, 0)])
def test_gemv_split_k(lib, warps, splits):
    """Every tensor-core GEMV form (plain, fp32 output with row scales, four parts, GLU, GDN's in_proj with the
    conv epilogue and its states, one and two token tiles) with K split across blocks, 4 or 8 warps a block:
    the float64 references hold as unsplit, and the split sums are the same bits launch after launch. Splits
    beyond K's 64-wide chunks are clamped (K = 144: 3 chunks); 0: the library's choice (none at these sizes)."""
    f16 = torch.float16
    with gemv_split(lib, warps, splits):
        for T, N, K in LINEAR_SHAPES[:4]:
            test_linear_fp8(lib, f16, T, N, K)
            test_linear_fp32_output_beyond_fp16_range(lib, f16, T, N, K)
        for T, ends in [(1, (128, 384, 384)), (12, (128, 256, 384))]:
            test_linear_parts(lib, f16, torch.float8_e4m3fn, T, ends)
        for T, I, K in [(1, 128, 256), (12, 128, 136), (16, 384, 256)]:
            test_linear_glu(lib, f16, torch.float8_e4m3fn, T, I, K)
        test_gdn_in_proj(lib, f16, torch.float8_e4m3fn, False)
        dev, T, N, K = lib.device, 3, 130, 1024
        w, scale = fp8_weight(N, K, dev)
        x = rnd(T, K, dtype=f16, device=dev)
        outs = [poisoned((T, N), torch.float32, dev) for _ in range(2)]
        for out in outs:
            lib.call("pl_linear", p(x), F16, 0, T, K, p(w), E4M3, p(scale), N, p(out), F32)
        assert torch.equal(outs[0], outs[1])
        assert gemv_plan(lib, T, K, N) == (warps, max(splits, 1))


def split_rule(tiles: int, chunks: int, sms: int, warps: int) -> int:
    """pl_gemv_plan's documented choice, restated: a grid under one wave of block slots (32 warps per SM at one
    token tile) split into enough blocks to fill the wave, at most 4 splits of at least 64 chunks each."""
    slots = sms * (32 // warps)
    return 1 if tiles >= slots else max(1, min(-(-slots // tiles), chunks // 64, 4))


def test_gemv_split_plan(lib):
    """The library's split choice by shape and SM count (the CPU build answers as an RTX 2080 Ti, 68 SMs): the
    27B's down_proj at TP1 (320 tiles, K 17408) as the rule says (split on an H200: 528 slots), gate|up as GLU
    (2176 tiles), o_proj (K 6144) and a K of 4 chunks not; none without scratch, with too little of it, or when
    switched off; warps as set."""
    sms = 68 if lib.device == "cpu" else torch.cuda.get_device_properties(0).multi_processor_count
    big = dict(T=1, K=17408, N=5120)
    assert gemv_plan(lib, **big) == (8, 1)                                         # no scratch on this thread
    with gemv_split(lib, 0, 0):
        warps, down = gemv_plan(lib, **big)
        assert warps == 8 and down == split_rule(320, 272, sms, 8)
        assert gemv_plan(lib, 1, 5120, 2 * 17408, glu=True)[1] == 1                  # gate|up as GLU: 2176 tiles
        assert gemv_plan(lib, 1, 6144, 5120)[1] == 1                                  # o_proj: 96 chunks
        assert gemv_plan(lib, 1, 256, 5120)[1] == 1                                   # 4 chunks: nothing to split
        assert gemv_plan(lib, 1, 17408, 1024)[1] == 4                                 # 64 tiles: 4 splits of 68
        lib.lib.pl_set_gemv_tuning(0, -1)
        assert gemv_plan(lib, **big) == (8, 1)
        lib.lib.pl_set_gemv_tuning(4, 0)
        assert gemv_plan(lib, **big) == (4, split_rule(320, 272, sms, 4))
    ws, counters = torch.zeros(1024, device=lib.device), torch.zeros(4096, dtype=torch.int32, device=lib.device)
    lib.lib.pl_set_gemv_scratch(p(ws), 4096, p(counters), 4096)                      # room for 8 tiles' sums
    try:
        assert gemv_plan(lib, **big)[1] == 1
    finally:
        lib.lib.pl_set_gemv_scratch(0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="GEMV warps 6: must be 0"):
        if lib.lib.pl_set_gemv_tuning(6, 0):
            raise RuntimeError(lib.ffi.string(lib.lib.pl_last_error()).decode())

@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("T,I,K,D", [(1, 256, 256, 384), (3, 384, 320, 256), (16, 128, 256, 128),
                                     (5, 200, 136, 130), (12, 344, 200, 300)])   # ragged I, D; K % 16 != 0
def test_mlp_one_launch(lib, act, normed, T, I, K, D):
    """pl_mlp: down(silu(h gate^T) * (h up^T)) in one launch, (T, D) fp32, h the plain or prenormed input; the
    blocks' partials summed by the last to arrive, in block order: a second launch gives the same bits and the
    chunk counters are left zero. Ragged I (a partial last block) and D (a partial last chunk)."""
    dev = lib.device
    wg, sg, fg = weight_of(torch.float8_e4m3fn, 2 * I, K, dev)
    wd, sd, fd = weight_of(torch.float8_e4m3fn, D, I, dev)
    res_out = poisoned((T, K), torch.float32, dev)
    h, args, r, _inputs = gemv_input(act, T, K, dev, res_out, normed)
    gu = h @ fg.T                                                                # (T, 2I)
    ref = (F.silu(gu[:, :I]) * gu[:, I:]) @ fd.T                                 # (T, D)
    blocks, chunks = -(-I // 128), -(-D // 128)
    ws = poisoned((blocks * T * D,), torch.float32, dev)
    counters = torch.zeros(chunks, dtype=torch.int32, device=dev)
    outs = []
    for _ in range(2):
        out = poisoned((T, D), torch.float32, dev)
        count = lib.ffi.new("uint64_t*")
        lib.lib.pl_launch_count(count)
        before = count[0]
        lib.call("pl_mlp", *args, T, K, p(wg), p(sg), I, p(wd), p(sd), D, p(out), p(ws), p(counters))
        lib.lib.pl_launch_count(count)
        assert count[0] - before == 1
        assert not counters.any()
        outs.append(out)
    check(outs[0], ref, TOL[act] * 2, f"mlp T={T} I={I} K={K} D={D}")
    assert torch.equal(outs[0], outs[1])
    if normed:
        check(res_out, r, 1e-6, "residual_out")
    else:
        assert torch.isnan(res_out).all()


def test_mlp_refuses(lib):
    dev = lib.device
    x, wg, sg = rnd(17, 128, device=dev), *fp8_weight(256, 128, dev)
    wd, sd = fp8_weight(128, 128, dev)
    out, ws, counters = poisoned((17, 128), torch.float32, dev), poisoned((17 * 128,), torch.float32, dev), \
        torch.zeros(1, dtype=torch.int32, device=dev)
    with pytest.raises(RuntimeError, match="at most 16 tokens .got 17."):
        lib.call("pl_mlp", p(x), 0, 0, 0, 0, 0.0, F32, 17, 128, p(wg), p(sg), 128, p(wd), p(sd), 128, p(out), p(ws),
                 p(counters))
    with pytest.raises(RuntimeError, match="e4m3 weights"):
        lib.call("pl_mlp", p(x), 0, 0, 0, 0, 0.0, F32, 1, 128, p(wg), 0, 128, p(wd), p(sd), 128, p(out), p(ws),
                 p(counters))


def test_norm_linear_refuses_prefill_sizes(lib):
    x, res, w = rnd(17, 64, device=lib.device), rnd(17, 64, device=lib.device), rnd(64, device=lib.device)
    wl, out = rnd(8, 64, device=lib.device), poisoned((17, 8), torch.float32, lib.device)
    with pytest.raises(RuntimeError, match="at most 16 tokens .got 17.: use pl_add_rmsnorm"):
        lib.call("pl_norm_linear_parts", p(x), p(res), 0, p(w), F32, 1e-6, F32, 17, 64, p(wl), F32, 0, 8, 8, 8, 8,
                 p(out), F32)


def test_launch_counter_and_skip(lib):
    """pl_launch_count counts each kernel an op queues (conv1d: one launch when the batch is one chunk of rows,
    two otherwise); with pl_set_skip_kernels(1) the launches are counted but nothing is written."""
    dev = lib.device
    count = lib.ffi.new("uint64_t*")

    def launches(fn) -> int:
        lib.lib.pl_launch_count(count)
        before = count[0]
        fn()
        lib.lib.pl_launch_count(count)
        return count[0] - before

    C, W = 40, 4
    w, state = rnd(C, W, device=dev), rnd(2, C, W - 1, device=dev)
    slots = torch.tensor([1, 0], dtype=torch.int32, device=dev)

    def conv(T):
        qs = torch.tensor([0, T - 1, T], dtype=torch.int32, device=dev)
        x, out = rnd(T, C, device=dev), poisoned((T, C), torch.float32, dev)
        return lambda: lib.call("pl_conv1d", p(x), F32, T, C, p(w), F32, W, p(state), F32, p(slots), p(qs), 2,
                                p(out)), out

    run, _ = conv(2)
    assert launches(run) == 1
    run, _ = conv(70)
    assert launches(run) == 2
    x, wl = rnd(3, 64, device=dev), rnd(8, 64, device=dev)
    out = poisoned((3, 8), torch.float32, dev)
    assert launches(lambda: lib.call("pl_linear", p(x), F32, 0, 3, 64, p(wl), F32, 0, 8, p(out), F32)) == 1
    assert torch.isfinite(out).all()
    out = poisoned((3, 8), torch.float32, dev)
    lib.lib.pl_set_skip_kernels(1)
    try:
        assert launches(lambda: lib.call("pl_linear", p(x), F32, 0, 3, 64, p(wl), F32, 0, 8, p(out), F32)) == 1
    finally:
        lib.lib.pl_set_skip_kernels(0)
    assert torch.isnan(out).all()                                              # counted, not run


@pytest.mark.parametrize("T", [2, 24])
def test_mlp_large_activations_fp16(lib, T):
    """Real-scale activations on the fp16 path: partial sums far above fp16's 65504 must not overflow when the
    result fits (fp32 accumulation), and norms of rows with |x| ~ 1e4 must stay finite (fp32 arithmetic)."""
    dev, act = lib.device, torch.float16
    N, K = 96, 512
    gen = torch.Generator().manual_seed(7)
    # Pairs of columns cancel: sum_k x_k w_nk is small although sum |x_k w_nk| ~ 1e6.
    x = rnd(T, K // 2, gen=gen, scale=3000.0).clamp(-60000, 60000)
    x = torch.stack([x, x], -1).reshape(T, K).to(act)
    w, scale = fp8_weight(N, K, "cpu", gen=gen)
    wf = w.float().reshape(N, K // 2, 2)
    wf[..., 1] = -wf[..., 0] * 0.999
    w = wf.reshape(N, K).to(torch.float8_e4m3fn)
    w, scale, x = w.to(dev), scale.to(dev), x.to(dev)
    out = poisoned((T, N), act, dev)
    lib.call("pl_linear", p(x), F16, 0, T, K, p(w), E4M3, p(scale), N, p(out), F16)
    ref = x.double().cpu() @ dequant(w.cpu().float(), scale.cpu()).T
    assert ref.abs().max() < 60000
    check(out, ref, 3e-3, "linear with large partial sums")
    # SwiGLU of large gate/up values whose product still fits fp16.
    g = torch.tensor([[-2e4, -80.0, 200.0, 250.0, 30000.0]], dtype=act, device=dev)
    u = torch.tensor([[3e4, 500.0, 300.0, -250.0, 2.0]], dtype=act, device=dev)
    out = poisoned(g.shape, act, dev)
    lib.call("pl_silu_mul", p(g), p(u), F16, 1, g.numel(), p(out), F16, 0)
    check(out, F.silu(g.double()) * u.double(), 2e-3, "silu_mul large")
    # rmsnorm / add_rmsnorm of rows with |x| ~ 1e4 (sum of squares ~ 1e11).
    D = 256
    x = rnd(2, D, dtype=act, device=dev, scale=2e4).clamp(-60000, 60000)
    residual = rnd(2, D, device=dev, scale=1e5)
    new_residual = residual.double() + x.double()
    w = rnd(D, device=dev, scale=0.2)
    out = poisoned((2, D), act, dev)
    lib.call("pl_add_rmsnorm", p(x), F16, p(residual), p(w), F32, p(out), F16, 2, D, 1e-6)
    check(out, ref_rmsnorm(new_residual, w, 1e-6), 2e-3, "add_rmsnorm large")


# ---- Beyond fp16's range: fp32 outputs of the linear, the row-scaled SwiGLU, the fp32 residual input. -------
# With fp16 activations the row-parallel outputs (o_proj, out_proj, down_proj), gate/up and the logits are
# written in fp32 and the MLP intermediate is scaled per row, because their values can pass 65504.

def pow2_row_scale_ref(h: torch.Tensor) -> torch.Tensor:
    """The documented row scale, computed independently: the least power of two s with max|h| / s <= 2^15."""
    amax = h.abs().amax(-1).double()
    return torch.where(amax > 2.0 ** 15, 2.0 ** torch.ceil(torch.log2(amax / 2.0 ** 15)), torch.ones_like(amax))


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("T,N,K", LINEAR_SHAPES)
def test_linear_fp32_output_beyond_fp16_range(lib, act, T, N, K):
    """Outputs near 1e6 (fp16 would be inf), each row times its input row scale (powers of two up to 2^8)."""
    dev, gen = lib.device, torch.Generator().manual_seed(T * 1_000_003 + N * 1009 + K)   # not the test order's
    w, scale = fp8_weight(N, K, dev, gen)
    scale = scale * 10.0 + 0.05     # weights ~3-10: (1, 96, 90) is one block, whose scale alone sets the size
    x = rnd(T, K, dtype=act, device=dev, scale=5000.0, gen=gen)
    rs = (2.0 ** torch.arange(T).remainder(9)).float().to(dev)                      # (T,)
    out = poisoned((T, N), torch.float32, dev)
    lib.call("pl_linear", p(x), CODE[act], p(rs), T, K, p(w), E4M3, p(scale), N, p(out), F32)
    ref = (x.double().cpu() @ dequant(w.cpu().float(), scale.cpu()).T) * rs.double().cpu()[:, None]
    assert ref.abs().max() > 1e5
    check(out, ref, 2e-5 if act == torch.float32 else 1e-3, f"linear fp32 out T={T} N={N} K={K}")


@pytest.mark.parametrize("T,N,K", [(3, 48, 80), (20, 96, 256)])
def test_linear_dense_fp32_output(lib, T, N, K):
    """The lm_head path (dense fp16 weight): fp32 logits from fp16 activations."""
    dev = lib.device
    w = rnd(N, K, dtype=torch.float16, device=dev, scale=30.0)
    x = rnd(T, K, dtype=torch.float16, device=dev, scale=300.0)
    out = poisoned((T, N), torch.float32, dev)
    lib.call("pl_linear", p(x), F16, 0, T, K, p(w), CODE[torch.float16], 0, N, p(out), F32)
    ref = x.double().cpu() @ w.double().cpu().T
    assert ref.abs().max() > 1e5
    check(out, ref, 1e-3, "linear dense fp32 out")


def test_linear_refuses_fp16_output_from_fp32(lib):
    x, w = rnd(2, 64, device=lib.device), rnd(8, 64, device=lib.device)
    out = poisoned((2, 8), torch.float16, lib.device)
    with pytest.raises(RuntimeError, match="output dtype 1: must be the activation dtype"):
        lib.call("pl_linear", p(x), F32, 0, 2, 64, p(w), F32, 0, 8, p(out), F16)


def test_silu_mul_row_scaled_to_fp16(lib):
    """fp32 gate/up whose products reach 1e7: fp16 out divided per row by a power of two, never inf."""
    dev = lib.device
    T, I = 4, 300
    g, u = rnd(T, I, device=dev, scale=50.0), rnd(T, I, device=dev, scale=100.0)
    u[0] *= 4.0
    g[1] *= 40.0
    u[2] *= 1e-3                                                     # a row inside the range keeps scale 1
    g[3, 17], u[3, 17] = 3000.0, 4000.0                              # one huge element sets its row's scale
    ref = F.silu(g.double().cpu()) * u.double().cpu()                # (T, I)
    out, rs = poisoned((T, I), torch.float16, dev), poisoned((T,), torch.float32, dev)
    lib.call("pl_silu_mul", p(g), p(u), F32, T, I, p(out), F16, p(rs))
    want_rs = pow2_row_scale_ref(ref)
    assert ref.abs().max() > 1e6 and want_rs[2] == 1 and (want_rs > 1).sum() == 3
    assert torch.equal(rs.cpu().double(), want_rs)
    assert torch.isfinite(out).all() and out.abs().max() <= 2.0 ** 15
    check(out.double().cpu() * rs.double().cpu()[:, None], ref, 1e-3, "silu_mul row-scaled")
    out32 = poisoned((T, I), torch.float32, dev)                     # fp32 out, no scale: plain
    lib.call("pl_silu_mul", p(g), p(u), F32, T, I, p(out32), F32, 0)
    check(out32, ref, 2e-5, "silu_mul fp32")


def test_add_rmsnorm_of_fp32_input_beyond_fp16(lib):
    """The residual add takes the fp32 row-parallel output (values ~1e6) and writes the norm in fp16."""
    dev, D = lib.device, 200
    x, residual = rnd(3, D, device=dev, scale=1e6), rnd(3, D, device=dev, scale=10.0)
    w = rnd(D, device=dev, scale=0.2)
    new_residual = residual.double() + x.double()
    out = poisoned((3, D), torch.float16, dev)
    lib.call("pl_add_rmsnorm", p(x), F32, p(residual), p(w), F32, p(out), F16, 3, D, 1e-6)
    check(residual, new_residual, 1e-6, "add_rmsnorm fp32 x residual")
    check(out, ref_rmsnorm(new_residual, w, 1e-6), 2e-3, "add_rmsnorm fp32 x normed")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("lo,V", [(0, 40), (40, 37), (77, 0), (100, 28)])   # shards of a 128-row vocabulary
def test_embed_shard(lib, act, lo, V):
    """pl_embed_shard: rows of ids in [lo, lo + V) from the shard's table, zeros for the rest (a ragged last shard,
    an empty one); summed over the shards, the full lookup."""
    dev = lib.device
    full = rnd(128, 72, dtype=torch.bfloat16, device=dev)
    ids = torch.tensor([0, 39, 40, 76, 77, 100, 127, 5, 63], device=dev)
    out = poisoned((ids.numel(), 72), act, dev)
    before = launches(lib)
    lib.call("pl_embed_shard", p(ids), ids.numel(), p(full[lo:lo + V].contiguous()), BF16, lo, V, 72, p(out),
             CODE[act])
    assert launches(lib) - before == 1
    own = ((ids >= lo) & (ids < lo + V)).cpu()
    want = torch.where(own[:, None], full.double().cpu()[ids.cpu()], 0.0)
    assert torch.equal(out.double().cpu(), want.to(act).double())


# ---- Paged attention: prefill (cached prefix + new rows, varlen) and decode (split-K). --------------------

def attention_case(dev, act, Hq, Hk, Dh, ctx_lens, q_lens, max_blocks, bs=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    B = len(ctx_lens)
    num_blocks = B * max_blocks + 3
    k_cache = rnd(num_blocks, bs, Hk, Dh, dtype=act, gen=gen)
    v_cache = rnd(num_blocks, bs, Hk, Dh, dtype=act, gen=gen)
    perm = torch.randperm(num_blocks, generator=gen)[:B * max_blocks]
    block_tables = perm.reshape(B, max_blocks).to(torch.int32)
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    query_start = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    T = int(query_start[-1])
    q = rnd(T, Hq, Dh, dtype=act, gen=gen)
    ref = ref_attention(q, k_cache, v_cache, block_tables, context_lens, query_start, Dh ** -0.5)
    to = lambda t: t.to(dev)
    return [to(t) for t in (q, k_cache, v_cache, block_tables, context_lens, query_start)], ref


def run_attention(lib, act, tensors, max_blocks, bs=16):
    q, k_cache, v_cache, block_tables, context_lens, query_start = tensors
    T, Hq, Dh = q.shape
    Hk, B = k_cache.shape[2], len(context_lens)
    nbytes = lib.lib.pl_attention_workspace_bytes(T, Hq, Dh, max_blocks, bs)
    ws = poisoned((max(nbytes // 4, 1),), torch.float32, lib.device)
    out = poisoned((T, Hq, Dh), act, lib.device)
    lib.call("pl_attention", p(q), CODE[act], T, Hq, Hk, Dh, p(k_cache), p(v_cache), bs, p(block_tables),
             max_blocks, p(context_lens), p(query_start), B, Dh ** -0.5, p(out), p(ws), nbytes)
    return out, nbytes


ATTN_CASES = [  # (Hq, Hk, Dh, context lens, query lens, max_blocks, expect split-K)
    (6, 1, 64, [1, 37, 300], [1, 1, 1], 40, True),             # decode, TP4 27B heads, splits of 256
    (4, 2, 32, [16, 513], [1, 1], 64, True),                   # decode, exact block edge, 4 splits
    (2, 1, 256, [20, 5], [1, 1], 2, False),                    # decode at head_dim 256, one split
    (6, 1, 64, [9, 40], [9, 7], 4, False),                     # prefill: fresh prompt + cached prefix
    (4, 2, 32, [33, 18, 1], [5, 18, 1], 3, False),             # mixed prefill/decode rows
    (3, 1, 32, [290, 17], [11, 17], 20, True),                 # chunked prefill with split-K
    (16, 2, 16, [40, 30], [37, 29], 3, False),                 # many rows, short block table: one split
    (10, 1, 48, [20, 3], [4, 1], 2, False),                    # GQA group > 8 (two chunks), ragged head_dim
]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("Hq,Hk,Dh,ctx,ql,mb,split", ATTN_CASES)
def test_attention(lib, act, Hq, Hk, Dh, ctx, ql, mb, split):
    tensors, ref = attention_case(lib.device, act, Hq, Hk, Dh, ctx, ql, mb)
    out, nbytes = run_attention(lib, act, tensors, mb)
    assert (nbytes > 0) == split
    check(out, ref, TOL[act] * 2, "attention")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("case", [0, 3, 5])                    # decode split-K, prefill one split, prefill split-K
def test_attention_gated(lib, act, case):
    """pl_attention_gated = pl_attention's output (rounded to act) * sigmoid(gate), in the kernel's epilogue and in
    the split merge."""
    Hq, Hk, Dh, ctx, ql, mb, split = ATTN_CASES[case]
    (q, k_cache, v_cache, bt, cl, qs), ref = attention_case(lib.device, act, Hq, Hk, Dh, ctx, ql, mb)
    T, B = q.shape[0], len(cl)
    gate = rnd(T, Hq * Dh, dtype=act, device=lib.device, scale=3, gen=torch.Generator().manual_seed(7))
    nbytes = lib.lib.pl_attention_workspace_bytes(T, Hq, Dh, mb, 16)
    assert (nbytes > 0) == split
    ws = poisoned((max(nbytes // 4, 1),), torch.float32, lib.device)
    out = poisoned((T, Hq, Dh), act, lib.device)
    lib.call("pl_attention_gated", p(q), CODE[act], T, Hq, Hk, Dh, p(k_cache), p(v_cache), 16, p(bt), mb, p(cl),
             p(qs), B, Dh ** -0.5, p(out), p(gate), p(ws), nbytes)
    want = ref.to(act).double() * torch.sigmoid(gate.double().cpu()).view(T, Hq, Dh)
    check(out, want, TOL[act] * 2, "gated attention")


def launches(lib) -> int:
    count = lib.ffi.new("uint64_t*")
    lib.lib.pl_launch_count(count)
    return count[0]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("case", range(len(ATTN_CASES)))
def test_attention_merged(lib, act, gated, case):
    """pl_attention_merged: the split-K merge done by the last split block of each row, one launch, the same bits
    as pl_attention(_gated)'s two (the same merge code, the same order) and within tolerance of float64; the
    counters are left zero, so a second call gives the same output."""
    Hq, Hk, Dh, ctx, ql, mb, split = ATTN_CASES[case]
    (q, k_cache, v_cache, bt, cl, qs), ref = attention_case(lib.device, act, Hq, Hk, Dh, ctx, ql, mb)
    T, B = q.shape[0], len(cl)
    gate = rnd(T, Hq * Dh, dtype=act, device=lib.device, scale=3, gen=torch.Generator().manual_seed(7))
    nbytes = lib.lib.pl_attention_workspace_bytes(T, Hq, Dh, mb, 16)
    ws = poisoned((max(nbytes // 4, 1),), torch.float32, lib.device)
    args = (p(q), CODE[act], T, Hq, Hk, Dh, p(k_cache), p(v_cache), 16, p(bt), mb, p(cl), p(qs), B, Dh ** -0.5)
    two = poisoned((T, Hq, Dh), act, lib.device)
    if gated:
        lib.call("pl_attention_gated", *args, p(two), p(gate), p(ws), nbytes)
    else:
        lib.call("pl_attention", *args, p(two), p(ws), nbytes)
    counters = torch.zeros(4096, dtype=torch.int32, device=lib.device)
    for _ in range(2):
        one = poisoned((T, Hq, Dh), act, lib.device)
        ws.fill_(float("nan"))
        before = launches(lib)
        lib.call("pl_attention_merged", *args, p(one), p(gate) if gated else 0, p(ws), nbytes, p(counters))
        assert launches(lib) - before == 1
        assert not counters.any()
        assert torch.equal(one, two)
    want = ref.to(act).double() * torch.sigmoid(gate.double().cpu()).view(T, Hq, Dh) if gated else ref
    check(one, want, TOL[act] * 2, "merged attention")


@pytest.mark.parametrize("act", ACTS)
def test_qk_norm_rope_kv(lib, act):
    """pl_qk_norm_rope_kv = pl_qk_norm_rope then pl_kv_write of its k (and v), in one launch; a negative slot is
    skipped; q_out as pl_qk_norm_rope's."""
    dev, T, Hq, Hk, Dh, R = lib.device, 5, 6, 2, 64, 8
    q, k, v = rnd(T, Hq, Dh, dtype=act, device=dev), rnd(T, Hk, Dh, dtype=act, device=dev), \
        rnd(T, Hk, Dh, dtype=act, device=dev)
    q_w, k_w = rnd(Dh, device=dev, scale=0.2), rnd(Dh, device=dev, scale=0.2)
    positions = torch.tensor([0, 7, 300, 5, 41], device=dev)
    inv_freq = (1e4 ** (-torch.arange(0, 2 * R, 2, dtype=torch.float32) / (2 * R))).to(dev)
    slots = torch.tensor([3, -1, 17, 0, 30], device=dev)
    kc, vc = rnd(4, 8, Hk, Dh, dtype=act, device=dev), rnd(4, 8, Hk, Dh, dtype=act, device=dev)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_ref, k_ref = poisoned((T, Hq, Dh), act, dev), poisoned((T, Hk, Dh), act, dev)
    lib.call("pl_qk_norm_rope", p(q), p(k), p(q_ref), p(k_ref), CODE[act], T, Hq, Hk, Dh, p(q_w), p(k_w), F32, 1e-6,
             p(positions), p(inv_freq), R)
    lib.call("pl_kv_write", p(k_ref), p(v), CODE[act], T, Hk, Dh, p(kc_ref), p(vc_ref), CODE[act], p(slots))
    q_out = poisoned((T, Hq, Dh), act, dev)
    lib.call("pl_qk_norm_rope_kv", p(q), p(k), p(v), p(q_out), CODE[act], T, Hq, Hk, Dh, p(q_w), p(k_w), F32, 1e-6,
             p(positions), p(inv_freq), R, p(kc), p(vc), CODE[act], p(slots))
    assert torch.equal(q_out, q_ref) and torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)   # (kc_ref: written)


def test_attention_rejects_small_workspace(lib):
    tensors, _ = attention_case(lib.device, torch.float32, 6, 1, 64, [300], [1], 40)
    q, k_cache, v_cache, bt, cl, qs = tensors
    out = poisoned(q.shape, torch.float32, lib.device)
    with pytest.raises(RuntimeError, match="workspace"):
        lib.call("pl_attention", p(q), F32, 1, 6, 1, 64, p(k_cache), p(v_cache), 16, p(bt), 40, p(cl), p(qs), 1,
                 0.125, p(out), 0, 0)


# ---- Gated DeltaNet: conv1d and the delta rule, prefill then decode continuing from the same state. --------

@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("W", [4, 2])
def test_conv1d(lib, act, W):
    dev = lib.device
    C, S = 40, 5
    w = rnd(C, W, device=dev, scale=0.5)
    state = rnd(S, C, W - 1, dtype=act, device=dev)
    slot_ids = torch.tensor([3, 0, 4], dtype=torch.int32, device=dev)
    for q_lens in ([6, 1, 2], [1, 1, 1], [70, 0, 5]):          # prefill (ragged), decode, rows past a 64-row chunk
        query_start = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=dev)
        T = sum(q_lens)
        x = rnd(T, C, dtype=act, device=dev)
        ref, ref_state = ref_conv1d(x.cpu(), w.cpu(), state.cpu(), slot_ids.cpu(), query_start.cpu())
        out = poisoned((T, C), act, dev)
        lib.call("pl_conv1d", p(x), CODE[act], T, C, p(w), F32, W, p(state), CODE[act], p(slot_ids),
                 p(query_start), 3, p(out))
        check(out, ref, TOL[act], "conv1d out")
        check(state, ref_state, 1e-7 if act == torch.float32 else 1e-3, "conv1d state")


GDN_CASES = [(4, 12, 16, 16), (1, 3, 32, 40), (2, 2, 128, 128)]    # (Hk, Hv, Dk, Dv): TP4 27B heads, ragged Dv


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", GDN_CASES)
def test_gated_delta(lib, act, Hk, Hv, Dk, Dv):
    dev = lib.device
    S = 4
    gen = torch.Generator().manual_seed(1)
    state = rnd(S, Hv, Dk, Dv, gen=gen, scale=0.1).to(dev)
    slot_ids = torch.tensor([2, 0], dtype=torch.int32, device=dev)
    lens = [[5, 3], [1, 1]] if Dk < 128 else [[3, 2], [1, 1]]   # prefill, then a decode step
    for q_lens in lens:
        query_start = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=dev)
        T = sum(q_lens)
        q, k = rnd(T, Hk, Dk, dtype=act, gen=gen).to(dev), rnd(T, Hk, Dk, dtype=act, gen=gen).to(dev)
        v = rnd(T, Hv, Dv, dtype=act, gen=gen).to(dev)
        g = (-torch.rand(T, Hv, generator=gen) * 2).to(dev)
        beta = torch.rand(T, Hv, generator=gen).to(dev)
        ref, ref_state = ref_gated_delta(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), state.cpu(),
                                         slot_ids.cpu(), query_start.cpu())
        out = poisoned((T, Hv, Dv), act, dev)
        lib.call("pl_gated_delta", p(q), p(k), p(v), CODE[act], T, Hk, Hv, Dk, Dv, p(g), p(beta), p(state),
                 p(slot_ids), p(query_start), 2, p(out))
        check(out, ref, TOL[act] * 2, "gated_delta out")
        check(state, ref_state, 2e-5 if act == torch.float32 else 2e-3, "gated_delta state")


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", GDN_CASES)
def test_gated_delta_rmsnorm(lib, act, Hk, Hv, Dk, Dv):
    """pl_gated_delta_rmsnorm: the delta rule, then the gated RMSNorm of its output (rounded to the activation type,
    as pl_gated_delta writes it) in one launch, against the float64 references of both; the state as pl_gated_delta
    leaves it. Prefill rows, then a decode step."""
    dev = lib.device
    gen = torch.Generator().manual_seed(2)
    state = rnd(4, Hv, Dk, Dv, gen=gen, scale=0.1).to(dev)
    slot_ids = torch.tensor([2, 0], dtype=torch.int32, device=dev)
    w = rnd(Dv, gen=gen).to(dev)
    for q_lens in ([4, 3], [1, 1]):
        query_start = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=dev)
        T = sum(q_lens)
        q, k = rnd(T, Hk, Dk, dtype=act, gen=gen).to(dev), rnd(T, Hk, Dk, dtype=act, gen=gen).to(dev)
        v, z = rnd(T, Hv, Dv, dtype=act, gen=gen).to(dev), rnd(T, Hv, Dv, dtype=act, gen=gen, scale=2).to(dev)
        g = (-torch.rand(T, Hv, generator=gen) * 2).to(dev)
        beta = torch.rand(T, Hv, generator=gen).to(dev)
        o, ref_state = ref_gated_delta(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), state.cpu(), slot_ids.cpu(),
                                       query_start.cpu())
        o = o.to(act).double()                                  # the kernel rounds o where pl_gated_delta writes it
        ref = w.double().cpu() * o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * F.silu(z.double().cpu())
        out = poisoned((T, Hv, Dv), act, dev)
        lib.call("pl_gated_delta_rmsnorm", p(q), p(k), p(v), CODE[act], T, Hk, Hv, Dk, Dv, p(g), p(beta), p(state),
                 p(slot_ids), p(query_start), 2, p(z), p(w), F32, 1e-6, p(out))
        check(out, ref, TOL[act] * 2, "gated_delta_rmsnorm out")
        check(state, ref_state, 2e-5 if act == torch.float32 else 2e-3, "gated_delta_rmsnorm state")
        state = ref_state.float().to(dev)


def test_gated_delta_rmsnorm_refuses_wide_heads(lib):
    """Dv over 128 does not fit one block: refused with the way out named, nothing written."""
    dev = lib.device
    t = torch.zeros(1, 1, 160, device=dev)
    with pytest.raises(RuntimeError, match="pl_gated_delta and pl_gated_rmsnorm"):
        lib.call("pl_gated_delta_rmsnorm", p(t), p(t), p(t), F32, 1, 1, 1, 160, 160, p(t), p(t), p(t), p(t), p(t),
                 1, p(t), p(t), F32, 1e-6, p(t))


# ---- The Python binding: pocketllm.NativeOps on the CPU build against pocketllm.TorchOps, op by op. --------
# (NativeOps allocates its outputs with torch.empty, so poisoning is left to the tests above.)

def _pocketllm():
    import pocketllm
    return pocketllm


def _nativeops_cases(pl, act):
    """(op name, args) for every op, at the TP4 27B head counts with small head dims; fresh tensors per call."""
    g = torch.Generator().manual_seed(3)
    r = lambda *s, scale=1.0, dtype=act: rnd(*s, dtype=dtype, scale=scale, gen=g)
    T, D, Hq, Hk, Dh = 7, 96, 6, 1, 64
    w8, s8 = fp8_weight(150, 256, "cpu", gen=g)
    bs, nb = 16, 8
    block_tables = torch.tensor([[3, 5, 0], [1, 7, 2]], dtype=torch.int32)
    Hkg, Hv, Dk, Dv, C, W = 4, 12, 16, 16, 80, 4
    qs = torch.tensor([0, 5, 7], dtype=torch.int32)
    return [
        ("embed", (torch.tensor([3, 0, 36, 5, 5, 17, 1]), r(37, D, dtype=torch.bfloat16))),
        ("embed_shard", (torch.tensor([3, 40, 36, 5, 75, 17, 1]), r(30, D, dtype=torch.bfloat16), 10)),
        ("embed_shard", (torch.tensor([3, 40]), r(1, D, dtype=torch.bfloat16), 50)),      # no id in the shard
        ("rmsnorm", (r(T, D), r(D, scale=0.2, dtype=torch.float32), 1e-6)),     # norm weights load as fp32
        ("add_rmsnorm", (r(T, D), r(T, D, dtype=torch.float32, scale=3), r(D, scale=0.2, dtype=torch.float32), 1e-6)),
        ("add_rmsnorm", (r(T, D, dtype=torch.float32, scale=1e5), r(T, D, dtype=torch.float32, scale=3),
                         r(D, scale=0.2, dtype=torch.float32), 1e-6, act)),
        ("linear", (r(3, 256), pl.Linear(w8, s8))),
        ("linear", (r(3, 256, scale=300), pl.Linear(w8, s8), torch.float32)),
        ("linear", (r(20, 256, scale=300), pl.Linear(w8, s8), torch.float32)),
        ("silu_mul_linear", (r(3, 256, scale=40, dtype=torch.float32), r(3, 256, scale=90, dtype=torch.float32),
                             pl.Linear(r(48, 256, scale=0.1, dtype=torch.bfloat16), None), act)),
        ("silu_mul_linear", (r(20, 256, scale=40, dtype=torch.float32), r(20, 256, scale=90, dtype=torch.float32),
                             pl.Linear(*fp8_weight(96, 256, "cpu", gen=g)), act)),
        ("linear", (r(20, 256), pl.Linear(w8, s8))),
        ("mlp", (r(3, 256, scale=40), pl.Linear(*fp8_weight(256, 256, "cpu", gen=g)),
                 pl.Linear(r(48, 128, scale=0.1, dtype=torch.bfloat16), None), act)),       # decode: pl_linear_glu
        ("mlp", (r(20, 256, scale=40), pl.Linear(*fp8_weight(256, 256, "cpu", gen=g)),
                 pl.Linear(*fp8_weight(96, 128, "cpu", gen=g)), act)),                      # prefill: 3 launches
        ("mlp", (r(5, 256, scale=40), pl.Linear(*fp8_weight(256, 256, "cpu", gen=g)),
                 pl.Linear(*fp8_weight(96, 128, "cpu", gen=g)), act)),                      # decode FP8: pl_mlp
        ("linear_parts", (r(3, 256), pl.Linear(w8, s8), [128, 22])),                 # FP8: parts end on blocks
        ("linear_parts", (r(20, 256, scale=300), pl.Linear(w8, s8), [128, 22], torch.float32)),
        ("linear_parts", (r(5, 64), pl.Linear(r(48, 64, scale=0.1, dtype=torch.bfloat16), None), [20, 4, 4, 20])),
        ("linear", (r(5, 64), pl.Linear(r(48, 64, scale=0.1, dtype=torch.bfloat16), None))),
        ("silu_mul", (r(T, 130, scale=3), r(T, 130))),
        ("sigmoid_mul", (r(T, 130), r(T, 130, scale=3))),
        ("qk_norm_rope", (r(T, Hq, Dh), r(T, Hk, Dh), r(Dh, scale=0.2, dtype=torch.float32),
                          r(Dh, scale=0.2, dtype=torch.float32), 1e-6, torch.arange(T) * 37,
                          1e7 ** (-torch.arange(0, 16, 2, dtype=torch.float32) / 16))),
        ("kv_write", (r(T, Hk, Dh), r(T, Hk, Dh), r(nb, bs, Hk, Dh), r(nb, bs, Hk, Dh),
                      torch.tensor([48, 49, 50, 80, 81, 16, 17]))),
        ("attention", (r(T, Hq, Dh), r(nb, bs, Hk, Dh), r(nb, bs, Hk, Dh), block_tables,
                       torch.tensor([40, 2], dtype=torch.int32), qs, Dh ** -0.5)),
        ("attention", (r(T, Hq, Dh), r(nb, bs, Hk, Dh), r(nb, bs, Hk, Dh), block_tables,      # gated, split
                       torch.tensor([40, 2], dtype=torch.int32), qs, Dh ** -0.5, r(T, Hq * Dh, scale=3))),
        ("attention", (r(2, Hq, Dh), r(nb, bs, Hk, Dh), r(nb, bs, Hk, Dh), block_tables,      # gated, decode
                       torch.tensor([40, 20], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32),
                       Dh ** -0.5, r(2, Hq * Dh, scale=3))),
        ("qk_norm_rope_kv", (r(T, Hq, Dh), r(T, Hk, Dh), r(T, Hk, Dh), r(Dh, scale=0.2, dtype=torch.float32),
                             r(Dh, scale=0.2, dtype=torch.float32), 1e-6, torch.arange(T) * 37,
                             1e7 ** (-torch.arange(0, 16, 2, dtype=torch.float32) / 16), r(nb, bs, Hk, Dh),
                             r(nb, bs, Hk, Dh), torch.tensor([48, 49, 50, 80, 81, 16, 17]))),
        ("conv1d", (r(T, C), r(C, W, scale=0.5, dtype=torch.float32), r(4, C, W - 1), torch.tensor([2, 0], dtype=torch.int32), qs)),
        ("gdn_in_proj", (r(2, 256), pl.Linear(w8, s8), [128, 22], r(128, W, scale=0.5, dtype=torch.float32),   # decode:
                         r(3, 128, W - 1), torch.tensor([2, 0], dtype=torch.int32),                  # the conv in
                         torch.tensor([0, 1, 2], dtype=torch.int32))),                               # the epilogue
        ("gdn_in_proj", (r(T, 256), pl.Linear(w8, s8), [128, 22], r(128, W, scale=0.5, dtype=torch.float32),
                         r(3, 128, W - 1), torch.tensor([2, 0], dtype=torch.int32), qs)),
        ("gdn_in_proj_gates", (r(2, 256), pl.Linear(w8, s8), [128, 22], r(128, W, scale=0.5, dtype=torch.float32),
                               r(3, 128, W - 1), torch.tensor([2, 0], dtype=torch.int32),   # decode: one launch
                               torch.tensor([0, 1, 2], dtype=torch.int32),
                               pl.Linear(r(2 * Hv, 256, scale=0.3), None), r(Hv, scale=0.5, dtype=torch.float32),
                               r(Hv, dtype=torch.float32))),
        ("gdn_in_proj_gates", (r(T, 256), pl.Linear(w8, s8), [128, 22], r(128, W, scale=0.5, dtype=torch.float32),
                               r(3, 128, W - 1), torch.tensor([2, 0], dtype=torch.int32), qs,   # prefill: the ops
                               pl.Linear(r(2 * Hv, 256, scale=0.3, dtype=torch.bfloat16), None),
                               r(Hv, scale=0.5, dtype=torch.float32), r(Hv, dtype=torch.float32))),
        ("gdn_gates", (r(T, Hv, scale=3), r(T, Hv, scale=3), r(Hv, scale=0.5, dtype=torch.float32), r(Hv, dtype=torch.float32))),
        ("gdn_gates_linear", (r(T, 64), pl.Linear(r(2 * Hv, 64, scale=0.3, dtype=torch.bfloat16), None),
                              r(Hv, scale=0.5, dtype=torch.float32), r(Hv, dtype=torch.float32))),
        ("gated_delta", (r(T, Hkg, Dk), r(T, Hkg, Dk), r(T, Hv, Dv), -torch.rand(T, Hv, generator=g),
                         torch.rand(T, Hv, generator=g), r(3, Hv, Dk, Dv, dtype=torch.float32, scale=0.1),
                         torch.tensor([2, 0], dtype=torch.int32), qs)),
        ("gated_delta", (r(2, Hkg, Dk), r(2, Hkg, Dk), r(2, Hv, Dv), -torch.rand(2, Hv, generator=g),
                         torch.rand(2, Hv, generator=g), r(3, Hv, Dk, Dv, dtype=torch.float32, scale=0.1),
                         torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32))),
        ("gated_rmsnorm", (r(T, Hv, Dv), r(T, Hv, Dv, scale=2), r(Dv, dtype=torch.float32), 1e-6)),
        ("gated_delta_rmsnorm", (r(T, Hkg, Dk), r(T, Hkg, Dk), r(T, Hv, Dv), -torch.rand(T, Hv, generator=g),
                                 torch.rand(T, Hv, generator=g), r(3, Hv, Dk, Dv, dtype=torch.float32, scale=0.1),
                                 torch.tensor([2, 0], dtype=torch.int32), qs, r(T, Hv, Dv, scale=2),
                                 r(Dv, dtype=torch.float32), 1e-6)),
        ("gated_delta_rmsnorm", (r(2, Hkg, Dk), r(2, Hkg, Dk), r(2, Hv, Dv), -torch.rand(2, Hv, generator=g),
                                 torch.rand(2, Hv, generator=g), r(3, Hv, Dk, Dv, dtype=torch.float32, scale=0.1),
                                 torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32),
                                 r(2, Hv, Dv, scale=2), r(Dv, dtype=torch.float32), 1e-6)),
    ]


def _clone(a):
    if isinstance(a, torch.Tensor):
        return a.clone()
    return a


@pytest.mark.parametrize("act", ACTS)
def test_nativeops_match_torchops(act):
    """Every op through pocketllm.NativeOps (the cffi wrappers) equals pocketllm.TorchOps, including the state
    each op updates in place (residual, KV cache, conv state, recurrent state), with NativeOps' decode fusions as
    shipped and all switched on (pl_mlp, pl_linear_glu up to 16 tokens, the merge inside attention's launch)."""
    pl = _pocketllm()
    _LIBS.setdefault("cpu", _load("cpu"))
    nops, tops = pl.NativeOps("cpu"), pl.TorchOps()
    tol = {torch.float32: 1e-4, torch.float16: 5e-3}[act]
    fused = pl.NativeOps("cpu")
    fused.mlp_tokens = fused.glu_tokens = pl.GEMV_MAX_TOKENS
    fused.merged_attention = True
    for nops, (name, args) in itertools.product((nops, fused), _nativeops_cases(pl, act)):
        a_n, a_t = [_clone(a) for a in args], [_clone(a) for a in args]
        if name in ("embed", "embed_shard"):
            a_n.append(act)
            a_t.append(act)
        out_n, out_t = getattr(nops, name)(*a_n), getattr(tops, name)(*a_t)
        outs_n = out_n if isinstance(out_n, tuple) else (out_n,)
        outs_t = out_t if isinstance(out_t, tuple) else (out_t,)
        for i, (o_n, o_t) in enumerate(zip(outs_n, outs_t)):
            if o_t is not None:
                check(o_n, o_t, tol, f"{name} output {i}")
        for i, (x_n, x_t) in enumerate(zip(a_n, a_t)):       # in-place state updates (add_rmsnorm returns its
            if isinstance(x_t, torch.Tensor) and x_t.is_floating_point() and name != "add_rmsnorm":   # residual)
                check(x_n, x_t, tol, f"{name} argument {i} after the call")


@pytest.mark.parametrize("act", ACTS)
def test_nativeops_prenorm_matches_torchops(act):
    """NativeOps.prenorm leaves the residual add + norm to the projections that read its output (pl_norm_linear_*):
    linear_parts, gdn_gates_linear, mlp and linear of it equal TorchOps' add_rmsnorm followed by the same op, and
    the new residual stream (written by the first of them) equals TorchOps'. Prefill sizes, fp16 x and sizes
    above NativeOps.prologue_tokens take add_rmsnorm itself."""
    pl = _pocketllm()
    _LIBS.setdefault("cpu", _load("cpu"))
    nops, tops = pl.NativeOps("cpu"), pl.TorchOps()
    tol = {torch.float32: 1e-4, torch.float16: 5e-3}[act]
    g = torch.Generator().manual_seed(5)
    r = lambda *s, scale=1.0, dtype=torch.float32: rnd(*s, dtype=dtype, scale=scale, gen=g)   # noqa: E731
    w8 = pl.Linear(*fp8_weight(256, 256, "cpu", gen=g))
    consumers = [("linear_parts", (w8, [128, 128])),                           # in a layer's order: the first
                 ("gdn_gates_linear", (pl.Linear(r(24, 256, scale=0.3, dtype=torch.bfloat16), None),   # writes
                                       r(12, scale=0.5), r(12))),                                    # the residual
                 ("mlp", (w8, pl.Linear(r(48, 128, scale=0.1, dtype=torch.bfloat16), None), act)),
                 ("mlp", (w8, pl.Linear(*fp8_weight(200, 128, "cpu", gen=g)), act)),      # pl_mlp
                 ("linear", (w8, torch.float32))]
    # Both settings of the two decode fusions: on up to 16 tokens, and the defaults (prologue off, GLU at T = 1).
    # (prologue_tokens, glu_tokens, mlp_tokens, T, x dtype): all on up to 16 tokens (pl_mlp), the GLU path with the
    # prologue, and the shipped defaults.
    cases = [(16, 16, 16, T, x_dtype) for T, x_dtype in [(3, torch.float32), (16, torch.float32),
                                                          (20, torch.float32), (3, act)]] + \
        [(16, 16, 0, 3, torch.float32), (0, 1, 0, 1, torch.float32), (0, 1, 0, 3, torch.float32)]
    for prologue, glu, mlp, T, x_dtype in cases:
        nops.prologue_tokens, nops.glu_tokens, nops.mlp_tokens = prologue, glu, mlp
        x, res, w = r(T, 256, scale=2, dtype=x_dtype), r(T, 256, scale=3), r(256, scale=0.2)
        h_n, res_n = nops.prenorm(x.clone(), res.clone(), w, 1e-6, act)
        h_t, res_t = tops.prenorm(x, res, w, 1e-6, act)
        assert isinstance(h_n, pl.Prenormed) == (T <= prologue and x_dtype == torch.float32), (T, x_dtype)
        for name, args in consumers:
            out_n, out_t = getattr(nops, name)(h_n, *args), getattr(tops, name)(h_t, *args)
            outs_n = out_n if isinstance(out_n, tuple) else (out_n,)
            outs_t = out_t if isinstance(out_t, tuple) else (out_t,)
            for i, (o_n, o_t) in enumerate(zip(outs_n, outs_t)):
                check(o_n, o_t, tol * 2, f"prenorm then {name} output {i}, T={T}")
        check(res_n, res_t, 1e-6, f"the residual stream after prenorm, T={T}")
