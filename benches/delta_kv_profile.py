"""Where Delta-KV's time goes at one size (issue 21: `delta_kv` against cuDNN at keep ratio 0.5).

Keys in runs of near-duplicates (`issue21_s4._runs_keys`, keep ratio about 1 / run at cosine
0.95), random normal q / v, bf16. Prints the end-to-end and cuDNN medians
(`triton.testing.do_bench`), then `torch.profiler`'s CUDA time per kernel over `--iters` calls
of `fast.delta_kv` (keep mask, packing, plans, phase 1 on the ragged launcher, phase 2) and of
cuDNN SDPA, and writes both as JSON.

    python benches/delta_kv_profile.py --seqlen 32768 --run 2 --json out.json
    python benches/delta_kv_profile.py --seqlen 32768 --runs 2,2,1 --json out.json   # keep ~ 0.6
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from issue21_s4 import _runs_keys  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlen", type=int, default=32768)
    p.add_argument("--run", type=int, default=2, help="keys per run of near-duplicates (keep ~ 1 / run)")
    p.add_argument("--runs", default=None,
                   help="run lengths repeated along the keys instead of --run, e.g. 2,2,1 (keep ~ 0.6)")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json", default="delta_kv_profile.json")
    args = p.parse_args(argv)
    from sparseprefill import fast

    n, hq, hkv, d = args.seqlen, args.heads, args.kv_heads, args.head_dim
    g = torch.Generator(device="cuda").manual_seed(n)
    q = torch.randn(1, hq, n, d, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(1, hkv, n, d, device="cuda", generator=g).to(torch.bfloat16)
    run = tuple(int(x) for x in args.runs.split(",")) if args.runs else args.run
    k = _runs_keys(n, d, hkv, run, seed=n)
    keep = float(fast.delta_keep_mask(k, threshold=0.95, metric="cosine").float().mean())

    def ours() -> torch.Tensor:
        return fast.delta_kv(q, k, v, threshold=0.95, metric="cosine")

    def cudnn() -> torch.Tensor:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    ms = float(triton.testing.do_bench(ours, warmup=10, rep=100, return_mode="median"))
    cud = float(triton.testing.do_bench(cudnn, warmup=10, rep=100, return_mode="median"))
    result: dict[str, object] = {"device": torch.cuda.get_device_name(), "seqlen": n, "heads": hq,
                                 "kv_heads": hkv, "head_dim": d, "runs": list(run) if isinstance(run, tuple) else [run], "keep_ratio": keep, "delta_kv_ms": ms,
                                 "cudnn_ms": cud, "speedup_vs_cudnn": cud / ms}
    print(f"{result['device']} N={n} keep={keep:.3f}: delta_kv {ms:.3f} ms, cuDNN {cud:.3f} ms, "
          f"{cud / ms:.3f}x")
    for name, fn in (("delta_kv", ours), ("cudnn", cudnn)):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
        kernels = []
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t > 0:
                kernels.append({"kernel": e.key[:120], "calls_per_iter": e.count / args.iters,
                                "ms_per_iter": t / 1000 / args.iters})
        kernels.sort(key=lambda r: -float(r["ms_per_iter"]))  # type: ignore[arg-type]
        result[f"{name}_kernels"] = kernels
        total = sum(float(r["ms_per_iter"]) for r in kernels)  # type: ignore[arg-type]
        print(f"--- {name}: GPU kernel time {total:.3f} ms per call")
        for r in kernels[:14]:
            print(f"  {r['ms_per_iter']:8.3f} ms  x{r['calls_per_iter']:.0f}  {r['kernel']}")
    Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
