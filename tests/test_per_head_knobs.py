"""Per-head knobs (`Method.knobs`): a scalar and a per-head value in both packages.

For every registered method with knobs (read from the registry, not a hand list):
`[x] * Hq` plans exactly as the scalar `x`; per-head `[lo, hi]` plans head 0 as the
scalar `lo` and head 1 as the scalar `hi` (so head 1 is at least as dense); the fast
package agrees with itself the same way; bad per-head values are refused naming the
argument. Tiny sizes: the whole file runs in a few seconds under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from sparseprefill import fast, methods, reference  # noqa: E402
from sparseprefill.reference._checks import check_knob, per_head  # noqa: E402

N, HQ, HKV, D = 80, 2, 1, 16
# Small blocks so that tiny N still has several (the interpreter's cost is per block).
BLOCKS = {"block": 16, "block_m": 16, "block_n": 16, "block_size": 16, "packed_block": 16}

# A low and a high value of each knob, by knob name: the high one keeps at least as
# much (every knob is monotone: a larger threshold, share, theta, alpha, size, count,
# window or sink keeps a superset).
VALUES: dict[str, tuple[Any, Any]] = {
    "threshold": (0.3, 1.0),
    "gamma": (0.3, 1.0),
    "theta": (0.0, 1e9),
    "alpha_c": (0.3, 1.0),
    "alpha_s": (0.3, 1.0),
    "vertical_size": (1, N),
    "slash_size": (1, N),
    "top_k": (1, 4),
    "window": (8, N),
    "sink": (0, 32),
    "tau": (0.0, 2.0),
    "delta": (0.0, 2.0),
}

KNOBS = [(name, knob) for name, m in methods.methods().items() for knob in m.knobs]


def _params(m: methods.Method) -> dict[str, Any]:
    """The method's defaults at N, with small blocks."""
    return {**m.demo_params(N), **{p: b for p, b in BLOCKS.items() if p in m.parameters()}}


