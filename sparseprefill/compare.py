"""`sparseprefill compare`: every registered method on the same attention, against the oracle.

For every registered method (or `--methods`) its main knob is swept over a documented
grid (`MethodSpec.sweep`, see docs/compare.md) and every point is measured the same
way:

* density: score entries the method computes over the causal area (the executed
  plan's, or both Delta-KV phases');
* recall: the full-attention mass kept per row, mean over rows, then mean and min
  over heads (methods that change the keys, Delta-KV, have none);
* output error: `||out - exact|| / ||exact||` against float64 dense attention;
* on a GPU (`--seqlen`, synthetic workload): end-to-end, estimate+plan and kernel
  times, speedup against cuDNN SDPA in the same run.

The oracle (`sparseprefill.oracle`) gives, per query row, the fewest keys holding a
share of the mass: its density at each share is the frontier no method can beat.
Output: a markdown table, JSON, and two plots (recall vs density with every method's
Pareto frontier and the oracle; speedup vs recall on a GPU).

    sparseprefill compare --qkv out/qkv_smollm2_8k.pt --json compare.json --png compare.png
    sparseprefill compare --seqlen 131072 --device cuda --json compare-128k.json
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

from .conformance.registry import METHODS, MethodSpec
from .oracle import oracle_density

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


def sweep(spec: MethodSpec, seqlen: int) -> list[dict[str, Any]]:
    """The method's knob grid at length N (`MethodSpec.sweep`, else its demo parameters)."""
    if spec.sweep is not None:
        return [dict(p) for p in spec.sweep(seqlen)]
    return [dict(spec.demo_params(seqlen))]


def measure(
    spec: MethodSpec,
    params: Mapping[str, Any],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    exact: torch.Tensor | None,
    *,
    backend: str,
    scale: float | None,
    source: str,
) -> Point:
    """Density, recall and output error of one method call (see the module doc)."""
    from . import reference

    start = time.perf_counter()
    params = spec.call_params(params, q)
    out = spec.run_fn(backend)(q, k, v, **params, scale=scale)
    view = spec.method_view(backend, q, k, v, params, scale=scale)
    per_head = None if view.recall is None else view.recall.double().mean(dim=-1)
    return Point(
        method=spec.name, params=params, source=source, seqlen=int(q.shape[2]),
        density=float(view.density.mean()),
        recall_mean=None if per_head is None else float(per_head.mean()),
        recall_min=None if per_head is None else float(per_head.min()),
        output_error=None if exact is None else reference.relative_error(out, exact),
        seconds=time.perf_counter() - start,
    )


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
) -> list[Point]:
    """Every method's sweep and the oracle on each captured layer (see `sparseprefill eval capture`)."""
    from . import reference

    dtype = torch.float16 if backend == "fast" else torch.float32
    points: list[Point] = []
    for layer, q, k, v, scale in zip(data["layers"], data["q"], data["k"], data["v"], data["scale"]):
        q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
        if max_seqlen is not None:
            q, k, v = (t[:, :, :max_seqlen] for t in (q, k, v))
        source = f"layer {layer}"
        exact = reference.attention(q.double(), k.double(), v.double(), scale=scale)
        points += oracle_points(q, k, scale=scale, source=source, shares=shares)
        for name in methods:
            spec = METHODS[name]
            for params in sweep(spec, int(q.shape[2])):
                point = measure(spec, params, q, k, v, exact, backend=backend, scale=scale, source=source)
                points.append(point)
                log(f"{source} {name} {params}: density {point.density:.3f} recall "
                    f"{_fmt(point.recall_mean)} error {_fmt(point.output_error, '.3e')}")
    return points


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
            e2e = bench._bench_ms(lambda: spec.fast_run(q, k, v, **call))
            gpu = {"e2e_ms": e2e, "cudnn_ms": base.ms, "speedup_vs_cudnn": base.ms / e2e,
                   "floor_ms": point.density * base.ms}
            if spec.plan_based:
                plan_fn = spec.plan_fn("fast")
                plan = plan_fn(q, k, **call)
                gpu["estimate_plan_ms"] = bench._bench_ms(lambda: plan_fn(q, k, **call))
                gpu["kernel_ms"] = bench._bench_ms(lambda: fast.sparse_attention(q, k, v, plan))
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
    """Markdown table: every point, with the oracle's density at the same recall beside it."""
    lines = ["| source | method | params | density | recall mean | recall min | oracle density at that recall "
             "| x oracle | output error | e2e ms | vs cuDNN |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in points:
        if p.method == "oracle":
            continue
        oracle = None if p.recall_mean is None else oracle_density_at(points, p.source, p.recall_mean)
        ratio = None if oracle is None or oracle == 0.0 else p.density / oracle
        params = ", ".join(f"{k}={v}" for k, v in p.params.items())
        lines.append(f"| {p.source} | {p.method} | {params} | {p.density:.3f} | {_fmt(p.recall_mean)} | "
                     f"{_fmt(p.recall_min)} | {_fmt(oracle, '.3f')} | {_fmt(ratio, '.2f')} | "
                     f"{_fmt(p.output_error, '.2e')} | {_fmt(p.gpu.get('e2e_ms'), '.2f')} | "
                     f"{_fmt(p.gpu.get('speedup_vs_cudnn'), '.2f')} |")
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
    names = sorted({p.method for p in points if p.method != "oracle"})
    # tab20 and a marker per method: up to 20 methods stay distinguishable.
    colors = {name: plt.get_cmap("tab20")((2 * i) % 20 + (2 * i) // 20) for i, name in enumerate(names)}
    markers = dict(zip(names, "osD^vP*Xh<>p8dH" * 2))
    for row, source in enumerate(sources):
        ax, ax2 = panels[row]
        mine = [p for p in points if p.source == source]
        oracle = sorted((p.density, p.recall_mean) for p in mine if p.method == "oracle")
        if oracle:
            ax.plot([d for d, _ in oracle], [r for _, r in oracle], "k--", lw=1.5, label="oracle (per row)")
        for name in names:
            pts = [p for p in mine if p.method == name and p.recall_mean is not None]
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
                pts = [p for p in mine if p.method == name and p.gpu and p.recall_mean is not None]
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
    parser.add_argument("--json", type=Path, default=None, help="write the points here")
    parser.add_argument("--png", type=Path, default=Path("out/compare.png"),
                        help="the plot (default out/compare.png)")


def run(args: argparse.Namespace) -> int:
    """Entry point of `sparseprefill compare`."""
    names: list[str] = args.methods or list(METHODS)
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
        points = compare_synthetic(args.seqlen, names, device=args.device, log=log, workload=args.workload,
                                   qkv=args.qkv)
    else:
        path = args.qkv or Path("out/qkv_smollm2_8k.pt")
        if not path.exists():
            print(f"sparseprefill compare: no capture at {path} (make one with `sparseprefill eval capture`)",
                  file=sys.stderr)
            return 2
        backend = args.backend or ("fast" if args.device.startswith("cuda") else "reference")
        points = compare_capture(torch.load(path), names, backend=backend, device=args.device,
                                 max_seqlen=args.max_seqlen, log=log)
    print(format_table(points))
    png = plot(points, args.png)
    print(f"plot: {png}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"points": [asdict(p) for p in points]}, indent=1))
        print(f"json: {args.json}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparseprefill compare", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
