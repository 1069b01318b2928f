"""SharePrefill on SmolLM2-135M-Instruct at 8K: every layer as one prefill, on the CPU.

Input: q, k, v of all 30 layers of one 8K prefill (`sparseprefill eval capture --layers
0 1 ... 29`, captured under dense attention) and a cluster layout (`sparseprefill
cluster`). The stack runs through `reference.shareprefill_layer` in layer order for
each `--deltas` value (0.3 is the paper's default; 1.01 its "w/o exclusion"
ablation, where no head counts as highly sparse), which gives the per-layer
distribution of dense / shared / vertical-slash heads. On the `--report-layers`:
density, attention recall (per head mean over rows; mean and min over heads) and
output error (relative to exact attention) of

* SharePrefill (each delta), with the plan it used in the stack;
* the FlexPrefill-style vertical-slash alone (`flexprefill_vs`) at gamma 0.9, and at the
  gamma whose density matches SharePrefill's (delta 0.3) on that layer;
* MInference vertical-slash (`vertical_slash`, slash budget 4x the vertical one) at
  the budget whose density matches;

each with the oracle's density at its mean recall (the fewest keys per row holding
that share of the mass: `sparseprefill.oracle`).

Usage (reference backend, float64 math; about 40 minutes on 2 CPU cores):
    python benches/shareprefill_smollm2.py --qkv qkv_smollm2_8k_all.pt --layout clusters.json \\
        --json benches/results/cpu-smollm2-shareprefill-2026-11-23.json --png docs/img/shareprefill-smollm2.png
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from sparseprefill import reference
from sparseprefill.oracle import oracle_density
from sparseprefill.reference import BlockColumnPlan, ClusterLayout, SharePrefillState

FRONTIER = (0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 0.995)


def plan_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockColumnPlan, scale: float,
               exact: torch.Tensor) -> dict[str, float]:
    """Density, recall (mean / min over heads of the per-head mean over rows) and output error."""
    per_head = reference.recall(q, k, plan, scale=scale).double().mean(dim=2)
    out = reference.sparse_attention(q, k, v, plan, scale=scale)
    return {"density": float(reference.density(plan).mean()), "recall_mean": float(per_head.mean()),
            "recall_min": float(per_head.min()), "output_error": reference.relative_error(out, exact)}


def match(make: Callable[[float], BlockColumnPlan], lo: float, hi: float, target: float, *,
          integer: bool, steps: int = 14) -> tuple[float, BlockColumnPlan]:
    """Bisection on a parameter whose plan density grows with it: the value closest to `target`."""
    best: tuple[float, float, BlockColumnPlan] | None = None
    for _ in range(steps):
        mid = (lo + hi) / 2
        value = float(round(mid)) if integer else mid
        plan = make(value)
        dens = float(reference.density(plan).mean())
        if best is None or abs(dens - target) < best[0]:
            best = (abs(dens - target), value, plan)
        if dens < target:
            lo = mid
        else:
            hi = mid
        if integer and hi - lo < 1:
            break
    assert best is not None
    return best[1], best[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qkv", required=True, help="capture of every layer (sparseprefill eval capture)")
    parser.add_argument("--layout", required=True, help="cluster layout JSON (sparseprefill cluster)")
    parser.add_argument("--report-layers", type=int, nargs="+", default=[2, 14, 27])
    parser.add_argument("--deltas", type=float, nargs="+", default=[0.3, 1.01])
    parser.add_argument("--max-seqlen", type=int, default=None, help="use only the first tokens")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args()
    data = torch.load(args.qkv, map_location="cpu")
    layout = ClusterLayout.load(args.layout)
    cut = args.max_seqlen
    layers = [int(x) for x in data["layers"]]
    qkv = {l: tuple(t[:, :, :cut].float() for t in (data["q"][i], data["k"][i], data["v"][i]))
           for i, l in enumerate(layers)}
    scales = {l: float(data["scale"][i]) for i, l in enumerate(layers)}
    n = int(qkv[layers[0]][0].shape[2])
    result: dict[str, Any] = {"seqlen": n, "layers": layers, "layout": args.layout,
                              "layout_sizes": {str(c): s for c, s in layout.sizes().items()},
                              "distribution": {}, "rows": [], "frontier": {}}
    plans: dict[tuple[float, int], BlockColumnPlan] = {}
    for delta in args.deltas:
        state = SharePrefillState(layout, delta=delta)
        t0 = time.perf_counter()
        for l in layers:
            q, k, v = qkv[l]
            if l in args.report_layers:
                plans[(delta, l)], _ = reference.shareprefill_layer_plan(q, k, state.clone(), layer=l,
                                                                         scale=scales[l])
            reference.shareprefill_layer(q, k, v, state, layer=l, scale=scales[l])
            print(f"delta {delta} layer {l}: {state.decisions[-1].counts()} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        result["distribution"][str(delta)] = {
            "per_layer": state.pattern_counts(),
            "pivots": [{"cluster": c, "layer": p.layer, "head": p.head, "blocks": int(p.mask.sum())}
                       for (c, _), p in sorted(state.pivots.items())],
            "d_sparse": [[round(float(x), 4) for x in d.d_sparse[0]] for d in state.decisions],
        }
    base_delta = args.deltas[0]
    for l in args.report_layers:
        q, k, v = qkv[l]
        scale = scales[l]
        exact = reference.attention(q.double(), k.double(), v.double(), scale=scale)
        rows: list[dict[str, Any]] = []

        def add(method: str, params: dict[str, Any], plan: BlockColumnPlan) -> None:
            stats = plan_stats(q, k, v, plan, scale, exact)
            rows.append({"method": method, "layer": l, "seqlen": n, "params": params, **stats})
            print(f"layer {l}: {method} {params} {stats}", flush=True)

        for delta in args.deltas:
            add("shareprefill", {"tau": 0.2, "delta": delta, "gamma": 0.9}, plans[(delta, l)])
        target = rows[0]["density"]
        add("flexprefill_vs", {"gamma": 0.9},
            reference.flexprefill_vs_plan(q, k, gamma=0.9, scale=scale))
        gamma, plan = match(lambda g: reference.flexprefill_vs_plan(q, k, gamma=g, scale=scale),
                            0.0, 1.0, target, integer=False)
        add("flexprefill_vs", {"gamma": round(gamma, 5), "matched_to": f"shareprefill delta {base_delta}"},
            plan)
        size, plan = match(lambda x: reference.vertical_slash_plan(q, k, vertical_size=int(x),
                                                                   slash_size=4 * int(x), scale=scale),
                           1.0, float(n), target, integer=True)
        add("vertical_slash", {"vertical_size": int(size), "slash_size": 4 * int(size),
                               "matched_to": f"shareprefill delta {base_delta}"}, plan)
        shares = sorted({*FRONTIER, *(round(r["recall_mean"], 6) for r in rows)})
        oracle = oracle_density(q, k, shares, scale=scale).mean(dim=(0, 1))
        frontier = {s: float(d) for s, d in zip(shares, oracle.tolist())}
        for r in rows:
            r["oracle_density_at_recall"] = frontier[round(r["recall_mean"], 6)]
        result["frontier"][str(l)] = {str(s): d for s, d in frontier.items() if s in FRONTIER}
        result["rows"] += rows
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.png is not None:
        picture(result, args.png)
    print("| method | layer | params | density | recall mean | recall min | output error | oracle density at recall |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in result["rows"]:
        params = ", ".join(f"{key}={val}" for key, val in r["params"].items() if key != "matched_to")
        print(f"| {r['method']} | {r['layer']} | {params} | {r['density']:.4f} | {r['recall_mean']:.4f} | "
              f"{r['recall_min']:.4f} | {r['output_error']:.4f} | {r['oracle_density_at_recall']:.4f} |")


def picture(result: dict[str, Any], path: Path) -> None:
    """Per-layer pattern distribution (one panel per delta) and recall vs density per report layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    deltas = list(result["distribution"])
    report = sorted({r["layer"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(deltas) + len(report), figsize=(4.2 * (len(deltas) + len(report)), 3.6))
    for ax, delta in zip(axes, deltas):
        per = result["distribution"][delta]["per_layer"]
        x = [p["layer"] for p in per]
        bottom = [0] * len(per)
        for kind, colour in (("dense", "C3"), ("shared", "C2"), ("vertical_slash", "C0")):
            vals = [p[kind] for p in per]
            ax.bar(x, vals, bottom=bottom, color=colour, label=kind.replace("_", "-"))
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_title(f"SmolLM2 8K, delta={delta}: heads per pattern")
        ax.set_xlabel("layer")
        ax.set_ylabel("query heads")
        ax.legend(fontsize=7)
    markers = {"shareprefill": "o", "flexprefill_vs": "s", "vertical_slash": "^"}
    for ax, layer in zip(axes[len(deltas):], report):
        frontier = result["frontier"][str(layer)]
        ax.plot([float(d) for d in frontier.values()], [float(s) for s in frontier], "k--", lw=1,
                label="oracle (per row)")
        for r in (r for r in result["rows"] if r["layer"] == layer):
            tag = ", ".join(f"{k}={v}" for k, v in r["params"].items() if k in ("delta", "gamma", "vertical_size"))
            ax.plot(r["density"], r["recall_mean"], markers[r["method"]], label=f"{r['method']} {tag}")
        ax.set_xlabel("density (share of causal pairs)")
        ax.set_ylabel("mean recall")
        ax.set_title(f"layer {layer}")
        ax.legend(fontsize=6)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
