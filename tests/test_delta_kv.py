"""Delta-KV (DeltaAttention thesis 4.1): keep mask, packing, the two phases, the ablations.

The conformance properties (plan = keep mask + packing + phase plans exactly equal;
end_to_end against an independent golden) run from the registry; these tests pin the
semantics the properties take for granted.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparseprefill import fast, reference
from sparseprefill.reference.delta_kv import expand_packed, is_dropped, safe_blocks, tree_sum


def _runs(b: int = 2, hkv: int = 2, n: int = 150, d: int = 16, *, run: int = 6, noise: float = 0.2,
          seed: int = 0, dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, ...]:
    """Keys that drift slowly (runs of similar keys), random values and queries (GQA 2)."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(b, hkv, n // run + 1, d, generator=gen).repeat_interleave(run, dim=2)[:, :, :n]
    k = (base + noise * torch.randn(b, hkv, n, d, generator=gen)).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    q = torch.randn(b, 2 * hkv, n, d, generator=gen).to(dtype)
    return q, k, v


# -- Stage 1 ----------------------------------------------------------------------


def test_keep_mask_follows_the_algorithm_literally() -> None:
    """A plain transcription of 4.1.1 (a Python loop per key) gives the same mask."""
    _, k, _ = _runs(n=70, d=8)
    got = reference.delta_keep_mask(k, threshold=1.5, chunk=20)
    for b in range(2):
        for h in range(2):
            for c0 in range(0, 70, 20):
                anchor = k[b, h, c0].double()
                assert bool(got[b, h, c0])
                for i in range(c0 + 1, min(c0 + 20, 70)):
                    dist = float(torch.linalg.vector_norm(k[b, h, i].double() - anchor))
                    assert bool(got[b, h, i]) == (dist > 1.5), (b, h, i, dist)
                    if dist > 1.5:
                        anchor = k[b, h, i].double()


