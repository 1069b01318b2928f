"""SharePrefill: the cluster layout, each algorithm step by hand, the per-prefill state,
and fast against reference layer by layer (decisions, plans, pivots, outputs).

Multi-layer inputs mix flat heads (q scaled to ~0: attention near uniform, so
`d_sparse` is small and the head is dense or shared) with peaked ones (highly
sparse: the vertical-slash fallback), so every pattern occurs.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import EXAMPLES  # noqa: E402
from sparseprefill import fast, reference  # noqa: E402
from sparseprefill.conformance import tolerance  # noqa: E402
from sparseprefill.conformance.properties import check_plans_equal, nan_poisoned_empty  # noqa: E402
from sparseprefill.conformance.ties import (  # noqa: E402
    DISTANCE_MARGIN,
    check_decisions_modulo_margin,
    check_pivot_modulo_ties,
    shareprefill_tie_check,
)
from sparseprefill.reference import ClusterLayout, SharePattern, SharePrefillState  # noqa: E402

ref_sp = importlib.import_module("sparseprefill.reference.shareprefill")
fast_sp = importlib.import_module("sparseprefill.fast.shareprefill")
DENSE, SHARED, VS = int(SharePattern.DENSE), int(SharePattern.SHARED), int(SharePattern.VERTICAL_SLASH)


def _stack(layers: int, b: int, hq: int, hkv: int, n: int, d: int, temps: list[list[float]],
           seed: int = 0, dtype: torch.dtype = torch.float16) -> list[tuple[torch.Tensor, ...]]:
    """Per layer q, k, v. The first 16 keys share a direction (a sink block); head h of
    layer l has queries `randn * min(t, 1) + t * direction` with `t = temps[l][h]`: 0 gives
    exactly uniform attention, large `t` attention concentrated on the sink block."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for l in range(layers):
        t = torch.tensor(temps[l]).view(1, hq, 1, 1)
        q = torch.randn(b, hq, n, d, generator=gen) * t.clamp(max=1.0)
        q[..., 0] += t[..., 0]
        k = torch.randn(b, hkv, n, d, generator=gen)
        k[:, :, :16, 0] += 4.0
        v = torch.randn(b, hkv, n, d, generator=gen)
        out.append((q.to(dtype), k.to(dtype), v.to(dtype)))
    return out


# -- the cluster layout ------------------------------------------------------------------


def test_layout_lookup_sizes_and_checks() -> None:
    layout = ClusterLayout(((0, 1, -1), (1, 1, 0)), meta={"model": "x"})
    assert layout.num_layers == 2 and layout.num_heads == 3
    assert layout.cluster(1, 2) == 0 and layout.cluster(0, 2) == ref_sp.NOISE
    assert layout.sizes() == {1: 3, 0: 2, -1: 1}
    with pytest.raises(ValueError, match="layer 2"):
        layout.cluster(2, 0)
    with pytest.raises(ValueError, match="head 3"):
        layout.cluster(0, 3)
    with pytest.raises(ValueError, match="heads"):
        ClusterLayout(((0, 1), (0,)))
    with pytest.raises(ValueError, match="-1"):
        ClusterLayout(((0, -2),))
    with pytest.raises(TypeError, match="ints"):
        ClusterLayout(((0, 1.0),))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one"):
        ClusterLayout(())


def test_layout_json_round_trip_and_authors_format(tmp_path: Path) -> None:
    layout = ClusterLayout(((0, 1, -1), (1, 1, 0)), meta={"threshold": 10.0})
    again = ClusterLayout.load(layout.save(tmp_path / "c.json"))
    assert again == layout and again.meta == {"threshold": 10.0}
    # The SharePrefill authors' lookup files: cluster id -> [[layer, head], ...] plus shared ids.
    theirs = {"clusters": {"42": [[0, 0], [1, 2]], "7": [[0, 1]], "3": [[1, 0], [1, 1]]},
              "shared_clusters": [42, 3]}
    parsed = ClusterLayout.from_json(json.dumps(theirs))
    # Shared ids become 0 ("3") and 1 ("42"); cluster 7 and the unlisted head (0, 2) are noise.
    assert parsed.clusters == ((1, -1, -1), (0, 0, 1))
    with pytest.raises(ValueError, match="JSON"):
        ClusterLayout.from_json("{")
    with pytest.raises(ValueError, match="format"):
        ClusterLayout.from_json('{"a": 1}')


