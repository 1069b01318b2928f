"""`headwise`: every query head its own method, setting and unit; one plan and one launch per layer.

A layer's heads differ by 10x in what they need (docs/calibrate.md), and no single method
is the cheapest on all of them: a head with a few strong columns and diagonals is served
by lines, a head whose mass sits in blocks by tiles, a diffuse head by nothing sparse at
all. `headwise_plan` takes one choice per query head, `{"method": name, **parameters}` or
None (that head runs full causal attention), and makes **one** plan of the layer:

1. heads that take the same method with the same non-knob parameters (block sizes,
   strides, ...) form a group; each group's estimator runs once, on its own query heads
   (the group's knob values, `Method.knobs`, go in as one value per head). A group is
   planned on a view of its heads: by KV head, the KV heads that give it the same number
   of query heads are one call (a GQA call on those heads alone; q and k are sliced where
   the heads are one run, else gathered), so an estimate never reads a head it does not
   plan;
2. the groups' plans are merged into one plan of every head at their finest common unit
   (`plan.merge_heads`: each part re-expressed at the gcd of the block sizes by
   `BlockColumnPlan.refined`, exact), the None heads marked dense;
3. the break-even rule (`dense_fallback.apply_rule`) on the merged plan.

`sparse_attention` of that plan is one kernel launch for the layer (the marked heads
through dense attention). Every method here plans a head from that head's queries, keys
and knob value alone (none has coupled heads), so head `h` of the merged plan keeps
exactly the keys that its method's plan of the whole layer keeps for `h`
(`tests/test_headwise.py`).

`fast.headwise_plan` runs the same steps with `fast`'s estimators. `sparseprefill calibrate
--method headwise` chooses the heads' choices: per head, among methods, settings and units, the
one that reaches the target at the least modelled cost (`head_kernel_ms` + `estimate_ms`).

The estimate cost model (`ESTIMATE_SHARES`): each method's estimate (its `*_plan` call,
plan included) as a share of cuDNN's dense time of the same heads, measured on one H200
(bf16, B = 1, 32 query / 8 KV heads, the `estimates` bench of
`benches/results/estimates-h200.json`, runs "after-32k-d128", "after-128k-d128",
"after-d64"), at N = 32K and 128K, D = 128 and 64: linear in log2 N between them and
clamped outside (so shorter prompts get the 32K share, an optimistic figure: fixed launch
costs weigh more at 8K), the nearest D. XAttention's share scales with `8 / stride` from
its stride-8 figure (stride 16 measured 0.071 against 0.066 so predicted at 32K). A
method without a measurement (block_sparse) has no share and is no candidate of the
calibration. Streaming, A-shape and dense plans depend on N alone: no estimate.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._checks import check_qk, check_qkv, resolve_scale
from .dense_fallback import RateTable, apply_rule, dense_cost, kernel_tile
from .plan import BlockColumnPlan, cdiv, merge_heads

HeadChoice = Mapping[str, Any] | None
METHOD_KEY = "method"

# The methods a head may take, and the parameters of each that take one value per query head
# (their descriptors' `Method.knobs`; `tests/test_headwise.py` checks the two agree).
KNOBS: dict[str, tuple[str, ...]] = {
    "xattention": ("threshold",),
    "dpxa": ("threshold",),
    "vertical_slash": ("vertical_size", "slash_size"),
    "flexprefill_vs": ("gamma",),
    "sample_attention": ("alpha_c", "alpha_s"),
    "anchor_attention": ("theta",),
    "block_sparse": ("top_k",),
    "a_shape": ("sink", "window"),
    "streaming": ("sink", "window"),
    "dense": (),
}


@dataclass(frozen=True)
class Estimator:
    """One method as `headwise` calls it: its plan function and its per-head knobs."""

    plan: Callable[..., BlockColumnPlan]
    knobs: tuple[str, ...]

    def takes_scale(self) -> bool:
        return "scale" in inspect.signature(self.plan).parameters

    def parameters(self) -> tuple[str, ...]:
        """The keyword parameters of the plan function (q, k and scale excluded)."""
        return tuple(p for p in inspect.signature(self.plan).parameters if p not in ("q", "k", "scale"))


def reference_estimators() -> dict[str, Estimator]:
    """The reference package's estimators, by method name."""
    from .a_shape import a_shape_plan
    from .anchor_attention import anchor_attention_plan
    from .block_sparse import block_sparse_plan
    from .dense import dense_plan
    from .dpxa import dpxa_plan
    from .flexprefill_vs import flexprefill_vs_plan
    from .sample_attention import sample_attention_plan
    from .streaming import streaming_plan
    from .vertical_slash import vertical_slash_plan
    from .xattention import xattention_plan

    plans: dict[str, Callable[..., BlockColumnPlan]] = {
        "xattention": xattention_plan, "dpxa": dpxa_plan, "vertical_slash": vertical_slash_plan,
        "flexprefill_vs": flexprefill_vs_plan, "sample_attention": sample_attention_plan,
        "anchor_attention": anchor_attention_plan, "block_sparse": block_sparse_plan, "a_shape": a_shape_plan,
        "streaming": streaming_plan, "dense": dense_plan,
    }
    return {name: Estimator(fn, KNOBS[name]) for name, fn in plans.items()}


