"""The calibration table of issue 23, one row per fitted layer, from the outputs of
`calibrate_workload.py` (the fit's report at the capture's length, and the prefix
predictions) and `calibration_acceptance.py` (every method on one head of every layer):

    python benches/calibration_table.py --reports fits/report-l*.json \\
        --prefix fits/prefix4096-l*.json fits/prefix2048-l*.json \\
        --acceptance acceptance-all-h4.json --json benches/results/calibration-table.json

Per layer: the captured and calibrated oracle density at 0.9 / 0.95 mass (layer mean over its
query heads, relative error, and whether within 20%), the five shares, the relative error of the
oracle density at 0.95 predicted at the full length from each prefix fit, and from the acceptance
items of that layer: the oracle densities of the head, every method's largest recall gap at equal
density and how many methods are within 0.03.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

TOLERANCE = 0.03
ORACLE_TOLERANCE = 0.20


def _summary(path: Path) -> tuple[int, dict[str, Any]]:
    report = json.loads(path.read_text())
    rule = next(iter(report["rules"]))
    item = report["rules"][rule][0]
    return int(item["layer"]), item["summary"]


def table(reports: list[Path], prefixes: dict[int, list[Path]], acceptance: list[Path]) -> dict[str, Any]:
    """Per layer rows (see the module doc) and totals."""
    rows: dict[int, dict[str, Any]] = {}
    for path in reports:
        layer, s = _summary(path)
        row = rows.setdefault(layer, {"layer": layer})
        for share in ("0.9", "0.95"):
            o = s[f"oracle_{share}"]
            row[f"oracle_{share}"] = {"captured": o["captured"], "calibrated": o["generated"],
                                      "relative_error": o["relative_error"],
                                      "head_relative_error_max": o["head_relative_error_max"]}
        row["shares"] = {name: [s[name]["captured"], s[name]["generated"]]
                         for name in ("sink", "local", "vertical", "slash", "rest")}
    for m, paths in prefixes.items():
        for path in paths:
            layer, s = _summary(path)
            rows.setdefault(layer, {"layer": layer})[f"predicted_from_{m}"] = {
                "oracle_0.9": s["oracle_0.9"]["relative_error"], "oracle_0.95": s["oracle_0.95"]["relative_error"]}
    for path in acceptance:
        for item in json.loads(path.read_text())["layers"]:
            row = rows.setdefault(int(item["layer"]), {"layer": int(item["layer"])})
            acc = row.setdefault("acceptance", {"query_heads": item["query_heads"], "gaps": {}})
            o = item["oracle"]
            if "captured" in o and "calibrated" in o:
                acc["oracle"] = {"captured": o["captured"], "calibrated": o["calibrated"],
                                 "relative_error": [b / a - 1 for a, b in zip(o["captured"], o["calibrated"])]}
            for name, g in item["gaps"].items():
                if "recall_gap_at_equal_density_max" in g and name != "dense":
                    acc["gaps"][name] = g["recall_gap_at_equal_density_max"]
    out = [rows[k] for k in sorted(rows)]
    for row in out:
        acc = row.get("acceptance")
        if acc is not None:
            gaps = [x for x in acc["gaps"].values() if x is not None]
            acc["within"] = sum(x <= TOLERANCE for x in gaps)
            acc["methods"] = len(gaps)
    return {"tolerance": TOLERANCE, "oracle_tolerance": ORACLE_TOLERANCE, "layers": out, "totals": _totals(out)}


def _totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    t: dict[str, Any] = {}
    fitted = [r for r in rows if "oracle_0.95" in r]
    for share in ("0.9", "0.95"):
        errs = [abs(r[f"oracle_{share}"]["relative_error"]) for r in fitted]
        if errs:
            t[f"layers_oracle_{share}_within_20pct"] = f"{sum(e <= ORACLE_TOLERANCE for e in errs)}/{len(errs)}"
    for key in sorted({k for r in rows for k in r if k.startswith("predicted_from_")}):
        e = [abs(r[key]["oracle_0.95"]) for r in rows if key in r]
        t[key] = {"layers": len(e), "mean_abs_error_0.95": sum(e) / len(e), "max_abs_error_0.95": max(e),
                  "within_20pct": sum(x <= ORACLE_TOLERANCE for x in e), "within_30pct": sum(x <= 0.3 for x in e)}
    per: dict[str, list[float]] = {}
    for r in rows:
        for name, g in r.get("acceptance", {}).get("gaps", {}).items():
            if g is not None:
                per.setdefault(name, []).append(g)
    t["methods"] = {name: {"layers": len(v), "within": sum(x <= TOLERANCE for x in v), "max": max(v),
                           "median": sorted(v)[len(v) // 2]} for name, v in per.items()}
    acc = [r["acceptance"] for r in rows if "acceptance" in r and "oracle" in r["acceptance"]]
    if acc:
        t["heads_oracle_within_20pct"] = [sum(abs(a["oracle"]["relative_error"][i]) <= ORACLE_TOLERANCE for a in acc)
                                          for i in range(2)]
        t["heads"] = len(acc)
        t["heads_all_methods_within"] = sum(a["within"] == a["methods"] for a in acc)
    return t


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"


def format_table(t: dict[str, Any]) -> str:
    methods = sorted(t["totals"].get("methods", {}))
    short = {"vertical_slash": "VS", "block_sparse": "BS", "xattention": "XA", "anchor_attention": "AA",
             "streaming": "SL", "a_shape": "AS", "minference": "MI", "flexprefill_vs": "FP",
             "sample_attention": "SA", "shareprefill": "SP", "dpxa": "DPXA"}
    head = ("| layer | oracle@0.9 capt / cal (err) | oracle@0.95 capt / cal (err) | from 4K | from 2K | "
            "head: oracle@0.9 / 0.95 err | " + " | ".join(short.get(m, m) for m in methods) + " | within 0.03 |")
    lines = [head, "| " + " | ".join(["---"] * (7 + len(methods))) + " |"]
    for r in t["layers"]:
        cells = [str(r["layer"])]
        for share in ("0.9", "0.95"):
            o = r.get(f"oracle_{share}")
            cells.append("-" if o is None else
                         f"{o['captured']:.4f} / {o['calibrated']:.4f} ({_pct(o['relative_error'])})")
        for m in ("4096", "2048"):
            p = r.get(f"predicted_from_{m}")
            cells.append("-" if p is None else _pct(p["oracle_0.95"]))
        acc = r.get("acceptance", {})
        o = acc.get("oracle")
        cells.append("-" if o is None else f"{_pct(o['relative_error'][0])} / {_pct(o['relative_error'][1])}")
        for m in methods:
            g = acc.get("gaps", {}).get(m)
            cells.append("-" if g is None else (f"**{g:.3f}**" if g > TOLERANCE else f"{g:.3f}"))
        cells.append(f"{acc['within']}/{acc['methods']}" if "within" in acc else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=Path, nargs="+", default=[], help="fit reports at the capture's length")
    parser.add_argument("--prefix", type=Path, nargs="+", default=[], help="prefix-fit reports (--predict)")
    parser.add_argument("--acceptance", type=Path, nargs="+", default=[])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    prefixes: dict[int, list[Path]] = {}
    for path in args.prefix:
        prefixes.setdefault(int(json.loads(path.read_text())["fit_seqlen"]), []).append(path)
    t = table(args.reports, prefixes, args.acceptance)
    print(format_table(t))
    print(json.dumps(t["totals"], indent=1))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": "python benches/calibration_table.py "
                                         + " ".join(argv or sys.argv[1:]), **t}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
