"""Every method's kernel part against `density x cuDNN dense` (issue 21's 1.3x target).

For each N (default 32K and 128K, D = 128, B = 1, 32 / 8 heads, the bench's workload
`discrete_keys.workload`, i.e. `demo.synthetic_qkv`) this times, in one process:

* cuDNN SDPA dense (causal) and our own dense plan on the same kernel;
* for every registered plan-based method at its defaults (`Method.demo_params`): the
  method's `*_plan` once, then the kernel part alone (`block_column_attention` on that
  plan) for every variant of `--variants` (`kernel_variants` switches; a plan without
  columns runs the first variant only, the switches being column switches);
* for the methods without a plan (`delta_kv`, `delta_xattention`), the CUDA time of
  their attention launches (`_block_column_fwd`, torch.profiler, per call) and their
  density from the method's view;
* extra plans from `discrete_keys.method_plans` (`--extra`, e.g. the single-line
  FlexPrefill plan and its block twin).

Per row: density, kernel ms, `ratio` = kernel ms / (density x cuDNN ms) (the target is
<= 1.3), `vs_own_dense` = kernel ms / (density x our dense ms) (what is left once our
dense rate is taken out), `tile_share` = kept pairs / pairs the kernel's tiles compute
(listed blocks count `block_m x block_n`, listed columns `block_m` each), the column
capacity `C` (`column_index.shape[3]`), mean columns per query block, and the mean
number of whole column tiles a program runs unmasked (`COL_SPLIT`'s work).

    python benches/kernel_floor.py --seqlens 32768,131072 \\
        --variants "split:COL_SPLIT=1;nosplit:COL_SPLIT=0" \\
        --extra flexprefill_vs_0.95_lines,blocks_like_flexprefill_vs_0.95_lines --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _ms(fn: Callable[[], Any], warmup: int, rep: int) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def plan_stats(plan: Any, n: int, tile_n: int) -> dict[str, float]:
    """Computed area and column statistics of a plan (device reductions, one host read)."""
    bm, bn = plan.block_m, plan.block_n
    heads = plan.batch * plan.num_heads
    pairs = heads * n * (n + 1) / 2
    blocks = float(plan.block_count.double().sum())
    cap = int(plan.column_index.shape[3])
    out = {"C": cap, "block_m": bm, "block_n": bn, "column_group": int(plan.column_group)}
    if cap:
        cc = plan.column_count
        cols = float(cc.double().sum())
        # Whole column tiles before each query block's first row (the split's unmasked work),
        # 64 query blocks at a time (grouped lists are long).
        o = torch.arange(cap, device=cc.device)
        early_tiles = 0.0
        qb = cc.shape[2]
        for q0 in range(0, qb, 64):
            qi = torch.arange(q0, min(qb, q0 + 64), device=cc.device)
            ci = plan.column_index.index_select(2, qi // plan.column_group)
            early = ((ci <= (qi * bm)[None, None, :, None]) & (o < cc[:, :, q0:q0 + 64, None])).sum(-1)
            early_tiles += float((early // tile_n).double().sum())
        out["mean_columns"] = float(cc.double().mean())
        out["mean_unmasked_col_tiles"] = early_tiles / cc.numel()
    else:
        cols = 0.0
        out["mean_columns"] = 0.0
        out["mean_unmasked_col_tiles"] = 0.0
    computed = blocks * bm * bn + cols * bm
    out["computed_share"] = computed / pairs
    return out


def main(argv: list[str] | None = None) -> int:
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from discrete_keys import method_plans, workload
    from kernel_variants import apply, parse_variants
    from sparseprefill import fast
    from sparseprefill.fast.kernels import block_column_attention
    from sparseprefill.methods import methods

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", default="32768,131072")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--methods", default="", help="comma-separated; default every registered method")
    p.add_argument("--variants", default="default:COL_SPLIT=auto")
    p.add_argument("--extra", default="", help="plans of discrete_keys.method_plans")
    p.add_argument("--cache", default="/tmp")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rep", type=int, default=60)
    p.add_argument("--json", default="/tmp/kernel_floor.json")
    args = p.parse_args(argv)
    variants = parse_variants(args.variants)
    reg = methods()
    names = [m for m in (args.methods.split(",") if args.methods else reg) if m]
    rows: list[dict[str, Any]] = []
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "variants": variants, "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim}

    def write() -> None:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    for n in (int(x) for x in args.seqlens.split(",")):
        q, k, v = workload(n, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                           cache=Path(args.cache))
        g = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

        def cudnn() -> Any:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)

        cudnn_ms = _ms(cudnn, args.warmup, args.rep)
        del ke, ve
        torch.cuda.empty_cache()
        apply(dict(variants[0][1]))
        dense_plan = fast.dense_plan(q, k)
        own_dense = _ms(lambda: block_column_attention(q, k, v, dense_plan, validate_plan=False),
                        args.warmup, args.rep)
        del dense_plan
        print(f"N={n}: cuDNN {cudnn_ms:.3f} ms, our dense {own_dense:.3f} ms ({cudnn_ms / own_dense:.3f}x)",
              flush=True)
        rows.append({"plan": "cuDNN SDPA", "seqlen": n, "kernel_ms": cudnn_ms, "own_dense_ms": own_dense})

        def record(name: str, plan: Any, kind: str) -> None:
            dens = float(fast.density(plan).mean())
            tile_n = math.gcd(plan.block_n, 128)
            stats = plan_stats(plan, n, tile_n)
            has_cols = stats["C"] > 0
            first: torch.Tensor | None = None
            for vname, sets in (variants if has_cols else variants[:1]):
                apply(dict(sets))
                plan.__dict__.pop("_resolved_columns", None)
                try:
                    out, _ = block_column_attention(q, k, v, plan, validate_plan=False)
                    torch.cuda.synchronize()
                    ms = _ms(lambda: block_column_attention(q, k, v, plan, validate_plan=False),
                             args.warmup, args.rep)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    print(f"N={n} {name} {vname}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                bad = int((~torch.isfinite(out)).sum())
                if first is None:
                    first, diff = out, 0.0
                else:
                    diff = float((out.float() - first.float()).norm() / first.float().norm().clamp(min=1e-30))
                    del out
                row = {"plan": name, "kind": kind, "variant": vname, "seqlen": n, "density": dens,
                       "kernel_ms": ms, "cudnn_ms": cudnn_ms, "own_dense_ms": own_dense,
                       "ratio": ms / (dens * cudnn_ms), "vs_own_dense": ms / (dens * own_dense),
                       "nonfinite": bad, "rel_diff_vs_first_variant": diff, **stats}
                row["tile_share"] = dens / stats["computed_share"] if stats["computed_share"] else math.nan
                rows.append(row)
                write()
                print(f"N={n} {name:<34} {vname:<10} dens {dens:.4f} {ms:9.3f} ms ratio {row['ratio']:.2f} "
                      f"own {row['vs_own_dense']:.2f} tiles {row['tile_share']:.2f} C {stats['C']} "
                      f"cols {stats['mean_columns']:.0f} unmasked {stats['mean_unmasked_col_tiles']:.1f} "
                      f"diff {diff:.1e}", flush=True)
            del first
            apply(dict(variants[0][1]))

        for name in names:
            spec = reg[name]
            t0 = time.perf_counter()
            call = spec.call_params(spec.demo_params(n), q)
            try:
                if spec.plan_based:
                    plan = spec.plan_fn("fast")(q, k, **call)
                    record(name, plan, "method default")
                    del plan
                else:
                    run = spec.run_fn("fast")
                    e2e = _ms(lambda: run(q, k, v, **call), args.warmup, args.rep)
                    view = spec.method_view("fast", q, k, v, call, with_recall=False)
                    dens = float(view.density.mean())
                    del view
                    torch.cuda.synchronize()
                    iters = 3
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        for _ in range(iters):
                            run(q, k, v, **call)
                        torch.cuda.synchronize()
                    kern = 0.0
                    total = 0.0
                    for e in prof.key_averages():
                        t = (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)) / 1e3 / iters
                        total += t
                        if "_block_column_fwd" in e.key:
                            kern += t
                    row = {"plan": name, "kind": "no plan (attention launches, torch.profiler)", "seqlen": n,
                           "density": dens, "kernel_ms": kern, "e2e_ms": e2e, "gpu_ms": total,
                           "cudnn_ms": cudnn_ms, "own_dense_ms": own_dense,
                           "ratio": kern / (dens * cudnn_ms), "vs_own_dense": kern / (dens * own_dense),
                           "params": {key: repr(val) for key, val in call.items()}}
                    rows.append(row)
                    write()
                    print(f"N={n} {name:<34} {'':<10} dens {dens:.4f} {kern:9.3f} ms ratio {row['ratio']:.2f} "
                          f"own {row['vs_own_dense']:.2f} (e2e {e2e:.2f} ms, GPU {total:.2f} ms)", flush=True)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"N={n} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            torch.cuda.empty_cache()
            print(f"   ({name}: {time.perf_counter() - t0:.1f} s)", flush=True)
        extra = tuple(x for x in args.extra.split(",") if x)
        if extra:
            for name, plan in method_plans(q, k, extra):
                record(name, plan, "extra plan")
                del plan
                torch.cuda.empty_cache()
        del q, k, v
        torch.cuda.empty_cache()
    apply({})
    write()
    print("\nN       plan                               variant    density  kernel ms  x floor  x own dense  tiles")
    for r in rows:
        if "ratio" in r:
            print(f"{r['seqlen']:<7} {r['plan']:<34} {r.get('variant', ''):<10} {r['density']:.4f} "
                  f"{r['kernel_ms']:10.3f} {r['ratio']:8.2f} {r['vs_own_dense']:11.2f} "
                  f"{r.get('tile_share', math.nan):6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
