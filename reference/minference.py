"""MInference end to end: per-head pattern configs, one merged plan, and the offline search.

* `HeadPattern` / `MInferenceConfig`: every (layer, query head) maps to one of
  `a_shape`, `vertical_slash`, `block_sparse` and its parameters; saved as JSON.
  `MInferenceConfig.from_json` also reads MInference's own config files (a list per
  layer of `{"head": ["vertical_and_slash", vertical, slash, score]}`).
* `minference_plan` / `minference`: the plans of the layer's patterns, each head
  taking its own pattern's lists, merged into one `BlockColumnPlan` (one kernel
  launch for the layer). All heads of a layer must use the same block sizes.
* `search_patterns` (Alg. 1, kernel-aware search): every candidate of Table 4 is
  resized until the score entries the kernel really computes (`kernel_cost`, from
  the plan, not from nominal sizes) match the target, the cost of A-shape
  (1024, 4096) by default; then each head takes the candidate whose output is
  closest to dense attention.

`fast.minference` et al. run the same code with `fast`'s estimators and kernel.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ._checks import check_block_size, check_positive_int, check_qk, check_qkv, resolve_scale
from .a_shape import a_shape, a_shape_plan
from .attention import attention, sparse_attention
from .dense_fallback import apply_rule
from .block_sparse import block_sparse, block_sparse_plan
from .plan import BlockColumnPlan, cdiv
from .vertical_slash import vertical_slash, vertical_slash_plan

PATTERNS: dict[str, tuple[str, ...]] = {
    "a_shape": ("sink", "window", "block_m", "block_n"),
    "vertical_slash": ("vertical_size", "slash_size", "last_q", "block_m", "block_n",
                       "init_columns", "local_diagonals"),
    "block_sparse": ("top_k", "block_size"),
}
_REQUIRED = {"a_shape": (), "vertical_slash": ("vertical_size", "slash_size"), "block_sparse": ("top_k",)}
# Parameters that may be 0; every other one must be >= 1. Block sizes are capped too.
_MAY_BE_ZERO = ("sink", "init_columns", "local_diagonals")
_BLOCK_PARAMS = ("block_m", "block_n", "block_size")
_FORMAT = "sparseprefill.minference"


@dataclass(frozen=True)
class HeadPattern:
    """One head's sparse pattern and its integer parameters (the method's keywords).

    Raises:
        ValueError: unknown pattern, unknown or missing parameter.
        TypeError: a parameter that is not an int.
    """

    pattern: str
    params: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str):
            raise TypeError(f"pattern must be a str, got {type(self.pattern).__name__}")
        if not isinstance(self.params, Mapping):
            raise TypeError(f"params must be a mapping of parameter names to ints, got "
                            f"{type(self.params).__name__}")
        if self.pattern not in PATTERNS:
            raise ValueError(f"pattern must be one of {sorted(PATTERNS)}, got {self.pattern!r}")
        for name, value in self.params.items():
            if name not in PATTERNS[self.pattern]:
                raise ValueError(f"{self.pattern} has no parameter {name!r}; "
                                 f"it takes {PATTERNS[self.pattern]}")
            label = f"{self.pattern} parameter {name}"
            if name in _BLOCK_PARAMS:
                check_block_size(label, value)
            else:
                check_positive_int(label, value, minimum=0 if name in _MAY_BE_ZERO else 1)
        for name in _REQUIRED[self.pattern]:
            if name not in self.params:
                raise ValueError(f"{self.pattern} needs the parameter {name!r}")
        object.__setattr__(self, "params", dict(sorted(self.params.items())))

    def __hash__(self) -> int:
        return hash(self.key())

    def key(self) -> tuple[str, tuple[tuple[str, int], ...]]:
        """A hashable identity: heads with equal keys share one plan."""
        return self.pattern, tuple(self.params.items())

    def block_sizes(self) -> tuple[int, int]:
        """(block_m, block_n) of the plans this pattern makes (method defaults filled in)."""
        if self.pattern == "block_sparse":
            size = self.params.get("block_size", 64)
            return size, size
        return self.params.get("block_m", 64), self.params.get("block_n", 64)

    def with_params(self, **changes: int) -> HeadPattern:
        """The same pattern with some parameters replaced."""
        return HeadPattern(self.pattern, {**self.params, **changes})

    def to_dict(self) -> dict[str, Any]:
        return {"pattern": self.pattern, **self.params}


@dataclass(frozen=True)
class MInferenceConfig:
    """Which pattern every (layer, query head) uses.

    Attributes:
        layers: `layers[l][h]` is the `HeadPattern` of query head `h` of layer `l`.
    """

    layers: tuple[tuple[HeadPattern, ...], ...]

    def __post_init__(self) -> None:
        layers = self.layers
        if not isinstance(layers, (tuple, list)):
            raise TypeError(f"layers must be a sequence of layers, got {type(layers).__name__}")
        for i, layer in enumerate(layers):
            if not isinstance(layer, (tuple, list)) or not layer:
                raise TypeError(f"layers[{i}] must be a non-empty sequence of HeadPattern, got {layer!r}")
            for h, head in enumerate(layer):
                if not isinstance(head, HeadPattern):
                    raise TypeError(f"layers[{i}][{h}] must be a HeadPattern, got {type(head).__name__}")
        object.__setattr__(self, "layers", tuple(tuple(layer) for layer in layers))

    def cap_last_q(self, limit: int) -> MInferenceConfig:
        """This config with every head's `last_q` at most `limit` (chunked prefill: a
        chunk of `limit` queries estimates from its own last queries; `chunk_plan`)."""
        def cap(head: HeadPattern) -> HeadPattern:
            if head.params.get("last_q", 0) <= limit:
                return head
            return HeadPattern(head.pattern, {**head.params, "last_q": limit})
        return MInferenceConfig(tuple(tuple(cap(h) for h in layer) for layer in self.layers))

    def layer(self, index: int) -> tuple[HeadPattern, ...]:
        """The patterns of one layer's query heads.

        Raises:
            TypeError: `index` is not an int.
            IndexError: no such layer.
        """
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index must be an int, got {type(index).__name__}")
        if not 0 <= index < len(self.layers):
            raise IndexError(f"layer {index} outside a config of {len(self.layers)} layers")
        return self.layers[index]

    @staticmethod
    def uniform(num_layers: int, num_heads: int, pattern: HeadPattern) -> MInferenceConfig:
        """Every head of every layer uses `pattern`."""
        check_positive_int("num_layers", num_layers)
        check_positive_int("num_heads", num_heads)
        if not isinstance(pattern, HeadPattern):
            raise TypeError(f"pattern must be a HeadPattern, got {type(pattern).__name__} ({pattern!r})")
        return MInferenceConfig(tuple((pattern,) * num_heads for _ in range(num_layers)))

    def to_json(self, *, indent: int | None = None) -> str:
        """JSON text: `{"format", "version", "layers": [[{"pattern": ..., params}, ...], ...]}`."""
        layers = [[head.to_dict() for head in layer] for layer in self.layers]
        return json.dumps({"format": _FORMAT, "version": 1, "layers": layers}, indent=indent)

    @staticmethod
    def from_json(text: str) -> MInferenceConfig:
        """Parse `to_json`'s format, or MInference's own config file.

        MInference's files are a list per layer of `{"<head>": [name, a, b, score]}`;
        `vertical_and_slash` entries become `vertical_slash(vertical_size=a, slash_size=b)`.

        Raises:
            ValueError: malformed JSON, an unknown format, or a bad head entry.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"config is not valid JSON: {err}") from err
        if isinstance(data, dict) and data.get("format") == _FORMAT:
            if data.get("version") != 1:
                raise ValueError(f"unsupported config version {data.get('version')!r}")
            layers = data.get("layers")
            if not isinstance(layers, list) or not all(isinstance(layer, list) and layer for layer in layers):
                raise ValueError("config 'layers' must be a list of non-empty lists of head entries, "
                                 f"got {layers!r:.200}")
            try:
                return MInferenceConfig(tuple(
                    tuple(_head_from_dict(head) for head in layer) for layer in layers
                ))
            except TypeError as err:
                raise ValueError(f"config has a bad head entry: {err}") from err
        if isinstance(data, list) and all(isinstance(layer, dict) for layer in data):
            return MInferenceConfig(tuple(_minference_layer(layer) for layer in data))
        raise ValueError("config must be sparseprefill's format or a MInference pattern file")

    def save(self, path: str | Path) -> Path:
        """Write `to_json` to `path`; return the path."""
        out = Path(path)
        out.write_text(self.to_json(indent=1) + "\n")
        return out

    @staticmethod
    def load(path: str | Path) -> MInferenceConfig:
        """Read a config written by `save` (or a MInference pattern file)."""
        return MInferenceConfig.from_json(Path(path).read_text())


