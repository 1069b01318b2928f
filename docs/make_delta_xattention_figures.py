"""Draw docs/img/delta_xattention.png: DeltaXAttention's tile modes on the demo's workload.

    python docs/make_delta_xattention_figures.py

One head of `sparseprefill.demo.synthetic_qkv` at N = 2048 whose keys are made
redundant (each key mostly a copy of the first of its run, runs of random length, shorter
along the sequence, as adjacent keys are in real models; the demo's own keys barely
repeat), 64-token tiles, stride 8,
threshold 0.9: XAttention's kept tiles, then DeltaXAttention's split (dark: exact,
light: packed through the tile's anchors, white: skipped) for `exact_top` 0.1 and 0,
and the `unselected="packed"` variant; below, the anchors of the per-tile packing
(cosine 0.83). The reference decides everything; CPU, under a minute.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from sparseprefill import reference  # noqa: E402
from sparseprefill.demo import Shape, synthetic_qkv  # noqa: E402
from sparseprefill.reference.delta_xattention import EXACT, PACKED  # noqa: E402

IMG = Path(__file__).resolve().parent / "img"
N, BLOCK, THRESHOLD, COSINE, HEAD = 2048, 64, 0.9, 0.83, 1


def main() -> None:
    q, k, v = synthetic_qkv(Shape(1, 4, 1, N, 64, torch.float32), device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    starts = torch.rand(N, generator=gen) < torch.linspace(0.1, 0.6, N)  # runs shorten along the sequence
    starts[0] = True
    first = torch.where(starts, torch.arange(N), 0).cummax(0).values
    k = 0.9 * k[:, :, first] + 0.1 * k
    packing = reference.delta_tile_pack(k, v, delta_threshold=COSINE, metric="cosine", block=BLOCK,
                                        packed_block=16)
    cases = [("XAttention (all selected tiles exact)", 1.0, "skip"),
             ("DeltaXAttention, exact_top 0.1 (tw10)", 0.1, "skip"),
             ("DeltaXAttention, exact_top 0 (diag kept)", 0.0, "skip"),
             ("unselected='packed' (not in the thesis)", 0.1, "packed")]
    cmap = matplotlib.colors.ListedColormap(["white", "#9ecae1", "#08519c"])
    fig = plt.figure(figsize=(16, 6.0))
    grid = fig.add_gridspec(2, len(cases), height_ratios=[8, 1])
    for col, (title, top, unselected) in enumerate(cases):
        modes = reference.delta_xattention_tiles(q, k, threshold=THRESHOLD, exact_top=top, block=BLOCK,
                                                 unselected=unselected)
        red = float(reference.delta_xattention_kv_reduction(modes, packing)[0, HEAD])
        dens = float(reference.delta_xattention_density(modes, packing)[0, HEAD])
        m = modes[0, HEAD].numpy().astype(float)
        m[np.triu_indices(m.shape[0], 1)] = np.nan
        ax = fig.add_subplot(grid[0, col])
        ax.imshow(m, cmap=cmap, vmin=0, vmax=2, interpolation="nearest")
        exact = int((modes[0, HEAD] == EXACT).sum())
        packed = int((modes[0, HEAD] == PACKED).sum())
        ax.set_title(f"{title}\n{exact} exact, {packed} packed tiles; KV red. {red:.1%}, density {dens:.1%}",
                     fontsize=8)
        ax.set_xlabel("key tile")
        if col == 0:
            ax.set_ylabel("query tile")
    ax_k = fig.add_subplot(grid[1, :])
    anchors = packing.anchors()[0, 0].numpy()
    ax_k.bar(np.arange(len(anchors)), anchors / BLOCK, color="#08519c", width=1.0)
    ax_k.set_xlim(-0.5, N // BLOCK - 0.5)
    ax_k.set_ylim(0, 1)
    ax_k.set_ylabel("anchors / keys", fontsize=7)
    ax_k.set_title(f"per-tile packing (cosine {COSINE}): keep ratio of every key tile "
                   f"({float(packing.keep_ratio()[0, 0]):.1%} overall; the last tile is never packed)", fontsize=8)
    fig.suptitle(f"N = {N}, {BLOCK}-token tiles, stride 8, threshold {THRESHOLD}, query head {HEAD}: "
                 "dark = exact, light = packed anchors with log-count bias, white = skipped", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95), h_pad=2.5)
    IMG.mkdir(exist_ok=True)
    fig.savefig(IMG / "delta_xattention.png", dpi=110)
    print(IMG / "delta_xattention.png")


if __name__ == "__main__":
    main()
