"""SharePrefill: pivotal sparse patterns shared across similar heads (Peng et al., Sec. 5, Alg. 1-5).

Offline (`sparseprefill cluster`), the query heads of a model are grouped into
clusters of heads with similar attention maps; the result is a `ClusterLayout`
(layer, head) -> cluster, with `NOISE` for heads in no cluster. Online, one
`SharePrefillState` lives for one prefill (one forward pass) and holds the pivotal
pattern dictionary: per cluster and batch row, the first densely computed head's
block pattern `M` and its last row of block attention `a~` (the "pivot").

Per layer (`shareprefill_layer`), every query head, in head order:

* Alg. 3 (determine the pattern): `a^` = softmax over key blocks of the mean scaled
  logit of the last query block against every key block (the pooled attention of
  `Q[-block_size:]`); `d_sparse = JS(a^, u)` against the uniform distribution over
  the key blocks, `d_sim = JS(a^, a~)` against the cluster's pivot; the head shares
  the pivot's pattern iff `d_sparse < delta` and `d_sim < tau`, otherwise it takes
  the vertical-slash fallback.
* Alg. 4 (share the pivotal pattern): the pivot's `M`; a cluster with no pivot yet
  gives its first non-sparse head (`d_sparse < delta`) the dense pattern.
* Alg. 5: FlexPrefill-style vertical-slash (`flexprefill_vs`, cumulative threshold
  `gamma`, the last `block_m` queries) for highly sparse heads, heads of the noise
  cluster, and heads whose pivot is too far.
* Alg. 1 line 8: one sparse-attention pass of the layer, which also returns the mean
  scaled logit of every computed block (`sparse_attention(..., block_mean_out=)`).
* Alg. 2 (construct the pivotal pattern), for every dense head: softmax of its block
  means over key blocks, `a~` = the last row, then the fewest blocks holding `gamma`
  of the normalised block mass (flattened over the whole map) become `M`; stored for
  the head's cluster.

Choices where the paper leaves room (docs/shareprefill.md has the reasoning):

* JS distance: `sqrt(JSD)` with base-2 logarithms, so distances lie in `[0, 1]` (the
  paper's ablation uses `delta = 1.01` "to account for boundary conditions" of a
  distance of 1). The authors' released code uses natural logarithms (maximum 0.83).
* `Q[-block_size:]` is read as the last query block of the plan (`block_m` rows, fewer
  when `block_m` does not divide N), so `a^` of a dense head equals its own `a~`.
* Heads are decided layer by layer (the paper: "in practice, we perform sparse
  attention computation layer-by-layer"): a pivot built in a layer serves the later
  layers. Within a layer only the first head of a cluster without a pivot is dense
  ("the first head within the cluster", Alg. 4); its other heads in that layer take
  the vertical-slash fallback, as in the authors' released code.
* A pivot is built once per cluster and prefill (only dense heads build pivots, and
  a head is dense only while its cluster has none).
* Pivot patterns always keep the diagonal key blocks of every query block (the
  blocks the main diagonal crosses) and their share counts toward `gamma` first:
  Alg. 2's threshold is global over the flattened map, so without them a query block
  whose row is flat could keep no block at all and its rows would output zeros.
  (The released code thresholds each row separately instead.)
* Decisions and pivots are per batch row: batch rows share nothing.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

import torch

from ._checks import PerHead, check_fraction, check_knob, check_positive_int, check_qk, check_qkv, resolve_scale
from .attention import sparse_attention
from .flexprefill_vs import (
    GAMMA,
    check_flexprefill_vs_params,
    cover_threshold,
    flexprefill_vs_lines,
    lines_masks,
)
from .plan import BlockColumnPlan, cdiv

# The paper's defaults (Sec. 6.1): similarity threshold tau, sparsity threshold delta.
TAU = 0.2
DELTA = 0.3
# Cluster id of the noise cluster (heads similar to no other): always vertical-slash.
NOISE = -1
_FORMAT = "sparseprefill.clusters"


class SharePattern(IntEnum):
    """The pattern a head takes in one prefill (Alg. 1 lines 3-7)."""

    DENSE = 0
    SHARED = 1
    VERTICAL_SLASH = 2


# -- offline clustering result -------------------------------------------------------


@dataclass(frozen=True)
class ClusterLayout:
    """Which cluster every (layer, query head) of a model belongs to.

    Attributes:
        clusters: `clusters[l][h]`, a cluster id (>= 0) or `NOISE` (-1).
        meta: free-form provenance (model, prompt, clustering settings).

    Raises:
        ValueError: an empty or ragged table, or an id below -1.
        TypeError: an id that is not an int.
    """

    clusters: tuple[tuple[int, ...], ...]
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        rows = tuple(tuple(layer) for layer in self.clusters)
        if not rows or not rows[0]:
            raise ValueError("a ClusterLayout needs at least one layer and one head")
        for l, layer in enumerate(rows):
            if len(layer) != len(rows[0]):
                raise ValueError(f"every layer needs {len(rows[0])} heads; layer {l} has {len(layer)}")
            for c in layer:
                if isinstance(c, bool) or not isinstance(c, int):
                    raise TypeError(f"cluster ids must be ints, got {c!r} in layer {l}")
                if c < NOISE:
                    raise ValueError(f"cluster ids must be >= 0 or NOISE (-1), got {c} in layer {l}")
        object.__setattr__(self, "clusters", rows)

    @property
    def num_layers(self) -> int:
        return len(self.clusters)

    @property
    def num_heads(self) -> int:
        return len(self.clusters[0])

    def cluster(self, layer: int, head: int) -> int:
        """The cluster of query head `head` of layer `layer`.

        Raises:
            ValueError: a layer or head outside the layout.
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside the cluster layout ({self.num_layers} layers)")
        if not 0 <= head < self.num_heads:
            raise ValueError(f"head {head} is outside the cluster layout ({self.num_heads} heads)")
        return self.clusters[layer][head]

    def sizes(self) -> dict[int, int]:
        """Heads per cluster id (NOISE included), largest first."""
        counts = Counter(c for layer in self.clusters for c in layer)
        return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))

    @staticmethod
    def uniform(num_layers: int, num_heads: int) -> ClusterLayout:
        """Every head of every layer in one cluster (0): the default without a clustering."""
        check_positive_int("num_layers", num_layers)
        check_positive_int("num_heads", num_heads)
        return ClusterLayout(tuple((0,) * num_heads for _ in range(num_layers)))

    def to_json(self, *, indent: int | None = None) -> str:
        """JSON: `{"format", "version", "num_layers", "num_heads", "clusters": [[id, ...], ...], "meta"}`."""
        return json.dumps({"format": _FORMAT, "version": 1, "num_layers": self.num_layers,
                           "num_heads": self.num_heads, "noise": NOISE,
                           "clusters": [list(layer) for layer in self.clusters],
                           "meta": dict(self.meta)}, indent=indent)

    @staticmethod
    def from_json(text: str) -> ClusterLayout:
        """Parse `to_json`'s format, or the SharePrefill authors' released lookup files.

        Their files are `{"clusters": {"<id>": [[layer, head], ...]}, "shared_clusters":
        [ids]}`; heads of clusters not listed as shared, and heads not listed at all,
        become `NOISE`.

        Raises:
            ValueError: malformed JSON or an unknown format.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"cluster layout is not valid JSON: {err}") from err
        if not isinstance(data, dict):
            raise ValueError("cluster layout must be a JSON object")
        if data.get("format") == _FORMAT:
            if data.get("version") != 1:
                raise ValueError(f"unsupported cluster layout version {data.get('version')!r}")
            return ClusterLayout(tuple(tuple(layer) for layer in data["clusters"]),
                                 meta=data.get("meta", {}))
        if isinstance(data.get("clusters"), dict) and "shared_clusters" in data:
            shared = {str(c) for c in data["shared_clusters"]}
            pairs = [(str(cid), int(l), int(h)) for cid, heads in data["clusters"].items()
                     for l, h in heads]
            if not pairs:
                raise ValueError("the cluster lookup lists no heads")
            layers = 1 + max(l for _, l, _ in pairs)
            heads = 1 + max(h for _, _, h in pairs)
            table = [[NOISE] * heads for _ in range(layers)]
            ids = {cid: i for i, cid in enumerate(sorted(shared, key=lambda c: (len(c), c)))}
            for cid, l, h in pairs:
                table[l][h] = ids[cid] if cid in shared else NOISE
            return ClusterLayout(tuple(tuple(row) for row in table),
                                 meta={"source": "SharePrefill lookup file"})
        raise ValueError("cluster layout must be sparseprefill's format or a SharePrefill lookup file")

    def save(self, path: str | Path) -> Path:
        """Write `to_json` to `path`; return the path."""
        out = Path(path)
        out.write_text(self.to_json(indent=1) + "\n")
        return out

    @staticmethod
    def load(path: str | Path) -> ClusterLayout:
        """Read a layout written by `save` (or a SharePrefill lookup file)."""
        return ClusterLayout.from_json(Path(path).read_text())


# -- the per-prefill state -------------------------------------------------------------


@dataclass(frozen=True)
class Pivot:
    """One cluster's pivotal pattern for one batch row (Alg. 2's dictionary entry).

    Attributes:
        a_tilde: float64 `[Kb]`, the pivot head's last row of block attention.
        mask: bool `[Qb, Kb]`, the pivotal block pattern `M`.
        layer, head: where it was computed.
    """

    a_tilde: torch.Tensor
    mask: torch.Tensor
    layer: int
    head: int


@dataclass(frozen=True)
class LayerDecision:
    """What every head of one layer did (Alg. 3 and 4).

    Attributes:
        layer: the layer index.
        pattern: int8 `[B, Hq]`, `SharePattern` values.
        d_sparse: float64 `[B, Hq]`, JS distance of `a^` to uniform.
        d_sim: float64 `[B, Hq]`, JS distance of `a^` to the cluster's pivot (NaN
            where the cluster had no pivot, or for noise heads).
        cluster: int64 `[Hq]`, the heads' clusters.
    """

    layer: int
    pattern: torch.Tensor
    d_sparse: torch.Tensor
    d_sim: torch.Tensor
    cluster: torch.Tensor

    def counts(self) -> dict[str, int]:
        """Heads (over batch rows) per pattern name."""
        return {p.name.lower(): int((self.pattern == p.value).sum()) for p in SharePattern}


class SharePrefillState:
    """The pivotal pattern dictionary of one prefill (create one per forward pass).

    Holds the thresholds and block sizes every layer of the prefill uses, the pivots
    built so far (per cluster and batch row) and each processed layer's decisions.
    The first layer fixes the batch size, N and device; a later layer of another
    shape raises (a new prompt needs a new state).

    Args:
        layout: the offline clustering (a `ClusterLayout` or the path of its JSON, as
            `sparseprefill cluster` writes it); None puts every head of every layer in
            one cluster (0).
        tau: similarity threshold on `d_sim`, in `[0, 2]` (0: never share).
        delta: sparsity threshold on `d_sparse`, in `[0, 2]` (above 1: no head is
            treated as highly sparse).
        gamma: cumulative threshold of Alg. 2 and Alg. 5, in `[0, 1]`.
        (tau, delta and gamma: a scalar, or one value per query head, a list or `[Hq]`
        tensor, used by that head in every layer: its Alg. 3 tests, its Alg. 5 lines and,
        when it is a cluster's dense head, its pivot's Alg. 2 threshold.)
        block_m, block_n: query rows and keys per block of every plan.
        init_columns, local_diagonals: forced lines of the Alg. 5 fallback.

    Raises:
        TypeError, ValueError: a bad parameter (a layout path that is not a file: ValueError).
    """

    def __init__(
        self,
        layout: ClusterLayout | str | Path | None = None,
        *,
        tau: PerHead = TAU,
        delta: PerHead = DELTA,
        gamma: PerHead = GAMMA,
        block_m: int = 64,
        block_n: int = 64,
        init_columns: int = 1,
        local_diagonals: int = 1,
    ) -> None:
        if isinstance(layout, (str, Path)):
            if not Path(layout).is_file():
                raise ValueError(f"layout {str(layout)!r} is not a file (expected a ClusterLayout JSON, "
                                 "as `sparseprefill cluster` writes)")
            layout = ClusterLayout.load(layout)
        if layout is not None and not isinstance(layout, ClusterLayout):
            raise TypeError(f"layout must be a ClusterLayout, a path to its JSON, or None, got "
                            f"{type(layout).__name__}")
        check_share_params(tau=tau, delta=delta, gamma=gamma, block_m=block_m, block_n=block_n,
                           init_columns=init_columns, local_diagonals=local_diagonals)
        self.layout: ClusterLayout | None = layout
        self.tau, self.delta, self.gamma = _knob(tau), _knob(delta), _knob(gamma)
        self.block_m, self.block_n = block_m, block_n
        self.init_columns, self.local_diagonals = init_columns, local_diagonals
        self.pivots: dict[tuple[int, int], Pivot] = {}
        self.decisions: list[LayerDecision] = []
        self.shape: tuple[int, int, int] | None = None
        self.device: torch.device | None = None

    def __repr__(self) -> str:
        return (f"SharePrefillState(layers done {[d.layer for d in self.decisions]}, "
                f"{len(self.pivots)} pivots, tau={self.tau}, delta={self.delta}, gamma={self.gamma})")

    def head_value(self, name: str, head: int) -> float:
        """Query head `head`'s `tau`, `delta` or `gamma` (the scalar, or its per-head value)."""
        value: float | tuple[float, ...] = getattr(self, name)
        return value[head] if isinstance(value, tuple) else value

    def cluster(self, layer: int, head: int) -> int:
        """The cluster of (layer, head): the layout's, or 0 for every head without one."""
        return 0 if self.layout is None else self.layout.cluster(layer, head)

    def pivot(self, cluster: int, batch_row: int) -> Pivot | None:
        """The pivot of `cluster` for one batch row, or None (Alg. 4's lookup)."""
        return self.pivots.get((cluster, batch_row))

    def bind(self, q: torch.Tensor, layer: int) -> None:
        """Check that `q: [B, Hq, N, D]` of `layer` belongs to this prefill; fix the shape
        at the first layer.

        Raises:
            TypeError, ValueError: a bad layer index, another shape or device than the
                earlier layers, a layer already processed, or a layout that does not
                cover the layer's heads.
        """
        check_positive_int("layer", layer, minimum=0)
        b, hq, n, _ = q.shape
        for name in ("tau", "delta", "gamma"):
            value = getattr(self, name)
            if isinstance(value, tuple) and len(value) != hq:
                raise ValueError(f"{name} given per head must have one value per query head (Hq={hq}), "
                                 f"got {len(value)}")
        if self.layout is not None:
            if layer >= self.layout.num_layers:
                raise ValueError(f"layer {layer} is outside the cluster layout "
                                 f"({self.layout.num_layers} layers)")
            if hq > self.layout.num_heads:
                raise ValueError(f"the cluster layout has {self.layout.num_heads} heads per layer, "
                                 f"q has {hq}")
        if self.shape is None:
            self.shape, self.device = (b, hq, n), q.device
        elif (b, hq, n) != self.shape or q.device != self.device:
            raise ValueError(
                f"this SharePrefillState belongs to a prefill of [B, Hq, N] = {list(self.shape)} on "
                f"{self.device}; got {[b, hq, n]} on {q.device} (create a new state per prompt)")
        if any(d.layer == layer for d in self.decisions):
            raise ValueError(f"layer {layer} was already processed in this prefill "
                             "(create a new SharePrefillState per forward pass)")

    def record(self, decision: LayerDecision, pivots: Mapping[tuple[int, int], Pivot]) -> None:
        """Store a processed layer's decisions and the pivots its dense heads built (Alg. 2)."""
        self.decisions.append(decision)
        for key, pivot in pivots.items():
            self.pivots.setdefault(key, pivot)

    def pattern_counts(self) -> list[dict[str, int]]:
        """Per processed layer, in order: `{"layer", "dense", "shared", "vertical_slash"}`."""
        return [{"layer": d.layer, **d.counts()} for d in self.decisions]

    def clone(self) -> SharePrefillState:
        """A copy whose dictionary and history can change independently (tensors shared)."""
        other = SharePrefillState(self.layout, tau=self.tau, delta=self.delta, gamma=self.gamma,
                                  block_m=self.block_m, block_n=self.block_n,
                                  init_columns=self.init_columns, local_diagonals=self.local_diagonals)
        other.pivots = dict(self.pivots)
        other.decisions = list(self.decisions)
        other.shape, other.device = self.shape, self.device
        return other


