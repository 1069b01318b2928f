"""MInference Block-Sparse heads (Alg. 3), as the specification.

Queries and keys are mean-pooled over blocks of `block_size` tokens (the last,
partial block pools its real tokens only). The pooled scores
`Q_hat K_hat^T` of query block `i` against the causal key blocks `j <= i` rank
the key blocks; query block `i` keeps its diagonal block `i` and the
`top_k - 1` best other causal blocks (fewer when it has fewer), so every query
block keeps `min(top_k, i + 1)` key blocks: the diagonal counts inside `top_k`.

Alg. 3 applies a softmax to the pooled scores before `argtopk`. A softmax is
monotone within a row, so ranking the scores themselves selects the same blocks
and keeps apart scores that a softmax would round to the same value; the softmax
scale does not matter either. Ties: the lower key-block index wins.
"""

from __future__ import annotations

import math

import torch

from ._checks import PerHeadInt, check_block_size, check_knob, check_positive_int, check_qk, is_per_head, per_head
from .attention import sparse_attention
from .dense_fallback import apply_rule
from .plan import BlockColumnPlan, cdiv, rank_nan_last


def mean_pooling(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Alg. 3 lines 2-3, `MeanPooling(x, block_size)`: float64 `[B, H, ceil(N / bs), D]`.

    The last block averages only the tokens it really holds.
    """
    b, h, n, d = x.shape
    nb = cdiv(n, block_size)
    padded = torch.zeros(b, h, nb * block_size, d, dtype=torch.float64, device=x.device)
    padded[:, :, :n] = x.to(torch.float64)
    sums = padded.reshape(b, h, nb, block_size, d).sum(dim=3)
    sizes = (n - torch.arange(nb, device=x.device) * block_size).clamp(max=block_size)
    return sums / sizes.to(torch.float64)[:, None]


def block_scores(q_pooled: torch.Tensor, k_pooled: torch.Tensor,
                 q_blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Alg. 3 line 4 before the softmax: float64 `[B, Hq, Qb, Kb]`, non-causal blocks -inf.

    Args:
        q_pooled: `[B, Hq, Qb, D]`; k_pooled: `[B, Hkv, Kb, D]`.
        q_blocks: int64 `[Qb]`, the global index of each pooled query block (a
            context-parallel rank scores only the blocks it holds); None: `arange(Kb)`,
            every query block (then `Qb == Kb`).
    """
    b, hq, qb, d = q_pooled.shape
    hkv, kb = k_pooled.shape[1], k_pooled.shape[2]
    g = hq // hkv
    scores = torch.matmul(q_pooled.reshape(b, hkv, g, qb, d), k_pooled.unsqueeze(2).transpose(-1, -2))
    causal = _causal_blocks(q_blocks, qb, kb, scores.device)
    return scores.masked_fill(~causal, -math.inf).reshape(b, hq, qb, kb)


def _causal_blocks(q_blocks: torch.Tensor | None, qb: int, kb: int, device: torch.device) -> torch.Tensor:
    """bool `[Qb, Kb]`: key block at or before each query block."""
    rows = torch.arange(qb, device=device) if q_blocks is None else q_blocks.to(device)
    return torch.arange(kb, device=device)[None, :] <= rows[:, None]


def check_top_k(top_k: object) -> int:
    """A `top_k` (key blocks per query block): an int >= 1, else TypeError/ValueError."""
    return check_positive_int("top_k", top_k)


def argtopk_blocks(scores: torch.Tensor, top_k: int | torch.Tensor,
                   q_blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Alg. 3 line 6, `argtopk(A_hat, k_b)` with the diagonal forced: bool `[B, H, Qb, Kb]`.

    Each query block keeps its diagonal block and the `top_k - 1` best other causal
    key blocks; a stable descending sort makes the lower index win ties.

    Args:
        scores: `[B, H, Qb, Kb]` from `block_scores`.
        top_k: blocks kept per query block, the diagonal included; an int, or int64
            `[H]` per head.
        q_blocks: as in `block_scores` (None: every query block, `Qb == Kb`).
    """
    qb, kb = scores.shape[-2], scores.shape[-1]
    causal = _causal_blocks(q_blocks, qb, kb, scores.device)
    # NaN scores (NaN in q or k) rank below every number but above non-causal blocks.
    ranked = torch.where(causal, rank_nan_last(scores), -math.inf)
    rows = torch.arange(qb, device=scores.device)
    diag = rows if q_blocks is None else q_blocks.to(scores.device)
    ranked[..., rows, diag] = math.inf
    if isinstance(top_k, torch.Tensor):
        counts = top_k.to(scores.device).clamp(max=kb)
        width = int(counts.max()) if counts.numel() else 0
        order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :width]
        # Each head keeps the first top_k[h] of the ranking.
        taken = torch.arange(width, device=scores.device) < counts[:, None, None]
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, taken.expand(order.shape))
        return keep & causal
    count = min(top_k, kb)
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :count]
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, True)
    # Non-causal blocks fill the budget of early query blocks; they are not kept.
    return keep & causal


def block_sparse_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    top_k: PerHeadInt,
    block_size: int = 64,
) -> BlockColumnPlan:
    """MInference Block-Sparse plan (Alg. 3); see the module doc.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`.
        top_k: key blocks kept per query block, the diagonal block included (>= 1); a
            scalar, or one per query head (a list or `[Hq]` int tensor).
        block_size: tokens per block, for pooling and for the plan's `block_m` and
            `block_n`.

    Returns:
        A `BlockColumnPlan` without columns, per batch row and query head.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k)
    check_knob("top_k", top_k, check_top_k, integer=True)
    bs = check_block_size("block_size", block_size)
    counts = (per_head(top_k, "top_k", shape.q_heads, check_top_k, integer=True, device=q.device)
              if is_per_head(top_k) else top_k)
    assert isinstance(counts, (int, torch.Tensor))
    scores = block_scores(mean_pooling(q, bs), mean_pooling(k, bs))
    blocks = argtopk_blocks(scores, counts)
    return apply_rule(BlockColumnPlan.from_masks(blocks, None, seqlen=shape.seqlen, block_m=bs, block_n=bs), q)


def block_sparse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    top_k: PerHeadInt,
    block_size: int = 64,
    scale: float | None = None,
) -> torch.Tensor:
    """Block-Sparse attention through `block_sparse_plan` (Alg. 3).

    Returns:
        `[B, Hq, N, D]` in q's dtype.
    """
    plan = block_sparse_plan(q, k, top_k=top_k, block_size=block_size)
    return sparse_attention(q, k, v, plan, scale=scale)
