"""The conformance properties: `fast` agrees with `reference`.

Two layers:

* `check_*` functions: plain functions, each checks one property for given
  inputs and raises AssertionError with the numbers and the inputs' description.
  Anyone can call them (tests, the demo, a debugging session).
* `PROPERTIES`: each property paired with the Hypothesis draws that feed it
  (shape, dtype, inputs, plan or method parameters within `Caps`). The GPU runner
  (`python -m sparseprefill.conformance`) and the CPU tests both run these, for
  every registered method (`registry.METHODS`) or once for the kernel itself.

Outputs of `fast` are NaN-poisoned while a property runs (`nan_poisoned_empty`),
so an element the kernel forgets to write fails instead of passing by luck.

Whether the properties find bugs on their own is measured by planting realistic
one-line bugs in a scratch copy and running only these properties
(`tools/planted_bugs.py`, docs/conformance.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from hypothesis import strategies as st

from .. import fast, reference
from ..reference.plan import BlockColumnPlan
from .dense_fallback import SUMMARY as DENSE_FALLBACK
from .dense_fallback import applies as applies_dense_fallback, dense_fallback_property, rule_off
from .registry import MethodSpec
from .strategies import (
    Caps,
    Draw,
    draw_block_sizes,
    draw_column_path,
    draw_dtype,
    draw_inputs,
    draw_limits,
    draw_mask,
    draw_method_params,
    draw_per_head_knobs,
    draw_plan,
    draw_scale,
    draw_seqlen,
    draw_shape,
    draw_tiles,
    forced_tiles,
    method_blocks,
)
from .tolerance import (
    baseline_attention,
    nan_poisoned_empty,
    check_attention,
    check_block_means,
    check_estimate,
    check_output,
    check_recall,
    golden_attention,
)


def _fail(context: str, message: str) -> AssertionError:
    return AssertionError(f"[{context}] {message}" if context else message)


def _first_true(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(i) for i in x.nonzero()[0].tolist())


def _listed(count: torch.Tensor, index: torch.Tensor, at: tuple[int, ...]) -> list[int]:
    n = int(count[at].item())
    return [int(i) for i in index[at][:n].tolist()]


# -- plans ---------------------------------------------------------------------


def _selection(plan: BlockColumnPlan, kind: str) -> torch.Tensor:
    """Listed blocks `[B, Hq, Qb, Kb]`, or listed columns outside listed blocks `[B, Hq, Qb, N]`
    (columns inside a listed block add nothing, so `equal` ignores them)."""
    blocks = plan.block_mask()
    if kind == "block":
        return blocks
    in_blocks = blocks.repeat_interleave(plan.block_n, dim=3)[..., : plan.seqlen]
    return plan.column_mask() & ~in_blocks


def check_plans_equal(
    expected: BlockColumnPlan, got: BlockColumnPlan, *, context: str = ""
) -> None:
    """A plan equals the expected one exactly: same sizes, lists and dense mask.

    `got` must also pass `validate()`. Padding past the counts is ignored.

    Raises:
        AssertionError: naming the first differing (batch, head, query block) and
            both lists there, or the first differing dense-mask entry.
    """
    try:
        got.validate()
    except (TypeError, ValueError) as err:
        raise _fail(context, f"plan is invalid: {err}") from err
    sizes_e = (expected.seqlen, expected.block_m, expected.block_n, tuple(expected.block_count.shape))
    sizes_g = (got.seqlen, got.block_m, got.block_n, tuple(got.block_count.shape))
    if sizes_e != sizes_g:
        raise _fail(context, f"plan sizes (N, block_m, block_n, [B, Hq, Qb]) are {sizes_g}, "
                             f"expected {sizes_e}")
    got = got.to(expected.device)
    if not expected.equal(got):
        for kind in ("block", "column"):
            mask_e, mask_g = _selection(expected, kind), _selection(got, kind)
            differs = (mask_e != mask_g).any(dim=-1)
            if bool(differs.any()):
                at = _first_true(differs)
                count_e, index_e = getattr(expected, f"{kind}_count"), getattr(expected, f"{kind}_index")
                count_g, index_g = getattr(got, f"{kind}_count"), getattr(got, f"{kind}_index")
                raise _fail(context, f"{kind} lists differ at (b, h, query block) {at}: got "
                                     f"{_listed(count_g, index_g, at)}, expected "
                                     f"{_listed(count_e, index_e, at)}")
        raise _fail(context, "plan.equal is False but block and column masks agree")
    dense_e, dense_g = expected.to_dense_mask(), got.to_dense_mask()
    if not torch.equal(dense_e, dense_g):
        at = _first_true(dense_e != dense_g)
        raise _fail(context, f"to_dense_mask differs at (b, h, row, key) {at}: got "
                             f"{bool(dense_g[at])}, expected {bool(dense_e[at])}")


def _check_valid(plan: BlockColumnPlan, which: str, context: str) -> None:
    """Every plan invariant holds, checked from scratch: a plan marked valid without a
    check (`mark_valid`, as estimators do) must still pass `validate()`, including the
    `columns_disjoint` promise the kernel relies on."""
    try:
        replace(plan, _checked=False).validate()
    except (TypeError, ValueError) as err:
        raise _fail(context, f"the {which} plan breaks an invariant: {err}") from err


# The power of two by which `check_scale_forwarded` scales q (and the explicit scale).
SCALE_FACTOR = 4.0


def check_scale_forwarded(
    spec: MethodSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    params: dict[str, Any],
    *,
    context: str = "",
) -> None:
    """The reference plan at the explicit scale `4 / sqrt(D)` is its plan of `4 q` at the
    default scale, exactly (methods whose plans take `scale`).

    Both are plans of the same float64 logits: scaling by a power of two is exact in
    fp16 / bf16 (inputs this small do not overflow) and commutes with every rounding, so
    no tie forgives a difference. A reference estimate that drops an explicit scale
    somewhere (and uses `1/sqrt(D)`) fails wherever a four times sharper softmax changes
    the plan, on every example, not only on the fifth that draws an explicit scale.

    Raises:
        AssertionError: the two plans differ.
    """
    from ..reference._checks import resolve_scale

    base = {key: value for key, value in params.items() if key != "scale"}
    plan_fn = spec.plan_fn("reference")
    explicit = plan_fn(q, k, **base, scale=SCALE_FACTOR * resolve_scale(None, q.shape[-1]))
    scaled = plan_fn(q * SCALE_FACTOR, k, **base)
    if not explicit.equal(scaled):
        raise _fail(context, f"reference plan at scale={SCALE_FACTOR:g}/sqrt(D) differs from its plan of "
                             f"{SCALE_FACTOR:g} q at the default scale: an explicit scale is not passed on")


def check_method_plan(
    spec: MethodSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    params: dict[str, Any],
    *,
    context: str = "",
) -> None:
    """`fast.<name>_plan` equals `reference.<name>_plan` on the same inputs.

    For methods with `exact_plans=False`, a difference is handed to the method's
    `tie_check`, which must show that every difference is decided by a tie; where they
    are equal, the method's `lines_check` judges the fast lines. Methods whose plans take `scale` must pass
    `check_scale_forwarded`. Both plans
    must pass `validate()` from scratch (whatever `mark_valid` said), and a method's
    `plan_check` first checks the reference plan against its definition.

    Raises:
        AssertionError: plans differ (and no tie explains it), or the fast plan is
            invalid or on another device than q.
    """
    expected = spec.plan_fn("reference")(q, k, **params)
    _check_valid(expected, "reference", context)
    if spec.plan_check is not None:
        try:
            spec.plan_check(q, k, params, expected)
        except AssertionError as err:
            raise _fail(context, f"reference plan: {err}") from err
    if "scale" in params:
        check_scale_forwarded(spec, q, k, params, context=context)
    got = spec.plan_fn("fast")(q, k, **params)
    if got.device != q.device:
        raise _fail(context, f"fast plan is on {got.device}, q on {q.device}")
    _check_valid(got, "fast", context)
    if spec.exact_plans:
        check_plans_equal(expected, got, context=context)
        return
    try:
        check_plans_equal(expected, got, context=context)
    except AssertionError as err:
        if spec.tie_check is None:
            raise _fail(context, f"{err}; method {spec.name!r} has exact_plans=False but no "
                                 "tie_check to show the difference is a tie") from err
        spec.tie_check(q, k, params, expected, got)
        return
    if spec.lines_check is not None:
        # Equal plans can still come from wrong lines that the block index hides.
        try:
            spec.lines_check(q, k, params)
        except AssertionError as err:
            raise _fail(context, f"plans are equal, but the fast lines are wrong: {err}") from err


def check_method_estimate(
    spec: MethodSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    params: dict[str, Any],
    *,
    context: str = "",
) -> float:
    """The fast estimate (`spec.estimate("fast", ...)`) against the reference's, before any top-k.

    Every named part must be present in both and agree under
    `tolerance.check_estimate`. Unlike the plan property this forgives no tie: a
    wrong score fails even where the top-k it feeds happens to pick the same lines.

    Returns:
        The largest error / allowance ratio.

    Raises:
        AssertionError: a part missing or outside its allowance.
    """
    if spec.estimate is None:
        raise ValueError(f"method {spec.name!r} has no estimate")
    expected = spec.estimate("reference", q, k, params)
    with nan_poisoned_empty():
        got = spec.estimate("fast", q, k, params)
    if set(got) != set(expected):
        raise _fail(context, f"estimate parts differ: fast {sorted(got)}, reference {sorted(expected)}")
    ratio = 0.0
    for name in sorted(expected):
        cmp = check_estimate(got[name].values, expected[name], name=name, context=context)
        ratio = max(ratio, cmp.ratio)
    if spec.head_local:
        ratio = max(ratio, check_head_map(spec, q, k, params, context=context))
    return ratio


def check_head_map(
    spec: MethodSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    params: dict[str, Any],
    *,
    context: str = "",
) -> float:
    """The reference estimate's GQA head map, on any drawn shape.

    From the drawn inputs' first batch row, a four-query-head, two-KV-head input: KV
    heads `k0` and `k0` with its head dim reversed (exact in 16 bits, as different as two
    heads), query heads the first and last drawn ones and the same two reversed. Query
    head `h` must get, from the whole input, the estimate it gets alone with KV head
    `h // 2` (a single-head call has no map to get wrong). Fast is compared with the
    reference on the drawn shapes by `check_method_estimate`.

    Returns:
        The largest error / allowance ratio.

    Raises:
        AssertionError: a head whose estimate differs from its single-head estimate.
    """
    assert spec.estimate is not None
    k0 = k[:1, :1]
    k2 = torch.cat([k0, k0.flip(-1)], dim=1)
    qa, qb = q[:1, :1], q[:1, -1:]
    q4 = torch.cat([qa, qb, qa.flip(-1), qb.flip(-1)], dim=1)
    whole = spec.estimate("reference", q4, k2, params)
    ratio = 0.0
    for h in range(4):
        alone = spec.estimate("reference", q4[:, h:h + 1], k2[:, h // 2:h // 2 + 1], params)
        for name, est in alone.items():
            got = whole[name].values[:, h:h + 1]
            cmp = check_estimate(got, est, name=f"{name} of query head {h} of 4 (2 KV heads) against it alone",
                                 context=context)
            ratio = max(ratio, cmp.ratio)
    return ratio


# -- plan validation --------------------------------------------------------------

CORRUPTIONS = ("duplicate", "unsorted", "past_end", "negative", "not_causal", "count_past_width",
               "count_negative", "disjoint_lie", "wrong_dtype", "wrong_rows")


def corrupt_plan(plan: BlockColumnPlan, kind: str, seed: int) -> BlockColumnPlan | None:
    """A copy of valid `plan` that breaks one invariant of `reference.plan`, or None when
    `plan` has no entry to break that way (e.g. no list of two entries to unsort)."""
    from dataclasses import replace

    gen = torch.Generator(device="cpu").manual_seed(seed)
    plan = plan.to("cpu").ungrouped()
    fields = {name: getattr(plan, name).clone().contiguous()
              for name in ("block_count", "block_index", "column_count", "column_index")}
    n, bm, bn = plan.seqlen, plan.block_m, plan.block_n
    last_row = ((torch.arange(plan.num_query_blocks) + 1) * bm - 1).clamp(max=n - 1)

    def pick(mask: torch.Tensor) -> tuple[int, ...] | None:
        where = mask.nonzero()
        if where.shape[0] == 0:
            return None
        row = where[int(torch.randint(0, where.shape[0], (1,), generator=gen))]
        return tuple(int(i) for i in row.tolist())

    kinds = ["block", "column"]
    order = torch.randperm(2, generator=gen).tolist()
    for kind_of_list in (kinds[i] for i in order):
        count, index = fields[f"{kind_of_list}_count"], fields[f"{kind_of_list}_index"]
        width = index.shape[3]
        upper = plan.num_key_blocks if kind_of_list == "block" else n
        if kind in ("duplicate", "unsorted"):
            at = pick(count >= 2)
            if at is None:
                continue
            i = int(torch.randint(0, int(count[at]) - 1, (1,), generator=gen))
            if kind == "duplicate":
                index[at + (i + 1,)] = index[at + (i,)]
            else:
                index[at + (i,)], index[at + (i + 1,)] = int(index[at + (i + 1,)]), int(index[at + (i,)])
        elif kind in ("past_end", "negative"):
            at = pick(count >= 1)
            if at is None:
                continue
            # The last entry past the end (still increasing), or the first below zero.
            if kind == "past_end":
                index[at + (int(count[at]) - 1,)] = upper
            else:
                index[at + (0,)] = -1
        elif kind == "not_causal":
            # A query block whose last entry can move past its causal horizon.
            horizon = (last_row // bn if kind_of_list == "block" else last_row).view(1, 1, -1)
            at = pick((count >= 1) & (horizon + 1 < upper))
            if at is None:
                continue
            index[at + (int(count[at]) - 1,)] = int(horizon[0, 0, at[2]]) + 1
        elif kind == "count_past_width":
            at = pick(count >= 0)
            if at is None:
                continue
            count[at] = width + 1
        elif kind == "count_negative":
            at = pick(count >= 0)
            if at is None:
                continue
            count[at] = -1
        else:
            continue
        return replace(plan, **fields, _checked=False)
    if kind == "disjoint_lie":
        inside = plan.column_mask() & plan.block_mask().repeat_interleave(bn, dim=3)[..., :n]
        if not bool(inside.any()):
            return None
        return replace(plan, columns_disjoint=True, _checked=False)
    if kind == "wrong_dtype":
        return replace(plan, block_index=fields["block_index"].to(torch.int64), _checked=False)
    if kind == "wrong_rows":
        return replace(plan, block_count=fields["block_count"][:, :, :-1], _checked=False)
    return None


def check_plan_rejected(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    context: str = "",
) -> float:
    """An invalid `plan` is refused by `validate()`, `reference.sparse_attention` and
    `fast.sparse_attention` (before any launch) with TypeError or ValueError.

    Returns:
        0.0 (an exact check).

    Raises:
        AssertionError: naming the entry point that accepted the plan.
    """
    checks = (("validate()", lambda: plan.validate()),
              ("reference.sparse_attention", lambda: reference.sparse_attention(q, k, v, plan)),
              ("fast.sparse_attention", lambda: fast.sparse_attention(q, k, v, plan.to(q.device))))
    for what, call in checks:
        try:
            call()
        except (TypeError, ValueError):
            continue
        raise _fail(context, f"{what} accepted an invalid plan")
    return 0.0


# -- attention -----------------------------------------------------------------


def check_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    scale: float | None = None,
    context: str = "",
) -> float:
    """`fast.sparse_attention(..., return_lse=True)` against the float64 golden.

    The golden and the baseline use `plan.to_dense_mask()`; rows that keep no key
    must give output 0 and lse -inf; nothing may be NaN.

    Returns:
        The largest error / allowance ratio (<= 1).

    Raises:
        AssertionError: under the tolerance policy (`tolerance.check_attention`).
    """
    mask = plan.to_dense_mask()
    golden = golden_attention(q, k, v, mask, scale=scale)
    baseline = baseline_attention(q, k, v, mask, scale=scale)
    with nan_poisoned_empty():
        out, lse = fast.sparse_attention(q, k, v, plan, scale=scale, return_lse=True)
    return check_attention(out, lse, golden, baseline, context=context)


def check_masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float | None = None,
    context: str = "",
) -> float:
    """`fast.attention(q, k, v, mask, return_lse=True)` against the float64 golden.

    Returns:
        The largest error / allowance ratio.

    Raises:
        AssertionError: under the tolerance policy.
    """
    golden = golden_attention(q, k, v, mask, scale=scale)
    baseline = baseline_attention(q, k, v, mask, scale=scale)
    with nan_poisoned_empty():
        out, lse = fast.attention(q, k, v, mask, scale=scale, return_lse=True)
    return check_attention(out, lse, golden, baseline, context=context)


def check_recall_density(
    q: torch.Tensor,
    k: torch.Tensor,
    selection: BlockColumnPlan | torch.Tensor,
    *,
    expected_selection: BlockColumnPlan | torch.Tensor | None = None,
    scale: float | None = None,
    context: str = "",
) -> float:
    """`fast.recall` / `fast.density` agree with `reference.recall` / `reference.density`.

    Args:
        q, k: the inputs. selection: a plan or a bool mask `[B, Hq, N, N]` given to
            `fast`. expected_selection: what `reference` gets (default: the same).
        scale: softmax scale. context: prefix for failure messages.

    Returns:
        The recall error / allowance ratio.

    Raises:
        AssertionError: recall beyond `tolerance.recall_allowance`, or densities not
            bit-identical (both count kept causal pairs exactly).
    """
    expected_sel = selection if expected_selection is None else expected_selection
    with nan_poisoned_empty():
        got = fast.recall(q, k, selection, scale=scale)
    expected = reference.recall(q, k, expected_sel, scale=scale)
    q64, k64 = q.to(torch.float64), k.to(torch.float64)
    _, lse_full = reference.attention(q64, k64, k64, scale=scale, return_lse=True)
    ratio = check_recall(got, expected, max_abs_lse=float(lse_full.abs().max().item()),
                         context=context).ratio
    dens_got = fast.density(selection)
    dens_expected = reference.density(expected_sel)
    if dens_got.dtype != torch.float64 or not torch.equal(dens_got.cpu(), dens_expected.cpu()):
        diff = (dens_got.double().cpu() - dens_expected.double().cpu()).abs()
        raise _fail(context, f"density differs: got {dens_got.flatten()[:8].tolist()} "
                             f"({dens_got.dtype}), reference {dens_expected.flatten()[:8].tolist()}; "
                             f"max diff {float(diff.max()):.3e}")
    return ratio


def check_method_end_to_end(
    spec: MethodSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    params: dict[str, Any],
    *,
    context: str = "",
) -> float:
    """`fast.<name>(q, k, v, **params)` against the float64 golden of the method (at
    `params["scale"]` when the method takes one).

    The golden runs the reference estimator's plan through float64 attention (for
    `exact_plans=False` methods whose plans differ at a tie, the fast plan's golden
    is used; `check_method_plan` judges the tie). `reference.<name>` in the input
    dtype must also meet the policy against its own golden.

    Returns:
        The largest error / allowance ratio of the fast run.

    Raises:
        AssertionError: under the tolerance policy.
    """
    if not spec.plan_based:
        return _check_planless_end_to_end(spec, q, k, v, params, context=context)
    ref_plan = spec.plan_fn("reference")(q, k, **params)
    plan = ref_plan
    if not spec.exact_plans:
        fast_plan = spec.plan_fn("fast")(q, k, **params).to(q.device)
        if not ref_plan.equal(fast_plan):
            plan = fast_plan
    scale = params.get("scale")
    mask = plan.to_dense_mask()
    golden = golden_attention(q, k, v, mask, scale=scale)
    baseline = baseline_attention(q, k, v, mask, scale=scale)
    with nan_poisoned_empty():
        out = spec.fast_run(q, k, v, **params)
    ratio = check_attention(out, None, golden, baseline, context=f"{context} fast")
    ref_out = spec.reference_run(q, k, v, **params)
    if plan is not ref_plan:
        ref_mask = ref_plan.to_dense_mask()
        golden = golden_attention(q, k, v, ref_mask, scale=scale)
        baseline = baseline_attention(q, k, v, ref_mask, scale=scale)
    check_output(ref_out, golden[0], baseline[0], context=f"{context} reference")
    return ratio


def _check_planless_end_to_end(
    spec: MethodSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: dict[str, Any],
    *, context: str,
) -> float:
    """End to end for a method without a plan: the spec's own golden and baseline."""
    assert spec.golden is not None
    golden, baseline = spec.golden(q, k, v, params)
    with nan_poisoned_empty():
        out = spec.fast_run(q, k, v, **params)
    ratio = check_output(out, golden, baseline, context=f"{context} fast").ratio
    check_output(spec.reference_run(q, k, v, **params), golden, baseline, context=f"{context} reference")
    return ratio


