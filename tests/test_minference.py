"""MInference methods: vertical-slash, block-sparse, A-shape (reference steps, fast kernels).

Hand-checked tiny cases of each algorithm step, then fast against reference:
integer things (lines, plans) exactly on inputs whose scores are far from any
tie, float things under `conformance.tolerance`. Sizes stay tiny: the fast
kernels run in Triton's CPU interpreter here.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from sparseprefill import fast, reference  # noqa: E402
from sparseprefill.conformance import tolerance  # noqa: E402
from sparseprefill.conformance.ties import (  # noqa: E402
    block_sparse_tie_check,
    check_topk_modulo_ties,
    line_tolerance,
    vertical_slash_tie_check,
)
from sparseprefill.fast.block_sparse import mean_pooling as fast_mean_pooling  # noqa: E402
from sparseprefill.fast.kernels.vertical_slash_index import (  # noqa: E402
    index_width_bound,
)
from sparseprefill.fast.kernels.vertical_slash_index import (  # noqa: E402
    vertical_slash_index as fast_index,
)
from sparseprefill.fast.vertical_slash import (  # noqa: E402
    plan_nbytes,
)
from sparseprefill.fast.vertical_slash import (  # noqa: E402
    vertical_slash_lines as fast_lines,
)
from sparseprefill.fast.vertical_slash import (  # noqa: E402
    vertical_slash_scores as fast_scores,
)
from sparseprefill.reference.block_sparse import (  # noqa: E402
    argtopk_blocks,
    block_scores,
    mean_pooling,
)
from sparseprefill.reference.minference import HeadPattern, MInferenceConfig, kernel_cost  # noqa: E402
from sparseprefill.reference.plan import BlockColumnPlan  # noqa: E402
from sparseprefill.reference.vertical_slash import (  # noqa: E402
    approximate_attention,
    argtopk,
    kept_lines,
    sum_slash,
    sum_vertical,
    vertical_slash_index,
    vertical_slash_lines,
    vertical_slash_scores,
)


def _lists(plan: BlockColumnPlan, b: int = 0, h: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    blocks = [plan.block_index[b, h, i, : int(plan.block_count[b, h, i])].tolist()
              for i in range(plan.num_query_blocks)]
    cols = [plan.column_index[b, h, i, : int(plan.column_count[b, h, i])].tolist()
            for i in range(plan.num_query_blocks)]
    return blocks, cols


def _inputs(b: int, hq: int, hkv: int, n: int, d: int, dtype: torch.dtype = torch.float16,
            seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    return q, k, v


def _alg4_literal(verticals: list[int], slashes: list[int], n: int, bm: int, bn: int
                  ) -> tuple[list[list[int]], list[list[int]]]:
    """Alg. 4 read literally for one head: merge slash ranges, then emit uncovered points."""
    blocks_out, cols_out = [], []
    for r0 in range(0, n, bm):
        r1 = min(r0 + bm, n)
        ranges = sorted((max(r0 - o, 0), r1 - o) for o in slashes if o <= r1 - 1)
        merged: list[list[int]] = []
        for start, stop in ranges:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], stop)
            else:
                merged.append([start, stop])
        blocks = sorted({c // bn for start, stop in merged for c in range(start, stop)})
        cols = [v for v in sorted(verticals) if v <= r1 - 1 and v // bn not in blocks]
        blocks_out.append(blocks)
        cols_out.append(cols)
    return blocks_out, cols_out


def _planted_inputs(dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """N = 64, D = 16: the last 4 queries attend to key 7 and to the key 5 before them.

    Each of those rows splits its mass evenly between key 7 (one vertical line) and
    key `row - 5` (one slash at offset 5); every other key gets ~exp(-25).
    """
    n, d = 64, 16
    q = torch.zeros(1, 1, n, d)
    k = torch.zeros(1, 1, n, d)
    q[0, 0, n - 4:, 0] = 10.0
    q[0, 0, n - 4:, 1] = 10.0
    k[0, 0, 7, 0] = 1.0
    k[0, 0, n - 9: n - 5, 1] = 1.0
    return q.to(dtype), k.to(dtype)


# -- reference steps, by hand ----------------------------------------------------


def test_sums_by_hand() -> None:
    """`sum_vertical` / `sum_slash` of a 2 x 4 A_hat (rows 2 and 3 of N = 4)."""
    a_hat = torch.tensor([[[[0.5, 0.25, 0.25, 0.0],
                            [0.1, 0.2, 0.3, 0.4]]]], dtype=torch.float64)
    assert sum_vertical(a_hat)[0, 0].tolist() == pytest.approx([0.6, 0.45, 0.55, 0.4])
    # Row 2: offsets 2, 1, 0 hold 0.5, 0.25, 0.25; row 3: offsets 3, 2, 1, 0 hold 0.1 .. 0.4.
    assert sum_slash(a_hat)[0, 0].tolist() == pytest.approx([0.25 + 0.4, 0.25 + 0.3, 0.5 + 0.2, 0.1])


def test_approximate_attention_all_rows_is_causal_softmax() -> None:
    q, k, _ = _inputs(1, 2, 1, 9, 8, torch.float64)
    a_hat = approximate_attention(q, k, last_q=100, scale=0.3)
    scores = (q @ k.transpose(-1, -2)) * 0.3
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    want = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)
    torch.testing.assert_close(a_hat, want, rtol=0, atol=1e-15)


def test_argtopk_forced_budget_and_ties() -> None:
    scores = torch.tensor([[[0.0, 5.0, 1.0, 1.0, 1.0, 3.0]]], dtype=torch.float64)
    # Budget 4, 1 forced (index 0): 5.0, 3.0, then the tie 1.0 x 3 goes to index 2.
    assert argtopk(scores, 4, 1).tolist() == [[[0, 1, 2, 5]]]
    # More forced than the budget: all forced are kept (kept_lines raises the count).
    count = kept_lines(2, 3, 6)
    assert count == 3
    assert argtopk(scores, count, 3).tolist() == [[[0, 1, 2]]]
    assert kept_lines(100, 30, 6) == 6


def test_lines_and_plan_on_planted_inputs() -> None:
    """A 4-block example where one vertical (key 7) and one slash (offset 5) win."""
    q, k = _planted_inputs(torch.float64)
    verticals, slashes = vertical_slash_lines(q, k, vertical_size=1, slash_size=1, last_q=4,
                                              init_columns=0, local_diagonals=0)
    assert verticals.tolist() == [[[7]]] and slashes.tolist() == [[[5]]]
    plan = reference.vertical_slash_plan(q, k, vertical_size=1, slash_size=1, last_q=4,
                                         block_m=16, block_n=16, init_columns=0, local_diagonals=0)
    # Offset 5 reaches keys [16i - 5, 16i + 11): blocks i - 1 and i. Key 7 is a column
    # once block 0 is no longer kept.
    assert _lists(plan) == ([[0], [0, 1], [1, 2], [2, 3]], [[], [], [7], [7]])


def test_index_by_hand() -> None:
    """N = 10, 4 x 4 blocks, slashes {0, 6}, verticals {5, 9}."""
    verticals = torch.tensor([[[5, 9]]], dtype=torch.int32)
    slashes = torch.tensor([[[0, 6]]], dtype=torch.int32)
    want = ([[0], [0, 1], [0, 2]], [[], [], [5]])
    assert _alg4_literal([5, 9], [0, 6], 10, 4, 4) == want
    assert _lists(vertical_slash_index(verticals, slashes, seqlen=10, block_m=4, block_n=4)) == want
    plan = fast_index(verticals, slashes, seqlen=10, block_m=4, block_n=4).validate()
    # fast shares the causal prefix of the verticals: 5 lies in listed block 1 of query
    # block 1, 9 in listed block 2 of query block 2; `equal` sees the same plan.
    assert _lists(plan) == (want[0], [[], [5], [5, 9]])
    assert plan.column_index.stride(2) == 0
    assert plan.equal(vertical_slash_index(verticals, slashes, seqlen=10, block_m=4, block_n=4))
    row9 = plan.to_dense_mask()[0, 0, 9].nonzero().flatten().tolist()
    assert row9 == [0, 1, 2, 3, 5, 8, 9]


def test_block_sparse_steps_by_hand() -> None:
    x = torch.arange(10, dtype=torch.float64).reshape(1, 1, 10, 1)
    # Blocks of 4: [0..3], [4..7], and the partial [8, 9] averaged over its 2 tokens.
    assert mean_pooling(x, 4).flatten().tolist() == [1.5, 5.5, 8.5]
    assert fast_mean_pooling(x.to(torch.float16), 4).flatten().tolist() == [1.5, 5.5, 8.5]
    scores = block_scores(mean_pooling(x, 4), mean_pooling(x, 4))
    assert torch.isinf(scores[0, 0, 0, 1]) and scores[0, 0, 1, 0] == 1.5 * 5.5
    # All scores equal: the diagonal plus the lowest other index.
    flat = torch.zeros(1, 1, 4, 4, dtype=torch.float64).masked_fill(
        ~torch.ones(4, 4, dtype=torch.bool).tril(), -math.inf)
    keep = argtopk_blocks(flat, 2)
    assert keep[0, 0].nonzero().tolist() == [[0, 0], [1, 0], [1, 1], [2, 0], [2, 2], [3, 0], [3, 3]]


# -- fast against reference --------------------------------------------------------


@pytest.mark.parametrize("by", ["walk", "blocks"])
def test_index_kernel_matches_reference_and_literal(monkeypatch: pytest.MonkeyPatch, by: str) -> None:
    """Both ways of building the slash blocks (`INDEX_BY`: Alg. 4's walk over the slashes,
    the key-block walk over a prefix count of offsets) give the reference's lists."""
    import sparseprefill.fast.kernels.vertical_slash_index as vsi

    monkeypatch.setattr(vsi, "INDEX_BY", by)
    gen = torch.Generator().manual_seed(3)
    cases = [(37, 16, 16, 5, 9), (100, 32, 16, 20, 3), (130, 16, 48, 7, 30), (64, 64, 64, 64, 64)]
    for n, bm, bn, kv, ks in cases:
        v = torch.stack([torch.randperm(n, generator=gen)[:kv] for _ in range(2)]).sort(-1).values
        s = torch.stack([torch.randperm(n, generator=gen)[:ks] for _ in range(2)]).sort(-1).values
        v, s = v.reshape(2, 1, kv).int(), s.reshape(2, 1, ks).int()
        got = fast_index(v, s, seqlen=n, block_m=bm, block_n=bn).validate()
        want = vertical_slash_index(v, s, seqlen=n, block_m=bm, block_n=bn)
        assert got.equal(want), (n, bm, bn, kv, ks)
        for b in range(2):
            literal = _alg4_literal(v[b, 0].tolist(), s[b, 0].tolist(), n, bm, bn)
            assert _lists(want, b) == literal, (n, bm, bn, kv, ks, b)


