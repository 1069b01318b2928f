"""Causal softmax attention, written for clarity and exactness (the specification).

Scores and softmax are computed in float64, a chunk of query rows at a time, so
memory stays O(chunk * N) and a 16K-token problem runs on a 24 GB CPU machine.
Grouped-query attention is handled by viewing the query heads of one KV head as a
group dimension; K and V are never copied per query head.

Two optional extras of `sparse_attention`, shared by every method and by the fast
kernel:

* `state`: an `AttentionState` (the online-softmax state `(m, l, acc)` of every
  query row) to start from; it is updated in place, so one call can resume where
  another stopped (AnchorAttention's stripes after its anchor pass, chunked
  prefill, splits of the keys merged exactly).
* `block_mean_out`: the mean scaled logit of every listed block (SharePrefill's
  block-averaged QK), -inf for blocks the plan does not list.

Non-finite inputs (the semantics `fast` follows too): a row's output is NaN iff it
keeps at least one key and reads a NaN or infinity (its query, or the key or value
of a key it keeps); its lse is NaN iff its query or a kept key's key is NaN or
infinite (values do not enter the lse), with one exception: a logit of exactly -inf
(an infinite query or key pointing away) weighs nothing, as a masked key does.
Keys a row does not keep never affect it. A row that keeps no key gets output 0 and
lse -inf.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, overload

import torch

from ._checks import QKVShape, check_chunk_qk, check_positive_int, check_qkv, check_tensor, resolve_scale
from .plan import BlockColumnPlan

# Dtypes of an `AttentionState` (fast: float32 only).
STATE_DTYPES = (torch.float32, torch.float64)
# Scores of one chunk are [B, Hq, chunk, N] float64: keep them near 256 MiB.
_CHUNK_BYTES = 256 * 2**20


def _chunk_rows(batch: int, heads: int, seqlen: int) -> int:
    per_row = batch * heads * seqlen * 8
    return max(1, min(seqlen, _CHUNK_BYTES // max(per_row, 1)))


def check_mask(mask: object, batch: int, heads: int, seqlen: int, device: torch.device) -> torch.Tensor:
    """Check a dense mask broadcastable to `[B, Hq, N, N]` and return it as bool.

    Raises:
        TypeError: not a bool tensor.
        ValueError: wrong rank, not broadcastable, or on another device.
    """
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must have dtype torch.bool, got {mask.dtype}")
    if mask.device != device:
        raise ValueError(f"mask must be on the device of q ({device}), got {mask.device}")
    if mask.dim() not in (2, 4):
        raise ValueError(f"mask must have shape [N, N] or [B, Hq, N, N], got {tuple(mask.shape)}")
    full = (batch, heads, seqlen, seqlen)
    shape = (1, 1, *mask.shape) if mask.dim() == 2 else tuple(mask.shape)
    for got, want in zip(shape, full):
        if got not in (1, want):
            raise ValueError(
                f"mask must broadcast to [B={batch}, Hq={heads}, N={seqlen}, N={seqlen}], "
                f"got {tuple(mask.shape)}"
            )
    if shape[2] != seqlen or shape[3] != seqlen:
        raise ValueError(f"mask must have N={seqlen} rows and columns, got {tuple(mask.shape)}")
    return mask.reshape(shape)


@dataclass(frozen=True, eq=False)
class AttentionState:
    """The online-softmax state of every query row over the keys attended so far.

    For query row `r` and the set `S` of keys it has attended, with scaled logits
    `s_j = scale * q_r . k_j`:

    * `m[r] = max_{j in S} s_j` (natural-log units; -inf if `S` is empty),
    * `l[r] = sum_{j in S} exp(s_j - m[r])` (0 if `S` is empty),
    * `acc[r] = sum_{j in S} exp(s_j - m[r]) v_j` (0 if `S` is empty).

    The output is `acc / l` and the lse `m + log l`. Two states over disjoint key
    sets merge exactly (`merge`). `sparse_attention(..., state=s)` starts from `s`
    and writes the state after its keys back into `s`'s tensors.

    Attributes:
        m, l: `[B, Hq, N]`; acc: `[B, Hq, N, D]`; one float dtype (float32 for `fast`,
            float32 or float64 for `reference`), one device.
    """

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741 (the paper's name)
    acc: torch.Tensor

    @staticmethod
    def empty(
        batch: int,
        heads: int,
        seqlen: int,
        head_dim: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> AttentionState:
        """The state of rows that have attended no key: m = -inf, l = 0, acc = 0.

        Raises:
            TypeError, ValueError: sizes that are not ints `>= 0` (0 rows is a valid,
                empty state: a rank of a context-parallel split that owns none), a dtype
                that is not float32 / float64, or a device that is not a device.
        """
        for name, value in (("batch", batch), ("heads", heads), ("seqlen", seqlen), ("head_dim", head_dim)):
            check_positive_int(name, value, minimum=0)
        if dtype not in STATE_DTYPES:
            raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype!r}")
        if not isinstance(device, (torch.device, str)):
            raise TypeError(f"device must be a torch.device or str, got {type(device).__name__}")
        return AttentionState(
            m=torch.full((batch, heads, seqlen), -math.inf, dtype=dtype, device=device),
            l=torch.zeros(batch, heads, seqlen, dtype=dtype, device=device),
            acc=torch.zeros(batch, heads, seqlen, head_dim, dtype=dtype, device=device),
        )

    @staticmethod
    def like(q: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> AttentionState:
        """`empty` with the batch, heads, length, head dim and device of `q: [B, Hq, N, D]`.

        Raises:
            TypeError, ValueError: q not a rank-4 tensor, or a bad dtype.
        """
        q = check_tensor("q", q, rank=4)
        b, h, n, d = q.shape
        return AttentionState.empty(b, h, n, d, device=q.device, dtype=dtype)

    def output(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`acc / l`, 0 where no key was attended; NaN stays NaN."""
        out = torch.where(self.l.unsqueeze(-1) == 0, 0.0, self.acc / self.l.unsqueeze(-1))
        return out if dtype is None else out.to(dtype)

    def lse(self) -> torch.Tensor:
        """`m + log l`, -inf where no key was attended; NaN stays NaN."""
        return torch.where(self.l == 0, -math.inf, self.m + torch.log(self.l))

    def merge(self, other: AttentionState) -> AttentionState:
        """The state over the union of two disjoint key sets (a new state).

        Raises:
            TypeError, ValueError: `other` is not an `AttentionState` of the same
                shapes, dtype and device as this one.
        """
        if not isinstance(other, AttentionState):
            raise TypeError(f"other must be an AttentionState, got {type(other).__name__}")
        acc = check_tensor("self.acc", self.acc, rank=4)
        bb, hh, nn, dd = acc.shape
        check_state(self, bb, hh, nn, dd, acc.device, name="self", in_place=False)
        check_state(other, bb, hh, nn, dd, acc.device, dtypes=(self.m.dtype,), name="other", in_place=False)
        m = torch.maximum(self.m, other.m)
        shift = torch.where(torch.isneginf(m), 0.0, m)
        a, b = torch.exp(self.m - shift), torch.exp(other.m - shift)
        return AttentionState(m=m, l=self.l * a + other.l * b,
                              acc=self.acc * a.unsqueeze(-1) + other.acc * b.unsqueeze(-1))

    def clone(self) -> AttentionState:
        """A copy with its own tensors."""
        return AttentionState(m=self.m.clone(), l=self.l.clone(), acc=self.acc.clone())


