"""Causal softmax attention, written for clarity and exactness (the specification).

Scores and softmax are computed in float64, a chunk of query rows at a time, so
memory stays O(chunk * N) and a 16K-token problem runs on a 24 GB CPU machine.
Grouped-query attention is handled by viewing the query heads of one KV head as a
group dimension; K and V are never copied per query head.
"""

from __future__ import annotations

import math
from typing import Literal, overload

import torch

from ._checks import check_qkv, resolve_scale
from .plan import BlockColumnPlan

# Scores of one chunk are [B, Hq, chunk, N] float64: keep them near 256 MiB.
_CHUNK_BYTES = 256 * 2**20


def _chunk_rows(batch: int, heads: int, seqlen: int) -> int:
    per_row = batch * heads * seqlen * 8
    return max(1, min(seqlen, _CHUNK_BYTES // max(per_row, 1)))


def check_mask(mask: object, batch: int, heads: int, seqlen: int, device: torch.device) -> torch.Tensor:
    """Check a dense mask broadcastable to `[B, Hq, N, N]` and return it as bool.

    Raises:
        TypeError: not a bool tensor.
        ValueError: wrong rank, not broadcastable, or on another device.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must have dtype torch.bool, got {mask.dtype}")
    if mask.device != device:
        raise ValueError(f"mask must be on the device of q ({device}), got {mask.device}")
    if mask.dim() not in (2, 4):
        raise ValueError(f"mask must have shape [N, N] or [B, Hq, N, N], got {tuple(mask.shape)}")
    full = (batch, heads, seqlen, seqlen)
    shape = (1, 1, *mask.shape) if mask.dim() == 2 else tuple(mask.shape)
    for got, want in zip(shape, full):
        if got not in (1, want):
            raise ValueError(
                f"mask must broadcast to [B={batch}, Hq={heads}, N={seqlen}, N={seqlen}], "
                f"got {tuple(mask.shape)}"
            )
    if shape[2] != seqlen or shape[3] != seqlen:
        raise ValueError(f"mask must have N={seqlen} rows and columns, got {tuple(mask.shape)}")
    return mask.reshape(shape)


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
    """Causal softmax attention with an optional dense mask.

    Args:
        q: `[B, Hq, N, D]`, float16/bfloat16/float32/float64.
        k, v: `[B, Hkv, N, D]`, the dtype and device of `q`; `Hq % Hkv == 0`.
        mask: bool, `[N, N]` or broadcastable to `[B, Hq, N, N]`; True keeps a key.
            It is intersected with causality. None: plain causal attention.
        scale: softmax scale, `1/sqrt(D)` if None.
        return_lse: also return the natural-log sum of exp of the kept scaled logits.

    Returns:
        `out: [B, Hq, N, D]` in q's dtype and, if `return_lse`, `lse: [B, Hq, N]` float32.
        A row with no kept key gets output 0 and lse -inf, never NaN.

    Raises:
        TypeError, ValueError: bad inputs (see `_checks.check_qkv`, `check_mask`).
    """
    shape = check_qkv(q, k, v)
    sm_scale = resolve_scale(scale, shape.head_dim)
    b, hq, hkv, n, d = shape.batch, shape.q_heads, shape.kv_heads, shape.seqlen, shape.head_dim
    g = shape.group
    dense_mask = None if mask is None else check_mask(mask, b, hq, n, q.device)

    # View the query heads of one KV head as a group dimension: [B, Hkv, G, N, D].
    qg = q.reshape(b, hkv, g, n, d).to(torch.float64)
    kg = k.to(torch.float64).unsqueeze(2)
    vg = v.to(torch.float64).unsqueeze(2)
    out = torch.empty(b, hkv, g, n, d, dtype=torch.float64, device=q.device)
    lse = torch.empty(b, hkv, g, n, dtype=torch.float64, device=q.device)
    chunk = _chunk_rows(b, hq, n)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        # Queries in [start, stop) can only see keys in [0, stop).
        rows = torch.arange(start, stop, device=q.device)
        keys = torch.arange(stop, device=q.device)
        keep = keys[None, :] <= rows[:, None]
        if dense_mask is not None:
            keep = keep & _group_mask(dense_mask[:, :, start:stop, :stop], hkv, g)
        scores = torch.matmul(qg[:, :, :, start:stop], kg[:, :, :, :stop].transpose(-1, -2)) * sm_scale
        scores = scores.masked_fill(~keep, -math.inf)
        row_max = scores.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        weights = torch.exp(scores - row_max)
        denom = weights.sum(dim=-1, keepdim=True)
        numer = torch.matmul(weights, vg[:, :, :, :stop])
        out[:, :, :, start:stop] = torch.where(denom > 0, numer / denom.clamp_min(1e-300), 0.0)
        lse[:, :, :, start:stop] = (row_max + torch.log(denom)).squeeze(-1)
    result = out.reshape(b, hq, n, d).to(q.dtype)
    if return_lse:
        return result, lse.reshape(b, hq, n).to(torch.float32)
    return result


def _group_mask(mask: torch.Tensor, hkv: int, g: int) -> torch.Tensor:
    """Reshape a `[B or 1, Hq or 1, rows, keys]` mask to broadcast over `[B, Hkv, G, ...]`."""
    bm, hm, r, c = mask.shape
    if hm == 1:
        return mask.reshape(bm, 1, 1, r, c)
    return mask.reshape(bm, hkv, g, r, c)


@overload
def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    scale: float | None = None,
    return_lse: Literal[False] = False,
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
) -> tuple[torch.Tensor, torch.Tensor]: ...


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention restricted to a plan: the keys `plan.to_dense_mask()` keeps.

    Args:
        q, k, v, scale, return_lse: as in `attention`.
        plan: a `BlockColumnPlan` with `B` and `Hq` of q and `seqlen == N`.

    Returns:
        As `attention`.

    Raises:
        TypeError, ValueError: bad inputs or a plan that fails `validate` or does not
            match q.
    """
    shape = check_qkv(q, k, v)
    check_plan(plan, shape.batch, shape.q_heads, shape.seqlen, q.device)
    mask = plan.to_dense_mask()
    if return_lse:
        return attention(q, k, v, mask, scale=scale, return_lse=True)
    return attention(q, k, v, mask, scale=scale)


def check_plan(
    plan: object, batch: int, heads: int, seqlen: int, device: torch.device
) -> BlockColumnPlan:
    """Check that `plan` is a valid `BlockColumnPlan` for `[B, Hq, N]` on `device`."""
    if not isinstance(plan, BlockColumnPlan):
        raise TypeError(f"plan must be a BlockColumnPlan, got {type(plan).__name__}")
    if plan.seqlen != seqlen:
        raise ValueError(f"plan.seqlen must equal N={seqlen}, got {plan.seqlen}")
    if tuple(plan.block_count.shape[:2]) != (batch, heads):
        raise ValueError(
            f"plan must have B={batch}, Hq={heads} (as q), got "
            f"{tuple(plan.block_count.shape[:2])}"
        )
    if plan.device != device:
        raise ValueError(f"plan must be on the device of q ({device}), got {plan.device}")
    return plan.ensure_valid()
