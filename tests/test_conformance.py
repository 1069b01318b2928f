"""The conformance properties on CPU (Triton interpreter), small sizes.

The same properties the GPU runner checks at N up to 16K (`python -m
sparseprefill.conformance --device cuda`), here with N <= 200 and a few examples
each, for every registered method and for the kernel on random plans and masks.
Also: the tolerance policy itself rejects what it must, and the runner works.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import EXAMPLES
from sparseprefill import fast, reference
from sparseprefill.conformance import METHODS
from sparseprefill.conformance import __main__ as runner
from sparseprefill.conformance import properties as props
from sparseprefill.conformance import tolerance
from sparseprefill.conformance.strategies import Caps, Shape, draw_plan

PER_METHOD = [p for p in props.PROPERTIES if p.per_method]
KERNEL = [p for p in props.PROPERTIES if not p.per_method]


@pytest.mark.parametrize("method,prop", [(spec.name, prop) for prop in PER_METHOD for spec in prop.cases(METHODS)],
                         ids=lambda x: x if isinstance(x, str) else x.name)
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_method_property(cpu_caps: Caps, method: str, prop: props.Property, data: Any) -> None:
    prop.run(data.draw, cpu_caps, METHODS[method])


@pytest.mark.parametrize("prop", KERNEL, ids=lambda p: p.name)
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_kernel_property(cpu_caps: Caps, prop: props.Property, data: Any) -> None:
    prop.run(data.draw, cpu_caps, None)


# -- the policy rejects what it must --------------------------------------------


def _inputs(n: int = 40, dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(1)
    return tuple(torch.randn(1, 2, n, 32, generator=gen).to(dtype) for _ in range(3))


def test_policy_rejects_nan_and_misplaced_inf() -> None:
    q, k, v = _inputs()
    golden = tolerance.golden_attention(q, k, v, None)
    baseline = tolerance.baseline_attention(q, k, v, None)
    out = golden[0].to(q.dtype)
    assert tolerance.check_attention(out, golden[1], golden, baseline) <= 1.0
    bad = out.clone()
    bad[0, 1, 7, 3] = math.nan
    with pytest.raises(AssertionError, match="non-finite"):
        tolerance.check_attention(bad, golden[1], golden, baseline)
    lse = golden[1].clone()
    lse[0, 0, 5] = -math.inf
    with pytest.raises(AssertionError, match="-inf"):
        tolerance.check_lse(lse, golden[1], baseline[1])
    lse[0, 0, 5] = math.nan
    with pytest.raises(AssertionError, match="NaN"):
        tolerance.check_lse(lse, golden[1], baseline[1])


def test_policy_rejects_one_dropped_key() -> None:
    """An output that misses a single key of one row fails the policy, with numbers."""
    q, k, v = _inputs()
    golden = tolerance.golden_attention(q, k, v, None)
    baseline = tolerance.baseline_attention(q, k, v, None)
    mask = torch.ones(40, 40, dtype=torch.bool)
    mask[30, 29] = False
    wrong = fast.attention(q, k, v, mask, return_lse=True)
    with pytest.raises(AssertionError, match=r"max abs error .* allowed"):
        tolerance.check_attention(wrong[0], wrong[1], golden, baseline)


def test_policy_empty_rows_must_be_zero() -> None:
    q, k, v = _inputs(8)
    mask = torch.ones(8, 8, dtype=torch.bool)
    mask[3] = False
    golden = tolerance.golden_attention(q, k, v, mask)
    baseline = tolerance.baseline_attention(q, k, v, mask)
    assert golden[1][0, 0, 3] == -math.inf and bool((golden[0][:, :, 3] == 0).all())
    assert bool(torch.isfinite(baseline[0]).all())
    out = golden[0].to(q.dtype).clone()
    out[0, 0, 3, 0] = 1e-3
    with pytest.raises(AssertionError, match="exactly 0"):
        tolerance.check_attention(out, golden[1], golden, baseline)


def test_recall_check_catches_wrong_plan() -> None:
    """Recall of a plan differing from the reference's by one column fails the check."""
    q, k, _ = _inputs(64)
    shape = Shape(batch=1, kv_heads=2, group=1, seqlen=64, head_dim=32)
    blocks = torch.ones(1, 2, 4, 4, dtype=torch.bool)
    plan = reference.BlockColumnPlan.from_masks(blocks, None, seqlen=64, block_m=16, block_n=16)
    blocks[0, 0, 3, 1] = False
    cols = torch.zeros(1, 2, 4, 64, dtype=torch.bool)
    cols[0, 0, 3, 16:31] = True  # block 1 of query block 3, less key 31
    other = reference.BlockColumnPlan.from_masks(blocks, cols, seqlen=64, block_m=16, block_n=16)
    assert shape.q_heads == plan.num_heads
    with pytest.raises(AssertionError, match="recall"):
        props.check_recall_density(q, k, other, expected_selection=plan)


