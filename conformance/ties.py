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
* sample-attention: the fast plan must be exactly `merge_index` of the fast
  selection (`fast.sample_attention.sample_attention_selection`), and each kept
  set (column blocks, block diagonals) must be a threshold top-k of the float64
  scores up to `sample_tolerance`: no dropped score above a kept one, the kept mass
  reaching `alpha` of the total, and the set minimal (without its smallest score
  it would not reach `alpha`), each within that tolerance.
"""

from __future__ import annotations

from typing import Any

import torch

from ..fast.sample_attention import sample_attention_selection as fast_selection
from ..fast.vertical_slash import vertical_slash_lines as fast_lines
from ..reference.block_sparse import block_scores, mean_pooling
from ..reference.plan import BlockColumnPlan
from ..reference.sample_attention import (
    merge_index,
    resolve_params,
    sample_attention_scores,
    sampled_rows,
)
from ..reference.vertical_slash import (
    INIT_COLUMNS,
    LOCAL_DIAGONALS,
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


def sample_tolerance(rows: int) -> float:
    """Largest fp32-vs-float64 difference of sampled block scores (and of their sums).

    Scores of one kind sum `rows` probabilities (each sampled row has mass 1); the
    fast scores differed by at most 3.5e-6 in total with 63 rows (interpreter, fp16,
    |q| x 2), so 1e-5 per row leaves ~180x margin.
    """
    return 1e-5 * rows


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


def check_threshold_topk(
    scores: torch.Tensor, kept: torch.Tensor, *, alpha: float, tolerance: float, what: str
) -> None:
    """`kept` is a SampleAttention threshold top-k of `scores` (Alg. 1 lines 6-9), up to ties.

    Args:
        scores: float `[B, H, L]`, non-negative. kept: bool `[B, H, L]`.
        alpha: the CRA threshold. tolerance: the allowed error of a score or a sum.
        what: name for messages.

    Raises:
        AssertionError: a dropped score above a kept one, a kept mass below
            `alpha * total`, or a kept set that still reaches `alpha` without its
            smallest score, each by more than `tolerance`.
    """
    x = scores.to(torch.float64).cpu()
    keep = kept.cpu().bool()
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    total = x.sum(dim=-1)
    mass = torch.where(keep, x, 0.0).sum(dim=-1)
    lowest_kept = torch.where(keep, x, inf).amin(dim=-1)
    highest_dropped = torch.where(~keep, x, -inf).amax(dim=-1)
    checks = (
        (highest_dropped - lowest_kept > tolerance, "a dropped score exceeds a kept one"),
        (mass < alpha * total - tolerance, f"the kept mass does not reach alpha={alpha}"),
        (keep.any(dim=-1) & (mass - lowest_kept >= alpha * total + tolerance),
         f"the kept set reaches alpha={alpha} without its smallest score (not minimal)"),
    )
    for bad, message in checks:
        if bool(bad.any()):
            at = tuple(int(i) for i in bad.nonzero()[0].tolist())
            raise _fail(f"{what} at (b, h) {at}: {message} (kept mass {float(mass[at]):.6g} of "
                        f"{float(total[at]):.6g}, tolerance {tolerance:.3g})")


def sample_attention_tie_check(
    q: torch.Tensor, k: torch.Tensor, params: dict[str, Any], expected: BlockColumnPlan, got: BlockColumnPlan
) -> None:
    """`MethodSpec.tie_check` of sample-attention (see the module doc)."""
    del expected
    n = q.shape[2]
    block_size = int(params.get("block_size", 128))
    columns, slashes = fast_selection(q, k, **params)
    rebuilt = merge_index(columns.cpu(), slashes.cpu(), seqlen=n, block_size=block_size)
    if not rebuilt.equal(got.to("cpu")):
        raise _fail("the fast plan is not merge_index of the fast selection")
    alpha_c, alpha_s, chunk_n = resolve_params(
        n, alpha_c=params.get("alpha_c"), alpha_s=params.get("alpha_s"), chunk_n=params.get("chunk_n"),
        block_size=block_size, settings=params.get("settings"))
    column, slash = sample_attention_scores(q, k, chunk_n=chunk_n, block_size=block_size,
                                            scale=params.get("scale"))
    rows = sum(stop - start for start, stop in sampled_rows(n, chunk_n, block_size))
    tol = sample_tolerance(rows)
    check_threshold_topk(column, columns, alpha=alpha_c, tolerance=tol, what="column blocks")
    check_threshold_topk(slash, slashes, alpha=alpha_s, tolerance=tol, what="slash blocks")
