"""`sparseprefill calibrate`: per-layer, per-head settings of any method, from captured q/k.

A method is deployed with one setting per layer and head chosen offline. From one or
more `sparseprefill eval capture` files (q/k/v of some layers of a real prompt), for a
method (or every plan-based method with a knob grid), this chooses for every captured
layer and query head the cheapest point of the method's calibration grid that reaches
a target, and full causal attention ("dense") for a head that no grid point serves.
The grid is the descriptor's `calibration` (every plan-based method has one), else its
compare `sweep`, or `--grid`; the command says which it used (`describe_grid`), and the
config records it (`grid`). The targets:

* `--target-recall R` (default 0.95): the head's attention recall, mean over its rows;
* `--target-row-recall R`: the head's worst sampled row;
* `--target-error E`: the head's relative output error (Frobenius, sampled rows).

Every target given must hold on every calibration capture of that layer (the cheapest
is by mean density over them). `--refine STEPS` then bisects each head's value of a
grid's float knob between the grid points around its pick (`refine_heads`: one run per
step, every head at its own midpoint). `--margin M` calibrates to the safe side
(`Target.with_margin`: every recall bound + M, an error bound - M, on the calibration
prompts) so that a held-out prompt still meets the target. What is measured: per layer, `--rows` query rows
sampled uniformly (one per stratum of N / rows rows, seeded) and their full causal
softmax in float64; the recall of a plan on those rows is the mass it keeps, its
output error the relative error of the renormalised kept mass times V, its density the
exact kept share of the whole causal area (`density(plan)`). The oracle (the sparsest
per-row selection at a share, `sparseprefill.oracle`) is counted on the same rows.

Head-independent methods (the descriptor's `coupled_heads` empty): one scalar run per
grid point gives every head's numbers. Every chosen layer config is then run as a whole
(what `patch` runs: one estimator call with per-head knob values, the dense heads made
full causal by `BlockColumnPlan.with_dense_heads`) and that measurement is the reported
one; for a method whose heads interact (SharePrefill) it is the only valid one, and the
report says so.

The written JSON (`<out-dir>/<method>.json`, one per method; format and checks in
`sparseprefill.config`) is what `patch(model, method, config=path)` reads: `{layer_idx:
spec}` where a spec is None (the layer runs SDPA), a dict of parameters whose knobs may
be per-head lists (`Method.knobs`) and whose `dense_heads` lists the heads that run full
causal attention, or, for a method whose varying parameters are not per-head knobs, a
per-head list (one dict or None per query head). Layers that were not captured are
absent: they run SDPA.

A layer takes minutes on a CPU (DPXA: 400-450 s on two cores), so each layer's result is
written the moment it is measured: one JSON line to the `.jsonl` beside `--table` (else
`<out-dir>/calibrate.jsonl`), and the config rewritten with every layer so far
(`"complete": false` until the last). Progress lines give the time spent and an estimate
of the time left; `--resume` reads the `.jsonl` back (same settings) and measures only
the layers it lacks.

`--prompts KIND=SOURCE ...` takes prompts of several kinds of text (`sparseprefill.prompts`:
captures, text files, or named sources such as the stdlib sources, the pydoc topics and
a Debian novel, captured once with `--model`); each head must then reach the target plus
its own margin, max(`--margin`, `--margin-spread` x the spread of its number across the
kinds), on every kind (`sparseprefill.margins`), and the config records each head's margin.

`--eval CONFIG ...` measures written configs on other captures (the held-out check:
calibrate on one text, evaluate on another). `sparseprefill search` (MInference's
per-head pattern search) and `sparseprefill tune` (SampleAttention per length range)
stay the methods' own searches; this command covers every method's knob per head.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .config import CalibratedConfig, dense_heads_of, read_config, write_config
from .layer_stats import (
    DEFAULT_SHARES, HeadStats, LayerCapture, Target, Truth, combine, layer_spec, layer_truths, load_captures,
    measure_spec, method_knobs, plan_stats)
from .runlog import Progress, RowLog, rows_path


# -- configs ---------------------------------------------------------------------------------


def calibratable(method: Any) -> bool:
    """Whether `calibrate` covers a method: plan-based, with plain parameters (no `prepare`:
    MInference's per-head patterns have `sparseprefill search`), a grid, not `dense`."""
    from .methods import DENSE

    return bool(method.plan_based and method.prepare is None and method.name != DENSE
                and (method.calibration is not None or method.sweep is not None or method_knobs(method)))


GRID_CALIBRATION = "calibration"
GRID_SWEEP = "sweep"
GRID_GIVEN = "--grid"


def calibration_grid(method: Any, seqlen: int,
                     given: Sequence[Mapping[str, Any]] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """The points `calibrate` searches for a method at `seqlen`, and which grid they are.

    Returns:
        (`"--grid"` for `given`, `"calibration"` for the descriptor's calibration grid,
        `"sweep"` for its compare sweep when it has none; the points, a point that
        repeats an earlier one dropped: at short N the grids' clamps make equal points).
    """
    if given is not None:
        label, points = GRID_GIVEN, [dict(p) for p in given]
    elif method.calibration is not None:
        label, points = GRID_CALIBRATION, method.calibration_params(seqlen)
    else:
        label, points = GRID_SWEEP, method.sweep_params(seqlen)
    seen: set[str] = set()
    out = []
    for p in points:
        key = json.dumps(p, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return label, out


def describe_grid(label: str, points: Sequence[Mapping[str, Any]], seqlen: int) -> str:
    """One line: which grid, its size, and the values of what it varies (the fixed rest once)."""
    keys = list(dict.fromkeys(key for p in points for key in p))
    varying = [key for key in keys if len({json.dumps(p.get(key), default=str) for p in points}) > 1]
    fixed = {key: points[0][key] for key in keys if key not in varying and key in points[0]}
    what = {GRID_CALIBRATION: "its calibration grid", GRID_GIVEN: "the --grid points",
            GRID_SWEEP: "its compare sweep (the method has no calibration grid)"}[label]
    values = "; ".join(f"{key} " + ", ".join(str(p.get(key)) for p in points) for key in varying)
    return (f"{what}, {len(points)} point(s) at N={seqlen}: {values or 'one point'}"
            + (f" (fixed: {', '.join(f'{k}={v}' for k, v in fixed.items())})" if fixed else ""))


# -- calibration --------------------------------------------------------------------------------


@dataclass
class LayerResult:
    """One method on one layer: the choice per head and what the whole config measured."""

    method: str
    layer: int
    sources: list[str]
    seqlen: int
    spec: Any
    picks: list[int | None]
    chosen_params: list[dict[str, Any] | None]
    density: list[float]
    recall_mean: list[float]
    recall_min: list[float]
    error: list[float] | None
    oracle: list[float]
    oracle_share: float
    default_density: list[float] = field(default_factory=list)
    default_recall_mean: list[float] = field(default_factory=list)
    default_params: dict[str, Any] = field(default_factory=dict)
    coupled: str = ""
    seconds: float = 0.0
    grid: str = ""
    head_margin: list[float | None] = field(default_factory=list)
    kind_recall: dict[str, list[float]] = field(default_factory=dict)
    # `--method headwise`: the unit, each head's modelled costs and every option (`choose_heads`).
    headwise: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        dens = sum(self.density) / len(self.density)
        orac = sum(self.oracle) / len(self.oracle)
        return {"method": self.method, "layer": self.layer, "density": dens, "oracle": orac,
                "ratio": dens / orac if orac > 0 else math.inf,
                "recall_mean": sum(self.recall_mean) / len(self.recall_mean),
                "recall_min_head": min(self.recall_mean), "worst_row": min(self.recall_min),
                "error_max": None if self.error is None else max(self.error),
                "dense_heads": sum(p is None for p in self.picks), "heads": len(self.picks),
                "default_density": (sum(self.default_density) / len(self.default_density)
                                    if self.default_density else None),
                "default_recall_mean": (sum(self.default_recall_mean) / len(self.default_recall_mean)
                                        if self.default_recall_mean else None),
                "default_recall_min_head": min(self.default_recall_mean) if self.default_recall_mean else None,
                "grid": self.grid, **_kind_summary(self)}


def _kind_summary(result: LayerResult) -> dict[str, Any]:
    """Per-head margins (mean, largest) and each kind's recall (mean / worst head), when known."""
    out: dict[str, Any] = {}
    margins = [m for m in result.head_margin if m is not None]
    if margins:
        out["head_margin_mean"], out["head_margin_max"] = sum(margins) / len(margins), max(margins)
    if result.kind_recall:
        out["kinds"] = {kind: {"recall_mean": sum(r) / len(r), "recall_min_head": min(r)}
                        for kind, r in result.kind_recall.items()}
    return out


def _head_lists(stats: HeadStats) -> tuple[list[float], list[float], list[float], list[float] | None]:
    return ([float(x) for x in stats.density], [float(x) for x in stats.recall_mean],
            [float(x) for x in stats.recall_min], None if stats.error is None else [float(x) for x in stats.error])


def bisect_knob(grid: Sequence[Mapping[str, Any]]) -> str | None:
    """The one parameter the grid varies, if it is a float (a knob to bisect), else None."""
    keys = list(dict.fromkeys(key for p in grid for key in p))
    varying = [key for key in keys if len({json.dumps(p.get(key), sort_keys=True) for p in grid}) > 1]
    if len(varying) != 1 or not all(isinstance(p.get(varying[0]), float) for p in grid):
        return None
    return varying[0]


def refine_heads(method: Any, caps: Sequence[LayerCapture], truths: Sequence[Truth], target: Target,
                 points: Sequence[Mapping[str, Any]], serve: torch.Tensor, *, steps: int,
                 top: float | None = None, impl: str = "reference") -> tuple[list[float | None], HeadStats | None]:
    """Bisect each head's knob between grid points: the cheapest value that serves it.

    The grid varies one float knob (`bisect_knob`), monotone in what it keeps (a larger
    value keeps a superset: every `Method.knobs` knob). Head `h`'s bracket is (`lo`, `hi`]:
    `hi` the smallest grid value that serves it, `lo` the largest below (that does not;
    the knob's 0 below the grid). A head no grid point serves is bracketed by the grid's
    largest value and `top` if `top` serves it (one extra run), else stays dense. Each
    step is one run with every head at its own midpoint (the per-head knob), so `steps`
    runs shrink every bracket `2**steps`-fold.

    Returns:
        (each head's value, None where dense; the stats of the last run, unused).
    """
    knob = bisect_knob(points)
    assert knob is not None
    hq = int(serve.shape[1])
    values = sorted({float(p[knob]) for p in points})
    base = dict(points[0])

    def run(per_head: list[float]) -> HeadStats:
        params = {**base, knob: per_head}
        stats = []
        for cap, truth in zip(caps, truths):
            q, k = cap.q.float(), cap.k.float()
            stats.append(plan_stats(truth, method.plan_fn(impl)(q, k, **method.call_params(params, q)), cap.v))
        return combine(stats)

    by_value = {float(p[knob]): g for g, p in enumerate(points)}
    lo: list[float] = []
    hi: list[float | None] = []
    for h in range(hq):
        ok = [x for x in values if bool(serve[by_value[x], h])]
        if ok:
            below = [x for x in values if x < ok[0]]
            lo.append(below[-1] if below else 0.0)
            hi.append(ok[0])
        else:
            lo.append(values[-1])
            hi.append(None)
    if top is not None and any(x is None for x in hi):
        served = target.serves(run([top] * hq))
        hi = [top if x is None and bool(served[h]) else x for h, x in enumerate(hi)]
    last = None
    for _ in range(steps):
        mids = [(a + b) / 2 if b is not None else values[-1] for a, b in zip(lo, hi)]
        last = run(mids)
        ok_t = target.serves(last)
        for h in range(hq):
            if hi[h] is None:
                continue
            if bool(ok_t[h]):
                hi[h] = mids[h]
            else:
                lo[h] = mids[h]
    return hi, last


def calibrate_layer(method: Any, caps: Sequence[LayerCapture], truths: Sequence[Truth], target: Target, *,
                    granularity: str = "head", impl: str = "reference", share: float = 0.95,
                    grid: Sequence[Mapping[str, Any]] | None = None, log: Any = None,
                    refine: int = 0, refine_top: float | None = None) -> LayerResult:
    """Choose one layer's config from its captures (one or more prompts of the same layer).

    Args:
        method: a `Method`.
        caps, truths: the layer's captures and their `row_truth`.
        target: what each head must reach on every prompt.
        granularity: "head" (each head its cheapest serving point) or "layer" (one point
            for the layer, the heads it does not serve dense).
        impl: "reference" or "fast" estimators.
        share: the oracle share the density is compared with.
        grid: the points searched (default `calibration_grid`: the descriptor's
            calibration grid, else its compare sweep; the result's `grid` says which).
        refine: bisection steps per head after the grid (`refine_heads`; granularity
            "head", a grid varying one float knob of a method whose heads are
            independent); 0: the grid's points only.
        refine_top: the knob's value tried for heads no grid point serves (then
            bisected from the grid's largest value); None: they stay dense.

    Returns:
        The `LayerResult`, measured with the whole config.
    """
    if granularity not in ("head", "layer"):
        raise ValueError(f"granularity must be 'head' or 'layer', got {granularity!r}")
    if share not in truths[0].shares:
        raise ValueError(f"share {share} is not among the oracle shares {truths[0].shares}")
    t0 = time.perf_counter()
    n = caps[0].seqlen
    grid_label, points = calibration_grid(method, n, grid)
    if not points:
        raise ValueError(f"{method.name}: empty calibration grid")
    per_point: list[HeadStats] = []
    for i, params in enumerate(points):
        stats = []
        for cap, truth in zip(caps, truths):
            q, k = cap.q.float(), cap.k.float()
            plan = method.plan_fn(impl)(q, k, **method.call_params(params, q))
            stats.append(plan_stats(truth, plan, cap.v))
        per_point.append(combine(stats))
        if log is not None:
            print(f"    {method.name} layer {caps[0].layer}: grid point {i + 1}/{len(points)} "
                  f"({_short(params)}) at {time.perf_counter() - t0:.0f} s", file=log, flush=True)
    hq = int(caps[0].q.shape[1])
    serve = torch.stack([target.serves(s) for s in per_point])  # [G, Hq]
    dens = torch.stack([s.density for s in per_point])  # [G, Hq]
    rec = torch.stack([s.recall_mean for s in per_point])
    picks: list[int | None]
    if granularity == "head":
        picks = []
        for h in range(hq):
            ok = [g for g in range(len(points)) if bool(serve[g, h])]
            picks.append(min(ok, key=lambda g: (float(dens[g, h]), -float(rec[g, h]))) if ok else None)
    else:
        # One point for the layer; a head it does not serve is dense (density 1).
        cost = torch.where(serve, dens, torch.ones_like(dens)).mean(dim=1)
        best = int(torch.argmin(cost))
        picks = [best if bool(serve[best, h]) else None for h in range(hq)]
    spec = layer_spec(method, points, picks)
    knob = bisect_knob(points)
    if refine > 0 and granularity == "head" and not method.coupled_heads and knob in method_knobs(method):
        values, _ = refine_heads(method, caps, truths, target, points, serve, steps=refine, top=refine_top,
                                 impl=impl)
        extra = [{**points[0], knob: v} for v in values if v is not None]
        # Each head's own point: the grid extended by the bisected values.
        points = list(points) + extra
        it = iter(range(len(points) - len(extra), len(points)))
        picks = [next(it) if v is not None else None for v in values]
        spec = layer_spec(method, points, picks)
    if isinstance(spec, list) and method.new_state is not None:
        # A stateful method takes one choice for every head of a layer: values per head need
        # its knobs (`Method.knobs`); without them, one point for the layer.
        cost = torch.where(serve, dens, torch.ones_like(dens)).mean(dim=1)
        best = int(torch.argmin(cost))
        picks = [best if bool(serve[best, h]) else None for h in range(hq)]
        spec = layer_spec(method, points, picks)
    whole, picks, spec = _measure_chosen(method, spec, picks, points, dens, caps, truths, target,
                                         impl=impl, settle=granularity == "head")
    default, dstats, oracle = _default_and_oracle(method, caps, truths, impl=impl, share=share)
    d, rm, rn, err = _head_lists(whole)
    result = LayerResult(
        method=method.name, layer=caps[0].layer, sources=[Path(c.source).name for c in caps], seqlen=n,
        spec=spec, picks=picks, chosen_params=[points[i] if i is not None else None for i in picks],
        density=d, recall_mean=rm, recall_min=rn, error=err, oracle=[float(x) for x in oracle],
        oracle_share=share, default_density=[float(x) for x in dstats.density],
        default_recall_mean=[float(x) for x in dstats.recall_mean], default_params=dict(default),
        coupled=method.coupled_heads, seconds=time.perf_counter() - t0, grid=grid_label,
        **_margin_fields(target, whole, picks))
    if log is not None:
        s = result.summary()
        print(f"  {method.name} layer {result.layer}: density {s['density']:.4f} (oracle {s['oracle']:.4f}, "
              f"x{s['ratio']:.2f}), recall {s['recall_mean']:.4f} / worst head {s['recall_min_head']:.4f}, "
              f"{s['dense_heads']} dense head(s), {result.seconds:.1f} s", file=log, flush=True)
    return result


def _measure_chosen(method: Any, spec: Any, picks: list[int | None], points: Sequence[Mapping[str, Any]],
                    dens: torch.Tensor, caps: Sequence[LayerCapture], truths: Sequence[Truth], target: Target, *,
                    impl: str, settle: bool) -> tuple[HeadStats, list[int | None], Any]:
    """The chosen layer config run as a whole: (its stats, picks, spec). For a method whose
    heads interact, heads the whole run does not serve move denser (`margins.settle_coupled`)."""
    if settle and method.coupled_heads and not isinstance(spec, list):
        from .margins import settle_coupled

        picks, spec, whole = settle_coupled(method, caps, truths, target, [dict(p) for p in points], picks, dens,
                                            impl=impl)
        return whole, picks, spec
    return measure_spec(method, spec, caps, truths, impl=impl), picks, spec


def _margin_fields(target: Target, whole: HeadStats, picks: Sequence[int | None]) -> dict[str, Any]:
    """`head_margin` and `kind_recall` of a `LayerResult` (`sparseprefill.margins`)."""
    from .margins import head_margins, kind_recall

    return {"head_margin": head_margins(target, whole, picks), "kind_recall": kind_recall(target, whole)}


def _short(params: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items())


def _default_and_oracle(method: Any, caps: Sequence[LayerCapture], truths: Sequence[Truth], *,
                        impl: str, share: float) -> tuple[dict[str, Any], Any, torch.Tensor]:
    """The method's default parameters at the captures' length, its per-head stats there,
    and the oracle's density at `share` per head (mean over the captures)."""
    default = method.demo_params(caps[0].seqlen)
    dstats = combine([plan_stats(t, method.plan_fn(impl)(c.q.float(), c.k.float(),
                                                          **method.call_params(default, c.q)), c.v)
                       for c, t in zip(caps, truths)])
    idx = list(truths[0].shares).index(share)
    oracle = torch.stack([t.oracle[..., idx].mean(0) for t in truths]).mean(0)
    return dict(default), dstats, oracle


def evaluate_layer(method: Any, spec: Any, caps: Sequence[LayerCapture], truths: Sequence[Truth], *,
                   impl: str = "reference", share: float = 0.95, kinds: Sequence[str] = ()) -> LayerResult:
    """A written layer config measured on (held-out) captures of that layer (`kinds`: the
    kind of each capture, for the per-kind recall)."""
    t0 = time.perf_counter()
    whole = measure_spec(method, spec, caps, truths, impl=impl)
    n = caps[0].seqlen
    default, dstats, oracle = _default_and_oracle(method, caps, truths, impl=impl, share=share)
    d, rm, rn, err = _head_lists(whole)
    dense = set(dense_heads_of(spec, int(caps[0].q.shape[1])))
    picks: list[int | None] = [None if h in dense else 0 for h in range(int(caps[0].q.shape[1]))]
    return LayerResult(
        method=method.name, layer=caps[0].layer, sources=[Path(c.source).name for c in caps], seqlen=n,
        spec=spec, picks=picks, chosen_params=[], density=d, recall_mean=rm, recall_min=rn, error=err,
        oracle=[float(x) for x in oracle], oracle_share=share,
        default_density=[float(x) for x in dstats.density],
        default_recall_mean=[float(x) for x in dstats.recall_mean], default_params=dict(default),
        coupled=method.coupled_heads, seconds=time.perf_counter() - t0,
        kind_recall=_margin_fields(_kinds_target(kinds), whole, picks)["kind_recall"])


def _kinds_target(kinds: Sequence[str]) -> Target:
    from .margins import SpreadTarget

    return SpreadTarget(kinds=tuple(kinds))


# -- per-head method choice (`--method headwise`) -----------------------------------------------


@dataclass
class HeadOption:
    """One head's best point of one candidate family, as measured on the calibration prompts.

    Attributes:
        family: index into the families searched.
        params: the head's choice, `{"method": name, **parameters}` (knobs as this head's value).
        block_m: the plan's query block (the unit the merged plan may have to refine to).
        density, recall_mean, recall_min: this head's numbers (mean over the prompts; worst row).
        block_pairs, column_pairs: its kept causal pairs through blocks / columns (batch rows
            summed, mean over the prompts): what the kernel reads.
    """

    family: int
    params: dict[str, Any]
    block_m: int
    density: float
    recall_mean: float
    recall_min: float
    block_pairs: float
    column_pairs: float


def headwise_families(method: Any, seqlen: int, given: Sequence[Mapping[str, Any]] | None = None
                  ) -> list[dict[str, Any]]:
    """The candidate families `--method headwise` searches: `given` (`--headwise-candidates`), else the
    descriptor's `head_candidates(N)`; each `{"method": name, **fixed parameters}`.

    Raises:
        ValueError: a family whose method is not one a head can take, or fixed parameters its
            method refuses.
    """
    from .config import METHOD, head_methods
    from .methods import METHODS

    families = [dict(f) for f in (given if given is not None else method.head_candidates(seqlen))]
    for i, fam in enumerate(families):
        name = fam.get(METHOD)
        if name not in head_methods() or name not in METHODS:
            raise ValueError(f"candidate {i}: method must be one of {', '.join(head_methods())}, got {name!r}")
        try:
            METHODS[name].check_params(family_grid(fam, seqlen)[0])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"candidate {i} ({name}): {exc}") from None
    return families


def family_grid(family: Mapping[str, Any], seqlen: int) -> list[dict[str, Any]]:
    """A family's points: its method's calibration grid at `seqlen` with the family's fixed
    parameters laid over every point (repeats dropped)."""
    from .config import METHOD
    from .methods import METHODS

    fixed = {k: v for k, v in family.items() if k != METHOD}
    _, points = calibration_grid(METHODS[family[METHOD]], seqlen)
    seen: set[str] = set()
    out = []
    for p in points:
        point = {**p, **fixed}
        key = json.dumps(point, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            out.append(point)
    return out


def _plan_pairs(plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept causal pairs per head (batch rows summed), float64 `[Hq]` each, through blocks / columns."""
    from .reference.dense_fallback import kept_pairs

    block, column = kept_pairs(plan)
    return block.sum(dim=0).to(torch.float64), column.sum(dim=0).to(torch.float64)


def _run_point(method: Any, params: Mapping[str, Any], caps: Sequence[LayerCapture], truths: Sequence[Truth],
               impl: str) -> tuple[HeadStats, torch.Tensor, torch.Tensor, int]:
    """One parameter point on every prompt of a layer: stats, mean kept pairs, the plan's block_m."""
    stats, blocks, columns = [], [], []
    block_m = 0
    for cap, truth in zip(caps, truths):
        q, k = cap.q.float(), cap.k.float()
        plan = method.plan_fn(impl)(q, k, **method.call_params(dict(params), q))
        stats.append(plan_stats(truth, plan, cap.v))
        b, c = _plan_pairs(plan)
        blocks.append(b)
        columns.append(c)
        block_m = plan.block_m
    return combine(stats), torch.stack(blocks).mean(0), torch.stack(columns).mean(0), block_m


def family_options(index: int, family: Mapping[str, Any], caps: Sequence[LayerCapture], truths: Sequence[Truth],
                   target: Target, *, impl: str = "reference", refine: int = 0, log: Any = None
                   ) -> list[HeadOption | None]:
    """Each head's cheapest point of one family that serves it (None: no point serves it).

    The family's grid is measured point by point (`family_grid`); with `refine` and a grid
    varying one float knob of its method, each head's knob is then bisected (`refine_heads`)
    and one more run measures every head at its own value. Cheapest: fewest kept pairs
    (the kernel work of the family's unit).
    """
    from .config import METHOD
    from .methods import METHODS

    method = METHODS[family[METHOD]]
    grid = family_grid(family, caps[0].seqlen)
    t0 = time.perf_counter()
    runs = []
    for i, params in enumerate(grid):
        runs.append(_run_point(method, params, caps, truths, impl))
        if log is not None:
            print(f"    headwise layer {caps[0].layer}: {_short(family)} point {i + 1}/{len(grid)} ({_short(params)}) "
                  f"at {time.perf_counter() - t0:.0f} s", file=log, flush=True)
    hq = int(caps[0].q.shape[1])
    serve = torch.stack([target.serves(r[0]) for r in runs])  # [G, Hq]

    def option(params: Mapping[str, Any], run: Any, h: int) -> HeadOption:
        stats, blocks, columns, block_m = run
        return HeadOption(index, {METHOD: method.name, **params}, block_m, float(stats.density[h]),
                          float(stats.recall_mean[h]), float(stats.recall_min[h]), float(blocks[h]),
                          float(columns[h]))

    out: list[HeadOption | None] = []
    for h in range(hq):
        ok = [g for g in range(len(grid)) if bool(serve[g, h])]
        g = min(ok, key=lambda g: float(runs[g][1][h] + runs[g][2][h])) if ok else None
        out.append(None if g is None else option(grid[g], runs[g], h))
    knob = bisect_knob(grid)
    if refine > 0 and knob in method_knobs(method) and any(o is not None for o in out):
        values, _ = refine_heads(method, caps, truths, target, grid, serve, steps=refine, impl=impl)
        top = max(float(p[knob]) for p in grid)
        per_head = [top if v is None else v for v in values]
        run = _run_point(method, {**grid[0], knob: per_head}, caps, truths, impl)
        served = target.serves(run[0])
        for h, value in enumerate(values):
            if value is not None and bool(served[h]):
                out[h] = option({**grid[0], knob: value}, run, h)
    return out


HEADWISE_OBJECTIVES = ("time", "density")


def choose_heads(options: Sequence[Sequence[HeadOption | None]], *, seqlen: int, batch: int, head_dim: int,
                 dtype: torch.dtype | str, rates: Any, objective: str = "time"
                 ) -> tuple[list[HeadOption | None], dict[str, Any]]:
    """Per head, the option of least modelled time, or dense when none beats dense.

    With `objective="density"` instead: per head the option of fewest kept pairs (the least
    kernel work, whatever the unit and the estimate cost), dense only where no option serves
    the head; the unit is then the finest query block chosen. The record prices either
    choice with the same model.

    A head's time is its kernel work at the rates of the merged plan's tile
    (`reference.headwise.head_kernel_ms`) plus its share of its method's estimate
    (`reference.headwise.estimate_ms`; a method without a measured estimate cost is no
    option); dense is the rule's dense time. The merged plan runs at the finest query
    block of its heads, so every query block size in use is tried as the layer's unit
    (options of coarser blocks priced at its tile): the unit of least total time wins.

    Args:
        options: `[family][head]` from `family_options`.
        seqlen, batch, head_dim, dtype, rates: the deployment the cost model prices.

    Returns:
        (each head's option, None for dense; a record of the costs per head and the unit).
    """
    from .reference.headwise import dense_ms, estimate_ms, head_kernel_ms

    if objective not in HEADWISE_OBJECTIVES:
        raise ValueError(f"objective must be one of {HEADWISE_OBJECTIVES}, got {objective!r}")
    hq = len(options[0]) if options else 0
    dense = dense_ms(seqlen=seqlen, batch=batch, head_dim=head_dim, dtype=dtype, rates=rates)
    units = sorted({o.block_m for fam in options for o in fam if o is not None})
    if objective == "density":
        least: list[HeadOption | None] = []
        for h in range(hq):
            served = [o for fam in options if (o := fam[h]) is not None]
            least.append(min(served, key=lambda o: o.block_pairs + o.column_pairs) if served else None)
        chosen = [o.block_m for o in least if o is not None]
        units = [math.gcd(*chosen)] if chosen else []
    best: tuple[float, int, list[HeadOption | None], list[float], list[float]] | None = None
    for unit in units or [0]:
        picks: list[HeadOption | None] = []
        kernel: list[float] = []
        estimate: list[float] = []
        total = 0.0
        for h in range(hq):
            pick, cost, k_ms, e_ms = None, dense, dense, 0.0
            if objective == "density":
                cost = math.inf
            for fam in options:
                o = fam[h]
                if o is None or unit == 0 or o.block_m % unit:
                    continue
                if objective == "density" and o is not least[h]:
                    continue
                e = estimate_ms(o.params["method"], o.params, seqlen=seqlen, batch=batch, head_dim=head_dim,
                                dtype=dtype, rates=rates)
                if e is None:
                    continue
                k = float(head_kernel_ms(torch.tensor([[o.block_pairs]]), torch.tensor([[o.column_pairs]]),
                                         seqlen=seqlen, tile=unit, head_dim=head_dim, dtype=dtype, rates=rates)[0])
                if k + e < cost:
                    pick, cost, k_ms, e_ms = o, k + e, k, e
            if pick is None:
                cost, k_ms, e_ms = dense, dense, 0.0
            picks.append(pick)
            kernel.append(k_ms)
            estimate.append(e_ms)
            total += cost
        if best is None or total < best[0]:
            best = (total, unit, picks, kernel, estimate)
    assert best is not None
    total, unit, picks, kernel, estimate = best
    record = {"objective": objective, "unit": unit, "dense_ms": dense, "kernel_ms": kernel, "estimate_ms": estimate,
              "total_ms": total, "dense_total_ms": dense * hq, "rates": getattr(rates, "device", ""), "dtype": str(dtype),
              "head_dim": head_dim, "methods": [None if p is None else p.params["method"] for p in picks]}
    return picks, record


def reuse_options(path: Path | str, layer: int, families: Sequence[Mapping[str, Any]]
                  ) -> list[list[HeadOption | None]]:
    """The options an earlier `--method headwise` run measured on one layer (its `--table` JSON),
    for `calibrate_headwise_layer(options=...)`.

    Raises:
        ValueError: the file has no headwise result for the layer, or searched other families.
    """
    data = json.loads(Path(path).read_text())
    for row in data.get("layers", []):
        record = row.get("headwise") or {}
        if int(row.get("layer", -1)) == layer and "options" in record:
            if json.dumps(record.get("families"), sort_keys=True) != json.dumps(list(families), sort_keys=True):
                raise ValueError(f"{path}: layer {layer} searched other families than this run")
            return [[None if o is None else HeadOption(**o) for o in fam] for fam in record["options"]]
    raise ValueError(f"{path}: no `--method headwise` result for layer {layer}")


def calibrate_headwise_layer(method: Any, caps: Sequence[LayerCapture], truths: Sequence[Truth], target: Target, *,
                         impl: str = "reference", share: float = 0.95, refine: int = 0,
                         families: Sequence[Mapping[str, Any]] | None = None, rates: Any = None,
                         dtype: torch.dtype | str = torch.bfloat16, objective: str = "time",
                         options: Sequence[Sequence[HeadOption | None]] | None = None,
                         log: Any = None) -> LayerResult:
    """`--method headwise` on one layer: every head the method, setting and unit of least modelled
    time that serves it (`family_options`, `choose_heads`), the layer's config a per-head list
    naming each head's method, measured as a whole (`headwise_plan`: one merged plan).

    Args:
        method: the `headwise` descriptor (its `head_candidates`).
        caps, truths, target, impl, share, refine, log: as `calibrate_layer`.
        families: the candidate families (default `headwise_families`).
        rates: the rates table of the cost model (default `reference.dense_fallback.DEFAULT_TABLE`).
        dtype: the deployment's dtype the rates are read at.
        objective: "time" (least modelled time) or "density" (fewest kept pairs): `choose_heads`.
        options: the families' options measured before on these prompts (`reuse_options`):
            the choice is made again (another objective or rates table) without measuring.

    Returns:
        The `LayerResult`; `chosen_params` names each head's method, `headwise` holds the costs.
    """
    from .reference.dense_fallback import DEFAULT_TABLE

    t0 = time.perf_counter()
    n = caps[0].seqlen
    fams = headwise_families(method, n, families)
    table = DEFAULT_TABLE if rates is None else rates
    if options is None:
        options = [family_options(i, fam, caps, truths, target, impl=impl, refine=refine, log=log)
                   for i, fam in enumerate(fams)]
    elif len(options) != len(fams):
        raise ValueError(f"{len(options)} families of options reused for {len(fams)} families")
    picks, record = choose_heads(options, seqlen=n, batch=int(caps[0].q.shape[0]), head_dim=int(caps[0].q.shape[3]),
                                 dtype=dtype, rates=table, objective=objective)
    spec = None if all(p is None for p in picks) else [None if p is None else dict(p.params) for p in picks]
    whole = measure_spec(method, spec, caps, truths, impl=impl)
    default, dstats, oracle = _default_and_oracle(method, caps, truths, impl=impl, share=share)
    d, rm, rn, err = _head_lists(whole)
    record["families"] = fams
    record["options"] = [[None if o is None else asdict(o) for o in fam] for fam in options]
    result = LayerResult(
        method=method.name, layer=caps[0].layer, sources=[Path(c.source).name for c in caps], seqlen=n,
        spec=spec, picks=[None if p is None else p.family for p in picks],
        chosen_params=[None if p is None else dict(p.params) for p in picks],
        density=d, recall_mean=rm, recall_min=rn, error=err, oracle=[float(x) for x in oracle],
        oracle_share=share, default_density=[float(x) for x in dstats.density],
        default_recall_mean=[float(x) for x in dstats.recall_mean], default_params=dict(default),
        seconds=time.perf_counter() - t0, grid="head_candidates", headwise=record)
    if log is not None:
        s = result.summary()
        took = ", ".join(f"{h}:{'dense' if p is None else _short(p.params)}" for h, p in enumerate(picks))
        print(f"  headwise layer {result.layer}: density {s['density']:.4f} (oracle {s['oracle']:.4f}, x{s['ratio']:.2f}), "
              f"recall {s['recall_mean']:.4f} / worst head {s['recall_min_head']:.4f}; modelled "
              f"{record['total_ms']:.4g} ms vs dense {record['dense_total_ms']:.4g} ms at unit {record['unit']}; "
              f"heads {took}", file=log, flush=True)
    return result


def format_table(results: Sequence[LayerResult], target: Target | None = None) -> str:
    """method x layer: density, oracle, ratio, recall mean / worst head / worst row, dense heads."""
    lines = ["| method | layer | density | oracle | ratio | recall mean | worst head | worst row | "
             "dense heads | default density | default recall / worst head | meets |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        s = r.summary()
        meets = ""
        if target is not None:
            ok = s["ratio"] <= 2.0 and s["recall_mean"] >= 0.95 and s["recall_min_head"] >= 0.85
            meets = "yes" if ok else "no"
        dd = "" if s["default_density"] is None else f"{s['default_density']:.4f}"
        dr = ("" if s["default_recall_mean"] is None
              else f"{s['default_recall_mean']:.3f} / {s['default_recall_min_head']:.3f}")
        lines.append(f"| {r.method}{' (whole)' if r.coupled else ''} | {r.layer} | {s['density']:.4f} | "
                     f"{s['oracle']:.4f} | {s['ratio']:.2f} | {s['recall_mean']:.4f} | {s['recall_min_head']:.4f} | "
                     f"{s['worst_row']:.3f} | {s['dense_heads']}/{s['heads']} | {dd} | {dr} | {meets} |")
    return "\n".join(lines)


def plot_heads(results: Sequence[LayerResult], path: Path, *, title: str = "") -> None:
    """Density per head before (the method's defaults) and after calibration, with the oracle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r.method for r in results))
    fig, axes = plt.subplots(len(methods), 1, figsize=(12, 2.6 * len(methods)), squeeze=False)
    for ax, name in zip(axes[:, 0], methods):
        rows = sorted((r for r in results if r.method == name), key=lambda r: r.layer)
        x0 = 0
        ticks, labels = [], []
        for r in rows:
            xs = list(range(x0, x0 + len(r.density)))
            ax.scatter(xs, r.default_density, marker="x", color="tab:gray", s=14,
                       label="default" if r is rows[0] else None)
            ax.scatter(xs, r.density, marker="o", color="tab:blue", s=12,
                       label="calibrated" if r is rows[0] else None)
            ax.scatter(xs, r.oracle, marker="_", color="tab:red", s=40,
                       label=f"oracle @ {r.oracle_share:g}" if r is rows[0] else None)
            ticks.append(x0 + len(xs) / 2 - 0.5)
            labels.append(str(r.layer))
            x0 += len(xs) + 1
        ax.set_yscale("log")
        ax.set_ylabel("density")
        ax.set_title(f"{name}: density per head, by layer", fontsize=9)
        ax.set_xticks(ticks, labels, fontsize=6)
        ax.legend(fontsize=7, loc="lower right")
    axes[-1, 0].set_xlabel("layer (heads side by side)")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- command line -------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `sparseprefill calibrate`."""
    parser.add_argument("--qkv", type=Path, nargs="+", default=None,
                        help="capture files from `sparseprefill eval capture` (calibration prompts, or the "
                             "held-out prompts with --eval), all of one kind; see --prompts for several kinds")
    add_prompt_arguments(parser)
    parser.add_argument("--method", nargs="+", default=None,
                        help="methods to calibrate (default: every plan-based method with a grid)")
    parser.add_argument("--eval", type=Path, nargs="+", default=None, metavar="CONFIG",
                        help="measure these written configs on --qkv instead of calibrating")
    parser.add_argument("--target-recall", type=float, default=0.95,
                        help="least mean recall of every head (default 0.95; negative: no bound)")
    parser.add_argument("--target-row-recall", type=float, default=None, help="least recall of any sampled row")
    parser.add_argument("--target-error", type=float, default=None, help="largest relative output error")
    parser.add_argument("--margin", type=float, default=0.0,
                        help="calibrate to the safe side: every recall bound + MARGIN (an error bound "
                             "- MARGIN) on the calibration prompts, so that held-out text still meets the "
                             "target (default 0; bisected configs otherwise land at the bound)")
    parser.add_argument("--granularity", choices=("head", "layer"), default="head",
                        help="one setting per head (default) or per layer (unserved heads dense either way)")
    parser.add_argument("--grid", type=json.loads, default=None,
                        help='JSON list of parameter dicts searched instead of the method\'s calibration grid '
                             '(one method only), e.g. \'[{"threshold": 0.9}, {"threshold": 0.95}]\'')
    parser.add_argument("--refine", type=int, default=0, metavar="STEPS",
                        help="after the grid, bisect each head's knob STEPS times between the grid points "
                             "around its pick (a grid varying one float knob; default 0: grid points only)")
    parser.add_argument("--refine-top", type=float, default=None, metavar="VALUE",
                        help="with --refine: the knob value tried for heads no grid point serves "
                             "(e.g. threshold 1.0); they are bisected from the grid's largest value")
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="captured layers to use (default all)")
    parser.add_argument("--max-seqlen", type=int, default=None, help="use only the first tokens of each capture")
    parser.add_argument("--rows", type=int, default=512, help="query rows sampled per layer (default 512)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--share", type=float, default=0.95, help="the oracle share compared with (default 0.95)")
    parser.add_argument("--backend", choices=("fast", "reference"), default="reference",
                        help="estimators (default reference: CPU)")
    parser.add_argument("--out-dir", type=Path, default=Path("calibrated"),
                        help="where <method>.json configs are written (default ./calibrated)")
    parser.add_argument("--table", type=Path, default=None,
                        help="write the table here (.md, and .json beside); each layer's result is written as "
                             "it finishes to the .jsonl beside it (without --table: <out-dir>/calibrate.jsonl "
                             "when calibrating)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the layers already in the .jsonl (a stopped run, same settings) and measure "
                             "only the others")
    parser.add_argument("--plot", type=Path, default=None, help="density per head before/after (PNG)")
    _add_headwise_arguments(parser)


def _add_headwise_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `--method headwise` (per-head method choice by modelled time)."""
    parser.add_argument("--headwise-candidates", type=json.loads, default=None, metavar="JSON",
                        help='with --method headwise: the families searched per head instead of the descriptor\'s, '
                             'a JSON list of {"method": name, fixed parameters...}, e.g. '
                             '\'[{"method": "xattention", "block": 64}]\'')
    parser.add_argument("--rates", type=Path, default=None,
                        help="with --method headwise: a rates table (`sparseprefill rates` JSON) for the cost model "
                             "(default: the break-even rule's default table, one H200)")
    parser.add_argument("--headwise-dtype", choices=("bfloat16", "float16"), default="bfloat16",
                        help="with --method headwise: the deployment dtype the rates are read at (default bfloat16)")
    parser.add_argument("--headwise-objective", choices=HEADWISE_OBJECTIVES, default="time",
                        help="with --method headwise: per head the least modelled time (default; dense where nothing "
                             "beats dense) or the fewest kept pairs (density; dense only where nothing serves)")
    parser.add_argument("--headwise-reuse", type=Path, default=None, metavar="TABLE_JSON",
                        help="with --method headwise: take each layer's measured options from an earlier headwise run's "
                             "--table JSON (same families and prompts) and only choose again (another objective, "
                             "--rates or --headwise-dtype), then measure the chosen config")


def _headwise_rates(args: argparse.Namespace) -> Any:
    """The rates table of the headwise cost model: `--rates`, else the default table."""
    from .reference.dense_fallback import DEFAULT_TABLE, RateTable

    if getattr(args, "rates", None) is None:
        return DEFAULT_TABLE
    return RateTable.from_json(json.loads(Path(args.rates).read_text()))


def _headwise_header(args: argparse.Namespace) -> dict[str, Any]:
    """The headwise settings that decide a layer's result (only when given, so other runs' headers
    stay as they were)."""
    out: dict[str, Any] = {}
    for key in ("headwise_candidates", "rates", "headwise_dtype", "headwise_objective", "headwise_reuse"):
        value = getattr(args, key, None)
        if value is not None and not (key, value) in (("headwise_dtype", "bfloat16"), ("headwise_objective", "time")):
            out[key] = str(value) if isinstance(value, Path) else value
    return out


def _describe_headwise(method: Any, seqlen: int, args: argparse.Namespace, *, log: bool) -> tuple[str, list[Any]]:
    """(grid label, the families) of a headwise run, printed with each family's grid size."""
    families = headwise_families(method, seqlen, args.headwise_candidates)
    if log:
        sizes = ", ".join(f"{_short(f)} ({len(family_grid(f, seqlen))})" for f in families)
        print(f"{method.name}: per head, the least modelled time over {len(families)} families (grid points): "
              f"{sizes}", file=sys.stderr, flush=True)
    return "head_candidates", families


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    """`--prompts` and what it needs: prompts of several kinds, per-head margins (`sparseprefill.prompts`,
    `sparseprefill.margins`)."""
    from .prompts import DEFAULT_HELDOUT, DEFAULT_PROMPTS, SOURCES

    names = ", ".join(f"{s.name} ({s.kind})" for s in SOURCES.values())
    parser.add_argument(
        "--prompts", nargs="*", default=None, metavar="KIND=SOURCE",
        help="prompts of several kinds of text; SOURCE: a capture file (*.pt), a text file, or a text source: "
             f"{names}. Text is captured with --model at --seqlen for --layers into --capture-dir (once). Alone: "
             f"{' '.join(f'{k}={v}' for k, v in DEFAULT_PROMPTS.items())} (with --eval: "
             f"{' '.join(f'{k}={v}' for k, v in DEFAULT_HELDOUT.items())}). Each head must reach the target plus its "
             "own margin max(--margin, --margin-spread x the spread of its number across kinds) on every kind")
    parser.add_argument("--margin-spread", type=float, default=1.0, metavar="C",
                        help="with --prompts: each head's margin is max(--margin, C x (max - min over the kinds of "
                             "its recall)) (default 1)")
    parser.add_argument("--model", choices=("smollm2", "gemma3-270m"), default="smollm2",
                        help="the model that captures --prompts text (default smollm2)")
    parser.add_argument("--seqlen", type=int, default=8192, help="tokens of each --prompts text (default 8192)")
    parser.add_argument("--capture-dir", type=Path, default=None,
                        help="where --prompts text captures go and are reused (default <out-dir>/captures)")
    parser.add_argument("--device", default="cpu", help="where the model runs for --prompts captures (default cpu)")


def _resolve_prompts(args: argparse.Namespace) -> dict[str, str]:
    """Turn `--prompts` into capture files (captured when text), appended to `args.qkv`.

    Returns:
        `{capture path: kind}` of every capture (a `--qkv` file: kind "", all one kind).
    """
    from .evaluate import DEFAULT_LAYERS, GEMMA3_LAYERS
    from .prompts import DEFAULT_HELDOUT, DEFAULT_PROMPTS, capture_prompts, parse_prompts

    kinds = {str(p): "" for p in args.qkv or []}
    prompts = parse_prompts(args.prompts, defaults=DEFAULT_HELDOUT if args.eval is not None else DEFAULT_PROMPTS)
    if not prompts and not kinds:
        raise ValueError("give the prompts: --qkv capture files, or --prompts KIND=SOURCE ...")
    if isinstance(args.margin_spread, bool) or not 0 <= args.margin_spread < math.inf:
        raise ValueError(f"--margin-spread must be a finite number >= 0, got {args.margin_spread}")
    if prompts:
        layers = args.layers or list(GEMMA3_LAYERS if args.model == "gemma3-270m" else DEFAULT_LAYERS)
        folder = args.capture_dir if args.capture_dir is not None else Path(args.out_dir) / "captures"
        paths = capture_prompts(prompts, model=args.model, seqlen=args.seqlen, layers=layers, folder=folder,
                                device=args.device, log=sys.stderr)
        args.prompt_list = [{"kind": p.kind, "source": p.source, "capture": str(path)}
                            for p, path in zip(prompts, paths)]
        args.qkv = [*(args.qkv or []), *paths]
        kinds.update({str(path): p.kind for p, path in zip(prompts, paths)})
    else:
        args.prompt_list = []
    return kinds


def _calibration_target(args: argparse.Namespace, target: Target) -> Target:
    """What the calibration prompts must meet: per-head spread margins with --prompts, else
    the global `--margin`."""
    if not args.prompt_list:
        return target.with_margin(args.margin)
    from .margins import SpreadTarget

    return SpreadTarget(recall=target.recall, row_recall=target.row_recall, error=target.error,
                        margin=args.margin, spread=args.margin_spread)


def _layer_target(target: Target, group: Sequence[LayerCapture], kinds: Mapping[str, str]) -> Target:
    """The calibration target of one layer: a spread target learns its prompts' kinds."""
    from .margins import SpreadTarget

    if isinstance(target, SpreadTarget):
        return target.for_kinds([kinds.get(c.source, "") for c in group])
    return target


def _prompt_meta(args: argparse.Namespace, results: Sequence[LayerResult]) -> dict[str, Any]:
    """The config's record of the prompts and each layer's per-head margins (`sparseprefill.config`)."""
    if not args.prompt_list:
        return {}
    return {"margin_spread": args.margin_spread, "prompts": args.prompt_list,
            "head_margins": {str(r.layer): r.head_margin for r in results if r.head_margin}}


def _check_held_out(config: CalibratedConfig, args: argparse.Namespace) -> None:
    """Say so when an --eval prompt is one the config was calibrated on (not held out)."""
    used = config.meta.get("prompts") or []
    mine = {(p["kind"], p["source"]) for p in args.prompt_list}
    seen = {str(p.get("kind")) for p in used if isinstance(p, dict)}
    same = sorted({kind for kind, _ in mine if kind in seen}
                  | {source for _, source in mine
                     if source in {str(p.get("source")) for p in used if isinstance(p, dict)}})
    if same:
        print(f"note: {config.method}: the --eval prompts share {', '.join(same)} with the config's calibration "
              "prompts: not a held-out kind", file=sys.stderr)


def _rows_file(args: argparse.Namespace) -> Path | None:
    """Where each layer's result is written as it finishes (see `--table`)."""
    if args.table is not None:
        return rows_path(args.table.with_suffix(".json"))
    if args.eval is None:
        return Path(args.out_dir) / "calibrate.jsonl"
    return None


def _header(args: argparse.Namespace, target: Target, impl: str) -> dict[str, Any]:
    """The settings that decide a layer's result (a resumed run must have the same)."""
    return {"command": "calibrate", "eval": [str(p) for p in args.eval or []], "target": asdict(target),
            "margin": args.margin, "granularity": args.granularity, "grid": args.grid, "refine": args.refine,
            "refine_top": args.refine_top, "rows": args.rows, "seed": args.seed, "share": args.share,
            "backend": impl, "captures": [str(p) for p in args.qkv], "layers": args.layers,
            "max_seqlen": args.max_seqlen, "prompts": args.prompt_list,
            "margin_spread": args.margin_spread if args.prompt_list else None, **_headwise_header(args)}


def _layer_result(row: Mapping[str, Any]) -> LayerResult:
    names = {f.name for f in fields(LayerResult)}
    return LayerResult(**{key: val for key, val in row.items() if key in names})


def run(args: argparse.Namespace) -> int:
    """Entry point of `sparseprefill calibrate`."""
    from .methods import METHODS

    impl = args.backend
    try:
        target = Target(recall=None if args.target_recall is not None and args.target_recall < 0
                        else args.target_recall,
                        row_recall=args.target_row_recall, error=args.target_error)
        kinds = _resolve_prompts(args)
        calib_target = _calibration_target(args, target)
        if args.rows < 1:
            raise ValueError(f"--rows must be >= 1, got {args.rows}")
        shares = tuple(sorted({*DEFAULT_SHARES, float(args.share)}))
        jobs: list[tuple[Any, CalibratedConfig | None]]
        if args.eval is not None:
            jobs = [(METHODS[c.method], c) for c in (read_config(path) for path in args.eval)]
        else:
            names = args.method or [m.name for m in METHODS.values() if calibratable(m)]
            for name in names:
                if name not in METHODS:
                    raise ValueError(f"unknown method {name!r}; registered: {', '.join(METHODS)}")
                if not calibratable(METHODS[name]) and METHODS[name].head_candidates is None:
                    raise ValueError(f"method {name!r} has no plan or no grid to calibrate"
                                     " (MInference: use `sparseprefill search`)")
            jobs = [(METHODS[name], None) for name in names]
            for name in names:
                if METHODS[name].head_candidates is not None:
                    headwise_families(METHODS[name], 4096, args.headwise_candidates)
            if args.grid is not None:
                if len(names) != 1:
                    raise ValueError("--grid needs exactly one --method")
                if not isinstance(args.grid, list) or not args.grid or not all(isinstance(p, dict) for p in args.grid):
                    raise ValueError(f"--grid must be a non-empty JSON list of parameter dicts, got {args.grid!r}")
                for point in args.grid:
                    METHODS[names[0]].check_params(point)
        rowlog = RowLog(_rows_file(args), _header(args, target, impl), resume=args.resume)
        for _, config in jobs:
            if config is not None:
                _check_held_out(config, args)
    except (TypeError, ValueError, OSError, RuntimeError) as err:
        print(f"sparseprefill calibrate: {err}", file=sys.stderr)
        return 2
    if impl == "fast" and not torch.cuda.is_available():
        from .demo import enable_interpreter

        enable_interpreter()
    caps = load_captures(args.qkv, layers=args.layers, max_seqlen=args.max_seqlen)
    by_layer: dict[int, list[LayerCapture]] = {}
    for cap in caps:
        by_layer.setdefault(cap.layer, []).append(cap)
    seqlen = by_layer[min(by_layer)][0].seqlen
    q_heads = int(by_layer[min(by_layer)][0].q.shape[1])
    print(f"{len(caps)} captured layer(s) from {len(args.qkv)} file(s); sampling {args.rows} rows per layer",
          file=sys.stderr, flush=True)
    done = {(r["method"], int(r["layer"])): _layer_result(r) for r in rowlog.of_kind("layer")}
    units = [(m.name, layer) for m, config in jobs for layer in sorted(by_layer)
             if config is None or layer in config.layers]
    progress = Progress(len(units), what="layer")
    progress.skip(sum(unit in done for unit in units))
    truths: dict[int, list[Truth]] = {}
    results: list[LayerResult] = []
    for method, config in jobs:
        layers: dict[int, Any] = {}
        grid_label, grid_points = calibration_grid(method, seqlen, args.grid)
        if method.head_candidates is not None:
            grid_label, grid_points = _describe_headwise(method, seqlen, args, log=config is None)
        elif config is None:
            print(f"{method.name}: {describe_grid(grid_label, grid_points, seqlen)}", file=sys.stderr, flush=True)
        meta = {"target": asdict(target), "margin": args.margin,
                "calibrated_to": asdict(target.with_margin(args.margin)),
                "granularity": args.granularity, "rows": args.rows, "seqlen": seqlen, "q_heads": q_heads,
                "backend": impl, "refine": args.refine, "refine_top": args.refine_top,
                "grid": {"source": grid_label, "seqlen": seqlen, "points": grid_points},
                "captures": sorted({Path(c.source).name for c in caps}),
                "coupled_heads": method.coupled_heads,
                "note": "layers absent from `layers` run SDPA (full attention)"}
        wanted = [layer for layer in sorted(by_layer) if config is None or layer in config.layers]
        for layer in wanted:
            group = by_layer[layer]
            res = done.get((method.name, layer))
            if res is None:
                if layer not in truths:
                    truths[layer] = layer_truths(group, args.rows, args.seed, shares)
                if config is not None:
                    res = evaluate_layer(method, config.layers[layer], group, truths[layer], impl=impl,
                                         share=args.share, kinds=[kinds.get(c.source, "") for c in group])
                elif method.head_candidates is not None:
                    fams = headwise_families(method, seqlen, args.headwise_candidates)
                    reused = None if args.headwise_reuse is None else reuse_options(args.headwise_reuse, layer, fams)
                    res = calibrate_headwise_layer(
                        method, group, truths[layer], _layer_target(calib_target, group, kinds), impl=impl,
                        share=args.share, refine=args.refine, families=fams, rates=_headwise_rates(args),
                        dtype=args.headwise_dtype, objective=args.headwise_objective, options=reused, log=sys.stderr)
                else:
                    res = calibrate_layer(method, group, truths[layer], _layer_target(calib_target, group, kinds),
                                          granularity=args.granularity,
                                          impl=impl, share=args.share, log=sys.stderr, grid=args.grid,
                                          refine=args.refine, refine_top=args.refine_top)
                rowlog.append({"kind": "layer", **asdict(res)})
                s = res.summary()
                progress.step(f"{method.name} layer {layer}: density {s['density']:.4f}, recall "
                              f"{s['recall_mean']:.4f} / worst head {s['recall_min_head']:.4f}")
            else:
                print(f"  {method.name} layer {layer}: read back from {rowlog.path}", file=sys.stderr)
            results.append(res)
            if config is None:
                layers[layer] = res.spec
                complete = len(layers) == len(wanted)
                mine = [r for r in results if r.method == method.name]
                path = write_config(Path(args.out_dir) / f"{method.name}.json",
                                    CalibratedConfig(method.name, layers,
                                                     {**meta, **_prompt_meta(args, mine), "complete": complete}))
                if complete:
                    print(f"wrote {path}", file=sys.stderr)
    table = format_table(results, target)
    print(table)
    if args.table is not None:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.with_suffix(".md").write_text(table + "\n")
        args.table.with_suffix(".json").write_text(json.dumps(
            {"target": asdict(target), "margin": 0.0 if args.eval is not None else args.margin,
             "rows": args.rows, "share": args.share, "backend": impl,
             "captures": [str(p) for p in args.qkv], "evaluated": [str(p) for p in args.eval or []],
             "summary": [r.summary() for r in results], "layers": [asdict(r) for r in results]}, indent=1))
    if args.plot is not None:
        plot_heads(results, args.plot)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparseprefill calibrate", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
