"""The method descriptor (`Method`) and the registry every tool reads.

One `Method` holds every fact about one method: its reference and fast functions,
defaults, parameter check, compare sweep and ablation grids, chunked-prefill behaviour,
capture safety, distributed estimate and per-head knobs. The CLI, demo, bench, compare,
eval, `patch`, `fast.ops` and `distributed` read these descriptors and keep no table of
method names of their own. How to benchmark a method lives in `sparseprefill.bench`
(its own suite, if any, in `sparseprefill/bench/suites/<name>.py`); test knowledge
(Hypothesis strategies, tie rules, the tolerance policy) in `sparseprefill.conformance`,
looked up by method name.

Nothing here imports Hypothesis: serving a model needs none.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..reference.plan import BlockColumnPlan

PlanFn = Callable[..., BlockColumnPlan]
RunFn = Callable[..., torch.Tensor]
Params = dict[str, Any]


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
class SyncStatus:
    """What a method's op reads back from the device, and whether it can be captured.

    Attributes:
        syncs: the host synchronisations of the default op, one line each; empty:
            none (the op is capture-safe as it is).
        static_bound: the width the `<method>_static` op uses instead of the read
            (None: no `_static` op; either none is needed or none exists).
        capture_safe: True when the `_static` op (or, without one, the default op)
            makes no host synchronisation and no host-to-device copy, so CUDA-graph
            capture works; False leaves the ops tagged `cudagraph_unsafe`.
        note: what stops capture, or what the static bound costs.
    """

    syncs: tuple[str, ...] = ()
    static_bound: str | None = None
    capture_safe: bool = True
    note: str = ""


# What a method that does not say is assumed to do: unknown reads, not capture-safe.
UNKNOWN_SYNC = SyncStatus(syncs=("unknown: the descriptor gives no SyncStatus",), capture_safe=False)


@dataclass(frozen=True)
class Adapter:
    """How a parameter of a non-scalar type travels through a custom-op argument.

    Attributes:
        schema: the op argument's type (`str`, `SymInt`, ...).
        encode: Python value -> op value (run by `fast.ops.call` before the op).
        decode: op value -> Python value (run inside the op).
    """

    schema: str
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


@dataclass(frozen=True)
class DistributedEstimate:
    """How `distributed.context_parallel_plan` estimates a method across ranks.

    Attributes:
        kind: "shape" (the plan depends on N alone: built locally, no traffic) or
            "native" (a distributed estimator that moves less than all of q and k).
        needs: what the estimate moves between ranks, one line (docs/distributed.md).
        build: `(shard, params, impl, scale, comm) -> BlockColumnPlan`, the plan of the
            whole sequence on every rank (see `sparseprefill.distributed`).
    """

    kind: str
    needs: str
    build: Callable[..., BlockColumnPlan]


@dataclass(frozen=True)
class Ablation:
    """A named grid of extra points for `sparseprefill compare --ablations`: a paper's ablation
    or a wider grid of a knob, measured beside the sweep (the evidence of docs/<method>.md).

    Attributes:
        label: the grid's name in the table, JSON and plot (e.g. "naive s4"); unique per method.
        grid: `N -> [params, ...]`, parameters of the method's own functions.
        reference_plan: `(q, k, **params) -> BlockColumnPlan`, an estimator that replaces the
            method's for this grid, for a variant no parameter selects (an ideal scorer, grid
            anchors); the points then run `sparse_attention` of its plan. Reference backend only.
        about: one line: what the grid shows.
    """

    label: str
    grid: Callable[[int], list[Params]]
    reference_plan: PlanFn | None = None
    about: str = ""


@dataclass(frozen=True)
class Method:
    """Every fact about one sparse attention method, in one place.

    Attributes:
        name: the public name (`fast.<name>`, `reference.<name>`, `patch(model, name)`).
        notes: one line: what the method is (the demo and docs tables).
        reference_plan, fast_plan: the estimators `(q, k, **params) -> BlockColumnPlan`;
            both or neither. A method whose output is not the attention of one plan
            (Delta-KV reads packed keys) has neither and gives `view`.
        reference_run, fast_run: the end-to-end functions `(q, k, v, **params, scale=)`.
            None (with plans): `sparse_attention(q, k, v, <impl>_plan(q, k, **params))`,
            with the plan function's parameters as its own.
        defaults: the parameters at a prompt length N (demo, bench, compare, `patch`
            without a config).
        sweep: `N -> [params, ...]`, the grid of the main knob that `sparseprefill
            compare` measures (docs/compare.md); None: `[defaults(N)]`.
        check: `(params) -> None`, the method's own check of parameter values, given
            every parameter of its run function (defaults filled in); raises
            ValueError/TypeError naming the parameter. Run by `check_params` (`patch`
            calls it when a model is patched, before any prompt).
        prepare: `(params, q) -> call parameters` for a method whose parameters depend
            on the input's shape (MInference's per-head config needs Hq).
        view: `(impl_name, q, k, v, params) -> MethodView` for reports; None: the plan's
            density and recall.
        chunked: for chunked prefill (`chunk_plan`, queries `[P, P + N)` over keys
            `[0, P + N)`): what a chunk's estimate reads, one line. Non-empty promises
            the plan's rows read no query before P, so a chunk's plan equals the
            one-shot plan restricted to its rows (`tests/test_chunked.py` checks it).
            "": the method needs the whole prompt; `chunk_plan` is not offered.
        sync: the host synchronisations of its op and whether it can be captured in a
            CUDA graph (`fast.ops`, docs/serving.md).
        adapters: op-argument adapters of parameters with no scalar op type.
        distributed: how context parallelism estimates it; None: every rank gathers
            all of q and k and runs the one-process estimator.
        new_state, reference_layer, fast_layer: for methods that carry state across
            the layers of one forward pass (SharePrefill). `new_state(params)` makes one
            prefill's state; `*_layer(q, k, v, state, *, layer, scale) -> out` runs one
            layer with it. `patch` uses them when set.
        ablations: extra grids `sparseprefill compare --ablations` measures beside the sweep
            (`Ablation`: a paper's ablation, a wider grid, a yardstick's budget grid).
        extras: `(impl_name, q, k, v, params, view) -> {name: float}`, numbers `compare`
            reports beside density and recall (a scoring ratio, a keep ratio, tiles computed),
            given the call's `MethodView`; None: none.
        calibration: `N -> [params, ...]`, the grid `sparseprefill calibrate` searches per
            layer and head (a wider grid of the main knob than `sweep`, its other parameters
            fixed); None: `sweep`.
        coupled_heads: "" when a head's plan depends on that head's q, k and knob values
            alone (calibrate then reads every head's recall from one scalar run per grid
            point); else one line saying how heads interact (SharePrefill's clusters), and
            calibrate measures the chosen per-head config as a whole.
        knobs: the parameters of the method's main knob(s) that take a per-head value as
            well as a scalar: a list/tuple of Hq numbers or a 1-D tensor `[Hq]`, element `h`
            for query head `h` (`reference._checks.per_head`, docs/architecture.md
            "Per-head knobs"). Empty: no per-head knob (dense; MInference, whose config
            is already per head).
        kv_knobs: those of `knobs` that act on the keys (Delta-KV's keep-mask
            threshold): a per-head value still has one element per query head, but the
            query heads of a KV group must share it (`reference._checks.per_kv_head`);
            the conformance strategies draw them per KV head.
        head_candidates: for a method whose heads each take another method (`headwise`):
            `N -> [{"method": name, **fixed parameters}, ...]`, the families `sparseprefill
            calibrate` searches per head (each family the named method's calibration grid
            with the fixed parameters, a unit say, laid over every point); its configs'
            layers are per-head lists that name each head's method. None: a method of its own.
    """

    name: str
    notes: str
    defaults: Callable[[int], Params]
    reference_plan: PlanFn | None = None
    fast_plan: PlanFn | None = None
    reference_run: RunFn | None = None
    fast_run: RunFn | None = None
    sweep: Callable[[int], list[Params]] | None = None
    check: Callable[[Mapping[str, Any]], None] | None = None
    prepare: Callable[[Params, torch.Tensor], Params] | None = None
    view: Callable[..., MethodView] | None = None
    chunked: str = ""
    sync: SyncStatus = UNKNOWN_SYNC
    adapters: Mapping[str, Adapter] = field(default_factory=dict)
    distributed: DistributedEstimate | None = None
    new_state: Callable[[Mapping[str, Any]], Any] | None = None
    reference_layer: Callable[..., torch.Tensor] | None = None
    fast_layer: Callable[..., torch.Tensor] | None = None
    ablations: tuple[Ablation, ...] = ()
    extras: Callable[..., dict[str, float]] | None = None
    calibration: Callable[[int], list[Params]] | None = None
    coupled_heads: str = ""
    knobs: tuple[str, ...] = ()
    kv_knobs: tuple[str, ...] = ()
    head_candidates: Callable[[int], list[Params]] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"a method's name must be a Python identifier, got {self.name!r}")
        if not isinstance(self.knobs, tuple) or not all(isinstance(n, str) for n in self.knobs):
            raise TypeError(f"{self.name}: knobs must be a tuple of parameter names, got {self.knobs!r}")
        if not isinstance(self.kv_knobs, tuple) or not set(self.kv_knobs) <= set(self.knobs):
            raise ValueError(f"{self.name}: kv_knobs must be a tuple of some of its knobs {self.knobs}, "
                             f"got {self.kv_knobs!r}")
        if (self.reference_plan is None) != (self.fast_plan is None):
            raise ValueError(f"{self.name}: give both plan functions or neither")
        if self.reference_plan is None and (self.reference_run is None or self.fast_run is None
                                            or self.view is None):
            raise ValueError(f"{self.name}: a method without plans needs both run functions and a view")
        if (self.reference_run is None) != (self.fast_run is None):
            raise ValueError(f"{self.name}: give both run functions or neither")
        if self.chunked and self.reference_plan is None:
            raise ValueError(f"{self.name}: chunked prefill needs plan functions")
        layers = (self.new_state, self.reference_layer, self.fast_layer)
        if any(f is None for f in layers) and any(f is not None for f in layers):
            raise ValueError(f"{self.name}: give new_state, reference_layer and fast_layer together")
        labels = [a.label for a in self.ablations]
        if not all(isinstance(a, Ablation) for a in self.ablations) or len(set(labels)) != len(labels):
            raise ValueError(f"{self.name}: ablations must be Ablation entries with unique labels, got {labels}")
        if any(a.reference_plan is not None for a in self.ablations) and not self.plan_based:
            raise ValueError(f"{self.name}: an ablation's own plan function needs a plan-based method")
        if self.reference_run is None:
            assert self.reference_plan is not None and self.fast_plan is not None
            object.__setattr__(self, "reference_run", _plan_runner(self.name, "reference", self.reference_plan))
            object.__setattr__(self, "fast_run", _plan_runner(self.name, "fast", self.fast_plan))
        unknown = [n for n in self.knobs if n not in self.parameters()]
        if unknown:
            raise ValueError(f"{self.name}: knobs {unknown} are not parameters of its functions "
                             f"{list(self.parameters())}")

    @property
    def plan_based(self) -> bool:
        """True when the output is `sparse_attention` of the method's plan."""
        return self.reference_plan is not None

    @property
    def capture_safe(self) -> bool:
        """True when its op (or its `_static` op) can be captured in a CUDA graph."""
        return self.sync.capture_safe

    def plan_fn(self, impl_name: str) -> PlanFn:
        """The `fast` or `reference` estimator (plan-based methods only)."""
        fn = self.fast_plan if impl_name == "fast" else self.reference_plan
        if fn is None:
            raise ValueError(f"method {self.name!r} does not produce a plan")
        return fn

    def run_fn(self, impl_name: str) -> RunFn:
        """The `fast` or `reference` end-to-end function."""
        fn = self.fast_run if impl_name == "fast" else self.reference_run
        assert fn is not None  # set in __post_init__
        return fn

    def demo_params(self, seqlen: int) -> Params:
        """The default parameters at prompt length `seqlen` (a new dict)."""
        return dict(self.defaults(seqlen))

    def sweep_params(self, seqlen: int) -> list[Params]:
        """The knob grid at `seqlen` (`sweep`, else the defaults alone)."""
        if self.sweep is None:
            return [self.demo_params(seqlen)]
        return [dict(p) for p in self.sweep(seqlen)]

    def calibration_params(self, seqlen: int) -> list[Params]:
        """The grid `sparseprefill calibrate` searches at `seqlen` (`calibration`, else the sweep)."""
        if self.calibration is None:
            return self.sweep_params(seqlen)
        return [dict(p) for p in self.calibration(seqlen)]

    def call_params(self, params: Mapping[str, Any], q: torch.Tensor) -> Params:
        """The keyword arguments of a call on `q` (`prepare` applied, if any)."""
        return dict(params) if self.prepare is None else self.prepare(dict(params), q)

    def parameters(self) -> tuple[str, ...]:
        """The keyword parameters its end-to-end function takes (q, k, v excluded)."""
        sig = inspect.signature(self.run_fn("reference"))
        return tuple(p for p in sig.parameters if p not in ("q", "k", "v"))

    def check_params(self, params: Mapping[str, Any]) -> None:
        """Check a parameter dict before any work: names the run function takes, then
        the values (`check`, with the defaults of the parameters not given).

        A method with `prepare` takes other parameters than its functions' (MInference's
        patterns): its names are checked when `prepare` runs.

        Raises:
            TypeError: `params` is not a mapping of names, or a name the method does not take.
            ValueError: a value `check` refuses.
        """
        if not isinstance(params, Mapping) or not all(isinstance(key, str) for key in params):
            raise TypeError(f"{self.name}: params must be a mapping of parameter names, got {params!r}")
        if self.prepare is not None:
            return
        sig = inspect.signature(self.run_fn("reference"))
        try:
            bound = sig.bind(None, None, None, **params)
        except TypeError as exc:
            raise TypeError(f"{self.name}: {exc}; it takes {list(self.parameters())}") from None
        bound.apply_defaults()
        if self.check is not None:
            self.check({key: val for key, val in bound.arguments.items() if key not in ("q", "k", "v")})

    def method_view(self, impl_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    params: Mapping[str, Any], *, scale: float | None = None,
                    with_recall: bool = True) -> MethodView:
        """Density, recall and a plan to draw for one call (see `MethodView`)."""
        if self.view is not None:
            return self.view(impl_name, q, k, v, dict(params))
        from .. import fast, reference

        impl: Any = fast if impl_name == "fast" else reference
        plan = self.plan_fn(impl_name)(q, k, **params)
        recall = impl.recall(q, k, plan, scale=scale) if with_recall else None
        return MethodView(density=impl.density(plan), recall=recall, plan=plan)


def _plan_runner(name: str, impl_name: str, plan_fn: PlanFn) -> RunFn:
    """`(q, k, v, **plan params, scale=None) -> sparse_attention(q, k, v, plan_fn(q, k, ...))`.

    The runner's signature and annotations are the plan function's with `v` added after
    `k` (and `scale` when the plan takes none), so the custom op built from it
    (`fast.ops.method_schema`) has the plan's typed parameters.
    """
    sig = inspect.signature(plan_fn)
    hints = typing.get_type_hints(plan_fn)
    params = list(sig.parameters.values())
    if [p.name for p in params[:2]] != ["q", "k"]:
        raise ValueError(f"{name}: a plan function takes (q, k, ...), got {sig}")
    takes_scale = "scale" in sig.parameters
    v_param = inspect.Parameter("v", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.Tensor)
    rest = params[2:]
    if not takes_scale:
        rest.append(inspect.Parameter("scale", inspect.Parameter.KEYWORD_ONLY, default=None,
                                      annotation=float | None))
    new_sig = sig.replace(parameters=[*params[:2], v_param, *rest], return_annotation=torch.Tensor)

    def run(*args: Any, **kwargs: Any) -> torch.Tensor:
        from .. import fast, reference

        bound = new_sig.bind(*args, **kwargs)
        bound.apply_defaults()
        call = dict(bound.arguments)
        q, k, v = call.pop("q"), call.pop("k"), call.pop("v")
        scale = call.get("scale") if takes_scale else call.pop("scale")
        plan = plan_fn(q, k, **call)
        impl: Any = fast if impl_name == "fast" else reference
        out: torch.Tensor = impl.sparse_attention(q, k, v, plan, scale=scale)
        return out

    run.__name__ = name
    run.__qualname__ = name
    run.__doc__ = f"`sparse_attention` of `{impl_name}` {plan_fn.__name__}'s plan (a derived runner)."
    run.__signature__ = new_sig  # type: ignore[attr-defined]
    run.__annotations__ = {**hints, "v": torch.Tensor, "return": torch.Tensor,
                           **({} if takes_scale else {"scale": float | None})}
    return run


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add `method` to the registry (names are unique); returns it.

    Raises:
        TypeError: not a `Method`.
        ValueError: the name is taken.
    """
    if not isinstance(method, Method):
        raise TypeError(f"register takes a Method, got {type(method).__name__}")
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is already registered")
    METHODS[method.name] = method
    return method


def unregister(name: str) -> Method:
    """Remove a registered method (a test's toy method); returns it.

    Its custom op, if `fast.ops` made one, stays registered with torch for the process.
    """
    if name not in METHODS:
        raise ValueError(f"no registered method {name!r}")
    return METHODS.pop(name)


def methods() -> Mapping[str, Method]:
    """The registered methods, in registration order."""
    return METHODS


def get(name: str) -> Method:
    """The registered method `name`.

    Raises:
        ValueError: not a string, or no such method (the message lists them).
    """
    if not isinstance(name, str) or name not in METHODS:
        raise ValueError(f"unknown method {name!r}; registered: {', '.join(METHODS)}")
    return METHODS[name]
