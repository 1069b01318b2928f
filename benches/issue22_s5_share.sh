#!/usr/bin/env bash
# Issue 22, fifth session, shareprefill / sample_attention host work (one device call):
# plans before (BEFORE) / after at 32K (128K for shareprefill) D128 beside cuDNN, the
# superseded designs as variants, GPU conformance, compile_check of shareprefill.
#   OUT=dir BUDGET_S=120 bash benches/issue22_s5_share.sh BEFORE
set -u
T0=$(date +%s)
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
BEFORE=$(cd "$1" && pwd)
DEADLINE=$((T0 + ${BUDGET_S:-120}))
CACHE=/tmp/estimator_stages
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
source benches/device_env.sh .
( cd "$BEFORE" && source benches/device_env.sh . )
nvidia-smi --query-gpu=name --format=csv,noheader
el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( DEADLINE - $(date +%s) )); }
build() {
  OMP_NUM_THREADS=$2 python3 -c "
import sys, torch; torch.set_num_threads($2); sys.path.insert(0, 'benches'); import estimator_stages as e
e.workload($1, torch.device('cpu'), '$CACHE')"
}
mkdir -p $CACHE
build 32768 16
M="--methods shareprefill sample_attention"
el "32K after + variants"
python3 benches/issue22_s5_share.py --seqlens 32768 $M --variants --deadline $DEADLINE --json "$OUT/after-32k.json" 2>&1 | grep -v Warn | grep -E "N=|Error"
el "32K before"
PYTHONPATH=$BEFORE python3 benches/issue22_s5_share.py --tag before --seqlens 32768 $M --deadline $DEADLINE --json "$OUT/before-32k.json" 2>&1 | grep -v Warn | grep -E "N=|Error"
build 131072 12 & p128=$!
el "GPU conformance ($(left)s left)"
( cd /tmp && timeout $(( $(left) < 150 ? $(left) - 25 : 150 )) python3 -m sparseprefill.conformance --device cuda --max-seqlen 8192 --examples 6 \
  --row-budget 6 --methods shareprefill,sample_attention --properties plan,end_to_end,estimate --json "$OUT/conformance.json" ) > "$OUT/conformance.txt" 2>&1
echo "conformance rc=$?"; grep -E "PASS|FAIL|ERROR" "$OUT/conformance.txt" | tail -12
el "compile_check shareprefill ($(left)s left)"
timeout 30 python3 benches/compile_check.py --methods shareprefill sample_attention --compile-methods --json "$OUT/compile_check.json" > "$OUT/compile_check.txt" 2>&1
echo "compile_check rc=$?"; grep -E " OK | FAIL | SKIP " "$OUT/compile_check.txt" | head -8
wait $p128
el "128K shareprefill after / before ($(left)s left)"
python3 benches/issue22_s5_share.py --seqlens 131072 --methods shareprefill --deadline $DEADLINE --json "$OUT/after-128k.json" 2>&1 | grep -v Warn | grep -E "N=|Error"
PYTHONPATH=$BEFORE python3 benches/issue22_s5_share.py --tag before --seqlens 131072 --methods shareprefill --deadline $DEADLINE --json "$OUT/before-128k.json" 2>&1 | grep -v Warn | grep -E "N=|Error"
el done
