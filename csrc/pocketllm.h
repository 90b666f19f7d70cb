/* pocketllm.h: the one C ABI of libpocketllm (docs/abi.md).
 *
 * The text between "cdef begin" and "cdef end" is handed to cffi's cdef by pocketllm.py as it stands, so it
 * holds plain C declarations only: no preprocessor lines, fixed-width types, device pointers and CUDA streams
 * as uint64_t (0 = the default stream), opaque handles as uint64_t.
 *
 * Error model: every function returns int, 0 = ok; on failure it returns nonzero and pl_last_error() holds a
 * one-line message "function (file:line): what: why" for the calling thread. Nothing here exits or aborts.
 */
#ifndef POCKETLLM_H
#define POCKETLLM_H

#include <stdint.h>

/* Bumped on every incompatible change of the declarations below; pocketllm.py checks it on load. */
#define PL_ABI_VERSION 5

#ifdef __cplusplus
extern "C" {
#endif
#if defined(__GNUC__)
/* The library is compiled with -fvisibility=hidden: exactly the functions declared here are exported. */
#pragma GCC visibility push(default)
#endif

/* ---- cdef begin ---- */

/* Element types, as int32_t dtype arguments. */
enum pl_dtype { PL_F32 = 0, PL_F16 = 1, PL_BF16 = 2, PL_E4M3 = 3, PL_I32 = 4, PL_I64 = 5 };

/* ---- runtime (native-infra) ---- */

/* PL_ABI_VERSION of the library. */
int32_t pl_abi_version(void);
/* The last error message of the calling thread ("" if none yet). */
const char* pl_last_error(void);
/* 1 for the CPU test build (libpocketllm_cpu.so: kernels run on host memory), 0 for the CUDA build. */
int32_t pl_is_cpu_build(void);
/* The CUDA version the installed driver supports and the one of the runtime this library carries, both as
 * 1000 * major + 10 * minor (e.g. 12040, 13000); driver 0 = no driver found. Never fails. */
int pl_cuda_versions(int32_t* driver_version, int32_t* runtime_version);
/* Visible CUDA devices. Fails, with the driver's reason, when there is no usable GPU or driver; first of all
 * when the driver is older than the carried runtime needs, in one line naming the minimum driver. */
int pl_device_count(int32_t* count);
/* Compute capability of a device, e.g. 7 5 for an RTX 2080 Ti. */
int pl_device_capability(int32_t device, int32_t* major, int32_t* minor);
/* Make `device` current for the calling host thread's launches. The library's CUDA runtime is its own (static),
 * so torch.cuda.set_device does not reach it: NativeOps calls this once per thread and device. */
int pl_set_device(int32_t device);

/* NCCL is loaded at run time (dlopen), so one binary works with or without it. pl_nccl_load opens `path`
 * (NULL: the default search for libnccl.so.2) once; it fails, saying why, when NCCL is unusable (older than
 * 2.14; in the CPU test build anything but the test NCCL of tests/fake_nccl.c). The other NCCL functions fail
 * until a load succeeded. A unique id is PL_NCCL_ID_BYTES opaque bytes. No call waits on a peer unbounded:
 * a failure or a timeout aborts the communicator (ncclCommAbort) and returns -1 naming it; an aborted
 * communicator refuses every call but pl_nccl_destroy. */
enum { PL_NCCL_ID_BYTES = 128 };
int pl_nccl_load(const char* path);
int pl_nccl_version(int32_t* version);
int pl_nccl_unique_id(uint8_t* id_out);
/* A non-blocking communicator, polled until every rank has joined or `timeout_s` has passed. */
int pl_nccl_init(const uint8_t* id, int32_t nranks, int32_t rank, int32_t device, double timeout_s,
                 uint64_t* comm_out);
/* In-place sum over all ranks of `count` elements of dtype PL_F16 or PL_F32, queued on `stream`. */
int pl_nccl_all_reduce_sum(uint64_t comm, uint64_t ptr, uint64_t count, int32_t dtype, uint64_t stream);
/* Until the collectives queued on `stream` so far have completed, polling NCCL's asynchronous error, for at
 * most `timeout_s` seconds. */
int pl_nccl_wait(uint64_t comm, uint64_t stream, double timeout_s);
/* ncclCommAbort now (a peer is known dead); the handle stays valid for pl_nccl_destroy. */
int pl_nccl_abort(uint64_t comm);
int pl_nccl_destroy(uint64_t comm);

/* Kernel launches made by this process so far (every op counts each kernel it queues; the CPU build counts
 * the same launches). Never fails but for a NULL count. */
int pl_launch_count(uint64_t* count);
/* Benchmarking switch: with skip = 1 every op checks its arguments and counts its launches but runs no kernel
 * (outputs are left unwritten), so what remains is the host's cost of the call. 0 restores normal operation. */
int pl_set_skip_kernels(int32_t skip);

/* ---- ops (native-kernels) ---- */
/* Conventions: int status; tensors as uint64_t pointers to contiguous memory; token and element counts as
 * int64_t, head counts and dims as int32_t; element types as int32_t pl_dtype; the stream is the last argument
 * (uint64_t). */


/* Dtype codes: 0 = fp32, 1 = fp16, 2 = bf16, 3 = fp8 e4m3 (weights only). Activations (act_dtype) are fp32 or
   fp16. Pointers are device addresses (host addresses in the CPU build), streams are cudaStream_t values.
   All tensors are contiguous. Every function returns 0, or -1 with pl_last_error() set. */

/* out (T, D) act = table[ids] ; ids (T,) int64; an id outside [0, V) yields a NaN row. */
int pl_embed(uint64_t ids, int64_t T, uint64_t table, int32_t table_dtype, int64_t V, int32_t D,
             uint64_t out, int32_t act_dtype, uint64_t stream);
/* The vocab-parallel embedding's lookup on one rank: table (V, D) holds rows [lo, lo + V) of the vocabulary; out
   row t = table[ids[t] - lo] for ids in that range, zeros for the others (V = 0: all zeros). */
int pl_embed_shard(uint64_t ids, int64_t T, uint64_t table, int32_t table_dtype, int64_t lo, int64_t V, int32_t D,
                   uint64_t out, int32_t act_dtype, uint64_t stream);
/* out (T, D) act = x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32; out may alias x. */
int pl_rmsnorm(uint64_t x, uint64_t w, int32_t w_dtype, uint64_t out, int32_t act_dtype, int64_t T,
               int32_t D, float eps, uint64_t stream);
/* residual (T, D) fp32 += x (T, D) of x_dtype (fp32 or fp16: the row-parallel outputs arrive in fp32) in
   place; out (T, D) act = rmsnorm(residual) as above. */
int pl_add_rmsnorm(uint64_t x, int32_t x_dtype, uint64_t residual, uint64_t w, int32_t w_dtype, uint64_t out,
                   int32_t act_dtype, int64_t T, int32_t D, float eps, uint64_t stream);
/* Split-K of the tensor-core GEMV (decode, fp16 activations, e4m3 weights): the calling thread's scratch on its
   current device, used by its later GEMVs there: workspace (>= tiles * splits * 128 (256 above 8 tokens) fp32) and
   n_counters uint32 counters, all zero (each launch leaves them zero). Launches on one stream at a time per
   thread. workspace = 0 forgets it (no split). */
int pl_set_gemv_scratch(uint64_t workspace, int64_t workspace_bytes, uint64_t counters, int64_t n_counters);
/* Benchmarking switches of that GEMV, process-wide: warps per block (0 = default 8, or 4, 8) and splits of K
   (0 = chosen by shape and SM count, -1 = none, 1..16 forced); pl_gemv_plan reports the choice for a shape. */
int pl_set_gemv_tuning(int32_t warps, int32_t splits);
int pl_gemv_plan(int64_t T, int64_t K, int64_t N, int32_t glu, int32_t* warps, int32_t* splits);
/* out (T, N) of out_dtype = x_row_scale[t] * (x (T, K) act @ w^T), w (N, K) of w_dtype; for w_dtype 3, scale
   is the fp32 (ceil(N/128), ceil(K/128)) block-scale tensor, else 0. x_row_scale (T,) fp32, or 0 for none
   (pl_silu_mul's row scales). out_dtype is act_dtype or 0 (fp32: what fp16 activations need where a sum may
   pass 65504). Accumulation is fp32 always. T <= 16 takes the GEMV path. */
int pl_linear(uint64_t x, int32_t act_dtype, uint64_t x_row_scale, int64_t T, int64_t K, uint64_t w,
              int32_t w_dtype, uint64_t scale, int64_t N, uint64_t out, int32_t out_dtype, uint64_t stream);
/* pl_linear of a fused weight (rows of several projections stacked, loaded that way once) whose output columns
   fall into four parts [0, end0), [end0, end1), [end1, end2), [end2, N) (0 <= end0 <= end1 <= end2 <= N; a part
   may be empty): out holds part p as its own contiguous (T, N_p) matrix, the parts one after another, so
   q|gate|k|v or gate|up come out of one launch as plain tensors. end0 = end1 = end2 = N is pl_linear. */
int pl_linear_parts(uint64_t x, int32_t act_dtype, uint64_t x_row_scale, int64_t T, int64_t K, uint64_t w,
                    int32_t w_dtype, uint64_t scale, int64_t N, int64_t end0, int64_t end1, int64_t end2,
                    uint64_t out, int32_t out_dtype, uint64_t stream);
/* The MLP's first half in one launch: out (T, I) fp32 = silu(x @ gate^T) * (x @ up^T), w (N = 2I, K) the rows
   [gate | up] stacked (FP8: I a multiple of 128, scale as in pl_linear). Decode sizes only: T <= 16 (the GEMV
   paths; larger T fails, use pl_linear_parts and pl_silu_mul). fp32 out, so no row scale is needed. */
int pl_linear_glu(uint64_t x, int32_t act_dtype, int64_t T, int64_t K, uint64_t w, int32_t w_dtype, uint64_t scale,
                  int64_t N, uint64_t out, uint64_t stream);
/* GDN's in_proj_a|b and pl_gdn_gates in one launch: w (2 Hv, K) the rows [a | b] stacked (any weight dtype,
   scale as in pl_linear); A_log, dt_bias (Hv,) fp32; out (2, T, Hv) fp32 = [g | beta] with
   g = -exp(A_log) * softplus(x a^T + dt_bias), beta = sigmoid(x b^T) (a and b are not rounded to act first). */
int pl_linear_gdn_gates(uint64_t x, int32_t act_dtype, int64_t T, int64_t K, uint64_t w, int32_t w_dtype,
                        uint64_t scale, int32_t Hv, uint64_t A_log, uint64_t dt_bias, uint64_t out, uint64_t stream);
/* The decoder layer's residual add + RMSNorm as the prologue of the projections that read its output (decode
   sizes: T <= 16; larger T fails, use pl_add_rmsnorm first). Their input is h = act(rmsnorm(residual + x) * (1 +
   norm_w)) with x, residual (T, K) fp32 (pl_add_rmsnorm's formulas, act = act_dtype), never stored: every block
   of the GEMV recomputes the T row norms. residual_out (T, K) fp32 (not residual: other blocks still read it)
   receives residual + x, or 0 when an earlier op of the step wrote it. The rest as in pl_linear_parts,
   pl_linear_glu and pl_linear_gdn_gates. */
int pl_norm_linear_parts(uint64_t x, uint64_t residual, uint64_t residual_out, uint64_t norm_w, int32_t norm_w_dtype,
                         float eps, int32_t act_dtype, int64_t T, int64_t K, uint64_t w, int32_t w_dtype,
                         uint64_t scale, int64_t N, int64_t end0, int64_t end1, int64_t end2, uint64_t out,
                         int32_t out_dtype, uint64_t stream);
int pl_norm_linear_glu(uint64_t x, uint64_t residual, uint64_t residual_out, uint64_t norm_w, int32_t norm_w_dtype,
                       float eps, int32_t act_dtype, int64_t T, int64_t K, uint64_t w, int32_t w_dtype, uint64_t scale,
                       int64_t N, uint64_t out, uint64_t stream);
/* The decode MLP in one launch (T <= 16): out (T, D) fp32 = down(silu(h gate^T) * (h up^T)), h the input as in
   pl_gdn_in_proj (x of act_dtype, or with residual != 0 the prenormed fp32 x, residual). gate_up (2 I, K) e4m3 =
   [gate | up], down (D, I) e4m3, both with 128x128 fp32 block scales. workspace: ceil(I / 128) * T * D fp32
   (no initial value); counters: ceil(D / 128) <= 4096 uint32, zero before the first call and left zero by each
   call (one launch at a time per counters buffer). Deterministic: the partials are summed in a fixed order. */
int pl_mlp(uint64_t x, uint64_t residual, uint64_t residual_out, uint64_t norm_w, int32_t norm_w_dtype, float eps,
           int32_t act_dtype, int64_t T, int64_t K, uint64_t gate_up, uint64_t gate_up_scale, int64_t I, uint64_t down,
           uint64_t down_scale, int64_t D, uint64_t out, uint64_t workspace, uint64_t counters, uint64_t stream);
int pl_norm_linear_gdn_gates(uint64_t x, uint64_t residual, uint64_t residual_out, uint64_t norm_w,
                             int32_t norm_w_dtype, float eps, int32_t act_dtype, int64_t T, int64_t K, uint64_t w,
                             int32_t w_dtype, uint64_t scale, int32_t Hv, uint64_t A_log, uint64_t dt_bias,
                             uint64_t out, uint64_t stream);
/* GDN's in_proj at decode sizes (T <= 16, row t the one new token of the sequence at slot slot_ids[t] (int32)):
   the fused weight w (N, K) [qkv (C rows) | z] as pl_linear_parts with parts [0, C), [C, N), output act, and
   pl_conv1d's causal conv + SiLU over the qkv part in the epilogue, advancing conv_state (S, C, W-1) of
   state_dtype; conv_w (C, W). residual = 0: x (T, K) act is the input; else the input is pl_norm_linear_parts'
   normed one (x, residual, residual_out, norm_w, eps as there; norm_w 0 and eps unused otherwise). */
int pl_gdn_in_proj(uint64_t x, uint64_t residual, uint64_t residual_out, uint64_t norm_w, int32_t norm_w_dtype,
                   float eps, int32_t act_dtype, int64_t T, int64_t K, uint64_t w, int32_t w_dtype, uint64_t scale,
                   int64_t C, int64_t N, uint64_t out, uint64_t conv_w, int32_t conv_w_dtype, int32_t W,
                   uint64_t conv_state, int32_t state_dtype, uint64_t slot_ids, uint64_t stream);
/* pl_gdn_in_proj and, in the same launch, GDN's dense a|b projection of the same input with the gates in its
   epilogue (pl_linear_gdn_gates): ab_w (2 Hv, K) of ab_w_dtype (rows [a | b]), A_log and dt_bias (Hv,) fp32, gates
   (2, T, Hv) fp32 = [g | beta]. One launch for an e4m3 q|k|v|z weight and an a|b weight in the activation dtype
   (16-byte aligned, K % 16 == 0); otherwise the two GEMVs one after the other. */
int pl_gdn_in_proj_gates(uint64_t x, uint64_t residual, uint64_t residual_out, uint64_t norm_w, int32_t norm_w_dtype,
                         float eps, int32_t act_dtype, int64_t T, int64_t K, uint64_t w, int32_t w_dtype,
                         uint64_t scale, int64_t C, int64_t N, uint64_t out, uint64_t conv_w, int32_t conv_w_dtype,
                         int32_t W, uint64_t conv_state, int32_t state_dtype, uint64_t slot_ids, uint64_t ab_w,
                         int32_t ab_w_dtype, int32_t Hv, uint64_t A_log, uint64_t dt_bias, uint64_t gates,
                         uint64_t stream);
/* out (T, I) of out_dtype = silu(g) * u / row_scale[t], g, u (T, I) of in_dtype, in fp32; out_dtype is in_dtype
   or fp16 from fp32 inputs. row_scale: 0 for none, or (T,) fp32 written with the power of two that brings the
   row's largest |value| to at most 2^15 (1 when it already is), so an fp16 out never overflows and keeps its
   relative precision. out may alias g or u when the dtypes match and row_scale is 0. */
int pl_silu_mul(uint64_t g, uint64_t u, int32_t in_dtype, int64_t T, int64_t I, uint64_t out, int32_t out_dtype,
                uint64_t row_scale, uint64_t stream);
/* out = x * sigmoid(gate) over n elements (act); out may alias x or gate. */
int pl_sigmoid_mul(uint64_t x, uint64_t gate, uint64_t out, int32_t act_dtype, int64_t n, uint64_t stream);
/* q (T, Hq, Dh), k (T, Hk, Dh) act -> q_out, k_out (may alias q, k): per-head zero-centred RMSNorm with
   q_w / k_w (Dh,), then rotate-half RoPE on the first 2*rot_half dims with angle positions[t] * inv_freq[i];
   positions (T,) int64, inv_freq (rot_half,) fp32; Dh <= 512. */
int pl_qk_norm_rope(uint64_t q, uint64_t k, uint64_t q_out, uint64_t k_out, int32_t act_dtype, int64_t T,
                    int32_t Hq, int32_t Hk, int32_t Dh, uint64_t q_w, uint64_t k_w, int32_t w_dtype,
                    float eps, uint64_t positions, uint64_t inv_freq, int32_t rot_half, uint64_t stream);
/* pl_qk_norm_rope then pl_kv_write in one launch: q_out (T, Hq, Dh) as pl_qk_norm_rope's; the normed and rotated
   k and v (T, Hk, Dh) go into k_cache, v_cache (as pl_kv_write: slot_mapping (T,) int64, negative = skip, which
   is required); k itself is not written back. q_out may alias q. */
int pl_qk_norm_rope_kv(uint64_t q, uint64_t k, uint64_t v, uint64_t q_out, int32_t act_dtype, int64_t T, int32_t Hq,
                       int32_t Hk, int32_t Dh, uint64_t q_w, uint64_t k_w, int32_t w_dtype, float eps,
                       uint64_t positions, uint64_t inv_freq, int32_t rot_half, uint64_t k_cache, uint64_t v_cache,
                       int32_t cache_dtype, uint64_t slot_mapping, uint64_t stream);
/* k, v (T, Hk, Dh) act -> k_cache, v_cache (num_blocks, block_size, Hk, Dh) of cache_dtype (0/1/2) at
   slot_mapping[t] (int64; slot = block * block_size + offset; a negative slot is skipped). */
int pl_kv_write(uint64_t k, uint64_t v, int32_t act_dtype, int64_t T, int32_t Hk, int32_t Dh,
                uint64_t k_cache, uint64_t v_cache, int32_t cache_dtype, uint64_t slot_mapping,
                uint64_t stream);
/* Paged attention. q (T, Hq, Dh) act, Dh <= 256, Hq % Hk == 0; k_cache, v_cache (num_blocks, block_size, Hk,
   Dh) in act_dtype; block_tables (B, max_blocks) int32; context_lens (B,) int32; query_start (B+1,) int32,
   query_start[B] == T. Row i of sequence b is its position context_lens[b] - qlen_b + i and attends causally
   to positions 0 .. that position. out (T, Hq, Dh) act. workspace: device memory of at least
   pl_attention_workspace_bytes(T, Hq, Dh, max_blocks, block_size) bytes (0 = none needed), which is
       splits == 1 ? 0 : T * Hq * splits * (Dh + 2) * 4,
       splits = T * Hq >= 4096 ? 1 : clamp(min(ceil(4096 / (T * Hq)), max_blocks * block_size / 64), 1, 64).
   Each row divides its own visible positions among the splits. A row with no visible position gives 0. */
int64_t pl_attention_workspace_bytes(int64_t T, int32_t Hq, int32_t Dh, int32_t max_blocks, int32_t block_size);
int pl_attention(uint64_t q, int32_t act_dtype, int64_t T, int32_t Hq, int32_t Hk, int32_t Dh,
                 uint64_t k_cache, uint64_t v_cache, int32_t block_size, uint64_t block_tables,
                 int32_t max_blocks, uint64_t context_lens, uint64_t query_start, int32_t B, float scale,
                 uint64_t out, uint64_t workspace, int64_t workspace_bytes, uint64_t stream);
/* pl_attention times sigmoid(gate) in its epilogue (Qwen3.5's gated attention; pl_sigmoid_mul no longer runs):
   out = attention(...) * sigmoid(gate), gate (T, Hq * Dh) act, the output rounded to act before the product. */
int pl_attention_gated(uint64_t q, int32_t act_dtype, int64_t T, int32_t Hq, int32_t Hk, int32_t Dh,
                       uint64_t k_cache, uint64_t v_cache, int32_t block_size, uint64_t block_tables,
                       int32_t max_blocks, uint64_t context_lens, uint64_t query_start, int32_t B, float scale,
                       uint64_t out, uint64_t gate, uint64_t workspace, int64_t workspace_bytes, uint64_t stream);
/* pl_attention_gated (gate = 0: pl_attention) in one launch: the last split block of each (row, kv head group)
   to finish merges the splits itself. counters: 4096 uint32, zero before the first call and left zero by each
   (one launch at a time per counters buffer; the same buffer may serve pl_mlp). */
int pl_attention_merged(uint64_t q, int32_t act_dtype, int64_t T, int32_t Hq, int32_t Hk, int32_t Dh,
                        uint64_t k_cache, uint64_t v_cache, int32_t block_size, uint64_t block_tables,
                        int32_t max_blocks, uint64_t context_lens, uint64_t query_start, int32_t B, float scale,
                        uint64_t out, uint64_t gate, uint64_t workspace, int64_t workspace_bytes, uint64_t counters,
                        uint64_t stream);
/* Depthwise causal conv1d + SiLU. x (T, C) act; w (C, W) of w_dtype, 2 <= W <= 8; conv_state (S, C, W-1) of
   state_dtype (0/1/2), read and updated at slot slot_ids[b] (int32); query_start (B+1,) int32. out (T, C). */
int pl_conv1d(uint64_t x, int32_t act_dtype, int64_t T, int32_t C, uint64_t w, int32_t w_dtype, int32_t W,
              uint64_t conv_state, int32_t state_dtype, uint64_t slot_ids, uint64_t query_start, int32_t B,
              uint64_t out, uint64_t stream);
/* a, b (T, Hv) act; A_log, dt_bias (Hv,) of param_dtype -> g, beta (T, Hv) fp32:
   g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b). */
int pl_gdn_gates(uint64_t a, uint64_t b, int32_t act_dtype, int64_t T, int32_t Hv, uint64_t A_log,
                 uint64_t dt_bias, int32_t param_dtype, uint64_t g, uint64_t beta, uint64_t stream);
/* Gated delta rule (sequential per token). q, k (T, Hk, Dk) act (L2-normalised inside, q scaled by Dk^-0.5),
   Dk <= 256; v (T, Hv, Dv) act; g, beta (T, Hv) fp32; state (S, Hv, Dk, Dv) fp32 read from and written back to
   slot slot_ids[b]; query_start (B+1,) int32. out (T, Hv, Dv) act. */
int pl_gated_delta(uint64_t q, uint64_t k, uint64_t v, int32_t act_dtype, int64_t T, int32_t Hk, int32_t Hv,
                   int32_t Dk, int32_t Dv, uint64_t g, uint64_t beta, uint64_t state, uint64_t slot_ids,
                   uint64_t query_start, int32_t B, uint64_t out, uint64_t stream);
/* pl_gated_delta then pl_gated_rmsnorm of its output in one launch: out (T, Hv, Dv) act = norm_w * o *
   rsqrt(mean(o^2) + eps) * silu(z) per (token, head), o the delta rule's output rounded to act; z (T, Hv, Dv) act,
   norm_w (Dv,) of norm_w_dtype; Dv <= 128. */
int pl_gated_delta_rmsnorm(uint64_t q, uint64_t k, uint64_t v, int32_t act_dtype, int64_t T, int32_t Hk, int32_t Hv,
                           int32_t Dk, int32_t Dv, uint64_t g, uint64_t beta, uint64_t state, uint64_t slot_ids,
                           uint64_t query_start, int32_t B, uint64_t z, uint64_t norm_w, int32_t norm_w_dtype,
                           float eps, uint64_t out, uint64_t stream);
/* out (rows, D) act = w * x * rsqrt(mean(x^2) + eps) * silu(z), per row (rows = T * Hv, D = Dv). */
int pl_gated_rmsnorm(uint64_t x, uint64_t z, uint64_t w, int32_t w_dtype, uint64_t out, int32_t act_dtype,
                     int64_t rows, int32_t D, float eps, uint64_t stream);

/* ---- state (prefix cache) ---- */

/* Row copies between two cache tensors (or within one) whose first dimension is rows of row_bytes bytes (state
   slots, KV blocks), at device addresses src_base and dst_base: dst row dst_rows[i] <- src row src_rows[i] for
   i < n (0 <= n <= 65535); src_rows, dst_rows (n,) int64 device arrays. Within one tensor no destination row may
   also be a source row of the same call. */
int pl_copy_rows(uint64_t src_base, uint64_t dst_base, int64_t row_bytes, uint64_t src_rows, uint64_t dst_rows,
                 int32_t n, uint64_t stream);

/* ---- decode-step plumbing: so a decode forward is native ops only (launch-list replay, CUDA graphs) ---- */

/* bytes bytes at dst set to zero (bytes >= 0). */
int pl_zero(uint64_t dst, int64_t bytes, uint64_t stream);
/* A strided 2-D copy: rows of row_bytes bytes, row r read at src + r * src_stride and written at
   dst + r * dst_stride (strides >= row_bytes; the two regions must not overlap). */
int pl_copy_2d(uint64_t src, int64_t src_stride, uint64_t dst, int64_t dst_stride, int64_t rows, int64_t row_bytes,
               uint64_t stream);

/* ---- end ops ---- */

/* ---- cdef end ---- */

#if defined(__GNUC__)
#pragma GCC visibility pop
#endif
#ifdef __cplusplus
}
#endif

#endif /* POCKETLLM_H */
