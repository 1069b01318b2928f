"""AnchorAttention (Zhang et al.) as a method descriptor."""

from __future__ import annotations

from typing import Any

import torch

from .. import fast, reference
from ..reference.anchor_attention import check_anchor_params
from ._common import keyword_check
from ._core import Ablation, Method, MethodView, SyncStatus, register


def defaults(n: int) -> dict[str, Any]:
    # The paper's theta and blocks; step 16 from 16K on, smaller below so that a
    # prompt has at least 8 groups (one group is all window, hence dense).
    return {"step": max(1, min(16, -(-n // 128) // 8))}


def extras(impl_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: dict[str, Any],
           view: MethodView) -> dict[str, float]:
    """`stripe_width`: the widest stripe list (the plan's column width, the static bound's rival)."""
    assert view.plan is not None
    return {"stripe_width": float(view.plan.column_index.shape[-1])}


METHOD = register(Method(
    check=keyword_check(check_anchor_params),
    name="anchor_attention",
    knobs=("theta",),
    notes="AnchorAttention: initial block + group window as anchor, difference-aware stripes "
          "per group of step query blocks, stripe pass resuming the anchor state",
    reference_plan=reference.anchor_attention_plan,
    fast_plan=fast.anchor_attention_plan,
    reference_run=reference.anchor_attention,
    fast_run=fast.anchor_attention,
    defaults=defaults,
    sweep=lambda n: [{**defaults(n), "theta": t} for t in (3.0, 6.0, 9.0, 12.0, 15.0)],
    calibration=lambda n: [{**defaults(n), "theta": t} for t in (3.0, 6.0, 9.0, 12.0, 15.0, 20.0)],
    ablations=(Ablation("theta x step", lambda n: [{"theta": t, "step": s, "block_m": 128, "block_n": 128}
                                                   for t in (6.0, 9.0, 12.0, 15.0) for s in (1, 4, 16)],
                        about="the paper's theta against the group size step (docs/anchor_attention.md)"),),
    extras=extras,
    chunked="each query block's anchor and its group's stripes: the chunk's own rows (chunks start on a "
            "group of `step` query blocks)",
    sync=SyncStatus(
        syncs=("dense fallback (off in anchor_attention_static): the rule's flags of each head group's plan "
               "(break_even_heads), one read per head group; with the early exit on (off by default) one more, "
               "the [Hq] flags of the last-64-row theta-gap probe (early_dense_heads)",
               "stripe identification: the longest stripe list (tile_count.sum(2).max().item())",
               "stripe pass: promoting whole stripe blocks to blocks (BlockColumnPlan.with_full_blocks: "
               "bool(promote.any()), mask_to_list width, new column width)"),
        static_bound="the last group's search region (about N keys per group); no block promotion",
        note="static stripe lists: 4 * B * Hq * G * N bytes (heads in groups above 256 MB); the stripes "
             "stay column gathers (the whole method on an H200 at 128K: 1185 ms so, 610 ms promoted)"),
))
