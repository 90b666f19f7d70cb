// Elementwise and normalisation ops: embed, rmsnorm, add_rmsnorm, silu_mul, sigmoid_mul, qk_norm_rope,
// kv_write, gdn_gates, gated_rmsnorm. All arithmetic in fp32; only the final value is cast to the
// activation type. One block per row for the norms, grid-stride loops for the elementwise ops.
#include "ops_common.cuh"

static const int ROW_THREADS = 256;   // threads per row for the row-wise norms
static const int EW_THREADS = 256;    // threads per block for the elementwise ops

static dim3 ew_grid(int64_t n) {
  int64_t blocks = (n + EW_THREADS - 1) / EW_THREADS;
  return dim3((unsigned)(blocks < 65535 * 8 ? (blocks > 0 ? blocks : 1) : 65535 * 8));
}

// ---- The embedding gather: out[t] = table[ids[t]]; an id outside [0, V) gives a NaN row. -------------------

template <typename TA>
__global__ void embed_kernel(const int64_t* ids, const void* table, int tdt, int64_t V, int D, TA* out) {
  int64_t t = blockIdx.x, id = ids[t];
  bool ok = id >= 0 && id < V;
  for (int i = threadIdx.x; i < D; i += blockDim.x)
    out[t * D + i] = from_f<TA>(ok ? load_any(table, tdt, id * D + i) : __int_as_float(0x7fc00000));
}

extern "C" int pl_embed(uint64_t ids, int64_t T, uint64_t table, int32_t table_dtype, int64_t V, int32_t D,
                        uint64_t out, int32_t act_dtype, uint64_t stream) {
  PL_REQUIRE(table_dtype >= PL_F32 && table_dtype <= PL_BF16, "table dtype must be fp32, fp16 or bf16");
  if (T == 0) return 0;
  PL_DISPATCH_ACT(act_dtype, TA,
    PL_LAUNCH(embed_kernel<TA>, dim3((unsigned)T), dim3(ROW_THREADS), 0, stream,
              (const int64_t*)ids, (const void*)table, (int)table_dtype, V, (int)D, (TA*)out));
  PL_CHECK_LAUNCH();
  return 0;
}

// pl_embed_shard: the rows of a vocab-parallel shard, table rows [lo, lo + V) of the full vocabulary; a row
// whose id falls outside is zero (another rank holds it, and the all-reduce that follows sums the ranks' rows).
template <typename TA>
__global__ void embed_shard_kernel(const int64_t* ids, const void* table, int tdt, int64_t lo, int64_t V, int D,
                                   TA* out) {
  int64_t t = blockIdx.x, id = ids[t] - lo;
  bool own = id >= 0 && id < V;
  for (int i = threadIdx.x; i < D; i += blockDim.x)
    out[t * D + i] = from_f<TA>(own ? load_any(table, tdt, id * D + i) : 0.f);
}

extern "C" int pl_embed_shard(uint64_t ids, int64_t T, uint64_t table, int32_t table_dtype, int64_t lo, int64_t V,
                              int32_t D, uint64_t out, int32_t act_dtype, uint64_t stream) {
  PL_REQUIRE(table_dtype >= PL_F32 && table_dtype <= PL_BF16, "table dtype must be fp32, fp16 or bf16");
  PL_REQUIRE(V >= 0 && lo >= 0 && D > 0, "embed shard: lo %lld, V %lld, D %d", (long long)lo, (long long)V, (int)D);
  if (T == 0) return 0;
  PL_DISPATCH_ACT(act_dtype, TA,
    PL_LAUNCH(embed_shard_kernel<TA>, dim3((unsigned)T), dim3(ROW_THREADS), 0, stream,
              (const int64_t*)ids, (const void*)table, (int)table_dtype, lo, V, (int)D, (TA*)out));
  PL_CHECK_LAUNCH();
  return 0;
}

// ---- Zero-centred RMSNorm, optionally fused with the residual add. -----------------------------------------
// ADD: residual (fp32) += x, then out = rmsnorm(residual). Each thread re-reads only elements it wrote itself,
// so the second pass needs no barrier; out may alias x.

