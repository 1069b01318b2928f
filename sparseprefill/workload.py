"""A synthetic workload calibrated, head by head, on captured attention.

`demo.synthetic_qkv` builds attention with sinks, a local bump, slashes and vertical
stripes in fixed proportions; real prefill attention is more concentrated and its keys
come in runs of near-duplicates. This module measures the structure of captured
attention (`sparseprefill eval capture`), fits a generator of the same family to it,
per query head, and builds q, k, v of any shape and length from the fit.

Structure statistics (`attention_stats`, the same definitions for a capture and for a
generated workload), per query head, on `rows` query rows spread evenly over the
sequence, each row's full causal softmax in float64:

* shares of the row's mass, disjoint, in this priority: `sink` (keys `0 .. SINK_KEYS-1`),
  `local` (distance `i - j < LOCAL`), `vertical` (the `N / 100` key columns of most
  mean mass beyond the local window), `slash` (the `N / 100` diagonals `i - j >= LOCAL`
  of most mean mass, keys not already counted as vertical), `rest` (everything else:
  the diffuse part);
* `profile`: the non-sink mass per distance band `[0, 2)`, `[2, 16)`, `[16, 128)`,
  `[128, 1024)`, `[1024, N)`;
* `oracle`: the per-row oracle's density at mass 0.9 and 0.95 (`sparseprefill.oracle`:
  the fewest keys per row holding that share, over the causal area of the rows);
* per KV head, `keep`: Delta-KV's keep ratio (`reference.delta_keep_mask`, cosine,
  chunks of 512, on the first 2048 keys) at similarity 0.95, 0.9, 0.83 and 0.75: how
  much the runs of similar keys compress.

The generator (`calibrated_qkv`) writes each score `scale * q_i . k_j` as a sum of
channels (the scheme of `demo.synthetic_qkv`, whose `Shape` and rotary helper it reuses),
with one set of logit weights per query head and the keys shared by a GQA group:

* sink: `+sink` on key 0;
* vertical: `+vertical * u_j` on a random 0.5% of keys (`u_j` uniform in [0.5, 1]);
* distance profile: 40 rotary pairs, frequencies geometric from pi to `ROTARY_MIN`; the
  query carries per-frequency weights fitted by ridge least squares to the head's score
  profile (one value per `PROFILE_BANDS` band), so this part of the score is a
  deterministic function of `i - j` (the local window and its tail);
* slash: random codes `c_p`, key `j` carrying `c_{j + o}` for each of the KV head's
  four slash offsets `o` (the capture's strongest diagonals), query `i` carrying `c_i`:
  `+slash` on the diagonals `i - j = o`;
* noise: Gaussian query and key contents, score standard deviation `noise`; the keys'
  contents come in runs (a new run starts with probability `1 / run_length`, jitter
  0.3), and a key-only channel `key_offset` (queries 0 there, so no score changes)
  sets how similar keys are in cosine, for Delta-KV.

Fit (`fit_layer`): key parameters (`run_length`, `key_offset`) first, by bisection on
the keep ratio at 0.83; then the logit weights by a fixed-point iteration on the
statistics, `w += 0.8 log(target share / generated share)` per component (every profile
band on its own band's mass) and, after the first rounds, `noise *= (generated / target
oracle density at 0.95) ** 0.7`, on a workload of the capture's own heads and length at
head size `FIT_HEAD_DIM`.

Rule to longer N (`RULES`): "fixed-logits" keeps every logit weight and every length
in tokens (profile per distance, slash offsets, vertical keys per token, runs) as
fitted: what a model's weights fix; "sink-log" also raises the sink weight by
`log(N / N_fit)` (the demo's rule: a sink keeps its share). `benches/calibrate_workload.py
--max-seqlen M --predict` fits on a prefix and reports each rule's error at the
capture's length; `DEFAULT_RULE` is the one that predicted better (docs/workload.md).

Heads of another shape (`calibrated_qkv` at Hq, Hkv, D not those of the fit): KV head
`j` takes fitted KV head `j * P / Hkv` of the pool of all fitted KV heads (layers in
order), its query heads the fitted query heads of that group in turn. Channels use at
most 128 of D (the rest are zero), so the score distribution does not change with D
for D >= 128; below, every part shrinks in proportion.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .demo import Shape as Shape
from .demo import _rotate, synthetic_qkv

SINK_KEYS = 4
LOCAL = 128
PROFILE_EDGES = (0, 2, 16, 128, 1024)
# Distance bands of the fitted score profile: 0, 1, 2, 3, then two per octave up to 2^20.
PROFILE_BANDS = tuple(sorted({0, 1, 2, 3, *(round(2 ** (x / 2)) for x in range(4, 41))}))
# Rotary frequencies of the profile: geometric from pi (period 2 tokens) to 1e-4 (63K tokens).
ROTARY_MIN = 1e-4
ORACLE_SHARES = (0.9, 0.95)
KEEP_THRESHOLDS = (0.95, 0.9, 0.83, 0.75)
KEEP_KEYS = 2048
KEEP_CHUNK = 512
SLASH_OFFSETS = 4
# How `attention_stats` ranks the diagonals (`SLASH_SELECT`): "mean" mass over the sampled rows
# that have them, or "median" over them, among the diagonals at least SLASH_MIN_ROWS rows have
# (a heavy key column crosses each diagonal in one row only: it moves a mean, not a median).
SLASH_SELECT = ("mean", "median")
SLASH_MIN_ROWS = 8
VERTICAL_FRACTION = 0.005
RUN_JITTER = 0.3
RUN_LENGTHS = (1.0, 4.0, 16.0)
RULES = ("fixed-logits", "sink-log")
# Shared structure of the far field (`score_structure`): per-key salience quantiles are
# stored at these probabilities (relative to the median), interpolated in normal scores.
SALIENCE_PROBS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.995, 0.999, 0.9995)
# Keys seen by fewer sampled far rows than this are left out of the salience estimate.
SALIENCE_MIN_ROWS = 24
# Key lags of the salience autocorrelation and query lags of the residual correlation.
SALIENCE_LAGS = (1, 4)
QUERY_LAGS = (1, 16)
# Whether the fit moves the measured salience's weight to the vertical share (damped; off:
# the salience stays as measured and the vertical share is a prediction of the fit, which
# with the measured salience came out 1.5-5x too heavy: docs/workload.md).
FIT_SALIENCE_SCALE = True
# Bounds of one round's factor on the salience weight (the shared fit): with (0.8, 1.25) ten
# rounds can lower it to 0.8^10 = 0.11 at most, where the fit of layer 27 ended (docs/workload.md).
SALIENCE_STEP = (0.8, 1.25)
# Keys of the moving mean taken off the key effect before its statistics.
SALIENCE_TREND = 257
# Salience channels at most (a GQA group larger than this shares them modulo).
SALIENCE_CHANNELS = 8
# Fits and the layer workloads are made at this head size: the scores are calibrated, not D
# (a capture at D = 64 is fitted by a D = 128 workload with the same score statistics).
FIT_HEAD_DIM = 128
DEFAULT_RULE = "sink-log"
WORKLOADS = ("synthetic", "calibrated")
# The fit shipped with the package: SmolLM2-135M, every layer, N = 8192.
DEFAULT_CALIBRATION = Path(__file__).parent / "workloads" / "smollm2-8k.json"
# Floor of a share in the log-ratio updates (a share of 1e-6 is "none").
_SHARE_FLOOR = 1e-6
_WEIGHT_MIN = -8.0
_WEIGHT_MAX = 30.0


# -- statistics --------------------------------------------------------------------------


@dataclass
class Stats:
    """Structure statistics of one layer (see the module doc); lists are per query head
    (`keep` per KV head)."""

    seqlen: int
    rows: int
    sink: list[float]
    local: list[float]
    vertical: list[float]
    slash: list[float]
    rest: list[float]
    profile: list[list[float]]
    oracle: list[list[float]]
    keep: list[list[float]] = field(default_factory=list)
    slash_offsets: list[list[int]] = field(default_factory=list)
    bands: list[list[float]] = field(default_factory=list)
    # Shared far-field structure per query head (`score_structure`); empty when not measured.
    salience: list[list[float]] = field(default_factory=list)
    salience_ac: list[list[float]] = field(default_factory=list)
    salience_group: list[float] = field(default_factory=list)
    residual: list[float] = field(default_factory=list)
    query_ac: list[list[float]] = field(default_factory=list)

    def shares(self, h: int) -> dict[str, float]:
        """The five disjoint shares of head `h`."""
        return {"sink": self.sink[h], "local": self.local[h], "vertical": self.vertical[h],
                "slash": self.slash[h], "rest": self.rest[h]}


def sample_rows(seqlen: int, rows: int) -> torch.Tensor:
    """`rows` query positions spread evenly over `[0, N)` (all of them if N <= rows)."""
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if seqlen <= rows:
        return torch.arange(seqlen)
    spread = torch.linspace(0, seqlen - 1, rows, dtype=torch.float64).round().to(torch.int64)
    return torch.tensor(sorted(set(spread.tolist())), dtype=torch.int64)


def _row_probs(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax of `rows` in float64: `[Hq, R, N]` (batch 0)."""
    hq, hkv = q.shape[1], k.shape[1]
    kk = k[0].to(torch.float64).repeat_interleave(hq // hkv, dim=0)
    qq = q[0, :, rows].to(torch.float64)
    scores = torch.matmul(qq, kk.transpose(-1, -2)) * scale
    causal = torch.arange(k.shape[2])[None, :] <= rows[:, None]
    return torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)


