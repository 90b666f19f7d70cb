// runtime.cuh: the few spellings that let one kernel source build twice.
//
// Under nvcc (__CUDACC__) everything here is the real CUDA: chevron launches, __half, mma.sync, ldmatrix.
// Under a host C++ compiler (the CPU test build, `python build.py --cpu`) this header is a small CUDA
// execution layer: blocks run one after another; the threads of a block are cooperative fibers (own stacks),
// so __syncthreads() is a real barrier; the 32 lanes of a warp exchange values at a warp barrier; tensor-core
// and fp8/fp16 wrappers compute the documented results on the CPU. A barrier that not every thread reaches is
// reported as a launch error (cudaGetLastError), never a hang. See docs/native.md.
//
// Kernel writers' contract (both builds):
//   - launch through PL_LAUNCH(kernel, grid, block, smem_bytes, stream, args...), then PL_CHECK_LAUNCH();
//     for a template kernel take a pointer first: `auto k = my_kernel<128>; PL_LAUNCH(k, ...)`;
//   - dynamic shared memory through PL_DYN_SMEM(T, name); static `__shared__` works as usual;
//   - fp16 through pl_half / pl_h2f / pl_f2h, bf16 through pl_bf2f / pl_f2bf, fp8 through pl_e4m3_*;
//   - tensor cores through pl_mma_m16n8k8 and pl_ldmatrix_*; warp ops with their standard names;
//   - exported functions return int (0 = ok); PL_CHECK / PL_FAIL fill pl_last_error() and return -1.
#pragma once

#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <math.h>
#include <atomic>

// ---------------------------------------------------------------------------------------------------------
// Errors, common to both builds: a thread-local message buffer read by pl_last_error() (runtime.cu).
// ---------------------------------------------------------------------------------------------------------

// Record "func (file:line): what: detail" as the last error. Defined in runtime.cu.
void pl_set_error(const char* func, const char* file, int line, const char* what, const char* detail);
// printf-style variant used by PL_FAIL.
void pl_set_errorf(const char* func, const char* file, int line, const char* fmt, ...);

// Check a CUDA runtime call; on failure record it and return -1 from the calling (int) function.
#define PL_CHECK(call)                                                                        \
    do {                                                                                      \
        cudaError_t pl_status_ = (call);                                                      \
        if (pl_status_ != cudaSuccess) {                                                      \
            pl_set_error(__func__, __FILE__, __LINE__, #call, cudaGetErrorString(pl_status_)); \
            return -1;                                                                        \
        }                                                                                     \
    } while (0)

// After every launch: a bad configuration or (CPU build) a divergent barrier shows up here.
#define PL_CHECK_LAUNCH() PL_CHECK(cudaGetLastError())

// Refuse bad arguments with a one-line, printf-style message (e.g. an unsupported head_dim).
#define PL_FAIL(...)                                                   \
    do {                                                               \
        pl_set_errorf(__func__, __FILE__, __LINE__, __VA_ARGS__);      \
        return -1;                                                     \
    } while (0)
#define PL_REQUIRE(cond, ...)          \
    do {                               \
        if (!(cond)) PL_FAIL(__VA_ARGS__); \
    } while (0)

// Device pointers travel through the C ABI as integers.
#define PL_PTR(T, u64) (reinterpret_cast<T*>(static_cast<uintptr_t>(u64)))

// Launch accounting, the same in both builds: every PL_LAUNCH adds one to pl_launch_counter (pl_launch_count
// reads it, so launches per decoded token are counted on the CPU too). With pl_set_skip_kernels(1) a launch
// is counted and then not run: what is left is the host's own cost of an op (benchmarks/host_ops.py).
inline std::atomic<uint64_t> pl_launch_counter{0};
inline std::atomic<int> pl_skip_kernels_flag{0};
// Count one launch; true when the kernel should run.
inline bool pl_count_launch() {
    pl_launch_counter.fetch_add(1, std::memory_order_relaxed);
    return pl_skip_kernels_flag.load(std::memory_order_relaxed) == 0;
}

#ifdef __CUDACC__
// =========================================================================================================
// The GPU build: the real spellings.
// =========================================================================================================
#include <cuda_runtime.h>
#include <cuda_fp16.h>

#define PL_CPU_EMU 0

#define PL_LAUNCH(kernel, grid, block, smem, stream, ...)                                 \
    do {                                                                                  \
        if (pl_count_launch())                                                            \
            kernel<<<(grid), (block), (smem), (cudaStream_t)(uintptr_t)(stream)>>>(__VA_ARGS__); \
    } while (0)

#define PL_DYN_SMEM(T, name)                                  \
    extern __shared__ __align__(16) unsigned char pl_dyn_smem_[]; \
    T* name = reinterpret_cast<T*>(pl_dyn_smem_)

typedef __half pl_half;
typedef __half2 pl_half2;

__device__ __forceinline__ float pl_h2f(pl_half h) { return __half2float(h); }
__device__ __forceinline__ pl_half pl_f2h(float f) { return __float2half_rn(f); }
__device__ __forceinline__ pl_half2 pl_make_half2(pl_half x, pl_half y) { return __halves2half2(x, y); }
__device__ __forceinline__ uint32_t pl_half2_bits(pl_half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ pl_half2 pl_bits_half2(uint32_t u) { return *reinterpret_cast<pl_half2*>(&u); }
__device__ __forceinline__ float pl_bits_float(uint32_t u) { return __uint_as_float(u); }
__device__ __forceinline__ uint32_t pl_float_bits(float f) { return __float_as_uint(f); }

// D (16x8 f32) = A (16x8 f16, row) * B (8x8 f16, col) + C; fragments as in the PTX ISA (see the CPU version).
__device__ __forceinline__ void pl_mma_m16n8k8(float d[4], const uint32_t a[2], uint32_t b, const float c[4]) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ uint32_t pl_smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void pl_ldmatrix_x4(uint32_t r[4], const void* smem_row_ptr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(pl_smem_addr(smem_row_ptr)));
}
__device__ __forceinline__ void pl_ldmatrix_x2(uint32_t r[2], const void* smem_row_ptr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(pl_smem_addr(smem_row_ptr)));
}
__device__ __forceinline__ void pl_ldmatrix_x4_trans(uint32_t r[4], const void* smem_row_ptr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(pl_smem_addr(smem_row_ptr)));
}
__device__ __forceinline__ void pl_ldmatrix_x2_trans(uint32_t r[2], const void* smem_row_ptr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(pl_smem_addr(smem_row_ptr)));
}

