"""FlexPrefill-style vertical-slash (SharePrefill Alg. 5) as a method descriptor, with its
distributed estimate."""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import fast, reference
from ..reference.plan import BlockColumnPlan
from ._common import MASS_CALIBRATION, keyword_check
from ..reference.flexprefill_vs import check_flexprefill_vs_params
from ._core import DistributedEstimate, Method, SyncStatus, register


def distributed_estimate(shard: Any, params: dict[str, Any], impl: str, scale: float | None,
                             comm: Any) -> BlockColumnPlan:
    from .. import sharding as D
    from ..reference._checks import check_count, per_head
    from ..reference.flexprefill_vs import GAMMA, LINE_BLOCK, check_flexprefill_vs_params, check_gamma, cover_bands

    p = {"gamma": GAMMA, "last_q": 64, "block_m": 64, "block_n": 64, "init_columns": 1, "local_diagonals": 1,
         "line_block": LINE_BLOCK, **params}
    unknown = set(p) - {"gamma", "last_q", "block_m", "block_n", "init_columns", "local_diagonals", "line_block"}
    if unknown:
        raise TypeError(f"flexprefill_vs got unexpected parameters {sorted(unknown)}")
    check_flexprefill_vs_params(**p)
    layout = shard.layout
    layout.check_blocks(p["block_m"], p["block_n"])
    n = layout.seqlen
    last_q = check_count("last_q", p["last_q"], cap=n)
    init_columns = check_count("init_columns", p["init_columns"], cap=n, minimum=0)
    local_diagonals = check_count("local_diagonals", p["local_diagonals"], cap=n, minimum=0)
    sm_scale = 1.0 / math.sqrt(shard.head_dim) if scale is None else float(scale)
    device = shard.q.device
    gamma = per_head(p["gamma"], "gamma", shard.q.shape[1], check_gamma, device=device)
    # Alg. 5 line 1: the last queries' softmax over every rank's keys (as vertical-slash).
    q_last = D.gather_rows(shard, torch.arange(n - last_q, n, device=device), comm)
    vertical_local, slash = D.distributed_last_q_scores(shard, q_last, scale=sm_scale, comm=comm)
    # Alg. 5 lines 2-8 need every line's share on every rank: gather the columns, sum the slashes.
    lengths = [layout.local_length(r) for r in range(comm.world)]
    vertical = layout.unshard(comm.all_gather(vertical_local, lengths, 2, "estimate"))
    comm.all_reduce(slash, "estimate")
    total = vertical.sum(dim=-1, keepdim=True)
    verticals = cover_bands(vertical / total, gamma, init_columns, p["line_block"])
    slashes = cover_bands(slash / total, gamma, local_diagonals, p["line_block"])
    if impl == "fast":
        from ..fast.flexprefill_vs import lines_index as fast_lines_index

        return fast_lines_index(verticals, slashes, block_m=p["block_m"], block_n=p["block_n"],
                                line_block=p["line_block"])
    from ..reference.flexprefill_vs import lines_index

    plan: BlockColumnPlan = lines_index(verticals, slashes, block_m=p["block_m"], block_n=p["block_n"],
                                        line_block=p["line_block"])
    return plan




METHOD = register(Method(
    check=keyword_check(check_flexprefill_vs_params),
    name="flexprefill_vs",
    knobs=("gamma",),
    notes="FlexPrefill-style vertical-slash (SharePrefill Alg. 5): fewest lines holding gamma of the "
          "estimated mass",
    reference_plan=reference.flexprefill_vs_plan,
    fast_plan=fast.flexprefill_vs_plan,
    reference_run=reference.flexprefill_vs,
    fast_run=fast.flexprefill_vs,
    defaults=lambda n: {"gamma": 0.9},
    sweep=lambda n: [{"gamma": g} for g in (0.8, 0.85, 0.9, 0.95, 0.98)],
    calibration=lambda n: [{"gamma": g} for g in MASS_CALIBRATION],
    chunked="the chunk's last `last_q` queries (capped at the chunk's length), as vertical-slash",
    sync=SyncStatus(
        syncs=("dense fallback (off in flexprefill_vs_static): the rule's [Hq] flags (break_even_heads), one "
               "read; with the early exit on (off by default) one more, the [Hq] flags of the last-64-row gamma "
               "probe (early_dense_heads)",
               "line lists: the most kept verticals and slashes of a head (padded_lines, .max().item()); "
               "not with line_block a multiple of block_n (the default): band_index takes the bands",
               "counting pass: as vertical_slash (band_index's own with whole-block bands)"),
        static_bound="N lines per head, then min(Kb, N * ...) = Kb key blocks per query block",
        note="static lines are padded to N (the counting pass walks all N offsets per query block); "
             "columns stay shared when per-block lists exceed 512 MB"),
    distributed=DistributedEstimate(
        "native",
        "as vertical-slash up to the scores; then, since the cumulative threshold needs every "
        "line's share, the column shares are all-gathered and the slash sums all-reduced "
        "(float64 `[B, Hq, N]` each)",
        distributed_estimate),
))
