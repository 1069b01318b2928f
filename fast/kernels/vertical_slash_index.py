"""Triton kernel for MInference's Vertical-Slash index (Alg. 4): lines -> `BlockColumnPlan`.

Blocks (Alg. 4's slash part): one program per (batch, head, query block
`[r0, r1)`), O(k_s) work. A kept offset `o <= r1 - 1` covers the keys
`[max(r0 - o, 0), r1 - o)`, i.e. the key blocks `[f, l]` with
`f = max(r0 - o, 0) // block_n`, `l = (r1 - 1 - o) // block_n`. Taken in
descending `o`, both `f` and `l` never decrease, so the blocks a slash adds to the
union of the earlier ones are `[max(f, l_prev + 1), l]`: the two-way merge of
Alg. 4 becomes a prefix sum over chunks of slashes, and every slash writes its (at
most `(block_m - 1) // block_n + 2`) new blocks at its prefix-sum position.

Each query block's walk starts at its first slash that reaches it (a bisection
of the sorted offsets, `SKIP_UNREACHED`). When `k_s >= Kb >= 128` (`INDEX_BY =
"auto"`) the blocks come from the band kernel below instead, with bands of one
offset: a key block is listed when a kept offset meets the offsets its causal
pairs span, O(Kb) a query block instead of O(k_s); the same sorted lists.

The kernel runs twice: a counting pass writes only `block_count`; the host reads
its maximum (the one synchronisation of `vertical_slash_index`), allocates
`block_index` exactly that wide, and the fill pass writes the lists. A width from
the parameters alone, `min(Kb, k_s * ((block_m - 1) // block_n + 2))`, is 12192
blocks at 1M tokens with 6096 slashes, where the nearest 6096 diagonals really
touch 97 (with per-block columns, 27.7 GB for 32 heads instead of 0.21 GB). The sync
costs the host its lead over the GPU (the next launches wait for the estimate,
top-k and counting pass already queued, a few tens of microseconds of launch
latency exposed) and makes the index uncapturable in a CUDA graph; during graph
capture, and inside `fast.capture.static_widths()`, the parameter bound is used
instead (`torch.ops.sparseprefill.vertical_slash_static`).

Columns (Alg. 4's vertical part): every query block of a head shares the head's
sorted verticals, `column_index` is a `[B, H, 1, k_v]` tensor expanded (stride 0)
over query blocks, and `column_count` is the number of verticals `<= r1 - 1` (a
`searchsorted`: the causal ones are a prefix). Verticals inside a listed block
stay in the list; the plan format allows it and the kernel skips them.

Bands (`band_index`, FlexPrefill-style lines of `line_block = g` adjacent columns and
offsets, `g` a multiple of `block_n`): every vertical band is whole key blocks, so the
plan is pure blocks. One program per (batch, head, query block) walks its causal key
blocks `[c0, c1)` in chunks: a block is kept if its vertical band is kept, or if a
kept slash band meets the offsets the block's causal pairs span,
`[max(r0 - c1 + 1, 0), r1 - 1 - c0]` (a prefix count over the kept bands answers that
in two loads). The walk is in key-block order, so the list comes out sorted; work is
O(Kb) per query block whatever the number of bands. Counting pass, width sync (the
bound Kb under capture or `static_widths()`), fill pass, as above.

Layout: kernels -> launchers (`count_blocks`, `fill_index`, `count_band_blocks`) ->
`vertical_slash_index`, `band_index`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...reference._checks import check_block_size, check_positive_int
from ...reference.plan import BlockColumnPlan, cdiv
from ..capture import static_widths_active

# Lines handled per vector step, and warps per program (H200, 128K, 32 heads: 256 x 4
# warps 3.49 ms, 128 x 4 3.81 ms, 8 warps no faster at any chunk; measured by a one-off sweep).
_CHUNK = 256
_NUM_WARPS = 4
# Start each query block's walk at its first reaching slash (a bisection of the sorted
# offsets) rather than at the largest offset: the same plan, fewer chunks for the early
# query blocks (False: the walk from the largest offset, kept to time the two).
SKIP_UNREACHED = True
# How the slash part's block lists are built: "walk" (Alg. 4, O(k_s) a query block), "blocks"
# (the band kernel's key-block walk with bands of one offset, O(Kb) a query block: a block is
# listed when a kept offset meets the offsets its causal pairs span, a prefix count over the
# offsets answering in two loads; the same lists) or "auto": "blocks" when k_s >= Kb and
# Kb >= `_BLOCKS_MIN_KB` (the bench's 6096 slashes: Kb 512 at 32K, 2048 at 128K; fifth
# session). Below that both take microseconds, and the walk, Alg. 4 as written, stays what
# the conformance properties exercise at their sizes (the band kernel is exercised there
# through flexprefill_vs; tests/test_minference.py runs both ways against the reference).
INDEX_BY: str = "auto"
_BLOCKS_MIN_KB = 128


def _by_blocks(n_slash: int, seqlen: int, block_n: int) -> bool:
    if INDEX_BY not in ("auto", "walk", "blocks"):
        raise ValueError(f"INDEX_BY must be 'auto', 'walk' or 'blocks', got {INDEX_BY!r}")
    kb = cdiv(seqlen, block_n)
    return INDEX_BY == "blocks" or (INDEX_BY == "auto" and n_slash >= kb >= _BLOCKS_MIN_KB)


def _offset_counts(slashes: torch.Tensor, seqlen: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_band_blocks_kernel`'s inputs for bands of one offset: no vertical band (int8 zeros
    `[B, H, Kb]`) and the kept offsets before each offset (int32 `[B, H, N + 1]`); padding
    entries N (and anything out of range) are counted nowhere."""
    b, h, _ = slashes.shape
    dev = slashes.device
    kept = torch.zeros(b, h, seqlen + 1, dtype=torch.int32, device=dev)
    kept.scatter_(2, slashes.long().clamp(0, seqlen), 1)
    counts = torch.zeros(b, h, seqlen + 1, dtype=torch.int32, device=dev)
    torch.cumsum(kept[..., :seqlen], dim=-1, out=counts[..., 1:])
    return torch.zeros(b, h, cdiv(seqlen, block_n), dtype=torch.int8, device=dev), counts


