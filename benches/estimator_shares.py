"""Every method's `*_plan` as a share of cuDNN SDPA dense, one run, one version (issue 22).

On the bench workload (`demo.synthetic_qkv`: bf16, B = 1, 32 query / 8 KV heads) at each
head dim and N: cuDNN dense, then each method's plan at its bench default (`do_bench`
median), its share of dense, its matrix-unit floor where it has one (XAttention stride S:
`dense / (2 S)`, the strided product's multiply-adds over dense's; DPXA: the scoring
ratio `alpha * beta` x dense, its anchor pairs' multiply-adds), the plan's host
synchronisations and a hash of its block and column lists (`estimator_stages._plan_hash`:
equal hashes, equal plans, so two versions' runs can be compared).

    python benches/estimator_shares.py --seqlens 32768 131072 --head-dims 128 64 --json out.json
    python benches/estimator_shares.py --table out.json [more.json ...]   # the markdown table

`--dpxa-variants` also times DPXA's scoring kernel and whole plan at `DPXA_CONFIGS`
(`delta_score.SCORE_CONFIG`) with the largest weight difference from the default; `--key-splits`
XAttention's scoring and plan at `KEY_SPLIT_STEPS` 0 / 2 / 4 / 8 (last in the run: triton
3.6 once aborted the process compiling it). `--ncu-dpxa` runs DPXA's
scoring once per `NCU_CONFIGS` entry (for `ncu --kernel-name regex:_anchor_tile_kernel`).
`--profile-flex` lists the kernels and host synchronisations of one `flexprefill_vs_plan`
call (torch profiler). Sections past `--deadline` (time.time()) are skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import estimator_stages as es  # noqa: E402

# DPXA scoring configurations timed by `--dpxa-variants`: (query tiles per program, Q anchors
# per step, K anchors per step, key tiles per program (0: all), flat loop with prefetch,
# warps, stages). The first is session 3's kernel (one program walks its whole range).
DPXA_CONFIGS: tuple[tuple[int, int, int, int, bool, int, int], ...] = (
    (64, 64, 64, 0, False, 4, 2),
    (64, 64, 64, 64, False, 4, 2),
    (64, 64, 64, 32, False, 4, 2),
    (64, 64, 64, 16, False, 4, 2),
    (64, 64, 64, 32, False, 8, 2),
    (64, 64, 64, 32, False, 4, 1),
    (32, 64, 64, 32, False, 4, 2),
    (32, 32, 64, 32, False, 4, 2),
    (64, 64, 64, 0, True, 4, 2),
    (64, 64, 64, 32, True, 4, 2),
)
NCU_CONFIGS = (DPXA_CONFIGS[0], DPXA_CONFIGS[2])
# Session 3's configuration (one program walks its whole key range), the tie check's "before".
DPXA_CONFIGS_BEFORE = DPXA_CONFIGS[0]
KEY_SPLITS = (0, 2, 4, 8)
# `_slash_kernel` tiles timed by `--slash-variants` (`last_q_estimate.SLASH_CONFIG`: rows a
# step, offsets a program, warps, stages, memory-skew programs per head (0: tl.gather)).
# The first is the fourth session's kernel.
SLASH_VARIANTS: tuple[tuple[int, int, int, int, int], ...] = (
    (64, 64, 4, 2, 0),
    (64, 64, 4, 1, 0),
    (32, 64, 4, 2, 0),
    (32, 32, 4, 2, 0),
    (32, 32, 4, 1, 0),
    (32, 32, 2, 2, 0),
    (16, 32, 4, 2, 0),
    (16, 16, 4, 2, 0),
    (64, 64, 4, 2, 32),
    (32, 32, 4, 2, 32),
    (32, 32, 4, 2, 64),
    (16, 16, 4, 2, 64),
    (32, 64, 4, 2, 32),
)
SPLIT_KEYS = (1024, 2048, 4096)
# The run's environment and the rows of the (N, D) already done, for the JSON written after every row.
ENV: dict[str, Any] = {}
DONE: list[dict[str, Any]] = []


def plans(n: int, q: torch.Tensor, k: torch.Tensor, dense_ms: float) -> list[tuple[str, Callable[[], Any], float | None]]:
    """(label, plan call, floor ms or None) of every method at its bench default."""
    from sparseprefill import fast
    from sparseprefill.methods import METHODS

    out: list[tuple[str, Callable[[], Any], float | None]] = []
    for name in ("anchor_attention", "vertical_slash", "sample_attention", "minference", "shareprefill"):
        spec = METHODS.get(name)
        if spec is None or spec.fast_plan is None:
            continue
        p = spec.call_params(spec.demo_params(n), q)
        out.append((name, lambda s=spec, p=p: s.fast_plan(q, k, **p), None))
    try:
        ratio = float(fast.dpxa_scoring_ratio(q, k).mean())
    except Exception:  # noqa: BLE001 - a version without it
        ratio = math.nan
    out.append(("dpxa", lambda: fast.dpxa_plan(q, k), ratio * dense_ms))
    for s in (8, 16):
        out.append((f"xattention s{s}", lambda s=s: fast.xattention_plan(q, k, stride=s, threshold=0.9, block=128),
                    dense_ms / (2 * s)))
    for g in (0.9, 0.95):
        out.append((f"flexprefill_vs g{g}", lambda g=g: fast.flexprefill_vs_plan(q, k, gamma=g), None))
    try:
        from sparseprefill.fast.delta_xattention import delta_xattention_tiles

        # Its estimate: XAttention stride 8's tile weights and the per-tile modes.
        out.append(("delta_xattention (tiles)", lambda: delta_xattention_tiles(q, k), dense_ms / 16))
    except ImportError:
        pass
    return out


def run_one(n: int, d: int, args: argparse.Namespace, log: Callable[[str], None]) -> list[dict[str, Any]]:
    dev = torch.device("cuda")
    q, k, v = es.workload(n, dev, args.cache, head_dim=d)
    dense_ms, _ = es.cudnn_ms(q, k, v)
    rows: list[dict[str, Any]] = [{"seqlen": n, "head_dim": d, "method": "cuDNN SDPA", "stage": "dense",
                                   "ms": dense_ms}]
    log(f"N={n} D={d} cuDNN dense {dense_ms:.3f} ms")

    def add(method: str, stage: str, fn: Callable[[], Any], floor: float | None = None, **extra: Any) -> None:
        if es.past_deadline():
            log(f"N={n} D={d} {method} {stage}: skipped (past the deadline)")
            return
        try:
            ms = es._ms(fn)
        except Exception as exc:  # noqa: BLE001 - a failing row is one log line
            log(f"N={n} D={d} {method} {stage}: {type(exc).__name__}: {str(exc)[:200]}")
            return
        row = {"seqlen": n, "head_dim": d, "method": method, "stage": stage, "ms": ms,
               "share": ms / dense_ms, **extra}
        if floor is not None and math.isfinite(floor):
            row["floor_ms"] = floor
            row["over_floor"] = ms / floor
        rows.append(row)
        if args.json:  # after every row: a run that aborts (a failed compile) keeps what it had
            with open(args.json, "w") as out:
                json.dump({"environment": ENV, "rows": DONE + rows}, out, indent=1)
        more = " ".join(f"{key}={val}" for key, val in extra.items())
        log(f"N={n} D={d} {method:26s} {stage:34s} {ms:8.3f} ms {100 * ms / dense_ms:6.2f}%"
            + (f" floor {floor:.3f} ({ms / floor:.2f}x)" if floor and math.isfinite(floor) else "") + f" {more}")

    with torch.no_grad():
        for method, fn, floor in plans(n, q, k, dense_ms):
            if args.methods and not any(method.startswith(m) for m in args.methods):
                continue
            try:
                plan = fn()
                extra = {"plan_hash": es._plan_hash(plan) if hasattr(plan, "block_count") else None,
                         "syncs": es._syncs(fn)}
                del plan
            except Exception as exc:  # noqa: BLE001
                log(f"N={n} D={d} {method}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            add(method, "plan", fn, floor, **extra)
        if args.dpxa_variants:
            _dpxa_variants(q, k, dense_ms, add, log)
        if args.slash_variants:
            _slash_variants(q, k, add, log)
        if args.tie_check:
            rows.extend(tie_check(n, d, q, k, log))
        if args.key_splits:
            # Last: triton 3.6 aborted the process compiling an earlier version of it.
            _key_splits(q, k, dense_ms, add, log)
        if args.profile_flex:
            rows.append({"seqlen": n, "head_dim": d, "method": "flexprefill_vs g0.9", "stage": "profile",
                         **profile_flex(q, k, log)})
    if args.json:  # the rows added without `add` (tie check, profile) too
        with open(args.json, "w") as out:
            json.dump({"environment": ENV, "rows": DONE + rows}, out, indent=1)
    del q, k, v
    torch.cuda.empty_cache()
    return rows


def _dpxa_variants(q: torch.Tensor, k: torch.Tensor, dense_ms: float, add: Any, log: Callable[[str], None]) -> None:
    """DPXA's scoring and whole plan at each of `DPXA_CONFIGS` (rows through `add`)."""
    from sparseprefill import fast
    from sparseprefill.fast.kernels import delta_score as ds

    ratio = float(fast.dpxa_scoring_ratio(q, k).mean())
    default = ds.SCORE_CONFIG
    add("dpxa", "anchors (q and k, default)", lambda: (ds.delta_anchor_packed(q, cos_threshold=0.75, block=128),
                                                       ds.delta_anchor_packed(k, cos_threshold=0.75, block=128)))
    add("dpxa", "select (default)", lambda w=fast.dpxa_tile_weights(q, k): fast.select_tiles(w, 0.9))
    base = fast.dpxa_tile_weights(q, k)
    base_hash = es._plan_hash(fast.dpxa_plan(q, k))
    try:
        for config in DPXA_CONFIGS:
            ds.SCORE_CONFIG = config
            try:
                w = fast.dpxa_tile_weights(q, k)
                diff = float((w - base).abs().nan_to_num(0.0).max())
                same = es._plan_hash(fast.dpxa_plan(q, k)) == base_hash
                del w
            except Exception as exc:  # noqa: BLE001 - e.g. a failed compile
                log(f"dpxa {config}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            add("dpxa", f"score {config}", lambda: fast.dpxa_tile_weights(q, k), ratio * dense_ms,
                max_weight_diff=diff)
            add("dpxa", f"plan {config}", lambda: fast.dpxa_plan(q, k), None, same_plan_as_default=same)
    finally:
        ds.SCORE_CONFIG = default


