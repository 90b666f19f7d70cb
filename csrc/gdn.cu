// Gated DeltaNet: the causal depthwise conv1d with per-slot conv state, and the gated delta rule with
// per-slot recurrent state. Both serve prefill and decode alike (decode is the one-row case). The delta rule
// here is the sequential per-token form, not the chunked (WY) form: exact, and for decode it is the whole story;
// long prefills are slower than a chunked kernel would be.
#include "ops_common.cuh"

// ---- conv1d. The outputs: one thread per (channel, chunk of CONV_ROWS rows of the flattened batch); it walks
// its rows keeping the W-1 previous inputs of the row's sequence in registers, taking them from x, or from the
// slot's state before the sequence's first row. Then the state update: one thread per (channel, sequence)
// gathers the last W-1 inputs (state + rows) and writes them back, a second kernel, which keeps every old state
// read ahead of its overwrite. When the whole batch is one chunk (T <= CONV_ROWS: decode and small mixed steps)
// one thread walks every sequence of its channel, so it writes each sequence's state itself once it has read
// it (STATE): one launch. ---------------------------------------------------------------------------------------

static const int CONV_MAX_W = 8;
static const int CONV_ROWS = 64;

// Input at position rel (relative to the sequence's first row; negative = from the state) of channel c.
template <typename TA>
__device__ __forceinline__ float conv_input(const TA* x, const void* conv_state, int sdt, int64_t st, int64_t row0,
                                            int64_t rel, int C, int c, int W) {
  return rel >= 0 ? to_f(x[(row0 + rel) * C + c]) : load_any(conv_state, sdt, st + (W - 1) + rel);
}

template <typename TA, bool STATE>
__global__ void conv1d_kernel(const TA* __restrict__ x, const void* __restrict__ w, int wdt,
                              void* __restrict__ conv_state, int sdt, const int32_t* slot_ids,
                              const int32_t* query_start, int B, int64_t T, int C, int W, TA* __restrict__ out) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  int64_t r0 = (int64_t)blockIdx.y * CONV_ROWS, r1 = r0 + CONV_ROWS < T ? r0 + CONV_ROWS : T;
  float wc[CONV_MAX_W], win[CONV_MAX_W];              // win[0 .. W-2] = previous inputs, oldest first
#pragma unroll
  for (int j = 0; j < CONV_MAX_W; j++) wc[j] = j < W ? load_any(w, wdt, (int64_t)c * W + j) : 0.f;
  int b = find_seq(query_start, B, r0);
  for (int64_t t = r0; t < r1;) {
    while (query_start[b + 1] <= t) b++;               // the sequence of row t (skipping empty ones)
    int64_t row0 = query_start[b], seg_end = query_start[b + 1] < r1 ? query_start[b + 1] : r1;
    int64_t st = ((int64_t)slot_ids[b] * C + c) * (W - 1);
#pragma unroll
    for (int j = 0; j < CONV_MAX_W - 1; j++)
      if (j < W - 1) win[j] = conv_input(x, conv_state, sdt, st, row0, t - row0 - (W - 1) + j, C, c, W);
    for (; t < seg_end; t++) {
      float xt = to_f(x[t * C + c]);
      float y = wc[W - 1] * xt;
#pragma unroll
      for (int j = 0; j < CONV_MAX_W - 1; j++)
        if (j < W - 1) y += wc[j] * win[j];
      out[t * C + c] = from_f<TA>(silu_f(y));
#pragma unroll
      for (int j = 0; j < CONV_MAX_W - 1; j++)
        if (j < W - 1) win[j] = j + 1 < W - 1 ? win[j + 1] : xt;
    }
    if (STATE)                                         // win = the sequence's last W-1 inputs
#pragma unroll
      for (int j = 0; j < CONV_MAX_W - 1; j++)
        if (j < W - 1) store_any(conv_state, sdt, st + j, win[j]);
  }
}

