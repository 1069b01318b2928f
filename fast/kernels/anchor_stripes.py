"""Triton kernel for AnchorAttention's stripe identification (Alg. 2): anchors -> stripe lists.

For every group `g` of `step` query blocks and every key `j` of its search region
`[block_n, w_g * block_n)`, the group keeps `j` when some query block `i` of the
group has `avgpool(x_a)_i - scale * avgpool(Q)_i . k_j <= theta` (see
`reference.anchor_attention` for the notation and the choices). The
`[Qb, N]` pooled scores (4 GB at 128K tokens and 32 heads in fp32) are never
stored: one program per (key tile of `BLOCK_K` keys, batch row and query head)
loads its key tile once and walks every group whose search region reaches the
tile, `BLOCK_Q` pooled queries at a time.

The kernel runs twice: a counting pass writes the kept keys per (group, key tile),
and each cell's decisions as 128 bits (`STRIPE_BITS`); the launcher turns the counts
into exclusive prefix sums over the tiles (the write offsets) and group counts,
reads the largest group count (the one host synchronisation, to size the lists
exactly) and the fill pass writes every tile's kept keys, in order, at its offset,
from the bits (no second scoring; without `STRIPE_BITS` it scores again). Each
group's list comes out sorted.

Precision: pooled queries and anchors are fp32 means; each pooled query is split
into two 16-bit parts `hi + lo` of the keys' dtype so the tensor-core dot products
(exact products, fp32 sums) carry about 16 (bf16) or 22 (fp16) bits of it. A key
whose float64 difference lies within `conformance.ties.anchor_margin` of `theta`
may be decided differently from the reference.

Layout: kernel -> launchers (`count_stripes`, `fill_stripes`) -> `stripe_index`.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from ...reference._checks import HALF_DTYPES, check_positive_int, check_qk
from ...reference.plan import cdiv
from ..capture import static_widths_active
from ._common import check_device_memory, check_kernel_device, dot as _dot, interpreter_active

# Keys per program and warps (a key tile is loaded once and reused for every group).
_BLOCK_K = 128
_NUM_WARPS = 4
# The counting pass stores its decisions as bits and the fill pass reads them (one
# scoring pass); `SPARSEPREFILL_ANCHOR_STRIPE_BITS=0` recomputes the scores in the fill
# pass instead (the earlier design, kept for timing: docs/anchor_attention.md, designs table).
STRIPE_BITS = os.environ.get("SPARSEPREFILL_ANCHOR_STRIPE_BITS", "1") == "1"


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _anchor_stripes_kernel(
    QH, QL, AMEAN, K, TILE_COUNT, TILE_OFFSET, INDEX, HITS,
    THETA, sm_scale, seqlen, head_dim, num_heads, group, num_qblocks, step,
    block_m, block_n, num_groups, num_tiles, width,
    stride_kb, stride_kh, stride_kn, stride_kd,
    BLOCK_K: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    WRITE: tl.constexpr, DOT_F32: tl.constexpr, SAVE_HITS: tl.constexpr, FROM_HITS: tl.constexpr,
    WORD_BITS: tl.constexpr,
):
    # SAVE_HITS (counting pass): also store each (group, tile)'s kept keys as BLOCK_K bits
    # (BLOCK_K // WORD_BITS int32 words at HITS); FROM_HITS (fill pass): read them back instead
    # of recomputing the pooled scores (no dot products: a pass over the bits).
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_b = i_bh // num_heads
    i_h = i_bh % num_heads
    i_hkv = i_h // group
    # Equation 2's threshold of this query head (fp32, a scalar theta filled).
    theta = tl.load(THETA + i_h)
    k0 = i_t * BLOCK_K
    o_k = k0 + tl.arange(0, BLOCK_K)
    o_d = tl.arange(0, HEAD_DIM)
    m_d = o_d < head_dim
    p_k = K + i_b * stride_kb + i_hkv * stride_kh + o_k.to(tl.int64)[None, :] * stride_kn \
        + o_d[:, None] * stride_kd
    if not FROM_HITS:
        b_k = tl.load(p_k, mask=(o_k[None, :] < seqlen) & m_d[:, None], other=0.0)
    NWORDS: tl.constexpr = BLOCK_K // WORD_BITS
    o_bit = tl.arange(0, WORD_BITS)
    p_qh = QH + i_bh * num_qblocks * head_dim + o_d[None, :]
    p_ql = QL + i_bh * num_qblocks * head_dim + o_d[None, :]
    p_a = AMEAN + i_bh * num_qblocks
    p_row = i_bh * num_groups * num_tiles

    # Group g searches keys [block_n, floor(g * span / block_n) * block_n), span = step * block_m:
    # the first group reaching this tile has floor(g * span / block_n) > k0 // block_n.
    span = step * block_m
    g_first = ((k0 // block_n + 1) * block_n + span - 1) // span
    for g in range(g_first, num_groups):
        # Alg. 2 lines 7-8: the group's search region.
        end = g * span // block_n * block_n
        m_key = (o_k >= block_n) & (o_k < end)
        q0 = g * step
        q1 = tl.minimum(q0 + step, num_qblocks)
        hit = tl.zeros([BLOCK_K], dtype=tl.int32)
        p_cell = p_row + g * num_tiles + i_t
        if FROM_HITS:
            words = tl.load(HITS + p_cell * NWORDS + tl.arange(0, NWORDS))
            hit = tl.reshape((words[:, None] >> o_bit[None, :]) & 1, [BLOCK_K])
        else:
            for c in range(q0, q1, BLOCK_Q):
                o_q = c + tl.arange(0, BLOCK_Q)
                m_q = o_q < q1
                m_qd = m_q[:, None] & m_d[None, :]
                b_qh = tl.load(p_qh + o_q.to(tl.int64)[:, None] * head_dim, mask=m_qd, other=0.0)
                b_ql = tl.load(p_ql + o_q.to(tl.int64)[:, None] * head_dim, mask=m_qd, other=0.0)
                b_a = tl.load(p_a + o_q, mask=m_q, other=0.0)
                # Alg. 2 line 10: scale * avgpool(Q) . k, from the two parts of the pooled query.
                b_s = (_dot(b_qh, b_k, DOT_F32) + _dot(b_ql, b_k, DOT_F32)) * sm_scale
                # Alg. 2 line 11 / Equation 2, and Section 3.4's union over the group.
                b_keep = ((b_a[:, None] - b_s) <= theta) & m_q[:, None]
                hit = tl.maximum(hit, tl.max(b_keep.to(tl.int32), 0))
        hit = tl.where(m_key, hit, 0)
        if SAVE_HITS:
            bits = tl.reshape(hit, [NWORDS, WORD_BITS]) << o_bit[None, :]
            tl.store(HITS + p_cell * NWORDS + tl.arange(0, NWORDS), tl.reduce(bits, 1, _bit_or))
        if WRITE:
            offset = tl.load(TILE_OFFSET + p_cell)
            pos = offset + tl.cumsum(hit, 0) - hit
            p_out = INDEX + (i_bh * num_groups + g) * width + pos
            tl.store(p_out, o_k, mask=(hit > 0) & (pos < width))
        else:
            tl.store(TILE_COUNT + p_cell, tl.sum(hit, 0))


def _launch(
    q_hi: torch.Tensor, q_lo: torch.Tensor, a_mean: torch.Tensor, k: torch.Tensor,
    tile_count: torch.Tensor, tile_offset: torch.Tensor, index: torch.Tensor, *,
    theta: torch.Tensor, sm_scale: float, step: int, block_m: int, block_n: int, num_groups: int,
    write: bool, hits: torch.Tensor | None = None,
) -> None:
    b, hq, qb, d = q_hi.shape
    n = k.shape[2]
    tiles = tile_count.shape[2]
    block_q = min(64, max(16, triton.next_power_of_2(step)))
    head_dim = max(16, triton.next_power_of_2(d))
    _anchor_stripes_kernel[(tiles, b * hq)](
        q_hi, q_lo, a_mean, k, tile_count, tile_offset, index, tile_count if hits is None else hits,
        theta, sm_scale, n, d, hq, hq // k.shape[1], qb, step,
        block_m, block_n, num_groups, tiles, index.shape[-1],
        *k.stride(),
        BLOCK_K=_BLOCK_K, BLOCK_Q=block_q, HEAD_DIM=head_dim, WRITE=write,
        DOT_F32=interpreter_active(), SAVE_HITS=hits is not None and not write,
        FROM_HITS=hits is not None and write, WORD_BITS=_word_bits(), num_warps=_NUM_WARPS,
        num_stages=1 if interpreter_active() else 2,
    )


def pooled_queries(q: torch.Tensor, block_m: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 2 line 1, `avgpool(Q)`, as two parts `(hi, lo)` of `dtype`, `[B, Hq, Qb, D]` each.

    The fp32 mean (the last block averages its real rows) equals `hi + lo` to about
    16 (bf16) or 22 (fp16) bits.
    """
    b, h, n, d = q.shape
    full = n // block_m
    parts = []
    if full:
        parts.append(q[:, :, : full * block_m].reshape(b, h, full, block_m, d)
                     .sum(dim=3, dtype=torch.float32) / block_m)
    if n > full * block_m:
        tail = q[:, :, full * block_m:]
        parts.append(tail.sum(dim=2, keepdim=True, dtype=torch.float32) / (n - full * block_m))
    mean = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
    hi = mean.to(dtype)
    lo = (mean - hi.to(torch.float32)).to(dtype)
    return hi.contiguous(), lo.contiguous()


