"""Argument validation shared by `reference` and `fast`.

Every public function checks its inputs here before doing any work, so both
packages reject the same bad inputs with the same messages, and no kernel ever
sees an input that was not checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Union

import torch

# A method's main knob (`Method.knobs`): one value for every query head, or one value per
# query head (a list/tuple of Hq numbers or a 1-D tensor of length Hq); see `per_head`.
PerHead = Union[float, Sequence[float], torch.Tensor]
PerHeadInt = Union[int, Sequence[int], torch.Tensor]

HALF_DTYPES = (torch.float16, torch.bfloat16)
REFERENCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Largest block (rows or keys per block) any method accepts. Real methods use 16 to
# 512; past a few thousand the kernel's tail bookkeeping (DIAG entries per tile) and
# int32 index arithmetic stop being sane, and a block that large is dense attention.
MAX_BLOCK_SIZE = 4096
# Largest softmax scale: 1/sqrt(D) <= 1 for every real model. Past about 1e6 the fp32
# logits of the kernels (|q . k| up to 65504^2 * D in fp16) can overflow to inf, where
# the float64 reference would not, so the two packages would disagree.
MAX_SCALE = 1e6


@dataclass(frozen=True)
class QKVShape:
    """Sizes of a checked `q: [B, Hq, N, D]`, `k, v: [B, Hkv, N, D]` triple."""

    batch: int
    q_heads: int
    kv_heads: int
    seqlen: int
    head_dim: int
    query_offset: int = 0

    @property
    def key_len(self) -> int:
        """Keys: `query_offset + seqlen` (a chunk of queries after a cached prefix)."""
        return self.query_offset + self.seqlen

    @property
    def group(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.q_heads // self.kv_heads


def check_tensor(name: str, x: object, *, rank: int) -> torch.Tensor:
    """Raise TypeError/ValueError unless `x` is a tensor of the given rank."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")
    return x


def check_values(name: str, x: torch.Tensor, *, why: str = "its values are read") -> torch.Tensor:
    """Raise ValueError naming `name` if `x` is a meta tensor (shapes only, no values to read)."""
    if x.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor (shape only): {why}, so it must hold real values")
    return x


def check_qk(
    q: object,
    k: object,
    *,
    dtypes: tuple[torch.dtype, ...] = REFERENCE_DTYPES,
    query_offset: int = 0,
) -> QKVShape:
    """Check `q: [B, Hq, N, D]` against `k: [B, Hkv, P + N, D]` and return the sizes.

    `query_offset` P: the queries are positions `[P, P + N)` of a prompt whose keys
    `[0, P + N)` are all in k (P = 0: q and k cover the same positions).

    Raises:
        TypeError: not tensors, or a dtype outside `dtypes`, or q and k differ in dtype.
        ValueError: wrong rank, mismatched sizes, Hq not a multiple of Hkv, empty
            tensors, or q and k on different devices.
    """
    q = check_tensor("q", q, rank=4)
    k = check_tensor("k", k, rank=4)
    if q.device.type == "meta":
        raise ValueError(
            "q is a meta tensor: sparse methods choose their keys from the values of q and k, "
            "so they need real tensors (under torch.compile, call the registered custom ops, "
            "whose fake implementations take meta inputs)"
        )
    if q.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"q must have dtype in ({names}), got {q.dtype}")
    if k.dtype != q.dtype:
        raise TypeError(f"k must have the dtype of q ({q.dtype}), got {k.dtype}")
    if k.device != q.device:
        raise ValueError(f"k must be on the device of q ({q.device}), got {k.device}")
    b, hq, n, d = q.shape
    if 0 in q.shape:
        raise ValueError(f"q must not be empty, got shape {tuple(q.shape)}")
    if k.shape[0] != b or k.shape[2] != query_offset + n or k.shape[3] != d:
        keys = f"N={n}" if query_offset == 0 else f"P + N={query_offset + n} (query_offset={query_offset})"
        raise ValueError(
            f"k must have shape [B={b}, Hkv, {keys}, D={d}] to match q, got {tuple(k.shape)}"
        )
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"the number of query heads ({hq}) must be a multiple of the number of "
            f"KV heads in k ({hkv})"
        )
    return QKVShape(batch=b, q_heads=hq, kv_heads=hkv, seqlen=n, head_dim=d, query_offset=query_offset)


