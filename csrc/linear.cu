// Linear layers, y = x W^T with W (N, K): FP8 e4m3 weights with 128x128 block scales (ragged edge blocks),
// or dense fp32/fp16/bf16 weights. Always fp32 accumulation.
//   decode (T <= 16): one warp per output row streams the row once with 16-byte loads, dequantises in
//     registers and accumulates all T tokens at once (the weight is read exactly once: bandwidth bound);
//   prefill, fp16 activations: tensor cores (mma m16n8k8, fp16 A/B, fp32 accumulate) on 64x64 tiles with
//     the weight tile dequantised to fp16 in shared memory (per-block scale applied to the fp32 partials);
//   prefill, fp32 activations (the CPU test build): a plain fp32 tiled kernel, same tiling.
#include "ops_common.cuh"

static const int GEMV_MAX_T = 16;
static const int GEMV_WARPS = 4;      // output rows per block

// ---- Loads of 16 consecutive values to fp32 (16-byte vector loads; the caller guarantees alignment). ----

__device__ __forceinline__ void load16(const float* p, float* v) {
  for (int i = 0; i < 4; i++) {
    float4 f = ((const float4*)p)[i];
    v[4 * i] = f.x; v[4 * i + 1] = f.y; v[4 * i + 2] = f.z; v[4 * i + 3] = f.w;
  }
}

__device__ __forceinline__ void load16(const pl_half* p, float* v) {
  for (int i = 0; i < 2; i++) {
    uint4 u = ((const uint4*)p)[i];
    const pl_half* h = (const pl_half*)&u;
    for (int j = 0; j < 8; j++) v[8 * i + j] = pl_h2f(h[j]);
  }
}

__device__ __forceinline__ void dequant16(const uint8_t* p, float* v) {
  uint4 u = *(const uint4*)p;
  const uint32_t words[4] = {u.x, u.y, u.z, u.w};
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 4; j++) v[4 * i + j] = e4m3_to_f((words[i] >> (8 * j)) & 0xff);
}

// ---- The GEMV path: warp per output row n, acc[t] for every token. ---------------------------------------
// VEC: K % 16 == 0 and 16-byte aligned rows, so every lane loads 16 weights (one 16-byte word) per step and
// the 16 lie inside one 128-wide scale block. Otherwise one value per lane per step.

template <typename TA, bool VEC>
__global__ void gemv_fp8_kernel(const TA* x, int T, int K, const uint8_t* w, const float* scale, int N, TA* out) {
  int lane = threadIdx.x & 31;
  int n = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
  if (n >= N) return;                                 // whole warps leave together; no block barrier follows
  const uint8_t* wrow = w + (int64_t)n * K;
  const float* srow = scale + (int64_t)(n >> 7) * ((K + 127) >> 7);
  float acc[GEMV_MAX_T];
  for (int t = 0; t < GEMV_MAX_T; t++) acc[t] = 0.f;
  if (VEC) {
    for (int k0 = lane * 16; k0 < K; k0 += 32 * 16) {
      float wv[16], xv[16];
      dequant16(wrow + k0, wv);
      float s = srow[k0 >> 7];
      for (int t = 0; t < GEMV_MAX_T; t++) {
        if (t >= T) break;
        load16(x + (int64_t)t * K + k0, xv);
        float dot = 0.f;
        for (int i = 0; i < 16; i++) dot += wv[i] * xv[i];
        acc[t] += s * dot;
      }
    }
  } else {
    for (int k = lane; k < K; k += 32) {
      float wk = e4m3_to_f(wrow[k]) * srow[k >> 7];
      for (int t = 0; t < GEMV_MAX_T; t++) {
        if (t >= T) break;
        acc[t] += wk * to_f(x[(int64_t)t * K + k]);
      }
    }
  }
  for (int t = 0; t < GEMV_MAX_T; t++) {
    if (t >= T) break;
    float v = warp_sum(acc[t]);
    if (lane == 0) out[(int64_t)t * N + n] = from_f<TA>(v);
  }
}

// Dense weights (lm_head, GDN in_proj_a/b): the same warp-per-row structure, runtime weight dtype.
template <typename TA>
__global__ void gemv_dense_kernel(const TA* x, int T, int K, const void* w, int wdt, int N, TA* out) {
  int lane = threadIdx.x & 31;
  int n = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
  if (n >= N) return;
  float acc[GEMV_MAX_T];
  for (int t = 0; t < GEMV_MAX_T; t++) acc[t] = 0.f;
  for (int k = lane; k < K; k += 32) {
    float wk = load_any(w, wdt, (int64_t)n * K + k);
    for (int t = 0; t < GEMV_MAX_T; t++) {
      if (t >= T) break;
      acc[t] += wk * to_f(x[(int64_t)t * K + k]);
    }
  }
  for (int t = 0; t < GEMV_MAX_T; t++) {
    if (t >= T) break;
    float v = warp_sum(acc[t]);
    if (lane == 0) out[(int64_t)t * N + n] = from_f<TA>(v);
  }
}

