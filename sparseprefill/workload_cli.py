"""`sparseprefill workload fit | accept | table`: the calibrated workload fitted, accepted and tabled.

The calibrated workload (`sparseprefill.workload`) generates q, k, v whose attention
statistics match a captured model's layer by layer. Three tasks:

* `fit`: fit it to a capture (or to saved statistics of one) and report captured against
  generated statistics; `--max-seqlen M --predict` fits on a prefix and predicts the
  statistics at the capture's length under every rule (`workload.RULES`); `--stats-only`
  saves the captured statistics; `--join` merges fits of single layers;
* `accept`: every method's sweep on captured layers and on the fit's own realization of
  them, at the capture's length: the oracle's density on both and per method the largest
  recall gap at equal density (`workload.curve_gaps`); `--merge` joins runs of one layer;
* `table`: one row per fitted layer from `fit` reports, prefix predictions and `accept`
  results: oracle densities and their errors, the shares, the predictions' errors, every
  method's gap and how many are within the tolerance.

    sparseprefill workload fit --qkv qkv_smollm2_8k_all.pt --calibration fit.json --json report.json
    sparseprefill workload accept --qkv qkv_smollm2_8k_all.pt --calibration fit.json --layers 14 --json acc.json
    sparseprefill workload table --reports report-l*.json --prefix prefix4096-l*.json --acceptance acc.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

# The acceptance criterion: a method's recall on the calibrated workload within this of the
# captured one at equal density; the oracle's density within ORACLE_TOLERANCE (relative).
TOLERANCE = 0.03
ORACLE_TOLERANCE = 0.20


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _command(args: argparse.Namespace) -> str:
    argv = getattr(args, "argv", None)
    return "sparseprefill workload " + " ".join(argv if argv is not None else sys.argv[2:])


# -- fit -------------------------------------------------------------------------------------


def add_fit_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `sparseprefill workload fit`."""
    from . import workload

    parser.add_argument("--qkv", type=Path, default=None, help="capture (sparseprefill eval capture)")
    parser.add_argument("--stats", type=Path, default=None,
                        help="instead of --qkv: fit to the captured statistics of a --stats-only JSON (made with "
                             "the same --shared, --rows and --slash-select); the report compares at their length")
    parser.add_argument("--predict-stats", type=Path, default=None,
                        help="with --stats of a prefix: the capture's statistics at its full length (a --stats-only "
                             "JSON): predict there under every rule (--rules)")
    parser.add_argument("--join", type=Path, nargs="+", default=None,
                        help="instead of fitting: join these fits (one layer each) into --calibration")
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="captured layers (default all)")
    parser.add_argument("--max-seqlen", type=int, default=None, help="fit on this prefix only")
    parser.add_argument("--predict", action="store_true",
                        help="with --max-seqlen: predict the statistics at the capture's length")
    parser.add_argument("--rules", nargs="+", choices=workload.RULES, default=None,
                        help="with --predict: only these rules to long N (default every rule)")
    parser.add_argument("--rows", type=int, default=128, help="query rows of every statistic (default 128)")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--calibration", type=Path, default=None, help="write the fit here")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--shared", action="store_true",
                        help="also fit the shared far-field structure (workload.fit_layer)")
    parser.add_argument("--joint-runs", action="store_true",
                        help="with --shared: query runs fitted with the vertical share, clean sink key")
    parser.add_argument("--slash-select", choices=workload.SLASH_SELECT, default="mean",
                        help="how the slash diagonals are ranked (workload.attention_stats)")
    parser.add_argument("--stats-only", action="store_true",
                        help="only the captured statistics of every chosen layer (no fit)")


