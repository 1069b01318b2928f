"""MInference's block-sparse pattern as a method descriptor, with its distributed estimate."""

from __future__ import annotations

from typing import Any

import torch

from .. import fast, reference
from ..reference.plan import BlockColumnPlan, cdiv
from ..reference.block_sparse import check_top_k
from ._common import block_sparse_top_k, knob_check
from ._core import DistributedEstimate, Method, SyncStatus, register


def distributed_estimate(shard: Any, params: dict[str, Any], impl: str, scale: float | None,
                         comm: Any) -> BlockColumnPlan:
    """Alg. 3 with the sequence split over ranks: each rank pools the blocks it holds
    (`mean_pooling`), the pooled keys are all-gathered, and each rank scores and selects
    its own query blocks with the method's steps (`block_scores`, `argtopk_blocks`)."""
    from .. import sharding as D
    from ..reference._checks import check_block_size, is_per_head, per_head
    from ..reference.block_sparse import argtopk_blocks, block_scores, check_top_k, mean_pooling

    p = {"block_size": 64, **params}
    unknown = set(p) - {"top_k", "block_size"}
    if unknown:
        raise TypeError(f"block_sparse got unexpected parameters {sorted(unknown)}")
    if "top_k" not in p:
        raise TypeError("block_sparse needs top_k")
    top_k: int | torch.Tensor
    if is_per_head(p["top_k"]):
        top_k = per_head(p["top_k"], "top_k", shard.q_heads, check_top_k, integer=True, device=shard.q.device)
    else:
        top_k = check_top_k(p["top_k"])
    bs = check_block_size("block_size", p["block_size"])
    layout = shard.layout
    layout.check_blocks(bs, bs)
    n, nb = layout.seqlen, cdiv(layout.seqlen, bs)
    device = shard.q.device
    b, hq, hkv, d = shard.batch, shard.q_heads, shard.kv_heads, shard.head_dim

    def pooled(x: torch.Tensor) -> torch.Tensor:
        # Alg. 3 lines 2-3 per chunk: chunks start on block boundaries, so pooling a
        # chunk pools exactly the global blocks it holds (the last one partial).
        parts, offset = [x.new_zeros(b, x.shape[1], 0, d, dtype=torch.float64)], 0
        for s, e in layout.rank_chunks(shard.rank):
            if e > s:
                parts.append(mean_pooling(x[:, :, offset:offset + e - s], bs))
            offset += e - s
        return torch.cat(parts, dim=2)

    ids = [D.block_ids(layout, r, bs, device) for r in range(comm.world)]
    gathered = comm.all_gather(pooled(shard.k), [int(i.numel()) for i in ids], 2, "estimate")
    k_all = torch.zeros(b, hkv, nb, d, dtype=torch.float64, device=device)
    for r, part in enumerate(gathered):
        k_all[:, :, ids[r]] = part
    q_ids = ids[shard.rank]
    blocks = torch.zeros(b, hq, nb, nb, dtype=torch.bool, device=device)
    if q_ids.numel():
        # Alg. 3 lines 4 and 6 on this rank's query blocks.
        scores = block_scores(pooled(shard.q), k_all, q_ids)
        blocks[:, :, q_ids] = argtopk_blocks(scores, top_k, q_ids)
    return BlockColumnPlan.from_masks(blocks, None, seqlen=n, block_m=bs, block_n=bs)


METHOD = register(Method(
    check=knob_check(integer=("top_k",), top_k=check_top_k),
    name="block_sparse",
    knobs=("top_k",),
    notes="MInference block-sparse: mean-pooled block scores, top-k key blocks per query block",
    reference_plan=reference.block_sparse_plan,
    fast_plan=fast.block_sparse_plan,
    reference_run=reference.block_sparse,
    fast_run=fast.block_sparse,
    defaults=lambda n: {"top_k": block_sparse_top_k(n)},
    sweep=lambda n: [{"top_k": max(2, -(-n // 64) // f)} for f in (32, 16, 8, 4, 2)],
    calibration=lambda n: [{"top_k": max(2, -(-n // 64) // f)} for f in (64, 32, 24, 16, 12, 8, 6, 4, 3, 2)],
    chunked="each query block's pooled queries against the pooled keys: the chunk's own blocks",
    sync=SyncStatus(note="top-k width min(top_k, Qb) from the parameters; dense fallback: outside CUDA-graph "
                         "capture, one read of the break-even rule's [Hq] flags (off during capture, so "
                         "the op stays capture-safe)"),
    distributed=DistributedEstimate(
        "native",
        "the mean-pooled keys of every rank (all-gather of `[B, Hkv, N / block_size, D]` float64)",
        distributed_estimate),
))
