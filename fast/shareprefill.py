"""SharePrefill on the GPU (see `reference.shareprefill` for the algorithm and its choices).

Per layer:

* decision (Alg. 3): `a^` from pooled queries and keys. The key blocks wholly
  before the last query block see every row of it, and a mean of bilinear terms over
  all pairs is the bilinear term of the means, so their pooled logit is exactly
  `scale * mean(q) . mean(k_j)` (O(N D) per KV head); the few blocks the last query
  block overlaps are computed pair by pair with the causal mask. Distances in
  float64; the per-head walk of Alg. 3/4 (`choose_patterns`) runs on the host on
  `[B, Hq]` numbers (one synchronisation).
* plan: vertical-slash heads from `flexprefill_vs` (Triton estimate and index),
  shared heads from their pivot's block mask.
* attention: one `block_column_attention` pass for the vertical-slash and shared
  heads, and one per dense (batch row, head) on the dense plan with
  `block_mean_out` (so block means are accumulated, and their `[Qb, Kb]` buffer
  allocated, only for the dense heads, typically a few per prefill).
* pivots (Alg. 2): softmax, sort and cumulative sum of the dense head's block means
  in float64 (`construct_pivotal_pattern`, the reference's torch code).

Float rounding: `a^` and the block means come from fp32 sums, so a distance within
`DISTANCE_MARGIN` of its threshold, or a block or line whose share nearly ties, may
be decided differently from the reference; `conformance.ties` accepts exactly those
differences (`check_decisions_modulo_margin`, `check_cover_modulo_ties`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..reference._checks import HALF_DTYPES, PerHead, check_qk, check_qkv, resolve_scale
from ..reference.flexprefill_vs import GAMMA
from ..reference.plan import BlockColumnPlan, cdiv, mask_to_list
from ..reference.shareprefill import (
    DELTA,
    NOISE,
    TAU,
    ClusterLayout,
    LayerDecision,
    Pivot,
    SharePattern,
    SharePrefillState,
    check_state,
    choose_patterns,
    construct_pivotal_pattern,
    js_distance,
)
from .flexprefill_vs import flexprefill_vs_lines, padded_lines_many
from .kernels import block_column_attention, check_device_memory, check_forward_only, check_kernel_block_sizes
from .kernels.own_columns import resolve_covered_columns
from .kernels.vertical_slash_index import vertical_slash_index


def last_block_attention(
    q: torch.Tensor, k: torch.Tensor, *, block_m: int, block_n: int, scale: float
) -> torch.Tensor:
    """Alg. 3 lines 2-3 (see `reference.shareprefill.last_block_attention`), pooled.

    Returns:
        float64 `[B, Hq, Kb]`.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    r0 = (cdiv(n, block_m) - 1) * block_m
    kb = cdiv(n, block_n)
    # Key blocks [0, full) end at or before r0: every row of the last query block sees all of them.
    full = r0 // block_n
    q_last = q[:, :, r0:].reshape(b, hkv, g, n - r0, d)
    logits = torch.empty(b, hkv, g, kb, dtype=torch.float64, device=q.device)
    if full:
        q_mean = q_last.to(torch.float32).mean(dim=3).to(torch.float64)
        k_mean = k[:, :, : full * block_n].to(torch.float32).reshape(b, hkv, full, block_n, d).mean(dim=3)
        logits[..., :full] = torch.einsum("bhgd,bhjd->bhgj", q_mean, k_mean.to(torch.float64)) * scale
    start = full * block_n
    tail = torch.matmul(q_last.to(torch.float64), k[:, :, start:].to(torch.float64).unsqueeze(2)
                        .transpose(-1, -2)) * scale
    causal = torch.arange(start, n, device=q.device)[None, :] <= torch.arange(r0, n, device=q.device)[:, None]
    key_block = torch.arange(start, n, device=q.device) // block_n - full
    sums = torch.zeros(b, hkv, g, kb - full, dtype=torch.float64, device=q.device)
    sums.index_add_(-1, key_block, torch.where(causal, tail, 0.0).sum(dim=-2))
    pairs = torch.zeros(kb - full, dtype=torch.float64, device=q.device)
    pairs.index_add_(0, key_block, causal.sum(dim=0).to(torch.float64))
    logits[..., full:] = sums / pairs
    return torch.softmax(logits, dim=-1).reshape(b, hq, kb)