def _knob(value: PerHead) -> float | tuple[float, ...]:
    """A checked tau, delta or gamma as the state keeps it: a float, or a tuple per head."""
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, torch.Tensor):
        return tuple(float(x) for x in value.tolist())
    return tuple(float(x) for x in value)


def check_share_params(
    *,
    tau: PerHead,
    delta: PerHead,
    gamma: PerHead,
    block_m: int,
    block_n: int,
    init_columns: int,
    local_diagonals: int,
) -> None:
    """Raise TypeError/ValueError naming the first bad SharePrefill parameter (tau, delta,
    gamma: a scalar or one per query head)."""
    check_knob("tau", tau, lambda x: check_fraction("tau", x, high=2.0))
    check_knob("delta", delta, lambda x: check_fraction("delta", x, high=2.0))
    check_flexprefill_vs_params(gamma=gamma, last_q=1, block_m=block_m, block_n=block_n,
                                init_columns=init_columns, local_diagonals=local_diagonals)


def check_state(state: object) -> SharePrefillState:
    """Return `state` if it is a `SharePrefillState`, else raise TypeError."""
    if not isinstance(state, SharePrefillState):
        raise TypeError(f"state must be a SharePrefillState, got {type(state).__name__}")
    return state


# -- Alg. 3: determine the sparse pattern -------------------------------------------------


