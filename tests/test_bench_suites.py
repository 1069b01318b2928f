"""The GPU benchmark suites, run structurally on CPU: every row well formed.

Timing needs a GPU (`triton.testing.do_bench`); here the timer is replaced by one
call of the function, so the suite's code paths (estimate, plans, kernels, the
split it reports) run in the interpreter at a small N and a wrong argument or a
missing key fails before the suite ever reaches a GPU.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from sparseprefill import bench


@pytest.fixture
def untimed(monkeypatch: pytest.MonkeyPatch) -> None:
    def once(fn: Any) -> float:
        fn()
        return 1.0

    monkeypatch.setattr(bench, "bench_ms", once)


def test_delta_kv_suite_rows(untimed: None) -> None:
    from sparseprefill.methods.delta_kv import run_delta_kv_suite

    rows = run_delta_kv_suite([80], batch=1, q_heads=2, kv_heads=1, head_dim=32,
                                    dtype=torch.float16, thresholds=(0.5,), device="cpu", log=lambda s: None)
    assert [r.method for r in rows] == ["dense", "delta_kv cos 0.5"]
    row = rows[1]
    assert 0 < row.density <= 1 and row.recall_mean is None
    for key in ("keep_mask_ms", "pack_ms", "plans_ms", "phase1_ms", "phase2_ms", "keep_ratio", "floor_ms"):
        assert key in row.extra, key
    assert 0 < row.extra["keep_ratio"] <= 1
    assert math.isfinite(row.extra["rel_err_vs_dense"])
    assert "delta_kv cos 0.5" in bench.format_table(rows)
