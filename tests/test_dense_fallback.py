"""The per-head dense fallback: the plan's `dense_heads`, the break-even rule, its rates, the early exit.

On the CPU the rule is off unless a table is given (`dense_fallback(rates=...)`); these tests
give a fixed table, so the decisions are exact and the same in both packages.
"""

from __future__ import annotations

import importlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from sparseprefill import fast, reference
from sparseprefill.fast.attention import dense_heads_into
from sparseprefill.reference import dense_fallback as rule
from sparseprefill.reference.dense_fallback import RatePoint, RateTable, dense_fallback
from sparseprefill.reference.plan import BlockColumnPlan, stack_plans

B, HQ, HKV, N, D = 2, 4, 2, 200, 32


def qkv(seed: int = 0, dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, N, D, generator=g).to(dtype)
    k = torch.randn(B, HKV, N, D, generator=g).to(dtype)
    v = torch.randn(B, HKV, N, D, generator=g).to(dtype)
    q[:, :2] *= 4  # heads 0, 1 peaked (sparse plans), heads 2, 3 flat (dense-ish plans)
    return q, k, v


def table(ratio: float = 0.6, program_us: float = 0.0, sdpa: float = 0.0) -> RateTable:
    """Block pairs cost 1 ps, dense pairs through our kernel `ratio` ps, through one SDPA call
    over the layer `sdpa` ps (0: no SDPA rate): with no program cost a head runs dense iff
    its kept share is >= ratio, and the layer goes to SDPA iff the mean over the heads of
    min(share, ratio) is >= sdpa."""
    pts = tuple(RatePoint(256, D, dt, tile, 1.0, 1.0, 1.0, program_us, sdpa, ratio)
                for dt in ("float16", "bfloat16") for tile in (16, 32, 64, 128))
    return RateTable("toy", "tests", pts)


