"""DPXA (delta-based tile scoring, DeltaAttention thesis sec. 4.3) as a method descriptor."""

from __future__ import annotations

from .. import fast, reference
from ._common import TILE_SWEEP, keyword_check, tile_block
from ..reference.dpxa import check_dpxa_params
from ._core import Method, SyncStatus, register
from .xattention import tile_suite

METHOD = register(Method(
    check=keyword_check(check_dpxa_params),
    name="dpxa",
    notes="DPXA: delta anchors of Q and K per tile, anchor-pair tile scores, XAttention's greedy "
          "selection (thesis sec. 4.3)",
    reference_plan=reference.dpxa_plan,
    fast_plan=fast.dpxa_plan,
    reference_run=reference.dpxa,
    fast_run=fast.dpxa,
    defaults=lambda n: {"cos_threshold": 0.75, "threshold": 0.9, "block": tile_block(n)},
    sweep=lambda n: [{"cos_threshold": 0.75, "threshold": t, "block": tile_block(n)} for t in TILE_SWEEP],
    chunked="as xattention: the chunk's own tiles",
    sync=SyncStatus(syncs=("tiles to plan: as xattention",), static_bound="as xattention"),
    bench=tile_suite("dpxa"),
))