#else
// =========================================================================================================
// The CPU build: a CUDA execution layer on fibers.
// =========================================================================================================
#include <sys/mman.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdarg.h>
#include <algorithm>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define PL_ASAN 1
#else
#define PL_ASAN 0
#endif

#define PL_CPU_EMU 1
#if !defined(__x86_64__)
#error "the CPU execution layer switches fibers with x86-64 assembly (pl_cpu_switch in runtime.cu)"
#endif

// Qualifiers vanish; __shared__ becomes function-static storage (one block runs at a time).
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
#define __constant__ static

// ---- Vector and index types (the subset kernels use) ----
struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint3 { unsigned x, y, z; };
struct __align__(8) float2 { float x, y; };
struct __align__(16) float4 { float x, y, z, w; };
struct __align__(8) uint2 { unsigned x, y; };
struct __align__(16) uint4 { unsigned x, y, z, w; };
struct __align__(8) int2 { int x, y; };
struct __align__(16) int4 { int x, y, z, w; };
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
static inline int2 make_int2(int x, int y) { return {x, y}; }
static inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }

// ---- The slice of the CUDA runtime API the library uses; streams are synchronous no-ops ----
typedef int cudaError_t;
typedef void* cudaStream_t;
enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorNoDevice = 100,
    cudaErrorLaunchFailure = 719,
};
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr {
    cudaDevAttrMaxSharedMemoryPerBlock = 8,
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
};
enum cudaMemcpyKind { cudaMemcpyDefault = 4 };

namespace pl_cpu {

// The emulated device: a Turing-class GPU (the smallest target), so its limits are the binding ones.
constexpr int kWarp = 32;
constexpr int kMaxThreads = 1024;
constexpr size_t kDefaultSmem = 48 * 1024;   // dynamic smem without cudaFuncSetAttribute
constexpr size_t kMaxSmemOptin = 64 * 1024;  // sm_75 opt-in maximum
constexpr size_t kSmemRedzone = 64;          // poisoned bytes each side of dynamic smem (ASan)

// What a fiber (one CUDA thread) is doing, as the scheduler sees it.
enum State { RUNNABLE, AT_SYNC, AT_WARP, DONE };

// One warp-level collective in flight: each named lane deposits its inputs, the last one computes all outputs.
enum WarpOp { W_SYNC, W_SHFL, W_SHFL_UP, W_SHFL_DOWN, W_SHFL_XOR, W_BALLOT, W_ANY, W_ALL, W_MMA, W_LDM };
struct Lane {
    uint32_t in[8];   // inputs: value bits, or mma fragments a0 a1 b c0..c3
    uint32_t out[8];  // results for this lane
    const void* ptr;  // ldmatrix row address
    int arg;          // this lane's source lane / delta / lane mask
};
struct Warp {
    uint32_t existing = 0;  // lanes this warp has (the last warp of a block may be partial)
    uint32_t arrived = 0;   // lanes that have deposited for the pending op
    uint32_t mask = 0;      // the pending op's member mask
    int op = -1, arg = 0, width = 0;   // arg: the first lane's (for ops whose argument must be uniform)
    Lane lane[kWarp];
};

struct Fiber {
    void* sp = nullptr;        // saved stack pointer while switched out
    char* stack = nullptr;     // usable stack (a guard page lies below it)
    uint3 tid;
    int linear = 0;
    State state = RUNNABLE;
    const char* sync_file = nullptr;  // the __syncthreads() this fiber waits at
    int sync_line = 0;
    void* fake_stack = nullptr;       // ASan bookkeeping for fiber switches
};

// Launch state. Launches are serialised by g_mutex, so plain globals are enough.
inline std::mutex g_mutex;
inline size_t g_stack_bytes = 0;
inline std::vector<Fiber> g_fibers;
inline std::vector<Warp> g_warps;
inline Fiber* g_cur = nullptr;
inline void* g_sched_sp = nullptr;
inline void* g_sched_fake = nullptr;
inline const void* g_sched_stack_bottom = nullptr;
inline size_t g_sched_stack_size = 0;
inline void (*g_body)(void*) = nullptr;
inline void* g_body_ctx = nullptr;
inline uint3 g_block_idx, g_block_dim, g_grid_dim;
inline unsigned char* g_dyn_smem = nullptr;
inline size_t g_dyn_smem_cap = 0;
inline std::unordered_map<const void*, size_t> g_smem_optin;
// Errors. The first failure of the launch in progress goes to plain globals (the hot loop checks them; a
// thread_local costs a __tls_get_addr per access in a shared library), and at the end of the launch to the
// calling thread's pending error, which cudaGetLastError returns and clears. Fixed buffers, no std::string:
// when the ASan runtime is loaded late (dlopen into python), std::string's allocations inside libstdc++ and
// its frees inline here would meet different allocators.
inline int g_launch_code = cudaSuccess;
inline char g_launch_msg[1024];
inline thread_local int g_error_code = cudaSuccess;
inline thread_local char g_error[1024];
inline thread_local char g_error_text[1024];   // the message of the error cudaGetLastError last returned

__attribute__((format(printf, 2, 3))) inline void fail(int code, const char* fmt, ...) {
    if (g_launch_code != cudaSuccess) return;
    g_launch_code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_launch_msg, sizeof g_launch_msg, fmt, ap);
    va_end(ap);
}