def check_state(
    state: object, batch: int, heads: int, seqlen: int, head_dim: int, device: torch.device,
    *, dtypes: tuple[torch.dtype, ...] = STATE_DTYPES, name: str = "state", in_place: bool = True,
) -> AttentionState:
    """Check an `AttentionState` for `q: [B, Hq, N, D]` and return it.

    Raises:
        TypeError: not an AttentionState, or tensors of a dtype outside `dtypes`.
        ValueError: wrong shapes, mixed dtypes, another device, or a field whose
            elements overlap in memory (an expanded, stride-0 view) when `in_place`
            (`sparse_attention` writes the state back, one value per row).
    """
    if not isinstance(state, AttentionState):
        raise TypeError(f"{name} must be an AttentionState or None, got {type(state).__name__}")
    want = {"m": (batch, heads, seqlen), "l": (batch, heads, seqlen),
            "acc": (batch, heads, seqlen, head_dim)}
    for field_name, shape in want.items():
        label = f"{name}.{field_name}"
        t = getattr(state, field_name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{label} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes or t.dtype != getattr(state.m, "dtype", None):
            names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise TypeError(f"{label} must have one dtype in ({names}) for all fields, got {t.dtype}")
        if tuple(t.shape) != shape:
            raise ValueError(f"{label} must have shape {list(shape)}, got {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{label} must be on the device of q ({device}), got {t.device}")
        if in_place:
            check_no_overlap(label, t)
    return state


def check_no_overlap(name: str, t: torch.Tensor) -> None:
    """Raise ValueError if `t` is written in place but some of its elements share memory
    (a stride-0 dimension of size > 1, as `expand` makes)."""
    if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
        raise ValueError(f"{name} must not be an expanded view (stride 0 over a dimension of size > 1, "
                         f"strides {tuple(t.stride())}): it is written in place, one element each; "
                         "pass a tensor with its own memory (.clone() or .contiguous())")


def check_block_mean_out(
    out: object, batch: int, heads: int, plan: BlockColumnPlan, device: torch.device
) -> torch.Tensor:
    """Check a caller-allocated float32 `[B, Hq, Qb, Kb]` block-mean buffer and return it.

    Raises:
        TypeError, ValueError: not a float32 tensor of that shape on q's device.
    """
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"block_mean_out must be a torch.Tensor or None, got {type(out).__name__}")
    shape = (batch, heads, plan.num_query_blocks, plan.num_key_blocks)
    if out.dtype != torch.float32:
        raise TypeError(f"block_mean_out must have dtype float32, got {out.dtype}")
    if tuple(out.shape) != shape:
        raise ValueError(f"block_mean_out must have shape [B, Hq, Qb, Kb] = {list(shape)}, "
                         f"got {tuple(out.shape)}")
    if out.device != device:
        raise ValueError(f"block_mean_out must be on the device of q ({device}), got {out.device}")
    check_no_overlap("block_mean_out", out)
    return out


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    return_lse: Literal[False] = False,
) -> torch.Tensor: ...


