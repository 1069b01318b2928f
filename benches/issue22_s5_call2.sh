#!/usr/bin/env bash
# Issue 22, fifth session, device call 2 (one script, one GPU): every plan as a share of cuDNN
# dense before (BEFORE: main at the session's start) and after this branch, at 32K / 128K D128
# and D64 after; the slash kernel's tiles and skews, the lse splits and the VS index walks
# (estimator_shares.py --slash-variants); the stage profile after; ncu of the new slash kernel;
# GPU conformance of the touched methods; compute-sanitizer memcheck; compile_check (capture).
#   OUT=dir BUDGET_S=540 bash benches/issue22_s5_call2.sh BEFORE
set -u
T0=$(date +%s)
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
BEFORE=$(cd "$1" && pwd)
BUDGET_S=${BUDGET_S:-540}
DEADLINE=$((T0 + BUDGET_S))
CACHE=/tmp/estimator_stages
S=benches/estimator_shares.py
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
source benches/device_env.sh .
AFTER=$PWD
( cd "$BEFORE" && source benches/device_env.sh . )
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( DEADLINE - $(date +%s) )); }
build() {
  OMP_NUM_THREADS=$3 python3 -c "
import sys, torch; torch.set_num_threads($3); sys.path.insert(0, 'benches'); import estimator_stages as e
e.workload($1, torch.device('cpu'), '$CACHE', head_dim=$2)"
}
mkdir -p $CACHE
build 32768 128 16
build 131072 128 10 & p128=$!
pids=""
for w in "32768 64" "131072 64"; do build $w 3 & pids="$pids $!"; done
el "32K D128 after: every plan, slash variants, lse splits, index walks"
python3 $S --seqlens 32768 --slash-variants --deadline $DEADLINE --json "$OUT/after-32k-d128.json" 2>&1 | grep -v Warn
el "32K D128 before"
PYTHONPATH=$BEFORE python3 $S --tag before --seqlens 32768 --deadline $DEADLINE --json "$OUT/before-32k-d128.json" 2>&1 | grep -v Warn
wait $p128
el "128K D128 after ($(left)s left)"
python3 $S --seqlens 131072 --deadline $DEADLINE --json "$OUT/after-128k-d128.json" 2>&1 | grep -v Warn
el "128K D128 before ($(left)s left)"
PYTHONPATH=$BEFORE python3 $S --tag before --seqlens 131072 --deadline $DEADLINE --json "$OUT/before-128k-d128.json" 2>&1 | grep -v Warn
el "GPU conformance ($(left)s left)"
( cd /tmp && timeout 120 python3 -m sparseprefill.conformance --device cuda --max-seqlen 8192 --examples 6 \
  --row-budget 6 --methods vertical_slash,minference,flexprefill_vs,shareprefill,delta_xattention \
  --properties plan,end_to_end,estimate --json "$OUT/conformance.json" ) > "$OUT/conformance.txt" 2>&1
echo "conformance rc=$?"; grep -E "PASS|FAIL|ERROR" "$OUT/conformance.txt" | tail -20
el "compute-sanitizer memcheck ($(left)s left)"
timeout 110 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benches/sanitize_kernels.py > "$OUT/sanitize.txt" 2>&1
echo "sanitizer rc=$?"; grep -E "ERROR SUMMARY|slash config|differ|FAIL" "$OUT/sanitize.txt" | tail -8; tail -3 "$OUT/sanitize.txt"
el "compile_check (capture) ($(left)s left)"
timeout 60 python3 benches/compile_check.py --methods minference vertical_slash shareprefill flexprefill_vs \
  --compile-methods minference --json "$OUT/compile_check.json" > "$OUT/compile_check.txt" 2>&1
echo "compile_check rc=$? OK: $(grep -c ' OK ' "$OUT/compile_check.txt") FAIL: $(grep -c ' FAIL ' "$OUT/compile_check.txt")"
grep -E " FAIL " "$OUT/compile_check.txt" | head
el "stage profile after, 32K ($(left)s left)"
timeout 45 python3 benches/estimator_profile.py --seqlens 32768 --methods vertical_slash minference shareprefill \
  flexprefill_vs delta_xattention --json "$OUT/profile-after-32k-d128.json" > "$OUT/profile-after-32k-d128.log" 2>&1
grep -E "do_bench|^\[after\]  +[0-9.]+ ms x" "$OUT/profile-after-32k-d128.log" | grep -A4 do_bench | cut -c1-140
el "ncu slash kernel (default) 32K ($(left)s left)"
[ $(left) -gt 40 ] && timeout 35 ncu --clock-control none --kernel-name regex:"_slash_kernel|_band_blocks_kernel" --launch-count 3 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
  python3 -c "
import sys, torch; sys.path.insert(0, 'benches'); import estimator_stages as e
from sparseprefill import fast
q, k, _ = e.workload(32768, torch.device('cuda'), '$CACHE')
fast.vertical_slash_plan(q, k, vertical_size=1000, slash_size=6096); torch.cuda.synchronize()
" > "$OUT/ncu-slash-32k.txt" 2>&1
grep -E "^  _|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Grid Size|Dynamic Shared" "$OUT/ncu-slash-32k.txt" | head -30
wait $pids
el "D64 after ($(left)s left)"
python3 $S --head-dims 64 --seqlens 32768 131072 --deadline $DEADLINE --json "$OUT/after-d64.json" 2>&1 | grep -v Warn
el done
