"""SampleAttention on captured SmolLM2 layers: recall and density per (alpha, chunk_n),
vertical-slash at matched density, and the oracle's density at the same recall.

For each captured layer (SmolLM2-135M, N = 8192, 9 query / 3 KV heads, D = 64) and
each `alpha_c = alpha_s = alpha` in {0.8, 0.9, 0.95, 0.98} and `chunk_n` in {1, 2, 4}
(block 128; block 64 too, to see the cost of granularity), the reference plan's
density and attention recall (per head, the mean over rows; reported as the mean
and the minimum over heads), then:

* vertical-slash (reference, MInference defaults: last_q 64, 64 x 64 blocks, 30
  forced columns, 100 forced diagonals) with `slash_size = 4 * vertical_size` (the
  demo's ratio) and `vertical_size` bisected to the density closest to
  SampleAttention's on that layer;
* the oracle (`sparseprefill.oracle.oracle_density`): per query row the fewest keys
  holding a share of the mass, at share = SampleAttention's mean recall;
* the best plan of the same block size (`block_oracle_density`): per query block the
  fewest cells holding that share of the block's rows' mass.

Recall and density of a plan are computed exactly from one float64 pass of full
attention per layer: the mass of every (64-row group, key) pair, summed over the
group's rows; a plan whose query blocks are multiples of 64 rows keeps whole such
pairs. The script checks this against `reference.recall` / `reference.density`
for one plan per layer (the `check` entries of the JSON).

Usage (CPU, about 40 minutes on 2 cores):
    python benches/sample_attention_smollm2.py --qkv /work/captures/qkv_smollm2_8k.pt \\
        --json benches/results/cpu-smollm2-sample_attention-2026-11-23.json \\
        --png docs/img/sample_attention_smollm2.png
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from sparseprefill import reference
from sparseprefill.oracle import oracle_density
from sparseprefill.reference.plan import BlockColumnPlan, cdiv
from sparseprefill.reference.sample_attention import sample_attention_selection

GROUP = 64
ALPHAS = (0.8, 0.9, 0.95, 0.98)
CHUNKS = (1, 2, 4)
BLOCK = 128
# Also at 64-token blocks: how much of the distance to the per-row oracle is block granularity.
BLOCKS = (128, 64)
SLASH_RATIO = 4
# Shares for the oracle's frontier curve in the figure.
CURVE = (0.5, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 0.995)


def group_mass(q: torch.Tensor, k: torch.Tensor, scale: float | None, rows_per: int = 512) -> torch.Tensor:
    """float64 `[Hq, N / 64, N]`: full causal attention mass of each (64-row group, key), B = 1."""
    _, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    sm = scale if scale is not None else 1 / math.sqrt(d)
    out = torch.zeros(hq, cdiv(n, GROUP), n, dtype=torch.float64)
    kk = k[0].double().unsqueeze(1)  # [Hkv, 1, N, D]
    for start in range(0, n, rows_per):
        stop = min(n, start + rows_per)
        rows = torch.arange(start, stop)
        qs = q[0, :, start:stop].double().reshape(hkv, g, stop - start, d)
        s = torch.matmul(qs, kk.transpose(-1, -2)) * sm
        s = s.masked_fill(torch.arange(n)[None, :] > rows[:, None], -math.inf)
        p = torch.softmax(s, dim=-1).reshape(hq, stop - start, n)
        out.index_add_(1, rows // GROUP, p)
    return out


def group_pairs(n: int) -> torch.Tensor:
    """int64 `[N / 64, N]`: causal rows of each 64-row group that see each key."""
    r0 = torch.arange(cdiv(n, GROUP))[:, None] * GROUP
    r1 = (r0 + GROUP).clamp(max=n)
    return (r1 - torch.arange(n)[None, :]).clamp(min=0).clamp(max=r1 - r0)


def kept_pairs(plan: BlockColumnPlan) -> torch.Tensor:
    """bool `[Hq, N / 64, N]`: the keys every 64-row group keeps (B = 1)."""
    if plan.block_m % GROUP:
        raise ValueError(f"plan.block_m must be a multiple of {GROUP}, got {plan.block_m}")
    n = plan.seqlen
    keys = plan.block_mask()[0].repeat_interleave(plan.block_n, dim=2)[..., :n]
    count, index = plan.own_columns()
    width = index.shape[3]
    cols = torch.zeros(*keys.shape[:2], n + 1, dtype=torch.bool)
    valid = torch.arange(width) < count[0].unsqueeze(-1)
    cols.scatter_(2, torch.where(valid, index[0].long(), n), True)
    keys = keys | cols[..., :n]
    per_group = torch.arange(cdiv(n, GROUP)) * GROUP // plan.block_m
    return keys[:, per_group]


def measure(plan: BlockColumnPlan, mass: torch.Tensor, pairs: torch.Tensor) -> dict[str, Any]:
    """Density and per-head recall of `plan`, exactly, from the layer's group masses."""
    n = plan.seqlen
    keep = kept_pairs(plan)
    recall = (keep * mass).sum(dim=(-1, -2)) / n
    density = float((keep * pairs).sum()) / (keep.shape[0] * n * (n + 1) / 2)
    return {"density": density, "recall_mean": float(recall.mean()), "recall_min": float(recall.min()),
            "recall_per_head": [round(float(x), 6) for x in recall]}


