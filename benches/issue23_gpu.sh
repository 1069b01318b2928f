#!/usr/bin/env bash
# Issue 23's device call, one call from a carried copy holding the code, the capture, a fit
# and the peer scratch copy (optional):
#   source benches/device_env.sh; OUT=$OUT bash benches/issue23_gpu.sh qkv3.pt calB.json peer
# 1. (CPU, in the background, FIT_THREADS threads each) the shared fit with query runs fitted
#    jointly with the vertical share (`calibrate_workload.py --shared --joint-runs`) of every
#    captured layer, one process per layer, at most FIT_S seconds;
# 2. (GPU) the equal-recall table: the calibrated workload at SEQLENS, then the capture
#    (QKV_METHODS only: the rest were measured before), SOURCE_S seconds per source in order;
#    FlexAttention on FLEX_METHODS' timed plans; the peers that import;
# 3. (GPU) the calibration acceptance of the new fit (and then of CAL) on ACCEPT_HEADS
#    (layer:query head), ACCEPT_S seconds each at most.
set -u -o pipefail
QKV=${1:?capture}; CAL=${2:?calibration}; PEER=${3:-}
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SEQLENS=${SEQLENS:-"32768 131072"}; SOURCE_S=${SOURCE_S:-"60 80 15"}; METHOD_S=${METHOD_S:-25}
QKV_METHODS=${QKV_METHODS:-"minference flexprefill_vs shareprefill"}
FLEX_METHODS=${FLEX_METHODS:-"xattention streaming"}
METHODS=${METHODS:-"xattention streaming vertical_slash minference flexprefill_vs anchor_attention a_shape block_sparse sample_attention shareprefill dpxa"}
ACCEPT_METHODS=${ACCEPT_METHODS:-"vertical_slash block_sparse xattention anchor_attention streaming a_shape"}
TOTAL_S=${TOTAL_S:-255}; T0=$(date +%s)
FIT_LAYERS=${FIT_LAYERS:-"2 14 27"}; FIT_S=${FIT_S:-200}; FIT_THREADS=${FIT_THREADS:-4}; FIT_IT=${FIT_IT:-8}
ACCEPT_HEADS=${ACCEPT_HEADS:-"14:1 2:4 27:4"}; ACCEPT_S=${ACCEPT_S:-20}
python -c "import torch; print(torch.cuda.get_device_name(), torch.__version__)"
pids=""
for l in $FIT_LAYERS; do
  OMP_NUM_THREADS=$FIT_THREADS MKL_NUM_THREADS=$FIT_THREADS timeout "$FIT_S" \
    python benches/calibrate_workload.py --qkv "$QKV" --layers "$l" --shared --joint-runs \
      --iterations "$FIT_IT" --rows 128 --calibration "$OUT/fit-joint-l$l.json" \
      --json "$OUT/fit-joint-report-l$l.json" >"$OUT/fit-joint-l$l.log" 2>&1 &
  pids="$pids $!"
done
OMP_NUM_THREADS=4 python benches/equal_recall.py --measure --qkv "$QKV" --qkv-last --seqlens $SEQLENS \
    --calibration "$CAL" --q-heads 12 --kv-heads 4 --rep 30 --methods $METHODS --source-budget-s $SOURCE_S --method-s "$METHOD_S" \
    --qkv-methods $QKV_METHODS --flex-methods $FLEX_METHODS ${PEER:+--peer "$PEER"} \
    --points-json "$OUT/points.json" --json "$OUT/equal-recall.json" --png "$OUT/equal-recall.png" \
    >"$OUT/equal-recall.log" 2>&1
grep -v "^|" "$OUT/equal-recall.log" | grep -v "^s " | tail -n 60
for p in $pids; do wait "$p"; echo "fit process $p: exit $?"; done
tail -n 3 "$OUT"/fit-joint-l*.log
fits=$(ls "$OUT"/fit-joint-l*.json 2>/dev/null | grep -v report)
accept() {  # $1 = calibration, $2 = name
  for item in $ACCEPT_HEADS; do
    [ $(( $(date +%s) - T0 + ACCEPT_S )) -lt "$TOTAL_S" ] || { echo "acceptance $2 $item: out of time"; continue; }
    timeout "$ACCEPT_S" python benches/calibration_acceptance.py --qkv "$QKV" --calibration "$1" \
        --layers "${item%%:*}" --query-heads "${item##*:}" --backend fast --device cuda --methods $ACCEPT_METHODS \
        --json "$OUT/acceptance-$2-l${item%%:*}-h${item##*:}.json" 2>>"$OUT/acceptance.log" | tail -n 18
  done
}
if [ -n "$fits" ]; then
  python benches/calibrate_workload.py --join $fits --calibration "$OUT/fit-joint.json"
  accept "$OUT/fit-joint.json" joint
fi
accept "$CAL" "$(basename "$CAL" .json)"