def run_fit(args: argparse.Namespace) -> int:
    """Entry point of `sparseprefill workload fit`."""
    from . import workload

    start = time.perf_counter()
    if args.join is not None:
        if args.calibration is None:
            raise ValueError("--join needs --calibration (where to write the joined fit)")
        parts = [workload.Calibration.from_json(json.loads(path.read_text())) for path in args.join]
        layers = tuple(sorted((lp for part in parts for lp in part.layers), key=lambda lp: lp.layer))
        joined = workload.Calibration(source=parts[0].source, layers=layers, rule=parts[0].rule)
        _write_calibration(args, joined)
        print(f"joined layers {[lp.layer for lp in layers]} into {args.calibration}")
        return 0
    if args.json is None:
        raise ValueError("--json is needed (the report) unless --join")
    if args.stats is not None:
        return _fit_from_stats(args, start)
    if args.qkv is None:
        raise ValueError("--qkv (or --stats, or --join) is needed")
    data = torch.load(args.qkv, map_location="cpu")
    if args.stats_only:
        stats = {}
        for i, layer in enumerate(data["layers"]):
            if args.layers is not None and layer not in args.layers:
                continue
            q, k = data["q"][i], data["k"][i]
            if args.max_seqlen is not None:
                q, k = q[:, :, :args.max_seqlen], k[:, :, :args.max_seqlen]
            # As the fit measures its target (`fit_capture`): the default scale where the capture's is
            # 1/sqrt(D) (the same to an ulp), slashes first for the shared fit.
            scale = float(data["scale"][i])
            stats[int(layer)] = asdict(workload.attention_stats(
                q, k, scale=None if math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-6) else scale,
                rows=args.rows, slash_first=args.shared, slash_select=args.slash_select))
            oracle = stats[int(layer)]["oracle"]
            _log(f"layer {layer}: oracle@0.95 mean {sum(o[1] for o in oracle) / len(oracle):.4f}")
        _write_json(args.json, {"command": _command(args), "source": data.get("meta", {}),
                                "slash_first": args.shared, "slash_select": args.slash_select, "rows": args.rows,
                                "layers": stats})
        return 0
    cal, fit_stats = workload.fit_capture(data, layers=args.layers, max_seqlen=args.max_seqlen, rows=args.rows,
                                          iterations=args.iterations, log=_log, shared=args.shared,
                                          joint_runs=args.joint_runs, slash_select=args.slash_select)
    _write_calibration(args, cal)
    rules = (args.rules or workload.RULES) if args.predict else (cal.rule,)
    report = workload.calibration_report(data, cal, fit_stats, rows=args.rows, rules=rules, log=_log)
    return _write_report(args, start, report)


def _write_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, default=str))


def _write_calibration(args: argparse.Namespace, cal: Any) -> None:
    if args.calibration is not None:
        _write_json(args.calibration, cal.to_json())


def _write_report(args: argparse.Namespace, start: float, report: dict[str, Any]) -> int:
    """The report with its command and time to `--json`; its table on stdout."""
    from . import workload

    report["command"] = _command(args)
    report["seconds"] = time.perf_counter() - start
    _write_json(args.json, report)
    print(workload.format_report(report))
    return 0


def _fit_from_stats(args: argparse.Namespace, start: float) -> int:
    """`--stats`: fit every chosen layer to saved captured statistics."""
    from . import workload

    saved = json.loads(args.stats.read_text())
    made = (bool(saved.get("slash_first", False)), int(saved.get("rows", args.rows)), saved.get("slash_select", "mean"))
    wanted = (bool(args.shared), args.rows, args.slash_select)
    if made != wanted:
        raise ValueError(f"{args.stats}: statistics made with (slash_first, rows, slash_select) = {made}; this fit "
                         f"needs {wanted}")
    fitted, stats = [], {}
    for key, d in sorted(saved["layers"].items(), key=lambda kv: int(kv[0])):
        layer = int(key)
        if args.layers is not None and layer not in args.layers:
            continue
        target = workload.Stats(**d)
        stats[layer] = target
        shape = workload.Shape(1, len(target.sink), len(target.slash_offsets), target.seqlen, workload.FIT_HEAD_DIM,
                               torch.float64)
        fitted.append(workload.fit_layer(target, shape, layer=layer, iterations=args.iterations, rows=args.rows,
                                         log=_log, shared=args.shared, joint_runs=args.joint_runs,
                                         slash_select=args.slash_select))
    meta = saved.get("source", {})
    cal = workload.Calibration(source=f"{meta.get('model', 'capture')}, N={fitted[0].seqlen if fitted else 0}",
                               layers=tuple(fitted))
    _write_calibration(args, cal)
    full = None
    if args.predict_stats is not None:
        full = {int(k): workload.Stats(**d) for k, d in json.loads(args.predict_stats.read_text())["layers"].items()}
    rules = (args.rules or workload.RULES) if full is not None else (cal.rule,)
    report = workload.calibration_report(None, cal, stats, rows=args.rows, log=_log, captured=full, rules=rules)
    return _write_report(args, start, report)


