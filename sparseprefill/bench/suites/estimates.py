"""`estimates`: every method's `*_plan` as a share of cuDNN SDPA dense, and where its time goes.

Per N on the selected workload: the baseline, then each plan-based method's `fast` plan at
its defaults (`plan_ms`, its share of the baseline in `extra["share"]`), with:

* its stages: every function of `sparseprefill.fast` / `.reference` the plan calls,
  timed inside one call (`common.StageTree`: CUDA-event spans on a GPU, the wall clock on
  a CPU; inclusive times per call path, the top `--stage-depth` levels kept);
* its host synchronisations (torch's sync debug mode; GPU only);
* a hash of its block and column lists (equal hashes, equal plans: runs of two versions
  compare plans as well as times);
* its floor where its suite module gives one (`estimate_floor(params, q, k, dense_ms)`:
  XAttention's strided products, `dense / (2 S)`; DPXA's anchor pairs).

A method without a plan (its attention reads packed keys) has no `*_plan` and no row.
"""

from __future__ import annotations

import hashlib
from typing import Any

from ..common import (
    Context,
    Option,
    Row,
    Suite,
    Unit,
    baseline_unit,
    method_hook,
    params_text,
    piece,
    stage_tree,
)


def plan_hash(plan: Any) -> str:
    """A short hash of a plan's lists (entries past a row's count are padding: zeroed, cut to the
    widest row), equal for equal plans."""
    import torch

    h = hashlib.sha256()
    for name in ("block_count", "block_index", "column_count", "column_index"):
        t = getattr(plan, name)
        count = plan.block_count if name.startswith("block") else plan.column_count
        if name.endswith("index") and t.shape[:3] == count.shape:
            width = int(count.max()) if count.numel() else 0
            t = t[..., :width]
            valid = torch.arange(width, device=t.device) < count.unsqueeze(-1)
            t = torch.where(valid, t.expand(valid.shape), 0)
        h.update(t.to(torch.int32).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def estimate_rows(ctx: Context, n: int, name: str, depth: int) -> list[Row]:
    from ... import fast
    from ...methods import get
    from ..common import host_syncs

    spec = get(name)
    q, k, _ = ctx.inputs(n)
    params = spec.call_params(spec.demo_params(n), q)
    plan_fn = spec.plan_fn("fast")
    plan = plan_fn(q, k, **params)
    ms = ctx.time(lambda: plan_fn(q, k, **params))
    base = ctx.baseline(n).ms
    with stage_tree(ctx.device) as tree:
        stages = [s for s in tree.measure(lambda: plan_fn(q, k, **params)) if s["depth"] < depth]
    extra: dict[str, Any] = {"params": params_text(params), "share": ms / base, "stages": stages,
                             "host_syncs": host_syncs(lambda: plan_fn(q, k, **params)),
                             "plan_hash": plan_hash(plan), "plan_mb": plan.nbytes() / 2**20}
    floor_fn = method_hook(name, "estimate_floor")
    floor = None if floor_fn is None else floor_fn(params, q, k, base)
    if floor is not None:
        extra.update(estimate_floor_ms=floor, over_estimate_floor=ms / floor)
    row = ctx.row(name, "sparseprefill", n, ms=ms, plan_ms=ms, density=float(fast.density(plan).mean()),
                  extra=extra)
    # A plan alone is no attention: its time is a share of dense (`extra["share"]`), not a speedup.
    row.speedup_vs_cudnn = row.vs_floor = None
    ctx.log(f"N={n}: {name} plan {ms:.3f} ms, {100 * ms / base:.2f}% of dense, {extra['host_syncs']} syncs")
    for s in stages:
        ctx.log(f"    {'  ' * s['depth']}{s['stage'].rsplit(' > ', 1)[-1]:<44} x{s['calls']:<3} "
                f"span {s['span_ms']:8.3f} ms host {s['host_ms']:8.3f} ms")
    return [row]


def units(ctx: Context, seqlens: list[int], *, stage_depth: int = 3) -> list[Unit]:
    from ...methods import get

    names = [name for name in ctx.method_names() if get(name).plan_based]
    skipped = [name for name in ctx.method_names() if not get(name).plan_based]
    if skipped:
        ctx.log(f"estimates: {', '.join(skipped)} make no plan (their attention reads packed keys): no row")
    out: list[Unit] = []
    for n in seqlens:
        out.append(baseline_unit(ctx, n))
        for name in names:
            out.append(piece(ctx, name, n, estimate_rows, ctx, n, name, stage_depth))
    return out


def format_shares(rows: list[Row]) -> str:
    """Plan time as a share of dense, host reads and the largest top-level stages, per row."""
    lines = [f"{'method':<20} {'N':>7} {'plan ms':>9} {'of dense':>8} {'syncs':>5}  largest stages"]
    for r in rows:
        if "share" not in r.extra:
            continue
        top = sorted((s for s in r.extra["stages"] if s["depth"] == 1), key=lambda s: -s["span_ms"])[:3]
        stages = ", ".join(f"{s['stage'].rsplit(' > ', 1)[-1]} {s['span_ms']:.2f}" for s in top)
        syncs = "-" if r.extra["host_syncs"] is None else str(r.extra["host_syncs"])
        lines.append(f"{r.method:<20} {r.seqlen:>7} {r.ms:>9.3f} {r.extra['share']:>8.2%} {syncs:>5}  {stages}")
    return "\n".join(lines)


SUITE = Suite(
    name="estimates",
    about="every method's *_plan as a share of cuDNN dense, its stage split, host reads and plan hash",
    seqlens=(32768, 131072),
    units=units,
    options=(Option("--stage-depth", "stage_depth", int, 3, "estimates: levels of the stage tree kept"),),
    summary=format_shares,
)
