"""XAttention and DPXA: reference steps by hand, fast against reference, ties, validation.

Hand-checked tiny cases of every step (antidiagonal scores, the row softmax summed
into tiles, the greedy selection, delta anchors are Delta-KV's stage 1, anchor-pair tile scores), then the
fast kernels against the reference on awkward shapes: integer things (anchors,
plans) exactly or through the tie check, float things within the tie tolerance.
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
from sparseprefill.conformance.ties import (  # noqa: E402
    check_greedy_modulo_ties,
    dpxa_tie_check,
    tile_weight_tolerance,
    xattention_tie_check,
)
from sparseprefill.fast.kernels.delta_score import delta_anchor_lists, delta_anchor_packed  # noqa: E402
from sparseprefill.fast.kernels.tile_select import select_tile_lists  # noqa: E402
from sparseprefill.fast.xattention import _select_tiles_torch  # noqa: E402
from sparseprefill.reference.plan import mask_to_list  # noqa: E402
from sparseprefill.reference.dpxa import anchor_tile_scores, dpxa_anchors  # noqa: E402
from sparseprefill.reference.xattention import stride_groups, stride_scores  # noqa: E402

REF_X = sys.modules["sparseprefill.reference.xattention"]


def _qk(b: int, hq: int, hkv: int, n: int, d: int, *, seed: int = 0,
        smooth: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp16 q, k, v; `smooth` makes neighbouring tokens similar (a random walk), as in real
    attention, so delta pre-processing drops some of them."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=gen)
    k = torch.randn(b, hkv, n, d, generator=gen)
    v = torch.randn(b, hkv, n, d, generator=gen)
    if smooth:
        q = q.cumsum(2) / (1 + torch.arange(n)[:, None]).sqrt()
        k = k.cumsum(2) / (1 + torch.arange(n)[:, None]).sqrt()
    return q.half(), k.half(), v.half()


# -- reference: XAttention steps ------------------------------------------------


def test_groups_restart_in_every_tile_and_end_short() -> None:
    start, size = stride_groups(11, block=5, stride=3)
    # Tiles [0, 5), [5, 10), [10, 11); groups of 3 inside each, the last ones short.
    assert start.tolist() == [0, 3, 5, 8, 10]
    assert size.tolist() == [3, 2, 3, 2, 1]


@pytest.mark.parametrize("n", [1, 7, 13])
def test_antidiagonal_scores_by_hand(n: int) -> None:
    q, k, _ = _qk(1, 2, 1, n, 8, seed=n)
    stride, block, scale = 3, 6, 0.7
    got = stride_scores(q, k, block=block, stride=stride, scoring="antidiagonal", scale=scale)
    start, size = stride_groups(n, block=block, stride=stride)
    q64, k64 = q.double(), k.double()
    for h in range(2):
        for g in range(start.numel()):
            for c in range(start.numel()):
                if start[c] > start[g]:
                    assert got[0, h, g, c] == -math.inf
                    continue
                # Slot a of the query group meets slot S - 1 - a of the key group.
                want = sum(float(q64[0, h, start[g] + a] @ k64[0, 0, start[c] + stride - 1 - a])
                           for a in range(stride) if a < size[g] and stride - 1 - a < size[c])
                assert float(got[0, h, g, c]) == pytest.approx(want * scale / stride, abs=1e-12)


def test_naive_scores_use_each_group_first_token() -> None:
    q, k, _ = _qk(1, 1, 1, 10, 8)
    got = stride_scores(q, k, block=8, stride=4, scoring="naive", scale=0.5)
    start, _ = stride_groups(10, block=8, stride=4)
    assert start.tolist() == [0, 4, 8]
    want = (q.double()[0, 0, start] @ k.double()[0, 0, start].T) * 0.5
    want = want.masked_fill(torch.ones(3, 3, dtype=torch.bool).triu(1), -math.inf)
    assert torch.equal(got[0, 0], want)


def test_tile_weights_are_row_softmax_summed_into_tiles() -> None:
    q, k, _ = _qk(2, 4, 2, 37, 16, seed=3)
    w = reference.xattention_tile_weights(q, k, stride=4, block=16)
    scores = stride_scores(q, k, block=16, stride=4, scoring="antidiagonal", scale=0.25)
    probs = torch.softmax(scores, dim=-1)
    start, _ = stride_groups(37, block=16, stride=4)
    tile = start // 16
    for i in range(3):
        rows = tile == i
        for j in range(3):
            mass = probs[:, :, rows][..., tile == j].sum(dim=(-2, -1)) / int(rows.sum())
            assert torch.allclose(w[:, :, i, j], mass, atol=1e-12)
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 3, dtype=torch.float64))
    assert bool((w.triu(1) == 0).all())


def test_gqa_equals_repeated_kv_heads() -> None:
    q, k, _ = _qk(1, 4, 2, 40, 16, seed=5)
    k_rep = k.repeat_interleave(2, dim=1)
    for fn in (reference.xattention_tile_weights, reference.dpxa_tile_weights):
        assert torch.equal(fn(q, k, block=16), fn(q, k_rep, block=16))


def _row(values: list[float]) -> torch.Tensor:
    """Weights of one query tile `i = len(values) - 1` as a [1, 1, T, T] tensor (other rows: diagonal)."""
    t = len(values)
    w = torch.eye(t, dtype=torch.float64)
    w[t - 1] = torch.tensor(values, dtype=torch.float64)
    return w[None, None]


def test_select_tiles_by_hand() -> None:
    # Row 4: forced tile 0 (0.05) and diagonal (0.5) count first; then 0.25, 0.15, 0.05.
    w = _row([0.05, 0.05, 0.15, 0.25, 0.5])
    keep = reference.select_tiles(w, 0.9)[0, 0, 4].tolist()
    # Before 0.25: 0.55 < 0.9 keep; before 0.15: 0.80 < 0.9 keep; before 0.05: 0.95 -> drop.
    assert keep == [True, False, True, True, True]
    assert reference.select_tiles(w, 0.8)[0, 0, 4].tolist() == [True, False, False, True, True]
    assert reference.select_tiles(w, 0.55)[0, 0, 4].tolist() == [True, False, False, False, True]
    assert reference.select_tiles(w, 1e-9)[0, 0, 4].tolist() == [True, False, False, False, True]
    assert reference.select_tiles(w, 1.0)[0, 0, 4].tolist() == [True] * 5
    # Ties: the lower index first.
    tied = _row([0.1, 0.2, 0.2, 0.5])
    assert reference.select_tiles(tied, 0.7)[0, 0, 3].tolist() == [True, True, False, True]
    for t in (1e-9, 0.55, 0.8, 0.9, 1.0):
        assert torch.equal(fast.select_tiles(w.float(), t), reference.select_tiles(w, t))


def test_select_tiles_threshold_one_keeps_every_causal_tile_even_with_zero_weights() -> None:
    w = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    w[..., torch.arange(4), torch.arange(4)] = 1.0
    for sel in (reference.select_tiles, fast.select_tiles):
        keep = sel(w, 1.0)
        assert torch.equal(keep[0, 0], torch.ones(4, 4, dtype=torch.bool).tril())


# -- reference: DPXA steps --------------------------------------------------------


def test_dpxa_anchors_are_delta_kv_stage_one_per_tile() -> None:
    q, _, _ = _qk(1, 2, 1, 45, 16, smooth=True)
    got = dpxa_anchors(q, cos_threshold=0.5, block=16)
    assert torch.equal(got, reference.delta_keep_mask(q, threshold=0.5, metric="cosine", chunk=16))
    assert bool(got[..., ::16].all())
    assert 0 < int(got.sum()) < got.numel()


def test_anchor_tile_scores_by_hand() -> None:
    q, k, _ = _qk(1, 1, 1, 9, 4, seed=2)
    qa = torch.tensor([[[1, 0, 1, 1, 0, 0, 1, 0, 1]]], dtype=torch.bool)
    ka = torch.tensor([[[1, 1, 0, 1, 0, 1, 1, 0, 0]]], dtype=torch.bool)
    got = anchor_tile_scores(q, k, qa, ka, block=4, scale=0.5)
    q64, k64 = q.double()[0, 0], k.double()[0, 0]
    for i in range(3):
        pairs = [(a, c) for a in range(4 * i, min(9, 4 * i + 4)) for c in range(a + 1)
                 if qa[0, 0, a] and ka[0, 0, c]]
        top = max(float(q64[a] @ k64[c]) * 0.5 for a, c in pairs)
        for j in range(3):
            want = sum(math.exp(float(q64[a] @ k64[c]) * 0.5 - top) for a, c in pairs if c // 4 == j)
            assert float(got[0, 0, i, j]) == pytest.approx(want, rel=1e-12, abs=1e-300)


def test_dpxa_scoring_ratio_is_product_of_keep_ratios() -> None:
    q, k, _ = _qk(2, 4, 2, 50, 16, smooth=True)
    ratio = reference.dpxa_scoring_ratio(q, k, cos_threshold=0.5, block=16)
    alpha = dpxa_anchors(q, cos_threshold=0.5, block=16).double().mean(-1)
    beta = dpxa_anchors(k, cos_threshold=0.5, block=16).double().mean(-1)
    assert torch.equal(ratio, alpha * beta.repeat_interleave(2, dim=1))
    assert 0.0 < float(ratio.min()) and float(ratio.max()) < 1.0


# -- fast against reference --------------------------------------------------------

XATTN_CASES = [
    # (B, Hq, Hkv, N, D, block, stride, scoring)
    (1, 1, 1, 1, 64, 16, 1, "antidiagonal"),
    (2, 4, 2, 63, 64, 16, 4, "antidiagonal"),
    (1, 2, 1, 111, 128, 48, 16, "antidiagonal"),
    (1, 3, 1, 129, 64, 128, 8, "naive"),
    (2, 2, 2, 100, 32, 32, 3, "naive"),
]


@pytest.mark.parametrize("case", XATTN_CASES, ids=lambda c: f"N{c[3]}-b{c[5]}-s{c[6]}-{c[7]}")
def test_fast_xattention_matches_reference(case: tuple[Any, ...]) -> None:
    b, hq, hkv, n, d, block, stride, scoring = case
    q, k, _ = _qk(b, hq, hkv, n, d, seed=n)
    w_ref = reference.xattention_tile_weights(q, k, stride=stride, block=block, scoring=scoring)
    w_fast = fast.xattention_tile_weights(q, k, stride=stride, block=block, scoring=scoring)
    assert w_fast.dtype == torch.float32 and w_fast.shape == w_ref.shape
    assert float((w_fast.double() - w_ref).abs().max()) <= tile_weight_tolerance(q, k, None)
    assert bool((w_fast.triu(1) == 0).all())
    for threshold in (1e-6, 0.5, 0.9, 1.0):
        params = {"stride": stride, "block": block, "scoring": scoring, "threshold": threshold}
        props.check_method_plan(METHODS["xattention"], q, k, params, context=str(params))


DPXA_CASES = [
    # (B, Hq, Hkv, N, D, block, cos_threshold)
    (1, 1, 1, 1, 64, 16, 0.75),
    (2, 4, 2, 63, 64, 16, 0.3),
    (1, 2, 1, 111, 128, 48, -1.0),
    (1, 1, 1, 129, 64, 128, 0.9),
    (2, 2, 1, 100, 32, 32, 1.0),
    # Every key an anchor, tiles of 48 against steps of 128 packed anchors: tile sums carried
    # across steps (the interpreter's BLOCK_K).
    (1, 2, 1, 300, 32, 48, 1.0),
]
# The interpreter runs the delta scan one position at a time: long tiles cost the most.
DPXA_THRESHOLDS = {16: (1e-6, 0.9), 32: (0.9,), 48: (0.5,), 128: (0.9,)}


@pytest.mark.parametrize("case", DPXA_CASES, ids=lambda c: f"N{c[3]}-b{c[5]}-cos{c[6]}")
def test_fast_dpxa_matches_reference(case: tuple[Any, ...]) -> None:
    b, hq, hkv, n, d, block, cos = case
    q, k, _ = _qk(b, hq, hkv, n, d, seed=n, smooth=True)
    for x in (q, k):
        assert torch.equal(delta_anchor_lists(x, cos_threshold=cos, block=block)[0],
                           dpxa_anchors(x, cos_threshold=cos, block=block))
    if block <= 32:
        assert torch.equal(fast.dpxa_scoring_ratio(q, k, cos_threshold=cos, block=block),
                           reference.dpxa_scoring_ratio(q, k, cos_threshold=cos, block=block))
    w_ref = reference.dpxa_tile_weights(q, k, cos_threshold=cos, block=block)
    w_fast = fast.dpxa_tile_weights(q, k, cos_threshold=cos, block=block)
    assert float((w_fast.double() - w_ref).abs().max()) <= tile_weight_tolerance(q, k, None)
    for threshold in DPXA_THRESHOLDS[block]:
        params = {"cos_threshold": cos, "block": block, "threshold": threshold}
        props.check_method_plan(METHODS["dpxa"], q, k, params, context=str(params))


def test_scoring_program_orders_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scoring kernel's program orders (launch order, longest rows first, a row
    block's key range split over programs) give the reference's weights; the first two
    bit for bit (the same sums in the same order)."""
    from sparseprefill.fast.kernels import xattention_score as xs

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 130, 16, generator=gen).half()
    k = torch.randn(1, 1, 130, 16, generator=gen).half()
    want = reference.xattention_tile_weights(q.double(), k.double(), stride=4, block=32)
    got = {}
    for longest, split in ((False, 0), (True, 0), (True, 1)):
        monkeypatch.setattr(xs, "LONGEST_FIRST", longest)
        monkeypatch.setattr(xs, "KEY_SPLIT_STEPS", split)
        got[longest, split] = fast.xattention_tile_weights(q, k, stride=4, block=32)
        torch.testing.assert_close(got[longest, split].double(), want, rtol=0, atol=1e-6)
    assert torch.equal(got[False, 0], got[True, 0])