@dataclass(frozen=True)
class HostLayerDecision(LayerDecision):
    """A `LayerDecision` that also keeps the host copy of `pattern` the host walk
    (`choose_patterns`) produced, so the plan's dispatch (which heads run which
    pattern) reads it without a device round trip.

    Attributes:
        pattern_host: int8 `[B, Hq]` on the CPU, equal to `pattern`.
    """

    pattern_host: torch.Tensor | None = field(default=None, compare=False, repr=False)


def host_pattern(decision: LayerDecision) -> torch.Tensor:
    """`decision.pattern` on the CPU (a synchronisation unless the decision kept it)."""
    kept = decision.pattern_host if isinstance(decision, HostLayerDecision) else None
    return decision.pattern.cpu() if kept is None else kept


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`: through pinned memory without waiting on CUDA (the
    copy is queued on the stream), a plain copy elsewhere."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def determine_sparse_pattern(
    state: SharePrefillState, a_hat: torch.Tensor, *, layer: int
) -> LayerDecision:
    """Alg. 3 for every head of one layer (see `reference.shareprefill.determine_sparse_pattern`).

    Distances for all heads at once on the device; the walk over heads on the host
    (one device-to-host transfer of both distances); the patterns and clusters go back
    to the device in one queued copy. Without any pivot (a layer's first prefill, or
    no cluster built one yet) `d_sim` is NaN everywhere, as in the reference, with no
    kernel launched for it.
    """
    b, hq, kb = a_hat.shape
    uniform = torch.full((kb,), 1.0 / kb, dtype=torch.float64, device=a_hat.device)
    d_sparse = js_distance(a_hat, uniform)
    clusters = [state.cluster(layer, h) for h in range(hq)]
    found = [(row, h, pivot) for row in range(b) for h, c in enumerate(clusters)
             if (pivot := None if c == NOISE else state.pivot(c, row)) is not None]
    if found:
        pivots = torch.full((b, hq, kb), math.nan, dtype=torch.float64, device=a_hat.device)
        for row, h, pivot in found:
            pivots[row, h] = pivot.a_tilde
        # NaN pivot rows give NaN distances: "no pivot", as in the reference.
        d_sim = js_distance(a_hat, pivots)
        has = ~torch.isnan(pivots[..., 0])
        d_sim = torch.where(has, d_sim, math.nan)
    else:
        d_sim = torch.full((b, hq), math.nan, dtype=torch.float64, device=a_hat.device)
    pattern = choose_patterns(state, d_sparse, d_sim, layer=layer)
    packed = to_device(torch.cat((pattern.reshape(-1).to(torch.int64),
                                  torch.tensor(clusters, dtype=torch.int64))), a_hat.device)
    return HostLayerDecision(layer=layer, pattern=packed[: b * hq].to(torch.int8).view(b, hq),
                             d_sparse=d_sparse, d_sim=d_sim, cluster=packed[b * hq:], pattern_host=pattern)


def decide_layer(
    q: torch.Tensor, k: torch.Tensor, state: SharePrefillState, *, layer: int, scale: float
) -> LayerDecision:
    """Alg. 3 for one layer: bind the layer to the state, estimate `a^`, decide every head."""
    state.bind(q, layer)
    a_hat = last_block_attention(q, k, block_m=state.block_m, block_n=state.block_n, scale=scale)
    return determine_sparse_pattern(state, a_hat, layer=layer)


def fallback_lines(
    q: torch.Tensor, k: torch.Tensor, state: SharePrefillState, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 5, the vertical-slash fallback, for every head: (verticals, slashes) bool
    `[B, Hq, N]` (see `reference.shareprefill.fallback_lines`); `layer_plan` keeps them
    for the vertical-slash heads."""
    return flexprefill_vs_lines(
        q, k, gamma=state.gamma, last_q=state.block_m, init_columns=state.init_columns,
        local_diagonals=state.local_diagonals, line_block=1, scale=scale)


def layer_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    state: SharePrefillState,
    decision: LayerDecision,
    *,
    scale: float,
    with_dense: bool = True,
) -> BlockColumnPlan:
    """Alg. 1 lines 3-7: the plan of every head (see `reference.shareprefill.layer_masks`).

    Args:
        with_dense: False leaves the dense heads' lists empty (they run separately).

    Returns:
        The plan: vertical-slash heads' lists from the Alg. 4 index kernel, shared and
        dense heads' block lists from their masks, per-query-block disjoint columns where
        they fit `DISJOINT_COLUMN_BYTES` (else the shared column list per head).
    """
    b, hq, n, _ = q.shape
    bm, bn = state.block_m, state.block_n
    pattern = decision.pattern.to(q.device)
    # Which heads run which pattern: decided on the host (`host_pattern`), read there.
    on_host = host_pattern(decision)
    is_vs = pattern == SharePattern.VERTICAL_SLASH
    if bool((on_host == SharePattern.VERTICAL_SLASH).any()):
        verticals, slashes = fallback_lines(q, k, state, scale=scale)
        verticals &= is_vs.unsqueeze(-1)
        slashes &= is_vs.unsqueeze(-1)
    else:
        verticals = slashes = torch.zeros(b, hq, n, dtype=torch.bool, device=q.device)
    plan = vertical_slash_index(*padded_lines_many(verticals, slashes), seqlen=n, block_m=bm, block_n=bn)
    others = ((on_host != SharePattern.VERTICAL_SLASH) if with_dense else on_host == SharePattern.SHARED
              ).nonzero().tolist()
    if others:
        qb, kb = cdiv(n, bm), cdiv(n, bn)
        # Quadratic in tokens: a [Qb, Kb] mask per dense or shared head, its block lists
        # (4 bytes an entry at most) and the layer's merged lists.
        check_device_memory(f"SharePrefill's block masks and lists of {len(others)} dense or shared heads "
                            f"([Qb, Kb] = [{qb}, {kb}])",
                            len(others) * qb * kb * 5 + b * hq * qb * kb * 4, q.device,
                            hint="Larger `block_m` / `block_n` or fewer heads per call fit.")
        masks = torch.ones(len(others), qb, kb, dtype=torch.bool, device=q.device)
        for i, (row, h) in enumerate(others):
            if int(on_host[row, h]) == SharePattern.SHARED:
                pivot = state.pivot(state.cluster(decision.layer, h), row)
                assert pivot is not None, "a shared head's cluster has a pivot"
                masks[i] = pivot.mask
        last_row = ((torch.arange(qb, device=q.device) + 1) * bm - 1).clamp(max=n - 1)
        masks &= (torch.arange(kb, device=q.device) * bn <= last_row[:, None])
        count, index = mask_to_list(masks)
        width = max(int(plan.block_index.shape[3]), int(index.shape[2]))
        block_index = torch.zeros(b, hq, qb, width, dtype=torch.int32, device=q.device)
        block_index[..., : plan.block_index.shape[3]] = plan.block_index
        block_count = plan.block_count.clone()
        rows, heads = to_device(torch.tensor(others, dtype=torch.int64).T.contiguous(), q.device)
        block_count[rows, heads] = count
        block_index[rows, heads, :, : index.shape[2]] = index
        plan = BlockColumnPlan(seqlen=n, block_m=bm, block_n=bn, block_count=block_count,
                               block_index=block_index, column_count=plan.column_count,
                               column_index=plan.column_index)
    # Per-query-block disjoint columns where they fit (`DISJOINT_COLUMN_BYTES`); single-line
    # verticals too many for that (quadratic in tokens: 361 GiB at 1M on the scale
    # workload) stay one shared list per head, the kernel testing covered columns itself.
    return resolve_covered_columns(plan.mark_valid())


def shareprefill_layer_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    state: SharePrefillState,
    *,
    layer: int,
    scale: float | None = None,
) -> tuple[BlockColumnPlan, LayerDecision]:
    """Every head's pattern and the layer's plan (see `reference.shareprefill_layer_plan`).

    Raises:
        TypeError, ValueError: bad inputs, or a layer that does not fit the state.
    """
    shape = check_qk(q, k, dtypes=HALF_DTYPES)
    state = check_state(state)
    check_kernel_block_sizes(state.block_m, state.block_n)
    sm_scale = resolve_scale(scale, shape.head_dim)
    decision = decide_layer(q, k, state, layer=layer, scale=sm_scale)
    return layer_plan(q, k, state, decision, scale=sm_scale), decision


def build_pivots(
    block_means: torch.Tensor, state: SharePrefillState, decision: LayerDecision,
    pairs: Sequence[tuple[int, int]],
) -> dict[tuple[int, int], Pivot]:
    """Alg. 2 for the dense (batch row, head) `pairs`, whose block means are `block_means[i]`."""
    assert state.shape is not None
    return {(state.cluster(decision.layer, h), row): construct_pivotal_pattern(
        block_means[i], gamma=state.head_value("gamma", h), seqlen=state.shape[2], block_m=state.block_m,
        block_n=state.block_n, layer=decision.layer, head=h) for i, (row, h) in enumerate(pairs)}


def dense_pivot_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: SharePrefillState,
    pairs: Sequence[tuple[int, int]], out: torch.Tensor, *, scale: float | None,
) -> torch.Tensor:
    """Dense attention of each (batch row, head) in `pairs`, written into `out`, with block means.

    Returns:
        float32 `[len(pairs), Qb, Kb]`, the pairs' block means.
    """
    n = q.shape[2]
    g = q.shape[1] // k.shape[1]
    bm, bn = state.block_m, state.block_n
    means = torch.empty(len(pairs), cdiv(n, bm), cdiv(n, bn), dtype=torch.float32, device=q.device)
    for i, (row, h) in enumerate(pairs):
        qi = q[row:row + 1, h:h + 1]
        ki, vi = k[row:row + 1, h // g:h // g + 1], v[row:row + 1, h // g:h // g + 1]
        plan = dense_layer_plan(n, bm, bn, q.device)
        part, _ = block_column_attention(qi, ki, vi, plan, scale=scale, validate_plan=False,
                                         block_mean_out=means[i:i + 1].unsqueeze(0))
        out[row, h] = part[0, 0]
    return means


def dense_layer_plan(seqlen: int, block_m: int, block_n: int, device: torch.device) -> BlockColumnPlan:
    """The causal plan of one head (stride-0 lists: O(Kb) memory)."""
    qb, kb = cdiv(seqlen, block_m), cdiv(seqlen, block_n)
    last_row = ((torch.arange(qb, device=device) + 1) * block_m - 1).clamp(max=seqlen - 1)
    count = (last_row // block_n + 1).to(torch.int32).view(1, 1, qb)
    index = torch.arange(kb, dtype=torch.int32, device=device).view(1, 1, 1, kb).expand(1, 1, qb, kb)
    none = torch.zeros(1, 1, qb, dtype=torch.int32, device=device)
    return BlockColumnPlan(seqlen=seqlen, block_m=block_m, block_n=block_n, block_count=count,
                           block_index=index, column_count=none,
                           column_index=torch.zeros(1, 1, qb, 0, dtype=torch.int32, device=device)
                           ).mark_valid()


def shareprefill_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: SharePrefillState,
    *,
    layer: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Alg. 1 for one layer (see `reference.shareprefill_layer`).

    Raises:
        TypeError, ValueError: bad inputs, or a layer that does not fit the state.
    """
    shape = check_qkv(q, k, v, dtypes=HALF_DTYPES)
    check_forward_only(q, k, v)
    state = check_state(state)
    check_kernel_block_sizes(state.block_m, state.block_n)
    sm_scale = resolve_scale(scale, shape.head_dim)
    decision = decide_layer(q, k, state, layer=layer, scale=sm_scale)
    plan = layer_plan(q, k, state, decision, scale=sm_scale, with_dense=False)
    out, _ = block_column_attention(q, k, v, plan, scale=scale, validate_plan=False)
    pairs = [(r, h) for r, h in (host_pattern(decision) == SharePattern.DENSE).nonzero().tolist()]
    pivots: dict[tuple[int, int], Pivot] = {}
    if pairs:
        means = dense_pivot_attention(q, k, v, state, pairs, out, scale=scale)
        pivots = build_pivots(means, state, decision, pairs)
    state.record(decision, pivots)
    return out


def shareprefill_stack(
    qs: Sequence[torch.Tensor],
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    state: SharePrefillState,
    *,
    layers: Sequence[int] | None = None,
    scale: float | None = None,
) -> list[torch.Tensor]:
    """Run several layers of one prefill in order (see `reference.shareprefill_stack`).

    Raises:
        TypeError, ValueError: mismatched lists, layers out of order, bad inputs.
    """
    if not (len(qs) == len(ks) == len(vs)):
        raise ValueError(f"qs, ks, vs must have one entry per layer, got {len(qs)}, {len(ks)}, {len(vs)}")
    order = list(range(len(qs))) if layers is None else list(layers)
    if len(order) != len(qs):
        raise ValueError(f"layers must name {len(qs)} layers, got {len(order)}")
    if any(b <= a for a, b in zip(order, order[1:])):
        raise ValueError(f"layers must be strictly increasing (model order), got {order}")
    return [shareprefill_layer(q, k, v, state, layer=l, scale=scale)
            for q, k, v, l in zip(qs, ks, vs, order)]


def shareprefill_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    layout: ClusterLayout | str | Path | None = None,
    layer: int = 0,
    tau: PerHead = TAU,
    delta: PerHead = DELTA,
    gamma: PerHead = GAMMA,
    block_m: int = 64,
    block_n: int = 64,
    init_columns: int = 1,
    local_diagonals: int = 1,
    scale: float | None = None,
) -> BlockColumnPlan:
    """SharePrefill's plan of one layer as a whole prefill (see `reference.shareprefill_plan`).

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    check_qk(q, k, dtypes=HALF_DTYPES)
    state = SharePrefillState(layout, tau=tau, delta=delta, gamma=gamma, block_m=block_m,
                              block_n=block_n, init_columns=init_columns, local_diagonals=local_diagonals)
    plan, _ = shareprefill_layer_plan(q, k, state, layer=layer, scale=scale)
    return plan


def shareprefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: ClusterLayout | str | Path | None = None,
    layer: int = 0,
    tau: PerHead = TAU,
    delta: PerHead = DELTA,
    gamma: PerHead = GAMMA,
    block_m: int = 64,
    block_n: int = 64,
    init_columns: int = 1,
    local_diagonals: int = 1,
    scale: float | None = None,
) -> torch.Tensor:
    """SharePrefill attention of one layer as a whole prefill (see `reference.shareprefill`).

    Host synchronisations: each head's pattern is decided on the host from the data
    (Alg. 3/4), and the dispatch reads it back; not capture-safe (docs/serving.md).

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    check_qkv(q, k, v, dtypes=HALF_DTYPES)
    check_forward_only(q, k, v)
    state = SharePrefillState(layout, tau=tau, delta=delta, gamma=gamma, block_m=block_m,
                              block_n=block_n, init_columns=init_columns, local_diagonals=local_diagonals)
    return shareprefill_layer(q, k, v, state, layer=layer, scale=scale)