def pooled_anchor(x_a: torch.Tensor, block_m: int) -> torch.Tensor:
    """Alg. 2 line 2, `avgpool(x_a)`: fp32 `[B, Hq, Qb]`, the mean anchor of each query block."""
    b, h, n = x_a.shape
    qb = cdiv(n, block_m)
    padded = torch.zeros(b, h, qb * block_m, dtype=torch.float32, device=x_a.device)
    padded[:, :, :n] = x_a
    sizes = (n - torch.arange(qb, device=x_a.device) * block_m).clamp(max=block_m)
    return (padded.reshape(b, h, qb, block_m).sum(dim=3) / sizes.to(torch.float32)).contiguous()


def search_width_bound(seqlen: int, *, step: int, block_m: int, block_n: int) -> int:
    """The most keys any group's search region holds (the last group's), from the sizes alone."""
    groups = cdiv(cdiv(seqlen, block_m), step)
    end = (groups - 1) * step * block_m // block_n * block_n
    return max(0, end - block_n)


def count_stripes(
    q_hi: torch.Tensor, q_lo: torch.Tensor, a_mean: torch.Tensor, k: torch.Tensor, *,
    theta: torch.Tensor, sm_scale: float, step: int, block_m: int, block_n: int,
    hits: torch.Tensor | None = None,
) -> torch.Tensor:
    """The counting pass: kept keys per (batch row and head, group, key tile), int32
    `[B * Hq, G, ceil(N / 128)]` (no host synchronisation); with `hits` (int32
    `[B * Hq, G, ceil(N / 128), 4]`, see `hit_bits`) also each cell's kept keys as bits."""
    b, hq, qb, _ = q_hi.shape
    groups = cdiv(qb, step)
    tiles = cdiv(k.shape[2], _BLOCK_K)
    tile_count = torch.zeros(b * hq, groups, tiles, dtype=torch.int32, device=k.device)
    _launch(q_hi, q_lo, a_mean, k, tile_count, tile_count, tile_count, theta=theta,
            sm_scale=sm_scale, step=step, block_m=block_m, block_n=block_n, num_groups=groups,
            write=False, hits=hits)
    return tile_count


