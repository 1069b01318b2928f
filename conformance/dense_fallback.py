"""Conformance of the break-even rule (`reference.dense_fallback`): both packages mark the
same heads dense, and each package's output follows its own marks.

Why the other properties run with the rule off (`rule_off`): they compare the estimators'
lists, and a head the rule marks dense has its lists ignored by `equal()` and by the
output (a list bug there would go unseen); their goldens (Delta-KV's, DeltaXAttention's)
describe the method without the rule. On CUDA the rule is on by default, so the
properties of `properties.PROPERTIES` are wrapped in `dense_fallback(False)`; this module's
property turns it on with one fixed table in both packages.

Why the two packages can decide differently at all. They call the same functions
(`reference.dense_fallback`): the cost model on integer pair counts (`plan_pairs`,
`delta_xattention_pairs`, the keep mask's sums) summed as integers before one float64
expression. So given equal plans (or equal Delta-KV keep masks, which are bit-identical by
construction) the marks are equal, to the bit, even for a head whose cost sits exactly on
the cutoff (the same rounding on both sides). They can differ only where the lists
themselves differ: a tie that a top-k or a greedy selection decides differently in the two
packages (`Checks.exact_plans` False, DeltaXAttention's fp32 tile weights). Then the two
packages price the head differently, and a cutoff between the two prices flips the mark in
one package only.

The tolerance band around a cutoff (`in_band`). The rule has two: per head, our kernel's
dense cost against the head's sparse cost; for the layer, one SDPA call's cost against the
sum over the heads of their best option. A head may be marked differently only when its
cutoff lies between the two packages' sparse costs of that head's own lists without the
rule, and the layer may go to SDPA in one package only when the SDPA cost lies between the
two packages' sums, each widened by `BAND` (relative) for rounding. Outside the bands the
marks must agree. Inside, the outputs are each checked against their own package's marks
(a dense head against full causal attention, the others against the method's output
without the rule), which is the check every example makes anyway.

Also checked per package: every head the rule marks on the lists made without the rule is
marked, and every head left unmarked keeps exactly the lists it has without the rule.

The table (`forcing_table`): block, column and ragged pairs cost 1 ps, programs nothing, a
dense pair through our kernel `cost` ps, a pair of the one SDPA call `sdpa` ps (or no SDPA
rate). So a head runs dense through our kernel iff its kept share (batch rows summed) is at
least `cost`, and the layer goes to SDPA iff the mean over the heads of `min(share, cost)`
is at least `sdpa`. The cutoff is drawn at a head's share exactly, halfway between two
heads' shares, above every share or below every share; the SDPA cost at that mean exactly,
below it, above it, or absent (`LAYERS`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ParamSpec

import torch
from hypothesis import strategies as st

from .. import fast, reference
from ..reference.delta_kv import dense_query_heads as delta_kv_dense_heads
from ..reference.delta_xattention import delta_xattention_pairs
from ..reference.delta_xattention import (
    dense_query_heads as delta_xattention_dense_heads,
)
from ..reference.dense_fallback import (
    HeadCosts,
    RatePoint,
    RateTable,
    dense_fallback,
    packed_head_costs,
    plan_costs,
    plan_pairs,
)
from ..reference.plan import BlockColumnPlan
from .registry import MethodSpec
from .strategies import Caps, Draw
from .tolerance import (
    baseline_attention,
    check_attention,
    check_output,
    golden_attention,
    nan_poisoned_empty,
)

# One method example as the properties draw it: (q, k, v, parameters, context, limits).
MethodInputs = Callable[[Draw, Caps, MethodSpec],
                        tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any], str, Any]]

__all__ = ["BAND", "CUTOFFS", "LAYERS", "RULE_METHODS", "SUMMARY", "applies", "check_delta_kv_marks",
           "check_delta_xattention_marks", "check_plan_marks", "dense_fallback_property", "forcing_table", "in_band",
           "rule_off"]

P = ParamSpec("P")

# Relative width of the rounding band around the cutoff (float64 costs of integer pairs).
BAND = 1e-9
# Where the drawn cutoff sits among the heads' kept shares.
CUTOFFS = ("at", "between", "above", "below")
# Where the drawn one-call SDPA cost sits against the heads' mean best share (none: no rate).
LAYERS = ("none", "at", "below", "above")
# The methods whose runs apply the break-even rule (streaming, a_shape, dense and
# shareprefill plan from N alone or their own rule, and do not).
RULE_METHODS = ("xattention", "dpxa", "flexprefill_vs", "anchor_attention", "vertical_slash", "minference",
                "sample_attention", "block_sparse", "delta_kv", "delta_xattention", "headwise")
SUMMARY = ("with one fixed rates table in both packages (our kernel's dense and the layer's one SDPA call "
           "priced), the heads sent dense agree (a head, or the layer, may differ only in the band where the "
           "cutoff lies between the two packages' costs of tied lists), each package "
           "marks every head its rule marks and keeps the others' lists exact, and each output follows its "
           "own marks")


def rule_off(run: Callable[P, float]) -> Callable[P, float]:
    """`run` with the break-even rule off (`dense_fallback(False)`): how every property but
    this module's runs, so its lists and goldens are the method's without the rule."""
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> float:
        with dense_fallback(False):
            return run(*args, **kwargs)

    wrapped.__name__ = getattr(run, "__name__", "property")
    wrapped.__doc__ = run.__doc__
    return wrapped


def applies(spec: MethodSpec) -> bool:
    """Whether the property runs on a method: those whose runs apply the rule."""
    return spec.name in RULE_METHODS


def forcing_table(cost: float, *, head_dim: int, seqlen: int, sdpa: float | None) -> RateTable:
    """A table under which a head runs dense through our kernel iff its kept share (batch
    rows summed) is at least `cost`, and the layer goes to one SDPA call iff the mean over
    the heads of `min(share, cost)` is at least `sdpa` (None: no SDPA rate, never): every
    sparse pair costs 1 ps, programs nothing, a dense pair `cost` ps through our kernel and
    `sdpa` ps through SDPA. One point per dtype and tile at (`seqlen`, `head_dim`): every
    lookup returns it unscaled."""
    cost = max(float(cost), 1e-12)
    sdpa_ps = 0.0 if sdpa is None else max(float(sdpa), 1e-12)
    points = tuple(RatePoint(max(1, seqlen), max(1, head_dim), dt, tile, 1.0, 1.0, 1.0, 0.0, sdpa_ps, cost)
                   for dt in ("float16", "bfloat16") for tile in (16, 32, 64, 128))
    return RateTable("conformance", f"forcing table, dense cost {cost!r}, sdpa {sdpa!r}", points)


def pick_layer(mean_best: float, where: str) -> float | None:
    """The one-call SDPA cost: None (`none`), the heads' mean best share exactly (`at`),
    half of it (`below`: the layer goes to SDPA), or above it (`above`: it never does)."""
    if where == "none":
        return None
    if where == "at":
        return mean_best
    if where == "below":
        return mean_best / 2
    return mean_best * 1.5 + 1e-6


def pick_cutoff(shares: list[float], where: str, index: int) -> float:
    """A cutoff among the heads' kept shares: `at` a share (exactly), `between` two distinct
    shares (halfway), `above` every share, `below` every share."""
    ordered = sorted(set(shares))
    if where == "at":
        return ordered[index % len(ordered)]
    if where == "between" and len(ordered) > 1:
        i = index % (len(ordered) - 1)
        return (ordered[i] + ordered[i + 1]) / 2
    if where == "below":
        return ordered[0] / 2
    return ordered[-1] * 1.5 + 1e-6


def in_band(sparse_ref: float, sparse_fast: float, dense: float, *, band: float = BAND) -> bool:
    """Whether a head's cutoff (`dense`) lies between the two packages' sparse costs of its
    lists, widened by `band` relative: where the marks may differ."""
    lo, hi = min(sparse_ref, sparse_fast), max(sparse_ref, sparse_fast)
    return lo * (1 - band) <= dense * (1 + band) and hi * (1 + band) >= dense * (1 - band)


def check_marks_agree(marks_ref: tuple[int, ...], marks_fast: tuple[int, ...], costs_ref: HeadCosts,
                      costs_fast: HeadCosts, *, context: str) -> None:
    """The two packages' marks agree outside the bands (`in_band`).

    Args:
        marks_ref, marks_fast: the heads each package sends dense.
        costs_ref, costs_fast: each package's costs of its own lists without the rule (the
            dense options are the same in both).

    Raises:
        AssertionError: the layer sent to SDPA in one package only outside its band, or a
            head marked in one package only outside its band.
    """
    layer_ref, layer_fast = bool(costs_ref.layer), bool(costs_fast.layer)
    if layer_ref != layer_fast:
        s_r, s_f = float(costs_ref.best_ms.sum()), float(costs_fast.best_ms.sum())
        d = float(costs_ref.layer_ms or 0.0)
        if not in_band(s_r, s_f, d):
            raise AssertionError(
                f"{context}: the layer goes to one SDPA call in {'reference' if layer_ref else 'fast'} only, outside "
                f"the band: best costs summed reference {s_r!r}, fast {s_f!r}, SDPA {d!r}")
        return
    for h in sorted(set(marks_ref) ^ set(marks_fast)):
        s_r, s_f, d = float(costs_ref.sparse_ms[h]), float(costs_fast.sparse_ms[h]), float(costs_ref.dense_ms[h])
        if not in_band(s_r, s_f, d):
            raise AssertionError(
                f"{context}: head {h} is dense in {'reference' if h in marks_ref else 'fast'} only, outside "
                f"the band: sparse cost reference {s_r!r}, fast {s_f!r}, dense {d!r}; marks reference "
                f"{list(marks_ref)}, fast {list(marks_fast)}")


def _plan_of(plan: BlockColumnPlan, heads: list[int]) -> BlockColumnPlan:
    """The plan with every head but `heads` listing nothing and unmarked."""
    return plan.without_heads([h for h in range(plan.num_heads) if h not in set(heads)])


def check_rule_followed(off: BlockColumnPlan, on: BlockColumnPlan, rates: RateTable, q: torch.Tensor, *,
                        which: str, context: str) -> None:
    """One package's plan with the rule (`on`) against its plan without it (`off`): the heads
    the rule marks on `off`'s lists are marked in `on`, and every unmarked head of `on` has
    exactly its lists of `off` (the early exit adds marks and changes no other list).

    Raises:
        AssertionError: naming the package and the head.
    """
    from ..reference.dense_fallback import break_even_heads

    ruled = break_even_heads(off.to(q.device), head_dim=int(q.shape[-1]), dtype=q.dtype, rates=rates)
    missing = sorted(set(ruled) - set(on.dense_heads))
    if missing:
        raise AssertionError(f"{context}: {which} leaves heads {missing} sparse that its rule sends dense "
                             f"(marks {list(on.dense_heads)})")
    kept = [h for h in range(on.num_heads) if h not in set(on.dense_heads)]
    for h in kept:
        if not _plan_of(on, [h]).equal(_plan_of(off.to(on.device), [h])):
            raise AssertionError(f"{context}: {which} head {h} is not marked dense but its lists differ from "
                                 "its lists without the rule")


def _goldens(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
             scale: float | None) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    return golden_attention(q, k, v, mask, scale=scale), baseline_attention(q, k, v, mask, scale=scale)


def check_plan_marks(spec: MethodSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: dict[str, Any],
                     *, where: str, index: int, layer: str, context: str = "") -> float:
    """The property for a plan-based method (see the module doc): `where` / `index` place
    the cutoff (`pick_cutoff`), `layer` the one-call SDPA cost (`pick_layer`).

    Returns:
        The largest error / allowance ratio of the fast output.

    Raises:
        AssertionError: marks that disagree outside the band, a package that does not follow
            its rule, an output off its own marks.
    """
    with dense_fallback(False):
        ref_off = spec.plan_fn("reference")(q, k, **params)
        fast_off = spec.plan_fn("fast")(q, k, **params)
    b, n = int(q.shape[0]), int(q.shape[2])
    causal = b * n * (n + 1) / 2
    block, column = plan_pairs(ref_off)
    shares = ((block + column).sum(dim=0).to(torch.float64) / causal).tolist()
    cost = pick_cutoff(shares, where, index)
    sdpa = pick_layer(sum(min(x, cost) for x in shares) / len(shares), layer)
    table = forcing_table(cost, head_dim=int(q.shape[-1]), seqlen=n, sdpa=sdpa)
    context = f"{context} cutoff {where} {cost!r}, SDPA {layer} {sdpa!r}"
    with dense_fallback(rates=table):
        ref_on = spec.plan_fn("reference")(q, k, **params)
        fast_on = spec.plan_fn("fast")(q, k, **params)
        with nan_poisoned_empty():
            out = spec.fast_run(q, k, v, **params)
        ref_out = spec.reference_run(q, k, v, **params)
    costs_ref = plan_costs(ref_off, head_dim=int(q.shape[-1]), dtype=q.dtype, rates=table)
    costs_fast = plan_costs(fast_off.to(ref_off.device), head_dim=int(q.shape[-1]), dtype=q.dtype, rates=table)
    check_marks_agree(ref_on.dense_heads, fast_on.dense_heads, costs_ref, costs_fast, context=context)
    check_rule_followed(ref_off, ref_on, table, q, which="reference", context=context)
    check_rule_followed(fast_off, fast_on, table, q, which="fast", context=context)
    scale = params.get("scale")
    golden, baseline = _goldens(q, k, v, fast_on.to(q.device).to_dense_mask(), scale)
    ratio = check_attention(out, None, golden, baseline, context=f"{context} fast (marks {list(fast_on.dense_heads)})")
    if not (fast_on.equal(ref_on.to(fast_on.device)) and fast_on.dense_heads == ref_on.dense_heads):
        golden, baseline = _goldens(q, k, v, ref_on.to_dense_mask(), scale)
    check_output(ref_out, golden[0], baseline[0], context=f"{context} reference (marks {list(ref_on.dense_heads)})")
    return ratio


def _with_dense_heads(golden: torch.Tensor, baseline: torch.Tensor, dense: tuple[torch.Tensor, torch.Tensor],
                      heads: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A method's golden and baseline with the heads `heads` replaced by full causal attention's."""
    if not heads:
        return golden, baseline
    golden, baseline = golden.clone(), baseline.clone()
    idx = list(heads)
    golden[:, idx] = dense[0][:, idx]
    baseline[:, idx] = dense[1][:, idx].to(baseline.dtype)
    return golden, baseline


