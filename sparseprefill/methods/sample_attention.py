"""SampleAttention (Zhu et al.) as a method descriptor, with its distributed estimate."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .. import fast, reference
from ..reference._checks import check_block_size
from ..reference.plan import BlockColumnPlan, cdiv
from ..reference.sample_attention import check_alpha_c, check_alpha_s
from ._common import MASS_CALIBRATION, knob_check
from ._core import Ablation, DistributedEstimate, Method, MethodView, SyncStatus, register


def distributed_estimate(shard: Any, params: dict[str, Any], impl: str, scale: float | None,
                               comm: Any) -> BlockColumnPlan:
    from .. import sharding as D
    from ..reference._checks import per_head
    from ..reference.sample_attention import arg_topk, check_alpha_c, check_alpha_s, find_k, merge_index
    from ..reference.sample_attention import resolve_params, sampled_rows

    p = dict(params)
    unknown = set(p) - {"alpha_c", "alpha_s", "chunk_n", "block_size", "settings"}
    if unknown:
        raise TypeError(f"sample_attention got unexpected parameters {sorted(unknown)}")
    layout = shard.layout
    n = layout.seqlen
    bs = check_block_size("block_size", p.get("block_size", 128))
    a_c, a_s, c_n = resolve_params(n, alpha_c=p.get("alpha_c"), alpha_s=p.get("alpha_s"),
                                   chunk_n=p.get("chunk_n"), block_size=bs, settings=p.get("settings"))
    layout.check_blocks(bs, bs)
    device = shard.q.device
    b, hq, kb = shard.batch, shard.q_heads, cdiv(n, bs)
    a_c = per_head(a_c, "alpha_c", hq, check_alpha_c, device=device)
    a_s = per_head(a_s, "alpha_s", hq, check_alpha_s, device=device)
    sm_scale = 1.0 / math.sqrt(shard.head_dim) if scale is None else float(scale)
    # Alg. 1 line 2: the sampled rows, wherever they live.
    rows = torch.cat([torch.arange(a, z, device=device) for a, z in sampled_rows(n, c_n, bs)])
    q_rows = D.gather_rows(shard, rows, comm)
    # Alg. 1 lines 3-4: the sampled softmax over every rank's keys, reduced per block cell.
    scores = torch.zeros(2, b, hq, kb + 1, dtype=torch.float64, device=device)
    diag_of = (rows // bs)[:, None]

    def consume(a_hat: torch.Tensor, cols: torch.Tensor) -> None:
        blocks = cols // bs
        cells = torch.zeros(b, hq, rows.numel(), kb, dtype=torch.float64, device=device)
        cells.index_add_(3, blocks, a_hat)
        scores[0, ..., :kb] += cells.sum(dim=2)
        diag = diag_of - torch.arange(kb, device=device)[None, :]
        diag = torch.where(diag >= 0, diag, kb).expand(b, hq, -1, kb).reshape(b, hq, -1)
        scores[1].scatter_add_(2, diag, cells.reshape(b, hq, -1))

    D.global_softmax(shard, q_rows, rows, scale=sm_scale, comm=comm, consume=consume)
    # Column scores are complete on the block's holder, slash scores partial: one all-reduce.
    comm.all_reduce(scores, "estimate")
    column, slash = scores[0, ..., :kb], scores[1, ..., :kb]
    # Alg. 1 lines 6-9 on every rank (the scores are [B, Hq, Kb]: tiny).
    columns = arg_topk(column, find_k(column, a_c))
    slashes = arg_topk(slash, find_k(slash, a_s))
    if impl == "fast":
        from ..fast.kernels.sample_index import sample_attention_index

        return sample_attention_index(columns, slashes, seqlen=n, block_size=bs)
    plan: BlockColumnPlan = merge_index(columns, slashes, seqlen=n, block_size=bs)
    return plan


def extras(impl_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: dict[str, Any],
           view: MethodView) -> dict[str, float]:
    """The heads (over batch rows) whose stage 2 keeps no slash block on the diagonal."""
    from ..fast.sample_attention import sample_attention_selection as fast_selection
    from ..reference.sample_attention import sample_attention_selection as reference_selection

    _, slashes = (fast_selection if impl_name == "fast" else reference_selection)(q, k, **params)
    return {"heads_without_selected_diagonal": float((~slashes[..., 0]).sum())}


# `compare --ablations` (docs/sample_attention.md): alpha_c = alpha_s over this grid for each
# chunk_n and block size (64-token blocks show what block granularity costs).
def alpha_grid(chunk_n: int, block_size: int) -> Callable[[int], list[dict[str, Any]]]:
    return lambda n: [{"alpha_c": a, "alpha_s": a, "chunk_n": chunk_n, "block_size": block_size}
                      for a in (0.8, 0.9, 0.95, 0.98)]


ABLATIONS = tuple(Ablation(f"chunk_n {c}, block {b}", alpha_grid(c, b)) for b in (128, 64) for c in (1, 2, 4))

METHOD = register(Method(
    check=knob_check(alpha_c=check_alpha_c, alpha_s=check_alpha_s),
    name="sample_attention",
    knobs=("alpha_c", "alpha_s"),
    notes="SampleAttention: chunked sampling, CRA-threshold column and slash blocks (Alg. 1)",
    reference_plan=reference.sample_attention_plan,
    fast_plan=fast.sample_attention_plan,
    reference_run=reference.sample_attention,
    fast_run=fast.sample_attention,
    # Section 5.4's 32K setting; 64-token blocks below 4K so short prompts keep several blocks.
    defaults=lambda n: {"alpha_c": 0.95, "alpha_s": 0.95, "chunk_n": 1, "block_size": 128 if n >= 4096 else 64},
    sweep=lambda n: [{"alpha_c": a, "alpha_s": a, "chunk_n": 1} for a in (0.8, 0.9, 0.95, 0.98)],
    calibration=lambda n: [{"alpha_c": a, "alpha_s": a, "chunk_n": 1} for a in MASS_CALIBRATION],
    ablations=ABLATIONS,
    extras=extras,
    sync=SyncStatus(
        syncs=("dense fallback: the break-even rule's [Hq] flags, one read (off in sample_attention_static)",
               "merge index: the most kept column + slash blocks ((...).max().item())",),
        static_bound="Kb key blocks per query block (every block)",
        note="stage 1's sampled-row tile table depends on parameters only: built once and kept "
             "(sampled_scores.tile_table); during a capture without a kept one it is built on the device "
             "(sampled_scores.row_tile_table), as a host copy is refused there"),
    distributed=DistributedEstimate(
        "native",
        "the sampled query rows (`chunk_n` chunks' last `block_size` rows; broadcast or all-reduced "
        "from their holders); per-row softmax max and sum (two all-reduces of `[B, Hq, R]`); one "
        "all-reduce of the float64 column and block-diagonal scores `[2, B, Hq, N / block_size]`",
        distributed_estimate),
))
