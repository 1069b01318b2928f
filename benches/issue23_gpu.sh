#!/usr/bin/env bash
# Issue 23's device call: the calibration acceptance on the GPU (every method's sweep on
# captured heads and on their calibrated twins), then the equal-recall table (captured
# SmolLM2 8K layers, calibrated workload at 32K and 128K) with the peers that import.
# Run from a carried copy holding the code, the capture (QKV), the fit (CAL) and the peer
# scratch copy (PEER, optional):
#   bash benches/issue23_gpu.sh qkv3.pt cal.json peer
set -u -o pipefail
QKV=${1:?capture}; CAL=${2:?calibration}; PEER=${3:-}
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ACCEPT_S=${ACCEPT_S:-70}; EQUAL_S=${EQUAL_S:-130}
SEQLENS=${SEQLENS:-"32768 131072"}; HEADS=${HEADS:-"0 4 8"}
python -c "import torch; print(torch.cuda.get_device_name())" | tee "$OUT/device.txt"
timeout $((ACCEPT_S + 15)) python benches/calibration_acceptance.py --qkv "$QKV" --calibration "$CAL" \
    --query-heads $HEADS --per-head --backend fast --device cuda --budget-s "$ACCEPT_S" \
    --json "$OUT/acceptance.json" 2>"$OUT/acceptance.log" | tail -n 25
python benches/equal_recall.py --measure --qkv "$QKV" --seqlens $SEQLENS --calibration "$CAL" \
    --q-heads 12 --kv-heads 4 --rep 30 --budget-s "$EQUAL_S" ${PEER:+--peer "$PEER"} \
    --points-json "$OUT/points.json" --json "$OUT/equal-recall.json" --png "$OUT/equal-recall.png" 2>&1 \
    | tee "$OUT/equal-recall.log" | grep -v "^|" | tail -n 60
python benches/equal_recall.py "$OUT/points.json" --json "$OUT/equal-recall.json" --png "$OUT/equal-recall.png" \
    | tail -n 70
