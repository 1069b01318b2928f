"""DPXA on the GPU (see `reference.dpxa` for the spec).

Delta anchors and anchor-pair tile scores: Triton (`fast.kernels.delta_score`);
selection and block lists: `fast.xattention.select_plan` (the same greedy rule and
kernel as XAttention); then the block kernel. Checks run once, in the public
functions.

The anchors are bit-identical to the reference's (Delta-KV's shared stage 1); the tile
scores are fp32, so a tile whose weight (nearly) ties another, or whose cumulative weight lands
on the threshold, may be decided differently: `conformance.ties.dpxa_tie_check`
shows that every difference is such a case.
"""

from __future__ import annotations

import torch

from ..reference._checks import HALF_DTYPES, PerHead, check_qkv, resolve_scale
from ..reference.plan import BlockColumnPlan
from .kernels import block_column_attention, check_forward_only
from .kernels.delta_score import _anchor_tile_weights, check_dpxa_inputs, dpxa_scoring_ratio, dpxa_tile_weights
from .xattention import select_plan

__all__ = ["dpxa", "dpxa_plan", "dpxa_scoring_ratio", "dpxa_tile_weights"]


def _dpxa_plan(q: torch.Tensor, k: torch.Tensor, *, cos_threshold: float, tau: torch.Tensor, block: int,
               sm_scale: float) -> BlockColumnPlan:
    weights = _anchor_tile_weights(q, k, cos_threshold=cos_threshold, block=block, sm_scale=sm_scale)
    return select_plan(weights, tau, seqlen=q.shape[2], block=block)


def dpxa_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    cos_threshold: float = 0.75,
    threshold: PerHead = 0.9,
    block: int = 128,
    scale: float | None = None,
) -> BlockColumnPlan:
    """DPXA plan (see `reference.dpxa_plan`).

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    cos_threshold, tau, block = check_dpxa_inputs(q, k, cos_threshold=cos_threshold, threshold=threshold,
                                                  block=block)
    sm_scale = resolve_scale(scale, q.shape[3])
    return _dpxa_plan(q, k, cos_threshold=cos_threshold, tau=tau, block=block, sm_scale=sm_scale)


def dpxa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cos_threshold: float = 0.75,
    threshold: PerHead = 0.9,
    block: int = 128,
    scale: float | None = None,
) -> torch.Tensor:
    """DPXA sparse attention (see `reference.dpxa`).

    Host synchronisation: one, the block-list width (as `xattention`; T in
    `torch.ops.sparseprefill.dpxa_static` and during CUDA-graph capture: no sync,
    capture-safe, docs/serving.md).

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    check_qkv(q, k, v, dtypes=HALF_DTYPES)
    cos_threshold, tau, block = check_dpxa_inputs(q, k, cos_threshold=cos_threshold, threshold=threshold,
                                                  block=block)
    check_forward_only(v)
    sm_scale = resolve_scale(scale, q.shape[3])
    plan = _dpxa_plan(q, k, cos_threshold=cos_threshold, tau=tau, block=block, sm_scale=sm_scale)
    out, _ = block_column_attention(q, k, v, plan, scale=sm_scale, validate_plan=False)
    return out
