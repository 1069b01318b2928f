"""Delta-KV (DeltaAttention thesis) as a method descriptor, with its report view."""

from __future__ import annotations

from typing import Any

import torch

from .. import fast, reference
from ..reference._checks import check_knob
from ..reference.delta_kv import check_metric, check_threshold, kv_threshold
from ._core import Ablation, Method, MethodView, SyncStatus, register


# The parameters of stage 1 (the keep mask).
STAGE1 = ("threshold", "metric", "chunk")


def stage1(params: dict[str, Any], heads: int, kv_heads: int) -> dict[str, Any]:
    """`delta_keep_mask`'s arguments from the method's parameters on `heads` query heads: a
    per-head threshold (one value per query head, equal within each KV group) becomes
    its one value per KV head (`reference.delta_kv.kv_threshold`)."""
    out = {name: params[name] for name in STAGE1 if name in params}
    if "threshold" in out:
        out["threshold"] = kv_threshold(out["threshold"], out.get("metric", "euclidean"), heads, kv_heads)
    return out


def check_params(params: Any) -> None:
    """`Method.check`: the metric, then the threshold (a scalar or one value per query head)
    under that metric (a Euclidean threshold is >= 0), before any work."""
    metric = check_metric(params.get("metric", "euclidean"))
    if params.get("threshold") is not None:
        check_knob("threshold", params["threshold"], lambda t: check_threshold(t, metric))


def packing(impl: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: dict[str, Any]) -> Any:
    """`impl`'s keep mask and packing (`PackedKV`) for the method's parameters."""
    keep = impl.delta_keep_mask(k, **stage1(params, int(q.shape[1]), int(k.shape[1])))
    return impl.delta_pack(k, v, keep, block=int(params.get("block_n", 64)))


def view(impl_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         params: dict[str, Any]) -> MethodView:
    """Density (score entries computed, both phases) and the phase-2 plan to draw; no recall."""
    impl: Any = fast if impl_name == "fast" else reference
    packed = packing(impl, q, k, v, params)
    block_m = int(params.get("block_m", 64))
    _, exact = impl.delta_kv_plans(q, packed, block_m=block_m)
    return MethodView(density=impl.delta_kv_density(q, packed, block_m=block_m), recall=None, plan=exact,
                      notes=f"keep ratio {float(packed.keep_ratio().mean()):.3f}")


def extras(impl_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: dict[str, Any],
           view: MethodView) -> dict[str, float]:
    """The keep ratio (anchors over keys) and the exact mass: the full-attention mass on the
    keys phase 2 computes exactly (per head the mean over rows; mean and min over heads)."""
    impl: Any = fast if impl_name == "fast" else reference
    assert view.plan is not None
    exact = impl.recall(q, k, view.plan).double().mean(dim=-1)
    return {"keep_ratio": float(packing(impl, q, k, v, params).keep_ratio().mean()),
            "exact_mass_mean": float(exact.mean()), "exact_mass_min": float(exact.min())}


# The thesis's two ablations (`compare --ablations`, docs/delta_kv.md) at these thresholds.
ABLATE = (("euclidean", 10.0), ("euclidean", 12.0), ("cosine", 0.85), ("cosine", 0.75))
ABLATIONS = (
    Ablation("euclidean", lambda n: [{"threshold": t, "metric": "euclidean"} for t in (8.0, 10.0, 12.0, 14.0)],
             about="the Euclidean metric"),
    Ablation("uniform anchors", lambda n: [{"threshold": t, "metric": m, "count_weighted": False} for m, t in ABLATE],
             about="anchors without the log-count bias"),
    Ablation("no exact diagonal", lambda n: [{"threshold": t, "metric": m, "exact_diagonal": False}
                                             for m, t in ABLATE],
             about="the critical diagonal packed too"),
    Ablation("block128", lambda n: [{"threshold": t, "metric": "cosine", "block_m": 128, "block_n": 128}
                                     for t in (0.95, 0.9, 0.85, 0.8, 0.75, 0.7)],
             about="DeltaXAttention's tiles (its yardstick, docs/delta_xattention.md)"),
)


METHOD = register(Method(
    name="delta_kv",
    notes="Delta-KV: anchors of similar-key runs packed with counts; exact critical diagonal",
    reference_run=reference.delta_kv,
    fast_run=fast.delta_kv,
    defaults=lambda n: {"threshold": 0.83, "metric": "cosine"},
    knobs=("threshold",),
    kv_knobs=("threshold",),
    check=check_params,
    sweep=lambda n: [{"threshold": t, "metric": "cosine"} for t in (0.95, 0.9, 0.85, 0.8, 0.75, 0.7)],
    ablations=ABLATIONS,
    extras=extras,
    view=view,
    sync=SyncStatus(
        syncs=("dense fallback (CUDA, on by default): the [Hkv] flags of the KV heads whose keep ratio passes "
               "break-even (keep_dense_kv_heads: flags.nonzero().tolist()), one read after the keep mask, "
               "before packing",
               "packing: the packed buffer's size (offsets[-1].item())",
               "packing: repeat_interleave of segment ids (output size read back)",
               "phase 2: the block-list width (count2.max().item())",
               "phase 1: whether any query block reads packed keys (bool(...any()))",
               "phase 1: the ragged launcher's offset range check (int(kv_offsets.min()), .max())"),
        capture_safe=False,
        note="the packed keys' count is data-dependent; a static variant would size the buffer "
             "for no compression (B * Hkv * N keys)"),
))
