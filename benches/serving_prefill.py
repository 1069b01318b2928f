"""Serving-shaped prefill on a GPU (issue 15): a packed mixed-length batch in one launch
vs cuDNN SDPA per sequence, and a long prompt in chunks vs one shot.

    python benches/serving_prefill.py --json out.json

Mixed batch: sequences of 4K + 16K + 60K tokens (bf16, 32/8 heads, D = 128), dense
plan and a vertical-slash plan (1000 verticals, 6096 slashes, 64 x 64 blocks) per
sequence (`fast.varlen_plans`), one `fast.varlen_attention` launch; beside it cuDNN
SDPA run on each sequence in turn and our kernel run per sequence. Chunked prefill:
128K tokens in 8K chunks (`plan.rows`: each chunk's queries against all keys so far)
vs the same plan in one launch, dense and vertical-slash; the outputs must agree bit
for bit (the same tiles in the same order).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from sparseprefill import fast


def _ms(fn: Any) -> float:
    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


VS = dict(vertical_size=1000, slash_size=6096, last_q=64, block_m=64, block_n=64)


def mixed(lengths: list[int], hq: int, hkv: int, d: int) -> list[dict[str, Any]]:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q = torch.randn(total, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(total, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(total, hkv, d, device=dev, dtype=torch.bfloat16)
    bounds = cu.tolist()
    seqs_l = [tuple(t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)) for a, b in zip(bounds, bounds[1:])]
    cudnn_ms = _ms(lambda: [_cudnn(*s) for s in seqs_l])
    rows = []
    for name, fn, params in (("dense", fast.dense_plan, {}), ("vertical_slash", fast.vertical_slash_plan, VS)):
        plan = fast.varlen_plans(fn, q, k, cu, **params)
        plan_ms = _ms(lambda: fast.varlen_plans(fn, q, k, cu, **params))
        one_ms = _ms(lambda: fast.varlen_attention(q, k, v, cu, max(lengths), plan))
        per = [fn(s[0], s[1], **params) for s in seqs_l]
        per_ms = _ms(lambda: [fast.sparse_attention(s[0], s[1], s[2], p) for s, p in zip(seqs_l, per)])
        out = fast.varlen_attention(q, k, v, cu, max(lengths), plan)
        same = all(torch.equal(out[int(cu[i]):int(cu[i + 1])], fast.sparse_attention(*s, p)[0].transpose(0, 1))
                   for i, (s, p) in enumerate(zip(seqs_l, per)))
        dens = sum(float(fast.density(p).mean()) * n * n for p, n in zip(per, lengths)) / sum(
            n * n for n in lengths)
        rows.append(dict(case="mixed", plan=name, lengths=lengths, varlen_ms=one_ms, per_sequence_ms=per_ms,
                         plan_ms=plan_ms, cudnn_per_sequence_ms=cudnn_ms, density=dens,
                         speedup_vs_cudnn=cudnn_ms / one_ms, equal_to_per_sequence=same))
        print(f"mixed {lengths} {name:15s} varlen {one_ms:8.2f} ms | per-seq ours {per_ms:8.2f} | cuDNN per-seq "
              f"{cudnn_ms:8.2f} ({cudnn_ms / one_ms:.2f}x) | plans {plan_ms:.2f} ms | density {dens:.3f} | "
              f"bit-equal {same}", flush=True)
    return rows


def chunked(n: int, chunk: int, hq: int, hkv: int, d: int) -> list[dict[str, Any]]:
    dev = torch.device("cuda")
    torch.manual_seed(1)
    q = torch.randn(1, hq, n, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, hkv, n, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, hkv, n, d, device=dev, dtype=torch.bfloat16)
    rows = []
    cudnn_ms = _ms(lambda: _cudnn(q, k, v))
    for name, plan in (("dense", fast.dense_plan(q, k)), ("vertical_slash", fast.vertical_slash_plan(q, k, **VS))):
        parts = [(s, min(n, s + chunk), plan.rows(s, min(n, s + chunk))) for s in range(0, n, chunk)]
        one_ms = _ms(lambda: fast.sparse_attention(q, k, v, plan))
        chunks_ms = _ms(lambda: [fast.sparse_attention(q[:, :, a:b], k[:, :, :b], v[:, :, :b], p) for a, b, p in parts])
        whole = fast.sparse_attention(q, k, v, plan)
        same = all(torch.equal(fast.sparse_attention(q[:, :, a:b], k[:, :, :b], v[:, :, :b], p), whole[:, :, a:b])
                   for a, b, p in parts)
        rows.append(dict(case="chunked", plan=name, seqlen=n, chunk=chunk, one_shot_ms=one_ms, chunks_ms=chunks_ms,
                         cudnn_one_shot_ms=cudnn_ms, density=float(fast.density(plan).mean()), bit_equal=same))
        print(f"chunked N={n} chunk={chunk} {name:15s} one shot {one_ms:8.2f} ms | {len(parts)} chunks {chunks_ms:8.2f} "
              f"ms ({chunks_ms / one_ms:.3f}x) | cuDNN one shot {cudnn_ms:8.2f} | bit-equal {same}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="4096,16384,61440")
    p.add_argument("--seqlen", type=int, default=131072)
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    rows = mixed([int(x) for x in a.lengths.split(",")], 32, 8, 128)
    rows += chunked(a.seqlen, a.chunk, 32, 8, 128)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "command": " ".join(sys.argv)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
