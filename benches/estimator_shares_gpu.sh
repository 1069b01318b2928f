#!/usr/bin/env bash
# Issue 22's one-call table on one GPU (session 4): every method's plan as a share of cuDNN
# dense at 32K / 128K, D = 128 and 64 (benches/estimator_shares.py), DPXA's scoring variants
# and XAttention's key splits, an ncu profile of DPXA's scoring kernel, the code in BEFORE
# (DPXA and XAttention only: plan hashes and times) and benches/compile_check.py last:
#   OUT=dir BUDGET_S=230 bash benches/estimator_shares_gpu.sh BEFORE
# Run from this checkout's root. BUDGET_S stops starting sections that many seconds after
# the start (compile_check gets what is left, killed at the budget).
set -u
T0=$(date +%s)
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
BEFORE=$(cd "$1" && pwd)
BUDGET_S=${BUDGET_S:-230}
DEADLINE=$((T0 + BUDGET_S))
CACHE=/tmp/estimator_stages
S=benches/estimator_shares.py
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
source benches/device_env.sh .
AFTER=$PWD
( cd "$BEFORE" && source benches/device_env.sh . )
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p $CACHE
build() {  # one workload into the cache (float64 on the CPU)
  OMP_NUM_THREADS=$3 python3 -c "
import sys, torch; torch.set_num_threads($3); sys.path.insert(0, 'benches'); import estimator_stages as e
e.workload($1, torch.device('cpu'), '$CACHE', head_dim=$2)"
}
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
build 32768 128 16
pids=""
for w in "131072 128" "32768 64" "131072 64"; do build $w 4 & pids="$pids $!"; done
el "32K D128 after (all methods, DPXA variants, flexprefill_vs profile, XAttention key splits)"
python3 $S --seqlens 32768 --dpxa-variants --profile-flex --key-splits --deadline $DEADLINE \
  --json "$OUT/after-32k-d128.json"
el "ncu of DPXA scoring at 32K"
timeout 60 ncu --clock-control none --kernel-name regex:_anchor_tile_kernel --launch-count 2 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis \
  python3 $S --ncu-dpxa --seqlens 32768 > "$OUT/ncu-dpxa-32k.txt" 2>&1
grep -E "ncu-dpxa config|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Memory Throughput|Warp Cycles Per Issued|Issued Warp|No Eligible|Grid Size|Waves Per SM|Block Limit" "$OUT/ncu-dpxa-32k.txt" | head -40
el "32K D128 before (dpxa, flexprefill_vs)"
PYTHONPATH=$BEFORE python3 $S --tag before --seqlens 32768 --methods dpxa flexprefill_vs --deadline $DEADLINE \
  --json "$OUT/before-32k-d128.json"
wait $pids
el "128K D128 after"
python3 $S --seqlens 131072 --dpxa-variants --key-splits --deadline $DEADLINE --json "$OUT/after-128k-d128.json"
el "D64 after"
python3 $S --head-dims 64 --seqlens 32768 131072 --deadline $DEADLINE --json "$OUT/after-d64.json"
python3 $S --table "$OUT"/after-32k-d128.json "$OUT"/after-128k-d128.json "$OUT"/after-d64.json \
  "$OUT"/before-32k-d128.json > /tmp/shares.md 2>/dev/null
left=$(( DEADLINE - $(date +%s) + 25 ))
el "compile_check (${left}s left)"
if [ $left -gt 15 ]; then
  timeout $left python3 benches/compile_check.py --json "$OUT/compile_check.json" > "$OUT/compile_check.txt" 2>&1
  echo "compile_check rc=$? lines OK: $(grep -c ' OK ' "$OUT/compile_check.txt")"
  grep -E " FAIL " "$OUT/compile_check.txt" | head -20
fi
el done
grep -E "\| plan \|" /tmp/shares.md