def last_block_attention(
    q: torch.Tensor, k: torch.Tensor, *, block_m: int, block_n: int, scale: float
) -> torch.Tensor:
    """Alg. 3 lines 2-3: `a^ = softmax(pool(Q^ K^T) / sqrt(d))` over key blocks.

    `Q^` is the last query block (rows `[(Qb - 1) * block_m, N)`); `pool` is the mean of
    the scaled logits over the causal (row, key) pairs of `Q^` and each key block (the
    same mean the kernel's `block_mean_out` gives for that query block).

    Returns:
        float64 `[B, Hq, Kb]`, each row a distribution over the key blocks.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    r0 = (cdiv(n, block_m) - 1) * block_m
    kb = cdiv(n, block_n)
    q_last = q[:, :, r0:].to(torch.float64).reshape(b, hkv, g, n - r0, d)
    scores = torch.matmul(q_last, k.to(torch.float64).unsqueeze(2).transpose(-1, -2)) * scale
    causal = torch.arange(n, device=q.device)[None, :] <= torch.arange(r0, n, device=q.device)[:, None]
    key_block = torch.arange(n, device=q.device) // block_n
    sums = torch.zeros(b, hkv, g, kb, dtype=torch.float64, device=q.device)
    sums.index_add_(-1, key_block, torch.where(causal, scores, 0.0).sum(dim=-2))
    pairs = torch.zeros(kb, dtype=torch.float64, device=q.device)
    pairs.index_add_(0, key_block, causal.sum(dim=0).to(torch.float64))
    return torch.softmax(sums / pairs, dim=-1).reshape(b, hq, kb)


def js_distance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Alg. 3 line 6: `sqrt(JSD(p || q))` with base-2 logarithms, in `[0, 1]`.

    Args:
        p, q: float64 `[..., K]` distributions (broadcastable); `0 log 0 = 0`.

    Returns:
        float64 `[...]`.
    """
    m = (p + q) / 2

    def kl(a: torch.Tensor) -> torch.Tensor:
        return torch.where(a > 0, a * torch.log2(a / m), 0.0).sum(dim=-1)

    return torch.sqrt(((kl(p) + kl(q)) / 2).clamp(min=0.0))