template <typename TX, typename TA, bool ADD>
__global__ void rmsnorm_kernel(const TX* x, float* residual, const void* w, int wdt, TA* out, int D, float eps) {
  __shared__ float red[32];
  int64_t row = (int64_t)blockIdx.x * D;
  float ss = 0.f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float r = to_f(x[row + i]);
    if (ADD) { r += residual[row + i]; residual[row + i] = r; }
    ss += r * r;
  }
  float inv = rsqrtf(block_sum(ss, red) / D + eps);
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float r = ADD ? residual[row + i] : to_f(x[row + i]);
    out[row + i] = from_f<TA>(r * inv * (1.f + load_any(w, wdt, i)));
  }
}

extern "C" int pl_rmsnorm(uint64_t x, uint64_t w, int32_t w_dtype, uint64_t out, int32_t act_dtype, int64_t T,
                          int32_t D, float eps, uint64_t stream) {
  if (T == 0) return 0;
  PL_DISPATCH_ACT(act_dtype, TA,
    PL_LAUNCH((rmsnorm_kernel<TA, TA, false>), dim3((unsigned)T), dim3(ROW_THREADS), 0, stream,
              (const TA*)x, (float*)0, (const void*)w, (int)w_dtype, (TA*)out, (int)D, eps));
  PL_CHECK_LAUNCH();
  return 0;
}

extern "C" int pl_add_rmsnorm(uint64_t x, int32_t x_dtype, uint64_t residual, uint64_t w, int32_t w_dtype,
                              uint64_t out, int32_t act_dtype, int64_t T, int32_t D, float eps, uint64_t stream) {
  if (T == 0) return 0;
  PL_DISPATCH_ACT(x_dtype, TX, PL_DISPATCH_ACT(act_dtype, TA,
    PL_LAUNCH((rmsnorm_kernel<TX, TA, true>), dim3((unsigned)T), dim3(ROW_THREADS), 0, stream,
              (const TX*)x, (float*)residual, (const void*)w, (int)w_dtype, (TA*)out, (int)D, eps)));
  PL_CHECK_LAUNCH();
  return 0;
}

// ---- SwiGLU and the sigmoid output gate: elementwise over n values. ----------------------------------------

template <typename TI, typename TO, bool SILU>
__global__ void gate_mul_kernel(const TI* a, const TI* b, TO* out, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    float va = to_f(a[i]), vb = to_f(b[i]);
    out[i] = from_f<TO>(SILU ? silu_f(va) * vb : va * sigmoid_f(vb));
  }
}

// SwiGLU into a safe range, one block per row: the MLP intermediate of a Qwen-family model can pass fp16's
// 65504, so the row is divided by a power of two (exact: only the exponent changes) that brings its largest
// |value| to at most 2^15, and down_proj multiplies its output row back (pl_linear's x_row_scale). Two passes
// over the row (the second re-reads it from L2) cost less than an fp32 intermediate would in the GEMM.
static const float SAFE_ROW_MAX = 32768.f;

template <typename TI, typename TO>
__global__ void silu_mul_rows_kernel(const TI* g, const TI* u, int64_t I, TO* out, float* row_scale) {
  __shared__ float red[32];
  int64_t row = (int64_t)blockIdx.x * I;
  float amax = 0.f;
  for (int64_t i = threadIdx.x; i < I; i += blockDim.x) amax = fmaxf(amax, fabsf(silu_f(to_f(g[row + i])) * to_f(u[row + i])));
  amax = block_max(amax, red);
  float s = 1.f;
  if (amax > SAFE_ROW_MAX && amax < INFINITY) {   // inf / NaN rows stay as they are: nothing to rescue
    int e;
    frexpf(amax / SAFE_ROW_MAX, &e);               // amax / 2^15 = m * 2^e, m in [0.5, 1): 2^e >= it
    s = ldexpf(1.f, e);
  }
  if (threadIdx.x == 0) row_scale[blockIdx.x] = s;
  float inv = 1.f / s;                              // a power of two: exact
  for (int64_t i = threadIdx.x; i < I; i += blockDim.x)
    out[row + i] = from_f<TO>(silu_f(to_f(g[row + i])) * to_f(u[row + i]) * inv);
}

template <typename TI, typename TO>
static void launch_silu_mul(const TI* g, const TI* u, int64_t T, int64_t I, TO* out, float* row_scale,
                            uint64_t stream) {
  if (row_scale)
    PL_LAUNCH((silu_mul_rows_kernel<TI, TO>), dim3((unsigned)T), dim3(ROW_THREADS), 0, stream, g, u, I, out,
              row_scale);
  else
    PL_LAUNCH((gate_mul_kernel<TI, TO, true>), ew_grid(T * I), dim3(EW_THREADS), 0, stream, g, u, out, T * I);
}

