"""SharePrefill on SmolLM2-135M-Instruct at 8K: all 30 layers as one prefill, on the CPU.

Input: q, k, v of every layer of one 8K prefill (`sparseprefill eval capture --seqlen 8192
--layers 0 1 ... 29`, captured under dense attention) and a cluster layout (`sparseprefill
cluster`). A layer-sharing method needs the whole stack: pivots built in early layers
serve later ones, so a capture of a few layers (2, 14, 27) would leave every layer
without the pivots the model's earlier layers would have built.

For each `--deltas` value (0.3 is the paper's default; 1.01 its "w/o exclusion"
ablation, where no head counts as highly sparse) the stack is decided layer by layer
in model order: per layer `reference.shareprefill_layer_plan` (Alg. 3-5), then Alg. 2
for the dense heads from their block means (a one-head dense `sparse_attention` with
`block_mean_out`: the block means of a dense head do not depend on the other heads'
plans), recorded into the `SharePrefillState`. That is `shareprefill_layer` without
the outputs of the sparse heads, which only the report layers need; the first layer
with a dense head is also run through `shareprefill_layer` and the two states' pivots
compared (`--no-check` skips it). This gives the per-layer distribution of dense /
shared / vertical-slash heads and every head's `d_sparse`.

On the `--report-layers`: density, attention recall (per head mean over rows; mean
and min over heads, and per pattern) and output error (relative to exact attention) of

* SharePrefill (each delta), with the plan it used in the stack;
* the FlexPrefill-style vertical-slash alone (`flexprefill_vs`) at gamma 0.9, and at the
  gamma whose density matches SharePrefill's (each delta whose plan differs from it);
* MInference vertical-slash (`vertical_slash`, slash budget 4x the vertical one) at
  the budget whose density matches;

each with the oracle's density at its mean recall (the fewest keys per row holding
that share of the mass: `sparseprefill.oracle`).

Usage (reference backend, float64 math; about 40 minutes on 2 shared CPU cores):
    python benches/shareprefill_smollm2.py --qkv qkv_smollm2_8k_all.pt \\
        --layout benches/results/cpu-smollm2-clusters-2026-11-23.json \\
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
from sparseprefill.reference import BlockColumnPlan, ClusterLayout, SharePattern, SharePrefillState
from sparseprefill.reference.shareprefill import build_pivots

FRONTIER = (0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 0.995)


def advance(state: SharePrefillState, q: torch.Tensor, k: torch.Tensor, layer: int,
            scale: float) -> tuple[BlockColumnPlan, Any]:
    """One layer of the prefill without the sparse heads' outputs: decide, plan, build the
    dense heads' pivots, record. Returns the plan and decision."""
    plan, decision = reference.shareprefill_layer_plan(q, k, state, layer=layer, scale=scale)
    b, hq, n, _ = q.shape
    g = hq // k.shape[1]
    block_means = torch.full((b, hq, plan.num_query_blocks, plan.num_key_blocks), float("nan"))
    for row, h in (decision.pattern == SharePattern.DENSE).nonzero().tolist():
        qh, kh = q[row:row + 1, h:h + 1], k[row:row + 1, h // g:h // g + 1]
        dense = reference.dense_plan(qh, kh, block_m=state.block_m, block_n=state.block_n)
        reference.sparse_attention(qh, kh, kh, dense, scale=scale, block_mean_out=block_means[row:row + 1, h:h + 1])
    state.record(decision, build_pivots(block_means, state, decision))
    return plan, decision


def plan_stats(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockColumnPlan, scale: float,
               exact: torch.Tensor) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
    """Density, recall (mean / min over heads of the per-head mean over rows), output error;
    and the per-head recall and density."""
    per_head = reference.recall(q, k, plan, scale=scale).double().mean(dim=2)[0]
    dens = reference.density(plan).double()[0]
    out = reference.sparse_attention(q, k, v, plan, scale=scale)
    return ({"density": float(dens.mean()), "recall_mean": float(per_head.mean()),
             "recall_min": float(per_head.min()), "output_error": reference.relative_error(out, exact)},
            per_head, dens)


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


def same_plan(a: BlockColumnPlan, b: BlockColumnPlan) -> bool:
    return bool(torch.equal(a.to_dense_mask(), b.to_dense_mask()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qkv", required=True, help="capture of every layer (sparseprefill eval capture)")
    parser.add_argument("--layout", required=True, help="cluster layout JSON (sparseprefill cluster)")
    parser.add_argument("--report-layers", type=int, nargs="+", default=[2, 14, 27])
    parser.add_argument("--deltas", type=float, nargs="+", default=[0.3, 1.01])
    parser.add_argument("--max-seqlen", type=int, default=None, help="use only the first tokens")
    parser.add_argument("--no-check", action="store_true", help="skip the shareprefill_layer check")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args()
    start = time.perf_counter()
    data = torch.load(args.qkv, map_location="cpu")
    layout = ClusterLayout.load(args.layout)
    cut = args.max_seqlen
    layers = [int(x) for x in data["layers"]]
    if layers != list(range(layout.num_layers)):
        print(f"warning: the capture has layers {layers}, the layout {layout.num_layers}: "
              "layers missing from the capture build no pivots", flush=True)
    qkv = {l: tuple(t[:, :, :cut].float() for t in (data["q"][i], data["k"][i], data["v"][i]))
           for i, l in enumerate(layers)}
    scales = {l: float(data["scale"][i]) for i, l in enumerate(layers)}
    n = int(qkv[layers[0]][0].shape[2])
    result: dict[str, Any] = {"seqlen": n, "layers": layers, "layout": args.layout,
                              "capture_meta": {k: str(v) for k, v in data.get("meta", {}).items()},
                              "layout_sizes": {str(c): s for c, s in layout.sizes().items()},
                              "distribution": {}, "rows": [], "frontier": {}, "check": None}
    plans: dict[tuple[float, int], BlockColumnPlan] = {}
    patterns: dict[tuple[float, int], torch.Tensor] = {}
    check = not args.no_check
    for delta in args.deltas:
        state = SharePrefillState(layout, delta=delta)
        t0 = time.perf_counter()
        for l in layers:
            q, k, v = qkv[l]
            before = state.clone() if check else None
            plan, decision = advance(state, q, k, l, scales[l])
            if before is not None and bool((decision.pattern == SharePattern.DENSE).any()):
                reference.shareprefill_layer(q, k, v, before, layer=l, scale=scales[l])
                same = set(before.pivots) == set(state.pivots) and all(
                    torch.equal(before.pivots[key].mask, state.pivots[key].mask)
                    and torch.allclose(before.pivots[key].a_tilde, state.pivots[key].a_tilde, rtol=0, atol=1e-12)
                    for key in state.pivots)
                result["check"] = {"delta": delta, "layer": l, "pivots_equal": same}
                print(f"check at layer {l}: pivots of shareprefill_layer and the decision pass equal: {same}",
                      flush=True)
                assert same
                check = False
            if l in args.report_layers:
                plans[(delta, l)], patterns[(delta, l)] = plan, decision.pattern[0].clone()
            print(f"delta {delta} layer {l}: {decision.counts()} ({time.perf_counter() - t0:.0f} s)", flush=True)
        d_sparse = torch.stack([d.d_sparse[0] for d in state.decisions])
        result["distribution"][str(delta)] = {
            "per_layer": state.pattern_counts(),
            "pivots": [{"cluster": c, "layer": p.layer, "head": p.head, "blocks": int(p.mask.sum()),
                        "causal_blocks": int(torch.ones(p.mask.shape).tril().sum())}
                       for (c, _), p in sorted(state.pivots.items())],
            "d_sparse": [[round(float(x), 4) for x in row] for row in d_sparse],
            "d_sparse_min": float(d_sparse.min()), "d_sparse_median": float(d_sparse.median()),
            "d_sim": [[None if x != x else round(float(x), 4) for x in d.d_sim[0]] for d in state.decisions],
            "seconds": round(time.perf_counter() - t0, 1),
        }
    for l in args.report_layers:
        q, k, v = qkv[l]
        scale = scales[l]
        exact = reference.attention(q.double(), k.double(), v.double(), scale=scale)
        rows: list[dict[str, Any]] = []

        def add(method: str, params: dict[str, Any], plan: BlockColumnPlan,
                pattern: torch.Tensor | None = None) -> dict[str, Any]:
            stats, per_head, dens = plan_stats(q, k, v, plan, scale, exact)
            row = {"method": method, "layer": l, "seqlen": n, "params": params, **stats,
                   "recall_per_head": [round(float(x), 5) for x in per_head],
                   "density_per_head": [round(float(x), 5) for x in dens]}
            if pattern is not None:
                row["pattern_per_head"] = [SharePattern(int(p)).name.lower() for p in pattern]
            rows.append(row)
            print(f"layer {l}: {method} {params} {stats} ({time.perf_counter() - start:.0f} s)", flush=True)
            return row

        flex = reference.flexprefill_vs_plan(q, k, gamma=0.9, scale=scale)
        share_rows = []
        for delta in args.deltas:
            share_rows.append(add("shareprefill", {"tau": 0.2, "delta": delta, "gamma": 0.9},
                                  plans[(delta, l)], patterns[(delta, l)]))
            share_rows[-1]["same_plan_as_flexprefill_vs_0.9"] = same_plan(plans[(delta, l)], flex)
        add("flexprefill_vs", {"gamma": 0.9}, flex)
        for delta, srow in zip(args.deltas, share_rows):
            if srow["same_plan_as_flexprefill_vs_0.9"]:
                continue
            target = srow["density"]
            gamma, plan = match(lambda g: reference.flexprefill_vs_plan(q, k, gamma=g, scale=scale),
                                0.0, 1.0, target, integer=False)
            add("flexprefill_vs", {"gamma": round(gamma, 5), "matched_to": f"shareprefill delta {delta}"}, plan)
            size, plan = match(lambda x: reference.vertical_slash_plan(q, k, vertical_size=int(x),
                                                                       slash_size=4 * int(x), scale=scale),
                               1.0, float(n), target, integer=True)
            add("vertical_slash", {"vertical_size": int(size), "slash_size": 4 * int(size),
                                   "matched_to": f"shareprefill delta {delta}"}, plan)
        if all(r["same_plan_as_flexprefill_vs_0.9"] for r in share_rows):
            size, plan = match(lambda x: reference.vertical_slash_plan(q, k, vertical_size=int(x),
                                                                       slash_size=4 * int(x), scale=scale),
                               1.0, float(n), share_rows[0]["density"], integer=True)
            add("vertical_slash", {"vertical_size": int(size), "slash_size": 4 * int(size),
                                   "matched_to": f"shareprefill delta {args.deltas[0]}"}, plan)
        shares = sorted({*FRONTIER, *(round(r["recall_mean"], 6) for r in rows)})
        oracle = oracle_density(q, k, shares, scale=scale).mean(dim=(0, 1))
        frontier = {s: float(d) for s, d in zip(shares, oracle.tolist())}
        for r in rows:
            r["oracle_density_at_recall"] = frontier[round(r["recall_mean"], 6)]
        result["frontier"][str(l)] = {str(s): d for s, d in frontier.items() if s in FRONTIER}
        result["rows"] += rows
    result["seconds"] = round(time.perf_counter() - start, 1)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.png is not None:
        picture(result, args.png)
    print(table(result))


def by_pattern(result: dict[str, Any]) -> list[str]:
    """Per report layer and delta: mean recall / density of each pattern's heads, beside the
    same heads under flexprefill_vs at gamma 0.9."""
    lines = ["| layer | delta | pattern | heads | recall (shareprefill) | density | recall (flexprefill_vs 0.9) "
             "| density |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        if r["method"] != "shareprefill":
            continue
        flex = next(x for x in result["rows"] if x["layer"] == r["layer"] and x["method"] == "flexprefill_vs"
                    and "matched_to" not in x["params"])
        for name in ("dense", "shared", "vertical_slash"):
            heads = [h for h, p in enumerate(r["pattern_per_head"]) if p == name]
            if not heads:
                continue

            def mean(xs: list[float]) -> float:
                return sum(xs[h] for h in heads) / len(heads)

            lines.append(f"| {r['layer']} | {r['params']['delta']} | {name} | {len(heads)} | "
                         f"{mean(r['recall_per_head']):.4f} | {mean(r['density_per_head']):.4f} | "
                         f"{mean(flex['recall_per_head']):.4f} | {mean(flex['density_per_head']):.4f} |")
    return lines


def table(result: dict[str, Any]) -> str:
    lines = ["| method | layer | params | density | recall mean | recall min | output error | "
             "oracle density at recall |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        params = ", ".join(f"{key}={val}" for key, val in r["params"].items())
        lines.append(f"| {r['method']} | {r['layer']} | {params} | {r['density']:.4f} | {r['recall_mean']:.4f} | "
                     f"{r['recall_min']:.4f} | {r['output_error']:.4f} | {r['oracle_density_at_recall']:.4f} |")
    return "\n".join(lines + [""] + by_pattern(result))


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
        ax.set_title(f"SmolLM2 8K, delta={delta}: heads per pattern", fontsize=9)
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
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.legend(fontsize=6)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
