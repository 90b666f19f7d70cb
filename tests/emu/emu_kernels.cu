// Test-only kernels for tests/test_emu_layer.py: each exercises one piece of csrc/runtime.cuh through the
// ordinary CUDA spellings, so the same file builds with nvcc (real instructions) and with g++ (the CPU
// execution layer). Built together with csrc/runtime.cu into a separate test library.
#include "pocketllm.h"
#include "runtime.cuh"

#pragma GCC visibility push(default)
extern "C" {
int emu_mma(uint64_t a_regs, uint64_t b_regs, uint64_t c_regs, uint64_t d_regs);
int emu_ldmatrix(uint64_t tile, int32_t nmat, int32_t trans, uint64_t regs_out);
int emu_e4m3(uint64_t bytes, uint64_t out, int32_t n);
int emu_e4m3x2(uint64_t pairs, uint64_t out_half_bits, int32_t n);
int emu_fp16(uint64_t in, uint64_t out_half_bits, uint64_t back, int32_t n);
int emu_bf16(uint64_t in, uint64_t out_bf_bits, uint64_t back, int32_t n);
int emu_warp_ops(uint64_t in, uint64_t out, int32_t nthreads);
int emu_barrier(uint64_t out, int32_t nthreads, int32_t rounds);
int emu_race(uint64_t out, int32_t nthreads, int32_t with_barrier, float salt);
int emu_divergent(int32_t mode);
int emu_dyn_smem(uint64_t out, int32_t n, int32_t smem_bytes, int32_t touch_past_end);
int emu_launch_config(int32_t threads);
}
#pragma GCC visibility pop

// ---- mma.m16n8k8: one warp, fragments given per lane by the caller ----
__global__ void mma_kernel(const uint32_t* a, const uint32_t* b, const float* c, float* d) {
    int lane = threadIdx.x;
    uint32_t ar[2] = {a[2 * lane], a[2 * lane + 1]};
    float cr[4], dr[4];
    for (int i = 0; i < 4; i++) cr[i] = c[4 * lane + i];
    pl_mma_m16n8k8(dr, ar, b[lane], cr);
    for (int i = 0; i < 4; i++) d[4 * lane + i] = dr[i];
}

int emu_mma(uint64_t a_regs, uint64_t b_regs, uint64_t c_regs, uint64_t d_regs) {
    PL_LAUNCH(mma_kernel, dim3(1), dim3(32), 0, 0, PL_PTR(const uint32_t, a_regs), PL_PTR(const uint32_t, b_regs),
              PL_PTR(const float, c_regs), PL_PTR(float, d_regs));
    PL_CHECK_LAUNCH();
    PL_CHECK(cudaDeviceSynchronize());
    return 0;
}

// ---- ldmatrix: a (32, 8) fp16 tile = four stacked 8x8 matrices; lane l gives the address of row l ----
__global__ void ldmatrix_kernel(const uint16_t* tile, int nmat, int trans, uint32_t* out) {
    __shared__ __align__(16) uint16_t s[32 * 8];
    int lane = threadIdx.x;
    for (int i = 0; i < 8; i++) s[lane * 8 + i] = tile[lane * 8 + i];
    __syncthreads();
    uint32_t r[4] = {0, 0, 0, 0};
    const void* row = &s[(lane % (8 * nmat)) * 8];
    if (nmat == 4 && !trans) pl_ldmatrix_x4(r, row);
    if (nmat == 4 && trans) pl_ldmatrix_x4_trans(r, row);
    if (nmat == 2 && !trans) pl_ldmatrix_x2(r, row);
    if (nmat == 2 && trans) pl_ldmatrix_x2_trans(r, row);
    for (int i = 0; i < 4; i++) out[4 * lane + i] = r[i];
}

int emu_ldmatrix(uint64_t tile, int32_t nmat, int32_t trans, uint64_t regs_out) {
    PL_REQUIRE(nmat == 2 || nmat == 4, "nmat must be 2 or 4, not %d", nmat);
    PL_LAUNCH(ldmatrix_kernel, dim3(1), dim3(32), 0, 0, PL_PTR(const uint16_t, tile), (int)nmat, (int)trans,
              PL_PTR(uint32_t, regs_out));
    PL_CHECK_LAUNCH();
    PL_CHECK(cudaDeviceSynchronize());
    return 0;
}

