"""Acceptance of the calibrated workload: every registered method's sweep on captured
layers and on the calibrated workload fitted to them, at the capture's length.

    python benches/calibration_acceptance.py --qkv /work/captures/qkv_smollm2_8k_all.pt \\
        --calibration sparseprefill/workloads/smollm2-8k.json --layers 14 --kv-heads 0 \\
        --json benches/results/cpu-smollm2-calibration-acceptance-2026-11-25.json

Per layer (and, to fit a CPU's time, a subset of KV heads with their query heads):
the oracle's density at 0.9 / 0.95 on both (all rows), every method's points, and per
method the largest recall gap at equal density (`workload.curve_gaps`). On a GPU pass
`--backend fast --device cuda` for every layer and head.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sparseprefill import workload
from sparseprefill.methods import METHODS
from sparseprefill.demo import Shape
from sparseprefill.oracle import oracle_density

TOLERANCE = 0.03


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qkv", type=Path, default=None)
    parser.add_argument("--calibration", type=Path, default=None, help="default: the shipped fit")
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="default: every fitted layer")
    parser.add_argument("--kv-heads", type=int, nargs="+", default=None,
                        help="KV heads (with their query heads) to run (default all)")
    parser.add_argument("--query-heads", type=int, nargs="+", default=None,
                        help="instead of --kv-heads: these query heads, each with its KV head (one KV head "
                             "per query head: a CPU-sized subset)")
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no new (layer, heads) item after this many seconds")
    parser.add_argument("--per-head", action="store_true",
                        help="every chosen query head on its own (its own curves and gaps)")
    parser.add_argument("--methods", nargs="+", default=None, help="default: every registered method")
    parser.add_argument("--backend", choices=("reference", "fast"), default="reference")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workloads", nargs="+", choices=("captured", "calibrated"),
                        default=["captured", "calibrated"],
                        help="run only these (two processes can split the work; --merge joins them)")
    parser.add_argument("--merge", type=Path, nargs="+", default=None,
                        help="instead of running: join these JSON outputs of one layer and report the gaps")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    start = time.perf_counter()
    if args.merge is not None:
        parts = [json.loads(path.read_text())["layers"][0] for path in args.merge]
        points = [workload.CurvePoint(**p) for part in parts for p in part["points"]]
        item = {**parts[0], "oracle": {k: v for part in parts for k, v in part["oracle"].items()},
                "gaps": workload.curve_gaps(points), "points": [asdict(p) for p in points]}
        print(format_acceptance(item))
        _write(args, argv, start, [item])
        return 0
    data = torch.load(args.qkv, map_location="cpu")
    cal = workload.load_calibration(args.calibration)
    methods = args.methods or list(METHODS)
    layers = args.layers or [lp.layer for lp in cal.layers]
    # bf16 on the fast backend (the dtype of the equal-recall runs: one set of compiled kernels).
    dtype = torch.bfloat16 if args.backend == "fast" else torch.float32
    results = []
    for layer in layers:
        lp = next(x for x in cal.layers if x.layer == layer)
        i = list(data["layers"]).index(layer)
        hq, hkv = len(lp.heads), len(lp.kv)
        group = hq // hkv
        if args.query_heads is not None:
            qh_all = list(args.query_heads)
        else:
            kv_all = args.kv_heads if args.kv_heads is not None else list(range(hkv))
            qh_all = [j * group + t for j in kv_all for t in range(group)]
        # --per-head: every query head (with its KV head) on its own, so each head has its own
        # curves and gaps; else the chosen heads together (curves of their mean recall).
        for qh in ([[h] for h in qh_all] if args.per_head else [qh_all]):
            if time.perf_counter() - start > args.budget_s:
                log(f"out of time (--budget-s {args.budget_s}) before layer {layer} heads {qh}")
                break
            kv_heads = [h // group for h in qh] if args.query_heads is not None or args.per_head else \
                sorted({h // group for h in qh})
            results.append(_one(args, argv, start, data, cal, lp, i, layer, qh, kv_heads, methods, dtype, results,
                                log))
    if len(results) > 1:
        print(format_summary(results), flush=True)
    _write(args, argv, start, results, summary=summarize(results) if results else None)
    return 0


def _one(args: argparse.Namespace, argv: list[str] | None, start: float, data: dict[str, Any],
         cal: workload.Calibration, lp: workload.LayerParams, i: int, layer: int, qh: list[int],
         kv_heads: list[int], methods: list[str], dtype: torch.dtype, results: list[dict[str, Any]],
         log: Callable[[str], None]) -> dict[str, Any]:
    """Both workloads of one set of query heads of one layer; the item of the JSON."""
    q, k, v = data["q"][i][:, qh], data["k"][i][:, kv_heads], data["v"][i][:, kv_heads]
    n = int(q.shape[2])
    # The twin is the fit's own realization: the whole layer generated at its shape and seed,
    # the chosen heads taken from it (a head generated alone is another draw of its random
    # parts, whose statistics vary from draw to draw: docs/workload.md).
    group = len(lp.heads) // len(lp.kv)
    shape = Shape(1, len(lp.heads), len(lp.kv), n, workload.FIT_HEAD_DIM, torch.float64)
    fq, fk, fv = workload.generate_layer(list(lp.heads), list(lp.kv), shape, seed=args.seed, fit_seqlen=lp.seqlen,
                                         rule=cal.rule)
    if any(h // group != j for h, j in zip(qh, kv_heads)) and len(kv_heads) == len(qh):
        raise ValueError(f"query heads {qh} do not match KV heads {kv_heads}")
    gq, gk, gv = fq[:, qh], fk[:, kv_heads], fv[:, kv_heads]
    del fq, fk, fv
    points: list[workload.CurvePoint] = []
    oracle = {}
    runs = (("captured", (q, k, v), float(data["scale"][i])),
            ("calibrated", (gq, gk, gv), workload.FIT_HEAD_DIM ** -0.5))
    for name, (a, b, c), scale in (r for r in runs if r[0] in args.workloads):
        a, b, c = (t.to(device=args.device, dtype=torch.float16 if dtype == torch.float32 else dtype).to(dtype)
                   for t in (a, b, c))
        oracle[name] = oracle_density(a, b, workload.ORACLE_SHARES, scale=scale).mean((0, 1)).tolist()
        log(f"layer {layer} {name}: oracle density at {workload.ORACLE_SHARES}: {oracle[name]}")
        for method in methods:  # one method at a time, so that a partial run is on disk
            points += workload.method_curves(a, b, c, [method], scale=scale, workload=name,
                                             backend=args.backend, log=log)
            item = {"layer": layer, "kv_heads": kv_heads, "query_heads": qh, "seqlen": n, "oracle": oracle,
                    "gaps": workload.curve_gaps(points), "points": [asdict(p) for p in points]}
            _write(args, argv, start, [*results, item])
    print(format_acceptance(item), flush=True)
    return item


def _write(args: argparse.Namespace, argv: list[str] | None, start: float, results: list[dict[str, Any]],
           summary: dict[str, Any] | None = None) -> None:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    args.json.write_text(json.dumps({"command": "python benches/calibration_acceptance.py "
                                     + " ".join(argv or sys.argv[1:]), "backend": args.backend, "device": device,
                                     "seconds": time.perf_counter() - start, "summary": summary,
                                     "layers": results}, indent=1))


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method over every item (layer, heads): the largest and median gap at equal
    density, how many items are within `TOLERANCE`; per item the oracle densities' relative
    error at 0.9 and 0.95."""
    per: dict[str, list[float]] = {}
    kinds: dict[str, str] = {}
    for item in results:
        for name, g in item["gaps"].items():
            key = "recall" if "recall_gap_at_equal_density_max" in g else "error"
            kinds[name] = key
            x = g[f"{key}_gap_at_equal_density_max"]
            if x is not None:
                per.setdefault(name, []).append(float(x))
    methods = {name: {"measure": kinds[name], "items": len(v), "max": max(v), "median": sorted(v)[len(v) // 2],
                      "within": sum(x <= TOLERANCE for x in v)} for name, v in per.items()}
    oracle = []
    for item in results:
        o = item["oracle"]
        if "captured" in o and "calibrated" in o:
            oracle.append({"layer": item["layer"], "query_heads": item["query_heads"],
                           "captured": o["captured"], "calibrated": o["calibrated"],
                           "relative_error": [b / a - 1 for a, b in zip(o["captured"], o["calibrated"])]})
    return {"tolerance": TOLERANCE, "methods": methods, "oracle": oracle}


def format_summary(results: list[dict[str, Any]]) -> str:
    """Markdown: per method the gap over every item; the oracle errors."""
    s = summarize(results)
    lines = [f"{len(results)} items (layer, query heads); recall gap at equal density, criterion {TOLERANCE}:", "",
             "| method | items within | max gap | median gap |", "| --- | --- | --- | --- |"]
    for name, m in s["methods"].items():
        label = name if m["measure"] == "recall" else f"{name} (output error)"
        lines.append(f"| {label} | {m['within']}/{m['items']} | {m['max']:.3f} | {m['median']:.3f} |")
    errs = [abs(e) for o in s["oracle"] for e in o["relative_error"]]
    if errs:
        e9 = [abs(o["relative_error"][0]) for o in s["oracle"]]
        e95 = [abs(o["relative_error"][1]) for o in s["oracle"]]
        lines += ["", f"oracle density relative error: at 0.9 max {max(e9):.0%} (median {sorted(e9)[len(e9) // 2]:.0%}), "
                      f"at 0.95 max {max(e95):.0%} (median {sorted(e95)[len(e95) // 2]:.0%}); within 20%: "
                      f"{sum(e <= 0.2 for e in e9)}/{len(e9)} and {sum(e <= 0.2 for e in e95)}/{len(e95)}"]
    return "\n".join(lines)


def format_acceptance(item: dict[str, object]) -> str:
    """Markdown: per method the largest recall gap at equal density and at the same knob."""
    oracle = item["oracle"]
    assert isinstance(oracle, dict) and isinstance(item["gaps"], dict)
    cap = oracle.get("captured", [math.nan, math.nan])
    cal = oracle.get("calibrated", [math.nan, math.nan])
    lines = [f"layer {item['layer']}, KV heads {item['kv_heads']}, N = {item['seqlen']}: oracle density at 0.9 "
             f"{cap[0]:.4f} captured / {cal[0]:.4f} calibrated ({cal[0] / cap[0] - 1:+.0%}), at 0.95 "
             f"{cap[1]:.4f} / {cal[1]:.4f} ({cal[1] / cap[1] - 1:+.0%})", "",
             "| method | max recall gap at equal density (points in overlap) | max gap at the same knob | "
             "density calibrated / captured at the same knob |", "| --- | --- | --- | --- |"]
    for name, g in item["gaps"].items():
        key = "recall" if "recall_gap_at_equal_density_max" in g else "error"
        eq = g[f"{key}_gap_at_equal_density_max"]
        same = g[f"{key}_gap_same_knob_max"]
        ratios = ", ".join(f"{r:.2f}" for r in g["density_ratio_same_knob"])
        lines.append(f"| {name}{'' if key == 'recall' else ' (output error)'} | "
                     f"{'-' if eq is None else f'{eq:.3f}'} ({g['points_in_overlap']}/{g['points']}) | "
                     f"{'-' if same is None else f'{same:.3f}'} | {ratios} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