#define PL_EMU_INTERNAL __attribute__((no_sanitize_address))

// ---- Fiber switching (with ASan's fiber annotations so it follows the stacks) ----
// pl_cpu_switch (runtime.cu, x86-64 assembly) saves the callee-saved registers on the current stack, stores
// the stack pointer in *save and resumes the stack `to`. ucontext's swapcontext would do, but it makes a
// system call per switch and ASan clears a whole stack's shadow on each; this is ~20x faster.
extern "C" void pl_cpu_switch(void** save, void* to);
inline void switch_to_scheduler(Fiber* f, bool finished) {
    (void)finished;  // used by the ASan annotation only
#if PL_ASAN
    __sanitizer_start_switch_fiber(finished ? nullptr : &f->fake_stack, g_sched_stack_bottom, g_sched_stack_size);
#endif
    pl_cpu_switch(&f->sp, g_sched_sp);
#if PL_ASAN
    __sanitizer_finish_switch_fiber(f->fake_stack, &g_sched_stack_bottom, &g_sched_stack_size);
#endif
}

inline void switch_to_fiber(Fiber* f) {
    g_cur = f;
#if PL_ASAN
    __sanitizer_start_switch_fiber(&g_sched_fake, f->stack, g_stack_bytes);
#endif
    pl_cpu_switch(&g_sched_sp, f->sp);
#if PL_ASAN
    __sanitizer_finish_switch_fiber(g_sched_fake, nullptr, nullptr);
#endif
    g_cur = nullptr;
}

inline void fiber_main() {
    Fiber* f = g_cur;
#if PL_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &g_sched_stack_bottom, &g_sched_stack_size);
#endif
    g_body(g_body_ctx);
    f->state = DONE;
    switch_to_scheduler(f, true);  // never resumed
}

// Fiber stacks: PL_EMU_STACK_KB (default 256 KiB) each, mmap'ed once with a guard page, reused by every launch.
inline void ensure_fibers(int n) {
    if (g_stack_bytes == 0) {
        const char* kb = getenv("PL_EMU_STACK_KB");
        g_stack_bytes = (size_t)(kb ? atoi(kb) : 256) * 1024;
    }
    size_t have = g_fibers.size();
    if ((int)have >= n) return;
    g_fibers.resize(n);
    for (size_t i = have; i < (size_t)n; i++) {
        size_t page = 4096, total = g_stack_bytes + page;
        void* m = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) { g_fibers.resize(i); return; }
        mprotect(m, page, PROT_NONE);  // overflow faults instead of corrupting the neighbour
        g_fibers[i].stack = static_cast<char*>(m) + page;
    }
}

// The order in which runnable fibers run between barriers: PL_EMU_SCHEDULE=forward (default) | reverse |
// shuffle (seed PL_EMU_SEED). Running a kernel under two orders and comparing outputs finds shared-memory
// races: a read that is not separated from a write by a barrier sees a different value.
inline void schedule_order(std::vector<int>& order, int n, unsigned launch_no) {
    order.resize(n);
    for (int i = 0; i < n; i++) order[i] = i;
    const char* s = getenv("PL_EMU_SCHEDULE");
    if (!s || !strcmp(s, "forward")) return;
    if (!strcmp(s, "reverse")) { std::reverse(order.begin(), order.end()); return; }
    const char* seed_s = getenv("PL_EMU_SEED");
    uint64_t x = 0x9E3779B97F4A7C15ull ^ (uint64_t)(seed_s ? atoll(seed_s) : 1) ^ ((uint64_t)launch_no << 32);
    for (int i = n - 1; i > 0; i--) {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        std::swap(order[i], order[x % (uint64_t)(i + 1)]);
    }
}

// "thread (x,y,z) of block (x,y,z)" in a caller's buffer.
struct Who {
    char text[96];
    explicit Who(const Fiber& f) {
        snprintf(text, sizeof text, "thread (%u,%u,%u) of block (%u,%u,%u)", f.tid.x, f.tid.y, f.tid.z,
                 g_block_idx.x, g_block_idx.y, g_block_idx.z);
    }
};

