"""How good a sparse selection is: recall, density and output error.

* recall: per query row, the share of the full causal attention probability mass
  that the kept keys carry (SampleAttention's cumulative residual attention, CRA);
  1 means nothing of weight was dropped.
* density: the kept share of the causal area, per (batch, head).
* relative_error: `||out - ref|| / ||ref||` over the whole tensor.
"""

from __future__ import annotations

import math

import torch

from ._checks import check_qk, check_tensor, check_values, resolve_scale
from .attention import _chunk_rows, _group_mask, check_mask, check_plan
from .plan import BlockColumnPlan


def _dense_keep(
    mask: torch.Tensor | BlockColumnPlan, batch: int, heads: int, seqlen: int, device: torch.device
) -> torch.Tensor:
    if isinstance(mask, BlockColumnPlan):
        return check_plan(mask, batch, heads, seqlen, device).to_dense_mask()
    return check_mask(mask, batch, heads, seqlen, device)


def recall(
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | BlockColumnPlan,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention recall of a mask or plan, per query row.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`.
        mask: a `BlockColumnPlan`, or a bool mask broadcastable to `[B, Hq, N, N]`.
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        float32 `[B, Hq, N]` in `[0, 1]`: the full causal softmax mass on kept keys.

    Raises:
        TypeError, ValueError: bad inputs.
    """
    shape = check_qk(q, k)
    sm_scale = resolve_scale(scale, shape.head_dim)
    b, hq, hkv, n, d, g = (shape.batch, shape.q_heads, shape.kv_heads, shape.seqlen,
                           shape.head_dim, shape.group)
    keep_all = _dense_keep(mask, b, hq, n, q.device)
    qg = q.reshape(b, hkv, g, n, d).to(torch.float64)
    kg = k.to(torch.float64).unsqueeze(2)
    out = torch.empty(b, hkv, g, n, dtype=torch.float64, device=q.device)
    chunk = _chunk_rows(b, hq, n)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        rows = torch.arange(start, stop, device=q.device)
        causal = torch.arange(stop, device=q.device)[None, :] <= rows[:, None]
        scores = torch.matmul(qg[:, :, :, start:stop], kg[:, :, :, :stop].transpose(-1, -2)) * sm_scale
        probs = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)
        keep = causal & _group_mask(keep_all[:, :, start:stop, :stop], hkv, g)
        out[:, :, :, start:stop] = (probs * keep).sum(dim=-1)
    return out.reshape(b, hq, n).to(torch.float32)


def density(mask: torch.Tensor | BlockColumnPlan) -> torch.Tensor:
    """Kept share of the causal area, per (batch, head).

    Args:
        mask: a `BlockColumnPlan`, or a bool mask `[B, Hq, N, N]` (intersected with
            causality before counting).

    Returns:
        float64 `[B, Hq]`: kept causal pairs over `N (N + 1) / 2`.

    Raises:
        TypeError, ValueError: not a plan or a rank-4 bool tensor.
    """
    if isinstance(mask, BlockColumnPlan):
        dense = mask.validate().to_dense_mask()
    else:
        dense = check_values("mask", check_tensor("mask", mask, rank=4), why="its kept pairs are counted")
        if dense.dtype != torch.bool:
            raise TypeError(f"mask must have dtype torch.bool, got {dense.dtype}")
        if dense.shape[2] != dense.shape[3] or dense.shape[2] == 0:
            raise ValueError(f"mask must have shape [B, Hq, N, N] with N >= 1, got {tuple(dense.shape)}")
    n = dense.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=dense.device).tril_()
    kept = (dense & causal).sum(dim=(-1, -2)).to(torch.float64)
    return kept / (n * (n + 1) / 2)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """`||out - ref|| / ||ref||` in float64 (the absolute error if `ref` is all zero).

    NaN or inf anywhere in `out` gives NaN or inf, never a small number.

    Raises:
        TypeError: not real tensors. ValueError: shapes differ, or a meta tensor (no values).
    """
    for name, x in (("out", out), ("ref", ref)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.is_complex():
            raise TypeError(f"{name} must be a real tensor, got {x.dtype}")
        check_values(name, x, why="the error is computed from its values")
    if out.shape != ref.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, ref {tuple(ref.shape)}; they must match")
    o = out.detach().to(torch.float64).cpu()
    r = ref.detach().to(torch.float64).cpu()
    num = float(torch.linalg.vector_norm(o - r).item())
    den = float(torch.linalg.vector_norm(r).item())
    if not math.isfinite(num):
        return math.nan
    return num / den if den > 0 else num
