# Session 5, issue 25: the missed held-out rows re-calibrated with --margin 0.02 (run from the repository root).
set -x
R=benches/results/calibrate; M=0.02
Q=/work/captures/qkv_smollm2_8k_all.pt; H=/work/captures/calib/qkv_smollm2_8k_pydoc_l0_3_9_14_20_27.pt
QG=/work/captures/qkv_gemma3_16k.pt; HG=/work/captures/calib/qkv_gemma3_8k_pydoc.pt
L="0 3 9 14 20 27"
GX='[{"stride":8,"block":128,"threshold":0.9},{"stride":8,"block":128,"threshold":0.95},{"stride":8,"block":128,"threshold":0.99}]'
GD='[{"cos_threshold":0.75,"threshold":0.9,"block":128},{"cos_threshold":0.75,"threshold":0.95,"block":128},{"cos_threshold":0.75,"threshold":0.99,"block":128}]'
GF='[{"gamma":0.8,"line_block":1},{"gamma":0.9,"line_block":1},{"gamma":0.95,"line_block":1},{"gamma":0.99,"line_block":1}]'
C="sparseprefill calibrate --rows 256 --margin $M"
# SmolLM2 4K: the three bisected methods that missed (XAttention L9, DPXA L20, flexprefill_vs L0 / L9), every held-out layer
$C --qkv $Q --max-seqlen 4096 --method xattention --layers $L --grid "$GX" --refine 4 --refine-top 1.0 \
   --out-dir $R/smollm2-4k-m02 --table $R/cpu-calibrate-smollm2-4k-xattention-m02
$C --qkv $Q --max-seqlen 4096 --method dpxa --layers $L --grid "$GD" --refine 3 --refine-top 1.0 \
   --out-dir $R/smollm2-4k-m02 --table $R/cpu-calibrate-smollm2-4k-dpxa-m02
$C --qkv $Q --max-seqlen 4096 --method flexprefill_vs --layers $L --grid "$GF" --refine 4 --refine-top 1.0 \
   --out-dir $R/smollm2-4k-m02 --table $R/cpu-calibrate-smollm2-4k-flexprefill_vs-m02
sparseprefill calibrate --rows 256 --qkv $H --max-seqlen 4096 --eval $R/smollm2-4k-m02/{xattention,dpxa,flexprefill_vs}.json \
   --table $R/cpu-heldout-smollm2-4k-m02-a
# Gemma 3 global layers: XAttention (missed L11) and DPXA (L11 missed; now all three layers)
$C --qkv $QG --max-seqlen 8192 --method xattention --grid "$GX" --refine 3 --refine-top 1.0 \
   --out-dir $R/gemma3-8k-m02 --table $R/cpu-calibrate-gemma3-8k-xattention-m02
$C --qkv $QG --max-seqlen 8192 --method dpxa --grid "$GD" --refine 3 --refine-top 1.0 \
   --out-dir $R/gemma3-8k-m02 --table $R/cpu-calibrate-gemma3-8k-dpxa-m02
sparseprefill calibrate --rows 256 --qkv $HG --eval $R/gemma3-8k-m02/{xattention,dpxa}.json --table $R/cpu-heldout-gemma3-8k-m02-a
# SmolLM2 8K: XAttention (missed L20), every held-out layer
$C --qkv $Q --method xattention --layers $L --grid "$GX" --refine 3 --refine-top 1.0 \
   --out-dir $R/smollm2-8k-m02 --table $R/cpu-calibrate-smollm2-8k-xattention-m02
sparseprefill calibrate --rows 256 --qkv $H --eval $R/smollm2-8k-m02/xattention.json --table $R/cpu-heldout-smollm2-8k-xattention-m02