def _head_from_dict(entry: object) -> HeadPattern:
    if not isinstance(entry, dict) or "pattern" not in entry:
        raise ValueError(f"a head entry must be an object with a 'pattern', got {entry!r}")
    params = {name: value for name, value in entry.items() if name != "pattern"}
    return HeadPattern(str(entry["pattern"]), params)


def check_patterns(methods: Methods, heads: Sequence[object], what: str) -> tuple[HeadPattern, ...]:
    """Check heads (or search candidates) before any estimate runs; return them.

    Raises:
        TypeError: an entry that is not a HeadPattern.
        ValueError: block sizes the package's kernel cannot run.
    """
    out = []
    for i, head in enumerate(heads):
        if not isinstance(head, HeadPattern):
            raise TypeError(f"{what}[{i}] must be a HeadPattern, got {type(head).__name__}")
        bm, bn = head.block_sizes()
        names = ("block_size", "block_size") if head.pattern == "block_sparse" else ("block_m", "block_n")
        where = f"{what}[{i}] ({head.pattern})"
        methods.check_blocks(bm, bn, (f"{where} {names[0]}", f"{where} {names[1]}"))
        out.append(head)
    return tuple(out)


def _minference_layer(layer: Mapping[str, Any]) -> tuple[HeadPattern, ...]:
    if not all(isinstance(h, str) and h.isdigit() for h in layer):
        raise ValueError(f"MInference layer keys must be head numbers, got {list(layer)!r:.200}")
    heads = sorted(layer.items(), key=lambda item: int(item[0]))
    if [int(h) for h, _ in heads] != list(range(len(heads))):
        raise ValueError(f"MInference layer heads must be 0 .. H-1, got {[h for h, _ in heads]}")
    out = []
    for head, entry in heads:
        if not isinstance(entry, list) or len(entry) < 3 or entry[0] != "vertical_and_slash":
            raise ValueError(f"head {head}: only 'vertical_and_slash' MInference entries are "
                             f"read, got {entry!r}")
        try:
            sizes = {"vertical_size": int(entry[1]), "slash_size": int(entry[2])}
            out.append(HeadPattern("vertical_slash", sizes))
        except (TypeError, ValueError, OverflowError) as err:
            raise ValueError(f"head {head}: bad vertical/slash sizes in {entry!r}: {err}") from err
    return tuple(out)