def block_oracle_density(mass: torch.Tensor, n: int, shares: list[float], block: int = BLOCK) -> list[float]:
    """Density of the best block plan at each share, averaged over heads.

    Per query block of `block` rows, the fewest `block x block` cells (by full attention
    mass, descending) whose mass reaches `share` of the block's rows: any block-granular
    method at that block size (recall averaged over a block's rows) needs at least this.
    """
    hq, groups, _ = mass.shape
    per = block // GROUP
    nb = cdiv(n, block)
    padded = torch.zeros(hq, nb * per, nb * block, dtype=torch.float64)
    padded[:, :groups, :n] = mass
    cells = padded.reshape(hq, nb, per, nb, block).sum(dim=(2, 4))  # [Hq, Qb, Kb]
    pairs = torch.zeros(nb * per, nb * block, dtype=torch.float64)
    pairs[:groups, :n] = group_pairs(n).double()
    cell_pairs = pairs.reshape(nb, per, nb, block).sum(dim=(1, 3))
    rows = (torch.arange(nb) * block + block).clamp(max=n) - torch.arange(nb) * block
    order = torch.sort(cells, dim=-1, descending=True)
    cum = order.values.cumsum(dim=-1)
    sorted_pairs = cell_pairs.expand(hq, nb, nb).gather(-1, order.indices)
    out = []
    for s in shares:
        need = (cum < s * rows[None, :, None] - 1e-12).sum(dim=-1, keepdim=True) + 1  # cells to keep
        keep = torch.arange(nb)[None, None, :] < need.clamp(max=nb)
        out.append(float((sorted_pairs * keep).sum()) / (hq * n * (n + 1) / 2))
    return out


def vs_plan(q: torch.Tensor, k: torch.Tensor, vertical: int, scale: float | None) -> BlockColumnPlan:
    return reference.vertical_slash_plan(q, k, vertical_size=vertical, slash_size=SLASH_RATIO * vertical,
                                         scale=scale)


