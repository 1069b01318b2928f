"""`scale`: every registered method at 512K and 1M tokens on one GPU: time and peak memory per stage.

Inputs: `common.structured_qkv` (built on the device; `--qkv` a capture). Per N: the
baseline (one synchronised call), then each method (`--methods`) at its defaults, each
stage run once after a warm-up at `--warmup-seqlen` (compiles out of the way), with
`torch.cuda.reset_peak_memory_stats` before it:

* a plan-based method: `plan` (its `fast` `*_plan`: estimate, selection, lists; the plan's
  bytes in `extra["plan_gib"]`) and `kernel` (`fast.sparse_attention` on it);
* a method without a plan, or a plan refused as too large for all heads at once (a
  `MemoryError` naming what it needs): `run`, the end-to-end function (which may plan
  its heads in groups that fit).

Per stage (`extra["stages"]`): seconds, peak GiB allocated and the peak above what was
allocated when the stage began (q, k, v; for the kernel also the plan), and its status:
`ok`, `refused` (with the message) or `oom` (a CUDA out-of-memory error: a bug, the
method should have refused). `--budget-s` stops starting new pieces once that much time
has passed (what ran is kept).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from ..common import (
    Context,
    Option,
    Row,
    Suite,
    Unit,
    params_text,
    structured_qkv,
    wall_ms,
)

GIB = 2.0**30


def _inputs(ctx: Context, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if ctx.qkv is not None:
        return ctx.inputs(n)
    key = (n, -1)
    if key not in ctx._inputs:
        ctx._inputs.clear()
        ctx.free()
        ctx._inputs[key] = structured_qkv(n, batch=ctx.batch, q_heads=ctx.q_heads, kv_heads=ctx.kv_heads,
                                          head_dim=ctx.head_dim, dtype=ctx.dtype, device=ctx.device)
    return ctx._inputs[key]


def stage(ctx: Context, fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """Run `fn` once: (its result or None, {s, peak_gib, above_gib, status[, error]})."""
    cuda = ctx.on_gpu
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    out: Any = None
    rec: dict[str, Any] = {"status": "ok"}
    try:
        out = fn()
        if cuda:
            torch.cuda.synchronize()
    except torch.OutOfMemoryError as err:
        rec = {"status": "oom", "error": str(err).splitlines()[0][:300]}
    except MemoryError as err:
        rec = {"status": "refused", "error": str(err)[:400]}
    rec["s"] = round(time.perf_counter() - t0, 4)
    if cuda:
        rec["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
        rec["above_gib"] = round((torch.cuda.max_memory_allocated() - base) / GIB, 3)
    return out, rec


def method_rows(ctx: Context, n: int, name: str, warmup_seqlen: int) -> list[Row]:
    from ... import fast
    from ...methods import get

    spec = get(name)
    if warmup_seqlen:
        wq, wk, wv = structured_qkv(warmup_seqlen, batch=1, q_heads=ctx.q_heads, kv_heads=ctx.kv_heads,
                                    head_dim=ctx.head_dim, dtype=ctx.dtype, device=ctx.device)
        spec.run_fn("fast")(wq, wk, wv, **spec.call_params(spec.demo_params(warmup_seqlen), wq))
        del wq, wk, wv
    q, k, v = _inputs(ctx, n)
    params = spec.call_params(spec.demo_params(n), q)
    stages: dict[str, Any] = {}
    dens = None
    plan_s = kernel_s = None
    plan_gib = None
    if spec.plan_based:
        plan, stages["plan"] = stage(ctx, lambda: spec.plan_fn("fast")(q, k, **params))
        if plan is not None:
            scale = params.get("scale")
            _, stages["kernel"] = stage(ctx, lambda: fast.sparse_attention(q, k, v, plan, scale=scale))
            plan_gib = round(plan.nbytes() / GIB, 3)
            dens = float(fast.density(plan).mean())
            plan_s, kernel_s = stages["plan"]["s"], stages["kernel"]["s"]
        del plan
        if stages["plan"]["status"] == "refused":
            ctx.free()
            _, stages["run"] = stage(ctx, lambda: spec.run_fn("fast")(q, k, v, **params))
    else:
        _, stages["run"] = stage(ctx, lambda: spec.run_fn("fast")(q, k, v, **params))
    ctx.free()
    total = sum(float(s["s"]) for s in stages.values())
    bad = [s["status"] for s in stages.values() if s["status"] != "ok"]
    status = bad[0] if bad else "ok"
    if "run" in stages and "plan" in stages and stages["run"]["status"] == "ok":
        status = "ok (end to end; the whole plan refused)"
    ctx.log(f"N={n} {name}: {status}, {total:.2f} s " + ", ".join(
        f"{key} {s['s']:.2f} s" + (f" {s['peak_gib']:.1f} GiB" if "peak_gib" in s else "")
        for key, s in stages.items()))
    base = ctx._baselines[n].ms if n in ctx._baselines else math.nan
    return [ctx.row(name, "sparseprefill", n, ms=total * 1e3, density=dens, baseline_ms=base,
                    plan_ms=None if plan_s is None else plan_s * 1e3,
                    kernel_ms=None if kernel_s is None else kernel_s * 1e3,
                    extra={"params": params_text(params), "stages": stages, "plan_gib": plan_gib, "status": status})]


def units(ctx: Context, seqlens: list[int], *, warmup_seqlen: int | None = None, budget_s: float = 1e9) -> list[Unit]:
    warm = (16384 if ctx.on_gpu else 0) if warmup_seqlen is None else warmup_seqlen
    start = time.perf_counter()

    def within(label: str, n: int, fn: Callable[..., list[Row]], *args: Any) -> list[Row]:
        if time.perf_counter() - start > budget_s:
            ctx.log(f"N={n} {label}: not started (--budget-s {budget_s:g} s spent)")
            return [Row(label, "sparseprefill", n, suite=ctx.suite, extra={"status": "not run: budget spent"})]
        try:
            return fn(*args)
        except (RuntimeError, ValueError, TypeError) as exc:
            message = f"{type(exc).__name__}: {str(exc)[:300]}"
            ctx.log(f"N={n} {label}: {message}")
            return [Row(label, "sparseprefill", n, suite=ctx.suite, extra={"error": message})]

    def baseline(n: int) -> list[Row]:
        q, k, v = _inputs(ctx, n)
        ms = wall_ms(ctx.dense_attention(q, k, v))
        ctx._baselines[n] = Row("dense", ctx.baseline_name, n, density=1.0, ms=ms, kernel_ms=ms, baseline_ms=ms,
                                baseline=ctx.baseline_name, speedup_vs_cudnn=1.0, suite=ctx.suite,
                                timer="wall clock, one call")
        ctx.free()
        return [ctx._baselines[n]]

    out: list[Unit] = []
    for n in seqlens:
        out.append(Unit(f"{n}/{ctx.baseline_name}", n, functools.partial(within, "dense", n, baseline, n)))
        for name in ctx.method_names():
            out.append(Unit(f"{n}/{name}", n, functools.partial(within, name, n, method_rows, ctx, n, name, warm)))
    return out


SUITE = Suite(
    name="scale",
    about="every method at 512K and 1M end to end: time and peak memory per stage, plan bytes",
    seqlens=(524288, 1048576),
    units=units,
    options=(Option("--warmup-seqlen", "warmup_seqlen", int, None,
                    "scale: a run at this N before each method's stages (0: none; default 16384 on a GPU)"),
             Option("--budget-s", "budget_s", float, 1e9, "scale: start no piece after this many seconds")),
)