template <typename TA>
__global__ void conv_state_kernel(const TA* __restrict__ x, void* __restrict__ conv_state, int sdt,
                                  const int32_t* slot_ids, const int32_t* query_start, int C, int W) {
  int c = blockIdx.x * blockDim.x + threadIdx.x, b = blockIdx.y;
  if (c >= C) return;
  int64_t row0 = query_start[b], n = query_start[b + 1] - row0;
  int64_t st = ((int64_t)slot_ids[b] * C + c) * (W - 1);
  float win[CONV_MAX_W];
#pragma unroll
  for (int j = 0; j < CONV_MAX_W - 1; j++)             // all old state reads before any write
    if (j < W - 1) win[j] = conv_input(x, conv_state, sdt, st, row0, n - (W - 1) + j, C, c, W);
#pragma unroll
  for (int j = 0; j < CONV_MAX_W - 1; j++)
    if (j < W - 1) store_any(conv_state, sdt, st + j, win[j]);
}

extern "C" int pl_conv1d(uint64_t x, int32_t act_dtype, int64_t T, int32_t C, uint64_t w, int32_t w_dtype,
                         int32_t W, uint64_t conv_state, int32_t state_dtype, uint64_t slot_ids,
                         uint64_t query_start, int32_t B, uint64_t out, uint64_t stream) {
  PL_REQUIRE(W >= 2 && W <= CONV_MAX_W, "conv kernel width must be in 2..8");
  PL_REQUIRE(state_dtype >= PL_F32 && state_dtype <= PL_BF16, "conv state dtype must be fp32, fp16 or bf16");
  if (B == 0 || C == 0) return 0;
  unsigned cblocks = (unsigned)((C + 127) / 128);
  if (T == 0) return 0;                               // no rows: every state stays as it is
  PL_DISPATCH_ACT(act_dtype, TA, {
    if (T <= CONV_ROWS) {
      PL_LAUNCH((conv1d_kernel<TA, true>), dim3(cblocks, 1), dim3(128), 0, stream, (const TA*)x, (const void*)w,
                (int)w_dtype, (void*)conv_state, (int)state_dtype, (const int32_t*)slot_ids,
                (const int32_t*)query_start, (int)B, T, (int)C, (int)W, (TA*)out);
    } else {
      PL_LAUNCH((conv1d_kernel<TA, false>), dim3(cblocks, (unsigned)((T + CONV_ROWS - 1) / CONV_ROWS)), dim3(128), 0,
                stream, (const TA*)x, (const void*)w, (int)w_dtype, (void*)conv_state, (int)state_dtype,
                (const int32_t*)slot_ids, (const int32_t*)query_start, (int)B, T, (int)C, (int)W, (TA*)out);
      PL_LAUNCH(conv_state_kernel<TA>, dim3(cblocks, (unsigned)B), dim3(128), 0, stream, (const TA*)x,
                (void*)conv_state, (int)state_dtype, (const int32_t*)slot_ids, (const int32_t*)query_start, (int)C,
                (int)W);
    }
  });
  PL_CHECK_LAUNCH();
  return 0;
}

// ---- The gated delta rule. One block per (32 * G value columns, value head, sequence), G column groups of
// GDN_WARPS warps: warp w of group c holds rows w*RPT .. w*RPT+RPT-1 of columns 32c .. 32c+31 of the block's
// share of S (Dk, Dv) in registers, lane = column. Per token:
//   S = exp(g) S;  delta_j = beta (v_j - sum_i S_ij k_i);  S_ij += k_i delta_j;  o_j = sum_i S_ij q_i
// with the column sums reduced across the warps through shared memory. G = 1 for the plain op.
// NORM (pl_gated_delta_rmsnorm): one block holds a head's whole row of Dv <= 32 * GDN_MAX_CG columns, so it
// finishes with GDN's gated RMSNorm, out = w * o * rsqrt(mean(o^2) + eps) * silu(z), o rounded to the activation
// type first (pl_gated_delta's output, pl_gated_rmsnorm's input): the two ops in one launch. -------------------