def test_cosine_metric() -> None:
    x = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [-1.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
    k = x.view(1, 1, 6, 2)
    keep = reference.delta_keep_mask(k, threshold=0.9, metric="cosine", chunk=6)
    # 1: cos 0.995 >= 0.9 dropped; 2: cos 0 kept; 3: cos 0 vs (0, 1) kept; 4: zero vs (-1, 0):
    # similarity 0, kept; 5: zero vs zero: similarity 1, dropped.
    assert keep[0, 0].tolist() == [True, False, True, True, True, False]
    # threshold -1: every key is at least that similar: one anchor per chunk.
    assert reference.delta_keep_mask(k, threshold=-1.0, metric="cosine", chunk=4)[0, 0].tolist() == \
        [True, False, False, False, True, False]


def test_threshold_extremes_and_chunks() -> None:
    _, k, _ = _runs(n=100)
    # 0: only identical neighbours are dropped (none here), so every key is an anchor.
    assert bool(reference.delta_keep_mask(k, threshold=0.0).all())
    dup = k.clone()
    dup[0, 0, 11] = dup[0, 0, 10]
    keep = reference.delta_keep_mask(dup, threshold=0.0)
    assert not bool(keep[0, 0, 11]) and int(keep.sum()) == keep.numel() - 1
    # huge: one anchor per chunk; chunk 1: every key; chunk > N: one chunk.
    huge = reference.delta_keep_mask(k, threshold=1e6, chunk=16)
    assert torch.equal(huge, (torch.arange(100) % 16 == 0).expand_as(huge))
    assert bool(reference.delta_keep_mask(k, threshold=1e6, chunk=1).all())
    assert int(reference.delta_keep_mask(k, threshold=1e6, chunk=10**9).sum()) == 4


def test_nan_key_is_its_own_anchor() -> None:
    _, k, _ = _runs(n=60)
    k[1, 0, 33, 2] = math.nan
    keep = reference.delta_keep_mask(k, threshold=1e6, chunk=64)
    assert bool(keep[1, 0, 33]) and bool(keep[1, 0, 34]), "NaN fails every test: kept, and so is the next key"


def test_tree_sum_order() -> None:
    x = torch.tensor([1e16, 1.0, -1e16, 1.0], dtype=torch.float64)
    # ((1e16 + 1) + (-1e16 + 1)) in float64: 1e16 + 1 rounds to 1e16, -1e16 + 1 to -1e16 + 2? no: to -1e16.
    assert float(tree_sum(x)) == float((x[0] + x[1]) + (x[2] + x[3]))
    assert float(tree_sum(torch.ones(5, dtype=torch.float64))) == 5.0
    assert bool(is_dropped(torch.ones(3), torch.ones(3), 0.0, "euclidean"))


@pytest.mark.parametrize("metric,threshold", [("euclidean", 1.0), ("euclidean", 3.0), ("cosine", 0.9),
                                              ("cosine", 0.2), ("cosine", -0.3)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fast_keep_mask_and_packing_are_bit_identical(metric: str, threshold: float, dtype: torch.dtype) -> None:
    _, k, v = _runs(n=90, d=24, dtype=dtype)
    k[0, 1, 40] = 0.0
    k[0, 1, 41] = 0.0
    ref = reference.delta_keep_mask(k, threshold=threshold, metric=metric, chunk=37)
    got = fast.delta_keep_mask(k, threshold=threshold, metric=metric, chunk=37)
    assert torch.equal(ref, got)
    a, b = reference.delta_pack(k, v, ref, block=16), fast.delta_pack(k, v, got, block=16)
    for name in ("counts", "timestamps", "offsets", "lengths"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert torch.equal(a.k.view(torch.int16), b.k.view(torch.int16))
    assert torch.equal(a.v.view(torch.int16), b.v.view(torch.int16))


# -- Stage 2 ---------------------------------------------------------------------


def test_packing_layout() -> None:
    _, k, v = _runs(n=50)
    keep = reference.delta_keep_mask(k, threshold=2.0, chunk=20)
    packed = reference.delta_pack(k, v, keep, block=16)
    assert packed.offsets[0] == 0 and int(packed.offsets[-1]) == packed.k.shape[0]
    for b in range(2):
        for h in range(2):
            rows = packed.segment(b, h)
            m = int(packed.lengths[b, h])
            assert (rows.stop - rows.start) % 16 == 0 and rows.stop - rows.start >= m
            pos = keep[b, h].nonzero().squeeze(-1)
            assert torch.equal(packed.k[rows][:m], k[b, h, pos])
            counts = packed.counts[rows]
            assert int(counts.sum()) == 50 and bool((counts[m:] == 0).all())
            assert torch.equal(packed.timestamps[rows], (torch.cumsum(counts, 0) - 1).to(torch.int32))
            # Runs end where the next anchor (or the sequence) starts; chunk starts are anchors.
            assert torch.equal(packed.timestamps[rows][:m] + 1, torch.cat([pos[1:], torch.tensor([50])]).int())
    assert torch.equal(packed.keep_ratio(), keep.double().mean(dim=-1))


# -- Stage 3 and the phases -------------------------------------------------------


def test_count_weighted_softmax_equals_attention_over_expanded_keys() -> None:
    """Eq. 4: anchors weighted by their run length == every anchor repeated over its run."""
    q, k, v = (t.double() for t in _runs(n=120))
    packed = reference.delta_pack(k, v, reference.delta_keep_mask(k, threshold=2.0, chunk=40), block=16)
    k_exp, v_exp = expand_packed(packed)
    # With the diagonal packed too, every causal position is read through its anchor.
    out = reference.delta_kv_attention(q, k, v, packed, block_m=16, exact_diagonal=False)
    torch.testing.assert_close(out, reference.attention(q, k_exp, v_exp), rtol=0, atol=1e-12)
    # And directly: one row against the anchors of its history with log-count bias.
    row, hist = q[0, 0, 119], int(packed.lengths[0, 0])
    anchors = packed.k[packed.segment(0, 0)][:hist]
    logits = anchors @ row / 4.0 + torch.log(packed.counts[packed.segment(0, 0)][:hist].double())
    weights = torch.softmax(logits, 0)
    expanded = torch.softmax(k_exp[0, 0] @ row / 4.0, 0)
    torch.testing.assert_close(weights @ packed.v[packed.segment(0, 0)][:hist], expanded @ v_exp[0, 0],
                               rtol=0, atol=1e-12)


def test_phases_cover_every_causal_key_once() -> None:
    q, k, v = _runs(n=160, run=3)
    packed = reference.delta_pack(k, v, reference.delta_keep_mask(k, threshold=2.0, chunk=64), block=4)
    plan1, plan2 = reference.delta_kv_plans(q, packed, block_m=32)
    safe, cut = safe_blocks(packed, block_m=32)
    assert int(safe.max()) > 0, "the workload must exercise phase 1"
    for b in range(2):
        for h in range(4):
            g = h // 2
            stamps = packed.timestamps[packed.segment(b, g)]
            for i in range(5):
                r0 = 32 * i
                s = int(plan1.block_count[b, h, i])
                assert s == int(safe[b, g, i])
                # Phase 1 blocks end before the query block; the next one does not.
                if s:
                    assert int(stamps[s * 4 - 1]) < r0 and int(cut[b, g, i]) == int(stamps[s * 4 - 1]) + 1
                if s * 4 < stamps.numel():
                    assert int(stamps[(s + 1) * 4 - 1]) >= r0
                covered_by_anchors = int(cut[b, g, i])
                exact = plan2.to_dense_mask()[b, h, r0]
                assert torch.equal(exact.nonzero().squeeze(-1), torch.arange(covered_by_anchors, r0 + 1))


@pytest.mark.parametrize("count_weighted,exact_diagonal", [(True, True), (False, True), (True, False)])
def test_fast_matches_reference_end_to_end(count_weighted: bool, exact_diagonal: bool) -> None:
    q, k, v = _runs(n=130, run=4, d=16)
    params = {"threshold": 2.0, "chunk": 64, "block_m": 32, "block_n": 16,
              "count_weighted": count_weighted, "exact_diagonal": exact_diagonal}
    golden = reference.delta_kv(*(t.double() for t in (q, k, v)), **params)
    got = fast.delta_kv(q, k, v, **params)
    assert float((got.double() - golden).abs().max()) < 4e-3
    q64 = q.double()
    packed = reference.delta_pack(k, v, reference.delta_keep_mask(k, threshold=2.0, chunk=64), block=16)
    assert int(safe_blocks(packed, block_m=32)[0].max()) > 0, "the workload must exercise phase 1"
    assert torch.equal(reference.delta_kv_density(q64, packed, block_m=32),
                       fast.delta_kv_density(q, fast.delta_pack(k, v, fast.delta_keep_mask(
                           k, threshold=2.0, chunk=64), block=16), block_m=32))


def test_threshold_zero_is_dense_attention() -> None:
    q, k, v = (t.double() for t in _runs(n=90))
    out = reference.delta_kv(q, k, v, threshold=0.0, block_m=16, block_n=16)
    torch.testing.assert_close(out, reference.attention(q, k, v), rtol=0, atol=1e-12)


def test_ablations_change_the_output_as_described() -> None:
    q, k, v = (t.double() for t in _runs(n=200, run=8))
    base = {"threshold": 2.5, "chunk": 64, "block_m": 32, "block_n": 16}
    exact = reference.attention(q, k, v)
    full = reference.delta_kv(q, k, v, **base)
    flat = reference.delta_kv(q, k, v, **base, count_weighted=False)
    packed_all = reference.delta_kv(q, k, v, **base, exact_diagonal=False)
    assert not torch.allclose(full, flat) and not torch.allclose(full, packed_all)
    # Without phase 2 the local window is approximated too: further from dense attention.
    assert reference.relative_error(packed_all, exact) > reference.relative_error(full, exact)


# -- checks ------------------------------------------------------------------------


@pytest.mark.parametrize("impl", [reference, fast])
def test_bad_arguments(impl: object) -> None:
    q, k, v = _runs(n=40)
    mod = impl
    with pytest.raises(ValueError, match="metric"):
        mod.delta_keep_mask(k, threshold=1.0, metric="manhattan")  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="threshold"):
        mod.delta_keep_mask(k, threshold=-1.0)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="threshold"):
        mod.delta_keep_mask(k, threshold=math.nan)  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="threshold"):
        mod.delta_keep_mask(k, threshold="1")  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="chunk"):
        mod.delta_keep_mask(k, threshold=1.0, chunk=0)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="k"):
        mod.delta_keep_mask(k[0], threshold=1.0)  # type: ignore[attr-defined]
    keep = reference.delta_keep_mask(k, threshold=1.0)
    with pytest.raises(ValueError, match="keep"):
        mod.delta_pack(k, v, keep[:, :1])  # type: ignore[attr-defined]
    bad = keep.clone()
    bad[0, 0, 0] = False
    with pytest.raises(ValueError, match="first key"):
        mod.delta_pack(k, v, bad)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="block"):
        mod.delta_pack(k, v, keep, block=0)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="v must match"):
        mod.delta_pack(k, v[:, :, :-1], keep)  # type: ignore[attr-defined]
    packed = reference.delta_pack(k, v, keep, block=16)
    with pytest.raises(TypeError, match="packed"):
        mod.delta_kv_plans(q, "packed")  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="does not fit"):
        mod.delta_kv_plans(q[:1], packed)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="block_m"):
        mod.delta_kv_plans(q, packed, block_m=0)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="packed must come from keys"):
        mod.delta_kv_attention(q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], packed)  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="exact_diagonal"):
        mod.delta_kv(q, k, v, threshold=1.0, exact_diagonal=1)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="does not fit"):
        mod.delta_kv_density(q[:1], packed)  # type: ignore[attr-defined]
