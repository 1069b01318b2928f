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
                counts = ("int", int, "PerHeadInt")  # PerHeadInt: a count that may be per head
                if (p.kind is p.KEYWORD_ONLY and p.annotation in counts and "block" not in p.name
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
        if pkg == "reference" and param in spec.method.knobs:  # per head too (int64 values)
            got = fn(q, k, **{**params, param: [2**63] * q.shape[1]})
            assert got.equal(base), f"{pkg}.{method}_plan({param}=[2**63] * Hq) differs from {param}={4 * N}"
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


# -- packed K/V, ragged launches, states, plan conversions and helpers ------------------------


class _NoLaunch:
    """Stands in for a Triton kernel: launching it means a check came too late."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getitem__(self, grid: object) -> Any:
        raise RuntimeError(f"kernel {self.name} launched before the inputs were rejected")


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Poison every Triton kernel of `fast`: a rejection must come before any launch."""
    import sys

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("sparseprefill.fast"):
            for attr, obj in list(vars(mod).items()):
                if isinstance(obj, (JITFunction, InterpretedFunction)):
                    monkeypatch.setattr(mod, attr, _NoLaunch(f"{mod_name}.{attr}"))


def _packed(n: int = 40, threshold: float = 0.0) -> tuple[tuple[torch.Tensor, ...], Any]:
    q, k, v = _qkv(n=n)
    keep = reference.delta_keep_mask(k, threshold=threshold, chunk=16)
    return (q, k, v), reference.delta_pack(k, v, keep, block=16)


def _edit_packing(packed: Any, how: str) -> Any:
    """A hand-edited copy of `packed` (a new, unchecked object)."""
    import dataclasses

    if how == "lengths":
        return dataclasses.replace(packed, lengths=packed.lengths + 1000)
    if how == "offsets":
        offsets = packed.offsets.clone()
        offsets[1] += 16
        return dataclasses.replace(packed, offsets=offsets)
    if how == "offsets_past_end":
        offsets = packed.offsets.clone()
        offsets[-1] = 2**40
        return dataclasses.replace(packed, offsets=offsets)
    if how == "timestamps":
        return dataclasses.replace(packed, timestamps=packed.timestamps - 2**30)
    if how == "counts":
        counts = packed.counts.clone()
        counts[0] = 2**30
        return dataclasses.replace(packed, counts=counts)
    if how == "seqlen":
        return dataclasses.replace(packed, seqlen=10**9)
    assert how == "list"
    return dataclasses.replace(packed, lengths=packed.lengths.tolist())


@pytest.mark.parametrize("how", ["lengths", "offsets", "offsets_past_end", "timestamps", "counts", "list"])
@pytest.mark.parametrize("pkg", PACKAGES)
def test_edited_packing_is_refused_before_launch(pkg: str, how: str, no_launch: None) -> None:
    (q, k, v), packed = _packed()
    assert packed.validate() is packed
    bad = _edit_packing(packed, how)
    with pytest.raises((ValueError, TypeError), match="packed"):
        bad.validate()
    mod = PACKAGES[pkg]
    with pytest.raises((ValueError, TypeError), match="packed"):
        mod.delta_kv_attention(q, k, v, bad, block_m=16)
    with pytest.raises((ValueError, TypeError), match="packed"):
        mod.delta_kv_plans(q, _edit_packing(packed, how), block_m=16)


@pytest.mark.parametrize("how", ["lengths", "offsets", "timestamps", "counts"])
@pytest.mark.parametrize("pkg", PACKAGES)
def test_edited_tile_packing_is_refused_before_launch(pkg: str, how: str, no_launch: None) -> None:
    import dataclasses

    q, k, v = _qkv(n=64)
    packing = reference.delta_tile_pack(k, v, delta_threshold=0.5, block=16, packed_block=16)
    modes = reference.delta_xattention_tiles(q, k, stride=4, threshold=0.9, exact_top=0.1, block=16)
    bad = dataclasses.replace(packing, packed=_edit_packing(packing.packed, how))
    with pytest.raises(ValueError, match="packed"):
        bad.validate()
    mod = PACKAGES[pkg]
    for call in (lambda p: mod.delta_xattention_attention(q, k, v, modes, p),
                 lambda p: mod.delta_xattention_plans(q, modes, p),
                 lambda p: mod.delta_xattention_density(modes, p)):
        with pytest.raises(ValueError, match="packed"):
            call(dataclasses.replace(packing, packed=_edit_packing(packing.packed, how)))


def test_packers_mark_their_output_valid() -> None:
    (q, k, v), packed = _packed()
    assert packed._checked
    fast_packed = fast.delta_pack(k, v, fast.delta_keep_mask(k, threshold=0.0, chunk=16), block=16)
    assert fast_packed._checked and fast_packed.validate() is fast_packed
    for mod in PACKAGES.values():
        tiles = mod.delta_tile_pack(k, v, delta_threshold=0.5, block=16, packed_block=16)
        assert tiles.packed._checked and tiles.validate() is tiles


@pytest.mark.parametrize("field_name", ["timestamps", "counts", "lengths", "offsets"])
def test_packing_edited_after_validation_cannot_read_out_of_bounds(field_name: str) -> None:
    """In place, after `validate`: not re-checked (as plans), wrong numbers, no stray read."""
    (q, k, v), packed = _packed()
    fast.delta_kv_attention(q, k, v, packed, block_m=16)
    for value in (2**31 - 1, -(2**31)):
        getattr(packed, field_name).fill_(value)
        out = fast.delta_kv_attention(q, k, v, packed, block_m=16)
        assert out.shape == q.shape and not bool(out.isinf().any())
    with pytest.raises(ValueError, match="packed"):
        packed.validate()


def test_ragged_kernel_bounds_segments_by_the_flat_buffer() -> None:
    """The kernel's own clamp (no host help): segments that start at the flat buffer's end
    (or one row before it) under a plan listing every causal block read nothing past T;
    keys past T weigh nothing (their bias loads as -inf), so rows without any key are 0."""
    from sparseprefill.fast.kernels.block_column import ragged_block_column_attention

    (q, k, v), packed = _packed()
    total = packed.k.shape[0]
    q16, kf, vf = q.half(), packed.k.half(), packed.v.half()
    plan = fast.dense_plan(q16, q16, block_m=16, block_n=16)
    bias = torch.zeros(total)
    segments = q.shape[0] * k.shape[1]
    out, lse = ragged_block_column_attention(q16, kf, vf, torch.full((segments,), total, dtype=torch.int64),
                                             plan, key_bias=bias, return_lse=True)
    assert bool((out == 0).all()) and bool((lse == -math.inf).all())
    out, _ = ragged_block_column_attention(q16, kf, vf, torch.full((segments,), total - 1, dtype=torch.int64),
                                           plan, key_bias=bias)
    # One key left: every row keeps exactly it (causal in segment space: key 0).
    assert torch.allclose(out.float(), vf[-1].float().expand_as(out), atol=1e-3)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_delta_kv_nan_in_v_reaches_only_rows_keeping_it(pkg: str) -> None:
    """Threshold 0: every key is its own anchor, so key 21 is kept by rows 21.. only
    (through the exact diagonal for rows of its query block, through its anchor after)."""
    q, k, v = _qkv()
    v[1, 1, 21, 3] = math.nan
    out = PACKAGES[pkg].delta_kv(q, k, v, threshold=0.0, chunk=16, block_m=16, block_n=16)
    nan_rows = out.isnan().any(-1)
    expected = torch.zeros_like(nan_rows)
    expected[1, 2:, 21:] = True
    assert torch.equal(nan_rows, expected)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_delta_xattention_row_keeping_no_key_is_zero(pkg: str) -> None:
    q, k, v = _qkv(n=64)
    mod = PACKAGES[pkg]
    packing = mod.delta_tile_pack(k, v, delta_threshold=0.5, block=16, packed_block=16)
    modes = torch.zeros(2, 4, 4, 4, dtype=torch.int8)
    modes[:, :, 3, 0] = 1  # PACKED: only query tile 3 keeps keys
    out = mod.delta_xattention_attention(q, k, v, modes, packing)
    assert bool((out[:, :, :48] == 0).all()) and bool(torch.isfinite(out).all())
    assert bool((out[:, :, 48:] != 0).any())


@pytest.mark.parametrize("value,where", [(7, (0, 0)), (-1, (1, 1)), (2, (0, 1)), (1, (2, 2)), (1, (3, 3))])
@pytest.mark.parametrize("pkg", PACKAGES)
def test_delta_xattention_refuses_impossible_modes(pkg: str, value: int, where: tuple[int, int],
                                                   no_launch: None) -> None:
    """Unknown values, EXACT above the diagonal, PACKED on or above it."""
    q, k, v = _qkv(n=64)
    packing = reference.delta_tile_pack(k, v, delta_threshold=0.5, block=16, packed_block=16)
    modes = reference.delta_xattention_tiles(q, k, stride=4, block=16)
    modes[0, 1, where[0], where[1]] = value
    mod = PACKAGES[pkg]
    for call in (lambda: mod.delta_xattention_attention(q, k, v, modes, packing),
                 lambda: mod.delta_xattention_plans(q, modes, packing),
                 lambda: mod.delta_xattention_density(modes, packing),
                 lambda: mod.delta_xattention_kv_reduction(modes, packing)):
        with pytest.raises(ValueError, match="modes"):
            call()


@pytest.mark.parametrize("pkg", PACKAGES)
def test_delta_xattention_density_refuses_another_lengths_packing(pkg: str) -> None:
    q, k, v = _qkv(n=64)
    modes = reference.delta_xattention_tiles(q, k, stride=4, block=16)
    _, k2, v2 = _qkv(n=96)
    other = reference.delta_tile_pack(k2, v2, delta_threshold=0.5, block=16, packed_block=16)
    for fn in (PACKAGES[pkg].delta_xattention_density, PACKAGES[pkg].delta_xattention_kv_reduction):
        with pytest.raises(ValueError, match="modes"):
            fn(modes, other)


def test_fast_delta_block_sizes_are_multiples_of_16(no_launch: None) -> None:
    q, k, v = _qkv()
    keep = reference.delta_keep_mask(k, threshold=0.5)
    with pytest.raises(ValueError, match="block must be a multiple of 16"):
        fast.delta_pack(k, v, keep, block=24)
    packed = reference.delta_pack(k, v, keep, block=16)
    with pytest.raises(ValueError, match="block_m must be a multiple of 16"):
        fast.delta_kv_plans(q, packed, block_m=24)
    with pytest.raises(ValueError, match="block_m must be a multiple of 16"):
        fast.delta_kv_density(q, packed, block_m=24)
    with pytest.raises(ValueError, match="packed.block must be a multiple of 16"):
        fast.delta_kv_plans(q, reference.delta_pack(k, v, keep, block=24), block_m=16)
    with pytest.raises(ValueError, match="packed_block must be a multiple of 16"):
        fast.delta_tile_pack(k, v, delta_threshold=0.5, block=16, packed_block=8)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_attention_with_longer_keys_is_the_chunk_of_the_prompt(pkg: str) -> None:
    """k, v of P + N keys: q holds positions [P, P + N) (chunked prefill), in both packages."""
    q, k, v = _qkv()
    mod = PACKAGES[pkg]
    whole = mod.attention(q, k, v)
    for p in (1, 16, 39):
        chunk, lse = mod.attention(q[:, :, p:], k, v, return_lse=True)
        torch.testing.assert_close(chunk, whole[:, :, p:], atol=2e-3, rtol=0)
        assert chunk.shape == q[:, :, p:].shape and lse.shape == q.shape[:2] + (N - p,)
    ref = reference.attention(q[:, :, 16:].double(), k.double(), v.double())
    torch.testing.assert_close(mod.attention(q[:, :, 16:], k, v).double(), ref, atol=2e-3, rtol=0)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_attention_refuses_mask_with_longer_keys_and_shorter_keys(pkg: str, no_launch: None) -> None:
    q, k, v = _qkv()
    mod = PACKAGES[pkg]
    with pytest.raises(ValueError, match="mask"):
        mod.attention(q[:, :, 8:], k, v, torch.ones(32, 32, dtype=torch.bool))
    with pytest.raises(ValueError, match="k must have shape"):
        mod.attention(q, k[:, :, 8:], v[:, :, 8:])
    with pytest.raises(ValueError, match="v must have the shape of k"):
        mod.attention(q[:, :, 8:], k, v[:, :, 8:])


@pytest.mark.parametrize("pkg", PACKAGES)
def test_sample_attention_unreadable_settings(pkg: str, tmp_path: Any, no_launch: None) -> None:
    q, k, v = _qkv()
    for path in ("/nonexistent/settings.json", str(tmp_path)):
        with pytest.raises(ValueError, match="settings"):
            PACKAGES[pkg].sample_attention(q, k, v, settings=path)
        with pytest.raises(ValueError, match="settings"):
            PACKAGES[pkg].sample_attention_plan(q, k, settings=path)


@pytest.mark.parametrize("where", ["state", "block_mean_out"])
@pytest.mark.parametrize("pkg", PACKAGES)
def test_sparse_attention_refuses_stride_zero_outputs(pkg: str, where: str, no_launch: None) -> None:
    q, k, v = _qkv()
    plan = reference.dense_plan(q, k, block_m=16, block_n=16)
    dtype = torch.float32
    kwargs: dict[str, Any] = {}
    if where == "state":
        acc = torch.zeros(1, 1, 1, 32, dtype=dtype).expand(2, 4, N, 32)
        kwargs["state"] = reference.AttentionState(m=torch.full((2, 4, N), -math.inf), l=torch.zeros(2, 4, N),
                                                   acc=acc)
    else:
        kwargs["block_mean_out"] = torch.zeros(1, dtype=dtype).expand(2, 4, 3, 3)
    with pytest.raises(ValueError, match=f"{where}.*expanded view"):
        PACKAGES[pkg].sparse_attention(q, k, v, plan, **kwargs)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_select_tiles_refuses_zero_tiles(pkg: str) -> None:
    with pytest.raises(ValueError, match="weights"):
        PACKAGES[pkg].select_tiles(torch.zeros(1, 1, 0, 0), 0.9)


def test_attention_state_checks_its_arguments() -> None:
    State = reference.AttentionState
    for bad in (-1, 2.0, True, None):
        with pytest.raises((ValueError, TypeError), match="batch"):
            State.empty(bad, 1, 1, 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dtype"):
        State.empty(1, 1, 1, 1, dtype=torch.int32)
    with pytest.raises(TypeError, match="q"):
        State.like("q")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="q"):
        State.like(torch.zeros(2, 3))
    assert State.like(torch.zeros(1, 0, 4, 4)).acc.shape == (1, 0, 4, 4)  # empty is a valid state
    assert State.empty(2, 4, 0, 16).m.shape == (2, 4, 0)
    a = State.empty(2, 4, 8, 16)
    with pytest.raises(TypeError, match="other"):
        a.merge("state")  # type: ignore[arg-type]
    for other in (State.empty(2, 4, 9, 16), State.empty(2, 4, 8, 16, dtype=torch.float64)):
        with pytest.raises((ValueError, TypeError), match="other"):
            a.merge(other)
    merged = a.merge(State.empty(2, 4, 8, 16))
    assert bool(torch.isneginf(merged.m).all()) and bool((merged.l == 0).all())


def _bad_plan(how: str) -> BlockColumnPlan:
    q, k, _ = _qkv()
    plan = reference.dense_plan(q, k, block_m=16, block_n=16)
    fields = {name: getattr(plan, name).clone() for name in ("block_count", "block_index", "column_count",
                                                               "column_index")}
    if how == "out_of_range":
        fields["block_index"].fill_(2**31 - 1)
    elif how == "meta":
        fields = {name: t.to("meta") for name, t in fields.items()}
    else:
        fields["block_count"] = fields["block_count"].tolist()
    return BlockColumnPlan(seqlen=N, block_m=16, block_n=16, **fields)


@pytest.mark.parametrize("how", ["out_of_range", "meta", "list"])
def test_plan_conversions_validate_first(how: str) -> None:
    for conversion in ("to_dense_mask", "block_mask", "column_mask", "with_full_blocks", "with_disjoint_columns",
                       "validate"):
        with pytest.raises((ValueError, TypeError), match="plan"):
            getattr(_bad_plan(how), conversion)()
    q, k, v = _qkv()
    for pkg in PACKAGES.values():
        with pytest.raises((ValueError, TypeError), match="plan"):
            pkg.sparse_attention(q, k, v, _bad_plan(how))


def test_plan_helpers_name_their_arguments() -> None:
    q, k, _ = _qkv()
    plan = reference.dense_plan(q, k, block_m=16, block_n=16)
    with pytest.raises(TypeError, match="other"):
        plan.equal("str")  # type: ignore[arg-type]
    with pytest.raises((TypeError, ValueError), match="plan"):
        plan.equal(_bad_plan("list"))
    with pytest.raises(TypeError, match="block_mask"):
        BlockColumnPlan.from_masks([[True]], None, seqlen=N, block_m=16, block_n=16)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="column_mask"):
        BlockColumnPlan.from_masks(torch.ones(2, 4, 3, 3, dtype=torch.bool), [[True]],  # type: ignore[arg-type]
                                   seqlen=N, block_m=16, block_n=16)
    stacked = reference.stack_plans(p for p in (plan, plan))
    assert stacked.equal(reference.stack_plans([plan, plan]))
    with pytest.raises(TypeError, match="plans"):
        reference.stack_plans(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="plans"):
        reference.stack_plans(plan)  # type: ignore[arg-type]


