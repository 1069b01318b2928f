"""The Hopper (sm90) path of the block kernel: its dispatch rule, and its kernel compiled offline.

The path itself runs only on an sm90 GPU (its numbers are checked there against the
portable kernel: docs/hopper-path.md); on the CPU these tests check that the rule picks
it from the call's features and the plan's shapes alone, that nothing but an sm90 GPU
takes it, and that the Gluon kernel compiles for sm90 with Triton's own ptxas into
warpgroup MMAs, register reallocation and mbarriers within the shared memory of a block.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

import pytest
import torch

from sparseprefill.fast.dense import dense_plan
from sparseprefill.fast.kernels import block_column as bc
from sparseprefill.fast.kernels import block_column_hopper as hop
from sparseprefill.fast.kernels import hopper_offline
from sparseprefill.reference.attention import AttentionState
from sparseprefill.reference.plan import BlockColumnPlan


def _call(d: int = 128, n: int = 300, block_m: int = 128, block_n: int = 128, **features: Any) -> tuple[Any, Any]:
    q = torch.randn(1, 4, n, d, dtype=torch.bfloat16)
    k = torch.randn(1, 2, n, d, dtype=torch.bfloat16)
    plan = dense_plan(q, k, block_m=block_m, block_n=block_n)
    return bc._KernelCall(q, k, k, plan, d ** -0.5, n, True, **features), plan


@pytest.mark.parametrize("d, block_m, block_n, ok", [
    (128, 128, 128, True), (64, 128, 128, True), (128, 256, 128, True), (128, 128, 64, True),
    (128, 64, 64, True), (64, 64, 128, True), (128, 192, 64, True),
    (96, 128, 128, False), (256, 128, 128, False), (32, 128, 128, False),
    (128, 32, 128, False), (128, 48, 64, False), (128, 128, 32, False), (128, 128, 16, False),
])
def test_rule_takes_the_shapes_it_supports(d: int, block_m: int, block_n: int, ok: bool) -> None:
    call, plan = _call(d=d, block_m=block_m, block_n=block_n)
    assert hop.eligible(call, plan) is ok


def test_rule_leaves_every_other_feature_to_the_portable_kernel() -> None:
    call, plan = _call()
    assert hop.eligible(call, plan)
    b, h, n, d = call.q.shape
    others = {
        "mask": torch.ones(n, n, dtype=torch.bool),
        "state": AttentionState.like(call.q),
        "block_mean_out": torch.zeros(b, h, plan.num_query_blocks, plan.num_key_blocks),
        "key_bias": torch.zeros(b, 2, n),
        "kv_offsets": torch.zeros(2, dtype=torch.int64),
        "row_max": torch.zeros(b, h, n),
        "dest": (torch.empty_like(call.q), None),
    }
    for name, value in others.items():
        assert not hop.eligible(replace(call, **{name: value}), plan), name
    with_columns = BlockColumnPlan(seqlen=n, block_m=128, block_n=128, block_count=plan.block_count,
                                   block_index=plan.block_index,
                                   column_count=torch.zeros(b, h, plan.num_query_blocks, dtype=torch.int32),
                                   column_index=torch.zeros(b, h, plan.num_query_blocks, 1, dtype=torch.int32))
    # Column lists run here only with the switch on (off by default: slower on the H200 at
    # 32K) and only where disjoint from the blocks (no in-kernel covered test).
    disjoint = replace(with_columns, columns_disjoint=True)
    saved = hop.COLUMNS
    try:
        hop.apply_switches({"HOPPER_COLUMNS": "0"})
        assert not hop.eligible(call, disjoint) and hop.eligible(call, plan)
        hop.apply_switches({"HOPPER_COLUMNS": "1"})
        assert hop.eligible(call, disjoint) and not hop.eligible(call, with_columns)
    finally:
        hop.apply_switches({})
        hop.COLUMNS = saved


def test_nothing_but_an_sm90_gpu_takes_the_path() -> None:
    call, plan = _call()
    assert not hop.supports(call, plan)  # CPU tensors
    saved = hop.ENABLED
    try:
        hop.ENABLED = False
        assert not hop.supports(call, plan)
    finally:
        hop.ENABLED = saved


def test_portable_kernel_still_runs_the_calls_the_rule_takes() -> None:
    """On the CPU the launcher's output for an eligible call is the portable kernel's."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's CPU interpreter (TRITON_INTERPRET=1)")
    call, plan = _call(n=200)
    out, lse = bc.block_column_attention(call.q, call.k, call.v, plan, return_lse=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        call.q.float(), call.k.float().repeat_interleave(2, 1), call.v.float().repeat_interleave(2, 1),
        is_causal=True)
    assert lse is not None and torch.isfinite(lse).all()
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_kernel_compiles_for_sm90_into_warp_specialised_wgmma() -> None:
    """Every shape the launcher picks compiles for sm90 (Triton's ptxas, no GPU): one block of
    three warpgroups inside an H200's 227 KiB, with warpgroup MMAs, register reallocation,
    TMA loads and mbarriers."""
    if not hop._GLUON:
        pytest.skip("this Triton has no Gluon warp_specialize")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter cannot compile Gluon
    proc = subprocess.run([sys.executable, "-m", "sparseprefill.fast.kernels.hopper_offline"], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout)
    assert [r["variant"] for r in rows] == [hopper_offline.variant_tag(*v) for v in hopper_offline.VARIANTS]
    for r in rows:
        assert r["num_warps"] == 12, r  # two consumer warpgroups and the producer warp(s), padded
        assert r["shared"] <= 227 * 1024, r
        assert r["HGMMA"] > 0 and r["USETMAXREG"] > 0 and r["UTMALDG"] > 0 and r["SYNCS"] > 0, r
        # Column lists: the producer gathers their rows with cp.async (LDGSTS); block plans never.
        assert (r["LDGSTS"] > 0) == r["variant"].endswith("_columns"), r


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_nonfinite_parts_find_every_nan_and_inf(dtype: torch.dtype) -> None:
    """The one pass the Hopper path gates its value-tile test on: each program's word is 1
    exactly where its share of V holds a NaN or an infinity (CPU interpreter)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's CPU interpreter (TRITON_INTERPRET=1)")
    v = torch.randn(2, 3, 50, 16).to(dtype)  # 4800 values: shares of 256 over 4 programs
    flat = v.reshape(-1)
    block, programs = 256, 4

    def parts(x: torch.Tensor) -> list[int]:
        out = torch.full((programs,), -1, dtype=torch.int32)
        hop._nonfinite_parts[(programs,)](x, out, x.numel(), BLOCK=block)
        return out.tolist()

    assert parts(flat) == [0] * programs
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in (0, 255, 256, 1500, 4799):
            w = flat.clone()
            w[at] = bad
            owner = (at // block) % programs  # program p reads blocks p, p + 4, ...
            assert parts(w) == [int(p == owner) for p in range(programs)], (bad, at)
