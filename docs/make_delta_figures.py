"""Draw docs/img/delta_kv.png: the two phases of Delta-KV on a small example.

    python docs/make_delta_figures.py

Keys that drift slowly (runs of similar keys), N = 512, chunks of 128, packed blocks
and query blocks of 32; the reference estimator decides everything.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from sparseprefill import reference  # noqa: E402
from sparseprefill.reference.delta_kv import safe_blocks  # noqa: E402

IMG = Path(__file__).resolve().parent / "img"
N, D, CHUNK, BLOCK = 512, 16, 128, 32


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(1, 1, N // 8 + 1, D, generator=gen).repeat_interleave(8, dim=2)[:, :, :N]
    k = (base + 0.25 * torch.randn(1, 1, N, D, generator=gen)).to(torch.float32)
    v = torch.randn(1, 1, N, D, generator=gen)
    keep = reference.delta_keep_mask(k, threshold=2.0, chunk=CHUNK)
    packed = reference.delta_pack(k, v, keep, block=BLOCK)
    _, cut = safe_blocks(packed, block_m=BLOCK)
    rows = np.arange(N)[:, None]
    keys = np.arange(N)[None, :]
    cut_of_row = cut[0, 0].numpy()[rows // BLOCK]
    # 2: exact (phase 2); 1: read through its anchor (phase 1); 0: future (causal mask).
    image = np.where(keys > rows, 0, np.where(keys >= cut_of_row, 2, 1))
    fig, (ax_m, ax_k) = plt.subplots(2, 1, figsize=(6.2, 7.2), gridspec_kw={"height_ratios": [6, 1]})
    cmap = matplotlib.colors.ListedColormap(["white", "#9ecae1", "#08519c"])
    ax_m.imshow(image, cmap=cmap, vmin=0, vmax=2, interpolation="nearest")
    ax_m.set_title(f"Delta-KV, N = {N}: phase 1 (light: packed anchors, {int(packed.lengths[0, 0])} of {N} "
                   f"keys)\nphase 2 (dark: the critical diagonal, exact)", fontsize=9)
    ax_m.set_xlabel("key position")
    ax_m.set_ylabel("query row")
    for b in range(0, N, BLOCK):
        ax_m.axhline(b - 0.5, color="grey", lw=0.3)
    anchors = keep[0, 0].numpy().astype(float)
    ax_k.imshow(anchors[None, :], aspect="auto", cmap="Greys", interpolation="nearest")
    ax_k.set_yticks([])
    ax_k.set_title(f"anchors (black) of the keep mask: chunks of {CHUNK}, Euclidean threshold 2.0", fontsize=9)
    for c in range(0, N, CHUNK):
        ax_k.axvline(c - 0.5, color="red", lw=0.8)
    fig.tight_layout()
    IMG.mkdir(exist_ok=True)
    fig.savefig(IMG / "delta_kv.png", dpi=110)
    print(IMG / "delta_kv.png")


if __name__ == "__main__":
    main()
