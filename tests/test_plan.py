"""`BlockColumnPlan`: every invariant of `validate`, dense masks of hand-built plans,
`from_masks` round trips, expanded-view plans, `equal` ignoring padding and columns
inside listed blocks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sparseprefill import fast, reference
from sparseprefill.reference import BlockColumnPlan
from sparseprefill.reference.plan import mask_to_list


def i32(values: object) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def small_plan() -> BlockColumnPlan:
    """N=5, 2x2 blocks: query blocks {0,1}, {2,3}, {4}; key blocks {0,1}, {2,3}, {4}.

    Query block 0 lists key block 0; block 1 lists no block and column 0; block 2
    lists key block 2 and columns 1 and 3. Padding entries are garbage on purpose.
    """
    return BlockColumnPlan(
        seqlen=5, block_m=2, block_n=2,
        block_count=i32([[[1, 0, 1]]]),
        block_index=i32([[[[0, 77]], [[-4, 9]], [[2, 2]]]]).squeeze(3).reshape(1, 1, 3, 2),
        column_count=i32([[[0, 1, 2]]]),
        column_index=i32([[[[5, 5]], [[0, -1]], [[1, 3]]]]).reshape(1, 1, 3, 2),
    )


SMALL_EXPECTED = torch.tensor([
    # key: 0  1  2  3  4
    [1, 0, 0, 0, 0],  # row 0: block 0, causal
    [1, 1, 0, 0, 0],  # row 1: block 0
    [1, 0, 0, 0, 0],  # row 2: column 0
    [1, 0, 0, 0, 0],  # row 3: column 0
    [0, 1, 0, 1, 1],  # row 4: columns 1, 3 and block 2 (key 4)
], dtype=torch.bool)


def test_small_plan_dense_mask() -> None:
    plan = small_plan().validate()
    assert torch.equal(plan.to_dense_mask()[0, 0], SMALL_EXPECTED)
    assert torch.equal(plan.block_mask()[0, 0], torch.tensor(
        [[1, 0, 0], [0, 0, 0], [0, 0, 1]], dtype=torch.bool))
    assert torch.equal(plan.column_mask()[0, 0, 2], torch.tensor([0, 1, 0, 1, 0], dtype=torch.bool))


def test_small_plan_density_and_recall_agree_with_the_mask() -> None:
    plan = small_plan()
    mask = SMALL_EXPECTED.view(1, 1, 5, 5)
    assert torch.equal(reference.density(plan), reference.density(mask))
    assert torch.equal(fast.density(plan), reference.density(mask))
    assert float(reference.density(plan)) == pytest.approx(8 / 15)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 1, 5, 16, generator=gen), torch.randn(1, 1, 5, 16, generator=gen)
    assert torch.equal(reference.recall(q, k, plan), reference.recall(q, k, mask))


def test_block_larger_than_sequence() -> None:
    plan = BlockColumnPlan(seqlen=3, block_m=16, block_n=64, block_count=i32([[[1]]]),
                           block_index=i32([[[[0]]]]), column_count=i32([[[0]]]),
                           column_index=torch.zeros(1, 1, 1, 0, dtype=torch.int32)).validate()
    assert torch.equal(plan.to_dense_mask()[0, 0], torch.ones(3, 3, dtype=torch.bool).tril())


def test_from_masks_round_trip() -> None:
    gen = torch.Generator().manual_seed(3)
    n, bm, bn = 37, 16, 8
    qb, kb = 3, 5
    blocks = torch.rand(2, 3, qb, kb, generator=gen) < 0.5
    columns = torch.rand(2, 3, qb, n, generator=gen) < 0.2
    plan = BlockColumnPlan.from_masks(blocks, columns, seqlen=n, block_m=bm, block_n=bn)
    again = BlockColumnPlan.from_masks(plan.block_mask(), plan.column_mask(), seqlen=n,
                                       block_m=bm, block_n=bn)
    assert plan.equal(again) and again.equal(plan)
    # from_masks drops non-causal blocks and columns inside kept blocks; what is kept
    # is exactly the causal part of blocks | columns.
    keys = blocks.repeat_interleave(bn, dim=3)[..., :n] | columns
    expected = keys.repeat_interleave(bm, dim=2)[:, :, :n] & torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(plan.to_dense_mask(), expected)
    assert not bool((plan.column_mask() & plan.block_mask().repeat_interleave(bn, 3)[..., :n]).any())


def test_from_masks_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="block_mask"):
        BlockColumnPlan.from_masks(torch.ones(1, 1, 2, 2, dtype=torch.bool), None, seqlen=40,
                                   block_m=16, block_n=16)
    with pytest.raises(ValueError, match="column_mask"):
        BlockColumnPlan.from_masks(torch.ones(1, 1, 3, 3, dtype=torch.bool),
                                   torch.ones(1, 1, 3, 39, dtype=torch.bool), seqlen=40,
                                   block_m=16, block_n=16)
    with pytest.raises(ValueError, match="seqlen"):
        BlockColumnPlan.from_masks(torch.ones(1, 1, 1, 1, dtype=torch.bool), None, seqlen=0,
                                   block_m=16, block_n=16)


def test_expanded_views() -> None:
    n, bm, bn = 50, 16, 16
    blocks = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    blocks[..., 1] = False
    columns = torch.zeros(1, 1, 4, n, dtype=torch.bool)
    columns[..., 17] = True
    one = BlockColumnPlan.from_masks(blocks, columns, seqlen=n, block_m=bm, block_n=bn)
    fields = {f: getattr(one, f).expand(2, 3, *getattr(one, f).shape[2:])
              for f in ("block_count", "block_index", "column_count", "column_index")}
    shared = replace(one, **fields).validate()
    assert shared.block_index.stride()[:2] == (0, 0)
    full = BlockColumnPlan.from_masks(blocks.expand(2, 3, 4, 4), columns.expand(2, 3, 4, n),
                                      seqlen=n, block_m=bm, block_n=bn)
    assert shared.equal(full)
    assert torch.equal(shared.to_dense_mask(), full.to_dense_mask())
    assert shared.nbytes() < full.nbytes()
    assert torch.equal(reference.density(shared), fast.density(shared))


def test_equal_ignores_padding_and_sees_differences() -> None:
    a = small_plan()
    b = replace(a, block_index=torch.where(torch.arange(2) < a.block_count.unsqueeze(-1),
                                           a.block_index, 123))
    assert a.equal(b)
    c = replace(a, column_count=i32([[[0, 1, 1]]]))
    assert not a.equal(c)
    assert not a.equal(replace(a, block_m=4, block_count=i32([[[1, 1]]]),
                               block_index=i32([[[[0], [0]]]]), column_count=i32([[[0, 0]]]),
                               column_index=torch.zeros(1, 1, 2, 0, dtype=torch.int32)))


# -- every invariant of validate -------------------------------------------------


def base() -> BlockColumnPlan:
    """N=64, 16x16 blocks, one (batch, head); valid, with room in the lists."""
    blocks = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    blocks[0, 0, 2, 0] = blocks[0, 0, 2, 2] = True
    columns = torch.zeros(1, 1, 4, 64, dtype=torch.bool)
    columns[0, 0, 2, 20] = columns[0, 0, 2, 40] = True
    plan = BlockColumnPlan.from_masks(blocks, columns, seqlen=64, block_m=16, block_n=16)
    return plan


def with_entries(plan: BlockColumnPlan, kind: str, values: list[int], qblock: int = 2) -> BlockColumnPlan:
    count = getattr(plan, f"{kind}_count").clone()
    old = getattr(plan, f"{kind}_index")
    index = torch.zeros(1, 1, 4, 4, dtype=torch.int32)
    index[..., : old.shape[3]] = old
    index[0, 0, qblock] = 0
    index[0, 0, qblock, : len(values)] = i32(values)
    count[0, 0, qblock] = len(values)
    return replace(plan, **{f"{kind}_count": count, f"{kind}_index": index})


@pytest.mark.parametrize("kind,values,match", [
    ("block", [2, 0], r"plan\.block_index is not strictly increasing"),
    ("block", [0, 0], r"plan\.block_index is not strictly increasing"),
    ("block", [0, 4], r"plan\.block_index has an entry outside \[0, 4\)"),
    ("block", [-1, 0], r"plan\.block_index has an entry outside"),
    ("block", [0, 3], r"plan\.block_index lists a key block .* \(not causal\)"),
    ("column", [40, 20], r"plan\.column_index is not strictly increasing"),
    ("column", [20, 20], r"plan\.column_index is not strictly increasing"),
    ("column", [20, 64], r"plan\.column_index has an entry outside \[0, 64\)"),
    ("column", [20, 48], r"plan\.column_index lists a key column after the last row"),
])
def test_validate_rejects_list_violations(kind: str, values: list[int], match: str) -> None:
    plan = with_entries(base(), kind, values)
    with pytest.raises(ValueError, match=match):
        plan.validate()


def test_validate_accepts_columns_inside_listed_blocks() -> None:
    """Invariant 4 allows a column to repeat keys of a listed block; `equal` ignores it."""
    plan = base()  # query block 2: key blocks 0 and 2, column 20
    for values in ([5, 20], [20, 32], [0, 15, 20, 33]):
        shared = with_entries(plan, "column", values).validate()
        assert shared.equal(plan) and plan.equal(shared)
        assert torch.equal(shared.to_dense_mask(), plan.to_dense_mask())
        assert torch.equal(fast.density(shared), reference.density(plan))
    # A column outside the listed blocks is a real difference.
    assert not with_entries(plan, "column", [5, 20, 21]).equal(plan)
    assert not plan.equal(with_entries(plan, "column", [5]))


def test_validate_accepts_boundary_entries() -> None:
    with_entries(base(), "block", [0, 3], qblock=3).validate()  # starts at the last row
    with_entries(base(), "column", [0, 31], qblock=1).validate()  # 31: the last row
    plan = with_entries(base(), "column", [63], qblock=3)
    plan.validate()


@pytest.mark.parametrize("count,match", [
    (5, r"plan\.block_count must lie in \[0, 4\]"),
    (-1, r"plan\.block_count must lie in \[0, 4\]"),
])
def test_validate_rejects_counts(count: int, match: str) -> None:
    plan = base()
    index = torch.zeros(1, 1, 4, 4, dtype=torch.int32)
    counts = plan.block_count.clone()
    counts[0, 0, 1] = count
    with pytest.raises(ValueError, match=match):
        replace(plan, block_count=counts, block_index=index).validate()


def test_validate_rejects_column_count_over_width() -> None:
    plan = base()
    counts = plan.column_count.clone()
    counts[0, 0, 0] = plan.column_index.shape[3] + 1
    with pytest.raises(ValueError, match=r"plan\.column_count must lie in"):
        replace(plan, column_count=counts).validate()


@pytest.mark.parametrize("field", ["block_count", "block_index", "column_count", "column_index"])
def test_validate_rejects_dtype(field: str) -> None:
    plan = base()
    bad = replace(plan, **{field: getattr(plan, field).to(torch.int64)})
    with pytest.raises(TypeError, match=rf"plan\.{field} must have dtype int32"):
        bad.validate()


@pytest.mark.parametrize("field", ["block_count", "block_index", "column_count", "column_index"])
def test_validate_rejects_non_tensor(field: str) -> None:
    bad = replace(base(), **{field: getattr(base(), field).tolist()})
    with pytest.raises(TypeError, match=rf"plan\.{field} must be a torch\.Tensor"):
        bad.validate()


@pytest.mark.parametrize("field", ["block_index", "column_count", "column_index"])
def test_validate_rejects_device(field: str) -> None:
    plan = base()
    bad = replace(plan, **{field: getattr(plan, field).to("meta")})
    with pytest.raises(ValueError, match=rf"plan\.{field} is on meta"):
        bad.validate()


@pytest.mark.parametrize("field,shape,match", [
    ("block_count", (1, 1, 3), r"plan\.block_count must have shape \[B, Hq, Qb=4\]"),
    ("block_count", (1, 4), r"plan\.block_count must have shape"),
    ("block_index", (1, 1, 3, 2), r"plan\.block_index must have shape \[1, 1, 4, width\]"),
    ("block_index", (1, 1, 4), r"plan\.block_index must have shape"),
    ("column_index", (1, 2, 4, 2), r"plan\.column_index must have shape"),
    ("column_count", (1, 1, 5), r"plan\.column_count must have shape"),
])
def test_validate_rejects_shapes(field: str, shape: tuple[int, ...], match: str) -> None:
    bad = replace(base(), **{field: torch.zeros(shape, dtype=torch.int32)})
    with pytest.raises(ValueError, match=match):
        bad.validate()


@pytest.mark.parametrize("field,value,error", [
    ("seqlen", 0, ValueError), ("block_m", 0, ValueError), ("block_n", -16, ValueError),
    ("seqlen", 64.0, TypeError), ("block_m", True, TypeError), ("block_n", "16", TypeError),
])
def test_validate_rejects_sizes(field: str, value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match=rf"plan\.{field}"):
        replace(base(), **{field: value}).validate()


def test_empty_plan_is_valid_and_masks_everything() -> None:
    plan = BlockColumnPlan.from_masks(torch.zeros(2, 1, 3, 3, dtype=torch.bool), None,
                                      seqlen=40, block_m=16, block_n=16)
    assert plan.block_index.shape[3] == 0 and plan.column_index.shape[3] == 0
    assert not bool(plan.to_dense_mask().any())
    assert bool((reference.density(plan) == 0).all())


def _grouped_plan(seed: int, *, n: int, bm: int, bn: int, g: int, causal_prefix: bool,
                  disjoint: bool) -> BlockColumnPlan:
    """Random grouped column rows holding some whole key blocks, plus random blocks."""
    gen = torch.Generator().manual_seed(seed)
    b, h = 2, 3
    qb, kb = -(-n // bm), -(-n // bn)
    rows = -(-qb // g)
    last_row = ((torch.arange(qb) + 1) * bm - 1).clamp(max=n - 1)
    blocks = (torch.rand(b, h, qb, kb, generator=gen) < 0.2) & (torch.arange(kb) * bn <= last_row[:, None])
    bcount, bindex = mask_to_list(blocks)
    row_masks = torch.zeros(b, h, rows, n, dtype=torch.bool)
    for r in range(rows):
        whole = torch.rand(b, h, kb, generator=gen) < 0.4
        row_masks[:, :, r] = whole.repeat_interleave(bn, dim=2)[..., :n] | (torch.rand(b, h, n, generator=gen) < 0.2)
    if disjoint:  # no column inside a listed block of any query block of the row
        owner = torch.arange(qb) // g
        for r in range(rows):
            listed = blocks[:, :, owner == r].any(dim=2).repeat_interleave(bn, dim=2)[..., :n]
            row_masks[:, :, r] &= ~listed
    ccount_rows, cindex = mask_to_list(row_masks)
    counts = torch.zeros(b, h, qb, dtype=torch.int32)
    for i in range(qb):
        causal = (cindex[:, :, i // g] <= last_row[i]) & (torch.arange(cindex.shape[3]) < ccount_rows[:, :, i // g, None])
        c = causal.sum(-1)
        if not causal_prefix:
            c = (c.float() * torch.rand(b, h, generator=gen)).floor().to(torch.int64)
        counts[:, :, i] = c
    return BlockColumnPlan(seqlen=n, block_m=bm, block_n=bn, block_count=bcount, block_index=bindex,
                           column_count=counts, column_index=cindex, columns_disjoint=disjoint,
                           column_group=g).validate()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n,bm,bn,g", [(200, 32, 16, 3), (111, 16, 16, 1), (257, 64, 32, 2), (63, 16, 32, 4)])
@pytest.mark.parametrize("causal_prefix", [True, False])
def test_with_full_blocks_keeps_the_attention(seed: int, n: int, bm: int, bn: int, g: int,
                                              causal_prefix: bool) -> None:
    plan = _grouped_plan(seed, n=n, bm=bm, bn=bn, g=g, causal_prefix=causal_prefix, disjoint=seed % 2 == 0)
    moved = plan.with_full_blocks()
    moved.validate()
    assert torch.equal(moved.to_dense_mask(), plan.to_dense_mask())
    assert moved.column_group == g and moved.columns_disjoint == plan.columns_disjoint
    if causal_prefix:  # every row holds whole blocks: some must have moved
        assert int(moved.column_count.sum()) < int(plan.column_count.sum())


def test_with_full_blocks_vetoes_a_prefix_ending_inside_a_visible_block() -> None:
    # One query block of 32 rows, one row of columns holding key block 0 (keys 0-15)
    # whole, but the query block reads only the first 5: keys 5-15 are visible to it,
    # so promoting the block would add them.
    # A second query block of the same group reads the whole row.
    plan = BlockColumnPlan(seqlen=64, block_m=32, block_n=16, block_count=i32([[[0, 0]]]),
                           block_index=torch.zeros(1, 1, 2, 0, dtype=torch.int32),
                           column_count=i32([[[5, 16]]]), column_index=torch.arange(16, dtype=torch.int32).view(1, 1, 1, 16),
                           column_group=2).validate()
    assert plan.with_full_blocks() is plan
    whole = replace(plan, column_count=i32([[[16, 16]]])).validate()
    moved = whole.with_full_blocks()
    assert moved.block_count.tolist() == [[[1, 1]]] and moved.column_count.tolist() == [[[0, 0]]]
    assert torch.equal(moved.to_dense_mask(), whole.to_dense_mask())


@pytest.mark.parametrize("seed", range(2))
def test_with_full_blocks_kernel_output(seed: int) -> None:
    """The kernel gives the same output on the promoted plan (its new diagonal blocks
    included) under the tolerance policy."""
    from sparseprefill.conformance.properties import check_sparse_attention

    plan = _grouped_plan(seed, n=200, bm=32, bn=16, g=3, causal_prefix=True, disjoint=True)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 200, 32, generator=gen).half()
    k = torch.randn(2, 3, 200, 32, generator=gen).half()
    v = torch.randn(2, 3, 200, 32, generator=gen).half()
    moved = plan.with_full_blocks()
    assert int(moved.block_count.sum()) > int(plan.block_count.sum())
    check_sparse_attention(q, k, v, moved, context="promoted plan")
