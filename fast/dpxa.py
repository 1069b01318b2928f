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
from ..reference.dense_fallback import heads_view, knob_heads
from ..reference.plan import BlockColumnPlan
from .attention import run_plan
from .dense_fallback import plan_with_fallback, probe_mass_density
from .kernels import check_forward_only
from .kernels.delta_score import (
    _anchor_tile_weights,
    check_dpxa_inputs,
    dpxa_scoring_ratio,
    dpxa_tile_weights,
)
from .xattention import select_plan

__all__ = ["dpxa", "dpxa_plan", "dpxa_scoring_ratio", "dpxa_tile_weights"]


def _dpxa_plan(q: torch.Tensor, k: torch.Tensor, *, cos_threshold: float, tau: torch.Tensor, block: int,
               sm_scale: float) -> BlockColumnPlan:
    """The tile plan, with the early exit and the break-even rule (`fast.dense_fallback`)."""
    def estimate(heads: list[int] | None) -> BlockColumnPlan:
        qs, ks = heads_view(q, k, heads)
        weights = _anchor_tile_weights(qs, ks, cos_threshold=cos_threshold, block=block, sm_scale=sm_scale)
        return select_plan(weights, knob_heads(tau, heads), seqlen=q.shape[2], block=block)

    return plan_with_fallback(q, k, estimate, block_m=block, block_n=block, probe=lambda: probe_mass_density(
        q, k, block_n=block, mass=tau, scale=sm_scale))


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
    return run_plan(q, k, v, plan, scale=sm_scale)
