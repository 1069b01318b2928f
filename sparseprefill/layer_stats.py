"""A layer's attention plans measured per head against the truth, on captured prompts.

The measuring layer under `sparseprefill calibrate` and `sparseprefill.margins`: captured
layers (`LayerCapture`, read by `load_captures` from `sparseprefill eval capture` files), the
exact causal softmax on sampled rows (`Truth`, `row_truth`), what a plan keeps of it per
query head (`HeadStats`: density, mean and worst-row recall, output error; `plan_stats`),
what a head must reach (`Target`), and a layer config (`layer_spec`) planned as `patch`
plans it (`layer_plan`) and measured as a whole (`measure_spec`).

Recall is the softmax mass a plan keeps on a sampled row; density the exact kept share
of the whole causal area; the output error the relative error of the renormalised kept
mass times V on the sampled rows (float64).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import split_dense_heads

DEFAULT_SHARES = (0.9, 0.95, 0.98)


@dataclass
class LayerCapture:
    """One captured layer of one prompt: q `[B, Hq, N, D]`, k, v `[B, Hkv, N, D]`."""

    source: str
    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor | None
    scale: float | None

    @property
    def seqlen(self) -> int:
        return int(self.q.shape[2])


@dataclass(frozen=True)
class Target:
    """What a head must reach; every bound that is not None must hold.

    Attributes:
        recall: least mean recall over the head's rows.
        row_recall: least recall of its worst sampled row.
        error: largest relative output error.
    """

    recall: float | None = 0.95
    row_recall: float | None = None
    error: float | None = None

    def __post_init__(self) -> None:
        from .reference._checks import check_fraction

        for name in ("recall", "row_recall"):
            value = getattr(self, name)
            if value is not None:
                check_fraction(f"target {name}", value)
        if self.error is not None and (not isinstance(self.error, (int, float)) or not self.error >= 0):
            raise ValueError(f"target error must be a number >= 0, got {self.error!r}")
        if self.recall is None and self.row_recall is None and self.error is None:
            raise ValueError("a target needs at least one of recall, row_recall, error")

    def with_margin(self, margin: float) -> Target:
        """The target a calibration prompt must meet so that other text still meets `self`.

        A config chosen at the cheapest setting that reaches a bound on the calibration
        prompt (bisection especially) keeps no slack; held-out text then lands just below
        it. With a margin `m` each recall bound `R` becomes `R + m` and an error bound `E`
        becomes `E - m`: the heads are calibrated to the safe side by `m`.

        Raises:
            ValueError: `margin` not in [0, 1), or a recall bound pushed above 1, or an
                error bound pushed below 0.
        """
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be a number in [0, 1), got {margin!r}")
        if margin == 0:
            return self
        for name in ("recall", "row_recall"):
            value = getattr(self, name)
            if value is not None and value + margin > 1.0:
                raise ValueError(f"margin {margin} lifts the target {name} {value} above 1; "
                                 f"use a margin <= {1.0 - value:.6g}")
        if self.error is not None and self.error - margin < 0:
            raise ValueError(f"margin {margin} takes the target error {self.error} below 0; "
                             f"use a margin <= {self.error:.6g}")
        return Target(recall=None if self.recall is None else self.recall + margin,
                      row_recall=None if self.row_recall is None else self.row_recall + margin,
                      error=None if self.error is None else self.error - margin)

    def serves(self, stats: HeadStats) -> torch.Tensor:
        """bool `[Hq]`: the heads whose numbers meet every bound."""
        ok = torch.ones_like(stats.density, dtype=torch.bool)
        if self.recall is not None:
            ok &= stats.recall_mean >= self.recall
        if self.row_recall is not None:
            ok &= stats.recall_min >= self.row_recall
        if self.error is not None:
            if stats.error is None:
                raise ValueError("an output-error target needs captures with v")
            ok &= stats.error <= self.error
        return ok


@dataclass
class Truth:
    """Full attention on the sampled rows of one layer.

    Attributes:
        rows: int64 `[R]`, sorted sampled positions.
        probs: float32 `[B, Hq, R, N]`, their causal softmax.
        out: float64 `[B, Hq, R, Dv]`, their exact output (None without v).
        oracle: float64 `[B, Hq, S]`, the oracle's density at `shares` (estimated from
            the rows: each stratum's row stands for its N / R rows).
        shares: the oracle shares.
    """

    rows: torch.Tensor
    probs: torch.Tensor
    out: torch.Tensor | None
    oracle: torch.Tensor
    shares: tuple[float, ...]


@dataclass
class HeadStats:
    """One plan's numbers per query head (batch rows averaged; worst over them for min/error).

    `parts`: for stats combined over several prompts (`combine`), each prompt's own, in
    order (what a per-kind margin reads, `sparseprefill.margins`); None for one prompt.
    """

    density: torch.Tensor
    recall_mean: torch.Tensor
    recall_min: torch.Tensor
    error: torch.Tensor | None
    parts: list[HeadStats] | None = None


def load_captures(paths: Sequence[Path | str], *, layers: Sequence[int] | None = None,
                  max_seqlen: int | None = None) -> list[LayerCapture]:
    """The layers of `eval capture` files (all, or those in `layers`), optionally cut to a prefix.

    Raises:
        ValueError: a file without the capture keys, or `layers` none of the files hold.
    """
    out: list[LayerCapture] = []
    for path in paths:
        data: dict[str, Any] = torch.load(path, map_location="cpu")
        missing = [key for key in ("layers", "q", "k") if key not in data]
        if missing:
            raise ValueError(f"{path}: not an `eval capture` file (missing {missing})")
        for i, layer in enumerate(data["layers"]):
            if layers is not None and int(layer) not in layers:
                continue
            q, k = data["q"][i], data["k"][i]
            v = data["v"][i] if "v" in data else None
            if max_seqlen is not None:
                q, k = q[:, :, :max_seqlen], k[:, :, :max_seqlen]
                v = None if v is None else v[:, :, :max_seqlen]
            scale = data["scale"][i] if "scale" in data else None
            out.append(LayerCapture(str(path), int(layer), q, k, v, None if scale is None else float(scale)))
    if layers is not None and not out:
        raise ValueError(f"no capture holds layers {list(layers)}")
    return out


def sample_rows(seqlen: int, count: int, *, seed: int = 0) -> torch.Tensor:
    """`count` query rows, one uniformly at random in each of `count` equal strata (all rows
    when `count >= seqlen`); int64, sorted."""
    if count >= seqlen:
        return torch.arange(seqlen)
    gen = torch.Generator().manual_seed(seed)
    edges = torch.linspace(0, seqlen, count + 1).floor().to(torch.int64)
    width = (edges[1:] - edges[:-1]).clamp(min=1)
    rows = edges[:-1] + (torch.rand(count, generator=gen) * width).floor().to(torch.int64)
    out: torch.Tensor = torch.unique(rows.clamp(max=seqlen - 1))
    return out


def row_truth(cap: LayerCapture, rows: torch.Tensor, *, shares: Sequence[float] = DEFAULT_SHARES,
              device: torch.device | str = "cpu") -> Truth:
    """Full causal attention of the sampled `rows` of one captured layer (float64 math)."""
    from .reference._checks import resolve_scale

    q, k = cap.q.to(device), cap.k.to(device)
    b, hq, n, d = q.shape
    hkv = int(k.shape[1])
    g = hq // hkv
    sm = resolve_scale(cap.scale, d)
    rows = rows.to(device)
    r = int(rows.numel())
    probs = torch.empty(b, hq, r, n, dtype=torch.float32, device=device)
    dv = None if cap.v is None else int(cap.v.shape[3])
    out = None if dv is None else torch.empty(b, hq, r, dv, dtype=torch.float64, device=device)
    want = torch.tensor(list(shares), dtype=torch.float64, device=device)
    kept = torch.zeros(b, hq, len(shares), dtype=torch.float64, device=device)
    kg = k.to(torch.float64).unsqueeze(2)
    vg = None if cap.v is None else cap.v.to(device=device, dtype=torch.float64).unsqueeze(2)
    step = max(1, 2**22 // max(1, b * hq * n))
    for start in range(0, r, step):
        pos = rows[start:start + step]
        qs = q[:, :, pos].to(torch.float64).reshape(b, hkv, g, -1, d)
        scores = torch.matmul(qs, kg.transpose(-1, -2)) * sm
        causal = torch.arange(n, device=device)[None, :] <= pos[:, None]
        p = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)
        probs[:, :, start:start + step] = p.reshape(b, hq, -1, n).to(torch.float32)
        if vg is not None and out is not None:
            out[:, :, start:start + step] = torch.matmul(p, vg).reshape(b, hq, p.shape[-2], -1)
        cum = torch.sort(p, dim=-1, descending=True).values.cumsum(dim=-1)
        below = (cum.unsqueeze(-1) < want - 1e-12).sum(dim=-2)  # [b, hkv, g, rows, S]
        need = torch.minimum(below + 1, (pos + 1)[:, None]).to(torch.float64)
        kept += need.sum(dim=-2).reshape(b, hq, len(shares))
    # Each sampled row stands for N / R rows of the causal area N (N + 1) / 2.
    oracle = kept * (n / r) / (n * (n + 1) / 2)
    return Truth(rows=rows, probs=probs, out=out, oracle=oracle.clamp(max=1.0), shares=tuple(shares))


def plan_stats(truth: Truth, plan: Any, v: torch.Tensor | None) -> HeadStats:
    """Recall (mean and worst sampled row), output error and exact density of a plan, per head."""
    probs = truth.probs
    b, hq, r, n = probs.shape
    rows = truth.rows.to(plan.device)
    cols = plan.block_mask().repeat_interleave(plan.block_n, dim=3)[..., :n] | plan.column_mask()[..., :n]
    keep = cols.index_select(2, rows // plan.block_m).to(probs.device)
    kept = probs * keep
    recall = kept.sum(dim=-1).double()  # [B, Hq, R]
    error = None
    if truth.out is not None and v is not None:
        hkv = int(v.shape[1])
        vg = v.to(device=probs.device, dtype=torch.float32).unsqueeze(2)
        o = torch.matmul(kept.reshape(b, hkv, hq // hkv, r, n), vg).reshape(b, hq, r, -1).double()
        o = o / recall.clamp(min=1e-30).unsqueeze(-1)
        exact = truth.out
        error = ((o - exact).pow(2).sum(dim=(-1, -2)) / exact.pow(2).sum(dim=(-1, -2)).clamp(min=1e-300)).sqrt()
        error = error.amax(dim=0)
    dens = plan_density(plan, cols).to(probs.device)
    return HeadStats(density=dens.mean(dim=0), recall_mean=recall.mean(dim=-1).mean(dim=0),
                     recall_min=recall.amin(dim=-1).amin(dim=0), error=error)


def plan_density(plan: Any, cols: torch.Tensor | None = None) -> torch.Tensor:
    """`reference.density(plan)` without the `[N, N]` mask: float64 `[B, Hq]`.

    Args:
        plan: a `BlockColumnPlan` (query offset 0).
        cols: its kept keys per query block, bool `[B, Hq, Qb, N]` (built if None).
    """
    n, bm = plan.seqlen, plan.block_m
    if cols is None:
        cols = plan.block_mask().repeat_interleave(plan.block_n, dim=3)[..., :n] | plan.column_mask()[..., :n]
    # Row r keeps the keys <= r of its query block's set: a prefix count of that set.
    prefix = cols.to(torch.int32).cumsum(dim=-1)  # [B, Hq, Qb, N]
    rows = torch.arange(n, device=cols.device)
    kept: torch.Tensor = prefix[:, :, rows // bm, rows].to(torch.float64).sum(dim=-1)
    share: torch.Tensor = kept / (n * (n + 1) / 2)
    return share


def method_knobs(method: Any) -> tuple[str, ...]:
    """The parameters of a method that take per-head values (`Method.knobs`; () before it exists)."""
    return tuple(getattr(method, "knobs", ()) or ())


def layer_spec(method: Any, grid: Sequence[Mapping[str, Any]], picks: Sequence[int | None]) -> Any:
    """The config entry of one layer from each head's grid index (None: dense).

    Returns:
        None when every head is dense (the layer runs SDPA); a parameter dict (knobs as
        per-head lists where heads differ, `dense_heads` when some are dense) when the
        parameters that differ between heads are all knobs of the method; else the
        integration's per-head list (one dict or None per head).
    """
    chosen = [i for i in picks if i is not None]
    if not chosen:
        return None
    dense = [h for h, i in enumerate(picks) if i is None]
    first = dict(grid[chosen[0]])
    keys = list(dict.fromkeys(key for i in chosen for key in grid[i]))
    varying = [key for key in keys if len({json.dumps(grid[i].get(key), sort_keys=True) for i in chosen}) > 1]
    knobs = method_knobs(method)
    if all(key in knobs for key in varying):
        spec: dict[str, Any] = dict(first)
        for key in varying:
            fill = grid[chosen[0]][key]
            spec[key] = [grid[i][key] if i is not None else fill for i in picks]
        if dense:
            spec["dense_heads"] = dense
        return spec
    return [dict(grid[i]) if i is not None else None for i in picks]


def layer_plan(method: Any, spec: Any, q: torch.Tensor, k: torch.Tensor, *, impl: str = "reference") -> Any:
    """The plan `patch` runs for one layer spec (see `layer_spec`): the method's estimator
    once (per-head knobs included), then `with_dense_heads`; a per-head list plans each
    head alone; None is the full causal plan."""
    from .methods import DENSE, METHODS
    from .reference.plan import stack_plans as stack_heads

    dense = METHODS[DENSE]
    if spec is None:
        return dense.plan_fn(impl)(q, k, **dense.demo_params(int(q.shape[2])))
    if _names_head_methods(spec):
        return _headwise_layer_plan(spec, q, k, impl=impl)
    if isinstance(spec, Mapping):
        params, heads = split_dense_heads(spec)
        plan = method.plan_fn(impl)(q, k, **method.call_params(params, q))
        return plan.with_dense_heads(heads)
    group = int(q.shape[1]) // int(k.shape[1])
    plans = []
    sizes: dict[str, int] | None = None
    for h, head in enumerate(spec):
        if head is not None:
            p = method.plan_fn(impl)(q[:, h:h + 1], k[:, h // group:h // group + 1], **dict(head))
            sizes = sizes or {"block_m": p.block_m, "block_n": p.block_n}
            plans.append(p)
        else:
            plans.append(None)
    out = []
    for h, p in enumerate(plans):
        if p is None:
            params = sizes if sizes is not None else dense.demo_params(int(q.shape[2]))
            p = dense.plan_fn(impl)(q[:, h:h + 1], k[:, h // group:h // group + 1], **params)
        out.append(p.ungrouped())
    # Heads stack along dim 1: transpose the batch/head roles of stack_plans (batch rows).
    return _stack_heads(out, stack_heads)


def _names_head_methods(spec: Any) -> bool:
    """Whether a layer spec is a per-head list whose heads name their methods (a headwise config)."""
    from .config import METHOD

    return isinstance(spec, list) and any(isinstance(h, Mapping) and METHOD in h for h in spec)


def _headwise_layer_plan(spec: Sequence[Any], q: torch.Tensor, k: torch.Tensor, *, impl: str) -> Any:
    """The plan `patch` runs for a per-head list naming each head's method: `headwise_plan`, one plan."""
    from . import fast, reference

    return (fast if impl == "fast" else reference).headwise_plan(q, k, heads=list(spec))