static const int GDN_WARPS = 8;
static const int GDN_MAX_DK = 256;
static const int GDN_MAX_CG = 4;          // column groups of a NORM block: Dv <= 128, 1024 threads

// The gated RMSNorm's operands (NORM only).
struct GdnNorm {
  const void* z = 0;          // (T, Hv, Dv) of the activation type
  const void* w = 0;          // (Dv,) of wdt
  int wdt = 0;
  float eps = 0.f;
};

template <typename TA, int RPT, bool NORM>
__global__ void __launch_bounds__(NORM ? 32 * GDN_WARPS * GDN_MAX_CG : 32 * GDN_WARPS)
gated_delta_kernel(const TA* __restrict__ q, const TA* __restrict__ k, const TA* __restrict__ v,
                   const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ state,
                   const int32_t* slot_ids, const int32_t* query_start, int Hk, int Hv, int Dk, int Dv,
                   TA* __restrict__ out, GdnNorm nrm) {
  const int CG = NORM ? GDN_MAX_CG : 1;
  __shared__ float q_s[GDN_WARPS * RPT], k_s[GDN_WARPS * RPT];   // this token's raw q, k (zero past Dk)
  __shared__ float red_qk[2][GDN_WARPS * CG];                     // per-warp sums of q^2, k^2
  __shared__ float red_k[CG][GDN_WARPS][32], red_o[CG][GDN_WARPS][32];   // per-warp column sums of S^T k, S^T q
  __shared__ float red_n[CG];                                     // NORM: per-group sums of o^2
  int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) % GDN_WARPS, cg = (threadIdx.x >> 5) / GDN_WARPS;
  int groups = blockDim.x / (32 * GDN_WARPS);                     // G (1 unless NORM)
  int j = (blockIdx.x * groups + cg) * 32 + lane, h = blockIdx.y, b = blockIdx.z;
  int kh = h / (Hv / Hk);
  bool col = j < Dv;
  float* S_g = state + ((int64_t)slot_ids[b] * Hv + h) * Dk * Dv;
  float S[RPT];