@pytest.mark.parametrize("key_tiles,flat", [(2, False), (1, True)], ids=["split2", "split1-flat"])
def test_dpxa_scoring_with_the_gpu_tiling(monkeypatch: pytest.MonkeyPatch, key_tiles: int, flat: bool) -> None:
    """DPXA's scoring kernel at GPU-like tiles (the interpreter's default takes every tile
    in one program): several query-tile groups per head launched longest first, each one's
    key range split over programs (splits past a group's range do nothing), key tiles with
    more anchors than a step, more Q anchors than a step (the hoisted first chunk and the
    reloaded ones), both loops (per key tile, and flat with the next chunk prefetched), GQA
    and batch 2; weights within tolerance of the reference."""
    from sparseprefill.fast.kernels import delta_score as ds
    from sparseprefill.fast.kernels import interpreter_active

    # The kernels run on CPU tensors under the interpreter, on a GPU's otherwise.
    if not interpreter_active() and not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET=0 runs the kernels on a GPU: needs CUDA")
    device = "cpu" if interpreter_active() else "cuda"
    # 4 query tiles a program (2 groups of the 5 tiles), 16 Q and 16 K anchors a step.
    monkeypatch.setattr(ds, "_score_config", lambda rows, tiles: (4, 16, 16, key_tiles, flat, 4, 1))
    q, k, _ = (t.to(device) for t in _qk(2, 2, 1, 160, 16, seed=5, smooth=True))
    keep_q = ds.delta_anchor_lists(q, cos_threshold=0.95, block=32)[2]
    keep_k = ds.delta_anchor_lists(k, cos_threshold=0.95, block=32)[2]
    assert int(keep_k.max()) > 16 and int(keep_q[..., :4].sum(-1).max()) > 16
    want = reference.dpxa_tile_weights(q, k, cos_threshold=0.95, block=32)
    got = fast.dpxa_tile_weights(q, k, cos_threshold=0.95, block=32)
    assert float((got.double() - want).abs().max()) <= tile_weight_tolerance(q, k, None)
    assert bool((got.triu(1) == 0).all())


