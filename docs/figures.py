"""Draw every figure of the docs pages into docs/img/ (run from anywhere, on a CPU).

    python docs/figures.py PAGE [PAGE ...]      # e.g. python docs/figures.py minference
    python docs/figures.py all
    python docs/figures.py --list                # pages and the pictures each draws
    python docs/figures.py dense --out /tmp/img  # somewhere else

Two kinds of figure: mask pictures, drawn from the package's own reference plans at a
small N (seconds to a minute on a CPU, no GPU, no capture needed), and figures of
measured numbers, drawn from the JSON under benches/results/ that the page cites.
Every PNG under docs/img/ is made here; docs/benchmarks.md lists each one with the
command that measured its numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

# Agg renders without a display, as on CI machines and GPU servers.
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch

from sparseprefill import reference
from sparseprefill._viz import attention_image, mask_image, plan_image, save_mask_figure

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benches" / "results"
IMG = ROOT / "docs" / "img"

Figure = Callable[[Path], Path]


def _load(name: str) -> Any:
    """One JSON file under benches/results/."""
    return json.loads((RESULTS / name).read_text())


def _save(fig: plt.Figure, path: Path, dpi: int = 110) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _demo_qkv(n: int, heads: int = 4, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q, k, v of the demo's synthetic workload (sinks, local decay, slashes, columns)."""
    from sparseprefill.demo import Shape, synthetic_qkv

    return synthetic_qkv(Shape(1, heads, 1, n, 64, dtype), device=torch.device("cpu"), seed=seed)


