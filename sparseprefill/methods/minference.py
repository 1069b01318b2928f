"""MInference's per-head dispatch (vertical-slash, A-shape, block-sparse heads in one plan) as a
method descriptor."""

from __future__ import annotations

import functools
from typing import Any

import torch

from .. import fast, reference
from ..reference.minference import HeadPattern, MInferenceConfig
from ._common import block_sparse_top_k, sink_window, vertical_slash_defaults
from ._core import Adapter, Method, SyncStatus, register


def defaults(n: int) -> dict[str, Any]:
    """The three patterns at their MInference budgets, heads taking them in turn (`prepare`)."""
    return {"patterns": (
        HeadPattern("vertical_slash", {**vertical_slash_defaults(n), "block_m": 64, "block_n": 64}),
        HeadPattern("a_shape", {**sink_window(n), "window": min(4096, max(128, n // 8)),
                                "block_m": 64, "block_n": 64}),
        HeadPattern("block_sparse", {"top_k": block_sparse_top_k(n), "block_size": 64}),
    )}


def sweep(n: int) -> list[dict[str, Any]]:
    """The default three patterns with budgets scaled together: vertical-slash as its own grid,
    the A-shape window N/f, block-sparse top_k Kb/f (blocks of 64)."""
    blocks = -(-n // 64)
    return [{"patterns": (
        HeadPattern("vertical_slash", {"vertical_size": max(30, n // f), "slash_size": max(64, 2 * n // f),
                                       "block_m": 64, "block_n": 64}),
        HeadPattern("a_shape", {**sink_window(n), "window": max(128, n // f), "block_m": 64, "block_n": 64}),
        HeadPattern("block_sparse", {"top_k": max(2, blocks * 8 // f), "block_size": 64}),
    )} for f in (128, 64, 32, 16, 8)]


def prepare(params: dict[str, Any], q: torch.Tensor) -> dict[str, Any]:
    """Pattern `h % len(patterns)` for query head `h`: a one-layer `MInferenceConfig`."""
    patterns = tuple(params["patterns"])
    heads = tuple(patterns[h % len(patterns)] for h in range(int(q.shape[1])))
    out: dict[str, Any] = {"config": MInferenceConfig((heads,)), "layer": 0}
    if params.get("scale") is not None:
        out["scale"] = params["scale"]
    return out


@functools.lru_cache(maxsize=64)
def _config_from_json(text: str) -> MInferenceConfig:
    return MInferenceConfig.from_json(text)


def _config_to_json(config: object) -> object:
    return config.to_json() if isinstance(config, MInferenceConfig) else config


METHOD = register(Method(
    name="minference",
    notes="MInference per-head dispatch: each head its own pattern (vertical-slash, A-shape, "
          "block-sparse), one merged plan, one kernel launch",
    reference_plan=reference.minference_plan,
    fast_plan=fast.minference_plan,
    reference_run=reference.minference,
    fast_run=fast.minference,
    defaults=defaults,
    sweep=sweep,
    prepare=prepare,
    chunked="per head, its pattern's reading (vertical-slash: the chunk's last queries; A-shape: none; "
            "block-sparse: the chunk's blocks)",
    sync=SyncStatus(
        syncs=("dense fallback: the break-even rule's [Hq] flags of the merged plan, one read (off in the "
               "static op)",
               "vertical-slash heads: as vertical_slash",),
        static_bound="vertical-slash heads: as vertical_slash_static",
        note="mixed layers merge their head plans slice by slice on the device "
             "(reference.minference.merge_head_plans); vertical-slash heads need the static op"),
    adapters={"config": Adapter("str", _config_to_json, _config_from_json)},
))
