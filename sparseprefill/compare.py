"""`sparseprefill compare`: every registered method on the same attention, against the oracle.

For every registered method (or `--methods`) its main knob is swept over a documented
grid (`Method.sweep`, see docs/compare.md) and every point is measured the same
way:

* density: score entries the method computes over the causal area (the executed
  plan's, or both Delta-KV phases');
* recall: the full-attention mass kept per row, mean over rows, then mean and min
  over heads (methods that change the keys, Delta-KV, have none);
* output error: `||out - exact|| / ||exact||` in float64;
* timed (`--seqlen`, on a GPU): end-to-end, estimate+plan and kernel times (median of
  `time_call`'s repeats), speedup against cuDNN SDPA in the same run.

The oracle (`sparseprefill.oracle`) gives, per query row, the fewest keys holding a
share of the mass: its density at each share is the frontier no method can beat; on a
capture every point also gets the oracle's density at exactly its own mean recall.
Output: a markdown table, JSON, and two plots (recall vs density with every method's
Pareto frontier and the oracle; speedup vs recall, with the oracle's floor, when timed).

Two inputs:

* a capture (`--qkv FILE`, no `--seqlen`): every captured layer, the reference backend on
  a CPU; exact float64 output, the recall of a layer's plans from one pass
  (`plan_recalls`);
* timed (`--seqlen N`): the demo's synthetic workload, the calibrated one
  (`--workload calibrated`) or a capture's layers as the batch (`--qkv`); the output
  error is against our dense plan's kernel (float64 dense attention does not fit at
  128K), the recall exact (`fast.recall`), the oracle from the last 4096 rows.

Long runs report as they go: with `--json PATH` every row is written to `PATH` with
suffix `.jsonl` the moment it is measured (a timed point as soon as it is timed, a
captured layer's points when its recall pass ends), each step prints the time spent and
an estimate of the time left, and `--resume` skips what the `.jsonl` holds. The timed
path plans once per point and times each part with `time_call`: a warm call (whose
result is used: the plan, the output) then repeats until their spread is small or a
time budget is spent, so a 5 ms call is timed about 5 times and a 200 ms one twice; each
row records its repeats and spread (`timing`) and the seconds of each stage (`stage_s`),
and the run ends with where its time went (`time_summary`).

The evidence of the method pages (docs/<method>.md) comes from options read from the
descriptors (`sparseprefill.methods`):

* `--ablations`: every method's `Method.ablations` grids beside its sweep (a paper's
  ablations, wider grids, a yardstick's budget grid), each point labelled with its grid;
  `Method.extras` adds the method's own numbers (scoring ratio, keep ratio, ...);
* `--yardstick METHOD[:LABEL]`: beside every other point, METHOD's recall and output
  error at the same density, interpolated between the two of its points (of grid LABEL)
  whose densities bracket it (e.g. `vertical_slash:x4`, vertical-slash at equal density);
* `--block-oracle B ...`: beside every point, the best plan of whole `B x B` cells at
  its recall (what block granularity alone costs, `oracle.block_oracle_density`);
* `--calibrate R ...`: per-head calibration of every grid: per (batch, head) the least
  dense point of the grid whose recall on that head reaches R, then the mean density,
  recall and the oracle's density at R (calibrated on the evaluated data itself: an
  optimistic bound of what an offline calibration reaches);
* `--equal-recall R ...`: per method the setting that reaches mean recall R at the least
  end-to-end time (untimed: the least density); timed, only those settings are timed
  (every point still measured for density and recall), which makes a run much shorter;
* `--equal-density`: the first of `--methods` runs its sweep; every other method runs at
  the value of its sweep's knob whose density is closest to each of those points
  (bisection, `match_density`), and a table sets each pair side by side (MInference's
  comparison of vertical-slash with A-shape at equal density).

    sparseprefill compare --qkv out/qkv_smollm2_8k.pt --json compare.json --png compare.png
    sparseprefill compare --seqlen 32768 --workload calibrated --device cuda --json c32k.json
    sparseprefill compare --seqlen 131072 --device cuda --equal-recall 0.9 0.95 --json er.json
    sparseprefill compare --qkv out/qkv_smollm2_8k.pt --methods vertical_slash a_shape --equal-density
    sparseprefill compare --qkv out/qkv_smollm2_8k.pt --methods xattention dpxa vertical_slash \
        --ablations --yardstick vertical_slash:x4 --calibrate 0.9 0.95 --json xattention.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .methods import METHODS, Method, MethodView
from .methods._core import PlanFn
from .oracle import block_oracle_density, oracle_density
from .runlog import Progress, RowLog, duration, rows_path

DEFAULT_SHARES = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)
EQUAL_DENSITY = "equal density"


@dataclass
class Point:
    """One measured (method, parameters, input) point."""

    method: str
    params: dict[str, Any]
    source: str
    seqlen: int
    density: float
    recall_mean: float | None
    recall_min: float | None
    output_error: float | None
    seconds: float
    gpu: dict[str, float] = field(default_factory=dict)
    label: str = ""
    density_per_head: list[float] = field(default_factory=list)
    recall_per_head: list[float] = field(default_factory=list)
    extras: dict[str, float] = field(default_factory=dict)
    oracle_density_at_recall: float | None = None
    yardsticks: dict[str, dict[str, float | None]] = field(default_factory=dict)
    block_oracle: dict[str, float] = field(default_factory=dict)
    timing: dict[str, dict[str, float]] = field(default_factory=dict)
    stage_s: dict[str, float] = field(default_factory=dict)
    matches: str = ""

    @property
    def series(self) -> str:
        """The method, with its ablation grid's label if any (`xattention [naive s4]`)."""
        return f"{self.method} [{self.label}]" if self.label else self.method


def point_key(source: str, method: str, label: str, params: Mapping[str, Any]) -> str:
    """The identity of a point in a run (source, method, grid label and the parameters as
    the grid gives them, before `Method.prepare`), the same after a JSON round trip: the
    rows file stores it, `--resume` skips the points it names."""
    return json.dumps([source, method, label, _plain(params)], sort_keys=True)


def _plain(value: Any) -> Any:
    """JSON-ready: tuples as lists, other objects (MInference's patterns) as text."""
    return json.loads(json.dumps(value, default=str))


def point_from_row(row: Mapping[str, Any]) -> Point:
    """A `Point` from its JSON row (unknown keys ignored)."""
    names = {f.name for f in fields(Point)}
    return Point(**{key: val for key, val in row.items() if key in names})


@dataclass
class Calibrated:
    """Per-head calibration of one grid at one target recall (`--calibrate`)."""

    source: str
    method: str
    label: str
    target: float
    params_per_head: list[dict[str, Any]]
    density: float
    recall_mean: float
    recall_min: float
    oracle_density_at_target: float | None = None
    yardsticks: dict[str, dict[str, float | None]] = field(default_factory=dict)
    extras: dict[str, float] = field(default_factory=dict)


Grid = tuple[str, PlanFn | None, list[dict[str, Any]]]


def sweep(spec: Method, seqlen: int) -> list[dict[str, Any]]:
    """The method's knob grid at length N (`Method.sweep`, else its defaults)."""
    return spec.sweep_params(seqlen)


