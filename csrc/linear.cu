// Linear layers, y = x W^T with W (N, K): FP8 e4m3 weights with 128x128 block scales (ragged edge blocks),
// or dense fp32/fp16/bf16 weights. Always fp32 accumulation. The output is the activation type or fp32 (TO):
// with fp16 activations the row-parallel outputs and the logits are written in fp32, since their sums can pass
// 65504; an optional per-row input scale rs (from pl_silu_mul) multiplies each output row in the epilogue.
//   decode (T <= 16), fp16 activations and e4m3 weights: tensor-core GEMV (mma m16n8k8 with the weight as
//     the 16-row operand, tokens as the 8-column one; 16-byte loads, weights widened in registers);
//   decode otherwise (fp32 activations, dense or ragged weights): one warp per output row streams the row once
//     with 16-byte loads where aligned, dequantises in registers, accumulates all T tokens at once;
//   prefill, fp16 activations: tensor cores (mma m16n8k8, fp16 A/B, fp32 accumulate) on 64x64 tiles with
//     the weight tile dequantised to fp16 in shared memory (per-block scale applied to the fp32 partials);
//   prefill, fp32 activations (the CPU test build): a plain fp32 tiled kernel, same tiling.
#include "ops_common.cuh"

static const int GEMV_MAX_T = 16;
static const int GEMV_WARPS = 4;      // output rows per block

// The epilogue's value of output row t: the fp32 sum times that row's input scale, if any.
__device__ __forceinline__ float row_scaled(float v, const float* rs, int64_t t) { return rs ? v * rs[t] : v; }

// Where output (t, n) goes. A fused projection (q|gate|k|v, gate|up, ...) is one weight of N rows whose output
// columns fall into up to four parts [0, e0), [e0, e1), [e1, e2), [e2, N); part p is stored as its own
// contiguous (T, N_p) matrix, the parts one after another, so each consumer reads a plain tensor, whatever T.
// e0 = e1 = e2 = N is the ordinary (T, N) layout.
// With A_log (pl_linear_gdn_gates) the epilogue turns GDN's [a | b] (e0 = Hv) into its gates in fp32:
// g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) (pl_gdn_gates' formulas).
// With conv_w (pl_gdn_in_proj, decode: row t is the one new token of the sequence at state slot slots[t]) the
// epilogue runs GDN's causal conv1d + SiLU over part 0 (the e0 qkv channels), as pl_conv1d does: the value,
// rounded to the output type first (pl_conv1d's input), after the slot's W-1 previous inputs, which it then
// shifts into the conv state (S, e0, W-1). Output (t, n) has one writer, so (t's slot, n) has one too.
struct OutParts {
  int64_t T;
  int e0, e1, e2, N;
  const float* A_log = 0;
  const float* dt_bias = 0;
  const void* conv_w = 0;     // (e0, W) of conv_wdt
  int conv_wdt = 0, W = 0;
  void* conv_state = 0;       // (S, e0, W-1) of conv_sdt
  int conv_sdt = 0;
  const int32_t* slots = 0;   // (T,)
  template <typename TO>
  __device__ __forceinline__ float epi(int64_t t, int n, float v) const {
    if (conv_w && n < e0) return conv(t, n, to_f(from_f<TO>(v)));
    if (!A_log) return v;
    if (n >= e0) return sigmoid_f(v);
    float x = v + dt_bias[n];
    return -expf(A_log[n]) * (x > 20.f ? x : log1pf(expf(x)));   // torch's softplus threshold
  }
  __device__ __forceinline__ float conv(int64_t t, int n, float xt) const {
    int64_t st = ((int64_t)slots[t] * e0 + n) * (W - 1), wi = (int64_t)n * W;
    float y = load_any(conv_w, conv_wdt, wi + W - 1) * xt;
    for (int j = 0; j < W - 1; j++) {
      float prev = load_any(conv_state, conv_sdt, st + j);
      y += load_any(conv_w, conv_wdt, wi + j) * prev;
      if (j > 0) store_any(conv_state, conv_sdt, st + j - 1, prev);     // shift left: the oldest leaves
    }
    store_any(conv_state, conv_sdt, st + W - 2, xt);
    return silu_f(y);
  }
  __device__ __forceinline__ int64_t at(int64_t t, int n) const {
    int s = n < e0 ? 0 : n < e1 ? e0 : n < e2 ? e1 : e2;
    int e = n < e0 ? e0 : n < e1 ? e1 : n < e2 ? e2 : N;
    return T * s + t * (e - s) + (n - s);
  }
};

// The input of pl_norm_linear_*: h = act(rmsnorm(residual + x) * (1 + w)) (pl_add_rmsnorm's formulas), computed
// on the fly from the fp32 residual stream and the fp32 row-parallel output x, so the decoder layer's add + norm
// needs no launch of its own. Each block first reduces every token's sum of squares into shared memory (it
// re-reads the (T, K) inputs, which sit in L2: T <= 16 rows of K floats); block 0 also writes residual + x to
// res_out (a separate buffer: the other blocks still read res). Then every load of x goes through xin().
// x == 0: no prologue, the kernel reads its ordinary activation input.
struct Prenorm {
  const float* x = 0;         // (T, K) fp32
  const float* res = 0;       // (T, K) fp32
  float* res_out = 0;         // (T, K) fp32 = res + x; 0 when an earlier op of the step wrote it
  const void* w = 0;          // (K,) the norm's weight, dtype wdt
  int wdt = 0;
  float eps = 0.f;
};

// Every thread of the block calls it (a barrier inside), before any warp leaves.
template <bool NORM>
__device__ __forceinline__ void prenorm_prologue(const Prenorm& pn, int T, int K, float* inv) {
  if (!NORM) return;
  __shared__ float red[32];
  bool first = blockIdx.x == 0 && blockIdx.y == 0 && pn.res_out;
  for (int t = 0; t < T; t++) {
    float ss = 0.f;
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
      int64_t i = (int64_t)t * K + k;
      float r = pn.x[i] + pn.res[i];
      if (first) pn.res_out[i] = r;
      ss += r * r;
    }
    float total = block_sum(ss, red);
    if (threadIdx.x == 0) inv[t] = rsqrtf(total / K + pn.eps);
  }
  __syncthreads();
}

// Input value (t, k) as the kernel multiplies it: x's, or the normed one rounded to the activation type.
template <typename TA, bool NORM>
__device__ __forceinline__ float xin(const TA* x, const Prenorm& pn, const float* inv, int64_t t, int k, int K) {
  int64_t i = t * K + k;
  if (!NORM) return to_f(x[i]);
  return to_f(from_f<TA>((pn.x[i] + pn.res[i]) * inv[t] * (1.f + load_any(pn.w, pn.wdt, k))));
}

// Eight normed fp16 inputs (t, k .. k+7), packed as the tensor-core GEMV loads them.
__device__ __forceinline__ uint4 xin8_half(const Prenorm& pn, const float* inv, int64_t t, int k, int K) {
  uint32_t u[4];
  for (int j = 0; j < 4; j++)
    u[j] = pl_half2_bits(pl_make_half2(pl_f2h(xin<pl_half, true>(0, pn, inv, t, k + 2 * j, K)),
                                       pl_f2h(xin<pl_half, true>(0, pn, inv, t, k + 2 * j + 1, K))));
  return make_uint4(u[0], u[1], u[2], u[3]);
}

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

// GLU (pl_linear_glu): the weight is [gate (N/2 rows) | up (N/2 rows)] and warp n computes rows n and n + N/2
// from the same x loads, writing silu(gate) * up as output column n of N/2.

// Each GEMV is a __device__ body taking its block's index bx, run by a thin kernel (bx = blockIdx.x) or by a kernel
// that runs two GEMVs side by side in one grid (gdn_in_proj_gates_kernel).
template <typename TA, typename TO, bool VEC, bool GLU = false, bool NORM = false>
__device__ __forceinline__ void gemv_fp8_body(int bx, const TA* x, const float* rs, int T, int K, const uint8_t* w,
                                              const float* scale, int N, const OutParts& op, TO* out,
                                              const Prenorm& pn) {
  const int NR = GLU ? 2 : 1;                         // weight rows per warp
  int rows = GLU ? N / 2 : N;
  __shared__ float inv[GEMV_MAX_T];
  prenorm_prologue<NORM>(pn, T, K, inv);
  int lane = threadIdx.x & 31;
  int n = bx * GEMV_WARPS + (threadIdx.x >> 5);
  if (n >= rows) return;                              // whole warps leave together; no block barrier follows
  const uint8_t* wrow[NR];
  const float* srow[NR];
  for (int r = 0; r < NR; r++) {
    int64_t nr = n + (int64_t)r * rows;
    wrow[r] = w + nr * K;
    srow[r] = scale + (nr >> 7) * ((K + 127) >> 7);
  }
  float acc[NR][GEMV_MAX_T];
  for (int r = 0; r < NR; r++)
    for (int t = 0; t < GEMV_MAX_T; t++) acc[r][t] = 0.f;
  if (VEC) {
    for (int k0 = lane * 16; k0 < K; k0 += 32 * 16) {
      float wv[NR][16], xv[16], s[NR];
      for (int r = 0; r < NR; r++) {
        dequant16(wrow[r] + k0, wv[r]);
        s[r] = srow[r][k0 >> 7];
      }
#pragma unroll
      for (int t = 0; t < GEMV_MAX_T; t++) {
        if (t < T) {
          if (NORM)
            for (int i = 0; i < 16; i++) xv[i] = xin<TA, true>(x, pn, inv, t, k0 + i, K);
          else
            load16(x + (int64_t)t * K + k0, xv);
          for (int r = 0; r < NR; r++) {
            float dot = 0.f;
#pragma unroll
            for (int i = 0; i < 16; i++) dot += wv[r][i] * xv[i];
            acc[r][t] += s[r] * dot;
          }
        }
      }
    }
  } else {
    for (int k = lane; k < K; k += 32) {
      for (int r = 0; r < NR; r++) {
        float wk = e4m3_to_f(wrow[r][k]) * srow[r][k >> 7];
#pragma unroll
        for (int t = 0; t < GEMV_MAX_T; t++)
          if (t < T) acc[r][t] += wk * xin<TA, NORM>(x, pn, inv, t, k, K);
      }
    }
  }
  for (int t = 0; t < GEMV_MAX_T; t++) {
    if (t >= T) break;
    float v = warp_sum(acc[0][t]);
    if (GLU) v = silu_f(v) * warp_sum(acc[NR - 1][t]);
    if (lane == 0) out[op.at(t, n)] = from_f<TO>(op.epi<TO>(t, n, row_scaled(v, rs, t)));
  }
}

