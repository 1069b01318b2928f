#!/usr/bin/env bash
# Issue 21, session 5: device calls from a copy of this checkout (source benches/device_env.sh first).
#   probe:  every method's kernel part against density x cuDNN at 32K / 128K, split on / off, the
#           single-line FlexPrefill plan with the 4 GiB front-door budget at 128K
#           (benches/kernel_floor.py); ncu of the single-line plan at 128K beside its block twin,
#           of one Delta-KV call at keep 0.5 (32K) and of the varlen batch (one launch, per sequence).
#   after:  `sparseprefill bench` (kernels, minference, sample_attention) before ($1, a copy of the
#           start) and after in one call, the kernel-floor table again, GPU conformance and a memcheck.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=$(cd "$(dirname "$0")/.." && pwd)
MODE=${1:-probe}
BEFORE=${2:-}
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
LIMIT=${LIMIT:-540}
T0=$SECONDS
LOG=$OUT/run.log
S=$R/benches
left() { echo $((LIMIT - (SECONDS - T0))); }
step() { local name=$1 limit=$2; shift 2; local l; l=$(left)
    if [ "$l" -lt 15 ]; then echo "=== $name skipped (${l}s left)" | tee -a "$LOG"; return; fi
    [ "$limit" -gt "$l" ] && limit=$l
    echo "=== $name (limit ${limit}s)" | tee -a "$LOG"; local t=$SECONDS
    timeout "$limit" "$@" 2>&1 | grep -v -i "warn" | tee -a "$LOG"
    echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS - t))s" | tee -a "$LOG"; }
NCU="ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy
     --section LaunchStats --section WarpStateStats --section SchedulerStats --section InstructionStats
     --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis -f"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$LOG"
cd /tmp
if [ "$MODE" = probe ]; then
    step workload-32k 40 python "$S/discrete_keys.py" workload --seqlens 32768 --head-dims 128
    python "$S/discrete_keys.py" workload --seqlens 131072 --head-dims 128 > /tmp/wl128.log 2>&1 &
    X=flexprefill_vs_0.95_lines,blocks_like_flexprefill_vs_0.95_lines,columns20,blocks_like_columns20
    step floor-32k 130 python "$S/kernel_floor.py" --seqlens 32768 --extra "$X" \
        --variants "split:COL_SPLIT=1;nosplit:COL_SPLIT=0;split2:COL_SPLIT=1;nosplit2:COL_SPLIT=0" \
        --json "$OUT/floor-32k.json"
    step ncu-delta 40 $NCU -o /tmp/ncudelta python "$S/issue21_s4.py" --parts ncu_delta --json /tmp/x.json
    ncu --import /tmp/ncudelta.ncu-rep --page details > "$OUT/ncu-delta-32k.txt" 2>&1
    step ncu-varlen 40 $NCU -o /tmp/ncuvarlen python "$S/issue21_s4.py" --parts ncu_varlen --json /tmp/y.json
    ncu --import /tmp/ncuvarlen.ncu-rep --page details > "$OUT/ncu-varlen.txt" 2>&1
    wait; cat /tmp/wl128.log >> "$LOG"
    step floor-128k 190 python "$S/kernel_floor.py" --seqlens 131072 --extra "$X" \
        --variants "split:COL_SPLIT=1;nosplit:COL_SPLIT=0;budget4:COL_SPLIT=1,BUDGET_GIB=4" \
        --json "$OUT/floor-128k.json"
    step ncu-lines-128k 60 $NCU -o /tmp/ncu128 python "$S/discrete_keys.py" profile --seqlens 131072 \
        --plans flexprefill_vs_0.95_lines,blocks_like_flexprefill_vs_0.95_lines
    ncu --import /tmp/ncu128.ncu-rep --page details > "$OUT/ncu-lines-128k.txt" 2>&1
fi
if [ "$MODE" = after ]; then
    link() { rm -rf "$2"; mkdir -p "$2"; cp -r "$1/sparseprefill" "$2/"
        for d in reference fast conformance; do ln -s "$1/$d" "$2/sparseprefill/$d"; done; }
    link "$BEFORE" /tmp/L/before
    step workload-32k 40 python "$S/discrete_keys.py" workload --seqlens 32768 --head-dims 128
    python "$S/discrete_keys.py" workload --seqlens 131072 --head-dims 128 > /tmp/wl128.log 2>&1 &
    step conformance 55 python -m sparseprefill.conformance --device cuda --max-seqlen 8192 --examples 6 \
        --row-budget 4 --methods vertical_slash,minference,flexprefill_vs,shareprefill,anchor_attention \
        --properties sparse_attention,nonfinite,end_to_end --json "$OUT/conformance.json"
    for suite in kernels minference sample_attention; do
        PYTHONPATH=/tmp/L/before step "bench-$suite-before" 40 python -m sparseprefill.cli bench --method $suite \
            --seqlens 32768 --no-flex --no-recall --json "$OUT/bench-$suite-before.json"
        step "bench-$suite-after" 40 python -m sparseprefill.cli bench --method $suite \
            --seqlens 32768 --no-flex --no-recall --json "$OUT/bench-$suite-after.json"
    done
    X=flexprefill_vs_0.95_lines,blocks_like_flexprefill_vs_0.95_lines
    F="--rep 40 --extra $X"
    PYTHONPATH=/tmp/L/before step floor-32k-before 35 python "$S/kernel_floor.py" --seqlens 32768 $F \
        --methods vertical_slash,minference,shareprefill --variants "main:COL_SPLIT=1" --json "$OUT/floor-32k-before.json"
    step floor-32k-after 45 python "$S/kernel_floor.py" --seqlens 32768 $F --methods vertical_slash,minference,shareprefill \
        --variants "rule:COL_SPLIT=auto;on:COL_SPLIT=1;off:COL_SPLIT=0" --json "$OUT/floor-32k-after.json"
    wait; cat /tmp/wl128.log >> "$LOG"
    PYTHONPATH=/tmp/L/before step floor-128k-before 40 python "$S/kernel_floor.py" --seqlens 131072 $F \
        --methods minference --variants "main:COL_SPLIT=1" --json "$OUT/floor-128k-before.json"
    step floor-128k-after 50 python "$S/kernel_floor.py" --seqlens 131072 $F --methods minference \
        --variants "rule:COL_SPLIT=auto;on:COL_SPLIT=1" --json "$OUT/floor-128k-after.json"
    step varlen 40 python "$S/issue21_s4.py" --parts varlen --flat-tma-only --varlen-grids --json "$OUT/varlen.json"
    step ncu-delta 35 $NCU -k regex:_block_column_fwd -o /tmp/ncudelta python "$S/issue21_s4.py" \
        --parts ncu_delta --json /tmp/x.json
    ncu --import /tmp/ncudelta.ncu-rep --page details > "$OUT/ncu-delta-32k.txt" 2>&1
fi
echo "total $((SECONDS - T0)) s" | tee -a "$LOG"