@overload
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    return_lse: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention with an optional dense mask.

    Args:
        q: `[B, Hq, N, D]`, float16/bfloat16/float32/float64.
        k, v: `[B, Hkv, P + N, D]`, the dtype and device of `q`; `Hq % Hkv == 0`.
            P = 0 (the usual case): q and k cover the same N positions. P > 0: q is a
            chunk of queries at positions `[P, P + N)` after a cached prefix, k and v
            hold all `P + N` keys (chunked prefill, as `dense` and `sparse_attention`
            with a plan's `query_offset`); row `r` sees keys `0 .. P + r`.
        mask: bool, `[N, N]` or broadcastable to `[B, Hq, N, N]`; True keeps a key.
            It is intersected with causality. None: plain causal attention. Only with
            P = 0.
        scale: softmax scale, `1/sqrt(D)` if None.
        return_lse: also return the natural-log sum of exp of the kept scaled logits.

    Returns:
        `out: [B, Hq, N, D]` in q's dtype and, if `return_lse`, `lse: [B, Hq, N]` float32.
        A row with no kept key gets output 0 and lse -inf, never NaN; NaN and
        infinities in the inputs propagate as the module doc says.

    Raises:
        TypeError, ValueError: bad inputs (see `_checks.check_qkv`, `check_mask`), or a
            mask with k longer than q.
    """
    shape = check_attention_inputs(q, k, v, mask)
    sm_scale = resolve_scale(scale, shape.head_dim)
    dense_mask = None if mask is None else check_mask(mask, shape.batch, shape.q_heads, shape.seqlen, q.device)
    state = AttentionState.like(q, dtype=torch.float64)
    _attend(q, k, v, dense_mask, state, sm_scale, shape.query_offset)
    result = state.output(q.dtype)
    if return_lse:
        return result, state.lse().to(torch.float32)
    return result


def check_attention_inputs(q: object, k: object, v: object, mask: object) -> QKVShape:
    """`attention`'s checks, shared by both packages: q against k, v of `P + N >= N`
    keys (P, the query offset, is `k.shape[2] - N`), and no mask when P > 0.

    Raises:
        TypeError, ValueError: as `check_qkv`; ValueError naming `mask` for a mask with P > 0.
    """
    offset = check_chunk_qk(q, k).query_offset
    shape = check_qkv(q, k, v, query_offset=offset)
    if mask is not None and offset:
        raise ValueError(f"mask must be None when k and v hold more keys ({offset + shape.seqlen}) than q "
                         f"has rows ({shape.seqlen}): a dense mask is [N, N], for q and k of one length")
    return shape


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    state: AttentionState,
    sm_scale: float,
    offset: int = 0,
) -> None:
    """Continue `state` with the causal keys `mask` keeps (all causal keys if None), in float64.

    Query row `r` is position `offset + r` (k holds `offset` more keys than q rows).

    The online-softmax update of every row, written as plainly as the math: with
    `m_new = max(m, max_j s_j)`, `l = l * exp(m - m_new) + sum_j exp(s_j - m_new)`,
    `acc = acc * exp(m - m_new) + sum_j exp(s_j - m_new) v_j` over the kept keys `j`.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    # View the query heads of one KV head as a group dimension: [B, Hkv, G, N, D].
    qg = q.reshape(b, hkv, g, n, d).to(torch.float64)
    kg = k.to(torch.float64).unsqueeze(2)
    v64 = v.to(torch.float64)
    # Non-finite values enter a row only through the keys it keeps: the products use
    # finite stand-ins and the rows that keep a non-finite value are set to NaN below.
    v_bad = ~torch.isfinite(v64).all(dim=-1).unsqueeze(2)  # [B, Hkv, 1, N]
    vg = torch.where(torch.isfinite(v64), v64, 0.0).unsqueeze(2)
    any_v_bad = bool(v_bad.any())
    m_all = state.m.view(b, hkv, g, n)
    l_all = state.l.view(b, hkv, g, n)
    acc_all = state.acc.view(b, hkv, g, n, d)
    chunk = _chunk_rows(b, hq, n)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        # Queries in [start, stop) (positions offset + r) see keys in [0, offset + stop).
        end = offset + stop
        rows = torch.arange(start, stop, device=q.device) + offset
        keys = torch.arange(end, device=q.device)
        keep = (keys[None, :] <= rows[:, None]).expand(b, hkv, g, stop - start, end)
        if mask is not None:
            keep = keep & _group_mask(mask[:, :, start:stop, :end], hkv, g)
        scores = torch.matmul(qg[:, :, :, start:stop], kg[:, :, :, :end].transpose(-1, -2)) * sm_scale
        scores = scores.masked_fill(~keep, -math.inf)
        m0 = m_all[:, :, :, start:stop].to(torch.float64)
        m_new = torch.maximum(m0, scores.amax(dim=-1))
        # A row that has kept nothing so far keeps m = -inf: shift by 0 so exp gives 0.
        shift = torch.where(torch.isneginf(m_new), 0.0, m_new)
        weights = torch.exp(scores - shift.unsqueeze(-1))
        rescale = torch.exp(m0 - shift)
        l_new = l_all[:, :, :, start:stop].to(torch.float64) * rescale + weights.sum(dim=-1)
        acc_new = acc_all[:, :, :, start:stop].to(torch.float64) * rescale.unsqueeze(-1) \
            + torch.matmul(weights, vg[:, :, :, :end])
        if any_v_bad:
            poisoned = (keep & v_bad[..., :end].unsqueeze(-2)).any(dim=-1, keepdim=True)
            acc_new = torch.where(poisoned, math.nan, acc_new)
        m_all[:, :, :, start:stop] = m_new.to(state.m.dtype)
        l_all[:, :, :, start:stop] = l_new.to(state.l.dtype)
        acc_all[:, :, :, start:stop] = acc_new.to(state.acc.dtype)


def block_means(q: torch.Tensor, k: torch.Tensor, plan: BlockColumnPlan, sm_scale: float) -> torch.Tensor:
    """The mean scaled logit of every listed block, -inf elsewhere: float32 `[B, Hq, Qb, Kb]`.

    The mean is over the causal `(row, key)` pairs of query block `i` and key block
    `j` inside the sequence (SharePrefill Alg. 2's block-averaged QK); columns do not
    contribute.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    bm, bn = plan.block_m, plan.block_n
    qb, kb = plan.num_query_blocks, plan.num_key_blocks
    listed = plan.block_mask()
    sums = torch.zeros(b, hkv, g, qb, kb, dtype=torch.float64, device=q.device)
    counts = torch.zeros(qb, kb, dtype=torch.float64, device=q.device)
    p = plan.query_offset
    qg = q.reshape(b, hkv, g, n, d).to(torch.float64)
    kg = k.to(torch.float64).unsqueeze(2)
    key_block = torch.arange(p + n, device=q.device) // bn
    for i in range(qb):
        r0, r1 = i * bm, min(n, (i + 1) * bm)
        e = p + r1  # keys the block's rows can see
        scores = torch.matmul(qg[:, :, :, r0:r1], kg[:, :, :, :e].transpose(-1, -2)) * sm_scale
        causal = torch.arange(e, device=q.device)[None, :] <= torch.arange(p + r0, e, device=q.device)[:, None]
        per_key = torch.where(causal, scores, 0.0).sum(dim=-2)  # [B, Hkv, G, e]
        sums[..., i, :].index_add_(-1, key_block[:e], per_key)
        counts[i].index_add_(0, key_block[:e], causal.sum(dim=0).to(torch.float64))
    means = (sums / counts.clamp(min=1)).reshape(b, hq, qb, kb)
    return torch.where(listed & (counts > 0), means, -math.inf).to(torch.float32)


def _group_mask(mask: torch.Tensor, hkv: int, g: int) -> torch.Tensor:
    """Reshape a `[B or 1, Hq or 1, rows, keys]` mask to broadcast over `[B, Hkv, G, ...]`."""
    bm, hm, r, c = mask.shape
    if hm == 1:
        return mask.reshape(bm, 1, 1, r, c)
    return mask.reshape(bm, hkv, g, r, c)


@overload
def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    scale: float | None = None,
    return_lse: Literal[False] = False,
    state: AttentionState | None = None,
    block_mean_out: torch.Tensor | None = None,
) -> torch.Tensor: ...


@overload
def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    scale: float | None = None,
    return_lse: Literal[True],
    state: AttentionState | None = None,
    block_mean_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockColumnPlan,
    *,
    scale: float | None = None,
    return_lse: bool = False,
    state: AttentionState | None = None,
    block_mean_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention restricted to a plan: the keys `plan.to_dense_mask()` keeps.

    A plan with `query_offset` P > 0 (a chunk of a prompt: `plan.rows`, or an
    estimator run on a chunk) takes q of the chunk's N rows and k, v of all `P + N`
    keys; the result is those rows of the whole prompt's attention under the plan.

    Args:
        q, k, v, scale, return_lse: as in `attention` (k, v: `[B, Hkv, P + N, D]`).
        plan: a `BlockColumnPlan` with `B` and `Hq` of q and `seqlen == N`.
        state: an `AttentionState` to start from (see the module doc), or None to
            start from nothing. It is updated in place to the state after this
            plan's keys; the output and lse are those of all keys attended so far.
            The plan's keys must not repeat keys the state has already attended.
        block_mean_out: a float32 `[B, Hq, Qb, Kb]` tensor, or None; if given it is
            filled with the mean scaled logit of every block the plan lists (over the
            block's causal pairs inside the sequence) and -inf for every other block.

    Returns:
        As `attention`.

    Raises:
        TypeError, ValueError: bad inputs, a plan that fails `validate` or does not
            match q, or a state / buffer of the wrong shape, dtype or device.
    """
    offset = plan.query_offset if isinstance(plan, BlockColumnPlan) else 0
    shape = check_qkv(q, k, v, query_offset=offset)
    sm_scale = resolve_scale(scale, shape.head_dim)
    check_plan(plan, shape.batch, shape.q_heads, shape.seqlen, q.device)
    if state is not None:
        check_state(state, shape.batch, shape.q_heads, shape.seqlen, shape.head_dim, q.device)
    if block_mean_out is not None:
        check_block_mean_out(block_mean_out, shape.batch, shape.q_heads, plan, q.device)
    if state is None:
        work = AttentionState.like(q, dtype=torch.float64)
    elif all(t.is_contiguous() for t in (state.m, state.l, state.acc)):
        work = state
    else:
        work = AttentionState(state.m.contiguous(), state.l.contiguous(), state.acc.contiguous())
    _attend(q, k, v, plan.to_dense_mask(), work, sm_scale, offset)
    if state is not None and work is not state:
        for name in ("m", "l", "acc"):
            getattr(state, name).copy_(getattr(work, name))
    if block_mean_out is not None:
        block_mean_out.copy_(block_means(q, k, plan, sm_scale))
    out = work.output(q.dtype)
    if return_lse:
        return out, work.lse().to(torch.float32)
    return out


def check_plan(
    plan: object, batch: int, heads: int, seqlen: int, device: torch.device
) -> BlockColumnPlan:
    """Check that `plan` is a valid `BlockColumnPlan` for `[B, Hq, N]` on `device`."""
    if not isinstance(plan, BlockColumnPlan):
        raise TypeError(f"plan must be a BlockColumnPlan, got {type(plan).__name__}")
    plan.check_fields()
    if plan.seqlen != seqlen:
        raise ValueError(f"plan.seqlen must equal N={seqlen}, got {plan.seqlen}")
    if tuple(plan.block_count.shape[:2]) != (batch, heads):
        raise ValueError(
            f"plan must have B={batch}, Hq={heads} (as q), got "
            f"{tuple(plan.block_count.shape[:2])}"
        )
    if plan.device != device:
        raise ValueError(f"plan must be on the device of q ({device}), got {plan.device}")
    return plan.ensure_valid()
