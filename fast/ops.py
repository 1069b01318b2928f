"""The fast entry points as `torch.library` custom ops: `torch.compile(fullgraph=True)` and CUDA graphs.

    import sparseprefill.fast.ops  # registers torch.ops.sparseprefill.*

    @torch.compile(fullgraph=True)
    def layer(q, k, v):
        return torch.ops.sparseprefill.vertical_slash(q, k, v, vertical_size=1000, slash_size=6096)

Importing this module registers, in the `sparseprefill` namespace:

* `sparse_attention(q, k, v, block_count, block_index, column_count, column_index,
  seqlen, block_m, block_n, columns_disjoint=False, column_group=1, query_offset=0, *,
  scale=None, validate=True) -> out` and `sparse_attention_lse(...) -> (out, lse)`: the
  block/column kernel on a plan passed as its four tensors and its ints (an op takes
  tensors and scalars, not a dataclass). `sparse_attention(q, k, v, plan)` below
  unpacks a `BlockColumnPlan`.
* `<method>(q, k, v, **params) -> out` for every method of
  `conformance.registry.METHODS`: estimate, plan and kernel in one op. Its output is
  `[B, Hq, N, D]` in q's dtype whatever the data, so the compiled graph has a fixed
  output shape even where the plan's width depends on the data (a vertical-slash
  plan is as wide as its fullest query block): the data-dependent shapes stay inside
  the op, and no unbacked symbolic size ever reaches the graph. The plan functions
  (`vertical_slash_plan`, ...) are not ops for that reason; build plans outside the
  compiled region, or use the method op.
* `<method>_static(...)`: the same op under `fast.capture.static_widths()`, for each
  method whose default op reads a plan width back from the device: the width is the
  parameter bound, no host synchronisation, so a CUDA graph can be captured around it.

`SYNC` says, per method, which host synchronisations the default op makes and
whether it (or its `_static` op) can be captured in a CUDA graph; ops with a host
synchronisation carry `torch.Tag.cudagraph_unsafe`, so inductor's
`mode="reduce-overhead"` does not put them in a graph. docs/serving.md has the table.

Method parameters map to op arguments by their annotations: `int` -> `SymInt`,
`float`, `bool`, `str` (a union with `str`, such as SampleAttention's `settings`,
passes only its `str` form, a path), each optionally `None`. A parameter of another
type needs an `Adapter` (MInference's `config` travels as its JSON text: in compiled
code pass `config.to_json()`, a constant, or `ops.call` encodes it outside the graph
at the cost of a graph break).

Adding a method: `register(MethodSpec(...))` in the registry gives it an op here at
import; add its line to `SYNC` (tests/test_compile.py fails until it has one).
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union, overload

import torch

from ..conformance.registry import METHODS
from ..reference._checks import HALF_DTYPES
from ..reference.minference import MInferenceConfig
from ..reference.plan import BlockColumnPlan
from .capture import static_widths
from .kernels import block_column_attention

NAMESPACE = "sparseprefill"


@dataclass(frozen=True)
class SyncStatus:
    """What one method's op reads back from the device, and whether it can be captured.

    Attributes:
        syncs: the host synchronisations of the default op, one line each; empty:
            none (the op is capture-safe as it is).
        static_bound: the width the `<method>_static` op uses instead of the read
            (None: no `_static` op; either none is needed or none exists).
        capture_safe: True when the `_static` op (or, without one, the default op)
            makes no host synchronisation and no host-to-device copy, so CUDA-graph
            capture works; False leaves the ops tagged `cudagraph_unsafe`.
        note: what stops capture, or what the static bound costs.
    """

    syncs: tuple[str, ...] = ()
    static_bound: str | None = None
    capture_safe: bool = True
    note: str = ""


# One line per registered method (tests/test_compile.py checks that every method has one).
SYNC: dict[str, SyncStatus] = {
    "dense": SyncStatus(),
    "streaming": SyncStatus(note="width from host arithmetic on the sizes"),
    "a_shape": SyncStatus(note="as streaming"),
    "block_sparse": SyncStatus(note="top-k width min(top_k, Qb) from the parameters"),
    "vertical_slash": SyncStatus(
        syncs=("counting pass: the widest block list of each head (block_count.amax().tolist())",),
        static_bound="min(Kb, slash_size * ((block_m - 1) // block_n + 2)) key blocks per query block",
        note="static plan: 4 * B * Hq * Qb * bound bytes (heads planned in groups above 1 GB)"),
    "anchor_attention": SyncStatus(
        syncs=("stripe identification: the longest stripe list (tile_count.sum(2).max().item())",
               "stripe pass: promoting whole stripe blocks to blocks (BlockColumnPlan.with_full_blocks: "
               "bool(promote.any()), mask_to_list width, new column width)"),
        static_bound="the last group's search region (about N keys per group); no block promotion",
        note="static stripe lists: 4 * B * Hq * G * N bytes (heads in groups above 256 MB); the stripes "
             "stay column gathers (the whole method on an H200 at 128K: 1185 ms so, 610 ms promoted)"),
    "sample_attention": SyncStatus(
        syncs=("merge index: the most kept column + slash blocks ((...).max().item())",),
        static_bound="Kb key blocks per query block (every block)",
        capture_safe=False,
        note="stage 1 copies its sampled-row tile table to the device (torch.tensor(tiles).to(q.device) "
             "in fast/kernels/sampled_scores.py), which capture refuses; the _static op still saves the "
             "width read. A table built on the device from the chunk bounds would make it capture-safe"),
    "minference": SyncStatus(
        syncs=("vertical-slash heads: as vertical_slash",),
        static_bound="vertical-slash heads: as vertical_slash_static",
        capture_safe=False,
        note="a layer mixing patterns merges its head plans with torch.tensor(list, device=...) "
             "(reference.minference.merge_head_plans): a host-to-device copy that capture refuses; "
             "a layer of one pattern is capture-safe through <pattern>_static"),
    "flexprefill_vs": SyncStatus(
        syncs=("line lists: the most kept verticals and slashes of a head (padded_lines, .max().item())",
               "counting pass: as vertical_slash"),
        static_bound="N lines per head, then min(Kb, N * ...) = Kb key blocks per query block",
        note="static lines are padded to N (the counting pass walks all N offsets per query block); "
             "columns stay shared when per-block lists exceed 512 MB"),
    "shareprefill": SyncStatus(
        syncs=("decision: the per-head walk of Alg. 3/4 on the host reads the [B, Hq] distances "
               "(reference choose_patterns, float(d_sparse[row, h]))",
               "plan: whether any head is vertical-slash (bool(is_vs.any()))",
               "plan: the shared and dense heads (nonzero().tolist(), int(pattern), int(cluster))",
               "pivots: int(decision.cluster[h]) per dense head",
               "attention: the dense (row, head) pairs (nonzero().tolist())",
               "vertical-slash heads: line lists and counting pass, as flexprefill_vs"),
        capture_safe=False,
        note="the pattern of each head is decided on the host from the data (and copied back with "
             "torch.tensor(..., device=...)); the dense heads' passes depend on it"),
    "xattention": SyncStatus(
        syncs=("tiles to plan: the most kept tiles of a row (reference.plan.mask_to_list, .max().item())",),
        static_bound="T = ceil(N / block) key blocks per query block"),
    "dpxa": SyncStatus(
        syncs=("tiles to plan: as xattention",),
        static_bound="as xattention"),
    "delta_kv": SyncStatus(
        syncs=("packing: the packed buffer's size (offsets[-1].item())",
               "packing: repeat_interleave of segment ids (output size read back)",
               "phase 2: the block-list width (count2.max().item())",
               "phase 1: whether any query block reads packed keys (bool(...any()))",
               "phase 1: the ragged launcher's offset range check (int(kv_offsets.min()), .max())"),
        capture_safe=False,
        note="the packed keys' count is data-dependent; a static variant would size the buffer "
             "for no compression (B * Hkv * N keys)"),
}


@dataclass(frozen=True)
class Adapter:
    """How a parameter of a non-scalar type travels through an op argument.

    Attributes:
        schema: the op argument's type (`str`, `SymInt`, ...).
        encode: Python value -> op value (run by `call` before the op).
        decode: op value -> Python value (run inside the op).
    """

    schema: str
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]


@functools.lru_cache(maxsize=64)
def _config_from_json(text: str) -> MInferenceConfig:
    return MInferenceConfig.from_json(text)


def _config_to_json(config: object) -> object:
    return config.to_json() if isinstance(config, MInferenceConfig) else config


ADAPTERS: dict[tuple[str, str], Adapter] = {
    ("minference", "config"): Adapter("str", _config_to_json, _config_from_json),
}

_SCALARS: dict[object, str] = {int: "SymInt", float: "float", bool: "bool", str: "str"}


def _schema_type(hint: object) -> tuple[str, bool] | None:
    """(op type, optional) of an annotation, or None when no op type carries it."""
    if hint is torch.Tensor:
        return "Tensor", False
    if hint in _SCALARS:
        return _SCALARS[hint], False
    origin = typing.get_origin(hint)
    if origin is Literal:
        kinds = {type(a) for a in typing.get_args(hint)}
        return (_SCALARS[kinds.pop()], False) if len(kinds) == 1 and next(iter(kinds)) in _SCALARS else None
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        optional = type(None) in args
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            inner = _schema_type(rest[0])
            return None if inner is None else (inner[0], optional)
        if str in rest:  # a union with `str` (a path, a name): only the `str` form passes
            return "str", optional
    return None


def _default_text(value: object) -> str:
    if value is None:
        return "None"
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"a non-finite default ({value}) has no op schema form")
    return repr(value)


@dataclass(frozen=True)
class _Param:
    name: str
    keyword_only: bool
    adapter: Adapter | None


def method_schema(name: str, fn: Callable[..., torch.Tensor]) -> tuple[str, tuple[_Param, ...]]:
    """The op schema of a method's output function `fn(q, k, v, ...)`, from its signature.

    Returns:
        (schema text `(Tensor q, ...) -> Tensor`, the parameters in order).

    Raises:
        TypeError: a parameter whose type no op argument carries and that has no
            `ADAPTERS` entry.
    """
    hints = typing.get_type_hints(fn)
    parts: list[str] = []
    params: list[_Param] = []
    star = False
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise TypeError(f"{name}: parameter {p.name!r} of kind {p.kind} has no op form")
        adapter = ADAPTERS.get((name, p.name))
        typed = (adapter.schema, False) if adapter is not None else _schema_type(hints.get(p.name))
        if typed is None:
            raise TypeError(f"{name}: parameter {p.name!r} ({hints.get(p.name)}) has no op type; "
                            "add an Adapter to sparseprefill.fast.ops.ADAPTERS")
        keyword_only = p.kind is p.KEYWORD_ONLY
        if keyword_only and not star:
            parts.append("*")
            star = True
        text = f"{typed[0]}{'?' if typed[1] else ''} {p.name}"
        if p.default is not p.empty:
            text += f"={_default_text(p.default)}"
        parts.append(text)
        params.append(_Param(p.name, keyword_only, adapter))
    return f"({', '.join(parts)}) -> Tensor", tuple(params)


def _fresh(out: torch.Tensor) -> torch.Tensor:
    # The fake output is a new contiguous tensor; so must the real one be.
    return out if out.is_contiguous() else out.contiguous()


def _fake_output(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The output of every op: a new contiguous `[B, Hq, N, D]` in q's dtype.

    Checks what the shapes alone decide (`check_qkv` refuses meta tensors, which a
    fake implementation must take); k, v may hold a cached prefix (`P + N` keys).
    """
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"q, k, v must be [B, Hq, N, D], [B, Hkv, P + N, D] twice; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in HALF_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype in float16/bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, hq, n, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or k.shape[2] < n or hq % k.shape[1] != 0:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)}")
    return q.new_empty(q.shape)


