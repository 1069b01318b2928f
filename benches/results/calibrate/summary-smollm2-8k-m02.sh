# The 8K table of the other methods with --margin 0.02 (docs/calibrate.md, "At 8K, the other methods"); repository root.
R=benches/results/calibrate
args=()
for m in flexprefill_vs anchor_attention vertical_slash sample_attention shareprefill; do
  for sfx in m02 m02-0_9_27; do
    [ -f $R/cpu-heldout-smollm2-8k-$m-$sfx.json ] && args+=(--config "$m margin-0.02=$R/cpu-calibrate-smollm2-8k-$m-$sfx.json:$R/cpu-heldout-smollm2-8k-$m-$sfx.json")
  done
done
.venv/bin/python benches/calib_summary.py "${args[@]}" --json $R/cpu-summary-smollm2-8k-m02.json
