"""Small plans: columns that repeat keys of listed blocks, shared column lists, tight widths.

A plan whose columns lie inside listed blocks keeps the same keys as its disjoint
twin (`from_masks` form): the same output, lse, density and recall in both
packages. The fast vertical-slash plan stores each head's verticals once (expanded
over query blocks) and block lists exactly as wide as the data needs, so its size
is `4 * B * H * (Qb * (W + 2) + k_v)` bytes with `W` the real width, not the
parameter bound. CPU, Triton interpreter, small N.
"""

from __future__ import annotations

import os
from dataclasses import replace

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from sparseprefill import fast, reference  # noqa: E402
from sparseprefill.bench import minference_anchor_lines  # noqa: E402
from sparseprefill.fast.capture import static_widths  # noqa: E402
from sparseprefill.conformance.properties import (  # noqa: E402
    check_recall_density,
    check_sparse_attention,
    nan_poisoned_empty,
)
from sparseprefill.fast.kernels.vertical_slash_index import (  # noqa: E402
    index_width_bound,
    vertical_slash_index as fast_index,
)
from sparseprefill.fast.vertical_slash import plan_nbytes  # noqa: E402
from sparseprefill.reference.plan import BlockColumnPlan, cdiv, columns_inside_blocks  # noqa: E402
from sparseprefill.reference.vertical_slash import vertical_slash_index as reference_index  # noqa: E402


