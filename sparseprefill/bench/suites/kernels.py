"""`kernels`: the block/column kernel on given plans, beside cuDNN SDPA, flash SDPA and FlexAttention.

Per N: cuDNN SDPA dense (the baseline) and flash SDPA; then for each plan (`--plans`,
default dense, streaming 1K + 8K, random causal blocks at 5% and 20%) the plan's build
time (`plan_ms`, not for the random plans, which are drawn on the host), our kernel on
it, and FlexAttention given the same plan (`common.flex_block_mask`), with the
difference of its output from ours. The dense plan's output is compared with cuDNN's.
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
    flex_row,
    named_plan,
    piece,
)

PLANS = "dense,streaming:sink=1024,window=8192,random5,random20"


def split_plans(text: str) -> list[str]:
    """"dense,streaming:sink=1024,window=8192,random5" -> ["dense", "streaming:sink=1024,window=8192",
    "random5"]: an item `key=value` without a `:` continues the plan before it."""
    out: list[str] = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        if "=" in item and ":" not in item and out:
            out[-1] += "," + item
        else:
            out.append(item)
    return out


def _flash_rows(ctx: Context, n: int) -> list[Row]:
    if not ctx.on_gpu:
        return []
    q, k, v = ctx.inputs(n)
    try:
        ms = ctx.time(ctx.dense_attention(q, k, v, backend="flash"))
    except RuntimeError as exc:
        ctx.log(f"N={n}: flash SDPA failed: {exc}")
        return []
    return [ctx.row("dense", "flash SDPA", n, ms=ms, kernel_ms=ms, density=1.0, recall_mean=1.0, recall_min=1.0)]


def _plan_rows(ctx: Context, n: int, name: str, block: int) -> list[Row]:
    from ... import fast

    q, k, v = ctx.inputs(n)

    def make() -> Any:
        return named_plan(name, q, k, block=block)

    plan = make()
    drawn = name.startswith(("random", "columns", "blocks-like", "minference-lines"))
    plan_ms = None if drawn else ctx.time(make)
    dens = float(fast.density(plan).mean())
    out = fast.sparse_attention(q, k, v, plan)
    extra: dict[str, Any] = {"plan": name, "block_m": plan.block_m, "block_n": plan.block_n}
    if dens == 1.0:  # every causal key: the output must be the baseline's
        ref = ctx.dense_attention(q, k, v)()
        extra["rel_err_vs_baseline"] = float((out.float() - ref.float()).norm() / ref.float().norm())
    kernel_ms = ctx.time(lambda: fast.sparse_attention(q, k, v, plan))
    recall = ctx.recall(q, k, plan)
    rows = [ctx.row(name, "sparseprefill", n, ms=kernel_ms + (plan_ms or 0.0), density=dens, recall=recall,
                    plan_ms=plan_ms, kernel_ms=kernel_ms, extra=extra)]
    ctx.log(f"N={n}: {name} ours {kernel_ms:.2f} ms (plan {plan_ms}) density {dens:.4f}")
    return rows + flex_row(ctx, name, plan, q, k, v, out, recall=recall)


def units(ctx: Context, seqlens: list[int], *, plans: str = PLANS, block: int | None = None) -> list[Unit]:
    size = block or (128 if ctx.on_gpu else 16)
    out: list[Unit] = []
    for n in seqlens:
        out.append(baseline_unit(ctx, n))
        out.append(Unit(f"{n}/flash SDPA", n, functools.partial(_flash_rows, ctx, n)))
        for name in split_plans(plans):
            out.append(piece(ctx, name, n, _plan_rows, ctx, n, name, size))
    return out


SUITE = Suite(
    name="kernels",
    about="dense, streaming and random-block plans (5%, 20%): our kernel, FlexAttention on the same plan, "
          "cuDNN and flash SDPA dense",
    seqlens=(8192, 32768, 131072),
    units=units,
    options=(Option("--plans", "plans", str, PLANS,
                    "kernels / floor / variants: plans by name (dense, randomP, columns20, minference-lines, a "
                    "method, METHOD:key=value, blocks-like:NAME)"),
             BLOCK),
)

