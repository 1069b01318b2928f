#!/usr/bin/env bash
# GPU conformance of the merged tree without an install: the package assembled by links.
set -u
R=$PWD
rm -rf /tmp/sp; mkdir -p /tmp/sp; cp -r sparseprefill /tmp/sp/
for d in reference fast conformance; do ln -s $R/$d /tmp/sp/sparseprefill/$d; done
export PYTHONPATH=/tmp/sp TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
cd /tmp && python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout ${LIMIT:-330} python3 -m sparseprefill.conformance --device cuda --max-seqlen ${MAXN:-8192} --examples ${EX:-6} \
  --row-budget ${RB:-3} --properties ${PROPS:-plan,end_to_end,estimate,sparse_attention,masked_attention,resumed_attention,nonfinite,plan_validation} \
  --json $OUT/conformance.json 2>&1 | tee $OUT/conformance.log | tail -n 70
