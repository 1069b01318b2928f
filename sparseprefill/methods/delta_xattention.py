"""DeltaXAttention (DeltaAttention thesis, sec. 4.2) as a method descriptor, with its report
view."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import fast, reference
from ..reference.delta_xattention import PACKED, SKIPPED
from ..reference.xattention import check_xattention_params
from ._common import keyword_check, tile_block
from ._core import Ablation, Method, MethodView, SyncStatus, register

# The parameters of the tile selection and of the per-tile packing.
TILES = ("stride", "threshold", "exact_top", "block", "scoring", "unselected", "scale")
PACK = ("delta_threshold", "metric", "block", "packed_block")


def pick(params: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The entries of `params` named in `names`."""
    return {name: params[name] for name in names if name in params}


def modes(impl: Any, q: torch.Tensor, k: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """`impl`'s tile modes (skip / exact / packed) for the method's parameters."""
    out: torch.Tensor = impl.delta_xattention_tiles(q, k, **pick(params, TILES))
    return out


def packing(impl: Any, k: torch.Tensor, v: torch.Tensor, params: dict[str, Any]) -> Any:
    """`impl`'s per-tile packing (`TilePackedKV`) for the method's parameters."""
    return impl.delta_tile_pack(k, v, **pick(params, PACK))


def view(impl_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         params: dict[str, Any]) -> MethodView:
    """Density (score entries of both launches), the exact tiles' plan to draw; no recall."""
    impl: Any = fast if impl_name == "fast" else reference
    tile_modes = modes(impl, q, k, params)
    packed = packing(impl, k, v, params)
    exact, _ = impl.delta_xattention_plans(q, tile_modes, packed)
    reduction = float(impl.delta_xattention_kv_reduction(tile_modes, packed).mean())
    share = float((tile_modes == PACKED).sum()) / max(1.0, float((tile_modes != 0).sum()))
    return MethodView(density=impl.delta_xattention_density(tile_modes, packed), recall=None, plan=exact,
                      notes=f"KV reduction {reduction:.3f}, packed tiles {share:.3f}")


def extras(impl_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: dict[str, Any],
           view: MethodView) -> dict[str, float]:
    """The thesis's KV reduction `f (1 - p)` (keys loaded relative to XAttention's same tiles),
    the tiles' keep ratio, the share of packed tiles among the computed ones, and the
    full-attention mass on the exact tiles and on the computed (exact or packed) tiles."""
    from ..fast.xattention import tiles_to_plan as fast_to_plan
    from ..reference.xattention import tiles_to_plan as reference_to_plan

    impl: Any = fast if impl_name == "fast" else reference
    tile_modes = modes(impl, q, k, params)
    packed = packing(impl, k, v, params)
    to_plan = fast_to_plan if impl_name == "fast" else reference_to_plan
    computed = to_plan(tile_modes != SKIPPED, seqlen=q.shape[2], block=int(params.get("block", 128)))
    assert view.plan is not None
    return {"kv_reduction": float(impl.delta_xattention_kv_reduction(tile_modes, packed).mean()),
            "keep_ratio": float(packed.keep_ratio().mean()),
            "packed_tiles": float((tile_modes == PACKED).sum()) / max(1.0, float((tile_modes != SKIPPED).sum())),
            "exact_mass": float(impl.recall(q, k, view.plan).double().mean()),
            "covered_mass": float(impl.recall(q, k, computed).double().mean())}


# The thesis's variants (`compare --ablations`, docs/delta_xattention.md): (label, exact_top,
# unselected), each over XAttention thresholds x cosine thresholds at stride 8, 128-token tiles.
VARIANTS = (("diag", 0.0, "skip"), ("tw10", 0.1, "skip"), ("tw10 fill", 0.1, "packed"), ("sketch", 1.0, "packed"))
def variant_grid(top: float, unselected: str) -> Callable[[int], list[dict[str, Any]]]:
    return lambda n: [{"stride": 8, "threshold": t, "exact_top": top, "unselected": unselected,
                       "delta_threshold": c, "metric": "cosine", "block": 128, "packed_block": 32}
                      for t in (0.8, 0.9, 0.95) for c in (0.95, 0.9, 0.85, 0.8, 0.75)]


ABLATIONS = tuple(
    Ablation(label, variant_grid(top, unselected),
             about={"diag": "only the diagonal exact", "tw10": "the heaviest 10% of selected tiles exact too",
                    "tw10 fill": "tw10, the unselected causal tiles packed instead of dropped",
                    "sketch": "every selected tile exact, every unselected causal tile packed"}[label])
    for label, top, unselected in VARIANTS)


def _params(n: int, delta_threshold: float) -> dict[str, Any]:
    return {"stride": 8, "threshold": 0.9, "exact_top": 0.1, "delta_threshold": delta_threshold,
            "metric": "cosine", "block": tile_block(n), "packed_block": 32}


METHOD = register(Method(
    check=keyword_check(check_xattention_params),
    name="delta_xattention",
    knobs=("threshold",),
    notes="DeltaXAttention: XAttention's tiles, the diagonal and top tiles exact, the other "
          "selected tiles through per-tile Delta-KV anchors (thesis sec. 4.2)",
    reference_run=reference.delta_xattention,
    fast_run=fast.delta_xattention,
    defaults=lambda n: _params(n, 0.83),
    sweep=lambda n: [_params(n, t) for t in (0.95, 0.9, 0.85, 0.8, 0.75)],
    ablations=ABLATIONS,
    extras=extras,
    view=view,
    sync=SyncStatus(
        syncs=("dense fallback (CUDA, on by default): the [Hq] flags of the heads whose exact and packed pairs "
               "do not beat dense (dense_query_heads: flags.nonzero().tolist()), one read after the tiles and "
               "the keep mask, before packing",
               "exact tiles to plan: as xattention",
               "packing: each group's packed buffer size (offsets[-1].item()) and repeat_interleave of segment "
               "ids; merging groups (int(p.offsets[-1]))",
               "packed plan: the widest packed region (int(ends[..., -1].max())), the list width (mask_to_list)",
               "packed launch: whether any tile is packed (bool(...any()))",
               "packed launch: the ragged launcher's offset range check, as delta_kv"),
        capture_safe=False,
        note="the packed keys' count is data-dependent, as delta_kv"),
))
