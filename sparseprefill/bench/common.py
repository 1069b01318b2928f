"""What every benchmark suite shares: the row, the run's context, timing, baselines and plans.

A suite measures on the context's device. On a GPU every time is the median of
`triton.testing.do_bench` after warm-up and the baseline is cuDNN SDPA (causal, K/V
expanded to the query heads outside the timed region) in the same process; on a CPU
(tiny sizes under `TRITON_INTERPRET=1`, how the tests run every suite) times are the
wall clock of one call and the baseline is PyTorch's math SDPA, which each row says
(`Row.baseline`, `Row.timer`). The rows' ratios then check the arithmetic, not speed.

Every row carries: density, recall, the time split (estimate / plan / kernel), the
speedup over the baseline of the same run, and the ratio to the floor
`density x baseline` (what a kernel running at the dense kernel's rate on the kept
pairs alone would take). TFLOP/s counts `4 D` flops per kept causal pair.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

from ..methods import DENSE
from ..reference.plan import BlockColumnPlan, causal_pairs, cdiv, mask_to_list

CUDNN = "cuDNN SDPA"
CPU_BASELINE = "math SDPA (CPU: no cuDNN)"


@dataclass
class Row:
    """One measured row of a suite (None: not measured or not applicable).

    Attributes:
        method: the method or case measured (a method name, a plan name, a stage).
        impl: who ran it: "sparseprefill", the baseline ("cuDNN SDPA" on a GPU), "flash SDPA",
            "FlexAttention", a peer's name.
        seqlen: N.
        density: the share of causal score entries computed.
        recall_mean, recall_min: the attention mass kept per row (mean, min over rows and heads).
        ms: the row's time end to end (estimate + plan + kernel where it has them).
        estimate_ms: the estimate alone (scores), where the suite separates it.
        plan_ms: the method's `*_plan` call (estimate, selection and index).
        kernel_ms: the attention kernel on the plan.
        baseline_ms: the dense baseline of the same run (`baseline`).
        baseline: "cuDNN SDPA", or on a CPU "math SDPA (CPU: no cuDNN)".
        speedup_vs_cudnn: `baseline_ms / ms`.
        floor_ms: `density x baseline_ms`.
        vs_floor: `ms / floor_ms`; `kernel_vs_floor`: `kernel_ms / floor_ms`.
        tflops: `4 D x kept causal pairs / ms`.
        suite: the suite that made the row.
        timer: how times were taken ("do_bench median", "wall clock, one call").
        extra: the suite's own numbers (stage times, plan statistics, checks).
    """

    method: str
    impl: str
    seqlen: int
    density: float | None = None
    recall_mean: float | None = None
    recall_min: float | None = None
    ms: float = math.nan
    estimate_ms: float | None = None
    plan_ms: float | None = None
    kernel_ms: float | None = None
    baseline_ms: float | None = None
    baseline: str = CUDNN
    speedup_vs_cudnn: float | None = None
    floor_ms: float | None = None
    vs_floor: float | None = None
    kernel_vs_floor: float | None = None
    tflops: float | None = None
    suite: str = ""
    timer: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        """The row as JSON-ready values (NaN as None, tensors and other objects as text)."""
        return {key: _plain(val) for key, val in asdict(self).items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Row:
        """A row written by `as_json` (unknown keys are ignored, missing ones take defaults)."""
        names = {f.name for f in fields(cls)}
        kept: dict[str, Any] = {key: (math.nan if key == "ms" and val is None else val)
                                for key, val in data.items() if key in names}
        return cls(**kept)


def _plain(value: Any) -> Any:
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(key): _plain(val) for key, val in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(val) for val in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return _plain(value.item())
    return repr(value)


def ratio(num: float | None, den: float | None) -> float | None:
    """`num / den`, or None when either is missing, not finite, or `den` is 0."""
    if num is None or den is None or not math.isfinite(num) or not math.isfinite(den) or den == 0:
        return None
    return num / den


def bench_ms(fn: Callable[[], Any], *, warmup: int = 50, rep: int = 300) -> float:
    """Median milliseconds of `fn` on the GPU (`triton.testing.do_bench` after warm-up)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def wall_ms(fn: Callable[[], Any], *, calls: int = 1) -> float:
    """Median wall-clock milliseconds of `calls` calls of `fn` (synchronised on a GPU)."""
    times = []
    for _ in range(max(1, calls)):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


def log_stderr(line: str) -> None:
    """Print a progress line to stderr (the table goes to stdout)."""
    print(line, file=sys.stderr, flush=True)