def _inputs(dtype: torch.dtype, n: int = N, kv_heads: int = HKV) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, n, D, generator=gen) for h in (HQ, kv_heads, kv_heads))
    k[:, :, 37] *= 4  # a heavy column, so that small budgets differ from large ones
    # Runs of near-equal keys (Delta-KV's keep mask then depends on its threshold).
    k[:, :, 1::2] = k[:, :, 0::2][:, :, : k[:, :, 1::2].shape[2]] + 0.3 * torch.randn(k[:, :, 1::2].shape, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _kv_heads(m: methods.Method, knob: str) -> int:
    """A knob that acts on the keys differs only between KV heads: one KV head per query head."""
    return HQ if knob in m.kv_knobs else HKV


def _head(plan: reference.BlockColumnPlan, h: int) -> torch.Tensor:
    return plan.to_dense_mask()[:, h]


def test_every_method_declares_its_knobs() -> None:
    assert set(methods.get("dense").knobs) == set()
    for name, m in methods.methods().items():
        for knob in m.knobs:
            assert knob in VALUES, f"{name}.{knob}: add its low/high values to VALUES"


@pytest.mark.parametrize("name,knob", KNOBS)
def test_per_head_value_plans_each_head_as_its_scalar(name: str, knob: str) -> None:
    """Reference: `[lo] * Hq` is `lo` exactly; `[lo, hi]` is `lo` on head 0 and `hi` on head 1."""
    m = methods.get(name)
    lo, hi = VALUES[knob]
    base = _params(m)
    q, k, v = _inputs(torch.float32)
    if not m.plan_based:
        # An output, not a plan (three end-to-end runs: a shorter prompt, three 16-token tiles).
        q, k, v = _inputs(torch.float32, 48, _kv_heads(m, knob))
        run = m.run_fn("reference")
        want = [run(q, k, v, **{**base, knob: x}) for x in (lo, hi)]
        got = run(q, k, v, **{**base, knob: [lo, hi]})
        for h in range(HQ):
            torch.testing.assert_close(got[:, h], want[h][:, h], rtol=0, atol=0)
        return
    plan = m.plan_fn("reference")
    scalar = {x: plan(q, k, **{**base, knob: x}) for x in (lo, hi)}
    assert plan(q, k, **{**base, knob: [lo] * HQ}).equal(scalar[lo])
    mixed = plan(q, k, **{**base, knob: (lo, hi)})
    for h, x in enumerate((lo, hi)):
        assert torch.equal(_head(mixed, h), _head(scalar[x], h)), (name, knob, h)
    density = reference.density(mixed)
    assert bool((density[:, 1] >= density[:, 0]).all()), density


@pytest.mark.parametrize("name", sorted({name for name, _ in KNOBS if methods.get(name).plan_based}))
def test_fast_per_head_plan_matches_the_reference(name: str) -> None:
    """Fast, every knob per head at once (`[lo, hi]`, as tensors): the conformance plan
    property (equal to the reference's, or differing only where the method's tie check
    allows, each head judged against its own values). One fast call per method."""
    from sparseprefill.conformance.properties import check_method_plan
    from sparseprefill.conformance.registry import METHODS

    m = methods.get(name)
    params = _params(m)
    for knob in m.knobs:
        lo, hi = VALUES[knob]
        params[knob] = torch.tensor([lo, hi], dtype=torch.int64 if isinstance(lo, int) else torch.float64)
    q, k, _ = _inputs(torch.float16, 48)
    check_method_plan(METHODS[name], q, k, params, context=f"{name} per-head {params}")


@pytest.mark.parametrize("name,knob", KNOBS)
def test_bad_per_head_values_are_refused_naming_the_argument(name: str, knob: str) -> None:
    m = methods.get(name)
    lo, _ = VALUES[knob]
    base = _params(m)
    q, k, v = _inputs(torch.float16)
    # Out of the scalar's range (any finite cosine threshold is valid: infinity is not).
    bad = math.inf if knob in m.kv_knobs else -1
    for impl in ("reference", "fast"):
        run = m.run_fn(impl)
        with pytest.raises(ValueError, match=knob):
            run(q, k, v, **{**base, knob: [lo] * (HQ + 1)})  # one value too many
        with pytest.raises(ValueError, match=knob):
            run(q, k, v, **{**base, knob: torch.full((HQ, 1), lo)})  # not 1-D
        with pytest.raises(TypeError, match=knob):
            run(q, k, v, **{**base, knob: ["x"] * HQ})
        with pytest.raises(ValueError, match=rf"{knob}\[1\]"):
            run(q, k, v, **{**base, knob: [lo, bad]})
        if knob in m.kv_knobs:
            # HQ query heads share HKV = 1 KV head: they must share its value.
            with pytest.raises(ValueError, match=rf"{knob} acts on the keys.*KV head 0"):
                run(q, k, v, **{**base, knob: [lo, VALUES[knob][1]]})


def test_per_head_helper() -> None:
    def check(x: object) -> float:
        if not isinstance(x, (int, float)) or isinstance(x, bool):
            raise TypeError(f"t must be a float, got {type(x).__name__}")
        if not 0 < x <= 1:
            raise ValueError(f"t must lie in (0, 1], got {x}")
        return float(x)

    assert per_head(0.5, "t", 3, check).tolist() == [0.5] * 3
    assert per_head([0.5, 1, 0.25], "t", 3, check).dtype == torch.float64
    assert per_head(torch.tensor([2, 3]), "t", 2, int, integer=True).tolist() == [2, 3]
    assert isinstance(check_knob("t", 0.5, check), float)
    assert check_knob("t", (0.5, 1.0), check).tolist() == [0.5, 1.0]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"t given per head must have one value per query head \(Hq=2\)"):
        per_head([0.5] * 3, "t", 2, check)
    with pytest.raises(ValueError, match=r"t\[0\] \(query head 0\): t must lie in \(0, 1\]"):
        per_head([0.0, 0.5], "t", 2, check)
    with pytest.raises(TypeError, match="t given per head must be a real tensor"):
        per_head(torch.ones(2, dtype=torch.bool), "t", 2, check)
    with pytest.raises(ValueError, match="must not be empty"):
        check_knob("t", [], check)


def test_ops_take_per_head_knobs() -> None:
    from sparseprefill.fast import ops

    m = methods.get("xattention")
    schema, _ = ops.method_schema("xattention", m.run_fn("fast"))
    assert "float threshold=0.9" in schema and "float[]? threshold_per_head=None" in schema
    assert "SymInt[]? top_k_per_head=None" in ops.method_schema("block_sparse", methods.get("block_sparse").run_fn("fast"))[0]
    q, k, v = _inputs(torch.float16, 48)
    params = {**_params(m), "threshold": torch.tensor([0.3, 1.0])}
    assert ops.op_params("xattention", params)["threshold_per_head"] == pytest.approx([0.3, 1.0])
    got = ops.call("xattention", q, k, v, **params).float()
    # Near the reference of the per-head call, away from the scalar call's head 1.
    q32, k32, v32 = (t.float() for t in (q, k, v))
    want = reference.xattention(q32, k32, v32, **params)
    low = reference.xattention(q32, k32, v32, **{**params, "threshold": 0.3})
    torch.testing.assert_close(got, want, rtol=0, atol=1e-2)
    assert float((low[:, 1] - want[:, 1]).abs().max()) > 0.1


