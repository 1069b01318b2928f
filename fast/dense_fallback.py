"""The break-even rule and the early exit in `fast` (the rule itself: `reference.dense_fallback`).

`fast` calls the reference's functions, so both packages mark the same heads given equal
plans and the same rates. The one difference: inside `fast.capture.static_widths()` (the
`_static` ops) and during CUDA-graph capture the rule is off, so those paths stay free of
host synchronisations.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..reference import dense_fallback as spec
from ..reference.dense_fallback import (
    DEFAULT_TABLE,
    RatePoint,
    RateTable,
    dense_fallback,
    early_exit_enabled,
    probe_gap_density,
    probe_mass_density,
)
from ..reference.plan import BlockColumnPlan
from .capture import static_widths_active

__all__ = ["DEFAULT_TABLE", "RatePoint", "RateTable", "active_rates", "apply_rule", "dense_fallback",
           "early_exit_enabled", "plan_with_fallback", "probe_gap_density", "probe_mass_density"]


def active_rates(t: torch.Tensor) -> RateTable | None:
    """`reference.dense_fallback.active_rates`, and None inside `static_widths()`."""
    if static_widths_active(t):
        return None
    return spec.active_rates(t)


def apply_rule(plan: BlockColumnPlan, q: torch.Tensor, *, layer: bool = True) -> BlockColumnPlan:
    """`reference.dense_fallback.apply_rule` with `active_rates` (the plan unchanged when off);
    `layer` False for a plan of a head group (no one-call SDPA option)."""
    rates = active_rates(q)
    return plan if rates is None else spec.apply_rule(plan, q, rates=rates, layer=layer)


def plan_with_fallback(
    q: torch.Tensor,
    k: torch.Tensor,
    estimate: Callable[[list[int] | None], BlockColumnPlan],
    *,
    block_m: int,
    block_n: int,
    probe: Callable[[], torch.Tensor] | None = None,
) -> BlockColumnPlan:
    """`reference.dense_fallback.plan_with_fallback` with `active_rates`."""
    return spec.plan_with_fallback(q, k, estimate, rates=active_rates(q), block_m=block_m, block_n=block_n,
                                   probe=probe)
