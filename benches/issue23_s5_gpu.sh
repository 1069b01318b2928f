#!/usr/bin/env bash
# Issue 23, session 5: one device call from a carried copy (code, the one-head capture of every
# SmolLM2 8K layer, the captured statistics of every layer for two fits: statsB/ (`calibrate_workload.py
# --stats-only --shared --slash-select median [--max-seqlen M]`, M = 8192, 4096, 2048) and statsC/
# (`--stats-only`, the default fit's statistics, 8192 only), calB.json and the peers' scratch copy):
#   source benches/device_env.sh
#   OUT=$OUT bash benches/issue23_s5_gpu.sh slim statsB statsC calB.json peer2
# 1. (CPU, background) build MInference's own CUDA index builder (peer2/minference/cuda.py);
# 2. (CPU, FIT_PROCS processes of one thread) fit every layer from its saved 8K statistics
#    (`calibrate_workload.py --stats`) twice: B = the shared fit with the median slash statistic,
#    C = the default fit; join each; the acceptance below takes the one of smaller mean |error| of
#    the layers' oracle density at 0.95; then, in the background, B's 4K and 2K prefix fits with
#    their prediction at 8K (`--stats ... --predict-stats`);
# 3. (GPU) the calibration acceptance of every fitted layer, query head 4 with its KV head 1 (the
#    capture carries only that head's q and k: 30 layers x 2 MiB; v is k, which no recall reads),
#    ACCEPT_METHODS first, then MORE_METHODS while the time lasts;
# 4. (GPU) the peers beside our equal-recall rows on the calibrated workload at SEQLENS
#    (calB, Hq 12 / Hkv 4, the workload of the earlier equal-recall tables).
set -u -o pipefail
SLIM=${1:?one-head capture (prefix of _meta.pt, _lo.bin, _hi.xz)}; STATS=${2:?folder of the B statistics at 8192 4096 2048}
STATSC=${3:?folder of the C statistics at 8192}; CAL=${4:?calibration of the equal-recall runs}; PEER=${5:?peer folder}
FIT_PROCS=${FIT_PROCS:-13}
OUT=${OUT:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
T0=$(date +%s); TOTAL_S=${TOTAL_S:-460}
ACCEPT_METHODS=${ACCEPT_METHODS:-"vertical_slash block_sparse xattention anchor_attention streaming a_shape"}
MORE_METHODS=${MORE_METHODS:-"minference flexprefill_vs sample_attention shareprefill dpxa"}
SEQLENS=${SEQLENS:-"32768 131072"}; SOURCE_S=${SOURCE_S:-"80 110"}
ER_METHODS=${ER_METHODS:-"xattention minference vertical_slash flexprefill_vs"}
python3 -c "import torch, triton; print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)"
W=$(mktemp -d)
export MINFERENCE_BUILD=$W/minference-build
( cd "$PEER" && MAX_JOBS=8 timeout 240 python3 -c "from minference import cuda; cuda._load(); print('minference.cuda built')" ) \
  >"$OUT/minference-build.log" 2>&1 &
build=$!
LAYERS=$(python3 -c "import json; print(' '.join(json.load(open('$STATS/stats-8192.json'))['layers']))")
fit() {  # $1 = layer, $2 = prefix length (8192: the fit itself), $3 = B or C
  local extra="" dir=$STATS opts="--shared --slash-select median --iterations 10"
  [ "$3" = C ] && dir=$STATSC opts="--iterations 14"
  [ "$2" = 8192 ] || extra="--predict-stats $dir/stats-8192.json --rules sink-log"
  OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 timeout 300 python3 benches/calibrate_workload.py --stats "$dir/stats-$2.json" \
    --layers "$1" $opts --rows 128 $extra \
    --calibration "$W/$3-fit$2-l$1.json" --json "$W/$3-report$2-l$1.json" >"$W/$3-fit$2-l$1.log" 2>&1
}
export -f fit; export W STATS STATSC
# One queue: the 8K fits of B and C, then B's prefix fits (while the GPU works below).
( printf '%s 8192 B\n' $LAYERS; printf '%s 4096 B\n' $LAYERS; printf '%s 2048 B\n' $LAYERS;
  printf '%s 8192 C\n' $LAYERS ) | xargs -P "$FIT_PROCS" -L1 bash -c 'fit $0 $1 $2' &
fits=$!
python3 - "$SLIM" "$W/capture.pt" <<'EOF'
# The one-head capture, carried as byte planes (the low bytes raw, the high bytes xz: 2 MiB a layer
# does not fit the carry with 30 layers otherwise), unpacked into the capture layout with zeros in
# the other heads (calibration_acceptance.py --query-heads 4 reads only head 4 and its KV head).
import lzma, sys, numpy as np, torch
d = torch.load(sys.argv[1] + "_meta.pt")
lo = np.fromfile(sys.argv[1] + "_lo.bin", dtype=np.uint8)
hi = np.frombuffer(lzma.decompress(open(sys.argv[1] + "_hi.xz", "rb").read()), dtype=np.uint8)
flat = torch.from_numpy(np.stack([lo, hi], 1).reshape(-1).copy().view(np.float16))
ts, at = [], 0
for shape in d["shapes"]:
    size = int(np.prod(shape)); ts.append(flat[at:at + size].view(shape)); at += size
n = len(d["layers"]); h, j = d["query_head"], d["kv_head"]
qs, ks = [], []
for q1, k1 in zip(ts[:n], ts[n:]):
    q = torch.zeros(1, 9, *q1.shape[2:], dtype=q1.dtype); q[:, h] = q1[:, 0]
    k = torch.zeros(1, 3, *k1.shape[2:], dtype=k1.dtype); k[:, j] = k1[:, 0]
    qs.append(q); ks.append(k)
torch.save({"layers": d["layers"], "q": qs, "k": ks, "v": ks, "scale": d["scale"], "meta": d["meta"]}, sys.argv[2])
print("capture expanded:", len(qs), "layers, query head", h, "KV head", j)
EOF
if [ -z "${SKIP_ER:-}" ]; then
wait "$build"; echo "minference build exit $? at $(( $(date +%s) - T0 )) s"; tail -n 3 "$OUT/minference-build.log"
OMP_NUM_THREADS=4 python3 benches/equal_recall.py --measure --seqlens $SEQLENS --calibration "$CAL" --q-heads 12 \
  --kv-heads 4 --rep 30 --methods $ER_METHODS --source-budget-s $SOURCE_S --method-s 25 --peer "$PEER" --peers-first \
  --points-json "$OUT/points-peers.json" --json "$OUT/equal-recall-peers.json" >"$OUT/equal-recall-peers.log" 2>&1
grep -i "peer\|cudnn\|not run\|fail" "$OUT/equal-recall-peers.log" | tail -n 40
tail -n 25 "$OUT/equal-recall-peers.log"
fi
n8=$(echo $LAYERS | wc -w)
for _ in $(seq 240); do
  [ $(ls "$W"/B-fit8192-l*.log 2>/dev/null | wc -l) -ge "$n8" ] && \
    ! pgrep -f -- "--stats $STATS/stats-8192.json" >/dev/null && break; sleep 1; done
echo "8K fits done at $(( $(date +%s) - T0 )) s: $(ls "$W"/B-fit8192-l*.json | wc -l) B, $(ls "$W"/C-fit8192-l*.json | wc -l) C"
for v in B C; do python3 benches/calibrate_workload.py --join "$W"/$v-fit8192-l*.json --calibration "$OUT/fit-all-$v.json"; done
V=$(python3 - "$W" <<'EOF'
import glob, json, sys
err = {}
for v in "BC":
    e = [abs(json.load(open(p))["rules"]["sink-log"][0]["summary"]["oracle_0.95"]["relative_error"])
         for p in glob.glob(f"{sys.argv[1]}/{v}-report8192-l*.json")]
    err[v] = sum(e) / len(e) if e else float("inf")
    print(f"fit {v}: {len(e)} layers, mean |oracle@0.95 error| {err[v]:.3f}", file=sys.stderr)
print(min(err, key=err.get))
EOF
)
V=${FORCE_V:-$V}
echo "acceptance on fit $V"
FIT=$OUT/fit-all-$V.json

# The fitted layers the carried capture holds (it may leave some out to fit the carry).
LAYERS=$(python3 -c "import json, torch; have = set(torch.load('${SLIM}_meta.pt')['layers']); print(' '.join(str(l['layer']) for l in json.load(open('$FIT'))['layers'] if l['layer'] in have))")
timeout 200 python3 benches/calibration_acceptance.py --qkv "$W/capture.pt" --calibration "$FIT" --layers $LAYERS \
  --query-heads 4 --backend fast --device cuda --methods $ACCEPT_METHODS --budget-s 170 \
  --json "$OUT/acceptance-all-h4.json" 2>"$OUT/acceptance.log" | tail -n 14
echo "acceptance done at $(( $(date +%s) - T0 )) s"
LEFT=$(( TOTAL_S - ( $(date +%s) - T0 ) - 10 ))
echo "left for the other methods' acceptance: $LEFT s"
if [ "$LEFT" -gt 40 ]; then
  timeout "$LEFT" python3 benches/calibration_acceptance.py --qkv "$W/capture.pt" --calibration "$FIT" --layers $LAYERS \
    --query-heads 4 --backend fast --device cuda --methods $MORE_METHODS --budget-s $(( LEFT - 30 )) \
    --json "$OUT/acceptance-all-h4-more.json" 2>"$OUT/acceptance-more.log" | tail -n 10
fi
kill -0 "$fits" 2>/dev/null && echo "prefix fits still running: waiting at most 45 s"
for _ in $(seq 45); do kill -0 "$fits" 2>/dev/null || break; sleep 1; done
tar czf "$OUT/fits.tgz" -C "$W" $(cd "$W" && ls ?-fit*-l*.json ?-report*-l*.json ?-fit*-l*.log 2>/dev/null)
echo "prefix reports: $(ls "$W"/B-report4096-l*.json 2>/dev/null | wc -l) at 4K, $(ls "$W"/B-report2048-l*.json 2>/dev/null | wc -l) at 2K"
echo "total $(( $(date +%s) - T0 )) s"
