// runtime.cu: the library's own plumbing: ABI version, last-error buffer, device query, NCCL loaded at run time.
#include "pocketllm.h"
#include "runtime.cuh"

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

// ---------------------------------------------------------------------------------------------------------
// The last error, one line per host thread: "function (file:line): what: why".
// ---------------------------------------------------------------------------------------------------------

static thread_local char g_last_error[2048];

static const char* base_name(const char* path) {
    const char* slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

void pl_set_error(const char* func, const char* file, int line, const char* what, const char* detail) {
    snprintf(g_last_error, sizeof g_last_error, "%s (%s:%d): %s: %s", func, base_name(file), line, what, detail);
}

void pl_set_errorf(const char* func, const char* file, int line, const char* fmt, ...) {
    char msg[1536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(g_last_error, sizeof g_last_error, "%s (%s:%d): %s", func, base_name(file), line, msg);
}

extern "C" const char* pl_last_error(void) { return g_last_error; }
extern "C" int32_t pl_abi_version(void) { return PL_ABI_VERSION; }
extern "C" int32_t pl_is_cpu_build(void) { return PL_CPU_EMU; }

extern "C" int pl_launch_count(uint64_t* count) {
    PL_REQUIRE(count, "count must not be NULL");
    *count = pl_launch_counter.load();
    return 0;
}

extern "C" int pl_set_skip_kernels(int32_t skip) {
    pl_skip_kernels_flag.store(skip ? 1 : 0);
    return 0;
}

// ---------------------------------------------------------------------------------------------------------
// Devices. The CUDA runtime is linked statically and finds the driver itself, so loading the library never
// fails for want of a GPU; this query is where that shows. A runtime of CUDA major version M runs on any driver
// that supports M.0 or newer (minor version compatibility), so the driver is checked against the runtime's major
// version and refused in one line naming the oldest driver that would do.
// ---------------------------------------------------------------------------------------------------------

// The oldest Linux driver of each CUDA major version (CUDA release notes, "minor version compatibility").
static const char* min_driver(int cuda_major) {
    switch (cuda_major) {
        case 11: return "450.80.02";
        case 12: return "525.60.13";
        case 13: return "580.65.06";
        default: return "one supporting it";
    }
}

extern "C" int pl_cuda_versions(int32_t* driver_version, int32_t* runtime_version) {
    int driver = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess) {   // no driver at all reads as 0
        cudaGetLastError();                               // not sticky; clear it for the next launch check
        driver = 0;
    }
    *driver_version = driver;
    *runtime_version = CUDART_VERSION;
    return 0;
}

extern "C" int pl_device_count(int32_t* count) {
    *count = 0;
    int32_t driver = 0, runtime = 0;
    pl_cuda_versions(&driver, &runtime);
    if (driver != 0 && driver / 1000 < runtime / 1000)
        PL_FAIL("no usable GPU: the NVIDIA driver supports CUDA %d.%d, but this library carries the CUDA %d.%d "
                "runtime, which needs driver %s or newer: update the driver, or build the library with a CUDA "
                "%d.x toolkit (python build.py --nvcc PATH; docs/abi.md)",
                driver / 1000, driver % 1000 / 10, runtime / 1000, runtime % 1000 / 10, min_driver(runtime / 1000),
                driver / 1000);
#if PL_CPU_EMU
    PL_FAIL("this is the CPU test build (libpocketllm_cpu.so): its kernels run on host memory, not on a GPU");
#else
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaErrorInsufficientDriver || e == cudaErrorNoDevice) {
        cudaGetLastError();  // not sticky; clear it
        PL_FAIL("no usable GPU: %s (this library carries the CUDA %d.%d runtime; it needs an NVIDIA GPU and "
                "driver %s or newer)",
                cudaGetErrorString(e), runtime / 1000, runtime % 1000 / 10, min_driver(runtime / 1000));
    }
    PL_CHECK(e);
    *count = n;
    return 0;
#endif
}

extern "C" int pl_device_capability(int32_t device, int32_t* major, int32_t* minor) {
    int ma = 0, mi = 0;
    PL_CHECK(cudaDeviceGetAttribute(&ma, cudaDevAttrComputeCapabilityMajor, device));
    PL_CHECK(cudaDeviceGetAttribute(&mi, cudaDevAttrComputeCapabilityMinor, device));
    *major = ma;
    *minor = mi;
    return 0;
}

