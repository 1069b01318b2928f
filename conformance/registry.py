"""The registry of shipped methods: one entry per method, read by the conformance
properties, the GPU conformance runner, the demo and the benchmarks.

Adding a method to every one of those is one `register(MethodSpec(...))` call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import fast, reference
from ..reference.plan import BlockColumnPlan
from .ties import (
    anchor_attention_tie_check,
    block_sparse_tie_check,
    flexprefill_vs_tie_check,
    dpxa_tie_check,
    sample_attention_tie_check,
    shareprefill_tie_check,
    vertical_slash_tie_check,
    xattention_tie_check,
)
from .tolerance import Estimate

PlanFn = Callable[..., BlockColumnPlan]
RunFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class MethodView:
    """What the demo, the eval table and the benchmarks report about one method call.

    Attributes:
        density: float64 `[B, Hq]`, score entries computed over the causal area.
        recall: float32 `[B, Hq, N]`, the attention mass kept per row, or None where
            recall does not apply (a method that changes the keys, as Delta-KV).
        plan: the plan to draw (the keys computed exactly), or None.
        notes: a short extra (e.g. a keep ratio).
    """

    density: torch.Tensor
    recall: torch.Tensor | None
    plan: BlockColumnPlan | None
    notes: str = ""


@dataclass(frozen=True)
class MethodSpec:
    """How to call one method in both packages, and with which parameters.

    Attributes:
        name: the method's public name (`fast.<name>`, `reference.<name>`).
        reference_plan, fast_plan: the estimators `(q, k, **params) -> BlockColumnPlan`.
        reference_run, fast_run: the end-to-end functions `(q, k, v, **params, scale=)`.
        params: draws keyword parameters valid for a sequence length `N`, for
            Hypothesis: a callable `(draw, seqlen) -> dict` (`draw` is Hypothesis's).
        demo_params: parameters for the demo and benchmarks, given `N`.
        exact_plans: True when the fast plan must equal the reference plan bit for bit
            on any input; False when a top-k tie may legitimately decide differently
            (then the property compares plans modulo exactly tied scores).
        tie_check: for `exact_plans=False`: `(q, k, params, reference_plan, fast_plan)
            -> None`, called only when the two plans differ; it raises AssertionError
            unless every difference is decided by an exactly tied score.
        new_state, reference_layer, fast_layer: for methods that carry state across the
            layers of one forward pass (SharePrefill). `new_state(params)` makes the
            state of one prefill from the method's parameters; `*_layer(q, k, v, state,
            *, layer, scale) -> out` runs one layer with it (plan, attention, update).
            The transformers integration uses them instead of `*_plan` when set; the
            plan functions stay the one-layer, fresh-state view used everywhere else.

    A method whose output is not the attention of one plan (Delta-KV reads packed
    keys) has `reference_plan = fast_plan = None` and instead:

        golden: `(q, k, v, params) -> (golden float64 output, baseline output)` for
            the end-to-end property under the tolerance policy.
        structure_check: `(q, k, v, params) -> None`, the "plan" property: the fast
            intermediate structures equal the reference's; raises AssertionError.
        view: `(impl_name, q, k, v, params) -> MethodView` for reports.

    sweep: `N -> [params, ...]`, the grid of the method's main knob that `sparseprefill
        compare` measures (docs/compare.md lists them); None: only `demo_params(N)`.
    estimate: `(impl_name, q, k, params) -> {name: Estimate}`, the method's numbers
        before any top-k or threshold (scores, pooled means), from `fast` or
        `reference`; the "estimate" property compares the two under the tolerance
        policy (`tolerance.check_estimate`), so an estimator bug cannot hide behind a
        tie the plan property forgives. None: the method has no such stage.
    input_kinds: the structured inputs its properties draw (`strategies.INPUT_KINDS`),
        the first one most often.
    plan_check: `(q, k, params, reference_plan) -> None`, a check of the reference plan
        against the method's definition in terms of other methods' plans (MInference:
        query head `h` is planned by its own pattern alone), run by the "plan" property
        so that code both packages share is checked too; raises AssertionError.
    min_heads: the fewest query heads its examples draw, past the strategies' cost cap
        (MInference: 2, so that two heads can take two patterns and be merged).
    prepare: `(params, q) -> call parameters` for a method whose parameters depend on
        the input's shape (MInference's per-head config needs Hq): drawn, demo and sweep
        parameters go through `call_params` before every call. None: unchanged.
    chunked: for chunked prefill (`chunk_plan`, queries `[P, P + N)` over keys
        `[0, P + N)`): what the estimate of a chunk reads, one line (docs/serving.md
        lists them). Non-empty promises the plan's rows `[P, P + N)` read no query
        before P, so the chunk's plan equals the one-shot plan of the prompt up to the
        chunk's end restricted to those rows (`tests/test_chunked.py` checks it). "":
        the method needs the whole prompt (its estimate reads queries across it, or it
        has no plan); `chunk_plan` is not offered for it.
    """

    name: str
    reference_plan: PlanFn | None
    fast_plan: PlanFn | None
    reference_run: RunFn
    fast_run: RunFn
    params: Callable[[Callable[[Any], Any], int], dict[str, Any]]
    demo_params: Callable[[int], dict[str, Any]]
    exact_plans: bool = True
    notes: str = field(default="")
    tie_check: Callable[..., None] | None = None
    new_state: Callable[[Mapping[str, Any]], Any] | None = None
    reference_layer: Callable[..., torch.Tensor] | None = None
    fast_layer: Callable[..., torch.Tensor] | None = None
    golden: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    structure_check: Callable[..., None] | None = None
    view: Callable[..., MethodView] | None = None
    sweep: Callable[[int], list[dict[str, Any]]] | None = None
    estimate: Callable[[str, torch.Tensor, torch.Tensor, dict[str, Any]], dict[str, Estimate]] | None = None
    input_kinds: tuple[str, ...] = ("normal", "lines", "lattice", "runs")
    plan_check: Callable[[torch.Tensor, torch.Tensor, dict[str, Any], BlockColumnPlan], None] | None = None
    min_heads: int = 1
    prepare: Callable[[dict[str, Any], torch.Tensor], dict[str, Any]] | None = None
    chunked: str = ""

    def __post_init__(self) -> None:
        if (self.reference_plan is None) != (self.fast_plan is None):
            raise ValueError(f"{self.name}: give both plan functions or neither")
        if self.reference_plan is None and (self.golden is None or self.structure_check is None
                                            or self.view is None):
            raise ValueError(f"{self.name}: a method without plans needs golden, structure_check and view")
        if self.chunked and self.reference_plan is None:
            raise ValueError(f"{self.name}: chunked prefill needs plan functions")

    def call_params(self, params: Mapping[str, Any], q: torch.Tensor) -> dict[str, Any]:
        """The keyword arguments of a call on `q` (`prepare` applied, if any)."""
        return dict(params) if self.prepare is None else self.prepare(dict(params), q)

    @property
    def plan_based(self) -> bool:
        """True when the output is `sparse_attention` of the method's plan."""
        return self.reference_plan is not None

    def plan_fn(self, impl_name: str) -> PlanFn:
        """The `fast` or `reference` estimator (plan-based methods only)."""
        fn = self.fast_plan if impl_name == "fast" else self.reference_plan
        if fn is None:
            raise ValueError(f"method {self.name!r} does not produce a plan")
        return fn

    def run_fn(self, impl_name: str) -> RunFn:
        """The `fast` or `reference` end-to-end function."""
        return self.fast_run if impl_name == "fast" else self.reference_run

    def method_view(self, impl_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    params: dict[str, Any], *, scale: float | None = None,
                    with_recall: bool = True) -> MethodView:
        """Density, recall and a plan to draw for one call (see `MethodView`)."""
        if self.view is not None:
            return self.view(impl_name, q, k, v, params)
        impl = fast if impl_name == "fast" else reference
        plan = self.plan_fn(impl_name)(q, k, **params)
        recall = impl.recall(q, k, plan, scale=scale) if with_recall else None
        return MethodView(density=impl.density(plan), recall=recall, plan=plan)


METHODS: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    """Add `spec` to `METHODS`; names are unique."""
    if spec.name in METHODS:
        raise ValueError(f"method {spec.name!r} is already registered")
    METHODS[spec.name] = spec
    return spec


def methods() -> Mapping[str, MethodSpec]:
    """The registered methods, in registration order."""
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


register(MethodSpec(
    name="dense",
    chunked="nothing: every causal key",
    reference_plan=reference.dense_plan,
    fast_plan=fast.dense_plan,
    reference_run=reference.dense,
    fast_run=fast.dense,
    params=_dense_params,
    demo_params=lambda n: {},
    notes="full causal attention (baseline)",
    sweep=lambda n: [{}],
))

register(MethodSpec(
    name="streaming",
    chunked="nothing: the sink and window are positions (the window ends at each row's own position)",
    reference_plan=reference.streaming_plan,
    fast_plan=fast.streaming_plan,
    reference_run=reference.streaming,
    fast_run=fast.streaming,
    params=_streaming_params,
    demo_params=lambda n: {"sink": min(1024, max(64, n // 32)), "window": max(128, n // 8)},
    notes="StreamingLLM / A-shape: sink + local window (baseline)",
    sweep=lambda n: [{"sink": min(1024, max(64, n // 32)), "window": max(128, n // f)} for f in (32, 16, 8, 4, 2)],
))


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
    """Vertical and slash scores (Alg. 2 lines 2-6): sums of at most `last_q` probabilities."""
    from ..fast.vertical_slash import vertical_slash_scores as fast_scores
    from ..reference.vertical_slash import vertical_slash_scores as reference_scores

    scores = fast_scores if impl_name == "fast" else reference_scores
    last_q = int(params.get("last_q", 64))
    vertical, slash = scores(q, k, last_q=last_q, scale=params.get("scale"))
    rows = min(last_q, q.shape[2])
    return {"vertical": Estimate(vertical, terms=rows, bound=1.0),
            "slash": Estimate(slash, terms=rows, bound=1.0)}


def _vertical_slash_demo(n: int) -> dict[str, Any]:
    # MInference's LLaMA-3 setting from 32K on; scaled down below so it stays sparse.
    if n >= 32768:
        return {"vertical_size": 1000, "slash_size": 6096}
    return {"vertical_size": max(30, n // 32), "slash_size": max(100, n // 8)}


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


register(MethodSpec(
    name="vertical_slash",
    chunked="the chunk's last `last_q` queries (capped at the chunk's length) against every key of the "
            "prefix and the chunk",
    reference_plan=reference.vertical_slash_plan,
    fast_plan=fast.vertical_slash_plan,
    reference_run=reference.vertical_slash,
    fast_run=fast.vertical_slash,
    params=_vertical_slash_params,
    demo_params=_vertical_slash_demo,
    exact_plans=False,
    tie_check=vertical_slash_tie_check,
    estimate=_vertical_slash_estimate,
    input_kinds=("lines", "normal", "lattice"),
    notes="MInference vertical-slash: last_q estimate, top-k columns and diagonals, Alg. 4 index",
    sweep=lambda n: [{"vertical_size": max(30, n // f), "slash_size": max(64, 2 * n // f)}
                     for f in (256, 128, 64, 32, 16, 8)],
))

register(MethodSpec(
    name="block_sparse",
    chunked="each query block's pooled queries against the pooled keys: the chunk's own blocks",
    reference_plan=reference.block_sparse_plan,
    fast_plan=fast.block_sparse_plan,
    reference_run=reference.block_sparse,
    fast_run=fast.block_sparse,
    params=_block_sparse_params,
    demo_params=lambda n: {"top_k": 100 if n >= 32768 else max(2, n // 512)},
    exact_plans=False,
    tie_check=block_sparse_tie_check,
    estimate=_block_sparse_estimate,
    input_kinds=("normal", "lattice", "runs", "lines"),
    notes="MInference block-sparse: mean-pooled block scores, top-k key blocks per query block",
    sweep=lambda n: [{"top_k": max(2, -(-n // 64) // f)} for f in (32, 16, 8, 4, 2)],
))

register(MethodSpec(
    name="a_shape",
    chunked="nothing: as streaming, at block granularity",
    reference_plan=reference.a_shape_plan,
    fast_plan=fast.a_shape_plan,
    reference_run=reference.a_shape,
    fast_run=fast.a_shape,
    params=_a_shape_params,
    demo_params=lambda n: {"sink": min(1024, max(64, n // 32)), "window": min(4096, max(128, n // 8))},
    notes="MInference A-shape: streaming with 1024 sink and 4096 window tokens, 64 x 64 blocks",
    sweep=lambda n: [{"sink": min(1024, max(64, n // 32)), "window": max(128, n // f)} for f in (32, 16, 8, 4)],
))


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


def _anchor_demo(n: int) -> dict[str, Any]:
    # The paper's theta and blocks; step 16 from 16K on, smaller below so that a
    # prompt has at least 8 groups (one group is all window, hence dense).
    return {"step": max(1, min(16, -(-n // 128) // 8))}


register(MethodSpec(
    name="anchor_attention",
    chunked="each query block's anchor and its group's stripes: the chunk's own rows (chunks start on a "
            "group of `step` query blocks)",
    reference_plan=reference.anchor_attention_plan,
    fast_plan=fast.anchor_attention_plan,
    reference_run=reference.anchor_attention,
    fast_run=fast.anchor_attention,
    params=_anchor_params,
    demo_params=_anchor_demo,
    exact_plans=False,
    tie_check=anchor_attention_tie_check,
    estimate=_anchor_estimate,
    input_kinds=("normal", "lattice", "lines"),
    notes="AnchorAttention: initial block + group window as anchor, difference-aware stripes "
          "per group of step query blocks, stripe pass resuming the anchor state",
    sweep=lambda n: [{**_anchor_demo(n), "theta": t} for t in (3.0, 6.0, 9.0, 12.0, 15.0)],
))


def _delta_kv_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    from hypothesis import strategies as st

    metric = draw(st.sampled_from(["euclidean", "cosine"]))
    if metric == "euclidean":
        # 0 drops only identical neighbours; 1e3 leaves one anchor per chunk; 0.5, 1 and 2
        # are distances the "runs" inputs hit exactly.
        threshold = draw(st.sampled_from([0.0, 2.0, 0.5, 1.0, 4.0, 6.0, 1e3]))
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
    from .delta import delta_golden, delta_structure_check, delta_view

    register(MethodSpec(
        name="delta_kv",
        reference_plan=None,
        fast_plan=None,
        reference_run=reference.delta_kv,
        fast_run=fast.delta_kv,
        params=_delta_kv_params,
        demo_params=lambda n: {"threshold": 0.83, "metric": "cosine"},
        notes="Delta-KV: anchors of similar-key runs packed with counts; exact critical diagonal",
        golden=delta_golden,
        structure_check=delta_structure_check,
        view=delta_view,
        input_kinds=("runs", "normal", "lattice"),
        sweep=lambda n: [{"threshold": t, "metric": "cosine"} for t in (0.95, 0.9, 0.85, 0.8, 0.75, 0.7)],
    ))


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


# The greedy threshold, the knob of XAttention and DPXA (`sparseprefill compare`).
_TILE_SWEEP = (0.8, 0.85, 0.9, 0.95, 0.98)


def _tile_demo_block(n: int) -> int:
    # 128 (the papers') once a sequence has a few dozen tiles; smaller below so the demo's
    # short workload still has tiles to skip.
    return 128 if n >= 4096 else 64


register(MethodSpec(
    name="xattention",
    chunked="each query tile's antidiagonal scores against the keys: the chunk's own tiles",
    reference_plan=reference.xattention_plan,
    fast_plan=fast.xattention_plan,
    reference_run=reference.xattention,
    fast_run=fast.xattention,
    params=_xattention_params,
    demo_params=lambda n: {"stride": 8, "threshold": 0.9, "block": _tile_demo_block(n)},
    exact_plans=False,
    tie_check=xattention_tie_check,
    sweep=lambda n: [{"stride": 8, "threshold": t, "block": _tile_demo_block(n)} for t in _TILE_SWEEP],
    notes="XAttention: antidiagonal stride-level scores, row softmax summed into tiles, greedy "
          "threshold selection (thesis sec. 2.5)",
))

register(MethodSpec(
    name="dpxa",
    chunked="as xattention: the chunk's own tiles",
    reference_plan=reference.dpxa_plan,
    fast_plan=fast.dpxa_plan,
    reference_run=reference.dpxa,
    fast_run=fast.dpxa,
    params=_dpxa_params,
    demo_params=lambda n: {"cos_threshold": 0.75, "threshold": 0.9, "block": _tile_demo_block(n)},
    exact_plans=False,
    tie_check=dpxa_tie_check,
    sweep=lambda n: [{"cos_threshold": 0.75, "threshold": t, "block": _tile_demo_block(n)} for t in _TILE_SWEEP],
    notes="DPXA: delta anchors of Q and K per tile, anchor-pair tile scores, XAttention's greedy "
          "selection (thesis sec. 4.3)",
))
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
    from .delta_xattention import (
        delta_xattention_golden,
        delta_xattention_structure_check,
        delta_xattention_view,
    )

    register(MethodSpec(
        name="delta_xattention",
        reference_plan=None,
        fast_plan=None,
        reference_run=reference.delta_xattention,
        fast_run=fast.delta_xattention,
        params=_delta_xattention_params,
        demo_params=lambda n: {"stride": 8, "threshold": 0.9, "exact_top": 0.1, "delta_threshold": 0.83,
                               "metric": "cosine", "block": _tile_demo_block(n), "packed_block": 32},
        notes="DeltaXAttention: XAttention's tiles, the diagonal and top tiles exact, the other "
              "selected tiles through per-tile Delta-KV anchors (thesis sec. 4.2)",
        golden=delta_xattention_golden,
        structure_check=delta_xattention_structure_check,
        view=delta_xattention_view,
        sweep=lambda n: [{"stride": 8, "threshold": 0.9, "exact_top": 0.1, "delta_threshold": t,
                          "metric": "cosine", "block": _tile_demo_block(n), "packed_block": 32}
                         for t in (0.95, 0.9, 0.85, 0.8, 0.75)],
    ))


_register_delta_xattention()


def _sample_attention_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    from hypothesis import strategies as st

    alpha = st.one_of(st.sampled_from([0.0, 0.5, 0.9, 0.95, 1.0]), st.floats(0.0, 1.0))
    return {
        "alpha_c": draw(alpha),
        "alpha_s": draw(alpha),
        # seqlen + 5 chunks: more chunks than rows, so every row is sampled.
        "chunk_n": draw(st.sampled_from([1, 2, 3, 4, 7, seqlen + 5])),
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
    return {"column": Estimate(column, terms=rows, bound=1.0),
            "slash": Estimate(slash, terms=rows, bound=1.0)}


register(MethodSpec(
    name="sample_attention",
    reference_plan=reference.sample_attention_plan,
    fast_plan=fast.sample_attention_plan,
    reference_run=reference.sample_attention,
    fast_run=fast.sample_attention,
    params=_sample_attention_params,
    # Section 5.4's 32K setting; 64-token blocks below 4K so short prompts keep several blocks.
    demo_params=lambda n: {"alpha_c": 0.95, "alpha_s": 0.95, "chunk_n": 1,
                           "block_size": 128 if n >= 4096 else 64},
    exact_plans=False,
    tie_check=sample_attention_tie_check,
    estimate=_sample_attention_estimate,
    input_kinds=("normal", "lattice", "lines"),
    notes="SampleAttention: chunked sampling, CRA-threshold column and slash blocks (Alg. 1)",
    sweep=lambda n: [{"alpha_c": a, "alpha_s": a, "chunk_n": 1} for a in (0.8, 0.9, 0.95, 0.98)],
))


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


def _minference_demo(n: int) -> dict[str, Any]:
    from ..reference.minference import HeadPattern

    vs = _vertical_slash_demo(n)
    return {"patterns": (
        HeadPattern("vertical_slash", {**vs, "block_m": 64, "block_n": 64}),
        HeadPattern("a_shape", {"sink": min(1024, max(64, n // 32)), "window": min(4096, max(128, n // 8)),
                                "block_m": 64, "block_n": 64}),
        HeadPattern("block_sparse", {"top_k": 100 if n >= 32768 else max(2, n // 512), "block_size": 64}),
    )}


def _minference_sweep(n: int) -> list[dict[str, Any]]:
    """The demo's three patterns with budgets scaled together: vertical-slash as its own grid,
    the A-shape window N/f, block-sparse top_k Kb/f (blocks of 64)."""
    from ..reference.minference import HeadPattern

    blocks = -(-n // 64)
    return [{"patterns": (
        HeadPattern("vertical_slash", {"vertical_size": max(30, n // f), "slash_size": max(64, 2 * n // f),
                                       "block_m": 64, "block_n": 64}),
        HeadPattern("a_shape", {"sink": min(1024, max(64, n // 32)), "window": max(128, n // f),
                                "block_m": 64, "block_n": 64}),
        HeadPattern("block_sparse", {"top_k": max(2, blocks * 8 // f), "block_size": 64}),
    )} for f in (128, 64, 32, 16, 8)]


def _minference_prepare(params: dict[str, Any], q: torch.Tensor) -> dict[str, Any]:
    """Pattern `h % len(patterns)` for query head `h`: a one-layer `MInferenceConfig`."""
    from ..reference.minference import MInferenceConfig

    patterns = tuple(params["patterns"])
    heads = tuple(patterns[h % len(patterns)] for h in range(int(q.shape[1])))
    out: dict[str, Any] = {"config": MInferenceConfig((heads,)), "layer": 0}
    if params.get("scale") is not None:
        out["scale"] = params["scale"]
    return out


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

    register(MethodSpec(
        name="minference",
        chunked="per head, its pattern's reading (vertical-slash: the chunk's last queries; A-shape: none; "
                "block-sparse: the chunk's blocks)",
        reference_plan=reference.minference_plan,
        fast_plan=fast.minference_plan,
        reference_run=reference.minference,
        fast_run=fast.minference,
        params=_minference_patterns,
        demo_params=_minference_demo,
        exact_plans=False,
        tie_check=minference_tie_check,
        notes="MInference per-head dispatch: each head its own pattern (vertical-slash, A-shape, "
              "block-sparse), one merged plan, one kernel launch",
        prepare=_minference_prepare,
        sweep=_minference_sweep,
        estimate=_minference_estimate,
        plan_check=_minference_plan_check,
        min_heads=2,
        input_kinds=("lines", "normal", "lattice"),
    ))


_register_minference()


def _flexprefill_vs_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    from hypothesis import strategies as st

    params: dict[str, Any] = _minference_blocks(draw)
    params["gamma"] = draw(st.sampled_from([0.9, 0.0, 0.5, 0.95, 1.0, 0.99]))
    everything = [seqlen, seqlen + 7] if seqlen <= 1024 else [1000]
    params["last_q"] = draw(st.sampled_from([1, 16, 64, *everything]))
    params["init_columns"] = draw(st.sampled_from([1, 0, 5]))
    params["local_diagonals"] = draw(st.sampled_from([1, 0, 7]))
    return params


register(MethodSpec(
    name="flexprefill_vs",
    chunked="the chunk's last `last_q` queries (capped at the chunk's length), as vertical-slash",
    reference_plan=reference.flexprefill_vs_plan,
    fast_plan=fast.flexprefill_vs_plan,
    reference_run=reference.flexprefill_vs,
    fast_run=fast.flexprefill_vs,
    params=_flexprefill_vs_params,
    demo_params=lambda n: {"gamma": 0.9},
    exact_plans=False,
    tie_check=flexprefill_vs_tie_check,
    notes="FlexPrefill-style vertical-slash (SharePrefill Alg. 5): fewest lines holding gamma of the "
          "estimated mass",
    sweep=lambda n: [{"gamma": g} for g in (0.8, 0.85, 0.9, 0.95, 0.98)],
))


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


_SHARE_STATE_KEYS = ("layout", "tau", "delta", "gamma", "block_m", "block_n", "init_columns",
                     "local_diagonals")


def _shareprefill_state(params: Mapping[str, Any]) -> reference.SharePrefillState:
    """The per-prefill state from SharePrefill's parameters (the layer comes from the model)."""
    unknown = sorted(set(params) - set(_SHARE_STATE_KEYS))
    if unknown:
        raise ValueError(f"shareprefill in a model takes {_SHARE_STATE_KEYS}; got also {unknown} "
                         "(the layer index comes from the model)")
    return reference.SharePrefillState(**params)


register(MethodSpec(
    name="shareprefill",
    reference_plan=reference.shareprefill_plan,
    fast_plan=fast.shareprefill_plan,
    reference_run=reference.shareprefill,
    fast_run=fast.shareprefill,
    params=_shareprefill_params,
    demo_params=lambda n: {},
    exact_plans=False,
    tie_check=shareprefill_tie_check,
    new_state=_shareprefill_state,
    reference_layer=reference.shareprefill_layer,
    fast_layer=fast.shareprefill_layer,
    notes="SharePrefill (one layer, fresh state: first head per cluster dense, others Alg. 5); "
          "layers share pivots through SharePrefillState",
    sweep=lambda n: [{"gamma": g} for g in (0.8, 0.85, 0.9, 0.95, 0.98)],
))
