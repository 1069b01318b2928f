"""`BlockColumnPlan`: every invariant of `validate`, dense masks of hand-built plans,
`from_masks` round trips, expanded-view plans, `equal` ignoring padding and columns
inside listed blocks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sparseprefill import fast, reference
from sparseprefill.reference import BlockColumnPlan


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