def pivot_distances(state: SharePrefillState, a_hat: torch.Tensor, *, layer: int) -> torch.Tensor:
    """Alg. 3 lines 4-6, `d_sim`: float64 `[B, Hq]`, JS distance of each head's `a^` to its
    cluster's pivot `a~`; NaN for noise heads and clusters without a pivot."""
    b, hq, _ = a_hat.shape
    d_sim = torch.full((b, hq), math.nan, dtype=torch.float64, device=a_hat.device)
    for row in range(b):
        for h in range(hq):
            c = state.cluster(layer, h)
            pivot = None if c == NOISE else state.pivot(c, row)
            if pivot is not None:
                d_sim[row, h] = js_distance(a_hat[row, h], pivot.a_tilde.to(a_hat))
    return d_sim


def choose_patterns(
    state: SharePrefillState, d_sparse: torch.Tensor, d_sim: torch.Tensor, *, layer: int
) -> torch.Tensor:
    """Alg. 3 lines 7-11 and Alg. 4's first-head rule, every head of one layer in head order.

    Per batch row `b` and head `h` of cluster `c`:

    * noise cluster: vertical-slash;
    * `c` has a pivot: shared iff `d_sparse < delta` and `d_sim < tau`, else
      vertical-slash;
    * `c` has no pivot: dense iff `d_sparse < delta` and no earlier head of this layer
      took the dense pattern for `c` (Alg. 4: the first head of the cluster), else
      vertical-slash.

    Args:
        state: the prefill's state (read only).
        d_sparse, d_sim: float64 `[B, Hq]` (`d_sim` NaN where there is no pivot).
        layer: the layer index (for cluster lookups).

    Returns:
        int8 `[B, Hq]` on the CPU, `SharePattern` values.
    """
    # One device-to-host transfer for both (one synchronisation, not two).
    d_sparse, d_sim = torch.stack((d_sparse, d_sim.to(d_sparse.device))).cpu().unbind(0)
    b, hq = d_sparse.shape
    pattern = torch.full((b, hq), int(SharePattern.VERTICAL_SLASH), dtype=torch.int8)
    for row in range(b):
        dense_now: set[int] = set()
        for h in range(hq):
            c = state.cluster(layer, h)
            if c == NOISE:
                continue
            not_sparse = float(d_sparse[row, h]) < state.head_value("delta", h)
            if state.pivot(c, row) is None:
                if not_sparse and c not in dense_now:
                    pattern[row, h] = SharePattern.DENSE
                    dense_now.add(c)
            elif not_sparse and float(d_sim[row, h]) < state.head_value("tau", h):
                pattern[row, h] = SharePattern.SHARED
    return pattern


