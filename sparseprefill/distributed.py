"""Sparse prefill past one GPU: head-parallel and context-parallel attention on torch.distributed.

Both modes use only `torch.distributed` collectives (NCCL on GPUs, gloo on CPUs),
never a transport of their own, and any method of the registry
(`sparseprefill.methods`) through its `run_fn` / `plan_fn` and
`call_params`.

Head-parallel (`head_parallel_attention`): each rank holds a slice of the query
heads with their KV heads, as a tensor-parallel attention layer does after its
column-parallel QKV projection, and runs the method's estimate, plan and kernel
for those heads alone. Plans never cross ranks; the output stays sharded by heads
or is all-gathered. GQA groups are kept whole: the KV heads are split when the
world size divides them, and replicated (each rank one KV head, as serving engines
do when there are fewer KV heads than ranks) when they divide the world size.

Context-parallel (`context_parallel_attention`): the sequence is cut into
`2 * world` chunks on `align`-token boundaries (`ZigZagLayout`); rank `r` holds the
chunks `r` and `2 * world - 1 - r`, so the causal work of every rank is the same.
Per rank:

1. estimate where the inputs live (`context_parallel_plan`): each method says what
   its estimate reads (`Method.distributed`); shape-only plans move nothing; vertical-slash
   and its FlexPrefill-style variant broadcast the last queries and reduce their
   line scores, SampleAttention broadcasts its sampled rows and reduces block
   scores, block-sparse all-gathers the pooled keys; any other plan-based method
   all-gathers q and k (`estimate="gather"`: correct for every method, and costlier
   than a dense ring);
2. the plan rows of the rank's query blocks are split into the keys it holds
   (`RankPlan.own`) and the keys held elsewhere (`RankPlan.remote`);
3. the rank tells every other rank which of its keys it needs (a bit per key and
   KV head, one `all_to_all_single`), and fetches exactly those K/V rows (a second
   `all_to_all_single`, started asynchronously);
4. while the fetch runs it computes its rows over its own keys; then over the
   fetched keys (`attend_rows`: one kernel call per chunk on the plan's
   `query_offset` rows); the two online-softmax states merge exactly with the lse
   (`AttentionState.merge`).

`Traffic` counts the bytes every collective moves (the payload a rank sends,
under the ring algorithms for all-reduce and all-gather); `ring_bytes` is what
ring attention would move (every K/V shard visits every other rank).
See docs/distributed.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .methods import DistributedEstimate, Method
from .methods import methods as registered_methods
from .reference._checks import check_positive_int
from .reference.attention import AttentionState
from .reference.minference import MInferenceConfig
from .reference.plan import BlockColumnPlan, cdiv

# The layout, collectives and estimate steps live in `sharding` (which descriptors import);
# they are re-exported here, the module users import for distributed attention.
from .sharding import (  # noqa: F401
    Comm,
    EstimateFn,
    Shard,
    Traffic,
    ZigZagLayout,
    _standin,
    block_ids,
    distributed_argtopk,
    distributed_last_q_scores,
    gather_rows,
    global_softmax,
    offset_bounds,
    reduce_scatter,
    ring_bytes,
)

IMPLS = ("reference", "fast")


# -- methods ----------------------------------------------------------------------


def method_spec(name: str) -> Method:
    """The registered method `name`.

    Raises:
        ValueError: no such method (the message lists the registered ones).
    """
    if not isinstance(name, str) or name not in registered_methods():
        raise ValueError(f"method must be one of {sorted(registered_methods())}, got {name!r}")
    return registered_methods()[name]


def _check_impl(impl: str) -> Any:
    from . import fast, reference

    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return fast if impl == "fast" else reference


def _slice_head_params(params: dict[str, Any], start: int, stop: int,
                       knobs: tuple[str, ...] = ()) -> dict[str, Any]:
    """Per-head parameters (MInference's per-head config, a per-head knob of `knobs`) cut
    to the heads `[start, stop)`."""
    out = dict(params)
    for key, value in params.items():
        if isinstance(value, MInferenceConfig):
            out[key] = MInferenceConfig(tuple(layer[start:stop] for layer in value.layers))
        elif key in knobs and isinstance(value, (list, tuple, torch.Tensor)):
            out[key] = value[start:stop]
    return out


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# -- head-parallel ----------------------------------------------------------------


def head_slices(q_heads: int, kv_heads: int, world: int, rank: int) -> tuple[slice, slice]:
    """The query heads and KV heads rank `rank` of `world` owns (GQA groups kept whole).

    KV heads are split when `world` divides `kv_heads`; when `kv_heads` divides
    `world` instead, every rank gets one KV head (replicated over `world / kv_heads`
    ranks) and an equal share of its query heads.

    Raises:
        ValueError: counts that cannot be split this way (the message says why).
    """
    hq = check_positive_int("q_heads", q_heads)
    hkv = check_positive_int("kv_heads", kv_heads)
    w = check_positive_int("world", world)
    if not isinstance(rank, int) or not 0 <= rank < w:
        raise ValueError(f"rank must lie in [0, {w}), got {rank!r}")
    if hq % hkv:
        raise ValueError(f"q_heads={hq} must be a multiple of kv_heads={hkv}")
    if hq % w:
        raise ValueError(f"head-parallel attention needs q_heads={hq} divisible by the world size {w}")
    per_q = hq // w
    if hkv % w == 0:
        per_kv = hkv // w
        return slice(rank * per_q, (rank + 1) * per_q), slice(rank * per_kv, (rank + 1) * per_kv)
    if w % hkv == 0:
        # Each KV head's group of G query heads is shared by W / Hkv ranks.
        kv = rank // (w // hkv)
        return slice(rank * per_q, (rank + 1) * per_q), slice(kv, kv + 1)
    raise ValueError(f"head-parallel attention needs kv_heads={hkv} divisible by the world size {w} "
                     f"(KV heads split) or dividing it (KV heads replicated)")


def shard_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, world: int,
                rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank `rank`'s heads of full `q: [B, Hq, N, D]`, `k, v: [B, Hkv, N, D]` (see `head_slices`)."""
    qs, ks = head_slices(int(q.shape[1]), int(k.shape[1]), world, rank)
    return q[:, qs], k[:, ks], v[:, ks]


def _head_call(spec: Method, params: Mapping[str, Any] | None, q: torch.Tensor,
               comm: Comm) -> dict[str, Any]:
    """`call_params` for the local heads as the global call would set them."""
    b, hq, n, d = q.shape
    standin = _standin(b, hq * comm.world, n, d, q)
    full = spec.call_params(dict(params or {}), standin)
    return _slice_head_params(full, comm.rank * hq, (comm.rank + 1) * hq, spec.knobs)


def head_parallel_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    method: str,
    params: Mapping[str, Any] | None = None,
    impl: str = "reference",
    group: dist.ProcessGroup | None = None,
) -> BlockColumnPlan:
    """The method's plan for this rank's heads (no communication).

    Args:
        q: `[B, Hq / W, N, D]` and k: `[B, Hkv_local, N, D]`, this rank's heads
            (`shard_heads`).
        method: a registered method with plans (`METHODS`).
        params: its keyword parameters, as for one process (`call_params` sees the
            global head count, so per-head configs pick this rank's heads).
        impl: "reference" or "fast".
        group: the process group (default: the world).

    Returns:
        The local heads' plan: the global plan's heads `[r Hq/W, (r+1) Hq/W)`.

    Raises:
        ValueError: unknown method or impl, or a method without plans.
    """
    spec = method_spec(method)
    _check_impl(impl)
    comm = Comm(group)
    return spec.plan_fn(impl)(q, k, **_head_call(spec, params, q, comm))


