#!/usr/bin/env bash
# Issue 23's device call: the calibration acceptance on the GPU (every method's sweep on
# captured heads and on their calibrated twins, one item per head), then the equal-recall
# table (captured SmolLM2 8K layers, calibrated workload at 32K and 128K) with the peers
# that import. From a carried copy holding the code, the capture, the fits and the peer
# scratch copy (optional):
#   bash benches/issue23_gpu.sh qkv3.pt cal.json "calA.json calB.json" peer
# (the first fit drives the equal-recall table; each fit of the list gets an acceptance run,
# ACCEPT_S seconds each at most; EQUAL_S bounds the start of new methods in the table.)
set -u -o pipefail
QKV=${1:?capture}; CAL=${2:?calibration}; ACCEPT=${3:-$CAL}; PEER=${4:-}
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ACCEPT_S=${ACCEPT_S:-40}; EQUAL_S=${EQUAL_S:-130}
SEQLENS=${SEQLENS:-"32768 131072"}; HEADS=${HEADS:-"0 4 8"}
python -c "import torch; print(torch.cuda.get_device_name())"
for fit in $ACCEPT; do
  name=$(basename "$fit" .json)
  timeout $((ACCEPT_S + 20)) python benches/calibration_acceptance.py --qkv "$QKV" --calibration "$fit" \
      --query-heads $HEADS --per-head --backend fast --device cuda --budget-s "$ACCEPT_S" \
      --json "$OUT/acceptance-$name.json" 2>>"$OUT/acceptance.log" | tail -n 14
done
python benches/equal_recall.py --measure --qkv "$QKV" --seqlens $SEQLENS --calibration "$CAL" \
    --q-heads 12 --kv-heads 4 --rep 30 --budget-s "$EQUAL_S" ${PEER:+--peer "$PEER"} \
    --points-json "$OUT/points.json" --json "$OUT/equal-recall.json" --png "$OUT/equal-recall.png" \
    >"$OUT/equal-recall.log" 2>&1
grep -v "^|" "$OUT/equal-recall.log" | tail -n 45
python benches/equal_recall.py "$OUT/points.json" --json "$OUT/equal-recall.json" --png "$OUT/equal-recall.png"
