"""`delta_xattention`: DeltaXAttention's stages, against XAttention's kernel on the same tiles.

Per N on the selected workload (stride-8 scoring, `--block` tiles): for each XAttention
threshold of the cases, XAttention's kernel on its selected tiles ("(same tiles)");
then per case (threshold, exact share, cosine threshold) and packed block
(`--packed-blocks`): the stages (XAttention scoring, `estimate_ms`; selection, the
exact/packed split, per-tile packing and plans, with scoring `plan_ms`; the packed
launch and the exact launch, `kernel_ms`) and `fast.delta_xattention` end to end.
Beside it the thesis's ablation: XAttention skipping the same share of its lightest
off-diagonal tiles (`skip_tiles` with `skip` = the measured KV reduction). `extra` has
the KV reduction `f (1 - p)`, the tiles' keep ratio, the share of packed tiles,
`kernel_vs_xattention` (both launches over XAttention's kernel) and every output's
error against the dense kernel. No recall: a packed tile changes the keys.
"""

from __future__ import annotations

from collections.abc import Callable
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
    piece,
)

CASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("delta_xattention cos0.9 tw10", {"delta_threshold": 0.9, "metric": "cosine", "threshold": 0.9,
                                      "exact_top": 0.1}),
    ("delta_xattention cos0.83 tw10", {"delta_threshold": 0.83, "metric": "cosine", "threshold": 0.9,
                                       "exact_top": 0.1}),
    ("delta_xattention cos0.83 diag", {"delta_threshold": 0.83, "metric": "cosine", "threshold": 0.9,
                                       "exact_top": 0.0}),
)


def keep_params(n: int, threshold: float, block: int | None) -> dict[str, Any]:
    """DeltaXAttention's parameters (its defaults) packing tiles at the cosine `threshold`
    (the `delta` suite)."""
    from ...methods import get

    return {**get("delta_xattention").demo_params(n), "delta_threshold": threshold, "metric": "cosine",
            **({} if block is None else {"block": block})}


