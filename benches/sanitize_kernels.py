"""Run every Triton kernel once at small sizes (for `compute-sanitizer`; GPU only).

Each registered method's fast output function at its demo parameters (B = 2, GQA,
N not a multiple of any block size), plus the block/column kernel with a start
state, block means, a key bias and a dense mask. Prints one line per case; exits 1
if a fast output differs from the float64 reference beyond the tolerance policy.

    compute-sanitizer --tool memcheck --error-exitcode 9 python benches/sanitize_kernels.py
"""

from __future__ import annotations

import sys

import torch

from sparseprefill import fast, reference
from sparseprefill.methods import METHODS


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def main() -> int:
    dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    n, bad = int(sys.argv[2]) if len(sys.argv) > 2 else 1000, 0
    q = torch.randn(2, 4, n, 64, generator=gen).to(dev, torch.float16)
    k = torch.randn(2, 2, n, 64, generator=gen).to(dev, torch.float16)
    v = torch.randn(2, 2, n, 64, generator=gen).to(dev, torch.float16)
    for spec in METHODS.values():
        params = spec.call_params(spec.demo_params(n), q)
        out = spec.run_fn("fast")(q, k, v, **params)
        _sync(dev)
        print(f"{spec.name:18s} out finite={bool(torch.isfinite(out).all())}", flush=True)
    plan = fast.vertical_slash_plan(q, k, vertical_size=64, slash_size=64, last_q=64, block_m=64, block_n=64)
    state = fast.AttentionState.empty(2, 4, n, 64, device=dev)
    means = torch.empty(2, 4, plan.num_query_blocks, plan.num_key_blocks, device=dev)
    fast.sparse_attention(q, k, v, plan, state=state, block_mean_out=means)
    bias = torch.randn(2, 2, n, generator=gen).to(dev)
    from sparseprefill.fast.kernels import block_column_attention

    block_column_attention(q, k, v, plan, key_bias=bias)
    # A NaN in V: the kernel copy with the non-finite step computes, the other leaves.
    v_nan = v.clone()
    v_nan[1, 0, 7, 3] = float("nan")
    out_nan, _ = block_column_attention(q, k, v_nan, plan)
    _sync(dev)
    print(f"non-finite V ran; {int(out_nan.isnan().any(-1).sum())} NaN rows", flush=True)
    # Chunked prefill (query_offset) and a packed varlen batch.
    fast.sparse_attention(q[:, :, 300:], k, v, fast.dense_plan(q[:, :, 300:], k))
    fast.sparse_attention(q[:, :, 320:], k, v, plan.rows(320))
    lengths = [100, 1, 400, 499]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    qp, kp, vp = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
    vplan = fast.varlen_plans(fast.vertical_slash_plan, qp, kp, cu, vertical_size=32, slash_size=32, last_q=32,
                              block_m=64, block_n=64)
    fast.varlen_attention(qp, kp, vp, cu, max(lengths), vplan, return_lse=True)
    _sync(dev)
    print("chunked and varlen ran", flush=True)
    mask = torch.rand(n, n, generator=gen).to(dev) < 0.5
    got = fast.attention(q, k, v, mask)
    want = reference.attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), mask.cpu())
    err = float((got.double().cpu() - want).abs().max())
    bad += err > 2e-2
    _sync(dev)
    print(f"state / block means / key bias / dense mask ran; mask max err {err:.2e}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
