"""Cost of the kernel's hostile-plan guard and non-finite step, before / after, on a GPU.

The block/column kernel clamps every plan entry it loads (so an edited plan cannot
read out of bounds) and, in masked tiles, keeps NaN values out of rows that do not
keep their key. Both are compile-time switches for benchmarking only
(`SPARSEPREFILL_GUARD=0`, `SPARSEPREFILL_NONFINITE=0`, read when the kernel module is
imported), so this script times the same plans in three child processes (both on,
guard off, non-finite step off) and cuDNN SDPA in the first, and prints a table:

    python benches/guard_cost.py --seqlen 131072 --json benches/results/h200-guard-cost.json

`--packed`: the kernels that read packed K/V instead (Delta-KV's phase-1 ragged launch
and DeltaXAttention's packed tiles, alone and inside their attention functions), guard
on / off; the guard there also clamps each segment's offset and bounds its keys by the
rows left in the flat buffer (q, k, v from `scale_run.device_qkv`).

Cases: dense plan, streaming (1K sink + 8K window), vertical-slash (1000, 6096) on
the synthetic workload of `sparseprefill bench --method minference`. bf16, 32 query /
8 KV heads, D = 128, B = 1, `triton.testing.do_bench` median.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

SETTINGS = {"guarded (default)": {}, "no guard": {"SPARSEPREFILL_GUARD": "0"},
            "no non-finite step": {"SPARSEPREFILL_NONFINITE": "0"}}


def measure_packed(seqlen: int) -> dict[str, float]:
    """Time the kernels that read packed K/V (the ragged launch, whose segment offsets the
    guard clamps in the kernel) under the current environment (child process)."""
    import torch
    import triton.testing

    from sparseprefill import fast
    from sparseprefill.fast.kernels.block_column import ragged_block_column_attention

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from scale_run import device_qkv

    def ms(fn: Any) -> float:
        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))

    q, k, v = device_qkv(seqlen)
    packed = fast.delta_pack(k, v, fast.delta_keep_mask(k, threshold=6.0, chunk=512), block=64)
    plan1, _ = fast.delta_kv_plans(q, packed, block_m=64)
    bias = torch.log(packed.counts.to(torch.float32))
    offsets = packed.offsets[:-1].contiguous()
    tiles = fast.delta_tile_pack(k, v, delta_threshold=6.0, block=128, packed_block=32)
    modes = fast.delta_xattention_tiles(q, k, block=128)
    _, packed_plan = fast.delta_xattention_plans(q, modes, tiles)
    t_bias = torch.log(tiles.packed.counts.to(torch.float32))
    regions = tiles.region_offsets()
    return {
        "Delta-KV phase 1 (ragged launch)": ms(lambda: ragged_block_column_attention(
            q, packed.k, packed.v, offsets, plan1, key_bias=bias)),
        "Delta-KV attention (both phases)": ms(lambda: fast.delta_kv_attention(q, k, v, packed, block_m=64)),
        "DeltaXAttention packed tiles (ragged launch)": ms(lambda: ragged_block_column_attention(
            q, tiles.packed.k, tiles.packed.v, regions, packed_plan, key_bias=t_bias)),
        "DeltaXAttention attention (packed + exact)": ms(lambda: fast.delta_xattention_attention(
            q, k, v, modes, tiles)),
    }


def measure(seqlen: int, cudnn: bool) -> dict[str, float]:
    """Time the three cases under the current environment (child process)."""
    import torch
    import triton.testing

    from sparseprefill import fast
    from sparseprefill.demo import Shape, synthetic_qkv

    def ms(fn: Any) -> float:
        return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))

    dev = torch.device("cuda")
    shape = Shape(batch=1, q_heads=32, kv_heads=8, seqlen=seqlen, head_dim=128)
    q, k, v = (t.to(torch.bfloat16) for t in synthetic_qkv(shape, device=dev))
    plans = {
        "dense": fast.dense_plan(q, k),
        "streaming 1K+8K": fast.streaming_plan(q, k, sink=1024, window=8192),
        "vertical_slash (1000, 6096)": fast.vertical_slash_plan(q, k, vertical_size=1000, slash_size=6096),
    }
    out = {name: ms(lambda p=plan: fast.sparse_attention(q, k, v, p)) for name, plan in plans.items()}
    if cudnn:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        ke, ve = k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)

        def sdpa() -> Any:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, ke, ve, is_causal=True)

        out["cuDNN SDPA (dense)"] = ms(sdpa)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=131072, help="N (default 131072)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cudnn", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--packed", action="store_true",
                        help="the packed K/V kernels (Delta-KV, DeltaXAttention) instead, guard on / off")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure_packed(args.seqlen) if args.packed else measure(args.seqlen, args.cudnn)))
        return 0
    results: dict[str, dict[str, float]] = {}
    settings = {k: SETTINGS[k] for k in ("guarded (default)", "no guard")} if args.packed else SETTINGS
    for i, (label, env) in enumerate(settings.items()):
        cmd = [sys.executable, __file__, "--child", "--seqlen", str(args.seqlen)] + \
            (["--packed"] if args.packed else ["--cudnn"] if i == 0 else [])
        done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=True)
        results[label] = json.loads(done.stdout.strip().splitlines()[-1])
    if args.packed:
        print(f"| case (N={args.seqlen}) | guarded ms | no guard ms | guard cost |")
        print("| --- | --- | --- | --- |")
        for case, on in results["guarded (default)"].items():
            off = results["no guard"][case]
            print(f"| {case} | {on:.3f} | {off:.3f} | {on / off - 1:+.1%} |")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"seqlen": args.seqlen, "packed": True, "results": results}, fh, indent=1)
        return 0
    cases = list(results["guarded (default)"])
    print(f"| case (N={args.seqlen}) | " + " | ".join(f"{s} ms" for s in SETTINGS) + " | guard cost | non-finite cost |")
    print("| --- " * (len(SETTINGS) + 3) + "|")
    for case in cases:
        on = results["guarded (default)"][case]
        if case.startswith("cuDNN"):
            print(f"| {case} | {on:.2f} | | | | |")
            continue
        off_g, off_n = results["no guard"][case], results["no non-finite step"][case]
        print(f"| {case} | {on:.2f} | {off_g:.2f} | {off_n:.2f} | {on / off_g - 1:+.1%} | {on / off_n - 1:+.1%} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"seqlen": args.seqlen, "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
