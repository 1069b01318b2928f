"""`sparseprefill compare`: every registered method on the same attention, against the oracle.

For every registered method (or `--methods`) its main knob is swept over a documented
grid (`Method.sweep`, see docs/compare.md) and every point is measured the same
way:

* density: score entries the method computes over the causal area (the executed
  plan's, or both Delta-KV phases');
* recall: the full-attention mass kept per row, mean over rows, then mean and min
  over heads (methods that change the keys, Delta-KV, have none);
* output error: `||out - exact|| / ||exact||` against float64 dense attention;
* on a GPU (`--seqlen`, synthetic workload): end-to-end, estimate+plan and kernel
  times, speedup against cuDNN SDPA in the same run.

The oracle (`sparseprefill.oracle`) gives, per query row, the fewest keys holding a
share of the mass: its density at each share is the frontier no method can beat; on a
capture every point also gets the oracle's density at exactly its own mean recall.
Output: a markdown table, JSON, and two plots (recall vs density with every method's
Pareto frontier and the oracle; speedup vs recall on a GPU).

The evidence of the method pages (docs/<method>.md) comes from three options, all
read from the descriptors (`sparseprefill.methods`):

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
  optimistic bound of what an offline calibration reaches).

    sparseprefill compare --qkv out/qkv_smollm2_8k.pt --json compare.json --png compare.png
    sparseprefill compare --seqlen 131072 --device cuda --json compare-128k.json
    sparseprefill compare --qkv out/qkv_smollm2_8k.pt --methods xattention dpxa vertical_slash \
        --ablations --yardstick vertical_slash:x4 --calibrate 0.9 0.95 --json xattention.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .methods import METHODS, Method, MethodView
from .methods._core import PlanFn
from .oracle import block_oracle_density, oracle_density

DEFAULT_SHARES = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99)


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

    @property
    def series(self) -> str:
        """The method, with its ablation grid's label if any (`xattention [naive s4]`)."""
        return f"{self.method} [{self.label}]" if self.label else self.method


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
) -> list[Point]:
    """Every method's sweep (and with `ablations` its ablation grids) and the oracle on each
    captured layer (see `sparseprefill eval capture`); `layers` picks captured layers.

    Every point also gets the oracle's density at its own mean recall and, for each
    `yardsticks` entry, that method's recall and error at its density; with `calibrate`,
    the per-head calibration of every grid is appended to `calibrated` (module doc).
    The recall of plan-based points comes from one pass per layer (`plan_recalls`);
    `output_error=False` skips every method's output (no error column, much faster).
    For each size in `block_oracles`, every point also gets the density of the best plan
    of whole `block x block` cells at its recall (`oracle.block_oracle_density`).
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
    points: list[Point] = []
    for layer, q, k, v, scale in zip(data["layers"], data["q"], data["k"], data["v"], data["scale"]):
        if layers is not None and int(layer) not in layers:
            continue
        q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
        if max_seqlen is not None:
            q, k, v = (t[:, :, :max_seqlen] for t in (q, k, v))
        source = f"layer {layer}"
        exact = reference.attention(q.double(), k.double(), v.double(), scale=scale) if output_error else None
        points += oracle_points(q, k, scale=scale, source=source, shares=shares)
        mine: list[Point] = []
        pending: list[tuple[Point, Any]] = []
        # A point of two grids (a wide grid containing the sweep) is measured once and copied.
        copies: list[tuple[Point, int, str]] = []
        for name in methods:
            spec = METHODS[name]
            done: dict[str, Point] = {}
            for label, plan_fn, grid in grids(spec, int(q.shape[2]), ablations=ablations):
                for params in grid:
                    key = repr((id(plan_fn), sorted(params.items())))
                    if key in done:
                        copies.append((done[key], len(mine), label))
                        point = done[key]
                    else:
                        waiting = len(pending)
                        point = measure(spec, params, q, k, v, exact, backend=backend, scale=scale,
                                        source=source, label=label, plan_fn=plan_fn, pending=pending)
                        done[key] = point
                        log(f"{source} {point.series} {params}: density {point.density:.4f} recall "
                            f"{'deferred' if len(pending) > waiting else _fmt(point.recall_mean)} error "
                            f"{_fmt(point.output_error, '.3e')} ({point.seconds:.1f} s)")
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
        if calibrated is not None:
            for target in targets:
                calibrated += calibrate_grids(mine, target, oracle[_share(target)], wanted)
        points += mine
    return points


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


def compare_synthetic(
    seqlen: int,
    methods: Sequence[str],
    *,
    batch: int = 1,
    q_heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
    shares: Sequence[float] = DEFAULT_SHARES,
    log: Callable[[str], None] = print,
    workload: str = "synthetic",
    qkv: Path | None = None,
) -> list[Point]:
    """A generated workload (or a capture) on a GPU: every point also timed, cuDNN SDPA in the same run.

    The inputs are `workload.workload_qkv`'s: the demo's synthetic workload, the
    calibrated one, or with `qkv` a capture's layers as the batch (its own heads and D).

    Output error is against the dense plan through our kernel (float32 accumulation),
    since float64 dense attention at 128K does not fit; the oracle runs on the last
    4096 query rows (and all keys) to stay within memory.
    """
    from . import bench, fast
    from .workload import Shape, workload_qkv

    q, k, v = workload_qkv(Shape(batch, q_heads, kv_heads, seqlen, head_dim, dtype), device=torch.device(device),
                           workload=workload, qkv=qkv)
    source = workload if qkv is None else f"capture {qkv.name}"
    base = bench.cudnn_row(q, k, v, log=log)
    exact = fast.sparse_attention(q, k, v, fast.dense_plan(q, k))
    points: list[Point] = []
    tail = min(seqlen, 4096)
    dens = _oracle_tail(q, k, tail, shares)
    points += [Point("oracle", {"share": s, "rows": f"last {tail}"}, source, seqlen, float(dens[i]), s, s,
                     None, 0.0) for i, s in enumerate(shares)]
    for name in methods:
        spec = METHODS[name]
        for params in sweep(spec, seqlen):
            point = measure(spec, params, q, k, v, exact, backend="fast", scale=None, source=source)
            call = spec.call_params(params, q)
            e2e = bench.bench_ms(lambda: spec.run_fn("fast")(q, k, v, **call))
            gpu = {"e2e_ms": e2e, "cudnn_ms": base.ms, "speedup_vs_cudnn": base.ms / e2e,
                   "floor_ms": point.density * base.ms}
            if spec.plan_based:
                plan_fn = spec.plan_fn("fast")
                plan = plan_fn(q, k, **call)
                gpu["estimate_plan_ms"] = bench.bench_ms(lambda: plan_fn(q, k, **call))
                gpu["kernel_ms"] = bench.bench_ms(lambda: fast.sparse_attention(q, k, v, plan))
                del plan
            point.gpu = gpu
            points.append(point)
            log(f"{name} {params}: {e2e:.2f} ms ({base.ms / e2e:.2f}x cuDNN) density {point.density:.3f}")
    return points


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
            for name in names:
                pts = [p for p in mine if p.series == name and p.gpu and p.recall_mean is not None]
                if pts:
                    ax2.scatter([p.recall_mean for p in pts], [p.gpu["speedup_vs_cudnn"] for p in pts],
                                color=colors[name], label=name, s=22)
            ax2.axhline(1.0, color="grey", lw=0.8)
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `sparseprefill compare`."""
    parser.add_argument("--qkv", type=Path, default=None,
                        help="captured q/k/v (sparseprefill eval capture); default without --seqlen: "
                             "out/qkv_smollm2_8k.pt")
    parser.add_argument("--seqlen", type=int, default=None,
                        help="time every point on a GPU at this N: on --workload, or with --qkv on the "
                             "capture's layers as the batch (first N tokens)")
    parser.add_argument("--workload", choices=("synthetic", "calibrated"), default="synthetic",
                        help="with --seqlen: the demo's synthetic workload (default) or the calibrated one "
                             "(sparseprefill.workload)")
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
    parser.add_argument("--json", type=Path, default=None, help="write the points here")
    parser.add_argument("--png", type=Path, default=Path("out/compare.png"),
                        help="the plot (default out/compare.png)")


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

    if args.seqlen is not None:
        if args.seqlen < 1:
            print("sparseprefill compare: --seqlen must be >= 1", file=sys.stderr)
            return 2
        if not args.device.startswith("cuda") or not torch.cuda.is_available():
            print("sparseprefill compare --seqlen times methods against cuDNN and needs a CUDA GPU; "
                  "on CPU use --qkv", file=sys.stderr)
            return 2
        if (args.ablations or args.yardstick or args.calibrate or args.layers or args.no_output_error
                or args.block_oracle):
            print("sparseprefill compare: --ablations, --yardstick, --calibrate, --block-oracle, --layers and "
                  "--no-output-error need a capture "
                  "(--qkv)", file=sys.stderr)
            return 2
        points = compare_synthetic(args.seqlen, names, device=args.device, log=log, workload=args.workload,
                                   qkv=args.qkv)
    else:
        path = args.qkv or Path("out/qkv_smollm2_8k.pt")
        if not path.exists():
            print(f"sparseprefill compare: no capture at {path} (make one with `sparseprefill eval capture`)",
                  file=sys.stderr)
            return 2
        backend = args.backend or ("fast" if args.device.startswith("cuda") else "reference")
        try:
            points = compare_capture(torch.load(path), names, backend=backend, device=args.device,
                                     max_seqlen=args.max_seqlen, log=log, layers=args.layers,
                                     ablations=args.ablations, yardsticks=args.yardstick,
                                     calibrate=args.calibrate, calibrated=calibrated,
                                     output_error=not args.no_output_error, block_oracles=args.block_oracle)
        except ValueError as exc:
            print(f"sparseprefill compare: {exc}", file=sys.stderr)
            return 2
    print(format_table(points))
    if calibrated:
        print()
        print(format_calibrated(calibrated))
    png = plot(points, args.png)
    print(f"plot: {png}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        result: dict[str, Any] = {"points": [asdict(p) for p in points]}
        if calibrated:
            result["calibrated"] = [asdict(r) for r in calibrated]
        result["arguments"] = {key: val for key, val in vars(args).items() if not callable(val)}
        args.json.write_text(json.dumps(result, indent=1, default=str))
        print(f"json: {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparseprefill compare", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
