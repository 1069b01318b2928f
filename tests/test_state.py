"""The shared mechanism's optional extras: `AttentionState` (start from / return the
online-softmax state), `block_mean_out` (mean scaled logit per listed block) and
column lists shared by groups of query blocks (`BlockColumnPlan.column_group`)."""

from __future__ import annotations

import math

import pytest
import torch

from sparseprefill import fast, reference
from sparseprefill.conformance import tolerance
from sparseprefill.conformance.properties import split_plan
from sparseprefill.reference.plan import BlockColumnPlan, cdiv, mask_to_list


def _qkv(b: int = 2, hq: int = 4, hkv: int = 2, n: int = 83, d: int = 32, *, seed: int = 0,
         dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    return q, k, v


def _grouped_plan(q: torch.Tensor, *, block: int = 16, group: int = 3, seed: int = 1,
                  with_blocks: bool = True) -> BlockColumnPlan:
    """Diagonal blocks plus one random column list per group of query blocks.

    The columns lie before the group's first row (as AnchorAttention's stripes do), so
    they never fall inside a diagonal block; each query block reads its causal prefix.
    """
    b, h, n, _ = q.shape
    qb = cdiv(n, block)
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.zeros(b, h, qb, cdiv(n, block), dtype=torch.bool)
    if with_blocks:
        blocks[..., torch.arange(qb), torch.arange(qb)] = True
    diag = BlockColumnPlan.from_masks(blocks, None, seqlen=n, block_m=block, block_n=block)
    rows = cdiv(qb, group)
    last_row = ((torch.arange(qb) + 1) * block - 1).clamp(max=n - 1)
    group_first = torch.arange(rows) * group * block
    pick = (torch.rand(b, h, rows, n, generator=gen) < 0.3) & (torch.arange(n) < group_first[:, None])
    count, index = mask_to_list(pick)
    owner = torch.arange(qb) // group
    listed = index[:, :, owner]
    valid = torch.arange(index.shape[-1]) < count[:, :, owner].unsqueeze(-1)
    per_block = (valid & (listed <= last_row[:, None])).sum(-1).to(torch.int32)
    return BlockColumnPlan(seqlen=n, block_m=block, block_n=block, block_count=diag.block_count,
                           block_index=diag.block_index, column_count=per_block, column_index=index,
                           column_group=group).validate()


# -- AttentionState -------------------------------------------------------------------


def test_state_merge_output_lse_match_one_pass() -> None:
    q, k, v = (t.double() for t in _qkv())
    plan = _grouped_plan(q)
    part_a, part_b = split_plan(plan, seed=3)
    out, lse = reference.sparse_attention(q, k, v, plan, return_lse=True)
    a, b = (reference.AttentionState.like(q, dtype=torch.float64) for _ in range(2))
    reference.sparse_attention(q, k, v, part_a, state=a)
    reference.sparse_attention(q, k, v, part_b, state=b)
    merged = a.merge(b)
    torch.testing.assert_close(merged.output(), out, rtol=0, atol=1e-12)
    torch.testing.assert_close(merged.lse().float(), lse, rtol=0, atol=1e-5)
    # Chained through one state: the same numbers, and the state holds them.
    chained = reference.AttentionState.like(q, dtype=torch.float64)
    reference.sparse_attention(q, k, v, part_a, state=chained)
    out2 = reference.sparse_attention(q, k, v, part_b, state=chained)
    torch.testing.assert_close(out2, out, rtol=0, atol=1e-12)
    torch.testing.assert_close(chained.output(), out, rtol=0, atol=1e-12)


def test_empty_state_rows_give_zero_and_minus_inf() -> None:
    state = reference.AttentionState.empty(1, 2, 5, 4)
    assert torch.equal(state.output(), torch.zeros(1, 2, 5, 4))
    assert bool((state.lse() == -math.inf).all())
    merged = state.merge(state.clone())
    assert bool((merged.lse() == -math.inf).all()) and not bool(merged.output().isnan().any())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fast_resumes_from_state_in_three_calls(dtype: torch.dtype) -> None:
    """Grouped columns, then the diagonal blocks in two halves, chained: one pass."""
    q, k, v = _qkv(dtype=dtype, n=111)
    whole = _grouped_plan(q, block=16, group=2)
    columns = _grouped_plan(q, block=16, group=2, with_blocks=False)
    diagonal = BlockColumnPlan.from_masks(whole.block_mask(), None, seqlen=111, block_m=16, block_n=16)
    part_a, part_b = split_plan(diagonal, seed=5)
    mask = whole.to_dense_mask()
    golden = tolerance.golden_attention(q, k, v, mask)
    baseline = tolerance.baseline_attention(q, k, v, mask)
    state = fast.AttentionState.like(q)
    fast.sparse_attention(q, k, v, columns, state=state)
    fast.sparse_attention(q, k, v, part_a, state=state)
    out, lse = fast.sparse_attention(q, k, v, part_b, state=state, return_lse=True)
    assert tolerance.check_attention(out, lse, golden, baseline) <= 1.0
    assert tolerance.check_attention(state.output(dtype), state.lse(), golden, baseline) <= 1.0


def test_fast_grouped_columns_equal_ungrouped() -> None:
    q, k, v = _qkv(n=97)
    plan = _grouped_plan(q, block=16, group=3)
    flat = plan.ungrouped()
    assert flat.column_group == 1 and plan.equal(flat) and flat.equal(plan)
    assert torch.equal(plan.to_dense_mask(), flat.to_dense_mask())
    out_g, lse_g = fast.sparse_attention(q, k, v, plan, return_lse=True)
    out_f, lse_f = fast.sparse_attention(q, k, v, flat, return_lse=True)
    assert torch.equal(out_g, out_f) and torch.equal(lse_g, lse_f)
    assert torch.equal(fast.density(plan), reference.density(flat))


def test_grouped_plan_validation_rejects() -> None:
    q, _, _ = _qkv(n=97)
    plan = _grouped_plan(q, block=16, group=3)
    bad_rows = BlockColumnPlan(**{**_fields(plan), "column_index": plan.query_block_columns()})
    with pytest.raises(ValueError, match=r"plan.column_index must have shape \[2, 4, 3, width\]"):
        bad_rows.validate()
    # A query block that reads past its causal horizon in its group's list: the first
    # block of a group reading a column of the group's later rows.
    index = plan.column_index.clone()
    count = plan.column_count.clone()
    # Group 1 is query blocks 3, 4, 5 (rows 48..96); its list starts with key 64.
    index[0, 0, 1, 0] = 64
    index[0, 0, 1, 1:] = torch.arange(65, 65 + index.shape[-1] - 1)
    count[0, 0, 3:6] = torch.tensor([1, 1, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="not causal"):  # rows 48..63 cannot see key 64
        BlockColumnPlan(**{**_fields(plan), "column_index": index, "column_count": count}).validate()
    count[0, 0, 3] = 0  # rows 64..79 and 80..96 may
    BlockColumnPlan(**{**_fields(plan), "column_index": index, "column_count": count}).validate()
    unsorted = plan.column_index.clone()
    unsorted[0, 0, 1, :2] = unsorted[0, 0, 1, :2].flip(0)
    with pytest.raises(ValueError, match="strictly increasing"):
        BlockColumnPlan(**{**_fields(plan), "column_index": unsorted}).validate()
    with pytest.raises(ValueError, match="plan.column_group must be >= 1"):
        BlockColumnPlan(**{**_fields(plan), "column_group": 0}).validate()


def _fields(plan: BlockColumnPlan) -> dict[str, object]:
    return {"seqlen": plan.seqlen, "block_m": plan.block_m, "block_n": plan.block_n,
            "block_count": plan.block_count, "block_index": plan.block_index,
            "column_count": plan.column_count, "column_index": plan.column_index,
            "column_group": plan.column_group}


# -- block means ------------------------------------------------------------------


def test_block_means_match_a_plain_computation() -> None:
    q, k, v = _qkv(n=70)
    plan = fast.streaming_plan(q, k, sink=16, window=20, block_m=32, block_n=16)
    got = torch.full((2, 4, 3, 5), math.nan)
    fast.sparse_attention(q, k, v, plan, block_mean_out=got)
    kk = k.double().repeat_interleave(2, dim=1)
    scores = q.double() @ kk.transpose(-1, -2) / math.sqrt(32)
    listed = plan.block_mask()
    for i in range(3):
        for j in range(5):
            rows, keys = torch.arange(i * 32, min(70, i * 32 + 32)), torch.arange(j * 16, min(70, j * 16 + 16))
            causal = keys[None, :] <= rows[:, None]
            if not bool(listed[0, 0, i, j]) or not bool(causal.any()):
                assert bool((got[:, :, i, j] == -math.inf).all())
                continue
            want = scores[:, :, rows][:, :, :, keys][..., causal].mean(dim=-1)
            torch.testing.assert_close(got[:, :, i, j].double(), want, rtol=0, atol=1e-5)


def test_extras_reject_bad_buffers() -> None:
    q, k, v = _qkv(n=40)
    plan = fast.dense_plan(q, k, block_m=16, block_n=16)
    for impl in (fast, reference):
        with pytest.raises(ValueError, match=r"block_mean_out must have shape \[B, Hq, Qb, Kb\]"):
            impl.sparse_attention(q, k, v, plan, block_mean_out=torch.empty(2, 4, 3, 2))
        with pytest.raises(TypeError, match="block_mean_out must have dtype float32"):
            impl.sparse_attention(q, k, v, plan, block_mean_out=torch.empty(2, 4, 3, 3, dtype=torch.float64))
        with pytest.raises(ValueError, match=r"state.acc must have shape \[2, 4, 40, 32\]"):
            impl.sparse_attention(q, k, v, plan, state=reference.AttentionState.empty(2, 4, 40, 16))
        with pytest.raises(TypeError, match="state must be an AttentionState"):
            impl.sparse_attention(q, k, v, plan, state=(1, 2, 3))  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"state.m must have one dtype in \(float32\)"):
        fast.sparse_attention(q, k, v, plan, state=reference.AttentionState.like(q, dtype=torch.float64))
