"""The GPU check's Python steps (called by tests/gpu/check.sh; each prints what it measured and writes JSON).

    python tests/gpu/gpu_check.py prereqs LOGDIR   # torch CUDA, GPU, driver, cffi, nvcc, NCCL, the library
    python tests/gpu/gpu_check.py load LOGDIR      # the native library loads and native_status() is ok
    python tests/gpu/gpu_check.py kernels LOGDIR   # fp32-output linears at the real K (5120, 17408) vs torch
    python tests/gpu/gpu_check.py nccl LOGDIR      # a one-rank communicator: unique id, init, all-reduce, destroy
    python tests/gpu/gpu_check.py bench LOGDIR     # kernel bandwidth vs measured copy bandwidth, 27B decode shapes
    python tests/gpu/gpu_check.py decode LOGDIR    # decode tokens/s at batch 1, 8 and 32, 27B shapes, 4 layers,
                                                   # eager and as CUDA graphs
    python tests/gpu/gpu_check.py graphs LOGDIR    # decode by CUDA graph replay == eager, token for token
    python tests/gpu/gpu_check.py model27b LOGDIR [--cpu]   # Qwen3.5-27B, dummy weights: TP1 and a TP4 rank's
                                                   # shapes, bench.py --report; --cpu: pocket-tiny's config here

Timing: after warm-up, the GPU is held busy (torch.cuda._sleep) while the host queues REPS back-to-back calls, so
the CUDA events around them measure the kernels and not Python's launch overhead; the median over many such runs,
divided by REPS. Bandwidth = the bytes a kernel
must move at least (weights, KV cache or recurrent state read, outputs written) / median time; the copy
bandwidth is a device-to-device copy of 2 GiB (read + write counted).
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def save(logdir: Path, name: str, data: dict) -> None:
    (logdir / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")


# ---- Prerequisites: say exactly what is missing instead of failing deep inside a test ----

def prereqs(logdir: Path) -> int:
    info, missing = {}, []
    info["python"] = platform.python_version()
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            info["gpu"] = f"{p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs)"
        else:
            missing.append("torch reports no CUDA device (torch.cuda.is_available() is False)")
    except ImportError:
        missing.append("torch is not installed")
    try:
        import transformers
        info["transformers"] = transformers.__version__
        if importlib.util.find_spec("transformers.models.qwen3_5") is None:
            missing.append(f"transformers {transformers.__version__} has no Qwen3.5 (qwen3_5): the parity and "
                           "reference checks need transformers>=5.2")
    except ImportError:
        missing.append("transformers is not installed (the parity and reference checks need it)")
    try:
        import cffi
        info["cffi"] = cffi.__version__
    except ImportError:
        missing.append("cffi is not installed (pip install cffi)")
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True)
        info["nvidia_smi"] = q.stdout.strip()
    import build
    info["nvcc"] = build.find_nvcc() or "not found (the prebuilt library must load as it is)"
    lib = ROOT / "build" / "libpocketllm.so"
    info["library"] = str(lib) if lib.exists() else "not built"
    if lib.exists():
        info["cuda_driver"] = cuda_driver_line(missing)
    if not lib.exists() and not build.find_nvcc():
        missing.append("build/libpocketllm.so is not there and nvcc is not available to build it")
    try:
        import nvidia.nccl  # noqa: F401
        info["nccl"] = "nvidia-nccl wheel"
    except ImportError:
        info["nccl"] = "no nvidia-nccl wheel; libnccl.so.2 from the system search path if any"
    info["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip() or "unknown"
    info["missing"] = missing
    save(logdir, "prereqs", info)
    for k, v in info.items():
        print(f"{k:12s} {v}")
    return 1 if missing else 0


def cuda_driver_line(missing: list[str]) -> str:
    """"driver supports CUDA 12.4, library carries CUDA 13.0", and a missing entry when the driver is too old."""
    import pocketllm
    try:
        lib = pocketllm.load_native()
        driver, runtime = lib.cuda_versions()
        lib.device_count()                                     # the library's own driver check
    except pocketllm.PocketError as e:
        missing.append(str(e))
        return f"unusable: {e}"
    v = lambda n: f"{n // 1000}.{n % 1000 // 10}"  # noqa: E731
    return f"driver supports CUDA {v(driver)}, the library carries the CUDA {v(runtime)} runtime"


def load(logdir: Path) -> int:
    import pocketllm
    ok, why = pocketllm.native_status("cuda")
    save(logdir, "load", {"ok": ok, "reason": why})
    print(("ok: " if ok else "FAILED: ") + why)
    return 0 if ok else 1


# ---- NCCL: one GPU means one rank, which still exercises every call, and the bounded waits: a peer that
#      never joins (a two-rank init with one rank), a step that never completes (a GPU spin queued before the
#      all-reduce), both ending in ncclCommAbort and an error naming the timeout, within it ----

SPIN_CYCLES = 16_000_000_000      # torch.cuda._sleep: about 8 s at 2 GHz, 11 s at 1.5 GHz


def _fails_within(call, match: str, low_s: float, high_s: float) -> dict:
    """{"ok": call() raised naming `match` after low_s..high_s seconds, the message, the seconds}."""
    t0 = time.monotonic()
    try:
        call()
        return {"ok": False, "error": "no error", "seconds": time.monotonic() - t0}
    except Exception as e:
        took = time.monotonic() - t0
        return {"ok": match in str(e) and low_s <= took < high_s, "error": str(e), "seconds": round(took, 2)}


def nccl(logdir: Path) -> int:
    import tempfile
    import torch
    import torch.distributed as dist
    import pocketllm
    ops = pocketllm.NativeOps("cuda")
    ok, why = pocketllm.nccl_status(ops.lib)
    result = {"available": ok, "reason": why}
    if ok:
        device = torch.cuda.current_device()
        uid = ops.nccl_unique_id()
        comm = ops.nccl_init(uid, 1, 0, device, 60.0)
        for dtype in (torch.float16, torch.float32):
            x = torch.randn(5120 * 8, device="cuda").to(dtype)
            before = x.clone()
            ops.all_reduce(x, comm)
            ops.nccl_wait(comm, 60.0)
            result[f"all_reduce_{dtype}"] = bool(torch.equal(x, before))   # the sum over one rank
        ops.lib.call("pl_nccl_destroy", comm)
        # A peer that never joins: rank 0 of two, alone.
        result["check_init_timeout"] = _fails_within(lambda: ops.nccl_init(ops.nccl_unique_id(), 2, 0, device, 3.0),
                                                     "did not complete within 3 s", 2.9, 15.0)
        # A step that never completes in time: a GPU spin ahead of the all-reduce, waited for 1 s.
        comm = ops.nccl_init(ops.nccl_unique_id(), 1, 0, device, 60.0)
        x = torch.ones(1024, device="cuda")
        torch.cuda._sleep(SPIN_CYCLES)
        ops.all_reduce(x, comm)
        result["check_step_timeout"] = _fails_within(lambda: ops.nccl_wait(comm, 1.0),
                                                     "did not complete within 1 s", 0.9, 10.0)
        result["check_aborted_is_refused"] = _fails_within(lambda: ops.all_reduce(x, comm), "aborted", 0.0, 5.0)
        ops.lib.call("pl_nccl_destroy", comm)
        torch.cuda.synchronize()
        # The engine's Comm: the barrier at connect, a bounded step, then the steady bound firing.
        with tempfile.TemporaryDirectory() as d:
            store = dist.FileStore(str(Path(d) / "store"), -1)
            store.set("nccl_id", ops.nccl_unique_id())
            opts = pocketllm.EngineOptions(collective_timeout=1.0, collective_warmup_timeout=60.0)
            c = pocketllm.Comm(store, 0, 1, torch.device("cuda", device), ops, opts)
            for _ in range(pocketllm.Comm.WARMUP_STEPS):
                c.all_reduce(torch.ones(8, device="cuda"))
                c.finish_step()
            torch.cuda._sleep(SPIN_CYCLES)
            c.all_reduce(torch.ones(8, device="cuda"))
            result["check_comm_timeout"] = _fails_within(c.finish_step, "took more than 1 s (--collective-timeout)",
                                                         0.9, 10.0)
            ops.lib.call("pl_nccl_destroy", c.comm)
            torch.cuda.synchronize()
    save(logdir, "nccl", result)
    print(result)
    passed = [v for k, v in result.items() if k.startswith("all_reduce")] + \
        [v["ok"] for k, v in result.items() if k.startswith("check_")]
    return 0 if ok and all(passed) else 1


# ---- Kernel benchmarks on the 27B decode shapes (TP1), each against the measured copy bandwidth ----

REPS = 10            # back-to-back calls per timed run
HOLD_CYCLES = 2e7    # ~10 ms of GPU spin: longer than the host needs to queue REPS calls


def median_ms(fn, warmup: int = 3, iters: int = 20) -> float:
    """Milliseconds per call of fn's GPU work, without the host's launch overhead (see the module docstring)."""
    import torch
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(HOLD_CYCLES))
        a.record()
        for _ in range(REPS):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / REPS)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy, read + write."""
    import torch
    src = torch.empty(2 ** 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters=10)
    return 2 * src.numel() * 2 / (ms * 1e-3) / 1e9