def _check_outputs(spec: MethodSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: dict[str, Any],
                   table: RateTable, marks_ref: tuple[int, ...], marks_fast: tuple[int, ...], *,
                   context: str) -> float:
    """Each package's run under `table` against the method's golden with its own marked heads
    replaced by full causal attention."""
    assert spec.golden is not None
    with dense_fallback(rates=table):
        with nan_poisoned_empty():
            out = spec.fast_run(q, k, v, **params)
        ref_out = spec.reference_run(q, k, v, **params)
    golden, baseline = spec.golden(q, k, v, params)
    scale = params.get("scale")
    dense = (golden_attention(q, k, v, None, scale=scale)[0], baseline_attention(q, k, v, None, scale=scale)[0])
    g, bl = _with_dense_heads(golden, baseline, dense, marks_fast)
    ratio = check_output(out, g, bl, context=f"{context} fast (marks {list(marks_fast)})").ratio
    g, bl = _with_dense_heads(golden, baseline, dense, marks_ref)
    check_output(ref_out, g, bl, context=f"{context} reference (marks {list(marks_ref)})")
    return ratio


def check_delta_kv_marks(spec: MethodSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         params: dict[str, Any], *, where: str, index: int, layer: str, context: str = "") -> float:
    """The property for Delta-KV: the decision is on the keep masks, bit-identical in the two
    packages, so the marks must be equal (no band); each output follows them.

    Returns:
        The largest error / allowance ratio of the fast output.
    """
    from ..methods.delta_kv import stage1

    hq, hkv = int(q.shape[1]), int(k.shape[1])
    b, n = int(q.shape[0]), int(q.shape[2])
    sizes = {"seqlen": n, "block_m": int(params.get("block_m", 64)), "block_n": int(params.get("block_n", 64))}
    kept_ref = reference.delta_keep_mask(k, **stage1(params, hq, hkv)).sum(dim=-1)
    kept_fast = fast.delta_keep_mask(k, **stage1(params, hq, hkv)).sum(dim=-1)
    shares = (kept_ref.sum(dim=0).to(torch.float64) / (b * n)).tolist()
    # Under the forcing table the break-even keep ratio is `cost` less phase 2's exact part.
    exact = min(sizes["block_m"] + sizes["block_n"], n) * n / (n * (n + 1) / 2)
    cost = pick_cutoff(shares, where, index) + exact
    sdpa = pick_layer(sum(min(x + exact, cost) for x in shares) / len(shares), layer)
    table = forcing_table(cost, head_dim=int(q.shape[-1]), seqlen=n, sdpa=sdpa)
    context = f"{context} cutoff {where} {cost!r}, SDPA {layer} {sdpa!r}"
    marks_ref = delta_kv_dense_heads(q, kept_ref, **sizes, rates=table)
    marks_fast = delta_kv_dense_heads(q, kept_fast.to(kept_ref.device), **sizes, rates=table)
    if marks_ref != marks_fast:
        raise AssertionError(f"{context}: Delta-KV dense heads differ on equal keep masks: reference "
                             f"{list(marks_ref)}, fast {list(marks_fast)}")
    return _check_outputs(spec, q, k, v, params, table, marks_ref, marks_fast, context=context)


