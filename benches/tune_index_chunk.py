"""Sweep the vertical-slash index kernel's chunk and warps (GPU), then run the
MInference benchmark with the fastest setting.

At `--seqlen` (128K) with 32 query heads: the top-k lines of the demo's synthetic
workload and ANCHORS.md's MInference lines, `vertical_slash_index` timed for every
(chunk, warps); every plan must equal the first one (block counts and lists).

Usage: python benches/tune_index_chunk.py [--seqlen 131072]. About a minute on an H200.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from sparseprefill.bench import format_table, minference_anchor_lines
from sparseprefill.methods.minference import run_minference_suite
from sparseprefill.demo import Shape, synthetic_qkv
from sparseprefill.fast.kernels import vertical_slash_index as vsi
from sparseprefill.fast.vertical_slash import vertical_slash_lines
from sparseprefill.reference import BlockColumnPlan

SETTINGS = [(chunk, warps) for chunk in (128, 256, 512, 1024) for warps in (4, 8)]


def same_blocks(a: BlockColumnPlan, b: BlockColumnPlan) -> bool:
    """Equal block counts and equal listed blocks (padding ignored)."""
    if not torch.equal(a.block_count, b.block_count) or a.block_index.shape != b.block_index.shape:
        return False
    width = a.block_index.shape[3]
    listed = torch.arange(width, device=a.device) < a.block_count.unsqueeze(-1)
    return torch.equal(a.block_index[listed], b.block_index[listed])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=131072)
    n = parser.parse_args().seqlen
    dev = torch.device("cuda")
    q, k, v = synthetic_qkv(Shape(1, 32, 8, n, 128, torch.bfloat16), device=dev)
    cases = {"workload": vertical_slash_lines(q, k, vertical_size=1000, slash_size=6096),
             "anchor": minference_anchor_lines(1, 32, n, device=dev)}
    del q, k, v
    total = dict.fromkeys(SETTINGS, 0.0)
    for name, (verticals, slashes) in cases.items():
        first = None
        for chunk, warps in SETTINGS:
            vsi._CHUNK, vsi._NUM_WARPS = chunk, warps

            def index() -> BlockColumnPlan:
                return vsi.vertical_slash_index(verticals, slashes, seqlen=n, block_m=64, block_n=64)

            plan = index()
            first = plan if first is None else first
            ms = float(triton.testing.do_bench(index, warmup=20, rep=200, return_mode="median"))
            total[(chunk, warps)] += ms
            print(f"{name} chunk {chunk} warps {warps}: {ms:.3f} ms same={same_blocks(plan, first)}",
                  flush=True)
    best = min(total, key=lambda s: total[s])
    print("best", best)
    vsi._CHUNK, vsi._NUM_WARPS = best
    print(format_table(run_minference_suite([n], with_recall=False, flex_max=0, log=lambda s: None)))


if __name__ == "__main__":
    main()
