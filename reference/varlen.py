"""Packed variable-length batches (FlashAttention's varlen layout), the specification.

Sequence `s` of a packed batch is rows `[cu_seqlens[s], cu_seqlens[s + 1])` of
`q: [T, Hq, D]`, `k, v: [T, Hkv, D]`. Every method estimates and plans each sequence
on its own (`varlen_plans`); the stacked plan (`stack_plans`: batch row `s` is
sequence `s`, `seqlen` the longest) runs the whole batch, in `fast` as one kernel
launch. Here, the reference attends each sequence alone with the plan's dense mask.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ._checks import REFERENCE_DTYPES
from .attention import attention
from .plan import BlockColumnPlan, stack_plans

PlanFn = Callable[..., BlockColumnPlan]


def check_varlen(q: object, k: object, v: object, cu_seqlens: object, *,
                 dtypes: tuple[torch.dtype, ...] = REFERENCE_DTYPES) -> list[int]:
    """Check a packed batch; return the host copy of `cu_seqlens` (one sync).

    Raises:
        TypeError, ValueError: naming the argument and what was expected.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("cu_seqlens", cu_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    assert isinstance(cu_seqlens, torch.Tensor)
    if q.dim() != 3 or 0 in q.shape:
        raise ValueError(f"q must be a non-empty [T, Hq, D] tensor, got {tuple(q.shape)}")
    if q.dtype not in dtypes:
        raise TypeError(f"q must have dtype in {dtypes}, got {q.dtype}")
    total, hq, d = q.shape
    if k.dim() != 3 or k.shape[0] != total or k.shape[2] != d or v.shape != k.shape:
        raise ValueError(f"k and v must be [T={total}, Hkv, D={d}] tensors, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"k and v must have q's dtype ({q.dtype}), got {k.dtype} and {v.dtype}")
    if k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"the query heads ({hq}) must be a multiple of the KV heads ({k.shape[1]})")
    if any(t.device != q.device for t in (k, v, cu_seqlens)):
        raise ValueError(f"k, v and cu_seqlens must be on q's device ({q.device})")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise TypeError(f"cu_seqlens must be an int32 [S + 1] tensor (S >= 1), got {cu_seqlens.dtype} "
                        f"{tuple(cu_seqlens.shape)}")
    cu = [int(x) for x in cu_seqlens.tolist()]
    if cu[0] != 0 or cu[-1] != total or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at T={total}, got {cu}")
    return cu


def sequence(t: torch.Tensor, cu: list[int], s: int) -> torch.Tensor:
    """Sequence `s` of a packed `[T, H, D]` tensor as a `[1, H, n, D]` view."""
    return t[cu[s]:cu[s + 1]].transpose(0, 1).unsqueeze(0)


def varlen_plans(plan_fn: PlanFn, q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor,
                 **params: Any) -> BlockColumnPlan:
    """Estimate and plan every sequence on its own, stacked into one plan.

    Args:
        plan_fn: any `*_plan(q, k, **params)` of this package (e.g. `vertical_slash_plan`).
        q: `[T, Hq, D]`; k: `[T, Hkv, D]`; cu_seqlens: int32 `[S + 1]`.
        **params: passed to `plan_fn` for every sequence.

    Returns:
        `stack_plans` of the per-sequence plans: `[S, Hq, max_seqlen]`.

    Raises:
        TypeError, ValueError: bad packed inputs, an empty sequence, or what `plan_fn` raises.
    """
    return plan_sequences(plan_fn, q, k, cu_seqlens, params,
                          dtypes=(q.dtype,) if isinstance(q, torch.Tensor) else REFERENCE_DTYPES)


def plan_sequences(plan_fn: PlanFn, q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor,
                   params: dict[str, Any], *, dtypes: tuple[torch.dtype, ...]) -> BlockColumnPlan:
    """`varlen_plans` of either package: check the packed batch (q's dtype among `dtypes`),
    plan every sequence on its own `[1, H, n, D]` view (no copy), stack the plans.

    Raises:
        TypeError, ValueError: bad packed inputs, an empty sequence, or what `plan_fn` raises.
    """
    if not callable(plan_fn):
        raise TypeError(f"plan_fn must be a callable *_plan(q, k, **params), got {type(plan_fn).__name__}")
    cu = check_varlen(q, k, k, cu_seqlens, dtypes=dtypes)
    if any(b == a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"every sequence must have at least one token, got cu_seqlens {cu}")
    return stack_plans([plan_fn(sequence(q, cu, s), sequence(k, cu, s), **params) for s in range(len(cu) - 1)])


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    plan: BlockColumnPlan,
    *,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of a packed batch under a stacked plan (each sequence alone).

    Args:
        q: `[T, Hq, D]`; k, v: `[T, Hkv, D]`; cu_seqlens: int32 `[S + 1]`.
        max_seqlen: the plan's `seqlen` (>= every sequence's length).
        plan: `[S, Hq, max_seqlen]` (`varlen_plans`, `stack_plans`); keys and rows past
            a sequence's end are ignored.
        scale, return_lse: as `attention`; the lse is float32 `[Hq, T]`.

    Returns:
        out `[T, Hq, D]` (and lse).

    Raises:
        TypeError, ValueError: bad packed inputs or a plan of the wrong size.
    """
    cu = check_varlen(q, k, v, cu_seqlens)
    seqs = len(cu) - 1
    if not isinstance(plan, BlockColumnPlan):
        raise TypeError(f"plan must be a BlockColumnPlan, got {type(plan).__name__}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < max(
            b - a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"max_seqlen must be an int >= the longest sequence, got {max_seqlen!r}")
    if (plan.seqlen, plan.batch, plan.num_heads, plan.query_offset) != (max_seqlen, seqs, q.shape[1], 0):
        raise ValueError(f"plan must be for [S={seqs}, Hq={q.shape[1]}, max_seqlen={max_seqlen}] with "
                         f"query_offset 0, got [{plan.batch}, {plan.num_heads}, {plan.seqlen}]")
    plan.ensure_valid()
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    mask = plan.to_dense_mask()
    for s in range(seqs):
        n = cu[s + 1] - cu[s]
        if n == 0:
            continue
        o, l_s = attention(sequence(q, cu, s), sequence(k, cu, s), sequence(v, cu, s),
                           mask[s:s + 1, :, :n, :n], scale=scale, return_lse=True)
        out[cu[s]:cu[s + 1]] = o[0].transpose(0, 1)
        lse[:, cu[s]:cu[s + 1]] = l_s[0]
    return (out, lse) if return_lse else out
