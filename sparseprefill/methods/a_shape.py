"""MInference's A-shape pattern (sink + window at block granularity) as a method descriptor."""

from __future__ import annotations

from .. import fast, reference
from ..reference.streaming import check_streaming_params
from ._common import keyword_check, shape_only_estimate, sink_window
from ._core import DistributedEstimate, Method, SyncStatus, register


def defaults(n: int) -> dict[str, int]:
    return {**sink_window(n), "window": min(4096, max(128, n // 8))}


METHOD = register(Method(
    check=keyword_check(check_streaming_params),
    name="a_shape",
    knobs=("sink", "window"),
    notes="MInference A-shape: streaming with 1024 sink and 4096 window tokens, 64 x 64 blocks",
    reference_plan=reference.a_shape_plan,
    fast_plan=fast.a_shape_plan,
    reference_run=reference.a_shape,
    fast_run=fast.a_shape,
    defaults=defaults,
    sweep=lambda n: [{**sink_window(n), "window": max(128, n // f)} for f in (32, 16, 8, 4)],
    calibration=lambda n: [{**sink_window(n), "window": max(128, n // f)}
                           for f in (64, 32, 24, 16, 12, 8, 6, 4, 3, 2)],
    chunked="nothing: as streaming, at block granularity",
    sync=SyncStatus(note="as streaming"),
    distributed=DistributedEstimate("shape", "nothing: sink and window depend on N alone",
                                    shape_only_estimate("a_shape")),
))