extern "C" int pl_silu_mul(uint64_t g, uint64_t u, int32_t in_dtype, int64_t T, int64_t I, uint64_t out,
                           int32_t out_dtype, uint64_t row_scale, uint64_t stream) {
  PL_REQUIRE(out_dtype == in_dtype || (in_dtype == PL_F32 && out_dtype == PL_F16),
             "silu_mul: output dtype %d from input dtype %d (must be the input dtype, or fp16 from fp32)",
             (int)out_dtype, (int)in_dtype);
  PL_REQUIRE(T < 65535ll * 32768 && I > 0, "silu_mul shape out of range");
  if (T == 0) return 0;
  if (out_dtype == PL_F16 && in_dtype == PL_F32)
    launch_silu_mul((const float*)g, (const float*)u, T, I, (pl_half*)out, (float*)row_scale, stream);
  else
    PL_DISPATCH_ACT(in_dtype, TA,
      launch_silu_mul((const TA*)g, (const TA*)u, T, I, (TA*)out, (float*)row_scale, stream));
  PL_CHECK_LAUNCH();
  return 0;
}

extern "C" int pl_sigmoid_mul(uint64_t x, uint64_t gate, uint64_t out, int32_t act_dtype, int64_t n,
                              uint64_t stream) {
  if (n == 0) return 0;
  PL_DISPATCH_ACT(act_dtype, TA,
    PL_LAUNCH((gate_mul_kernel<TA, TA, false>), ew_grid(n), dim3(EW_THREADS), 0, stream,
              (const TA*)x, (const TA*)gate, (TA*)out, n));
  PL_CHECK_LAUNCH();
  return 0;
}

// ---- Per-head q/k norm + partial rotate-half RoPE. One block per (token, head); heads 0..Hq-1 are q, the
// rest k. The head is staged in shared memory, so the outputs may alias the inputs. With a slot mapping
// (pl_qk_norm_rope_kv) the k heads go straight into the KV cache at the token's slot and Hk more blocks per
// token copy v there: the KV-cache write needs no launch of its own. ---------------------------------------

static const int MAX_HEAD_DIM = 512;

template <typename TA>
__global__ void qk_norm_rope_kernel(const TA* q, const TA* k, TA* q_out, TA* k_out, const void* q_w,
                                    const void* k_w, int wdt, float eps, const int64_t* positions,
                                    const float* inv_freq, int half_rot, int Hq, int Hk, int Dh, const TA* v,
                                    void* k_cache, void* v_cache, int cdt, const int64_t* slot_mapping) {
  __shared__ float xs[MAX_HEAD_DIM];
  __shared__ float red[32];
  int64_t t = blockIdx.x;
  int h = blockIdx.y;
  bool is_q = h < Hq;
  int64_t slot = slot_mapping ? slot_mapping[t] : -1;
  if (h >= Hq + Hk) {                                   // a v head (uniform per block): copied to the cache
    int64_t i0 = (t * Hk + (h - Hq - Hk)) * Dh, c0 = (slot * Hk + (h - Hq - Hk)) * Dh;
    if (slot >= 0)
      for (int i = threadIdx.x; i < Dh; i += blockDim.x) store_any(v_cache, cdt, c0 + i, to_f(v[i0 + i]));
    return;
  }
  const TA* src = is_q ? q + (t * Hq + h) * Dh : k + (t * Hk + (h - Hq)) * Dh;
  TA* dst = is_q ? q_out + (t * Hq + h) * Dh : slot_mapping ? 0 : k_out + (t * Hk + (h - Hq)) * Dh;
  int64_t c0 = (slot * Hk + (h - Hq)) * Dh;             // a k head's place in the cache
  const void* w = is_q ? q_w : k_w;
  float ss = 0.f;
  for (int i = threadIdx.x; i < Dh; i += blockDim.x) {
    float v = to_f(src[i]);
    xs[i] = v;
    ss += v * v;
  }
  float inv = rsqrtf(block_sum(ss, red) / Dh + eps);   // block_sum's barriers also publish xs
  for (int i = threadIdx.x; i < Dh; i += blockDim.x) xs[i] *= inv * (1.f + load_any(w, wdt, i));
  __syncthreads();
  float pos = (float)positions[t];
  for (int i = threadIdx.x; i < Dh; i += blockDim.x) {
    float v = xs[i];
    if (i < 2 * half_rot) {
      int j = i < half_rot ? i : i - half_rot;            // frequency index of the pair (j, j + half_rot)
      float s, c;
      sincosf(pos * inv_freq[j], &s, &c);
      v = i < half_rot ? xs[i] * c - xs[i + half_rot] * s : xs[i] * c + xs[j] * s;
    }
    if (dst) dst[i] = from_f<TA>(v);
    else if (slot >= 0) store_any(k_cache, cdt, c0 + i, to_f(from_f<TA>(v)));   // as k in act, then kv_write
  }
}

