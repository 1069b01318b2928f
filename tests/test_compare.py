"""`sparseprefill compare` on a tiny capture (CPU, reference backend): table, JSON, plot."""

from __future__ import annotations

import json
from typing import Any
from pathlib import Path

import pytest
import torch

from sparseprefill import compare, reference
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


def _toy_window_method() -> Any:
    """A plan-based toy (StreamingLLM's plan) with an ablation grid, a grid of its own plan
    function, and extras: what `--ablations` / `--calibrate` read from a descriptor."""
    from sparseprefill import fast, reference
    from sparseprefill.methods import Ablation, Method

    def dense_below(q: torch.Tensor, k: torch.Tensor, *, window: int, block_m: int = 32,
                    block_n: int = 32) -> Any:
        return reference.dense_plan(q, k, block_m=block_m, block_n=block_n)

    return Method(
        name="toy_window_compare", notes="toy", reference_plan=reference.streaming_plan,
        fast_plan=fast.streaming_plan, defaults=lambda n: {"sink": 32, "window": 64, "block_m": 32, "block_n": 32},
        sweep=lambda n: [{"sink": 32, "window": w, "block_m": 32, "block_n": 32} for w in (32, 96)],
        ablations=(Ablation("wide", lambda n: [{"sink": 32, "window": w, "block_m": 32, "block_n": 32}
                                               for w in (32, 64, 128, 160)]),
                   Ablation("own plan", lambda n: [{"window": 0}], reference_plan=dense_below)),
        extras=lambda impl, q, k, v, params, view: {"blocks": float(view.plan.block_mask().sum())},
    )


def test_compare_ablations_yardstick_and_calibration(tiny_capture: Path) -> None:
    from sparseprefill import methods, reference

    toy = methods.register(_toy_window_method())
    try:
        data = torch.load(tiny_capture)
        calibrated: list[compare.Calibrated] = []
        points = compare.compare_capture(data, [toy.name, "vertical_slash"], ablations=True,
                                         yardsticks=["vertical_slash:x4"], calibrate=[0.9, 0.5],
                                         calibrated=calibrated, log=lambda line: None)
    finally:
        methods.unregister(toy.name)
    mine = [p for p in points if p.method == toy.name]
    assert [(p.label, p.params.get("window")) for p in mine] == [
        ("", 32), ("", 96), ("wide", 32), ("wide", 64), ("wide", 128), ("wide", 160), ("own plan", 0)]
    # The shared point (window 32) was measured once and copied under the grid's label.
    assert mine[0].recall_per_head == mine[2].recall_per_head and mine[0].output_error == mine[2].output_error
    own = mine[-1]
    assert own.density == pytest.approx(1.0) and own.recall_mean == pytest.approx(1.0, abs=1e-6)
    assert all(p.extras["blocks"] > 0 for p in mine)
    # Deferred recall (one pass for every plan) equals reference.recall, per head.
    q, k = data["q"][0].float(), data["k"][0].float()
    plan = reference.streaming_plan(q, k, sink=32, window=96, block_m=32, block_n=32)
    want = reference.recall(q, k, plan, scale=0.25).double().mean(dim=-1).flatten().tolist()
    assert mine[1].recall_per_head == pytest.approx(want, abs=1e-6)
    # The oracle at each point's own recall is exact.
    exact = oracle_density(q, k, [min(1.0, mine[1].recall_mean or 0.0)], scale=0.25).mean()
    assert mine[1].oracle_density_at_recall == pytest.approx(float(exact))
    # The yardstick: vertical_slash [x4]'s recall interpolated at each point's density.
    curve = sorted((p.density, p.recall_mean) for p in points if p.method == "vertical_slash" and p.label == "x4")
    for p in mine:
        got = p.yardsticks["vertical_slash:x4"]["recall_mean"]
        inside = [(d0, r0, d1, r1) for (d0, r0), (d1, r1) in zip(curve, curve[1:]) if d0 <= p.density <= d1]
        if not inside:
            assert got is None
            continue
        d0, r0, d1, r1 = inside[0]
        assert got == pytest.approx(r0 if d1 == d0 else r0 + (r1 - r0) * (p.density - d0) / (d1 - d0))
    assert all("vertical_slash:x4" not in p.yardsticks for p in points if p.method == "vertical_slash")
    # Calibration: per head the least dense grid point reaching the target on that head.
    row = next(c for c in calibrated if c.method == toy.name and c.label == "wide" and c.target == 0.5)
    grid = [p for p in mine if p.label == "wide"]
    for h, params in enumerate(row.params_per_head):
        ok = [p for p in grid if p.recall_per_head[h] >= 0.5]
        best = min(ok, key=lambda p: p.density_per_head[h]) if ok else max(grid, key=lambda p: p.recall_per_head[h])
        assert params == best.params
    assert {(c.method, c.label) for c in calibrated} >= {(toy.name, ""), (toy.name, "wide"), ("vertical_slash", "x4")}


