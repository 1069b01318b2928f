"""Delta-KV compression on Triton kernels (see `reference.delta_kv` for the specification).

Stage 1 and 2 run in `fast/kernels/delta_pack.py` (keep mask bit-identical to the
reference's; packing with one host synchronisation to size the flat buffer). The two
phases of 4.1.4 are two launches of the one block/column kernel chained through an
`AttentionState`: phase 1 reads the packed anchors through per-(batch row, KV head)
offsets (`ragged_block_column_attention`) with the log run length as a per-key bias,
phase 2 resumes from its state over the original keys of the critical diagonal.

`delta_kv` decides on the measured keep ratio before packing (the break-even rule,
`reference.dense_fallback.keep_dense_kv_heads`, through `fast.dense_fallback`): a KV
head that keeps too many keys for packed attention to beat our kernel's dense keeps only
its first key in the packing (its segment is one anchor), its query heads list nothing in
either phase, and they run full causal attention through our kernel; where one SDPA call
over the whole layer beats the heads' best options summed, every head runs in that call
and nothing is packed (`fast.attention.dense_heads_into`).
"""

from __future__ import annotations

import math

import torch

from ..reference._checks import HALF_DTYPES, PerHead, check_block_size, check_count, check_qkv, resolve_scale
from ..reference.attention import AttentionState
from ..reference.delta_kv import (
    PackedKV,
    check_flags,
    check_keys,
    check_mask_threshold,
    check_metric,
    check_pack_inputs,
    check_packed,
    check_packed_for,
    cdiv_tensor,
    dense_query_heads,
    kv_threshold,
)
from ..reference.plan import BlockColumnPlan, cdiv
from .attention import dense_heads_into
from .dense_fallback import active_rates
from .kernels import block_column_attention, check_forward_only, check_kernel_block_sizes, check_kernel_device
from .kernels.block_column import ragged_block_column_attention
from .kernels.delta_pack import keep_mask, pack
from .metrics import density

# Chunk granularity of the packing kernel when the caller's chunks are not known.
_PACK_CHUNK = 512


