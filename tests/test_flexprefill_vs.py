"""FlexPrefill-style vertical-slash (SharePrefill Alg. 5): reference steps by hand, fast vs reference.

Integer things (kept lines, plans) exactly on inputs far from any tie; the tie
check accepts only differences within the documented rounding margins.
"""

from __future__ import annotations

import math
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from sparseprefill import fast, reference  # noqa: E402
from sparseprefill.conformance import tolerance  # noqa: E402
from sparseprefill.conformance.ties import (  # noqa: E402
    MASS_TOLERANCE,
    check_cover_modulo_ties,
    flexprefill_vs_tie_check,
)
from sparseprefill.fast.flexprefill_vs import flexprefill_vs_lines as fast_lines  # noqa: E402
from sparseprefill.fast.flexprefill_vs import lines_index as fast_index  # noqa: E402
import sparseprefill.fast.flexprefill_vs  # noqa: E402
from sparseprefill.fast.flexprefill_vs import padded_lines, padded_lines_many  # noqa: E402
from sparseprefill.reference.flexprefill_vs import (  # noqa: E402
    cover_threshold,
    first_lines,
    flexprefill_vs_lines,
    lines_index,
    normalized_lines,
)
from sparseprefill.reference.vertical_slash import approximate_attention, vertical_slash_index  # noqa: E402


