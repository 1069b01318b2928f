#!/usr/bin/env bash
# One device call for issue 21 (benches/discrete_keys.py): lays out each code version as an
# importable `sparseprefill` package (no build), then profiles or times them in one run.
#   profile [DIR]: ncu on the column path (DIR's code, ../before by default) + ablations.
#   compare VERSION_DIR=LABEL[:ENV=VAL,...] ...: `run` per version, then `merge`.
# Outputs go to $OUT (at most 8 files come back).
set -uo pipefail
MODE=$1; shift
OUT=${OUT:-/tmp/out}
HERE=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1

layout() {  # SRC DEST: the installed layout of pyproject's package-dir mapping
    rm -rf "$2"; mkdir -p "$2"
    cp -r "$1/sparseprefill" "$2/"
    for p in reference fast conformance; do cp -r "$1/$p" "$2/sparseprefill/$p"; done
}

nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
if [ "$MODE" = profile ]; then
    layout "$HERE/${1:-../before}" /tmp/L/profiled  # profile [DIR]: the before code by default
    export PYTHONPATH=/tmp/L/profiled
    S=$HERE/benches/discrete_keys.py
    # Warm the workload cache and the compile cache outside ncu.
    python "$S" profile --seqlens 32768,131072 2>&1 | tee "$OUT/profile.log"
    ncu --profile-from-start off --clock-control none --kernel-name regex:_block_column_fwd \
        --set full --import-source no -f -o "$OUT/ncu-32k" \
        python "$S" profile --seqlens 32768 >> "$OUT/profile.log" 2>&1
    ncu --profile-from-start off --clock-control none --kernel-name regex:_block_column_fwd \
        --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
        --section Occupancy --section LaunchStats --section SchedulerStats -f -o "$OUT/ncu-128k" \
        python "$S" profile --seqlens 131072 >> "$OUT/profile.log" 2>&1
    for r in 32k 128k; do
        ncu --import "$OUT/ncu-$r.ncu-rep" --page details > "$OUT/ncu-$r.txt" 2>&1
    done
    # Cost split of the column loop (benchmark switches of the before code), 32K.
    for env in "" SPARSEPREFILL_NONFINITE=0 SPARSEPREFILL_GUARD=0 SPARSEPREFILL_PREFETCH=0; do
        lab=${env:-base}
        env $env python "$S" run --label "profiled-${lab%%=*}" --seqlens 32768 \
            --plans anchor_attention,flexprefill_vs_0.95,columns20 --json "/tmp/abl-${lab%%=*}.json" \
            --warmup 25 --rep 150 >> "$OUT/profile.log" 2>&1
    done
    python "$S" merge /tmp/abl-*.json --json "$OUT/ablation-32k.json"
    grep -E "Duration|Throughput|Issue Slot|Eligible|Stall|Registers|Shared Memory Config|Achieved Occ|L2 Hit|L1/TEX Hit|Warp Cycles|Block Limit" "$OUT/ncu-32k.txt" | head -120
    exit 0
