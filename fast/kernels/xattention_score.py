"""Triton kernels for XAttention's tile weights (see `reference.xattention` for the spec).

The stride-level scores (one per query group x key group, `[G, G]` per head with
`G ~ N / stride`) are never stored. Two kernels:

1. `_row_tile_lse_kernel`: per (tile of `BLOCK_R` query groups, head), walks the key
   groups `TILES_PER_STEP` key tiles at a time, computes the scores (antidiagonal: a
   sum of `stride` tile products `q[start_g + a] . k[start_h + S - 1 - a]`, so the
   head-dim concatenation of section 2.5 is never built; naive: one product), and
   writes, per query group and key tile, the log2-sum-exp of the group's scores in
   that tile, plus each group's log2-sum-exp over the whole row (online). That is
   `[G, T]` floats per head (`block / stride` times fewer than `[G, G]`); the
   launcher runs heads in groups so that it stays under `_SCRATCH_BYTES`.
2. `_tile_weight_kernel`: per (query tile, head), `W[i, j] = sum_g exp2(lse_gj - lse_g)`
   over the query groups `g` of tile `i`: the row-softmax probabilities summed into tiles.

The launcher divides each row of `W` by its sum. Everything is fp32 (products of
16-bit inputs are exact in fp32; sums round). GQA maps query head `h` to KV head
`h // G`; K is never copied. No host synchronisation.

Layout: kernels -> launcher (`xattention_tile_weights`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...reference._checks import HALF_DTYPES, check_qk, per_head, resolve_scale
from ...reference.plan import cdiv
from ...reference.xattention import check_threshold, check_xattention_params
from ._common import (
    LOG2E,
    check_device_memory,
    check_forward_only,
    check_kernel_device,
    dot as _dot,
    interpreter_active,
)

# Largest per-launch [B, H, G, T] fp32 scratch of row-tile log-sum-exps.
_SCRATCH_BYTES = 256 << 20
# Key groups scored per step (a multiple of the padded groups per tile).
_STEP_COLUMNS = 64


def check_fast_block(block: int) -> None:
    """Raise ValueError unless `block` (the plan's tiles) is a multiple of 16."""
    if block % 16 != 0:
        raise ValueError(f"block must be a multiple of 16 for the fast kernels, got {block}")


@triton.jit
def _group_bounds(o_g, seqlen, block, stride, groups_per_tile):
    """First token and end (exclusive) of global groups `o_g` (tile-major order)."""
    i_t = o_g // groups_per_tile
    start = i_t * block + (o_g % groups_per_tile) * stride
    end = tl.minimum(tl.minimum(start + stride, i_t * block + block), seqlen)
    return start, end


@triton.jit
def _row_tile_lse_kernel(
    Q, K, TILE_LSE, ROW_LSE,
    qk_scale, seqlen, head_dim, num_heads, head0, group,
    block, stride, groups_per_tile, num_rows, num_tiles,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    BLOCK_R: tl.constexpr, GPT_PAD: tl.constexpr, TILES_PER_STEP: tl.constexpr,
    HEAD_DIM: tl.constexpr, TERMS: tl.constexpr, DOT_F32: tl.constexpr, LONGEST_FIRST: tl.constexpr,
    SPLIT: tl.constexpr, tiles_per_split,
):
    if SPLIT:
        # Grid (key splits, heads, row blocks): the programs of one row block, each on
        # `tiles_per_split` key tiles, are launched together and read the same query rows
        # (shared in L2); the row log-sum-exp is left to `_tile_weight_kernel`.
        i_split = tl.program_id(0)
        i_bh = tl.program_id(1)
        i_r = tl.num_programs(2) - 1 - tl.program_id(2)
    elif LONGEST_FIRST:
        # Grid (heads, row blocks), launched head-fastest from the last row block: the
        # longest causal rows of every head start first, the short ones fill the tail.
        i_bh = tl.program_id(0)
        i_r = tl.num_programs(1) - 1 - tl.program_id(1)
    else:
        i_r = tl.program_id(0)
        i_bh = tl.program_id(1)
    i_b = i_bh // num_heads
    i_h = head0 + i_bh % num_heads
    i_hkv = i_h // group
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_start, r_end = _group_bounds(o_r, seqlen, block, stride, groups_per_tile)
    m_r = (o_r < num_rows) & (r_start < seqlen)
    o_d = tl.arange(0, HEAD_DIM)
    m_d = o_d < head_dim
    COLS: tl.constexpr = TILES_PER_STEP * GPT_PAD
    o_c = tl.arange(0, COLS)
    c_tile_off = o_c // GPT_PAD
    c_g = o_c % GPT_PAD
    o_s = tl.arange(0, TILES_PER_STEP)
    p_q = Q + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh + o_d[None, :] * stride_qd
    p_k = K + i_b.to(tl.int64) * stride_kb + i_hkv.to(tl.int64) * stride_kh + o_d[:, None] * stride_kd
    p_lse = TILE_LSE + i_bh.to(tl.int64) * num_rows * num_tiles + o_r.to(tl.int64)[:, None] * num_tiles

    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    # Key tiles after the last row's tile are invisible to every row here.
    last_row = tl.minimum(i_r * BLOCK_R + BLOCK_R, num_rows) - 1
    last_tile = last_row // groups_per_tile
    t_begin = 0
    t_stop = last_tile + 1
    if SPLIT:
        t_begin = i_split * tiles_per_split
        t_stop = tl.minimum(t_stop, t_begin + tiles_per_split)
    for t0 in range(t_begin, t_stop, TILES_PER_STEP):
        c_tile = t0 + c_tile_off
        c_start = c_tile * block + c_g * stride
        c_end = tl.minimum(tl.minimum(c_start + stride, c_tile * block + block), seqlen)
        m_c = (c_g < groups_per_tile) & (c_start < seqlen) & (c_tile < num_tiles)
        b_s = tl.zeros([BLOCK_R, COLS], dtype=tl.float32)
        # Sec. 2.5: the antidiagonal of each S x S sub-block, a + b = S - 1 (naive: a = b = 0).
        for a in range(TERMS):
            q_pos = r_start + a
            k_pos = c_start + (TERMS - 1 - a)
            m_q = m_r & (q_pos < r_end)
            m_k = m_c & (k_pos < c_end)
            b_q = tl.load(p_q + q_pos.to(tl.int64)[:, None] * stride_qn,
                          mask=m_q[:, None] & m_d[None, :], other=0.0)
            b_k = tl.load(p_k + k_pos.to(tl.int64)[None, :] * stride_kn,
                          mask=m_k[None, :] & m_d[:, None], other=0.0)
            b_s += _dot(b_q, b_k, DOT_F32)
        b_s = b_s * qk_scale
        # A non-finite score (NaN or infinity in q or k) weighs nothing, as in the reference.
        visible = m_r[:, None] & m_c[None, :] & (c_start[None, :] <= r_start[:, None]) \
            & (tl.abs(b_s) < float("inf"))
        b_s = tl.where(visible, b_s, float("-inf"))
        b_s3 = tl.reshape(b_s, (BLOCK_R, TILES_PER_STEP, GPT_PAD))
        t_max = tl.max(b_s3, 2)
        t_shift = tl.where(t_max == float("-inf"), 0.0, t_max)
        t_sum = tl.sum(tl.math.exp2(b_s3 - t_shift[:, :, None]), 2)
        t_lse = tl.where(t_sum > 0.0, t_shift + tl.math.log2(tl.where(t_sum > 0.0, t_sum, 1.0)),
                         float("-inf"))
        o_t = t0 + o_s
        tl.store(p_lse + o_t[None, :], t_lse, mask=m_r[:, None] & (o_t[None, :] < num_tiles))
        m_new = tl.maximum(m_i, tl.max(t_lse, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.math.exp2(m_i - m_shift) + tl.sum(tl.math.exp2(t_lse - m_shift[:, None]), 1)
        m_i = m_new
    if not SPLIT:
        # l_i > 0 unless a group has no finite score: its lse is then -inf, its weights NaN.
        row_lse = tl.where(l_i > 0.0, m_i + tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        tl.store(ROW_LSE + i_bh.to(tl.int64) * num_rows + o_r, row_lse, mask=m_r)


@triton.jit
def _tile_weight_kernel(
    TILE_LSE, ROW_LSE, W,
    seqlen, num_heads, head0, block, stride, groups_per_tile, num_rows, num_tiles,
    stride_wb, stride_wh, stride_wi,
    GPT_PAD: tl.constexpr, BLOCK_T: tl.constexpr, ROW_FROM_TILES: tl.constexpr,
):
    i_q = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // num_heads
    i_h = head0 + i_bh % num_heads
    o_g = tl.arange(0, GPT_PAD)
    rows = i_q * groups_per_tile + o_g
    start, _ = _group_bounds(rows, seqlen, block, stride, groups_per_tile)
    m_g = (o_g < groups_per_tile) & (start < seqlen)
    p_lse = TILE_LSE + i_bh.to(tl.int64) * num_rows * num_tiles + rows.to(tl.int64)[:, None] * num_tiles
    if ROW_FROM_TILES:
        # Split rows (`SPLIT`): each group's log-sum-exp over its tiles' log-sum-exps.
        m_i = tl.full([GPT_PAD], float("-inf"), dtype=tl.float32)
        for j0 in range(0, i_q + 1, BLOCK_T):
            o_t = j0 + tl.arange(0, BLOCK_T)
            t_lse = tl.load(p_lse + o_t[None, :], mask=m_g[:, None] & (o_t <= i_q)[None, :], other=float("-inf"))
            m_i = tl.maximum(m_i, tl.max(t_lse, 1))
        # Each loop's result is used once after it: triton 3.6's OptimizeThreadLocality pass
        # asserts that of a loop-carried reduction (`loopResult.hasOneUse()`; the H100 run of
        # 2026-11-25 failed to compile the two-use form). A group without any finite tile
        # gets a finite shift (-3e38), l_i = 0 and log2(0) = -inf: its lse is -inf as before.
        m_shift = tl.maximum(m_i, -3.0e38)
        l_i = tl.zeros([GPT_PAD], dtype=tl.float32)
        for j0 in range(0, i_q + 1, BLOCK_T):
            o_t = j0 + tl.arange(0, BLOCK_T)
            t_lse = tl.load(p_lse + o_t[None, :], mask=m_g[:, None] & (o_t <= i_q)[None, :], other=float("-inf"))
            l_i += tl.sum(tl.math.exp2(t_lse - m_shift[:, None]), 1)
        row_lse = m_shift + tl.math.log2(l_i)
        # Padding groups (past the tile or N) load -inf tiles: 0 keeps them out of the sums.
        row_lse = tl.where(m_g, row_lse, 0.0)
    else:
        row_lse = tl.load(ROW_LSE + i_bh.to(tl.int64) * num_rows + rows, mask=m_g, other=0.0)
    p_w = W + i_b.to(tl.int64) * stride_wb + i_h.to(tl.int64) * stride_wh + i_q.to(tl.int64) * stride_wi
    for j0 in range(0, i_q + 1, BLOCK_T):
        o_t = j0 + tl.arange(0, BLOCK_T)
        m_t = o_t <= i_q
        t_lse = tl.load(p_lse + o_t[None, :], mask=m_g[:, None] & m_t[None, :], other=float("-inf"))
        # Sec. 2.5: the row-softmax probabilities of the tile, summed over its query groups.
        w = tl.sum(tl.math.exp2(t_lse - row_lse[:, None]), 0)
        tl.store(p_w + o_t, w, mask=m_t)


def check_xattention_inputs(
    q: torch.Tensor, k: torch.Tensor, *, stride: int, threshold: object, block: int, scoring: str
) -> tuple[int, torch.Tensor, int, str]:
    """The fast XAttention checks, once: inputs (dtype, device, no autograd, D <= 256), parameters.

    Returns:
        (stride, threshold, block, scoring) as `check_xattention_params` normalises them,
        the threshold per query head: float64 `[Hq]` on q's device (`per_head`).

    Raises:
        TypeError, ValueError: bad inputs or parameters, before any launch.
    """
    shape = check_qk(q, k, dtypes=HALF_DTYPES)
    s, _, bs, sc = check_xattention_params(stride=stride, threshold=threshold, block=block, scoring=scoring)
    check_fast_block(bs)
    check_kernel_device(q)
    check_forward_only(q, k)
    if shape.head_dim > 256:
        raise ValueError(f"head dim D must be <= 256 for the fast kernels, got {shape.head_dim}")
    return s, per_head(threshold, "threshold", shape.q_heads, check_threshold, device=q.device), bs, sc


# (query groups per program, key groups per step, warps, pipeline stages) of
# `_row_tile_lse_kernel` on a GPU (`sparseprefill bench estimates` times it). The first that
# fits the shared memory at the head dim is taken (`score_config`): the 128 x 128 tiles
# measured fastest at D = 128 need 3 x (128 + 128) x D x 2 bytes of pipeline buffers,
# 384 KiB at D = 256, more than a Hopper SM has (227 KiB; the GPU conformance run of
# 2026-11-25 drew D = 256 and failed there), so larger heads take the earlier 64 x 64
# tiles.
SCORE_CONFIGS = ((128, 128, 8, 3), (64, 64, 4, 2))
SHARED_BYTES = 227 * 1024
# Program order of `_row_tile_lse_kernel`: row blocks in launch order (False), or the
# longest causal rows of every head first (True). H100, 32K, bench workload, the 128 x 128
# tiles: stride 16 1.248 -> 1.089 ms, stride 8 2.042 -> 1.845 ms (benches/results/
# h100-estimator-stages-issue22-2026-11-25.txt; docs/xattention.md). Same results bit for bit.
LONGEST_FIRST = True
# CUDA's limit on the second and third grid dimensions.
_MAX_GRID_Y = 65535
# Key steps per program when a row block's key range is split over several programs
# launched together (0: one program per row block; -1: by stride, `key_split_steps`).
# Meant to share the query rows in L2 (the ncu profile of 2026-11-25: DRAM-bound, tensor
# pipe 25%) and to spread the work at 8K-32K. Timed on an H200 with triton 3.6
# (2026-11-26, docs/xattention.md): 2 steps cut stride 16's scoring 0.938 -> 0.868 ms at
# 32K and 14.16 -> 13.31 ms at 128K; at stride 8 no split was faster (1.778 / 26.51 ms
# unsplit against 1.768-1.797 / 27.01-27.63 split), so -1 splits at stride >= 16 only.
KEY_SPLIT_STEPS = -1


def key_split_steps(stride: int) -> int:
    """Key steps per program at `stride` (`KEY_SPLIT_STEPS`, or by stride where it is -1)."""
    if KEY_SPLIT_STEPS >= 0:
        return KEY_SPLIT_STEPS
    # The interpreter pays per program: unsplit (the tests set KEY_SPLIT_STEPS to split).
    return 2 if stride >= 16 and not interpreter_active() else 0


def score_config(head_dim: int, itemsize: int) -> tuple[int, int, int, int]:
    """The first of `SCORE_CONFIGS` whose Q and K pipeline buffers fit `SHARED_BYTES` at
    `head_dim` (a power of two) and `itemsize`; the last one otherwise."""
    for config in SCORE_CONFIGS:
        block_r, step, _, stages = config
        if stages * (block_r + step) * head_dim * itemsize <= SHARED_BYTES:
            return config
    return SCORE_CONFIGS[-1]


def _tile_weights(q: torch.Tensor, k: torch.Tensor, *, stride: int, block: int, scoring: str,
                  sm_scale: float) -> torch.Tensor:
    """`xattention_tile_weights` on checked inputs and parameters."""
    b, hq, n, d = q.shape
    group = hq // k.shape[1]
    tiles = cdiv(n, block)
    per_tile = cdiv(block, stride)
    rows = tiles * per_tile
    antidiagonal = scoring == "antidiagonal"
    terms = stride if antidiagonal else 1
    qk_scale = sm_scale * LOG2E / (stride if antidiagonal else 1)
    gpt_pad = triton.next_power_of_2(per_tile)
    head_dim = max(16, triton.next_power_of_2(d))
    if interpreter_active():
        block_r, step_columns, warps, stages = 64, _STEP_COLUMNS, 4, 1
    else:
        block_r, step_columns, warps, stages = score_config(head_dim, q.element_size())
    tiles_per_step = max(1, step_columns // gpt_pad)
    dot_f32 = interpreter_active() and q.dtype == torch.bfloat16
    # Quadratic in tokens: the weights (and their normalised copy), then the selection's
    # keep mask and tile lists (1 + 4 bytes a tile pair), plus the per-head-group scratch.
    check_device_memory("XAttention's tile weights and tile lists ([B, Hq, T, T], T = ceil(N / block) = "
                        f"{tiles})", b * hq * tiles * tiles * (2 * 4 + 5) + _SCRATCH_BYTES, q.device,
                        hint="A larger `block` (T falls with its square) or fewer query heads per call fit.")
    weights = torch.zeros(b, hq, tiles, tiles, dtype=torch.float32, device=q.device)
    heads_at_once = max(1, min(hq, _SCRATCH_BYTES // max(1, b * rows * tiles * 4)))
    for h0 in range(0, hq, heads_at_once):
        hl = min(heads_at_once, hq - h0)
        tile_lse = torch.empty(b * hl, rows, tiles, dtype=torch.float32, device=q.device)
        row_lse = torch.empty(b * hl, rows, dtype=torch.float32, device=q.device)
        row_blocks = triton.cdiv(rows, block_r)
        longest = LONGEST_FIRST and row_blocks <= _MAX_GRID_Y
        steps = key_split_steps(stride)
        split = steps > 0 and row_blocks <= _MAX_GRID_Y and b * hl <= _MAX_GRID_Y
        tiles_per_split = max(1, steps) * tiles_per_step
        if split:
            grid: tuple[int, ...] = (cdiv(tiles, tiles_per_split), b * hl, row_blocks)
        else:
            grid = (b * hl, row_blocks) if longest else (row_blocks, b * hl)
        _row_tile_lse_kernel[grid](
            q, k, tile_lse, row_lse,
            qk_scale, n, d, hl, h0, group, block, stride, per_tile, rows, tiles,
            *q.stride(), *k.stride(),
            BLOCK_R=block_r, GPT_PAD=gpt_pad, TILES_PER_STEP=tiles_per_step, HEAD_DIM=head_dim,
            TERMS=terms, DOT_F32=dot_f32, LONGEST_FIRST=longest, SPLIT=split, tiles_per_split=tiles_per_split,
            num_warps=warps, num_stages=stages,
        )
        _tile_weight_kernel[(tiles, b * hl)](
            tile_lse, row_lse, weights,
            n, hl, h0, block, stride, per_tile, rows, tiles,
            weights.stride(0), weights.stride(1), weights.stride(2),
            GPT_PAD=gpt_pad, BLOCK_T=32, ROW_FROM_TILES=split, num_warps=4,
        )
        del tile_lse, row_lse
    return weights / weights.sum(dim=-1, keepdim=True)


def xattention_tile_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    stride: int = 8,
    block: int = 128,
    scoring: str = "antidiagonal",
    scale: float | None = None,
) -> torch.Tensor:
    """XAttention tile weights (see `reference.xattention.xattention_tile_weights`).

    Args:
        q: `[B, Hq, N, D]` float16/bfloat16; k: `[B, Hkv, N, D]`.
        stride: tokens per group (>= 1; values past `block` mean `block`).
        block: tokens per tile, a multiple of 16.
        scoring: "antidiagonal" or "naive".
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        float32 `[B, Hq, T, T]`, `T = ceil(N / block)`: rows sum to 1 over `j <= i`;
        non-causal entries are 0.

    Raises:
        TypeError, ValueError: bad inputs (dtype, device, shapes, head dim > 256) or
            parameters.
    """
    stride, _, block, scoring = check_xattention_inputs(q, k, stride=stride, threshold=1.0, block=block,
                                                        scoring=scoring)
    sm_scale = resolve_scale(scale, q.shape[3])
    return _tile_weights(q, k, stride=stride, block=block, scoring=scoring, sm_scale=sm_scale)