#pragma unroll
  for (int rr = 0; rr < RPT; rr++) {
    int i = warp * RPT + rr;
    S[rr] = (col && i < Dk) ? S_g[(int64_t)i * Dv + j] : 0.f;
  }
  float q_scale = rsqrtf((float)Dk);
  int64_t t0 = query_start[b], t1 = query_start[b + 1];
  // What one token needs, loaded a token ahead so the loads overlap the previous token's math: thread i < Dk
  // holds q_i and k_i (blockDim >= GDN_WARPS * RPT >= Dk), column threads v_j (and z_j); everyone g and beta.
  struct Tok { float q, k, v, z, g, beta; };
  auto fetch = [&](int64_t t, Tok& x) {
    int i = threadIdx.x;
    x.q = i < Dk ? to_f(q[(t * Hk + kh) * Dk + i]) : 0.f;
    x.k = i < Dk ? to_f(k[(t * Hk + kh) * Dk + i]) : 0.f;
    x.v = col ? to_f(v[(t * Hv + h) * Dv + j]) : 0.f;
    x.z = NORM && col ? to_f(((const TA*)nrm.z)[(t * Hv + h) * Dv + j]) : 0.f;
    x.g = g[t * Hv + h];
    x.beta = beta[t * Hv + h];
  };
  float nw = NORM && col ? load_any(nrm.w, nrm.wdt, j) : 0.f;
  Tok cur, nxt;
  if (t0 < t1) fetch(t0, cur);
  for (int64_t t = t0; t < t1; t++) {
    if (t + 1 < t1) fetch(t + 1, nxt);
    // q, k of key head kh to shared memory with their squared norms (the L2 normalisation).
    if (threadIdx.x < GDN_WARPS * RPT) { q_s[threadIdx.x] = cur.q; k_s[threadIdx.x] = cur.k; }
    float sq = warp_sum(cur.q * cur.q), sk = warp_sum(cur.k * cur.k);
    if (lane == 0) { red_qk[0][threadIdx.x >> 5] = sq; red_qk[1][threadIdx.x >> 5] = sk; }
    __syncthreads();
    sq = sk = 0.f;
    for (int w = 0; w < GDN_WARPS * groups; w++) { sq += red_qk[0][w]; sk += red_qk[1][w]; }
    float inv_q = rsqrtf(sq + 1e-6f) * q_scale, inv_k = rsqrtf(sk + 1e-6f);
    // Decay, then this warp's share of S^T k.
    float decay = expf(cur.g), part = 0.f;
#pragma unroll
    for (int rr = 0; rr < RPT; rr++) {
      S[rr] *= decay;
      part += S[rr] * k_s[warp * RPT + rr];
    }
    red_k[cg][warp][lane] = part * inv_k;
    __syncthreads();
    float kS = 0.f;
    for (int w = 0; w < GDN_WARPS; w++) kS += red_k[cg][w][lane];
    float delta = cur.beta * (cur.v - kS);
    part = 0.f;
#pragma unroll
    for (int rr = 0; rr < RPT; rr++) {
      S[rr] += k_s[warp * RPT + rr] * inv_k * delta;
      part += S[rr] * q_s[warp * RPT + rr];
    }
    red_o[cg][warp][lane] = part * inv_q;
    __syncthreads();
    // Past the third barrier every thread is done reading this token's q_s, k_s, red_qk and red_k, so the next
    // token rewrites them at once; red_o only after its second barrier, which warp 0 reaches after this read
    // (NORM: after the fourth barrier below, which every warp reaches after warp 0's read).
    float o = 0.f;
    if (warp == 0) {
      for (int w = 0; w < GDN_WARPS; w++) o += red_o[cg][w][lane];
      o = col ? to_f(from_f<TA>(o)) : 0.f;
      if (!NORM && col) out[(t * Hv + h) * Dv + j] = from_f<TA>(o);
    }
    if (NORM) {
      float ss = warp_sum(o * o);          // (zero outside warp 0 of each group)
      if (warp == 0 && lane == 0) red_n[cg] = ss;
      __syncthreads();
      if (warp == 0 && col) {
        ss = 0.f;
        for (int c = 0; c < groups; c++) ss += red_n[c];
        float inv = rsqrtf(ss / Dv + nrm.eps);
        out[(t * Hv + h) * Dv + j] = from_f<TA>(nw * o * inv * silu_f(cur.z));
      }
    }
    cur = nxt;
  }
#pragma unroll
  for (int rr = 0; rr < RPT; rr++) {
    int i = warp * RPT + rr;
    if (col && i < Dk) S_g[(int64_t)i * Dv + j] = S[rr];
  }
}

template <typename TA, int RPT, bool NORM>
static void launch_gated_delta(const TA* q, const TA* k, const TA* v, const float* g, const float* beta, float* state,
                               const int32_t* slots, const int32_t* qs, int B, int Hk, int Hv, int Dk, int Dv,
                               TA* out, const GdnNorm& nrm, uint64_t stream) {
  int groups = NORM ? (Dv + 31) / 32 : 1;
  PL_LAUNCH((gated_delta_kernel<TA, RPT, NORM>), dim3((unsigned)((Dv + 32 * groups - 1) / (32 * groups)),
            (unsigned)Hv, (unsigned)B), dim3(32 * GDN_WARPS * groups), 0, stream, q, k, v, g, beta, state, slots, qs,
            Hk, Hv, Dk, Dv, out, nrm);
}

