// Paged attention over the KV cache, (num_blocks, block_size, Hk, Dh), for prefill and decode alike.
// One block of 4 warps handles one query row, one q head and one split of the row's visible positions:
// each warp takes every 4th position, computes the q.k dot with a warp reduction, and keeps a running
// (max, sum, acc) online softmax; the warps merge through shared memory. With several splits (decode, or few
// rows: flash-decoding) every block writes its normalised partial output and log-sum-exp terms to the
// workspace and a second kernel merges the splits. Softmax and accumulation in fp32.
#include "ops_common.cuh"

static const int ATT_WARPS = 4;
static const int ATT_MAX_DH = 256;
static const int ATT_MIN_SPLIT = 256;        // positions per split at least
static const int ATT_MAX_SPLITS = 32;
static const int64_t ATT_SPLIT_ROWS = 1024;  // T * Hq at or above which one split already fills the GPU

// Splits for a launch, from host-known sizes only (max_blocks = block_tables' width).
static int attention_splits(int64_t T, int32_t Hq, int32_t max_blocks, int32_t block_size) {
  if (T * Hq >= ATT_SPLIT_ROWS) return 1;
  int64_t max_ctx = (int64_t)max_blocks * block_size;
  int64_t s = (max_ctx + ATT_MIN_SPLIT - 1) / ATT_MIN_SPLIT;
  return (int)(s < 1 ? 1 : s > ATT_MAX_SPLITS ? ATT_MAX_SPLITS : s);
}

static int64_t split_len(int splits, int32_t max_blocks, int32_t block_size) {
  int64_t max_ctx = (int64_t)max_blocks * block_size;
  int64_t len = (max_ctx + splits - 1) / splits;
  return (len + block_size - 1) / block_size * block_size;
}

extern "C" int64_t pl_attention_workspace_bytes(int64_t T, int32_t Hq, int32_t Dh, int32_t max_blocks,
                                                int32_t block_size) {
  int splits = attention_splits(T, Hq, max_blocks, block_size);
  return splits == 1 ? 0 : T * Hq * splits * (int64_t)(Dh + 2) * (int64_t)sizeof(float);
}

// The sequence owning flattened query row r: the last b with query_start[b] <= r.
__device__ __forceinline__ int find_seq(const int32_t* query_start, int B, int64_t r) {
  int lo = 0, hi = B - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (query_start[mid] <= r) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// DPL = head dims per lane (Dh <= 32 * DPL); lane l owns dims l*DPL .. l*DPL + DPL - 1.
template <typename TA, int DPL>
__global__ void attention_kernel(const TA* q, const TA* k_cache, const TA* v_cache, const int32_t* block_tables,
                                 int max_blocks, const int32_t* context_lens, const int32_t* query_start, int B,
                                 int Hq, int Hk, int Dh, int block_size, float scale, int64_t split_tokens,
                                 TA* out, float* ws) {
  __shared__ float q_s[32 * DPL];
  __shared__ float m_w[ATT_WARPS], l_w[ATT_WARPS];
  __shared__ float acc_w[ATT_WARPS][32 * DPL];
  int64_t r = blockIdx.x;
  int h = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int b = find_seq(query_start, B, r);
  int qlen = query_start[b + 1] - query_start[b];
  int64_t visible = (int64_t)context_lens[b] - qlen + (r - query_start[b]) + 1;   // positions 0 .. visible-1
  int64_t p0 = split * split_tokens, p1 = p0 + split_tokens < visible ? p0 + split_tokens : visible;
  float* part = splits > 1 ? ws + ((r * Hq + h) * splits + split) * (int64_t)(Dh + 2) : 0;  // [o (Dh) | m | l]
  if (p0 >= p1) {                                     // an empty split (only when splits > 1)
    if (threadIdx.x == 0) { part[Dh] = -INFINITY; part[Dh + 1] = 0.f; }
    return;
  }
  int kvh = h / (Hq / Hk);
  const TA* qrow = q + (r * Hq + h) * Dh;
  for (int d = threadIdx.x; d < 32 * DPL; d += blockDim.x) q_s[d] = d < Dh ? to_f(qrow[d]) * scale : 0.f;
  __syncthreads();
  float qv[DPL], acc[DPL];
  for (int j = 0; j < DPL; j++) { qv[j] = q_s[lane * DPL + j]; acc[j] = 0.f; }
  float m = -INFINITY, l = 0.f;
  const int32_t* table = block_tables + (int64_t)b * max_blocks;
  for (int64_t p = p0 + warp; p < p1; p += ATT_WARPS) {
    int64_t slot = (int64_t)table[p / block_size] * block_size + p % block_size;
    const TA* kp = k_cache + (slot * Hk + kvh) * Dh;
    const TA* vp = v_cache + (slot * Hk + kvh) * Dh;
    float dot = 0.f;
    for (int j = 0; j < DPL; j++) {
      int d = lane * DPL + j;
      if (d < Dh) dot += qv[j] * to_f(kp[d]);
    }
    float s = warp_sum(dot);
    float m_new = fmaxf(m, s);
    float corr = expf(m - m_new), e = expf(s - m_new);
    l = l * corr + e;
    for (int j = 0; j < DPL; j++) {
      int d = lane * DPL + j;
      acc[j] = acc[j] * corr + (d < Dh ? e * to_f(vp[d]) : 0.f);
    }
    m = m_new;
  }
  if (lane == 0) { m_w[warp] = m; l_w[warp] = l; }
  for (int j = 0; j < DPL; j++) acc_w[warp][lane * DPL + j] = acc[j];
  __syncthreads();
  float M = -INFINITY;
  for (int w = 0; w < ATT_WARPS; w++) M = fmaxf(M, m_w[w]);
  float L = 0.f;
  for (int w = 0; w < ATT_WARPS; w++) L += l_w[w] > 0.f ? l_w[w] * expf(m_w[w] - M) : 0.f;
  for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
    float o = 0.f;
    for (int w = 0; w < ATT_WARPS; w++)
      if (l_w[w] > 0.f) o += acc_w[w][d] * expf(m_w[w] - M);
    if (splits == 1) out[(r * Hq + h) * Dh + d] = from_f<TA>(o / L);
    else part[d] = o / L;
  }
  if (splits > 1 && threadIdx.x == 0) { part[Dh] = M; part[Dh + 1] = L; }
}