# -- properties with their draws -----------------------------------------------


PropertyFn = Callable[[Draw, Caps, "MethodSpec | None"], float]


@dataclass(frozen=True)
class Property:
    """One conformance property and the draws that feed it.

    Attributes:
        name: short name for tables and test ids.
        per_method: True if it runs once per registered method (`run` gets the
            `MethodSpec`), False if it checks the kernel alone (`run` gets None).
        applies: for per-method properties, which methods it runs on.
        run: `(draw, caps, spec) -> error/allowance ratio`; raises AssertionError.
        summary: one line for `--list` and docs.
    """

    name: str
    per_method: bool
    run: PropertyFn
    summary: str
    applies: Callable[[MethodSpec], bool] = lambda spec: True

    def cases(self, methods: dict[str, MethodSpec]) -> list[MethodSpec]:
        """The registered methods this per-method property runs on."""
        return [spec for spec in methods.values() if self.applies(spec)]


def _method_inputs(
    draw: Draw, caps: Caps, spec: MethodSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any], str, Any]:
    """Inputs and parameters of one method example, with the `draw_limits` context to run in."""
    n = draw_seqlen(draw, caps)
    params = draw_method_params(draw, spec, n)
    blocks = method_blocks(params)
    shape = draw_shape(draw, caps, seqlen=n, blocks=blocks, min_heads=spec.min_heads)
    q, k, v, what = draw_inputs(draw, shape, draw_dtype(draw), caps.device, kinds=spec.input_kinds,
                                blocks=blocks)
    params, per_head_what = draw_per_head_knobs(draw, spec, params, n, q.shape[1], k.shape[1])
    limits, limits_what = draw_limits(draw, caps)
    return (q, k, v, spec.call_params(params, q),
            f"{spec.name} {what} params={params}{per_head_what} {limits_what}", limits)


