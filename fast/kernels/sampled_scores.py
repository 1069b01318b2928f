"""Triton kernels for SampleAttention's stage 1 (Alg. 1 lines 3-4): sampled block scores.

The sampled rows (`reference.sample_attention.sampled_rows`: the last `block_size`
rows of each of `chunk_n` chunks) attend exactly to their causal keys; their
softmax `A_hat` (`[R, N]` per head) is never stored. The rows are cut into tiles
of at most `BLOCK_L` rows, each inside one query block of the `block_size` grid,
and two kernels recompute score tiles:

1. `_lse_partial_kernel`: per (key split, row tile, head), the online-softmax
   `(max, sum)` of the tile's rows over the split's keys, in log2 units; the
   launcher combines the splits into each row's log2-sum-exp.
2. `_mass_kernel`: per (key split, row tile, head), `sum exp2(s - lse)` over the
   tile's rows and each `BLOCK_N`-key sub-tile, written to its own slot of a
   `[B * Hq, T, N / BLOCK_N]` buffer (no atomics: the result does not depend on
   the launch order).

`BLOCK_N` divides `block_size`, so the launcher sums sub-tiles into key blocks
(float64), then over tiles into column scores and along block diagonals (the
tile's query block minus the key block) into slash scores. Memory beyond q and k:
`O(B * Hq * T * N / BLOCK_N)` floats, T = ceil(R / BLOCK_L) tiles (at 128K,
chunk_n = 4, 32 heads: 2 MiB). No host synchronisation.

Layout: kernels -> launcher (`sampled_block_scores`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ...reference._checks import HALF_DTYPES, check_positive_int, check_qk, resolve_scale
from ...reference.plan import cdiv
from ._common import LOG2E, check_kernel_device, dot as _dot_f32, interpreter_active

# Keys per split: enough programs to fill the GPU when few rows are sampled.
_SPLIT_KEYS = 4096
# Sampled rows per program.
_BLOCK_L = 64


@triton.jit
def _tile_rows(TILES, i_t, BLOCK_L: tl.constexpr):
    """Rows `[start, stop)` of row tile `i_t`, as an arange and its mask."""
    start = tl.load(TILES + 2 * i_t)
    stop = tl.load(TILES + 2 * i_t + 1)
    o_r = start + tl.arange(0, BLOCK_L)
    return o_r, o_r < stop, stop


@triton.jit
def _load_q(Q, i_b, i_h, o_r, m_r, o_d, m_d, stride_qb, stride_qh, stride_qn, stride_qd):
    p_q = Q + i_b.to(tl.int64) * stride_qb + i_h.to(tl.int64) * stride_qh \
        + o_r.to(tl.int64)[:, None] * stride_qn + o_d[None, :] * stride_qd
    return tl.load(p_q, mask=m_r[:, None] & m_d[None, :], other=0.0)


@triton.jit
def _lse_partial_kernel(
    Q, K, TILES, M_OUT, S_OUT,
    qk_scale, seqlen, head_dim, num_heads, group, split_keys, num_tiles,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr,
):
    i_split = tl.program_id(0)
    i_t = tl.program_id(1)
    i_bh = tl.program_id(2)
    i_b = i_bh // num_heads
    i_h = i_bh % num_heads
    o_r, m_r, stop_r = _tile_rows(TILES, i_t, BLOCK_L)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, HEAD_DIM)
    m_d = o_d < head_dim
    b_q = _load_q(Q, i_b, i_h, o_r, m_r, o_d, m_d, stride_qb, stride_qh, stride_qn, stride_qd)
    p_k = K + i_b.to(tl.int64) * stride_kb + (i_h // group).to(tl.int64) * stride_kh \
        + o_d[:, None] * stride_kd

    m_i = tl.full([BLOCK_L], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_L], dtype=tl.float32)
    start = i_split * split_keys
    # Keys at or after the tile's last row + 1 are masked for every row of the tile.
    stop = tl.minimum(start + split_keys, stop_r)
    for start_n in range(start, stop, BLOCK_N):
        o_c = start_n + o_n
        b_k = tl.load(p_k + o_c.to(tl.int64)[None, :] * stride_kn,
                      mask=(o_c[None, :] < seqlen) & m_d[:, None], other=0.0)
        b_s = _dot_f32(b_q, b_k, DOT_F32) * qk_scale
        b_s = tl.where(o_c[None, :] <= o_r[:, None], b_s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(b_s, 1))
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.math.exp2(m_i - m_shift) + tl.sum(tl.math.exp2(b_s - m_shift[:, None]), 1)
        m_i = m_new
    # Every slot is written, so the combine reads no uninitialised memory; slots of rows past
    # the tile hold values that the mass kernel masks out.
    p_out = (i_bh.to(tl.int64) * tl.num_programs(0) + i_split) * num_tiles * BLOCK_L \
        + i_t * BLOCK_L + tl.arange(0, BLOCK_L)
    tl.store(M_OUT + p_out, m_i)
    tl.store(S_OUT + p_out, l_i)


@triton.jit
def _mass_kernel(
    Q, K, TILES, LSE, PART,
    qk_scale, seqlen, head_dim, num_heads, group, split_keys, num_tiles, num_sub,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    BLOCK_L: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_F32: tl.constexpr,
):
    i_split = tl.program_id(0)
    i_t = tl.program_id(1)
    i_bh = tl.program_id(2)
    i_b = i_bh // num_heads
    i_h = i_bh % num_heads
    o_r, m_r, stop_r = _tile_rows(TILES, i_t, BLOCK_L)
    o_n = tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, HEAD_DIM)
    m_d = o_d < head_dim
    b_q = _load_q(Q, i_b, i_h, o_r, m_r, o_d, m_d, stride_qb, stride_qh, stride_qn, stride_qd)
    b_lse = tl.load(LSE + (i_bh.to(tl.int64) * num_tiles + i_t) * BLOCK_L + tl.arange(0, BLOCK_L))
    p_k = K + i_b.to(tl.int64) * stride_kb + (i_h // group).to(tl.int64) * stride_kh \
        + o_d[:, None] * stride_kd
    p_part = PART + (i_bh.to(tl.int64) * num_tiles + i_t) * num_sub
    start = i_split * split_keys
    stop = tl.minimum(start + split_keys, stop_r)
    for start_n in range(start, stop, BLOCK_N):
        o_c = start_n + o_n
        b_k = tl.load(p_k + o_c.to(tl.int64)[None, :] * stride_kn,
                      mask=(o_c[None, :] < seqlen) & m_d[:, None], other=0.0)
        b_s = _dot_f32(b_q, b_k, DOT_F32) * qk_scale
        m_keep = m_r[:, None] & (o_c[None, :] <= o_r[:, None])
        b_p = tl.where(m_keep, tl.math.exp2(b_s - b_lse[:, None]), 0.0)
        tl.store(p_part + start_n // BLOCK_N, tl.sum(tl.sum(b_p, 1), 0))


def row_tiles(spans: list[tuple[int, int]], block_size: int, block_l: int = _BLOCK_L) -> list[tuple[int, int]]:
    """Cut sampled row spans into tiles of at most `block_l` rows inside one query block."""
    tiles = []
    for start, stop in spans:
        r = start
        while r < stop:
            end = min(stop, (r // block_size + 1) * block_size, r + block_l)
            tiles.append((r, end))
            r = end
    return tiles


#: Where `_sampled_block_scores` gets its tile table: "cached" (built once per spans,
#: block size and device from `row_tiles` and kept, see `tile_table`) or "device"
#: (rebuilt on the device every call by `row_tile_table`, the design until 2026-11-26).
#: Same table; timings in docs/sample_attention.md (designs table).
TILE_TABLE = "cached"
#: At most this many tables are kept; later ones are built on the device each call.
TILE_TABLE_CACHE = 64
_TABLES: dict[tuple[tuple[tuple[int, int], ...], int, int, torch.device], tuple[torch.Tensor, int]] = {}


def tile_table(
    spans: list[tuple[int, int]], block_size: int, device: torch.device, block_l: int = _BLOCK_L
) -> tuple[torch.Tensor, int]:
    """`row_tile_table`, kept per (spans, block size, rows a tile, device).

    The table depends on parameters only (the spans come from N, `chunk_n` and the
    block size), so the first call outside a CUDA-graph capture builds it on the host
    and copies it over once, and later calls reuse it: no launches at all, against
    about `2 * len(spans) + 8` small ones. Kept tables are never evicted (a captured
    graph may read one) and never written. During a capture, or with `TILE_TABLE =
    "device"`, or once `TILE_TABLE_CACHE` tables are kept, the table is built on the
    device by `row_tile_table` (capture-safe).
    """
    key = (tuple(spans), block_size, block_l, device)
    hit = _TABLES.get(key)
    if hit is not None and TILE_TABLE == "cached":
        return hit
    if (TILE_TABLE != "cached" or len(_TABLES) >= TILE_TABLE_CACHE
            or (device.type == "cuda" and torch.cuda.is_current_stream_capturing())):
        return row_tile_table(spans, block_size, device, block_l)
    tiles = row_tiles(spans, block_size, block_l)
    table = torch.tensor(tiles, dtype=torch.int32).reshape(len(tiles), 2).to(device)
    _TABLES[key] = (table, len(tiles))
    return table, len(tiles)


def row_tile_table(
    spans: list[tuple[int, int]], block_size: int, device: torch.device, block_l: int = _BLOCK_L
) -> tuple[torch.Tensor, int]:
    """`row_tiles` as an int32 `[T, 2]` device table, built on the device.

    The rows come from one `arange` per span and the cuts from arithmetic on them (a
    row starts a tile at a span start, a query-block boundary, or every `block_l` rows
    after either); each tile's bounds are a scatter-min / scatter-max by tile number.
    Kernel launches with scalar arguments only: no host-to-device copy and no
    synchronisation, so a CUDA graph can be captured around it. `T` comes from the
    host-side `row_tiles` (the spans are parameters, not data).

    Returns:
        (table, T): rows `[start, stop)` of each tile, in `row_tiles`' order.
    """
    num_tiles = len(row_tiles(spans, block_size, block_l))
    rows = torch.cat([torch.arange(a, z, device=device, dtype=torch.int64) for a, z in spans])
    first = torch.cat([torch.full((z - a,), a, device=device, dtype=torch.int64) for a, z in spans])
    piece = torch.maximum(first, torch.div(rows, block_size, rounding_mode="floor") * block_size)
    opens = (rows - piece) % block_l == 0
    tile = torch.cumsum(opens.to(torch.int64), 0) - 1
    start = torch.zeros(num_tiles, dtype=torch.int64, device=device)
    stop = torch.zeros(num_tiles, dtype=torch.int64, device=device)
    start.scatter_reduce_(0, tile, rows, "amin", include_self=False)
    stop.scatter_reduce_(0, tile, rows + 1, "amax", include_self=False)
    return torch.stack([start, stop], dim=1).to(torch.int32).contiguous(), num_tiles


def sampled_block_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    spans: list[tuple[int, int]],
    block_size: int,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Column and slash block scores of the sampled rows (Alg. 1 lines 3-4).

    Args:
        q: `[B, Hq, N, D]` float16/bfloat16 (any strides); k: `[B, Hkv, N, D]`.
        spans: sorted, disjoint sampled row ranges `[start, stop)` within `[0, N)`.
        block_size: the block grid, a multiple of 16.
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        (column, slash), float64 `[B, Hq, Kb]`: the sampled mass per key block, and
        per block diagonal `d = row // block_size - key block`.

    Raises:
        TypeError, ValueError: bad inputs (dtype, device, shapes, head dim > 256,
            block size, empty or out-of-range spans).
    """
    shape = check_qk(q, k, dtypes=HALF_DTYPES)
    bs = check_positive_int("block_size", block_size)
    if bs % 16:
        raise ValueError(f"block_size must be a multiple of 16 for the fast kernels, got {bs}")
    check_score_inputs(q)
    n = shape.seqlen
    if not spans or any(not 0 <= a < z <= n for a, z in spans):
        raise ValueError(f"spans must be non-empty ranges inside [0, {n}), got {spans[:4]}")
    return _sampled_block_scores(q, k, spans=spans, block_size=bs, sm_scale=resolve_scale(scale, shape.head_dim))


