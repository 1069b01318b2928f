"""pytest-benchmark suite of the GPU kernels: `pytest benches/ --benchmark-json out.json`.

Skipped entirely without a CUDA device. Each case times one call with CUDA events
(median of many) and stores it in `extra_info`, beside pytest-benchmark's own
wall-clock statistics of the synchronised call, so runs compare with
`--benchmark-compare`.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="the benchmarks need a CUDA device")
    for item in items:
        item.add_marker(skip)