def test_plan_check_names_the_difference() -> None:
    blocks = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    a = reference.BlockColumnPlan.from_masks(blocks, None, seqlen=32, block_m=16, block_n=16)
    blocks[0, 0, 1, 0] = False
    b = reference.BlockColumnPlan.from_masks(blocks, None, seqlen=32, block_m=16, block_n=16)
    with pytest.raises(AssertionError, match=r"block lists differ at .*\(0, 0, 1\).*\[1\].*\[0, 1\]"):
        props.check_plans_equal(a, b)
    props.check_plans_equal(a, a)


def test_baseline_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    """The baseline works a chunk of query rows at a time at long N; chunks change nothing
    (fp32 log-sum-exps may differ in the last bit, so only their -inf rows are compared)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 77, 32, generator=gen).half()
    k, v = (torch.randn(2, 2, 77, 32, generator=gen).half() for _ in range(2))
    mask = torch.rand(2, 4, 77, 77, generator=gen) < 0.5
    mask[:, :, 5] = False
    whole = tolerance.baseline_attention(q, k, v, mask)
    monkeypatch.setattr(tolerance, "_CHUNK_BYTES", 2 * 4 * 77 * 4 * 3)
    chunked = tolerance.baseline_attention(q, k, v, mask)
    assert torch.equal(whole[0], chunked[0])
    assert torch.equal(whole[1] == -math.inf, chunked[1] == -math.inf)
    assert bool((whole[1][:, :, 5] == -math.inf).all())


def test_nan_poisoning_reaches_fast_outputs() -> None:
    with props.nan_poisoned_empty():
        x = torch.empty(3, dtype=torch.float16)
        i = torch.empty(3, dtype=torch.int32)
    assert bool(torch.isnan(x).all()) and i.dtype == torch.int32
    assert not bool(torch.isnan(torch.empty(3).fill_(0)).any())


def test_draw_plan_is_valid_and_matches_its_masks(cpu_caps: Caps) -> None:
    @settings(max_examples=30)
    @given(data=st.data())
    def check(data: Any) -> None:
        shape = Shape(batch=2, kv_heads=1, group=2, seqlen=data.draw(st.integers(1, 90)), head_dim=16)
        plan, _ = draw_plan(data.draw, shape, block_m=32, block_n=16, device="cpu")
        plan.validate()
        dense = plan.to_dense_mask()
        assert dense.shape == (2, 2, shape.seqlen, shape.seqlen)
        assert not bool(dense.triu(1).any())

    check()


# -- the runner -----------------------------------------------------------------


def test_runner_passes_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "conf.json"
    code = runner.main(["--device", "cpu", "--max-seqlen", "32", "--examples", "1",
                        "--json", str(out)])
    assert code == 0
    payload = json.loads(out.read_text())
    names = {(r["method"], r["prop"]) for r in payload["results"]}
    assert {(m, "end_to_end") for m in METHODS} <= names
    assert ("kernel", "sparse_attention") in names
    assert all(r["passed"] and r["examples"] >= 1 for r in payload["results"])


def test_runner_fails_on_a_failing_property(monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    def broken(*args: Any, **kwargs: Any) -> torch.Tensor:
        out: torch.Tensor = fast.dense(*args, **kwargs)
        return out * 1.01

    from dataclasses import replace

    from sparseprefill import methods

    # A broken fast function in the method's descriptor, the one place the runner reads it from.
    monkeypatch.setitem(methods.METHODS, "dense", replace(methods.get("dense"), fast_run=broken))
    assert METHODS["dense"].fast_run is broken
    code = runner.main(["--device", "cpu", "--max-seqlen", "48", "--examples", "3",
                        "--methods", "dense", "--properties", "end_to_end"])
    assert code == 1
    assert "FAIL" in capsys.readouterr().out


# -- the new pieces reject what they must -------------------------------------------


def _listed_plan() -> reference.BlockColumnPlan:
    """N = 64, 16 x 16 blocks, lists of two or more entries and a column inside a block."""
    blocks = torch.zeros(1, 2, 4, 4, dtype=torch.bool)
    blocks[:, :, 2, :2] = True
    blocks[:, :, 3, [0, 2, 3]] = True
    plan = reference.BlockColumnPlan.from_masks(blocks, None, seqlen=64, block_m=16, block_n=16)
    cols = torch.zeros(1, 2, 4, 64, dtype=torch.bool)
    cols[:, :, 3, [5, 20, 40]] = True  # 5 and 40 lie inside listed blocks 0 and 2
    cols[:, :, 1, [3, 17]] = True
    from sparseprefill.reference.plan import mask_to_list

    count, index = mask_to_list(cols)
    return reference.BlockColumnPlan(seqlen=64, block_m=16, block_n=16, block_count=plan.block_count,
                                     block_index=plan.block_index, column_count=count,
                                     column_index=index).validate()


@pytest.mark.parametrize("kind", props.CORRUPTIONS)
def test_every_corruption_breaks_the_plan(kind: str) -> None:
    """Each corruption of the plan_validation property applies to a plan with lists and
    makes it invalid; the property then needs every entry point to refuse it."""
    plan = _listed_plan()
    bad = props.corrupt_plan(plan, kind, seed=3)
    assert bad is not None
    with pytest.raises((TypeError, ValueError)):
        bad.validate()
    q, k, v = _inputs(64)
    with pytest.raises(AssertionError, match="accepted an invalid plan"):
        props.check_plan_rejected(q, k, v, plan)
    props.check_plan_rejected(q, k, v, bad)


def test_estimate_check_rejects_a_wrong_score() -> None:
    """One vertical score off by twice its allowance fails; within it passes."""
    q, k, _ = _inputs(48)
    spec = METHODS["vertical_slash"]
    assert spec.estimate is not None
    params = {"vertical_size": 4, "slash_size": 4, "last_q": 16}
    expected = spec.estimate("reference", q, k, params)
    got = spec.estimate("fast", q, k, params)
    for name, est in expected.items():
        tolerance.check_estimate(got[name].values, est, name=name)
    allowed = tolerance.estimate_allowance(expected["vertical"].terms, expected["vertical"].bound)
    wrong = expected["vertical"].values.clone()
    wrong[0, 1, 7] += 2 * allowed
    with pytest.raises(AssertionError, match=r"vertical: max abs error .* allowed"):
        tolerance.check_estimate(wrong, expected["vertical"], name="vertical")
    wrong[0, 1, 7] = math.nan
    with pytest.raises(AssertionError, match="NaN or infinity"):
        tolerance.check_estimate(wrong, expected["vertical"], name="vertical")


def test_draw_limits_lowers_and_restores() -> None:
    """`draw_limits` sets the drawn limits inside its context only."""
    import sparseprefill.fast.kernels.last_q_estimate as lq
    from sparseprefill.conformance.strategies import draw_limits

    real = lq._SPLIT_KEYS

    @settings(max_examples=20)
    @given(data=st.data())
    def check(data: Any) -> None:
        limits, what = draw_limits(data.draw, Caps())
        with limits:
            inside = lq._SPLIT_KEYS
        assert lq._SPLIT_KEYS == real
        assert (inside != real) == ("last_q_estimate._SPLIT_KEYS" in what)
        seen.add(inside)

    seen: set[int] = set()
    check()
    assert len(seen) > 1
    limits, what = draw_limits(lambda s: 64, Caps(scaled_limits=False))
    assert what == ""


def test_forced_tiles_sets_and_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    """`forced_tiles` changes the kernel's tiles inside its context only, and `draw_tiles`
    draws tiles that divide the plan blocks and make them several tiles wide."""
    from sparseprefill.conformance.strategies import draw_tiles, forced_tiles
    from sparseprefill.fast.kernels.block_column import _tile_config

    monkeypatch.delenv("SPARSEPREFILL_TILE", raising=False)
    own = _tile_config(64, 128, 64)
    with forced_tiles((16, 32)):
        assert _tile_config(64, 128, 64)[:2] == (16, 32)
    assert _tile_config(64, 128, 64) == own
    with forced_tiles(None):
        assert _tile_config(64, 128, 64) == own

    @settings(max_examples=30)
    @given(data=st.data())
    def check(data: Any) -> None:
        bm, bn = data.draw(st.sampled_from([16, 32, 64, 256])), data.draw(st.sampled_from([16, 32, 64, 256]))
        tiles = draw_tiles(data.draw, Caps(), bm, bn)
        if tiles is not None:
            assert bm % tiles[0] == 0 and bn % tiles[1] == 0 and bn // tiles[1] > 1
            seen.add(bn // tiles[1])

    seen: set[int] = set()
    check()
    assert len(seen) > 1
    assert draw_tiles(lambda s: True, Caps(scaled_limits=False), 64, 64) is None


def test_draw_column_path_sets_and_restores() -> None:
    """`draw_column_path` leaves covered columns to the kernel and narrows column tiles
    inside its context only, both choices drawn, nothing under `scaled_limits=False`."""
    from sparseprefill.conformance.strategies import draw_column_path
    from sparseprefill.fast.kernels import block_column, own_columns

    real = (own_columns.RESOLVE_COVERED, block_column._COL_TILE, block_column._COL_SPLIT)

    @settings(max_examples=40)
    @given(data=st.data())
    def check(data: Any) -> None:
        path, what = draw_column_path(data.draw, Caps())
        with path:
            inside = (own_columns.RESOLVE_COVERED, block_column._COL_TILE, block_column._COL_SPLIT)
        assert (own_columns.RESOLVE_COVERED, block_column._COL_TILE, block_column._COL_SPLIT) == real
        assert inside[0] == ("covered-in-kernel" not in what)
        assert (inside[1] == 16) == ("col_tile=16" in what)
        assert (inside[2] is True) == ("col-split" in what)
        assert not (inside[2] is True and not inside[0])  # the split needs resolved (disjoint) columns
        seen.add(inside)

    seen: set[tuple[bool, int, bool | None]] = set()
    check()
    assert len(seen) == 6
    assert draw_column_path(lambda s: True, Caps(scaled_limits=False))[1] == ""


def test_minference_plan_check_rejects_a_wrong_head() -> None:
    """The MInference `plan_check` passes the reference plan and fails a plan whose head 1
    is another pattern's (a merge that mixed heads up)."""
    from sparseprefill.reference.minference import HeadPattern

    spec = METHODS["minference"]
    assert spec.plan_check is not None
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 80, 32, generator=gen).half()
    k = torch.randn(1, 1, 80, 32, generator=gen).half()
    patterns = (HeadPattern("a_shape", {"sink": 16, "window": 16, "block_m": 16, "block_n": 16}),
                HeadPattern("vertical_slash", {"vertical_size": 2, "slash_size": 2, "last_q": 16,
                                               "block_m": 16, "block_n": 16, "init_columns": 0,
                                               "local_diagonals": 0}))
    params = spec.call_params({"patterns": patterns}, q)
    plan = reference.minference_plan(q, k, **params)
    spec.plan_check(q, k, params, plan)
    same = {"patterns": (patterns[0], patterns[0])}
    wrong = reference.minference_plan(q, k, **spec.call_params(same, q))
    with pytest.raises(AssertionError, match="head 1 .* differs from its pattern's own plan"):
        spec.plan_check(q, k, params, wrong)


