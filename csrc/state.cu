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

// Decode-step plumbing that would otherwise be torch ops in the forward (so a recorded decode step is native
// only, section 8's DecodeGraphs): zero-filling a buffer (the residual stream's start) and packing a strided 2-D
// view (rows of row_bytes bytes, src_stride bytes apart) into a buffer of dst_stride-byte rows (NativeOps._as).
// Both move 16-byte words when every address and size allows it, else bytes; neither looks at the element type.

static const int FILL_BLOCKS = 1024;    // grid-stride loops: enough blocks to fill an H200, few to launch

template <typename W>
__global__ void zero_kernel(W* dst, int64_t words) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += (int64_t)gridDim.x * blockDim.x)
    dst[i] = W{};
}

template <typename W>
__global__ void copy_2d_kernel(const uint8_t* src, int64_t src_stride, uint8_t* dst, int64_t dst_stride,
                               int64_t rows, int64_t row_words) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const W* from = (const W*)(src + r * src_stride);
    W* to = (W*)(dst + r * dst_stride);
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < row_words; i += (int64_t)gridDim.x * blockDim.x)
      to[i] = from[i];
  }
}

static unsigned blocks_for(int64_t words, int64_t most) {
  int64_t blocks = (words + COPY_THREADS - 1) / COPY_THREADS;
  return (unsigned)(blocks < 1 ? 1 : blocks < most ? blocks : most);
}

extern "C" int pl_zero(uint64_t dst, int64_t bytes, uint64_t stream) {
  PL_REQUIRE(bytes >= 0, "bytes must be >= 0, got %lld", (long long)bytes);
  if (bytes == 0) return 0;
  PL_REQUIRE(dst != 0, "dst is a null pointer");
  if (dst % 16 == 0 && bytes % 16 == 0)
    PL_LAUNCH(zero_kernel<uint4>, dim3(blocks_for(bytes / 16, FILL_BLOCKS)), dim3(COPY_THREADS), 0, stream,
              PL_PTR(uint4, dst), bytes / 16);
  else
    PL_LAUNCH(zero_kernel<uint8_t>, dim3(blocks_for(bytes, FILL_BLOCKS)), dim3(COPY_THREADS), 0, stream,
              PL_PTR(uint8_t, dst), bytes);
  PL_CHECK_LAUNCH();
  return 0;
}

extern "C" int pl_copy_2d(uint64_t src, int64_t src_stride, uint64_t dst, int64_t dst_stride, int64_t rows,
                          int64_t row_bytes, uint64_t stream) {
  PL_REQUIRE(rows >= 0 && row_bytes >= 0, "rows and row_bytes must be >= 0, got %lld and %lld", (long long)rows,
             (long long)row_bytes);
  if (rows == 0 || row_bytes == 0) return 0;
  PL_REQUIRE(src != 0 && dst != 0, "src and dst must not be null pointers");
  PL_REQUIRE(src_stride >= row_bytes && dst_stride >= row_bytes,
             "row strides (%lld, %lld bytes) must be at least row_bytes (%lld)", (long long)src_stride,
             (long long)dst_stride, (long long)row_bytes);
  bool wide = (src | dst) % 16 == 0 && (src_stride | dst_stride | row_bytes) % 16 == 0;
  int64_t words = wide ? row_bytes / 16 : row_bytes;
  dim3 grid(blocks_for(words, COPY_CHUNKS), (unsigned)(rows < 65535 ? rows : 65535));
  if (wide)
    PL_LAUNCH(copy_2d_kernel<uint4>, grid, dim3(COPY_THREADS), 0, stream, PL_PTR(const uint8_t, src), src_stride,
              PL_PTR(uint8_t, dst), dst_stride, rows, words);
  else
    PL_LAUNCH(copy_2d_kernel<uint8_t>, grid, dim3(COPY_THREADS), 0, stream, PL_PTR(const uint8_t, src), src_stride,
              PL_PTR(uint8_t, dst), dst_stride, rows, words);
  PL_CHECK_LAUNCH();
  return 0;
}
