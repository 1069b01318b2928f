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
* SharePrefill: the fast head decisions must be a valid outcome of Alg. 3/4 under
  the float64 distances, where a distance within `DISTANCE_MARGIN` of its threshold
  may go either way (`check_decisions_modulo_margin`); the fast plan must be the
  reference's plan of the fast decisions and fast Alg. 5 lines, those lines valid as
  below, and pivots valid cumulative selections of the float64 block attention.
* cumulative thresholds (FlexPrefill-style vertical-slash, SharePrefill's pivots):
  the fast plan must be exactly the index of the fast selection, and that selection
  must be a valid `cover_threshold` of the float64 shares up to `share_tolerance`
  per entry and `mass_tolerance` on the cumulative share (`check_cover_modulo_ties`).
* XAttention and DPXA (greedy threshold selection, `check_greedy_modulo_ties`): the
  kept tiles are a greedy selection of the float64 tile weights up to
  `tile_weight_tolerance` (order and threshold crossing); DPXA's anchors are
  Delta-KV's stage 1, bit-identical in both packages.
* anchor attention (thresholds, not top-k): the anchor blocks must be exactly
  Alg. 1's, and a stripe key may differ between the plans only where, for some
  query block of its group, the float64 difference `avgpool(x_a) - s` lies within
  `anchor_margin` of `theta`.
* sample-attention: the fast plan must be exactly `merge_index` of the fast
  selection (`fast.sample_attention.sample_attention_selection`), and each kept
  set (column blocks, block diagonals) must be a threshold top-k of the float64
  scores up to `sample_tolerance`: no dropped score above a kept one, the kept mass
  reaching `alpha` of the total, and the set minimal (without its smallest score
  it would not reach `alpha`), each within that tolerance.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..fast.flexprefill_vs import flexprefill_vs_lines as fast_flex_lines
from ..fast.sample_attention import sample_attention_selection as fast_selection
from ..fast.shareprefill import decide_layer as fast_decide
from ..fast.shareprefill import fallback_lines as fast_fallback_lines
from ..fast.vertical_slash import vertical_slash_lines as fast_lines
from ..reference._checks import per_head, resolve_scale
from ..reference.anchor_attention import (
    STEP,
    THETA,
    anchor_blocks,
    anchor_scores,
    group_stripes,
    pooled_anchor,
    search_region,
    stripe_scores,
)
from ..reference.block_sparse import block_scores, mean_pooling
from ..reference.flexprefill_vs import (
    GAMMA,
    LINE_BLOCK,
    band_lines,
    first_lines,
    lines_index,
    normalized_lines,
    pool_lines,
)
from ..reference.flexprefill_vs import flexprefill_vs_lines as reference_flex_lines
from ..reference.dpxa import anchor_tile_scores, dpxa_anchors
from ..reference.plan import BlockColumnPlan, cdiv, rank_nan_last
from ..reference.sample_attention import (
    merge_index,
    resolve_params,
    sample_attention_scores,
    sampled_rows,
)
from ..reference.shareprefill import (
    NOISE,
    LayerDecision,
    Pivot,
    SharePattern,
    SharePrefillState,
    diagonal_blocks,
    layer_masks,
)
from ..reference.shareprefill import decide_layer as ref_decide
from ..reference.vertical_slash import (
    INIT_COLUMNS,
    LOCAL_DIAGONALS,
    approximate_attention,
    line_counts,
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
    scores: torch.Tensor, picked: torch.Tensor, *, count: int | torch.Tensor, forced: int, tolerance: float,
    what: str
) -> None:
    """`picked` is a top-`count` of `scores` with indices `< forced` kept, up to ties.

    Args:
        scores: float `[B, H, L]`. picked: int `[B, H, count]`, distinct indices (per-head
            counts: `[B, H, max count]`, each head's list padded with L).
        count: the expected number of picks, an int or int64 `[H]` per head.
        forced: indices always kept.
        tolerance: how much a dropped score may exceed a kept one.
        what: name for messages.

    Raises:
        AssertionError: wrong count, a forced index missing, or a dropped score
            above a kept one by more than `tolerance`.
    """
    counts = torch.as_tensor(count, dtype=torch.int64).cpu().expand(scores.shape[1])
    width = int(counts.max()) if counts.numel() else 0
    if picked.shape[-1] != width:
        raise _fail(f"{what}: {picked.shape[-1]} picked, expected {width}")
    scores = rank_nan_last(scores.to(torch.float64).cpu())
    b, h, length = scores.shape
    keep = torch.zeros(b, h, length + 1, dtype=torch.bool).scatter_(-1, picked.cpu().to(torch.int64), True)
    keep = keep[..., :length]
    if not torch.equal(keep.sum(dim=-1), counts.expand(b, h)):
        raise _fail(f"{what}: picked indices are not distinct, or not {count} per head")
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


def vertical_slash_lines_check(
    q: torch.Tensor, k: torch.Tensor, params: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`Checks.lines_check` of vertical-slash: the fast lines are the top-k of the float64
    scores with the forced first columns and nearest diagonals, modulo exact ties.

    Returns:
        The fast (verticals, slashes), for the tie check to rebuild the plan from.
    """
    n = q.shape[2]
    init_columns = int(params.get("init_columns", INIT_COLUMNS))
    local_diagonals = int(params.get("local_diagonals", LOCAL_DIAGONALS))
    last_q = int(params.get("last_q", 64))
    scale = params.get("scale")
    verticals, slashes = fast_lines(
        q, k, vertical_size=params["vertical_size"], slash_size=params["slash_size"],
        last_q=last_q, init_columns=init_columns, local_diagonals=local_diagonals, scale=scale,
    )
    vertical, slash = vertical_slash_scores(q, k, last_q=last_q, scale=scale)
    tol = line_tolerance(min(last_q, n))
    hq, cpu = q.shape[1], torch.device("cpu")
    check_topk_modulo_ties(vertical, verticals,
                           count=line_counts(params["vertical_size"], init_columns, n, "vertical_size", hq, cpu),
                           forced=init_columns, tolerance=tol, what="verticals")
    check_topk_modulo_ties(slash, slashes,
                           count=line_counts(params["slash_size"], local_diagonals, n, "slash_size", hq, cpu),
                           forced=local_diagonals, tolerance=tol, what="slashes")
    return verticals, slashes


def vertical_slash_tie_check(
    q: torch.Tensor, k: torch.Tensor, params: dict[str, Any], expected: BlockColumnPlan, got: BlockColumnPlan
) -> None:
    """`MethodSpec.tie_check` of vertical-slash (see the module doc)."""
    del expected
    verticals, slashes = vertical_slash_lines_check(q, k, params)
    rebuilt = vertical_slash_index(
        verticals.cpu(), slashes.cpu(), seqlen=q.shape[2], block_m=int(params.get("block_m", 64)),
        block_n=int(params.get("block_n", 64)),
    )
    if not rebuilt.equal(got.to("cpu")):
        raise _fail("the fast plan is not Alg. 4 of the fast lines")


def block_sparse_tie_check(
    q: torch.Tensor, k: torch.Tensor, params: dict[str, Any], expected: BlockColumnPlan, got: BlockColumnPlan
) -> None:
    """`MethodSpec.tie_check` of block-sparse (see the module doc)."""
    del expected
    top_k = _heads(params["top_k"], q.shape[1]).to(torch.int64)  # per query head
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
    want = torch.minimum(torch.arange(1, nb + 1), top_k[:, None])
    if not torch.equal(keep.sum(dim=-1), want.expand(keep.shape[:-1])):
        raise _fail(f"block counts differ from min(top_k={top_k.tolist()}, i + 1)")
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
    gamma: float | torch.Tensor,
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
        gamma: the threshold: a float, or a tensor broadcastable to `scores.shape[:-1]`
            (per head). forced: bool broadcastable to `scores`.
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
    """`MethodSpec.tie_check` of the FlexPrefill-style vertical-slash (see the module doc).

    Both plans are judged against Alg. 5's definition (float64 shares of this call, the
    forced first `init_columns` columns and `local_diagonals` diagonals): the fast plan
    is Alg. 4 of the fast lines, the reference plan Alg. 4 of the reference lines, and
    both line sets are valid covers up to rounding. So a difference caused by a bug in
    the reference (its forced counts, scale, block lists) fails here instead of being
    forgiven as a tie.
    """
    n = q.shape[2]
    gamma = params.get("gamma", GAMMA)
    heads_gamma = _heads(gamma, q.shape[1])
    last_q = int(params.get("last_q", 64))
    init_columns = int(params.get("init_columns", 1))
    local_diagonals = int(params.get("local_diagonals", 1))
    line_block = int(params.get("line_block", LINE_BLOCK))
    scale = params.get("scale")

    def alg4(v: torch.Tensor, s: torch.Tensor) -> BlockColumnPlan:
        return lines_index(v.cpu(), s.cpu(), block_m=int(params.get("block_m", 64)),
                           block_n=int(params.get("block_n", 64)), line_block=line_block)

    verticals, slashes = fast_flex_lines(q, k, gamma=gamma, last_q=last_q, init_columns=init_columns,
                                         local_diagonals=local_diagonals, line_block=line_block, scale=scale)
    if not alg4(verticals, slashes).equal(got.to("cpu")):
        raise _fail("the fast plan is not Alg. 4 of the fast lines")
    a_hat = approximate_attention(q, k, last_q=last_q, scale=resolve_scale(scale, q.shape[-1]))
    a_v, a_s = normalized_lines(a_hat)
    cpu = torch.device("cpu")
    ref_v, ref_s = reference_flex_lines(q, k, gamma=gamma, last_q=last_q, init_columns=init_columns,
                                        local_diagonals=local_diagonals, line_block=line_block, scale=scale)
    if not alg4(ref_v, ref_s).equal(expected.to("cpu")):
        raise _fail("the reference plan is not Alg. 4 of the reference lines")
    nb = cdiv(n, line_block)
    # Both line sets must be covers; the cover is judged over bands (a band's first line
    # stands for it; line_block = 1: single lines, Alg. 5).
    for who, v_lines, s_lines in (("fast", verticals, slashes), ("reference", ref_v, ref_s)):
        for shares, kept, forced_lines, what in ((a_v, v_lines, init_columns, "verticals"),
                                                 (a_s, s_lines, local_diagonals, "slashes")):
            bands = kept.cpu()[..., ::line_block]
            if not torch.equal(band_lines(bands, line_block, n), kept.cpu()):
                raise _fail(f"the {who} {what} are not whole bands of line_block={line_block} lines")
            check_cover_modulo_ties(pool_lines(shares, line_block), bands, gamma=heads_gamma,
                                    forced=first_lines(cdiv(forced_lines, line_block), nb, cpu),
                                    what=f"{who} {what}")


# Distances of the fp32-pooled estimate differ from the float64 ones by at most ~1e-7
# (SmolLM2 layers and random inputs); a decision whose distance lies within this margin of
# its threshold may go either way.
DISTANCE_MARGIN = 1e-4


def check_decisions_modulo_margin(
    state: SharePrefillState,
    got: torch.Tensor,
    d_sparse: torch.Tensor,
    d_sim: torch.Tensor,
    *,
    layer: int,
    margin: float = DISTANCE_MARGIN,
) -> None:
    """`got` (int8 `[B, Hq]` patterns) is what Alg. 3/4 may decide under float64 distances.

    Replays `reference.shareprefill.choose_patterns` head by head with `state`'s
    pivots; where `d_sparse` or `d_sim` lies within `margin` of its threshold, both
    outcomes of that test are allowed, and the replay follows `got`'s choice (so a
    different first dense head of a cluster is judged consistently).

    Raises:
        AssertionError: naming the (batch row, head) whose pattern no outcome explains.
    """
    got, d_sparse, d_sim = got.cpu(), d_sparse.cpu(), d_sim.cpu()
    b, hq = got.shape

    def outcomes(value: float, threshold: float) -> set[bool]:
        if abs(value - threshold) <= margin:
            return {True, False}
        return {value < threshold}

    for row in range(b):
        dense_now: set[int] = set()
        for h in range(hq):
            c = state.cluster(layer, h)
            pick = SharePattern(int(got[row, h]))
            allowed: set[SharePattern] = set()
            if c == NOISE:
                allowed = {SharePattern.VERTICAL_SLASH}
            else:
                sparse_ok = outcomes(float(d_sparse[row, h]), state.head_value("delta", h))
                if state.pivot(c, row) is None:
                    first = c not in dense_now
                    allowed = {SharePattern.DENSE if ok and first else SharePattern.VERTICAL_SLASH
                               for ok in sparse_ok}
                else:
                    sim_ok = outcomes(float(d_sim[row, h]), state.head_value("tau", h))
                    allowed = {SharePattern.SHARED if a and s else SharePattern.VERTICAL_SLASH
                               for a in sparse_ok for s in sim_ok}
            if pick not in allowed:
                raise _fail(f"layer {layer} (batch row, head) ({row}, {h}), cluster {c}: pattern "
                            f"{pick.name}, allowed {sorted(p.name for p in allowed)} (d_sparse "
                            f"{float(d_sparse[row, h]):.6f}, d_sim {float(d_sim[row, h]):.6f})")
            if pick == SharePattern.DENSE:
                dense_now.add(c)


def check_pivot_modulo_ties(block_means: torch.Tensor, pivot: Pivot, *, gamma: float, seqlen: int,
                            block_m: int, block_n: int, what: str) -> None:
    """A fast pivot's mask is a valid Alg. 2 selection of the reference's block means.

    Args:
        block_means: float `[Qb, Kb]`, the reference's block means of the dense head.
        pivot: the fast `Pivot`.

    Raises:
        AssertionError: the mask is no cumulative selection up to rounding.
    """
    a_block = torch.softmax(block_means.to(torch.float64).cpu(), dim=-1)
    flat = (a_block / a_block.sum()).flatten()
    forced = diagonal_blocks(seqlen, block_m, block_n, torch.device("cpu")).flatten()
    # Block means carry fp32 accumulation error (tolerance.BLOCK_MEAN_REL): relative shares.
    check_cover_modulo_ties(flat, pivot.mask.cpu().flatten(), gamma=gamma, forced=forced,
                            share_tolerance=SHARE_TOLERANCE * float(flat.max()), what=what)


def _share_state_args(params: dict[str, Any]) -> dict[str, Any]:
    keys = ("layout", "tau", "delta", "gamma", "block_m", "block_n", "init_columns", "local_diagonals")
    return {key: params[key] for key in keys if key in params}


def shareprefill_lines_check(
    q: torch.Tensor, k: torch.Tensor, params: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`Checks.lines_check` of SharePrefill: the fast layer's Alg. 5 fallback lines
    (`fast.shareprefill.fallback_lines`, every head) are covers of the float64 shares of
    the last `block_m` queries with the forced lines, modulo ties.

    Returns:
        The fast (verticals, slashes).
    """
    state = SharePrefillState(**_share_state_args(params))
    scale = resolve_scale(params.get("scale"), q.shape[-1])
    verticals, slashes = fast_fallback_lines(q, k, state, scale=scale)
    a_v, a_s = normalized_lines(approximate_attention(q, k, last_q=state.block_m, scale=scale))
    n, cpu = q.shape[2], torch.device("cpu")
    gamma = _heads(state.gamma, q.shape[1])
    check_cover_modulo_ties(a_v, verticals.cpu(), gamma=gamma,
                            forced=first_lines(state.init_columns, n, cpu), what="verticals")
    check_cover_modulo_ties(a_s, slashes.cpu(), gamma=gamma,
                            forced=first_lines(state.local_diagonals, n, cpu), what="slashes")
    return verticals, slashes


