"""Every registered method at 512K and 1M tokens on one GPU: time and peak memory per stage.

Scale as load (issue 26): B = 1, 32 query / 8 KV heads, D = 128, bf16, each method of
the registry (`sparseprefill.methods`, no list here) at its default parameters
(`Method.demo_params(N)`). Stages, each timed once (CUDA-synchronised wall time, after a
compile run at `--warmup-seqlen`) with `torch.cuda.reset_peak_memory_stats` before it:

* plan-based methods: `plan` (`fast.<m>_plan`: estimate, selection, block lists) and
  `kernel` (`fast.sparse_attention` on that plan);
* methods without a plan (Delta-KV, DeltaXAttention): `run` (`fast.<m>`, end to end);
* a plan that refuses (all heads' plan at once does not fit): `run` as well, the method's
  end-to-end function, which may plan its heads in groups that fit (AnchorAttention).

Per stage: seconds, peak allocated GiB (`torch.cuda.max_memory_allocated`) and the peak
above what was allocated when the stage began (q, k, v and, for the kernel, the plan).
A method that cannot run refuses before allocating (`MemoryError` from
`fast.kernels.check_device_memory`, naming what it needs): recorded as `refused` with
its message. A CUDA out-of-memory error instead would be a bug (recorded as `oom`).

q, k, v come from `device_qkv`: built on the GPU in seconds (the demo's float64 CPU
generator would take minutes and ~100 GB of host memory at 1M), with the same
ingredients as `demo.synthetic_qkv`: attention sinks, vertical stripes, a local
rotary bump, periodic slashes, runs of similar keys, Gaussian noise.

    python benches/scale_run.py --json $OUT/scale.json [--seqlens 524288,1048576]
        [--methods dense,xattention] [--budget-s 200] [--method-limit-s 40]

`--budget-s` stops starting new work when that much wall time has passed (results so
far are kept; the JSON is rewritten after every stage); `--method-limit-s` skips a
method's longer lengths when its previous length took more than a quarter of it (each
stage is at least linear in N, the dense kernel quadratic).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

GIB = 2.0**30


def device_qkv(seqlen: int, *, q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
               dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda",
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v `[1, H, N, D]` with sinks, vertical stripes, a local bump, slashes and key runs.

    Scaled logits (`q.k / sqrt(D)`): the first 4 keys +8 (sinks); about N/100 random keys
    +1 to +6 (verticals); a rotary bump of width about N/40 around `j = i` (+3 at its
    peak); periodic diagonals `i - j = P, 2P, ...` (+2, P = N/10); noise. Keys drift in
    runs of 1 to 16 positions (consecutive keys share a component), so Delta-KV and
    DeltaXAttention find anchors standing for several keys. Built in float32 on the
    device, then cast.
    """
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    n, d, root = seqlen, head_dim, math.sqrt(head_dim)
    f32 = torch.float32
    q = torch.randn(1, q_heads, n, d, generator=gen, device=dev, dtype=f32) * 0.3
    k = torch.randn(1, kv_heads, n, d, generator=gen, device=dev, dtype=f32) * 0.3
    v = torch.randn(1, kv_heads, n, d, generator=gen, device=dev, dtype=f32)
    pos = torch.arange(n, device=dev, dtype=f32)
    # Runs of similar keys: a shared component per run (run ids from random cut points).
    cuts = torch.rand(n, generator=gen, device=dev) < 1.0 / 8
    run_id = torch.cumsum(cuts.to(torch.int64), 0)
    run_vec = torch.randn(int(run_id[-1]) + 1, d, generator=gen, device=dev, dtype=f32) * 0.6
    k = k * 0.5 + run_vec[run_id].view(1, 1, n, d)
    # Sinks (dim 0): q_0 k_0 / root = 8 on the first 4 keys.
    amp = math.sqrt(8.0 * root)
    q[..., 0] = amp
    k[..., :4, 0] = amp
    k[..., 4:, 0] = 0.0
    # Verticals (dim 1): about N/100 keys at +1 .. +6.
    cols = torch.randint(4, n, (max(1, n // 100),), generator=gen, device=dev)
    q[..., 1] = math.sqrt(root)
    k[..., 1] = 0.0
    k[..., cols, 1] = (1.0 + 5.0 * torch.rand(cols.numel(), generator=gen, device=dev)) * math.sqrt(root)
    # Local bump (dims 2..9): 4 rotary pairs of wavelengths N/40 .. N/5, peak +3.
    a = math.sqrt(3.0 * root / 4)
    for j, frac in enumerate((40.0, 20.0, 10.0, 5.0)):
        w = 2 * math.pi / max(1.0, n / frac) / 4
        q[..., 2 + 2 * j], q[..., 3 + 2 * j] = a * torch.cos(w * pos), a * torch.sin(w * pos)
        k[..., 2 + 2 * j], k[..., 3 + 2 * j] = a * torch.cos(w * pos), a * torch.sin(w * pos)
    # Slashes (dims 10, 11): period N/10, +2.
    w = 2 * math.pi / max(1.0, n / 10)
    b_amp = math.sqrt(2.0 * root)
    q[..., 10], q[..., 11] = b_amp * torch.cos(w * pos), b_amp * torch.sin(w * pos)
    k[..., 10], k[..., 11] = b_amp * torch.cos(w * pos), b_amp * torch.sin(w * pos)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _sync() -> None:
    torch.cuda.synchronize()


def _stage(fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """Run `fn` once: (its result, {s, peak_gib, above_gib, status, error})."""
    _sync()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out: Any = None
    rec: dict[str, Any] = {"status": "ok"}
    try:
        out = fn()
        _sync()
    except torch.cuda.OutOfMemoryError as err:
        rec = {"status": "oom", "error": str(err).splitlines()[0][:300]}
    except MemoryError as err:
        rec = {"status": "refused", "error": str(err)[:400]}
    rec["s"] = round(time.perf_counter() - t0, 4)
    rec["peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 3)
    rec["above_gib"] = round((torch.cuda.max_memory_allocated() - base) / GIB, 3)
    return out, rec


def run_method(method: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> dict[str, Any]:
    """The stages of one method at q's length (see the module doc)."""
    from sparseprefill import fast

    n = q.shape[2]
    params = method.call_params(method.demo_params(n), q)
    shown = {key: val for key, val in method.demo_params(n).items() if isinstance(val, (int, float, str, bool))}
    stages: dict[str, Any] = {}
    if method.plan_based:
        plan, stages["plan"] = _stage(lambda: method.plan_fn("fast")(q, k, **params))
        if plan is not None:
            scale = params.get("scale")
            _, stages["kernel"] = _stage(lambda: fast.sparse_attention(q, k, v, plan, scale=scale))
            stages["plan_gib"] = round(plan.nbytes() / GIB, 3) if hasattr(plan, "nbytes") else None
            stages["density"] = round(float(fast.density(plan).mean()), 4)
        del plan
        if stages["plan"]["status"] == "refused":
            # The whole plan of every head at once does not fit; the end-to-end function
            # may still run (AnchorAttention's plans its heads in groups that fit).
            torch.cuda.empty_cache()
            _, stages["run"] = _stage(lambda: method.run_fn("fast")(q, k, v, **params))
    else:
        _, stages["run"] = _stage(lambda: method.run_fn("fast")(q, k, v, **params))
    torch.cuda.empty_cache()
    return {"params": shown, **stages}


def _total_s(rec: dict[str, Any]) -> float:
    return sum(float(s["s"]) for key, s in rec.items() if isinstance(s, dict) and "s" in s)


def _status(rec: dict[str, Any]) -> str:
    run = rec.get("run")
    if isinstance(run, dict) and run.get("status") == "ok" and "plan" in rec:
        return "ok (end to end; the whole plan refused)"
    bad = [s["status"] for key, s in rec.items() if isinstance(s, dict) and s.get("status", "ok") != "ok"]
    return bad[0] if bad else "ok"


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| method | N | plan / run s | plan / run peak GiB (above inputs) | kernel s | kernel peak GiB "
             "(above inputs + plan) | density | status |", "| --- " * 8 + "|"]
    for r in results:
        first = r.get("run") or r.get("plan") or {}
        kern = r.get("kernel") or {}
        k_s = f"{kern['s']:.3f}" if kern else "-"
        k_mem = f"{kern['peak_gib']:.2f} ({kern['above_gib']:.2f})" if kern else "-"
        status = r.get("status", "ok")
        if not status.startswith("ok"):
            status += ": " + next((s["error"] for s in r.values() if isinstance(s, dict) and "error" in s), "")[:160]
        lines.append(f"| {r['method']} | {r['seqlen'] // 1024}K | {first.get('s', float('nan')):.3f} | "
                     f"{first.get('peak_gib', float('nan')):.2f} ({first.get('above_gib', float('nan')):.2f}) | "
                     f"{k_s} | {k_mem} | {r.get('density', '-')} | {status} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", default="524288,1048576")
    parser.add_argument("--methods", default="", help="comma-separated subset of the registry (default: all)")
    parser.add_argument("--warmup-seqlen", type=int, default=16384, help="0: no warm-up (times include compiles)")
    parser.add_argument("--budget-s", type=float, default=1e9)
    parser.add_argument("--method-limit-s", type=float, default=60.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)

    from sparseprefill.bench import environment
    from sparseprefill.methods import methods

    t_start = time.perf_counter()
    registry = methods()
    names = [m for m in args.methods.split(",") if m] or list(registry)
    seqlens = [int(s) for s in args.seqlens.split(",") if s]
    results: list[dict[str, Any]] = []
    payload: dict[str, Any] = {"environment": environment(), "device": torch.cuda.get_device_name(),
                               "total_gib": round(torch.cuda.get_device_properties(0).total_memory / GIB, 2),
                               "shape": {"batch": 1, "q_heads": 32, "kv_heads": 8, "head_dim": 128,
                                         "dtype": "bfloat16"},
                               "seqlens": seqlens, "results": results, "skipped": []}

    def save() -> None:
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(payload, fh, indent=1)

    # Compile every method's kernels once at a small length (0: no warm-up; the first
    # call of each stage then includes its compiles, peaks are unchanged).
    if args.warmup_seqlen > 0:
        q, k, v = device_qkv(args.warmup_seqlen)
        for name in names:
            try:
                run_method(registry[name], q, k, v)
            except Exception as err:  # recorded; the long runs below say the same
                print(f"warmup {name}: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        del q, k, v
        print(f"warmup done in {time.perf_counter() - t_start:.1f} s", flush=True)
    payload["warmup_seqlen"] = args.warmup_seqlen
    last_total: dict[str, float] = {}
    for n in seqlens:
        torch.cuda.empty_cache()
        q, k, v = device_qkv(n)
        _sync()
        for name in names:
            elapsed = time.perf_counter() - t_start
            if elapsed > args.budget_s:
                payload["skipped"].append({"method": name, "seqlen": n, "why": f"budget ({elapsed:.0f} s)"})
                continue
            prev = last_total.get(name)
            if prev is not None and prev > args.method_limit_s / 4:
                payload["skipped"].append({"method": name, "seqlen": n,
                                           "why": f"{prev:.1f} s at the previous length (limit "
                                                  f"{args.method_limit_s:.0f} s)"})
                continue
            try:
                rec = run_method(registry[name], q, k, v)
            except Exception as err:
                rec = {"error": f"{type(err).__name__}: {str(err)[:300]}", "status": "error"}
            rec = {"method": name, "seqlen": n, **rec}
            rec.setdefault("status", _status(rec))
            last_total[name] = _total_s(rec)
            results.append(rec)
            save()
            print(f"{name:18s} N={n:>8d} {rec['status']:8s} {last_total[name]:7.2f} s  "
                  + "  ".join(f"{key} {s['s']:.3f}s {s['peak_gib']:.1f}GiB"
                              for key, s in rec.items() if isinstance(s, dict) and "s" in s), flush=True)
        del q, k, v
    save()
    print(table(results))
    for s in payload["skipped"]:
        print(f"skipped {s['method']} at {s['seqlen']}: {s['why']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
