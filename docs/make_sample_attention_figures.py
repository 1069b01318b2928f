"""Draw the SampleAttention figure under docs/img/ (run from the repository root).

    python docs/make_sample_attention_figures.py

A synthetic head with the paper's composed pattern (Figure 4(c)): attention sinks,
a local window, diagonals every 400 tokens, and a heavy key column that only the
first half of the queries attend to (it "fades in the lower half"). Then the plans
of `reference.sample_attention_plan` with `chunk_n = 1` (only the last block of
queries is sampled, so the fading column is missed) and `chunk_n = 2` (the last
block of the first half is sampled too, and the column is kept over the whole
matrix). CPU, a few seconds.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from sparseprefill import reference
from sparseprefill._viz import attention_image, plan_image, save_mask_figure

IMG = Path(__file__).resolve().parent / "img"
N, D, PERIOD, BLOCK = 2048, 64, 400, 64
FADING_KEY = 300


def synthetic_head() -> tuple[torch.Tensor, torch.Tensor]:
    """q, k `[1, 1, N, D]`: sinks, local window, slashes every PERIOD, a column for rows < N/2."""
    gen = torch.Generator().manual_seed(0)
    pos = torch.arange(N, dtype=torch.float64)
    q = torch.zeros(N, D, dtype=torch.float64)
    k = torch.zeros(N, D, dtype=torch.float64)
    q[:, 18:] = torch.randn(N, D - 18, generator=gen, dtype=torch.float64)
    k[:, 18:] = torch.randn(N, D - 18, generator=gen, dtype=torch.float64)
    for j in range(8):  # q_r . k_c gains sum_j cos(w_j (r - c)): peaks at r - c = 0, PERIOD, ...
        w = 2 * math.pi * (j + 1) / PERIOD
        q[:, 2 * j] += 8 * torch.cos(w * pos)
        q[:, 2 * j + 1] += 8 * torch.sin(w * pos)
        k[:, 2 * j] += torch.cos(w * pos)
        k[:, 2 * j + 1] += torch.sin(w * pos)
    q[:, 16] += 48.0
    k[:4, 16] += 1.0  # sinks
    q[: N // 2, 17] += 80.0
    k[FADING_KEY, 17] += 1.0  # the column only the first half of the queries see
    return q[None, None], k[None, None]


def main() -> None:
    q, k = synthetic_head()
    panels = [("attention (log scale)", attention_image(q[0, 0], k[0, 0], size=256))]
    for chunk_n in (1, 2):
        plan = reference.sample_attention_plan(q, k, alpha_c=0.95, alpha_s=0.95, chunk_n=chunk_n,
                                               block_size=BLOCK)
        recall = float(reference.recall(q, k, plan).mean())
        panels.append((f"chunk_n = {chunk_n}: density {float(reference.density(plan)[0, 0]):.1%}\n"
                       f"recall {recall:.3f}", plan_image(plan, size=256)))
    save_mask_figure(panels, IMG / "sample_attention.png",
                     title=f"N = {N}, alpha_c = alpha_s = 0.95, {BLOCK}-token blocks: column blocks + "
                           "block diagonals")


if __name__ == "__main__":
    main()
