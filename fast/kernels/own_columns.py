"""Triton kernel: a plan's columns outside its listed blocks, per query block.

`BlockColumnPlan.own_columns` (the spec, plain PyTorch) builds a
`[B, Hq, Qb, max_columns]` boolean "column inside a listed block" table with a
`searchsorted` and then a stable sort to compact the kept columns: at 128K tokens,
32 heads and 1000 columns that is about 0.5 GB of int64 temporaries and 5.6 ms on
an H200, more than the kernel time it saves. This kernel does the same in one
pass: one program per (batch, head, query block) walks its columns `CHUNK` at a
time, looks each column's key block up in the (sorted) block list by a vectorised
binary search, and writes the columns found in no listed block, in order, at
their prefix-sum positions. Work: O(k_v log W) per query block; memory: the
output only.

Layout: kernel -> launcher (`disjoint_columns`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...reference.plan import BlockColumnPlan
from ._common import check_device_memory

# Columns handled per vector step.
_CHUNK = 128
# Largest per-query-block column lists built from shared (stride-0 or grouped) ones
# by `resolve_covered_columns`; read at call time (conformance lowers it to 0).
DISJOINT_COLUMN_BYTES = 512 << 20
# Resolve covered columns at plan time (`resolve_covered_columns`). False leaves every
# plan's covered columns to the kernel's own column-in-block test, the path large
# shared lists take; read at call time (conformance turns it off for some examples, so
# that test runs on every plan shape the strategies draw, not only on shared lists).
RESOLVE_COVERED = True


def covered_column_settings() -> tuple[bool, int]:
    """`(RESOLVE_COVERED, DISJOINT_COLUMN_BYTES)` as they are now (read at each launch, since
    conformance, tests and benchmarks change them between calls)."""
    return RESOLVE_COVERED, DISJOINT_COLUMN_BYTES


@triton.jit
def _own_columns_kernel(
    BLOCK_COUNT, BLOCK_INDEX, COLUMN_COUNT, COLUMN_INDEX, OUT_COUNT, OUT_INDEX,
    num_heads, block_n, out_width, block_width,
    s_bc0, s_bc1, s_bc2,
    s_bi0, s_bi1, s_bi2, s_bi3,
    s_cc0, s_cc1, s_cc2,
    s_ci0, s_ci1, s_ci2, s_ci3,
    CHUNK: tl.constexpr, SEARCH_STEPS: tl.constexpr,
):
    i_m = tl.program_id(0).to(tl.int64)
    i_bh = tl.program_id(1).to(tl.int64)
    num_qb = tl.num_programs(0)
    i_b = i_bh // num_heads
    i_h = i_bh % num_heads
    # Counts clamped to the lists' widths: a plan edited after validation (docs/robustness.md)
    # must not make this pass read past a row.
    n_blocks = tl.load(BLOCK_COUNT + i_b * s_bc0 + i_h * s_bc1 + i_m * s_bc2)
    n_blocks = tl.minimum(tl.maximum(n_blocks, 0), block_width)
    n_cols = tl.load(COLUMN_COUNT + i_b * s_cc0 + i_h * s_cc1 + i_m * s_cc2)
    n_cols = tl.minimum(tl.maximum(n_cols, 0), out_width)
    p_blocks = BLOCK_INDEX + i_b * s_bi0 + i_h * s_bi1 + i_m * s_bi2
    p_cols = COLUMN_INDEX + i_b * s_ci0 + i_h * s_ci1 + i_m * s_ci2
    p_out = OUT_INDEX + (i_bh * num_qb + i_m) * out_width
    o_ch = tl.arange(0, CHUNK)

    n_kept = 0
    for c0 in range(0, n_cols, CHUNK):
        o_c = c0 + o_ch
        m_c = o_c < n_cols
        col = tl.load(p_cols + o_c * s_ci3, mask=m_c, other=0)
        kb = col // block_n
        # Lower bound of kb in the sorted block list [0, n_blocks).
        lo = tl.zeros([CHUNK], dtype=tl.int32)
        hi = tl.zeros([CHUNK], dtype=tl.int32) + n_blocks
        for _ in tl.static_range(SEARCH_STEPS):
            active = lo < hi
            mid = (lo + hi) // 2
            val = tl.load(p_blocks + mid * s_bi3, mask=m_c & active, other=0)
            right = val < kb
            lo = tl.where(active & right, mid + 1, lo)
            hi = tl.where(active & ~right, mid, hi)
        hit = tl.load(p_blocks + lo * s_bi3, mask=m_c & (lo < n_blocks), other=-1) == kb
        keep = (m_c & ~hit).to(tl.int32)
        pos = n_kept + tl.cumsum(keep, 0) - keep
        tl.store(p_out + pos, col, mask=keep > 0)
        n_kept += tl.sum(keep, 0)
    tl.store(OUT_COUNT + i_bh * num_qb + i_m, n_kept)


def disjoint_columns(plan: BlockColumnPlan) -> BlockColumnPlan:
    """`plan.with_disjoint_columns()` computed by one Triton pass (same plan, exactly).

    Args:
        plan: a valid plan on a CUDA device (or on the CPU under `TRITON_INTERPRET=1`);
            its index tensors may be stride-0 expanded views (shared columns).

    Returns:
        The plan with per-query-block column lists that skip every listed block
        (`columns_disjoint=True`); block lists are shared with `plan`; padding past
        a count is 0.
    """
    if not isinstance(plan, BlockColumnPlan):
        raise TypeError(f"plan must be a BlockColumnPlan, got {type(plan).__name__}")
    b, h, qb = plan.batch, plan.num_heads, plan.num_query_blocks
    width = plan.column_index.shape[3]
    columns = plan.query_block_columns()
    count = torch.zeros(b, h, qb, dtype=torch.int32, device=plan.device)
    # [B, H, Qb, width] written out: quadratic in tokens where the shared column list grows
    # with N (SharePrefill's single-line verticals: ~360 GiB at 1M tokens, 32 heads).
    check_device_memory(f"the per-query-block column lists ([B, H, Qb, width] = [{b}, {h}, {qb}, {width}])",
                        b * h * qb * width * 4, plan.device,
                        hint="Fewer kept columns (a lower gamma or vertical budget, or columns kept in "
                             "whole key blocks), a larger block_m or fewer heads per call fit.")
    index = torch.zeros(b, h, qb, width, dtype=torch.int32, device=plan.device)
    if width > 0 and count.numel() > 0:
        _own_columns_kernel[(qb, b * h)](
            plan.block_count, plan.block_index, plan.column_count, columns, count, index,
            h, plan.block_n, width, plan.block_index.shape[3],
            *plan.block_count.stride(), *plan.block_index.stride(),
            *plan.column_count.stride(), *columns.stride(),
            CHUNK=_CHUNK, SEARCH_STEPS=max(1, plan.block_index.shape[3].bit_length()), num_warps=4,
        )
    out = BlockColumnPlan(
        seqlen=plan.seqlen, block_m=plan.block_m, block_n=plan.block_n,
        block_count=plan.block_count, block_index=plan.block_index,
        column_count=count, column_index=index, columns_disjoint=True,
        query_offset=plan.query_offset,
    )
    return out.mark_valid() if plan._checked else out


def resolve_covered_columns(plan: BlockColumnPlan) -> BlockColumnPlan:
    """The plan normalisation every launch of the block/column kernel goes through.

    Columns that a listed block of the same query block already covers are resolved
    at plan time, once per column row, so the kernel can skip its per-tile
    column-in-block test (`SKIP_COVERED`, a window compare and a fallback binary
    search in every column tile):

    * plans without columns, or already `columns_disjoint`: unchanged;
    * one column list per query block (`column_group == 1`), stored per query block
      or shared (stride 0) but fitting `DISJOINT_COLUMN_BYTES` once expanded:
      `disjoint_columns` (one Triton pass);
    * grouped lists (`column_group > 1`): `plan.without_covered_columns()` (drops the
      columns covered for every query block of the group; disjoint when no covered
      column is left, else the kernel keeps its test for the rest);
    * shared (stride-0) lists too large to give every query block its own, or any
      plan while `RESOLVE_COVERED` is False: unchanged
      (fast.flexprefill_vs's plan at 128K: its in-kernel test ran at 0.46 of the block
      path on an H100, against 0.98 resolved at 32K; docs/plan-and-kernels.md).

    The result is cached on the plan object (like its validation), so launching the
    same plan again costs nothing (a plan edited in place afterwards must be rebuilt,
    as for validation); the attention is the same (`to_dense_mask` equal). During
    CUDA-graph capture a result is not cached and grouped lists are left as they are.
    """
    if plan.columns_disjoint or plan.column_index.shape[3] == 0 or not RESOLVE_COVERED:
        return plan
    # Under CUDA-graph capture nothing runs until replay: a result made there is used by
    # the captured launch that follows but never cached (its tensors are not written
    # yet), and the grouped pass (one host sync) is left to the kernel's own test.
    capturing = plan.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    cached = plan.__dict__.get("_resolved_columns")
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    if plan.column_group == 1:
        # Lists already stored per query block cost nothing new to resolve (columns20 at
        # 128K: 687 MB); shared (stride-0) ones are expanded only within the budget.
        per_block = plan.batch * plan.num_heads * plan.num_query_blocks * plan.column_index.shape[3] * 4
        stored = plan.column_index.untyped_storage().nbytes()
        out = plan if per_block > max(DISJOINT_COLUMN_BYTES, stored) else disjoint_columns(plan)
    elif capturing:
        return plan
    else:
        out = plan.without_covered_columns()
    if capturing:
        return out
    object.__setattr__(plan, "_resolved_columns", out)
    return out