// ---- Conversions, element-wise ----
__global__ void e4m3_kernel(const uint8_t* in, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = pl_e4m3_to_float(in[i]);
}
__global__ void e4m3x2_kernel(const uint16_t* in, uint32_t* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = pl_half2_bits(pl_e4m3x2_to_half2(in[i]));
}
__global__ void fp16_kernel(const float* in, pl_half* out, float* back, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = pl_f2h(in[i]);
        back[i] = pl_h2f(out[i]);
    }
}
__global__ void bf16_kernel(const float* in, uint16_t* out, float* back, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        out[i] = pl_f2bf(in[i]);
        back[i] = pl_bf2f(out[i]);
    }
}

int emu_e4m3(uint64_t bytes, uint64_t out, int32_t n) {
    PL_LAUNCH(e4m3_kernel, dim3((n + 127) / 128), dim3(128), 0, 0, PL_PTR(const uint8_t, bytes), PL_PTR(float, out),
              n);
    PL_CHECK_LAUNCH();
    PL_CHECK(cudaDeviceSynchronize());
    return 0;
}
int emu_e4m3x2(uint64_t pairs, uint64_t out_half_bits, int32_t n) {
    PL_LAUNCH(e4m3x2_kernel, dim3((n + 127) / 128), dim3(128), 0, 0, PL_PTR(const uint16_t, pairs),
              PL_PTR(uint32_t, out_half_bits), n);
    PL_CHECK_LAUNCH();
    PL_CHECK(cudaDeviceSynchronize());
    return 0;
}
int emu_fp16(uint64_t in, uint64_t out_half_bits, uint64_t back, int32_t n) {
    PL_LAUNCH(fp16_kernel, dim3((n + 127) / 128), dim3(128), 0, 0, PL_PTR(const float, in),
              PL_PTR(pl_half, out_half_bits), PL_PTR(float, back), n);
    PL_CHECK_LAUNCH();
    PL_CHECK(cudaDeviceSynchronize());
    return 0;
}
int emu_bf16(uint64_t in, uint64_t out_bf_bits, uint64_t back, int32_t n) {
    PL_LAUNCH(bf16_kernel, dim3((n + 127) / 128), dim3(128), 0, 0, PL_PTR(const float, in),
              PL_PTR(uint16_t, out_bf_bits), PL_PTR(float, back), n);
    PL_CHECK_LAUNCH();
    PL_CHECK(cudaDeviceSynchronize());
    return 0;
}

// ---- Warp shuffles and votes: out holds 12 results per thread, op-major ----
__global__ void warp_ops_kernel(const int* in, int* out, int n) {
    int t = threadIdx.x, lane = t & 31, v = in[t];
    const unsigned all = 0xffffffffu;
    int r[12];
    r[0] = __shfl_sync(all, v, (lane * 7 + 3) & 31);
    r[1] = __shfl_up_sync(all, v, 3);
    r[2] = __shfl_down_sync(all, v, 5);
    r[3] = __shfl_xor_sync(all, v, 6);
    r[4] = __shfl_sync(all, v, 2, 8);        // lane 2 of each group of 8
    r[5] = __shfl_up_sync(all, v, 1, 4);
    r[6] = __shfl_down_sync(all, v, 2, 16);
    r[7] = __shfl_xor_sync(all, v, 9, 8);    // crosses into the next group: own value for the upper half
    r[8] = (int)__ballot_sync(all, v & 1);
    r[9] = __any_sync(all, v == 12345);
    r[10] = __all_sync(all, v >= 0);
    float f = __shfl_xor_sync(all, (float)v * 0.5f, 1);
    r[11] = (int)(f * 2.0f);
    for (int i = 0; i < 12; i++) out[i * n + t] = r[i];
}

int emu_warp_ops(uint64_t in, uint64_t out, int32_t nthreads) {
    PL_LAUNCH(warp_ops_kernel, dim3(1), dim3(nthreads), 0, 0, PL_PTR(const int, in), PL_PTR(int, out),
              (int)nthreads);
    PL_CHECK_LAUNCH();
    PL_CHECK(cudaDeviceSynchronize());
    return 0;
}

