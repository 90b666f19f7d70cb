/* fake_nccl.c: a one-rank NCCL for the CPU test build, so the library's polling and abort paths run without a
 * GPU. It implements the NCCL functions csrc/runtime.cu loads, with NCCL's semantics for a non-blocking
 * communicator, and a scripted fault (fake_nccl_script): an initialisation that never completes (a rank that
 * never joins), a collective after which the communicator stays in progress (a hung peer) or reports
 * ncclRemoteError (a dead peer). The library loads only a NCCL exporting pl_fake_nccl in its CPU build. */
#include <stdlib.h>
#include <string.h>

int pl_fake_nccl = 1;

enum { ncclSuccess = 0, ncclInvalidArgument = 4, ncclRemoteError = 6, ncclInProgress = 7 };
enum { FAKE_OK = 0, FAKE_INIT_HANGS = 1, FAKE_STEP_HANGS = 2, FAKE_PEER_DIES = 3 };

typedef struct {
    size_t size;
    unsigned int magic, version;
    int blocking;
} config_head;

typedef struct { int state, nranks; } fake_comm;
typedef struct { char internal[128]; } unique_id;   /* passed by value, as NCCL's */

static int script = FAKE_OK, aborted = 0, destroyed = 0, reduced = 0, last_blocking = -1;
void fake_nccl_script(int s) { script = s; aborted = destroyed = reduced = 0; last_blocking = -1; }
int fake_nccl_aborted(void) { return aborted; }
int fake_nccl_destroyed(void) { return destroyed; }
int fake_nccl_reduced(void) { return reduced; }
int fake_nccl_last_blocking(void) { return last_blocking; }

int ncclGetVersion(int* v) { *v = 22803; return ncclSuccess; }
int ncclGetUniqueId(void* id) { memset(id, 7, 128); return ncclSuccess; }
const char* ncclGetErrorString(int r) {
    switch (r) {
        case ncclSuccess: return "no error";
        case ncclRemoteError: return "remote process exited or there was a network error";
        case ncclInProgress: return "NCCL operation in progress";
        default: return "invalid argument";
    }
}
const char* ncclGetLastError(void* comm) { (void)comm; return script == FAKE_PEER_DIES ? "fake: peer rank 1 gone" : ""; }

int ncclCommInitRankConfig(fake_comm** out, int nranks, unique_id id, int rank, config_head* config) {
    (void)id;
    if (!config || config->magic != 0xcafebeef || config->size < sizeof(config_head) || rank != 0 || nranks != 1)
        return ncclInvalidArgument;
    last_blocking = config->blocking;
    fake_comm* c = (fake_comm*)calloc(1, sizeof *c);
    c->nranks = nranks;
    c->state = ncclInProgress;                       /* non-blocking: joined later, or never */
    if (script != FAKE_INIT_HANGS) c->state = ncclSuccess;
    *out = c;
    return config->blocking ? c->state : ncclInProgress;
}

int ncclAllReduce(const void* in, void* out, size_t n, int dtype, int op, fake_comm* c, void* stream) {
    (void)in; (void)out; (void)n; (void)dtype; (void)op; (void)stream;   /* one rank: the sum is the input */
    if (c->state != ncclSuccess) return ncclInvalidArgument;
    reduced++;
    if (script == FAKE_STEP_HANGS) c->state = ncclInProgress;
    if (script == FAKE_PEER_DIES) c->state = ncclRemoteError;
    return ncclSuccess;
}

int ncclCommGetAsyncError(fake_comm* c, int* state) { *state = c->state; return ncclSuccess; }
int ncclCommAbort(fake_comm* c) { aborted++; free(c); return ncclSuccess; }
int ncclCommDestroy(fake_comm* c) { destroyed++; free(c); return ncclSuccess; }
