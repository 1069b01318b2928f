"""Chunked prefill with any row-local estimator (see `reference.chunked`)."""

from __future__ import annotations

from typing import Any

import torch

from ..reference.chunked import PlanFn, chunk_inputs, chunk_rows
from ..reference.plan import BlockColumnPlan


def chunk_plan(plan_fn: PlanFn, q: torch.Tensor, k: torch.Tensor, **params: Any) -> BlockColumnPlan:
    """Plan the chunk `q` (positions `[P, P + N)`) over the keys `k` (positions `[0, P + N)`)
    with a fast estimator (see `reference.chunk_plan`); the kernel runs the result with
    `sparse_attention(q, k, v, plan)`."""
    full, prefix, params = chunk_inputs(plan_fn, q, k, params)
    return chunk_rows(plan_fn(full, k, **params), prefix)
