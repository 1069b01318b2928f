"""Delta-KV compression (DeltaAttention thesis, section 4.1), as the specification.

Adjacent keys are often nearly equal; Delta-KV keeps one *anchor* per run of
similar keys and attends to the anchors with their run lengths as weights.

Stage 1, `delta_keep_mask` (4.1.1). Per batch row and KV head the keys are cut into
chunks of `chunk` tokens; the first key of a chunk is an anchor (so chunks are
independent). Walking the chunk, each key is compared with the current anchor:

* `metric="euclidean"`: dropped iff `||k_i - a||_2 <= threshold` (Eq. 2, `delta <= tau`);
* `metric="cosine"`: dropped iff `cos(k_i, a) >= threshold` (similar enough; a key
  and an anchor of norm 0 have similarity 1 if both are 0, else 0);

a kept key becomes the anchor. Both packages compute the comparison the same way,
so the masks agree bit for bit: products and sums in float64 (exact inputs: fp16 and
bf16 values are float64 values), the sums over the head dimension in one fixed
pairwise order (`tree_sum`), a separate rounding after every multiply and every add
(the fast kernel turns off fused multiply-add), and no square root (`is_dropped`).
A key with a NaN fails every comparison, so it is kept as its own anchor: NaN
reaches exactly the rows that attend to that key.

Stage 2, `delta_pack` (4.1.2). The anchors of each (batch row, KV head) form one
*segment* of a flat, ragged `PackedKV`: their keys and values, `counts` (run length:
the anchor and the dropped keys after it) and `timestamps` (the last original
position each anchor stands for, the running sum of counts minus 1). Segments are
padded with zero keys and values of count 0 to a multiple of `block` rows, so the
kernel reads whole blocks.

Stage 3 (4.1.3): the count-weighted softmax `W_ij = c_j exp(S_ij) / sum_k c_k exp(S_ik)`
is a softmax of `S_ij + log c_j`: exactly attention with each anchor's key and value
repeated over its run (`expand_packed` builds those keys; tests/test_delta_kv.py shows
the identity).

Two phases (4.1.4), per query block `[r0, r1)` (`delta_kv_plans`):

* phase 1, compressed history: the packed blocks (`block` anchors each) whose *reach*
  (largest timestamp) is `< r0` -- a prefix of the segment, since timestamps grow --
  attended with the log-count bias;
* phase 2, critical diagonal: the original keys from just after the last safe
  block's reach, `cut = reach + 1` (0 if no block is safe), to each row (causal).

The union is every causal key once: positions before `cut` through their anchors,
positions from `cut` on exactly. Ablations: `count_weighted=False` drops the
log-count bias; `exact_diagonal=False` ("no phase 2", everything packed) attends to
the phase-2 positions through their anchors too (the expanded keys), which makes
the whole output equal to causal attention over `expand_packed`'s keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ._checks import (
    REFERENCE_DTYPES,
    PerHead,
    check_block_size,
    check_count,
    check_positive_int,
    check_qkv,
    check_tensor,
    is_per_head,
    per_head,
    per_kv_head,
    resolve_scale,
)
from .dense_fallback import RateTable, active_rates, attend_dense_heads, keep_dense_kv_heads, query_heads_of
from .plan import BlockColumnPlan, cdiv

METRICS = ("euclidean", "cosine")


@dataclass(frozen=True, eq=False)
class PackedKV:
    """Delta-KV anchors of every (batch row, KV head), ragged and flat (Stage 2).

    Segment `s = b * Hkv + g` (batch row `b`, KV head `g`) is rows
    `offsets[s] .. offsets[s + 1]` of every field; its first `lengths[b, g]` rows are
    the anchors in order, the rest zero padding up to a multiple of `block`.

    Attributes:
        k, v: `[T, D]`, the anchors' keys and values (the inputs' dtype).
        counts: int32 `[T]`, run length of each anchor; 0 on padding.
        timestamps: int32 `[T]`, running sum of the segment's counts minus 1: the last
            original position each anchor stands for (padding repeats the last).
        offsets: int64 `[B * Hkv + 1]`, segment starts (multiples of `block`) and `T`.
        lengths: int32 `[B, Hkv]`, anchors per segment.
        seqlen: N, the original number of keys.
        block: padding granule, the packed key block of phase 1.
    """

    k: torch.Tensor
    v: torch.Tensor
    counts: torch.Tensor
    timestamps: torch.Tensor
    offsets: torch.Tensor
    lengths: torch.Tensor
    seqlen: int
    block: int
    # Set by `validate` (or by the packers, valid by construction): the consumers call
    # `ensure_valid`, so a packing is checked once, before its first launch. Not an
    # init field, so `dataclasses.replace` makes an unchecked copy.
    _checked: bool = field(default=False, init=False, repr=False, compare=False)

    def validate(self) -> PackedKV:
        """Check every invariant of the class doc; return self.

        `k`, `v` `[T, D]` of one float dtype and device; `counts`, `timestamps` int32
        `[T]`; `offsets` int64 `[B * Hkv + 1]` from 0 to T, each segment
        `ceil(lengths / block) * block` rows; `1 <= lengths <= seqlen`; counts `>= 1` on
        the anchors, 0 on padding, summing to `seqlen` per segment; timestamps their
        running sum minus 1. So no content of a valid packing makes a kernel read
        outside `k`, `v` or a segment.

        Raises:
            TypeError: a field of the wrong type or dtype.
            ValueError: the first broken invariant, naming the field (and the segment).
        """
        n = check_positive_int("packed.seqlen", self.seqlen)
        bs = check_block_size("packed.block", self.block)
        for name in ("k", "v", "counts", "timestamps", "offsets", "lengths"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"packed.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.device.type == "meta":
                raise ValueError(f"packed.{name} is a meta tensor: a packing needs values")
        dev = self.k.device
        if self.k.dim() != 2 or self.k.dtype not in REFERENCE_DTYPES or 0 in self.k.shape[1:]:
            raise ValueError(f"packed.k must be a float [T, D] tensor, got {self.k.dtype} {tuple(self.k.shape)}")
        if self.v.shape != self.k.shape or self.v.dtype != self.k.dtype or self.v.device != dev:
            raise ValueError(f"packed.v must match packed.k ({tuple(self.k.shape)}, {self.k.dtype}, {dev}), got "
                             f"{tuple(self.v.shape)}, {self.v.dtype}, {self.v.device}")
        total = self.k.shape[0]
        for name, dtype, rank in (("counts", torch.int32, 1), ("timestamps", torch.int32, 1),
                                  ("offsets", torch.int64, 1), ("lengths", torch.int32, 2)):
            t = getattr(self, name)
            if t.dtype != dtype or t.dim() != rank:
                raise TypeError(f"packed.{name} must be a rank-{rank} {dtype} tensor, got {t.dtype} "
                                f"{tuple(t.shape)}")
            if t.device != dev:
                raise ValueError(f"packed.{name} must be on packed.k's device ({dev}), got {t.device}")
        for name in ("counts", "timestamps"):
            if getattr(self, name).shape[0] != total:
                raise ValueError(f"packed.{name} must have T={total} entries (rows of packed.k), got "
                                 f"{getattr(self, name).shape[0]}")
        segs = self.lengths.numel()
        off = self.offsets
        if off.shape[0] != segs + 1:
            raise ValueError(f"packed.offsets must have B * Hkv + 1 = {segs + 1} entries, got {off.shape[0]}")
        if int(off[0]) != 0 or int(off[-1]) != total:
            raise ValueError(f"packed.offsets must start at 0 and end at T={total}, got {int(off[0])} .. "
                             f"{int(off[-1])}")
        lengths = self.lengths.reshape(-1).to(torch.int64)
        _raise_segment((lengths < 1) | (lengths > n), f"packed.lengths must lie in [1, seqlen={n}]")
        sizes = off[1:] - off[:-1]
        _raise_segment(sizes != cdiv_tensor(lengths, bs) * bs,
                       f"packed.offsets must give each segment ceil(lengths / block) * block rows (block={bs})")
        seg = torch.repeat_interleave(torch.arange(segs, device=dev), sizes)
        row = torch.arange(total, device=dev) - off[:-1][seg]
        anchor = row < lengths[seg]
        counts = self.counts.to(torch.int64)
        bad = torch.where(anchor, counts < 1, counts != 0)
        _raise_segment(torch.zeros(segs, dtype=torch.bool, device=dev).index_put_((seg,), bad, accumulate=True),
                       "packed.counts must be >= 1 on a segment's anchors and 0 on its padding")
        per_seg = torch.zeros(segs, dtype=torch.int64, device=dev).index_add_(0, seg, counts)
        _raise_segment(per_seg != n, f"packed.counts must sum to seqlen={n} in every segment")
        running = torch.cumsum(counts, 0)
        before = torch.where(off[:-1] > 0, running[(off[:-1] - 1).clamp(min=0)], 0) if total else off[:-1]
        stamps = running - before[seg] - 1
        bad = stamps != self.timestamps.to(torch.int64)
        _raise_segment(torch.zeros(segs, dtype=torch.bool, device=dev).index_put_((seg,), bad, accumulate=True),
                       "packed.timestamps must be the running sum of the segment's counts minus 1")
        object.__setattr__(self, "_checked", True)
        return self

    def ensure_valid(self) -> PackedKV:
        """`validate` unless this packing already passed it (or was marked valid); return self.

        Tensors edited in place after a successful check are not re-checked: call
        `validate` again after such edits.
        """
        return self if self._checked else self.validate()

    def mark_valid(self) -> PackedKV:
        """Record that this packing is valid by construction (the packers only); return self."""
        object.__setattr__(self, "_checked", True)
        return self

    @property
    def batch(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def kv_heads(self) -> int:
        return int(self.lengths.shape[1])

    def keep_ratio(self) -> torch.Tensor:
        """Anchors over keys, float64 `[B, Hkv]` (the thesis's KV reduction is 1 minus this)."""
        return self.lengths.to(torch.float64) / self.seqlen

    def segment(self, batch: int, head: int) -> slice:
        """The rows of one segment, padding included."""
        s = batch * self.kv_heads + head
        return slice(int(self.offsets[s]), int(self.offsets[s + 1]))


def _raise_segment(bad: torch.Tensor, message: str) -> None:
    if bool(bad.any()):
        raise ValueError(f"{message}; first at segment {int(bad.nonzero()[0, 0])}")


def check_metric(metric: object) -> str:
    """Return `metric` if it is one of `METRICS`, else raise."""
    if not isinstance(metric, str):
        raise TypeError(f"metric must be a str, got {type(metric).__name__}")
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}, got {metric!r}")
    return metric