def _need(spec: MethodSpec | None) -> MethodSpec:
    if spec is None:
        raise ValueError("this property runs per method; pass a MethodSpec")
    return spec


def _prop_method_plan(draw: Draw, caps: Caps, spec: MethodSpec | None) -> float:
    s = _need(spec)
    q, k, v, params, context, limits = _method_inputs(draw, caps, s)
    with limits:
        if s.plan_based:
            check_method_plan(s, q, k, params, context=context)
        else:
            assert s.structure_check is not None
            try:
                s.structure_check(q, k, v, params)
            except AssertionError as err:
                raise _fail(context, str(err)) from err
    return 0.0


def _prop_method_estimate(draw: Draw, caps: Caps, spec: MethodSpec | None) -> float:
    s = _need(spec)
    q, k, _, params, context, limits = _method_inputs(draw, caps, s)
    with limits:
        return check_method_estimate(s, q, k, params, context=context)


def _prop_method_end_to_end(draw: Draw, caps: Caps, spec: MethodSpec | None) -> float:
    s = _need(spec)
    q, k, v, params, context, limits = _method_inputs(draw, caps, s)
    with limits:
        return check_method_end_to_end(s, q, k, v, params, context=context)


def _prop_method_recall(draw: Draw, caps: Caps, spec: MethodSpec | None) -> float:
    s = _need(spec)
    q, k, _, params, context, limits = _method_inputs(draw, caps, s)
    with limits:
        got_plan = s.plan_fn("fast")(q, k, **params)
        expected_plan = s.plan_fn("reference")(q, k, **params)
        if not s.exact_plans and not expected_plan.equal(got_plan.to(expected_plan.device)):
            expected_plan = got_plan  # a tie; `method_plan` judges it
        return check_recall_density(q, k, got_plan, expected_selection=expected_plan,
                                    scale=params.get("scale"), context=context)


