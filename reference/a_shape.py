"""MInference A-shape heads: StreamingLLM's sink + local window with the paper's defaults.

The paper (Table 4, C.2) uses 1024 initial ("global") tokens and a 4096-token
local window, on 64 x 64 blocks. The plan is `streaming_plan`'s: this module
only fixes the defaults.
"""

from __future__ import annotations

import torch

from ._checks import PerHeadInt
from .plan import BlockColumnPlan
from .streaming import streaming, streaming_plan


def a_shape_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    sink: PerHeadInt = 1024,
    window: PerHeadInt = 4096,
    block_m: int = 64,
    block_n: int = 64,
) -> BlockColumnPlan:
    """A-shape plan: `streaming_plan` with MInference's defaults.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]` (only their shapes are used).
        sink: initial tokens every query sees (>= 0); a scalar, or one per query head.
        window: most recent tokens every query sees, itself included (>= 1); the same.
        block_m, block_n: query rows and keys per block.

    Returns:
        The same `BlockColumnPlan` for every batch row (and head, for scalar knobs),
        without columns.

    Raises:
        TypeError, ValueError: bad inputs.
    """
    return streaming_plan(q, k, sink=sink, window=window, block_m=block_m, block_n=block_n)


def a_shape(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    sink: PerHeadInt = 1024,
    window: PerHeadInt = 4096,
    block_m: int = 64,
    block_n: int = 64,
    scale: float | None = None,
) -> torch.Tensor:
    """A-shape attention: `streaming` with MInference's defaults.

    Returns:
        `[B, Hq, N, D]` in q's dtype.
    """
    return streaming(q, k, v, sink=sink, window=window, block_m=block_m, block_n=block_n, scale=scale)