def check_threshold(threshold: object, metric: str, *, name: str = "threshold") -> float:
    """A finite float; `>= 0` for the Euclidean distance (a cosine threshold may be any).
    `name` is the argument's name in the messages."""
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(threshold).__name__}")
    if not math.isfinite(threshold):
        raise ValueError(f"{name} must be finite, got {threshold}")
    if metric == "euclidean" and threshold < 0:
        raise ValueError(f"{name} must be >= 0 for the euclidean metric, got {threshold}")
    return float(threshold)


def check_mask_threshold(threshold: object, metric: str, kv_heads: int) -> float | torch.Tensor:
    """`delta_keep_mask`'s threshold: a scalar (`check_threshold`), or one value per KV head
    (a list/tuple of Hkv numbers or a 1-D tensor, each element checked as the scalar),
    returned as float64 `[Hkv]` on the CPU."""
    if not is_per_head(threshold):
        return check_threshold(threshold, metric)
    return per_head(threshold, "threshold", kv_heads, lambda t: check_threshold(t, metric), unit="KV head")


def kv_threshold(threshold: object, metric: str, heads: int, kv_heads: int) -> float | torch.Tensor:
    """The threshold of a Delta-KV call on `heads` query heads (the method's per-head knob,
    docs/architecture.md "Per-head knobs"): a scalar, or one value per query head equal
    within each KV group (`per_kv_head`); returns the scalar or float64 `[Hkv]` (CPU), what
    `delta_keep_mask` takes."""
    return per_kv_head(threshold, "threshold", heads, kv_heads, lambda t: check_threshold(t, metric))


