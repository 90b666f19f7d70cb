// Paged attention over the KV cache, (num_blocks, block_size, Hk, Dh), for prefill and decode alike.
// One block of 4 warps handles one query row, the q heads of one kv group (up to 8: every K/V row is read once
// for the whole group) and one split of the row's visible positions: each warp takes every 4th pair of
// positions, computes the q.k dots with warp reductions, and keeps a running (max, sum, acc) online softmax per
// head; the warps merge through shared memory. With several splits (decode, or few rows: flash-decoding) every
// block writes its normalised partial output and log-sum-exp terms to the workspace and a second kernel merges
// the splits (pl_attention_merged: the last split of each row to finish merges them, one launch). Softmax and
// accumulation in fp32.
#include "ops_common.cuh"

static const int ATT_WARPS = 4;
static const int ATT_MAX_DH = 256;
static const int ATT_MIN_SPLIT = 64;         // positions per split at least (bounds splits by max context)
static const int ATT_MAX_SPLITS = 64;
static const int64_t ATT_SPLIT_WORK = 4096;  // aim at T * Hq * splits >= this (a few hundred blocks at GQA 6-8)

// Splits for a launch, from host-known sizes only (max_blocks = block_tables' width). Each row then divides
// ITS visible positions evenly among the splits, so a wide block table costs nothing.
static int attention_splits(int64_t T, int32_t Hq, int32_t max_blocks, int32_t block_size) {
  int64_t rows = T * Hq;
  if (rows >= ATT_SPLIT_WORK) return 1;
  int64_t s = (ATT_SPLIT_WORK + rows - 1) / rows;
  int64_t by_ctx = (int64_t)max_blocks * block_size / ATT_MIN_SPLIT;
  if (s > by_ctx) s = by_ctx;
  return (int)(s < 1 ? 1 : s > ATT_MAX_SPLITS ? ATT_MAX_SPLITS : s);
}

extern "C" int64_t pl_attention_workspace_bytes(int64_t T, int32_t Hq, int32_t Dh, int32_t max_blocks,
                                                int32_t block_size) {
  int splits = attention_splits(T, Hq, max_blocks, block_size);
  return splits == 1 ? 0 : T * Hq * splits * (int64_t)(Dh + 2) * (int64_t)sizeof(float);
}

