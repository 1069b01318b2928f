"""`sparseprefill compare` on a tiny capture (CPU, reference backend): table, JSON, plot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sparseprefill import compare
from sparseprefill.cli import main
from sparseprefill.oracle import oracle_density, oracle_row_counts


@pytest.fixture
def tiny_capture(tmp_path: Path) -> Path:
    gen = torch.Generator().manual_seed(0)
    n = 192
    data = {"layers": [0], "q": [torch.randn(1, 2, n, 16, generator=gen).half() * 2],
            "k": [torch.randn(1, 1, n, 16, generator=gen).half()],
            "v": [torch.randn(1, 1, n, 16, generator=gen).half()], "scale": [0.25],
            "meta": {"seqlen": n}}
    path = tmp_path / "tiny.pt"
    torch.save(data, path)
    return path


def test_compare_cli_on_a_tiny_capture(tiny_capture: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "cmp.json", tmp_path / "cmp.png"
    code = main(["compare", "--qkv", str(tiny_capture), "--methods", "dense", "streaming", "vertical_slash",
                 "delta_kv", "--device", "cpu", "--json", str(out), "--png", str(png)])
    assert code == 0
    table = capsys.readouterr().out
    assert "| layer 0 | streaming |" in table and "x oracle" in table
    points = json.loads(out.read_text())["points"]
    methods = {p["method"] for p in points}
    assert methods == {"oracle", "dense", "streaming", "vertical_slash", "delta_kv"}
    dense = [p for p in points if p["method"] == "dense"][0]
    assert dense["density"] == pytest.approx(1.0) and dense["recall_mean"] == pytest.approx(1.0, abs=1e-6)
    assert dense["output_error"] < 1e-3
    # The oracle never needs more keys than any method at the same recall.
    pts = [compare.Point(**p) for p in points]
    for p in pts:
        if p.method != "oracle" and p.recall_mean is not None:
            oracle = compare.oracle_density_at(pts, p.source, min(p.recall_mean, 0.99))
            if oracle is not None:
                assert oracle <= p.density + 1e-9, p
    assert [p for p in pts if p.method == "delta_kv"][0].recall_mean is None
    assert png.exists() and png.stat().st_size > 0


def test_pareto_front() -> None:
    pts = [compare.Point("m", {}, "s", 10, d, r, r, None, 0.0) for d, r in
           [(0.1, 0.5), (0.2, 0.4), (0.3, 0.9), (0.4, 0.9), (0.5, 0.95)]]
    assert [(p.density, p.recall_mean) for p in compare.pareto(pts)] == [(0.1, 0.5), (0.3, 0.9), (0.5, 0.95)]


def test_oracle_rows_of_a_tail_match_the_whole() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 50, 8, generator=gen), torch.randn(1, 1, 50, 8, generator=gen)
    shares = [0.5, 0.9]
    whole = oracle_density(q, k, shares) * (50 * 51 / 2)
    head = oracle_row_counts(q[:, :, :20], k, shares, first_row=0)
    tail = oracle_row_counts(q[:, :, 20:], k, shares, first_row=20)
    torch.testing.assert_close(head + tail, whole)


def test_compare_rejects_unknown_methods(tiny_capture: Path) -> None:
    assert main(["compare", "--qkv", str(tiny_capture), "--methods", "nope", "--device", "cpu"]) == 2
    assert main(["compare", "--qkv", "/nonexistent.pt", "--device", "cpu"]) == 2
