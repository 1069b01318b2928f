"""MInference Block-Sparse heads on the GPU (see `reference.block_sparse` for the spec).

Pooled means and pooled scores in fp32 torch ops, then one `torch.topk` per chunk
of query blocks with the diagonal set to +inf and non-causal blocks to -inf; no
host synchronisation. The `[Qb, Kb]` pooled scores are built `_SCORE_BYTES` at a
time (they would be 34 GB at 1M tokens and 32 heads); the plan itself is
`[B, Hq, Qb, min(top_k, Qb)]` int32 (210 MB there with `top_k = 100`).

`torch.topk` orders exact ties its own way, and fp32 scores differ from the
reference's float64 ones in the last bits, so a block whose score (nearly) ties
the last kept one may differ from the reference's choice.
"""

from __future__ import annotations

import torch

from ..reference._checks import (
    HALF_DTYPES,
    PerHeadInt,
    check_block_size,
    check_knob,
    check_qk,
    check_qkv,
    per_head,
)
from ..reference.block_sparse import check_top_k
from ..reference.plan import BlockColumnPlan, cdiv, rank_nan_last
from .attention import run_plan
from .dense import empty_columns
from .dense_fallback import apply_rule
from .kernels import (
    check_forward_only,
    check_kernel_block_sizes,
    check_kernel_device,
)

_SCORE_BYTES = 256 << 20


def mean_pooling(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Alg. 3 lines 2-3: float32 `[B, H, ceil(N / bs), D]`; the last block averages its real tokens."""
    b, h, n, d = x.shape
    full = n // block_size
    parts = []
    if full:
        blocks = x[:, :, : full * block_size].reshape(b, h, full, block_size, d)
        parts.append(blocks.sum(dim=3, dtype=torch.float32) / block_size)
    if n > full * block_size:
        tail = x[:, :, full * block_size:]
        parts.append(tail.sum(dim=2, keepdim=True, dtype=torch.float32) / (n - full * block_size))
    return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]


def block_sparse_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    top_k: PerHeadInt,
    block_size: int = 64,
) -> BlockColumnPlan:
    """MInference Block-Sparse plan (see `reference.block_sparse_plan`).

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k, dtypes=HALF_DTYPES)
    check_kernel_device(q)
    checked = check_knob("top_k", top_k, check_top_k, integer=True)
    bs = check_block_size("block_size", block_size)
    check_kernel_block_sizes(bs, bs, names=("block_size", "block_size"))
    b, hq, hkv, g = shape.batch, shape.q_heads, shape.kv_heads, shape.group
    nb = cdiv(shape.seqlen, bs)
    # Per-head top_k: lists as wide as the largest, each head cut to its own count.
    widths = (per_head(checked, "top_k", hq, check_top_k, integer=True, device=q.device).clamp(max=nb)
              if isinstance(checked, torch.Tensor) else None)
    width = min(int(checked), nb) if widths is None else int(widths.max())
    q_pooled = mean_pooling(q, bs).reshape(b, hkv, g, nb, -1)
    k_pooled = mean_pooling(k, bs).unsqueeze(2).transpose(-1, -2)
    dev = q.device
    block_index = torch.empty(b, hq, nb, width, dtype=torch.int32, device=dev)
    key_block = torch.arange(nb, device=dev)
    rows = max(1, _SCORE_BYTES // (4 * b * hq * nb))
    for i0 in range(0, nb, rows):
        i1 = min(i0 + rows, nb)
        query_block = torch.arange(i0, i1, device=dev)[:, None]
        scores = rank_nan_last(torch.matmul(q_pooled[:, :, :, i0:i1], k_pooled))
        scores = scores.masked_fill(key_block > query_block, float("-inf"))
        scores = scores.masked_fill(key_block == query_block, float("inf"))
        if widths is None:
            picked = torch.topk(scores, width, dim=-1, sorted=False).indices
        else:
            picked = torch.topk(scores, width, dim=-1, sorted=True).indices
            head_width = widths.reshape(hkv, g)[None, :, :, None, None]
            picked = torch.where(torch.arange(width, device=dev) < head_width, picked, nb)
        # Early query blocks fill their budget with non-causal blocks: push them last.
        picked = torch.where(picked > query_block, nb, picked)
        picked = torch.sort(picked, dim=-1).values
        block_index[:, :, i0:i1] = picked.reshape(b, hq, i1 - i0, width).to(torch.int32)
    if widths is None:
        count = torch.clamp(torch.arange(1, nb + 1, device=dev), max=width).to(torch.int32).expand(b, hq, nb)
    else:
        count = torch.minimum(torch.arange(1, nb + 1, device=dev), widths[:, None]).to(torch.int32)
        count = count.expand(b, hq, nb)
    col_count, col_index = empty_columns(b, hq, nb, dev)
    return apply_rule(BlockColumnPlan(
        seqlen=shape.seqlen,
        block_m=bs,
        block_n=bs,
        block_count=count,
        block_index=block_index,
        column_count=col_count,
        column_index=col_index,
    ), q)


def block_sparse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    top_k: PerHeadInt,
    block_size: int = 64,
    scale: float | None = None,
) -> torch.Tensor:
    """Block-Sparse attention (see `reference.block_sparse`).

    Returns:
        `[B, Hq, N, D]` in q's dtype.
    """
    check_qkv(q, k, v, dtypes=HALF_DTYPES)
    check_forward_only(q, k, v)
    plan = block_sparse_plan(q, k, top_k=top_k, block_size=block_size)
    return run_plan(q, k, v, plan, scale=scale)
