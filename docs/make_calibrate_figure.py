"""Density per head before (each method's defaults) and after calibration, with the oracle:
docs/img/calibrate-density-per-head.png from the tables `sparseprefill calibrate --table` wrote.

    python docs/make_calibrate_figure.py benches/results/calibrate/cpu-calibrate-smollm2-4k-*.json
    # another figure, each table's method relabelled (LABEL=PATH):
    python docs/make_calibrate_figure.py --out docs/img/calibrate-refine.png --title "..." \
        "xattention grid=benches/results/calibrate/cpu-calibrate-smollm2-4k-C1.json" ...
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from sparseprefill.calibrate import LayerResult, plot_heads

DEFAULT_TITLE = "SmolLM2-135M, N = 4096 (stdlib code), target: every head's mean recall >= 0.95"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tables", nargs="+", help="calibrate --table JSON files, optionally LABEL=PATH")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "img" / "calibrate-density-per-head.png")
    ap.add_argument("--title", default=DEFAULT_TITLE)
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="only these layers")
    args = ap.parse_args(argv)
    results = []
    for item in args.tables:
        label, _, path = item.rpartition("=") if "=" in item else ("", "", item)
        for row in json.loads(Path(path).read_text())["layers"]:
            res = LayerResult(**row)
            if args.layers is not None and res.layer not in args.layers:
                continue
            results.append(replace(res, method=label) if label else res)
    plot_heads(results, args.out, title=args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