// ---- Barriers: every round each thread publishes a value and reads its neighbour's; only a real barrier
// between the write and the read (and before the next write) gives the exact answer ----
__global__ void barrier_kernel(float* out, int rounds) {
    __shared__ float s[1024];
    int t = threadIdx.x, n = blockDim.x;
    float acc = (float)t;
    for (int r = 0; r < rounds; r++) {
        s[t] = acc;
        __syncthreads();
        acc = acc + 0.5f * s[(t + 1) % n];
        __syncthreads();
    }
    out[blockIdx.x * n + t] = acc;
}

int emu_barrier(uint64_t out, int32_t nthreads, int32_t rounds) {
    PL_LAUNCH(barrier_kernel, dim3(2), dim3(nthreads), 0, 0, PL_PTR(float, out), (int)rounds);
    PL_CHECK_LAUNCH();
    PL_CHECK(cudaDeviceSynchronize());
    return 0;
}

// ---- A shared-memory race (read of a neighbour's slot with no barrier in between) for the schedule check ----
__global__ void race_kernel(float* out, int with_barrier, float salt) {
    __shared__ float s[256];
    int t = threadIdx.x, n = blockDim.x;
    s[t] = salt + t;
    if (with_barrier) __syncthreads();
    out[t] = s[(t + 1) % n];
}

int emu_race(uint64_t out, int32_t nthreads, int32_t with_barrier, float salt) {
    PL_LAUNCH(race_kernel, dim3(1), dim3(nthreads), 0, 0, PL_PTR(float, out), (int)with_barrier, salt);
    PL_CHECK_LAUNCH();
    PL_CHECK(cudaDeviceSynchronize());
    return 0;
}

// ---- Misuse the layer must report (CPU build only: on a GPU these hang or are undefined) ----
__global__ void divergent_kernel(int mode) {
    int t = threadIdx.x;
    if (mode == 0) {                 // a thread leaves before the barrier the others wait at
        if (t == 3) return;
        __syncthreads();
    } else if (mode == 1) {          // two different barriers
        if (t < 16) __syncthreads();
        else __syncthreads();
    } else if (mode == 2) {          // a lane named in the mask never arrives at the shuffle
        if (t == 31) return;
        (void)__shfl_xor_sync(0xffffffffu, t, 1);
    } else if (mode == 3) {          // the mask names lanes that do not exist (a 48-thread block)
        if (t >= 32) (void)__shfl_xor_sync(0xffffffffu, t, 1);
    }
}

int emu_divergent(int32_t mode) {
    PL_LAUNCH(divergent_kernel, dim3(1), dim3(mode == 3 ? 48 : 64), 0, 0, (int)mode);
    PL_CHECK_LAUNCH();
    return 0;
}

// ---- Dynamic shared memory: filled from global, summed back; touch_past_end reads one float beyond it ----
__global__ void dyn_smem_kernel(float* out, int n, int touch_past_end) {
    PL_DYN_SMEM(float, s);
    int t = threadIdx.x;
    for (int i = t; i < n; i += blockDim.x) s[i] = (float)(i & 1023);   // sums stay exact in fp32
    __syncthreads();
    if (t == 0) {
        float acc = 0.f;
        for (int i = 0; i < n + touch_past_end; i++) acc += s[i];
        out[0] = acc;
    }
}

int emu_dyn_smem(uint64_t out, int32_t n, int32_t smem_bytes, int32_t touch_past_end) {
    auto k = dyn_smem_kernel;
    if (smem_bytes > 48 * 1024)
        PL_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
    PL_LAUNCH(k, dim3(1), dim3(128), smem_bytes, 0, PL_PTR(float, out), (int)n, (int)touch_past_end);
    PL_CHECK_LAUNCH();
    PL_CHECK(cudaDeviceSynchronize());
    return 0;
}

__global__ void noop_kernel(int) {}

int emu_launch_config(int32_t threads) {
    PL_LAUNCH(noop_kernel, dim3(1), dim3(threads), 0, 0, 0);
    PL_CHECK_LAUNCH();
    return 0;
}
