"""`variants`: the block/column kernel's tuning switches and tile configurations on named plans.

A variant (`--variants "name:KEY=VAL,KEY=VAL;name2:..."`) sets switches of
`fast.kernels.block_column` for its rows and restores them after: `KEY` is a module
switch without its underscore (`GUARD`, `NONFINITE`, `COL_SPLIT` (1, 0 or auto),
`COL_TILE`, `COL_PREFETCH`, `PREFETCH`, `TILE_MAJOR`, `FLAT_TMA`, `WARP_SPEC`, ...: each
launch reads them), `TILE` a tile configuration `BM.BN.warps.stages` (the kernel's
`SPARSEPREFILL_TILE`), `BUDGET_GIB` the front door's budget for per-block column lists,
and the Hopper path's switches (`fast.kernels.block_column_hopper.apply_switches`):
`HOPPER` 1 / 0 (the sm90 path, or the portable kernel on the same call), `HOPPER_STAGES`,
`HOPPER_NONFINITE`, `HOPPER_COLUMNS`; so `"hopper:;portable:HOPPER=0"` times both paths
in one process.
`--tiles "BM,BN,warps,stages;..."` adds one `TILE` variant per configuration. A key this
version does not have is reported in the row (`error`), not guessed.

Per N and plan (`--plans`: dense, random 5% blocks, a plan with a fifth of its area in
columns, ANCHORS.md's MInference lines; any `common.named_plan` name, or a method without
a plan, which is then timed end to end): every variant's kernel time, TFLOP/s, ratio to
cuDNN and to the floor, its output's difference from the first variant's, and the
non-finite values it wrote. The default variants measure the guard (plan entries clamped
on load), the non-finite step (NaN kept out of rows that do not keep their key) and the
column-split rule.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..common import (
    BLOCK,
    Context,
    Option,
    Row,
    Suite,
    Unit,
    baseline_unit,
    named_plan,
    piece,
)
from .kernels import split_plans

PLANS = "dense,random5,columns20,minference-lines"
VARIANTS = "default:;no guard:GUARD=0;no non-finite step:NONFINITE=0;column split:COL_SPLIT=1;" \
           "no column split:COL_SPLIT=0"


def parse_variants(text: str, tiles: str = "") -> list[tuple[str, dict[str, str]]]:
    """`"name:KEY=VAL,KEY=VAL;name2:..."` -> [(name, {KEY: VAL})]; `tiles` adds `tile BM,BN,w,s` variants."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(";"))):
        name, _, rest = item.partition(":")
        try:
            sets = dict(kv.split("=", 1) for kv in filter(None, rest.split(",")))
        except ValueError:
            raise ValueError(f"--variants: expected name:KEY=VAL,... items, got {item!r}") from None
        out.append((name, sets))
    for tile in filter(None, (x.strip() for x in tiles.split(";"))):
        out.append((f"tile {tile}", {"TILE": tile.replace(",", ".")}))
    return out


def _value(current: Any, text: str) -> Any:
    if isinstance(current, bool) or (current is None and text in ("0", "1", "auto")):
        return {"1": True, "0": False, "auto": None}[text]
    if isinstance(current, int):
        return int(text)
    if isinstance(current, float):
        return float(text)
    return text


@contextmanager
def applied(sets: dict[str, str]) -> Iterator[None]:
    """The switches of one variant, restored on exit.

    Raises:
        KeyError: a switch this version of the kernel does not have.
    """
    from ...fast.kernels import block_column, block_column_hopper, own_columns

    saved: list[tuple[Any, str, Any]] = []
    env = os.environ.get("SPARSEPREFILL_TILE")
    hopper = {key: text for key, text in sets.items() if key.startswith("HOPPER")}
    try:
        if hopper:
            unknown = sorted(set(hopper) - set(block_column_hopper.SWITCHES))
            if unknown:
                raise KeyError(f"fast.kernels.block_column_hopper has no switch {', '.join(unknown)}")
            saved += [(block_column_hopper, attr, getattr(block_column_hopper, attr))
                      for attr in block_column_hopper.SWITCHES.values()]
            block_column_hopper.apply_switches(hopper)
        for key, text in sets.items():
            if key in hopper:
                continue
            if key == "TILE":
                os.environ["SPARSEPREFILL_TILE"] = text.replace(".", ",")
            elif key == "BUDGET_GIB":
                saved.append((own_columns, "DISJOINT_COLUMN_BYTES", own_columns.DISJOINT_COLUMN_BYTES))
                own_columns.DISJOINT_COLUMN_BYTES = int(float(text) * 2**30)
            else:
                attr = f"_{key}"
                if not hasattr(block_column, attr):
                    raise KeyError(f"fast.kernels.block_column has no switch {attr}")
                saved.append((block_column, attr, getattr(block_column, attr)))
                setattr(block_column, attr, _value(getattr(block_column, attr), text))
        yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)
        if env is None:
            os.environ.pop("SPARSEPREFILL_TILE", None)
        else:
            os.environ["SPARSEPREFILL_TILE"] = env


