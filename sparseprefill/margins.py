"""Per-head calibration margins from the spread of recall across kinds of text.

A head calibrated at the cheapest setting that reaches a target on the calibration
prompts keeps no slack on other text. One global margin (`--margin M`: every head
calibrated to target + M) is too much for heads whose recall does not move with the text
and too little for heads that are local on code and diffuse on prose. With prompts of
several kinds (`sparseprefill.prompts`), each head gets its own margin, from how much its
numbers move across the kinds at the setting being tried:

    spread_h = max_k x_kh - min_k x_kh            (x_kh: head h's number on kind k)
    margin_h = max(M, C * spread_h)               (M: --margin, the floor; C: --margin-spread)

and the setting serves head h when, on **every** kind, a recall bound R holds as
x_kh >= R + margin_h (so min_k x_kh >= R + margin_h) and an error bound E as
x_kh <= E - margin_h. Each bound (mean recall, worst-row recall, output error) takes
the spread of its own number. Several prompts of one kind are averaged first (the worst
row: their worst; the error: their largest), so K is the number of kinds, not of prompts.

Why the range, C = 1: the kinds seen are a sample of the kinds a deployment meets. If
a new kind's number is another draw from the same spread, it falls below the lowest
kind seen with chance 1 / (K + 1) (exchangeable draws), and below the lowest minus one
range far less often (K = 3 normal draws: about 1.5%, `tail_below_min_minus_range`).
A margin from the spread grows where the text moves a head and shrinks to the floor
where it does not; since a denser setting keeps more on every kind, the spread shrinks
as the setting grows, and a head whose recall moves by more than 1 - R at every setting
runs dense. With one kind (or only `--qkv` captures) every spread is 0 and margin_h = M:
the global margin as before.

Heads that interact (SharePrefill: a cluster's first sparse-enough head runs dense and
pivots the others, the descriptor's `coupled_heads`): the per-head margins are computed
on scalar runs, where the clusters differ from the chosen config's, so the chosen config
is then run as a whole on every kind (`settle_coupled`), its margins recomputed from those
whole runs, and each head it does not serve moves to its next denser grid point (dense
past the last), for up to `COUPLED_ROUNDS` rounds; the head margins reported are those of
the last whole run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .layer_stats import HeadStats, Target, layer_spec, measure_spec

COUPLED_ROUNDS = 3
BOUNDS = ("recall", "row_recall", "error")


@dataclass(frozen=True)
class SpreadTarget(Target):
    """A `Target` whose margin is per head, from the spread of each number across kinds.

    Attributes:
        recall, row_recall, error: the user's bounds (see `Target`).
        margin: the floor M of every head's margin.
        spread: C, the multiple of the spread across kinds added as margin.
        kinds: the kind of each prompt of the layer, in the order of the stats' `parts`
            (empty: every prompt one kind).
    """

    margin: float = 0.0
    spread: float = 1.0
    kinds: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float)) or not 0 <= self.margin < 1:
            raise ValueError(f"margin must be a number in [0, 1), got {self.margin!r}")
        if (isinstance(self.spread, bool) or not isinstance(self.spread, (int, float))
                or not 0 <= self.spread < math.inf):
            raise ValueError(f"margin spread must be a finite number >= 0, got {self.spread!r}")
        if not all(isinstance(kind, str) for kind in self.kinds):
            raise TypeError(f"kinds must be strings, got {self.kinds!r}")
        for name in ("recall", "row_recall"):
            value = getattr(self, name)
            if value is not None and value + self.margin > 1.0:
                raise ValueError(f"margin {self.margin} lifts the target {name} {value} above 1; "
                                 f"use a margin <= {1.0 - value:.6g}")
        if self.error is not None and self.error - self.margin < 0:
            raise ValueError(f"margin {self.margin} takes the target error {self.error} below 0; "
                             f"use a margin <= {self.error:.6g}")

    def for_kinds(self, kinds: Sequence[str]) -> SpreadTarget:
        """The same target for a layer whose prompts are of `kinds` (in capture order)."""
        return replace(self, kinds=tuple(kinds))

    @property
    def user_target(self) -> Target:
        """The bounds alone, without margins."""
        return Target(recall=self.recall, row_recall=self.row_recall, error=self.error)

    def per_kind(self, stats: HeadStats) -> dict[str, HeadStats]:
        """`{kind: stats}`: the prompts of each kind combined (mean recall and density
        averaged, the worst row and the largest error kept).

        Raises:
            ValueError: stats of a number of prompts other than `kinds` says.
        """
        parts = stats.parts if stats.parts is not None else [stats]
        kinds = self.kinds or ("",) * len(parts)
        if len(kinds) != len(parts):
            raise ValueError(f"stats of {len(parts)} prompt(s) for a target of {len(kinds)} kind(s)")
        out: dict[str, HeadStats] = {}
        for kind in dict.fromkeys(kinds):
            mine = [p for p, k in zip(parts, kinds) if k == kind]
            errs = [p.error for p in mine]
            out[kind] = HeadStats(
                density=torch.stack([p.density for p in mine]).mean(0),
                recall_mean=torch.stack([p.recall_mean for p in mine]).mean(0),
                recall_min=torch.stack([p.recall_min for p in mine]).amin(0),
                error=None if any(e is None for e in errs) else torch.stack([e for e in errs if e is not None]).amax(0))
        return out

    def margins(self, stats: HeadStats) -> dict[str, torch.Tensor]:
        """`{bound: float64 [Hq]}`: each given bound's per-head margin max(M, C * spread)."""
        kinds = self.per_kind(stats)
        out: dict[str, torch.Tensor] = {}
        for bound in BOUNDS:
            if getattr(self, bound) is None:
                continue
            values = _values(bound, list(kinds.values()))
            spread = values.amax(0) - values.amin(0)
            out[bound] = torch.clamp(self.spread * spread, min=self.margin)
        return out

    def serves(self, stats: HeadStats) -> torch.Tensor:
        """bool `[Hq]`: the heads that meet every bound plus their own margin on every kind."""
        kinds = list(self.per_kind(stats).values())
        ok = torch.ones_like(stats.density, dtype=torch.bool)
        for bound, margin in self.margins(stats).items():
            values = _values(bound, kinds)
            if bound == "error":
                ok &= values.amax(0) <= float(self.error) - margin  # type: ignore[arg-type]
            else:
                ok &= values.amin(0) >= float(getattr(self, bound)) + margin
        return ok


