"""Recall, density and output error without O(N^2) memory (see `reference.metrics`).

Recall uses the identity: the full causal softmax mass that the kept keys of a row
carry is `exp(lse_kept - lse_causal)`. Both log-sum-exps come from the kernel, so a
plan's recall costs two sparse passes and O(N) memory. Density of a plan is counted
in closed form from its block and column lists (columns inside a listed block are
not counted twice).
"""

from __future__ import annotations

import torch

from ..reference._checks import HALF_DTYPES, check_qk, check_tensor, check_values
from ..reference.attention import check_mask, check_plan
from ..reference.metrics import relative_error
from ..reference.plan import BlockColumnPlan, causal_pairs, columns_inside_blocks
from .dense import dense_plan
from .kernels import block_column_attention, check_forward_only, check_kernel_block_sizes

__all__ = ["density", "recall", "relative_error"]


def recall(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | BlockColumnPlan,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention recall of a mask or plan, per query row (see `reference.recall`).

    Returns:
        float32 `[B, Hq, N]` in `[0, 1]`.
    """
    shape = check_qk(q, k, dtypes=HALF_DTYPES)
    check_forward_only(q, k)
    # Check the selection before the full causal pass, so bad input costs no launch.
    if isinstance(mask, BlockColumnPlan):
        check_plan(mask, shape.batch, shape.q_heads, shape.seqlen, q.device)
        check_kernel_block_sizes(mask.block_m, mask.block_n, prefix="plan.")
    else:
        check_mask(mask, shape.batch, shape.q_heads, shape.seqlen, q.device)
    full = dense_plan(q, k)
    # K stands in for V: only the log-sum-exps are used.
    _, lse_full = block_column_attention(q, k, k, full, scale=scale, return_lse=True,
                                         validate_plan=False)
    if isinstance(mask, BlockColumnPlan):
        # A head of `dense_heads` keeps every causal key: its recall is 1 (set below).
        _, lse_kept = block_column_attention(q, k, k, mask, scale=scale, return_lse=True)
        if mask.dense_heads:
            assert lse_kept is not None and lse_full is not None
            lse_kept[:, list(mask.dense_heads)] = lse_full[:, list(mask.dense_heads)]
    else:
        _, lse_kept = block_column_attention(q, k, k, full, mask=mask, scale=scale,
                                             return_lse=True, validate_plan=False)
    assert lse_full is not None and lse_kept is not None
    return torch.exp(lse_kept - lse_full).clamp_(max=1.0)


def density(mask: torch.Tensor | BlockColumnPlan) -> torch.Tensor:
    """Kept share of the causal area, per (batch, head) (see `reference.density`).

    Returns:
        float64 `[B, Hq]`.
    """
    if not isinstance(mask, BlockColumnPlan):
        dense = check_values("mask", check_tensor("mask", mask, rank=4), why="its kept pairs are counted")
        if dense.dtype != torch.bool:
            raise TypeError(f"mask must have dtype torch.bool, got {dense.dtype}")
        if dense.shape[2] != dense.shape[3] or dense.shape[2] == 0:
            raise ValueError(f"mask must have shape [B, Hq, N, N] with N >= 1, got {tuple(dense.shape)}")
        n = dense.shape[-1]
        kept = dense.tril().sum(dim=(-1, -2)).to(torch.float64)
        return kept / (n * (n + 1) / 2)
    # The fields first: the plan's sizes below are read from them.
    mask.check_fields()
    plan = check_plan(mask, mask.batch, mask.num_heads, mask.seqlen, mask.device)
    n, bm, bn = plan.seqlen, plan.block_m, plan.block_n
    dev = plan.device
    qb = plan.num_query_blocks
    width = plan.block_index.shape[3] + plan.column_index.shape[3]
    # Count a slab of query blocks at a time: the int64 temporaries stay near 256 MiB.
    step = max(1, (32 << 20) // max(1, plan.batch * plan.num_heads * width))
    kept = torch.zeros(plan.batch, plan.num_heads, dtype=torch.int64, device=dev)
    for s0 in range(0, qb, step):
        s1 = min(qb, s0 + step)
        r0 = (torch.arange(s0, s1, device=dev, dtype=torch.int64) * bm).view(1, 1, -1, 1)
        r1 = torch.clamp(r0 + bm, max=n)
        bcount = plan.block_count[:, :, s0:s1].unsqueeze(-1)
        bvalid = torch.arange(plan.block_index.shape[3], device=dev) < bcount
        k0 = plan.block_index[:, :, s0:s1].to(torch.int64) * bn
        k1 = torch.clamp(k0 + bn, max=n)
        kept += torch.where(bvalid, causal_pairs(r0, r1, k0, k1), 0).sum(dim=(-1, -2))
        ccount = plan.column_count[:, :, s0:s1].unsqueeze(-1)
        cvalid = torch.arange(plan.column_index.shape[3], device=dev) < ccount
        c = plan.query_block_columns(s0, s1).to(torch.int64)
        # A column inside a listed block is already counted with the block.
        cvalid = cvalid & ~columns_inside_blocks(plan.block_count[:, :, s0:s1],
                                                 plan.block_index[:, :, s0:s1], c, block_n=bn)
        kept += torch.where(cvalid, causal_pairs(r0, r1, c, c + 1), 0).sum(dim=(-1, -2))
    if plan.dense_heads:
        # A head of `dense_heads` keeps the whole causal area, whatever its lists.
        kept[:, list(plan.dense_heads)] = n * (n + 1) // 2
    return kept.to(torch.float64) / (n * (n + 1) / 2)
