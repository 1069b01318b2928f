"""DPXA on the GPU (see `reference.dpxa` for the spec).

Delta anchors and anchor-pair tile scores: Triton (`fast.kernels.delta_score`);
selection: `fast.xattention.select_tiles` (the same greedy rule as XAttention); plan:
the kept tiles as key blocks, then the block kernel.

The anchors are bit-identical to the reference's (Delta-KV's shared stage 1); the tile
scores are fp32, so a tile whose weight (nearly) ties another, or whose cumulative weight lands
on the threshold, may be decided differently: `conformance.ties.dpxa_tie_check`
shows that every difference is such a case.
"""

from __future__ import annotations

import torch

from ..reference._checks import HALF_DTYPES, check_qk, check_qkv, resolve_scale
from ..reference.dpxa import check_dpxa_params
from ..reference.plan import BlockColumnPlan
from .kernels import block_column_attention, check_forward_only, check_kernel_device
from .kernels.delta_score import dpxa_scoring_ratio, dpxa_tile_weights
from .kernels.xattention_score import check_fast_block
from .xattention import select_tiles, tiles_to_plan

__all__ = ["dpxa", "dpxa_plan", "dpxa_scoring_ratio", "dpxa_tile_weights"]


def dpxa_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    cos_threshold: float = 0.75,
    threshold: float = 0.9,
    block: int = 128,
    scale: float | None = None,
) -> BlockColumnPlan:
    """DPXA plan (see `reference.dpxa_plan`).

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k, dtypes=HALF_DTYPES)
    cos_threshold, threshold, block = check_dpxa_params(cos_threshold=cos_threshold,
                                                        threshold=threshold, block=block)
    check_fast_block(block)
    weights = dpxa_tile_weights(q, k, cos_threshold=cos_threshold, block=block, scale=scale)
    return tiles_to_plan(select_tiles(weights, threshold), seqlen=shape.seqlen, block=block)


def dpxa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cos_threshold: float = 0.75,
    threshold: float = 0.9,
    block: int = 128,
    scale: float | None = None,
) -> torch.Tensor:
    """DPXA sparse attention (see `reference.dpxa`).

    Host synchronisation: one, the block-list width (as `xattention`; T in
    `torch.ops.sparseprefill.dpxa_static`: capture-safe, docs/serving.md).

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qkv(q, k, v, dtypes=HALF_DTYPES)
    check_dpxa_params(cos_threshold=cos_threshold, threshold=threshold, block=block)
    check_fast_block(block)
    check_kernel_device(q)
    check_forward_only(q, k, v)
    resolve_scale(scale, shape.head_dim)
    plan = dpxa_plan(q, k, cos_threshold=cos_threshold, threshold=threshold, block=block, scale=scale)
    out, _ = block_column_attention(q, k, v, plan, scale=scale, validate_plan=False)
    return out
