"""`sparseprefill tune`: SampleAttention's offline tuner on tiny captures (CPU, reference).

The tuner's recall and density come from per-cell attention masses; they must equal
`reference.recall` / `reference.density` of the plan the written settings produce.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sparseprefill import reference
from sparseprefill.cli import main as cli_main
from sparseprefill.demo import Shape, synthetic_qkv
from sparseprefill.reference.sample_attention import SampleAttentionSettings
from sparseprefill.tune import cell_mass, cell_pairs, ranges_of


def _capture(path: Path, n: int, seed: int) -> Path:
    q, k, v = synthetic_qkv(Shape(1, 4, 2, n, 32, torch.float16), device=torch.device("cpu"), seed=seed)
    torch.save({"layers": [3, 5], "q": [q, q.flip(1)], "k": [k, k.flip(1)], "v": [v, v],
                "scale": [None, 0.2]}, path)
    return path


def test_cell_mass_and_pairs_by_definition() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 37, 16, generator=gen), torch.randn(1, 1, 37, 16, generator=gen)
    mass = cell_mass(q, k, 16, scale=None)
    probs = torch.softmax((q.double() @ k.double().transpose(-1, -2) / 4).masked_fill(
        torch.ones(37, 37, dtype=torch.bool).triu(1), float("-inf")), dim=-1)
    want = torch.nn.functional.pad(probs, (0, 11, 0, 11)).reshape(1, 2, 3, 16, 3, 16).sum(dim=(3, 5))
    torch.testing.assert_close(mass, want)
    pairs = cell_pairs(37, 16, torch.device("cpu"))
    causal = torch.nn.functional.pad(torch.ones(37, 37).tril(), (0, 11, 0, 11))
    assert torch.equal(pairs, causal.reshape(3, 16, 3, 16).sum(dim=(1, 3)).long())
    assert ranges_of([10, 20]) == [(0, 10), (10, 20), (20, None)]


def test_tune_writes_settings_that_reproduce_its_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    short = _capture(tmp_path / "short.pt", 100, 0)
    long = _capture(tmp_path / "long.pt", 200, 1)
    out, table = tmp_path / "tuned.json", tmp_path / "table.json"
    code = cli_main(["tune", "--method", "sample_attention", "--qkv", str(short), str(long), "--bounds", "150",
                     "--block-size", "16", "--alphas", "0.5,0.9,0.98", "--chunks", "1,2", "--target-mean", "0.9",
                     "--target-min", "0.8", "--out", str(out), "--table", str(table)])
    assert code == 0
    text = capsys.readouterr().out
    assert text.count("chosen") == 2 and "| alpha_c | alpha_s | chunk_n | density |" in text
    settings = SampleAttentionSettings.load(out)
    assert [(r.min_seqlen, r.max_seqlen) for r in settings.ranges] == [(0, 150), (150, None)]
    assert settings.block_size == 16 and settings.target is not None
    report = json.loads(table.read_text())
    assert len(report[0]["candidates"]) == 3 * 3 * 2
    for path, r in ((short, settings.ranges[0]), (long, settings.ranges[1])):
        assert r.stats is not None and r.stats["meets_target"]
        assert r.stats["recall_worst_layer"] >= 0.9 and r.stats["recall_min"] >= 0.8
        data = torch.load(path)
        densities, recalls = [], []
        for i in range(2):
            q, k, scale = data["q"][i].float(), data["k"][i].float(), data["scale"][i]
            plan = reference.sample_attention_plan(q, k, block_size=16, settings=out, scale=scale)
            densities.append(float(reference.density(plan).mean()))
            recalls.append(reference.recall(q, k, plan, scale=scale).double().mean(dim=-1))
        assert sum(densities) / 2 == pytest.approx(r.stats["density"], rel=1e-12)
        assert min(float(x.mean()) for x in recalls) == pytest.approx(r.stats["recall_worst_layer"], abs=1e-6)
        assert float(torch.cat(recalls).min()) == pytest.approx(r.stats["recall_min"], abs=1e-6)
        # No cheaper candidate met the target.
        cands = next(x for x in report if x["min_seqlen"] == r.min_seqlen)["candidates"]
        assert all(c["density"] >= r.stats["density"] for c in cands if c["meets"])


def test_tune_reports_an_unreachable_target_and_rejects_bad_grids(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    cap = _capture(tmp_path / "c.pt", 80, 2)
    out = tmp_path / "tuned.json"
    code = cli_main(["tune", "--qkv", str(cap), "--block-size", "16", "--alphas", "0.1", "--chunks", "1",
                     "--target-mean", "1.0", "--target-min", "1.0", "--out", str(out)])
    assert code == 0
    assert "no setting meets" in capsys.readouterr().out
    stats = SampleAttentionSettings.load(out).ranges[0].stats
    assert stats is not None and stats["meets_target"] is False
    for bad in (["--alphas", "1.5"], ["--chunks", "0"], ["--target-mean", "2"]):
        assert cli_main(["tune", "--qkv", str(cap), "--out", str(out), *bad]) == 2