// DPL values at p (lane's share of a K or V row) to fp32; FULL: the row is exactly 32 * DPL wide and aligned,
// so one vector load serves (16 bytes for fp16 at DPL 8).
template <int DPL, bool FULL>
__device__ __forceinline__ void load_dpl(const pl_half* p, int d0, int Dh, float* v) {
  if (FULL && DPL % 2 == 0) {
    uint32_t u[DPL / 2 > 0 ? DPL / 2 : 1];
    if (DPL == 8) { uint4 x = *(const uint4*)(p + d0); u[0] = x.x; u[1] = x.y; u[2] = x.z; u[3] = x.w; }
    else if (DPL == 4) { uint2 x = *(const uint2*)(p + d0); u[0] = x.x; u[1] = x.y; }
    else u[0] = *(const uint32_t*)(p + d0);
#pragma unroll
    for (int j = 0; j < DPL / 2; j++) {
      pl_half2 h = pl_bits_half2(u[j]);
      const pl_half* hp = (const pl_half*)&h;
      v[2 * j] = pl_h2f(hp[0]);
      v[2 * j + 1] = pl_h2f(hp[1]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < DPL; j++) v[j] = d0 + j < Dh ? pl_h2f(p[d0 + j]) : 0.f;
  }
}

template <int DPL, bool FULL>
__device__ __forceinline__ void load_dpl(const float* p, int d0, int Dh, float* v) {
  if (FULL && DPL % 4 == 0) {
#pragma unroll
    for (int j = 0; j < DPL; j += 4) {
      float4 x = *(const float4*)(p + d0 + j);
      v[j] = x.x; v[j + 1] = x.y; v[j + 2] = x.z; v[j + 3] = x.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < DPL; j++) v[j] = d0 + j < Dh ? p[d0 + j] : 0.f;
  }
}

// pl_attention_gated's epilogue: the output times sigmoid(gate), gate (T, Hq * Dh) laid out as out, rounded
// to the activation type first (as the separate pl_sigmoid_mul read it). No gate: the output as it is.
template <typename TA>
__device__ __forceinline__ float gated(float o, const TA* gate, int64_t i) {
  return gate ? to_f(from_f<TA>(o)) * sigmoid_f(to_f(gate[i])) : o;
}

// One block = one query row, up to GM q heads of one kv group (GQA: each K/V row is loaded once for all of
// them), one split. DPL = head dims per lane (Dh <= 32 * DPL); lane l owns dims l*DPL .. l*DPL + DPL - 1.
// blockIdx.y = kv head * head_chunks + chunk; the chunk holds q heads kvh*G + chunk*GM .. (+GM, < G).
template <typename TA, int DPL, int GM, bool FULL>
__device__ __forceinline__ void attention_body(const TA* q, const TA* k_cache, const TA* v_cache,
                                               const int32_t* block_tables, int max_blocks,
                                               const int32_t* context_lens, const int32_t* query_start, int B,
                                               int Hq, int Hk, int Dh, int block_size, float scale,
                                               TA* out, float* ws, const TA* gate) {
  __shared__ float m_x[ATT_WARPS / 2][GM], l_x[ATT_WARPS / 2][GM];
  __shared__ float acc_x[ATT_WARPS / 2][GM][32 * DPL];
  int64_t r = blockIdx.x;
  int G = Hq / Hk, chunks = (G + GM - 1) / GM;
  int kvh = blockIdx.y / chunks, h0 = kvh * G + (blockIdx.y % chunks) * GM;
  int nh = G - (blockIdx.y % chunks) * GM < GM ? G - (blockIdx.y % chunks) * GM : GM;   // heads in this chunk
  int split = blockIdx.z, splits = gridDim.z;
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, d0 = lane * DPL;
  int b = find_seq(query_start, B, r);
  int qlen = query_start[b + 1] - query_start[b];
  int64_t visible = (int64_t)context_lens[b] - qlen + (r - query_start[b]) + 1;   // positions 0 .. visible-1
  int64_t per = (visible + splits - 1) / splits;
  per = per < 16 ? 16 : per;
  int64_t p0 = split * per, p1 = p0 + per < visible ? p0 + per : visible;
  if (p0 >= p1) {                                     // an empty split: l = 0 marks it (zeros if it is the only one)
    for (int i = threadIdx.x; i < nh; i += blockDim.x) {
      int64_t row = r * Hq + h0 + i;
      if (splits == 1) {
        for (int d = 0; d < Dh; d++) out[row * Dh + d] = from_f<TA>(0.f);
      } else {
        float* part = ws + (row * splits + split) * (int64_t)(Dh + 2);
        part[Dh] = -INFINITY;
        part[Dh + 1] = 0.f;
      }
    }
    return;
  }
  float qv[GM][DPL], acc[GM][DPL], m[GM], l[GM];
#pragma unroll
  for (int i = 0; i < GM; i++) {
    if (i < nh) load_dpl<DPL, FULL>(q + (r * Hq + h0 + i) * Dh, d0, Dh, qv[i]);
#pragma unroll
    for (int j = 0; j < DPL; j++) { qv[i][j] = i < nh ? qv[i][j] * scale : 0.f; acc[i][j] = 0.f; }
    m[i] = -INFINITY;
    l[i] = 0.f;
  }
  const int32_t* table = block_tables + (int64_t)b * max_blocks;
  // Each warp takes two positions per step (both loads in flight before the math), every 8th pair.
  for (int64_t p = p0 + 2 * warp; p < p1; p += 2 * ATT_WARPS) {
    bool two = p + 1 < p1;                            // uniform across the warp
    float k0[DPL], v0[DPL], k1[DPL], v1[DPL];
    int64_t s0 = (int64_t)table[p / block_size] * block_size + p % block_size;
    load_dpl<DPL, FULL>(k_cache + (s0 * Hk + kvh) * Dh, d0, Dh, k0);
    load_dpl<DPL, FULL>(v_cache + (s0 * Hk + kvh) * Dh, d0, Dh, v0);
    if (two) {
      int64_t s1 = (int64_t)table[(p + 1) / block_size] * block_size + (p + 1) % block_size;
      load_dpl<DPL, FULL>(k_cache + (s1 * Hk + kvh) * Dh, d0, Dh, k1);
      load_dpl<DPL, FULL>(v_cache + (s1 * Hk + kvh) * Dh, d0, Dh, v1);
    } else {
#pragma unroll
      for (int j = 0; j < DPL; j++) k1[j] = v1[j] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < GM; i++) {
      if (i < nh) {                                   // uniform across the warp
        float dot0 = 0.f, dot1 = 0.f;
#pragma unroll
        for (int j = 0; j < DPL; j++) { dot0 += qv[i][j] * k0[j]; dot1 += qv[i][j] * k1[j]; }
        float sc0 = warp_sum(dot0), sc1 = two ? warp_sum(dot1) : -INFINITY;
        float m_new = fmaxf(m[i], fmaxf(sc0, sc1));
        float corr = expf(m[i] - m_new), e0 = expf(sc0 - m_new), e1 = two ? expf(sc1 - m_new) : 0.f;
        l[i] = l[i] * corr + e0 + e1;
#pragma unroll
        for (int j = 0; j < DPL; j++) acc[i][j] = acc[i][j] * corr + e0 * v0[j] + e1 * v1[j];
        m[i] = m_new;
      }
    }
  }
  // Merge the warps' (m, l, acc) per head in a tree (warps 2,3 into 0,1, then 1 into 0) through a shared buffer
  // of two warps' worth; a warp that saw no position has l = 0 and weighs nothing.
  for (int half = ATT_WARPS / 2; half >= 1; half /= 2) {
    if (warp >= half && warp < 2 * half) {
#pragma unroll
      for (int i = 0; i < GM; i++) {
        if (lane == 0) { m_x[warp - half][i] = m[i]; l_x[warp - half][i] = l[i]; }
#pragma unroll
        for (int j = 0; j < DPL; j++) acc_x[warp - half][i][d0 + j] = acc[i][j];
      }
    }
    __syncthreads();
    if (warp < half) {
#pragma unroll
      for (int i = 0; i < GM; i++) {
        float mo = m_x[warp][i], lo = l_x[warp][i], M = fmaxf(m[i], mo);
        float c_me = l[i] > 0.f ? expf(m[i] - M) : 0.f, c_o = lo > 0.f ? expf(mo - M) : 0.f;
        l[i] = l[i] * c_me + lo * c_o;
        m[i] = M;
#pragma unroll
        for (int j = 0; j < DPL; j++) acc[i][j] = acc[i][j] * c_me + acc_x[warp][i][d0 + j] * c_o;
      }
    }
    __syncthreads();
  }
  if (warp != 0) return;
#pragma unroll
  for (int i = 0; i < GM; i++) {
    if (i >= nh) continue;
    int64_t row = r * Hq + h0 + i;
    float* part = splits > 1 ? ws + (row * splits + split) * (int64_t)(Dh + 2) : 0;   // [o (Dh) | m | l]
#pragma unroll
    for (int j = 0; j < DPL; j++) {
      int d = d0 + j;
      if (d >= Dh) continue;
      if (splits == 1) out[row * Dh + d] = from_f<TA>(gated(acc[i][j] / l[i], gate, row * Dh + d));
      else part[d] = acc[i][j] / l[i];
    }
    if (splits > 1 && lane == 0) { part[Dh] = m[i]; part[Dh + 1] = l[i]; }
  }
}

// Merge of the splits of (query row, head) `row`: weights l_s * exp(m_s - max m); empty splits (l = 0) are
// skipped, their o unwritten. Thread s < splits reads split s's (m, l) and the block reduces them, so the weights
// cost two block reductions, not a serial walk of every split per thread (64 dependent loads each, ~30 us at 4k
// context on an H200); then each thread sums its head dims over the splits, the loads of 8 splits in flight.
// F: const float, or const volatile float when other blocks of the same launch wrote the partials (past the L1,
// which is not coherent). Every thread of the block calls it (block reductions).
template <typename TA, typename F>
__device__ __forceinline__ void merge_splits(F* ws, int64_t row, int Dh, int splits, TA* out, const TA* gate) {
  __shared__ float wgt[ATT_MAX_SPLITS], red[32];
  F* parts = ws + row * splits * (int64_t)(Dh + 2);
  int s = threadIdx.x;
  float m = -INFINITY, l = 0.f;
  if (s < splits) {
    m = parts[s * (Dh + 2) + Dh];
    l = parts[s * (Dh + 2) + Dh + 1];
  }
  __syncthreads();                                    // a previous call's threads are done reading wgt
  float M = block_max(l > 0.f ? m : -INFINITY, red);
  float mine = l > 0.f ? l * expf(m - M) : 0.f;
  if (s < splits) wgt[s] = mine;
  float L = block_sum(mine, red);                     // its barriers also publish wgt
  for (int d = threadIdx.x; d < Dh; d += blockDim.x) {
    float o = 0.f;
#pragma unroll 8
    for (int j = 0; j < splits; j++)
      if (wgt[j] > 0.f) o += wgt[j] * parts[j * (Dh + 2) + d];
    int64_t i = row * Dh + d;
    out[i] = from_f<TA>(gated(L > 0.f ? o / L : 0.f, gate, i));   // no visible position: 0
  }
}

template <typename TA>
__global__ void attention_merge_kernel(const float* ws, int Hq, int Dh, int splits, TA* out, const TA* gate) {
  merge_splits<TA, const float>(ws, (int64_t)blockIdx.x * Hq + blockIdx.y, Dh, splits, out, gate);
}

// The attention launch. With counters (pl_attention_merged) and several splits, the splits of a (row, head
// group) count themselves in counters[blockIdx.x * gridDim.y + blockIdx.y] once their partials are written, and
// the last to arrive merges them (merge_splits, so the same sums as the merge kernel) and zeroes the counter:
// no second launch, no grid barrier.
template <typename TA, int DPL, int GM, bool FULL>
__global__ void attention_kernel(const TA* q, const TA* k_cache, const TA* v_cache, const int32_t* block_tables,
                                 int max_blocks, const int32_t* context_lens, const int32_t* query_start, int B,
                                 int Hq, int Hk, int Dh, int block_size, float scale,
                                 TA* out, float* ws, const TA* gate, unsigned* counters) {
  attention_body<TA, DPL, GM, FULL>(q, k_cache, v_cache, block_tables, max_blocks, context_lens, query_start, B, Hq,
                                    Hk, Dh, block_size, scale, out, ws, gate);
  if (gridDim.z == 1 || !counters) return;
  __shared__ int last;
  __threadfence();                                    // this split's partials are visible before its count
  __syncthreads();
  unsigned* c = counters + (int64_t)blockIdx.x * gridDim.y + blockIdx.y;
  if (threadIdx.x == 0) last = atomicAdd(c, 1u) == gridDim.z - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  int G = Hq / Hk, chunks = (G + GM - 1) / GM, chunk = blockIdx.y % chunks;
  int h0 = (blockIdx.y / chunks) * G + chunk * GM, nh = G - chunk * GM < GM ? G - chunk * GM : GM;
  for (int i = 0; i < nh; i++)
    merge_splits<TA, const volatile float>(ws, (int64_t)blockIdx.x * Hq + h0 + i, Dh, gridDim.z, out, gate);
  if (threadIdx.x == 0) *c = 0;                       // ready for the next launch
}

template <typename TA, int DPL, int GM>
static void launch_attention(const TA* q, const TA* kc, const TA* vc, const int32_t* bt, int max_blocks,
                             const int32_t* cl, const int32_t* qs, int B, int64_t T, int Hq, int Hk, int Dh,
                             int block_size, float scale, int splits, TA* out, float* ws, const TA* gate,
                             unsigned* counters, uint64_t stream) {
  int chunks = (Hq / Hk + GM - 1) / GM;
  bool full = Dh == 32 * DPL && ((uintptr_t)q & 15) == 0 && ((uintptr_t)kc & 15) == 0 && ((uintptr_t)vc & 15) == 0;
  dim3 grid((unsigned)T, (unsigned)(Hk * chunks), (unsigned)splits), block(32 * ATT_WARPS);
  if (full)
    PL_LAUNCH((attention_kernel<TA, DPL, GM, true>), grid, block, 0, stream, q, kc, vc, bt, max_blocks, cl, qs, B,
              Hq, Hk, Dh, block_size, scale, out, ws, gate, counters);
  else
    PL_LAUNCH((attention_kernel<TA, DPL, GM, false>), grid, block, 0, stream, q, kc, vc, bt, max_blocks, cl, qs, B,
              Hq, Hk, Dh, block_size, scale, out, ws, gate, counters);
  if (splits > 1 && !counters)
    PL_LAUNCH(attention_merge_kernel<TA>, dim3((unsigned)T, (unsigned)Hq), dim3(128), 0, stream,
              (const float*)ws, Hq, Dh, splits, out, gate);
}

// Head-group size GM by the GQA ratio: 1, 2, 4 or 8 heads per block (larger groups run in chunks of 8).
template <typename TA, int DPL>
static void launch_attention_g(const TA* q, const TA* kc, const TA* vc, const int32_t* bt, int max_blocks,
                               const int32_t* cl, const int32_t* qs, int B, int64_t T, int Hq, int Hk, int Dh,
                               int block_size, float scale, int splits, TA* out, float* ws, const TA* gate,
                               unsigned* counters, uint64_t stream) {
  int G = Hq / Hk;
  if (G == 1)
    launch_attention<TA, DPL, 1>(q, kc, vc, bt, max_blocks, cl, qs, B, T, Hq, Hk, Dh, block_size, scale, splits, out, ws, gate, counters, stream);
  else if (G == 2)
    launch_attention<TA, DPL, 2>(q, kc, vc, bt, max_blocks, cl, qs, B, T, Hq, Hk, Dh, block_size, scale, splits, out, ws, gate, counters, stream);
  else if (G <= 4)
    launch_attention<TA, DPL, 4>(q, kc, vc, bt, max_blocks, cl, qs, B, T, Hq, Hk, Dh, block_size, scale, splits, out, ws, gate, counters, stream);
  else
    launch_attention<TA, DPL, 8>(q, kc, vc, bt, max_blocks, cl, qs, B, T, Hq, Hk, Dh, block_size, scale, splits, out, ws, gate, counters, stream);
}

static int attention(uint64_t q, int32_t act_dtype, int64_t T, int32_t Hq, int32_t Hk, int32_t Dh,
                     uint64_t k_cache, uint64_t v_cache, int32_t block_size, uint64_t block_tables,
                     int32_t max_blocks, uint64_t context_lens, uint64_t query_start, int32_t B,
                     float scale, uint64_t out, uint64_t gate, uint64_t workspace, int64_t workspace_bytes,
                     uint64_t stream, uint64_t counters = 0) {
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
    const TA* gp = (const TA*)gate;
    float* ws = (float*)workspace;
    unsigned* cn = (unsigned*)counters;
    if (Dh <= 32) launch_attention_g<TA, 1>(qp, kc, vc, bt, max_blocks, cl, qs, B, T, Hq, Hk, Dh, block_size, scale, splits, op, ws, gp, cn, stream);
    else if (Dh <= 64) launch_attention_g<TA, 2>(qp, kc, vc, bt, max_blocks, cl, qs, B, T, Hq, Hk, Dh, block_size, scale, splits, op, ws, gp, cn, stream);
    else if (Dh <= 128) launch_attention_g<TA, 4>(qp, kc, vc, bt, max_blocks, cl, qs, B, T, Hq, Hk, Dh, block_size, scale, splits, op, ws, gp, cn, stream);
    else launch_attention_g<TA, 8>(qp, kc, vc, bt, max_blocks, cl, qs, B, T, Hq, Hk, Dh, block_size, scale, splits, op, ws, gp, cn, stream);
  });
  PL_CHECK_LAUNCH();
  return 0;
}