def _rel_err(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float((out.float() - exact.float()).norm() / exact.float().norm())


class _Shared:
    """What the cases at one N share: the dense output and the scoring (computed once)."""

    def __init__(self, ctx: Context, n: int, block: int) -> None:
        from ... import fast
        from ...fast.kernels import block_column_attention

        q, k, v = ctx.inputs(n)
        self.exact = block_column_attention(q, k, v, fast.dense_plan(q, k), validate_plan=False)[0]
        self.weights = fast.xattention_tile_weights(q, k, stride=8, block=block)
        self.scoring_ms = ctx.time(lambda: fast.xattention_tile_weights(q, k, stride=8, block=block))
        self.xattention_ms: dict[float, float] = {}


def same_tiles_rows(ctx: Context, n: int, threshold: float, block: int, shared: _Shared) -> list[Row]:
    from ... import fast
    from ...fast.kernels import block_column_attention
    from ...fast.xattention import select_tiles, tiles_to_plan

    q, k, v = ctx.inputs(n)
    plan = tiles_to_plan(select_tiles(shared.weights, threshold), seqlen=n, block=block)
    ms = ctx.time(lambda: block_column_attention(q, k, v, plan, validate_plan=False))
    shared.xattention_ms[threshold] = ms
    out = block_column_attention(q, k, v, plan, validate_plan=False)[0]
    return [ctx.row(f"xattention s8 {threshold} (same tiles)", "sparseprefill", n, ms=ms, kernel_ms=ms,
                    density=float(fast.density(plan).mean()), estimate_ms=shared.scoring_ms,
                    extra={"rel_err_vs_dense": _rel_err(out, shared.exact)})]


def case_rows(ctx: Context, n: int, name: str, params: dict[str, Any], packed_block: int, block: int,
              shared: _Shared) -> list[Row]:
    from ... import fast
    from ...fast.kernels import block_column_attention
    from ...fast.kernels.block_column import ragged_block_column_attention
    from ...fast.xattention import select_tiles, tiles_to_plan
    from ...reference.attention import AttentionState
    from ...reference.delta_xattention import PACKED, SKIPPED, tile_modes

    q, k, v = ctx.inputs(n)
    threshold, top = float(params["threshold"]), float(params["exact_top"])
    if threshold not in shared.xattention_ms:
        same_tiles_rows(ctx, n, threshold, block, shared)
    x_ms = shared.xattention_ms[threshold]
    weights = shared.weights
    selected = select_tiles(weights, threshold)

    def split() -> torch.Tensor:
        return tile_modes(selected, fast.exact_tiles(weights, selected, top), "skip")

    modes = split()
    pack_args = {"delta_threshold": params["delta_threshold"], "metric": params["metric"], "block": block,
                 "packed_block": packed_block}
    packing = fast.delta_tile_pack(k, v, **pack_args)
    exact_plan, packed_plan = fast.delta_xattention_plans(q, modes, packing)
    bias = packing.packed.counts.float().log()
    offsets = packing.region_offsets()

    def packed_launch() -> AttentionState:
        state = AttentionState.like(q)
        ragged_block_column_attention(q, packing.packed.k, packing.packed.v, offsets, packed_plan, key_bias=bias,
                                      state=state)
        return state

    state = packed_launch()
    skip = float(fast.delta_xattention_kv_reduction(modes, packing).mean())
    skip_plan = tiles_to_plan(fast.skip_tiles(weights, selected, skip), seqlen=n, block=block)
    run_params = {**params, "stride": 8, "block": block, "packed_block": packed_block}
    extra: dict[str, Any] = {
        "params": run_params, "scoring_ms": shared.scoring_ms,
        "selection_ms": ctx.time(lambda: select_tiles(weights, threshold)), "split_ms": ctx.time(split),
        "packing_ms": ctx.time(lambda: fast.delta_tile_pack(k, v, **pack_args)),
        "plans_ms": ctx.time(lambda: fast.delta_xattention_plans(q, modes, packing)),
        "packed_ms": ctx.time(packed_launch),
        "exact_ms": ctx.time(lambda: block_column_attention(q, k, v, exact_plan, state=state.clone(),
                                                            validate_plan=False)),
        "xattention_kernel_ms": x_ms,
        "skip_kernel_ms": ctx.time(lambda: block_column_attention(q, k, v, skip_plan, validate_plan=False)),
        "skip_density": float(fast.density(skip_plan).mean()),
        "kv_reduction": skip, "keep_ratio": float(packing.keep_ratio().mean()),
        "packed_tiles": float((modes == PACKED).sum()) / max(1.0, float((modes != SKIPPED).sum())),
        "packed_rows_loaded": float(packed_plan.block_count.double().sum()) * packed_block,
    }
    extra["kernel_vs_xattention"] = (extra["packed_ms"] + extra["exact_ms"]) / x_ms
    ms = ctx.time(lambda: fast.delta_xattention(q, k, v, **run_params))
    extra["rel_err_vs_dense"] = _rel_err(fast.delta_xattention(q, k, v, **run_params), shared.exact)
    extra["skip_rel_err_vs_dense"] = _rel_err(
        block_column_attention(q, k, v, skip_plan, validate_plan=False)[0], shared.exact)
    before = sum(extra[key] for key in ("scoring_ms", "selection_ms", "split_ms", "packing_ms", "plans_ms"))
    label = f"{name} pb{packed_block}"
    row = ctx.row(label, "sparseprefill", n, ms=ms, density=float(fast.delta_xattention_density(modes, packing).mean()),
                  estimate_ms=shared.scoring_ms, plan_ms=before, kernel_ms=extra["packed_ms"] + extra["exact_ms"],
                  extra=extra)
    ctx.log(f"N={n}: {label} {ms:.2f} ms, KV reduction {skip:.3f}, {extra['kernel_vs_xattention']:.2f}x "
            "XAttention's kernel")
    return [row]


def _same_tiles(ctx: Context, n: int, threshold: float, block: int, shared: Callable[[], _Shared]) -> list[Row]:
    return same_tiles_rows(ctx, n, threshold, block, shared())


def _case(ctx: Context, n: int, name: str, params: dict[str, Any], packed_block: int, block: int,
          shared: Callable[[], _Shared]) -> list[Row]:
    return case_rows(ctx, n, name, params, packed_block, block, shared())


def units(ctx: Context, seqlens: list[int], *, packed_blocks: str = "32,64", block: int | None = None) -> list[Unit]:
    size = block or (128 if ctx.on_gpu else 32)
    packed = [int(x) for x in packed_blocks.split(",") if x]
    out: list[Unit] = []
    for n in seqlens:
        shared: dict[int, _Shared] = {}

        def get(n: int = n, shared: dict[int, _Shared] = shared) -> _Shared:
            if n not in shared:
                shared[n] = _Shared(ctx, n, size)
            return shared[n]

        out.append(baseline_unit(ctx, n))
        for t in sorted({float(p["threshold"]) for _, p in CASES}):
            label = f"xattention s8 {t} (same tiles)"
            out.append(piece(ctx, label, n, _same_tiles, ctx, n, t, size, get))
        for name, params in CASES:
            for pb in packed:
                label = f"{name} pb{pb}"
                out.append(piece(ctx, label, n, _case, ctx, n, name, params, pb, size, get))
    return out


SUITE = Suite(
    name="delta_xattention",
    about="DeltaXAttention stages, against XAttention's kernel on the same tiles and the tile-skip ablation",
    seqlens=(32768, 131072),
    units=units,
    options=(Option("--packed-blocks", "packed_blocks", str, "32,64",
                    "delta_xattention: comma-separated packed key blocks"), BLOCK),
)
