#!/usr/bin/env bash
# Issue 22, fifth session, AnchorAttention's plan: one device call. The workloads are built
# while the GPU conformance and the memcheck run, then main's plan (.carry/before) and this
# branch's (every switch combination) are timed beside cuDNN, one after the other:
#   OUT=dir BEFORE=../.carry/before BUDGET_S=170 bash benches/anchor_plan_gpu.sh
set -u
T0=$(date +%s)
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
BEFORE=${BEFORE:-../.carry/before}
BUDGET_S=${BUDGET_S:-170}
CACHE=/tmp/estimator_stages
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
source benches/device_env.sh .
AFTER_PATH=$PYTHONPATH
(cd "$BEFORE" && for d in reference fast conformance; do [ -e sparseprefill/$d ] || ln -s ../$d sparseprefill/$d; done)
BEFORE_PATH=$(cd "$BEFORE" && pwd)
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
( OMP_NUM_THREADS=12 python3 -c "
import sys, torch; torch.set_num_threads(12); sys.path.insert(0, 'benches'); import estimator_stages as e
for n in (32768, 131072): e.workload(n, torch.device('cpu'), '$CACHE', head_dim=128)" > "$OUT/build.txt" 2>&1 ) & build=$!
el "conformance"
timeout 75 python3 -m sparseprefill.conformance --device cuda --max-seqlen 8192 --examples 6 --row-budget 6 \
  --methods anchor_attention --properties plan,end_to_end,estimate,sparse_attention,resumed_attention \
  --json "$OUT/conformance.json" > "$OUT/conformance.txt" 2>&1
echo "conformance rc=$?"; tail -n 12 "$OUT/conformance.txt"
el "memcheck"
timeout 60 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benches/sanitize_kernels.py > "$OUT/memcheck.txt" 2>&1
echo "memcheck rc=$?"; grep -E "ERROR SUMMARY|ran|anchor|Error" "$OUT/memcheck.txt" | tail -n 8
wait $build; el "workloads built"; tail -n 3 "$OUT/build.txt"
el "before"
PYTHONPATH=$BEFORE_PATH timeout 60 python3 benches/anchor_plan_time.py --tag before --json "$OUT/before.json"
el "after"
PYTHONPATH=$AFTER_PATH timeout $(( BUDGET_S - $(date +%s) + T0 )) python3 benches/anchor_plan_time.py --tag after \
  --json "$OUT/after.json"
el done
