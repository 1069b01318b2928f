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
* cumulative thresholds (FlexPrefill-style vertical-slash, SharePrefill's pivots):
  the fast plan must be exactly the index of the fast selection, and that selection
  must be a valid `cover_threshold` of the float64 shares up to `share_tolerance`
  per entry and `mass_tolerance` on the cumulative share (`check_cover_modulo_ties`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..fast.flexprefill_vs import flexprefill_vs_lines as fast_flex_lines
from ..fast.vertical_slash import vertical_slash_lines as fast_lines
from ..reference._checks import resolve_scale
from ..reference.block_sparse import block_scores, mean_pooling
from ..reference.flexprefill_vs import (
    GAMMA,
    first_lines,
    lines_index,
    normalized_lines,
)
from ..reference.plan import BlockColumnPlan
from ..reference.vertical_slash import (
    INIT_COLUMNS,
    LOCAL_DIAGONALS,
    approximate_attention,
    kept_lines,
    vertical_slash_index,
    vertical_slash_scores,
)


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
    scores = scores.to(torch.float64).cpu()
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
    scores = block_scores(mean_pooling(q, bs), mean_pooling(k, bs)).cpu()
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


# Shares (entries of a distribution summing to 1) from the fp32 estimate differ from the
# float64 ones by at most ~1e-6 (measured: 4e-7 on SmolLM2 8K and random inputs);
# cumulative shares by at most the sum of those errors. Both margins leave >10x room.
SHARE_TOLERANCE = 1e-5
MASS_TOLERANCE = 1e-4


def check_cover_modulo_ties(
    scores: torch.Tensor,
    kept: torch.Tensor,
    *,
    gamma: float,
    forced: torch.Tensor,
    share_tolerance: float = SHARE_TOLERANCE,
    mass_tolerance: float = MASS_TOLERANCE,
    what: str,
) -> None:
    """`kept` is a valid `cover_threshold(scores, gamma, forced)` up to rounding.

    Valid means: every forced entry is kept; no dropped entry beats a kept unforced
    one by more than `share_tolerance`; dropping the smallest kept unforced entry
    would leave less than `gamma + mass_tolerance`; and if any unforced entry is
    dropped, the kept share is at least `gamma - mass_tolerance`.

    Args:
        scores: float `[..., L]` shares (float64 from the reference).
        kept: bool `[..., L]` selection to judge.
        gamma: the threshold. forced: bool broadcastable to `scores`.
        share_tolerance, mass_tolerance: the rounding margins.
        what: name for messages.

    Raises:
        AssertionError: naming the first (leading index) that breaks a condition.
    """
    scores = scores.to(torch.float64).cpu()
    kept = kept.cpu()
    forced = forced.cpu().expand(scores.shape)
    inf = torch.tensor(math.inf, dtype=torch.float64)
    checks = [
        ((forced & ~kept).any(dim=-1), "a forced entry is missing"),
    ]
    free_kept = kept & ~forced
    free_dropped = ~kept & ~forced
    lowest_kept = torch.where(free_kept, scores, inf).amin(dim=-1)
    highest_dropped = torch.where(free_dropped, scores, -inf).amax(dim=-1)
    checks.append((highest_dropped - lowest_kept > share_tolerance,
                   f"a dropped share exceeds a kept one by more than {share_tolerance:.1e}"))
    mass = torch.where(kept, scores, 0.0).sum(dim=-1)
    needed = free_kept.any(dim=-1) & (mass - lowest_kept >= gamma + mass_tolerance)
    checks.append((needed, f"the smallest kept entry was not needed to reach gamma={gamma}"))
    short = free_dropped.any(dim=-1) & (mass < gamma - mass_tolerance)
    checks.append((short, f"the kept share stays below gamma={gamma} while entries are dropped"))
    for bad, message in checks:
        if bool(bad.any()):
            at = tuple(int(i) for i in bad.nonzero()[0].tolist())
            raise _fail(f"{what} at {at}: {message} (kept share {float(mass[at]):.8f})")


def flexprefill_vs_tie_check(
    q: torch.Tensor, k: torch.Tensor, params: dict[str, Any], expected: BlockColumnPlan, got: BlockColumnPlan
) -> None:
    """`MethodSpec.tie_check` of the FlexPrefill-style vertical-slash (see the module doc)."""
    del expected
    n = q.shape[2]
    gamma = float(params.get("gamma", GAMMA))
    last_q = int(params.get("last_q", 64))
    init_columns = int(params.get("init_columns", 1))
    local_diagonals = int(params.get("local_diagonals", 1))
    scale = params.get("scale")
    verticals, slashes = fast_flex_lines(q, k, gamma=gamma, last_q=last_q, init_columns=init_columns,
                                         local_diagonals=local_diagonals, scale=scale)
    rebuilt = lines_index(verticals.cpu(), slashes.cpu(), block_m=int(params.get("block_m", 64)),
                          block_n=int(params.get("block_n", 64)))
    if not rebuilt.equal(got.to("cpu")):
        raise _fail("the fast plan is not Alg. 4 of the fast lines")
    a_hat = approximate_attention(q, k, last_q=last_q, scale=resolve_scale(scale, q.shape[-1]))
    a_v, a_s = normalized_lines(a_hat)
    cpu = torch.device("cpu")
    check_cover_modulo_ties(a_v, verticals, gamma=gamma, forced=first_lines(init_columns, n, cpu),
                            what="verticals")
    check_cover_modulo_ties(a_s, slashes, gamma=gamma, forced=first_lines(local_diagonals, n, cpu),
                            what="slashes")
