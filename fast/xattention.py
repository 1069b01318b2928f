"""XAttention on the GPU (see `reference.xattention` for the spec).

Tile weights: two Triton kernels (`fast.kernels.xattention_score`) that never store
the stride-level `[G, G]` scores. Selection: `select_tiles`, torch sort and cumsum on
the `[B, Hq, T, T]` tile weights (small: `T = N / block`), a few heads at a time.
Plan: the kept tiles as key blocks (one host synchronisation for the list width),
then the block kernel.

The fp32 weights differ from the reference's float64 ones in the last bits, so a tile
whose weight ties (or nearly ties) another, or whose cumulative weight lands on the
threshold, may be decided differently: `conformance.ties.xattention_tie_check` shows
that every difference is such a case.
"""

from __future__ import annotations

import math

import torch

from ..reference._checks import HALF_DTYPES, check_qk, check_qkv, resolve_scale
from ..reference.plan import BlockColumnPlan, mask_to_list, rank_nan_last
from ..reference.xattention import check_threshold, check_weights, check_xattention_params
from .capture import static_widths_active
from .dense import empty_columns
from .kernels import block_column_attention, check_forward_only, check_kernel_device
from .kernels.xattention_score import check_fast_block, xattention_tile_weights

__all__ = ["select_tiles", "xattention", "xattention_plan", "xattention_tile_weights"]

# Elements of [rows, T] tile weights selected at once (sort indices and cumsums in float64).
_SELECT_ELEMENTS = 1 << 24


def select_tiles(weights: torch.Tensor, threshold: float) -> torch.Tensor:
    """Greedy threshold selection (see `reference.xattention.select_tiles`).

    Args:
        weights: float `[B, H, T, T]`, rows summing to 1 over the causal tiles `j <= i`.
        threshold: in `(0, 1]`.

    Returns:
        bool `[B, H, T, T]`.

    Raises:
        TypeError, ValueError: a bad threshold or weights not `[B, H, T, T]`.
    """
    tau = check_threshold(threshold)
    check_weights(weights)
    b, h, tiles, _ = weights.shape
    idx = torch.arange(tiles, device=weights.device)
    causal = idx[None, :] <= idx[:, None]
    if tau >= 1.0:
        return causal.expand(weights.shape).clone()
    keep = torch.empty(weights.shape, dtype=torch.bool, device=weights.device)
    flat_w = weights.reshape(b * h * tiles, tiles)
    flat_keep = keep.view(b * h * tiles, tiles)
    rows = max(1, _SELECT_ELEMENTS // tiles)
    for r0 in range(0, b * h * tiles, rows):
        r1 = min(r0 + rows, b * h * tiles)
        qi = torch.arange(r0, r1, device=weights.device) % tiles
        c = idx[None, :] <= qi[:, None]
        forced = (idx[None, :] == 0) | (idx[None, :] == qi[:, None])
        w = torch.where(c, flat_w[r0:r1], 0.0)
        # NaN weights (NaN in q or k) rank last and count as 0, as in the reference.
        ranked = torch.where(forced, math.inf, torch.where(c, rank_nan_last(w), -math.inf))
        w = torch.nan_to_num(w, nan=0.0)
        order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
        taken = torch.gather(w, -1, order).to(torch.float64)
        before = taken.cumsum(dim=-1) - taken
        keep_sorted = torch.gather(forced, -1, order) | (before < tau)
        flat_keep[r0:r1] = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted) & c
    return keep


def tiles_to_plan(keep: torch.Tensor, *, seqlen: int, block: int) -> BlockColumnPlan:
    """The kept causal tiles `[B, H, T, T]` as a plan of `block x block` key blocks (valid by construction).

    The lists are as wide as the most kept tiles of a row (`mask_to_list`: one host
    synchronisation), or `T` inside `fast.capture.static_widths()` and during CUDA-graph
    capture (no read).
    """
    b, h, tiles, _ = keep.shape
    if static_widths_active(keep):
        # `mask_to_list` at the full width T: a stable sort puts the kept tiles first, in order.
        count = keep.sum(dim=-1)
        order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
        index = torch.where(torch.arange(tiles, device=keep.device) < count.unsqueeze(-1), order, 0)
        count, index = count.to(torch.int32), index.to(torch.int32)
    else:
        count, index = mask_to_list(keep)
    col_count, col_index = empty_columns(b, h, tiles, keep.device)
    return BlockColumnPlan(
        seqlen=seqlen, block_m=block, block_n=block, block_count=count, block_index=index,
        column_count=col_count, column_index=col_index,
    ).mark_valid()


def xattention_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    stride: int = 8,
    threshold: float = 0.9,
    block: int = 128,
    scoring: str = "antidiagonal",
    scale: float | None = None,
) -> BlockColumnPlan:
    """XAttention plan (see `reference.xattention_plan`).

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k, dtypes=HALF_DTYPES)
    stride, threshold, block, scoring = check_xattention_params(
        stride=stride, threshold=threshold, block=block, scoring=scoring)
    check_fast_block(block)
    weights = xattention_tile_weights(q, k, stride=stride, block=block, scoring=scoring, scale=scale)
    return tiles_to_plan(select_tiles(weights, threshold), seqlen=shape.seqlen, block=block)


def xattention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    stride: int = 8,
    threshold: float = 0.9,
    block: int = 128,
    scoring: str = "antidiagonal",
    scale: float | None = None,
) -> torch.Tensor:
    """XAttention sparse attention (see `reference.xattention`).

    Host synchronisation: one, the block-list width. Inside `fast.capture.static_widths()`
    (`torch.ops.sparseprefill.xattention_static`) and during CUDA-graph capture the
    width is T: no sync, capture-safe (docs/serving.md).

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qkv(q, k, v, dtypes=HALF_DTYPES)
    check_xattention_params(stride=stride, threshold=threshold, block=block, scoring=scoring)
    check_fast_block(block)
    check_kernel_device(q)
    check_forward_only(q, k, v)
    resolve_scale(scale, shape.head_dim)
    plan = xattention_plan(q, k, stride=stride, threshold=threshold, block=block, scoring=scoring,
                           scale=scale)
    out, _ = block_column_attention(q, k, v, plan, scale=scale, validate_plan=False)
    return out
