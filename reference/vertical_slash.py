"""MInference Vertical-Slash heads (Alg. 2 estimate, Alg. 4 index), as the specification.

Estimate (Alg. 2): the softmax attention `A_hat` of the last `L = min(last_q, N)`
queries of each query head against all keys (causal, so also among those `L`
queries), summed

* per key column `c` (the vertical score of `c`), and
* per diagonal offset `o = row - col`, `0 <= o < N` (the slash score of `o`).

Lines kept:

* verticals: the first `init_columns` columns are forced; the rest of the budget
  goes to the highest vertical scores. Forced lines count inside the budget, as in
  MInference's released code (it sets them to +inf before one `topk`): exactly
  `max(vertical_size, min(init_columns, N))` columns are kept, capped at `N`.
* slashes: the same with the `local_diagonals` nearest offsets `0, 1, ...` forced
  and `slash_size` as the budget.
* ties between equal scores: the lower column index (the nearer diagonal) wins.
* per-head budgets (`vertical_size` / `slash_size` as a list or `[Hq]` tensor): each
  query head keeps its own number of lines; the line lists are as wide as the largest
  and a shorter head's list is padded with N (a column no query sees, a diagonal
  that reaches no row), which `vertical_slash_index` reads as padding.

Index (Alg. 4): for query block `i`, rows `[r0, r1)` with `r1 = min(r0 + block_m, N)`,
a kept slash `o <= r1 - 1` covers the keys `[max(r0 - o, 0), r1 - o)`. The plan keeps

* every key block (`block_n` keys, aligned) that intersects the union of those
  ranges (Alg. 4 merges the ranges and emits them as blocks; our blocks are
  aligned to `block_n`, so a range is rounded outward to whole blocks), and
* every kept vertical `v <= r1 - 1` not inside a kept block, as a column,

intersected with causality. That plan is exactly what the kernel computes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ._checks import (
    PerHeadInt,
    check_block_size,
    check_knob,
    check_positive_int,
    check_qk,
    is_per_head,
    per_head,
    resolve_scale,
)
from .attention import sparse_attention
from .dense_fallback import apply_rule
from .plan import BlockColumnPlan, cdiv, rank_nan_last

# MInference's released code forces 30 initial columns and the 100 nearest diagonals.
INIT_COLUMNS = 30
LOCAL_DIAGONALS = 100


def kept_lines(budget: int, forced: int, seqlen: int) -> int:
    """How many lines (verticals or slashes) are kept: forced ones count in the budget."""
    return min(seqlen, max(budget, min(forced, seqlen)))


def kept_lines_per_head(budget: torch.Tensor, forced: int, seqlen: int) -> torch.Tensor:
    """`kept_lines` of every head's budget (int64 `[H]`)."""
    return budget.clamp(min=min(forced, seqlen)).clamp(max=seqlen)


def check_line_budget(name: str) -> Callable[[object], int]:
    """The scalar check of a line budget (`vertical_size`, `slash_size`): an int >= 1."""
    return lambda value: check_positive_int(name, value)


def line_counts(budget: PerHeadInt, forced: int, seqlen: int, name: str, heads: int,
                device: torch.device) -> int | torch.Tensor:
    """The kept-line count: `kept_lines` of a scalar budget, or int64 `[heads]` of a per-head one."""
    if not is_per_head(budget):
        assert isinstance(budget, int)
        return kept_lines(budget, forced, seqlen)
    sizes = per_head(budget, name, heads, check_line_budget(name), integer=True, device=device)
    return kept_lines_per_head(sizes, forced, seqlen)


def pad_to_counts(lines: torch.Tensor, count: torch.Tensor, seqlen: int) -> torch.Tensor:
    """Ragged per-head line lists: in int `[B, H, W]` (ascending), entries past each head's
    `count[h]` in rank order become N; returned sorted ascending (the padding last).

    `lines` must list each head's lines best first (rank order) for the cut."""
    rank = torch.arange(lines.shape[-1], device=lines.device)
    cut = torch.where(rank < count.to(lines.device)[:, None], lines, seqlen)
    return torch.sort(cut, dim=-1).values.to(torch.int32)