def _periodic_head(n: int, d: int, period: int, heavy_keys: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k `[1, 1, N, D]` whose attention has slashes every `period` tokens and a few heavy columns."""
    gen = torch.Generator().manual_seed(0)
    pos = torch.arange(n, dtype=torch.float64)
    q = 0.3 * torch.randn(n, d, generator=gen, dtype=torch.float64)
    k = 0.3 * torch.randn(n, d, generator=gen, dtype=torch.float64)
    # q_r . k_c gains sum_j cos(w_j (r - c)): peaks where r - c is a multiple of the period.
    for j in range(8):
        w = 2 * math.pi * (j + 1) / period
        q[:, 2 * j] += 6 * torch.cos(w * pos)
        q[:, 2 * j + 1] += 6 * torch.sin(w * pos)
        k[:, 2 * j] += torch.cos(w * pos)
        k[:, 2 * j + 1] += torch.sin(w * pos)
    q[:, 16] += 64.0
    k[list(heavy_keys), 16] += 1.0
    return q[None, None], k[None, None]


# --- mask pictures: the package's own plans ------------------------------------------------------


def dense_masks(out: Path) -> Path:
    q = k = torch.zeros(1, 1, 2048, 16)  # the estimators read only the shapes here
    plan = reference.dense_plan(q, k, block_m=128, block_n=64)
    return save_mask_figure([("dense_plan, N = 2048\n128 x 64 blocks", plan_image(plan, size=256))],
                            out / "dense.png")


def streaming_masks(out: Path) -> Path:
    n, sink, window = 2048, 100, 300
    q = k = torch.zeros(1, 1, n, 16)
    rows, keys = torch.arange(n)[:, None], torch.arange(n)[None, :]
    token_mask = (keys <= rows) & ((keys < sink) | (keys > rows - window))
    plan = reference.streaming_plan(q, k, sink=sink, window=window, block_m=128, block_n=64)
    share = float(reference.density(plan)[0, 0])
    token_share = float(reference.density(token_mask[None, None])[0, 0])
    return save_mask_figure(
        [(f"token level: sink {sink}, window {window}\ndensity {token_share:.1%}", mask_image(token_mask, size=256)),
         (f"streaming_plan (128 x 64 blocks)\ndensity {share:.1%}", plan_image(plan, size=256))],
        out / "streaming.png",
        title=f"N = {n}: the token-level A-shape and the block-rounded plan the kernel runs")


def minference_masks(out: Path) -> Path:
    n = 2048
    q, k = _periodic_head(n, 64, 400, (0, 1, 2, 3, 600, 601, 1400))
    attention = attention_image(q[0, 0], k[0, 0], size=256)

    def dens(plan: Any) -> str:
        return f"{float(reference.density(plan)[0, 0]):.1%}"

    vs = reference.vertical_slash_plan(q, k, vertical_size=16, slash_size=24, last_q=64, block_m=64, block_n=64,
                                       init_columns=4, local_diagonals=8)
    save_mask_figure([("attention (log scale)", attention),
                      (f"vertical_slash_plan\n(16, 24), 64 x 64 blocks, density {dens(vs)}", plan_image(vs, size=256))],
                     out / "vertical_slash.png", title=f"N = {n}: slashes become key blocks, leftover verticals columns")
    bs = reference.block_sparse_plan(q, k, top_k=6, block_size=64)
    save_mask_figure([("attention (log scale)", attention),
                      (f"block_sparse_plan\ntop_k 6, 64-token blocks, density {dens(bs)}", plan_image(bs, size=256))],
                     out / "block_sparse.png", title=f"N = {n}: top-k key blocks from mean-pooled scores")
    ashape = reference.a_shape_plan(q, k, sink=64, window=256)
    return save_mask_figure([("attention (log scale)", attention),
                             (f"a_shape_plan\nsink 64, window 256, density {dens(ashape)}",
                              plan_image(ashape, size=256))],
                            out / "a_shape.png", title=f"N = {n}: sink + local window, whatever the input")


def sample_attention_masks(out: Path) -> Path:
    n, d, period, fading_key = 2048, 64, 400, 300
    gen = torch.Generator().manual_seed(0)
    pos = torch.arange(n, dtype=torch.float64)
    q = torch.zeros(n, d, dtype=torch.float64)
    k = torch.zeros(n, d, dtype=torch.float64)
    q[:, 18:] = torch.randn(n, d - 18, generator=gen, dtype=torch.float64)
    k[:, 18:] = torch.randn(n, d - 18, generator=gen, dtype=torch.float64)
    for j in range(8):
        w = 2 * math.pi * (j + 1) / period
        q[:, 2 * j] += 8 * torch.cos(w * pos)
        q[:, 2 * j + 1] += 8 * torch.sin(w * pos)
        k[:, 2 * j] += torch.cos(w * pos)
        k[:, 2 * j + 1] += torch.sin(w * pos)
    q[:, 16] += 48.0
    k[:4, 16] += 1.0  # sinks
    q[: n // 2, 17] += 80.0
    k[fading_key, 17] += 1.0  # a column only the first half of the queries see
    q, k = q[None, None], k[None, None]
    panels = [("attention (log scale)", attention_image(q[0, 0], k[0, 0], size=256))]
    for chunk_n in (1, 2):
        plan = reference.sample_attention_plan(q, k, alpha_c=0.95, alpha_s=0.95, chunk_n=chunk_n, block_size=64)
        recall = float(reference.recall(q, k, plan).mean())
        label = f"chunk_n = {chunk_n}: density {float(reference.density(plan)[0, 0]):.1%}\nrecall {recall:.3f}"
        panels.append((label, plan_image(plan, size=256)))
    return save_mask_figure(panels, out / "sample_attention.png",
                            title=f"N = {n}, alpha_c = alpha_s = 0.95, 64-token blocks: column blocks + block diagonals")


def _weight_image(weights: torch.Tensor, size: int = 256, floor: float = 1e-4) -> np.ndarray:
    """Tile weights `[T, T]` of one head, log scaled to `[0, 1]`, one pixel block per tile."""
    w = weights.double().clamp(min=floor).log10()
    img = ((w - math.log10(floor)) / -math.log10(floor)).numpy()
    t = weights.shape[0]
    img[np.triu_indices(t, 1)] = np.nan
    rep = max(1, size // t)
    return np.kron(img, np.ones((rep, rep)))


def xattention_masks(out: Path) -> Path:
    n, block, threshold, head = 2048, 64, 0.9, 1
    q, k, _ = _demo_qkv(n)
    panels = [("attention, one head (log scale)", attention_image(q[0, head], k[0, 0], size=256))]
    cases = [("xattention", "XAttention, stride 8 (antidiagonal)", {"stride": 8}, "Score% 12.5"),
             ("xattention", "naive stride 4 (ablation)", {"stride": 4, "scoring": "naive"}, "Score% 6.3"),
             ("dpxa", "DPXA, cos 0.75", {"cos_threshold": 0.75}, None)]
    for method, label, params, score in cases:
        weights = getattr(reference, f"{method}_tile_weights")(q, k, block=block, **params)
        plan = getattr(reference, f"{method}_plan")(q, k, block=block, threshold=threshold, **params)
        recall = float(reference.recall(q, k, plan)[0, head].mean())
        density = float(reference.density(plan)[0, head])
        if score is None:
            score = f"Score% {100 * float(reference.dpxa_scoring_ratio(q, k, block=block, **params)[0, head]):.1f}"
        panels.append((f"{label}\ntile weights (log), {score}", _weight_image(weights[0, head])))
        panels.append((f"kept tiles at threshold {threshold}\ndensity {density:.1%}, recall {recall:.3f}",
                       plan_image(plan, head=head, size=256)))
    save_mask_figure(panels[:3], out / "xattention.png", columns=3,
                     title=f"N = {n}, {block}-token tiles: antidiagonal tile weights and the greedy selection")
    return save_mask_figure([panels[0], *panels[3:]], out / "dpxa.png", columns=5,
                            title=f"N = {n}: naive stride-4 sampling and DPXA's delta anchors (same greedy rule)")


def anchor_attention_masks(out: Path) -> Path:
    import importlib

    anchor = importlib.import_module("sparseprefill.reference.anchor_attention")
    n, block, theta = 2048, 64, 6.0
    q, k, _ = _demo_qkv(n, heads=1, dtype=torch.float16, seed=1)
    panels = [("attention, head 0 (log scale)", attention_image(q[0, 0], k[0, 0], size=256))]
    for step, with_stripes in ((4, False), (4, True), (1, True)):
        plan = reference.anchor_attention_plan(q, k, theta=theta, step=step, block_m=block, block_n=block)
        if with_stripes:
            title = f"anchor + stripes, theta {theta:g}, step {step}"
        else:
            empty = torch.zeros(1, 1, plan.num_column_rows, n, dtype=torch.bool)
            plan = anchor.anchor_plan_from_stripes(empty, seqlen=n, step=step, block_m=block, block_n=block)
            title = f"anchor blocks only (step {step})"
        dens = float(reference.density(plan)[0, 0])
        rec = float(reference.recall(q, k, plan)[0, 0].mean())
        panels.append((f"{title}\ndensity {dens:.1%}, recall {rec:.3f}", plan_image(plan, size=256)))
    return save_mask_figure(panels, out / "anchor_attention.png",
                            title=f"AnchorAttention, N = {n}, blocks of {block}: initial block + group window "
                                  "(blocks), stripes shared by each group of step query blocks (columns)")


def headwise_masks(out: Path) -> Path:
    n = 2048
    q, k, _ = _demo_qkv(n, heads=4)
    # Each head the choice that fits its pattern: slashes and columns, blocks, diffuse, local.
    heads: list[dict[str, Any] | None] = [
        {"method": "vertical_slash", "vertical_size": 32, "slash_size": 64, "block_m": 64, "block_n": 64,
         "init_columns": 4, "local_diagonals": 8},
        {"method": "xattention", "stride": 8, "threshold": 0.9, "block": 128},
        None,
        {"method": "streaming", "sink": 64, "window": 256, "block_m": 128, "block_n": 64},
    ]
    # On a CPU the break-even rule is off: the merged plan as the estimators made it.
    plan = reference.headwise_plan(q, k, heads=heads)
    density = reference.density(plan)[0]
    recall = reference.recall(q, k, plan)[0].mean(dim=-1)
    panels = [(f"attention, head {h} (log scale)", attention_image(q[0, h], k[0, 0], size=256)) for h in range(4)]
    for h, choice in enumerate(heads):
        if choice is None:
            label = "None: full causal"  # marked dense: plan_image draws it full causal
        else:
            unit = (f"{choice['block']} x {choice['block']}" if "block" in choice
                    else f"{choice['block_m']} x {choice['block_n']}")
            label = f"{choice['method']} (its unit {unit})"
        image = plan_image(plan, head=h, size=256)
        panels.append((f"head {h}: {label}\ndensity {float(density[h]):.1%}, recall {float(recall[h]):.3f}", image))
    return save_mask_figure(panels, out / "headwise.png", columns=4, seqlen=n,
                            title=f"headwise_plan, N = {n}: one plan of the four heads at {plan.block_m} x "
                                  f"{plan.block_n} blocks, head {', '.join(map(str, plan.dense_heads))} marked dense")


def delta_kv_masks(out: Path) -> Path:
    from sparseprefill.reference.delta_kv import safe_blocks

    n, d, chunk, block = 512, 16, 128, 32
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(1, 1, n // 8 + 1, d, generator=gen).repeat_interleave(8, dim=2)[:, :, :n]
    k = (base + 0.25 * torch.randn(1, 1, n, d, generator=gen)).to(torch.float32)
    v = torch.randn(1, 1, n, d, generator=gen)
    keep = reference.delta_keep_mask(k, threshold=2.0, chunk=chunk)
    packed = reference.delta_pack(k, v, keep, block=block)
    _, cut = safe_blocks(packed, block_m=block)
    rows, keys = np.arange(n)[:, None], np.arange(n)[None, :]
    cut_of_row = cut[0, 0].numpy()[rows // block]
    # 2: exact (phase 2); 1: read through its anchor (phase 1); 0: future (causal mask).
    image = np.where(keys > rows, 0, np.where(keys >= cut_of_row, 2, 1))
    fig, (ax_m, ax_k) = plt.subplots(2, 1, figsize=(6.2, 7.2), gridspec_kw={"height_ratios": [6, 1]})
    cmap = matplotlib.colors.ListedColormap(["white", "#9ecae1", "#08519c"])
    ax_m.imshow(image, cmap=cmap, vmin=0, vmax=2, interpolation="nearest")
    ax_m.set_title(f"Delta-KV, N = {n}: phase 1 (light: packed anchors, {int(packed.lengths[0, 0])} of {n} keys)\n"
                   "phase 2 (dark: the critical diagonal, exact)", fontsize=9)
    ax_m.set_xlabel("key position")
    ax_m.set_ylabel("query row")
    for b in range(0, n, block):
        ax_m.axhline(b - 0.5, color="grey", lw=0.3)
    ax_k.imshow(keep[0, 0].numpy().astype(float)[None, :], aspect="auto", cmap="Greys", interpolation="nearest")
    ax_k.set_yticks([])
    ax_k.set_title(f"anchors (black) of the keep mask: chunks of {chunk}, Euclidean threshold 2.0", fontsize=9)
    for c in range(0, n, chunk):
        ax_k.axvline(c - 0.5, color="red", lw=0.8)
    fig.tight_layout()
    return _save(fig, out / "delta_kv.png")


def delta_xattention_masks(out: Path) -> Path:
    from sparseprefill.reference.delta_xattention import EXACT, PACKED

    n, block, threshold, cosine, head = 2048, 64, 0.9, 0.83, 1
    q, k, v = _demo_qkv(n)
    # Redundant keys: each key mostly a copy of the first of its run; runs shorten along the sequence.
    gen = torch.Generator().manual_seed(0)
    starts = torch.rand(n, generator=gen) < torch.linspace(0.1, 0.6, n)
    starts[0] = True
    first = torch.where(starts, torch.arange(n), 0).cummax(0).values
    k = 0.9 * k[:, :, first] + 0.1 * k
    packing = reference.delta_tile_pack(k, v, delta_threshold=cosine, metric="cosine", block=block, packed_block=16)
    cases = [("XAttention (all selected tiles exact)", 1.0, "skip"),
             ("DeltaXAttention, exact_top 0.1 (tw10)", 0.1, "skip"),
             ("DeltaXAttention, exact_top 0 (diag kept)", 0.0, "skip"),
             ("unselected='packed' (not in the thesis)", 0.1, "packed")]
    cmap = matplotlib.colors.ListedColormap(["white", "#9ecae1", "#08519c"])
    fig = plt.figure(figsize=(16, 6.0))
    grid = fig.add_gridspec(2, len(cases), height_ratios=[8, 1])
    for col, (title, top, unselected) in enumerate(cases):
        modes = reference.delta_xattention_tiles(q, k, threshold=threshold, exact_top=top, block=block,
                                                 unselected=unselected)
        red = float(reference.delta_xattention_kv_reduction(modes, packing)[0, head])
        dens = float(reference.delta_xattention_density(modes, packing)[0, head])
        m = modes[0, head].numpy().astype(float)
        m[np.triu_indices(m.shape[0], 1)] = np.nan
        ax = fig.add_subplot(grid[0, col])
        ax.imshow(m, cmap=cmap, vmin=0, vmax=2, interpolation="nearest")
        exact, packed = int((modes[0, head] == EXACT).sum()), int((modes[0, head] == PACKED).sum())
        ax.set_title(f"{title}\n{exact} exact, {packed} packed tiles; KV red. {red:.1%}, density {dens:.1%}", fontsize=8)
        ax.set_xlabel("key tile")
        if col == 0:
            ax.set_ylabel("query tile")
    ax_k = fig.add_subplot(grid[1, :])
    anchors = packing.anchors()[0, 0].numpy()
    ax_k.bar(np.arange(len(anchors)), anchors / block, color="#08519c", width=1.0)
    ax_k.set_xlim(-0.5, n // block - 0.5)
    ax_k.set_ylim(0, 1)
    ax_k.set_ylabel("anchors / keys", fontsize=7)
    ax_k.set_title(f"per-tile packing (cosine {cosine}): keep ratio of every key tile "
                   f"({float(packing.keep_ratio()[0, 0]):.1%} overall; the last tile is never packed)", fontsize=8)
    fig.suptitle(f"N = {n}, {block}-token tiles, stride 8, threshold {threshold}, query head {head}: "
                 "dark = exact, light = packed anchors with log-count bias, white = skipped", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95), h_pad=2.5)
    return _save(fig, out / "delta_xattention.png")


# --- measured numbers: JSON under benches/results/ -----------------------------------------------


def _oracle(ax: plt.Axes, curve: dict[str, float] | Sequence[float], shares: Sequence[float] | None = None,
            style: str = "k-", label: str = "oracle (per row)") -> None:
    """Draw an oracle curve given as {share: density} or as densities at `shares`."""
    if isinstance(curve, dict):
        pts = sorted((float(d), float(s)) for s, d in curve.items())
    else:
        pts = sorted(zip(curve, shares or []))
    ax.plot([d for d, _ in pts], [s for _, s in pts], style, lw=1.5, label=label)


def _front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Pareto front of (density, value): sorted by density, value non-decreasing."""
    out: list[tuple[float, float]] = []
    for d, v in sorted(points):
        if not out or v > out[-1][1]:
            out.append((d, v))
    return out


def _density_at(front: list[tuple[float, float]], target: float, higher: bool) -> float | None:
    """Least density reaching `target` along a front, linear between its points."""
    for i, (dens, val) in enumerate(front):
        if (val >= target) if higher else (val <= target):
            if i == 0:
                return dens
            d0, v0 = front[i - 1]
            return d0 + (dens - d0) * (target - v0) / (val - v0) if val != v0 else dens
    return None


def compare_table(points: list[dict[str, Any]]) -> str:
    """Per method and layer: density at mean recall 0.90 / 0.95 (x the oracle's) / at output error <= 0.05."""
    sources = sorted({p["source"] for p in points}, key=lambda s: int(s.split()[-1]))
    methods = ["oracle", *sorted({p["method"] for p in points if p["method"] != "oracle"})]
    fmt = lambda x: "-" if x is None else f"{x:.3f}"
    rows = ["| method | " + " | ".join(sources) + " |", "| --- |" + " --- |" * len(sources)]
    for m in methods:
        cells = []
        for s in sources:
            pts = [p for p in points if p["source"] == s and p["method"] == m]
            rec = _front([(p["density"], p["recall_mean"]) for p in pts if p["recall_mean"] is not None])
            err = sorted((p["density"], p["output_error"]) for p in pts if p.get("output_error") is not None)
            err_front = [e for i, e in enumerate(err) if all(e[1] < f[1] for f in err[:i])]
            d90, d95 = _density_at(rec, 0.90, True), _density_at(rec, 0.95, True)
            oracle = _front([(p["density"], p["recall_mean"]) for p in points if p["source"] == s
                             and p["method"] == "oracle"])
            o95 = _density_at(oracle, 0.95, True)
            x = f" ({d95 / o95:.1f}x)" if d95 is not None and o95 and m != "oracle" else ""
            cells.append(f"{fmt(d90)} / {fmt(d95)}{x} / {fmt(_density_at(err_front, 0.05, False))}")
        rows.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def compare_figure(out: Path) -> Path:
    points = _load("compare-smollm2-4k-cpu.json")["points"]
    print(compare_table(points))
    sources = sorted({p["source"] for p in points}, key=lambda s: int(s.split()[-1]))
    names = sorted({p["method"] for p in points if p["method"] != "oracle"})
    cmap = plt.get_cmap("tab20")
    colors = {n: cmap((2 * i) % 20 + (2 * i) // 20) for i, n in enumerate(names)}
    markers = dict(zip(names, "osD^vP*Xh<>p8dH" * 2))
    fig, axes = plt.subplots(1, len(sources), figsize=(6.0 * len(sources), 5.0), squeeze=False)
    for ax, source in zip(axes[0], sources):
        mine = [p for p in points if p["source"] == source]
        oracle = sorted((p["density"], p["recall_mean"]) for p in mine if p["method"] == "oracle")
        ax.plot([d for d, _ in oracle], [r for _, r in oracle], "k--", lw=1.5, label="oracle (per row)")
        for name in names:
            pts = [(p["density"], p["recall_mean"]) for p in mine if p["method"] == name and p["recall_mean"] is not None]
            if not pts:
                continue
            ax.scatter([d for d, _ in pts], [r for _, r in pts], s=18, color=colors[name], alpha=0.6, marker=markers[name])
            front = _front(pts)
            ax.plot([d for d, _ in front], [r for _, r in front], "-", color=colors[name], marker=markers[name],
                    markersize=4, label=name)
        ax.set_xlabel("density (computed share of the causal area)")
        ax.set_ylabel("recall (mean over rows and heads)")
        ax.set_title(f"SmolLM2-135M {source}, N = 4096: recall vs density", fontsize=10)
        ax.set_xlim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return _save(fig, out / "compare-smollm2-4k.png")


def xattention_figure(out: Path) -> Path:
    data = _load("xattention-smollm2-8k-cpu.json")
    families = list(dict.fromkeys(r["family"] for L in data["layers"] for r in L["rows"]))
    colors = {"exact": "grey", "xattention": "tab:blue", "naive": "tab:green", "dpxa cos": "tab:red",
              "dpxa-grid": "tab:purple"}
    fig, axes = plt.subplots(1, len(data["layers"]), figsize=(5.6 * len(data["layers"]), 4.6), sharey=True)
    for ax, layer in zip(np.atleast_1d(axes), data["layers"]):
        _oracle(ax, layer["oracle_grid"], style="k-")
        vs = sorted((p["density"], p["recall_mean"]) for p in layer["vertical_slash_grid"])
        ax.plot([d for d, _ in vs], [r for _, r in vs], "k--", lw=1.2, label="vertical-slash (x, 4x)")
        for i, fam in enumerate(families):
            pts = sorted((r["density"], r["recall_mean"]) for r in layer["rows"] if r["family"] == fam)
            color = next((c for key, c in colors.items() if fam.startswith(key)), "black")
            ax.plot([d for d, _ in pts], [r for _, r in pts], "-" if "naive" not in fam and "grid" not in fam else ":",
                    marker="o^sDv"[i % 5], ms=3.5, lw=1.2, color=color, label=fam)
        ax.set_xscale("log")
        ax.set_xlim(1e-2, 1.0)
        ax.set_ylim(0.5, 1.0)
        ax.set_xlabel("density (kept causal pairs)")
        ax.set_title(f"SmolLM2-135M layer {layer['layer']}, N = {layer['seqlen']}")
        ax.grid(alpha=0.3, which="both")
    np.atleast_1d(axes)[0].set_ylabel("recall (mean over rows and heads)")
    np.atleast_1d(axes)[-1].legend(fontsize=7, loc="lower right")
    fig.suptitle("Tile scorers at thresholds 0.5 ... 0.98 (block 128), against the oracle and vertical-slash")
    fig.tight_layout()
    return _save(fig, out / "xattention_recall_density.png")


def anchor_attention_figure(out: Path) -> Path:
    data = _load("anchor-attention-smollm2-8k-cpu.json")
    shares = data["oracle_curve_shares"]
    layers = sorted({r["layer"] for r in data["rows"]})
    steps = sorted({r["params"]["step"] for r in data["rows"] if r["method"] == "anchor_attention"})
    fig, axes = plt.subplots(1, len(layers), figsize=(6.0 * len(layers), 4.4))
    for ax, layer in zip(np.atleast_1d(axes), layers):
        _oracle(ax, data["oracle_curves"][str(layer)], shares)
        rows = [r for r in data["rows"] if r["layer"] == layer]
        for step, marker in zip(steps, "os^D"):
            mine = [r for r in rows if r["method"] == "anchor_attention" and r["params"]["step"] == step]
            ax.scatter([r["density"] for r in mine], [r["recall_mean"] for r in mine], marker=marker,
                       c=[r["params"]["theta"] for r in mine], cmap="plasma", vmin=0, vmax=20, s=40,
                       label=f"anchor step {step}")
            for r in mine:
                ax.annotate(f"{r['params']['theta']:g}", (r["density"], r["recall_mean"]), fontsize=6,
                            xytext=(3, -6), textcoords="offset points")
        other = [r for r in rows if r["method"] != "anchor_attention"]
        ax.scatter([r["density"] for r in other], [r["recall_mean"] for r in other], marker="x", color="grey",
                   label="vertical_slash (matched)")
        ax.set_xlim(0, 1.0)
        ax.set_ylim(0.48, 1.02)
        ax.set_xlabel("density (kept share of the causal area)")
        ax.set_ylabel("recall (mean over heads)")
        ax.set_title(f"SmolLM2-135M layer {layer}, N = 8192")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle("AnchorAttention (labels: theta; marker: step) vs vertical-slash at matched density")
    fig.tight_layout()
    return _save(fig, out / "anchor_smollm2_recall_density.png")


def sample_attention_figure(out: Path) -> Path:
    data = _load("sample-attention-smollm2-8k-cpu.json")
    fig, axes = plt.subplots(1, len(data["layers"]), figsize=(5.6 * len(data["layers"]), 4.8))
    for ax, layer in zip(np.atleast_1d(axes), data["layers"]):
        _oracle(ax, layer["oracle_curve"], style="k--")
        _oracle(ax, layer["block_oracle_curve"]["128"], style="k-.", label="best 128-block plan")
        for bi, block in enumerate(sorted({r["block_size"] for r in layer["rows"]}, reverse=True)):
            for ci, chunk in enumerate(sorted({r["chunk_n"] for r in layer["rows"]})):
                pts = sorted((r["density"], r["recall_mean"], r["alpha_c"]) for r in layer["rows"]
                             if r["block_size"] == block and r["chunk_n"] == chunk)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "-" if bi == 0 else ":", marker="os"[bi],
                        color=f"C{ci}", ms=4, label=f"SampleAttention block {block}, chunk_n={chunk}")
                if bi == 0:
                    for d, r, a in pts:
                        ax.annotate(f"{a:g}", (d, r), fontsize=6, xytext=(3, -7), textcoords="offset points")
        vs = [(r["vertical_slash"]["density"], r["vertical_slash"]["recall_mean"]) for r in layer["rows"]
              if r.get("vertical_slash")]
        ax.scatter([d for d, _ in vs], [r for _, r in vs], marker="x", color="tab:red", s=40,
                   label="vertical-slash, matched density")
        ax.axhline(0.95, color="grey", lw=0.6)
        ax.set_xscale("log")
        ax.set_ylim(0.7, 1.0)
        ax.set_xlabel("density (share of the causal area)")
        ax.set_ylabel("recall, mean over heads")
        ax.set_title(f"SmolLM2-135M layer {layer['layer']}, N = 8192")
    np.atleast_1d(axes)[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return _save(fig, out / "sample_attention_smollm2.png")


def delta_xattention_figure(out: Path) -> Path:
    data = _load("delta-xattention-smollm2-8k-cpu.json")
    fig, axes = plt.subplots(1, len(data["layers"]), figsize=(6.0 * len(data["layers"]), 4.6))
    for ax, layer in zip(np.atleast_1d(axes), data["layers"]):
        xa = sorted((r["density"], r["output_error"]) for r in layer["xattention"])
        ax.plot(*zip(*xa), "k-o", ms=3, label="XAttention s8")
        dkv = sorted((r["density"], r["output_error"]) for r in layer["delta_kv"])
        ax.plot(*zip(*dkv), "--s", color="grey", ms=3, label="Delta-KV alone")
        skip = sorted((r["density"], r["output_error"]) for r in layer["tile_skip"]
                      if r["threshold"] == 0.9 and r["first_tile"] == "kept")
        ax.plot(*zip(*skip), ":^", color="tab:green", ms=3, label="XAttention 0.9 + tile skip")
        variants = list(dict.fromkeys(r["variant"] for r in layer["delta_xattention"]))
        for i, variant in enumerate(variants):
            pts = sorted((r["density"], r["output_error"]) for r in layer["delta_xattention"]
                         if r["variant"] == variant and r["threshold"] == 0.9)
            if pts:
                ax.plot(*zip(*pts), "-D", color=f"C{i + 1}", ms=3, label=f"DeltaXAttention 0.9 {variant}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("density (score entries over the causal area)")
        ax.set_title(f"SmolLM2-135M layer {layer['layer']}, N = {layer['seqlen']}")
        ax.grid(alpha=0.3, which="both")
    np.atleast_1d(axes)[0].set_ylabel("relative output error vs dense")
    np.atleast_1d(axes)[-1].legend(fontsize=7, loc="lower left")
    fig.suptitle("DeltaXAttention (cosine 0.95 ... 0.75) against XAttention, its tile skip and Delta-KV")
    fig.tight_layout()
    return _save(fig, out / "delta_xattention_smollm2.png")


def _layers_result(data: dict[str, Any]) -> dict[str, Any]:
    """An `eval layers` JSON (or the older layout of the same run: `distribution` per delta,
    `params` per row) as {"distribution": {label: {"per_layer": [...]}}, "frontier", "rows"
    with a `setting` label}."""
    if "settings" in data:  # written by `sparseprefill eval layers`
        dist = {s["label"]: {"per_layer": [{"layer": e["layer"], **e.get("counts", {})} for e in s["per_layer"]]}
                for s in data["settings"]}
        return {"distribution": dist, "frontier": data["frontier"], "rows": data["rows"]}
    keys = ("delta", "gamma", "vertical_size")
    rows = [{**r, "setting": ", ".join(f"{k}={v}" for k, v in r["params"].items() if k in keys)} for r in data["rows"]]
    dist = {f"delta={d}": v for d, v in data["distribution"].items()}
    return {"distribution": dist, "frontier": data["frontier"], "rows": rows}


def shareprefill_figures(out: Path) -> Path:
    clusters = _load("clusters-smollm2-8k-cpu.json")
    table = np.array(clusters["clusters"], dtype=float)
    noise = clusters["noise"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 6.5), gridspec_kw={"width_ratios": [1, 1.6]})
    ax.imshow(np.where(table == noise, np.nan, table), cmap="tab20", aspect="auto", interpolation="nearest")
    for (layer, head), c in np.ndenumerate(table):
        ax.text(head, layer, "n" if c == noise else str(int(c)), ha="center", va="center", fontsize=6)
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_title("cluster of each head (n: noise)")
    ids, counts = np.unique(table, return_counts=True)
    order = sorted(zip(ids, counts), key=lambda x: (x[0] == noise, -x[1]))
    ax2.bar(range(len(order)), [c for _, c in order], color=["0.6" if i == noise else "C0" for i, _ in order])
    ax2.set_xticks(range(len(order)), ["noise" if i == noise else str(int(i)) for i, _ in order], fontsize=7)
    ax2.set_ylabel("heads")
    n_clusters = sum(1 for i, _ in order if i != noise)
    ax2.set_title(f"{n_clusters} clusters, {int((table == noise).sum())} noise heads of {table.size}")
    fig.suptitle("SmolLM2-135M, 30 layers x 9 heads: SharePrefill's offline clusters (sparseprefill cluster)")
    fig.tight_layout()
    _save(fig, out / "shareprefill-clusters.png")

    data = _layers_result(_load("shareprefill-smollm2-8k-cpu.json"))
    deltas = list(data["distribution"])
    layers = list(data["frontier"])
    fig, axes = plt.subplots(1, len(deltas) + len(layers), figsize=(4.6 * (len(deltas) + len(layers)), 3.6))
    for ax, delta in zip(axes, deltas):
        per = data["distribution"][delta]["per_layer"]
        bottom = np.zeros(len(per))
        for kind, color in (("dense", "tab:red"), ("shared", "tab:green"), ("vertical_slash", "tab:blue")):
            vals = np.array([p.get(kind, 0) for p in per])
            ax.bar([p["layer"] for p in per], vals, bottom=bottom, color=color, label=kind.replace("_", "-"))
            bottom += vals
        ax.set_title(f"SmolLM2 8K, {delta}: heads per pattern", fontsize=8)
        ax.set_xlabel("layer")
        ax.set_ylabel("query heads")
        ax.legend(fontsize=6)
    for ax, layer in zip(axes[len(deltas):], layers):
        _oracle(ax, {s: d for s, d in data["frontier"][layer].items()}, style="k--")
        for i, r in enumerate(r for r in data["rows"] if str(r["layer"]) == layer):
            params = r["setting"]
            ax.scatter([r["density"]], [r["recall_mean"]], marker="osD^v"[i % 5], s=30,
                       label=f"{r['method']} {params}")
        ax.set_xlabel("density (share of causal pairs)")
        ax.set_ylabel("mean recall")
        ax.set_title(f"layer {layer}", fontsize=8)
        ax.legend(fontsize=5, loc="lower right")
    fig.tight_layout()
    return _save(fig, out / "shareprefill-smollm2.png")


def _density_per_head(tables: dict[str, Any], path: Path, title: str) -> Path:
    """Density per head, default vs calibrated vs oracle, one panel per table (label)."""
    fig, axes = plt.subplots(len(tables), 1, figsize=(12, 2.6 * len(tables)), squeeze=False)
    for ax, (label, table) in zip(axes[:, 0], tables.items()):
        rows = sorted(table["layers"], key=lambda r: r["layer"])
        x0, ticks, labels = 0, [], []
        for i, r in enumerate(rows):
            xs = list(range(x0, x0 + len(r["density"])))
            ax.scatter(xs, r["default_density"], marker="x", color="tab:gray", s=14, label="default" if i == 0 else None)
            ax.scatter(xs, r["density"], marker="o", color="tab:blue", s=12, label="calibrated" if i == 0 else None)
            ax.scatter(xs, r["oracle"], marker="_", color="tab:red", s=40,
                       label=f"oracle @ {r['oracle_share']:g}" if i == 0 else None)
            ticks.append(x0 + len(xs) / 2 - 0.5)
            labels.append(str(r["layer"]))
            x0 += len(xs) + 1
        ax.set_yscale("log")
        ax.set_ylabel("density")
        ax.set_title(f"{label}: density per head, by layer", fontsize=9)
        ax.set_xticks(ticks, labels, fontsize=6)
        ax.legend(fontsize=7, loc="lower right")
    axes[-1, 0].set_xlabel("layer (heads side by side)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def calibrate_figures(out: Path) -> Path:
    grid = _load("calibrate/calibrate-smollm2-4k-grid-cpu.json")
    xa = [row for key in grid if key.startswith("xattention") for row in grid[key]["layers"]]
    tables = {"xattention grid": {"layers": xa}}
    tables["flexprefill_vs grid"] = grid["flexprefill_vs grid"]
    both = grid["sample_attention and shareprefill grid"]["layers"]
    for method in ("sample_attention", "shareprefill"):
        tables[f"{method} grid"] = {"layers": [r for r in both if r["method"] == method]}
    _density_per_head(tables, out / "calibrate-density-per-head.png",
                      "SmolLM2-135M, N = 4096 (stdlib code), target: every head's mean recall >= 0.95")
    return _density_per_head(_load("calibrate/calibrate-smollm2-4k-margin-cpu.json"),
                             out / "calibrate-margin-density-per-head.png",
                             "SmolLM2-135M, N = 4096 (stdlib code), every head's mean recall >= 0.95 + margin 0.02")


def workload_figure(out: Path) -> Path:
    rows = _load("equal-recall-h200.json")["rows"] + _load("equal-recall-32k-more-h200.json")["rows"]

    def panel(source: str) -> str:
        if source.startswith("captured"):
            return "captured SmolLM2 layers 2 / 14 / 27, N = 8192 (H100 and H200 rows)"
        n = source.split("N=")[2].split(",")[0]
        return f"calibrated workload, N = {n}, 12 / 4 heads, D = 128 (H200)"

    panels = list(dict.fromkeys(panel(r["source"]) for r in rows))
    panels.sort(key=lambda p: (not p.startswith("captured"), len(p), p))
    methods = sorted({r["method"] for r in rows})
    cmap = plt.get_cmap("tab20")
    style = {m: (cmap(i % 20), "osD^v<>pXh*"[i % 11]) for i, m in enumerate(methods)}
    fig, axes = plt.subplots(1, len(panels), figsize=(7.0 * len(panels), 5.2), squeeze=False)
    for ax, name in zip(axes[0], panels):
        mine = [r for r in rows if panel(r["source"]) == name and r.get("speedup_vs_cudnn") is not None]
        floor = sorted({(r["target"], 1.0 / r["oracle_density"]) for r in mine if r.get("oracle_density")})
        if floor:
            ax.plot([t for t, _ in floor], [s for _, s in floor], "k--", label="oracle floor (1 / density)")
        for method in methods:
            # The captured panel holds two cards' rows: one line per (method, card).
            for card in ("H100", "H200"):
                pts = sorted({(r["recall"], r["speedup_vs_cudnn"]) for r in mine
                              if r["method"] == method and card in r["source"].split("[")[-1]})
                if pts:
                    color, marker = style[method]
                    label = method + (f" ({card})" if name.startswith("captured") else "")
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], "-" if card == "H200" else ":", marker=marker,
                            color=color, ms=5, label=label)
        ax.set_yscale("log")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("mean recall")
        ax.set_ylabel("speedup vs cuDNN SDPA (end to end)")
        ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle("Fastest setting per method at mean recall 0.90 and 0.95, against cuDNN SDPA of the same run")
    fig.tight_layout()
    return _save(fig, out / "equal-recall-h200.png", dpi=100)


def _passkey_cells(data: Any) -> list[dict[str, Any]]:
    """The cells of `sparseprefill eval passkey --json` (`{"cells": [...], ...}`), or of the
    older layout of the same run (the list of cells alone)."""
    cells: list[dict[str, Any]] = data["cells"] if isinstance(data, dict) else data
    return cells


def integration_figure(out: Path) -> Path:
    cells = _passkey_cells(_load("passkey-smollm2-h200.json"))
    methods = list(dict.fromkeys(c["method"] for c in cells))
    lengths = sorted({c["seqlen"] for c in cells})
    depths = sorted({c["depth"] for c in cells})
    fig, axes = plt.subplots(1, len(methods), figsize=(2.2 + 1.1 * len(lengths) * len(methods), 3.2), squeeze=False)
    image = None
    for col, (ax, method) in enumerate(zip(axes[0], methods)):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for c in cells:
            if c["method"] == method:
                grid[depths.index(c["depth"]), lengths.index(c["seqlen"])] = c["correct"] / c["trials"]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_title(method)
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths] if col == 0 else [])
        ax.set_xlabel("prompt length")
        if col == 0:
            ax.set_ylabel("needle depth")
    fig.colorbar(image, ax=axes[0].tolist(), label="passkey accuracy")
    path = out / "passkey-h200.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _bytes_vs_ring(res: dict[str, Any], world: int) -> tuple[list[str], list[float], list[float]]:
    """Per method at `world` ranks: its name (`*`: the estimate gathers q and k), K/V bytes
    fetched and estimate bytes, each over ring attention's. From `sparseprefill bench
    distributed --json` (its one-process bytes rows: no estimate traffic, which only the
    torchrun modes move) or the older layout of the same run (`methods`, with the estimate
    bytes of its gloo runs)."""
    names, kv, est = [], [], []
    if "rows" in res:
        for row in res["rows"]:
            extra = row.get("extra") or {}
            if row.get("suite") == "distributed" and extra.get("world") == world and "kv_vs_ring" in extra:
                names.append(row["method"] + ("*" if extra.get("estimate") == "gather" else ""))
                kv.append(extra["kv_vs_ring"])
                est.append(0.0)
        return names, kv, est
    for name, entry in res["methods"].items():
        row = entry["summary_all_layers"][str(world)]
        names.append(name + ("*" if entry["estimate"] == "gather" else ""))
        kv.append(row["kv_vs_ring"])
        est.append(row.get("estimate_vs_ring", 0.0))
    return names, kv, est


