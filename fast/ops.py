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
* `<method>(q, k, v, **params) -> out` for every registered method
  (`sparseprefill.methods`): estimate, plan and kernel in one op. Its output is
  `[B, Hq, N, D]` in q's dtype whatever the data, so the compiled graph has a fixed
  output shape even where the plan's width depends on the data (a vertical-slash
  plan is as wide as its fullest query block): the data-dependent shapes stay inside
  the op, and no unbacked symbolic size ever reaches the graph. The plan functions
  (`vertical_slash_plan`, ...) are not ops for that reason; build plans outside the
  compiled region, or use the method op.
* `<method>_static(...)`: the same op under `fast.capture.static_widths()`, for each
  method whose default op reads a plan width back from the device: the width is the
  parameter bound, no host synchronisation, so a CUDA graph can be captured around it.

Each method's descriptor (`Method.sync`, `sync_status(name)`) says which host
synchronisations the default op makes and whether it (or its `_static` op) can be
captured in a CUDA graph; ops with a host
synchronisation carry `torch.Tag.cudagraph_unsafe`, so inductor's
`mode="reduce-overhead"` does not put them in a graph. docs/serving.md has the table.

Per-head knobs (`Method.knobs`: a scalar, or one value per query head) keep their scalar
op argument (`float threshold=0.9`) and gain a keyword-only list argument
(`float[]? threshold_per_head=None`, `SymInt[]?` for an integer knob): when given (Hq
numbers), it replaces the scalar. A custom op takes no keyword-only tensor, so a per-head
value travels as numbers, a constant of the compiled graph; `ops.call` (and so `patch(...,
use_ops=True)`) moves a list, tuple or tensor given as the knob there (a tensor read back
once). Inside the op the list is copied to the device: not capture-safe.

Method parameters map to op arguments by their annotations: `int` -> `SymInt`,
`float`, `bool`, `str` (a union with `str`, such as SampleAttention's `settings`,
passes only its `str` form, a path), each optionally `None`. A parameter of another
type needs an `Adapter` in its descriptor (`Method.adapters`; MInference's `config`
travels as its JSON text: in compiled
code pass `config.to_json()`, a constant, or `ops.call` encodes it outside the graph
at the cost of a graph break).

Adding a method: its descriptor (`sparseprefill.methods.register(Method(...))`) gives
it an op here, at import or, for a method registered later, on first use; its
`sync` says what the op reads back (unknown, hence not capture-safe, until it does).
"""

from __future__ import annotations

import inspect
import json
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Union, overload

import torch

from ..reference._checks import HALF_DTYPES
from ..reference.plan import BlockColumnPlan
from ..methods import UNKNOWN_SYNC, Adapter, SyncStatus
from ..methods import methods as registered_methods
from .capture import static_widths
from .kernels import block_column_attention

NAMESPACE = "sparseprefill"


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


# The op argument that carries a per-head knob's `[Hq]` tensor beside its scalar.
PER_HEAD_SUFFIX = "_per_head"


def _knob_scalar(hint: object) -> str | None:
    """The op type of a per-head knob's scalar form (`PerHead` -> float, `PerHeadInt` -> SymInt);
    its per-head argument is a list of it."""
    if typing.get_origin(hint) in (Union, types.UnionType):
        for arg in typing.get_args(hint):
            if arg in (float, int):
                return _SCALARS[arg]
    return None


def method_schema(name: str, fn: Callable[..., torch.Tensor]) -> tuple[str, tuple[_Param, ...]]:
    """The op schema of a method's output function `fn(q, k, v, ...)`, from its signature.

    Returns:
        (schema text `(Tensor q, ...) -> Tensor`, the parameters in order).

    Raises:
        TypeError: a parameter whose type no op argument carries and that has no
            adapter in its descriptor (`Method.adapters`).
    """
    adapters = _adapters(name)
    knobs = _knobs(name)
    hints = typing.get_type_hints(fn)
    parts: list[str] = []
    params: list[_Param] = []
    star = False
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY):
            raise TypeError(f"{name}: parameter {p.name!r} of kind {p.kind} has no op form")
        adapter = adapters.get(p.name)
        knob = _knob_scalar(hints.get(p.name)) if p.name in knobs and adapter is None else None
        typed: tuple[str, bool] | None
        if adapter is not None:
            typed = (adapter.schema, False)
        elif knob is not None:
            typed = (knob, type(None) in typing.get_args(hints.get(p.name)))
        else:
            typed = _schema_type(hints.get(p.name))
        if typed is None:
            raise TypeError(f"{name}: parameter {p.name!r} ({hints.get(p.name)}) has no op type; "
                            "give the method's descriptor an Adapter for it (Method.adapters)")
        keyword_only = p.kind is p.KEYWORD_ONLY
        if keyword_only and not star:
            parts.append("*")
            star = True
        text = f"{typed[0]}{'?' if typed[1] else ''} {p.name}"
        if p.default is not p.empty:
            text += f"={_default_text(p.default)}"
        parts.append(text)
        params.append(_Param(p.name, keyword_only, adapter))
    extra = [n for n in knobs if _knob_scalar(hints.get(n)) is not None and n not in adapters]
    if extra and not star:
        parts.append("*")
    for knob_name in extra:
        parts.append(f"{_knob_scalar(hints.get(knob_name))}[]? {knob_name}{PER_HEAD_SUFFIX}=None")
        params.append(_Param(knob_name + PER_HEAD_SUFFIX, True, None))
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
        status: its `SyncStatus`; None: the registered method's `Method.sync`
            (`UNKNOWN_SYNC`, tagged `cudagraph_unsafe`, for a name not registered).

    Raises:
        ValueError: an op of this name is already registered.
        TypeError: a parameter without an op type (see `method_schema`).
    """
    if name in _OPS:
        raise ValueError(f"op {NAMESPACE}::{name} is already registered")
    if status is None:
        status = sync_status(name)
    schema, params = method_schema(name, fn)

    def call_fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        bound = dict(zip((p.name for p in params), args))
        bound.update(kwargs)
        for p in params:
            if p.adapter is not None and p.name in bound:
                bound[p.name] = p.adapter.decode(bound[p.name])
            if p.name.endswith(PER_HEAD_SUFFIX) and p.name in bound:
                per_head = bound.pop(p.name)
                if per_head is not None:
                    bound[p.name.removesuffix(PER_HEAD_SUFFIX)] = per_head
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
    # The op takes the four lists alone: a plan's dense heads travel as full causal lists.
    plan = plan.with_dense_lists()
    check = not plan._checked if validate is None else bool(validate)
    args = (q, k, v, plan.block_count, plan.block_index, plan.column_count, plan.column_index,
            plan.seqlen, plan.block_m, plan.block_n, plan.columns_disjoint, plan.column_group,
            plan.query_offset)
    if return_lse:
        out, lse = torch.ops.sparseprefill.sparse_attention_lse(*args, scale=scale, validate=check)
        return out, lse
    result: torch.Tensor = torch.ops.sparseprefill.sparse_attention(*args, scale=scale, validate=check)
    return result