// After a round in which no fiber could run: release a block barrier everyone reached, or report why not.
// Returns false when the block can never finish (the error is recorded).
inline bool release_or_report(int n) {
    int done = 0, at_sync = 0, at_warp = 0;
    const Fiber* first_sync = nullptr;
    const Fiber* first_done = nullptr;
    const Fiber* first_warp = nullptr;
    for (int i = 0; i < n; i++) {
        const Fiber& f = g_fibers[i];
        if (f.state == DONE) { done++; if (!first_done) first_done = &f; }
        if (f.state == AT_WARP) { at_warp++; if (!first_warp) first_warp = &f; }
        if (f.state == AT_SYNC) {
            at_sync++;
            if (!first_sync) first_sync = &f;
            else if (f.sync_line != first_sync->sync_line || strcmp(f.sync_file, first_sync->sync_file)) {
                fail(cudaErrorLaunchFailure, "divergent __syncthreads(): %s waits at %s:%d but %s waits at %s:%d",
                     Who(*first_sync).text, first_sync->sync_file, first_sync->sync_line, Who(f).text, f.sync_file,
                     f.sync_line);
                return false;
            }
        }
    }
    if (at_sync == n) {
        for (int i = 0; i < n; i++) g_fibers[i].state = RUNNABLE;
        return true;
    }
    if (at_sync && done)
        fail(cudaErrorLaunchFailure,
             "deadlock in block: %s waits at __syncthreads() (%s:%d) but %s has exited without reaching it "
             "(%d exited, %d waiting)",
             Who(*first_sync).text, first_sync->sync_file, first_sync->sync_line, Who(*first_done).text, done,
             at_sync);
    else if (at_warp)
        fail(cudaErrorLaunchFailure,
             "deadlock in block: %s waits at a warp operation that some lane named in its mask never reaches",
             Who(*first_warp).text);
    else
        fail(cudaErrorLaunchFailure, "deadlock in block: no thread can proceed");
    return false;
}

// Run one block to completion: every fiber runs until it blocks, then barriers are released, repeatedly.
PL_EMU_INTERNAL inline bool run_block(int n, const uint3& bdim, const std::vector<int>& order) {
    for (int i = 0; i < n; i++) {
        Fiber& f = g_fibers[i];
        f.linear = i;
        f.tid = {(unsigned)(i % bdim.x), (unsigned)((i / bdim.x) % bdim.y), (unsigned)(i / (bdim.x * bdim.y))};
        f.state = RUNNABLE;
        f.fake_stack = nullptr;
        // A fresh stack that "returns" into fiber_main: the six callee-saved registers pl_cpu_switch pops, the
        // address it returns to, and a null return address for fiber_main (so it starts 16-byte aligned).
        void** top = reinterpret_cast<void**>(f.stack + g_stack_bytes);
        top[-1] = nullptr;
        top[-2] = reinterpret_cast<void*>(&fiber_main);
        for (int r = 3; r <= 8; r++) top[-r] = nullptr;
        f.sp = top - 8;
    }
    int nwarps = (n + kWarp - 1) / kWarp;
    if ((int)g_warps.size() < nwarps) g_warps.resize(nwarps);
    for (int i = 0; i < nwarps; i++) {
        g_warps[i].arrived = 0;
        int lanes = std::min(kWarp, n - i * kWarp);
        g_warps[i].existing = lanes == kWarp ? 0xffffffffu : ((1u << lanes) - 1u);
    }
    for (;;) {
        for (int i : order) {
            if (g_fibers[i].state != RUNNABLE) continue;
            switch_to_fiber(&g_fibers[i]);
            if (g_launch_code != cudaSuccess) return false;  // a warp op reported misuse
        }
        int live = 0, runnable = 0;
        for (int i = 0; i < n; i++) {
            live += g_fibers[i].state != DONE;
            runnable += g_fibers[i].state == RUNNABLE;
        }
        if (live == 0) return true;
        if (!runnable && !release_or_report(n)) return false;
    }
}

inline size_t* smem_optin_slot(const void* fn) { return &g_smem_optin[fn]; }

inline bool check_config(const dim3& grid, const dim3& block, size_t smem, const void* fn) {
    unsigned long long nthreads = (unsigned long long)block.x * block.y * block.z;
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || nthreads == 0 || nthreads > (unsigned)kMaxThreads ||
        block.x > 1024 || block.y > 1024 || block.z > 64 || grid.y > 65535 || grid.z > 65535 ||
        grid.x > 2147483647u) {
        fail(cudaErrorInvalidConfiguration, "invalid configuration argument: grid (%u,%u,%u) block (%u,%u,%u)",
             grid.x, grid.y, grid.z, block.x, block.y, block.z);
        return false;
    }
    auto it = g_smem_optin.find(fn);
    size_t allowed = it == g_smem_optin.end() ? kDefaultSmem : std::max(kDefaultSmem, it->second);
    if (smem > allowed || smem > kMaxSmemOptin) {
        fail(cudaErrorInvalidConfiguration,
             "invalid configuration argument: %zu bytes of dynamic shared memory (limit %zu; above 48 KiB "
             "needs cudaFuncSetAttribute, and sm_75 allows at most 64 KiB)",
             smem, allowed < kMaxSmemOptin ? allowed : kMaxSmemOptin);
        return false;
    }
    return true;
}

