"""Speed at equal accuracy: from `sparseprefill compare` points, per method the knob
setting that reaches a mean recall target at the least end-to-end time.

    sparseprefill compare --seqlen 32768 --workload calibrated --device cuda \\
        --json benches/results/h100-compare-calibrated-32k-2026-11-25.json
    python benches/equal_recall.py benches/results/h100-compare-calibrated-32k-2026-11-25.json \\
        --targets 0.95 0.90 --json benches/results/h100-equal-recall-32k-2026-11-25.json \\
        --png docs/img/equal-recall-32k.png

Or measured in one pass on the GPU (`--measure`): every method's sweep untimed (density
and recall from the fast backend), then only the point that each target picks timed
(small `do_bench` counts), cuDNN SDPA in the same run; sources: a capture (`--qkv`, its
layers as the batch) and the calibrated workload at each `--seqlens` N:

    python benches/equal_recall.py --measure --qkv qkv3.pt --seqlens 32768 131072 \
        --points-json $OUT/points.json --json $OUT/equal-recall.json --png $OUT/equal-recall.png

Per (source, method, target): the point with mean recall >= target and the least e2e
time (without GPU times: the least density), its density, time split (estimate+plan,
kernel), speedup over cuDNN SDPA of the same run and the ratio of its time to the floor
`density x cuDNN time`; beside it the oracle's density at the target. A method none of
whose points reaches the target is listed as such, with its best recall. Methods
without recall (Delta-KV, DeltaXAttention) are left out: they change the keys.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any


def equal_recall(points: list[dict[str, Any]], targets: list[float]) -> list[dict[str, Any]]:
    """Rows of the equal-recall table (see the module doc)."""
    rows = []
    sources = list(dict.fromkeys(p["source"] for p in points))
    for source in sources:
        mine = [p for p in points if p["source"] == source]
        oracle = sorted((p["recall_mean"], p["density"]) for p in mine if p["method"] == "oracle")
        for method in dict.fromkeys(p["method"] for p in mine if p["method"] != "oracle"):
            pts = [p for p in mine if p["method"] == method and p["recall_mean"] is not None]
            if not pts:
                continue
            for target in targets:
                ok = [p for p in pts if p["recall_mean"] >= target]
                row: dict[str, Any] = {"source": source, "method": method, "target": target,
                                       "oracle_density": _oracle_at(oracle, target)}
                if not ok:
                    best = max(pts, key=lambda p: p["recall_mean"])
                    row.update(reached=False, best_recall=best["recall_mean"], params=best["params"])
                    rows.append(row)
                    continue
                timed = [p for p in ok if p.get("gpu", {}).get("e2e_ms") is not None]
                pick = min(timed, key=lambda p: p["gpu"]["e2e_ms"]) if timed else min(ok, key=lambda p: p["density"])
                gpu = pick.get("gpu", {})
                row.update(reached=True, params=pick["params"], density=pick["density"],
                           recall=pick["recall_mean"], e2e_ms=gpu.get("e2e_ms"),
                           estimate_plan_ms=gpu.get("estimate_plan_ms"), kernel_ms=gpu.get("kernel_ms"),
                           cudnn_ms=gpu.get("cudnn_ms"), speedup_vs_cudnn=gpu.get("speedup_vs_cudnn"),
                           vs_floor=(gpu["e2e_ms"] / gpu["floor_ms"] if gpu.get("floor_ms") else None),
                           flex_kernel_ms=gpu.get("flex_kernel_ms"))
                rows.append(row)
    return rows


def _tagged_rows(spec: str) -> list[dict[str, Any]]:
    path, _, tag = spec.partition("=")
    rows: list[dict[str, Any]] = json.loads(Path(path).read_text())["rows"]
    return [{**r, "source": f"{r['source']} [{tag}]"} for r in rows] if tag else rows


def join_rows(parts: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rows of several runs, one per (source, method, target): a reached row over one that
    was not (a run cut short), else the later run's."""
    joined: dict[tuple[Any, ...], dict[str, Any]] = {}
    for rows in parts:
        for r in rows:
            key = (r["source"], r["method"], r["target"])
            if key not in joined or r.get("reached", True) or not joined[key].get("reached", True):
                joined[key] = r
    return list(joined.values())