template <typename TA, typename TO, bool VEC, bool GLU = false, bool NORM = false>
__global__ void gemv_fp8_kernel(const TA* x, const float* rs, int T, int K, const uint8_t* w, const float* scale,
                                int N, OutParts op, TO* out, Prenorm pn) {
  gemv_fp8_body<TA, TO, VEC, GLU, NORM>(blockIdx.x, x, rs, T, K, w, scale, N, op, out, pn);
}

// Dense weights (lm_head, GDN in_proj_a/b): the same warp-per-row structure. VEC (K % 8 == 0, aligned rows):
// each lane converts 8 consecutive weights per step from one 16-byte (bf16/fp16) or two (fp32) loads.
template <int WDT>
__device__ __forceinline__ void load8_w(const void* w, int64_t i, float* v) {
  if (WDT == PL_F32) {
    float4 a = *(const float4*)((const float*)w + i), b = *(const float4*)((const float*)w + i + 4);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  } else {
    uint4 u = *(const uint4*)((const uint16_t*)w + i);
    const uint32_t words[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
      if (WDT == PL_BF16) {
        v[2 * j] = pl_bf2f((uint16_t)(words[j] & 0xffff));
        v[2 * j + 1] = pl_bf2f((uint16_t)(words[j] >> 16));
      } else {
        pl_half2 h = pl_bits_half2(words[j]);
        const pl_half* hp = (const pl_half*)&h;
        v[2 * j] = pl_h2f(hp[0]);
        v[2 * j + 1] = pl_h2f(hp[1]);
      }
    }
  }
}

// Eight activations as one 16-byte load (two for fp32): at T tokens each weight load meets T activation loads, so
// scalar ones made the dense GEMV load-issue-bound (on an H200 the bf16 lm_head at 8 tokens: 5.03 ms scalar, 2.20
// vector). At one token the scalar loads measured faster (1.07 vs 1.89 ms, not understood): load8_x_scalar.
template <typename TA>
__device__ __forceinline__ void load8_x_scalar(const TA* p, float* v) {
  for (int j = 0; j < 8; j++) v[j] = to_f(p[j]);
}

__device__ __forceinline__ void load8_x(const pl_half* p, float* v) {
  uint4 u = *(const uint4*)p;
  const pl_half* h = (const pl_half*)&u;
  for (int j = 0; j < 8; j++) v[j] = pl_h2f(h[j]);
}

