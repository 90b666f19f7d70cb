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

// ---- The gated delta rule. One block per (32 value columns, value head, sequence); warp w holds rows
// w*RPT .. w*RPT+RPT-1 of those 32 columns of S (Dk, Dv) in registers, lane = column. Per token:
//   S = exp(g) S;  delta_j = beta (v_j - sum_i S_ij k_i);  S_ij += k_i delta_j;  o_j = sum_i S_ij q_i
// with the column sums reduced across the warps through shared memory. ---------------------------------------

static const int GDN_WARPS = 8;
static const int GDN_MAX_DK = 256;

template <typename TA, int RPT>
__global__ void gated_delta_kernel(const TA* __restrict__ q, const TA* __restrict__ k, const TA* __restrict__ v,
                                   const float* __restrict__ g, const float* __restrict__ beta,
                                   float* __restrict__ state, const int32_t* slot_ids, const int32_t* query_start,
                                   int Hk, int Hv, int Dk, int Dv, TA* __restrict__ out) {
  __shared__ float q_s[GDN_WARPS * RPT], k_s[GDN_WARPS * RPT];   // this token's raw q, k (zero past Dk)
  __shared__ float red_qk[2][GDN_WARPS];                          // per-warp sums of q^2, k^2
  __shared__ float red_k[GDN_WARPS][32], red_o[GDN_WARPS][32];    // per-warp column sums of S^T k, S^T q
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int j = blockIdx.x * 32 + lane, h = blockIdx.y, b = blockIdx.z;
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
  // holds q_i and k_i (blockDim >= GDN_WARPS * RPT >= Dk), column threads v_j; everyone g and beta.
  struct Tok { float q, k, v, g, beta; };
  auto fetch = [&](int64_t t, Tok& x) {
    int i = threadIdx.x;
    x.q = i < Dk ? to_f(q[(t * Hk + kh) * Dk + i]) : 0.f;
    x.k = i < Dk ? to_f(k[(t * Hk + kh) * Dk + i]) : 0.f;
    x.v = col ? to_f(v[(t * Hv + h) * Dv + j]) : 0.f;
    x.g = g[t * Hv + h];
    x.beta = beta[t * Hv + h];
  };
  Tok cur, nxt;
  if (t0 < t1) fetch(t0, cur);
  for (int64_t t = t0; t < t1; t++) {
    if (t + 1 < t1) fetch(t + 1, nxt);
    // q, k of key head kh to shared memory with their squared norms (the L2 normalisation).
    if (threadIdx.x < GDN_WARPS * RPT) { q_s[threadIdx.x] = cur.q; k_s[threadIdx.x] = cur.k; }
    float sq = warp_sum(cur.q * cur.q), sk = warp_sum(cur.k * cur.k);
    if (lane == 0) { red_qk[0][warp] = sq; red_qk[1][warp] = sk; }
    __syncthreads();
    sq = sk = 0.f;
    for (int w = 0; w < GDN_WARPS; w++) { sq += red_qk[0][w]; sk += red_qk[1][w]; }
    float inv_q = rsqrtf(sq + 1e-6f) * q_scale, inv_k = rsqrtf(sk + 1e-6f);
    // Decay, then this warp's share of S^T k.
    float decay = expf(cur.g), part = 0.f;
#pragma unroll
    for (int rr = 0; rr < RPT; rr++) {
      S[rr] *= decay;
      part += S[rr] * k_s[warp * RPT + rr];
    }
    red_k[warp][lane] = part * inv_k;
    __syncthreads();
    float kS = 0.f;
    for (int w = 0; w < GDN_WARPS; w++) kS += red_k[w][lane];
    float delta = cur.beta * (cur.v - kS);
    part = 0.f;
#pragma unroll
    for (int rr = 0; rr < RPT; rr++) {
      S[rr] += k_s[warp * RPT + rr] * inv_k * delta;
      part += S[rr] * q_s[warp * RPT + rr];
    }
    red_o[warp][lane] = part * inv_q;
    __syncthreads();
    // Past the third barrier every thread is done reading this token's q_s, k_s, red_qk and red_k, so the next
    // token rewrites them at once; red_o only after its second barrier, which warp 0 reaches after this read.
    if (warp == 0 && col) {
      float o = 0.f;
      for (int w = 0; w < GDN_WARPS; w++) o += red_o[w][lane];
      out[(t * Hv + h) * Dv + j] = from_f<TA>(o);
    }
    cur = nxt;
  }
#pragma unroll
  for (int rr = 0; rr < RPT; rr++) {
    int i = warp * RPT + rr;
    if (col && i < Dk) S_g[(int64_t)i * Dv + j] = S[rr];
  }
}

template <typename TA, int RPT>
static void launch_gated_delta(const TA* q, const TA* k, const TA* v, const float* g, const float* beta, float* state,
                               const int32_t* slots, const int32_t* qs, int B, int Hk, int Hv, int Dk, int Dv,
                               TA* out, uint64_t stream) {
  PL_LAUNCH((gated_delta_kernel<TA, RPT>), dim3((unsigned)((Dv + 31) / 32), (unsigned)Hv, (unsigned)B),
            dim3(32 * GDN_WARPS), 0, stream, q, k, v, g, beta, state, slots, qs, Hk, Hv, Dk, Dv, out);
}

extern "C" int pl_gated_delta(uint64_t q, uint64_t k, uint64_t v, int32_t act_dtype, int64_t T, int32_t Hk,
                              int32_t Hv, int32_t Dk, int32_t Dv, uint64_t g, uint64_t beta, uint64_t state,
                              uint64_t slot_ids, uint64_t query_start, int32_t B, uint64_t out, uint64_t stream) {
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
    if (Dk <= 16) launch_gated_delta<TA, 2>(qp, kp, vp, gp, bp, st, sl, qs, B, Hk, Hv, Dk, Dv, op, stream);
    else if (Dk <= 32) launch_gated_delta<TA, 4>(qp, kp, vp, gp, bp, st, sl, qs, B, Hk, Hv, Dk, Dv, op, stream);
    else if (Dk <= 64) launch_gated_delta<TA, 8>(qp, kp, vp, gp, bp, st, sl, qs, B, Hk, Hv, Dk, Dv, op, stream);
    else if (Dk <= 128) launch_gated_delta<TA, 16>(qp, kp, vp, gp, bp, st, sl, qs, B, Hk, Hv, Dk, Dv, op, stream);
    else launch_gated_delta<TA, 32>(qp, kp, vp, gp, bp, st, sl, qs, B, Hk, Hv, Dk, Dv, op, stream);
  });
  PL_CHECK_LAUNCH();
  return 0;
}
