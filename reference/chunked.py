"""Chunked prefill with any row-local estimator: plan a chunk of queries over its prefix.

A serving engine that splits a prompt into chunks has, for chunk `[P, P + n)`, the
chunk's queries and the keys/values of positions `[0, P + n)` (the cached prefix and
the chunk). `chunk_plan` plans such a chunk with any `*_plan(q, k, **params)` of this
package: it runs the estimator on the prompt so far with the prefix's queries set to
zero (they are not available) and keeps the chunk's rows (`BlockColumnPlan.rows`).

That is exactly the plan the method would give those rows with the real prefix
queries for every estimator whose rows `[P, P + n)` read only queries in
`[P, P + n)`: the geometric methods (no queries read), per-query-block estimators
(block-sparse, XAttention, DPXA, AnchorAttention) and the last-queries estimators
(vertical-slash, FlexPrefill's), whose last `last_q` queries are then the chunk's own
(`last_q` is capped at the chunk's length). `conformance.registry.MethodSpec.chunked`
says which registered methods are such; `tests/test_chunked.py` checks, for each, that
the chunk plan equals the one-shot plan of the prompt up to the chunk's end,
restricted to the chunk's rows. Methods that read queries across the whole prompt
(SampleAttention's sampled rows, SharePrefill's pivots) or change the keys (Delta-KV)
need the whole prompt: see docs/serving.md.

Cost: the estimator runs over the prefix's rows too (zero queries); the plan rows
outside the chunk are dropped. For the last-queries methods that is their index pass
over `P + n` rows; for per-query-block scorers it repeats the prefix's scoring.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from ._checks import check_tensor
from .plan import BlockColumnPlan

PlanFn = Callable[..., BlockColumnPlan]

# Plan functions whose rows read queries across the whole prompt (or a layer's state):
# a chunk planned over zero prefix queries would be a different method, so they are
# refused (conformance.registry: their `MethodSpec.chunked` is empty).
WHOLE_PROMPT = {
    "sample_attention_plan": "SampleAttention samples query rows across the whole prompt (Stage 1)",
    "shareprefill_plan": "SharePrefill decides each head's pattern from the whole prompt's last block and "
                         "its layer state",
    "shareprefill_layer_plan": "SharePrefill decides each head's pattern from the whole prompt's last block "
                               "and its layer state",
    "headwise_plan": "headwise's heads may take methods that read the whole prompt (SampleAttention among its "
                     "defaults); chunk a layer whose heads all chunk by each head's own method",
}


def chunk_inputs(plan_fn: PlanFn, q: object, k: object,
                 params: dict[str, Any]) -> tuple[torch.Tensor, int, dict[str, Any]]:
    """The zero-prefixed queries, the query offset P and the parameters of a chunk.

    Raises:
        TypeError, ValueError: naming the argument, before any estimate.
    """
    if not callable(plan_fn):
        raise TypeError(f"plan_fn must be a callable *_plan(q, k, **params), got {type(plan_fn).__name__}")
    why = WHOLE_PROMPT.get(getattr(plan_fn, "__name__", ""))
    if why is not None:
        raise ValueError(f"plan_fn={plan_fn.__name__} needs the whole prompt: {why}; chunk_plan takes "
                         "estimators whose rows read only their own chunk's queries (docs/serving.md)")
    q = check_tensor("q", q, rank=4)
    k = check_tensor("k", k, rank=4)
    if 0 in q.shape:
        raise ValueError(f"q must not be empty, got shape {tuple(q.shape)}")
    n, keys = q.shape[2], k.shape[2]
    if keys < n:
        raise ValueError(f"k must hold the prefix and the chunk (P + N >= N={n} keys), got {keys} keys")
    if k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3] or k.device != q.device:
        raise ValueError(f"k must be [B={q.shape[0]}, Hkv, P + N, D={q.shape[3]}] on {q.device}, got "
                         f"{tuple(k.shape)} on {k.device}")
    prefix = keys - n
    if prefix == 0:
        full = q
    else:
        full = torch.cat([q.new_zeros(q.shape[0], q.shape[1], prefix, q.shape[3]), q], dim=2)
    params = dict(params)
    for name, value in params.items():
        # Per-head configs (MInferenceConfig) cap their heads' last_q the same way.
        if hasattr(value, "cap_last_q"):
            params[name] = value.cap_last_q(n)
    check_chunk_alignment(plan_fn, params, prefix, keys)
    last_q = inspect.signature(plan_fn).parameters.get("last_q")
    if last_q is not None:
        # The estimate's last queries are the chunk's own.
        value = params.get("last_q", last_q.default)
        if isinstance(value, int) and not isinstance(value, bool) and value > n:
            params["last_q"] = n
    return full, prefix, params


# The estimator parameter that sets a plan's query block rows, by the package's naming
# convention (block_m; block_size for square blocks; block for XAttention-style tiles),
# and the one that groups query blocks over one column list (`column_group`).
_ROW_BLOCK_PARAMS = ("block_m", "block_size", "block")
_GROUP_PARAM = "step"


def check_chunk_alignment(plan_fn: PlanFn, params: dict[str, Any], prefix: int, keys: int) -> None:
    """Refuse a prefix P that `chunk_rows` would refuse, before the estimator runs.

    The plan's query block rows and column group are read from `plan_fn`'s parameters
    (given or default; see `_ROW_BLOCK_PARAMS`); `chunk_rows` checks the plan itself
    again afterwards, so an estimator named otherwise is still refused, only later.

    Raises:
        ValueError: P is not a multiple of `block_m * column_group`.
    """
    if prefix == 0:
        return
    try:
        sig = inspect.signature(plan_fn).parameters
    except (TypeError, ValueError):
        return
    def value(name: str) -> object:
        p = sig.get(name)
        return params.get(name, p.default if p is not None else None)
    rows = next((value(n) for n in _ROW_BLOCK_PARAMS if n in sig), None)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        return
    step = value(_GROUP_PARAM) if _GROUP_PARAM in sig else 1
    group = min(step, -(-keys // rows)) if isinstance(step, int) and not isinstance(step, bool) and step >= 1 else 1
    align = rows * group
    if prefix % align:
        raise ValueError(f"the prefix length P={prefix} (k has P + N keys) must be a multiple of the plan's "
                         f"block_m * column_group = {rows} * {group} = {align}: chunks start on query blocks "
                         "and never split a group sharing its column list")


def chunk_plan(plan_fn: PlanFn, q: torch.Tensor, k: torch.Tensor, **params: Any) -> BlockColumnPlan:
    """Plan the chunk `q` (positions `[P, P + N)`) over the keys `k` (positions `[0, P + N)`).

    Args:
        plan_fn: a row-local `*_plan(q, k, **params)` of this package (registered
            methods with `MethodSpec.chunked`; e.g. `vertical_slash_plan`).
        q: `[B, Hq, N, D]`, the chunk's queries; k: `[B, Hkv, P + N, D]`.
        **params: passed to `plan_fn`; a `last_q` above N is capped at N (in a per-head
            config too: any parameter with a `cap_last_q(N)` method, as `MInferenceConfig`).

    Returns:
        A plan with `query_offset = P`, `seqlen = N`, `key_len = P + N`: run it with
        `sparse_attention(q, k, v, plan)`.

    Raises:
        TypeError, ValueError: bad inputs, what `plan_fn` raises, or a P that is not a
            multiple of the plan's `block_m`.
    """
    full, prefix, params = chunk_inputs(plan_fn, q, k, params)
    return chunk_rows(plan_fn(full, k, **params), prefix)


def chunk_rows(plan: BlockColumnPlan, prefix: int) -> BlockColumnPlan:
    """The rows `[prefix, seqlen)` of a plan of the zero-prefixed prompt.

    A chunk starts on a query block, and on a column group when query blocks share
    their column lists (`column_group > 1`, AnchorAttention's groups): the group's
    shared list is estimated from all its rows, so a chunk that split it would read
    prefix queries.

    Raises:
        ValueError: `prefix` is not a multiple of `block_m * column_group`.
    """
    align = plan.block_m * plan.column_group
    if prefix % align:
        raise ValueError(f"the prefix length P={prefix} (k has P + N keys) must be a multiple of the plan's "
                         f"block_m * column_group = {plan.block_m} * {plan.column_group} = {align}: chunks "
                         "start on query blocks and never split a group sharing its column list")
    return plan.rows(prefix, plan.seqlen) if prefix else plan
