"""`floor`: every method's kernel on its default plan against the floor `density x cuDNN`.

Per N on the selected workload: cuDNN SDPA dense (the baseline) and our own dense plan on
the block/column kernel (`own dense`), then for every plan-based method its `fast` plan
at its defaults (built once) and the kernel alone on it (`kernel_ms`); `kernel_vs_floor`
is the kernel over `density x cuDNN` and `extra["vs_own_dense"]` the kernel over
`density x our dense` (what is left once our dense rate is taken out). `extra` has the
plan's cost to the kernel (`common.plan_stats`: column capacity `C`, mean columns per
query block, `tile_share`: kept pairs over the pairs the kernel's tiles compute).

A method without a plan: on a GPU the CUDA time of its block/column launches per call
(torch.profiler, kernels named `_block_column_fwd`), beside its end-to-end time; on a CPU
its end-to-end time alone. `--plans` adds named plans (`common.named_plan`), by default
a random plan with a fifth of its area in columns and its block-only twin.
"""

from __future__ import annotations

import functools
from typing import Any

from ..common import (
    BLOCK,
    Context,
    Option,
    Row,
    Suite,
    Unit,
    baseline_unit,
    named_plan,
    params_text,
    piece,
    plan_stats,
    profiled_kernels,
)
from .kernels import split_plans

EXTRA_PLANS = "columns20,blocks-like:columns20"


class _OwnDense:
    """Our dense kernel's time per N (the `own dense` row), measured once."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.ms: dict[int, float] = {}

    def rows(self, n: int) -> list[Row]:
        from ... import fast
        from ...fast.kernels import block_column_attention

        q, k, v = self.ctx.inputs(n)
        plan = fast.dense_plan(q, k)
        ms = self.ctx.time(lambda: block_column_attention(q, k, v, plan, validate_plan=False))
        self.ms[n] = ms
        return [self.ctx.row("dense (own kernel)", "sparseprefill", n, ms=ms, kernel_ms=ms, density=1.0)]

    def at(self, n: int) -> float:
        if n not in self.ms:
            self.rows(n)
        return self.ms[n]


def plan_rows(ctx: Context, n: int, label: str, plan: Any, own: _OwnDense, extra: dict[str, Any]) -> list[Row]:
    """The kernel on one plan against the floor (see the module doc)."""
    from ... import fast
    from ...fast.kernels import block_column_attention

    q, k, v = ctx.inputs(n)
    dens = float(fast.density(plan).mean())
    ms = ctx.time(lambda: block_column_attention(q, k, v, plan, validate_plan=False))
    stats = plan_stats(plan)
    extra = {**extra, **stats, "vs_own_dense": ms / (dens * own.at(n))}
    row = ctx.row(label, "sparseprefill", n, ms=ms, kernel_ms=ms, density=dens, extra=extra)
    ctx.log(f"N={n}: {label} kernel {ms:.3f} ms, x{row.kernel_vs_floor} floor, x{extra['vs_own_dense']:.2f} own "
            f"dense, tile share {stats['tile_share']:.2f}, C {stats['C']}")
    return [row]


def method_rows(ctx: Context, n: int, name: str, own: _OwnDense) -> list[Row]:
    from ...methods import get

    spec = get(name)
    q, k, v = ctx.inputs(n)
    call = spec.call_params(spec.demo_params(n), q)
    if spec.plan_based:
        plan = spec.plan_fn("fast")(q, k, **call)
        return plan_rows(ctx, n, name, plan, own, {"kind": "method default", "params": params_text(call)})
    run = spec.run_fn("fast")
    e2e = ctx.time(lambda: run(q, k, v, **call))
    dens = float(spec.method_view("fast", q, k, v, call, with_recall=False).density.mean())
    launches = profiled_kernels(lambda: run(q, k, v, **call), match="_block_column_fwd")
    extra: dict[str, Any] = {"kind": "no plan", "params": params_text(call), "e2e_ms": e2e}
    if launches is None:
        extra["note"] = "on a CPU: end to end only (the attention launches are profiled on a GPU)"
        return [ctx.row(name, "sparseprefill", n, ms=e2e, density=dens, extra=extra)]
    kern = float(launches["matched_ms"])
    extra.update(gpu_ms=launches["gpu_ms"], vs_own_dense=kern / (dens * own.at(n)))
    return [ctx.row(name, "sparseprefill", n, ms=kern, kernel_ms=kern, density=dens, extra=extra)]


def named_plan_rows(ctx: Context, n: int, label: str, block: int, own: _OwnDense) -> list[Row]:
    q, k, _ = ctx.inputs(n)
    return plan_rows(ctx, n, label, named_plan(label, q, k, block=block), own, {"kind": "named plan"})


def units(ctx: Context, seqlens: list[int], *, plans: str = EXTRA_PLANS, block: int | None = None) -> list[Unit]:
    own = _OwnDense(ctx)
    size = block or (128 if ctx.on_gpu else 16)
    out: list[Unit] = []
    for n in seqlens:
        out.append(baseline_unit(ctx, n))
        out.append(Unit(f"{n}/dense (own kernel)", n, functools.partial(own.rows, n)))
        for name in ctx.method_names():
            out.append(piece(ctx, name, n, method_rows, ctx, n, name, own))
        for label in split_plans(plans):
            out.append(piece(ctx, label, n, named_plan_rows, ctx, n, label, size, own))
    return out


SUITE = Suite(
    name="floor",
    about="every method's kernel on its default plan against density x cuDNN and density x our dense kernel",
    seqlens=(32768, 131072),
    units=units,
    options=(Option("--plans", "plans", str, EXTRA_PLANS, "plans by name (see `kernels`)"), BLOCK),
)
