#!/usr/bin/env bash
# Issue 23's second device call: what the first (`issue23_gpu.sh`, 2026-11-26) left out when its
# per-source budgets ran out: the remaining methods at 32K and at 128K, the peers there, the
# capture's FlexPrefill-style and SharePrefill rows, the fits again (their JSONs did not come
# back: at most 8 files return, so everything now goes back in one tar), and the acceptance
# items the first call cut. From the carried copy:
#   source benches/device_env.sh; OUT=$OUT bash benches/issue23_gpu_rest.sh qkv3.pt calB.json peer
set -u -o pipefail
QKV=${1:?capture}; CAL=${2:?calibration}; PEER=${3:-}
OUT=${OUT:-out}; W=$(mktemp -d); mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s); TOTAL_S=${TOTAL_S:-285}
python -c "import torch; print(torch.cuda.get_device_name(), torch.__version__)"
pids=""
for l in 2 14 27; do
  OMP_NUM_THREADS=4 MKL_NUM_THREADS=4 timeout 220 python benches/calibrate_workload.py --qkv "$QKV" --layers "$l" \
    --shared --joint-runs --iterations 8 --rows 128 --calibration "$W/fit-joint-l$l.json" \
    --json "$W/fit-joint-report-l$l.json" >"$W/fit-joint-l$l.log" 2>&1 &
  pids="$pids $!"
done
er() {  # $1 = name, rest = arguments
  local name=$1; shift
  OMP_NUM_THREADS=4 python benches/equal_recall.py --measure --calibration "$CAL" --q-heads 12 --kv-heads 4 \
      --rep 30 ${PEER:+--peer "$PEER" --peers-first} \
      --points-json "$W/points-$name.json" --json "$W/equal-recall-$name.json" "$@" >"$W/equal-recall-$name.log" 2>&1
  grep -v "^|" "$W/equal-recall-$name.log" | cut -c1-220 | tail -n 30
}
er 32k --seqlens 32768 --methods minference flexprefill_vs anchor_attention a_shape block_sparse sample_attention \
    shareprefill dpxa --source-budget-s 95 --method-s 20
er 128k --seqlens 131072 --qkv "$QKV" --qkv-last --qkv-methods flexprefill_vs shareprefill --methods a_shape \
    block_sparse sample_attention shareprefill anchor_attention dpxa --source-budget-s 95 25 --method-s 30
for p in $pids; do wait "$p"; echo "fit process $p: exit $?"; done
tail -qn 2 "$W"/fit-joint-l*.log
python benches/calibrate_workload.py --join "$W"/fit-joint-l2.json "$W"/fit-joint-l14.json "$W"/fit-joint-l27.json \
    --calibration "$W/fit-joint.json"
for item in "$W/fit-joint.json:joint:14:1" "$CAL:calB:27:4"; do
  IFS=: read -r cal name layer head <<<"$item"
  left=$(( TOTAL_S - ($(date +%s) - T0) )); [ "$left" -gt 15 ] || { echo "acceptance $name $layer: out of time"; continue; }
  timeout "$left" python benches/calibration_acceptance.py --qkv "$QKV" --calibration "$cal" --layers "$layer" \
      --query-heads "$head" --backend fast --device cuda --methods vertical_slash block_sparse xattention \
      anchor_attention streaming a_shape --json "$W/acceptance-$name-l$layer-h$head.json" 2>>"$W/acceptance.log" \
      | tail -n 12
done
tar czf "$OUT/issue23-rest.tgz" -C "$W" .
cp "$W"/equal-recall-*.json "$OUT/" 2>/dev/null
ls -la "$OUT"
