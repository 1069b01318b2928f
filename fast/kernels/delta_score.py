"""Triton kernels for DPXA (see `reference.dpxa` for the spec).

1. The anchors: Delta-KV's stage-1 kernel (`fast.kernels.delta_pack.keep_mask`, bit-
   identical to `reference.delta_kv.delta_keep_mask`) with the tile as the chunk, on the
   queries and on the keys; each row's anchor positions are then packed to its front
   (`[B * H, N]`, one cumsum and one scatter) with each tile's first slot
   (`[B * H, T + 1]`), `delta_anchor_packed`.
2. `_anchor_row_kernel`: per (query tile, query head), the Q anchors of the query tile
   against the packed K anchors of key tiles `0..i`, `BLOCK_K` of them per step whatever
   tile they belong to, so the work is the anchor pairs (`alpha * beta` of the causal
   tile pairs) with no per-tile padding; `sum exp2(s - m)` per key, `m` the running
   maximum over the row; the keys' sums are added per key tile by a segmented scan, and
   a tile's sum is stored with the `m` it is relative to once its last anchor is seen.
   The launcher rescales the row to its final maximum and normalises it. Only
   `[B, Hq, T, T]` is written.

   The kernel it replaces gave every key tile `BLOCK_A` = 32 slots and gathered them
   through per-tile position lists: at the bench workload's 7.5% anchors (10 per
   128-token tile) three slots in four were padding, 157 ms at 128K on an H200
   (docs/xattention.md has the figures).

GQA maps query head `h` to KV head `h // G` (K anchors are computed once per KV
head). No host synchronisation.

Layout: kernels -> launchers (`delta_anchor_packed`, `dpxa_tile_weights`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...reference._checks import HALF_DTYPES, check_qk, per_head, resolve_scale
from ...reference.dpxa import check_dpxa_params
from ...reference.xattention import check_threshold
from ...reference.plan import cdiv
from ._common import (
    LOG2E,
    check_device_memory,
    check_forward_only,
    check_kernel_device,
    dot as _dot,
    interpreter_active,
)
from .delta_pack import keep_mask
from .xattention_score import check_fast_block


@triton.jit
def _segment_add(v1, f1, v2, f2):
    # Segmented sum: a flag opens a new segment (run of keys of one tile).
    return tl.where(f2 != 0, v2, v1 + v2), f1 | f2


@triton.jit
def _anchor_row_kernel(
    Q, K, Q_POS, Q_START, K_POS, K_START, ACC, MAX,
    qk_scale, head_dim, num_heads, group, num_kv_heads, block, num_tiles, pos_stride,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    G_PAD: tl.constexpr, TQ: tl.constexpr, SLOTS: tl.constexpr, BLOCK_K: tl.constexpr,
    HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr,
):
    # OUT = G_PAD x TQ output rows per program: the query heads of one KV head times TQ
    # query tiles. They share the KV head, so one pass over its packed K anchors (those of
    # key tiles up to the last query tile) serves them all: the K rows are read once per
    # OUT rows of weights, not once per row. Each step scores SLOTS Q anchors of every
    # output row (more passes where a tile has more anchors) against BLOCK_K packed K
    # anchors whatever tile they belong to: the work is the anchor pairs, no per-tile
    # padding. Keys past a query anchor are masked (causal per token), so a query tile
    # earlier than the program's last gets exact zeros for key tiles after it.
    OUT: tl.constexpr = G_PAD * TQ
    i_t0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * TQ  # longest rows first
    i_bkv = tl.program_id(1)
    i_b = i_bkv // num_kv_heads
    i_hkv = i_bkv % num_kv_heads
    o_out = tl.arange(0, OUT)
    i_g = o_out // TQ
    i_t = i_t0 + o_out % TQ
    m_out = (i_g < group) & (i_t < num_tiles)
    i_h = i_hkv * group + i_g
    i_bh = i_b * num_heads + i_h
    o_d = tl.arange(0, HEAD_DIM)
    m_d = o_d < head_dim
    o_k = tl.arange(0, BLOCK_K)
    p_start = Q_START + i_bh.to(tl.int64) * (num_tiles + 1) + i_t
    q_start = tl.load(p_start, mask=m_out, other=0)
    q_end = tl.load(p_start + 1, mask=m_out, other=0)
    most = tl.max(q_end - q_start, 0)
    last_tile = tl.minimum(i_t0 + TQ, num_tiles) - 1
    k_end = tl.load(K_START + i_bkv.to(tl.int64) * (num_tiles + 1) + last_tile + 1)
    p_q = Q + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64)[:, None, None] * stride_qh \
        + o_d[None, None, :] * stride_qd
    p_qpos = Q_POS + i_bh.to(tl.int64) * pos_stride
    p_k = K + i_b.to(tl.int64) * stride_kb + i_hkv.to(tl.int64) * stride_kh + o_d[:, None] * stride_kd
    p_kpos = K_POS + i_bkv.to(tl.int64) * pos_stride
    p_row = (i_bh.to(tl.int64) * num_tiles + i_t) * num_tiles
    o_s = tl.arange(0, SLOTS)
    m_run = tl.full([OUT], float("-inf"), tl.float32)
    carry = tl.zeros([OUT], tl.float32)
    carry_tile = tl.max(tl.full([BLOCK_K], -1, tl.int32), 0)  # none yet (a scalar tensor)
    for c0 in range(0, k_end, BLOCK_K):
        o_c = c0 + o_k
        m_c = o_c < k_end
        k_pos = tl.load(p_kpos + o_c, mask=m_c, other=0)
        k_tile = tl.where(m_c, k_pos // block, num_tiles)
        b_k = tl.load(p_k + k_pos.to(tl.int64)[None, :] * stride_kn, mask=m_c[None, :] & m_d[:, None], other=0.0)
        col = tl.zeros([OUT, BLOCK_K], tl.float32)
        for a0 in range(0, most, SLOTS):
            # Slot s of output row o: the (a0 + s)-th Q anchor of its query tile.
            i_a = q_start[:, None] + a0 + o_s[None, :]
            m_a = m_out[:, None] & (i_a < q_end[:, None])
            q_pos = tl.load(p_qpos[:, None] + i_a, mask=m_a, other=0)
            b_q = tl.load(p_q + q_pos.to(tl.int64)[:, :, None] * stride_qn,
                          mask=m_a[:, :, None] & m_d[None, None, :], other=0.0)
            # Sec. 4.3: one cell of the full tile per anchor pair; causal per token.
            b_s = _dot(tl.reshape(b_q, (OUT * SLOTS, HEAD_DIM)), b_k, DOT_F32) * qk_scale
            b_s = tl.reshape(b_s, (OUT, SLOTS, BLOCK_K))
            valid = m_a[:, :, None] & m_c[None, None, :] & (k_pos[None, None, :] <= q_pos[:, :, None]) \
                & (tl.abs(b_s) < float("inf"))
            b_s = tl.where(valid, b_s, float("-inf"))
            m_new = tl.maximum(m_run, tl.max(tl.max(b_s, 2), 1))
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.math.exp2(m_run - m_shift)
            col = col * alpha[:, None] + tl.sum(tl.math.exp2(b_s - m_shift[:, None, None]), 1)
            carry = carry * alpha
            m_run = m_new
        # The tile before this step's first key is complete unless it continues here.
        first_tile = tl.min(k_tile, 0)
        done = m_out & (tl.zeros([OUT], tl.int32) + carry_tile >= 0) & (tl.zeros([OUT], tl.int32) + carry_tile != first_tile)
        tl.store(ACC + p_row + carry_tile, carry, mask=done)
        tl.store(MAX + p_row + carry_tile, m_run, mask=done)
        col = col + tl.where((o_k[None, :] == 0) & (k_tile[None, :] == carry_tile), carry[:, None], 0.0)
        prev_pos = tl.load(p_kpos + o_c - 1, mask=m_c & (o_c > 0), other=-block)
        opens = tl.zeros([OUT, BLOCK_K], tl.int32) + (prev_pos // block != k_tile).to(tl.int32)[None, :]
        seg, _ = tl.associative_scan((col, opens), 1, _segment_add)
        next_pos = tl.load(p_kpos + o_c + 1, mask=(o_k + 1 < BLOCK_K) & (o_c + 1 < k_end), other=-block)
        closes = m_c & (o_k + 1 < BLOCK_K) & (o_c + 1 < k_end) & (next_pos // block != k_tile)
        m_store = m_out[:, None] & closes[None, :]
        tl.store(ACC + p_row[:, None] + k_tile[None, :], seg, mask=m_store)
        tl.store(MAX + p_row[:, None] + k_tile[None, :], tl.zeros([OUT, BLOCK_K], tl.float32) + m_run[:, None],
                 mask=m_store)
        # The step's last tile may go on in the next step: carry it.
        last = tl.minimum(BLOCK_K, k_end - c0) - 1
        carry = tl.sum(tl.where(o_k[None, :] == last, seg, 0.0), 1)
        carry_tile = tl.max(tl.where(o_k == last, k_tile, -1), 0)
    done = m_out & (tl.zeros([OUT], tl.int32) + carry_tile >= 0)
    tl.store(ACC + p_row + carry_tile, carry, mask=done)
    tl.store(MAX + p_row + carry_tile, m_run, mask=done)


def delta_anchor_lists(
    x: torch.Tensor, *, cos_threshold: float, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Delta anchors of `x: [B, H, N, D]` per tile of `block` tokens, packed per tile.

    Returns:
        (anchors bool `[B, H, N]`, positions int32 `[B, H, T, block]` with each tile's
        anchors first, in order, counts int32 `[B, H, T]`).
    """
    b, h, n, _ = x.shape
    tiles = cdiv(n, block)
    keep, _ = keep_mask(x, threshold=cos_threshold, cosine=True, chunk=min(block, n))
    padded = torch.zeros(b, h, tiles * block, dtype=torch.int8, device=x.device)
    padded[:, :, :n] = keep.to(torch.int8)
    padded = padded.view(b, h, tiles, block)
    # A stable sort of the dropped flags puts each tile's anchors first, in order.
    order = torch.sort(1 - padded, dim=-1, stable=True).indices
    start = torch.arange(tiles, device=x.device, dtype=torch.int64)[:, None] * block
    pos = (order + start).to(torch.int32)
    return keep, pos, padded.sum(dim=-1, dtype=torch.int32)


