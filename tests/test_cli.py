"""The `sparseprefill` command: subcommands, lazy imports, and the CPU demo end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparseprefill.cli import COMMANDS, main
from sparseprefill.conformance.registry import METHODS


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
        assert row["notes"] == "" or row["notes"].startswith("plans differ"), row
        assert 0.0 < row["density"] <= 1.0
        assert 0.0 <= row["recall_min"] <= row["recall_mean"] <= 1.0 + 1e-6
        assert row["error_vs_ref64"] is not None and row["error_vs_ref64"] < 1e-2, row
    dense = [r for r in rows if r["method"] == "dense"]
    assert all(r["recall_min"] > 0.999 and r["error_vs_full"] < 1e-2 for r in dense)
