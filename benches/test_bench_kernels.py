"""Kernel benchmarks as a pytest-benchmark suite (GPU only; see conftest.py).

`BENCH_SEQLENS=8192,32768` (comma-separated) chooses the lengths (default 8K, 32K, 128K).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sparseprefill import fast
from sparseprefill.bench import random_block_plan

SEQLENS = [int(n) for n in os.environ.get("BENCH_SEQLENS", "8192,32768,131072").split(",") if n]
HQ, HKV, D = 32, 8, 128


def cuda_event_ms(fn: Callable[[], Any], reps: int = 20) -> float:
    """Median milliseconds of `fn` timed with CUDA events, after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


@pytest.fixture(scope="module", params=SEQLENS, ids=lambda n: f"N{n}")
def qkv(request: pytest.FixtureRequest) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = request.param
    torch.manual_seed(n)
    dev = torch.device("cuda")
    q = torch.randn(1, HQ, n, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, HKV, n, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, HKV, n, D, device=dev, dtype=torch.bfloat16)
    return q, k, v


def _run(benchmark: Any, fn: Callable[[], Any], flops: float) -> None:
    ms = cuda_event_ms(fn)
    benchmark.extra_info["cuda_event_median_ms"] = ms
    benchmark.extra_info["tflops"] = flops / ms / 1e9

    def synced() -> None:
        fn()
        torch.cuda.synchronize()

    benchmark.pedantic(synced, rounds=10, warmup_rounds=2)


def _flops(q: torch.Tensor, density: float) -> float:
    b, h, n, d = q.shape
    return 4.0 * d * b * h * density * n * (n + 1) / 2


def test_cudnn_sdpa(benchmark: Any, qkv: tuple[torch.Tensor, ...]) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    q, k, v = qkv
    g = HQ // HKV
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

    def fn() -> Any:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)

    _run(benchmark, fn, _flops(q, 1.0))


@pytest.mark.parametrize("case", ["dense", "streaming", "random5", "random20"])
def test_sparseprefill(benchmark: Any, qkv: tuple[torch.Tensor, ...], case: str) -> None:
    q, k, v = qkv
    n = q.shape[2]
    if case == "dense":
        plan = fast.dense_plan(q, k)
    elif case == "streaming":
        plan = fast.streaming_plan(q, k, sink=1024, window=8192)
    else:
        dens = 0.05 if case == "random5" else 0.20
        plan = random_block_plan(1, HQ, n, density=dens, block_m=128, block_n=128, device=q.device)
    density = float(fast.density(plan).mean())
    benchmark.extra_info["density"] = density
    _run(benchmark, lambda: fast.sparse_attention(q, k, v, plan), _flops(q, density))
