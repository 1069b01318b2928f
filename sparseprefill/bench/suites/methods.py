"""`methods`: every registered method at its defaults, end to end, beside cuDNN SDPA.

Per N, on the selected workload: the baseline row, then per method (`--methods`, default
every registered one) the end-to-end time (`ms`: the method's `fast` function), its
plan (`plan_ms`: the `*_plan` call, estimate and index together) and the kernel on that
plan (`kernel_ms`), density and recall from the method's view, the speedup over cuDNN
and the ratios to the floor `density x cuDNN` (`vs_floor` end to end, `kernel_vs_floor`
for the kernel alone). A method without a plan (its attention reads packed keys)
reports its end-to-end time, its density and its own note (a keep ratio).

`for_method(name)` is this suite for one method: `sparseprefill bench NAME` for a method
that has no suite of its own.
"""

from __future__ import annotations

import json
from typing import Any

from ..common import (
    Context,
    Option,
    Row,
    Suite,
    Unit,
    baseline_unit,
    params_text,
    piece,
)


def method_row(ctx: Context, n: int, name: str, params: dict[str, Any] | None = None,
               label: str | None = None) -> list[Row]:
    """One method's row at N: end to end, plan and kernel (see the module doc)."""
    from ... import fast
    from ...methods import get

    spec = get(name)
    q, k, v = ctx.inputs(n)
    call = spec.call_params(spec.demo_params(n) if params is None else dict(params), q)
    run = spec.run_fn("fast")
    out = run(q, k, v, **call)
    del out
    ms = ctx.time(lambda: run(q, k, v, **call))
    view = spec.method_view("fast", q, k, v, call, with_recall=ctx.with_recall)
    dens = float(view.density.mean())
    extra: dict[str, Any] = {"params": params_text(call)}
    if view.notes:
        extra["notes"] = view.notes
    plan_ms = kernel_ms = None
    if spec.plan_based:
        plan_fn = spec.plan_fn("fast")
        plan = plan_fn(q, k, **call)
        plan_ms = ctx.time(lambda: plan_fn(q, k, **call))
        scale = call.get("scale")
        kernel_ms = ctx.time(lambda: fast.sparse_attention(q, k, v, plan, scale=scale))
        extra["plan_mb"] = plan.nbytes() / 2**20
        del plan
    row = ctx.row(label or name, "sparseprefill", n, ms=ms, density=dens, recall=view.recall, plan_ms=plan_ms,
                  kernel_ms=kernel_ms, extra=extra)
    ctx.log(f"N={n}: {label or name} {ms:.2f} ms (plan {plan_ms}, kernel {kernel_ms}) density {dens:.4f}")
    return [row]


def _params(text: str | None) -> dict[str, Any] | None:
    if not text:
        return None
    loaded = json.loads(text)
    if not isinstance(loaded, dict):
        raise ValueError(f"--params: expected a JSON object of parameters, got {text!r}")
    return loaded


def units(ctx: Context, seqlens: list[int], *, params: str | None = None,
          names: list[str] | None = None) -> list[Unit]:
    given = _params(params)
    names = ctx.method_names() if names is None else names
    if given is not None and len(names) != 1:
        raise ValueError("--params sets one method's parameters: give --methods NAME (or the suite NAME)")
    out: list[Unit] = []
    for n in seqlens:
        out.append(baseline_unit(ctx, n))
        for name in names:
            out.append(piece(ctx, name, n, method_row, ctx, n, name, given))
    return out


OPTIONS = (Option("--params", "params", str, None,
                  "methods / a method: its parameters as JSON (default: the method's defaults at N)"),)

SUITE = Suite(
    name="methods",
    about="every method at its defaults end to end: estimate / plan / kernel split, density, recall, speedup vs "
          "cuDNN, ratio to the floor density x cuDNN",
    seqlens=(32768, 131072),
    units=units,
    options=OPTIONS,
)


def for_method(name: str) -> Suite:
    """The `methods` suite for the registered method `name` alone."""
    from ...methods import get

    get(name)

    def only(ctx: Context, seqlens: list[int], *, params: str | None = None) -> list[Unit]:
        return units(ctx, seqlens, params=params, names=[name])

    return Suite(name=name, about=f"{name} at its defaults end to end, plan and kernel, beside cuDNN",
                 seqlens=SUITE.seqlens, units=only, options=OPTIONS)
