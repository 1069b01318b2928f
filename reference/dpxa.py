"""DPXA, delta-based tile scoring (thesis section 4.3), as the specification.

Delta pre-processing (section 4.1.1 with the cosine metric of section 7.1.3) picks
anchors in Q and in K independently, inside every tile of `block` tokens: it is
Delta-KV's stage 1, `reference.delta_kv.delta_keep_mask(x, threshold=cos_threshold,
metric="cosine", chunk=block)`, applied to the queries as well as the keys (the tile
is the chunk, so its first token is an anchor and tiles are independent; walking the
tile, a token whose cosine similarity to the current anchor is >= `cos_threshold` is
dropped, any other token becomes the anchor). Both packages share that function's
bit-identical float64 test, so fast and reference anchors are always equal.

Tile score of query tile `i` and key tile `j` (section 4.3): the sum of `exp` of the
scaled scores `scale * q_a . k_b` over the Q anchors `a` of tile `i` and the K anchors
`b` of tile `j` with `b <= a` (each entry is one cell of the full tile, so causality
is per token). No count weighting. For stability every query tile's scores are
shifted by their maximum over the whole row of tiles, which the normalisation below
cancels. A non-finite score (NaN or infinity in q or k) weighs nothing; a query tile
without any finite score gets a NaN row, and `select_tiles` keeps every causal tile
there.

Tile weights: each query tile's row of scores divided by its sum (the input of
XAttention's greedy selection, which normalises by the row total); selection is
`reference.xattention.select_tiles`, the same greedy rule as XAttention.

Scoring ratio (section 4.3): with keep ratios `alpha` (anchors of Q over N) and
`beta` (anchors of K over N), the scoring costs `alpha * beta` of the full tiles;
`dpxa_scoring_ratio` returns it per (batch, query head).
"""

from __future__ import annotations

import math

import torch

from ._checks import (
    PerHead,
    check_block_size,
    check_fraction,
    check_knob,
    check_qk,
    per_head,
    resolve_scale,
)
from .attention import sparse_attention
from .delta_kv import delta_keep_mask
from .dense_fallback import (
    active_rates,
    heads_view,
    knob_heads,
    plan_with_fallback,
    probe_mass_density,
)
from .plan import BlockColumnPlan, cdiv
from .xattention import check_threshold, normalize_rows, select_tiles, tiles_to_plan


def check_dpxa_params(*, cos_threshold: object, threshold: object,
                      block: object) -> tuple[float, float | torch.Tensor, int]:
    """Check the DPXA parameters; return `(cos_threshold, threshold, block)` (a per-head
    threshold as a float64 CPU tensor).

    Raises:
        TypeError, ValueError: naming the first bad parameter.
    """
    cos = check_fraction("cos_threshold", cos_threshold, low=-1.0, high=1.0)
    tau = check_knob("threshold", threshold, check_threshold)
    return cos, tau, check_block_size("block", block)


def dpxa_anchors(x: torch.Tensor, *, cos_threshold: float, block: int) -> torch.Tensor:
    """Section 4.1.1 (cosine) per tile of `block` tokens: bool `[B, H, N]`, True at anchors."""
    return delta_keep_mask(x, threshold=cos_threshold, metric="cosine", chunk=block)


