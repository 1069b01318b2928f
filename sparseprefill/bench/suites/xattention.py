"""`xattention`: XAttention's tile scoring / selection / kernel split, beside cuDNN SDPA.

Per N and case (stride 8 and 16 antidiagonal scoring, naive stride-4 scoring, each at
threshold 0.9; `--block` tiles): end to end (`fast.xattention`), and in stages:
scoring (the tile weights, `estimate_ms`), selection (the greedy threshold and the
plan's block lists; `plan_ms` is scoring + selection) and the block kernel on the plan
(`kernel_ms`). `extra`: the split, `scoring_vs_cudnn` (the scoring time over cuDNN's
dense time: stride-8 scoring computes 1/16 of dense's products), the tiles computed
and the scoring ratio (the share of a tile's score cells the scoring computes).

`tile_rows` is shared with the `dpxa` suite (DPXA scores tiles from delta anchors).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...reference.plan import cdiv
from ..common import BLOCK, Context, Row, Suite, Unit, baseline_unit, piece

CASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("xattention s8 0.9", {"stride": 8, "threshold": 0.9}),
    ("xattention s16 0.9", {"stride": 16, "threshold": 0.9}),
    ("naive s4 0.9", {"stride": 4, "threshold": 0.9, "scoring": "naive"}),
)


def scoring_ratio(params: dict[str, Any], block: int) -> float:
    """The share of a tile's score cells XAttention's scoring computes: 1/S antidiagonal,
    `(ceil(block / S) / block)^2` naive."""
    stride = int(params["stride"])
    if params.get("scoring", "antidiagonal") == "antidiagonal":
        return 1.0 / stride
    return (cdiv(block, stride) / block) ** 2


def tile_rows(ctx: Context, n: int, label: str, params: dict[str, Any], *, block: int,
              weights_fn: Callable[..., torch.Tensor], run_fn: Callable[..., torch.Tensor],
              extra_stages: Callable[[Context, torch.Tensor, torch.Tensor, dict[str, Any]], dict[str, Any]],
              ) -> list[Row]:
    """One tile method's row at N: end to end and scoring / selection / kernel (module doc).

    Args:
        weights_fn: `(q, k, **params without threshold) -> [B, Hq, T, T]` tile weights.
        run_fn: the method's end-to-end function.
        extra_stages: `(ctx, q, k, params) -> {name: value}`, the method's own extra numbers.
    """
    from ... import fast
    from ...fast.kernels import block_column_attention
    from ...fast.xattention import select_tiles, tiles_to_plan

    q, k, v = ctx.inputs(n)
    params = {**params, "block": block}
    threshold = params["threshold"]
    tile_params = {key: val for key, val in params.items() if key != "threshold"}

    def scoring() -> torch.Tensor:
        return weights_fn(q, k, **tile_params)

    weights = scoring()

    def selection() -> Any:
        return tiles_to_plan(select_tiles(weights, threshold), seqlen=n, block=block)

    plan = selection()
    scoring_ms, selection_ms = ctx.time(scoring), ctx.time(selection)
    kernel_ms = ctx.time(lambda: block_column_attention(q, k, v, plan, validate_plan=False))
    ms = ctx.time(lambda: run_fn(q, k, v, **params))
    dens = float(fast.density(plan).mean())
    keep = plan.block_mask()
    tiles = plan.num_query_blocks * (plan.num_query_blocks + 1) / 2
    base = ctx.baseline(n).ms
    extra = {"params": params, "scoring_ms": scoring_ms, "selection_ms": selection_ms,
             "scoring_vs_cudnn": scoring_ms / base, "tiles_computed": float(keep.sum()) / (keep[..., 0, 0].numel()
                                                                                         * tiles),
             **extra_stages(ctx, q, k, params)}
    row = ctx.row(label, "sparseprefill", n, ms=ms, density=dens, recall=ctx.recall(q, k, plan),
                  estimate_ms=scoring_ms, plan_ms=scoring_ms + selection_ms, kernel_ms=kernel_ms, extra=extra)
    ctx.log(f"N={n}: {label} {ms:.2f} ms (scoring {scoring_ms:.2f}, selection {selection_ms:.2f}, kernel "
            f"{kernel_ms:.2f}) density {dens:.4f}")
    return [row]


def estimate_floor(params: dict[str, Any], q: torch.Tensor, k: torch.Tensor, dense_ms: float) -> float | None:
    """The `estimates` suite's floor of XAttention's plan: the strided product's multiply-adds
    over dense's at the dense rate, `dense / (2 S)` (antidiagonal scoring only)."""
    if params.get("scoring", "antidiagonal") != "antidiagonal":
        return None
    return dense_ms / (2 * int(params.get("stride", 8)))


def _xattention_extra(ctx: Context, q: torch.Tensor, k: torch.Tensor, params: dict[str, Any]) -> dict[str, Any]:
    return {"scoring_ratio": scoring_ratio(params, int(params["block"]))}


def units(ctx: Context, seqlens: list[int], *, block: int | None = None) -> list[Unit]:
    from ... import fast

    size = block or (128 if ctx.on_gpu else 32)
    out: list[Unit] = []
    for n in seqlens:
        out.append(baseline_unit(ctx, n))
        for label, params in CASES:
            out.append(piece(ctx, label, n, tile_rows, ctx, n, label, params, block=size,
                             weights_fn=fast.xattention_tile_weights, run_fn=fast.xattention,
                             extra_stages=_xattention_extra))
    return out


SUITE = Suite(
    name="xattention",
    about="XAttention: tile scoring / selection / kernel split at strides 8 and 16 and naive scoring",
    seqlens=(32768, 131072),
    units=units,
    options=(BLOCK,),
)
