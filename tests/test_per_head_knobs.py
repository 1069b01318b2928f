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

from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from sparseprefill import fast, methods, reference  # noqa: E402
from sparseprefill.reference._checks import check_knob, per_head  # noqa: E402

N, HQ, HKV, D = 160, 2, 1, 32

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
    "top_k": (1, 8),
    "window": (16, N),
    "sink": (0, 64),
    "tau": (0.0, 2.0),
    "delta": (0.0, 2.0),
}

KNOBS = [(name, knob) for name, m in methods.methods().items() for knob in m.knobs]


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, N, D, generator=gen) for h in (HQ, HKV, HKV))
    k[:, :, 37] *= 4  # a heavy column, so that small budgets differ from large ones
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _head(plan: reference.BlockColumnPlan, h: int) -> torch.Tensor:
    return plan.to_dense_mask()[:, h]


def test_every_method_declares_its_knobs() -> None:
    assert set(methods.get("dense").knobs) == set()
    for name, m in methods.methods().items():
        for knob in m.knobs:
            assert knob in VALUES, f"{name}.{knob}: add its low/high values to VALUES"


@pytest.mark.parametrize("name,knob", KNOBS)
def test_per_head_value_plans_each_head_as_its_scalar(name: str, knob: str) -> None:
    m = methods.get(name)
    lo, hi = VALUES[knob]
    base = m.demo_params(N)
    if not m.plan_based:
        q, k, v = _inputs(torch.float32)
        run = m.run_fn("reference")
        want = [run(q, k, v, **{**base, knob: x}) for x in (lo, hi)]
        got = run(q, k, v, **{**base, knob: [lo, hi]})
        for h in range(HQ):
            torch.testing.assert_close(got[:, h], want[h][:, h], rtol=0, atol=0)
        return
    q, k, _ = _inputs(torch.float32)
    plan = m.plan_fn("reference")
    scalar = {x: plan(q, k, **{**base, knob: x}) for x in (lo, hi)}
    assert plan(q, k, **{**base, knob: [lo] * HQ}).equal(scalar[lo])
    mixed = plan(q, k, **{**base, knob: (lo, hi)})
    for h, x in enumerate((lo, hi)):
        assert torch.equal(_head(mixed, h), _head(scalar[x], h)), (name, knob, h)
    density = reference.density(mixed)
    assert bool((density[:, 1] >= density[:, 0]).all()), density

    qh, kh, _ = _inputs(torch.float16)
    plan = m.plan_fn("fast")
    fast_scalar = {x: plan(qh, kh, **{**base, knob: x}) for x in (lo, hi)}
    dtype = torch.int64 if isinstance(lo, int) else torch.float64
    fast_mixed = plan(qh, kh, **{**base, knob: torch.tensor([lo, hi], dtype=dtype)})
    for h, x in enumerate((lo, hi)):
        assert torch.equal(_head(fast_mixed, h), _head(fast_scalar[x], h)), (name, knob, h)


@pytest.mark.parametrize("name,knob", KNOBS)
def test_bad_per_head_values_are_refused_naming_the_argument(name: str, knob: str) -> None:
    m = methods.get(name)
    lo, _ = VALUES[knob]
    base = m.demo_params(N)
    q, k, v = _inputs(torch.float16)
    for impl in ("reference", "fast"):
        run = m.run_fn(impl)
        with pytest.raises(ValueError, match=knob):
            run(q, k, v, **{**base, knob: [lo] * (HQ + 1)})  # one value too many
        with pytest.raises(ValueError, match=knob):
            run(q, k, v, **{**base, knob: torch.full((HQ, 1), lo)})  # not 1-D
        with pytest.raises(TypeError, match=knob):
            run(q, k, v, **{**base, knob: ["x"] * HQ})
        with pytest.raises(ValueError, match=rf"{knob}\[1\]"):
            run(q, k, v, **{**base, knob: [lo, -1]})  # out of the scalar's range


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
    q, k, v = _inputs(torch.float16)
    params = {**m.demo_params(N), "threshold": [0.3, 1.0]}
    want = fast.xattention(q, k, v, **params)
    assert torch.equal(ops.call("xattention", q, k, v, **params), want)
    op = ops.method_op("xattention")
    direct = op(q, k, v, **{**m.demo_params(N), "threshold_per_head": [0.3, 1.0]})
    assert torch.equal(direct, want)
