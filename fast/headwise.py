"""`headwise` on the GPU: every query head its own method, one merged plan, one kernel launch
(see `reference.headwise` for the spec).

The same grouping and merging as the reference (`reference.headwise.headwise_plan_with`), with
`fast`'s estimators: each group of heads that share a method is estimated once on its own
heads, the groups' plans merged at their finest common unit on the device
(`reference.plan.merge_heads`: slices written in place, no host read), the break-even rule
applied to the merged plan, then one block/column launch (the dense heads through SDPA).

Host synchronisations: each group's estimator's own (docs/dense-fallback.md and the
method descriptors' `sync`), and the rule's `[Hq]` flags once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..reference._checks import HALF_DTYPES, check_qkv
from ..reference.headwise import KNOBS, Estimator, HeadChoice, headwise_plan_with
from ..reference.plan import BlockColumnPlan
from .attention import run_plan
from .dense_fallback import apply_rule
from .kernels import check_forward_only


def fast_estimators() -> dict[str, Estimator]:
    """The fast package's estimators, by method name (the same names and knobs as
    `reference.headwise.reference_estimators`)."""
    from .a_shape import a_shape_plan
    from .anchor_attention import anchor_attention_plan
    from .block_sparse import block_sparse_plan
    from .dense import dense_plan
    from .dpxa import dpxa_plan
    from .flexprefill_vs import flexprefill_vs_plan
    from .sample_attention import sample_attention_plan
    from .streaming import streaming_plan
    from .vertical_slash import vertical_slash_plan
    from .xattention import xattention_plan

    plans: dict[str, Callable[..., BlockColumnPlan]] = {
        "xattention": xattention_plan, "dpxa": dpxa_plan, "vertical_slash": vertical_slash_plan,
        "flexprefill_vs": flexprefill_vs_plan, "sample_attention": sample_attention_plan,
        "anchor_attention": anchor_attention_plan, "block_sparse": block_sparse_plan, "a_shape": a_shape_plan,
        "streaming": streaming_plan, "dense": dense_plan,
    }
    return {name: Estimator(fn, KNOBS[name]) for name, fn in plans.items()}


def headwise_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    heads: Sequence[HeadChoice],
    scale: float | None = None,
) -> BlockColumnPlan:
    """One plan of a layer whose query heads each take their own method (see
    `reference.headwise_plan`).

    Raises:
        TypeError, ValueError: bad inputs or choices.
    """
    return apply_rule(headwise_plan_with(fast_estimators(), q, k, heads=heads, scale=scale), q)


def headwise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    heads: Sequence[HeadChoice],
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of a layer whose query heads each take their own method: `headwise_plan`, then
    one block/column launch (see `reference.headwise`).

    Returns:
        `[B, Hq, N, D]` in q's dtype.
    """
    check_qkv(q, k, v, dtypes=HALF_DTYPES)
    check_forward_only(q, k, v)
    return run_plan(q, k, v, headwise_plan(q, k, heads=heads, scale=scale), scale=scale)
