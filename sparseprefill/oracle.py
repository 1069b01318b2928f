"""The oracle: the sparsest selection any method could make at a given recall.

Per query row, the oracle keeps the fewest keys whose full causal softmax mass
reaches a share `s` (sort the row's probabilities in descending order, take the
shortest prefix whose sum is >= `s`). Its density at `s` is the frontier every
method is judged against: a method with mean recall `R` at density `rho` is
compared with the oracle's density at share `R` (each of the oracle's rows reaches
`R`, so its mean recall is at least `R`).

This is a measurement tool, not a method: float64, chunked over query rows, memory
O(rows_per_chunk * N). It is what `sparseprefill compare` and the per-method
evidence tables use.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .reference._checks import check_fraction, check_qk, resolve_scale

# Probabilities of one chunk are [B, Hq, rows, N] float64, sorted once: keep them near 128 MiB.
_CHUNK_BYTES = 128 * 2**20
# A row whose sorted prefix sums to within this of `s` counts as reaching `s`
# (float64 sums of probabilities that add to 1 carry rounding of that order).
_SUM_SLACK = 1e-12


def oracle_density(
    q: torch.Tensor,
    k: torch.Tensor,
    shares: Sequence[float],
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Density of the per-row oracle at each share, per (batch, head).

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]` (any float dtype; math in float64).
        shares: attention-mass shares in `[0, 1]`; 0 keeps nothing, 1 keeps every key
            of non-zero probability (`N (N + 1) / 2` pairs at most).
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        float64 `[B, Hq, len(shares)]`: kept pairs over `N (N + 1) / 2`.

    Raises:
        TypeError, ValueError: bad inputs or a share outside `[0, 1]`.
    """
    shape = check_qk(q, k)
    targets = [check_fraction(f"shares[{i}]", s) for i, s in enumerate(shares)]
    if not targets:
        raise ValueError("shares must not be empty")
    sm_scale = resolve_scale(scale, shape.head_dim)
    b, hq, hkv, n, d, g = (shape.batch, shape.q_heads, shape.kv_heads, shape.seqlen,
                           shape.head_dim, shape.group)
    qg = q.reshape(b, hkv, g, n, d).to(torch.float64)
    kg = k.to(torch.float64).unsqueeze(2)
    want = torch.tensor(targets, dtype=torch.float64, device=q.device)
    kept = torch.zeros(b, hkv, g, len(targets), dtype=torch.float64, device=q.device)
    chunk = max(1, min(n, _CHUNK_BYTES // max(1, b * hq * n * 8)))
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        rows = torch.arange(start, stop, device=q.device)
        causal = torch.arange(stop, device=q.device)[None, :] <= rows[:, None]
        scores = torch.matmul(qg[:, :, :, start:stop], kg[:, :, :, :stop].transpose(-1, -2)) * sm_scale
        probs = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)
        cum = torch.sort(probs, dim=-1, descending=True).values.cumsum(dim=-1)
        # Keys needed for share s: 1 + the number of prefix sums still below s (0 for s = 0).
        below = (cum.unsqueeze(-1) < (want - _SUM_SLACK)).sum(dim=-2)
        needed = torch.where(want > 0, (below + 1).clamp(max=causal.sum(-1)[:, None]), 0)
        kept += needed.sum(dim=-2).to(torch.float64)
    return kept.reshape(b, hq, len(targets)) / (n * (n + 1) / 2)


def oracle_density_at(
    q: torch.Tensor,
    k: torch.Tensor,
    share: float,
    *,
    scale: float | None = None,
) -> float:
    """The oracle's density at one share, averaged over batch and heads.

    Raises:
        TypeError, ValueError: as `oracle_density`.
    """
    return float(oracle_density(q, k, [share], scale=scale).mean())