template <bool NORM>
static int gated_delta(uint64_t q, uint64_t k, uint64_t v, int32_t act_dtype, int64_t T, int32_t Hk, int32_t Hv,
                       int32_t Dk, int32_t Dv, uint64_t g, uint64_t beta, uint64_t state, uint64_t slot_ids,
                       uint64_t query_start, int32_t B, uint64_t out, const GdnNorm& nrm, uint64_t stream) {
  PL_REQUIRE(Dk > 0 && Dk <= GDN_MAX_DK, "key head dim must be in 1..256");
  PL_REQUIRE(Hk > 0 && Hv % Hk == 0, "value heads must be a multiple of key heads");
  if (B == 0 || T == 0) return 0;
  PL_DISPATCH_ACT(act_dtype, TA, {
    const TA *qp = (const TA*)q, *kp = (const TA*)k, *vp = (const TA*)v;
    const float *gp = (const float*)g, *bp = (const float*)beta;
    const int32_t *sl = (const int32_t*)slot_ids, *qs = (const int32_t*)query_start;
    float* st = (float*)state;
    TA* op = (TA*)out;
    // RPT = rows of S per thread = ceil(Dk / GDN_WARPS).
    if (Dk <= 16) launch_gated_delta<TA, 2, NORM>(qp, kp, vp, gp, bp, st, sl, qs, B, Hk, Hv, Dk, Dv, op, nrm, stream);
    else if (Dk <= 32) launch_gated_delta<TA, 4, NORM>(qp, kp, vp, gp, bp, st, sl, qs, B, Hk, Hv, Dk, Dv, op, nrm, stream);
    else if (Dk <= 64) launch_gated_delta<TA, 8, NORM>(qp, kp, vp, gp, bp, st, sl, qs, B, Hk, Hv, Dk, Dv, op, nrm, stream);
    else if (Dk <= 128) launch_gated_delta<TA, 16, NORM>(qp, kp, vp, gp, bp, st, sl, qs, B, Hk, Hv, Dk, Dv, op, nrm, stream);
    else launch_gated_delta<TA, 32, NORM>(qp, kp, vp, gp, bp, st, sl, qs, B, Hk, Hv, Dk, Dv, op, nrm, stream);
  });
  PL_CHECK_LAUNCH();
  return 0;
}

extern "C" int pl_gated_delta(uint64_t q, uint64_t k, uint64_t v, int32_t act_dtype, int64_t T, int32_t Hk,
                              int32_t Hv, int32_t Dk, int32_t Dv, uint64_t g, uint64_t beta, uint64_t state,
                              uint64_t slot_ids, uint64_t query_start, int32_t B, uint64_t out, uint64_t stream) {
  return gated_delta<false>(q, k, v, act_dtype, T, Hk, Hv, Dk, Dv, g, beta, state, slot_ids, query_start, B, out,
                            GdnNorm(), stream);
}

extern "C" int pl_gated_delta_rmsnorm(uint64_t q, uint64_t k, uint64_t v, int32_t act_dtype, int64_t T, int32_t Hk,
                                      int32_t Hv, int32_t Dk, int32_t Dv, uint64_t g, uint64_t beta, uint64_t state,
                                      uint64_t slot_ids, uint64_t query_start, int32_t B, uint64_t z,
                                      uint64_t norm_w, int32_t norm_w_dtype, float eps, uint64_t out,
                                      uint64_t stream) {
  PL_REQUIRE(Dv > 0 && Dv <= 32 * GDN_MAX_CG, "pl_gated_delta_rmsnorm: value head dim %d must be in 1..%d (use "
             "pl_gated_delta and pl_gated_rmsnorm)", (int)Dv, 32 * GDN_MAX_CG);
  PL_REQUIRE(z != 0 && norm_w != 0, "pl_gated_delta_rmsnorm needs z and the norm's weight");
  PL_REQUIRE(norm_w_dtype >= PL_F32 && norm_w_dtype <= PL_BF16, "norm weight dtype must be fp32, fp16 or bf16");
  GdnNorm nrm;
  nrm.z = (const void*)z;
  nrm.w = (const void*)norm_w;
  nrm.wdt = norm_w_dtype;
  nrm.eps = eps;
  return gated_delta<true>(q, k, v, act_dtype, T, Hk, Hv, Dk, Dv, g, beta, state, slot_ids, query_start, B, out, nrm,
                           stream);
}