def test_index_kernel_skips_unreached_slashes_over_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bisection start (`SKIP_UNREACHED`) over several chunks, the walk starting inside
    one: the same plan as the full walk and as the reference (slashes at and around each
    query block's last row, padding N)."""
    import sparseprefill.fast.kernels.vertical_slash_index as vsi

    monkeypatch.setattr(vsi, "_CHUNK", 2)
    n, bm, bn = 90, 16, 16
    # Query block 2 (rows 32-47) meets key block 0 only through offset 47, on its last row.
    s = torch.tensor([0, 1, 15, 47, 50, 63, 80, 89, 90, 90], dtype=torch.int32).reshape(1, 1, -1)
    v = torch.tensor([[[3, 40]]], dtype=torch.int32)
    want = vertical_slash_index(v, s.clamp(max=n - 1).unique().reshape(1, 1, -1), seqlen=n, block_m=bm, block_n=bn)
    plans = []
    for skip in (True, False):
        monkeypatch.setattr(vsi, "SKIP_UNREACHED", skip)
        plans.append(fast_index(v, s, seqlen=n, block_m=bm, block_n=bn).validate())
    assert plans[0].equal(plans[1]) and plans[0].equal(want)
    assert _lists(plans[0])[0] == _lists(plans[1])[0]


@pytest.mark.parametrize("config", [(16, 32, 4, 2, 2)])
def test_fast_slash_scores_at_other_tiles(monkeypatch: pytest.MonkeyPatch,
                                          config: tuple[int, int, int, int, int]) -> None:
    """`SLASH_CONFIG` changes the slash kernel's tile and skew, not its sums (last_q 40: rows
    in steps of 16, one partial; 32 offsets a tile; the memory skew with 2 programs per
    head, each walking several offset tiles through one scratch slot)."""
    import sparseprefill.fast.kernels.last_q_estimate as lq

    monkeypatch.setattr(lq, "SLASH_CONFIG", config)
    q, k, _ = _inputs(1, 2, 1, 97, 32, torch.float16, seed=5)
    _, slash = fast_scores(q, k, last_q=40)
    _, ref_slash = vertical_slash_scores(q, k, last_q=40)
    assert (slash.double() - ref_slash).abs().max() < line_tolerance(40) / 10


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("last_q", [16, 70, 500])
def test_fast_scores(dtype: torch.dtype, last_q: int) -> None:
    q, k, _ = _inputs(1, 2, 1, 97, 32, dtype, seed=last_q)
    vertical, slash = fast_scores(q, k, last_q=last_q)
    ref_vertical, ref_slash = vertical_slash_scores(q, k, last_q=last_q)
    tol = line_tolerance(min(last_q, 97))
    assert (vertical.double() - ref_vertical).abs().max() < tol / 10
    assert (slash.double() - ref_slash).abs().max() < tol / 10


def _topk_margin(scores: torch.Tensor, count: int, forced: int) -> float:
    """Smallest gap between the last kept and the first dropped free score (inf if none)."""
    free = scores[..., forced:]
    count -= min(forced, scores.shape[-1])
    if count <= 0 or count >= free.shape[-1]:
        return math.inf
    top = free.sort(dim=-1, descending=True).values
    return float((top[..., count - 1] - top[..., count]).min())


VS_CASES = [
    # (B, Hq, Hkv, N, D, params)
    (2, 2, 1, 100, 32, dict(vertical_size=12, slash_size=9, last_q=16, block_m=32, block_n=16,
                           init_columns=3, local_diagonals=2)),
    (1, 4, 2, 75, 64, dict(vertical_size=5, slash_size=20, last_q=200, block_m=16, block_n=64,
                          init_columns=0, local_diagonals=0)),
    (1, 2, 2, 130, 16, dict(vertical_size=40, slash_size=4, last_q=64, block_m=64, block_n=32)),
]


@pytest.mark.parametrize("case", range(len(VS_CASES)))
def test_vertical_slash_fast_matches_reference(case: int) -> None:
    b, hq, hkv, n, d, params = VS_CASES[case]
    q, k, v = _inputs(b, hq, hkv, n, d, seed=case)
    init = int(params.get("init_columns", 30))
    local = int(params.get("local_diagonals", 100))
    last_q = int(params["last_q"])
    # Tie-free inputs: the kept/dropped boundary is above `line_tolerance`, itself ~400x the estimate's rounding.
    ref_vertical, ref_slash = vertical_slash_scores(q, k, last_q=last_q)
    tol = line_tolerance(min(last_q, n))
    assert _topk_margin(ref_vertical, kept_lines(int(params["vertical_size"]), init, n), init) > tol
    assert _topk_margin(ref_slash, kept_lines(int(params["slash_size"]), local, n), local) > tol

    lines = fast_lines(q, k, **{key: params[key] for key in params if key not in ("block_m", "block_n")})
    want_lines = vertical_slash_lines(q, k, **{key: params[key] for key in params
                                               if key not in ("block_m", "block_n")})
    assert torch.equal(lines[0], want_lines[0]) and torch.equal(lines[1], want_lines[1])
    want = reference.vertical_slash_plan(q, k, **params)
    got = fast.vertical_slash_plan(q, k, **params).validate()
    assert got.equal(want)
    assert torch.equal(got.to_dense_mask(), want.to_dense_mask())

    mask = want.to_dense_mask()
    golden = tolerance.golden_attention(q, k, v, mask)
    baseline = tolerance.baseline_attention(q, k, v, mask)
    tolerance.check_output(fast.vertical_slash(q, k, v, **params), golden[0], baseline[0])
    torch.testing.assert_close(reference.vertical_slash(*tolerance.upcast(q, k, v), **params), golden[0],
                               rtol=0, atol=1e-12)


def test_vertical_slash_head_groups_match_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """With small plan budgets, heads run in groups (1 query head, then 1 KV head): same output."""
    q, k, v = _inputs(1, 4, 2, 64, 32, seed=9)
    params = dict(vertical_size=6, slash_size=5, last_q=16, block_m=16, block_n=16)
    whole = fast.vertical_slash(q, k, v, **params)
    # The package exports a function of the module's name: fetch the module itself.
    module = importlib.import_module("sparseprefill.fast.vertical_slash")
    width = fast.vertical_slash_plan(q, k, **params).block_index.shape[3]
    per_head = plan_nbytes(1, 1, 64, block_m=16, block_width=width, n_vertical=kept_lines(6, 30, 64))
    for budget, heads in ((1, 1), (3 * per_head, 2)):
        assert module.head_group(4, 2, budget // per_head) == heads
        monkeypatch.setattr(module, "PLAN_BYTES", budget)
        assert torch.equal(whole, fast.vertical_slash(q, k, v, **params))
    assert module.head_group(32, 4, 0) == 1 and module.head_group(32, 6, 5) == 3


def test_block_sparse_fast_matches_reference() -> None:
    q, k, v = _inputs(2, 4, 2, 150, 32, seed=5)
    for top_k, block_size in ((3, 32), (1, 16), (20, 64)):
        want = reference.block_sparse_plan(q, k, top_k=top_k, block_size=block_size)
        got = fast.block_sparse_plan(q, k, top_k=top_k, block_size=block_size).validate()
        assert got.equal(want), (top_k, block_size)
        counts = want.block_count[0, 0].tolist()
        assert counts == [min(top_k, i + 1) for i in range(len(counts))]
    mask = want.to_dense_mask()
    golden = tolerance.golden_attention(q, k, v, mask)
    baseline = tolerance.baseline_attention(q, k, v, mask)
    tolerance.check_output(fast.block_sparse(q, k, v, top_k=20, block_size=64), golden[0], baseline[0])


def test_a_shape_is_streaming_with_minference_defaults() -> None:
    q, k, _ = _inputs(1, 2, 1, 100, 16)
    for pkg in (reference, fast):
        plan = pkg.a_shape_plan(q, k, sink=20, window=30, block_m=16, block_n=32)
        assert plan.equal(pkg.streaming_plan(q, k, sink=20, window=30, block_m=16, block_n=32))
        default = pkg.a_shape_plan(q, k)
        assert (default.block_m, default.block_n) == (64, 64)
        assert default.equal(pkg.streaming_plan(q, k, sink=1024, window=4096, block_m=64, block_n=64))


# -- ties ----------------------------------------------------------------------------


def test_topk_modulo_ties() -> None:
    scores = torch.tensor([[[0.0, 5.0, 1.0, 1.0, 3.0]]], dtype=torch.float64)
    picked = torch.tensor([[[0, 1, 4]]])
    check_topk_modulo_ties(scores, picked, count=3, forced=1, tolerance=1e-9, what="lines")
    for tied in ([[[1, 2, 4]]], [[[1, 3, 4]]]):
        check_topk_modulo_ties(scores, torch.tensor(tied), count=3, forced=0, tolerance=1e-9, what="lines")
    with pytest.raises(AssertionError, match="exceeds"):
        check_topk_modulo_ties(scores, torch.tensor([[[0, 1, 2]]]), count=3, forced=1, tolerance=1e-9,
                               what="lines")
    with pytest.raises(AssertionError, match="forced"):
        check_topk_modulo_ties(scores, torch.tensor([[[1, 2, 4]]]), count=3, forced=1, tolerance=1e-9,
                               what="lines")


def test_block_sparse_tie_check() -> None:
    q, k, _ = _inputs(1, 2, 1, 64, 16, seed=2)
    params: dict[str, object] = {"top_k": 2, "block_size": 16}
    # Diagonal plus the block just before it, where the reference keeps block 0 on ties.
    keep = (torch.eye(4, dtype=torch.bool) | torch.ones(4, 4, dtype=torch.bool).tril(-1).triu(-1))
    other = BlockColumnPlan.from_masks(keep.expand(1, 2, 4, 4), None, seqlen=64, block_m=16, block_n=16)
    zeros = torch.zeros_like(q), torch.zeros_like(k)
    tied = reference.block_sparse_plan(*zeros, top_k=2, block_size=16)
    assert not tied.equal(other)
    block_sparse_tie_check(*zeros, params, tied, other)
    best = reference.block_sparse_plan(q, k, top_k=2, block_size=16)
    assert not best.equal(other)
    with pytest.raises(AssertionError, match="exceeds"):
        block_sparse_tie_check(q, k, params, best, other)


def test_vertical_slash_tie_check() -> None:
    q, k, _ = _inputs(1, 2, 1, 64, 16, seed=2)
    params: dict[str, object] = dict(vertical_size=4, slash_size=4, last_q=8, block_m=16, block_n=16,
                                     init_columns=1, local_diagonals=1)
    plan = fast.vertical_slash_plan(q, k, **params)  # type: ignore[arg-type]
    vertical_slash_tie_check(q, k, params, plan, plan)
    wrong = fast.vertical_slash_plan(q, k, **{**params, "slash_size": 8})  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="Alg. 4"):
        vertical_slash_tie_check(q, k, params, plan, wrong)


# -- bad inputs ------------------------------------------------------------------------


BAD_VS = [
    ({"vertical_size": 0}, ValueError, "vertical_size"),
    ({"slash_size": 0}, ValueError, "slash_size"),
    ({"last_q": 0}, ValueError, "last_q"),
    ({"init_columns": -1}, ValueError, "init_columns"),
    ({"local_diagonals": -2}, ValueError, "local_diagonals"),
    ({"block_m": 0}, ValueError, "block_m"),
    ({"vertical_size": 2.5}, TypeError, "vertical_size"),
]


@pytest.mark.parametrize("pkg", [reference, fast], ids=["reference", "fast"])
def test_bad_parameters_raise(pkg: object) -> None:
    q, k, v = _inputs(1, 2, 1, 32, 16)
    base: dict[str, object] = {"vertical_size": 4, "slash_size": 4}
    for change, error, name in BAD_VS:
        with pytest.raises(error, match=name):
            pkg.vertical_slash_plan(q, k, **{**base, **change})  # type: ignore[attr-defined]
        with pytest.raises(error, match=name):
            pkg.vertical_slash(q, k, v, **{**base, **change})  # type: ignore[attr-defined]
    for change, error, name in (({"top_k": 0}, ValueError, "top_k"),
                                ({"top_k": 2, "block_size": 0}, ValueError, "block_size")):
        with pytest.raises(error, match=name):
            pkg.block_sparse_plan(q, k, **change)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="window"):
        pkg.a_shape_plan(q, k, window=0)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="k must have shape"):
        pkg.vertical_slash_plan(q, k[:, :, :16], **base)  # type: ignore[attr-defined]