__device__ __forceinline__ void load8_x(const float* p, float* v) {
  float4 a = ((const float4*)p)[0], b = ((const float4*)p)[1];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

template <typename TA>
__device__ __forceinline__ void load8_x(const TA* p, float* v) {
  load8_x_scalar(p, v);
}

// WPR warps per row (a few output rows, e.g. GDN's in_proj_a|b: 96 rows at TP1, 24 at TP4): a row's K is dealt
// out to WPR warps in 256-wide chunks, so more loads are in flight instead of one warp's chain of DRAM round
// trips; the warps' sums meet in shared memory, in warp order. GLU as in gemv_fp8_kernel. WARPS: the block's.
template <typename TA, typename TO, int WDT, bool VEC, bool GLU = false, int WPR = 1, bool NORM = false,
          int WARPS = GEMV_WARPS>
__device__ __forceinline__ void gemv_dense_body(int bx, const TA* x, const float* rs, int T, int K, const void* w,
                                                int N, const OutParts& op, TO* out, const Prenorm& pn) {
  const int NR = GLU ? 2 : 1;
  int rows = GLU ? N / 2 : N;
  __shared__ float inv[GEMV_MAX_T];
  prenorm_prologue<NORM>(pn, T, K, inv);
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int n = bx * (WARPS / WPR) + warp / WPR, part = warp % WPR;
  if (WPR == 1 && n >= rows) return;                  // whole warps leave together; no block barrier follows
  bool live = n < rows;
  float acc[NR][GEMV_MAX_T];
  for (int r = 0; r < NR; r++)
    for (int t = 0; t < GEMV_MAX_T; t++) acc[r][t] = 0.f;
  if (live && VEC) {
    for (int k0 = (part * 32 + lane) * 8; k0 < K; k0 += WPR * 32 * 8) {
      float wv[NR][8], xv[8];
      for (int r = 0; r < NR; r++) load8_w<WDT>(w, (n + (int64_t)r * rows) * K + k0, wv[r]);
#pragma unroll
      for (int t = 0; t < GEMV_MAX_T; t++) {
        if (t < T) {
          if (NORM)
            for (int i = 0; i < 8; i++) xv[i] = xin<TA, true>(x, pn, inv, t, k0 + i, K);
          else if (T == 1)
            load8_x_scalar(x + k0, xv);
          else
            load8_x(x + (int64_t)t * K + k0, xv);
          for (int r = 0; r < NR; r++)
#pragma unroll
            for (int i = 0; i < 8; i++) acc[r][t] += wv[r][i] * xv[i];
        }
      }
    }
  } else if (live) {
    for (int k = part * 32 + lane; k < K; k += WPR * 32) {
      for (int r = 0; r < NR; r++) {
        float wk = load_any(w, WDT, (n + (int64_t)r * rows) * K + k);
#pragma unroll
        for (int t = 0; t < GEMV_MAX_T; t++)
          if (t < T) acc[r][t] += wk * xin<TA, NORM>(x, pn, inv, t, k, K);
      }
    }
  }
  __shared__ float red[WPR > 1 ? WARPS : 1][NR][GEMV_MAX_T];
  if (WPR > 1) {
    for (int t = 0; t < T; t++)
      for (int r = 0; r < NR; r++) {
        float v = warp_sum(acc[r][t]);
        if (lane == 0) red[warp][r][t] = v;
      }
    __syncthreads();
    if (!live || part != 0) return;
  }
#pragma unroll
  for (int t = 0; t < GEMV_MAX_T; t++) {
    if (t < T) {
      float v[NR];
      for (int r = 0; r < NR; r++) {
        if (WPR == 1) {
          v[r] = warp_sum(acc[r][t]);
        } else {
          v[r] = 0.f;
          for (int p = 0; p < WPR; p++) v[r] += red[warp + p][r][t];
        }
      }
      float y = GLU ? silu_f(v[0]) * v[NR - 1] : v[0];
      if (lane == 0) out[op.at(t, n)] = from_f<TO>(op.epi<TO>(t, n, row_scaled(y, rs, t)));
    }
  }
}

template <typename TA, typename TO, int WDT, bool VEC, bool GLU = false, int WPR = 1, bool NORM = false>
__global__ void gemv_dense_kernel(const TA* x, const float* rs, int T, int K, const void* w, int N, OutParts op,
                                  TO* out, Prenorm pn) {
  gemv_dense_body<TA, TO, WDT, VEC, GLU, WPR, NORM>(blockIdx.x, x, rs, T, K, w, N, op, out, pn);
}

// ---- The tensor-core GEMV (fp16 activations, e4m3 weights, K % 16 == 0): the weight is the mma's A operand
// (16 output rows x 8 k), the tokens its B operand (8 k x 8 tokens; two token tiles for T > 8), so each byte
// of weight costs two integer operations to widen (pl_e4m3x2_to_half2) and the tensor core does the rest.
// Block = 16 output rows, 8 warps splitting K into 64-wide chunks. Lane (g = lane/4, t = lane%4) loads 16
// bytes of rows g and g+8 at k = chunk + 16t and 16 halves of token g there; mma step s (0..7) uses bytes /
// halves 2s, 2s+1 of those: a consistent permutation of k between A and B, so the dot products are unchanged.
// A 64-wide chunk and the 16 rows lie inside one 128x128 scale block: one scale per chunk. ---------------------

static const int GEMV_MMA_WARPS = 8;      // warps of a block by default (pl_set_gemv_tuning: 4 or 8)
static const int GEMV_MAX_SPLIT = 16;

// Split-K of the tensor-core GEMV: gridDim.y blocks share a 16-row tile, each over its own range of whole
// 64-wide chunks of K. With one block per tile a grid of few tiles leaves SMs idle (down_proj at TP1: 320 tiles
// for 528 block slots of an H200; gemv_splits says when splitting pays). Each
// block writes its (16 rows x 8 NT tokens) fp32 sums to ws in the mma's lane layout and counts itself in
// counters[tile]; the last of the tile's blocks adds the partials in split order (the same sums whichever block
// arrives last), runs the epilogue and zeroes the counter. ws: gridDim.x * gridDim.y * NT * 128 floats.
struct SplitK {
  float* ws = 0;
  unsigned* counters = 0;
};

// GLU (N/2 % 8 == 0): a block takes 8 output columns c0..c0+7, gate rows c0 + g as the A operand's rows g and up
// rows N/2 + c0 + g as its rows g + 8, so each lane ends up holding gate and up of the same (column, token)s.
template <int NT, typename TO, bool GLU = false, bool NORM = false>
__device__ __forceinline__ void gemv_mma_body(int bx, const pl_half* x, const float* rs, int T, int K,
                                              const uint8_t* w, const float* scale, int N, const OutParts& op,
                                              TO* out, const Prenorm& pn, const SplitK& sk = SplitK()) {
  __shared__ float red[GEMV_MMA_WARPS][32][NT * 4];
  __shared__ float inv[GEMV_MAX_T];
  prenorm_prologue<NORM>(pn, T, K, inv);
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  int ks = gridDim.y, by = blockIdx.y, chunks = (K + 63) >> 6;         // this block's split of K's 64-chunks
  int kbeg = (int)((int64_t)by * chunks / ks) * 64, kend = (int)((int64_t)(by + 1) * chunks / ks) * 64;
  kend = kend < K ? kend : K;
  int g = lane >> 2, t = lane & 3;
  int rows = GLU ? N / 2 : N;
  int n0 = GLU ? bx * 8 : bx * 16;                            // the block's first output column
  int base_b = GLU ? rows + n0 : n0 + 8;                       // the first weight row of A rows 8..15
  int KB = (K + 127) >> 7;
  const float* srow = scale + (int64_t)(n0 >> 7) * KB;
  const float* srow_b = scale + (int64_t)(base_b >> 7) * KB;
  // Registers of one chunk: rows g and g+8 of the weight, and the x slices of token g (+8 for the 2nd tile).
  struct Chunk { uint4 wa, wb, xa[NT], xb[NT]; };
  auto load = [&](int c0, Chunk& c) {
    int k = c0 + 16 * t;
    uint4 z = make_uint4(0, 0, 0, 0);
    c.wa = c.wb = z;
    if (k < kend) {
      if (n0 + g < rows) c.wa = *(const uint4*)(w + (int64_t)(n0 + g) * K + k);
      if ((GLU ? n0 + g < rows : base_b + g < N)) c.wb = *(const uint4*)(w + (int64_t)(base_b + g) * K + k);
    }
#pragma unroll
    for (int j = 0; j < NT; j++) {
      int tok = 8 * j + g;
      c.xa[j] = c.xb[j] = z;
      if (k < kend && tok < T && NORM) {
        c.xa[j] = xin8_half(pn, inv, tok, k, K);
        c.xb[j] = xin8_half(pn, inv, tok, k + 8, K);
      } else if (k < kend && tok < T) {
        c.xa[j] = *(const uint4*)(x + (int64_t)tok * K + k);
        c.xb[j] = *(const uint4*)(x + (int64_t)tok * K + k + 8);
      }
    }
  };
  const int step = warps * 64;
  float acc[NT][4] = {};
  // Two chunks in flight while one is multiplied (zeros past K): with one, the kernel held 40-50% of an H200's
  // copy bandwidth (docs/benchmarks.md), about 1 KB per warp outstanding being too little to cover DRAM latency.
  Chunk cur, nxt, nxt2;
  load(kbeg + warp * 64, cur);
  load(kbeg + warp * 64 + step, nxt);
  for (int c0 = kbeg + warp * 64; c0 < kend; c0 += step) {
    load(c0 + 2 * step, nxt2);
    const uint32_t wa_w[4] = {cur.wa.x, cur.wa.y, cur.wa.z, cur.wa.w}, wb_w[4] = {cur.wb.x, cur.wb.y, cur.wb.z, cur.wb.w};
    float part[NT][4] = {};
#pragma unroll
    for (int s = 0; s < 8; s++) {
      int sh = 16 * (s & 1);
      uint32_t a[2] = {pl_half2_bits(pl_e4m3x2_to_half2((uint16_t)(wa_w[s >> 1] >> sh))),
                       pl_half2_bits(pl_e4m3x2_to_half2((uint16_t)(wb_w[s >> 1] >> sh)))};
#pragma unroll
      for (int j = 0; j < NT; j++) {
        const uint32_t xw[8] = {cur.xa[j].x, cur.xa[j].y, cur.xa[j].z, cur.xa[j].w,
                                cur.xb[j].x, cur.xb[j].y, cur.xb[j].z, cur.xb[j].w};
        pl_mma_m16n8k8(part[j], a, xw[s], part[j]);
      }
    }
    float sc = srow[c0 >> 7] * 256.f, sc_b = srow_b[c0 >> 7] * 256.f;   // the 2^8 of pl_e4m3x2_to_half2
#pragma unroll
    for (int j = 0; j < NT; j++)
      for (int i = 0; i < 4; i++) acc[j][i] += (i < 2 ? sc : sc_b) * part[j][i];
    cur = nxt;
    nxt = nxt2;
  }
  for (int j = 0; j < NT; j++)
    for (int i = 0; i < 4; i++) red[warp][lane][j * 4 + i] = acc[j][i];
  __syncthreads();
  if (warp != 0) return;
  float v[NT][4];
  for (int j = 0; j < NT; j++)
    for (int i = 0; i < 4; i++) {
      v[j][i] = 0.f;
      for (int w2 = 0; w2 < warps; w2++) v[j][i] += red[w2][lane][j * 4 + i];
    }
  if (ks > 1) {                                        // split-K: the tile's last block adds every split's sums
    float* part = sk.ws + ((int64_t)bx * ks + by) * (NT * 128);
    for (int j = 0; j < NT; j++)
      for (int i = 0; i < 4; i++) part[(j * 4 + i) * 32 + lane] = v[j][i];
    __threadfence();                                   // this split's sums are visible before its count
    unsigned last = 0;
    if (lane == 0) last = atomicAdd(&sk.counters[bx], 1u) == (unsigned)ks - 1;
    if (!__shfl_sync(0xffffffffu, last, 0)) return;
    __threadfence();
    const volatile float* parts = sk.ws + (int64_t)bx * ks * (NT * 128);   // past the L1 (other blocks wrote it)
    for (int j = 0; j < NT; j++)
      for (int i = 0; i < 4; i++) {
        float sum = 0.f;
        for (int y = 0; y < ks; y++) sum += parts[y * (NT * 128) + (j * 4 + i) * 32 + lane];
        v[j][i] = sum;
      }
    if (lane == 0) sk.counters[bx] = 0;                // ready for the next launch
  }
  // d[0..1] = D[g][2t..2t+1], d[2..3] = D[g+8][2t..2t+1]: rows n0+g(+8), tokens 8j+2t(+1).
  for (int j = 0; j < NT; j++) {
    for (int i = 0; i < (GLU ? 2 : 4); i++) {
      int n = n0 + g + (i >= 2 ? 8 : 0), tok = 8 * j + 2 * t + (i & 1);
      float y = GLU ? silu_f(v[j][i]) * v[j][i + 2] : v[j][i];
      if (n < rows && tok < T) out[op.at(tok, n)] = from_f<TO>(op.epi<TO>(tok, n, row_scaled(y, rs, tok)));
    }
  }
}

template <int NT, typename TO, bool GLU = false, bool NORM = false>
__global__ void gemv_mma_kernel(const pl_half* x, const float* rs, int T, int K, const uint8_t* w,
                                const float* scale, int N, OutParts op, TO* out, Prenorm pn, SplitK sk) {
  gemv_mma_body<NT, TO, GLU, NORM>(blockIdx.x, x, rs, T, K, w, scale, N, op, out, pn, sk);
}

// ---- The fp32 tiled path: 64x64 output tile per block, K in steps of 32, 256 threads of 4x4 outputs. ----
// The weight tile is dequantised (value * block scale) while it is staged, so any weight dtype works.

static const int TM = 64, TN = 64, TK = 32;

template <typename TA, typename TO>
__global__ void gemm_tiled_kernel(const TA* x, const float* rs, int T, int K, const void* w, int wdt,
                                  const float* scale, int N, OutParts op, TO* out) {
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
      if (m < T && n < N) out[op.at(m, n)] = from_f<TO>(op.epi<TO>(m, n, row_scaled(acc[i][j], rs, m)));
    }
}

// ---- The tensor-core path (fp16 activations; e4m3 or fp16 weights): 64x64 output tile per block, 4 warps of
// 32x32, K in tiles of 32 staged as fp16 in shared memory, mma m16n8k8 (fp16 x fp16 -> fp32).
// A 64-row weight tile starting at a multiple of 64 lies inside one 128-row scale block, and a 32-wide K tile
// inside one 128-wide one, so the whole tile shares one scale: the mma accumulates the raw products of one
// 128-wide K block into `part`, which is then scaled into `acc`. e4m3 weights are staged as value * 2^-8
// (exact in fp16, subnormals included; the 2^8 goes into the scale). VEC (K % 16 == 0, aligned): 16-byte
// loads; otherwise element loads with zero fill past the edges.

static const int MK = 32, MPAD = 8;   // K tile; row padding in halves (keeps rows 16-byte aligned, spreads banks)

