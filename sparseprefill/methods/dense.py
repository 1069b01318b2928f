"""Dense causal attention (the baseline) as a method descriptor."""

from __future__ import annotations

from .. import fast, reference
from ._common import shape_only_estimate
from ._core import DistributedEstimate, Method, SyncStatus, register

METHOD = register(Method(
    name="dense",
    notes="full causal attention (baseline)",
    reference_plan=reference.dense_plan,
    fast_plan=fast.dense_plan,
    reference_run=reference.dense,
    fast_run=fast.dense,
    defaults=lambda n: {},
    sweep=lambda n: [{}],
    chunked="nothing: every causal key",
    sync=SyncStatus(),
    distributed=DistributedEstimate("shape", "nothing: the causal triangle depends on N alone",
                                    shape_only_estimate("dense")),
))
