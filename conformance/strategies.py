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

Draws aim at boundaries, not only at random: lengths one below and above block
multiples, head dims 16 to 256 (the kernel's tile changes above 128; the tile-step cap
keeps the costly ones short), plan blocks wider than the kernel's tile (`SUB_N > 1`),
columns inside listed blocks and at block edges, and structured inputs
(`INPUT_KINDS`): planted vertical and slash lines on the first and last row or column
of a block, small-integer "lattice" values whose scores tie exactly, and runs of
repeated keys whose distances sit exactly on a threshold. `draw_limits` lowers the
size limits at which the fast code changes path (key splits of the estimates, score
chunks, per-head planning, index chunks), and `draw_tiles` the kernel's tiles, so
N <= 200 reaches the paths that long inputs and wide plan blocks take.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from ..reference.plan import BlockColumnPlan, cdiv, mask_to_list
from .registry import MethodSpec

Draw = Callable[[st.SearchStrategy[Any]], Any]

DTYPES = (torch.float16, torch.bfloat16)
# 96 and 192 are not powers of two (the kernels pad and mask the head dim); above 128
# the block/column kernel takes 64 x 32 tiles (`fast.kernels.block_column._tile_config`).
HEAD_DIMS = (16, 32, 64, 96, 128, 192, 256)
PLAN_BLOCK_M = (16, 32, 64, 128, 256)
# 256 is wider than the kernel's key tile (128, or 32 above D = 128): SUB_N > 1.
PLAN_BLOCK_N = (16, 32, 64, 128, 256)

# Lengths around block edges (16 .. 256) and the classic awkward ones (63, 111).
_AWKWARD_SEQLENS = (1, 2, 15, 16, 17, 31, 32, 33, 47, 49, 63, 64, 65, 95, 97, 111, 127, 128,
                    129, 143, 145, 191, 192, 193, 200, 255, 256, 257, 1000, 1023, 1025, 2047,
                    4097, 8191, 16383, 16384)

# Structured inputs (see `draw_inputs`); the kinds a method cares most about are listed in
# its `MethodSpec.input_kinds`.
INPUT_KINDS = ("normal", "lines", "lattice", "runs", "shifted")


@dataclass(frozen=True)
class Caps:
    """Size limits for one run of the properties.

    Attributes:
        device: where tensors are made ("cuda", or "cpu" under the interpreter).
        max_seqlen: largest N drawn.
        max_head_dim: largest D drawn (from `HEAD_DIMS`); under `max_tile_steps`, only
            dims whose one-head cost fits are drawn (the smallest otherwise).
        max_batch, max_kv_heads, max_group: largest B, Hkv and Hq / Hkv.
        max_mask_elements: cap on `B * Hq * N * N`, the size of the reference's
            dense masks (bool bytes); B and Hq shrink at long N to respect it.
        max_tile_steps: cap on the kernel's work per example in the interpreter,
            `B * Hq * interpreter_work(...)` (about 10 ms per unit); None: no cap.
        scaled_limits: let `draw_limits` lower the fast code's size limits (see there).
    """

    device: str = "cpu"
    max_seqlen: int = 200
    max_head_dim: int = 256
    max_batch: int = 3
    max_kv_heads: int = 4
    max_group: int = 4
    max_mask_elements: int = 2**30
    max_tile_steps: int | None = None
    scaled_limits: bool = True


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


def kernel_tiles(block_m: int, block_n: int, head_dim: int = 64) -> tuple[int, int]:
    """The kernel's tile sizes for a plan's block sizes and head dim (they divide the blocks).

    The kernel's own choice (`_tile_config`), so the cost model cannot drift from it.
    """
    from ..fast.kernels.block_column import _tile_config

    tile_m, tile_n, _, _ = _tile_config(block_m, block_n, head_dim)
    return tile_m, tile_n


def interpreter_work(seqlen: int, head_dim: int, tiles: tuple[int, int]) -> float:
    """Cost of one head of a full causal plan in the Triton interpreter, in tile steps.

    Measured on 2 CPU cores (triton 3.9): a program's setup and a small tile step
    cost about 10 ms each, and a step grows with its tile volume (fp16 tile matmuls
    run without BLAS there): 20 ms at 64x64x32, 115 ms at 128x64x128.
    """
    q_tiles = cdiv(seqlen, tiles[0])
    steps = q_tiles * (cdiv(seqlen, tiles[1]) + 1) / 2
    padded = max(16, 1 << (head_dim - 1).bit_length())  # the kernel pads D to a power of two
    return q_tiles + steps * (1 + tiles[0] * tiles[1] * padded / 100_000)