# -- the draws that aim at what bugs hide behind --------------------------------------


def test_late_peaks_raise_the_running_max_late() -> None:
    """`_late_peaks`: most rows past the late key meet their largest logit at or after it,
    long after their first key tile (what an online softmax must rescale for)."""
    from sparseprefill.conformance.strategies import _late_peaks, block_edges

    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 96, 32, generator=gen)
    k = torch.randn(1, 2, 96, 32, generator=gen)
    what = _late_peaks(gen, q, k, 2, block_edges(96, (16,)))
    late = int(what.split(", late ")[1].split(",")[0])
    s = torch.einsum("bhnd,bhmd->bhnm", q, k.repeat_interleave(2, dim=1)).tril()
    s = s.masked_fill(torch.ones(96, 96, dtype=torch.bool).triu(1), -math.inf)
    argmax = s.argmax(dim=-1)[0, :, late:]
    assert late >= 48
    assert float((argmax >= late).float().mean()) > 0.9, what


def test_edge_seqlen_lands_on_block_edges(cpu_caps: Caps) -> None:
    """`edge_seqlen` moves N to a multiple of a drawn block size, or one off it, a third of
    the time; within the cap."""
    from sparseprefill.conformance.strategies import edge_seqlen

    moved: set[int] = set()

    @settings(max_examples=60)
    @given(data=st.data())
    def check(data: Any) -> None:
        n = edge_seqlen(data.draw, cpu_caps, 100, (48, 64))
        assert 1 <= n <= cpu_caps.max_seqlen
        if n != 100:
            assert min((n + e) % size for size in (48, 64) for e in (-1, 0, 1)) == 0
            moved.add(n)

    check()
    assert len(moved) >= 3


