#!/usr/bin/env bash
# Issue 22, session 4, second device call: DPXA's scoring configurations around the first
# call's best (benches/estimator_shares_gpu.sh), the kept defaults' tie check against the
# unsplit kernels, an ncu profile of the kept DPXA kernel, and the GPU conformance of the
# methods whose kernels changed:
#   OUT=dir BUDGET_S=150 bash benches/estimator_shares_gpu2.sh
set -u
T0=$(date +%s)
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-150}
DEADLINE=$((T0 + BUDGET_S))
CACHE=/tmp/estimator_stages
S=benches/estimator_shares.py
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
source benches/device_env.sh .
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
build() {
  OMP_NUM_THREADS=$3 python3 -c "
import sys, torch; torch.set_num_threads($3); sys.path.insert(0, 'benches'); import estimator_stages as e
e.workload($1, torch.device('cpu'), '$CACHE', head_dim=$2)"
}
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
build 32768 128 16
build 131072 128 12 & pid=$!
CONFIGS="[(32,32,64,32,False,4,2),(64,64,64,0,False,4,2),(32,32,64,16,False,4,2),(32,32,64,64,False,4,2),\
(32,32,32,32,False,4,2),(16,16,64,32,False,4,2),(32,32,64,32,False,2,2),(32,32,64,32,True,4,2)]"
for n in 32768 131072; do
  [ $n = 131072 ] && wait $pid
  el "N=$n"
  python3 $S --seqlens $n --methods dpxa xattention --dpxa-variants --dpxa-configs "$CONFIGS" --tie-check \
    --deadline $DEADLINE --json "$OUT/after2-$n.json"
  if [ $n = 32768 ]; then
    el "ncu of the kept DPXA kernel at 32K"
    timeout 40 ncu --clock-control none --kernel-name regex:_anchor_tile_kernel --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SchedulerStats --section MemoryWorkloadAnalysis \
      python3 $S --ncu-dpxa --seqlens 32768 --dpxa-configs "[(32,32,64,32,False,4,2)]" > "$OUT/ncu2-dpxa-32k.txt" 2>&1
    grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Memory Throughput|Issued Warp|No Eligible|Grid Size|Waves Per SM|Block Limit Reg" "$OUT/ncu2-dpxa-32k.txt"
  fi
done
left=$(( DEADLINE - $(date +%s) + 20 ))
el "GPU conformance (${left}s left)"
if [ $left -gt 20 ]; then
  timeout $left python3 -m sparseprefill.conformance --device cuda --max-seqlen 4096 --examples 4 \
    --methods dpxa,xattention,flexprefill_vs --no-kernel --json "$OUT/conformance.json" > "$OUT/conformance.txt" 2>&1
  echo "conformance rc=$?"; tail -n 15 "$OUT/conformance.txt"
fi
el done
