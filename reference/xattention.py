"""XAttention antidiagonal tile scoring (thesis section 2.5), as the specification.

Every sequence is cut into tiles of `block` tokens (query tiles and key tiles alike;
the last tile holds the rest), and every tile into `ceil(block / stride)` groups of
`stride` consecutive tokens (the last group of a tile may be shorter).

Scores, one per (query group, key group), "stride level" (section 2.5, Figure 6):

* `scoring="antidiagonal"`: groups are concatenated along the head dimension, the
  key group in reversed order, so the score of query group `g` and key group `h`
  sums the `stride` products on the antidiagonal of their `S x S` sub-block:
  `sum_{a + b = S - 1} q[start_g + a] . k[start_h + b]`. A token missing from a short
  group contributes 0 (zero padding, as the authors' code pads). The sum is scaled by
  `scale / stride`: the authors' code divides by the stride, so the score is the
  mean of the antidiagonal's scaled logits.
* `scoring="naive"`: the thesis's ablation (section 4.3): every group keeps its first
  token only, no head-dim expansion: `scale * q[start_g] . k[start_h]`.

A non-finite score (NaN or infinity in q or k) counts as `-inf`: it weighs nothing.
A query group left without any finite score makes its query tile's row of weights NaN,
and `select_tiles` keeps every causal tile there.

Causality is decided per group, as in the authors' code: key group `h` is visible to
query group `g` iff it starts no later (`start_h <= start_g`), so the diagonal group's
antidiagonal includes products with keys after the query (the diagonal tile is
kept anyway; this only shapes the normalisation).

Tile weights: a softmax over each query group's row of visible key groups (the
authors' `softmax` over `Q_reshaped K_reshaped^T`), the probabilities summed into
tiles (query tile `i` x key tile `j`), and each query tile's row divided by its sum,
so that `sum_j W[i, j] = 1`: `W[i, j]` is the mean, over the query groups of tile `i`,
of the mass the group puts on key tile `j`.

Selection (`select_tiles`, shared with `dpxa`): per query tile `i`, the first key tile
and the diagonal tile are always kept; the other causal tiles are taken in descending
weight (ties: lower index first), a tile being kept iff the weight of the tiles taken
before it (forced ones included) is below `threshold` (so the tile that crosses it is
kept, as in the authors' `find_blocks_chunked`). `threshold = 1` keeps every causal tile.
NaN weights (from NaN in q or k) rank last and count as 0. A per-head threshold (a list
or `[Hq]` tensor) gives every query head its own value (GQA: the query heads of one KV
head share its keys but select their tiles each with its own threshold).

The plan has `block_m = block_n = block` and no columns.
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
    check_qk,
    check_tensor,
    check_values,
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

SCORINGS = ("antidiagonal", "naive")


def check_threshold(threshold: object) -> float:
    """Return `threshold` as float if it lies in `(0, 1]`, else raise TypeError/ValueError."""
    value = check_fraction("threshold", threshold)
    if value <= 0.0:
        raise ValueError(f"threshold must lie in (0, 1], got {threshold}")
    return value


def check_weights(weights: object) -> torch.Tensor:
    """Tile weights: a float tensor `[B, H, T, T]`, else TypeError/ValueError naming `weights`."""
    weights = check_values("weights", check_tensor("weights", weights, rank=4), why="tiles are chosen by them")
    if not weights.is_floating_point():
        raise TypeError(f"weights must be a float tensor, got {weights.dtype}")
    if weights.shape[2] != weights.shape[3]:
        raise ValueError(f"weights must have shape [B, H, T, T], got {tuple(weights.shape)}")
    if 0 in weights.shape:
        raise ValueError(f"weights must not be empty (T >= 1 tiles), got shape {tuple(weights.shape)}")
    return weights


def check_xattention_params(
    *, stride: object, threshold: object, block: object, scoring: object
) -> tuple[int, float | torch.Tensor, int, str]:
    """Check the XAttention parameters; return `(stride, threshold, block, scoring)`.

    A group never outgrows its tile, so strides past `block` mean `block` (and are
    clamped to it before any arithmetic). A per-head threshold comes back as a float64
    CPU tensor (its length is checked against Hq by `per_head`).

    Raises:
        TypeError, ValueError: naming the first bad parameter.
    """
    bs = check_block_size("block", block)
    s = check_count("stride", stride, cap=bs)
    tau = check_knob("threshold", threshold, check_threshold)
    if not isinstance(scoring, str):
        raise TypeError(f"scoring must be a str, got {type(scoring).__name__}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    return s, tau, bs, scoring


def stride_groups(seqlen: int, *, block: int, stride: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Section 2.5, the partition: the groups of every tile, in sequence order.

    Returns:
        (start, size), int64 `[G]`: each group's first token and its token count;
        tile `t` holds `ceil(block / stride)` groups (fewer in the last tile).
    """
    per_tile = cdiv(block, stride)
    tiles = cdiv(seqlen, block)
    offsets = torch.arange(per_tile) * stride
    start = (torch.arange(tiles)[:, None] * block + offsets[None, :]).reshape(-1)
    end = torch.minimum(torch.arange(tiles)[:, None] * block + block, torch.tensor(seqlen))
    end = torch.minimum(start.reshape(tiles, per_tile) + stride, end).reshape(-1)
    real = start < seqlen
    return start[real], (end - start)[real]


