"""Fit the calibrated workload (`sparseprefill.workload`) to a capture; report the fit.

    python benches/calibrate_workload.py --qkv /work/captures/qkv_smollm2_8k_all.pt \\
        --calibration sparseprefill/workloads/smollm2-8k.json \\
        --json benches/results/cpu-smollm2-calibration-2026-11-25.json

With `--max-seqlen M --predict` it fits on the first M tokens only and compares the
statistics predicted at the capture's length (under every rule of `workload.RULES`)
with the captured ones: the check of the rule to long N.
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

from sparseprefill import workload
from sparseprefill.demo import Shape


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qkv", type=Path, default=None, help="capture (sparseprefill eval capture)")
    parser.add_argument("--stats", type=Path, default=None,
                        help="instead of --qkv: fit to the captured statistics of a --stats-only JSON (made "
                             "with the same --shared and --rows); no capture needed, e.g. on a machine the "
                             "capture does not reach; the report compares at the statistics' own length")
    parser.add_argument("--predict-stats", type=Path, default=None,
                        help="with --stats of a prefix: the capture's statistics at its full length (a --stats-only "
                             "JSON): predict there under every rule (--rules), as --max-seqlen --predict does")
    parser.add_argument("--join", type=Path, nargs="+", default=None,
                        help="instead of fitting: join these calibrations (one layer each, e.g. fitted in "
                             "parallel processes) into --calibration, layers in order")
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="captured layers (default all)")
    parser.add_argument("--max-seqlen", type=int, default=None, help="fit on this prefix only")
    parser.add_argument("--predict", action="store_true",
                        help="with --max-seqlen: predict the statistics at the capture's length")
    parser.add_argument("--rules", nargs="+", choices=workload.RULES, default=None,
                        help="with --predict: only these rules to long N (default every rule)")
    parser.add_argument("--rows", type=int, default=128, help="query rows of every statistic")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--calibration", type=Path, default=None, help="write the fit here")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--shared", action="store_true",
                        help="experimental: also fit the shared far-field structure (workload.fit_layer)")
    parser.add_argument("--joint-runs", action="store_true",
                        help="with --shared: query runs fitted with the vertical share, clean sink key")
    parser.add_argument("--slash-select", choices=workload.SLASH_SELECT, default="mean",
                        help="how the slash diagonals are ranked (workload.attention_stats)")
    parser.add_argument("--stats-only", action="store_true",
                        help="only the captured statistics of every chosen layer (no fit)")
    args = parser.parse_args(argv)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    start = time.perf_counter()
    if args.join is not None:
        parts = [workload.Calibration.from_json(json.loads(path.read_text())) for path in args.join]
        layers = tuple(sorted((lp for part in parts for lp in part.layers), key=lambda lp: lp.layer))
        joined = workload.Calibration(source=parts[0].source, layers=layers, rule=parts[0].rule)
        if args.calibration is None:
            parser.error("--join needs --calibration (where to write the joined fit)")
        args.calibration.write_text(json.dumps(joined.to_json(), indent=1))
        print(f"joined layers {[lp.layer for lp in layers]} into {args.calibration}")
        return 0
    if args.stats is not None:
        if args.json is None:
            parser.error("--stats needs --json")
        return _fit_from_stats(args, argv, start, log)
    if args.qkv is None or args.json is None:
        parser.error("--qkv and --json are needed unless --join or --stats")
    data = torch.load(args.qkv, map_location="cpu")
    if args.stats_only:
        stats = {}
        for i, layer in enumerate(data["layers"]):
            if args.layers is None or layer in args.layers:
                q, k = data["q"][i], data["k"][i]
                if args.max_seqlen is not None:
                    q, k = q[:, :, :args.max_seqlen], k[:, :, :args.max_seqlen]
                # As the fit measures its target (`fit_capture`): the default scale where the capture's
                # is 1/sqrt(D) (the same to an ulp), slashes first for the shared fit.
                scale = float(data["scale"][i])
                stats[int(layer)] = asdict(workload.attention_stats(
                    q, k, scale=None if math.isclose(scale, q.shape[-1] ** -0.5, rel_tol=1e-6) else scale,
                    rows=args.rows, slash_first=args.shared, slash_select=args.slash_select))
                log(f"layer {layer}: oracle@0.95 mean {sum(o[1] for o in stats[int(layer)]['oracle']) / len(stats[int(layer)]['oracle']):.4f}")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": " ".join(["python benches/calibrate_workload.py",
                                                              *(argv or sys.argv[1:])]),
                                         "source": data.get("meta", {}), "slash_first": args.shared,
                                         "slash_select": args.slash_select,
                                         "rows": args.rows, "layers": stats}, indent=1))
        return 0
    cal, fit_stats = workload.fit_capture(data, layers=args.layers, max_seqlen=args.max_seqlen,
                                          rows=args.rows, iterations=args.iterations, log=log,
                                          shared=args.shared, joint_runs=args.joint_runs,
                                          slash_select=args.slash_select)
    _write_calibration(args, cal)
    report = workload.calibration_report(data, cal, fit_stats, rows=args.rows,
                                         rules=(args.rules or workload.RULES) if args.predict else (cal.rule,), log=log)
    return _write_report(args, argv, start, report)


def _write_calibration(args: argparse.Namespace, cal: workload.Calibration) -> None:
    """`--calibration`: the fitted layers as JSON."""
    if args.calibration is not None:
        args.calibration.parent.mkdir(parents=True, exist_ok=True)
        args.calibration.write_text(json.dumps(cal.to_json(), indent=1))


def _write_report(args: argparse.Namespace, argv: list[str] | None, start: float, report: dict[str, Any]) -> int:
    """`--json`: the report with its command and time; the table on stdout."""
    report["command"] = " ".join(["python benches/calibrate_workload.py", *(argv or sys.argv[1:])])
    report["seconds"] = time.perf_counter() - start
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(workload.format_report(report))
    return 0


def _fit_from_stats(args: argparse.Namespace, argv: list[str] | None, start: float,
                    log: Callable[[str], None]) -> int:
    """`--stats`: fit every chosen layer to saved captured statistics; the report as `--qkv`'s
    at the statistics' own length."""
    saved = json.loads(args.stats.read_text())
    made = (bool(saved.get("slash_first", False)), int(saved.get("rows", args.rows)), saved.get("slash_select", "mean"))
    if made != (bool(args.shared), args.rows, args.slash_select):
        raise SystemExit(f"{args.stats}: statistics made with (slash_first, rows, slash_select) = {made}; this fit "
                         f"needs {(bool(args.shared), args.rows, args.slash_select)}")
    fitted, stats = [], {}
    for key, d in sorted(saved["layers"].items(), key=lambda kv: int(kv[0])):
        layer = int(key)
        if args.layers is not None and layer not in args.layers:
            continue
        target = workload.Stats(**d)
        stats[layer] = target
        shape = Shape(1, len(target.sink), len(target.slash_offsets), target.seqlen, workload.FIT_HEAD_DIM,
                      torch.float64)
        fitted.append(workload.fit_layer(target, shape, layer=layer, iterations=args.iterations, rows=args.rows,
                                         log=log, shared=args.shared, joint_runs=args.joint_runs,
                                         slash_select=args.slash_select))
    meta = saved.get("source", {})
    cal = workload.Calibration(source=f"{meta.get('model', 'capture')}, N={fitted[0].seqlen if fitted else 0}",
                               layers=tuple(fitted))
    _write_calibration(args, cal)
    full = None
    if args.predict_stats is not None:
        full = {int(key): workload.Stats(**d) for key, d in json.loads(args.predict_stats.read_text())["layers"].items()}
    report = workload.calibration_report(None, cal, stats, rows=args.rows, log=log, captured=full,
                                         rules=(args.rules or workload.RULES) if full is not None else (cal.rule,))
    return _write_report(args, argv, start, report)


if __name__ == "__main__":
    sys.exit(main())