def test_fast_rejects_float32() -> None:
    q, k, _ = _inputs(1, 1, 1, 32, 16, torch.float32)
    with pytest.raises(TypeError, match="dtype"):
        fast.vertical_slash_plan(q, k, vertical_size=4, slash_size=4)
    with pytest.raises(TypeError, match="dtype"):
        fast.block_sparse_plan(q, k, top_k=2)


# -- memory --------------------------------------------------------------------------


def test_plan_width_bound_comes_from_parameters() -> None:
    """The data-free bound (used only under CUDA graph capture) and the plan size formula."""
    assert index_width_bound(6096, seqlen=1 << 20, block_m=64, block_n=64) == 12192
    assert index_width_bound(6096, seqlen=1 << 16, block_m=64, block_n=64) == 1024
    assert plan_nbytes(1, 1, 1 << 20, block_m=64, block_width=12192, n_vertical=1000) == (
        4 * (16384 * (12192 + 2) + 1000))


# -- per-head dispatch and the search (Alg. 1) ------------------------------------------


def _head(pattern: str, **params: int) -> HeadPattern:
    return HeadPattern(pattern, params)


MIXED = (
    _head("a_shape", sink=16, window=48, block_m=32, block_n=32),
    _head("vertical_slash", vertical_size=8, slash_size=12, init_columns=2, local_diagonals=4,
          last_q=16, block_m=32, block_n=32),
    _head("block_sparse", top_k=2, block_size=32),
    _head("a_shape", sink=16, window=48, block_m=32, block_n=32),
)


