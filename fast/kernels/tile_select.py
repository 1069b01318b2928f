"""Triton kernel for the greedy cumulative-threshold tile selection (see `reference.xattention.select_tiles`).

`_select_row_kernel`: one program per row of tile weights (query tile `i` of one
head; a few rows where rows are short). It ranks the causal tiles as the reference does (tile 0 and the diagonal
first, then by weight descending, NaN last, ties by position: one bitonic sort of
64-bit keys, the weight's order-preserving bits above the complemented position),
sums the sorted weights in float64, keeps every tile whose preceding sum is below
its head's threshold (one per head: `THRESH[H]`, a scalar threshold filled), and
writes in one pass the row's keep mask, its kept count and its kept positions ascending (the plan's block list at width `T`, zeros past the count).
So selection and the line-to-index step cost one launch, with no host round trip.

XAttention, DPXA and DeltaXAttention select through it (`fast.xattention`). Rows
longer than `MAX_KERNEL_TILES` (N > 512K at 128-token tiles) take the torch path
of `fast.xattention.select_tiles` instead.

Layout: kernel -> launcher (`select_tile_lists`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .block_column import interpreter_active

# Longest row the kernel sorts in registers (a power of two).
MAX_KERNEL_TILES = 4096


@triton.jit
def _select_row_kernel(
    W, THRESH, KEEP, COUNT, INDEX, num_rows, num_tiles, num_heads,
    ROWS: tl.constexpr, T_PAD: tl.constexpr,
):
    # ROWS rows of weights per program (query tiles i of some heads), T_PAD tiles each;
    # row r is query tile r % T of head (r // T) % H.
    o_row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m_row = o_row < num_rows
    b_tau = tl.load(THRESH + (o_row // num_tiles) % num_heads, mask=m_row, other=0.0)
    i_q = (o_row % num_tiles)[:, None]
    o_t = tl.arange(0, T_PAD)[None, :]
    causal = (o_t <= i_q) & m_row[:, None]
    p_w = W + o_row.to(tl.int64)[:, None] * num_tiles
    w = tl.load(p_w + o_t, mask=causal, other=0.0).to(tl.float32)
    forced = (o_t == 0) | (o_t == i_q)
    # Rank: forced +inf, NaN the lowest finite value, non-causal -inf (rank_nan_last).
    rank = tl.where(w != w, -3.4028234663852886e38, w)
    rank = tl.where(forced, float("inf"), tl.where(causal, rank, float("-inf")))
    # An integer in the float's order: the bits of a non-negative float, minus the
    # magnitude bits of a negative one (-0.0 ties +0.0, as in torch.sort), made >= 0.
    bits = rank.to(tl.int32, bitcast=True).to(tl.int64)
    ordered = tl.where(bits >= 0, bits, -(bits + 2147483648)) + 2147483648
    # Descending by rank; equal ranks by position ascending (a stable sort's order).
    key = tl.sort(ordered * T_PAD + (T_PAD - 1 - o_t).to(tl.int64), 1, descending=True)
    order = (T_PAD - 1 - (key % T_PAD)).to(tl.int32)
    m_order = (order <= i_q) & m_row[:, None]
    taken = tl.load(p_w + order, mask=m_order, other=0.0).to(tl.float32)
    taken = tl.where(taken != taken, 0.0, taken).to(tl.float64)
    before = tl.cumsum(taken, 1) - taken
    # Keep while the mass before a tile is below the threshold; tile 0 and the diagonal always.
    keep_sorted = m_order & ((order == 0) | (order == i_q) | (before < b_tau[:, None]))
    p_keep = KEEP + o_row.to(tl.int64)[:, None] * num_tiles
    m_tile = (o_t < num_tiles) & m_row[:, None]
    tl.store(p_keep + o_t, tl.zeros([ROWS, T_PAD], tl.int8), mask=m_tile)
    tl.debug_barrier()
    tl.store(p_keep + order, keep_sorted.to(tl.int8), mask=m_order)
    tl.debug_barrier()
    # The kept positions ascending: each kept tile's slot is the number kept before it.
    kept = tl.load(p_keep + o_t, mask=m_tile, other=0).to(tl.int32)
    slot = tl.cumsum(kept, 1) - kept
    count = tl.sum(kept, 1)
    p_index = INDEX + o_row.to(tl.int64)[:, None] * num_tiles
    tl.store(p_index + o_t, tl.zeros([ROWS, T_PAD], tl.int32), mask=m_tile & (o_t >= count[:, None]))
    tl.store(p_index + slot, tl.zeros([ROWS, T_PAD], tl.int32) + o_t, mask=m_tile & (kept != 0))
    tl.store(COUNT + o_row, count, mask=m_row)


def heads_threshold(threshold: float | torch.Tensor, heads: int, device: torch.device) -> torch.Tensor:
    """A checked threshold as float64 `[heads]` on `device`: a per-head tensor as it is, a
    scalar filled on the device (no copy, no host synchronisation)."""
    if isinstance(threshold, torch.Tensor):
        return threshold.to(device=device, dtype=torch.float64)
    return torch.full((heads,), float(threshold), dtype=torch.float64, device=device)


def select_tile_lists(weights: torch.Tensor,
                      threshold: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy selection of checked `[B, H, T, T]` weights, `T <= MAX_KERNEL_TILES`.

    `threshold`: checked, in (0, 1]: a scalar or float64 `[H]`, one per head
    (`reference._checks.per_head`), compared in float64 as the torch path does; 1 keeps
    every causal tile of its head.

    Returns:
        (keep bool `[B, H, T, T]`, count int32 `[B, H, T]`, index int32 `[B, H, T, T]`:
        the kept tiles of each row ascending, then zeros).
    """
    b, h, tiles, _ = weights.shape
    w = weights.contiguous()
    keep = torch.empty(b, h, tiles, tiles, dtype=torch.int8, device=w.device)
    count = torch.empty(b, h, tiles, dtype=torch.int32, device=w.device)
    index = torch.empty(b, h, tiles, tiles, dtype=torch.int32, device=w.device)
    t_pad = max(16, triton.next_power_of_2(tiles))
    rows = b * h * tiles
    # A threshold of 1 keeps every causal tile whatever the rounding of the sums.
    tau = heads_threshold(threshold, h, w.device)
    tau = torch.where(tau >= 1.0, math.inf, tau).contiguous()
    # A few rows per program where rows are short; in the interpreter all of them (its
    # cost is per operation, not per element).
    per_program = min(triton.next_power_of_2(rows), 256) if interpreter_active() else max(1, 512 // t_pad)
    if rows:
        _select_row_kernel[(triton.cdiv(rows, per_program),)](
            w, tau, keep, count, index, rows, tiles, h,
            ROWS=per_program, T_PAD=t_pad, num_warps=4 if interpreter_active() else max(1, min(8, t_pad // 128)),
        )
    return keep.view(torch.bool), count, index
