"""Triton kernels for MInference's Vertical-Slash estimate (Alg. 2 lines 2-6).

The estimate is the softmax attention `A_hat` of the last `L` queries against all
`N` keys, summed per key column (vertical scores) and per diagonal offset
`o = row - col` (slash scores). `A_hat` (`[L, N]` per head, 8 GB at 1M tokens and
32 heads) is never stored; three kernels recompute score tiles instead:

1. `_lse_partial_kernel`: per (key split, row tile, head), the online-softmax
   `(max, sum)` of the rows over the split's keys, in log2 units; the launcher
   combines the splits into each row's log2-sum-exp with a few torch ops.
2. `_vertical_kernel`: per (key tile, head), `sum_rows exp2(s - lse)` per key.
3. `_slash_kernel`: per (offset tile, head), loads the key window that the tile's
   diagonals cross for a row tile, computes `P = exp2(s - lse)` on it, and skews
   it with `tl.gather` (row `i`, offset `t` -> window column `i - t + BLOCK_O - 1`)
   so the diagonal sums become column sums; or, `SLASH_CONFIG`'s fifth entry > 0,
   through a per-program scratch slot (stored, a barrier, read back skewed), each
   program walking several offset tiles. 32 rows x 32 offsets a step by default.

No host synchronisation: every size is known from the shapes. GQA maps query
head `h` to KV head `h // G`; K is never copied.

Layout: kernels -> launcher (`last_q_scores`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...reference._checks import HALF_DTYPES, check_positive_int, check_qk, resolve_scale
from ._common import LOG2E, check_kernel_device, dot as _dot_f32, interpreter_active

# Keys per split of the lse pass: enough splits to fill the GPU at long N.
_SPLIT_KEYS = 4096
# `_slash_kernel`'s tile: (rows a step, offsets a program, warps, pipeline stages). The
# earlier (64, 64, 4, 2) read a 128-key window per step and skewed a 64 x 128
# tile with `tl.gather`: 255 registers and 131 KB of shared memory a program, one
# 4-warp program per SM (ncu, H200, 32K: 0.50 ms, 4.4x `_vertical_kernel`'s 0.11 ms
# for twice its multiply-adds). 32 rows x 32 offsets read a 64-key window: a quarter
# of the tile, the same multiply-adds per offset (docs/minference.md, designs table).
# The fifth entry: 0 skews the tile with `tl.gather` (a program per offset tile); P > 0
# skews it through memory instead, P programs per head, each storing its tile in its own
# scratch slot and reading it back skewed (a second design, timed beside the first).
SLASH_CONFIG: tuple[int, int, int, int, int] = (32, 32, 4, 2, 0)


@triton.jit
def _load_rows(Q, i_b, i_h, o_l, m_l, seqlen, rows, o_d, m_d, stride_qb, stride_qh, stride_qn, stride_qd):
    """The query tile of local rows `o_l` (global rows `N - L + o_l`): `[BLOCK_L, HEAD_DIM]`."""
    o_r = seqlen - rows + o_l
    p_q = Q + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh \
        + o_r.to(tl.int64)[:, None] * stride_qn + o_d[None, :] * stride_qd
    return tl.load(p_q, mask=m_l[:, None] & m_d[None, :], other=0.0)


@triton.jit
def _lse_partial_kernel(
    Q, K, M_OUT, S_OUT,
    qk_scale, seqlen, rows, head_dim, num_heads, group, split_keys,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr,
):
    i_split = tl.program_id(0)
    i_l = tl.program_id(1)
    i_bh = tl.program_id(2)
    i_b = i_bh // num_heads
    i_h = i_bh % num_heads
    i_hkv = i_h // group
    o_l = i_l * BLOCK_L + tl.arange(0, BLOCK_L)
    m_l = o_l < rows
    o_r = seqlen - rows + o_l
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, HEAD_DIM)
    m_d = o_d < head_dim
    b_q = _load_rows(Q, i_b, i_h, o_l, m_l, seqlen, rows, o_d, m_d,
                     stride_qb, stride_qh, stride_qn, stride_qd)
    p_k = K + i_b.to(tl.int64) * stride_kb + i_hkv.to(tl.int64) * stride_kh + o_d[:, None] * stride_kd

    m_i = tl.full([BLOCK_L], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_L], dtype=tl.float32)
    start = i_split * split_keys
    # Keys after the tile's last row are masked for every row of the tile.
    stop = tl.minimum(start + split_keys, seqlen - rows + i_l * BLOCK_L + BLOCK_L)
    stop = tl.minimum(stop, seqlen)
    for start_n in range(start, stop, BLOCK_N):
        o_c = start_n + o_n
        b_k = tl.load(p_k + o_c.to(tl.int64)[None, :] * stride_kn,
                      mask=(o_c[None, :] < seqlen) & m_d[:, None], other=0.0)
        b_s = _dot_f32(b_q, b_k, DOT_F32) * qk_scale
        m_keep = (o_c[None, :] <= o_r[:, None]) & (o_c[None, :] < seqlen)
        b_s = tl.where(m_keep, b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.math.exp2(m_i - m_shift) + tl.sum(tl.math.exp2(b_s - m_shift[:, None]), 1)
        m_i = m_new
    p_out = i_bh.to(tl.int64) * tl.num_programs(0) * rows + i_split * rows + o_l
    tl.store(M_OUT + p_out, m_i, mask=m_l)
    tl.store(S_OUT + p_out, l_i, mask=m_l)


@triton.jit
def _vertical_kernel(
    Q, K, LSE, OUT,
    qk_scale, seqlen, rows, head_dim, num_heads, group,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // num_heads
    i_h = i_bh % num_heads
    i_hkv = i_h // group
    o_c = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_c = o_c < seqlen
    o_d = tl.arange(0, HEAD_DIM)
    m_d = o_d < head_dim
    p_k = K + i_b.to(tl.int64) * stride_kb + i_hkv.to(tl.int64) * stride_kh \
        + o_c.to(tl.int64)[None, :] * stride_kn + o_d[:, None] * stride_kd
    b_k = tl.load(p_k, mask=m_c[None, :] & m_d[:, None], other=0.0)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Rows before the tile's first key see none of it.
    first = tl.maximum(i_n * BLOCK_N - (seqlen - rows), 0) // BLOCK_L * BLOCK_L
    for l0 in range(first, rows, BLOCK_L):
        o_l = l0 + tl.arange(0, BLOCK_L)
        m_l = o_l < rows
        o_r = seqlen - rows + o_l
        b_q = _load_rows(Q, i_b, i_h, o_l, m_l, seqlen, rows, o_d, m_d,
                         stride_qb, stride_qh, stride_qn, stride_qd)
        b_lse = tl.load(LSE + i_bh.to(tl.int64) * rows + o_l, mask=m_l, other=0.0)
        b_s = _dot_f32(b_q, b_k, DOT_F32) * qk_scale
        m_keep = m_l[:, None] & m_c[None, :] & (o_c[None, :] <= o_r[:, None])
        b_p = tl.where(m_keep, tl.math.exp2(b_s - b_lse[:, None]), 0.0)
        acc += tl.sum(b_p, 0)
    tl.store(OUT + i_bh.to(tl.int64) * seqlen + o_c, acc, mask=m_c)


@triton.jit
def _slash_kernel(
    Q, K, LSE, OUT, SCRATCH,
    qk_scale, seqlen, rows, head_dim, num_heads, group, num_otiles,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    BLOCK_L: tl.constexpr, BLOCK_O: tl.constexpr, WINDOW: tl.constexpr, HEAD_DIM: tl.constexpr,
    DOT_F32: tl.constexpr, SKEW_MEMORY: tl.constexpr,
):
    i_bh = tl.program_id(1)
    i_b = i_bh // num_heads
    i_h = i_bh % num_heads
    i_hkv = i_h // group
    o_t = tl.arange(0, BLOCK_O)
    o_w = tl.arange(0, WINDOW)
    o_i = tl.arange(0, BLOCK_L)
    o_d = tl.arange(0, HEAD_DIM)
    m_d = o_d < head_dim
    p_k = K + i_b.to(tl.int64) * stride_kb + i_hkv.to(tl.int64) * stride_kh + o_d[:, None] * stride_kd
    # SKEW_MEMORY: this program's `[BLOCK_L, WINDOW]` slot, reused by its offset tiles.
    p_scratch = SCRATCH + (i_bh.to(tl.int64) * tl.num_programs(0) + tl.program_id(0)) * (BLOCK_L * WINDOW)
    i_skew = o_i[:, None] - o_t[None, :] + BLOCK_O - 1
    # Offset tiles pid, pid + programs, ...: one each when the grid has a program per tile.
    for i_o in range(tl.program_id(0), num_otiles, tl.num_programs(0)):
        o0 = i_o * BLOCK_O
        acc = tl.zeros([BLOCK_O], dtype=tl.float32)
        # A row before offset o0 has no key at offset >= o0.
        first = tl.maximum(o0 - (seqlen - rows), 0) // BLOCK_L * BLOCK_L
        for l0 in range(first, rows, BLOCK_L):
            acc += _slash_rows(Q, LSE, p_k, p_scratch, qk_scale, seqlen, rows, i_b, i_h, i_bh, l0, o0,
                               o_i, o_t, o_w, o_d, m_d, i_skew,
                               stride_qb, stride_qh, stride_qn, stride_qd, stride_kn,
                               BLOCK_L, BLOCK_O, WINDOW, DOT_F32, SKEW_MEMORY)
        o_off = o0 + o_t
        tl.store(OUT + i_bh.to(tl.int64) * seqlen + o_off, acc, mask=o_off < seqlen)


@triton.jit
def _slash_rows(Q, LSE, p_k, p_scratch, qk_scale, seqlen, rows, i_b, i_h, i_bh, l0, o0,
                o_i, o_t, o_w, o_d, m_d, i_skew,
                stride_qb, stride_qh, stride_qn, stride_qd, stride_kn,
                BLOCK_L: tl.constexpr, BLOCK_O: tl.constexpr, WINDOW: tl.constexpr, DOT_F32: tl.constexpr,
                SKEW_MEMORY: tl.constexpr):
    """One row step of `_slash_kernel`: the offset tile's diagonal sums over rows `l0 + o_i`."""
    o_l = l0 + o_i
    m_l = o_l < rows
    o_r = seqlen - rows + o_l
    b_q = _load_rows(Q, i_b, i_h, o_l, m_l, seqlen, rows, o_d, m_d,
                     stride_qb, stride_qh, stride_qn, stride_qd)
    b_lse = tl.load(LSE + i_bh.to(tl.int64) * rows + o_l, mask=m_l, other=0.0)
    # Row i at offset o0 + t reads key r_i - o0 - t = window_start + (i - t + BLOCK_O - 1).
    window_start = seqlen - rows + l0 - o0 - BLOCK_O + 1
    o_c = window_start + o_w
    m_c = (o_c >= 0) & (o_c < seqlen)
    b_k = tl.load(p_k + o_c.to(tl.int64)[None, :] * stride_kn, mask=m_c[None, :] & m_d[:, None],
                  other=0.0)
    b_s = _dot_f32(b_q, b_k, DOT_F32) * qk_scale
    m_keep = m_l[:, None] & m_c[None, :] & (o_c[None, :] <= o_r[:, None])
    b_p = tl.where(m_keep, tl.math.exp2(b_s - b_lse[:, None]), 0.0)
    if SKEW_MEMORY:
        # The skew through the program's scratch slot (L1/L2), no `tl.gather`.
        tl.store(p_scratch + o_i[:, None] * WINDOW + o_w[None, :], b_p)
        tl.debug_barrier()
        b_skew = tl.load(p_scratch + o_i[:, None] * WINDOW + i_skew)
        tl.debug_barrier()
    else:
        b_skew = tl.gather(b_p, i_skew, 1)
    return tl.sum(b_skew, 0)