# Inputs of the kernel properties: random, planted lines (peaked rows), exact ties,
# logits far from 0 (block means and sums that a miscount moves).
_KERNEL_INPUTS = ("normal", "lines", "lattice", "shifted")


def _random_plan_inputs(
    draw: Draw, caps: Caps
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, BlockColumnPlan, str, Any]:
    """Inputs and a random plan, with the context to run the kernel in (`forced_tiles`,
    `draw_column_path`)."""
    n = draw_seqlen(draw, caps)
    bm, bn = draw_block_sizes(draw)
    tiles = draw_tiles(draw, caps, bm, bn)
    shape = draw_shape(draw, caps, seqlen=n, blocks=(bm, bn), tiles=tiles)
    q, k, v, what = draw_inputs(draw, shape, draw_dtype(draw), caps.device, kinds=_KERNEL_INPUTS,
                                blocks=(bm, bn))
    plan, plan_what = draw_plan(draw, shape, block_m=bm, block_n=bn, device=caps.device)
    tiles_what = f" tiles={tiles[0]}x{tiles[1]}" if tiles else ""
    columns, columns_what = draw_column_path(draw, caps)
    return (q, k, v, plan, f"{what} {plan_what}{tiles_what} {columns_what}".rstrip(),
            _both(forced_tiles(tiles), columns))


@contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    """Enter two context managers, the first outermost."""
    with first, second:
        yield


def _prop_sparse_attention(draw: Draw, caps: Caps, spec: MethodSpec | None) -> float:
    q, k, v, plan, context, tiles = _random_plan_inputs(draw, caps)
    scale = draw_scale(draw)
    limits, limits_what = draw_limits(draw, caps)
    with limits, tiles:
        return check_sparse_attention(q, k, v, plan, scale=scale,
                                      context=f"{context} scale={scale} {limits_what}")


def _prop_plan_validation(draw: Draw, caps: Caps, spec: MethodSpec | None) -> float:
    n = draw_seqlen(draw, caps)
    bm, bn = draw_block_sizes(draw)
    shape = draw_shape(draw, caps, seqlen=n, blocks=(bm, bn))
    q, k, v, what = draw_inputs(draw, shape, draw_dtype(draw), caps.device)
    plan, plan_what = draw_plan(draw, shape, block_m=bm, block_n=bn, device=caps.device)
    # The dense mask is the plan's meaning for every golden: it must be causal on its own
    # (the reference attention intersects it with causality again, so only this sees it).
    dense = plan.to_dense_mask()
    causal = torch.ones(plan.seqlen, plan.key_len, dtype=torch.bool, device=dense.device).tril_(plan.query_offset)
    if bool((dense & ~causal).any()):
        raise _fail(f"{what} {plan_what}", "plan.to_dense_mask() keeps a key after its row (not causal)")
    # Every corruption that applies to this plan (a few kinds need lists of two or more).
    seed = int(draw(st.integers(0, 2**31 - 1)))
    for kind in CORRUPTIONS:
        bad = corrupt_plan(plan, kind, seed)
        if bad is None:
            continue
        check_plan_rejected(q, k, v, bad, context=f"{what} {plan_what} corruption={kind} seed={seed}")
    return 0.0