@pytest.mark.parametrize("pkg", PACKAGES)
def test_varlen_plans_needs_a_plan_function(pkg: str) -> None:
    q = torch.randn(40, 4, 32, dtype=torch.float16)
    k = torch.randn(40, 2, 32, dtype=torch.float16)
    cu = torch.tensor([0, 17, 40], dtype=torch.int32)
    with pytest.raises(TypeError, match="plan_fn"):
        PACKAGES[pkg].varlen_plans(None, q, k, cu)  # type: ignore[arg-type]


def test_minference_config_checks() -> None:
    from sparseprefill.reference import HeadPattern, MInferenceConfig

    with pytest.raises(TypeError, match="params"):
        HeadPattern("a_shape", params=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pattern"):
        HeadPattern(None)  # type: ignore[arg-type]
    config = MInferenceConfig.uniform(2, 4, HeadPattern("vertical_slash", {"vertical_size": 8, "slash_size": 8}))
    with pytest.raises(TypeError, match="index"):
        config.layer("0")  # type: ignore[arg-type]
    for text in ('[{"0": ["vertical_and_slash", 1e400, 100, 1]}]',
                 '[{"0": ["vertical_and_slash", 100, -1e400, 1]}]',
                 '{"format": "sparseprefill.minference", "version": 1, "layers": [[{"pattern": "vertical_slash",'
                 ' "vertical_size": 1e400, "slash_size": 8}]]}'):
        with pytest.raises(ValueError):
            MInferenceConfig.from_json(text)


def test_sample_attention_settings_huge_numbers() -> None:
    text = ('{"format": "sparseprefill.sample_attention", "version": 1, "block_size": 1e400, "ranges": '
            '[{"min_seqlen": 0, "max_seqlen": 1e400, "alpha_c": 0.9, "alpha_s": 0.9, "chunk_n": 1}]}')
    with pytest.raises((ValueError, TypeError)):
        reference.SampleAttentionSettings.from_json(text)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_chunk_plan_refuses_a_misaligned_prefix_before_any_estimate(pkg: str, no_launch: None) -> None:
    q, k, _ = _qkv(n=96)
    mod = PACKAGES[pkg]
    cases: list[tuple[Any, dict[str, Any], int]] = [
        (mod.vertical_slash_plan, {"vertical_size": 8, "slash_size": 8, "block_m": 64, "block_n": 64}, 16),
        (mod.block_sparse_plan, {"top_k": 2, "block_size": 32}, 48),
        (mod.xattention_plan, {"block": 32}, 16),
        (mod.anchor_attention_plan, {"step": 2, "block_m": 16, "block_n": 16}, 16),
    ]
    for plan_fn, params, prefix in cases:
        with pytest.raises(ValueError, match="prefix length"):
            mod.chunk_plan(plan_fn, q[:, :, prefix:], k, **params)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_anchor_huge_step_is_one_group(pkg: str) -> None:
    q, k, _ = _qkv(n=96)
    fn = PACKAGES[pkg].anchor_attention_plan
    base = fn(q, k, step=6, block_m=16, block_n=16)
    for huge in (7, 2**40, 2**63):
        got = fn(q, k, step=huge, block_m=16, block_n=16)
        assert got.validate().equal(base)


def test_quadratic_stages_refuse_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    """`check_device_memory` (called where a buffer grows with the square of the tokens)
    raises MemoryError naming the stage, its bytes and what is free; small stages and
    CPU tensors are never checked (no driver call)."""
    from sparseprefill.fast.kernels import check_device_memory

    # 10 GiB free; torch's cache gives back 1 GiB more when emptied (not counted before).
    state = {"free": 10 * 2**30, "emptied": 0}

    def empty_cache() -> None:
        state["free"], state["emptied"] = 11 * 2**30, state["emptied"] + 1

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    cuda = torch.device("cuda", 0)
    check_device_memory("tile weights", 10 * 2**30, cuda)  # fits what is free: the cache is left alone
    assert state["emptied"] == 0
    check_device_memory("tile weights", 11 * 2**30, cuda)  # fits once the cache is given back
    assert state["emptied"] == 1
    with pytest.raises(MemoryError, match=r"tile weights needs 12\.0 GiB .* only 11\.0 GiB .* larger block"):
        check_device_memory("tile weights", 12 * 2**30, cuda, hint="A larger block fits.")
    check_device_memory("tile weights", 2**40, torch.device("cpu"))
    check_device_memory("small", 2**29, cuda)


def test_disjoint_column_lists_are_sized_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-query-block column lists `[B, H, Qb, width]` (quadratic where the shared
    column list grows with N: SharePrefill's single-line verticals at 1M tokens) are
    checked by `check_device_memory` before they are allocated."""
    import importlib

    own = importlib.import_module("sparseprefill.fast.kernels.own_columns")
    asked: list[tuple[str, int]] = []

    def refuse(what: str, nbytes: int, device: torch.device, *, hint: str = "") -> None:
        asked.append((what, nbytes))
        raise MemoryError(f"{what} needs {nbytes} bytes")

    monkeypatch.setattr(own, "check_device_memory", refuse)
    n, bm = 100, 16
    cols = torch.tensor([0, 3, 50], dtype=torch.int32)
    plan = BlockColumnPlan.from_masks(torch.zeros(2, 3, 7, 7, dtype=torch.bool),
                                      torch.zeros(2, 3, 7, n, dtype=torch.bool).index_fill_(-1, cols.long(), True),
                                      seqlen=n, block_m=bm, block_n=bm)
    with pytest.raises(MemoryError, match=r"column lists \(\[B, H, Qb, width\] = \[2, 3, 7, 3\]\)"):
        own.disjoint_columns(plan)
    assert asked and asked[0][1] == 2 * 3 * 7 * 3 * 4


# -- inputs that used to escape as AttributeError / NotImplementedError / RuntimeError -------


@pytest.mark.parametrize("how", ["meta", "list"])
@pytest.mark.parametrize("field_name", ["block_count", "block_index", "column_count", "column_index"])
@pytest.mark.parametrize("pkg", PACKAGES)
def test_density_of_a_plan_with_bad_fields_names_the_field(pkg: str, field_name: str, how: str,
                                                           no_launch: None) -> None:
    """`density` reads the plan's sizes from its fields: they are checked first (a list
    `block_count` used to raise AttributeError in `fast`)."""
    import dataclasses

    q, k, _ = _qkv()
    plan = reference.dense_plan(q, k, block_m=16, block_n=16)
    value = getattr(plan, field_name)
    bad = dataclasses.replace(plan, **{field_name: value.tolist() if how == "list" else value.to("meta")})
    with pytest.raises((TypeError, ValueError), match=f"plan.{field_name}"):
        PACKAGES[pkg].density(bad)
    with pytest.raises((TypeError, ValueError), match=f"plan.{field_name}"):
        bad.to("cpu")


@pytest.mark.parametrize("pkg", PACKAGES)
def test_metrics_refuse_meta_tensors(pkg: str) -> None:
    """`relative_error` and `density` read values: a meta `out`, `ref` or `mask` is refused
    by name (it used to raise NotImplementedError from `.cpu()`, or return a meta result)."""
    mod = PACKAGES[pkg]
    x = torch.zeros(2, 4, 8, 16)
    with pytest.raises(ValueError, match="out is a meta tensor"):
        mod.relative_error(x.to("meta"), x)
    with pytest.raises(ValueError, match="ref is a meta tensor"):
        mod.relative_error(x, x.to("meta"))
    with pytest.raises(TypeError, match="out must be a real tensor"):
        mod.relative_error(x.to(torch.complex64), x)
    with pytest.raises(ValueError, match="mask is a meta tensor"):
        mod.density(torch.ones(1, 2, 8, 8, dtype=torch.bool, device="meta"))


@pytest.mark.parametrize("theta", [1e300, 1e39, 10**400, [12.0, 1e300, 12.0, 12.0]],
                         ids=["1e300", "1e39", "int_10e400", "per_head"])
@pytest.mark.parametrize("pkg", PACKAGES)
def test_anchor_theta_past_float32_is_refused(pkg: str, theta: Any, no_launch: None) -> None:
    """A finite theta past `MAX_THETA` would overflow the stripe kernel's float32 (a
    RuntimeError from the launcher); both packages refuse it by name, before any launch.
    `+inf` (keep every key) stays accepted."""
    from sparseprefill.reference.anchor_attention import MAX_THETA, check_theta

    q, k, v = _qkv()
    mod = PACKAGES[pkg]
    with pytest.raises(ValueError, match="theta"):
        mod.anchor_attention_plan(q, k, theta=theta, block_m=16, block_n=16)
    with pytest.raises(ValueError, match="theta"):
        mod.anchor_attention(q, k, v, theta=theta, block_m=16, block_n=16)
    assert check_theta(math.inf) == math.inf and check_theta(MAX_THETA) == MAX_THETA


@pytest.mark.parametrize("pkg", PACKAGES)
def test_per_head_knob_on_meta_is_refused(pkg: str, no_launch: None) -> None:
    """A per-head knob is read back once for its checks: a meta tensor is refused by the
    knob's name (it used to raise NotImplementedError)."""
    q, k, v = _qkv()
    mod = PACKAGES[pkg]
    with pytest.raises(ValueError, match="theta given per head"):
        mod.anchor_attention_plan(q, k, theta=torch.full((4,), 12.0, device="meta"), block_m=16, block_n=16)
    with pytest.raises(ValueError, match="vertical_size given per head"):
        mod.vertical_slash_plan(q, k, vertical_size=torch.full((4,), 4, device="meta"), slash_size=4,
                                block_m=16, block_n=16)