def head_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    method: str,
    params: Mapping[str, Any] | None = None,
    impl: str = "reference",
    scale: float | None = None,
    group: dist.ProcessGroup | None = None,
    gather_output: bool = True,
    traffic: Traffic | None = None,
) -> torch.Tensor:
    """Any registered method on this rank's heads; the output gathered or left sharded.

    Args:
        q: `[B, Hq / W, N, D]`; k, v: `[B, Hkv_local, N, D]`: this rank's heads, GQA
            groups whole (`shard_heads` cuts them from full tensors).
        method: a registered method (`METHODS`); Delta-KV included.
        params: its keyword parameters, as for one process.
        impl: "reference" or "fast".
        scale: softmax scale, `1/sqrt(D)` if None.
        group: the process group (default: the world).
        gather_output: all-gather the heads into `[B, Hq, N, D]` (every rank), or
            return this rank's `[B, Hq / W, N, D]` (what a tensor-parallel output
            projection takes).
        traffic: a `Traffic` to add the output gather's bytes to, or None.

    Returns:
        The attention output in q's dtype.

    Raises:
        ValueError: unknown method or impl; bad inputs as the method raises them.
    """
    spec = method_spec(method)
    _check_impl(impl)
    comm = Comm(group)
    call = _head_call(spec, params, q, comm)
    out: torch.Tensor = spec.run_fn(impl)(q, k, v, **call, scale=scale)
    if gather_output and comm.world > 1:
        parts = comm.all_gather(out, [out.shape[1]] * comm.world, 1, "output")
        out = torch.cat(parts, dim=1)
    if traffic is not None:
        traffic.output += comm.traffic.output
    return out