# -- the choices -------------------------------------------------------------------------


def check_heads(heads: object, estimators: Mapping[str, Estimator]) -> list[tuple[str, dict[str, Any]] | None]:
    """Check a per-head choice list and return it as `(method, params)` or None per entry.

    Args:
        heads: a list or tuple; each entry None (full causal attention) or a mapping with
            `"method"` (a method `headwise` composes: `estimators`) and that method's parameters,
            each knob one value (the head's own). A call gives query head `h` entry
            `h % len(heads)` (one entry per head, or a pattern repeated over the heads, as
            MInference's default patterns are; a calibrated config has one per head, checked
            against its `q_heads`).
        estimators: the methods a head may take.

    Raises:
        TypeError: not a list of mappings / None, a parameter name the method does not take
            (`scale` included: the call's scale applies to every head).
        ValueError: empty, an unknown method, a knob given as a list.
    """
    if isinstance(heads, (str, bytes, Mapping)) or not isinstance(heads, (list, tuple)):
        raise TypeError(f"heads must be a list of per-head choices (a dict with 'method', or None), "
                        f"got {type(heads).__name__}")
    if not heads:
        raise ValueError("heads must not be empty")
    out: list[tuple[str, dict[str, Any]] | None] = []
    for h, entry in enumerate(heads):
        where = f"heads[{h}]"
        if entry is None:
            out.append(None)
            continue
        if not isinstance(entry, Mapping):
            raise TypeError(f"{where}: expected a dict with 'method' or None, got {type(entry).__name__}")
        params = dict(entry)
        name = params.pop(METHOD_KEY, None)
        if not isinstance(name, str) or name not in estimators:
            raise ValueError(f"{where}.method: expected one of {', '.join(estimators)}, got {name!r}")
        est = estimators[name]
        known = est.parameters()
        for key, value in params.items():
            if not isinstance(key, str) or key not in known:
                raise TypeError(f"{where}: {name} takes no parameter {key!r}; it takes {list(known)}")
            if key in est.knobs and isinstance(value, (list, tuple, torch.Tensor)):
                raise ValueError(f"{where}.{key}: one value for its own head, got a "
                                 f"{type(value).__name__}")
        out.append((name, params))
    return out


def _group_key(name: str, params: Mapping[str, Any], knobs: Sequence[str]) -> str:
    fixed = {key: val for key, val in params.items() if key not in knobs}
    given = sorted(key for key in params if key in knobs)
    return json.dumps([name, fixed, given], sort_keys=True, default=str)


def _select(t: torch.Tensor, heads: Sequence[int]) -> torch.Tensor:
    """Heads `heads` of `t` along dim 1: a slice where they are one run, else a gathered copy."""
    if list(heads) == list(range(heads[0], heads[0] + len(heads))):
        return t[:, heads[0]:heads[0] + len(heads)]
    return t.index_select(1, torch.tensor(list(heads), device=t.device))


