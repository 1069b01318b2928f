"""Hostile inputs that pass the argument checks: what each package does with them.

* huge ints: a count parameter far past N means the same as "everything" (no int64
  overflow changes its meaning); block sizes past `MAX_BLOCK_SIZE` are refused
  (test_validation.py);
* NaN and infinities: they reach exactly the rows that keep them, in both packages
  (the rule is in reference/attention.py's module doc; the conformance property
  `nonfinite` checks it on random plans); estimators rank NaN scores last and keep
  their forced lines;
* plans changed after validation: wrong numbers, never an out-of-bounds access;
* autograd: `fast` is forward-only and says so instead of returning detached outputs.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import pytest
import torch

from sparseprefill import fast, reference
from sparseprefill.conformance import METHODS
from sparseprefill.reference import BlockColumnPlan

PACKAGES = {"reference": reference, "fast": fast}
N = 40


def _qkv(dtype: torch.dtype = torch.float16, n: int = N, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 4, n, 32, generator=gen).to(dtype),
            torch.randn(2, 2, n, 32, generator=gen).to(dtype),
            torch.randn(2, 2, n, 32, generator=gen).to(dtype))


def _count_params() -> list[tuple[str, str, str]]:
    """(package, method, int parameter) for every registered method's non-block int
    parameters (plan functions; the reference run of methods without a plan)."""
    out = []
    for pkg_name, pkg in PACKAGES.items():
        for spec in METHODS.values():
            if not spec.plan_based and pkg_name == "fast":
                continue
            fn = spec.plan_fn(pkg_name) if spec.plan_based else spec.reference_run
            for p in inspect.signature(fn).parameters.values():
                if (p.kind is p.KEYWORD_ONLY and p.annotation in ("int", int) and "block" not in p.name
                        and p.name != "layer"):  # an index into a config, not a count
                    out.append((pkg_name, spec.name, p.name))
    return out


@pytest.mark.parametrize("pkg,method,param", _count_params())
def test_huge_counts_mean_everything(pkg: str, method: str, param: str) -> None:
    """`param=2**63` (or 2**40) plans (or computes) exactly what `param=4 N` does."""
    q, k, v = _qkv()
    spec = METHODS[method]
    params = spec.call_params(spec.demo_params(N), q)
    if spec.plan_based:
        fn = spec.plan_fn(pkg)
        base = fn(q, k, **{**params, param: 4 * N})
        for huge in (2**40, 2**63):
            got = fn(q, k, **{**params, param: huge})
            assert got.equal(base), f"{pkg}.{method}_plan({param}={huge}) differs from {param}={4 * N}"
        return
    base_out = spec.reference_run(q, k, v, **{**params, param: 4 * N})
    for huge in (2**40, 2**63):
        got_out = spec.reference_run(q, k, v, **{**params, param: huge})
        assert torch.equal(got_out, base_out), f"{method}({param}={huge}) differs from {param}={4 * N}"


@pytest.mark.parametrize("pkg", PACKAGES)
def test_streaming_huge_sink_keeps_everything(pkg: str) -> None:
    q, k, _ = _qkv()
    plan = PACKAGES[pkg].streaming_plan(q, k, sink=2**63, window=1, block_m=16, block_n=16)
    assert plan.equal(reference.dense_plan(q, k, block_m=16, block_n=16))


# -- NaN and infinities ------------------------------------------------------------------


@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nonfinite_reaches_the_same_rows(where: str, value: float) -> None:
    q, k, v = _qkv()
    inputs = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    inputs[where][1, 1, 17, 3] = value
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    plan = reference.streaming_plan(q, k, sink=16, window=8, block_m=16, block_n=16)
    out, lse = fast.sparse_attention(q, k, v, plan, return_lse=True)
    ref, ref_lse = reference.sparse_attention(q.double(), k.double(), v.double(), plan, return_lse=True)
    assert torch.equal(out.isnan().any(-1), ref.isnan().any(-1))
    assert torch.equal(lse.isnan(), ref_lse.isnan())
    nan_rows = out.isnan().any(-1)
    if where == "q":
        assert nan_rows.sum() == 1 and bool(nan_rows[1, 1, 17])
    else:
        # Key 17 of KV head 1 is kept by query heads 2 and 3 of batch 1, rows 17 .. 39
        # whose window or sink reaches it (the sink covers keys 0..15 only).
        assert int(nan_rows.sum()) > 0 and not bool(nan_rows[0].any()) and not bool(nan_rows[1, :2].any())
    assert not bool(out[~nan_rows].isinf().any())
    if where == "v":
        assert not bool(lse.isnan().any()), "values never enter the lse"


@pytest.mark.parametrize("pkg", PACKAGES)
def test_nan_keeps_forced_lines(pkg: str) -> None:
    """NaN in k or q: vertical-slash keeps its first columns and nearest diagonals,
    block-sparse its diagonal blocks (NaN scores rank below every number)."""
    mod = PACKAGES[pkg]
    q, k, _ = _qkv(n=96)
    k_nan = k.clone()
    k_nan[:, :, 50] = math.nan
    q_nan = q.clone()
    q_nan[0, 0, 70] = math.nan
    for qq, kk in ((q, k_nan), (q_nan, k)):
        plan = mod.vertical_slash_plan(qq, kk, vertical_size=8, slash_size=8, last_q=16, block_m=16,
                                       block_n=16, init_columns=3, local_diagonals=2)
        dense = plan.to_dense_mask()
        rows = torch.arange(96)
        assert bool(dense[..., 3:, :3].all()), "forced first columns dropped"
        assert bool(dense[..., rows, rows].all()) and bool(dense[..., rows[1:], rows[:-1]].all()), \
            "forced nearest diagonals dropped"
        blocks = mod.block_sparse_plan(qq, kk, top_k=2, block_size=16).block_mask()
        assert bool(blocks.diagonal(dim1=-2, dim2=-1).all()), "diagonal block dropped"


def test_nan_scores_rank_last_in_both_packages() -> None:
    q, k, _ = _qkv(n=96)
    k[:, :, 50] = math.nan
    params = {"vertical_size": 8, "slash_size": 8, "last_q": 16, "block_m": 16, "block_n": 16}
    spec = METHODS["vertical_slash"]
    expected = reference.vertical_slash_plan(q, k, **params)
    got = fast.vertical_slash_plan(q, k, **params)
    if not expected.equal(got):
        assert spec.tie_check is not None
        spec.tie_check(q, k, params, expected, got)


# -- plans changed after validation ------------------------------------------------------


def _corrupt(plan: BlockColumnPlan, how: str) -> None:
    if how == "huge_index":
        plan.block_index.fill_(2**31 - 1)
    elif how == "negative_index":
        plan.block_index.fill_(-(2**31))
    elif how == "huge_count":
        plan.block_count.fill_(2**31 - 1)
        plan.column_count.fill_(2**31 - 1)
    elif how == "negative_count":
        plan.block_count.fill_(-7)
    elif how == "columns_out_of_range":
        plan.column_index[..., ::2] = 2**31 - 1
        plan.column_index[..., 1::2] = -5
        plan.column_count.fill_(plan.column_index.shape[-1])
    elif how == "unsorted":
        plan.block_index.copy_(plan.block_index.flip(-1))


@pytest.mark.parametrize("how", ["huge_index", "negative_index", "huge_count", "negative_count",
                                 "columns_out_of_range", "unsorted"])
def test_plan_edited_after_validation_cannot_read_out_of_bounds(how: str) -> None:
    q, k, v = _qkv(n=45)
    blocks = torch.rand(2, 4, 3, 3, generator=torch.Generator().manual_seed(1)) < 0.7
    columns = torch.rand(2, 4, 3, 45, generator=torch.Generator().manual_seed(2)) < 0.2
    plan = BlockColumnPlan.from_masks(blocks, columns, seqlen=45, block_m=16, block_n=16)
    plan = BlockColumnPlan(seqlen=45, block_m=16, block_n=16, block_count=plan.block_count.clone(),
                           block_index=plan.block_index.clone(), column_count=plan.column_count.clone(),
                           column_index=plan.column_index.clone()).validate()
    _corrupt(plan, how)
    out, lse = fast.sparse_attention(q, k, v, plan, return_lse=True)  # validated before: not re-checked
    assert bool(torch.isfinite(out).all()) and not bool(lse.isnan().any())
    # mark_valid() on a bad plan is the same promise broken the same way.
    bad = BlockColumnPlan(seqlen=45, block_m=16, block_n=16, block_count=plan.block_count,
                          block_index=plan.block_index, column_count=plan.column_count,
                          column_index=plan.column_index).mark_valid()
    assert bool(torch.isfinite(fast.sparse_attention(q, k, v, bad)).all())
    with pytest.raises(ValueError, match="plan"):
        plan.validate()


# -- autograd --------------------------------------------------------------------------


def _output_functions() -> list[str]:
    names = ["attention", "sparse_attention", "recall"]
    names += [spec.name for spec in METHODS.values() if hasattr(fast, spec.name)]
    return names


@pytest.mark.parametrize("name", _output_functions())
def test_fast_is_forward_only(name: str) -> None:
    q, k, v = _qkv()
    q.requires_grad_(True)
    fn: Any = getattr(fast, name)
    kwargs = METHODS[name].call_params(METHODS[name].demo_params(N), q.detach()) if name in METHODS else {}
    args: list[Any] = [q, k] if name == "recall" else [q, k, v]
    if name in ("sparse_attention", "recall"):
        args.append(reference.dense_plan(q.detach(), k, block_m=16, block_n=16))
    with pytest.raises(ValueError, match="forward-only"):
        fn(*args, **kwargs)
    with torch.no_grad():
        fn(*args, **kwargs)
