"""The `sparseprefill` command: subcommands, lazy imports, and the CPU demo end to end."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparseprefill.cli import COMMANDS, main
from sparseprefill.conformance.registry import METHODS

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, "-m", "sparseprefill.cli", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=600)


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert "sparseprefill" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["demo", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--seqlen", "--device", "--out", "--json"):
        assert option in out


def test_missing_command_is_an_error() -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    with pytest.raises(SystemExit) as info:
        main(["no-such-command"])
    assert info.value.code == 2


def test_commands_are_imported_lazily() -> None:
    # Choosing `demo` must not import Triton (the demo sets TRITON_INTERPRET first)
    # nor the bench module.
    code = (
        "import sys; from sparseprefill.cli import build_parser; build_parser(['demo']); "
        "bad = [m for m in ('triton', 'sparseprefill.bench', 'sparseprefill.fast') "
        "if m in sys.modules]; sys.exit(str(bad) if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_bench_help() -> None:
    assert "bench" in [c.name for c in COMMANDS]
    if importlib.util.find_spec("sparseprefill.bench") is None:
        pytest.skip("sparseprefill.bench is not written yet")
    with pytest.raises(SystemExit) as info:
        main(["bench", "--help"])
    assert info.value.code == 0


def test_demo_unknown_method_fails() -> None:
    proc = _run("demo", "--device", "cpu", "--seqlen", "64", "--methods", "nonexistent")
    assert proc.returncode == 2
    assert "nonexistent" in proc.stderr


def test_demo_table_and_png(tmp_path: Path) -> None:
    png, js = tmp_path / "masks.png", tmp_path / "demo.json"
    proc = _run("demo", "--device", "cpu", "--seqlen", "200", "--out", str(png), "--json", str(js))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("method "))
    for column in ("backend", "density", "recall mean", "recall min", "err vs full", "time ms"):
        assert column in lines[header]
    body = [line.split() for line in lines[header + 2 :] if line.strip()]
    seen = {(cols[0], cols[1]) for cols in body if cols and cols[0] in METHODS}
    for name in METHODS:
        assert (name, "reference") in seen and (name, "fast") in seen, (name, proc.stdout)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads(js.read_text())["rows"]
    assert len(rows) == 2 * len(METHODS)
    for row in rows:
        # Agreement within tolerance is the conformance suite's job; here every row
        # must simply have been measured.
        assert not row["notes"].startswith("failed"), row
        assert 0.0 < row["density"] <= 1.0
        if METHODS[row["method"]].plan_based:
            assert 0.0 <= row["recall_min"] <= row["recall_mean"]
        else:  # a method that changes the keys (Delta-KV) has no recall
            assert row["recall_min"] is None and row["recall_mean"] is None
        assert math.isfinite(row["error_vs_full"]) and math.isfinite(row["error_vs_ref64"]), row
    dense = [r for r in rows if r["method"] == "dense"]
    assert [r["density"] for r in dense] == [1.0, 1.0]


def _readme_block(title_words: str) -> list[str]:
    """The lines of the first ```bash block after the README line containing `title_words`."""
    text = (ROOT / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(text) if title_words in line)
    begin = next(i for i in range(start, len(text)) if text[i].startswith("```bash"))
    end = next(i for i in range(begin + 1, len(text)) if text[i].startswith("```"))
    return [line for line in text[begin + 1 : end] if line.strip()]


@pytest.mark.skipif(not (ROOT / ".ci" / "run").exists(), reason="not a source checkout")
def test_ci_runs_the_readme_test_commands() -> None:
    readme = _readme_block("Set up and run the tests")
    ci = [line.split(" || ")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert readme and readme[-1].endswith("-m pytest -q -n auto")
    position = [ci.index(line) for line in readme if line in ci]
    assert len(position) == len(readme), f"README test lines missing from .ci/run: {readme}"
    assert position == sorted(position)
    # The demo sets up the same venv and torch; the tests add the `hf` extra and the model.
    assert _readme_block("Set up and run the demo")[:2] == readme[:2]
