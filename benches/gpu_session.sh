#!/usr/bin/env bash
# One batched GPU session (the `device` tool's run, or any CUDA machine): the checkout made importable, then
# the named steps, each under its own time limit; logs and JSON go to $OUT (default ./gpu-out),
# the JSON also packed into $OUT/results.tar.
#   bash benches/gpu_session.sh sanitize serving sweep anchor sample delta_kv guard
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT/res"; R="$OUT/res"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
source benches/device_env.sh  # import from the checkout, no install (see that file)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
B="python3 -m sparseprefill.cli bench --no-flex"
step() { local name=$1 limit=$2; shift 2; echo "=== $name (limit ${limit}s): $*"; local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$R/$name.log" | tail -n 40; echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS - t0))s"; }
for s in "$@"; do case $s in
  sanitize) step sanitize 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 benches/sanitize_kernels.py cuda 1000 ;;
  serving) step serving 150 python3 benches/serving_shapes.py --seqlen 32768 --json "$R/serving.json" ;;
  sweep) step sweep 240 python3 benches/serving_shapes.py --seqlen 32768 --shapes serve64 --sweep --json "$R/sweep64.json" ;;
  sweep128) step sweep128 240 python3 benches/serving_shapes.py --seqlen 32768 --shapes llama3_8b --sweep --json "$R/sweep128.json" ;;
  anchor) step anchor 120 $B --method anchor_attention --seqlens 32768,131072 --json "$R/anchor.json" ;;
  sample) step sample 120 $B --method sample_attention --seqlens 32768,131072 --json "$R/sample.json" ;;
  delta_kv) step delta_kv 150 $B --method delta_kv --seqlens 32768,131072 --json "$R/delta_kv.json" ;;
  minference) step minference 150 $B --method minference --seqlens 32768,131072 --json "$R/minference.json" ;;
  shareprefill) step shareprefill 240 $B --method shareprefill --seqlens 32768,131072 --layers 4 --json "$R/shareprefill.json" ;;
  kernels) step kernels 150 $B --seqlens 8192,32768,131072 --json "$R/kernels.json" ;;
  guard) step guard 150 python3 benches/guard_cost.py --seqlen 131072 --json "$R/guard.json" ;;
  gputests) step gputests 300 python3 -m pytest -q -x tests -k gpu -p no:cacheprovider ;;
  conformance) step conformance 300 python3 -m sparseprefill.conformance --device cuda --max-seqlen 16384 --examples 30 ;;
  conformance-quick) step conformance-quick 170 python3 -m sparseprefill.conformance --device cuda --max-seqlen 8192 --examples 4 --row-budget 2 --json "$R/conformance-quick.json" ;;
  discrete) SEQLENS=${SEQLENS:-32768} STEP_TIMEOUT=100 OUT="$R" step discrete 230 bash benches/discrete_keys_gpu.sh compare .carry/before=before .=after ;;
  *) if [[ $s == bench:* ]]; then m=${s#bench:}; step "$m" 200 $B --method "$m" --seqlens 32768,131072 --json "$R/$m.json";
     elif [[ $s == py:* ]]; then f=${s#py:}; step "$(basename "$f" .py)" 240 python3 "$f" --json "$R/$(basename "$f" .py).json";
     else echo "unknown step $s"; fi ;;
esac; done
tar -C "$OUT" -cf "$OUT/results.tar" res && rm -rf "$R"
