"""Kernel speed on the shapes users serve (issue 15), and the tile sweep behind the defaults.

GPU only. Each (shape, tile configuration) runs in a fresh subprocess: the kernel reads
`SPARSEPREFILL_TILE` ("BM,BN,warps,stages") at import. For each shape it times, in the
same process, cuDNN SDPA, our dense plan, a random 5% block plan (128 x 128) and, at
D = 128, a 64 x 64 random plan; it prints TFLOP/s on the computed causal area and the
ratio to cuDNN. The row tagged `default` uses the library's own tile choice.

Shapes (bf16): "serve64" B=2, 14/2 heads, D=64 (the issue's 32K case); "llama3_8b"
32/8/128; "qwen25_7b" 28/4/128.

Usage:
    python benches/serving_shapes.py --seqlen 32768 --json out.json
    python benches/serving_shapes.py --shapes serve64 --sweep      # every tile config
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

SHAPES = {"serve64": (2, 14, 2, 64), "llama3_8b": (1, 32, 8, 128), "qwen25_7b": (1, 28, 4, 128)}

CHILD = r"""
import json, sys, torch, triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
from sparseprefill import fast
from sparseprefill.bench import random_block_plan
b, hq, hkv, d, n = (int(x) for x in sys.argv[1:6])
dev = torch.device("cuda")
torch.manual_seed(0)
q = torch.randn(b, hq, n, d, device=dev, dtype=torch.bfloat16)
k = torch.randn(b, hkv, n, d, device=dev, dtype=torch.bfloat16)
v = torch.randn(b, hkv, n, d, device=dev, dtype=torch.bfloat16)
def ms(fn):
    fn(); torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
def sdpa():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
area = b * hq * n * (n + 1) / 2
res = {"cudnn_ms": ms(sdpa)}
ref = sdpa()
plans = [("dense", fast.dense_plan(q, k))]
plans.append(("rand5_128", random_block_plan(b, hq, n, density=0.05, block_m=128, block_n=128, device=dev)))
plans.append(("rand5_64", random_block_plan(b, hq, n, density=0.05, block_m=64, block_n=64, device=dev)))
if d == 128:
    plans.append(("rand30_64", random_block_plan(b, hq, n, density=0.30, block_m=64, block_n=64, device=dev)))
for name, plan in plans:
    dens = float(fast.density(plan).mean())
    t = ms(lambda: fast.sparse_attention(q, k, v, plan))
    res[name + "_ms"] = t
    res[name + "_density"] = dens
    res[name + "_tflops"] = 4 * d * area * dens / t / 1e9
    if name == "dense":
        err = (fast.sparse_attention(q, k, v, plan).float() - ref.float()).abs().max().item()
        res["dense_vs_cudnn_maxabs"] = err
res["cudnn_tflops"] = 4 * d * area / res["cudnn_ms"] / 1e9
print("RESULT " + json.dumps(res))
"""

SWEEP = ["64,128,4,3", "64,128,4,4", "64,128,4,2", "128,128,4,2", "128,128,4,4", "64,64,4,3",
         "128,128,8,3", "64,128,8,3"]


def _child(shape: tuple[int, int, int, int], n: int, tile: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("SPARSEPREFILL_TILE", None)
    if tile:
        env["SPARSEPREFILL_TILE"] = tile
    out = subprocess.run([sys.executable, "-c", CHILD, *map(str, shape), str(n)], env=env,
                         capture_output=True, text=True, timeout=300)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            row: dict[str, Any] = json.loads(line[7:])
            return row
    return {"error": (out.stderr.strip().splitlines() or ["no output"])[-1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", type=int, default=32768)
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--sweep", action="store_true", help="also every tile configuration in SWEEP")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    rows = []
    for name in a.shapes.split(","):
        shape = SHAPES[name]
        for tile in [None, *(SWEEP if a.sweep else [])]:
            r = _child(shape, a.seqlen, tile)
            r.update(shape=name, tile=tile or "default", seqlen=a.seqlen)
            rows.append(r)
            if "error" in r:
                print(f"{name:10s} {r['tile']:12s} ERROR {r['error']}", flush=True)
                continue
            extra = f" rand30_64 {r['rand30_64_tflops']:4.0f} TF/s" if "rand30_64_tflops" in r else ""
            print(f"{name:10s} {r['tile']:12s} cuDNN {r['cudnn_ms']:7.2f} ms | dense {r['dense_ms']:7.2f} ms "
                  f"({r['cudnn_ms'] / r['dense_ms']:.2f}x cuDNN, {r['dense_tflops']:4.0f} TF/s) | "
                  f"rand5_128 {r['rand5_128_tflops']:4.0f} TF/s ({r['rand5_128_tflops'] / r['dense_tflops']:.0%}"
                  f" of dense) | rand5_64 {r['rand5_64_tflops']:4.0f} TF/s{extra}", flush=True)
    if a.json:
        import torch
        import triton

        with open(a.json, "w") as f:
            json.dump({"rows": rows, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "command": " ".join(sys.argv)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