@dataclass
class Context:
    """The run every suite measures in: device, shape, workload, timer and baselines.

    Attributes:
        device: cuda (times from `do_bench`, cuDNN baseline) or cpu (wall clock, math SDPA;
            kernels under `TRITON_INTERPRET=1`).
        batch, q_heads, kv_heads, head_dim, dtype: the inputs' shape
            (`q: [batch, q_heads, N, head_dim]`).
        workload: "synthetic" (`demo.synthetic_qkv`) or "calibrated" (`workload.calibrated_qkv`);
            `qkv`: a capture file instead (its layers as the batch).
        methods: the methods to run (None: every registered method).
        with_recall: measure recall (needs the attention of every row: costly at long N).
        flex: time FlexAttention on the same plans (GPU only).
        rep: milliseconds `do_bench` spends per measurement (warm-up a sixth of it).
        cpu_calls: calls per measurement on a CPU (the median is kept).
        log: where progress lines go.
        timer: replaces the clock (tests: one call, a fixed time); None: the device's clock.
    """

    device: torch.device = field(default_factory=lambda: torch.device("cuda"))
    batch: int = 1
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: torch.dtype = torch.bfloat16
    workload: str = "synthetic"
    qkv: str | None = None
    methods: tuple[str, ...] | None = None
    with_recall: bool = True
    flex: bool = True
    rep: int = 300
    cpu_calls: int = 1
    log: Callable[[str], None] = log_stderr
    timer: Callable[[Callable[[], Any]], float] | None = None
    suite: str = ""
    rank: int = 0
    _inputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False)
    _baselines: dict[int, Row] = field(default_factory=dict, repr=False)
    _flex: Any = field(default=None, repr=False)

    @property
    def on_gpu(self) -> bool:
        """True when kernels run on CUDA (real timings, a cuDNN baseline)."""
        return self.device.type == "cuda"

    @property
    def baseline_name(self) -> str:
        return CUDNN if self.on_gpu else CPU_BASELINE

    @property
    def timer_name(self) -> str:
        if self.timer is not None:
            return "given timer"
        return "do_bench median" if self.on_gpu else f"wall clock, median of {self.cpu_calls} call(s)"

    def time(self, fn: Callable[[], Any]) -> float:
        """Milliseconds of `fn` (see `timer_name`)."""
        if self.timer is not None:
            return float(self.timer(fn))
        if self.on_gpu:
            return bench_ms(fn, warmup=max(1, self.rep // 6), rep=self.rep)
        return wall_ms(fn, calls=self.cpu_calls)

    def method_names(self) -> list[str]:
        """The methods to run, in registration order (all registered when `methods` is None).

        Raises:
            ValueError: a name that is not registered.
        """
        from ..methods import get, methods

        if self.methods is None:
            return list(methods())
        return [get(name).name for name in self.methods]

    def shape(self, seqlen: int) -> Any:
        from ..demo import Shape

        return Shape(self.batch, self.q_heads, self.kv_heads, seqlen, self.head_dim, self.dtype)

    def inputs(self, seqlen: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of the selected workload at N (kept until another N is asked for)."""
        key = (seqlen, seed)
        if key not in self._inputs:
            self._inputs.clear()
            self.free()
            from ..workload import workload_qkv

            q, k, v = workload_qkv(self.shape(seqlen), device=self.device, workload=self.workload, qkv=self.qkv,
                                   seed=seed)
            self._inputs[key] = (q, k, v)
        q, k, v = self._inputs[key]
        return q, k, v

    def free(self) -> None:
        """Return cached GPU memory to the device (between rows)."""
        if self.on_gpu:
            torch.cuda.empty_cache()

    def causal_pairs(self, seqlen: int, heads: int | None = None, batch: int | None = None) -> float:
        """Causal (query, key) pairs of all heads at N."""
        return float((self.batch if batch is None else batch) * (self.q_heads if heads is None else heads)
                     * seqlen * (seqlen + 1) / 2)

    def dense_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        backend: str = "") -> Callable[[], torch.Tensor]:
        """The baseline call on q, k, v (K/V expanded to the query heads here, outside the timed
        region): cuDNN SDPA on a GPU (`backend="flash"`: flash SDPA), math SDPA on a CPU."""
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        g = q.shape[1] // k.shape[1]
        ke, ve = (k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)) if g > 1 else (k, v)
        if not self.on_gpu:
            chosen = SDPBackend.MATH
        else:
            chosen = SDPBackend.FLASH_ATTENTION if backend == "flash" else SDPBackend.CUDNN_ATTENTION

        def run() -> torch.Tensor:
            with sdpa_kernel(chosen):
                return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)

        return run

    def baseline(self, seqlen: int) -> Row:
        """The dense baseline at N on this run's inputs (measured once per N, then kept)."""
        if seqlen not in self._baselines:
            q, k, v = self.inputs(seqlen)
            ms = math.nan
            try:
                ms = self.time(self.dense_attention(q, k, v))
            except (RuntimeError, torch.OutOfMemoryError) as exc:
                self.log(f"N={seqlen}: {self.baseline_name} failed: {type(exc).__name__}: {str(exc)[:200]}")
            self.free()
            pairs = self.causal_pairs(seqlen, int(q.shape[1]), int(q.shape[0]))
            self._baselines[seqlen] = Row(
                DENSE, self.baseline_name, seqlen, density=1.0, recall_mean=1.0, recall_min=1.0, ms=ms,
                kernel_ms=ms, baseline_ms=ms, baseline=self.baseline_name, speedup_vs_cudnn=1.0, floor_ms=ms,
                vs_floor=1.0, tflops=ratio(4 * int(q.shape[3]) * pairs, ms * 1e9), suite=self.suite,
                timer=self.timer_name)
        return self._baselines[seqlen]

    def remember(self, row: Row) -> None:
        """Keep a baseline row read back from an earlier run (`--resume`) as this run's."""
        if row.impl in (CUDNN, CPU_BASELINE) and row.method == DENSE and row.seqlen not in self._baselines:
            self._baselines[row.seqlen] = row

    def row(self, method: str, impl: str, seqlen: int, *, ms: float, density: float | None = None,
            recall: torch.Tensor | None = None, recall_mean: float | None = None, recall_min: float | None = None,
            estimate_ms: float | None = None, plan_ms: float | None = None, kernel_ms: float | None = None,
            pairs: float | None = None, head_dim: int | None = None, baseline_ms: float | None = None,
            extra: dict[str, Any] | None = None) -> Row:
        """A row with the derived columns filled in from this run's baseline at N.

        Args:
            recall: float `[..., N]` kept mass per row (mean and min taken here), or give
                `recall_mean` / `recall_min`.
            pairs: causal pairs of the whole input (default: this context's shape at N).
            baseline_ms: the dense time to compare with (default: `baseline(seqlen).ms`).
        """
        if recall is not None:
            recall_mean, recall_min = float(recall.double().mean()), float(recall.min())
        base = self.baseline(seqlen).ms if baseline_ms is None else baseline_ms
        floor = None if density is None else density * base
        flops = None if density is None else 4 * (head_dim or self.head_dim) * density * (
            self.causal_pairs(seqlen) if pairs is None else pairs)
        return Row(method, impl, seqlen, density=density, recall_mean=recall_mean, recall_min=recall_min, ms=ms,
                   estimate_ms=estimate_ms, plan_ms=plan_ms, kernel_ms=kernel_ms, baseline_ms=base,
                   baseline=self.baseline_name, speedup_vs_cudnn=ratio(base, ms), floor_ms=floor,
                   vs_floor=ratio(ms, floor), kernel_vs_floor=ratio(kernel_ms, floor),
                   tflops=ratio(flops, None if flops is None else ms * 1e9), suite=self.suite, timer=self.timer_name,
                   extra=dict(extra or {}))

    def recall(self, q: torch.Tensor, k: torch.Tensor, plan: BlockColumnPlan,
               scale: float | None = None) -> torch.Tensor | None:
        """The plan's recall per row, or None when the run skips recall."""
        if not self.with_recall:
            return None
        from .. import fast

        out: torch.Tensor = fast.recall(q, k, plan, scale=scale)
        return out

    def flex_fn(self) -> Any:
        """`torch.compile(flex_attention)`, or None (no CUDA, `--no-flex`, or it failed to build)."""
        if not (self.flex and self.on_gpu):
            return None
        if self._flex is None:
            try:
                from torch.nn.attention.flex_attention import flex_attention

                self._flex = torch.compile(flex_attention, dynamic=False)
            except Exception as exc:  # noqa: BLE001 - depends on the torch build: report and go on
                self.log(f"FlexAttention unavailable: {type(exc).__name__}: {exc}")
                self.flex = False
                return None
        return self._flex


@dataclass(frozen=True)
class Unit:
    """One resumable piece of a suite: the rows of one case at one N.

    Attributes:
        key: unique within the suite ("N/case"); `--resume` skips a key already written.
        seqlen: N (progress lines show it).
        run: measures and returns the rows.
    """

    key: str
    seqlen: int
    run: Callable[[], list[Row]]


@dataclass(frozen=True)
class Option:
    """A command-line option of a suite (`sparseprefill bench SUITE --flag VALUE`).

    Attributes:
        flag: e.g. "--theta"; suites that share a flag share its meaning (its first help).
        dest: the keyword the suite's `units` takes.
        type: int, float or str (the parser's type).
        default: the value when not given (None: the suite picks one per N or device).
        help: one line.
    """

    flag: str
    dest: str
    type: Callable[[str], Any]
    default: Any
    help: str


@dataclass(frozen=True)
class Suite:
    """A benchmark suite: named, with its default lengths, options and resumable units.

    Attributes:
        name: `sparseprefill bench NAME`.
        about: what it measures, one line (`--help`).
        seqlens: the default N on a GPU.
        units: `(ctx, seqlens, **options) -> [Unit, ...]`, built before anything runs (so
            progress can count them); each unit measures when run.
        options: its own command-line options.
        summary: `rows -> text` printed after the table, or None.
        prepare: `(ctx, options) -> None` before the units are built (a process group), or None.
    """

    name: str
    about: str
    seqlens: tuple[int, ...]
    units: Callable[..., list[Unit]]
    options: tuple[Option, ...] = ()
    summary: Callable[[list[Row]], str] | None = None
    prepare: Callable[[Context, dict[str, Any]], None] | None = None


def piece(ctx: Context, label: str, seqlen: int, fn: Callable[..., list[Row]], *args: Any, **kwargs: Any) -> Unit:
    """The unit `N/label` whose rows are `fn(*args, **kwargs)` (a failure is one row naming it: `guarded`)."""
    return Unit(f"{seqlen}/{label}", seqlen, functools.partial(guarded, ctx, label, seqlen,
                                                              functools.partial(fn, *args, **kwargs)))


# The block or tile size option several suites share.
BLOCK = Option("--block", "block", int, None, "block or tile size (default 128 on a GPU, smaller on cpu)")


def baseline_unit(ctx: Context, seqlen: int) -> Unit:
    """The dense baseline's row at N as a unit (first of every N)."""
    return Unit(f"{seqlen}/{ctx.baseline_name}", seqlen, lambda: [ctx.baseline(seqlen)])


def guarded(ctx: Context, label: str, seqlen: int, fn: Callable[[], list[Row]]) -> list[Row]:
    """`fn()`'s rows, or one row saying why it failed (the run goes on to the next case)."""
    try:
        return fn()
    except (RuntimeError, ValueError, TypeError, MemoryError, NotImplementedError) as exc:
        message = f"{type(exc).__name__}: {str(exc)[:300]}"
        ctx.log(f"N={seqlen} {label}: {message}")
        return [Row(label, "sparseprefill", seqlen, suite=ctx.suite, timer=ctx.timer_name,
                    extra={"error": message})]
    finally:
        ctx.free()


def method_hook(method: str, name: str) -> Any:
    """The attribute `name` of a method's own suite module (`sparseprefill/bench/suites/<method>.py`),
    or None when the method has no such module or the module no such attribute: how a shared
    suite finds what one method adds to it (an estimate's floor), without a table of methods."""
    import importlib
    import importlib.util

    module = f"{__package__}.suites.{method}"
    if importlib.util.find_spec(module) is None:
        return None
    return getattr(importlib.import_module(module), name, None)


def params_text(params: dict[str, Any]) -> dict[str, str]:
    """Parameters as short text for a row's `extra` (tensors and configs as their repr)."""
    return {key: repr(val) for key, val in params.items()}


# -- plans ----------------------------------------------------------------------------------


def random_block_plan(
    batch: int, heads: int, seqlen: int, *, density: float, block_m: int, block_n: int,
    device: torch.device | str, seed: int = 0,
) -> BlockColumnPlan:
    """A plan keeping each causal key block with probability ~`density` (diagonal kept).

    Blocks are drawn independently per (batch, head, query block); the diagonal block
    is always kept so that no row is empty. No columns.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    qb, kb = cdiv(seqlen, block_m), cdiv(seqlen, block_n)
    last_row = ((torch.arange(qb) + 1) * block_m - 1).clamp(max=seqlen - 1)
    causal_count = last_row // block_n + 1
    keys = torch.rand(batch, heads, qb, kb, generator=gen) < density
    diag = torch.arange(kb)[None, :] == (last_row // block_n)[:, None]
    keys = (keys | diag) & (torch.arange(kb)[None, :] < causal_count[:, None])
    count, index = mask_to_list(keys)
    zero_cols = torch.zeros(batch, heads, qb, dtype=torch.int32)
    return BlockColumnPlan(
        seqlen=seqlen, block_m=block_m, block_n=block_n,
        block_count=count.to(device),
        block_index=index.to(device),
        column_count=zero_cols.to(device),
        column_index=torch.zeros(batch, heads, qb, 0, dtype=torch.int32, device=device),
    )


def column_plan(q: torch.Tensor, *, key_share: float = 0.02, block_share: float = 0.08,
                block: int = 64, seed: int = 0) -> BlockColumnPlan:
    """A random plan whose kept area is about 20% columns: each causal block kept with
    probability `block_share` (the diagonal always), plus `key_share * N` random causal key
    columns per query block (lists that may repeat a listed block's keys)."""
    b, h, n = q.shape[0], q.shape[1], q.shape[2]
    dev = q.device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    qb = cdiv(n, block)
    last = ((torch.arange(qb) + 1) * block - 1).clamp(max=n - 1)
    kb = torch.arange(qb)
    keep = torch.rand(b, h, qb, qb, generator=gen) < block_share
    keep = (keep | (kb[None, :] == kb[:, None])) & (kb[None, :] <= kb[:, None])
    count, index = mask_to_list(keep)
    width = max(1, int(key_share * n))
    cols = torch.sort(torch.randint(0, n, (b, h, qb, width), generator=gen), dim=-1).values
    dup = torch.zeros_like(cols, dtype=torch.bool)
    dup[..., 1:] = cols[..., 1:] == cols[..., :-1]
    cols = torch.sort(torch.where(dup | (cols > last[None, None, :, None]), n, cols), dim=-1).values
    ccount = (cols < n).sum(-1).to(torch.int32)
    plan = BlockColumnPlan(seqlen=n, block_m=block, block_n=block, block_count=count.to(dev),
                           block_index=index.to(dev), column_count=ccount.to(dev),
                           column_index=cols.clamp(max=n - 1).to(torch.int32).to(dev))
    return plan.validate()


def block_plan_like(plan: BlockColumnPlan, density: float, *, seed: int = 1) -> BlockColumnPlan:
    """A random causal block plan with `plan`'s block sizes and about `density` of the causal
    pairs (every diagonal block, each other causal block with one probability): what the block
    path alone does on the same area (the twin of a plan with columns)."""
    b, h, n, bm, bn = plan.batch, plan.num_heads, plan.seqlen, plan.block_m, plan.block_n
    qb, kb, dev = plan.num_query_blocks, plan.num_key_blocks, plan.device
    gen = torch.Generator(device="cpu").manual_seed(seed)
    first = torch.arange(kb) * bn
    last = plan.last_rows().cpu()
    r0 = (torch.arange(qb) * bm)[:, None]
    pairs = causal_pairs(r0, last[:, None] + 1, first[None, :], (first + bn).clamp(max=n)[None, :]).double()
    causal = pairs > 0
    diag = causal & (first[None, :] + bn - 1 >= r0)
    share = (density * pairs.sum() - pairs[diag].sum()).clamp(min=0) / pairs[causal & ~diag].sum().clamp(min=1)
    keep = ((torch.rand(b, h, qb, kb, generator=gen) < share) & causal) | diag
    count, index = mask_to_list(keep)
    return BlockColumnPlan(seqlen=n, block_m=bm, block_n=bn, block_count=count.to(dev), block_index=index.to(dev),
                           column_count=torch.zeros_like(count).to(dev),
                           column_index=torch.zeros(b, h, qb, 0, dtype=torch.int32, device=dev),
                           columns_disjoint=True).validate()


def minference_anchor_lines(
    batch: int, heads: int, seqlen: int, *, vertical_size: int = 1000, slash_size: int = 6096,
    device: torch.device | str, seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lines of ANCHORS.md's MInference measurement: the first 30 columns plus
    random ones (`vertical_size` in all) and the `slash_size` nearest diagonals.

    Returns:
        (verticals, slashes) int32 `[B, H, count]`, sorted ascending.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    nv = min(vertical_size, seqlen)
    forced = min(30, nv)
    rest = torch.rand(batch, heads, max(seqlen - forced, 0), generator=gen).argsort(-1)[..., : nv - forced]
    verticals = torch.cat([torch.arange(forced).expand(batch, heads, forced), rest + forced], -1)
    slashes = torch.arange(min(slash_size, seqlen)).expand(batch, heads, -1)
    return (verticals.sort(-1).values.to(torch.int32).to(device),
            slashes.to(torch.int32).contiguous().to(device))


def minference_lines_plan(q: torch.Tensor, *, vertical_size: int = 1000, slash_size: int = 6096,
                          block: int = 64) -> BlockColumnPlan:
    """The plan of `minference_anchor_lines` (64 x 64 blocks, columns disjoint where they fit),
    as `fast.vertical_slash_plan` builds it from lines."""
    from ..fast.kernels.vertical_slash_index import vertical_slash_index
    from ..fast.vertical_slash import with_own_columns

    n = int(q.shape[2])
    verticals, slashes = minference_anchor_lines(int(q.shape[0]), int(q.shape[1]), n, vertical_size=vertical_size,
                                                 slash_size=slash_size, device=q.device)
    return with_own_columns(vertical_slash_index(verticals, slashes, seqlen=n, block_m=block, block_n=block))


def named_plan(name: str, q: torch.Tensor, k: torch.Tensor, *, block: int = 128) -> BlockColumnPlan:
    """A plan by name, for the suites that time kernels on given plans.

    Names: `dense`; `randomP` (random causal blocks, P percent, `block` square);
    `columns20` (about 20% of the kept area in columns, 64-blocks); `minference-lines`
    (ANCHORS.md's MInference lines); a registered method's name (its `fast` plan at its
    defaults for N); `METHOD:key=value,...` (those parameters over the defaults);
    `blocks-like:NAME` (a block-only plan with NAME's block sizes and density). `dense` is
    the registered dense method's plan.

    Raises:
        ValueError: an unknown name, or a method without a plan.
    """
    from .. import fast
    from ..methods import get

    n = int(q.shape[2])
    if name.startswith("blocks-like:"):
        inner = named_plan(name.split(":", 1)[1], q, k, block=block)
        return block_plan_like(inner, float(fast.density(inner).mean()))
    if name.startswith("random") and name[6:].isdigit():
        return random_block_plan(int(q.shape[0]), int(q.shape[1]), n, density=int(name[6:]) / 100,
                                 block_m=block, block_n=block, device=q.device, seed=int(name[6:]))
    if name == "columns20":
        return column_plan(q, block=min(64, block))
    if name == "minference-lines":
        return minference_lines_plan(q, block=min(64, block))
    method_name, _, given = name.partition(":")
    spec = get(method_name)
    if not spec.plan_based:
        raise ValueError(f"{method_name} makes no plan (its attention reads packed keys); time it end to end")
    params = spec.demo_params(n)
    for item in filter(None, given.split(",")):
        key, _, text = item.partition("=")
        params[key] = parse_value(text)
    return spec.plan_fn("fast")(q, k, **spec.call_params(params, q))


def parse_value(text: str) -> Any:
    """"12" -> 12, "0.9" -> 0.9, "true"/"false" -> bool, anything else stays text."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def plan_stats(plan: BlockColumnPlan) -> dict[str, float]:
    """What a plan costs the kernel: column capacity `C`, mean columns per query block, and
    `tile_share`, the kept pairs over the pairs the kernel's tiles compute (a listed block
    counts `block_m x block_n`, a listed column `block_m`)."""
    from .. import fast

    heads = plan.batch * plan.num_heads
    n = plan.seqlen
    blocks = float(plan.block_count.double().sum())
    cap = int(plan.column_index.shape[3])
    cols = float(plan.column_count.double().sum()) if cap else 0.0
    computed = (blocks * plan.block_m * plan.block_n + cols * plan.block_m) / (heads * n * (n + 1) / 2)
    dens = float(fast.density(plan).mean())
    return {"C": cap, "block_m": plan.block_m, "block_n": plan.block_n,
            "mean_columns": float(plan.column_count.double().mean()) if cap else 0.0,
            "tile_share": dens / computed if computed else math.nan, "plan_mb": plan.nbytes() / 2**20}


def flex_block_mask(plan: BlockColumnPlan) -> Any:
    """The same plan as a FlexAttention `BlockMask`, as a careful Flex user would write it.

    Blocks entirely below the diagonal go in the "full" lists (no mask_mod call), the
    rest in the partial lists with a causal mask_mod. Columns have no Flex form, so a
    plan with columns is expressed as a per-head set of key columns (the union of its
    column lists: exact for vertical-slash plans, whose columns are one vertical set
    minus the keys its blocks already cover): every key block holding such a column
    becomes a partial block whose mask_mod looks the column up.
    """
    from torch.nn.attention.flex_attention import BlockMask

    bm, bn, n = plan.block_m, plan.block_n, plan.seqlen
    qb, kb = plan.num_query_blocks, plan.num_key_blocks
    b, h = plan.batch, plan.num_heads
    dev = plan.device
    keep = plan.block_mask()
    first_row = (torch.arange(qb, device=dev) * bm).view(qb, 1)
    last_row = ((torch.arange(qb, device=dev) + 1) * bm - 1).clamp(max=n - 1).view(qb, 1)
    key_first = (torch.arange(kb, device=dev) * bn)[None, :]
    key_last = key_first + bn - 1
    below = (key_last <= first_row) & (key_last < n)
    is_full = keep & below
    is_part = keep & ~below
    vertical = torch.zeros(b, h, n + 1, dtype=torch.bool, device=dev)
    has_columns = plan.column_index.shape[3] > 0
    if has_columns:
        width = plan.column_index.shape[3]
        valid = torch.arange(width, device=dev) < plan.column_count.unsqueeze(-1)
        cols = torch.where(valid, plan.query_block_columns().to(torch.int64), n).reshape(b, h, -1)
        vertical.scatter_(2, cols, True)
        vblocks = torch.zeros(b, h, kb + 1, dtype=torch.bool, device=dev)
        vblocks.scatter_(2, torch.where(cols < n, cols // bn, kb), True)
        causal_blocks = key_first <= last_row
        is_part = is_part | (vblocks[:, :, None, :kb] & causal_blocks & ~is_full)
    vertical = vertical[..., :n]
    block_keep = keep

    def compact(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # As create_block_mask does: every row a permutation of the key blocks, kept first.
        order = torch.sort((~sel).to(torch.int8), dim=-1, stable=True).indices
        return sel.sum(-1).to(torch.int32), order.to(torch.int32).contiguous()

    pc, pi = compact(is_part)
    fc, fi = compact(is_full)

    if has_columns:
        def mask_mod(bi: Any, hi: Any, q_idx: Any, kv_idx: Any) -> Any:
            listed = block_keep[bi, hi, q_idx // bm, kv_idx // bn] | vertical[bi, hi, kv_idx]
            return (q_idx >= kv_idx) & listed
    else:
        def mask_mod(bi: Any, hi: Any, q_idx: Any, kv_idx: Any) -> Any:
            return q_idx >= kv_idx

    return BlockMask.from_kv_blocks(pc, pi, fc, fi, BLOCK_SIZE=(bm, bn), mask_mod=mask_mod,
                                    seq_lengths=(n, n))


def flex_row(ctx: Context, label: str, plan: BlockColumnPlan, q: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor, ours: torch.Tensor, *, recall: torch.Tensor | None = None) -> list[Row]:
    """FlexAttention on `plan` (kernel only), with its output's difference from ours; [] when
    Flex is off or unavailable; one row naming the error when it fails."""
    from .. import fast

    flex_fn = ctx.flex_fn()
    if flex_fn is None:
        return []
    n = int(q.shape[2])
    dens = float(fast.density(plan).mean())
    try:
        bmask = flex_block_mask(plan)
        # Flex's tiles must divide the mask's blocks (its default tiles are 128 wide).
        opts = {"BLOCK_M": min(128, plan.block_m), "BLOCK_N": min(128, plan.block_n)}
        out = flex_fn(q, k, v, block_mask=bmask, enable_gqa=True, kernel_options=opts)
        diff = float((out.float() - ours.float()).norm() / ours.float().norm())
        ms = ctx.time(lambda: flex_fn(q, k, v, block_mask=bmask, enable_gqa=True, kernel_options=opts))
    except Exception as exc:  # noqa: BLE001 - a Flex failure is reported, not fatal
        message = f"{type(exc).__name__}: {str(exc)[:300]}"
        ctx.log(f"N={n} FlexAttention failed for {label}: {message}")
        return [Row(label, "FlexAttention", n, density=dens, suite=ctx.suite, extra={"error": message})]
    return [ctx.row(label, "FlexAttention", n, ms=ms, kernel_ms=ms, density=dens, recall=recall,
                    extra={"rel_diff_vs_ours": diff})]


def structured_qkv(seqlen: int, *, batch: int = 1, q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                   dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda",
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v `[B, H, N, D]` with sinks, vertical stripes, a local bump, slashes and key runs,
    built on `device` in seconds at 1M tokens (the demo's float64 CPU generator would take
    minutes and ~100 GB there), from the same ingredients as `demo.synthetic_qkv`.

    Scaled logits (`q.k / sqrt(D)`): the first 4 keys +8 (sinks); about N/100 random keys
    +1 to +6 (verticals); a rotary bump of width about N/40 around `j = i` (+3 at its
    peak); periodic diagonals `i - j = P, 2P, ...` (+2, P = N/10); noise. Keys drift in
    runs of 1 to 16 positions (consecutive keys share a component), so Delta-KV and
    DeltaXAttention find anchors standing for several keys. Built in float32, then cast;
    the same seed gives the same tensors on every device of one kind (every rank).
    """
    if head_dim < 12:
        raise ValueError(f"structured_qkv draws its patterns on 12 dimensions: head_dim must be >= 12, got {head_dim}")
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    n, d, root = seqlen, head_dim, math.sqrt(head_dim)
    f32 = torch.float32
    q = torch.randn(batch, q_heads, n, d, generator=gen, device=dev, dtype=f32) * 0.3
    k = torch.randn(batch, kv_heads, n, d, generator=gen, device=dev, dtype=f32) * 0.3
    v = torch.randn(batch, kv_heads, n, d, generator=gen, device=dev, dtype=f32)
    pos = torch.arange(n, device=dev, dtype=f32)
    # Runs of similar keys: a shared component per run (run ids from random cut points).
    cuts = torch.rand(n, generator=gen, device=dev) < 1.0 / 8
    run_id = torch.cumsum(cuts.to(torch.int64), 0)
    run_vec = torch.randn(int(run_id[-1]) + 1, d, generator=gen, device=dev, dtype=f32) * 0.6
    k = k * 0.5 + run_vec[run_id].view(1, 1, n, d)
    # Sinks (dim 0): q_0 k_0 / root = 8 on the first 4 keys.
    amp = math.sqrt(8.0 * root)
    q[..., 0] = amp
    k[..., :4, 0] = amp
    k[..., 4:, 0] = 0.0
    # Verticals (dim 1): about N/100 keys at +1 .. +6.
    cols = torch.randint(4, max(5, n), (max(1, n // 100),), generator=gen, device=dev)
    q[..., 1] = math.sqrt(root)
    k[..., 1] = 0.0
    k[..., cols, 1] = (1.0 + 5.0 * torch.rand(cols.numel(), generator=gen, device=dev)) * math.sqrt(root)
    # Local bump (dims 2..9): 4 rotary pairs of wavelengths N/40 .. N/5, peak +3.
    a = math.sqrt(3.0 * root / 4)
    for j, frac in enumerate((40.0, 20.0, 10.0, 5.0)):
        w = 2 * math.pi / max(1.0, n / frac) / 4
        q[..., 2 + 2 * j], q[..., 3 + 2 * j] = a * torch.cos(w * pos), a * torch.sin(w * pos)
        k[..., 2 + 2 * j], k[..., 3 + 2 * j] = a * torch.cos(w * pos), a * torch.sin(w * pos)
    # Slashes (dims 10, 11): period N/10, +2.
    w = 2 * math.pi / max(1.0, n / 10)
    b_amp = math.sqrt(2.0 * root)
    q[..., 10], q[..., 11] = b_amp * torch.cos(w * pos), b_amp * torch.sin(w * pos)
    k[..., 10], k[..., 11] = b_amp * torch.cos(w * pos), b_amp * torch.sin(w * pos)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# -- stages and host reads --------------------------------------------------------------------


# Helpers that only validate arguments: not stages.
_NOT_STAGES = ("check", "_check", "resolve_scale", "interpreter_active", "cdiv", "is_", "_is_")


class StageTree:
    """The time each function of `sparseprefill.fast` / `.reference` takes inside one call.

    `install` wraps every such function bound in a loaded `sparseprefill` module (the
    same wrapper wherever a function is bound); while `active`, each wrapped call records
    its span: CUDA events on a GPU (the span of its kernels and host gaps on the stream),
    the wall clock on a CPU, and its host time. `rows()` gives inclusive times per call
    path ("a > b > c"), depth-first in order of first appearance. `uninstall` restores
    the original functions.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.stack: list[str] = []
        self.records: list[tuple[tuple[str, ...], Any, Any, float]] = []
        self.active = False
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        import functools

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            self.stack.append(name)
            path = tuple(self.stack)
            start = end = None
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                start.record()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if end is not None:
                    end.record()
                self.records.append((path, start, end, (time.perf_counter() - t0) * 1e3))
                self.stack.pop()

        inner.__sparseprefill_stage__ = True  # type: ignore[attr-defined]
        return inner

    def install(self) -> int:
        """Wrap the package's functions; returns how many."""
        import types

        wrapped: dict[int, Callable[..., Any]] = {}
        for mod_name, mod in list(sys.modules.items()):
            if not mod_name.startswith("sparseprefill") or mod is None:
                continue
            for attr, val in list(vars(mod).items()):
                if not isinstance(val, types.FunctionType) or getattr(val, "__sparseprefill_stage__", False):
                    continue
                owner = getattr(val, "__module__", "") or ""
                if not owner.startswith(("sparseprefill.fast", "sparseprefill.reference")):
                    continue
                if val.__name__.startswith(_NOT_STAGES):
                    continue
                if id(val) not in wrapped:
                    wrapped[id(val)] = self._wrap(val, f"{owner.rsplit('.', 1)[-1]}.{val.__name__}")
                self._saved.append((mod, attr, val))
                setattr(mod, attr, wrapped[id(val)])
        return len(wrapped)

    def uninstall(self) -> None:
        for mod, attr, val in reversed(self._saved):
            setattr(mod, attr, val)
        self._saved.clear()

    def measure(self, fn: Callable[[], Any]) -> list[dict[str, Any]]:
        """The stages of one call of `fn` (see the class doc)."""
        self.records.clear()
        self.active = True
        try:
            fn()
        finally:
            self.active = False
        if self.cuda:
            torch.cuda.synchronize()
        agg: dict[tuple[str, ...], list[float]] = {}
        order: list[tuple[str, ...]] = []
        for path, start, end, host in self.records:
            if path not in agg:
                agg[path] = [0.0, 0.0, 0.0]
                order.append(path)
            entry = agg[path]
            entry[0] += 1
            entry[1] += start.elapsed_time(end) if start is not None else host
            entry[2] += host
        first = {p: i for i, p in enumerate(order)}

        def position(p: tuple[str, ...]) -> tuple[int, ...]:
            return tuple(first.get(p[: j + 1], 0) for j in range(len(p)))

        return [{"stage": " > ".join(p), "depth": len(p) - 1, "calls": int(agg[p][0]), "span_ms": agg[p][1],
                 "host_ms": agg[p][2]} for p in sorted(order, key=position)]


@contextmanager
def stage_tree(device: torch.device) -> Iterator[StageTree]:
    """A `StageTree` installed for the duration of the block."""
    tree = StageTree(device)
    tree.install()
    try:
        yield tree
    finally:
        tree.uninstall()


def host_syncs(fn: Callable[[], Any]) -> int | None:
    """Host synchronisations of one call of `fn` (torch's sync debug mode); None off a GPU."""
    if not torch.cuda.is_available():
        return None
    import warnings

    fn()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def profiled_kernels(fn: Callable[[], Any], *, calls: int = 3, match: str = "") -> dict[str, Any] | None:
    """CUDA time per call of the kernels `fn` launches (torch.profiler): total, the kernels whose
    name contains `match`, and the largest ones; None off a GPU."""
    if not torch.cuda.is_available():
        return None
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = []
    for e in prof.key_averages():
        total: Any = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        t = float(total) / 1e3 / calls
        if t > 0:
            kernels.append((e.key, e.count / calls, t))
    kernels.sort(key=lambda item: -item[2])
    return {"gpu_ms": sum(t for _, _, t in kernels),
            "matched_ms": sum(t for key, _, t in kernels if match and match in key),
            "top": [{"kernel": key[:100], "calls": c, "ms": t} for key, c, t in kernels[:10]]}


# -- output ---------------------------------------------------------------------------------


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def format_table(rows: Sequence[Row]) -> str:
    """A fixed-width table of the rows: density, recall, the time split and the ratios."""
    head = (f"{'method':<34} {'impl':<16} {'N':>7} {'density':>8} {'recall':>13} {'ms':>9} {'est':>7} "
            f"{'plan':>7} {'kernel':>8} {'vs cuDNN':>8} {'x floor':>7} {'TFLOP/s':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        rec = "-" if r.recall_mean is None else f"{r.recall_mean:.3f}/{_num(r.recall_min, '.3f')}"
        note = f"  {r.extra['error'][:60]}" if "error" in r.extra else ""
        lines.append(
            f"{r.method[:34]:<34} {r.impl[:16]:<16} {r.seqlen:>7} {_num(r.density, '8.4f'):>8} {rec:>13} "
            f"{_num(r.ms, '9.2f'):>9} {_num(r.estimate_ms, '7.2f'):>7} {_num(r.plan_ms, '7.2f'):>7} "
            f"{_num(r.kernel_ms, '8.2f'):>8} "
            f"{'-' if r.speedup_vs_cudnn is None else f'{r.speedup_vs_cudnn:.2f}x':>8} "
            f"{_num(r.vs_floor, '7.2f'):>7} {_num(r.tflops, '7.0f'):>7}{note}")
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                            "triton_interpret": os.environ.get("TRITON_INTERPRET", "0")}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    else:
        info["device"] = "cpu"
    return info


def cudnn_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, log: Callable[[str], None] = log_stderr) -> Row:
    """cuDNN SDPA on q, k, v as a row (math SDPA and the wall clock off a GPU): for tools that
    time beside the baseline outside a suite (`sparseprefill compare --device cuda`)."""
    ctx = Context(device=q.device, batch=int(q.shape[0]), q_heads=int(q.shape[1]), kv_heads=int(k.shape[1]),
                  head_dim=int(q.shape[3]), dtype=q.dtype, log=log)
    ctx._inputs[(int(q.shape[2]), 0)] = (q, k, v)
    return ctx.baseline(int(q.shape[2]))
