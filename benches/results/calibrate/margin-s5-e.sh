# Session 5, issue 25: run when the CPU freed up at the end: Gemma 3's remaining line methods and SmolLM2 8K's
# remaining layers (0 / 9 / 27, into smollm2-8k-m02-b/), --margin 0.02, each held out (repository root).
set -x
R=benches/results/calibrate; M=0.02
Q=/work/captures/qkv_smollm2_8k_all.pt; H=/work/captures/calib/qkv_smollm2_8k_pydoc_l0_3_9_14_20_27.pt
QG=/work/captures/qkv_gemma3_16k.pt; HG=/work/captures/calib/qkv_gemma3_8k_pydoc.pt
GV=$(python3 -c "import json; b=(32,64,128,256,512,1024); print(json.dumps([{'vertical_size': v, 'slash_size': s} for v in b for s in b]))")
C="sparseprefill calibrate --rows 256 --margin $M"
one() {
  local name=$1 q=$2 h=$3 ml=$4 out=$5 tag=$6; shift 6
  $C --qkv $q $ml --out-dir $R/$out --table $R/cpu-calibrate-$tag "$@"
  sparseprefill calibrate --rows 256 --qkv $h $ml --eval $R/$out/$name.json --table $R/cpu-heldout-$tag
}
one sample_attention $QG $HG "--max-seqlen 8192" gemma3-8k-m02 gemma3-8k-sample_attention-m02 --method sample_attention
one shareprefill $QG $HG "--max-seqlen 8192" gemma3-8k-m02 gemma3-8k-shareprefill-m02 --method shareprefill
one sample_attention $Q $H "" smollm2-8k-m02-b smollm2-8k-sample_attention-m02-0_9_27 --method sample_attention --layers 0 9 27
one shareprefill $Q $H "" smollm2-8k-m02-b smollm2-8k-shareprefill-m02-0_9_27 --method shareprefill --layers 0 9 27
one vertical_slash $QG $HG "--max-seqlen 8192" gemma3-8k-m02 gemma3-8k-vertical_slash-m02 --method vertical_slash --grid "$GV"
one vertical_slash $Q $H "" smollm2-8k-m02-b smollm2-8k-vertical_slash-m02-0_9_27 --method vertical_slash --layers 0 9 27 --grid "$GV"
# (stopped at the deadline before it finished: no result)
one anchor_attention $Q $H "" smollm2-8k-m02-b smollm2-8k-anchor_attention-m02-0_9_27 --method anchor_attention --layers 0 9 27 \
    --refine 3 --refine-top 50.0
