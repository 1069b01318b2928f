"""Attention from a dense mask or from a plan, on the block/column Triton kernel.

A plan's `dense_heads` (heads marked to run full causal attention: the break-even rule of
`reference.dense_fallback`, a calibrated config's dense heads) are honoured here: those
heads run through the fastest dense attention available (`dense_heads_attention`: torch
SDPA, cuDNN or flash, with GQA through `enable_gqa`, K and V never copied) and the kernel
runs the other heads in the same call; where SDPA cannot serve (a state to continue, an
lse or block means to return, no CUDA device) the marked heads get their full causal
lists (`BlockColumnPlan.with_dense_lists`) and the kernel runs every head.
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from ..reference.attention import AttentionState, check_attention_inputs
from ..reference.dense_fallback import active_rates, dense_cost, kernel_tile
from ..reference.plan import BlockColumnPlan
from .dense import dense_plan
from .kernels import block_column_attention


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    return_lse: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    return_lse: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention with an optional dense mask (see `reference.attention`).

    The kernel walks every causal key tile; with a mask it also reads the mask tile
    (O(N^2) bytes read, since the mask itself is that large).

    Args:
        q: `[B, Hq, N, D]` float16/bfloat16; k, v: `[B, Hkv, P + N, D]`: P = 0, or
            P > 0 for a chunk of queries at positions `[P, P + N)` over all `P + N`
            keys (as `reference.attention`).
        mask: bool, `[N, N]` or broadcastable to `[B, Hq, N, N]`, or None; only with P = 0.
        scale: softmax scale, `1/sqrt(D)` if None.
        return_lse: also return the natural-log lse, float32 `[B, Hq, N]`.

    Returns:
        out `[B, Hq, N, D]` (and lse): rows with no kept key give 0 and -inf.

    Raises:
        TypeError, ValueError: bad inputs, before any kernel launch.
    """
    check_attention_inputs(q, k, v, mask)
    plan = dense_plan(q, k)
    out, lse = block_column_attention(
        q, k, v, plan, mask=mask, scale=scale, return_lse=return_lse, validate_plan=False
    )
    if return_lse:
        assert lse is not None
        return out, lse
    return out


@overload
def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    scale: float | None = None,
    return_lse: Literal[False] = False,
    state: AttentionState | None = None,
    block_mean_out: torch.Tensor | None = None,
) -> torch.Tensor: ...


