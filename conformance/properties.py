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
    edge_seqlen,
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
    # A third of the examples of a method with per-head knobs (the first among them): N
    # short enough that several query heads (GQA, batch rows) of several blocks each fit
    # the interpreter's work cap, so the knobs' per-head values, head groups and the
    # (batch, head) maps of the estimators all meet a plan with choices to make. Drawn
    # freely, long N leaves room for one head and many heads come with N under a block.
    several_heads = bool(spec.method.knobs) and caps.max_tile_steps is not None \
        and int(draw(st.integers(0, 2))) == 0
    if several_heads:
        n = int(draw(st.integers(min(49, caps.max_seqlen), min(96, caps.max_seqlen))))
    params = draw_method_params(draw, spec, n)
    if several_heads or not draw(st.booleans()):
        finer = _finer_until(params, n, 3)
        try:
            spec.method.check_params(finer)
            params = finer
        except (TypeError, ValueError):
            pass
    blocks = method_blocks(params)
    n = edge_seqlen(draw, caps, n, _block_params(params))
    shape = draw_shape(draw, caps, seqlen=n, blocks=blocks, min_heads=spec.min_heads)
    q, k, v, what = draw_inputs(draw, shape, draw_dtype(draw), caps.device, kinds=spec.input_kinds,
                                blocks=blocks)
    params, per_head_what = draw_per_head_knobs(draw, spec, params, n, q.shape[1], k.shape[1], often=several_heads)
    limits, limits_what = draw_limits(draw, caps, head_groups=bool(per_head_what) and q.shape[1] > 1)
    return (q, k, v, spec.call_params(params, q),
            f"{spec.name} {what} params={params}{per_head_what} {limits_what}", limits)


def _block_params(params: dict[str, Any]) -> list[int]:
    """The block sizes among a method's parameters (every int parameter named `*block*`)."""
    return sorted({int(v) for key, v in params.items()
                   if "block" in key and isinstance(v, int) and not isinstance(v, bool) and v > 1})


def _need(spec: MethodSpec | None) -> MethodSpec:
    if spec is None:
        raise ValueError("this property runs per method; pass a MethodSpec")
    return spec


def _estimator_caps(caps: Caps) -> Caps:
    """Caps of the properties that run a method's estimator but not the attention kernel
    (plan, estimate): twice the interpreter's tile steps (the cap counts attention tile
    steps), so the shapes carry more batch rows and heads: different content per batch
    row and per-head knobs that differ between heads of several batch rows."""
    steps = None if caps.max_tile_steps is None else 2 * caps.max_tile_steps
    return replace(caps, max_tile_steps=steps)


def _prop_method_plan(draw: Draw, caps: Caps, spec: MethodSpec | None) -> float:
    s = _need(spec)
    q, k, v, params, context, limits = _method_inputs(draw, _estimator_caps(caps), s)
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
    q, k, _, params, context, limits = _method_inputs(draw, _estimator_caps(caps), s)
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
    n = edge_seqlen(draw, caps, n, (bm, bn))
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


# -- sequences of calls in one process -------------------------------------------------
#
# Every other property checks one call on fresh draws. State kept between calls (a host-side
# table keyed by some of a call's parameters, a plan object's cached resolution, a launch
# configuration remembered per signature, the pivots a stateful method carries from layer to
# layer) is wrong only for a later call that shares part of the key with an earlier one. The
# properties below make calls in a row that differ in one thing at a time, at one N.

# What changes from one call of a sequence to the next.
SEQUENCE_CHANGES = ("blocks", "blocks", "blocks", "params", "seqlen", "shape", "dtype", "content", "knobs")


