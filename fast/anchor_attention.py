"""AnchorAttention on the GPU (see `reference.anchor_attention` for the spec and choices).

Three kernel passes, as the paper's Alg. 1-3:

1. anchor: `block_column_attention` over the anchor blocks (the initial key block
   and the group's window) from an empty `AttentionState`; the state's row max
   `m` (natural-log units of the scaled logits) is Equation 1's `x_a` (the plan alone,
   `anchor_attention_plan`, runs the kernel's row-max switch instead: the same `m`, no
   exp2, no P x V; `anchor_maxima`);
2. identification: `stripe_index` (Triton counting pass that also keeps its
   decisions as bits, one host sync for the width, fill pass from the bits) pools queries and anchors per query block and keeps the
   group's keys within `theta` of the pooled anchor;
3. stripes: `block_column_attention` over the stripes alone (a plan with no
   blocks, one column list per group: `column_group = step`), resuming from the
   anchor state, so the anchor region is never computed twice. Key blocks that a
   group's stripes hold entirely are read as blocks
   (`BlockColumnPlan.with_full_blocks`): at high stripe density a column gather
   runs far below the dense rate.

Plan memory: `4 * B * Hq * (Qb + G * W)` bytes for the stripes (`G = ceil(Qb /
step)` groups, `W` the longest stripe list of any group and head) plus the anchor
block lists, stored once for all heads (expanded views). `W` is data-dependent and
can reach the last group's whole search region (about N), so `anchor_attention`
plans and runs query heads in groups whose stripe plan cannot exceed `PLAN_BYTES`
whatever the data (at 128K tokens, blocks of 128 and step 16, 32 MB per head at
most: 8 heads per group at B = 1); `anchor_attention_plan` returns the whole plan.

The identification computes pooled scores in fp32 from a two-part 16-bit pooled
query, and the anchors come from the kernel's fp32 state: keys whose float64
difference lies within `conformance.ties.anchor_margin` of `theta` may be decided
differently from the reference.
"""

from __future__ import annotations

import os

import torch

from ..reference._checks import (
    HALF_DTYPES,
    PerHead,
    check_qk,
    check_qkv,
    per_head,
    resolve_scale,
)
from ..reference.anchor_attention import (
    STEP,
    THETA,
    check_anchor_params,
    check_theta,
    group_step,
)
from ..reference.attention import AttentionState
from ..reference.dense_fallback import (
    break_even_heads,
    early_dense_heads,
    early_exit_enabled,
    heads_view,
    knob_heads,
    probe_gap_density,
)
from ..reference.plan import BlockColumnPlan, cdiv
from .attention import dense_heads_into
from .capture import static_widths_active
from .dense_fallback import active_rates, plan_with_fallback
from .kernels import (
    block_column_attention,
    block_column_row_max,
    check_forward_only,
    check_kernel_block_sizes,
    check_kernel_device,
)
from .kernels._common import head_group
from .kernels.anchor_stripes import search_width_bound, stripe_index

# Anchors from the kernel's row-max switch (no exp2, no P x V); `SPARSEPREFILL_ANCHOR_ROW_MAX=0`
# runs the full attention pass with `k` as values instead (the earlier design, kept for
# timing: docs/anchor_attention.md, designs table).
ANCHOR_ROW_MAX = os.environ.get("SPARSEPREFILL_ANCHOR_ROW_MAX", "1") == "1"

# Largest stripe plan `anchor_attention` builds at once (the 128K budget).
PLAN_BYTES = 256 << 20


