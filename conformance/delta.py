"""Conformance of Delta-KV, the one method whose output is not a plan's attention.

Delta-KV changes which keys the kernel reads (packed anchors with a log-count bias,
then the exact critical diagonal), so the plan properties do not apply. Instead:

* `delta_structure_check` (the "plan" property): the fast keep mask, packing and
  both phase plans equal the reference's exactly (they are comparisons of the same
  float64 numbers in the same order, and integer bookkeeping).
* `delta_golden` (the "end_to_end" property): an independent statement of the
  output as one masked softmax over concatenated keys, `[packed anchors ; phase-2
  keys]`, with the log-count bias on the anchors: in float64 it is the golden, in the
  inputs' dtype (matmuls in that dtype, softmax in fp32, as `baseline_attention`) it
  is the baseline of the tolerance policy. The reference's own loop is checked
  against the same golden.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import fast, reference
from ..reference.delta_kv import PackedKV, expand_packed, safe_blocks
from ..reference.plan import cdiv
from ..methods.delta_kv import stage1 as _stage1
from ..methods.delta_kv import packing as _packing

def delta_structure_check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: dict[str, Any]) -> None:
    """Fast keep mask, packed buffers and phase plans equal the reference's exactly.

    Raises:
        AssertionError: naming the first field that differs.
    """
    stage1 = _stage1(params, int(q.shape[1]), int(k.shape[1]))
    keep_r = reference.delta_keep_mask(k, **stage1)
    keep_f = fast.delta_keep_mask(k, **stage1)
    if not torch.equal(keep_r.cpu(), keep_f.cpu()):
        at = tuple(int(i) for i in (keep_r.cpu() != keep_f.cpu()).nonzero()[0].tolist())
        raise AssertionError(f"keep masks differ at (b, kv head, key) {at}: fast {bool(keep_f[at])}, "
                             f"reference {bool(keep_r[at])}")
    block = int(params.get("block_n", 64))
    ref = reference.delta_pack(k, v, keep_r, block=block)
    got = fast.delta_pack(k, v, keep_f, block=block)
    for name in ("counts", "timestamps", "offsets", "lengths"):
        if not torch.equal(getattr(ref, name).cpu(), getattr(got, name).cpu()):
            raise AssertionError(f"packed {name} differ")
    for name in ("k", "v"):
        # Bit patterns: the anchors are copies.
        if not torch.equal(getattr(ref, name).view(torch.int16).cpu(), getattr(got, name).view(torch.int16).cpu()):
            raise AssertionError(f"packed {name} differ")
    block_m = int(params.get("block_m", 64))
    for i, (p_ref, p_got) in enumerate(zip(reference.delta_kv_plans(q, ref, block_m=block_m),
                                           fast.delta_kv_plans(q, got, block_m=block_m))):
        if not p_ref.equal(p_got.to(p_ref.device)):
            raise AssertionError(f"phase {i + 1} plans differ")


def _combined(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedKV, params: dict[str, Any],
              *, dtype: torch.dtype) -> torch.Tensor:
    """Delta-KV's output as one masked softmax over `[anchors ; phase-2 keys]`, computed in `dtype`.

    float64: the golden. The inputs' dtype: matmuls there, bias, mask and softmax in fp32
    (the baseline, written as `tolerance.baseline_attention` is).
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    block_m = int(params.get("block_m", 64))
    count_weighted = bool(params.get("count_weighted", True))
    exact = bool(params.get("exact_diagonal", True))
    scale = params.get("scale")
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    safe, cut = safe_blocks(packed, block_m=block_m)
    k2, v2 = (k, v) if exact else expand_packed(packed)
    width = int((packed.offsets[1:] - packed.offsets[:-1]).max())
    anchors_k = torch.zeros(b, hkv, width, d, dtype=k.dtype, device=k.device)
    anchors_v = torch.zeros_like(anchors_k)
    bias = torch.full((b, hkv, width), -math.inf, dtype=torch.float64, device=k.device)
    visible = torch.zeros(b, hkv, cdiv(n, block_m), width, dtype=torch.bool, device=k.device)
    for bi in range(b):
        for kv in range(hkv):
            rows = packed.segment(bi, kv)
            size = rows.stop - rows.start
            anchors_k[bi, kv, :size] = packed.k[rows]
            anchors_v[bi, kv, :size] = packed.v[rows]
            counts = packed.counts[rows].to(torch.float64)
            bias[bi, kv, :size] = torch.log(counts) if count_weighted else torch.where(counts > 0, 0.0, -math.inf)
            visible[bi, kv] = torch.arange(width, device=k.device) < safe[bi, kv].unsqueeze(-1) * packed.block
    query_block = torch.arange(n, device=q.device) // block_m
    pos = torch.arange(n, device=q.device)
    exact_keys = (pos[None, :] >= cut[:, :, query_block].unsqueeze(-1)) & (pos[None, :] <= pos[:, None])
    mask = torch.cat([visible[:, :, query_block], exact_keys], dim=-1)  # [B, Hkv, N, width + N]
    keys = torch.cat([anchors_k, k2], dim=2)
    values = torch.cat([anchors_v, v2], dim=2)
    key_bias = torch.cat([bias, torch.zeros(b, hkv, n, dtype=torch.float64, device=k.device)], dim=2)
    qg = q.reshape(b, hkv, g, n, d).to(dtype)
    scores = torch.matmul(qg, keys.to(dtype).unsqueeze(2).transpose(-1, -2)) * sm_scale
    soft = torch.float64 if dtype == torch.float64 else torch.float32
    logits = scores.to(soft) + key_bias.unsqueeze(2).unsqueeze(3).to(soft)
    logits = logits.masked_fill(~mask.unsqueeze(2), -math.inf)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0).to(dtype)
    out = torch.matmul(probs, values.to(dtype).unsqueeze(2))
    return out.reshape(b, hq, n, d)


def delta_golden(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 params: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(golden float64 output, baseline output in q's dtype) of `delta_kv(q, k, v, **params)`."""
    packed = _packing(reference, q, k, v, params)
    golden = _combined(q, k, v, packed, params, dtype=torch.float64)
    baseline = _combined(q, k, v, packed, params, dtype=q.dtype)
    return golden, baseline
