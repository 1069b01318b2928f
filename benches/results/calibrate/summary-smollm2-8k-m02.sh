# The 8K table of the other methods with --margin 0.02 (docs/calibrate.md, "At 8K, the other methods"); repository root.
R=benches/results/calibrate
args=()
for m in flexprefill_vs anchor_attention vertical_slash sample_attention shareprefill; do
  [ -f $R/cpu-heldout-smollm2-8k-$m-m02.json ] && args+=(--config "$m margin-0.02=$R/cpu-calibrate-smollm2-8k-$m-m02.json:$R/cpu-heldout-smollm2-8k-$m-m02.json")
done
.venv/bin/python benches/calib_summary.py "${args[@]}" --json $R/cpu-summary-smollm2-8k-m02.json