@triton.jit
def _vertical_slash_blocks_kernel(
    SLASH, BLOCK_COUNT, BLOCK_INDEX,
    seqlen, block_m, block_n, n_slash, num_qblocks, block_width,
    search_steps,
    RANGE_BLOCKS: tl.constexpr, CHUNK: tl.constexpr, WRITE: tl.constexpr, SKIP_UNREACHED: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    r0 = i_m * block_m
    r1 = tl.minimum(r0 + block_m, seqlen)
    p_slash = SLASH + i_bh * n_slash
    row = i_bh * num_qblocks + i_m
    p_bindex = BLOCK_INDEX + row * block_width
    o_ch = tl.arange(0, CHUNK)

    # Slash t (descending offset) is SLASH[n_slash - 1 - t] (stored ascending).
    t_begin = n_slash * 0
    if SKIP_UNREACHED:
        # Alg. 4 line 7 as a bisection: the slashes above r1 - 1 (the first ones in
        # descending order) reach no row of the block, add no block and leave
        # `last_prev` at -1, so the walk starts at the first one that reaches.
        lo = n_slash * 0
        hi = n_slash + 0
        for _ in range(0, search_steps):
            mid = (lo + hi) // 2
            live = lo < hi
            v = tl.load(p_slash + mid, mask=live, other=seqlen)
            right = live & (v <= r1 - 1)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(live & (v > r1 - 1), mid, hi)
        t_begin = n_slash - lo
    n_blocks = 0
    last_prev = -1
    for t0 in range(t_begin, n_slash, CHUNK):
        o_t = t0 + o_ch
        m_t = o_t < n_slash
        off = tl.load(p_slash + (n_slash - 1 - o_t), mask=m_t, other=seqlen)
        # Alg. 4 line 7 (bisect): slashes that start below the block reach none of its rows.
        reach = m_t & (off <= r1 - 1)
        first = tl.maximum(r0 - off, 0) // block_n
        last = tl.where(reach, (r1 - 1 - off) // block_n, -1)
        # The previous slash's last block; `last` never decreases along t.
        off_prev = tl.load(p_slash + (n_slash - o_t), mask=m_t & (o_t > t0), other=seqlen)
        last_before = tl.where(off_prev <= r1 - 1, (r1 - 1 - off_prev) // block_n, -1)
        last_before = tl.where(o_t == t0, last_prev, last_before)
        start = tl.maximum(first, last_before + 1)
        count = tl.where(reach, tl.maximum(last - start + 1, 0), 0)
        if WRITE:
            pos = n_blocks + tl.cumsum(count, 0) - count
            for u in tl.static_range(RANGE_BLOCKS):
                tl.store(p_bindex + pos + u, (start + u).to(tl.int32), mask=u < count)
        n_blocks += tl.sum(count, 0)
        last_prev = tl.maximum(last_prev, tl.max(last, 0))
    if not WRITE:
        tl.store(BLOCK_COUNT + row, n_blocks)


@triton.jit
def _band_blocks_kernel(
    VBLOCK, SCOUNT, BLOCK_COUNT, BLOCK_INDEX,
    seqlen, block_m, block_n, line_block, num_kblocks, n_bands, num_qblocks, block_width,
    CHUNK: tl.constexpr, WRITE: tl.constexpr,
):
    i_m = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    r0 = i_m * block_m
    r1 = tl.minimum(r0 + block_m, seqlen)
    p_v = VBLOCK + i_bh * num_kblocks
    p_s = SCOUNT + i_bh * (n_bands + 1)
    row = i_bh * num_qblocks + i_m
    p_bindex = BLOCK_INDEX + row * block_width
    o_ch = tl.arange(0, CHUNK)
    # Causal key blocks: first key not after the query block's last row.
    n_causal = (r1 - 1) // block_n + 1
    n_blocks = 0
    for k0 in range(0, n_causal, CHUNK):
        i_kb = k0 + o_ch
        m_kb = i_kb < n_causal
        c0 = i_kb * block_n
        c1 = tl.minimum(c0 + block_n, seqlen)
        band_lo = tl.maximum(r0 - c1 + 1, 0) // line_block
        band_hi = tl.maximum(r1 - 1 - c0, 0) // line_block
        kept_before = tl.load(p_s + band_lo, mask=m_kb, other=0)
        kept_through = tl.load(p_s + band_hi + 1, mask=m_kb, other=0)
        vertical = tl.load(p_v + i_kb, mask=m_kb, other=0)
        keep = m_kb & ((vertical != 0) | (kept_through > kept_before))
        count = keep.to(tl.int32)
        if WRITE:
            pos = n_blocks + tl.cumsum(count, 0) - count
            tl.store(p_bindex + pos, i_kb.to(tl.int32), mask=keep)
        n_blocks += tl.sum(count, 0)
    if not WRITE:
        tl.store(BLOCK_COUNT + row, n_blocks)


def index_width_bound(n_slash: int, *, seqlen: int, block_m: int, block_n: int) -> int:
    """The block width no query block can exceed, from the parameters alone."""
    return min(cdiv(seqlen, block_n), n_slash * ((block_m - 1) // block_n + 2))


def _check_lines(verticals: torch.Tensor, slashes: torch.Tensor) -> None:
    for name, t in (("verticals", verticals), ("slashes", slashes)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must have dtype int32, got {t.dtype}")
        if t.dim() != 3 or t.shape[:2] != verticals.shape[:2] or t.shape[2] < 1:
            raise ValueError(f"{name} must have shape [B, H, count >= 1], got {tuple(t.shape)}")
        if t.device != verticals.device:
            raise ValueError(f"{name} is on {t.device}, verticals on {verticals.device}")


def count_blocks(slashes: torch.Tensor, *, seqlen: int, block_m: int, block_n: int) -> torch.Tensor:
    """The counting pass: key blocks per query block, int32 `[B, H, Qb]` (no host sync).

    Args:
        slashes: int32 `[B, H, ks]`, distinct offsets in `[0, N)`, sorted ascending.
        seqlen: N. block_m, block_n: query rows and keys per block.
    """
    b, h, ks = slashes.shape
    qb = cdiv(seqlen, block_m)
    if _by_blocks(ks, seqlen, block_n):
        vblocks, counts = _offset_counts(slashes, seqlen, block_n)
        return count_band_blocks(vblocks, counts, seqlen=seqlen, block_m=block_m, block_n=block_n, line_block=1)
    block_count = torch.empty(b, h, qb, dtype=torch.int32, device=slashes.device)
    _vertical_slash_blocks_kernel[(qb, b * h)](
        slashes.contiguous(), block_count, block_count,
        seqlen, block_m, block_n, ks, qb, 0, ks.bit_length(),
        RANGE_BLOCKS=(block_m - 1) // block_n + 2, CHUNK=_CHUNK, WRITE=False, SKIP_UNREACHED=SKIP_UNREACHED,
        num_warps=_NUM_WARPS,
    )
    return block_count


def block_widths(block_count: torch.Tensor, bound: int) -> list[int]:
    """The widest block list of every head: the one host synchronisation of the index.

    Args:
        block_count: int32 `[B, H, Qb]` from `count_blocks`.
        bound: `index_width_bound`, used for every head while a CUDA graph is being
            captured (no sync is possible then) and inside `static_widths()`.

    Returns:
        H ints.
    """
    h = block_count.shape[1]
    if static_widths_active(block_count):
        return [bound] * h
    if block_count.numel() == 0:
        return [0] * h
    return [int(w) for w in block_count.amax(dim=(0, 2)).tolist()]


def fill_index(
    verticals: torch.Tensor,
    slashes: torch.Tensor,
    block_count: torch.Tensor,
    *,
    block_width: int,
    seqlen: int,
    block_m: int,
    block_n: int,
) -> BlockColumnPlan:
    """The fill pass (no host sync): the plan whose block lists `block_count` counted.

    Args:
        verticals: int32 `[B, H, kv]`, sorted ascending; slashes: int32 `[B, H, ks]`,
            sorted ascending.
        block_count: int32 `[B, H, Qb]`, `count_blocks` of these slashes.
        block_width: at least `block_count.max()`.
        seqlen, block_m, block_n: as the plan's.

    Returns:
        The plan; `column_index` is the verticals expanded over query blocks.
    """
    b, h, kv = verticals.shape
    ks = slashes.shape[2]
    qb = cdiv(seqlen, block_m)
    dev = verticals.device
    block_index = torch.empty(b, h, qb, block_width, dtype=torch.int32, device=dev)
    if block_width > 0 and _by_blocks(ks, seqlen, block_n):
        vblocks, counts = _offset_counts(slashes, seqlen, block_n)
        _band_blocks_kernel[(qb, b * h)](
            vblocks, counts, block_count, block_index,
            seqlen, block_m, block_n, 1, vblocks.shape[2], seqlen, qb, block_width,
            CHUNK=_CHUNK, WRITE=True, num_warps=_NUM_WARPS,
        )
    elif block_width > 0:
        _vertical_slash_blocks_kernel[(qb, b * h)](
            slashes.contiguous(), block_count, block_index,
            seqlen, block_m, block_n, ks, qb, block_width, ks.bit_length(),
            RANGE_BLOCKS=(block_m - 1) // block_n + 2, CHUNK=_CHUNK, WRITE=True, SKIP_UNREACHED=SKIP_UNREACHED,
            num_warps=_NUM_WARPS,
        )
    shared = verticals.contiguous()
    last_row = ((torch.arange(qb, device=dev, dtype=torch.int32) + 1) * block_m - 1).clamp_(max=seqlen - 1)
    column_count = torch.searchsorted(shared, last_row.expand(b, h, qb).contiguous(), right=True,
                                      out_int32=True)
    return BlockColumnPlan(
        seqlen=seqlen,
        block_m=block_m,
        block_n=block_n,
        block_count=block_count,
        block_index=block_index,
        column_count=column_count,
        column_index=shared.unsqueeze(2).expand(b, h, qb, kv),
    )


def vertical_slash_index(
    verticals: torch.Tensor,
    slashes: torch.Tensor,
    *,
    seqlen: int,
    block_m: int = 64,
    block_n: int = 64,
) -> BlockColumnPlan:
    """Alg. 4 on the GPU: kept lines -> plan (see `reference.vertical_slash.vertical_slash_index`).

    Counting pass, one host synchronisation for the width (see the module doc),
    fill pass.

    Args:
        verticals: int32 `[B, H, kv]`, distinct key columns in `[0, N)`, sorted ascending.
        slashes: int32 `[B, H, ks]`, distinct offsets `row - col` in `[0, N)`, sorted
            ascending.
        seqlen: N. block_m, block_n: query rows and keys per block.

    Returns:
        The plan: block lists as wide as the fullest query block needs, the verticals
        shared by every query block (`equal` to the reference's disjoint plan).

    Raises:
        TypeError: index tensors not int32.
        ValueError: shapes that do not match, or tensors on different devices. Values
            are not checked (that would need more host synchronisation): unsorted or
            out-of-range lines give an invalid plan.
    """
    n = check_positive_int("seqlen", seqlen)
    bm = check_block_size("block_m", block_m)
    bn = check_block_size("block_n", block_n)
    _check_lines(verticals, slashes)
    block_count = count_blocks(slashes, seqlen=n, block_m=bm, block_n=bn)
    bound = index_width_bound(slashes.shape[2], seqlen=n, block_m=bm, block_n=bn)
    width = max(block_widths(block_count, bound), default=0)
    return fill_index(verticals, slashes, block_count, block_width=width, seqlen=n,
                      block_m=bm, block_n=bn)


def _check_bands(vertical_blocks: torch.Tensor, slash_bands: torch.Tensor, *, seqlen: int, block_n: int,
                 line_block: int) -> None:
    for name, t, width in (("vertical_blocks", vertical_blocks, cdiv(seqlen, block_n)),
                           ("slash_bands", slash_bands, cdiv(seqlen, line_block))):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.bool:
            raise TypeError(f"{name} must have dtype bool, got {t.dtype}")
        if t.dim() != 3 or t.shape[:2] != vertical_blocks.shape[:2] or t.shape[2] != width:
            raise ValueError(f"{name} must have shape [B, H, {width}], got {tuple(t.shape)}")
        if t.device != vertical_blocks.device:
            raise ValueError(f"{name} is on {t.device}, vertical_blocks on {vertical_blocks.device}")
    if line_block % block_n:
        raise ValueError(f"line_block must be a multiple of block_n={block_n}, got {line_block}")


def count_band_blocks(vertical_blocks: torch.Tensor, slash_counts: torch.Tensor, *, seqlen: int,
                      block_m: int, block_n: int, line_block: int) -> torch.Tensor:
    """The counting pass of `band_index`: int32 `[B, H, Qb]` (no host sync).

    Args:
        vertical_blocks: int8 `[B, H, Kb]`, 1 where the key block's vertical band is kept.
        slash_counts: int32 `[B, H, Nb + 1]`, kept slash bands before each band (a prefix count).
        seqlen, block_m, block_n, line_block: as `band_index`'s.
    """
    b, h, kb = vertical_blocks.shape
    qb = cdiv(seqlen, block_m)
    block_count = torch.empty(b, h, qb, dtype=torch.int32, device=vertical_blocks.device)
    _band_blocks_kernel[(qb, b * h)](
        vertical_blocks, slash_counts, block_count, block_count,
        seqlen, block_m, block_n, line_block, kb, slash_counts.shape[2] - 1, qb, 0,
        CHUNK=_CHUNK, WRITE=False, num_warps=_NUM_WARPS,
    )
    return block_count


def band_index(
    vertical_blocks: torch.Tensor,
    slash_bands: torch.Tensor,
    *,
    seqlen: int,
    block_m: int,
    block_n: int,
    line_block: int,
) -> BlockColumnPlan:
    """Kept line bands -> a pure-block plan (see the module doc and
    `reference.flexprefill_vs.lines_index` with `line_block` a multiple of `block_n`).

    Args:
        vertical_blocks: bool `[B, H, Kb]`, key blocks whose vertical band is kept.
        slash_bands: bool `[B, H, ceil(N / line_block)]`, kept bands of `line_block`
            diagonal offsets (band `j` holds offsets `[j g, j g + g)`).
        seqlen: N. block_m, block_n: query rows and keys per block.
        line_block: the band width, a multiple of `block_n`.

    Returns:
        The plan: sorted block lists as wide as the fullest query block needs (one host
        synchronisation; Kb under capture or `static_widths()`), no columns.

    Raises:
        TypeError, ValueError: wrong dtypes, shapes or devices, or `line_block` not a
            multiple of `block_n`.
    """
    n = check_positive_int("seqlen", seqlen)
    bm = check_block_size("block_m", block_m)
    bn = check_block_size("block_n", block_n)
    g = check_positive_int("line_block", line_block)
    _check_bands(vertical_blocks, slash_bands, seqlen=n, block_n=bn, line_block=g)
    b, h, kb = vertical_blocks.shape
    qb = cdiv(n, bm)
    dev = vertical_blocks.device
    vblocks = vertical_blocks.to(torch.int8).contiguous()
    counts = torch.zeros(b, h, slash_bands.shape[2] + 1, dtype=torch.int32, device=dev)
    counts[..., 1:] = torch.cumsum(slash_bands, dim=-1)
    block_count = count_band_blocks(vblocks, counts, seqlen=n, block_m=bm, block_n=bn, line_block=g)
    width = max(block_widths(block_count, kb), default=0)
    block_index = torch.empty(b, h, qb, width, dtype=torch.int32, device=dev)
    if width > 0:
        _band_blocks_kernel[(qb, b * h)](
            vblocks, counts, block_count, block_index,
            n, bm, bn, g, kb, slash_bands.shape[2], qb, width,
            CHUNK=_CHUNK, WRITE=True, num_warps=_NUM_WARPS,
        )
    return BlockColumnPlan(
        seqlen=n,
        block_m=bm,
        block_n=bn,
        block_count=block_count,
        block_index=block_index,
        column_count=torch.zeros(b, h, qb, dtype=torch.int32, device=dev),
        column_index=torch.zeros(b, h, qb, 0, dtype=torch.int32, device=dev),
    )
