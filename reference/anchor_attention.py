"""AnchorAttention (Zhang et al., 2025): anchor, difference-aware stripes, discrete KV.

Notation, 0-indexed throughout: `N` tokens; query block `i` holds the rows
`[i * block_m, min((i + 1) * block_m, N))`, key block `j` the keys
`[j * block_n, (j + 1) * block_n)`; group `g = i // step` holds the query blocks
`[g * step, (g + 1) * step)` and starts at row `R_g = g * step * block_m`.

* Anchor region (Alg. 1). Query block `i` attends to the initial key block `0`
  (lines 3-6) and to the window blocks `[max(1, w_g), diag_i]` (lines 7-16), with
  `w_g = floor(R_g / block_n)` (the key block holding the group's first row) and
  `diag_i = floor(last_row_i / block_n)` (the key block holding the block's last
  row), causally. Alg. 1 line 8 reads `j_start = max(2, floor((i-1)/step) * step *
  (b_q/b_kv))` in its 1-indexed numbering; taken literally that is one key block
  before the group's first row, the very block Alg. 2 line 7 (`j_end`) ends its
  search on, so Alg. 3 would count it twice. We start the window at the group's
  first row (`w_g`, 0-indexed), which is the 1-indexed block `w_g + 1`: the only
  reading under which the anchor and the stripes are disjoint, as Alg. 3 needs.
  `max(2, .)` is the 1-indexed "after the initial block": our `max(1, .)`.
* Anchor `x_a` (Equation 1): per query row, the maximum of the *scaled* logits
  `scale * q . k` over its anchor keys, in natural-log units: exactly the running
  max `m` Alg. 1 leaves in the online-softmax state (Alg. 2's "anchor score Acc"
  is read as this `M`, not as the accumulator `Acc`: `Acc` is a `[rows, D]` output
  sum, not a score, and Equation 1 defines `x_a` as the maximum).
* Stripes (Alg. 2, Equation 2, Section 3.4). Each query block pools its queries
  (`avgpool(Q)`, the mean of its rows) and its anchors (`avgpool(x_a)`). For every
  key `j` of the group's search region, the keys `[block_n, w_g * block_n)` (after
  the initial block, before the window: Alg. 2 lines 7-8), the score is
  `s_ij = scale * avgpool(Q)_i . k_j`, and query block `i` marks `j` when
  `avgpool(x_a)_i - s_ij <= theta` (Equation 2's `<=`; Alg. 2 line 11 prints `<`,
  the authors' code tests `qk + theta >= anchor`, i.e. `<=`). The group keeps the
  union of its query blocks' marks (Section 3.4), one sorted list shared by its
  `step` query blocks.
* Discrete-KV computation (Alg. 3): attention over the anchor blocks, then the
  online softmax resumed from that state over the group's stripe keys only. The
  stripes lie before the group's first row, so every row of the group keeps all of
  them, and outside the anchor blocks, so nothing is counted twice.

`theta` is in the units of Equation 2: natural-log units of the scaled logits (a
kept key's pooled probability is at least `exp(-theta)` times the anchor's).

The plan: the anchor blocks as key blocks, the stripes as key columns shared by
the `step` query blocks of a group (`column_group = step`), `columns_disjoint`.
"""

from __future__ import annotations

import math

import torch

from ._checks import (
    PerHead,
    check_block_size,
    check_knob,
    check_positive_int,
    check_qk,
    check_qkv,
    per_head,
    resolve_scale,
)
from .attention import AttentionState, _chunk_rows, _group_mask, sparse_attention
from .block_sparse import mean_pooling
from .dense_fallback import (
    active_rates,
    heads_view,
    knob_heads,
    plan_with_fallback,
    probe_gap_density,
)
from .plan import BlockColumnPlan, cdiv, mask_to_list

# The paper's defaults (Section 4.1): theta = 12, step = 16, blocks of 128.
THETA = 12.0
STEP = 16


# Largest finite theta: the fast stripe kernel compares in float32. Any theta this large
# already keeps every key whose logit is finite; +inf says so exactly.
MAX_THETA = 1e30


