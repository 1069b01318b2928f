"""StreamingLLM (sink + local window, the baseline) as a method descriptor."""

from __future__ import annotations

from .. import fast, reference
from ..reference.streaming import check_streaming_params
from ._common import keyword_check, shape_only_estimate, sink_window
from ._core import DistributedEstimate, Method, SyncStatus, register

METHOD = register(Method(
    check=keyword_check(check_streaming_params),
    name="streaming",
    knobs=("sink", "window"),
    notes="StreamingLLM / A-shape: sink + local window (baseline)",
    reference_plan=reference.streaming_plan,
    fast_plan=fast.streaming_plan,
    reference_run=reference.streaming,
    fast_run=fast.streaming,
    defaults=sink_window,
    sweep=lambda n: [{**sink_window(n), "window": max(128, n // f)} for f in (32, 16, 8, 4, 2)],
    calibration=lambda n: [{**sink_window(n), "window": max(128, n // f)}
                           for f in (64, 32, 24, 16, 12, 8, 6, 4, 3, 2)],
    chunked="nothing: the sink and window are positions (the window ends at each row's own position)",
    sync=SyncStatus(note="width from host arithmetic on the sizes"),
    distributed=DistributedEstimate("shape", "nothing: sink and window depend on N alone",
                                    shape_only_estimate("streaming")),
))
