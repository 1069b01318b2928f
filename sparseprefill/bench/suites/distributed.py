"""`distributed`: context-parallel estimates and bytes moved, and head- / context-parallel timings.

Modes (`--dist-modes`; default `head,context` under torchrun, `bytes` in one process):

* `bytes` (one process, no traffic): every plan-based method's `fast` plan (`reference` on
  a CPU) at its defaults on the inputs, split over `ZigZagLayout(N, W, --align)` for each
  `--worlds` W: the K/V rows and ask bits every rank would fetch (`fetch_bytes`) against
  what ring attention moves (`ring_bytes`), with the method's estimate kind and what it
  reads (`Method.distributed`, or all of q and k gathered);
* `head`, `context` (under torchrun, one process per GPU, or per CPU rank with gloo):
  per method and N, on the same inputs on every rank: the method on the whole problem on
  one device, `head_parallel_attention` on the rank's heads (output left sharded, and
  gathered), `context_parallel_attention` on the rank's zig-zag chunks; the median of
  `--reps` timed calls after a warm-up, each the slowest rank's time (all-reduce max).
  Efficiency is `one / (W * parallel)`. Context-parallel bytes are the `Traffic` summed
  over ranks (estimate, index, K/V), against ring attention; the largest difference of
  each parallel output from the one-device output is a check.

Launch the timed modes with torchrun:

    torchrun --standalone --nproc-per-node 2 -m sparseprefill.cli bench distributed \\
        --seqlens 256K,1M --json results/distributed.json

Inputs: `common.structured_qkv` (built on the device in seconds at 1M; every rank draws
the same tensors), or `--qkv` a capture.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ... import distributed as D
from ..common import (
    Context,
    Option,
    Row,
    Suite,
    Unit,
    params_text,
    piece,
    ratio,
    structured_qkv,
)

DEFAULT_SEQLENS = (262144, 524288, 1048576)


def default_methods() -> list[str]:
    """Every registered method whose descriptor has a distributed estimate of its own."""
    from ...methods import methods

    return [name for name, m in methods().items() if m.distributed is not None]


def setup() -> tuple[torch.device, str]:
    """Initialise the process group from torchrun's environment; (device, backend).

    Raises:
        SystemExit: not launched by torchrun.
    """
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise SystemExit("sparseprefill bench distributed --dist-modes head,context: launch it with torchrun, "
                             "e.g. torchrun --standalone --nproc-per-node 2 -m sparseprefill.cli bench distributed")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    backend = str(dist.get_backend())
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return device, backend


def rank_timer(device: torch.device, reps: int) -> Callable[[Callable[[], Any]], float]:
    """Median ms of `reps` calls after one warm-up, each the slowest rank's (all-reduce max)."""
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


