"""`sparseprefill eval granularity | heldout | layers | passkey --config` and `sparseprefill
workload accept | table` at tiny sizes on the CPU (no model download: a tiny random Llama)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from sparseprefill import unit_bounds
from sparseprefill.cli import main

N, HQ, HKV, D = 96, 4, 2, 16


def capture(tmp_path: Path, layers: tuple[int, ...] = (0, 1), n: int = N) -> Path:
    gen = torch.Generator().manual_seed(0)
    data = {"layers": list(layers), "q": [torch.randn(1, HQ, n, D, generator=gen) * 1.5 for _ in layers],
            "k": [torch.randn(1, HKV, n, D, generator=gen) for _ in layers],
            "v": [torch.randn(1, HKV, n, D, generator=gen) for _ in layers], "scale": [D ** -0.5] * len(layers),
            "meta": {"model": "toy"}}
    path = tmp_path / "cap.pt"
    torch.save(data, path)
    return path


def test_unit_bounds_order_and_edges() -> None:
    """Finer units never need more than coarser ones; one-token tiles are the mean oracle."""
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(64, 8, generator=gen) * 2, torch.randn(64, 8, generator=gen)
    p = unit_bounds.head_probs(q, k, 8 ** -0.5)
    assert torch.allclose(p.sum(-1), torch.ones(64, dtype=torch.float64))
    share = 0.9
    mean, row = unit_bounds.mean_bound(p, share), unit_bounds.row_bound(p, share)
    assert mean <= row + 1e-12  # a mean target lets rows fall below
    one, _ = unit_bounds.block_bounds(p, 1, share)
    assert one == pytest.approx(mean)
    b16, b16_rows = unit_bounds.block_bounds(p, 16, share)
    assert mean <= b16 <= 1.0 and b16 <= b16_rows + 1e-12
    assert mean <= unit_bounds.stripes_bound(p, 16, share) <= 1.0
    lines = unit_bounds.lines_bound(p, share)
    assert mean <= lines["density"] <= 1.0 and lines["vertical"] + lines["slash"] > 0
    assert unit_bounds.row_bound(p, 1.0) == pytest.approx(1.0, abs=0.05)


def test_eval_granularity_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "g.json"
    assert main(["eval", "granularity", "--qkv", str(capture(tmp_path)), "--layers", "1", "--seqlen", "64",
                 "--blocks", "16", "--stripes", "16", "--json", str(out)]) == 0
    assert "| layer | row | mean | block16 |" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["seqlen"] == 64 and list(data["layers"]) == ["1"] and len(data["layers"]["1"]) == HQ
    assert set(data["layers"]["1"][0]) == {"row", "mean", "block16", "block16_rows", "stripes16", "lines"}
    assert main(["eval", "granularity", "--qkv", str(capture(tmp_path)), "--layers", "7",
                 "--json", str(out)]) == 2


def _table(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"summary": rows}))
    return path


def _summary(method: str, layer: int, density: float, oracle: float, recall: float, worst: float) -> dict[str, Any]:
    return {"method": method, "layer": layer, "density": density, "oracle": oracle, "ratio": density / oracle,
            "recall_mean": recall, "recall_min_head": worst}


def test_eval_heldout_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cal = _table(tmp_path / "cal.json", [_summary("xattention", 0, 0.2, 0.1, 0.97, 0.9)])
    held = _table(tmp_path / "held.json", [_summary("xattention", 0, 0.3, 0.1, 0.96, 0.9),
                                           _summary("vertical_slash", 0, 0.15, 0.1, 0.95, 0.8)])
    held0 = _table(tmp_path / "held0.json", [_summary("xattention", 0, 0.2, 0.1, 0.93, 0.8)])
    gran = tmp_path / "g.json"
    gran.write_text(json.dumps({"layers": {"0": [{"row": 0.1, "block128": 0.25, "lines": {"density": 0.18}}] * 2}}))
    out = tmp_path / "h.json"
    assert main(["eval", "heldout", "--config", f"m=cal.json:held.json".replace("cal.json", str(cal))
                 .replace("held.json", str(held)), "--versus", f"m=-:{held0}", "--granularity", str(gran),
                 "--unit", "xattention=block128", "--unit", "vertical_slash=lines", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "block128 0.250 (2.5x)" in text and "1.50x" in text
    rows = {r["method"]: r for r in json.loads(out.read_text())}
    x, vs = rows["xattention"], rows["vertical_slash"]
    # 3x the oracle: the tile bound alone is 2.5x, so the unit is to blame; vertical-slash misses the head target.
    assert x["why"] == "granularity" and not x["meets"] and x["versus"]["density_cost"] == pytest.approx(1.5)
    assert vs["calibration"] is None and not vs["meets"] and vs["why"] == "" and vs["bound_ratio"] == pytest.approx(1.8)
    assert main(["eval", "heldout", "--config", f"m={held}"]) == 2
    assert main(["eval", "heldout", "--config", f"m=-:{held}", "--versus", f"other=-:{held}"]) == 2


def test_eval_layers_carries_the_state(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A stateful method (SharePrefill) over every layer in order, one report layer measured
    with another method at its density; a stateless one layer by layer."""
    from sparseprefill.reference import ClusterLayout

    layers = (0, 1, 2)
    cap = capture(tmp_path, layers, n=128)
    layout = ClusterLayout.uniform(len(layers), HQ).save(tmp_path / "layout.json")
    setting = json.dumps({"layout": str(layout), "block_m": 32, "block_n": 32})
    out = tmp_path / "l.json"
    assert main(["eval", "layers", "--qkv", str(cap), "--method", "shareprefill", "--setting", setting,
                 "--report-layers", "2", "--match", "streaming", "--json", str(out),
                 "--png", str(tmp_path / "l.png")]) == 0
    assert "heads per decision and layer" in capsys.readouterr().out
    result = json.loads(out.read_text())
    per_layer = result["settings"][0]["per_layer"]
    assert [e["layer"] for e in per_layer] == [0, 1, 2]
    assert all(sum(e["counts"].values()) == HQ for e in per_layer)
    share, matched = result["rows"]
    assert share["method"] == "shareprefill" and matched["method"] == "streaming"
    assert 0 < share["density"] <= 1 and share["oracle_density_at_recall"] <= share["density"] + 1e-9
    assert len(share["pattern_per_head"]) == HQ and (tmp_path / "l.png").exists()
    assert main(["eval", "layers", "--qkv", str(cap), "--method", "streaming", "--setting",
                 '{"sink": 16, "window": 32}', "--report-layers", "1"]) == 0
    assert main(["eval", "layers", "--qkv", str(cap), "--method", "streaming", "--report-layers", "9"]) == 2


