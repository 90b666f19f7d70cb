// Cache row copies: the prefix cache's state snapshots (a sequence's recurrent and conv state into a snapshot
// slot and back) and its copy-on-write KV blocks. One launch copies n rows of one cache tensor, row dst[i] <-
// row src[i], where a row is the tensor's first dimension (a state slot, a KV block). Rows are moved as 16-byte
// words when the base and the row size allow it, else as bytes; the kernel never looks at the element type.
#include "ops_common.cuh"

static const int COPY_THREADS = 256;
static const int COPY_CHUNKS = 64;      // blocks per row at most: a 27B snapshot row is ~0.8 MB

template <typename W>
__global__ void copy_rows_kernel(W* base, int64_t row_words, const int64_t* src, const int64_t* dst) {
  const W* from = base + src[blockIdx.x] * row_words;
  W* to = base + dst[blockIdx.x] * row_words;
  for (int64_t i = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; i < row_words; i += (int64_t)gridDim.y * blockDim.x)
    to[i] = from[i];
}

extern "C" int pl_copy_rows(uint64_t base, int64_t row_bytes, uint64_t src_rows, uint64_t dst_rows, int32_t n,
                            uint64_t stream) {
  PL_REQUIRE(row_bytes > 0, "row_bytes must be > 0, got %lld", (long long)row_bytes);
  PL_REQUIRE(n >= 0 && n <= 65535, "n must be in [0, 65535], got %d", (int)n);
  if (n == 0) return 0;
  bool wide = base % 16 == 0 && row_bytes % 16 == 0;
  int64_t words = wide ? row_bytes / 16 : row_bytes;
  int64_t per = (words + COPY_THREADS - 1) / COPY_THREADS;
  dim3 grid((unsigned)n, (unsigned)(per < COPY_CHUNKS ? per : COPY_CHUNKS));
  if (wide)
    PL_LAUNCH(copy_rows_kernel<uint4>, grid, dim3(COPY_THREADS), 0, stream, PL_PTR(uint4, base), words,
              PL_PTR(const int64_t, src_rows), PL_PTR(const int64_t, dst_rows));
  else
    PL_LAUNCH(copy_rows_kernel<uint8_t>, grid, dim3(COPY_THREADS), 0, stream, PL_PTR(uint8_t, base), words,
              PL_PTR(const int64_t, src_rows), PL_PTR(const int64_t, dst_rows));
  PL_CHECK_LAUNCH();
  return 0;
}