def split_plan(plan: BlockColumnPlan, seed: int) -> tuple[BlockColumnPlan, BlockColumnPlan]:
    """Two plans over disjoint key sets whose union is `plan`'s (a random split).

    Every listed block goes to one part; every column outside the listed blocks goes
    to one part (columns inside them are dropped: the union already holds them).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks = plan.block_mask().cpu()
    in_blocks = blocks.repeat_interleave(plan.block_n, dim=3)[..., : plan.seqlen]
    columns = plan.column_mask().cpu() & ~in_blocks
    to_a_blocks = torch.rand(blocks.shape, generator=gen) < 0.5
    to_a_columns = torch.rand(columns.shape, generator=gen) < 0.5
    sizes = {"seqlen": plan.seqlen, "block_m": plan.block_m, "block_n": plan.block_n}
    part_a = BlockColumnPlan.from_masks(blocks & to_a_blocks, columns & to_a_columns, **sizes)
    part_b = BlockColumnPlan.from_masks(blocks & ~to_a_blocks, columns & ~to_a_columns, **sizes)
    return part_a.to(plan.device), part_b.to(plan.device)


def check_resumed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    seed: int = 0,
    scale: float | None = None,
    context: str = "",
) -> float:
    """Two `fast.sparse_attention` calls chained through an `AttentionState` equal one pass.

    `plan` is split into two disjoint parts (`split_plan`); the second call resumes
    from the state the first one left. Its output and lse are checked against the
    float64 golden of the whole plan, and so are the output and lse of the state it
    leaves behind.

    Returns:
        The largest error / allowance ratio.

    Raises:
        AssertionError: under the tolerance policy.
    """
    part_a, part_b = split_plan(plan, seed)
    mask = plan.to_dense_mask()
    golden = golden_attention(q, k, v, mask, scale=scale)
    baseline = baseline_attention(q, k, v, mask, scale=scale)
    with nan_poisoned_empty():
        state = reference.AttentionState.like(q)
        fast.sparse_attention(q, k, v, part_a, scale=scale, state=state)
        out, lse = fast.sparse_attention(q, k, v, part_b, scale=scale, state=state, return_lse=True)
    ratio = check_attention(out, lse, golden, baseline, context=f"{context} resumed")
    left = check_attention(state.output(q.dtype), state.lse(), golden, baseline,
                           context=f"{context} state left by the resumed call")
    # The reference resumes the same way (its float64 state, then its own output).
    ref_state = reference.AttentionState.like(q, dtype=torch.float64)
    reference.sparse_attention(q, k, v, part_a, scale=scale, state=ref_state)
    ref_out, ref_lse = reference.sparse_attention(q, k, v, part_b, scale=scale, state=ref_state,
                                                  return_lse=True)
    check_attention(ref_out, ref_lse, golden, baseline, context=f"{context} reference resumed")
    return max(ratio, left)


def check_block_mean_output(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    scale: float | None = None,
    context: str = "",
) -> float:
    """`block_mean_out` of `fast.sparse_attention` against the reference's on float64 inputs.

    Returns:
        The error / allowance ratio.

    Raises:
        AssertionError: under `tolerance.check_block_means`.
    """
    b, h = q.shape[:2]
    shape = (b, h, plan.num_query_blocks, plan.num_key_blocks)
    expected = torch.empty(shape, dtype=torch.float32, device=q.device)
    q64, k64, v64 = (t.to(torch.float64) for t in (q, k, v))
    reference.sparse_attention(q64, k64, v64, plan, scale=scale, block_mean_out=expected)
    got = torch.full(shape, math.nan, dtype=torch.float32, device=q.device)
    with nan_poisoned_empty():
        fast.sparse_attention(q, k, v, plan, scale=scale, block_mean_out=got)
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    max_logit = float(q64.abs().amax(dim=(-1, -2)).max()) * float(k64.abs().amax(dim=(-1, -2)).max()) \
        * q.shape[-1] * sm_scale
    return check_block_means(got, expected, max_abs_logit=max_logit, context=context).ratio


def check_nonfinite_propagation(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    scale: float | None = None,
    context: str = "",
) -> float:
    """`fast` and `reference` agree on non-finite inputs (reference/attention.py's semantics).

    The rows whose output is NaN and the rows whose lse is NaN must be the same in
    both packages (exactly: a row that keeps a NaN or infinity reads NaN, no other row
    does), and every other row must be finite in both.

    Returns:
        0.0 (an exact check).

    Raises:
        AssertionError: naming the first row where the two differ.
    """
    q64, k64, v64 = (t.to(torch.float64) for t in (q, k, v))
    ref_out, ref_lse = reference.sparse_attention(q64, k64, v64, plan, scale=scale, return_lse=True)
    with nan_poisoned_empty():
        out, lse = fast.sparse_attention(q, k, v, plan, scale=scale, return_lse=True)
    checks = (("output NaN", ref_out.isnan().any(dim=-1), out.isnan().any(dim=-1)),
              ("output non-finite", (~torch.isfinite(ref_out)).any(dim=-1), (~torch.isfinite(out)).any(dim=-1)),
              ("lse NaN", ref_lse.isnan(), lse.isnan()))
    for what, expected, got in checks:
        if not torch.equal(expected.cpu(), got.cpu()):
            at = _first_true((expected != got).cpu())
            raise _fail(context, f"{what} rows differ at (b, h, row) {at}: fast {bool(got[at])}, "
                                 f"reference {bool(expected[at])}")
    return 0.0


def _prop_nonfinite(draw: Draw, caps: Caps, spec: MethodSpec | None) -> float:
    q, k, v, plan, context, tiles = _random_plan_inputs(draw, caps)
    # v most often: a non-finite value is the only thing the kernel must find itself (q and k
    # reach the scores, which carry NaN on their own).
    where = str(draw(st.sampled_from(["v", "q", "k", "v"])))
    value = float(draw(st.sampled_from([math.nan, math.inf, -math.inf])))
    target = {"q": q, "k": k, "v": v}[where].clone()
    count = int(draw(st.integers(1, 3)))
    seed = int(draw(st.integers(0, 2**31 - 1)))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # Two times in three, aimed at the boundary: a key (of k or v) that some rows of a query
    # block keep and others of the same block do not (the diagonal, a column), so a
    # kernel that poisons or reads a whole tile's rows shows it.
    aimed = where != "q" and bool(draw(st.sampled_from([True, True, False])))
    partial = _partially_kept_keys(plan, q.shape[1] // k.shape[1]) if aimed else []
    for _ in range(count):
        at: tuple[int, ...]
        if partial:
            b, hkv, key = partial[int(torch.randint(0, len(partial), (1,), generator=gen))]
            at = (b, hkv, key, int(torch.randint(0, target.shape[3], (1,), generator=gen)))
        else:
            at = tuple(int(torch.randint(0, size, (1,), generator=gen)) for size in target.shape)
        target[at] = value
    inputs = {"q": q, "k": k, "v": v, where: target}
    with tiles:
        return check_nonfinite_propagation(inputs["q"], inputs["k"], inputs["v"], plan,
                                           context=f"{context} {count} x {value} in {where} seed={seed} "
                                                   f"aimed={bool(partial)}")


def _partially_kept_keys(plan: BlockColumnPlan, group: int) -> list[tuple[int, int, int]]:
    """(batch row, KV head, key) of every key that some rows of a query block keep and
    other rows of the same block do not, under `plan` (query head h reads KV head h // group)."""
    mask = plan.to_dense_mask().cpu()  # [B, Hq, N, keys]
    b, hq, n, keys = mask.shape
    qb = -(-n // plan.block_m)
    padded = torch.zeros(b, hq, qb * plan.block_m, keys, dtype=torch.bool)
    padded[:, :, :n] = mask
    rows = padded.view(b, hq, qb, plan.block_m, keys)
    real = torch.zeros(qb * plan.block_m, dtype=torch.bool)
    real[:n] = True
    real = real.view(qb, plan.block_m)[None, None, :, :, None]
    some = rows.any(dim=3)
    every = (rows | ~real).all(dim=3)
    hits = (some & ~every).any(dim=2)  # [B, Hq, keys]
    return sorted({(int(i), int(h) // group, int(j)) for i, h, j in hits.nonzero().tolist()})


def _prop_resumed_attention(draw: Draw, caps: Caps, spec: MethodSpec | None) -> float:
    q, k, v, plan, context, tiles = _random_plan_inputs(draw, caps)
    scale = draw_scale(draw)
    seed = int(draw(st.integers(0, 2**31 - 1)))
    with tiles:
        return check_resumed_attention(q, k, v, plan, seed=seed, scale=scale,
                                       context=f"{context} split seed={seed} scale={scale}")


def _prop_block_means(draw: Draw, caps: Caps, spec: MethodSpec | None) -> float:
    q, k, v, plan, context, tiles = _random_plan_inputs(draw, caps)
    scale = draw_scale(draw)
    with tiles:
        return check_block_mean_output(q, k, v, plan, scale=scale, context=f"{context} scale={scale}")


def _prop_masked_attention(draw: Draw, caps: Caps, spec: MethodSpec | None) -> float:
    shape = draw_shape(draw, caps)
    q, k, v, what = draw_inputs(draw, shape, draw_dtype(draw), caps.device, kinds=_KERNEL_INPUTS,
                                blocks=(128, 128))
    mask: torch.Tensor | None = None
    mask_what = "mask None"
    if bool(draw(st.sampled_from([True, True, True, False]))):
        mask, mask_what = draw_mask(draw, shape, caps.device)
    scale = draw_scale(draw)
    return check_masked_attention(q, k, v, mask, scale=scale,
                                  context=f"{what} {mask_what} scale={scale}")


def _prop_recall_random(draw: Draw, caps: Caps, spec: MethodSpec | None) -> float:
    q, k, _, plan, context, tiles = _random_plan_inputs(draw, caps)
    scale = draw_scale(draw)
    with tiles:
        if bool(draw(st.booleans())):
            return check_recall_density(q, k, plan, scale=scale, context=f"{context} scale={scale}")
        mask = plan.to_dense_mask()
        return check_recall_density(q, k, mask, scale=scale, context=f"{context} as mask scale={scale}")


# The rule off for these (conformance.dense_fallback says why); "dense_fallback" checks the rule.
PROPERTIES: tuple[Property, ...] = tuple(replace(p, run=rule_off(p.run)) for p in (
    Property("plan", True, _prop_method_plan,
             "fast plan equals the reference plan (equal() and to_dense_mask()); for a method "
             "without a plan, its structures (Delta-KV: keep mask, packing, phase plans)"),
    Property("end_to_end", True, _prop_method_end_to_end,
             "fast.<method> output vs float64 golden of the reference plan (or the method's own "
             "golden); reference.<method> too"),
    Property("recall_density", True, _prop_method_recall,
             "fast.recall/density of the method's plan vs reference",
             applies=lambda spec: spec.plan_based),
    Property("estimate", True, _prop_method_estimate,
             "the method's estimate before any top-k (scores, pooled means) vs reference, "
             "under the tolerance policy (no tie forgiven)",
             applies=lambda spec: spec.estimate is not None),
    Property("sparse_attention", False, _prop_sparse_attention,
             "fast.sparse_attention (out, lse) on random valid plans vs float64 golden"),
    Property("masked_attention", False, _prop_masked_attention,
             "fast.attention with a dense mask (or None) vs float64 golden"),
    Property("recall_density_random", False, _prop_recall_random,
             "fast.recall/density on random plans and masks vs reference"),
    Property("resumed_attention", False, _prop_resumed_attention,
             "two fast.sparse_attention calls chained through an AttentionState equal one pass"),
    Property("block_means", False, _prop_block_means,
             "fast block_mean_out (mean scaled logit per listed block) vs reference"),
    Property("nonfinite", False, _prop_nonfinite,
             "NaN/inf in q, k or v reach exactly the same rows in fast and reference"),
    Property("plan_validation", False, _prop_plan_validation,
             "plans that break one invariant (order, range, causality, counts, disjointness, "
             "dtype, shape) are refused by validate() and both packages before any launch"),
)) + (Property("dense_fallback", True, dense_fallback_property(_method_inputs), DENSE_FALLBACK,
                applies=applies_dense_fallback),)


def properties() -> dict[str, Property]:
    """`PROPERTIES` by name."""
    return {p.name: p for p in PROPERTIES}
