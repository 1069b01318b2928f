"""DeltaXAttention on the existing kernels (see `reference.delta_xattention` for the spec).

Tiles: XAttention's Triton tile weights and torch selection (`fast.xattention`), then
the exact/packed split by one float64 sort per head. Packing: Delta-KV's keep-mask
and packing kernels (`fast/kernels/delta_pack.py`) on the keys viewed as
`[B * Hkv, T - 1, block, D]` (a view, no copy, for contiguous K/V): every tile one
chunk, one packed segment, so the masks and buffers are bit-identical to the
reference's. Attention: two launches of the one block/column kernel chained through
an `AttentionState`: the packed tiles through `ragged_block_column_attention` (one
region of tile segments per (batch row, KV head), the log count as a per-key bias),
then the exact tiles over the original keys, which finishes the softmax.

The fp32 tile weights can decide a (near-)tie differently from the reference's
float64 ones, in the selection (as `fast.xattention`) and in the top-`exact_top`
split; `conformance.delta_xattention` shows every such difference is a tie.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from ..reference._checks import HALF_DTYPES, PerHead, check_fraction, check_qkv, resolve_scale
from ..reference.attention import AttentionState
from ..reference.delta_kv import PackedKV, check_flags
from ..reference.delta_xattention import (
    EXACT,
    PACKED,
    SKIPPED,
    TilePackedKV,
    check_exact_top,
    check_key_dtype,
    check_modes,
    check_packing,
    check_selection,
    check_tile_pack_inputs,
    check_unselected,
    delta_xattention_density,
    delta_xattention_kv_reduction,
    dense_query_heads,
    empty_packing,
    exact_tiles as reference_exact_tiles,
    skip_tiles as reference_skip_tiles,
    tile_modes,
    tile_view,
)
from ..reference.plan import BlockColumnPlan, cdiv, mask_to_list
from ..reference.xattention import check_xattention_params
from .attention import dense_heads_into
from .dense import empty_columns
from .dense_fallback import active_rates
from .kernels import block_column_attention, check_forward_only, check_kernel_block_sizes, check_kernel_device
from .kernels.block_column import ragged_block_column_attention
from .kernels.delta_pack import keep_mask, pack
from .kernels.xattention_score import _tile_weights, check_fast_block, check_xattention_inputs
from .xattention import _select_tiles, tiles_to_plan

__all__ = [
    "delta_tile_pack",
    "delta_xattention",
    "delta_xattention_attention",
    "delta_xattention_density",
    "delta_xattention_kv_reduction",
    "delta_xattention_plans",
    "delta_xattention_tiles",
    "exact_tiles",
    "skip_tiles",
]

# Tile weights ranked at once (float64 sort keys and int64 indices: ~16 bytes each).
_RANK_ELEMENTS = 1 << 24
# Bools of the packed plan's [B, heads, T, key blocks] mask built at once.
_MASK_ELEMENTS = 1 << 25
# The packing kernel's grid has one program per tile segment in its second dimension.
_MAX_GRID_Y = 65535


def _key_dtype(weights: torch.Tensor) -> torch.dtype:
    """float32 sort keys for float32 (or narrower) weights: the reference's float64 order in
    half the radix passes (`reference.delta_xattention.rank_off_diagonal`; H200, 128K, 32
    heads: the ranking was 6.3 of the plan's 34.9 ms)."""
    narrow = weights.dtype in (torch.float32, torch.float16, torch.bfloat16)
    return torch.float32 if narrow else torch.float64


def _by_heads(weights: torch.Tensor, selected: torch.Tensor, fraction: float,
              fn: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]) -> torch.Tensor:
    """Apply the reference's per-(batch row, head) rule to a few heads at a time."""
    b, h, t, _ = weights.shape
    flat_w = weights.reshape(1, b * h, t, t)
    flat_s = selected.reshape(1, b * h, t, t)
    rows = max(1, _RANK_ELEMENTS // max(1, t * t))
    out = torch.empty(1, b * h, t, t, dtype=torch.bool, device=weights.device)
    for r0 in range(0, b * h, rows):
        out[:, r0:r0 + rows] = fn(flat_w[:, r0:r0 + rows], flat_s[:, r0:r0 + rows], fraction)
    return out.view(b, h, t, t)


def exact_tiles(weights: torch.Tensor, selected: torch.Tensor, exact_top: float, *,
                key_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The exact tiles (see `reference.delta_xattention.exact_tiles`), a few heads at a time.

    Args:
        weights: float `[B, H, T, T]`, XAttention tile weights.
        selected: bool `[B, H, T, T]`, the selected tiles (`select_tiles`).
        exact_top: fraction in `[0, 1]`.
        key_dtype: the ranking's sort keys, as the reference's; `delta_xattention_tiles`
            passes float32 for float32 weights (the same order, half the radix passes).

    Returns:
        bool `[B, H, T, T]`.

    Raises:
        TypeError, ValueError: bad arguments.
    """
    weights, selected = check_selection(weights, selected)
    return _by_heads(weights, selected, check_exact_top(exact_top),
                     functools.partial(reference_exact_tiles, key_dtype=check_key_dtype(key_dtype)))


def skip_tiles(weights: torch.Tensor, selected: torch.Tensor, skip: float, *,
               key_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """4.2.2's tile-skip ablation (see `reference.delta_xattention.skip_tiles`).

    Args:
        weights: float `[B, H, T, T]`, XAttention tile weights.
        selected: bool `[B, H, T, T]` (`select_tiles`).
        skip: fraction in `[0, 1]`.
        key_dtype: the ranking's sort keys, as the reference's.

    Returns:
        bool `[B, H, T, T]`, a subset of `selected` keeping every diagonal and first tile.

    Raises:
        TypeError, ValueError: bad arguments.
    """
    weights, selected = check_selection(weights, selected)
    return _by_heads(weights, selected, check_fraction("skip", skip),
                     functools.partial(reference_skip_tiles, key_dtype=check_key_dtype(key_dtype)))


def delta_xattention_tiles(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    stride: int = 8,
    threshold: PerHead = 0.9,
    exact_top: float = 0.1,
    block: int = 128,
    scoring: str = "antidiagonal",
    unselected: str = "skip",
    scale: float | None = None,
) -> torch.Tensor:
    """The mode of every tile (see `reference.delta_xattention_tiles`).

    Returns:
        int8 `[B, Hq, T, T]` of `EXACT`, `PACKED`, `SKIPPED`.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    stride, threshold, block, scoring = check_xattention_inputs(q, k, stride=stride, threshold=threshold,
                                                                block=block, scoring=scoring)
    top = check_exact_top(exact_top)
    unselected = check_unselected(unselected)
    sm_scale = resolve_scale(scale, q.shape[-1])
    weights = _tile_weights(q, k, stride=stride, block=block, scoring=scoring, sm_scale=sm_scale)
    selected = _select_tiles(weights, threshold)
    return tile_modes(selected, exact_tiles(weights, selected, top, key_dtype=_key_dtype(weights)), unselected)


def _merge(parts: list[PackedKV]) -> PackedKV:
    """Concatenate packings of consecutive groups of segments into one."""
    if len(parts) == 1:
        return parts[0]
    offsets = [parts[0].offsets[:1]]
    base = 0
    for p in parts:
        offsets.append(p.offsets[1:] + base)
        base += int(p.offsets[-1])
    return PackedKV(
        k=torch.cat([p.k for p in parts]), v=torch.cat([p.v for p in parts]),
        counts=torch.cat([p.counts for p in parts]), timestamps=torch.cat([p.timestamps for p in parts]),
        offsets=torch.cat(offsets), lengths=torch.cat([p.lengths for p in parts]),
        seqlen=parts[0].seqlen, block=parts[0].block,
    )


def delta_tile_pack(
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    delta_threshold: float,
    metric: str = "euclidean",
    block: int = 128,
    packed_block: int = 32,
) -> TilePackedKV:
    """Per-tile Stages 1-2 (see `reference.delta_tile_pack`); the same `TilePackedKV`, bit for bit.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    k, v, thr, metric, bs, pb = check_tile_pack_inputs(k, v, delta_threshold, metric, block, packed_block)
    if k.dtype not in HALF_DTYPES:
        raise TypeError(f"k must have dtype float16 or bfloat16 for the fast kernels, got {k.dtype}")
    check_kernel_block_sizes(bs, pb, names=("block", "packed_block"))
    check_kernel_device(k)
    check_tile_count(k.shape[2], bs)
    keep, counts = _tile_keep(k, threshold=thr, metric=metric, block=bs)
    return _tile_pack(k, v, keep, counts, block=bs, packed_block=pb)


def check_tile_count(seqlen: int, block: int) -> None:
    """Raise ValueError when the packing kernel's grid cannot hold `ceil(N / block) - 1` tiles."""
    tiles = cdiv(seqlen, block) - 1
    if tiles > _MAX_GRID_Y:
        raise ValueError(f"N / block must be at most {_MAX_GRID_Y + 1} tiles for the packing kernel, got "
                         f"{tiles + 1}; use a larger block")


def _tile_rows(b: int, h: int, tiles: int) -> range:
    """The first (batch row, KV head) of each launch of the packing kernels (its grid's
    second dimension holds at most `_MAX_GRID_Y` tile segments)."""
    return range(0, b * h, max(1, _MAX_GRID_Y // max(1, tiles)))


def _tile_keep(k: torch.Tensor, *, threshold: float, metric: str,
               block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 per tile on checked inputs (see `reference.delta_xattention.tile_keep_mask`):
    (keep bool `[B * Hkv, T - 1, block]`, anchors per tile int32 `[B * Hkv * (T - 1), 1]`)."""
    b, h, n, _ = k.shape
    tiles = cdiv(n, block) - 1
    if tiles == 0:
        return (torch.zeros(b * h, 0, block, dtype=torch.bool, device=k.device),
                torch.zeros(0, 1, dtype=torch.int32, device=k.device))
    k4 = tile_view(k, block, tiles)
    step = _tile_rows(b, h, tiles).step
    parts = [keep_mask(k4[r0:r0 + step], threshold=threshold, cosine=metric == "cosine", chunk=block)
             for r0 in _tile_rows(b, h, tiles)]
    if len(parts) == 1:
        return parts[0]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _tile_pack(k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, counts: torch.Tensor, *, block: int,
               packed_block: int) -> TilePackedKV:
    """Stage 2 per tile on checked inputs, from `_tile_keep`'s mask and counts."""
    b, h, n, _ = k.shape
    tiles = cdiv(n, block) - 1
    if tiles == 0:
        return empty_packing(k, block, packed_block)
    k4, v4 = tile_view(k, block, tiles), tile_view(v, block, tiles)
    step = _tile_rows(b, h, tiles).step
    parts = [pack(k4[r0:r0 + step], v4[r0:r0 + step], keep[r0:r0 + step], counts[r0 * tiles:(r0 + step) * tiles],
                  chunk=block, block=packed_block) for r0 in _tile_rows(b, h, tiles)]
    return TilePackedKV(packed=_merge(parts), batch=b, kv_heads=h, seqlen=n, block=block).mark_valid()


def _packed_plan(modes: torch.Tensor, packing: TilePackedKV, seqlen: int) -> BlockColumnPlan:
    """The packed tiles' key blocks per query tile (see `reference.delta_xattention_plans`)."""
    b, hq, t, _ = modes.shape
    dev = modes.device
    pb, bs = packing.packed_block, packing.block
    count = torch.zeros(b, hq, t, dtype=torch.int32, device=dev)
    col_count, col_index = empty_columns(b, hq, t, dev)
    if packing.tiles == 0:
        return BlockColumnPlan(seqlen=seqlen, block_m=bs, block_n=pb, block_count=count,
                               block_index=torch.zeros(b, hq, t, 0, dtype=torch.int32, device=dev),
                               column_count=col_count, column_index=col_index).mark_valid()
    first, size = packing.tile_blocks()
    ends = (first + size).contiguous()  # [B, Hkv, T - 1], non-decreasing along the tiles
    # Key blocks of the largest region (0 for an edited packing whose ends run backwards).
    width = max(0, int(ends[..., -1].max()))
    blocks = torch.arange(width, device=dev)
    # The tile of every key block of a region, and whether the region has that block.
    owner = torch.searchsorted(ends, blocks.expand(*ends.shape[:2], width).contiguous(), right=True)
    inside = blocks < ends[..., -1:]
    owner = owner.clamp(max=packing.tiles - 1)
    group = hq // packing.kv_heads
    heads = max(1, _MASK_ELEMENTS // max(1, b * t * width))
    counts, indices = [], []
    for h0 in range(0, hq, heads):
        h1 = min(hq, h0 + heads)
        kv = torch.arange(h0, h1, device=dev) // group
        packed = modes[:, h0:h1, :, : packing.tiles] == PACKED  # [B, h, T, T - 1]
        own = owner[:, kv].unsqueeze(2).expand(b, h1 - h0, t, width)
        mask = torch.gather(packed, -1, own) & inside[:, kv].unsqueeze(2)
        c, idx = mask_to_list(mask)
        counts.append(c)
        indices.append(idx)
    list_width = max(int(i.shape[-1]) for i in indices)
    index = torch.zeros(b, hq, t, list_width, dtype=torch.int32, device=dev)
    h0 = 0
    for c, idx in zip(counts, indices):
        index[:, h0:h0 + c.shape[1], :, : idx.shape[-1]] = idx
        h0 += c.shape[1]
    return BlockColumnPlan(seqlen=seqlen, block_m=bs, block_n=pb, block_count=torch.cat(counts, dim=1),
                           block_index=index, column_count=col_count, column_index=col_index).mark_valid()


def delta_xattention_plans(
    q: torch.Tensor,
    modes: torch.Tensor,
    packing: TilePackedKV,
) -> tuple[BlockColumnPlan, BlockColumnPlan]:
    """The two launches as plans (see `reference.delta_xattention_plans`), built with tensor ops.

    Raises:
        TypeError, ValueError: bad inputs.
    """
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError(f"q must be a [B, Hq, N, D] tensor, got {getattr(q, 'shape', type(q).__name__)}")
    if not isinstance(packing, TilePackedKV):
        raise TypeError(f"packing must be a TilePackedKV, got {type(packing).__name__}")
    b, hq, n, _ = q.shape
    packing.ensure_valid()
    if (packing.batch, packing.seqlen) != (b, n) or hq % packing.kv_heads != 0:
        raise ValueError(f"packing (B={packing.batch}, Hkv={packing.kv_heads}, N={packing.seqlen}) does not "
                         f"fit q [B={b}, Hq={hq}, N={n}]")
    check_kernel_block_sizes(packing.block, packing.packed_block, names=("packing.block", "packing.packed_block"))
    modes = check_modes(modes, tuple(q.shape), packing)
    exact = tiles_to_plan(modes == EXACT, seqlen=n, block=packing.block)
    return exact, _packed_plan(modes, packing, n)


def delta_xattention_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    modes: torch.Tensor,
    packing: TilePackedKV,
    *,
    count_weighted: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Packed tiles, then exact tiles: two kernel launches sharing one softmax state.

    Raises:
        TypeError, ValueError: bad inputs, before any launch.
    """
    shape = check_qkv(q, k, v, dtypes=HALF_DTYPES)
    check_kernel_device(q)
    check_forward_only(q, k, v)
    scale = resolve_scale(scale, shape.head_dim)
    check_packing(packing, k)
    modes = check_modes(modes, tuple(q.shape), packing)
    check_flags(count_weighted=count_weighted)
    check_kernel_block_sizes(packing.block, packing.packed_block, names=("block", "packed_block"))
    return _two_launches(q, k, v, modes, packing, count_weighted=count_weighted, scale=scale)


def _two_launches(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, modes: torch.Tensor, packing: TilePackedKV,
                  *, count_weighted: bool, scale: float) -> torch.Tensor:
    """`delta_xattention_attention` on checked inputs."""
    exact_plan, packed_plan = delta_xattention_plans(q, modes, packing)
    state = AttentionState.like(q)
    if bool((packed_plan.block_count > 0).any()):
        counts = packing.packed.counts.to(torch.float32)
        # Eq. 4 as a bias: c exp(s) = exp(s + log c); padding (count 0) weighs nothing.
        bias = torch.log(counts) if count_weighted else torch.where(counts > 0, 0.0, -math.inf)
        ragged_block_column_attention(q, packing.packed.k, packing.packed.v, packing.region_offsets(),
                                      packed_plan, key_bias=bias, scale=scale, state=state)
    out, _ = block_column_attention(q, k, v, exact_plan, scale=scale, state=state, validate_plan=False)
    return out


def delta_xattention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    stride: int = 8,
    threshold: PerHead = 0.9,
    exact_top: float = 0.1,
    delta_threshold: float,
    metric: str = "euclidean",
    block: int = 128,
    packed_block: int = 32,
    scoring: str = "antidiagonal",
    unselected: str = "skip",
    count_weighted: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """DeltaXAttention end to end (see `reference.delta_xattention`).

    The break-even rule (on by default on CUDA; `reference.delta_xattention.dense_query_heads`)
    decides on the tiles and the keep mask, before packing: a query head whose two
    launches would not beat our kernel's dense lists nothing in either launch and runs
    full causal attention through our kernel; where one SDPA call over the layer beats the
    heads' best options summed, every head runs in it (nothing packed); a KV head whose
    query heads all run dense is not packed (one anchor a tile). Host
    reads: the packed buffer's size, the packed plan's width, whether any tile is packed;
    with the rule on, one more (the `[Hq]` flags).

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs or parameters, before any launch.
    """
    shape = check_qkv(q, k, v, dtypes=HALF_DTYPES)
    check_kernel_device(q)
    check_forward_only(q, k, v)
    check_xattention_params(stride=stride, threshold=threshold, block=block, scoring=scoring)
    check_exact_top(exact_top)
    check_unselected(unselected)
    _, _, thr, metric, bs, pb = check_tile_pack_inputs(k, v, delta_threshold, metric, block, packed_block)
    check_fast_block(bs)
    check_kernel_block_sizes(bs, pb, names=("block", "packed_block"))
    check_flags(count_weighted=count_weighted)
    scale = resolve_scale(scale, shape.head_dim)
    check_tile_count(shape.seqlen, bs)
    modes = delta_xattention_tiles(q, k, stride=stride, threshold=threshold, exact_top=exact_top, block=block,
                                   scoring=scoring, unselected=unselected, scale=scale)
    keep, counts = _tile_keep(k, threshold=thr, metric=metric, block=bs)
    tiles = cdiv(shape.seqlen, bs) - 1
    dense = dense_query_heads(q, modes, counts.view(shape.batch, shape.kv_heads, tiles), block=bs,
                              packed_block=pb, rates=active_rates(q))
    if len(dense) == shape.q_heads:
        return dense_heads_into(q, k, v, dense, None, scale=scale)
    if dense:
        modes, keep, counts = _without_heads(modes, keep, counts, dense, batch=shape.batch, kv_heads=shape.kv_heads)
    packing = _tile_pack(k, v, keep, counts, block=bs, packed_block=pb)
    out = _two_launches(q, k, v, modes, packing, count_weighted=count_weighted, scale=scale)
    return dense_heads_into(q, k, v, dense, out, scale=scale)


def _without_heads(modes: torch.Tensor, keep: torch.Tensor, counts: torch.Tensor, dense: tuple[int, ...], *,
                   batch: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tiles and the per-tile keep mask of a run whose query heads `dense` run dense:
    those heads' tiles `SKIPPED` (both launches list nothing for them), and the tiles of
    a KV head whose every query head runs dense keep their first key only (one anchor
    each: no packing to speak of). New tensors; the inputs are not modified."""
    hq = int(modes.shape[1])
    g = hq // kv_heads
    modes = modes.clone()
    modes[:, list(dense)] = SKIPPED
    gone = [j for j in range(kv_heads) if all(h in set(dense) for h in range(j * g, (j + 1) * g))]
    if not gone or keep.shape[1] == 0:
        return modes, keep, counts
    rows = torch.tensor([b * kv_heads + j for b in range(batch) for j in gone], device=keep.device)
    keep = keep.clone()
    keep[rows, :, 1:] = False
    counts = counts.clone().view(batch * kv_heads, -1)
    counts[rows] = 1
    return modes, keep, counts.view(-1, 1)
