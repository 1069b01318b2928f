"""`dpxa`: DPXA's tile scoring / selection / kernel split, beside cuDNN SDPA.

As the `xattention` suite (`xattention.tile_rows`), with DPXA's scoring (anchor-pair
scores from the delta anchors of Q and K): cosine thresholds 0.75 and 0.78 at tile
thresholds 0.9 and 0.75. `extra` adds `anchors_ms` (the delta anchors of Q and K alone)
and the measured scoring ratio `alpha * beta` (the share of a tile's score cells the
anchor pairs cover, mean over heads and tiles).
"""

from __future__ import annotations

from typing import Any

import torch

from ..common import BLOCK, Context, Suite, Unit, baseline_unit, piece
from .xattention import tile_rows

CASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("dpxa cos0.75 0.9", {"cos_threshold": 0.75, "threshold": 0.9}),
    ("dpxa cos0.75 0.75", {"cos_threshold": 0.75, "threshold": 0.75}),
    ("dpxa cos0.78 0.9", {"cos_threshold": 0.78, "threshold": 0.9}),
)


def _dpxa_extra(ctx: Context, q: torch.Tensor, k: torch.Tensor, params: dict[str, Any]) -> dict[str, Any]:
    from ... import fast
    from ...fast.kernels.delta_score import delta_anchor_lists

    cos, block = params["cos_threshold"], int(params["block"])
    anchors_ms = ctx.time(lambda: (delta_anchor_lists(q, cos_threshold=cos, block=block),
                                   delta_anchor_lists(k, cos_threshold=cos, block=block)))
    ratio = float(fast.dpxa_scoring_ratio(q, k, cos_threshold=cos, block=block).mean())
    return {"anchors_ms": anchors_ms, "scoring_ratio": ratio}


def estimate_floor(params: dict[str, Any], q: torch.Tensor, k: torch.Tensor, dense_ms: float) -> float | None:
    """The `estimates` suite's floor of DPXA's plan: its anchor pairs' multiply-adds at the dense
    rate, the measured scoring ratio `alpha * beta` times dense."""
    from ... import fast

    ratio = fast.dpxa_scoring_ratio(q, k, cos_threshold=params.get("cos_threshold", 0.75),
                                    block=int(params.get("block", 128)))
    return float(ratio.mean()) * dense_ms


def units(ctx: Context, seqlens: list[int], *, block: int | None = None) -> list[Unit]:
    from ... import fast

    size = block or (128 if ctx.on_gpu else 32)
    out: list[Unit] = []
    for n in seqlens:
        out.append(baseline_unit(ctx, n))
        for label, params in CASES:
            out.append(piece(ctx, label, n, tile_rows, ctx, n, label, params, block=size,
                             weights_fn=fast.dpxa_tile_weights, run_fn=fast.dpxa, extra_stages=_dpxa_extra))
    return out


SUITE = Suite(
    name="dpxa",
    about="DPXA: delta anchors / tile scoring / selection / kernel split at cosine 0.75 and 0.78",
    seqlens=(32768, 131072),
    units=units,
    options=(BLOCK,),
)
