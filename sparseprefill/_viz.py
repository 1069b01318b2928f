"""Pictures of attention masks: plans and dense masks drawn as kept-share images.

A picture is `size x size` pixels whatever N is: pixel `(p, c)` shows the share of
keys in column bin `c` that the centre row of row bin `p` keeps, so a 128K-token
plan is drawn from its block lists without ever building the `[N, N]` mask.
Pixels wholly above the causal diagonal are NaN and drawn grey.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from .reference.plan import BlockColumnPlan


def _bins(seqlen: int, size: int) -> torch.Tensor:
    """Bin edges `[R + 1]` splitting `[0, N)` into `R = min(size, N)` near-equal bins."""
    r = max(1, min(size, seqlen))
    return torch.div(torch.arange(r + 1, dtype=torch.int64) * seqlen, r, rounding_mode="floor")


def _pool(keys: torch.Tensor, edges: torch.Tensor) -> np.ndarray:
    """Turn the kept keys of each pixel row, bool `[R, N]`, into kept shares `[R, R]`.

    Row `p` is the centre row of row bin `p`; keys after it are not causal, and a pixel
    whose first key is after it is NaN.
    """
    centres = (edges[:-1] + edges[1:] - 1) // 2
    n = keys.shape[1]
    causal = torch.arange(n)[None, :] <= centres[:, None]
    kept = (keys & causal).to(torch.int32)
    cum = torch.nn.functional.pad(kept.cumsum(dim=1), (1, 0))
    counts = cum[:, edges[1:]] - cum[:, edges[:-1]]
    share = counts.to(torch.float64) / (edges[1:] - edges[:-1]).to(torch.float64)[None, :]
    share = torch.where(edges[:-1][None, :] > centres[:, None], torch.nan, share)
    return share.numpy()


def plan_image(plan: BlockColumnPlan, *, batch: int = 0, head: int = 0, size: int = 512) -> np.ndarray:
    """Kept-share image of one (batch row, query head) of a plan (a head the plan marks
    dense drawn as full causal attention, whatever its lists say).

    Args:
        plan: any valid `BlockColumnPlan`.
        batch, head: which batch row and query head to draw.
        size: pixels per side (at most N).

    Returns:
        float64 `[R, R]` with `R = min(size, N)`: values in `[0, 1]`, NaN above the
        diagonal.

    Raises:
        IndexError: `batch` or `head` out of range.
    """
    if not (0 <= batch < plan.batch and 0 <= head < plan.num_heads):
        raise IndexError(f"batch={batch}, head={head} outside a plan of {plan.batch} x {plan.num_heads}")
    one = BlockColumnPlan(
        seqlen=plan.seqlen,
        block_m=plan.block_m,
        block_n=plan.block_n,
        block_count=plan.block_count[batch : batch + 1, head : head + 1],
        block_index=plan.block_index[batch : batch + 1, head : head + 1],
        column_count=plan.column_count[batch : batch + 1, head : head + 1],
        column_index=plan.column_index[batch : batch + 1, head : head + 1],
        column_group=plan.column_group,
        dense_heads=(0,) if head in plan.dense_heads else (),
    ).to("cpu")
    n = plan.seqlen
    per_block = one.block_mask()[0, 0].repeat_interleave(plan.block_n, dim=1)[:, :n]
    per_block = per_block | one.column_mask()[0, 0]
    edges = _bins(n, size)
    centres = (edges[:-1] + edges[1:] - 1) // 2
    return _pool(per_block[centres // plan.block_m], edges)


def mask_image(mask: torch.Tensor, *, size: int = 512) -> np.ndarray:
    """Kept-share image of a dense bool mask `[N, N]` (see `plan_image`).

    Raises:
        ValueError: `mask` is not a square rank-2 bool tensor.
    """
    if mask.dim() != 2 or mask.shape[0] != mask.shape[1] or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool [N, N] tensor, got {mask.dtype} {tuple(mask.shape)}")
    edges = _bins(mask.shape[0], size)
    centres = (edges[:-1] + edges[1:] - 1) // 2
    return _pool(mask.cpu()[centres], edges)


def save_mask_figure(
    panels: Sequence[tuple[str, np.ndarray]],
    path: str | Path,
    *,
    title: str | None = None,
    columns: int = 4,
    seqlen: int | None = None,
) -> Path:
    """Draw kept-share images side by side and save them as a PNG.

    Args:
        panels: (panel title, image from `plan_image` or `mask_image`) pairs.
        path: where to write the PNG; parent folders are created.
        title: figure title, or None.
        columns: panels per row.
        seqlen: N, to label the axes in token positions (pixel indices otherwise).

    Returns:
        The path written.

    Raises:
        ValueError: no panels.
    """
    if not panels:
        raise ValueError("panels must not be empty")
    import matplotlib

    # Agg renders without a display, as on CI machines and GPU servers.
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ncols = min(columns, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 3.5 * nrows), squeeze=False,
                             layout="constrained")
    cmap = matplotlib.colormaps["Blues"].copy()
    cmap.set_bad("#dddddd")
    for ax, (name, image) in zip(axes.flat, panels):
        ax.imshow(np.ma.masked_invalid(image), cmap=cmap, vmin=0.0, vmax=1.0,
                  interpolation="nearest")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        pixels = image.shape[0]
        ticks = np.linspace(0, pixels - 1, 3)
        labels = [str(int(round(t * (seqlen or pixels) / pixels))) for t in ticks]
        labels[-1] = str(seqlen if seqlen is not None else pixels)
        ax.set_xticks(ticks, labels, fontsize=7)
        ax.set_yticks(ticks, labels, fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def attention_image(q: torch.Tensor, k: torch.Tensor, *, size: int = 512, floor: float = 1e-4) -> np.ndarray:
    """Causal attention of one head on a log scale, as an image in `[0, 1]`.

    Only the centre row of each row bin is computed (float32, `[R, N]` scores), so
    this is cheap at any N.

    Args:
        q, k: `[N, D]`, one query head and its KV head.
        size: pixels per side (at most N).
        floor: attention share drawn as 0; 1 is drawn as 1, log-linear between.

    Returns:
        float64 `[R, R]`: per pixel, the summed attention probability of its keys, log
        scaled; NaN above the diagonal.
    """
    n, d = k.shape
    edges = _bins(n, size)
    centres = (edges[:-1] + edges[1:] - 1) // 2
    scores = (q[centres.to(q.device)].float() @ k.float().T) / math.sqrt(d)
    causal = torch.arange(n, device=k.device)[None, :] <= centres.to(k.device)[:, None]
    probs = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1).double().cpu()
    cum = torch.nn.functional.pad(probs.cumsum(dim=1), (1, 0))
    mass = (cum[:, edges[1:]] - cum[:, edges[:-1]]).clamp(min=floor)
    image = (torch.log10(mass) - math.log10(floor)) / -math.log10(floor)
    image = torch.where(edges[:-1][None, :] > centres[:, None], torch.nan, image)
    return image.numpy()