def determine_sparse_pattern(
    state: SharePrefillState, a_hat: torch.Tensor, *, layer: int
) -> LayerDecision:
    """Alg. 3 (with Alg. 4's first-head rule) for every head of one layer.

    Args:
        state: the prefill's state (read only).
        a_hat: float64 `[B, Hq, Kb]`, `last_block_attention`.
        layer: the layer index.

    Returns:
        The layer's `LayerDecision`.
    """
    hq, kb = a_hat.shape[1], a_hat.shape[2]
    # Alg. 3 line 6: d_sparse against the uniform distribution over the key blocks.
    uniform = torch.full((kb,), 1.0 / kb, dtype=torch.float64, device=a_hat.device)
    d_sparse = js_distance(a_hat, uniform)
    d_sim = pivot_distances(state, a_hat, layer=layer)
    pattern = choose_patterns(state, d_sparse, d_sim, layer=layer)
    clusters = torch.tensor([state.cluster(layer, h) for h in range(hq)], dtype=torch.int64,
                            device=a_hat.device)
    return LayerDecision(layer=layer, pattern=pattern.to(a_hat.device), d_sparse=d_sparse,
                         d_sim=d_sim, cluster=clusters)


# -- Alg. 4, 5 and 1: the layer's plan --------------------------------------------------------


