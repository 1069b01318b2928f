"""Conformance of DeltaXAttention, a method whose output is not one plan's attention.

* `delta_xattention_structure_check` (the "plan" property): the fast tile modes equal
  the reference's, or differ only where the fp32 tile weights decide a tie (the
  selection as `xattention_tie_check` judges it, and the top-`exact_top` split: the
  same number of exact tiles, none outweighed by a packed candidate by more than
  `tile_weight_tolerance` in float64); the per-tile packing is bit-identical (the same
  float64 comparisons in both packages, as Delta-KV's); and the fast plans equal the
  reference's plans of the same modes and packing.
* `delta_xattention_golden` (the "end_to_end" property): an independent statement of
  the output as one masked softmax over `[original keys ; every anchor of the region]`
  with the log-count bias on the anchors, from the reference's modes and packing: in
  float64 the golden, in the inputs' dtype (matmuls there, softmax in fp32) the
  baseline of the tolerance policy.

The golden follows the reference's tiles. If the fp32 weights flip a tie (random
inputs essentially never tie within 1e-5; the structure check names such a case),
the fast output would be compared with the other side of the tie.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import fast, reference
from ..reference.delta_xattention import EXACT, PACKED, TilePackedKV, share_of, tile_modes
from ..methods.delta_xattention import modes as _modes
from ..methods.delta_xattention import packing as _packing
from .ties import check_greedy_modulo_ties, tile_weight_tolerance

def check_top_modulo_ties(weights: torch.Tensor, selected: torch.Tensor, exact: torch.Tensor, exact_top: float,
                          *, tolerance: float) -> None:
    """`exact` is `exact_tiles(weights, selected, exact_top)` up to ties within `tolerance`.

    Per (batch row, head): every diagonal tile is exact, no other non-selected or
    non-causal tile is; the exact off-diagonal tiles number `round(exact_top * n)`; and
    no packed candidate outweighs an exact one by more than `tolerance` (float64).

    Raises:
        AssertionError: naming the first (b, h) that breaks a rule.
    """
    w = torch.nan_to_num(weights.to(torch.float64).cpu(), nan=-math.inf)
    selected, exact = selected.cpu(), exact.cpu()
    t = w.shape[-1]
    idx = torch.arange(t)
    below = idx[None, :] < idx[:, None]
    diag = idx[None, :] == idx[:, None]
    candidate = selected & below

    def first(bad: torch.Tensor, message: str) -> None:
        if bool(bad.any()):
            at = tuple(int(i) for i in bad.nonzero()[0].tolist())
            raise AssertionError(f"DeltaXAttention exact tiles at (b, h) {at[:2]}: {message}")

    first((diag & ~exact).any(-1).any(-1), "a diagonal tile is not exact")
    first((exact & ~diag & ~candidate).any(-1).any(-1), "an exact tile is not a selected off-diagonal tile")
    chosen = exact & candidate
    wanted = share_of(exact_top, candidate.sum(dim=(-2, -1)))
    first(chosen.sum(dim=(-2, -1)) != wanted, f"not round({exact_top} x selected off-diagonal tiles) exact")
    lightest = torch.where(chosen, w, math.inf).amin(dim=(-2, -1))
    heaviest = torch.where(candidate & ~chosen, w, -math.inf).amax(dim=(-2, -1))
    first(heaviest - lightest > tolerance, f"a packed tile outweighs an exact one by more than {tolerance:.3g}")


def delta_xattention_structure_check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     params: dict[str, Any]) -> None:
    """Fast tile modes (modulo ties), packing (bit for bit) and plans against the reference.

    Raises:
        AssertionError: naming the first structure that differs.
    """
    modes_r = _modes(reference, q, k, params).cpu()
    modes_f = _modes(fast, q, k, params).cpu()
    if not torch.equal(modes_r, modes_f):
        scoring = {name: params[name] for name in ("stride", "block", "scoring", "scale") if name in params}
        weights_f = fast.xattention_tile_weights(q, k, **scoring)
        selected_f = fast.select_tiles(weights_f, params.get("threshold", 0.9))
        top = float(params.get("exact_top", 0.1))
        exact_f = fast.exact_tiles(weights_f, selected_f, top)
        again = tile_modes(selected_f, exact_f, str(params.get("unselected", "skip"))).cpu()
        if not torch.equal(again, modes_f):
            raise AssertionError("fast.delta_xattention_tiles is not tile_modes of its own steps")
        weights = reference.xattention_tile_weights(q, k, **scoring)
        tol = tile_weight_tolerance(q, k, params.get("scale"))
        check_greedy_modulo_ties(weights, selected_f, threshold=params.get("threshold", 0.9),
                                 tolerance=tol, what="DeltaXAttention selection")
        check_top_modulo_ties(weights, selected_f, exact_f, top, tolerance=tol)
    ref = _packing(reference, k, v, params)
    got = _packing(fast, k, v, params)
    for name in ("counts", "timestamps", "offsets", "lengths"):
        if not torch.equal(getattr(ref.packed, name).cpu(), getattr(got.packed, name).cpu()):
            raise AssertionError(f"tile packing: {name} differ")
    for name in ("k", "v"):
        # Bit patterns: the anchors are copies.
        if not torch.equal(getattr(ref.packed, name).view(torch.int16).cpu(),
                           getattr(got.packed, name).view(torch.int16).cpu()):
            raise AssertionError(f"tile packing: {name} differ")
    modes = modes_f.to(q.device)
    for what, p_ref, p_got in zip(("exact", "packed"), reference.delta_xattention_plans(q, modes, ref),
                                  fast.delta_xattention_plans(q, modes, got)):
        if not p_ref.equal(p_got.to(p_ref.device)):
            raise AssertionError(f"{what} plans differ")


def _combined(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, modes: torch.Tensor, packing: TilePackedKV,
              params: dict[str, Any], *, dtype: torch.dtype) -> torch.Tensor:
    """The output as one masked softmax over `[keys ; region anchors]`, computed in `dtype`."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    bs = packing.block
    count_weighted = bool(params.get("count_weighted", True))
    scale = params.get("scale")
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    pk = packing.packed
    sizes = (pk.offsets[1:] - pk.offsets[:-1]).view(b, hkv, packing.tiles)
    width = max(1, int(sizes.sum(-1).max())) if packing.tiles else 1
    anchors_k = torch.zeros(b, hkv, width, d, dtype=k.dtype, device=k.device)
    anchors_v = torch.zeros_like(anchors_k)
    bias = torch.full((b, hkv, width), -math.inf, dtype=torch.float64, device=k.device)
    tile = torch.zeros(b, hkv, width, dtype=torch.int64, device=k.device)
    for bi in range(b):
        for kv in range(hkv):
            region = packing.region(bi, kv)
            m = region.stop - region.start
            anchors_k[bi, kv, :m] = pk.k[region]
            anchors_v[bi, kv, :m] = pk.v[region]
            counts = pk.counts[region].to(torch.float64)
            bias[bi, kv, :m] = torch.log(counts) if count_weighted else torch.where(counts > 0, 0.0, -math.inf)
            tile[bi, kv, :m] = torch.repeat_interleave(torch.arange(packing.tiles, device=k.device), sizes[bi, kv])
    pos = torch.arange(n, device=q.device)
    keys = torch.cat([k, anchors_k], dim=2).repeat_interleave(g, dim=1).to(dtype)
    values = torch.cat([v, anchors_v], dim=2).repeat_interleave(g, dim=1).to(dtype)
    key_bias = torch.cat([torch.zeros(b, hkv, n, dtype=torch.float64, device=k.device), bias], dim=2)
    soft = torch.float64 if dtype == torch.float64 else torch.float32
    key_bias = key_bias.repeat_interleave(g, dim=1).to(soft)
    anchor_tile = tile.repeat_interleave(g, dim=1)  # [B, Hq, W]
    out = torch.empty(b, hq, n, d, dtype=dtype, device=q.device)
    # Rows in chunks, so that the [rows, N + W] logits stay small at any N.
    for r0 in range(0, n, 256):
        r1 = min(n, r0 + 256)
        rows = pos[r0:r1]
        modes_rows = modes[:, :, rows // bs].to(torch.int64)  # [B, Hq, R, T]
        exact = torch.gather(modes_rows, -1, (pos // bs).expand(b, hq, r1 - r0, n)) == EXACT
        exact = exact & (pos[None, :] <= rows[:, None])
        packed = torch.gather(modes_rows, -1, anchor_tile.unsqueeze(2).expand(b, hq, r1 - r0, width)) == PACKED
        mask = torch.cat([exact, packed], dim=-1)  # [B, Hq, R, N + W]
        scores = torch.matmul(q[:, :, r0:r1].to(dtype), keys.transpose(-1, -2)) * sm_scale
        logits = (scores.to(soft) + key_bias.unsqueeze(2)).masked_fill(~mask, -math.inf)
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0).to(dtype)
        out[:, :, r0:r1] = torch.matmul(probs, values)
    return out


def delta_xattention_golden(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            params: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(golden float64 output, baseline output in q's dtype) of `delta_xattention(q, k, v, **params)`."""
    modes = _modes(reference, q, k, params)
    packing = _packing(reference, k, v, params)
    golden = _combined(q, k, v, modes, packing, params, dtype=torch.float64)
    baseline = _combined(q, k, v, modes, packing, params, dtype=q.dtype)
    return golden, baseline