def anchor_block_lists(
    seqlen: int, *, step: int, block_m: int, block_n: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 1's key blocks as lists: (count int32 `[Qb]`, index int32 `[Qb, W]`).

    Block 0, then the window `[max(1, w_g), diag_i]` (see `reference.anchor_blocks`).
    Built on `device` directly, the width from the same arithmetic on the host: no
    host synchronisation and no host-to-device copy (capture-safe).
    """

    def window_of(dev: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        i = torch.arange(cdiv(seqlen, block_m), device=dev)
        start = torch.clamp((i // step) * step * block_m // block_n, min=1)
        end = (torch.clamp((i + 1) * block_m, max=seqlen) - 1) // block_n
        return start, torch.clamp(end - start + 1, min=0)

    width = 1 + int(window_of("cpu")[1].max())
    start, window = window_of(device)
    t = torch.arange(width - 1, device=device)
    lists = torch.where(t[None, :] < window[:, None], start[:, None] + t[None, :], 0)
    index = torch.nn.functional.pad(lists, (1, 0)).to(torch.int32)
    return (1 + window).to(torch.int32), index


def _plans(
    b: int, h: int, seqlen: int, *, step: int, block_m: int, block_n: int,
    counts: torch.Tensor | None, index: torch.Tensor | None, device: torch.device,
    with_blocks: bool,
) -> BlockColumnPlan:
    """A plan of the anchor blocks (if `with_blocks`) and the stripes (if given), valid
    by construction: stripes lie in the search regions, outside every anchor block."""
    qb = cdiv(seqlen, block_m)
    groups = cdiv(qb, step)
    if with_blocks:
        bcount, bindex = anchor_block_lists(seqlen, step=step, block_m=block_m, block_n=block_n,
                                            device=device)
    else:
        bcount = torch.zeros(qb, dtype=torch.int32, device=device)
        bindex = torch.zeros(qb, 0, dtype=torch.int32, device=device)
    if counts is None or index is None:
        ccount = torch.zeros(b, h, qb, dtype=torch.int32, device=device)
        cindex = torch.zeros(b, h, groups, 0, dtype=torch.int32, device=device)
    else:
        owner = torch.arange(qb, device=device) // step
        ccount = counts[:, :, owner].contiguous()
        cindex = index
    return BlockColumnPlan(
        seqlen=seqlen, block_m=block_m, block_n=block_n,
        block_count=bcount.expand(b, h, qb), block_index=bindex.expand(b, h, *bindex.shape),
        column_count=ccount, column_index=cindex, columns_disjoint=True, column_group=step,
    ).mark_valid()


def _check(
    q: torch.Tensor, *, theta: object, step: int, block_m: int, block_n: int
) -> float | torch.Tensor:
    """The parameters' checks; theta as a float, or float64 `[Hq]` on q's device if per head
    (a scalar stays a float: the kernel gets it by a device fill, no copy)."""
    checked = check_anchor_params(theta=theta, step=step, block_m=block_m, block_n=block_n)
    check_kernel_block_sizes(block_m, block_n)
    check_kernel_device(q)
    if isinstance(checked, torch.Tensor):
        return per_head(checked, "theta", q.shape[1], check_theta, device=q.device)
    return checked


def anchor_maxima(
    q: torch.Tensor, k: torch.Tensor, *, step: int, block_m: int, block_n: int, scale: float
) -> torch.Tensor:
    """Equation 1 on the GPU: `x_a`, fp32 `[B, Hq, N]`, the row max of the scaled logits over
    the anchor blocks (see `reference.anchor_attention.anchor_scores`): the block kernel's
    row-max switch (`block_column_row_max`: no exp2, no P x V), bit for bit the `m` of the
    anchor pass's state; with `ANCHOR_ROW_MAX` off, that full pass with `k` as values.
    Arguments are checked by the caller."""
    b, h, n = q.shape[0], q.shape[1], q.shape[2]
    anchor = _plans(b, h, n, step=step, block_m=block_m, block_n=block_n, counts=None, index=None,
                    device=q.device, with_blocks=True)
    if ANCHOR_ROW_MAX:
        return block_column_row_max(q, k, anchor, scale=scale, validate_plan=False)
    state = AttentionState.like(q)
    block_column_attention(q, k, k, anchor, scale=scale, state=state, validate_plan=False)
    return state.m


def anchor_attention_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    theta: PerHead = THETA,
    step: int = STEP,
    block_m: int = 128,
    block_n: int = 128,
    scale: float | None = None,
) -> BlockColumnPlan:
    """AnchorAttention plan (see `reference.anchor_attention_plan`).

    Runs the anchor pass (row max only: `anchor_maxima`) and the stripe
    identification; block sizes must be multiples of 16.

    Args:
        q: `[B, Hq, N, D]` fp16/bf16; k: `[B, Hkv, N, D]`.
        theta: the difference threshold of Equation 2, in natural-log units of the
            scaled logits (>= 0; the paper uses 12); a scalar or one per query head.
        step: query blocks per group sharing one stripe list (>= 1; the paper: 16).
        block_m, block_n: query rows and keys per block (the paper: 128, 128).
        scale: softmax scale, `1/sqrt(D)` if None (Equations 1 and 2 use it).

    Returns:
        The plan: anchor blocks per query block (shared by all heads) and each group's
        stripes as grouped columns (`column_group = step`, `columns_disjoint`).

    Raises:
        TypeError, ValueError: bad inputs or parameters, before any kernel launch.
    """
    shape = check_qk(q, k, dtypes=HALF_DTYPES)
    theta = _check(q, theta=theta, step=step, block_m=block_m, block_n=block_n)
    sm_scale = resolve_scale(scale, shape.head_dim)
    b, h, n = shape.batch, shape.q_heads, shape.seqlen
    step = group_step(step, n, block_m)

    def estimate(heads: list[int] | None) -> BlockColumnPlan:
        qs, ks = heads_view(q, k, heads)
        x_a = anchor_maxima(qs, ks, step=step, block_m=block_m, block_n=block_n, scale=sm_scale)
        counts, index = stripe_index(qs, ks, x_a, theta=knob_heads(theta, heads), step=step, block_m=block_m,
                                     block_n=block_n, scale=sm_scale)
        return _plans(b, int(qs.shape[1]), n, step=step, block_m=block_m, block_n=block_n, counts=counts,
                      index=index, device=q.device, with_blocks=True)

    return plan_with_fallback(q, k, estimate, block_m=block_m, block_n=block_n,
                              probe=lambda: probe_gap_density(q, k, theta=_theta_vector(theta, h, q.device),
                                                              scale=sm_scale))


def _theta_vector(theta: float | torch.Tensor, heads: int, device: torch.device) -> torch.Tensor:
    """theta as float64 `[Hq]` (a scalar repeated)."""
    if isinstance(theta, torch.Tensor):
        return theta.to(device=device, dtype=torch.float64)
    return torch.full((heads,), float(theta), dtype=torch.float64, device=device)


def stripe_plan_nbytes(batch: int, heads: int, seqlen: int, *, step: int, block_m: int, width: int) -> int:
    """Bytes of the stripe part of a plan: per-query-block counts and per-group lists."""
    qb = cdiv(seqlen, block_m)
    return 4 * batch * heads * (qb + cdiv(qb, step) * width)


def anchor_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    theta: PerHead = THETA,
    step: int = STEP,
    block_m: int = 128,
    block_n: int = 128,
    scale: float | None = None,
) -> torch.Tensor:
    """AnchorAttention (see `reference.anchor_attention`): anchor pass, Triton stripe
    identification from its state, stripe pass resuming from the state.

    Query heads are processed in groups whose stripe plan fits `PLAN_BYTES` at any
    stripe count (see the module doc); each group has its own state.

    Host synchronisations per head group: the longest stripe list, and the promotion of
    whole stripe blocks to blocks (`with_full_blocks`, three reads). Inside
    `fast.capture.static_widths()` (`torch.ops.sparseprefill.anchor_attention_static`)
    and during CUDA-graph capture the width is the search-region bound and the stripes
    stay columns (no promotion; the same attention at the column-gather rate): no
    sync, capture-safe (docs/serving.md).

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs or parameters, before any kernel launch.
    """
    shape = check_qkv(q, k, v, dtypes=HALF_DTYPES)
    check_forward_only(q, k, v)
    theta = _check(q, theta=theta, step=step, block_m=block_m, block_n=block_n)
    sm_scale = resolve_scale(scale, shape.head_dim)
    b, n, g = shape.batch, shape.seqlen, shape.group
    step = group_step(step, n, block_m)
    bound = search_width_bound(n, step=step, block_m=block_m, block_n=block_n)
    head_bytes = stripe_plan_nbytes(b, 1, n, step=step, block_m=block_m, width=max(1, bound))
    heads = head_group(shape.q_heads, g, PLAN_BYTES // head_bytes)

    rates = active_rates(q)
    exited: tuple[int, ...] = ()
    layer = heads == shape.q_heads  # one head group: the one-call SDPA option is open
    if rates is not None and early_exit_enabled():
        # Early exit: heads whose last rows keep most keys within theta skip the stripe pass.
        exited = early_dense_heads(probe_gap_density(q, k, theta=_theta_vector(theta, shape.q_heads, q.device),
                                                     scale=sm_scale),
                                   seqlen=n, block_m=block_m, head_dim=shape.head_dim, dtype=q.dtype, rates=rates)
        if len(exited) == shape.q_heads:
            return dense_heads_into(q, k, v, exited, None, scale=sm_scale)

    def run(h0: int, h1: int) -> torch.Tensor:
        kv0, kv1 = h0 // g, (h1 - 1) // g + 1
        qs, ks, vs = q[:, h0:h1], k[:, kv0:kv1], v[:, kv0:kv1]
        anchor = _plans(b, h1 - h0, n, step=step, block_m=block_m, block_n=block_n, counts=None,
                        index=None, device=q.device, with_blocks=True)
        state = AttentionState.like(qs)
        block_column_attention(qs, ks, vs, anchor, scale=sm_scale, state=state,
                               validate_plan=False)  # Alg. 1
        group_theta = theta[h0:h1] if isinstance(theta, torch.Tensor) else theta
        counts, index = stripe_index(qs, ks, state.m, theta=group_theta, step=step,  # Alg. 2
                                     block_m=block_m, block_n=block_n, scale=sm_scale)
        stripes = _plans(b, h1 - h0, n, step=step, block_m=block_m, block_n=block_n, counts=counts,
                         index=index, device=q.device, with_blocks=False)
        dense: tuple[int, ...] = ()
        if rates is not None:
            # The break-even rule on the group's whole plan (anchor blocks and stripes), as
            # `anchor_attention_plan` decides it; the early-exited heads count as marked.
            whole = _plans(b, h1 - h0, n, step=step, block_m=block_m, block_n=block_n, counts=counts,
                           index=index, device=q.device, with_blocks=True)
            whole = whole.with_dense_heads([h - h0 for h in exited if h0 <= h < h1])
            dense = break_even_heads(whole, head_dim=shape.head_dim, dtype=q.dtype, rates=rates, layer=layer)
            if len(dense) == h1 - h0:
                # Every head dense: no stripe pass (one SDPA call where the group is the layer).
                return dense_heads_into(qs, ks, vs, dense, None, scale=sm_scale, layer=layer)
            if dense:
                stripes = stripes.without_heads(dense)
        # Key blocks a group's stripes hold whole run as blocks (dense rate), not as
        # column gathers: the H200 bench's 128K stripe pass took 1159 ms as columns.
        # The promotion reads list widths back (host syncs): static widths (and graph
        # capture) keep the stripes as columns, the same attention, slower.
        if not static_widths_active(q):
            stripes = stripes.with_full_blocks()
        out, _ = block_column_attention(qs, ks, vs, stripes, scale=sm_scale, state=state,
                                        validate_plan=False)  # Alg. 3
        # Some heads dense: our kernel from scratch on those heads alone (their anchor pass
        # is dropped), never SDPA on part of the layer.
        return dense_heads_into(qs, ks, vs, dense, out, scale=sm_scale, layer=False)

    if heads == shape.q_heads:
        return run(0, shape.q_heads)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for h0 in range(0, shape.q_heads, heads):
        h1 = min(h0 + heads, shape.q_heads)
        out[:, h0:h1] = run(h0, h1)
    return out
