"""MInference end to end on the GPU (see `reference.minference` for the spec).

The same dispatch and search code as the reference, with `fast`'s estimators, one
block/column kernel launch per layer, and `fast.attention` as the dense target of
the search.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..reference._checks import HALF_DTYPES, check_qkv
from ..reference.minference import (
    TABLE4,
    HeadPattern,
    Methods,
    MInferenceConfig,
    SearchResult,
    minference_plan_with,
    search_patterns_with,
)
from ..reference.plan import BlockColumnPlan
from .a_shape import a_shape, a_shape_plan
from .attention import attention, run_plan, sparse_attention
from .block_sparse import block_sparse, block_sparse_plan
from .dense_fallback import apply_rule
from .kernels import check_forward_only, check_kernel_block_sizes
from .vertical_slash import vertical_slash, vertical_slash_plan


def _kernel_blocks(block_m: int, block_n: int, names: tuple[str, str]) -> None:
    check_kernel_block_sizes(block_m, block_n, names=names)


FAST_METHODS = Methods(
    plans={"a_shape": a_shape_plan, "vertical_slash": vertical_slash_plan, "block_sparse": block_sparse_plan},
    runs={"a_shape": a_shape, "vertical_slash": vertical_slash, "block_sparse": block_sparse},
    sparse_attention=sparse_attention,
    attention=attention,
    check_blocks=_kernel_blocks,
)


def minference_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    config: MInferenceConfig,
    *,
    layer: int = 0,
    scale: float | None = None,
) -> BlockColumnPlan:
    """The merged plan of one layer (see `reference.minference_plan`).

    Raises:
        TypeError, ValueError, IndexError: bad inputs, config or layer.
    """
    return apply_rule(minference_plan_with(FAST_METHODS, q, k, config, layer=layer, scale=scale), q)


def minference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: MInferenceConfig,
    *,
    layer: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """MInference attention of one layer: one merged plan, one kernel launch.

    Host synchronisation: one per vertical-slash pattern of the layer (its width;
    the bound inside `fast.capture.static_widths()`). A layer mixing patterns merges
    its head plans slice by slice on the device: with the static widths the op is
    capture-safe (`torch.ops.sparseprefill.minference_static`, docs/serving.md).

    Returns:
        `[B, Hq, N, D]` in q's dtype.
    """
    check_qkv(q, k, v, dtypes=HALF_DTYPES)
    check_forward_only(q, k, v)
    plan = minference_plan(q, k, config, layer=layer, scale=scale)
    return run_plan(q, k, v, plan, scale=scale)


def search_patterns(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    candidates: Sequence[HeadPattern] = TABLE4,
    target: float | None = None,
    tolerance: float = 0.05,
    scale: float | None = None,
) -> SearchResult:
    """Kernel-aware pattern search for one layer (see `reference.search_patterns`).

    Raises:
        TypeError, ValueError: bad inputs or arguments.
    """
    return search_patterns_with(FAST_METHODS, q, k, v, candidates=candidates, target=target,
                                tolerance=tolerance, scale=scale)
