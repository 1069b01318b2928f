# The held-out summary table of docs/calibrate.md (run from the repository root).
R=benches/results/calibrate
G="$R/cpu-granularity-smollm2-4k.json"
[ -f $R/cpu-granularity-stripes-smollm2-4k.json ] && G="$G $R/cpu-granularity-stripes-smollm2-4k.json"
.venv/bin/python benches/calib_summary.py --granularity $G \
 --config "xattention grid=$R/cpu-calibrate-smollm2-4k.json:$R/cpu-heldout-smollm2-4k-xattention.json" \
 --config "xattention bisected=$R/cpu-calibrate-smollm2-4k-refine-b128.json:$R/cpu-heldout-smollm2-4k-refine-b128.json" \
 --config "dpxa bisected=$R/cpu-calibrate-smollm2-4k-dpxa.json:$R/cpu-heldout-smollm2-4k-dpxa.json" \
 --config "anchor_attention bisected=$R/cpu-calibrate-smollm2-4k-anchor.json:$R/cpu-heldout-smollm2-4k-anchor.json" \
 --config "flexprefill_vs grid=$R/cpu-calibrate-smollm2-4k-D.json:$R/cpu-heldout-smollm2-4k-ADfs.json" \
 --config "flexprefill_vs bisected=$R/cpu-calibrate-smollm2-4k-flexprefill_vs-refine.json:$R/cpu-heldout-smollm2-4k-flexprefill_vs-refine.json" \
 --config "vertical_slash 7x7=$R/cpu-calibrate-smollm2-4k-vertical_slash7.json:$R/cpu-heldout-smollm2-4k-vertical_slash7.json" \
 --config "sample_attention grid=$R/cpu-calibrate-smollm2-4k-A.json:$R/cpu-heldout-smollm2-4k-ADfs.json" \
 --config "shareprefill per layer=$R/cpu-calibrate-smollm2-4k-A.json:$R/cpu-heldout-smollm2-4k-ADfs.json" \
 --json $R/cpu-summary-smollm2-4k.json
