"""SharePrefill (Peng et al.) as a method descriptor: its cross-layer state."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


from .. import fast, reference
from ._common import MASS_CALIBRATION, keyword_check
from ..reference.shareprefill import check_share_params
from ._core import Method, SyncStatus, register

# The parameters of one prefill's state (the layer index comes from the model).
STATE_KEYS = ("layout", "tau", "delta", "gamma", "block_m", "block_n", "init_columns", "local_diagonals")


def new_state(params: Mapping[str, Any]) -> reference.SharePrefillState:
    """The per-prefill state from SharePrefill's parameters (the layer comes from the model)."""
    unknown = sorted(set(params) - set(STATE_KEYS))
    if unknown:
        raise ValueError(f"shareprefill in a model takes {STATE_KEYS}; got also {unknown} "
                         "(the layer index comes from the model)")
    return reference.SharePrefillState(**params)


METHOD = register(Method(
    check=keyword_check(check_share_params),
    name="shareprefill",
    knobs=("gamma", "tau", "delta"),
    notes="SharePrefill (one layer, fresh state: first head per cluster dense, others Alg. 5); "
          "layers share pivots through SharePrefillState",
    reference_plan=reference.shareprefill_plan,
    fast_plan=fast.shareprefill_plan,
    reference_run=reference.shareprefill,
    fast_run=fast.shareprefill,
    defaults=lambda n: {},
    sweep=lambda n: [{"gamma": g} for g in (0.8, 0.85, 0.9, 0.95, 0.98)],
    calibration=lambda n: [{"gamma": g} for g in MASS_CALIBRATION],
    new_state=new_state,
    coupled_heads="each cluster's first head with d_sparse < delta runs dense and pivots the cluster's other "
                  "heads (Alg. 3/4): one head's gamma changes what its cluster shares",
    reference_layer=reference.shareprefill_layer,
    fast_layer=fast.shareprefill_layer,
    sync=SyncStatus(
        syncs=("decision: the per-head walk of Alg. 3/4 on the host reads the [B, Hq] distances, both "
               "in one transfer (reference choose_patterns); its patterns stay on the host for the dispatch "
               "(fast HostLayerDecision)",
               "plan: both padded line widths in one transfer (padded_lines_many)",
               "plan: the dense and shared heads' block lists (mask_to_list)",
               "vertical-slash heads: the index width (counting pass)",
               "plan and attention: which heads are dense or shared (nonzero().tolist(), int()) from the host "
               "copy of the patterns: a read of a CPU tensor, no device read on a GPU"),
        capture_safe=False,
        note="the pattern of each head is decided on the host from the data (and copied to the device "
             "from pinned memory); the dense heads' passes depend on it"),
))