def distributed_figure(out: Path) -> Path:
    from sparseprefill import distributed as dist
    from sparseprefill.methods import METHODS

    world, rank = 4, 1
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8), gridspec_kw={"width_ratios": [1, 1, 1.2]})
    n = 256
    layout = dist.ZigZagLayout(n, world, 1)
    owner = layout.owner().numpy()
    img = np.full((n, n), np.nan)
    r, c = np.tril_indices(n)
    img[r, c] = owner[r]
    axes[0].imshow(img, cmap=matplotlib.colors.ListedColormap(plt.cm.tab10.colors[:world]), interpolation="nearest")
    work = [sum((e * (e + 1) - s * (s + 1)) // 2 for s, e in layout.rank_chunks(i)) for i in range(world)]
    for s, _ in layout.chunks[1:]:
        axes[0].axhline(s - 0.5, color="white", lw=0.6)
    axes[0].set_title(f"zig-zag split, {world} ranks\nrank r: chunks r and {2 * world - 1}-r; causal work "
                      f"{min(work) / sum(work):.1%}-{max(work) / sum(work):.1%} each", fontsize=8)
    axes[0].set_xlabel("key")
    axes[0].set_ylabel("query (colour: rank computing the row)")

    n = 2048
    q, k, _ = _demo_qkv(n, heads=1)
    spec = METHODS["vertical_slash"]
    plan = spec.plan_fn("reference")(q, k, **spec.demo_params(n))
    split = dist.split_plan(plan, dist.ZigZagLayout(n, world, 128), rank)
    own = (np.nan_to_num(plan_image(split.own, size=256)) > 0).astype(float)
    remote = (np.nan_to_num(plan_image(split.remote, size=256)) > 0).astype(float)
    rgb = np.ones((*own.shape, 3)) - own[..., None] * np.array([0.9, 0.5, 0.0]) - remote[..., None] * np.array(
        [0.0, 0.8, 0.8])
    axes[1].imshow(rgb.clip(0, 1), interpolation="nearest")
    need = dist.needed_keys(split.remote, k.shape[1])[0, 0].numpy()
    axes[1].set_title(f"rank {rank}'s rows, vertical-slash, the demo's workload (N = {n})\n"
                      f"pixels with a kept key: blue held, red fetched ({need.mean():.0%} of the keys)", fontsize=8)
    axes[1].set_xlabel("key")
    for ax in axes[:2]:
        ax.set_xticks([])
        ax.set_yticks([])

    names, kv, est = _bytes_vs_ring(_load("distributed-bytes-smollm2-8k-cpu.json"), world)
    y = np.arange(len(names))
    axes[2].barh(y, kv, color="tab:red", label="K/V rows fetched")
    axes[2].barh(y, est, left=kv, color="tab:gray", alpha=0.6, label="estimate")
    axes[2].axvline(1.0, color="black", lw=0.8, ls="--")
    axes[2].text(1.0, len(names) - 0.4, " dense ring", fontsize=7)
    axes[2].set_yticks(y, names, fontsize=7)
    axes[2].invert_yaxis()
    axes[2].set_xlim(0, max(1.6, max(a + b for a, b in zip(kv, est)) * 1.05))
    axes[2].set_xlabel(f"bytes moved / ring attention's, {world} ranks, 3 layers")
    axes[2].set_title("SmolLM2 N = 8192, demo parameters\n* estimate all-gathers q and k", fontsize=8)
    axes[2].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return _save(fig, out / "distributed.png", dpi=120)


PAGES: dict[str, list[Figure]] = {
    "dense": [dense_masks],
    "streaming": [streaming_masks],
    "minference": [minference_masks],
    "sample_attention": [sample_attention_masks, sample_attention_figure],
    "xattention": [xattention_masks, xattention_figure],
    "anchor_attention": [anchor_attention_masks, anchor_attention_figure],
    "delta_kv": [delta_kv_masks],
    "headwise": [headwise_masks],
    "delta_xattention": [delta_xattention_masks, delta_xattention_figure],
    "shareprefill": [shareprefill_figures],
    "compare": [compare_figure],
    "calibrate": [calibrate_figures],
    "workload": [workload_figure],
    "integration": [integration_figure],
    "distributed": [distributed_figure],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", help=f"'all' or any of: {', '.join(PAGES)}")
    parser.add_argument("--out", type=Path, default=IMG, help="folder for the PNGs (default docs/img)")
    parser.add_argument("--list", action="store_true", help="list the pages and their figure functions")
    args = parser.parse_args(argv)
    if args.list:
        for page, figures in PAGES.items():
            print(f"{page}: {', '.join(f.__name__ for f in figures)}")
        return 0
    pages = list(PAGES) if args.pages == ["all"] else args.pages
    unknown = [p for p in pages if p not in PAGES]
    if unknown or not pages:
        parser.error(f"pages must be 'all' or among {', '.join(PAGES)}; got {unknown or 'nothing'}")
    for page in pages:
        for figure in PAGES[page]:
            print(f"{page}: {figure(args.out)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