def head_calls(heads: Sequence[int], q_heads: int, kv_heads: int) -> list[tuple[list[int], list[int]]]:
    """How one group's query heads are planned: `(query heads, their KV heads)` per estimator call.

    The KV heads that give the group the same number of query heads are one call (a GQA call
    with that many query heads per KV head), the query heads in KV-head order.
    """
    g = q_heads // kv_heads
    by_kv: dict[int, list[int]] = {}
    for h in sorted(heads):
        by_kv.setdefault(h // g, []).append(h)
    by_size: dict[int, list[int]] = {}
    for kv, hs in by_kv.items():
        by_size.setdefault(len(hs), []).append(kv)
    return [([h for kv in kvs for h in by_kv[kv]], kvs) for _, kvs in sorted(by_size.items())]


def headwise_plan_with(
    estimators: Mapping[str, Estimator],
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    heads: Sequence[HeadChoice],
    scale: float | None = None,
) -> BlockColumnPlan:
    """`headwise_plan` with a given package's estimators (see the module doc); no break-even rule."""
    shape = check_qk(q, k)
    resolve_scale(scale, shape.head_dim)
    hq, hkv = shape.q_heads, shape.kv_heads
    choices = check_heads(heads, estimators)
    # A head that takes `dense` is a dense head: marked, so it runs through dense attention.
    per_head = [None if c is None or c[0] == "dense" else c for c in (choices[h % len(choices)] for h in range(hq))]
    groups: dict[str, list[int]] = {}
    for h, choice in enumerate(per_head):
        if choice is not None:
            name, params = choice
            groups.setdefault(_group_key(name, params, estimators[name].knobs), []).append(h)
    dense = [h for h, choice in enumerate(per_head) if choice is None]
    if not groups:
        plan: BlockColumnPlan = estimators["dense"].plan(q, k)
        return plan.with_dense_heads(range(hq))
    parts: list[tuple[BlockColumnPlan, list[int]]] = []
    for members in groups.values():
        first = per_head[members[0]]
        assert first is not None
        name, params = first
        est = estimators[name]
        for qh, kvh in head_calls(members, hq, hkv):
            call = {key: val for key, val in params.items() if key not in est.knobs}
            for knob in est.knobs:
                if knob in params:
                    values = [per_head[h][1][knob] for h in qh]  # type: ignore[index]
                    call[knob] = values[0] if all(v == values[0] for v in values) else values
            if est.takes_scale():
                call["scale"] = scale
            parts.append((est.plan(_select(q, qh), _select(k, kvh), **call), qh))
    if len(parts) == 1 and parts[0][1] == list(range(hq)):
        return parts[0][0]
    return merge_heads(parts, num_heads=hq, dense_heads=dense)


def headwise_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    heads: Sequence[HeadChoice],
    scale: float | None = None,
) -> BlockColumnPlan:
    """One plan of a layer whose query heads each take their own method (see the module doc).

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`.
        heads: the query heads' choices, head `h` taking `heads[h % len(heads)]`: None (full
            causal attention) or `{"method": name, **params}`, a method of `KNOBS` with its
            parameters, each knob one value.
        scale: softmax scale of the estimates, `1/sqrt(D)` if None.

    Returns:
        A `BlockColumnPlan` of every head at the finest block sizes its heads use; the None
        and `dense` heads (and those the break-even rule sends dense) in `dense_heads`.

    Raises:
        TypeError, ValueError: bad inputs or choices (before any estimate); a bad knob value
            is refused by its method's estimator when its group is planned.
    """
    return apply_rule(headwise_plan_with(reference_estimators(), q, k, heads=heads, scale=scale), q)


