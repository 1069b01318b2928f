"""Dense causal attention as a plan, built without materialising any block mask."""

from __future__ import annotations

import torch

from ..reference._checks import check_block_size, check_positive_int, check_qk, check_chunk_qk
from ..reference.plan import BlockColumnPlan, cdiv
from .kernels import block_column_attention


def empty_columns(batch: int, heads: int, qblocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(column_count, column_index) of a plan without columns, as expanded views."""
    count = torch.zeros(1, 1, 1, dtype=torch.int32, device=device).expand(batch, heads, qblocks)
    index = torch.zeros(1, 1, 1, 0, dtype=torch.int32, device=device).expand(batch, heads, qblocks, 0)
    return count, index


def dense_plan(
    q: torch.Tensor, k: torch.Tensor, *, block_m: int = 128, block_n: int = 128
) -> BlockColumnPlan:
    """The plan that keeps the whole causal triangle (see `reference.dense_plan`).

    Every query block lists the key blocks `0 .. last`, so one `arange` expanded over
    batch, heads and query blocks serves as the index: O(N) memory.
    """
    shape = check_chunk_qk(q, k)
    bm = check_block_size("block_m", block_m)
    bn = check_block_size("block_n", block_n)
    n, b, h = shape.seqlen, shape.batch, shape.q_heads
    qb, kb = cdiv(n, bm), cdiv(shape.key_len, bn)
    last_row = ((torch.arange(qb, device=q.device) + 1) * bm - 1).clamp(max=n - 1) + shape.query_offset
    count = (last_row // bn + 1).to(torch.int32)
    index = torch.arange(kb, dtype=torch.int32, device=q.device)
    col_count, col_index = empty_columns(b, h, qb, q.device)
    return BlockColumnPlan(
        seqlen=n,
        block_m=bm,
        block_n=bn,
        block_count=count.expand(b, h, qb),
        block_index=index.expand(b, h, qb, kb),
        column_count=col_count,
        column_index=col_index,
        query_offset=shape.query_offset,
    ).mark_valid()


def dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_m: int = 128,
    block_n: int = 128,
    scale: float | None = None,
) -> torch.Tensor:
    """Full causal attention through the dense plan (see `reference.dense`)."""
    plan = dense_plan(q, k, block_m=block_m, block_n=block_n)
    out, _ = block_column_attention(q, k, v, plan, scale=scale, validate_plan=False)
    return out
