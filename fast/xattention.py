"""XAttention on the GPU (see `reference.xattention` for the spec).

Tile weights: two Triton kernels (`fast.kernels.xattention_score`) that never store
the stride-level `[G, G]` scores. Selection and block lists: one kernel
(`fast.kernels.tile_select`, shared with DPXA and DeltaXAttention) on the
`[B, Hq, T, T]` tile weights; one host synchronisation cuts the lists to the widest
row (none inside `static_widths()`). Then the block kernel.

Checks run once, in the public functions; `_xattention_plan` and the kernels'
launchers trust them.

The fp32 weights differ from the reference's float64 ones in the last bits, so a tile
whose weight ties (or nearly ties) another, or whose cumulative weight lands on the
threshold, may be decided differently: `conformance.ties.xattention_tie_check` shows
that every difference is such a case.
"""

from __future__ import annotations

import math

import torch

from ..reference._checks import (
    HALF_DTYPES,
    PerHead,
    check_knob,
    check_qkv,
    per_head,
    resolve_scale,
)
from ..reference.dense_fallback import heads_view, knob_heads
from ..reference.plan import BlockColumnPlan, mask_to_list, rank_nan_last
from ..reference.xattention import check_threshold, check_weights
from .attention import run_plan
from .capture import static_widths_active
from .dense import empty_columns
from .dense_fallback import plan_with_fallback, probe_mass_density
from .kernels import check_forward_only
from .kernels.tile_select import MAX_KERNEL_TILES, heads_threshold, select_tile_lists
from .kernels.xattention_score import (
    _tile_weights,
    check_xattention_inputs,
    xattention_tile_weights,
)

__all__ = ["select_tiles", "xattention", "xattention_plan", "xattention_tile_weights"]

# Elements of [rows, T] tile weights selected at once by the torch path (sort indices
# and cumsums in float64).
_SELECT_ELEMENTS = 1 << 24


def _kernel_selects(weights: torch.Tensor) -> bool:
    """Whether the selection kernel takes these weights: on a GPU, rows of at most
    `MAX_KERNEL_TILES` tiles. CPU tensors take the torch path, under the interpreter
    too (its bitonic sort costs ~0.4 s a launch there; tests/test_xattention.py checks
    the kernel against the torch path directly, and GPU conformance runs it)."""
    return weights.is_cuda and weights.shape[-1] <= MAX_KERNEL_TILES


def _select_tiles_torch(weights: torch.Tensor, threshold: float | torch.Tensor) -> torch.Tensor:
    """The greedy selection in torch sort and cumsum ops, a few rows at a time (rows longer
    than the kernel's, and CPU tensors outside the interpreter); `threshold`: checked, a
    scalar or float64 `[H]`."""
    b, h, tiles, _ = weights.shape
    tau = heads_threshold(threshold, h, weights.device)
    idx = torch.arange(tiles, device=weights.device)
    keep = torch.empty(weights.shape, dtype=torch.bool, device=weights.device)
    flat_w = weights.reshape(b * h * tiles, tiles)
    flat_keep = keep.view(b * h * tiles, tiles)
    rows = max(1, _SELECT_ELEMENTS // tiles)
    for r0 in range(0, b * h * tiles, rows):
        r1 = min(r0 + rows, b * h * tiles)
        row = torch.arange(r0, r1, device=weights.device)
        qi = row % tiles
        # Row r is query tile r % T of head (r // T) % H; a threshold of 1 keeps every causal tile.
        row_tau = tau[torch.div(row, tiles, rounding_mode="floor") % h][:, None]
        c = idx[None, :] <= qi[:, None]
        forced = (idx[None, :] == 0) | (idx[None, :] == qi[:, None])
        w = torch.where(c, flat_w[r0:r1], 0.0)
        # NaN weights (NaN in q or k) rank last and count as 0, as in the reference.
        ranked = torch.where(forced, math.inf, torch.where(c, rank_nan_last(w), -math.inf))
        w = torch.nan_to_num(w, nan=0.0)
        order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
        taken = torch.gather(w, -1, order).to(torch.float64)
        before = taken.cumsum(dim=-1) - taken
        keep_sorted = torch.gather(forced, -1, order) | (before < row_tau)
        flat_keep[r0:r1] = (torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted) | (row_tau >= 1.0)) & c
    return keep


def select_tiles(weights: torch.Tensor, threshold: PerHead) -> torch.Tensor:
    """Greedy threshold selection (see `reference.xattention.select_tiles`).

    One kernel launch (`fast.kernels.tile_select`) on a GPU; torch sort and cumsum ops
    for rows longer than `MAX_KERNEL_TILES` tiles.

    Args:
        weights: float `[B, H, T, T]`, rows summing to 1 over the causal tiles `j <= i`.
        threshold: in `(0, 1]`, one for every head or one per head (H values).

    Returns:
        bool `[B, H, T, T]`.

    Raises:
        TypeError, ValueError: a bad threshold or weights not `[B, H, T, T]`.
    """
    check_knob("threshold", threshold, check_threshold)
    check_weights(weights)
    return _select_tiles(weights, per_head(threshold, "threshold", weights.shape[1], check_threshold,
                                           device=weights.device))


