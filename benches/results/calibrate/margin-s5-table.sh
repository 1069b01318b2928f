# The margin tables of docs/calibrate.md (repository root): no margin -> --margin 0.02, calibration and held out.
R=benches/results/calibrate
P() { echo "$1=$R/cpu-calibrate-$2.json:$R/cpu-heldout-$3.json|$R/cpu-calibrate-$4.json:$R/cpu-heldout-$5.json"; }
.venv/bin/python benches/calib_margin.py \
 --pair "xattention bisected=$R/cpu-calibrate-smollm2-4k-refine-b128.json:$R/cpu-heldout-smollm2-4k-refine-b128.json+$R/cpu-calibrate-smollm2-4k-refine-b128-0_20_27.json:$R/cpu-heldout-smollm2-4k-refine-b128-0_20_27.json|$R/cpu-calibrate-smollm2-4k-xattention-m02.json:$R/cpu-heldout-smollm2-4k-m02-a.json" \
 --pair "$(P 'dpxa bisected' smollm2-4k-dpxa smollm2-4k-dpxa smollm2-4k-dpxa-m02 smollm2-4k-m02-a)" \
 --pair "$(P 'flexprefill_vs bisected' smollm2-4k-flexprefill_vs-refine smollm2-4k-flexprefill_vs-refine smollm2-4k-flexprefill_vs-m02 smollm2-4k-m02-a)" \
 --pair "$(P 'anchor_attention bisected' smollm2-4k-anchor smollm2-4k-anchor smollm2-4k-anchor_attention-m02 smollm2-4k-anchor_attention-m02)" \
 --pair "$(P 'vertical_slash 7x7' smollm2-4k-vertical_slash7 smollm2-4k-vertical_slash7 smollm2-4k-vertical_slash-m02-3_9 smollm2-4k-vertical_slash-m02-3_9)" \
 --json $R/cpu-margin-smollm2-4k-a.json
echo
.venv/bin/python benches/calib_margin.py \
 --pair "xattention bisected=$R/cpu-calibrate-smollm2-8k-xattention-0_9_14_20_27.json:$R/cpu-heldout-smollm2-8k-xattention-0_9_14_20_27.json+$R/cpu-calibrate-smollm2-8k-xattention-3.json:$R/cpu-heldout-smollm2-8k-3.json|$R/cpu-calibrate-smollm2-8k-xattention-m02.json:$R/cpu-heldout-smollm2-8k-xattention-m02.json" \
 --json $R/cpu-margin-smollm2-8k-xattention.json
echo
.venv/bin/python benches/calib_margin.py \
 --pair "$(P 'xattention bisected' gemma3-8k-xattention gemma3-8k gemma3-8k-xattention-m02 gemma3-8k-m02-a)" \
 --pair "$(P 'dpxa bisected' gemma3-8k-dpxa-11 gemma3-8k-dpxa-11 gemma3-8k-dpxa-m02 gemma3-8k-m02-a)" \
 --json $R/cpu-margin-gemma3-8k.json
