"""DeltaXAttention: reference steps by hand, identities, fast against reference, validation.

The exact/packed split and the tile-skip ablation on hand-made weights; the per-tile
packing against Delta-KV run on each tile alone; the identities that pin the output
(count-weighted anchors == attention to the expanded keys; everything exact == dense;
every key an anchor == XAttention); then the fast package against the reference on
awkward shapes (modes and packing exactly, outputs under the tolerance policy).
Sizes stay tiny: the kernels run in Triton's CPU interpreter here.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from sparseprefill import fast, reference  # noqa: E402
from sparseprefill.conformance import METHODS  # noqa: E402
from sparseprefill.conformance import properties as props  # noqa: E402
from sparseprefill.conformance.delta_xattention import (  # noqa: E402
    check_top_modulo_ties,
    delta_xattention_golden,
    delta_xattention_structure_check,
)
from sparseprefill.conformance.tolerance import check_output  # noqa: E402
from sparseprefill.reference.delta_xattention import EXACT, PACKED, SKIPPED, tile_modes  # noqa: E402

FAST_DX = sys.modules["sparseprefill.fast.delta_xattention"]


def _qkv(b: int, hq: int, hkv: int, n: int, d: int, *, seed: int = 0, runs: int = 3,
         dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v whose keys come in runs of about `runs` near-equal vectors (so anchors drop some)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=gen)
    base = torch.randn(b, hkv, n, d, generator=gen)
    k = base[:, :, (torch.arange(n) // runs) * runs] + 0.05 * torch.randn(b, hkv, n, d, generator=gen)
    v = torch.randn(b, hkv, n, d, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# -- reference: the exact/packed split and the ablation ---------------------------


def _weights() -> tuple[torch.Tensor, torch.Tensor]:
    """One head, 5 tiles; off-diagonal weights chosen to order by hand."""
    w = torch.tensor([[1.0, 0, 0, 0, 0],
                      [0.6, 0.4, 0, 0, 0],
                      [0.5, 0.2, 0.3, 0, 0],
                      [0.1, 0.2, 0.2, 0.5, 0],
                      [0.3, 0.05, 0.15, 0.1, 0.4]], dtype=torch.float64)[None, None]
    return w, torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()


def test_exact_top_takes_the_heaviest_selected_off_diagonal_tiles_per_head() -> None:
    w, sel = _weights()
    sel[0, 0, 4, 1] = False  # not selected: never exact, whatever its weight
    # Candidates: (1,0) .6, (2,0) .5, (2,1) .2, (3,0) .1, (3,1) .2, (3,2) .2, (4,0) .3,
    # (4,2) .15, (4,3) .1: nine; 0.34 x 9 = 3.06 -> 3 tiles: .6, .5, .3.
    ex = reference.exact_tiles(w, sel, 0.34)[0, 0]
    want = torch.eye(5, dtype=torch.bool)
    want[1, 0] = want[2, 0] = want[4, 0] = True
    assert torch.equal(ex, want)
    # 0.39 x 9 = 3.51 -> 4 (halves up): the next is a three-way tie at .2, lowest (i, j) first.
    ex = reference.exact_tiles(w, sel, 0.39)[0, 0]
    want[2, 1] = True
    assert torch.equal(ex, want)
    assert torch.equal(reference.exact_tiles(w, sel, 0.0)[0, 0], torch.eye(5, dtype=torch.bool))
    assert torch.equal(reference.exact_tiles(w, sel, 1.0)[0, 0], sel[0, 0])
    # 0.1 x 30 is 3.0000000000000004 in floats: still 3, not 4.
    t = 31
    big = torch.rand(1, 1, t, t, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    few = torch.zeros(1, 1, t, t, dtype=torch.bool)
    few[0, 0, torch.arange(1, t), 0] = True
    assert int((reference.exact_tiles(big, few, 0.1) & ~torch.eye(t, dtype=torch.bool)).sum()) == 3


def test_nan_weights_rank_last_for_exact_and_first_for_skipping() -> None:
    w, sel = _weights()
    w[0, 0, 3, 2] = math.nan
    ex = reference.exact_tiles(w, sel, 0.2)[0, 0]  # 10 candidates -> 2: .6 and .5, never the NaN
    assert bool(ex[1, 0]) and bool(ex[2, 0]) and not bool(ex[3, 2])
    kept = reference.skip_tiles(w, sel, 0.1)[0, 0]  # 6 candidates (not tile 0) -> 1 dropped: the NaN one
    want = sel[0, 0].clone()
    want[3, 2] = False
    assert torch.equal(kept, want)


def test_ranking_on_float32_keys_is_the_float64_order() -> None:
    """`key_dtype=torch.float32` (what `fast.delta_xattention_tiles` passes for float32
    weights) picks the same tiles as the float64 spec, ties (to the lower index) and NaN
    included, in both packages; any other key dtype is refused."""
    w, sel = _weights()
    w[0, 0, 3, 2] = math.nan
    w32 = w.float()
    for frac in (0.1, 0.2, 0.39, 0.67, 1.0):
        want_exact = reference.exact_tiles(w32.double(), sel, frac)
        want_skip = reference.skip_tiles(w32.double(), sel, frac)
        for mod in (fast, reference):
            assert torch.equal(mod.exact_tiles(w32, sel, frac, key_dtype=torch.float32), want_exact)
            assert torch.equal(mod.skip_tiles(w32, sel, frac, key_dtype=torch.float32), want_skip)
    for mod in (fast, reference):
        for bad in (torch.float16, "float32", None):
            with pytest.raises(TypeError, match="key_dtype"):
                mod.exact_tiles(w32, sel, 0.1, key_dtype=bad)
            with pytest.raises(TypeError, match="key_dtype"):
                mod.skip_tiles(w32, sel, 0.1, key_dtype=bad)


def test_skip_tiles_drops_the_lightest_off_diagonal_tiles_but_never_the_first() -> None:
    w, sel = _weights()
    w[0, 0, 4, 0] = 0.01  # the lightest tile of all, but the first key tile: XAttention forces it
    # Candidates (j > 0): (2,1) .2, (3,1) .2, (3,2) .2, (4,1) .05, (4,2) .15, (4,3) .1;
    # 0.67 -> drop 4: .05, .1, .15, then of the .2 tie the later (3,2) (the reverse of
    # exact_tiles' order).
    kept = reference.skip_tiles(w, sel, 0.67)[0, 0]
    gone = sel[0, 0] & ~kept
    assert sorted(map(tuple, gone.nonzero().tolist())) == [(3, 2), (4, 1), (4, 2), (4, 3)]
    assert torch.equal(reference.skip_tiles(w, sel, 0.0), sel)
    everything = reference.skip_tiles(w, sel, 1.0)[0, 0]
    assert torch.equal(everything, torch.eye(5, dtype=torch.bool) | (torch.arange(5) == 0)[None, :])
    assert torch.equal(fast.skip_tiles(w.float(), sel, 0.5), reference.skip_tiles(w.float(), sel, 0.5))


def test_tile_modes() -> None:
    w, sel = _weights()
    sel[0, 0, 4, 1] = False
    ex = reference.exact_tiles(w, sel, 0.34)
    modes = tile_modes(sel, ex, "skip")[0, 0]
    assert modes[4, 1] == SKIPPED and modes[4, 0] == EXACT and modes[4, 2] == PACKED and modes[0, 1] == SKIPPED
    modes = tile_modes(sel, ex, "packed")[0, 0]
    assert modes[4, 1] == PACKED and modes[0, 1] == SKIPPED
    assert modes.dtype == torch.int8


# -- reference: per-tile packing ----------------------------------------------------


def test_tile_packing_is_delta_kv_on_every_tile_alone() -> None:
    _, k, v = _qkv(2, 2, 2, 70, 16, seed=1)
    tp = reference.delta_tile_pack(k, v, delta_threshold=0.9, metric="cosine", block=16, packed_block=8)
    assert tp.tiles == 4  # tiles 0..3 of 16; the short last tile [64, 70) is never packed
    first, count = tp.tile_blocks()
    for b in range(2):
        for g in range(2):
            region = tp.region(b, g)
            assert int(tp.region_offsets()[b * 2 + g]) == region.start
            for j in range(4):
                kt, vt = k[b:b + 1, g:g + 1, 16 * j:16 * (j + 1)], v[b:b + 1, g:g + 1, 16 * j:16 * (j + 1)]
                keep = reference.delta_keep_mask(kt, threshold=0.9, metric="cosine", chunk=16)
                alone = reference.delta_pack(kt, vt, keep, block=8)
                seg = tp.packed.segment(b * 2 + g, j)
                assert torch.equal(tp.packed.k[seg], alone.k) and torch.equal(tp.packed.v[seg], alone.v)
                assert torch.equal(tp.packed.counts[seg], alone.counts)
                assert int(tp.packed.counts[seg].sum()) == 16
                assert seg.start - region.start == int(first[b, g, j]) * 8
                assert seg.stop - seg.start == int(count[b, g, j]) * 8
                assert int(tp.anchors()[b, g, j]) == int(keep.sum())
    assert 0 < float(tp.keep_ratio().max()) < 1


def test_one_tile_packs_nothing() -> None:
    q, k, v = _qkv(1, 2, 1, 30, 16)
    tp = reference.delta_tile_pack(k, v, delta_threshold=0.5, metric="cosine", block=32)
    assert tp.tiles == 0 and tp.packed.k.shape == (0, 16)
    out = reference.delta_xattention(q, k, v, delta_threshold=0.5, metric="cosine", block=32)
    assert torch.allclose(out.double(), reference.attention(q.double(), k.double(), v.double()), atol=2e-3)


# -- reference: identities -----------------------------------------------------------


def _mixed_golden(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, modes: torch.Tensor,
                  tp: Any) -> torch.Tensor:
    """Attention where a packed tile's keys and values are its anchors repeated over their runs."""
    from sparseprefill.reference.delta_kv import expand_packed

    b, hq, n, d = q.shape
    g = hq // k.shape[1]
    bs = tp.block
    exp_k, exp_v = expand_packed(tp.packed)  # [B * Hkv, T - 1, bs, D]
    out = torch.empty(b, hq, n, d, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            kv = h // g
            ke, ve = k[bi, kv].double().clone(), v[bi, kv].double().clone()
            kp, vp = ke.clone(), ve.clone()
            kp[: tp.tiles * bs] = exp_k[bi * k.shape[1] + kv].reshape(-1, d).double()
            vp[: tp.tiles * bs] = exp_v[bi * k.shape[1] + kv].reshape(-1, d).double()
            for r in range(n):
                i = r // bs
                mode = modes[bi, h, i, torch.arange(r + 1) // bs]
                keys = torch.where((mode == PACKED)[:, None], kp[: r + 1], ke[: r + 1])
                vals = torch.where((mode == PACKED)[:, None], vp[: r + 1], ve[: r + 1])
                s = (q[bi, h, r].double() @ keys.T) / math.sqrt(d)
                s = s.masked_fill(mode == SKIPPED, -math.inf)
                out[bi, h, r] = torch.softmax(s, -1) @ vals
    return out


@pytest.mark.parametrize("unselected", ["skip", "packed"])
def test_count_weighted_anchors_equal_attention_to_the_expanded_keys(unselected: str) -> None:
    q, k, v = _qkv(2, 4, 2, 53, 16, seed=2, dtype=torch.float64)
    modes = reference.delta_xattention_tiles(q, k, block=16, threshold=0.7, exact_top=0.2, unselected=unselected)
    assert bool((modes == PACKED).any()) and bool((modes == SKIPPED).tril(-1).any()) == (unselected == "skip")
    tp = reference.delta_tile_pack(k, v, delta_threshold=0.95, metric="cosine", block=16, packed_block=16)
    assert float(tp.keep_ratio().max()) < 0.8
    out = reference.delta_xattention_attention(q, k, v, modes, tp)
    assert torch.allclose(out, _mixed_golden(q, k, v, modes, tp), atol=1e-12)
    plain = reference.delta_xattention_attention(q, k, v, modes, tp, count_weighted=False)
    assert not torch.allclose(plain, out, atol=1e-3)


def test_everything_exact_is_dense_and_every_key_an_anchor_is_xattention() -> None:
    q, k, v = _qkv(1, 2, 1, 45, 16, seed=3, dtype=torch.float64)
    dense = reference.attention(q, k, v)
    out = reference.delta_xattention(q, k, v, threshold=1.0, exact_top=1.0, delta_threshold=0.5, block=16)
    assert torch.allclose(out, dense, atol=1e-12)
    # Euclidean 0 drops only exact duplicates (none here): every packed tile is its keys.
    x = reference.xattention(q, k, v, threshold=0.6, block=16, stride=4)
    out = reference.delta_xattention(q, k, v, threshold=0.6, block=16, stride=4, exact_top=0.0, delta_threshold=0.0)
    assert torch.allclose(out, x, atol=1e-12)


def test_kv_reduction_and_density_by_hand() -> None:
    q, k, v = _qkv(1, 1, 1, 40, 8, seed=4)
    tp = reference.delta_tile_pack(k, v, delta_threshold=0.9, metric="cosine", block=16, packed_block=8)
    a0, a1 = (int(x) for x in tp.anchors()[0, 0])
    modes = torch.full((1, 1, 3, 3), SKIPPED, dtype=torch.int8)
    modes[0, 0, 0, 0] = modes[0, 0, 1, 1] = modes[0, 0, 2, 2] = EXACT
    modes[0, 0, 2, 0] = PACKED
    modes[0, 0, 2, 1] = EXACT
    # Computed tiles load 16 + 16 + 8 (diagonals) + 16 (exact (2,1)) + a0 (packed (2,0)).
    red = reference.delta_xattention_kv_reduction(modes, tp)
    assert math.isclose(float(red), (16 - a0) / (16 + 16 + 8 + 16 + 16))
    dens = reference.delta_xattention_density(modes, tp)
    pairs = 136 + 136 + 36 + 8 * 16 + 8 * a0
    assert math.isclose(float(dens), pairs / (40 * 41 / 2))
    assert int(a1) > 0


def test_plans_cover_exactly_the_modes() -> None:
    q, k, v = _qkv(2, 4, 2, 100, 16, seed=5)
    modes = reference.delta_xattention_tiles(q, k, block=32, threshold=0.5, exact_top=0.3)
    tp = reference.delta_tile_pack(k, v, delta_threshold=0.9, metric="cosine", block=32, packed_block=16)
    exact, packed = reference.delta_xattention_plans(q, modes, tp)
    assert torch.equal(exact.block_mask(), modes == EXACT)
    first, count = tp.tile_blocks()
    blocks = packed.block_mask()  # [B, Hq, T, Kb] over packed key blocks
    for b in range(2):
        for h in range(4):
            for i in range(4):
                want = torch.zeros(blocks.shape[-1], dtype=torch.bool)
                for j in range(tp.tiles):
                    if modes[b, h, i, j] == PACKED:
                        want[int(first[b, h // 2, j]):int(first[b, h // 2, j] + count[b, h // 2, j])] = True
                assert torch.equal(blocks[b, h, i], want)


# -- fast against reference ------------------------------------------------------------


CASES = [
    # b, hq, hkv, n, d, block, packed_block, metric, delta, unselected, exact_top, threshold
    pytest.param(2, 4, 2, 111, 64, 32, 16, "cosine", 0.9, "skip", 0.2, 0.8, id="N111-gqa-b2"),
    pytest.param(1, 2, 1, 129, 128, 64, 32, "euclidean", 1.0, "packed", 0.1, 0.9, id="N129-d128-packed"),
    pytest.param(1, 2, 2, 63, 64, 16, 16, "cosine", 0.5, "skip", 1.0, 1e-6, id="N63-b16"),
    pytest.param(1, 1, 1, 1, 64, 16, 16, "cosine", 0.5, "skip", 0.1, 0.9, id="N1"),
    pytest.param(1, 2, 1, 96, 64, 48, 16, "euclidean", 0.0, "skip", 0.0, 1.0, id="N96-b48-dense",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("b,hq,hkv,n,d,block,pb,metric,delta,unselected,top,threshold", CASES)
def test_fast_matches_reference(b: int, hq: int, hkv: int, n: int, d: int, block: int, pb: int, metric: str,
                                delta: float, unselected: str, top: float, threshold: float) -> None:
    q, k, v = _qkv(b, hq, hkv, n, d, seed=n)
    params = {"block": block, "packed_block": pb, "metric": metric, "delta_threshold": delta,
              "unselected": unselected, "exact_top": top, "threshold": threshold, "stride": 4}
    delta_xattention_structure_check(q, k, v, params)
    golden, baseline = delta_xattention_golden(q, k, v, params)
    with props.nan_poisoned_empty():
        out = fast.delta_xattention(q, k, v, **params)
    check_output(out, golden, baseline, context="fast")
    check_output(reference.delta_xattention(q, k, v, **params), golden, baseline, context="reference")
    modes = reference.delta_xattention_tiles(q, k, **{x: params[x] for x in ("block", "unselected", "exact_top",
                                                                           "threshold", "stride")})
    tp_r = reference.delta_tile_pack(k, v, delta_threshold=delta, metric=metric, block=block, packed_block=pb)
    tp_f = fast.delta_tile_pack(k, v, delta_threshold=delta, metric=metric, block=block, packed_block=pb)
    for fn in ("delta_xattention_kv_reduction", "delta_xattention_density"):
        assert torch.equal(getattr(reference, fn)(modes, tp_r), getattr(fast, fn)(modes, tp_f))


def test_registry_golden_matches_the_reference_loop() -> None:
    q, k, v = _qkv(1, 2, 1, 70, 16, seed=6, dtype=torch.float32)
    params = {"block": 16, "packed_block": 16, "delta_threshold": 0.9, "metric": "cosine", "exact_top": 0.3,
              "threshold": 0.8, "count_weighted": False}
    golden, _ = delta_xattention_golden(q, k, v, params)
    assert torch.allclose(reference.delta_xattention(q.double(), k.double(), v.double(), **params), golden,
                          atol=1e-6)


def test_packing_split_over_several_launches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packing grid is split when it has too many tile segments; the result is the same."""
    _, k, v = _qkv(2, 4, 3, 70, 16, seed=7)
    whole = fast.delta_tile_pack(k, v, delta_threshold=0.9, metric="cosine", block=16, packed_block=16)
    monkeypatch.setattr(FAST_DX, "_MAX_GRID_Y", 9)  # 4 tiles -> 2 (b, kv) regions per launch
    parts = fast.delta_tile_pack(k, v, delta_threshold=0.9, metric="cosine", block=16, packed_block=16)
    for name in ("k", "v", "counts", "timestamps", "offsets", "lengths"):
        assert torch.equal(getattr(whole.packed, name), getattr(parts.packed, name)), name


def test_fast_ties_are_checked() -> None:
    """The top split's tie check accepts a swap within tolerance and rejects a real one."""
    w, sel = _weights()
    ex = reference.exact_tiles(w, sel, 0.39)  # .6, .5, .3 and (2,1) among three at .2
    swapped = ex.clone()
    swapped[0, 0, 2, 1], swapped[0, 0, 3, 1] = False, True
    check_top_modulo_ties(w, sel, swapped, 0.39, tolerance=1e-9)
    wrong = ex.clone()
    wrong[0, 0, 4, 0], wrong[0, 0, 4, 1] = False, True  # .3 packed while .05 exact
    with pytest.raises(AssertionError, match="outweighs"):
        check_top_modulo_ties(w, sel, wrong, 0.39, tolerance=1e-6)
    fewer = ex.clone()
    fewer[0, 0, 2, 1] = False
    with pytest.raises(AssertionError, match="round"):
        check_top_modulo_ties(w, sel, fewer, 0.39, tolerance=1e-6)


def test_nonfinite_values_reach_only_the_rows_that_read_them() -> None:
    q, k, v = _qkv(1, 2, 1, 64, 16, seed=8)
    params = {"block": 16, "packed_block": 16, "delta_threshold": 0.9, "metric": "cosine", "threshold": 1.0,
              "exact_top": 0.0}
    tp = reference.delta_tile_pack(k, v, **{x: params[x] for x in ("block", "packed_block", "delta_threshold",
                                                                    "metric")})
    seg = tp.packed.segment(0, 0)
    counts = tp.packed.counts[seg]
    dropped = int(torch.nonzero(counts > 1)[0]) + 1  # the key after the first multi-key anchor
    anchor_pos = 0 if dropped == 1 else int(counts[: dropped - 1].sum())
    v[0, 0, anchor_pos + 1] = math.nan  # a dropped key's value: never read
    ref = reference.delta_xattention(q, k, v, **params)
    got = fast.delta_xattention(q, k, v, **params)
    assert not bool(ref[:, :, 16:].isnan().any())  # rows past tile 0 read tile 0 through anchors
    assert torch.equal(ref.isnan(), got.isnan())
    v[0, 0, anchor_pos] = math.nan  # the anchor's own value: every row that packs or sees tile 0
    ref = reference.delta_xattention(q, k, v, **params)
    got = fast.delta_xattention(q, k, v, **params)
    assert bool(ref[:, :, 16:].isnan().all()) and not bool(ref[:, :, :anchor_pos].isnan().any())
    assert torch.equal(ref.isnan(), got.isnan())


@pytest.mark.slow
def test_end_to_end_property_on_the_registry() -> None:
    q, k, v = _qkv(2, 4, 2, 90, 64, seed=10)
    params = METHODS["delta_xattention"].demo_params(90)
    assert props.check_method_end_to_end(METHODS["delta_xattention"], q, k, v, params) <= 1.0


# -- validation --------------------------------------------------------------------------


@pytest.mark.parametrize("pkg", [reference, fast], ids=["reference", "fast"])
def test_argument_checks(pkg: Any) -> None:
    q, k, v = _qkv(1, 2, 1, 40, 16)
    w, sel = _weights()

    def bad(error: type[Exception], word: str, **kw: Any) -> None:
        args = {"delta_threshold": 0.5, "metric": "cosine", "block": 16, **kw}
        with pytest.raises(error, match=word):
            pkg.delta_xattention(q, k, v, **args)

    bad(ValueError, "packed_block", packed_block=24, block=32)
    bad(ValueError, "packed_block", packed_block=0)
    bad(ValueError, "exact_top", exact_top=1.5)
    bad(TypeError, "exact_top", exact_top="0.1")
    bad(ValueError, "unselected", unselected="drop")
    bad(ValueError, "delta_threshold", delta_threshold=math.nan)
    bad(ValueError, "delta_threshold", delta_threshold=-1.0, metric="euclidean")
    bad(TypeError, "delta_threshold", delta_threshold=None)
    bad(ValueError, "metric", metric="l1")
    bad(TypeError, "count_weighted", count_weighted=1)
    bad(ValueError, "threshold", threshold=0.0)
    with pytest.raises(ValueError, match="selected"):
        pkg.exact_tiles(w, sel[..., :4], 0.1)
    with pytest.raises(ValueError, match="selected"):
        pkg.skip_tiles(w, sel.int(), 0.1)
    with pytest.raises(ValueError, match="skip"):
        pkg.skip_tiles(w, sel, -0.1)
    with pytest.raises(TypeError, match="weights"):
        pkg.exact_tiles(w.tolist(), sel, 0.1)
    with pytest.raises(ValueError, match="packed_block"):
        pkg.delta_tile_pack(k, v, delta_threshold=0.5, block=48, packed_block=32)
    with pytest.raises(ValueError, match="v must match"):
        pkg.delta_tile_pack(k, v[..., :8], delta_threshold=0.5)
    tp = reference.delta_tile_pack(k, v, delta_threshold=0.5, metric="cosine", block=16, packed_block=16)
    modes = reference.delta_xattention_tiles(q, k, block=16)
    with pytest.raises(TypeError, match="packing"):
        pkg.delta_xattention_plans(q, modes, "packing")
    with pytest.raises(ValueError, match="modes"):
        pkg.delta_xattention_plans(q, modes.long(), tp)
    with pytest.raises(ValueError, match="modes"):
        pkg.delta_xattention_attention(q, k, v, modes[:, :1], tp)
    with pytest.raises(ValueError, match="packing"):
        pkg.delta_xattention_attention(q[:, :, :32], k[:, :, :32], v[:, :, :32], modes, tp)
    with pytest.raises(TypeError, match="packing"):
        pkg.delta_xattention_kv_reduction(modes, None)
    with pytest.raises(TypeError, match="modes"):
        pkg.delta_xattention_density("modes", tp)


def test_fast_specific_checks() -> None:
    q, k, v = _qkv(1, 2, 1, 40, 16)
    with pytest.raises(ValueError, match="block"):
        fast.delta_xattention(q, k, v, delta_threshold=0.5, block=24, packed_block=8)
    with pytest.raises(TypeError, match="k must have dtype"):
        fast.delta_tile_pack(k.float(), v.float(), delta_threshold=0.5)
