"""MInference Vertical-Slash heads on the GPU (see `reference.vertical_slash` for the spec).

Estimate: `last_q_scores` (Triton, no `[L, N]` tensor); lines: one `torch.topk`
per kind with the forced lines set to +inf; index: `vertical_slash_index`
(Triton, Alg. 4). No host synchronisation anywhere.

`torch.topk` breaks exact ties in its own order, not by the lower index as the
reference does, and the fp32 estimate differs from the float64 one in the last
bits, so a line whose score ties (or nearly ties) the last kept one may differ
from the reference's choice.

Plan memory is sized from the parameters (`index_widths`): per (batch, head,
query block) `min(Kb, k_s * ((block_m - 1) // block_n + 2)) + k_v` int32. At long
N that is large (about 0.86 GB per head at N = 1M, (1000, 6096), 64 x 64 blocks),
so `vertical_slash` plans and runs a group of query heads at a time, keeping its
plans under `PLAN_BYTES` where one head's plan fits.
"""

from __future__ import annotations

import math

import torch

from ..reference._checks import HALF_DTYPES, check_qk, check_qkv
from ..reference.plan import BlockColumnPlan, cdiv
from ..reference.vertical_slash import (
    INIT_COLUMNS,
    LOCAL_DIAGONALS,
    check_vertical_slash_params,
    kept_lines,
)
from .kernels import block_column_attention
from .kernels.last_q_estimate import last_q_scores
from .kernels.vertical_slash_index import index_widths, vertical_slash_index

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


def top_lines(scores: torch.Tensor, count: int, forced: int) -> torch.Tensor:
    """`argtopk` with the first `forced` indices kept: int32 `[B, H, count]`, ascending."""
    scores[..., :forced] = math.inf
    picked = torch.topk(scores, count, dim=-1, sorted=False).indices
    return torch.sort(picked.to(torch.int32), dim=-1).values


def vertical_slash_lines(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    vertical_size: int,
    slash_size: int,
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
    vertical, slash = last_q_scores(q, k, last_q=last_q, scale=scale)
    n = shape.seqlen
    verticals = top_lines(vertical, kept_lines(vertical_size, init_columns, n), init_columns)
    slashes = top_lines(slash, kept_lines(slash_size, local_diagonals, n), local_diagonals)
    return verticals, slashes


def vertical_slash_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    vertical_size: int,
    slash_size: int,
    last_q: int = 64,
    block_m: int = 64,
    block_n: int = 64,
    init_columns: int = INIT_COLUMNS,
    local_diagonals: int = LOCAL_DIAGONALS,
    scale: float | None = None,
) -> BlockColumnPlan:
    """MInference Vertical-Slash plan (see `reference.vertical_slash_plan`).

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k, dtypes=HALF_DTYPES)
    check_vertical_slash_params(
        vertical_size=vertical_size, slash_size=slash_size, last_q=last_q, block_m=block_m,
        block_n=block_n, init_columns=init_columns, local_diagonals=local_diagonals,
    )
    verticals, slashes = vertical_slash_lines(
        q, k, vertical_size=vertical_size, slash_size=slash_size, last_q=last_q,
        init_columns=init_columns, local_diagonals=local_diagonals, scale=scale,
    )
    return vertical_slash_index(verticals, slashes, seqlen=shape.seqlen, block_m=block_m, block_n=block_n)


def plan_bytes_per_head(
    seqlen: int, *, vertical_size: int, slash_size: int, block_m: int, block_n: int,
    init_columns: int, local_diagonals: int,
) -> int:
    """Bytes of a vertical-slash plan for one batch row and query head."""
    kv = kept_lines(vertical_size, init_columns, seqlen)
    ks = kept_lines(slash_size, local_diagonals, seqlen)
    block_width, column_width = index_widths(kv, ks, seqlen=seqlen, block_m=block_m, block_n=block_n)
    return 4 * cdiv(seqlen, block_m) * (block_width + column_width + 2)


def vertical_slash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    vertical_size: int,
    slash_size: int,
    last_q: int = 64,
    block_m: int = 64,
    block_n: int = 64,
    init_columns: int = INIT_COLUMNS,
    local_diagonals: int = LOCAL_DIAGONALS,
    scale: float | None = None,
) -> torch.Tensor:
    """Vertical-Slash sparse attention (see `reference.vertical_slash`).

    Query heads are planned and run in groups whose plans fit in `PLAN_BYTES`
    (all at once unless N is long; one head at a time if even that does not fit).

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qkv(q, k, v, dtypes=HALF_DTYPES)
    params = dict(
        vertical_size=vertical_size, slash_size=slash_size, last_q=last_q, block_m=block_m,
        block_n=block_n, init_columns=init_columns, local_diagonals=local_diagonals,
    )
    check_vertical_slash_params(**params)
    per_head = shape.batch * plan_bytes_per_head(
        shape.seqlen, vertical_size=vertical_size, slash_size=slash_size, block_m=block_m,
        block_n=block_n, init_columns=init_columns, local_diagonals=local_diagonals,
    )
    step = head_group(shape.q_heads, shape.group, PLAN_BYTES // per_head)
    if step == shape.q_heads:
        plan = vertical_slash_plan(q, k, scale=scale, **params)
        out, _ = block_column_attention(q, k, v, plan, scale=scale, validate_plan=False)
        return out
    g = shape.group
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for h0 in range(0, shape.q_heads, step):
        # A group is whole KV heads, or query heads of one KV head.
        kv0, kv1 = h0 // g, (h0 + step - 1) // g + 1
        qs, ks, vs = q[:, h0:h0 + step], k[:, kv0:kv1], v[:, kv0:kv1]
        plan = vertical_slash_plan(qs, ks, scale=scale, **params)
        out[:, h0:h0 + step], _ = block_column_attention(qs, ks, vs, plan, scale=scale, validate_plan=False)
    return out


def head_group(q_heads: int, group: int, fit: int) -> int:
    """Query heads planned at once: at most `fit` (at least 1), whole KV heads or a divisor of G."""
    if fit >= q_heads:
        return q_heads
    if fit >= group:
        return fit // group * group
    return max(d for d in range(1, group + 1) if group % d == 0 and d <= max(fit, 1))
