"""Attention from a dense mask or from a plan, on the block/column Triton kernel."""

from __future__ import annotations

from typing import Literal, overload

import torch

from ..reference.attention import AttentionState, check_attention_inputs
from ..reference.plan import BlockColumnPlan
from .dense import dense_plan
from .kernels import block_column_attention


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    return_lse: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    return_lse: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention with an optional dense mask (see `reference.attention`).

    The kernel walks every causal key tile; with a mask it also reads the mask tile
    (O(N^2) bytes read, since the mask itself is that large).

    Args:
        q: `[B, Hq, N, D]` float16/bfloat16; k, v: `[B, Hkv, P + N, D]`: P = 0, or
            P > 0 for a chunk of queries at positions `[P, P + N)` over all `P + N`
            keys (as `reference.attention`).
        mask: bool, `[N, N]` or broadcastable to `[B, Hq, N, N]`, or None; only with P = 0.
        scale: softmax scale, `1/sqrt(D)` if None.
        return_lse: also return the natural-log lse, float32 `[B, Hq, N]`.

    Returns:
        out `[B, Hq, N, D]` (and lse): rows with no kept key give 0 and -inf.

    Raises:
        TypeError, ValueError: bad inputs, before any kernel launch.
    """
    check_attention_inputs(q, k, v, mask)
    plan = dense_plan(q, k)
    out, lse = block_column_attention(
        q, k, v, plan, mask=mask, scale=scale, return_lse=return_lse, validate_plan=False
    )
    if return_lse:
        assert lse is not None
        return out, lse
    return out


@overload
def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    scale: float | None = None,
    return_lse: Literal[False] = False,
    state: AttentionState | None = None,
    block_mean_out: torch.Tensor | None = None,
) -> torch.Tensor: ...


@overload
def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    scale: float | None = None,
    return_lse: Literal[True],
    state: AttentionState | None = None,
    block_mean_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    state: AttentionState | None = None,
    block_mean_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention restricted to a plan (see `reference.sparse_attention`).

    The plan is validated before launch; its block sizes must be multiples of 16.

    Args:
        q, k, v, plan, scale, return_lse: as `reference.sparse_attention`.
        state: a float32 `AttentionState` to start from, updated in place (one kernel
            pass reads and writes it); None starts from nothing.
        block_mean_out: float32 `[B, Hq, Qb, Kb]` filled with the mean scaled logit of
            every listed block (accumulated in the kernel pass), -inf elsewhere.

    Raises:
        TypeError, ValueError: bad inputs or plan, before any kernel launch.
    """
    out, lse = block_column_attention(q, k, v, plan, scale=scale, return_lse=return_lse,
                                      state=state, block_mean_out=block_mean_out)
    if return_lse:
        assert lse is not None
        return out, lse
    return out
