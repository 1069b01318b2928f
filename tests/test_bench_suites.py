"""Every `sparseprefill bench` suite, run for real on the CPU at tiny sizes.

Kernels run under `TRITON_INTERPRET=1` on CPU tensors; times are the wall clock of one
call and the baseline is math SDPA (each row says so). The numbers mean nothing here; the
rows must still be complete and consistent: every suite's code path (estimates, plans,
kernels, the stage split it reports, the derived ratios) runs, so a wrong argument or a
missing key fails before the suite ever reaches a GPU. The runner's file output,
progress, `--resume` and `--plot` are checked through the CLI.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from sparseprefill import bench
from sparseprefill.bench import common
from sparseprefill.bench.common import CPU_BASELINE, Context, Row

N = 100  # a multiple of no block size the suites use


def context(**kw: Any) -> Context:
    base: dict[str, Any] = dict(device=torch.device("cpu"), batch=1, q_heads=2, kv_heads=1, head_dim=32,
                                dtype=torch.float16, log=lambda line: None)
    return Context(**{**base, **kw})


def run(name: str, ctx: Context | None = None, seqlens: tuple[int, ...] = (N,), **options: Any) -> list[Row]:
    ctx = ctx or context()
    rows = bench.run_suite(bench.load_suite(name), ctx, list(seqlens), options)
    assert rows, name
    check_rows(rows, name)
    return rows


def check_rows(rows: list[Row], suite: str) -> None:
    """Every row: its suite, no error, the derived columns consistent with its own numbers."""
    for r in rows:
        assert r.suite == suite, (r.method, r.suite)
        assert "error" not in r.extra, (r.method, r.extra["error"])
        if r.impl == CPU_BASELINE:
            assert r.baseline == CPU_BASELINE and r.speedup_vs_cudnn == 1.0
        if r.density is not None:
            assert 0 < r.density <= 1, (r.method, r.density)
        if r.recall_mean is not None and r.recall_min is not None:
            assert 0 <= r.recall_min <= r.recall_mean <= 1 + 1e-6, (r.method, r.recall_mean, r.recall_min)
        if r.baseline_ms is not None and math.isfinite(r.ms) and r.speedup_vs_cudnn is not None:
            assert r.speedup_vs_cudnn == pytest.approx(r.baseline_ms / r.ms)
        if r.floor_ms is not None and r.density is not None and r.baseline_ms is not None:
            assert r.floor_ms == pytest.approx(r.density * r.baseline_ms)
            if r.vs_floor is not None:
                assert r.vs_floor == pytest.approx(r.ms / r.floor_ms)
        json.dumps(r.as_json())


def named(rows: list[Row], prefix: str) -> list[Row]:
    return [r for r in rows if r.method.startswith(prefix) and r.impl != CPU_BASELINE]


def test_kernels() -> None:
    rows = run("kernels", plans="dense,streaming:sink=16,window=32,random20", block=16)
    assert [(r.method, r.impl) for r in rows] == [("dense", CPU_BASELINE), ("dense", "sparseprefill"),
                                                 ("streaming:sink=16,window=32", "sparseprefill"),
                                                 ("random20", "sparseprefill")]
    dense = rows[1]
    assert dense.density == 1.0 and dense.extra["rel_err_vs_baseline"] < 1e-2 and dense.plan_ms is not None
    assert rows[3].plan_ms is None and 0 < rows[3].density < 1 and rows[3].kernel_vs_floor is not None
    assert "random20" in common.format_table(rows)


def test_methods_every_method_once() -> None:
    ctx = context(methods=("streaming", "delta_kv", "xattention"))
    rows = run("methods", ctx, seqlens=(160,))
    mine = {r.method: r for r in rows[1:]}
    assert list(mine) == ["streaming", "delta_kv", "xattention"]
    assert mine["xattention"].plan_ms is not None and mine["xattention"].kernel_ms is not None
    assert mine["delta_kv"].plan_ms is None and mine["delta_kv"].recall_mean is None
    assert "keep ratio" in mine["delta_kv"].extra["notes"]


def test_a_method_without_its_own_suite_gets_its_methods_rows() -> None:
    suite = bench.load_suite("a_shape")
    assert suite.name == "a_shape"
    rows = run("a_shape", params='{"sink": 16, "window": 32, "block_m": 16, "block_n": 16}')
    assert [r.method for r in rows] == ["dense", "a_shape"] and rows[1].density < 1


def test_estimates_stage_split() -> None:
    rows = run("estimates", context(methods=("xattention", "delta_kv")), seqlens=(160,))
    assert [r.method for r in rows] == ["dense", "xattention"]  # delta_kv makes no plan
    x = rows[1]
    assert x.plan_ms == x.ms and x.speedup_vs_cudnn is None and x.extra["share"] > 0
    stages = x.extra["stages"]
    assert stages[0]["depth"] == 0 and any("tile" in s["stage"] for s in stages)
    assert len(x.extra["plan_hash"]) == 16 and x.extra["host_syncs"] is None  # no sync mode off a GPU
    # XAttention's suite module gives the estimate's floor (the strided products).
    assert x.extra["estimate_floor_ms"] == pytest.approx(rows[0].ms / 16)
    assert "xattention" in bench.load_suite("estimates").summary(rows)  # type: ignore[misc]


def test_floor() -> None:
    rows = run("floor", context(methods=("vertical_slash", "delta_kv")), seqlens=(160,), plans="columns20",
               block=16)
    names = [r.method for r in rows]
    assert names == ["dense", "dense (own kernel)", "vertical_slash", "delta_kv", "columns20"]
    vs = rows[2]
    assert vs.kernel_vs_floor is not None and vs.extra["vs_own_dense"] > 0 and 0 < vs.extra["tile_share"] <= 1
    assert rows[3].extra["kind"] == "no plan" and "CPU" in rows[3].extra["note"]
    assert rows[4].extra["C"] > 0 and rows[4].extra["mean_columns"] > 0


def test_variants_restore_the_switches() -> None:
    from sparseprefill.fast.kernels import block_column

    before = (block_column._GUARD, block_column._COL_SPLIT)
    rows = run("variants", plans="dense,columns20", variants="default:;no guard:GUARD=0;split:COL_SPLIT=1",
               tiles="16,16,4,1", block=16)
    assert (block_column._GUARD, block_column._COL_SPLIT) == before
    assert len(rows) == 1 + 2 * 4
    for r in rows[1:]:
        assert r.extra["rel_diff_vs_first"] < 1e-3 and r.extra["nonfinite"] == 0, r.method
    tile = next(r for r in rows if r.extra.get("variant") == "tile 16,16,4,1")
    assert tile.extra["sets"] == {"TILE": "16.16.4.1"}


def test_variants_report_an_unknown_switch() -> None:
    ctx = context()
    rows = bench.run_suite(bench.load_suite("variants"), ctx, [N], {"plans": "dense", "variants": "x:NO_SUCH=1",
                                                                    "block": 16})
    assert "no switch _NO_SUCH" in rows[1].extra["error"]


def test_variants_set_and_restore_the_hopper_switches() -> None:
    """`HOPPER*` keys go to the Hopper path's switches for their rows and are restored (on a CPU
    both variants run the portable kernel: the rows agree); an unknown one is reported."""
    from sparseprefill.fast.kernels import block_column_hopper as hop

    before = {attr: getattr(hop, attr) for attr in hop.SWITCHES.values()}
    rows = run("variants", plans="dense", variants="hopper:;portable:HOPPER=0,HOPPER_STAGES=2", block=16)
    assert {attr: getattr(hop, attr) for attr in hop.SWITCHES.values()} == before
    portable = next(r for r in rows if r.extra.get("variant") == "portable")
    assert portable.extra["sets"] == {"HOPPER": "0", "HOPPER_STAGES": "2"}
    assert portable.extra["rel_diff_vs_first"] == 0 and portable.extra["nonfinite"] == 0
    rows = bench.run_suite(bench.load_suite("variants"), context(), [N],
                           {"plans": "dense", "variants": "x:HOPPER_NO_SUCH=1", "block": 16})
    assert "no switch HOPPER_NO_SUCH" in rows[1].extra["error"]
    assert {attr: getattr(hop, attr) for attr in hop.SWITCHES.values()} == before


def test_serving_mixed_batch() -> None:
    rows = run("serving", seqlens=(64,), lengths="40,72", parts="mixed", block=16)
    mixed = named(rows, "mixed batch ")
    assert len(mixed) == 2 and all(r.extra["equal_to_per_sequence"] for r in mixed)
    assert rows[0].impl == CPU_BASELINE + " per sequence" and mixed[0].plan_ms is not None


@pytest.mark.slow
def test_serving_shapes() -> None:
    rows = run("serving", seqlens=(64,), shapes="serve64", parts="shapes")
    assert [r.impl for r in rows] == [CPU_BASELINE] + ["sparseprefill"] * 3
    assert all(r.baseline_ms == rows[0].ms for r in rows) and rows[2].density < 1


def test_serving_chunked_only() -> None:
    rows = run("serving", seqlens=(128,), chunk=32, parts="chunked", block=16)
    assert [r.extra["bit_equal"] for r in rows] == [True, True]


def test_scale_stages_and_memory_status() -> None:
    rows = run("scale", context(methods=("block_sparse", "delta_kv")), seqlens=(160,), warmup_seqlen=0)
    assert [r.method for r in rows] == ["dense", "block_sparse", "delta_kv"]
    assert set(rows[1].extra["stages"]) == {"plan", "kernel"} and rows[1].extra["plan_gib"] is not None
    assert set(rows[2].extra["stages"]) == {"run"} and rows[2].extra["status"] == "ok"


def test_scale_budget_stops_new_pieces() -> None:
    rows = bench.run_suite(bench.load_suite("scale"), context(methods=("dense",)), [N],
                           {"warmup_seqlen": 0, "budget_s": -1.0})
    assert all(r.extra["status"] == "not run: budget spent" for r in rows)


@pytest.mark.slow
def test_delta_keep_ratios() -> None:
    rows = run("delta", seqlens=(64,), runs="2;2/2/1", block=16)
    base = [r for r in rows if r.impl == CPU_BASELINE]
    assert [r.method for r in base] == ["runs 2", "runs 2/2/1"]
    assert base[0].extra["keep_ratio"] < base[1].extra["keep_ratio"] < 1
    for r in named(rows, "delta_"):
        assert r.extra["rel_err_vs_baseline"] < 0.5 and r.extra["nonfinite"] == 0


def test_peers_say_why_not() -> None:
    rows = run("peers", recall_rows=16)
    peers = rows[1:]
    assert len(peers) == 4 and all(r.extra["status"].startswith("not importable") for r in peers)


def test_distributed_bytes_in_one_process() -> None:
    rows = run("distributed", context(methods=("dense", "vertical_slash")), seqlens=(256,), worlds="2,4")
    assert [(r.method, r.extra["world"]) for r in rows] == [("dense", 2), ("dense", 4), ("vertical_slash", 2),
                                                           ("vertical_slash", 4)]
    for r in rows:
        assert 0 < r.extra["kv"] <= r.extra["ring"] and r.extra["estimate"] in ("shape", "native")
    summary = bench.load_suite("distributed").summary(rows)  # type: ignore[misc]
    assert "vertical_slash" in summary and "kv/ring" in summary


def test_anchor_attention_suite() -> None:
    rows = run("anchor_attention", context(head_dim=16), seqlens=(128,), theta=2.0, step=1, block=32)
    row = rows[-1]
    assert row.method == "anchor_attention" and 0 < row.density < 1 and row.recall_mean is not None
    extra = row.extra
    assert extra["stages_vs_e2e_max_abs_diff"] == 0.0  # the stages are the end-to-end run
    assert 0 < extra["anchor_density"] < row.density and extra["stripe_width"] > 0
    assert row.estimate_ms == extra["anchor_ms"]
    assert row.plan_ms == pytest.approx(extra["anchor_ms"] + extra["identification_ms"])
    assert "paper" in extra["paper_claim"] and extra["speedup_vs_flash"] is None  # no flash SDPA off a GPU


@pytest.mark.parametrize("name", ["xattention", pytest.param("dpxa", marks=pytest.mark.slow)])
def test_tile_suites(name: str) -> None:
    rows = run(name, seqlens=(96,), block=32)
    assert len(rows) == 4
    for row in rows[1:]:
        for key in ("scoring_ms", "selection_ms", "scoring_vs_cudnn", "tiles_computed", "scoring_ratio"):
            assert key in row.extra, key
        assert 0 < row.extra["tiles_computed"] <= 1 and row.kernel_ms is not None
        assert row.plan_ms == pytest.approx(row.extra["scoring_ms"] + row.extra["selection_ms"])
    if name == "xattention":
        assert rows[1].extra["scoring_ratio"] == 1 / 8
    else:
        assert "anchors_ms" in rows[1].extra and 0 < rows[1].extra["scoring_ratio"] <= 1


def test_minference_suite() -> None:
    rows = run("minference", seqlens=(128,), vs_blocks="32x32")
    assert [r.method for r in rows] == ["dense", "vertical_slash 32x32", "MInference plan", "block_sparse"]
    vs = rows[1]
    assert vs.plan_ms == pytest.approx(vs.estimate_ms + vs.extra["index_ms"])


def test_sample_attention_suite() -> None:
    from sparseprefill.bench.suites.sample_attention import format_stages

    rows = run("sample_attention", seqlens=(160,), settings="0.9/0.9/2", block=32)
    assert [r.method for r in rows] == ["dense", "sample_attention 0.9/0.9/2"]
    row = rows[1]
    for key in ("sampling_ms", "filtering_ms", "overhead_vs_dense", "block_width"):
        assert math.isfinite(row.extra[key]) and row.extra[key] > 0, key
    assert row.floor_ms == pytest.approx(row.density * rows[0].ms)
    assert "kernel/floor" in format_stages(rows)


@pytest.mark.slow
def test_shareprefill_suite() -> None:
    rows = run("shareprefill", context(q_heads=4, kv_heads=2, head_dim=16, with_recall=False), seqlens=(48,),
               layers=2, block=16)
    assert [r.method for r in rows] == ["dense L0", "shareprefill L0", "flexprefill_vs L0", "dense L1",
                                        "shareprefill L1", "flexprefill_vs L1", "shareprefill total (2 layers)"]
    share = named(rows, "shareprefill L")
    for r in share:
        assert {"decision_ms", "plan_only_ms", "sparse_heads_ms", "dense_pivots_ms", "pivot_build_ms"} <= set(r.extra)
        assert sum(r.extra[p] for p in ("dense", "shared", "vertical_slash")) == 4
    # The flat head 0 is the pivot in layer 0 and shares it in layer 1.
    assert share[0].extra["dense"] == 1 and share[1].extra["shared"] >= 1
    assert rows[-1].speedup_vs_cudnn is not None


def test_delta_kv_suite() -> None:
    rows = run("delta_kv", seqlens=(80,), thresholds="0.5", block=16)
    assert [r.method for r in rows] == ["dense", "delta_kv cos 0.5"]
    row = rows[1]
    for key in ("keep_mask_ms", "pack_ms", "plans_ms", "phase1_ms", "phase2_ms", "keep_ratio"):
        assert key in row.extra, key
    assert 0 < row.extra["keep_ratio"] <= 1 and math.isfinite(row.extra["rel_err_vs_dense"])
    assert row.recall_mean is None and row.kernel_ms == row.extra["phase1_ms"] + row.extra["phase2_ms"]


def test_delta_xattention_suite() -> None:
    from sparseprefill.bench.suites import delta_xattention as dx

    rows = bench.run_suite(dx.SUITE, context(), [96], {"packed_blocks": "16", "block": 32})
    check_rows(rows, "delta_xattention")
    names = [r.method for r in rows]
    assert names[0] == "dense" and "xattention s8 0.9 (same tiles)" in names
    cases = named(rows, "delta_xattention")
    assert len(cases) == len(dx.CASES)
    for key in ("selection_ms", "split_ms", "packing_ms", "plans_ms", "packed_ms", "exact_ms", "kv_reduction",
                "keep_ratio", "packed_tiles", "xattention_kernel_ms", "skip_kernel_ms", "kernel_vs_xattention"):
        assert key in cases[0].extra, key
    assert 0 <= cases[0].extra["kv_reduction"] < 1


def test_every_suite_is_tested_here() -> None:
    """A new suite module gets a test above (each suite's name appears in this file)."""
    here = Path(__file__).read_text()
    modules = Path(bench.__file__).parent / "suites"
    names = sorted(p.stem for p in modules.glob("*.py") if p.stem != "__init__")
    assert set(bench.SUITES) <= set(names)
    missing = [name for name in names if f'"{name}"' not in here]
    assert not missing, missing


# -- the runner ------------------------------------------------------------------------------


def cli(args: list[str]) -> int:
    from sparseprefill.cli import main

    return main(["bench", *args, "--device", "cpu", "--seqlens", str(N)])


def test_cli_writes_rows_as_measured_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run.json"
    args = ["kernels", "--plans", "dense,random20", "--block", "16", "--json", str(out)]
    assert cli(args) == 0
    captured = capsys.readouterr()
    assert "random20" in captured.out and "[kernels 4/4]" in captured.err and "left ~" in captured.err
    data = json.loads(out.read_text())
    assert [r["method"] for r in data["rows"]] == ["dense", "dense", "random20"]
    assert data["environment"]["device"] == "cpu" and data["arguments"]["device"] == "cpu"
    lines = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert "arguments" in lines[0] and sum("done" in e for e in lines) == 4 and sum("row" in e for e in lines) == 3

    # Resume: every piece was done, so nothing is measured again and the rows come back.
    from sparseprefill.bench.suites import kernels

    def fail(*a: Any, **k: Any) -> Any:
        raise AssertionError("measured again on --resume")

    monkeypatch.setattr(kernels, "_plan_rows", fail)
    assert cli([*args, "--resume"]) == 0
    assert "from the earlier run" in capsys.readouterr().err
    assert [r["method"] for r in json.loads(out.read_text())["rows"]] == ["dense", "dense", "random20"]

    # Another shape is another run: refused.
    with pytest.raises(SystemExit, match="other inputs"):
        cli([*args, "--resume", "--q-heads", "4"])


def test_resume_measures_what_is_missing(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    assert cli(["kernels", "--plans", "dense,random20", "--block", "16", "--json", str(out)]) == 0
    jsonl = out.with_suffix(".jsonl")
    kept = [line for line in jsonl.read_text().splitlines() if "random20" not in line]
    jsonl.write_text("\n".join(kept) + "\n")
    assert cli(["kernels", "--plans", "dense,random20", "--block", "16", "--json", str(out), "--resume"]) == 0
    methods = [json.loads(line).get("row", {}).get("method") for line in jsonl.read_text().splitlines()]
    assert methods.count("random20") == 1 and methods.count("dense") == 2


def test_cli_plot_and_method_alias(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "speed.png"
    assert cli(["--method", "streaming", "--params", '{"sink": 16, "window": 32}', "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_unknown_names() -> None:
    with pytest.raises(ValueError, match="unknown suite 'nope'"):
        cli(["nope"])
    with pytest.raises(ValueError, match="unknown method"):
        cli(["methods", "--methods", "nope"])


def test_no_gpu_means_a_clear_exit(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from sparseprefill.cli import main

    assert main(["bench", "kernels"]) == 2
    assert "--device cpu" in capsys.readouterr().err


def test_row_json_round_trip() -> None:
    row = Row("m", "sparseprefill", 8, density=0.5, ms=float("nan"), extra={"t": torch.tensor(2.0), "x": (1, 2)})
    data = row.as_json()
    assert data["ms"] is None and data["extra"] == {"t": 2.0, "x": [1, 2]}
    back = Row.from_json({**data, "unknown": 1})
    assert back.method == "m" and math.isnan(back.ms) and back.density == 0.5
