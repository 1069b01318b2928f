"""Run `mypy --strict` over the installed layout of sparseprefill.

The distribution maps the top-level folders `reference/`, `fast/` and
`conformance/` onto `sparseprefill.*` (setuptools package-dir), which mypy cannot
follow; this script builds that layout from symbolic links in a temporary folder
and checks it with the project's configuration. Exit code is mypy's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("reference", "fast", "conformance")


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        pkg = Path(tmp) / "sparseprefill"
        pkg.mkdir()
        for entry in (ROOT / "sparseprefill").iterdir():
            if entry.name != "__pycache__":
                os.symlink(entry, pkg / entry.name)
        for sub in SUBPACKAGES:
            os.symlink(ROOT / sub, pkg / sub)
        cmd = [sys.executable, "-m", "mypy", "--strict", "--config-file",
               str(ROOT / "pyproject.toml"), "--cache-dir", str(Path(tmp) / ".mypy_cache"),
               "-p", "sparseprefill"]
        return subprocess.call(cmd, cwd=tmp)


if __name__ == "__main__":
    sys.exit(main())
