#!/usr/bin/env bash
# Named GPU steps, each under a time limit, each step's time printed; results under $OUT.
#
#   bash benches/gpu.sh                      # the GPU workflow's steps (.github/workflows/gpu.yml), in order
#   bash benches/gpu.sh conformance gputests # chosen steps
#   bash benches/gpu.sh bench:estimates,floor bench:scale   # any `sparseprefill bench` suites at their defaults
#   bash benches/gpu.sh --list               # the steps, their limits and commands
#
# Steps of the workflow (WORKFLOW below; tests/test_workflows.py keeps gpu.yml calling exactly these):
#   conformance       GPU conformance: every method and property, N up to 4K, 2 examples a row (82 rows;
#                     on a fresh H200 61 rows took 240 s, mostly compiling: about 330 s in all; warm, 21 s)
#   gputests          TRITON_INTERPRET=0 pytest tests -k gpu (long-N GPU tests)
#   pytest-benchmark  pytest benches/ (pytest-benchmark kernel suite) at 8K and 32K
#   bench             sparseprefill bench kernels methods at 32K, quick timing (--rep 50, no FlexAttention), a plot
#   demo              sparseprefill demo on the GPU (32K)
# Further steps:
#   sanitize          compute-sanitizer memcheck over every kernel (benches/sanitize_kernels.py, and --packed)
#   compile           torch.compile / CUDA-graph checks of the custom ops (benches/compile_check.py)
#   suites            the shared bench suites at 32K, quick timing (kernels estimates floor variants serving delta peers)
#   method-suites     each method's own bench suite at 32K, quick timing
#   scale             bench scale: every method at 512K and 1M, time and peak memory (stops new work at 480 s)
#   distributed       bench distributed in one process: context-parallel bytes at 256K
#   bench:S1,S2       `sparseprefill bench S1 S2` at the suites' defaults (JSON, .jsonl and PNG per step)
# The long steps write as they go and pass --resume: a step stopped at its limit continues when run again.
#
# The checkout is made importable without installing it where `import sparseprefill.fast` fails
# (benches/device_env.sh). Environment: OUT (default results), PYTHON (default python3),
# LIMIT_<STEP> overrides a step's limit in seconds (LIMIT_PYTEST_BENCHMARK for pytest-benchmark).
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-results}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

WORKFLOW=(conformance gputests pytest-benchmark bench demo)
EXTRA=(sanitize compile suites method-suites scale distributed)

declare -A LIMIT=(
  [conformance]=420 [gputests]=90 [pytest-benchmark]=90 [bench]=150 [demo]=120
  [sanitize]=570 [compile]=300 [suites]=570 [method-suites]=570 [scale]=570 [distributed]=300 [bench:]=570
)
declare -A CMD=(
  [conformance]="\$PY -m sparseprefill.conformance --device cuda --max-seqlen 4096 --examples 2 --json \$OUT/conformance.json"
  [gputests]="TRITON_INTERPRET=0 \$PY -m pytest tests -k gpu -rs -q -p no:cacheprovider"
  [pytest-benchmark]="BENCH_SEQLENS=8192,32768 \$PY -m pytest benches/ -q -p no:cacheprovider --benchmark-json \$OUT/pytest-benchmark.json"
  [bench]="\$PY -m sparseprefill.cli bench kernels methods --seqlens 32K --rep 50 --no-flex --json \$OUT/bench.json --plot \$OUT/bench.png"
  [demo]="\$PY -m sparseprefill.cli demo --device cuda --out \$OUT/demo.png --json \$OUT/demo.json"
  [sanitize]="compute-sanitizer --tool memcheck --error-exitcode 9 \$PY benches/sanitize_kernels.py && compute-sanitizer --tool memcheck --error-exitcode 9 \$PY benches/sanitize_kernels.py --packed"
  [compile]="\$PY benches/compile_check.py --json \$OUT/compile_check.json"
  [suites]="\$PY -m sparseprefill.cli bench kernels estimates floor variants serving delta peers --seqlens 32K --rep 50 --no-recall --json \$OUT/suites.json --resume --plot \$OUT/suites.png"
  [method-suites]="\$PY -m sparseprefill.cli bench anchor_attention xattention dpxa minference sample_attention shareprefill delta_kv delta_xattention --seqlens 32K --rep 50 --layers 4 --json \$OUT/method-suites.json --resume --plot \$OUT/method-suites.png"
  [scale]="\$PY -m sparseprefill.cli bench scale --budget-s 480 --json \$OUT/scale.json --resume"
  [distributed]="\$PY -m sparseprefill.cli bench distributed --seqlens 256K --json \$OUT/distributed-bytes.json"
)

limit_of() {
  local key=$1
  [[ $1 == bench:* ]] && key="bench:"
  local var
  var="LIMIT_$(echo "${key%:}" | tr 'a-z-' 'A-Z_')"
  echo "${!var:-${LIMIT[$key]}}"
}

command_of() {
  local step=$1
  case $step in
    bench:*)
      local suites=${step#bench:} tag=${step#bench:}
      tag=${tag//,/-}
      echo "\$PY -m sparseprefill.cli bench ${suites//,/ } --json \$OUT/bench-$tag.json --resume --plot \$OUT/bench-$tag.png"
      ;;
    *)
      [[ -n ${CMD[$step]+x} ]] || return 1
      echo "${CMD[$step]}"
      ;;
  esac
}

if [[ ${1:-} == --list ]]; then
  for step in "${WORKFLOW[@]}" "${EXTRA[@]}" bench:SUITES; do
    printf '%-17s %5ss  %s\n' "$step" "$(limit_of "$step")" "$(command_of "$step")"
  done
  exit 0
fi

steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=("${WORKFLOW[@]}")
for step in "${steps[@]}"; do
  if ! command_of "$step" >/dev/null; then
    echo "gpu.sh: unknown step '$step' (bash benches/gpu.sh --list)" >&2
    exit 2
  fi
done
if ! $PY -c "import sparseprefill.fast" 2>/dev/null; then
  # shellcheck source=benches/device_env.sh
  source benches/device_env.sh .
fi
mkdir -p "$OUT"

status=0
summary=()
for step in "${steps[@]}"; do
  cmd=$(command_of "$step")
  limit=$(limit_of "$step")
  echo "=== $step (limit ${limit}s): ${cmd}"
  start=$SECONDS
  OUT=$OUT PY=$PY timeout --signal=INT --kill-after=15 "$limit" bash -c "$cmd"
  rc=$?
  took=$((SECONDS - start))
  [[ $rc -eq 124 ]] && echo "=== $step: stopped at its limit of ${limit}s"
  echo "=== $step: exit $rc in ${took}s"
  summary+=("$(printf '%-17s exit %-3s %5ss (limit %ss)' "$step" "$rc" "$took" "$limit")")
  [[ $rc -ne 0 ]] && status=1
done
echo "=== step times"
printf '%s\n' "${summary[@]}"
exit $status
