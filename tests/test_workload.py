"""The calibrated workload (sparseprefill.workload): statistics, generator, fit, tools.

CPU only, small N. The statistics are checked on inputs whose answer is known by
construction; the generator on shapes, determinism and the direction each weight moves
its share; the fit on a target made by the generator itself (it must find parameters
that reproduce the target's statistics).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from sparseprefill import workload
from sparseprefill.demo import Shape, synthetic_qkv
from sparseprefill.workload import HeadParams, KVParams


def _layer(heads: list[HeadParams], kv: list[KVParams], n: int, *, d: int = 128, b: int = 1,
           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    shape = Shape(b, len(heads), len(kv), n, d, torch.float64)
    return workload.generate_layer(heads, kv, shape, seed=seed)


def test_stats_all_mass_on_the_sink() -> None:
    # Key 0 scores +50 for every query, every other key 0: the sink holds the mass.
    n, d = 300, 16
    q = torch.zeros(1, 2, n, d, dtype=torch.float64)
    k = torch.zeros(1, 1, n, d, dtype=torch.float64)
    q[..., 0] = 50.0 * math.sqrt(d)
    k[:, :, 0, 0] = 1.0
    s = workload.attention_stats(q, k, rows=64, with_keep=False)
    for h in range(2):
        # Rows 0..3 see only sink keys; every later row has e^-50 off the sink.
        assert s.sink[h] == pytest.approx(1.0, abs=1e-12)
        assert s.local[h] + s.vertical[h] + s.slash[h] + s.rest[h] == pytest.approx(0.0, abs=1e-12)
        # Oracle: one key per row (the sink) at any share below 1.
        rows = workload.sample_rows(n, 64)
        assert s.oracle[h][0] == pytest.approx(rows.numel() / float((rows + 1).sum()))


def test_stats_uniform_attention_is_local_then_rest() -> None:
    # Zero scores: row i spreads 1 / (i + 1) over its keys.
    n, d = 257, 16
    q = torch.zeros(1, 1, n, d)
    k = torch.zeros(1, 1, n, d)
    s = workload.attention_stats(q, k, rows=n, with_keep=False)
    rows = torch.arange(n, dtype=torch.float64)
    sink = (torch.clamp(rows + 1, max=workload.SINK_KEYS) / (rows + 1)).mean()
    assert s.sink[0] == pytest.approx(float(sink), rel=1e-9)
    shares = s.shares(0)
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-12)
    assert min(shares.values()) >= -1e-12
    assert sum(s.bands[0]) + s.sink[0] == pytest.approx(1.0, abs=1e-12)
    # The oracle at 0.9 of a uniform row keeps ceil(0.9 (i + 1)) keys.
    kept = torch.ceil(0.9 * (rows + 1) - 1e-9)
    assert s.oracle[0][0] == pytest.approx(float(kept.sum() / (rows + 1).sum()), rel=1e-9)


def test_generate_layer_shapes_determinism_and_gqa() -> None:
    heads = [HeadParams(profile=(4.0, 2.0, 1.0)), HeadParams(sink=6.0), HeadParams(noise=2.0), HeadParams()]
    kv = [KVParams(slash_offsets=(50,)), KVParams(run_length=4.0, key_offset=3.0)]
    q, k, v = _layer(heads, kv, 301, d=64, b=2)
    assert q.shape == (2, 4, 301, 64) and k.shape == (2, 2, 301, 64) and v.shape == k.shape
    assert all(torch.isfinite(t).all() for t in (q, k, v))
    again = _layer(heads, kv, 301, d=64, b=2)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), again))
    other = _layer(heads, kv, 301, d=64, b=2, seed=1)
    assert not torch.equal(q, other[0])


def test_generate_layer_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="head and"):
        _layer([HeadParams()] * 3, [KVParams()] * 2, 64)
    with pytest.raises(ValueError, match="head_dim"):
        _layer([HeadParams()], [KVParams()], 64, d=8)
    with pytest.raises(ValueError, match="rule"):
        workload.generate_layer([HeadParams()], [KVParams()], Shape(1, 1, 1, 64, 64, torch.float64), rule="linear")


@pytest.mark.parametrize("name", ["sink", "vertical", "noise"])
def test_each_weight_moves_its_statistic(name: str) -> None:
    n = 512
    kv = [KVParams(slash_offsets=(200,))]
    low = HeadParams(sink=2.0, vertical=0.0, profile=(3.0, 2.0, 1.0, 0.5), slash=0.0, noise=0.5)
    high = HeadParams(**{**low.__dict__, name: getattr(low, name) + 4.0})
    s = [workload.attention_stats(*_layer([p], kv, n)[:2], rows=128, with_keep=False) for p in (low, high)]
    if name == "noise":  # more noise: a more concentrated rest, a sparser oracle
        assert s[1].oracle[0][1] < s[0].oracle[0][1]
    else:
        assert getattr(s[1], name)[0] > getattr(s[0], name)[0] + 0.05


def test_slash_weight_puts_mass_on_its_diagonal() -> None:
    n = 1024
    kv = [KVParams(slash_offsets=(300,))]
    q, k, _ = _layer([HeadParams(sink=0.0, vertical=-8.0, slash=12.0, noise=0.3)], kv, n)
    s = workload.attention_stats(q, k, rows=256, with_keep=False)
    assert s.slash[0] > 0.3
    assert 300 in s.slash_offsets[0]


def test_rotary_weights_reproduce_a_smooth_profile() -> None:
    # A profile the 40 frequencies can carry (3 nats decaying over ~256 tokens) comes back
    # closely; a sharp near-field peak does not (the fit corrects band masses instead:
    # docs/workload.md), so this test uses a smooth one.
    profile = tuple(3.0 * math.exp(-lo / 256) for lo in workload.PROFILE_BANDS)
    n = 2048
    lay = workload._layout(128)
    pairs = (lay.rotary.stop - lay.rotary.start) // 2
    c = workload.rotary_weights(profile, n, pairs)
    dist = torch.arange(n, dtype=torch.float64)
    got = (torch.cos(dist[:, None] * workload._frequencies(pairs)[None, :]) * c).sum(-1)
    want = workload.profile_at(profile, dist)
    want = want - want[-1]
    assert (got - want).abs().max() < 0.5
    assert (got - want).abs().mean() < 0.1


def test_keep_ratio_follows_runs_and_offset() -> None:
    n = 512
    heads = [HeadParams()]
    plain = workload.keep_ratios(_layer(heads, [KVParams()], n)[1])
    runs = workload.keep_ratios(_layer(heads, [KVParams(run_length=16.0, key_offset=30.0)], n)[1])
    assert len(plain) == 1 and len(plain[0]) == len(workload.KEEP_THRESHOLDS)
    assert runs[0][2] < plain[0][2] - 0.2
    # A looser threshold never keeps more keys.
    assert all(a >= b for a, b in zip(runs[0], runs[0][1:]))


@pytest.mark.slow
def test_fit_reproduces_a_generated_target() -> None:
    # The target is the generator's own output: the fit must reach its statistics.
    n = 1024
    truth_heads = [HeadParams(sink=9.0, vertical=1.0, profile=(5.0, 4.0, 3.0, 2.5, 2.0, 1.0, 0.0), slash=2.0,
                              noise=1.5),
                   HeadParams(sink=7.0, vertical=3.0, profile=(3.0, 3.0, 2.0, 1.0, 0.0), slash=0.0, noise=1.0)]
    truth_kv = [KVParams(slash_offsets=(400,), run_length=4.0, key_offset=6.0)]
    q, k, _ = _layer(truth_heads, truth_kv, n, seed=5)
    target = workload.attention_stats(q, k, rows=128)
    fitted = workload.fit_layer(target, Shape(1, 2, 1, n, 128, torch.float64), iterations=10, rows=128)
    gq, gk, _ = _layer(list(fitted.heads), list(fitted.kv), n)
    got = workload.attention_stats(gq, gk, rows=128)
    for h in range(2):
        assert got.oracle[h][1] == pytest.approx(target.oracle[h][1], rel=0.3)
        assert got.sink[h] == pytest.approx(target.sink[h], abs=0.08)
    assert got.keep[0][2] == pytest.approx(target.keep[0][2], abs=0.1)


def test_calibration_round_trip_and_checks(tmp_path: Path) -> None:
    layer = workload.LayerParams(3, 512, (HeadParams(profile=(1.0, 0.5)), HeadParams()),
                                 (KVParams(slash_offsets=(130, 140)),))
    cal = workload.Calibration("unit test", (layer,))
    path = tmp_path / "cal.json"
    path.write_text(json.dumps(cal.to_json()))
    assert workload.load_calibration(path) == cal
    bad = cal.to_json()
    bad["rule"] = "linear"
    with pytest.raises(ValueError, match="rule"):
        workload.Calibration.from_json(bad)
    bad = cal.to_json()
    bad["layers"][0]["kv"] *= 3
    with pytest.raises(ValueError, match="KV heads"):
        workload.Calibration.from_json(bad)


def test_shipped_calibration_builds_any_shape() -> None:
    cal = workload.load_calibration()
    assert cal.layers and cal.rule in workload.RULES
    shape = Shape(2, 6, 2, 257, 64, torch.float16)
    q, k, v = workload.calibrated_qkv(shape, device=torch.device("cpu"), calibration=cal)
    assert q.shape == (2, 6, 257, 64) and k.shape == (2, 2, 257, 64) and q.dtype == torch.float16
    assert all(torch.isfinite(t).all() for t in (q, k, v))
    with pytest.raises(ValueError, match="not in the calibration"):
        workload.calibrated_qkv(shape, device=torch.device("cpu"), calibration=cal, layer=10_000)


def test_sink_log_rule_raises_only_the_sink() -> None:
    heads, kv = [HeadParams(sink=3.0, profile=(2.0, 1.0))], [KVParams()]
    shape = Shape(1, 1, 1, 256, 64, torch.float64)
    fixed = workload.generate_layer(heads, kv, shape, fit_seqlen=64, rule="fixed-logits")
    grown = workload.generate_layer(heads, kv, shape, fit_seqlen=64, rule="sink-log")
    scale = 1 / 8.0
    assert float((grown[0][..., 0] - fixed[0][..., 0]).mean() * scale) == pytest.approx(math.log(4.0))
    assert torch.equal(grown[0][..., 1:], fixed[0][..., 1:]) and torch.equal(grown[1], fixed[1])


def test_workload_qkv_choices(tmp_path: Path) -> None:
    shape = Shape(1, 4, 2, 96, 32, torch.float32)
    cpu = torch.device("cpu")
    plain = workload.workload_qkv(shape, device=cpu, workload="synthetic")
    assert all(torch.equal(a, b) for a, b in zip(plain, synthetic_qkv(shape, device=cpu)))
    with pytest.raises(ValueError, match="workload"):
        workload.workload_qkv(shape, device=cpu, workload="real")
    # A capture: its layers become the batch, cut to N; longer N is refused.
    data = {"layers": [0, 1], "q": [torch.randn(1, 3, 128, 16)] * 2, "k": [torch.randn(1, 1, 128, 16)] * 2,
            "v": [torch.randn(1, 1, 128, 16)] * 2, "scale": [0.25, 0.25]}
    path = tmp_path / "cap.pt"
    torch.save(data, path)
    q, k, v = workload.workload_qkv(shape, device=cpu, qkv=path)
    assert q.shape == (2, 3, 96, 16) and k.shape == (2, 1, 96, 16)
    assert torch.equal(q[1], data["q"][1][0, :, :96])
    with pytest.raises(ValueError, match="longer than the capture"):
        workload.workload_qkv(Shape(1, 4, 2, 200, 32, torch.float32), device=cpu, qkv=path)
    workload.select("calibrated")
    try:
        got = workload.bench_qkv(shape, device=cpu)
        assert all(torch.equal(a, b) for a, b in zip(got, workload.calibrated_qkv(shape, device=cpu)))
    finally:
        workload.select("synthetic")
    with pytest.raises(ValueError, match="workload"):
        workload.select("real")


def test_curve_gaps_interpolates_at_equal_density() -> None:
    def point(method: str, wl: str, density: float, recall: float) -> workload.CurvePoint:
        return workload.CurvePoint(method, {}, wl, density, recall, None, 0.0)

    points = [point("m", "captured", 0.2, 0.90), point("m", "captured", 0.4, 0.95),
              point("m", "calibrated", 0.1, 0.80), point("m", "calibrated", 0.3, 0.96)]
    gaps = workload.curve_gaps(points)["m"]
    # At density 0.2 the calibrated curve is at 0.88: gap 0.02 (0.4 lies outside it); at 0.3
    # the captured curve is at 0.925: gap 0.035 (0.1 lies outside it).
    assert gaps["recall_gap_at_equal_density_max"] == pytest.approx(0.035)
    assert gaps["points_in_overlap"] == 2 and gaps["points"] == 4
    assert gaps["recall_gap_same_knob_max"] == pytest.approx(0.10)
    assert gaps["density_ratio_same_knob"] == pytest.approx([0.5, 0.75])


def test_cli_options_parse() -> None:
    from sparseprefill.cli import build_parser

    parser, _ = build_parser(["bench"])
    args = parser.parse_args(["bench", "--workload", "calibrated", "--qkv", "x.pt"])
    assert args.workload == "calibrated" and args.qkv == "x.pt"
    parser, _ = build_parser(["compare"])
    args = parser.parse_args(["compare", "--seqlen", "1024", "--workload", "calibrated"])
    assert args.workload == "calibrated"
    with pytest.raises(SystemExit):
        parser.parse_args(["compare", "--workload", "real"])


def test_method_curves_recall_is_reference_recall() -> None:
    from sparseprefill import reference
    from sparseprefill.conformance.registry import METHODS

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 200, 32), torch.randn(1, 1, 200, 32), torch.randn(1, 1, 200, 32))
    points = workload.method_curves(q, k, v, ["streaming"], scale=None, workload="x")
    spec = METHODS["streaming"]
    for p in points:
        plan = spec.plan_fn("reference")(q, k, **p.params)
        assert p.recall_mean == pytest.approx(float(reference.recall(q, k, plan).double().mean()), abs=1e-6)
        assert p.density == pytest.approx(float(reference.density(plan).mean()))


def test_equal_recall_picks_the_fastest_point_reaching_the_target() -> None:
    from sparseprefill import compare

    def pt(method: str, density: float, recall: float, e2e: float | None) -> compare.Point:
        gpu = {} if e2e is None else {"e2e_ms": e2e, "cudnn_ms": 10.0, "speedup_vs_cudnn": 10.0 / e2e,
                                      "floor_ms": density * 10.0}
        return compare.Point(method, {"x": density}, "s", 100, density, recall, recall, None, 0.0, gpu=gpu)

    points = [pt("oracle", 0.02, 0.9, None), pt("oracle", 0.04, 0.95, None),
              pt("a", 0.1, 0.96, 3.0), pt("a", 0.05, 0.95, 4.0), pt("a", 0.03, 0.91, 1.0),
              pt("b", 0.5, 0.80, 2.0), pt("c", 0.2, 0.97, None), pt("c", 0.3, 0.99, None)]
    rows = {(r["method"], r["target"]): r for r in compare.equal_recall(points, [0.95, 0.9])}
    assert rows[("a", 0.95)]["params"] == {"x": 0.1} and rows[("a", 0.95)]["vs_floor"] == pytest.approx(3.0)
    assert rows[("a", 0.9)]["params"] == {"x": 0.03}
    assert rows[("a", 0.95)]["oracle_density"] == pytest.approx(0.04)
    assert rows[("b", 0.95)]["reached"] is False and rows[("b", 0.95)]["best_recall"] == 0.8
    assert rows[("c", 0.95)]["params"] == {"x": 0.2} and rows[("c", 0.95)]["e2e_ms"] is None  # untimed: least dense
    assert "not reached" in compare.format_equal_recall(list(rows.values()))


def test_runs_from_correlation_round_trip() -> None:
    # (1 - jitter^2) (1 - 1/run)^L at two lags gives back run and jitter.
    run, jitter = 20.0, 0.4
    c = [(1 - jitter ** 2) * (1 - 1 / run) ** lag for lag in (1, 16)]
    got_run, got_jitter = workload.runs_from_correlation(c[0], c[1], (1, 16))
    assert got_run == pytest.approx(run, rel=1e-6) and got_jitter == pytest.approx(jitter, rel=1e-6)
    assert workload.runs_from_correlation(0.0, 0.0, (1, 4)) == (1.0, 1.0)  # no correlation: iid


def test_salience_values_follow_the_quantiles() -> None:
    quant = [-3.0, -2.0, -1.0, -0.5, -0.2, 0.0, 0.3, 1.0, 2.0, 4.0, 5.0, 7.0, 8.0]
    z = torch.randn(200_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    vals = workload.salience_values(quant, z)
    probs = torch.tensor(workload.SALIENCE_PROBS, dtype=torch.float64)
    got = torch.quantile(vals[:100_000], probs[3:10])
    assert torch.allclose(got, torch.tensor(quant[3:10], dtype=torch.float64), atol=0.15)
    assert float(vals.max()) <= 8.0 and float(vals.min()) >= -3.0


def test_score_structure_measures_planted_salience_and_runs() -> None:
    # Heavy keys shared by every query (salience) in long runs, queries in runs: the
    # measurement finds the salience's upper quantiles, its key autocorrelation and the
    # queries' residual correlation; without them it finds none of the three.
    n = 2048
    quant = tuple(2.0 * x for x in (-3.1, -2.3, -1.6, -1.3, -0.7, 0.0, 0.7, 1.3, 1.6, 2.3, 2.6, 3.1, 3.3))
    shared = HeadParams(sink=0.0, profile=(0.0,), slash=0.0, noise=0.5, salience=quant, query_run=50.0,
                        query_jitter=0.2)
    plain = HeadParams(sink=0.0, profile=(0.0,), slash=0.0, noise=0.5)
    kv = [KVParams(vertical_fraction=0.0, salience_run=6.0, salience_jitter=0.3)]
    q, k, _ = _layer([shared], kv, n)
    got = workload.score_structure(q, k)
    q0, k0, _ = _layer([plain], [KVParams(vertical_fraction=0.0)], n)
    none = workload.score_structure(q0, k0)
    i99 = workload.SALIENCE_PROBS.index(0.99)
    assert got["salience"][0][i99] == pytest.approx(quant[i99], rel=0.35)
    assert none["salience"][0][i99] < 0.5 * quant[i99]
    assert got["salience_ac"][0][0] > 0.6 > none["salience_ac"][0][0] + 0.3
    assert got["query_ac"][0][0] > 0.6 > none["query_ac"][0][0] + 0.3
    assert got["residual"][0] == pytest.approx(0.5, rel=0.3)
    # Too short for the far field: nothing measured.
    assert workload.score_structure(q[:, :, :200], k[:, :, :200])["salience"] == []


def test_generate_layer_with_salience_is_deterministic_and_round_trips(tmp_path: Path) -> None:
    quant = tuple(float(x) for x in range(-6, 7))
    heads = [HeadParams(salience=quant, salience_group=0.5, query_run=4.0, query_jitter=0.5)] * 2
    kv = [KVParams(vertical_fraction=0.0)]
    a = _layer(heads, kv, 512, d=64)
    b = _layer(heads, kv, 512, d=64)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # The two heads of the group have their own salience channels, half shared.
    lay = workload._layout(64, 2)
    ch = a[1][0, 0, :, lay.salience]
    assert 0.3 < workload._corr(ch[:, 0], ch[:, 1]) < 0.7
    cal = workload.Calibration("t", (workload.LayerParams(0, 512, tuple(heads), tuple(kv)),))
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cal.to_json()))
    assert workload.load_calibration(path) == cal


def test_clean_sink_key_fixes_the_sink_logit_across_draws() -> None:
    # With clean_sink, key 0 holds only the sink, offset and rotary channels: every query's
    # score on it is the same in every draw; without, the random channels move it.
    quant = tuple(float(x) for x in range(-6, 7))
    heads = [HeadParams(noise=3.0, salience=quant, query_run=4.0, query_jitter=0.5)] * 2
    clean, plain = [KVParams(vertical_fraction=0.1, slash_offsets=(5,), clean_sink=True)], [KVParams(
        vertical_fraction=0.1, slash_offsets=(5,))]

    def sink_logits(kv: list[KVParams], seed: int) -> torch.Tensor:
        q, k, _ = _layer(heads, kv, 256, d=64, seed=seed)
        return torch.einsum("bhnd,bd->bhn", q, k[:, 0, 0])

    assert torch.allclose(sink_logits(clean, 0), sink_logits(clean, 1))
    assert not torch.allclose(sink_logits(plain, 0), sink_logits(plain, 1))


@pytest.mark.slow
def test_fit_from_saved_stats_equals_fit_from_capture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # `workload fit --stats` (fit to a --stats-only JSON, no capture) fits exactly what `--qkv`
    # fits on the same capture: the statistics round-trip through JSON unchanged.
    from sparseprefill.cli import main as cli

    def fit(*argv: str) -> int:
        return cli(["workload", "fit", *argv])

    q, k, v = synthetic_qkv(Shape(1, 2, 1, 400, 32, torch.float32), device=torch.device("cpu"), seed=3)
    cap = tmp_path / "cap.pt"
    torch.save({"layers": [5], "q": [q], "k": [k], "v": [v], "scale": [32 ** -0.5], "meta": {"model": "t"}}, cap)
    common = ["--shared", "--iterations", "1", "--rows", "16"]
    assert fit("--qkv", str(cap), *common, "--calibration", str(tmp_path / "a.json"),
               "--json", str(tmp_path / "ra.json")) == 0
    assert fit("--qkv", str(cap), "--stats-only", *common, "--json", str(tmp_path / "s.json")) == 0
    assert fit("--stats", str(tmp_path / "s.json"), *common, "--calibration", str(tmp_path / "b.json"),
               "--json", str(tmp_path / "rb.json")) == 0
    a, b = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    assert a["layers"] == b["layers"] and a["layers"][0]["layer"] == 5
    ra, rb = (json.loads((tmp_path / n).read_text()) for n in ("ra.json", "rb.json"))
    assert ra["rules"] == rb["rules"]
    # Statistics made for another fit are refused.
    assert fit("--stats", str(tmp_path / "s.json"), "--iterations", "1", "--rows", "16",
               "--json", str(tmp_path / "rc.json")) == 2
    assert "statistics made with" in capsys.readouterr().err


def test_median_slash_statistic_ignores_a_heavy_column() -> None:
    # One heavy key column crosses every long diagonal in one sampled row: ranked by the mean over
    # the rows that reach a diagonal it shows up as slashes (few rows reach the longest ones); ranked
    # by the median it does not, and its mass is counted as vertical.
    n, col = 640, 20
    q = torch.zeros(1, 1, n, 2)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, n, 2)
    k[0, 0, col, 0] = 12.0
    stats = {sel: workload.attention_stats(q, k, scale=1.0, rows=32, with_keep=False, with_structure=False,
                                           slash_first=True, slash_select=sel) for sel in workload.SLASH_SELECT}
    assert stats["mean"].slash[0] > 0.15
    assert stats["median"].slash[0] < 1e-3
    assert stats["median"].vertical[0] > stats["mean"].vertical[0] + 0.15
    with pytest.raises(ValueError, match="slash_select"):
        workload.attention_stats(q, k, rows=8, slash_select="max")