def test_config_json_round_trip_and_minference_files(tmp_path: Path) -> None:
    config = MInferenceConfig((MIXED, MIXED[::-1]))
    assert MInferenceConfig.from_json(config.to_json()) == config
    assert MInferenceConfig.load(config.save(tmp_path / "c.json")) == config
    theirs = json.dumps([{"1": ["vertical_and_slash", 30, 800, 7], "0": ["vertical_and_slash", 1000, 6096, 3]}])
    assert MInferenceConfig.from_json(theirs).layer(0) == (
        _head("vertical_slash", vertical_size=1000, slash_size=6096),
        _head("vertical_slash", vertical_size=30, slash_size=800))
    with pytest.raises(ValueError, match="vertical_and_slash"):
        MInferenceConfig.from_json(json.dumps([{"0": ["stream_llm", 100, 800, 1]}]))
    with pytest.raises(ValueError, match="format"):
        MInferenceConfig.from_json(json.dumps({"layers": []}))
    with pytest.raises(IndexError, match="layer 2"):
        config.layer(2)


def test_head_pattern_checks() -> None:
    assert _head("block_sparse", top_k=3).block_sizes() == (64, 64)
    assert {_head("a_shape"), _head("a_shape")} == {_head("a_shape")}
    with pytest.raises(ValueError, match="pattern"):
        _head("sliding")
    with pytest.raises(ValueError, match="no parameter"):
        _head("block_sparse", top_k=3, window=4)
    with pytest.raises(ValueError, match="slash_size"):
        _head("vertical_slash", vertical_size=3)
    with pytest.raises(TypeError, match="int"):
        HeadPattern("block_sparse", {"top_k": 2.0})  # type: ignore[dict-item]