// Run a whole grid: blocks in order x, then y, then z; stop at the first failing block.
inline void run_grid_locked(const void* fn, dim3 grid, dim3 block, size_t smem, void (*body)(void*), void* ctx) {
    static unsigned launch_no = 0;
    launch_no++;
    if (!check_config(grid, block, smem, fn)) return;
    int n = (int)(block.x * block.y * block.z);
    ensure_fibers(n);
    if ((int)g_fibers.size() < n) { fail(cudaErrorLaunchFailure, "cannot allocate fiber stacks"); return; }
    // Dynamic shared memory: heap, refilled with 0xff (NaN as fp16 and fp32) per block, redzones poisoned.
    if (smem + 2 * kSmemRedzone > g_dyn_smem_cap) {
        free(g_dyn_smem);
        g_dyn_smem_cap = smem + 2 * kSmemRedzone;
        g_dyn_smem = static_cast<unsigned char*>(aligned_alloc(64, (g_dyn_smem_cap + 63) / 64 * 64));
    }
    std::vector<int> order;
    schedule_order(order, n, launch_no);
    g_body = body;
    g_body_ctx = ctx;
    g_block_dim = {block.x, block.y, block.z};
    g_grid_dim = {grid.x, grid.y, grid.z};
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                g_block_idx = {bx, by, bz};
#if PL_ASAN
                ASAN_UNPOISON_MEMORY_REGION(g_dyn_smem, g_dyn_smem_cap);
#endif
                memset(g_dyn_smem, 0xff, g_dyn_smem_cap);
#if PL_ASAN
                ASAN_POISON_MEMORY_REGION(g_dyn_smem, kSmemRedzone);
                ASAN_POISON_MEMORY_REGION(g_dyn_smem + kSmemRedzone + smem, g_dyn_smem_cap - kSmemRedzone - smem);
#endif
                if (!run_block(n, g_block_dim, order)) {
#if PL_ASAN
                    // The abandoned fibers' frames are still poisoned; clean the stacks for the next launch.
                    for (Fiber& f : g_fibers) ASAN_UNPOISON_MEMORY_REGION(f.stack, g_stack_bytes);
#endif
                    return;
                }
            }
}

inline void run_grid(const void* fn, dim3 grid, dim3 block, size_t smem, void (*body)(void*), void* ctx) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_launch_code = cudaSuccess;
    run_grid_locked(fn, grid, block, smem, body, ctx);
    if (g_launch_code != cudaSuccess && g_error_code == cudaSuccess) {   // errors stay pending until read
        g_error_code = g_launch_code;
        memcpy(g_error, g_launch_msg, sizeof g_error);
    }
}

template <class Tuple, class Fn>
struct Closure {
    Fn fn;
    Tuple args;
    static void call(void* self) {
        Closure* c = static_cast<Closure*>(self);
        std::apply(c->fn, c->args);
    }
};

// PL_LAUNCH on the CPU: the arguments are converted to the kernel's parameter types once, as CUDA does.
template <class... P, class... A>
inline void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, A&&... args) {
    using Tuple = std::tuple<std::decay_t<P>...>;
    Closure<Tuple, void (*)(P...)> c{kernel, Tuple(std::forward<A>(args)...)};
    run_grid(reinterpret_cast<const void*>(kernel), grid, block, smem, &Closure<Tuple, void (*)(P...)>::call, &c);
}

// ---- Warp collectives ----
inline Fiber* self() { return g_cur; }

// Deposit this lane's inputs for op `op`; the last lane named in `mask` computes every lane's result.
PL_EMU_INTERNAL inline void warp_compute(Warp& w);

// Misuse of a warp operation: record it and abandon the launch (this fiber is never resumed).
__attribute__((noinline, cold)) inline void warp_misuse(Fiber* f, const Warp& w, int op, uint32_t mask, int width) {
    int lane = f->linear % kWarp;
    if (!(mask >> lane & 1u) || (mask & ~w.existing))
        fail(cudaErrorLaunchFailure, "%s: warp operation with mask 0x%08x %s lane %d (the warp has %d lanes)",
             Who(*f).text, mask, (mask >> lane & 1u) ? "names a missing lane; called from" : "does not name the calling",
             lane, __builtin_popcount(w.existing));
    else
        fail(cudaErrorLaunchFailure,
             "%s: divergent warp operation: lane %d calls op %d (mask 0x%08x, width %d) while op %d (mask 0x%08x, "
             "width %d) is pending",
             Who(*f).text, lane, op, mask, width, w.op, w.mask, w.width);
    switch_to_scheduler(f, false);
}

// The layer's own bookkeeping is trusted: not instrumented by ASan (the kernels are), which halves its cost.
PL_EMU_INTERNAL inline Lane& warp_collective(int op, uint32_t mask, int arg, int width, const uint32_t* in, int nin,
                                             const void* ptr) {
    Fiber* f = self();
    int warp_no = f->linear / kWarp, lane = f->linear % kWarp;
    Warp& w = g_warps[warp_no];
    if (!(mask >> lane & 1u) || (mask & ~w.existing)) warp_misuse(f, w, op, mask, width);
    if (w.arrived == 0) {
        w.mask = mask; w.op = op; w.arg = arg; w.width = width;
    } else if (w.mask != mask || w.op != op || w.width != width) {
        warp_misuse(f, w, op, mask, width);
    }
    Lane& me = w.lane[lane];
    for (int i = 0; i < nin; i++) me.in[i] = in[i];
    me.ptr = ptr;
    me.arg = arg;
    w.arrived |= 1u << lane;
    if (w.arrived == mask) {
        warp_compute(w);
        for (int l = 0; l < kWarp; l++)
            if (mask >> l & 1u) g_fibers[warp_no * kWarp + l].state = RUNNABLE;
        w.arrived = 0;
        f->state = RUNNABLE;
    } else {
        f->state = AT_WARP;
        switch_to_scheduler(f, false);
    }
    return me;
}

