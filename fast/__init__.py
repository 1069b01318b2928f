"""sparseprefill.fast: the `reference` API on fused Triton kernels.

Same names, signatures, defaults and return types as `sparseprefill.reference`.
Inputs are float16/bfloat16 CUDA tensors (or CPU tensors under
`TRITON_INTERPRET=1`); everything is validated before any kernel launch.
"""

from ..reference.plan import BlockColumnPlan
from .attention import attention, sparse_attention
from .dense import dense, dense_plan
from .metrics import density, recall, relative_error
from .streaming import streaming, streaming_plan

__all__ = [
    "BlockColumnPlan",
    "attention",
    "dense",
    "dense_plan",
    "density",
    "recall",
    "relative_error",
    "sparse_attention",
    "streaming",
    "streaming_plan",
]