def test_kernel_cost_by_hand() -> None:
    """N = 32, 16 x 16 blocks: block 0 for query block 0; block 1 + 3 columns for block 1."""
    blocks = torch.tensor([[[[True, False], [False, True]]]])
    columns = torch.zeros(1, 1, 2, 32, dtype=torch.bool)
    columns[0, 0, 1, [2, 5, 9]] = True
    plan = BlockColumnPlan.from_masks(blocks, columns, seqlen=32, block_m=16, block_n=16)
    # 16 rows x 16 keys, then 16 rows x (16 block keys + one 16-key column tile).
    assert kernel_cost(plan).tolist() == [[16 * 16 + 16 * 32]]


def test_minference_plan_gives_each_head_its_pattern() -> None:
    q, k, v = _inputs(1, 4, 2, 160, 32, seed=4)
    config = MInferenceConfig((MIXED,))
    want = reference.minference_plan(q, k, config)
    for h, head in enumerate(MIXED):
        own = getattr(reference, f"{head.pattern}_plan")(q, k, **head.params)
        assert torch.equal(want.to_dense_mask()[:, h], own.to_dense_mask()[:, h]), h
    got = fast.minference_plan(q, k, config).validate()
    assert got.equal(want)
    mask = want.to_dense_mask()
    golden = tolerance.golden_attention(q, k, v, mask)
    baseline = tolerance.baseline_attention(q, k, v, mask)
    tolerance.check_output(fast.minference(q, k, v, config), golden[0], baseline[0])
    torch.testing.assert_close(reference.minference(*tolerance.upcast(q, k, v), config), golden[0],
                               rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="4 heads"):
        reference.minference_plan(q[:, :2], k[:, :1], config)
    mixed_blocks = MInferenceConfig(((MIXED[0], _head("block_sparse", top_k=2, block_size=16)) * 2,))
    with pytest.raises(ValueError, match="block sizes"):
        reference.minference_plan(q, k, mixed_blocks)


