"""The context-parallel layout and the collective steps a distributed estimate takes.

`ZigZagLayout` splits N tokens over ranks (ring attention's zig-zag split); `Comm`
wraps the `torch.distributed` collectives and counts what each sends (`Traffic`);
`Shard` is one rank's q and k with the global sizes. The functions below it are
the steps a method's distributed estimate (`Method.distributed`, written in the
method's descriptor) is made of: gathering query rows, a softmax over every rank's
keys, MInference's line scores, a reduce-scatter and a distributed arg-top-k.

This module reads no method descriptor, so descriptors can import it;
`sparseprefill.distributed` (head- and context-parallel attention of any registered
method) builds on it and re-exports its names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .reference._checks import check_positive_int
from .reference.plan import BlockColumnPlan, cdiv, rank_nan_last

# Float64 logits of the distributed last-q estimate are made this many bytes at a time.
_ESTIMATE_CHUNK_BYTES = 256 * 2**20


# -- traffic ----------------------------------------------------------------------


@dataclass
class Traffic:
    """Bytes one rank sent (or, after `reduced`, all ranks together), by purpose.

    Attributes:
        estimate: collectives of the estimate (last queries, line scores, pooled
            keys, or the whole q and k for `estimate="gather"`).
        index: which K/V rows each rank asks of each other rank (one bit per key
            and KV head).
        kv: the fetched K and V rows.
        output: gathering the output (`gather_output=True`).
    """

    estimate: int = 0
    index: int = 0
    kv: int = 0
    output: int = 0

    @property
    def total(self) -> int:
        """All bytes counted."""
        return self.estimate + self.index + self.kv + self.output

    def as_dict(self) -> dict[str, int]:
        """The counts and their total, for JSON."""
        return {"estimate": self.estimate, "index": self.index, "kv": self.kv,
                "output": self.output, "total": self.total}

    def reduced(self, group: dist.ProcessGroup | None = None) -> Traffic:
        """The sum over the ranks of `group` (a collective: every rank must call it)."""
        device = _group_device(group)
        t = torch.tensor([self.estimate, self.index, self.kv, self.output], dtype=torch.int64,
                         device=device)
        dist.all_reduce(t, group=group)
        e, i, k, o = (int(x) for x in t.tolist())
        return Traffic(estimate=e, index=i, kv=k, output=o)


def _group_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device collectives of `group` take (NCCL: this rank's GPU; gloo: CPU)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Comm:
    """The collectives this module uses, each adding what it sends to a `Traffic` field."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call "
                               "torch.distributed.init_process_group first (torchrun sets it up)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.traffic = Traffic()

    def _count(self, kind: str, nbytes: int) -> None:
        setattr(self.traffic, kind, getattr(self.traffic, kind) + int(nbytes))

    def all_reduce(self, t: torch.Tensor, kind: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> None:
        """In place; a ring all-reduce sends `2 (W - 1) / W` of the tensor per rank."""
        if self.world > 1:
            dist.all_reduce(t, op=op, group=self.group)
            self._count(kind, 2 * (self.world - 1) * _nbytes(t) // self.world)

    def broadcast(self, t: torch.Tensor, src: int, kind: str) -> None:
        """In place from group rank `src`, counted as `W - 1` copies sent by `src`."""
        if self.world > 1:
            dist.broadcast(t, src=dist.get_global_rank(self.group, src) if self.group is not None
                           else src, group=self.group)
            if self.rank == src:
                self._count(kind, (self.world - 1) * _nbytes(t))

    def all_gather(self, t: torch.Tensor, lengths: Sequence[int], dim: int, kind: str) -> list[torch.Tensor]:
        """Every rank's `t`, whose size along `dim` is `lengths[rank]` (padded on the wire).

        Counted as `W - 1` copies of this rank's unpadded tensor.
        """
        if self.world == 1:
            return [t]
        width = max(lengths)
        pad = list(t.shape)
        pad[dim] = width - t.shape[dim]
        padded = torch.cat([t, t.new_zeros(pad)], dim=dim).contiguous() if pad[dim] else t.contiguous()
        out = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(out, padded, group=self.group)
        self._count(kind, (self.world - 1) * _nbytes(t))
        return [o.narrow(dim, 0, n) for o, n in zip(out, lengths)]

    def all_to_all(self, send: Sequence[torch.Tensor], recv_numel: Sequence[int], kind: str,
                   *, async_op: bool = False) -> tuple[list[torch.Tensor], Any]:
        """Send `send[s]` (flattened, one dtype) to rank `s`; receive `recv_numel[s]` from `s`.

        Returns the received pieces (valid once the returned work, if any, has waited)
        and the work handle (None when not `async_op` or with one rank). Counted: the
        bytes sent to other ranks.
        """
        dtype, device = send[0].dtype, send[0].device
        flat_in = torch.cat([s.reshape(-1) for s in send]) if send else torch.empty(0)
        recv = torch.empty(sum(recv_numel), dtype=dtype, device=device)
        work = None
        if self.world == 1:
            recv.copy_(flat_in)
        else:
            work = dist.all_to_all_single(recv, flat_in, output_split_sizes=list(recv_numel),
                                          input_split_sizes=[s.numel() for s in send],
                                          group=self.group, async_op=async_op)
            self._count(kind, sum(_nbytes(s) for i, s in enumerate(send) if i != self.rank))
        return list(torch.split(recv, list(recv_numel))), work


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# -- layout -------------------------------------------------------------------------


@dataclass(frozen=True)
class ZigZagLayout:
    """The context-parallel split of `N` tokens over `world` ranks.

    The sequence is cut into `2 * world` chunks whose boundaries are multiples of
    `align` (the last chunk ends at `N`), as equal as `align` allows; rank `r` holds
    chunks `r` and `2 * world - 1 - r`, in that order (its "local order"). Under
    causal attention chunk `c` costs about `2c + 1` units, so every rank's pair costs
    the same (ring attention's zig-zag split). Plans need `block_m` and `block_n`
    dividing `align`, so that every query block and key block lies on one rank.

    Attributes:
        seqlen: N.
        world: ranks.
        align: tokens per unit of the split (a multiple of the plan's block sizes).
    """

    seqlen: int
    world: int
    align: int = 128

    def __post_init__(self) -> None:
        check_positive_int("seqlen", self.seqlen)
        check_positive_int("world", self.world, maximum=1 << 16)
        check_positive_int("align", self.align, maximum=1 << 30)

    @property
    def chunks(self) -> tuple[tuple[int, int], ...]:
        """The `2 * world` chunks `[start, stop)` in sequence order (some may be empty)."""
        units = cdiv(self.seqlen, self.align)
        count = 2 * self.world
        bounds = [min(self.seqlen, (c * units // count) * self.align) for c in range(count + 1)]
        bounds[-1] = self.seqlen
        return tuple((bounds[c], bounds[c + 1]) for c in range(count))

    def rank_chunks(self, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The two chunks of `rank`, early one first."""
        self._check_rank(rank)
        chunks = self.chunks
        return chunks[rank], chunks[2 * self.world - 1 - rank]

    def local_length(self, rank: int) -> int:
        """Tokens held by `rank`."""
        return sum(e - s for s, e in self.rank_chunks(rank))

    def tokens(self, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 `[local_length(rank)]`: the global position of every local token."""
        return torch.cat([torch.arange(s, e, device=device) for s, e in self.rank_chunks(rank)])

    def owner(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """int64 `[N]`: the rank holding every token."""
        out = torch.empty(self.seqlen, dtype=torch.int64, device=device)
        for c, (s, e) in enumerate(self.chunks):
            out[s:e] = c if c < self.world else 2 * self.world - 1 - c
        return out

    def shard(self, x: torch.Tensor, rank: int, dim: int = 2) -> torch.Tensor:
        """The local part of `x` (natural order along `dim`, `N` long), in local order."""
        if x.shape[dim] != self.seqlen:
            raise ValueError(f"x must have N={self.seqlen} entries along dim {dim}, got {tuple(x.shape)}")
        return torch.cat([x.narrow(dim, s, e - s) for s, e in self.rank_chunks(rank)], dim=dim)

    def unshard(self, parts: Sequence[torch.Tensor], dim: int = 2) -> torch.Tensor:
        """Every rank's local part (rank order) back in natural order along `dim`."""
        if len(parts) != self.world:
            raise ValueError(f"expected {self.world} parts, got {len(parts)}")
        pieces: list[torch.Tensor | None] = [None] * (2 * self.world)
        for r, part in enumerate(parts):
            (s0, e0), (s1, e1) = self.rank_chunks(r)
            if part.shape[dim] != (e0 - s0) + (e1 - s1):
                raise ValueError(f"part {r} must have {self.local_length(r)} entries along dim {dim}, "
                                 f"got {tuple(part.shape)}")
            pieces[r] = part.narrow(dim, 0, e0 - s0)
            pieces[2 * self.world - 1 - r] = part.narrow(dim, e0 - s0, e1 - s1)
        return torch.cat([p for p in pieces if p is not None], dim=dim)

    def query_block_ranges(self, rank: int, block_m: int) -> tuple[tuple[int, int], ...]:
        """The query blocks `[i0, i1)` of `rank`'s non-empty chunks."""
        return tuple((s // block_m, cdiv(e, block_m)) for s, e in self.rank_chunks(rank) if e > s)

    def check_blocks(self, block_m: int, block_n: int) -> None:
        """Raise ValueError unless `block_m` and `block_n` divide `align`."""
        for name, size in (("block_m", block_m), ("block_n", block_n)):
            if self.align % size:
                raise ValueError(
                    f"context-parallel attention needs chunk boundaries on block boundaries: "
                    f"align={self.align} is not a multiple of the plan's {name}={size} "
                    f"(choose an align that all block sizes divide, e.g. {math.lcm(block_m, block_n)})")

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise ValueError(f"rank must lie in [0, {self.world}), got {rank}")


def ring_bytes(layout: ZigZagLayout, *, batch: int, kv_heads: int, head_dim: int, itemsize: int) -> int:
    """Bytes ring attention moves: every rank's K and V shard visits the `W - 1` others."""
    return (layout.world - 1) * 2 * batch * kv_heads * layout.seqlen * head_dim * itemsize


def _standin(batch: int, heads: int, seqlen: int, head_dim: int, like: torch.Tensor) -> torch.Tensor:
    """A zero tensor of the given shape costing one element (for shape-only calls)."""
    return torch.zeros((), dtype=like.dtype, device=like.device).expand(batch, heads, seqlen, head_dim)


# -- context-parallel: estimates ------------------------------------------------------


@dataclass
class Shard:
    """One rank's inputs and the global sizes."""

    q: torch.Tensor
    k: torch.Tensor
    layout: ZigZagLayout
    rank: int
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    tokens: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = self.layout.tokens(self.rank, self.q.device)

    def standins(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.layout.seqlen
        return (_standin(self.batch, self.q_heads, n, self.head_dim, self.q),
                _standin(self.batch, self.kv_heads, n, self.head_dim, self.k))


EstimateFn = Callable[[Shard, dict[str, Any], str, "float | None", Comm], BlockColumnPlan]


def gather_rows(shard: Shard, rows: torch.Tensor, comm: Comm) -> torch.Tensor:
    """The q rows `rows` (int64, ascending, global) on every rank: `[B, Hq, R, D]`.

    Broadcast from their holder when one rank holds them all, else an all-reduce of
    zero-padded copies (each row is non-zero on its one holder: the sum is exact).
    """
    layout = shard.layout
    owner = layout.owner()[rows.cpu()]
    out = torch.zeros(shard.batch, shard.q_heads, rows.numel(), shard.head_dim, dtype=shard.q.dtype,
                      device=shard.q.device)
    # Position of every global token in this rank's local order (-1: not held here).
    local = torch.full((layout.seqlen,), -1, dtype=torch.int64, device=shard.q.device)
    local[shard.tokens] = torch.arange(shard.tokens.numel(), device=shard.q.device)
    where = local[rows.to(shard.q.device)]
    mine = where >= 0
    if bool(mine.any()):
        out[:, :, mine] = shard.q[:, :, where[mine]]
    holders = torch.unique(owner).tolist()
    if len(holders) == 1:
        comm.broadcast(out, int(holders[0]), "estimate")
    else:
        comm.all_reduce(out, "estimate")
    return out


def global_softmax(shard: Shard, q_rows: torch.Tensor, row_ids: torch.Tensor, *, scale: float, comm: Comm,
                    consume: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """`softmax(Q_rows K^T)` over every rank's keys, handed to `consume` a local key chunk at a time.

    Every rank computes the float64 logits of the rows against its own keys; the
    row maxima (all-reduce max) and the row sums of `exp(logit - max)` (all-reduce
    sum) make the softmax global. `consume(a_hat [B, Hq, R, c], cols [c])` gets the
    probabilities of each chunk of local keys (`cols`: their global positions);
    non-causal entries are 0.
    """
    b, hq, rows, d = q_rows.shape
    hkv = shard.kv_heads
    g = hq // hkv
    device = q_rows.device
    qg = q_rows.to(torch.float64).reshape(b, hkv, g, rows, d)
    n_local = shard.k.shape[2]
    step = max(1, _ESTIMATE_CHUNK_BYTES // max(1, b * hq * rows * 8))

    def logits(c0: int, c1: int) -> tuple[torch.Tensor, torch.Tensor]:
        cols = shard.tokens[c0:c1]
        s = torch.matmul(qg, shard.k[:, :, c0:c1].to(torch.float64).unsqueeze(2).transpose(-1, -2)) * scale
        causal = cols[None, :] <= row_ids[:, None]
        return s.masked_fill(~causal, -math.inf), cols

    m = torch.full((b, hkv, g, rows), -math.inf, dtype=torch.float64, device=device)
    for c0 in range(0, n_local, step):
        m = torch.maximum(m, logits(c0, min(n_local, c0 + step))[0].amax(dim=-1))
    comm.all_reduce(m, "estimate", op=dist.ReduceOp.MAX)
    shift = torch.where(torch.isneginf(m), 0.0, m).unsqueeze(-1)
    total = torch.zeros(b, hkv, g, rows, dtype=torch.float64, device=device)
    for c0 in range(0, n_local, step):
        total += torch.exp(logits(c0, min(n_local, c0 + step))[0] - shift).sum(dim=-1)
    comm.all_reduce(total, "estimate")
    for c0 in range(0, n_local, step):
        s, cols = logits(c0, min(n_local, c0 + step))
        consume((torch.exp(s - shift) / total.unsqueeze(-1)).reshape(b, hq, rows, -1), cols)


def distributed_last_q_scores(shard: Shard, q_last: torch.Tensor, *, scale: float,
                              comm: Comm) -> tuple[torch.Tensor, torch.Tensor]:
    """MInference Alg. 2 lines 2-6 with the keys split over ranks, up to the local scores.

    `A_hat = softmax(Q_last K^T)` over all keys (`global_softmax`).

    Returns:
        (vertical float64 `[B, Hq, n_local]`: the mass of each local key column,
        complete; slash float64 `[B, Hq, N]`: this rank's part of every diagonal's
        mass, to be summed over ranks). Equal to the one-process scores up to the
        order of float64 additions.
    """
    b, hq, rows, _ = q_last.shape
    n = shard.layout.seqlen
    row_ids = torch.arange(n - rows, n, device=q_last.device)
    vertical = torch.zeros(b, hq, shard.k.shape[2], dtype=torch.float64, device=q_last.device)
    slash = torch.zeros(b, hq, n, dtype=torch.float64, device=q_last.device)
    start = 0

    def consume(a_hat: torch.Tensor, cols: torch.Tensor) -> None:
        nonlocal start
        # Alg. 2 line 4: sum_v, the mass of every (local) key column.
        vertical[..., start:start + cols.numel()] = a_hat.sum(dim=2)
        start += cols.numel()
        # Alg. 2 line 6: sum_s by offset row - col; non-causal entries are 0 (park on 0).
        offset = (row_ids[:, None] - cols[None, :]).clamp(min=0).expand(b, hq, rows, -1)
        slash.scatter_add_(2, offset.reshape(b, hq, -1), a_hat.reshape(b, hq, -1))

    global_softmax(shard, q_last, row_ids, scale=scale, comm=comm, consume=consume)
    return vertical, slash


def offset_bounds(n: int, world: int) -> list[int]:
    """Rank `s` completes the slash sums of the offsets `[bounds[s], bounds[s + 1])`."""
    return [s * n // world for s in range(world + 1)]


def reduce_scatter(partial: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Sum `partial: [B, H, N]` over ranks, keeping this rank's offsets (`offset_bounds`).

    An all-to-all of the slices and a sum in rank order: a reduce-scatter, which
    gloo lacks; `(W - 1) / W` of the vector leaves each rank.
    """
    b, h, n = partial.shape
    bounds = offset_bounds(n, comm.world)
    mine = bounds[comm.rank + 1] - bounds[comm.rank]
    send = [partial[..., bounds[s]:bounds[s + 1]].contiguous() for s in range(comm.world)]
    got, _ = comm.all_to_all(send, [b * h * mine] * comm.world, "estimate")
    total = torch.zeros(b, h, mine, dtype=partial.dtype, device=partial.device)
    for piece in got:
        total += piece.reshape(b, h, mine)
    return total


def distributed_argtopk(values: torch.Tensor, ids: torch.Tensor, lengths: Sequence[int], *,
                        count: int | torch.Tensor, forced: int, comm: Comm) -> torch.Tensor:
    """`reference.vertical_slash.argtopk` of scores partitioned over ranks.

    Args:
        values: `[B, H, m]` this rank's complete scores; ids: int64 `[m]`, ascending,
            their global indices; lengths: every rank's `m`.
        count, forced: as `argtopk` (a per-head count, int64 `[H]`, pads each head's
            list with `sum(lengths)`, the index past the last).

    Returns:
        int32 `[B, H, count]` sorted ascending, on every rank: each rank's best
        `count` (by score, then lower index) are all-gathered and ranked again, which
        picks exactly the one-process set (the global best `count` are among them).
    """
    ranked = rank_nan_last(values).clone()
    ranked[..., ids < forced] = math.inf
    per_head_count = count if isinstance(count, torch.Tensor) else None
    if per_head_count is not None:
        count = int(per_head_count.max()) if per_head_count.numel() else 0
    assert isinstance(count, int)
    take = [min(count, m) for m in lengths]
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :take[comm.rank]]
    cand_val = torch.gather(ranked, -1, order)
    cand_id = ids[order]
    all_val = torch.cat(comm.all_gather(cand_val, take, 2, "estimate"), dim=-1)
    all_id = torch.cat(comm.all_gather(cand_id.contiguous(), take, 2, "estimate"), dim=-1)
    # Index order first, so that the stable sort by score gives ties to the lower index.
    by_id = torch.sort(all_id, dim=-1).indices
    all_val, all_id = torch.gather(all_val, -1, by_id), torch.gather(all_id, -1, by_id)
    top = torch.sort(all_val, dim=-1, descending=True, stable=True).indices[..., :count]
    if per_head_count is not None:
        from .reference.vertical_slash import pad_to_counts

        return pad_to_counts(torch.gather(all_id, -1, top), per_head_count, sum(lengths))
    return torch.sort(torch.gather(all_id, -1, top), dim=-1).values.to(torch.int32)


def block_ids(layout: ZigZagLayout, rank: int, block: int, device: torch.device) -> torch.Tensor:
    """int64: the global indices of the `block`-sized blocks `rank` holds, in local order."""
    ids = [torch.arange(s // block, cdiv(e, block), device=device) for s, e in layout.rank_chunks(rank) if e > s]
    return torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64, device=device)
