"""`minference`: MInference's patterns with its own settings, per stage, beside cuDNN and FlexAttention.

Per N on the selected workload:

* vertical-slash at the `vertical_slash` method's defaults (MInference's 1000 verticals
  and 6096 slashes from 32K on), for each `--vs-blocks` block size: end to end
  (`fast.vertical_slash`), the estimate (`estimate_ms`: the last-64-query scores and
  the top-k lines), the index (`plan_ms` is estimate + index), the kernel;
* ANCHORS.md's fixed MInference plan (the first 30 + random verticals, the 6096 nearest
  diagonals, 64 x 64 blocks): index and kernel, no estimate;
* block-sparse at the `block_sparse` method's defaults (top_k 100 blocks of 64 from 32K
  on): plan (pooled scores and top-k) and kernel;

each also run by FlexAttention on the same plan (up to `--flex-max`).
"""

from __future__ import annotations

from typing import Any

from ..common import (
    Context,
    Option,
    Row,
    Suite,
    Unit,
    baseline_unit,
    flex_row,
    minference_anchor_lines,
    piece,
)


def _parse_blocks(text: str) -> tuple[tuple[int, int], ...]:
    """"64x64,128x64" -> ((64, 64), (128, 64))."""
    blocks = []
    for item in filter(None, text.split(",")):
        try:
            bm, bn = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"--vs-blocks: expected block_mxblock_n items like 64x64, got {item!r}") from None
        blocks.append((bm, bn))
    return tuple(blocks)


def _flex(ctx: Context, n: int, flex_max: int, label: str, plan: Any, out: Any, recall: Any) -> list[Row]:
    if n > flex_max:
        return []
    q, k, v = ctx.inputs(n)
    return flex_row(ctx, label, plan, q, k, v, out, recall=recall)


def vertical_slash_rows(ctx: Context, n: int, block_m: int, block_n: int, flex_max: int) -> list[Row]:
    from ... import fast
    from ...fast.kernels import block_column_attention
    from ...fast.kernels.vertical_slash_index import vertical_slash_index
    from ...fast.vertical_slash import vertical_slash_lines, with_own_columns
    from ...methods import get

    q, k, v = ctx.inputs(n)
    budgets = {key: val for key, val in get("vertical_slash").demo_params(n).items()
               if key in ("vertical_size", "slash_size")}
    verticals, slashes = vertical_slash_lines(q, k, **budgets)
    estimate_ms = ctx.time(lambda: vertical_slash_lines(q, k, **budgets))

    def index() -> Any:
        # As fast.vertical_slash_plan builds it: disjoint columns where they fit.
        return with_own_columns(vertical_slash_index(verticals, slashes, seqlen=n, block_m=block_m, block_n=block_n))

    plan = index()
    index_ms = ctx.time(index)
    kernel_ms = ctx.time(lambda: block_column_attention(q, k, v, plan, validate_plan=False))
    ms = ctx.time(lambda: fast.vertical_slash(q, k, v, block_m=block_m, block_n=block_n, **budgets))
    recall = ctx.recall(q, k, plan)
    label = f"vertical_slash {block_m}x{block_n}"
    row = ctx.row(label, "sparseprefill", n, ms=ms, density=float(fast.density(plan).mean()), recall=recall,
                  estimate_ms=estimate_ms, plan_ms=estimate_ms + index_ms, kernel_ms=kernel_ms,
                  extra={"params": budgets, "index_ms": index_ms, "plan_mb": plan.nbytes() / 2**20})
    out = block_column_attention(q, k, v, plan, validate_plan=False)[0]
    return [row, *_flex(ctx, n, flex_max, label, plan, out, recall)]


def anchors_plan_rows(ctx: Context, n: int, flex_max: int) -> list[Row]:
    from ... import fast
    from ...fast.kernels import block_column_attention
    from ...fast.kernels.vertical_slash_index import vertical_slash_index
    from ...fast.vertical_slash import with_own_columns

    q, k, v = ctx.inputs(n)
    verticals, slashes = minference_anchor_lines(int(q.shape[0]), int(q.shape[1]), n, device=q.device)

    def index() -> Any:
        return with_own_columns(vertical_slash_index(verticals, slashes, seqlen=n, block_m=64, block_n=64))

    plan = index()
    index_ms = ctx.time(index)
    kernel_ms = ctx.time(lambda: block_column_attention(q, k, v, plan, validate_plan=False))
    recall = ctx.recall(q, k, plan)
    row = ctx.row("MInference plan", "sparseprefill", n, ms=index_ms + kernel_ms,
                  density=float(fast.density(plan).mean()), recall=recall, plan_ms=index_ms, kernel_ms=kernel_ms,
                  extra={"lines": "first 30 + random verticals (1000), 6096 nearest diagonals", "index_ms": index_ms})
    out = block_column_attention(q, k, v, plan, validate_plan=False)[0]
    return [row, *_flex(ctx, n, flex_max, "MInference plan", plan, out, recall)]


def block_sparse_rows(ctx: Context, n: int, flex_max: int) -> list[Row]:
    from ... import fast
    from ...fast.kernels import block_column_attention
    from ...methods import get

    q, k, v = ctx.inputs(n)
    params = get("block_sparse").demo_params(n)
    plan = fast.block_sparse_plan(q, k, **params)
    plan_ms = ctx.time(lambda: fast.block_sparse_plan(q, k, **params))
    kernel_ms = ctx.time(lambda: block_column_attention(q, k, v, plan, validate_plan=False))
    recall = ctx.recall(q, k, plan)
    row = ctx.row("block_sparse", "sparseprefill", n, ms=plan_ms + kernel_ms, density=float(fast.density(plan).mean()),
                  recall=recall, plan_ms=plan_ms, kernel_ms=kernel_ms, extra={"params": params})
    out = block_column_attention(q, k, v, plan, validate_plan=False)[0]
    return [row, *_flex(ctx, n, flex_max, "block_sparse", plan, out, recall)]


def units(ctx: Context, seqlens: list[int], *, vs_blocks: str = "64x64", flex_max: int = 131072) -> list[Unit]:
    blocks = _parse_blocks(vs_blocks)
    out: list[Unit] = []
    for n in seqlens:
        out.append(baseline_unit(ctx, n))
        for bm, bn in blocks:
            label = f"vertical_slash {bm}x{bn}"
            out.append(piece(ctx, label, n, vertical_slash_rows, ctx, n, bm, bn, flex_max))
        out.append(piece(ctx, "MInference plan", n, anchors_plan_rows, ctx, n, flex_max))
        out.append(piece(ctx, "block_sparse", n, block_sparse_rows, ctx, n, flex_max))
    return out


SUITE = Suite(
    name="minference",
    about="vertical-slash and block-sparse with MInference's settings per stage, and ANCHORS.md's MInference "
          "plan, beside cuDNN and FlexAttention",
    seqlens=(32768, 131072, 524288),
    units=units,
    options=(Option("--vs-blocks", "vs_blocks", str, "64x64",
                    "comma-separated vertical-slash plan block sizes block_mxblock_n (MInference's: 64x64)"),
             Option("--flex-max", "flex_max", int, 131072, "longest N FlexAttention runs at")),
)
