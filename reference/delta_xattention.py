"""DeltaXAttention (DeltaAttention thesis, section 4.2), as the specification.

XAttention decides which tiles of `block x block` are computed; DeltaXAttention then
reads most of those tiles through Delta-KV anchors instead of all their keys.

Tiles (`delta_xattention_tiles`), per batch row and query head, every causal tile
`(i, j)` (query tile `i`, key tile `j <= i`) gets one of three modes:

* `EXACT`: the diagonal tile `j = i` (4.2.1: never compressed), and the top `exact_top`
  fraction of the *selected* off-diagonal tiles by XAttention tile weight (4.2.1: "the
  top 10% by XAttention tile importance score"). The fraction is taken per (batch row,
  query head) over all its selected off-diagonal tiles: `round(exact_top * n)` of its
  `n` such tiles (halves up), the heaviest first, NaN weights last, ties to the lower
  `(i, j)` in row-major order.
* `PACKED`: the other selected tiles: attended through the tile's own anchors, with the
  count-weighted softmax of 4.1.3 (`log count` added to each anchor's logit).
* `SKIPPED`: the tiles XAttention does not select (as in XAttention). With
  `unselected="packed"` (not in the thesis: the lead's variant, an ablation) they are
  `PACKED` too, so no causal tile is dropped.

Selection is XAttention's own (`xattention_tile_weights` + `select_tiles`, see
`reference.xattention`): first and diagonal tiles forced, greedy to `threshold`.

Packing (`delta_tile_pack`): "the pre-processing and packing stages are applied per
block rather than over the full key matrix" (4.2), so every key tile is one Delta-KV
chunk (`delta_keep_mask` with `chunk = block`: the tile's first key is an anchor, runs
end at the tile's end) and one packed segment (`delta_pack` on the keys viewed as
`[B * Hkv, T - 1, block, D]`: segment `(b * Hkv + g) * (T - 1) + j` is tile `j` of
batch row `b`, KV head `g`), padded to a multiple of `packed_block` anchors. Only the
first `T - 1` tiles are packed: a packed tile is strictly below the diagonal, and the
last tile (the only one that may be short) is never below any query tile's diagonal.

Attention (`delta_xattention_attention`): each query row attends, in one softmax, to
the original keys of its `EXACT` tiles (causal inside the diagonal tile) and to the
anchors of its `PACKED` tiles with logits `s + log count` (`+ 0` without
`count_weighted`). Every key of a packed tile precedes every row of the query tile,
so no causal mask applies to anchors.

KV reduction (4.2.1, `delta_xattention_kv_reduction`): the keys loaded by the computed
tiles (a packed tile loads its anchors) relative to loading every computed tile in
full, i.e. relative to XAttention with the same selection: the thesis's `f (1 - p)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ._checks import (
    PerHead,
    check_block_size,
    check_fraction,
    check_positive_int,
    check_qk,
    check_qkv,
    check_tensor,
    check_values,
    per_head,
    resolve_scale,
)
from .delta_kv import (
    PackedKV,
    check_flags,
    check_keys,
    check_metric,
    check_threshold,
    delta_keep_mask,
    delta_pack,
)
from .dense_fallback import RateTable, active_rates, attend_dense_heads, flagged, packed_head_costs
from .plan import BlockColumnPlan, cdiv, rank_nan_last
from .xattention import check_threshold as check_threshold_of_tiles
from .xattention import check_weights, check_xattention_params, select_tiles, xattention_tile_weights

SKIPPED, PACKED, EXACT = 0, 1, 2
UNSELECTED = ("skip", "packed")


@dataclass(frozen=True, eq=False)
class TilePackedKV:
    """Delta-KV anchors of every key tile (4.2: Stage 1-2 per block), ragged and flat.

    `packed` is a `PackedKV` whose segments are tiles: its "batch" is `B * Hkv`, its
    "KV heads" are the `T - 1` packed tiles and its `seqlen` is `block`; segment
    `(b * Hkv + g) * (T - 1) + j` holds tile `j` of batch row `b`, KV head `g`
    (anchors first, zero padding to a multiple of `packed.block`). The segments of one
    `(b, g)` are contiguous: a *region* of the flat buffer.

    Attributes:
        packed: the tiles' `PackedKV` (counts are run lengths inside the tile).
        batch, kv_heads: B, Hkv.
        seqlen: N, the original number of keys.
        block: tokens per tile.
    """

    packed: PackedKV
    batch: int
    kv_heads: int
    seqlen: int
    block: int
    # Set by `validate` or the packers (`PackedKV`'s rule; `replace` makes an unchecked copy).
    _checked: bool = field(default=False, init=False, repr=False, compare=False)

    def validate(self) -> TilePackedKV:
        """Check the packing's invariants; return self.

        `batch`, `kv_heads`, `seqlen` ints `>= 1`, `block` a block size; `packed` a
        valid `PackedKV` (`PackedKV.validate`) of `B * Hkv` rows of `T - 1` tiles,
        `seqlen = block`, and a `packed.block` dividing `block`. Checked once per
        object (`ensure_valid`); the packers build valid packings.

        Raises:
            TypeError, ValueError: the first broken invariant, naming the field.
        """
        for name in ("batch", "kv_heads", "seqlen"):
            check_positive_int(f"packing.{name}", getattr(self, name))
        bs = check_block_size("packing.block", self.block)
        if not isinstance(self.packed, PackedKV):
            raise TypeError(f"packing.packed must be a PackedKV, got {type(self.packed).__name__}")
        try:
            self.packed.ensure_valid()
        except (TypeError, ValueError) as err:
            # PackedKV names its fields `packed.<field>`; here they are the packing's.
            raise type(err)(f"packing.{err}") from None
        if (self.packed.batch, self.packed.kv_heads) != (self.batch * self.kv_heads, self.tiles) or \
                (self.tiles > 0 and self.packed.seqlen != bs):
            raise ValueError(f"packing.packed must hold B * Hkv = {self.batch * self.kv_heads} rows of "
                             f"T - 1 = {self.tiles} tiles of {bs} keys, got {tuple(self.packed.lengths.shape)} "
                             f"segments of {self.packed.seqlen} keys")
        if bs % self.packed.block:
            raise ValueError(f"packing.packed.block must divide packing.block ({bs}), got {self.packed.block}")
        object.__setattr__(self, "_checked", True)
        return self

    def ensure_valid(self) -> TilePackedKV:
        """`validate` unless the packing already passed it (or was built valid); return self."""
        if not (self._checked and getattr(self.packed, "_checked", False)):
            self.validate()
        return self

    def mark_valid(self) -> TilePackedKV:
        """Record that the packing is valid by construction (the packers only); return self."""
        self.packed.mark_valid()
        object.__setattr__(self, "_checked", True)
        return self

    @property
    def tiles(self) -> int:
        """Packed tiles per (batch row, KV head): `ceil(N / block) - 1`."""
        return cdiv(self.seqlen, self.block) - 1

    @property
    def packed_block(self) -> int:
        """Padding granule of each tile's anchors (the kernel's packed key block)."""
        return self.packed.block

    def anchors(self) -> torch.Tensor:
        """Anchors of every packed tile, int64 `[B, Hkv, T - 1]`."""
        return self.packed.lengths.to(torch.int64).view(self.batch, self.kv_heads, self.tiles)

    def keep_ratio(self) -> torch.Tensor:
        """Anchors over keys of the packed tiles, float64 `[B, Hkv]` (1 if nothing is packed)."""
        if self.tiles == 0:
            return torch.ones(self.batch, self.kv_heads, dtype=torch.float64, device=self.packed.k.device)
        return self.anchors().sum(-1).to(torch.float64) / (self.tiles * self.block)

    def region_offsets(self) -> torch.Tensor:
        """Start row of every (batch row, KV head)'s region, int64 `[B * Hkv]`."""
        first = torch.arange(self.batch * self.kv_heads, device=self.packed.offsets.device) * self.tiles
        return self.packed.offsets[first].contiguous()

    def tile_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(first, count), int64 `[B, Hkv, T - 1]`: each tile's packed key blocks, counted
        in blocks of `packed_block` rows from its region's start."""
        bs = self.packed.block
        starts = self.packed.offsets[:-1].view(self.batch * self.kv_heads, self.tiles)
        sizes = (self.packed.offsets[1:] - self.packed.offsets[:-1]).view(self.batch * self.kv_heads, self.tiles)
        first = (starts - self.region_offsets()[:, None]) // bs
        shape = (self.batch, self.kv_heads, self.tiles)
        return first.view(shape), (sizes // bs).view(shape)

    def region(self, batch: int, head: int) -> slice:
        """Rows of `packed` holding the tiles of one (batch row, KV head)."""
        s = (batch * self.kv_heads + head) * self.tiles
        return slice(int(self.packed.offsets[s]), int(self.packed.offsets[s + self.tiles]))


def check_exact_top(exact_top: object) -> float:
    """`exact_top` as a float in `[0, 1]`, else TypeError/ValueError."""
    return check_fraction("exact_top", exact_top)


def check_unselected(unselected: object) -> str:
    """`unselected` if it is one of `UNSELECTED`, else TypeError/ValueError."""
    if not isinstance(unselected, str):
        raise TypeError(f"unselected must be a str, got {type(unselected).__name__}")
    if unselected not in UNSELECTED:
        raise ValueError(f"unselected must be one of {UNSELECTED}, got {unselected!r}")
    return unselected


def check_delta_threshold(delta_threshold: object, metric: str) -> float:
    """Delta-KV's threshold check (`reference.delta_kv.check_threshold`) under this name."""
    return check_threshold(delta_threshold, metric, name="delta_threshold")


def check_pack_blocks(block: object, packed_block: object) -> tuple[int, int]:
    """(block, packed_block): block sizes, `packed_block` dividing `block` (past it: `block`)."""
    bs = check_block_size("block", block)
    pb = min(check_block_size("packed_block", packed_block), bs)
    if bs % pb != 0:
        raise ValueError(f"packed_block must divide block ({bs}), got {pb}")
    return bs, pb


def check_modes(modes: object, q_shape: tuple[int, ...], packing: TilePackedKV) -> torch.Tensor:
    """`modes`: int8 `[B, Hq, T, T]` of `delta_xattention_tiles` for `q` and `packing`."""
    modes = check_tensor("modes", modes, rank=4)
    b, hq, n = q_shape[0], q_shape[1], q_shape[2]
    t = cdiv(n, packing.block)
    if modes.dtype != torch.int8 or tuple(modes.shape) != (b, hq, t, t):
        raise ValueError(f"modes must be an int8 [B, Hq, T, T] = {[b, hq, t, t]} tensor, got {modes.dtype} "
                         f"{tuple(modes.shape)}")
    check_mode_values(modes)
    return modes


def check_mode_values(modes: torch.Tensor) -> None:
    """Raise ValueError unless every entry of `modes` `[B, H, T, T]` is a mode a tile may
    have: `SKIPPED`, `EXACT` on causal tiles (`j <= i`), `PACKED` strictly below the
    diagonal (`j < i`: only those tiles are packed, and their keys precede every row)."""
    if modes.device.type == "meta":
        raise ValueError("modes is a meta tensor: the plans are built from its values")
    t = modes.shape[-1]
    idx = torch.arange(t, device=modes.device)
    below = idx[None, :] < idx[:, None]
    bad = ((modes != SKIPPED) & (modes != PACKED) & (modes != EXACT)) | \
        ((modes == EXACT) & ~(below | (idx[None, :] == idx[:, None]))) | ((modes == PACKED) & ~below)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise ValueError(f"modes must hold SKIPPED ({SKIPPED}), EXACT ({EXACT}) on causal tiles j <= i and "
                         f"PACKED ({PACKED}) on tiles j < i only; first bad entry {int(modes[where])} at {where}")


def check_density_inputs(modes: object, packing: object) -> tuple[torch.Tensor, TilePackedKV]:
    """`modes` `[B, Hq, T, T]` (int8, valid values) and the `TilePackedKV` it was made with."""
    modes = check_tensor("modes", modes, rank=4)
    if not isinstance(packing, TilePackedKV):
        raise TypeError(f"packing must be a TilePackedKV, got {type(packing).__name__}")
    packing.ensure_valid()
    t = cdiv(packing.seqlen, packing.block)
    b, hq = modes.shape[0], modes.shape[1]
    if modes.dtype != torch.int8 or tuple(modes.shape) != (packing.batch, hq, t, t) or \
            hq % packing.kv_heads != 0:
        raise ValueError(f"modes must be an int8 [B={packing.batch}, Hq, T={t}, T={t}] tensor (Hq a multiple of "
                         f"Hkv={packing.kv_heads}) for this packing (N={packing.seqlen}, block={packing.block}), "
                         f"got {modes.dtype} {tuple(modes.shape)}")
    if modes.device != packing.packed.k.device:
        raise ValueError(f"modes must be on the packing's device ({packing.packed.k.device}), got {modes.device}")
    check_mode_values(modes)
    return modes, packing


def check_packing(packing: object, k: torch.Tensor) -> TilePackedKV:
    """`packing` must be a `TilePackedKV` of `k: [B, Hkv, N, D]` (sizes, dtype, device)."""
    if not isinstance(packing, TilePackedKV):
        raise TypeError(f"packing must be a TilePackedKV, got {type(packing).__name__}")
    packing.ensure_valid()
    b, h, n, d = k.shape
    if (packing.batch, packing.kv_heads, packing.seqlen) != (b, h, n) or packing.packed.k.shape[-1] != d:
        raise ValueError(f"packing must come from keys [B={b}, Hkv={h}, N={n}, D={d}], got B={packing.batch}, "
                         f"Hkv={packing.kv_heads}, N={packing.seqlen}, D={packing.packed.k.shape[-1]}")
    if packing.packed.k.dtype != k.dtype or packing.packed.k.device != k.device:
        raise ValueError(f"packing must have k's dtype and device ({k.dtype}, {k.device})")
    return packing


def check_selection(weights: object, selected: object) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile weights `[B, H, T, T]` (float) and a bool selection of the same shape."""
    weights = check_weights(weights)
    selected = check_values("selected", check_tensor("selected", selected, rank=4), why="it names the tiles")
    if selected.device != weights.device:
        raise ValueError(f"selected must be on weights' device ({weights.device}), got {selected.device}")
    if selected.dtype != torch.bool or selected.shape != weights.shape:
        raise ValueError(f"selected must be a bool tensor of weights' shape {tuple(weights.shape)}, "
                         f"got {selected.dtype} {tuple(selected.shape)}")
    return weights, selected


def check_key_dtype(key_dtype: object) -> torch.dtype:
    """The ranking's sort-key dtype: torch.float64 (the spec) or torch.float32."""
    if key_dtype not in (torch.float64, torch.float32):
        raise TypeError(f"key_dtype must be torch.float64 or torch.float32, got {key_dtype!r}")
    assert isinstance(key_dtype, torch.dtype)
    return key_dtype


def rank_off_diagonal(
    weights: torch.Tensor, selected: torch.Tensor, *, first: bool = True,
    key_dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The selected off-diagonal tiles of every (batch row, head), heaviest first.

    Args:
        weights, selected: `[B, H, T, T]`.
        first: whether the first key tile (`j = 0`) is a candidate.
        key_dtype: the sort keys' dtype. float64 is the spec; float32 gives the same order
            for weights of float32 or narrower (each is exact in both) that are never
            float32's lowest finite value (where NaN ranks), in half the radix passes
            (`fast.delta_xattention_tiles` passes it for float32 weights).

    Returns:
        (order int64 `[B, H, T * T]`: row-major tile indices, the `n` candidates first by
        descending weight (NaN last, ties to the lower index); n int64 `[B, H]`).
    """
    b, h, t, _ = weights.shape
    idx = torch.arange(t, device=weights.device)
    off = (idx[None, :] < idx[:, None]) & ((idx[None, :] > 0) | first)
    candidate = (selected & off).reshape(b, h, t * t)
    ranked = torch.where(candidate, rank_nan_last(weights.reshape(b, h, t * t).to(key_dtype)), -math.inf)
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    return order, candidate.sum(-1)


def share_of(fraction: float, n: torch.Tensor) -> torch.Tensor:
    """`round(fraction * n)`, halves up, int64 (the same float64 arithmetic in both packages)."""
    return torch.floor(fraction * n.to(torch.float64) + 0.5).to(torch.int64)


def exact_tiles(weights: torch.Tensor, selected: torch.Tensor, exact_top: float, *,
                key_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """4.2.1: the tiles computed exactly: the diagonal, and the top `exact_top` of the selected
    off-diagonal tiles by weight (per batch row and head; see the module doc).

    Args:
        weights: float `[B, H, T, T]`, XAttention tile weights.
        selected: bool `[B, H, T, T]`, the selected tiles (`select_tiles`).
        exact_top: fraction in `[0, 1]`.
        key_dtype: the ranking's sort keys (`rank_off_diagonal`).

    Returns:
        bool `[B, H, T, T]`.

    Raises:
        TypeError, ValueError: bad arguments.
    """
    weights, selected = check_selection(weights, selected)
    top = check_exact_top(exact_top)
    b, h, t, _ = weights.shape
    order, n = rank_off_diagonal(weights, selected, key_dtype=check_key_dtype(key_dtype))
    # 4.2.1: "the top 10% of off-diagonal tiles by XAttention tile importance score".
    in_top = torch.arange(t * t, device=weights.device) < share_of(top, n).unsqueeze(-1)
    top_tiles = torch.zeros(b, h, t * t, dtype=torch.bool, device=weights.device).scatter_(-1, order, in_top)
    idx = torch.arange(t, device=weights.device)
    return top_tiles.view(b, h, t, t) | (idx[None, :] == idx[:, None])


def skip_tiles(weights: torch.Tensor, selected: torch.Tensor, skip: float, *,
               key_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """4.2.2's ablation: XAttention's selection less its `skip` least important off-diagonal tiles.

    Per batch row and head, `round(skip * n)` of its `n` selected off-diagonal tiles
    other than the first key tile are dropped, the lightest first (the exact reverse of
    `exact_tiles`' order: NaN weights first, ties to the higher index). XAttention
    forces the first tile (it holds the attention sink, which its antidiagonal weights
    underrate); the diagonal is never a candidate either.

    Args:
        weights: float `[B, H, T, T]`, XAttention tile weights.
        selected: bool `[B, H, T, T]` (`select_tiles`).
        skip: fraction in `[0, 1]`.
        key_dtype: the ranking's sort keys (`rank_off_diagonal`).

    Returns:
        bool `[B, H, T, T]`, a subset of `selected` keeping every diagonal and first tile.

    Raises:
        TypeError, ValueError: bad arguments.
    """
    weights, selected = check_selection(weights, selected)
    drop = check_fraction("skip", skip)
    b, h, t, _ = weights.shape
    order, n = rank_off_diagonal(weights, selected, first=False, key_dtype=check_key_dtype(key_dtype))
    pos = torch.arange(t * t, device=weights.device)
    # Sec. 4.2.2: "skip the alpha% least important off-diagonal tiles".
    dropped = (pos >= (n - share_of(drop, n)).unsqueeze(-1)) & (pos < n.unsqueeze(-1))
    gone = torch.zeros(b, h, t * t, dtype=torch.bool, device=weights.device).scatter_(-1, order, dropped)
    return selected & ~gone.view(b, h, t, t)


def tile_modes(selected: torch.Tensor, exact: torch.Tensor, unselected: str) -> torch.Tensor:
    """int8 `[B, H, T, T]`: `EXACT` where `exact`, `PACKED` on the other selected (or, with
    `unselected="packed"`, causal) tiles, `SKIPPED` elsewhere."""
    t = selected.shape[-1]
    idx = torch.arange(t, device=selected.device)
    computed = selected if unselected == "skip" else (idx[None, :] <= idx[:, None]).expand(selected.shape)
    modes = torch.where(computed, PACKED, SKIPPED).to(torch.int8)
    return torch.where(exact, EXACT, modes).to(torch.int8)


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
    """The mode of every tile: XAttention's selection split into exact and packed tiles.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`.
        stride, threshold, block, scoring: XAttention's (`reference.xattention_plan`).
        exact_top: fraction of the selected off-diagonal tiles computed exactly, in `[0, 1]`.
        unselected: "skip" (the thesis) or "packed" (unselected causal tiles packed too).
        scale: softmax scale of the scoring, `1/sqrt(D)` if None.

    Returns:
        int8 `[B, Hq, T, T]` of `EXACT`, `PACKED`, `SKIPPED`; non-causal tiles `SKIPPED`.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k)
    stride, _, block, scoring = check_xattention_params(
        stride=stride, threshold=threshold, block=block, scoring=scoring)
    tau = per_head(threshold, "threshold", shape.q_heads, check_threshold_of_tiles, device=q.device)
    top = check_exact_top(exact_top)
    unselected = check_unselected(unselected)
    resolve_scale(scale, q.shape[-1])
    # Sec. 2.5: XAttention's tile weights and greedy selection.
    weights = xattention_tile_weights(q, k, stride=stride, block=block, scoring=scoring, scale=scale)
    selected = select_tiles(weights, tau)
    # Sec. 4.2.1: the diagonal and the top tiles exact, the rest of the selection packed.
    return tile_modes(selected, exact_tiles(weights, selected, top), unselected)


def tile_view(x: torch.Tensor, block: int, tiles: int) -> torch.Tensor:
    """`x: [B, H, N, D]` as `[B * H, tiles, block, D]` over its first `tiles * block` tokens
    (a view when `x`'s batch and head dimensions merge, else a copy)."""
    b, h, n, d = x.shape
    return x.reshape(b * h, n, d)[:, : tiles * block].view(b * h, tiles, block, d)


def empty_packing(k: torch.Tensor, block: int, packed_block: int) -> TilePackedKV:
    """The packing of keys with a single tile: nothing is ever packed."""
    b, h, n, d = k.shape
    dev = k.device
    packed = PackedKV(
        k=k.new_zeros(0, d), v=k.new_zeros(0, d),
        counts=torch.zeros(0, dtype=torch.int32, device=dev), timestamps=torch.zeros(0, dtype=torch.int32, device=dev),
        offsets=torch.zeros(1, dtype=torch.int64, device=dev), lengths=torch.zeros(b * h, 0, dtype=torch.int32, device=dev),
        seqlen=block, block=packed_block,
    ).mark_valid()
    return TilePackedKV(packed=packed, batch=b, kv_heads=h, seqlen=n, block=block).mark_valid()


def check_tile_pack_inputs(
    k: object, v: object, delta_threshold: object, metric: object, block: object, packed_block: object,
) -> tuple[torch.Tensor, torch.Tensor, float, str, int, int]:
    """Check `delta_tile_pack`'s arguments; return them."""
    k = check_keys(k)
    v = check_tensor("v", v, rank=4)
    if v.shape != k.shape or v.dtype != k.dtype or v.device != k.device:
        raise ValueError(f"v must match k's shape, dtype and device, got {tuple(v.shape)} {v.dtype} {v.device}")
    m = check_metric(metric)
    thr = check_delta_threshold(delta_threshold, m)
    bs, pb = check_pack_blocks(block, packed_block)
    return k, v, thr, m, bs, pb


def delta_tile_pack(
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    delta_threshold: float,
    metric: str = "euclidean",
    block: int = 128,
    packed_block: int = 32,
) -> TilePackedKV:
    """4.2: Delta-KV Stages 1 and 2 applied per key tile (see the module doc).

    Args:
        k, v: `[B, Hkv, N, D]`, same dtype and device.
        delta_threshold: Stage 1's threshold (`reference.delta_keep_mask`).
        metric: "euclidean" or "cosine".
        block: tokens per tile (the Stage 1 chunk).
        packed_block: each tile's anchors are padded to a multiple of it (divides `block`;
            values past `block` mean `block`).

    Returns:
        The `TilePackedKV` of tiles `0 .. T - 2`.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    k, v, thr, metric, bs, pb = check_tile_pack_inputs(k, v, delta_threshold, metric, block, packed_block)
    return tile_pack(k, v, tile_keep_mask(k, threshold=thr, metric=metric, block=bs), block=bs, packed_block=pb)


def tile_keep_mask(k: torch.Tensor, *, threshold: float, metric: str, block: int) -> torch.Tensor:
    """Sec. 4.2: Stage 1 per block (each tile one chunk, its first key an anchor), on checked
    inputs: bool `[B * Hkv, T - 1, block]` over the packed tiles (`[B * Hkv, 0, block]` for
    a single tile)."""
    b, h, n, _ = k.shape
    tiles = cdiv(n, block) - 1
    if tiles == 0:
        return torch.zeros(b * h, 0, block, dtype=torch.bool, device=k.device)
    return delta_keep_mask(tile_view(k, block, tiles), threshold=threshold, metric=metric, chunk=block)


def tile_pack(k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *, block: int,
              packed_block: int) -> TilePackedKV:
    """Sec. 4.2: Stage 2 per block (one packed segment per tile) from `tile_keep_mask`'s mask,
    on checked inputs."""
    b, h, n, _ = k.shape
    tiles = cdiv(n, block) - 1
    if tiles == 0:
        return empty_packing(k, block, packed_block)
    packed = delta_pack(tile_view(k, block, tiles), tile_view(v, block, tiles), keep, block=packed_block)
    return TilePackedKV(packed=packed, batch=b, kv_heads=h, seqlen=n, block=block).mark_valid()


def delta_xattention_pairs(modes: torch.Tensor, anchors: torch.Tensor, *, seqlen: int, block: int,
                           packed_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (query, key) pairs the two launches compute, per (batch row, query head): what
    the break-even rule prices (`reference.dense_fallback.packed_head_costs`).

    An exact tile costs its causal pairs (the diagonal tile `r (r + 1) / 2`), a packed
    tile its rows times its anchors padded to `packed_block` (the kernel reads whole
    packed blocks). Integers throughout, a few heads at a time.

    Args:
        modes: int8 `[B, Hq, T, T]`, `delta_xattention_tiles`'s.
        anchors: int `[B, Hkv, T - 1]`, anchors per packed tile (the keep mask's sums).
        seqlen: N. block: tokens per tile. packed_block: the anchors' padding granule.

    Returns:
        (exact_pairs, packed_pairs), int64 `[B, Hq]`.
    """
    b, hq, t, _ = modes.shape
    dev = modes.device
    hkv = int(anchors.shape[1])
    size = (seqlen - torch.arange(t, device=dev, dtype=torch.int64) * block).clamp(max=block)
    pairs = (size[:, None] * size[None, :]).tril(-1) + torch.diag(size * (size + 1) // 2)
    padded = torch.zeros(b, hkv, t, dtype=torch.int64, device=dev)
    padded[..., : t - 1] = (anchors.to(torch.int64) + packed_block - 1) // packed_block * packed_block
    exact = torch.zeros(b, hq, dtype=torch.int64, device=dev)
    packed = torch.zeros(b, hq, dtype=torch.int64, device=dev)
    step = max(1, (1 << 24) // max(1, b * t * t))
    for h0 in range(0, hq, step):
        h1 = min(hq, h0 + step)
        m = modes[:, h0:h1]
        exact[:, h0:h1] = torch.where(m == EXACT, pairs, 0).sum(dim=(-2, -1))
        rows = torch.where(m == PACKED, size[:, None], 0).sum(dim=-2)  # [B, h, T]: query rows per key tile
        kv = torch.arange(h0, h1, device=dev) // (hq // hkv)
        packed[:, h0:h1] = (rows * padded[:, kv]).sum(dim=-1)
    return exact, packed


def dense_query_heads(q: torch.Tensor, modes: torch.Tensor, anchors: torch.Tensor, *, block: int,
                      packed_block: int, rates: RateTable | None) -> tuple[int, ...]:
    """The query heads the break-even rule sends dense, decided on the tiles and the keep
    mask before packing: those whose two launches (`delta_xattention_pairs` priced by
    `packed_head_costs`) are not faster than dense; () when the rule is off (`rates` None).
    Both packages call it (one host read of `[Hq]` flags).

    Args:
        q: `[B, Hq, N, D]` (its dtype and head dim choose the rates).
        modes: `[B, Hq, T, T]` tile modes. anchors: int `[B, Hkv, T - 1]`.
        block, packed_block: the run's tile and packed block.
        rates: the table in force, None when the rule is off.

    Returns:
        Sorted query heads.
    """
    if rates is None:
        return ()
    n = int(q.shape[2])
    exact, packed = delta_xattention_pairs(modes, anchors, seqlen=n, block=block, packed_block=packed_block)
    costs = packed_head_costs(exact, packed, seqlen=n, block_m=block, head_dim=int(q.shape[-1]), dtype=q.dtype,
                              rates=rates)
    return flagged(costs.dense)


def packed_block_mask(modes: torch.Tensor, packing: TilePackedKV) -> torch.Tensor:
    """bool `[B, Hq, T, ceil(N / packed_block)]`: the packed key blocks (in region space) of
    every query tile's `PACKED` tiles."""
    b, hq, t, _ = modes.shape
    group = hq // packing.kv_heads
    pb = packing.packed_block
    kb = cdiv(packing.seqlen, pb)
    mask = torch.zeros(b, hq, t, kb, dtype=torch.bool, device=modes.device)
    if packing.tiles == 0:
        return mask
    first, count = packing.tile_blocks()
    for bi in range(b):
        for h in range(hq):
            for j in range(packing.tiles):
                f, c = int(first[bi, h // group, j]), int(count[bi, h // group, j])
                mask[bi, h, :, f:f + c] = (modes[bi, h, :, j] == PACKED)[:, None]
    return mask


def delta_xattention_plans(
    q: torch.Tensor,
    modes: torch.Tensor,
    packing: TilePackedKV,
) -> tuple[BlockColumnPlan, BlockColumnPlan]:
    """The two launches as plans: (exact tiles over the original keys, packed tiles over the anchors).

    The exact plan lists the `EXACT` tiles as key blocks of `block x block`. The packed
    plan (`block_m = block`, `block_n = packed_block`) lists, per query tile, the packed
    key blocks of its `PACKED` tiles in their region's index space (see `TilePackedKV`).

    Args:
        q: `[B, Hq, N, D]` (only the shape is used).
        modes: from `delta_xattention_tiles`.
        packing: from `delta_tile_pack` of the keys.

    Returns:
        (exact_plan, packed_plan), `BlockColumnPlan`s for `[B, Hq, N]`.

    Raises:
        TypeError, ValueError: bad inputs.
    """
    q = check_tensor("q", q, rank=4)
    if not isinstance(packing, TilePackedKV):
        raise TypeError(f"packing must be a TilePackedKV, got {type(packing).__name__}")
    b, hq, n, _ = q.shape
    packing.ensure_valid()
    if (packing.batch, packing.seqlen) != (b, n) or hq % packing.kv_heads != 0:
        raise ValueError(f"packing (B={packing.batch}, Hkv={packing.kv_heads}, N={packing.seqlen}) does not "
                         f"fit q [B={b}, Hq={hq}, N={n}]")
    modes = check_modes(modes, tuple(q.shape), packing)
    bs = packing.block
    exact = BlockColumnPlan.from_masks(modes == EXACT, None, seqlen=n, block_m=bs, block_n=bs)
    packed = BlockColumnPlan.from_masks(packed_block_mask(modes, packing), None, seqlen=n, block_m=bs,
                                        block_n=packing.packed_block)
    return exact, packed


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
    """4.2 with 4.1.3: exact tiles over the original keys, packed tiles over their anchors, one softmax.

    Args:
        q: `[B, Hq, N, D]`; k, v: `[B, Hkv, N, D]`.
        modes: from `delta_xattention_tiles`.
        packing: `delta_tile_pack(k, v, ...)`.
        count_weighted: weight anchors by their run length (Eq. 4); False drops the bias.
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs.
    """
    shape = check_qkv(q, k, v)
    sm_scale = resolve_scale(scale, shape.head_dim)
    check_packing(packing, k)
    modes = check_modes(modes, tuple(q.shape), packing)
    check_flags(count_weighted=count_weighted)
    b, hq, n, d = q.shape
    g, bs = shape.group, packing.block
    tiles = cdiv(n, bs)
    key_tile = torch.arange(n, device=q.device) // bs
    pos = torch.arange(n, device=q.device)
    out = torch.empty(b, hq, n, d, dtype=torch.float64, device=q.device)
    for bi in range(b):
        for kv in range(shape.kv_heads):
            rows = packing.region(bi, kv)
            anchors_k = packing.packed.k[rows].to(torch.float64)
            anchors_v = packing.packed.v[rows].to(torch.float64)
            counts = packing.packed.counts[rows].to(torch.float64)
            # Eq. 4: c exp(s) = exp(s + log c); padding (count 0) weighs nothing either way.
            bias = torch.log(counts) if count_weighted else torch.where(counts > 0, 0.0, -math.inf)
            sizes = (packing.packed.offsets[1:] - packing.packed.offsets[:-1])[
                (bi * shape.kv_heads + kv) * packing.tiles:(bi * shape.kv_heads + kv + 1) * packing.tiles]
            anchor_tile = torch.repeat_interleave(torch.arange(packing.tiles, device=q.device), sizes)
            keys = torch.cat([k[bi, kv].to(torch.float64), anchors_k])
            values = torch.cat([v[bi, kv].to(torch.float64), anchors_v])
            key_bias = torch.cat([torch.zeros(n, dtype=torch.float64, device=q.device), bias])
            # Non-finite values reach only the rows that keep them (reference.attention's rule).
            bad_value = ~torch.isfinite(values).all(dim=-1)
            values = torch.where(torch.isfinite(values), values, 0.0)
            for h in range(kv * g, (kv + 1) * g):
                for i in range(tiles):
                    r0, r1 = i * bs, min(n, (i + 1) * bs)
                    qs = q[bi, h, r0:r1].to(torch.float64)
                    exact = (modes[bi, h, i, key_tile] == EXACT)[None, :] & (pos[None, :] <= pos[r0:r1, None])
                    packed = (modes[bi, h, i, anchor_tile] == PACKED)[None, :].expand(r1 - r0, -1)
                    keep = torch.cat([exact, packed], dim=-1)
                    logits = (qs @ keys.T * sm_scale + key_bias).masked_fill(~keep, -math.inf)
                    o = torch.softmax(logits, dim=-1) @ values
                    # A row that keeps no key (its diagonal tile skipped) gets 0 (reference.attention).
                    o = torch.where(keep.any(-1, keepdim=True), o, 0.0)
                    out[bi, h, r0:r1] = torch.where((keep & bad_value).any(-1, keepdim=True), math.nan, o)
    return out.to(q.dtype)


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
    """DeltaXAttention end to end: XAttention's tiles, per-tile packing, exact + packed attention.

    Where the break-even rule is on (`reference.dense_fallback`: CUDA tensors by default,
    any device inside `dense_fallback(rates=table)`), it decides on the tiles and the keep
    mask, before packing: a query head whose exact and packed pairs
    (`delta_xattention_pairs`, priced by `packed_head_costs`) are not faster than dense
    gets full causal attention instead (every other head the output it gets without the
    rule).

    Args:
        q: `[B, Hq, N, D]`; k, v: `[B, Hkv, N, D]`.
        stride, threshold, block, scoring: XAttention's selection (`block` is also the
            Delta-KV chunk).
        exact_top: fraction of the selected off-diagonal tiles computed exactly (4.2.1).
        delta_threshold, metric: Delta-KV Stage 1 (`reference.delta_keep_mask`).
        packed_block: anchors of a tile padded to a multiple of it (divides `block`; past it,
            `block`).
        unselected: "skip" (thesis) or "packed".
        count_weighted: the count-weighted softmax (Eq. 4).
        scale: softmax scale of the scoring and the attention, `1/sqrt(D)` if None.

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    check_qkv(q, k, v)
    check_xattention_params(stride=stride, threshold=threshold, block=block, scoring=scoring)
    check_exact_top(exact_top)
    check_unselected(unselected)
    _, _, thr, metric, bs, pb = check_tile_pack_inputs(k, v, delta_threshold, metric, block, packed_block)
    check_flags(count_weighted=count_weighted)
    resolve_scale(scale, q.shape[-1])
    modes = delta_xattention_tiles(q, k, stride=stride, threshold=threshold, exact_top=exact_top, block=block,
                                   scoring=scoring, unselected=unselected, scale=scale)
    keep = tile_keep_mask(k, threshold=thr, metric=metric, block=bs)
    anchors = keep.sum(dim=-1).view(k.shape[0], k.shape[1], keep.shape[1])
    dense = dense_query_heads(q, modes, anchors, block=bs, packed_block=pb, rates=active_rates(q))
    if len(dense) == q.shape[1]:
        return attend_dense_heads(q, k, v, dense, None, scale=scale)
    packing = tile_pack(k, v, keep, block=bs, packed_block=pb)
    out = delta_xattention_attention(q, k, v, modes, packing, count_weighted=count_weighted, scale=scale)
    return attend_dense_heads(q, k, v, dense, out, scale=scale)


def _tile_sizes(seqlen: int, block: int, device: torch.device) -> torch.Tensor:
    t = cdiv(seqlen, block)
    return (seqlen - torch.arange(t, device=device) * block).clamp(max=block).to(torch.float64)


def _packed_anchors(modes: torch.Tensor, packing: TilePackedKV) -> torch.Tensor:
    """float64 `[B, Hq, T]`: anchors of every key tile (0 for the unpacked last tile)."""
    b, hq, t, _ = modes.shape
    anchors = torch.zeros(b, packing.kv_heads, t, dtype=torch.float64, device=modes.device)
    anchors[..., : packing.tiles] = packing.anchors().to(torch.float64)
    return anchors.repeat_interleave(hq // packing.kv_heads, dim=1)


def delta_xattention_kv_reduction(modes: torch.Tensor, packing: TilePackedKV) -> torch.Tensor:
    """4.2.1's KV reduction `f (1 - p)`, float64 `[B, Hq]`.

    The keys the computed tiles load (an exact tile all of its keys, a packed tile its
    anchors) over the keys they would load all exact (XAttention with the same tiles):
    one minus that ratio. Counts actual anchors, not the kernel's padding.
    """
    modes, packing = check_density_inputs(modes, packing)
    size = _tile_sizes(packing.seqlen, packing.block, modes.device)
    packed = (modes == PACKED).to(torch.float64)
    full = ((modes != SKIPPED).to(torch.float64) * size).sum(dim=(-2, -1))
    saved = (packed * (size - _packed_anchors(modes, packing)).unsqueeze(-2)).sum(dim=(-2, -1))
    return saved / full


def delta_xattention_density(modes: torch.Tensor, packing: TilePackedKV) -> torch.Tensor:
    """Score entries computed over the causal area, float64 `[B, Hq]` (the kernel's work).

    An exact tile costs its causal (row, key) pairs, a packed tile `rows x anchors`.
    """
    modes, packing = check_density_inputs(modes, packing)
    n = packing.seqlen
    size = _tile_sizes(n, packing.block, modes.device)
    pairs = size[:, None] * size[None, :]
    pairs = pairs.tril(-1) + torch.diag(size * (size + 1) / 2)
    exact = ((modes == EXACT).to(torch.float64) * pairs).sum(dim=(-2, -1))
    packed = ((modes == PACKED).to(torch.float64) * size[:, None] * _packed_anchors(modes, packing).unsqueeze(-2))
    return (exact + packed.sum(dim=(-2, -1))) / (n * (n + 1) / 2)