def approximate_attention(q: torch.Tensor, k: torch.Tensor, *, last_q: int, scale: float) -> torch.Tensor:
    """Alg. 2 line 2: `A_hat = softmax(Q[-last_q:] K^T / sqrt(d) + m_causal)`.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`.
        last_q: queries used; `min(last_q, N)` of them, the last ones.
        scale: softmax scale.

    Returns:
        float64 `[B, Hq, L, N]`, row `i` being query `N - L + i`; non-causal entries 0.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    rows = min(last_q, n)
    q_last = q[:, :, n - rows:].to(torch.float64).reshape(b, hkv, g, rows, d)
    scores = torch.matmul(q_last, k.to(torch.float64).unsqueeze(2).transpose(-1, -2)) * scale
    row_ids = torch.arange(n - rows, n, device=q.device)
    causal = torch.arange(n, device=q.device)[None, :] <= row_ids[:, None]
    scores = scores.masked_fill(~causal, -math.inf)
    return torch.softmax(scores, dim=-1).reshape(b, hq, rows, n)


def sum_vertical(a_hat: torch.Tensor) -> torch.Tensor:
    """Alg. 2 line 4, `sum_v(A_hat)`: float64 `[B, Hq, N]`, the mass of every key column."""
    return a_hat.sum(dim=2)


def sum_slash(a_hat: torch.Tensor) -> torch.Tensor:
    """Alg. 2 line 6, `sum_s(A_hat)`: float64 `[B, Hq, N]`, indexed by offset `o = row - col`.

    Entry `o` is the sum of `A_hat[row, row - o]` over the estimated rows with `row >= o`.
    """
    b, h, rows, n = a_hat.shape
    row_ids = torch.arange(n - rows, n, device=a_hat.device)
    offset = row_ids[:, None] - torch.arange(n, device=a_hat.device)[None, :]
    # Non-causal entries (offset < 0) are 0 in A_hat; park them on offset 0 harmlessly.
    offset = offset.clamp(min=0).expand(b, h, rows, n).reshape(b, h, rows * n)
    out = torch.zeros(b, h, n, dtype=a_hat.dtype, device=a_hat.device)
    return out.scatter_add_(2, offset, a_hat.reshape(b, h, rows * n))


def argtopk(scores: torch.Tensor, count: int | torch.Tensor, forced: int) -> torch.Tensor:
    """Alg. 2 lines 4 and 6, `argtopk`, with the first `forced` indices always kept.

    Args:
        scores: `[B, H, L]`, higher is better.
        count: how many indices to keep (`kept_lines`), `>= min(forced, L)`; an int, or
            int64 `[H]` per head (`kept_lines_per_head`).
        forced: indices `0 .. forced - 1` are kept whatever their score.

    Returns:
        int32 `[B, H, count]`, sorted ascending (per-head counts: `[B, H, max count]`,
        each head's list padded with L after its own count). Ties: the lower index wins
        (a stable sort of the scores, descending, keeps equal scores in index order). A
        NaN score (from NaN in q or k) ranks below every number; forced indices stay kept.
    """
    ranked = rank_nan_last(scores)
    ranked[..., :forced] = math.inf
    if isinstance(count, torch.Tensor):
        width = int(count.max()) if count.numel() else 0
        order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :width]
        return pad_to_counts(order, count, scores.shape[-1])
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :count]
    return torch.sort(order, dim=-1).values.to(torch.int32)


def check_vertical_slash_params(
    *,
    vertical_size: PerHeadInt,
    slash_size: PerHeadInt,
    last_q: int,
    block_m: int,
    block_n: int,
    init_columns: int,
    local_diagonals: int,
) -> None:
    """Raise TypeError/ValueError naming the first bad vertical-slash parameter (the budgets:
    a scalar, or one per query head)."""
    check_knob("vertical_size", vertical_size, check_line_budget("vertical_size"), integer=True)
    check_knob("slash_size", slash_size, check_line_budget("slash_size"), integer=True)
    check_positive_int("last_q", last_q)
    check_block_size("block_m", block_m)
    check_block_size("block_n", block_n)
    check_positive_int("init_columns", init_columns, minimum=0)
    check_positive_int("local_diagonals", local_diagonals, minimum=0)


def vertical_slash_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    last_q: int = 64,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 2 lines 2-6 up to the scores: (vertical `[B, Hq, N]`, slash `[B, Hq, N]`) float64.

    Raises:
        TypeError, ValueError: bad inputs.
    """
    shape = check_qk(q, k)
    check_positive_int("last_q", last_q)
    a_hat = approximate_attention(q, k, last_q=last_q, scale=resolve_scale(scale, shape.head_dim))
    return sum_vertical(a_hat), sum_slash(a_hat)


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
    """Alg. 2 lines 2-6: the kept vertical columns and slash offsets.

    Returns:
        (verticals int32 `[B, Hq, kept_lines(vertical_size, init_columns, N)]`,
        slashes int32 `[B, Hq, kept_lines(slash_size, local_diagonals, N)]`), each
        sorted ascending; a slash is the offset `row - col` of its diagonal. Per-head
        budgets: as wide as the largest head's count, the others padded with N.

    Raises:
        TypeError, ValueError: bad inputs.
    """
    shape = check_qk(q, k)
    check_vertical_slash_params(
        vertical_size=vertical_size, slash_size=slash_size, last_q=last_q, block_m=1,
        block_n=1, init_columns=init_columns, local_diagonals=local_diagonals,
    )
    n, hq = shape.seqlen, shape.q_heads
    n_vertical = line_counts(vertical_size, init_columns, n, "vertical_size", hq, q.device)
    n_slash = line_counts(slash_size, local_diagonals, n, "slash_size", hq, q.device)
    vertical, slash = vertical_slash_scores(q, k, last_q=last_q, scale=scale)
    verticals = argtopk(vertical, n_vertical, init_columns)
    slashes = argtopk(slash, n_slash, local_diagonals)
    return verticals, slashes


def slash_coverage(slashes: torch.Tensor, *, seqlen: int, block_m: int) -> torch.Tensor:
    """Alg. 4, the ranges: bool `[B, H, Qb, N]`, the keys the kept slashes reach per query block.

    Key `c` is reached in query block `[r0, r1)` iff some kept offset lies in
    `[r0 - c, r1 - 1 - c]`; a cumulative count of kept offsets answers that.
    """
    b, h, _ = slashes.shape
    n, qb = seqlen, cdiv(seqlen, block_m)
    device = slashes.device
    kept = torch.zeros(b, h, n + 1, dtype=torch.int64, device=device)
    kept.scatter_(2, slashes.to(torch.int64), 1)
    # below[o] = number of kept offsets < o, for o in [0, N].
    below = torch.cat([torch.zeros_like(kept[..., :1]), kept[..., :n].cumsum(dim=2)], dim=2)
    r0 = torch.arange(qb, device=device)[:, None] * block_m
    r1 = (r0 + block_m).clamp(max=n)
    c = torch.arange(n, device=device)[None, :]
    lo = (r0 - c).clamp(0, n)
    hi = (r1 - c).clamp(0, n)
    hits = below[:, :, hi.reshape(-1)] - below[:, :, lo.reshape(-1)]
    return hits.reshape(b, h, qb, n) > 0


def vertical_slash_index(
    verticals: torch.Tensor,
    slashes: torch.Tensor,
    *,
    seqlen: int,
    block_m: int = 64,
    block_n: int = 64,
) -> BlockColumnPlan:
    """Alg. 4: point-range merge of verticals (points) and slashes (ranges) into a plan.

    Args:
        verticals: int `[B, H, kv]`, distinct kept key columns in `[0, N)`; N is padding
            (ragged per-head lists), as in the fast index kernel.
        slashes: int `[B, H, ks]`, distinct kept offsets `row - col` in `[0, N)`; N is
            padding.
        seqlen: N. block_m, block_n: query rows and keys per block.

    Returns:
        The plan of the module doc: key blocks touched by a slash range, plus the
        verticals outside those blocks as columns.

    Raises:
        ValueError: an index out of `[0, N)` or mismatched leading shapes.
    """
    n = check_positive_int("seqlen", seqlen)
    bm = check_block_size("block_m", block_m)
    bn = check_block_size("block_n", block_n)
    for name, t in (("verticals", verticals), ("slashes", slashes)):
        if t.dim() != 3 or t.shape[:2] != verticals.shape[:2]:
            raise ValueError(f"{name} must have shape [B, H, count], got {tuple(t.shape)}")
        if t.numel() and (int(t.min()) < 0 or int(t.max()) > n):
            raise ValueError(f"{name} must lie in [0, {n}) (or be the padding {n}), got range "
                             f"[{int(t.min())}, {int(t.max())}]")
    b, h, _ = verticals.shape
    qb, kb = cdiv(n, bm), cdiv(n, bn)
    reached = slash_coverage(slashes, seqlen=n, block_m=bm)
    padded = torch.zeros(b, h, qb, kb * bn, dtype=torch.bool, device=reached.device)
    padded[..., :n] = reached
    blocks = padded.reshape(b, h, qb, kb, bn).any(dim=-1)
    columns = torch.zeros(b, h, n + 1, dtype=torch.bool, device=verticals.device)
    columns = columns.scatter_(2, verticals.to(torch.int64), True)[..., :n]
    # from_masks drops the non-causal columns and those inside a kept block.
    columns = columns.unsqueeze(2).expand(b, h, qb, n)
    return BlockColumnPlan.from_masks(blocks, columns, seqlen=n, block_m=bm, block_n=bn)


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
    """MInference Vertical-Slash plan (Alg. 2 estimate, Alg. 4 index); see the module doc.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`. Each query head is estimated from its
            own queries against its KV head's keys.
        vertical_size: vertical-line budget, forced initial columns included (>= 1); a
            scalar, or one per query head (a list or `[Hq]` int tensor).
        slash_size: slash-line budget, forced local diagonals included (>= 1); the same.
        last_q: queries used for the estimate (>= 1; more than N means all).
        block_m, block_n: query rows and keys per block.
        init_columns: first columns always kept (>= 0); MInference uses 30.
        local_diagonals: nearest diagonals always kept (>= 0); MInference uses 100.
        scale: softmax scale of the estimate, `1/sqrt(D)` if None.

    Returns:
        A `BlockColumnPlan` per batch row and query head.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k)
    check_vertical_slash_params(
        vertical_size=vertical_size, slash_size=slash_size, last_q=last_q, block_m=block_m,
        block_n=block_n, init_columns=init_columns, local_diagonals=local_diagonals,
    )
    verticals, slashes = vertical_slash_lines(
        q, k, vertical_size=vertical_size, slash_size=slash_size, last_q=last_q,
        init_columns=init_columns, local_diagonals=local_diagonals, scale=scale,
    )
    return apply_rule(vertical_slash_index(verticals, slashes, seqlen=shape.seqlen, block_m=block_m,
                                          block_n=block_n), q)


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
    """Vertical-Slash sparse attention through `vertical_slash_plan` (Alg. 2).

    Returns:
        `[B, Hq, N, D]` in q's dtype.
    """
    plan = vertical_slash_plan(
        q, k, vertical_size=vertical_size, slash_size=slash_size, last_q=last_q,
        block_m=block_m, block_n=block_n, init_columns=init_columns,
        local_diagonals=local_diagonals, scale=scale,
    )
    return sparse_attention(q, k, v, plan, scale=scale)
