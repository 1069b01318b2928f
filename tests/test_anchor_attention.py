"""AnchorAttention: the paper's algorithm boxes transcribed literally against our
0-indexed reading, Equation 1's anchor, Equation 2's inclusive threshold, the group
union, the plan invariants, the resumed stripe pass, fast against reference, the
tie check, head groups and argument checks."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from sparseprefill import fast, reference
from sparseprefill.conformance import tolerance
from sparseprefill.conformance.tolerance import nan_poisoned_empty
from sparseprefill.conformance.registry import METHODS
from sparseprefill.conformance.ties import anchor_attention_tie_check
from sparseprefill.fast.kernels.anchor_stripes import search_width_bound, stripe_index
from sparseprefill.reference.plan import BlockColumnPlan, cdiv

# The modules (the packages re-export functions of the same names).
ref_anchor = importlib.import_module("sparseprefill.reference.anchor_attention")
fast_anchor = importlib.import_module("sparseprefill.fast.anchor_attention")


def _qkv(b: int = 1, hq: int = 2, hkv: int = 1, n: int = 111, d: int = 32, *, seed: int = 0,
         dtype: torch.dtype = torch.float16, q_scale: float = 2.0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, n, d, generator=gen) * q_scale).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    return q, k, v


# -- the algorithm boxes, literally (1-indexed) ------------------------------------------


def _alg1_literal(i: int, *, step: int, r: int, t_n: int) -> set[int]:
    """Alg. 1's key blocks of query block i, 1-indexed, exactly as printed (lines 3, 8-10)."""
    j_start = max(2, (i - 1) // step * step * r)
    j_end = min(i * r, t_n)
    return {1} | set(range(j_start, j_end + 1))


def _alg2_literal(i: int, *, step: int, r: int) -> set[int]:
    """Alg. 2's searched key blocks of group i, 1-indexed, as printed (lines 7-8)."""
    j_end = (i - 1) * step * r
    return set(range(2, j_end + 1))


@pytest.mark.parametrize("n,bm,bn,step", [(4096, 128, 128, 16), (1000, 64, 16, 3), (777, 32, 32, 1),
                                          (640, 128, 64, 2), (300, 16, 16, 5)])
def test_window_is_alg1_read_0_indexed(n: int, bm: int, bn: int, step: int) -> None:
    """Our window starts at the group's first row; the printed j_start is one block earlier,
    and that block is the last one Alg. 2 searches: read literally, Alg. 3 counts it twice."""
    r = bm // bn
    qb, kb = cdiv(n, bm), cdiv(n, bn)
    ours = ref_anchor.anchor_blocks(n, step=step, block_m=bm, block_n=bn)
    region = ref_anchor.search_region(n, step=step, block_m=bm, block_n=bn)
    overlaps = 0
    for i0 in range(qb):
        g = i0 // step
        literal = {j - 1 for j in _alg1_literal(i0 + 1, step=step, r=r, t_n=kb)}
        mine = set(ours[i0].nonzero().flatten().tolist())
        extra = literal - mine
        # The only difference: the block before the group's first row (0-indexed g*step*r - 1).
        assert mine <= literal
        assert extra <= {g * step * r - 1}
        searched = {j - 1 for j in _alg2_literal(g + 1, step=step, r=r)}
        region_blocks = set((region[g].nonzero().flatten() // bn).tolist())
        assert region_blocks == searched, (i0, region_blocks, searched)
        assert not (mine & searched)
        overlaps += bool(literal & searched)
    if n // (bm * step) >= 2:
        assert overlaps > 0  # the literal reading does overlap Alg. 2's search


@pytest.mark.parametrize("n,bm,bn,step", [(1, 16, 16, 1), (111, 48, 16, 2), (129, 16, 48, 3),
                                          (200, 32, 64, 1), (257, 64, 48, 7), (63, 128, 16, 16)])
def test_anchor_and_search_partition_the_causal_keys(n: int, bm: int, bn: int, step: int) -> None:
    """Every causal key of every row is in exactly one of: its anchor blocks, its group's region."""
    blocks = ref_anchor.anchor_blocks(n, step=step, block_m=bm, block_n=bn)
    region = ref_anchor.search_region(n, step=step, block_m=bm, block_n=bn)
    anchor_keys = blocks.repeat_interleave(bn, dim=1)[:, :n].repeat_interleave(bm, dim=0)[:n]
    search_keys = region.repeat_interleave(step * bm, dim=0)[:n]
    causal = torch.ones(n, n, dtype=torch.bool).tril_()
    assert not bool((anchor_keys & search_keys).any())
    assert not bool((search_keys & ~causal).any())  # stripes precede the group's first row
    assert torch.equal((anchor_keys | search_keys) & causal, causal)
    count, index = fast_anchor.anchor_block_lists(n, step=step, block_m=bm, block_n=bn, device="cpu")
    lists = BlockColumnPlan.from_masks(blocks[None, None], None, seqlen=n, block_m=bm, block_n=bn)
    assert torch.equal(count, lists.block_count[0, 0])
    assert torch.equal(torch.where(torch.arange(index.shape[1]) < count[:, None], index, 0),
                       torch.where(torch.arange(index.shape[1]) < count[:, None],
                                   lists.block_index[0, 0, :, : index.shape[1]], 0))


def _alg2_literal_stripes(q: torch.Tensor, k: torch.Tensor, x_a: torch.Tensor, *, theta: float,
                          step: int, bm: int, scale: float) -> set[tuple[int, int]]:
    """Alg. 2 lines 1-14 with Equation 2's <=, loops as printed (one head, bm == bn), 0-indexed."""
    n = q.shape[0]
    qb = cdiv(n, bm)
    kept = set()
    for g in range(cdiv(qb, step)):
        j_end = g * step  # key blocks 1 .. g*step*r - 1 (0-indexed), r = 1
        for i in range(g * step, min(qb, (g + 1) * step)):
            rows = slice(i * bm, min(n, (i + 1) * bm))
            q_mean = q[rows].double().mean(dim=0)
            a_mean = x_a[rows].double().mean()
            for j in range(1, j_end):
                for key in range(j * bm, (j + 1) * bm):
                    if a_mean - scale * float(q_mean @ k[key].double()) <= theta:
                        kept.add((g, key))
    return kept


def test_stripes_are_alg2_literal_group_union() -> None:
    q, k, _ = _qkv(n=100, d=16, seed=3)
    bm, step, theta, scale = 16, 2, 3.0, 0.25
    plan = reference.anchor_attention_plan(q, k, theta=theta, step=step, block_m=bm, block_n=bm,
                                           scale=scale)
    blocks = ref_anchor.anchor_blocks(100, step=step, block_m=bm, block_n=bm)
    x_a = ref_anchor.anchor_scores(q, k, blocks, block_n=bm, block_m=bm, scale=scale)
    for h in range(2):
        want = _alg2_literal_stripes(q[0, h], k[0, 0], x_a[0, h], theta=theta, step=step, bm=bm,
                                     scale=scale)
        got = set()
        for g in range(plan.num_column_rows):
            count = int(plan.column_count[0, h, g * step])
            got |= {(g, int(j)) for j in plan.column_index[0, h, g, :count]}
        assert got == want and 0 < len(got) < 16 + 48 + 80  # not empty, not everything


def test_stripe_bits_and_row_max_switches_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """One scoring pass (the fill reads the counting pass's bits) and the row-max anchor
    pass give the plan of the earlier designs (scores recomputed, full anchor pass)."""
    stripes = importlib.import_module("sparseprefill.fast.kernels.anchor_stripes")
    q, k, _ = _qkv(b=1, hq=1, hkv=1, n=200, d=16, seed=4)  # 4 groups: the last reaches key tile 1
    args = dict(theta=4.0, step=2, block_m=32, block_n=16, scale=0.25)
    new = fast_anchor.anchor_attention_plan(q, k, **args)
    monkeypatch.setattr(stripes, "STRIPE_BITS", False)
    monkeypatch.setattr(fast_anchor, "ANCHOR_ROW_MAX", False)
    old = fast_anchor.anchor_attention_plan(q, k, **args)
    kept = int(new.column_count[0, 0, ::2].sum())
    assert 0 < kept < int(new.column_count.shape[2]) // 2 * 128, kept  # some stripes, not all
    for name in ("block_count", "block_index", "column_count", "column_index"):
        assert torch.equal(getattr(new, name), getattr(old, name)), name


def test_x_a_is_equation_1_and_the_anchor_state_max() -> None:
    q, k, v = _qkv(b=2, hq=4, hkv=2, n=97, d=32, seed=5)
    bm, bn, step, scale = 32, 16, 2, 0.3
    blocks = ref_anchor.anchor_blocks(97, step=step, block_m=bm, block_n=bn)
    x_a = ref_anchor.anchor_scores(q, k, blocks, block_n=bn, block_m=bm, scale=scale)
    # Equation 1 by brute force on a few rows: max over the anchor keys of scale * q . k.
    for b, h, row in [(0, 0, 0), (1, 3, 40), (0, 2, 96), (1, 1, 64)]:
        keys = [c for c in range(row + 1) if bool(blocks[row // bm, c // bn])]
        want = max(scale * float(q[b, h, row].double() @ k[b, h // 2, c].double()) for c in keys)
        assert x_a[b, h, row].item() == pytest.approx(want, rel=1e-12, abs=1e-12)
    # It is the running max of the anchor pass's state (natural-log units, scaled logits).
    sizes = dict(seqlen=97, step=step, block_m=bm, block_n=bn)
    empty = torch.zeros(2, 4, cdiv(cdiv(97, bm), step), 97, dtype=torch.bool)
    anchor_only = ref_anchor.anchor_plan_from_stripes(empty, **sizes)
    state = reference.AttentionState.like(q, dtype=torch.float64)
    reference.sparse_attention(q, k, v, anchor_only, scale=scale, state=state)
    torch.testing.assert_close(state.m, x_a, rtol=1e-12, atol=1e-12)
    fast_state = fast.AttentionState.like(q)
    fast.sparse_attention(q, k, v, anchor_only, scale=scale, state=fast_state)
    torch.testing.assert_close(fast_state.m.double(), x_a, rtol=1e-5, atol=1e-5)


def test_plan_is_grouped_disjoint_and_causal() -> None:
    q, k, _ = _qkv(b=2, hq=2, hkv=1, n=150, d=32, seed=7)
    for impl in (reference, fast):
        plan = impl.anchor_attention_plan(q, k, theta=3.0, step=3, block_m=16, block_n=32)
        assert plan.column_group == 3 and plan.columns_disjoint
        qb = cdiv(150, 16)
        assert tuple(plan.column_index.shape[:3]) == (2, 2, cdiv(qb, 3))
        plan.validate()  # checks columns_disjoint and causality
        owner = torch.arange(qb) // 3
        first_row = (owner * 3 * 16)[None, None, :, None]
        cols = plan.query_block_columns()
        valid = torch.arange(cols.shape[-1]) < plan.column_count.unsqueeze(-1)
        assert bool((cols[valid[..., :]] < first_row.expand_as(cols)[valid]).all())
        assert int(plan.column_count.sum()) > 0


@pytest.mark.parametrize("theta,density", [(0.0, None), (math.inf, 1.0), (1e9, 1.0)])
def test_theta_extremes(theta: float, density: float | None) -> None:
    q, k, _ = _qkv(n=129, d=32, seed=11)
    for impl in (reference, fast):
        plan = impl.anchor_attention_plan(q, k, theta=theta, step=2, block_m=16, block_n=16)
        got = float(impl.density(plan).mean())
        if density is not None:
            assert got == density
        else:
            anchor = impl.anchor_attention_plan(q, k, theta=0.0, step=2, block_m=16, block_n=16)
            assert 0 < got < 1 and got == float(impl.density(anchor).mean())


def _split(plan: BlockColumnPlan) -> tuple[BlockColumnPlan, BlockColumnPlan]:
    """The anchor-only and stripe-only parts of an anchor plan."""
    b, h, qb = plan.block_count.shape
    zero = torch.zeros(b, h, qb, dtype=torch.int32)
    anchor = BlockColumnPlan(seqlen=plan.seqlen, block_m=plan.block_m, block_n=plan.block_n,
                             block_count=plan.block_count, block_index=plan.block_index,
                             column_count=zero, column_index=plan.column_index,
                             columns_disjoint=True, column_group=plan.column_group).validate()
    stripes = BlockColumnPlan(seqlen=plan.seqlen, block_m=plan.block_m, block_n=plan.block_n,
                              block_count=zero, block_index=plan.block_index,
                              column_count=plan.column_count, column_index=plan.column_index,
                              columns_disjoint=True, column_group=plan.column_group).validate()
    return anchor, stripes


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_resumed_stripe_pass_equals_one_pass_with_the_same_lse(dtype: torch.dtype) -> None:
    q, k, v = _qkv(b=2, hq=2, hkv=1, n=111, d=32, seed=13, dtype=dtype)
    params = dict(theta=2.0, step=2, block_m=32, block_n=16)
    plan = reference.anchor_attention_plan(q, k, **params)
    anchor, stripes = _split(plan)
    mask = plan.to_dense_mask()
    golden = tolerance.golden_attention(q, k, v, mask)
    baseline = tolerance.baseline_attention(q, k, v, mask)
    with nan_poisoned_empty():
        state = fast.AttentionState.like(q)
        fast.sparse_attention(q, k, v, anchor, state=state)
        out, lse = fast.sparse_attention(q, k, v, stripes, state=state, return_lse=True)
        one, one_lse = fast.sparse_attention(q, k, v, plan, return_lse=True)
        run = fast.anchor_attention(q, k, v, **params)
    assert tolerance.check_attention(out, lse, golden, baseline) <= 1.0
    assert tolerance.check_attention(one, one_lse, golden, baseline) <= 1.0
    assert tolerance.check_attention(run, None, golden, baseline) <= 1.0
    # The reference's resumed run (Alg. 3) is the one pass, to float64 rounding.
    q64, k64, v64 = (t.double() for t in (q, k, v))
    resumed = reference.anchor_attention(q64, k64, v64, **params)
    torch.testing.assert_close(resumed, reference.sparse_attention(q64, k64, v64, plan),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("b,hq,hkv,n,d,bm,bn,step,theta,dtype", [
    (2, 2, 1, 63, 64, 16, 16, 1, 4.0, torch.float16),
    (1, 2, 1, 129, 128, 32, 48, 2, 12.0, torch.bfloat16),
    (1, 2, 2, 1, 64, 16, 16, 16, 12.0, torch.float16),
    (2, 2, 1, 111, 64, 48, 16, 5, 1.0, torch.bfloat16),
    (2, 2, 1, 200, 32, 16, 16, 2, 1e9, torch.float16),  # every search key a stripe: whole blocks promoted
])
def test_fast_matches_reference(b: int, hq: int, hkv: int, n: int, d: int, bm: int, bn: int,
                                step: int, theta: float, dtype: torch.dtype) -> None:
    q, k, v = _qkv(b=b, hq=hq, hkv=hkv, n=n, d=d, seed=n, dtype=dtype)
    params = dict(theta=theta, step=step, block_m=bm, block_n=bn)
    expected = reference.anchor_attention_plan(q, k, **params)
    got = fast.anchor_attention_plan(q, k, **params)
    if not expected.equal(got):
        anchor_attention_tie_check(q, k, params, expected, got)
    mask = got.to_dense_mask()
    golden = tolerance.golden_attention(q, k, v, mask)
    baseline = tolerance.baseline_attention(q, k, v, mask)
    with nan_poisoned_empty():
        out = fast.anchor_attention(q, k, v, **params)
    assert tolerance.check_attention(out, None, golden, baseline) <= 1.0
    if theta == 1e9:  # the run promoted whole stripe blocks: check there were some
        _, stripes = _split(got)
        assert int(stripes.with_full_blocks().block_count.sum()) > 0


def _tie_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """x_a = 4 everywhere; group 2 (step 1, blocks of 16) may keep key 20 (difference exactly
    2) and key 21 (difference 0.5)."""
    q = torch.zeros(1, 1, 64, 16)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 64, 16)
    k[0, 0, 0, 0] = 4.0
    k[0, 0, 20, 0] = 2.0
    k[0, 0, 21, 0] = 3.5
    return q.half(), k.half()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_threshold_is_inclusive(dtype: torch.dtype) -> None:
    """A key whose pooled score is exactly `theta` below the pooled anchor is kept (Eq. 2's <=)."""
    q, k = (t.to(dtype) for t in _tie_inputs())
    for impl in (reference, fast):
        kept = impl.anchor_attention_plan(q, k, theta=2.0, step=1, block_m=16, block_n=16, scale=1.0)
        cols = kept.query_block_columns()[0, 0, 2, : int(kept.column_count[0, 0, 2])].tolist()
        assert cols == [20, 21], (impl.__name__, cols)
        below = impl.anchor_attention_plan(q, k, theta=1.999, step=1, block_m=16, block_n=16,
                                           scale=1.0)
        cols = below.query_block_columns()[0, 0, 2, : int(below.column_count[0, 0, 2])].tolist()
        assert cols == [21], (impl.__name__, cols)


def test_tie_check_accepts_ties_and_rejects_real_differences() -> None:
    q, k = _tie_inputs()
    params = dict(theta=2.0, step=1, block_m=16, block_n=16, scale=1.0)
    plan = reference.anchor_attention_plan(q, k, **params)
    anchor_attention_tie_check(q, k, params, plan, plan)

    def without(key: int) -> BlockColumnPlan:
        count, index = plan.column_count.clone(), plan.column_index.clone()
        keep = [int(c) for c in index[0, 0, 2, : count[0, 0, 2]] if int(c) != key]
        index[0, 0, 2, : len(keep)] = torch.tensor(keep, dtype=torch.int32)
        count[0, 0, 2] = len(keep)
        return BlockColumnPlan(seqlen=64, block_m=16, block_n=16, block_count=plan.block_count,
                               block_index=plan.block_index, column_count=count, column_index=index,
                               columns_disjoint=True, column_group=1)

    anchor_attention_tie_check(q, k, params, plan, without(20))  # difference == theta: a tie
    with pytest.raises(AssertionError, match="beyond the margin"):
        anchor_attention_tie_check(q, k, params, plan, without(21))


def test_head_groups_give_the_same_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a tiny plan budget the run goes head by head (GQA slices): the same numbers."""
    q, k, v = _qkv(b=1, hq=4, hkv=2, n=64, d=16, seed=19)
    params = dict(theta=3.0, step=1, block_m=16, block_n=16)
    whole = fast.anchor_attention(q, k, v, **params)
    monkeypatch.setattr(fast_anchor, "PLAN_BYTES", 1)
    with nan_poisoned_empty():
        parts = fast.anchor_attention(q, k, v, **params)
    assert torch.equal(whole, parts)


def test_plan_memory_is_one_list_per_group() -> None:
    q, k, _ = _qkv(hq=2, n=256, d=32, seed=23)
    plan = fast.anchor_attention_plan(q, k, theta=4.0, step=4, block_m=16, block_n=16)
    width = plan.column_index.shape[-1]
    assert plan.column_index.shape[2] == 4  # 16 query blocks, groups of 4
    assert plan.column_index.untyped_storage().nbytes() == 4 * 2 * 4 * width
    assert fast_anchor.stripe_plan_nbytes(1, 2, 256, step=4, block_m=16, width=width) == \
        plan.column_count.untyped_storage().nbytes() + plan.column_index.untyped_storage().nbytes()
    assert width <= search_width_bound(256, step=4, block_m=16, block_n=16) == 176
    # 128K tokens, 32 heads, blocks of 128, step 16: the bound per head is 32 MB.
    per_head = fast_anchor.stripe_plan_nbytes(1, 1, 131072, step=16, block_m=128,
                                              width=search_width_bound(131072, step=16, block_m=128,
                                                                       block_n=128))
    assert per_head < 33 * 2**20 and fast_anchor.PLAN_BYTES // per_head == 8


def test_bad_arguments_are_rejected_before_any_launch() -> None:
    q, k, v = _qkv(n=40)
    for impl in (reference, fast):
        with pytest.raises(ValueError, match="theta must be >= 0"):
            impl.anchor_attention_plan(q, k, theta=-1.0)
        with pytest.raises(ValueError, match="theta must be >= 0"):
            impl.anchor_attention(q, k, v, theta=math.nan)
        with pytest.raises(TypeError, match="theta must be a float"):
            impl.anchor_attention_plan(q, k, theta="12")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="theta must be a float"):
            impl.anchor_attention_plan(q, k, theta=True)
        with pytest.raises(ValueError, match="step must be >= 1"):
            impl.anchor_attention(q, k, v, step=0)
        with pytest.raises(TypeError, match="block_n must be an int"):
            impl.anchor_attention_plan(q, k, block_n=16.0)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="k must have shape"):
            impl.anchor_attention_plan(q, k[:, :, :30])
    with pytest.raises(ValueError, match="block_m must be a multiple of 16"):
        fast.anchor_attention(q, k, v, block_m=24)
    with pytest.raises(TypeError, match="q must have dtype"):
        fast.anchor_attention_plan(q.float(), k.float())
    with pytest.raises(ValueError, match="x_a must be a float32 tensor"):
        stripe_index(q, k, torch.zeros(1, 2, 39), theta=1.0, step=1, block_m=16, block_n=16, scale=1.0)


def test_absurd_step_is_one_group() -> None:
    q, k, _ = _qkv(n=70, d=16, seed=29)
    for impl in (reference, fast):
        huge = impl.anchor_attention_plan(q, k, theta=2.0, step=10**15, block_m=16, block_n=16)
        # Capped at the query blocks before any arithmetic (docs/robustness.md): 70 / 16 -> 5.
        assert huge.column_group == 5 and huge.equal(
            impl.anchor_attention_plan(q, k, theta=2.0, step=5, block_m=16, block_n=16))


def test_registered() -> None:
    spec = METHODS["anchor_attention"]
    assert spec.fast_run is fast.anchor_attention and not spec.exact_plans
    assert spec.demo_params(800) == {"step": 1} and spec.demo_params(131072) == {"step": 16}


def test_transformers_patch() -> None:
    """`patch(model, "anchor_attention")`: theta = inf keeps every key (the logits of SDPA);
    theta = 0 drops some (logits differ)."""
    for module in ("transformers", "gguf", "accelerate"):
        pytest.importorskip(module)
    from test_integration_transformers import _ids, _logits, _tiny

    from sparseprefill.integrations.transformers import patch, unpatch

    model = _tiny("llama")
    ids = _ids(1, 96)
    ref = _logits(model, ids)
    blocks = {"block_m": 16, "block_n": 16, "step": 1}
    attn = patch(model, "anchor_attention", {"theta": math.inf, **blocks}, backend="reference",
                 min_seqlen=1)
    torch.testing.assert_close(_logits(model, ids), ref, rtol=0, atol=1e-5)
    assert attn.calls == {"sparse": 2}
    unpatch(model)
    patch(model, "anchor_attention", {"theta": 0.0, **blocks}, backend="reference", min_seqlen=1)
    assert (_logits(model, ids) - ref).abs().max() > 1e-3
    unpatch(model)