def matched_vertical_slash(q: torch.Tensor, k: torch.Tensor, target: float, scale: float | None,
                           mass: torch.Tensor, pairs: torch.Tensor,
                           cache: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Vertical-slash with the density closest to `target` (bisection on vertical_size)."""
    n = q.shape[2]

    def at(v: int) -> dict[str, Any]:
        if v not in cache:
            cache[v] = {"vertical_size": v, "slash_size": SLASH_RATIO * v,
                        **measure(vs_plan(q, k, v, scale), mass, pairs)}
        return cache[v]

    lo, hi = 1, max(1, n // SLASH_RATIO)
    if at(lo)["density"] >= target:
        return at(lo)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if at(mid)["density"] < target:
            lo = mid
        else:
            hi = mid
    return min((at(lo), at(hi)), key=lambda r: abs(r["density"] - target))


def run_layer(layer: int, q: torch.Tensor, k: torch.Tensor, scale: float | None, log: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    n = q.shape[2]
    mass = group_mass(q, k, scale)
    pairs = group_pairs(n)
    print(f"layer {layer}: attention masses in {time.perf_counter() - t0:.0f} s", file=log, flush=True)
    rows: list[dict[str, Any]] = []
    vs_cache: dict[int, dict[str, Any]] = {}
    for block, chunk_n, alpha in ((b, c, a) for b in BLOCKS for c in CHUNKS for a in ALPHAS):
        params = {"alpha_c": alpha, "alpha_s": alpha, "chunk_n": chunk_n, "block_size": block}
        plan = reference.sample_attention_plan(q, k, scale=scale, **params)
        _, slashes = sample_attention_selection(q, k, scale=scale, **params)
        row: dict[str, Any] = {"layer": layer, "seqlen": n, **params, **measure(plan, mass, pairs)}
        row["heads_without_selected_diagonal"] = int((~slashes[0, :, 0]).sum())
        row["meets_target"] = row["recall_mean"] >= 0.95 and row["recall_min"] >= 0.85
        row["vertical_slash"] = matched_vertical_slash(q, k, row["density"], scale, mass, pairs, vs_cache)
        rows.append(row)
        print(f"layer {layer} block {block} alpha {alpha} chunk_n {chunk_n}: density {row['density']:.4f} recall "
              f"{row['recall_mean']:.4f}/{row['recall_min']:.4f} | vs({row['vertical_slash']['vertical_size']}) "
              f"{row['vertical_slash']['density']:.4f} {row['vertical_slash']['recall_mean']:.4f}/"
              f"{row['vertical_slash']['recall_min']:.4f}  [{time.perf_counter() - t0:.0f} s]",
              file=log, flush=True)
    shares = sorted({*CURVE, *(r["recall_mean"] for r in rows)})
    oracle = oracle_density(q, k, [min(1.0, s) for s in shares], scale=scale)[0].mean(dim=0)
    by_share = dict(zip(shares, (float(x) for x in oracle)))
    blocks = {b: dict(zip(shares, block_oracle_density(mass, n, shares, b))) for b in BLOCKS}
    for r in rows:
        r["oracle_density_at_recall_mean"] = by_share[r["recall_mean"]]
        r["density_vs_oracle"] = r["density"] / r["oracle_density_at_recall_mean"]
        r["block_oracle_density_at_recall_mean"] = blocks[r["block_size"]][r["recall_mean"]]
    # The exact shortcut against the reference metrics, on one plan.
    plan = reference.sample_attention_plan(q, k, alpha_c=0.95, alpha_s=0.95, chunk_n=2, block_size=64,
                                           scale=scale)
    fast_way = measure(plan, mass, pairs)
    ref_recall = reference.recall(q, k, plan, scale=scale).double().mean(dim=-1)[0]
    vs = vs_plan(q, k, 256, scale)
    vs_fast = measure(vs, mass, pairs)
    vs_recall = reference.recall(q, k, vs, scale=scale).double().mean(dim=-1)[0]
    check = {
        "sample_attention_density_diff": abs(fast_way["density"] - float(reference.density(plan).mean())),
        "sample_attention_recall_diff": float((ref_recall - torch.tensor(fast_way["recall_per_head"],
                                                                         dtype=torch.float64)).abs().max()),
        "vertical_slash_density_diff": abs(vs_fast["density"] - float(reference.density(vs).mean())),
        "vertical_slash_recall_diff": float((vs_recall - torch.tensor(vs_fast["recall_per_head"],
                                                                      dtype=torch.float64)).abs().max()),
    }
    print(f"layer {layer}: checks {check} [{time.perf_counter() - t0:.0f} s]", file=log, flush=True)
    return {"layer": layer, "rows": rows, "oracle_curve": {str(s): by_share[s] for s in CURVE},
            "block_oracle_curve": {str(b): {str(s): blocks[b][s] for s in CURVE} for b in BLOCKS},
            "check": check, "seconds": time.perf_counter() - t0}


def figure(layers: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(layers), figsize=(4.6 * len(layers), 4.2), squeeze=False)
    colors = {1: "tab:blue", 2: "tab:orange", 4: "tab:green"}
    for ax, lay in zip(axes[0], layers):
        curve = sorted((float(s), d) for s, d in lay["oracle_curve"].items())
        ax.plot([d for _, d in curve], [s for s, _ in curve], "k--", lw=1, label="oracle (per row)")
        curve = sorted((float(s), d) for s, d in lay["block_oracle_curve"][str(BLOCK)].items())
        ax.plot([d for _, d in curve], [s for s, _ in curve], "k-.", lw=1, label=f"best {BLOCK}-block plan")
        for b, style in zip(BLOCKS, ("o-", "s:")):
            for c in CHUNKS:
                pts = [r for r in lay["rows"] if r["chunk_n"] == c and r["block_size"] == b]
                ax.plot([r["density"] for r in pts], [r["recall_mean"] for r in pts], style, color=colors[c],
                        ms=4, label=f"SampleAttention block {b}, chunk_n={c}")
                if b == BLOCK:
                    for r in pts:
                        ax.annotate(f"{r['alpha_c']:g}", (r["density"], r["recall_mean"]), fontsize=6,
                                    textcoords="offset points", xytext=(3, -8))
        vs = [r["vertical_slash"] for r in lay["rows"] if r["block_size"] == BLOCK]
        ax.scatter([r["density"] for r in vs], [r["recall_mean"] for r in vs], marker="x", color="tab:red",
                   label="vertical-slash, matched density", zorder=3)
        ax.axhline(0.95, color="grey", lw=0.5)
        ax.set_xscale("log")
        ax.set_xlabel("density (share of the causal area)")
        ax.set_ylabel("recall, mean over heads")
        ax.set_title(f"SmolLM2-135M layer {lay['layer']}, N = 8192")
        ax.set_ylim(min(0.7, min(r["recall_mean"] for r in vs)), 1.0)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    import sys

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qkv", default="/work/captures/qkv_smollm2_8k.pt")
    parser.add_argument("--layers", type=int, nargs="*", default=None, help="captured layers to use (default all)")
    parser.add_argument("--max-seqlen", type=int, default=None, help="use only the first tokens (quick runs)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    data = torch.load(args.qkv, map_location="cpu")
    out = []
    for i, layer in enumerate(data["layers"]):
        if args.layers and layer not in args.layers:
            continue
        q, k = data["q"][i][:, :, : args.max_seqlen], data["k"][i][:, :, : args.max_seqlen]
        out.append(run_layer(int(layer), q, k, float(data["scale"][i]), sys.stderr))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"capture": str(args.qkv), "block_sizes": BLOCKS, "alphas": ALPHAS,
                                             "chunks": CHUNKS, "slash_ratio": SLASH_RATIO, "layers": out},
                                            indent=1))
    for lay in out:
        print("| layer | block | alpha | chunk_n | density | recall mean | recall min | oracle density at "
              "that recall | x oracle | best block plan | vertical-slash (v, s) | its density | its recall "
              "mean | its recall min |")
        print("| --- " * 14 + "|")
        for r in lay["rows"]:
            v = r["vertical_slash"]
            print(f"| {r['layer']} | {r['block_size']} | {r['alpha_c']:g} | {r['chunk_n']} | {r['density']:.4f} | "
                  f"{r['recall_mean']:.4f} | {r['recall_min']:.4f} | {r['oracle_density_at_recall_mean']:.4f} | "
                  f"{r['density_vs_oracle']:.2f} | {r['block_oracle_density_at_recall_mean']:.4f} | "
                  f"({v['vertical_size']}, {v['slash_size']}) | "
                  f"{v['density']:.4f} | {v['recall_mean']:.4f} | {v['recall_min']:.4f} |")
    if args.png:
        figure(out, args.png)


if __name__ == "__main__":
    main()