def _inputs(b: int, hq: int, hkv: int, n: int, d: int, dtype: torch.dtype = torch.float16,
            seed: int = 0, peak: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, k, v; `peak` > 0 adds a shared direction to q and to a few keys (sparse rows)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=gen) for h in (hq, hkv, hkv))
    if peak:
        q[..., 0] += peak
        hot = torch.randperm(n, generator=gen)[: max(1, n // 16)]
        k[:, :, hot, 0] += peak
        k[:, :, 0, 0] += peak
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _brute_cover(scores: list[float], gamma: float, forced: set[int]) -> set[int]:
    """Alg. 5 lines 4-8 by enumeration: forced first, then the fewest largest reaching gamma."""
    kept = set(forced)
    mass = sum(scores[i] for i in kept)
    rest = sorted((i for i in range(len(scores)) if i not in forced), key=lambda i: (-scores[i], i))
    for i in rest:
        if mass >= gamma:
            break
        kept.add(i)
        mass += scores[i]
    return kept


# -- reference steps, by hand ----------------------------------------------------------


def test_cover_threshold_by_hand() -> None:
    s = torch.tensor([[0.1, 0.4, 0.05, 0.3, 0.15]], dtype=torch.float64)
    none = torch.zeros(5, dtype=torch.bool)
    # 0.4 + 0.3 = 0.7 < 0.8, + 0.15 = 0.85: three lines.
    assert cover_threshold(s, 0.8, none).nonzero()[:, 1].tolist() == [1, 3, 4]
    # Exactly reaching gamma stops: 0.4 + 0.3 = 0.7 >= 0.7.
    assert cover_threshold(s, 0.7, none).nonzero()[:, 1].tolist() == [1, 3]
    assert not bool(cover_threshold(s, 0.0, none).any())
    assert bool(cover_threshold(s, 1.0, none).all())
    # Index 2 forced: its 0.05 counts first, then 0.4 + 0.3 -> 0.75 >= 0.75.
    assert cover_threshold(s, 0.75, first_lines(3, 5, s.device) & (torch.arange(5) == 2)
                           ).nonzero()[:, 1].tolist() == [1, 2, 3]
    # Ties: the lower index ranks first.
    t = torch.tensor([[0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    assert cover_threshold(t, 0.5, torch.zeros(4, dtype=torch.bool)).nonzero()[:, 1].tolist() == [0, 1]


def test_cover_threshold_matches_enumeration() -> None:
    gen = torch.Generator().manual_seed(3)
    for trial in range(40):
        n = int(torch.randint(1, 30, (1,), generator=gen))
        raw = torch.rand(n, generator=gen, dtype=torch.float64) ** 4
        scores = raw / raw.sum()
        gamma = float(torch.rand(1, generator=gen))
        forced_n = trial % 4
        kept = cover_threshold(scores[None], gamma, first_lines(forced_n, n, scores.device))[0]
        want = _brute_cover(scores.tolist(), gamma, set(range(min(forced_n, n))))
        assert set(kept.nonzero()[:, 0].tolist()) == want, (trial, gamma)


def test_normalized_lines_sum_to_one() -> None:
    q, k, _ = _inputs(1, 2, 1, 40, 16, torch.float64, peak=3.0)
    a_v, a_s = normalized_lines(approximate_attention(q, k, last_q=8, scale=0.25))
    torch.testing.assert_close(a_v.sum(-1), torch.ones(1, 2, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(a_s.sum(-1), torch.ones(1, 2, dtype=torch.float64), rtol=0, atol=1e-12)


def test_lines_on_planted_inputs() -> None:
    """The last 4 queries (rows 60-63) split their mass evenly over keys 7 and 55-58."""
    n, d = 64, 16
    q = torch.zeros(1, 1, n, d, dtype=torch.float64)
    k = torch.zeros(1, 1, n, d, dtype=torch.float64)
    q[0, 0, n - 4:, :2] = 10.0
    k[0, 0, 7, 0] = 1.0
    k[0, 0, 55:59, 1] = 1.0
    a_v, a_s = normalized_lines(approximate_attention(q, k, last_q=4, scale=1.0))
    assert float(a_v[0, 0, 7]) == pytest.approx(0.2, abs=1e-3)
    # Offset o of keys 55-58 from rows 60-63 occurs 4 - |o - 5| times: 0.05 per occurrence.
    assert float(a_s[0, 0, 5]) == pytest.approx(0.2, abs=1e-3)
    assert float(a_s[0, 0, 3]) == pytest.approx(0.1, abs=1e-3)
    verticals, slashes = flexprefill_vs_lines(q, k, gamma=0.72, last_q=4, init_columns=0,
                                              local_diagonals=0, line_block=1, scale=1.0)
    # 0.2 each, ties to the lower column: 7, 55, 56 hold 0.6 < 0.72, so 57 too.
    assert verticals[0, 0].nonzero()[:, 0].tolist() == [7, 55, 56, 57]
    # 5 (.2), 4 and 6 (.15), 3 and 7 (.1) hold 0.7 < 0.72; then offset 2 (the lowest of the .05s).
    assert slashes[0, 0].nonzero()[:, 0].tolist() == [2, 3, 4, 5, 6, 7]


def test_lines_index_is_alg4_of_the_lines() -> None:
    """With equal counts per head, the mask index equals MInference's index of the same lines."""
    gen = torch.Generator().manual_seed(0)
    n = 77
    for bm, bn in ((16, 16), (32, 16), (16, 48)):
        v_ids = torch.randperm(n, generator=gen)[:6].sort().values
        s_ids = torch.randperm(n, generator=gen)[:5].sort().values
        vm = torch.zeros(1, 1, n, dtype=torch.bool)
        sm = torch.zeros(1, 1, n, dtype=torch.bool)
        vm[0, 0, v_ids] = True
        sm[0, 0, s_ids] = True
        want = vertical_slash_index(v_ids.view(1, 1, -1), s_ids.view(1, 1, -1), seqlen=n,
                                    block_m=bm, block_n=bn)
        assert lines_index(vm, sm, block_m=bm, block_n=bn).equal(want)
        assert fast_index(vm, sm, block_m=bm, block_n=bn).validate().equal(want)


def test_line_bands_by_hand() -> None:
    """Bands pool their lines' shares, rank as one entry and keep all their lines; with
    `block_n` dividing the band the vertical band is listed as blocks, not columns."""
    from sparseprefill.reference.flexprefill_vs import cover_bands, pool_lines

    shares = torch.tensor([[[0.05, 0.05, 0.3, 0.0, 0.2, 0.2, 0.1, 0.1]]], dtype=torch.float64)
    torch.testing.assert_close(pool_lines(shares, 3), torch.tensor([[[0.4, 0.4, 0.2]]], dtype=torch.float64))
    # Bands of 2: shares 0.1, 0.3, 0.4, 0.2; gamma 0.6 keeps bands 2 and 1 (lines 2-5).
    kept = cover_bands(shares, 0.6, 0, 2)
    assert kept.int().tolist() == [[[0, 0, 1, 1, 1, 1, 0, 0]]]
    # One forced line forces its whole band (band 0), then the fewest others reach gamma.
    assert cover_bands(shares, 0.45, 1, 2).int().tolist() == [[[1, 1, 0, 0, 1, 1, 0, 0]]]
    # Blocks of 2 keys, bands of 2: vertical band 1 (columns 2, 3) is the key block 1 of
    # every query block past it; no slash kept but offset 0.
    verticals = torch.zeros(1, 1, 8, dtype=torch.bool)
    verticals[..., 2:4] = True
    slashes = torch.zeros(1, 1, 8, dtype=torch.bool)
    slashes[..., 0] = True
    plan = lines_index(verticals, slashes, block_m=2, block_n=2, line_block=2)
    assert plan.column_count.sum() == 0
    assert plan.block_mask()[0, 0].int().tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0], [0, 1, 0, 1]]
    with_columns = lines_index(verticals, slashes, block_m=2, block_n=2, line_block=1)
    assert torch.equal(with_columns.to_dense_mask(), plan.to_dense_mask())
    assert int(with_columns.column_count.sum()) > 0


def test_padded_lines() -> None:
    kept = torch.tensor([[[False, True, False, True], [False, False, False, False]]])
    assert padded_lines(kept).tolist() == [[[1, 3], [4, 4]]]
    assert padded_lines(torch.zeros(1, 1, 3, dtype=torch.bool)).tolist() == [[[3]]]


@pytest.mark.parametrize("compact_by", ["scatter", "sort"])
def test_padded_lines_many_equals_one_at_a_time(compact_by: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both compactions give each mask's ascending kept indices at its own width."""
    monkeypatch.setattr(sys.modules["sparseprefill.fast.flexprefill_vs"], "COMPACT_BY", compact_by)
    gen = torch.Generator().manual_seed(3)
    a, b = torch.rand(2, 3, 37, generator=gen) < 0.3, torch.rand(2, 3, 37, generator=gen) < 0.05
    for got, kept in zip(padded_lines_many(a, b), (a, b)):
        width = max(1, int(kept.sum(-1).max()))
        want = [[sorted(torch.nonzero(r).flatten().tolist()) + [37] * (width - int(r.sum())) for r in row]
                for row in kept]
        assert got.tolist() == want
    assert padded_lines_many() == ()


def test_density_grows_with_gamma_and_empty_plan_gives_zeros() -> None:
    q, k, v = _inputs(1, 2, 1, 160, 32, seed=1, peak=4.0)
    dens = [float(reference.density(reference.flexprefill_vs_plan(q, k, gamma=g, block_m=16, block_n=16,
                                                                  line_block=lb)).mean())
            for lb in (1, 16) for g in (0.0, 0.5, 0.9, 1.0)]
    dens_bands, dens = dens[4:], dens[:4]
    assert dens_bands == sorted(dens_bands) and dens_bands[0] < dens_bands[-1] == 1.0
    assert dens == sorted(dens) and dens[0] < dens[-1] == 1.0
    empty = reference.flexprefill_vs_plan(q, k, gamma=0.0, init_columns=0, local_diagonals=0)
    assert int(empty.block_count.sum()) == 0 and int(empty.column_count.sum()) == 0
    out = fast.flexprefill_vs(q, k, v, gamma=0.0, init_columns=0, local_diagonals=0)
    assert bool((out == 0).all())


# -- fast against reference ------------------------------------------------------------


CASES = [
    # (B, Hq, Hkv, N, D, params)
    (2, 4, 2, 111, 64, dict(gamma=0.9, last_q=32, block_m=32, block_n=16, line_block=1)),
    (1, 2, 1, 129, 128, dict(gamma=0.95, last_q=64, block_m=64, block_n=64, init_columns=0,
                            local_diagonals=0, line_block=1)),
    (1, 3, 3, 63, 32, dict(gamma=0.5, last_q=200, block_m=16, block_n=48, init_columns=5,
                          local_diagonals=7, line_block=1)),
    (2, 2, 2, 1, 64, dict(gamma=0.9)),
    # Bands of lines that are whole key blocks (a pure-block plan); narrower bands (kept as
    # columns) are drawn by the conformance property.
    (1, 2, 1, 111, 16, dict(gamma=0.9, last_q=32, block_m=32, block_n=16, line_block=32,
                           init_columns=0, local_diagonals=0)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_fast_matches_reference(case: int) -> None:
    b, hq, hkv, n, d, params = CASES[case]
    q, k, v = _inputs(b, hq, hkv, n, d, seed=case, peak=3.0)
    line_params = {key: val for key, val in params.items() if key not in ("block_m", "block_n")}
    want_v, want_s = flexprefill_vs_lines(q, k, **line_params)  # type: ignore[arg-type]
    got_v, got_s = fast_lines(q, k, **line_params)  # type: ignore[arg-type]
    assert torch.equal(got_v, want_v) and torch.equal(got_s, want_s)
    want = reference.flexprefill_vs_plan(q, k, **params)  # type: ignore[arg-type]
    got = fast.flexprefill_vs_plan(q, k, **params).validate()  # type: ignore[arg-type]
    assert got.equal(want)
    mask = want.to_dense_mask()
    golden = tolerance.golden_attention(q, k, v, mask)
    baseline = tolerance.baseline_attention(q, k, v, mask)
    tolerance.check_output(fast.flexprefill_vs(q, k, v, **params), golden[0], baseline[0])  # type: ignore[arg-type]
    torch.testing.assert_close(reference.flexprefill_vs(*tolerance.upcast(q, k, v), **params),  # type: ignore[arg-type]
                               golden[0], rtol=0, atol=1e-12)


def test_fast_shares_within_the_tie_margin() -> None:
    """The fp32 estimate's shares and cumulative shares stay far inside the margins."""
    q, k, _ = _inputs(1, 4, 2, 150, 64, seed=4, peak=2.0)
    from sparseprefill.fast.kernels.last_q_estimate import last_q_scores

    vertical, slash = last_q_scores(q, k, last_q=64)
    a_v, a_s = normalized_lines(approximate_attention(q, k, last_q=64, scale=0.125))
    for got, want in ((vertical, a_v), (slash, a_s)):
        shares = got.double() / got.double().sum(-1, keepdim=True)
        assert float((shares - want).abs().max()) < 1e-6
        assert float((shares.cumsum(-1) - want.cumsum(-1)).abs().max()) < MASS_TOLERANCE / 10


def test_cover_tie_check_accepts_ties_and_rejects_real_differences() -> None:
    s = torch.tensor([[0.4, 0.2, 0.2, 0.2]], dtype=torch.float64)
    none = torch.zeros(4, dtype=torch.bool)
    # gamma 0.6: 0.4 and one of the tied 0.2s; the reference takes index 1, index 3 is a tie.
    assert cover_threshold(s, 0.6, none).tolist() == [[True, True, False, False]]
    check_cover_modulo_ties(s, torch.tensor([[True, False, False, True]]), gamma=0.6, forced=none,
                            what="t")
    with pytest.raises(AssertionError, match="exceeds"):
        check_cover_modulo_ties(s, torch.tensor([[False, True, True, True]]), gamma=0.6,
                                forced=none, what="t")
    with pytest.raises(AssertionError, match="not needed"):
        check_cover_modulo_ties(s, torch.tensor([[True, True, True, False]]), gamma=0.55, forced=none,
                                what="t")
    with pytest.raises(AssertionError, match="below gamma"):
        check_cover_modulo_ties(s, torch.tensor([[True, False, False, False]]), gamma=0.6,
                                forced=none, what="t")
    with pytest.raises(AssertionError, match="forced"):
        check_cover_modulo_ties(s, torch.tensor([[True, True, False, False]]), gamma=0.6,
                                forced=torch.tensor([False, False, False, True]), what="t")
    # A cumulative share within the mass margin of gamma may stop either side of it.
    check_cover_modulo_ties(s, torch.tensor([[True, True, False, False]]), gamma=0.6 + 1e-6,
                            forced=none, what="t")
    check_cover_modulo_ties(s, torch.tensor([[True, True, True, False]]), gamma=0.8 + 1e-6 - 0.2,
                            forced=none, what="t")


def test_flexprefill_vs_tie_check() -> None:
    q, k, _ = _inputs(1, 2, 1, 64, 16, seed=2, peak=3.0)
    params: dict[str, object] = dict(gamma=0.9, last_q=8, block_m=16, block_n=16, line_block=1)
    plan = fast.flexprefill_vs_plan(q, k, **params)  # type: ignore[arg-type]
    flexprefill_vs_tie_check(q, k, params, plan, plan)
    wrong = fast.flexprefill_vs_plan(q, k, **{**params, "gamma": 0.0, "local_diagonals": 0})  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="Alg. 4"):
        flexprefill_vs_tie_check(q, k, params, plan, wrong)


# -- bad inputs ------------------------------------------------------------------------


BAD = [
    ({"gamma": 1.5}, ValueError, "gamma"),
    ({"gamma": -0.1}, ValueError, "gamma"),
    ({"gamma": math.nan}, ValueError, "gamma"),
    ({"gamma": "0.9"}, TypeError, "gamma"),
    ({"last_q": 0}, ValueError, "last_q"),
    ({"init_columns": -1}, ValueError, "init_columns"),
    ({"local_diagonals": -1}, ValueError, "local_diagonals"),
    ({"block_n": 0}, ValueError, "block_n"),
    ({"line_block": 0}, ValueError, "line_block"),
    ({"line_block": 2.0}, TypeError, "line_block"),
]


@pytest.mark.parametrize("pkg", [reference, fast], ids=["reference", "fast"])
def test_bad_parameters_raise(pkg: object) -> None:
    q, k, v = _inputs(1, 2, 1, 32, 16)
    for change, error, name in BAD:
        with pytest.raises(error, match=name):
            pkg.flexprefill_vs_plan(q, k, **change)  # type: ignore[attr-defined]
        with pytest.raises(error, match=name):
            pkg.flexprefill_vs(q, k, v, **change)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="k must have shape"):
        pkg.flexprefill_vs_plan(q, k[:, :, :16])  # type: ignore[attr-defined]


def test_fast_rejects_float32_and_odd_blocks() -> None:
    q, k, _ = _inputs(1, 1, 1, 32, 16, torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        fast.flexprefill_vs_plan(q, k)
    q, k, _ = _inputs(1, 1, 1, 32, 16)
    with pytest.raises(ValueError, match="block"):
        fast.flexprefill_vs_plan(q, k, block_m=24)


# -- hostile inputs --------------------------------------------------------------------


def test_cover_threshold_ranks_nan_last() -> None:
    scores = torch.tensor([0.1, math.nan, 0.6, 0.3], dtype=torch.float64)
    kept = cover_threshold(scores, 0.85, torch.zeros(4, dtype=torch.bool))
    assert kept.tolist() == [False, False, True, True]
    # A forced NaN ranks first and stops the cumulative sum: only the forced entries.
    forced = torch.tensor([False, True, False, False])
    assert cover_threshold(scores, 0.85, forced).tolist() == [False, True, False, False]
    # Every share NaN (NaN in the estimated rows of q): only the forced entries.
    nan = torch.full((4,), math.nan, dtype=torch.float64)
    assert cover_threshold(nan, 0.9, forced).tolist() == [False, True, False, False]


@pytest.mark.parametrize("pkg", [reference, fast], ids=["reference", "fast"])
def test_nan_keeps_forced_lines(pkg: object) -> None:
    """NaN in k (one key) or in an estimated query row: the first columns and the nearest
    diagonals stay in the plan (NaN shares rank last); fast and reference agree."""
    q, k, _ = _inputs(2, 4, 2, 96, 32, seed=3, peak=2.0)
    k_nan = k.clone()
    k_nan[:, :, 50] = math.nan
    q_nan = q.clone()
    q_nan[0, 0, 90] = math.nan
    params: dict[str, object] = dict(gamma=0.9, last_q=16, block_m=16, block_n=16, init_columns=3,
                                     local_diagonals=2)
    rows = torch.arange(96)
    for qq, kk in ((q, k_nan), (q_nan, k)):
        plan = pkg.flexprefill_vs_plan(qq, kk, **params)  # type: ignore[attr-defined]
        dense = plan.to_dense_mask()
        assert bool(dense[..., 3:, :3].all()), "forced first columns dropped"
        assert bool(dense[..., rows, rows].all()) and bool(dense[..., rows[1:], rows[:-1]].all()), \
            "forced nearest diagonals dropped"
        if pkg is fast:
            expected = reference.flexprefill_vs_plan(qq, kk, **params)  # type: ignore[arg-type]
            if not expected.equal(plan):
                flexprefill_vs_tie_check(qq, kk, params, expected, plan)


@pytest.mark.parametrize("pkg", [reference, fast], ids=["reference", "fast"])
def test_huge_counts_mean_everything(pkg: object) -> None:
    q, k, _ = _inputs(1, 2, 1, 40, 16, seed=4)
    for name in ("last_q", "init_columns", "local_diagonals"):
        base = pkg.flexprefill_vs_plan(q, k, block_m=16, block_n=16, **{name: 160})  # type: ignore[attr-defined]
        huge = pkg.flexprefill_vs_plan(q, k, block_m=16, block_n=16, **{name: 2**63})  # type: ignore[attr-defined]
        assert huge.equal(base), name
    with pytest.raises(ValueError, match="block_m"):
        pkg.flexprefill_vs_plan(q, k, block_m=2**20)  # type: ignore[attr-defined]
