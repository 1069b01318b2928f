"""MInference's vertical-slash pattern as a method descriptor, with its distributed estimate."""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import fast, reference
from ..reference.plan import BlockColumnPlan
from ..reference.vertical_slash import check_vertical_slash_params
from ._common import keyword_check, vertical_slash_defaults
from ._core import Ablation, DistributedEstimate, Method, SyncStatus, register


def distributed_estimate(shard: Any, params: dict[str, Any], impl: str, scale: float | None,
                         comm: Any) -> BlockColumnPlan:
    """Alg. 2 with the keys split over ranks: the last queries' softmax over every rank's
    keys, vertical and slash scores reduced where they are complete, the method's own
    index builder on the global lines."""
    from .. import sharding as D
    from ..reference.vertical_slash import line_counts
    from ..reference.vertical_slash import vertical_slash_index as reference_index

    p = {"last_q": 64, "block_m": 64, "block_n": 64, "init_columns": 30, "local_diagonals": 100, **params}
    unknown = set(p) - {"vertical_size", "slash_size", "last_q", "block_m", "block_n", "init_columns",
                        "local_diagonals"}
    if unknown:
        raise TypeError(f"vertical_slash got unexpected parameters {sorted(unknown)}")
    check_vertical_slash_params(**p)
    layout = shard.layout
    layout.check_blocks(p["block_m"], p["block_n"])
    n = layout.seqlen
    rows = min(p["last_q"], n)
    sm_scale = 1.0 / math.sqrt(shard.head_dim) if scale is None else float(scale)
    # Alg. 2 line 2: the last queries live on the ranks holding the sequence's end.
    q_last = D.gather_rows(shard, torch.arange(n - rows, n, device=shard.q.device), comm)
    vertical, slash_part = D.distributed_last_q_scores(shard, q_last, scale=sm_scale, comm=comm)
    # Alg. 2 lines 4 and 6: argtopk with the forced lines, ties to the lower index.
    verticals = D.distributed_argtopk(
        vertical, shard.tokens, [layout.local_length(r) for r in range(comm.world)],
        count=line_counts(p["vertical_size"], p["init_columns"], n, "vertical_size", shard.q_heads, shard.q.device),
        forced=p["init_columns"], comm=comm)
    bounds = D.offset_bounds(n, comm.world)
    slashes = D.distributed_argtopk(
        D.reduce_scatter(slash_part, comm), torch.arange(bounds[comm.rank], bounds[comm.rank + 1],
                                                         device=slash_part.device),
        [bounds[r + 1] - bounds[r] for r in range(comm.world)],
        count=line_counts(p["slash_size"], p["local_diagonals"], n, "slash_size", shard.q_heads, shard.q.device),
        forced=p["local_diagonals"], comm=comm)
    if impl == "fast":
        from ..fast.kernels.vertical_slash_index import vertical_slash_index as fast_index
        from ..fast.vertical_slash import with_own_columns

        return with_own_columns(fast_index(verticals, slashes, seqlen=n, block_m=p["block_m"],
                                           block_n=p["block_n"]))
    plan: BlockColumnPlan = reference_index(verticals, slashes, seqlen=n, block_m=p["block_m"],
                                            block_n=p["block_n"])
    return plan


# The yardstick grid (`compare --ablations --yardstick vertical_slash:x4`): budgets (x, 4x),
# x geometric from 8 to about 2100, 64 x 64 blocks, fine enough to interpolate recall at
# any other method's density.
YARDSTICK = tuple(int(round(8 * 1.45 ** i)) for i in range(16))

METHOD = register(Method(
    check=keyword_check(check_vertical_slash_params),
    name="vertical_slash",
    knobs=("vertical_size", "slash_size"),
    notes="MInference vertical-slash: last_q estimate, top-k columns and diagonals, Alg. 4 index",
    reference_plan=reference.vertical_slash_plan,
    fast_plan=fast.vertical_slash_plan,
    reference_run=reference.vertical_slash,
    fast_run=fast.vertical_slash,
    defaults=vertical_slash_defaults,
    sweep=lambda n: [{"vertical_size": max(30, n // f), "slash_size": max(64, 2 * n // f)}
                     for f in (256, 128, 64, 32, 16, 8)],
    calibration=lambda n: [{"vertical_size": max(30, n // f), "slash_size": max(64, 2 * n // f)}
                           for f in (512, 256, 181, 128, 90, 64, 45, 32, 16, 8)],
    ablations=(Ablation("x4", lambda n: [{"vertical_size": x, "slash_size": 4 * x, "block_m": 64, "block_n": 64}
                                         for x in YARDSTICK],
                        about="the yardstick: budgets (x, 4x) on a geometric grid"),),
    chunked="the chunk's last `last_q` queries (capped at the chunk's length) against every key of the "
            "prefix and the chunk",
    sync=SyncStatus(
        syncs=("dense fallback (off in vertical_slash_static): the break-even rule's [Hq] flags "
               "(break_even_heads: flags.nonzero().tolist()), one read per head group of the run",
               "counting pass: the widest block list of each head (block_count.amax().tolist())",),
        static_bound="min(Kb, slash_size * ((block_m - 1) // block_n + 2)) key blocks per query block",
        note="static plan: 4 * B * Hq * Qb * bound bytes (heads planned in groups above 1 GB)"),
    distributed=DistributedEstimate(
        "native",
        "the last `last_q` queries (broadcast from the rank holding the sequence's end); "
        "per-row softmax max and sum (two all-reduces of `[B, Hq, last_q]`); each rank's "
        "slash partial sums reduce-scattered (`(W-1)/W` of a float64 `[B, Hq, N]` per rank); "
        "the best `vertical_size` / `slash_size` candidates of every rank all-gathered",
        distributed_estimate),
))
