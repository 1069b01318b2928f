"""Chunked prefill: plans with `query_offset` (queries [P, P + n) against keys [0, P + n))."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import EXAMPLES
from sparseprefill import fast, reference
from sparseprefill.conformance import METHODS
from sparseprefill.conformance.tolerance import nan_poisoned_empty
from sparseprefill.conformance.tolerance import baseline_attention, check_attention, golden_attention
from sparseprefill.reference import BlockColumnPlan
from sparseprefill.reference.chunked import WHOLE_PROMPT, chunk_inputs


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


# -- chunk_plan: any row-local estimator, every registered method that promises it -------------


CHUNKED = [name for name, spec in METHODS.items() if spec.chunked]


def test_every_method_says_whether_it_chunks() -> None:
    """A method with a plan either promises chunked prefill or is refused by chunk_plan."""
    for name, spec in METHODS.items():
        if spec.reference_plan is None or spec.chunked:
            continue
        for fn in (spec.reference_plan, spec.fast_plan):
            assert getattr(fn, "__name__", "") in WHOLE_PROMPT, name
    assert {"dense", "streaming", "vertical_slash", "block_sparse", "a_shape", "minference"} <= set(CHUNKED)


@pytest.mark.parametrize("name", CHUNKED)
@settings(max_examples=max(2, EXAMPLES // 3), deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_chunk_plan_equals_one_shot_rows(name: str, data: st.DataObject) -> None:
    """The plan of chunk [P, P + N) over keys [0, P + N), from the chunk's queries alone, equals
    the one-shot plan of the prompt up to P + N restricted to the chunk's rows, in both
    packages; the fast kernel runs it to the same rows as the reference."""
    spec = METHODS[name]
    total = data.draw(st.integers(90, 230), label="P + N")
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    hkv = data.draw(st.sampled_from([1, 2]), label="Hkv")
    q = torch.randn(2, 2 * hkv, total, 32, generator=gen).half()
    k, v = (torch.randn(2, hkv, total, 32, generator=gen).half() for _ in range(2))
    params = spec.call_params(spec.params(data.draw, total), q)
    for impl, plan_fn, dtype in (("reference", spec.reference_plan, torch.float32),
                                 ("fast", spec.fast_plan, torch.float16)):
        assert plan_fn is not None
        qq, kk = q.to(dtype), k.to(dtype)
        probe = plan_fn(qq, kk, **params)
        align = probe.block_m * probe.column_group
        if total <= align:
            continue
        prefix = align * data.draw(st.integers(1, (total - 1) // align), label=f"{impl} P / align")
        _, _, capped = chunk_inputs(plan_fn, qq[:, :, prefix:], kk, params)
        want = plan_fn(qq, kk, **capped).rows(prefix, total)
        pkg = reference if impl == "reference" else fast
        got = pkg.chunk_plan(plan_fn, qq[:, :, prefix:], kk, **params)
        assert got.query_offset == prefix and got.key_len == total and got.seqlen == total - prefix
        assert got.equal(want), f"{name} ({impl}): chunk [{prefix}, {total}) plan differs from the one-shot rows"
        if impl == "fast":
            with nan_poisoned_empty():
                out = fast.sparse_attention(q[:, :, prefix:], k, v, got)
            mask = torch.zeros(*got.block_count.shape[:2], total, total, dtype=torch.bool)
            mask[:, :, prefix:] = got.to_dense_mask()
            golden = tuple(t[:, :, prefix:] for t in golden_attention(q, k, v, mask))
            baseline = tuple(t[:, :, prefix:] for t in baseline_attention(q, k, v, mask))
            assert check_attention(out, None, golden, baseline, context=f"{name} chunk") <= 1.0


def test_chunk_plan_checks() -> None:
    q, k, _ = _qkv(100, dtype=torch.float32)
    with pytest.raises(ValueError, match="needs the whole prompt"):
        reference.chunk_plan(reference.sample_attention_plan, q[:, :, 64:], k)
    with pytest.raises(ValueError, match="needs the whole prompt"):
        fast.chunk_plan(fast.shareprefill_plan, q[:, :, 64:].half(), k.half())
    with pytest.raises(ValueError, match="headwise_plan needs the whole prompt"):
        reference.chunk_plan(reference.headwise_plan, q[:, :, 64:], k)
    with pytest.raises(ValueError, match=r"multiple of the plan's block_m \* column_group = 32 \* 1"):
        reference.chunk_plan(reference.dense_plan, q[:, :, 40:], k, block_m=32)
    with pytest.raises(ValueError, match="k must hold the prefix and the chunk"):
        reference.chunk_plan(reference.dense_plan, q, k[:, :, :50])
    with pytest.raises(TypeError, match="plan_fn must be a callable"):
        reference.chunk_plan("dense", q, k)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="q must not be empty"):
        reference.chunk_plan(reference.dense_plan, q[:, :, :0], k)
    # The estimate's last queries are the chunk's own: last_q above N is capped.
    plan = reference.chunk_plan(reference.vertical_slash_plan, q[:, :, 64:], k, vertical_size=8,
                                slash_size=8, last_q=1000, block_m=32, block_n=32)
    want = reference.vertical_slash_plan(q, k, vertical_size=8, slash_size=8, last_q=36, block_m=32,
                                         block_n=32).rows(64, 100)
    assert plan.equal(want)