def test_packed_anchors_are_positions_in_order() -> None:
    q, _, _ = _qk(2, 2, 1, 45, 32, smooth=True)
    keep, pos, start = delta_anchor_packed(q, cos_threshold=0.6, block=16)
    flags = keep.reshape(4, 45)
    for r in range(4):
        want = flags[r].nonzero().flatten().tolist()
        assert pos[r, : len(want)].tolist() == want
        per_tile = [int(flags[r, t * 16:(t + 1) * 16].sum()) for t in range(3)]
        assert start[r].tolist() == [0, per_tile[0], per_tile[0] + per_tile[1], sum(per_tile)]


def test_selection_kernel_matches_the_torch_path() -> None:
    """`fast.kernels.tile_select` (the GPU path of `select_tiles`) against the torch path:
    ties by position, NaN rows and weights, thresholds at the extremes and per head; and its lists
    are `mask_to_list` of its mask at width T."""
    gen = torch.Generator().manual_seed(5)
    tiles = 9
    w = torch.rand(2, 2, tiles, tiles, generator=gen)
    w[0, 0] = (w[0, 0] * 4).round() / 4  # ties
    w[0, 1, 6, 2] = math.nan  # one NaN weight
    w[1, 0, 4] = math.nan  # a NaN row
    idx = torch.arange(tiles)
    w = torch.where(idx[None, :] <= idx[:, None], w, 0.0)
    w = w / w.sum(-1, keepdim=True)
    w[0, 1, 6, 2] = math.nan
    # Scalars at the extremes, and one threshold per head (the kernel reads THRESH[h]).
    for threshold in (1e-9, 0.5, 0.9, 1.0, torch.tensor([0.5, 1.0], dtype=torch.float64)):
        want = _select_tiles_torch(w, threshold)
        keep, count, index = select_tile_lists(w, threshold)
        assert torch.equal(keep, want), threshold
        want_count, want_index = mask_to_list(want)
        assert torch.equal(count, want_count)
        width = want_index.shape[-1]
        assert torch.equal(index[..., :width], want_index) and not bool(index[..., width:].any())


