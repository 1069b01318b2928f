"""Draw the MInference figures under docs/img/ (run from the repository root).

    python docs/make_minference_figures.py

A synthetic head with the structure MInference looks for (a few heavy key
columns, diagonals every 400 tokens from RoPE-like rotations), then the plans of
`reference.vertical_slash_plan`, `reference.block_sparse_plan` and
`reference.a_shape_plan` on it. CPU, a few seconds.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from sparseprefill import reference
from sparseprefill._viz import attention_image, plan_image, save_mask_figure

IMG = Path(__file__).resolve().parent / "img"
N, D, PERIOD = 2048, 64, 400
HEAVY_KEYS = (0, 1, 2, 3, 600, 601, 1400)


def synthetic_head() -> tuple[torch.Tensor, torch.Tensor]:
    """q, k `[1, 1, N, D]` whose attention has slashes at offsets 0, 400, ... and a few columns."""
    gen = torch.Generator().manual_seed(0)
    pos = torch.arange(N, dtype=torch.float64)
    q = 0.3 * torch.randn(N, D, generator=gen, dtype=torch.float64)
    k = 0.3 * torch.randn(N, D, generator=gen, dtype=torch.float64)
    # q_r . k_c gains sum_j cos(w_j (r - c)): peaks where r - c is a multiple of PERIOD.
    for j in range(8):
        w = 2 * math.pi * (j + 1) / PERIOD
        q[:, 2 * j] += 6 * torch.cos(w * pos)
        q[:, 2 * j + 1] += 6 * torch.sin(w * pos)
        k[:, 2 * j] += torch.cos(w * pos)
        k[:, 2 * j + 1] += torch.sin(w * pos)
    q[:, 16] += 64.0
    k[list(HEAVY_KEYS), 16] += 1.0
    return q[None, None], k[None, None]


def main() -> None:
    q, k = synthetic_head()
    attention = attention_image(q[0, 0], k[0, 0], size=256)

    vs = reference.vertical_slash_plan(q, k, vertical_size=16, slash_size=24, last_q=64,
                                       block_m=64, block_n=64, init_columns=4, local_diagonals=8)
    save_mask_figure(
        [
            ("attention (log scale)", attention),
            (f"vertical_slash_plan\n(16, 24), 64 x 64 blocks, density "
             f"{float(reference.density(vs)[0, 0]):.1%}", plan_image(vs, size=256)),
        ],
        IMG / "vertical_slash.png",
        title=f"N = {N}: slashes become key blocks, leftover verticals columns",
    )
    bs = reference.block_sparse_plan(q, k, top_k=6, block_size=64)
    save_mask_figure(
        [
            ("attention (log scale)", attention),
            (f"block_sparse_plan\ntop_k 6, 64-token blocks, density "
             f"{float(reference.density(bs)[0, 0]):.1%}", plan_image(bs, size=256)),
        ],
        IMG / "block_sparse.png",
        title=f"N = {N}: top-k key blocks from mean-pooled scores",
    )
    ashape = reference.a_shape_plan(q, k, sink=64, window=256)
    save_mask_figure(
        [
            ("attention (log scale)", attention),
            (f"a_shape_plan\nsink 64, window 256, density "
             f"{float(reference.density(ashape)[0, 0]):.1%}", plan_image(ashape, size=256)),
        ],
        IMG / "a_shape.png",
        title=f"N = {N}: sink + local window, whatever the input",
    )


if __name__ == "__main__":
    main()
