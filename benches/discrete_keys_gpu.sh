#!/usr/bin/env bash
# One device call for issue 21 (benches/discrete_keys.py): lays out each code version as an
# importable `sparseprefill` package (no build), then profiles or times them in one run.
#   profile: ncu on the column path (before code) + the compiled kernel's TTGIR/SASS.
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
    layout "$HERE/../before" /tmp/L/before
    export PYTHONPATH=/tmp/L/before
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
        env $env python "$S" run --label "before-${lab%%=*}" --seqlens 32768 \
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
