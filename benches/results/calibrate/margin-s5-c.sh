# Session 5, issue 25: the remaining SmolLM2 4K configs with --margin 0.02 (does the margin break rows that met?
# and the 12 estimator rows of the density target), each held out after its calibration (repository root).
set -x
R=benches/results/calibrate; M=0.02
Q=/work/captures/qkv_smollm2_8k_all.pt; H=/work/captures/calib/qkv_smollm2_8k_pydoc_l0_3_9_14_20_27.pt
L="0 3 9 14 20 27"
G7=$(python3 -c "import json; b=(16,32,64,128,256,512,1024); print(json.dumps([{'vertical_size': v, 'slash_size': s} for v in b for s in b]))")
C="sparseprefill calibrate --rows 256 --margin $M --qkv $Q --max-seqlen 4096 --layers $L --out-dir $R/smollm2-4k-m02"
E="sparseprefill calibrate --rows 256 --qkv $H --max-seqlen 4096"
$C --method anchor_attention --refine 3 --refine-top 50.0 --table $R/cpu-calibrate-smollm2-4k-anchor_attention-m02
$E --eval $R/smollm2-4k-m02/anchor_attention.json --table $R/cpu-heldout-smollm2-4k-anchor_attention-m02
$C --method vertical_slash --grid "$G7" --table $R/cpu-calibrate-smollm2-4k-vertical_slash-m02
$E --eval $R/smollm2-4k-m02/vertical_slash.json --table $R/cpu-heldout-smollm2-4k-vertical_slash-m02
$C --method sample_attention --table $R/cpu-calibrate-smollm2-4k-sample_attention-m02
$E --eval $R/smollm2-4k-m02/sample_attention.json --table $R/cpu-heldout-smollm2-4k-sample_attention-m02
$C --method shareprefill --table $R/cpu-calibrate-smollm2-4k-shareprefill-m02
$E --eval $R/smollm2-4k-m02/shareprefill.json --table $R/cpu-heldout-smollm2-4k-shareprefill-m02
