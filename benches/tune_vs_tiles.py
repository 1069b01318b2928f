"""Tile sweep of the block/column kernel on ANCHORS.md's MInference plan (GPU).

The plan: 1000 columns (first 30 + random), the 6096 nearest diagonals, 64 x 64
blocks, disjoint per-query-block columns, 32 query / 8 KV heads, D = 128, bf16,
128K tokens (random q, k, v: timing does not depend on the values). Each
`SPARSEPREFILL_TILE` = "BLOCK_M,BLOCK_N,warps,stages" runs with and without TMA
loads; prints the median kernel time and the largest difference from the first
configuration's output (0 for the same tiles; sub-tiles reorder the sums).

Usage: python benches/tune_vs_tiles.py [--seqlen 131072]. About 30 s on an H200.
"""

from __future__ import annotations

import argparse
import os

import torch
import triton.testing

from sparseprefill.bench import minference_anchor_lines
from sparseprefill.fast.kernels import block_column_attention
from sparseprefill.fast.kernels.vertical_slash_index import vertical_slash_index
from sparseprefill.fast.vertical_slash import with_own_columns

CONFIGS = ["64,64,4,3", "64,64,4,2", "64,64,4,4", "64,64,8,3", "64,64,8,2", "64,32,4,3", "64,32,4,4",
           "32,64,4,3"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=131072)
    n = parser.parse_args().seqlen
    hq, hkv, d = 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, hq, n, d, device="cuda", generator=gen).bfloat16()
    k = torch.randn(1, hkv, n, d, device="cuda", generator=gen).bfloat16()
    v = torch.randn(1, hkv, n, d, device="cuda", generator=gen).bfloat16()
    verticals, slashes = minference_anchor_lines(1, hq, n, device=torch.device("cuda"))
    plan = with_own_columns(vertical_slash_index(verticals, slashes, seqlen=n, block_m=64, block_n=64))
    first = None
    for cfg in CONFIGS:
        os.environ["SPARSEPREFILL_TILE"] = cfg
        for tma in ("1", "0"):
            os.environ["SPARSEPREFILL_TMA"] = tma

            def run() -> torch.Tensor:
                return block_column_attention(q, k, v, plan, validate_plan=False)[0]

            out = run()
            first = out if first is None else first
            diff = float((out.float() - first.float()).abs().max())
            ms = triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")
            print(f"tile {cfg} tma {tma}: {ms:.2f} ms  maxdiff {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
