#!/usr/bin/env bash
# Issue 21, session 4: one device call (about 270 s), from a copy of this checkout; $OUT collects
# at most 6 files. Optional $1: a copy of the session's start (main a69ceee) for the dense "before".
#   1. ragged / varlen on flat TMA against the dense launcher and per-sequence launches; Delta-KV
#      at keep ratios 0.5 / 0.33 (32K, 128K) and 0.5 (262K) against cuDNN (benches/issue21_s4.py);
#   2. dense designs at 8K / 32K / 128K beside cuDNN, and the start's dense kernel in its own process;
#   3. ncu of our dense kernel and cuDNN's at 8K, D 128;
#   4. what session 3 owed: the 64 x 64 column plans before / after the unmasked column tiles beside
#      their block twins at 32K, both D (128K if time is left);
#   5. compute-sanitizer memcheck of the new paths at small N, to the end.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
R=$(cd "$(dirname "$0")/.." && pwd)
MODE=${1:-main}  # main: the first call; second: what the first call's step limits cut
BEFORE=${2:-}
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
LIMIT=${LIMIT:-268}
T0=$SECONDS
left() { echo $((LIMIT - (SECONDS - T0))); }
link() {  # SRC DEST: the installed layout by links, no install
    rm -rf "$2"; mkdir -p "$2"; cp -r "$1/sparseprefill" "$2/"
    for d in reference fast conformance; do ln -s "$1/$d" "$2/sparseprefill/$d"; done
}
LOG=$OUT/run.log
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee "$LOG"
link "$R" /tmp/L/after
export PYTHONPATH=/tmp/L/after
S=$R/benches
cd /tmp
# CPU only, while the GPU works: the bench workloads for the owed column plans.
python "$S/discrete_keys.py" workload --seqlens 32768 --head-dims 128,64 > /tmp/wl.log 2>&1 &
step() { local name=$1 limit=$2; shift 2; local l; l=$(left)
    if [ "$l" -lt 15 ]; then echo "=== $name skipped (${l}s left)" | tee -a "$LOG"; return; fi
    [ "$limit" -gt "$l" ] && limit=$l
    echo "=== $name (limit ${limit}s)" | tee -a "$LOG"; local t=$SECONDS
    timeout "$limit" "$@" 2>&1 | grep -v -i "warn" | tee -a "$LOG"
    echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS - t))s" | tee -a "$LOG"; }
if [ "$MODE" = main ]; then
step parts 80 python "$S/issue21_s4.py" --parts ragged,varlen,delta --json "$OUT/s4-parts.json"
wait  # the workloads (CPU, started first)
cat /tmp/wl.log >> "$LOG"
P="columns20,blocks_like_columns20,flexprefill_vs_0.95_lines,blocks_like_flexprefill_vs_0.95_lines"
P="$P,vertical_slash,blocks_like_vertical_slash"
step owed-32k 50 python "$S/kernel_variants.py" --seqlens 32768 --head-dims 128,64 --plans "$P" \
    --warmup 10 --rep 60 --variants "before:COL_SPLIT=0;after:COL_SPLIT=1" --json "$OUT/owed-columns-32k.json"
step memcheck 30 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python "$S/issue21_s4.py" --parts small --json /tmp/small.json
step memcheck-columns 30 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python "$S/discrete_keys.py" run --sanitize --label san --seqlens 1500 --heads 4 --kv-heads 2 \
    --plans anchor_attention,columns20,flexprefill_vs_0.95_lines,vertical_slash --json /tmp/san.json
step dense 45 python "$S/issue21_s4.py" --parts dense --json "$OUT/s4-dense.json"
step ncu 30 ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section SchedulerStats --section InstructionStats \
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis -f -o /tmp/ncu8k \
    python "$S/issue21_s4.py" --parts ncu --json /tmp/ncu.json
ncu --import /tmp/ncu8k.ncu-rep --page details > "$OUT/ncu-8k-dense.txt" 2>&1
if [ -n "$BEFORE" ]; then
    link "$BEFORE" /tmp/L/before
    PYTHONPATH=/tmp/L/before step dense-before 20 python "$S/issue21_s4.py" --parts dense \
        --dense 8192:128,32768:128 --json /tmp/dense-before.json
    cp /tmp/dense-before.json "$OUT/s4-dense-before.json" 2>/dev/null
fi
fi
if [ "$MODE" = second ]; then
    # Cut from the first call: the memcheck runs (new flat-TMA paths; the two column plans it did
    # not reach), the owed column plans at D 64, Delta-KV at 262K.
    python "$S/discrete_keys.py" workload --seqlens 32768 --head-dims 64 > /tmp/wl.log 2>&1 &
    step memcheck 40 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python "$S/issue21_s4.py" --parts ragged,varlen --small --flat-tma-only --json /tmp/small.json
    step memcheck-columns 30 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python "$S/discrete_keys.py" run --sanitize --label san --seqlens 1500 --heads 4 --kv-heads 2 \
        --plans flexprefill_vs_0.95_lines,vertical_slash --json /tmp/san.json
    wait; cat /tmp/wl.log >> "$LOG"
    P="columns20,blocks_like_columns20,flexprefill_vs_0.95_lines,blocks_like_flexprefill_vs_0.95_lines"
    P="$P,vertical_slash,blocks_like_vertical_slash"
    step owed-32k-d64 40 python "$S/kernel_variants.py" --seqlens 32768 --head-dims 64 --plans "$P" \
        --warmup 10 --rep 60 --variants "before:COL_SPLIT=0;after:COL_SPLIT=1;before2:COL_SPLIT=0;after2:COL_SPLIT=1" \
        --json "$OUT/owed-columns-32k-d64.json"
    step delta-262k 35 python "$S/issue21_s4.py" --parts delta --delta-seqlens 262144 --json "$OUT/s4-delta-262k.json"
    step varlen 18 python "$S/issue21_s4.py" --parts varlen --flat-tma-only --json "$OUT/s4-varlen.json"
fi
grep -E "ERROR SUMMARY|ran under|=== memcheck" "$LOG" > "$OUT/sanitizer.txt"
grep -E "^\s+(Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Executed Instructions  )|^  [a-z_]+.*\(" "$OUT/ncu-8k-dense.txt" | head -40
grep -E "ragged_vs_dense|varlen_over|keep_ratio|vs_cudnn=|block path|cuDNN [0-9]|rc=" "$LOG" | cut -c1-230