def check_delta_xattention_marks(spec: MethodSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 params: dict[str, Any], *, where: str, index: int, layer: str,
                                 context: str = "") -> float:
    """The property for DeltaXAttention: marks from each package's tiles and keep mask agree
    outside the band (tiles may differ at an fp32 tie); each output follows its own marks.

    Returns:
        The largest error / allowance ratio of the fast output.
    """
    from ..methods.delta_xattention import PACK, modes, packing, pick

    b, n = int(q.shape[0]), int(q.shape[2])
    pack = pick(params, PACK)
    tiles = {"block": int(pack.get("block", 128)), "packed_block": 0}
    ref_pack, fast_pack = packing(reference, k, v, params), packing(fast, k, v, params)
    tiles["packed_block"] = ref_pack.packed_block
    modes_ref, modes_fast = modes(reference, q, k, params), modes(fast, q, k, params).to(q.device)
    anchors_ref, anchors_fast = ref_pack.anchors(), fast_pack.anchors().to(q.device)
    exact_r, packed_r = delta_xattention_pairs(modes_ref, anchors_ref, seqlen=n, **tiles)
    exact_f, packed_f = delta_xattention_pairs(modes_fast, anchors_fast, seqlen=n, **tiles)
    shares = ((exact_r + packed_r).sum(dim=0).to(torch.float64) / (b * n * (n + 1) / 2)).tolist()
    cost = pick_cutoff(shares, where, index)
    sdpa = pick_layer(sum(min(x, cost) for x in shares) / len(shares), layer)
    table = forcing_table(cost, head_dim=int(q.shape[-1]), seqlen=n, sdpa=sdpa)
    context = f"{context} cutoff {where} {cost!r}, SDPA {layer} {sdpa!r}"
    marks_ref = delta_xattention_dense_heads(q, modes_ref, anchors_ref, **tiles, rates=table)
    marks_fast = delta_xattention_dense_heads(q, modes_fast, anchors_fast, **tiles, rates=table)
    costs_ref, costs_fast = (packed_head_costs(e, p, seqlen=n, block_m=tiles["block"], head_dim=int(q.shape[-1]),
                                               dtype=q.dtype, rates=table)
                             for e, p in ((exact_r, packed_r), (exact_f, packed_f)))
    check_marks_agree(marks_ref, marks_fast, costs_ref, costs_fast, context=context)
    return _check_outputs(spec, q, k, v, params, table, marks_ref, marks_fast, context=context)