class SdpaSpy:
    """Records the query heads of every torch SDPA call (and forwards it)."""

    def __init__(self) -> None:
        self.heads: list[int] = []
        self.real = torch.nn.functional.scaled_dot_product_attention

    def __call__(self, q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.heads.append(int(q.shape[1]))
        return self.real(q, *args, **kwargs)


def force_sdpa(monkeypatch: pytest.MonkeyPatch) -> SdpaSpy:
    """SDPA taken as the faster dense path on the CPU (the branch CUDA takes), every call seen."""
    spy = SdpaSpy()
    monkeypatch.setattr(importlib.import_module("sparseprefill.fast.attention"), "sdpa_is_faster",
                        lambda *a, **kw: True)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return spy


def streaming(q: torch.Tensor, k: torch.Tensor) -> BlockColumnPlan:
    return reference.streaming_plan(q, k, sink=16, window=32, block_m=16, block_n=16)


# -- the plan field ----------------------------------------------------------------------


def test_dense_heads_field_is_validated() -> None:
    q, k, _ = qkv()
    plan = streaming(q, k)
    for bad, err in (((2, 1), ValueError), ((4,), ValueError), ((1, 1), ValueError), ([1], TypeError),
                     ((True,), TypeError)):
        odd = BlockColumnPlan(plan.seqlen, plan.block_m, plan.block_n, plan.block_count, plan.block_index,
                              plan.column_count, plan.column_index, dense_heads=bad)  # type: ignore[arg-type]
        with pytest.raises(err, match="dense_heads"):
            odd.validate()


def test_marked_heads_attend_every_causal_key_in_both_packages() -> None:
    q, k, v = qkv()
    plan = streaming(q, k)
    marked = plan.with_dense_heads([2, 0])
    assert marked.dense_heads == (0, 2) and marked.block_count is plan.block_count
    mask, before = marked.to_dense_mask(), plan.to_dense_mask()
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    for h in range(HQ):
        assert torch.equal(mask[:, h], causal.expand(B, N, N) if h in (0, 2) else before[:, h])
    lists = marked.with_dense_lists()
    assert lists.dense_heads == () and torch.equal(lists.to_dense_mask(), mask)
    assert torch.equal(reference.density(marked), fast.density(marked))
    assert torch.equal(fast.density(marked), fast.density(lists))
    ref = reference.sparse_attention(q, k, v, marked)
    assert torch.allclose(reference.sparse_attention(q, k, v, lists).float(), ref.float(), atol=0, rtol=0)
    out = fast.sparse_attention(q, k, v, marked)
    assert (out.float() - ref.float()).abs().max() < 2e-3
    rec = fast.recall(q, k, marked)
    assert torch.allclose(rec[:, [0, 2]], torch.ones_like(rec[:, [0, 2]]))
    assert torch.allclose(rec[:, [1, 3]], fast.recall(q, k, plan)[:, [1, 3]])


def test_equal_rows_stack_and_without_heads() -> None:
    q, k, _ = qkv()
    plan = streaming(q, k)
    marked = plan.with_dense_heads([1])
    assert not marked.equal(plan) and marked.equal(plan.with_dense_heads([1]))
    # The lists of a dense head are not compared.
    assert marked.equal(plan.with_dense_lists().with_dense_heads([1]).with_dense_heads([1]))
    assert marked.rows(32, 64).dense_heads == (1,)
    assert torch.equal(marked.rows(32, 64).to_dense_mask(), marked.to_dense_mask()[:, :, 32:64, :64])
    none = marked.without_heads([1, 3])
    assert none.dense_heads == () and not bool(none.to_dense_mask()[:, [1, 3]].any())
    same = stack_plans([marked.rows(0, N), marked])
    assert same.dense_heads == (1,)
    mixed = stack_plans([marked, plan])
    assert mixed.dense_heads == ()
    assert torch.equal(mixed.to_dense_mask()[:B], marked.to_dense_mask())
    assert torch.equal(mixed.to_dense_mask()[B:], plan.to_dense_mask())


def test_launcher_reads_a_marked_plan_as_its_lists() -> None:
    """The block/column launcher reads lists alone, so it writes the marks into them:
    a marked plan given straight to it (a benchmark timing the kernel part) computes the
    marked heads densely, bit-equal to `with_dense_lists()`."""
    from sparseprefill.fast.kernels import block_column_attention

    q, k, v = qkv()
    marked = streaming(q, k).without_heads([1]).with_dense_heads([1, 3])
    out, lse = block_column_attention(q, k, v, marked, return_lse=True)
    want, want_lse = block_column_attention(q, k, v, marked.with_dense_lists(), return_lse=True)
    assert torch.equal(out, want) and lse is not None and want_lse is not None and torch.equal(lse, want_lse)
    ref = reference.sparse_attention(q.float(), k.float(), v.float(), marked)
    assert float((out.float() - ref).abs().max()) < 2e-3


@pytest.mark.parametrize("heads", [(0, 1, 2, 3), (1,), (0, 1), (1, 3), (0, 2, 3)])
def test_dense_heads_into_never_calls_sdpa_on_part_of_the_layer(heads: tuple[int, ...],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Some heads: our kernel, the others untouched; every head of the layer: one SDPA call
    over all of them (a head group, `layer=False`: our kernel)."""
    spy = force_sdpa(monkeypatch)
    q, k, v = qkv()
    want = reference.attention(q.float(), k.float(), v.float())
    for layer in (True, False):
        out = torch.full_like(q, math.nan)
        dense_heads_into(q, k, v, heads, out, layer=layer)
        for h in range(HQ):
            if h in heads:
                assert float((out[:, h].float() - want[:, h]).abs().max()) < 2e-3
            else:
                assert bool(out[:, h].isnan().all())
    assert spy.heads == ([HQ] if len(heads) == HQ else [])


def test_a_fully_marked_plan_runs_as_one_sdpa_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fast.sparse_attention` / `run_plan`: every head marked: one SDPA call over every head;
    some heads marked: one kernel launch (no SDPA call), the marked heads dense."""
    from sparseprefill.fast.attention import run_plan

    spy = force_sdpa(monkeypatch)
    q, k, v = qkv()
    plan = streaming(q, k)
    want = reference.attention(q.float(), k.float(), v.float())
    out = fast.sparse_attention(q, k, v, plan.with_dense_heads(range(HQ)))
    assert spy.heads == [HQ] and float((out.float() - want).abs().max()) < 2e-3
    part = fast.sparse_attention(q, k, v, plan.with_dense_heads([0, 3]))
    assert spy.heads == [HQ]
    ref = reference.sparse_attention(q.float(), k.float(), v.float(), plan.with_dense_heads([0, 3]))
    assert float((part.float() - ref).abs().max()) < 2e-3
    run_plan(q, k, v, plan.with_dense_heads(range(HQ)), layer=False)  # a head group: no SDPA call
    assert spy.heads == [HQ]


def test_varlen_attention_honours_marked_heads() -> None:
    """The varlen launcher reads lists alone: `fast.varlen_attention` gives a stacked plan's
    marked heads their full causal lists, as the reference's dense mask does."""
    lengths = [37, 90, 64]
    g = torch.Generator().manual_seed(3)
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(total, h, D, generator=g).half() for h in (HQ, HKV, HKV))
    plan = reference.varlen_plans(reference.streaming_plan, q, k, cu, sink=16, window=16, block_m=16,
                                  block_n=16).with_dense_heads([1, 2])
    out = fast.varlen_attention(q, k, v, cu, max(lengths), plan)
    want = reference.varlen_attention(q.float(), k.float(), v.float(), cu, max(lengths), plan)
    assert isinstance(out, torch.Tensor) and isinstance(want, torch.Tensor)
    assert float((out.float() - want.float()).abs().max()) < 2e-3
    unmarked = reference.varlen_attention(q.float(), k.float(), v.float(), cu, max(lengths),
                                          plan.without_heads([1, 2]).with_dense_heads([]))
    assert isinstance(unmarked, torch.Tensor)
    assert float((want - unmarked).abs().max()) > 0.05  # the marks matter on this input


# -- the rule ----------------------------------------------------------------------------


def test_rule_sends_heads_past_break_even_dense() -> None:
    q, k, _ = qkv()
    plan = reference.xattention_plan(q, k, block=32, threshold=[0.5, 0.6, 0.95, 0.99])
    dens = reference.density(plan).sum(0) / B  # batch rows summed, as the rule does
    for ratio in (0.3, 0.6, 0.9):
        got = rule.break_even_heads(plan, head_dim=D, dtype=q.dtype, rates=table(ratio))
        assert got == tuple(h for h in range(HQ) if dens[h] >= ratio - 1e-12)


def test_program_cost_makes_short_lists_lose() -> None:
    q, k, _ = qkv()
    plan = streaming(q, k)
    causal = N * (N + 1) / 2
    assert rule.break_even_heads(plan, head_dim=D, dtype=q.dtype, rates=table(0.99)) == ()
    # Programs of B * ceil(N / 16) query tiles at a cost that alone passes dense.
    heavy = table(0.99, program_us=causal * 0.99 * 1e-6 / math.ceil(N / 16))
    assert rule.break_even_heads(plan, head_dim=D, dtype=q.dtype, rates=heavy) == tuple(range(HQ))


def test_the_layer_goes_to_one_sdpa_call_when_the_heads_best_options_cost_more() -> None:
    """Every head dense iff the heads' best options summed (sparse, or our kernel's dense)
    are not below one SDPA call over the layer; never for a head group (`layer=False`) or
    without an SDPA rate; a marked head is priced dense."""
    q, k, _ = qkv()
    plan = reference.xattention_plan(q, k, block=32, threshold=[0.5, 0.6, 0.95, 0.99])
    dens = (reference.density(plan).sum(0) / B).tolist()
    for ours in (0.6, 2.0):
        best = sum(min(x, ours) for x in dens) / HQ
        by_ours = tuple(h for h in range(HQ) if dens[h] >= ours)
        for sdpa, want in ((best * 0.999, tuple(range(HQ))), (best * 1.001, by_ours)):
            tab = table(ours, sdpa=sdpa)
            assert rule.break_even_heads(plan, head_dim=D, dtype=q.dtype, rates=tab) == want
            assert rule.break_even_heads(plan, head_dim=D, dtype=q.dtype, rates=tab, layer=False) == by_ours
    assert rule.break_even_heads(plan, head_dim=D, dtype=q.dtype, rates=table(2.0)) == ()  # no SDPA rate
    # A head already marked (its lists say 0 pairs) costs our kernel's dense in the layer's sum.
    empty = plan.without_heads([0]).with_dense_heads([0])
    best = (2.0 + sum(dens[1:])) / HQ
    assert rule.break_even_heads(empty, head_dim=D, dtype=q.dtype, rates=table(2.0, sdpa=best * 0.999)) == \
        tuple(range(HQ))
    assert rule.break_even_heads(empty, head_dim=D, dtype=q.dtype, rates=table(2.0, sdpa=best * 1.001)) == (0,)


def test_plan_pairs_counts_from_the_counts() -> None:
    """Blocks exact (the trim of the last listed blocks), disjoint or not; columns bounded by
    `block_m (block_m - 1) / 2` pairs per query block above the exact count; equal plans
    from the two packages count alike."""
    g = torch.Generator().manual_seed(5)
    for bm, bn, p in ((32, 16, 0), (16, 32, 7), (32, 32, 45), (64, 16, 13)):
        qb, kb = math.ceil(N / bm), math.ceil((N + p) / bn)
        last = torch.clamp(torch.arange(qb) * bm + bm, max=N) - 1 + p
        blocks = (torch.rand(B, HQ, qb, kb, generator=g) < 0.4) & (torch.arange(kb)[None, :] * bn <= last[:, None])
        cols = (torch.rand(B, HQ, qb, N + p, generator=g) < 0.05) & (torch.arange(N + p)[None, :] <= last[:, None])
        plan = BlockColumnPlan.from_masks(blocks, cols, seqlen=N, block_m=bm, block_n=bn, query_offset=p)
        for form in (plan, plan.with_disjoint_columns()):
            block, column = rule.plan_pairs(form)
            exact_block, exact_column = rule.kept_pairs(form)
            assert torch.equal(block, exact_block)
            assert bool((column >= exact_column).all())
            assert bool((column - exact_column <= qb * bm * (bm - 1) // 2).all())
        assert torch.equal(rule.plan_pairs(plan)[1], rule.plan_pairs(plan.with_disjoint_columns())[1])
    q, k, _ = qkv()
    params = {"block_m": 32, "block_n": 32, "last_q": 16, "vertical_size": 8, "slash_size": 24}
    ref, got = reference.vertical_slash_plan(q, k, **params), fast.vertical_slash_plan(q, k, **params)
    assert not ref.columns_disjoint and got.columns_disjoint and ref.equal(got)
    assert all(torch.equal(a, b) for a, b in zip(rule.plan_pairs(ref), rule.plan_pairs(got)))


@pytest.mark.parametrize("method, params", [
    ("xattention", {"block": 32, "threshold": [0.5, 0.6, 0.95, 0.99]}),
    ("dpxa", {"block": 32, "threshold": [0.5, 0.6, 0.95, 0.99]}),
    ("flexprefill_vs", {"block_m": 32, "block_n": 32, "last_q": 16, "gamma": [0.5, 0.7, 0.9, 0.99]}),
    ("anchor_attention", {"block_m": 32, "block_n": 32, "step": 2, "theta": [1.0, 2.0, 8.0, 12.0]}),
    ("vertical_slash", {"block_m": 32, "block_n": 32, "last_q": 16, "vertical_size": 8, "slash_size": 24}),
    ("sample_attention", {"block_size": 32}),
])
def test_packages_agree_with_the_rule(method: str, params: dict[str, object]) -> None:
    """The property conformance needs: given one table, reference and fast mark the same heads,
    their plans are `equal`, and fast's output is the reference's attention of its plan
    (some heads dense through our kernel; every head dense through the layer's SDPA call)."""
    q, k, v = qkv()
    marks = set()
    for tab in (table(0.9), table(2.0, sdpa=0.01)):
        with dense_fallback(rates=tab):
            ref = getattr(reference, f"{method}_plan")(q, k, **params)
            got = getattr(fast, f"{method}_plan")(q, k, **params)
            assert ref.dense_heads == got.dense_heads
            assert ref.equal(got)
            out = getattr(fast, method)(q, k, v, **params)
            want = reference.sparse_attention(q, k, v, ref)
            assert (out.float() - want.float()).abs().max() < 4e-3
            assert (getattr(reference, method)(q, k, v, **params).float() - want.float()).abs().max() == 0
            marks.add(len(ref.dense_heads))
    assert HQ in marks  # the layer's SDPA table marks every head


def test_switch_turns_the_rule_off() -> None:
    q, k, _ = qkv()
    params = {"block": 32, "threshold": [0.5, 0.6, 0.95, 0.99]}
    assert rule.active_rates(q) is None  # CPU, no table: off
    with dense_fallback(rates=table()):
        assert reference.xattention_plan(q, k, **params).dense_heads
        with dense_fallback(False):
            assert rule.active_rates(q) is None
            assert reference.xattention_plan(q, k, **params).dense_heads == ()
        assert rule.active_rates(q) is not None
    with pytest.raises(TypeError, match="enabled"):
        with dense_fallback(1):  # type: ignore[arg-type]
            pass
    with pytest.raises(TypeError, match="early_exit"), dense_fallback(early_exit=1):  # type: ignore[arg-type]
        pass


def test_environment_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(rule.ENV_SWITCH, "0")
    assert rule.switched_off_by_env()
    monkeypatch.setenv(rule.ENV_SWITCH, "1")
    assert not rule.switched_off_by_env()


def test_early_exit_is_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """No probe runs unless `dense_fallback(early_exit=True)` or `SPARSEPREFILL_EARLY_EXIT=1`;
    an inner block without `early_exit` keeps the outer setting."""
    monkeypatch.delenv(rule.ENV_EARLY_EXIT, raising=False)
    assert not rule.early_exit_enabled()
    calls: list[int] = []
    q, k, _ = qkv()

    def probe() -> torch.Tensor:
        calls.append(1)
        return torch.ones(B, HQ, dtype=torch.float64)

    def estimate(heads: list[int] | None) -> BlockColumnPlan:
        return streaming(q, k)

    plan = rule.plan_with_fallback(q, k, estimate, rates=table(0.6), block_m=16, block_n=16, probe=probe)
    assert calls == [] and plan.dense_heads == ()
    with dense_fallback(rates=table(0.6), early_exit=True):
        assert rule.early_exit_enabled()
        with dense_fallback(rates=table(0.6)):
            assert rule.early_exit_enabled()
        with dense_fallback(False, early_exit=False):
            assert not rule.early_exit_enabled()
        plan = rule.plan_with_fallback(q, k, estimate, rates=table(0.6), block_m=16, block_n=16, probe=probe)
    assert calls == [1] and plan.dense_heads == tuple(range(HQ))
    monkeypatch.setenv(rule.ENV_EARLY_EXIT, "1")
    assert rule.early_exit_enabled()
    with dense_fallback(early_exit=False):
        assert not rule.early_exit_enabled()


# -- the early exit ----------------------------------------------------------------------


@pytest.mark.parametrize("impl", [reference, fast])
def test_early_exit_is_exact(impl: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A head that exits early runs dense and is not estimated; every other head gets the
    lists the estimator gives without the rule."""
    q, k, _ = qkv()
    params = {"block": 32, "threshold": [0.5, 0.6, 0.95, 0.99]}
    plan_fn = getattr(impl, "xattention_plan")
    with dense_fallback(False):
        before = plan_fn(q, k, **params)
    probe = rule.probe_mass_density(q, k, block_n=32, mass=torch.tensor(params["threshold"], dtype=torch.float64),
                                    scale=D ** -0.5)
    tab = table(0.6)
    exits = rule.early_dense_heads(probe, seqlen=N, block_m=32, head_dim=D, dtype=q.dtype, rates=tab)
    assert exits and len(exits) < HQ  # the flat heads exit, the peaked ones do not
    seen: list[int] = []
    real = rule.heads_view

    def spy(q_: torch.Tensor, k_: torch.Tensor, heads: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(int(q_.shape[1]) if heads is None else len(heads))
        return real(q_, k_, heads)

    monkeypatch.setattr(importlib.import_module(f"{impl.__name__}.xattention"), "heads_view", spy)
    with dense_fallback(rates=tab, early_exit=True):
        after = plan_fn(q, k, **params)
    assert set(exits) <= set(after.dense_heads)
    g = HQ // HKV
    whole_groups_out = [j for j in range(HKV) if all(h in exits for h in range(j * g, (j + 1) * g))]
    assert seen == [HQ - g * len(whole_groups_out)]  # exited groups are not scored
    kept = [h for h in range(HQ) if h not in after.dense_heads]
    for h in kept:
        one = [h]
        assert after.without_heads([x for x in range(HQ) if x not in one]).equal(
            before.without_heads([x for x in range(HQ) if x not in one]))


@pytest.mark.parametrize("method, params", [
    ("xattention", {"block": 32, "threshold": 0.99}),
    ("anchor_attention", {"block_m": 32, "block_n": 32, "step": 2, "theta": 12.0}),
])
def test_every_head_exiting_skips_the_estimate(method: str, params: dict[str, Any]) -> None:
    q, k, v = qkv()
    with dense_fallback(rates=table(0.01), early_exit=True):
        plan = getattr(reference, f"{method}_plan")(q, k, **params)
        assert plan.dense_heads == tuple(range(HQ))
        assert int(plan.block_count.sum()) == 0
        out = getattr(fast, method)(q, k, v, **params)
    assert (out.float() - reference.attention(q, k, v).float()).abs().max() < 2e-3


def test_dense_keep_ratio_is_break_even() -> None:
    tab = table(0.6)
    keep = rule.dense_keep_ratio(seqlen=256, head_dim=D, dtype="float16", rates=tab, exact_pairs_per_row=0)
    assert keep == pytest.approx(0.6)


# -- Delta-KV and DeltaXAttention: the decision on the keep mask, before packing ------------


def delta_qkv(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KV head 0's keys repeat in runs of 8 (keep 1/8), KV head 1's in runs of 2 over the
    first half and are random after it (keep 3/4 under a small threshold); the values are
    random, so a dropped key changes the output. Query heads 0, 1 peaked, 2, 3 flat."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, N, D, generator=g)
    q[:, :2] *= 4
    k = torch.randn(B, HKV, N, D, generator=g)
    k[:, 0] = k[:, 0, ::8].repeat_interleave(8, dim=1)[:, :N]
    k[:, 1, : N // 2] = k[:, 1, : N // 2: 2].repeat_interleave(2, dim=1)
    v = torch.randn(B, HKV, N, D, generator=g)
    return q.half(), k.half(), v.half()


DELTA_KV = {"threshold": 0.5, "metric": "euclidean", "chunk": 64, "block_m": 16, "block_n": 16}


def test_keep_dense_kv_heads_compares_integers() -> None:
    tab = table(0.6)
    ratio = rule.dense_keep_ratio(seqlen=N, head_dim=D, dtype="float16", rates=tab, exact_pairs_per_row=32,
                                  block_m=16)
    assert 0 < ratio < 1
    at = math.ceil(ratio * B * N)  # the fewest anchors (batch rows summed) that go dense
    kept = torch.tensor([[at // 2, at // 2 - 1], [at - at // 2, at - at // 2]])
    got = rule.keep_dense_kv_heads(kept, q_heads=HQ, seqlen=N, block_m=16, block_n=16, head_dim=D,
                                   dtype="float16", rates=tab)
    assert got == (0,)
    assert rule.query_heads_of(got, HQ, HKV) == (0, 1)
    # The layer's SDPA call: at the mean of the KV heads' best costs (per causal pair) exactly.
    exact = 32 * N / (N * (N + 1) / 2)
    best = [min(float(kept[:, j].sum()) / (B * N) + exact, 0.6) for j in range(HKV)]
    mean = sum(best) / HKV
    for sdpa, want in ((mean * 0.999, (0, 1)), (mean * 1.001, (0,))):
        assert rule.keep_dense_kv_heads(kept, q_heads=HQ, seqlen=N, block_m=16, block_n=16, head_dim=D,
                                        dtype="float16", rates=table(0.6, sdpa=sdpa)) == want


@pytest.mark.parametrize("impl", [reference, fast])
@pytest.mark.parametrize("exact_diagonal", [True, False])
def test_delta_kv_sends_uncompressed_kv_heads_dense(impl: Any, exact_diagonal: bool) -> None:
    """KV head 1 (keep 3/4) runs dense, KV head 0 (keep 1/8) gets exactly its output without
    the rule; everything dense under a table where nothing beats dense."""
    q, k, v = delta_qkv()
    params = {**DELTA_KV, "exact_diagonal": exact_diagonal}
    keep = reference.delta_keep_mask(k, threshold=0.5, metric="euclidean", chunk=64)
    assert float(keep[:, 0].double().mean()) == pytest.approx(1 / 8, abs=0.01)
    assert float(keep[:, 1].double().mean()) == pytest.approx(3 / 4, abs=0.01)
    with dense_fallback(False):
        before = impl.delta_kv(q, k, v, **params)
    with dense_fallback(rates=table(0.6)):
        after = impl.delta_kv(q, k, v, **params)
    want = reference.attention(q, k, v)
    assert torch.equal(after[:, :2], before[:, :2])
    err = float((after[:, 2:].float() - want[:, 2:].float()).abs().max())
    assert err == 0 if impl is reference else err < 2e-3
    assert float((before[:, 2:].float() - want[:, 2:].float()).abs().max()) > 0.05  # the rule did act
    with dense_fallback(rates=table(0.01)):
        every = impl.delta_kv(q, k, v, **params)
    err = float((every.float() - want.float()).abs().max())
    assert err == 0 if impl is reference else err < 2e-3


@pytest.mark.parametrize("method", ["delta_kv", "delta_xattention"])
def test_delta_dense_heads_through_our_kernel_or_one_sdpa_call(method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With SDPA the faster dense path (the branch CUDA takes, forced on the CPU): some heads
    dense run through our kernel (no SDPA call), every head dense through the layer's one
    SDPA call; the other heads keep their output without the rule."""
    spy = force_sdpa(monkeypatch)
    q, k, v = delta_qkv()
    params = DELTA_KV if method == "delta_kv" else DXA
    with dense_fallback(False):
        before = getattr(fast, method)(q, k, v, **params)
    want = reference.attention(q, k, v)
    for tab, dense, calls in ((table(0.6), (2, 3), []), (table(2.0, sdpa=0.01), (0, 1, 2, 3), [HQ])):
        spy.heads.clear()
        with dense_fallback(rates=tab):
            after = getattr(fast, method)(q, k, v, **params)
        assert spy.heads == calls
        for h in range(HQ):
            if h in dense:
                assert float((after[:, h].float() - want[:, h].float()).abs().max()) < 2e-3
            else:
                assert torch.equal(after[:, h], before[:, h])


def test_delta_kv_packing_of_a_dense_kv_head_is_one_anchor() -> None:
    from sparseprefill.fast.delta_kv import first_key_only
    from sparseprefill.fast.kernels.delta_pack import keep_mask, pack

    _, k, v = delta_qkv()
    keep, counts = keep_mask(k, threshold=0.5, cosine=False, chunk=64)
    keep2, counts2 = first_key_only(keep, counts, [1])
    assert torch.equal(keep2[:, 0], keep[:, 0]) and torch.equal(counts2.view(B, HKV, -1)[:, 0],
                                                                counts.view(B, HKV, -1)[:, 0])
    packed = pack(k, v, keep2, counts2, chunk=64, block=16).validate()
    assert packed.lengths[:, 1].tolist() == [1] * B and packed.lengths[:, 1].tolist() != \
        keep[:, 1].sum(-1).tolist()
    assert torch.equal(packed.lengths[:, 0], keep[:, 0].sum(-1).to(torch.int32))


DXA = {"threshold": [0.5, 0.6, 0.95, 0.99], "delta_threshold": 0.5, "metric": "euclidean", "block": 32,
       "packed_block": 16, "exact_top": 0.2}


def test_delta_xattention_pairs_count_the_launches_work() -> None:
    """Exact tiles' causal pairs plus packed tiles' rows times padded anchors, tile by tile."""
    from sparseprefill.reference.delta_xattention import EXACT, PACKED, delta_xattention_pairs

    q, k, v = delta_qkv()
    bs, pb = 32, 16
    modes = reference.delta_xattention_tiles(q, k, threshold=DXA["threshold"], exact_top=0.2, block=bs,
                                             unselected="packed")
    anchors = reference.delta_tile_pack(k, v, delta_threshold=0.5, block=bs, packed_block=pb).anchors()
    exact, packed = delta_xattention_pairs(modes, anchors, seqlen=N, block=bs, packed_block=pb)
    t = math.ceil(N / bs)
    size = [min(bs, N - i * bs) for i in range(t)]
    for b in range(B):
        for h in range(HQ):
            e = p = 0
            for i in range(t):
                for j in range(i + 1):
                    mode = int(modes[b, h, i, j])
                    if mode == EXACT:
                        e += size[i] * (size[i] + 1) // 2 if i == j else size[i] * size[j]
                    elif mode == PACKED:
                        p += size[i] * math.ceil(int(anchors[b, h // (HQ // HKV), j]) / pb) * pb
            assert (int(exact[b, h]), int(packed[b, h])) == (e, p)
    assert int(packed.sum()) > 0


@pytest.mark.parametrize("impl", [reference, fast])
def test_delta_xattention_sends_heads_past_break_even_dense(impl: Any) -> None:
    """The flat heads (every tile selected and exact) run dense; a head below break-even gets
    exactly its output without the rule; under a table where nothing beats dense, every
    head is dense (and nothing is packed)."""
    q, k, v = delta_qkv()
    with dense_fallback(False):
        before = impl.delta_xattention(q, k, v, **DXA)
    want = reference.attention(q, k, v)
    assert float((before[:, 2:].float() - want[:, 2:].float()).abs().max()) > 0.05  # the rule will act
    for ratio, dense in ((0.6, (2, 3)), (0.01, (0, 1, 2, 3))):
        with dense_fallback(rates=table(ratio)):
            after = impl.delta_xattention(q, k, v, **DXA)
        for h in range(HQ):
            if h in dense:
                err = float((after[:, h].float() - want[:, h].float()).abs().max())
                assert err == 0 if impl is reference else err < 2e-3
            else:
                assert torch.equal(after[:, h], before[:, h])


def test_delta_xattention_packages_decide_alike() -> None:
    from sparseprefill.reference.delta_xattention import dense_query_heads

    q, k, v = delta_qkv()
    modes = reference.delta_xattention_tiles(q, k, threshold=DXA["threshold"], exact_top=0.2, block=32)
    fast_modes = fast.delta_xattention_tiles(q, k, threshold=DXA["threshold"], exact_top=0.2, block=32)
    assert torch.equal(modes, fast_modes)
    anchors = reference.delta_tile_pack(k, v, delta_threshold=0.5, block=32, packed_block=16).anchors()
    fast_anchors = fast.delta_tile_pack(k, v, delta_threshold=0.5, block=32, packed_block=16).anchors()
    assert torch.equal(anchors, fast_anchors)
    for ratio in (0.3, 0.45, 0.6):
        got = dense_query_heads(q, modes, anchors, block=32, packed_block=16, rates=table(ratio))
        assert got == dense_query_heads(q, fast_modes, fast_anchors, block=32, packed_block=16, rates=table(ratio))
    assert dense_query_heads(q, modes, anchors, block=32, packed_block=16, rates=None) == ()


# -- the conformance property finds a package that does not follow the rule ---------------


def test_conformance_property_passes_and_catches_a_package_off_its_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    from sparseprefill.conformance import METHODS
    from sparseprefill.conformance import dense_fallback as conf

    q, k, v = qkv()
    spec = METHODS["xattention"]
    params = spec.call_params({"block": 32, "threshold": [0.5, 0.6, 0.95, 0.99]}, q)
    for where in conf.CUTOFFS:
        for layer in conf.LAYERS:
            conf.check_plan_marks(spec, q, k, v, params, where=where, index=1, layer=layer)
    monkeypatch.setattr(importlib.import_module("sparseprefill.fast.dense_fallback"), "active_rates",
                        lambda t: None)
    with pytest.raises(AssertionError, match="outside the band"):
        conf.check_plan_marks(spec, q, k, v, params, where="between", index=0, layer="none")
    with pytest.raises(AssertionError, match="dense in reference only"):
        conf.check_plan_marks(spec, q, k, v, params, where="above", index=0, layer="below")


def test_conformance_property_catches_delta_kv_off_its_marks(monkeypatch: pytest.MonkeyPatch) -> None:
    from sparseprefill.conformance import METHODS
    from sparseprefill.conformance import dense_fallback as conf

    q, k, v = delta_qkv()
    spec = METHODS["delta_kv"]
    params = spec.call_params(DELTA_KV, q)
    for layer in conf.LAYERS:
        conf.check_delta_kv_marks(spec, q, k, v, params, where="between", index=0, layer=layer)
    monkeypatch.setattr(importlib.import_module("sparseprefill.fast.delta_kv"), "dense_query_heads",
                        lambda *a, **kw: ())
    with pytest.raises(AssertionError, match="fast"):
        conf.check_delta_kv_marks(spec, q, k, v, params, where="between", index=0, layer="none")


def test_band_is_the_interval_between_the_two_costs() -> None:
    from sparseprefill.conformance.dense_fallback import in_band, pick_cutoff, pick_layer

    assert in_band(1.0, 2.0, 1.5) and in_band(2.0, 1.0, 1.0) and in_band(1.0, 1.0, 1.0)
    assert not in_band(1.0, 1.0, 1.0 + 1e-6) and not in_band(1.0, 2.0, 2.1)
    shares = [0.2, 0.5, 0.5, 0.9]
    assert pick_cutoff(shares, "at", 1) == 0.5 and pick_cutoff(shares, "between", 1) == pytest.approx(0.7)
    assert pick_cutoff(shares, "below", 0) < 0.2 < 0.9 < pick_cutoff(shares, "above", 0)
    assert pick_layer(0.4, "none") is None and pick_layer(0.4, "at") == 0.4
    below, above = pick_layer(0.4, "below"), pick_layer(0.4, "above")
    assert below is not None and above is not None and below < 0.4 < above


# -- rates -------------------------------------------------------------------------------


def test_rate_table_round_trip_and_interpolation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tab = rule.DEFAULT_TABLE
    again = RateTable.from_json(json.loads(json.dumps(tab.to_json())))
    assert again == tab
    lo, hi = tab.at(8192, 128, torch.bfloat16, 128), tab.at(32768, 128, torch.bfloat16, 128)
    mid = tab.at(16384, 128, torch.bfloat16, 128)
    assert mid.block_ps == pytest.approx((lo.block_ps + hi.block_ps) / 2)
    assert tab.at(1 << 22, 128, torch.bfloat16, 128).block_ps == tab.at(131072, 128, torch.bfloat16, 128).block_ps
    assert tab.at(32768, 96, torch.float32, 128).dtype == "bfloat16"
    with pytest.raises(ValueError, match="format"):
        RateTable.from_json({"points": []})
    with pytest.raises(ValueError, match="block_ps"):
        RatePoint(1, 1, "float16", 128, -1.0, 1.0, 1.0, 0.0, 1.0, 1.0)
    monkeypatch.setenv("SPARSEPREFILL_CACHE", str(tmp_path))
    assert rule.cache_dir() == tmp_path / "rates"
    assert rule.cache_key("NVIDIA H200", "2.11.0+cu130", "3.6.0") == "NVIDIA_H200-torch2.11.0+cu130-triton3.6.0.json"
