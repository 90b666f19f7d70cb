#!/usr/bin/env bash
# The one prepared GPU check (issue 7, docs gpu.md): everything native that needs a GPU, in one run of about
# five minutes on an H200-class GPU, so a second attempt fits in a 15-minute window.
#
#   tests/gpu/check.sh LOGDIR
#
# Steps (each with its own time limit; a failed step is reported and the next one still runs):
#   1 prereqs   torch with CUDA, the GPU, its driver (against the library's CUDA runtime), cffi, nvcc, NCCL, the
#               library: says exactly what is missing
#   2 library   the prebuilt build/libpocketllm.so loads on this GPU; otherwise it is rebuilt here for this
#               GPU's arch (needs nvcc, a few minutes), then loaded again
#   3 wrappers  tests/test_emu_layer.py on cuda: mma / ldmatrix / conversions / shuffles on the hardware agree
#               with the layouts the CPU execution layer computes
#   4 ops       tests/test_native_ops.py on cuda: every native op against the reference, poisoned outputs
#   4b kernels  the fp32-output linears and the row-scaled MLP at the real K (5120, 17408) vs float64
#   5 nccl      a one-rank communicator: unique id, init, all-reduce fp16/fp32, destroy
#   6 parity    tests/gpu/test_gpu_parity.py: native vs torch, identical greedy tokens for 64 steps
#   7 bench     kernel bandwidth vs measured copy bandwidth on the 27B decode shapes
#   8 decode    decode tokens/s at batch 1 and 8, 27B shapes with 4 layers, extrapolated to 64 (stated so)
# Full logs: LOGDIR/<step>.log and LOGDIR/<step>.json; the short table comes last (also LOGDIR/summary.txt).
set -uo pipefail

LOG=${1:?usage: tests/gpu/check.sh LOGDIR}
mkdir -p "$LOG"
LOG=$(cd "$LOG" && pwd)
cd "$(dirname "$0")/../.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
PY=${PYTHON:-python3}
START=$(date +%s)
: > "$LOG/summary.tsv"

# run NAME LIMIT_SECONDS COMMAND...: log to LOGDIR/NAME.log, record status and seconds.
run() {
    local name=$1 limit=$2
    shift 2
    local t0=$(date +%s)
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
    echo "the prebuilt library does not load here: rebuilding for sm_$arch"
    "$PY" build.py --arch "$arch" && "$PY" tests/gpu/gpu_check.py load "$LOG"
}
export -f load_or_rebuild
export PY LOG

run prereqs 60 "$PY" tests/gpu/gpu_check.py prereqs "$LOG"
run library 300 bash -c load_or_rebuild
run wrappers 120 "$PY" -m pytest -q -x tests/test_emu_layer.py -k cuda -p no:cacheprovider
run ops 150 "$PY" -m pytest -q tests/test_native_ops.py -k cuda -p no:cacheprovider
run kernels 90 "$PY" tests/gpu/gpu_check.py kernels "$LOG"
run nccl 60 "$PY" tests/gpu/gpu_check.py nccl "$LOG"
run parity 120 "$PY" -m pytest -q tests/gpu/test_gpu_parity.py -p no:cacheprovider
run bench 120 "$PY" tests/gpu/gpu_check.py bench "$LOG"
run decode 180 "$PY" tests/gpu/gpu_check.py decode "$LOG"

{
    echo
    echo "== pocketllm GPU check: $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null), $(( $(date +%s) - START ))s"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/GPU: /'
    column -t -s $'\t' "$LOG/summary.tsv"
    if [ -f "$LOG/bench.json" ]; then
        "$PY" - "$LOG/bench.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
print(f"\nkernel bandwidth (copy: {d['copy_GBps']:.0f} GB/s; goals: GEMV >= 80%, attention / GDN >= 70%)")
for r in d["rows"][1:]:
    print(f"  {r['kernel']:28s} {r['shape']:22s} B={r['batch']:<2} {r['ms']:8.4f} ms {r['GB/s']:7.0f} GB/s {r['% of copy']:5.1f}%")
EOF
    fi
    if [ -f "$LOG/decode.json" ]; then
        "$PY" - "$LOG/decode.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
for b in ("batch1", "batch8"):
    if b in d:
        r = d[b]
        print(f"decode {b}: {r['step_ms_4_layers']:.2f} ms/step with 4 layers -> ~{r['tok_per_s_est']:.1f} tok/s "
              f"at 64 layers (extrapolated; real-vocab lm_head excluded)")
EOF
    fi
} | tee "$LOG/summary.txt"

! grep -qv $'\tok\t' "$LOG/summary.tsv"
