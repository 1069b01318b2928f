"""The block/column kernel on hand-picked awkward cases (CPU, Triton interpreter).

Every comparison goes through the conformance checks, so the tolerance is the
project's one policy (`conformance.tolerance`) and outputs are NaN-poisoned.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparseprefill import fast
from sparseprefill.conformance.properties import (
    check_masked_attention,
    check_sparse_attention,
    nan_poisoned_empty,
)
from sparseprefill.conformance.tolerance import (
    baseline_attention,
    check_attention,
    check_lse,
    check_output,
    golden_attention,
)
from sparseprefill.reference import BlockColumnPlan


def qkv(
    b: int, hq: int, hkv: int, n: int, d: int, dtype: torch.dtype = torch.float16, *,
    seed: int = 0, bnhd: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random inputs; `bnhd` stores them as `[B, N, H, D]` and returns `.transpose(1, 2)` views."""
    gen = torch.Generator().manual_seed(seed)

    def make(h: int) -> torch.Tensor:
        if bnhd:
            return torch.randn(b, n, h, d, generator=gen).to(dtype).transpose(1, 2)
        return torch.randn(b, h, n, d, generator=gen).to(dtype)

    return make(hq), make(hkv), make(hkv)


def random_plan(
    b: int, h: int, n: int, bm: int, bn: int, *, p_block: float, p_col: float, seed: int = 0,
    empty_every: int = 0,
) -> BlockColumnPlan:
    gen = torch.Generator().manual_seed(seed)
    qb, kb = -(-n // bm), -(-n // bn)
    blocks = torch.rand(b, h, qb, kb, generator=gen) < p_block
    cols = torch.rand(b, h, qb, n, generator=gen) < p_col
    if empty_every:
        blocks[:, :, ::empty_every] = False
        cols[:, :, ::empty_every] = False
    return BlockColumnPlan.from_masks(blocks, cols, seqlen=n, block_m=bm, block_n=bn)


# (B, Hq, Hkv, N, D, dtype): awkward N, every head dim, GQA groups 1-4, batch 2.
SHAPES = [
    (1, 1, 1, 1, 64, torch.float16),
    (2, 2, 2, 1, 128, torch.bfloat16),
    (2, 4, 1, 63, 32, torch.float16),
    (2, 3, 1, 65, 96, torch.bfloat16),
    (1, 4, 2, 129, 64, torch.bfloat16),
    (2, 2, 1, 129, 128, torch.float16),
    (1, 3, 3, 200, 32, torch.float16),
    (1, 2, 1, 200, 96, torch.float16),
    (2, 1, 1, 111, 16, torch.bfloat16),
]


@pytest.mark.parametrize("b,hq,hkv,n,d,dtype", SHAPES)
def test_causal_attention_awkward_shapes(
    b: int, hq: int, hkv: int, n: int, d: int, dtype: torch.dtype
) -> None:
    q, k, v = qkv(b, hq, hkv, n, d, dtype)
    assert check_masked_attention(q, k, v, None, context=f"{(b, hq, hkv, n, d, dtype)}") <= 1


@pytest.mark.parametrize("b,hq,hkv,n,d,dtype", SHAPES[2:6])
def test_sparse_attention_awkward_shapes(
    b: int, hq: int, hkv: int, n: int, d: int, dtype: torch.dtype
) -> None:
    q, k, v = qkv(b, hq, hkv, n, d, dtype, seed=1)
    plan = random_plan(b, hq, n, 32, 16, p_block=0.5, p_col=0.1, seed=n)
    check_sparse_attention(q, k, v, plan, context=f"{(b, hq, hkv, n, d, dtype)}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_strided_bnhd_views(dtype: torch.dtype) -> None:
    q, k, v = qkv(2, 4, 2, 70, 64, dtype, bnhd=True)
    assert not q.is_contiguous() and q.stride(1) == 64
    plan = random_plan(2, 4, 70, 32, 32, p_block=0.6, p_col=0.05)
    check_sparse_attention(q, k, v, plan)
    with nan_poisoned_empty():
        strided = fast.sparse_attention(q, k, v, plan)
        contiguous = fast.sparse_attention(q.contiguous(), k.contiguous(), v.contiguous(), plan)
    assert torch.equal(strided, contiguous)


def test_return_lse_does_not_change_the_output() -> None:
    q, k, v = qkv(1, 2, 1, 90, 64)
    plan = random_plan(1, 2, 90, 64, 32, p_block=0.7, p_col=0.1)
    with nan_poisoned_empty():
        out, lse = fast.sparse_attention(q, k, v, plan, return_lse=True)
        alone = fast.sparse_attention(q, k, v, plan)
    assert isinstance(alone, torch.Tensor) and torch.equal(out, alone)
    assert lse.shape == (1, 2, 90) and lse.dtype == torch.float32
    with nan_poisoned_empty():
        out2, lse2 = fast.attention(q, k, v, return_lse=True)
        alone2 = fast.attention(q, k, v)
    assert torch.equal(out2, alone2)
    golden = golden_attention(q, k, v, None)
    check_lse(lse2, golden[1], baseline_attention(q, k, v, None)[1])


def test_fully_masked_rows_give_zero_and_minus_inf() -> None:
    n = 80
    q, k, v = qkv(2, 2, 1, n, 32)
    # Every other query block empty; the others keep only column 40, which rows < 40 cannot see.
    cols = torch.zeros(2, 2, 5, n, dtype=torch.bool)
    cols[:, :, 1::2, 40] = True
    plan = BlockColumnPlan.from_masks(torch.zeros(2, 2, 5, 5, dtype=torch.bool), cols,
                                      seqlen=n, block_m=16, block_n=16)
    check_sparse_attention(q, k, v, plan)
    with nan_poisoned_empty():
        out, lse = fast.sparse_attention(q, k, v, plan, return_lse=True)
    assert bool((out[:, :, :48] == 0).all()) and bool((lse[:, :, :48] == -math.inf).all())
    assert bool(torch.isfinite(lse[:, :, 48:64]).all())
    assert bool((lse[:, :, 64:] == -math.inf).all())
    # Row r >= 48 of query block 3 sees only key 40: the output is v[40] exactly.
    assert torch.equal(out[:, :, 50], v[:, :, 40].repeat_interleave(2, dim=1))


def test_fully_masked_rows_through_a_dense_mask() -> None:
    q, k, v = qkv(1, 2, 2, 50, 64, torch.bfloat16)
    mask = torch.rand(50, 50, generator=torch.Generator().manual_seed(2)) < 0.3
    mask[::3] = False
    check_masked_attention(q, k, v, mask)
    check_masked_attention(q, k, v, torch.zeros(50, 50, dtype=torch.bool))


@pytest.mark.parametrize("p_col", [0.05, 0.5, 1.0])
def test_plans_with_columns_only(p_col: float) -> None:
    q, k, v = qkv(1, 2, 1, 100, 64, seed=3)
    plan = random_plan(1, 2, 100, 32, 16, p_block=0.0, p_col=p_col, seed=4)
    assert plan.block_index.shape[3] == 0 and plan.column_index.shape[3] > 0
    check_sparse_attention(q, k, v, plan)


@pytest.mark.parametrize("bm,bn", [(64, 32), (32, 128), (256, 64), (256, 128), (16, 16)])
def test_plan_block_sizes_and_kernel_sub_tiles(bm: int, bn: int) -> None:
    """Kernel tiles divide plan blocks: block_n=128 runs as two 64-key tiles, block_m=256
    as two 128-row tiles (the diagonal tail count covers both)."""
    n = 200 if bm * bn >= 64 * 32 else 90
    q, k, v = qkv(1, 2, 1, n, 32, torch.bfloat16, seed=bm + bn)
    for p_block, p_col in ((1.0, 0.0), (0.5, 0.1)):
        plan = random_plan(1, 2, n, bm, bn, p_block=p_block, p_col=p_col, seed=bm * bn)
        check_sparse_attention(q, k, v, plan, context=f"{bm}x{bn} p={p_block}")


@pytest.mark.parametrize("bm,bn", [(16, 16), (64, 128), (256, 32)])
def test_dense_plans(bm: int, bn: int) -> None:
    q, k, v = qkv(2, 2, 1, 129, 64) if bm * bn > 256 else qkv(1, 2, 1, 97, 64)
    check_sparse_attention(q, k, v, fast.dense_plan(q, k, block_m=bm, block_n=bn))
    golden = golden_attention(q, k, v, None)
    baseline = baseline_attention(q, k, v, None)
    with nan_poisoned_empty():
        out = fast.dense(q, k, v, block_m=bm, block_n=bn)
    check_output(out, golden[0], baseline[0], context=f"fast.dense {bm}x{bn}")


@pytest.mark.parametrize("form", ["2d", "full", "head", "expanded", "non_contiguous"])
def test_dense_mask_path(form: str) -> None:
    b, hq, hkv, n = 2, 2, 1, 70
    q, k, v = qkv(b, hq, hkv, n, 32, seed=5)
    gen = torch.Generator().manual_seed(6)
    if form == "2d":
        mask = torch.rand(n, n, generator=gen) < 0.5
    elif form == "full":
        mask = torch.rand(b, hq, n, n, generator=gen) < 0.5
    elif form == "head":
        mask = torch.rand(1, hq, n, n, generator=gen) < 0.5
    elif form == "expanded":
        mask = (torch.rand(n, n, generator=gen) < 0.5).expand(b, hq, n, n)
    else:
        mask = (torch.rand(b, hq, n, n, generator=gen) < 0.5).transpose(2, 3)
    check_masked_attention(q, k, v, mask, context=form)


def test_explicit_scale() -> None:
    q, k, v = qkv(1, 2, 2, 64, 64, torch.bfloat16, seed=7)
    for scale in (0.01, 0.5, 2.0):
        check_masked_attention(q, k, v, None, scale=scale, context=f"scale={scale}")


def test_shared_memory_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch the GPU refuses for shared memory is retried with fewer stages, then
    smaller tiles; the result is unchanged and the fitted configuration is kept."""
    from triton.runtime.errors import OutOfResources

    from sparseprefill.fast.kernels import block_column as bc

    real = bc._block_column_fwd
    launches: list[tuple[int, int, int]] = []

    class Picky:
        """Refuses tiles wider than 32 keys or more than one stage, like a small GPU."""

        def __getitem__(self, grid: object) -> object:
            def launch(*args: object, **kw: object) -> object:
                launches.append((int(kw["BLOCK_N"]), int(kw["num_stages"]), int(kw["BLOCK_M"])))  # type: ignore[call-overload]
                if int(kw["BLOCK_N"]) > 32:  # type: ignore[call-overload]
                    raise OutOfResources(300_000, 232_448, "shared memory")
                return real[grid](*args, **kw)

            return launch

    monkeypatch.setattr(bc, "_block_column_fwd", Picky())
    monkeypatch.setattr(bc, "_FITTED", {})
    monkeypatch.setattr(bc, "_tile_config", lambda bm, bn, d: (64, 64, 4, 3))
    torch.manual_seed(3)
    q = torch.randn(2, 4, 150, 64, dtype=torch.float16)
    k = torch.randn(2, 2, 150, 64, dtype=torch.float16)
    v = torch.randn(2, 2, 150, 64, dtype=torch.float16)
    mask = torch.rand(150, 150) < 0.5
    out, lse = fast.attention(q, k, v, mask, return_lse=True)
    # 3 stages, 2, 1, then 32-key tiles with 2 stages: the fourth launch runs.
    assert launches == [(64, 3, 64), (64, 2, 64), (64, 1, 64), (32, 2, 64)]
    assert list(bc._FITTED.values()) == [(64, 32, 4, 2)]
    golden, baseline = golden_attention(q, k, v, mask), baseline_attention(q, k, v, mask)
    check_attention(out, lse, golden, baseline, context="after the fallback")
    launches.clear()
    fast.attention(q, k, v, mask, return_lse=True)
    assert launches == [(32, 2, 64)]  # the fitted configuration, first try


def test_row_max_switch_is_the_state_max_bit_for_bit() -> None:
    """`block_column_row_max` (the kernel's ROW_MAX switch: no exp2, no P x V) equals the
    `m` a full pass leaves in an empty state, blocks and columns, empty rows -inf."""
    from sparseprefill.fast.kernels import block_column_attention, block_column_row_max

    q, k, v = qkv(1, 2, 1, 75, 16, torch.bfloat16, seed=7)
    plan = random_plan(1, 2, 75, 32, 16, p_block=0.4, p_col=0.1, seed=3, empty_every=2)
    state = fast.AttentionState.like(q)
    block_column_attention(q, k, v, plan, scale=0.2, state=state)
    got = block_column_row_max(q, k, plan, scale=0.2)
    assert torch.equal(got, state.m) and bool(torch.isinf(got).any()) and bool(torch.isfinite(got).any())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nonfinite_flag(dtype: torch.dtype) -> None:
    """The one-pass "V holds a NaN / inf" flag: 0 on finite values, 1 on each kind of bad value
    wherever it sits (first and last element, a chunk past the first program's), also on a
    non-contiguous view (the `aminmax` fallback)."""
    from sparseprefill.fast.kernels.block_column import _nonfinite_flag

    gen = torch.Generator().manual_seed(0)
    v = torch.randn(2, 3, 1500, 64, generator=gen).to(dtype)
    assert _nonfinite_flag(v).tolist() == [0]
    assert _nonfinite_flag(v.transpose(1, 2)).tolist() == [0]
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in ((0, 0, 0, 0), (1, 2, 1499, 63), (1, 0, 700, 5)):
            w = v.clone()
            w[where] = bad
            assert _nonfinite_flag(w).tolist() == [1], (bad, where)
            assert _nonfinite_flag(w.transpose(1, 2)).tolist() == [1], (bad, where)