extern "C" int pl_set_device(int32_t device) {
#if PL_CPU_EMU
    PL_REQUIRE(device == 0, "the CPU test build has only device 0, not %d", device);
#else
    PL_CHECK(cudaSetDevice(device));
#endif
    return 0;
}

// ---------------------------------------------------------------------------------------------------------
// NCCL, opened with dlopen on first use: one binary serves machines with and without NCCL, and the library
// can say exactly why tensor parallelism is unavailable instead of failing to load. The few NCCL types we
// need are declared here from nccl.h (NCCL 2.x; these values are part of its stable ABI).
//
// No wait on a peer is unbounded. A communicator is created non-blocking (ncclConfig_t.blocking = 0) and
// pl_nccl_init polls ncclCommGetAsyncError until it is ready; pl_nccl_wait polls an event recorded after the
// step's collectives and the async error. An error or the timeout aborts the communicator (ncclCommAbort), so
// a dead or hung peer ends in an error with NCCL's text or the timeout, never in a spinning kernel.
//
// The CPU test build has no GPU NCCL; it loads only a test NCCL (tests/fake_nccl.c, marked by the symbol
// pl_fake_nccl) so that these polling and abort paths run in CI. Its kernels run synchronously, so there the
// step's event is always complete and only NCCL's own state (init in progress, an async error) is polled.
// ---------------------------------------------------------------------------------------------------------

typedef int ncclResult_t;  // ncclSuccess = 0
typedef struct ncclComm* ncclComm_t;
typedef struct { char internal[PL_NCCL_ID_BYTES]; } ncclUniqueId;
enum { ncclFloat16 = 6, ncclFloat32 = 7 };  // ncclDataType_t
enum { ncclSum = 0 };                       // ncclRedOp_t
enum { ncclInProgress = 7 };                // ncclResult_t: a non-blocking call still running

// ncclConfig_t's leading fields as of NCCL 2.14 (the first with non-blocking communicators). NCCL reads a
// config by its `size` and `version`, so a newer NCCL takes this shorter one and defaults the rest.
struct ncclConfigV214 {
    size_t size;
    unsigned int magic;    // 0xcafebeef
    unsigned int version;  // NCCL_VERSION(2, 14, 0)
    int blocking, cgaClusterSize, minCTAs, maxCTAs;
    const char* netName;
};
static const int kNcclUndefInt = (int)0x80000000;  // NCCL_CONFIG_UNDEF_INT: "use the default"
static const int kNcclMinVersion = 21400;          // 2.14.0: ncclCommInitRankConfig with blocking = 0

struct NcclApi {
    void* handle = nullptr;
    ncclResult_t (*GetVersion)(int*);
    ncclResult_t (*GetUniqueId)(ncclUniqueId*);
    ncclResult_t (*CommInitRankConfig)(ncclComm_t*, int, ncclUniqueId, int, ncclConfigV214*);
    ncclResult_t (*AllReduce)(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*);
    ncclResult_t (*CommAbort)(ncclComm_t);
    ncclResult_t (*CommDestroy)(ncclComm_t);
    const char* (*GetErrorString)(ncclResult_t);
    const char* (*GetLastError)(ncclComm_t);  // NCCL >= 2.13; may be absent
};
static NcclApi g_nccl;

