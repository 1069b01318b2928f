# Session 5, issue 25: the other methods at 8K (SmolLM2) and on Gemma 3, --margin 0.02, each held out right after
# its calibration (run from the repository root; one thread, after margin-s5-a.sh).
set -x
R=benches/results/calibrate; M=0.02
Q=/work/captures/qkv_smollm2_8k_all.pt; H=/work/captures/calib/qkv_smollm2_8k_pydoc_l0_3_9_14_20_27.pt
QG=/work/captures/qkv_gemma3_16k.pt; HG=/work/captures/calib/qkv_gemma3_8k_pydoc.pt
L="0 3 9 14 20 27"
GF='[{"gamma":0.8,"line_block":1},{"gamma":0.9,"line_block":1},{"gamma":0.95,"line_block":1},{"gamma":0.99,"line_block":1}]'
GV=$(python3 -c "import json; b=(32,64,128,256,512,1024); print(json.dumps([{'vertical_size': v, 'slash_size': s} for v in b for s in b]))")
C="sparseprefill calibrate --rows 256 --margin $M"
one() {  # one() NAME QKV HELDOUT MAXLEN-ARGS OUTDIR ARGS...: calibrate then hold out
  local name=$1 q=$2 h=$3 ml=$4 out=$5; shift 5
  $C --qkv $q $ml --out-dir $R/$out --table $R/cpu-calibrate-$out-$name "$@"
  sparseprefill calibrate --rows 256 --qkv $h $ml --eval $R/$out/$name.json --table $R/cpu-heldout-$out-$name
}
# SmolLM2 8K, every held-out layer
one anchor_attention $Q $H "" smollm2-8k-m02 --method anchor_attention --layers $L --refine 3 --refine-top 50.0
one flexprefill_vs $Q $H "" smollm2-8k-m02 --method flexprefill_vs --layers $L --grid "$GF" --refine 4 --refine-top 1.0
one vertical_slash $Q $H "" smollm2-8k-m02 --method vertical_slash --layers $L --grid "$GV"
one sample_attention $Q $H "" smollm2-8k-m02 --method sample_attention --layers $L
one shareprefill $Q $H "" smollm2-8k-m02 --method shareprefill --layers $L
# Gemma 3 global layers 5 / 11 / 17 (first 8192 tokens of the 16K capture; held out on prose)
one flexprefill_vs $QG $HG "--max-seqlen 8192" gemma3-8k-m02 --method flexprefill_vs --grid "$GF" --refine 4 --refine-top 1.0
one vertical_slash $QG $HG "--max-seqlen 8192" gemma3-8k-m02 --method vertical_slash --grid "$GV"
one sample_attention $QG $HG "--max-seqlen 8192" gemma3-8k-m02 --method sample_attention
one shareprefill $QG $HG "--max-seqlen 8192" gemma3-8k-m02 --method shareprefill
one anchor_attention $QG $HG "--max-seqlen 8192" gemma3-8k-m02 --method anchor_attention --refine 3 --refine-top 50.0
