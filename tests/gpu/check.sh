#!/usr/bin/env bash
# The one prepared GPU check (issues 7 and 17, docs gpu.md): everything native that needs a GPU, and pocketllm
# serving on it as a user starts it, in one run of at most 8 minutes on an H200-class GPU, build included.
#
#   tests/gpu/check.sh LOGDIR
#
# Steps (each with its own time limit; a failed step is reported and the next one still runs):
#   1 prereqs   torch with CUDA, the GPU, its driver (against the library's CUDA runtime), transformers with
#               Qwen3.5, cffi, nvcc, NCCL, the library: says exactly what is missing
#   2 library   the prebuilt build/libpocketllm.so loads on this GPU; otherwise it is rebuilt here for this
#               GPU's arch (needs nvcc, a few minutes), then loaded again
#   3 wrappers  tests/test_emu_layer.py on cuda: mma / ldmatrix / conversions / shuffles on the hardware agree
#               with the layouts the CPU execution layer computes
#   4 ops       tests/test_native_ops.py on cuda: every native op against the reference, poisoned outputs
#   4b kernels  the fp32-output linears and the row-scaled MLP at the real K (5120, 17408) vs float64
#   4c ptx_sm75 every op again on a build for sm_75 alone (build/sm75/, made here when not carried): on a
#               newer GPU the driver JIT-compiles its compute_75 PTX, so the Turing code path (mma m16n8k8, no
#               cp.async) runs, as far as one newer GPU can run it (CUDA_FORCE_PTX_JIT=1 cannot: torch's own
#               kernels carry no PTX and fail with "no kernel image")
#   5 nccl      a one-rank communicator: unique id, init, all-reduce fp16/fp32, destroy; init and step
#               timeouts abort the communicator (a peer that never joins, a GPU spin ahead of the step)
#   6 parity    tests/gpu/test_gpu_parity.py: native vs torch, identical greedy tokens for 64 steps
#   6b graphs   decode by CUDA graph replay (DecodeGraphs) == eager, token for token, greedy and sampled (penalties,
#               top-k/top-p/min-p, logit_bias, min_tokens, n=2), the graph holding the forward only and the
#               forward with the sampler (Sampler.sample_static); async scheduling (on, graphed) == one step at a
#               time, and the decode step time one at a time, overlapped, and overlapped with the sampler eager
#   6c model27b Qwen3.5-27B with --load-format dummy (random FP8 weights of the real shapes made on the GPU from
#               config.json: no 27 GB download): benchmarks/bench.py --report at TP1 (batch-1 TPOT against the
#               bytes-per-token / copy-bandwidth roofline, output tokens/s at batch 8 and 32, TTFT at 1k and 8k,
#               the speculative step's cost and its implied speed-up, profiler GPU vs wall time per step, peak
#               memory), then one TP4 rank's shapes on this GPU (LOGDIR/model27b.txt; `gpu_check.py model27b
#               LOGDIR --cpu` runs the same code on the CPU with pocket-tiny's config)
#   7 synth     a synthetic FP8 checkpoint with the 27B's layer shapes, 4 layers (tests/gpu/serve_check.py)
#   8 serve_tiny       `python pocketllm.py` on the GPU (--device auto, --backend native: the defaults must pick
#   9 serve_synthetic  them), pocket-tiny, then the synthetic checkpoint with --smoke-layers 4: /health after
#                      the warm-up, default sampling (temperature 1, top_p 0.95), penalties, n=2 + logprobs,
#                      streaming, a forced tool call (tests/gpu/serve_check.py)
#  10 verify    tests/verify_openai.py against pocket-tiny on the GPU, with the published clients
#  11 bench     kernel bandwidth vs measured copy bandwidth on the 27B decode shapes
#  12 decode    decode tokens/s at batch 1, 8 and 32 sampled at temperature 1, 27B shapes with 4 layers,
#               extrapolated to 64 (stated so), eager, as CUDA graphs with the sampler inside and with the sampler
#               eager after the graph, and with the decode fusions switched
#               off one by one; then a torch.profiler table of batch-1 steps (LOGDIR/profile.txt)
#  13 speculative  tests/test_speculative.py on the GPU (LLM's defaults: cuda, native): MTP drafts verified
#               exactly against unspeculated greedy output, oracle drafts, stop/max_tokens inside windows,
#               preemption, pocket-tiny's acceptance; then benchmarks/speculative.py's K = 0..4 table
# Full logs: LOGDIR/<step>.log and LOGDIR/<step>.json; the short table comes last (also LOGDIR/summary.txt).
# CHECK_BUDGET=SECONDS bounds the whole run (default 450); CHECK_ONLY="STEP ..." runs only the steps named.
# The device image lacks cffi, openai and langchain-openai: carry their wheels (docs/gpu.md, device README) or
# the native steps fail at prereqs and verify runs its client checks as NOT RUN.
# Without a GPU, `python tests/gpu/serve_check.py dry-run LOGDIR` runs steps 7-9 on the CPU (tests/test_gpu_check.py
# does, with `bash -n` of this file).
set -uo pipefail

