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
    check_qk(q, k)
    n = q.shape[2]
    return oracle_row_counts(q, k, shares, first_row=0, scale=scale) / (n * (n + 1) / 2)


def oracle_row_counts(
    q: torch.Tensor,
    k: torch.Tensor,
    shares: Sequence[float],
    *,
    first_row: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Keys the oracle keeps, summed over the rows of `q`, per (batch, head) and share.

    Args:
        q: `[B, Hq, R, D]`, the query rows `first_row .. first_row + R - 1` of a sequence
            whose keys are `k: [B, Hkv, N, D]` (`first_row + R <= N`); each row sees
            the keys up to its own position.
        shares, scale: as `oracle_density`.

    Returns:
        float64 `[B, Hq, len(shares)]`.

    Raises:
        TypeError, ValueError: bad inputs.
    """
    targets = [check_fraction(f"shares[{i}]", s) for i, s in enumerate(shares)]
    if not targets:
        raise ValueError("shares must not be empty")
    if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() != 4 or k.dim() != 4:
        raise ValueError("q and k must be rank-4 tensors")
    b, hq, rows, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    if hkv == 0 or hq % hkv or k.shape[0] != b or k.shape[3] != d or not 0 <= first_row <= n - rows:
        raise ValueError(f"q rows [{first_row}, {first_row + rows}) do not fit keys {tuple(k.shape)}")
    sm_scale = resolve_scale(scale, d)
    g = hq // hkv
    qg = q.reshape(b, hkv, g, rows, d).to(torch.float64)
    kg = k.to(torch.float64).unsqueeze(2)
    want = torch.tensor(targets, dtype=torch.float64, device=q.device)
    kept = torch.zeros(b, hkv, g, len(targets), dtype=torch.float64, device=q.device)
    chunk = max(1, min(rows, _CHUNK_BYTES // max(1, b * hq * n * 8)))
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        pos = torch.arange(first_row + start, first_row + stop, device=q.device)
        keys = int(pos[-1]) + 1
        causal = torch.arange(keys, device=q.device)[None, :] <= pos[:, None]
        scores = torch.matmul(qg[:, :, :, start:stop], kg[:, :, :, :keys].transpose(-1, -2)) * sm_scale
        probs = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)
        cum = torch.sort(probs, dim=-1, descending=True).values.cumsum(dim=-1)
        # Keys needed for share s: 1 + the number of prefix sums still below s (0 for s = 0).
        below = (cum.unsqueeze(-1) < (want - _SUM_SLACK)).sum(dim=-2)
        needed = torch.where(want > 0, (below + 1).clamp(max=causal.sum(-1)[:, None]), 0)
        kept += needed.sum(dim=-2).to(torch.float64)
    return kept.reshape(b, hq, len(targets))


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


def block_oracle_density(
    q: torch.Tensor,
    k: torch.Tensor,
    shares: Sequence[float],
    *,
    block: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Density of the best plan of `block x block` cells at each share, per (batch, head).

    Per query block of `block` rows, the fewest cells (by full-attention mass,
    descending) whose mass reaches `share` times the block's row count: a plan of whole
    cells at this block size needs at least this density for every query block to reach
    mean recall `share` (the block-granular counterpart of `oracle_density`).

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]` (math in float64).
        shares: shares in `[0, 1]`.
        block: rows and keys per cell.
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        float64 `[B, Hq, len(shares)]`: causal pairs of the kept cells over `N (N + 1) / 2`.

    Raises:
        TypeError, ValueError: bad inputs, a share outside `[0, 1]` or `block < 1`.
    """
    check_qk(q, k)
    targets = [check_fraction(f"shares[{i}]", s) for i, s in enumerate(shares)]
    if not targets:
        raise ValueError("shares must not be empty")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be an int >= 1, got {block!r}")
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    sm_scale = resolve_scale(scale, d)
    nb = -(-n // block)
    dev = q.device
    key_block = torch.arange(n, device=dev) // block
    qg = q.reshape(b, hkv, g, n, d).to(torch.float64)
    kg = k.to(torch.float64).unsqueeze(2)
    cells = torch.zeros(b, hq, nb, nb, dtype=torch.float64, device=dev)  # mass of each (query block, key block)
    rows_per = block * max(1, _CHUNK_BYTES // max(1, b * hq * n * 8) // block)
    for start in range(0, n, rows_per):
        stop = min(n, start + rows_per)
        pos = torch.arange(start, stop, device=dev)
        causal = torch.arange(stop, device=dev)[None, :] <= pos[:, None]
        scores = torch.matmul(qg[:, :, :, start:stop], kg[:, :, :, :stop].transpose(-1, -2)) * sm_scale
        probs = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1).reshape(b, hq, stop - start, stop)
        per_row = torch.zeros(b, hq, stop - start, nb, dtype=torch.float64, device=dev)
        per_row.index_add_(-1, key_block[:stop], probs)
        cells.index_add_(2, pos // block, per_row)
    # Causal pairs of every cell: row r sees min(max(r - j * block + 1, 0), size_j) keys of block j.
    starts = torch.arange(nb, device=dev) * block
    sizes = (n - starts).clamp(max=block)
    seen = (torch.arange(n, device=dev)[:, None] - starts[None, :] + 1).clamp(min=0)
    seen = torch.minimum(seen, sizes[None, :]).to(torch.float64)  # [N, Kb]
    cell_pairs = torch.zeros(nb, nb, dtype=torch.float64, device=dev).index_add_(0, key_block, seen)
    order = torch.sort(cells, dim=-1, descending=True, stable=True)
    cum = order.values.cumsum(dim=-1)
    sorted_pairs = cell_pairs.expand(b, hq, nb, nb).gather(-1, order.indices)
    rows = sizes.to(torch.float64)[None, None, :, None]
    out = torch.empty(b, hq, len(targets), dtype=torch.float64, device=dev)
    for i, s in enumerate(targets):
        # Cells needed: 1 + the number of prefix sums still below the target (0 for s = 0).
        need = ((cum < s * rows - _SUM_SLACK).sum(dim=-1, keepdim=True) + 1).clamp(max=nb) if s > 0 else 0
        keep = torch.arange(nb, device=dev) < need
        out[..., i] = (sorted_pairs * keep).sum(dim=(-2, -1)) / (n * (n + 1) / 2)
    return out
