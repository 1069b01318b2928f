"""Quick GPU correctness sweep of the fast kernels against the float64 reference.

Prints one line per case: relative error of fast vs golden, of plain PyTorch in
the input dtype vs golden, and max |lse| difference. Usage: python benches/gpu_smoke.py
"""

from __future__ import annotations

import sys

import torch

from sparseprefill import fast, reference
from sparseprefill.bench import random_block_plan


def main() -> int:
    dev = torch.device("cuda")
    bad = 0
    cases = [
        (2, 8, 2, 1000, 128, torch.bfloat16), (2, 4, 4, 777, 64, torch.float16),
        (1, 6, 2, 4095, 128, torch.bfloat16), (3, 4, 1, 129, 96, torch.float16),
        (1, 2, 2, 2049, 256, torch.bfloat16), (2, 4, 2, 65, 32, torch.bfloat16),
    ]
    for b, hq, hkv, n, d, dt in cases:
        torch.manual_seed(n + d)
        q = torch.randn(b, n, hq, d, device=dev, dtype=dt).transpose(1, 2)  # strided view
        k = torch.randn(b, hkv, n, d, device=dev, dtype=dt)
        v = torch.randn(b, hkv, n, d, device=dev, dtype=dt)
        for name, plan in [
            ("dense", fast.dense_plan(q, k)),
            ("stream", fast.streaming_plan(q, k, sink=64, window=256, block_m=64, block_n=32)),
            ("random", random_block_plan(b, hq, n, density=0.3, block_m=128, block_n=128,
                                         device=dev, seed=n)),
        ]:
            out, lse = fast.sparse_attention(q, k, v, plan, return_lse=True)
            gold, glse = reference.sparse_attention(q.double(), k.double(), v.double(), plan,
                                                    return_lse=True)
            base = reference.sparse_attention(q, k, v, plan)  # output rounding only
            mask = plan.to_dense_mask()
            g = hq // hkv
            s = (q @ k.repeat_interleave(g, 1).transpose(-1, -2)) * d ** -0.5
            s = s.masked_fill(~mask, float("-inf"))
            naive = (torch.softmax(s.float(), -1).to(dt) @ v.repeat_interleave(g, 1))
            e = reference.relative_error(out, gold)
            eb = reference.relative_error(naive, gold)
            dl = (lse - glse).abs().max().item()
            ok = e <= 2 * eb + 1e-3 and dl < 1e-3
            bad += not ok
            print(f"{'ok ' if ok else 'BAD'} B={b} Hq={hq} Hkv={hkv} N={n} D={d} {str(dt)[6:]:8} "
                  f"{name:6}: fast {e:.2e}  naive-{str(dt)[6:]} {eb:.2e}  |dlse| {dl:.1e}")
    print("failures:", bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