def test_head_parallel_ranks_get_their_heads_values() -> None:
    from sparseprefill.distributed import _slice_head_params

    params = {"threshold": [0.1, 0.2, 0.3, 0.4], "top_k": torch.tensor([1, 2, 3, 4]), "block": 64}
    got = _slice_head_params(params, 2, 4, ("threshold", "top_k"))
    assert got["threshold"] == [0.3, 0.4] and got["top_k"].tolist() == [3, 4] and got["block"] == 64
    assert _slice_head_params({"threshold": 0.9}, 2, 4, ("threshold",)) == {"threshold": 0.9}


def test_kv_knob_masks_each_kv_head_as_its_scalar() -> None:
    """Delta-KV's threshold acts on the keys: per KV head in `delta_keep_mask` (both
    packages, bit-identical masks), per query head (equal within a group) in `delta_kv`;
    a scalar is the scalar path; a wrong length names the KV heads."""
    m = methods.get("delta_kv")
    assert m.kv_knobs == ("threshold",)
    _, k, _ = _inputs(torch.float16, 48, kv_heads=2)
    lo, hi = 0.98, 0.3
    for impl in (reference, fast):
        masks = {x: impl.delta_keep_mask(k, threshold=x, metric="cosine", chunk=16) for x in (lo, hi)}
        assert not torch.equal(masks[lo], masks[hi])
        mixed = impl.delta_keep_mask(k, threshold=torch.tensor([lo, hi]), metric="cosine", chunk=16)
        assert torch.equal(mixed[:, 0], masks[lo][:, 0]) and torch.equal(mixed[:, 1], masks[hi][:, 1])
        with pytest.raises(ValueError, match=r"threshold given per head must have one value per KV head \(Hkv=2\)"):
            impl.delta_keep_mask(k, threshold=[lo] * 3, metric="cosine", chunk=16)
        with pytest.raises(ValueError, match=r"threshold\[1\] \(KV head 1\)"):
            impl.delta_keep_mask(k, threshold=[lo, math.nan], metric="cosine", chunk=16)
    assert torch.equal(reference.delta_keep_mask(k, threshold=(lo, hi), metric="cosine", chunk=16),
                       fast.delta_keep_mask(k, threshold=(lo, hi), metric="cosine", chunk=16))


def test_per_kv_head_helper() -> None:
    from sparseprefill.reference._checks import per_kv_head

    assert per_kv_head(0.5, "t", 4, 2, float) == 0.5
    assert per_kv_head([0.5, 0.5, 0.25, 0.25], "t", 4, 2, float).tolist() == [0.5, 0.25]  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"query heads 2..3 \(KV head 1\) got \[0.25, 0.5\]"):
        per_kv_head([0.5, 0.5, 0.25, 0.5], "t", 4, 2, float)


def test_ops_take_per_head_values_of_required_knobs() -> None:
    """A knob without a default (Delta-KV's threshold, vertical-slash sizes) is a required
    op argument: `op_params` fills it with the first head's value, the list overrides it.
    Every method with knobs: the op's required arguments are all given (no launch)."""
    from sparseprefill.fast import ops

    for name, m in methods.methods().items():
        if not m.knobs:
            continue
        params = {**_params(m), **{knob: [VALUES[knob][0]] * HQ for knob in m.knobs}}
        given = ops.op_params(name, params)
        schema, _ = ops.method_schema(name, m.run_fn("fast"))
        for arg in schema.split("*,", 1)[1].split(") ->")[0].split(","):
            arg = arg.strip()
            if arg and "=" not in arg:
                assert arg.split()[-1] in given, (name, arg, given)
    sizes = ops.op_params("vertical_slash", {"vertical_size": torch.tensor([2, 8]), "slash_size": (4, 16)})
    assert sizes == {"vertical_size": 2, "vertical_size_per_head": [2, 8], "slash_size": 4,
                     "slash_size_per_head": [4, 16]}