def unique_points(points: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`points` without repeats (at short N a sweep's clamps give equal points), in order."""
    seen: set[str] = set()
    out = []
    for p in points:
        key = json.dumps(_plain(p), sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(dict(p))
    return out


def grids(spec: Method, seqlen: int, *, ablations: bool = False) -> list[Grid]:
    """`(label, plan function or None, params)` of every grid to measure: the sweep (label
    ""), then with `ablations` every `Method.ablations` grid."""
    out: list[Grid] = [("", None, sweep(spec, seqlen))]
    if ablations:
        out += [(a.label, a.reference_plan, [dict(p) for p in a.grid(seqlen)]) for a in spec.ablations]
    return out


def measure(
    spec: Method,
    params: Mapping[str, Any],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    exact: torch.Tensor | None,
    *,
    backend: str,
    scale: float | None,
    source: str,
    label: str = "",
    plan_fn: PlanFn | None = None,
    pending: list[tuple[Point, Any]] | None = None,
) -> Point:
    """Density, recall, output error and the method's extras of one method call (see the
    module doc); `plan_fn` replaces the method's estimator (an `Ablation`'s own plan).

    `exact` None skips the output (no error). With `pending`, a plan-based point's recall
    is left to `fill_recalls` (one pass over the attention for all of a layer's plans):
    `(point, plan)` is appended.
    """
    from . import fast, reference

    start = time.perf_counter()
    params = spec.call_params(params, q)
    impl: Any = fast if backend == "fast" else reference
    deferred = pending is not None and (plan_fn is not None or (spec.plan_based and spec.view is None))
    out = None
    if plan_fn is None:
        if exact is not None:
            out = spec.run_fn(backend)(q, k, v, **params, scale=scale)
        view = spec.method_view(backend, q, k, v, params, scale=scale, with_recall=not deferred)
    else:
        plan = plan_fn(q, k, **params)
        if exact is not None:
            out = impl.sparse_attention(q, k, v, plan, scale=scale)
        recall = None if deferred else impl.recall(q, k, plan, scale=scale)
        view = MethodView(density=impl.density(plan), recall=recall, plan=plan)
    per_head = None if view.recall is None else view.recall.double().mean(dim=-1)
    extras = {} if spec.extras is None else spec.extras(backend, q, k, v, params, view)
    point = Point(
        method=spec.name, params=params, source=source, seqlen=int(q.shape[2]),
        density=float(view.density.mean()),
        recall_mean=None if per_head is None else float(per_head.mean()),
        recall_min=None if per_head is None else float(per_head.min()),
        output_error=None if out is None or exact is None else reference.relative_error(out, exact),
        seconds=time.perf_counter() - start, label=label,
        density_per_head=[float(x) for x in view.density.double().flatten()],
        recall_per_head=[] if per_head is None else [float(x) for x in per_head.flatten()],
        extras=extras,
    )
    if deferred:
        assert pending is not None
        pending.append((point, view.plan))
    return point


def plan_recalls(q: torch.Tensor, k: torch.Tensor, plans: Sequence[Any], *,
                 scale: float | None) -> list[torch.Tensor]:
    """`reference.recall` of many plans (float64 `[B, Hq, N]` each) from one float64 pass over
    the causal softmax, chunked over query rows: the probabilities are computed once per
    chunk for all plans (the same sums as `reference.recall`, which recomputes them per plan).
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    sm = d ** -0.5 if scale is None else float(scale)
    # Per plan, the kept keys of each query block: bool [B, Hq, Qb, N].
    kept = [(p.block_mask().repeat_interleave(p.block_n, dim=3)[..., :n] | p.column_mask()[..., :n], p.block_m)
            for p in plans]
    out = [torch.empty(b, hq, n, dtype=torch.float64, device=q.device) for _ in plans]
    qg = q.reshape(b, hkv, g, n, d).to(torch.float64)
    kg = k.to(torch.float64).unsqueeze(2)
    chunk = max(1, min(n, 2**24 // max(1, b * hq * n)))
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        rows = torch.arange(start, stop, device=q.device)
        causal = torch.arange(stop, device=q.device)[None, :] <= rows[:, None]
        scores = torch.matmul(qg[..., start:stop, :], kg[..., :stop, :].transpose(-1, -2)) * sm
        probs = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1).reshape(b, hq, stop - start, stop)
        for (cols, block_m), dest in zip(kept, out):
            keep = cols[:, :, rows // block_m, :stop] & causal
            dest[:, :, start:stop] = (probs * keep).sum(dim=-1)
    return out


def fill_recalls(q: torch.Tensor, k: torch.Tensor, pending: Sequence[tuple[Point, Any]], *,
                 scale: float | None) -> None:
    """Set the recall of every deferred point (`measure(..., pending=)`) from one pass."""
    if not pending:
        return
    started = time.perf_counter()
    recalls = plan_recalls(q, k, [plan for _, plan in pending], scale=scale)
    spent = (time.perf_counter() - started) / len(pending)
    for (point, _), recall in zip(pending, recalls):
        per_head = recall.to(torch.float32).double().mean(dim=-1)  # rows in float32, as reference.recall
        point.recall_mean, point.recall_min = float(per_head.mean()), float(per_head.min())
        point.recall_per_head = [float(x) for x in per_head.flatten()]
        point.seconds += spent


def oracle_points(q: torch.Tensor, k: torch.Tensor, *, scale: float | None, source: str,
                  shares: Sequence[float] = DEFAULT_SHARES) -> list[Point]:
    """The oracle at each share: its density, with recall = the share (every row reaches it)."""
    dens = oracle_density(q, k, shares, scale=scale)  # [B, Hq, S]
    return [Point(method="oracle", params={"share": s}, source=source, seqlen=int(q.shape[2]),
                  density=float(dens[..., i].mean()), recall_mean=s, recall_min=s, output_error=None,
                  seconds=0.0)
            for i, s in enumerate(shares)]


@dataclass(frozen=True)
class DensityPath:
    """How `match_density` moves a method's density: one number `t` mapped to parameters.

    Attributes:
        knobs: the parameters that move (the ones the method's sweep varies).
        base: the sweep's other parameters.
        lo, hi: the range of `t`.
        integer: the knobs are ints (rounded).
        start: the knobs' values at `t = 1` when several int knobs scale together.
    """

    knobs: tuple[str, ...]
    base: dict[str, Any]
    lo: float
    hi: float
    integer: bool
    start: tuple[float, ...] = ()

    def params(self, t: float) -> dict[str, Any]:
        """The parameters at `t`."""
        if self.start:  # several int knobs, scaled together from the sweep's first point
            return {**self.base, **{k: max(1, int(round(x * t))) for k, x in zip(self.knobs, self.start)}}
        value: float | int = int(round(t)) if self.integer else t
        return {**self.base, **{k: value for k in self.knobs}}


def density_path(spec: Method, seqlen: int) -> DensityPath:
    """The parameters `match_density` searches, from what the method's sweep varies:

    * one numeric knob, or several float knobs equal at every point (SampleAttention's
      alpha_c = alpha_s): an int from 1 to N, a float between the sweep's least and
      largest value;
    * several int knobs (vertical-slash's budgets): scaled together from the sweep's
      first point, keeping their ratio, from the least scale that keeps each >= 1 up to N.

    Raises:
        ValueError: a sweep that varies nothing numeric, or several knobs neither tied nor int.
    """
    def varying_keys(points: Sequence[Mapping[str, Any]]) -> list[str]:
        keys = list(dict.fromkeys(key for p in points for key in p))
        return [key for key in keys if len({json.dumps(_plain(p.get(key))) for p in points}) > 1]

    points = sweep(spec, seqlen)
    # At short N the sweep's clamps can make every point equal: its knobs are the ones it varies at long N.
    varying = varying_keys(points) or varying_keys(sweep(spec, max(seqlen, 65536)))
    values = {key: [p.get(key) for p in points] for key in varying}
    numeric = all(isinstance(x, (int, float)) and not isinstance(x, bool) for xs in values.values() for x in xs)
    if not varying or not numeric:
        raise ValueError(f"--equal-density: {spec.name}'s sweep varies {varying or 'no parameter'}; matching a "
                         "density needs numeric knobs")
    base = {key: val for key, val in points[0].items() if key not in varying}
    integer = all(isinstance(x, int) for xs in values.values() for x in xs)
    tied = all(len({p.get(key) for key in varying}) == 1 for p in points)
    if len(varying) == 1 or tied:
        if integer:
            return DensityPath(tuple(varying), base, 1.0, float(seqlen), True)
        flat = [float(x) for x in values[varying[0]] if x is not None]
        return DensityPath(tuple(varying), base, min(flat), max(flat), False)
    if not integer:
        raise ValueError(f"--equal-density: {spec.name}'s sweep varies {varying} apart; matching a density needs "
                         "one knob, tied knobs, or int budgets")
    start = tuple(float(points[0][key]) for key in varying)
    return DensityPath(tuple(varying), base, 1.0 / min(start), seqlen / max(start), True, start)


def match_density(spec: Method, q: torch.Tensor, k: torch.Tensor, target: float, *, backend: str,
                  steps: int = 16, scale: float | None = None) -> dict[str, Any]:
    """The parameters of `spec` (along `density_path`) whose plan's density on (q, k) is
    closest to `target`: bisection, density growing along the path (its ends measured
    first: a target outside their densities takes the nearer end).

    Raises:
        ValueError: a method without a plan, or one `density_path` refuses.
    """
    from . import fast, reference

    if not spec.plan_based:
        raise ValueError(f"--equal-density: {spec.name} has no plan to match a density with")
    impl: Any = fast if backend == "fast" else reference
    path = density_path(spec, int(q.shape[2]))
    extra = {} if scale is None or "scale" not in spec.parameters() else {"scale": scale}

    def dens(t: float) -> float:
        params = spec.call_params({**path.params(t), **extra}, q)
        return float(impl.density(spec.plan_fn(backend)(q, k, **params)).mean())

    lo, hi = path.lo, path.hi
    tried = {lo: dens(lo), hi: dens(hi)}
    for _ in range(steps):
        if path.integer and not path.start and hi - lo <= 1:
            break
        mid = (lo + hi) / 2
        if path.integer and not path.start:
            mid = float(int(mid))
        tried[mid] = d = dens(mid)
        if d < target:
            lo = mid
        else:
            hi = mid
    best = min(tried, key=lambda t: (abs(tried[t] - target), t))
    return path.params(best)


def compare_capture(
    data: Mapping[str, Any],
    methods: Sequence[str],
    *,
    backend: str = "reference",
    device: str = "cpu",
    max_seqlen: int | None = None,
    shares: Sequence[float] = DEFAULT_SHARES,
    log: Callable[[str], None] = print,
    layers: Sequence[int] | None = None,
    ablations: bool = False,
    yardsticks: Sequence[str] = (),
    calibrate: Sequence[float] = (),
    calibrated: list[Calibrated] | None = None,
    output_error: bool = True,
    block_oracles: Sequence[int] = (),
    equal_density: bool = False,
    rows: RowLog | None = None,
) -> list[Point]:
    """Every method's sweep (and with `ablations` its ablation grids) and the oracle on each
    captured layer (see `sparseprefill eval capture`); `layers` picks captured layers.

    Every point also gets the oracle's density at its own mean recall and, for each
    `yardsticks` entry, that method's recall and error at its density; with `calibrate`,
    the per-head calibration of every grid is appended to `calibrated` (module doc).
    The recall of plan-based points comes from one pass per layer (`plan_recalls`);
    `output_error=False` skips every method's output (no error column, much faster).
    For each size in `block_oracles`, every point also gets the density of the best plan
    of whole `block x block` cells at its recall (`oracle.block_oracle_density`). With
    `equal_density`, the methods after the first run at the densities of the first's
    points (`match_density`) instead of their sweeps.

    `rows`: each layer's points (and calibrations) are appended when the layer is done,
    then a `layer_done` row; a layer whose `layer_done` row is already there (a resumed
    run) is read back instead of measured.
    """
    from . import reference

    dtype = torch.float16 if backend == "fast" else torch.float32
    captured = [int(x) for x in data["layers"]]
    missing = sorted(set(layers or ()) - set(captured))
    if missing:
        raise ValueError(f"layers {missing} are not in the capture (it has {captured})")
    targets = [float(t) for t in calibrate]
    if any(not 0.0 < t <= 1.0 for t in targets):
        raise ValueError(f"calibrate targets must lie in (0, 1], got {targets}")
    wanted = [parse_yardstick(y, methods) for y in yardsticks]
    if equal_density:
        if len(methods) < 2:
            raise ValueError("--equal-density needs two or more --methods (the first one's points are matched)")
        for name in methods[1:]:
            density_path(METHODS[name], 1024)
    chosen = [(i, int(layer)) for i, layer in enumerate(data["layers"]) if layers is None or int(layer) in layers]
    done_layers = set() if rows is None else {str(r["source"]) for r in rows.of_kind("layer_done")}

    def grid_size(name: str, n: int) -> int:
        first = METHODS[methods[0]]
        if equal_density and name != methods[0]:
            return len(unique_points(sweep(first, n)))
        return sum(len(g) for _, _, g in grids(METHODS[name], n, ablations=ablations))

    def length(i: int) -> int:
        n = int(data["q"][i].shape[2])
        return n if max_seqlen is None else min(n, max_seqlen)

    progress = Progress(sum(grid_size(name, length(i)) for i, _ in chosen for name in methods), what="point")
    points: list[Point] = []
    for i, layer in chosen:
        source = f"layer {layer}"
        if source in done_layers:
            assert rows is not None
            back = [point_from_row(r) for r in rows.of_kind("point") if r["source"] == source]
            if calibrated is not None:
                names = {f.name for f in fields(Calibrated)}
                calibrated += [Calibrated(**{key: val for key, val in r.items() if key in names})
                               for r in rows.of_kind("calibrated") if r["source"] == source]
            progress.skip(sum(grid_size(name, length(i)) for name in methods))
            log(f"{source}: {len(back)} points read back from {rows.path}")
            points += back
            continue
        q, k, v, scale = data["q"][i], data["k"][i], data["v"][i], data["scale"][i]
        q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
        if max_seqlen is not None:
            q, k, v = (t[:, :, :max_seqlen] for t in (q, k, v))
        n = int(q.shape[2])
        exact = reference.attention(q.double(), k.double(), v.double(), scale=scale) if output_error else None
        oracle_pts = oracle_points(q, k, scale=scale, source=source, shares=shares)
        mine: list[Point] = []
        pending: list[tuple[Point, Any]] = []
        # A point of two grids (a wide grid containing the sweep) is measured once and copied.
        copies: list[tuple[Point, int, str]] = []

        def one(spec: Method, params: dict[str, Any], label: str, plan_fn: PlanFn | None) -> Point:
            waiting = len(pending)
            point = measure(spec, params, q, k, v, exact, backend=backend, scale=scale,
                            source=source, label=label, plan_fn=plan_fn, pending=pending)
            progress.step(f"{source} {point.series} {_short(params)}: density {point.density:.4f} recall "
                          f"{'deferred' if len(pending) > waiting else _fmt(point.recall_mean)} error "
                          f"{_fmt(point.output_error, '.3e')} ({point.seconds:.1f} s)")
            return point

        for name in methods:
            spec = METHODS[name]
            if equal_density and name != methods[0]:
                partners = {json.dumps(_plain(p.params), sort_keys=True): p
                            for p in mine if p.method == methods[0] and not p.label}
                for partner in partners.values():
                    params = match_density(spec, q, k, partner.density, backend=backend)
                    point = one(spec, params, EQUAL_DENSITY, None)
                    point.matches = f"{partner.method} {_short(partner.params)}"
                    mine.append(point)
                continue
            done: dict[str, Point] = {}
            for label, plan_fn, grid in grids(spec, n, ablations=ablations):
                for params in grid:
                    key = repr((id(plan_fn), sorted(params.items())))
                    if key in done:
                        copies.append((done[key], len(mine), label))
                        progress.step(f"{source} {spec.name}{f' [{label}]' if label else ''} {_short(params)}: "
                                      f"the same point as {done[key].series}'s")
                        point = done[key]
                    else:
                        point = one(spec, params, label, plan_fn)
                        done[key] = point
                    mine.append(point)
        started = time.perf_counter()
        fill_recalls(q, k, pending, scale=scale)
        log(f"{source}: recall of {len(pending)} plans in one pass, {time.perf_counter() - started:.0f} s")
        for original, index, copy_label in copies:
            mine[index] = Point(**{**asdict(original), "label": copy_label})
        oracle = exact_oracle(q, k, [p.recall_mean for p in mine if p.recall_mean is not None] + targets,
                              scale=scale)
        for p in mine:
            p.oracle_density_at_recall = None if p.recall_mean is None else oracle[_share(p.recall_mean)]
        recalls = sorted({_share(p.recall_mean) for p in mine if p.recall_mean is not None})
        for size in block_oracles if recalls else ():
            best = block_oracle_density(q, k, recalls, block=size, scale=scale).mean(dim=(0, 1)).tolist()
            by_share = dict(zip(recalls, best))
            for p in mine:
                if p.recall_mean is not None:
                    p.block_oracle[str(size)] = by_share[_share(p.recall_mean)]
        for method, grid_label in wanted:
            add_yardstick(mine, method, grid_label)
        mine_calibrated: list[Calibrated] = []
        if calibrated is not None:
            for target in targets:
                mine_calibrated += calibrate_grids(mine, target, oracle[_share(target)], wanted)
            calibrated += mine_calibrated
        if rows is not None:
            for p in oracle_pts + mine:
                rows.append({"kind": "point", **asdict(p)})
            for c in mine_calibrated:
                rows.append({"kind": "calibrated", **asdict(c)})
            rows.append({"kind": "layer_done", "source": source})
        points += oracle_pts + mine
    return points


def _short(params: Mapping[str, Any]) -> str:
    """Parameters in a log line (a long value, MInference's patterns, cut short)."""
    text = ", ".join(f"{k}={v}" for k, v in params.items())
    return text if len(text) <= 120 else text[:117] + "..."


def _share(recall: float) -> float:
    """The oracle share standing for a recall: the recall itself, clipped to [0, 1] (not
    rounded: near 1, a share rounded up by 5e-7 can cost many keys)."""
    return min(1.0, max(0.0, recall))


def exact_oracle(q: torch.Tensor, k: torch.Tensor, recalls: Sequence[float], *,
                 scale: float | None) -> dict[float, float]:
    """The oracle's density (mean over batch and heads) at each recall, keyed by `_share`."""
    wanted = sorted({_share(r) for r in recalls})
    out: dict[float, float] = {}
    for i in range(0, len(wanted), 32):  # 32 shares per pass bound the pass's memory
        part = wanted[i:i + 32]
        dens = oracle_density(q, k, part, scale=scale).mean(dim=(0, 1))
        out.update({s: float(d) for s, d in zip(part, dens)})
    return out


def parse_yardstick(text: str, methods: Sequence[str]) -> tuple[str, str | None]:
    """`METHOD[:LABEL]` -> (method, label or None: all its points).

    Raises:
        ValueError: the method is not compared in this run, or has no such grid.
    """
    method, _, label = text.partition(":")
    if method not in methods:
        raise ValueError(f"yardstick {text!r}: method {method!r} is not among the compared methods {list(methods)}")
    labels = [""] + [a.label for a in METHODS[method].ablations]
    if label and label not in labels:
        raise ValueError(f"yardstick {text!r}: {method} has no grid {label!r} (grids: {labels[1:]})")
    return method, label or None


def yardstick_name(method: str, label: str | None) -> str:
    return method if label is None else f"{method}:{label}"


def interpolate(x: float, xs: Sequence[float], ys: Sequence[float | None]) -> float | None:
    """Linear interpolation of `ys` at `x` on the points `(xs, ys)`; None outside their range
    or where a bracketing point has no value."""
    pts = sorted((a, b) for a, b in zip(xs, ys) if b is not None)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def at_density(curve: Sequence[Point], density: float) -> dict[str, float | None]:
    """A yardstick's recall (mean, min) and output error at `density`, from its points."""
    xs = [p.density for p in curve]
    return {"density": density,
            "recall_mean": interpolate(density, xs, [p.recall_mean for p in curve]),
            "recall_min": interpolate(density, xs, [p.recall_min for p in curve]),
            "output_error": interpolate(density, xs, [p.output_error for p in curve])}


def add_yardstick(points: Sequence[Point], method: str, label: str | None) -> None:
    """Set `yardsticks[name]` of every point not on the yardstick's own curve."""
    curve = [p for p in points if p.method == method and (label is None or p.label == label)]
    name = yardstick_name(method, label)
    for p in points:
        if p.method != method:
            p.yardsticks[name] = at_density(curve, p.density)


def calibrate_grids(points: Sequence[Point], target: float, oracle: float | None,
                    yardsticks: Sequence[tuple[str, str | None]] = ()) -> list[Calibrated]:
    """Per-head calibration of every (method, grid) of one source at recall `target`.

    Per (batch, head): the grid point of least density on that head whose recall on that
    head reaches `target`; none reaches it: the point of highest recall on that head.
    Grids without per-head recall (methods that change the keys) are left out.
    """
    out: list[Calibrated] = []
    by: dict[tuple[str, str], list[Point]] = {}
    for p in points:
        if p.recall_per_head:
            by.setdefault((p.method, p.label), []).append(p)
    for (method, label), grid in by.items():
        heads = len(grid[0].recall_per_head)
        picks = []
        for h in range(heads):
            ok = [p for p in grid if p.recall_per_head[h] >= target]
            pick = (min(ok, key=lambda p: p.density_per_head[h]) if ok
                    else max(grid, key=lambda p: p.recall_per_head[h]))
            picks.append((pick, pick.recall_per_head[h], pick.density_per_head[h]))
        density = sum(d for _, _, d in picks) / heads
        extras = {key: sum(p.extras.get(key, 0.0) for p, _, _ in picks) / heads
                  for key in grid[0].extras}
        out.append(Calibrated(
            source=grid[0].source, method=method, label=label, target=target,
            params_per_head=[p.params for p, _, _ in picks], density=density,
            recall_mean=sum(r for _, r, _ in picks) / heads, recall_min=min(r for _, r, _ in picks),
            oracle_density_at_target=oracle, extras=extras,
            yardsticks={yardstick_name(m, lab): at_density(
                [p for p in points if p.method == m and p.source == grid[0].source
                 and (lab is None or p.label == lab)], density)
                for m, lab in yardsticks if m != method}))
    return out


# -- timed points ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """One timed call: the median of its repeats, in ms.

    Attributes:
        ms: median of the repeats.
        spread: (75th - 25th percentile) / median of the repeats (0 with fewer than 3).
        reps: repeats timed (the warm call not counted).
        first_ms: the warm call (compilation included on its first run).
    """

    ms: float
    spread: float
    reps: int
    first_ms: float


TIME_BUDGET_S = 0.2
TIME_SPREAD = 0.05
TIME_MIN_REPS = 5
TIME_MAX_REPS = 25
_FLUSH_BYTES = 256 << 20


def _spread(samples: Sequence[float]) -> float:
    if len(samples) < 3:
        return 0.0
    q = statistics.quantiles(samples, n=4, method="inclusive")
    mid = statistics.median(samples)
    return (q[2] - q[0]) / mid if mid > 0 else 0.0


class Timer:
    """Times calls on one device (`time_call`); CUDA events on a GPU, the wall clock on a CPU.

    Each repeat starts from a flushed L2 cache (a 256 MiB buffer zeroed outside the timed
    region, as `triton.testing.do_bench` does), so a row means the same as before.
    """

    def __init__(self, device: torch.device | str, *, budget_s: float = TIME_BUDGET_S, spread: float = TIME_SPREAD,
                 min_reps: int = TIME_MIN_REPS, max_reps: int = TIME_MAX_REPS) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.budget_s, self.spread, self.min_reps, self.max_reps = budget_s, spread, min_reps, max_reps
        self._flush = torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device=self.device) if self.cuda else None

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _once(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        if self._flush is not None:
            self._flush.zero_()
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            stop = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            out = fn()
            stop.record()
            stop.synchronize()
            return out, float(start.elapsed_time(stop))
        t0 = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t0) * 1e3

    def time_call(self, fn: Callable[[], Any]) -> tuple[Any, Timing]:
        """Call `fn` once (the warm call; its result is returned), then time repeats.

        Repeats stop once there are `min_reps` of them whose spread (interquartile range
        over median) is at most `spread`, or the time budget is spent (at least two
        repeats), or at `max_reps`: a fast, steady call is timed `min_reps` times, a slow
        one twice, a noisy one until the budget is spent.
        """
        self.sync()
        out, first = self._once(fn)
        samples: list[float] = []
        deadline = time.perf_counter() + self.budget_s
        while len(samples) < self.max_reps:
            samples.append(self._once(fn)[1])
            if len(samples) >= 2 and time.perf_counter() >= deadline:
                break
            if len(samples) >= self.min_reps and _spread(samples) <= self.spread:
                break
        return out, Timing(statistics.median(samples), _spread(samples), len(samples), first)


def dense_baseline(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, timer: Timer) -> tuple[str, Timing]:
    """The dense baseline of a timed run: cuDNN SDPA (causal) on a GPU, PyTorch's SDPA on a
    CPU (smoke runs); K and V expanded to the query heads outside the timed region."""
    import torch.nn.functional as F

    g = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    if timer.cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def cudnn() -> torch.Tensor:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)

        name, fn = "cuDNN SDPA", cudnn
    else:
        name, fn = "SDPA (CPU)", lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
    _, timing = timer.time_call(fn)
    return name, timing


def relative_error_on_device(out: torch.Tensor, exact: torch.Tensor) -> float:
    """`reference.relative_error(out, exact)` (float64 Frobenius) computed where the tensors
    are, one batch row and head at a time: no host copy of two `[B, H, N, D]` outputs."""
    num = torch.zeros((), dtype=torch.float64, device=out.device)
    den = torch.zeros((), dtype=torch.float64, device=out.device)
    for b in range(out.shape[0]):
        for h in range(out.shape[1]):
            o, r = out[b, h].double(), exact[b, h].double()
            num += (o - r).pow(2).sum()
            den += r.pow(2).sum()
    n, d = math.sqrt(float(num)), math.sqrt(float(den))
    if not math.isfinite(n):
        return math.nan
    return n / d if d > 0 else n


def timed_inputs(seqlen: int, *, workload: str = "synthetic", qkv: Path | None = None, batch: int = 1,
                 q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
                 device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """q, k, v and the source name of a timed run (`workload.workload_qkv`)."""
    from .workload import Shape, workload_qkv

    q, k, v = workload_qkv(Shape(batch, q_heads, kv_heads, seqlen, head_dim, dtype), device=torch.device(device),
                           workload=workload, qkv=qkv)
    source = workload if qkv is None else f"capture {qkv.name}"
    return q, k, v, source


def compare_timed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    source: str,
    methods: Sequence[str],
    *,
    backend: str = "fast",
    shares: Sequence[float] = DEFAULT_SHARES,
    log: Callable[[str], None] = print,
    equal_recall: Sequence[float] = (),
    rows: RowLog | None = None,
    timer: Timer | None = None,
) -> list[Point]:
    """Every method's sweep on one input, every point timed (see the module doc).

    Per point: the plan once (timed: estimate+plan), the kernel on it (timed), the
    end-to-end call (timed; its output gives the error against our dense plan's kernel),
    density, exact recall (`recall` of the plan) and the method's extras. Methods without
    a plan (Delta-KV) get the end-to-end time and their view's density. The oracle runs on
    the last 4096 rows. With `equal_recall` targets, every point is measured untimed and
    only the least dense point of each method reaching each target is timed.

    `rows`: the baseline, the oracle and each point are appended as they are measured
    (with `equal_recall`, a point untimed first, then again once timed: the later row
    wins); what a resumed `rows` already holds is read back instead of measured again.
    """
    from . import fast, reference

    impl: Any = fast if backend == "fast" else reference
    timer = timer or Timer(q.device)
    n = int(q.shape[2])
    back = {} if rows is None else {r["key"]: r for r in rows.of_kind("point") if r["source"] == source}
    base_rows = [] if rows is None else [r for r in rows.of_kind("baseline") if r["source"] == source]
    if base_rows:
        base_name, base_ms = base_rows[-1]["name"], float(base_rows[-1]["ms"])
        log(f"{source}: {base_name} {base_ms:.3f} ms (read back)")
    else:
        base_name, base = dense_baseline(q, k, v, timer)
        base_ms = base.ms
        log(f"{source}: {base_name} {base_ms:.3f} ms ({base.reps} repeats, spread {base.spread:.1%})")
        if rows is not None:
            rows.append({"kind": "baseline", "source": source, "name": base_name, "ms": base_ms,
                         "timing": asdict(base)})
    points: list[Point] = []
    oracle_key = point_key(source, "oracle", "", {})
    if oracle_key in back:
        points += [point_from_row(r) for r in rows.of_kind("point") if r.get("key") == oracle_key]  # type: ignore[union-attr]
    else:
        started = time.perf_counter()
        tail = min(n, 4096)
        dens = _oracle_tail(q, k, tail, shares)
        oracle = [Point("oracle", {"share": s, "rows": f"last {tail}"}, source, n, float(dens[i]), s, s, None, 0.0)
                  for i, s in enumerate(shares)]
        log(f"{source}: oracle on the last {tail} rows in {time.perf_counter() - started:.1f} s")
        points += oracle
        if rows is not None:
            for p in oracle:
                rows.append({"kind": "point", "key": oracle_key, **asdict(p)})
    exact = impl.sparse_attention(q, k, v, impl.dense_plan(q, k))
    jobs = [(METHODS[name], params) for name in methods for params in unique_points(sweep(METHODS[name], n))]
    progress = Progress(len(jobs) * (2 if equal_recall else 1), what="step")
    measured: list[tuple[Point, Method, dict[str, Any], str]] = []
    for spec, params in jobs:
        key = point_key(source, spec.name, "", params)
        if key in back:
            progress.skip()
            measured.append((point_from_row(back[key]), spec, params, key))
            continue
        point = _measure_timed(spec, params, q, k, v, exact, impl=impl, backend=backend, source=source,
                               timer=timer, time_now=not equal_recall, base_ms=base_ms)
        if rows is not None:
            rows.append({"kind": "point", "key": key, **asdict(point)})
        progress.step(f"{source} {spec.name} {_short(params)}: density {point.density:.4f} recall "
                      f"{_fmt(point.recall_mean)} error {_fmt(point.output_error, '.2e')}"
                      + (f" e2e {point.gpu['e2e_ms']:.2f} ms ({point.gpu['speedup_vs_cudnn']:.2f}x {base_name})"
                         if point.gpu else ""))
        measured.append((point, spec, params, key))
    picks = _equal_recall_picks([m[0] for m in measured], equal_recall) if equal_recall else set()
    for point, spec, params, key in measured:
        if id(point) in picks and not point.gpu:
            started = time.perf_counter()
            _time_point(point, spec, params, q, k, v, impl=impl, backend=backend, timer=timer, base_ms=base_ms)
            point.stage_s["timing"] = time.perf_counter() - started
            point.seconds += point.stage_s["timing"]
            if rows is not None:
                rows.append({"kind": "point", "key": key, **asdict(point)})
            progress.step(f"{source} {spec.name} {_short(params)}: timed (least density at recall "
                          f"{_fmt(point.recall_mean)}): e2e {point.gpu['e2e_ms']:.2f} ms "
                          f"({point.gpu['speedup_vs_cudnn']:.2f}x {base_name})")
        elif equal_recall:
            progress.skip()
        points.append(point)
    return points


def _measure_timed(spec: Method, params: dict[str, Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              exact: torch.Tensor, *, impl: Any, backend: str, source: str, timer: Timer, time_now: bool,
              base_ms: float) -> Point:
    """One timed-path point: plan, output, density, recall, error, extras; timed too with
    `time_now` (the timed calls then give the plan and the output, no call is repeated
    untimed)."""
    started = time.perf_counter()
    call = spec.call_params(params, q)
    stage: dict[str, float] = {}
    point = Point(method=spec.name, params=_plain(call), source=source, seqlen=int(q.shape[2]), density=math.nan,
                  recall_mean=None, recall_min=None, output_error=None, seconds=0.0)
    plan: Any = None
    out: Any = None
    if time_now:
        t0 = time.perf_counter()
        plan, out = _time_point(point, spec, params, q, k, v, impl=impl, backend=backend, timer=timer,
                                base_ms=base_ms)
        stage["timing"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if spec.plan_based and spec.view is None:
        if plan is None:
            plan = spec.plan_fn(backend)(q, k, **call)
        if not time_now:
            out = spec.run_fn(backend)(q, k, v, **call)
        view = MethodView(density=impl.density(plan), recall=None, plan=plan)
    else:
        view = spec.method_view(backend, q, k, v, call, with_recall=False)
        if not time_now:
            out = spec.run_fn(backend)(q, k, v, **call)
    timer.sync()
    stage["plan_and_output"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if view.plan is not None and spec.plan_based:
        per_head = impl.recall(q, k, view.plan).double().mean(dim=-1)
        point.recall_mean, point.recall_min = float(per_head.mean()), float(per_head.min())
        point.recall_per_head = [float(x) for x in per_head.flatten()]
    timer.sync()
    stage["recall"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    point.output_error = relative_error_on_device(out, exact)
    stage["error"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    point.extras = {} if spec.extras is None else spec.extras(backend, q, k, v, call, view)
    timer.sync()
    stage["extras"] = time.perf_counter() - t0
    point.density = float(view.density.mean())
    point.density_per_head = [float(x) for x in view.density.double().flatten()]
    point.stage_s = stage
    point.seconds = time.perf_counter() - started
    if point.gpu:
        point.gpu["floor_ms"] = point.density * base_ms
    return point


def _time_point(point: Point, spec: Method, params: dict[str, Any], q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, *, impl: Any, backend: str, timer: Timer, base_ms: float) -> tuple[Any, Any]:
    """Time a point's estimate+plan, its kernel and its end-to-end call; sets `point.gpu`
    and `point.timing`. Returns (the plan or None, the end-to-end output)."""
    call = spec.call_params(params, q)
    gpu: dict[str, float] = {}
    timing: dict[str, dict[str, float]] = {}
    plan: Any = None
    if spec.plan_based:
        plan_fn = spec.plan_fn(backend)
        plan, t = timer.time_call(lambda: plan_fn(q, k, **call))
        gpu["estimate_plan_ms"], timing["estimate_plan"] = t.ms, asdict(t)
        _, t = timer.time_call(lambda: impl.sparse_attention(q, k, v, plan))
        gpu["kernel_ms"], timing["kernel"] = t.ms, asdict(t)
    out, t = timer.time_call(lambda: spec.run_fn(backend)(q, k, v, **call))
    gpu.update({"e2e_ms": t.ms, "cudnn_ms": base_ms, "speedup_vs_cudnn": base_ms / t.ms})
    if not math.isnan(point.density):
        gpu["floor_ms"] = point.density * base_ms
    timing["e2e"] = asdict(t)
    point.gpu, point.timing = gpu, timing
    return plan, out


def _equal_recall_picks(points: Sequence[Point], targets: Sequence[float]) -> set[int]:
    """`id`s of the points to time for `--equal-recall`: per method and target, the least
    dense point whose mean recall reaches the target."""
    picks: set[int] = set()
    for method in dict.fromkeys(p.method for p in points):
        mine = [p for p in points if p.method == method and p.recall_mean is not None]
        for target in targets:
            ok = [p for p in mine if p.recall_mean is not None and p.recall_mean >= target]
            if ok:
                picks.add(id(min(ok, key=lambda p: p.density)))
    return picks


def _oracle_tail(q: torch.Tensor, k: torch.Tensor, rows: int, shares: Sequence[float]) -> list[float]:
    """Oracle density of the last `rows` query rows (their causal pairs only)."""
    n = q.shape[2]
    gen_q = q[:, :, n - rows:]
    # Queries near the end see nearly all keys: shift them to the start of a sequence of
    # length n is not possible, so count the kept keys of these rows directly.
    from .oracle import oracle_row_counts

    counts = oracle_row_counts(gen_q, k, shares, first_row=n - rows)  # [B, Hq, S] kept pairs
    pairs = sum(n - rows + i + 1 for i in range(rows))
    return [float(counts[..., i].double().mean() / pairs) for i in range(len(shares))]


def pareto(points: Sequence[Point]) -> list[Point]:
    """Points no other point beats on both density (lower) and mean recall (higher)."""
    scored = sorted((p for p in points if p.recall_mean is not None), key=lambda p: (p.density, -(p.recall_mean or 0)))
    front: list[Point] = []
    best = -math.inf
    for p in scored:
        assert p.recall_mean is not None
        if p.recall_mean > best:
            front.append(p)
            best = p.recall_mean
    return front


def oracle_density_at(points: Sequence[Point], source: str, recall: float) -> float | None:
    """The oracle's density at a recall (linear between measured shares), for one source."""
    curve = sorted((p.recall_mean, p.density) for p in points
                   if p.method == "oracle" and p.source == source and p.recall_mean is not None)
    if not curve or recall > curve[-1][0]:
        return None
    prev = (0.0, 0.0)
    for r, d in curve:
        if recall <= r:
            if r == prev[0]:
                return d
            return prev[1] + (d - prev[1]) * (recall - prev[0]) / (r - prev[0])
        prev = (r, d)
    return None


def _fmt(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def format_table(points: Sequence[Point]) -> str:
    """Markdown table: every point, with the oracle's density at the same recall beside it
    (exact where measured, else interpolated between the oracle's shares), then the
    method's extras and every yardstick's recall / error at the same density."""
    names = list(dict.fromkeys(name for p in points for name in p.yardsticks))
    sizes = list(dict.fromkeys(size for p in points for size in p.block_oracle))
    lines = ["| source | method | params | density | recall mean | recall min | oracle density at that recall "
             "| x oracle | output error | e2e ms | vs cuDNN | extras |"
             + "".join(f" best {b}-block plan at that recall |" for b in sizes)
             + "".join(f" {n} recall / error at that density |" for n in names),
             "| --- " * (12 + len(sizes) + len(names)) + "|"]
    for p in points:
        if p.method == "oracle":
            continue
        oracle = p.oracle_density_at_recall
        if oracle is None and p.recall_mean is not None:
            oracle = oracle_density_at(points, p.source, p.recall_mean)
        ratio = None if oracle is None or oracle == 0.0 else p.density / oracle
        params = ", ".join(f"{k}={v}" for k, v in p.params.items())
        extras = ", ".join(f"{k} {v:.4g}" for k, v in p.extras.items())
        marks = "".join(f" {_fmt(p.yardsticks[n]['recall_mean']) if n in p.yardsticks else '-'} / "
                        f"{_fmt(p.yardsticks[n]['output_error'], '.2e') if n in p.yardsticks else '-'} |"
                        for n in names)
        lines.append(f"| {p.source} | {p.series} | {params} | {p.density:.3f} | {_fmt(p.recall_mean)} | "
                     f"{_fmt(p.recall_min)} | {_fmt(oracle, '.3f')} | {_fmt(ratio, '.2f')} | "
                     f"{_fmt(p.output_error, '.2e')} | {_fmt(p.gpu.get('e2e_ms'), '.2f')} | "
                     f"{_fmt(p.gpu.get('speedup_vs_cudnn'), '.2f')} | {extras} |"
                     + "".join(f" {_fmt(p.block_oracle.get(b), '.3f')} |" for b in sizes) + marks)
    return "\n".join(lines)


def format_calibrated(rows: Sequence[Calibrated]) -> str:
    """Markdown table of the per-head calibrations (`--calibrate`)."""
    names = list(dict.fromkeys(name for r in rows for name in r.yardsticks))
    lines = ["| source | method | grid | target recall per head | density | recall mean | recall min | "
             "oracle density at the target | x oracle | extras |"
             + "".join(f" {n} recall at that density |" for n in names),
             "| --- " * (10 + len(names)) + "|"]
    for r in rows:
        o = r.oracle_density_at_target
        ratio = None if not o else r.density / o
        extras = ", ".join(f"{k} {v:.4g}" for k, v in r.extras.items())
        marks = "".join(f" {_fmt(r.yardsticks[n]['recall_mean']) if n in r.yardsticks else '-'} |" for n in names)
        lines.append(f"| {r.source} | {r.method} | {r.label or 'sweep'} | {r.target} | {r.density:.4f} | "
                     f"{r.recall_mean:.4f} | {r.recall_min:.4f} | {_fmt(o)} | {_fmt(ratio, '.2f')} | "
                     f"{extras} |{marks}")
    return "\n".join(lines)


def plot(points: Sequence[Point], path: Path) -> Path:
    """Recall vs density (every method's points and Pareto frontier, the oracle), and, where
    the points were timed, speedup vs recall; one panel pair per source."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def order(source: str) -> tuple[str, int]:
        head, _, tail = source.rpartition(" ")
        return (head, int(tail)) if tail.isdigit() else (source, 0)

    sources = sorted({p.source for p in points}, key=order)
    timed = any(p.gpu for p in points)
    if timed:  # one row per source: recall vs density, speedup vs recall
        fig, grid = plt.subplots(len(sources), 2, figsize=(13.0, 4.6 * len(sources)), squeeze=False)
        panels = [(grid[i][0], grid[i][1]) for i in range(len(sources))]
    else:  # the sources side by side
        fig, grid = plt.subplots(1, len(sources), figsize=(6.0 * len(sources), 5.0), squeeze=False)
        panels = [(grid[0][i], None) for i in range(len(sources))]
    names = sorted({p.series for p in points if p.method != "oracle"})
    # tab20 and a marker per method: up to 20 methods stay distinguishable.
    colors = {name: plt.get_cmap("tab20")((2 * i) % 20 + (2 * i) // 20) for i, name in enumerate(names)}
    markers = dict(zip(names, "osD^vP*Xh<>p8dH" * (1 + len(names) // 15)))
    for row, source in enumerate(sources):
        ax, ax2 = panels[row]
        mine = [p for p in points if p.source == source]
        oracle = sorted((p.density, p.recall_mean) for p in mine if p.method == "oracle")
        if oracle:
            ax.plot([d for d, _ in oracle], [r for _, r in oracle], "k--", lw=1.5, label="oracle (per row)")
        for name in names:
            pts = [p for p in mine if p.series == name and p.recall_mean is not None]
            if not pts:
                continue
            ax.scatter([p.density for p in pts], [p.recall_mean for p in pts], s=18, color=colors[name], alpha=0.6,
                       marker=markers[name])
            front = pareto(pts)
            ax.plot([p.density for p in front], [p.recall_mean for p in front], "-", color=colors[name],
                    marker=markers[name], markersize=4, label=name)
        ax.set_xlabel("density (computed share of the causal area)")
        ax.set_ylabel("recall (mean over rows and heads)")
        ax.set_title(f"{source}: recall vs density", fontsize=10)
        ax.set_xlim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
        if ax2 is not None:
            floor = sorted((p.recall_mean, 1.0 / p.density) for p in mine
                           if p.method == "oracle" and p.density > 0 and p.recall_mean is not None)
            if floor:
                ax2.plot([r for r, _ in floor], [s for _, s in floor], "k--", lw=1.2,
                         label="oracle floor (1 / density)")
            for name in names:
                pts = [p for p in mine if p.series == name and p.gpu and p.recall_mean is not None]
                if pts:
                    ax2.scatter([p.recall_mean for p in pts], [p.gpu["speedup_vs_cudnn"] for p in pts],
                                color=colors[name], label=name, s=22)
            ax2.axhline(1.0, color="grey", lw=0.8)
            ax2.set_yscale("log")
            ax2.set_xlabel("recall (mean)")
            ax2.set_ylabel("speedup vs cuDNN SDPA (end to end)")
            ax2.set_title(f"{source}: speedup vs recall", fontsize=10)
            ax2.grid(alpha=0.3)
            ax2.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def equal_recall(points: Sequence[Point], targets: Sequence[float]) -> list[dict[str, Any]]:
    """Per (source, method, target): the point with mean recall >= target and the least
    end-to-end time (untimed: the least density), or, when none reaches it, the best recall.
    The oracle's density at the target sits beside it. Methods without recall are left out."""
    out: list[dict[str, Any]] = []
    for source in dict.fromkeys(p.source for p in points):
        mine = [p for p in points if p.source == source]
        for method in dict.fromkeys(p.method for p in mine if p.method != "oracle"):
            pts = [p for p in mine if p.method == method and p.recall_mean is not None and not p.label]
            if not pts:
                continue
            for target in targets:
                row: dict[str, Any] = {"source": source, "method": method, "target": target,
                                       "oracle_density": oracle_density_at(points, source, target)}
                ok = [p for p in pts if (p.recall_mean or 0.0) >= target]
                if not ok:
                    best = max(pts, key=lambda p: p.recall_mean or 0.0)
                    row.update(reached=False, best_recall=best.recall_mean, params=best.params)
                    out.append(row)
                    continue
                timed = [p for p in ok if p.gpu.get("e2e_ms") is not None]
                pick = min(timed, key=lambda p: p.gpu["e2e_ms"]) if timed else min(ok, key=lambda p: p.density)
                gpu = pick.gpu
                row.update(reached=True, params=pick.params, density=pick.density, recall=pick.recall_mean,
                           e2e_ms=gpu.get("e2e_ms"), estimate_plan_ms=gpu.get("estimate_plan_ms"),
                           kernel_ms=gpu.get("kernel_ms"), cudnn_ms=gpu.get("cudnn_ms"),
                           speedup_vs_cudnn=gpu.get("speedup_vs_cudnn"),
                           vs_floor=gpu["e2e_ms"] / gpu["floor_ms"] if gpu.get("floor_ms") else None)
                out.append(row)
    return out


def _setting(params: Mapping[str, Any]) -> str:
    """A knob setting in a table cell (a per-head config cut short)."""
    text = ", ".join(f"{k}={v}" for k, v in params.items()) or "-"
    return text if len(text) <= 80 else text[:77] + "..."


def format_equal_recall(rows: Sequence[Mapping[str, Any]]) -> str:
    """Markdown table of `equal_recall` rows."""
    lines = ["| source | target | method | setting | density (oracle) | recall | e2e ms | estimate+plan ms "
             "| kernel ms | vs cuDNN | x floor |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if not r["reached"]:
            lines.append(f"| {r['source']} | {r['target']} | {r['method']} | not reached (best recall "
                         f"{_fmt(r['best_recall'], '.3f')} at {_setting(r['params'])}) | - | - | - | - | - | - | - |")
            continue
        lines.append(f"| {r['source']} | {r['target']} | {r['method']} | {_setting(r['params'])} | "
                     f"{r['density']:.3f} ({_fmt(r['oracle_density'], '.3f')}) | {_fmt(r['recall'], '.3f')} | "
                     f"{_fmt(r['e2e_ms'], '.2f')} | {_fmt(r['estimate_plan_ms'], '.2f')} | "
                     f"{_fmt(r['kernel_ms'], '.2f')} | {_fmt(r['speedup_vs_cudnn'], '.2f')} | "
                     f"{_fmt(r['vs_floor'], '.2f')} |")
    return "\n".join(lines)


def equal_density_pairs(points: Sequence[Point]) -> list[dict[str, Any]]:
    """Each `--equal-density` point beside the point whose density it matches."""
    out = []
    for p in points:
        if p.label != EQUAL_DENSITY:
            continue
        partner = next((o for o in points if o.source == p.source and not o.label and o.method != "oracle"
                        and f"{o.method} {_short(o.params)}" == p.matches), None)
        if partner is not None:
            out.append({"source": p.source, "first": asdict(partner), "matched": asdict(p)})
    return out


def format_equal_density(pairs: Sequence[Mapping[str, Any]]) -> str:
    """Markdown table of `equal_density_pairs`."""
    lines = ["| source | method | setting | density | recall mean / min | output error | matched method | "
             "setting | density | recall mean / min | output error |",
             "| --- " * 11 + "|"]
    for pair in pairs:
        cells = []
        for p in (pair["first"], pair["matched"]):
            cells.append(f"{p['method']} | {_setting(p['params'])} | {p['density']:.3f} | "
                         f"{_fmt(p['recall_mean'])} / {_fmt(p['recall_min'])} | {_fmt(p['output_error'], '.2e')}")
        lines.append(f"| {pair['source']} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def time_summary(points: Sequence[Point]) -> str:
    """Where a run's time went: per method its points, seconds and the seconds of each stage."""
    stages = list(dict.fromkeys(s for p in points for s in p.stage_s))
    lines = ["| method | points | seconds | " + " | ".join(stages) + (" |" if stages else ""),
             "| --- " * (3 + len(stages)) + "|"]
    for method in dict.fromkeys(p.method for p in points if p.method != "oracle"):
        mine = [p for p in points if p.method == method]
        cells = [f"{sum(p.stage_s.get(s, 0.0) for p in mine):.1f}" for s in stages]
        lines.append(f"| {method} | {len(mine)} | {sum(p.seconds for p in mine):.1f} | " + " | ".join(cells)
                     + (" |" if cells else ""))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `sparseprefill compare`."""
    parser.add_argument("--qkv", type=Path, default=None,
                        help="captured q/k/v (sparseprefill eval capture); default without --seqlen: "
                             "out/qkv_smollm2_8k.pt")
    parser.add_argument("--seqlen", type=int, default=None,
                        help="time every point at this N (on a GPU; a CPU run is a smoke test): on --workload, "
                             "or with --qkv on the capture's layers as the batch (first N tokens)")
    parser.add_argument("--workload", choices=("synthetic", "calibrated"), default="synthetic",
                        help="with --seqlen: the demo's synthetic workload (default) or the calibrated one "
                             "(sparseprefill.workload)")
    parser.add_argument("--batch", type=int, default=1, help="with --seqlen: batch rows (default 1)")
    parser.add_argument("--q-heads", type=int, default=32, help="with --seqlen: query heads (default 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="with --seqlen: key/value heads (default 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="with --seqlen: head size (default 128)")
    parser.add_argument("--methods", nargs="+", default=None,
                        help=f"registered methods (default: all: {', '.join(METHODS)})")
    parser.add_argument("--backend", choices=("fast", "reference"), default=None,
                        help="default: fast on CUDA, reference on CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="default: cuda if available, else cpu")
    parser.add_argument("--max-seqlen", type=int, default=None, help="use only the first tokens of the capture")
    parser.add_argument("--layers", type=int, nargs="+", default=None,
                        help="captured layers to use (default: all of the capture's)")
    parser.add_argument("--ablations", action="store_true",
                        help="also every method's ablation grids (Method.ablations; capture only)")
    parser.add_argument("--yardstick", nargs="+", default=[], metavar="METHOD[:GRID]",
                        help="beside every point, this compared method's recall and error at the same "
                             "density (e.g. vertical_slash:x4, with --ablations)")
    parser.add_argument("--block-oracle", type=int, nargs="+", default=[], metavar="BLOCK",
                        help="beside every point, the best plan of whole BLOCK x BLOCK cells at its recall "
                             "(capture only)")
    parser.add_argument("--no-output-error", action="store_true",
                        help="skip every method's output and its error (density and recall only; capture only)")
    parser.add_argument("--calibrate", type=float, nargs="+", default=[], metavar="RECALL",
                        help="per-head calibration of every grid at these recalls (capture only)")
    parser.add_argument("--equal-recall", type=float, nargs="+", default=[], metavar="RECALL",
                        help="per method the setting reaching mean recall RECALL at the least time (untimed: "
                             "least density); with --seqlen only those settings are timed")
    parser.add_argument("--equal-density", action="store_true",
                        help="the methods after the first run at the densities of the first one's sweep points "
                             "(their sweep's knob bisected) and are tabled beside them (capture only)")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the points here; each row is also written as it is measured to the .jsonl "
                             "beside it")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows already in the .jsonl beside --json (same settings) and measure the rest")
    parser.add_argument("--png", type=Path, default=Path("out/compare.png"),
                        help="the plot (default out/compare.png)")


def _header(args: argparse.Namespace, names: Sequence[str], backend: str) -> dict[str, Any]:
    """The settings that decide what a row holds (a resumed run must have the same)."""
    head: dict[str, Any] = {"command": "compare", "backend": backend, "device": str(args.device),
                            "qkv": None if args.qkv is None else str(args.qkv)}
    if args.seqlen is not None:
        head.update(seqlen=args.seqlen, workload=args.workload, batch=args.batch, q_heads=args.q_heads,
                    kv_heads=args.kv_heads, head_dim=args.head_dim, equal_recall=sorted(args.equal_recall))
    else:
        head.update(methods=list(names), max_seqlen=args.max_seqlen, ablations=args.ablations,
                    yardstick=list(args.yardstick), block_oracle=list(args.block_oracle),
                    output_error=not args.no_output_error, calibrate=list(args.calibrate),
                    equal_density=args.equal_density)
    return head


def run(args: argparse.Namespace) -> int:
    """Entry point of `sparseprefill compare`."""
    names: list[str] = args.methods or list(METHODS)
    calibrated: list[Calibrated] = []
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        print(f"sparseprefill compare: unknown methods {unknown}; registered: {', '.join(METHODS)}",
              file=sys.stderr)
        return 2

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def fail(message: str) -> int:
        print(f"sparseprefill compare: {message}", file=sys.stderr)
        return 2

    if any(not 0.0 < t <= 1.0 for t in args.equal_recall):
        return fail(f"--equal-recall targets must lie in (0, 1], got {args.equal_recall}")
    backend = args.backend or ("fast" if str(args.device).startswith("cuda") else "reference")
    started = time.perf_counter()
    try:
        rows = RowLog(None if args.json is None else rows_path(args.json), _header(args, names, backend),
                      resume=args.resume, log=log)
    except (ValueError, OSError) as exc:
        return fail(str(exc))
    if args.seqlen is not None:
        if args.seqlen < 1:
            return fail("--seqlen must be >= 1")
        if str(args.device).startswith("cuda") and not torch.cuda.is_available():
            return fail("--device cuda, but CUDA is not available (a CPU run: --device cpu, a smoke test)")
        if (args.ablations or args.yardstick or args.calibrate or args.layers or args.no_output_error
                or args.block_oracle or args.equal_density):
            return fail("--ablations, --yardstick, --calibrate, --block-oracle, --equal-density, --layers and "
                        "--no-output-error need a capture without --seqlen")
        if not str(args.device).startswith("cuda"):
            log("compare --seqlen on a CPU: a smoke test of the timed path, not a measurement")
        if backend == "fast" and not torch.cuda.is_available():
            from .demo import enable_interpreter

            enable_interpreter()
        try:
            q, k, v, source = timed_inputs(args.seqlen, workload=args.workload, qkv=args.qkv, batch=args.batch,
                                           q_heads=args.q_heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                                           dtype=torch.bfloat16 if backend == "fast" else torch.float32,
                                           device=args.device)
        except (ValueError, OSError) as exc:
            return fail(str(exc))
        log(f"{source}: inputs {tuple(q.shape)} / {tuple(k.shape)} in {time.perf_counter() - started:.1f} s")
        points = compare_timed(q, k, v, source, names, backend=backend, log=log, equal_recall=args.equal_recall,
                               rows=rows, timer=Timer(q.device))
    else:
        path = args.qkv or Path("out/qkv_smollm2_8k.pt")
        if not path.exists():
            return fail(f"no capture at {path} (make one with `sparseprefill eval capture`)")
        try:
            points = compare_capture(torch.load(path), names, backend=backend, device=args.device,
                                     max_seqlen=args.max_seqlen, log=log, layers=args.layers,
                                     ablations=args.ablations, yardsticks=args.yardstick,
                                     calibrate=args.calibrate, calibrated=calibrated,
                                     output_error=not args.no_output_error, block_oracles=args.block_oracle,
                                     equal_density=args.equal_density, rows=rows)
        except ValueError as exc:
            return fail(str(exc))
    print(format_table(points))
    if calibrated:
        print()
        print(format_calibrated(calibrated))
    result: dict[str, Any] = {"points": [asdict(p) for p in points]}
    if calibrated:
        result["calibrated"] = [asdict(r) for r in calibrated]
    if args.equal_recall:
        result["equal_recall"] = equal_recall(points, args.equal_recall)
        print()
        print(format_equal_recall(result["equal_recall"]))
    if args.equal_density:
        result["equal_density"] = equal_density_pairs(points)
        print()
        print(format_equal_density(result["equal_density"]))
    png = plot(points, args.png)
    print(f"plot: {png}")
    log(f"where the time went ({duration(time.perf_counter() - started)} in all):\n{time_summary(points)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result["arguments"] = {key: val for key, val in vars(args).items() if not callable(val)}
        args.json.write_text(json.dumps(result, indent=1, default=str))
        print(f"json: {args.json} (rows as measured: {rows.path})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparseprefill compare", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
