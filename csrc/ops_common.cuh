// Shared helpers for the op kernels (norms.cu, linear.cu, attention.cu, gdn.cu): dtype codes, loads and
// stores that convert to and from fp32, warp and block reductions, the e4m3 decoder, the dtype dispatch.
// Everything here is ordinary CUDA that the CPU build runs through runtime.cuh's execution layer.
#pragma once
#include "runtime.cuh"

#include "pocketllm.h"   // the dtype codes PL_F32 .. PL_E4M3 and the op declarations

// Conversions between the activation types and fp32. ---------------------------------------------------
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(pl_half v) { return pl_h2f(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ pl_half from_f<pl_half>(float v) { return pl_f2h(v); }

// e4m3 byte -> fp32 with a few integer operations and no branch: the 7 magnitude bits move into an fp32 exponent/mantissa
// (exponent rebiased by 127 - 7 = 120); exponent 0 is the subnormal range m * 2^-9. The encodings 0x7f/0xff
// (NaN in e4m3fn) decode as 480; checkpoints never contain them.
__device__ __forceinline__ float e4m3_to_f(uint32_t byte) {
  uint32_t mag = byte & 0x7f;
  float normal = __uint_as_float((mag << 20) + (120u << 23));
  float sub = (float)(mag & 7) * 0.001953125f;   // m * 2^-9
  float v = (mag >> 3) ? normal : sub;
  return (byte & 0x80) ? -v : v;
}

// Element i of a tensor whose dtype is only known at run time (small parameter vectors, embedding tables,
// dense weights on the generic paths). The switch is uniform across a warp.
__device__ __forceinline__ float load_any(const void* p, int dtype, int64_t i) {
  switch (dtype) {
    case PL_F32: return ((const float*)p)[i];
    case PL_F16: return pl_h2f(((const pl_half*)p)[i]);
    case PL_BF16: return pl_bf2f(((const uint16_t*)p)[i]);
    default: return e4m3_to_f(((const uint8_t*)p)[i]);
  }
}

__device__ __forceinline__ void store_any(void* p, int dtype, int64_t i, float v) {
  switch (dtype) {
    case PL_F32: ((float*)p)[i] = v; break;
    case PL_F16: ((pl_half*)p)[i] = pl_f2h(v); break;
    default: ((uint16_t*)p)[i] = pl_f2bf(v); break;
  }
}

// Reductions. block_sum needs blockDim.x a multiple of 32 and every thread of the block calling it. ----------
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float block_sum(float v, float* red /* __shared__ [32] */) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();                     // red may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < nwarps; w++) total += red[w];
  return total;
}

__device__ __forceinline__ float block_max(float v, float* red /* __shared__ [32] */) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float m = red[0];
  for (int w = 1; w < nwarps; w++) m = fmaxf(m, red[w]);
  return m;
}

// The sequence owning flattened row r (query_start (B+1,) int32): the last b with query_start[b] <= r.
__device__ __forceinline__ int find_seq(const int32_t* query_start, int B, int64_t r) {
  int lo = 0, hi = B - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (query_start[mid] <= r) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ float silu_f(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }

// Run `body` with `T` bound to the activation type of code `dtype` (fp32 or fp16); other codes fail.
#define PL_DISPATCH_ACT(dtype, T, ...)                                            \
  do {                                                                             \
    if ((dtype) == PL_F32) { typedef float T; __VA_ARGS__; }                       \
    else if ((dtype) == PL_F16) { typedef pl_half T; __VA_ARGS__; }                \
    else PL_FAIL("activation dtype %d: must be 0 (fp32) or 1 (fp16)", (int)(dtype)); \
  } while (0)