@pytest.mark.parametrize("field_name", ["counts", "lengths", "timestamps"])
@pytest.mark.parametrize("pkg", PACKAGES)
def test_edited_tile_packing_names_the_packing(pkg: str, field_name: str, no_launch: None) -> None:
    """DeltaXAttention takes `packing`: a broken field of its `PackedKV` is named
    `packing.packed.<field>` (the message used to say `packed.<field>`, an argument these
    functions do not have), by every consumer, before any launch."""
    import dataclasses

    q, k, v = _qkv(n=64)
    packing = reference.delta_tile_pack(k, v, delta_threshold=0.5, block=16, packed_block=16)
    modes = reference.delta_xattention_tiles(q, k, stride=4, threshold=0.9, exact_top=0.1, block=16)

    def edited() -> Any:
        values = getattr(packing.packed, field_name).clone()
        values[0] = 2**30
        return dataclasses.replace(packing, packed=dataclasses.replace(packing.packed, **{field_name: values}))

    mod = PACKAGES[pkg]
    for call in (lambda p: mod.delta_xattention_attention(q, k, v, modes, p),
                 lambda p: mod.delta_xattention_plans(q, modes, p),
                 lambda p: mod.delta_xattention_density(modes, p),
                 lambda p: mod.delta_xattention_kv_reduction(modes, p)):
        with pytest.raises(ValueError, match=f"packing.packed.{field_name}"):
            call(edited())


@pytest.mark.parametrize("pkg", PACKAGES)
def test_tile_selection_refuses_meta_weights(pkg: str) -> None:
    """Tile weights and selections are read: meta tensors are refused by name (they used to
    give a meta result), and a selection on another device than the weights too."""
    mod = PACKAGES[pkg]
    w = torch.rand(1, 2, 4, 4)
    sel = torch.ones(1, 2, 4, 4, dtype=torch.bool)
    with pytest.raises(ValueError, match="weights is a meta tensor"):
        mod.select_tiles(w.to("meta"), threshold=0.9)
    with pytest.raises(ValueError, match="weights is a meta tensor"):
        mod.exact_tiles(w.to("meta"), sel, exact_top=0.1)
    with pytest.raises(ValueError, match="selected"):
        mod.skip_tiles(w, sel.to("meta"), skip=0.1)
