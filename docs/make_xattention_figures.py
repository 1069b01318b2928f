"""Draw the XAttention / DPXA tile-mask figures under docs/img/ (run from the repository root).

    python docs/make_xattention_figures.py

One head of the demo's workload (`sparseprefill.demo.synthetic_qkv`: sinks, local
decay, slashes, vertical stripes) at N = 2048 with 64-token tiles; the tile weights
of each scorer (what `xattention_tile_weights` / `dpxa_tile_weights` return, log
scale) beside the tiles `select_tiles` keeps at threshold 0.9, with density and
recall in the titles. CPU, reference backend, about a minute.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from sparseprefill import reference
from sparseprefill._viz import attention_image, plan_image, save_mask_figure
from sparseprefill.demo import Shape, synthetic_qkv

IMG = Path(__file__).resolve().parent / "img"
N, BLOCK, THRESHOLD = 2048, 64, 0.9


def weight_image(weights: torch.Tensor, size: int = 256, floor: float = 1e-4) -> np.ndarray:
    """Tile weights `[T, T]` of one head, log scaled to `[0, 1]`, one pixel block per tile."""
    w = weights.double().clamp(min=floor).log10()
    img = ((w - math.log10(floor)) / -math.log10(floor)).numpy()
    t = weights.shape[0]
    img[np.triu_indices(t, 1)] = np.nan
    rep = max(1, size // t)
    return np.kron(img, np.ones((rep, rep)))


def main() -> None:
    q, k, _ = synthetic_qkv(Shape(1, 4, 1, N, 64, torch.float32), device=torch.device("cpu"))
    head = 1
    attention = attention_image(q[0, head], k[0, 0], size=256)
    cases = [
        ("xattention", "XAttention, stride 8 (antidiagonal)", {"stride": 8}, "Score% 12.5"),
        ("xattention", "naive stride 4 (ablation)", {"stride": 4, "scoring": "naive"}, "Score% 6.3"),
        ("dpxa", "DPXA, cos 0.75", {"cos_threshold": 0.75}, None),
    ]
    panels = [("attention, one head (log scale)", attention)]
    for method, label, params, score in cases:
        weights_fn = getattr(reference, f"{method}_tile_weights")
        plan_fn = getattr(reference, f"{method}_plan")
        weights = weights_fn(q, k, block=BLOCK, **params)
        plan = plan_fn(q, k, block=BLOCK, threshold=THRESHOLD, **params)
        recall = float(reference.recall(q, k, plan)[0, head].mean())
        density = float(reference.density(plan)[0, head])
        if score is None:
            ratio = float(reference.dpxa_scoring_ratio(q, k, block=BLOCK, **params)[0, head])
            score = f"Score% {100 * ratio:.1f}"
        panels.append((f"{label}\ntile weights (log), {score}", weight_image(weights[0, head])))
        panels.append((f"kept tiles at threshold {THRESHOLD}\ndensity {density:.1%}, recall {recall:.3f}",
                       plan_image(plan, head=head, size=256)))
    save_mask_figure(panels[:3], IMG / "xattention.png", columns=3,
                     title=f"N = {N}, {BLOCK}-token tiles: antidiagonal tile weights and the greedy selection")
    save_mask_figure([panels[0], *panels[3:]], IMG / "dpxa.png", columns=5,
                     title=f"N = {N}: naive stride-4 sampling and DPXA's delta anchors (same greedy rule)")


if __name__ == "__main__":
    main()