// Merge of the splits: weights l_s * exp(m_s - max m); empty splits (l = 0) are skipped, their o unwritten.
template <typename TA>
__global__ void attention_merge_kernel(const float* ws, int Hq, int Dh, int splits, TA* out) {
  int64_t r = blockIdx.x;
  int h = blockIdx.y;
  const float* parts = ws + (r * Hq + h) * splits * (int64_t)(Dh + 2);
  float M = -INFINITY;
  for (int s = 0; s < splits; s++) M = fmaxf(M, parts[s * (Dh + 2) + Dh]);
  for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
    float o = 0.f, L = 0.f;
    for (int s = 0; s < splits; s++) {
      const float* p = parts + s * (Dh + 2);
      if (p[Dh + 1] > 0.f) {
        float wgt = p[Dh + 1] * expf(p[Dh] - M);
        o += wgt * p[d];
        L += wgt;
      }
    }
    out[(r * Hq + h) * Dh + d] = from_f<TA>(o / L);
  }
}

template <typename TA, int DPL>
static void launch_attention(const TA* q, const TA* kc, const TA* vc, const int32_t* bt, int max_blocks,
                             const int32_t* cl, const int32_t* qs, int B, int64_t T, int Hq, int Hk, int Dh,
                             int block_size, float scale, int splits, TA* out, float* ws, uint64_t stream) {
  int64_t split_tokens = split_len(splits, max_blocks, block_size);
  PL_LAUNCH((attention_kernel<TA, DPL>), dim3((unsigned)T, (unsigned)Hq, (unsigned)splits), dim3(32 * ATT_WARPS),
            0, stream, q, kc, vc, bt, max_blocks, cl, qs, B, Hq, Hk, Dh, block_size, scale, split_tokens, out, ws);
  if (splits > 1)
    PL_LAUNCH(attention_merge_kernel<TA>, dim3((unsigned)T, (unsigned)Hq), dim3(128), 0, stream,
              (const float*)ws, Hq, Dh, splits, out);
}

extern "C" int pl_attention(uint64_t q, int32_t act_dtype, int64_t T, int32_t Hq, int32_t Hk, int32_t Dh,
                            uint64_t k_cache, uint64_t v_cache, int32_t block_size, uint64_t block_tables,
                            int32_t max_blocks, uint64_t context_lens, uint64_t query_start, int32_t B,
                            float scale, uint64_t out, uint64_t workspace, int64_t workspace_bytes,
                            uint64_t stream) {
  PL_REQUIRE(Dh > 0 && Dh <= ATT_MAX_DH, "head_dim must be in 1..256");
  PL_REQUIRE(Hk > 0 && Hq % Hk == 0, "q heads must be a multiple of kv heads");
  PL_REQUIRE(block_size > 0 && max_blocks > 0 && B > 0, "block_size, max_blocks and B must be positive");
  PL_REQUIRE(workspace_bytes >= pl_attention_workspace_bytes(T, Hq, Dh, max_blocks, block_size),
             "workspace smaller than pl_attention_workspace_bytes()");
  if (T == 0) return 0;
  int splits = attention_splits(T, Hq, max_blocks, block_size);
  PL_DISPATCH_ACT(act_dtype, TA, {
    const TA *qp = (const TA*)q, *kc = (const TA*)k_cache, *vc = (const TA*)v_cache;
    const int32_t *bt = (const int32_t*)block_tables, *cl = (const int32_t*)context_lens,
                  *qs = (const int32_t*)query_start;
    TA* op = (TA*)out;
    float* ws = (float*)workspace;
    if (Dh <= 32) launch_attention<TA, 1>(qp, kc, vc, bt, max_blocks, cl, qs, B, T, Hq, Hk, Dh, block_size, scale, splits, op, ws, stream);
    else if (Dh <= 64) launch_attention<TA, 2>(qp, kc, vc, bt, max_blocks, cl, qs, B, T, Hq, Hk, Dh, block_size, scale, splits, op, ws, stream);
    else if (Dh <= 128) launch_attention<TA, 4>(qp, kc, vc, bt, max_blocks, cl, qs, B, T, Hq, Hk, Dh, block_size, scale, splits, op, ws, stream);
    else launch_attention<TA, 8>(qp, kc, vc, bt, max_blocks, cl, qs, B, T, Hq, Hk, Dh, block_size, scale, splits, op, ws, stream);
  });
  PL_CHECK_LAUNCH();
  return 0;
}
