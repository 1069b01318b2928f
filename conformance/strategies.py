"""Hypothesis strategies for the conformance properties.

Everything here draws through a `draw` callable (Hypothesis's `data.draw`, or the
`draw` of an `st.composite`), so a property can draw a sequence length first and
then method parameters, block sizes and a shape that fit it. Tensor values are
not drawn element by element: a drawn seed feeds `torch.Generator`, which keeps
examples cheap and reproducible while Hypothesis still shrinks shapes and plans.

`Caps` bounds every draw: the GPU runner uses N up to 16K with a cap on the
reference's dense `[B, Hq, N, N]` masks; CPU tests under `TRITON_INTERPRET=1` use
N <= 200 and a cap on the number of kernel tile steps, since the interpreter costs
about 10 ms per tile step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from ..reference.plan import BlockColumnPlan, cdiv, mask_to_list
from .registry import MethodSpec

Draw = Callable[[st.SearchStrategy[Any]], Any]

DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (16, 32, 64, 96, 128)
PLAN_BLOCK_M = (16, 32, 64, 128, 256)
PLAN_BLOCK_N = (16, 32, 64, 128)

# Lengths around block edges (16 .. 256) and the classic awkward ones (63, 111).
_AWKWARD_SEQLENS = (1, 2, 15, 16, 17, 31, 33, 63, 64, 65, 111, 127, 128, 129, 191, 200,
                    255, 256, 257, 1000, 1023, 1025, 2047, 4097, 8191, 16383, 16384)


@dataclass(frozen=True)
class Caps:
    """Size limits for one run of the properties.

    Attributes:
        device: where tensors are made ("cuda", or "cpu" under the interpreter).
        max_seqlen: largest N drawn.
        max_head_dim: largest D drawn (from `HEAD_DIMS`).
        max_batch, max_kv_heads, max_group: largest B, Hkv and Hq / Hkv.
        max_mask_elements: cap on `B * Hq * N * N`, the size of the reference's
            dense masks (bool bytes); B and Hq shrink at long N to respect it.
        max_tile_steps: cap on the kernel's work per example in the interpreter,
            `B * Hq * interpreter_work(...)` (about 10 ms per unit); None: no cap.
    """

    device: str = "cpu"
    max_seqlen: int = 200
    max_head_dim: int = 128
    max_batch: int = 3
    max_kv_heads: int = 4
    max_group: int = 4
    max_mask_elements: int = 2**30
    max_tile_steps: int | None = None


@dataclass(frozen=True)
class Shape:
    """Sizes of one attention problem: `q: [B, Hq, N, D]`, `k, v: [B, Hkv, N, D]`."""

    batch: int
    kv_heads: int
    group: int
    seqlen: int
    head_dim: int

    @property
    def q_heads(self) -> int:
        return self.kv_heads * self.group

    def __str__(self) -> str:
        return (f"B={self.batch} Hq={self.q_heads} Hkv={self.kv_heads} N={self.seqlen} "
                f"D={self.head_dim}")


def kernel_tiles(block_m: int, block_n: int) -> tuple[int, int]:
    """The kernel's tile sizes for a plan's block sizes (they divide the blocks)."""
    return math.gcd(block_m, 128), math.gcd(block_n, 64)


def interpreter_work(seqlen: int, head_dim: int, tiles: tuple[int, int]) -> float:
    """Cost of one head of a full causal plan in the Triton interpreter, in tile steps.

    Measured on 2 CPU cores (triton 3.9): a program's setup and a small tile step
    cost about 10 ms each, and a step grows with its tile volume (fp16 tile matmuls
    run without BLAS there): 20 ms at 64x64x32, 115 ms at 128x64x128.
    """
    q_tiles = cdiv(seqlen, tiles[0])
    steps = q_tiles * (cdiv(seqlen, tiles[1]) + 1) / 2
    return q_tiles + steps * (1 + tiles[0] * tiles[1] * head_dim / 100_000)


def draw_seqlen(draw: Draw, caps: Caps) -> int:
    """N in [1, caps.max_seqlen], biased to short and awkward lengths.

    A third of draws are lengths at block edges (1, 63, 65, 111, 129, ...), half are
    short (<= 130), and one in ten ranges up to the cap, so long runs stay rare.
    """
    cap = caps.max_seqlen
    awkward = [n for n in _AWKWARD_SEQLENS if n <= cap] or [1]
    kind = draw(st.sampled_from(["short", "awkward", "short", "awkward", "short",
                                 "medium", "short", "awkward", "medium", "long"]))
    if kind == "awkward":
        return int(draw(st.sampled_from(awkward)))
    if kind == "short":
        return int(draw(st.integers(1, min(cap, 130))))
    if kind == "medium":
        return int(draw(st.integers(1, min(cap, 1024))))
    return int(draw(st.integers(1, cap)))


def draw_shape(
    draw: Draw,
    caps: Caps,
    *,
    seqlen: int | None = None,
    tiles: tuple[int, int] = (128, 64),
) -> Shape:
    """A shape within `caps`; B and Hq shrink when N is long or tiles are small.

    Args:
        draw: Hypothesis's draw.
        caps: the limits.
        seqlen: N, or None to draw one (`draw_seqlen`).
        tiles: the kernel tile sizes `(tile_m, tile_n)` the example will run with;
            used to honour `caps.max_tile_steps`.
    """
    n = draw_seqlen(draw, caps) if seqlen is None else seqlen
    dims = [d for d in HEAD_DIMS if d <= caps.max_head_dim] or [HEAD_DIMS[0]]
    d = int(draw(st.sampled_from(dims)))
    heads_budget = max(1, caps.max_mask_elements // (n * n))
    if caps.max_tile_steps is not None:
        per_head = max(1, int(interpreter_work(n, d, tiles)))
        heads_budget = min(heads_budget, max(1, caps.max_tile_steps // per_head))
    b = int(draw(st.integers(1, max(1, min(caps.max_batch, heads_budget)))))
    hkv = int(draw(st.integers(1, max(1, min(caps.max_kv_heads, heads_budget // b)))))
    g = int(draw(st.integers(1, max(1, min(caps.max_group, heads_budget // (b * hkv))))))
    return Shape(batch=b, kv_heads=hkv, group=g, seqlen=n, head_dim=d)


def draw_dtype(draw: Draw) -> torch.dtype:
    """fp16 or bf16 (the dtypes of `fast`)."""
    dtype: torch.dtype = draw(st.sampled_from(DTYPES))
    return dtype


def draw_scale(draw: Draw) -> float | None:
    """The softmax scale: mostly None (1/sqrt(D)), sometimes an explicit value."""
    scale: float | None = draw(st.sampled_from([None, None, None, 0.05, 0.3, 1.0]))
    return scale


def _layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """The values of contiguous `x: [B, H, N, D]` in a storage of another layout."""
    if layout == "bnhd":
        # What a model's projection gives: [B, N, H, D] viewed as [B, H, N, D].
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "padded_d":
        b, h, n, d = x.shape
        wide = torch.full((b, h, n, d + 8), math.nan, dtype=x.dtype, device=x.device)
        wide[..., :d] = x
        return wide[..., :d]
    return x


def draw_inputs(
    draw: Draw, shape: Shape, dtype: torch.dtype, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """Random `q, k, v` of `shape`, plus a short description for failure messages.

    Values are standard normal (q times a drawn magnitude, 0.5 to 4, so some
    softmaxes are peaked); layouts are contiguous, `[B, N, H, D]` transposed views,
    or views into a wider, NaN-filled head dimension.
    """
    seed = int(draw(st.integers(0, 2**31 - 1)))
    magnitude = float(draw(st.sampled_from([1.0, 0.5, 2.0, 4.0])))
    layout = str(draw(st.sampled_from(["contiguous", "bnhd", "contiguous", "padded_d"])))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    b, hq, hkv, n, d = shape.batch, shape.q_heads, shape.kv_heads, shape.seqlen, shape.head_dim
    q = (torch.randn(b, hq, n, d, generator=gen) * magnitude).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    q, k, v = (_layout(t.to(device), layout) for t in (q, k, v))
    what = f"{shape} {str(dtype).removeprefix('torch.')} seed={seed} |q|x{magnitude} {layout}"
    return q, k, v, what


def draw_block_sizes(draw: Draw) -> tuple[int, int]:
    """Plan block sizes, multiples of 16 (`PLAN_BLOCK_M`, `PLAN_BLOCK_N`)."""
    return int(draw(st.sampled_from(PLAN_BLOCK_M))), int(draw(st.sampled_from(PLAN_BLOCK_N)))


def _pack(
    count: torch.Tensor, index: torch.Tensor, *, extra: int, garbage: str, layout: str,
    gen: torch.Generator,
) -> torch.Tensor:
    """Re-store a compact list `[..., W]` with `extra` padding columns and garbage past counts."""
    width = index.shape[-1] + extra
    padded = torch.zeros(*index.shape[:-1], width, dtype=torch.int32)
    padded[..., : index.shape[-1]] = index
    pad = torch.arange(width) >= count.unsqueeze(-1)
    if garbage == "random":
        junk = torch.randint(-5, 2**20, padded.shape, generator=gen, dtype=torch.int32)
    elif garbage == "huge":
        junk = torch.full(padded.shape, 2**31 - 1, dtype=torch.int32)
    elif garbage == "negative":
        junk = torch.full(padded.shape, -1, dtype=torch.int32)
    else:
        junk = torch.zeros(padded.shape, dtype=torch.int32)
    padded = torch.where(pad, junk, padded)
    if layout == "strided" and width > 0:
        # Every other int32 of a wider buffer: the last stride is 2, not 1.
        wide = torch.zeros(*padded.shape[:-1], 2 * width, dtype=torch.int32)
        wide[..., ::2] = padded
        return wide[..., ::2]
    return padded


def draw_plan(
    draw: Draw,
    shape: Shape,
    *,
    block_m: int,
    block_n: int,
    device: str,
) -> tuple[BlockColumnPlan, str]:
    """A random valid `BlockColumnPlan` for `shape`, and a short description.

    Draws a density of key blocks (0 to 1), a density of extra columns (outside the
    listed blocks, or sometimes also inside them), some emptied query blocks, column
    lists shared by groups of query blocks (`column_group`), whether one list is
    shared by every batch row and head (stride-0 expanded views), the width of
    padding past the counts and its garbage (zeros, random, int32 max, -1), and
    strided index storage.
    """
    seed = int(draw(st.integers(0, 2**31 - 1)))
    p_block = float(draw(st.sampled_from([0.3, 1.0, 0.0, 0.05, 0.6])))
    p_col = float(draw(st.sampled_from([0.0, 0.02, 0.1, 0.0, 0.5])))
    p_empty = float(draw(st.sampled_from([0.0, 0.2, 0.0, 1.0])))
    shared = bool(draw(st.booleans()))
    extra = int(draw(st.sampled_from([0, 1, 3])))
    garbage = str(draw(st.sampled_from(["zero", "random", "huge", "negative"])))
    layout = str(draw(st.sampled_from(["contiguous", "strided"])))
    overlap = bool(draw(st.sampled_from([False, True, False])))
    group = int(draw(st.sampled_from([1, 1, 1, 2, 3, 1000])))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n = shape.seqlen
    qb, kb = cdiv(n, block_m), cdiv(n, block_n)
    lead = (1, 1) if shared else (shape.batch, shape.q_heads)
    blocks = torch.rand(*lead, qb, kb, generator=gen) < p_block
    columns = torch.rand(*lead, qb, n, generator=gen) < p_col
    empty = torch.rand(*lead, qb, 1, generator=gen) < p_empty
    blocks &= ~empty
    columns &= ~empty
    compact = BlockColumnPlan.from_masks(blocks, columns, seqlen=n, block_m=block_m, block_n=block_n)
    column_count, column_index = compact.column_count, compact.column_index
    list_count = column_count
    if overlap:
        # Keep the columns that fall inside listed blocks (invariant 4 allows them; the
        # kernel must skip them so no key counts twice).
        last_row = ((torch.arange(qb) + 1) * block_m - 1).clamp(max=n - 1)
        column_count, column_index = mask_to_list(columns & (torch.arange(n) <= last_row[:, None]))
        list_count = column_count
    if group > 1:
        # One sorted list per group of query blocks (plan invariant 6): each query block
        # reads the causal prefix of its group's list, which may repeat keys of its blocks.
        rows = cdiv(qb, group)
        last_row = ((torch.arange(qb) + 1) * block_m - 1).clamp(max=n - 1)
        group_last = last_row[torch.clamp((torch.arange(rows) + 1) * group - 1, max=qb - 1)]
        grouped = (torch.rand(*lead, rows, n, generator=gen) < p_col) & \
            (torch.arange(n) <= group_last[:, None])
        list_count, column_index = mask_to_list(grouped)
        owner = torch.arange(qb) // group
        listed = column_index[:, :, owner]
        valid = torch.arange(listed.shape[-1]) < list_count[:, :, owner].unsqueeze(-1)
        column_count = (valid & (listed <= last_row[:, None])).sum(dim=-1).to(torch.int32)
        column_count = torch.where(empty.squeeze(-1), 0, column_count)
    block_index = _pack(compact.block_count, compact.block_index, extra=extra, garbage=garbage,
                        layout=layout, gen=gen)
    column_index = _pack(list_count, column_index, extra=extra, garbage=garbage,
                         layout=layout, gen=gen)
    fields = [compact.block_count, block_index, column_count, column_index]
    fields = [t.to(device) for t in fields]
    if shared:
        full = (shape.batch, shape.q_heads)
        fields = [t.expand(*full, *t.shape[2:]) for t in fields]
    plan = BlockColumnPlan(seqlen=n, block_m=block_m, block_n=block_n, block_count=fields[0],
                           block_index=fields[1], column_count=fields[2], column_index=fields[3],
                           column_group=group)
    what = (f"plan {block_m}x{block_n} seed={seed} p_block={p_block} p_col={p_col} "
            f"p_empty={p_empty} overlap={overlap} group={group} shared={shared} pad+{extra} "
            f"{garbage} {layout}")
    return plan.validate(), what


def draw_mask(draw: Draw, shape: Shape, device: str) -> tuple[torch.Tensor, str]:
    """A random dense bool mask for `fast.attention(mask=...)`, and a description.

    Shapes `[N, N]`, `[B, Hq, N, N]` or `[1, Hq, N, N]` (broadcast over batch);
    densities from 0 (every row empty) to 1.
    """
    seed = int(draw(st.integers(0, 2**31 - 1)))
    density = float(draw(st.sampled_from([0.5, 0.1, 0.9, 0.0, 1.0])))
    form = str(draw(st.sampled_from(["full", "2d", "head"])))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n = shape.seqlen
    size = {"full": (shape.batch, shape.q_heads, n, n), "2d": (n, n),
            "head": (1, shape.q_heads, n, n)}[form]
    mask = (torch.rand(*size, generator=gen) < density).to(device)
    return mask, f"mask {form} density={density} seed={seed}"


def draw_method_params(draw: Draw, spec: MethodSpec, seqlen: int) -> dict[str, Any]:
    """Parameters of a registered method valid for N = `seqlen` (`spec.params`)."""
    return dict(spec.params(draw, seqlen))


def method_tiles(params: dict[str, Any]) -> tuple[int, int]:
    """Kernel tiles a method's parameters lead to (its defaults are 128 x 64)."""
    bm = params.get("block_m", params.get("block_size", 128))
    bn = params.get("block_n", params.get("block_size", 64))
    if isinstance(bm, int) and isinstance(bn, int) and bm % 16 == 0 and bn % 16 == 0:
        return kernel_tiles(bm, bn)
    return 16, 16


@st.composite
def shapes(draw: Draw, caps: Caps = Caps()) -> Shape:
    """Strategy form of `draw_shape`."""
    return draw_shape(draw, caps)


@st.composite
def plans(draw: Draw, shape: Shape, device: str = "cpu") -> BlockColumnPlan:
    """Strategy of random valid plans for `shape` (see `draw_plan`)."""
    bm, bn = draw_block_sizes(draw)
    return draw_plan(draw, shape, block_m=bm, block_n=bn, device=device)[0]