_OPS: dict[str, Any] = {}


def register_method_op(name: str, fn: Callable[..., torch.Tensor], status: SyncStatus | None = None) -> None:
    """Register `torch.ops.sparseprefill.<name>` (and `<name>_static` if `status` has a
    static bound) running `fn(q, k, v, **params) -> [B, Hq, N, D]`.

    Args:
        name: the op name (a registered method's name).
        fn: the method's fast output function.
        status: its `SyncStatus`; None: `SYNC[name]`, or an unknown status (tagged
            `cudagraph_unsafe`, no `_static` op) when it has no entry.

    Raises:
        ValueError: an op of this name is already registered.
        TypeError: a parameter without an op type (see `method_schema`).
    """
    if name in _OPS:
        raise ValueError(f"op {NAMESPACE}::{name} is already registered")
    if status is None:
        status = SYNC.get(name, SyncStatus(syncs=("unknown: no SYNC entry",), capture_safe=False))
    schema, params = method_schema(name, fn)

    def call_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        bound = dict(zip((p.name for p in params), args))
        bound.update(kwargs)
        for p in params:
            if p.adapter is not None and p.name in bound:
                bound[p.name] = p.adapter.decode(bound[p.name])
        return _fresh(fn(**bound))

    def static_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        with static_widths():
            return call_fn(*args, **kwargs)

    variants: list[tuple[str, Callable[..., torch.Tensor], bool]] = [(name, call_fn, not status.syncs)]
    if status.static_bound is not None:
        variants.append((f"{name}_static", static_fn, status.capture_safe))
    for op_name, impl, safe in variants:
        tags = () if safe else (torch.Tag.cudagraph_unsafe,)
        op = torch.library.custom_op(f"{NAMESPACE}::{op_name}", impl, mutates_args=(), schema=schema,
                                     tags=tags)
        op.register_fake(_fake_output)
        _OPS[op_name] = op