fi
if [ "$MODE" = compare ]; then
    # compare SRC=LABEL[:ENV=VAL,...] ... (SRC relative to this checkout: "." or "../before").
    SEQ=${SEQLENS:-32768,131072}
    jsons=()
    for spec in "$@"; do
        src=${spec%%=*}; rest=${spec#*=}; lab=${rest%%:*}; envs=""
        [ "$rest" != "$lab" ] && envs=${rest#*:}
        dest=/tmp/L/$(basename "$(cd "$HERE/$src" && pwd)")
        [ -d "$dest" ] || layout "$HERE/$src" "$dest"
        env ${envs//,/ } PYTHONPATH="$dest" timeout "${STEP_TIMEOUT:-240}" python "$HERE/benches/discrete_keys.py" \
            run --label "$lab" --seqlens "$SEQ" --json "/tmp/dk-$lab.json" --rows-dir /tmp/dkrows \
            --warmup 25 --rep 200 2>&1 | tee -a "$OUT/compare.log"
        [ -f "/tmp/dk-$lab.json" ] && jsons+=("/tmp/dk-$lab.json")
    done
    python "$HERE/benches/discrete_keys.py" merge "${jsons[@]}" --rows-dir /tmp/dkrows \
        --json "$OUT/compare.json" 2>&1 | tee "$OUT/table.txt"
fi
if [ "$MODE" = issue21 ]; then
    # issue21 MAIN_DIR AFTER_DIR: session 2's kernel call. Each step is a `run` of one version
    # (own process), cut at its STEP budget; rows are kept as they come.
    #   A after, D=128: column plans, each beside a block plan of its density (blocks_like_*)
    #   B main (correctness and before/after), D=128, column plans and dense
    #   C after with the column-index prefetch off (SPARSEPREFILL_COL_PREFETCH=0)
    #   D after and main, D=64
    main=$1; after=$2; SEQ=${SEQLENS:-32768,131072}
    layout "$HERE/$main" /tmp/L/main; layout "$HERE/$after" /tmp/L/after
    # Workloads built on the CPU while compute-sanitizer checks the changed kernels.
    PYTHONPATH=/tmp/L/after python "$HERE/benches/discrete_keys.py" workload --seqlens "$SEQ" \
        > "$OUT/workload.log" 2>&1 &
    wl=$!
    PYTHONPATH=/tmp/L/after timeout "${STEP_SAN:-110}" compute-sanitizer --tool memcheck --error-exitcode 9 \
        python "$HERE/benches/sanitize_kernels.py" cuda 700 > "$OUT/sanitizer.txt" 2>&1
    echo "memcheck sanitize_kernels.py: exit $?"; grep -E "ERROR SUMMARY|non-finite|ran" "$OUT/sanitizer.txt" | tail -5
    wait $wl; cat "$OUT/workload.log"
    COLS=vertical_slash,flexprefill_vs_0.95,anchor_attention,columns20
    LIKE=blocks_like_vertical_slash,blocks_like_flexprefill_vs_0.95,blocks_like_anchor_attention,blocks_like_columns20
    step() {  # LABEL DIR SECONDS ARGS...
        local lab=$1 dir=$2 secs=$3; shift 3
        PYTHONPATH=/tmp/L/$dir timeout "$secs" python "$HERE/benches/discrete_keys.py" run --label "$lab" \
            --json "/tmp/dk-$lab.json" --rows-dir /tmp/dkrows --dump-dir "$OUT/ttgir" --warmup 20 --rep 100 "$@" \
            2>&1 | grep -v Warning | tee -a "$OUT/issue21.log"
    }
    step after after "${STEP_A:-150}" --seqlens "$SEQ" --plans "dense,$COLS,$LIKE"
    step main main "${STEP_B:-70}" --seqlens "$SEQ" --plans "dense,$COLS"
    export SPARSEPREFILL_COL_PREFETCH=0; step after-nocolpf after "${STEP_C:-50}" --seqlens "$SEQ" --plans "$COLS"
    unset SPARSEPREFILL_COL_PREFETCH; step after-d64 after "${STEP_D:-90}" --seqlens "$SEQ" --head-dim 64 --plans "dense,$COLS,$LIKE"
    step main-d64 main "${STEP_E:-50}" --seqlens "$SEQ" --head-dim 64 --plans "$COLS"
    for set in "main after after-nocolpf" "main-d64 after-d64"; do
        js=(); for l in $set; do [ -f "/tmp/dk-$l.json" ] && js+=("/tmp/dk-$l.json"); done
        [ ${#js[@]} -gt 0 ] && python "$HERE/benches/discrete_keys.py" merge "${js[@]}" --rows-dir /tmp/dkrows \
            --json "$OUT/issue21-${set%% *}.json" 2>&1 | tee -a "$OUT/table.txt"
    done
    tar czf "$OUT/ttgir.tgz" -C "$OUT" ttgir && rm -rf "$OUT/ttgir"
fi
if [ "$MODE" = sanitize ]; then
    # compute-sanitizer memcheck on the column paths (gather and packed), small sizes.
    layout "$HERE" /tmp/L/sanitize
    for cols in gather pack; do
        SPARSEPREFILL_COLUMNS=$cols PYTHONPATH=/tmp/L/sanitize timeout "${STEP_TIMEOUT:-150}" \
            compute-sanitizer --tool memcheck --error-exitcode 9 python "$HERE/benches/discrete_keys.py" \
            run --sanitize --label "san-$cols" --seqlens 3000 --heads 8 --kv-heads 2 \
            --plans dense,anchor_attention,flexprefill_vs_0.95,columns20 --json /tmp/san.json \
            > "$OUT/sanitizer-$cols.txt" 2>&1
        echo "memcheck $cols: exit $?"; tail -3 "$OUT/sanitizer-$cols.txt"
    done
fi
