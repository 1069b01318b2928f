"""`sparseprefill bench --distributed`: head- and context-parallel prefill under torchrun.

Launch one process per GPU (or per CPU rank with gloo):

    torchrun --standalone --nproc-per-node 2 -m sparseprefill.cli bench --distributed \\
        --seqlens 262144,1048576 --json benches/results/h200x2-distributed.json

Every rank draws the same random q, k, v (seeded per N), and for each method and N
measures, on the same inputs in the same run:

* one device: the method's `run_fn` on the whole problem (every rank runs it at once,
  on its own device, so the figure is one device's time);
* head-parallel: `head_parallel_attention` on the rank's heads, output left sharded
  (what a tensor-parallel layer takes) and gathered;
* context-parallel: `context_parallel_attention` on the rank's zig-zag chunks,
  output left sharded;

the median of `--reps` timed calls after one warm-up, each the slowest rank's time
(all-reduce max). Scaling efficiency is `one / (W * parallel)`. Bytes are the
context-parallel `Traffic` summed over ranks, against `ring_bytes` (ring attention).
The largest difference of each parallel output from the one-device output is
printed as a check. NCCL on CUDA, gloo on CPU (tiny sizes; time means nothing there).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from . import distributed as D
from .methods import DENSE

# Default `--dist-methods`: every method whose descriptor has a distributed estimate of
# its own (`Method.distributed`); the others gather all of q and k.
def default_methods() -> str:
    from .methods import methods

    return ",".join(name for name, m in methods().items() if m.distributed is not None)


DEFAULT_SEQLENS = "262144,524288,1048576"


def bench_params(method: str, seqlen: int) -> dict[str, Any]:
    """The parameters a method runs with here, on random q and k: its descriptor's
    `params_on_random` (the defaults, except where they would not behave as on real
    heads: vertical-slash keeps MInference's budgets with the nearest diagonals forced)."""
    return D.method_spec(method).params_on_random(seqlen)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `--distributed` (added to `sparseprefill bench`)."""
    parser.add_argument("--distributed", action="store_true",
                        help="head- and context-parallel prefill over torch.distributed; launch with torchrun "
                             f"(default N {DEFAULT_SEQLENS}; see docs/distributed.md)")
    parser.add_argument("--dist-methods", default=None,
                        help="--distributed: registered methods (default: those with a distributed "
                             "estimate of their own)")
    parser.add_argument("--dist-modes", default="head,context",
                        help="--distributed: head, context or both (default head,context)")
    parser.add_argument("--impl", choices=D.IMPLS, default=None,
                        help="--distributed: fast (default on CUDA) or reference (default on CPU)")
    parser.add_argument("--align", type=int, default=128,
                        help="--distributed: context-parallel chunk boundaries, a multiple of every block "
                             "size (default 128)")
    parser.add_argument("--reps", type=int, default=3, help="--distributed: timed calls per row (default 3)")
    parser.add_argument("--dense-max", type=int, default=262144,
                        help="--distributed: longest N for dense (its one-device run is the slow one; "
                             "default 262144)")


def _setup() -> tuple[torch.device, str]:
    """Initialise the process group from torchrun's environment; (device, backend)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise SystemExit("sparseprefill bench --distributed: launch it with torchrun, e.g. "
                             "torchrun --standalone --nproc-per-node 2 -m sparseprefill.cli bench --distributed")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    backend = str(dist.get_backend())
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return device, backend


def _timer(device: torch.device, reps: int) -> Callable[[Callable[[], Any]], float]:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def measure(fn: Callable[[], Any]) -> float:
        fn()
        times = []
        for _ in range(reps):
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            sync()
            elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64,
                                   device=device if device.type == "cuda" else "cpu")
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times.append(float(elapsed.item()) * 1e3)
        return statistics.median(times)

    return measure


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.to(torch.float32) - b.to(torch.float32)).abs().max().item())