# -- cost ------------------------------------------------------------------------


def kernel_cost(plan: BlockColumnPlan) -> torch.Tensor:
    """Score entries (query row x key) the block/column kernel computes, float64 `[B, Hq]`.

    Every listed block costs `rows x block_n`; listed columns are gathered in tiles of
    `gcd(block_n, 64)` keys, as the kernel does, so a partly filled tile costs a whole
    one. Multiply by `4 * D` for FLOPs (two matmuls, multiply-add).
    """
    n, bm, bn = plan.seqlen, plan.block_m, plan.block_n
    tile = math.gcd(bn, 64)
    rows = (n - torch.arange(plan.num_query_blocks, device=plan.device) * bm).clamp(max=bm)
    keys = plan.block_count.to(torch.float64) * bn + (
        torch.div(plan.column_count + tile - 1, tile, rounding_mode="floor").to(torch.float64) * tile
    )
    return (keys * rows.to(torch.float64)).sum(dim=-1)


# -- dispatch --------------------------------------------------------------------


@dataclass(frozen=True)
class Methods:
    """One package's estimators, runners and dense attention, by pattern name."""

    plans: Mapping[str, Callable[..., BlockColumnPlan]]
    runs: Mapping[str, Callable[..., torch.Tensor]]
    sparse_attention: Callable[..., torch.Tensor]
    attention: Callable[..., torch.Tensor]
    # (block_m, block_n, (name_m, name_n)) -> None; raises ValueError naming the size the
    # package's kernel cannot run.
    check_blocks: Callable[[int, int, tuple[str, str]], None] = lambda block_m, block_n, names: None


REFERENCE_METHODS = Methods(
    plans={"a_shape": a_shape_plan, "vertical_slash": vertical_slash_plan, "block_sparse": block_sparse_plan},
    runs={"a_shape": a_shape, "vertical_slash": vertical_slash, "block_sparse": block_sparse},
    sparse_attention=sparse_attention,
    attention=attention,
)


