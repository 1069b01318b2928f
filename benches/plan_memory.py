"""Size and build time of the fast vertical-slash plan at long N (GPU; issue 3's memory target).

Builds the plan of ANCHORS.md's MInference lines (first 30 + random verticals, the
6096 nearest diagonals, 64 x 64 blocks) for 32 heads, prints `plan.nbytes()`
against the formula `4 * B * H * (Qb * (W + 2) + k_v)` and the old data-free
bound, and times the index (counting pass, the one host sync, fill pass). Then,
at `--kernel-seqlen`, times `disjoint_columns` (the Triton pass that gives every
query block its own columns outside its listed blocks) and the block/column kernel
on the shared plan, on the per-block lists without the `columns_disjoint` promise
(the kernel still tests every column) and on the disjoint plan (test compiled out).

Usage: python benches/plan_memory.py [--seqlen 1048576] [--heads 32] [--kernel-seqlen 131072]
(`--kernel-seqlen 0` skips the kernel part). About a minute on an H200.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import triton.testing

from sparseprefill.bench import minference_anchor_lines
from sparseprefill.fast.kernels import block_column_attention
from sparseprefill.fast.kernels.own_columns import disjoint_columns
from sparseprefill.fast.kernels.vertical_slash_index import (
    block_widths,
    count_blocks,
    fill_index,
    index_width_bound,
    vertical_slash_index,
)
from sparseprefill.fast.vertical_slash import plan_nbytes
from sparseprefill.reference.plan import cdiv


def _wall_ms(fn: Callable[[], Any], reps: int = 5) -> float:
    """Median wall time of `fn()` in ms, synchronised before and after (the index syncs anyway)."""
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=1 << 20)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--vertical-size", type=int, default=1000)
    parser.add_argument("--slash-size", type=int, default=6096)
    parser.add_argument("--kernel-seqlen", type=int, default=1 << 17)
    args = parser.parse_args()
    dev = torch.device("cuda")
    bm = bn = 64
    n, h = args.seqlen, args.heads

    verticals, slashes = minference_anchor_lines(1, h, n, vertical_size=args.vertical_size,
                                                 slash_size=args.slash_size, device=dev)
    kv, ks = verticals.shape[2], slashes.shape[2]
    plan = vertical_slash_index(verticals, slashes, seqlen=n, block_m=bm, block_n=bn)
    torch.cuda.synchronize()
    width = plan.block_index.shape[3]
    bound = index_width_bound(ks, seqlen=n, block_m=bm, block_n=bn)
    formula = plan_nbytes(1, h, n, block_m=bm, block_width=width, n_vertical=kv)
    old = 4 * h * cdiv(n, bm) * (bound + kv + 2)
    print(f"N={n} heads={h} verticals={kv} slashes={ks} blocks {bm}x{bn}")
    print(f"block width W={width} (data-free bound {bound}); column_index stride {plan.column_index.stride()}")
    print(f"plan.nbytes() = {plan.nbytes() / 1e6:.1f} MB (formula {formula / 1e6:.1f} MB; "
          f"old bound {old / 1e9:.2f} GB); peak GPU memory {torch.cuda.max_memory_allocated() / 1e9:.2f} GB")
    plan.validate()
    print("plan.validate() passed")

    counts = count_blocks(slashes, seqlen=n, block_m=bm, block_n=bn)
    count_ms = _wall_ms(lambda: count_blocks(slashes, seqlen=n, block_m=bm, block_n=bn))
    sync_ms = _wall_ms(lambda: block_widths(counts, bound))
    fill_ms = _wall_ms(lambda: fill_index(verticals, slashes, counts, block_width=width, seqlen=n,
                                          block_m=bm, block_n=bn))
    total_ms = _wall_ms(lambda: vertical_slash_index(verticals, slashes, seqlen=n, block_m=bm, block_n=bn))
    print(f"index: counting pass {count_ms:.2f} ms, width read (sync) {sync_ms:.3f} ms, "
          f"fill pass {fill_ms:.2f} ms; vertical_slash_index {total_ms:.2f} ms")
    del plan, counts, verticals, slashes
    torch.cuda.empty_cache()

    nk = args.kernel_seqlen
    if nk > 0:
        torch.manual_seed(0)
        q = torch.randn(1, h, nk, 128, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, max(1, h // 4), nk, 128, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lines = minference_anchor_lines(1, h, nk, vertical_size=args.vertical_size,
                                        slash_size=args.slash_size, device=dev)
        shared = vertical_slash_index(*lines, seqlen=nk, block_m=bm, block_n=bn)
        disjoint = disjoint_columns(shared)
        convert_ms = triton.testing.do_bench(lambda: disjoint_columns(shared), warmup=10, rep=100,
                                             return_mode="median")
        print(f"disjoint_columns (Triton) at N={nk}: {convert_ms:.2f} ms")
        # The same per-block lists without the promise: the kernel still tests each column.
        untested = replace(disjoint, columns_disjoint=False)
        results = []
        for name, p in (("shared columns", shared), ("per-block columns, tested", untested),
                        ("disjoint columns (columns_disjoint)", disjoint)):
            ms = triton.testing.do_bench(lambda: block_column_attention(q, k, v, p, validate_plan=False),
                                         warmup=10, rep=100, return_mode="median")
            out, _ = block_column_attention(q, k, v, p, validate_plan=False)
            results.append(out)
            print(f"kernel N={nk} {name}: {ms:.2f} ms (columns listed: mean "
                  f"{float(p.column_count.float().mean()):.0f} per query block)")
        diff = max(float((r.float() - results[0].float()).abs().max()) for r in results[1:])
        print(f"max output difference from the shared plan: {diff:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
