"""FlexPrefill-style vertical-slash heads on the GPU (see `reference.flexprefill_vs` for the spec).

Estimate: `last_q_scores` (Triton, no `[L, N]` tensor), the same kernel as
MInference's vertical-slash. Lines: the fp32 scores are normalised and ranked in
float64 with the reference's `cover_threshold` (a stable sort and a cumulative
sum, O(N log N) per head). Index: the kept lines, padded to the longest head's
count with the offset N (which reaches no row), go through the vertical-slash
index kernel (Alg. 4) and per-query-block disjoint columns where they fit. With
`line_block` a multiple of `block_n` the kept bands go to `band_index` instead: one
pass over each query block's causal key blocks, a pure-block plan (no line lists,
no columns to gather).

Float rounding: the fp32 estimate differs from the reference's float64 one in the
last bits, so a line whose share nearly ties the last kept one, or whose cumulative
share lies within rounding of `gamma`, may be decided differently;
`conformance.ties.flexprefill_vs_tie_check` accepts exactly those differences.
"""

from __future__ import annotations

import torch

from ..reference._checks import (
    HALF_DTYPES,
    PerHead,
    check_count,
    check_qk,
    check_qkv,
    per_head,
    resolve_scale,
)
from ..reference.dense_fallback import heads_view, knob_heads
from ..reference.flexprefill_vs import (
    GAMMA,
    LINE_BLOCK,
    band_lines,
    check_flexprefill_vs_params,
    check_gamma,
    cover_threshold,
    first_lines,
    pool_lines,
)
from ..reference.plan import BlockColumnPlan, cdiv
from .attention import run_plan
from .capture import static_widths_active
from .dense_fallback import plan_with_fallback, probe_mass_density
from .kernels import check_forward_only, check_kernel_block_sizes
from .kernels.last_q_estimate import last_q_scores
from .kernels.vertical_slash_index import band_index, vertical_slash_index
from .vertical_slash import with_own_columns


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
    """Kept columns and offsets (see `reference.flexprefill_vs.flexprefill_vs_lines`).

    Returns:
        (verticals, slashes) bool `[B, Hq, N]` (whole bands of `line_block` lines).

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k, dtypes=HALF_DTYPES)
    check_flexprefill_vs_params(gamma=gamma, last_q=last_q, block_m=1, block_n=1,
                                init_columns=init_columns, local_diagonals=local_diagonals,
                                line_block=line_block)
    n = shape.seqlen
    last_q = check_count("last_q", last_q, cap=n)
    init_columns = check_count("init_columns", init_columns, cap=n, minimum=0)
    local_diagonals = check_count("local_diagonals", local_diagonals, cap=n, minimum=0)
    heads_gamma = per_head(gamma, "gamma", shape.q_heads, check_gamma, device=q.device)
    vertical, slash = last_q_scores(q, k, last_q=last_q, scale=scale)
    # [2, B, Hq, N]: columns, then offsets. Both go through one batch of ops (the
    # reference's `cover_bands` on each, row by row the same float64 values; half the
    # launches, which is what this stage costs at 32K).
    lines = torch.stack((vertical, slash)).to(torch.float64)
    # Alg. 5 lines 2-3: both sums hold the same total mass (L rows of one each).
    total = lines[0].sum(dim=-1, keepdim=True)
    # Bands are pooled in float64 after the division, as the reference pools its shares.
    bands = pool_lines(lines / total, line_block)
    forced = torch.stack([first_lines(cdiv(c, line_block), bands.shape[-1], q.device)
                          for c in (init_columns, local_diagonals)])[:, None, None, :]
    kept = band_lines(cover_threshold(bands, heads_gamma, forced), line_block, n)
    return kept[0], kept[1]


#: How `padded_lines` lists the kept indices: "sort" (a sort of the indices with the
#: dropped ones pushed to N) or "scatter" (each kept index written at its rank, the rank
#: a cumulative sum; O(N) a row, no sort). Same lists; on an H200 at 32K (shareprefill's
#: plan, same process) the sort measured 3.83 ms, the scatter 3.94: the sort stays.
#: docs/shareprefill.md (designs table).
COMPACT_BY = "sort"


def padded_lines(kept: torch.Tensor) -> torch.Tensor:
    """bool `[B, H, N]` -> int32 `[B, H, W]` kept indices ascending, padded with N.

    `W` is the largest count (at least 1; one host synchronisation), or N inside
    `fast.capture.static_widths()` and during CUDA-graph capture. The index
    kernel reads offset N as a slash that reaches no row, and a column N is never
    causal, so the padding adds nothing.
    """
    return padded_lines_many(kept)[0]


def padded_lines_many(*kept: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`padded_lines` of several masks (each its own width) with one host synchronisation
    for all their widths (none inside `static_widths()` or a capture)."""
    if not kept:
        return ()
    n = [t.shape[-1] for t in kept]
    if static_widths_active(kept[0]):
        widths = n
    else:
        most = torch.stack([t.sum(dim=-1, dtype=torch.int32).max() for t in kept])
        widths = [max(1, w) for w in most.tolist()]
    return tuple(_compact(t, w) for t, w in zip(kept, widths))


