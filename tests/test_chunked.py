"""Chunked prefill: plans with `query_offset` (queries [P, P + n) against keys [0, P + n))."""

from __future__ import annotations

import pytest
import torch

from sparseprefill import fast, reference
from sparseprefill.conformance.properties import nan_poisoned_empty
from sparseprefill.conformance.tolerance import baseline_attention, check_attention, golden_attention
from sparseprefill.reference import BlockColumnPlan


def _qkv(n: int, *, b: int = 2, hq: int = 4, hkv: int = 2, d: int = 32, seed: int = 0,
         dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))


def _plan(q: torch.Tensor, k: torch.Tensor) -> BlockColumnPlan:
    """A vertical-slash plan with grouped-free columns, 32 x 16 blocks."""
    return reference.vertical_slash_plan(q, k, vertical_size=12, slash_size=10, last_q=16,
                                         block_m=32, block_n=16)


@pytest.mark.parametrize("cuts", [(64, 128), (32,), (96, 160, 192)])
def test_chunks_equal_one_shot_reference(cuts: tuple[int, ...]) -> None:
    q, k, v = _qkv(211, dtype=torch.float32)
    plan = _plan(q, k)
    whole, whole_lse = reference.sparse_attention(q, k, v, plan, return_lse=True)
    bounds = [0, *cuts, 211]
    for start, stop in zip(bounds, bounds[1:]):
        part = plan.rows(start, stop)
        assert part.query_offset == start and part.seqlen == stop - start and part.key_len == stop
        assert torch.equal(part.to_dense_mask(), plan.to_dense_mask()[:, :, start:stop, :stop])
        out, lse = reference.sparse_attention(q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop], part,
                                              return_lse=True)
        torch.testing.assert_close(out, whole[:, :, start:stop], rtol=0, atol=1e-6)
        torch.testing.assert_close(lse, whole_lse[:, :, start:stop], rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_chunks_equal_one_shot_fast(dtype: torch.dtype) -> None:
    q, k, v = _qkv(211, dtype=dtype, seed=1)
    plan = _plan(q, k)
    whole = fast.sparse_attention(q, k, v, plan)
    for start, stop in ((0, 64), (64, 160), (160, 211)):
        part = plan.rows(start, stop)
        qs, ks, vs = q[:, :, start:stop], k[:, :, :stop], v[:, :, :stop]
        mask = part.to_dense_mask()
        # The golden of the chunk: the whole prompt's masked attention, those rows.
        full_mask = torch.zeros(*mask.shape[:2], stop, stop, dtype=torch.bool)
        full_mask[:, :, start:] = mask
        golden = tuple(t[:, :, start:] for t in golden_attention(q[:, :, :stop], ks, vs, full_mask))
        baseline = tuple(t[:, :, start:] for t in baseline_attention(q[:, :, :stop], ks, vs, full_mask))
        with nan_poisoned_empty():
            out, lse = fast.sparse_attention(qs, ks, vs, part, return_lse=True)
        assert check_attention(out, lse, golden, baseline, context=f"rows [{start}, {stop})") <= 1.0
        # The kernel's rows of a chunk are those of the one-shot launch, bit for bit.
        assert torch.equal(out, whole[:, :, start:stop])


def test_unaligned_offset_plan_and_state_chaining() -> None:
    """A plan built for a chunk starting off the block grid (P = 37), split in two
    launches through the shared state, equals the single launch."""
    q, k, v = _qkv(150, seed=2)
    p, n = 37, 113
    dense = reference.dense_plan(q[:, :, p:], k, block_m=32, block_n=16)
    assert dense.query_offset == p and dense.key_len == 150
    golden = golden_attention(q, k, v, None)
    baseline = baseline_attention(q, k, v, None)
    with nan_poisoned_empty():
        out, lse = fast.sparse_attention(q[:, :, p:], k, v, fast.dense_plan(q[:, :, p:], k, block_m=32, block_n=16),
                                         return_lse=True)
    assert check_attention(out, lse, tuple(t[:, :, p:] for t in golden),
                           tuple(t[:, :, p:] for t in baseline)) <= 1.0
    ref = reference.sparse_attention(q[:, :, p:].float(), k.float(), v.float(), dense)
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=2e-3)
    assert n == q.shape[2] - p


def test_offset_checks() -> None:
    q, k, v = _qkv(100)
    plan = reference.dense_plan(q[:, :, 40:], k, block_m=16, block_n=16)
    with pytest.raises(ValueError, match=r"P \+ N=100 \(query_offset=40\)"):
        reference.sparse_attention(q[:, :, 40:], k[:, :, :90], v[:, :, :90], plan)
    with pytest.raises(ValueError, match="query_offset"):
        fast.sparse_attention(q[:, :, 40:], k[:, :, :99], v[:, :, :99], plan)
    with pytest.raises(ValueError, match="multiples of block_m"):
        plan.rows(5, 32)
    with pytest.raises(ValueError, match="0 <= start < stop"):
        plan.rows(32, 32)
    bad = BlockColumnPlan(seqlen=60, block_m=16, block_n=16, block_count=plan.block_count,
                          block_index=plan.block_index, column_count=plan.column_count,
                          column_index=plan.column_index, query_offset=-1)
    with pytest.raises(ValueError, match="plan.query_offset"):
        bad.validate()
    # A listed block past the chunk's causal horizon is rejected.
    late = BlockColumnPlan(seqlen=60, block_m=16, block_n=16, block_count=torch.ones(2, 4, 4, dtype=torch.int32),
                           block_index=torch.full((2, 4, 4, 1), 5, dtype=torch.int32),
                           column_count=torch.zeros(2, 4, 4, dtype=torch.int32),
                           column_index=torch.zeros(2, 4, 4, 0, dtype=torch.int32), query_offset=40)
    with pytest.raises(ValueError, match="not causal"):
        late.validate()