def attention_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float | None = None,
    rows: int = 256,
    with_keep: bool = True,
    with_structure: bool = True,
    slash_first: bool = False,
    slash_select: str = "mean",
) -> Stats:
    """Structure statistics of one layer's attention (batch 0; see the module doc).

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`; any float dtype (math in float64).
        scale: softmax scale, `1/sqrt(D)` if None.
        rows: query rows sampled evenly over the sequence.
        with_keep: also measure Delta-KV keep ratios per KV head.
        with_structure: also measure the far field's shared structure (`score_structure`).
        slash_first: take the slash diagonals before the vertical columns (the shared fit's
            order): the vertical columns first (the default, the first fit's order) count a
            sharp slash as vertical lines, one heavy column per sampled row (docs/workload.md).
        slash_select: how the slash diagonals are ranked (`SLASH_SELECT`): "mean" far mass over
            the rows that have them, or "median" over them among the diagonals at least
            `SLASH_MIN_ROWS` rows have: with the mean, a heavy key column counts as a slash on the
            long diagonals that few sampled rows reach (docs/workload.md).

    Returns:
        A `Stats`.

    Raises:
        ValueError: bad shapes, `rows < 1` or an unknown `slash_select`.
    """
    from .reference._checks import check_qk, resolve_scale

    if slash_select not in SLASH_SELECT:
        raise ValueError(f"slash_select must be one of {SLASH_SELECT}, got {slash_select!r}")
    shape = check_qk(q, k)
    n, hq, hkv = shape.seqlen, shape.q_heads, shape.kv_heads
    sm_scale = resolve_scale(scale, shape.head_dim)
    idx = sample_rows(n, rows)
    p = _row_probs(q, k, idx, sm_scale)  # [Hq, R, N]
    r = int(idx.numel())
    keys = torch.arange(n)
    dist = idx[:, None] - keys[None, :]  # [R, N]; negative: not causal (p = 0 there)
    # One pass sums the mass per (head, row, category): category 0 sink, 1 + b distance
    # band b of PROFILE_EDGES (non-sink), the last one non-causal.
    edges = torch.tensor([*PROFILE_EDGES, n + 1])
    band = torch.bucketize(dist, edges, right=True) - 1  # -1 below 0 (non-causal)
    cats = len(PROFILE_EDGES) + 2
    cat = torch.where(dist < 0, cats - 1, band + 1)
    cat = torch.where(keys[None, :] < SINK_KEYS, torch.where(dist < 0, cats - 1, 0), cat)
    per = torch.zeros(hq, r, cats, dtype=torch.float64)
    per.scatter_add_(2, cat.expand(hq, -1, -1), p)
    sink = per[..., 0].mean(-1)
    profile = per[..., 1:cats - 1].mean(1)  # [Hq, bands]
    far = (dist >= LOCAL) & (keys[None, :] >= SINK_KEYS)
    local = (1.0 - per[..., 0] - per[..., cats - 1]).mean(-1) - profile[:, PROFILE_EDGES.index(LOCAL):].sum(-1)
    top = max(1, n // 100)
    p_far = p * far
    # Diagonals i - j of most mean far mass (over the rows that have them) and key columns of
    # most mean far mass; with `slash_first` the columns are taken off the slash diagonals,
    # else the slashes off the columns.
    dist_idx = dist.clamp(min=0, max=n).expand(hq, -1, -1).reshape(hq, -1)
    diag_sum = torch.zeros(hq, n + 1, dtype=torch.float64)
    diag_sum.scatter_add_(1, dist_idx, p_far.reshape(hq, -1))
    diag_rows = torch.bincount(dist.clamp(min=0, max=n)[far].reshape(-1), minlength=n + 1).to(torch.float64)
    diag_mean = diag_sum / diag_rows.clamp(min=1)
    if slash_select == "median":
        # Per diagonal d the median over the rows i >= d of p[i, i - d] (far keys only).
        d = torch.arange(n + 1)
        key = idx[:, None] - d[None, :]  # [R, N + 1]
        ok = (key >= SINK_KEYS) & (d[None, :] >= LOCAL)
        vals = torch.gather(p_far, 2, key.clamp(min=0, max=n - 1).expand(hq, -1, -1))
        med = torch.nanmedian(vals.masked_fill(~ok, math.nan), dim=1).values
        diag_mean = torch.where((ok.sum(0) >= SLASH_MIN_ROWS)[None, :], torch.nan_to_num(med, nan=-1.0), -1.0)
    diag_mean[:, :LOCAL] = -1.0
    sdiag = diag_mean.topk(min(top, n), dim=-1).indices  # [Hq, top]
    is_slash_d = torch.zeros(hq, n + 1, dtype=torch.bool)
    is_slash_d.scatter_(1, sdiag, True)
    on_slash = torch.gather(is_slash_d, 1, dist_idx).view(hq, r, n)
    p_cols = p_far.masked_fill(on_slash, 0.0) if slash_first else p_far
    vcols = p_cols.mean(1).topk(min(top, n), dim=-1).indices
    is_vert = torch.zeros(hq, n, dtype=torch.bool)
    is_vert.scatter_(1, vcols, True)
    vertical = (p_cols * is_vert[:, None, :]).sum(-1).mean(-1)
    p_diag = p_far if slash_first else p_far.masked_fill(is_vert[:, None, :], 0.0)
    slash = (p_diag * on_slash).sum(-1).mean(-1)
    # Non-sink mass per PROFILE_BANDS band (what the score profile is fitted to).
    fine_edges = torch.tensor([*PROFILE_BANDS, 2 ** 40])
    fine = (torch.bucketize(dist.clamp(min=0), fine_edges, right=True) - 1).clamp(max=len(PROFILE_BANDS) - 1)
    fine = torch.where((dist < 0) | (keys[None, :] < SINK_KEYS), len(PROFILE_BANDS), fine)
    per_band = torch.zeros(hq, r, len(PROFILE_BANDS) + 1, dtype=torch.float64)
    per_band.scatter_add_(2, fine.expand(hq, -1, -1), p)
    bands = per_band[..., :-1].mean(1)
    rest = 1.0 - sink - local - vertical - slash
    oracle = _oracle_rows(p, idx)
    # The KV head's strongest diagonals (mean over its query heads) seed the slash offsets.
    group = hq // hkv
    offsets = []
    for j in range(hkv):
        mean = diag_mean[j * group:(j + 1) * group].mean(0)
        offsets.append([int(x) for x in mean.topk(min(SLASH_OFFSETS, n + 1)).indices.tolist() if x >= LOCAL])
    keep = keep_ratios(k) if with_keep else []
    structure = score_structure(q, k, scale=sm_scale) if with_structure else {}
    return Stats(seqlen=n, rows=int(idx.numel()), sink=sink.tolist(), local=local.tolist(),
                 vertical=vertical.tolist(), slash=slash.tolist(), rest=rest.tolist(),
                 profile=profile.tolist(), oracle=oracle.tolist(), keep=keep,
                 slash_offsets=offsets, bands=bands.tolist(), **structure)


def _lag_corr(x: torch.Tensor, lag: int) -> float:
    """Autocorrelation of a 1-D sequence at `lag` (0 if too short or constant)."""
    c = x - x.mean()
    var = float((c * c).mean())
    if c.numel() <= lag or var <= 0.0:
        return 0.0
    return float((c[lag:] * c[:-lag]).mean()) / var


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation of two 1-D sequences (0 if either is constant)."""
    x, y = a - a.mean(), b - b.mean()
    den = float(x.norm() * y.norm())
    return float((x * y).sum()) / den if den > 0 else 0.0


def score_structure(q: torch.Tensor, k: torch.Tensor, *, scale: float | None = None,
                    base_rows: int = 64) -> dict[str, list[Any]]:
    """Shared structure of the far field (`i - j >= LOCAL`, not sink) of every query head,
    from the scores themselves (batch 0, float64):

    * the scores of `base_rows` rows spread over the last three quarters of the sequence, and of
      the rows 1 and 16 after each, minus each row's far mean, split into a key effect
      (`salience`: the mean over the rows that see key j, keys seen by at least
      `SALIENCE_MIN_ROWS` rows) and a residual;
    * `salience`: the key effect's quantiles at `SALIENCE_PROBS` minus its median, shrunk by
      the share of its variance that the finite row count adds (`residual^2 / rows`);
    * `salience_ac`: its autocorrelation along the keys at `SALIENCE_LAGS` (runs of heavy
      keys), corrected for that noise; `salience_group`: its correlation with the mean key
      effect of the GQA group (how much the group's heads share heavy keys);
    * `residual`: the residual's standard deviation (per-query variation, nats);
    * `query_ac`: the residual's correlation between rows `QUERY_LAGS` apart (queries in runs).

    Returns a dict of per-query-head lists; empty lists when N is too short
    (`N < 2 LOCAL + 64`).
    """
    from .reference._checks import check_qk, resolve_scale

    shape = check_qk(q, k)
    n, hq, hkv = shape.seqlen, shape.q_heads, shape.kv_heads
    out: dict[str, list[Any]] = {"salience": [], "salience_ac": [], "salience_group": [], "residual": [],
                                 "query_ac": []}
    if n < 2 * LOCAL + 64:
        return out
    sm = resolve_scale(scale, shape.head_dim)
    top = n - 1 - max(QUERY_LAGS)
    base = sample_rows(top - n // 4, base_rows) + n // 4
    rows = torch.unique(torch.cat([base, *(base + lag for lag in QUERY_LAGS)]))
    where = {int(r): i for i, r in enumerate(rows.tolist())}
    keys = torch.arange(n)
    far = ((rows[:, None] - keys[None, :]) >= LOCAL) & (keys[None, :] >= SINK_KEYS)  # [R, N]
    cnt = far.sum(0)
    ok = cnt >= SALIENCE_MIN_ROWS
    group = hq // hkv
    probs = torch.tensor(SALIENCE_PROBS, dtype=torch.float64)
    cols = []
    for h in range(hq):
        s = torch.matmul(q[0, h, rows].to(torch.float64), k[0, h // group].to(torch.float64).T) * sm
        r = torch.where(far, s, 0.0)
        r = torch.where(far, r - r.sum(1, keepdim=True) / far.sum(1, keepdim=True).clamp(min=1), 0.0)
        col = r.sum(0) / cnt.clamp(min=1)
        resid = torch.where(far, r - col[None, :], 0.0)
        res_var = float((resid * resid).sum() / far.sum())
        # Detrended: minus its moving mean over SALIENCE_TREND keys (a smooth trend along the
        # keys is the distance profile's, which the generator draws apart).
        c = col[ok]
        pad = SALIENCE_TREND // 2
        trend = torch.nn.functional.avg_pool1d(
            torch.nn.functional.pad(c[None, None], (pad, pad), mode="replicate"), SALIENCE_TREND, 1)[0, 0]
        c = c - trend[:c.numel()]
        noise_var = float((res_var / cnt[ok].double()).mean())
        shrink = math.sqrt(max(0.1, 1.0 - noise_var / max(float(c.var()), 1e-12)))
        quant = (torch.quantile(c, probs) - c.median()) * shrink
        out["salience"].append([float(x) for x in quant])
        out["salience_ac"].append([min(0.99, max(0.0, _lag_corr(c, lag) / shrink ** 2)) for lag in SALIENCE_LAGS])
        out["residual"].append(math.sqrt(res_var))
        corr = []
        ib = torch.tensor([where[b] for b in base.tolist()])
        m = far[ib].to(torch.float64)
        for lag in QUERY_LAGS:
            il = torch.tensor([where[b + lag] for b in base.tolist()])
            x, y = resid[ib], resid[il]
            x = (x - (x * m).sum(1, keepdim=True) / m.sum(1, keepdim=True)) * m
            y = (y - (y * m).sum(1, keepdim=True) / m.sum(1, keepdim=True)) * m
            den = x.norm(dim=1) * y.norm(dim=1)
            good = den > 0
            val = float(((x * y).sum(1)[good] / den[good]).mean()) if bool(good.any()) else 0.0
            corr.append(max(0.0, val))
        out["query_ac"].append(corr)
        cols.append(c)
    for h in range(hq):
        # Mean correlation with the group's other heads (1 without any): the shared part.
        j = h // group
        others = [cols[o] for o in range(j * group, (j + 1) * group) if o != h]
        out["salience_group"].append(
            max(0.0, min(1.0, sum(_corr(cols[h], o) for o in others) / len(others))) if others else 1.0)
    return out


def _oracle_rows(p: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Oracle density at `ORACLE_SHARES` of the sampled rows: `[Hq, S]` (kept keys over
    the rows' causal pairs, the estimator of `oracle.oracle_density` on these rows)."""
    # Ordered in float32 (faster; near-ties may swap, which moves no sum), summed in float64.
    order = torch.argsort(p.to(torch.float32), dim=-1, descending=True)
    cum = torch.gather(p, -1, order).cumsum(-1)
    want = torch.tensor(ORACLE_SHARES, dtype=torch.float64)
    below = (cum.unsqueeze(-1) < want - 1e-12).sum(-2)  # [Hq, R, S]
    needed = (below + 1).clamp(max=(idx + 1)[None, :, None])
    return needed.sum(1).to(torch.float64) / float((idx + 1).sum())


def keep_ratios(k: torch.Tensor, thresholds: Sequence[float] = KEEP_THRESHOLDS) -> list[list[float]]:
    """Delta-KV keep ratio per (batch row, KV head) at `thresholds` (cosine, first
    `KEEP_KEYS` keys): `[B * Hkv][len(thresholds)]`."""
    from .reference.delta_kv import delta_keep_mask

    kk = k[:, :, :KEEP_KEYS]
    ratios = [delta_keep_mask(kk, threshold=t, metric="cosine", chunk=KEEP_CHUNK).double().mean(-1).reshape(-1)
              for t in thresholds]
    table: list[list[float]] = torch.stack(ratios, -1).tolist()
    return table


# -- parameters ----------------------------------------------------------------------------


@dataclass(frozen=True)
class HeadParams:
    """Logit weights (nats) of one query head; see the module doc."""

    sink: float = 3.0
    vertical: float = 2.0
    # Score (nats) at the centre of each PROFILE_BANDS band; beyond the last fitted band
    # the last value holds.
    profile: tuple[float, ...] = ()
    slash: float = 1.0
    noise: float = 1.0
    # Shared far-field structure (empty salience: none). Key salience z_j, in nats, at
    # SALIENCE_PROBS of its distribution; its weight; its correlation with the group's
    # shared salience; the queries' noise in runs (`run_length`, `jitter` as the keys').
    salience: tuple[float, ...] = ()
    salience_scale: float = 1.0
    salience_group: float = 1.0
    query_run: float = 1.0
    query_jitter: float = 1.0


@dataclass(frozen=True)
class KVParams:
    """Key structure of one KV head: slash offsets, runs and cosine offset; see the module doc."""

    slash_offsets: tuple[int, ...] = ()
    run_length: float = 1.0
    key_offset: float = 0.0
    vertical_fraction: float = VERTICAL_FRACTION
    # Runs of the salience sequence along the keys (heavy keys come in runs).
    salience_run: float = 1.0
    salience_jitter: float = 1.0
    # Key 0 carries only the sink, its cosine offset and the rotary channels (no random
    # vertical, slash, noise or salience content): the sink's logit then does not move by
    # several nats from draw to draw (docs/workload.md, "one head's statistics depend on
    # the draw").
    clean_sink: bool = False


@dataclass(frozen=True)
class LayerParams:
    """One fitted layer: `heads[h]` for query head h, `kv[j]` for KV head j, at `seqlen`."""

    layer: int
    seqlen: int
    heads: tuple[HeadParams, ...]
    kv: tuple[KVParams, ...]
    # The statistic the layer was fitted with (`attention_stats(slash_select=...)`).
    slash_select: str = "mean"


@dataclass(frozen=True)
class Calibration:
    """A fitted workload: its layers, where they came from and the rule to other lengths."""

    source: str
    layers: tuple[LayerParams, ...]
    rule: str = DEFAULT_RULE

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (`from_json` reads it back)."""
        return asdict(self)

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Calibration:
        """Read `to_json`'s dict.

        Raises:
            ValueError: an unknown rule or a layer without heads.
        """
        layers = []
        for item in data["layers"]:
            heads = tuple(HeadParams(**{**h, "profile": tuple(h["profile"]),
                                        "salience": tuple(h.get("salience", ()))}) for h in item["heads"])
            kv = tuple(KVParams(**{**j, "slash_offsets": tuple(j["slash_offsets"])}) for j in item["kv"])
            if not heads or not kv or len(heads) % len(kv):
                raise ValueError(f"layer {item['layer']}: {len(heads)} query heads for {len(kv)} KV heads")
            layers.append(LayerParams(int(item["layer"]), int(item["seqlen"]), heads, kv,
                                      str(item.get("slash_select", "mean"))))
        rule = str(data.get("rule", DEFAULT_RULE))
        check_rule(rule)
        return Calibration(str(data["source"]), tuple(layers), rule)


def check_rule(rule: object) -> str:
    """Raises ValueError unless `rule` is one of `RULES`."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    return str(rule)


def load_calibration(path: str | Path | None = None) -> Calibration:
    """Read a calibration JSON (default: the shipped SmolLM2 8K fit).

    Raises:
        FileNotFoundError: no such file. ValueError: a malformed one.
    """
    where = Path(path) if path is not None else DEFAULT_CALIBRATION
    return Calibration.from_json(json.loads(where.read_text()))


# -- generator -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """Channel ranges of the generator for a head dimension."""

    rotary: slice
    slash: slice
    noise: slice
    salience: slice


# Channels per part at head_dim 128, after 0: sink, 1: vertical, 2: key offset: rotary
# pairs of the distance profile, slash codes, noise.
_PARTS_128 = (80, 20, 25)


def _layout(head_dim: int, salience: int = 0) -> _Layout:
    # Below D = 128 every part shrinks in proportion (fewer rotary pairs: a coarser
    # profile; fewer slash and noise channels: a noisier slash). Above 128 the extra
    # channels stay zero, so the score distribution is that of D = 128. `salience`
    # channels, when asked for, come off the end of the noise part.
    usable = min(head_dim, 128) - 3
    rot = max(2, (_PARTS_128[0] * usable // 125) // 2 * 2)
    slash = max(2, _PARTS_128[1] * usable // 125)
    end = 3 + usable - salience
    return _Layout(rotary=slice(3, 3 + rot), slash=slice(3 + rot, 3 + rot + slash),
                   noise=slice(3 + rot + slash, end), salience=slice(end, 3 + usable))


def _frequencies(pairs: int) -> torch.Tensor:
    """Rotary frequencies of the profile, geometric from pi down to ROTARY_MIN."""
    if pairs == 1:
        return torch.tensor([math.pi], dtype=torch.float64)
    return math.pi * (ROTARY_MIN / math.pi) ** (torch.arange(pairs, dtype=torch.float64) / (pairs - 1))


def profile_at(profile: Sequence[float], dist: torch.Tensor) -> torch.Tensor:
    """The score profile at distances `dist` (linear in log(1 + distance) between band
    centres; constant past the last band)."""
    bands = torch.tensor([*PROFILE_BANDS, 2 ** 40], dtype=torch.float64)
    centres = torch.log1p(torch.sqrt(bands[:-1] * (bands[1:] - 1).clamp(min=bands[:-1])))[:len(profile)]
    values = torch.tensor(list(profile), dtype=torch.float64)
    x = torch.log1p(dist.to(torch.float64))
    i = torch.searchsorted(centres, x).clamp(1, max(1, len(profile) - 1))
    if len(profile) == 1:
        return values.expand_as(x).clone()
    x0, x1 = centres[i - 1], centres[i]
    t = ((x - x0) / (x1 - x0)).clamp(0.0, 1.0)
    return values[i - 1] + t * (values[i] - values[i - 1])


@functools.lru_cache(maxsize=256)
def _rotary_weights_cached(profile: tuple[float, ...], seqlen: int, pairs: int) -> torch.Tensor:
    return rotary_weights(profile, seqlen, pairs)


def rotary_weights(profile: Sequence[float], seqlen: int, pairs: int) -> torch.Tensor:
    """Per-frequency weights `c` with `sum_f c_f cos(theta_f d)` closest to the profile.

    Ridge least squares over every distance below 1024 and 1024 log-spaced ones up to N
    (the far field as heavy as the near one); the ridge keeps the weights, hence fp16 /
    bf16 rounding of q, small.
    """
    near = torch.arange(min(seqlen, 1024), dtype=torch.float64)
    far = (torch.logspace(math.log10(1024), math.log10(max(seqlen, 1025)), 1024, dtype=torch.float64)
           if seqlen > 1024 else torch.empty(0, dtype=torch.float64))
    dist = torch.cat([near, far.round()])
    target = profile_at(profile, dist)
    target = target - target[-1]  # a constant shift does not change a softmax
    a = torch.cos(dist[:, None] * _frequencies(pairs)[None, :])
    gram = a.T @ a
    ridge = 1e-3 * float(gram.diagonal().mean()) * torch.eye(pairs, dtype=torch.float64)
    weights: torch.Tensor = torch.linalg.solve(gram + ridge, a.T @ target)
    return weights


def _runs(gen: torch.Generator, rows: int, n: int, dims: int, run_length: Sequence[float],
          jitter: Sequence[float] | None = None) -> torch.Tensor:
    """Contents `[rows, n, dims]` in runs: a run shares one Gaussian vector, each position
    adds jitter (`jitter[row]`, default `RUN_JITTER`); a new run starts with probability
    `1 / run_length[row]`. Unit variance; the correlation at lag L is
    `(1 - jitter^2) (1 - 1 / run_length)^L`."""
    base = torch.randn(rows, n, dims, generator=gen, dtype=torch.float64)
    noise = torch.randn(rows, n, dims, generator=gen, dtype=torch.float64)
    start_p = torch.tensor([1.0 / max(1.0, r) for r in run_length], dtype=torch.float64)
    starts = torch.rand(rows, n, generator=gen, dtype=torch.float64) < start_p[:, None]
    starts[:, 0] = True
    pos = torch.arange(n).expand(rows, n)
    # The run's vector is the base vector at the run's first position.
    first_pos = torch.cummax(torch.where(starts, pos, 0), dim=1).values
    shared = torch.gather(base, 1, first_pos[..., None].expand(rows, n, dims))
    jit = torch.tensor([RUN_JITTER] * rows if jitter is None else list(jitter), dtype=torch.float64)[:, None, None]
    return shared * torch.sqrt(1 - jit ** 2) + noise * jit


def runs_from_correlation(c_short: float, c_long: float, lags: tuple[int, int]) -> tuple[float, float]:
    """`(run_length, jitter)` of `_runs` whose correlation is `c_short` at `lags[0]` and
    `c_long` at `lags[1]` (`(1 - jitter^2) (1 - 1/run)^L`), clipped to a valid model."""
    c0, c1 = max(1e-3, min(0.99, c_short)), max(0.0, min(0.99, c_long))
    if c0 <= 1e-3:
        return 1.0, 1.0
    r = (max(c1, 1e-6) / c0) ** (1.0 / (lags[1] - lags[0])) if c1 < c0 else 0.999
    r = max(0.0, min(0.999, r))
    w = min(0.99, c0 / max(r ** lags[0], 1e-6))
    return 1.0 / (1.0 - r), math.sqrt(1.0 - w)


def _normal_icdf(p: torch.Tensor) -> torch.Tensor:
    return math.sqrt(2.0) * torch.erfinv(2.0 * p - 1.0)


def salience_values(quantiles: Sequence[float], latent: torch.Tensor) -> torch.Tensor:
    """Map standard-normal `latent` values to the salience distribution given by its
    `quantiles` at `SALIENCE_PROBS` (linear in normal scores, flat beyond the ends)."""
    t = _normal_icdf(torch.tensor(SALIENCE_PROBS, dtype=torch.float64))
    vals = torch.tensor(list(quantiles), dtype=torch.float64)
    x = latent.clamp(float(t[0]), float(t[-1]))
    i = torch.searchsorted(t, x.contiguous()).clamp(1, len(t) - 1)
    t0, t1 = t[i - 1], t[i]
    return vals[i - 1] + (x - t0) / (t1 - t0) * (vals[i] - vals[i - 1])


def generate_layer(
    heads: Sequence[HeadParams],
    kv: Sequence[KVParams],
    shape: Shape,
    *,
    seed: int = 0,
    fit_seqlen: int | None = None,
    rule: str = DEFAULT_RULE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 CPU q, k, v of one layer from per-head parameters (see the module doc).

    Args:
        heads: `Hq` query-head parameters; kv: `Hkv` KV-head parameters.
        shape: sizes (`shape.dtype` is ignored here: the result is float64).
        seed: all randomness comes from a generator seeded with it.
        fit_seqlen: the length the parameters were fitted at (for `rule`); None: N.
        rule: how weights carry to N (`RULES`).

    Returns:
        `(q, k, v)` float64 on the CPU.

    Raises:
        ValueError: head counts that do not match `shape`, or `head_dim < 16`.
    """
    b, hq, hkv, n, d = shape.batch, shape.q_heads, shape.kv_heads, shape.seqlen, shape.head_dim
    check_rule(rule)
    if len(heads) != hq or len(kv) != hkv or hq % hkv:
        raise ValueError(f"{len(heads)} head and {len(kv)} KV parameters for q_heads={hq}, kv_heads={hkv}")
    if d < 16:
        raise ValueError(f"head_dim must be >= 16, got {d}")
    group = hq // hkv
    sal = min(group, SALIENCE_CHANNELS) if any(p.salience for p in heads) else 0
    lay = _layout(d, sal)
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    scale = 1.0 / math.sqrt(d)
    sink_shift = math.log(n / fit_seqlen) if rule == "sink-log" and fit_seqlen else 0.0
    rows = b * hkv
    k = torch.zeros(rows, n, d, dtype=f64)
    q = torch.zeros(b, hq, n, d, dtype=f64)
    v = torch.randn(b, hkv, n, d, generator=gen, dtype=f64)
    k[:, 0, 0] = 1.0
    heavy = torch.rand(rows, n, generator=gen, dtype=f64) < torch.tensor(
        [kv[r % hkv].vertical_fraction for r in range(rows)], dtype=f64)[:, None]
    k[..., 1] = torch.where(heavy, 0.5 + 0.5 * torch.rand(rows, n, generator=gen, dtype=f64), 0.0)
    k[..., 2] = torch.tensor([kv[r % hkv].key_offset for r in range(rows)], dtype=f64)[:, None]
    pairs = (lay.rotary.stop - lay.rotary.start) // 2
    theta = _frequencies(pairs)
    pos = torch.arange(n, dtype=f64)
    # Unit key vectors turned by position; query h carries its weights: q_i . k_j =
    # sum_f c_hf cos(theta_f (i - j)) (demo._rotate's pairs).
    unit = torch.zeros(n, 2 * pairs, dtype=f64)
    unit[:, 0::2] = 1.0
    turned = _rotate(unit, pos, theta)
    k[..., lay.rotary] = turned
    ds = lay.slash.stop - lay.slash.start
    reach = max([0, *(o for j in kv for o in j.slash_offsets)])
    codes = torch.randn(rows, n + reach, ds, generator=gen, dtype=f64)
    for r in range(rows):
        for o in kv[r % hkv].slash_offsets:
            k[r, :, lay.slash] += codes[r, o:o + n]
    dn = lay.noise.stop - lay.noise.start
    k[..., lay.noise] = _runs(gen, rows, n, dn, [kv[r % hkv].run_length for r in range(rows)])
    if all(p.query_run <= 1.0 and p.query_jitter >= 1.0 for p in heads):
        x = torch.randn(b, hq, n, dn, generator=gen, dtype=f64)
    else:  # queries in runs: nearby queries' noise correlated, so they favour the same keys
        x = _runs(gen, b * hq, n, dn, [heads[r % hq].query_run for r in range(b * hq)],
                  [heads[r % hq].query_jitter for r in range(b * hq)]).view(b, hq, n, dn)
    if sal:
        # Key salience: per KV head a shared latent sequence in runs, per salience channel t
        # (query head t of the group) its own part, mixed by that head's group correlation,
        # mapped through the head's salience quantiles. Channel t is query head t's alone.
        kvr = [kv[r % hkv] for r in range(rows)]
        shared = _runs(gen, rows, n, 1, [x.salience_run for x in kvr], [x.salience_jitter for x in kvr])[..., 0]
        own = _runs(gen, rows * sal, n, 1, [kvr[r // sal].salience_run for r in range(rows * sal)],
                    [kvr[r // sal].salience_jitter for r in range(rows * sal)]).view(rows, sal, n)
        for r in range(rows):
            for t in range(sal):
                hp = heads[(r % hkv) * group + t]
                if hp.salience:
                    c = max(0.0, min(1.0, hp.salience_group))
                    latent = math.sqrt(c) * shared[r] + math.sqrt(1.0 - c) * own[r, t]
                    k[r, :, lay.salience.start + t] = salience_values(hp.salience, latent)
    for r in range(rows):
        if kv[r % hkv].clean_sink:
            k[r, 0, 1] = 0.0
            for part in (lay.slash, lay.noise, lay.salience):
                k[r, 0, part] = 0.0
    k = k.view(b, hkv, n, d)
    codes = codes.view(b, hkv, n + reach, ds)
    for h, p in enumerate(heads):
        j = h // group
        q[:, h, :, 0] = (p.sink + sink_shift) / scale
        q[:, h, :, 1] = p.vertical / scale
        if p.profile:
            # Query heads of other shapes repeat fitted heads: one solve per distinct profile.
            weights = _rotary_weights_cached(tuple(p.profile), n, pairs)
            q[:, h, :, lay.rotary] = turned * (weights / scale).repeat_interleave(2)
        q[:, h, :, lay.slash] = codes[:, j, :n] * (p.slash / (ds * scale))
        q[:, h, :, lay.noise] = x[:, h] * (p.noise / (math.sqrt(dn) * scale))
        if sal and p.salience:
            q[:, h, :, lay.salience.start + (h % group) % sal] = p.salience_scale / scale
    return q, k, v


def _pool(calibration: Calibration) -> list[tuple[LayerParams, int]]:
    """Every fitted KV head: (layer, KV head index), layers in order."""
    return [(layer, j) for layer in calibration.layers for j in range(len(layer.kv))]


def calibrated_qkv(
    shape: Shape,
    *,
    device: torch.device,
    seed: int = 0,
    calibration: Calibration | None = None,
    layer: int | None = None,
    rule: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of the calibrated workload at any shape (see the module doc).

    Args:
        shape: sizes and dtype (`head_dim >= 16`).
        device: where the tensors go (built in float64 on the CPU first, as the demo's).
        seed: randomness.
        calibration: the fit (default: the shipped SmolLM2 8K fit, `DEFAULT_CALIBRATION`).
        layer: use only this fitted layer (its heads in turn); None: KV heads spread over
            all fitted layers.
        rule: rule to other lengths (default: the calibration's).

    Returns:
        `(q, k, v)`: `q: [B, Hq, N, D]`, `k, v: [B, Hkv, N, D]` in `shape.dtype`.

    Raises:
        ValueError: bad shape, an unknown layer or rule.
    """
    if shape.head_dim < 16 or shape.q_heads % shape.kv_heads or shape.seqlen < 1:
        raise ValueError(f"shape needs head_dim >= 16, q_heads a multiple of kv_heads, seqlen >= 1; got {shape}")
    cal = calibration if calibration is not None else load_calibration()
    chosen = check_rule(rule if rule is not None else cal.rule)
    layers = [x for x in cal.layers if layer is None or x.layer == layer]
    if not layers:
        raise ValueError(f"layer {layer} is not in the calibration (layers {[x.layer for x in cal.layers]})")
    pool = _pool(replace(cal, layers=tuple(layers)))
    hkv, group = shape.kv_heads, shape.q_heads // shape.kv_heads
    picks = [pool[(j * len(pool)) // hkv] if hkv <= len(pool) else pool[j % len(pool)] for j in range(hkv)]
    heads: list[HeadParams] = []
    kv: list[KVParams] = []
    fit_n = {lp.seqlen for lp, _ in picks}
    for lp, j in picks:
        g0 = len(lp.heads) // len(lp.kv)
        kv.append(lp.kv[j])
        heads += [lp.heads[j * g0 + (t % g0)] for t in range(group)]
    q, k, v = generate_layer(heads, kv, shape, seed=seed, fit_seqlen=max(fit_n), rule=chosen)
    return tuple(t.to(device=device, dtype=shape.dtype) for t in (q, k, v))  # type: ignore[return-value]


# -- fitting -------------------------------------------------------------------------------


def _log_ratio(target: float, got: float, clip: float = 2.0, damping: float = 0.8) -> float:
    r = damping * math.log(max(target, _SHARE_FLOOR) / max(got, _SHARE_FLOOR))
    return max(-clip, min(clip, r))


def fit_keys(kv: list[KVParams], target_keep: Sequence[Sequence[float]], shape: Shape, *,
             seed: int = 0, steps: int = 6) -> list[KVParams]:
    """Fit each KV head's `run_length` and `key_offset` to its keep ratios.

    For every run length of `RUN_LENGTHS` at once (one batch row each), bisection on
    `key_offset` matches the keep ratio at similarity 0.83; the run length whose keep
    curve is closest over all `KEEP_THRESHOLDS` wins. Keys do not depend on the query
    weights, so this runs before the logit fit.
    """
    hkv, runs = len(kv), len(RUN_LENGTHS)
    small = Shape(runs, hkv, hkv, min(shape.seqlen, KEEP_KEYS), shape.head_dim, torch.float64)
    dummy = [HeadParams()] * hkv
    mid = KEEP_THRESHOLDS[KEEP_THRESHOLDS.index(0.83)]
    lo = torch.zeros(runs, hkv, dtype=torch.float64)
    hi = torch.full((runs, hkv), 64.0, dtype=torch.float64)

    def keys(offset: torch.Tensor) -> torch.Tensor:
        k = torch.cat([generate_layer(dummy, [replace(x, run_length=run, key_offset=float(offset[i, j]))
                                              for j, x in enumerate(kv)],
                                      replace(small, batch=1), seed=seed)[1] for i, run in enumerate(RUN_LENGTHS)])
        return k

    want = torch.tensor([t[KEEP_THRESHOLDS.index(mid)] for t in target_keep], dtype=torch.float64)
    for _ in range(steps):
        mid_offset = 0.5 * (lo + hi)
        got = torch.tensor(keep_ratios(keys(mid_offset), (mid,)), dtype=torch.float64).view(runs, hkv)
        # More offset: more similar keys, fewer kept.
        more = got > want[None, :]
        lo = torch.where(more, mid_offset, lo)
        hi = torch.where(more, hi, mid_offset)
    offset = 0.5 * (lo + hi)
    got = torch.tensor(keep_ratios(keys(offset)), dtype=torch.float64).view(runs, hkv, -1)
    target = torch.tensor([list(t) for t in target_keep], dtype=torch.float64)
    best = (got - target[None]).abs().sum(-1).argmin(0)  # [Hkv]
    return [replace(x, run_length=RUN_LENGTHS[int(best[j])], key_offset=float(offset[best[j], j]))
            for j, x in enumerate(kv)]


def fit_layer(
    target: Stats,
    shape: Shape,
    *,
    layer: int = 0,
    iterations: int = 12,
    rows: int = 256,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    shared: bool = False,
    joint_runs: bool = False,
    slash_select: str = "mean",
) -> LayerParams:
    """Fit one layer's generator to `target` statistics (see the module doc).

    `shared=True` (experimental) also draws the far field's shared structure measured by
    `score_structure` (key salience, its runs, queries in runs) with weights in -30..60
    nats; it does not yet reproduce a generated target of its own family
    (docs/workload.md), so the default fit leaves it out. `joint_runs=True` (with `shared`)
    also moves the query runs with the vertical share (a generated vertical share above the
    capture's shortens them: long runs of Gaussian query noise put the same far keys on
    top for a whole run, spurious vertical lines; never longer than measured) and draws
    a clean sink key (`KVParams.clean_sink`).

    Args:
        target: `attention_stats` of the captured layer (with keep ratios).
        shape: the capture's shape (batch 1).
        layer: the layer's index, recorded in the result.
        iterations: fixed-point iterations on the logit weights.
        rows: query rows of the statistics of each iteration (as for the target).
        seed: the workload seed the fit is made on.
        log: progress lines.
        slash_select: the slash statistic of the shared fit (`attention_stats`); `target` must
            have been measured with it.

    Returns:
        The fitted `LayerParams`.
    """
    hq, hkv = shape.q_heads, shape.kv_heads
    group = hq // hkv
    shared = shared and bool(target.salience)
    w_min, w_max = (-30.0, 60.0) if shared else (_WEIGHT_MIN, _WEIGHT_MAX)
    kv = [KVParams(slash_offsets=tuple(o)) for o in target.slash_offsets]
    if shared:
        # Heavy far keys come from the measured salience (no planted vertical keys); its runs
        # along the keys from the group's mean autocorrelation.
        runs = [runs_from_correlation(
            sum(target.salience_ac[h][0] for h in range(j * group, (j + 1) * group)) / group,
            sum(target.salience_ac[h][1] for h in range(j * group, (j + 1) * group)) / group,
            SALIENCE_LAGS) for j in range(hkv)]
        kv = [replace(x, vertical_fraction=0.0, salience_run=runs[j][0], salience_jitter=runs[j][1],
                      clean_sink=joint_runs)
              for j, x in enumerate(kv)]
    if target.keep:
        kv = fit_keys(kv, target.keep, shape, seed=seed)
    n = shape.seqlen
    nb = sum(1 for lo in PROFILE_BANDS if lo < n)
    # Start: the captured mean probability per band (its log is the score profile up to a
    # constant), the sink's log-odds against about N / 2 keys.
    width = [min(hi, n) - lo for lo, hi in zip(PROFILE_BANDS[:nb], [*PROFILE_BANDS[1:], 2 ** 40][:nb])]
    heads = []
    for h in range(hq):
        per_key = [max(m, 1e-12) / w for m, w in zip(target.bands[h][:nb], width)]
        base = math.log(per_key[-1])
        # Scores log(p) reproduce the probabilities p exactly: the profile's and the sink's
        # against the same far-field base.
        extra: dict[str, Any] = {}
        lift = 0.0
        if shared:
            run, jitter = runs_from_correlation(target.query_ac[h][0], target.query_ac[h][1], QUERY_LAGS)
            extra = {"salience": tuple(target.salience[h]), "salience_group": target.salience_group[h],
                     "query_run": run, "query_jitter": jitter, "noise": target.residual[h]}
            # Every non-sink key's mass is raised by E[exp(noise + salience)]: so is the sink's start.
            grid = salience_values(target.salience[h], _normal_icdf(torch.linspace(0.0005, 0.9995, 999,
                                                                                  dtype=torch.float64)))
            lift = target.residual[h] ** 2 / 2 + math.log(float(torch.exp(grid).mean()))
        heads.append(HeadParams(**{
            "sink": min(w_max, math.log(max(target.sink[h], 1e-6)) - base + (lift if shared else 0.0)),
            "vertical": 1.0, "profile": tuple(min(w_max, math.log(x) - base) for x in per_key),
            "slash": 1.0, "noise": 1.0, **extra}))
    measured_run = [p.query_run for p in heads]
    for it in range(iterations):
        q, k, _ = generate_layer(heads, kv, replace(shape, batch=1), seed=seed)
        got = attention_stats(q, k, rows=rows, with_keep=False, with_structure=False, slash_first=shared,
                              slash_select=slash_select)
        new = []
        for h, p in enumerate(heads):
            profile = tuple(
                min(w_max, max(w_min, w + _log_ratio(target.bands[h][b], got.bands[h][b])))
                for b, w in enumerate(p.profile)
            )
            ratio = got.oracle[h][1] / max(target.oracle[h][1], 1e-9)
            # With measured salience its weight carries the vertical share (damped: the
            # share answers steeply); else the planted vertical keys' weight does.
            sal_step = max(SALIENCE_STEP[0], min(SALIENCE_STEP[1], (max(target.vertical[h], _SHARE_FLOOR)
                                                             / max(got.vertical[h], _SHARE_FLOOR)) ** 0.3))
            query_run = p.query_run
            if joint_runs and p.salience and it >= 1:
                over = max(got.vertical[h], _SHARE_FLOOR) / max(target.vertical[h], _SHARE_FLOOR)
                query_run = max(1.0, min(measured_run[h], p.query_run * max(0.5, min(1.25, over ** -0.5))))
            new.append(replace(
                p,
                salience_scale=p.salience_scale * sal_step if p.salience and FIT_SALIENCE_SCALE else p.salience_scale,
                query_run=query_run,
                sink=min(w_max, max(w_min, p.sink + _log_ratio(target.sink[h], got.sink[h]))),
                vertical=min(w_max, max(w_min, p.vertical + _log_ratio(target.vertical[h], got.vertical[h]))),
                profile=profile,
                slash=min(w_max, max(w_min, p.slash + _log_ratio(target.slash[h], got.slash[h]))),
                # The noise sets how concentrated the rest is: tuned once the shares settle.
                # (from the second round when the structure was measured: the start is close).
                noise=(p.noise if it < (1 if p.salience else iterations // 2 - 1)
                       else min(8.0, max(0.05, p.noise * max(0.7, min(1.4, ratio ** 0.7))))),
            ))
        heads = new
        if log is not None:
            err = max(abs(a - b) / max(b, 1e-9) for a, b in zip((o[1] for o in got.oracle),
                                                                  (o[1] for o in target.oracle)))
            log(f"layer {layer} iteration {it}: worst oracle@0.95 relative error {err:.3f}")
    return LayerParams(layer=layer, seqlen=shape.seqlen, heads=tuple(heads), kv=tuple(kv), slash_select=slash_select)


def fit_capture(
    data: Mapping[str, Any],
    *,
    layers: Sequence[int] | None = None,
    max_seqlen: int | None = None,
    rows: int = 256,
    iterations: int = 12,
    log: Callable[[str], None] | None = None,
    shared: bool = False,
    joint_runs: bool = False,
    slash_select: str = "mean",
) -> tuple[Calibration, dict[int, Stats]]:
    """Fit every (or the given) captured layer; also return the captured statistics.

    Args:
        data: a capture (`sparseprefill eval capture`): lists `layers`, `q`, `k`, `scale`.
        layers: which captured layers (default all).
        max_seqlen: fit on the first tokens only (the prefix check).
        rows, iterations, shared, joint_runs, slash_select: as `fit_layer`.

    Returns:
        (the `Calibration`, {layer: captured `Stats`}).

    Raises:
        ValueError: a layer not in the capture, or a capture scale other than 1/sqrt(D)
            (the generator's scores assume it).
    """
    wanted = list(data["layers"]) if layers is None else list(layers)
    missing = sorted(set(wanted) - set(data["layers"]))
    if missing:
        raise ValueError(f"layers {missing} are not in the capture (it has {list(data['layers'])})")
    fitted = []
    stats: dict[int, Stats] = {}
    for i, layer in enumerate(data["layers"]):
        if layer not in wanted:
            continue
        q, k = data["q"][i], data["k"][i]
        if max_seqlen is not None:
            q, k = q[:, :, :max_seqlen], k[:, :, :max_seqlen]
        d = q.shape[-1]
        if not math.isclose(float(data["scale"][i]), d ** -0.5, rel_tol=1e-6):
            raise ValueError(f"layer {layer}: scale {data['scale'][i]} is not 1/sqrt({d})")
        target = attention_stats(q, k, rows=rows, slash_first=shared, slash_select=slash_select)
        stats[int(layer)] = target
        shape = Shape(1, q.shape[1], k.shape[1], q.shape[2], FIT_HEAD_DIM, torch.float64)
        fitted.append(fit_layer(target, shape, layer=int(layer), iterations=iterations, rows=rows, log=log,
                                shared=shared, joint_runs=joint_runs, slash_select=slash_select))
    meta = data.get("meta", {})
    source = f"{meta.get('model', 'capture')}, N={fitted[0].seqlen if fitted else 0}"
    return Calibration(source=source, layers=tuple(fitted)), stats


def layer_capture(calibration: Calibration, layer: int, *, seqlen: int | None = None, seed: int = 0,
                  rule: str | None = None, dtype: torch.dtype = torch.float16) -> dict[str, Any]:
    """The calibrated workload of one fitted layer at its own shape, as a capture dict
    (`layers`, `q`, `k`, `v`, `scale`, `meta`) that `compare` and `eval table` read."""
    lp = next((x for x in calibration.layers if x.layer == layer), None)
    if lp is None:
        raise ValueError(f"layer {layer} is not in the calibration")
    n = lp.seqlen if seqlen is None else seqlen
    shape = Shape(1, len(lp.heads), len(lp.kv), n, FIT_HEAD_DIM, dtype)
    q, k, v = generate_layer(lp.heads, lp.kv, shape, seed=seed, fit_seqlen=lp.seqlen,
                             rule=check_rule(rule or calibration.rule))
    return {"layers": [layer], "q": [q.to(dtype)], "k": [k.to(dtype)], "v": [v.to(dtype)],
            "scale": [FIT_HEAD_DIM ** -0.5], "meta": {"model": f"calibrated ({calibration.source})", "seqlen": n}}


# -- workloads for the tools -----------------------------------------------------------------


def capture_qkv(path: str | Path, shape: Shape, *, device: torch.device) -> tuple[torch.Tensor, ...]:
    """q, k, v from a capture file for a tool that asks for `shape`: the captured layers
    stacked along the batch (every layer one batch row), cut to `shape.seqlen`.

    Only `shape.seqlen` and `shape.dtype` are honoured; heads and head size are the
    capture's (a capture is what it is).

    Raises:
        ValueError: N longer than the capture, or layers of different shapes.
    """
    data = torch.load(Path(path), map_location="cpu")
    n = shape.seqlen
    have = int(data["q"][0].shape[2])
    if n > have:
        raise ValueError(f"seqlen {n} is longer than the capture's {have} tokens ({path})")
    shapes = {tuple(t.shape[1:]) for t in data["q"]}
    if len(shapes) != 1:
        raise ValueError(f"capture {path}: layers of different shapes {shapes}")
    return tuple(torch.cat([t[:, :, :n] for t in data[name]], dim=0).to(device=device, dtype=shape.dtype)
                 for name in ("q", "k", "v"))


def workload_qkv(
    shape: Shape,
    *,
    device: torch.device,
    workload: str = "synthetic",
    qkv: str | Path | None = None,
    seed: int = 0,
    calibration: str | Path | None = None,
) -> tuple[torch.Tensor, ...]:
    """q, k, v of the named workload: `synthetic` (`demo.synthetic_qkv`), `calibrated`
    (`calibrated_qkv`) or, with `qkv`, a capture file (`capture_qkv`).

    Raises:
        ValueError: an unknown workload.
    """
    if qkv is not None:
        return capture_qkv(qkv, shape, device=device)
    if workload == "synthetic":
        return synthetic_qkv(shape, device=device, seed=seed)
    if workload == "calibrated":
        cal = load_calibration(calibration)
        return calibrated_qkv(shape, device=device, seed=seed, calibration=cal)
    raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")


class _Selected:
    """The workload the benchmark suites build (`select`); synthetic by default."""

    workload = "synthetic"
    qkv: str | None = None


def select(workload: str, qkv: str | None = None) -> None:
    """Choose the workload of `bench_qkv` (the `--workload` / `--qkv` options of `bench`).

    Raises:
        ValueError: an unknown workload.
    """
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    _Selected.workload, _Selected.qkv = workload, qkv


def bench_qkv(shape: Shape, *, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """The selected workload at `shape` (drop-in for `demo.synthetic_qkv` in the suites)."""
    return workload_qkv(shape, device=device, workload=_Selected.workload, qkv=_Selected.qkv, seed=seed)


# -- reports -------------------------------------------------------------------------------


def _layer_summary(cap: Stats, gen: Stats) -> dict[str, Any]:
    """Captured against generated statistics of one layer: means over heads and errors."""
    hq = len(cap.sink)

    def mean(x: Sequence[float]) -> float:
        return float(sum(x) / len(x))

    out: dict[str, Any] = {}
    for i, share in enumerate(ORACLE_SHARES):
        c = mean([o[i] for o in cap.oracle])
        g = mean([o[i] for o in gen.oracle])
        per_head = [abs(go[i] - co[i]) / co[i] for go, co in zip(gen.oracle, cap.oracle)]
        out[f"oracle_{share}"] = {"captured": c, "generated": g, "relative_error": (g - c) / c,
                                  "head_relative_error_median": sorted(per_head)[hq // 2],
                                  "head_relative_error_max": max(per_head)}
    for name in ("sink", "local", "vertical", "slash", "rest"):
        c_list, g_list = getattr(cap, name), getattr(gen, name)
        out[name] = {"captured": mean(c_list), "generated": mean(g_list),
                     "head_abs_error_max": max(abs(a - b) for a, b in zip(c_list, g_list))}
    if cap.keep and gen.keep:
        out["keep"] = {"thresholds": list(KEEP_THRESHOLDS),
                       "captured": [mean([x[i] for x in cap.keep]) for i in range(len(KEEP_THRESHOLDS))],
                       "generated": [mean([x[i] for x in gen.keep]) for i in range(len(KEEP_THRESHOLDS))]}
    return out


def calibration_report(
    data: Mapping[str, Any] | None,
    calibration: Calibration,
    fit_stats: Mapping[int, Stats],
    *,
    rows: int = 128,
    rules: Sequence[str] = (DEFAULT_RULE,),
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    captured: Mapping[int, Stats] | None = None,
) -> dict[str, Any]:
    """Captured against generated statistics, per fitted layer, at the capture's length.

    When the calibration was fitted on a prefix, the generated workload is made at the
    capture's full length under each rule and compared with the full capture's
    statistics: the rule's prediction error. With `data` None (a fit to saved statistics) the
    comparison is against `captured` (saved statistics of the capture at its full length) or,
    without it, against `fit_stats` at the fit's own length.

    Returns:
        A JSON-ready dict: `source`, `fit_seqlen`, `seqlen`, and per rule the per-layer
        summaries (`_layer_summary`) and per-head statistics.
    """
    index = {int(x): i for i, x in enumerate(data["layers"])} if data is not None else {}
    report: dict[str, Any] = {"source": calibration.source, "rules": {}}
    for rule in rules:
        check_rule(rule)
        layers: list[dict[str, Any]] = []
        for lp in calibration.layers:
            # A shared fit (salience drawn) is measured as it was fitted: slashes first.
            first = any(h.salience for h in lp.heads)
            if data is None:
                cap = captured[lp.layer] if captured is not None else fit_stats[lp.layer]
                n = cap.seqlen
            else:
                q, k = data["q"][index[lp.layer]], data["k"][index[lp.layer]]
                n = int(q.shape[2])
                cap = fit_stats[lp.layer] if n == lp.seqlen else attention_stats(q, k, rows=rows, slash_first=first,
                                                                                 slash_select=lp.slash_select)
            shape = Shape(1, len(lp.heads), len(lp.kv), n, FIT_HEAD_DIM, torch.float64)
            gq, gk, _ = generate_layer(lp.heads, lp.kv, shape, seed=seed, fit_seqlen=lp.seqlen, rule=rule)
            gen = attention_stats(gq, gk, rows=rows, slash_first=first, slash_select=lp.slash_select)
            layers.append({"layer": lp.layer, "summary": _layer_summary(cap, gen),
                           "captured": asdict(cap), "generated": asdict(gen)})
            report["fit_seqlen"], report["seqlen"] = lp.seqlen, n
            if log is not None:
                o = layers[-1]["summary"]["oracle_0.95"]
                log(f"{rule} layer {lp.layer}: oracle@0.95 captured {o['captured']:.4f} generated "
                    f"{o['generated']:.4f}")
        report["rules"][rule] = layers
    return report


def format_report(report: Mapping[str, Any]) -> str:
    """Markdown tables of `calibration_report` (one per rule)."""
    lines = []
    for rule, layers in report["rules"].items():
        lines += [f"fit at N = {report.get('fit_seqlen')}, statistics at N = {report.get('seqlen')}, rule {rule}:",
                  "",
                  "| layer | oracle@0.9 capt / gen | oracle@0.95 capt / gen (rel. err) | sink | local | vertical "
                  "| slash | rest | keep@0.83 |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for item in layers:
            s = item["summary"]
            o9, o95 = s["oracle_0.9"], s["oracle_0.95"]
            cells = [f"{s[x]['captured']:.3f} / {s[x]['generated']:.3f}" for x in ("sink", "local", "vertical",
                                                                                   "slash", "rest")]
            keep = s.get("keep")
            kc = "-" if keep is None else f"{keep['captured'][2]:.3f} / {keep['generated'][2]:.3f}"
            lines.append(f"| {item['layer']} | {o9['captured']:.4f} / {o9['generated']:.4f} | "
                         f"{o95['captured']:.4f} / {o95['generated']:.4f} ({o95['relative_error']:+.0%}) | "
                         + " | ".join(cells) + f" | {kc} |")
        errs = [abs(item["summary"]["oracle_0.95"]["relative_error"]) for item in layers]
        errs9 = [abs(item["summary"]["oracle_0.9"]["relative_error"]) for item in layers]
        lines += ["", f"mean |relative error| of the layer's oracle density: {sum(errs9) / len(errs9):.1%} at 0.9, "
                      f"{sum(errs) / len(errs):.1%} at 0.95; worst {max(errs9):.1%} / {max(errs):.1%}", ""]
    return "\n".join(lines)


# -- acceptance: every method on a captured layer and on its calibrated twin ------------------


@dataclass
class CurvePoint:
    """One sweep point of one method on one workload."""

    method: str
    params: dict[str, Any]
    workload: str
    density: float
    recall_mean: float | None
    output_error: float | None
    seconds: float


def method_curves(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    methods: Sequence[str],
    *,
    scale: float | None,
    workload: str,
    backend: str = "reference",
    log: Callable[[str], None] | None = None,
) -> list[CurvePoint]:
    """Every method's `compare` sweep on one input: density and mean recall per point
    (methods that change the keys, Delta-KV, get the output error against float64
    attention instead of a recall)."""
    import time

    from . import reference
    from .methods import METHODS, MethodView

    n = int(q.shape[2])
    exact: torch.Tensor | None = None
    probs = _probabilities(q, k, scale)  # [B, Hq, N, N] float32, once for every plan
    points = []
    for name in methods:
        spec = METHODS[name]
        for params in spec.sweep_params(n):
            start = time.perf_counter()
            call = spec.call_params(params, q)
            if spec.plan_based:
                # Recall as reference.recall defines it (the kept share of each row's full causal
                # softmax), from the probabilities computed once instead of once per plan.
                plan = spec.plan_fn(backend)(q, k, **call)
                keep = plan.to_dense_mask().to(probs.device)
                view = MethodView(density=reference.density(plan), recall=(probs * keep).sum(-1), plan=None)
                del keep
            else:
                view = spec.method_view(backend, q, k, v, call, scale=scale)
            error = None
            if view.recall is None:
                if exact is None:
                    exact = reference.attention(q.double(), k.double(), v.double(), scale=scale)
                error = reference.relative_error(spec.run_fn(backend)(q, k, v, **call, scale=scale), exact)
            point = CurvePoint(name, dict(params), workload, float(view.density.mean()),
                               None if view.recall is None else float(view.recall.double().mean()), error,
                               time.perf_counter() - start)
            points.append(point)
            if log is not None:
                log(f"{workload} {name} {params}: density {point.density:.4f} recall {point.recall_mean} "
                    f"error {point.output_error} ({point.seconds:.1f} s)")
    return points


def _probabilities(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Full causal softmax `[B, Hq, N, N]` in float32 (float64 math, row chunks)."""
    from .reference._checks import resolve_scale

    b, hq, n, d = q.shape
    g = hq // k.shape[1]
    sm = resolve_scale(scale, d)
    out = torch.empty(b, hq, n, n, dtype=torch.float32, device=q.device)
    kk = k.to(torch.float64).repeat_interleave(g, dim=1)
    step = 1024
    for start in range(0, n, step):
        stop = min(n, start + step)
        rows = torch.arange(start, stop, device=q.device)
        scores = torch.matmul(q[:, :, start:stop].to(torch.float64), kk.transpose(-1, -2)) * sm
        causal = torch.arange(n, device=q.device)[None, :] <= rows[:, None]
        out[:, :, start:stop] = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1).to(torch.float32)
    return out


def _interpolate(curve: Sequence[tuple[float, float]], x: float) -> float | None:
    """Linear interpolation of sorted (x, y) pairs at x; None outside their range."""
    if not curve or x < curve[0][0] or x > curve[-1][0]:
        return None
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return curve[0][1]


def curve_gaps(points: Sequence[CurvePoint], captured: str = "captured",
               calibrated: str = "calibrated") -> dict[str, dict[str, Any]]:
    """Per method: the largest recall gap between the two workloads' recall-vs-density
    curves (each workload's points against the other's curve, linearly interpolated, where
    the densities overlap) and the gap at the same knob setting.

    Methods without recall compare output error the same way (`error_gap_*`).
    """
    out: dict[str, dict[str, Any]] = {}
    for name in dict.fromkeys(p.method for p in points):
        mine = [p for p in points if p.method == name]
        cap = [p for p in mine if p.workload == captured]
        cal = [p for p in mine if p.workload == calibrated]
        field_name = "recall_mean" if all(p.recall_mean is not None for p in mine) else "output_error"
        # Both ways: each workload's points against the other's curve, where densities overlap.
        at_density = []
        for mine_pts, other in ((cap, cal), (cal, cap)):
            curve = sorted((p.density, float(getattr(p, field_name))) for p in other)
            for p in mine_pts:
                y = _interpolate(curve, p.density)
                if y is not None:
                    at_density.append(abs(y - float(getattr(p, field_name))))
        same_knob = [abs(float(getattr(a, field_name)) - float(getattr(b, field_name))) for a, b in zip(cap, cal)]
        density_ratio = [b.density / a.density for a, b in zip(cap, cal) if a.density > 0]
        prefix = "recall" if field_name == "recall_mean" else "error"
        out[name] = {
            f"{prefix}_gap_at_equal_density_max": max(at_density) if at_density else None,
            "points_in_overlap": len(at_density), "points": len(cap) + len(cal),
            f"{prefix}_gap_same_knob_max": max(same_knob) if same_knob else None,
            "density_ratio_same_knob": density_ratio,
        }
    return out
