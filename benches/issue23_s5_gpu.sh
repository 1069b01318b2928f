#!/usr/bin/env bash
# Issue 23, session 5: one device call from a carried copy (code, the one-head capture of every
# SmolLM2 8K layer, the fits made on the CPU, the captured statistics of the layers still to fit,
# calB.json and the peers' scratch copy):
#   source benches/device_env.sh
#   OUT=$OUT bash benches/issue23_s5_gpu.sh slim_h4.pt.xz fits5 stats.json calB.json peer2
# 1. (CPU, background) build MInference's own CUDA index builder (peer2/minference/cuda.py);
# 2. (CPU, 16 cores) fit the layers of stats.json from their saved statistics
#    (`calibrate_workload.py --stats`, one process per layer), join them with FITS/fit-l*.json;
# 3. (GPU) the calibration acceptance of every fitted layer, query head 4 with its KV head 1 (the
#    capture carries only that head's q and k: 30 layers x 2 MiB; v is k, which no recall reads),
#    ACCEPT_METHODS first, then MORE_METHODS while the time lasts;
# 4. (GPU) the peers beside our equal-recall rows on the calibrated workload at SEQLENS
#    (calB, Hq 12 / Hkv 4, the workload of the earlier equal-recall tables).
set -u -o pipefail
SLIM=${1:?one-head capture (.pt.xz)}; FITS=${2:?folder of fit-l*.json}; STATS=${3:?statistics to fit}
CAL=${4:?calibration of the equal-recall runs}; PEER=${5:?peer folder}
OUT=${OUT:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
T0=$(date +%s); TOTAL_S=${TOTAL_S:-420}
ACCEPT_METHODS=${ACCEPT_METHODS:-"vertical_slash block_sparse xattention anchor_attention streaming a_shape"}
MORE_METHODS=${MORE_METHODS:-"minference flexprefill_vs sample_attention shareprefill dpxa"}
SEQLENS=${SEQLENS:-"32768 131072"}; SOURCE_S=${SOURCE_S:-"50 80"}
ER_METHODS=${ER_METHODS:-"xattention minference vertical_slash flexprefill_vs"}
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)"
W=$(mktemp -d)
export MINFERENCE_BUILD=$W/minference-build
( cd "$PEER" && MAX_JOBS=8 timeout 240 python3 -c "from minference import cuda; cuda._load(); print('minference.cuda built')" ) \
  >"$OUT/minference-build.log" 2>&1 &
build=$!
for l in $(python3 -c "import json; print(' '.join(json.load(open('$STATS'))['layers']))"); do
  OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 timeout 200 python3 benches/calibrate_workload.py --stats "$STATS" --layers "$l" \
    --shared --iterations 10 --rows 128 --calibration "$W/fit-l$l.json" --json "$W/report-l$l.json" \
    >"$W/fit-l$l.log" 2>&1 &
done
xz -d -T4 -c "$SLIM" >"$W/slim.pt"
python3 - "$W/slim.pt" "$W/capture.pt" <<'EOF'
import sys, torch
d = torch.load(sys.argv[1], map_location="cpu")
h, j = d["query_head"], d["kv_head"]
qs, ks = [], []
for q1, k1 in zip(d["q"], d["k"]):
    q = torch.zeros(1, 9, *q1.shape[2:], dtype=q1.dtype); q[:, h] = q1[:, 0]
    k = torch.zeros(1, 3, *k1.shape[2:], dtype=k1.dtype); k[:, j] = k1[:, 0]
    qs.append(q); ks.append(k)
torch.save({"layers": d["layers"], "q": qs, "k": ks, "v": ks, "scale": d["scale"], "meta": d["meta"]}, sys.argv[2])
print("capture expanded:", len(qs), "layers, query head", h, "KV head", j)
EOF
while pgrep -f "calibrate_workload.py --stats" >/dev/null; do sleep 1; done
echo "device fits done at $(( $(date +%s) - T0 )) s: $(ls "$W"/fit-l*.json | wc -l) layers"
python3 benches/calibrate_workload.py --join $(ls "$FITS"/fit-l*.json "$W"/fit-l*.json) --calibration "$OUT/fit-all.json"
FIT=$OUT/fit-all.json
tar czf "$OUT/device-fits.tgz" -C "$W" $(cd "$W" && ls fit-l*.json report-l*.json fit-l*.log)
LAYERS=$(python3 -c "import json; print(' '.join(str(l['layer']) for l in json.load(open('$FIT'))['layers']))")
timeout 200 python3 benches/calibration_acceptance.py --qkv "$W/capture.pt" --calibration "$FIT" --layers $LAYERS \
  --query-heads 4 --backend fast --device cuda --methods $ACCEPT_METHODS --budget-s 170 \
  --json "$OUT/acceptance-all-h4.json" 2>"$OUT/acceptance.log" | tail -n 14
echo "acceptance done at $(( $(date +%s) - T0 )) s"
wait "$build"; echo "minference build exit $?"; tail -n 3 "$OUT/minference-build.log"
OMP_NUM_THREADS=4 python3 benches/equal_recall.py --measure --seqlens $SEQLENS --calibration "$CAL" --q-heads 12 \
  --kv-heads 4 --rep 30 --methods $ER_METHODS --source-budget-s $SOURCE_S --method-s 25 --peer "$PEER" --peers-first \
  --points-json "$OUT/points-peers.json" --json "$OUT/equal-recall-peers.json" >"$OUT/equal-recall-peers.log" 2>&1
grep -i "peer\|cudnn\|not run\|fail" "$OUT/equal-recall-peers.log" | tail -n 40
tail -n 25 "$OUT/equal-recall-peers.log"
LEFT=$(( TOTAL_S - ( $(date +%s) - T0 ) - 10 ))
echo "left for the other methods' acceptance: $LEFT s"
if [ "$LEFT" -gt 40 ]; then
  timeout "$LEFT" python3 benches/calibration_acceptance.py --qkv "$W/capture.pt" --calibration "$FIT" --layers $LAYERS \
    --query-heads 4 --backend fast --device cuda --methods $MORE_METHODS --budget-s $(( LEFT - 30 )) \
    --json "$OUT/acceptance-all-h4-more.json" 2>"$OUT/acceptance-more.log" | tail -n 10
fi
echo "total $(( $(date +%s) - T0 )) s"