def _slash_variants(q: torch.Tensor, k: torch.Tensor, add: Any, log: Callable[[str], None]) -> None:
    """The last-q estimate and the vertical_slash / minference plans at each of
    `SLASH_VARIANTS`, the lse pass's key splits at `SPLIT_KEYS`, and the VS index with
    and without its bisection start (rows through `add`; plan hashes against the defaults)."""
    from sparseprefill.fast.kernels import last_q_estimate as lq
    from sparseprefill.fast.kernels import vertical_slash_index as vsi
    from sparseprefill.methods import METHODS

    specs = {name: METHODS.get(name) for name in ("vertical_slash", "minference")}
    calls = {name: (lambda s=spec, p=spec.call_params(spec.demo_params(q.shape[2]), q): s.fast_plan(q, k, **p))
             for name, spec in specs.items() if spec is not None}
    est = lambda: lq.last_q_scores(q, k, last_q=64)  # noqa: E731
    _, base_slash = est()
    base_hash = {name: es._plan_hash(fn()) for name, fn in calls.items()}
    saved = lq.SLASH_CONFIG, lq._SPLIT_KEYS, vsi.SKIP_UNREACHED, vsi.INDEX_BY

    def measure(label: str) -> None:
        try:
            _, slash = est()
            diff = float((slash - base_slash).abs().max())
            same = {name: es._plan_hash(fn()) == base_hash[name] for name, fn in calls.items()}
        except Exception as exc:  # noqa: BLE001 - e.g. a failed compile
            log(f"{label}: {type(exc).__name__}: {str(exc)[:200]}")
            return
        add("last_q_scores", f"estimate {label}", est, None, max_slash_diff=diff)
        for name, fn in calls.items():
            add(name, f"plan {label}", fn, None, same_plan_as_default=same[name])

    try:
        for config in SLASH_VARIANTS:
            lq.SLASH_CONFIG = config
            measure(f"{config}")
        lq.SLASH_CONFIG = saved[0]
        for keys in SPLIT_KEYS:
            lq._SPLIT_KEYS = keys
            measure(f"lse split {keys}")
        lq._SPLIT_KEYS = saved[1]
        from sparseprefill.fast.vertical_slash import vertical_slash_lines

        spec = specs["vertical_slash"]
        if spec is not None:
            p = spec.call_params(spec.demo_params(q.shape[2]), q)
            line_args = {key: val for key, val in p.items() if key in (
                "vertical_size", "slash_size", "last_q", "init_columns", "local_diagonals")}
            _, slashes = vertical_slash_lines(q, k, **line_args)
            for by, skip in (("walk", False), ("walk", True), ("blocks", True)):
                vsi.INDEX_BY, vsi.SKIP_UNREACHED = by, skip
                add("vertical_slash", f"count_blocks {by} skip={skip}",
                    lambda: vsi.count_blocks(slashes, seqlen=q.shape[2], block_m=p.get("block_m", 64),
                                             block_n=p.get("block_n", 64)), None)
                measure(f"index {by} skip={skip}")
    finally:
        lq.SLASH_CONFIG, lq._SPLIT_KEYS, vsi.SKIP_UNREACHED, vsi.INDEX_BY = saved