def run_rows(
    seqlens: list[int],
    methods: list[str],
    *,
    modes: list[str],
    batch: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    impl: str,
    align: int,
    reps: int,
    dense_max: int,
    device: torch.device,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """One row per (N, method) with the timings, efficiencies, bytes and checks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    measure = _timer(device, reps)
    rows: list[dict[str, Any]] = []
    for n in seqlens:
        for method in methods:
            if method == DENSE and n > dense_max:
                continue
            spec = D.method_spec(method)
            gen = torch.Generator(device=device).manual_seed(n)
            q = torch.randn(batch, q_heads, n, head_dim, generator=gen, device=device, dtype=dtype)
            k = torch.randn(batch, kv_heads, n, head_dim, generator=gen, device=device, dtype=dtype)
            v = torch.randn(batch, kv_heads, n, head_dim, generator=gen, device=device, dtype=dtype)
            params = bench_params(method, n)
            row: dict[str, Any] = {"method": method, "seqlen": n, "world": world, "impl": impl,
                                   "params": {key: repr(val) for key, val in params.items()}}
            log(f"[N={n} {method}] one device")
            run = spec.run_fn(impl)
            call = spec.call_params(params, q)
            one_out = run(q, k, v, **call)
            row["one_ms"] = measure(lambda: run(q, k, v, **call))
            if "head" in modes:
                log(f"[N={n} {method}] head-parallel")
                ql, kl, vl = D.shard_heads(q, k, v, world=world, rank=rank)
                row["head_ms"] = measure(lambda: D.head_parallel_attention(
                    ql, kl, vl, method=method, params=params, impl=impl, gather_output=False))
                gathered = D.head_parallel_attention(ql, kl, vl, method=method, params=params, impl=impl)
                row["head_gather_ms"] = measure(lambda: D.head_parallel_attention(
                    ql, kl, vl, method=method, params=params, impl=impl))
                row["head_efficiency"] = row["one_ms"] / (world * row["head_ms"])
                row["head_max_diff"] = _max_diff(gathered, one_out)
                row["head_output_bytes"] = (world - 1) * gathered.numel() * gathered.element_size()
                del ql, kl, vl, gathered
            if "context" in modes and spec.plan_based:
                log(f"[N={n} {method}] context-parallel")
                layout = D.ZigZagLayout(n, world, align)
                qs, ks, vs = (layout.shard(x, rank) for x in (q, k, v))
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                res = D.context_parallel_attention(qs, ks, vs, method=method, params=params, layout=layout,
                                                   impl=impl)
                row["context_ms"] = measure(lambda: D.context_parallel_attention(
                    qs, ks, vs, method=method, params=params, layout=layout, impl=impl))
                row["context_efficiency"] = row["one_ms"] / (world * row["context_ms"])
                row["estimate"] = res.plan.estimate
                row["bytes"] = res.traffic.reduced().as_dict()
                row["ring_bytes"] = D.ring_bytes(layout, batch=batch, kv_heads=kv_heads, head_dim=head_dim,
                                                 itemsize=q.element_size())
                row["bytes_vs_ring"] = row["bytes"]["total"] / row["ring_bytes"]
                full = D.context_parallel_attention(qs, ks, vs, method=method, params=params, layout=layout,
                                                    impl=impl, gather_output=True).out
                row["context_max_diff"] = _max_diff(full, one_out)
                if device.type == "cuda":
                    row["context_peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                del qs, ks, vs, res, full
            rows.append(row)
            del q, k, v, one_out
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table: times, efficiencies, bytes moved against a dense ring."""
    head = (f"{'method':<16} {'N':>8} {'W':>2} {'one ms':>9} {'head ms':>9} {'eff':>5} {'ctx ms':>9} {'eff':>5} "
            f"{'est':<6} {'moved MB':>9} {'ring MB':>9} {'/ring':>6} {'max diff':>9}")
    lines = [head, "-" * len(head)]

    def num(x: Any, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for r in rows:
        moved = r.get("bytes", {}).get("total")
        diff = max(r.get("head_max_diff", 0.0), r.get("context_max_diff", 0.0))
        lines.append(
            f"{r['method']:<16} {r['seqlen']:>8} {r['world']:>2} {r['one_ms']:>9.2f} "
            f"{num(r.get('head_ms'), '9.2f'):>9} {num(r.get('head_efficiency'), '5.2f'):>5} "
            f"{num(r.get('context_ms'), '9.2f'):>9} {num(r.get('context_efficiency'), '5.2f'):>5} "
            f"{r.get('estimate', '-'):<6} {num(None if moved is None else moved / 1e6, '9.2f'):>9} "
            f"{num(r.get('ring_bytes', 0) / 1e6 if 'ring_bytes' in r else None, '9.2f'):>9} "
            f"{num(r.get('bytes_vs_ring'), '6.3f'):>6} {diff:>9.2e}")
    return "\n".join(lines)


def run_distributed(args: argparse.Namespace) -> int:
    """Entry point of `sparseprefill bench --distributed` (every rank runs it)."""
    device, backend = _setup()
    impl = args.impl or ("fast" if device.type == "cuda" else "reference")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    seqlens = [int(s) for s in str(args.seqlens or DEFAULT_SEQLENS).split(",") if s]
    methods = [m for m in str(args.dist_methods or default_methods()).split(",") if m]
    modes = [m for m in str(args.dist_modes).split(",") if m]
    for m in methods:
        D.method_spec(m)
    bad = set(modes) - {"head", "context"}
    if bad:
        raise SystemExit(f"--dist-modes: unknown modes {sorted(bad)} (head, context)")
    rank = dist.get_rank()

    def log(line: str) -> None:
        if rank == 0:
            print(line, file=sys.stderr, flush=True)

    rows = run_rows(seqlens, methods, modes=modes, batch=args.batch, q_heads=args.q_heads, kv_heads=args.kv_heads,
                    head_dim=args.head_dim, dtype=dtype, impl=impl, align=args.align, reps=args.reps,
                    dense_max=args.dense_max, device=device, log=log)
    if rank == 0:
        print(format_rows(rows))
        if args.json:
            from .bench import environment

            env = {**environment(), "backend": backend, "world": dist.get_world_size()}
            with open(args.json, "w") as fh:
                json.dump({"environment": env, "rows": rows}, fh, indent=1,
                          default=lambda o: None if isinstance(o, float) and math.isnan(o) else str(o))
    dist.barrier()
    dist.destroy_process_group()
    return 0
