"""The one sparse plan format: key blocks plus key columns per query block.

A `BlockColumnPlan` says, for every batch row `b`, query head `h` and query block
`i` (the rows `[i * block_m, (i + 1) * block_m)`), which keys those rows attend to:

* a list of key blocks, each the keys `[j * block_n, (j + 1) * block_n)`;
* a list of single key columns;

the union of the two, always intersected with causality (query row `r` never sees key `c > r`) and with
the sequence (`c < N`). This generalises MInference's vertical-slash index
(block_count / block_offset / column_count / column_index) to every method in
this project: A-shape and StreamingLLM, block-sparse top-k, vertical-slash,
SampleAttention, XAttention / DPXA tiles and AnchorAttention stripes all produce
it, and one kernel family in `fast` consumes it.

Invariants (checked by `validate`):

1. `block_count`, `column_count`: int32 `[B, Hq, Qb]` with `Qb = ceil(N / block_m)`;
   `block_index`: int32 `[B, Hq, Qb, max_blocks]`; `column_index`: int32
   `[B, Hq, Qb, max_columns]`; all on one device.
2. `0 <= block_count <= max_blocks` and `0 <= column_count <= max_columns`.
3. The first `block_count` entries of a block list are strictly increasing (so
   sorted and unique), in `[0, Kb)` with `Kb = ceil(N / block_n)`, and causal: the
   block's first key is not after the query block's last row.
4. The first `column_count` entries of a column list are strictly increasing, in
   `[0, N)` and causal in the same sense. A column MAY lie inside a listed key
   block of the same query block: it adds nothing to the kept set (the union), and
   the kernel skips it so no key is counted twice. This lets one column list be
   shared by every query block of a head (vertical-slash: the head's verticals,
   expanded over query blocks, `column_count` the causal prefix).
5. Entries past the counts are padding: their values mean nothing. Compare plans
   with `equal` (same blocks, and same columns once those inside listed blocks
   are removed), never with `torch.equal` on the raw index tensors.
6. Column lists may be shared by groups of `column_group` consecutive query blocks
   (default 1: one list per query block): `column_index` is then
   `[B, Hq, ceil(Qb / column_group), max_columns]` and query block `i` reads the
   first `column_count[..., i]` entries of row `i // column_group` (counts stay per
   query block, so each block takes its own causal prefix of the group's sorted
   list). AnchorAttention's stripes, found once per group of `step` query blocks,
   are stored this way: a group's list costs memory once, not `step` times.
7. `query_offset` P >= 0: the plan's rows are the queries at positions `[P, P + N)`
   (query block `i` is positions `[P + i * block_m, P + (i + 1) * block_m)`), its keys
   `[0, P + N)` (`Kb = ceil((P + N) / block_n)`), and causality compares a key with
   the row's position. P = 0 is a whole prompt; P > 0 is a chunk of a prompt whose
   first P positions are already in the KV cache (chunked prefill, prefix caching).
8. `dense_heads`: a sorted tuple of distinct query heads in `[0, Hq)` that attend every
   causal key (full causal attention, `[0, P + r]` for row `r`), whatever their lists
   say: their lists are kept but ignored by every consumer (`to_dense_mask`,
   `block_mask`, `column_mask`, `equal`, `density`, `recall`, both packages'
   `sparse_attention`). This is how a plan says "this head runs dense": the break-even
   rule (`reference.dense_fallback`) and a calibrated config's dense heads set it, and
   `fast.sparse_attention` sends those heads to the fastest dense attention. A consumer
   that reads the lists alone (the block/column launcher) must first call
   `with_dense_lists()`, which writes the marked heads' full causal lists.

Index tensors may be expanded views (stride 0 over batch, heads or query
blocks): a dense or streaming plan shared by every head costs O(N) memory, not
O(B * H * N^2 / (block_m * block_n)).

Hostile plans: `validate` rejects every invalid plan; the fast kernel also clamps
every count and index it loads into range, so a plan edited in place after
validation (or wrongly `mark_valid`-ed) gives wrong numbers, never an
out-of-bounds memory access.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch

from ._checks import check_block_size, check_positive_int

# Key positions are stored as int32: a plan's keys (`query_offset + seqlen`) stay below this.
MAX_KEYS = 2**31 - 1

_INDEX_FIELDS = ("block_count", "block_index", "column_count", "column_index")


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)




def _lead_base(t: torch.Tensor) -> torch.Tensor:
    """`t` with its batch and head axes cut to size 1 where they are expanded views (stride 0),
    so work on it broadcasts instead of materialising the copies."""
    index = tuple(slice(0, 1) if t.shape[d] > 1 and t.stride(d) == 0 else slice(None) for d in (0, 1))
    return t[index]


def _row_entries(rows: torch.Tensor, owner: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """`rows[b, h, owner[i], pos[b, h, i]]` as int64 `[B, H, Qb]`: one entry of each query
    block's column row, read without giving every query block its own copy of the row
    (`[B, H, Qb, W]` would be quadratic in tokens: 62.5 GiB for one AnchorAttention head at
    1M). `rows` may be a stride-0 expanded view."""
    b, h = pos.shape[0], pos.shape[1]
    bi = torch.arange(b, device=pos.device).view(b, 1, 1)
    hi = torch.arange(h, device=pos.device).view(1, h, 1)
    return rows[bi, hi, owner.view(1, 1, -1), pos].to(torch.int64)

@dataclass(frozen=True, eq=False)
class BlockColumnPlan:
    """Which key blocks and key columns every query block attends to (see module doc).

    Attributes:
        seqlen: N, the number of queries and keys.
        block_m: rows per query block.
        block_n: keys per key block.
        block_count: int32 `[B, Hq, Qb]`, listed key blocks per query block.
        block_index: int32 `[B, Hq, Qb, max_blocks]`, sorted key-block indices.
        column_count: int32 `[B, Hq, Qb]`, listed key columns per query block.
        column_index: int32 `[B, Hq, Qb, max_columns]`, sorted key indices.
        columns_disjoint: True promises that no listed column lies inside a listed key
            block of its query block (checked by `validate`); the kernel then skips its
            column-in-block test. False (the default) allows such columns.
        column_group: query blocks that share one column list (invariant 6); 1 (the
            default) gives every query block its own list.
        query_offset: P, the position of the plan's first query row (invariant 7):
            the plan covers queries `[P, P + seqlen)` against keys `[0, P + seqlen)`
            (chunked prefill over a cached prefix). 0 (the default): a whole prompt.
        dense_heads: query heads that run full causal attention whatever their lists
            say (invariant 8), sorted and distinct; () (the default): none.
    """

    seqlen: int
    block_m: int
    block_n: int
    block_count: torch.Tensor
    block_index: torch.Tensor
    column_count: torch.Tensor
    column_index: torch.Tensor
    columns_disjoint: bool = False
    column_group: int = 1
    query_offset: int = 0
    dense_heads: tuple[int, ...] = ()
    # Set once `validate` has passed (or by an estimator that builds valid plans by
    # construction), so launching the same plan again skips the O(plan) check.
    _checked: bool = field(default=False, repr=False, compare=False)

    # -- sizes ---------------------------------------------------------------

    @property
    def batch(self) -> int:
        return int(self.block_count.shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.block_count.shape[1])

    @property
    def num_query_blocks(self) -> int:
        return cdiv(self.seqlen, self.block_m)

    @property
    def key_len(self) -> int:
        """Keys the plan may list: `query_offset + seqlen`."""
        return self.query_offset + self.seqlen

    @property
    def num_key_blocks(self) -> int:
        return cdiv(self.key_len, self.block_n)

    def last_rows(self) -> torch.Tensor:
        """int64 `[Qb]`: the position of every query block's last row (its causal horizon)."""
        qb = self.num_query_blocks
        rows = (torch.arange(qb, device=self.device, dtype=torch.int64) + 1) * self.block_m - 1
        return rows.clamp(max=self.seqlen - 1) + self.query_offset

    @property
    def num_column_rows(self) -> int:
        """Rows of `column_index`: one per group of `column_group` query blocks."""
        return cdiv(self.num_query_blocks, self.column_group)

    @property
    def device(self) -> torch.device:
        return self.block_count.device

    def query_block_columns(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The column list of each query block in `[start, stop)`: `[B, Hq, stop - start, W]`.

        With `column_group == 1` this is a view of `column_index`; otherwise each
        group's row is gathered once per query block (a new tensor).
        """
        stop = self.num_query_blocks if stop is None else stop
        if self.column_group == 1:
            return self.column_index[:, :, start:stop]
        rows = torch.arange(start, stop, device=self.device) // self.column_group
        return self.column_index.index_select(2, rows)

    def ungrouped(self) -> BlockColumnPlan:
        """The same plan with one column list per query block (`column_group == 1`)."""
        if self.column_group == 1:
            return self
        plan = replace(self, column_index=self.query_block_columns(), column_group=1, _checked=False)
        return plan.mark_valid() if self._checked else plan

    def nbytes(self) -> int:
        """Bytes of index storage actually allocated (expanded views count once)."""
        total = 0
        for name in _INDEX_FIELDS:
            t: torch.Tensor = getattr(self, name)
            total += t.untyped_storage().nbytes()
        return total

    # -- checks --------------------------------------------------------------

    def validate(self) -> BlockColumnPlan:
        """Check every invariant of the module doc; return self.

        Raises:
            TypeError: an index tensor is not an int32 tensor.
            ValueError: a shape, range, order or causality invariant fails; the
                message names the field and the first offending entry.
        """
        n = check_positive_int("plan.seqlen", self.seqlen)
        bm = check_block_size("plan.block_m", self.block_m)
        bn = check_block_size("plan.block_n", self.block_n)
        check_positive_int("plan.query_offset", self.query_offset, minimum=0, maximum=MAX_KEYS - n)
        self.check_fields()
        self.check_dense_heads()
        qb = cdiv(n, bm)
        keys = self.key_len
        kb = cdiv(keys, bn)
        if self.block_count.dim() != 3 or self.block_count.shape[2] != qb:
            raise ValueError(
                f"plan.block_count must have shape [B, Hq, Qb={qb}] for N={n}, "
                f"block_m={bm}; got {tuple(self.block_count.shape)}"
            )
        lead = tuple(self.block_count.shape)
        group = check_positive_int("plan.column_group", self.column_group)
        rows = cdiv(qb, group)
        for name, want in (("block_index", lead), ("column_index", (*lead[:2], rows))):
            t = getattr(self, name)
            if t.dim() != 4 or tuple(t.shape[:3]) != want:
                raise ValueError(
                    f"plan.{name} must have shape [{want[0]}, {want[1]}, {want[2]}, width], "
                    f"got {tuple(t.shape)}"
                )
        if tuple(self.column_count.shape) != lead:
            raise ValueError(
                f"plan.column_count must have shape {lead}, got {tuple(self.column_count.shape)}"
            )
        # Last query row of every query block: the causal horizon of the block.
        last_row = self.last_rows().view(1, 1, qb, 1)

        blocks_valid = _check_list(
            "block", self.block_count, self.block_index, upper=kb,
        )
        starts = self.block_index.to(torch.int64) * bn
        bad = blocks_valid & (starts > last_row)
        _raise_first(bad, "plan.block_index lists a key block that starts after the last row "
                          "of its query block (not causal)")

        width = self.column_index.shape[3]
        if group == 1:
            cols_valid = _check_list("column", self.column_count, self.column_index, upper=keys)
            bad = cols_valid & (self.column_index.to(torch.int64) > last_row)
        else:
            # A group's list is checked once, over the longest prefix any of its query
            # blocks reads; causality per query block needs only its last read entry.
            bad = (self.column_count < 0) | (self.column_count > width)
            _raise_first(bad, f"plan.column_count must lie in [0, {width}] (the width of "
                              "plan.column_index)")
            owner = torch.arange(qb, device=self.device) // group
            group_count = torch.zeros(*lead[:2], rows, dtype=torch.int32, device=self.device)
            group_count.scatter_reduce_(2, owner.expand_as(self.column_count), self.column_count, "amax")
            _check_list("column", group_count, self.column_index, upper=keys)
            bad = torch.zeros_like(self.column_count, dtype=torch.bool).unsqueeze(-1)
            if width > 0:
                last = self.query_block_columns().gather(
                    3, (self.column_count.to(torch.int64) - 1).clamp(min=0).unsqueeze(-1))
                bad = (self.column_count.unsqueeze(-1) > 0) & (last.to(torch.int64) > last_row)
        _raise_first(bad, "plan.column_index lists a key column after the last row of its "
                          "query block (not causal)")
        if self.columns_disjoint and width > 0:
            step = max(1, (64 << 20) // max(1, lead[0] * lead[1] * width * 8))
            for s0 in range(0, qb, step):
                s1 = min(qb, s0 + step)
                cols = self.query_block_columns(s0, s1)
                valid = torch.arange(width, device=self.device) < self.column_count[:, :, s0:s1, None]
                inside = columns_inside_blocks(self.block_count[:, :, s0:s1],
                                               self.block_index[:, :, s0:s1], cols, block_n=bn)
                _raise_first(valid & inside, "plan.columns_disjoint is True but plan.column_index "
                                             f"lists a key column inside a listed key block (query "
                                             f"blocks from {s0})")
        object.__setattr__(self, "_checked", True)
        return self

    def check_fields(self) -> None:
        """Raise unless the four index fields are int32 tensors with values on one real
        device: the cheap part of `validate`, run before anything reads a field.

        Raises:
            TypeError: a field that is not an int32 tensor (a list, say).
            ValueError: fields on different devices, or meta tensors (no values to check).
        """
        for name in _INDEX_FIELDS:
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"plan.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.int32:
                raise TypeError(f"plan.{name} must have dtype int32, got {t.dtype}")
            if t.device.type == "meta":
                raise ValueError(f"plan.{name} is on meta (a meta tensor): a plan's lists need values "
                                 "(build it from real tensors)")
            if t.device != self.block_count.device:
                raise ValueError(
                    f"plan.{name} is on {t.device}, plan.block_count on {self.block_count.device}"
                )

    def check_dense_heads(self) -> None:
        """Raise unless `dense_heads` is a sorted tuple of distinct query heads in `[0, Hq)`.

        Raises:
            TypeError: not a tuple of ints.
            ValueError: a head outside `[0, Hq)`, or heads not strictly increasing.
        """
        heads = self.dense_heads
        if not isinstance(heads, tuple) or any(isinstance(h, bool) or not isinstance(h, int) for h in heads):
            raise TypeError(f"plan.dense_heads must be a tuple of query-head indices (int), got {heads!r}")
        hq = int(self.block_count.shape[1]) if self.block_count.dim() >= 2 else 0
        for i, h in enumerate(heads):
            if not 0 <= h < hq:
                raise ValueError(f"plan.dense_heads[{i}] = {h} is outside [0, Hq={hq})")
            if i and h <= heads[i - 1]:
                raise ValueError(f"plan.dense_heads must be strictly increasing (sorted, distinct), got {heads}")

    def dense_head_mask(self) -> torch.Tensor:
        """bool `[Hq]` on the plan's device: True for the heads of `dense_heads`."""
        mask = torch.zeros(self.num_heads, dtype=torch.bool, device=self.device)
        if self.dense_heads:
            mask[list(self.dense_heads)] = True
        return mask

    def ensure_valid(self) -> BlockColumnPlan:
        """`validate` unless this plan object already passed it; return self.

        Index tensors changed in place after a successful check are not re-checked:
        call `validate` again after such edits.
        """
        return self if self._checked else self.validate()

    def mark_valid(self) -> BlockColumnPlan:
        """Record that this plan is valid by construction (estimators only); return self."""
        object.__setattr__(self, "_checked", True)
        return self

    # -- conversions ---------------------------------------------------------

    def block_mask(self) -> torch.Tensor:
        """Return the listed key blocks as bool `[B, Hq, Qb, Kb]` (a head of `dense_heads`:
        every key block its query block's rows can see)."""
        self.ensure_valid()
        b, h, qb = self.block_count.shape
        out = torch.zeros(b, h, qb, self.num_key_blocks + 1, dtype=torch.bool, device=self.device)
        width = self.block_index.shape[3]
        valid = torch.arange(width, device=self.device) < self.block_count.unsqueeze(-1)
        idx = torch.where(valid, self.block_index.to(torch.int64), self.num_key_blocks)
        out.scatter_(3, idx, True)
        out = out[..., : self.num_key_blocks]
        if self.dense_heads:
            # A dense head keeps every key block up to its query block's last row.
            causal = torch.arange(self.num_key_blocks, device=self.device) * self.block_n \
                <= self.last_rows()[:, None]
            out = torch.where(self.dense_head_mask()[None, :, None, None], causal, out)
        return out

    def column_mask(self) -> torch.Tensor:
        """Return the listed key columns as bool `[B, Hq, Qb, P + N]` (none for a head of
        `dense_heads`: its blocks hold every causal key)."""
        self.ensure_valid()
        b, h, qb = self.column_count.shape
        keys = self.key_len
        out = torch.zeros(b, h, qb, keys + 1, dtype=torch.bool, device=self.device)
        width = self.column_index.shape[3]
        valid = torch.arange(width, device=self.device) < self.column_count.unsqueeze(-1)
        idx = torch.where(valid, self.query_block_columns().to(torch.int64), keys)
        out.scatter_(3, idx, True)
        out = out[..., :keys]
        if self.dense_heads:
            out = out & ~self.dense_head_mask()[None, :, None, None]
        return out

    def to_dense_mask(self) -> torch.Tensor:
        """Return the exact keys every query attends to, as bool `[B, Hq, N, P + N]`.

        Row `r` (position `P + r`), column `c` is True iff `c <= P + r` and `c` lies in
        a listed key block or is a listed column of the query block holding `r`, or the
        row's head is in `dense_heads`.
        """
        self.ensure_valid()
        n, bm, bn, keys = self.seqlen, self.block_m, self.block_n, self.key_len
        cols = self.block_mask().repeat_interleave(bn, dim=3)[..., :keys]
        cols = cols | self.column_mask()
        rows = cols.repeat_interleave(bm, dim=2)[:, :, :n]
        causal = torch.ones(n, keys, dtype=torch.bool, device=self.device).tril_(self.query_offset)
        return rows & causal

    def to(self, device: torch.device | str) -> BlockColumnPlan:
        """Return the same plan with its index tensors on `device`.

        Raises:
            TypeError: a field that is not a tensor. ValueError: a meta tensor (no values to move).
        """
        for name in _INDEX_FIELDS:
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"plan.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type == "meta":
                raise ValueError(f"plan.{name} is on meta (a meta tensor): a plan's lists need values "
                                 "(build it from real tensors)")
        return BlockColumnPlan(
            seqlen=self.seqlen,
            block_m=self.block_m,
            block_n=self.block_n,
            block_count=self.block_count.to(device),
            block_index=self.block_index.to(device),
            column_count=self.column_count.to(device),
            column_index=self.column_index.to(device),
            columns_disjoint=self.columns_disjoint,
            column_group=self.column_group,
            query_offset=self.query_offset,
            dense_heads=self.dense_heads,
        )

    def equal(self, other: BlockColumnPlan) -> bool:
        """True iff both plans keep the same keys through the same lists.

        Same sizes, the same `dense_heads`, the same block lists, and the same column
        lists once the columns inside a listed block are removed (they add nothing),
        padding ignored: a plan with disjoint columns equals its twin whose columns
        repeat keys of its blocks. The lists of a dense head are not compared.
        """
        if not isinstance(other, BlockColumnPlan):
            raise TypeError(f"other must be a BlockColumnPlan, got {type(other).__name__}")
        self.check_fields()
        other.check_fields()
        if (self.seqlen, self.block_m, self.block_n, self.query_offset, self.dense_heads) != \
                (other.seqlen, other.block_m, other.block_n, other.query_offset, other.dense_heads):
            return False
        if self.block_count.shape != other.block_count.shape:
            return False
        other = other.to(self.device)
        if self.dense_heads:
            # The lists of a dense head mean nothing: compare the other heads' lists only.
            return self.without_heads(self.dense_heads).equal(other.without_heads(other.dense_heads))
        if not torch.equal(self.block_count, other.block_count):
            return False
        if not _lists_equal(self.block_count, self.block_index, other.block_index):
            return False
        count_a, index_a = self.own_columns()
        count_b, index_b = other.own_columns()
        return torch.equal(count_a, count_b) and _lists_equal(count_a, index_a, index_b)

    def own_columns(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The listed columns outside every listed block of their query block.

        Returns:
            (count int32 `[B, Hq, Qb]`, index int32 `[B, Hq, Qb, max_columns]`), the
            kept columns first and in order, padding after the count.

        Raises:
            TypeError, ValueError: a plan that fails `validate` (checked once per plan).
        """
        self.ensure_valid()
        width = self.column_index.shape[3]
        columns = self.query_block_columns()
        keep = torch.arange(width, device=self.device) < self.column_count.unsqueeze(-1)
        keep = keep & ~columns_inside_blocks(self.block_count, self.block_index, columns,
                                             block_n=self.block_n)
        # A stable sort of the dropped flags moves the kept columns first, in order.
        order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
        index = torch.gather(columns, 3, order)
        return keep.sum(dim=-1).to(torch.int32), index

    def with_disjoint_columns(self) -> BlockColumnPlan:
        """The same attention with `own_columns` as column lists and `columns_disjoint`.

        Costs `[B, Hq, Qb, max_columns]` int32 even where the columns were shared or
        grouped (the result has `column_group == 1`), and saves the kernel its
        column-in-block test.

        Raises:
            TypeError, ValueError: a plan that fails `validate` (checked once per plan).
        """
        count, index = self.own_columns()
        plan = BlockColumnPlan(
            seqlen=self.seqlen, block_m=self.block_m, block_n=self.block_n,
            block_count=self.block_count, block_index=self.block_index,
            column_count=count, column_index=index, columns_disjoint=True,
            query_offset=self.query_offset, dense_heads=self.dense_heads,
        )
        return plan.mark_valid() if self._checked else plan

    def without_covered_columns(self, *, chunk_bytes: int = 64 << 20) -> BlockColumnPlan:
        """The same attention with the columns that listed blocks already cover resolved
        once per column row (a group of `column_group` query blocks, or one query block).

        A column entry of a row is dropped when every query block of the group that
        reads it (its position is below the block's count) lists the key block holding
        it, or when no query block reads it; each count keeps its kept entries. The
        result is `columns_disjoint` when no kept entry is covered for any query block
        that reads it (always so with `column_group == 1`: then this is
        `with_disjoint_columns`, keeping the layout). Where a group's query blocks
        differ (one lists the column's block, another reads the column), the column
        stays and so does the kernel's column-in-block test. The kept set of every
        row is unchanged (`to_dense_mask` is equal).

        Works `chunk_bytes` of temporaries at a time (about 24 bytes per column entry
        per query block); the result's `column_index` is `[B, Hq, rows, W']`, `W'` the
        longest kept row (one host sync). Expanded (stride-0) column rows become real
        rows.

        Returns:
            self where there are no columns or they are already disjoint, else the
            resolved plan (valid if self was checked).

        Raises:
            TypeError, ValueError: a plan that fails `validate` (checked once per plan).
        """
        self.ensure_valid()
        width = self.column_index.shape[3]
        if width == 0 or self.columns_disjoint or self.batch * self.num_heads == 0:
            return self
        b, h, qb, g = self.batch, self.num_heads, self.num_query_blocks, self.column_group
        rows, dev = self.num_column_rows, self.device
        step = max(1, chunk_bytes // max(1, b * h * g * width * 24))
        keep_parts: list[torch.Tensor] = []
        partial = torch.zeros((), dtype=torch.bool, device=dev)
        o_w = torch.arange(width, device=dev)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            q0, q1 = r0 * g, min(qb, r1 * g)
            cols = self.query_block_columns(q0, q1)
            reads = o_w < self.column_count[:, :, q0:q1, None]
            inside = columns_inside_blocks(self.block_count[:, :, q0:q1], self.block_index[:, :, q0:q1],
                                           cols, block_n=self.block_n)
            need = reads & ~inside
            short = (r1 - r0) * g - (q1 - q0)  # the last group may be short
            if short:
                need = torch.cat([need, need.new_zeros(b, h, short, width)], dim=2)
            keep_row = need.view(b, h, r1 - r0, g, width).any(dim=3)
            keep_parts.append(keep_row)
            kept_for = keep_row.repeat_interleave(g, dim=2)[:, :, : q1 - q0]
            partial = partial | (reads & inside & kept_for).any()
        keep = torch.cat(keep_parts, dim=2)
        owner = torch.arange(qb, device=dev) // g
        kept_before = torch.cumsum(keep.to(torch.int32), dim=3)
        counts = self.column_count.to(torch.int64)
        new_counts = torch.where(counts > 0, _row_entries(kept_before, owner, (counts - 1).clamp(min=0)), 0)
        order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
        new_width = int(keep.sum(dim=-1).max().item()) if keep.numel() else 0
        column_index = torch.gather(self.column_index.expand(b, h, rows, width), 3, order[..., :new_width])
        plan = BlockColumnPlan(
            seqlen=self.seqlen, block_m=self.block_m, block_n=self.block_n,
            block_count=self.block_count, block_index=self.block_index,
            column_count=new_counts.to(torch.int32), column_index=column_index.contiguous(),
            columns_disjoint=not bool(partial), column_group=g, query_offset=self.query_offset,
            dense_heads=self.dense_heads,
        )
        return plan.mark_valid() if self._checked else plan

    def rows(self, start: int, stop: int | None = None) -> BlockColumnPlan:
        """The plan of the query rows `[start, stop)` alone (a chunk of this plan).

        The result has `query_offset = self.query_offset + start` and the same lists
        for those rows, so running it on the chunk's queries (and the keys up to the
        chunk's end) gives exactly those rows of running this plan. `start` must be a
        multiple of `block_m` and `stop` one too, or the end; grouped column rows are
        shared views when `start` is a multiple of `block_m * column_group`, else
        gathered per query block.

        Raises:
            ValueError: a range that is empty, out of `[0, seqlen]`, or not on block rows.
        """
        n, bm = self.seqlen, self.block_m
        stop = n if stop is None else stop
        for name, value in (("start", start), ("stop", stop)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if not 0 <= start < stop <= n:
            raise ValueError(f"rows [start, stop) must satisfy 0 <= start < stop <= seqlen={n}, "
                             f"got [{start}, {stop})")
        if start % bm or (stop % bm and stop != n):
            raise ValueError(f"start and stop must be multiples of block_m={bm} (stop may be "
                             f"seqlen={n}), got [{start}, {stop})")
        i0, i1 = start // bm, cdiv(stop, bm)
        plan = self if i0 % self.column_group == 0 else self.ungrouped()
        g = plan.column_group
        out = BlockColumnPlan(
            seqlen=stop - start, block_m=bm, block_n=self.block_n,
            block_count=plan.block_count[:, :, i0:i1], block_index=plan.block_index[:, :, i0:i1],
            column_count=plan.column_count[:, :, i0:i1],
            column_index=plan.column_index[:, :, i0 // g:cdiv(i1, g)],
            columns_disjoint=self.columns_disjoint, column_group=g,
            query_offset=self.query_offset + start, dense_heads=self.dense_heads,
        )
        return out.mark_valid() if self._checked else out

    def with_full_blocks(self) -> BlockColumnPlan:
        """The same attention with every key block that a column list holds entirely
        listed as a block instead (the kernel reads a listed block as one contiguous
        tile at the dense rate; a column tile is a gather of single rows).

        Works on the shared column rows (`column_group`): a key block is promoted for a
        group when the group's row holds all of its keys (`min(block_n, N - j *
        block_n)` of them); each query block of the group whose own prefix reaches the
        block then lists it, and the block's columns leave the row. A block is left as
        columns when some query block's prefix ends inside it while a key it does not
        read is one it could see (then the promotion would add a key); a prefix that
        ends inside the block only where the rest is in the future (the causal prefix,
        as every estimator here builds) is promoted. So the kept set of every row is
        unchanged (`to_dense_mask` is equal), and so is `equal`-comparison of the
        attention, not of the lists. `columns_disjoint` is kept.

        One host sync (the new column width, as `mask_to_list`); builds a `[B, Hq, Qb,
        Kb]` bool mask of the block lists.

        Returns:
            A plan with `column_group` as before, lists re-packed; self if no block is
            held entirely by a column row.

        Raises:
            TypeError, ValueError: a plan that fails `validate` (checked once per plan).
        """
        self.ensure_valid()
        b, h, qb = self.batch, self.num_heads, self.num_query_blocks
        n, bn, g = self.key_len, self.block_n, self.column_group
        kb, rows, width = self.num_key_blocks, self.num_column_rows, self.column_index.shape[3]
        if width == 0 or b * h == 0:
            return self
        device = self.device
        counts = self.column_count.to(torch.int64)
        # Valid length of each shared row: the longest prefix any of its query blocks reads.
        owner = torch.arange(qb, device=device) // g
        row_len = torch.zeros(b, h, rows, dtype=torch.int64, device=device)
        row_len.scatter_reduce_(2, owner.expand(b, h, qb), counts, reduce="amax")
        cols = self.column_index.to(torch.int64)
        valid = torch.arange(width, device=device) < row_len.unsqueeze(-1)
        blk = torch.where(valid, cols // bn, kb)  # padding counts in a spare slot
        held = torch.zeros(b, h, rows, kb + 1, dtype=torch.int64, device=device)
        held.scatter_add_(3, blk, torch.ones_like(blk))
        held = held[..., :kb]
        size = (n - torch.arange(kb, device=device) * bn).clamp(max=bn)
        full = held == size  # [B, H, rows, Kb]
        # Position of each block's first key in its row (the entries before it).
        first = torch.cumsum(held, dim=3) - held
        # A prefix that ends inside a full block: veto the block unless every key of it
        # past the prefix is after the query block's last row.
        last_row = self.last_rows()
        nxt = _row_entries(self.column_index, owner, counts.clamp(max=width - 1))
        prev = _row_entries(self.column_index, owner, (counts - 1).clamp(min=0))
        inside = (counts > 0) & (counts < row_len.index_select(2, owner)) & (prev // bn == nxt // bn)
        veto_q = inside & (nxt <= last_row)
        vq = torch.zeros(b, h, qb, kb + 1, dtype=torch.bool, device=device)
        vq.scatter_(3, torch.where(veto_q, nxt // bn, kb).unsqueeze(-1), True)
        veto_rows = torch.zeros(b, h, rows, kb + 1, dtype=torch.int32, device=device)
        veto_rows.index_add_(2, owner, vq.to(torch.int32))
        promote = full & (veto_rows[..., :kb] == 0)
        if not bool(promote.any()):
            return self
        # Query block i lists a promoted block of its row when its prefix reaches it.
        reach = promote.index_select(2, owner) & (first.index_select(2, owner) < counts.unsqueeze(-1))
        blocks = torch.zeros(b, h, qb, kb + 1, dtype=torch.bool, device=device)
        bvalid = torch.arange(self.block_index.shape[3], device=device) < self.block_count.unsqueeze(-1)
        blocks.scatter_(3, torch.where(bvalid, self.block_index.to(torch.int64), kb), True)
        blocks = blocks[..., :kb] | reach
        block_count, block_index = mask_to_list(blocks)
        # Drop the promoted blocks' columns from each row; each count keeps its kept entries.
        keep = valid & ~torch.gather(torch.cat([promote, promote.new_zeros(b, h, rows, 1)], 3), 3, blk)
        kept_before = torch.cumsum(keep.to(torch.int64), dim=3)
        new_counts = torch.where(counts > 0, _row_entries(kept_before, owner, (counts - 1).clamp(min=0)), 0)
        order = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices
        new_width = int(keep.sum(dim=-1).max().item())
        column_index = torch.gather(self.column_index, 3, order[..., :new_width])
        plan = BlockColumnPlan(
            seqlen=self.seqlen, block_m=self.block_m, block_n=bn, block_count=block_count,
            block_index=block_index, column_count=new_counts.to(torch.int32),
            column_index=column_index.contiguous(), columns_disjoint=self.columns_disjoint,
            column_group=g, query_offset=self.query_offset, dense_heads=self.dense_heads,
        )
        return plan.mark_valid() if self._checked else plan

    def _head_list(self, heads: Iterable[int] | torch.Tensor) -> list[int]:
        """Checked query-head indices of `heads` (ints in `[0, Hq)`, or a bool `[Hq]` tensor)."""
        hq = self.num_heads
        if isinstance(heads, torch.Tensor):
            if heads.dtype != torch.bool or heads.shape != (hq,):
                raise TypeError(f"heads given as a tensor must be bool [Hq={hq}], got {heads.dtype} "
                                f"{tuple(heads.shape)}")
            return [int(h) for h in heads.nonzero().flatten().tolist()]
        chosen = []
        for h in heads:
            if isinstance(h, bool) or not isinstance(h, int):
                raise TypeError(f"heads must be query-head indices (int), got {h!r}")
            if not 0 <= h < hq:
                raise ValueError(f"heads: query head {h} is outside [0, {hq})")
            chosen.append(h)
        return chosen

    def with_dense_heads(self, heads: Iterable[int] | torch.Tensor) -> BlockColumnPlan:
        """The same plan with the given query heads marked dense (`dense_heads`, invariant 8).

        The per-head dense fallback (a calibrated config's `dense_heads`, the break-even
        rule): whatever method built the plan, the marked heads attend every causal key,
        every other head keeps its lists. The lists themselves are not touched (no
        copy, no widening): `fast.sparse_attention` runs the marked heads through the
        fastest dense attention and the others through the kernel; `with_dense_lists`
        writes the marked heads' full causal lists for a consumer of the lists alone.

        Args:
            heads: query-head indices (ints in `[0, Hq)`, repeats allowed), or a bool
                `[Hq]` tensor (read back: a host synchronisation); empty returns self.

        Returns:
            A plan of the same shape whose `dense_heads` is the union of its own and
            `heads`; validated if self was.

        Raises:
            TypeError: heads that are not ints / a bool tensor.
            ValueError: a head outside `[0, Hq)`.
        """
        chosen = set(self._head_list(heads)) - set(self.dense_heads)
        if not chosen:
            return self
        plan = replace(self, dense_heads=tuple(sorted(chosen | set(self.dense_heads))), _checked=False)
        return plan.mark_valid() if self._checked else plan

    def without_heads(self, heads: Iterable[int] | torch.Tensor) -> BlockColumnPlan:
        """The same plan with the given query heads attending no key: their block and column
        counts set to 0 and their `dense_heads` mark removed; the index tensors are shared.

        What `fast.sparse_attention` launches the kernel on while the dense heads run
        elsewhere (their programs leave at once).

        Raises:
            TypeError, ValueError: as `with_dense_heads`.
        """
        chosen = sorted(set(self._head_list(heads)))
        if not chosen:
            return self
        self.check_fields()
        sel = torch.zeros(self.num_heads, dtype=torch.bool, device=self.device)
        sel[chosen] = True
        drop = sel[None, :, None]
        plan = replace(self, block_count=torch.where(drop, 0, self.block_count).to(torch.int32),
                       column_count=torch.where(drop, 0, self.column_count).to(torch.int32),
                       dense_heads=tuple(h for h in self.dense_heads if h not in set(chosen)),
                       _checked=False)
        return plan.mark_valid() if self._checked else plan

    def with_dense_lists(self) -> BlockColumnPlan:
        """The same attention with `dense_heads` written into the lists: each marked head
        lists every key block up to its query block's last row and no column, and the
        result has no `dense_heads`. Every other head keeps its lists.

        For a consumer that reads the lists alone (the block/column launcher, an op that
        passes the four tensors). The block lists widen to `Kb` when a dense head needs
        it; expanded index views are copied (`[B, Hq, Qb, Kb]` int32).

        Returns:
            self when no head is marked, else the plan above; validated if self was.
        """
        if not self.dense_heads:
            return self
        self.check_fields()
        hq = self.num_heads
        sel = self.dense_head_mask()
        kb = self.num_key_blocks
        width = max(int(self.block_index.shape[3]), kb)
        causal = (self.last_rows() // self.block_n + 1).to(torch.int32)  # [Qb] key blocks each query block sees
        b, qb = self.batch, self.num_query_blocks
        index = torch.zeros(b, hq, qb, width, dtype=torch.int32, device=self.device)
        index[..., : self.block_index.shape[3]] = self.block_index
        full = torch.arange(width, dtype=torch.int32, device=self.device).expand(b, hq, qb, width)
        index = torch.where(sel[None, :, None, None], full, index)
        block_count = torch.where(sel[None, :, None], causal.expand(b, hq, qb), self.block_count).to(torch.int32)
        column_count = torch.where(sel[None, :, None], 0, self.column_count).to(torch.int32)
        plan = replace(self, block_count=block_count.contiguous(), block_index=index.contiguous(),
                       column_count=column_count.contiguous(), dense_heads=(), _checked=False)
        return plan.mark_valid() if self._checked else plan

    def refined(self, block_m: int, block_n: int) -> BlockColumnPlan:
        """The same attention expressed at finer blocks: query blocks of `block_m` rows and key
        blocks of `block_n` keys, each a divisor of the plan's own size.

        Query block `i` becomes its `fm = self.block_m // block_m` sub-blocks `i * fm + t`, which
        keep `i`'s lists; listed key block `j` becomes its `fn = self.block_n // block_n`
        sub-blocks `j * fn + t`. A key sub-block that starts after a query sub-block's last row
        is dropped from that sub-block's list (all of its keys are in that sub-block's future),
        and each query sub-block reads the causal prefix of its parent's column list (the list
        is sorted, so the prefix is a count). Column rows are shared, not copied: the result's
        `column_group` is `fm * self.column_group` over the same `column_index`. So every query
        row keeps exactly the keys it kept (`to_dense_mask` is equal, and so are `density` and
        `recall`), and plans of different block sizes become one plan at their finest common
        unit (`merge_heads`). `dense_heads`, `query_offset` and `columns_disjoint` are kept (a
        column outside every listed block stays outside every sub-block).

        The kernel runs a refined plan on `gcd(block_m, 128)`-row tiles: finer query blocks cost
        more programs, finer key blocks skip the empty half of a diagonal tile.

        Costs `[B, Hq, Qb', Wb * fn]` int32 for the block lists (`Qb' = ceil(N / block_m)`, `Wb`
        the plan's block width); batch and head axes that were expanded views (stride 0) stay so.
        No host synchronisation.

        Args:
            block_m: rows per query block of the result, dividing `self.block_m`.
            block_n: keys per key block of the result, dividing `self.block_n`.

        Returns:
            self when both sizes are the plan's, else the refined plan (validated if self was).

        Raises:
            TypeError, ValueError: a size that is not an int in `[1, MAX_BLOCK_SIZE]`, or one that
                does not divide the plan's (the message names it).
        """
        bm = check_block_size("block_m", block_m)
        bn = check_block_size("block_n", block_n)
        for name, new, old in (("block_m", bm, self.block_m), ("block_n", bn, self.block_n)):
            if old % new:
                raise ValueError(f"{name}={new} must divide the plan's {name}={old} (a plan is refined "
                                 "to finer blocks only)")
        if (bm, bn) == (self.block_m, self.block_n):
            return self
        self.check_fields()
        fm, fn = self.block_m // bm, self.block_n // bn
        dev = self.device
        qb = cdiv(self.seqlen, bm)
        parent = torch.arange(qb, device=dev) // fm
        last = ((torch.arange(qb, device=dev, dtype=torch.int64) + 1) * bm - 1).clamp(max=self.seqlen - 1) \
            + self.query_offset  # [Qb'] each sub-block's causal horizon
        b, h = self.batch, self.num_heads

        # Blocks: each entry j -> j * fn + t; the listed, causal entries form a prefix of the
        # expanded (sorted) list, so a count says which are kept.
        index = _lead_base(self.block_index).index_select(2, parent).to(torch.int64)
        wb = int(index.shape[3]) * fn
        index = (index.unsqueeze(-1) * fn + torch.arange(fn, device=dev)).reshape(*index.shape[:3], wb)
        listed = torch.arange(wb, device=dev) < (_lead_base(self.block_count).index_select(2, parent)
                                                 .to(torch.int64) * fn).unsqueeze(-1)
        causal = index * bn <= last.view(1, 1, qb, 1)
        block_count = (listed & causal).sum(dim=-1).to(torch.int32)
        block_index = index.to(torch.int32)

        # Columns: the same rows, each sub-block's count the causal prefix of its parent's.
        counts = _lead_base(self.column_count).index_select(2, parent).to(torch.int64)
        width = int(self.column_index.shape[3])
        group = self.column_group * fm
        if width:
            rows = _lead_base(self.column_index)
            shared = rows.shape[2] > 1 and rows.stride(2) == 0
            base = self.column_count.to(torch.int64)
            old_owner = torch.arange(self.num_query_blocks, device=dev) // self.column_group
            row_len = torch.zeros(*base.shape[:2], self.num_column_rows, dtype=torch.int64, device=dev)
            row_len.scatter_reduce_(2, old_owner.expand_as(base), base, reduce="amax")
            if shared:
                # One list read by every query block: its prefix is sorted up to the longest count.
                rows = rows[:, :, :1]
                row_len = row_len.amax(dim=2, keepdim=True)
                horizon = last.view(1, 1, 1, qb)
            else:
                pad = self.num_column_rows * group - qb
                horizon = torch.cat([last, last[-1:].expand(pad)]).view(1, 1, -1, group)
            valid = torch.arange(width, device=dev) < row_len.unsqueeze(-1)
            ordered = torch.where(valid, rows.to(torch.int64), torch.iinfo(torch.int64).max)
            lead = (max(int(ordered.shape[0]), int(horizon.shape[0])), max(int(ordered.shape[1]), int(horizon.shape[1])))
            seen = torch.searchsorted(ordered.expand(*lead, *ordered.shape[2:]).contiguous(),
                                      horizon.expand(*lead, *horizon.shape[2:]).contiguous(), right=True)
            seen = seen.reshape(*lead, -1)[..., :qb]
            counts = torch.minimum(counts, seen)
        plan = BlockColumnPlan(
            seqlen=self.seqlen, block_m=bm, block_n=bn,
            block_count=block_count.expand(b, h, qb), block_index=block_index.expand(b, h, qb, wb),
            column_count=counts.to(torch.int32).expand(b, h, qb), column_index=self.column_index,
            columns_disjoint=self.columns_disjoint, column_group=group, query_offset=self.query_offset,
            dense_heads=self.dense_heads,
        )
        return plan.mark_valid() if self._checked else plan

    @staticmethod
    def from_masks(
        block_mask: torch.Tensor,
        column_mask: torch.Tensor | None,
        *,
        seqlen: int,
        block_m: int,
        block_n: int,
        query_offset: int = 0,
    ) -> BlockColumnPlan:
        """Build a plan from dense selections; the reference estimators use this.

        Non-causal blocks and columns are dropped, and so are columns inside a selected
        block (they would add nothing), so any selection yields a valid plan with
        disjoint blocks and columns.

        Args:
            block_mask: bool `[B, Hq, Qb, Kb]`, key blocks to keep (`Kb` over `P + N` keys).
            column_mask: bool `[B, Hq, Qb, P + N]`, key columns to keep, or None.
            seqlen, block_m, block_n, query_offset: as the plan's attributes.

        Returns:
            The validated plan, lists as narrow as the fullest query block needs.
        """
        n = check_positive_int("seqlen", seqlen)
        bm = check_block_size("block_m", block_m)
        bn = check_block_size("block_n", block_n)
        p = check_positive_int("query_offset", query_offset, minimum=0, maximum=MAX_KEYS - n)
        keys = p + n
        qb, kb = cdiv(n, bm), cdiv(keys, bn)
        for name, mask in (("block_mask", block_mask), ("column_mask", column_mask)):
            if mask is None and name == "column_mask":
                continue
            if not isinstance(mask, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
            if mask.device.type == "meta":
                raise ValueError(f"{name} is a meta tensor: a plan is built from the mask's values")
        if column_mask is not None and column_mask.device != block_mask.device:
            raise ValueError(f"column_mask must be on block_mask's device ({block_mask.device}), "
                             f"got {column_mask.device}")
        if block_mask.dim() != 4 or tuple(block_mask.shape[2:]) != (qb, kb):
            raise ValueError(
                f"block_mask must have shape [B, Hq, {qb}, {kb}], got {tuple(block_mask.shape)}"
            )
        device = block_mask.device
        last_row = ((torch.arange(qb, device=device) + 1) * bm - 1).clamp(max=n - 1) + p
        causal_blocks = torch.arange(kb, device=device) * bn <= last_row[:, None]
        blocks = block_mask.bool() & causal_blocks
        if column_mask is None:
            columns = torch.zeros(*blocks.shape[:3], keys, dtype=torch.bool, device=device)
        else:
            if tuple(column_mask.shape) != (*blocks.shape[:3], keys):
                raise ValueError(
                    f"column_mask must have shape {(*blocks.shape[:3], keys)}, "
                    f"got {tuple(column_mask.shape)}"
                )
            columns = column_mask.bool()
        causal_cols = torch.arange(keys, device=device) <= last_row[:, None]
        in_block = blocks.repeat_interleave(bn, dim=3)[..., :keys]
        columns = columns & causal_cols & ~in_block
        block_count, block_index = mask_to_list(blocks)
        column_count, column_index = mask_to_list(columns)
        return BlockColumnPlan(
            seqlen=n,
            block_m=bm,
            block_n=bn,
            block_count=block_count,
            block_index=block_index,
            column_count=column_count,
            column_index=column_index,
            query_offset=p,
        ).validate()


def stack_plans(plans: Iterable[BlockColumnPlan]) -> BlockColumnPlan:
    """One plan whose batch rows are the given plans' rows, in order (a varlen batch).

    The plans may have different `seqlen`s (one sequence each, say); the result has
    the largest, and a shorter plan's query blocks past its end list nothing. Block
    sizes, heads, `column_group` and `query_offset` (0) must agree. `dense_heads` is
    kept where every plan has the same; otherwise each plan's marked heads are written
    into its lists first (`with_dense_lists`).

    Args:
        plans: a list, tuple or any other iterable of `BlockColumnPlan`s (a generator
            is read once).

    Raises:
        TypeError: `plans` is not an iterable of `BlockColumnPlan`s.
        ValueError: no plans, or plans that disagree.
    """
    if isinstance(plans, BlockColumnPlan) or not isinstance(plans, Iterable):
        raise TypeError(f"plans must be an iterable of BlockColumnPlan, got {type(plans).__name__}")
    plans = list(plans)
    if not plans:
        raise ValueError("plans must not be empty")
    first = plans[0]
    for i, p in enumerate(plans):
        if not isinstance(p, BlockColumnPlan):
            raise TypeError(f"plans[{i}] must be a BlockColumnPlan, got {type(p).__name__}")
        p.check_fields()
        if (p.block_m, p.block_n, p.column_group, p.num_heads, p.device) != \
                (first.block_m, first.block_n, first.column_group, first.num_heads, first.device):
            raise ValueError(f"plans[{i}] differs from plans[0] in block sizes, column_group, heads or device")
        if p.query_offset:
            raise ValueError(f"plans[{i}] has query_offset {p.query_offset}; stacked plans must have 0")
    marks = {p.dense_heads for p in plans}
    if len(marks) > 1:
        # One marker serves every batch row: rows whose dense heads differ get them as lists.
        plans = [p.with_dense_lists() for p in plans]
    dense_heads = plans[0].dense_heads
    n = max(p.seqlen for p in plans)
    qb = cdiv(n, first.block_m)
    rows = cdiv(qb, first.column_group)
    bw = max(p.block_index.shape[3] for p in plans)
    cw = max(p.column_index.shape[3] for p in plans)

    def pad(t: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
        out = torch.zeros(size, dtype=torch.int32, device=first.device)
        out[tuple(slice(0, s) for s in t.shape)] = t
        return out

    parts: dict[str, list[torch.Tensor]] = {name: [] for name in _INDEX_FIELDS}
    for p in plans:
        b, h = p.batch, p.num_heads
        parts["block_count"].append(pad(p.block_count, (b, h, qb)))
        parts["block_index"].append(pad(p.block_index, (b, h, qb, bw)))
        parts["column_count"].append(pad(p.column_count, (b, h, qb)))
        parts["column_index"].append(pad(p.column_index, (b, h, rows, cw)))
    plan = BlockColumnPlan(
        seqlen=n, block_m=first.block_m, block_n=first.block_n,
        block_count=torch.cat(parts["block_count"]), block_index=torch.cat(parts["block_index"]),
        column_count=torch.cat(parts["column_count"]), column_index=torch.cat(parts["column_index"]),
        columns_disjoint=all(p.columns_disjoint for p in plans), column_group=first.column_group,
        dense_heads=dense_heads,
    )
    return plan.mark_valid() if all(p._checked for p in plans) else plan


def merge_heads(parts: Sequence[tuple[BlockColumnPlan, Sequence[int]]], *, num_heads: int,
                dense_heads: Iterable[int] = ()) -> BlockColumnPlan:
    """One plan of `num_heads` query heads from plans of some of them, at their finest common unit.

    Part `(plan, heads)` gives its plan's head `i` to query head `heads[i]`: a method's estimate
    of a subset of a layer's heads (per-head method choice, `headwise`). The parts may differ in
    block sizes and column groups: every part is re-expressed at `block_m = gcd` of their
    `block_m`s and `block_n = gcd` of their `block_n`s (`BlockColumnPlan.refined`, exact), and
    their column lists ungrouped where the groups differ. A part's `dense_heads` move with its
    heads. Query heads that no part gives must be in `dense_heads`: they list nothing and are
    marked dense (full causal attention). The lists are written by head slices on the plans'
    device (no host read, no host-to-device copy); expanded views are materialised
    (`[B, num_heads, Qb, width]` int32 per list).

    Args:
        parts: `(plan, heads)` pairs; `len(heads) == plan.num_heads`, every target a query
            head in `[0, num_heads)`, no head given twice. The plans share `seqlen`,
            `query_offset`, batch size and device.
        num_heads: Hq of the result.
        dense_heads: query heads that run full causal attention (every head no part gives).

    Returns:
        The merged plan, `columns_disjoint` when every part with columns is, validated when
        every part was.

    Raises:
        TypeError: parts that are not `(BlockColumnPlan, heads)` pairs, heads that are not ints.
        ValueError: no part, plans that disagree, a head out of range, given twice, or given by
            no part and not dense.
    """
    hq = check_positive_int("num_heads", num_heads)
    if isinstance(parts, BlockColumnPlan) or not isinstance(parts, Sequence) or not parts:
        raise ValueError("parts must be a non-empty sequence of (plan, heads) pairs")
    plans: list[BlockColumnPlan] = []
    targets: list[list[int]] = []
    for i, part in enumerate(parts):
        if not isinstance(part, (tuple, list)) or len(part) != 2 or not isinstance(part[0], BlockColumnPlan):
            raise TypeError(f"parts[{i}] must be a (BlockColumnPlan, heads) pair, got {type(part).__name__}")
        plan, heads = part
        plan.check_fields()
        heads = list(heads)
        if any(isinstance(h, bool) or not isinstance(h, int) for h in heads):
            raise TypeError(f"parts[{i}] heads must be query-head indices (int), got {heads!r}")
        if len(heads) != plan.num_heads:
            raise ValueError(f"parts[{i}] names {len(heads)} heads for a plan of {plan.num_heads}")
        plans.append(plan)
        targets.append(heads)
    first = plans[0]
    for i, p in enumerate(plans):
        if (p.seqlen, p.query_offset, p.batch, p.device) != (first.seqlen, first.query_offset, first.batch,
                                                              first.device):
            raise ValueError(f"parts[{i}] differs from parts[0] in seqlen, query_offset, batch or device: "
                             f"{(p.seqlen, p.query_offset, p.batch, str(p.device))} against "
                             f"{(first.seqlen, first.query_offset, first.batch, str(first.device))}")
    dense = sorted(set(int(h) for h in dense_heads))
    owner: dict[int, int] = {}
    for i, heads in enumerate(targets):
        for h in heads:
            if not 0 <= h < hq:
                raise ValueError(f"parts[{i}] gives query head {h}, outside [0, {hq})")
            if h in owner:
                raise ValueError(f"query head {h} is given by parts[{owner[h]}] and parts[{i}]")
            owner[h] = i
    if any(not 0 <= h < hq for h in dense):
        raise ValueError(f"dense_heads {dense} must lie in [0, {hq})")
    missing = [h for h in range(hq) if h not in owner and h not in set(dense)]
    if missing:
        raise ValueError(f"query heads {missing} are given by no part and not in dense_heads")
    bm = math.gcd(*(p.block_m for p in plans))
    bn = math.gcd(*(p.block_n for p in plans))
    plans = [p.refined(bm, bn) for p in plans]
    if len({p.column_group for p in plans}) > 1:
        plans = [p.ungrouped() for p in plans]
    group = plans[0].column_group
    b, n, dev = first.batch, first.seqlen, first.device
    qb = cdiv(n, bm)
    rows = cdiv(qb, group)
    bw = max(int(p.block_index.shape[3]) for p in plans)
    cw = max(int(p.column_index.shape[3]) for p in plans)
    out = {
        "block_count": torch.zeros(b, hq, qb, dtype=torch.int32, device=dev),
        "block_index": torch.zeros(b, hq, qb, bw, dtype=torch.int32, device=dev),
        "column_count": torch.zeros(b, hq, qb, dtype=torch.int32, device=dev),
        "column_index": torch.zeros(b, hq, rows, cw, dtype=torch.int32, device=dev),
    }
    marks = set(dense)
    for plan, heads in zip(plans, targets):
        marks |= {heads[h] for h in plan.dense_heads}
        # Runs of consecutive targets are written as slices: no index tensor crosses to the device.
        start = 0
        while start < len(heads):
            stop = start + 1
            while stop < len(heads) and heads[stop] == heads[stop - 1] + 1:
                stop += 1
            h0, h1 = heads[start], heads[start] + stop - start
            for name in _INDEX_FIELDS:
                src = getattr(plan, name)[:, start:stop]
                dst = out[name][:, h0:h1]
                dst[..., : src.shape[-1]] = src
            start = stop
    merged = BlockColumnPlan(
        seqlen=n, block_m=bm, block_n=bn, block_count=out["block_count"], block_index=out["block_index"],
        column_count=out["column_count"], column_index=out["column_index"], columns_disjoint=all(p.columns_disjoint or p.column_index.shape[3] == 0 for p in plans),
        column_group=group, query_offset=first.query_offset, dense_heads=tuple(sorted(marks)),
    )
    return merged.mark_valid() if all(p._checked for p in plans) else merged


def columns_inside_blocks(
    block_count: torch.Tensor,
    block_index: torch.Tensor,
    column_index: torch.Tensor,
    *,
    block_n: int,
) -> torch.Tensor:
    """Which column entries lie inside a listed key block of their query block.

    Args:
        block_count: int32 `[B, H, S]` and block_index int32 `[B, H, S, Wb]`: block
            lists (sorted, as `validate` requires) of `S` query blocks.
        column_index: int `[B, H, S, Wc]`, column entries of the same query blocks.
        block_n: keys per key block.

    Returns:
        bool `[B, H, S, Wc]`; entries past the column counts are not masked out.
    """
    wb, wc = block_index.shape[3], column_index.shape[3]
    shape = (*column_index.shape[:3], wc)
    if wb == 0 or wc == 0:
        return torch.zeros(shape, dtype=torch.bool, device=column_index.device)
    valid = torch.arange(wb, device=block_index.device) < block_count.unsqueeze(-1)
    # Padding above every block index keeps each list sorted for searchsorted.
    listed = torch.where(valid, block_index.to(torch.int64), torch.iinfo(torch.int64).max)
    col_block = torch.div(column_index.to(torch.int64), block_n, rounding_mode="floor")
    col_block = col_block.expand(shape).contiguous()
    pos = torch.searchsorted(listed.contiguous(), col_block).clamp_(max=wb - 1)
    return torch.gather(listed, 3, pos) == col_block


def causal_pairs(r0: torch.Tensor, r1: torch.Tensor, k0: torch.Tensor, k1: torch.Tensor) -> torch.Tensor:
    """Number of (row, key) pairs with `r0 <= row < r1`, `k0 <= key < k1`, `key <= row`."""
    # Rows in [k0, k1) see a growing prefix of the keys; rows >= k1 see all k1 - k0.
    a = torch.maximum(r0, k0)
    b = torch.minimum(r1, k1)
    ramp_rows = torch.clamp(b - a, min=0)
    # sum_{row=a}^{b-1} (row + 1 - k0)
    ramp = ramp_rows * (a + 1 - k0) + ramp_rows * (ramp_rows - 1) // 2
    flat_rows = torch.clamp(r1 - torch.maximum(r0, k1), min=0)
    return ramp + flat_rows * (k1 - k0)


def rank_nan_last(scores: torch.Tensor) -> torch.Tensor:
    """A copy of `scores` whose NaNs rank below every other score (the lowest finite value).

    Sorting and `topk` put NaN first; an estimate made of NaN in q or k would then pick
    arbitrary lines ahead of the forced ones. Every estimator ranks through this.
    """
    return torch.nan_to_num(scores, nan=torch.finfo(scores.dtype).min, posinf=math.inf,
                            neginf=-math.inf)


# Elements `mask_to_list` sorts at once (2**26: ~0.6 GiB of sort indices and scratch).
MASK_LIST_ELEMENTS = 1 << 26


def mask_to_list(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn bool `[..., L]` into (count int32 `[...]`, sorted indices int32 `[..., width]`).

    The width is the largest count (one host sync); padding past a count is 0.
    """
    count = mask.sum(dim=-1)
    width = int(count.max().item()) if count.numel() else 0
    length = mask.shape[-1]
    flat = mask.reshape(math.prod(mask.shape[:-1]), length)
    flat_count = count.reshape(-1, 1)
    index = torch.zeros(flat.shape[0], width, dtype=torch.int32, device=mask.device)
    # Rows at a time: the sort's int64 indices (and its scratch) are 8+ bytes an element,
    # 18 GiB at once for XAttention's [B, Hq, T, T] tile mask at 1M tokens.
    rows = max(1, MASK_LIST_ELEMENTS // max(1, length))
    valid_cols = torch.arange(width, device=mask.device)
    for r0 in range(0, flat.shape[0], rows):
        r1 = min(r0 + rows, flat.shape[0])
        # A stable sort of the negated mask puts the selected positions first, in order.
        order = torch.sort((~flat[r0:r1]).to(torch.int8), dim=-1, stable=True).indices[:, :width]
        index[r0:r1] = torch.where(valid_cols < flat_count[r0:r1], order, 0)
    return count.to(torch.int32), index.reshape(*mask.shape[:-1], width)


def _check_list(kind: str, count: torch.Tensor, index: torch.Tensor, *, upper: int) -> torch.Tensor:
    """Check counts, range and strict order of one list; return the valid-entry mask."""
    width = index.shape[3]
    bad = (count < 0) | (count > width)
    _raise_first(bad, f"plan.{kind}_count must lie in [0, {width}] (the width of "
                      f"plan.{kind}_index)")
    valid = torch.arange(width, device=index.device) < count.unsqueeze(-1)
    bad = valid & ((index < 0) | (index >= upper))
    _raise_first(bad, f"plan.{kind}_index has an entry outside [0, {upper})")
    if width > 1:
        step_valid = valid[..., 1:]
        bad = step_valid & (index[..., 1:] <= index[..., :-1])
        _raise_first(bad, f"plan.{kind}_index is not strictly increasing (sorted, unique)")
    return valid


def _raise_first(bad: torch.Tensor, message: str) -> None:
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise ValueError(f"{message}; first at index {where}")


def _lists_equal(count: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    width = int(count.max().item()) if count.numel() else 0
    if width == 0:
        return True
    if a.shape[3] < width or b.shape[3] < width:
        return False
    valid = torch.arange(width, device=count.device) < count.unsqueeze(-1)
    return bool(torch.equal(torch.where(valid, a[..., :width], 0), torch.where(valid, b[..., :width], 0)))