def rows_as_points(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The timed points of `equal_recall` rows (one per reached row, duplicates once) and the
    oracle's density at each target, as `plot` takes them (for a run whose points file is lost)."""
    points: list[dict[str, Any]] = []
    seen: set[tuple[Any, ...]] = set()
    for r in rows:
        if r.get("oracle_density") and ("oracle", r["source"], r["target"]) not in seen:
            seen.add(("oracle", r["source"], r["target"]))
            points.append({"source": r["source"], "method": "oracle", "params": {"share": r["target"]},
                           "density": r["oracle_density"], "recall_mean": r["target"], "gpu": {}})
        key = (r["method"], r["source"], r.get("recall"), r.get("density"))
        if r.get("reached", True) and r.get("speedup_vs_cudnn") is not None and key not in seen:
            seen.add(key)
            points.append({"source": r["source"], "method": r["method"], "params": r["params"],
                           "density": r["density"], "recall_mean": r["recall"],
                           "gpu": {"speedup_vs_cudnn": r["speedup_vs_cudnn"]}})
    return points


def _oracle_at(curve: list[tuple[float, float]], recall: float) -> float | None:
    prev = (0.0, 0.0)
    for r, d in curve:
        if recall <= r:
            return d if r == prev[0] else prev[1] + (d - prev[1]) * (recall - prev[0]) / (r - prev[0])
        prev = (r, d)
    return None


def _f(x: Any, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _setting(params: dict[str, Any]) -> str:
    """A knob setting in a table cell; a per-head MInference config as its first head's sizes."""
    import re

    if not isinstance(params, dict):  # the first run's JSON wrote some settings as text
        return str(params)
    out = []
    for k, v in params.items():
        if k == "patterns":
            continue
        if k == "config":
            sizes = re.search(r"'slash_size': (\d+), 'vertical_size': (\d+)", str(v))
            out.append("config (first head: vertical {}, slash {})".format(sizes.group(2), sizes.group(1))
                       if sizes else "config")
        else:
            out.append(f"{k}={v}")
    return ", ".join(out) or "-"


def format_rows(rows: list[dict[str, Any]]) -> str:
    """Markdown table of `equal_recall` rows."""
    lines = ["| source | target | method | setting | density (oracle) | recall | e2e ms | estimate+plan ms "
             "| kernel ms | Flex kernel ms | vs cuDNN | x floor |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        params = _setting(r["params"])
        if not r.get("reached", True):
            lines.append(f"| {r['source']} | {r['target']} | {r['method']} | not reached (best recall "
                         f"{r['best_recall']:.3f} at {params}) | - | - | - | - | - | - | - | - |")
            continue
        lines.append(f"| {r['source']} | {r['target']} | {r['method']} | {params} | {r['density']:.3f} "
                     f"({_f(r['oracle_density'], '.3f')}) | {r['recall']:.3f} | {_f(r['e2e_ms'], '.2f')} | "
                     f"{_f(r['estimate_plan_ms'], '.2f')} | {_f(r['kernel_ms'], '.2f')} | "
                     f"{_f(r.get('flex_kernel_ms'), '.2f')} | "
                     f"{_f(r['speedup_vs_cudnn'], '.2f')} | {_f(r['vs_floor'], '.2f')} |")
    return "\n".join(lines)


def plot(points: list[dict[str, Any]], path: Path) -> None:
    """Speedup over cuDNN against recall, every timed point, one panel per source (two
    columns); the oracle's floor (1 / its density) as a dashed line; one colour and marker
    per method across the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sources = list(dict.fromkeys(p["source"] for p in points))
    if not sources:
        return
    methods = sorted({p["method"] for p in points if p["method"] != "oracle"})
    cmap = plt.get_cmap("tab20")
    style = {m: (cmap(i % 20), "osD^v<>pXh*"[i % 11]) for i, m in enumerate(methods)}
    cols = min(2, len(sources))
    rows = (len(sources) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 5.0 * rows), squeeze=False)
    for ax in axes.flat[len(sources):]:
        ax.axis("off")
    for ax, source in zip(axes.flat, sources):
        mine = [p for p in points if p["source"] == source]
        oracle = sorted((p["recall_mean"], 1.0 / p["density"]) for p in mine if p["method"] == "oracle" and p["density"])
        if oracle:
            ax.plot([r for r, _ in oracle], [s for _, s in oracle], "k--", label="oracle floor (1 / density)")
        for method in methods:
            pts = sorted((p for p in mine if p["method"] == method and p["recall_mean"] is not None
                          and p.get("gpu", {}).get("speedup_vs_cudnn") is not None), key=lambda p: p["recall_mean"])
            if pts:
                color, marker = style[method]
                ax.plot([p["recall_mean"] for p in pts], [p["gpu"]["speedup_vs_cudnn"] for p in pts], "-",
                        marker=marker, color=color, ms=5, label=method)
        ax.set_yscale("log")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xlabel("mean recall")
        ax.set_ylabel("speedup vs cuDNN SDPA (end to end)")
        title = source.replace("calibrated (SmolLM2-135M-Instruct.Q4_1.gguf, N=8192), ", "calibrated, ")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ms(fn: Any, rep: int, slow_s: float = 0.25) -> float:
    """Median ms of `fn`: `do_bench` unless one call takes over `slow_s` seconds, then the
    median of three synchronised calls (do_bench's 5-call estimate plus warmup would spend
    seconds per slow estimator at 128K)."""
    import time

    import torch
    import triton.testing

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    if time.perf_counter() - start > slow_s:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[1]
    return float(triton.testing.do_bench(fn, warmup=max(5, rep // 5), rep=rep, return_mode="median"))


def measure_source(q: Any, k: Any, v: Any, source: str, methods: list[str], targets: list[float], *,
                   rep: int = 40, deadline: float = math.inf, log: Any = print,
                   peers: bool = False, backend: str = "fast",
                   timer: Any = None, on_method: Any = None, baseline_ms: float | None = None,
                   flex_methods: tuple[str, ...] = (), flex_fn: Any = None,
                   method_s: float = math.inf, peers_first: bool = False) -> list[dict[str, Any]]:
    """Points of one input on the GPU: the oracle (last 4096 rows), every method's sweep
    (density, recall; untimed), then per target the least-density point reaching it timed
    end to end and split into estimate+plan / kernel, cuDNN SDPA in the same run.

    `flex_methods`: for these methods' timed points also FlexAttention (`flex_fn`, a compiled
    `flex_attention`) on the same plan (`bench.flex_block_mask`), kernel only, with its output's
    relative difference from ours. `baseline_ms` replaces the cuDNN timing (CPU smoke runs).
    A method's sweep stops at `deadline` or after `method_s` seconds (the points so far kept).
    The peers run after our methods, or before them with `peers_first`."""
    import time
    from dataclasses import asdict

    from sparseprefill import bench, fast
    from sparseprefill.compare import _oracle_tail, measure, sweep
    from sparseprefill.methods import METHODS

    n = int(q.shape[2])
    impl: Any = fast
    if backend != "fast":
        from sparseprefill import reference as impl
    clock = timer if timer is not None else (lambda fn: _ms(fn, rep))
    base_ms = bench.cudnn_row(q, k, v, log=log).ms if baseline_ms is None else baseline_ms
    shares = sorted({0.5, 0.8, 0.85, 0.9, 0.95, 0.98, 0.99, *targets})
    tail = min(n, 4096)
    dens = _oracle_tail(q, k, tail, shares)
    points: list[dict[str, Any]] = [
        {"method": "oracle", "params": {"share": s, "rows": f"last {tail}"}, "source": source, "seqlen": n,
         "density": d, "recall_mean": s, "gpu": {}} for s, d in zip(shares, dens)]
    log(f"{source}: cuDNN {base_ms:.2f} ms; oracle density at 0.9 / 0.95: "
        f"{dens[shares.index(0.9)]:.4f} / {dens[shares.index(0.95)]:.4f}")
    if peers and peers_first:
        points += _peer_points(q, k, v, source, targets, base_ms, rep, log)
        peers = False
    for name in methods:
        if time.perf_counter() > deadline:
            log(f"{source}: out of time before {name}")
            break
        spec = METHODS[name]
        mine = []
        started = time.perf_counter()
        for params in sweep(spec, n):
            if time.perf_counter() > min(deadline, started + method_s):
                log(f"{source} {name}: sweep cut after {len(mine)} points (time)")
                break
            point = measure(spec, params, q, k, v, None, backend=backend, scale=None, source=source)
            if point.recall_mean is None:
                break  # methods that change the keys: no recall, not in this table
            mine.append(({k: v for k, v in asdict(point).items()
                          if k in ("method", "params", "source", "seqlen", "density", "recall_mean", "recall_min")},
                         params))
        picks = []
        for target in targets:
            ok = [m for m in mine if m[0]["recall_mean"] >= target]
            if ok:
                pick = min(ok, key=lambda m: m[0]["density"])
                if all(pick is not p for p in picks):
                    picks.append(pick)
        for point, params in picks:
            call = spec.call_params(params, q)
            e2e = clock(lambda: spec.run_fn(backend)(q, k, v, **call))
            gpu = {"e2e_ms": e2e, "cudnn_ms": base_ms, "speedup_vs_cudnn": base_ms / e2e,
                   "floor_ms": point["density"] * base_ms}
            plan_fn = spec.plan_fn(backend)
            plan = plan_fn(q, k, **call)
            gpu["estimate_plan_ms"] = clock(lambda: plan_fn(q, k, **call))
            gpu["kernel_ms"] = clock(lambda: impl.sparse_attention(q, k, v, plan))
            if name in flex_methods and flex_fn is not None and time.perf_counter() < deadline:
                gpu.update(_flex_time(flex_fn, clock, plan, q, k, v, impl, log))
            del plan
            point["gpu"] = gpu
            log(f"{source} {name} {point['params']}: recall {point['recall_mean']:.3f} density "
                f"{point['density']:.4f} e2e {e2e:.2f} ms ({base_ms / e2e:.2f}x cuDNN)")
        points += [m[0] for m in mine]
        if on_method is not None:
            on_method(points)
        if not mine:
            log(f"{source} {name}: no recall (changes the keys), left out")
    if peers and time.perf_counter() > deadline:
        log(f"{source}: out of time before the peers")
    elif peers:
        points += _peer_points(q, k, v, source, targets, base_ms, rep, log)
    return _plain(points)


def _peer_points(q: Any, k: Any, v: Any, source: str, targets: list[float], base_ms: float, rep: int,
                 log: Any) -> list[dict[str, Any]]:
    """`peers.peer_points` on one input, with the dense output for their output error."""
    import torch
    import torch.nn.functional as F

    from sparseprefill.bench.suites.peers import peer_points

    g = q.shape[1] // k.shape[1]
    dense = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True)
    out: list[dict[str, Any]] = peer_points(q, k, v, source, targets, base_ms, dense=dense, rep=rep, log=log)
    del dense
    torch.cuda.empty_cache()
    return out


def _flex_time(flex_fn: Any, clock: Any, plan: Any, q: Any, k: Any, v: Any, impl: Any,
               log: Any) -> dict[str, Any]:
    """FlexAttention's kernel time on `plan` (as `bench.flex_row`), or why it failed."""
    from sparseprefill.bench import flex_block_mask

    try:
        bmask = flex_block_mask(plan)
        opts = {"BLOCK_M": min(128, plan.block_m), "BLOCK_N": min(128, plan.block_n)}
        ours = impl.sparse_attention(q, k, v, plan)
        fout = flex_fn(q, k, v, block_mask=bmask, enable_gqa=True, kernel_options=opts)
        diff = float((fout.float() - ours.float()).norm() / ours.float().norm())
        fms = clock(lambda: flex_fn(q, k, v, block_mask=bmask, enable_gqa=True, kernel_options=opts))
        log(f"  FlexAttention on the same plan: {fms:.2f} ms (rel. diff vs ours {diff:.1e})")
        return {"flex_kernel_ms": fms, "flex_rel_diff": diff}
    except Exception as exc:  # noqa: BLE001 - report and go on
        log(f"  FlexAttention failed: {type(exc).__name__}: {str(exc)[:200]}")
        return {"flex_error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def _plain(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Points with JSON-ready params (plans' pattern objects as text)."""
    return [{**p, "params": {k: (v if isinstance(v, (int, float, str, bool)) or v is None else str(v))
                             for k, v in p["params"].items()}} for p in points]


def run_measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The `--measure` sources (see the module doc)."""
    import time

    import torch

    from sparseprefill import workload
    from sparseprefill.demo import Shape
    from sparseprefill.methods import METHODS

    deadline = time.perf_counter() + args.budget_s
    methods = args.methods or [m for m in METHODS if m != "dense"]
    dev = torch.device("cuda")
    points: list[dict[str, Any]] = []
    jobs: list[tuple[str, int | None]] = [("calibrated", n) for n in args.seqlens]
    if args.qkv is not None:
        jobs.insert(len(jobs) if args.qkv_last else 0, ("captured", None))
    budgets = list(args.source_budget_s or [])
    cal = workload.load_calibration(args.calibration)
    flex_fn = None
    if args.flex_methods:
        from torch.nn.attention.flex_attention import flex_attention

        flex_fn = torch.compile(flex_attention, dynamic=False)
    for i, (kind, n) in enumerate(jobs):
        if time.perf_counter() > deadline:
            print(f"out of time before {kind} {n}", flush=True)
            break
        started = time.perf_counter()
        until = min(deadline, started + budgets[i]) if i < len(budgets) else deadline
        if kind == "captured":
            data = torch.load(args.qkv, map_location="cpu")
            n_cap = int(data["q"][0].shape[2])
            q, k, v = workload.capture_qkv(args.qkv, Shape(1, 1, 1, n_cap, 64, torch.bfloat16), device=dev)
            source = f"captured {args.qkv.name} (layers {list(data['layers'])}), N={n_cap}"
        else:
            assert n is not None
            shape = Shape(1, args.q_heads, args.kv_heads, n, 128, torch.bfloat16)
            q, k, v = workload.calibrated_qkv(shape, device=dev, calibration=cal)
            source = f"calibrated ({cal.source}), N={n}, Hq={args.q_heads}, Hkv={args.kv_heads}"
        print(f"{source}: inputs in {time.perf_counter() - started:.1f} s", flush=True)
        def save(mine: list[dict[str, Any]], done: list[dict[str, Any]] = list(points)) -> None:
            # Every source so far plus this one's points (after each method: a run cut short keeps them).
            if args.points_json is not None:
                args.points_json.parent.mkdir(parents=True, exist_ok=True)
                args.points_json.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                        "points": done + _plain(mine)}, indent=1))

        mine_methods = args.qkv_methods if kind == "captured" and args.qkv_methods else methods
        new = measure_source(q, k, v, source, mine_methods, args.targets, rep=args.rep, deadline=until,
                             log=lambda line: print(line, flush=True), peers=args.peer is not None,
                             on_method=save, flex_methods=tuple(args.flex_methods or ()), flex_fn=flex_fn,
                             method_s=args.method_s, peers_first=args.peers_first)
        save(new)
        points += new
        del q, k, v
        torch.cuda.empty_cache()
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("compare_json", type=Path, nargs="*", help="`sparseprefill compare --json` outputs")
    parser.add_argument("--rows", type=Path, nargs="+", default=None,
                        help="instead of points: join these --json outputs' rows (table and figure from them); "
                             "FILE=TAG appends ' [TAG]' to the file's sources (e.g. the card)")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.95, 0.90])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--measure", action="store_true", help="measure on the GPU instead of reading JSON")
    parser.add_argument("--qkv", type=Path, default=None, help="with --measure: a capture as one source")
    parser.add_argument("--seqlens", type=int, nargs="*", default=[], help="with --measure: calibrated N")
    parser.add_argument("--calibration", type=Path, default=None, help="default: the shipped fit")
    parser.add_argument("--q-heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--methods", nargs="+", default=None)
    parser.add_argument("--rep", type=int, default=40, help="do_bench rep (ms) of each timed point")
    parser.add_argument("--budget-s", type=float, default=math.inf, help="start no new method after this")
    parser.add_argument("--peer", default=None,
                        help="with --measure: also run the peers (`sparseprefill bench peers`), this folder first on sys.path")
    parser.add_argument("--qkv-methods", nargs="+", default=None,
                        help="with --measure: the capture's methods (default: --methods)")
    parser.add_argument("--qkv-last", action="store_true", help="with --measure: the capture after the N sources")
    parser.add_argument("--source-budget-s", type=float, nargs="+", default=None,
                        help="with --measure: seconds per source in order (start no new method after)")
    parser.add_argument("--method-s", type=float, default=math.inf,
                        help="with --measure: cut a method's sweep after this many seconds")
    parser.add_argument("--flex-methods", nargs="+", default=None,
                        help="with --measure: FlexAttention on these methods' timed plans")
    parser.add_argument("--peers-first", action="store_true", help="with --peer: the peers before our methods")
    parser.add_argument("--points-json", type=Path, default=None, help="with --measure: every point")
    args = parser.parse_args(argv)
    points = []
    if args.measure:
        if args.peer:
            sys.path.insert(0, os.path.abspath(args.peer))
        points = run_measure(args)
    for path in args.compare_json:
        points += json.loads(path.read_text())["points"]
    if args.rows:
        rows = join_rows([_tagged_rows(str(path)) for path in args.rows])
        points = rows_as_points(rows)
    else:
        rows = equal_recall(points, args.targets)
    print(format_rows(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"inputs": [str(p) for p in args.compare_json], "rows": rows}, indent=1))
    if args.png is not None:
        plot(points, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
