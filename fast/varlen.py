"""Packed variable-length batches on the block/column kernel, one launch (see `reference.varlen`)."""

from __future__ import annotations

from typing import Any

import torch

from ..reference.plan import BlockColumnPlan
from ..reference.varlen import PlanFn, plan_sequences
from .kernels import varlen_block_column_attention


def varlen_plans(plan_fn: PlanFn, q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor,
                 **params: Any) -> BlockColumnPlan:
    """Estimate and plan every sequence on its own, stacked (see `reference.varlen_plans`).

    Each sequence's estimate runs on its own `[1, H, n, D]` view of the packed
    tensors (no copies); the launches of the estimators are per sequence.
    """
    return plan_sequences(plan_fn, q, k, cu_seqlens, params, dtypes=(torch.float16, torch.bfloat16))


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    plan: BlockColumnPlan,
    *,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a packed batch under a stacked plan, one kernel launch
    (see `reference.varlen_attention`; `kernels.varlen_block_column_attention`).

    The launcher reads the four lists alone: a plan's `dense_heads` (the break-even rule's
    marks, kept by `stack_plans` where every sequence has them) travel as full causal
    lists (`BlockColumnPlan.with_dense_lists`)."""
    if not isinstance(plan, BlockColumnPlan):
        raise TypeError(f"plan must be a BlockColumnPlan, got {type(plan).__name__}")
    out, lse = varlen_block_column_attention(q, k, v, cu_seqlens, max_seqlen, plan.with_dense_lists(), scale=scale,
                                             return_lse=return_lse)
    if return_lse:
        assert lse is not None
        return out, lse
    return out