def last_q_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    last_q: int = 64,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical and slash scores of the last `min(last_q, N)` queries (Alg. 2 lines 2-6).

    Args:
        q: `[B, Hq, N, D]` float16/bfloat16 (any strides); k: `[B, Hkv, N, D]`.
        last_q: queries estimated (>= 1); more than N means all of them.
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        (vertical, slash), float32 `[B, Hq, N]`: per key column, and per offset
        `o = row - col`, the estimated attention mass summed over the rows.

    Raises:
        TypeError, ValueError: bad inputs (dtype, device, shapes, head dim > 256).
    """
    shape = check_qk(q, k, dtypes=HALF_DTYPES)
    check_kernel_device(q)
    check_positive_int("last_q", last_q)
    if shape.head_dim > 256:
        raise ValueError(f"head dim D must be <= 256 for the fast kernels, got {shape.head_dim}")
    qk_scale = resolve_scale(scale, shape.head_dim) * LOG2E
    b, hq, n, d = shape.batch, shape.q_heads, shape.seqlen, shape.head_dim
    rows = min(last_q, n)
    block_l = min(64, max(16, triton.next_power_of_2(rows)))
    block_n = 64
    head_dim = max(16, triton.next_power_of_2(d))
    dot_f32 = interpreter_active() and q.dtype == torch.bfloat16
    num_stages = 1 if interpreter_active() else 2
    common = (n, rows, d, hq, shape.group, *q.stride(), *k.stride())

    splits = triton.cdiv(n, _SPLIT_KEYS)
    m_part = torch.empty(b * hq, splits, rows, dtype=torch.float32, device=q.device)
    s_part = torch.empty_like(m_part)
    _lse_partial_kernel[(splits, triton.cdiv(rows, block_l), b * hq)](
        q, k, m_part, s_part, qk_scale, *common[:5], _SPLIT_KEYS, *common[5:],
        BLOCK_L=block_l, BLOCK_N=block_n, HEAD_DIM=head_dim, DOT_F32=dot_f32,
        num_warps=4, num_stages=num_stages,
    )
    # Every row sees key 0, in split 0: the combined max is finite.
    m_all = m_part.amax(dim=1, keepdim=True)
    lse = (m_all + torch.log2((s_part * torch.exp2(m_part - m_all)).sum(dim=1, keepdim=True)))
    lse = lse.squeeze(1).contiguous()

    vertical = torch.empty(b, hq, n, dtype=torch.float32, device=q.device)
    _vertical_kernel[(triton.cdiv(n, block_n), b * hq)](
        q, k, lse, vertical, qk_scale, *common,
        BLOCK_L=block_l, BLOCK_N=block_n, HEAD_DIM=head_dim, DOT_F32=dot_f32,
        num_warps=4, num_stages=num_stages,
    )
    slash = torch.empty(b, hq, n, dtype=torch.float32, device=q.device)
    slash_l, slash_o, slash_warps, slash_stages, memory_programs = SLASH_CONFIG
    slash_l = min(slash_l, block_l)
    window = triton.next_power_of_2(slash_l + slash_o - 1)
    num_otiles = triton.cdiv(n, slash_o)
    # Gather skew: a program per offset tile. Memory skew: `memory_programs` per head, each
    # walking its share of the offset tiles with one scratch slot.
    programs = min(num_otiles, memory_programs) if memory_programs else num_otiles
    scratch = (torch.empty(b * hq * programs * slash_l * window, dtype=torch.float32, device=q.device)
               if memory_programs else slash)
    _slash_kernel[(programs, b * hq)](
        q, k, lse, slash, scratch, qk_scale, *common[:5], num_otiles, *common[5:],
        BLOCK_L=slash_l, BLOCK_O=slash_o, WINDOW=window, HEAD_DIM=head_dim, DOT_F32=dot_f32,
        SKEW_MEMORY=memory_programs > 0,
        num_warps=slash_warps, num_stages=1 if interpreter_active() else slash_stages,
    )
    return vertical, slash