template <bool FP8, bool VEC>
__device__ __forceinline__ void stage_tiles(const pl_half* x, int T, int K, const void* w, int N, int m0, int n0, int k0,
                                            pl_half (*xs)[MK + MPAD], pl_half (*ws)[MK + MPAD]) {
  const pl_half zero = pl_f2h(0.f);
  if (VEC) {
    // x: 64 rows x 4 chunks of 8 halves; 2 chunks per thread.
    for (int c = threadIdx.x; c < TM * 4; c += blockDim.x) {
      int r = c >> 2, kk = (c & 3) * 8, m = m0 + r, k = k0 + kk;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (m < T && k < K) v = *(const uint4*)(x + (int64_t)m * K + k);
      *(uint4*)&xs[r][kk] = v;
    }
    if (FP8) {
      // w: 64 rows x 2 chunks of 16 bytes; one chunk per thread, widened to 16 halves.
      for (int c = threadIdx.x; c < TN * 2; c += blockDim.x) {
        int r = c >> 1, kk = (c & 1) * 16, n = n0 + r, k = k0 + kk;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (n < N && k < K) v = *(const uint4*)((const uint8_t*)w + (int64_t)n * K + k);
        const uint32_t words[4] = {v.x, v.y, v.z, v.w};
        uint32_t h[8];
        for (int i = 0; i < 4; i++) {
          h[2 * i] = pl_half2_bits(pl_e4m3x2_to_half2((uint16_t)(words[i] & 0xffff)));
          h[2 * i + 1] = pl_half2_bits(pl_e4m3x2_to_half2((uint16_t)(words[i] >> 16)));
        }
        *(uint4*)&ws[r][kk] = make_uint4(h[0], h[1], h[2], h[3]);
        *(uint4*)&ws[r][kk + 8] = make_uint4(h[4], h[5], h[6], h[7]);
      }
    } else {
      for (int c = threadIdx.x; c < TN * 4; c += blockDim.x) {
        int r = c >> 2, kk = (c & 3) * 8, n = n0 + r, k = k0 + kk;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (n < N && k < K) v = *(const uint4*)((const pl_half*)w + (int64_t)n * K + k);
        *(uint4*)&ws[r][kk] = v;
      }
    }
  } else {
    for (int idx = threadIdx.x; idx < TM * MK; idx += blockDim.x) {
      int r = idx / MK, kk = idx % MK, k = k0 + kk, m = m0 + r, n = n0 + r;
      xs[r][kk] = (m < T && k < K) ? x[(int64_t)m * K + k] : zero;
      pl_half wv = zero;
      if (n < N && k < K) {
        if (FP8) wv = pl_f2h(e4m3_to_f(((const uint8_t*)w)[(int64_t)n * K + k]) * 0.00390625f);   // * 2^-8
        else wv = ((const pl_half*)w)[(int64_t)n * K + k];
      }
      ws[r][kk] = wv;
    }
  }
}

template <bool FP8, bool VEC, typename TO>
__global__ void gemm_mma_kernel(const pl_half* x, const float* rs, int T, int K, const void* w, const float* scale,
                                int N, OutParts op, TO* out) {
  __shared__ __align__(16) pl_half xs[TM][MK + MPAD];
  __shared__ __align__(16) pl_half ws[TN][MK + MPAD];
  int m0 = blockIdx.y * TM, n0 = blockIdx.x * TN;
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;       // this warp's 32x32 sub-tile
  int g = lane >> 2, t = lane & 3;                       // fragment coordinates (PTX ISA layout)
  int KB = (K + 127) >> 7;
  float acc[2][4][4] = {};
  for (int kb = 0; kb < KB; kb++) {
    float part[2][4][4] = {};
    for (int k0 = kb * 128; k0 < kb * 128 + 128 && k0 < K; k0 += MK) {
      stage_tiles<FP8, VEC>(x, T, K, w, N, m0, n0, k0, xs, ws);
      __syncthreads();
      for (int ks = 0; ks < MK; ks += 8) {
        uint32_t a[2][2], b[4];
        for (int mi = 0; mi < 2; mi++) {
          a[mi][0] = *(const uint32_t*)&xs[wm + mi * 16 + g][ks + 2 * t];
          a[mi][1] = *(const uint32_t*)&xs[wm + mi * 16 + g + 8][ks + 2 * t];
        }
        for (int ni = 0; ni < 4; ni++) b[ni] = *(const uint32_t*)&ws[wn + ni * 8 + g][ks + 2 * t];
        for (int mi = 0; mi < 2; mi++)
          for (int ni = 0; ni < 4; ni++) pl_mma_m16n8k8(part[mi][ni], a[mi], b[ni], part[mi][ni]);
      }
      __syncthreads();
    }
    float s = FP8 ? scale[(n0 >> 7) * KB + kb] * 256.f : 1.f;
    for (int mi = 0; mi < 2; mi++)
      for (int ni = 0; ni < 4; ni++)
        for (int i = 0; i < 4; i++) acc[mi][ni][i] += s * part[mi][ni][i];
  }
  // c[0..1] = C[g][2t..2t+1], c[2..3] = C[g+8][2t..2t+1].
  for (int mi = 0; mi < 2; mi++)
    for (int ni = 0; ni < 4; ni++)
      for (int i = 0; i < 4; i++) {
        int m = m0 + wm + mi * 16 + g + (i >= 2 ? 8 : 0), n = n0 + wn + ni * 8 + 2 * t + (i & 1);
        if (m < T && n < N) out[op.at(m, n)] = from_f<TO>(op.epi<TO>(m, n, row_scaled(acc[mi][ni][i], rs, m)));
      }
}

// ---- The launcher. ------------------------------------------------------------------------------------------

// The tensor-core path takes fp16 activations with e4m3 or fp16 weights; returns false for other cases.
template <typename TO>
static bool launch_mma(const float*, const float*, int64_t, int64_t, const void*, int, const float*, int64_t,
                       OutParts, TO*, dim3, uint64_t) {
  return false;
}

template <typename TO>
static bool launch_mma(const pl_half* x, const float* rs, int64_t T, int64_t K, const void* w, int wdt,
                       const float* scale, int64_t N, OutParts op, TO* out, dim3 grid, uint64_t stream) {
  if (wdt != PL_E4M3 && wdt != PL_F16) return false;
  bool vec = K % 16 == 0 && ((uintptr_t)x & 15) == 0 && ((uintptr_t)w & 15) == 0;
  dim3 block(128);
  if (wdt == PL_E4M3 && vec)
    PL_LAUNCH((gemm_mma_kernel<true, true, TO>), grid, block, 0, stream, x, rs, (int)T, (int)K, w, scale, (int)N, op, out);
  else if (wdt == PL_E4M3)
    PL_LAUNCH((gemm_mma_kernel<true, false, TO>), grid, block, 0, stream, x, rs, (int)T, (int)K, w, scale, (int)N, op, out);
  else if (vec)
    PL_LAUNCH((gemm_mma_kernel<false, true, TO>), grid, block, 0, stream, x, rs, (int)T, (int)K, w, scale, (int)N, op, out);
  else
    PL_LAUNCH((gemm_mma_kernel<false, false, TO>), grid, block, 0, stream, x, rs, (int)T, (int)K, w, scale, (int)N, op, out);
  return true;
}

// The tensor-core GEMV takes fp16 activations, e4m3 weights, K % 16 == 0, aligned (GLU: N/2 % 8 == 0); false
// for other cases.
template <bool GLU, bool NORM, typename TO>
static bool launch_gemv_mma(const float*, const float*, int64_t, int64_t, const void*, int, const float*, int64_t,
                            OutParts, TO*, const Prenorm&, uint64_t) {
  return false;
}

// The calling thread's split-K scratch on its current device (pl_set_gemv_scratch), and the tuning switches
// (pl_set_gemv_tuning: warps per block, 0 = GEMV_MMA_WARPS; splits, 0 = gemv_splits' choice, -1 = none).
struct GemvScratch {
  int device = -1;
  float* ws = 0;
  int64_t floats = 0;
  unsigned* counters = 0;
  int64_t n_counters = 0;
};
inline thread_local GemvScratch g_gemv_scratch;
inline std::atomic<int> g_gemv_warps{0}, g_gemv_splits{0};

static int current_device() {
  int device = 0;
  return cudaGetDevice(&device) == cudaSuccess ? device : -1;
}