def check_keys(k: object) -> torch.Tensor:
    """`k: [B, Hkv, N, D]`, a non-empty float tensor."""
    k = check_tensor("k", k, rank=4)
    if k.dtype not in REFERENCE_DTYPES:
        raise TypeError(f"k must be a float16/bfloat16/float32/float64 tensor, got {k.dtype}")
    if k.device.type == "meta":
        raise ValueError("k is a meta tensor: the keep mask depends on the key values")
    if 0 in k.shape:
        raise ValueError(f"k must not be empty, got shape {tuple(k.shape)}")
    return k


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dimension in a fixed order: adjacent pairs, level by level.

    The dimension is padded with zeros to a power of two (at least 2); each level adds
    element `2i` and `2i + 1`. The fast kernel sums in exactly this order, so float64
    sums of the same numbers are bit-identical in both packages.
    """
    width = max(2, 1 << (x.shape[-1] - 1).bit_length())
    x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    while x.shape[-1] > 1:
        x = x.view(*x.shape[:-1], x.shape[-1] // 2, 2).sum(dim=-1)
    return x.squeeze(-1)


def is_dropped(key: torch.Tensor, anchor: torch.Tensor, threshold: float | torch.Tensor,
               metric: str) -> torch.Tensor:
    """4.1.1 steps 2-3: is `key` similar enough to `anchor` to be dropped? bool `[...]`.

    `threshold` is a float, or a float64 tensor broadcastable to the result (one value
    per KV head); every element is tested exactly as the float would be.

    Float64 throughout, sums in `tree_sum`'s order, and no square root: the Euclidean
    test is `d2 <= threshold**2`; the cosine test `cos >= threshold` is, for norms
    product `nn > 0`, `dot > 0 and dot**2 >= threshold**2 * nn` when `threshold > 0`,
    else `dot >= 0 or dot**2 <= threshold**2 * nn`. The fast kernel evaluates the very
    same expressions, so no rounding can flip a test in one package only. NaN fails
    every comparison, so a NaN key is never dropped.
    """
    x = key.to(torch.float64)
    a = anchor.to(torch.float64)
    t2 = threshold * threshold
    if metric == "euclidean":
        diff = x - a
        return tree_sum(diff * diff) <= t2
    dot = tree_sum(x * a)
    nx, na = tree_sum(x * x), tree_sum(a * a)
    norms = nx * na
    if isinstance(threshold, torch.Tensor):
        similar = torch.where(threshold > 0, (dot > 0) & (dot * dot >= t2 * norms),
                              (dot >= 0) | (dot * dot <= t2 * norms))
    elif threshold > 0:
        similar = (dot > 0) & (dot * dot >= t2 * norms)
    else:
        similar = (dot >= 0) | (dot * dot <= t2 * norms)
    # Zero vectors: similarity 1 if both are zero, else 0.
    zero_sim = torch.where((nx == 0) & (na == 0), 1.0, 0.0)
    return torch.where(norms == 0, zero_sim >= threshold, similar)


def delta_keep_mask(
    k: torch.Tensor,
    *,
    threshold: PerHead,
    metric: str = "euclidean",
    chunk: int = 512,
) -> torch.Tensor:
    """Stage 1 (4.1.1): which keys are anchors, per (batch row, KV head).

    Args:
        k: `[B, Hkv, N, D]`, any float dtype.
        threshold: the Euclidean distance (>= 0) or cosine similarity below / above
            which a key is dropped (see the module doc); a scalar, or one value per KV
            head (a list/tuple of Hkv numbers or a 1-D tensor), KV head `g` masked with
            element `g` exactly as with that scalar.
        metric: "euclidean" or "cosine".
        chunk: keys per independent chunk (>= 1; values past N mean one chunk).

    Returns:
        bool `[B, Hkv, N]`, True at anchors; every chunk's first key is one.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    k = check_keys(k)
    metric = check_metric(metric)
    thr = check_mask_threshold(threshold, metric, k.shape[1])
    b, h, n, d = k.shape
    size = check_count("chunk", chunk, cap=n)
    if isinstance(thr, torch.Tensor):
        thr = thr.to(k.device).view(1, h, 1)  # one per KV head, broadcast over [B, Hkv, chunks]
    nc = cdiv(n, size)
    x = torch.zeros(b, h, nc * size, d, dtype=torch.float64, device=k.device)
    x[:, :, :n] = k.to(torch.float64)
    x = x.view(b, h, nc, size, d)
    keep = torch.zeros(b, h, nc, size, dtype=torch.bool, device=k.device)
    keep[..., 0] = True
    valid = (torch.arange(nc * size, device=k.device) < n).view(nc, size)
    anchor = x[..., 0, :]
    for t in range(1, size):
        # 4.1.1 steps 2-3: keep the key and move the anchor, or drop it.
        kept = ~is_dropped(x[..., t, :], anchor, thr, metric) & valid[:, t]
        keep[..., t] = kept
        anchor = torch.where(kept.unsqueeze(-1), x[..., t, :], anchor)
    return keep.view(b, h, nc * size)[..., :n].clone()