def delta_keep_mask(
    k: torch.Tensor,
    *,
    threshold: PerHead,
    metric: str = "euclidean",
    chunk: int = 512,
) -> torch.Tensor:
    """Stage 1 (see `reference.delta_keep_mask`): bool `[B, Hkv, N]`, bit-identical to it;
    `threshold` a scalar or one value per KV head.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    k = check_keys(k)
    if k.dtype not in HALF_DTYPES:
        raise TypeError(f"k must have dtype float16 or bfloat16 for the fast kernels, got {k.dtype}")
    metric = check_metric(metric)
    thr = check_mask_threshold(threshold, metric, k.shape[1])
    size = check_count("chunk", chunk, cap=k.shape[2])
    check_kernel_device(k)
    return keep_mask(k, threshold=thr, cosine=metric == "cosine", chunk=size)[0]


def delta_pack(
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor,
    *,
    block: int = 64,
) -> PackedKV:
    """Stage 2 (see `reference.delta_pack`); the same `PackedKV`, field for field.

    Raises:
        TypeError, ValueError: bad inputs.
    """
    k, v, keep, bs = check_pack_inputs(k, v, keep, block)
    if k.dtype not in HALF_DTYPES:
        raise TypeError(f"k must have dtype float16 or bfloat16 for the fast kernels, got {k.dtype}")
    check_kernel_block_sizes(bs, bs, names=("block", "block"))
    check_kernel_device(k)
    return pack(k, v, keep, None, chunk=min(_PACK_CHUNK, k.shape[2]), block=bs).mark_valid()


def delta_kv_plans(
    q: torch.Tensor,
    packed: PackedKV,
    *,
    block_m: int = 64,
) -> tuple[BlockColumnPlan, BlockColumnPlan]:
    """The two phases as plans (see `reference.delta_kv_plans`), built with tensor ops.

    Phase 1's block lists are one `arange` shared by every query block (stride 0);
    phase 2's are as wide as the longest critical diagonal (one host synchronisation).

    Raises:
        TypeError, ValueError: bad inputs.
    """
    packed, q = check_packed_for(packed, q)
    bm = check_block_size("block_m", block_m)
    check_kernel_block_sizes(bm, packed.block, names=("block_m", "packed.block"))
    phase1, diagonal = _phase1_plan(q, packed, bm)
    return phase1, _phase2_plan(diagonal, _HostMax(diagonal.count).get())


class _Diagonal:
    """Phase 2's per-query-block geometry, on the device: the first whole key block past
    the cut (`first_block`), the number of whole blocks up to the diagonal (`count`) and
    the columns `[cut, col_end)` before the first whole block. The query heads of `drop`
    (bool `[Hq]`, heads that run dense elsewhere) list nothing."""

    def __init__(self, cut: torch.Tensor, *, n: int, bm: int, bs: int, drop: torch.Tensor | None = None) -> None:
        dev = cut.device
        qb = cut.shape[-1]
        last_row = (torch.arange(1, qb + 1, device=dev, dtype=torch.int64) * bm).clamp(max=n) - 1
        self.cut, self.n, self.bm, self.bs = cut, n, bm, bs
        self.first_block = cdiv_tensor(cut, bs)
        self.count = (last_row // bs - self.first_block + 1).clamp(min=0)
        # Columns: from `cut` up to the first whole block, never past the block's last row.
        self.col_count = (torch.minimum(self.first_block * bs, last_row + 1) - cut).clamp(min=0)
        if drop is not None:
            # Before the width is read: a dense head's whole diagonal must not widen the lists.
            self.count = torch.where(drop[None, :, None], 0, self.count)
            self.col_count = torch.where(drop[None, :, None], 0, self.col_count)


class _HostMax:
    """The maximum of an integer tensor, read on the host without stalling the stream.

    On a GPU the value is copied into pinned memory behind an event as soon as it is
    computed; `get` waits for that event only, so kernels launched between the two
    calls (Delta-KV's phase 1) keep the GPU busy while the host waits. On the CPU it
    is a plain read."""

    def __init__(self, t: torch.Tensor) -> None:
        m = t.max() if t.numel() else t.new_zeros(())
        self._event: torch.cuda.Event | None = None
        if m.is_cuda:
            self._host = torch.empty((), dtype=m.dtype, pin_memory=True)
            self._host.copy_(m, non_blocking=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._event.record()
        else:
            self._host = m

    def get(self) -> int:
        if self._event is not None:
            self._event.synchronize()
        return int(self._host.item())


def _phase1_plan(q: torch.Tensor, packed: PackedKV, bm: int,
                 dense: tuple[int, ...] = ()) -> tuple[BlockColumnPlan, _Diagonal]:
    """Phase 1's plan and phase 2's geometry, with tensor ops only (no host read); the
    query heads `dense` list nothing in either phase."""
    b, hq, n, _ = q.shape
    bs = packed.block
    dev = q.device
    qb, kb = cdiv(n, bm), cdiv(n, bs)
    safe, cut = safe_blocks(packed, block_m=bm)
    group = hq // packed.kv_heads
    safe = safe.view(b, packed.kv_heads, qb).repeat_interleave(group, dim=1)
    cut = cut.view(b, packed.kv_heads, qb).repeat_interleave(group, dim=1)
    drop = None
    if dense:
        drop = torch.zeros(hq, dtype=torch.bool, device=dev)
        drop[list(dense)] = True
        safe = torch.where(drop[None, :, None], 0, safe)
    phase1 = BlockColumnPlan(
        seqlen=n, block_m=bm, block_n=bs,
        block_count=safe.to(torch.int32),
        block_index=torch.arange(kb, dtype=torch.int32, device=dev).expand(b, hq, qb, kb),
        column_count=torch.zeros(b, hq, qb, dtype=torch.int32, device=dev),
        column_index=torch.zeros(b, hq, qb, 0, dtype=torch.int32, device=dev),
    ).mark_valid()
    return phase1, _Diagonal(cut, n=n, bm=bm, bs=bs, drop=drop)


def _phase2_plan(diag: _Diagonal, width: int) -> BlockColumnPlan:
    """Phase 2's plan, its block lists `width` wide (the longest critical diagonal)."""
    dev, bs = diag.cut.device, diag.bs
    blocks = diag.first_block.unsqueeze(-1) + torch.arange(width, device=dev)
    columns = diag.cut.unsqueeze(-1) + torch.arange(max(bs - 1, 0), device=dev)
    return BlockColumnPlan(
        seqlen=diag.n, block_m=diag.bm, block_n=bs,
        block_count=diag.count.to(torch.int32),
        block_index=torch.where(torch.arange(width, device=dev) < diag.count.unsqueeze(-1), blocks, 0)
        .to(torch.int32),
        column_count=diag.col_count.to(torch.int32),
        column_index=torch.where(torch.arange(columns.shape[-1], device=dev) < diag.col_count.unsqueeze(-1),
                                 columns, 0).to(torch.int32),
        columns_disjoint=True,
    ).mark_valid()


def safe_blocks(packed: PackedKV, *, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(safe, cut) int64 `[B * Hkv, Qb]` (see `reference.delta_kv.safe_blocks`), vectorised."""
    n, bs = packed.seqlen, packed.block
    dev = packed.counts.device
    qb, kb = cdiv(n, block_m), cdiv(n, bs)
    starts = packed.offsets[:-1]
    # A packing edited after `validate` may not fit `k` any more: never list a block
    # that would end past the flat buffer's T rows (wrong numbers, no stray read).
    ends = torch.minimum(packed.offsets[1:], torch.full_like(starts, packed.counts.numel()))
    blocks = ((ends - starts.clamp(min=0)) // bs).clamp(min=0)
    j = torch.arange(kb, device=dev)
    last = (starts[:, None] + (j + 1) * bs - 1).clamp(min=0, max=max(packed.counts.numel() - 1, 0))
    # Timestamps grow within a segment, so a block's reach is its last entry; blocks a
    # segment does not have reach N, which no query block precedes.
    reach = torch.where(j < blocks[:, None], packed.timestamps[last].to(torch.int64), n)
    first_row = (torch.arange(qb, device=dev, dtype=torch.int64) * block_m).expand(reach.shape[0], qb)
    safe = torch.searchsorted(reach.contiguous(), first_row.contiguous())
    cut = torch.where(safe > 0, reach.gather(1, (safe - 1).clamp(min=0)) + 1, 0)
    # Valid timestamps give 0 <= cut <= N; edited ones must not size phase 2 past it.
    return safe, cut.clamp(min=0, max=n)


def expand_packed(packed: PackedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """Each anchor's key and value repeated over its run, `[B, Hkv, N, D]` (one gather)."""
    rows = torch.repeat_interleave(torch.arange(packed.counts.numel(), device=packed.counts.device),
                                   packed.counts.to(torch.int64))
    shape = (packed.batch, packed.kv_heads, packed.seqlen, packed.k.shape[-1])
    return packed.k[rows].view(shape), packed.v[rows].view(shape)


def delta_kv_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    packed: PackedKV,
    *,
    block_m: int = 64,
    count_weighted: bool = True,
    exact_diagonal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """The two-phase attention (see `reference.delta_kv_attention`): two kernel launches.

    Raises:
        TypeError, ValueError: bad inputs, before any launch.
    """
    shape = check_qkv(q, k, v, dtypes=HALF_DTYPES)
    check_kernel_device(q)
    check_forward_only(q, k, v)
    scale = resolve_scale(scale, shape.head_dim)
    check_packed(packed, k)
    check_flags(count_weighted=count_weighted, exact_diagonal=exact_diagonal)
    bm = check_block_size("block_m", block_m)
    check_kernel_block_sizes(bm, packed.block, names=("block_m", "packed.block"))
    return _two_phases(q, k, v, packed, bm=bm, count_weighted=count_weighted, exact_diagonal=exact_diagonal,
                       scale=scale)


def _two_phases(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedKV, *, bm: int,
                count_weighted: bool, exact_diagonal: bool, scale: float,
                dense: tuple[int, ...] = ()) -> torch.Tensor:
    """`delta_kv_attention` on checked inputs; the query heads `dense` (whole KV groups,
    sorted) list nothing in either phase and get full causal attention
    (`fast.attention.dense_heads_into`)."""
    plan1, diagonal = _phase1_plan(q, packed, bm, dense)
    width = _HostMax(diagonal.count)  # read after phase 1 is queued: no idle GPU while it waits
    counts = packed.counts.to(torch.float32)
    # Eq. 4 as a bias: c exp(s) = exp(s + log c); padding (count 0) weighs nothing.
    bias = torch.log(counts) if count_weighted else torch.where(counts > 0, 0.0, -math.inf)
    state = AttentionState.like(q)
    # Launched even where no query block has a safe block: its programs then leave at
    # once, cheaper than the host read that would skip them. The offsets are a valid
    # packing's (checked by `delta_kv_attention`, or built by `pack`), so the launcher's
    # own range check is skipped.
    ragged_block_column_attention(q, packed.k, packed.v, packed.offsets[:-1].contiguous(), plan1,
                                  key_bias=bias, scale=scale, state=state, check_offsets=False)
    plan2 = _phase2_plan(diagonal, width.get())
    k2, v2 = (k, v) if exact_diagonal else expand_packed(packed)
    out, _ = block_column_attention(q, k2, v2, plan2, scale=scale, state=state, validate_plan=False)
    return dense_heads_into(q, k, v, dense, out, scale=scale)


def delta_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    threshold: PerHead,
    metric: str = "euclidean",
    chunk: int = 512,
    block_m: int = 64,
    block_n: int = 64,
    count_weighted: bool = True,
    exact_diagonal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Delta-KV attention end to end (see `reference.delta_kv`; `threshold` a scalar or one
    value per query head, equal within each KV group).

    Host synchronisations: two, the packed buffer's size and the phase-2 width; the
    width is copied out behind an event and read after phase 1 is queued, so the GPU
    does not idle while the host waits for it; with the break-even rule on (CUDA, by
    default) one more, the `[Hkv]` flags of the KV heads whose keep ratio sends them
    dense (read after the keep mask, before packing). No static variant, not
    capture-safe (docs/serving.md).

    The break-even rule (`reference.dense_fallback.keep_dense_kv_heads`): a KV head
    whose keep ratio (batch rows together) is at or above the ratio where packed
    attention stops beating our kernel's dense is not packed (its segment keeps one
    anchor) and its query heads run full causal attention through our kernel; every
    other head gets exactly the output it gets without the rule. Where one SDPA call over
    the layer beats the heads' best options summed, every head runs in it. Off: `SPARSEPREFILL_DENSE_FALLBACK=0` or
    `fast.dense_fallback.dense_fallback(False)`.

    Raises:
        TypeError, ValueError: bad inputs or parameters, before any launch.
    """
    shape = check_qkv(q, k, v, dtypes=HALF_DTYPES)
    check_kernel_device(q)
    check_forward_only(q, k, v)
    metric = check_metric(metric)
    thr = kv_threshold(threshold, metric, shape.q_heads, shape.kv_heads)
    size = check_count("chunk", chunk, cap=shape.seqlen)
    bm = check_block_size("block_m", block_m)
    bn = check_block_size("block_n", block_n)
    check_kernel_block_sizes(bm, bn)
    check_flags(count_weighted=count_weighted, exact_diagonal=exact_diagonal)
    scale = resolve_scale(scale, shape.head_dim)
    keep, chunk_counts = keep_mask(k, threshold=thr, cosine=metric == "cosine", chunk=size)
    dense = dense_query_heads(q, chunk_counts.view(shape.batch, shape.kv_heads, -1).sum(dim=-1),
                              seqlen=shape.seqlen, block_m=bm, block_n=bn, rates=active_rates(q))
    if len(dense) == shape.q_heads:
        return dense_heads_into(q, k, v, dense, None, scale=scale)
    if dense:
        keep, chunk_counts = first_key_only(keep, chunk_counts, sorted({h // shape.group for h in dense}))
    packed = pack(k, v, keep, chunk_counts, chunk=size, block=bn).mark_valid()
    return _two_phases(q, k, v, packed, bm=bm, count_weighted=count_weighted, exact_diagonal=exact_diagonal,
                       scale=scale, dense=dense)


def first_key_only(keep: torch.Tensor, chunk_counts: torch.Tensor,
                   kv_heads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The keep mask and anchors per chunk with the KV heads `kv_heads` keeping their first
    key only (one anchor, a segment of one packed block): what the packing of a KV head
    that runs dense costs.

    Args:
        keep: bool `[B, Hkv, N]`; chunk_counts: int32 `[B * Hkv, C]` (`keep_mask`'s).
        kv_heads: sorted KV heads.

    Returns:
        New (keep, chunk_counts); the inputs are not modified.
    """
    b, hkv, _ = keep.shape
    idx = torch.tensor(kv_heads, device=keep.device)
    keep = keep.clone()
    keep[:, idx, 1:] = False
    counts = chunk_counts.clone().view(b, hkv, -1)
    counts[:, idx] = 0
    counts[:, idx, 0] = 1
    return keep, counts.view(b * hkv, -1)


def delta_kv_density(q: torch.Tensor, packed: PackedKV, *, block_m: int = 64) -> torch.Tensor:
    """Score entries the two phases compute, over the causal area (see the reference).

    Raises:
        TypeError, ValueError: bad inputs (as `delta_kv_plans`).
    """
    plan1, plan2 = delta_kv_plans(q, packed, block_m=block_m)
    n = packed.seqlen
    rows = (n - torch.arange(plan1.num_query_blocks, device=q.device) * plan1.block_m).clamp(max=plan1.block_m)
    phase1 = (plan1.block_count.to(torch.float64) * packed.block * rows).sum(dim=-1)
    return phase1 / (n * (n + 1) / 2) + density(plan2)