def _word_bits() -> int:
    """Bits used per int32 word of `hit_bits` (fewer where a key tile is narrower than 32)."""
    return min(32, _BLOCK_K)


def hit_bits(batch: int, heads: int, seqlen: int, *, step: int, block_m: int,
             device: torch.device) -> torch.Tensor:
    """The counting pass's kept-key bits, int32 `[B * Hq, G, ceil(N / 128), 4]` (128 keys a
    cell, one bit each; cells no group reaches stay unwritten and are never read):
    `4 * B * Hq * G * N / 32` bytes, 32 MB at 128K tokens, 32 heads, step 16."""
    groups = cdiv(cdiv(seqlen, block_m), step)
    tiles = cdiv(seqlen, _BLOCK_K)
    words = _BLOCK_K // _word_bits()
    nbytes = batch * heads * groups * tiles * words * 4
    check_device_memory(f"AnchorAttention's kept-key bits ([B * Hq, G, tiles] = [{batch * heads}, {groups}, "
                        f"{tiles}])", nbytes, device,
                        hint="A larger step or fewer heads per call fit.")
    return torch.empty(batch * heads, groups, tiles, words, dtype=torch.int32, device=device)


def fill_stripes(
    q_hi: torch.Tensor, q_lo: torch.Tensor, a_mean: torch.Tensor, k: torch.Tensor,
    tile_count: torch.Tensor, *, width: int, theta: torch.Tensor, sm_scale: float, step: int,
    block_m: int, block_n: int, hits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fill pass (no host sync): (group counts int32 `[B, Hq, G]`, sorted keys int32
    `[B, Hq, G, width]`, padding 0), `width` at least the largest group count. With
    `hits` (the counting pass's bits) it reads them instead of recomputing the scores."""
    b, hq, qb, _ = q_hi.shape
    groups = tile_count.shape[1]
    offsets = (torch.cumsum(tile_count, dim=2, dtype=torch.int32) - tile_count).contiguous()
    counts = tile_count.sum(dim=2, dtype=torch.int32).reshape(b, hq, groups)
    # Quadratic in tokens where theta keeps most keys: G = Qb / step groups of up to N
    # columns each (16 GiB at 512K, 32 heads, step 16, density 0.87 on the H100).
    check_device_memory(f"AnchorAttention's stripe column lists ([B, Hq, G, width] = [{b}, {hq}, {groups}, "
                        f"{width}])", b * hq * groups * width * 4, k.device,
                        hint="A smaller theta (fewer stripe keys), a larger step or fewer heads per call fit.")
    index = torch.zeros(b * hq, groups, width, dtype=torch.int32, device=k.device)
    if width > 0:
        _launch(q_hi, q_lo, a_mean, k, tile_count, offsets, index, theta=theta, sm_scale=sm_scale,
                step=step, block_m=block_m, block_n=block_n, num_groups=groups, write=True, hits=hits)
    return counts, index.reshape(b, hq, groups, width)


def stripe_index(
    q: torch.Tensor,
    k: torch.Tensor,
    x_a: torch.Tensor,
    *,
    theta: float | torch.Tensor,
    step: int,
    block_m: int,
    block_n: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 2 on the GPU: every group's stripe keys (see `reference.anchor_attention.stripe_sets`).

    Args:
        q: `[B, Hq, N, D]` fp16/bf16; k: `[B, Hkv, N, D]` (any strides).
        x_a: fp32 `[B, Hq, N]`, the anchors (the `m` of the anchor pass's state).
        theta: Equation 2's threshold (natural-log units, >= 0): a float, or float `[Hq]`
            per query head (its values read back once for the check).
        step, block_m, block_n: group size in query blocks; block sizes.
        scale: softmax scale.

    Returns:
        (counts int32 `[B, Hq, G]`, keys int32 `[B, Hq, G, W]`): each group's kept keys,
        sorted, `W` the largest count (one host synchronisation; the parameter bound
        `search_width_bound` while a CUDA graph is being captured or inside
        `fast.capture.static_widths()`).

    Raises:
        TypeError, ValueError: bad shapes, dtypes or devices, head dim > 256.
    """
    shape = check_qk(q, k, dtypes=HALF_DTYPES)
    check_kernel_device(q)
    for name, value in (("step", step), ("block_m", block_m), ("block_n", block_n)):
        check_positive_int(name, value)
    if shape.head_dim > 256:
        raise ValueError(f"head dim D must be <= 256 for the fast kernels, got {shape.head_dim}")
    want = (shape.batch, shape.q_heads, shape.seqlen)
    if not isinstance(x_a, torch.Tensor) or x_a.dtype != torch.float32 or tuple(x_a.shape) != want:
        got = (x_a.dtype, tuple(x_a.shape)) if isinstance(x_a, torch.Tensor) else type(x_a).__name__
        raise ValueError(f"x_a must be a float32 tensor of shape {list(want)}, got {got}")
    if x_a.device != q.device:
        raise ValueError(f"x_a must be on the device of q ({q.device}), got {x_a.device}")
    if isinstance(theta, torch.Tensor):
        if tuple(theta.shape) != (shape.q_heads,) or not theta.is_floating_point():
            raise ValueError(f"theta per head must be a float tensor of shape [{shape.q_heads}], got "
                             f"{theta.dtype} {tuple(theta.shape)}")
        if bool((theta.isnan() | (theta < 0)).any()):
            raise ValueError(f"theta must be >= 0, got {theta.tolist()}")
        thetas = theta.to(device=q.device, dtype=torch.float32).contiguous()
    else:
        if math.isnan(theta) or theta < 0:
            raise ValueError(f"theta must be >= 0, got {theta}")
        # The fp32 the kernel's scalar argument was (a fill: no copy, no host synchronisation).
        thetas = torch.full((shape.q_heads,), float(theta), dtype=torch.float32, device=q.device)
    # Groups of more query blocks than exist are one group: keeps the kernel's ints small.
    step = min(step, cdiv(shape.seqlen, block_m))
    q_hi, q_lo = pooled_queries(q, block_m, k.dtype)
    a_mean = pooled_anchor(x_a, block_m)
    hits = (hit_bits(shape.batch, shape.q_heads, shape.seqlen, step=step, block_m=block_m,
                     device=k.device) if STRIPE_BITS else None)
    tile_count = count_stripes(q_hi, q_lo, a_mean, k, theta=thetas, sm_scale=float(scale),
                               step=step, block_m=block_m, block_n=block_n, hits=hits)
    if static_widths_active(k):
        width = search_width_bound(shape.seqlen, step=step, block_m=block_m, block_n=block_n)
    else:
        width = int(tile_count.sum(dim=2).max().item()) if tile_count.numel() else 0
    return fill_stripes(q_hi, q_lo, a_mean, k, tile_count, width=width, theta=thetas,
                        sm_scale=float(scale), step=step, block_m=block_m, block_n=block_n, hits=hits)
