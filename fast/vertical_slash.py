"""MInference Vertical-Slash heads on the GPU (see `reference.vertical_slash` for the spec).

Estimate: `last_q_scores` (Triton, no `[L, N]` tensor); lines: one `torch.topk`
per kind with the forced lines set to +inf; index: `vertical_slash_index`
(Triton, Alg. 4: a counting pass, one host synchronisation to size the block
lists exactly, a fill pass).

`torch.topk` breaks exact ties in its own order, not by the lower index as the
reference does, and the fp32 estimate differs from the float64 one in the last
bits, so a line whose score ties (or nearly ties) the last kept one may differ
from the reference's choice.

Plan memory: `4 * B * Hq * (Qb * (W + 2) + k_v)` bytes, with `W` the most key
blocks any query block really lists (the verticals are stored once per head and
shared by every query block). With the 6096 nearest diagonals and 64 x 64 blocks
`W` is 97 at any N, so 1M tokens and 32 heads take about 0.21 GB. Scattered
slashes can make `W` reach `min(Kb, 2 k_s)`; `vertical_slash` then plans and runs
groups of query heads whose plans fit in `PLAN_BYTES`.
"""

from __future__ import annotations

import math

import torch

from ..reference._checks import HALF_DTYPES, PerHeadInt, check_qk, check_qkv
from ..reference.plan import BlockColumnPlan, cdiv, rank_nan_last
from ..reference.vertical_slash import (
    INIT_COLUMNS,
    LOCAL_DIAGONALS,
    check_vertical_slash_params,
    line_counts,
    pad_to_counts,
)
from .attention import run_plan
from .dense_fallback import apply_rule
from .kernels import check_forward_only, check_kernel_block_sizes
from .kernels._common import head_group
from .kernels.last_q_estimate import last_q_scores
from .kernels.own_columns import resolve_covered_columns
from .kernels.vertical_slash_index import (
    block_widths,
    count_blocks,
    fill_index,
    index_width_bound,
    vertical_slash_index,
)

# Largest plan `vertical_slash` builds at once.
PLAN_BYTES = 1 << 30


def vertical_slash_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    last_q: int = 64,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 2 lines 2-6 up to the scores: (vertical, slash) float32 `[B, Hq, N]`.

    Raises:
        TypeError, ValueError: bad inputs.
    """
    return last_q_scores(q, k, last_q=last_q, scale=scale)


def top_lines(scores: torch.Tensor, count: int | torch.Tensor, forced: int) -> torch.Tensor:
    """`argtopk` with the first `forced` indices kept: int32 `[B, H, count]`, ascending
    (per-head counts, int64 `[H]`: as wide as the largest, each head padded with N).

    NaN scores rank below every number (`rank_nan_last`); forced indices stay kept.
    """
    scores = rank_nan_last(scores)
    scores[..., :forced] = math.inf
    if isinstance(count, torch.Tensor):
        # The largest count's top lines best first, each head's list cut to its own count.
        width = int(count.max()) if count.numel() else 0
        best = torch.topk(scores, width, dim=-1, sorted=True).indices
        return pad_to_counts(best, count, scores.shape[-1])
    picked = torch.topk(scores, count, dim=-1, sorted=False).indices
    return torch.sort(picked.to(torch.int32), dim=-1).values


def vertical_slash_lines(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    vertical_size: PerHeadInt,
    slash_size: PerHeadInt,
    last_q: int = 64,
    init_columns: int = INIT_COLUMNS,
    local_diagonals: int = LOCAL_DIAGONALS,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept verticals and slash offsets (see `reference.vertical_slash.vertical_slash_lines`).

    Returns:
        (verticals, slashes) int32 `[B, Hq, count]`, sorted ascending.
    """
    shape = check_qk(q, k, dtypes=HALF_DTYPES)
    check_vertical_slash_params(
        vertical_size=vertical_size, slash_size=slash_size, last_q=last_q, block_m=1,
        block_n=1, init_columns=init_columns, local_diagonals=local_diagonals,
    )
    n, hq = shape.seqlen, shape.q_heads
    n_vertical = line_counts(vertical_size, init_columns, n, "vertical_size", hq, q.device)
    n_slash = line_counts(slash_size, local_diagonals, n, "slash_size", hq, q.device)
    vertical, slash = last_q_scores(q, k, last_q=last_q, scale=scale)
    verticals = top_lines(vertical, n_vertical, init_columns)
    slashes = top_lines(slash, n_slash, local_diagonals)
    return verticals, slashes