def test_passkey_configs_side_by_side(tmp_path: Path) -> None:
    """Two calibrated configs of one method run as two labelled runs beside the SDPA model;
    every trial's margin is kept and decides the verdict; the masked backend checked against
    the reference one."""
    pytest.importorskip("transformers", reason="the `hf` extra is not installed")
    import argparse

    from transformers import LlamaConfig, LlamaForCausalLM

    from sparseprefill import evaluate
    from sparseprefill.config import CalibratedConfig, write_config

    class CharTokenizer:
        chat_template = None

        def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
            return {"input_ids": [min(ord(c), 127) for c in text]}

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=HQ, num_key_value_heads=HKV,
                                         max_position_embeddings=512)).eval()
    paths = []
    for name, window in (("a", 16), ("b", 64)):
        paths.append(write_config(tmp_path / f"{name}.json", CalibratedConfig(
            "streaming", {0: {"sink": 16, "window": window, "block_m": 16, "block_n": 16}}, {"q_heads": HQ})))
    args = argparse.Namespace(config=[f"narrow={paths[0]}", str(paths[1])], methods=None, params=None,
                              no_dense=False)
    runs = evaluate._runs(args)
    assert [r.label for r in runs] == ["sdpa", "narrow", "streaming (b)"]
    assert runs[1].params == {0: {"sink": 16, "window": 16, "block_m": 16, "block_n": 16}}
    cells = evaluate.passkey_grid(model, CharTokenizer(), runs, lengths=[300], depths=[0.5], trials=2,
                                  backend="reference")
    assert [c.method for c in cells] == ["sdpa", "narrow", "streaming (b)"]
    for c in cells:
        assert len(c.margins) == 2 and c.correct == sum(m > 0 for m in c.margins)
    checks = evaluate.check_backends(model, CharTokenizer(), runs, 200)
    assert [c["label"] for c in checks] == ["narrow", "streaming (b)"]
    assert all(c["max_abs_logit_diff"] < 1e-3 for c in checks)
    with pytest.raises(ValueError, match="one label"):
        evaluate._runs(argparse.Namespace(config=[f"x={paths[0]}", f"x={paths[1]}"], methods=None, params=None,
                                          no_dense=True))


def test_workload_accept_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`workload fit` on a toy capture, `accept` on one head of its layer, `table` from both."""
    from sparseprefill.demo import Shape, synthetic_qkv

    q, k, v = synthetic_qkv(Shape(1, 2, 1, 256, 32, torch.float32), device=torch.device("cpu"), seed=3)
    cap = tmp_path / "cap.pt"
    torch.save({"layers": [4], "q": [q], "k": [k], "v": [v], "scale": [32 ** -0.5], "meta": {"model": "t"}}, cap)
    fit, report = tmp_path / "fit.json", tmp_path / "report.json"
    assert main(["workload", "fit", "--qkv", str(cap), "--iterations", "1", "--rows", "16",
                 "--calibration", str(fit), "--json", str(report)]) == 0
    acc = tmp_path / "acc.json"
    assert main(["workload", "accept", "--qkv", str(cap), "--calibration", str(fit), "--query-heads", "0",
                 "--methods", "streaming", "xattention", "--json", str(acc)]) == 0
    result = json.loads(acc.read_text())
    item = result["layers"][0]
    assert item["layer"] == 4 and item["query_heads"] == [0] and set(item["oracle"]) == {"captured", "calibrated"}
    assert set(item["gaps"]) == {"streaming", "xattention"}
    capsys.readouterr()
    table = tmp_path / "table.json"
    assert main(["workload", "table", "--reports", str(report), "--acceptance", str(acc), "--json",
                 str(table)]) == 0
    text = capsys.readouterr().out
    assert "| 4 |" in text and "X = xattention" not in text and "xattention" in text
    rows = json.loads(table.read_text())["layers"]
    assert rows[0]["layer"] == 4 and set(rows[0]["acceptance"]["gaps"]) <= {"streaming", "xattention"}
    assert main(["workload", "accept", "--qkv", str(cap), "--calibration", str(fit), "--layers", "9",
                 "--json", str(acc)]) == 2
