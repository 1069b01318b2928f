"""Tile-configuration sweep of the block/column kernel (GPU; tuning aid, not a test).

Each configuration runs in a fresh subprocess (the kernel reads the tuning
variables `SPARSEPREFILL_TILE`, `SPARSEPREFILL_PREFETCH`, `SPARSEPREFILL_TMA` at
import). Prints TFLOP/s on the computed causal area for a dense and a random 5%
plan. Usage: python benches/tune_kernel.py [N ...]
"""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = r"""
import sys, torch, triton.testing
from sparseprefill import fast
from sparseprefill.bench import random_block_plan
n = int(sys.argv[1]); dev = torch.device("cuda")
torch.manual_seed(0)
q = torch.randn(1, 32, n, 128, device=dev, dtype=torch.bfloat16)
k = torch.randn(1, 8, n, 128, device=dev, dtype=torch.bfloat16)
v = torch.randn(1, 8, n, 128, device=dev, dtype=torch.bfloat16)
res = []
for name, plan in [("dense64", fast.dense_plan(q, k, block_n=64)),
                   ("dense128", fast.dense_plan(q, k, block_n=128)),
                   ("rand5%", random_block_plan(1, 32, n, density=0.05, block_m=128, block_n=128, device=dev))]:
    dens = float(fast.density(plan).mean())
    ms = triton.testing.do_bench(lambda: fast.sparse_attention(q, k, v, plan), warmup=50, rep=300,
                                 return_mode="median")
    res.append(f"{name} {ms:8.2f} ms {4 * 128 * 32 * dens * n * (n + 1) / 2 / ms / 1e9:5.0f} TF/s")
print(" | ".join(res))
"""

CONFIGS = [
    ("128,64,8,3", "1", "1"), ("128,64,8,3", "0", "1"), ("128,64,8,3", "1", "0"),
    ("128,64,8,4", "1", "1"), ("128,64,4,3", "1", "1"), ("128,128,8,3", "1", "1"),
    ("128,128,8,2", "1", "1"), ("64,64,4,3", "1", "1"),
]


def main() -> int:
    seqlens = [int(a) for a in sys.argv[1:]] or [32768, 131072]
    for n in seqlens:
        for tile, prefetch, tma in CONFIGS:
            env = dict(os.environ, SPARSEPREFILL_TILE=tile, SPARSEPREFILL_PREFETCH=prefetch,
                       SPARSEPREFILL_TMA=tma)
            out = subprocess.run([sys.executable, "-c", CHILD, str(n)], env=env,
                                 capture_output=True, text=True)
            line = out.stdout.strip() or out.stderr.strip().splitlines()[-1]
            print(f"N={n} tile={tile} prefetch={prefetch} tma={tma}: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