@overload
def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    scale: float | None = None,
    return_lse: Literal[True],
    state: AttentionState | None = None,
    block_mean_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    state: AttentionState | None = None,
    block_mean_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention restricted to a plan (see `reference.sparse_attention`).

    The plan is validated before launch; its block sizes must be multiples of 16.

    Args:
        q, k, v, plan, scale, return_lse: as `reference.sparse_attention`.
        state: a float32 `AttentionState` to start from, updated in place (one kernel
            pass reads and writes it); None starts from nothing.
        block_mean_out: float32 `[B, Hq, Qb, Kb]` filled with the mean scaled logit of
            every listed block (accumulated in the kernel pass), -inf elsewhere.

    Raises:
        TypeError, ValueError: bad inputs or plan, before any kernel launch.
    """
    if isinstance(plan, BlockColumnPlan) and plan.dense_heads:
        if state is None and block_mean_out is None and not return_lse and sdpa_serves(q, plan):
            return run_plan(q, k, v, plan, scale=scale, validate_plan=True)
        plan = plan.with_dense_lists()
    out, lse = block_column_attention(q, k, v, plan, scale=scale, return_lse=return_lse,
                                      state=state, block_mean_out=block_mean_out)
    if return_lse:
        assert lse is not None
        return out, lse
    return out


def sdpa_serves(q: torch.Tensor, plan: BlockColumnPlan) -> bool:
    """Whether the dense heads of `plan` go to torch SDPA: q on a CUDA device, a whole
    prompt (no query offset), and SDPA the faster dense path of the rates in force (the
    rule's table, else the device's: `reference.dense_fallback`)."""
    return not plan.query_offset and sdpa_is_faster(q, seqlen=plan.seqlen, block_m=plan.block_m)


def sdpa_is_faster(q: torch.Tensor, *, seqlen: int, block_m: int) -> bool:
    """Whether torch SDPA is the dense path for `q` (a whole prompt of `seqlen` queries on
    a CUDA device, the kernel's query block `block_m`): q on a CUDA device and SDPA the
    faster dense path of the rates in force."""
    if not q.is_cuda:
        return False
    from ..reference.dense_fallback import device_rates

    rates = active_rates(q) or device_rates(q.device)
    rate = rates.at(seqlen, int(q.shape[-1]), q.dtype, kernel_tile(block_m))
    return dense_cost(rate)[1] == "sdpa"


def dense_heads_into(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: tuple[int, ...], out: torch.Tensor | None, *,
    scale: float | None = None, block_m: int = 128,
) -> torch.Tensor:
    """Full causal attention of the query heads `heads` of a whole prompt, written into `out`.

    What a method that is not one plan's attention (Delta-KV, DeltaXAttention) runs its
    dense heads through: torch SDPA (`dense_heads_attention`, K and V never copied) where
    `sdpa_is_faster`, else our kernel on the dense plan with every other head's counts 0
    (their programs leave at once).

    Args:
        q: `[B, Hq, N, D]`; k, v: `[B, Hkv, N, D]` (checked by the caller).
        heads: sorted distinct query heads.
        out: `[B, Hq, N, D]` written at `heads`; None: every head is listed and the result
            is a new tensor.
        scale: softmax scale, `1/sqrt(D)` if None.
        block_m: the method's query block (which rates apply).

    Returns:
        `out` (or the new output).
    """
    hq, hkv = int(q.shape[1]), int(k.shape[1])
    if out is None and len(heads) != hq:
        raise ValueError(f"dense_heads_into needs `out` unless every head is listed ({len(heads)} of {hq})")
    if not heads:
        assert out is not None
        return out
    if sdpa_is_faster(q, seqlen=int(q.shape[2]), block_m=block_m):
        if out is None:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                    enable_gqa=hq > hkv)
        return dense_heads_attention(q, k, v, heads, out, scale=scale)
    plan = dense_plan(q, k)
    if len(heads) != hq:
        plan = plan.without_heads([h for h in range(hq) if h not in set(heads)])
    res, _ = block_column_attention(q, k, v, plan, scale=scale, validate_plan=False)
    if out is None:
        return res
    idx = torch.tensor(heads, device=q.device)
    return out.index_copy_(1, idx, res.index_select(1, idx))


def dense_heads_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: tuple[int, ...], out: torch.Tensor, *,
    scale: float | None = None,
) -> torch.Tensor:
    """Write full causal attention of the query heads `heads` into `out`, through torch SDPA.

    The heads are grouped by their KV head: every KV head whose whole group is listed
    KV heads form one SDPA call when they are a contiguous run with the same number of
    listed query heads each (every head dense, say), otherwise one call per KV head with
    its listed query heads (`enable_gqa` where a call has more query than KV heads); q
    is gathered per call (a copy of the listed heads' queries), K and V are sliced
    views, never copied.

    Args:
        q: `[B, Hq, N, D]`; k, v: `[B, Hkv, N, D]`.
        heads: sorted distinct query heads.
        out: `[B, Hq, N, D]`, written in place at those heads.
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        `out`.
    """
    hq, hkv = int(q.shape[1]), int(k.shape[1])
    g = hq // hkv
    by_kv: dict[int, list[int]] = {}
    for h in heads:
        by_kv.setdefault(h // g, []).append(h)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    kv = sorted(by_kv)
    counts = {len(hs) for hs in by_kv.values()}
    if len(counts) == 1 and kv == list(range(kv[0], kv[-1] + 1)):
        # A contiguous run of KV heads with the same count each: one call, K and V sliced (views).
        per = counts.pop()
        j0, j1 = kv[0], kv[-1] + 1
        idx = torch.tensor([h for j in kv for h in by_kv[j]], device=q.device)
        qs = q if len(idx) == hq else q.index_select(1, idx)
        res = sdpa(qs, k[:, j0:j1], v[:, j0:j1], is_causal=True, scale=scale, enable_gqa=per > 1)
        if len(idx) == hq:
            out.copy_(res)
        else:
            out.index_copy_(1, idx, res)
        return out
    for j, hs in sorted(by_kv.items()):
        idx = torch.tensor(hs, device=q.device)
        res = sdpa(q.index_select(1, idx), k[:, j:j + 1], v[:, j:j + 1], is_causal=True, scale=scale,
                   enable_gqa=len(hs) > 1)
        out.index_copy_(1, idx, res)
    return out


def run_plan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockColumnPlan, *, scale: float | None = None,
    validate_plan: bool = False,
) -> torch.Tensor:
    """The output of a plan, its `dense_heads` honoured: the kernel on the other heads (the
    marked heads' counts set to 0: their programs leave at once), SDPA on the marked ones
    where `sdpa_serves`, else the kernel on `with_dense_lists()`. What every fast method
    runs its plan through (the estimators' plans are valid by construction: `validate_plan`
    False).

    Returns:
        `[B, Hq, N, D]` in q's dtype.
    """
    if not plan.dense_heads:
        out, _ = block_column_attention(q, k, v, plan, scale=scale, validate_plan=validate_plan)
        return out
    if not sdpa_serves(q, plan):
        out, _ = block_column_attention(q, k, v, plan.with_dense_lists(), scale=scale, validate_plan=validate_plan)
        return out
    if validate_plan:
        plan.ensure_valid()
    if len(plan.dense_heads) == plan.num_heads:
        from ..reference._checks import check_qkv
        from ..reference.attention import check_plan

        shape = check_qkv(q, k, v)
        check_plan(plan, shape.batch, shape.q_heads, shape.seqlen, q.device)
        out = torch.empty_like(q)
    else:
        out, _ = block_column_attention(q, k, v, plan.without_heads(plan.dense_heads), scale=scale,
                                        validate_plan=False)
    return dense_heads_attention(q, k, v, plan.dense_heads, out, scale=scale)