def shareprefill_tie_check(
    q: torch.Tensor, k: torch.Tensor, params: dict[str, Any], expected: BlockColumnPlan, got: BlockColumnPlan
) -> None:
    """`MethodSpec.tie_check` of SharePrefill's one-layer plan (see the module doc)."""
    del expected
    state_args = _share_state_args(params)
    layer = int(params.get("layer", 0))
    scale = resolve_scale(params.get("scale"), q.shape[-1])
    ref_state = SharePrefillState(**state_args)
    ref_decision = ref_decide(q, k, ref_state, layer=layer, scale=scale)
    fast_state = SharePrefillState(**state_args)
    fast_decision = fast_decide(q, k, fast_state, layer=layer, scale=scale)
    # Judge against the state as it was before the layer (here: fresh).
    ref_state = SharePrefillState(**state_args)
    check_decisions_modulo_margin(ref_state, fast_decision.pattern, ref_decision.d_sparse,
                                  ref_decision.d_sim, layer=layer)
    verticals, slashes = shareprefill_lines_check(q, k, params)
    cpu_decision = LayerDecision(layer=layer, pattern=fast_decision.pattern.cpu(),
                                        d_sparse=fast_decision.d_sparse.cpu(),
                                        d_sim=fast_decision.d_sim.cpu(), cluster=fast_decision.cluster.cpu())
    blocks, columns = layer_masks(verticals.cpu(), slashes.cpu(), ref_state, cpu_decision)
    rebuilt = BlockColumnPlan.from_masks(blocks, columns, seqlen=q.shape[2], block_m=ref_state.block_m,
                                         block_n=ref_state.block_n)
    if not rebuilt.equal(got.to("cpu")):
        raise _fail("the fast plan is not the plan of the fast decisions and Alg. 5 lines")


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


