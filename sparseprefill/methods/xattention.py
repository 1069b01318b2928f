"""XAttention (antidiagonal tile scoring, DeltaAttention thesis sec. 2.5) as a method descriptor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import fast, reference
from ..reference.plan import BlockColumnPlan, cdiv
from ..reference.xattention import check_xattention_params
from ._common import (
    EVIDENCE_BLOCK,
    TILE_CALIBRATION,
    TILE_EVIDENCE,
    TILE_SWEEP,
    keyword_check,
    tile_block,
    tile_grid,
    tiles_computed,
)
from ._core import Ablation, Method, MethodView, SyncStatus, register


def exact_tile_mass_plan(q: torch.Tensor, k: torch.Tensor, *, threshold: float, block: int = EVIDENCE_BLOCK,
                         scale: float | None = None) -> BlockColumnPlan:
    """XAttention's greedy rule on the ideal scorer: the true attention mass of every tile
    (summed over the query tile's rows, float64), normalised per query tile, so that the
    distance to the oracle splits into what `block`-token tiles cost and what scoring costs.

    q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`. Memory O(256 * N) per head.
    """
    import math

    b, hq, n, d = q.shape
    g = hq // k.shape[1]
    t = cdiv(n, block)
    sm = 1.0 / math.sqrt(d) if scale is None else float(scale)
    key_tile = torch.arange(n, device=q.device) // block
    mass = torch.zeros(b, hq, t, t, dtype=torch.float64, device=q.device)
    k64 = k.to(torch.float64).repeat_interleave(g, dim=1)
    for r0 in range(0, n, 256):
        r1 = min(n, r0 + 256)
        rows = torch.arange(r0, r1, device=q.device)
        s = torch.matmul(q[:, :, r0:r1].to(torch.float64), k64.transpose(-1, -2)) * sm
        p = torch.softmax(s.masked_fill(torch.arange(n, device=q.device)[None, :] > rows[:, None], -math.inf), -1)
        per_row = torch.zeros(b, hq, r1 - r0, t, dtype=torch.float64, device=q.device).index_add_(-1, key_tile, p)
        mass.index_add_(2, rows // block, per_row)
    from ..reference.xattention import normalize_rows, tiles_to_plan

    return tiles_to_plan(reference.select_tiles(normalize_rows(mass), threshold), seqlen=n, block=block)


def skip_plan(q: torch.Tensor, k: torch.Tensor, *, threshold: float, skip: float, stride: int = 8,
              block: int = EVIDENCE_BLOCK, first_tile: str = "kept", scale: float | None = None) -> BlockColumnPlan:
    """The thesis's ablation (sec. 4.2.2): XAttention's tiles with the lightest `skip` share of
    the selected off-diagonal tiles dropped (`reference.skip_tiles`, which keeps the first key
    tile); `first_tile="skippable"` is the literal reading that may drop the first tile too."""
    from ..reference.delta_xattention import rank_off_diagonal, share_of
    from ..reference.xattention import tiles_to_plan

    weights = reference.xattention_tile_weights(q, k, stride=stride, block=block, scale=scale)
    selected = reference.select_tiles(weights, threshold)
    if first_tile == "kept":
        kept = reference.skip_tiles(weights, selected, skip)
    else:
        bsz, h, t, _ = weights.shape
        order, count = rank_off_diagonal(weights, selected, first=True)
        pos = torch.arange(t * t, device=weights.device)
        dropped = (pos >= (count - share_of(skip, count)).unsqueeze(-1)) & (pos < count.unsqueeze(-1))
        gone = torch.zeros(bsz, h, t * t, dtype=torch.bool, device=weights.device).scatter_(-1, order, dropped)
        kept = selected & ~gone.view(bsz, h, t, t)
    return tiles_to_plan(kept, seqlen=q.shape[2], block=block)


def scoring_ratio(params: dict[str, Any]) -> float:
    """The share of a full tile's score cells the scoring computes (thesis "Score%"): 1/S for
    antidiagonal scoring, `(ceil(block / S) / block)^2` for naive, 1 for the exact tile mass."""
    if "stride" not in params:
        return 1.0
    stride, block = int(params["stride"]), int(params.get("block", 128))
    if params.get("scoring", "antidiagonal") == "antidiagonal":
        return 1.0 / stride
    return (cdiv(block, stride) / block) ** 2


def extras(impl_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: dict[str, Any],
           view: MethodView) -> dict[str, float]:
    return {"tiles_computed": tiles_computed(view), "scoring_ratio": scoring_ratio(params)}


SKIPS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


def skip_grid(threshold: float, first_tile: str) -> Callable[[int], list[dict[str, Any]]]:
    return lambda n: [{"stride": 8, "threshold": threshold, "skip": f, "block": EVIDENCE_BLOCK,
                       "first_tile": first_tile} for f in SKIPS]


ABLATIONS = (
    Ablation("s8", tile_grid(stride=8), about="stride 8 over the wide threshold grid"),
    Ablation("s16", tile_grid(stride=16)),
    Ablation("naive s3", tile_grid(stride=3, scoring="naive"),
             about="thesis 4.3: the first token of each group, no head-dim expansion"),
    Ablation("naive s4", tile_grid(stride=4, scoring="naive")),
    Ablation("exact tile mass", lambda n: [{"threshold": t, "block": EVIDENCE_BLOCK} for t in TILE_EVIDENCE],
             reference_plan=exact_tile_mass_plan, about="the ideal scorer for the same greedy rule"),
    *(Ablation(f"skip{t}{'' if first == 'kept' else '-literal'}", skip_grid(t, first),
               reference_plan=skip_plan, about="thesis 4.2.2: XAttention dropping its lightest tiles")
      for first in ("kept", "skippable") for t in (0.8, 0.9, 0.95)),
)


METHOD = register(Method(
    check=keyword_check(check_xattention_params),
    name="xattention",
    knobs=("threshold",),
    notes="XAttention: antidiagonal stride-level scores, row softmax summed into tiles, greedy "
          "threshold selection (thesis sec. 2.5)",
    reference_plan=reference.xattention_plan,
    fast_plan=fast.xattention_plan,
    reference_run=reference.xattention,
    fast_run=fast.xattention,
    defaults=lambda n: {"stride": 8, "threshold": 0.9, "block": tile_block(n)},
    sweep=lambda n: [{"stride": 8, "threshold": t, "block": tile_block(n)} for t in TILE_SWEEP],
    calibration=lambda n: [{"stride": 8, "threshold": t, "block": tile_block(n)} for t in TILE_CALIBRATION],
    ablations=ABLATIONS,
    extras=extras,
    chunked="each query tile's antidiagonal scores against the keys: the chunk's own tiles",
    sync=SyncStatus(
        syncs=("dense fallback (CUDA, on by default; off during capture and in xattention_static): the "
               "break-even rule's [Hq] flags (break_even_heads: flags.nonzero().tolist()), one read; with the "
               "early exit on (off by default) one more, the [Hq] flags of the last-64-row probe "
               "(early_dense_heads)",
               "tiles to plan: the widest row of the selection kernel's lists (count.max().item()); the "
               "torch path (T > 4096 or CPU) uses mask_to_list",),
        static_bound="T = ceil(N / block) key blocks per query block"),
))
