"""Kernel variants of the block/column kernel timed in one process, beside cuDNN (issue 21).

A variant is a set of the launcher's tuning switches (module attributes of
`fast.kernels.block_column`: `_COL_SPLIT`, `_COL_TILE`, `_COL_PREFETCH`, `_TILE_MAJOR`; and
`BUDGET_GIB`, the front door's `own_columns.DISJOINT_COLUMN_BYTES`) and an optional tile
override (`SPARSEPREFILL_TILE="BM,BN,warps,stages"`). For every (N, D) the bench's
workload (`discrete_keys.workload`) and each plan are built once; every variant of every
plan is then timed (`triton.testing.do_bench`, median) and its output compared with the
first variant's (relative Frobenius difference), and cuDNN SDPA dense is timed in the same
process. Switching a module attribute changes a constexpr, so each variant compiles its
own kernel; nothing else changes between variants.

    python benches/kernel_variants.py --seqlens 32768 --head-dims 128,64 \\
        --plans anchor_attention,blocks_like_anchor_attention \\
        --variants "base:COL_SPLIT=0;split:COL_SPLIT=1;split64:COL_SPLIT=1,COL_TILE=64" --json out.json
    python benches/kernel_variants.py --seqlens 8192,32768 --plans dense \\
        --variants "t128:TILE=128.128.8.3;t128s2:TILE=128.128.8.2" --json dense.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def parse_variants(text: str) -> list[tuple[str, dict[str, str]]]:
    """`"name:KEY=VAL,KEY=VAL;name2:..."` -> [(name, {KEY: VAL})]; TILE takes dots for commas."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(";"))):
        name, _, rest = item.partition(":")
        sets = dict(kv.split("=", 1) for kv in filter(None, rest.split(",")))
        out.append((name, sets))
    return out


def apply(sets: dict[str, str]) -> None:
    from sparseprefill.fast.kernels import block_column as bc

    bc._COL_SPLIT = {"1": True, "0": False}.get(sets.get("COL_SPLIT", "auto"))  # auto: the rule
    bc._COL_TILE = int(sets.get("COL_TILE", "0"))
    bc._COL_PREFETCH = sets.get("COL_PREFETCH", "1") == "1"
    bc._TILE_MAJOR = sets.get("TILE_MAJOR", "0") == "1"
    from sparseprefill.fast.kernels import own_columns

    own_columns.DISJOINT_COLUMN_BYTES = int(float(sets.get("BUDGET_GIB", "0.5")) * 2**30)
    tile = sets.get("TILE")
    if tile:
        os.environ["SPARSEPREFILL_TILE"] = tile.replace(".", ",")
    else:
        os.environ.pop("SPARSEPREFILL_TILE", None)


def main(argv: list[str] | None = None) -> int:
    import triton
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from discrete_keys import method_plans, workload
    from sparseprefill import fast
    from sparseprefill.fast.kernels import block_column_attention

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", default="32768")
    p.add_argument("--head-dims", default="128")
    p.add_argument("--plans", default="anchor_attention,blocks_like_anchor_attention")
    p.add_argument("--variants", required=True)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--cache", default="/tmp")
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=150)
    p.add_argument("--json", default="/tmp/kernel_variants.json")
    args = p.parse_args(argv)
    variants = parse_variants(args.variants)
    names = tuple(args.plans.split(","))
    rows: list[dict[str, Any]] = []
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "variants": variants}

    def write() -> None:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    for d in (int(x) for x in args.head_dims.split(",")):
        for n in (int(x) for x in args.seqlens.split(",")):
            q, k, v = workload(n, heads=args.heads, kv_heads=args.kv_heads, head_dim=d, cache=Path(args.cache))
            pairs = q.shape[0] * q.shape[1] * n * (n + 1) / 2
            g = q.shape[1] // k.shape[1]
            ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

            def cudnn() -> Any:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)

            cudnn_ms = triton.testing.do_bench(cudnn, warmup=args.warmup, rep=args.rep, return_mode="median")
            del ke, ve
            rows.append({"plan": "cuDNN SDPA", "seqlen": n, "head_dim": d, "kernel_ms": cudnn_ms,
                         "tflops": 4 * d * pairs / cudnn_ms / 1e9})
            print(f"N={n} D={d}: cuDNN {cudnn_ms:.3f} ms", flush=True)
            for name, plan in method_plans(q, k, names):
                dens = float(fast.density(plan).mean())
                first = None
                # A block-path twin does not depend on the column switches: its first variant only.
                for vname, sets in (variants[:1] if name.startswith("blocks_like_") else variants):
                    apply(sets)
                    plan.__dict__.pop("_resolved_columns", None)  # the front door's cache (budget variants)
                    try:
                        out, _ = block_column_attention(q, k, v, plan, validate_plan=False)
                        torch.cuda.synchronize()
                        ms = triton.testing.do_bench(
                            lambda: block_column_attention(q, k, v, plan, validate_plan=False),
                            warmup=args.warmup, rep=args.rep, return_mode="median")
                    except Exception as exc:  # a configuration that does not launch: say so, go on
                        print(f"N={n} D={d} {name} {vname}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                        continue
                    if first is None:
                        first = out.float()
                        diff = 0.0
                    else:
                        diff = float((out.float() - first).norm() / first.norm().clamp(min=1e-30))
                    row = {"plan": name, "variant": vname, "sets": sets, "seqlen": n, "head_dim": d,
                           "density": dens, "kernel_ms": ms, "tflops": 4 * d * dens * pairs / ms / 1e9,
                           "vs_cudnn": cudnn_ms / ms, "vs_floor": ms / (dens * cudnn_ms),
                           "rel_diff_vs_first": diff, "nonfinite": int((~torch.isfinite(out)).sum())}
                    rows.append(row)
                    write()
                    print(f"N={n} D={d} {name:<30} {vname:<12} {ms:8.3f} ms {row['tflops']:5.0f} TFLOP/s "
                          f"{row['vs_cudnn']:.3f}x cuDNN diff {diff:.1e}", flush=True)
                    del out
            del q, k, v
            torch.cuda.empty_cache()
    apply({})
    write()
    # Column plans against their block-path twin, per variant.
    for r in rows:
        like = next((x for x in rows if x.get("plan") == "blocks_like_" + str(r.get("plan"))
                     and x["seqlen"] == r["seqlen"] and x["head_dim"] == r["head_dim"]), None)
        if like is not None:
            r["vs_block_path"] = r["tflops"] / like["tflops"]
            print(f"N={r['seqlen']} D={r['head_dim']} {r['plan']} {r['variant']}: "
                  f"{r['vs_block_path']:.2f} of the block path", flush=True)
    write()
    return 0 if not any(math.isnan(r.get("kernel_ms", 0.0)) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