def variant_rows(ctx: Context, n: int, plan_name: str, variants: list[tuple[str, dict[str, str]]],
                 block: int) -> list[Row]:
    """Every variant on one plan (or a method without a plan, end to end) at N."""
    from ... import fast
    from ...fast.kernels import block_column_attention
    from ...methods import get, methods

    q, k, v = ctx.inputs(n)
    spec = methods().get(plan_name.split(":", 1)[0])
    if spec is not None and not spec.plan_based:
        call = spec.call_params(spec.demo_params(n), q)
        run = spec.run_fn("fast")
        dens = float(get(spec.name).method_view("fast", q, k, v, call, with_recall=False).density.mean())

        def fn() -> torch.Tensor:
            return run(q, k, v, **call)
        plan = None
    else:
        plan = named_plan(plan_name, q, k, block=block)
        dens = float(fast.density(plan).mean())

        def fn() -> torch.Tensor:
            assert plan is not None
            return block_column_attention(q, k, v, plan, validate_plan=False)[0]

    rows: list[Row] = []
    first: torch.Tensor | None = None
    for name, sets in variants:
        label = f"{plan_name} [{name}]"
        try:
            with applied(sets):
                if plan is not None:
                    plan.__dict__.pop("_resolved_columns", None)  # the front door's cache (budget variants)
                out = fn()
                ms = ctx.time(fn)
        except (KeyError, RuntimeError, ValueError) as exc:
            message = f"{type(exc).__name__}: {str(exc)[:200]}"
            ctx.log(f"N={n} {label}: {message}")
            rows.append(Row(label, "sparseprefill", n, density=dens, suite=ctx.suite,
                            extra={"variant": name, "sets": sets, "error": message}))
            continue
        if first is None:
            first, diff = out.float(), 0.0
        else:
            diff = float((out.float() - first).norm() / first.norm().clamp(min=1e-30))
        rows.append(ctx.row(label, "sparseprefill", n, ms=ms, kernel_ms=ms if plan is not None else None,
                            density=dens, extra={"variant": name, "sets": sets, "plan": plan_name,
                                                 "rel_diff_vs_first": diff,
                                                 "nonfinite": int((~torch.isfinite(out)).sum())}))
        ctx.log(f"N={n} {label}: {ms:.3f} ms, diff {diff:.1e}")
    return rows


def units(ctx: Context, seqlens: list[int], *, plans: str = PLANS, variants: str = VARIANTS, tiles: str = "",
          block: int | None = None) -> list[Unit]:
    chosen = parse_variants(variants, tiles)
    size = block or (128 if ctx.on_gpu else 16)
    out: list[Unit] = []
    for n in seqlens:
        out.append(baseline_unit(ctx, n))
        for name in split_plans(plans):
            out.append(piece(ctx, name, n, variant_rows, ctx, n, name, chosen, size))
    return out


SUITE = Suite(
    name="variants",
    about="the block/column kernel's switches (guard, non-finite step, column split, ...) and tile "
          "configurations on named plans",
    seqlens=(32768, 131072),
    units=units,
    options=(Option("--plans", "plans", str, PLANS, "plans by name (see `kernels`)"),
             Option("--variants", "variants", str, VARIANTS, "variants: name:KEY=VAL,...;name2:... (module doc)"),
             Option("--tiles", "tiles", str, "", "variants: tile configurations BM,BN,warps,stages;..."),
             BLOCK),
)