PL_EMU_INTERNAL inline void warp_shfl_results(Warp& w) {
    int width = w.width;
    for (int l = 0; l < kWarp; l++) {
        if (!(w.mask >> l & 1u)) continue;
        int base = l & ~(width - 1), src = l;
        switch (w.op) {
            case W_SHFL: src = base + (w.lane[l].arg & (width - 1)); break;
            case W_SHFL_UP: src = (l - base) - w.lane[l].arg < 0 ? l : l - w.lane[l].arg; break;
            case W_SHFL_DOWN: src = (l - base) + w.lane[l].arg >= width ? l : l + w.lane[l].arg; break;
            case W_SHFL_XOR: src = l ^ w.lane[l].arg; if (src >= base + width) src = l; break;
        }
        if (!(w.mask >> src & 1u)) {
            fail(cudaErrorLaunchFailure, "shuffle: lane %d reads lane %d, which is not in the mask 0x%08x", l, src,
                 w.mask);
            src = l;
        }
        w.lane[l].out[0] = w.lane[src].in[0];
        w.lane[l].out[1] = w.lane[src].in[1];
    }
}

// fp16 <-> fp32 on raw bits, for the fragment arithmetic below.
inline float half_bits_to_float(uint16_t h) { _Float16 v; memcpy(&v, &h, 2); return (float)v; }

// mma.m16n8k8.row.col f32.f16.f16.f32, PTX ISA fragment layout, with g = lane / 4 and t = lane % 4:
//   A (16x8): a[0] = {A[g][2t], A[g][2t+1]}, a[1] = {A[g+8][2t], A[g+8][2t+1]} (low half first)
//   B (8x8):  b    = {B[2t][g], B[2t+1][g]}
//   C, D (16x8 f32): c[0..1] = C[g][2t..2t+1], c[2..3] = C[g+8][2t..2t+1]
PL_EMU_INTERNAL inline void warp_mma_results(Warp& w) {
    float A[16][8], B[8][8], C[16][8];
    for (int l = 0; l < kWarp; l++) {
        const uint32_t* in = w.lane[l].in;
        int g = l / 4, t = l % 4;
        for (int h = 0; h < 2; h++) {
            A[g][2 * t + h] = half_bits_to_float((uint16_t)(in[0] >> (16 * h)));
            A[g + 8][2 * t + h] = half_bits_to_float((uint16_t)(in[1] >> (16 * h)));
            B[2 * t + h][g] = half_bits_to_float((uint16_t)(in[2] >> (16 * h)));
            float c0, c1;
            memcpy(&c0, &in[3 + h], 4);
            memcpy(&c1, &in[5 + h], 4);
            C[g][2 * t + h] = c0;
            C[g + 8][2 * t + h] = c1;
        }
    }
    for (int l = 0; l < kWarp; l++) {
        int g = l / 4, t = l % 4;
        for (int i = 0; i < 4; i++) {
            int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
            float acc = C[row][col];  // products of fp16 values are exact in fp32
            for (int k = 0; k < 8; k++) acc += A[row][k] * B[k][col];
            memcpy(&w.lane[l].out[i], &acc, 4);
        }
    }
}

// ldmatrix.m8n8.b16: lanes 8i..8i+7 give the 8 row addresses (16 bytes each) of matrix i; every lane receives,
// per matrix i, r[i] = {M_i[lane/4][2(lane%4)], M_i[lane/4][2(lane%4)+1]}; .trans: {M_i[2(lane%4)][lane/4],
// M_i[2(lane%4)+1][lane/4]}. arg = number of matrices (1, 2, 4); width = 1 for .trans.
inline void warp_ldmatrix_results(Warp& w) {
    int nmat = w.arg;
    bool trans = w.width == 1;
    for (int l = 0; l < kWarp; l++) {
        int r = l / 4, c = 2 * (l % 4);
        for (int i = 0; i < nmat; i++) {
            uint16_t v[2];
            for (int h = 0; h < 2; h++) {
                int row = trans ? c + h : r, col = trans ? r : c + h;
                memcpy(&v[h], static_cast<const char*>(w.lane[8 * i + row].ptr) + 2 * col, 2);
            }
            w.lane[l].out[i] = (uint32_t)v[0] | ((uint32_t)v[1] << 16);
        }
    }
}

PL_EMU_INTERNAL inline void warp_compute(Warp& w) {
    switch (w.op) {
        case W_SYNC: break;
        case W_SHFL: case W_SHFL_UP: case W_SHFL_DOWN: case W_SHFL_XOR: warp_shfl_results(w); break;
        case W_BALLOT: case W_ANY: case W_ALL: {
            uint32_t bits = 0;
            for (int l = 0; l < kWarp; l++)
                if ((w.mask >> l & 1u) && w.lane[l].in[0]) bits |= 1u << l;
            uint32_t r = w.op == W_BALLOT ? bits : w.op == W_ANY ? (bits != 0) : (bits == w.mask);
            for (int l = 0; l < kWarp; l++) w.lane[l].out[0] = r;
            break;
        }
        case W_MMA: warp_mma_results(w); break;
        case W_LDM: warp_ldmatrix_results(w); break;
    }
}