def group_tokens(x: torch.Tensor, start: torch.Tensor, size: torch.Tensor, stride: int) -> torch.Tensor:
    """Section 2.5: the `stride` token vectors of every group, zero-padded.

    Args:
        x: `[B, H, N, D]`. start, size: from `stride_groups`.

    Returns:
        float64 `[B, H, G, stride, D]`; slot `a` of group `g` is token `start[g] + a`,
        or zeros when `a >= size[g]`.
    """
    b, h, n, d = x.shape
    pos = start[:, None] + torch.arange(stride)[None, :]
    present = torch.arange(stride)[None, :] < size[:, None]
    gathered = x.to(torch.float64)[:, :, pos.clamp(max=n - 1).to(x.device)]
    # where, not a product: a slot past its group must not carry another token's NaN.
    return torch.where(present.to(x.device)[None, None, :, :, None], gathered, 0.0)


def stride_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    block: int,
    stride: int,
    scoring: str,
    scale: float,
) -> torch.Tensor:
    """Section 2.5 (Figure 6) or the naive ablation (section 4.3): stride-level scores.

    Returns:
        float64 `[B, Hq, G, G]`; entry `(g, h)` is query group `g` against key group
        `h`, `-inf` where key group `h` starts after query group `g` or where the score
        is not finite.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    start, size = stride_groups(n, block=block, stride=stride)
    qg = group_tokens(q, start, size, stride)
    kg = group_tokens(k, start, size, stride)
    if scoring == "antidiagonal":
        # Concatenate along the head dim, keys reversed: slot a meets key slot S-1-a.
        q_packed = qg.reshape(b, hq, -1, stride * d)
        k_packed = kg.flip(3).reshape(b, hkv, -1, stride * d)
        logit_scale = scale / stride
    else:
        q_packed = qg[:, :, :, 0]
        k_packed = kg[:, :, :, 0]
        logit_scale = scale
    ng = start.numel()
    scores = torch.matmul(q_packed.reshape(b, hkv, g, ng, -1),
                          k_packed.unsqueeze(2).transpose(-1, -2)) * logit_scale
    visible = (start[None, :] <= start[:, None]).to(q.device)
    # A non-finite score (NaN or infinity in q or k) weighs nothing in the estimate.
    visible = visible & torch.isfinite(scores)
    return scores.masked_fill(~visible, -math.inf).reshape(b, hq, ng, ng)


def tile_of_groups(seqlen: int, *, block: int, stride: int) -> torch.Tensor:
    """int64 `[G]`: the tile every group lies in."""
    start, _ = stride_groups(seqlen, block=block, stride=stride)
    return torch.div(start, block, rounding_mode="floor")


def sum_into_tiles(probs: torch.Tensor, tile: torch.Tensor, tiles: int) -> torch.Tensor:
    """Sum stride-level entries `[B, H, G, G]` into tiles: float64 `[B, H, T, T]`.

    (An index sum, not a product with a one-hot matrix: a NaN stays in its own tile.)
    """
    b, h, ng, _ = probs.shape
    tile = tile.to(probs.device)
    by_key = torch.zeros(b, h, ng, tiles, dtype=torch.float64, device=probs.device)
    by_key.index_add_(3, tile, probs.to(torch.float64))
    out = torch.zeros(b, h, tiles, tiles, dtype=torch.float64, device=probs.device)
    return out.index_add_(2, tile, by_key)


def normalize_rows(sums: torch.Tensor) -> torch.Tensor:
    """Divide every query tile's row of tile sums by its total: rows sum to 1."""
    return sums / sums.sum(dim=-1, keepdim=True)