def random_qkv(batch: int, q_heads: int, kv_heads: int, n: int, head_dim: int, dtype: torch.dtype,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random normal q, k, v seeded by N (the same on every rank)."""
    gen = torch.Generator(device=device).manual_seed(n)
    return (torch.randn(batch, q_heads, n, head_dim, generator=gen, device=device, dtype=dtype),
            torch.randn(batch, kv_heads, n, head_dim, generator=gen, device=device, dtype=dtype),
            torch.randn(batch, kv_heads, n, head_dim, generator=gen, device=device, dtype=dtype))


def parallel_row(method: str, n: int, *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, modes: list[str],
                 impl: str, align: int, measure: Callable[[Callable[[], Any]], float]) -> dict[str, Any]:
    """One method at N: one device, head-parallel and context-parallel (see the module doc)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    spec = D.method_spec(method)
    batch, kv_heads, head_dim = int(q.shape[0]), int(k.shape[1]), int(q.shape[3])
    params = spec.demo_params(n)
    row: dict[str, Any] = {"method": method, "seqlen": n, "world": world, "impl": impl,
                           "params": params_text(params)}
    run = spec.run_fn(impl)
    call = spec.call_params(params, q)
    one_out = run(q, k, v, **call)
    row["one_ms"] = measure(lambda: run(q, k, v, **call))
    if "head" in modes:
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
        layout = D.ZigZagLayout(n, world, align)
        qs, ks, vs = (layout.shard(x, rank) for x in (q, k, v))
        if q.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(q.device)
        res = D.context_parallel_attention(qs, ks, vs, method=method, params=params, layout=layout, impl=impl)
        row["context_ms"] = measure(lambda: D.context_parallel_attention(
            qs, ks, vs, method=method, params=params, layout=layout, impl=impl))
        row["context_efficiency"] = row["one_ms"] / (world * row["context_ms"])
        row["estimate"] = res.plan.estimate
        row["bytes"] = res.traffic.reduced().as_dict()
        row["ring_bytes"] = D.ring_bytes(layout, batch=batch, kv_heads=kv_heads, head_dim=head_dim,
                                         itemsize=q.element_size())
        row["bytes_vs_ring"] = row["bytes"]["total"] / row["ring_bytes"]
        full = D.context_parallel_attention(qs, ks, vs, method=method, params=params, layout=layout, impl=impl,
                                            gather_output=True).out
        row["context_max_diff"] = _max_diff(full, one_out)
        if q.device.type == "cuda":
            row["context_peak_gib"] = torch.cuda.max_memory_allocated(q.device) / 2**30
        del qs, ks, vs, res, full
    return row


def run_rows(seqlens: list[int], methods: list[str], *, modes: list[str], batch: int, q_heads: int, kv_heads: int,
             head_dim: int, dtype: torch.dtype, impl: str, align: int, reps: int, dense_max: int,
             device: torch.device, log: Callable[[str], None],
             inputs: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
             ) -> list[dict[str, Any]]:
    """`parallel_row` for each N and method (every rank calls it); `inputs(N)` gives q, k, v
    (default: random normal, seeded by N)."""
    from ...methods import DENSE

    measure = rank_timer(device, reps)
    rows: list[dict[str, Any]] = []
    for n in seqlens:
        for method in methods:
            if method == DENSE and n > dense_max:
                continue
            q, k, v = (inputs(n) if inputs is not None
                       else random_qkv(batch, q_heads, kv_heads, n, head_dim, dtype, device))
            log(f"[N={n} {method}] {', '.join(modes)}")
            rows.append(parallel_row(method, n, q=q, k=k, v=v, modes=modes, impl=impl, align=align, measure=measure))
            del q, k, v
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A fixed-width table of `run_rows`' rows: times, efficiencies, bytes moved against a dense ring."""
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


def bytes_rows(ctx: Context, n: int, method: str, worlds: list[int], align: int) -> list[Row]:
    """The `bytes` mode's rows of one method at N: one per world size (see the module doc)."""
    from ... import fast, reference

    spec = D.method_spec(method)
    q, k, _ = _inputs(ctx, n)
    impl = "fast" if ctx.on_gpu else "reference"
    params = spec.call_params(spec.demo_params(n), q)
    plan = spec.plan_fn(impl)(q, k, **params)
    dens = float((fast if ctx.on_gpu else reference).density(plan).mean())
    kind = D.estimate_kind(method)
    native = spec.distributed
    needs = native.needs if native is not None and kind != "gather" else D.GATHER_NEEDS
    rows = []
    for world in worlds:
        layout = D.ZigZagLayout(n, world, align)
        layout.check_blocks(plan.block_m, plan.block_n)
        fetched = D.fetch_bytes([D.split_plan(plan, layout, r) for r in range(world)], layout,
                                kv_heads=int(k.shape[1]), head_dim=int(k.shape[3]), itemsize=k.element_size())
        ring = D.ring_bytes(layout, batch=int(k.shape[0]), kv_heads=int(k.shape[1]), head_dim=int(k.shape[3]),
                            itemsize=k.element_size())
        rows.append(Row(method, f"context-parallel W={world} (bytes)", n, density=dens, suite=ctx.suite,
                        extra={"world": world, "estimate": kind, "estimate_needs": needs, **fetched,
                               "ring": ring, "kv_vs_ring": ratio(fetched["kv"], ring),
                               "params": params_text(params)}))
        ctx.log(f"N={n} {method} W={world}: kv/ring {fetched['kv'] / ring:.3f} ({kind} estimate)")
    return rows


def _inputs(ctx: Context, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if ctx.qkv is not None:
        return ctx.inputs(n)
    return structured_qkv(n, batch=ctx.batch, q_heads=ctx.q_heads, kv_heads=ctx.kv_heads, head_dim=ctx.head_dim,
                          dtype=ctx.dtype, device=ctx.device)


def _modes(text: str) -> list[str]:
    if text == "auto":
        return ["head", "context"] if "WORLD_SIZE" in os.environ else ["bytes"]
    modes = [m for m in text.split(",") if m]
    bad = set(modes) - {"bytes", "head", "context"}
    if bad:
        raise SystemExit(f"--dist-modes: unknown modes {sorted(bad)} (bytes, head, context)")
    if "bytes" in modes and len(modes) > 1:
        raise SystemExit("--dist-modes: bytes runs in one process, head and context under torchrun: run them apart")
    return modes


def prepare(ctx: Context, options: dict[str, Any]) -> None:
    """Join the process group when a timed mode runs (rank 0 alone prints and writes)."""
    if _modes(str(options["dist_modes"])) == ["bytes"]:
        return
    device, _ = setup()
    ctx.device, ctx.rank = device, dist.get_rank()
    if ctx.rank != 0:
        ctx.log = lambda line: None


def units(ctx: Context, seqlens: list[int], *, dist_modes: str = "auto", impl: str | None = None, align: int = 128,
          reps: int = 3, dense_max: int = 262144, worlds: str = "2,4,8") -> list[Unit]:
    modes = _modes(dist_modes)
    names = list(ctx.methods) if ctx.methods is not None else None
    out: list[Unit] = []
    if modes == ["bytes"]:
        from ...methods import get

        chosen = names or [name for name in ctx.method_names() if get(name).plan_based]
        sizes = [int(w) for w in worlds.split(",") if w]
        for n in seqlens:
            for method in chosen:
                out.append(piece(ctx, f"{method} bytes", n, bytes_rows, ctx, n, method, sizes, align))
        return out
    impl_name = impl or ("fast" if ctx.device.type == "cuda" else "reference")
    measure = rank_timer(ctx.device, reps)
    from ...methods import DENSE

    for n in seqlens:
        for method in names or default_methods():
            if method == DENSE and n > dense_max:
                continue

            def one(n: int = n, method: str = method) -> list[Row]:
                q, k, v = _inputs(ctx, n)
                r = parallel_row(method, n, q=q, k=k, v=v, modes=modes, impl=impl_name, align=align, measure=measure)
                rows = [Row(method, "one device", n, ms=r["one_ms"], suite=ctx.suite, extra=r)]
                if "head_ms" in r:
                    rows.append(Row(method, f"head-parallel W={r['world']}", n, ms=r["head_ms"], suite=ctx.suite,
                                    extra={"efficiency": r["head_efficiency"], "gather_ms": r["head_gather_ms"],
                                           "max_diff": r["head_max_diff"]}))
                if "context_ms" in r:
                    rows.append(Row(method, f"context-parallel W={r['world']}", n, ms=r["context_ms"],
                                    suite=ctx.suite, extra={"efficiency": r["context_efficiency"],
                                                            "estimate": r["estimate"], "bytes": r["bytes"],
                                                            "bytes_vs_ring": r["bytes_vs_ring"],
                                                            "max_diff": r["context_max_diff"]}))
                if ctx.rank == 0:
                    print(format_rows([r]), file=sys.stderr, flush=True)
                return rows

            out.append(Unit(f"{n}/{method} parallel", n, one))
    return out


def summary(rows: list[Row]) -> str:
    """The bytes rows as a table (kv and index bytes against a ring), then the timed rows (`format_rows`)."""
    lines = []
    accounted = [r for r in rows if "kv_vs_ring" in r.extra]
    if accounted:
        lines.append(f"{'method':<18} {'N':>8} {'W':>3} {'estimate':<8} {'density':>8} {'kv MB':>10} {'index MB':>9} "
                     f"{'ring MB':>10} {'kv/ring':>8}")
        for r in accounted:
            x = r.extra
            lines.append(f"{r.method:<18} {r.seqlen:>8} {x['world']:>3} {x['estimate']:<8} {r.density or 0:>8.4f} "
                         f"{x['kv'] / 1e6:>10.2f} {x['index'] / 1e6:>9.3f} {x['ring'] / 1e6:>10.2f} "
                         f"{x['kv_vs_ring']:>8.3f}")
    timed = [r.extra for r in rows if r.impl == "one device"]
    if timed:
        lines.append(format_rows(timed))
    return "\n".join(lines)


SUITE = Suite(
    name="distributed",
    about="context-parallel estimate and bytes moved (one process), head- and context-parallel timings "
          "(under torchrun)",
    seqlens=DEFAULT_SEQLENS,
    units=units,
    options=(Option("--dist-modes", "dist_modes", str, "auto",
                    "distributed: bytes (one process) or head,context (torchrun); auto picks by the launch"),
             Option("--impl", "impl", str, None, "distributed: fast (default on CUDA) or reference"),
             Option("--align", "align", int, 128, "distributed: chunk boundaries, a multiple of every block size"),
             Option("--reps", "reps", int, 3, "distributed: timed calls per row"),
             Option("--dense-max", "dense_max", int, 262144, "distributed: longest N for dense"),
             Option("--worlds", "worlds", str, "2,4,8", "distributed bytes: world sizes accounted")),
    summary=summary,
    prepare=prepare,
)