def _key_splits(q: torch.Tensor, k: torch.Tensor, dense_ms: float, add: Any, log: Callable[[str], None]) -> None:
    """XAttention's scoring and plan at each of `KEY_SPLITS` (rows through `add`)."""
    from sparseprefill import fast
    from sparseprefill.fast.kernels import xattention_score as xs

    if hasattr(xs, "KEY_SPLIT_STEPS"):
        saved = xs.KEY_SPLIT_STEPS
        try:
            for s in (8, 16):
                xs.KEY_SPLIT_STEPS = 0
                ref = fast.xattention_tile_weights(q, k, stride=s, block=128)
                ref_hash = es._plan_hash(fast.xattention_plan(q, k, stride=s, threshold=0.9, block=128))
                for steps in KEY_SPLITS:
                    xs.KEY_SPLIT_STEPS = steps
                    try:
                        w = fast.xattention_tile_weights(q, k, stride=s, block=128)
                        diff = float((w - ref).abs().nan_to_num(0.0).max())
                        same = es._plan_hash(fast.xattention_plan(q, k, stride=s, threshold=0.9, block=128)) == ref_hash
                        del w
                    except Exception as exc:  # noqa: BLE001 - triton 3.6 failed to compile it once
                        log(f"xattention s{s} key split {steps}: {type(exc).__name__}: {str(exc)[:200]}")
                        continue
                    add(f"xattention s{s}", f"score key split {steps}",
                        lambda s=s: fast.xattention_tile_weights(q, k, stride=s, block=128), dense_ms / (2 * s),
                        max_weight_diff=diff)
                    add(f"xattention s{s}", f"plan key split {steps}",
                        lambda s=s: fast.xattention_plan(q, k, stride=s, threshold=0.9, block=128), dense_ms / (2 * s),
                        same_plan_as_unsplit=same)
                del ref
        finally:
            xs.KEY_SPLIT_STEPS = saved