LINEARS_27B = {   # name: (N, K) at TP1
    "mlp.gate/up": (17408, 5120), "mlp.down": (5120, 17408), "attn.q(+gate)": (12288, 5120),
    "attn.k/v": (1024, 5120), "attn.o": (5120, 6144), "gdn.in_proj_qkv": (10240, 5120),
    "gdn.in_proj_z": (6144, 5120), "gdn.out_proj": (5120, 6144),
}
FP32_OUT = {"mlp.gate/up", "mlp.down", "attn.o", "gdn.out_proj"}   # written in fp32 by the model (fp16 range)


def fp8_linear(N: int, K: int):
    import torch
    import pocketllm
    return pocketllm.Linear(weight=(torch.randn(N, K, device="cuda") * 0.5).to(torch.float8_e4m3fn),
                            scale=torch.rand((N + 127) // 128, (K + 127) // 128, device="cuda") * 0.01)


# ---- The fp32-output kernels at the real K, against torch in float64 on the same fp16 inputs ----

def kernels(logdir: Path) -> int:
    """Every path (tensor-core GEMV at B 1 and 9, tensor-core GEMM at 40 and 200 tokens) with fp32 outputs far
    beyond fp16's range, and the MLP's row-scaled SwiGLU + down_proj, at K = 5120 and 17408."""
    import torch
    import torch.nn.functional as F
    import pocketllm
    torch.manual_seed(0)
    ops, tops, rows, ok = pocketllm.NativeOps("cuda"), pocketllm.TorchOps(), [], True
    for N, K in ((5120, 17408), (17408, 5120), (1536, 17408)):
        w = fp8_linear(N, K)
        w.scale.mul_(100)                                             # weights ~0.25: outputs ~1e5 and more
        wd = pocketllm.dequantize(w, torch.float64)                  # (N, K) exact
        for B in (1, 9, 40, 200):
            x = (torch.randn(B, K, device="cuda") * 2e4).clamp(-6e4, 6e4).to(torch.float16)
            got = ops.linear(x, w, torch.float32)
            want = x.double() @ wd.t()
            err = float((got.double() - want).abs().max() / want.abs().max())
            rows.append({"op": "linear fp32 out", "N": N, "K": K, "B": B, "max_abs": float(want.abs().max()),
                         "rel_err": err, "finite": bool(torch.isfinite(got).all())})
            ok &= rows[-1]["finite"] and err <= 1e-4
            if K == 17408:                                            # the MLP: gate, up fp32 -> down
                g, u = torch.randn(B, K, device="cuda") * 60, torch.randn(B, K, device="cuda") * 90
                got = ops.silu_mul_linear(g, u, w, torch.float16)
                ref_t = tops.silu_mul_linear(g, u, w, torch.float16)
                want = (F.silu(g.double()) * u.double()) @ wd.t()
                err = float((got.double() - want).abs().max() / want.abs().max())
                err_t = float((ref_t.double() - want).abs().max() / want.abs().max())
                rows.append({"op": "silu_mul_linear fp16", "N": N, "K": K, "B": B,
                             "max_abs": float(want.abs().max()), "rel_err": err, "torch_rel_err": err_t,
                             "finite": bool(torch.isfinite(got).all())})
                ok &= rows[-1]["finite"] and err <= 2e-3
        del w, wd
    for r in rows:
        print(f"{r['op']:22s} {r['N']:>6}x{r['K']:<6} B={r['B']:<4} max|ref| {r['max_abs']:9.3g} "
              f"rel err {r['rel_err']:.2e}{'' if r['finite'] else ' NON-FINITE'}", flush=True)
    save(logdir, "kernels", {"ok": ok, "rows": rows})
    return 0 if ok else 1


def bench(logdir: Path) -> int:
    import torch
    import pocketllm
    torch.manual_seed(0)
    ops, act = pocketllm.NativeOps("cuda"), torch.float16
    copy = copy_bandwidth()
    rows = [{"kernel": "device copy", "shape": "2 GiB", "batch": "-", "ms": None, "GB/s": copy, "% of copy": 100.0}]

    def row(kernel, shape, batch, nbytes, fn):
        ms = median_ms(fn)
        gbs = nbytes / (ms * 1e-3) / 1e9
        rows.append({"kernel": kernel, "shape": shape, "batch": batch, "ms": ms, "GB/s": gbs,
                     "% of copy": 100 * gbs / copy})
        print(f"{kernel:28s} {shape:22s} B={batch:<3} {ms:8.4f} ms {gbs:8.1f} GB/s {100 * gbs / copy:5.1f}%",
              flush=True)

    for name, (N, K) in LINEARS_27B.items():
        w = fp8_linear(N, K)
        out = torch.float32 if name in FP32_OUT else act
        for B in (1, 8):
            x = torch.randn(B, K, device="cuda").to(act)
            nbytes = N * K + w.scale.numel() * 4 + B * K * 2 + B * N * out.itemsize
            kernel = f"FP8 GEMV {name}{' f32out' if out == torch.float32 else ''}"
            row(kernel, f"{N}x{K}", B, nbytes, lambda: ops.linear(x, w, out))
        del w
    rows += gemv_sweep(ops, copy)
    # The decode MLP, at the 27B's TP1 shapes, each path forced through NativeOps' switches (prologue_tokens,
    # glu_tokens, mlp_tokens): pl_mlp (gate|up, the SiLU product and down_proj in one launch, the blocks' partials summed by
    # the last block) on a plain input, with the layer's add + RMSNorm in its prologue, and after its own
    # add_rmsnorm launch; against gate|up + pl_silu_mul + down_proj on the row-scaled fp16 product (3 launches,
    # what prefill runs). Bytes: the three FP8 weights and their scales.
    I, D = 17408, 5120
    gate_up, down = fp8_linear(2 * I, D), fp8_linear(D, I)
    mlp_bytes = 3 * I * D + (gate_up.scale.numel() + down.scale.numel()) * 4
    shipped = ops.prologue_tokens, ops.glu_tokens, ops.mlp_tokens

    def switches(prologue: int, glu: int, mlp: int = 16) -> None:
        ops.prologue_tokens, ops.glu_tokens, ops.mlp_tokens = prologue, glu, mlp

    for B in (1, 2, 4, 8):
        x = torch.randn(B, D, device="cuda").to(act)
        xf, res = torch.randn(B, D, device="cuda"), torch.randn(B, D, device="cuda")          # (B, D) fp32
        norm_w = torch.rand(D, device="cuda")
        switches(0, 16)
        row("MLP pl_mlp (1 launch)", f"{I}x{D} x3", B, mlp_bytes, lambda: ops.mlp(x, gate_up, down, act))
        row("add_rmsnorm + pl_mlp", f"{I}x{D} x3", B, mlp_bytes,
            lambda: ops.mlp(ops.add_rmsnorm(xf, res, norm_w, 1e-6, act)[0], gate_up, down, act))
        switches(16, 16)
        row("pl_mlp with norm prologue", f"{I}x{D} x3", B, mlp_bytes,
            lambda: ops.mlp(ops.prenorm(xf, res, norm_w, 1e-6, act)[0], gate_up, down, act))
        row("MLP 3 launches (fp16 h)", f"{I}x{D} x3", B, mlp_bytes,
            lambda: ops.silu_mul_linear(*ops.linear_parts(x, gate_up, [I, I], torch.float32), down, act))
        switches(0, 16, 0)
        row("MLP glu + down (2 launches)", f"{I}x{D} x3", B, mlp_bytes, lambda: ops.mlp(x, gate_up, down, act))
    switches(*shipped)
    del gate_up, down
    head = pocketllm.Linear(weight=torch.randn(248320, 5120, device="cuda").to(torch.bfloat16))
    for B in (1, 8):
        x = torch.randn(B, 5120, device="cuda").to(act)
        row("bf16 GEMV lm_head f32out", "248320x5120", B, 248320 * 5120 * 2 + B * (5120 * 2 + 248320 * 4),
            lambda: ops.linear(x, head, torch.float32))
    del head

    # Decode attention at 4k context: 24 q heads, 4 kv heads, head_dim 256, fp16 KV, block size 16.
    ctx, bs, Hq, Hk, Dh = 4096, 16, 24, 4, 256
    for B in (1, 8):
        nblk = ctx // bs
        k_cache = torch.randn(B * nblk, bs, Hk, Dh, device="cuda").to(act)
        v_cache = torch.randn_like(k_cache)
        tables = torch.arange(B * nblk, device="cuda", dtype=torch.int32).view(B, nblk)
        lens = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
        qs = torch.arange(B + 1, device="cuda", dtype=torch.int32)
        q = torch.randn(B, Hq, Dh, device="cuda").to(act)
        nbytes = 2 * B * ctx * Hk * Dh * 2 + 2 * B * Hq * Dh * 2
        row("decode attention", f"ctx {ctx}, 24/4 heads", B, nbytes,
            lambda: ops.attention(q, k_cache, v_cache, tables, lens, qs, Dh ** -0.5))
        ops.merged_attention = True                              # the split-K merge by the last split block
        row("decode attention, merge inside", f"ctx {ctx}, 24/4 heads", B, nbytes,
            lambda: ops.attention(q, k_cache, v_cache, tables, lens, qs, Dh ** -0.5))
        ops.merged_attention = False
        del k_cache, v_cache

    # GDN decode: 16 key heads, 48 value heads, 128 x 128 fp32 state per head, read and written every step.
    Hk_, Hv, Dk, Dv = 16, 48, 128, 128
    for B in (1, 8):
        state = torch.randn(B, Hv, Dk, Dv, device="cuda") * 0.01
        slots = torch.arange(B, device="cuda", dtype=torch.int32)
        qs = torch.arange(B + 1, device="cuda", dtype=torch.int32)
        qk = torch.randn(B, Hk_, Dk, device="cuda").to(act)
        v = torch.randn(B, Hv, Dv, device="cuda").to(act)
        g = -torch.rand(B, Hv, device="cuda")
        beta = torch.rand(B, Hv, device="cuda")
        nbytes = 2 * B * Hv * Dk * Dv * 4
        row("GDN decode (delta rule)", "48 heads 128x128", B, nbytes,
            lambda: ops.gated_delta(qk, qk, v, g, beta, state, slots, qs))
        # The same with the gated RMSNorm of its output in the launch (pl_gated_delta_rmsnorm: a block per head's
        # whole row, 4x fewer and 4x wider blocks): what a decode layer runs.
        z, norm_w = torch.randn(B, Hv, Dv, device="cuda").to(act), torch.rand(Dv, device="cuda")
        row("GDN decode + gated norm", "48 heads 128x128", B, nbytes + B * Hv * Dv * 2,
            lambda: ops.gated_delta_rmsnorm(qk, qk, v, g, beta, state, slots, qs, z, norm_w, 1e-6))
    # GDN's in_proj at decode (27B TP1 shapes): FP8 q|k|v|z with the conv in its epilogue and the fp16 a|b rows
    # with the gates, one launch (pl_gdn_in_proj_gates) against the two GEMVs.
    C, N, D, Hv = 2 * 16 * 128 + 48 * 128, 2 * 16 * 128 + 2 * 48 * 128, 5120, 48
    qkvz, ab = fp8_linear(N, D), pocketllm.Linear(weight=torch.randn(2 * Hv, D, device="cuda").to(act) * 0.01)
    conv_w, A_log, dt_bias = torch.rand(C, 4, device="cuda"), torch.rand(Hv, device="cuda"), torch.rand(Hv, device="cuda")
    in_bytes = N * D + qkvz.scale.numel() * 4 + 2 * Hv * D * 2
    for B in (1, 8):
        x = torch.randn(B, D, device="cuda").to(act)
        conv_state = torch.zeros(B, C, 3, device="cuda").to(act)
        slots, qs = torch.arange(B, device="cuda", dtype=torch.int32), torch.arange(B + 1, device="cuda", dtype=torch.int32)
        row("GDN in_proj + gates (1)", f"{N}+{2 * Hv}x{D}", B, in_bytes,
            lambda: ops.gdn_in_proj_gates(x, qkvz, [C, N - C], conv_w, conv_state, slots, qs, ab, A_log, dt_bias))
        row("GDN in_proj, gates (2)", f"{N}+{2 * Hv}x{D}", B, in_bytes,
            lambda: (ops.gdn_in_proj(x, qkvz, [C, N - C], conv_w, conv_state, slots, qs),
                     ops.gdn_gates_linear(x, ab, A_log, dt_bias)))
    del qkvz, ab
    save(logdir, "bench", {"copy_GBps": copy, "rows": rows})
    return 0


# The tensor-core GEMV's switches (pl_set_gemv_tuning): warps per block and splits of K (-1 = none, 0 = the
# library's choice by shape and SM count, n = forced). Each shape and batch under each.
GEMV_CONFIGS = [(8, -1), (8, 0), (8, 2), (8, 4), (4, -1), (4, 2)]


def gemv_sweep(ops, copy: float) -> list[dict]:
    """The 27B's TP1 projections (and gate|up as pl_linear_glu) at batch 1 and 8 under every GEMV_CONFIGS
    entry; prints one line per shape: ms and % of copy per config, the library's own choice marked."""
    import torch
    rows = []
    shapes = [(name, N, K, False) for name, (N, K) in LINEARS_27B.items()] + [("mlp.gate|up glu", 2 * 17408, 5120, True)]
    wp, sp = ops.lib.ffi.new("int32_t*"), ops.lib.ffi.new("int32_t*")

    def glu_call(x, weight, scale, h):                    # pl_linear_glu, as NativeOps.mlp runs it at one token
        ops.lib.call("pl_linear_glu", x.data_ptr(), 1, x.shape[0], x.shape[1], weight.data_ptr(), 3, scale,
                     weight.shape[0], h.data_ptr(), torch.cuda.current_stream().cuda_stream)

    try:
        for name, N, K, glu in shapes:
            w = fp8_linear(N, K)
            out = torch.float32 if name in FP32_OUT or glu else torch.float16
            for B in (1, 8):
                x = torch.randn(B, K, device="cuda").to(torch.float16)
                nbytes = N * K + w.scale.numel() * 4 + B * K * 2 + B * (N // 2 if glu else N) * out.itemsize
                weight, scale = ops._weight(w)
                h = torch.empty(B, N // 2, device="cuda")
                fn = (lambda: glu_call(x, weight, scale, h)) if glu else (lambda: ops.linear(x, w, out))
                cells = []
                for warps, splits in GEMV_CONFIGS:
                    ops.lib.call("pl_set_gemv_tuning", warps, splits)
                    ms = median_ms(fn, iters=7)
                    gbs = nbytes / (ms * 1e-3) / 1e9
                    ops.lib.call("pl_gemv_plan", B, K, N, int(glu), wp, sp)
                    rows.append({"kernel": f"GEMV sweep {name}", "shape": f"{N}x{K}", "batch": B, "warps": warps,
                                 "splits": splits, "chosen_splits": sp[0], "ms": ms, "GB/s": gbs,
                                 "% of copy": 100 * gbs / copy})
                    cells.append(f"w{warps}s{splits if splits else f'auto={sp[0]}'} {ms * 1e3:6.1f}us "
                                 f"{100 * gbs / copy:4.1f}%")
                print(f"sweep {name:18s} B={B}: " + " | ".join(cells), flush=True)
            del w
    finally:
        ops.lib.call("pl_set_gemv_tuning", 0, 0)
    return rows


# ---- Decode tokens/s: a synthetic checkpoint with the 27B shapes and 4 layers (3 GDN + 1 full attention) ----

def decode(logdir: Path) -> int:
    import tempfile
    import torch
    import checkpoints
    import pocketllm
    t0 = time.time()
    shapes = dict(hidden_size=5120, intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4,
                  head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                  linear_value_head_dim=128, num_hidden_layers=4,
                  layer_types=["linear_attention"] * 3 + ["full_attention"])
    with tempfile.TemporaryDirectory() as d:
        if os.environ.get("POCKETLLM_SYNTH"):            # check.sh made it once for the serving steps too
            path = Path(os.environ["POCKETLLM_SYNTH"])
        else:
            path, ref = checkpoints.make_checkpoint(Path(d), "qwen3_5", fp8=True, **shapes)
            del ref
        made = time.time() - t0
        result = {"checkpoint_s": made, "layers": 4, "extrapolated_to": 64, "sampling": "temperature 1, top_p 0.95",
                  "speculative_tokens": 0}
        # No speculation: CUDA graphs replay plain decode steps only (verify windows run eagerly).
        llm = pocketllm.LLM(path, backend="native", device="cuda", dtype="float16", quiet=True,
                            max_context=1024, max_batch_size=32, speculative_tokens=0, gpu_memory_utilization=0.5)
        ops, prompt = llm.model.ops, list(range(5, 69))
        # (batch, graphs, fusion variant): "default" as shipped (add + RMSNorm its own launch; the GLU MLP at one
        # token, 3 launches above); "pl_mlp to 16": the one-launch MLP at every decode size; "prologue + pl_mlp
        # to 16": and the add + RMSNorm inside the projections that follow.
        # "no split-K": the tensor-core GEMV one block per 16-row tile (pl_set_gemv_tuning(0, -1)), as before
        # split-K; "3-launch MLP at 1 token": gate|up, silu_mul, down_proj at batch 1 too (glu_tokens 0). Each
        # variant: (the three switches, splits).
        shipped = (ops.prologue_tokens, ops.glu_tokens, ops.mlp_tokens)
        variants = {"default": shipped + (0,), "no split-K": shipped + (-1,),
                    "3-launch MLP at 1 token": (shipped[0], 0, shipped[2], 0)}
        # graphs: False (eager), True (forward and sampler in one CUDA graph per bucket), "forward" (the graph
        # holds the forward only and the sampler runs eagerly after it, as before the sampler was captured)
        runs = [(B, g, "default") for B in (1, 8, 32) for g in (False, True, "forward")] + \
            [(B, True, "no split-K") for B in (1, 8)] + [(1, True, "3-launch MLP at 1 token")]
        current = variants["default"]
        for B, graphs, variant in runs:
            llm.engine.graphs.enabled = bool(graphs)
            llm.engine.graphs.sampling = graphs is True
            if current != variants[variant]:
                current = variants[variant]
                ops.prologue_tokens, ops.glu_tokens, ops.mlp_tokens = current[:3]
                ops.lib.call("pl_set_gemv_tuning", 0, current[3])
                llm.engine.graphs.steps.clear()                # captured graphs hold the other variant's launches
                llm.engine.graphs.seen.clear()
            def run(n):
                streams = [llm.submit(prompt, pocketllm.SamplingParams(max_tokens=n, temperature=1.0, top_p=0.95,
                                                                       seed=i, ignore_eos=True)) for i in range(B)]
                torch.cuda.synchronize()
                t = time.perf_counter()
                for s in streams:
                    for _ in s:
                        pass
                torch.cuda.synchronize()
                return time.perf_counter() - t
            run(4)                                     # warm-up (and, with graphs, each bucket's eager first step)
            # per decode step, prefill cancelled out; the median of 3 (one pair moved 25% between device runs)
            step_ms = statistics.median((run(32) - run(8)) / 24 * 1e3 for _ in range(3))
            # 4 of 64 layers: the per-layer part scales by 16 (the 3:1 GDN:attention pattern is the model's);
            # embedding, sampling and engine overhead are counted 16 times too, so this is a lower bound.
            how = {False: "eager", True: "graphs", "forward": "graphs, sampler eager"}[graphs] + \
                ("" if variant == "default" else f" ({variant})")
            result[f"batch{B}_{how}"] = {"step_ms_4_layers": step_ms, "step_ms_64_layers_est": step_ms * 16,
                                         "tok_per_s_est": B * 1e3 / (step_ms * 16)}
            print(f"batch {B} {how}: {step_ms:.2f} ms per step with 4 layers -> ~{step_ms * 16:.1f} ms with 64 "
                  f"-> ~{B * 1e3 / (step_ms * 16):.1f} tok/s (lm_head of the real vocab not included)", flush=True)
        result["graphs_captured"] = llm.engine.graphs.buckets_recorded()
        result["steps_sampled_in_graph"] = llm.engine.graphs.sampled
        ops.prologue_tokens, ops.glu_tokens, ops.mlp_tokens = shipped
        ops.lib.call("pl_set_gemv_tuning", 0, 0)
        llm.engine.graphs.steps.clear()
        llm.engine.graphs.seen.clear()
        result["profile"] = profile_steps(llm, prompt, logdir)
        llm.close()
    save(logdir, "decode", result)
    return 0


def profile_steps(llm, prompt: list[int], logdir: Path) -> dict:
    """Where a batch-1 decode step's time goes, eager and graphed: torch.profiler over 24 steps, the top ops by
    host time and by GPU time written to LOGDIR/profile.txt; returns the step's host and GPU totals."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    import pocketllm
    out, totals = [], {}
    for graphs in (False, True):
        llm.engine.graphs.enabled = graphs
        params = pocketllm.SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=0, ignore_eos=True)
        for _ in llm.submit(prompt, params):                   # warm-up (and the bucket's eager step + capture)
            pass
        params = pocketllm.SamplingParams(max_tokens=25, temperature=1.0, top_p=0.95, seed=1, ignore_eos=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            for _ in llm.submit(prompt, params):
                pass
            torch.cuda.synchronize()
            wall = time.perf_counter() - t
        how = "graphs" if graphs else "eager"
        ka = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in ka) / 25
        totals[how] = {"wall_ms_per_token": wall * 1e3 / 25, "gpu_ms_per_token": gpu_us / 1e3}
        out.append(f"==== batch 1, {how}: {wall * 1e3 / 25:.2f} ms wall per token (25 tokens, prefill included), "
                   f"{gpu_us / 1e3:.3f} ms GPU per token")
        out.append(ka.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        out.append(ka.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
    (logdir / "profile.txt").write_text("\n".join(out))
    print(json.dumps(totals), flush=True)
    return totals


# ---- Qwen3.5-27B with dummy weights (--load-format dummy, no download): benchmarks/bench.py's report at TP1
#      (batch-1 decode against the copy-bandwidth roofline, batch 8 and 32, TTFT, speculation's step cost), then one
#      TP4 rank's shapes on this one GPU. --cpu: the same code on the CPU with pocket-tiny's config (and its TP2
#      rank's shapes), which tests/test_gpu_check.py runs. ----

def host_copy_bandwidth() -> float:
    """GB/s of a 256 MiB host copy, read + write (the --cpu run's roofline)."""
    import torch
    src = torch.empty(2 ** 27, dtype=torch.int16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 2 / best / 1e9


def model27b(logdir: Path, cpu: bool = False) -> int:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench
    if cpu:
        base, world, copy = json.loads((ROOT / "models" / "pocket-tiny" / "config.json").read_text()), 2, \
            host_copy_bandwidth()
        flags = ["--device", "cpu", "--backend", "torch", "--decode", "8", "--ttft-lens", "256",
                 "--report-batches", "4", "--ttft-repeats", "1"]
    else:
        base, world, copy = bench.qwen35_27b_config(), 4, copy_bandwidth()
        flags = ["--device", "cuda", "--backend", "native", "--dtype", "float16", "--decode", "32",
                 "--ttft-lens", "1024,8192", "--report-batches", "8,32", "--ttft-repeats", "1"]
    result, text = {"copy_GBps": copy}, []
    for name, raw, spec in (("tp1", base, "2"), (f"tp{world}_rank", bench.rank_shapes(base, world), "0")):
        ckpt = logdir / f"model27b-{name}"
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / "config.json").write_text(json.dumps(raw, indent=1))
        t0 = time.time()
        r = bench.report(bench.parse_args(["--report", "--ckpt", str(ckpt), "--load-format", "dummy",
                                           "--speculative-tokens", spec] + flags))
        batch1 = r["off"]["batch1"]
        roofline_ms = r["off"]["decode_bytes_per_step"] / (copy * 1e9) * 1e3
        r["roofline"] = {"bytes_per_step": r["off"]["decode_bytes_per_step"], "roofline_ms": roofline_ms,
                         "tpot_ms": batch1["tpot_ms"], "fraction_of_roofline": roofline_ms / batch1["tpot_ms"]}
        result[name] = r
        line = (f"{name}: batch-1 TPOT {batch1['tpot_ms']:.2f} ms vs roofline {roofline_ms:.2f} ms "
                f"({r['off']['decode_bytes_per_step'] / 1e6:.1f} MB / {copy:.0f} GB/s) = "
                f"{100 * roofline_ms / batch1['tpot_ms']:.0f}% of the roofline; {time.time() - t0:.0f} s")
        print(line, flush=True)
        text += [f"## {name} ({r['machine']}, backend {r['off']['backend']} on {r['off']['device']})", line, "",
                 bench.report_table(r), ""]
    save(logdir, "model27b", result)
    (logdir / "model27b.txt").write_text("\n".join(text))
    return 0


# ---- CUDA graphs: the decode step replayed from a graph gives the eager step's tokens, greedy and sampled ----

def graphs(logdir: Path) -> int:
    """Graph replay == eager, token for token: the eager step, the graph of the forward with the sampler after it,
    and the whole step (forward and sampler) in one graph (the sampler's parameters in the static payload:
    Sampler.static_fields), for every sampler stage a graph captures (penalties, top-k/top-p sort, min-p,
    logit_bias and min_tokens bans, n > 1)."""
    import pocketllm
    prompts = [[5, 6, 7, 8], list(range(20, 45)), [100, 3, 9]]          # 3 sequences: padded to the 4-bucket
    kinds = {"greedy": dict(temperature=0), "sampled": dict(temperature=1.0, top_p=0.95, presence_penalty=0.5,
                                                            frequency_penalty=0.3),
             "filters": dict(temperature=0.8, top_k=40, min_p=0.02, repetition_penalty=1.2, min_tokens=8,
                             stop_token_ids=[11, 13], logit_bias={11: 2.0, 13: 2.0, 220: -1.5}),
             "n=2": dict(n=2, temperature=1.0, top_p=0.9, frequency_penalty=0.2)}
    modes = {"eager": (False, False), "graph, sampler eager": (True, False), "graph with the sampler": (True, True)}
    out, ok = {}, True
    llm = pocketllm.LLM(None, backend="native", device="cuda", dtype="float16", quiet=True, max_context=512,
                        max_batch_size=8, speculative_tokens=0)       # graphs replay plain decode steps only
    g = llm.engine.graphs
    assert g is not None, "no DecodeGraphs on the native CUDA engine"
    for kind, params in kinds.items():
        tokens, sampled = {}, g.sampled
        for mode, (g.enabled, g.sampling) in modes.items():
            streams = [llm.submit(p, pocketllm.SamplingParams(max_tokens=48, seed=i, ignore_eos=True, **params))
                       for i, p in enumerate(prompts)]
            tokens[mode] = [choice_tokens(s) for s in streams]
        out[kind] = {"steps_sampled_in_graph": g.sampled - sampled}
        for mode in list(modes)[1:]:
            same = tokens["eager"] == tokens[mode]
            first = next((i for i, (a, b) in enumerate(zip(tokens["eager"][0][0], tokens[mode][0][0])) if a != b), None)
            out[kind][mode] = {"identical": same, "first_difference_seq0": first}
            ok &= same
            print(f"{kind}: {mode} {'==' if same else '!='} eager over 3 x 48 tokens", flush=True)
        ok &= out[kind]["steps_sampled_in_graph"] > 0
    g.enabled = g.sampling = True
    out["buckets_captured"] = g.buckets_recorded()
    out["graphs_with_the_sampler"] = sorted(str(k) for k in g.steps if not isinstance(k, int))
    ok &= bool(out["buckets_captured"]) and bool(out["graphs_with_the_sampler"])
    print(f"buckets captured: {out['buckets_captured']}; graphs with the sampler (bucket, stages): "
          f"{len(out['graphs_with_the_sampler'])}")
    out["overlap"] = overlap(llm, prompts, kinds)
    ok &= all(v["identical"] for v in out["overlap"].values() if isinstance(v, dict)) and out["overlap"]["launched"] > 0
    llm.close()
    save(logdir, "graphs", out)
    return 0 if ok else 1


def choice_tokens(stream) -> list[list[int]]:
    """A request's tokens, choice by choice."""
    found: dict[int, list[int]] = {}
    for ev in stream:
        found.setdefault(ev.index, []).extend(ev.token_ids)
    return [found[i] for i in sorted(found)]


def overlap(llm, prompts: list[list[int]], kinds: dict) -> dict:
    """Async scheduling on the card (llm has it on, graphs replaying): its tokens == an engine without it, and ms
    per decode step of both (3 sequences, the difference of a 72- and an 8-token run)."""
    import time
    import pocketllm
    serial = pocketllm.LLM(None, backend="native", device="cuda", dtype="float16", quiet=True, max_context=512,
                           max_batch_size=8, speculative_tokens=0, async_scheduling=False)
    out, launched = {"launched": 0}, llm.engine.device.launches
    for kind, params in kinds.items():
        tokens = [[choice_tokens(s) for s in [
            engine.submit(p, pocketllm.SamplingParams(max_tokens=48, seed=i, ignore_eos=True, **params))
            for i, p in enumerate(prompts)]] for engine in (serial, llm)]
        out[kind] = {"identical": tokens[0] == tokens[1]}
        print(f"{kind}: async scheduling {'==' if tokens[0] == tokens[1] else '!='} one step at a time", flush=True)
    out["launched"] = llm.engine.device.launches - launched

    def seconds(engine, n):
        t0 = time.perf_counter()
        for s in [engine.submit(p, pocketllm.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                  for p in prompts]:
            list(s)
        return time.perf_counter() - t0
    for name, engine, sampling in (("serial", serial, True), ("overlapped", llm, True),
                                   ("overlapped_sampler_eager", llm, False)):
        engine.engine.graphs.sampling = sampling
        seconds(engine, 8)
        out[f"{name}_ms_per_step"] = min(seconds(engine, 72) - seconds(engine, 8) for _ in range(3)) * 1e3 / 64
    llm.engine.graphs.sampling = True
    print(f"decode step, 3 sequences: {out['serial_ms_per_step']:.3f} ms one at a time, "
          f"{out['overlapped_ms_per_step']:.3f} ms overlapped, "
          f"{out['overlapped_sampler_eager_ms_per_step']:.3f} ms overlapped with the sampler outside the graph",
          flush=True)
    serial.close()
    return out


def main() -> int:
    step, logdir = sys.argv[1], Path(sys.argv[2])
    logdir.mkdir(parents=True, exist_ok=True)
    if step == "model27b" and sys.argv[3:] == ["--cpu"]:
        return model27b(logdir, cpu=True)
    if step in ("kernels", "nccl", "bench", "decode", "graphs", "model27b"):
        import torch
        if not torch.cuda.is_available():
            print(f"{step}: skipped, torch sees no CUDA GPU")
            return 1
    steps = {"prereqs": prereqs, "load": load, "kernels": kernels, "nccl": nccl, "bench": bench, "decode": decode,
             "graphs": graphs, "model27b": model27b}
    return steps[step](logdir)


if __name__ == "__main__":
    sys.exit(main())