def _values(bound: str, kinds: Sequence[HeadStats]) -> torch.Tensor:
    """float64 `[K, Hq]`: one bound's number per kind."""
    if bound == "recall":
        return torch.stack([k.recall_mean for k in kinds]).double()
    if bound == "row_recall":
        return torch.stack([k.recall_min for k in kinds]).double()
    if any(k.error is None for k in kinds):
        raise ValueError("an output-error target needs captures with v")
    return torch.stack([k.error for k in kinds if k.error is not None]).double()


def kind_recall(target: Target, stats: HeadStats) -> dict[str, list[float]]:
    """`{kind: per-head mean recall}` of combined stats (one entry "" without kinds)."""
    if not isinstance(target, SpreadTarget):
        target = SpreadTarget(recall=target.recall, row_recall=target.row_recall, error=target.error)
    return {kind: [float(x) for x in s.recall_mean] for kind, s in target.per_kind(stats).items()}


def head_margins(target: Target, stats: HeadStats, picks: Sequence[int | None]) -> list[float | None]:
    """Each served head's margin on the mean-recall bound (else the first bound given) at
    the measured config; None for a dense head. A plain `Target` has none: []."""
    if not isinstance(target, SpreadTarget):
        return []
    margins = target.margins(stats)
    if not margins:
        return []
    values = margins.get("recall", next(iter(margins.values())))
    return [None if p is None else float(values[h]) for h, p in enumerate(picks)]


def settle_coupled(method: Any, caps: Sequence[Any], truths: Sequence[Any], target: Target,
                   points: Sequence[dict[str, Any]], picks: list[int | None], density: torch.Tensor, *,
                   impl: str = "reference", rounds: int = COUPLED_ROUNDS) -> tuple[list[int | None], Any, HeadStats]:
    """For a method whose heads interact: the chosen config checked as a whole on every kind.

    Each round runs the layer config (`layer_spec` of `picks`) on every prompt, and every
    head it does not serve (its margin recomputed from that whole run's spread) moves to
    its next denser grid point by its scalar-run density, or runs dense past the last.

    Args:
        method: the `Method`; caps, truths: the layer's prompts and their row truth.
        target: a `Target` or `SpreadTarget` (for the layer's kinds).
        points: the grid; picks: each head's grid index (None: dense).
        density: float `[G, Hq]`, each grid point's scalar-run density per head.
        impl: the estimators; rounds: the most whole runs that move heads.

    Returns:
        (picks, the layer spec, the stats of its last whole run).
    """
    picks = list(picks)
    spec = layer_spec(method, points, picks)
    whole = measure_spec(method, spec, caps, truths, impl=impl)
    for _ in range(rounds):
        served = target.serves(whole)
        failing = [h for h, p in enumerate(picks) if p is not None and not bool(served[h])]
        if not failing:
            break
        for h in failing:
            pick = picks[h]
            assert pick is not None
            denser = [g for g in range(len(points)) if float(density[g, h]) > float(density[pick, h])]
            picks[h] = min(denser, key=lambda g: float(density[g, h])) if denser else None
        spec = layer_spec(method, points, picks)
        whole = measure_spec(method, spec, caps, truths, impl=impl)
    return picks, spec, whole


def tail_below_min_minus_range(kinds: int, spread: float = 1.0, *, draws: int = 200_000, seed: int = 0) -> float:
    """The chance that one more normal draw falls below min - `spread` x range of `kinds`
    draws (Monte Carlo): how often a new kind of text misses a head calibrated with
    C = `spread` at the floor 0, when its number varies across kinds as normal draws."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(draws, kinds + 1, generator=gen, dtype=torch.float64)
    seen, new = x[:, :kinds], x[:, kinds]
    bound = seen.amin(1) - spread * (seen.amax(1) - seen.amin(1))
    return float((new < bound).double().mean())


__all__ = [
    "BOUNDS",
    "COUPLED_ROUNDS",
    "SpreadTarget",
    "head_margins",
    "kind_recall",
    "settle_coupled",
    "tail_below_min_minus_range",
]