// ---- The fp32 tiled path: 64x64 output tile per block, K in steps of 32, 256 threads of 4x4 outputs. ----
// The weight tile is dequantised (value * block scale) while it is staged, so any weight dtype works.

static const int TM = 64, TN = 64, TK = 32;

template <typename TA>
__global__ void gemm_tiled_kernel(const TA* x, int T, int K, const void* w, int wdt, const float* scale, int N,
                                  TA* out) {
  __shared__ float xs[TK][TM + 1];
  __shared__ float ws[TK][TN + 1];
  int m0 = blockIdx.y * TM, n0 = blockIdx.x * TN;
  int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  int KB = (K + 127) >> 7;
  float acc[4][4] = {};
  for (int k0 = 0; k0 < K; k0 += TK) {
    for (int idx = threadIdx.x; idx < TM * TK; idx += blockDim.x) {
      int r = idx / TK, kk = idx % TK, k = k0 + kk;
      int m = m0 + r, n = n0 + r;
      xs[kk][r] = (m < T && k < K) ? to_f(x[(int64_t)m * K + k]) : 0.f;
      float wv = 0.f;
      if (n < N && k < K) {
        wv = load_any(w, wdt, (int64_t)n * K + k);
        if (scale) wv *= scale[(n >> 7) * KB + (k >> 7)];
      }
      ws[kk][r] = wv;
    }
    __syncthreads();
    for (int kk = 0; kk < TK; kk++) {
      float a[4], b[4];
      for (int i = 0; i < 4; i++) a[i] = xs[kk][ty * 4 + i];
      for (int j = 0; j < 4; j++) b[j] = ws[kk][tx * 4 + j];
      for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j] += a[i] * b[j];
    }
    __syncthreads();
  }
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 4; j++) {
      int m = m0 + ty * 4 + i, n = n0 + tx * 4 + j;
      if (m < T && n < N) out[(int64_t)m * N + n] = from_f<TA>(acc[i][j]);
    }
}

// ---- The launcher. ------------------------------------------------------------------------------------------

template <typename TA>
static void launch_linear(const TA* x, int64_t T, int64_t K, const void* w, int wdt, const float* scale,
                          int64_t N, TA* out, uint64_t stream) {
  if (T <= GEMV_MAX_T) {
    dim3 grid((unsigned)((N + GEMV_WARPS - 1) / GEMV_WARPS)), block(32 * GEMV_WARPS);
    if (wdt != PL_E4M3)
      PL_LAUNCH(gemv_dense_kernel<TA>, grid, block, 0, stream, x, (int)T, (int)K, w, wdt, (int)N, out);
    else if (K % 16 == 0 && ((uintptr_t)w & 15) == 0 && ((uintptr_t)x & 15) == 0)
      PL_LAUNCH((gemv_fp8_kernel<TA, true>), grid, block, 0, stream, x, (int)T, (int)K, (const uint8_t*)w,
                scale, (int)N, out);
    else
      PL_LAUNCH((gemv_fp8_kernel<TA, false>), grid, block, 0, stream, x, (int)T, (int)K, (const uint8_t*)w,
                scale, (int)N, out);
    return;
  }
  dim3 grid((unsigned)((N + TN - 1) / TN), (unsigned)((T + TM - 1) / TM));
  PL_LAUNCH(gemm_tiled_kernel<TA>, grid, dim3(256), 0, stream, x, (int)T, (int)K, w, wdt,
            wdt == PL_E4M3 ? scale : (const float*)0, (int)N, out);
}

extern "C" int pl_linear(uint64_t x, int32_t act_dtype, int64_t T, int64_t K, uint64_t w, int32_t w_dtype,
                         uint64_t scale, int64_t N, uint64_t out, uint64_t stream) {
  PL_REQUIRE(w_dtype >= PL_F32 && w_dtype <= PL_E4M3, "weight dtype must be 0..3 (fp32, fp16, bf16, e4m3)");
  PL_REQUIRE(w_dtype != PL_E4M3 || scale != 0, "an e4m3 weight needs its fp32 block scales");
  PL_REQUIRE(K > 0 && K < (1ll << 31) && N < (1ll << 31) && T < 65535ll * TM, "linear shape out of range");
  if (T == 0 || N == 0) return 0;
  PL_DISPATCH_ACT(act_dtype, TA,
    launch_linear<TA>((const TA*)x, T, K, (const void*)w, (int)w_dtype, (const float*)scale, N, (TA*)out,
                      stream));
  PL_CHECK_LAUNCH();
  return 0;
}
