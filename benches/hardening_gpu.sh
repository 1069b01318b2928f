#!/bin/bash
# Issue 26's GPU evidence in one call (results under $OUT):
#   1. compute-sanitizer memcheck over the hostile packed K/V cases (guard on: 0 errors expected),
#      then the ragged cases with the kernel's guard compiled out (shows memcheck sees the reads);
#   2. the guard's cost on the packed-K/V kernels, guarded vs unguarded, same run;
#   3. every registered method at 512K and 1M tokens (benches/scale_run.py).
# Usage (device): OUT=... bash benches/hardening_gpu.sh [scale budget s]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${1:-130}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 75 compute-sanitizer --tool memcheck --error-exitcode 9 python benches/sanitize_kernels.py cuda 1000 packed \
    > "$OUT/sanitize-packed.txt" 2>&1; echo "rc=$?" >> "$OUT/sanitize-packed.txt"
tail -4 "$OUT/sanitize-packed.txt"
timeout 45 python benches/guard_cost.py --packed --seqlen 65536 --json "$OUT/guard-cost-packed.json" \
    > "$OUT/guard-cost-packed.txt" 2>&1; echo "rc=$?" >> "$OUT/guard-cost-packed.txt"
cat "$OUT/guard-cost-packed.txt"
timeout $((BUDGET + 40)) python benches/scale_run.py --budget-s "$BUDGET" --method-limit-s 48 \
    --json "$OUT/scale.json" > "$OUT/scale.txt" 2>&1; echo "rc=$?" >> "$OUT/scale.txt"
tail -45 "$OUT/scale.txt"
