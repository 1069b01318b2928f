"""Run `mypy --strict` over the installed layout of sparseprefill.

mypy cannot follow setuptools' package-dir mapping, so this checks the layout
that `tools/layout.py` builds from symbolic links in a temporary folder, with the
project's configuration. Exit code is mypy's.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layout import ROOT, make_layout  # noqa: E402


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        make_layout(Path(tmp))
        cmd = [sys.executable, "-m", "mypy", "--strict", "--config-file",
               str(ROOT / "pyproject.toml"), "--cache-dir", str(Path(tmp) / ".mypy_cache"),
               "-p", "sparseprefill"]
        return subprocess.call(cmd, cwd=tmp)


if __name__ == "__main__":
    sys.exit(main())
