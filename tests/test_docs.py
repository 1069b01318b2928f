"""The docs: every relative link and picture resolves, and `docs/figures.py` draws a page's figures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


@pytest.mark.skipif(not (ROOT / "docs").is_dir(), reason="not a source checkout")
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_and_pictures_resolve(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


@pytest.mark.skipif(not (ROOT / "docs" / "figures.py").exists(), reason="not a source checkout")
def test_figures_script_draws_a_page(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(ROOT / "docs" / "figures.py"), "dense", "streaming", "--out",
                          str(tmp_path)], check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert {p.name for p in tmp_path.glob("*.png")} == {"dense.png", "streaming.png"}
    bad = subprocess.run([sys.executable, str(ROOT / "docs" / "figures.py"), "no_such_page"],
                         check=False, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "no_such_page" in bad.stderr