// Check an NCCL call: record the NCCL error text and return -1.
#define PL_NCCL_CHECK(call)                                                                         \
    do {                                                                                            \
        ncclResult_t pl_nccl_status_ = (call);                                                      \
        if (pl_nccl_status_ != 0) {                                                                 \
            pl_set_error(__func__, __FILE__, __LINE__, #call, g_nccl.GetErrorString(pl_nccl_status_)); \
            return -1;                                                                              \
        }                                                                                           \
    } while (0)

#define PL_NCCL_REQUIRE_LOADED() \
    PL_REQUIRE(g_nccl.handle, "NCCL is not loaded: call pl_nccl_load first (it says why NCCL is unusable)")

extern "C" int pl_nccl_load(const char* path) {
    if (g_nccl.handle) return 0;
#if PL_CPU_EMU
    PL_REQUIRE(path && path[0], "NCCL is not available in the CPU test build");
#endif
    const char* name = path && path[0] ? path : "libnccl.so.2";
    void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    PL_REQUIRE(h, "cannot load NCCL (%s): %s; install the nvidia-nccl-cu13 wheel or set NCCL_ROOT", name, dlerror());
#if PL_CPU_EMU
    if (!dlsym(h, "pl_fake_nccl")) {
        dlclose(h);
        PL_FAIL("NCCL is not available in the CPU test build (%s is not the test NCCL, tests/fake_nccl.c)", name);
    }
#endif
    NcclApi api;
    api.handle = h;
    const char* missing = nullptr;
#define PL_NCCL_SYM(field, sym) \
    if (!(*reinterpret_cast<void**>(&api.field) = dlsym(h, sym)) && !missing) missing = sym
    PL_NCCL_SYM(GetVersion, "ncclGetVersion");
    PL_NCCL_SYM(GetUniqueId, "ncclGetUniqueId");
    PL_NCCL_SYM(CommInitRankConfig, "ncclCommInitRankConfig");
    PL_NCCL_SYM(AllReduce, "ncclAllReduce");
    PL_NCCL_SYM(CommGetAsyncError, "ncclCommGetAsyncError");
    PL_NCCL_SYM(CommAbort, "ncclCommAbort");
    PL_NCCL_SYM(CommDestroy, "ncclCommDestroy");
    PL_NCCL_SYM(GetErrorString, "ncclGetErrorString");
#undef PL_NCCL_SYM
    *reinterpret_cast<void**>(&api.GetLastError) = dlsym(h, "ncclGetLastError");
    if (missing) {
        dlclose(h);
        PL_FAIL("%s is not a usable NCCL library: symbol %s is missing (NCCL 2.14 or newer is required)", name,
                missing);
    }
    int version = 0;
    if (api.GetVersion(&version) != 0 || version < kNcclMinVersion) {
        dlclose(h);
        PL_FAIL("%s reports NCCL version %d; NCCL 2.14 (21400) or newer is required", name, version);
    }
    g_nccl = api;
    return 0;
}

extern "C" int pl_nccl_version(int32_t* version) {
    PL_NCCL_REQUIRE_LOADED();
    int v = 0;
    PL_NCCL_CHECK(g_nccl.GetVersion(&v));
    *version = v;
    return 0;
}

extern "C" int pl_nccl_unique_id(uint8_t* id_out) {
    PL_NCCL_REQUIRE_LOADED();
    ncclUniqueId id;
    PL_NCCL_CHECK(g_nccl.GetUniqueId(&id));
    memcpy(id_out, id.internal, PL_NCCL_ID_BYTES);
    return 0;
}

// A communicator as the library hands it out: NCCL's, and the event pl_nccl_wait records after a step.
struct PlComm {
    ncclComm_t comm = nullptr;
#if !PL_CPU_EMU
    cudaEvent_t done = nullptr;
#endif
};

static double now_s() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

// The NCCL text of a failed communicator: its last error line when NCCL has one, else the code's string.
static const char* nccl_error_text(ncclComm_t comm, ncclResult_t code) {
    const char* last = g_nccl.GetLastError ? g_nccl.GetLastError(comm) : nullptr;
    return last && last[0] ? last : g_nccl.GetErrorString(code);
}

// Abort comm (ncclCommAbort frees it and wakes its kernels) and record why; returns -1.
#define PL_NCCL_ABORT(comm, ...)                                                                    \
    do {                                                                                            \
        ncclResult_t pl_abort_status_ = g_nccl.CommAbort(comm);                                     \
        char pl_abort_why_[1024];                                                                   \
        snprintf(pl_abort_why_, sizeof pl_abort_why_, __VA_ARGS__);                                 \
        if (pl_abort_status_ != 0)                                                                  \
            PL_FAIL("%s; ncclCommAbort failed too: %s", pl_abort_why_, g_nccl.GetErrorString(pl_abort_status_)); \
        PL_FAIL("%s; the communicator is aborted", pl_abort_why_);                                  \
    } while (0)

// Poll comm's async error until it leaves ncclInProgress (a non-blocking call's state), for at most
// `deadline`. 0: ready; -1: failed or timed out, the communicator aborted and the reason recorded.
static int nccl_poll_ready(ncclComm_t comm, double deadline, double timeout_s, const char* what) {
    for (;;) {
        ncclResult_t state = ncclInProgress;
        ncclResult_t got = g_nccl.CommGetAsyncError(comm, &state);
        if (got != 0) state = got;
        if (state == 0) return 0;
        if (state != ncclInProgress) PL_NCCL_ABORT(comm, "%s failed: %s", what, nccl_error_text(comm, state));
        if (now_s() > deadline)
            PL_NCCL_ABORT(comm, "%s did not complete within %g s (a rank is dead or hung)", what, timeout_s);
        usleep(200);
    }
}

extern "C" int pl_nccl_init(const uint8_t* id, int32_t nranks, int32_t rank, int32_t device, double timeout_s,
                            uint64_t* comm_out) {
    PL_NCCL_REQUIRE_LOADED();
    PL_REQUIRE(nranks >= 1 && rank >= 0 && rank < nranks, "bad rank %d of %d ranks", rank, nranks);
    PL_REQUIRE(timeout_s > 0, "the NCCL initialisation timeout must be > 0 s, got %g", timeout_s);
    ncclUniqueId uid;
    memcpy(uid.internal, id, PL_NCCL_ID_BYTES);
#if !PL_CPU_EMU
    PL_CHECK(cudaSetDevice(device));  // NCCL binds the communicator to the current device
#else
    (void)device;
#endif
    double deadline = now_s() + timeout_s;
    ncclConfigV214 config = {sizeof(ncclConfigV214), 0xcafebeef, (unsigned)kNcclMinVersion, 0,
                             kNcclUndefInt, kNcclUndefInt, kNcclUndefInt, nullptr};
    ncclComm_t comm = nullptr;
    ncclResult_t started = g_nccl.CommInitRankConfig(&comm, nranks, uid, rank, &config);
    if (started != 0 && started != ncclInProgress) {
        if (comm) PL_NCCL_ABORT(comm, "ncclCommInitRankConfig failed: %s", nccl_error_text(comm, started));
        PL_FAIL("ncclCommInitRankConfig failed: %s", g_nccl.GetErrorString(started));
    }
    if (nccl_poll_ready(comm, deadline, timeout_s, "ncclCommInitRank") != 0) return -1;
    PlComm* handle = new PlComm;
    handle->comm = comm;
#if !PL_CPU_EMU
    cudaError_t made = cudaEventCreateWithFlags(&handle->done, cudaEventDisableTiming);
    if (made != cudaSuccess) {
        delete handle;
        PL_NCCL_ABORT(comm, "cudaEventCreateWithFlags failed: %s", cudaGetErrorString(made));
    }
#endif
    *comm_out = (uint64_t)(uintptr_t)handle;
    return 0;
}

static PlComm* pl_comm(uint64_t handle) { return reinterpret_cast<PlComm*>((uintptr_t)handle); }

extern "C" int pl_nccl_all_reduce_sum(uint64_t comm, uint64_t ptr, uint64_t count, int32_t dtype, uint64_t stream) {
    PL_NCCL_REQUIRE_LOADED();
    PL_REQUIRE(comm && pl_comm(comm)->comm, "null or aborted NCCL communicator");
    PL_REQUIRE(dtype == PL_F16 || dtype == PL_F32, "all-reduce supports fp16 and fp32, not dtype %d", dtype);
    void* p = PL_PTR(void, ptr);
    ncclComm_t c = pl_comm(comm)->comm;
    ncclResult_t got = g_nccl.AllReduce(p, p, (size_t)count, dtype == PL_F16 ? ncclFloat16 : ncclFloat32, ncclSum,
                                        c, (cudaStream_t)(uintptr_t)stream);
    if (got == ncclInProgress) {   // a non-blocking communicator still enqueueing: wait for that (not the sum)
        if (nccl_poll_ready(c, now_s() + 60.0, 60.0, "enqueueing ncclAllReduce") != 0) {
            pl_comm(comm)->comm = nullptr;
            return -1;
        }
    } else if (got != 0) {
        pl_comm(comm)->comm = nullptr;
        PL_NCCL_ABORT(c, "ncclAllReduce failed: %s", nccl_error_text(c, got));
    }
    return 0;
}

extern "C" int pl_nccl_wait(uint64_t comm, uint64_t stream, double timeout_s) {
    PL_NCCL_REQUIRE_LOADED();
    PL_REQUIRE(comm && pl_comm(comm)->comm, "null or aborted NCCL communicator");
    PL_REQUIRE(timeout_s > 0, "the NCCL wait timeout must be > 0 s, got %g", timeout_s);
    PlComm* h = pl_comm(comm);
    double deadline = now_s() + timeout_s;
#if !PL_CPU_EMU
    PL_CHECK(cudaEventRecord(h->done, (cudaStream_t)(uintptr_t)stream));
    for (;;) {
        cudaError_t q = cudaEventQuery(h->done);
        if (q == cudaSuccess) break;
        if (q != cudaErrorNotReady) PL_CHECK(q);
        ncclResult_t state = 0;
        ncclResult_t got = g_nccl.CommGetAsyncError(h->comm, &state);
        if (got != 0) state = got;
        ncclComm_t c = h->comm;
        if (state != 0 && state != ncclInProgress) {
            h->comm = nullptr;
            PL_NCCL_ABORT(c, "an NCCL all-reduce failed: %s", nccl_error_text(c, state));
        }
        if (now_s() > deadline) {
            h->comm = nullptr;
            PL_NCCL_ABORT(c, "the NCCL all-reduces did not complete within %g s (a rank is dead or hung)", timeout_s);
        }
        usleep(50);
    }
#else
    (void)stream;   // the CPU build's kernels have run: only NCCL's own state is left to poll
#endif
    ncclComm_t c = h->comm;
    if (nccl_poll_ready(c, deadline, timeout_s, "the NCCL all-reduces") != 0) {
        h->comm = nullptr;
        return -1;
    }
    return 0;
}

extern "C" int pl_nccl_abort(uint64_t comm) {
    PL_NCCL_REQUIRE_LOADED();
    PL_REQUIRE(comm, "null NCCL communicator");
    PlComm* h = pl_comm(comm);
    ncclComm_t c = h->comm;
    h->comm = nullptr;
    if (c) PL_NCCL_CHECK(g_nccl.CommAbort(c));
    return 0;
}

extern "C" int pl_nccl_destroy(uint64_t comm) {
    PL_NCCL_REQUIRE_LOADED();
    PL_REQUIRE(comm, "null NCCL communicator");
    PlComm* h = pl_comm(comm);
    ncclComm_t c = h->comm;
#if !PL_CPU_EMU
    cudaError_t event_gone = h->done ? cudaEventDestroy(h->done) : cudaSuccess;
#endif
    delete h;           // an aborted communicator (c == NULL) was freed by ncclCommAbort
    if (c) PL_NCCL_CHECK(g_nccl.CommDestroy(c));
#if !PL_CPU_EMU
    PL_CHECK(event_gone);
#endif
    return 0;
}

#if PL_ASAN
// The CPU build is usually dlopen'ed into a running python, where the ASan runtime cannot come first in the
// library list; this hook lets it start anyway (heap checks then need LD_PRELOAD, see build.py).
extern "C" __attribute__((visibility("default"))) const char* __asan_default_options() {
    return "verify_asan_link_order=0:detect_leaks=0";
}
#endif

#if PL_CPU_EMU
// ---------------------------------------------------------------------------------------------------------
// The CPU execution layer's fiber switch (declared in runtime.cuh): push the System V callee-saved registers,
// swap stack pointers, pop the other fiber's registers and return into it.
// ---------------------------------------------------------------------------------------------------------
asm(R"(
    .text
    .globl pl_cpu_switch
    .hidden pl_cpu_switch
    .type pl_cpu_switch, @function
pl_cpu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size pl_cpu_switch, .-pl_cpu_switch
    .section .note.GNU-stack,"",@progbits
    .text
)");
#endif
