#!/usr/bin/env bash
# Issue 22, fifth session, device call 1: where every `*_plan` spends its time (stage tree,
# kernels, host syncs; benches/estimator_profile.py) at 32K and 128K, D128, and an ncu profile of
# the last-q estimate's kernels (`_lse_partial_kernel`, `_vertical_kernel`, `_slash_kernel`) at 32K.
#   OUT=dir BUDGET_S=200 bash benches/issue22_s5_call1.sh
set -u
T0=$(date +%s)
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-200}
CACHE=/tmp/estimator_stages
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
source benches/device_env.sh .
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
build() {
  OMP_NUM_THREADS=$3 python3 -c "
import sys, torch; torch.set_num_threads($3); sys.path.insert(0, 'benches'); import estimator_stages as e
e.workload($1, torch.device('cpu'), '$CACHE', head_dim=$2)"
}
mkdir -p $CACHE
build 32768 128 16
build 131072 128 12 & bp=$!
el "profile 32K"
timeout $(( BUDGET_S - 60 )) python3 benches/estimator_profile.py --seqlens 32768 --json "$OUT/profile-32k-d128.json" \
  2>&1 | grep -v Warning | tee "$OUT/profile-32k-d128.log"
el "ncu last-q kernels 32K"
timeout 50 ncu --clock-control none --kernel-name regex:"_slash_kernel|_vertical_kernel|_lse_partial_kernel" \
  --launch-count 3 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis --section InstructionStats --section ComputeWorkloadAnalysis \
  python3 -c "
import sys, torch; sys.path.insert(0, 'benches'); import estimator_stages as e
from sparseprefill.fast.kernels.last_q_estimate import last_q_scores
q, k, _ = e.workload(32768, torch.device('cuda'), '$CACHE'); last_q_scores(q, k, last_q=64); torch.cuda.synchronize()
" > "$OUT/ncu-lastq-32k.txt" 2>&1
grep -E "^  _|Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Memory Throughput|Warp Cycles Per Issued|Issued Warp|No Eligible|Grid Size|Waves Per SM|Shared.*Bank|Executed Ipc|L1/TEX Hit|Stall" "$OUT/ncu-lastq-32k.txt" | head -60
wait $bp
left=$(( T0 + BUDGET_S - $(date +%s) ))
el "profile 128K (${left}s left)"
[ $left -gt 20 ] && timeout $left python3 benches/estimator_profile.py --seqlens 131072 \
  --json "$OUT/profile-128k-d128.json" 2>&1 | grep -v Warning | tee "$OUT/profile-128k-d128.log"
el done