# -- Alg. 3 steps by hand --------------------------------------------------------------


def test_js_distance_base_2() -> None:
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.2, 0.8]], dtype=torch.float64)
    q = torch.tensor([[0.0, 1.0], [0.5, 0.5], [0.6, 0.4]], dtype=torch.float64)
    d = ref_sp.js_distance(p, q)
    assert d[0] == pytest.approx(1.0, abs=1e-15) and d[1] == 0.0
    from scipy.spatial.distance import jensenshannon

    assert float(d[2]) == pytest.approx(float(jensenshannon([0.2, 0.8], [0.6, 0.4], base=2)), abs=1e-12)
    torch.testing.assert_close(d, ref_sp.js_distance(q, p), rtol=0, atol=1e-15)


@pytest.mark.parametrize("n,bm,bn", [(37, 16, 8), (64, 16, 16), (50, 32, 48), (1, 16, 16)])
def test_last_block_attention_by_brute_force(n: int, bm: int, bn: int) -> None:
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(2, 4, n, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, n, 8, generator=gen, dtype=torch.float64)
    got = ref_sp.last_block_attention(q, k, block_m=bm, block_n=bn, scale=0.3)
    r0 = ((n - 1) // bm) * bm
    kb = -(-n // bn)
    for b in range(2):
        for h in range(4):
            means = []
            for j in range(kb):
                vals = [0.3 * float(q[b, h, r] @ k[b, h // 2, c]) for r in range(r0, n)
                        for c in range(j * bn, min(n, (j + 1) * bn)) if c <= r]
                means.append(sum(vals) / len(vals))
            want = torch.softmax(torch.tensor(means, dtype=torch.float64), dim=0)
            torch.testing.assert_close(got[b, h], want, rtol=0, atol=1e-12)
    # The pooled fast estimate (exact factorisation + fp32 means) agrees to rounding.
    fast_a = fast_sp.last_block_attention(q.half(), k.half(), block_m=bm, block_n=bn, scale=0.3)
    ref_a = ref_sp.last_block_attention(q.half(), k.half(), block_m=bm, block_n=bn, scale=0.3)
    assert float((fast_a - ref_a).abs().max()) < 1e-6


def test_choose_patterns_by_hand() -> None:
    """Noise, first-head-dense, sparse heads, sharing with pivot, strict thresholds."""
    layout = ClusterLayout(((0, 0, 1, -1, 1, 2),))
    state = SharePrefillState(layout, tau=0.2, delta=0.3)
    state.pivots[(1, 0)] = ref_sp.Pivot(a_tilde=torch.ones(2) / 2, mask=torch.ones(1, 2, dtype=torch.bool),
                                        layer=0, head=0)
    d_sparse = torch.tensor([[0.1, 0.1, 0.29, 0.0, 0.3, 0.5]], dtype=torch.float64)
    d_sim = torch.tensor([[math.nan, math.nan, 0.19, math.nan, 0.0, math.nan]], dtype=torch.float64)
    got = ref_sp.choose_patterns(state, d_sparse, d_sim, layer=0)
    # h0: first of cluster 0 -> dense; h1: cluster 0 already dense in this layer -> VS;
    # h2: pivot, both below -> shared; h3: noise -> VS; h4: d_sparse == delta -> VS;
    # h5: no pivot but highly sparse -> VS.
    assert got.tolist() == [[DENSE, VS, SHARED, VS, VS, VS]]
    tight = SharePrefillState(layout, tau=0.0, delta=0.3)
    tight.pivots = dict(state.pivots)
    assert ref_sp.choose_patterns(tight, d_sparse, d_sim, layer=0)[0, 2] == VS


def test_construct_pivotal_pattern_by_hand() -> None:
    """Alg. 2 on a 2 x 2 block map: softmax rows, flatten, normalise, cumulative 0.9."""
    inf = math.inf
    means = torch.tensor([[0.0, -inf], [math.log(3.0), 0.0]], dtype=torch.float32)
    # Rows: [1, 0] and [0.75, 0.25]; normalised: [0.5, 0, 0.375, 0.125].
    pivot = ref_sp.construct_pivotal_pattern(means, gamma=0.8, seqlen=32, block_m=16, block_n=16,
                                             layer=3, head=1)
    assert pivot.a_tilde.tolist() == pytest.approx([0.75, 0.25])
    # Diagonal blocks (0,0) and (1,1) forced: 0.625; then (1,0): 1.0 >= 0.8.
    assert pivot.mask.tolist() == [[True, False], [True, True]]
    pivot = ref_sp.construct_pivotal_pattern(means, gamma=0.6, seqlen=32, block_m=16, block_n=16,
                                             layer=3, head=1)
    assert pivot.mask.tolist() == [[True, False], [False, True]]
    assert (pivot.layer, pivot.head) == (3, 1)


def test_diagonal_blocks() -> None:
    diag = ref_sp.diagonal_blocks(40, 16, 8, torch.device("cpu"))
    assert diag.nonzero().tolist() == [[0, 0], [0, 1], [1, 2], [1, 3], [2, 4]]


# -- the prefill state and the multi-layer path ----------------------------------------------


def test_sharing_across_layers_end_to_end() -> None:
    """Layer 0: flat head 0 becomes the pivot of cluster 0; layer 1: flat head 0 shares it,
    the peaked head takes Alg. 5, the noise head too; outputs follow each plan."""
    layout = ClusterLayout(((0, 0, -1, 1), (0, 1, -1, 1)))
    temps = [[0.0, 0.0, 1.0, 8.0], [0.0, 8.0, 0.0, 8.0]]
    layers = _stack(2, 1, 4, 2, 96, 32, temps, seed=1)
    state = SharePrefillState(layout, block_m=16, block_n=16)
    outs = reference.shareprefill_stack(*zip(*layers), state)  # type: ignore[call-arg]
    first, second = state.decisions
    assert first.pattern.tolist() == [[DENSE, VS, VS, VS]]
    assert second.pattern.tolist() == [[SHARED, VS, VS, VS]]
    assert set(state.pivots) == {(0, 0)} and state.pivots[(0, 0)].layer == 0
    assert state.pattern_counts() == [{"layer": 0, "dense": 1, "shared": 0, "vertical_slash": 3},
                                      {"layer": 1, "dense": 0, "shared": 1, "vertical_slash": 3}]
    # The dense pivot's own a^ equals its a~ (the last query block read).
    q0, k0, _ = layers[0]
    a_hat = ref_sp.last_block_attention(q0, k0, block_m=16, block_n=16, scale=32 ** -0.5)
    torch.testing.assert_close(a_hat[0, 0], state.pivots[(0, 0)].a_tilde, rtol=0, atol=1e-6)
    # Layer 1, head 0 attends exactly through the pivot's mask.
    fresh = SharePrefillState(layout, block_m=16, block_n=16)
    reference.shareprefill_layer(*layers[0], fresh, layer=0)
    plan, decision = reference.shareprefill_layer_plan(layers[1][0], layers[1][1], fresh, layer=1)
    assert torch.equal(decision.pattern, second.pattern)
    assert torch.equal(plan.block_mask()[0, 0], state.pivots[(0, 0)].mask & torch.ones(6, 6).tril().bool())
    assert int(plan.column_count[0, 0].sum()) == 0
    golden = tolerance.golden_attention(*layers[1], plan.to_dense_mask())
    torch.testing.assert_close(outs[1].double(), golden[0], rtol=0, atol=2e-3)


def test_batch_rows_decide_independently() -> None:
    layout = ClusterLayout(((0, 0), (0, 0)))
    flat = _stack(1, 1, 2, 1, 64, 16, [[0.0, 0.0]], seed=2)[0]
    peaked = _stack(1, 1, 2, 1, 64, 16, [[8.0, 8.0]], seed=2)[0]
    q, k, v = (torch.cat([a, b]).float() for a, b in zip(flat, peaked))
    state = SharePrefillState(layout, block_m=16, block_n=16)
    reference.shareprefill_layer(q.half(), k.half(), v.half(), state, layer=0)
    assert state.decisions[0].pattern.tolist() == [[DENSE, VS], [VS, VS]]
    assert set(state.pivots) == {(0, 0)}


def test_state_checks() -> None:
    layers = _stack(2, 1, 2, 1, 40, 16, [[1.0, 1.0]] * 2)
    state = SharePrefillState(ClusterLayout(((0, 0),)), block_m=16, block_n=16)
    reference.shareprefill_layer(*layers[0], state, layer=0)
    with pytest.raises(ValueError, match="already processed"):
        reference.shareprefill_layer(*layers[1], state, layer=0)
    with pytest.raises(ValueError, match="outside the cluster layout"):
        reference.shareprefill_layer(*layers[1], state, layer=1)
    other = SharePrefillState(None, block_m=16, block_n=16)
    reference.shareprefill_layer(*layers[0], other, layer=0)
    q, k, v = (t[:, :, :32] for t in layers[1])
    with pytest.raises(ValueError, match="new state"):
        reference.shareprefill_layer(q, k, v, other, layer=1)
    with pytest.raises(ValueError, match="heads per layer"):
        reference.shareprefill_plan(*_stack(1, 1, 4, 1, 20, 16, [[1.0] * 4])[0][:2],
                                    layout=ClusterLayout(((0, 0),)))
    with pytest.raises(TypeError, match="SharePrefillState"):
        reference.shareprefill_layer(*layers[0], "state", layer=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="strictly increasing"):
        reference.shareprefill_stack(*zip(*layers), SharePrefillState(), layers=[1, 0])  # type: ignore[call-arg]
    for pkg in (reference, fast):
        qs, ks, vs = zip(*layers)
        with pytest.raises(ValueError, match="one entry per layer"):
            pkg.shareprefill_stack(qs, ks[:1], vs, SharePrefillState())
        with pytest.raises(ValueError, match="layers must name"):
            pkg.shareprefill_stack(qs, ks, vs, SharePrefillState(), layers=[0])
        with pytest.raises(TypeError, match="state"):
            pkg.shareprefill_stack(qs, ks, vs, object())
    copy = state.clone()
    copy.pivots.clear()
    assert state.pivots == {} or len(state.pivots) >= len(copy.pivots)


BAD = [
    ({"tau": -0.1}, ValueError, "tau"),
    ({"delta": 2.5}, ValueError, "delta"),
    ({"gamma": 1.1}, ValueError, "gamma"),
    ({"tau": "x"}, TypeError, "tau"),
    ({"block_m": 0}, ValueError, "block_m"),
    ({"init_columns": -1}, ValueError, "init_columns"),
    ({"layer": -1}, ValueError, "layer"),
    ({"layout": "no/such/clusters.json"}, ValueError, "layout"),
    ({"layout": 3}, TypeError, "layout"),
]


@pytest.mark.parametrize("pkg", [reference, fast], ids=["reference", "fast"])
def test_bad_parameters_raise(pkg: Any) -> None:
    q, k, v = _stack(1, 1, 2, 1, 32, 16, [[1.0, 1.0]])[0]
    for change, error, name in BAD:
        with pytest.raises(error, match=name):
            pkg.shareprefill_plan(q, k, **change)
        with pytest.raises(error, match=name):
            pkg.shareprefill(q, k, v, **change)
    with pytest.raises(ValueError, match="k must have shape"):
        pkg.shareprefill_plan(q, k[:, :, :16])


def test_fast_rejects_float32_and_odd_blocks() -> None:
    q, k, v = _stack(1, 1, 2, 1, 32, 16, [[1.0, 1.0]], dtype=torch.float32)[0]
    with pytest.raises(TypeError, match="dtype"):
        fast.shareprefill_plan(q, k)
    with pytest.raises(ValueError, match="block"):
        fast.shareprefill(q.half(), k.half(), v.half(), block_m=24)


# -- fast against reference, layer by layer ---------------------------------------------------


def check_layer_step(state: SharePrefillState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     layer: int, scale: float | None = None) -> SharePrefillState:
    """Fast vs reference on one layer from the same state; returns the reference state after it.

    Decisions must agree modulo the distance margin; with equal decisions the plans must be
    equal (or differ only by Alg. 5 ties: `shareprefill_tie_check`'s line check); the fast
    output must meet the tolerance policy against the golden of its own plan; fast pivots
    must be valid Alg. 2 selections of the reference's block means.
    """
    before = state.clone()
    ref_plan, ref_decision = reference.shareprefill_layer_plan(q, k, state.clone(), layer=layer, scale=scale)
    fast_plan, fast_decision = fast.shareprefill_layer_plan(q, k, before.clone(), layer=layer, scale=scale)
    check_decisions_modulo_margin(before, fast_decision.pattern, ref_decision.d_sparse,
                                  ref_decision.d_sim, layer=layer)
    assert float((fast_decision.d_sparse.cpu() - ref_decision.d_sparse).abs().max()) < DISTANCE_MARGIN / 10
    if torch.equal(fast_decision.pattern.cpu(), ref_decision.pattern.cpu()):
        check_plans_equal(ref_plan, fast_plan)
    fast_state = before.clone()
    with nan_poisoned_empty():
        out = fast.shareprefill_layer(q, k, v, fast_state, layer=layer, scale=scale)
    mask = fast_plan.to_dense_mask()
    golden = tolerance.golden_attention(q, k, v, mask, scale=scale)
    baseline = tolerance.baseline_attention(q, k, v, mask, scale=scale)
    tolerance.check_output(out, golden[0], baseline[0])
    ref_out = reference.shareprefill_layer(q, k, v, state, layer=layer, scale=scale)
    if torch.equal(fast_plan.to_dense_mask(), ref_plan.to_dense_mask()):
        tolerance.check_output(ref_out, golden[0], baseline[0])
    # Pivots built by the fast layer against the reference's block means of the same heads.
    new = {key: p for key, p in fast_state.pivots.items() if key not in before.pivots}
    if new:
        b, hq = q.shape[:2]
        means = torch.empty(b, hq, ref_plan.num_query_blocks, ref_plan.num_key_blocks)
        dense = reference.dense_plan(q, k, block_m=state.block_m, block_n=state.block_n)
        reference.sparse_attention(*tolerance.upcast(q, k, v), dense, scale=scale, block_mean_out=means)
        for (cluster, row), pivot in new.items():
            check_pivot_modulo_ties(means[row, pivot.head], pivot, gamma=state.gamma, seqlen=q.shape[2],
                                    block_m=state.block_m, block_n=state.block_n,
                                    what=f"pivot of cluster {cluster}")
            assert pivot.layer == layer
    return state


def test_fast_matches_reference_across_layers() -> None:
    layout = ClusterLayout(((0, 0, -1, 1), (0, 1, 1, 0), (1, 0, 0, 1)))
    temps = [[0.0, 0.0, 1.0, 0.05], [0.0, 8.0, 0.05, 0.0], [0.05, 0.0, 4.0, 0.0]]
    layers = _stack(3, 2, 4, 2, 75, 64, temps, seed=3)
    state = SharePrefillState(layout, block_m=16, block_n=32, delta=0.5)
    for l, (q, k, v) in enumerate(layers):
        state = check_layer_step(state, q, k, v, l)
    kinds = torch.stack([d.pattern for d in state.decisions])
    assert {DENSE, SHARED, VS} <= set(kinds.unique().tolist())


@settings(max_examples=max(2, EXAMPLES // 3))
@given(data=st.data())
def test_fast_matches_reference_hypothesis(data: Any) -> None:
    """Hypothesis over tau, delta, gamma, cluster layouts, GQA, batch and N (small sizes)."""
    draw = data.draw
    n = draw(st.sampled_from([1, 17, 63, 111, 129]))
    b = draw(st.integers(1, 2))
    hkv = draw(st.integers(1, 2))
    g = draw(st.sampled_from([1, 2]))
    hq = hkv * g
    layers = draw(st.integers(1, 3))
    clusters = draw(st.lists(st.lists(st.integers(-1, 2), min_size=hq, max_size=hq),
                             min_size=layers, max_size=layers))
    temps = draw(st.lists(st.lists(st.sampled_from([0.0, 0.05, 1.0, 6.0]), min_size=hq, max_size=hq),
                          min_size=layers, max_size=layers))
    bm, bn = draw(st.sampled_from([(16, 16), (32, 16), (16, 48), (64, 64)]))
    state = SharePrefillState(ClusterLayout(tuple(tuple(c) for c in clusters)),
                              tau=draw(st.sampled_from([0.2, 0.0, 0.6, 1.01])),
                              delta=draw(st.sampled_from([0.3, 1.01, 0.6])),
                              gamma=draw(st.sampled_from([0.9, 0.5, 1.0, 0.0])),
                              block_m=bm, block_n=bn,
                              init_columns=draw(st.sampled_from([1, 0])),
                              local_diagonals=draw(st.sampled_from([1, 0])))
    seed = draw(st.integers(0, 2**31 - 1))
    dtype = draw(st.sampled_from([torch.float16, torch.bfloat16]))
    for l, (q, k, v) in enumerate(_stack(layers, b, hq, hkv, n, 64, temps, seed=seed, dtype=dtype)):
        state = check_layer_step(state, q, k, v, l)


def test_stack_equals_layer_by_layer() -> None:
    layout = ClusterLayout(((0, 0), (0, 0)))
    layers = _stack(2, 1, 2, 1, 48, 32, [[0.0, 1.0], [0.0, 6.0]], seed=5)
    one = SharePrefillState(layout, block_m=16, block_n=16)
    outs = fast.shareprefill_stack(*zip(*layers), one)  # type: ignore[call-arg]
    two = SharePrefillState(layout, block_m=16, block_n=16)
    for l, (q, k, v) in enumerate(layers):
        assert torch.equal(outs[l], fast.shareprefill_layer(q, k, v, two, layer=l))
    assert [d.pattern.tolist() for d in one.decisions] == [d.pattern.tolist() for d in two.decisions]


# -- tie checks -------------------------------------------------------------------------------


def test_decision_margin_check() -> None:
    layout = ClusterLayout(((0, 0, -1),))
    state = SharePrefillState(layout, delta=0.3)
    d_sim = torch.full((1, 3), math.nan, dtype=torch.float64)
    near = torch.tensor([[0.3 - DISTANCE_MARGIN / 2, 0.1, 0.0]], dtype=torch.float64)
    # Head 0 is within the margin of delta: dense or VS; if VS, head 1 becomes the first dense.
    check_decisions_modulo_margin(state, torch.tensor([[DENSE, VS, VS]]), near, d_sim, layer=0)
    check_decisions_modulo_margin(state, torch.tensor([[VS, DENSE, VS]]), near, d_sim, layer=0)
    with pytest.raises(AssertionError, match="allowed"):
        check_decisions_modulo_margin(state, torch.tensor([[VS, VS, VS]]), near, d_sim, layer=0)
    far = torch.tensor([[0.2, 0.1, 0.0]], dtype=torch.float64)
    with pytest.raises(AssertionError, match=r"\(0, 0\)"):
        check_decisions_modulo_margin(state, torch.tensor([[VS, DENSE, VS]]), far, d_sim, layer=0)
    with pytest.raises(AssertionError, match="NOISE|VERTICAL"):
        check_decisions_modulo_margin(state, torch.tensor([[DENSE, VS, DENSE]]), far, d_sim, layer=0)


def test_shareprefill_tie_check() -> None:
    q, k, _ = _stack(1, 1, 4, 2, 64, 32, [[0.0, 6.0, 0.0, 6.0]], seed=7)[0]
    params: dict[str, Any] = dict(layout=ClusterLayout(((0, 0, 1, -1),)), block_m=16, block_n=16)
    plan = fast.shareprefill_plan(q, k, **params)
    shareprefill_tie_check(q, k, params, plan, plan)
    # A plan made with another gamma keeps other lines: not a tie.
    wrong = fast.shareprefill_plan(q, k, **{**params, "gamma": 0.3})
    assert not wrong.equal(plan)
    with pytest.raises(AssertionError, match="not explained by a tie"):
        shareprefill_tie_check(q, k, params, plan, wrong)


def test_column_lists_too_large_to_give_every_query_block_its_own_stay_shared(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Single-line verticals whose per-query-block lists exceed `DISJOINT_COLUMN_BYTES`
    (361 GiB at 1M tokens on the scale workload) stay one shared list per head: the same
    plan (`equal`) and the same attention, the kernel testing covered columns itself."""
    own = importlib.import_module("sparseprefill.fast.kernels.own_columns")
    q, k, v = _stack(1, 1, 4, 2, 200, 32, [[0.0, 6.0, 0.0, 6.0]], seed=7)[0]
    params: dict[str, Any] = dict(layout=ClusterLayout(((0, 0, 1, -1),)), block_m=16, block_n=16)
    fitting = fast.shareprefill_plan(q, k, **params)
    monkeypatch.setattr(own, "DISJOINT_COLUMN_BYTES", 0)
    shared = fast.shareprefill_plan(q, k, **params)
    assert fitting.columns_disjoint and not shared.columns_disjoint
    assert shared.column_index.stride(2) == 0 and int(shared.column_count.max()) > 0
    assert shared.equal(fitting)
    torch.testing.assert_close(fast.sparse_attention(q, k, v, shared), fast.sparse_attention(q, k, v, fitting))


def test_nan_input_decides_vertical_slash_and_keeps_valid_plans() -> None:
    """NaN in a key of batch row 0: that row's `a^` and distances are NaN, so no head of it
    counts as non-sparse (NaN < delta is false): vertical-slash with its forced lines; the
    other batch row decides as without the NaN; both packages agree."""
    layout = ClusterLayout(((0, 0, 1, 1), (0, 0, 1, 1)))
    layers = _stack(2, 2, 4, 2, 48, 16, [[0.0, 0.0, 0.05, 0.0]] * 2, seed=5)
    clean = SharePrefillState(layout, block_m=16, block_n=16, delta=0.5)
    for l, (q, k, v) in enumerate(layers):
        reference.shareprefill_layer(q, k, v, clean, layer=l)
    q0, k0, v0 = layers[0]
    k0 = k0.clone()
    k0[0, :, 30] = math.nan
    states = {pkg: SharePrefillState(layout, block_m=16, block_n=16, delta=0.5) for pkg in ("reference", "fast")}
    for name, pkg in (("reference", reference), ("fast", fast)):
        for l, (q, k, v) in enumerate([(q0, k0, v0), layers[1]]):
            plan, decision = pkg.shareprefill_layer_plan(q, k, states[name].clone(), layer=l)
            plan.validate()
            dense = plan.to_dense_mask()
            rows = torch.arange(48)
            assert bool(dense[..., rows, rows].all()), "main diagonal dropped"
            pkg.shareprefill_layer(q, k, v, states[name], layer=l)
        first = states[name].decisions[0]
        assert bool((first.pattern[0] == VS).all()) and bool(first.d_sparse[0].isnan().all())
        assert torch.equal(first.pattern[1].cpu(), clean.decisions[0].pattern[1].cpu())
    for ref_d, fast_d in zip(states["reference"].decisions, states["fast"].decisions):
        assert torch.equal(ref_d.pattern.cpu(), fast_d.pattern.cpu())
