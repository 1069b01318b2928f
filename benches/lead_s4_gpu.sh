#!/usr/bin/env bash
# The lead's closing device call of 2026-11-26 (session 4): GPU conformance of the merged tree
# (the methods and kernel paths changed this session: Delta-KV's parameter check, ragged / varlen
# K/V on flat TMA, DPXA / XAttention scoring, flexprefill_vs, the kernel strategies), then issue
# 23's owed 32K equal-recall rows. From the checkout root, with the calibration carried:
#   OUT=$OUT CAL=.carryW/calB.json bash benches/lead_s4_gpu.sh
set -u -o pipefail
OUT=${OUT:-out}; CAL=${CAL:?calibration JSON}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source benches/device_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout "${CONF_S:-270}" python3 -m sparseprefill.conformance --device cuda --max-seqlen 8192 --examples 6 \
    --row-budget "${ROW_S:-8}" \
    --methods delta_kv,delta_xattention,anchor_attention,shareprefill,flexprefill_vs,dpxa,xattention \
    --properties plan,end_to_end,sparse_attention,masked_attention,resumed_attention,nonfinite,block_means,recall_density_random \
    --json "$OUT/conformance.json" >"$OUT/conformance.txt" 2>&1
echo "conformance exit $?"; grep -E "PASS|FAIL|passed|failed" "$OUT/conformance.txt" | tail -n 24
timeout "${ER_S:-190}" python3 benches/equal_recall.py --measure --seqlens 32768 --calibration "$CAL" --q-heads 12 \
    --kv-heads 4 --rep 30 --methods shareprefill dpxa sample_attention minference --method-s "${METHOD_S:-40}" \
    --points-json "$OUT/points-32k-rest.json" --json "$OUT/equal-recall-32k-rest.json" >"$OUT/equal-recall.log" 2>&1
echo "equal_recall exit $?"; grep -v "^|" "$OUT/equal-recall.log" | cut -c1-200 | tail -n 12; grep "^|" "$OUT/equal-recall.log" | tail -n 12