// Streaming multiprocessors of `device`, cached (the CPU build's runtime answers as an RTX 2080 Ti: 68).
static int sm_count(int device) {
  static std::atomic<int> cached[64];
  if (device < 0 || device >= 64) return 1;
  int n = cached[device].load(std::memory_order_relaxed);
  if (n == 0) {
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n < 1) n = 1;
    cached[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

// Splits of K for `tiles` 16-row tiles, as measured on an H200 (docs/benchmarks.md, "Fourth run"): more, shorter
// blocks cost more than a ragged last wave saves (gate|up's 1088 tiles: 42 us unsplit, 48-72 us split 2-8), so
// only a grid of less than one wave of block slots (resident blocks of `warps` warps: about 32 warps per SM at
// one token tile, 20 at two) is split, into at most enough splits to fill one wave, each keeping at least 64
// chunks (K >= 4096) and at most 4: the 27B's down_proj at TP1 (320 tiles, K 17408) 50 -> 44 us; o_proj's
// K 6144 is not split (19 vs 18 us). 1 without scratch or with NORM's prologue in the kernel (its first block
// writes the residual stream). Bounded by the scratch's floats and counters.
static int gemv_splits(int64_t tiles, int64_t K, int nt, int warps, bool norm) {
  const GemvScratch& sc = g_gemv_scratch;
  int forced = g_gemv_splits.load(std::memory_order_relaxed);
  if (norm || forced < 0 || !sc.ws || tiles > sc.n_counters) return 1;
  int device = current_device();
  if (device != sc.device) return 1;
  int64_t chunks = (K + 63) / 64, ks = forced;
  if (ks == 0) {
    int64_t slots = (int64_t)sm_count(device) * ((nt == 1 ? 32 : 20) / warps);
    ks = tiles >= slots ? 1 : (slots + tiles - 1) / tiles;
    ks = ks < chunks / 64 ? ks : chunks / 64;
    ks = ks < 4 ? ks : 4;
  }
  ks = ks < 1 ? 1 : ks > GEMV_MAX_SPLIT ? GEMV_MAX_SPLIT : ks;
  ks = ks > chunks ? chunks : ks;
  while (ks > 1 && tiles * ks * nt * 128 > sc.floats) ks--;
  return (int)ks;
}

extern "C" int pl_set_gemv_scratch(uint64_t workspace, int64_t workspace_bytes, uint64_t counters,
                                   int64_t n_counters) {
  PL_REQUIRE(workspace_bytes >= 0 && n_counters >= 0, "scratch sizes must not be negative");
  GemvScratch sc;
  if (workspace && counters) {
    sc.device = current_device();
    sc.ws = (float*)workspace;
    sc.floats = workspace_bytes / (int64_t)sizeof(float);
    sc.counters = (unsigned*)counters;
    sc.n_counters = n_counters;
  }
  g_gemv_scratch = sc;
  return 0;
}

extern "C" int pl_set_gemv_tuning(int32_t warps, int32_t splits) {
  PL_REQUIRE(warps == 0 || warps == 4 || warps == 8, "GEMV warps %d: must be 0 (default), 4 or 8", (int)warps);
  PL_REQUIRE(splits >= -1 && splits <= GEMV_MAX_SPLIT, "GEMV splits %d: must be -1 (none), 0 (auto) or 1..%d",
             (int)splits, GEMV_MAX_SPLIT);
  g_gemv_warps.store(warps);
  g_gemv_splits.store(splits);
  return 0;
}

static int gemv_warps() {
  int w = g_gemv_warps.load(std::memory_order_relaxed);
  return w ? w : GEMV_MMA_WARPS;
}

extern "C" int pl_gemv_plan(int64_t T, int64_t K, int64_t N, int32_t glu, int32_t* warps, int32_t* splits) {
  PL_REQUIRE(warps && splits && T >= 1 && T <= GEMV_MAX_T && K > 0 && N > 0, "pl_gemv_plan: bad arguments");
  *warps = gemv_warps();
  *splits = gemv_splits(glu ? N / 2 / 8 : (N + 15) / 16, K, T <= 8 ? 1 : 2, *warps, false);
  return 0;
}

template <bool GLU, bool NORM, typename TO>
static bool launch_gemv_mma(const pl_half* x, const float* rs, int64_t T, int64_t K, const void* w, int wdt,
                            const float* scale, int64_t N, OutParts op, TO* out, const Prenorm& pn, uint64_t stream) {
  if (wdt != PL_E4M3 || K % 16 != 0 || ((uintptr_t)x & 15) != 0 || ((uintptr_t)w & 15) != 0) return false;
  if (GLU && (N / 2) % 8 != 0) return false;
  int64_t tiles = GLU ? N / 2 / 8 : (N + 15) / 16;
  int nt = T <= 8 ? 1 : 2, warps = gemv_warps(), ks = gemv_splits(tiles, K, nt, warps, NORM);
  SplitK sk;
  if (ks > 1) {
    sk.ws = g_gemv_scratch.ws;
    sk.counters = g_gemv_scratch.counters;
  }
  dim3 grid((unsigned)tiles, (unsigned)ks), block(32 * warps);
  const uint8_t* w8 = (const uint8_t*)w;
  if (nt == 1)
    PL_LAUNCH((gemv_mma_kernel<1, TO, GLU, NORM>), grid, block, 0, stream, x, rs, (int)T, (int)K, w8, scale, (int)N,
              op, out, pn, sk);
  else
    PL_LAUNCH((gemv_mma_kernel<2, TO, GLU, NORM>), grid, block, 0, stream, x, rs, (int)T, (int)K, w8, scale, (int)N,
              op, out, pn, sk);
  return true;
}

// Up to this many output rows a dense GEMV gives each row a whole block (GEMV_WARPS warps splitting K).
static const int64_t GEMV_SPLIT_ROWS = 1024;

template <typename TA, typename TO, int WDT, bool VEC, bool GLU, bool NORM>
static void launch_dense(bool split, dim3 grid, uint64_t stream, const TA* x, const float* rs, int t, int k,
                         const void* w, int n, OutParts op, TO* out, const Prenorm& pn) {
  dim3 block(32 * GEMV_WARPS);
  if (split)
    PL_LAUNCH((gemv_dense_kernel<TA, TO, WDT, VEC, false, GEMV_WARPS, NORM>), grid, block, 0, stream, x, rs, t, k, w,
              n, op, out, pn);
  else
    PL_LAUNCH((gemv_dense_kernel<TA, TO, WDT, VEC, GLU, 1, NORM>), grid, block, 0, stream, x, rs, t, k, w, n, op, out,
              pn);
}

// T <= GEMV_MAX_T: the tensor-core GEMV where it applies, else a warp (or, for a few dense rows, a block) per row.
// NORM: the input is pn's normed residual stream (x is 0).
template <bool GLU, typename TA, typename TO, bool NORM = false>
static void launch_gemv(const TA* x, const float* rs, int64_t T, int64_t K, const void* w, int wdt,
                        const float* scale, int64_t N, OutParts op, TO* out, uint64_t stream,
                        const Prenorm& pn = Prenorm()) {
  if (launch_gemv_mma<GLU, NORM>(x, rs, T, K, w, wdt, scale, N, op, out, pn, stream)) return;
  int64_t rows = GLU ? N / 2 : N;
  bool split = !GLU && wdt != PL_E4M3 && rows <= GEMV_SPLIT_ROWS;
  dim3 grid((unsigned)(split ? rows : (rows + GEMV_WARPS - 1) / GEMV_WARPS)), block(32 * GEMV_WARPS);
  bool vec = ((uintptr_t)w & 15) == 0 && ((uintptr_t)x & 15) == 0;
  const uint8_t* w8 = (const uint8_t*)w;
  int t = (int)T, k = (int)K, n = (int)N;
  if (wdt == PL_E4M3 && vec && K % 16 == 0)
    PL_LAUNCH((gemv_fp8_kernel<TA, TO, true, GLU, NORM>), grid, block, 0, stream, x, rs, t, k, w8, scale, n, op, out,
              pn);
  else if (wdt == PL_E4M3)
    PL_LAUNCH((gemv_fp8_kernel<TA, TO, false, GLU, NORM>), grid, block, 0, stream, x, rs, t, k, w8, scale, n, op, out,
              pn);
  else if (vec && K % 8 == 0 && wdt == PL_BF16)
    launch_dense<TA, TO, PL_BF16, true, GLU, NORM>(split, grid, stream, x, rs, t, k, w, n, op, out, pn);
  else if (vec && K % 8 == 0 && wdt == PL_F16)
    launch_dense<TA, TO, PL_F16, true, GLU, NORM>(split, grid, stream, x, rs, t, k, w, n, op, out, pn);
  else if (vec && K % 8 == 0)
    launch_dense<TA, TO, PL_F32, true, GLU, NORM>(split, grid, stream, x, rs, t, k, w, n, op, out, pn);
  else if (wdt == PL_BF16)
    launch_dense<TA, TO, PL_BF16, false, GLU, NORM>(split, grid, stream, x, rs, t, k, w, n, op, out, pn);
  else if (wdt == PL_F16)
    launch_dense<TA, TO, PL_F16, false, GLU, NORM>(split, grid, stream, x, rs, t, k, w, n, op, out, pn);
  else
    launch_dense<TA, TO, PL_F32, false, GLU, NORM>(split, grid, stream, x, rs, t, k, w, n, op, out, pn);
}

// The GEMV of x, or (pn not 0) of pn's normed input.
template <bool GLU, typename TA, typename TO>
static void launch_gemv_of(const TA* x, const Prenorm* pn, const float* rs, int64_t T, int64_t K, const void* w,
                           int wdt, const float* scale, int64_t N, OutParts op, TO* out, uint64_t stream) {
  if (pn)
    launch_gemv<GLU, TA, TO, true>((const TA*)0, rs, T, K, w, wdt, scale, N, op, out, stream, *pn);
  else
    launch_gemv<GLU, TA, TO>(x, rs, T, K, w, wdt, scale, N, op, out, stream);
}

template <typename TA, typename TO>
static void launch_linear(const TA* x, const Prenorm* pn, const float* rs, int64_t T, int64_t K, const void* w,
                          int wdt, const float* scale, int64_t N, OutParts op, TO* out, uint64_t stream) {
  if (T <= GEMV_MAX_T) {
    launch_gemv_of<false>(x, pn, rs, T, K, w, wdt, scale, N, op, out, stream);
    return;
  }
  dim3 grid((unsigned)((N + TN - 1) / TN), (unsigned)((T + TM - 1) / TM));
  if (!launch_mma(x, rs, T, K, w, wdt, scale, N, op, out, grid, stream))
    PL_LAUNCH((gemm_tiled_kernel<TA, TO>), grid, dim3(256), 0, stream, x, rs, (int)T, (int)K, w, wdt,
              wdt == PL_E4M3 ? scale : (const float*)0, (int)N, op, out);
}

// pl_linear and pl_linear_parts: the same kernels; ends = (N, N, N) is the plain (T, N) output. pn: the normed
// input of pl_norm_linear_* (the GEMV sizes only), or 0.
static int linear(uint64_t x, int32_t act_dtype, uint64_t x_row_scale, int64_t T, int64_t K, uint64_t w,
                  int32_t w_dtype, uint64_t scale, int64_t N, const int64_t ends[3], uint64_t out, int32_t out_dtype,
                  uint64_t stream, const float* A_log = 0, const float* dt_bias = 0, const Prenorm* pn = 0) {
  PL_REQUIRE(w_dtype >= PL_F32 && w_dtype <= PL_E4M3, "weight dtype must be 0..3 (fp32, fp16, bf16, e4m3)");
  PL_REQUIRE(w_dtype != PL_E4M3 || scale != 0, "an e4m3 weight needs its fp32 block scales");
  PL_REQUIRE(out_dtype == act_dtype || out_dtype == PL_F32,
             "output dtype %d: must be the activation dtype (%d) or 0 (fp32)", (int)out_dtype, (int)act_dtype);
  PL_REQUIRE(K > 0 && K < (1ll << 31) && N < (1ll << 31) && T < 65535ll * TM, "linear shape out of range");
  PL_REQUIRE(0 <= ends[0] && ends[0] <= ends[1] && ends[1] <= ends[2] && ends[2] <= N,
             "part ends %lld %lld %lld: must rise within 0..N = %lld", (long long)ends[0], (long long)ends[1],
             (long long)ends[2], (long long)N);
  if (T == 0 || N == 0) return 0;
  const float* rs = (const float*)x_row_scale;
  OutParts op{T, (int)ends[0], (int)ends[1], (int)ends[2], (int)N, A_log, dt_bias};
  PL_DISPATCH_ACT(act_dtype, TA,
    if (out_dtype == PL_F32)
      launch_linear<TA, float>((const TA*)x, pn, rs, T, K, (const void*)w, (int)w_dtype, (const float*)scale, N, op,
                               (float*)out, stream);
    else
      launch_linear<TA, TA>((const TA*)x, pn, rs, T, K, (const void*)w, (int)w_dtype, (const float*)scale, N, op,
                            (TA*)out, stream));
  PL_CHECK_LAUNCH();
  return 0;
}

extern "C" int pl_linear(uint64_t x, int32_t act_dtype, uint64_t x_row_scale, int64_t T, int64_t K, uint64_t w,
                         int32_t w_dtype, uint64_t scale, int64_t N, uint64_t out, int32_t out_dtype,
                         uint64_t stream) {
  const int64_t ends[3] = {N, N, N};
  return linear(x, act_dtype, x_row_scale, T, K, w, w_dtype, scale, N, ends, out, out_dtype, stream);
}

extern "C" int pl_linear_parts(uint64_t x, int32_t act_dtype, uint64_t x_row_scale, int64_t T, int64_t K,
                               uint64_t w, int32_t w_dtype, uint64_t scale, int64_t N, int64_t end0, int64_t end1,
                               int64_t end2, uint64_t out, int32_t out_dtype, uint64_t stream) {
  const int64_t ends[3] = {end0, end1, end2};
  return linear(x, act_dtype, x_row_scale, T, K, w, w_dtype, scale, N, ends, out, out_dtype, stream);
}

static int linear_glu(uint64_t x, const Prenorm* pn, int32_t act_dtype, int64_t T, int64_t K, uint64_t w,
                      int32_t w_dtype, uint64_t scale, int64_t N, uint64_t out, uint64_t stream) {
  PL_REQUIRE(w_dtype >= PL_F32 && w_dtype <= PL_E4M3, "weight dtype must be 0..3 (fp32, fp16, bf16, e4m3)");
  PL_REQUIRE(w_dtype != PL_E4M3 || scale != 0, "an e4m3 weight needs its fp32 block scales");
  PL_REQUIRE(K > 0 && K < (1ll << 31) && N > 0 && N < (1ll << 31) && N % 2 == 0,
             "GLU weight of %lld rows: must be [gate | up], an even number", (long long)N);
  PL_REQUIRE(w_dtype != PL_E4M3 || (N / 2) % 128 == 0,
             "GLU FP8 weight: gate's %lld rows must be whole 128-row scale blocks", (long long)(N / 2));
  PL_REQUIRE(T >= 0 && T <= GEMV_MAX_T, "pl_linear_glu takes at most %d tokens (got %lld): use pl_linear_parts "
             "and pl_silu_mul", GEMV_MAX_T, (long long)T);
  if (T == 0) return 0;
  OutParts op{T, (int)(N / 2), (int)(N / 2), (int)(N / 2), (int)(N / 2)};
  PL_DISPATCH_ACT(act_dtype, TA,
    launch_gemv_of<true, TA, float>((const TA*)x, pn, 0, T, K, (const void*)w, (int)w_dtype, (const float*)scale, N,
                                    op, (float*)out, stream));
  PL_CHECK_LAUNCH();
  return 0;
}

extern "C" int pl_linear_glu(uint64_t x, int32_t act_dtype, int64_t T, int64_t K, uint64_t w, int32_t w_dtype,
                             uint64_t scale, int64_t N, uint64_t out, uint64_t stream) {
  return linear_glu(x, 0, act_dtype, T, K, w, w_dtype, scale, N, out, stream);
}

extern "C" int pl_linear_gdn_gates(uint64_t x, int32_t act_dtype, int64_t T, int64_t K, uint64_t w, int32_t w_dtype,
                                   uint64_t scale, int32_t Hv, uint64_t A_log, uint64_t dt_bias, uint64_t out,
                                   uint64_t stream) {
  PL_REQUIRE(Hv > 0 && A_log != 0 && dt_bias != 0, "GDN gates need Hv > 0, A_log and dt_bias");
  const int64_t ends[3] = {Hv, 2 * (int64_t)Hv, 2 * (int64_t)Hv};
  return linear(x, act_dtype, 0, T, K, w, w_dtype, scale, 2 * (int64_t)Hv, ends, out, PL_F32, stream,
                (const float*)A_log, (const float*)dt_bias);
}

// ---- The same three with the decoder layer's residual add + RMSNorm as the GEMV's prologue (Prenorm). --------

static int prenorm_of(Prenorm& pn, uint64_t x, uint64_t residual, uint64_t residual_out, uint64_t norm_w,
                      int32_t norm_w_dtype, float eps, int64_t T) {
  PL_REQUIRE(x != 0 && residual != 0 && norm_w != 0, "the normed input needs x, residual and the norm's weight");
  PL_REQUIRE(norm_w_dtype >= PL_F32 && norm_w_dtype <= PL_BF16, "norm weight dtype must be fp32, fp16 or bf16");
  PL_REQUIRE(T >= 0 && T <= GEMV_MAX_T, "a normed input takes at most %d tokens (got %lld): use pl_add_rmsnorm "
             "first", GEMV_MAX_T, (long long)T);
  pn.x = (const float*)x;
  pn.res = (const float*)residual;
  pn.res_out = (float*)residual_out;
  pn.w = (const void*)norm_w;
  pn.wdt = norm_w_dtype;
  pn.eps = eps;
  return 0;
}

extern "C" int pl_norm_linear_parts(uint64_t x, uint64_t residual, uint64_t residual_out, uint64_t norm_w,
                                    int32_t norm_w_dtype, float eps, int32_t act_dtype, int64_t T, int64_t K,
                                    uint64_t w, int32_t w_dtype, uint64_t scale, int64_t N, int64_t end0,
                                    int64_t end1, int64_t end2, uint64_t out, int32_t out_dtype, uint64_t stream) {
  Prenorm pn;
  if (prenorm_of(pn, x, residual, residual_out, norm_w, norm_w_dtype, eps, T)) return -1;
  const int64_t ends[3] = {end0, end1, end2};
  return linear(0, act_dtype, 0, T, K, w, w_dtype, scale, N, ends, out, out_dtype, stream, 0, 0, &pn);
}

extern "C" int pl_norm_linear_glu(uint64_t x, uint64_t residual, uint64_t residual_out, uint64_t norm_w,
                                  int32_t norm_w_dtype, float eps, int32_t act_dtype, int64_t T, int64_t K, uint64_t w,
                                  int32_t w_dtype, uint64_t scale, int64_t N, uint64_t out, uint64_t stream) {
  Prenorm pn;
  if (prenorm_of(pn, x, residual, residual_out, norm_w, norm_w_dtype, eps, T)) return -1;
  return linear_glu(0, &pn, act_dtype, T, K, w, w_dtype, scale, N, out, stream);
}

// ---- The decode MLP in one launch (pl_mlp): out = down(silu(h gate^T) * (h up^T)), FP8 weights. -------------
// Block b owns the intermediate rows [128 b, 128 b + 128), one 128-wide scale block of down's K: it computes
// their silu(gate) * up for every token into shared memory (warp per row, as gemv_fp8_body), then its partial
// down product, (T, D) fp32 summed over its 128 rows only, into workspace row b. The partials meet without a grid
// barrier (blocks need not all be resident): D is cut into 128-row chunks, each with a counter; a block bumps a
// chunk's counter after writing that chunk of its partial, and the block that arrives last sums the chunk's
// partials in block order (deterministic: the same sum whoever arrives last) into out, then zeroes the counter
// for the next launch. Blocks walk the chunks starting at different ones, so the sums are spread over blocks.
static const int MLP_ROWS = 128;
static const int MLP_WARPS = 8;      // few blocks (ceil(I / 128): 34 at the 27B's TP4), so more loads in flight each

template <typename TA, bool VEC, bool NORM>
__global__ void mlp_kernel(const TA* x, int T, int K, const uint8_t* gu, const float* gu_scale, int I,
                           const uint8_t* down, const float* down_scale, int D, float* out, float* ws,
                           unsigned* counters, Prenorm pn) {
  __shared__ float inv[GEMV_MAX_T];
  __shared__ float h[GEMV_MAX_T][MLP_ROWS];           // silu(gate) * up of this block's rows
  __shared__ int last;
  prenorm_prologue<NORM>(pn, T, K, inv);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, b = blockIdx.x;
  const int i0 = b * MLP_ROWS, rows = min(MLP_ROWS, I - i0), kb = (K + 127) >> 7;
  for (int r = warp; r < rows; r += MLP_WARPS) {     // whole warps take the same rows
    const int64_t ng = i0 + r, nu = ng + I;
    const uint8_t* wrow[2] = {gu + ng * K, gu + nu * K};
    const float* srow[2] = {gu_scale + (ng >> 7) * kb, gu_scale + (nu >> 7) * kb};
    float acc[2][GEMV_MAX_T];
    for (int j = 0; j < 2; j++)
      for (int t = 0; t < GEMV_MAX_T; t++) acc[j][t] = 0.f;
    if (VEC) {
      for (int k0 = lane * 16; k0 < K; k0 += 32 * 16) {
        float wv[2][16], xv[16];
        for (int j = 0; j < 2; j++) dequant16(wrow[j] + k0, wv[j]);
#pragma unroll
        for (int t = 0; t < GEMV_MAX_T; t++) {
          if (t >= T) break;
          for (int i = 0; i < 16; i++) xv[i] = xin<TA, NORM>(x, pn, inv, t, k0 + i, K);
          for (int j = 0; j < 2; j++) {
            float dot = 0.f;
            for (int i = 0; i < 16; i++) dot += wv[j][i] * xv[i];
            acc[j][t] += srow[j][k0 >> 7] * dot;
          }
        }
      }
    } else {
      for (int k = lane; k < K; k += 32)
        for (int j = 0; j < 2; j++) {
          float wk = e4m3_to_f(wrow[j][k]) * srow[j][k >> 7];
#pragma unroll
          for (int t = 0; t < GEMV_MAX_T; t++)
            if (t < T) acc[j][t] += wk * xin<TA, NORM>(x, pn, inv, t, k, K);
        }
    }
    for (int t = 0; t < T; t++) {
      float g = warp_sum(acc[0][t]), u = warp_sum(acc[1][t]);
      if (lane == 0) h[t][r] = silu_f(g) * u;
    }
  }
  __syncthreads();
  const int chunks = (D + MLP_ROWS - 1) / MLP_ROWS, ib = (I + 127) >> 7;
  const int64_t plane = (int64_t)T * D;                // one block's partial (T, D)
  float* part = ws + b * plane;
  for (int c0 = 0; c0 < chunks; c0++) {
    const int c = (c0 + b) % chunks, n1 = min(D, (c + 1) * MLP_ROWS);
    for (int n = c * MLP_ROWS + warp; n < n1; n += MLP_WARPS) {   // warp per output row n of down
      const uint8_t* wrow = down + (int64_t)n * I + i0;
      float s = down_scale[(int64_t)(n >> 7) * ib + b];
      float acc[GEMV_MAX_T];
      for (int t = 0; t < GEMV_MAX_T; t++) acc[t] = 0.f;
      for (int i = lane; i < rows; i += 32) {
        float wv = e4m3_to_f(wrow[i]);
#pragma unroll
        for (int t = 0; t < GEMV_MAX_T; t++)
          if (t < T) acc[t] += wv * h[t][i];
      }
      for (int t = 0; t < T; t++) {
        float v = warp_sum(acc[t]);
        if (lane == 0) part[(int64_t)t * D + n] = s * v;
      }
    }
    __threadfence();                                   // this chunk of the partial is visible before the count
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&counters[c], 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) continue;
    __threadfence();
    const volatile float* all = ws;                    // other blocks' partials: past the (incoherent) L1
    const int w = n1 - c * MLP_ROWS;
    for (int j = threadIdx.x; j < T * w; j += blockDim.x) {
      int64_t o = (int64_t)(j / w) * D + c * MLP_ROWS + j % w;
      float sum = 0.f;
      for (unsigned q = 0; q < gridDim.x; q++) sum += all[q * plane + o];
      out[o] = sum;
    }
    if (threadIdx.x == 0) counters[c] = 0;             // ready for the next launch
  }
}

extern "C" int pl_mlp(uint64_t x, uint64_t residual, uint64_t residual_out, uint64_t norm_w, int32_t norm_w_dtype,
                      float eps, int32_t act_dtype, int64_t T, int64_t K, uint64_t gate_up, uint64_t gate_up_scale,
                      int64_t I, uint64_t down, uint64_t down_scale, int64_t D, uint64_t out, uint64_t workspace,
                      uint64_t counters, uint64_t stream) {
  Prenorm pn;
  bool norm = residual != 0;
  if (norm && prenorm_of(pn, x, residual, residual_out, norm_w, norm_w_dtype, eps, T)) return -1;
  PL_REQUIRE(x != 0 && out != 0 && workspace != 0 && counters != 0, "pl_mlp needs x, out, workspace, counters");
  PL_REQUIRE(gate_up_scale != 0 && down_scale != 0, "pl_mlp takes e4m3 weights with their fp32 block scales");
  PL_REQUIRE(T >= 0 && T <= GEMV_MAX_T, "pl_mlp takes at most %d tokens (got %lld)", GEMV_MAX_T, (long long)T);
  PL_REQUIRE(K > 0 && K < (1 << 30) && I > 0 && I < (1 << 30) && D > 0 && D < (1 << 30),
             "pl_mlp shape out of range: K %lld, I %lld, D %lld", (long long)K, (long long)I, (long long)D);
  PL_REQUIRE((D + MLP_ROWS - 1) / MLP_ROWS <= 4096, "pl_mlp: D %lld needs more than 4096 counters", (long long)D);
  if (T == 0) return 0;
  bool vec = K % 16 == 0 && gate_up % 16 == 0;
  unsigned blocks = (unsigned)((I + MLP_ROWS - 1) / MLP_ROWS);
#define PL_MLP_LAUNCH(TA, V, N)                                                                               \
  PL_LAUNCH((mlp_kernel<TA, V, N>), dim3(blocks), dim3(MLP_WARPS * 32), 0, stream, (const TA*)x, (int)T,     \
            (int)K, (const uint8_t*)gate_up, (const float*)gate_up_scale, (int)I, (const uint8_t*)down,       \
            (const float*)down_scale, (int)D, (float*)out, (float*)workspace, (unsigned*)counters, pn)
  PL_DISPATCH_ACT(act_dtype, TA,
    if (norm) { if (vec) PL_MLP_LAUNCH(TA, true, true); else PL_MLP_LAUNCH(TA, false, true); }
    else      { if (vec) PL_MLP_LAUNCH(TA, true, false); else PL_MLP_LAUNCH(TA, false, false); });
#undef PL_MLP_LAUNCH
  PL_CHECK_LAUNCH();
  return 0;
}

extern "C" int pl_norm_linear_gdn_gates(uint64_t x, uint64_t residual, uint64_t residual_out, uint64_t norm_w,
                                        int32_t norm_w_dtype, float eps, int32_t act_dtype, int64_t T, int64_t K,
                                        uint64_t w, int32_t w_dtype, uint64_t scale, int32_t Hv, uint64_t A_log,
                                        uint64_t dt_bias, uint64_t out, uint64_t stream) {
  Prenorm pn;
  if (prenorm_of(pn, x, residual, residual_out, norm_w, norm_w_dtype, eps, T)) return -1;
  PL_REQUIRE(Hv > 0 && A_log != 0 && dt_bias != 0, "GDN gates need Hv > 0, A_log and dt_bias");
  const int64_t ends[3] = {Hv, 2 * (int64_t)Hv, 2 * (int64_t)Hv};
  return linear(0, act_dtype, 0, T, K, w, w_dtype, scale, 2 * (int64_t)Hv, ends, out, PL_F32, stream,
                (const float*)A_log, (const float*)dt_bias, &pn);
}

// ---- GDN's in_proj qkv|z with the causal conv1d of the decode step in its epilogue (OutParts::conv), and
// optionally (pl_gdn_in_proj_gates) the dense a|b projection with the gates in its epilogue in the same launch:
// blocks [0, main_blocks) run the FP8 q|k|v|z GEMV, the blocks after them the a|b GEMV, one row per block with
// all the block's warps splitting K (gemv_dense_body with WPR = WARPS). NT: the tensor-core GEMV's token tiles
// (fp16 activations), 0 for the warp-per-row FP8 GEMV (fp32 activations). ----------------------------------------

template <typename TA, int WDT, int NT, int WARPS, bool NORM>
__global__ void gdn_in_proj_gates_kernel(const TA* x, int T, int K, const uint8_t* w, const float* scale, int N,
                                         OutParts op, TA* out, int main_blocks, const void* ab_w, OutParts op_ab,
                                         float* gates, Prenorm pn) {
  if ((int)blockIdx.x >= main_blocks)
    gemv_dense_body<TA, float, WDT, true, false, WARPS, NORM, WARPS>((int)blockIdx.x - main_blocks, x, 0, T, K, ab_w,
                                                                     op_ab.N, op_ab, gates, pn);
  else if constexpr (NT == 0)
    gemv_fp8_body<TA, TA, true, false, NORM>((int)blockIdx.x, x, 0, T, K, w, scale, N, op, out, pn);
  else
    gemv_mma_body<NT, TA, false, NORM>((int)blockIdx.x, x, 0, T, K, w, scale, N, op, out, pn);
}

// The a|b projection's part of pl_gdn_in_proj_gates: its dense weight and the gates' operands.
struct AbGates {
  const void* w;              // (2 Hv, K) of wdt
  int wdt, Hv;
  const float* A_log;         // (Hv,)
  const float* dt_bias;       // (Hv,)
  float* gates;               // (2, T, Hv) fp32: g, then beta
};

// The one-launch form when it applies (e4m3 q|k|v|z weight, a|b weight in the activation dtype, K % 16 == 0,
// 16-byte aligned operands); false otherwise (the caller launches the two GEMVs).
template <typename TA, bool NORM>
static bool launch_gdn_in_proj_gates(const TA* x, int64_t T, int64_t K, const void* w, int wdt, const float* scale,
                                     int64_t N, const OutParts& op, TA* out, const AbGates& ab, const Prenorm& pn,
                                     uint64_t stream) {
  constexpr int act = sizeof(TA) == 4 ? PL_F32 : PL_F16;
  if (wdt != PL_E4M3 || ab.wdt != act || K % 16 != 0 || ((uintptr_t)x & 15) || ((uintptr_t)w & 15) ||
      ((uintptr_t)ab.w & 15))
    return false;
  OutParts op_ab{T, ab.Hv, 2 * ab.Hv, 2 * ab.Hv, 2 * ab.Hv, ab.A_log, ab.dt_bias};
  const uint8_t* w8 = (const uint8_t*)w;
  int t = (int)T, k = (int)K, n = (int)N;
  if constexpr (act == PL_F32) {
    int main_blocks = (int)((N + GEMV_WARPS - 1) / GEMV_WARPS);
    PL_LAUNCH((gdn_in_proj_gates_kernel<TA, act, 0, GEMV_WARPS, NORM>), dim3((unsigned)(main_blocks + 2 * ab.Hv)),
              dim3(32 * GEMV_WARPS), 0, stream, x, t, k, w8, scale, n, op, out, main_blocks, ab.w, op_ab, ab.gates, pn);
  } else {
    int main_blocks = (int)((N + 15) / 16);
    dim3 grid((unsigned)(main_blocks + 2 * ab.Hv)), block(32 * GEMV_MMA_WARPS);
    if (T <= 8)
      PL_LAUNCH((gdn_in_proj_gates_kernel<TA, act, 1, GEMV_MMA_WARPS, NORM>), grid, block, 0, stream, x, t, k, w8,
                scale, n, op, out, main_blocks, ab.w, op_ab, ab.gates, pn);
    else
      PL_LAUNCH((gdn_in_proj_gates_kernel<TA, act, 2, GEMV_MMA_WARPS, NORM>), grid, block, 0, stream, x, t, k, w8,
                scale, n, op, out, main_blocks, ab.w, op_ab, ab.gates, pn);
  }
  return true;
}

static int gdn_in_proj(uint64_t x, uint64_t residual, uint64_t residual_out, uint64_t norm_w, int32_t norm_w_dtype,
                       float eps, int32_t act_dtype, int64_t T, int64_t K, uint64_t w, int32_t w_dtype,
                       uint64_t scale, int64_t C, int64_t N, uint64_t out, uint64_t conv_w, int32_t conv_w_dtype,
                       int32_t W, uint64_t conv_state, int32_t state_dtype, uint64_t slot_ids, const AbGates* ab,
                       uint64_t stream) {
  PL_REQUIRE(T >= 0 && T <= GEMV_MAX_T, "pl_gdn_in_proj takes at most %d tokens (got %lld): use pl_linear_parts "
             "and pl_conv1d", GEMV_MAX_T, (long long)T);
  PL_REQUIRE(0 < C && C <= N, "qkv channels %lld: must be in 1..N = %lld", (long long)C, (long long)N);
  PL_REQUIRE(W >= 2 && W <= 8, "conv kernel width must be in 2..8");
  PL_REQUIRE(conv_w_dtype >= PL_F32 && conv_w_dtype <= PL_BF16, "conv weight dtype must be fp32, fp16 or bf16");
  PL_REQUIRE(state_dtype >= PL_F32 && state_dtype <= PL_BF16, "conv state dtype must be fp32, fp16 or bf16");
  PL_REQUIRE(conv_w != 0 && conv_state != 0 && slot_ids != 0, "the conv needs its weight, state and slots");
  if (ab) {
    PL_REQUIRE(ab->w != 0 && ab->wdt >= PL_F32 && ab->wdt <= PL_E4M3, "the a|b weight: a dtype of 0..3 is needed");
    PL_REQUIRE(ab->wdt != PL_E4M3, "the a|b weight must be dense (fp32, fp16 or bf16)");
    PL_REQUIRE(ab->Hv > 0 && ab->A_log != 0 && ab->dt_bias != 0 && ab->gates != 0,
               "GDN gates need Hv > 0, A_log, dt_bias and their output");
  }
  Prenorm pn;
  if (residual && prenorm_of(pn, x, residual, residual_out, norm_w, norm_w_dtype, eps, T)) return -1;
  if (T == 0) return 0;
  PL_REQUIRE(w_dtype >= PL_F32 && w_dtype <= PL_E4M3, "weight dtype must be 0..3 (fp32, fp16, bf16, e4m3)");
  PL_REQUIRE(w_dtype != PL_E4M3 || scale != 0, "an e4m3 weight needs its fp32 block scales");
  PL_REQUIRE(K > 0 && K < (1ll << 31) && N < (1ll << 31), "linear shape out of range");
  OutParts op{T, (int)C, (int)N, (int)N, (int)N};
  op.conv_w = (const void*)conv_w;
  op.conv_wdt = conv_w_dtype;
  op.W = W;
  op.conv_state = (void*)conv_state;
  op.conv_sdt = state_dtype;
  op.slots = (const int32_t*)slot_ids;
  bool fused = false;
  PL_DISPATCH_ACT(act_dtype, TA, {
    const TA* xp = residual ? (const TA*)0 : (const TA*)x;
    if (ab && residual)
      fused = launch_gdn_in_proj_gates<TA, true>(xp, T, K, (const void*)w, (int)w_dtype, (const float*)scale, N, op,
                                                 (TA*)out, *ab, pn, stream);
    else if (ab)
      fused = launch_gdn_in_proj_gates<TA, false>(xp, T, K, (const void*)w, (int)w_dtype, (const float*)scale, N, op,
                                                  (TA*)out, *ab, pn, stream);
    if (!fused)
      launch_gemv_of<false, TA, TA>(xp, residual ? &pn : 0, 0, T, K, (const void*)w, (int)w_dtype,
                                    (const float*)scale, N, op, (TA*)out, stream);
  });
  PL_CHECK_LAUNCH();
  if (ab && !fused) {        // the a|b GEMV after it; the q|k|v|z one has written residual_out already
    const int64_t ends[3] = {ab->Hv, 2 * (int64_t)ab->Hv, 2 * (int64_t)ab->Hv};
    pn.res_out = 0;
    return linear(residual ? 0 : x, act_dtype, 0, T, K, (uint64_t)(uintptr_t)ab->w, ab->wdt, 0, 2 * (int64_t)ab->Hv,
                  ends, (uint64_t)(uintptr_t)ab->gates, PL_F32, stream, ab->A_log, ab->dt_bias, residual ? &pn : 0);
  }
  return 0;
}

extern "C" int pl_gdn_in_proj(uint64_t x, uint64_t residual, uint64_t residual_out, uint64_t norm_w,
                              int32_t norm_w_dtype, float eps, int32_t act_dtype, int64_t T, int64_t K, uint64_t w,
                              int32_t w_dtype, uint64_t scale, int64_t C, int64_t N, uint64_t out, uint64_t conv_w,
                              int32_t conv_w_dtype, int32_t W, uint64_t conv_state, int32_t state_dtype,
                              uint64_t slot_ids, uint64_t stream) {
  return gdn_in_proj(x, residual, residual_out, norm_w, norm_w_dtype, eps, act_dtype, T, K, w, w_dtype, scale, C, N,
                     out, conv_w, conv_w_dtype, W, conv_state, state_dtype, slot_ids, 0, stream);
}

extern "C" int pl_gdn_in_proj_gates(uint64_t x, uint64_t residual, uint64_t residual_out, uint64_t norm_w,
                                    int32_t norm_w_dtype, float eps, int32_t act_dtype, int64_t T, int64_t K,
                                    uint64_t w, int32_t w_dtype, uint64_t scale, int64_t C, int64_t N, uint64_t out,
                                    uint64_t conv_w, int32_t conv_w_dtype, int32_t W, uint64_t conv_state,
                                    int32_t state_dtype, uint64_t slot_ids, uint64_t ab_w, int32_t ab_w_dtype,
                                    int32_t Hv, uint64_t A_log, uint64_t dt_bias, uint64_t gates, uint64_t stream) {
  AbGates ab{(const void*)ab_w, ab_w_dtype, Hv, (const float*)A_log, (const float*)dt_bias, (float*)gates};
  return gdn_in_proj(x, residual, residual_out, norm_w, norm_w_dtype, eps, act_dtype, T, K, w, w_dtype, scale, C, N,
                     out, conv_w, conv_w_dtype, W, conv_state, state_dtype, slot_ids, &ab, stream);
}