def _qkv(b: int, hq: int, hkv: int, n: int, d: int, dtype: torch.dtype, seed: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    return q, k, v


def _lists_from_mask(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool `[..., N]` -> (count int32, sorted indices int32 with -1 padding)."""
    count = mask.sum(dim=-1)
    width = int(count.max())
    order = torch.sort((~mask).to(torch.int8), dim=-1, stable=True).indices[..., :width]
    valid = torch.arange(width) < count.unsqueeze(-1)
    return count.to(torch.int32), torch.where(valid, order, -1).to(torch.int32)


def covered_twin(plan: BlockColumnPlan, *, p: float, seed: int) -> BlockColumnPlan:
    """`plan` plus causal columns drawn inside its listed blocks (the same kept keys)."""
    gen = torch.Generator().manual_seed(seed)
    n, bm, bn = plan.seqlen, plan.block_m, plan.block_n
    in_block = plan.block_mask().repeat_interleave(bn, dim=3)[..., :n]
    extra = (torch.rand(in_block.shape, generator=gen) < p) & in_block
    last_row = ((torch.arange(plan.num_query_blocks) + 1) * bm - 1).clamp(max=n - 1)
    causal = torch.arange(n)[None, :] <= last_row[:, None]
    count, index = _lists_from_mask((plan.column_mask() | extra) & causal)
    return replace(plan, column_count=count, column_index=index)


def _random_disjoint(b: int, h: int, n: int, bm: int, bn: int, seed: int) -> BlockColumnPlan:
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.rand(b, h, cdiv(n, bm), cdiv(n, bn), generator=gen) < 0.4
    columns = torch.rand(b, h, cdiv(n, bm), n, generator=gen) < 0.1
    return BlockColumnPlan.from_masks(blocks, columns, seqlen=n, block_m=bm, block_n=bn)


TWIN_CASES = [
    # (B, Hq, Hkv, N, D, block_m, block_n, dtype)
    (2, 4, 2, 100, 32, 32, 16, torch.float16),
    (1, 2, 1, 129, 64, 64, 64, torch.bfloat16),
    (1, 3, 3, 70, 16, 16, 32, torch.float16),
]


@pytest.mark.parametrize("case", range(len(TWIN_CASES)))
def test_columns_inside_blocks_change_nothing(case: int) -> None:
    b, hq, hkv, n, d, bm, bn, dtype = TWIN_CASES[case]
    q, k, v = _qkv(b, hq, hkv, n, d, dtype, seed=case)
    plan = _random_disjoint(b, hq, n, bm, bn, seed=case)
    twin = covered_twin(plan, p=0.3, seed=case).validate()
    inside = columns_inside_blocks(twin.block_count, twin.block_index, twin.column_index, block_n=bn)
    valid = torch.arange(twin.column_index.shape[3]) < twin.column_count.unsqueeze(-1)
    assert bool((inside & valid).any()), "the twin must really repeat keys of listed blocks"
    assert twin.equal(plan) and plan.equal(twin)
    assert torch.equal(twin.to_dense_mask(), plan.to_dense_mask())

    # fast on the twin meets the policy against the golden of the common mask.
    check_sparse_attention(q, k, v, twin, context=f"twin {case}")
    check_recall_density(q, k, twin, expected_selection=plan, context=f"twin {case}")
    assert torch.equal(fast.density(twin), fast.density(plan))
    assert torch.equal(reference.density(twin), reference.density(plan))
    assert torch.equal(reference.recall(q, k, twin), reference.recall(q, k, plan))
    up = tuple(x.double() for x in (q, k, v))
    out_t, lse_t = reference.sparse_attention(*up, twin, return_lse=True)
    out_p, lse_p = reference.sparse_attention(*up, plan, return_lse=True)
    assert torch.equal(out_t, out_p) and torch.equal(lse_t, lse_p)
    # The kernel skips the covered columns: the same keys in the same block tiles.
    with nan_poisoned_empty():
        fast_t, flse_t = fast.sparse_attention(q, k, v, twin, return_lse=True)
        fast_p, flse_p = fast.sparse_attention(q, k, v, plan, return_lse=True)
    torch.testing.assert_close(flse_t, flse_p, rtol=0, atol=1e-5)
    torch.testing.assert_close(fast_t.float(), fast_p.float(), rtol=0, atol=4e-3)


def test_columns_only_inside_blocks_equal_a_plan_without_columns() -> None:
    n, bm, bn = 64, 16, 16
    blocks = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    plan = BlockColumnPlan.from_masks(blocks, None, seqlen=n, block_m=bm, block_n=bn)
    twin = covered_twin(plan, p=1.0, seed=0).validate()
    assert twin.column_index.shape[3] == n and plan.column_index.shape[3] == 0
    assert twin.equal(plan) and plan.equal(twin)
    q, k, v = _qkv(1, 1, 1, n, 32, torch.float16, seed=1)
    check_sparse_attention(q, k, v, twin)
    check_recall_density(q, k, twin, expected_selection=plan)


def test_shared_expanded_columns_in_the_kernel() -> None:
    """One column list, stride 0 over batch, heads and query blocks; counts a causal prefix."""
    b, hq, hkv, n, bm, bn = 2, 4, 2, 150, 32, 16
    qb = cdiv(n, bm)
    cols = torch.tensor([0, 3, 17, 40, 41, 64, 90, 127, 128, 149], dtype=torch.int32)
    last_row = ((torch.arange(qb) + 1) * bm - 1).clamp(max=n - 1).to(torch.int32)
    counts = torch.searchsorted(cols, last_row, right=True, out_int32=True)
    # The diagonal key blocks of every query block: block i covers keys [32i, 32i + 32).
    diag = torch.stack([torch.arange(qb) * 2, torch.arange(qb) * 2 + 1], dim=1)
    diag_count = (diag * bn < n).sum(dim=1).to(torch.int32)
    plan = BlockColumnPlan(
        seqlen=n, block_m=bm, block_n=bn,
        block_count=diag_count.expand(b, hq, qb),
        block_index=diag.to(torch.int32).expand(b, hq, qb, 2),
        column_count=counts.expand(b, hq, qb),
        column_index=cols.expand(b, hq, qb, cols.numel()),
    ).validate()
    assert plan.column_index.stride() == (0, 0, 0, 1)
    assert plan.nbytes() == 4 * (qb + qb * 2 + qb + cols.numel())
    q, k, v = _qkv(b, hq, hkv, n, 64, torch.bfloat16, seed=2)
    check_sparse_attention(q, k, v, plan)
    count, index = plan.own_columns()
    disjoint = replace(plan, column_count=count, column_index=index)
    check_recall_density(q, k, plan, expected_selection=disjoint)


def test_fast_vertical_slash_index_shares_verticals() -> None:
    """The fast index against the reference (disjoint) one: equal, same density and output."""
    gen = torch.Generator().manual_seed(7)
    b, h, n, bm, bn, kv, ks = 2, 2, 200, 32, 16, 25, 12
    verticals = torch.stack([torch.randperm(n, generator=gen)[:kv] for _ in range(b * h)])
    slashes = torch.stack([torch.randperm(n, generator=gen)[:ks] for _ in range(b * h)])
    verticals = verticals.sort(-1).values.reshape(b, h, kv).int()
    slashes = slashes.sort(-1).values.reshape(b, h, ks).int()
    got = fast_index(verticals, slashes, seqlen=n, block_m=bm, block_n=bn).validate()
    want = reference_index(verticals, slashes, seqlen=n, block_m=bm, block_n=bn)
    assert got.equal(want) and want.equal(got)
    assert got.column_index.stride(2) == 0 and got.column_index.shape[3] == kv
    assert got.block_index.shape[3] == int(want.block_count.max())
    # Every causal vertical is listed, inside a listed block or not.
    last_row = ((torch.arange(cdiv(n, bm)) + 1) * bm - 1).clamp(max=n - 1)
    assert torch.equal(got.column_count, (verticals[:, :, None, :] <= last_row[:, None]).sum(-1).int())
    q, k, v = _qkv(b, h, 1, n, 32, torch.float16, seed=8)
    check_sparse_attention(q, k, v, got)
    check_recall_density(q, k, got, expected_selection=want)


def test_width_bound_under_graph_capture() -> None:
    """While a CUDA graph is captured no sync is allowed: the parameter bound is the width
    (as inside `static_widths()`, which capture turns on too)."""
    verticals, slashes = minference_anchor_lines(1, 2, 300, vertical_size=40, slash_size=20,
                                                 device=torch.device("cpu"))
    tight = fast_index(verticals, slashes, seqlen=300, block_m=32, block_n=32)
    with static_widths():
        loose = fast_index(verticals, slashes, seqlen=300, block_m=32, block_n=32).validate()
    assert loose.block_index.shape[3] == index_width_bound(20, seqlen=300, block_m=32, block_n=32)
    assert tight.block_index.shape[3] < loose.block_index.shape[3]
    assert loose.equal(tight)


# -- plan memory ------------------------------------------------------------------


def _old_bound_nbytes(b: int, h: int, n: int, bm: int, bn: int, kv: int, ks: int) -> int:
    """Bytes before this change: data-free block width and `kv` columns per query block."""
    width = index_width_bound(ks, seqlen=n, block_m=bm, block_n=bn) + kv
    return 4 * b * h * cdiv(n, bm) * (width + 2)


@pytest.mark.parametrize("n", [1024, 4096])
def test_anchor_plan_memory_formula(n: int) -> None:
    """ANCHORS' lines (first 30 + random verticals, nearest slashes), 64 x 64 blocks.

    The nearest `ks` diagonals reach `ks + 63` keys per query block: `ceil((ks - 1) / 64) + 1`
    key blocks once the block is past `ks`, whatever N is. The plan is
    `4 * B * H * (Qb * (W + 2) + k_v)` bytes: O(Qb * W + H * k_v), not O(Qb * (bound + k_v)).
    """
    b, h, kv, ks, bm, bn = 1, 2, 100, 300, 64, 64
    verticals, slashes = minference_anchor_lines(b, h, n, vertical_size=kv, slash_size=ks,
                                                 device=torch.device("cpu"))
    plan = fast_index(verticals, slashes, seqlen=n, block_m=bm, block_n=bn)
    width = plan.block_index.shape[3]
    assert width == cdiv(ks - 1, bn) + 1 == 6
    assert plan.nbytes() == plan_nbytes(b, h, n, block_m=bm, block_width=width, n_vertical=kv)
    assert plan.column_index.untyped_storage().nbytes() == 4 * b * h * kv
    old = _old_bound_nbytes(b, h, n, bm, bn, kv, ks)
    assert plan.nbytes() * 5 < old
    # At the size the same formula gives ~0.2 GB instead of 27.7 GB.
    big = plan_nbytes(1, 32, 1 << 20, block_m=64, block_width=cdiv(6096 - 1, 64) + 1, n_vertical=1000)
    assert big == 4 * 32 * (16384 * 99 + 1000)
    assert big < 250e6 and _old_bound_nbytes(1, 32, 1 << 20, 64, 64, 1000, 6096) > 27e9
