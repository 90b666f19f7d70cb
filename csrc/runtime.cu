// runtime.cu: the library's own plumbing: ABI version, last-error buffer, device query, NCCL loaded at run time.
#include "pocketllm.h"
#include "runtime.cuh"

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

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
// ---------------------------------------------------------------------------------------------------------

typedef int ncclResult_t;  // ncclSuccess = 0
typedef struct ncclComm* ncclComm_t;
typedef struct { char internal[PL_NCCL_ID_BYTES]; } ncclUniqueId;
enum { ncclFloat16 = 6, ncclFloat32 = 7 };  // ncclDataType_t
enum { ncclSum = 0 };                       // ncclRedOp_t

struct NcclApi {
    void* handle = nullptr;
    ncclResult_t (*GetVersion)(int*);
    ncclResult_t (*GetUniqueId)(ncclUniqueId*);
    ncclResult_t (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int);
    ncclResult_t (*AllReduce)(const void*, void*, size_t, int, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*CommDestroy)(ncclComm_t);
    const char* (*GetErrorString)(ncclResult_t);
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
#if PL_CPU_EMU
    (void)path;
    PL_FAIL("NCCL is not available in the CPU test build");
#else
    if (g_nccl.handle) return 0;
    const char* name = path && path[0] ? path : "libnccl.so.2";
    void* h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    PL_REQUIRE(h, "cannot load NCCL (%s): %s; install the nvidia-nccl-cu13 wheel or set NCCL_ROOT", name, dlerror());
    NcclApi api;
    api.handle = h;
    const char* missing = nullptr;
#define PL_NCCL_SYM(field, sym) \
    if (!(*reinterpret_cast<void**>(&api.field) = dlsym(h, sym)) && !missing) missing = sym
    PL_NCCL_SYM(GetVersion, "ncclGetVersion");
    PL_NCCL_SYM(GetUniqueId, "ncclGetUniqueId");
    PL_NCCL_SYM(CommInitRank, "ncclCommInitRank");
    PL_NCCL_SYM(AllReduce, "ncclAllReduce");
    PL_NCCL_SYM(CommDestroy, "ncclCommDestroy");
    PL_NCCL_SYM(GetErrorString, "ncclGetErrorString");
#undef PL_NCCL_SYM
    if (missing) {
        dlclose(h);
        PL_FAIL("%s is not a usable NCCL library: symbol %s is missing", name, missing);
    }
    int version = 0;
    if (api.GetVersion(&version) != 0 || version < 20000) {
        dlclose(h);
        PL_FAIL("%s reports NCCL version %d; NCCL 2.x is required", name, version);
    }
    g_nccl = api;
    return 0;
#endif
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

extern "C" int pl_nccl_init(const uint8_t* id, int32_t nranks, int32_t rank, int32_t device, uint64_t* comm_out) {
    PL_NCCL_REQUIRE_LOADED();
    PL_REQUIRE(nranks >= 1 && rank >= 0 && rank < nranks, "bad rank %d of %d ranks", rank, nranks);
    ncclUniqueId uid;
    memcpy(uid.internal, id, PL_NCCL_ID_BYTES);
#if !PL_CPU_EMU
    PL_CHECK(cudaSetDevice(device));  // NCCL binds the communicator to the current device
#else
    (void)device;
#endif
    ncclComm_t comm = nullptr;
    PL_NCCL_CHECK(g_nccl.CommInitRank(&comm, nranks, uid, rank));
    *comm_out = (uint64_t)(uintptr_t)comm;
    return 0;
}

extern "C" int pl_nccl_all_reduce_sum(uint64_t comm, uint64_t ptr, uint64_t count, int32_t dtype, uint64_t stream) {
    PL_NCCL_REQUIRE_LOADED();
    PL_REQUIRE(comm, "null NCCL communicator");
    PL_REQUIRE(dtype == PL_F16 || dtype == PL_F32, "all-reduce supports fp16 and fp32, not dtype %d", dtype);
    void* p = PL_PTR(void, ptr);
    PL_NCCL_CHECK(g_nccl.AllReduce(p, p, (size_t)count, dtype == PL_F16 ? ncclFloat16 : ncclFloat32, ncclSum,
                                   reinterpret_cast<ncclComm_t>(comm), (cudaStream_t)(uintptr_t)stream));
    return 0;
}

extern "C" int pl_nccl_destroy(uint64_t comm) {
    PL_NCCL_REQUIRE_LOADED();
    PL_REQUIRE(comm, "null NCCL communicator");
    PL_NCCL_CHECK(g_nccl.CommDestroy(reinterpret_cast<ncclComm_t>(comm)));
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