def headwise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    heads: Sequence[HeadChoice],
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of a layer whose query heads each take their own method: `sparse_attention`
    of `headwise_plan` (one plan for the layer).

    Args:
        q: `[B, Hq, N, D]`; k, v: `[B, Hkv, N, D]`.
        heads, scale: as `headwise_plan`.

    Returns:
        `[B, Hq, N, D]` in q's dtype.
    """
    from .attention import sparse_attention

    check_qkv(q, k, v)
    return sparse_attention(q, k, v, headwise_plan(q, k, heads=heads, scale=scale), scale=scale)


# -- the cost model ----------------------------------------------------------------------


# Estimate time over cuDNN dense time of the same heads: {method: {D: ((N, share), ...)}}
# (benches/results/estimates-h200.json, bf16, B = 1, 32 / 8 heads; see the module doc).
ESTIMATE_SHARES: dict[str, dict[int, tuple[tuple[int, float], ...]]] = {
    "xattention": {128: ((32768, 0.1313), (131072, 0.1107)), 64: ((32768, 0.1519), (131072, 0.1417))},
    "dpxa": {128: ((32768, 0.1134), (131072, 0.0431)), 64: ((32768, 0.1089), (131072, 0.0538))},
    "vertical_slash": {128: ((32768, 0.0980), (131072, 0.0194)), 64: ((32768, 0.1419), (131072, 0.0296))},
    "flexprefill_vs": {128: ((32768, 0.0668), (131072, 0.0123)), 64: ((32768, 0.1042), (131072, 0.0172))},
    "sample_attention": {128: ((32768, 0.0860), (131072, 0.0080)), 64: ((32768, 0.1405), (131072, 0.0151))},
    "anchor_attention": {128: ((32768, 0.2775), (131072, 0.0847)), 64: ((32768, 0.2857), (131072, 0.0797))},
    "a_shape": {128: ((32768, 0.0), (131072, 0.0))},
    "streaming": {128: ((32768, 0.0), (131072, 0.0))},
    "dense": {128: ((32768, 0.0), (131072, 0.0))},
}
# XAttention's figures are at stride 8; its scoring reads N / stride antidiagonal cells.
_MEASURED_STRIDE = 8


def estimate_share(method: str, params: Mapping[str, Any], *, seqlen: int, head_dim: int) -> float | None:
    """A method's estimate time as a share of dense time at `seqlen`, `head_dim` (module doc);
    None for a method without a measurement."""
    table = ESTIMATE_SHARES.get(method)
    if table is None:
        return None
    d = min(table, key=lambda x: (abs(x - head_dim), -x))
    points = sorted(table[d])
    x = math.log2(max(seqlen, 1))
    (n0, s0), (n1, s1) = points[0], points[-1]
    w = min(1.0, max(0.0, (x - math.log2(n0)) / (math.log2(n1) - math.log2(n0)))) if n1 != n0 else 0.0
    share = (1 - w) * s0 + w * s1
    if "stride" in params:
        share *= _MEASURED_STRIDE / int(params["stride"])
    return share


def dense_ms(*, seqlen: int, batch: int, head_dim: int, dtype: torch.dtype | str, rates: RateTable) -> float:
    """One head's dense causal attention time on the faster dense path (the break-even rule's)."""
    ps, _ = dense_cost(rates.at(seqlen, head_dim, dtype, 128))
    return batch * seqlen * (seqlen + 1) / 2 * ps * 1e-9


def head_kernel_ms(block_pairs: torch.Tensor, column_pairs: torch.Tensor, *, seqlen: int, tile: int,
                   head_dim: int, dtype: torch.dtype | str, rates: RateTable) -> torch.Tensor:
    """The break-even rule's sparse time of each head's lists run on `tile`-row kernel tiles.

    Args:
        block_pairs, column_pairs: `[B, Hq]` kept causal pairs through blocks / columns
            (`dense_fallback.kept_pairs`, which refinement leaves unchanged).
        seqlen: N. tile: the kernel's query tile (`gcd(block_m, 128)` of the merged plan).
        head_dim, dtype, rates: as `dense_fallback.head_costs`.

    Returns:
        float64 `[Hq]` milliseconds (batch rows summed).
    """
    rate = rates.at(seqlen, head_dim, dtype, kernel_tile(tile))
    b = int(block_pairs.shape[0])
    pairs = block_pairs.to(torch.float64) * rate.block_ps + column_pairs.to(torch.float64) * rate.columns_ps
    out: torch.Tensor = pairs.sum(dim=0) * 1e-9 + b * cdiv(seqlen, kernel_tile(tile)) * rate.program_us * 1e-3
    return out


def estimate_ms(method: str, params: Mapping[str, Any], *, seqlen: int, batch: int, head_dim: int,
                dtype: torch.dtype | str, rates: RateTable) -> float | None:
    """One head's share of its method's estimate time (`estimate_share` x `dense_ms`), or None."""
    share = estimate_share(method, params, seqlen=seqlen, head_dim=head_dim)
    if share is None:
        return None
    return share * dense_ms(seqlen=seqlen, batch=batch, head_dim=head_dim, dtype=dtype, rates=rates)
