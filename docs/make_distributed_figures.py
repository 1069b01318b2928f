"""Draw docs/img/distributed.png (run from the repository root, after benches/distributed_bytes.py).

    python docs/make_distributed_figures.py --qkv /work/captures/qkv_smollm2_8k.pt \\
        --json benches/results/cpu-distributed-2026-11-23.json

Left: the zig-zag split of the causal square over 4 ranks (rows coloured by the rank
that computes them). Middle: one rank's rows of a vertical-slash plan on captured
SmolLM2 attention, keys it holds against keys it fetches. Right: bytes each method
moves over 4 ranks against a dense ring, from the JSON.
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from sparseprefill import distributed as D  # noqa: E402
from sparseprefill._viz import plan_image  # noqa: E402
from sparseprefill.methods import METHODS  # noqa: E402

WORLD = 4
RANK = 1


def zigzag_panel(ax: plt.Axes) -> None:
    n = 256
    layout = D.ZigZagLayout(n, WORLD, 1)
    owner = layout.owner().numpy()
    img = np.full((n, n), np.nan)
    rows, cols = np.tril_indices(n)
    img[rows, cols] = owner[rows]
    ax.imshow(img, cmap=matplotlib.colors.ListedColormap(plt.cm.tab10.colors[:WORLD]), interpolation="nearest")
    work = [sum((e * (e + 1) - s * (s + 1)) // 2 for s, e in layout.rank_chunks(r)) for r in range(WORLD)]
    for s, _ in layout.chunks[1:]:
        ax.axhline(s - 0.5, color="white", lw=0.6)
    ax.set_title(f"zig-zag split, {WORLD} ranks\nrank r: chunks r and {2 * WORLD - 1}-r; causal work "
                 f"{min(work) / sum(work):.1%}-{max(work) / sum(work):.1%} each", fontsize=8)
    ax.set_xlabel("key")
    ax.set_ylabel("query (colour: rank computing the row)")
    ax.set_xticks([])
    ax.set_yticks([])


def plan_panel(ax: plt.Axes, qkv: str) -> None:
    data = torch.load(qkv)
    li = data["layers"].index(14)
    q, k = data["q"][li], data["k"][li]
    n = q.shape[2]
    spec = METHODS["vertical_slash"]
    plan = spec.plan_fn("reference")(q, k, **spec.demo_params(n))
    rp = D.split_plan(plan, D.ZigZagLayout(n, WORLD, 128), RANK)
    # A pixel is coloured if it holds any kept key (single columns would vanish as shares).
    own = (np.nan_to_num(plan_image(rp.own, size=256)) > 0).astype(float)
    remote = (np.nan_to_num(plan_image(rp.remote, size=256)) > 0).astype(float)
    rgb = np.ones((*own.shape, 3))
    rgb -= own[..., None] * np.array([0.9, 0.5, 0.0])
    rgb -= remote[..., None] * np.array([0.0, 0.8, 0.8])
    ax.imshow(rgb.clip(0, 1), interpolation="nearest")
    need = D.needed_keys(rp.remote, k.shape[1])[0, 0].numpy()
    ax.set_title(f"rank {RANK}'s rows, vertical-slash, SmolLM2 layer 14 head 0 (N = {n})\n"
                 f"pixels with a kept key: blue held, red fetched ({need.mean():.0%} of the keys, KV head 0)",
                 fontsize=8)
    ax.set_xlabel("key")
    ax.set_xticks([])
    ax.set_yticks([])


def bytes_panel(ax: plt.Axes, path: str) -> None:
    with open(path) as fh:
        res = json.load(fh)
    names, kv, est = [], [], []
    for name, entry in res["methods"].items():
        row = entry["summary_all_layers"][str(WORLD)]
        names.append(name + ("*" if entry["estimate"] == "gather" else ""))
        kv.append(row["kv_vs_ring"])
        est.append(row.get("estimate_vs_ring", 0.0))
    y = np.arange(len(names))
    ax.barh(y, kv, color="tab:red", label="K/V rows fetched")
    ax.barh(y, est, left=kv, color="tab:gray", alpha=0.6, label="estimate")
    ax.axvline(1.0, color="black", lw=0.8, ls="--")
    ax.text(1.0, len(names) - 0.4, " dense ring", fontsize=7)
    ax.set_yticks(y, names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, max(1.6, max(k + e for k, e in zip(kv, est)) * 1.05))
    ax.set_xlabel(f"bytes moved / ring attention's, {WORLD} ranks, 3 layers")
    ax.set_title("SmolLM2 N = 8192, demo parameters\n* estimate all-gathers q and k", fontsize=8)
    ax.legend(fontsize=7, loc="upper right")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--qkv", default="/work/captures/qkv_smollm2_8k.pt")
    parser.add_argument("--json", default="benches/results/cpu-distributed-2026-11-23.json")
    parser.add_argument("--png", default="docs/img/distributed.png")
    args = parser.parse_args()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8), gridspec_kw={"width_ratios": [1, 1, 1.2]})
    zigzag_panel(axes[0])
    plan_panel(axes[1], args.qkv)
    bytes_panel(axes[2], args.json)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print("wrote", args.png)


if __name__ == "__main__":
    main()
