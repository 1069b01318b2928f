"""Where each `*_plan` spends its time, stage by stage (issue 22, fifth session; GPU only).

For each method of `estimator_shares.plans` (bench workload, bench defaults) at each N:

- wall time of one plan call (synchronised) and the GPU busy time (torch profiler: the sum
  of its kernels), the launch count and the largest kernels;
- a stage tree: every Python function of `sparseprefill.fast` / `.reference` that the plan
  calls is wrapped for the one profiled call, recording CUDA events around it, so each
  stage's span on the stream (its kernels and the host gaps between them) and its host
  time are measured where the code says what the stage is (inclusive times; nested
  stages are indented);
- the host synchronisations (torch's sync debug mode) with the innermost package frame
  that caused each.

    python benches/estimator_profile.py --seqlens 32768 --methods vertical_slash minference \
        --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
import traceback
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import estimator_shares as esh  # noqa: E402
import estimator_stages as es  # noqa: E402

# Helpers that only validate arguments: not stages.
_SKIP_PREFIXES = ("check", "_check", "resolve_scale", "interpreter_active", "cdiv", "is_", "_is_")


class StageTree:
    """CUDA-event spans of the wrapped functions of one call, as a call tree."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.records: list[tuple[tuple[str, ...], torch.cuda.Event, torch.cuda.Event, float]] = []
        self.active = False

    def wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            self.stack.append(name)
            path = tuple(self.stack)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            try:
                return fn(*args, **kwargs)
            finally:
                end.record()
                self.records.append((path, start, end, (time.perf_counter() - t0) * 1e3))
                self.stack.pop()

        inner.__wrapped_stage__ = True  # type: ignore[attr-defined]
        return inner

    def rows(self) -> list[dict[str, Any]]:
        torch.cuda.synchronize()
        agg: dict[tuple[str, ...], list[float]] = {}
        order: list[tuple[str, ...]] = []
        for path, start, end, host in self.records:
            if path not in agg:
                agg[path] = [0, 0.0, 0.0]
                order.append(path)
            a = agg[path]
            a[0] += 1
            a[1] += start.elapsed_time(end)
            a[2] += host
        # Depth-first order of first appearance: sort by the first-seen index of each prefix.
        first = {p: i for i, p in enumerate(order)}
        key = lambda p: tuple(first.get(p[: j + 1], 0) for j in range(len(p)))  # noqa: E731
        return [{"stage": " > ".join(p), "depth": len(p) - 1, "name": p[-1], "calls": int(agg[p][0]),
                 "gpu_span_ms": agg[p][1], "host_ms": agg[p][2]} for p in sorted(order, key=key)]


def install(tree: StageTree) -> int:
    """Wrap every package function bound in any loaded `sparseprefill` module (the same
    wrapper wherever one function is bound). Returns the number of functions wrapped."""
    wrapped: dict[int, Callable[..., Any]] = {}
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("sparseprefill") or mod is None:
            continue
        for attr, val in list(vars(mod).items()):
            if not isinstance(val, types.FunctionType) or getattr(val, "__wrapped_stage__", False):
                continue
            owner = getattr(val, "__module__", "") or ""
            if not (owner.startswith("sparseprefill.fast") or owner.startswith("sparseprefill.reference")):
                continue
            if val.__name__.startswith(_SKIP_PREFIXES):
                continue
            if id(val) not in wrapped:
                wrapped[id(val)] = tree.wrap(val, f"{owner.rsplit('.', 1)[-1]}.{val.__name__}")
            setattr(mod, attr, wrapped[id(val)])
    return len(wrapped)


def sync_sites(fn: Callable[[], Any]) -> list[str]:
    """The innermost package frame (file:line function) of each host synchronisation."""
    sites: list[str] = []
    saved = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchroniz" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "sparseprefill" in f.filename or "/fast/" in f.filename or "/reference/" in f.filename]
        f = frames[-1] if frames else None
        sites.append(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" if f else "?")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = saved
    return sites


def kernel_table(fn: Callable[[], Any]) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sorted(((e.key, e.count, e.device_time_total / 1e3) for e in events
                      if e.device_time_total > 0 and e.device_type.name == "CUDA"), key=lambda t: -t[2])
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                        "cudaLaunchKernelExC"))
    return {"gpu_busy_ms": sum(t[2] for t in kernels), "launches": launches, "kernel_kinds": len(kernels),
            "kernel_count": sum(t[1] for t in kernels),
            "top": [{"kernel": name[:90], "count": c, "ms": ms} for name, c, ms in kernels[:14]]}


def profile_one(label: str, fn: Callable[[], Any], tree: StageTree, log: Callable[[str], None]) -> dict[str, Any]:
    fn()
    torch.cuda.synchronize()
    ms = es._ms(fn)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    kt = kernel_table(fn)
    sites = sync_sites(fn)
    tree.records.clear()
    tree.active = True
    try:
        fn()
    finally:
        tree.active = False
    stages = tree.rows()
    log(f"{label}: do_bench {ms:.3f} ms, one call {wall:.3f} ms, GPU busy {kt['gpu_busy_ms']:.3f} ms, "
        f"{kt['launches']} launches ({kt['kernel_count']} kernels), {len(sites)} syncs")
    for s in sorted(set(sites)):
        log(f"    sync x{sites.count(s)} {s}")
    for t in kt["top"]:
        log(f"    {t['ms']:8.3f} ms x{t['count']:3d} {t['kernel']}")
    for r in stages:
        if r["gpu_span_ms"] >= 0.01 or r["depth"] <= 1:
            log(f"    {'  ' * r['depth']}{r['name']:<{48 - 2 * r['depth']}s} x{r['calls']:3d} "
                f"span {r['gpu_span_ms']:8.3f} ms host {r['host_ms']:8.3f} ms")
    return {"method": label, "ms": ms, "wall_ms": wall, **kt, "syncs": len(sites), "sync_sites": sites,
            "stages": stages}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="*", default=[32768])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--methods", nargs="*", default=None, help="label prefixes")
    parser.add_argument("--cache", default="/tmp/estimator_stages")
    parser.add_argument("--json", default=None)
    parser.add_argument("--tag", default="after")
    args = parser.parse_args(argv)

    def log(line: str) -> None:
        print(f"[{args.tag}] {line}", flush=True)

    import triton

    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    log(str(env))
    out: list[dict[str, Any]] = []
    tree = StageTree()
    with torch.no_grad():
        for n in args.seqlens:
            q, k, v = es.workload(n, torch.device("cuda"), args.cache, head_dim=args.head_dim)
            dense_ms, _ = es.cudnn_ms(q, k, v)
            log(f"N={n} D={args.head_dim} cuDNN dense {dense_ms:.3f} ms")
            entries = esh.plans(n, q, k, dense_ms)
            install(tree)
            for label, fn, _floor in entries:
                if args.methods and not any(label.startswith(m) for m in args.methods):
                    continue
                try:
                    row = profile_one(f"N={n} {label}", fn, tree, log)
                except Exception as exc:  # noqa: BLE001 - one failing method is one log line
                    log(f"N={n} {label}: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                row.update({"seqlen": n, "head_dim": args.head_dim, "label": label, "dense_ms": dense_ms,
                            "share": row["ms"] / dense_ms})
                out.append(row)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump({"environment": env, "rows": out}, f, indent=1)
            del q, k, v
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