def _plan_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_count: torch.Tensor,
               block_index: torch.Tensor, column_count: torch.Tensor, column_index: torch.Tensor,
               seqlen: int, block_m: int, block_n: int, columns_disjoint: bool, column_group: int,
               query_offset: int, scale: float | None, validate: bool,
               return_lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    plan = BlockColumnPlan(seqlen=seqlen, block_m=block_m, block_n=block_n, block_count=block_count,
                           block_index=block_index, column_count=column_count, column_index=column_index,
                           columns_disjoint=columns_disjoint, column_group=column_group,
                           query_offset=query_offset)
    return block_column_attention(q, k, v, plan, scale=scale, return_lse=return_lse, validate_plan=validate)


_PLAN_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor block_count, Tensor block_index, Tensor column_count, "
                "Tensor column_index, SymInt seqlen, SymInt block_m, SymInt block_n, bool columns_disjoint=False, "
                "SymInt column_group=1, SymInt query_offset=0, *, float? scale=None, bool validate=True)")


@torch.library.custom_op(f"{NAMESPACE}::sparse_attention", mutates_args=(), schema=_PLAN_SCHEMA + " -> Tensor")
def _sparse_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_count: torch.Tensor,
                         block_index: torch.Tensor, column_count: torch.Tensor, column_index: torch.Tensor,
                         seqlen: int, block_m: int, block_n: int, columns_disjoint: bool = False,
                         column_group: int = 1, query_offset: int = 0, *, scale: float | None = None,
                         validate: bool = True) -> torch.Tensor:
    out, _ = _plan_impl(q, k, v, block_count, block_index, column_count, column_index, seqlen, block_m,
                        block_n, columns_disjoint, column_group, query_offset, scale, validate, False)
    return _fresh(out)


