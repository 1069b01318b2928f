"""`sparseprefill eval heldout`: calibrated configs on held-out text, against the oracle and the unit's bound.

Reads the tables `sparseprefill calibrate --table` writes: a calibration run and the
`--eval` run of the same configs on other text (the held-out check). Per config, method
and layer it prints:

* held out: density, the oracle's density on the same sampled rows, their ratio, recall
  mean / worst head, and whether the target holds (`--target-recall` mean,
  `--worst-head`, `--max-ratio`: by default mean >= 0.95, worst head >= 0.85, <= 2x);
* on the calibration prompt: the config's density and its ratio to that prompt's oracle;
* with `--granularity` (`sparseprefill eval granularity` JSONs of the calibration prompt)
  and `--unit METHOD=UNIT`: the sparsest selection of the method's unit reaching the share
  (`block128`, `stripes128`, `lines`, ...; layer mean) as a ratio to the row oracle, and
  "why > 2x": `granularity` when that bound itself is over the ratio (no knob can reach
  the target with this unit), `estimator` when it is within and the config is not;
* with `--versus LABEL=CAL.json:HELD.json`: the same rows of another run of that config
  (say, without `--margin`): its held-out recall and density, the density it costs.

    sparseprefill eval heldout --config "margin 0.02=cal.json:held.json" \\
        --versus "margin 0.02=cal0.json:held0.json" --granularity g.json \\
        --unit xattention=block128 --unit vertical_slash=lines --json heldout.json

A side `CAL.json:HELD.json` may join several runs with `+` (runs of different layers of
one config).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

Rows = dict[tuple[str, int], tuple[dict[str, Any] | None, dict[str, Any]]]


def _summary(path: str) -> dict[tuple[str, int], dict[str, Any]]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("summary"), list):
        raise ValueError(f"{path}: not a `sparseprefill calibrate --table` JSON (no summary list)")
    return {(str(row["method"]), int(row["layer"])): row for row in data["summary"]}


def read_pair(spec: str) -> Rows:
    """`CAL.json:HELD.json` (runs joined by `+`; CAL may be `-`): (method, layer) ->
    (calibration summary or None, held-out summary)."""
    out: Rows = {}
    for part in spec.split("+"):
        cal, sep, held = part.partition(":")
        if not sep or not held:
            raise ValueError(f"expected CAL.json:HELD.json, got {part!r}")
        c = {} if cal == "-" else _summary(cal)
        for key, row in _summary(held).items():
            out[key] = (c.get(key), row)
    return out


def labelled(items: list[str], flag: str) -> list[tuple[str, Rows]]:
    """`LABEL=CAL.json:HELD.json` items read."""
    out = []
    for item in items:
        label, sep, spec = item.partition("=")
        if not sep:
            raise ValueError(f"{flag} takes LABEL=CAL.json:HELD.json, got {item!r}")
        out.append((label, read_pair(spec)))
    return out


def bounds(paths: list[Path]) -> dict[int, dict[str, float]]:
    """layer -> unit -> layer-mean density (and "row", the row oracle), from granularity JSONs."""
    out: dict[int, dict[str, float]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        for layer, heads in data["layers"].items():
            means = out.setdefault(int(layer), {})
            for key in heads[0]:
                vals = [h[key]["density"] if isinstance(h[key], dict) else h[key] for h in heads]
                means[key] = sum(vals) / len(vals)
    return out


def heldout_rows(configs: list[tuple[str, Rows]], *, versus: Mapping[str, Rows] | None = None,
                 bound: Mapping[int, Mapping[str, float]] | None = None, units: Mapping[str, str] | None = None,
                 recall: float = 0.95, worst_head: float = 0.85, max_ratio: float = 2.0) -> list[dict[str, Any]]:
    """One row per (config, method, layer) (see the module doc)."""
    rows = []
    for label, pairs in configs:
        other = (versus or {}).get(label, {})
        for (method, layer), (cal, held) in sorted(pairs.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            meets = (held["recall_mean"] >= recall and held["recall_min_head"] >= worst_head
                     and held["ratio"] <= max_ratio)
            unit = (units or {}).get(method)
            b = (bound or {}).get(layer, {})
            b_ratio = b[unit] / b["row"] if unit is not None and unit in b and b.get("row") else None
            why = ""
            if held["ratio"] > max_ratio and b_ratio is not None:
                why = "granularity" if b_ratio > max_ratio else "estimator"
            row: dict[str, Any] = {"label": label, "method": method, "layer": layer, "held": held,
                                   "calibration": cal, "meets": meets, "bound_unit": unit,
                                   "bound_density": b.get(unit) if unit else None, "bound_ratio": b_ratio, "why": why}
            if (method, layer) in other:
                ocal, oheld = other[(method, layer)]
                row["versus"] = {"calibration": ocal, "held": oheld,
                                 "meets": bool(oheld["recall_mean"] >= recall and oheld["recall_min_head"] >= worst_head
                                               and oheld["ratio"] <= max_ratio),
                                 "density_cost": held["density"] / oheld["density"] if oheld["density"] else None}
            rows.append(row)
    return rows


def format_heldout(rows: list[dict[str, Any]]) -> str:
    """Markdown table of `heldout_rows`."""
    versus = any("versus" in r for r in rows)
    head = ("| config | method | layer | held-out density | oracle | ratio | recall mean / worst head | meets | "
            "calibration density (ratio) | unit bound (ratio to row oracle) | config / bound | why over |")
    if versus:
        head += " versus: recall mean / worst head | versus: density | density cost | versus meets |"
    lines = [head, "| --- " * (head.count("|") - 1) + "|"]
    for r in rows:
        h, c = r["held"], r["calibration"]
        cal = f"{c['density']:.3f} ({c['ratio']:.2f}x)" if c else "-"
        unit, b_ratio = r["bound_unit"], r["bound_ratio"]
        bound = f"{unit} {r['bound_density']:.3f} ({b_ratio:.1f}x)" if b_ratio is not None else "-"
        over = f"{c['density'] / r['bound_density']:.2f}" if c and b_ratio is not None else "-"
        line = (f"| {r['label']} | {r['method']} | {r['layer']} | {h['density']:.3f} | {h['oracle']:.4f} | "
                f"{h['ratio']:.2f}x | {h['recall_mean']:.3f} / {h['recall_min_head']:.3f} | "
                f"{'yes' if r['meets'] else 'no'} | {cal} | {bound} | {over} | {r['why']} |")
        if versus:
            v = r.get("versus")
            if v is None:
                line += " - | - | - | - |"
            else:
                vh = v["held"]
                cost = "-" if v["density_cost"] is None else f"{v['density_cost']:.2f}x"
                line += (f" {vh['recall_mean']:.3f} / {vh['recall_min_head']:.3f} | {vh['density']:.3f} | {cost} | "
                         f"{'yes' if v['meets'] else 'no'} |")
        lines.append(line)
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `sparseprefill eval heldout`."""
    parser.add_argument("--config", action="append", required=True, metavar="LABEL=CAL.json:HELD.json",
                        help="a config's calibration and held-out `calibrate --table` JSONs (repeatable)")
    parser.add_argument("--versus", action="append", default=[], metavar="LABEL=CAL.json:HELD.json",
                        help="another run of config LABEL (e.g. without --margin) set beside it")
    parser.add_argument("--granularity", type=Path, nargs="+", default=[],
                        help="`sparseprefill eval granularity` JSONs of the calibration prompt")
    parser.add_argument("--unit", action="append", default=[], metavar="METHOD=UNIT",
                        help="the unit whose bound a method is held to (a key of the granularity JSON: "
                             "block128, stripes128, lines, ...)")
    parser.add_argument("--target-recall", type=float, default=0.95, help="least held-out mean recall (0.95)")
    parser.add_argument("--worst-head", type=float, default=0.85, help="least held-out worst head (0.85)")
    parser.add_argument("--max-ratio", type=float, default=2.0, help="largest density / oracle (2)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")


def run(args: argparse.Namespace) -> int:
    """Entry point of `sparseprefill eval heldout`."""
    try:
        configs = labelled(args.config, "--config")
        versus = dict(labelled(args.versus, "--versus"))
        unknown = sorted(set(versus) - {label for label, _ in configs})
        if unknown:
            raise ValueError(f"--versus labels {unknown} name no --config")
        units = {}
        for item in args.unit:
            method, sep, unit = item.partition("=")
            if not sep or not unit:
                raise ValueError(f"--unit takes METHOD=UNIT, got {item!r}")
            units[method] = unit
        rows = heldout_rows(configs, versus=versus, bound=bounds(args.granularity), units=units,
                            recall=args.target_recall, worst_head=args.worst_head, max_ratio=args.max_ratio)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as exc:
        print(f"sparseprefill eval heldout: {exc}", file=sys.stderr)
        return 2
    print(format_heldout(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    return 0
