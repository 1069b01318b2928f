"""Build the installed layout of sparseprefill from symbolic links.

The distribution maps the top-level folders `reference/`, `fast/` and
`conformance/` onto `sparseprefill.*` (setuptools package-dir). Tools that cannot
follow that mapping (mypy; a machine where the package cannot be pip-installed)
get the same import layout from `make_layout(dest)`: `dest/sparseprefill/...`.

Usage: `python tools/layout.py DEST` then `PYTHONPATH=DEST python -c "import sparseprefill.fast"`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUBPACKAGES = ("reference", "fast", "conformance")


def make_layout(dest: Path) -> Path:
    """Create `dest/sparseprefill` as links into the repository; return it."""
    pkg = dest / "sparseprefill"
    pkg.mkdir(parents=True, exist_ok=True)
    for entry in (ROOT / "sparseprefill").iterdir():
        if entry.name != "__pycache__" and not (pkg / entry.name).exists():
            os.symlink(entry, pkg / entry.name)
    for sub in SUBPACKAGES:
        if not (pkg / sub).exists():
            os.symlink(ROOT / sub, pkg / sub)
    return pkg


if __name__ == "__main__":
    make_layout(Path(sys.argv[1]))