@torch.library.custom_op(f"{NAMESPACE}::sparse_attention_lse", mutates_args=(),
                         schema=_PLAN_SCHEMA + " -> (Tensor, Tensor)")
def _sparse_attention_lse_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_count: torch.Tensor,
                             block_index: torch.Tensor, column_count: torch.Tensor, column_index: torch.Tensor,
                             seqlen: int, block_m: int, block_n: int, columns_disjoint: bool = False,
                             column_group: int = 1, query_offset: int = 0, *, scale: float | None = None,
                             validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _plan_impl(q, k, v, block_count, block_index, column_count, column_index, seqlen, block_m,
                          block_n, columns_disjoint, column_group, query_offset, scale, validate, True)
    assert lse is not None
    return _fresh(out), _fresh(lse)


@_sparse_attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return _fake_output(q, k, v)


@_sparse_attention_lse_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
      **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    out = _fake_output(q, k, v)
    return out, q.new_empty(q.shape[:3], dtype=torch.float32)


@overload
def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockColumnPlan, *,
                     scale: float | None = None, return_lse: Literal[False] = False,
                     validate: bool | None = None) -> torch.Tensor: ...


@overload
def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockColumnPlan, *,
                     scale: float | None = None, return_lse: Literal[True],
                     validate: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    validate: bool | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`fast.sparse_attention` through the `sparseprefill::sparse_attention` op.

    Args:
        q: `[B, Hq, N, D]` float16/bfloat16; k, v: `[B, Hkv, P + N, D]` (P the plan's
            `query_offset`: a chunk after a cached prefix).
        plan: a `BlockColumnPlan` for `[B, Hq, N]`.
        scale: softmax scale, `1/sqrt(D)` if None.
        return_lse: also return the natural-log lse, float32 `[B, Hq, N]`.
        validate: check every plan invariant before the launch (reads the plan back:
            a host synchronisation). None: only for plans no estimator marked valid,
            so estimator plans stay capture-safe.

    Returns:
        out `[B, Hq, N, D]` in q's dtype (and the lse).

    Raises:
        TypeError, ValueError: bad inputs or plan, before any kernel launch.
    """
    if not isinstance(plan, BlockColumnPlan):
        raise TypeError(f"plan must be a BlockColumnPlan, got {type(plan).__name__}")
    check = not plan._checked if validate is None else bool(validate)
    args = (q, k, v, plan.block_count, plan.block_index, plan.column_count, plan.column_index,
            plan.seqlen, plan.block_m, plan.block_n, plan.columns_disjoint, plan.column_group,
            plan.query_offset)
    if return_lse:
        out, lse = torch.ops.sparseprefill.sparse_attention_lse(*args, scale=scale, validate=check)
        return out, lse
    result: torch.Tensor = torch.ops.sparseprefill.sparse_attention(*args, scale=scale, validate=check)
    return result


def method_op(name: str, *, static: bool = False) -> Any:
    """The op of a registered method: `torch.ops.sparseprefill.<name>` (or `<name>_static`).

    Raises:
        ValueError: no such op (an unknown method, or `static` for a method without
            a static bound: its default op already makes no width read, see `SYNC`).
    """
    op_name = f"{name}_static" if static else name
    if op_name not in _OPS:
        if static and name in _OPS:
            status = SYNC.get(name)
            why = "its default op reads no width" if status and not status.syncs else "no static bound exists"
            raise ValueError(f"{name} has no _static op: {why} (see sparseprefill.fast.ops.SYNC)")
        raise ValueError(f"no op {NAMESPACE}::{op_name}; registered: {', '.join(sorted(_OPS))}")
    return getattr(torch.ops.sparseprefill, op_name)


def capture_op(name: str) -> Any:
    """The op of method `name` that a CUDA graph can capture: `<name>_static` if it has
    one, else `<name>` itself.

    Raises:
        ValueError: the method cannot be captured (see `SYNC[name].note`).
    """
    status = SYNC.get(name)
    if status is None or not status.capture_safe:
        raise ValueError(f"{name} is not capture-safe: {status.note if status else 'no SYNC entry'}")
    return method_op(name, static=status.static_bound is not None)


def op_params(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """A method's keyword parameters as its op takes them (`ADAPTERS` encoded)."""
    out = dict(params)
    for (method, param), adapter in ADAPTERS.items():
        if method == name and param in out:
            out[param] = adapter.encode(out[param])
    return out


def call(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, static: bool = False,
         **params: Any) -> torch.Tensor:
    """Run method `name` through its op: `method_op(name, static=static)(q, k, v, **params)`.

    Raises:
        TypeError, ValueError: bad inputs or parameters (from the method).
    """
    result: torch.Tensor = method_op(name, static=static)(q, k, v, **op_params(name, params))
    return result


for _name, _spec in METHODS.items():
    register_method_op(_name, _spec.fast_run)

__all__ = [
    "ADAPTERS",
    "Adapter",
    "NAMESPACE",
    "SYNC",
    "SyncStatus",
    "call",
    "capture_op",
    "method_op",
    "method_schema",
    "op_params",
    "register_method_op",
    "sparse_attention",
]
