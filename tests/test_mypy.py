"""`mypy --strict` over the whole package passes (tools/run_mypy.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parent.parent / "tools" / "run_mypy.py"


@pytest.mark.skipif(not RUNNER.exists(), reason="tools/run_mypy.py is not in this checkout")
def test_mypy_strict_clean() -> None:
    proc = subprocess.run([sys.executable, str(RUNNER)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, f"mypy --strict failed:\n{proc.stdout}\n{proc.stderr}"
