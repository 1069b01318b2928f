"""Issue 25: what `sparseprefill calibrate --margin` buys and costs, per method and layer.

Reads pairs of `calibrate --table` JSONs (the calibration run and the `--eval` held-out run)
for a config without margin and the same method calibrated with one, and prints one row per
(method, layer): held-out recall mean / worst head of each (the issue's held-out target:
mean >= 0.95 and worst head >= 0.85), held-out density of each and the margin's density
cost (ratio), and the calibration-prompt density of each.

    python benches/calib_margin.py --pair "LABEL=CAL.json:HELD.json|CAL_M.json:HELD_M.json" ... --json out.json
A side may be `-` (no run: the row then shows the other side only) or several
`CAL.json:HELD.json` joined by `+` (runs of different layers of one config).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def rows(spec: str, method: str) -> dict[int, tuple[dict[str, Any], dict[str, Any]]]:
    """layer -> (calibration summary, held-out summary) of `method` in `CAL.json:HELD.json`."""
    if spec == "-":
        return {}
    if "+" in spec:
        return {k: v for part in spec.split("+") for k, v in rows(part, method).items()}
    cal, held = spec.split(":")
    c = {int(r["layer"]): r for r in json.loads(Path(cal).read_text())["summary"] if r["method"] == method}
    h = {int(r["layer"]): r for r in json.loads(Path(held).read_text())["summary"] if r["method"] == method}
    return {layer: (c[layer], h[layer]) for layer in sorted(c) if layer in h}


def meets(h: dict[str, Any]) -> bool:
    return bool(h["recall_mean"] >= 0.95 and h["recall_min_head"] >= 0.85)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", action="append", required=True, metavar="LABEL=BASE|MARGIN")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    out = []
    print("| config | layer | no margin: held-out recall mean / worst head | margin: held-out recall mean / worst head "
          "| held-out density, no margin -> margin (cost) | calibration density, no margin -> margin | "
          "held-out oracle ratio with margin | recall target held out (no margin -> margin) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for item in args.pair:
        label, _, both = item.partition("=")
        base_spec, _, margin_spec = both.partition("|")
        method = label.split()[0]
        base, marg = rows(base_spec, method), rows(margin_spec, method)
        for layer in sorted(set(base) | set(marg)):
            b, m = base.get(layer), marg.get(layer)
            rec = (lambda x: f"{x[1]['recall_mean']:.3f} / {x[1]['recall_min_head']:.3f}" if x else "-")
            dens = (f"{b[1]['density']:.3f} -> {m[1]['density']:.3f} ({m[1]['density'] / b[1]['density']:.2f}x)"
                    if b and m else (f"- -> {m[1]['density']:.3f}" if m else f"{b[1]['density']:.3f} -> -"))
            cdens = (f"{b[0]['density']:.3f} -> {m[0]['density']:.3f}" if b and m
                     else (f"- -> {m[0]['density']:.3f}" if m else f"{b[0]['density']:.3f} -> -"))
            ok = f"{'yes' if b and meets(b[1]) else ('no' if b else '-')} -> {'yes' if m and meets(m[1]) else ('no' if m else '-')}"
            ratio = f"{m[1]['ratio']:.2f}x" if m else "-"
            print(f"| {label} | {layer} | {rec(b)} | {rec(m)} | {dens} | {cdens} | {ratio} | {ok} |")
            out.append({"config": label, "layer": layer, "base": None if b is None else {"calibration": b[0], "heldout": b[1]},
                        "margin": None if m is None else {"calibration": m[0], "heldout": m[1]}})
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