LOG=${1:?usage: tests/gpu/check.sh LOGDIR}
mkdir -p "$LOG"
LOG=$(cd "$LOG" && pwd)
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
PY=${PYTHON:-python3}
START=$(date +%s)
: > "$LOG/summary.tsv"

# run NAME LIMIT_SECONDS COMMAND...: log to LOGDIR/NAME.log, record status and seconds. The whole check keeps
# within CHECK_BUDGET seconds (default 450, so the device call ends inside 8 minutes): a step gets at most what
# is left, and a step with under 15 s left is recorded as SKIPPED.
BUDGET=${CHECK_BUDGET:-450}
ONLY=${CHECK_ONLY:-}             # e.g. CHECK_ONLY="ops graphs decode": run just these steps (a rerun's short list)
run() {
    local name=$1 limit=$2
    shift 2
    if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then
        printf '%s\tok\tnot selected (CHECK_ONLY)\n' "$name" >> "$LOG/summary.tsv"
        return 0
    fi
    local t0=$(date +%s)
    local left=$(( BUDGET - (t0 - START) ))
    if [ $left -lt 15 ]; then
        printf '%s\tSKIPPED(time budget %ss spent)\t0s\n' "$name" "$BUDGET" >> "$LOG/summary.tsv"
        echo "=== $name: skipped, the ${BUDGET}s budget is spent"
        return 1
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "=== $name: $*" | tee "$LOG/$name.log"
    timeout --kill-after=10 "$limit" "$@" >> "$LOG/$name.log" 2>&1
    local rc=$?
    local status=ok
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then status="TIMEOUT(${limit}s)"; elif [ $rc -ne 0 ]; then status="FAILED(rc=$rc)"; fi
    printf '%s\t%s\t%ss\n' "$name" "$status" "$(( $(date +%s) - t0 ))" >> "$LOG/summary.tsv"
    tail -n 4 "$LOG/$name.log"
    return $rc
}

# The prebuilt library, or one rebuilt here for this GPU's arch when it does not load.
load_or_rebuild() {
    "$PY" tests/gpu/gpu_check.py load "$LOG" && return 0
    local arch
    arch=$("$PY" -c "import torch; p = torch.cuda.get_device_capability(); print(f'{p[0]}{p[1]}')") || return 1
    # Rebuilt for the default architectures (sm_75 + sm_90, the tests' stamp), so no test rebuilds it again.
    echo "the prebuilt library does not load here (this GPU is sm_$arch): rebuilding for the default architectures"
    "$PY" build.py && "$PY" tests/gpu/gpu_check.py load "$LOG"
}
export -f load_or_rebuild
export PY LOG