extern "C" int pl_qk_norm_rope(uint64_t q, uint64_t k, uint64_t q_out, uint64_t k_out, int32_t act_dtype,
                               int64_t T, int32_t Hq, int32_t Hk, int32_t Dh, uint64_t q_w, uint64_t k_w,
                               int32_t w_dtype, float eps, uint64_t positions, uint64_t inv_freq,
                               int32_t rot_half, uint64_t stream) {
  PL_REQUIRE(Dh > 0 && Dh <= MAX_HEAD_DIM, "head_dim must be in 1..512");
  PL_REQUIRE(rot_half >= 0 && 2 * rot_half <= Dh, "2 * len(inv_freq) must not exceed head_dim");
  if (T == 0) return 0;
  PL_DISPATCH_ACT(act_dtype, TA,
    PL_LAUNCH(qk_norm_rope_kernel<TA>, dim3((unsigned)T, (unsigned)(Hq + Hk)), dim3(128), 0, stream,
              (const TA*)q, (const TA*)k, (TA*)q_out, (TA*)k_out, (const void*)q_w, (const void*)k_w,
              (int)w_dtype, eps, (const int64_t*)positions, (const float*)inv_freq, (int)rot_half,
              (int)Hq, (int)Hk, (int)Dh, (const TA*)0, (void*)0, (void*)0, 0, (const int64_t*)0));
  PL_CHECK_LAUNCH();
  return 0;
}

extern "C" int pl_qk_norm_rope_kv(uint64_t q, uint64_t k, uint64_t v, uint64_t q_out, int32_t act_dtype, int64_t T,
                                  int32_t Hq, int32_t Hk, int32_t Dh, uint64_t q_w, uint64_t k_w, int32_t w_dtype,
                                  float eps, uint64_t positions, uint64_t inv_freq, int32_t rot_half,
                                  uint64_t k_cache, uint64_t v_cache, int32_t cache_dtype, uint64_t slot_mapping,
                                  uint64_t stream) {
  PL_REQUIRE(Dh > 0 && Dh <= MAX_HEAD_DIM, "head_dim must be in 1..512");
  PL_REQUIRE(rot_half >= 0 && 2 * rot_half <= Dh, "2 * len(inv_freq) must not exceed head_dim");
  PL_REQUIRE(cache_dtype >= PL_F32 && cache_dtype <= PL_BF16, "cache dtype must be fp32, fp16 or bf16");
  PL_REQUIRE(slot_mapping != 0, "pl_qk_norm_rope_kv needs the slot mapping");
  if (T == 0) return 0;
  PL_DISPATCH_ACT(act_dtype, TA,
    PL_LAUNCH(qk_norm_rope_kernel<TA>, dim3((unsigned)T, (unsigned)(Hq + 2 * Hk)), dim3(128), 0, stream,
              (const TA*)q, (const TA*)k, (TA*)q_out, (TA*)0, (const void*)q_w, (const void*)k_w,
              (int)w_dtype, eps, (const int64_t*)positions, (const float*)inv_freq, (int)rot_half,
              (int)Hq, (int)Hk, (int)Dh, (const TA*)v, (void*)k_cache, (void*)v_cache, (int)cache_dtype,
              (const int64_t*)slot_mapping));
  PL_CHECK_LAUNCH();
  return 0;
}

// ---- KV-cache write: caches are (num_blocks, block_size, Hk, Dh), i.e. (slots, Hk, Dh). Slot < 0 = skip. ----