def check_theta(theta: object) -> float:
    """Return `theta` as float: a real number, not NaN, `>= 0`, finite up to `MAX_THETA`
    or `+inf` (which keeps every key)."""
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise TypeError(f"theta must be a float, got {type(theta).__name__}")
    if theta != theta or theta < 0:  # NaN (`math.isnan` would overflow on a huge int)
        raise ValueError(f"theta must be >= 0, got {theta}")
    if MAX_THETA < theta < math.inf:
        raise ValueError(f"theta must be at most {MAX_THETA:g} or +inf (keep every key), got {theta!r:.40}: "
                         "the fast kernels compare in float32")
    return float(theta)


def check_anchor_params(*, theta: object, step: object, block_m: object,
                        block_n: object) -> float | torch.Tensor:
    """Raise TypeError/ValueError naming the first bad parameter; return theta as float
    (a per-head theta as a float64 CPU tensor, each value checked by `check_theta`).

    `theta` must be a real number, not NaN, and `>= 0` (+inf keeps every key);
    `step`, `block_m`, `block_n` ints `>= 1`.
    """
    value = check_knob("theta", theta, check_theta)
    check_positive_int("step", step)
    check_block_size("block_m", block_m)
    check_block_size("block_n", block_n)
    return value


def group_step(step: int, seqlen: int, block_m: int) -> int:
    """`step` capped at the query blocks of the sequence: every step past them means one
    group of all query blocks, so 2**63 plans what `Qb` plans (docs/robustness.md)."""
    return min(step, cdiv(seqlen, block_m))


def window_start(group: int, *, step: int, block_m: int, block_n: int) -> int:
    """`w_g`: the key block holding group `group`'s first row (the window starts there)."""
    return group * step * block_m // block_n


