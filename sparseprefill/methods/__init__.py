"""sparseprefill.methods: one descriptor per method, the one place a method's facts live.

    from sparseprefill import methods
    m = methods.get("vertical_slash")
    m.fast_plan(q, k, **m.demo_params(N))

Every tool (CLI, demo, bench, compare, eval, `patch`, `fast.ops`, `distributed`) reads
`methods.methods()`; adding a method is one module that calls `register(Method(...))`
(docs/architecture.md). The shipped methods register on import, in this order.
"""

from ._core import (
    METHODS,
    UNKNOWN_SYNC,
    Ablation,
    Adapter,
    DistributedEstimate,
    Method,
    MethodView,
    SyncStatus,
    get,
    methods,
    register,
    unregister,
)
from . import dense, streaming, vertical_slash, block_sparse, a_shape, anchor_attention  # noqa: E402,F401
from . import delta_kv, xattention, dpxa, delta_xattention, sample_attention  # noqa: E402,F401
from . import minference, flexprefill_vs, shareprefill  # noqa: E402,F401
from . import headwise  # noqa: E402,F401

# The method a head with full causal attention runs (`patch`'s `None` heads, the bench's baseline).
DENSE: str = dense.METHOD.name

__all__ = [
    "DENSE",
    "METHODS",
    "UNKNOWN_SYNC",
    "Ablation",
    "Adapter",
    "DistributedEstimate",
    "Method",
    "MethodView",
    "SyncStatus",
    "get",
    "methods",
    "register",
    "unregister",
]