def vertical_slash_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    vertical_size: PerHeadInt,
    slash_size: PerHeadInt,
    last_q: int = 64,
    block_m: int = 64,
    block_n: int = 64,
    init_columns: int = INIT_COLUMNS,
    local_diagonals: int = LOCAL_DIAGONALS,
    scale: float | None = None,
) -> BlockColumnPlan:
    """MInference Vertical-Slash plan (see `reference.vertical_slash_plan`).

    Its block lists are exactly as wide as the fullest query block needs (one host
    synchronisation); each head's verticals are stored once and shared by its query
    blocks, so columns may repeat keys of listed blocks (`equal` to the reference).

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k, dtypes=HALF_DTYPES)
    check_vertical_slash_params(
        vertical_size=vertical_size, slash_size=slash_size, last_q=last_q, block_m=block_m,
        block_n=block_n, init_columns=init_columns, local_diagonals=local_diagonals,
    )
    check_kernel_block_sizes(block_m, block_n)
    verticals, slashes = vertical_slash_lines(
        q, k, vertical_size=vertical_size, slash_size=slash_size, last_q=last_q,
        init_columns=init_columns, local_diagonals=local_diagonals, scale=scale,
    )
    plan = vertical_slash_index(verticals, slashes, seqlen=shape.seqlen, block_m=block_m,
                                block_n=block_n)
    return apply_rule(with_own_columns(plan), q)


def with_own_columns(plan: BlockColumnPlan) -> BlockColumnPlan:
    """Per-query-block disjoint columns when they fit (`resolve_covered_columns`).

    Shared column lists keep a plan small at long N, but the kernel then tests every
    column against the block list (on an H200 at 128K with ANCHORS.md's MInference
    lines: 43 ms against 33 ms with disjoint columns). The kernel's front door does
    this normalisation for any plan (cached on the plan); calling it here, when the
    method builds its plan, puts its cost in the plan time rather than the first
    kernel call.
    """
    return resolve_covered_columns(plan)


def plan_nbytes(batch: int, heads: int, seqlen: int, *, block_m: int, block_width: int,
                n_vertical: int) -> int:
    """Bytes of a fast vertical-slash plan: counts, `block_width`-wide block lists and
    one shared column list per (batch, head)."""
    return 4 * batch * heads * (cdiv(seqlen, block_m) * (block_width + 2) + n_vertical)


def vertical_slash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    vertical_size: PerHeadInt,
    slash_size: PerHeadInt,
    last_q: int = 64,
    block_m: int = 64,
    block_n: int = 64,
    init_columns: int = INIT_COLUMNS,
    local_diagonals: int = LOCAL_DIAGONALS,
    scale: float | None = None,
) -> torch.Tensor:
    """Vertical-Slash sparse attention (see `reference.vertical_slash`).

    One plan for all heads unless its block lists, sized from the counting pass,
    exceed `PLAN_BYTES` (scattered slashes at long N); then query heads are indexed
    and run in groups that fit (one head at a time if even that does not fit).

    Host synchronisation: one, the counting pass's widest block list. Inside
    `fast.capture.static_widths()` (`torch.ops.sparseprefill.vertical_slash_static`)
    and during CUDA-graph capture the width is the parameter bound instead: no sync,
    capture-safe (docs/serving.md).

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qkv(q, k, v, dtypes=HALF_DTYPES)
    check_forward_only(q, k, v)
    check_vertical_slash_params(
        vertical_size=vertical_size, slash_size=slash_size, last_q=last_q, block_m=block_m,
        block_n=block_n, init_columns=init_columns, local_diagonals=local_diagonals,
    )
    check_kernel_block_sizes(block_m, block_n)
    n, b, g = shape.seqlen, shape.batch, shape.group
    verticals, slashes = vertical_slash_lines(
        q, k, vertical_size=vertical_size, slash_size=slash_size, last_q=last_q,
        init_columns=init_columns, local_diagonals=local_diagonals, scale=scale,
    )
    counts = count_blocks(slashes, seqlen=n, block_m=block_m, block_n=block_n)
    widths = block_widths(counts, index_width_bound(slashes.shape[2], seqlen=n, block_m=block_m,
                                                    block_n=block_n))
    per_head = plan_nbytes(b, 1, n, block_m=block_m, block_width=max(widths),
                           n_vertical=verticals.shape[2])
    step = head_group(shape.q_heads, g, PLAN_BYTES // per_head)

    def run(h0: int, h1: int) -> torch.Tensor:
        plan = with_own_columns(fill_index(
            verticals[:, h0:h1], slashes[:, h0:h1], counts[:, h0:h1],
            block_width=max(widths[h0:h1]), seqlen=n, block_m=block_m, block_n=block_n))
        # A group is whole KV heads, or query heads of one KV head.
        kv0, kv1 = h0 // g, (h1 - 1) // g + 1
        # A group of part of the layer: no SDPA call on it (its rate is not measured).
        layer = h1 - h0 == shape.q_heads
        plan = apply_rule(plan, q[:, h0:h1], layer=layer)
        return run_plan(q[:, h0:h1], k[:, kv0:kv1], v[:, kv0:kv1], plan, scale=scale, layer=layer)

    if step == shape.q_heads:
        return run(0, shape.q_heads)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for h0 in range(0, shape.q_heads, step):
        h1 = min(h0 + step, shape.q_heads)
        out[:, h0:h1] = run(h0, h1)
    return out