def delta_pack(
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor,
    *,
    block: int = 64,
) -> PackedKV:
    """Stage 2 (4.1.2): pack the anchors of every (batch row, KV head) into a `PackedKV`.

    Args:
        k, v: `[B, Hkv, N, D]`, same dtype and device.
        keep: bool `[B, Hkv, N]` from `delta_keep_mask` (position 0 must be kept).
        block: segments are padded to a multiple of `block` rows (the packed key
            block of phase 1).

    Returns:
        The `PackedKV` (see its doc), in k's dtype.

    Raises:
        TypeError, ValueError: bad inputs, or a keep mask whose first key is dropped.
    """
    k, v, keep, bs = check_pack_inputs(k, v, keep, block)
    b, h, n, d = k.shape
    ks, vs, counts, stamps, lengths = [], [], [], [], []
    offsets = [0]
    for bi in range(b):
        for g in range(h):
            pos = keep[bi, g].nonzero().squeeze(-1)
            m = int(pos.numel())
            rows = cdiv(m, bs) * bs
            # A run lasts until the next anchor (or the end of the sequence).
            run = torch.diff(pos, append=torch.tensor([n], device=pos.device))
            seg_k = torch.zeros(rows, d, dtype=k.dtype, device=k.device)
            seg_v = torch.zeros(rows, d, dtype=v.dtype, device=v.device)
            seg_c = torch.zeros(rows, dtype=torch.int32, device=k.device)
            seg_k[:m], seg_v[:m], seg_c[:m] = k[bi, g, pos], v[bi, g, pos], run.to(torch.int32)
            ks.append(seg_k)
            vs.append(seg_v)
            counts.append(seg_c)
            stamps.append((torch.cumsum(seg_c, 0) - 1).to(torch.int32))
            lengths.append(m)
            offsets.append(offsets[-1] + rows)
    return PackedKV(
        k=torch.cat(ks), v=torch.cat(vs), counts=torch.cat(counts), timestamps=torch.cat(stamps),
        offsets=torch.tensor(offsets, dtype=torch.int64, device=k.device),
        lengths=torch.tensor(lengths, dtype=torch.int32, device=k.device).view(b, h),
        seqlen=n, block=bs,
    ).mark_valid()


