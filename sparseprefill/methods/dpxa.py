"""DPXA (delta-based tile scoring, DeltaAttention thesis sec. 4.3) as a method descriptor."""

from __future__ import annotations

from typing import Any

import torch

from .. import fast, reference
from ..reference.dpxa import check_dpxa_params
from ..reference.plan import BlockColumnPlan, cdiv
from ._common import EVIDENCE_BLOCK, TILE_CALIBRATION, TILE_SWEEP, keyword_check, tile_block, tile_grid, tiles_computed
from ._core import Ablation, Method, MethodView, SyncStatus, register


def grid_anchor_plan(q: torch.Tensor, k: torch.Tensor, *, anchor_period: int, threshold: float,
                     block: int = EVIDENCE_BLOCK, scale: float | None = None) -> BlockColumnPlan:
    """DPXA's tile scores on a fixed grid of anchors (the first token of every `anchor_period`
    inside each tile) instead of delta anchors: the thesis's question "content-adaptive anchors
    or grid sampling?" with everything else equal."""
    from ..reference.dpxa import anchor_tile_scores
    from ..reference.xattention import normalize_rows, tiles_to_plan

    n = q.shape[2]
    on_grid = torch.arange(n, device=q.device) % block % anchor_period == 0
    sm = q.shape[-1] ** -0.5 if scale is None else float(scale)
    scores = anchor_tile_scores(q, k, on_grid.expand(*q.shape[:3]), on_grid.expand(*k.shape[:3]),
                                block=block, scale=sm)
    return tiles_to_plan(reference.select_tiles(normalize_rows(scores), threshold), seqlen=n, block=block)


def extras(impl_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: dict[str, Any],
           view: MethodView) -> dict[str, float]:
    """Tiles computed and the scoring ratio `alpha * beta` (thesis 4.3), measured per head."""
    block = int(params.get("block", 128))
    if "anchor_period" in params:
        ratio = (cdiv(block, int(params["anchor_period"])) / block) ** 2
    else:
        impl: Any = fast if impl_name == "fast" else reference
        ratio = float(impl.dpxa_scoring_ratio(q, k, cos_threshold=params.get("cos_threshold", 0.75),
                                              block=block).mean())
    return {"tiles_computed": tiles_computed(view), "scoring_ratio": ratio}


METHOD = register(Method(
    check=keyword_check(check_dpxa_params),
    name="dpxa",
    knobs=("threshold",),
    notes="DPXA: delta anchors of Q and K per tile, anchor-pair tile scores, XAttention's greedy "
          "selection (thesis sec. 4.3)",
    reference_plan=reference.dpxa_plan,
    fast_plan=fast.dpxa_plan,
    reference_run=reference.dpxa,
    fast_run=fast.dpxa,
    defaults=lambda n: {"cos_threshold": 0.75, "threshold": 0.9, "block": tile_block(n)},
    sweep=lambda n: [{"cos_threshold": 0.75, "threshold": t, "block": tile_block(n)} for t in TILE_SWEEP],
    calibration=lambda n: [{"cos_threshold": 0.75, "threshold": t, "block": tile_block(n)}
                           for t in TILE_CALIBRATION],
    ablations=(
        *(Ablation(f"cos{c}", tile_grid(cos_threshold=c), about="delta anchors at this cosine")
          for c in (0.72, 0.75, 0.78)),
        *(Ablation(f"grid p{p}", tile_grid(anchor_period=p), reference_plan=grid_anchor_plan,
                   about="grid anchors instead of delta anchors")
          for p in (3, 4)),
    ),
    extras=extras,
    chunked="as xattention: the chunk's own tiles",
    sync=SyncStatus(syncs=("dense fallback: as xattention (the rule's [Hq] flags, one read; the early exit's "
                           "[Hq] flags, one more, where it is on)",
                           "tiles to plan: as xattention"), static_bound="as xattention",
                    note="the anchor kernel's threshold is filled on the device (a host write "
                         "`out[0] = x` would synchronise and fail capture)"),
))
