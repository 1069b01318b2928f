"""Triton kernels for DPXA (see `reference.dpxa` for the spec).

1. The anchors: Delta-KV's stage-1 kernel (`fast.kernels.delta_pack.keep_mask`, bit-
   identical to `reference.delta_kv.delta_keep_mask`) with the tile as the chunk, on the
   queries and on the keys; each row's anchor positions are then packed to its front
   (`[B * H, N]`, one cumsum and one scatter) with each tile's first slot
   (`[B * H, T + 1]`), `delta_anchor_packed`.
2. `_anchor_tile_kernel`: per query head, `TQ` consecutive query tiles and up to
   `key_tiles` key tiles of their causal range (the range split over programs, so the
   launch fills the GPU at 8K-32K), the Q anchors of those tiles (`BLOCK_M` at a time,
   whatever tile they belong to) against each key tile's packed K anchors (`BLOCK_K` at
   a time): the work is the anchor pairs (`alpha * beta` of the causal tile pairs) plus
   one partial chunk per key tile. Per query tile a running maximum (rows map to their
   query tile through a one-hot `[BLOCK_M, TQ]` mask); per (query tile, key tile) the
   absolute log2-sum-exp of its pairs is stored in the output. Optionally (`FLAT`) one
   flat loop over the range's chunks with the next chunk's loads issued first.
3. `_normalise_rows_kernel`: each row of the output into weights (online max and sum
   over the causal entries, one write pass). Only `[B, Hq, T, T]` is written, no scan.

   The kernels it replaces (docs/xattention.md, "DPXA scoring"): one program per row
   block walking its whole key range (128 programs at 32K, latency-bound with
   one warp per scheduler, ncu), per-tile slots of 32 (157
   ms at 128K on an H200: three slots in four padding), then 16 output rows per program
   against 64 packed K anchors a step with a segmented scan per step (52.6 ms at 128K on an
   H100: few Q rows per K read, a scan per step, and 8-17 s a call in the interpreter).

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
    interpreter_active,
)
from .delta_pack import keep_mask
from .xattention_score import check_fast_block


@triton.jit
def _anchor_pairs(
    p_q, p_qpos, b_q0, q_pos0, m_r0, r_count, b_k, k_pos, m_c, acc, m_run,
    qk_scale, block, i_t0, stride_qn, stride_qd, o_m, o_d, m_d, o_t,
    BLOCK_M: tl.constexpr, DOT_F32: tl.constexpr,
):
    # One chunk of K anchors against every Q anchor of the program (BLOCK_M at a time):
    # the running maxima and the chunk's exp-sums per output row. The first BLOCK_M rows
    # stay in registers (all of them where the tiles have few Q anchors, as on the bench
    # workload); later row chunks are reloaded.
    for r0 in range(0, r_count, BLOCK_M):
        m_r = m_r0
        q_pos = q_pos0
        b_q = b_q0
        if r0 > 0:
            m_r = r0 + o_m < r_count
            q_pos = tl.load(p_qpos + r0 + o_m, mask=m_r, other=0)
            b_q = tl.load(p_q + q_pos.to(tl.int64)[:, None] * stride_qn + o_d[None, :] * stride_qd,
                          mask=m_r[:, None] & m_d[None, :], other=0.0)
        # Sec. 4.3: one cell of the full tile per anchor pair; causal per token.
        if DOT_F32:
            b_s = tl.dot(b_q.to(tl.float32), b_k.to(tl.float32)) * qk_scale
        else:
            b_s = tl.dot(b_q, b_k) * qk_scale
        valid = m_r[:, None] & m_c[None, :] & (k_pos[None, :] <= q_pos[:, None]) \
            & (tl.abs(b_s) < float("inf"))
        b_s = tl.where(valid, b_s, float("-inf"))
        # Row r belongs to output row (query tile) q_pos // block - i_t0.
        hot = ((q_pos // block - i_t0)[:, None] == o_t[None, :]) & m_r[:, None]
        t_max = tl.max(tl.where(hot, tl.max(b_s, 1)[:, None], float("-inf")), 0)
        m_new = tl.maximum(m_run, t_max)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        r_shift = tl.sum(tl.where(hot, m_shift[None, :], 0.0), 1)
        r_sum = tl.sum(tl.math.exp2(b_s - r_shift[:, None]), 1)
        acc = acc * tl.math.exp2(m_run - m_shift) + tl.sum(tl.where(hot, r_sum[:, None], 0.0), 0)
        m_run = m_new
    return acc, m_run


@triton.jit
def _anchor_tile_kernel(
    Q, K, Q_POS, Q_START, K_POS, K_START, W,
    qk_scale, head_dim, num_heads, group, num_kv_heads, block, num_tiles, pos_stride,
    key_tiles, num_splits,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    TQ: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr,
    FLAT: tl.constexpr, DOT_F32: tl.constexpr,
):
    # One program: query head h (the group's heads are adjacent programs, so they read the
    # same K anchors at about the same time, from L2), TQ consecutive query tiles and up
    # to `key_tiles` consecutive key tiles of their causal range (split `i_split` of
    # `num_splits`; a split past the range does nothing). Its rows are the Q anchors of
    # those query tiles (R of them, BLOCK_M at a time, whatever tile they belong to); it
    # walks its key tiles, each tile's packed K anchors BLOCK_K at a time, so the work is
    # the anchor pairs plus one partial chunk per key tile. Per output row (query tile) t:
    # a running maximum m_t and, per key tile j, sum exp2(s - m_t) over the pairs of t's
    # anchors and j's anchors (causal per token), stored as the absolute log2-sum-exp
    # lse_tj in W; `_normalise_rows_kernel` then turns each row into weights. No segmented
    # scan, no scratch: W ([B, Hq, T, T]) is the only output.
    # FLAT: one loop over the range's chunks (a key tile's last chunk ends it), the next
    # chunk's positions and K rows loaded before this chunk's math; else a loop over key
    # tiles with a loop over their chunks.
    i_g = tl.program_id(0)
    i_split = tl.program_id(1) % num_splits
    i_t0 = (tl.num_programs(1) // num_splits - 1 - tl.program_id(1) // num_splits) * TQ  # longest rows first
    i_bkv = tl.program_id(2)
    i_b = i_bkv // num_kv_heads
    i_hkv = i_bkv % num_kv_heads
    i_h = i_hkv * group + i_g
    i_bh = i_b * num_heads + i_h
    t_end = tl.minimum(i_t0 + TQ, num_tiles)
    j_lo = i_split * key_tiles
    j_hi = tl.maximum(tl.minimum(j_lo + key_tiles, t_end), j_lo)
    p_qs = Q_START + i_bh.to(tl.int64) * (num_tiles + 1)
    r_begin = tl.load(p_qs + i_t0)
    r_count = tl.load(p_qs + t_end) - r_begin
    p_qpos = Q_POS + i_bh.to(tl.int64) * pos_stride + r_begin
    p_q = Q + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh
    p_kpos = K_POS + i_bkv.to(tl.int64) * pos_stride
    p_ks = K_START + i_bkv.to(tl.int64) * (num_tiles + 1)
    p_k = K + i_b.to(tl.int64) * stride_kb + i_hkv.to(tl.int64) * stride_kh
    o_m = tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, HEAD_DIM)
    m_d = o_d < head_dim
    o_k = tl.arange(0, BLOCK_K)
    o_t = tl.arange(0, TQ)
    m_t = i_t0 + o_t < num_tiles
    p_w = W + (i_bh.to(tl.int64) * num_tiles + i_t0 + o_t) * num_tiles
    m_run = tl.full([TQ], float("-inf"), tl.float32)
    m_r0 = o_m < r_count
    q_pos0 = tl.load(p_qpos + o_m, mask=m_r0, other=0)
    b_q0 = tl.load(p_q + q_pos0.to(tl.int64)[:, None] * stride_qn + o_d[None, :] * stride_qd,
                   mask=m_r0[:, None] & m_d[None, :], other=0.0)
    acc = tl.zeros([TQ], tl.float32)
    if FLAT:
        j = j_lo
        c0 = tl.load(p_ks + j_lo)
        k_stop = tl.load(p_ks + j_lo + 1)
        o_c = c0 + o_k
        m_c = o_c < tl.where(j < j_hi, k_stop, c0)  # an empty range: no chunk
        k_pos = tl.load(p_kpos + o_c, mask=m_c, other=0)
        b_k = tl.load(p_k + k_pos.to(tl.int64)[None, :] * stride_kn + o_d[:, None] * stride_kd,
                      mask=m_c[None, :] & m_d[:, None], other=0.0)
        while j < j_hi:
            # The next chunk: the rest of tile j, or tile j + 1's first (an empty tile
            # is one empty chunk); its loads are issued before this chunk's math.
            done = c0 + BLOCK_K >= k_stop
            n_c0 = tl.where(done, k_stop, c0 + BLOCK_K)
            n_j = tl.where(done, j + 1, j)
            n_stop = tl.where(done, tl.load(p_ks + tl.minimum(n_j + 1, num_tiles)), k_stop)
            n_oc = n_c0 + o_k
            n_mc = n_oc < tl.where(n_j < j_hi, n_stop, n_c0)  # past the range: empty
            n_kpos = tl.load(p_kpos + n_oc, mask=n_mc, other=0)
            n_bk = tl.load(p_k + n_kpos.to(tl.int64)[None, :] * stride_kn + o_d[:, None] * stride_kd,
                           mask=n_mc[None, :] & m_d[:, None], other=0.0)
            acc, m_run = _anchor_pairs(p_q, p_qpos, b_q0, q_pos0, m_r0, r_count, b_k, k_pos, m_c, acc, m_run,
                                       qk_scale, block, i_t0, stride_qn, stride_qd, o_m, o_d, m_d, o_t,
                                       BLOCK_M, DOT_F32)
            # acc > 0 only where m_run is finite.
            lse = tl.where(acc > 0, m_run + tl.math.log2(acc), float("-inf"))
            done_t = c0 + BLOCK_K + 0 * o_t >= k_stop  # `done` per output row (a vector mask)
            tl.store(p_w + j, lse, mask=m_t & done_t)
            acc = tl.where(done_t, 0.0, acc)
            c0, k_stop, j = n_c0, n_stop, n_j
            k_pos, b_k, m_c = n_kpos, n_bk, n_mc
    else:
        for j in range(j_lo, j_hi):
            k0 = tl.load(p_ks + j)
            k1 = tl.load(p_ks + j + 1)
            acc = tl.zeros([TQ], tl.float32)
            for c0 in range(k0, k1, BLOCK_K):
                o_c = c0 + o_k
                m_c = o_c < k1
                k_pos = tl.load(p_kpos + o_c, mask=m_c, other=0)
                b_k = tl.load(p_k + k_pos.to(tl.int64)[None, :] * stride_kn + o_d[:, None] * stride_kd,
                              mask=m_c[None, :] & m_d[:, None], other=0.0)
                acc, m_run = _anchor_pairs(p_q, p_qpos, b_q0, q_pos0, m_r0, r_count, b_k, k_pos, m_c, acc, m_run,
                                           qk_scale, block, i_t0, stride_qn, stride_qd, o_m, o_d, m_d, o_t,
                                           BLOCK_M, DOT_F32)
            lse = tl.where(acc > 0, m_run + tl.math.log2(acc), float("-inf"))
            tl.store(p_w + j, lse, mask=m_t)


@triton.jit
def _normalise_rows_kernel(W, rows, num_tiles, ROWS: tl.constexpr, BLOCK_J: tl.constexpr):
    # ROWS rows of W ([B * Hq * T, T], absolute log2-sum-exps where j <= t) into weights:
    # exp2(lse - max) / sum over the causal entries, 0 past them. A row without any
    # finite score becomes NaN, every entry, as the reference's.
    o_r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    m_r = o_r < rows
    t = o_r % num_tiles
    p_w = W + o_r.to(tl.int64)[:, None] * num_tiles
    m = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    for j0 in range(0, num_tiles, BLOCK_J):
        o_j = j0 + tl.arange(0, BLOCK_J)
        causal = m_r[:, None] & (o_j[None, :] <= t[:, None])
        x = tl.load(p_w + o_j[None, :], mask=causal, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        total = total * tl.math.exp2(m - shift) + tl.sum(tl.math.exp2(x - shift[:, None]), 1)
        m = m_new
    for j0 in range(0, num_tiles, BLOCK_J):
        o_j = j0 + tl.arange(0, BLOCK_J)
        causal = m_r[:, None] & (o_j[None, :] <= t[:, None])
        x = tl.load(p_w + o_j[None, :], mask=causal, other=float("-inf"))
        tl.store(p_w + o_j[None, :], tl.math.exp2(x - m[:, None]) / total[:, None],
                 mask=m_r[:, None] & (o_j[None, :] < num_tiles))


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


# The scoring kernel's tiles on the GPU: (most query tiles per program, Q anchors per
# step, K anchors per step, key tiles per program (0: the whole causal range), flat loop
# with the next chunk prefetched, warps, stages). Every variant measured, with its time,
# is in docs/xattention.md (designs table, DPXA scoring). Kept (H200, 2026-11-26,
# bench workload): 32 query tiles and 32 Q anchors a step (fewer registers: more
# programs per SM) and 32 key tiles per program (the key range split: 1024 programs at
# 32K instead of 128), scoring 2.53 -> 1.25 ms at 32K and 15.8 -> 9.0 ms at 128K. Fewer
# query tiles per program (halving, down to 16) while the launch has fewer than
# MIN_PROGRAMS programs: off (0) since the key split fills the GPU.
SCORE_CONFIG: tuple[int, int, int, int, bool, int, int] = (32, 32, 64, 32, False, 4, 2)
MIN_PROGRAMS = 0
# Under the CPU interpreter: few, wide steps (it pays per operation, not per element);
# TQ is at most the next power of two of the tiles.
INTERPRETER_SCORE_CONFIG: tuple[int, int, int, int, bool, int, int] = (64, 128, 128, 0, False, 4, 1)
# Rows of W per program of the normalisation.
NORM_ROWS = 16
_MAX_GRID_Y = 65535


def _score_config(rows: int, tiles: int) -> tuple[int, int, int, int, bool, int, int]:
    """`(TQ, BLOCK_M, BLOCK_K, key tiles, flat, warps, stages)` for `rows` (batch x query
    heads) rows of tiles."""
    if interpreter_active():
        tq, block_m, block_k, key_tiles, flat, warps, stages = INTERPRETER_SCORE_CONFIG
        return min(tq, triton.next_power_of_2(tiles)), block_m, block_k, key_tiles, flat, warps, stages
    tq, block_m, block_k, key_tiles, flat, warps, stages = SCORE_CONFIG
    while tq > 16 and rows * cdiv(tiles, tq) < MIN_PROGRAMS:
        tq //= 2
    return tq, block_m, block_k, key_tiles, flat, warps, stages


def _anchor_tile_weights(q: torch.Tensor, k: torch.Tensor, *, cos_threshold: float, block: int,
                         sm_scale: float) -> torch.Tensor:
    """`dpxa_tile_weights` on checked inputs and parameters."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    tiles = cdiv(n, block)
    # Quadratic in tokens: the float32 weights (the kernel's only output), then the
    # selection's mask and lists (1 + 4 bytes a tile).
    check_device_memory(f"DPXA's tile scores and tile lists ([B, Hq, T, T], T = ceil(N / block) = {tiles})",
                        b * hq * tiles * tiles * (4 + 5), q.device,
                        hint="A larger `block` (T falls with its square) or fewer query heads per call fit.")
    _, q_pos, q_start = delta_anchor_packed(q, cos_threshold=cos_threshold, block=block)
    _, k_pos, k_start = delta_anchor_packed(k, cos_threshold=cos_threshold, block=block)
    weights = torch.empty(b, hq, tiles, tiles, dtype=torch.float32, device=q.device)
    tq, block_m, block_k, key_tiles, flat, warps, stages = _score_config(b * hq, tiles)
    row_blocks = cdiv(tiles, tq)
    # Key tiles per program: the whole range (one split), or as configured, widened
    # until the grid's second dimension fits.
    key_tiles = tiles if key_tiles <= 0 else min(key_tiles, tiles)
    while row_blocks * cdiv(tiles, key_tiles) > _MAX_GRID_Y:
        key_tiles *= 2
    splits = cdiv(tiles, key_tiles)
    _anchor_tile_kernel[(hq // hkv, row_blocks * splits, b * hkv)](
        q, k, q_pos, q_start, k_pos, k_start, weights,
        sm_scale * LOG2E, d, hq, hq // hkv, hkv, block, tiles, n + 1, key_tiles, splits,
        *q.stride(), *k.stride(),
        TQ=tq, BLOCK_M=block_m, BLOCK_K=block_k, HEAD_DIM=max(16, triton.next_power_of_2(d)),
        FLAT=flat, DOT_F32=interpreter_active() and q.dtype == torch.bfloat16,
        num_warps=warps, num_stages=stages,
    )
    rows = b * hq * tiles
    _normalise_rows_kernel[(cdiv(rows, NORM_ROWS),)](
        weights, rows, tiles, ROWS=NORM_ROWS, BLOCK_J=min(256, max(16, triton.next_power_of_2(tiles))),
    )
    return weights


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
