"""Triton kernel for MInference's Vertical-Slash index (Alg. 4): lines -> `BlockColumnPlan`.

One program per (batch, head, query block `[r0, r1)`), O(k_s + k_v log k_s) work:

* Ranges (Alg. 4's slash part). A kept offset `o <= r1 - 1` covers the keys
  `[max(r0 - o, 0), r1 - o)`, i.e. the key blocks `[f, l]` with
  `f = max(r0 - o, 0) // block_n`, `l = (r1 - 1 - o) // block_n`. Taken in
  descending `o`, both `f` and `l` never decrease, so the blocks a slash adds to
  the union of the earlier ones are `[max(f, l_prev + 1), l]`: the two-way merge
  of Alg. 4 becomes a prefix sum over chunks of slashes, and every slash writes its
  (at most `(block_m - 1) // block_n + 2`) new blocks at its prefix-sum position.
* Points (Alg. 4's vertical part). A kept column `v <= r1 - 1` of key block `j`
  is inside a kept block iff some kept offset lies in
  `[r0 - (j + 1) * block_n + 1, r1 - 1 - j * block_n]`; a binary search in the
  sorted offsets answers it, and the columns left are compacted by a prefix sum.

Widths come from the parameters, not from the data, so nothing waits for the GPU:
blocks `min(Kb, k_s * ((block_m - 1) // block_n + 2))`, columns `k_v`.

Layout: kernel -> launcher (`vertical_slash_index`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...reference._checks import check_positive_int
from ...reference.plan import BlockColumnPlan, cdiv

# Lines handled per vector step.
_CHUNK = 128


@triton.jit
def _vertical_slash_index_kernel(
    VERTICAL, SLASH, BLOCK_COUNT, BLOCK_INDEX, COLUMN_COUNT, COLUMN_INDEX,
    seqlen, block_m, block_n, n_vertical, n_slash, num_qblocks, block_width, column_width,
    RANGE_BLOCKS: tl.constexpr, SEARCH_STEPS: tl.constexpr, CHUNK: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    r0 = i_m * block_m
    r1 = tl.minimum(r0 + block_m, seqlen)
    p_slash = SLASH + i_bh * n_slash
    p_vert = VERTICAL + i_bh * n_vertical
    row = i_bh * num_qblocks + i_m
    p_bindex = BLOCK_INDEX + row * block_width
    p_cindex = COLUMN_INDEX + row * column_width
    o_ch = tl.arange(0, CHUNK)

    # Ranges: slash t (descending offset) is SLASH[n_slash - 1 - t] (stored ascending).
    n_blocks = 0
    last_prev = -1
    for t0 in range(0, n_slash, CHUNK):
        o_t = t0 + o_ch
        m_t = o_t < n_slash
        off = tl.load(p_slash + (n_slash - 1 - o_t), mask=m_t, other=seqlen)
        # Alg. 4 line 7 (bisect): slashes that start below the block reach none of its rows.
        reach = m_t & (off <= r1 - 1)
        first = tl.maximum(r0 - off, 0) // block_n
        last = tl.where(reach, (r1 - 1 - off) // block_n, -1)
        # The previous slash's last block; `last` never decreases along t.
        off_prev = tl.load(p_slash + (n_slash - o_t), mask=m_t & (o_t > t0), other=seqlen)
        last_before = tl.where(off_prev <= r1 - 1, (r1 - 1 - off_prev) // block_n, -1)
        last_before = tl.where(o_t == t0, last_prev, last_before)
        start = tl.maximum(first, last_before + 1)
        count = tl.where(reach, tl.maximum(last - start + 1, 0), 0)
        pos = n_blocks + tl.cumsum(count, 0) - count
        for u in tl.static_range(RANGE_BLOCKS):
            tl.store(p_bindex + pos + u, (start + u).to(tl.int32), mask=u < count)
        n_blocks += tl.sum(count, 0)
        last_prev = tl.maximum(last_prev, tl.max(last, 0))
    tl.store(BLOCK_COUNT + row, n_blocks)

    # Points: verticals not inside a kept block become columns.
    n_cols = 0
    for v0 in range(0, n_vertical, CHUNK):
        o_v = v0 + o_ch
        m_v = o_v < n_vertical
        col = tl.load(p_vert + o_v, mask=m_v, other=seqlen)
        causal = m_v & (col <= r1 - 1)
        j = col // block_n
        lo = r0 - (j + 1) * block_n + 1
        hi = r1 - 1 - j * block_n
        # Lower bound of `lo` in the ascending offsets.
        left = tl.zeros([CHUNK], dtype=tl.int32)
        right = tl.full([CHUNK], 0, dtype=tl.int32) + n_slash
        for _ in tl.static_range(SEARCH_STEPS):
            active = left < right
            mid = (left + right) // 2
            val = tl.load(p_slash + mid, mask=active, other=0)
            go_right = active & (val < lo)
            left = tl.where(go_right, mid + 1, left)
            right = tl.where(active & ~go_right, mid, right)
        hit = tl.load(p_slash + left, mask=left < n_slash, other=seqlen)
        covered = (left < n_slash) & (hit <= hi)
        keep = causal & ~covered
        keep_i = keep.to(tl.int32)
        pos = n_cols + tl.cumsum(keep_i, 0) - keep_i
        tl.store(p_cindex + pos, col.to(tl.int32), mask=keep)
        n_cols += tl.sum(keep_i, 0)
    tl.store(COLUMN_COUNT + row, n_cols)


def index_widths(n_vertical: int, n_slash: int, *, seqlen: int, block_m: int, block_n: int) -> tuple[int, int]:
    """(block width, column width) that no query block can exceed, from the parameters alone."""
    range_blocks = (block_m - 1) // block_n + 2
    return min(cdiv(seqlen, block_n), n_slash * range_blocks), n_vertical


def vertical_slash_index(
    verticals: torch.Tensor,
    slashes: torch.Tensor,
    *,
    seqlen: int,
    block_m: int = 64,
    block_n: int = 64,
) -> BlockColumnPlan:
    """Alg. 4 on the GPU: kept lines -> plan (see `reference.vertical_slash.vertical_slash_index`).

    Args:
        verticals: int32 `[B, H, kv]`, distinct key columns in `[0, N)`, sorted ascending.
        slashes: int32 `[B, H, ks]`, distinct offsets `row - col` in `[0, N)`, sorted
            ascending.
        seqlen: N. block_m, block_n: query rows and keys per block.

    Returns:
        The plan; its widths are `index_widths(kv, ks, ...)`.

    Raises:
        TypeError: index tensors not int32.
        ValueError: shapes that do not match, or tensors on different devices. Values
            are not checked (that would need a host synchronisation): unsorted or
            out-of-range lines give an invalid plan.
    """
    n = check_positive_int("seqlen", seqlen)
    bm = check_positive_int("block_m", block_m)
    bn = check_positive_int("block_n", block_n)
    for name, t in (("verticals", verticals), ("slashes", slashes)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must have dtype int32, got {t.dtype}")
        if t.dim() != 3 or t.shape[:2] != verticals.shape[:2] or t.shape[2] < 1:
            raise ValueError(f"{name} must have shape [B, H, count >= 1], got {tuple(t.shape)}")
        if t.device != verticals.device:
            raise ValueError(f"{name} is on {t.device}, verticals on {verticals.device}")
    b, h, kv = verticals.shape
    ks = slashes.shape[2]
    qb = cdiv(n, bm)
    block_width, column_width = index_widths(kv, ks, seqlen=n, block_m=bm, block_n=bn)
    dev = verticals.device
    block_count = torch.empty(b, h, qb, dtype=torch.int32, device=dev)
    block_index = torch.empty(b, h, qb, block_width, dtype=torch.int32, device=dev)
    column_count = torch.empty(b, h, qb, dtype=torch.int32, device=dev)
    column_index = torch.empty(b, h, qb, column_width, dtype=torch.int32, device=dev)
    _vertical_slash_index_kernel[(qb, b * h)](
        verticals.contiguous(), slashes.contiguous(),
        block_count, block_index, column_count, column_index,
        n, bm, bn, kv, ks, qb, block_width, column_width,
        RANGE_BLOCKS=(bm - 1) // bn + 2, SEARCH_STEPS=ks.bit_length(), CHUNK=_CHUNK,
        num_warps=4,
    )
    return BlockColumnPlan(
        seqlen=n,
        block_m=bm,
        block_n=bn,
        block_count=block_count,
        block_index=block_index,
        column_count=column_count,
        column_index=column_index,
    )
