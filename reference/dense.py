"""Dense causal attention as a plan: every causal key block of every query block."""

from __future__ import annotations

import torch

from ._checks import check_block_size, check_positive_int, check_qk, check_chunk_qk
from .attention import sparse_attention
from .plan import BlockColumnPlan, cdiv


def dense_plan(
    q: torch.Tensor, k: torch.Tensor, *, block_m: int = 128, block_n: int = 128
) -> BlockColumnPlan:
    """The plan that keeps the whole causal triangle.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, P + N, D]` (only their shapes are used): with
            P > 0, q holds the chunk of queries at positions `[P, P + N)` and the plan
            has `query_offset` P (chunked prefill over a cached prefix).
        block_m: query rows per block. block_n: keys per block.

    Returns:
        A `BlockColumnPlan` listing, for query block `i`, every key block up to the
        one holding its last row, and no columns.

    Raises:
        TypeError, ValueError: bad inputs.
    """
    shape = check_chunk_qk(q, k)
    bm = check_block_size("block_m", block_m)
    bn = check_block_size("block_n", block_n)
    n = shape.seqlen
    blocks = torch.ones(
        shape.batch, shape.q_heads, cdiv(n, bm), cdiv(shape.key_len, bn), dtype=torch.bool, device=q.device
    )
    return BlockColumnPlan.from_masks(blocks, None, seqlen=n, block_m=bm, block_n=bn,
                                      query_offset=shape.query_offset)


def dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_m: int = 128,
    block_n: int = 128,
    scale: float | None = None,
) -> torch.Tensor:
    """Full causal attention through the dense plan (see `dense_plan`).

    Returns:
        `[B, Hq, N, D]` in q's dtype.
    """
    plan = dense_plan(q, k, block_m=block_m, block_n=block_n)
    return sparse_attention(q, k, v, plan, scale=scale)
