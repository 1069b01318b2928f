"""Test setup: Triton's CPU interpreter, a Hypothesis profile, small caps.

`TRITON_INTERPRET=1` must be set before triton is imported (triton reads it when a
kernel is defined), so it is set here, at the top of the first file pytest loads.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402

from sparseprefill.conformance.strategies import Caps  # noqa: E402

# Fixed examples every run (derandomize), no example database in the work tree, and
# no shrinking: under the interpreter Hypothesis would spend its full 5-minute shrink
# budget on a failure; the failure message already names shape, seeds and plan.
settings.register_profile(
    "sparseprefill-cpu",
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much],
)
settings.load_profile("sparseprefill-cpu")

# Under pytest-xdist (`-n auto`, the README's command) each worker takes its share of
# the cores: a full torch thread pool per worker would oversubscribe them.
_WORKERS = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
if _WORKERS:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(_WORKERS)))

# Examples per Hypothesis property test; raise it locally for a deeper run.
EXAMPLES = int(os.environ.get("SPARSEPREFILL_TEST_EXAMPLES", "12"))

# N <= 200 and a cap on kernel work keep one kernel call near 0.4 s in the interpreter.
CPU_CAPS = Caps(device="cpu", max_seqlen=200, max_tile_steps=40)


@pytest.fixture(scope="session")
def cpu_caps() -> Caps:
    return CPU_CAPS
