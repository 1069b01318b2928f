"""AnchorAttention on captured SmolLM2-135M layers: recall and density over theta x step,
vertical-slash at matched density, and the oracle's density at the same recall.

For every captured layer, every `theta` in `--thetas` and `step` in `--steps`, the
reference plan (float64, built step by step with the reference's own functions: the
same plan as `reference.anchor_attention_plan`, checked for the paper default) gives
density and recall (per head: the mean over rows of the full-softmax mass the plan
keeps; the table reports the mean and the minimum over heads, as `sparseprefill eval
table` does). Vertical-slash (64 x 64 blocks, `vertical_size = slash_size / 6`, the
ratio of MInference's 1000 / 6096) is given the budget whose density is closest to
the anchor plan's on that layer (bisection). Beside every row: the oracle's density
at the row's mean recall (per query row, the fewest keys holding that share of the
mass; `sparseprefill.oracle`), and the ratio of the two densities.

Usage (CPU, reference backend, about 25 minutes on 2 cores):
    python benches/anchor_evidence.py --qkv /work/captures/qkv_smollm2_8k.pt \\
        --json benches/results/cpu-smollm2-anchor_attention-2026-11-23.json \\
        --png docs/img/anchor_smollm2_recall_density.png
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch

from sparseprefill import reference
from sparseprefill.oracle import oracle_density
from sparseprefill.reference.anchor_attention import (
    anchor_blocks,
    anchor_plan_from_stripes,
    anchor_scores,
    group_stripes,
    pooled_anchor,
    search_region,
    stripe_scores,
)
from sparseprefill.reference.block_sparse import mean_pooling
from sparseprefill.reference.plan import BlockColumnPlan

ORACLE_CURVE = (0.5, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999)
ROWS_PER_CHUNK = 256


def anchor_plans(q: torch.Tensor, k: torch.Tensor, *, scale: float, thetas: list[float],
                 steps: list[int], block: int) -> dict[tuple[float, int], BlockColumnPlan]:
    """Reference plans for every (theta, step); the anchors are computed once per step."""
    n = q.shape[2]
    plans = {}
    q_mean = mean_pooling(q, block)
    scores = stripe_scores(q_mean, k, scale=scale)
    for step in steps:
        blocks = anchor_blocks(n, step=step, block_m=block, block_n=block)
        x_a = anchor_scores(q, k, blocks, block_n=block, block_m=block, scale=scale)
        diff = pooled_anchor(x_a, block).unsqueeze(-1) - scores
        region = search_region(n, step=step, block_m=block, block_n=block)
        for theta in thetas:
            stripes = group_stripes(diff <= theta, region, step=step)
            plans[(theta, step)] = anchor_plan_from_stripes(stripes, seqlen=n, step=step,
                                                            block_m=block, block_n=block)
    return plans


def matched_vertical_slash(q: torch.Tensor, k: torch.Tensor, target: float, *, scale: float,
                           cache: dict[int, tuple[float, BlockColumnPlan]]) -> tuple[int, float, BlockColumnPlan]:
    """The vertical-slash budget (slash_size s, vertical_size s // 6) of density nearest `target`."""
    n = q.shape[2]

    def plan_at(s: int) -> tuple[float, BlockColumnPlan]:
        if s not in cache:
            plan = reference.vertical_slash_plan(q, k, vertical_size=max(1, s // 6), slash_size=s,
                                                 block_m=64, block_n=64, scale=scale)
            cache[s] = (float(reference.density(plan).mean()), plan)
        return cache[s]

    lo, hi = 1, n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if plan_at(mid)[0] < target:
            lo = mid
        else:
            hi = mid
        if abs(plan_at(mid)[0] - target) < 1e-3:
            lo = hi = mid
            break
    best = min({lo, hi}, key=lambda s: abs(plan_at(s)[0] - target))
    return best, plan_at(best)[0], plan_at(best)[1]


def per_head_recall(q: torch.Tensor, k: torch.Tensor, plans: list[BlockColumnPlan], *,
                    scale: float) -> list[torch.Tensor]:
    """Per-row recall of every plan, float64 `[Hq, N]` each, from one pass over the softmax.

    The same quantity as `reference.recall` (checked by the caller on one plan), with the
    full-softmax probabilities computed once per chunk of rows for all plans.
    """
    _, hq, n, d = q.shape
    g = hq // k.shape[1]
    qh = q[0].to(torch.float64)
    kh = k[0].to(torch.float64).repeat_interleave(g, dim=0)
    masks = [(p.block_mask()[0], p.column_mask()[0], p.block_m, p.block_n) for p in plans]
    out = [torch.empty(hq, n, dtype=torch.float64) for _ in plans]
    for r0 in range(0, n, ROWS_PER_CHUNK):
        r1 = min(n, r0 + ROWS_PER_CHUNK)
        rows = torch.arange(r0, r1)
        causal = torch.arange(r1)[None, :] <= rows[:, None]
        s = torch.matmul(qh[:, r0:r1], kh[:, :r1].transpose(-1, -2)) * scale
        probs = torch.softmax(s.masked_fill(~causal, -math.inf), dim=-1)
        for (blocks, columns, bm, bn), dest in zip(masks, out):
            qb = rows // bm
            keep = blocks[:, qb][:, :, torch.arange(r1) // bn] | columns[:, qb, :r1]
            dest[:, r0:r1] = (probs * (keep & causal)).sum(dim=-1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qkv", default="/work/captures/qkv_smollm2_8k.pt")
    parser.add_argument("--thetas", default="6,9,12,15")
    parser.add_argument("--steps", default="1,4,16")
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--layers", default=None, help="comma-separated subset of the captured layers")
    parser.add_argument("--max-seqlen", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    data = torch.load(args.qkv, map_location="cpu")
    thetas = [float(t) for t in args.thetas.split(",")]
    steps = [int(s) for s in args.steps.split(",")]
    wanted = None if args.layers is None else {int(x) for x in args.layers.split(",")}
    rows: list[dict[str, Any]] = []
    curves: dict[int, list[float]] = {}
    started = time.perf_counter()
    for i, layer in enumerate(data["layers"]):
        if wanted is not None and int(layer) not in wanted:
            continue
        q, k = data["q"][i], data["k"][i]
        if args.max_seqlen is not None:
            q, k = q[:, :, : args.max_seqlen], k[:, :, : args.max_seqlen]
        scale = float(data["scale"][i])
        n = q.shape[2]
        plans = anchor_plans(q, k, scale=scale, thetas=thetas, steps=steps, block=args.block)
        default = (12.0, 16)
        if default in plans:
            assert plans[default].equal(reference.anchor_attention_plan(q, k, scale=scale,
                                                                        block_m=args.block,
                                                                        block_n=args.block))
        cache: dict[int, tuple[float, BlockColumnPlan]] = {}
        entries: list[dict[str, Any]] = []
        for (theta, step), plan in plans.items():
            dens = reference.density(plan)[0]
            entries.append({"layer": int(layer), "method": "anchor_attention",
                            "params": {"theta": theta, "step": step, "block_m": args.block,
                                       "block_n": args.block},
                            "density": float(dens.mean()), "plan": plan,
                            "stripe_width": int(plan.column_index.shape[-1])})
            s, vs_dens, vs_plan = matched_vertical_slash(q, k, float(dens.mean()), scale=scale, cache=cache)
            entries.append({"layer": int(layer), "method": "vertical_slash",
                            "params": {"vertical_size": max(1, s // 6), "slash_size": s, "block_m": 64,
                                       "block_n": 64, "matched_to": {"theta": theta, "step": step}},
                            "density": vs_dens, "plan": vs_plan})
            print(f"layer {layer} theta {theta} step {step}: density {float(dens.mean()):.4f}, "
                  f"vertical_slash s={s} density {vs_dens:.4f} [{time.perf_counter() - started:.0f} s]",
                  flush=True)
        recalls = per_head_recall(q, k, [e["plan"] for e in entries], scale=scale)
        check = reference.recall(q, k, entries[0]["plan"], scale=scale)[0].double()
        assert float((check - recalls[0]).abs().max()) < 1e-6, "recall evaluator != reference.recall"
        for e, rec in zip(entries, recalls):
            per_head = rec.mean(dim=1)
            e.update(recall_mean=float(per_head.mean()), recall_min=float(per_head.min()),
                     recall_worst_row=float(rec.min()))
        shares = [e["recall_mean"] for e in entries] + list(ORACLE_CURVE)
        oracle = oracle_density(q, k, shares, scale=scale)[0].mean(dim=0)
        for e, o in zip(entries, oracle[: len(entries)]):
            e["oracle_density"] = float(o)
            e["over_oracle"] = e["density"] / float(o) if float(o) > 0 else math.inf
            del e["plan"]
            rows.append(e)
            print(f"  layer {layer} {e['method']} {e['params']}: density {e['density']:.4f} recall "
                  f"{e['recall_mean']:.4f}/{e['recall_min']:.4f} oracle {e['oracle_density']:.4f} "
                  f"({e['over_oracle']:.2f}x)", flush=True)
        curves[int(layer)] = [float(o) for o in oracle[len(entries):]]
        print(f"layer {layer} done at {time.perf_counter() - started:.0f} s (N = {n})", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"capture": args.qkv, "command": "python benches/anchor_evidence.py "
                       + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                  if v is not None),
                       "oracle_curve_shares": list(ORACLE_CURVE), "oracle_curves": curves,
                       "rows": rows}, fh, indent=1)
    if args.png:
        plot(rows, curves, args.png)


def plot(rows: list[dict[str, Any]], curves: dict[int, list[float]], path: str) -> None:
    """Recall vs density per layer: anchor configs, matched vertical-slash, the oracle curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(curves)
    fig, axes = plt.subplots(1, len(layers), figsize=(5 * len(layers), 4.2), squeeze=False)
    markers = {1: "o", 4: "s", 16: "^"}
    for ax, layer in zip(axes[0], layers):
        ax.plot(curves[layer], ORACLE_CURVE, "k-", lw=1, label="oracle (per row)")
        for r in rows:
            if r["layer"] != layer:
                continue
            if r["method"] == "anchor_attention":
                p = r["params"]
                ax.scatter(r["density"], r["recall_mean"], marker=markers.get(p["step"], "o"),
                           c=[[p["theta"] / 16, 0.2, 1 - p["theta"] / 16]], s=36,
                           label=f"anchor step {p['step']}" if p["theta"] == 12.0 else None)
                ax.annotate(f"{p['theta']:g}", (r["density"], r["recall_mean"]), fontsize=6,
                            xytext=(3, -6), textcoords="offset points")
            else:
                ax.scatter(r["density"], r["recall_mean"], marker="x", c="gray", s=24,
                           label="vertical_slash (matched)" if r["params"]["matched_to"] ==
                           {"theta": 12.0, "step": 16} else None)
        ax.set_title(f"SmolLM2-135M layer {layer}, N = 8192")
        ax.set_xlabel("density (kept share of the causal area)")
        ax.set_ylabel("recall (mean over heads)")
        ax.set_xlim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("AnchorAttention (labels: theta; marker: step) vs vertical-slash at matched density")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
