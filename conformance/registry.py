"""What conformance knows about each method, keyed by method name: its Hypothesis
parameter strategy, whether its plans must match bit for bit, its tie rule, its
estimate comparison and, for a method without a plan, its golden output and structure
check.

Every other fact about a method lives in its descriptor (`sparseprefill.methods`).
`METHODS` joins the two: for each registered method a `MethodSpec` that the
properties, the GPU conformance runner and the tests read. A method registered with
no entry here still gets every property: its parameters are drawn from its compare
sweep and defaults, and its plans must match exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .. import reference
from ..methods import Method, MethodView
from ..methods import methods as registered_methods
from ..reference.plan import BlockColumnPlan
from .ties import (
    anchor_attention_tie_check,
    block_sparse_tie_check,
    flexprefill_vs_tie_check,
    dpxa_tie_check,
    sample_attention_tie_check,
    shareprefill_lines_check,
    shareprefill_tie_check,
    vertical_slash_lines_check,
    vertical_slash_tie_check,
    xattention_tie_check,
)
from .tolerance import Estimate

PlanFn = Callable[..., BlockColumnPlan]
ParamsFn = Callable[[Callable[[Any], Any], int], dict[str, Any]]

__all__ = ["CHECKS", "Checks", "METHODS", "MethodSpec", "MethodView", "checks_for", "methods"]


@dataclass(frozen=True)
class Checks:
    """How the conformance properties test one method.

    Attributes:
        params: draws keyword parameters valid for a sequence length `N`, for
            Hypothesis: `(draw, seqlen) -> dict` (`draw` is Hypothesis's). None: one of
            the method's sweep points or its defaults at N.
        exact_plans: True when the fast plan must equal the reference plan bit for bit
            on any input; False when a top-k tie may legitimately decide differently
            (then the property compares plans modulo exactly tied scores).
        tie_check: for `exact_plans=False`: `(q, k, params, reference_plan, fast_plan)
            -> None`, called only when the two plans differ; it raises AssertionError
            unless every difference is decided by an exactly tied score.
        golden: for a method without plans: `(q, k, v, params) -> (golden float64
            output, baseline output)` for the end-to-end property under the tolerance
            policy.
        structure_check: for a method without plans: `(q, k, v, params) -> None`, the
            "plan" property: the fast intermediate structures equal the reference's.
        estimate: `(impl_name, q, k, params) -> {name: Estimate}`, the method's numbers
            before any top-k or threshold, from `fast` or `reference`; the "estimate"
            property compares the two under the tolerance policy, so an estimator bug
            cannot hide behind a tie the plan property forgives. None: no such stage.
        input_kinds: the structured inputs its properties draw (`strategies.INPUT_KINDS`),
            the first one most often.
        plan_check: `(q, k, params, reference_plan) -> None`, a check of the reference plan
            against the method's definition in terms of other methods' plans, run by the
            "plan" property; raises AssertionError.
        min_heads: the fewest query heads its examples draw, past the strategies' cost cap.
        head_local: the estimate of query head `h` depends only on `q[:, h]` and its KV
            head `k[:, h // G]` (every part is `[B, Hq, ...]`): the estimate property
            then also checks the reference's GQA head map on a built four-head, two-KV-head
            input against single-head calls (`properties.check_head_map`), which a
            wrong map (`h % Hkv` for `h // G`) cannot pass, whatever shape was drawn.
        lines_check: `(q, k, params) -> None`, run by the plan property on every example
            (also where the two plans are equal): judges the fast lines a plan is built
            from against their definition, modulo ties (raises AssertionError). At the
            CI's sizes (a few blocks) many line sets give the same block plan, so a line
            bug (a wrong forced count, a line too few, too few estimate rows) often
            leaves the plan unchanged and only the lines show it. Costs one more fast
            line estimate per example.
    """

    params: ParamsFn | None = None
    exact_plans: bool = True
    tie_check: Callable[..., None] | None = None
    golden: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    structure_check: Callable[..., None] | None = None
    estimate: Callable[[str, torch.Tensor, torch.Tensor, dict[str, Any]], dict[str, Estimate]] | None = None
    input_kinds: tuple[str, ...] = ("normal", "lines", "lattice", "runs")
    plan_check: Callable[[torch.Tensor, torch.Tensor, dict[str, Any], BlockColumnPlan], None] | None = None
    min_heads: int = 1
    head_local: bool = False
    lines_check: Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], object] | None = None


@dataclass(frozen=True)
class MethodSpec:
    """A registered method as the properties see it: its descriptor and its `Checks`."""

    method: Method
    checks: Checks

    def __post_init__(self) -> None:
        if not self.method.plan_based and (self.checks.golden is None or self.checks.structure_check is None):
            raise ValueError(f"{self.method.name}: a method without plans needs golden and structure_check "
                             "in conformance.registry.CHECKS")

    # The descriptor's facts.
    @property
    def name(self) -> str:
        return self.method.name

    @property
    def notes(self) -> str:
        return self.method.notes

    @property
    def reference_plan(self) -> PlanFn | None:
        return self.method.reference_plan

    @property
    def fast_plan(self) -> PlanFn | None:
        return self.method.fast_plan

    @property
    def reference_run(self) -> Callable[..., torch.Tensor]:
        return self.method.run_fn("reference")

    @property
    def fast_run(self) -> Callable[..., torch.Tensor]:
        return self.method.run_fn("fast")

    @property
    def new_state(self) -> Callable[[Mapping[str, Any]], Any] | None:
        return self.method.new_state

    @property
    def reference_layer(self) -> Callable[..., torch.Tensor] | None:
        return self.method.reference_layer

    @property
    def fast_layer(self) -> Callable[..., torch.Tensor] | None:
        return self.method.fast_layer

    @property
    def sweep(self) -> Callable[[int], list[dict[str, Any]]] | None:
        return self.method.sweep

    @property
    def chunked(self) -> str:
        return self.method.chunked

    @property
    def plan_based(self) -> bool:
        return self.method.plan_based

    def demo_params(self, seqlen: int) -> dict[str, Any]:
        return self.method.demo_params(seqlen)

    def call_params(self, params: Mapping[str, Any], q: torch.Tensor) -> dict[str, Any]:
        return self.method.call_params(params, q)

    def plan_fn(self, impl_name: str) -> PlanFn:
        return self.method.plan_fn(impl_name)

    def run_fn(self, impl_name: str) -> Callable[..., torch.Tensor]:
        return self.method.run_fn(impl_name)

    def method_view(self, impl_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    params: dict[str, Any], *, scale: float | None = None,
                    with_recall: bool = True) -> MethodView:
        return self.method.method_view(impl_name, q, k, v, params, scale=scale, with_recall=with_recall)

    # The conformance facts.
    @property
    def params(self) -> ParamsFn:
        return self.checks.params or _sweep_params(self.method)

    @property
    def exact_plans(self) -> bool:
        return self.checks.exact_plans

    @property
    def tie_check(self) -> Callable[..., None] | None:
        return self.checks.tie_check

    @property
    def golden(self) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
        return self.checks.golden

    @property
    def structure_check(self) -> Callable[..., None] | None:
        return self.checks.structure_check

    @property
    def estimate(self) -> Callable[[str, torch.Tensor, torch.Tensor, dict[str, Any]], dict[str, Estimate]] | None:
        return self.checks.estimate

    @property
    def input_kinds(self) -> tuple[str, ...]:
        return self.checks.input_kinds

    @property
    def lines_check(self) -> Callable[[torch.Tensor, torch.Tensor, dict[str, Any]], object] | None:
        return self.checks.lines_check

    @property
    def plan_check(self) -> Callable[[torch.Tensor, torch.Tensor, dict[str, Any], BlockColumnPlan], None] | None:
        return self.checks.plan_check

    @property
    def min_heads(self) -> int:
        return self.checks.min_heads

    @property
    def head_local(self) -> bool:
        return self.checks.head_local


def _sweep_params(method: Method) -> ParamsFn:
    """Draw one of the method's sweep points or its defaults at N (a method with no `Checks`)."""
    def draw_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
        from hypothesis import strategies as st

        points = [method.demo_params(seqlen), *method.sweep_params(seqlen)]
        return dict(draw(st.sampled_from(points)))
    return draw_params


# The conformance facts of the shipped methods, by name (filled below).
CHECKS: dict[str, Checks] = {}


def checks_for(name: str) -> Checks:
    """The `Checks` of method `name`: its entry in `CHECKS`, else the defaults."""
    return CHECKS.get(name, Checks())


class _Specs(Mapping[str, MethodSpec]):
    """Every registered method (`sparseprefill.methods`) with its checks, in registration order."""

    def __getitem__(self, name: str) -> MethodSpec:
        method = registered_methods().get(name)
        if method is None:
            raise KeyError(name)
        return MethodSpec(method, checks_for(name))

    def __iter__(self) -> Iterator[str]:
        return iter(list(registered_methods()))

    def __len__(self) -> int:
        return len(registered_methods())


METHODS: Mapping[str, MethodSpec] = _Specs()


def methods() -> Mapping[str, MethodSpec]:
    """The registered methods with their checks, in registration order."""
    return METHODS


def _block_sizes(draw: Callable[[Any], Any]) -> dict[str, int]:
    """Block sizes; block_n 256 is wider than the kernel's key tile (SUB_N > 1)."""
    from hypothesis import strategies as st

    return {
        "block_m": draw(st.sampled_from([16, 32, 64, 128])),
        "block_n": draw(st.sampled_from([16, 32, 64, 128, 256])),
    }


def _dense_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    return _block_sizes(draw)


def _near_multiple(draw: Callable[[Any], Any], size: int, seqlen: int, shifts: list[int]) -> int:
    """`j * size + shift` for a drawn multiple `j <= N / size` and a drawn shift."""
    from hypothesis import strategies as st

    j = draw(st.integers(0, max(0, seqlen // max(size, 1))))
    return int(j * size + draw(st.sampled_from(shifts)))


def _sink_window(draw: Callable[[Any], Any], seqlen: int, block_n: int | None = None,
                 block_m: int | None = None) -> dict[str, int]:
    """`sink` and `window` draws shared by streaming and A-shape (both may exceed N).

    With `block_n`, half the draws aim at block edges: a sink one below, at or above a
    multiple of `block_n`, a window one or two past one (the window's first key block
    then starts exactly at a block edge for query blocks aligned to `block_n`). With
    `block_m` too, one draw in six aims at one query block: its first row `r0` and a
    key block `kb` before it, a window of `r0 + 1 - (kb + 1) * block_n + shift` (shift
    -1, 0, 1) puts the window's edge on `kb`'s last key, with a sink that stops short of
    `kb`, so the edge decides whether `kb` is kept.
    """
    from hypothesis import strategies as st

    if block_n is not None and block_m is not None and draw(st.integers(0, 5)) == 0:
        aligned = [r0 for r0 in range(block_m, seqlen, block_m) if r0 >= block_n]
        if aligned:
            r0 = int(draw(st.sampled_from(aligned)))
            kb = int(draw(st.integers(0, r0 // block_n - 1)))
            window = r0 + 1 - (kb + 1) * block_n + int(draw(st.sampled_from([0, 1, -1])))
            return {"sink": int(draw(st.integers(0, kb * block_n))), "window": max(1, window)}
    if block_n is not None and draw(st.booleans()):
        return {"sink": max(0, _near_multiple(draw, block_n, seqlen, [0, 1, -1])),
                "window": max(1, _near_multiple(draw, block_n, seqlen, [1, 2, 0]))}
    return {"sink": draw(st.integers(0, max(1, seqlen))),
            "window": draw(st.integers(1, max(1, seqlen + 8)))}


def _streaming_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    blocks = _block_sizes(draw)
    return {**blocks, **_sink_window(draw, seqlen, blocks["block_n"], blocks["block_m"])}


CHECKS["dense"] = Checks(
    params=_dense_params,
)

CHECKS["streaming"] = Checks(
    params=_streaming_params,
)


def _scale(draw: Callable[[Any], Any]) -> float | None:
    """A softmax scale for the methods whose plans take one: the default (None) mostly,
    else a small or a large explicit one, so a scale that is not passed on is seen."""
    from hypothesis import strategies as st

    return draw(st.sampled_from([None, None, None, 0.05, 0.4]))  # type: ignore[no-any-return]


def _minference_blocks(draw: Callable[[Any], Any]) -> dict[str, int]:
    from hypothesis import strategies as st

    sizes = st.sampled_from([16, 32, 48, 64, 128])
    return {"block_m": draw(sizes), "block_n": draw(sizes)}


def _vertical_slash_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    """Half the draws keep few lines and force none, so the lines the estimate picks
    (the planted ones of `strategies.draw_inputs(kinds=("lines",))`) decide the plan
    and the index meets lines on block edges without the diagonal blocks hiding them."""
    return {**_minference_blocks(draw), **_vertical_slash_lines(draw, seqlen), "scale": _scale(draw)}


def _vertical_slash_lines(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    """The line parameters of vertical-slash (and of MInference's vertical-slash heads)."""
    from hypothesis import strategies as st

    params: dict[str, Any] = {}
    few = bool(draw(st.booleans()))
    top = 6 if few else seqlen + 8
    params["vertical_size"] = draw(st.integers(1, top))
    params["slash_size"] = draw(st.integers(1, min(top, 4) if few else top))
    # last_q > N means every query; 64 is MInference's value. The reference holds the
    # float64 [last_q, N] estimate per head, so "every query" is drawn at N <= 1024 only.
    # 15 .. 65: around the estimate kernels' row tiles (16 to 64 rows).
    everything = [seqlen, seqlen + 7] if seqlen <= 1024 else [1000]
    params["last_q"] = draw(st.sampled_from([1, 16, 64, *everything, 15, 17, 33, 63, 65]))
    params["init_columns"] = draw(st.sampled_from([0, 0] if few else [0, 1, 5, 30]))
    params["local_diagonals"] = draw(st.sampled_from([0, 0, 1] if few else [0, 1, 7, 100]))
    if not few and draw(st.booleans()):
        # Budgets just above the forced lines: which lines are forced decides the rest.
        params["vertical_size"] = params["init_columns"] + draw(st.integers(1, 4))
        params["slash_size"] = params["local_diagonals"] + draw(st.integers(1, 4))
    return params


def _vertical_slash_estimate(impl_name: str, q: torch.Tensor, k: torch.Tensor,
                             params: dict[str, Any]) -> dict[str, Estimate]:
    """Vertical and slash scores (Alg. 2 lines 2-6): sums of at most `last_q` probabilities
    (each of fp32 logits: `_probability_bound`)."""
    from ..fast.vertical_slash import vertical_slash_scores as fast_scores
    from ..reference.vertical_slash import vertical_slash_scores as reference_scores

    scores = fast_scores if impl_name == "fast" else reference_scores
    last_q = int(params.get("last_q", 64))
    vertical, slash = scores(q, k, last_q=last_q, scale=params.get("scale"))
    rows = min(last_q, q.shape[2])
    bound = _probability_bound(q, k, params.get("scale"))
    return {"vertical": Estimate(vertical, terms=rows, bound=bound),
            "slash": Estimate(slash, terms=rows, bound=bound)}


def _block_sparse_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    from hypothesis import strategies as st

    block_size = draw(st.sampled_from([16, 32, 48, 64, 128]))
    return {"block_size": block_size, "top_k": _block_sparse_top_k(draw, seqlen, block_size)}


def _block_sparse_top_k(draw: Callable[[Any], Any], seqlen: int, block_size: int) -> int:
    """top_k at its edges half the time: one block, two, all but one, all, past all."""
    from hypothesis import strategies as st

    blocks = -(-seqlen // block_size)
    edge = [1, 2, max(1, blocks - 1), blocks, blocks + 1]
    return int(draw(st.sampled_from(edge)) if draw(st.booleans()) else draw(st.integers(1, blocks + 2)))


def _block_sparse_estimate(impl_name: str, q: torch.Tensor, k: torch.Tensor,
                           params: dict[str, Any]) -> dict[str, Estimate]:
    """Mean-pooled queries and keys (Alg. 3 lines 2-3): means of `block_size` values."""
    from ..fast.block_sparse import mean_pooling as fast_pooling
    from ..reference.block_sparse import mean_pooling as reference_pooling

    pooling = fast_pooling if impl_name == "fast" else reference_pooling
    bs = int(params.get("block_size", 64))
    terms = min(bs, q.shape[2])
    return {"q_pooled": Estimate(pooling(q, bs), terms=terms, bound=_max_abs(q)),
            "k_pooled": Estimate(pooling(k, bs), terms=terms, bound=_max_abs(k))}


def _max_abs(x: torch.Tensor) -> float:
    finite = x[torch.isfinite(x)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def _a_shape_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    blocks = _minference_blocks(draw)
    return {**blocks, **_sink_window(draw, seqlen, blocks["block_n"], blocks["block_m"])}


CHECKS["vertical_slash"] = Checks(
    params=_vertical_slash_params,
    exact_plans=False,
    tie_check=vertical_slash_tie_check,
    estimate=_vertical_slash_estimate,
    input_kinds=("lines", "normal", "lattice"),
    lines_check=vertical_slash_lines_check,
)

CHECKS["block_sparse"] = Checks(
    params=_block_sparse_params,
    exact_plans=False,
    tie_check=block_sparse_tie_check,
    estimate=_block_sparse_estimate,
    input_kinds=("normal", "lattice", "runs", "lines"),
)

CHECKS["a_shape"] = Checks(
    params=_a_shape_params,
)


def _anchor_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    from hypothesis import strategies as st

    params: dict[str, Any] = _minference_blocks(draw)
    blocks = -(-seqlen // params["block_m"])
    # theta: 0 (only keys at least as strong as the pooled anchor), typical, and so
    # large that every search key is kept; step: one block, a few, more than exist.
    params["theta"] = draw(st.sampled_from([0.0, 1.0, 4.0, 12.0, 1e9]))
    params["step"] = draw(st.sampled_from([1, 1, 2, 3, 16, blocks, blocks + 1]))
    params["scale"] = _scale(draw)
    return params


def _anchor_estimate(impl_name: str, q: torch.Tensor, k: torch.Tensor,
                     params: dict[str, Any]) -> dict[str, Estimate]:
    """The anchors `x_a` (Equation 1, row maxima of D-term dot products), their block means
    and the pooled queries (Alg. 2 lines 1-2): the numbers compared with theta."""
    from ..fast.anchor_attention import anchor_maxima
    from ..fast.kernels.anchor_stripes import pooled_anchor as fast_pooled_anchor
    from ..fast.kernels.anchor_stripes import pooled_queries
    from ..reference._checks import resolve_scale
    from ..reference.anchor_attention import anchor_blocks, anchor_scores, pooled_anchor
    from ..reference.block_sparse import mean_pooling

    step, bm, bn = int(params.get("step", 16)), int(params.get("block_m", 128)), int(params.get("block_n", 128))
    scale = resolve_scale(params.get("scale"), q.shape[-1])
    if impl_name == "fast":
        x_a = anchor_maxima(q, k, step=step, block_m=bm, block_n=bn, scale=scale)
        a_mean = fast_pooled_anchor(x_a, bm)
        hi, lo = pooled_queries(q, bm, k.dtype)
        q_mean = hi.to(torch.float32) + lo.to(torch.float32)
    else:
        blocks = anchor_blocks(q.shape[2], step=step, block_m=bm, block_n=bn, device=q.device)
        x_a = anchor_scores(q, k, blocks, block_n=bn, block_m=bm, scale=scale)
        a_mean = pooled_anchor(x_a, bm)
        q_mean = mean_pooling(q, bm)
    d = q.shape[-1]
    logit = scale * _max_abs(q) * _max_abs(k)  # largest |scale q_d k_d|
    rows = min(bm, q.shape[2])
    return {"anchor": Estimate(x_a, terms=d, bound=logit),
            "anchor_mean": Estimate(a_mean, terms=d + rows, bound=max(logit, _max_abs(x_a))),
            "q_mean": Estimate(q_mean, terms=rows, bound=_max_abs(q))}


CHECKS["anchor_attention"] = Checks(
    params=_anchor_params,
    exact_plans=False,
    tie_check=anchor_attention_tie_check,
    estimate=_anchor_estimate,
    input_kinds=("normal", "lattice", "lines"),
)


def _delta_kv_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    from hypothesis import strategies as st

    metric = draw(st.sampled_from(["euclidean", "cosine"]))
    if metric == "euclidean":
        # 0 drops only identical neighbours; 1e3 leaves one anchor per chunk; 0.5, 1 and 2
        # are distances the "runs" inputs hit exactly.
        # The distances of the "runs" inputs (0.5, 1, 2) most often: a key exactly at
        # the threshold must be dropped (<=), which only such a draw shows.
        threshold = draw(st.sampled_from([0.0, 2.0, 0.5, 1.0, 4.0, 6.0, 1e3, 0.5, 1.0, 2.0, 0.5, 1.0, 2.0]))
    else:
        # 0.5: the "runs" inputs' cosine-1/2 twins sit exactly on it; 0: orthogonal keys.
        threshold = draw(st.sampled_from([-1.0, 0.0, 0.5, 0.8, 0.95, 1.0]))
    return {
        "threshold": threshold, "metric": metric,
        "chunk": draw(st.sampled_from([1, 7, 16, 64, 512, 15, 17, 63, 65])),
        "block_m": draw(st.sampled_from([16, 32, 64])),
        "block_n": draw(st.sampled_from([16, 32, 64])),
        "count_weighted": draw(st.sampled_from([True, True, False])),
        "exact_diagonal": draw(st.sampled_from([True, True, False])),
    }


def _register_delta_kv() -> None:
    from .delta import delta_golden, delta_structure_check

    CHECKS["delta_kv"] = Checks(
        params=_delta_kv_params,
        golden=delta_golden,
        structure_check=delta_structure_check,
        input_kinds=("runs", "normal", "lattice"),
    )


_register_delta_kv()


def _tile_threshold(draw: Callable[[Any], Any]) -> float:
    """XAttention / DPXA threshold in (0, 1]: the extremes, the papers' values, or any."""
    from hypothesis import strategies as st

    return float(draw(st.one_of(
        st.sampled_from([1.0, 0.9, 0.95, 0.8, 1e-6]),
        st.floats(min_value=0.0, max_value=1.0, exclude_min=True, allow_nan=False),
    )))


def _tile_block(draw: Callable[[Any], Any]) -> int:
    from hypothesis import strategies as st

    return int(draw(st.sampled_from([16, 32, 48, 64, 80, 96, 112, 128])))


def _xattention_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    from hypothesis import strategies as st

    # 3 exercises groups that straddle no tile but end short (the naive ablation's stride).
    return {"stride": int(draw(st.sampled_from([1, 2, 4, 8, 16, 3]))),
            "threshold": _tile_threshold(draw), "block": _tile_block(draw),
            "scoring": str(draw(st.sampled_from(["antidiagonal", "antidiagonal", "naive"])))}


def _dpxa_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    from hypothesis import strategies as st

    cos = draw(st.one_of(st.sampled_from([0.75, 0.78, -1.0, 1.0, 0.0]),
                         st.floats(min_value=-1.0, max_value=1.0, allow_nan=False)))
    return {"cos_threshold": float(cos), "threshold": _tile_threshold(draw), "block": _tile_block(draw)}


def _probability_bound(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> float:
    """The `bound` of an estimate made of softmax probabilities of fp32 logits.

    A probability `exp(s - m)` computed from fp32 logits errs by about `2**-24 |s - m|`
    relative, so past logits of `2**8` the per-summand allowance (`ESTIMATE_REL = 2**-16`)
    grows with the largest possible logit, `scale * max|q| * max|k| * D`.
    """
    from ..reference._checks import resolve_scale

    d = q.shape[-1]
    logit = resolve_scale(scale, d) * _max_abs(q) * _max_abs(k) * d
    return max(1.0, logit * 2.0**-8)


def _xattention_estimate(impl_name: str, q: torch.Tensor, k: torch.Tensor,
                         params: dict[str, Any]) -> dict[str, Estimate]:
    """XAttention tile weights (section 2.5), before the greedy threshold: each row of
    tiles a distribution (sums of stride-level probabilities over its query groups), of
    the antidiagonal scoring and of the naive ablation (section 4.3) both."""
    from ..fast.xattention import xattention_tile_weights as fast_weights
    from ..reference.xattention import xattention_tile_weights as reference_weights

    weights = fast_weights if impl_name == "fast" else reference_weights
    block = int(params.get("block", 128))
    bound = _probability_bound(q, k, params.get("scale"))
    # Both scorings on every example (the naive ablation is drawn a third of the time).
    return {scoring: Estimate(weights(q, k, stride=int(params.get("stride", 8)), block=block, scoring=scoring,
                                      scale=params.get("scale")), terms=1, bound=bound)
            for scoring in ("antidiagonal", "naive")}


def _dpxa_estimate(impl_name: str, q: torch.Tensor, k: torch.Tensor,
                   params: dict[str, Any]) -> dict[str, Estimate]:
    """DPXA tile weights (section 4.3), before the greedy threshold: anchor-pair masses
    per tile, each row of tiles normalised to 1."""
    from ..fast.dpxa import dpxa_tile_weights as fast_weights
    from ..reference.dpxa import dpxa_tile_weights as reference_weights

    weights = fast_weights if impl_name == "fast" else reference_weights
    block = int(params.get("block", 128))
    w = weights(q, k, cos_threshold=float(params.get("cos_threshold", 0.75)), block=block,
                scale=params.get("scale"))
    return {"tile_weights": Estimate(w, terms=1, bound=_probability_bound(q, k, params.get("scale")))}


CHECKS["xattention"] = Checks(
    params=_xattention_params,
    exact_plans=False,
    tie_check=xattention_tie_check,
    estimate=_xattention_estimate,
    head_local=True,
)

CHECKS["dpxa"] = Checks(
    params=_dpxa_params,
    exact_plans=False,
    tie_check=dpxa_tie_check,
    estimate=_dpxa_estimate,
    head_local=True,
)
def _delta_xattention_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    from hypothesis import strategies as st

    block = int(draw(st.sampled_from([16, 32, 48, 64, 96, 128])))
    metric = draw(st.sampled_from(["euclidean", "cosine"]))
    if metric == "euclidean":
        # 0 drops only identical neighbours; 1e3 leaves one anchor per tile.
        delta = draw(st.sampled_from([0.0, 4.0, 6.0, 1e3]))
    else:
        delta = draw(st.sampled_from([-1.0, 0.0, 0.5, 0.9, 1.0]))
    return {
        "stride": int(draw(st.sampled_from([1, 2, 4, 8, 16, 3]))),
        "threshold": _tile_threshold(draw),
        "exact_top": float(draw(st.one_of(st.sampled_from([0.0, 0.1, 1.0]), st.floats(0.0, 1.0)))),
        "delta_threshold": delta, "metric": metric, "block": block,
        "packed_block": int(draw(st.sampled_from([p for p in (16, 32, 48, 64, 96, 128) if block % p == 0]))),
        "unselected": draw(st.sampled_from(["skip", "skip", "packed"])),
        "count_weighted": draw(st.sampled_from([True, True, False])),
    }


def _register_delta_xattention() -> None:
    from .delta_xattention import delta_xattention_golden, delta_xattention_structure_check

    CHECKS["delta_xattention"] = Checks(
        params=_delta_xattention_params,
        golden=delta_xattention_golden,
        structure_check=delta_xattention_structure_check,
    )


_register_delta_xattention()


def _sample_attention_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    from hypothesis import strategies as st

    alpha = st.one_of(st.sampled_from([0.0, 0.5, 0.9, 0.95, 1.0]), st.floats(0.0, 1.0))
    return {
        "alpha_c": draw(alpha),
        "alpha_s": draw(alpha),
        # seqlen + 5 chunks: more chunks than rows; ceil(N / 16) chunks: none longer than the
        # smallest block. Either way every row is sampled, whatever the block size (the sampled
        # rows then stay the same when only the block size changes).
        "chunk_n": draw(st.sampled_from([1, 2, 3, 4, 7, seqlen + 5, seqlen + 5, -(-seqlen // 16)])),
        "block_size": draw(st.sampled_from([16, 32, 48, 64, 128])),
        "scale": _scale(draw),
    }


def _sample_attention_estimate(impl_name: str, q: torch.Tensor, k: torch.Tensor,
                               params: dict[str, Any]) -> dict[str, Estimate]:
    """Column and slash block scores of the sampled rows (Alg. 1 lines 1-4): sums of
    probabilities, at most one per sampled row."""
    from ..fast.sample_attention import sample_attention_scores as fast_scores
    from ..reference.sample_attention import resolve_params, sampled_rows
    from ..reference.sample_attention import sample_attention_scores as reference_scores

    n, bs = q.shape[2], int(params.get("block_size", 128))
    _, _, chunk_n = resolve_params(n, alpha_c=params.get("alpha_c"), alpha_s=params.get("alpha_s"),
                                   chunk_n=params.get("chunk_n"), block_size=bs,
                                   settings=params.get("settings"))
    scores = fast_scores if impl_name == "fast" else reference_scores
    column, slash = scores(q, k, chunk_n=chunk_n, block_size=bs, scale=params.get("scale"))
    rows = sum(stop - start for start, stop in sampled_rows(n, chunk_n, bs))
    bound = _probability_bound(q, k, params.get("scale"))
    return {"column": Estimate(column, terms=rows, bound=bound),
            "slash": Estimate(slash, terms=rows, bound=bound)}


CHECKS["sample_attention"] = Checks(
    params=_sample_attention_params,
    exact_plans=False,
    tie_check=sample_attention_tie_check,
    estimate=_sample_attention_estimate,
    input_kinds=("normal", "lattice", "lines"),
)


def _minference_patterns(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    """1-3 head patterns with one pair of block sizes (Hypothesis); `prepare` assigns them
    to the query heads in turn."""
    from hypothesis import strategies as st

    from ..reference.minference import HeadPattern

    bm = draw(st.sampled_from([16, 32, 64]))
    bn = draw(st.sampled_from([16, 32, 64]))
    kinds = ["a_shape", "vertical_slash"] + (["block_sparse"] if bm == bn else [])
    patterns = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(kinds))
        if kind == "a_shape":
            params = {**_sink_window(draw, seqlen, bn, bm), "block_m": bm, "block_n": bn}
        elif kind == "vertical_slash":
            params = {**_vertical_slash_lines(draw, seqlen), "block_m": bm, "block_n": bn}
        else:
            params = {"top_k": _block_sparse_top_k(draw, seqlen, bm), "block_size": bm}
        patterns.append(HeadPattern(kind, params))
    # block_m / block_n are hints for the strategies' cost cap; `prepare` drops them.
    return {"patterns": tuple(patterns), "block_m": bm, "block_n": bn, "scale": _scale(draw)}


def _minference_plan_check(q: torch.Tensor, k: torch.Tensor, params: dict[str, Any],
                           plan: BlockColumnPlan) -> None:
    """Head `h` of the merged plan keeps exactly what its pattern's own plan of head `h`
    alone keeps (`reference.<pattern>_plan` on `q[:, h]` and its KV head), so a bug in
    the dispatch or the merge, which both packages share, still fails."""
    heads = params["config"].layer(int(params.get("layer", 0)))
    plans: dict[str, PlanFn] = {"a_shape": reference.a_shape_plan, "vertical_slash": reference.vertical_slash_plan,
             "block_sparse": reference.block_sparse_plan}
    group = q.shape[1] // k.shape[1]
    merged = plan.to_dense_mask()
    for h, head in enumerate(heads):
        kwargs: dict[str, Any] = dict(head.params)
        if head.pattern == "vertical_slash":
            kwargs["scale"] = params.get("scale")
        own = plans[head.pattern](q[:, h:h + 1], k[:, h // group:h // group + 1], **kwargs)
        mask = own.to_dense_mask()[:, 0]
        if not torch.equal(mask, merged[:, h]):
            at = tuple(int(i) for i in (mask != merged[:, h]).nonzero()[0].tolist())
            raise AssertionError(f"head {h} ({head.pattern} {head.params}) of the merged plan differs "
                                 f"from its pattern's own plan at (b, row, key) {at}: merged "
                                 f"{bool(merged[at[0], h, at[1], at[2]])}, own {bool(mask[at])}")


def _minference_estimate(impl_name: str, q: torch.Tensor, k: torch.Tensor,
                         params: dict[str, Any]) -> dict[str, Estimate]:
    """The estimates of every distinct vertical-slash and block-sparse pattern of the
    layer, as MInference's dispatch runs them (on all heads), named `<pattern #>.<part>`."""
    heads = params["config"].layer(int(params.get("layer", 0)))
    out: dict[str, Estimate] = {}
    seen: dict[Any, int] = {}
    for head in heads:
        if head.key() in seen or head.pattern not in ("vertical_slash", "block_sparse"):
            continue
        seen[head.key()] = len(seen)
        pattern_params = {**head.params, "scale": params.get("scale")}
        estimate = _vertical_slash_estimate if head.pattern == "vertical_slash" else _block_sparse_estimate
        part = estimate(impl_name, q, k, pattern_params)
        out.update({f"{seen[head.key()]}.{head.pattern}.{name}": est for name, est in part.items()})
    return out


def _register_minference() -> None:
    from .ties import minference_tie_check

    CHECKS["minference"] = Checks(
        params=_minference_patterns,
        exact_plans=False,
        tie_check=minference_tie_check,
        estimate=_minference_estimate,
        plan_check=_minference_plan_check,
        min_heads=2,
        input_kinds=("lines", "normal", "lattice"),
    )


_register_minference()


def _flexprefill_vs_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    from hypothesis import strategies as st

    params: dict[str, Any] = _minference_blocks(draw)
    # Low gammas half the time: the forced lines then decide most of the plan.
    params["gamma"] = draw(st.sampled_from([0.9, 0.0, 0.5, 0.95, 1.0, 0.99, 0.0, 0.2, 0.3, 0.0]))
    everything = [seqlen, seqlen + 7] if seqlen <= 1024 else [1000]
    params["last_q"] = draw(st.sampled_from([1, 16, 64, *everything]))
    # Mostly different forced counts, so a count applied to the wrong kind of line shows.
    params["init_columns"], params["local_diagonals"] = draw(st.sampled_from(
        [(1, 1), (5, 1), (1, 7), (5, 0), (0, 7), (5, 7), (0, 0)]))
    params["scale"] = _scale(draw)
    # Bands of lines: single lines (Alg. 5), whole key blocks (a pure-block plan), and
    # widths that are not multiples of block_n (lines kept as columns).
    params["line_block"] = draw(st.sampled_from([1, params["block_n"], 2 * params["block_n"], 16, 100]))
    return params


def _flexprefill_vs_estimate(impl_name: str, q: torch.Tensor, k: torch.Tensor,
                             params: dict[str, Any]) -> dict[str, Estimate]:
    """Alg. 5 lines 1-3: the vertical and slash shares `a_v`, `a_s` of the last queries'
    attention (each sums to 1 per head), before the cumulative threshold."""
    from ..fast.kernels.last_q_estimate import last_q_scores
    from ..reference._checks import resolve_scale
    from ..reference.flexprefill_vs import normalized_lines
    from ..reference.vertical_slash import approximate_attention

    n = q.shape[2]
    last_q = min(int(params.get("last_q", 64)), n)
    if impl_name == "fast":
        vertical, slash = last_q_scores(q, k, last_q=last_q, scale=params.get("scale"))
        total = vertical.to(torch.float64).sum(dim=-1, keepdim=True)
        a_v, a_s = vertical.to(torch.float64) / total, slash.to(torch.float64) / total
    else:
        a_hat = approximate_attention(q, k, last_q=last_q, scale=resolve_scale(params.get("scale"), q.shape[-1]))
        a_v, a_s = normalized_lines(a_hat)
    bound = _probability_bound(q, k, params.get("scale"))
    return {"vertical": Estimate(a_v, terms=1, bound=bound), "slash": Estimate(a_s, terms=1, bound=bound)}


CHECKS["flexprefill_vs"] = Checks(
    params=_flexprefill_vs_params,
    exact_plans=False,
    tie_check=flexprefill_vs_tie_check,
    estimate=_flexprefill_vs_estimate,
    head_local=True,
)


# Query heads of the drawn layouts: at least the most any conformance shape has.
_LAYOUT_HEADS = 64


def _shareprefill_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    from hypothesis import strategies as st

    params: dict[str, Any] = _block_sizes(draw)
    kind = draw(st.sampled_from(["one", "groups", "noise", "none"]))
    if kind != "none":
        seed = draw(st.integers(0, 2**31 - 1))
        gen = torch.Generator().manual_seed(seed)
        ids = {"one": 1, "groups": 3, "noise": 2}[kind]
        row = (torch.randint(0, ids, (_LAYOUT_HEADS,), generator=gen) - int(kind == "noise")).tolist()
        params["layout"] = reference.ClusterLayout((tuple(int(c) for c in row),))
    params["tau"] = draw(st.sampled_from([0.2, 0.0, 0.5, 1.01]))
    params["delta"] = draw(st.sampled_from([0.3, 1.01, 0.0, 0.6, 2.0]))
    params["gamma"] = draw(st.sampled_from([0.9, 0.0, 0.5, 1.0]))
    params["init_columns"] = draw(st.sampled_from([1, 0, 5]))
    params["local_diagonals"] = draw(st.sampled_from([1, 0, 7]))
    return params


def _shareprefill_estimate(impl_name: str, q: torch.Tensor, k: torch.Tensor,
                           params: dict[str, Any]) -> dict[str, Estimate]:
    """Alg. 3 lines 2-3: `a^`, the softmax over key blocks of the last query block's
    pooled logits (what the JS distances and the pattern choice read)."""
    from ..fast.shareprefill import last_block_attention as fast_a_hat
    from ..reference._checks import resolve_scale
    from ..reference.shareprefill import last_block_attention as reference_a_hat

    a_hat = fast_a_hat if impl_name == "fast" else reference_a_hat
    bm, bn = int(params.get("block_m", 64)), int(params.get("block_n", 64))
    scale = resolve_scale(params.get("scale"), q.shape[-1])
    values = a_hat(q, k, block_m=bm, block_n=bn, scale=scale)
    return {"a_hat": Estimate(values, terms=1, bound=_probability_bound(q, k, scale))}


CHECKS["shareprefill"] = Checks(
    params=_shareprefill_params,
    exact_plans=False,
    tie_check=shareprefill_tie_check,
    estimate=_shareprefill_estimate,
    head_local=True,
    lines_check=shareprefill_lines_check,
)


def _headwise_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    """Per-head choices of the methods whose plans are exact in both packages (streaming, A-shape,
    dense, each with its own drawn block sizes) and dense heads: what `headwise` adds to its methods
    (grouping, the merge at the finest unit, dense marks) is checked exactly; the adaptive
    methods' own agreement is their own properties'."""
    from hypothesis import strategies as st

    heads: list[dict[str, Any] | None] = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["streaming", "a_shape", "dense", "streaming", None]))
        if kind is None:
            heads.append(None)
        elif kind == "dense":
            heads.append({"method": kind, **_block_sizes(draw)})
        else:
            heads.append({"method": kind, **_streaming_params(draw, seqlen)})
    return {"heads": heads}


CHECKS["headwise"] = Checks(
    params=_headwise_params,
)
