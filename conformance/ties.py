"""Tie checks: a fast plan that differs from the reference's only where scores tie.

`fast` ranks fp32 scores with `torch.topk`; `reference` ranks float64 scores with a
stable sort (lower index wins). Where two scores are equal, or closer than the
fp32 estimate's rounding, the two may keep different lines or blocks, and both
plans are right. A `tie_check` (see `MethodSpec.tie_check`) shows that this is the
only reason a fast plan differs: it raises AssertionError otherwise.

* vertical-slash: the fast plan must be exactly Alg. 4 of the fast lines
  (`fast.vertical_slash.vertical_slash_lines`), and those lines must be a top-k of
  the float64 scores in which no dropped line beats a kept one by more than
  `line_tolerance`.
* block-sparse: every query block keeps its diagonal and `min(top_k, i + 1)`
  causal blocks, and no dropped block beats a kept one by more than
  `block_tolerance` in the float64 pooled scores.
* XAttention and DPXA (greedy threshold selection, `check_greedy_modulo_ties`): the
  kept tiles are a greedy selection of the float64 tile weights up to
  `tile_weight_tolerance` (order and threshold crossing); DPXA's anchors are
  Delta-KV's stage 1, bit-identical in both packages.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..fast.vertical_slash import vertical_slash_lines as fast_lines
from ..reference.block_sparse import block_scores, mean_pooling
from ..reference.dpxa import anchor_tile_scores, dpxa_anchors
from ..reference.plan import BlockColumnPlan, rank_nan_last
from ..reference.vertical_slash import (
    INIT_COLUMNS,
    LOCAL_DIAGONALS,
    kept_lines,
    vertical_slash_index,
    vertical_slash_scores,
)
from ..reference.xattention import xattention_tile_weights


def line_tolerance(rows: int) -> float:
    """Largest fp32-vs-float64 difference of a vertical or slash score summed over `rows`.

    Scores sum `rows` probabilities; the fast estimate's error was at most 2.2e-6
    for 100 rows (interpreter, fp16 and bf16), so 1e-5 per row leaves ~400x margin.
    """
    return 1e-5 * rows


def block_tolerance(scores: torch.Tensor) -> float:
    """Largest fp32-vs-float64 difference of pooled block scores (relative 1e-4)."""
    finite = scores[torch.isfinite(scores)]
    return 1e-4 * (1.0 + (float(finite.abs().max()) if finite.numel() else 0.0))


def _fail(message: str) -> AssertionError:
    return AssertionError(f"not explained by a tie: {message}")


def check_topk_modulo_ties(
    scores: torch.Tensor, picked: torch.Tensor, *, count: int, forced: int, tolerance: float, what: str
) -> None:
    """`picked` is a top-`count` of `scores` with indices `< forced` kept, up to ties.

    Args:
        scores: float `[B, H, L]`. picked: int `[B, H, count]`, distinct indices.
        count: the expected number of picks. forced: indices always kept.
        tolerance: how much a dropped score may exceed a kept one.
        what: name for messages.

    Raises:
        AssertionError: wrong count, a forced index missing, or a dropped score
            above a kept one by more than `tolerance`.
    """
    if picked.shape[-1] != count:
        raise _fail(f"{what}: {picked.shape[-1]} picked, expected {count}")
    scores = rank_nan_last(scores.to(torch.float64).cpu())
    keep = torch.zeros(scores.shape, dtype=torch.bool).scatter_(-1, picked.cpu().to(torch.int64), True)
    if int(keep.sum(dim=-1).min()) != count:
        raise _fail(f"{what}: picked indices are not distinct")
    is_forced = torch.arange(scores.shape[-1]) < forced
    if not bool(keep[..., is_forced].all()):
        raise _fail(f"{what}: a forced index (< {forced}) is missing")
    free = ~is_forced
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    lowest_kept = torch.where(keep & free, scores, inf).amin(dim=-1)
    highest_dropped = torch.where(~keep & free, scores, -inf).amax(dim=-1)
    gap = highest_dropped - lowest_kept
    if bool((gap > tolerance).any()):
        at = tuple(int(i) for i in (gap > tolerance).nonzero()[0].tolist())
        raise _fail(f"{what} at (b, h) {at}: a dropped score exceeds a kept one by "
                    f"{float(gap[at]):.3g} > {tolerance:.3g}")


def vertical_slash_tie_check(
    q: torch.Tensor, k: torch.Tensor, params: dict[str, Any], expected: BlockColumnPlan, got: BlockColumnPlan
) -> None:
    """`MethodSpec.tie_check` of vertical-slash (see the module doc)."""
    del expected
    n = q.shape[2]
    init_columns = int(params.get("init_columns", INIT_COLUMNS))
    local_diagonals = int(params.get("local_diagonals", LOCAL_DIAGONALS))
    last_q = int(params.get("last_q", 64))
    scale = params.get("scale")
    verticals, slashes = fast_lines(
        q, k, vertical_size=params["vertical_size"], slash_size=params["slash_size"],
        last_q=last_q, init_columns=init_columns, local_diagonals=local_diagonals, scale=scale,
    )
    rebuilt = vertical_slash_index(
        verticals.cpu(), slashes.cpu(), seqlen=n, block_m=int(params.get("block_m", 64)),
        block_n=int(params.get("block_n", 64)),
    )
    if not rebuilt.equal(got.to("cpu")):
        raise _fail("the fast plan is not Alg. 4 of the fast lines")
    vertical, slash = vertical_slash_scores(q, k, last_q=last_q, scale=scale)
    tol = line_tolerance(min(last_q, n))
    check_topk_modulo_ties(vertical, verticals, count=kept_lines(params["vertical_size"], init_columns, n),
                           forced=init_columns, tolerance=tol, what="verticals")
    check_topk_modulo_ties(slash, slashes, count=kept_lines(params["slash_size"], local_diagonals, n),
                           forced=local_diagonals, tolerance=tol, what="slashes")


def block_sparse_tie_check(
    q: torch.Tensor, k: torch.Tensor, params: dict[str, Any], expected: BlockColumnPlan, got: BlockColumnPlan
) -> None:
    """`MethodSpec.tie_check` of block-sparse (see the module doc)."""
    del expected
    top_k = int(params["top_k"])
    bs = int(params.get("block_size", 64))
    got = got.to("cpu").validate()
    if bool((got.column_count != 0).any()):
        raise _fail("block-sparse plans list no columns")
    scores = rank_nan_last(block_scores(mean_pooling(q, bs), mean_pooling(k, bs)).cpu())
    nb = scores.shape[-1]
    keep = got.block_mask()
    diagonal = torch.eye(nb, dtype=torch.bool)
    if not bool(keep[..., diagonal].all()):
        raise _fail("a diagonal block is missing")
    want = torch.clamp(torch.arange(1, nb + 1), max=top_k)
    if not torch.equal(keep.sum(dim=-1), want.expand(keep.shape[:-1])):
        raise _fail(f"block counts differ from min(top_k={top_k}, i + 1)")
    causal = torch.ones(nb, nb, dtype=torch.bool).tril_()
    free = causal & ~diagonal
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    lowest_kept = torch.where(keep & free, scores, inf).amin(dim=-1)
    highest_dropped = torch.where(~keep & free, scores, -inf).amax(dim=-1)
    gap = highest_dropped - lowest_kept
    tol = block_tolerance(scores)
    if bool((gap > tol).any()):
        at = tuple(int(i) for i in (gap > tol).nonzero()[0].tolist())
        raise _fail(f"blocks at (b, h, query block) {at}: a dropped score exceeds a kept one by "
                    f"{float(gap[at]):.3g} > {tol:.3g}")


# -- XAttention / DPXA: greedy threshold selection of tiles ----------------------


def tile_weight_tolerance(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> float:
    """Largest fp32-vs-float64 difference of a normalised tile weight or a sum of them.

    The fast scores round fp32 sums of exact fp32 products, so a logit is off by about
    `1e-7` of the largest possible logit `L = scale * max|q_i| * max|k_j|` (all the
    kernels' arithmetic is relative to it); a weight `w` then by about `w * 1e-7 * L`,
    and a cumulative sum of weights by the same amount. `1e-5 * (1 + L)` leaves ~100x.
    """
    d = q.shape[-1]
    sm_scale = scale if scale is not None else d ** -0.5
    q_max = float(q.to(torch.float64).norm(dim=-1).max())
    k_max = float(k.to(torch.float64).norm(dim=-1).max())
    return 1e-5 * (1.0 + sm_scale * q_max * k_max)


def check_greedy_modulo_ties(
    weights: torch.Tensor, keep: torch.Tensor, *, threshold: float, tolerance: float, what: str
) -> None:
    """`keep` is the greedy threshold selection of `weights` up to ties and rounding.

    Per query tile `i`: tile 0 and tile `i` are kept, nothing non-causal is; no dropped
    tile outweighs a kept free tile by more than `tolerance`; the kept weight reaches
    `threshold` (less `tolerance`) unless every causal tile is kept; and without its
    lightest free tile it stays below `threshold` (plus `tolerance`), so no tile was
    kept once the threshold was reached. `threshold == 1` must keep every causal tile.

    Args:
        weights: float64 `[B, H, T, T]`, rows summing to 1 over `j <= i`.
        keep: bool `[B, H, T, T]`.

    Raises:
        AssertionError: naming the first (b, h, query tile) that breaks a rule.
    """
    weights = weights.to(torch.float64).cpu()
    keep = keep.cpu()
    tiles = weights.shape[-1]
    idx = torch.arange(tiles)
    causal = idx[None, :] <= idx[:, None]
    forced = (idx[None, :] == 0) | (idx[None, :] == idx[:, None])
    free = causal & ~forced

    def first(bad: torch.Tensor, message: str) -> None:
        if bool(bad.any()):
            at = tuple(int(i) for i in bad.nonzero()[0].tolist())
            raise _fail(f"{what} at (b, h, query tile) {at[:3]}: {message}")

    first((keep & ~causal).any(-1), "a non-causal tile is kept")
    first((forced & ~keep).any(-1), "the first or the diagonal tile is missing")
    if threshold >= 1.0:
        first((causal & ~keep).any(-1), "threshold 1 must keep every causal tile")
        return
    inf = torch.tensor(math.inf, dtype=torch.float64)
    kept_free = keep & free
    dropped = free & ~keep
    lightest_kept = torch.where(kept_free, weights, inf).amin(-1)
    heaviest_dropped = torch.where(dropped, weights, -inf).amax(-1)
    first(heaviest_dropped - lightest_kept > tolerance,
          f"a dropped tile outweighs a kept one by more than {tolerance:.3g}")
    total = torch.where(keep, weights, 0.0).sum(-1)
    first(dropped.any(-1) & (total < threshold - tolerance),
          f"tiles were dropped before the kept weight reached threshold {threshold}")
    without_last = total - torch.where(kept_free.any(-1), lightest_kept, 0.0)
    first(kept_free.any(-1) & (without_last >= threshold + tolerance),
          f"a tile was kept after the kept weight had reached threshold {threshold}")


def xattention_tie_check(
    q: torch.Tensor, k: torch.Tensor, params: dict[str, Any], expected: BlockColumnPlan, got: BlockColumnPlan
) -> None:
    """`MethodSpec.tie_check` of XAttention: the fast tiles are a greedy selection of the
    float64 tile weights, up to `tile_weight_tolerance`."""
    del expected
    got = got.to("cpu").validate()
    if bool((got.column_count != 0).any()):
        raise _fail("XAttention plans list no columns")
    scale = params.get("scale")
    weights = xattention_tile_weights(
        q, k, stride=int(params.get("stride", 8)), block=int(params.get("block", 128)),
        scoring=str(params.get("scoring", "antidiagonal")), scale=scale,
    )
    check_greedy_modulo_ties(weights, got.block_mask(), threshold=float(params.get("threshold", 0.9)),
                             tolerance=tile_weight_tolerance(q, k, scale), what="xattention tiles")


def dpxa_tie_check(
    q: torch.Tensor, k: torch.Tensor, params: dict[str, Any], expected: BlockColumnPlan, got: BlockColumnPlan
) -> None:
    """`MethodSpec.tie_check` of DPXA: the fast tiles are a greedy selection of the
    float64 tile weights, up to `tile_weight_tolerance` (the anchors are the same in both
    packages: Delta-KV's stage 1, bit-identical)."""
    del expected
    got = got.to("cpu").validate()
    if bool((got.column_count != 0).any()):
        raise _fail("DPXA plans list no columns")
    cos_threshold = float(params.get("cos_threshold", 0.75))
    block = int(params.get("block", 128))
    scale = params.get("scale")
    q_anchors = dpxa_anchors(q, cos_threshold=cos_threshold, block=block).cpu()
    k_anchors = dpxa_anchors(k, cos_threshold=cos_threshold, block=block).cpu()
    sm_scale = scale if scale is not None else q.shape[-1] ** -0.5
    scores = anchor_tile_scores(q.cpu(), k.cpu(), q_anchors, k_anchors, block=block, scale=sm_scale)
    weights = scores / scores.sum(dim=-1, keepdim=True)
    check_greedy_modulo_ties(weights, got.block_mask(), threshold=float(params.get("threshold", 0.9)),
                             tolerance=tile_weight_tolerance(q, k, scale), what="dpxa tiles")