template <class T>
inline T shfl(int op, uint32_t mask, T v, int arg, int width) {
    static_assert(sizeof(T) <= 8, "warp shuffles move at most 8 bytes");
    if (width < 1 || width > kWarp || (width & (width - 1))) {
        fail(cudaErrorLaunchFailure, "%s: shuffle width %d is not a power of two in 1..32", Who(*self()).text, width);
        switch_to_scheduler(self(), false);
    }
    uint32_t in[2] = {0, 0};
    memcpy(in, &v, sizeof(T));
    Lane& me = warp_collective(op, mask, arg, width, in, 2, nullptr);
    T r;
    memcpy(&r, me.out, sizeof(T));
    return r;
}

inline void sync_block(const char* file, int line) {
    Fiber* f = self();
    f->state = AT_SYNC;
    f->sync_file = file;
    f->sync_line = line;
    switch_to_scheduler(f, false);
}

inline unsigned char* dyn_smem() { return g_dyn_smem + kSmemRedzone; }

}  // namespace pl_cpu

// ---- The CUDA names kernels use ----
#define threadIdx (pl_cpu::self()->tid)
#define blockIdx (pl_cpu::g_block_idx)
#define blockDim (pl_cpu::g_block_dim)
#define gridDim (pl_cpu::g_grid_dim)
#define warpSize 32

#define PL_LAUNCH(kernel, grid, block, smem, stream, ...) \
    ((void)(stream), pl_count_launch() ? pl_cpu::launch(kernel, dim3(grid), dim3(block), (size_t)(smem), __VA_ARGS__) \
                                       : (void)0)
#define PL_DYN_SMEM(T, name) T* name = reinterpret_cast<T*>(pl_cpu::dyn_smem())

#define __syncthreads() pl_cpu::sync_block(__FILE__, __LINE__)
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    pl_cpu::warp_collective(pl_cpu::W_SYNC, mask, 0, 32, nullptr, 0, nullptr);
}
template <class T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    return pl_cpu::shfl(pl_cpu::W_SHFL, mask, v, src, width);
}
template <class T> inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    return pl_cpu::shfl(pl_cpu::W_SHFL_UP, mask, v, (int)d, width);
}
template <class T> inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    return pl_cpu::shfl(pl_cpu::W_SHFL_DOWN, mask, v, (int)d, width);
}
template <class T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return pl_cpu::shfl(pl_cpu::W_SHFL_XOR, mask, v, lane_mask, width);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
    uint32_t in = pred != 0;
    return pl_cpu::warp_collective(pl_cpu::W_BALLOT, mask, 0, 32, &in, 1, nullptr).out[0];
}
inline int __any_sync(unsigned mask, int pred) {
    uint32_t in = pred != 0;
    return (int)pl_cpu::warp_collective(pl_cpu::W_ANY, mask, 0, 32, &in, 1, nullptr).out[0];
}
inline int __all_sync(unsigned mask, int pred) {
    uint32_t in = pred != 0;
    return (int)pl_cpu::warp_collective(pl_cpu::W_ALL, mask, 0, 32, &in, 1, nullptr).out[0];
}

// Fibers are cooperative and switch only at barriers, so a read-modify-write is atomic here.
template <class T> inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <class T> inline T atomicMax(T* p, T v) { T old = *p; *p = old > v ? old : v; return old; }
template <class T> inline T atomicMin(T* p, T v) { T old = *p; *p = old < v ? old : v; return old; }
template <class T> inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
inline unsigned atomicCAS(unsigned* p, unsigned cmp, unsigned v) { unsigned old = *p; if (old == cmp) *p = v; return old; }
inline int atomicCAS(int* p, int cmp, int v) { int old = *p; if (old == cmp) *p = v; return old; }
inline void __threadfence() {}
inline void __threadfence_block() {}

// Device math with host meanings.
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : x > 1.f ? 1.f : x; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
template <class T> inline T __ldg(const T* p) { return *p; }
template <class A, class B> inline auto min(A a, B b) -> decltype(a < b ? a : b) { return a < b ? a : b; }
template <class A, class B> inline auto max(A a, B b) -> decltype(a < b ? a : b) { return a < b ? b : a; }

// The runtime API calls the library may make. Memory always comes from the caller, so there is no malloc.
inline cudaError_t cudaGetLastError() {
    cudaError_t e = pl_cpu::g_error_code;
    if (e != cudaSuccess) memcpy(pl_cpu::g_error_text, pl_cpu::g_error, sizeof pl_cpu::g_error_text);
    pl_cpu::g_error_code = cudaSuccess;
    pl_cpu::g_error[0] = 0;
    return e;
}
inline cudaError_t cudaPeekAtLastError() { return pl_cpu::g_error_code; }
inline const char* cudaGetErrorString(cudaError_t e) {
    switch (e) {
        case cudaSuccess: return "no error";
        case cudaErrorInvalidValue: return "invalid argument";
        case cudaErrorNoDevice: return "no CUDA-capable device is detected";
        case cudaErrorInvalidConfiguration:
        case cudaErrorLaunchFailure:
            return pl_cpu::g_error_text[0] ? pl_cpu::g_error_text : "unspecified launch failure";
        default: return "unknown error (CPU execution layer)";
    }
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t = 0) { memset(p, v, n); return cudaSuccess; }
inline cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t = 0) {
    memmove(d, s, n);
    return cudaSuccess;
}
inline cudaError_t cudaGetDevice(int* d) { *d = 0; return cudaSuccess; }
// The emulated runtime stands for CUDA 13.0. The driver's CUDA version is PL_EMU_DRIVER_VERSION (default: the
// same), a hook of this test build only: it simulates an old driver so that the refusal is testable.
#define CUDART_VERSION 13000
inline cudaError_t cudaDriverGetVersion(int* v) {
    const char* s = getenv("PL_EMU_DRIVER_VERSION");
    *v = s ? atoi(s) : CUDART_VERSION;
    return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) {
    switch (a) {
        case cudaDevAttrMaxSharedMemoryPerBlock: *v = (int)pl_cpu::kDefaultSmem; return cudaSuccess;
        case cudaDevAttrMaxSharedMemoryPerBlockOptin: *v = (int)pl_cpu::kMaxSmemOptin; return cudaSuccess;
        case cudaDevAttrMultiProcessorCount: *v = 68; return cudaSuccess;  // an RTX 2080 Ti
        case cudaDevAttrComputeCapabilityMajor: *v = 7; return cudaSuccess;
        case cudaDevAttrComputeCapabilityMinor: *v = 5; return cudaSuccess;
    }
    return cudaErrorInvalidValue;
}
template <class... P>
inline cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0) return cudaErrorInvalidValue;
    if ((size_t)value > pl_cpu::kMaxSmemOptin) return cudaErrorInvalidValue;
    *pl_cpu::smem_optin_slot(reinterpret_cast<const void*>(kernel)) = (size_t)value;
    return cudaSuccess;
}

