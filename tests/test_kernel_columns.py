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


def test_columns_inside_listed_blocks_past_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    # The launcher would resolve these shared lists first (`resolve_covered_columns`);
    # a zero budget keeps them shared so the kernel's own test runs.
    monkeypatch.setattr("sparseprefill.fast.kernels.own_columns.DISJOINT_COLUMN_BYTES", 0)
    torch.manual_seed(0)
    # 2560 keys: 160 key blocks, 137 of them listed for the last query block (> 128).
    n, bm, bn = 2560, 512, 16
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


def _exact_own_columns(plan: reference.BlockColumnPlan) -> None:
    """fast's one-pass disjoint columns equal the reference's, entry for entry."""
    from sparseprefill.fast.kernels.own_columns import disjoint_columns

    got = disjoint_columns(plan)
    want = plan.with_disjoint_columns()
    assert got.columns_disjoint
    assert torch.equal(got.column_count, want.column_count)
    width = got.column_index.shape[3]
    kept = torch.arange(width) < got.column_count.unsqueeze(-1)
    assert torch.equal(torch.where(kept, got.column_index, 0), torch.where(kept, want.column_index, 0))
    assert got.validate().equal(plan)


@pytest.mark.parametrize("seed", range(6))
def test_fast_disjoint_columns_match_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(17, 700, (1,), generator=gen))
    bm, bn = [(16, 16), (64, 16), (32, 64), (16, 32), (128, 128), (48, 16)][seed]
    b, h = 2, 3
    qb, kb = -(-n // bm), -(-n // bn)
    blocks = torch.rand(b, h, qb, kb, generator=gen) < [0.0, 0.3, 0.7, 0.95, 0.5, 0.2][seed]
    cols = torch.rand(b, h, qb, n, generator=gen) < 0.2
    # Columns inside listed blocks kept on purpose: from_masks would drop them.
    plan = reference.BlockColumnPlan.from_masks(blocks, None, seqlen=n, block_m=bm, block_n=bn)
    counts = [[[int(cols[i, j, m, : min(n, (m + 1) * bm)].sum()) for m in range(qb)]
               for j in range(h)] for i in range(b)]
    width = max(1, max(c for row in counts for hc in row for c in hc))
    index = torch.zeros(b, h, qb, width, dtype=torch.int32)
    for i in range(b):
        for j in range(h):
            for m in range(qb):
                sel = cols[i, j, m, : min(n, (m + 1) * bm)].nonzero().flatten()
                index[i, j, m, : sel.numel()] = sel.to(torch.int32)
    per_block = replace(plan, column_count=torch.tensor(counts, dtype=torch.int32),
                        column_index=index, _checked=False).validate()
    _exact_own_columns(per_block)
    # Shared columns (stride-0 over query blocks), as fast.vertical_slash_index builds them.
    shared_list = cols[0, 0, 0].nonzero().flatten().to(torch.int32)
    if shared_list.numel():
        last_row = ((torch.arange(qb) + 1) * bm - 1).clamp(max=n - 1).to(torch.int32)
        count = torch.searchsorted(shared_list, last_row, right=True).to(torch.int32)
        shared = replace(plan, column_count=count.expand(b, h, qb),
                         column_index=shared_list.view(1, 1, 1, -1).expand(b, h, qb, -1),
                         _checked=False).validate()
        _exact_own_columns(shared)


@pytest.mark.parametrize("value", [None, float("nan"), float("inf")])
@pytest.mark.parametrize("group", [1, 2])
def test_nonfinite_values_through_column_tiles(value: float | None, group: int) -> None:
    """The column loop's non-finite step runs only when V holds a NaN/inf: with one at a
    key that is a column of some query blocks, exactly the rows that keep it read NaN
    (shared and grouped column lists, GQA, batch 2); with none, the fast copy matches the
    golden output."""
    torch.manual_seed(11 + group)
    b, hq, hkv, n, d, bm, bn = 2, 4, 2, 150, 32, 32, 16
    qb, kb = -(-n // bm), -(-n // bn)
    blocks = torch.rand(b, hq, qb, kb) < 0.3
    cols = torch.rand(b, hq, qb, n) < 0.25
    col = 40
    cols[1, 2:, :, col] = True  # query heads 2, 3 read KV head 1's key 40 as a column
    blocks[1, 2:, :, col // bn] = False
    plan = reference.BlockColumnPlan.from_masks(blocks, cols, seqlen=n, block_m=bm, block_n=bn)
    if group > 1:
        # Grouped lists (invariant 6): each group's union of columns, sorted once; every
        # query block reads its causal prefix (columns inside its blocks are skipped).
        rows = -(-qb // group)
        cm = plan.column_mask()
        cm = torch.cat([cm, cm.new_zeros(b, hq, rows * group - qb, n)], 2).view(b, hq, rows, group, n).any(3)
        width = int(cm.sum(-1).max())
        index = torch.sort(torch.where(cm, torch.arange(n), n), dim=-1).values[..., :width]
        last = ((torch.arange(qb) + 1) * bm - 1).clamp(max=n - 1)
        count = (index[:, :, torch.arange(qb) // group] <= last[None, None, :, None]).sum(-1)
        plan = reference.BlockColumnPlan(
            seqlen=n, block_m=bm, block_n=bn, block_count=plan.block_count, block_index=plan.block_index,
            column_count=count.to(torch.int32), column_index=index.clamp(max=n - 1).to(torch.int32),
            column_group=group,
        ).validate()
    q = torch.randn(b, hq, n, d, dtype=torch.bfloat16)
    k = torch.randn(b, hkv, n, d, dtype=torch.bfloat16)
    v = torch.randn(b, hkv, n, d, dtype=torch.bfloat16)
    if value is not None:
        v[1, 1, col, 3] = value
    out, lse = fast.sparse_attention(q, k, v, plan, return_lse=True)
    mask = plan.to_dense_mask()
    ref, ref_lse = reference.sparse_attention(q.double(), k.double(), v.double(), plan, return_lse=True)
    nan_rows = ref.isnan().any(-1)
    assert torch.equal(out.isnan().any(-1), nan_rows)
    assert torch.equal(lse.isnan(), ref_lse.isnan())
    if value is None:
        golden, baseline = golden_attention(q, k, v, mask), baseline_attention(q, k, v, mask)
        check_attention(out, lse, golden, baseline, context="finite values, fast column copy")
    else:
        kept = mask[1, 2:, :, col].any()
        assert bool(kept) and int(nan_rows.sum()) > 0
        assert not bool(nan_rows[0].any()) and not bool(nan_rows[1, :2].any())
        assert bool(out[~nan_rows].isfinite().all())


def _grouped_plan(gen: torch.Generator, n: int, bm: int, bn: int, group: int, b: int = 2,
                  h: int = 2) -> reference.BlockColumnPlan:
    """Random blocks plus each group's sorted column union, every query block reading
    its causal prefix (columns inside its own listed blocks left in on purpose)."""
    qb, kb = -(-n // bm), -(-n // bn)
    blocks = torch.rand(b, h, qb, kb, generator=gen) < 0.4
    plan = reference.BlockColumnPlan.from_masks(blocks, None, seqlen=n, block_m=bm, block_n=bn)
    rows = -(-qb // group)
    cm = torch.rand(b, h, rows, n, generator=gen) < 0.3
    width = max(1, int(cm.sum(-1).max()))
    index = torch.sort(torch.where(cm, torch.arange(n), n), dim=-1).values[..., :width]
    last = ((torch.arange(qb) + 1) * bm - 1).clamp(max=n - 1)
    count = (index[:, :, torch.arange(qb) // group] <= last[None, None, :, None]).sum(-1)
    return reference.BlockColumnPlan(
        seqlen=n, block_m=bm, block_n=bn, block_count=plan.block_count, block_index=plan.block_index,
        column_count=count.to(torch.int32), column_index=index.clamp(max=n - 1).to(torch.int32),
        column_group=group,
    ).validate()


@pytest.mark.parametrize("group", [1, 2, 3])
def test_without_covered_columns_keeps_the_attention(group: int) -> None:
    """Plan-time resolution of covered columns: same kept set, every dropped entry was
    covered (or unread), disjoint exactly when no kept entry is covered for a reader."""
    from sparseprefill.reference.plan import columns_inside_blocks

    gen = torch.Generator().manual_seed(group)
    plan = _grouped_plan(gen, 300, 32, 16, group)
    out = plan.without_covered_columns(chunk_bytes=1)  # one group row per chunk
    out.validate()
    assert torch.equal(out.to_dense_mask(), plan.to_dense_mask())
    assert out.column_group == group and out.column_index.shape[3] <= plan.column_index.shape[3]
    assert bool((out.column_count <= plan.column_count).all())
    reads = torch.arange(out.column_index.shape[3]) < out.column_count.unsqueeze(-1)
    covered = reads & columns_inside_blocks(out.block_count, out.block_index, out.query_block_columns(),
                                            block_n=out.block_n)
    assert out.columns_disjoint == (not bool(covered.any()))
    if group == 1:
        assert out.columns_disjoint and out.equal(plan.with_disjoint_columns())
    # Every query block of a group listing the block of a column: the column goes.
    same = replace(plan, block_count=plan.block_count[:, :, :1].expand_as(plan.block_count).contiguous(),
                   block_index=plan.block_index[:, :, :1].expand_as(plan.block_index).contiguous(),
                   _checked=False)
    same = replace(same, column_count=torch.minimum(same.column_count, same.column_count[:, :, :1]),
                   _checked=False).validate()
    resolved = same.without_covered_columns()
    assert resolved.columns_disjoint and torch.equal(resolved.to_dense_mask(), same.to_dense_mask())


def test_launch_resolves_covered_columns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's front door resolves a grouped plan's covered columns (cached on the
    plan) and gives the attention of the unresolved plan run with the in-kernel test."""
    from sparseprefill.fast.kernels import own_columns

    gen = torch.Generator().manual_seed(7)
    plan = _grouped_plan(gen, 200, 32, 16, 2, b=1)
    q = torch.randn(1, 2, 200, 32, generator=gen).to(torch.float16)
    k = torch.randn(1, 1, 200, 32, generator=gen).to(torch.float16)
    v = torch.randn(1, 1, 200, 32, generator=gen).to(torch.float16)
    out, lse = fast.sparse_attention(q, k, v, plan, return_lse=True)
    resolved = own_columns.resolve_covered_columns(plan)
    assert resolved is not plan and resolved is own_columns.resolve_covered_columns(plan)
    mask = plan.to_dense_mask()
    golden, baseline = golden_attention(q, k, v, mask), baseline_attention(q, k, v, mask)
    check_attention(out, lse, golden, baseline, context="resolved at the front door")
    # Switched off (`RESOLVE_COVERED`, as conformance does): the plan goes to the kernel's test.
    monkeypatch.setattr(own_columns, "RESOLVE_COVERED", False)
    fresh = replace(plan)
    assert own_columns.resolve_covered_columns(fresh) is fresh


def test_narrow_column_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Column tiles narrower than the key tiles (the `SPARSEPREFILL_COL_TILE` switch):
    the same attention, grouped and disjoint lists, columns past several narrow tiles."""
    from sparseprefill.fast.kernels import block_column

    monkeypatch.setattr(block_column, "_COL_TILE", 16)
    gen = torch.Generator().manual_seed(3)
    plan = _grouped_plan(gen, 260, 64, 64, 2, b=1).without_covered_columns()
    assert int(plan.column_count.max()) > 32
    q = torch.randn(1, 2, 260, 32, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 1, 260, 32, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, 1, 260, 32, generator=gen).to(torch.bfloat16)
    out, lse = fast.sparse_attention(q, k, v, plan, return_lse=True)
    mask = plan.to_dense_mask()
    golden, baseline = golden_attention(q, k, v, mask), baseline_attention(q, k, v, mask)
    check_attention(out, lse, golden, baseline, context="16-key column tiles")


def test_unmasked_column_tiles_and_grid_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole column tiles before a query tile's first row run without masks (`_COL_SPLIT`),
    and the tile-major grid (`_TILE_MAJOR`) starts the same programs in another order:
    the same attention either way, on grouped disjoint lists with a head dim that is not
    a power of two, a NaN in V included (unmasked column tiles skip the non-finite step:
    every row keeps every key there)."""
    from sparseprefill.fast.kernels import block_column

    monkeypatch.setattr(block_column, "_COL_SPLIT", True)
    monkeypatch.setattr(block_column, "_TILE_MAJOR", True)
    gen = torch.Generator().manual_seed(5)
    grouped = _grouped_plan(gen, 200, 32, 32, 2, b=1)
    # Blocks with per-query-block disjoint columns, and grouped lists alone (disjoint too).
    plans = [grouped.ungrouped().with_disjoint_columns(),
             replace(grouped, block_count=torch.zeros_like(grouped.block_count), columns_disjoint=True).validate()]
    q = torch.randn(1, 2, 200, 24, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 1, 200, 24, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, 1, 200, 24, generator=gen).to(torch.bfloat16)
    for plan in plans:
        assert int(plan.column_count.max()) > 48
        out, lse = fast.sparse_attention(q, k, v, plan, return_lse=True)
        mask = plan.to_dense_mask()
        golden, baseline = golden_attention(q, k, v, mask), baseline_attention(q, k, v, mask)
        check_attention(out, lse, golden, baseline, context="unmasked column tiles")
    v[0, 0, 7] = float("nan")
    out = fast.sparse_attention(q, k, v, plans[1])
    ref = reference.sparse_attention(q.double(), k.double(), v.double(), plans[1])
    assert torch.equal(torch.isnan(out).any(-1), torch.isnan(ref).any(-1))


def test_column_split_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_column_split`: the unmasked column tiles' copy of the kernel runs where the query
    blocks list on average at least `SPLIT_MIN_COLUMN_TILES` column tiles. The host settles
    what it can (no columns, a capacity below the threshold, lists not disjoint, a dense
    mask, the tuning switch); otherwise a flag on the device picks the copy in the launch,
    and every copy gives the same attention (a NaN in V picks the non-finite copy)."""
    from sparseprefill.fast.kernels import block_column

    monkeypatch.setattr(block_column, "_COL_SPLIT", None)
    gen = torch.Generator().manual_seed(5)
    grouped = _grouped_plan(gen, 200, 32, 32, 2, b=1)
    plan = replace(grouped, block_count=torch.zeros_like(grouped.block_count), columns_disjoint=True).validate()
    cap, mean = plan.column_index.shape[3], float(plan.column_count.float().mean())
    split = block_column._column_split
    assert split(plan, cap + 1) is False                        # capacity below one tile x 2
    assert split(plan, 16, masked=True) is False                # a dense mask: never split
    assert split(replace(plan, columns_disjoint=False), 16) is False
    monkeypatch.setattr(block_column, "SPLIT_MIN_COLUMN_TILES", 1)
    for col_n in (int(mean) - 4, int(mean) + 4):
        flag = split(plan, col_n)
        assert isinstance(flag, torch.Tensor) and int(flag) == int(mean >= col_n)
    monkeypatch.setattr(block_column, "_COL_SPLIT", True)
    assert split(plan, cap + 1) is True


@pytest.mark.slow
def test_column_split_copies_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launch through the device selector (tile 32, one column tile as the threshold:
    the split's copy computes) against the copy forced off, bit for bit; then a NaN in V
    (the non-finite copy computes)."""
    from sparseprefill.fast.kernels import block_column

    monkeypatch.setattr(block_column, "SPLIT_MIN_COLUMN_TILES", 1)
    gen = torch.Generator().manual_seed(5)
    grouped = _grouped_plan(gen, 200, 32, 32, 2, b=1)
    plan = replace(grouped, block_count=torch.zeros_like(grouped.block_count), columns_disjoint=True).validate()
    mean = float(plan.column_count.float().mean())
    q = torch.randn(1, 2, 200, 24, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, 1, 200, 24, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, 1, 200, 24, generator=gen).to(torch.bfloat16)
    assert mean >= 32
    monkeypatch.setattr(block_column, "_COL_SPLIT", False)
    off = fast.sparse_attention(q, k, v, plan)
    monkeypatch.setattr(block_column, "_COL_SPLIT", None)
    assert torch.equal(fast.sparse_attention(q, k, v, plan), off)
    v[0, 0, 7] = float("nan")
    out = fast.sparse_attention(q, k, v, plan)
    ref = reference.sparse_attention(q.double(), k.double(), v.double(), plan)
    assert torch.equal(torch.isnan(out).any(-1), torch.isnan(ref).any(-1))


@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_shared_columns_past_the_budget_run_in_head_chunks(monkeypatch: pytest.MonkeyPatch, slow: bool) -> None:
    """Shared (stride-0) column lists too large to resolve at once (`DISJOINT_COLUMN_BYTES`)
    launch a few query heads at a time (`_head_chunk`: a divisor or a multiple of the GQA
    group), each chunk resolved: the same attention as the kernel's own covered-column test."""
    from sparseprefill.fast.kernels import block_column

    gen = torch.Generator().manual_seed(11)
    n, bm, hq, hkv = 160, 32, 4, 2
    qb, kb = n // bm, n // bm
    blocks = torch.rand(1, hq, qb, kb, generator=gen) < 0.4
    base = reference.BlockColumnPlan.from_masks(blocks, None, seqlen=n, block_m=bm, block_n=bm)
    col_list = torch.sort(torch.randperm(n, generator=gen)[:40]).values.to(torch.int32)
    last = (torch.arange(qb) + 1) * bm - 1
    count = torch.searchsorted(col_list, last.to(torch.int32), right=True).to(torch.int32)
    plan = reference.BlockColumnPlan(
        seqlen=n, block_m=bm, block_n=bm, block_count=base.block_count, block_index=base.block_index,
        column_count=count.view(1, 1, qb).expand(1, hq, qb),
        column_index=col_list.view(1, 1, 1, -1).expand(1, hq, qb, -1)).validate()
    q = torch.randn(1, hq, n, 16, generator=gen).to(torch.bfloat16)
    k = torch.randn(1, hkv, n, 16, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, hkv, n, 16, generator=gen).to(torch.bfloat16)
    per_head = qb * 40 * 4
    call = block_column._KernelCall(q, k, v, plan, 0.25, n, True)
    for fit, chunk in ((0, 0), (1, 1), (3, 2), (4, 0)):  # 0: none fits; 4: all heads fit at once
        monkeypatch.setattr(own_columns_mod(), "DISJOINT_COLUMN_BYTES", fit * per_head)
        assert block_column._head_chunk(plan, call) == chunk
    if not slow:
        return
    monkeypatch.setattr(own_columns_mod(), "DISJOINT_COLUMN_BYTES", 0)
    whole, whole_lse = fast.sparse_attention(q, k, v, plan, return_lse=True)
    for fit in (1, 3):
        monkeypatch.setattr(own_columns_mod(), "DISJOINT_COLUMN_BYTES", fit * per_head)
        out, lse = fast.sparse_attention(q, k, v, plan, return_lse=True)
        torch.testing.assert_close(out, whole, atol=2e-2, rtol=0)
        torch.testing.assert_close(lse, whole_lse, atol=1e-4, rtol=0)


def own_columns_mod() -> object:
    from sparseprefill.fast.kernels import own_columns

    return own_columns
