"""FlexPrefill-style vertical-slash heads: lines chosen by a cumulative threshold (SharePrefill Alg. 5).

SharePrefill (Peng et al., Appendix B, Algorithm 5) falls back to the
vertical-slash search of FlexPrefill (Lai et al.) for highly sparse heads. Unlike
MInference's vertical-slash (`vertical_slash`), which keeps a fixed number of
lines, it keeps the fewest lines whose estimated attention mass reaches `gamma`:

1. `A_hat = softmax(Q_hat K^T / sqrt(d))` for the last `L = min(last_q, N)` queries
   `Q_hat` of each query head (causal), as in `vertical_slash.approximate_attention`.
2. `a_v = sum_vertical(A_hat) / sum(A_hat)` and `a_s = sum_slash(A_hat) / sum(A_hat)`:
   the share of the estimated mass on every key column and every diagonal offset
   `o = row - col`; each sums to 1.
3. For each kind, the lines sorted by share, descending; `K = min{k : the k largest
   shares sum to >= gamma}`; the `K` largest are kept (`cover_threshold`).

Forced lines (our addition, documented choice): the first `init_columns` columns and
the `local_diagonals` nearest diagonals are always kept and their share counts first:
`K` is then the fewest further lines, in descending share, that bring the kept share
to `gamma`. With `init_columns = local_diagonals = 0` this is Alg. 5 exactly. The
defaults keep column 0 (the attention sink) and the main diagonal, so that no query
row is left without keys; FlexPrefill's released code likewise always keeps the
first key block and the diagonal block. Ties between equal shares: the lower index
(column, or nearer diagonal) ranks first. If rounding keeps the cumulative share just
below `gamma` after every line, every line is kept.

Per-head `gamma` (a list or `[Hq]` tensor): query head `h` covers its own share
`gamma[h]`, of its own estimate (GQA: each query head has its own lines anyway).

Index: the kept lines go through MInference's Alg. 4 (`vertical_slash.vertical_slash_index`
semantics): the key blocks a kept slash reaches in a query block, plus the kept
columns outside them. Unlike MInference, the number of lines differs per head.

Line granularity (`line_block = g`, our addition; 1 is Alg. 5 as written): lines are
chosen in aligned bands of `g` adjacent columns (`[j g, j g + g)`) and of `g` adjacent
diagonal offsets. A band's share is the sum of its lines' shares (`pool_lines`), the
cumulative threshold ranks bands instead of lines (so the kept bands still hold at
least `gamma` of the estimated mass), a band is forced if it holds a forced line, and
a kept band keeps all its lines. When `block_n` divides `g`, a kept vertical band is
whole key blocks and the index lists it as blocks (`lines_masks`), not columns: the
plan is then pure blocks, as in FlexPrefill's released code, which keeps whole
128-blocks of verticals and block diagonals (see docs/flexprefill_vs.md).
"""

from __future__ import annotations

import math

import torch

from ._checks import (
    PerHead,
    check_block_size,
    check_count,
    check_fraction,
    check_knob,
    check_positive_int,
    check_qk,
    per_head,
    resolve_scale,
)
from .attention import sparse_attention
from .dense_fallback import (
    active_rates,
    heads_view,
    knob_heads,
    plan_with_fallback,
    probe_mass_density,
)
from .plan import BlockColumnPlan, cdiv, rank_nan_last
from .vertical_slash import (
    approximate_attention,
    slash_coverage,
    sum_slash,
    sum_vertical,
)

# FlexPrefill's and SharePrefill's cumulative attention threshold.
GAMMA = 0.9
# Lines per band of the threshold (1: single lines, Alg. 5 as written). 128, two default
# 64-key blocks: whole key blocks, a pure-block plan; chosen by measurement, docs/flexprefill_vs.md.
LINE_BLOCK = 128


def check_gamma(gamma: object) -> float:
    """Return `gamma` as float if it lies in `[0, 1]`, else raise TypeError/ValueError."""
    return check_fraction("gamma", gamma)