// ---- fp16 (IEEE binary16 through the compiler's _Float16: conversions round to nearest even) ----
typedef _Float16 pl_half;
struct __align__(4) pl_half2 { pl_half x, y; };

inline float pl_h2f(pl_half h) { return (float)h; }
inline pl_half pl_f2h(float f) { return (pl_half)f; }
inline pl_half2 pl_make_half2(pl_half x, pl_half y) { return {x, y}; }
inline uint32_t pl_half2_bits(pl_half2 h) { uint32_t u; memcpy(&u, &h, 4); return u; }
inline pl_half2 pl_bits_half2(uint32_t u) { pl_half2 h; memcpy(&h, &u, 4); return h; }
inline float pl_bits_float(uint32_t u) { return __uint_as_float(u); }
inline uint32_t pl_float_bits(float f) { return __float_as_uint(f); }

// ---- Tensor cores: called by all 32 lanes of a warp together, like the instructions ----
inline void pl_mma_m16n8k8(float d[4], const uint32_t a[2], uint32_t b, const float c[4]) {
    uint32_t in[7] = {a[0], a[1], b, 0, 0, 0, 0};
    memcpy(&in[3], c, 16);
    pl_cpu::Lane& me = pl_cpu::warp_collective(pl_cpu::W_MMA, 0xffffffffu, 0, 32, in, 7, nullptr);
    memcpy(d, me.out, 16);
}
inline void pl_ldmatrix_n(uint32_t* r, const void* row, int nmat, bool trans) {
    pl_cpu::Lane& me = pl_cpu::warp_collective(pl_cpu::W_LDM, 0xffffffffu, nmat, trans ? 1 : 0, nullptr, 0, row);
    memcpy(r, me.out, 4 * nmat);
}
inline void pl_ldmatrix_x4(uint32_t r[4], const void* p) { pl_ldmatrix_n(r, p, 4, false); }
inline void pl_ldmatrix_x2(uint32_t r[2], const void* p) { pl_ldmatrix_n(r, p, 2, false); }
inline void pl_ldmatrix_x4_trans(uint32_t r[4], const void* p) { pl_ldmatrix_n(r, p, 4, true); }
inline void pl_ldmatrix_x2_trans(uint32_t r[2], const void* p) { pl_ldmatrix_n(r, p, 2, true); }

#endif  // __CUDACC__

// =========================================================================================================
// Both builds: bf16 and fp8 conversions written once on bit patterns.
// =========================================================================================================

// bf16 is the top half of an fp32.
__device__ __forceinline__ float pl_bf2f(uint16_t b) { return pl_bits_float((uint32_t)b << 16); }
// fp32 -> bf16 bits, round to nearest even (NaN stays NaN).
__device__ __forceinline__ uint16_t pl_f2bf(float f) {
    uint32_t u = pl_float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// e4m3 (float8_e4m3fn): sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities; 0x7f/0xff are NaN.
__device__ __forceinline__ float pl_e4m3_to_float(uint8_t v) {
    uint32_t sign = (uint32_t)(v & 0x80) << 24, e = (v >> 3) & 0xf, m = v & 0x7;
    if (e == 0xf && m == 0x7) return pl_bits_float(0x7fc00000u | sign);
    if (e == 0) return (sign ? -1.0f : 1.0f) * (float)m * 0.001953125f;  // subnormal: m/8 * 2^-6
    return pl_bits_float(sign | ((e + 120u) << 23) | (m << 20));        // rebias 7 -> 127
}

// Two e4m3 bytes (low byte -> .x, high byte -> .y) to fp16 in four integer ops: each byte's sign goes to bit 15
// and its other 7 bits to bits 13..7, which reads as an fp16 of exactly (e4m3 value) * 2^-8, subnormals
// included. The caller folds the 2^8 into the block scale. NaN bytes (0x7f/0xff) are NOT preserved (they read
// as +-480 * 2^-8); FP8 checkpoints contain none.
__device__ __forceinline__ pl_half2 pl_e4m3x2_to_half2(uint16_t two_fp8) {
    uint32_t v = ((uint32_t)two_fp8 & 0xffu) | (((uint32_t)two_fp8 & 0xff00u) << 8);
    return pl_bits_half2(((v & 0x00800080u) << 8) | ((v & 0x007f007fu) << 7));
}