def check_pack_inputs(
    k: object, v: object, keep: object, block: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Check `delta_pack`'s arguments; return them (and the block size)."""
    k = check_keys(k)
    v = check_tensor("v", v, rank=4)
    if v.shape != k.shape or v.dtype != k.dtype or v.device != k.device:
        raise ValueError(f"v must match k's shape, dtype and device, got {tuple(v.shape)} {v.dtype} "
                         f"{v.device}")
    keep = check_tensor("keep", keep, rank=3)
    if keep.dtype != torch.bool or tuple(keep.shape) != tuple(k.shape[:3]) or keep.device != k.device:
        raise ValueError(f"keep must be a bool [B, Hkv, N] = {list(k.shape[:3])} tensor on k's device, "
                         f"got {keep.dtype} {tuple(keep.shape)}")
    if not bool(keep[..., 0].all()):
        raise ValueError("keep must keep the first key of every (batch row, KV head): it is an anchor")
    return k, v, keep, check_block_size("block", block)


def check_packed(packed: object, k: torch.Tensor) -> PackedKV:
    """Check that `packed` is a `PackedKV` of `k: [B, Hkv, N, D]` (sizes, dtype, device)."""
    if not isinstance(packed, PackedKV):
        raise TypeError(f"packed must be a PackedKV, got {type(packed).__name__}")
    packed.ensure_valid()
    b, h, n, d = k.shape
    if packed.seqlen != n or (packed.batch, packed.kv_heads) != (b, h) or packed.k.shape[-1] != d:
        raise ValueError(f"packed must come from keys [B={b}, Hkv={h}, N={n}, D={d}], got seqlen "
                         f"{packed.seqlen}, lengths {tuple(packed.lengths.shape)}, D {packed.k.shape[-1]}")
    if packed.k.dtype != k.dtype or packed.k.device != k.device:
        raise ValueError(f"packed must have k's dtype and device ({k.dtype}, {k.device})")
    return packed


def check_packed_for(packed: object, q: object) -> tuple[PackedKV, torch.Tensor]:
    """`delta_kv_plans` / `delta_kv_density`'s check: a valid `PackedKV` for `q: [B, Hq, N, D]`."""
    q = check_tensor("q", q, rank=4)
    if not isinstance(packed, PackedKV):
        raise TypeError(f"packed must be a PackedKV, got {type(packed).__name__}")
    packed.ensure_valid()
    b, hq, n, _ = q.shape
    if (packed.batch, packed.seqlen) != (b, n) or packed.kv_heads == 0 or hq % packed.kv_heads != 0:
        raise ValueError(f"packed (B={packed.batch}, Hkv={packed.kv_heads}, N={packed.seqlen}) does not "
                         f"fit q [B={b}, Hq={hq}, N={n}]")
    if packed.lengths.device != q.device:
        raise ValueError(f"packed must be on q's device ({q.device}), got {packed.lengths.device}")
    return packed, q


def expand_packed(packed: PackedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """Each anchor's key and value repeated over its run: `[B, Hkv, N, D]` each.

    Count-weighted attention to the anchors equals plain attention to these keys.
    """
    n = packed.seqlen
    ks, vs = [], []
    for bi in range(packed.batch):
        for g in range(packed.kv_heads):
            rows = packed.segment(bi, g)
            m = int(packed.lengths[bi, g])
            counts = packed.counts[rows][:m].to(torch.int64)
            ks.append(torch.repeat_interleave(packed.k[rows][:m], counts, dim=0))
            vs.append(torch.repeat_interleave(packed.v[rows][:m], counts, dim=0))
    shape = (packed.batch, packed.kv_heads, n, packed.k.shape[-1])
    return torch.stack(ks).view(shape), torch.stack(vs).view(shape)


def safe_blocks(packed: PackedKV, *, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """4.1.4 phase 1's stopping rule, per (batch row, KV head, query block).

    Returns:
        (safe, cut), int64 `[B, Hkv, Qb]`: the number of leading packed blocks whose reach
        (largest timestamp) is before the query block's first row, and the first
        original position phase 2 computes exactly (the last safe reach + 1, or 0).
    """
    n, bs = packed.seqlen, packed.block
    qb = cdiv(n, block_m)
    first_row = torch.arange(qb, device=packed.counts.device, dtype=torch.int64) * block_m
    safe = torch.zeros(packed.batch, packed.kv_heads, qb, dtype=torch.int64, device=first_row.device)
    cut = torch.zeros_like(safe)
    for bi in range(packed.batch):
        for g in range(packed.kv_heads):
            stamps = packed.timestamps[packed.segment(bi, g)].to(torch.int64)
            reach = stamps.view(-1, bs).amax(dim=1)
            count = (reach[None, :] < first_row[:, None]).sum(dim=1)
            safe[bi, g] = count
            last = reach[(count - 1).clamp(min=0)]
            cut[bi, g] = torch.where(count > 0, last + 1, 0)
    return safe, cut


def delta_kv_plans(
    q: torch.Tensor,
    packed: PackedKV,
    *,
    block_m: int = 64,
) -> tuple[BlockColumnPlan, BlockColumnPlan]:
    """The two phases of 4.1.4 as plans: (phase 1 over packed keys, phase 2 over original keys).

    Phase 1 lists, for query block `i`, the packed blocks `0 .. safe - 1` of its KV
    head's segment (in the segment's own index space, blocks of `packed.block`
    anchors). Phase 2 lists the original keys from `cut` on: the keys up to the next
    multiple of `packed.block` as columns, then whole key blocks to the diagonal.

    Args:
        q: `[B, Hq, N, D]` (only the shape is used).
        packed: from `delta_pack` for the keys of `q`'s KV heads.
        block_m: query rows per block.

    Returns:
        (phase1, phase2), each a `BlockColumnPlan` for `[B, Hq, N]` with `block_n =
        packed.block`.

    Raises:
        TypeError, ValueError: bad inputs.
    """
    packed, q = check_packed_for(packed, q)
    b, hq, n, _ = q.shape
    bm = check_block_size("block_m", block_m)
    bs = packed.block
    qb, kb = cdiv(n, bm), cdiv(n, bs)
    safe, cut = safe_blocks(packed, block_m=bm)
    group = hq // packed.kv_heads
    safe = safe.repeat_interleave(group, dim=1)
    cut = cut.repeat_interleave(group, dim=1)
    phase1 = torch.arange(kb, device=q.device) < safe.unsqueeze(-1)
    keys = torch.arange(n, device=q.device)
    exact = keys >= cut.unsqueeze(-1)
    # Whole key blocks from the first block boundary at or after `cut`; columns before it.
    block_start = cdiv_tensor(cut, bs) * bs
    blocks = torch.arange(kb, device=q.device) * bs >= block_start.unsqueeze(-1)
    columns = exact & (keys < block_start.unsqueeze(-1))
    sizes = {"seqlen": n, "block_m": bm, "block_n": bs}
    plan1 = BlockColumnPlan.from_masks(phase1, None, **sizes)
    plan2 = BlockColumnPlan.from_masks(blocks, columns, **sizes)
    return plan1, plan2


def cdiv_tensor(x: torch.Tensor, d: int) -> torch.Tensor:
    """Ceiling division of a non-negative int tensor by a positive int."""
    return torch.div(x + d - 1, d, rounding_mode="floor")


def delta_kv_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    packed: PackedKV,
    *,
    block_m: int = 64,
    count_weighted: bool = True,
    exact_diagonal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Stage 3 with the two phases of 4.1.4: attention to the packed history plus the exact diagonal.

    Row `r` of query block `i` attends, in one softmax (float64), to the anchors of
    the safe packed blocks with logits `s + log count` (`+ 0` if not
    `count_weighted`), and to the original keys `cut_i .. r` (with
    `exact_diagonal=False`, to those positions' anchors instead).

    Args:
        q: `[B, Hq, N, D]`; k, v: `[B, Hkv, N, D]` (phase 2 reads them).
        packed: `delta_pack(k, v, ...)`.
        block_m: query rows per block (where phase 1 stops is decided per block).
        count_weighted: weight anchors by their run length (Eq. 4).
        exact_diagonal: phase 2 on the original keys (4.1.4); False is the thesis's
            "w/o phase 2" ablation.
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs.
    """
    shape = check_qkv(q, k, v)
    sm_scale = resolve_scale(scale, shape.head_dim)
    check_packed(packed, k)
    check_flags(count_weighted=count_weighted, exact_diagonal=exact_diagonal)
    bm = check_block_size("block_m", block_m)
    b, hq, n, d = q.shape
    g = shape.group
    safe, cut = safe_blocks(packed, block_m=bm)
    k2, v2 = (k, v) if exact_diagonal else expand_packed(packed)
    # Non-finite values reach only the rows that keep them (reference.attention's rule):
    # the products use finite stand-ins, and rows keeping a bad value are set to NaN.
    v2_bad = ~torch.isfinite(v2).all(dim=-1)
    v2 = torch.where(torch.isfinite(v2), v2, 0)
    out = torch.empty(b, hq, n, d, dtype=torch.float64, device=q.device)
    for bi in range(b):
        for kv in range(shape.kv_heads):
            rows = packed.segment(bi, kv)
            pk = packed.k[rows].to(torch.float64)
            pv = packed.v[rows].to(torch.float64)
            pv_bad = ~torch.isfinite(pv).all(dim=-1)
            pv = torch.where(torch.isfinite(pv), pv, 0.0)
            bias = torch.log(packed.counts[rows].to(torch.float64)) if count_weighted else \
                torch.where(packed.counts[rows] > 0, 0.0, -math.inf).to(torch.float64)
            for i in range(cdiv(n, bm)):
                r0, r1 = i * bm, min(n, (i + 1) * bm)
                hist = int(safe[bi, kv, i]) * packed.block
                c = int(cut[bi, kv, i])
                qs = q[bi, kv * g:(kv + 1) * g, r0:r1].to(torch.float64)
                # Phase 1: anchors of the safe blocks, with the log-count bias (Eq. 4).
                s1 = qs @ pk[:hist].T * sm_scale + bias[:hist]
                # Phase 2: positions c .. r of the critical diagonal, causal.
                s2 = qs @ k2[bi, kv, c:r1].to(torch.float64).T * sm_scale
                causal = torch.arange(c, r1, device=q.device)[None, :] <= torch.arange(r0, r1, device=q.device)[:, None]
                s2 = s2.masked_fill(~causal, -math.inf)
                p = torch.softmax(torch.cat([s1, s2], dim=-1), dim=-1)
                o = p @ torch.cat([pv[:hist], v2[bi, kv, c:r1].to(torch.float64)])
                listed = (packed.counts[rows][:hist] > 0).expand(s1.shape)
                kept = torch.cat([listed, causal.expand_as(s2)], dim=-1)
                bad = torch.cat([pv_bad[:hist], v2_bad[bi, kv, c:r1]])
                out[bi, kv * g:(kv + 1) * g, r0:r1] = torch.where((kept & bad).any(-1, keepdim=True), math.nan, o)
    return out.to(q.dtype)


def check_flags(**flags: object) -> None:
    """Raise TypeError unless every flag is a bool."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def delta_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    threshold: PerHead,
    metric: str = "euclidean",
    chunk: int = 512,
    block_m: int = 64,
    block_n: int = 64,
    count_weighted: bool = True,
    exact_diagonal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Delta-KV attention end to end: keep mask, packing, the two-phase attention.

    Where the break-even rule is on (`reference.dense_fallback`: CUDA tensors by default,
    any device inside `dense_fallback(rates=table)`), it decides on the keep mask, before
    packing: the query heads of the KV heads `keep_dense_kv_heads` picks get full causal
    attention instead (every other head the output it gets without the rule).

    Args:
        q: `[B, Hq, N, D]`; k, v: `[B, Hkv, N, D]`.
        threshold, metric, chunk: Stage 1 (`delta_keep_mask`). `threshold` is a scalar or
            one value per query head (the method's per-head knob) equal within each KV
            group, since it decides which keys the group's KV head keeps (`kv_threshold`).
        block_m: query rows per block. block_n: packed key block (segments are padded to
            it) and the key block of phase 2.
        count_weighted, exact_diagonal: the thesis's ablations (`delta_kv_attention`).
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    check_qkv(q, k, v)
    metric = check_metric(metric)
    thr = kv_threshold(threshold, metric, q.shape[1], k.shape[1])
    check_block_size("block_m", block_m)
    check_block_size("block_n", block_n)
    check_flags(count_weighted=count_weighted, exact_diagonal=exact_diagonal)
    resolve_scale(scale, q.shape[-1])
    keep = delta_keep_mask(k, threshold=thr, metric=metric, chunk=chunk)
    dense = dense_query_heads(q, keep.sum(dim=-1), seqlen=k.shape[2], block_m=block_m, block_n=block_n,
                              rates=active_rates(q))
    if len(dense) == q.shape[1]:
        return attend_dense_heads(q, k, v, dense, None, scale=scale)
    packed = delta_pack(k, v, keep, block=block_n)
    out = delta_kv_attention(q, k, v, packed, block_m=block_m, count_weighted=count_weighted,
                             exact_diagonal=exact_diagonal, scale=scale)
    return attend_dense_heads(q, k, v, dense, out, scale=scale)


def dense_query_heads(q: torch.Tensor, kept: torch.Tensor, *, seqlen: int, block_m: int, block_n: int,
                      rates: RateTable | None) -> tuple[int, ...]:
    """The query heads the break-even rule sends dense on a Delta-KV keep mask: the query
    heads of the KV heads `keep_dense_kv_heads` picks (every head where one SDPA call over
    the layer wins, else those at or above the break-even keep ratio), or () when the rule
    is off (`rates` None). Both packages call it.

    Args:
        q: `[B, Hq, N, D]` (its dtype and head dim choose the rates).
        kept: int `[B, Hkv]`, anchors per (batch row, KV head): the keep mask's sums.
        seqlen: N. block_m, block_n: the run's query block and packed key block.
        rates: the table in force (`active_rates(q)`), None when the rule is off.

    Returns:
        Sorted query heads (whole KV groups).
    """
    if rates is None:
        return ()
    kv = keep_dense_kv_heads(kept, q_heads=int(q.shape[1]), seqlen=seqlen, block_m=block_m, block_n=block_n,
                             head_dim=int(q.shape[-1]), dtype=q.dtype, rates=rates)
    return query_heads_of(kv, int(q.shape[1]), int(kept.shape[1]))


def delta_kv_density(q: torch.Tensor, packed: PackedKV, *, block_m: int = 64) -> torch.Tensor:
    """Score entries the two phases compute, over the causal area: float64 `[B, Hq]`.

    Phase 1 costs `rows x block` per safe packed block, phase 2 its causal pairs; the
    dense causal area is `N (N + 1) / 2`. This is the method's kernel work in the
    units every other method's density uses.
    """
    plan1, plan2 = delta_kv_plans(q, packed, block_m=block_m)
    n = packed.seqlen
    rows = (n - torch.arange(plan1.num_query_blocks, device=q.device) * plan1.block_m).clamp(max=plan1.block_m)
    phase1 = (plan1.block_count.to(torch.float64) * packed.block * rows).sum(dim=-1)
    causal = plan2.to_dense_mask().sum(dim=(-1, -2)).to(torch.float64)
    return (phase1 + causal) / (n * (n + 1) / 2)
