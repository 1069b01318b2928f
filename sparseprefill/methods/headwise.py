"""`headwise`: per-head method choice (each query head its own method, setting and unit; one
merged plan, one launch per layer) as a method descriptor."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from .. import fast, reference
from ..reference.headwise import KNOBS, METHOD_KEY, check_heads, reference_estimators
from ._common import tile_block, vertical_slash_defaults
from ._core import METHODS, Adapter, Method, SyncStatus, register


def defaults(n: int) -> dict[str, Any]:
    """Four methods at their defaults, heads taking them in turn (head `h` the `h % 4`-th):
    what the demo, bench and compare run without a calibrated config. A deployed `headwise`
    runs the per-head config `sparseprefill calibrate --method headwise` writes."""
    return {"heads": [
        {METHOD_KEY: "xattention", "stride": 8, "threshold": 0.9, "block": tile_block(n)},
        {METHOD_KEY: "vertical_slash", **vertical_slash_defaults(n)},
        {METHOD_KEY: "sample_attention", "alpha_c": 0.95, "alpha_s": 0.95, "block_size": 64},
        {METHOD_KEY: "flexprefill_vs", "gamma": 0.9},
    ]}


def head_candidates(n: int) -> list[dict[str, Any]]:
    """The families `calibrate --method headwise` searches per head: each method's calibration grid
    at each unit listed here (the unit's parameters laid over every grid point).

    Tiles of 128 and 64 (XAttention, SampleAttention's blocks); vertical-slash lines on
    64 x 64 blocks and on 128-row query blocks with 64-key blocks (the kernel's 128-row tile);
    FlexPrefill's lines at token level (`line_block` 1, columns through the column path) and
    in bands of 64; AnchorAttention's stripes (token columns) on 128- and 64-row blocks. DPXA
    (minutes per grid point on a CPU) and block-sparse (no measured estimate cost) are left
    out; `--headwise-candidates` names others.
    """
    return [
        {METHOD_KEY: "xattention", "block": 128},
        {METHOD_KEY: "xattention", "block": 64},
        {METHOD_KEY: "vertical_slash", "block_m": 64, "block_n": 64},
        {METHOD_KEY: "vertical_slash", "block_m": 128, "block_n": 64},
        {METHOD_KEY: "flexprefill_vs", "line_block": 1},
        {METHOD_KEY: "flexprefill_vs", "line_block": 64},
        {METHOD_KEY: "sample_attention", "block_size": 128},
        {METHOD_KEY: "sample_attention", "block_size": 64},
        {METHOD_KEY: "anchor_attention", "block_m": 128, "block_n": 128},
        {METHOD_KEY: "anchor_attention", "block_m": 64, "block_n": 64},
    ]


def check(params: Mapping[str, Any]) -> None:
    """The per-head choices: their form (`reference.headwise.check_heads`), then each head's
    parameters through its own method's check (the message names the head)."""
    heads = params.get("heads")
    check_heads(heads, reference_estimators())
    assert isinstance(heads, (list, tuple))
    for h, entry in enumerate(heads):
        if entry is None:
            continue
        rest = {key: val for key, val in entry.items() if key != METHOD_KEY}
        try:
            METHODS[entry[METHOD_KEY]].check_params(rest)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"heads[{h}] ({entry[METHOD_KEY]}): {exc}") from None


@functools.lru_cache(maxsize=64)
def _heads_from_json(text: str) -> tuple[Any, ...]:
    return tuple(json.loads(text))


def _heads_to_json(heads: object) -> object:
    return json.dumps(list(heads), sort_keys=True) if isinstance(heads, (list, tuple)) else heads


METHOD = register(Method(
    name="headwise",
    notes="per-head method choice: each query head its own method, setting and unit (calibrate --method "
          "headwise), the heads' plans merged at their finest unit, one kernel launch",
    reference_plan=reference.headwise_plan,
    fast_plan=fast.headwise_plan,
    reference_run=reference.headwise,
    fast_run=fast.headwise,
    defaults=defaults,
    check=check,
    head_candidates=head_candidates,
    sync=SyncStatus(
        syncs=("each method's estimate: that method's reads (its descriptor), once per group of heads "
               "sharing a method and its non-knob parameters",
               "dense fallback: the break-even rule's [Hq] flags of the merged plan, one read",),
        capture_safe=False,
        note="the merge writes head slices on the device (no read); a head's group is estimated on its own "
             "heads (q and k sliced where the heads are one run, else gathered)"),
    adapters={"heads": Adapter("str", _heads_to_json, _heads_from_json)},
))

# The methods a head may take are those `reference.headwise` composes; each is registered.
assert set(KNOBS) <= set(METHODS), sorted(set(KNOBS) - set(METHODS))
