// Cache row copies: the prefix cache's state snapshots (a sequence's recurrent and conv state into a snapshot
// slot and back) and its copied partial KV blocks, and forked choices' state. One launch copies n rows from one
// cache tensor to another of the same row size (or within one), dst row dst[i] <- src row src[i], a row being
// the tensor's first dimension (a state slot, a KV block). Rows move as 16-byte words when both bases and the
// row size allow it, else as bytes; the kernel never looks at the element type. One block row per copy,
// up to COPY_CHUNKS blocks along it.
#include "ops_common.cuh"

static const int COPY_THREADS = 256;
static const int COPY_CHUNKS = 64;      // blocks per row at most: a 27B layer's state row is 3 MiB

template <typename W>
__global__ void copy_rows_kernel(const W* src_base, W* dst_base, int64_t row_words, const int64_t* src,
                                 const int64_t* dst) {
  const W* from = src_base + src[blockIdx.x] * row_words;
  W* to = dst_base + dst[blockIdx.x] * row_words;
  for (int64_t i = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; i < row_words; i += (int64_t)gridDim.y * blockDim.x)
    to[i] = from[i];
}

extern "C" int pl_copy_rows(uint64_t src_base, uint64_t dst_base, int64_t row_bytes, uint64_t src_rows,
                            uint64_t dst_rows, int32_t n, uint64_t stream) {
  PL_REQUIRE(row_bytes > 0, "row_bytes must be > 0, got %lld", (long long)row_bytes);
  PL_REQUIRE(n >= 0 && n <= 65535, "n must be in [0, 65535], got %d", (int)n);
  if (n == 0) return 0;
  bool wide = src_base % 16 == 0 && dst_base % 16 == 0 && row_bytes % 16 == 0;
  int64_t words = wide ? row_bytes / 16 : row_bytes;
  int64_t per = (words + COPY_THREADS - 1) / COPY_THREADS;
  dim3 grid((unsigned)n, (unsigned)(per < COPY_CHUNKS ? per : COPY_CHUNKS));
  if (wide)
    PL_LAUNCH(copy_rows_kernel<uint4>, grid, dim3(COPY_THREADS), 0, stream, PL_PTR(const uint4, src_base),
              PL_PTR(uint4, dst_base), words,
              PL_PTR(const int64_t, src_rows), PL_PTR(const int64_t, dst_rows));
  else
    PL_LAUNCH(copy_rows_kernel<uint8_t>, grid, dim3(COPY_THREADS), 0, stream, PL_PTR(const uint8_t, src_base),
              PL_PTR(uint8_t, dst_base), words,
              PL_PTR(const int64_t, src_rows), PL_PTR(const int64_t, dst_rows));
  PL_CHECK_LAUNCH();
  return 0;
}