run prereqs 60 "$PY" tests/gpu/gpu_check.py prereqs "$LOG"
run library 300 bash -c load_or_rebuild
run wrappers 120 "$PY" -m pytest -q -x tests/test_emu_layer.py -k cuda -p no:cacheprovider
run ops 150 "$PY" -m pytest -q tests/test_native_ops.py -k cuda -p no:cacheprovider
run kernels 90 "$PY" tests/gpu/gpu_check.py kernels "$LOG"
# The Turing code path on this GPU: an sm_75-only build, whose compute_75 PTX the driver JIT-compiles.
sm75_ops() {
    [ -f build/sm75/libpocketllm.so ] || "$PY" -c "import build; build.build(arch='75', out_dir='build/sm75')" \
        || return 1
    POCKETLLM_NATIVE_LIB=build/sm75/libpocketllm.so "$PY" -m pytest -q tests/test_native_ops.py -k cuda \
        -p no:cacheprovider
}
export -f sm75_ops
run ptx_sm75 150 bash -c sm75_ops
run nccl 120 "$PY" tests/gpu/gpu_check.py nccl "$LOG"
run parity 120 "$PY" -m pytest -q tests/gpu/test_gpu_parity.py -p no:cacheprovider
run graphs 120 "$PY" tests/gpu/gpu_check.py graphs "$LOG"
run model27b 240 "$PY" tests/gpu/gpu_check.py model27b "$LOG"
export POCKETLLM_SYNTH=${TMPDIR:-/tmp}/pocketllm-synth-27b-shapes
run synth 150 "$PY" tests/gpu/serve_check.py synth "$POCKETLLM_SYNTH"
GPU_FLAGS=(--max-context 2048)      # --device auto and --backend auto: the start-up line must say cuda:0, native
run serve_tiny 90 "$PY" tests/gpu/serve_check.py serve "$LOG" serve_tiny -- "${GPU_FLAGS[@]}"
run serve_synthetic 120 "$PY" tests/gpu/serve_check.py serve "$LOG" serve_synthetic -- "${GPU_FLAGS[@]}" \
    --ckpt "$POCKETLLM_SYNTH" --smoke-layers 4
ls "$LOG"/serve_*.server.log >/dev/null 2>&1 && ! grep -h "backend native on cuda:0" "$LOG"/serve_*.server.log \
    >> "$LOG/serve_tiny.log" && printf 'serve_default_backend\tFAILED(the defaults did not pick native on cuda:0)\t0s\n' >> "$LOG/summary.tsv"
run verify 150 "$PY" tests/verify_openai.py --client-python "$PY" --log-dir "$LOG/verify" "${GPU_FLAGS[@]}"
run bench 150 "$PY" tests/gpu/gpu_check.py bench "$LOG"
run decode 200 "$PY" tests/gpu/gpu_check.py decode "$LOG"
run speculative 120 bash -c '"$PY" -m pytest -q -x tests/test_speculative.py -k "not tensor_parallel" \
    -p no:cacheprovider && "$PY" benchmarks/speculative.py --decode 64 --threads 8'

{
    echo
    echo "== pocketllm GPU check: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null), $(( $(date +%s) - START ))s"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /'
    column -t -s $'\t' "$LOG/summary.tsv" 2>/dev/null || expand -t 24 "$LOG/summary.tsv"
    if [ -f "$LOG/bench.json" ]; then
        "$PY" - "$LOG/bench.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"\nkernel bandwidth (copy: {d['copy_GBps']:.0f} GB/s; goals: GEMV >= 80%, attention / GDN >= 70%)")
for r in d["rows"][1:]:
    print(f"  {r['kernel']:28s} {r['shape']:22s} B={r['batch']:<2} {r['ms']:8.4f} ms {r['GB/s']:7.0f} GB/s {r['% of copy']:5.1f}%")
EOF
    fi
    [ -f "$LOG/model27b.txt" ] && { echo; cat "$LOG/model27b.txt"; }
    if [ -f "$LOG/decode.json" ]; then
        "$PY" - "$LOG/decode.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
for b, r in d.items():
    if b.startswith("batch"):
        print(f"decode {b}: {r['step_ms_4_layers']:.2f} ms/step with 4 layers -> ~{r['tok_per_s_est']:.1f} tok/s "
              f"at 64 layers (extrapolated; real-vocab lm_head excluded; {d.get('sampling', 'greedy')})")
EOF
    fi
} | tee "$LOG/summary.txt"

! grep -qv $'\tok\t' "$LOG/summary.tsv"
