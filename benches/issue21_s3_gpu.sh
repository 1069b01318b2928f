#!/usr/bin/env bash
# Issue 21, session 3 device calls (run from a copy of this checkout; $OUT collects results).
#   probe: ncu on anchor_attention's plan and its block-path twin at 32K (D 128), then the
#          column-loop variants (unmasked column tiles, 64-key column tiles) at 32K for
#          D 128 / 64, and dense tile shapes at 8K / 32K for D 128 / 64, all beside cuDNN.
#   final: before / after (COL_SPLIT=0 / 1 in one process) at 32K and 128K, dense grid orders,
#          sanitizer (steps cut short by design: a 170 s call).
#   owed:  what final cut (about 4 to 8 minutes).
set -uo pipefail
MODE=$1; shift
OUT=${OUT:-/tmp/out}
R=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
link() {  # SRC DEST: the installed layout (package-dir mapping) by links, no install
    rm -rf "$2"; mkdir -p "$2"; cp -r "$1/sparseprefill" "$2/"
    for d in reference fast conformance; do ln -s "$1/$d" "$2/sparseprefill/$d"; done
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader | tee "$OUT/gpu.txt"
link "$R" /tmp/L/after
export PYTHONPATH=/tmp/L/after
S=$R/benches
if [ "$MODE" = probe ]; then
    python "$S/discrete_keys.py" workload --seqlens 32768 --head-dims 128 > "$OUT/workload.log" 2>&1
    python "$S/discrete_keys.py" workload --seqlens 8192,32768 --head-dims 64,128 >> "$OUT/workload.log" 2>&1 &
    timeout 70 ncu --profile-from-start off --clock-control none --kernel-name regex:_block_column_fwd \
        --set full --import-source no -f -o /tmp/ncu-32k \
        python "$S/discrete_keys.py" profile --seqlens 32768 --plans anchor_attention,blocks_like_anchor_attention \
        > "$OUT/ncu.log" 2>&1
    wait
    ncu --import /tmp/ncu-32k.ncu-rep --page details > "$OUT/ncu-32k.txt" 2>&1
    ncu --import /tmp/ncu-32k.ncu-rep --page raw --csv > /tmp/ncu-raw.csv 2>&1; gzip -c /tmp/ncu-raw.csv > "$OUT/ncu-32k-raw.csv.gz"
    timeout 60 python "$S/kernel_variants.py" --seqlens 32768 --head-dims 128 \
        --plans anchor_attention,blocks_like_anchor_attention \
        --variants "nosplit:COL_SPLIT=0;split:COL_SPLIT=1;split64:COL_SPLIT=1,COL_TILE=64;nosplit64:COL_SPLIT=0,COL_TILE=64" \
        --json "$OUT/anchor-variants-d128.json" 2>&1 | grep -v Warn | tee "$OUT/variants.log"
    timeout 35 python "$S/kernel_variants.py" --seqlens 32768 --head-dims 64 \
        --plans anchor_attention,blocks_like_anchor_attention --variants "nosplit:COL_SPLIT=0;split:COL_SPLIT=1" \
        --json "$OUT/anchor-variants-d64.json" 2>&1 | grep -v Warn | tee -a "$OUT/variants.log"
    timeout 40 python "$S/kernel_variants.py" --seqlens 8192,32768 --head-dims 128 --plans dense \
        --variants "t128x128s3:;t128x128s2:TILE=128.128.8.2;t128x64s3:TILE=128.64.8.3" \
        --json "$OUT/dense-d128.json" 2>&1 | grep -v Warn | tee -a "$OUT/variants.log"
    timeout 35 python "$S/kernel_variants.py" --seqlens 8192,32768 --head-dims 64 --plans dense \
        --variants "t64x128s3:;t128x128s3:TILE=128.128.8.3;t64x64s3:TILE=64.64.4.3" \
        --json "$OUT/dense-d64.json" 2>&1 | grep -v Warn | tee -a "$OUT/variants.log"
    grep -E "^    (Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L1/TEX Hit|L2 Hit|Issue Slots Busy|No Eligible|Registers Per|Achieved Occupancy|Local Memory Spilling|Warp Cycles Per Issued)|_block_column_fwd" "$OUT/ncu-32k.txt" | head -60
fi
if [ "$MODE" = final ]; then
    # Workloads: 128K in the background while the GPU works on 8K / 32K.
    python "$S/discrete_keys.py" workload --seqlens 131072 --head-dims 128 > "$OUT/workload.log" 2>&1 &
    python "$S/discrete_keys.py" workload --seqlens 131072 --head-dims 64 >> /tmp/wl64.log 2>&1 &
    python "$S/discrete_keys.py" workload --seqlens 8192,32768 --head-dims 64 >> /tmp/wlshort.log 2>&1 &
    python "$S/discrete_keys.py" workload --seqlens 32768,8192 --head-dims 128 >> "$OUT/workload.log" 2>&1
    SAN="anchor_attention,columns20"
    SPARSEPREFILL_TILE_MAJOR=1 timeout 22 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python "$S/discrete_keys.py" run --sanitize --label san --seqlens 1500 --heads 8 --kv-heads 2 \
        --plans "$SAN" --json /tmp/san.json > /tmp/san.txt 2>&1
    echo "memcheck (column split + tile-major grid): exit $?" | tee -a /tmp/san.txt; grep -E "ERROR SUMMARY|ran under" /tmp/san.txt
    P32="anchor_attention,blocks_like_anchor_attention,columns20,blocks_like_columns20"
    timeout 27 python "$S/kernel_variants.py" --seqlens 32768 --head-dims 128 --plans "$P32" \
        --variants "before:COL_SPLIT=0;after:COL_SPLIT=1" --json "$OUT/cols-32k-d128.json" 2>&1 | grep -v Warn | tee "$OUT/final.log"
    timeout 26 python "$S/kernel_variants.py" --seqlens 8192,32768 --head-dims 128,64 --plans dense \
        --variants "head_major:;tile_major:TILE_MAJOR=1" --json "$OUT/dense-short.json" 2>&1 | grep -v Warn | tee -a "$OUT/final.log"
    wait
    P128="anchor_attention,blocks_like_anchor_attention,columns20,blocks_like_columns20,flexprefill_vs_0.95_lines,blocks_like_flexprefill_vs_0.95_lines,dense"
    timeout 55 python "$S/kernel_variants.py" --seqlens 131072 --head-dims 128 --plans "$P128" --warmup 10 --rep 60 \
        --variants "before:COL_SPLIT=0;after:COL_SPLIT=1;budget4g:COL_SPLIT=1,BUDGET_GIB=4;tile_major:TILE_MAJOR=1" \
        --json "$OUT/cols-128k-d128.json" 2>&1 | grep -v Warn | tee -a "$OUT/final.log"
    timeout 22 python "$S/kernel_variants.py" --seqlens 131072 --head-dims 64 --warmup 10 --rep 60 \
        --plans "anchor_attention,blocks_like_anchor_attention,columns20,blocks_like_columns20" \
        --variants "after:COL_SPLIT=1" --json "$OUT/cols-128k-d64.json" 2>&1 | grep -v Warn | tee -a "$OUT/final.log"
    cp /tmp/san.txt "$OUT/sanitizer.txt"
    grep -E "block path|cuDNN [0-9]" "$OUT/final.log"
fi
if [ "$MODE" = owed ]; then
    # What the session-3 final call's step budgets cut (about 4 minutes): the 64 x 64 column
    # plans before / after the unmasked column tiles beside their block twins at 32K and 128K,
    # the 4 GiB front-door budget for flexprefill's shared single lines, dense at 128K, and the
    # sanitizer over the new paths run to its end.
    python "$S/discrete_keys.py" workload --seqlens 32768,131072 --head-dims 128,64 > "$OUT/workload.log" 2>&1
    P="columns20,blocks_like_columns20,flexprefill_vs_0.95_lines,blocks_like_flexprefill_vs_0.95_lines"
    P="$P,vertical_slash,blocks_like_vertical_slash,anchor_attention,blocks_like_anchor_attention"
    timeout 240 python "$S/kernel_variants.py" --seqlens 32768,131072 --head-dims 128,64 --plans "$P" \
        --variants "before:COL_SPLIT=0;after:COL_SPLIT=1;budget4g:COL_SPLIT=1,BUDGET_GIB=4" \
        --json "$OUT/owed-columns.json" 2>&1 | grep -v Warn | tee "$OUT/owed.log"
    timeout 60 python "$S/kernel_variants.py" --seqlens 131072 --head-dims 128 --plans dense \
        --variants "head_major:;tile_major:TILE_MAJOR=1" --json "$OUT/owed-dense.json" 2>&1 | grep -v Warn | tee -a "$OUT/owed.log"
    SPARSEPREFILL_TILE_MAJOR=1 timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 \
        python "$S/discrete_keys.py" run --sanitize --label san --seqlens 1500 --heads 8 --kv-heads 2 \
        --plans anchor_attention,columns20,flexprefill_vs_0.95_lines,vertical_slash --json /tmp/san.json \
        > "$OUT/sanitizer.txt" 2>&1
    echo "memcheck: exit $?"; grep -E "ERROR SUMMARY|ran under" "$OUT/sanitizer.txt"
    grep -E "block path|cuDNN [0-9]" "$OUT/owed.log"
fi
