"""Estimator stages on the GPU, before / after, beside cuDNN SDPA dense in the same run (issue 22).

Every method's `*_plan` at its bench default is timed whole and in its stages (score,
reduce, select, index, host syncs), on the bench workload (`demo.synthetic_qkv`: bf16,
B = 1, 32 query / 8 KV heads, D = 128) at each N, with `triton.testing.do_bench`
medians; each figure is also given as a share of cuDNN's dense time of the same run.
Stages that only one version has are timed where they exist.

One run times one version of the package (whatever `import sparseprefill` finds);
`--merge` joins two runs' JSON into the before / after table and checks that both
versions made the same plans (a hash of each plan's block and column lists). The
device command of issue 22 (the old code installed beside the new one):

    python -m pip install -q --no-deps --no-build-isolation --target /tmp/before .carry/before
    python -m pip install -q --no-deps --no-build-isolation --target /tmp/after .
    PYTHONPATH=/tmp/before python benches/estimator_stages.py --tag before --json $OUT/before.json
    PYTHONPATH=/tmp/after python benches/estimator_stages.py --tag after --json $OUT/after.json \\
        --peer .carryE/peer --variants
    python benches/estimator_stages.py --merge $OUT/before.json $OUT/after.json --json $OUT/stages.json

`--peer DIR` also times FlexPrefill's own code (MInference's Triton port, a scratch copy
in DIR that is never part of this repository) end to end and its estimate, with the
output's relative error against dense beside ours. `--variants` times the XAttention
scoring kernel at other tile configurations (`SCORE_CONFIGS`).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch


# Wall-clock time (time.time()) after which no new section starts (`--deadline`): a device
# call's budget cuts the tail of the run, not the middle of a section.
DEADLINE = math.inf


def past_deadline() -> bool:
    return time.time() > DEADLINE


def _ms(fn: Callable[[], Any], rep: int = 100) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def _syncs(fn: Callable[[], Any]) -> int:
    """Host synchronisations of one call (torch's sync debug mode, warnings counted)."""
    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _plan_hash(plan: Any) -> str:
    h = hashlib.sha256()
    for name in ("block_count", "block_index", "column_count", "column_index"):
        t = getattr(plan, name)
        count = plan.block_count if name.startswith("block") else plan.column_count
        if name.endswith("index") and t.shape[:3] == count.shape:
            # Entries past a row's count are padding: zero them, cut to the widest row
            # (grouped lists, one row per group of query blocks, are hashed as they are).
            width = int(count.max()) if count.numel() else 0
            t = t[..., :width]
            valid = torch.arange(width, device=t.device) < count.unsqueeze(-1)
            t = torch.where(valid, t.expand(valid.shape), 0)
        h.update(t.to(torch.int32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def workload(n: int, device: torch.device, cache: str,
             head_dim: int = 128) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    path = os.path.join(cache, f"qkv_{n}.pt" if head_dim == 128 else f"qkv_{n}_d{head_dim}.pt")
    if os.path.exists(path):
        q, k, v = torch.load(path)
    else:
        from sparseprefill.demo import Shape, synthetic_qkv

        q, k, v = synthetic_qkv(Shape(1, 32, 8, n, head_dim, torch.bfloat16), device=torch.device("cpu"))
        os.makedirs(cache, exist_ok=True)
        # Written aside, then renamed: a run reading the cache never sees half a file.
        torch.save((q, k, v), path + f".{os.getpid()}")
        os.replace(path + f".{os.getpid()}", path)
    return q.to(device), k.to(device), v.to(device)


def cudnn_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[float, torch.Tensor]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

    def run() -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)

    ms = _ms(run, rep=300)
    return ms, run()


def _rel_err(out: torch.Tensor, exact: torch.Tensor) -> float:
    return float((out.float() - exact.float()).norm() / exact.float().norm())


# Query rows whose recall is measured: the last 64 rows before each of these fractions of N.
RECALL_FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def recall_rows(n: int) -> list[int]:
    return [r for f in RECALL_FRACTIONS for r in range(int(n * f) - 64, int(n * f))]


def sampled_recall(q: torch.Tensor, k: torch.Tensor, kept_keys: Callable[[int, int, int], torch.Tensor]) -> float:
    """Mean attention mass the kept keys hold over `recall_rows` of every query head (batch 0).

    `kept_keys(head, first_row, stop_row)` is bool `[stop_row - first_row, N]`, the plan's
    keys of those rows; the exact causal softmax is computed in fp32 for those rows.
    """
    n, d = q.shape[2], q.shape[3]
    group = q.shape[1] // k.shape[1]
    rows = torch.tensor(recall_rows(n), device=q.device)
    keys = torch.arange(n, device=q.device)
    total = 0.0
    for h in range(q.shape[1]):
        s = (q[0, h, rows].float() @ k[0, h // group].float().T) / math.sqrt(d)
        s = s.masked_fill(keys[None, :] > rows[:, None], -math.inf)
        p = torch.softmax(s, dim=-1)
        kept = torch.cat([kept_keys(h, int(rows[i]), int(rows[i]) + 64) for i in range(0, len(rows), 64)])
        total += float((p * kept).sum(-1).mean())
    return total / q.shape[1]


def plan_kept_keys(plan: Any) -> Callable[[int, int, int], torch.Tensor]:
    """`kept_keys` of a BlockColumnPlan (batch 0; rows of one call inside one query block
    or a few whole ones)."""
    n, bm, bn = plan.seqlen, plan.block_m, plan.block_n

    def kept(h: int, start: int, stop: int) -> torch.Tensor:
        out = []
        for r in range(start, stop):
            i = r // bm
            mask = torch.zeros(plan.num_key_blocks * bn + 1, dtype=torch.bool, device=plan.device)
            blocks = plan.block_index[0, h, i, : int(plan.block_count[0, h, i])].long()
            mask[:-1].view(-1, bn)[blocks] = True
            group = getattr(plan, "column_group", 1)
            cols = plan.column_index[0, h, i // group, : int(plan.column_count[0, h, i])].long()
            mask[cols] = True
            out.append(mask[:n])
        return torch.stack(out)

    return kept


def stage_rows(n: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dense: torch.Tensor,
               log: Callable[[str], None], methods: list[str] | None = None) -> list[dict[str, Any]]:
    """Every method's plan and stages at N (whatever this version of the package has)."""
    import importlib

    from sparseprefill import fast
    from sparseprefill.methods import METHODS
    from sparseprefill.fast.kernels import block_column_attention

    # The modules (`sparseprefill.fast.xattention` is also the name of a function there).
    fx = importlib.import_module("sparseprefill.fast.xattention")
    ff = importlib.import_module("sparseprefill.fast.flexprefill_vs")

    rows: list[dict[str, Any]] = []

    def add(method: str, stage: str, fn: Callable[[], Any], **extra: Any) -> None:
        t0 = time.perf_counter()
        try:
            ms = _ms(fn)
        except Exception as exc:  # noqa: BLE001 - a failing stage is one row
            log(f"N={n} {method} {stage}: {type(exc).__name__}: {str(exc)[:200]}")
            return
        rows.append({"seqlen": n, "method": method, "stage": stage, "ms": ms, **extra})
        # Density, error and recall in the log too: a run cut short still leaves them there.
        quality = " ".join(f"{f}={extra[f]:.4g}" for f in ("density", "rel_err", "recall") if f in extra)
        log(f"N={n} {method:28s} {stage:30s} {ms:9.3f} ms  ({time.perf_counter() - t0:.1f}s) {quality}")

    def plan_row(method: str, plan_fn: Callable[[], Any], run_fn: Callable[[], torch.Tensor] | None,
                 recall: bool = False) -> Any:
        plan = plan_fn()
        extra: dict[str, Any] = {"plan_hash": _plan_hash(plan), "density": float(fast.density(plan).mean()),
                                 "syncs": _syncs(plan_fn)}
        if run_fn is not None:
            extra["rel_err"] = _rel_err(run_fn(), dense)
        if recall:
            extra["recall"] = sampled_recall(q, k, plan_kept_keys(plan))
        add(method, "plan", plan_fn, **extra)
        add(method, "kernel", lambda: block_column_attention(q, k, v, plan, validate_plan=False))
        return plan

    def guarded(section: str, fn: Callable[[], None]) -> None:
        if methods and section not in methods:
            return
        if past_deadline():
            log(f"N={n} {section}: skipped (past the deadline)")
            return
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - one failing section leaves the others
            log(f"N={n} {section}: {type(exc).__name__}: {str(exc)[:300]}")

    guarded("dpxa", lambda: _dpxa_rows(q, k, v, fast, add, plan_row, rows))
    guarded("xattention", lambda: _xattention_rows(n, q, k, v, fast, fx, add, plan_row))
    guarded("flexprefill_vs", lambda: _flexprefill_rows(q, k, v, fast, ff, add, plan_row))
    guarded("flexprefill_vs", lambda: _flexprefill_band_rows(q, k, v, fast, ff, add, plan_row))
    for method in ("vertical_slash", "sample_attention", "anchor_attention", "minference", "block_sparse"):
        spec = METHODS[method]
        if spec.fast_plan is None:
            continue
        params = spec.call_params(spec.demo_params(n), q)
        guarded(method, lambda s=spec, p=params: plan_row(
            s.name, lambda: s.fast_plan(q, k, **p), lambda: s.fast_run(q, k, v, **p)))
    return rows


def _xattention_rows(n: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fast: Any, fx: Any,
                     add: Any, plan_row: Any) -> None:
    """XAttention: score (two kernels), select, index; and the plan whole."""
    for stride in (8, 16):
        name = f"xattention s{stride}"
        params = {"stride": stride, "threshold": 0.9, "block": 128}
        plan_row(name, lambda p=params: fast.xattention_plan(q, k, **p),
                 lambda p=params: fast.xattention(q, k, v, **p), recall=True)
        weights = fast.xattention_tile_weights(q, k, stride=stride, block=128)
        add(name, "score", lambda s=stride: fast.xattention_tile_weights(q, k, stride=s, block=128))
        add(name, "select", lambda w=weights: fast.select_tiles(w, 0.9))
        keep = fast.select_tiles(weights, 0.9)
        add(name, "index", lambda kp=keep: fx.tiles_to_plan(kp, seqlen=n, block=128))
        if hasattr(fx, "select_plan"):
            add(name, "select+index (one kernel)", lambda w=weights: fx.select_plan(w, 0.9, seqlen=n, block=128))
        del weights, keep



def _dpxa_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fast: Any, add: Any, plan_row: Any,
               rows: list[dict[str, Any]]) -> None:
    """DPXA: anchors, anchor-pair scores, select."""
    from sparseprefill.fast.kernels import delta_score

    name = "dpxa cos0.75"
    plan_row(name, lambda: fast.dpxa_plan(q, k), lambda: fast.dpxa(q, k, v), recall=True)
    anchors = getattr(delta_score, "delta_anchor_packed", None) or delta_score.delta_anchor_lists
    add(name, "anchors (q and k)", lambda: (anchors(q, cos_threshold=0.75, block=128),
                                            anchors(k, cos_threshold=0.75, block=128)))
    add(name, "score (anchors + pairs)", lambda: fast.dpxa_tile_weights(q, k))
    weights = fast.dpxa_tile_weights(q, k)
    add(name, "select", lambda: fast.select_tiles(weights, 0.9))
    ratio = float(fast.dpxa_scoring_ratio(q, k).mean())
    rows[-1]["scoring_ratio"] = ratio
    del weights
    # Higher thresholds, for DPXA against XAttention stride 8 at equal recall (the scoring
    # is the same at every threshold; only the selection and the recall change).
    for tau in DPXA_THRESHOLDS:
        plan_row(f"dpxa cos0.75 t{tau}", lambda t=tau: fast.dpxa_plan(q, k, threshold=t),
                 None, recall=True)


DPXA_THRESHOLDS = (0.95, 0.99)


def _flexprefill_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fast: Any, ff: Any, add: Any,
                      plan_row: Any) -> None:
    """FlexPrefill-style vertical-slash: estimate, lines, padded lines, index."""
    from sparseprefill.fast.kernels.last_q_estimate import last_q_scores

    for gamma in (0.9, 0.95):
        name = f"flexprefill_vs g{gamma}"
        lines = {"line_block": 1} if "line_block" in inspect.signature(fast.flexprefill_vs_plan).parameters else {}
        plan_row(name, lambda g=gamma: fast.flexprefill_vs_plan(q, k, gamma=g, **lines),
                 lambda g=gamma: fast.flexprefill_vs(q, k, v, gamma=g, **lines), recall=True)
        add(name, "estimate (last_q_scores)", lambda: last_q_scores(q, k, last_q=64))
        add(name, "lines (estimate + cover)", lambda g=gamma: ff.flexprefill_vs_lines(q, k, gamma=g, **lines))
        ver, sla = ff.flexprefill_vs_lines(q, k, gamma=gamma, **lines)
        add(name, "padded lines", lambda a=ver, b=sla: (ff.padded_lines(a), ff.padded_lines(b)))
        add(name, "index (lines_index)", lambda a=ver, b=sla: ff.lines_index(a, b))
        del ver, sla


# Line granularity variants (issue 22): (line_block, block_m = block_n) at each gamma.
BAND_CONFIGS = ((128, 64), (128, 128))
BAND_GAMMAS = (0.9, 0.95)
# The default is (128, 64). The 2026-11-25 32K run also timed (64, 64) and gamma 0.85
# (docs/flexprefill_vs.md); the session-3 run timed (128, 128) only.


def _flexprefill_band_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fast: Any, ff: Any, add: Any,
                           plan_row: Any) -> None:
    """flexprefill_vs with lines in bands (`line_block`), where this version has it."""
    if "line_block" not in inspect.signature(fast.flexprefill_vs_plan).parameters:
        return
    for lb, blk in BAND_CONFIGS:
        for gamma in BAND_GAMMAS:
            p = {"gamma": gamma, "line_block": lb, "block_m": blk, "block_n": blk}
            name = f"flexprefill_vs g{gamma} lb{lb} b{blk}"
            plan_row(name, lambda p=p: fast.flexprefill_vs_plan(q, k, **p),
                     lambda p=p: fast.flexprefill_vs(q, k, v, **p), recall=True)
            lp = {"gamma": gamma, "line_block": lb}
            add(name, "lines (estimate + cover)", lambda lp=lp: ff.flexprefill_vs_lines(q, k, **lp))
            ver, sla = ff.flexprefill_vs_lines(q, k, **lp)
            add(name, "index (lines_index)",
                lambda a=ver, b=sla, lb=lb, blk=blk: ff.lines_index(a, b, block_m=blk, block_n=blk, line_block=lb))
            del ver, sla


def peer_rows(n: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dense: torch.Tensor, peer: str,
              log: Callable[[str], None]) -> list[dict[str, Any]]:
    """FlexPrefill's own code (a scratch copy of MInference's port), same inputs."""
    sys.path.insert(0, os.path.abspath(peer))
    from minference.modules import flexprefill as fp  # type: ignore[import-not-found]

    rows: list[dict[str, Any]] = []
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    for gamma in (0.9, 0.95):
        def e2e(g: float = gamma) -> torch.Tensor:
            return fp.flex_prefill_attention(qt, kt, vt, g, 0.1, block_size=128)  # type: ignore[no-any-return]

        def est(g: float = gamma) -> Any:
            return fp.get_active_blocks(qt, kt, vt, 128, g, 1, math.ceil(n / 128), 0.1, False)

        try:
            out = e2e().transpose(1, 2)
            # Its plan: per (batch, head) the unique entries `row block * T + column block`.
            tiles = (n + 127) // 128
            entries = est()
            kept = sum(int(((e // tiles) >= (e % tiles)).sum()) for per_b in entries for e in per_b)
            density = kept / (q.shape[1] * tiles * (tiles + 1) / 2)

            def peer_keys(h: int, start: int, stop: int, e: Any = entries) -> torch.Tensor:
                mine = e[0][h].long()
                out = []
                for r in range(start, stop):
                    cols = mine[(mine // tiles) == r // 128] % tiles
                    mask = torch.zeros(tiles * 128, dtype=torch.bool, device=q.device)
                    mask.view(tiles, 128)[cols] = True
                    out.append(mask[:n])
                return torch.stack(out)

            recall = sampled_recall(q, k, peer_keys)
            for stage, fn in (("end to end", e2e), ("estimate (get_active_blocks)", est)):
                ms = _ms(fn)
                row = {"seqlen": n, "method": f"FlexPrefill (MInference port) g{gamma}", "stage": stage, "ms": ms}
                if stage == "end to end":
                    row["rel_err"] = _rel_err(out, dense)
                    row["density"] = density
                    row["recall"] = recall
                rows.append(row)
                log(f"N={n} peer g{gamma} {stage}: {ms:.3f} ms density={density:.4g} "
                    f"rel_err={row.get('rel_err', float('nan')):.4g} recall={recall:.4g}")
        except Exception as exc:  # noqa: BLE001
            log(f"N={n} peer g{gamma}: {type(exc).__name__}: {str(exc)[:300]}")
    return rows


def variant_rows(n: int, q: torch.Tensor, k: torch.Tensor, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The XAttention scoring kernel at other tile configurations and program orders (after only)."""
    from sparseprefill.fast.kernels import xattention_score as xs

    rows: list[dict[str, Any]] = _dpxa_variant_rows(n, q, k, log)

    def time_scoring(label: str, stride: int) -> None:
        # One variant's tile weights at one stride; a variant that fails (e.g. to compile) is logged.
        try:
            ms = _ms(lambda: xs.xattention_tile_weights(q, k, stride=stride, block=128))
        except Exception as exc:  # noqa: BLE001
            log(f"variant {label} s{stride}: {type(exc).__name__}: {str(exc)[:200]}")
            return
        rows.append({"seqlen": n, "method": f"xattention s{stride}", "stage": label, "ms": ms})
        log(f"N={n} xattention s{stride} {label}: {ms:.3f} ms")

    default, order = xs.SCORE_CONFIGS, getattr(xs, "LONGEST_FIRST", None)
    orders = (False, True) if order is not None else (None,)
    for config in XATTENTION_VARIANTS:
        xs.SCORE_CONFIGS = (config,)
        for longest in orders:
            if longest is not None:
                xs.LONGEST_FIRST = longest
            label = f"score {config}" + (" longest first" if longest else "")
            for stride in (8, 16):
                if past_deadline():
                    break
                time_scoring(label, stride)
    xs.SCORE_CONFIGS = default
    if order is not None:
        xs.LONGEST_FIRST = order
    if hasattr(xs, "KEY_SPLIT_STEPS"):
        # Each row block's key range over several programs launched together (shared Q in L2).
        split_default = xs.KEY_SPLIT_STEPS
        for steps in (2, 4, 8):
            xs.KEY_SPLIT_STEPS = steps
            for stride in (8, 16):
                if past_deadline():
                    break
                time_scoring(f"score {default[0]} key split {steps} steps", stride)
        xs.KEY_SPLIT_STEPS = split_default
    return rows


# XAttention scoring configurations timed by `--variants`, each in both program orders,
# before the key splits. The 2026-11-25 32K run timed (128, 128, 8, 3), (64, 64, 4, 2),
# (128, 256, 8, 2) and (256, 128, 8, 2) (docs/xattention.md); pass them here to time them again.
XATTENTION_VARIANTS: tuple[tuple[int, int, int, int], ...] = ()
# DPXA scoring configurations (`delta_score.SCORE_CONFIG`: query tiles per program, Q
# anchors per step, K anchors per step, key tiles per program (0: all), flat loop, warps,
# stages), each with TQ fixed (no halving). Session 3 timed the first four with 0 key
# tiles; session 4's (benches/estimator_shares.py, DPXA_CONFIGS) are in docs/xattention.md.
DPXA_VARIANTS: tuple[tuple[int, int, int, int, bool, int, int], ...] = (
    (64, 64, 32, 0, False, 4, 2), (32, 64, 32, 0, False, 4, 2), (64, 64, 64, 0, False, 4, 2),
    (64, 32, 32, 0, False, 4, 2), (32, 32, 64, 32, False, 4, 2))


def _dpxa_variant_rows(n: int, q: torch.Tensor, k: torch.Tensor, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """DPXA's scoring kernel at other tile configurations (where this version has them)."""
    from sparseprefill import fast
    from sparseprefill.fast.kernels import delta_score as ds

    rows: list[dict[str, Any]] = []
    if not hasattr(ds, "SCORE_CONFIG"):
        return rows
    default, min_programs = ds.SCORE_CONFIG, ds.MIN_PROGRAMS
    ds.MIN_PROGRAMS = 0
    try:
        for config in DPXA_VARIANTS:
            if past_deadline():
                break
            ds.SCORE_CONFIG = config
            label = f"score {config}"
            try:
                ms = _ms(lambda: fast.dpxa_tile_weights(q, k))
            except Exception as exc:  # noqa: BLE001
                log(f"variant dpxa {label}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            rows.append({"seqlen": n, "method": "dpxa cos0.75", "stage": label, "ms": ms})
            log(f"N={n} dpxa cos0.75 {label}: {ms:.3f} ms")
    finally:
        ds.SCORE_CONFIG, ds.MIN_PROGRAMS = default, min_programs
    return rows


def capture_rows(log: Callable[[str], None]) -> list[dict[str, Any]]:
    """nosync + CUDA-graph capture and replay of every `_static` op (compile_check's checks),
    the ones `SYNC` still marks unsafe (sample_attention, minference) included."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import compile_check as cc  # type: ignore[import-not-found]
    from sparseprefill.methods import METHODS
    from sparseprefill.fast import ops

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(1, h, 8192, 64, generator=gen, device=dev, dtype=torch.bfloat16) for h in (8, 2, 2))
    for name in sorted(METHODS):
        if f"{name}_static" not in ops._OPS:
            continue
        op = ops.method_op(name, static=True)
        spec = METHODS[name]
        params = ops.op_params(name, spec.call_params(spec.demo_params(8192), q))

        def run(op: Any = op, params: dict[str, Any] = params) -> torch.Tensor:
            return op(q, k, v, **params)  # type: ignore[no-any-return]

        cc.check_nosync(f"{name}_static", run)
        cc.check_graph("graph", f"{name}_static", run, (q, k, v), True)
    return [dict(r) for r in cc.RESULTS]


def sanitize() -> int:
    """The kernels issue 22 added or changed, once each at small sizes (B = 2, GQA, N = 1000)."""
    from sparseprefill import fast
    from sparseprefill.fast.kernels.tile_select import select_tile_lists

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 1000, 64, generator=gen).to("cuda", torch.float16) for h in (8, 2, 2))
    outs = {
        "dpxa": fast.dpxa(q, k, v, block=64),
        "dpxa cos 1": fast.dpxa(q, k, v, cos_threshold=1.0, block=48),
        "xattention s8": fast.xattention(q, k, v, stride=8, block=64),
        "xattention s16": fast.xattention(q, k, v, stride=16, block=128),
        "sample_attention": fast.sample_attention(q, k, v, block_size=64, chunk_n=3),
        "select": select_tile_lists(fast.dpxa_tile_weights(q, k, block=16), 0.9)[2],
    }
    torch.cuda.synchronize()
    for name, out in outs.items():
        print(f"{name:18s} finite={bool(torch.isfinite(out.float()).all())}", flush=True)
    return 0


def merge(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One table: per (N, method, stage) the before and after ms and their shares of cuDNN."""
    dense = {r["seqlen"]: r["ms"] for r in after["rows"] if r["method"] == "cuDNN SDPA"}
    dense_b = {r["seqlen"]: r["ms"] for r in before["rows"] if r["method"] == "cuDNN SDPA"}
    keyed_b = {(r["seqlen"], r["method"], r["stage"]): r for r in before["rows"]}
    keyed_a = {(r["seqlen"], r["method"], r["stage"]): r for r in after["rows"]}
    table = []
    for key in sorted(set(keyed_a) | set(keyed_b), key=lambda t: (t[0], t[1], t[2] != "plan", t[2])):
        b, a = keyed_b.get(key), keyed_a.get(key)
        n = key[0]
        row: dict[str, Any] = {"seqlen": n, "method": key[1], "stage": key[2],
                               "before_ms": b["ms"] if b else None, "after_ms": a["ms"] if a else None}
        if b and n in dense_b:
            row["before_share"] = b["ms"] / dense_b[n]
        if a and n in dense:
            row["after_share"] = a["ms"] / dense[n]
        for field in ("density", "syncs", "rel_err", "recall", "scoring_ratio"):
            for tag, r in (("before", b), ("after", a)):
                if r and field in r:
                    row[f"{tag}_{field}"] = r[field]
        if b and a and "plan_hash" in b and "plan_hash" in a:
            row["same_plan"] = b["plan_hash"] == a["plan_hash"]
        table.append(row)
    return {"environment": after.get("environment"), "before_environment": before.get("environment"),
            "cudnn_ms": dense, "cudnn_ms_before_run": dense_b, "rows": table,
            "capture": after.get("capture", [])}


def _num(row: dict[str, Any], field: str) -> str:
    x = row.get(f"after_{field}", row.get(f"before_{field}"))
    return "-" if x is None else f"{x:.4g}"


def format_table(merged: dict[str, Any]) -> str:
    lines = ["| N | method | stage | before ms | after ms | before / cuDNN | after / cuDNN | same plan "
             "| density | output error | recall |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]

    def f(x: Any, pct: bool = False) -> str:
        if x is None:
            return "-"
        return f"{100 * x:.1f}%" if pct else f"{x:.2f}"

    for r in merged["rows"]:
        same = r.get("same_plan")
        lines.append(f"| {r['seqlen']} | {r['method']} | {r['stage']} | {f(r['before_ms'])} | {f(r['after_ms'])} | "
                     f"{f(r.get('before_share'), True)} | {f(r.get('after_share'), True)} | "
                     f"{'-' if same is None else ('yes' if same else 'NO')} | "
                     f"{_num(r, 'density')} | {_num(r, 'rel_err')} | {_num(r, 'recall')} |")
    return "\n".join(lines)


def _load_runs(paths: str) -> dict[str, Any]:
    """One run's JSON, or several (comma-separated, e.g. one per N) joined: rows in order."""
    joined: dict[str, Any] = {"rows": []}
    for path in paths.split(","):
        if not os.path.exists(path):
            continue
        with open(path) as f:
            run = json.load(f)
        joined.setdefault("environment", run.get("environment"))
        joined["rows"] += run["rows"]
        joined["capture"] = joined.get("capture", []) + run.get("capture", [])
    return joined


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="*", default=[32768, 131072])
    parser.add_argument("--tag", default="after")
    parser.add_argument("--json", default=None)
    parser.add_argument("--cache", default="/tmp/estimator_stages")
    parser.add_argument("--peer", default=None, help="folder holding a scratch copy of MInference's modules")
    parser.add_argument("--variants", action="store_true", help="time XAttention scoring tile configurations")
    parser.add_argument("--capture", action="store_true", help="nosync and CUDA-graph checks of the _static ops")
    parser.add_argument("--sanitize", action="store_true",
                        help="run the kernels issue 22 changed once at N = 1000 (under compute-sanitizer)")
    parser.add_argument("--merge", nargs=2, default=None, metavar=("BEFORE", "AFTER"))
    parser.add_argument("--methods", nargs="*", default=None,
                        help="sections to time (xattention, dpxa, flexprefill_vs, vertical_slash, ...); all if omitted")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--deadline", type=float, default=math.inf,
                        help="time.time() after which no new section starts (a device call's budget)")
    args = parser.parse_args(argv)
    global DEADLINE
    DEADLINE = args.deadline

    if args.merge:
        after_run = _load_runs(args.merge[1])
        # "none": an after-only run (e.g. the D = 64 rows)
        before_run = {"rows": []} if args.merge[0] == "none" else _load_runs(args.merge[0])
        merged = merge(before_run, after_run)
        if args.json:
            with open(args.json, "w") as out:
                json.dump(merged, out, indent=1)
        print(format_table(merged))
        for r in merged["capture"]:
            print(f"{r['check']:8s} {r['method']:28s} {r['status']:4s} {r['detail']}")
        return 0

    def log(line: str) -> None:
        print(f"[{args.tag}] {line}", flush=True)

    if args.sanitize:
        return sanitize()

    import sparseprefill

    dev = torch.device("cuda")
    env = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "package": os.path.dirname(sparseprefill.__file__), "tag": args.tag, "head_dim": args.head_dim}
    log(str(env))
    rows: list[dict[str, Any]] = []
    for n in args.seqlens:
        if past_deadline():
            log(f"N={n}: skipped (past the deadline)")
            continue
        q, k, v = workload(n, dev, args.cache, head_dim=args.head_dim)
        ms, dense = cudnn_ms(q, k, v)
        rows.append({"seqlen": n, "method": "cuDNN SDPA", "stage": "dense", "ms": ms})
        log(f"N={n} cuDNN SDPA dense {ms:.3f} ms")
        with torch.no_grad():
            rows += stage_rows(n, q, k, v, dense, log, args.methods)
            if args.variants and not past_deadline():
                rows += variant_rows(n, q, k, log)
            if args.peer and not past_deadline():
                rows += peer_rows(n, q, k, v, dense, args.peer, log)
        del q, k, v, dense
        torch.cuda.empty_cache()
        if args.json:  # after every N, so a run cut short still leaves its rows
            with open(args.json, "w") as out:
                json.dump({"environment": env, "rows": rows}, out, indent=1)
    result: dict[str, Any] = {"environment": env, "rows": rows}
    if args.capture:
        result["capture"] = capture_rows(log)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