# -- accept ------------------------------------------------------------------------------------


def add_accept_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `sparseprefill workload accept`."""
    parser.add_argument("--qkv", type=Path, default=None, help="the capture the fit was made from")
    parser.add_argument("--calibration", type=Path, default=None, help="the fit (default: the shipped one)")
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="default: every fitted layer")
    parser.add_argument("--kv-heads", type=int, nargs="+", default=None,
                        help="KV heads (with their query heads) to run (default all)")
    parser.add_argument("--query-heads", type=int, nargs="+", default=None,
                        help="instead of --kv-heads: these query heads, each with its KV head (a CPU-sized subset)")
    parser.add_argument("--budget-s", type=float, default=math.inf,
                        help="start no new (layer, heads) item after this many seconds")
    parser.add_argument("--per-head", action="store_true", help="every chosen query head on its own")
    parser.add_argument("--methods", nargs="+", default=None, help="default: every registered method")
    parser.add_argument("--backend", choices=("reference", "fast"), default="reference")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workloads", nargs="+", choices=("captured", "calibrated"),
                        default=["captured", "calibrated"],
                        help="run only these (two processes can split the work; --merge joins them)")
    parser.add_argument("--merge", type=Path, nargs="+", default=None,
                        help="instead of running: join these JSON outputs of one layer and report the gaps")
    parser.add_argument("--json", type=Path, required=True,
                        help="the results (rewritten after every method: a stopped run keeps what it measured)")


def run_accept(args: argparse.Namespace) -> int:
    """Entry point of `sparseprefill workload accept`."""
    from . import workload
    from .methods import METHODS

    start = time.perf_counter()
    if args.merge is not None:
        parts = [json.loads(path.read_text())["layers"][0] for path in args.merge]
        points = [workload.CurvePoint(**p) for part in parts for p in part["points"]]
        item = {**parts[0], "oracle": {k: v for part in parts for k, v in part["oracle"].items()},
                "gaps": workload.curve_gaps(points), "points": [asdict(p) for p in points]}
        print(format_acceptance(item))
        _write_acceptance(args, start, [item])
        return 0
    if args.qkv is None:
        raise ValueError("--qkv is needed unless --merge")
    methods = args.methods or list(METHODS)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; registered: {', '.join(METHODS)}")
    data = torch.load(args.qkv, map_location="cpu")
    cal = workload.load_calibration(args.calibration)
    layers = args.layers or [lp.layer for lp in cal.layers]
    missing = [layer for layer in layers if layer not in [lp.layer for lp in cal.layers]
               or layer not in [int(x) for x in data["layers"]]]
    if missing:
        raise ValueError(f"layers {missing} are not both fitted and captured")
    # bf16 on the fast backend (the dtype of the timed runs: one set of compiled kernels).
    dtype = torch.bfloat16 if args.backend == "fast" else torch.float32
    results: list[dict[str, Any]] = []
    for layer in layers:
        lp = next(x for x in cal.layers if x.layer == layer)
        i = [int(x) for x in data["layers"]].index(layer)
        hq, hkv = len(lp.heads), len(lp.kv)
        group = hq // hkv
        if args.query_heads is not None:
            chosen = list(args.query_heads)
        else:
            kv_all = args.kv_heads if args.kv_heads is not None else list(range(hkv))
            chosen = [j * group + t for j in kv_all for t in range(group)]
        for qh in ([[h] for h in chosen] if args.per_head else [chosen]):
            if time.perf_counter() - start > args.budget_s:
                _log(f"out of time (--budget-s {args.budget_s}) before layer {layer} heads {qh}")
                break
            kv_heads = ([h // group for h in qh] if args.query_heads is not None or args.per_head
                        else sorted({h // group for h in qh}))
            results.append(_accept_item(args, start, data, cal, lp, i, layer, qh, kv_heads, methods, dtype, results,
                                        _log))
    if len(results) > 1:
        print(format_summary(results), flush=True)
    _write_acceptance(args, start, results, summary=summarize(results) if results else None)
    return 0


def _accept_item(args: argparse.Namespace, start: float, data: dict[str, Any], cal: Any, lp: Any, i: int,
                 layer: int, qh: list[int], kv_heads: list[int], methods: list[str], dtype: torch.dtype,
                 results: list[dict[str, Any]], log: Callable[[str], None]) -> dict[str, Any]:
    """Both workloads of one set of query heads of one layer: the item of the JSON."""
    from . import workload
    from .oracle import oracle_density

    q, k, v = data["q"][i][:, qh], data["k"][i][:, kv_heads], data["v"][i][:, kv_heads]
    n = int(q.shape[2])
    # The twin is the fit's own realization: the whole layer generated at its shape and seed, the
    # chosen heads taken from it (a head generated alone is another draw of its random parts).
    group = len(lp.heads) // len(lp.kv)
    if len(kv_heads) == len(qh) and any(h // group != j for h, j in zip(qh, kv_heads)):
        raise ValueError(f"query heads {qh} do not match KV heads {kv_heads}")
    shape = workload.Shape(1, len(lp.heads), len(lp.kv), n, workload.FIT_HEAD_DIM, torch.float64)
    fq, fk, fv = workload.generate_layer(list(lp.heads), list(lp.kv), shape, seed=args.seed, fit_seqlen=lp.seqlen,
                                         rule=cal.rule)
    gq, gk, gv = fq[:, qh], fk[:, kv_heads], fv[:, kv_heads]
    del fq, fk, fv
    points: list[Any] = []
    oracle: dict[str, list[float]] = {}
    runs = (("captured", (q, k, v), float(data["scale"][i])),
            ("calibrated", (gq, gk, gv), workload.FIT_HEAD_DIM ** -0.5))
    item: dict[str, Any] = {}
    for name, tensors, scale in (r for r in runs if r[0] in args.workloads):
        a, b, c = (t.to(device=args.device, dtype=torch.float16 if dtype == torch.float32 else dtype).to(dtype)
                   for t in tensors)
        oracle[name] = oracle_density(a, b, workload.ORACLE_SHARES, scale=scale).mean((0, 1)).tolist()
        log(f"layer {layer} {name}: oracle density at {workload.ORACLE_SHARES}: {oracle[name]}")
        for method in methods:  # one method at a time, so that a stopped run keeps what it measured
            points += workload.method_curves(a, b, c, [method], scale=scale, workload=name, backend=args.backend,
                                             log=log)
            item = {"layer": layer, "kv_heads": kv_heads, "query_heads": qh, "seqlen": n, "oracle": oracle,
                    "gaps": workload.curve_gaps(points), "points": [asdict(p) for p in points]}
            _write_acceptance(args, start, [*results, item])
    print(format_acceptance(item), flush=True)
    return item


def _write_acceptance(args: argparse.Namespace, start: float, results: list[dict[str, Any]],
                      summary: dict[str, Any] | None = None) -> None:
    device = torch.cuda.get_device_name() if str(args.device).startswith("cuda") else "cpu"
    _write_json(args.json, {"command": _command(args), "backend": args.backend, "device": device,
                            "seconds": time.perf_counter() - start, "summary": summary, "layers": results})


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method over every item (layer, heads): the largest and median gap at equal density
    and how many items are within `TOLERANCE`; per item the oracle densities' relative error."""
    per: dict[str, list[float]] = {}
    kinds: dict[str, str] = {}
    for item in results:
        for name, g in item["gaps"].items():
            key = "recall" if "recall_gap_at_equal_density_max" in g else "error"
            kinds[name] = key
            x = g[f"{key}_gap_at_equal_density_max"]
            if x is not None:
                per.setdefault(name, []).append(float(x))
    methods = {name: {"measure": kinds[name], "items": len(v), "max": max(v), "median": sorted(v)[len(v) // 2],
                      "within": sum(x <= TOLERANCE for x in v)} for name, v in per.items()}
    oracle = []
    for item in results:
        o = item["oracle"]
        if "captured" in o and "calibrated" in o:
            oracle.append({"layer": item["layer"], "query_heads": item["query_heads"], "captured": o["captured"],
                           "calibrated": o["calibrated"],
                           "relative_error": [b / a - 1 for a, b in zip(o["captured"], o["calibrated"])]})
    return {"tolerance": TOLERANCE, "methods": methods, "oracle": oracle}


def format_summary(results: list[dict[str, Any]]) -> str:
    """Markdown: per method the gap over every item; the oracle's errors."""
    s = summarize(results)
    lines = [f"{len(results)} items (layer, query heads); recall gap at equal density, criterion {TOLERANCE}:", "",
             "| method | items within | max gap | median gap |", "| --- | --- | --- | --- |"]
    for name, m in s["methods"].items():
        label = name if m["measure"] == "recall" else f"{name} (output error)"
        lines.append(f"| {label} | {m['within']}/{m['items']} | {m['max']:.3f} | {m['median']:.3f} |")
    if s["oracle"]:
        e9 = [abs(o["relative_error"][0]) for o in s["oracle"]]
        e95 = [abs(o["relative_error"][1]) for o in s["oracle"]]
        lines += ["", f"oracle density relative error: at 0.9 max {max(e9):.0%} (median {sorted(e9)[len(e9) // 2]:.0%}), "
                      f"at 0.95 max {max(e95):.0%} (median {sorted(e95)[len(e95) // 2]:.0%}); within "
                      f"{ORACLE_TOLERANCE:.0%}: {sum(e <= ORACLE_TOLERANCE for e in e9)}/{len(e9)} and "
                      f"{sum(e <= ORACLE_TOLERANCE for e in e95)}/{len(e95)}"]
    return "\n".join(lines)


def format_acceptance(item: dict[str, Any]) -> str:
    """Markdown: per method the largest recall gap at equal density and at the same knob."""
    oracle = item["oracle"]
    cap = oracle.get("captured", [math.nan, math.nan])
    cal = oracle.get("calibrated", [math.nan, math.nan])

    def rel(a: float, b: float) -> str:
        return "-" if not a or math.isnan(a) or math.isnan(b) else f"{b / a - 1:+.0%}"

    lines = [f"layer {item['layer']}, KV heads {item['kv_heads']}, N = {item['seqlen']}: oracle density at 0.9 "
             f"{cap[0]:.4f} captured / {cal[0]:.4f} calibrated ({rel(cap[0], cal[0])}), at 0.95 "
             f"{cap[1]:.4f} / {cal[1]:.4f} ({rel(cap[1], cal[1])})", "",
             "| method | max recall gap at equal density (points in overlap) | max gap at the same knob | "
             "density calibrated / captured at the same knob |", "| --- | --- | --- | --- |"]
    for name, g in item["gaps"].items():
        key = "recall" if "recall_gap_at_equal_density_max" in g else "error"
        eq = g[f"{key}_gap_at_equal_density_max"]
        same = g[f"{key}_gap_same_knob_max"]
        ratios = ", ".join(f"{r:.2f}" for r in g["density_ratio_same_knob"])
        lines.append(f"| {name}{'' if key == 'recall' else ' (output error)'} | "
                     f"{'-' if eq is None else f'{eq:.3f}'} ({g['points_in_overlap']}/{g['points']}) | "
                     f"{'-' if same is None else f'{same:.3f}'} | {ratios} |")
    return "\n".join(lines)


# -- table -------------------------------------------------------------------------------------


def add_table_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `sparseprefill workload table`."""
    parser.add_argument("--reports", type=Path, nargs="+", default=[],
                        help="`workload fit` reports at the capture's length")
    parser.add_argument("--prefix", type=Path, nargs="+", default=[],
                        help="`workload fit --max-seqlen M --predict` reports")
    parser.add_argument("--acceptance", type=Path, nargs="+", default=[], help="`workload accept` results")
    parser.add_argument("--json", type=Path, default=None)


def _report_summary(path: Path) -> tuple[int, dict[str, Any]]:
    report = json.loads(path.read_text())
    rule = next(iter(report["rules"]))
    item = report["rules"][rule][0]
    return int(item["layer"]), item["summary"]


def calibration_table(reports: list[Path], prefixes: dict[int, list[Path]], acceptance: list[Path]) -> dict[str, Any]:
    """One row per layer (see the module doc) and the totals."""
    rows: dict[int, dict[str, Any]] = {}
    for path in reports:
        layer, s = _report_summary(path)
        row = rows.setdefault(layer, {"layer": layer})
        for share in ("0.9", "0.95"):
            o = s[f"oracle_{share}"]
            row[f"oracle_{share}"] = {"captured": o["captured"], "calibrated": o["generated"],
                                      "relative_error": o["relative_error"],
                                      "head_relative_error_max": o["head_relative_error_max"]}
        row["shares"] = {name: [s[name]["captured"], s[name]["generated"]]
                         for name in ("sink", "local", "vertical", "slash", "rest")}
    for m, paths in prefixes.items():
        for path in paths:
            layer, s = _report_summary(path)
            rows.setdefault(layer, {"layer": layer})[f"predicted_from_{m}"] = {
                "oracle_0.9": s["oracle_0.9"]["relative_error"], "oracle_0.95": s["oracle_0.95"]["relative_error"]}
    for path in acceptance:
        for item in json.loads(path.read_text())["layers"]:
            row = rows.setdefault(int(item["layer"]), {"layer": int(item["layer"])})
            acc = row.setdefault("acceptance", {"query_heads": item["query_heads"], "gaps": {}})
            o = item["oracle"]
            if "captured" in o and "calibrated" in o:
                acc["oracle"] = {"captured": o["captured"], "calibrated": o["calibrated"],
                                 "relative_error": [b / a - 1 for a, b in zip(o["captured"], o["calibrated"])]}
            for name, g in item["gaps"].items():
                # A method whose density never moves (full attention) has no gap to speak of.
                if "recall_gap_at_equal_density_max" in g and g.get("points", 2) > 1:
                    acc["gaps"][name] = g["recall_gap_at_equal_density_max"]
    out = [rows[k] for k in sorted(rows)]
    for row in out:
        acc = row.get("acceptance")
        if acc is not None:
            gaps = [x for x in acc["gaps"].values() if x is not None]
            acc["within"] = sum(x <= TOLERANCE for x in gaps)
            acc["methods"] = len(gaps)
    return {"tolerance": TOLERANCE, "oracle_tolerance": ORACLE_TOLERANCE,
            "prefixes": sorted(prefixes, reverse=True), "layers": out, "totals": _totals(out)}


def _totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    t: dict[str, Any] = {}
    fitted = [r for r in rows if "oracle_0.95" in r]
    for share in ("0.9", "0.95"):
        errs = [abs(r[f"oracle_{share}"]["relative_error"]) for r in fitted]
        if errs:
            t[f"layers_oracle_{share}_within_20pct"] = f"{sum(e <= ORACLE_TOLERANCE for e in errs)}/{len(errs)}"
    for key in sorted({k for r in rows for k in r if k.startswith("predicted_from_")}):
        e = [abs(r[key]["oracle_0.95"]) for r in rows if key in r]
        t[key] = {"layers": len(e), "mean_abs_error_0.95": sum(e) / len(e), "max_abs_error_0.95": max(e),
                  "within_20pct": sum(x <= ORACLE_TOLERANCE for x in e), "within_30pct": sum(x <= 0.3 for x in e)}
    per: dict[str, list[float]] = {}
    for r in rows:
        for name, g in r.get("acceptance", {}).get("gaps", {}).items():
            if g is not None:
                per.setdefault(name, []).append(g)
    t["methods"] = {name: {"layers": len(v), "within": sum(x <= TOLERANCE for x in v), "max": max(v),
                           "median": sorted(v)[len(v) // 2]} for name, v in per.items()}
    acc = [r["acceptance"] for r in rows if "acceptance" in r and "oracle" in r["acceptance"]]
    if acc:
        t["heads_oracle_within_20pct"] = [sum(abs(a["oracle"]["relative_error"][i]) <= ORACLE_TOLERANCE for a in acc)
                                          for i in range(2)]
        t["heads"] = len(acc)
        t["heads_all_methods_within"] = sum(a["within"] == a["methods"] for a in acc)
    return t


def _short_name(method: str) -> str:
    """A column title: the initials of a method name of several words (`vertical_slash` -> VS)."""
    words = method.split("_")
    return "".join(w[0] for w in words).upper() if len(words) > 1 else method


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"


def format_calibration_table(t: dict[str, Any]) -> str:
    """Markdown: one row per layer (a gap over the tolerance in bold)."""
    methods = sorted(t["totals"].get("methods", {}))
    prefixes = t.get("prefixes", [])
    head = ("| layer | oracle@0.9 capt / cal (err) | oracle@0.95 capt / cal (err) | "
            + "".join(f"from {m} | " for m in prefixes)
            + "head: oracle@0.9 / 0.95 err | " + " | ".join(_short_name(m) for m in methods)
            + f" | within {TOLERANCE} |")
    lines = [head, "| " + " | ".join(["---"] * (head.count("|") - 1)) + " |"]
    for r in t["layers"]:
        cells = [str(r["layer"])]
        for share in ("0.9", "0.95"):
            o = r.get(f"oracle_{share}")
            cells.append("-" if o is None else f"{o['captured']:.4f} / {o['calibrated']:.4f} "
                                               f"({_pct(o['relative_error'])})")
        for m in prefixes:
            p = r.get(f"predicted_from_{m}")
            cells.append("-" if p is None else _pct(p["oracle_0.95"]))
        acc = r.get("acceptance", {})
        o = acc.get("oracle")
        cells.append("-" if o is None else f"{_pct(o['relative_error'][0])} / {_pct(o['relative_error'][1])}")
        for m in methods:
            g = acc.get("gaps", {}).get(m)
            cells.append("-" if g is None else (f"**{g:.3f}**" if g > TOLERANCE else f"{g:.3f}"))
        cells.append(f"{acc['within']}/{acc['methods']}" if "within" in acc else "-")
        lines.append("| " + " | ".join(cells) + " |")
    if methods:
        lines += ["", "columns: " + ", ".join(f"{_short_name(m)} = {m}" for m in methods)]
    return "\n".join(lines)


def run_table(args: argparse.Namespace) -> int:
    """Entry point of `sparseprefill workload table`."""
    prefixes: dict[int, list[Path]] = {}
    for path in args.prefix:
        prefixes.setdefault(int(json.loads(path.read_text())["fit_seqlen"]), []).append(path)
    t = calibration_table(args.reports, prefixes, args.acceptance)
    print(format_calibration_table(t))
    print(json.dumps(t["totals"], indent=1))
    if args.json is not None:
        _write_json(args.json, {"command": _command(args), **t})
    return 0


# -- command line ------------------------------------------------------------------------------

TASKS = {
    "fit": (add_fit_arguments, run_fit, "fit the calibrated workload to a capture (or saved statistics); "
                                        "report the fit, predict from a prefix"),
    "accept": (add_accept_arguments, run_accept, "every method's sweep on captured layers and on the fit: the "
                                                 "recall gap at equal density"),
    "table": (add_table_arguments, run_table, "one row per fitted layer from fit reports, prefix predictions and "
                                              "acceptance results"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `workload` tasks."""
    sub = parser.add_subparsers(dest="workload_command", metavar="TASK", required=True)
    for name, (add, _, text) in TASKS.items():
        add(sub.add_parser(name, help=text, description=text))


def run(args: argparse.Namespace) -> int:
    """Entry point of `sparseprefill workload`."""
    try:
        return int(TASKS[args.workload_command][1](args))
    except (ValueError, OSError) as exc:
        print(f"sparseprefill workload {args.workload_command}: {exc}", file=sys.stderr)
        return 2
