"""Static plan widths: estimators that size a plan from the data can size it from the parameters.

Three estimators read one number back from the GPU to size a plan exactly: the widest
block list of vertical-slash's counting pass, the longest stripe list of
AnchorAttention, the most kept blocks of SampleAttention. That read is a host
synchronisation, and a CUDA graph cannot be captured around it. Each of them also
has a width that holds for every input, from its parameters alone (see the methods'
docs); inside `static_widths()`, and whenever a CUDA graph is being captured on the
tensors' device, they use that bound instead of the read. The plan is then wider
(more padding past the counts: memory, never different attention), and the same
width on every call, so a captured graph replays on any input of the same shape.

`sparseprefill.fast.ops` registers a `<method>_static` op running the method inside
`static_widths()` for every method that has one (docs/serving.md lists them).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_STATE = threading.local()


@contextmanager
def static_widths() -> Iterator[None]:
    """Within this block (this thread), size data-dependent plan widths by their
    parameter bounds: no host synchronisation for the width."""
    previous = getattr(_STATE, "on", False)
    _STATE.on = True
    try:
        yield
    finally:
        _STATE.on = previous


def capturing(t: torch.Tensor) -> bool:
    """True while a CUDA graph is being captured on t's device (no host sync allowed)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def static_widths_active(t: torch.Tensor) -> bool:
    """True when an estimator must use its static width for tensors like `t`:
    inside `static_widths()`, or while a CUDA graph is being captured."""
    return bool(getattr(_STATE, "on", False)) or capturing(t)