def _select_tiles(weights: torch.Tensor, tau: float | torch.Tensor) -> torch.Tensor:
    """`select_tiles` on checked weights and threshold (a scalar or float64 `[H]`)."""
    if _kernel_selects(weights):
        return select_tile_lists(weights, tau)[0]
    return _select_tiles_torch(weights, tau)


def _plan(count: torch.Tensor, index: torch.Tensor, *, seqlen: int, block: int) -> BlockColumnPlan:
    b, h, tiles = count.shape
    col_count, col_index = empty_columns(b, h, tiles, count.device)
    return BlockColumnPlan(
        seqlen=seqlen, block_m=block, block_n=block, block_count=count, block_index=index,
        column_count=col_count, column_index=col_index,
    ).mark_valid()


def tiles_to_plan(keep: torch.Tensor, *, seqlen: int, block: int) -> BlockColumnPlan:
    """The kept causal tiles `[B, H, T, T]` as a plan of `block x block` key blocks (valid by construction).

    The lists are as wide as the most kept tiles of a row (`mask_to_list`: one host
    synchronisation), or `T` inside `fast.capture.static_widths()` and during CUDA-graph
    capture (no read).
    """
    tiles = keep.shape[2]
    if static_widths_active(keep):
        # `mask_to_list` at the full width T: a stable sort puts the kept tiles first, in order.
        count = keep.sum(dim=-1)
        order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
        index = torch.where(torch.arange(tiles, device=keep.device) < count.unsqueeze(-1), order, 0)
        count, index = count.to(torch.int32), index.to(torch.int32)
    else:
        count, index = mask_to_list(keep)
    return _plan(count, index, seqlen=seqlen, block=block)


def select_plan(weights: torch.Tensor, tau: float | torch.Tensor, *, seqlen: int, block: int) -> BlockColumnPlan:
    """`tiles_to_plan(select_tiles(weights, tau))` on checked weights and threshold (a
    scalar or float64 `[H]` per head).

    On a GPU one kernel selects and writes the block lists at width `T`; they are cut
    to the widest row (one host synchronisation) outside `static_widths()` and capture.
    """
    if not _kernel_selects(weights):
        return tiles_to_plan(_select_tiles_torch(weights, tau), seqlen=seqlen, block=block)
    _, count, index = select_tile_lists(weights, tau)
    if not static_widths_active(weights):
        width = int(count.max().item()) if count.numel() else 0
        index = index[..., :width].contiguous()
    return _plan(count, index, seqlen=seqlen, block=block)


def _xattention_plan(q: torch.Tensor, k: torch.Tensor, *, stride: int, tau: torch.Tensor, block: int, scoring: str,
                     sm_scale: float) -> BlockColumnPlan:
    """The tile plan, with the break-even rule and, where it is on (off by default), the
    early exit (a head whose last rows need most tiles for its threshold's mass is not
    scored) (`fast.dense_fallback`)."""
    def estimate(heads: list[int] | None) -> BlockColumnPlan:
        qs, ks = heads_view(q, k, heads)
        weights = _tile_weights(qs, ks, stride=stride, block=block, scoring=scoring, sm_scale=sm_scale)
        return select_plan(weights, knob_heads(tau, heads), seqlen=q.shape[2], block=block)

    return plan_with_fallback(q, k, estimate, block_m=block, block_n=block, probe=lambda: probe_mass_density(
        q, k, block_n=block, mass=tau, scale=sm_scale))


def xattention_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    stride: int = 8,
    threshold: PerHead = 0.9,
    block: int = 128,
    scoring: str = "antidiagonal",
    scale: float | None = None,
) -> BlockColumnPlan:
    """XAttention plan (see `reference.xattention_plan`).

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    stride, tau, block, scoring = check_xattention_inputs(q, k, stride=stride, threshold=threshold,
                                                          block=block, scoring=scoring)
    sm_scale = resolve_scale(scale, q.shape[3])
    return _xattention_plan(q, k, stride=stride, tau=tau, block=block, scoring=scoring, sm_scale=sm_scale)


def xattention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    stride: int = 8,
    threshold: PerHead = 0.9,
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
    check_qkv(q, k, v, dtypes=HALF_DTYPES)
    stride, tau, block, scoring = check_xattention_inputs(q, k, stride=stride, threshold=threshold,
                                                          block=block, scoring=scoring)
    check_forward_only(v)
    sm_scale = resolve_scale(scale, q.shape[3])
    plan = _xattention_plan(q, k, stride=stride, tau=tau, block=block, scoring=scoring, sm_scale=sm_scale)
    return run_plan(q, k, v, plan, scale=sm_scale)