def _compact(kept: torch.Tensor, width: int) -> torch.Tensor:
    """The first `width` kept indices of each row of `kept`, ascending, padded with N."""
    n = kept.shape[-1]
    ids = torch.arange(n, dtype=torch.int32, device=kept.device)
    if COMPACT_BY == "sort":
        ranked = torch.where(kept, ids, n)
        return torch.sort(ranked, dim=-1).values[..., :width].contiguous()
    # Rank of each kept index = kept indices before it; dropped ones go to a spill column.
    rank = torch.cumsum(kept, dim=-1, dtype=torch.int32) - 1
    slot = torch.where(kept & (rank < width), rank, width).to(torch.int64)
    out = torch.full((*kept.shape[:-1], width + 1), n, dtype=torch.int32, device=kept.device)
    out.scatter_(-1, slot, torch.where(kept, ids, n).expand_as(slot))
    # The spill column received arbitrary writes; every real slot got exactly one.
    return out[..., :width].contiguous()


def lines_index(
    verticals: torch.Tensor,
    slashes: torch.Tensor,
    *,
    block_m: int = 64,
    block_n: int = 64,
    line_block: int = 1,
) -> BlockColumnPlan:
    """Alg. 4 of kept-line masks on the GPU (see `reference.flexprefill_vs.lines_index`).

    Args:
        verticals, slashes: bool `[B, H, N]`; with `line_block` a multiple of
            `block_n`, unions of aligned bands of `line_block` lines (as
            `flexprefill_vs_lines` returns them).
        block_m, block_n: query rows and keys per block.
        line_block: the band width of the lines.

    Returns:
        The plan; `equal` to the reference's.
    """
    n = verticals.shape[-1]
    if line_block % block_n == 0:
        # A band is whole key blocks: its first column (or offset) says whether it is kept.
        return band_index(verticals[..., ::block_n], slashes[..., ::line_block], seqlen=n,
                          block_m=block_m, block_n=block_n, line_block=line_block).mark_valid()
    plan = vertical_slash_index(*padded_lines_many(verticals, slashes), seqlen=n,
                                block_m=block_m, block_n=block_n)
    return with_own_columns(plan.mark_valid())


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
    """FlexPrefill-style vertical-slash plan (see `reference.flexprefill_vs_plan`).

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k, dtypes=HALF_DTYPES)
    check_flexprefill_vs_params(gamma=gamma, last_q=last_q, block_m=block_m, block_n=block_n,
                                init_columns=init_columns, local_diagonals=local_diagonals,
                                line_block=line_block)
    mass = per_head(gamma, "gamma", shape.q_heads, check_gamma, device=q.device)
    check_kernel_block_sizes(block_m, block_n)

    def estimate(heads: list[int] | None) -> BlockColumnPlan:
        qs, ks = heads_view(q, k, heads)
        verticals, slashes = flexprefill_vs_lines(
            qs, ks, gamma=gamma if heads is None else knob_heads(mass, heads), last_q=last_q,
            init_columns=init_columns, local_diagonals=local_diagonals, line_block=line_block, scale=scale,
        )
        return lines_index(verticals, slashes, block_m=block_m, block_n=block_n, line_block=line_block)

    sm_scale = resolve_scale(scale, shape.head_dim)
    return plan_with_fallback(q, k, estimate, block_m=block_m, block_n=block_n,
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
    """FlexPrefill-style vertical-slash sparse attention (see `reference.flexprefill_vs`).

    Host synchronisations: the padded line width (none with `line_block` a multiple of
    `block_n`) and the index's counting pass. Inside
    `fast.capture.static_widths()` (`torch.ops.sparseprefill.flexprefill_vs_static`)
    and during CUDA-graph capture both use their bounds (N lines, Kb blocks): no sync,
    capture-safe (docs/serving.md).

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    check_qkv(q, k, v, dtypes=HALF_DTYPES)
    check_forward_only(q, k, v)
    plan = flexprefill_vs_plan(
        q, k, gamma=gamma, last_q=last_q, block_m=block_m, block_n=block_n,
        init_columns=init_columns, local_diagonals=local_diagonals, line_block=line_block, scale=scale,
    )
    return run_plan(q, k, v, plan, scale=scale)
