#!/usr/bin/env bash
# Issue 22's estimator table on one GPU: the code in BEFORE and this tree in one run, cuDNN
# beside, FlexPrefill's own code (a scratch copy in PEER, never part of this repository):
#   OUT=dir bash benches/estimator_stages_gpu.sh BEFORE [PEER]
# SEQLENS (default "32768 131072") and METHODS (default "flexprefill_vs xattention dpxa")
# narrow it. About 7 minutes on an H100 with the defaults; the workloads are built first
# (float64 on the CPU, about a minute at 128K) and shared by every run through the cache.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
BEFORE=$1; PEER=${2:-}
SEQLENS=${SEQLENS:-"32768 131072"}
METHODS=${METHODS:-"flexprefill_vs xattention dpxa"}
S=benches/estimator_stages.py
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/es-before "$BEFORE" >/dev/null 2>&1 || echo "install of $BEFORE failed"
python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/es-after . >/dev/null 2>&1 || echo "install of . failed"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for d in 128 64; do
  PYTHONPATH=/tmp/es-after python3 -c "
import sys, torch; sys.path.insert(0, 'benches'); import estimator_stages as e
for n in map(int, '$SEQLENS'.split()): e.workload(n, torch.device('cpu'), '/tmp/estimator_stages', head_dim=$d)"
done
peer=${PEER:+--peer $PEER}
PYTHONPATH=/tmp/es-before python3 $S --tag before --seqlens $SEQLENS --methods $METHODS --json "$OUT/before.json"
PYTHONPATH=/tmp/es-after python3 $S --tag after --seqlens $SEQLENS --methods $METHODS --variants $peer --json "$OUT/after.json"
PYTHONPATH=/tmp/es-after python3 $S --merge "$OUT/before.json" "$OUT/after.json" --json "$OUT/stages.json" > "$OUT/stages.md"
PYTHONPATH=/tmp/es-after python3 $S --tag d64 --head-dim 64 --seqlens $SEQLENS --methods flexprefill_vs xattention $peer \
  --json "$OUT/d64.json"
PYTHONPATH=/tmp/es-after python3 $S --merge none "$OUT/d64.json" --json "$OUT/stages-d64.json" > "$OUT/stages-d64.md"
# The kernels this table's branch changed (band_index, the scoring orders), against the reference.
PYTHONPATH=/tmp/es-after python3 -m sparseprefill.conformance --device cuda --max-seqlen 4096 --examples 10 \
  --methods flexprefill_vs,xattention --no-kernel --json "$OUT/conformance.json" | tail -n 6
grep -E "\| plan \||end to end|cuDNN" "$OUT/stages.md" "$OUT/stages-d64.md"