def dense_fallback_property(method_inputs: MethodInputs) -> Callable[[Draw, Caps, MethodSpec | None], float]:
    """The "dense_fallback" property over `method_inputs` (the properties' own draw of one
    method example: inputs, parameters, context, limits), so this module reads nothing of
    `properties`: a method example, a drawn cutoff and SDPA cost, then the check of the
    method's kind (plan-based, Delta-KV, DeltaXAttention)."""

    def prop_dense_fallback(draw: Draw, caps: Caps, spec: MethodSpec | None) -> float:
        if spec is None:
            raise ValueError("this property runs per method; pass a MethodSpec")
        q, k, v, params, context, limits = method_inputs(draw, caps, spec)
        where = str(draw(st.sampled_from(CUTOFFS)))
        index = int(draw(st.integers(min_value=0, max_value=63)))
        layer = str(draw(st.sampled_from(LAYERS)))
        check: Callable[..., float] = check_plan_marks
        if spec.name == "delta_kv":
            check = check_delta_kv_marks
        elif spec.name == "delta_xattention":
            check = check_delta_xattention_marks
        with limits:
            ratio = check(spec, q, k, v, params, where=where, index=index, layer=layer, context=context)
        return ratio if math.isfinite(ratio) else 0.0

    return prop_dense_fallback
