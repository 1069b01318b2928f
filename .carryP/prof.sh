#!/usr/bin/env bash
# CPU-interpreter test profile on a many-core host: files spread over P processes, one thread each.
set -u
P=${P:-15}
rm -rf /tmp/sp; mkdir -p /tmp/sp; cp -r sparseprefill /tmp/sp/; for d in reference fast conformance; do ln -s $PWD/$d /tmp/sp/sparseprefill/$d; done; export PYTHONPATH=/tmp/sp
(cd /tmp && python3 -c "import sparseprefill.conformance, sparseprefill; print(sparseprefill.__file__)")
python3 -c "import hypothesis, pytest; print('hyp', hypothesis.__version__, 'pytest', pytest.__version__)"
ls tests/test_*.py | grep -v test_mypy > /tmp/files.txt
split -n r/$P /tmp/files.txt /tmp/part_
for p in /tmp/part_*; do n=$(basename $p)
  ( OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TIMELOG=$OUT/t_$n.jsonl PYTHONPATH=/tmp/sp:$PWD/.carryP TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= \
    timeout ${LIMIT:-420} pytest -q -p no:cacheprovider -p timelog $(cat $p) > $OUT/o_$n.txt 2>&1 ) &
done
wait
tail -n 3 $OUT/o_*.txt | grep -E "passed|failed|error" 
cat $OUT/t_*.jsonl | python3 -c "
import sys,json
r=[json.loads(l) for l in sys.stdin]; r.sort(key=lambda x:-x['cpu'])
print('tests', len(r), 'cpu', round(sum(x['cpu'] for x in r)), 'wall', round(sum(x['wall'] for x in r)))
for x in r[:30]: print(round(x['cpu'],1), round(x['wall'],1), x['id'])"
