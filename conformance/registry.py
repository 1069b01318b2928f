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
    block_sparse_tie_check,
    flexprefill_vs_tie_check,
    shareprefill_tie_check,
    vertical_slash_tie_check,
)

PlanFn = Callable[..., BlockColumnPlan]
RunFn = Callable[..., torch.Tensor]


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
    """

    name: str
    reference_plan: PlanFn
    fast_plan: PlanFn
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
    from hypothesis import strategies as st

    return {
        "block_m": draw(st.sampled_from([16, 32, 64, 128])),
        "block_n": draw(st.sampled_from([16, 32, 64])),
    }


def _dense_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    return _block_sizes(draw)


def _sink_window(draw: Callable[[Any], Any], seqlen: int) -> dict[str, int]:
    """`sink` and `window` draws shared by streaming and A-shape (both may exceed N)."""
    from hypothesis import strategies as st

    return {"sink": draw(st.integers(0, max(1, seqlen))),
            "window": draw(st.integers(1, max(1, seqlen + 8)))}


def _streaming_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    return {**_block_sizes(draw), **_sink_window(draw, seqlen)}


register(MethodSpec(
    name="dense",
    reference_plan=reference.dense_plan,
    fast_plan=fast.dense_plan,
    reference_run=reference.dense,
    fast_run=fast.dense,
    params=_dense_params,
    demo_params=lambda n: {},
    notes="full causal attention (baseline)",
))

register(MethodSpec(
    name="streaming",
    reference_plan=reference.streaming_plan,
    fast_plan=fast.streaming_plan,
    reference_run=reference.streaming,
    fast_run=fast.streaming,
    params=_streaming_params,
    demo_params=lambda n: {"sink": min(1024, max(64, n // 32)), "window": max(128, n // 8)},
    notes="StreamingLLM / A-shape: sink + local window (baseline)",
))


def _minference_blocks(draw: Callable[[Any], Any]) -> dict[str, int]:
    from hypothesis import strategies as st

    sizes = st.sampled_from([16, 32, 48, 64, 128])
    return {"block_m": draw(sizes), "block_n": draw(sizes)}


def _vertical_slash_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    from hypothesis import strategies as st

    params: dict[str, Any] = _minference_blocks(draw)
    params["vertical_size"] = draw(st.integers(1, seqlen + 8))
    params["slash_size"] = draw(st.integers(1, seqlen + 8))
    # last_q > N means every query; 64 is MInference's value. The reference holds the
    # float64 [last_q, N] estimate per head, so "every query" is drawn at N <= 1024 only.
    everything = [seqlen, seqlen + 7] if seqlen <= 1024 else [1000]
    params["last_q"] = draw(st.sampled_from([1, 16, 64, *everything]))
    params["init_columns"] = draw(st.sampled_from([0, 1, 5, 30]))
    params["local_diagonals"] = draw(st.sampled_from([0, 1, 7, 100]))
    return params


def _vertical_slash_demo(n: int) -> dict[str, Any]:
    # MInference's LLaMA-3 setting from 32K on; scaled down below so it stays sparse.
    if n >= 32768:
        return {"vertical_size": 1000, "slash_size": 6096}
    return {"vertical_size": max(30, n // 32), "slash_size": max(100, n // 8)}


def _block_sparse_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    from hypothesis import strategies as st

    block_size = draw(st.sampled_from([16, 32, 48, 64, 128]))
    blocks = -(-seqlen // block_size)
    return {"block_size": block_size, "top_k": draw(st.integers(1, blocks + 2))}


def _a_shape_params(draw: Callable[[Any], Any], seqlen: int) -> dict[str, Any]:
    return {**_minference_blocks(draw), **_sink_window(draw, seqlen)}


register(MethodSpec(
    name="vertical_slash",
    reference_plan=reference.vertical_slash_plan,
    fast_plan=fast.vertical_slash_plan,
    reference_run=reference.vertical_slash,
    fast_run=fast.vertical_slash,
    params=_vertical_slash_params,
    demo_params=_vertical_slash_demo,
    exact_plans=False,
    tie_check=vertical_slash_tie_check,
    notes="MInference vertical-slash: last_q estimate, top-k columns and diagonals, Alg. 4 index",
))

register(MethodSpec(
    name="block_sparse",
    reference_plan=reference.block_sparse_plan,
    fast_plan=fast.block_sparse_plan,
    reference_run=reference.block_sparse,
    fast_run=fast.block_sparse,
    params=_block_sparse_params,
    demo_params=lambda n: {"top_k": 100 if n >= 32768 else max(2, n // 512)},
    exact_plans=False,
    tie_check=block_sparse_tie_check,
    notes="MInference block-sparse: mean-pooled block scores, top-k key blocks per query block",
))

register(MethodSpec(
    name="a_shape",
    reference_plan=reference.a_shape_plan,
    fast_plan=fast.a_shape_plan,
    reference_run=reference.a_shape,
    fast_run=fast.a_shape,
    params=_a_shape_params,
    demo_params=lambda n: {"sink": min(1024, max(64, n // 32)), "window": min(4096, max(128, n // 8))},
    notes="MInference A-shape: streaming with 1024 sink and 4096 window tokens, 64 x 64 blocks",
))


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
))