def _plan_kwargs(head: HeadPattern, scale: float | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(head.params)
    if head.pattern == "vertical_slash":
        kwargs["scale"] = scale
    return kwargs


def _owner_runs(owner: Sequence[int]) -> list[tuple[int, int, int]]:
    """`(h0, h1, plan)` for each maximal run of consecutive heads owned by one plan."""
    runs: list[tuple[int, int, int]] = []
    for h, i in enumerate(owner):
        if runs and runs[-1][2] == i and runs[-1][1] == h:
            runs[-1] = (runs[-1][0], h + 1, i)
        else:
            runs.append((h, h + 1, i))
    return runs


def merge_head_plans(plans: Sequence[BlockColumnPlan], owner: Sequence[int]) -> BlockColumnPlan:
    """One plan whose head `h` is head `h` of `plans[owner[h]]`.

    Lists that every plan shares across query blocks (stride 0 along that axis, as the
    fast vertical-slash verticals and the dense block lists are) or leaves empty stay
    shared, one row per head expanded over query blocks, so a layer mixing patterns
    costs no more memory than its parts. The merged plan promises disjoint columns
    (`columns_disjoint`) when every plan with columns does, and is marked valid when
    every part was.

    Raises:
        ValueError: plans of different sizes, or `owner` of the wrong length.
    """
    plans = [p.ungrouped() for p in plans]
    first = plans[0]
    for p in plans:
        if (p.seqlen, p.block_m, p.block_n, tuple(p.block_count.shape)) != (
                first.seqlen, first.block_m, first.block_n, tuple(first.block_count.shape)):
            raise ValueError("all heads of a layer must use the same block sizes (block_m, block_n); "
                             f"got ({p.block_m}, {p.block_n}) and ({first.block_m}, {first.block_n})")
    b, h, qb = first.block_count.shape
    if len(owner) != h:
        raise ValueError(f"owner must name a plan for each of the {h} heads, got {len(owner)}")
    out: dict[str, torch.Tensor] = {}
    for kind in ("block", "column"):
        indices = [getattr(p, f"{kind}_index") for p in plans]
        width = max(t.shape[3] for t in indices)
        shared = all(t.shape[3] == 0 or t.stride(2) == 0 for t in indices)
        rows = 1 if shared else qb
        # Runs of consecutive heads of one plan, concatenated as views: no index tensor is
        # copied to the device, so the merge is capture-safe (docs/serving.md), and it is
        # one `cat` per tensor rather than two copies per run (32 runs when patterns
        # alternate by head: 1.5 ms of host time at 32K on an H200).
        runs = _owner_runs(owner)
        rowed = [t[:, :, :rows].expand(b, h, rows, t.shape[3]).to(torch.int32) for t in indices]
        padded = [torch.nn.functional.pad(t, (0, width - t.shape[3])) if t.shape[3] < width else t
                  for t in rowed]
        counts = [getattr(p, f"{kind}_count").to(torch.int32) for p in plans]
        count = torch.cat([counts[i][:, h0:h1] for h0, h1, i in runs], dim=1)
        index = torch.cat([padded[i][:, h0:h1] for h0, h1, i in runs], dim=1)
        out[f"{kind}_count"], out[f"{kind}_index"] = count, index.expand(b, h, qb, width)
    owned = set(owner)
    used = [p for i, p in enumerate(plans) if i in owned]
    merged = BlockColumnPlan(
        seqlen=first.seqlen,
        block_m=first.block_m,
        block_n=first.block_n,
        block_count=out["block_count"],
        block_index=out["block_index"],
        column_count=out["column_count"],
        column_index=out["column_index"],
        columns_disjoint=all(p.columns_disjoint or p.column_index.shape[3] == 0 for p in used),
    )
    return merged.mark_valid() if all(p._checked for p in used) else merged


def minference_plan_with(
    methods: Methods,
    q: torch.Tensor,
    k: torch.Tensor,
    config: MInferenceConfig,
    *,
    layer: int = 0,
    scale: float | None = None,
) -> BlockColumnPlan:
    """`minference_plan` with a given package's estimators (see the module doc)."""
    shape = check_qk(q, k)
    resolve_scale(scale, shape.head_dim)
    if not isinstance(config, MInferenceConfig):
        raise TypeError(f"config must be a MInferenceConfig, got {type(config).__name__}")
    check_positive_int("layer", layer, minimum=0)
    heads = check_patterns(methods, config.layer(layer), f"config.layers[{layer}]")
    if len(heads) != shape.q_heads:
        raise ValueError(f"config layer {layer} has {len(heads)} heads, q has {shape.q_heads}")
    sizes = sorted({head.block_sizes() for head in heads})
    if len(sizes) > 1:
        raise ValueError(f"config layer {layer}: all heads of a layer must use the same block sizes "
                         f"(block_m, block_n); got {sizes}")
    distinct: dict[tuple[str, tuple[tuple[str, int], ...]], int] = {}
    owner = [distinct.setdefault(head.key(), len(distinct)) for head in heads]
    patterns = {head.key(): head for head in heads}
    # Estimates run on all heads, not only the pattern's own: slicing GQA query heads
    # would mean copying K per head, and the estimates are small next to the kernel.
    plans = [methods.plans[patterns[key].pattern](q, k, **_plan_kwargs(patterns[key], scale))
             for key in distinct]
    if len(plans) == 1:
        return plans[0]
    return merge_head_plans(plans, owner)


def minference_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    config: MInferenceConfig,
    *,
    layer: int = 0,
    scale: float | None = None,
) -> BlockColumnPlan:
    """The merged plan of one layer: each query head planned by its own pattern.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`.
        config: the patterns; `config.layers[layer]` must list `Hq` heads, all with the
            same block sizes.
        layer: which layer of `config`.
        scale: softmax scale of the vertical-slash estimates, `1/sqrt(D)` if None.

    Returns:
        A `BlockColumnPlan` for all heads.

    Raises:
        TypeError, ValueError, IndexError: bad inputs, config or layer.
    """
    return apply_rule(minference_plan_with(REFERENCE_METHODS, q, k, config, layer=layer, scale=scale), q)