def anchor_blocks(
    seqlen: int, *, step: int, block_m: int, block_n: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Alg. 1: bool `[Qb, Kb]`, the anchor key blocks of every query block.

    Key block 0 (lines 3-6) and the window `[max(1, w_g), diag_i]` (lines 8-10).
    """
    qb, kb = cdiv(seqlen, block_m), cdiv(seqlen, block_n)
    i = torch.arange(qb, device=device)
    j = torch.arange(kb, device=device)[None, :]
    group = i // step
    # Alg. 1 line 8: j_start, 0-indexed (see the module doc).
    start = torch.clamp(group * step * block_m // block_n, min=1)[:, None]
    # Alg. 1 line 9: j_end, the key block of the query block's last row.
    last_row = torch.clamp((i + 1) * block_m, max=seqlen) - 1
    end = (last_row // block_n)[:, None]
    initial = j == 0
    window = (j >= start) & (j <= end)
    return initial | window


def search_region(
    seqlen: int, *, step: int, block_m: int, block_n: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Alg. 2 lines 7-8: bool `[G, N]`, the keys each group's stripes are chosen from.

    Keys `[block_n, w_g * block_n)`: after the initial block, before the window.
    """
    groups = cdiv(cdiv(seqlen, block_m), step)
    g = torch.arange(groups, device=device)
    end = (g * step * block_m // block_n * block_n)[:, None]
    keys = torch.arange(seqlen, device=device)[None, :]
    return (keys >= block_n) & (keys < end)


def anchor_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    blocks: torch.Tensor,
    *,
    block_n: int,
    block_m: int,
    scale: float,
) -> torch.Tensor:
    """Equation 1: `x_a`, float64 `[B, Hq, N]`, the row max of the scaled logits over the anchor.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`.
        blocks: bool `[Qb, Kb]` from `anchor_blocks`.
        block_n, block_m: the block sizes `blocks` was built with.
        scale: softmax scale.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    # The anchor keys of every row, as a dense [N, N] mask shared by all heads.
    keys = blocks.repeat_interleave(block_n, dim=1)[:, :n].repeat_interleave(block_m, dim=0)[:n]
    keys = keys & torch.ones(n, n, dtype=torch.bool, device=q.device).tril_()
    qg = q.reshape(b, hkv, g, n, d).to(torch.float64)
    kg = k.to(torch.float64).unsqueeze(2)
    out = torch.empty(b, hkv, g, n, dtype=torch.float64, device=q.device)
    chunk = _chunk_rows(b, hq, n)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        scores = torch.matmul(qg[:, :, :, start:stop], kg[:, :, :, :stop].transpose(-1, -2)) * scale
        keep = _group_mask(keys[None, None, start:stop, :stop], hkv, g)
        out[:, :, :, start:stop] = scores.masked_fill(~keep, -math.inf).amax(dim=-1)
    return out.reshape(b, hq, n)


def pooled_anchor(x_a: torch.Tensor, block_m: int) -> torch.Tensor:
    """Alg. 2 line 2, `avgpool(x_a)`: float64 `[B, Hq, Qb]`, the mean anchor of each query block."""
    return mean_pooling(x_a.unsqueeze(-1), block_m).squeeze(-1)


def stripe_scores(q_mean: torch.Tensor, k: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Alg. 2 line 10: `avgpool(Q) K^T / sqrt(d)`, float64 `[B, Hq, Qb, N]`.

    Args:
        q_mean: `[B, Hq, Qb, D]` (Alg. 2 line 1, `avgpool(Q)`); k: `[B, Hkv, N, D]`.
    """
    b, hq, qb, d = q_mean.shape
    hkv = k.shape[1]
    g = hq // hkv
    scores = torch.matmul(q_mean.reshape(b, hkv, g, qb, d).to(torch.float64),
                          k.to(torch.float64).unsqueeze(2).transpose(-1, -2)) * scale
    return scores.reshape(b, hq, qb, -1)


def difference_aware_mask(anchor_mean: torch.Tensor, scores: torch.Tensor,
                          theta: float | torch.Tensor) -> torch.Tensor:
    """Alg. 2 line 11 / Equation 2: bool `[B, Hq, Qb, N]`, `avgpool(x_a) - s <= theta`
    (`theta` a float or float64 `[Hq]`, one per query head)."""
    if isinstance(theta, torch.Tensor):
        theta = theta.to(scores.device)[:, None, None]
    return (anchor_mean.unsqueeze(-1) - scores) <= theta


def group_stripes(marks: torch.Tensor, region: torch.Tensor, *, step: int) -> torch.Tensor:
    """Section 3.4: bool `[B, Hq, G, N]`, the union of the marks of a group's query blocks,
    restricted to the group's search region `region: [G, N]`."""
    b, h, _, n = marks.shape
    groups = region.shape[0]
    union = torch.zeros(b, h, groups, n, dtype=torch.bool, device=marks.device)
    for g in range(groups):
        union[:, :, g] = marks[:, :, g * step:(g + 1) * step].any(dim=2)
    return union & region


def stripe_sets(
    q: torch.Tensor,
    k: torch.Tensor,
    x_a: torch.Tensor,
    *,
    theta: float | torch.Tensor,
    step: int,
    block_m: int,
    block_n: int,
    scale: float,
) -> torch.Tensor:
    """Alg. 2: bool `[B, Hq, G, N]`, the stripe keys of every group, from the anchors `x_a`
    (`theta`: a float, or float64 `[Hq]` per query head)."""
    n = q.shape[2]
    q_mean = mean_pooling(q, block_m)  # Alg. 2 line 1
    anchor_mean = pooled_anchor(x_a, block_m)  # Alg. 2 line 2
    scores = stripe_scores(q_mean, k, scale=scale)  # Alg. 2 line 10
    marks = difference_aware_mask(anchor_mean, scores, theta)  # Alg. 2 line 11
    region = search_region(n, step=step, block_m=block_m, block_n=block_n, device=q.device)
    return group_stripes(marks, region, step=step)


def anchor_plan_from_stripes(
    stripes: torch.Tensor, *, seqlen: int, step: int, block_m: int, block_n: int,
    with_blocks: bool = True,
) -> BlockColumnPlan:
    """The plan: anchor blocks (if `with_blocks`) plus the groups' stripes as grouped columns.

    Args:
        stripes: bool `[B, Hq, G, N]` from `stripe_sets`.

    Returns:
        A validated plan with `column_group = step` and `columns_disjoint = True`;
        every query block reads its group's whole list (all of it lies before the
        group's first row).
    """
    b, h, _, n = stripes.shape
    qb = cdiv(seqlen, block_m)
    blocks = anchor_blocks(seqlen, step=step, block_m=block_m, block_n=block_n, device=stripes.device)
    if not with_blocks:
        blocks = torch.zeros_like(blocks)
    block_count, block_index = mask_to_list(blocks)
    group_count, group_index = mask_to_list(stripes)
    owner = torch.arange(qb, device=stripes.device) // step
    return BlockColumnPlan(
        seqlen=seqlen, block_m=block_m, block_n=block_n,
        block_count=block_count.expand(b, h, qb),
        block_index=block_index.expand(b, h, *block_index.shape),
        column_count=group_count[:, :, owner].contiguous(),
        column_index=group_index,
        columns_disjoint=True,
        column_group=step,
    ).validate()


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
    """AnchorAttention plan: anchor blocks (Alg. 1) plus difference-aware stripes (Alg. 2).

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`. Each query head is planned from its
            own queries against its KV head's keys.
        theta: the difference threshold of Equation 2, in natural-log units of the
            scaled logits (>= 0; the paper uses 12); a scalar, or one per query head (a
            list or `[Hq]` tensor: each head marks its stripes with its own).
        step: query blocks per group sharing one stripe list (>= 1; the paper: 16).
        block_m, block_n: query rows and keys per block (the paper: 128, 128).
        scale: softmax scale, `1/sqrt(D)` if None (Equations 1 and 2 use it).

    Returns:
        A `BlockColumnPlan`: the anchor key blocks of each query block, and the
        stripes of its group as key columns (`column_group = step`,
        `columns_disjoint = True`).

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k)
    check_anchor_params(theta=theta, step=step, block_m=block_m, block_n=block_n)
    theta = per_head(theta, "theta", shape.q_heads, check_theta, device=q.device)
    sm_scale = resolve_scale(scale, shape.head_dim)
    n = shape.seqlen
    step = group_step(step, n, block_m)
    blocks = anchor_blocks(n, step=step, block_m=block_m, block_n=block_n, device=q.device)

    def estimate(heads: list[int] | None) -> BlockColumnPlan:
        qs, ks = heads_view(q, k, heads)
        x_a = anchor_scores(qs, ks, blocks, block_n=block_n, block_m=block_m, scale=sm_scale)  # Eq. 1
        stripes = stripe_sets(qs, ks, x_a, theta=knob_heads(theta, heads), step=step, block_m=block_m,
                              block_n=block_n, scale=sm_scale)
        return anchor_plan_from_stripes(stripes, seqlen=n, step=step, block_m=block_m, block_n=block_n)

    return plan_with_fallback(q, k, estimate, rates=active_rates(q), block_m=block_m, block_n=block_n,
                              probe=lambda: probe_gap_density(q, k, theta=theta, scale=sm_scale))


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
    """AnchorAttention (Alg. 1-3): anchor pass, stripes from its state, resumed stripe pass.

    The anchor blocks are attended first from an empty `AttentionState`; its row
    maxima are the anchors `x_a` (Equation 1); the stripes are chosen from them
    (Alg. 2); the stripe keys are then attended resuming from that state (Alg. 3),
    never revisiting the anchor blocks. The output equals
    `sparse_attention(q, k, v, anchor_attention_plan(q, k, ...))`.

    Args:
        q, k, theta, step, block_m, block_n, scale: as `anchor_attention_plan`.
        v: `[B, Hkv, N, D]`.

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qkv(q, k, v)
    check_anchor_params(theta=theta, step=step, block_m=block_m, block_n=block_n)
    theta = per_head(theta, "theta", shape.q_heads, check_theta, device=q.device)
    sm_scale = resolve_scale(scale, shape.head_dim)
    n, b, h = shape.seqlen, shape.batch, shape.q_heads
    if active_rates(q) is not None:
        # The break-even rule decides on the whole plan: one pass over it (the same keys).
        return sparse_attention(q, k, v, anchor_attention_plan(q, k, theta=theta, step=step, block_m=block_m,
                                                               block_n=block_n, scale=scale), scale=sm_scale)
    step = group_step(step, n, block_m)
    groups = cdiv(cdiv(n, block_m), step)
    empty = torch.zeros(b, h, groups, n, dtype=torch.bool, device=q.device)
    anchor_only = anchor_plan_from_stripes(empty, seqlen=n, step=step, block_m=block_m, block_n=block_n)
    state = AttentionState.like(q, dtype=torch.float64)
    sparse_attention(q, k, v, anchor_only, scale=sm_scale, state=state)  # Alg. 1
    stripes = stripe_sets(q, k, state.m, theta=theta, step=step, block_m=block_m,  # Alg. 2
                          block_n=block_n, scale=sm_scale)
    stripe_only = anchor_plan_from_stripes(stripes, seqlen=n, step=step, block_m=block_m,
                                           block_n=block_n, with_blocks=False)
    return sparse_attention(q, k, v, stripe_only, scale=sm_scale, state=state)  # Alg. 3
