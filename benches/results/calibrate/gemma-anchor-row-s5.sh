# Session 5, issue 25: AnchorAttention on Gemma 3 with a worst-row bound (its mean-recall config cost +31.7%
# perplexity: worst rows 0.10-0.36), then its perplexity beside dense (repository root; needs the Gemma package).
set -x
R=benches/results/calibrate; QG=/work/captures/qkv_gemma3_16k.pt; HG=/work/captures/calib/qkv_gemma3_8k_pydoc.pt
sparseprefill calibrate --qkv $QG --max-seqlen 8192 --rows 256 --margin 0.02 --target-row-recall 0.7 \
    --method anchor_attention --refine 3 --refine-top 50.0 --out-dir $R/gemma3-8k-m02-row07 \
    --table $R/cpu-calibrate-gemma3-8k-anchor_attention-m02-row07
sparseprefill calibrate --qkv $HG --rows 256 --eval $R/gemma3-8k-m02-row07/anchor_attention.json \
    --table $R/cpu-heldout-gemma3-8k-anchor_attention-m02-row07
sparseprefill eval ppl --model gemma3-270m --seqlen 8192 --last 1024 --text /work/captures/calib/pydoc_topics.txt \
    --config $R/gemma3-8k-m02-row07/anchor_attention.json --backend masked --device cpu \
    --json $R/cpu-ppl-gemma3-8k-anchor_attention-m02-row07.json