# -- context-parallel: the plan rows of a rank --------------------------------------


@dataclass(frozen=True)
class RankPlan:
    """One rank's share of a global plan, split by who holds the keys.

    All three plans have the global sizes (`seqlen = N`, every query block), with
    empty lists outside `ranges`; `own | remote == plan` on those rows.

    Attributes:
        plan: the global plan's rows of this rank's query blocks.
        own: the keys this rank holds.
        remote: the keys other ranks hold (fetched before the second pass).
        ranges: this rank's query blocks, `[i0, i1)` per non-empty chunk.
        estimate: how the plan was estimated ("shape", "native" or "gather").
    """

    plan: BlockColumnPlan
    own: BlockColumnPlan
    remote: BlockColumnPlan
    ranges: tuple[tuple[int, int], ...]
    estimate: str


def _shared_dims(tensors: Sequence[torch.Tensor]) -> tuple[bool, bool]:
    """Whether all tensors are stride-0 (or size 1) over the batch and over the heads."""
    def shared(dim: int) -> bool:
        return all(t.shape[dim] == 1 or t.stride(dim) == 0 for t in tensors)
    return shared(0), shared(1)


def _compact(count: torch.Tensor, index: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept entries of sorted lists, in order: (count int32, index int32 as narrow as needed)."""
    valid = torch.arange(index.shape[-1], device=index.device) < count.unsqueeze(-1)
    keep = keep & valid
    new_count = keep.sum(dim=-1)
    width = int(new_count.max().item()) if new_count.numel() else 0
    # A stable sort of the dropped flags moves the kept entries first, in order.
    order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices[..., :width]
    return new_count.to(torch.int32), torch.gather(index, -1, order).to(torch.int32)


def _rows_shared(index: torch.Tensor) -> bool:
    """One list read by every query block (stride 0 over them): prefixes of it per block."""
    return index.shape[2] == 1 or index.stride(2) == 0


def _restrict_lists(
    count: torch.Tensor,
    index: torch.Tensor,
    rows: torch.Tensor,
    keep_fn: Callable[[torch.Tensor], torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists of one kind kept on the query blocks `rows` (bool `[Qb]`) and by `keep_fn`.

    Args:
        count: int32 `[b, h, Qb]`; index: int `[b, h, Qb, W]`, one list per query
            block (a list shared by every block may be a stride-0 view).
        rows: bool `[Qb]`, the query blocks that keep their lists.
        keep_fn: bool function of the int64 entries, or None (keep all).

    Returns:
        (count int32 `[b, h, Qb]`, index int32 `[b, h, Qb, W']`); a shared list stays
        one shared list (its kept entries, each block counting those in its prefix).
    """
    b, h, qb = count.shape
    width = index.shape[3]
    if _rows_shared(index):
        row = index[:, :, :1].to(torch.int64)
        keep = torch.ones_like(row, dtype=torch.bool) if keep_fn is None else keep_fn(row)
        kept = torch.cumsum(keep.to(torch.int32), dim=-1).expand(b, h, qb, width)
        prefix = (count.to(torch.int64) - 1).clamp(min=0).unsqueeze(-1)
        new_count = torch.where(count > 0, kept.gather(-1, prefix).squeeze(-1), 0) if width else \
            torch.zeros_like(count)
        new_count = torch.where(rows, new_count, 0).to(torch.int32)
        full = torch.full((b, h, 1), width, dtype=torch.int32, device=index.device)
        _, shared = _compact(full, row, keep)
        return new_count, shared.expand(b, h, qb, shared.shape[-1])
    idx = index.to(torch.int64)
    keep = torch.ones_like(idx, dtype=torch.bool) if keep_fn is None else keep_fn(idx)
    new_count, new_index = _compact(torch.where(rows, count, 0), idx, keep)
    return new_count, new_index


def restrict_plan(
    plan: BlockColumnPlan,
    ranges: Sequence[tuple[int, int]],
    keep_key: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> BlockColumnPlan:
    """The plan's rows of the query blocks in `ranges`, other rows empty, optionally
    keeping only the keys `keep_key` accepts.

    Args:
        plan: a valid global plan.
        ranges: query block ranges `[i0, i1)`.
        keep_key: bool function of int64 key positions, or None (all). Blocks are
            kept where it accepts the block's first key, so it must be constant over
            every key block (as ownership is when the block size divides the layout's
            `align`).

    Returns:
        A plan of the global sizes with `column_group = 1`. Index tensors stay
        expanded views where the input's were (over batch and heads, and a list
        shared by every query block stays one list), so a dense or vertical-slash
        plan costs no more here than in one process.
    """
    plan = plan.ensure_valid()
    if plan.column_group != 1 and not _rows_shared(plan.column_index):
        plan = plan.ungrouped()
    b, h, qb = plan.block_count.shape
    fields = [plan.block_count, plan.block_index, plan.column_count, plan.column_index]
    shared_b, shared_h = _shared_dims(fields)
    bs, hs = (1 if shared_b else b), (1 if shared_h else h)
    device = plan.device
    rows = torch.zeros(qb, dtype=torch.bool, device=device)
    for i0, i1 in ranges:
        rows[i0:i1] = True
    bn = plan.block_n

    def keep_block(i: torch.Tensor) -> torch.Tensor:
        assert keep_key is not None
        return keep_key((i.clamp(0, plan.num_key_blocks - 1) * bn))

    def keep_column(c: torch.Tensor) -> torch.Tensor:
        assert keep_key is not None
        return keep_key(c.clamp(0, plan.seqlen - 1))

    block_count, block_index = _restrict_lists(plan.block_count[:bs, :hs], plan.block_index[:bs, :hs], rows,
                                               None if keep_key is None else keep_block)
    column_count, column_index = _restrict_lists(plan.column_count[:bs, :hs], plan.column_index[:bs, :hs],
                                                 rows, None if keep_key is None else keep_column)
    out = BlockColumnPlan(
        seqlen=plan.seqlen, block_m=plan.block_m, block_n=plan.block_n,
        block_count=block_count.expand(b, h, qb), block_index=block_index.expand(b, h, *block_index.shape[2:]),
        column_count=column_count.expand(b, h, qb),
        column_index=column_index.expand(b, h, *column_index.shape[2:]),
        columns_disjoint=plan.columns_disjoint,
    )
    # Sub-lists (or sub-prefixes) of a valid plan's sorted, causal lists: valid.
    return out.mark_valid()


def split_plan(plan: BlockColumnPlan, layout: ZigZagLayout, rank: int, *, estimate: str = "") -> RankPlan:
    """`rank`'s rows of a global plan, split into keys it holds and keys it must fetch.

    Raises:
        ValueError: the plan's block sizes do not divide `layout.align`, or its length
            is not the layout's.
    """
    if plan.seqlen != layout.seqlen or plan.query_offset != 0:
        raise ValueError(f"plan must cover the layout's whole prompt (seqlen={layout.seqlen}, query_offset 0), "
                         f"got seqlen={plan.seqlen}, query_offset={plan.query_offset}")
    layout.check_blocks(plan.block_m, plan.block_n)
    ranges = layout.query_block_ranges(rank, plan.block_m)
    owner = layout.owner(plan.device)

    def mine(keys: torch.Tensor) -> torch.Tensor:
        return owner[keys] == rank

    def theirs(keys: torch.Tensor) -> torch.Tensor:
        return owner[keys] != rank

    return RankPlan(
        plan=restrict_plan(plan, ranges),
        own=restrict_plan(plan, ranges, mine),
        remote=restrict_plan(plan, ranges, theirs),
        ranges=ranges,
        estimate=estimate,
    )


def needed_keys(remote: BlockColumnPlan, kv_heads: int) -> torch.Tensor:
    """bool `[B, Hkv, N]`: the keys a plan lists for any query head of each KV head.

    Whole key blocks count (the plan's remote blocks lie before the rows that list
    them, so all their keys are causal); positions past N are dropped.
    """
    b, hq, qb = remote.block_count.shape
    n, bn, kb = remote.seqlen, remote.block_n, remote.num_key_blocks
    fields = [remote.block_count, remote.block_index, remote.column_count, remote.column_index]
    shared_b, shared_h = _shared_dims(fields)
    bs, hs = (1 if shared_b else b), (1 if shared_h else hq)
    device = remote.device

    def marks(count: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
        count, index = count[:bs, :hs], index[:bs, :hs]
        if _rows_shared(index):
            # Prefixes of one list: their union is the longest prefix.
            count, index = count.amax(dim=2, keepdim=True), index[:, :, :1]
        valid = torch.arange(index.shape[-1], device=device) < count.unsqueeze(-1)
        idx = torch.where(valid, index.to(torch.int64), size).reshape(bs, hs, -1)
        out = torch.zeros(bs, hs, size + 1, dtype=torch.bool, device=device)
        return out.scatter_(2, idx, True)[..., :size]

    blocks = marks(remote.block_count, remote.block_index, kb)
    keys = blocks.repeat_interleave(bn, dim=2)[..., :n] | marks(remote.column_count, remote.column_index, n)
    if hs == 1:
        per_kv = keys.expand(bs, kv_heads, n)
    else:
        per_kv = keys.reshape(bs, kv_heads, hq // kv_heads, n).any(dim=2)
    return per_kv.expand(b, kv_heads, n)


def rank_fetch_bytes(rank_plan: RankPlan, layout: ZigZagLayout, rank: int, *, kv_heads: int, head_dim: int,
                     itemsize: int) -> dict[str, int]:
    """The bytes of rank `rank`'s fetch in `context_parallel_attention`: (index, kv).

    Computed from its plan alone (one process), by the rule the exchange follows: the
    rank sends every other rank a bit per (batch, KV head, token held there) and
    receives the K and V rows it asked for. Summed over ranks these are the measured
    `Traffic.index` and `Traffic.kv` (tests check it).
    """
    need = needed_keys(rank_plan.remote, kv_heads)
    b = need.shape[0]
    index = kv = 0
    for s in range(layout.world):
        if s != rank:
            index += b * kv_heads * cdiv(layout.local_length(s), 8)
            kv += int(need[..., layout.tokens(s, need.device)].sum()) * 2 * head_dim * itemsize
    return {"index": index, "kv": kv}


def fetch_bytes(rank_plans: Sequence[RankPlan], layout: ZigZagLayout, *, kv_heads: int, head_dim: int,
                itemsize: int) -> dict[str, int]:
    """`rank_fetch_bytes` summed over every rank (`rank_plans[r]` is rank `r`'s)."""
    parts = [rank_fetch_bytes(rp, layout, r, kv_heads=kv_heads, head_dim=head_dim, itemsize=itemsize)
             for r, rp in enumerate(rank_plans)]
    return {key: sum(p[key] for p in parts) for key in ("index", "kv")}


def _gather_estimate(spec_name: str) -> EstimateFn:
    def build(shard: Shard, params: dict[str, Any], impl: str, scale: float | None,
              comm: Comm) -> BlockColumnPlan:
        lengths = [shard.layout.local_length(r) for r in range(comm.world)]
        q = shard.layout.unshard(comm.all_gather(shard.q, lengths, 2, "estimate"))
        k = shard.layout.unshard(comm.all_gather(shard.k, lengths, 2, "estimate"))
        fn = method_spec(spec_name).plan_fn(impl)
        extra = {"scale": scale} if scale is not None and _accepts(fn, "scale") else {}
        plan: BlockColumnPlan = fn(q, k, **params, **extra)
        return plan
    return build


GATHER_NEEDS = ("all of q and k (all-gather): the estimate reads queries against keys across the "
                "whole sequence, so every rank rebuilds them and runs the one-process estimator")


def estimate_kind(method: str, estimate: str = "auto") -> str:
    """"shape", "native" or "gather": how `context_parallel_plan` estimates `method`."""
    if estimate not in ("auto", "gather"):
        raise ValueError(f"estimate must be 'auto' or 'gather', got {estimate!r}")
    native = method_spec(method).distributed
    if estimate == "gather" or native is None:
        return "gather"
    return native.kind


# -- context-parallel: plan, fetch, attention ----------------------------------------


def _check_cp_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, layout: ZigZagLayout,
                     comm: Comm) -> tuple[int, int, int, int]:
    if not isinstance(layout, ZigZagLayout):
        raise TypeError(f"layout must be a ZigZagLayout, got {type(layout).__name__}")
    if layout.world != comm.world:
        raise ValueError(f"layout.world={layout.world} does not match the process group's size {comm.world}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a rank-4 tensor [B, H, n_local, D]")
        want = layout.local_length(comm.rank)
        if t.shape[2] != want:
            raise ValueError(f"{name} must hold this rank's {want} tokens along dim 2 (ZigZagLayout.shard), "
                             f"got shape {tuple(t.shape)}")
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    if k.shape[0] != b or k.shape[3] != d or hkv == 0 or hq % hkv:
        raise ValueError(f"k must be [B={b}, Hkv, n_local, D={d}] with Hkv dividing Hq={hq}, got {tuple(k.shape)}")
    if v is not None and v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.dtype != q.dtype or (v is not None and v.dtype != q.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}"
                        + ("" if v is None else f", {v.dtype}"))
    return b, hq, hkv, d


def context_parallel_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    method: str,
    params: Mapping[str, Any] | None = None,
    layout: ZigZagLayout,
    impl: str = "reference",
    scale: float | None = None,
    estimate: str = "auto",
    group: dist.ProcessGroup | None = None,
    traffic: Traffic | None = None,
) -> RankPlan:
    """Estimate the method's plan with the sequence split over ranks; this rank's rows.

    Args:
        q: `[B, Hq, n_local, D]`, k: `[B, Hkv, n_local, D]`: this rank's tokens in
            local order (`layout.shard`).
        method: a registered method with plans.
        params: its keyword parameters, as for one process.
        layout: the split (its `world` must be the group's size).
        impl: "reference" or "fast" (which package builds the plan where it matters).
        scale: the estimate's softmax scale where the method has one (vertical-slash).
        estimate: "auto" (the method's `Method.distributed`, else gather) or "gather"
            (all-gather q and k and run the one-process estimator).
        group: the process group (default: the world).
        traffic: a `Traffic` to add the estimate's bytes to, or None.

    Returns:
        `RankPlan`: the global plan's rows of this rank's query blocks and their split.

    Raises:
        ValueError: unknown method or impl, a method without plans (Delta-KV), inputs
            that do not match the layout, or block sizes that do not divide
            `layout.align`.
    """
    spec = method_spec(method)
    if not spec.plan_based:
        raise ValueError(f"context-parallel attention needs a method with plans; {method!r} has none "
                         f"(run it head-parallel instead)")
    _check_impl(impl)
    kind = estimate_kind(method, estimate)
    comm = Comm(group)
    b, hq, hkv, d = _check_cp_inputs(q, k, None, layout, comm)
    shard = Shard(q=q, k=k, layout=layout, rank=comm.rank, batch=b, q_heads=hq, kv_heads=hkv, head_dim=d)
    call = spec.call_params(dict(params or {}), shard.standins()[0])
    native = spec.distributed
    build = _gather_estimate(method) if kind == "gather" or native is None else native.build
    plan = build(shard, call, impl, scale, comm)
    if traffic is not None:
        traffic.estimate += comm.traffic.estimate
    return split_plan(plan, layout, comm.rank, estimate=kind)


class KVFetch:
    """The K/V rows a rank's remote plan lists, asked for and received with two all-to-alls.

    Constructing it runs the first (a bit per key and KV head, blocking) and starts the
    second (the rows, asynchronous); `finish` waits and writes the rows into full-length
    buffers. Every rank of the group must construct its fetch at the same point.

    Args:
        k, v: `[B, Hkv, n_local, D]`, this rank's keys and values (local order).
        remote: this rank's `RankPlan.remote`.
        layout: the split.
        group: the process group (default: the world).
        traffic: a `Traffic` the bytes are added to, or None.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, remote: BlockColumnPlan, layout: ZigZagLayout,
                 group: dist.ProcessGroup | None = None, traffic: Traffic | None = None) -> None:
        comm = Comm(group)
        self.comm, self.layout, self.traffic = comm, layout, traffic
        device = k.device
        b, hkv, _, d = k.shape
        need = needed_keys(remote, hkv)
        # Own keys are never remote, so a rank asks nothing of itself.
        self.asks = [need[..., layout.tokens(s, device)] for s in range(comm.world)]
        # Step 1: one bit per (batch, KV head, token held by s), to every rank s.
        n_me = layout.local_length(comm.rank)
        packed = [_pack_bits(a) for a in self.asks]
        got, _ = comm.all_to_all(packed, [b * hkv * cdiv(n_me, 8)] * comm.world, "index")
        asked = [_unpack_bits(x.reshape(b, hkv, -1), n_me) for x in got]
        # Step 2: the K and V rows each rank asked for, as [count, 2, D] per rank.
        send = [torch.stack([k[a], v[a]], dim=1) for a in asked]
        self.recv_rows = [int(a.sum()) for a in self.asks]
        self.pieces, self.work = comm.all_to_all(send, [r * 2 * d for r in self.recv_rows], "kv",
                                                 async_op=True)
        if traffic is not None:
            traffic.index += comm.traffic.index
            traffic.kv += comm.traffic.kv

    def finish(self, k_buf: torch.Tensor, v_buf: torch.Tensor) -> None:
        """Wait for the rows and write them at their global positions.

        Args:
            k_buf, v_buf: `[B, Hkv, N, D]`, written at the fetched (batch, head, key)
                entries only.
        """
        if self.work is not None:
            self.work.wait()
        d = k_buf.shape[3]
        for s, (ask, piece) in enumerate(zip(self.asks, self.pieces)):
            if s == self.comm.rank or not self.recv_rows[s]:
                continue
            bi, hi, ti = ask.nonzero(as_tuple=True)
            rows = piece.reshape(-1, 2, d)
            pos = self.layout.tokens(s, k_buf.device)[ti]
            k_buf[bi, hi, pos] = rows[:, 0]
            v_buf[bi, hi, pos] = rows[:, 1]


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool `[..., n]` -> uint8 `[..., ceil(n / 8)]`, bit `j` of byte `i` = entry `8 i + j`."""
    n = mask.shape[-1]
    pad = cdiv(n, 8) * 8 - n
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).reshape(*mask.shape[:-1], -1, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (m * weights).sum(dim=-1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `_pack_bits`: bool `[..., n]`."""
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(-1) & weights) != 0
    return bits.reshape(*packed.shape[:-1], -1)[..., :n]


def attend_rows(
    impl: str,
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    plan: BlockColumnPlan,
    chunks: Sequence[tuple[int, int]],
    *,
    scale: float | None,
) -> AttentionState:
    """The online-softmax state of a rank's query rows over the keys `plan` lists.

    The one local-compute step of context-parallel attention: one kernel call per
    chunk `[P, P + n)` of rows, on the chunk's plan rows (`plan.rows(P, P + n)`,
    `query_offset = P`) and the keys `[0, P + n)`.

    Args:
        impl: "reference" or "fast".
        q: `[B, Hq, n_local, D]`, the local rows in local order (the chunks one after
            the other).
        k_buf, v_buf: `[B, Hkv, N, D]`, holding at least the keys the plan lists at
            their global positions.
        plan: a valid plan of the global sizes (`query_offset` 0).
        chunks: the global rows `[start, stop)` of the local rows, in local order; each
            start a multiple of `plan.block_m`, each stop one too or N.
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        The state of the local rows: float64 (reference) or float32 (fast), `[B, Hq, n_local]`.
    """
    mod = _check_impl(impl)
    b, hq, n_local, d = q.shape
    dtype = torch.float32 if impl == "fast" else torch.float64
    parts, offset = [], 0
    for start, stop in chunks:
        if stop <= start:
            continue
        rows = stop - start
        state = AttentionState.empty(b, hq, rows, d, device=q.device, dtype=dtype)
        mod.sparse_attention(q[:, :, offset:offset + rows], k_buf[:, :, :stop], v_buf[:, :, :stop],
                             plan.rows(start, stop), scale=scale, state=state)
        parts.append(state)
        offset += rows
    if offset != n_local:
        raise ValueError(f"chunks hold {offset} rows, q has {n_local}")
    if not parts:
        return AttentionState.empty(b, hq, 0, d, device=q.device, dtype=dtype)
    return AttentionState(m=torch.cat([p.m for p in parts], dim=2), l=torch.cat([p.l for p in parts], dim=2),
                          acc=torch.cat([p.acc for p in parts], dim=2))


@dataclass(frozen=True)
class ContextParallelOutput:
    """What `context_parallel_attention` returns.

    Attributes:
        out: `[B, Hq, n_local, D]` (local order) or, gathered, `[B, Hq, N, D]`.
        lse: float32, the same rows.
        plan: this rank's `RankPlan`.
        traffic: the bytes this rank sent (`Traffic.reduced` sums the ranks).
    """

    out: torch.Tensor
    lse: torch.Tensor
    plan: RankPlan
    traffic: Traffic


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    method: str,
    params: Mapping[str, Any] | None = None,
    layout: ZigZagLayout,
    impl: str = "reference",
    scale: float | None = None,
    estimate: str = "auto",
    group: dist.ProcessGroup | None = None,
    gather_output: bool = False,
) -> ContextParallelOutput:
    """Sparse attention with the sequence split over ranks (see the module doc).

    Args:
        q: `[B, Hq, n_local, D]`; k, v: `[B, Hkv, n_local, D]`: this rank's tokens in
            local order (`layout.shard`); fp16/bf16 for "fast".
        method, params, layout, impl, scale, estimate, group: as `context_parallel_plan`.
        gather_output: all-gather the rows into natural order `[B, Hq, N, D]` on every
            rank, or keep this rank's rows (local order).

    Returns:
        `ContextParallelOutput` (output, lse, the rank's plan, bytes sent).

    Raises:
        TypeError, ValueError: as `context_parallel_plan`, and v not matching k.
    """
    comm = Comm(group)
    _check_cp_inputs(q, k, v, layout, comm)
    traffic = Traffic()
    rp = context_parallel_plan(q, k, method=method, params=params, layout=layout, impl=impl, scale=scale,
                               estimate=estimate, group=group, traffic=traffic)
    b, hkv, _, d = k.shape
    tokens = layout.tokens(comm.rank, q.device)
    k_buf = k.new_zeros(b, hkv, layout.seqlen, d)
    v_buf = v.new_zeros(b, hkv, layout.seqlen, d)
    k_buf.index_copy_(2, tokens, k)
    v_buf.index_copy_(2, tokens, v)
    fetch = KVFetch(k, v, rp.remote, layout, group, traffic)
    # The rows over the keys held here while the fetch is under way...
    chunks = layout.rank_chunks(comm.rank)
    own = attend_rows(impl, q, k_buf, v_buf, rp.own, chunks, scale=scale)
    fetch.finish(k_buf, v_buf)
    # ...then over the fetched keys; the two states merge exactly (lse weights).
    state = own.merge(attend_rows(impl, q, k_buf, v_buf, rp.remote, chunks, scale=scale))
    out = state.output(q.dtype)
    lse = state.lse().to(torch.float32)
    if gather_output:
        lengths = [layout.local_length(r) for r in range(comm.world)]
        out = layout.unshard(comm.all_gather(out, lengths, 2, "output"))
        lse = layout.unshard(comm.all_gather(lse, lengths, 2, "output"))
    traffic.output += comm.traffic.output
    return ContextParallelOutput(out=out, lse=lse, plan=rp, traffic=traffic)


__all__ = [
    "GATHER_NEEDS",
    "ContextParallelOutput",
    "DistributedEstimate",
    "KVFetch",
    "RankPlan",
    "Traffic",
    "ZigZagLayout",
    "attend_rows",
    "context_parallel_attention",
    "context_parallel_plan",
    "distributed_last_q_scores",
    "estimate_kind",
    "fetch_bytes",
    "rank_fetch_bytes",
    "head_parallel_attention",
    "head_parallel_plan",
    "head_slices",
    "method_spec",
    "needed_keys",
    "restrict_plan",
    "ring_bytes",
    "shard_heads",
    "split_plan",
]
