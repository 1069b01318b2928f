"""Defaults that several methods of one paper share (kept here so each is written once)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def sink_window(n: int) -> dict[str, int]:
    """StreamingLLM / A-shape sink and window at prompt length N: 1024 and N / 8 at long N,
    scaled down below so a short prompt still skips something."""
    return {"sink": min(1024, max(64, n // 32)), "window": max(128, n // 8)}


def vertical_slash_defaults(n: int) -> dict[str, Any]:
    """MInference's LLaMA-3 setting from 32K on; scaled down below so it stays sparse."""
    if n >= 32768:
        return {"vertical_size": 1000, "slash_size": 6096}
    return {"vertical_size": max(30, n // 32), "slash_size": max(100, n // 8)}


def block_sparse_top_k(n: int) -> int:
    """MInference's block-sparse budget: 100 blocks from 32K on, N / 512 below."""
    return 100 if n >= 32768 else max(2, n // 512)


def tile_block(n: int) -> int:
    """XAttention-family tile size: 128 (the papers') once a sequence has a few dozen tiles;
    64 below so the demo's short workload still has tiles to skip."""
    return 128 if n >= 4096 else 64


# The greedy threshold grid of XAttention and DPXA (`sparseprefill compare`).
TILE_SWEEP = (0.8, 0.85, 0.9, 0.95, 0.98)
# The wider grid of their ablations (`compare --ablations`, docs/xattention.md), at the
# thesis's 128-token tiles whatever N.
TILE_EVIDENCE = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.98)
EVIDENCE_BLOCK = 128
# The per-head calibration grid of the tile thresholds (`sparseprefill calibrate`): wide on
# both sides, since real heads need anything from 0.6 to 0.99.
TILE_CALIBRATION = (0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.99)
# The same for the mass fractions of FlexPrefill / SharePrefill (gamma) and SampleAttention (alpha).
MASS_CALIBRATION = (0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99)


def tile_grid(**params: Any) -> Callable[[int], list[dict[str, Any]]]:
    """`N -> [params + threshold, block 128]` over `TILE_EVIDENCE` (an ablation's grid)."""
    return lambda n: [{**params, "threshold": t, "block": EVIDENCE_BLOCK} for t in TILE_EVIDENCE]


def tiles_computed(view: Any) -> float:
    """The kept causal tiles over all causal tiles of a tile plan (the thesis's "sparsity")."""
    keep: torch.Tensor = view.plan.block_mask()  # [B, Hq, T, T]
    t = keep.shape[-1]
    return float(keep.sum()) / (keep[..., 0, 0].numel() * t * (t + 1) / 2)


def shape_only_estimate(name: str) -> Any:
    """A `DistributedEstimate.build` for a plan that depends on N alone: every rank runs the
    method's own estimator on stand-in tensors of the global shape (no traffic)."""
    def build(shard: Any, params: dict[str, Any], impl: str, scale: float | None, comm: Any) -> Any:
        from ._core import get

        q, k = shard.standins()
        return get(name).plan_fn(impl)(q, k, **params)
    return build


def keyword_check(fn: Any) -> Any:
    """A `Method.check` calling `fn(**params)` with the parameters `fn` names (a method's
    own `check_<name>_params`, which takes every one of them by keyword)."""
    import inspect

    names = [p for p in inspect.signature(fn).parameters if p != "prefix"]

    def check(params: Any) -> None:
        fn(**{name: params[name] for name in names if name in params})
    return check


def knob_check(integer: tuple[str, ...] = (), **checks: Callable[[object], float | int]) -> Any:
    """A `Method.check` of per-head knobs: each named parameter, unless None, is a scalar or
    one value per query head, each value through its scalar check (`check_knob`; its
    length is checked against Hq when the method runs). `integer`: the int knobs."""
    from ..reference._checks import check_knob

    def check(params: Any) -> None:
        for name, fn in checks.items():
            if params.get(name) is not None:
                check_knob(name, params[name], fn, integer=name in integer)
    return check