def test_merge_keeps_shared_columns_and_the_disjoint_promise() -> None:
    """A layer mixing patterns: shared (stride-0) verticals stay shared in the merged
    plan, disjoint columns keep `columns_disjoint`, and the attention is unchanged."""
    from sparseprefill.fast.kernels.own_columns import disjoint_columns
    from sparseprefill.reference.minference import merge_head_plans

    q, k, v = _inputs(2, 4, 2, 300, 32, seed=9)
    shared_vs = fast_index(*fast_lines(q, k, vertical_size=12, slash_size=20), seqlen=300,
                           block_m=64, block_n=64)
    assert shared_vs.column_index.stride(2) == 0
    a_shape = reference.a_shape_plan(q, k, sink=64, window=64)
    owner = [0, 1, 1, 0]
    merged = merge_head_plans([shared_vs, a_shape], owner)
    assert merged.column_index.stride(2) == 0
    assert merged.nbytes() < merge_head_plans([shared_vs.with_disjoint_columns(), a_shape], owner).nbytes()
    assert not merged.columns_disjoint
    disjoint = merge_head_plans([disjoint_columns(shared_vs), a_shape], owner)
    assert disjoint.columns_disjoint and disjoint.validate().equal(merged.validate())
    mask = merged.to_dense_mask()
    for h, i in enumerate(owner):
        assert torch.equal(mask[:, h], [shared_vs, a_shape][i].to_dense_mask()[:, h])
    golden = tolerance.golden_attention(q, k, v, mask)
    baseline = tolerance.baseline_attention(q, k, v, mask)
    for plan in (merged, disjoint):
        tolerance.check_output(fast.sparse_attention(q, k, v, plan), golden[0], baseline[0])


