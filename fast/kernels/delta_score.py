"""Triton kernels for DPXA (see `reference.dpxa` for the spec).

1. The anchors: Delta-KV's stage-1 kernel (`fast.kernels.delta_pack.keep_mask`, bit-
   identical to `reference.delta_kv.delta_keep_mask`) with the tile as the chunk, on the
   queries and on the keys; each tile's anchor positions are then packed to its front
   (`[B, H, T, block]`) by a stable sort of the tile's flags, and counted (`[B, H, T]`).
2. `_anchor_tile_score_kernel`: per (query tile, query head), for every causal key
   tile, the Q anchors of the query tile against the K anchors of the key tile,
   `BLOCK_A` packed anchors at a time (so the work is about `alpha * beta` of a full
   tile), `sum exp2(s - m)` with `m` the running maximum over the row of tiles. It
   stores, per tile, that sum and the `m` it is relative to; the launcher rescales
   the row to its final maximum and normalises it. Only `[B, Hq, T, T]` is written.

GQA maps query head `h` to KV head `h // G` (K anchors are computed once per KV
head). No host synchronisation.

Layout: kernel -> launchers (`delta_anchor_lists`, `dpxa_tile_weights`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...reference._checks import HALF_DTYPES, check_qk, resolve_scale
from ...reference.dpxa import check_dpxa_params
from ...reference.plan import cdiv
from ._common import LOG2E, check_forward_only, check_kernel_device, dot as _dot, interpreter_active
from .delta_pack import keep_mask
from .xattention_score import check_fast_block


@triton.jit
def _anchor_tile_score_kernel(
    Q, K, Q_POS, Q_COUNT, K_POS, K_COUNT, ACC, MAX,
    qk_scale, head_dim, num_heads, group, num_kv_heads, block, num_tiles,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    BLOCK_A: tl.constexpr, BLOCK_J: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr,
):
    # One query tile against BLOCK_J key tiles per step: the K anchors of those tiles sit
    # side by side, BLOCK_A slots each, so one dot scores them all.
    i_q = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_b = i_bh // num_heads
    i_h = i_bh % num_heads
    i_hkv = i_h // group
    i_bkv = i_b * num_kv_heads + i_hkv
    o_a = tl.arange(0, BLOCK_A)
    o_d = tl.arange(0, HEAD_DIM)
    m_d = o_d < head_dim
    COLS: tl.constexpr = BLOCK_J * BLOCK_A
    o_c = tl.arange(0, COLS)
    c_tile = o_c // BLOCK_A
    c_slot = o_c % BLOCK_A
    o_j = tl.arange(0, BLOCK_J)
    p_q = Q + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh + o_d[None, :] * stride_qd
    p_k = K + i_b.to(tl.int64) * stride_kb + i_hkv.to(tl.int64) * stride_kh + o_d[:, None] * stride_kd
    p_qpos = Q_POS + (i_bh.to(tl.int64) * num_tiles + i_q) * block
    p_kcount = K_COUNT + i_bkv.to(tl.int64) * num_tiles
    p_kpos = K_POS + i_bkv.to(tl.int64) * num_tiles * block
    n_q = tl.load(Q_COUNT + i_bh.to(tl.int64) * num_tiles + i_q)
    p_out = i_bh.to(tl.int64) * num_tiles * num_tiles + i_q * num_tiles
    m_run = float("-inf")
    for j0 in range(0, i_q + 1, BLOCK_J):
        m_cj = j0 + c_tile <= i_q
        n_k = tl.load(p_kcount + j0 + c_tile, mask=m_cj, other=0)
        most = tl.max(n_k, 0)
        acc = tl.zeros([BLOCK_J], dtype=tl.float32)
        for a0 in range(0, n_q, BLOCK_A):
            m_qa = a0 + o_a < n_q
            q_pos = tl.load(p_qpos + a0 + o_a, mask=m_qa, other=0)
            b_q = tl.load(p_q + q_pos.to(tl.int64)[:, None] * stride_qn,
                          mask=m_qa[:, None] & m_d[None, :], other=0.0)
            for c0 in range(0, most, BLOCK_A):
                m_ka = c0 + c_slot < n_k
                k_pos = tl.load(p_kpos + (j0 + c_tile).to(tl.int64) * block + c0 + c_slot,
                                mask=m_ka, other=0)
                b_k = tl.load(p_k + k_pos.to(tl.int64)[None, :] * stride_kn,
                              mask=m_ka[None, :] & m_d[:, None], other=0.0)
                # Sec. 4.3: one cell of the full tile per anchor pair; causal per token.
                b_s = _dot(b_q, b_k, DOT_F32) * qk_scale
                # A non-finite score (NaN or infinity in q or k) weighs nothing.
                valid = m_qa[:, None] & m_ka[None, :] & (k_pos[None, :] <= q_pos[:, None]) \
                    & (tl.abs(b_s) < float("inf"))
                b_s = tl.where(valid, b_s, float("-inf"))
                m_new = tl.maximum(m_run, tl.max(b_s))
                m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                b_p = tl.reshape(tl.math.exp2(b_s - m_shift), (BLOCK_A, BLOCK_J, BLOCK_A))
                acc = acc * tl.math.exp2(m_run - m_shift) + tl.sum(tl.sum(b_p, 2), 0)
                m_run = m_new
        # Each tile's sum is relative to the running maximum after its step.
        m_j = j0 + o_j <= i_q
        tl.store(ACC + p_out + j0 + o_j, acc, mask=m_j)
        tl.store(MAX + p_out + j0 + o_j, tl.full([BLOCK_J], 0.0, tl.float32) + m_run, mask=m_j)


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


def _check_qk(q: torch.Tensor, k: torch.Tensor, *, cos_threshold: float, threshold: float,
              block: int) -> tuple[float, int]:
    shape = check_qk(q, k, dtypes=HALF_DTYPES)
    check_kernel_device(q)
    check_forward_only(q, k)
    cos, _, bs = check_dpxa_params(cos_threshold=cos_threshold, threshold=threshold, block=block)
    check_fast_block(bs)
    if shape.head_dim > 256:
        raise ValueError(f"head dim D must be <= 256 for the fast kernels, got {shape.head_dim}")
    return cos, bs


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
    cos_threshold, block = _check_qk(q, k, cos_threshold=cos_threshold, threshold=1.0, block=block)
    sm_scale = resolve_scale(scale, q.shape[3])
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    tiles = cdiv(n, block)
    _, q_pos, q_count = delta_anchor_lists(q, cos_threshold=cos_threshold, block=block)
    _, k_pos, k_count = delta_anchor_lists(k, cos_threshold=cos_threshold, block=block)
    acc = torch.zeros(b, hq, tiles, tiles, dtype=torch.float32, device=q.device)
    row_max = torch.full((b, hq, tiles, tiles), float("-inf"), dtype=torch.float32, device=q.device)
    if interpreter_active():
        # Fewer, larger steps: the interpreter's cost is per operation, not per element.
        block_a = min(64, triton.next_power_of_2(block))
        block_j = max(1, 256 // block_a)
    else:
        block_a = 16 if block < 64 else 32
        block_j = max(1, 128 // block_a)
    _anchor_tile_score_kernel[(tiles, b * hq)](
        q, k, q_pos, q_count, k_pos, k_count, acc, row_max,
        sm_scale * LOG2E, d, hq, hq // hkv, hkv, block, tiles, *q.stride(), *k.stride(),
        BLOCK_A=block_a, BLOCK_J=block_j, HEAD_DIM=max(16, triton.next_power_of_2(d)),
        DOT_F32=interpreter_active() and q.dtype == torch.bfloat16,
        num_warps=4, num_stages=1 if interpreter_active() else 2,
    )
    # Each tile's sum is relative to the running maximum when it was written.
    final = row_max.amax(dim=-1, keepdim=True)
    scores = acc * torch.exp2(row_max - final)
    return scores / scores.sum(dim=-1, keepdim=True)


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
    cos_threshold, block = _check_qk(q, k, cos_threshold=cos_threshold, threshold=1.0, block=block)
    n = q.shape[2]
    g = q.shape[1] // k.shape[1]
    _, _, q_count = delta_anchor_lists(q, cos_threshold=cos_threshold, block=block)
    _, _, k_count = delta_anchor_lists(k, cos_threshold=cos_threshold, block=block)
    alpha = q_count.sum(dim=-1).to(torch.float64) / n
    beta = k_count.sum(dim=-1).to(torch.float64) / n
    return alpha * beta.repeat_interleave(g, dim=1)
