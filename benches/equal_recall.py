"""Speed at equal accuracy: from `sparseprefill compare` points, per method the knob
setting that reaches a mean recall target at the least end-to-end time.

    sparseprefill compare --seqlen 32768 --workload calibrated --device cuda \\
        --json benches/results/h100-compare-calibrated-32k-2026-11-25.json
    python benches/equal_recall.py benches/results/h100-compare-calibrated-32k-2026-11-25.json \\
        --targets 0.95 0.90 --json benches/results/h100-equal-recall-32k-2026-11-25.json \\
        --png docs/img/equal-recall-32k.png

Per (source, method, target): the point with mean recall >= target and the least e2e
time (without GPU times: the least density), its density, time split (estimate+plan,
kernel), speedup over cuDNN SDPA of the same run and the ratio of its time to the floor
`density x cuDNN time`; beside it the oracle's density at the target. A method none of
whose points reaches the target is listed as such, with its best recall. Methods
without recall (Delta-KV, DeltaXAttention) are left out: they change the keys.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any


def equal_recall(points: list[dict[str, Any]], targets: list[float]) -> list[dict[str, Any]]:
    """Rows of the equal-recall table (see the module doc)."""
    rows = []
    sources = list(dict.fromkeys(p["source"] for p in points))
    for source in sources:
        mine = [p for p in points if p["source"] == source]
        oracle = sorted((p["recall_mean"], p["density"]) for p in mine if p["method"] == "oracle")
        for method in dict.fromkeys(p["method"] for p in mine if p["method"] != "oracle"):
            pts = [p for p in mine if p["method"] == method and p["recall_mean"] is not None]
            if not pts:
                continue
            for target in targets:
                ok = [p for p in pts if p["recall_mean"] >= target]
                row: dict[str, Any] = {"source": source, "method": method, "target": target,
                                       "oracle_density": _oracle_at(oracle, target)}
                if not ok:
                    best = max(pts, key=lambda p: p["recall_mean"])
                    row.update(reached=False, best_recall=best["recall_mean"], params=best["params"])
                    rows.append(row)
                    continue
                timed = [p for p in ok if p.get("gpu", {}).get("e2e_ms") is not None]
                pick = min(timed, key=lambda p: p["gpu"]["e2e_ms"]) if timed else min(ok, key=lambda p: p["density"])
                gpu = pick.get("gpu", {})
                row.update(reached=True, params=pick["params"], density=pick["density"],
                           recall=pick["recall_mean"], e2e_ms=gpu.get("e2e_ms"),
                           estimate_plan_ms=gpu.get("estimate_plan_ms"), kernel_ms=gpu.get("kernel_ms"),
                           cudnn_ms=gpu.get("cudnn_ms"), speedup_vs_cudnn=gpu.get("speedup_vs_cudnn"),
                           vs_floor=(gpu["e2e_ms"] / gpu["floor_ms"] if gpu.get("floor_ms") else None))
                rows.append(row)
    return rows


def _oracle_at(curve: list[tuple[float, float]], recall: float) -> float | None:
    prev = (0.0, 0.0)
    for r, d in curve:
        if recall <= r:
            return d if r == prev[0] else prev[1] + (d - prev[1]) * (recall - prev[0]) / (r - prev[0])
        prev = (r, d)
    return None


def _f(x: Any, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_rows(rows: list[dict[str, Any]]) -> str:
    """Markdown table of `equal_recall` rows."""
    lines = ["| source | target | method | setting | density (oracle) | recall | e2e ms | estimate+plan ms "
             "| kernel ms | vs cuDNN | x floor |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        params = ", ".join(f"{k}={v}" for k, v in r["params"].items() if k != "patterns") or "-"
        if not r["reached"]:
            lines.append(f"| {r['source']} | {r['target']} | {r['method']} | not reached (best recall "
                         f"{r['best_recall']:.3f} at {params}) | - | - | - | - | - | - | - |")
            continue
        lines.append(f"| {r['source']} | {r['target']} | {r['method']} | {params} | {r['density']:.3f} "
                     f"({_f(r['oracle_density'], '.3f')}) | {r['recall']:.3f} | {_f(r['e2e_ms'], '.2f')} | "
                     f"{_f(r['estimate_plan_ms'], '.2f')} | {_f(r['kernel_ms'], '.2f')} | "
                     f"{_f(r['speedup_vs_cudnn'], '.2f')} | {_f(r['vs_floor'], '.2f')} |")
    return "\n".join(lines)


def plot(points: list[dict[str, Any]], path: Path) -> None:
    """Speedup over cuDNN against recall, every timed point, one panel per source; the
    oracle's floor (1 / its density) as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = list(dict.fromkeys(p["source"] for p in points))
    fig, axes = plt.subplots(1, len(sources), figsize=(6.5 * len(sources), 4.8), squeeze=False)
    for ax, source in zip(axes[0], sources):
        mine = [p for p in points if p["source"] == source]
        oracle = sorted((p["recall_mean"], 1.0 / p["density"]) for p in mine if p["method"] == "oracle" and p["density"])
        if oracle:
            ax.plot([r for r, _ in oracle], [s for _, s in oracle], "k--", label="oracle floor (1 / density)")
        for method in sorted({p["method"] for p in mine if p["method"] != "oracle"}):
            pts = [p for p in mine if p["method"] == method and p["recall_mean"] is not None
                   and p.get("gpu", {}).get("speedup_vs_cudnn") is not None]
            if pts:
                ax.plot([p["recall_mean"] for p in pts], [p["gpu"]["speedup_vs_cudnn"] for p in pts], "o-",
                        ms=3, label=method)
        ax.set_yscale("log")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("mean recall")
        ax.set_ylabel("speedup vs cuDNN SDPA (end to end)")
        ax.set_title(source, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("compare_json", type=Path, nargs="+", help="`sparseprefill compare --json` outputs")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.95, 0.90])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args(argv)
    points = []
    for path in args.compare_json:
        points += json.loads(path.read_text())["points"]
    rows = equal_recall(points, args.targets)
    print(format_rows(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"inputs": [str(p) for p in args.compare_json], "rows": rows}, indent=1))
    if args.png is not None:
        plot(points, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