def share_pivotal_pattern(state: SharePrefillState, cluster: int, batch_row: int) -> torch.Tensor | None:
    """Alg. 4: the pivotal block pattern of `cluster` (bool `[Qb, Kb]`), or None (dense)."""
    pivot = state.pivot(cluster, batch_row)
    return None if pivot is None else pivot.mask


def layer_masks(
    verticals: torch.Tensor, slashes: torch.Tensor, state: SharePrefillState, decision: LayerDecision
) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 1 lines 3-7: the block and column selections of every head.

    Args:
        verticals, slashes: bool `[B, Hq, N]`, Alg. 5's kept lines of every head (used
            for the vertical-slash heads only).
        state: the prefill's state (pivots, block sizes). decision: the layer's.

    Returns:
        (blocks bool `[B, Hq, Qb, Kb]`, columns bool `[B, Hq, Qb, N]`): dense heads keep
        every block, shared heads their pivot's `M`, vertical-slash heads the Alg. 4
        index of their lines.
    """
    blocks, columns = lines_masks(verticals, slashes, block_m=state.block_m, block_n=state.block_n)
    blocks, columns = blocks.clone(), columns.clone()
    for row, h in (decision.pattern != SharePattern.VERTICAL_SLASH).nonzero().tolist():
        columns[row, h] = False
        if decision.pattern[row, h] == SharePattern.DENSE:
            blocks[row, h] = True
        else:
            shared = share_pivotal_pattern(state, int(decision.cluster[h]), row)
            assert shared is not None, "a shared head's cluster has a pivot"
            blocks[row, h] = shared
    return blocks, columns


def diagonal_blocks(seqlen: int, block_m: int, block_n: int, device: torch.device) -> torch.Tensor:
    """bool `[Qb, Kb]`: the key blocks the main diagonal crosses in each query block."""
    qb, kb = cdiv(seqlen, block_m), cdiv(seqlen, block_n)
    r0 = torch.arange(qb, device=device) * block_m
    r1 = (r0 + block_m).clamp(max=seqlen)
    j = torch.arange(kb, device=device)
    return (j[None, :] >= (r0 // block_n)[:, None]) & (j[None, :] <= ((r1 - 1) // block_n)[:, None])


def construct_pivotal_pattern(
    block_mean: torch.Tensor, *, gamma: float, seqlen: int, block_m: int, block_n: int, layer: int, head: int
) -> Pivot:
    """Alg. 2 for one dense head: its pivot `(a~, M)`.

    Args:
        block_mean: float `[Qb, Kb]`, the head's mean scaled logit per block (-inf for
            blocks not computed: non-causal ones).
        gamma: the cumulative threshold.
        seqlen, block_m, block_n: the plan's sizes. layer, head: provenance.

    Returns:
        The `Pivot`: `a~` the last row of the block attention, `M` the fewest blocks
        (diagonal blocks first, see the module doc) holding `gamma` of the normalised
        block attention of the whole map.
    """
    # Alg. 2 line 3: block-averaged attention scores, softmax over key blocks per row.
    a_block = torch.softmax(block_mean.to(torch.float64), dim=-1)
    # Line 4: the last row is the pivotal representative.
    a_tilde = a_block[-1].clone()
    # Line 5: flatten and normalise over the whole map.
    flat = (a_block / a_block.sum()).flatten()
    # Lines 6-9: the fewest blocks reaching gamma (sorted, cumulative).
    forced = diagonal_blocks(seqlen, block_m, block_n, block_mean.device).flatten()
    keep = cover_threshold(flat, gamma, forced)
    # Line 10: index_to_mask.
    return Pivot(a_tilde=a_tilde, mask=keep.view(a_block.shape), layer=layer, head=head)


# -- public API ------------------------------------------------------------------------------


def decide_layer(
    q: torch.Tensor, k: torch.Tensor, state: SharePrefillState, *, layer: int, scale: float
) -> LayerDecision:
    """Alg. 3 for one layer: bind the layer to the state, estimate `a^`, decide every head."""
    state.bind(q, layer)
    a_hat = last_block_attention(q, k, block_m=state.block_m, block_n=state.block_n, scale=scale)
    return determine_sparse_pattern(state, a_hat, layer=layer)


def fallback_lines(
    q: torch.Tensor, k: torch.Tensor, state: SharePrefillState, *, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 5, the vertical-slash fallback (Alg. 1 line 6), for every head of a layer.

    FlexPrefill's lines (`flexprefill_vs_lines`) from the last `block_m` queries (the
    query block SharePrefill estimates from), with the state's `gamma`, forced
    `init_columns` / `local_diagonals` and single lines (`line_block = 1`).

    Returns:
        (verticals, slashes) bool `[B, Hq, N]`; the layer plan keeps those of its
        vertical-slash heads.
    """
    return flexprefill_vs_lines(
        q, k, gamma=state.gamma, last_q=state.block_m, init_columns=state.init_columns,
        local_diagonals=state.local_diagonals, line_block=1, scale=scale)