def test_search_picks_per_head_at_equal_cost() -> None:
    """Head 0 attends to one far key (a vertical line), head 1 locally: the search sees it."""
    n, d = 256, 16
    q = torch.zeros(1, 2, n, d, dtype=torch.float64)
    k = torch.zeros(1, 2, n, d, dtype=torch.float64)
    v = torch.randn(1, 2, n, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q[0, 0, :, 0] = 40.0
    k[0, 0, 100, 0] = 1.0
    pos = torch.arange(n, dtype=torch.float64)
    q[0, 1, :, 1], q[0, 1, :, 2] = 12.0 * torch.cos(pos / 40), 12.0 * torch.sin(pos / 40)
    k[0, 1, :, 1], k[0, 1, :, 2] = torch.cos(pos / 40), torch.sin(pos / 40)
    candidates = (
        _head("a_shape", sink=16, window=48, block_m=16, block_n=16),
        _head("vertical_slash", vertical_size=4, slash_size=50, init_columns=0, local_diagonals=8,
              block_m=16, block_n=16),
        _head("block_sparse", top_k=1, block_size=16),
    )
    target = float(kernel_cost(reference.a_shape_plan(q, k, sink=16, window=48, block_m=16,
                                                      block_n=16)).mean())
    result = reference.search_patterns(q, k, v, candidates=candidates, target=target, tolerance=0.1)
    assert result.target == target and result.errors.shape == (3, 2)
    assert result.patterns[0].pattern != "a_shape"
    assert float(result.errors[0, 0]) > 10 * float(result.errors[:, 0].min())
    for c, head in enumerate(result.candidates):
        out = getattr(reference, head.pattern)(q, k, v, **head.params)
        dense = reference.attention(q, k, v)
        err = (out - dense)[0, 1].norm() / dense[0, 1].norm()
        assert float(result.errors[c, 1]) == pytest.approx(float(err), rel=1e-9)
    assert result.patterns == tuple(result.candidates[int(c)] for c in result.errors.argmin(dim=0))
    # Block-sparse was resized from top_k = 1 toward the target cost.
    assert result.candidates[2].params["top_k"] > 1


# -- on a GPU (run with TRITON_INTERPRET=0; skipped on CPU) ----------------------------

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1",
    reason="needs a CUDA GPU and TRITON_INTERPRET=0",
)