def test_compare_cli_evidence_options(tiny_capture: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ev.json"
    code = main(["compare", "--qkv", str(tiny_capture), "--methods", "streaming", "vertical_slash", "--ablations",
                 "--yardstick", "vertical_slash:x4", "--calibrate", "0.9", "--no-output-error", "--layers", "0",
                 "--device", "cpu", "--json", str(out), "--png", str(tmp_path / "ev.png")])
    assert code == 0
    text = capsys.readouterr().out
    assert "vertical_slash:x4 recall / error at that density" in text and "target recall per head" in text
    result = json.loads(out.read_text())
    assert result["calibrated"] and result["arguments"]["ablations"] is True
    assert all(p["output_error"] is None for p in result["points"])
    assert {p["label"] for p in result["points"] if p["method"] == "vertical_slash"} == {"", "x4"}
    bad = ["compare", "--qkv", str(tiny_capture), "--device", "cpu", "--methods", "streaming"]
    assert main([*bad, "--yardstick", "vertical_slash"]) == 2  # not compared in this run
    assert main([*bad, "vertical_slash", "--yardstick", "vertical_slash:nope"]) == 2
    assert main([*bad, "--layers", "5"]) == 2
    assert main([*bad, "--calibrate", "1.5"]) == 2


def test_ablation_descriptor_checks() -> None:
    from sparseprefill import reference
    from sparseprefill.methods import Ablation, Method

    grid = Ablation("a", lambda n: [{}])
    with pytest.raises(ValueError, match="unique labels"):
        Method(name="toy_dup", notes="", defaults=lambda n: {}, reference_plan=reference.dense_plan,
               fast_plan=reference.dense_plan, ablations=(grid, grid))
    with pytest.raises(ValueError, match="plan-based"):
        Method(name="toy_runs", notes="", defaults=lambda n: {}, reference_run=reference.attention,
               fast_run=reference.attention, view=lambda *a: None,
               ablations=(Ablation("b", lambda n: [{}], reference_plan=reference.dense_plan),))


def test_evidence_plans_of_the_tile_methods() -> None:
    """The ablations' own plans: the ideal scorer keeps every causal tile at threshold 1 and
    more mass than XAttention at equal threshold on a toy; skip 0 is XAttention's plan."""
    from sparseprefill import reference
    from sparseprefill.methods import dpxa, xattention

    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 300, 16, generator=gen), torch.randn(2, 2, 300, 16, generator=gen)
    full = xattention.exact_tile_mass_plan(q, k, threshold=1.0, block=64)
    assert torch.equal(full.block_mask(), reference.dense_plan(q, k, block_m=64, block_n=64).block_mask())
    ideal = xattention.exact_tile_mass_plan(q, k, threshold=0.8, block=64)
    assert float(reference.recall(q, k, ideal).mean(dim=-1).min()) >= 0.8 - 1e-6
    base = reference.xattention_plan(q, k, stride=4, threshold=0.8, block=64)
    for first in ("kept", "skippable"):
        same = xattention.skip_plan(q, k, threshold=0.8, skip=0.0, stride=4, block=64, first_tile=first)
        assert torch.equal(same.block_mask(), base.block_mask())
    kept = xattention.skip_plan(q, k, threshold=0.8, skip=1.0, stride=4, block=64).block_mask()
    assert kept[..., 0].all() and kept.diagonal(dim1=-2, dim2=-1).all()
    grid = dpxa.grid_anchor_plan(q, k, anchor_period=1, threshold=1.0, block=64)
    assert torch.equal(grid.block_mask(), full.block_mask())


def test_block_oracle_of_one_token_blocks_is_the_row_oracle() -> None:
    """Cells of one row and one key are the per-row oracle's choices, so both densities agree;
    one block holding the whole sequence keeps everything at share 1."""
    from sparseprefill.oracle import block_oracle_density

    gen = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 4, 37, 8, generator=gen), torch.randn(2, 2, 37, 8, generator=gen)
    shares = [0.0, 0.5, 0.9, 0.99]
    torch.testing.assert_close(block_oracle_density(q, k, shares, block=1), oracle_density(q, k, shares))
    whole = block_oracle_density(q, k, [1.0], block=64)
    torch.testing.assert_close(whole, torch.ones_like(whole))
    with pytest.raises(ValueError, match="block"):
        block_oracle_density(q, k, [0.9], block=0)