def draw_seqlen(draw: Draw, caps: Caps) -> int:
    """N in [1, caps.max_seqlen], biased to short and awkward lengths.

    A third of draws are lengths at block edges (1, 63, 65, 111, 129, ...), half are
    short (<= 130), and one in ten ranges up to the cap, so long runs stay rare.
    """
    cap = caps.max_seqlen
    awkward = [n for n in _AWKWARD_SEQLENS if n <= cap] or [1]
    # Hypothesis's first example takes the first choice of every draw: an awkward length
    # past a block edge (129, or the longest under the cap), not N = 1.
    first = max((n for n in awkward if n <= 129), default=awkward[0])
    awkward = [first] + [n for n in awkward if n != first]
    kind = draw(st.sampled_from(["awkward", "short", "short", "awkward", "short",
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
    blocks: tuple[int, int] = (128, 128),
    tiles: tuple[int, int] | None = None,
    min_heads: int = 1,
) -> Shape:
    """A shape within `caps`; B and Hq shrink when N is long or tiles are small.

    Head dims are drawn from `HEAD_DIMS`, the common ones (64, 128) more often; under
    `caps.max_tile_steps` a dim whose one-head kernel work does not fit is not drawn.
    Where at least four heads fit, half the shapes are GQA with `Hkv >= 2` and `G >= 2`.

    Args:
        draw: Hypothesis's draw.
        caps: the limits.
        seqlen: N, or None to draw one (`draw_seqlen`).
        blocks: the plan block sizes `(block_m, block_n)` the example will run with
            (the kernel's tiles follow from them and D); used for `caps.max_tile_steps`.
        tiles: kernel tiles forced by `draw_tiles` (None: the kernel's own choice).
        min_heads: the fewest query heads, even past `caps.max_tile_steps`.
    """
    n = draw_seqlen(draw, caps) if seqlen is None else seqlen
    dims = [d for d in HEAD_DIMS if d <= caps.max_head_dim] or [HEAD_DIMS[0]]
    if caps.max_tile_steps is not None:
        dims = [d for d in dims if interpreter_work(n, d, tiles or kernel_tiles(*blocks, d))
                <= caps.max_tile_steps] or [dims[0]]
    weighted = dims + [d for d in (64, 128) if d in dims]
    d = int(draw(st.sampled_from(weighted)))
    heads_budget = max(1, caps.max_mask_elements // (n * n))
    if caps.max_tile_steps is not None:
        per_head = max(1, int(interpreter_work(n, d, tiles or kernel_tiles(*blocks, d))))
        heads_budget = min(heads_budget, max(1, caps.max_tile_steps // per_head))
    heads_budget = max(heads_budget, min_heads)
    # `not draw(booleans())`: Hypothesis's first (simplest) example is GQA with two batch rows.
    if heads_budget >= 4 and min(caps.max_kv_heads, caps.max_group) >= 2 and not draw(st.booleans()):
        # GQA first, half the time: two or more KV heads of two or more query heads each,
        # where a head map that is wrong only for h >= G (h % Hkv for h // G) shows.
        hkv = int(draw(st.integers(2, max(2, min(caps.max_kv_heads, heads_budget // 2)))))
        g = int(draw(st.integers(2, max(2, min(caps.max_group, heads_budget // hkv)))))
        b = int(draw(st.integers(1, max(1, min(caps.max_batch, heads_budget // (hkv * g))))))
        if b == 1 and 2 * hkv * g <= heads_budget and caps.max_batch >= 2 and not draw(st.booleans()):
            b = 2
        return Shape(batch=b, kv_heads=hkv, group=g, seqlen=n, head_dim=d)
    b = int(draw(st.integers(1, max(1, min(caps.max_batch, heads_budget)))))
    hkv = int(draw(st.integers(1, max(1, min(caps.max_kv_heads, heads_budget // b)))))
    g = int(draw(st.integers(1, max(1, min(caps.max_group, heads_budget // (b * hkv))))))
    if hkv * g < min_heads:
        g = -(-min_heads // hkv)
    if b == 1 and 2 * hkv * g <= heads_budget and min(caps.max_batch, 2) == 2 and not draw(st.booleans()):
        # A second batch row of other content where it still fits: code that reads batch
        # row 0's values (or strides) for every row shows only with two.
        b = 2
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


def block_edges(seqlen: int, sizes: Sequence[int]) -> list[int]:
    """Positions on block edges: the first and last index of every block of each size,
    and N - 1 (sorted, in `[0, N)`)."""
    out = {seqlen - 1}
    for size in sizes:
        if size <= 0:
            continue
        for start in range(0, seqlen, size):
            out.update((start, start + size - 1))
    return sorted(p for p in out if 0 <= p < seqlen)


def _pick(gen: torch.Generator, items: Sequence[int], count: int) -> list[int]:
    """Up to `count` distinct items, chosen with `gen`."""
    if not items or count <= 0:
        return []
    order = torch.randperm(len(items), generator=gen)[:count].tolist()
    return sorted(items[i] for i in order)


def _lines_inputs(
    gen: torch.Generator, shape: Shape, magnitude: float, edges: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """q, k (float32) with planted vertical and slash lines, mostly on block edges.

    Every query of a KV head's group shares a direction `u` and a per-position
    direction `w_r`; a vertical at key `c` adds a multiple of `u` to `k_c` (every later
    query attends to it), a slash at offset `o` adds `w_{j + o}` to `k_j` (query `r`
    attends to key `r - o`). Planted logits are about 5 above the noise's.
    """
    b, hkv, g, n, d = shape.batch, shape.kv_heads, shape.group, shape.seqlen, shape.head_dim
    root = math.sqrt(d)
    u = torch.randn(b, hkv, 1, 1, d, generator=gen)
    u = u / u.norm(dim=-1, keepdim=True).clamp(min=1e-6)
    w = torch.randn(b, hkv, 1, n, d, generator=gen) / root
    q = torch.randn(b, hkv, g, n, d, generator=gen) * 0.5 * magnitude + 2.0 * u + 2.0 * w
    k = torch.randn(b, hkv, n, d, generator=gen) * 0.5
    verticals = _pick(gen, list(edges), 3) + _pick(gen, list(range(n)), 1)
    for c in verticals:
        k[:, :, c] += 2.5 * root * u[:, :, 0, 0]
    offsets = sorted({o for o in _pick(gen, list(edges), 2) + _pick(gen, list(range(min(n, 4))), 1)})
    for o in offsets:
        k[:, :, : n - o] += 2.5 * root * w[:, :, 0, o:]
    return q.reshape(b, hkv * g, n, d), k, f"verticals {verticals} slashes {offsets}"


def _lattice(gen: torch.Generator, *size: int) -> torch.Tensor:
    """Values in {-1, -0.5, 0, 0.5, 1}: exact in fp16/bf16; their products sum exactly."""
    return (torch.randint(-2, 3, size, generator=gen) * 0.5).float()


def _lattice_inputs(gen: torch.Generator, shape: Shape, edges: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Lattice q and k with repeated keys and a repeated key block: exactly equal scores."""
    b, hq, hkv, n, d = shape.batch, shape.q_heads, shape.kv_heads, shape.seqlen, shape.head_dim
    q = _lattice(gen, b, hq, n, d)
    k = _lattice(gen, b, hkv, n, d)
    repeats = _pick(gen, [p for p in edges if p > 0], 3)
    for p in repeats:
        k[:, :, p] = k[:, :, p - 1]
    # A whole span copied onto a later one: equal pooled (block) scores.
    span = int(torch.randint(1, max(2, n // 4 + 1), (1,), generator=gen))
    if 2 * span <= n:
        k[:, :, n - span:] = k[:, :, :span]
    return q, k, f"repeats {repeats} span {span}"


def _runs_inputs(
    gen: torch.Generator, shape: Shape, magnitude: float, edges: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Keys in runs (Delta-KV's case): runs start at block edges (or one past), and in a
    run every key is the run's first key, or differs from it by exactly 0.5, 1 or 2 in
    one coordinate, or is its cosine-1/2 twin, so distances sit exactly on thresholds."""
    b, hq, hkv, n, d = shape.batch, shape.q_heads, shape.kv_heads, shape.seqlen, shape.head_dim
    q = torch.randn(b, hq, n, d, generator=gen) * magnitude
    k = torch.randn(b, hkv, n, d, generator=gen)
    starts = sorted({0, *(p + int(torch.randint(0, 2, (1,), generator=gen)) for p in edges)} - {n})
    styles = []
    for i, s0 in enumerate(starts):
        s1 = starts[i + 1] if i + 1 < len(starts) else n
        style = int(torch.randint(0, 5, (1,), generator=gen))
        styles.append(style)
        if style == 0 or s1 - s0 < 2:
            continue  # independent random keys
        if style == 4 and d >= 4:
            # Anchor c * e_i and keys c * (e_i + e_a + e_b + e_c): cosine exactly 1/2.
            dims = torch.randperm(d, generator=gen)[:4]
            base = torch.zeros(d)
            base[dims[0]] = 1.0
            twin = torch.zeros(d)
            twin[dims] = 1.0
            k[:, :, s0] = base
            k[:, :, s0 + 1:s1] = torch.where(torch.rand(s1 - s0 - 1, 1, generator=gen) < 0.7, twin, base)
            continue
        base = _lattice(gen, b, hkv, 1, d)[:, :, 0]
        k[:, :, s0:s1] = base.unsqueeze(2)
        if style in (2, 3):
            # Each member its own step, so every exact Euclidean threshold (0.5, 1, 2)
            # meets a key exactly at it in most runs, whatever the run's length.
            for t in range(s0 + 1, s1):
                if style == 3 or bool(torch.rand(1, generator=gen) < 0.5):
                    step = (0.5, 1.0, 2.0)[int(torch.randint(0, 3, (1,), generator=gen))]
                    k[:, :, t, int(torch.randint(0, d, (1,), generator=gen))] += step
    return q, k, f"runs at {starts[:8]}{'...' if len(starts) > 8 else ''} styles {styles[:8]}"


def _shifted_inputs(gen: torch.Generator, shape: Shape, magnitude: float) -> tuple[torch.Tensor, torch.Tensor, str]:
    """q and k sharing one direction: every scaled logit is about +4 (or -4) plus noise, so
    means and sums of logits (block means, lse) are far from 0 and a miscounted pair or
    a dropped max shows."""
    b, hq, hkv, n, d = shape.batch, shape.q_heads, shape.kv_heads, shape.seqlen, shape.head_dim
    u = torch.randn(d, generator=gen)
    u = u / u.norm().clamp(min=1e-6)
    sign = 1.0 if bool(torch.rand(1, generator=gen) < 0.7) else -1.0
    c = 2.0 * d ** 0.25  # (c u) . (c u) / sqrt(d) = 4
    q = torch.randn(b, hq, n, d, generator=gen) * 0.5 * magnitude + sign * c * u
    k = torch.randn(b, hkv, n, d, generator=gen) * 0.5 + c * u
    return q, k, f"shift {sign * 4:+.0f}"


def _late_peaks(gen: torch.Generator, q: torch.Tensor, k: torch.Tensor, group: int,
                edges: Sequence[int]) -> str:
    """Add, in place, logits that raise a row's running max late in its key order: a
    moderate vertical early, a strong one on a late block edge (every later row meets its
    largest logit only in a late key tile), and half the time each row's own key strongest
    of all (its max changes at the diagonal, the last tile it reads). Online-softmax code
    that forgets to rescale what it summed before then errs by a factor `exp(gap)`.

    Args:
        q: float32 `[B, Hq, N, D]`, k: float32 `[B, Hkv, N, D]` (changed in place).
        group: query heads per KV head. edges: block-edge positions (`block_edges`).
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    root = math.sqrt(d)
    u = torch.randn(b, hkv, 1, d, generator=gen)
    u = u / u.norm(dim=-1, keepdim=True).clamp(min=1e-6)
    # Every query of a KV head's group leans on u, so a key along u is a peak for all of them.
    q.view(b, hkv, group, n, d).add_(3.0 * u.unsqueeze(2))
    early = int(torch.randint(0, max(1, n // 4), (1,), generator=gen))
    late_edges = [p for p in edges if p >= n // 2] or [n - 1]
    late = late_edges[int(torch.randint(0, len(late_edges), (1,), generator=gen))]
    # Scaled logits about 4.5 (early) and 9 (late) above the noise's 0 +- 1.
    k[:, :, early] += 1.5 * root * u[:, :, 0]
    k[:, :, late] += 3.0 * root * u[:, :, 0]
    diagonal = bool(torch.rand(1, generator=gen) < 0.5)
    if diagonal:
        # q_r . k_r about 8 more for every row r: a row's own key, its last, is a peak too.
        w = torch.randn(b, hkv, n, d, generator=gen) / root
        q.view(b, hkv, group, n, d).add_(2.0 * w.unsqueeze(2))
        k += 4.0 * root * w
    return f"late peaks (early {early}, late {late}, diagonal {diagonal})"


def draw_inputs(
    draw: Draw,
    shape: Shape,
    dtype: torch.dtype,
    device: str,
    *,
    kinds: Sequence[str] = ("normal",),
    blocks: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """Random `q, k, v` of `shape`, plus a short description for failure messages.

    Kinds (`INPUT_KINDS`; drawn from `kinds`, the first one most often):

    * "normal": standard normal values (q times a drawn magnitude, 0.5 to 4, so some
      softmaxes are peaked);
    * "lines": planted vertical lines and slashes, mostly on the edges of `blocks`
      (`_lines_inputs`);
    * "lattice": values in {-1, -0.5, 0, 0.5, 1} with repeated keys and a repeated
      span of keys: scores and pooled scores tie exactly;
    * "runs": runs of keys starting at block edges whose members sit exactly at a
      Euclidean distance of 0, 0.5, 1 or 2, or a cosine of 1/2, from the run's first key;
    * "shifted": q and k share a direction, every scaled logit about +-4 plus noise.

    A quarter of the "normal", "lines" and "shifted" draws also get late peaks
    (`_late_peaks`): logits that raise rows' running max late in their key order.

    Layouts are contiguous, `[B, N, H, D]` transposed views, or views into a wider,
    NaN-filled head dimension.

    Args:
        draw, shape, dtype, device: as the other draws.
        kinds: the kinds to draw from.
        blocks: block sizes whose edges the structured kinds aim at.
    """
    seed = int(draw(st.integers(0, 2**31 - 1)))
    magnitude = float(draw(st.sampled_from([1.0, 0.5, 2.0, 4.0])))
    layout = str(draw(st.sampled_from(["contiguous", "bnhd", "contiguous", "padded_d"])))
    kinds = list(kinds) or ["normal"]
    kind = str(draw(st.sampled_from([kinds[0], *kinds])))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    b, hq, hkv, n, d = shape.batch, shape.q_heads, shape.kv_heads, shape.seqlen, shape.head_dim
    edges = block_edges(n, blocks)
    detail = ""
    if kind == "lines":
        q, k, detail = _lines_inputs(gen, shape, magnitude, edges)
    elif kind == "lattice":
        q, k, detail = _lattice_inputs(gen, shape, edges)
    elif kind == "runs":
        q, k, detail = _runs_inputs(gen, shape, magnitude, edges)
    elif kind == "shifted":
        q, k, detail = _shifted_inputs(gen, shape, magnitude)
    else:
        q = torch.randn(b, hq, n, d, generator=gen) * magnitude
        k = torch.randn(b, hkv, n, d, generator=gen)
    if kind in ("normal", "lines", "shifted") and int(draw(st.integers(0, 3))) == 0:
        peaks = _late_peaks(gen, q, k, hq // hkv, edges)
        detail = f"{detail}; {peaks}" if detail else peaks
    v = torch.randn(b, hkv, n, d, generator=gen)
    q, k, v = (_layout(t.to(dtype).to(device), layout) for t in (q, k, v))
    what = (f"{shape} {str(dtype).removeprefix('torch.')} seed={seed} {kind}"
            f"{f' ({detail})' if detail else ''} |q|x{magnitude} {layout}")
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
    listed blocks, or sometimes also inside them), columns on block edges (the first
    and last key of key blocks, the last row of query blocks, N - 1), some emptied
    query blocks, column lists shared by groups of query blocks (`column_group`),
    whether one list is shared by every batch row and head (stride-0 expanded views),
    the width of padding past the counts and its garbage (zeros, random, int32 max,
    -1), strided index storage, and sometimes the plan's disjoint-column form
    (`with_disjoint_columns`, which the kernel reads without its column-in-block test).
    """
    seed = int(draw(st.integers(0, 2**31 - 1)))
    p_block = float(draw(st.sampled_from([0.3, 1.0, 0.0, 0.05, 0.6])))
    p_col = float(draw(st.sampled_from([0.0, 0.02, 0.1, 0.0, 0.5, 0.3])))
    p_empty = float(draw(st.sampled_from([0.0, 0.2, 0.0, 1.0])))
    shared = bool(draw(st.booleans()))
    extra = int(draw(st.sampled_from([0, 1, 3])))
    garbage = str(draw(st.sampled_from(["zero", "random", "huge", "negative"])))
    layout = str(draw(st.sampled_from(["contiguous", "strided"])))
    overlap = bool(draw(st.booleans()))
    if overlap:
        # Enough columns inside listed blocks that a block's columns straddle column tiles,
        # and listed blocks for them to fall in.
        p_col = max(p_col, float(draw(st.sampled_from([0.3, 0.5, 0.8]))))
        p_block = max(p_block, float(draw(st.sampled_from([0.3, 0.6, 1.0]))))
    group = int(draw(st.sampled_from([1, 1, 1, 2, 3, 1000])))
    edge_columns = bool(draw(st.booleans()))
    # The disjoint form drops the overlapping columns: drawn only for plans without them,
    # so half the plans keep columns inside listed blocks for the kernel's window test.
    disjoint = bool(draw(st.sampled_from([False, False, True]))) and not overlap
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n = shape.seqlen
    qb, kb = cdiv(n, block_m), cdiv(n, block_n)
    lead = (1, 1) if shared else (shape.batch, shape.q_heads)
    blocks = torch.rand(*lead, qb, kb, generator=gen) < p_block
    columns = torch.rand(*lead, qb, n, generator=gen) < p_col
    if edge_columns:
        edges = torch.tensor(block_edges(n, (block_m, block_n)), dtype=torch.int64)
        columns[..., edges] |= torch.rand(*lead, qb, len(edges), generator=gen) < 0.5
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
                           column_group=group).validate()
    if disjoint:
        plan = plan.with_disjoint_columns()
    what = (f"plan {block_m}x{block_n} seed={seed} p_block={p_block} p_col={p_col} "
            f"edge_columns={edge_columns} p_empty={p_empty} overlap={overlap} group={group} "
            f"shared={shared} pad+{extra} {garbage} {layout} disjoint={disjoint}")
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


def _knob_key(value: Any) -> Any:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)


def _grid_values(spec: MethodSpec, params: dict[str, Any], name: str, seqlen: int) -> list[Any]:
    """The values of one knob in the method's calibration grid (else its compare sweep) at
    `seqlen` that the method accepts beside `params`, in the type of the drawn value."""
    method = spec.method
    try:
        points = method.calibration_params(seqlen)
    except (TypeError, ValueError):
        return []
    out = []
    for point in points:
        value = point.get(name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        value = type(params[name])(value)
        try:
            method.check_params({**params, name: value})
        except (TypeError, ValueError):
            continue
        out.append(value)
    return out


def draw_per_head_knobs(draw: Draw, spec: MethodSpec, params: dict[str, Any], seqlen: int,
                        heads: int, kv_heads: int | None = None, *,
                        often: bool = False) -> tuple[dict[str, Any], str]:
    """Most of the time, give each of the method's per-head knobs (`Method.knobs`) one value
    per query head, as a list, a tuple or a float64/int64 tensor. A knob that acts on the
    keys (`Method.kv_knobs`) is drawn once per KV head (`kv_heads`, default `heads`) and
    repeated over the KV head's query heads.

    The values come from the method's own strategy (`spec.params`, redrawn), the drawn
    scalar among them (and, where the redraws all agree, the knob's values in the method's
    calibration grid or compare sweep: small examples' redraws often agree), in one of
    three spreads: each head its own redraw; the two
    extremes of the redraws alternating head by head (neighbours differ); or the
    extremes alternating by KV group (the query heads of one KV head agree, the groups
    differ). So code that reads one head's value for another (the first head's, the KV
    head's, another batch row's) meets values as different as the method allows.

    A head's value that the method refuses beside the other parameters (a Delta-KV
    threshold below 0 under the Euclidean metric) falls back to the drawn scalar.

    Three draws in four are per head (the newest code and the head-group paths read
    per-head values; a scalar is filled per head by the same code in most methods); with
    several knobs, each is made per head half the time (at least one), every one with `often`.

    Returns:
        (the parameters, a note for the failure message: the knobs made per head).
    """
    knobs = [name for name in spec.method.knobs if params.get(name) is not None]
    if not knobs or int(draw(st.integers(0, 3))) == 3:
        return params, ""
    out = dict(params)
    redraws = [spec.params(draw, seqlen) for _ in range(max(heads, 3))]
    spread = str(draw(st.sampled_from(["extremes", "groups", "each"])))
    group = max(1, heads // max(1, kv_heads or heads))
    chosen = [name for name in knobs if often or len(knobs) == 1 or draw(st.booleans())]
    if not chosen:  # at least one knob per head
        chosen = [knobs[int(draw(st.integers(0, len(knobs) - 1)))]]
    for name in knobs:
        if name not in chosen:
            continue
        units = kv_heads if kv_heads is not None and name in spec.method.kv_knobs else heads
        candidates = []
        for r in redraws:
            value = r.get(name)
            if value is None or isinstance(value, bool) or type(value) is not type(params[name]):
                continue
            try:
                spec.method.check_params({**params, name: value})
            except (TypeError, ValueError):
                continue
            candidates.append(value)
        candidates.append(params[name])
        if len(set(map(_knob_key, candidates))) < 2:
            # Redraws of small examples often agree: the method's own grid spreads the values.
            candidates += _grid_values(spec, params, name, seqlen)
        if spread == "each":
            values = [candidates[h % len(candidates)] for h in range(units)]
            values[draw(st.integers(0, units - 1))] = params[name]
        else:
            low, high = min(candidates), max(candidates)
            if spread == "extremes" or units != heads:
                values = [high if h % 2 else low for h in range(units)]
            else:
                values = [high if (h // group) % 2 else low for h in range(units)]
            if bool(draw(st.booleans())):
                values.reverse()
        values = [x for x in values for _ in range(heads // units)]
        form = draw(st.sampled_from(["list", "tuple", "tensor"]))
        if form == "tensor":
            dtype = torch.int64 if isinstance(params[name], int) else torch.float64
            out[name] = torch.tensor(values, dtype=dtype)
        else:
            out[name] = values if form == "list" else tuple(values)
    changed = {name: out[name] for name in knobs if out[name] is not params[name]}
    return out, (f" per-head ({spread}) {changed}" if changed else "")


def edge_seqlen(draw: Draw, caps: Caps, seqlen: int, sizes: Sequence[int]) -> int:
    """A third of the time, N moved to the nearest edge of one of `sizes` (the plan's block
    sizes): a multiple of it, one below or one above; a sixth of those is a single block
    (N = size or size - 1). Else `seqlen` unchanged. Parameters drawn for `seqlen` stay
    valid: counts past N mean "everything" in every method.
    """
    sizes = [int(x) for x in sizes if int(x) > 0]
    if not sizes or int(draw(st.integers(0, 2))) != 0:
        return seqlen
    size = int(draw(st.sampled_from(sizes)))
    blocks = 1 if int(draw(st.integers(0, 5))) == 5 else max(1, round(seqlen / size))
    shift = int(draw(st.sampled_from([-1, 0, 1])))
    return max(1, min(caps.max_seqlen, blocks * size + shift))


def method_blocks(params: dict[str, Any]) -> tuple[int, int]:
    """Plan block sizes a method's parameters lead to (128 x 128 when it names none)."""
    bm = params.get("block_m", params.get("block_size", 128))
    bn = params.get("block_n", params.get("block_size", 128))
    if isinstance(bm, int) and isinstance(bn, int) and bm % 16 == 0 and bn % 16 == 0:
        return bm, bn
    return 16, 16


def method_tiles(params: dict[str, Any], head_dim: int = 64) -> tuple[int, int]:
    """Kernel tiles a method's parameters lead to."""
    return kernel_tiles(*method_blocks(params), head_dim)


# Size limits at which the fast code changes path: (module, name, scaled-down values).
# Each is read when the function runs, so `draw_limits` can lower it for one example.
_LIMITS: tuple[tuple[str, str, tuple[Any, ...]], ...] = (
    # Keys per split of the vertical-slash lse pass (a multiple of its 64-key tile).
    ("sparseprefill.fast.kernels.last_q_estimate", "_SPLIT_KEYS", (64, 128)),
    # Slashes per vector step of the Alg. 4 index kernel (a power of two).
    ("sparseprefill.fast.kernels.vertical_slash_index", "_CHUNK", (16, 32)),
    # Columns per vector step of the disjoint-columns kernel (a power of two).
    ("sparseprefill.fast.kernels.own_columns", "_CHUNK", (16,)),
    # Keys per tile of AnchorAttention's stripe kernel (each tile finds its first group).
    ("sparseprefill.fast.kernels.anchor_stripes", "_BLOCK_K", (16, 32)),
    # Keys per split of SampleAttention's lse pass (a multiple of its 64-key tile).
    ("sparseprefill.fast.kernels.sampled_scores", "_SPLIT_KEYS", (64,)),
    # Key blocks per vector step of SampleAttention's merge-index kernel (a power of two).
    ("sparseprefill.fast.kernels.sample_index", "_CHUNK", (16,)),
    # Block-sparse pooled scores built a chunk of query blocks at a time.
    ("sparseprefill.fast.block_sparse", "_SCORE_BYTES", (1, 4096)),
    # Vertical-slash plans and runs heads in groups past this size (1: a head or a divisor
    # of G at a time; 1024: a few heads at a time at N <= 200).
    ("sparseprefill.fast.vertical_slash", "PLAN_BYTES", (1, 1024)),
    # AnchorAttention plans and runs heads in groups past this size (per-head theta sliced).
    ("sparseprefill.fast.anchor_attention", "PLAN_BYTES", (1, 1024)),
    # The vertical-slash index by key blocks (the band kernel) from this many key blocks.
    ("sparseprefill.fast.kernels.vertical_slash_index", "_BLOCKS_MIN_KB", (1,)),
    # XAttention scores heads in groups whose lse scratch fits this (1: a head at a time).
    ("sparseprefill.fast.kernels.xattention_score", "_SCRATCH_BYTES", (1,)),
    # XAttention's torch selection works a chunk of rows at a time.
    ("sparseprefill.fast.xattention", "_SELECT_ELEMENTS", (1,)),
    # On a GPU, rows longer than this take the torch selection instead of the kernel.
    ("sparseprefill.fast.kernels.tile_select", "MAX_KERNEL_TILES", (1,)),
    # DeltaXAttention ranks and builds its packed mask a chunk of rows / heads at a time.
    ("sparseprefill.fast.delta_xattention", "_RANK_ELEMENTS", (1,)),
    ("sparseprefill.fast.delta_xattention", "_MASK_ELEMENTS", (1,)),
    # DPXA's scoring halves its query tiles a program while the launch has fewer programs.
    ("sparseprefill.fast.kernels.delta_score", "MIN_PROGRAMS", (1 << 20,)),
    # DPXA's anchor-pair scoring in small chunks (TQ, BLOCK_M, BLOCK_K, key tiles, FLAT,
    # warps, stages), on the GPU and under the interpreter: at N <= 200 the real chunks
    # hold every anchor of a program at once, so the running maximum never rises between
    # chunks (its rescaling never runs) and no program splits a row's key range.
    ("sparseprefill.fast.kernels.delta_score", "SCORE_CONFIG",
     ((2, 16, 16, 2, False, 4, 1), (4, 16, 16, 1, True, 4, 1))),
    ("sparseprefill.fast.kernels.delta_score", "INTERPRETER_SCORE_CONFIG",
     ((2, 16, 16, 2, False, 4, 1), (4, 16, 16, 1, True, 4, 1))),
    # SampleAttention's row-tile table built on the device each call (the capture path).
    ("sparseprefill.fast.kernels.sampled_scores", "TILE_TABLE", ("device",)),
    # Delta-KV's packing chunk when the caller's chunks are not known.
    ("sparseprefill.fast.delta_kv", "_PACK_CHUNK", (16,)),
    # The block/column kernel's unmasked copy for whole column tiles before a query tile
    # (None: its rule, which N <= 200 rarely meets; True: always where it applies).
    ("sparseprefill.fast.kernels.block_column", "_COL_SPLIT", (True,)),
    # Plans keep shared (not disjoint) column lists past this size (the kernel tests them).
    ("sparseprefill.fast.kernels.own_columns", "DISJOINT_COLUMN_BYTES", (0,)),
    # The reference works a chunk of query rows at a time.
    ("sparseprefill.reference.attention", "_CHUNK_BYTES", (1, 1 << 16)),
)


def draw_tiles(draw: Draw, caps: Caps, block_m: int, block_n: int) -> tuple[int, int] | None:
    """Kernel tiles smaller than the kernel's own choice, half the time under `caps.scaled_limits`.

    At N <= 200 a plan block wider than the kernel's key tile (`SUB_N` > 1) is never
    fully before a query tile with the kernel's own tiles (128 keys up to D = 128), so
    its unmasked sub-tile loop would go unchecked; forced tiles of 16 or 32 keys (and
    16 to 64 rows) make plan blocks of 32 to 256 keys several tiles wide. Run the
    example inside `forced_tiles(tiles)`. None: the kernel's own tiles.
    """
    if not caps.scaled_limits or not draw(st.booleans()):
        return None
    widths = [t for t in (16, 32) if block_n % t == 0 and t < block_n]
    heights = [t for t in (16, 32, 64) if block_m % t == 0]
    if not widths or not heights:
        return None
    return int(draw(st.sampled_from(heights))), int(draw(st.sampled_from(widths)))


@contextmanager
def forced_tiles(tiles: tuple[int, int] | None) -> Iterator[None]:
    """Run the block/column kernel with `tiles` (its `SPARSEPREFILL_TILE` override, 4 warps,
    one stage) inside the context; None: unchanged."""
    import os

    if tiles is None:
        yield
        return
    saved = os.environ.get("SPARSEPREFILL_TILE")
    os.environ["SPARSEPREFILL_TILE"] = f"{tiles[0]},{tiles[1]},4,1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["SPARSEPREFILL_TILE"]
        else:
            os.environ["SPARSEPREFILL_TILE"] = saved


class _patched:
    """A reusable context manager that sets module attributes `(module, name, value)` inside
    it and restores them after (the draws of `draw_limits` and `draw_column_path`; a
    sequence of calls enters the same one once per call)."""

    def __init__(self, changes: Sequence[tuple[Any, str, Any]]) -> None:
        self.changes = list(changes)
        self.saved: list[list[tuple[Any, str, Any]]] = []

    def __enter__(self) -> None:
        self.saved.append([(module, name, getattr(module, name)) for module, name, _ in self.changes])
        for module, name, value in self.changes:
            setattr(module, name, value)

    def __exit__(self, *exc: object) -> None:
        for module, name, value in reversed(self.saved.pop()):
            setattr(module, name, value)


# Limits whose lowered value switches off a table kept between calls (a sequence of calls,
# which looks for what such tables get wrong, keeps them on).
_STATE_SWITCHES = {("sparseprefill.fast.kernels.sampled_scores", "TILE_TABLE")}
# Limits past which query heads are planned and run in groups: the code that slices
# per-head values (and the KV heads of a group) for each group.
_HEAD_GROUPS = {("sparseprefill.fast.vertical_slash", "PLAN_BYTES"),
                ("sparseprefill.fast.anchor_attention", "PLAN_BYTES"),
                ("sparseprefill.fast.kernels.xattention_score", "_SCRATCH_BYTES")}


def draw_limits(draw: Draw, caps: Caps, *, keep_state: bool = False,
                head_groups: bool = False) -> tuple[Any, str]:
    """A context manager that lowers some of the fast code's size limits, and a description.

    Long inputs take paths that N <= 200 never reaches with the real limits: several key
    splits in the vertical-slash estimate, several chunks of slashes in the index kernel,
    pooled block scores in chunks, vertical-slash plans built per group of heads, shared
    instead of disjoint columns, the reference's row chunks. Each limit keeps its real
    value in about half the examples and takes a small one otherwise (`_LIMITS`); with
    `caps.scaled_limits` False nothing changes. With `keep_state`, switches that turn off a
    table kept between calls are left on (`_STATE_SWITCHES`); with `head_groups` (the
    example gives its heads different knob values), heads always run in groups of one
    (`_HEAD_GROUPS`), so each group's slice of the per-head values is checked.
    """
    import importlib

    if not caps.scaled_limits:
        return _patched([]), ""
    changes = []
    for module_name, name, values in _LIMITS:
        if keep_state and (module_name, name) in _STATE_SWITCHES:
            continue
        grouped = head_groups and (module_name, name) in _HEAD_GROUPS
        # Grouped: the smallest limit, a head (or a divisor of G) a group, so every group
        # after the first reads its own slice of the per-head values.
        value = values[0] if grouped else draw(st.sampled_from([None, None, *values]))
        if value is not None:
            changes.append((importlib.import_module(module_name), name, value))
    what = " ".join(f"{m.__name__.rsplit('.', 1)[-1]}.{n}={v}" for m, n, v in changes)
    return _patched(changes), (f"limits {what}" if what else "")


def draw_column_path(draw: Draw, caps: Caps) -> tuple[Any, str]:
    """A context manager that picks how the block/column kernel reads a plan's columns, and
    a description.

    Three choices: covered columns (columns inside a listed block), half the time,
    left to the kernel's own column-in-block test instead of resolved at plan
    time (`own_columns.RESOLVE_COVERED`; in production only large shared lists take that
    path, so at N <= 200 it would run on few plans); else, half the time, the
    kernel's copy that runs whole column tiles before a query tile without masks
    (`block_column._COL_SPLIT`; its rule picks it only where query blocks list many
    columns, which N <= 200 rarely reaches); and column tiles of 16 keys (two times in
    three with the split, a third of the time otherwise)
    (`block_column._COL_TILE`, a tuning switch), so that the short column lists of small
    N still span several column tiles and the kernel's per-tile bookkeeping (the block
    list window, the covered test across a tile edge, the masked tail, the split between
    unmasked and masked tiles) runs at every edge. With `caps.scaled_limits` False nothing
    changes.
    """
    import importlib

    if not caps.scaled_limits:
        return _patched([]), ""
    in_kernel = bool(draw(st.booleans()))
    split = not in_kernel and bool(draw(st.booleans()))
    # The split copy's own edge (whole unmasked column tiles, then the masked tail) needs
    # column lists of several tiles: with the split, 16-key column tiles most of the time.
    col_tile = int(draw(st.sampled_from([16, 16, 0] if split else [0, 16, 0])))
    changes: list[tuple[Any, str, Any]] = []
    block_column = importlib.import_module("sparseprefill.fast.kernels.block_column")
    if in_kernel:
        changes.append((importlib.import_module("sparseprefill.fast.kernels.own_columns"),
                        "RESOLVE_COVERED", False))
    if split:
        changes.append((block_column, "_COL_SPLIT", True))
    if col_tile:
        changes.append((block_column, "_COL_TILE", col_tile))
    what = (" covered-in-kernel" if in_kernel else "") + (" col-split" if split else "") + \
        (f" col_tile={col_tile}" if col_tile else "")
    return _patched(changes), what.strip()


@st.composite
def shapes(draw: Draw, caps: Caps = Caps()) -> Shape:
    """Strategy form of `draw_shape`."""
    return draw_shape(draw, caps)


@st.composite
def plans(draw: Draw, shape: Shape, device: str = "cpu") -> BlockColumnPlan:
    """Strategy of random valid plans for `shape` (see `draw_plan`)."""
    bm, bn = draw_block_sizes(draw)
    return draw_plan(draw, shape, block_m=bm, block_n=bn, device=device)[0]