def _adapters(name: str) -> Mapping[str, Adapter]:
    method = registered_methods().get(name)
    return {} if method is None else method.adapters


def _knobs(name: str) -> tuple[str, ...]:
    method = registered_methods().get(name)
    return () if method is None else method.knobs


def sync_status(name: str) -> SyncStatus:
    """What method `name`'s op reads back and whether it can be captured (`Method.sync`);
    `UNKNOWN_SYNC` for a name that is not registered."""
    method = registered_methods().get(name)
    return UNKNOWN_SYNC if method is None else method.sync


def register_methods() -> None:
    """Register the op of every registered method that has none yet (a method registered
    after this module was imported gets its op on first use)."""
    for name, method in registered_methods().items():
        if name not in _OPS:
            register_method_op(name, method.run_fn("fast"))


def method_op(name: str, *, static: bool = False) -> Any:
    """The op of a registered method: `torch.ops.sparseprefill.<name>` (or `<name>_static`).

    Raises:
        ValueError: no such op (an unknown method, or `static` for a method without
            a static bound: its default op already makes no width read, see `Method.sync`).
    """
    register_methods()
    op_name = f"{name}_static" if static else name
    if op_name not in _OPS:
        if static and name in _OPS:
            status = sync_status(name)
            why = "its default op reads no width" if not status.syncs else "no static bound exists"
            raise ValueError(f"{name} has no _static op: {why} (see its descriptor's Method.sync)")
        raise ValueError(f"no op {NAMESPACE}::{op_name}; registered: {', '.join(sorted(_OPS))}")
    return getattr(torch.ops.sparseprefill, op_name)


def capture_op(name: str) -> Any:
    """The op of method `name` that a CUDA graph can capture: `<name>_static` if it has
    one, else `<name>` itself.

    Raises:
        ValueError: the method cannot be captured (see its `Method.sync.note`).
    """
    status = sync_status(name)
    if not status.capture_safe:
        raise ValueError(f"{name} is not capture-safe: {status.note or status.syncs}")
    return method_op(name, static=status.static_bound is not None)


def op_params(name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """A method's keyword parameters as its op takes them (`Method.adapters` encoded; a
    per-head knob moved to its `<knob>_per_head` list argument, the scalar argument set
    to the first head's value: a knob without a default (Delta-KV's threshold,
    vertical-slash sizes) is a required op argument, and the list overrides it)."""
    out = dict(params)
    for param, adapter in _adapters(name).items():
        if param in out:
            out[param] = adapter.encode(out[param])
    for knob in _knobs(name):
        value = out.get(knob)
        if isinstance(value, (list, tuple, torch.Tensor)):
            values = value.tolist() if isinstance(value, torch.Tensor) else list(value)
            out[knob + PER_HEAD_SUFFIX] = values
            if values:
                out[knob] = values[0]
            else:
                del out[knob]
    return out


def call(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, static: bool = False,
         **params: Any) -> torch.Tensor:
    """Run method `name` through its op: `method_op(name, static=static)(q, k, v, **params)`.

    Raises:
        TypeError, ValueError: bad inputs or parameters (from the method).
    """
    result: torch.Tensor = method_op(name, static=static)(q, k, v, **op_params(name, params))
    return result


register_methods()

__all__ = [
    "Adapter",
    "NAMESPACE",
    "register_methods",
    "SyncStatus",
    "call",
    "capture_op",
    "method_op",
    "method_schema",
    "op_params",
    "register_method_op",
    "sparse_attention",
    "sync_status",
]