def _sequence_caps(caps: Caps) -> Caps:
    """Sizes for sequences (several calls an example; what they look for is kept between
    calls, not found at long N): N up to a quarter of the cap but at least 200 (the CPU
    cap), half the interpreter's tile steps a call."""
    steps = None if caps.max_tile_steps is None else max(1, caps.max_tile_steps // 2)
    return replace(caps, max_seqlen=min(caps.max_seqlen, max(200, caps.max_seqlen // 4)), max_tile_steps=steps)


def _finer_until(params: dict[str, Any], n: int, count: int) -> dict[str, Any]:
    """`params` with its block sizes halved (each down to 16) until N = n spans at least
    `count` blocks of the largest: with one or two blocks a sparse method has nothing to
    choose (its plan is dense, its per-head values and head groups change nothing), so
    half the examples of every method property draw enough blocks for a choice."""
    while count * max(_block_params(params) or [1]) > n and _refinable(params):
        params = {key: (val // 2 if "block" in key and isinstance(val, int) and not isinstance(val, bool)
                        and val >= 32 and (val // 2) % 16 == 0 else val) for key, val in params.items()}
    return params


def _refinable(params: dict[str, Any]) -> bool:
    """Whether some block size among `params` can be halved (to a multiple of 16)."""
    return any("block" in key and isinstance(v, int) and not isinstance(v, bool) and v >= 32 and (v // 2) % 16 == 0
               for key, v in params.items())


def _neighbour_blocks(draw: Draw, params: dict[str, Any], *, finer: bool = False) -> dict[str, Any]:
    """`params` with each block size halved (mostly; always with `finer`) or doubled, where
    the result is still a multiple of 16 in [16, 256]: the same problem on a finer or
    coarser grid. A structure built for the coarser grid and kept is wrong on the finer one
    (the other way round it often still fits)."""
    out = dict(params)
    for key, value in params.items():
        if "block" not in key or not isinstance(value, int) or isinstance(value, bool):
            continue
        steps = (value // 2,) if finer else (value // 2, value // 2, value // 2, value * 2)
        options = [x for x in steps if x % 16 == 0 and 16 <= x <= 256 and x != value]
        if options:
            out[key] = int(draw(st.sampled_from(options)))
    return out


@dataclass
class _Call:
    """The draws of one call of a sequence: raw parameters, shape, dtype and inputs."""

    params: dict[str, Any]
    shape: Any
    dtype: torch.dtype
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    what: str
    call_params: dict[str, Any]
    knobs_what: str


def _fits(caps: Caps, shape: Any, blocks: tuple[int, int], min_heads: int) -> bool:
    """Whether `shape` kept for a call at plan blocks `blocks` stays within twice the
    sequence's `caps.max_tile_steps` (the cap of a single call: `_sequence_caps` halves it)."""
    from .strategies import interpreter_work, kernel_tiles

    if caps.max_tile_steps is None:
        return True
    work = interpreter_work(shape.seqlen, shape.head_dim, kernel_tiles(*blocks, shape.head_dim))
    return bool(shape.batch * shape.q_heads * work <= max(2 * caps.max_tile_steps, min_heads * work))


def _draw_call(draw: Draw, caps: Caps, spec: MethodSpec, n: int, prev: _Call | None,
               change: str) -> _Call:
    """The next call of a sequence at N = n: fresh draws (no `prev`), or `prev` with one
    thing changed (`SEQUENCE_CHANGES`): the block sizes, the other parameters, the shape
    (batch, heads, D), the dtype, the tensor values, or the per-head knobs."""
    if prev is None or change in ("blocks", "finer", "params"):
        fresh = draw_method_params(draw, spec, n)
        if prev is None:
            params = fresh
        else:
            is_block = {key for key in {*fresh, *prev.params} if "block" in key}

            def kept(key: str) -> bool:
                """Whether `key` keeps the call before's value (this change does not name it)."""
                return (key in is_block) == (change == "params")

            params = {**{key: val for key, val in fresh.items() if not kept(key)},
                      **{key: val for key, val in prev.params.items() if kept(key)}}
            if change == "finer" or (change == "blocks" and bool(draw(st.booleans()))):
                params = _neighbour_blocks(draw, prev.params, finer=change == "finer")
            try:
                spec.method.check_params(params)
            except (TypeError, ValueError):
                params = fresh
    else:
        params = prev.params
    blocks = method_blocks(params)
    shape = prev.shape if prev is not None and change not in ("shape", "seqlen") else None
    if shape is None or not _fits(caps, shape, blocks, spec.min_heads):
        shape = draw_shape(draw, caps, seqlen=n, blocks=blocks, min_heads=spec.min_heads)
    if prev is not None and change == "dtype":
        # The same values in the other dtype: only the dtype differs from the call before.
        dtype = torch.bfloat16 if prev.dtype == torch.float16 else torch.float16
        q, k, v = (t.to(dtype) for t in (prev.q, prev.k, prev.v))
        what = f"{prev.what} as {str(dtype).removeprefix('torch.')}"
    elif prev is not None and shape is prev.shape and change != "content":
        dtype, q, k, v, what = prev.dtype, prev.q, prev.k, prev.v, prev.what
    else:
        dtype = prev.dtype if prev is not None and change == "content" else draw_dtype(draw)
        q, k, v, what = draw_inputs(draw, shape, dtype, caps.device, kinds=spec.input_kinds, blocks=blocks)
    if prev is not None and params is prev.params and change != "knobs" and shape is prev.shape:
        raw, knobs_what = _raw_knobs(prev), prev.knobs_what
    else:
        raw, knobs_what = draw_per_head_knobs(draw, spec, params, n, q.shape[1], k.shape[1])
    knobbed = {**spec.call_params(raw, q), "__raw__": raw}
    return _Call(params, shape, dtype, q, k, v, what, knobbed, knobs_what)


def _raw_knobs(call: _Call) -> dict[str, Any]:
    """A call's parameters with its per-head knobs, before `call_params`."""
    raw: dict[str, Any] = call.call_params.get("__raw__", call.params)
    return raw


def _params_of(call: _Call) -> dict[str, Any]:
    return {key: val for key, val in call.call_params.items() if key != "__raw__"}


def _check_call(spec: MethodSpec, call: _Call, check: str, context: str) -> float:
    """One call of a sequence against the reference: its estimate (before any top-k), its
    plan (or a plan-less method's structures), or end to end."""
    params = _params_of(call)
    if check == "estimate" and spec.estimate is not None:
        return check_method_estimate(spec, call.q, call.k, params, context=context)
    if check == "end_to_end":
        return check_method_end_to_end(spec, call.q, call.k, call.v, params, context=context)
    if spec.plan_based:
        check_method_plan(spec, call.q, call.k, params, context=context)
        return 0.0
    assert spec.structure_check is not None
    try:
        spec.structure_check(call.q, call.k, call.v, params)
    except AssertionError as err:
        raise _fail(context, str(err)) from err
    return 0.0


def _prop_method_sequence(draw: Draw, caps: Caps, spec: MethodSpec | None) -> float:
    """Three to five calls of the method in one process, each differing from the one before
    in one thing: the second call the first on a finer block grid (each block size halved,
    where the method has one that can be), later ones a change drawn from
    `SEQUENCE_CHANGES` (block sizes (new, or halved or doubled), other parameters, N, shape, dtype,
    values, per-head knobs), every call checked against the reference: the estimate
    (cheap, no tie forgiven) where the method has one, the last call's plan (or a plan-less
    method's structures, or end to end a quarter of the time). Between calls, a third of
    the time, a call of another registered method on the same inputs, checked too."""
    from .registry import METHODS

    s = _need(spec)
    caps = _sequence_caps(caps)
    n = draw_seqlen(draw, caps)
    limits, limits_what = draw_limits(draw, caps, keep_state=True)
    calls = int(draw(st.integers(3, 5)))
    others = [name for name in METHODS if name != s.name]
    ratio = 0.0
    history: list[str] = []
    prev: _Call | None = None
    with limits:
        for i in range(calls):
            if prev is None:
                change = "first"
            elif i == 1 and _refinable(prev.params):
                # The second call: the same problem on a finer block grid, every time.
                change = "finer"
            else:
                change = str(draw(st.sampled_from(SEQUENCE_CHANGES)))
            if change == "seqlen":
                n = draw_seqlen(draw, caps)
            call = _draw_call(draw, caps, s, n, prev, change)
            if i + 1 < calls:
                check = "estimate" if s.estimate is not None else "plan"
            else:
                check = "end_to_end" if int(draw(st.integers(0, 3))) == 0 else "plan"
            history.append(f"call {i} ({change}, {check}): {call.what} params={call.params}{call.knobs_what}")
            context = f"{s.name} sequence {limits_what}; " + "; ".join(history)
            ratio = max(ratio, _check_call(s, call, check, context))
            if others and i + 1 < calls and int(draw(st.integers(0, 2))) == 0:
                other = METHODS[str(draw(st.sampled_from(others)))]
                if call.q.shape[1] >= other.min_heads:
                    o_params = draw_method_params(draw, other, n)
                    o_call = _Call(o_params, call.shape, call.dtype, call.q, call.k, call.v, call.what,
                                   other.call_params(o_params, call.q), "")
                    history.append(f"between: {other.name} params={o_params}")
                    _check_call(other, o_call, "estimate" if other.estimate is not None else "plan",
                                f"{s.name} sequence {limits_what}; " + "; ".join(history))
            prev = call
    return ratio


def check_layer_step(
    spec: MethodSpec,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ref_state: Any,
    fast_state: Any,
    *,
    layer: int,
    scale: float | None = None,
    context: str = "",
) -> tuple[float, Any]:
    """One layer of a stateful method (`Method.new_state`: SharePrefill), each package from its
    own state carried over the earlier layers; both states advance in place.

    The fast decisions must be ones the reference's float64 distances allow (modulo
    `ties.DISTANCE_MARGIN`); with equal decisions the plans must be equal; the fast output
    must meet the tolerance policy against the golden of its own plan, the reference's
    against its own; with equal decisions both packages must record pivots for the same
    (cluster, batch row) keys, and every new pivot of either package must be a valid
    Alg. 2 selection (modulo ties) of the float64 block means of its head and batch row,
    at that head's gamma.

    A difference the margins allow (a decision within the margin, a pivot mask decided by
    a tie) makes the two states legitimately different; the fast state then continues
    from a copy of the reference's, so later layers still compare like with like.

    Returns:
        (the fast output's error / allowance ratio, the fast state to carry on with).

    Raises:
        AssertionError: naming the layer.
    """
    from .ties import DISTANCE_MARGIN, check_decisions_modulo_margin, check_pivot_modulo_ties

    where = f"{context} layer {layer}"
    ref_plan, ref_decision = getattr(reference, f"{spec.name}_layer_plan")(q, k, ref_state.clone(), layer=layer,
                                                                          scale=scale)
    fast_plan, fast_decision = getattr(fast, f"{spec.name}_layer_plan")(q, k, fast_state.clone(), layer=layer,
                                                                       scale=scale)
    _check_valid(fast_plan, "fast", where)
    try:
        check_decisions_modulo_margin(ref_state, fast_decision.pattern, ref_decision.d_sparse,
                                      ref_decision.d_sim, layer=layer)
        gap = float((fast_decision.d_sparse.cpu() - ref_decision.d_sparse.cpu()).abs().max())
        if gap >= DISTANCE_MARGIN / 10:
            raise AssertionError(f"d_sparse differs by {gap:.3g} (allowed {DISTANCE_MARGIN / 10:.3g})")
    except AssertionError as err:
        raise _fail(where, f"decisions: {err}") from err
    same = torch.equal(fast_decision.pattern.cpu(), ref_decision.pattern.cpu())
    if same:
        check_plans_equal(ref_plan, fast_plan, context=where)
    ref_before, fast_before = dict(ref_state.pivots), dict(fast_state.pivots)
    with nan_poisoned_empty():
        assert spec.fast_layer is not None and spec.reference_layer is not None
        out = spec.fast_layer(q, k, v, fast_state, layer=layer, scale=scale)
    mask = fast_plan.to_dense_mask()
    golden = golden_attention(q, k, v, mask, scale=scale)
    baseline = baseline_attention(q, k, v, mask, scale=scale)
    ratio = check_output(out, golden[0], baseline[0], context=f"{where} fast").ratio
    ref_out = spec.reference_layer(q, k, v, ref_state, layer=layer, scale=scale)
    if not ref_plan.equal(fast_plan.to(ref_plan.device)):
        ref_mask = ref_plan.to_dense_mask()
        golden = golden_attention(q, k, v, ref_mask, scale=scale)
        baseline = baseline_attention(q, k, v, ref_mask, scale=scale)
    check_output(ref_out, golden[0], baseline[0], context=f"{where} reference")
    new = {name: {key: p for key, p in state.pivots.items() if before.get(key) is not p}
           for name, state, before in (("fast", fast_state, fast_before), ("reference", ref_state, ref_before))}
    if same and set(new["fast"]) != set(new["reference"]):
        raise _fail(where, f"new pivots (cluster, batch row): fast {sorted(new['fast'])}, reference "
                           f"{sorted(new['reference'])}")
    diverged = not same
    if new["fast"] or new["reference"]:
        b, hq = q.shape[:2]
        means = torch.empty(b, hq, ref_plan.num_query_blocks, ref_plan.num_key_blocks, device=q.device)
        dense = reference.dense_plan(q, k, block_m=ref_state.block_m, block_n=ref_state.block_n)
        q64, k64, v64 = (t.to(torch.float64) for t in (q, k, v))
        reference.sparse_attention(q64, k64, v64, dense, scale=scale, block_mean_out=means)
        for name, pivots in new.items():
            for (cluster, row), pivot in pivots.items():
                what = f"{name} pivot of cluster {cluster}, batch row {row} (head {pivot.head})"
                try:
                    check_pivot_modulo_ties(means[row, pivot.head].cpu(), pivot,
                                            gamma=ref_state.head_value("gamma", pivot.head), seqlen=q.shape[2],
                                            block_m=ref_state.block_m, block_n=ref_state.block_n, what=what)
                except AssertionError as err:
                    raise _fail(where, str(err)) from err
                if pivot.layer != layer:
                    raise _fail(where, f"{what} says layer {pivot.layer}")
        for key, pivot in new["fast"].items():
            other = new["reference"].get(key)
            diverged |= other is None or not torch.equal(pivot.mask.cpu(), other.mask.cpu())
    return ratio, (ref_state.clone() if diverged else fast_state)


def _prop_method_layers(draw: Draw, caps: Caps, spec: MethodSpec | None) -> float:
    """Two or three layers of one prefill of a stateful method: a state per package, made by
    the method's `new_state` and carried from layer to layer (`check_layer_step`), batch
    rows that decide apart, per-head knobs, a cluster layout over every layer."""
    s = _need(spec)
    assert s.new_state is not None
    caps = _sequence_caps(caps)
    n = draw_seqlen(draw, caps)
    params = draw_method_params(draw, s, n)
    n = edge_seqlen(draw, caps, n, _block_params(params))
    # A pivot of few key blocks is the diagonal alone whatever gamma a head has: at least
    # four blocks of each size, by longer N, then by finer blocks.
    n = max(n, min(caps.max_seqlen, 4 * max(method_blocks(params)) + 1))
    params = _finer_until(params, n, 4)
    blocks = method_blocks(params)
    # Two query heads at least: a pivot made by a head other than the first.
    shape = draw_shape(draw, caps, seqlen=n, blocks=blocks, min_heads=max(2, s.min_heads))
    if shape.batch == 1 and bool(draw(st.booleans())):
        # Pivots are kept per batch row: two rows of different content.
        shape = replace(shape, batch=2)
    dtype = draw_dtype(draw)
    layers = int(draw(st.integers(2, 3)))
    raw, knobs_what = draw_per_head_knobs(draw, s, params, n, shape.q_heads, shape.kv_heads, often=True)
    raw = _layers_layout(raw, layers)
    scale = raw.pop("scale", None)
    ref_state = s.new_state({key: val for key, val in raw.items() if key != "layer"})
    fast_state = ref_state.clone()
    ratio = 0.0
    seen: list[str] = []
    for layer in range(layers):
        q, k, v, what = draw_inputs(draw, shape, dtype, caps.device, kinds=s.input_kinds, blocks=blocks)
        seen.append(what)
        context = f"{s.name} layers params={params}{knobs_what} scale={scale}; inputs " + "; ".join(seen)
        step, fast_state = check_layer_step(s, q, k, v, ref_state, fast_state, layer=layer, scale=scale,
                                            context=context)
        ratio = max(ratio, step)
    return ratio


def _layers_layout(params: dict[str, Any], layers: int) -> dict[str, Any]:
    """A parameter set's one-layer cluster layout extended to `layers` layers: layer `l`
    keeps the first layer's clusters on every other head (rolled by `l`, so a pivot made by
    one head is offered to others) and gives the remaining heads clusters first seen at
    layer `l` (so later layers make pivots too, from heads other than the first)."""
    layout = params.get("layout")
    if layout is None or not hasattr(layout, "clusters"):
        return dict(params)
    row = tuple(layout.clusters[0])
    rows = []
    for l in range(layers):
        rolled = row[-l:] + row[:-l] if l else row
        rows.append(tuple(c if c < 0 or l == 0 or h % 2 == 0 else c + 100 * l for h, c in enumerate(rolled)))
    return {**params, "layout": type(layout)(tuple(rows))}


def _prop_sequence_attention(draw: Draw, caps: Caps, spec: MethodSpec | None) -> float:
    """Two or three `fast.sparse_attention` calls at one N, each differing from the one before
    in one thing: the plan, the block sizes, the shape, the dtype or the values (the same
    plan object kept where it still fits, so what a plan caches is reused), the forced
    tiles or the column path, the scale. Each against the float64 golden."""
    caps = _sequence_caps(caps)
    n = draw_seqlen(draw, caps)
    bm, bn = draw_block_sizes(draw)
    n = edge_seqlen(draw, caps, n, (bm, bn))
    tiles = draw_tiles(draw, caps, bm, bn)
    shape = draw_shape(draw, caps, seqlen=n, blocks=(bm, bn), tiles=tiles)
    dtype = draw_dtype(draw)
    q, k, v, what = draw_inputs(draw, shape, dtype, caps.device, kinds=_KERNEL_INPUTS, blocks=(bm, bn))
    plan, plan_what = draw_plan(draw, shape, block_m=bm, block_n=bn, device=caps.device)
    columns, columns_what = draw_column_path(draw, caps)
    scale = draw_scale(draw)
    calls = int(draw(st.integers(2, 3)))
    ratio = 0.0
    history: list[str] = []
    for i in range(calls):
        change = "first"
        if i > 0:
            change = str(draw(st.sampled_from(["plan", "blocks", "shape", "dtype", "content", "tiles",
                                               "columns", "scale"])))
            if change == "blocks":
                bm, bn = draw_block_sizes(draw)
                tiles = draw_tiles(draw, caps, bm, bn)
                if not _fits(caps, shape, (bm, bn), 1):
                    shape = draw_shape(draw, caps, seqlen=n, blocks=(bm, bn), tiles=tiles)
                    q, k, v, what = draw_inputs(draw, shape, dtype, caps.device, kinds=_KERNEL_INPUTS,
                                                blocks=(bm, bn))
            if change == "shape":
                shape = draw_shape(draw, caps, seqlen=n, blocks=(bm, bn), tiles=tiles)
            if change in ("shape", "content"):
                q, k, v, what = draw_inputs(draw, shape, dtype, caps.device, kinds=_KERNEL_INPUTS, blocks=(bm, bn))
            if change == "dtype":
                dtype = torch.bfloat16 if dtype == torch.float16 else torch.float16
                q, k, v = (t.to(dtype) for t in (q, k, v))
                what = f"{what} as {str(dtype).removeprefix('torch.')}"
            if change in ("plan", "blocks", "shape"):
                plan, plan_what = draw_plan(draw, shape, block_m=bm, block_n=bn, device=caps.device)
            if change == "tiles":
                tiles = draw_tiles(draw, caps, bm, bn)
            if change == "columns":
                columns, columns_what = draw_column_path(draw, caps)
            if change == "scale":
                scale = draw_scale(draw)
        tiles_what = f" tiles={tiles[0]}x{tiles[1]}" if tiles else ""
        history.append(f"call {i} ({change}): {what} {plan_what}{tiles_what} {columns_what} scale={scale}")
        with forced_tiles(tiles), columns:
            ratio = max(ratio, check_sparse_attention(q, k, v, plan, scale=scale,
                                                      context=f"sequence at N={n}; " + "; ".join(history)))
    return ratio


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
    Property("sequence", True, _prop_method_sequence,
             "three to five calls of the method in one process, each differing from the one "
             "before in one thing (block sizes, parameters, N, shape, dtype, values, per-head "
             "knobs), sometimes another method's call between them; each checked against the "
             "reference (estimate, plan or end to end): state kept between calls"),
    Property("layers", True, _prop_method_layers,
             "two or three layers of one prefill of a stateful method, each package carrying its "
             "own state: decisions, plans, outputs and recorded pivots against the reference",
             applies=lambda spec: spec.new_state is not None),
    Property("sequence_attention", False, _prop_sequence_attention,
             "two or three fast.sparse_attention calls at one N, each differing from the one "
             "before in one thing (plan, block sizes, shape, dtype, values, tiles, column path, "
             "scale; the same plan object kept where it fits), each vs the float64 golden"),
    Property("plan_validation", False, _prop_plan_validation,
             "plans that break one invariant (order, range, causality, counts, disjointness, "
             "dtype, shape) are refused by validate() and both packages before any launch"),
)) + (Property("dense_fallback", True, dense_fallback_property(_method_inputs), DENSE_FALLBACK,
                applies=applies_dense_fallback),)


def properties() -> dict[str, Property]:
    """`PROPERTIES` by name."""
    return {p.name: p for p in PROPERTIES}
