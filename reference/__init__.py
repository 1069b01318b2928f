"""sparseprefill.reference: every method in plain, readable PyTorch (the specification).

`fast` exports the same names with the same signatures; see `docs/`.
"""

from .attention import attention, sparse_attention
from .dense import dense, dense_plan
from .metrics import density, recall, relative_error
from .plan import BlockColumnPlan
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