def _heads(value: object, heads: int) -> torch.Tensor:
    """A checked knob (a scalar or one value per head) as float64 `[heads]` on the CPU."""
    def as_float(x: object) -> float:
        assert isinstance(x, (int, float))
        return float(x)
    return per_head(value, "knob", heads, as_float)


def check_greedy_modulo_ties(
    weights: torch.Tensor, keep: torch.Tensor, *, threshold: object, tolerance: float, what: str
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
        threshold: one for every head, or one per head (H values).

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
    tau = _heads(threshold, weights.shape[1])[None, :, None]  # [1, H, 1] against rows [B, H, T]
    full = tau >= 1.0
    first(full & (causal & ~keep).any(-1), "threshold 1 must keep every causal tile")
    inf = torch.tensor(math.inf, dtype=torch.float64)
    kept_free = keep & free
    dropped = free & ~keep
    lightest_kept = torch.where(kept_free, weights, inf).amin(-1)
    heaviest_dropped = torch.where(dropped, weights, -inf).amax(-1)
    first(~full & (heaviest_dropped - lightest_kept > tolerance),
          f"a dropped tile outweighs a kept one by more than {tolerance:.3g}")
    total = torch.where(keep, weights, 0.0).sum(-1)
    first(~full & dropped.any(-1) & (total < tau - tolerance),
          f"tiles were dropped before the kept weight reached threshold {threshold}")
    without_last = total - torch.where(kept_free.any(-1), lightest_kept, 0.0)
    first(~full & kept_free.any(-1) & (without_last >= tau + tolerance),
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
    check_greedy_modulo_ties(weights, got.block_mask(), threshold=params.get("threshold", 0.9),
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
    check_greedy_modulo_ties(weights, got.block_mask(), threshold=params.get("threshold", 0.9),
                             tolerance=tile_weight_tolerance(q, k, scale), what="dpxa tiles")
# Relative error budget of the fast anchor path's decision quantity (see `anchor_margin`).
ANCHOR_RELATIVE_MARGIN = 2.0**-12


def anchor_margin(
    q: torch.Tensor, k: torch.Tensor, anchor_mean: torch.Tensor, q_mean: torch.Tensor, *,
    block_m: int, scale: float,
) -> torch.Tensor:
    """How far the fast path's `avgpool(x_a) - s` may be from the float64 one: `[B, Hq, Qb, N]`.

    `2**-12 * (1 + |avgpool(x_a)_i| + scale * (sum_d |avgpool(Q)_id k_jd|
    + max_r |q_r| max_j |k_j|))`, rows `r` of query block `i`, keys `j` of the head.
    The fast errors it covers, all far below 2**-12 relative: the anchors are the
    kernel's fp32 running max of fp32-accumulated products of 16-bit inputs (about
    `D * 2**-24` of `scale |q_r| |k_j|`, plus a few ulps of the log2/ln conversion);
    the pooled means are fp32 sums; the pooled query enters the dot product as two
    16-bit parts (2**-16 of it for bf16, 2**-22 for fp16) with fp32 accumulation.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qb = q_mean.shape[2]
    k64 = k.to(torch.float64)
    abs_dot = torch.matmul(q_mean.abs().reshape(b, hkv, g, qb, d),
                           k64.abs().unsqueeze(2).transpose(-1, -2)).reshape(b, hq, qb, n)
    q_norm = torch.zeros(b, hq, qb * block_m, dtype=torch.float64, device=q.device)
    q_norm[:, :, :n] = q.to(torch.float64).norm(dim=-1)
    row_max = q_norm.reshape(b, hq, qb, block_m).amax(dim=-1)
    k_max = k64.norm(dim=-1).amax(dim=-1).repeat_interleave(g, dim=1)  # [B, Hq]
    bound: torch.Tensor = 1.0 + anchor_mean.abs() + scale * row_max * k_max[:, :, None]
    margin: torch.Tensor = ANCHOR_RELATIVE_MARGIN * (bound.unsqueeze(-1) + scale * abs_dot)
    return margin


def anchor_attention_tie_check(
    q: torch.Tensor, k: torch.Tensor, params: dict[str, Any], expected: BlockColumnPlan, got: BlockColumnPlan
) -> None:
    """`MethodSpec.tie_check` of anchor attention (see the module doc)."""
    from ..reference.block_sparse import mean_pooling

    theta = _heads(params.get("theta", THETA), q.shape[1])[:, None, None]  # [Hq, 1, 1] per query head
    step = int(params.get("step", STEP))
    bm, bn = int(params.get("block_m", 128)), int(params.get("block_n", 128))
    q, k = q.cpu(), k.cpu()
    scale = resolve_scale(params.get("scale"), q.shape[-1])
    got = got.to("cpu").validate()
    n = q.shape[2]
    if got.column_group != step or not got.columns_disjoint:
        raise _fail(f"column_group {got.column_group} (want step={step}), columns_disjoint "
                    f"{got.columns_disjoint} (want True)")
    blocks = anchor_blocks(n, step=step, block_m=bm, block_n=bn)
    if not torch.equal(got.block_mask(), blocks.expand_as(got.block_mask())):
        raise _fail("the anchor blocks are not Alg. 1's")
    # Every query block reads its group's whole list.
    qb = cdiv(n, bm)
    groups = cdiv(qb, step)
    owner = torch.arange(qb) // step
    lists = got.column_index.to(torch.int64)
    width = lists.shape[-1]
    group_count = torch.zeros(*got.column_count.shape[:2], groups, dtype=torch.int32)
    group_count.scatter_reduce_(2, owner.expand_as(got.column_count), got.column_count, "amax")
    if not torch.equal(got.column_count, group_count[:, :, owner]):
        raise _fail("the query blocks of a group do not all read their group's whole stripe list")
    valid = torch.arange(width) < group_count.unsqueeze(-1)
    got_sets = torch.zeros(*group_count.shape, n + 1, dtype=torch.bool)
    got_sets.scatter_(3, torch.where(valid, lists, n), True)
    got_sets = got_sets[..., :n]
    # Float64 decision quantities of the reference.
    x_a = anchor_scores(q, k, blocks, block_n=bn, block_m=bm, scale=scale)
    anchor_mean = pooled_anchor(x_a, bm)
    q_mean = mean_pooling(q, bm)
    diff = anchor_mean.unsqueeze(-1) - stripe_scores(q_mean, k, scale=scale)
    region = search_region(n, step=step, block_m=bm, block_n=bn)
    ref_sets = group_stripes(diff <= theta, region, step=step)
    near = (diff - theta).abs() <= anchor_margin(q, k, anchor_mean, q_mean, block_m=bm, scale=scale)
    near_sets = group_stripes(near, region, step=step)
    bad = (ref_sets != got_sets) & ~near_sets
    if bool(bad.any()):
        at = tuple(int(i) for i in bad.nonzero()[0].tolist())
        b, h, grp, j = at
        rows = slice(grp * step, min(qb, (grp + 1) * step))
        closest = float((diff[b, h, rows, j] - theta[h]).abs().min())
        raise _fail(f"stripe key {j} of group {grp} at (b, h) {(b, h)}: reference keeps it "
                    f"{bool(ref_sets[at])}, fast {bool(got_sets[at])}; the nearest difference is "
                    f"{closest:.3g} from theta={float(theta[h])} (beyond the margin)")
def check_threshold_topk(
    scores: torch.Tensor, kept: torch.Tensor, *, alpha: float | torch.Tensor, tolerance: float, what: str
) -> None:
    """`kept` is a SampleAttention threshold top-k of `scores` (Alg. 1 lines 6-9), up to ties.

    Args:
        scores: float `[B, H, L]`, non-negative. kept: bool `[B, H, L]`.
        alpha: the CRA threshold, a float or `[H]` (per head). tolerance: the allowed
            error of a score or a sum.
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
    heads = q.shape[1]
    check_threshold_topk(column, columns, alpha=_heads(alpha_c, heads), tolerance=tol, what="column blocks")
    check_threshold_topk(slash, slashes, alpha=_heads(alpha_s, heads), tolerance=tol, what="slash blocks")


def _head(plan: BlockColumnPlan, h: int) -> BlockColumnPlan:
    """Query head `h` of a plan (a one-head plan over the same sizes)."""
    return BlockColumnPlan(
        seqlen=plan.seqlen, block_m=plan.block_m, block_n=plan.block_n,
        block_count=plan.block_count[:, h:h + 1], block_index=plan.block_index[:, h:h + 1],
        column_count=plan.column_count[:, h:h + 1], column_index=plan.column_index[:, h:h + 1],
        columns_disjoint=plan.columns_disjoint, column_group=plan.column_group,
    )


def minference_tie_check(
    q: torch.Tensor, k: torch.Tensor, params: dict[str, Any], expected: BlockColumnPlan, got: BlockColumnPlan
) -> None:
    """`MethodSpec.tie_check` of MInference's dispatch: head by head, its own pattern's check.

    A-shape heads must be equal exactly; vertical-slash and block-sparse heads may differ
    only as `vertical_slash_tie_check` / `block_sparse_tie_check` allow.
    """
    heads = params["config"].layer(int(params.get("layer", 0)))
    group = q.shape[1] // k.shape[1]
    got = got.to(expected.device)
    for h, pattern in enumerate(heads):
        exp_h, got_h = _head(expected, h), _head(got, h)
        if exp_h.equal(got_h):
            continue
        q_h, k_h = q[:, h:h + 1], k[:, h // group:h // group + 1]
        where = f"head {h} ({pattern.pattern})"
        if pattern.pattern == "vertical_slash":
            try:
                vertical_slash_tie_check(q_h, k_h, {**pattern.params, "scale": params.get("scale")},
                                         exp_h, got_h)
            except AssertionError as err:
                raise _fail(f"{where}: {err}") from err
        elif pattern.pattern == "block_sparse":
            try:
                block_sparse_tie_check(q_h, k_h, dict(pattern.params), exp_h, got_h)
            except AssertionError as err:
                raise _fail(f"{where}: {err}") from err
        else:
            raise _fail(f"{where}: A-shape plans must be equal")
