"""Density per head before (each method's defaults) and after calibration, with the oracle:
docs/img/calibrate-density-per-head.png from the tables `sparseprefill calibrate --table` wrote.

    python docs/make_calibrate_figure.py benches/results/calibrate/cpu-calibrate-smollm2-4k-*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sparseprefill.calibrate import LayerResult, plot_heads


def main(paths: list[str]) -> None:
    results = []
    for path in paths:
        for row in json.loads(Path(path).read_text())["layers"]:
            results.append(LayerResult(**row))
    out = Path(__file__).resolve().parent / "img" / "calibrate-density-per-head.png"
    plot_heads(results, out, title="SmolLM2-135M, N = 4096 (stdlib code), target: every head's mean recall >= 0.95")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1:])
