"""Triton kernels for Delta-KV Stages 1 and 2 (see `reference.delta_kv`).

1. `_keep_mask_kernel`: one lane per chunk (of every batch row and KV head), a block
   of lanes per program. Each lane walks its chunk in order (the anchor of a key is
   the last kept key before it, so the walk is sequential; chunks are independent
   because their first key is an anchor) and compares each key with the anchor in
   float64, summing over the head dimension in
   the same fixed pairwise order as the reference (`reference.delta_kv._tree_sum`:
   adjacent pairs, level by level, over the dimension padded to a power of two with
   zeros), with fused multiply-add turned off at launch. Every rounding is then the
   same as the reference's, so the keep masks agree bit for bit.
2. `_pack_kernel`: one program per (chunk, segment). From the chunk's keep flags it
   computes where each anchor lands in the flat packed buffer (the segment's offset
   plus the anchors of earlier chunks plus an exclusive prefix sum) and copies the
   anchor's key, value and position there.

The launchers (`keep_mask`, `pack`) do the rest with a few small torch ops: anchors
per chunk and per segment, segment offsets (one host synchronisation, to size the
flat buffer), and run lengths from consecutive anchor positions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...reference.delta_kv import PackedKV
from ...reference.plan import cdiv
from ._common import check_kernel_device, interpreter_active


@triton.jit
def _tree_sum(x, LANES: tl.constexpr, WIDTH: tl.constexpr):
    """Row sums of `x: [LANES, WIDTH]` (a power of two), adjacent pairs level by level: `[LANES]`."""
    if WIDTH >= 256:
        x = tl.sum(tl.reshape(x, [LANES, 128, 2]), 2)
    if WIDTH >= 128:
        x = tl.sum(tl.reshape(x, [LANES, 64, 2]), 2)
    if WIDTH >= 64:
        x = tl.sum(tl.reshape(x, [LANES, 32, 2]), 2)
    if WIDTH >= 32:
        x = tl.sum(tl.reshape(x, [LANES, 16, 2]), 2)
    if WIDTH >= 16:
        x = tl.sum(tl.reshape(x, [LANES, 8, 2]), 2)
    if WIDTH >= 8:
        x = tl.sum(tl.reshape(x, [LANES, 4, 2]), 2)
    if WIDTH >= 4:
        x = tl.sum(tl.reshape(x, [LANES, 2, 2]), 2)
    return tl.sum(tl.reshape(x, [LANES, 1, 2]), 2).reshape(LANES)


@triton.jit
def _keep_mask_kernel(
    K, THRESH, KEEP, CHUNK_COUNT,
    seqlen, head_dim, num_heads, chunk, num_chunks, total_chunks, thresh_stride,
    stride_kb, stride_kh, stride_kn, stride_kd,
    COSINE: tl.constexpr, LANES: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    # One lane per chunk (chunks of all batch rows and KV heads, LANES at a time); the
    # lanes walk their chunks in step, one key position per iteration.
    o_lane = tl.program_id(0) * LANES + tl.arange(0, LANES)
    m_lane = o_lane < total_chunks
    i_bh = o_lane // num_chunks
    i_c = o_lane % num_chunks
    i_b = i_bh // num_heads
    i_h = i_bh % num_heads
    start = i_c * chunk
    end = tl.minimum(start + chunk, seqlen)
    o_d = tl.arange(0, HEAD_DIM)
    m_d = o_d < head_dim
    p_k = K + i_b.to(tl.int64)[:, None] * stride_kb + i_h.to(tl.int64)[:, None] * stride_kh \
        + start.to(tl.int64)[:, None] * stride_kn + o_d[None, :] * stride_kd
    p_keep = KEEP + i_bh.to(tl.int64) * seqlen + start
    # threshold**2 and threshold, float64 (see reference.delta_kv.is_dropped), of each
    # lane's KV head (`thresh_stride` 0: one pair for every head).
    p_thresh = THRESH + i_h * thresh_stride
    t2 = tl.load(p_thresh, mask=m_lane, other=0.0)
    thr = tl.load(p_thresh + 1, mask=m_lane, other=0.0)
    anchor = tl.load(p_k, mask=m_lane[:, None] & m_d[None, :], other=0.0).to(tl.float64)
    tl.store(p_keep, tl.full([LANES], 1, tl.int8), mask=m_lane)
    kept = m_lane.to(tl.int32)
    # The anchor's squared norm (cosine): it changes only when the anchor does.
    na = _tree_sum(anchor * anchor, LANES, HEAD_DIM)
    for t in range(1, chunk):
        m_t = m_lane & (start + t < end)
        x = tl.load(p_k + t * stride_kn, mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float64)
        if COSINE:
            dot = _tree_sum(x * anchor, LANES, HEAD_DIM)
            nx = _tree_sum(x * x, LANES, HEAD_DIM)
            norms = nx * na
            # cos >= threshold without a square root (reference.delta_kv.is_dropped).
            dot2 = dot * dot
            rhs = t2 * norms
            similar = tl.where(thr > 0, (dot > 0) & (dot2 >= rhs), (dot >= 0) | (dot2 <= rhs))
            zero_sim = tl.where((nx == 0) & (na == 0), 1.0, 0.0).to(tl.float64)
            drop = tl.where(norms == 0, zero_sim >= thr, similar)
        else:
            diff = x - anchor
            drop = _tree_sum(diff * diff, LANES, HEAD_DIM) <= t2
        keep = m_t & ~drop
        tl.store(p_keep + t, keep.to(tl.int8), mask=m_t)
        anchor = tl.where(keep[:, None], x, anchor)
        if COSINE:
            na = tl.where(keep, nx, na)
        kept += keep.to(tl.int32)
    tl.store(CHUNK_COUNT + o_lane, kept, mask=m_lane)


@triton.jit
def _pack_kernel(
    K, V, KEEP, DEST, K_OUT, V_OUT, POS_OUT,
    seqlen, head_dim, num_heads, chunk,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    CHUNK_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    i_c = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // num_heads
    i_h = i_bh % num_heads
    start = i_c * chunk
    o_t = tl.arange(0, CHUNK_P2)
    pos = start + o_t
    m_t = (o_t < chunk) & (pos < seqlen)
    keep = tl.load(KEEP + i_bh.to(tl.int64) * seqlen + pos, mask=m_t, other=0).to(tl.int32)
    # Row of each anchor in the flat buffer: where this chunk's anchors start, plus an
    # exclusive prefix sum of the keep flags.
    base = tl.load(DEST + i_bh * tl.num_programs(0) + i_c)
    row = base + tl.cumsum(keep, 0) - keep
    m_keep = m_t & (keep > 0)
    tl.store(POS_OUT + row, pos, mask=m_keep)
    o_d = tl.arange(0, HEAD_DIM)
    m_d = o_d < head_dim
    p_k = K + i_b.to(tl.int64) * stride_kb + i_h.to(tl.int64) * stride_kh \
        + pos.to(tl.int64)[:, None] * stride_kn + o_d[None, :] * stride_kd
    p_v = V + i_b.to(tl.int64) * stride_vb + i_h.to(tl.int64) * stride_vh \
        + pos.to(tl.int64)[:, None] * stride_vn + o_d[None, :] * stride_vd
    m_2d = m_keep[:, None] & m_d[None, :]
    dst = row.to(tl.int64)[:, None] * head_dim + o_d[None, :]
    tl.store(K_OUT + dst, tl.load(p_k, mask=m_2d, other=0.0), mask=m_2d)
    tl.store(V_OUT + dst, tl.load(p_v, mask=m_2d, other=0.0), mask=m_2d)


def threshold_args(threshold: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """float64 `[threshold**2, threshold]` as the kernel reads them (Python's float64 square),
    or `[Hkv, 2]` of those pairs for a per-KV-head threshold (float64 `[Hkv]`; the
    square is the same IEEE float64 product).

    A scalar is filled on the device by two fill kernels whose value travels as a kernel
    argument: no host-to-device copy and no synchronisation, so CUDA-graph capture
    accepts it (`out[0] = x` copies a host scalar, which the capture refuses).
    """
    if isinstance(threshold, torch.Tensor):
        t = threshold.to(torch.float64)
        return torch.stack([t * t, t], dim=1).to(device).contiguous()
    out = torch.empty(2, dtype=torch.float64, device=device)
    out[:1].fill_(threshold * threshold)
    out[1:].fill_(threshold)
    return out


def keep_mask(k: torch.Tensor, *, threshold: float | torch.Tensor, cosine: bool,
              chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 on checked inputs: (keep bool `[B, Hkv, N]`, anchors per chunk int32 `[B * Hkv, C]`).

    `threshold`: a float, or float64 `[Hkv]` (one per KV head, checked by the caller)."""
    check_kernel_device(k)
    b, h, n, d = k.shape
    chunk = min(chunk, n)
    nc = cdiv(n, chunk)
    keep = torch.zeros(b * h, n, dtype=torch.int8, device=k.device)
    counts = torch.empty(b * h, nc, dtype=torch.int32, device=k.device)
    total = b * h * nc
    # On a GPU 16 chunks per program (a warp's worth of float64 lanes per step); in the
    # interpreter all of them, since its cost is per operation, not per element.
    lanes = min(triton.next_power_of_2(total), 64 if interpreter_active() else 16)
    extra = {} if interpreter_active() else {"enable_fp_fusion": False}
    _keep_mask_kernel[(triton.cdiv(total, lanes),)](
        k, threshold_args(threshold, k.device), keep, counts,
        n, d, h, chunk, nc, total, 2 if isinstance(threshold, torch.Tensor) else 0, *k.stride(),
        COSINE=cosine, LANES=lanes, HEAD_DIM=max(2, triton.next_power_of_2(d)), num_warps=4, **extra,
    )
    return keep.view(b, h, n).bool(), counts


def pack(
    k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, chunk_counts: torch.Tensor | None, *,
    chunk: int, block: int,
) -> PackedKV:
    """Stage 2 on checked inputs (see `reference.delta_pack`)."""
    check_kernel_device(k)
    b, h, n, d = k.shape
    chunk = min(chunk, n)
    nc = cdiv(n, chunk)
    if chunk_counts is None:
        padded = torch.zeros(b * h, nc * chunk, dtype=torch.int32, device=k.device)
        padded[:, :n] = keep.view(b * h, n).to(torch.int32)
        chunk_counts = padded.view(b * h, nc, chunk).sum(dim=-1, dtype=torch.int32)
    lengths = chunk_counts.sum(dim=1)
    rows = torch.div(lengths + block - 1, block, rounding_mode="floor") * block
    offsets = torch.zeros(b * h + 1, dtype=torch.int64, device=k.device)
    offsets[1:] = torch.cumsum(rows, 0)
    total = int(offsets[-1].item())  # the one host synchronisation: the buffer's size
    # Where each chunk's first anchor lands: segment start + anchors of its earlier chunks.
    dest = offsets[:-1, None] + torch.cumsum(chunk_counts, 1) - chunk_counts
    k_out = torch.zeros(total, d, dtype=k.dtype, device=k.device)
    v_out = torch.zeros(total, d, dtype=v.dtype, device=v.device)
    pos = torch.full((total,), -1, dtype=torch.int32, device=k.device)
    keep8 = keep.reshape(b * h, n).to(torch.int8)
    _pack_kernel[(nc, b * h)](
        k, v, keep8, dest.contiguous(), k_out, v_out, pos,
        n, d, h, chunk, *k.stride(), *v.stride(),
        CHUNK_P2=triton.next_power_of_2(chunk), HEAD_DIM=max(16, triton.next_power_of_2(d)),
        num_warps=4,
    )
    # Run lengths: the next anchor's position (or N) minus this one's, within a segment.
    seg = torch.repeat_interleave(torch.arange(b * h, device=k.device), rows, output_size=total)
    seg_end = torch.full_like(pos, n)
    real = pos >= 0
    nxt = torch.cat([pos[1:], pos.new_full((1,), -1)])
    same_seg = torch.cat([seg[1:] == seg[:-1], seg.new_zeros(1, dtype=torch.bool)])
    nxt = torch.where(same_seg & (nxt >= 0), nxt, seg_end)
    counts = torch.where(real, nxt - pos, 0).to(torch.int32)
    stamps = torch.zeros_like(counts)
    if total:
        # Running sum of counts per segment, minus 1 (padding repeats the last).
        csum = torch.cumsum(counts.to(torch.int64), 0)
        seg_base = torch.cat([csum.new_zeros(1), csum])[offsets[:-1]][seg]
        stamps = (csum - seg_base - 1).to(torch.int32)
    return PackedKV(k=k_out, v=v_out, counts=counts, timestamps=stamps, offsets=offsets,
                    lengths=lengths.view(b, h).to(torch.int32), seqlen=n, block=block)