def tie_check(n: int, d: int, q: torch.Tensor, k: torch.Tensor, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The default DPXA and XAttention stride 16 plans against the weights of the unsplit
    kernels (session 3's DPXA configuration, KEY_SPLIT_STEPS 0): tiles that differ, and
    `check_greedy_modulo_ties` (the conformance tie rule) on those weights."""
    from sparseprefill import fast
    from sparseprefill.conformance.ties import check_greedy_modulo_ties, tile_weight_tolerance
    from sparseprefill.fast.kernels import delta_score as ds
    from sparseprefill.fast.kernels import xattention_score as xs

    tol = tile_weight_tolerance(q, k, None)
    out = []
    saved = ds.SCORE_CONFIG, xs.KEY_SPLIT_STEPS
    for method in ("dpxa", "xattention s16"):
        try:
            if method == "dpxa":
                ds.SCORE_CONFIG = DPXA_CONFIGS_BEFORE
                old_w = fast.dpxa_tile_weights(q, k)
                old = fast.dpxa_plan(q, k).block_mask()
                ds.SCORE_CONFIG = saved[0]
                new = fast.dpxa_plan(q, k).block_mask()
            else:
                xs.KEY_SPLIT_STEPS = 0
                old_w = fast.xattention_tile_weights(q, k, stride=16, block=128)
                old = fast.xattention_plan(q, k, stride=16, threshold=0.9, block=128).block_mask()
                xs.KEY_SPLIT_STEPS = saved[1]
                new = fast.xattention_plan(q, k, stride=16, threshold=0.9, block=128).block_mask()
            differ = int((old != new).sum())
            try:
                check_greedy_modulo_ties(old_w.double().cpu(), new.cpu(), threshold=0.9, tolerance=tol, what=method)
                verdict = "PASS"
            except AssertionError as exc:
                verdict = f"FAIL {str(exc)[:200]}"
            log(f"N={n} D={d} tie check {method}: {differ} tiles differ of {int(old.sum())} kept; "
                f"greedy modulo ties (tolerance {tol:.3g}) {verdict}")
            out.append({"seqlen": n, "head_dim": d, "method": method, "stage": "tie check",
                         "tiles_differ": differ, "tiles_kept_before": int(old.sum()), "tolerance": tol,
                         "verdict": verdict})
        finally:
            ds.SCORE_CONFIG, xs.KEY_SPLIT_STEPS = saved
    return out


def profile_flex(q: torch.Tensor, k: torch.Tensor, log: Callable[[str], None]) -> dict[str, Any]:
    """Kernels (count, GPU time, the largest), launches and host syncs of one flexprefill_vs_plan."""
    from torch.profiler import ProfilerActivity, profile

    from sparseprefill import fast

    fn = lambda: fast.flexprefill_vs_plan(q, k, gamma=0.9)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sorted(((e.key, e.count, e.device_time_total / 1e3) for e in events if e.device_time_total > 0
                      and e.device_type.name == "CUDA"), key=lambda t: -t[2])
    gpu_ms = sum(t[2] for t in kernels)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
    syncs = sum(e.count for e in events if "Synchronize" in e.key or e.key == "cudaMemcpyAsync")
    out = {"wall_ms": wall, "gpu_ms": gpu_ms, "launches": launches, "sync_or_copy_calls": syncs,
           "top": [{"kernel": name[:80], "count": c, "ms": ms} for name, c, ms in kernels[:12]]}
    log(f"flexprefill_vs profile: wall {wall:.3f} ms, GPU busy {gpu_ms:.3f} ms, {launches} launches, "
        f"{syncs} sync/copy calls")
    for t in out["top"]:
        log(f"   {t['ms']:8.3f} ms x{t['count']:3d} {t['kernel']}")
    return out


def ncu_dpxa(n: int, cache: str, configs: tuple[tuple[int, int, int, int, bool, int, int], ...]) -> int:
    from sparseprefill import fast
    from sparseprefill.fast.kernels import delta_score as ds

    q, k, _ = es.workload(n, torch.device("cuda"), cache)
    for config in configs:
        ds.SCORE_CONFIG = config
        fast.dpxa_tile_weights(q, k)
        torch.cuda.synchronize()
        print(f"ncu-dpxa config {config}", flush=True)
    return 0


def table(paths: list[str]) -> str:
    rows = []
    for path in paths:
        if os.path.exists(path):  # a section cut by the budget leaves no file
            with open(path) as f:
                rows += json.load(f)["rows"]
    lines = ["| D | N | method | stage | ms | share of cuDNN | floor ms | x floor | syncs | plan hash |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "ms" not in r:
            continue
        lines.append(f"| {r['head_dim']} | {r['seqlen']} | {r['method']} | {r['stage']} | {r['ms']:.3f} | "
                     f"{100 * r.get('share', 1.0):.2f}% | {r.get('floor_ms', float('nan')):.3f} | "
                     f"{r.get('over_floor', float('nan')):.2f} | {r.get('syncs', '-')} | {r.get('plan_hash', '-')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="*", default=[32768, 131072])
    parser.add_argument("--head-dims", type=int, nargs="*", default=[128])
    parser.add_argument("--methods", nargs="*", default=None, help="label prefixes (dpxa, xattention, ...)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--cache", default="/tmp/estimator_stages")
    parser.add_argument("--tag", default="after")
    parser.add_argument("--dpxa-variants", action="store_true")
    parser.add_argument("--dpxa-configs", default=None,
                        help="the configurations --dpxa-variants times, a Python literal (default DPXA_CONFIGS)")
    parser.add_argument("--tie-check", action="store_true",
                        help="the default DPXA plan and XAttention stride 16 plan against the unsplit kernels' "
                             "weights: greedy selections up to tile_weight_tolerance (conformance.ties)")
    parser.add_argument("--key-splits", action="store_true")
    parser.add_argument("--slash-variants", action="store_true",
                        help="the slash kernel's tiles, the lse key splits and the VS index walk, timed")
    parser.add_argument("--profile-flex", action="store_true")
    parser.add_argument("--ncu-dpxa", action="store_true")
    parser.add_argument("--table", nargs="*", default=None, metavar="JSON")
    parser.add_argument("--deadline", type=float, default=math.inf)
    args = parser.parse_args(argv)
    if args.table is not None:
        print(table(args.table))
        return 0
    if args.dpxa_configs:
        import ast

        global DPXA_CONFIGS
        DPXA_CONFIGS = tuple(tuple(c) for c in ast.literal_eval(args.dpxa_configs))
    if args.ncu_dpxa:
        return ncu_dpxa(args.seqlens[0], args.cache, DPXA_CONFIGS if args.dpxa_configs else NCU_CONFIGS)
    es.DEADLINE = args.deadline

    def log(line: str) -> None:
        print(f"[{args.tag}] {line}", flush=True)

    import triton

    ENV.update({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                "tag": args.tag})
    log(str(ENV))
    for d in args.head_dims:
        for n in args.seqlens:
            if es.past_deadline():
                log(f"N={n} D={d}: skipped (past the deadline)")
                continue
            DONE.extend(run_one(n, d, args, log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
