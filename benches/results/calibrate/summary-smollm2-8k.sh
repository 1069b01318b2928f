# The 8K held-out table of docs/calibrate.md (run from the repository root).
R=benches/results/calibrate
.venv/bin/python benches/calib_summary.py \
 --config "xattention bisected=$R/cpu-calibrate-smollm2-8k-xattention-0_9_14_20_27.json:$R/cpu-heldout-smollm2-8k-xattention-0_9_14_20_27.json" \
 --config "xattention bisected=$R/cpu-calibrate-smollm2-8k-xattention-3.json:$R/cpu-heldout-smollm2-8k-3.json" \
 --config "dpxa bisected=$R/cpu-calibrate-smollm2-8k-dpxa-3.json:$R/cpu-heldout-smollm2-8k-3.json" \
 --config "dpxa bisected=$R/cpu-calibrate-smollm2-8k-dpxa-14.json:$R/cpu-heldout-smollm2-8k-dpxa-14.json" \
 --json $R/cpu-summary-smollm2-8k.json