def shareprefill_layer_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    state: SharePrefillState,
    *,
    layer: int,
    scale: float | None = None,
) -> tuple[BlockColumnPlan, LayerDecision]:
    """Alg. 1 lines 2-7 for one layer: every head's pattern and the layer's plan.

    Reads `state` (its pivots) without changing it; `shareprefill_layer` also runs the
    attention and records the layer.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`.
        state: the prefill's `SharePrefillState`.
        layer: this layer's index in the model (for the cluster layout).
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        (plan, decision).

    Raises:
        TypeError, ValueError: bad inputs, or a layer that does not fit the state.
    """
    shape = check_qk(q, k)
    state = check_state(state)
    sm_scale = resolve_scale(scale, shape.head_dim)
    decision = decide_layer(q, k, state, layer=layer, scale=sm_scale)
    # Alg. 5 (Alg. 1 line 6), computed for every head and used for the vertical-slash ones.
    verticals, slashes = fallback_lines(q, k, state, scale=sm_scale)
    blocks, columns = layer_masks(verticals, slashes, state, decision)
    plan = BlockColumnPlan.from_masks(blocks, columns, seqlen=shape.seqlen, block_m=state.block_m,
                                      block_n=state.block_n)
    return plan, decision


def build_pivots(
    block_means: torch.Tensor, state: SharePrefillState, decision: LayerDecision
) -> dict[tuple[int, int], Pivot]:
    """Alg. 2 for every dense head of a layer: `{(cluster, batch row): Pivot}`.

    Args:
        block_means: float32 `[B, Hq, Qb, Kb]` from the layer's sparse attention.
        state: the prefill's state (for gamma and sizes). decision: the layer's.
    """
    assert state.shape is not None
    n = state.shape[2]
    pivots: dict[tuple[int, int], Pivot] = {}
    for row, h in (decision.pattern == SharePattern.DENSE).nonzero().tolist():
        pivots[(int(decision.cluster[h]), row)] = construct_pivotal_pattern(
            block_means[row, h], gamma=state.head_value("gamma", h), seqlen=n, block_m=state.block_m,
            block_n=state.block_n, layer=decision.layer, head=h)
    return pivots