@needs_gpu
@pytest.mark.parametrize("n", [4097, 32768, 131072])
def test_gpu_estimate_index_and_output(n: int) -> None:
    """Long N on the GPU: scores vs float64, plan vs reference Alg. 4, output vs golden."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    b, hq, hkv, d = 1, 4, 2, 128
    q = torch.randn(b, hq, n, d, device="cuda", generator=gen).to(torch.bfloat16)
    k = torch.randn(b, hkv, n, d, device="cuda", generator=gen).to(torch.bfloat16)
    v = torch.randn(b, hkv, n, d, device="cuda", generator=gen).to(torch.bfloat16)
    vertical, slash = fast_scores(q, k, last_q=64)
    ref_vertical, ref_slash = vertical_slash_scores(q, k, last_q=64)
    assert float((vertical.double() - ref_vertical).abs().max()) < line_tolerance(64) / 10
    assert float((slash.double() - ref_slash).abs().max()) < line_tolerance(64) / 10

    params = dict(vertical_size=1000, slash_size=6096)
    verticals, slashes = fast_lines(q, k, **params)
    plan = fast_index(verticals, slashes, seqlen=n, block_m=64, block_n=64).validate()
    if n <= 32768:
        want = vertical_slash_index(verticals, slashes, seqlen=n, block_m=64, block_n=64)
        assert plan.equal(want)
        mask = plan.to_dense_mask()
        golden = tolerance.golden_attention(q, k, v, mask)
        baseline = tolerance.baseline_attention(q, k, v, mask)
        tolerance.check_output(fast.vertical_slash(q, k, v, **params), golden[0], baseline[0])