def test_per_head_knobs_reach_their_extremes() -> None:
    """Some draws give neighbouring heads the two extremes of the method's own values, and
    some give whole KV groups one value each (`draw_per_head_knobs`)."""
    from sparseprefill.conformance.strategies import draw_per_head_knobs

    spec = METHODS["anchor_attention"]
    seen: set[str] = set()

    @settings(max_examples=150)
    @given(data=st.data())
    def check(data: Any) -> None:
        params = spec.params(data.draw, 64)
        out, what = draw_per_head_knobs(data.draw, spec, params, 64, 4, 2)
        theta = out["theta"]
        if isinstance(theta, (int, float)):
            return
        values = [float(x) for x in (theta.tolist() if isinstance(theta, torch.Tensor) else theta)]
        assert len(values) == 4
        if "(extremes)" in what:
            assert values[0] != values[1] or len(set(values)) == 1
            seen.add("extremes")
        if "(groups)" in what:
            assert values[0] == values[1] and values[2] == values[3]
            seen.add("groups")

    check()
    assert seen == {"extremes", "groups"}


def test_sequence_changes_one_thing_at_a_time(cpu_caps: Caps) -> None:
    """The second call of a sequence is the first on a finer grid (every halvable block size
    halved, nothing else changed); `_draw_call` keeps what a change does not name."""
    spec = METHODS["sample_attention"]

    @settings(max_examples=20)
    @given(data=st.data())
    def check(data: Any) -> None:
        caps = props._sequence_caps(cpu_caps)
        first = props._draw_call(data.draw, caps, spec, 64, None, "first")
        if not props._refinable(first.params):
            return
        finer = props._draw_call(data.draw, caps, spec, 64, first, "finer")
        assert finer.params["block_size"] == first.params["block_size"] // 2
        assert {k: v for k, v in finer.params.items() if k != "block_size"} == \
            {k: v for k, v in first.params.items() if k != "block_size"}
        assert finer.q is first.q or finer.shape is not first.shape  # a shape too costly is redrawn
        other = props._draw_call(data.draw, caps, spec, 64, first, "dtype")
        assert other.dtype != first.dtype and other.params is first.params
        assert torch.equal(other.q.float(), first.q.to(other.dtype).float())

    check()