def check_chunk_qk(
    q: object,
    k: object,
    *,
    dtypes: tuple[torch.dtype, ...] = REFERENCE_DTYPES,
) -> QKVShape:
    """`check_qk` where k may hold more positions than q: then q holds the last N of
    k's `P + N` positions (a chunk after a cached prefix) and `query_offset` is P."""
    offset = 0
    if isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() == 4 and k.dim() == 4:
        offset = max(0, k.shape[2] - q.shape[2])
    return check_qk(q, k, dtypes=dtypes, query_offset=offset)


def check_qkv(
    q: object,
    k: object,
    v: object,
    *,
    dtypes: tuple[torch.dtype, ...] = REFERENCE_DTYPES,
    query_offset: int = 0,
) -> QKVShape:
    """Check a `q, k, v` triple (see `check_qk`); `v` must match `k` exactly."""
    shape = check_qk(q, k, dtypes=dtypes, query_offset=query_offset)
    assert isinstance(k, torch.Tensor)
    v = check_tensor("v", v, rank=4)
    if v.dtype != k.dtype:
        raise TypeError(f"v must have the dtype of q and k ({k.dtype}), got {v.dtype}")
    if v.device != k.device:
        raise ValueError(f"v must be on the device of q and k ({k.device}), got {v.device}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    return shape


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """Return the softmax scale, `1/sqrt(D)` by default; it must be finite and > 0."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be finite and > 0, got {scale}")
    if scale > MAX_SCALE:
        raise ValueError(f"scale must be <= {MAX_SCALE:g} (fp32 logits would overflow), got {scale}")
    return float(scale)


def check_positive_int(name: str, value: object, *, minimum: int = 1, maximum: int | None = None) -> int:
    """Return `value` if it is an int in `[minimum, maximum]`, else raise TypeError/ValueError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_block_size(name: str, value: object) -> int:
    """Return a block size (rows or keys per block) in `[1, MAX_BLOCK_SIZE]`, else raise."""
    return check_positive_int(name, value, maximum=MAX_BLOCK_SIZE)


def check_count(name: str, value: object, *, cap: int, minimum: int = 1) -> int:
    """Check an int `>= minimum` whose values past `cap` all mean the same ("everything").

    Returns `min(value, cap)`, so that no later arithmetic sees a huge Python int
    (2**63 would overflow an int64 tensor and silently change the meaning).
    """
    return min(check_positive_int(name, value, minimum=minimum), cap)


def check_fraction(name: str, value: object, *, low: float = 0.0, high: float = 1.0) -> float:
    """Return `value` as float if it lies in `[low, high]`, else raise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not (low <= value <= high):
        raise ValueError(f"{name} must lie in [{low}, {high}], got {value}")
    return float(value)


# An integer knob's per-head values are stored as int64: larger counts (a caller's "keep
# everything", 2**63) mean the same as this one, far past any sequence length.
KNOB_INT_CAP = 2**62


def is_per_head(value: object) -> bool:
    """True when a knob's value is given per head (a list, tuple or tensor), not as one scalar."""
    return isinstance(value, (list, tuple, torch.Tensor))


def _per_head_values(name: str, value: object, check: Callable[[object], float | int], *,
                     unit: str = "query head") -> list[float | int]:
    """Every element of a per-head value through the knob's scalar `check` (same rules and
    messages as the scalar form, prefixed with the head), after the container's checks.
    `unit` names what an element stands for ("query head", or "KV head")."""
    count = "Hq" if unit == "query head" else "Hkv"
    if isinstance(value, torch.Tensor):
        if value.dim() != 1:
            raise ValueError(f"{name} given per head must be a 1-D tensor of {count} values, got shape "
                             f"{tuple(value.shape)}")
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} given per head must be a real tensor, got {value.dtype}")
        check_values(f"{name} given per head", value, why="each head's value is checked")
        items: list[object] = value.detach().cpu().tolist()  # a check before any launch
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise TypeError(f"{name} must be a number, or one number per {unit} (a list, tuple or "
                        f"1-D tensor), got {type(value).__name__}")
    if not items:
        raise ValueError(f"{name} given per head must not be empty")
    out: list[float | int] = []
    for h, item in enumerate(items):
        try:
            out.append(check(item))
        except TypeError as exc:
            raise TypeError(f"{name}[{h}] ({unit} {h}): {exc}") from None
        except ValueError as exc:
            raise ValueError(f"{name}[{h}] ({unit} {h}): {exc}") from None
    return out