extern "C" int pl_attention(uint64_t q, int32_t act_dtype, int64_t T, int32_t Hq, int32_t Hk, int32_t Dh,
                            uint64_t k_cache, uint64_t v_cache, int32_t block_size, uint64_t block_tables,
                            int32_t max_blocks, uint64_t context_lens, uint64_t query_start, int32_t B,
                            float scale, uint64_t out, uint64_t workspace, int64_t workspace_bytes,
                            uint64_t stream) {
  return attention(q, act_dtype, T, Hq, Hk, Dh, k_cache, v_cache, block_size, block_tables, max_blocks, context_lens,
                   query_start, B, scale, out, 0, workspace, workspace_bytes, stream);
}

extern "C" int pl_attention_gated(uint64_t q, int32_t act_dtype, int64_t T, int32_t Hq, int32_t Hk, int32_t Dh,
                                  uint64_t k_cache, uint64_t v_cache, int32_t block_size, uint64_t block_tables,
                                  int32_t max_blocks, uint64_t context_lens, uint64_t query_start, int32_t B,
                                  float scale, uint64_t out, uint64_t gate, uint64_t workspace,
                                  int64_t workspace_bytes, uint64_t stream) {
  PL_REQUIRE(gate != 0, "pl_attention_gated needs the gate");
  return attention(q, act_dtype, T, Hq, Hk, Dh, k_cache, v_cache, block_size, block_tables, max_blocks, context_lens,
                   query_start, B, scale, out, gate, workspace, workspace_bytes, stream);
}

extern "C" int pl_attention_merged(uint64_t q, int32_t act_dtype, int64_t T, int32_t Hq, int32_t Hk, int32_t Dh,
                                   uint64_t k_cache, uint64_t v_cache, int32_t block_size, uint64_t block_tables,
                                   int32_t max_blocks, uint64_t context_lens, uint64_t query_start, int32_t B,
                                   float scale, uint64_t out, uint64_t gate, uint64_t workspace,
                                   int64_t workspace_bytes, uint64_t counters, uint64_t stream) {
  PL_REQUIRE(counters != 0, "pl_attention_merged needs its counters (%d zeroed uint32)", (int)ATT_SPLIT_WORK);
  return attention(q, act_dtype, T, Hq, Hk, Dh, k_cache, v_cache, block_size, block_tables, max_blocks, context_lens,
                   query_start, B, scale, out, gate, workspace, workspace_bytes, stream, counters);
}
