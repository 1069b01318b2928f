#!/usr/bin/env bash
# The lead's device call of 2026-11-26 (session 5), from the merged tree's root with main at the
# session's start carried in .carry/before:
#   OUT=$OUT bash benches/lead_s5_gpu.sh perf     (parts 1-3)
#   OUT=$OUT bash benches/lead_s5_gpu.sh check    (part 4)
#   OUT=$OUT bash benches/lead_s5_gpu.sh final    (after the last merges: conformance, memcheck, the three
#                                                  rebuilt plans before / after, Delta-KV at keep 0.6)
#   OUT=$OUT bash benches/lead_s5_gpu.sh owed21   (issue 21's unmeasured rows: Delta-KV at keep 0.6, the column plans
#                                                  at 128K D 64, shareprefill's kernel part at 128K with head chunks)
# 1. Delta-KV before / after the host-read change (keep 0.5 and 0.33 at 32K, keep 0.5 at 128K),
#    benches/delta_kv_profile.py in both trees, cuDNN in each run.
# 2. Varlen in one launch against per-sequence launches, packed grid on / off (issue 21).
# 3. compute-sanitizer memcheck of every method's fast path (benches/sanitize_kernels.py).
# 4. GPU conformance of the methods and kernel paths changed this session.
set -u -o pipefail
MODE=${1:-perf}
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
R=$(pwd)
source benches/device_env.sh "$R"
LOG=$OUT/run.log
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$LOG"
rm -rf /tmp/L/before && mkdir -p /tmp/L/before && cp -r "$R/.carry/before/sparseprefill" /tmp/L/before/
for d in reference fast conformance; do ln -s "$R/.carry/before/$d" /tmp/L/before/sparseprefill/$d; done
step() { local name=$1 limit=$2; shift 2; echo "=== $name" | tee -a "$LOG"; local t=$SECONDS
    timeout "$limit" "$@" 2>&1 | grep -v -i warn | tee -a "$LOG"; echo "=== $name rc=${PIPESTATUS[0]} $((SECONDS - t))s" | tee -a "$LOG"; }
W=$(mktemp -d)
if [ "$MODE" = perf ]; then
for cfg in "32768 2" "32768 3" "131072 2"; do set -- $cfg
    PYTHONPATH=/tmp/L/before step "delta-before-$1-run$2" 120 python3 "$R/benches/delta_kv_profile.py" --seqlen $1 --run $2 \
        --json "$W/delta-before-$1-run$2.json"
    step "delta-after-$1-run$2" 120 python3 benches/delta_kv_profile.py --seqlen $1 --run $2 --json "$W/delta-after-$1-run$2.json"
done
step varlen 90 python3 benches/issue21_s4.py --parts varlen --flat-tma-only --varlen-grids --json "$W/varlen.json"
step memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benches/sanitize_kernels.py
fi
if [ "$MODE" = check ]; then
step conformance "${CONF_S:-240}" python3 -m sparseprefill.conformance --device cuda --max-seqlen 8192 --examples 6 \
    --row-budget "${ROW_S:-6}" \
    --methods delta_kv,vertical_slash,minference,flexprefill_vs,shareprefill,delta_xattention,anchor_attention,sample_attention \
    --properties plan,end_to_end,estimate,sparse_attention,nonfinite,resumed_attention,block_means \
    --json "$W/conformance.json"
fi
if [ "$MODE" = final ]; then
    step conformance 170 python3 -m sparseprefill.conformance --device cuda --max-seqlen 8192 --examples 6 --row-budget 6 \
        --methods shareprefill,sample_attention,anchor_attention,flexprefill_vs \
        --properties plan,end_to_end,estimate,sparse_attention,resumed_attention,nonfinite,block_means \
        --json "$W/conformance-final.json"
    step memcheck 130 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benches/sanitize_kernels.py
    M="shareprefill sample_attention anchor_attention"
    PYTHONPATH=/tmp/L/before step shares-before 100 python3 "$R/.carry/before/benches/estimator_shares.py" --seqlens 32768 131072 \
        --methods $M --tag before --json "$W/shares-before.json"
    step shares-after 100 python3 benches/estimator_shares.py --seqlens 32768 131072 --methods $M --tag after \
        --json "$W/shares-after.json"
    step delta-keep06-32768 60 python3 benches/delta_kv_profile.py --seqlen 32768 --runs 2,2,1 --json "$W/delta-keep06-32768.json"
fi
if [ "$MODE" = owed21 ]; then
    python3 benches/discrete_keys.py workload --seqlens 131072 --head-dims 64,128 > "$W/wl.log" 2>&1 &
    for n in 32768 131072; do
        step "delta-keep06-$n" 120 python3 benches/delta_kv_profile.py --seqlen $n --runs 2,2,1 --json "$W/delta-keep06-$n.json"
    done
    wait; cat "$W/wl.log" >> "$LOG"
    step floor-share-128k 150 python3 benches/kernel_floor.py --seqlens 131072 --methods shareprefill --json "$W/floor-share-128k.json"
    step columns-128k-d64 150 python3 benches/kernel_variants.py --seqlens 131072 --head-dims 64 --warmup 5 --rep 40 \
        --plans columns20,blocks_like_columns20,flexprefill_vs_0.95_lines,blocks_like_flexprefill_vs_0.95_lines \
        --variants "rule:COL_SPLIT=auto;on:COL_SPLIT=1;off:COL_SPLIT=0" --json "$W/columns-128k-d64.json"
fi
tar -czf "$OUT/lead-s5.tgz" -C "$W" .