template <typename TA>
__global__ void kv_write_kernel(const TA* k, const TA* v, void* k_cache, void* v_cache, int cdt,
                                const int64_t* slot_mapping, int Hk, int Dh) {
  int64_t t = blockIdx.x, slot = slot_mapping[t];
  if (slot < 0) return;
  int64_t n = (int64_t)Hk * Dh;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    store_any(k_cache, cdt, slot * n + i, to_f(k[t * n + i]));
    store_any(v_cache, cdt, slot * n + i, to_f(v[t * n + i]));
  }
}

extern "C" int pl_kv_write(uint64_t k, uint64_t v, int32_t act_dtype, int64_t T, int32_t Hk, int32_t Dh,
                           uint64_t k_cache, uint64_t v_cache, int32_t cache_dtype, uint64_t slot_mapping,
                           uint64_t stream) {
  PL_REQUIRE(cache_dtype >= PL_F32 && cache_dtype <= PL_BF16, "cache dtype must be fp32, fp16 or bf16");
  if (T == 0) return 0;
  PL_DISPATCH_ACT(act_dtype, TA,
    PL_LAUNCH(kv_write_kernel<TA>, dim3((unsigned)T), dim3(ROW_THREADS), 0, stream,
              (const TA*)k, (const TA*)v, (void*)k_cache, (void*)v_cache, (int)cache_dtype,
              (const int64_t*)slot_mapping, (int)Hk, (int)Dh));
  PL_CHECK_LAUNCH();
  return 0;
}

// ---- GDN gates: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), both fp32 (T, Hv). ------------

template <typename TA>
__global__ void gdn_gates_kernel(const TA* a, const TA* b, const void* A_log, const void* dt_bias, int pdt,
                                 float* g, float* beta, int64_t n, int Hv) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    int h = (int)(i % Hv);
    float x = to_f(a[i]) + load_any(dt_bias, pdt, h);
    float softplus = x > 20.f ? x : log1pf(expf(x));   // torch's softplus threshold
    g[i] = -expf(load_any(A_log, pdt, h)) * softplus;
    beta[i] = sigmoid_f(to_f(b[i]));
  }
}

extern "C" int pl_gdn_gates(uint64_t a, uint64_t b, int32_t act_dtype, int64_t T, int32_t Hv, uint64_t A_log,
                            uint64_t dt_bias, int32_t param_dtype, uint64_t g, uint64_t beta, uint64_t stream) {
  int64_t n = T * Hv;
  if (n == 0) return 0;
  PL_DISPATCH_ACT(act_dtype, TA,
    PL_LAUNCH(gdn_gates_kernel<TA>, ew_grid(n), dim3(EW_THREADS), 0, stream,
              (const TA*)a, (const TA*)b, (const void*)A_log, (const void*)dt_bias, (int)param_dtype,
              (float*)g, (float*)beta, n, (int)Hv));
  PL_CHECK_LAUNCH();
  return 0;
}

// ---- Gated RMSNorm of the GDN output: w * x * rsqrt(mean(x^2) + eps) * silu(z), per (token, head) row. ----

template <typename TA>
__global__ void gated_rmsnorm_kernel(const TA* x, const TA* z, const void* w, int wdt, TA* out, int D, float eps) {
  __shared__ float red[32];
  int64_t row = (int64_t)blockIdx.x * D;
  float ss = 0.f;
  for (int i = threadIdx.x; i < D; i += blockDim.x) {
    float v = to_f(x[row + i]);
    ss += v * v;
  }
  float inv = rsqrtf(block_sum(ss, red) / D + eps);
  for (int i = threadIdx.x; i < D; i += blockDim.x)
    out[row + i] = from_f<TA>(load_any(w, wdt, i) * to_f(x[row + i]) * inv * silu_f(to_f(z[row + i])));
}

extern "C" int pl_gated_rmsnorm(uint64_t x, uint64_t z, uint64_t w, int32_t w_dtype, uint64_t out,
                                int32_t act_dtype, int64_t rows, int32_t D, float eps, uint64_t stream) {
  if (rows == 0) return 0;
  PL_DISPATCH_ACT(act_dtype, TA,
    PL_LAUNCH(gated_rmsnorm_kernel<TA>, dim3((unsigned)rows), dim3(128), 0, stream,
              (const TA*)x, (const TA*)z, (const void*)w, (int)w_dtype, (TA*)out, (int)D, eps));
  PL_CHECK_LAUNCH();
  return 0;
}