def shareprefill_layer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: SharePrefillState,
    *,
    layer: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Alg. 1 for one layer: decide, attend (with block means), build pivots, record.

    Args:
        q: `[B, Hq, N, D]`; k, v: `[B, Hkv, N, D]`.
        state: the prefill's `SharePrefillState`, updated in place.
        layer: this layer's index in the model.
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs, or a layer that does not fit the state.
    """
    check_qkv(q, k, v)
    plan, decision = shareprefill_layer_plan(q, k, state, layer=layer, scale=scale)
    dense = bool((decision.pattern == SharePattern.DENSE).any())
    if not dense:
        state.record(decision, {})
        return sparse_attention(q, k, v, plan, scale=scale)
    b, hq = q.shape[:2]
    block_means = torch.empty(b, hq, plan.num_query_blocks, plan.num_key_blocks, dtype=torch.float32,
                              device=q.device)
    out = sparse_attention(q, k, v, plan, scale=scale, block_mean_out=block_means)
    state.record(decision, build_pivots(block_means, state, decision))
    return out


def shareprefill_stack(
    qs: Sequence[torch.Tensor],
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    state: SharePrefillState,
    *,
    layers: Sequence[int] | None = None,
    scale: float | None = None,
) -> list[torch.Tensor]:
    """Run the q, k, v of several layers of one prefill in order (`shareprefill_layer` each).

    For a model the q, k, v of a layer depend on the previous layer's output; this
    runs a captured (or synthetic) stack as if it were one prefill.

    Args:
        qs, ks, vs: per layer `[B, Hq, N, D]`, `[B, Hkv, N, D]`, `[B, Hkv, N, D]`.
        state: a fresh (or partly used) `SharePrefillState`, updated in place.
        layers: the layers' indices in the model (default `0 .. len(qs) - 1`),
            increasing.
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        The outputs, one `[B, Hq, N, D]` per layer.

    Raises:
        TypeError, ValueError: mismatched lists, layers out of order, bad inputs.
    """
    if not (len(qs) == len(ks) == len(vs)):
        raise ValueError(f"qs, ks, vs must have one entry per layer, got {len(qs)}, {len(ks)}, {len(vs)}")
    order = list(range(len(qs))) if layers is None else list(layers)
    if len(order) != len(qs):
        raise ValueError(f"layers must name {len(qs)} layers, got {len(order)}")
    if any(b <= a for a, b in zip(order, order[1:])):
        raise ValueError(f"layers must be strictly increasing (model order), got {order}")
    return [shareprefill_layer(q, k, v, state, layer=l, scale=scale)
            for q, k, v, l in zip(qs, ks, vs, order)]


def shareprefill_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    layout: ClusterLayout | str | Path | None = None,
    layer: int = 0,
    tau: PerHead = TAU,
    delta: PerHead = DELTA,
    gamma: PerHead = GAMMA,
    block_m: int = 64,
    block_n: int = 64,
    init_columns: int = 1,
    local_diagonals: int = 1,
    scale: float | None = None,
) -> BlockColumnPlan:
    """SharePrefill's plan of one layer run as a whole prefill (a fresh state).

    No cluster has a pivot yet, so each cluster's first head with `d_sparse < delta`
    is dense and every other head takes the Alg. 5 fallback; sharing needs earlier
    layers (`SharePrefillState` with `shareprefill_layer` or `shareprefill_stack`).

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`.
        layout: the cluster layout (or the path of its JSON); its layer `layer` gives
            the heads' clusters (a layout with more heads than q is allowed, the extra
            ones are unused). None: all heads in one cluster.
        layer: which layer of `layout` these heads are.
        tau, delta, gamma: the thresholds (see `SharePrefillState`).
        block_m, block_n: query rows and keys per block.
        init_columns, local_diagonals: forced lines of the Alg. 5 fallback.
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        The layer's `BlockColumnPlan`.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    check_qk(q, k)
    state = SharePrefillState(layout, tau=tau, delta=delta, gamma=gamma, block_m=block_m,
                              block_n=block_n, init_columns=init_columns, local_diagonals=local_diagonals)
    plan, _ = shareprefill_layer_plan(q, k, state, layer=layer, scale=scale)
    return plan


def shareprefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: ClusterLayout | str | Path | None = None,
    layer: int = 0,
    tau: PerHead = TAU,
    delta: PerHead = DELTA,
    gamma: PerHead = GAMMA,
    block_m: int = 64,
    block_n: int = 64,
    init_columns: int = 1,
    local_diagonals: int = 1,
    scale: float | None = None,
) -> torch.Tensor:
    """SharePrefill attention of one layer run as a whole prefill (see `shareprefill_plan`).

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    check_qkv(q, k, v)
    plan = shareprefill_plan(q, k, layout=layout, layer=layer, tau=tau, delta=delta, gamma=gamma,
                             block_m=block_m, block_n=block_n, init_columns=init_columns,
                             local_diagonals=local_diagonals, scale=scale)
    return sparse_attention(q, k, v, plan, scale=scale)