def test_sequence_catches_a_table_kept_under_a_short_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A SampleAttention tile table kept without its block size passes a single call, and
    fails the call after it on a finer grid (the sequence property's second call; the
    planted-bug harness measures that the property draws it: `sample-tile-table-key-block`)."""
    from sparseprefill.fast.kernels import sampled_scores

    tables: dict[Any, Any] = {}

    def short_key(spans: list[tuple[int, int]], block_size: int, device: torch.device,
                  block_l: int = sampled_scores._BLOCK_L) -> tuple[torch.Tensor, int]:
        key = (tuple(spans), block_l, device)
        if key not in tables:
            tiles = sampled_scores.row_tiles(spans, block_size, block_l)
            tables[key] = (torch.tensor(tiles, dtype=torch.int32).reshape(len(tiles), 2).to(device), len(tiles))
        return tables[key]  # type: ignore[no-any-return]

    monkeypatch.setattr(sampled_scores, "tile_table", short_key)
    spec = METHODS["sample_attention"]
    q, k, v = _inputs(60)
    calls = []
    for block_size in (64, 32):
        params = {"alpha_c": 0.9, "alpha_s": 0.9, "chunk_n": 65, "block_size": block_size}
        calls.append(props._Call(params, None, q.dtype, q, k, v, "inputs", {**params, "__raw__": params}, ""))
    props._check_call(spec, calls[0], "estimate", "first")
    with pytest.raises(AssertionError, match="slash"):
        props._check_call(spec, calls[1], "estimate", "finer")
