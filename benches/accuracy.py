"""Accuracy of every registered method against dense attention, in three measurements.

1. `table`: density / recall / output error per method on captured SmolLM2 layers
   (run `benches/capture_qkv.py` first);
2. `passkey`: passkey retrieval grid (length x depth) with a heatmap PNG;
3. `ppl`: perplexity of the last 1K tokens of an 8K stdlib-text prompt.

Results go to `--out` (default `out/accuracy/`): `table.json`, `passkey.json`,
`passkey.png`, `ppl.json`, and the printed markdown tables.

Usage:
    python benches/accuracy.py --device cuda                 # full grid, fast backend
    python benches/accuracy.py --device cpu --quick          # reduced grid, reference backend
    python benches/accuracy.py --only table --device cuda    # one measurement
Extra options are passed to every measurement, e.g. `--methods dense streaming`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sparseprefill.evaluate import main as evaluate

QUICK = {
    "table": ["--max-seqlen", "2048"],
    "passkey": ["--lengths", "1024", "2048", "--depths", "0.1", "0.5", "0.9", "--trials", "1"],
    "ppl": ["--seqlen", "2048", "--last", "512"],
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/accuracy"))
    parser.add_argument("--qkv", default="out/qkv_smollm2_8k.pt")
    parser.add_argument("--quick", action="store_true", help="CPU-sized grid")
    parser.add_argument("--only", choices=("table", "passkey", "ppl"), action="append")
    args, rest = parser.parse_known_args(argv)
    status = 0
    for task in args.only or ["table", "passkey", "ppl"]:
        extra = QUICK[task] if args.quick else []
        cmd = [task, *extra, "--json", str(args.out / f"{task}.json"), *rest]
        if task == "table":
            cmd += ["--qkv", args.qkv]
        if task == "passkey":
            cmd += ["--png", str(args.out / "passkey.png")]
        print(f"## sparseprefill eval {' '.join(cmd)}", flush=True)
        status |= evaluate(cmd)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
