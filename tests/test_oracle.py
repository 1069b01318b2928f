"""The oracle's density equals a brute-force per-row count on small inputs."""

from __future__ import annotations

import math

import pytest
import torch

from sparseprefill.oracle import oracle_density, oracle_density_at


def _brute_force(q: torch.Tensor, k: torch.Tensor, shares: list[float]) -> torch.Tensor:
    b, hq, n, d = q.shape
    kk = k.repeat_interleave(hq // k.shape[1], dim=1).double()
    s = (q.double() @ kk.transpose(-1, -2)) / math.sqrt(d)
    p = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf).softmax(-1)
    out = torch.zeros(b, hq, len(shares), dtype=torch.float64)
    for bi in range(b):
        for hi in range(hq):
            for r in range(n):
                ranked = sorted(p[bi, hi, r, : r + 1].tolist(), reverse=True)
                for si, share in enumerate(shares):
                    total, count = 0.0, 0
                    while share > 0 and total < share - 1e-12:
                        total += ranked[count]
                        count += 1
                    out[bi, hi, si] += count
    return out / (n * (n + 1) / 2)


def test_oracle_matches_brute_force() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 37, 16, generator=gen)
    k = torch.randn(2, 2, 37, 16, generator=gen) * 2
    shares = [0.0, 0.5, 0.9, 0.99, 1.0]
    got = oracle_density(q, k, shares)
    assert torch.equal(got, _brute_force(q, k, shares))
    assert got[..., 0].eq(0).all() and got[..., -1].eq(1).all()
    assert oracle_density_at(q, k, 0.9) == pytest.approx(float(got[..., 2].mean()))


def test_oracle_rejects_bad_shares() -> None:
    q = torch.randn(1, 1, 8, 4)
    with pytest.raises(ValueError, match=r"shares\[1\]"):
        oracle_density(q, q, [0.5, 1.5])
    with pytest.raises(ValueError, match="shares must not be empty"):
        oracle_density(q, q, [])
