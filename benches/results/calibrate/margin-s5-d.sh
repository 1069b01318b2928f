# Session 5, issue 25: what the shared CPU allowed after margin-s5-a.sh / the anchor part of margin-s5-c.sh, in
# order of value: SmolLM2 8K methods other than XAttention / DPXA, the 4K estimator layers 3 / 9 with per-head
# vertical-slash budgets, then Gemma 3. --margin 0.02; each calibration held out right after (repository root).
set -x
R=benches/results/calibrate; M=0.02
Q=/work/captures/qkv_smollm2_8k_all.pt; H=/work/captures/calib/qkv_smollm2_8k_pydoc_l0_3_9_14_20_27.pt
QG=/work/captures/qkv_gemma3_16k.pt; HG=/work/captures/calib/qkv_gemma3_8k_pydoc.pt
GF='[{"gamma":0.8,"line_block":1},{"gamma":0.9,"line_block":1},{"gamma":0.95,"line_block":1},{"gamma":0.99,"line_block":1}]'
G7=$(python3 -c "import json; b=(16,32,64,128,256,512,1024); print(json.dumps([{'vertical_size': v, 'slash_size': s} for v in b for s in b]))")
GV=$(python3 -c "import json; b=(32,64,128,256,512,1024); print(json.dumps([{'vertical_size': v, 'slash_size': s} for v in b for s in b]))")
C="sparseprefill calibrate --rows 256 --margin $M"
one() {  # one() NAME QKV HELDOUT MAXLEN-ARGS OUTDIR TAG ARGS...: calibrate then hold out
  local name=$1 q=$2 h=$3 ml=$4 out=$5 tag=$6; shift 6
  $C --qkv $q $ml --out-dir $R/$out --table $R/cpu-calibrate-$tag "$@"
  sparseprefill calibrate --rows 256 --qkv $h $ml --eval $R/$out/$name.json --table $R/cpu-heldout-$tag
}
one flexprefill_vs $Q $H "" smollm2-8k-m02 smollm2-8k-flexprefill_vs-m02 --method flexprefill_vs --layers 0 3 9 14 20 27 \
    --grid "$GF" --refine 4 --refine-top 1.0
one vertical_slash $Q $H "--max-seqlen 4096" smollm2-4k-m02-vs39 smollm2-4k-vertical_slash-m02-3_9 --method vertical_slash \
    --layers 3 9 --grid "$G7"
one anchor_attention $Q $H "" smollm2-8k-m02 smollm2-8k-anchor_attention-m02 --method anchor_attention --layers 3 14 20 \
    --refine 3 --refine-top 50.0
one flexprefill_vs $QG $HG "--max-seqlen 8192" gemma3-8k-m02 gemma3-8k-flexprefill_vs-m02 --method flexprefill_vs \
    --grid "$GF" --refine 4 --refine-top 1.0
one vertical_slash $Q $H "" smollm2-8k-m02 smollm2-8k-vertical_slash-m02 --method vertical_slash --layers 3 14 20 --grid "$GV"
one sample_attention $Q $H "" smollm2-8k-m02 smollm2-8k-sample_attention-m02 --method sample_attention --layers 3 14 20
one shareprefill $Q $H "" smollm2-8k-m02 smollm2-8k-shareprefill-m02 --method shareprefill --layers 3 14 20