def check_knob(name: str, value: object, check: Callable[[object], float | int], *,
               integer: bool = False) -> float | int | torch.Tensor:
    """Check a knob whose length cannot be checked yet (no tensor at hand: a method's
    parameter check): a scalar through `check`, a per-head value element by element.

    Args:
        name: the parameter's name (in every message).
        value: a scalar, or a list/tuple/1-D tensor of values.
        check: the knob's scalar check, `value -> normalised scalar` (raises TypeError or
            ValueError naming `name`).
        integer: whether the knob is an integer (the per-head tensor's dtype).

    Returns:
        The checked scalar, or a CPU tensor `[len]` (int64 if `integer`, else float64).

    Raises:
        TypeError, ValueError: naming `name` (and the head of a bad element).
    """
    if not is_per_head(value):
        return check(value)
    values = _per_head_values(name, value, check)
    if integer:
        return torch.tensor([min(v, KNOB_INT_CAP) for v in values], dtype=torch.int64)
    return torch.tensor(values, dtype=torch.float64)


def per_head(value: object, name: str, heads: int, check: Callable[[object], float | int], *,
             integer: bool = False, device: torch.device | str | None = None,
             unit: str = "query head") -> torch.Tensor:
    """A knob's value for every query head: the one normalisation all methods use.

    A scalar applies to every head; a per-head value (a list/tuple of `heads` numbers or
    a 1-D tensor of length `heads`) gives query head `h` its element `h`. Each element
    passes the knob's scalar `check`, so the two forms accept the same values. A tensor
    is read back once for the check (before any launch); a list is copied to `device`.

    Args:
        value: the knob as the caller gave it.
        name: the parameter's name (in every message).
        heads: Hq, the number of query heads.
        check: the knob's scalar check, `value -> normalised scalar`.
        integer: int64 values (counts, sizes) instead of float64; values past
            `KNOB_INT_CAP` (2**62) mean it.
        device: where the result lives (q's device).
        unit: what one element stands for, in the messages: "query head" (`heads` is Hq)
            or "KV head" (`heads` is Hkv, a knob that acts on the keys: `per_kv_head`).

    Returns:
        `[heads]` float64 (int64 if `integer`) on `device`.

    Raises:
        TypeError: a value that is not a number, a list/tuple of numbers or a real tensor.
        ValueError: the wrong length or rank, or an element `check` refuses.
    """
    dtype = torch.int64 if integer else torch.float64
    values = [check(value)] * heads if not is_per_head(value) else _per_head_values(name, value, check, unit=unit)
    if len(values) != heads:
        count = "Hq" if unit == "query head" else "Hkv"
        raise ValueError(f"{name} given per head must have one value per {unit} ({count}={heads}), "
                         f"got {len(values)}")
    if integer:
        values = [min(v, KNOB_INT_CAP) for v in values]
    if not is_per_head(value):
        return torch.full((heads,), values[0], dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, device=device)


def per_kv_head(value: object, name: str, heads: int, kv_heads: int, check: Callable[[object], float | int], *,
                device: torch.device | str | None = None) -> float | int | torch.Tensor:
    """A knob that acts on the keys (one value per KV head), given like every knob.

    Such a knob (Delta-KV's keep-mask threshold) changes which keys a KV head keeps, so
    the query heads of one KV group must share its value: a per-head value has one
    element per query head (Hq, the form of every other knob, so configs, custom ops
    and head-parallel slices carry it unchanged) whose elements are equal within each
    group of `heads // kv_heads` consecutive query heads. Elements pass `check` first
    (`per_head`'s messages), then the groups are compared.

    Returns:
        The checked scalar for a scalar; else float64 `[kv_heads]` on `device`, one value
        per KV head.

    Raises:
        TypeError, ValueError: as `per_head`; ValueError naming `name` and the KV head
        whose query heads differ.
    """
    if not is_per_head(value):
        return check(value)
    values = per_head(value, name, heads, check)
    group = heads // kv_heads
    grouped = values.view(kv_heads, group)
    differ = (grouped != grouped[:, :1]).any(dim=1)
    if bool(differ.any()):
        g = int(differ.nonzero()[0, 0])
        raise ValueError(f"{name} acts on the keys, so the query heads of a KV head share one value: "
                         f"query heads {g * group}..{(g + 1) * group - 1} (KV head {g}) got "
                         f"{grouped[g].tolist()}")
    return grouped[:, 0].contiguous().to(device)
