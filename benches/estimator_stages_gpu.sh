#!/usr/bin/env bash
# Issue 22's estimator table on one GPU: the code in BEFORE and this tree in one run, cuDNN
# beside, FlexPrefill's own code (a scratch copy in PEER, never part of this repository):
#   OUT=dir bash benches/estimator_stages_gpu.sh BEFORE [PEER]
# SEQLENS (default "32768 131072": the first is run before and after while the other
# workloads are built in the background, float64 on the CPU, about a minute at 128K) and METHODS (default "dpxa xattention
# flexprefill_vs") narrow it. BUDGET_S (default 0: none) stops starting new sections that
# many seconds after the start, so a device call's limit cuts the tail, not the middle;
# the GPU conformance of the changed methods runs last, if 90 s of the budget are left (then killed 30 s
# past the budget). WORKLOADS, a folder of prebuilt `qkv_*.pt` (the cache's files), saves
# their build on a machine that has them (1.6 GB at 128K: too large to carry).
set -u
T0=$(date +%s)
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
BEFORE=$1; PEER=${2:-}
SEQLENS=${SEQLENS:-"32768 131072"}
METHODS=${METHODS:-"dpxa xattention flexprefill_vs"}
BUDGET_S=${BUDGET_S:-0}
CACHE=/tmp/estimator_stages
S=benches/estimator_stages.py
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
DEADLINE=inf; [ "$BUDGET_S" -gt 0 ] && DEADLINE=$((T0 + BUDGET_S))
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/es-before "$BEFORE" >/dev/null 2>&1 || echo "install of $BEFORE failed"
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/es-after . >/dev/null 2>&1 || echo "install of . failed"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p $CACHE; [ -n "${WORKLOADS:-}" ] && cp "$WORKLOADS"/qkv_*.pt $CACHE/ 2>/dev/null
first=${SEQLENS%% *}; rest=${SEQLENS#"$first"}
# Every workload not carried, built in parallel in the background (4 threads each).
pids=""
for d in 128 64; do for n in $SEQLENS; do
  OMP_NUM_THREADS=4 PYTHONPATH=/tmp/es-after python3 -c "
import sys, torch; torch.set_num_threads(4); sys.path.insert(0, 'benches'); import estimator_stages as e
e.workload($n, torch.device('cpu'), '$CACHE', head_dim=$d)" & pids="$pids $!"
  [ "$d $n" = "128 $first" ] && { wait $!; }  # the first one is needed at once
done; done
peer=${PEER:+--peer $PEER}
run() { PYTHONPATH=/tmp/es-$1 python3 $S --tag $1 --deadline $DEADLINE --methods $METHODS "${@:2}"; }
run after --seqlens $first --variants $peer --json "$OUT/after-$first.json"
run before --seqlens $first --json "$OUT/before-$first.json"
wait $pids
if [ -n "${rest// }" ]; then
  run after --seqlens $rest --variants $peer --json "$OUT/after-rest.json"
  run before --seqlens $rest --json "$OUT/before-rest.json"
fi
join() { echo "$OUT/$1-$first.json,$OUT/$1-rest.json"; }
PYTHONPATH=/tmp/es-after python3 $S --merge "$(join before)" "$(join after)" --json "$OUT/stages.json" > "$OUT/stages.md"
# The kernels this table's branch changed, against the reference, if time is left.
left=1800; [ "$BUDGET_S" -gt 0 ] && left=$(( DEADLINE - $(date +%s) + 30 ))
if [ $left -gt 120 ]; then
  PYTHONPATH=/tmp/es-after timeout $left \
    python3 -m sparseprefill.conformance --device cuda --max-seqlen 4096 --examples ${EXAMPLES:-4} \
    --methods ${CONFORMANCE:-dpxa,xattention,flexprefill_vs} --no-kernel --json "$OUT/conformance.json" | tail -n 12
else
  echo "GPU conformance skipped: less than 90 s of the budget left"
fi
run after --tag d64 --head-dim 64 --seqlens $SEQLENS $peer --json "$OUT/d64.json"
PYTHONPATH=/tmp/es-after python3 $S --merge none "$OUT/d64.json" --json "$OUT/stages-d64.json" > "$OUT/stages-d64.md"
echo "elapsed $(( $(date +%s) - T0 )) s"
grep -E "\| plan \||end to end|score|cuDNN" "$OUT/stages.md" "$OUT/stages-d64.md"
