"""The kernel's column-in-listed-block skip when a tile's columns outrun its window.

The kernel compares each tile of columns with a window of up to 128 entries of the
sorted block list and falls back to a binary search for columns past a full
window. This plan lists more than 128 blocks for late query blocks and columns
spread over all of them (most inside listed blocks), so both paths run.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sparseprefill import fast, reference
from sparseprefill.conformance.tolerance import baseline_attention, check_attention, golden_attention


def test_columns_inside_listed_blocks_past_the_window() -> None:
    torch.manual_seed(0)
    n, bm, bn = 4096, 512, 16
    qb, kb = n // bm, n // bn
    # Most key blocks listed (every 7th left out): late query blocks list > 128 blocks.
    blocks = (torch.arange(kb) % 7 != 3).expand(1, 1, qb, kb).clone()
    # Sparse columns, 16 to a tile (block_n = 16) across the sequence: a tile spans more
    # listed blocks than the window holds, so late columns need the fallback search.
    cols = (torch.arange(n) % 199 == 5).expand(1, 1, qb, n).clone()
    plan = reference.BlockColumnPlan.from_masks(blocks, None, seqlen=n, block_m=bm, block_n=bn)
    assert int(plan.block_count.max()) > 128
    # Shared columns: the same sorted list for every query block, causal prefix counted.
    col_list = cols[0, 0, 0].nonzero().flatten().to(torch.int32)
    last_row = (torch.arange(qb) + 1) * bm - 1
    count = torch.searchsorted(col_list, last_row.to(torch.int32), right=True).to(torch.int32)
    shared = reference.BlockColumnPlan(
        seqlen=n, block_m=bm, block_n=bn, block_count=plan.block_count,
        block_index=plan.block_index, column_count=count.view(1, 1, qb),
        column_index=col_list.view(1, 1, 1, -1).expand(1, 1, qb, -1),
    ).validate()
    q = torch.randn(1, 1, n, 32, dtype=torch.float16)
    k = torch.randn(1, 1, n, 32, dtype=torch.float16)
    v = torch.randn(1, 1, n, 32, dtype=torch.float16)
    out, lse = fast.sparse_attention(q, k, v, shared, return_lse=True)
    mask = shared.to_dense_mask()
    golden, baseline = golden_attention(q, k, v, mask), baseline_attention(q, k, v, mask)
    check_attention(out, lse, golden, baseline, context="columns past the window")

    # The disjoint twin promises no column inside a listed block: the kernel skips its
    # column-in-block test and must give the same attention.
    disjoint = shared.with_disjoint_columns().validate()
    assert disjoint.columns_disjoint and disjoint.equal(shared)
    out_d, lse_d = fast.sparse_attention(q, k, v, disjoint, return_lse=True)
    check_attention(out_d, lse_d, golden, baseline, context="disjoint twin")
    # A plan that claims disjoint columns but repeats keys of listed blocks is refused.
    with pytest.raises(ValueError, match="columns_disjoint"):
        replace(shared, columns_disjoint=True).validate()