def check_score_inputs(q: torch.Tensor) -> None:
    """The kernels' own limits on checked q: a CUDA device (or the interpreter), D <= 256."""
    check_kernel_device(q)
    if q.shape[3] > 256:
        raise ValueError(f"head dim D must be <= 256 for the fast kernels, got {q.shape[3]}")


def _sampled_block_scores(
    q: torch.Tensor, k: torch.Tensor, *, spans: list[tuple[int, int]], block_size: int, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sampled_block_scores` on checked inputs and parameters."""
    b, hq, n, d = q.shape
    group = hq // k.shape[1]
    bs = block_size
    qk_scale = sm_scale * LOG2E
    tile_t, num_tiles = tile_table(spans, bs, q.device)
    block_n = math.gcd(bs, 64)
    head_dim = max(16, triton.next_power_of_2(d))
    dot_f32 = interpreter_active() and q.dtype == torch.bfloat16
    num_stages = 1 if interpreter_active() else 2
    splits = cdiv(n, _SPLIT_KEYS)
    grid = (splits, num_tiles, b * hq)
    common = (qk_scale, n, d, hq, group, _SPLIT_KEYS, num_tiles)
    strides = (*q.stride(), *k.stride())

    m_part = torch.empty(b * hq, splits, num_tiles * _BLOCK_L, dtype=torch.float32, device=q.device)
    s_part = torch.empty_like(m_part)
    _lse_partial_kernel[grid](
        q, k, tile_t, m_part, s_part, *common, *strides,
        BLOCK_L=_BLOCK_L, BLOCK_N=64, HEAD_DIM=head_dim, DOT_F32=dot_f32,
        num_warps=4, num_stages=num_stages,
    )
    # Every row sees key 0, in split 0: the combined max of a real row is finite.
    m_all = m_part.amax(dim=1, keepdim=True)
    m_safe = torch.where(torch.isfinite(m_all), m_all, torch.zeros_like(m_all))
    lse = m_safe + torch.log2((s_part * torch.exp2(m_part - m_safe)).sum(dim=1, keepdim=True))
    lse = lse.squeeze(1).contiguous()

    num_sub = cdiv(n, block_n)
    # Zeros: sub-tiles right of a tile's last row are never written.
    part = torch.zeros(b * hq, num_tiles, num_sub, dtype=torch.float32, device=q.device)
    _mass_kernel[grid](
        q, k, tile_t, lse, part, *common, num_sub, *strides,
        BLOCK_L=_BLOCK_L, BLOCK_N=block_n, HEAD_DIM=head_dim, DOT_F32=dot_f32,
        num_warps=4, num_stages=num_stages,
    )
    kb = cdiv(n, bs)
    per_block = bs // block_n
    cells = torch.zeros(b * hq, num_tiles, kb * per_block, dtype=torch.float64, device=q.device)
    cells[..., :num_sub] = part
    cells = cells.reshape(b * hq, num_tiles, kb, per_block).sum(dim=-1)  # [BH, T, Kb]
    column = cells.sum(dim=1)
    qblock = torch.div(tile_t[:, 0].to(torch.int64), bs, rounding_mode="floor")
    diag = qblock[:, None] - torch.arange(kb, device=q.device)[None, :]
    diag = torch.where(diag >= 0, diag, kb).expand(b * hq, num_tiles, kb).reshape(b * hq, -1)
    slash = torch.zeros(b * hq, kb + 1, dtype=torch.float64, device=q.device)
    slash.scatter_add_(1, diag, cells.reshape(b * hq, -1))
    return column.reshape(b, hq, kb), slash[:, :kb].reshape(b, hq, kb)