def xattention_tile_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    stride: int = 8,
    block: int = 128,
    scoring: str = "antidiagonal",
    scale: float | None = None,
) -> torch.Tensor:
    """XAttention tile weights (section 2.5): the importance every key tile has for every query tile.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]` (GQA: query head `h` uses KV head `h // G`).
        stride: tokens per group (>= 1; values past `block` mean `block`).
        block: tokens per tile.
        scoring: "antidiagonal" (XAttention) or "naive" (first token of every group).
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        float64 `[B, Hq, T, T]` with `T = ceil(N / block)`: row `i` sums to 1 over the
        causal key tiles `j <= i`; non-causal entries are 0.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k)
    stride, _, block, scoring = check_xattention_params(stride=stride, threshold=1.0, block=block,
                                                        scoring=scoring)
    sm_scale = resolve_scale(scale, shape.head_dim)
    n = shape.seqlen
    scores = stride_scores(q, k, block=block, stride=stride, scoring=scoring, scale=sm_scale)
    # Sec. 2.5 / authors' Alg.: softmax over each query group's visible key groups.
    probs = torch.softmax(scores, dim=-1)
    # Sec. 2.5: sum the stride-level weights into tiles, then per query tile to 1.
    sums = sum_into_tiles(probs, tile_of_groups(n, block=block, stride=stride), cdiv(n, block))
    return normalize_rows(sums)


def select_tiles(weights: torch.Tensor, threshold: PerHead) -> torch.Tensor:
    """Sec. 2.5 / 4.3: greedy threshold selection of tiles, first and diagonal tiles forced.

    Args:
        weights: float `[B, H, T, T]`, rows summing to 1 over the causal tiles `j <= i`.
        threshold: in `(0, 1]`, one for every head or one per head (H values).

    Returns:
        bool `[B, H, T, T]`: per query tile `i`, tile 0, tile `i`, and the other causal
        tiles in descending weight (lower index first at ties) while the weight taken
        before each is below its head's `threshold`; every causal tile where it is 1. A
        NaN weight (NaN in q or k) ranks last and counts as 0.

    Raises:
        TypeError, ValueError: a bad threshold or weights not `[B, H, T, T]`.
    """
    check_knob("threshold", threshold, check_threshold)
    check_weights(weights)
    tau = per_head(threshold, "threshold", weights.shape[1], check_threshold,
                   device=weights.device)[None, :, None, None]
    tiles = weights.shape[-1]
    idx = torch.arange(tiles, device=weights.device)
    causal = idx[None, :] <= idx[:, None]
    forced = (idx[None, :] == 0) | (idx[None, :] == idx[:, None])
    w = torch.where(causal, weights.to(torch.float64), 0.0)
    ranked = torch.where(forced, math.inf, torch.where(causal, rank_nan_last(w), -math.inf))
    w = torch.nan_to_num(w, nan=0.0)
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    taken = torch.gather(w, -1, order)
    before = taken.cumsum(dim=-1) - taken
    # find_blocks_chunked: a tile is kept while the weight taken before it is < tau.
    keep_sorted = torch.gather(forced.expand(w.shape), -1, order) | (before < tau)
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    # A threshold of 1 keeps every causal tile whatever the rounding of the sums.
    return (keep | (tau >= 1.0)) & causal


def tiles_to_plan(keep: torch.Tensor, *, seqlen: int, block: int) -> BlockColumnPlan:
    """A plan listing the kept tiles as key blocks of `block x block`, no columns."""
    return BlockColumnPlan.from_masks(keep, None, seqlen=seqlen, block_m=block, block_n=block)


def xattention_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    stride: int = 8,
    threshold: PerHead = 0.9,
    block: int = 128,
    scoring: str = "antidiagonal",
    scale: float | None = None,
) -> BlockColumnPlan:
    """XAttention plan: tile weights (section 2.5), then `select_tiles`; see the module doc.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`.
        stride: tokens per group (>= 1, past `block` means `block`); XAttention uses 8 or 16.
        threshold: cumulative tile weight to reach per query tile, in `(0, 1]`; a
            scalar, or one per query head (a list or `[Hq]` tensor).
        block: tokens per tile (the plan's `block_m` and `block_n`).
        scoring: "antidiagonal" (XAttention) or "naive" (thesis's ablation).
        scale: softmax scale of the scoring, `1/sqrt(D)` if None.

    Returns:
        A `BlockColumnPlan` without columns, per batch row and query head; where the
        break-even rule is on (`reference.dense_fallback`), the heads it sends dense are
        in `dense_heads`; where the early exit is on too (off by default), a head whose
        last rows already need most tiles for its threshold is left unscored.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k)
    stride, threshold, block, scoring = check_xattention_params(
        stride=stride, threshold=threshold, block=block, scoring=scoring)
    tau = per_head(threshold, "threshold", shape.q_heads, check_threshold, device=q.device)

    def estimate(heads: list[int] | None) -> BlockColumnPlan:
        qs, ks = heads_view(q, k, heads)
        weights = xattention_tile_weights(qs, ks, stride=stride, block=block, scoring=scoring, scale=scale)
        return tiles_to_plan(select_tiles(weights, knob_heads(tau, heads)), seqlen=shape.seqlen, block=block)

    sm_scale = resolve_scale(scale, shape.head_dim)
    return plan_with_fallback(q, k, estimate, rates=active_rates(q), block_m=block, block_n=block,
                              probe=lambda: probe_mass_density(q, k, block_n=block, mass=tau, scale=sm_scale))


def xattention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    stride: int = 8,
    threshold: PerHead = 0.9,
    block: int = 128,
    scoring: str = "antidiagonal",
    scale: float | None = None,
) -> torch.Tensor:
    """XAttention sparse attention through `xattention_plan`.

    Args:
        q: `[B, Hq, N, D]`; k, v: `[B, Hkv, N, D]`.
        stride, threshold, block, scoring, scale: as `xattention_plan` (scale is also
            the attention's softmax scale).

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    plan = xattention_plan(q, k, stride=stride, threshold=threshold, block=block,
                           scoring=scoring, scale=scale)
    return sparse_attention(q, k, v, plan, scale=scale)