def minference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: MInferenceConfig,
    *,
    layer: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """MInference attention of one layer: `minference_plan`, then one sparse attention.

    Returns:
        `[B, Hq, N, D]` in q's dtype.
    """
    check_qkv(q, k, v)
    plan = minference_plan(q, k, config, layer=layer, scale=scale)
    return sparse_attention(q, k, v, plan, scale=scale)


# -- search (Alg. 1) ----------------------------------------------------------------

# Table 4: A-shape (1024, 4096); Vertical-Slash (30, 2048), (100, 1800), (500, 1500),
# (3000, 200); Block-Sparse 100.
TABLE4: tuple[HeadPattern, ...] = (
    HeadPattern("a_shape", {"sink": 1024, "window": 4096}),
    HeadPattern("vertical_slash", {"vertical_size": 30, "slash_size": 2048}),
    HeadPattern("vertical_slash", {"vertical_size": 100, "slash_size": 1800}),
    HeadPattern("vertical_slash", {"vertical_size": 500, "slash_size": 1500}),
    HeadPattern("vertical_slash", {"vertical_size": 3000, "slash_size": 200}),
    HeadPattern("block_sparse", {"top_k": 100}),
)
# ChangeSpace steps (C.3: 50 for the lines); block-sparse moves a block at a time.
_STEP = {"vertical_slash": ("slash_size", 50), "block_sparse": ("top_k", 1)}


@dataclass(frozen=True)
class SearchResult:
    """What `search_patterns` found for one layer.

    Attributes:
        patterns: the chosen `HeadPattern` per query head (a layer of `MInferenceConfig`).
        candidates: the candidates after resizing to the target cost.
        errors: float64 `[C, Hq]`, `||y_c - y|| / ||y||` per candidate and head.
        costs: float64 `[C]`, mean `kernel_cost` per head of each candidate.
        target: the target cost (score entries per head).
    """

    patterns: tuple[HeadPattern, ...]
    candidates: tuple[HeadPattern, ...]
    errors: torch.Tensor
    costs: torch.Tensor
    target: float


def _mean_cost(methods: Methods, q: torch.Tensor, k: torch.Tensor, head: HeadPattern,
               scale: float | None) -> float:
    plan = methods.plans[head.pattern](q, k, **_plan_kwargs(head, scale))
    return float(kernel_cost(plan).mean())