def anchor_tile_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    q_anchors: torch.Tensor,
    k_anchors: torch.Tensor,
    *,
    block: int,
    scale: float,
) -> torch.Tensor:
    """Section 4.3: sum of exp of the anchor x anchor scores per tile, each row max-shifted.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`.
        q_anchors: bool `[B, Hq, N]`; k_anchors: bool `[B, Hkv, N]`.
        block: tokens per tile. scale: softmax scale.

    Returns:
        float64 `[B, Hq, T, T]`: entry `(i, j)` is `sum exp(s - M_i)` over the causal
        anchor pairs of tiles `i` and `j`, `M_i` the largest such score of row `i`.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    tiles = cdiv(n, block)
    key_tile = torch.div(torch.arange(n, device=q.device), block, rounding_mode="floor")
    k64 = k.to(torch.float64).unsqueeze(2)
    k_mask = k_anchors.unsqueeze(2)
    out = torch.zeros(b, hkv, g, tiles, tiles, dtype=torch.float64, device=q.device)
    for i in range(tiles):
        r0, r1 = i * block, min(n, (i + 1) * block)
        q_rows = q[:, :, r0:r1].to(torch.float64).reshape(b, hkv, g, r1 - r0, d)
        scores = torch.matmul(q_rows, k64[..., :r1, :].transpose(-1, -2)) * scale
        rows = torch.arange(r0, r1, device=q.device)
        causal = torch.arange(r1, device=q.device)[None, :] <= rows[:, None]
        pair = q_anchors[:, :, r0:r1].reshape(b, hkv, g, r1 - r0, 1) & k_mask[..., :r1].unsqueeze(-2)
        # A non-finite score (NaN or infinity in q or k) weighs nothing.
        scores = scores.masked_fill(~(pair & causal & torch.isfinite(scores)), -math.inf)
        # Finite unless no pair of the row has a finite score; the row is then NaN.
        row_max = scores.amax(dim=(-2, -1), keepdim=True)
        mass = torch.exp(scores - row_max).sum(dim=-2)
        out[:, :, :, i] = torch.zeros_like(out[:, :, :, i]).index_add_(-1, key_tile[:r1], mass)
    return out.reshape(b, hq, tiles, tiles)


def dpxa_tile_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    cos_threshold: float = 0.75,
    block: int = 128,
    scale: float | None = None,
) -> torch.Tensor:
    """DPXA tile weights (section 4.3): delta anchors of Q and K, anchor-pair tile scores.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]` (GQA: query head `h` uses KV head `h // G`).
        cos_threshold: delta pre-processing threshold in `[-1, 1]`.
        block: tokens per tile (and per delta chunk).
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        float64 `[B, Hq, T, T]`, `T = ceil(N / block)`: row `i` sums to 1 over `j <= i`;
        non-causal entries are 0.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k)
    cos_threshold, _, block = check_dpxa_params(cos_threshold=cos_threshold, threshold=1.0, block=block)
    sm_scale = resolve_scale(scale, shape.head_dim)
    q_anchors = dpxa_anchors(q, cos_threshold=cos_threshold, block=block)
    k_anchors = dpxa_anchors(k, cos_threshold=cos_threshold, block=block)
    scores = anchor_tile_scores(q, k, q_anchors, k_anchors, block=block, scale=sm_scale)
    return normalize_rows(scores)


def dpxa_scoring_ratio(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    cos_threshold: float = 0.75,
    block: int = 128,
) -> torch.Tensor:
    """Section 4.3's scoring ratio `alpha * beta` per (batch, query head).

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`.
        cos_threshold, block: as `dpxa_tile_weights`.

    Returns:
        float64 `[B, Hq]`: (Q anchors of the head / N) x (K anchors of its KV head / N).

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k)
    cos_threshold, _, block = check_dpxa_params(cos_threshold=cos_threshold, threshold=1.0, block=block)
    alpha = dpxa_anchors(q, cos_threshold=cos_threshold, block=block).to(torch.float64).mean(-1)
    beta = dpxa_anchors(k, cos_threshold=cos_threshold, block=block).to(torch.float64).mean(-1)
    return alpha * beta.repeat_interleave(shape.group, dim=1)


def dpxa_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    cos_threshold: float = 0.75,
    threshold: PerHead = 0.9,
    block: int = 128,
    scale: float | None = None,
) -> BlockColumnPlan:
    """DPXA plan: `dpxa_tile_weights`, then XAttention's greedy `select_tiles`.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`.
        cos_threshold: delta pre-processing threshold in `[-1, 1]` (thesis: 0.75, 0.78).
        threshold: cumulative tile weight to reach per query tile, in `(0, 1]`; a scalar,
            or one per query head (a list or `[Hq]` tensor).
        block: tokens per tile (the plan's `block_m` and `block_n`).
        scale: softmax scale of the scoring, `1/sqrt(D)` if None.

    Returns:
        A `BlockColumnPlan` without columns, per batch row and query head; the break-even
        rule and the early exit as `xattention_plan`.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k)
    cos_threshold, _, block = check_dpxa_params(cos_threshold=cos_threshold, threshold=threshold, block=block)
    tau = per_head(threshold, "threshold", shape.q_heads, check_threshold, device=q.device)

    def estimate(heads: list[int] | None) -> BlockColumnPlan:
        qs, ks = heads_view(q, k, heads)
        weights = dpxa_tile_weights(qs, ks, cos_threshold=cos_threshold, block=block, scale=scale)
        return tiles_to_plan(select_tiles(weights, knob_heads(tau, heads)), seqlen=shape.seqlen, block=block)

    sm_scale = resolve_scale(scale, shape.head_dim)
    return plan_with_fallback(q, k, estimate, rates=active_rates(q), block_m=block, block_n=block,
                              probe=lambda: probe_mass_density(q, k, block_n=block, mass=tau, scale=sm_scale))


def dpxa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cos_threshold: float = 0.75,
    threshold: PerHead = 0.9,
    block: int = 128,
    scale: float | None = None,
) -> torch.Tensor:
    """DPXA sparse attention through `dpxa_plan`.

    Args:
        q: `[B, Hq, N, D]`; k, v: `[B, Hkv, N, D]`.
        cos_threshold, threshold, block, scale: as `dpxa_plan` (scale is also the
            attention's softmax scale).

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    plan = dpxa_plan(q, k, cos_threshold=cos_threshold, threshold=threshold, block=block,
                     scale=scale)
    return sparse_attention(q, k, v, plan, scale=scale)