TIMED = ["compare", "--seqlen", "256", "--device", "cpu", "--q-heads", "2", "--kv-heads", "1", "--head-dim", "16"]


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_timed_path_writes_each_row_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--seqlen` (a CPU smoke run): every point timed and written to the .jsonl as it is
    measured; a stopped run resumed measures only what the .jsonl lacks."""
    out = tmp_path / "t.json"
    args = [*TIMED, "--methods", "streaming", "xattention", "delta_kv", "--json", str(out),
            "--png", str(tmp_path / "t.png")]
    assert main(args) == 0
    err = capsys.readouterr().err
    sizes = {name: len(compare.unique_points(compare.sweep(compare.METHODS[name], 256)))
             for name in ("streaming", "xattention", "delta_kv")}
    total = sum(sizes.values())
    assert f"[{total}/{total} steps" in err and "left" in err and "where the time went" in err
    rows = _rows(tmp_path / "t.jsonl")
    assert "header" in rows[0] and rows[1]["kind"] == "baseline"
    points = [r for r in rows if r.get("kind") == "point" and r["method"] != "oracle"]
    assert [r["method"] for r in points] == [name for name, size in sizes.items() for _ in range(size)]
    assert len({r["key"] for r in points}) == total and total >= 8
    for r in points:
        assert r["gpu"]["e2e_ms"] > 0 and r["timing"]["e2e"]["reps"] >= 2 and "recall" in r["stage_s"]
        assert (r["recall_mean"] is None) == (r["method"] == "delta_kv")
        assert ("kernel_ms" in r["gpu"]) == (r["method"] != "delta_kv")
    final = json.loads(out.read_text())["points"]
    assert len(final) == len(points) + 7  # and the oracle's shares
    # Stopped after the 4th point, in the middle of writing the 5th.
    cut = rows.index(points[4])
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:cut]) + '{"kind": "po')
    assert main([*args, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "cut short" in err and f"[{total - 4}/{total - 4} steps" in err and "read back" in err
    again = [r for r in _rows(tmp_path / "t.jsonl") if r.get("kind") == "point" and r["method"] != "oracle"]
    assert [r["key"] for r in again] == [r["key"] for r in points]
    assert [r["seconds"] for r in again[:4]] == [r["seconds"] for r in points[:4]]
    assert main([*args, "--resume", "--q-heads", "4"]) == 2
    assert "q_heads = 2" in capsys.readouterr().err


def test_timed_equal_recall_times_only_the_picks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "e.json"
    assert main([*TIMED, "--methods", "streaming", "xattention", "--equal-recall", "0.9", "--json", str(out),
                 "--png", str(tmp_path / "e.png")]) == 0
    assert "| 0.9 | streaming |" in capsys.readouterr().out
    result = json.loads(out.read_text())
    points = [compare.point_from_row(p) for p in result["points"] if p["method"] != "oracle"]
    timed = [p for p in points if p.gpu]
    assert 1 <= len(timed) <= 2 and all(p.recall_mean is not None for p in points)
    for row in result["equal_recall"]:
        mine = [p for p in points if p.method == row["method"] and (p.recall_mean or 0) >= 0.9]
        if row["reached"]:
            assert row["density"] == min(p.density for p in mine) and row["e2e_ms"] is not None
        else:
            assert not mine


def test_timer_repeats_follow_the_spread_and_the_budget() -> None:
    import time as clock

    timer = compare.Timer("cpu", budget_s=0.05, min_reps=5)
    out, steady = timer.time_call(lambda: 7)
    assert out == 7 and steady.reps >= 5 and steady.first_ms >= 0
    _, slow = timer.time_call(lambda: clock.sleep(0.03))
    assert slow.reps == 2 and slow.ms >= 25


def test_equal_density_pairs_each_point_with_a_matched_one(tiny_capture: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "d.json"
    assert main(["compare", "--qkv", str(tiny_capture), "--methods", "vertical_slash", "a_shape", "--equal-density",
                 "--device", "cpu", "--json", str(out), "--png", str(tmp_path / "d.png")]) == 0
    assert "matched method" in capsys.readouterr().out
    pairs = json.loads(out.read_text())["equal_density"]
    sweep = compare.unique_points(compare.sweep(compare.METHODS["vertical_slash"], 192))
    assert len(pairs) == len(sweep)
    data = torch.load(tiny_capture)
    q, k = data["q"][0].float(), data["k"][0].float()
    a_shape = compare.METHODS["a_shape"]
    for pair in pairs:
        first, matched = pair["first"], pair["matched"]
        assert first["method"] == "vertical_slash" and matched["method"] == "a_shape"
        assert matched["label"] == "equal density" and matched["recall_mean"] is not None
        # The closest density A-shape's window reaches: the windows beside it are no closer.
        gap = abs(matched["density"] - first["density"])
        for w in (matched["params"]["window"] - 1, matched["params"]["window"] + 1):
            if 1 <= w <= 192:
                plan = a_shape.plan_fn("reference")(q, k, **{**matched["params"], "window": w})
                assert abs(float(reference.density(plan).mean()) - first["density"]) >= gap - 1e-12
    assert main(["compare", "--qkv", str(tiny_capture), "--methods", "a_shape", "--equal-density",
                 "--device", "cpu", "--png", str(tmp_path / "x.png")]) == 2