def change_space(
    methods: Methods,
    q: torch.Tensor,
    k: torch.Tensor,
    head: HeadPattern,
    *,
    target: float,
    tolerance: float,
    scale: float | None,
) -> tuple[HeadPattern, float]:
    """Alg. 1 lines 3-7: resize `head` until its kernel cost is within `tolerance` of `target`.

    The size parameter (slash_size, or top_k) moves on its ChangeSpace grid by
    bisection, since the cost never decreases as it grows; the closest grid point
    wins if none is within tolerance. A-shape is kept as it is.

    Returns:
        (resized pattern, its mean kernel cost per head).
    """
    cost = _mean_cost(methods, q, k, head, scale)
    if head.pattern not in _STEP or abs(cost - target) <= tolerance * target:
        return head, cost
    name, step = _STEP[head.pattern]
    n = q.shape[2]
    upper = cdiv(n, head.block_sizes()[1]) if head.pattern == "block_sparse" else n
    lo, hi = 1, max(1, cdiv(upper, step))
    best = (abs(cost - target), head, cost)
    while lo <= hi:
        mid = (lo + hi) // 2
        trial = head.with_params(**{name: min(upper, mid * step)})
        trial_cost = _mean_cost(methods, q, k, trial, scale)
        best = min(best, (abs(trial_cost - target), trial, trial_cost), key=lambda item: item[0])
        if abs(trial_cost - target) <= tolerance * target:
            break
        if trial_cost < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return best[1], best[2]


def search_patterns_with(
    methods: Methods,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    candidates: Sequence[HeadPattern] = TABLE4,
    target: float | None = None,
    tolerance: float = 0.05,
    scale: float | None = None,
) -> SearchResult:
    """`search_patterns` with a given package's methods (see the module doc)."""
    shape = check_qkv(q, k, v)
    resolve_scale(scale, shape.head_dim)
    if isinstance(candidates, (str, bytes)) or not isinstance(candidates, Sequence):
        raise TypeError(f"candidates must be a sequence of HeadPattern, got {type(candidates).__name__}")
    if not candidates:
        raise ValueError("candidates must not be empty")
    candidates = check_patterns(methods, candidates, "candidates")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise TypeError(f"tolerance must be a float, got {type(tolerance).__name__}")
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must lie in (0, 1), got {tolerance}")
    if target is not None:
        if isinstance(target, bool) or not isinstance(target, (int, float)):
            raise TypeError(f"target must be a float or None, got {type(target).__name__}")
        if not (math.isfinite(target) and target > 0):
            raise ValueError(f"target must be finite and > 0, got {target}")
    default = HeadPattern("a_shape", {"sink": 1024, "window": 4096})
    if target is None:
        default = check_patterns(methods, [default], "default target pattern")[0]
        target = _mean_cost(methods, q, k, default, scale)
    fitted = [change_space(methods, q, k, c, target=target, tolerance=tolerance, scale=scale)
              for c in candidates]
    dense = methods.attention(q, k, v, scale=scale).to(torch.float64)
    dense_norm = dense.transpose(0, 1).reshape(shape.q_heads, -1).norm(dim=1).clamp_min(1e-300)
    errors = torch.empty(len(fitted), shape.q_heads, dtype=torch.float64)
    for i, (head, _) in enumerate(fitted):
        out = methods.runs[head.pattern](q, k, v, **head.params, scale=scale)
        diff = (out.to(torch.float64) - dense).transpose(0, 1).reshape(shape.q_heads, -1).norm(dim=1)
        errors[i] = (diff / dense_norm).cpu()
    # Alg. 1 line 14: argmin per head; ties go to the earlier candidate.
    choice = errors.argmin(dim=0).tolist()
    return SearchResult(
        patterns=tuple(fitted[c][0] for c in choice),
        candidates=tuple(head for head, _ in fitted),
        errors=errors,
        costs=torch.tensor([cost for _, cost in fitted], dtype=torch.float64),
        target=float(target),
    )


def search_patterns(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    candidates: Sequence[HeadPattern] = TABLE4,
    target: float | None = None,
    tolerance: float = 0.05,
    scale: float | None = None,
) -> SearchResult:
    """Kernel-aware pattern search for one layer (Alg. 1, Table 4).

    Args:
        q: `[B, Hq, N, D]`; k, v: `[B, Hkv, N, D]`: a sample of the layer's inputs.
        candidates: patterns to try (Table 4 by default); vertical-slash candidates
            are resized through `slash_size`, block-sparse through `top_k`.
        target: kernel cost per head to match (`kernel_cost`); default: A-shape
            (1024, 4096) on these inputs.
        tolerance: relative cost mismatch accepted while resizing.
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        A `SearchResult`; `result.patterns` is the layer of a `MInferenceConfig`.

    Raises:
        TypeError, ValueError: bad inputs or arguments.
    """
    return search_patterns_with(REFERENCE_METHODS, q, k, v, candidates=candidates, target=target,
                                tolerance=tolerance, scale=scale)
