"""Triton kernel for SampleAttention's `merge_index` (Alg. 1 line 11): kept blocks -> plan.

One program per (batch * head, query block `i`) walks the causal key blocks
`j <= i` in chunks and keeps `j` iff it is a kept column block, `i - j` is a kept
block diagonal, or `j = i` (the diagonal, always kept); a prefix sum places the
kept indices, already sorted. O(Qb) work per program, no dense `[Qb, Kb]` mask.

The block lists are `min(Kb, max(k_c + k_s) + 1)` wide, a bound from the selected
counts: no query block lists more than its head's kept column blocks, kept
diagonals and the diagonal block. Reading that bound is the one host
synchronisation of the plan; inside `fast.capture.static_widths()` (and during CUDA
graph capture) the width is `Kb`, which holds for any selection.

Layout: kernel -> launcher (`sample_attention_index`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...reference._checks import check_positive_int
from ...reference.plan import BlockColumnPlan, cdiv
from ..capture import static_widths_active

_CHUNK = 256


@triton.jit
def _merge_index_kernel(
    COLUMNS, SLASHES, BLOCK_COUNT, BLOCK_INDEX,
    num_blocks, block_width,
    CHUNK: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    p_col = COLUMNS + i_bh * num_blocks
    p_slash = SLASHES + i_bh * num_blocks
    row = i_bh * num_blocks + i_m
    p_out = BLOCK_INDEX + row * block_width
    n_kept = 0
    for j0 in range(0, i_m + 1, CHUNK):
        o_j = j0 + tl.arange(0, CHUNK)
        m_j = o_j <= i_m
        col = tl.load(p_col + o_j, mask=m_j, other=0)
        slash = tl.load(p_slash + (i_m - o_j), mask=m_j, other=0)
        # Alg. 1 line 11: column blocks and block diagonals extended over the matrix, plus the diagonal.
        keep = (m_j & ((col != 0) | (slash != 0) | (o_j == i_m))).to(tl.int32)
        pos = n_kept + tl.cumsum(keep, 0) - keep
        tl.store(p_out + pos, o_j.to(tl.int32), mask=keep != 0)
        n_kept += tl.sum(keep, 0)
    tl.store(BLOCK_COUNT + row, n_kept)


def sample_attention_index(
    columns: torch.Tensor,
    slashes: torch.Tensor,
    *,
    seqlen: int,
    block_size: int,
    width: int | None = None,
) -> BlockColumnPlan:
    """`merge_index` on the GPU: kept column blocks and block diagonals -> plan.

    Args:
        columns: bool `[B, H, Kb]`, kept column blocks.
        slashes: bool `[B, H, Kb]`, kept block diagonals `d = i - j`.
        seqlen: N. block_size: the block grid (plan `block_m = block_n`).
        width: block-list width, at least the longest list; None: from the kept
            counts (one host synchronisation), or `Kb` under `static_widths()`.

    Returns:
        The plan (`columns_disjoint`, no columns), marked valid.

    Raises:
        TypeError, ValueError: shapes or dtypes that do not fit.
    """
    n = check_positive_int("seqlen", seqlen)
    bs = check_positive_int("block_size", block_size)
    kb = cdiv(n, bs)
    for name, t in (("columns", columns), ("slashes", slashes)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.bool:
            raise TypeError(f"{name} must be a bool torch.Tensor")
        if t.dim() != 3 or t.shape[2] != kb or t.shape[:2] != columns.shape[:2]:
            raise ValueError(f"{name} must have shape [B, H, Kb={kb}], got {tuple(t.shape)}")
        if t.device != columns.device:
            raise ValueError(f"{name} is on {t.device}, columns on {columns.device}")
    b, h, _ = columns.shape
    if width is None and static_widths_active(columns):
        width = kb
    if width is None:
        width = int((columns.sum(dim=-1) + slashes.sum(dim=-1)).max().item()) + 1
    width = min(kb, check_positive_int("width", width))
    device = columns.device
    block_count = torch.empty(b, h, kb, dtype=torch.int32, device=device)
    block_index = torch.empty(b, h, kb, width, dtype=torch.int32, device=device)
    _merge_index_kernel[(kb, b * h)](
        columns.contiguous().view(torch.int8), slashes.contiguous().view(torch.int8),
        block_count, block_index, kb, width, CHUNK=_CHUNK, num_warps=4,
    )
    no_columns = torch.zeros(1, 1, 1, dtype=torch.int32, device=device)
    return BlockColumnPlan(
        seqlen=n, block_m=bs, block_n=bs,
        block_count=block_count, block_index=block_index,
        column_count=no_columns.expand(b, h, kb),
        column_index=no_columns.reshape(1, 1, 1, 1)[..., :0].expand(b, h, kb, 0),
        columns_disjoint=True,
    ).mark_valid()