def check_flexprefill_vs_params(
    *,
    gamma: PerHead,
    last_q: int,
    block_m: int,
    block_n: int,
    init_columns: int,
    local_diagonals: int,
    line_block: int = 1,
) -> None:
    """Raise TypeError/ValueError naming the first bad parameter (gamma: a scalar or per head)."""
    check_knob("gamma", gamma, check_gamma)
    check_positive_int("last_q", last_q)
    check_block_size("block_m", block_m)
    check_block_size("block_n", block_n)
    check_positive_int("init_columns", init_columns, minimum=0)
    check_positive_int("local_diagonals", local_diagonals, minimum=0)
    check_block_size("line_block", line_block)


def normalized_lines(a_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 5 lines 2-3: `a_v`, `a_s` = vertical and slash sums over the total mass.

    Args:
        a_hat: float64 `[B, H, L, N]`, softmax rows of the estimated queries.

    Returns:
        (a_v, a_s) float64 `[B, H, N]`, each summing to 1 per head.
    """
    total = a_hat.sum(dim=(2, 3)).unsqueeze(-1)
    return sum_vertical(a_hat) / total, sum_slash(a_hat) / total


def cover_threshold(scores: torch.Tensor, gamma: float | torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """Alg. 5 lines 4-8 (and Alg. 2's budget): the fewest entries whose share reaches `gamma`.

    Entries are ranked by score, descending (ties: lower index first), with the
    `forced` entries ranked before all others whatever their score; an entry is kept
    iff it is forced or the scores of the entries ranked before it sum to less than
    `gamma`. With nothing forced, that keeps the `K = min{k : sum of the k largest
    >= gamma}` largest entries, and all of them if the sum never reaches `gamma`.

    A NaN score (from NaN in q or k) ranks below every number (`rank_nan_last`) and,
    once reached, stops the cumulative sum: only the forced entries and the numbers
    ranked before it are kept.

    Args:
        scores: float64 `[..., L]`, non-negative shares (summing to about 1).
        gamma: the threshold in `[0, 1]`: a float, or a tensor broadcastable to
            `scores.shape[:-1]` (a per-head `[H]` against `[B, H, L]`).
        forced: bool, broadcastable to `scores`: entries always kept.

    Returns:
        bool `[..., L]`, the kept entries.
    """
    forced = forced.expand(scores.shape)
    ranked = torch.where(forced, math.inf, rank_nan_last(scores))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    mass = torch.gather(scores, -1, order)
    before = torch.cumsum(mass, dim=-1) - mass
    if isinstance(gamma, torch.Tensor):
        gamma = gamma.to(before.device).unsqueeze(-1)
    keep_sorted = torch.gather(forced, -1, order) | (before < gamma)
    return torch.zeros_like(forced).scatter(-1, order, keep_sorted)


def first_lines(count: int, seqlen: int, device: torch.device) -> torch.Tensor:
    """bool `[N]`: True for the first `count` indices (forced columns or diagonals)."""
    return torch.arange(seqlen, device=device) < count


def pool_lines(shares: torch.Tensor, line_block: int) -> torch.Tensor:
    """Band shares: the sum of every aligned group of `line_block` lines.

    Args:
        shares: float `[..., N]`, one share per column or diagonal offset.
        line_block: lines per band (>= 1).

    Returns:
        float `[..., ceil(N / line_block)]`; band `j` holds lines `[j g, min(j g + g, N))`.
    """
    n = shares.shape[-1]
    bands = cdiv(n, line_block)
    wide = torch.zeros(*shares.shape[:-1], bands * line_block, dtype=shares.dtype, device=shares.device)
    wide[..., :n] = shares
    return wide.reshape(*shares.shape[:-1], bands, line_block).sum(dim=-1)


def band_lines(kept: torch.Tensor, line_block: int, seqlen: int) -> torch.Tensor:
    """bool `[..., Nb]` kept bands -> bool `[..., N]` kept lines (every line of a kept band)."""
    return kept.repeat_interleave(line_block, dim=-1)[..., :seqlen]


def cover_bands(shares: torch.Tensor, gamma: float | torch.Tensor, forced_lines: int,
                line_block: int) -> torch.Tensor:
    """`cover_threshold` over bands of `line_block` lines, returned as lines.

    Args:
        shares: float64 `[B, H, N]` line shares.
        gamma: the threshold (a float or a per-head tensor, as `cover_threshold`).
        forced_lines: the first lines always kept.
        line_block: lines per band; a band holding a forced line is forced.

    Returns:
        bool `[B, H, N]`: the lines of the kept bands.
    """
    n = shares.shape[-1]
    bands = pool_lines(shares, line_block)
    forced = first_lines(cdiv(forced_lines, line_block), bands.shape[-1], shares.device)
    return band_lines(cover_threshold(bands, gamma, forced), line_block, n)


def flexprefill_vs_lines(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    gamma: PerHead = GAMMA,
    last_q: int = 64,
    init_columns: int = 1,
    local_diagonals: int = 1,
    line_block: int = LINE_BLOCK,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 5 lines 1-9: the kept key columns and diagonal offsets of every query head.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`.
        gamma: cumulative share to reach, in `[0, 1]`; a scalar or one per query head.
        last_q: queries of the estimate (the last ones; more than N means all).
        init_columns, local_diagonals: forced first columns and nearest diagonals.
        line_block: lines per band of the threshold (1: single lines, Alg. 5).
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        (verticals, slashes) bool `[B, Hq, N]`: kept columns, kept offsets `row - col`
        (whole aligned bands of `line_block` lines).

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k)
    check_flexprefill_vs_params(gamma=gamma, last_q=last_q, block_m=1, block_n=1,
                                init_columns=init_columns, local_diagonals=local_diagonals,
                                line_block=line_block)
    n = shape.seqlen
    # Counts past N mean "all": clamp before any arithmetic.
    last_q = check_count("last_q", last_q, cap=n)
    init_columns = check_count("init_columns", init_columns, cap=n, minimum=0)
    local_diagonals = check_count("local_diagonals", local_diagonals, cap=n, minimum=0)
    heads_gamma = per_head(gamma, "gamma", shape.q_heads, check_gamma, device=q.device)
    a_hat = approximate_attention(q, k, last_q=last_q, scale=resolve_scale(scale, shape.head_dim))
    a_v, a_s = normalized_lines(a_hat)
    verticals = cover_bands(a_v, heads_gamma, init_columns, line_block)
    slashes = cover_bands(a_s, heads_gamma, local_diagonals, line_block)
    return verticals, slashes


def lines_masks(
    verticals: torch.Tensor,
    slashes: torch.Tensor,
    *,
    block_m: int,
    block_n: int,
    line_block: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 4 of MInference on kept-line masks, as dense selections.

    Args:
        verticals, slashes: bool `[B, H, N]`, kept columns and kept offsets.
        block_m, block_n: query rows and keys per block.
        line_block: the lines' band width; when `block_n` divides it, key blocks whose
            columns are all kept verticals (whole bands) are listed as blocks.

    Returns:
        (blocks bool `[B, H, Qb, Kb]`: the key blocks a kept slash reaches in each query
        block, and the whole-band vertical blocks; columns bool `[B, H, Qb, N]`: the kept
        columns), for `BlockColumnPlan.from_masks` (which drops columns inside blocks).
    """
    b, h, n = verticals.shape
    qb, kb = cdiv(n, block_m), cdiv(n, block_n)
    offsets = torch.arange(n, device=slashes.device).expand(b, h, n)
    # slash_coverage ignores offset N (its spare slot): pad the ragged lists with it.
    padded = torch.where(slashes, offsets, n)
    reached = slash_coverage(padded, seqlen=n, block_m=block_m)
    wide = torch.zeros(b, h, qb, kb * block_n, dtype=torch.bool, device=reached.device)
    wide[..., :n] = reached
    blocks = wide.reshape(b, h, qb, kb, block_n).any(dim=-1)
    if line_block % block_n == 0:
        # Columns past N count as kept, so the last (partial) key block can be whole.
        full = torch.ones(b, h, kb * block_n, dtype=torch.bool, device=verticals.device)
        full[..., :n] = verticals
        blocks = blocks | full.reshape(b, h, 1, kb, block_n).all(dim=-1)
    return blocks, verticals.unsqueeze(2).expand(b, h, qb, n)


def lines_index(
    verticals: torch.Tensor,
    slashes: torch.Tensor,
    *,
    block_m: int = 64,
    block_n: int = 64,
    line_block: int = 1,
) -> BlockColumnPlan:
    """Alg. 4 of MInference on kept-line masks: the key blocks the kept slashes reach in
    each query block, plus the kept columns outside them (intersected with causality).

    Args:
        verticals, slashes: bool `[B, H, N]`, kept columns and kept offsets.
        block_m, block_n: query rows and keys per block.
        line_block: the lines' band width (see `lines_masks`): when `block_n` divides it,
            whole-band verticals become block entries.

    Returns:
        The plan (disjoint blocks and columns).
    """
    n = verticals.shape[-1]
    blocks, columns = lines_masks(verticals, slashes, block_m=block_m, block_n=block_n,
                                  line_block=line_block)
    return BlockColumnPlan.from_masks(blocks, columns, seqlen=n, block_m=block_m, block_n=block_n)


def flexprefill_vs_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    gamma: PerHead = GAMMA,
    last_q: int = 64,
    block_m: int = 64,
    block_n: int = 64,
    init_columns: int = 1,
    local_diagonals: int = 1,
    line_block: int = LINE_BLOCK,
    scale: float | None = None,
) -> BlockColumnPlan:
    """FlexPrefill-style vertical-slash plan (SharePrefill Alg. 5); see the module doc.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`.
        gamma: cumulative attention share the kept lines must reach, in `[0, 1]`; a
            scalar, or one per query head (a list or `[Hq]` tensor).
        last_q: queries used for the estimate (>= 1; more than N means all).
        block_m, block_n: query rows and keys per block of the plan.
        init_columns: first columns always kept (>= 0).
        local_diagonals: nearest diagonals always kept (>= 0).
        line_block: lines per band of the threshold (>= 1; 1 is Alg. 5's single lines);
            a multiple of `block_n` makes the plan pure blocks.
        scale: softmax scale of the estimate, `1/sqrt(D)` if None.

    Returns:
        A `BlockColumnPlan` per batch row and query head.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k)
    check_flexprefill_vs_params(gamma=gamma, last_q=last_q, block_m=block_m, block_n=block_n,
                                init_columns=init_columns, local_diagonals=local_diagonals,
                                line_block=line_block)
    mass = per_head(gamma, "gamma", shape.q_heads, check_gamma, device=q.device)

    def estimate(heads: list[int] | None) -> BlockColumnPlan:
        qs, ks = heads_view(q, k, heads)
        verticals, slashes = flexprefill_vs_lines(
            qs, ks, gamma=gamma if heads is None else knob_heads(mass, heads), last_q=last_q,
            init_columns=init_columns, local_diagonals=local_diagonals, line_block=line_block, scale=scale,
        )
        return lines_index(verticals, slashes, block_m=block_m, block_n=block_n, line_block=line_block)

    sm_scale = resolve_scale(scale, shape.head_dim)
    return plan_with_fallback(q, k, estimate, rates=active_rates(q), block_m=block_m, block_n=block_n,
                              probe=lambda: probe_mass_density(q, k, block_n=block_n, mass=mass, scale=sm_scale))


def flexprefill_vs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    gamma: PerHead = GAMMA,
    last_q: int = 64,
    block_m: int = 64,
    block_n: int = 64,
    init_columns: int = 1,
    local_diagonals: int = 1,
    line_block: int = LINE_BLOCK,
    scale: float | None = None,
) -> torch.Tensor:
    """FlexPrefill-style vertical-slash sparse attention through `flexprefill_vs_plan`.

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    plan = flexprefill_vs_plan(
        q, k, gamma=gamma, last_q=last_q, block_m=block_m, block_n=block_n,
        init_columns=init_columns, local_diagonals=local_diagonals, line_block=line_block, scale=scale,
    )
    return sparse_attention(q, k, v, plan, scale=scale)
