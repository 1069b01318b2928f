"""Summarise a `sparseprefill compare` JSON: per method and layer, the least density
reaching a recall (and an output error), against the oracle.

    python docs/make_compare_summary.py benches/results/cpu-smollm2-compare-4k-2026-11-23.json

For each method's sweep points of one source (layer), the density needed for mean
recall 0.90 / 0.95 is interpolated linearly along the method's Pareto frontier
(points sorted by density, recall made non-decreasing); "-" where no point of the
grid reaches it. The oracle's density at the same recall comes from its own curve.
Methods that change the keys (Delta-KV, DeltaXAttention) have no recall; for every
method the least density with output error <= 0.05 is given too.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from typing import Any


def _frontier(points: list[dict[str, Any]], key: str, better: str) -> list[tuple[float, float]]:
    pts = sorted((p["density"], p[key]) for p in points if p.get(key) is not None)
    out: list[tuple[float, float]] = []
    for dens, val in pts:
        if out and ((better == "high" and val <= out[-1][1]) or (better == "low" and val >= out[-1][1])):
            continue
        out.append((dens, val))
    return out


def _density_at(front: list[tuple[float, float]], target: float, better: str) -> float | None:
    def ok(v: float) -> bool:
        return v >= target if better == "high" else v <= target
    for i, (dens, val) in enumerate(front):
        if ok(val):
            if i == 0:
                return dens
            d0, v0 = front[i - 1]
            return d0 + (dens - d0) * (target - v0) / (val - v0) if val != v0 else dens
    return None


def summary(points: list[dict[str, Any]]) -> str:
    by: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for p in points:
        by[(p["source"], p["method"])].append(p)
    sources = sorted({s for s, _ in by}, key=lambda s: int(s.split()[-1]) if s.split()[-1].isdigit() else 0)
    methods = sorted({m for _, m in by if m != "oracle"})
    rows = ["Each cell: density at mean recall 0.90 / at 0.95 (x the oracle's at 0.95) / at output error <= 0.05.",
            "",
            "| method | " + " | ".join(sources) + " |",
            "| --- |" + " --- |" * len(sources)]
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    for m in ["oracle", *methods]:
        cells = []
        for s in sources:
            pts = by.get((s, m), [])
            rec = _frontier(pts, "recall_mean", "high")
            err = _frontier(pts, "output_error", "low")
            d90, d95 = _density_at(rec, 0.90, "high"), _density_at(rec, 0.95, "high")
            o95 = _density_at(_frontier(by.get((s, "oracle"), []), "recall_mean", "high"), 0.95, "high")
            x = f" ({d95 / o95:.1f}x)" if d95 is not None and o95 and m != "oracle" else ""
            cells.append(f"{fmt(d90)} / {fmt(d95)}{x} / {fmt(_density_at(err, 0.05, 'low'))}")
        rows.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(summary(json.load(open(sys.argv[1]))["points"]))
