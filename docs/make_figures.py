"""Draw the figures under docs/img/ (run from the repository root).

    python docs/make_figures.py

Uses only the reference estimators and `sparseprefill._viz`, on CPU, in seconds.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sparseprefill import reference
from sparseprefill._viz import mask_image, plan_image, save_mask_figure

IMG = Path(__file__).resolve().parent / "img"
N, BLOCK_M, BLOCK_N = 2048, 128, 64
SINK, WINDOW = 100, 300


def main() -> None:
    # Estimators read only the shapes of q and k.
    q = torch.zeros(1, 1, N, 16)
    k = torch.zeros(1, 1, N, 16)

    dense = reference.dense_plan(q, k, block_m=BLOCK_M, block_n=BLOCK_N)
    save_mask_figure([(f"dense_plan, N = {N}\n{BLOCK_M} x {BLOCK_N} blocks", plan_image(dense, size=256))],
                     IMG / "dense.png")

    rows = torch.arange(N)[:, None]
    keys = torch.arange(N)[None, :]
    token_mask = (keys <= rows) & ((keys < SINK) | (keys > rows - WINDOW))
    plan = reference.streaming_plan(q, k, sink=SINK, window=WINDOW, block_m=BLOCK_M, block_n=BLOCK_N)
    share = float(reference.density(plan)[0, 0])
    token_share = float(reference.density(token_mask[None, None])[0, 0])
    save_mask_figure(
        [
            (f"token level: sink {SINK}, window {WINDOW}\ndensity {token_share:.1%}",
             mask_image(token_mask, size=256)),
            (f"streaming_plan ({BLOCK_M} x {BLOCK_N} blocks)\ndensity {share:.1%}",
             plan_image(plan, size=256)),
        ],
        IMG / "streaming.png",
        title=f"N = {N}: the token-level A-shape and the block-rounded plan the kernel runs",
    )


if __name__ == "__main__":
    main()