def _stack_heads(plans: Sequence[Any], stack_rows: Any) -> Any:
    from dataclasses import replace

    flipped = [replace(p, block_count=p.block_count.transpose(0, 1), block_index=p.block_index.transpose(0, 1),
                       column_count=p.column_count.transpose(0, 1), column_index=p.column_index.transpose(0, 1),
                       _checked=False) for p in plans]
    both = stack_rows(flipped)
    return replace(both, block_count=both.block_count.transpose(0, 1).contiguous(),
                   block_index=both.block_index.transpose(0, 1).contiguous(),
                   column_count=both.column_count.transpose(0, 1).contiguous(),
                   column_index=both.column_index.transpose(0, 1).contiguous(), _checked=False).validate()


def layer_truths(caps: Sequence[LayerCapture], rows: int, seed: int, shares: Sequence[float]) -> list[Truth]:
    return [row_truth(c, sample_rows(c.seqlen, rows, seed=seed + c.layer), shares=shares) for c in caps]


def combine(stats: Sequence[HeadStats]) -> HeadStats:
    """Several prompts of one layer: mean density and recall, worst row, worst error."""
    err = [s.error for s in stats]
    return HeadStats(
        density=torch.stack([s.density for s in stats]).mean(0),
        recall_mean=torch.stack([s.recall_mean for s in stats]).mean(0),
        recall_min=torch.stack([s.recall_min for s in stats]).amin(0),
        error=None if any(e is None for e in err) else torch.stack([e for e in err if e is not None]).amax(0),
        parts=list(stats))


def measure_spec(method: Any, spec: Any, caps: Sequence[LayerCapture], truths: Sequence[Truth],
                 *, impl: str = "reference") -> HeadStats:
    """A layer config run as a whole (`layer_plan`) on each prompt of the layer, combined."""
    out = []
    for cap, truth in zip(caps, truths):
        q, k = cap.q.float(), cap.k.float()
        out.append(plan_stats(truth, layer_plan(method, spec, q, k, impl=impl), cap.v))
    return combine(out)