def delta_anchor_packed(
    x: torch.Tensor, *, cos_threshold: float, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Delta anchors of `x: [B, H, N, D]`, packed per row (no host synchronisation).

    Returns:
        (anchors bool `[B, H, N]`, positions int32 `[B * H, N]`: each row's anchor
        positions ascending, first (the rest is padding), tile starts int32
        `[B * H, T + 1]`: anchors of tile `t` are `positions[:, start[t]:start[t + 1]]`).
    """
    b, h, n, _ = x.shape
    tiles = cdiv(n, block)
    keep, counts = keep_mask(x, threshold=cos_threshold, cosine=True, chunk=min(block, n))
    flags = keep.view(b * h, n)
    # Each anchor's slot: the anchors before it in its row. Dropped keys go to slot N
    # (a spare column) so that one scatter does it all.
    slot = torch.where(flags, torch.cumsum(flags, 1, dtype=torch.int32) - 1, n).to(torch.int64)
    pos = torch.zeros(b * h, n + 1, dtype=torch.int32, device=x.device)
    pos.scatter_(1, slot, torch.arange(n, dtype=torch.int32, device=x.device).expand(b * h, n))
    start = torch.zeros(b * h, tiles + 1, dtype=torch.int32, device=x.device)
    start[:, 1:] = torch.cumsum(counts, 1)
    return keep, pos, start


def _anchor_tile_weights(q: torch.Tensor, k: torch.Tensor, *, cos_threshold: float, block: int,
                         sm_scale: float) -> torch.Tensor:
    """`dpxa_tile_weights` on checked inputs and parameters."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    tiles = cdiv(n, block)
    # Quadratic in tokens: sums and running maxima, the rescaling's temporaries and the
    # normalised weights (5 float32 copies), then the selection's mask and lists (1 + 4).
    check_device_memory(f"DPXA's tile scores and tile lists ([B, Hq, T, T], T = ceil(N / block) = {tiles})",
                        b * hq * tiles * tiles * (5 * 4 + 5), q.device,
                        hint="A larger `block` (T falls with its square) or fewer query heads per call fit.")
    _, q_pos, q_start = delta_anchor_packed(q, cos_threshold=cos_threshold, block=block)
    _, k_pos, k_start = delta_anchor_packed(k, cos_threshold=cos_threshold, block=block)
    acc = torch.zeros(b, hq, tiles, tiles, dtype=torch.float32, device=q.device)
    row_max = torch.full((b, hq, tiles, tiles), float("-inf"), dtype=torch.float32, device=q.device)
    # 16 output rows per program (the group's heads x query tiles) where the group allows,
    # and slots enough for a dot of at least 16 rows.
    g_pad = triton.next_power_of_2(hq // hkv)
    tq = max(1, 16 // g_pad)
    slots = max(1, 16 // (g_pad * tq))
    block_k = 128 if interpreter_active() else 64
    _anchor_row_kernel[(cdiv(tiles, tq), b * hkv)](
        q, k, q_pos, q_start, k_pos, k_start, acc, row_max,
        sm_scale * LOG2E, d, hq, hq // hkv, hkv, block, tiles, n + 1, *q.stride(), *k.stride(),
        G_PAD=g_pad, TQ=tq, SLOTS=slots, BLOCK_K=block_k, HEAD_DIM=max(16, triton.next_power_of_2(d)),
        DOT_F32=interpreter_active() and q.dtype == torch.bfloat16,
        num_warps=4, num_stages=1 if interpreter_active() else 2,
    )
    # Each tile's sum is relative to the running maximum when it was written.
    final = row_max.amax(dim=-1, keepdim=True)
    scores = acc * torch.exp2(row_max - final)
    return scores / scores.sum(dim=-1, keepdim=True)


def check_dpxa_inputs(q: torch.Tensor, k: torch.Tensor, *, cos_threshold: float, threshold: object,
                      block: int) -> tuple[float, torch.Tensor, int]:
    """The fast DPXA checks, once: inputs (dtype, device, no autograd, D <= 256), parameters.

    Returns:
        (cos_threshold, threshold, block) as `check_dpxa_params` normalises them, the
        threshold per query head: float64 `[Hq]` on q's device (`per_head`).

    Raises:
        TypeError, ValueError: bad inputs or parameters, before any launch.
    """
    shape = check_qk(q, k, dtypes=HALF_DTYPES)
    check_kernel_device(q)
    check_forward_only(q, k)
    cos, _, bs = check_dpxa_params(cos_threshold=cos_threshold, threshold=threshold, block=block)
    check_fast_block(bs)
    if shape.head_dim > 256:
        raise ValueError(f"head dim D must be <= 256 for the fast kernels, got {shape.head_dim}")
    return cos, per_head(threshold, "threshold", shape.q_heads, check_threshold, device=q.device), bs


def dpxa_tile_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    cos_threshold: float = 0.75,
    block: int = 128,
    scale: float | None = None,
) -> torch.Tensor:
    """DPXA tile weights (see `reference.dpxa.dpxa_tile_weights`).

    Args:
        q: `[B, Hq, N, D]` float16/bfloat16; k: `[B, Hkv, N, D]`.
        cos_threshold: in `[-1, 1]`.
        block: tokens per tile, a multiple of 16.
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        float32 `[B, Hq, T, T]`: rows sum to 1 over `j <= i`; non-causal entries are 0.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    cos_threshold, _, block = check_dpxa_inputs(q, k, cos_threshold=cos_threshold, threshold=1.0, block=block)
    sm_scale = resolve_scale(scale, q.shape[3])
    return _anchor_tile_weights(q, k, cos_threshold=cos_threshold, block=block, sm_scale=sm_scale)


def dpxa_scoring_ratio(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    cos_threshold: float = 0.75,
    block: int = 128,
) -> torch.Tensor:
    """Section 4.3's scoring ratio per (batch, query head) (see `reference.dpxa.dpxa_scoring_ratio`).

    Returns:
        float64 `[B, Hq]`.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    cos_threshold, _, block = check_dpxa_inputs(q, k, cos_threshold=cos_threshold, threshold=1.0, block=block)
    n = q.shape[2]
    g = q.shape[1] // k.shape[1]
    _, _, q_count = delta_anchor_lists(q, cos_threshold=cos_threshold, block=block)
    _, _, k_count = delta_anchor_lists(k, cos_threshold=cos_threshold, block=block)
    alpha = q_count.sum(dim=-1).to(torch.float64) / n
    beta = k_count.sum(dim=-1).to(torch.float64) / n
    return alpha * beta.repeat_interleave(g, dim=1)
