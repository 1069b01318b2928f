"""Triton kernel family for `BlockColumnPlan`: key blocks, then gathered key columns.

One program computes one tile of `BLOCK_M` query rows of one (batch, query head)
(MInference Alg. 5, generalised): it loads the query tile once, loops over the
listed key blocks in `BLOCK_N`-key tiles, then over the listed key columns gathered
`BLOCK_N` at a time, keeping the online-softmax state `(m_i, l_i, acc)` in fp32.
Because block lists are sorted and causal, only the last few listed blocks can
cross the diagonal or the end of the sequence: the kernel runs the block list in
two loops, an unmasked one and a masked one; sorted causal column lists likewise
run their tiles before the query tile's first row unmasked and mask only the rest
(disjoint lists). A column inside a listed block (allowed by the plan format, so column
lists can be shared) is dropped by a binary search in the block list, so no key
counts twice (plans normally arrive with such columns already resolved at the front
door, `resolve_covered_columns`). Masked column tiles would run the step that
keeps NaN / inf values out of rows that skip their key on every one of them; for
plans with columns the launcher computes a one-element flag (does V hold a
non-finite value at all, `torch.aminmax`, no host sync) and launches two compiled
copies of the kernel, with and without that step: the programs of the copy that does
not match the flag return at once. Grouped-query attention maps query head `h` to KV head `h // G`; K
and V are never copied. `log2(e)` is folded into the scale so the loop uses `exp2`.

On sm90 GPUs the launcher first hands the calls its rule takes (key blocks, and disjoint
columns where that path's switch is on; 64-multiple blocks, D 64 / 128, none of the
extras; NaN / inf handled there) to the warp-specialised Gluon sibling,
`block_column_hopper` (docs/hopper-path.md), before any of its own bookkeeping; this
kernel runs everything else, every call on other GPUs and in the CPU interpreter, and is
the reference that path is checked against.

Layout: kernel -> launcher (`block_column_attention`), which checks everything
the kernel assumes.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ...reference._checks import HALF_DTYPES, check_qkv, resolve_scale
from ...reference.attention import (
    AttentionState,
    check_block_mean_out,
    check_mask,
    check_plan,
    check_state,
)
from ...reference.plan import BlockColumnPlan, causal_pairs
from ._common import (
    K_LN2,
    K_LOG2E,
    LOG2E,
    check_forward_only,
    check_head_dim,
    check_kernel_block_sizes,
    check_kernel_device,
    dot_f32,
    head_group,
    interpreter_active,
    tma_ok,
)
from ._common import dot as _dot
from .block_column_hopper import launch as hopper_launch, supports as hopper_supports
from .own_columns import covered_column_settings, resolve_covered_columns


@triton.jit
def _load_kv(
    K, V, p_k, p_v, i_b, i_hkv, tma_row, tma_col, start_n, o_n, seqlen, stride_kn, stride_vn, m_d,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr, FLAT_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Load the key tile transposed `[HEAD_DIM, BLOCK_N]` and the value tile `[BLOCK_N, HEAD_DIM]`."""
    if USE_TMA:
        if FLAT_TMA:
            # Flat K / V (a ragged segment, or one KV head's columns of a packed varlen
            # batch) through a 2-D descriptor: rows past the buffer arrive as zeros; rows
            # past a segment inside it are the next segment's, which a valid plan reads
            # only in masked tiles, where causality drops them (and the non-finite step,
            # where on, zeroes their bad values).
            row = (tma_row + start_n).to(tl.int32)  # int64 where a ragged segment bounds the keys
            b_k = tl.trans(K.load([row, tma_col]).reshape(BLOCK_N, HEAD_DIM))
            b_v = V.load([row, tma_col]).reshape(BLOCK_N, HEAD_DIM)
        else:
            # Hopper bulk tensor copies; rows past N arrive as zeros.
            b_k = tl.trans(K.load([i_b, i_hkv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM))
            b_v = V.load([i_b, i_hkv, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
    else:
        off_k = start_n.to(tl.int64) * stride_kn
        off_v = start_n.to(tl.int64) * stride_vn
        if MASKED:
            m_key = (start_n + o_n) < seqlen
            if EVEN_D:
                b_k = tl.load(p_k + off_k, mask=m_key[None, :], other=0.0)
                b_v = tl.load(p_v + off_v, mask=m_key[:, None], other=0.0)
            else:
                b_k = tl.load(p_k + off_k, mask=m_key[None, :] & m_d[:, None], other=0.0)
                b_v = tl.load(p_v + off_v, mask=m_key[:, None] & m_d[None, :], other=0.0)
        else:
            if EVEN_D:
                b_k = tl.load(p_k + off_k)
                b_v = tl.load(p_v + off_v)
            else:
                b_k = tl.load(p_k + off_k, mask=m_d[:, None], other=0.0)
                b_v = tl.load(p_v + off_v, mask=m_d[None, :], other=0.0)
    return b_k, b_v


@triton.jit
def _softmax_step(acc, l_i, m_i, poison, b_q, b_k, b_v, b_keep, b_bias, qk_scale, sm_scale,
                  MASKED: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_MEAN: tl.constexpr,
                  NONFINITE: tl.constexpr, HAS_BIAS: tl.constexpr, ROW_MAX: tl.constexpr):
    """One online-softmax update of `(acc, l_i, m_i)` with a key tile (keep-mask if MASKED).

    Scores stay unscaled until `s * qk_scale - m`, which compiles to one FMA per element.
    In a masked tile a row may skip a key whose value is NaN or infinite: such values
    are zeroed for the product (0 * NaN would leak into rows that do not keep the key)
    and the rows that do keep one are recorded in `poison` (set to NaN at the end).
    Returns the updated state and, if BLOCK_MEAN, the sum of the kept scaled logits.
    With ROW_MAX only `m_i` is updated (the same max, bit for bit): no exp2, no P x V.
    """
    b_s = _dot(b_q, b_k, DOT_F32)
    tile_sum = 0.0
    if MASKED:
        if BLOCK_MEAN:
            tile_sum = tl.sum(tl.sum(tl.where(b_keep, b_s, 0.0), 1), 0) * sm_scale
        b_s = tl.where(b_keep, b_s, float("-inf"))
        if NONFINITE and not ROW_MAX:
            # Compared in fp32: Triton's CPU interpreter holds bf16 as raw bits.
            b_v32 = b_v.to(tl.float32)
            v_bad = (b_v32 != b_v32) | (tl.abs(b_v32) == float("inf"))
            key_bad = tl.max(v_bad.to(tl.int32), 1)
            poison = tl.maximum(poison, tl.max((b_keep & (key_bad[None, :] > 0)).to(tl.int32), 1))
            b_v = tl.where(v_bad, 0.0, b_v).to(b_v.dtype)
    elif BLOCK_MEAN:
        tile_sum = tl.sum(tl.sum(b_s, 1), 0) * sm_scale
    if ROW_MAX:
        if HAS_BIAS:
            m_new = tl.maximum(m_i, tl.max(b_s * qk_scale + b_bias[None, :], 1))
        else:
            m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)
        return acc, l_i, m_new, poison, tile_sum
    if HAS_BIAS:
        # Per-key additive bias (log2 units), e.g. Delta-KV's log run length.
        b_s = b_s * qk_scale + b_bias[None, :]
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        b_p = tl.math.exp2(b_s - m_shift[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(b_s, 1) * qk_scale)
        # A row whose kept logits are all -inf so far keeps m = -inf: shift by 0 so exp2 gives 0.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        b_p = tl.math.exp2(b_s * qk_scale - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(b_p, 1)
    acc = acc * alpha[:, None] + _dot(b_p.to(b_v.dtype), b_v, DOT_F32)
    return acc, l_i, m_new, poison, tile_sum


@triton.jit
def _listed_block(p_bindex, stride_bik, count, i_blk, SEARCH_STEPS: tl.constexpr):
    """True where key block `i_blk` is among the first `count` entries of a sorted block list.

    A vectorised lower-bound search; `SEARCH_STEPS = ceil(log2(width + 1))` halvings
    settle any count up to the list width. The list is one plan row, so the loads
    hit L1/L2.
    """
    lo = tl.zeros_like(i_blk)
    hi = lo + count
    for _ in tl.static_range(SEARCH_STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        val = tl.load(p_bindex + mid * stride_bik, mask=active, other=0)
        go_right = active & (val < i_blk)
        lo = tl.where(go_right, mid + 1, lo)
        hi = tl.where(active & ~go_right, mid, hi)
    found = tl.load(p_bindex + lo * stride_bik, mask=lo < count, other=-1)
    return (lo < count) & (found == i_blk)


@triton.jit
def _column_tiles(
    acc, l_i, m_i, poison, b_q, b_bias, ccount, count, p_cindex, stride_cik, p_bindex, stride_bik,
    p_k_cols, p_v_cols, stride_kn, stride_vn, x_base, stride_xn, p_mask, stride_mn,
    m_row, m_d, o_m, o_n, key_len, plan_block_n, qk_scale, sm_scale, row0_g,
    BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, GUARD: tl.constexpr, PREFETCH: tl.constexpr,
    SKIP_COVERED: tl.constexpr, WIN: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    NONFINITE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
    EVEN_D: tl.constexpr, COL_SPLIT: tl.constexpr, COL_TAIL: tl.constexpr, ROW_MAX: tl.constexpr,
):
    """Fold the listed columns into `(acc, l_i, m_i)`, gathered `BLOCK_N` at a time.

    With COL_SPLIT (disjoint lists, no dense mask) the whole tiles of columns before the
    tile's first row run unmasked, like key blocks before the diagonal; the remaining
    column tiles are masked (column count, causality, covered columns), so with
    NONFINITE each of those also passes its V tile through registers to test it for
    NaN / inf (`_softmax_step`); the launcher runs that copy of the kernel only when
    V holds a non-finite value at all.
    """
    # Sorted columns meet the sorted block list in order: `ptr` never passes the first
    # listed block a later column can fall in, so a window of WIN entries from `ptr`
    # settles a whole tile with one compare; only columns past a full window fall
    # back to a binary search (a per-column search in every tile was 5x slower).
    ptr = count * 0
    o_w = tl.arange(0, WIN)
    c_start = ccount * 0
    if COL_SPLIT and not SKIP_COVERED and not HAS_MASK:
        # Sorted causal lists: only columns after the tile's first row need the causal
        # mask, and a query block lists at most its own rows' keys past that row, so they
        # are among the last COL_TAIL (>= plan block_m) entries. Whole tiles before them
        # run like unmasked key blocks: no keep mask, no load predicates, and (every row
        # keeping every key) no non-finite step.
        o_t = ccount - COL_TAIL + tl.arange(0, COL_TAIL)
        c_tail = tl.load(p_cindex + o_t * stride_cik, mask=o_t >= 0, other=-1)
        n_late = tl.sum(((c_tail > row0_g) & (o_t >= 0)).to(tl.int32), 0)
        c_start = ((ccount - n_late) // BLOCK_N) * BLOCK_N
        if PREFETCH:
            i_col_nx = tl.load(p_cindex + o_n * stride_cik, mask=o_n < c_start, other=0)
        for c0 in range(0, c_start, BLOCK_N):
            if PREFETCH:
                i_col = i_col_nx
                i_col_nx = tl.load(p_cindex + (c0 + BLOCK_N + o_n) * stride_cik,
                                   mask=c0 + BLOCK_N + o_n < c_start, other=0)
            else:
                i_col = tl.load(p_cindex + (c0 + o_n) * stride_cik)
            if GUARD:
                i_col = tl.minimum(tl.maximum(i_col, 0), key_len - 1)
            if EVEN_D:
                b_k = tl.load(p_k_cols + i_col.to(tl.int64)[None, :] * stride_kn)
                b_v = tl.load(p_v_cols + i_col.to(tl.int64)[:, None] * stride_vn)
            else:
                b_k = tl.load(p_k_cols + i_col.to(tl.int64)[None, :] * stride_kn, mask=m_d[:, None], other=0.0)
                b_v = tl.load(p_v_cols + i_col.to(tl.int64)[:, None] * stride_vn, mask=m_d[None, :], other=0.0)
            if HAS_BIAS:
                b_bias = tl.load(x_base + i_col.to(tl.int64) * stride_xn) * K_LOG2E
            acc, l_i, m_i, poison, tile_sum = _softmax_step(
                acc, l_i, m_i, poison, b_q, b_k, b_v, b_q, b_bias, qk_scale, sm_scale,
                False, DOT_F32, False, NONFINITE, HAS_BIAS, ROW_MAX)
    # The gathers below depend on the column indices: with disjoint columns, load the
    # next tile's one step ahead (H200, 128K MInference plan: 33.2 -> 32.4 ms). With
    # the column-in-block test it made the loop 1.75x slower (43.2 -> 75.7 ms), so
    # that path loads them in place.
    if PREFETCH and not SKIP_COVERED:
        i_col_next = tl.load(p_cindex + (c_start + o_n) * stride_cik, mask=c_start + o_n < ccount, other=0)
    for c0 in range(c_start, ccount, BLOCK_N):
        o_c = c0 + o_n
        m_c = o_c < ccount
        if PREFETCH and not SKIP_COVERED:
            i_col = i_col_next
            o_next = o_c + BLOCK_N
            i_col_next = tl.load(p_cindex + o_next * stride_cik, mask=o_next < ccount, other=0)
        else:
            i_col = tl.load(p_cindex + o_c * stride_cik, mask=m_c, other=0)
        if GUARD:
            i_col = tl.minimum(tl.maximum(i_col, 0), key_len - 1)
        b_k = tl.load(p_k_cols + i_col.to(tl.int64)[None, :] * stride_kn,
                      mask=m_c[None, :] & m_d[:, None], other=0.0)
        b_v = tl.load(p_v_cols + i_col.to(tl.int64)[:, None] * stride_vn,
                      mask=m_c[:, None] & m_d[None, :], other=0.0)
        if HAS_BIAS:
            b_bias = tl.load(x_base + i_col.to(tl.int64) * stride_xn, mask=m_c,
                             other=float("-inf")) * K_LOG2E
        m_new = m_c
        if SKIP_COVERED:
            # A column inside a listed block was already counted there (plan invariant 4).
            i_blk = i_col // plan_block_n
            m_w = ptr + o_w < count
            b_win = tl.load(p_bindex + (ptr + o_w) * stride_bik, mask=m_w, other=-1)
            covered = tl.sum((i_blk[:, None] == b_win[None, :]).to(tl.int32), 1) > 0
            win_last = tl.max(tl.where(m_w, b_win, -1), 0)
            unsure = m_c & (i_blk > win_last) & (ptr + WIN < count)
            if tl.sum(unsure.to(tl.int32), 0) > 0:
                covered = covered | (unsure & _listed_block(p_bindex, stride_bik, count, i_blk,
                                                            SEARCH_STEPS))
            last_blk = tl.max(tl.where(m_c, i_blk, 0), 0)
            ptr = ptr + tl.sum((m_w & (b_win < last_blk)).to(tl.int32), 0)
            m_new = m_c & ~covered
        b_keep = m_new[None, :] & (i_col[None, :] <= o_m[:, None])
        if HAS_MASK:
            m_user = tl.load(p_mask + i_col.to(tl.int64)[None, :] * stride_mn,
                             mask=m_row[:, None] & m_c[None, :], other=0)
            b_keep = b_keep & (m_user != 0)
        acc, l_i, m_i, poison, tile_sum = _softmax_step(
            acc, l_i, m_i, poison, b_q, b_k, b_v, b_keep, b_bias, qk_scale, sm_scale,
            True, DOT_F32, False, NONFINITE, HAS_BIAS, ROW_MAX)
    return acc, l_i, m_i, poison


@triton.jit
def _block_column_fwd(
    Q, K, V, O, LSE, MASK,
    BLOCK_COUNT, BLOCK_INDEX, COLUMN_COUNT, COLUMN_INDEX,
    M_ST, L_ST, ACC_ST, BSUM, KV_OFFSET, KEY_BIAS, CU_SEQLENS, K_DESC, V_DESC, COPY_SEL,
    qk_scale, sm_scale, seqlen, key_len, q_offset, head_dim, num_heads, group,
    plan_block_m, plan_block_n, num_key_blocks, block_width, column_width, column_group,
    strides_q, strides_k, strides_v, strides_o, strides_lse, strides_mask,
    strides_bc, strides_bi, strides_cc, strides_ci, strides_sum, strides_bias,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    SUB_N: tl.constexpr, DIAG: tl.constexpr, EVEN_D: tl.constexpr, HAS_COLUMNS: tl.constexpr,
    DOT_F32: tl.constexpr, USE_TMA: tl.constexpr, PREFETCH: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, WIN: tl.constexpr, SKIP_COVERED: tl.constexpr,
    GUARD: tl.constexpr, NONFINITE: tl.constexpr, COL_PREFETCH: tl.constexpr, COL_N: tl.constexpr,
    COL_SPLIT: tl.constexpr, COL_TAIL: tl.constexpr, TILE_MAJOR: tl.constexpr,
    FLAT_TMA: tl.constexpr = False, WARP_SPEC: tl.constexpr = False, COPY: tl.constexpr = 0,
    TILE_START=None, SEQ_P2: tl.constexpr = 1, ROW_MAX_OUT=None,
):
    # A feature is on when its tensor is given: LSE (return_lse), MASK (a dense mask),
    # M_ST / L_ST / ACC_ST (a state to resume), BSUM (block means), KV_OFFSET (ragged
    # K/V), KEY_BIAS (per-key bias), CU_SEQLENS (a packed varlen batch); the launcher
    # passes None otherwise, which Triton compiles away like a constexpr flag.
    RETURN_LSE: tl.constexpr = LSE is not None
    HAS_MASK: tl.constexpr = MASK is not None
    HAS_STATE: tl.constexpr = M_ST is not None
    BLOCK_MEAN: tl.constexpr = BSUM is not None
    HAS_KV_OFFSET: tl.constexpr = KV_OFFSET is not None
    HAS_BIAS: tl.constexpr = KEY_BIAS is not None
    HAS_VARLEN: tl.constexpr = CU_SEQLENS is not None
    # ROW_MAX_OUT (`block_column_row_max`): only the row max of the scaled logits is
    # computed and written there (natural-log units, fp32 [B, Hq, N]); no exp2, no P x V,
    # no output (no state, block means, lse or dense mask with it).
    ROW_MAX: tl.constexpr = ROW_MAX_OUT is not None
    stride_qb, stride_qh, stride_qn, stride_qd = strides_q
    stride_kb, stride_kh, stride_kn, stride_kd = strides_k
    stride_vb, stride_vh, stride_vn, stride_vd = strides_v
    stride_ob, stride_oh, stride_on = strides_o
    stride_lb, stride_lh = strides_lse
    stride_mb, stride_mh, stride_mm, stride_mn = strides_mask
    stride_bcb, stride_bch, stride_bcm = strides_bc
    stride_bib, stride_bih, stride_bim, stride_bik = strides_bi
    stride_ccb, stride_cch, stride_ccm = strides_cc
    stride_cib, stride_cih, stride_cim, stride_cik = strides_ci
    stride_sb, stride_sh, stride_sm, stride_sn = strides_sum
    stride_xb, stride_xh, stride_xn = strides_bias
    # Compiled copies share a launch (see `_launch`): with COPY_SEL given, only the copy
    # whose COPY equals the selector on the device computes (the copy without the
    # non-finite step where V holds no NaN / inf, the one with it where it does; with or
    # without the unmasked column tiles, `_column_split`); the others' programs leave at once.
    if COPY_SEL is not None:
        if tl.load(COPY_SEL) != COPY:
            return
    # Longest rows first: later query tiles list more blocks. (A tile-major 1-D grid for
    # varlen batches measured slower on the H200: 89.6 vs 83.3 ms on 4K + 16K + 60K.)
    if TILE_START is not None:
        # A varlen batch on a packed grid: program t of a head is query tile t of the
        # sequences' tiles laid end to end (TILE_START: their first tiles, then INT32_MAX
        # padding), longest first within a sequence; programs past the last tile leave.
        t = tl.program_id(0)
        starts = tl.load(TILE_START + tl.arange(0, SEQ_P2))
        i_s = tl.sum((starts <= t).to(tl.int32), 0) - 1
        t_end = tl.load(TILE_START + i_s + 1)
        if t_end == 2147483647:
            return
        i_m = t_end - 1 - t
        i_bh = i_s * num_heads + tl.program_id(1)
    elif TILE_MAJOR:
        # Query tiles on the slow grid axis: the programs start in one global
        # longest-first order (every head's last query tile, then the one before, ...).
        i_m = tl.num_programs(1) - 1 - tl.program_id(1)
        i_bh = tl.program_id(0)
    else:
        i_m = tl.num_programs(0) - 1 - tl.program_id(0)
        i_bh = tl.program_id(1)
    i_b = i_bh // num_heads
    i_h = i_bh % num_heads
    i_hkv = i_h // group
    row0 = i_m * BLOCK_M
    i_qb = row0 // plan_block_m
    # Packed variable-length batch: "batch row" i_b is sequence i_b, rows
    # [cu[i_b], cu[i_b + 1]) of the packed q, k, v and output (batch strides 0).
    seq0 = i_b.to(tl.int64) * 0
    if HAS_VARLEN:
        seq0 = tl.load(CU_SEQLENS + i_b).to(tl.int64)
        seqlen = tl.load(CU_SEQLENS + i_b + 1) - tl.load(CU_SEQLENS + i_b)
        key_len = seqlen
        if row0 >= seqlen:
            return  # a shorter sequence's tiles past its end: nothing to read or write
    # Rows are the queries at positions q_offset + r (a chunk after a cached prefix):
    # o_l indexes q, the output and the state; o_m (positions) meets the keys.
    row0_g = q_offset + row0

    o_l = row0 + tl.arange(0, BLOCK_M)
    o_m = q_offset + o_l
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, HEAD_DIM)
    m_d = o_d < head_dim
    m_row = o_l < seqlen

    p_q = Q + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh + seq0 * stride_qn \
        + o_l.to(tl.int64)[:, None] * stride_qn + o_d[None, :] * stride_qd
    b_q = tl.load(p_q, mask=m_row[:, None] & m_d[None, :], other=0.0)
    # Where this (batch, KV head)'s keys, values and key biases start: its own row of a
    # ragged, flat K/V (HAS_KV_OFFSET: Delta-KV's packed anchors), else by strides.
    if HAS_KV_OFFSET:
        kv_row = tl.load(KV_OFFSET + i_b * (num_heads // group) + i_hkv)
        if GUARD:
            # An edited packing's offset cannot move the segment past the flat buffer,
            # and its keys are bounded by the rows left after its start (key_len = T):
            # every masked read and clamped index below then stays inside [0, T).
            kv_row = tl.minimum(tl.maximum(kv_row, 0), key_len)
            key_len = key_len - kv_row
        k_base = K + kv_row * stride_kn
        v_base = V + kv_row * stride_vn
        x_row = kv_row * stride_xn
    else:
        k_base = K + i_b.to(tl.int64) * stride_kb + i_hkv.to(tl.int64) * stride_kh + seq0 * stride_kn
        v_base = V + i_b.to(tl.int64) * stride_vb + i_hkv.to(tl.int64) * stride_vh + seq0 * stride_vn
        x_row = i_b.to(tl.int64) * stride_xb + i_hkv.to(tl.int64) * stride_xh
    # Where a flat descriptor's tiles start (FLAT_TMA): the segment's first row, and for
    # a varlen batch the sequence's first row and the KV head's first column.
    tma_row = 0
    tma_col = 0
    if FLAT_TMA:
        if HAS_KV_OFFSET:
            tma_row = kv_row.to(tl.int32)
        if HAS_VARLEN:
            tma_row = seq0.to(tl.int32)
            tma_col = i_hkv * HEAD_DIM
    x_base = KEY_BIAS
    if HAS_BIAS:
        x_base = KEY_BIAS + x_row
    # Key/value tile pointers at key 0; each step adds start_n * stride.
    p_k = k_base + o_d[:, None] * stride_kd + o_n[None, :] * stride_kn
    p_v = v_base + o_d[None, :] * stride_vd + o_n[:, None] * stride_vn
    b_bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    p_mask = MASK
    if HAS_MASK:
        p_mask = MASK + i_b.to(tl.int64) * stride_mb + i_h.to(tl.int64) * stride_mh \
            + o_l.to(tl.int64)[:, None] * stride_mm

    # State rows: [B, Hq, N] for m and l, [B, Hq, N, D] for acc, all contiguous.
    o_st = i_bh.to(tl.int64) * seqlen + o_l
    if HAS_STATE:
        m_i = tl.load(M_ST + o_st, mask=m_row, other=float("-inf")) * K_LOG2E
        l_i = tl.load(L_ST + o_st, mask=m_row, other=0.0)
        acc = tl.load(ACC_ST + o_st[:, None] * head_dim + o_d[None, :],
                      mask=m_row[:, None] & m_d[None, :], other=0.0)
    else:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    poison = tl.zeros([BLOCK_M], dtype=tl.int32)
    if BLOCK_MEAN:
        p_bsum = BSUM + i_b.to(tl.int64) * stride_sb + i_h.to(tl.int64) * stride_sh \
            + i_qb.to(tl.int64) * stride_sm

    p_bindex = BLOCK_INDEX + i_b.to(tl.int64) * stride_bib + i_h.to(tl.int64) * stride_bih \
        + i_qb.to(tl.int64) * stride_bim
    # Counts and indices are clamped into range wherever they are loaded: a plan changed
    # after validation gives wrong numbers, never an out-of-bounds access.
    count = tl.load(BLOCK_COUNT + i_b * stride_bcb + i_h * stride_bch + i_qb * stride_bcm)
    if GUARD:
        count = tl.minimum(tl.maximum(count, 0), block_width)
    # Sorted causal lists put every block that reaches past row0 (the diagonal, or the
    # end of the sequence) among the last DIAG entries: count them, mask only those.
    o_tail = count - DIAG + tl.arange(0, DIAG)
    tail = tl.load(p_bindex + o_tail * stride_bik, mask=o_tail >= 0, other=-1)
    n_masked = tl.sum(((tail * plan_block_n + plan_block_n - 1 > row0_g) & (o_tail >= 0)).to(tl.int32), 0)
    # Blocks that end before row0: the unmasked loop never takes more, nor a later one.
    full_blocks = (row0_g + 1) // plan_block_n
    n_full = (count - n_masked) * SUB_N
    if GUARD:
        # Unmasked reads end at the keys (key_len; a ragged segment's rows left in T).
        full_blocks = tl.minimum(full_blocks, key_len // plan_block_n)
        n_full = tl.minimum(count - n_masked, full_blocks) * SUB_N
    # The next block index is loaded one step ahead so the tile loads never wait on it.
    kb_next = tl.load(p_bindex, mask=n_full > 0, other=0)
    for t in tl.range(0, n_full, warp_specialize=WARP_SPEC):
        if PREFETCH:
            kb = kb_next
            kb_next = tl.load(p_bindex + ((t + 1) // SUB_N) * stride_bik, mask=t + 1 < n_full, other=0)
        else:
            kb = tl.load(p_bindex + (t // SUB_N) * stride_bik)
        if GUARD:
            kb = tl.minimum(tl.maximum(kb, 0), full_blocks - 1)
        start_n = kb * plan_block_n + (t % SUB_N) * BLOCK_N
        b_k, b_v = _load_kv(K_DESC, V_DESC, p_k, p_v, i_b, i_hkv, tma_row, tma_col, start_n, o_n, key_len,
                            stride_kn, stride_vn, m_d, False, EVEN_D, USE_TMA, FLAT_TMA, BLOCK_N, HEAD_DIM)
        if HAS_BIAS:
            b_bias = tl.load(x_base + (start_n + o_n).to(tl.int64) * stride_xn) * K_LOG2E
        if HAS_MASK:
            o_key = start_n + o_n
            b_keep = tl.load(p_mask + o_key.to(tl.int64)[None, :] * stride_mn,
                             mask=m_row[:, None], other=0) != 0
            acc, l_i, m_i, poison, tile_sum = _softmax_step(
                acc, l_i, m_i, poison, b_q, b_k, b_v, b_keep, b_bias, qk_scale, sm_scale,
                True, DOT_F32, False, NONFINITE, HAS_BIAS, ROW_MAX)
        else:
            acc, l_i, m_i, poison, tile_sum = _softmax_step(
                acc, l_i, m_i, poison, b_q, b_k, b_v, b_q, b_bias, qk_scale, sm_scale,
                False, DOT_F32, BLOCK_MEAN, NONFINITE, HAS_BIAS, ROW_MAX)
            if BLOCK_MEAN:
                tl.atomic_add(p_bsum + kb.to(tl.int64) * stride_sn, tile_sum)
    for t in range(n_full, count * SUB_N):
        kb = tl.load(p_bindex + (t // SUB_N) * stride_bik)
        if GUARD:
            kb = tl.minimum(tl.maximum(kb, 0), num_key_blocks - 1)
        start_n = kb * plan_block_n + (t % SUB_N) * BLOCK_N
        b_k, b_v = _load_kv(K_DESC, V_DESC, p_k, p_v, i_b, i_hkv, tma_row, tma_col, start_n, o_n, key_len,
                            stride_kn, stride_vn, m_d, True, EVEN_D, USE_TMA, FLAT_TMA, BLOCK_N, HEAD_DIM)
        o_key = start_n + o_n
        if HAS_BIAS:
            b_bias = tl.load(x_base + o_key.to(tl.int64) * stride_xn, mask=o_key < key_len,
                             other=float("-inf")) * K_LOG2E
        b_keep = o_key[None, :] <= o_m[:, None]
        if HAS_MASK:
            m_user = tl.load(p_mask + o_key.to(tl.int64)[None, :] * stride_mn,
                             mask=m_row[:, None] & (o_key[None, :] < key_len), other=0)
            b_keep = b_keep & (m_user != 0)
        acc, l_i, m_i, poison, tile_sum = _softmax_step(
            acc, l_i, m_i, poison, b_q, b_k, b_v, b_keep, b_bias, qk_scale, sm_scale,
            True, DOT_F32, BLOCK_MEAN, NONFINITE, HAS_BIAS, ROW_MAX)
        if BLOCK_MEAN:
            tl.atomic_add(p_bsum + kb.to(tl.int64) * stride_sn, tile_sum)

    if HAS_COLUMNS:
        ccount = tl.load(COLUMN_COUNT + i_b * stride_ccb + i_h * stride_cch + i_qb * stride_ccm)
        if GUARD:
            ccount = tl.minimum(tl.maximum(ccount, 0), column_width)
        # Query blocks of one group share a column list (plan invariant 6).
        i_crow = i_qb // column_group
        p_cindex = COLUMN_INDEX + i_b.to(tl.int64) * stride_cib + i_h.to(tl.int64) * stride_cih \
            + i_crow.to(tl.int64) * stride_cim
        p_k_cols = k_base + o_d[:, None] * stride_kd
        p_v_cols = v_base + o_d[None, :] * stride_vd
        # Column tiles may be narrower than key tiles (COL_N, a tuning switch).
        acc, l_i, m_i, poison = _column_tiles(
            acc, l_i, m_i, poison, b_q, tl.zeros([COL_N], dtype=tl.float32), ccount, count, p_cindex,
            stride_cik, p_bindex, stride_bik,
            p_k_cols, p_v_cols, stride_kn, stride_vn, x_base, stride_xn, p_mask, stride_mn,
            m_row, m_d, o_m, tl.arange(0, COL_N), key_len, plan_block_n, qk_scale, sm_scale, row0_g,
            COL_N, DOT_F32, GUARD, COL_PREFETCH, SKIP_COVERED, WIN, SEARCH_STEPS, NONFINITE,
            HAS_BIAS, HAS_MASK, EVEN_D, COL_SPLIT, COL_TAIL, ROW_MAX)

    if ROW_MAX:
        tl.store(ROW_MAX_OUT + o_st, m_i * K_LN2, mask=m_row)
        return
    # A row that keeps a non-finite value reads NaN; finite inputs never give an infinite
    # output (a convex combination of values), so any infinity is such a row too.
    acc = tl.where(poison[:, None] > 0, float("nan"), acc)
    # Rows with no kept key: output 0 and lse -inf; NaN stays NaN.
    l_zero = l_i == 0.0
    l_safe = tl.where(l_zero, 1.0, l_i)
    b_o = acc / l_safe[:, None]
    b_o = tl.where(l_zero[:, None], 0.0, b_o)
    b_o = tl.where(tl.abs(b_o) == float("inf"), float("nan"), b_o)
    p_o = O + i_b.to(tl.int64) * stride_ob + i_h.to(tl.int64) * stride_oh + seq0 * stride_on \
        + o_l.to(tl.int64)[:, None] * stride_on + o_d[None, :]
    tl.store(p_o, b_o.to(O.dtype.element_ty), mask=m_row[:, None] & m_d[None, :])
    if RETURN_LSE:
        lse = tl.where(l_zero, float("-inf"), (m_i + tl.math.log2(l_safe)) * K_LN2)
        p_lse = LSE + i_b.to(tl.int64) * stride_lb + i_h.to(tl.int64) * stride_lh + seq0 + o_l
        tl.store(p_lse, lse, mask=m_row)
    if HAS_STATE:
        tl.store(M_ST + o_st, m_i * K_LN2, mask=m_row)
        tl.store(L_ST + o_st, l_i, mask=m_row)
        tl.store(ACC_ST + o_st[:, None] * head_dim + o_d[None, :], acc,
                 mask=m_row[:, None] & m_d[None, :])


def _tile_config(plan_block_m: int, plan_block_n: int, head_dim: int) -> tuple[int, int, int, int]:
    """Return (BLOCK_M, BLOCK_N, num_warps, num_stages) for a plan's block sizes.

    Kernel tiles must divide the plan's blocks. Measured on an H200 (triton 3.6, bf16,
    d=128, 128K tokens, `sparseprefill bench variants --tiles`): 128x128 tiles, 8 warps, 3 stages
    reach 532 TFLOP/s on a dense plan, 128x64 465, 64x64 with 4 warps 473; 4 warps on
    128-row tiles fall to ~300. Head dims above 128 take smaller tiles to fit registers.
    """
    if head_dim <= 64:
        # D <= 64 (H200, bf16, 32K, B=2, 14/2 heads, `bench serving` / `bench variants --tiles`):
        # 64x128 tiles with 4 warps 9.95 ms (0.84x cuDNN), 128x128 with 8 warps 10.69.
        block_m = math.gcd(plan_block_m, 64)
        block_n = math.gcd(plan_block_n, 128)
    elif head_dim <= 128:
        block_m = math.gcd(plan_block_m, 128)
        block_n = math.gcd(plan_block_n, 128)
    else:
        block_m = math.gcd(plan_block_m, 64)
        block_n = math.gcd(plan_block_n, 32)
    num_warps = 8 if block_m >= 128 else 4
    num_stages = 3 if head_dim <= 128 else 2
    if interpreter_active():
        num_stages = 1
    tune = os.environ.get("SPARSEPREFILL_TILE")  # "BM,BN,warps,stages": tuning runs only
    if tune:
        bm_t, bn_t, w_t, s_t = (int(x) for x in tune.split(","))
        if plan_block_m % bm_t == 0 and plan_block_n % bn_t == 0:
            block_m, block_n, num_warps, num_stages = bm_t, bn_t, w_t, s_t
    return block_m, block_n, num_warps, num_stages


# Tile configurations that compiled and launched, per launch signature (see the
# OutOfResources fallback in `block_column_attention`).
_FITTED: dict[tuple[object, ...], tuple[int, int, int, int]] = {}


def _smaller_config(config: tuple[int, int, int, int]) -> tuple[int, int, int, int] | None:
    """The next configuration to try after a shared-memory failure, or None.

    One stage fewer down to 1; then half the key tile (it still divides the plan's
    block_n) down to 16; then half the query tile with 4 warps.
    """
    block_m, block_n, num_warps, num_stages = config
    if num_stages > 1:
        return block_m, block_n, num_warps, num_stages - 1
    if block_n > 16:
        return block_m, block_n // 2, num_warps, 2
    if block_m > 16:
        return block_m // 2, block_n, 4, 2
    return None


_PREFETCH = os.environ.get("SPARSEPREFILL_PREFETCH", "1") == "1"
_COL_PREFETCH = os.environ.get("SPARSEPREFILL_COL_PREFETCH", "1") == "1"
# Tuning switches only: the column loop's index prefetch, and its tile width (keys per
# column tile, a power of two >= 16; 0 = the key tile's). docs/plan-and-kernels.md.
_COL_TILE = int(os.environ.get("SPARSEPREFILL_COL_TILE", "0"))
# Column tiles wholly before a query tile's first row run without masks where the plan's
# query blocks list enough columns for it to pay (`_column_split`); a tuning switch
# forces it: `SPARSEPREFILL_COL_SPLIT=1` always, `0` never (None: the rule).
_COL_SPLIT: bool | None = {"1": True, "0": False}.get(os.environ.get("SPARSEPREFILL_COL_SPLIT", "auto"))
# The rule's threshold: the split's copy of the kernel runs where the query blocks list on
# average at least this many column tiles (measured: docs/plan-and-kernels.md).
SPLIT_MIN_COLUMN_TILES = 2
# Grid order (a tuning switch): query tiles on the slow axis, so programs start longest
# first over all heads, not head after head (docs/plan-and-kernels.md, short prompts).
_TILE_MAJOR = os.environ.get("SPARSEPREFILL_TILE_MAJOR", "0") == "1"
# Benchmarking switches only (`sparseprefill bench variants`): `SPARSEPREFILL_GUARD=0` drops the
# clamps of loaded plan entries, `SPARSEPREFILL_NONFINITE=0` the masked-tile step that
# keeps NaN values out of rows that do not keep their key. Never turn them off in use.
_GUARD = os.environ.get("SPARSEPREFILL_GUARD", "1") == "1"
_NONFINITE = os.environ.get("SPARSEPREFILL_NONFINITE", "1") == "1"
# Ragged and varlen K / V through flat 2-D TMA descriptors (since 2026-11-26; `0`: pointer
# loads, for timing the two paths; docs/plan-and-kernels.md, "ragged and varlen on TMA").
_FLAT_TMA = os.environ.get("SPARSEPREFILL_FLAT_TMA", "1") == "1"
# A tuning switch: Triton's warp specialisation of the unmasked block loop (producer
# warps for the TMA loads, consumer warps for the products); off by default.
_WARP_SPEC = os.environ.get("SPARSEPREFILL_WARP_SPEC", "0") == "1"
# Varlen batches on a packed grid (the sequences' query tiles end to end, `TILE_START`):
# no programs for a shorter sequence's tiles past its end. `0`: the S x max-tiles grid.
_VARLEN_PACKED_GRID = os.environ.get("SPARSEPREFILL_VARLEN_PACKED_GRID", "1") == "1"


@dataclass(frozen=True)
class _KernelCall:
    """One launch of `_block_column_fwd` on inputs the front door has checked.

    `q` is `[B, Hq, N, D]`; `k`, `v` are `[B, Hkv, N, D]`, or flat `[T, D]` with
    `kv_offsets` (ragged). A varlen batch arrives as batch-stride-0 views
    `[S, H, max_seqlen, D]` of the packed tensors, with `varlen = (cu_seqlens, out,
    lse)` the packed outputs' views the kernel writes into (and `v_nonfinite` taken
    from the packed V).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    plan: BlockColumnPlan
    sm_scale: float
    key_len: int
    return_lse: bool
    mask: torch.Tensor | None = None
    state: AttentionState | None = None
    block_mean_out: torch.Tensor | None = None
    key_bias: torch.Tensor | None = None
    kv_offsets: torch.Tensor | None = None
    varlen: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
    # The "V holds a NaN/inf" flag, when the caller has it cheaper than from `v` (a
    # varlen view repeats the packed V once per sequence).
    v_nonfinite: torch.Tensor | None = None
    # Rows of the packed varlen buffers the views stand on (their flat TMA descriptors).
    varlen_rows: int = 0
    # Where to write (`out`, `lse`) instead of fresh tensors (one head chunk of a launch).
    dest: tuple[torch.Tensor, torch.Tensor | None] | None = None
    # fp32 `[B, Hq, N]` to receive the row max alone (`block_column_row_max`): no output.
    row_max: torch.Tensor | None = None


def _front_door(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: object, *, head_dim: int,
    scale: float | None,
) -> tuple[float, BlockColumnPlan]:
    """The checks every launcher shares, after its own layout checks.

    Returns:
        (the softmax scale, the plan as lists: a plan whose `dense_heads` are marked gets
        them written into its lists, since the kernel reads the lists alone; the fast
        methods send marked heads to SDPA before they get here, `fast.attention.run_plan`).

    Raises:
        TypeError, ValueError: a device the kernels cannot run on, an input needing a
            gradient, `D > 256`, a bad scale, a non-plan, or plan blocks not multiples of 16.
    """
    check_kernel_device(q)
    check_forward_only(q, k, v)
    check_head_dim(head_dim)
    sm_scale = resolve_scale(scale, head_dim)
    if not isinstance(plan, BlockColumnPlan):
        raise TypeError(f"plan must be a BlockColumnPlan, got {type(plan).__name__}")
    check_kernel_block_sizes(plan.block_m, plan.block_n, prefix="plan.")
    return sm_scale, plan.with_dense_lists() if plan.dense_heads else plan


def _check_tensors(**tensors: object) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def block_column_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    validate_plan: bool = True,
    state: AttentionState | None = None,
    block_mean_out: torch.Tensor | None = None,
    key_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the kernel for `plan` (optionally also applying a dense bool `mask`).

    Args:
        q: `[B, Hq, N, D]` fp16/bf16 (any strides); k, v: `[B, Hkv, N, D]`.
        plan: a `BlockColumnPlan` for `[B, Hq, N]` whose block sizes are multiples of 16.
        mask: optional bool, broadcastable to `[B, Hq, N, N]`, intersected with the plan.
        scale: softmax scale, `1/sqrt(D)` if None.
        return_lse: also return the natural-log lse, float32 `[B, Hq, N]`.
        validate_plan: check every plan invariant first (skip only for plans this
            package built itself).
        state: a float32 `AttentionState` to start from, updated in place (see
            `reference.sparse_attention`); None starts from nothing.
        block_mean_out: float32 `[B, Hq, Qb, Kb]` filled with the mean scaled logit of
            every listed block and -inf elsewhere (not with `mask`).
        key_bias: optional float32 `[B, Hkv, N]` added to every scaled logit of a key
            (natural-log units; -inf removes a key).

    Returns:
        (out `[B, Hq, N, D]` in q's dtype, lse or None).

    Raises:
        TypeError, ValueError: any input the kernel does not support.
    """
    offset = plan.query_offset if isinstance(plan, BlockColumnPlan) else 0
    shape = check_qkv(q, k, v, dtypes=HALF_DTYPES, query_offset=offset)
    b, hq, n, d = shape.batch, shape.q_heads, shape.seqlen, shape.head_dim
    sm_scale, plan = _front_door(q, k, v, plan, head_dim=d, scale=scale)
    if validate_plan:
        check_plan(plan, b, hq, n, q.device)
    if mask is not None and offset:
        raise ValueError("mask cannot be combined with a plan whose query_offset is > 0")
    dense_mask = None if mask is None else check_mask(mask, b, hq, n, q.device)
    if state is not None:
        check_state(state, b, hq, n, d, q.device, dtypes=(torch.float32,))
    if block_mean_out is not None:
        if dense_mask is not None:
            raise ValueError("block_mean_out cannot be combined with a dense mask")
        check_block_mean_out(block_mean_out, b, hq, plan, q.device)
    if key_bias is not None:
        _check_bias(key_bias, (b, shape.kv_heads, n), q.device)
    return _launch(_KernelCall(q, k, v, plan, sm_scale, shape.key_len, return_lse, mask=dense_mask,
                               state=state, block_mean_out=block_mean_out, key_bias=key_bias))


def block_column_row_max(
    q: torch.Tensor,
    k: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    scale: float | None = None,
    validate_plan: bool = True,
) -> torch.Tensor:
    """The row max of the scaled logits over `plan`'s keys, without the attention.

    The same kernel as `block_column_attention` with its row-max switch (`ROW_MAX`):
    each key tile's logits and their running max only, no exp2, no P x V, no output.
    Bit for bit the `m` an `AttentionState` started empty would hold after
    `block_column_attention(q, k, v, plan, state=...)` (AnchorAttention's Equation 1
    anchors, `fast.anchor_attention.anchor_maxima`).

    Args:
        q: `[B, Hq, N, D]` fp16/bf16 (any strides); k: `[B, Hkv, N, D]`.
        plan: a `BlockColumnPlan` for `[B, Hq, N]` whose block sizes are multiples of 16.
        scale: softmax scale, `1/sqrt(D)` if None.
        validate_plan: check every plan invariant first.

    Returns:
        float32 `[B, Hq, N]`, natural-log units; -inf for a row with no listed key.

    Raises:
        TypeError, ValueError: any input the kernel does not support.
    """
    offset = plan.query_offset if isinstance(plan, BlockColumnPlan) else 0
    shape = check_qkv(q, k, k, dtypes=HALF_DTYPES, query_offset=offset)
    b, hq, n = shape.batch, shape.q_heads, shape.seqlen
    sm_scale, plan = _front_door(q, k, k, plan, head_dim=shape.head_dim, scale=scale)
    if validate_plan:
        check_plan(plan, b, hq, n, q.device)
    row_max = torch.empty(b, hq, n, dtype=torch.float32, device=q.device)
    _launch(_KernelCall(q, k, k, plan, sm_scale, shape.key_len, False, row_max=row_max))
    return row_max


def ragged_block_column_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_offsets: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    key_bias: torch.Tensor | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    state: AttentionState | None = None,
    check_offsets: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel over keys stored ragged: one flat `[T, D]` K and V, a segment per (b, KV head).

    Keys of batch row `b` and KV head `g` are rows `kv_offsets[b * Hkv + g] + j` of `k`,
    `v` (and `key_bias`), `j` counting from 0 in the segment's own index space, which
    is the space the plan's key blocks and columns index. Causality is applied in that
    space (key `j` for row `r` iff `j <= r`), so a caller whose keys stand for later
    positions (Delta-KV's packed anchors) lists only blocks whose keys every row of
    the query block may see; and, since blocks before the diagonal are read without
    masks, every listed block must lie inside its segment (pad segments to a multiple
    of `plan.block_n`). This is what `fast.delta_kv` builds; the plan is not validated.

    Args:
        q: `[B, Hq, N, D]` fp16/bf16. k, v: `[T, D]`, q's dtype, last dim contiguous.
        kv_offsets: int64 `[B * Hkv]` segment starts, in `[0, T]`.
        plan: a plan for `[B, Hq, N]` over the segments' keys (block sizes multiples of 16).
        key_bias: optional float32 `[T]` added to every scaled logit of a key.
        scale, return_lse, state: as `block_column_attention`.
        check_offsets: check that every offset lies in `[0, T]` (one host
            synchronisation); skip only for offsets the caller built and checked, as
            `fast.delta_kv` does with a validated `PackedKV` (its `offsets` are a
            cumulative sum of segment sizes ending at `T`).

    Returns:
        (out `[B, Hq, N, D]`, lse or None).

    Raises:
        TypeError, ValueError: shapes, dtypes, devices or offsets out of range.
    """
    _check_tensors(q=q, k=k, v=v)
    if q.dim() != 4 or q.dtype not in HALF_DTYPES:
        raise ValueError(f"q must be a float16/bfloat16 [B, Hq, N, D] tensor, got {q.dtype} {tuple(q.shape)}")
    b, hq, n, d = q.shape
    if k.dim() != 2 or k.shape[1] != d or v.shape != k.shape or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k and v must be [T, D={d}] tensors of q's dtype, got {tuple(k.shape)} "
                         f"{k.dtype} and {tuple(v.shape)} {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"k and v must be on q's device ({q.device})")
    sm_scale, plan = _front_door(q, k, v, plan, head_dim=d, scale=scale)
    if not isinstance(kv_offsets, torch.Tensor) or kv_offsets.dtype != torch.int64 or kv_offsets.dim() != 1:
        raise TypeError("kv_offsets must be an int64 [B * Hkv] tensor")
    hkv = kv_offsets.shape[0] // b if b else 0
    if hkv == 0 or hkv * b != kv_offsets.shape[0] or hq % hkv != 0:
        raise ValueError(f"kv_offsets must have B * Hkv entries with Hq % Hkv == 0; got "
                         f"{kv_offsets.shape[0]} for B={b}, Hq={hq}")
    if kv_offsets.device != q.device:
        raise ValueError(f"kv_offsets must be on q's device ({q.device})")
    if check_offsets and kv_offsets.numel():
        lo, hi = torch.stack(torch.aminmax(kv_offsets)).tolist()  # one host read
        if lo < 0 or hi > k.shape[0]:
            raise ValueError(f"kv_offsets must lie in [0, T={k.shape[0]}]")
    if plan.seqlen != n or tuple(plan.block_count.shape[:2]) != (b, hq) or plan.device != q.device:
        raise ValueError("plan must be for q (seqlen, B, Hq, device)")
    if state is not None:
        check_state(state, b, hq, n, d, q.device, dtypes=(torch.float32,))
    if key_bias is not None:
        _check_bias(key_bias, (k.shape[0],), q.device)
    # Keys of a segment may run past N (padding); T bounds every read of a valid plan.
    return _launch(_KernelCall(q, k, v, plan, sm_scale, k.shape[0], return_lse, state=state,
                               key_bias=key_bias, kv_offsets=kv_offsets))


def varlen_block_column_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    plan: BlockColumnPlan,
    *,
    scale: float | None = None,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel over a packed batch of sequences of different lengths, in one launch.

    FlashAttention's varlen layout: sequence `s` is rows `[cu_seqlens[s],
    cu_seqlens[s + 1])` of q, k and v. The plan is `stack_plans` of one plan per
    sequence: batch row `s` of the plan is sequence `s`, its `seqlen` is `max_seqlen`,
    and the rows and keys of a shorter sequence past its end are never read.

    Args:
        q: `[T, Hq, D]` fp16/bf16; k, v: `[T, Hkv, D]`, q's dtype (any strides).
        cu_seqlens: int32 `[S + 1]` on q's device, `0 = cu[0] <= ... <= cu[S] = T`.
        max_seqlen: an int >= every sequence's length (the plan's `seqlen`).
        plan: a plan for `[S, Hq, max_seqlen]` with `query_offset` 0.
        scale, return_lse: as `block_column_attention`; the lse is float32 `[Hq, T]`.

    Returns:
        (out `[T, Hq, D]` in q's dtype, lse or None).

    Raises:
        TypeError, ValueError: shapes, dtypes, devices, offsets or plan sizes that do
            not match (one host read of `cu_seqlens`), before any launch.
    """
    _check_tensors(q=q, k=k, v=v, cu_seqlens=cu_seqlens)
    if q.dim() != 3 or q.dtype not in HALF_DTYPES:
        raise ValueError(f"q must be a float16/bfloat16 [T, Hq, D] tensor, got {q.dtype} {tuple(q.shape)}")
    total, hq, d = q.shape
    if k.dim() != 3 or k.shape[0] != total or k.shape[2] != d or v.shape != k.shape:
        raise ValueError(f"k and v must be [T={total}, Hkv, D={d}] tensors, got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"k and v must have q's dtype ({q.dtype}), got {k.dtype} and {v.dtype}")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"the query heads ({hq}) must be a multiple of the KV heads ({hkv})")
    if total == 0:
        raise ValueError("q must not be empty (T = 0)")
    check_kernel_device(q)
    if k.device != q.device or v.device != q.device or cu_seqlens.device != q.device:
        raise ValueError(f"k, v and cu_seqlens must be on q's device ({q.device})")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise TypeError(f"cu_seqlens must be an int32 [S + 1] tensor (S >= 1), got {cu_seqlens.dtype} "
                        f"{tuple(cu_seqlens.shape)}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 1:
        raise ValueError(f"max_seqlen must be a positive int, got {max_seqlen!r}")
    cu = cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    if cu[0] != 0 or cu[-1] != total or min(lengths) < 0:
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at T={total}, got {cu}")
    if max(lengths) > max_seqlen:
        raise ValueError(f"max_seqlen={max_seqlen} is below the longest sequence ({max(lengths)})")
    seqs = len(lengths)
    check_plan(plan, seqs, hq, max_seqlen, q.device)
    if plan.query_offset:
        raise ValueError("a varlen plan must have query_offset 0")
    sm_scale, plan = _front_door(q, k, v, plan, head_dim=d, scale=scale)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(hq, total, dtype=torch.float32, device=q.device) if return_lse else None

    def view(t: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [S, H, max_seqlen, D], batch stride 0
        return t.as_strided((seqs, t.shape[1], max_seqlen, t.shape[2]), (0, t.stride(1), t.stride(0), t.stride(2)))

    # The views' nominal size must exist in storage (as_strided checks it): only a
    # max_seqlen above T needs padding; the kernel never reads past a sequence's end.
    pad = max(0, max_seqlen - total)
    if pad:
        q, k, v = (torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) for t in (q, k, v))
        out = torch.empty(total + pad, hq, d, dtype=q.dtype, device=q.device)
        if lse is not None:
            lse = torch.empty(hq, total + pad, dtype=torch.float32, device=q.device)
    lse_view = None if lse is None else lse.as_strided((seqs, hq, max_seqlen), (0, lse.stride(0), 1))
    flag = _nonfinite_flag(v) if plan.column_index.shape[3] > 0 and _NONFINITE else None
    _launch(_KernelCall(view(q), view(k), view(v), plan, sm_scale, max_seqlen, return_lse,
                        varlen=(cu_seqlens, view(out), lse_view), v_nonfinite=flag, varlen_rows=total + pad))
    out = out[:total]
    return out, (lse[:, :total] if lse is not None else None)


def _check_bias(bias: object, shape: tuple[int, ...], device: torch.device) -> None:
    if not isinstance(bias, torch.Tensor) or bias.dtype != torch.float32:
        raise TypeError(f"key_bias must be a float32 tensor, got {getattr(bias, 'dtype', type(bias).__name__)}")
    if tuple(bias.shape) != shape:
        raise ValueError(f"key_bias must have shape {list(shape)}, got {tuple(bias.shape)}")
    if bias.device != device:
        raise ValueError(f"key_bias must be on q's device ({device}), got {bias.device}")


def _column_split(plan: BlockColumnPlan, col_n: int, masked: bool = False) -> bool | torch.Tensor:
    """Whether a column plan runs the copy of the kernel with unmasked column tiles.

    The split (`COL_SPLIT`: whole column tiles before a query tile's first row run without
    masks) pays where query blocks list many columns (AnchorAttention's stripes: 1.56x at
    32K) and costs where they list few: its copy of the kernel holds more registers (the
    64 x 64, D 128 copy: 255 against 242), and with almost no whole tile to run unmasked
    that slows the whole launch (H200, 32K: the single-line FlexPrefill plan, 47 columns per
    query block, 5% slower; SharePrefill's, 4, 7%). The rule: split where the query blocks
    list on average at least `SPLIT_MIN_COLUMN_TILES` column tiles of `col_n` keys.

    Returns:
        False where the plan cannot reach that (no columns, or a column capacity below
        it: known on the host) or the kernel could not split (columns not disjoint, a
        dense mask), else an int32 `[1]` flag on the plan's device (0 / 1,
        no host sync) that picks the copy in the launch. `_COL_SPLIT` (a tuning switch)
        forces True / False.
    """
    if plan.column_index.shape[3] == 0 or not plan.columns_disjoint or masked:
        return False
    if _COL_SPLIT is not None:
        return _COL_SPLIT
    need = SPLIT_MIN_COLUMN_TILES * col_n
    if plan.column_index.shape[3] < need or plan.column_count.numel() == 0:
        return False
    total = plan.column_count.sum(dtype=torch.int64)
    return (total >= need * plan.column_count.numel()).to(torch.int32).reshape(1)


@triton.jit
def _any_nonfinite(X, FLAG, numel, BLOCK: tl.constexpr):
    """Set `FLAG[0]` to 1 if any of the `numel` values at X is a NaN or an infinity."""
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(tl.program_id(0) * BLOCK, numel, tl.num_programs(0) * BLOCK):
        o_x = tl.arange(0, BLOCK).to(tl.int64) + start  # numel may pass 2**31 (V at 1M tokens)
        # Compared in fp32: Triton's CPU interpreter holds bf16 as raw bits.
        b_x = tl.load(X + o_x, mask=o_x < numel, other=0.0).to(tl.float32)
        bad = bad | ((b_x != b_x) | (tl.abs(b_x) == float("inf"))).to(tl.int32)
    if tl.max(bad, 0) > 0:
        tl.atomic_max(FLAG, 1)


def _nonfinite_flag(v: torch.Tensor) -> torch.Tensor:
    """int32 `[1]` on v's device: 1 if v holds a NaN or an infinity, else 0 (no host sync).

    One pass over a contiguous v (a zeroed flag and one reduction kernel: two launches,
    where `aminmax` and its finiteness tests took six); other layouts through `aminmax`.
    """
    if not v.is_contiguous() or v.numel() == 0:
        low, high = torch.aminmax(v)
        return (~(torch.isfinite(low) & torch.isfinite(high))).to(torch.int32).reshape(1)
    flag = torch.zeros(1, dtype=torch.int32, device=v.device)
    block = 4096
    programs = triton.cdiv(v.numel(), block)
    if v.is_cuda:
        programs = min(programs, 4 * torch.cuda.get_device_properties(v.device).multi_processor_count)
    else:
        programs = min(programs, 4)
    _any_nonfinite[(programs,)](v.reshape(-1), flag, v.numel(), BLOCK=block, num_warps=8)
    return flag


def _zero_strides(n: int) -> tuple[int, ...]:
    return (0,) * n


def _head_chunk(plan: BlockColumnPlan, call: _KernelCall) -> int:
    """Query heads per launch where shared column lists are too large to resolve at once.

    `resolve_covered_columns` leaves shared (stride-0) single lists whose per-query-block
    expansion passes `own_columns.DISJOINT_COLUMN_BYTES` to the kernel's covered-column
    test (the single-line FlexPrefill plan at 128K: 11.5 GB expanded, 0.50 of the block
    path). Launched a few query heads at a time, each chunk's lists fit the budget and run
    resolved, with the unmasked column tiles. Returns the chunk (a multiple or a divisor of
    the GQA group, so a chunk's heads share whole KV heads), or 0: no chunking (lists
    resolved or not shared, a call with a mask, state, block means, key bias, ragged or
    varlen K / V, or one head's lists alone past the budget).
    """
    resolve_covered, budget = covered_column_settings()
    if (plan.column_index.shape[3] == 0 or plan.columns_disjoint or plan.column_group != 1
            or not resolve_covered or call.mask is not None or call.state is not None
            or call.block_mean_out is not None or call.key_bias is not None or call.kv_offsets is not None
            or call.varlen is not None or call.dest is not None or call.row_max is not None):
        return 0
    b, hq = call.q.shape[:2]
    group = hq // call.k.shape[1]
    per_head = b * plan.num_query_blocks * plan.column_index.shape[3] * 4
    fit = budget // max(1, per_head)
    return 0 if fit < 1 or fit >= hq else head_group(hq, group, int(fit))


def _head_slice(plan: BlockColumnPlan, h0: int, h1: int) -> BlockColumnPlan:
    """Query heads `[h0, h1)` of a plan (views of its index tensors)."""
    sub = replace(plan, block_count=plan.block_count[:, h0:h1], block_index=plan.block_index[:, h0:h1],
                  column_count=plan.column_count[:, h0:h1], column_index=plan.column_index[:, h0:h1])
    return sub.mark_valid() if plan._checked else sub


def _launch_head_chunks(call: _KernelCall, plan: BlockColumnPlan, chunk: int) -> tuple[
        torch.Tensor, torch.Tensor | None]:
    """One launch per `chunk` query heads, each writing its heads of one output."""
    q, k, v = call.q, call.k, call.v
    b, hq, n, d = q.shape
    group = hq // k.shape[1]
    out = torch.empty(b, hq, n, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, n, dtype=torch.float32, device=q.device) if call.return_lse else None
    flag = call.v_nonfinite
    if flag is None and _NONFINITE:
        flag = _nonfinite_flag(v)
    for h0 in range(0, hq, chunk):
        h1 = min(hq, h0 + chunk)
        k0, k1 = h0 // group, (h1 - 1) // group + 1
        _launch(replace(call, q=q[:, h0:h1], k=k[:, k0:k1], v=v[:, k0:k1], plan=_head_slice(plan, h0, h1),
                        v_nonfinite=flag, dest=(out[:, h0:h1], None if lse is None else lse[:, h0:h1])))
    return out, lse


def _launch(call: _KernelCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch `_block_column_fwd` for one checked call (the only launch site)."""
    q, k, v = call.q, call.k, call.v
    # Covered columns resolved once per plan (cached on it), not in every column tile;
    # shared lists too large for that, a few heads at a time (`_head_chunk`).
    plan = resolve_covered_columns(call.plan)
    b, hq, n, d = q.shape
    lse: torch.Tensor | None
    if hopper_supports(call, plan):
        # The Hopper path takes the whole call in one launch, non-finite V included
        # (docs/hopper-path.md); nothing of the portable launcher's work below is needed.
        out = torch.empty(b, hq, n, d, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, hq, n, dtype=torch.float32, device=q.device) if call.return_lse else None
        hopper_launch(q, k, v, out, lse, plan, call.sm_scale)
        return out, lse
    chunk = _head_chunk(plan, call)
    if chunk:
        return _launch_head_chunks(call, plan, chunk)
    ragged = call.kv_offsets is not None
    group = hq // (call.kv_offsets.shape[0] // b if call.kv_offsets is not None else k.shape[1])
    head_dim = max(16, triton.next_power_of_2(d))
    if call.varlen is not None:
        cu_arg, out, lse = call.varlen
    elif call.dest is not None:
        cu_arg = None
        out, lse = call.dest
    elif call.row_max is not None:
        cu_arg = None
        out, lse = q.new_empty(1, 1, 1, 1), None  # not written: the kernel stores the row max only
    else:
        cu_arg = None
        out = torch.empty(b, hq, n, d, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, hq, n, dtype=torch.float32, device=q.device) if call.return_lse else None
    mask_arg = None
    mstrides = _zero_strides(4)
    if call.mask is not None:
        mask = call.mask
        mask_arg = mask.view(torch.uint8) if mask.is_contiguous() else mask.to(torch.uint8)
        mstrides = tuple(s if sz > 1 else 0 for s, sz in zip(mask_arg.stride(), mask_arg.shape))
    # The kernel reads and writes the state rows in place, contiguous.
    state = call.state
    work = state
    if state is not None and not all(t.is_contiguous() for t in (state.m, state.l, state.acc)):
        work = AttentionState(state.m.contiguous(), state.l.contiguous(), state.acc.contiguous())
    sums = None
    if call.block_mean_out is not None:
        sums = torch.zeros(b, hq, plan.num_query_blocks, plan.num_key_blocks, dtype=torch.float32,
                           device=q.device)
    bias = call.key_bias
    if bias is None:
        xstrides = _zero_strides(3)
    elif ragged:
        xstrides = (0, 0, bias.stride(0))
    else:
        xstrides = tuple(bias.stride())
    # A flat [T, D] K / V: batch and head strides 0, each segment found by its offset.
    kstrides = (0, 0, *k.stride()) if ragged else tuple(k.stride())
    vstrides = (0, 0, *v.stride()) if ragged else tuple(v.stride())
    has_columns = plan.column_index.shape[3] > 0
    v_bad = None
    if has_columns and _NONFINITE and call.row_max is None:
        v_bad = call.v_nonfinite if call.v_nonfinite is not None else _nonfinite_flag(v)
    use_tma = head_dim == d and not ragged and call.varlen is None and tma_ok(q, k, v)
    # Ragged `[T, D]` and varlen `[T, Hkv, D]` K / V: one 2-D descriptor each (a varlen
    # view's heads must be adjacent in a row: its head stride D).
    flat_tma = (_FLAT_TMA and head_dim == d and (ragged or call.varlen is not None) and k.shape[0] > 0
                and tma_ok(q, k, v)
                and (ragged or (k.stride(1) == d and v.stride(1) == d and call.varlen_rows > 0)))
    # Column plans: copies of the kernel, one launch each; a selector on the device picks
    # the one whose programs compute (no host sync), the others' leave at once. The copy
    # without the non-finite step does not carry its registers (H100: the single kernel
    # holding both column loops spilled; docs/plan-and-kernels.md), and the unmasked column
    # tiles run in their own copy where `_column_split` cannot settle them on the host.
    initial = _tile_config(plan.block_m, plan.block_n, d)
    col_n = min(initial[1], _COL_TILE) if _COL_TILE else initial[1]
    split = _column_split(plan, col_n, call.mask is not None) if has_columns else False
    copies: list[tuple[bool, bool]]  # (NONFINITE, COL_SPLIT), launched in order; COPY = position
    selector: torch.Tensor | None = None
    if isinstance(split, torch.Tensor):
        copies = [(False, False), (False, True)]
        selector = split
        if v_bad is not None:
            copies.append((True, True))
            selector = torch.maximum(split, 2 * v_bad)
    elif v_bad is not None:
        copies, selector = [(False, split), (True, split)], v_bad
    else:
        copies = [(_NONFINITE, split)]

    def launch_copy(nonfinite: bool, col_split: bool, copy: int, launched: bool) -> bool:
        """Launch one compiled copy (`NONFINITE=nonfinite`, `COL_SPLIT=col_split`, `COPY=copy`),
        falling back to smaller tiles where shared memory runs out; returns True. A launch
        that fails for shared memory never ran, so a fallback leaves what an earlier copy
        wrote alone (block sums are zeroed only before any copy ran)."""
        key = (q.device, q.dtype, d, plan.block_m, plan.block_n, call.mask is not None, use_tma or flat_tma,
               call.varlen is None, has_columns, call.return_lse, ragged, bias is not None,
               work is not None, sums is not None, nonfinite, col_split, call.row_max is not None)
        config = initial if os.environ.get("SPARSEPREFILL_TILE") else _FITTED.get(key, initial)
        # Listed blocks that can reach past a tile's first row overlap the plan block's rows.
        diag = triton.next_power_of_2(plan.block_m // plan.block_n + 2)
        while True:
            block_m, block_n, num_warps, num_stages = config
            k_desc: object = None
            v_desc: object = None
            if use_tma:
                from triton.tools.tensor_descriptor import TensorDescriptor

                k_desc = TensorDescriptor.from_tensor(k, [1, 1, block_n, head_dim])
                v_desc = TensorDescriptor.from_tensor(v, [1, 1, block_n, head_dim])
            elif flat_tma:
                from triton.tools.tensor_descriptor import TensorDescriptor

                if ragged:
                    k_desc = TensorDescriptor.from_tensor(k, [block_n, head_dim])
                    v_desc = TensorDescriptor.from_tensor(v, [block_n, head_dim])
                else:  # the packed [T, Hkv, D] buffers under the varlen views, as [T, Hkv * D]
                    cols = k.shape[1] * d
                    k_desc = TensorDescriptor(k, [call.varlen_rows, cols], [k.stride(2), 1], [block_n, head_dim])
                    v_desc = TensorDescriptor(v, [call.varlen_rows, cols], [v.stride(2), 1], [block_n, head_dim])
            tile_major = _TILE_MAJOR and call.varlen is None
            grid = (b * hq, triton.cdiv(n, block_m)) if tile_major else (triton.cdiv(n, block_m), b * hq)
            tile_start = None
            if call.varlen is not None and _VARLEN_PACKED_GRID and cu_arg is not None:
                # The sequences' query tiles end to end: at most cdiv(T, BLOCK_M) + S programs
                # a head (no host read of the lengths), not S x cdiv(max_seqlen, BLOCK_M).
                tile_start = torch.full((triton.next_power_of_2(b + 1) + 1,), 2**31 - 1, dtype=torch.int32,
                                        device=q.device)
                tile_start[0] = 0
                lengths = (cu_arg[1:] - cu_arg[:-1]).to(torch.int32)
                tile_start[1:b + 1] = torch.cumsum((lengths + block_m - 1) // block_m, 0).to(torch.int32)
                grid = (triton.cdiv(call.varlen_rows or n * b, block_m) + b, hq)
            try:
                _block_column_fwd[grid](
                    q, k, v, out, lse, mask_arg,
                    plan.block_count, plan.block_index, plan.column_count, plan.column_index,
                    *((work.m, work.l, work.acc) if work is not None else (None, None, None)),
                    sums, call.kv_offsets, bias, cu_arg, k_desc, v_desc, selector,
                    call.sm_scale * LOG2E, call.sm_scale, n, call.key_len, plan.query_offset, d, hq, group,
                    plan.block_m, plan.block_n, plan.num_key_blocks, plan.block_index.shape[3],
                    plan.column_index.shape[3], plan.column_group,
                    tuple(q.stride()), kstrides, vstrides, tuple(out.stride()[:3]),
                    tuple(lse.stride()[:2]) if lse is not None else _zero_strides(2), mstrides,
                    tuple(plan.block_count.stride()), tuple(plan.block_index.stride()),
                    tuple(plan.column_count.stride()), tuple(plan.column_index.stride()),
                    tuple(sums.stride()) if sums is not None else _zero_strides(4), xstrides,
                    BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim, SUB_N=plan.block_n // block_n,
                    DIAG=diag, EVEN_D=(head_dim == d), HAS_COLUMNS=has_columns,
                    DOT_F32=dot_f32(q.dtype), USE_TMA=use_tma or flat_tma, PREFETCH=_PREFETCH,
                    SEARCH_STEPS=plan.block_index.shape[3].bit_length() if has_columns else 0,
                    WIN=min(128, triton.next_power_of_2(max(1, plan.block_index.shape[3]))),
                    SKIP_COVERED=has_columns and not plan.columns_disjoint,
                    GUARD=_GUARD, NONFINITE=nonfinite, COL_PREFETCH=_COL_PREFETCH,
                    COL_N=min(block_n, _COL_TILE) if _COL_TILE else block_n,
                    COL_SPLIT=col_split,
                    COL_TAIL=triton.next_power_of_2(plan.block_m) if has_columns else 1,
                    TILE_MAJOR=tile_major, FLAT_TMA=flat_tma, WARP_SPEC=_WARP_SPEC, COPY=copy,
                    TILE_START=tile_start, SEQ_P2=triton.next_power_of_2(b + 1), ROW_MAX_OUT=call.row_max,
                    num_warps=num_warps, num_stages=num_stages,
                )
            except OutOfResources:
                # This GPU has less shared memory than the tile needs (a dense mask's tiles,
                # or a smaller card than an H100/H200): fewer stages, then smaller tiles.
                smaller = _smaller_config(config)
                if smaller is None:
                    raise
                config = smaller
                if sums is not None and not launched:
                    sums.zero_()
                continue
            if config != initial:
                _FITTED[key] = config
            return True

    launched = False
    for copy, (nonfinite, col_split) in enumerate(copies):
        launched = launch_copy(nonfinite, col_split, copy, launched)
    if state is not None and work is not state:
        assert work is not None
        for name in ("m", "l", "acc"):
            getattr(state, name).copy_(getattr(work, name))
    if call.block_mean_out is not None and sums is not None:
        call.block_mean_out.copy_(_block_means(plan, sums))
    return out, lse


def _block_means(plan: BlockColumnPlan, sums: torch.Tensor) -> torch.Tensor:
    """Listed blocks' logit sums over their causal pair counts; -inf for the others."""
    dev = plan.device
    r0 = (torch.arange(plan.num_query_blocks, device=dev, dtype=torch.int64) * plan.block_m)[:, None]
    r1 = torch.clamp(r0 + plan.block_m, max=plan.seqlen) + plan.query_offset
    r0 = r0 + plan.query_offset
    k0 = (torch.arange(plan.num_key_blocks, device=dev, dtype=torch.int64) * plan.block_n)[None, :]
    k1 = torch.clamp(k0 + plan.block_n, max=plan.key_len)
    pairs = causal_pairs(r0, r1, k0, k1).to(torch.float32)
    listed = plan.block_mask() & (pairs > 0)
    return torch.where(listed, sums / pairs.clamp(min=1), float("-inf"))


__all__ = [
    "block_column_attention",
    "check_forward_only",
    "check_kernel_block_sizes",
    "check_kernel_device",
    "interpreter_active",
    "ragged_block_column_attention",
    "varlen_block_column_attention",
]