def test_anchor_lists_are_packed_positions() -> None:
    q, _, _ = _qk(1, 2, 1, 45, 32, smooth=True)
    keep, pos, count = delta_anchor_lists(q, cos_threshold=0.6, block=16)
    want = [[[int(keep[0, h, t * 16:(t + 1) * 16].sum()) for t in range(3)] for h in range(2)]]
    assert count.tolist() == want
    for h in range(2):
        for t in range(3):
            want = (keep[0, h, t * 16:(t + 1) * 16].nonzero().flatten() + t * 16).tolist()
            assert pos[0, h, t, : int(count[0, h, t])].tolist() == want


@pytest.mark.parametrize("method", ["xattention", "dpxa"])
def test_end_to_end_nan_poisoned(method: str) -> None:
    q, k, v = _qk(2, 4, 2, 77, 64, seed=9, smooth=True)
    params = {"block": 32, "threshold": 0.8}
    ratio = props.check_method_end_to_end(METHODS[method], q, k, v, params, context=method)
    assert ratio <= 1.0


@pytest.mark.parametrize("where", ["q", "k"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nonfinite_inputs_weigh_nothing_in_both_packages(where: str, value: float) -> None:
    """A NaN or infinite score weighs nothing; a query tile left without a finite score
    keeps every causal tile; fast and reference plans agree and keep the forced tiles."""
    q, k, _ = _qk(1, 2, 1, 70, 32, seed=7)
    (q if where == "q" else k)[0, 0, 37, 3] = value
    for name, params in (("xattention", {"block": 16, "stride": 4, "threshold": 0.5}),
                         ("dpxa", {"block": 16, "cos_threshold": 0.5, "threshold": 0.5})):
        ref = METHODS[name].reference_plan(q, k, **params)
        got = METHODS[name].fast_plan(q, k, **params)
        assert ref.equal(got), f"{name}: {value} in {where}"
        keep = ref.block_mask()
        assert bool(keep[..., torch.arange(5), torch.arange(5)].all()) and bool(keep[..., 0].all())
    for stride in (3, 5):  # groups that end short at tile ends: padding must stay clean
        ref = reference.xattention_plan(q, k, block=16, stride=stride, threshold=0.5)
        assert ref.equal(fast.xattention_plan(q, k, block=16, stride=stride, threshold=0.5))
    weights = reference.xattention_tile_weights(q, k, block=16, stride=4)
    nan_rows = weights.isnan().any(-1)[0, 0].tolist()
    # Token 37's query group has no finite score only when q itself is non-finite.
    assert nan_rows == ([False, False, True, False, False] if where == "q" else [False] * 5)
    if where == "q":
        plan = reference.xattention_plan(q, k, block=16, stride=4, threshold=0.5)
        assert plan.block_mask()[0, 0, 2].tolist() == [True, True, True, False, False]


def test_short_group_padding_does_not_read_the_next_tile() -> None:
    """Stride 5 in 16-token tiles: tile 2's last group is token 47 alone; its padding slots
    must not pick up token 48 (tile 3), here NaN."""
    q, k, _ = _qk(1, 1, 1, 64, 16, seed=8)
    q[0, 0, 48] = math.nan
    for pkg in (reference, fast):
        weights = pkg.xattention_tile_weights(q, k, block=16, stride=5)
        assert weights.isnan().any(-1)[0, 0].tolist() == [False, False, False, True]


# -- the tie checks reject what they must -------------------------------------------


def test_greedy_tie_check_rejects_wrong_selections() -> None:
    w = _row([0.05, 0.05, 0.15, 0.25, 0.5])
    good = reference.select_tiles(w, 0.9)
    check_greedy_modulo_ties(w, good, threshold=0.9, tolerance=1e-9, what="t")
    swapped = good.clone()
    swapped[0, 0, 4, 3], swapped[0, 0, 4, 1] = False, True  # the heavier tile dropped
    with pytest.raises(AssertionError, match="outweighs"):
        check_greedy_modulo_ties(w, swapped, threshold=0.9, tolerance=1e-9, what="t")
    short = good.clone()
    short[0, 0, 4, 2] = False  # stopped before reaching the threshold
    with pytest.raises(AssertionError, match="before the kept weight reached"):
        check_greedy_modulo_ties(w, short, threshold=0.9, tolerance=1e-9, what="t")
    extra = good.clone()
    extra[0, 0, 4, 1] = True  # one tile after the threshold was reached
    with pytest.raises(AssertionError, match="after the kept weight had reached"):
        check_greedy_modulo_ties(w, extra, threshold=0.9, tolerance=1e-9, what="t")
    no_first = good.clone()
    no_first[0, 0, 4, 0] = False
    with pytest.raises(AssertionError, match="first or the diagonal"):
        check_greedy_modulo_ties(w, no_first, threshold=0.9, tolerance=1e-9, what="t")
    # A near-tie within the tolerance may go either way.
    tied = _row([0.1, 0.2, 0.2 + 1e-12, 0.5])
    alt = reference.select_tiles(tied, 0.7)
    alt[0, 0, 3, 1], alt[0, 0, 3, 2] = True, False
    check_greedy_modulo_ties(tied, alt, threshold=0.7, tolerance=1e-9, what="t")


def test_tie_checks_reject_a_wrong_plan() -> None:
    q, k, _ = _qk(1, 2, 1, 96, 32, seed=4, smooth=True)
    for name, tie_check, params in (
        ("xattention", xattention_tie_check, {"block": 16, "stride": 4, "threshold": 0.6}),
        ("dpxa", dpxa_tie_check, {"block": 16, "cos_threshold": 0.5, "threshold": 0.6}),
    ):
        plan = METHODS[name].reference_plan(q, k, **params)
        tie_check(q, k, params, plan, plan)
        keep = plan.block_mask()
        free = (keep.sum(-1) < torch.arange(1, 7)) & (torch.arange(6) >= 2)
        i = int(free[0, 0].nonzero()[0])
        dropped = int((~keep[0, 0, i, : i + 1]).nonzero()[0])
        kept_free = [j for j in range(1, i) if keep[0, 0, i, j]]
        wrong = keep.clone()
        wrong[0, 0, i, dropped] = True
        if kept_free:
            wrong[0, 0, i, kept_free[0]] = False
        bad = reference.BlockColumnPlan.from_masks(wrong, None, seqlen=96, block_m=16, block_n=16)
        with pytest.raises(AssertionError, match="not explained by a tie"):
            tie_check(q, k, params, plan, bad)


# -- validation before any launch ----------------------------------------------------

BAD_XATTN = [
    ({"stride": 0}, ValueError, "stride"),
    ({"block": 2**20}, ValueError, "block"),
    ({"threshold": 0.0}, ValueError, "threshold"),
    ({"threshold": 1.5}, ValueError, "threshold"),
    ({"threshold": math.nan}, ValueError, "threshold"),
    ({"threshold": "0.9"}, TypeError, "threshold"),
    ({"scoring": "diagonal"}, ValueError, "scoring"),
    ({"scoring": 1}, TypeError, "scoring"),
    ({"block": 0}, ValueError, "block"),
    ({"stride": 2.0}, TypeError, "stride"),
]
BAD_DPXA = [
    ({"cos_threshold": 1.5}, ValueError, "cos_threshold"),
    ({"cos_threshold": -1.01}, ValueError, "cos_threshold"),
    ({"threshold": 0.0}, ValueError, "threshold"),
    ({"block": -16}, ValueError, "block"),
]


@pytest.mark.parametrize("pkg", [reference, fast], ids=["reference", "fast"])
def test_bad_parameters_are_named(pkg: Any) -> None:
    q, k, v = _qk(1, 2, 1, 20, 16)
    for kwargs, exc, word in BAD_XATTN:
        with pytest.raises(exc, match=word):
            pkg.xattention_plan(q, k, **kwargs)
        with pytest.raises(exc, match=word):
            pkg.xattention(q, k, v, **kwargs)
        if "threshold" not in kwargs:
            with pytest.raises(exc, match=word):
                pkg.xattention_tile_weights(q, k, **kwargs)
    for kwargs, exc, word in BAD_DPXA:
        with pytest.raises(exc, match=word):
            pkg.dpxa_plan(q, k, **kwargs)
        with pytest.raises(exc, match=word):
            pkg.dpxa(q, k, v, **kwargs)
        if "threshold" not in kwargs:
            with pytest.raises(exc, match=word):
                pkg.dpxa_tile_weights(q, k, **kwargs)
            with pytest.raises(exc, match=word):
                pkg.dpxa_scoring_ratio(q, k, **kwargs)
    with pytest.raises(ValueError, match="weights"):
        pkg.select_tiles(torch.zeros(2, 3, 4), 0.9)
    with pytest.raises(ValueError, match="weights must have shape"):
        pkg.select_tiles(torch.zeros(1, 1, 3, 4), 0.9)
    with pytest.raises(TypeError, match="weights"):
        pkg.select_tiles(torch.zeros(1, 1, 3, 3, dtype=torch.int64), 0.9)
    with pytest.raises(TypeError, match="weights"):
        pkg.select_tiles([[0.5]], 0.9)
    with pytest.raises(ValueError, match="threshold"):
        pkg.select_tiles(torch.zeros(1, 1, 3, 3), 0.0)


def test_stride_past_block_means_block() -> None:
    q, k, _ = _qk(1, 2, 1, 50, 16, seed=3)
    for pkg in (reference, fast):
        base = pkg.xattention_tile_weights(q, k, stride=16, block=16)
        for stride in (17, 2**63):
            assert torch.equal(pkg.xattention_tile_weights(q, k, stride=stride, block=16), base)


def test_fast_rejects_what_its_kernels_cannot_run() -> None:
    q, k, v = _qk(1, 2, 1, 20, 16)
    with pytest.raises(ValueError, match="block must be a multiple of 16"):
        fast.xattention(q, k, v, block=24, stride=8)
    with pytest.raises(ValueError, match="block must be a multiple of 16"):
        fast.dpxa_plan(q, k, block=40)
    with pytest.raises(TypeError, match="dtype"):
        fast.xattention_plan(q.float(), k.float())


def test_registry_demo_params_run() -> None:
    q, k, _ = _qk(1, 2, 1, 300, 16, smooth=True)
    for name in ("xattention", "dpxa"):
        spec = METHODS[name]
        plan = spec.reference_plan(q, k, **spec.demo_params(300))
        assert plan.block_m == plan.block_n == 64
        assert 0.0 < float(reference.density(plan).mean()) <= 1.0
    assert METHODS["xattention"].demo_params(32768)["block"] == 128
    assert REF_X.SCORINGS == ("antidiagonal", "naive")


def test_score_config_fits_shared_memory_at_every_head_dim() -> None:
    """The GPU scoring tiles fit a Hopper SM's shared memory at every head dim the kernels take
    (D = 256 with the 128 x 128 tiles asked for 384 KiB on an H100: found by the GPU
    conformance run of 2026-11-25), and D <= 128 keeps the fastest measured tiles."""
    from sparseprefill.fast.kernels import xattention_score as xs

    for head_dim in (16, 32, 64, 128, 256):  # fp16 / bf16 inputs only
        block_r, step, _, stages = xs.score_config(head_dim, 2)
        assert stages * (block_r + step) * head_dim * 2 <= xs.SHARED_BYTES, head_dim
    assert xs.score_config(128, 2) == xs.SCORE_CONFIGS[0]
    assert xs.score_config(256, 2) != xs.SCORE_CONFIGS[0]
