"""Attention from a dense mask or from a plan, on the block/column Triton kernel.

A plan's `dense_heads` (heads marked to run full causal attention: the break-even rule of
`reference.dense_fallback`, a calibrated config's dense heads) are honoured here, the two
ways the rule prices:

* some heads marked: they get their full causal lists (`BlockColumnPlan.with_dense_lists`)
  and the kernel runs them in the same launch as the sparse heads (no copy of q, K or V);
* every head marked, a whole prompt, the call holding the whole layer, on a CUDA device
  where SDPA is the faster dense path of the rates in force: ONE torch SDPA call over
  every head (`enable_gqa`), the call `sparseprefill rates` measures.

torch SDPA is never called on a subset of heads: its rate there is not measured (on an
H200 per-KV-head calls ran far slower than the one call over the layer).
"""

from __future__ import annotations

from typing import Literal, overload

import torch

from ..reference.attention import AttentionState, check_attention_inputs
from ..reference.dense_fallback import DENSE_TILE, active_rates, dense_cost, kernel_tile
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
    if (isinstance(plan, BlockColumnPlan) and plan.dense_heads and state is None and block_mean_out is None
            and not return_lse and sdpa_serves(q, plan)):
        return run_plan(q, k, v, plan, scale=scale, validate_plan=True)
    out, lse = block_column_attention(q, k, v, plan, scale=scale, return_lse=return_lse,
                                      state=state, block_mean_out=block_mean_out)
    if return_lse:
        assert lse is not None
        return out, lse
    return out


def sdpa_serves(q: torch.Tensor, plan: BlockColumnPlan) -> bool:
    """Whether `plan` runs as one torch SDPA call: every head marked dense, a whole prompt
    (no query offset), and `sdpa_is_faster` (q on a CUDA device, SDPA the faster dense path
    of the rates in force). The caller must hold the whole layer (`run_plan`'s `layer`)."""
    return (len(plan.dense_heads) == plan.num_heads and not plan.query_offset
            and sdpa_is_faster(q, seqlen=plan.seqlen, block_m=plan.block_m))


def sdpa_is_faster(q: torch.Tensor, *, seqlen: int, block_m: int) -> bool:
    """Whether one torch SDPA call over every head is the dense path for `q` (a whole prompt
    of `seqlen` queries, the kernel's query block `block_m`): q on a CUDA device and SDPA
    the faster dense path of the rates in force (the rule's table, else the device's)."""
    if not isinstance(q, torch.Tensor) or not q.is_cuda or q.dim() != 4:
        return False  # bad inputs fall through to the launcher's checks
    from ..reference.dense_fallback import device_rates

    rates = active_rates(q) or device_rates(q.device)
    rate = rates.at(seqlen, int(q.shape[-1]), q.dtype, kernel_tile(block_m))
    return dense_cost(rate)[1] == "sdpa"


def _sdpa_layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Full causal attention of every head as one torch SDPA call (GQA through `enable_gqa`)."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                            enable_gqa=q.shape[1] > k.shape[1])


def dense_heads_into(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: tuple[int, ...], out: torch.Tensor | None, *,
    scale: float | None = None, layer: bool = True,
) -> torch.Tensor:
    """Full causal attention of the query heads `heads` of a whole prompt, written into `out`.

    What a method that is not one plan's attention (Delta-KV, DeltaXAttention,
    AnchorAttention's resumed pass) runs its dense heads through: every head of the layer
    (`layer` and `heads` all of q's) as one torch SDPA call where `sdpa_is_faster`; else our
    kernel on the dense plan of `DENSE_TILE`-row blocks with every other head's counts 0
    (their programs leave at once), K and V never copied. The rule prices both at
    `DENSE_TILE`-row tiles (`reference.dense_fallback`).

    Args:
        q: `[B, Hq, N, D]`; k, v: `[B, Hkv, N, D]` (checked by the caller).
        heads: sorted distinct query heads.
        out: `[B, Hq, N, D]` written at `heads`; None: every head is listed and the result
            is a new tensor.
        scale: softmax scale, `1/sqrt(D)` if None.
        layer: q holds every head of the layer (False for a head group: no SDPA call).

    Returns:
        `out` (or the new output).
    """
    hq = int(q.shape[1])
    if out is None and len(heads) != hq:
        raise ValueError(f"dense_heads_into needs `out` unless every head is listed ({len(heads)} of {hq})")
    if not heads:
        assert out is not None
        return out
    if len(heads) == hq and layer and sdpa_is_faster(q, seqlen=int(q.shape[2]), block_m=DENSE_TILE):
        res = _sdpa_layer(q, k, v, scale)
        return res if out is None else out.copy_(res)
    plan = dense_plan(q, k, block_m=DENSE_TILE, block_n=DENSE_TILE)
    if len(heads) != hq:
        plan = plan.without_heads([h for h in range(hq) if h not in set(heads)])
    res, _ = block_column_attention(q, k, v, plan, scale=scale, validate_plan=False)
    if out is None:
        return res
    idx = torch.tensor(heads, device=q.device)
    return out.index_copy_(1, idx, res.index_select(1, idx))


def run_plan(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockColumnPlan, *, scale: float | None = None,
    validate_plan: bool = False, layer: bool = True,
) -> torch.Tensor:
    """The output of a plan, its `dense_heads` honoured: one torch SDPA call where every head
    is marked and `sdpa_serves` (and `layer`: q holds the whole layer), else the kernel on
    the plan with the marked heads' lists written full (the launcher's
    `with_dense_lists()`), one launch. What every fast method runs its plan through (the
    estimators' plans are valid by construction: `validate_plan` False).

    Returns:
        `[B, Hq, N, D]` in q's dtype.
    """
    if layer and plan.dense_heads and sdpa_serves(q, plan):
        from ..reference._checks import check_qkv
        from ..reference.attention import check_plan

        if validate_plan:
            plan.ensure_valid()
        shape = check_qkv(q, k, v)
        check_plan(plan, shape.batch, shape.q_heads, shape.seqlen, q.device)
        return _sdpa_layer(q, k, v, scale)
    out, _ = block_column_attention(q, k, v, plan, scale=scale, validate_plan=validate_plan)
    return out
