"""One held-out table for issue 25: method x layer, against the oracle and the granularity bound.

Reads `sparseprefill calibrate --table` JSONs (the calibration run and the `--eval`
held-out run of each config) and `benches/calib_granularity.py` JSONs (exact
softmax, every row, on the calibration prompt), and prints, per config and layer:

* held out: density, the oracle's density on the same sampled rows, their ratio,
  recall mean / worst head, and whether the issue's target is met (mean >= 0.95,
  worst head >= 0.85, ratio <= 2);
* calibration prompt: the config's density and its ratio to that prompt's oracle;
* the bound of the method's granularity on the calibration prompt (the sparsest
  selection of its unit reaching mean recall 0.95 per head, layer mean), as a ratio
  to the row oracle: block methods 128 x 128 tiles (`block128`), per-query-block
  key columns `stripes128` (AnchorAttention), whole columns and diagonals `lines`
  (vertical-slash methods, SampleAttention, SharePrefill);
* "why > 2x": `granularity` when the bound itself is above 2x (no knob can reach the
  target with this unit), `estimator` when the bound is within 2x and the config is not.

    python benches/calib_summary.py --granularity G1.json G2.json \\
        --config "xattention bisected=CAL.json:HELD.json" ... > table.md

(a label starts with its method's name: the rows of that method are read from both files).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

BOUND = {"xattention": "block128", "dpxa": "block128", "anchor_attention": "stripes128",
         "flexprefill_vs": "lines", "vertical_slash": "lines", "sample_attention": "lines",
         "shareprefill": "lines"}


def summary(path: str) -> dict[tuple[str, int], dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    return {(row["method"], int(row["layer"])): row for row in data["summary"]}


def bounds(paths: list[str]) -> dict[int, dict[str, float]]:
    """Layer -> granularity -> layer-mean density, and "row" (the row oracle)."""
    out: dict[int, dict[str, float]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        for layer, heads in data["layers"].items():
            means = out.setdefault(int(layer), {})
            for key in heads[0]:
                vals = [h[key]["density"] if isinstance(h[key], dict) else h[key] for h in heads]
                means[key] = sum(vals) / len(vals)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--granularity", nargs="+", default=[])
    ap.add_argument("--config", action="append", default=[], metavar="LABEL=CAL.json:HELD.json")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    bound = bounds(args.granularity)
    rows = []
    print("| config | layer | held-out density | oracle | ratio | recall mean / worst head | meets "
          "| calibration density (ratio) | bound of its unit (ratio to row oracle) | config / bound | why > 2x |")
    print("| --- |" + " --- |" * 10)
    for item in args.config:
        label, _, paths = item.partition("=")
        cal_path, _, held_path = paths.partition(":")
        cal, held = summary(cal_path), summary(held_path)
        wanted = label.split()[0]  # the label starts with the method's name
        for (method, layer), h in sorted(held.items(), key=lambda kv: kv[0][1]):
            if method != wanted:
                continue
            c = cal.get((method, layer))
            unit = BOUND.get(method)
            b = bound.get(layer, {})
            b_ratio = b[unit] / b["row"] if unit in b and "row" in b else None
            meets = h["recall_mean"] >= 0.95 and h["recall_min_head"] >= 0.85 and h["ratio"] <= 2
            why = ""
            if h["ratio"] > 2 and b_ratio is not None:
                why = "granularity" if b_ratio > 2 else "estimator"
            row = {"label": label, "method": method, "layer": layer, "held": h, "calibration": c,
                   "bound_unit": unit, "bound_density": b.get(unit) if unit else None, "bound_ratio": b_ratio,
                   "meets": meets, "why": why}
            rows.append(row)
            cal_txt = f"{c['density']:.3f} ({c['ratio']:.2f}x)" if c else "-"
            bound_txt = f"{unit} {b[unit]:.3f} ({b_ratio:.1f}x)" if b_ratio is not None and unit else "-"
            over = f"{c['density'] / b[unit]:.2f}" if c and b_ratio is not None and unit else "-"
            print(f"| {label} | {layer} | {h['density']:.3f} | {h['oracle']:.4f} | {h['ratio']:.2f}x "
                  f"| {h['recall_mean']:.3f} / {h['recall_min_head']:.3f} | {'yes' if meets else 'no'} "
                  f"| {cal_txt} | {bound_txt} | {over} | {why} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
