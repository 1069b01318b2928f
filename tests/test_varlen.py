"""Packed variable-length batches: a varlen batch equals running each sequence alone."""

from __future__ import annotations

import pytest
import torch

from sparseprefill import fast, reference
from sparseprefill.conformance.tolerance import nan_poisoned_empty
from sparseprefill.conformance.tolerance import baseline_attention, check_attention, golden_attention

LENGTHS = [37, 130, 1, 96]


def _packed(lengths: list[int], *, hq: int = 4, hkv: int = 2, d: int = 32, seed: int = 0,
            dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(total, h, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    return q, k, v, cu


def _seq(t: torch.Tensor, cu: torch.Tensor, s: int) -> torch.Tensor:
    return t[int(cu[s]):int(cu[s + 1])].transpose(0, 1).unsqueeze(0)


PLANS = {
    "dense": (lambda pkg: pkg.dense_plan, dict(block_m=32, block_n=16)),
    "vertical_slash": (lambda pkg: pkg.vertical_slash_plan,
                       dict(vertical_size=8, slash_size=6, last_q=16, block_m=32, block_n=16)),
    "block_sparse": (lambda pkg: pkg.block_sparse_plan, dict(top_k=3, block_size=32)),
}


@pytest.mark.parametrize("method", PLANS)
def test_varlen_plans_are_the_per_sequence_plans(method: str) -> None:
    q, k, _, cu = _packed(LENGTHS)
    for pkg in (reference, fast):
        get, params = PLANS[method]
        plan = pkg.varlen_plans(get(pkg), q, k, cu, **params)
        assert plan.batch == len(LENGTHS) and plan.seqlen == max(LENGTHS)
        for s, n in enumerate(LENGTHS):
            alone = get(pkg)(_seq(q, cu, s), _seq(k, cu, s), **params)
            got = plan.to_dense_mask()[s:s + 1, :, :n, :n]
            assert torch.equal(got, alone.to_dense_mask()), f"{pkg.__name__} {method} sequence {s}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["dense", "vertical_slash"])
def test_varlen_attention_equals_each_sequence_alone(dtype: torch.dtype, method: str) -> None:
    q, k, v, cu = _packed(LENGTHS, dtype=dtype, seed=1)
    get, params = PLANS[method]
    plan = reference.varlen_plans(get(reference), q, k, cu, **params)
    with nan_poisoned_empty():
        out, lse = fast.varlen_attention(q, k, v, cu, max(LENGTHS), plan, return_lse=True)
    ref_out, ref_lse = reference.varlen_attention(q.float(), k.float(), v.float(), cu, max(LENGTHS), plan,
                                                  return_lse=True)
    mask = plan.to_dense_mask()
    for s, n in enumerate(LENGTHS):
        qs, ks, vs = (_seq(t, cu, s) for t in (q, k, v))
        m = mask[s:s + 1, :, :n, :n]
        golden = golden_attention(qs, ks, vs, m)
        baseline = baseline_attention(qs, ks, vs, m)
        rows = slice(int(cu[s]), int(cu[s + 1]))
        got = out[rows].transpose(0, 1).unsqueeze(0)
        assert check_attention(got, lse[:, rows].unsqueeze(0), golden, baseline, context=f"seq {s}") <= 1.0
        # The reference varlen is the reference of each sequence.
        torch.testing.assert_close(ref_out[rows].transpose(0, 1).unsqueeze(0), golden[0].float(),
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(ref_lse[:, rows], golden[1][0], rtol=0, atol=1e-4)
    # One launch equals the sequences launched alone, bit for bit (same tiles, same order).
    for s, n in enumerate(LENGTHS):
        alone = fast.sparse_attention(*(_seq(t, cu, s) for t in (q, k, v)),
                                      get(reference)(_seq(q, cu, s), _seq(k, cu, s), **params))
        assert torch.equal(out[int(cu[s]):int(cu[s + 1])], alone[0].transpose(0, 1))


def test_varlen_strided_inputs_and_padded_max_seqlen() -> None:
    q, k, v, cu = _packed([20, 45])
    qt = q.transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, D] with head-major strides
    plan = reference.varlen_plans(reference.dense_plan, q, k, cu, block_m=16, block_n=16)
    a = fast.varlen_attention(qt, k, v, cu, 45, plan)
    big = reference.stack_plans([plan, reference.dense_plan(torch.zeros(1, 4, 70, 32), torch.zeros(1, 2, 70, 32),
                                                            block_m=16, block_n=16)])
    assert big.seqlen == 70 and big.batch == 3
    b = fast.varlen_attention(q, k, v, cu, 45, plan)
    assert torch.equal(a, b)


def test_varlen_checks() -> None:
    q, k, v, cu = _packed([20, 45])
    plan = reference.varlen_plans(reference.dense_plan, q, k, cu, block_m=16, block_n=16)
    with pytest.raises(TypeError, match="cu_seqlens must be an int32"):
        fast.varlen_attention(q, k, v, cu.long(), 45, plan)
    with pytest.raises(ValueError, match="end at T=65"):
        fast.varlen_attention(q, k, v, torch.tensor([0, 20, 60], dtype=torch.int32), 45, plan)
    with pytest.raises(ValueError, match="below the longest"):
        fast.varlen_attention(q, k, v, cu, 44, plan)
    with pytest.raises(ValueError, match="max_seqlen"):
        reference.varlen_attention(q.float(), k.float(), v.float(), cu, 44, plan)
    with pytest.raises(ValueError, match="plan.seqlen must equal N=60"):
        fast.varlen_attention(q, k, v, cu, 60, plan)
    with pytest.raises(ValueError, match="\\[T, Hq, D\\]"):
        fast.varlen_attention(q[None], k, v, cu, 45, plan)
    with pytest.raises(ValueError, match="at least one token"):
        reference.varlen_plans(reference.dense_plan, q, k, torch.tensor([0, 0, 65], dtype=torch.int32))
    with pytest.raises(ValueError, match="block sizes"):
        reference.stack_plans([plan, reference.dense_plan(torch.zeros(1, 4, 9, 32), torch.zeros(1, 2, 9, 32),
                                                          block_m=32, block_n=16)])
