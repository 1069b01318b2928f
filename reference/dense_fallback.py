"""The break-even rule: which heads of a plan would run faster as dense attention.

A sparse plan pays off only where its kernel beats dense attention on the same head.
A head whose plan keeps most of the causal area (or whose lists are short, so the
kernel's fixed cost per query tile does not amortise) is slower through the sparse
kernel than dense. The rule marks such heads dense in the plan itself
(`BlockColumnPlan.dense_heads`), so every consumer sees the same decision:
`to_dense_mask`, `density`, `recall`, both packages' `sparse_attention`.

Two dense options, each priced by a measured rate (per query head `h`, batch rows
summed; docs/dense-fallback.md):

    sparse_ms(h) = (block_pairs(h) * block_ps + column_pairs(h) * columns_ps) * 1e-9
                   + programs(h) * program_us * 1e-3
    ours_ms(h)   = B * causal * dense_ps * 1e-9          our kernel, the head's lists
                                                          written full, in the same launch
    layer_ms     = B * Hq * causal * sdpa_ps * 1e-9      ONE torch SDPA call over every head

* a head runs dense through our kernel when `sparse_ms(h) >= ours_ms(h)`;
* the whole layer runs as one SDPA call (every head marked) when the sum over the heads
  of their best cost, `min(sparse_ms(h), ours_ms(h))` (`ours_ms` for a head already
  marked), is not below `layer_ms`. Only where the plan is the whole layer and a whole
  prompt (`layer=True`, no query offset) and the table has an SDPA rate.

`sdpa_ps` is what `sparseprefill rates` measures: one causal call over all heads with
`enable_gqa`. An SDPA call on a subset of heads is never made (its rate is not measured:
on an H200 per-KV-head calls ran far slower than the whole-layer call).

`block_pairs` / `column_pairs` come from the counts (`plan_pairs`): `block_count x rows
x block_n` less the causal trim of the few blocks a query block lists last (the only ones
that can cross the diagonal), `column_count x rows` for disjoint columns (an upper bound:
a column inside the query block's own rows is counted for every row); `programs` the
kernel's query tiles of the head (`B * ceil(N / tile)`, `tile = gcd(block_m, 128)`). The
costs are device-wide throughput costs: a pair's picoseconds and a program's microseconds
when the whole GPU runs many heads at once, as a prefill does. They come from a
`RateTable`: measured once per device by `sparseprefill rates` and cached under the
user's cache folder (keyed by device name, torch and triton versions), else the
`DEFAULT_TABLE` shipped here (an H200).

When the rule runs (`active_rates`):

* inside `dense_fallback(False)`, or with `SPARSEPREFILL_DENSE_FALLBACK=0` in the
  environment: never (the one switch that turns it off);
* inside `dense_fallback(rates=table)`: always, with that table, on any device (the
  tests use a fixed table on the CPU);
* otherwise on CUDA tensors, with the cached measured table or the default one; never
  on the CPU (no GPU rates describe an interpreter) and never while a CUDA graph is
  being captured (the decision reads `[Hq]` flags back to the host: one
  synchronisation, which capture forbids; `fast` also skips it inside
  `fast.capture.static_widths()`, the `_static` ops).

The early exit (a cheap probe of each head's density before the estimate) is off by
default: on an H200 at 32K its probe added 6-39 ms of plan time and saved nothing.
`dense_fallback(early_exit=True)` or `SPARSEPREFILL_EARLY_EXIT=1` turns it on.

The rule lives here, in the specification, and `fast` calls the same functions, so the
two packages given equal plans and the same table mark the same heads (the pair counts
are integers; the comparison is the same float64 arithmetic on both sides).
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .attention import attention
from .plan import BlockColumnPlan, causal_pairs, cdiv, columns_inside_blocks

FORMAT = "sparseprefill.rates/1"
# The environment variable that turns the rule off for a process ("0", "off", "false", "no").
ENV_SWITCH = "SPARSEPREFILL_DENSE_FALLBACK"
# The environment variable that turns the early exit on for a process ("1", "on", "true", "yes").
ENV_EARLY_EXIT = "SPARSEPREFILL_EARLY_EXIT"
# An estimate exits early when its probe puts the head this far past break-even:
# sparse_ms * (1 - EARLY_EXIT_MARGIN) >= dense_ms on the probe's estimated pairs.
EARLY_EXIT_MARGIN = 0.15
# The query tile of our kernel's dense heads outside a plan's launch (Delta-KV,
# DeltaXAttention, AnchorAttention's resumed pass: `fast.attention.dense_heads_into`), and of
# the rates those decisions read.
DENSE_TILE = 128
# Query rows the early-exit probe reads (the last rows of the prompt, which see the most keys).
PROBE_ROWS = 64


# -- rates -----------------------------------------------------------------------------


@dataclass(frozen=True)
class RatePoint:
    """Measured costs of each kernel path at one (dtype, head dim, query tile, N).

    Attributes:
        seqlen: N of the measurement.
        head_dim: D.
        dtype: "bfloat16" or "float16".
        tile: the kernel's query tile rows (`BLOCK_M`: 128 for 128-row plan blocks, 64
            for 64-row ones).
        block_ps: picoseconds per kept causal pair through listed blocks.
        columns_ps: picoseconds per kept causal pair through listed columns.
        ragged_ps: picoseconds per computed pair of the ragged (packed keys) launcher,
            Delta-KV's phase 1.
        program_us: microseconds per kernel program (one query tile of one head): the
            fixed cost that short lists do not amortise.
        sdpa_ps: picoseconds per causal pair of ONE torch SDPA call over every head of
            the layer (causal, GQA through `enable_gqa`; the fastest backend torch picks:
            cuDNN on an H200); 0: not measured (the rule never offers the SDPA call).
        dense_ps: picoseconds per causal pair of our kernel on the dense plan (what a head
            whose lists are written full costs in a launch with the sparse heads); 0: not
            measured (no head is sent dense through our kernel).
    """

    seqlen: int
    head_dim: int
    dtype: str
    tile: int
    block_ps: float
    columns_ps: float
    ragged_ps: float
    program_us: float
    sdpa_ps: float
    dense_ps: float

    def __post_init__(self) -> None:
        for name in ("seqlen", "head_dim", "tile"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RatePoint.{name} must be a positive int, got {value!r}")
        if self.dtype not in ("bfloat16", "float16"):
            raise ValueError(f"RatePoint.dtype must be 'bfloat16' or 'float16', got {self.dtype!r}")
        for name in ("block_ps", "columns_ps", "ragged_ps", "program_us", "sdpa_ps", "dense_ps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ValueError(f"RatePoint.{name} must be a finite number >= 0, got {value!r}")
        if self.sdpa_ps <= 0 and self.dense_ps <= 0:
            raise ValueError("RatePoint needs a dense cost: sdpa_ps or dense_ps must be > 0")


@dataclass(frozen=True)
class RateTable:
    """The rates of one device: `RatePoint`s over N, D, dtype and query tile.

    Attributes:
        device: the device name the rates were measured on (`torch.cuda.get_device_name`).
        source: how they were obtained (a command and date, or the default table's JSON).
        torch_version, triton_version: the versions of the measurement.
        points: the measured points (at least one).
    """

    device: str
    source: str
    points: tuple[RatePoint, ...]
    torch_version: str = ""
    triton_version: str = ""

    def __post_init__(self) -> None:
        if not self.points or not all(isinstance(p, RatePoint) for p in self.points):
            raise ValueError("RateTable.points must hold at least one RatePoint")

    def at(self, seqlen: int, head_dim: int, dtype: torch.dtype | str, tile: int) -> RatePoint:
        """The costs at one shape: the points of the nearest dtype, tile and head dim, then
        linear interpolation in log2 N between the two nearest lengths (clamped outside
        the measured range); pair costs scale with `head_dim / D` of the point.
        """
        name = str(dtype).removeprefix("torch.")
        dtypes = {p.dtype for p in self.points}
        want = name if name in dtypes else ("bfloat16" if "bfloat16" in dtypes else next(iter(sorted(dtypes))))
        pts = [p for p in self.points if p.dtype == want]
        tiles = {p.tile for p in pts}
        t = min(tiles, key=lambda x: (abs(math.log2(x) - math.log2(max(tile, 1))), -x))
        pts = [p for p in pts if p.tile == t]
        dims = {p.head_dim for p in pts}
        d = min(dims, key=lambda x: (abs(x - head_dim), -x))
        pts = sorted((p for p in pts if p.head_dim == d), key=lambda p: p.seqlen)
        x = math.log2(max(seqlen, 1))
        lo = max((p for p in pts if math.log2(p.seqlen) <= x), key=lambda p: p.seqlen, default=pts[0])
        hi = min((p for p in pts if math.log2(p.seqlen) >= x), key=lambda p: p.seqlen, default=pts[-1])
        w = 0.0 if hi.seqlen == lo.seqlen else (x - math.log2(lo.seqlen)) / (math.log2(hi.seqlen) - math.log2(lo.seqlen))
        scale = head_dim / d

        def mix(name: str, pair: bool) -> float:
            value = (1 - w) * float(getattr(lo, name)) + w * float(getattr(hi, name))
            return value * scale if pair else value

        return RatePoint(seqlen=int(seqlen), head_dim=int(head_dim), dtype=want, tile=t,
                         block_ps=mix("block_ps", True), columns_ps=mix("columns_ps", True),
                         ragged_ps=mix("ragged_ps", True), program_us=mix("program_us", False),
                         sdpa_ps=mix("sdpa_ps", True), dense_ps=mix("dense_ps", True))

    def to_json(self) -> dict[str, Any]:
        """The table as the JSON object `from_json` reads (`FORMAT`)."""
        return {"format": FORMAT, "device": self.device, "source": self.source,
                "torch": self.torch_version, "triton": self.triton_version,
                "points": [asdict(p) for p in self.points]}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> RateTable:
        """Read a table written by `to_json`.

        Raises:
            ValueError: another format, or a point with bad values.
        """
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise ValueError(f"a rates table must be a JSON object with format {FORMAT!r}")
        points = data.get("points")
        if not isinstance(points, list):
            raise ValueError("a rates table needs a list of points")
        try:
            pts = tuple(RatePoint(**p) for p in points)
        except TypeError as exc:
            raise ValueError(f"a rates point has unknown or missing fields: {exc}") from None
        return RateTable(device=str(data.get("device", "")), source=str(data.get("source", "")), points=pts,
                         torch_version=str(data.get("torch", "")), triton_version=str(data.get("triton", "")))


# The measured points of `DEFAULT_TABLE` at 8K and 32K: benches/results/rates-h200.json
# (`sparseprefill rates` on one H200, torch 2.11.0+cu130, triton 3.6.0, B = 1, 32 query / 8 KV
# heads, bf16; fp16 the same figures), rounded to 4 decimals.
# (N, D, tile): (block_ps, columns_ps, ragged_ps, program_us, sdpa_ps, dense_ps).
_MEASURED_H200 = {
    (8192, 128, 128): (0.8950, 5.9423, 1.2270, 0.0787, 0.8572, 1.0184),
    (32768, 128, 128): (1.0808, 3.0024, 1.2050, 0.0575, 0.8531, 1.0001),
    (8192, 128, 64): (1.0334, 13.5086, 1.4360, 0.0369, 0.9085, 1.1919),
    (32768, 128, 64): (1.3253, 1.3253, 1.5023, 0.0399, 0.8526, 1.2469),
    (8192, 64, 128): (0.0712, 7.7091, 0.7905, 0.1287, 0.5901, 0.6561),
    (32768, 64, 128): (0.6393, 2.0092, 0.7090, 0.0335, 0.5532, 0.5885),
    (8192, 64, 64): (0.5296, 30.0778, 1.0058, 0.0337, 0.5902, 0.8348),
    (32768, 64, 64): (0.8542, 1.3978, 0.9151, 0.0114, 0.5527, 0.7596),
}


def _h200_points() -> tuple[RatePoint, ...]:
    """The default table's points (see `DEFAULT_TABLE`)."""
    points = [RatePoint(n, d, dtype, tile, *fields) for (n, d, tile), fields in _MEASURED_H200.items()
              for dtype in ("bfloat16", "float16")]
    # 128K is not in the measured file: the earlier figures. (D): (block_ps, program_us, sdpa_ps,
    # dense_ps) at 128-row tiles. D 128: the slope and intercept through the random 5% and 20%
    # 128 x 128 block plans, cuDNN's and our dense plan's ms over the causal pairs, one
    # `sparseprefill bench kernels` run (benches/results/h200-kernels-8k-128k-2026-11-23.json,
    # removed from the tree by commit e5de490: `git show e5de490^:<that path>`). D 64: cuDNN
    # measured (benches/results/columns-h200-d64-128k.json), our dense plan from the 32K ratio to
    # cuDNN (not measured), the block pair cost taken as our dense plan's, the program cost fitted
    # to the columns20 block twin. Columns: block / 0.95 (column-dominant plans at 0.93-0.97 of
    # their block twin); ragged: dense / 0.83 (Delta-KV phase 1); 64-row tiles: pair costs x
    # 532 / 473 (the tile sweep at 128K), the same cost per program.
    for dim, (block, program, sdpa, dense) in ((128, (0.948, 0.152, 0.944, 0.973)),
                                               (64, (0.695, 0.187, 0.545, 0.695))):
        for dtype in ("bfloat16", "float16"):
            points.append(RatePoint(131072, dim, dtype, 128, block, block / 0.95, dense / 0.83, program, sdpa,
                                    dense))
            points.append(RatePoint(131072, dim, dtype, 64, block * 532 / 473, block * 532 / 473 / 0.95,
                                    dense / 0.83, program, sdpa, dense))
    return tuple(points)


# One NVIDIA H200 (torch 2.11.0+cu130, triton 3.6.0), B = 1, 32 query / 8 KV heads: 8K and 32K
# measured by `sparseprefill rates` (benches/results/rates-h200.json), 128K from the earlier
# bench figures (see `_h200_points`). `sparseprefill rates` on a device replaces it there.
DEFAULT_TABLE = RateTable(
    device="NVIDIA H200 (default table)",
    source="8K / 32K: benches/results/rates-h200.json (sparseprefill rates); 128K: derived from the earlier "
           "bench figures (docs/dense-fallback.md)",
    points=_h200_points(), torch_version="2.11.0+cu130", triton_version="3.6.0",
)


def cache_dir() -> Path:
    """The folder of measured rate tables: `$XDG_CACHE_HOME/sparseprefill/rates` (default
    `~/.cache/sparseprefill/rates`), or `$SPARSEPREFILL_CACHE/rates` when that is set."""
    root = os.environ.get("SPARSEPREFILL_CACHE")
    if root:
        return Path(root) / "rates"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sparseprefill" / "rates"


def cache_key(device_name: str, torch_version: str, triton_version: str) -> str:
    """The file name of a device's measured table: its name and the versions, slugged."""
    raw = f"{device_name}-torch{torch_version}-triton{triton_version}"
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", raw).strip("_") + ".json"


def _versions() -> tuple[str, str]:
    try:
        import triton

        triton_version = str(triton.__version__)
    except ImportError:
        triton_version = "none"
    return str(torch.__version__), triton_version


def cache_path(device: torch.device) -> Path:
    """Where `sparseprefill rates` writes (and the rule reads) the rates of `device`."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return cache_dir() / cache_key(name, *_versions())


_LOADED: dict[str, RateTable] = {}
_LOCK = threading.Lock()


def device_rates(device: torch.device) -> RateTable:
    """The rates of a CUDA device: its cached measured table if one exists (read once per
    process), else `DEFAULT_TABLE`. A cache file that does not parse is ignored (default)."""
    path = cache_path(device)
    key = str(path)
    with _LOCK:
        if key not in _LOADED:
            table = DEFAULT_TABLE
            if path.is_file():
                try:
                    table = RateTable.from_json(json.loads(path.read_text()))
                except (ValueError, OSError):
                    table = DEFAULT_TABLE
            _LOADED[key] = table
        return _LOADED[key]


def forget_cached_rates() -> None:
    """Drop the tables read so far (after `sparseprefill rates` wrote a new one)."""
    with _LOCK:
        _LOADED.clear()


# -- the switch ------------------------------------------------------------------------


@dataclass
class _Switch(threading.local):
    enabled: bool | None = None
    rates: RateTable | None = None
    early_exit: bool | None = None
    stack: list[tuple[bool | None, RateTable | None, bool | None]] = field(default_factory=list)


_SWITCH = _Switch()


@contextmanager
def dense_fallback(enabled: bool = True, *, rates: RateTable | None = None,
                   early_exit: bool | None = None) -> Iterator[None]:
    """Within this block (this thread), turn the break-even rule on or off.

    `dense_fallback(False)` turns it off (every plan runs as its estimator made it);
    `dense_fallback(rates=table)` runs it with that table on any device, the CPU included.
    Outside any block the rule is on for CUDA tensors unless the environment sets
    `SPARSEPREFILL_DENSE_FALLBACK=0`.

    Args:
        enabled: the rule on (True) or off (False).
        rates: the table to use on any device; None: the device's (CUDA only).
        early_exit: the adaptive estimators' early exit (a probe of each head's density
            before the estimate) on or off; None keeps the enclosing setting (off by
            default, on with `SPARSEPREFILL_EARLY_EXIT=1`).

    Raises:
        TypeError: `enabled` or `early_exit` not a bool, or `rates` not a `RateTable`.
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    if rates is not None and not isinstance(rates, RateTable):
        raise TypeError(f"rates must be a RateTable or None, got {type(rates).__name__}")
    if early_exit is not None and not isinstance(early_exit, bool):
        raise TypeError(f"early_exit must be a bool or None, got {type(early_exit).__name__}")
    _SWITCH.stack.append((_SWITCH.enabled, _SWITCH.rates, _SWITCH.early_exit))
    _SWITCH.enabled, _SWITCH.rates = enabled, rates
    if early_exit is not None:
        _SWITCH.early_exit = early_exit
    try:
        yield
    finally:
        _SWITCH.enabled, _SWITCH.rates, _SWITCH.early_exit = _SWITCH.stack.pop()


def switched_off_by_env() -> bool:
    """True when `SPARSEPREFILL_DENSE_FALLBACK` turns the rule off for this process."""
    return os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "off", "false", "no")


def early_exit_enabled() -> bool:
    """Whether the adaptive estimators probe for an early exit (only where the rule is on):
    the innermost `dense_fallback(early_exit=...)`, else `SPARSEPREFILL_EARLY_EXIT`
    ("1", "on", "true", "yes"), else off."""
    if _SWITCH.early_exit is not None:
        return _SWITCH.early_exit
    return os.environ.get(ENV_EARLY_EXIT, "0").strip().lower() in ("1", "on", "true", "yes")


def active_rates(t: torch.Tensor) -> RateTable | None:
    """The table the rule uses for tensors like `t`, or None when the rule is off for them
    (see the module doc: the switch, the device, CUDA-graph capture)."""
    if _SWITCH.enabled is False:
        return None
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    if _SWITCH.rates is not None:
        return _SWITCH.rates
    if _SWITCH.enabled is None and switched_off_by_env():
        return None
    if t.device.type != "cuda":
        return None
    return device_rates(t.device)


# -- the rule --------------------------------------------------------------------------


def kernel_tile(block_m: int) -> int:
    """The kernel's query tile rows for a plan's `block_m` (as the block/column launcher picks
    them for D <= 128)."""
    return math.gcd(block_m, 128)


def kept_pairs(plan: BlockColumnPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact kept causal pairs of every (batch row, head), split by path.

    O(B x Hq x Qb x width) work over the index tensors: the rule itself counts from the
    counts (`plan_pairs`); this exact count is what `plan_pairs` is checked against.

    Args:
        plan: a valid plan; its `dense_heads` are counted by their lists.

    Returns:
        (block_pairs, column_pairs): int64 `[B, Hq]`; a column inside a listed block of
        its query block is counted once, with the block.
    """
    n, bm, bn, p = plan.seqlen, plan.block_m, plan.block_n, plan.query_offset
    dev = plan.device
    qb = plan.num_query_blocks
    b, h = plan.batch, plan.num_heads
    keys = plan.key_len
    width = plan.block_index.shape[3] + plan.column_index.shape[3]
    step = max(1, (32 << 20) // max(1, b * h * width))
    block = torch.zeros(b, h, dtype=torch.int64, device=dev)
    column = torch.zeros(b, h, dtype=torch.int64, device=dev)
    for s0 in range(0, qb, step):
        s1 = min(qb, s0 + step)
        r0 = (torch.arange(s0, s1, device=dev, dtype=torch.int64) * bm + p).view(1, 1, -1, 1)
        r1 = torch.clamp(r0 + bm, max=p + n)
        bcount = plan.block_count[:, :, s0:s1].unsqueeze(-1)
        bvalid = torch.arange(plan.block_index.shape[3], device=dev) < bcount
        k0 = plan.block_index[:, :, s0:s1].to(torch.int64) * bn
        k1 = torch.clamp(k0 + bn, max=keys)
        block += torch.where(bvalid, causal_pairs(r0, r1, k0, k1), 0).sum(dim=(-1, -2))
        if plan.column_index.shape[3]:
            ccount = plan.column_count[:, :, s0:s1].unsqueeze(-1)
            cvalid = torch.arange(plan.column_index.shape[3], device=dev) < ccount
            c = plan.query_block_columns(s0, s1).to(torch.int64)
            cvalid = cvalid & ~columns_inside_blocks(plan.block_count[:, :, s0:s1],
                                                     plan.block_index[:, :, s0:s1], c, block_n=bn)
            column += torch.where(cvalid, causal_pairs(r0, r1, c, c + 1), 0).sum(dim=(-1, -2))
    return block, column


def covered_columns(plan: BlockColumnPlan) -> torch.Tensor:
    """int64 `[B, Hq, Qb]`: the listed columns of each query block that lie inside one of its
    listed key blocks (0 everywhere for a `columns_disjoint` plan or one without columns or
    blocks). O(B x Hq x Qb x width), in chunks of the query blocks."""
    b, h, qb = plan.batch, plan.num_heads, plan.num_query_blocks
    wb, wc = plan.block_index.shape[3], plan.column_index.shape[3]
    out = torch.zeros(b, h, qb, dtype=torch.int64, device=plan.device)
    if plan.columns_disjoint or wb == 0 or wc == 0:
        return out
    step = max(1, (32 << 20) // max(1, b * h * (wb + wc)))
    for s0 in range(0, qb, step):
        s1 = min(qb, s0 + step)
        valid = torch.arange(wc, device=plan.device) < plan.column_count[:, :, s0:s1].unsqueeze(-1)
        inside = columns_inside_blocks(plan.block_count[:, :, s0:s1], plan.block_index[:, :, s0:s1],
                                       plan.query_block_columns(s0, s1), block_n=plan.block_n)
        out[:, :, s0:s1] = (valid & inside).sum(dim=-1)
    return out


def plan_pairs(plan: BlockColumnPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs the rule prices, from the counts: O(B x Hq x Qb) work.

    * Blocks: `block_count x rows x block_n` per query block, less the causal trim of the
      last `ceil(block_m / block_n) + 1` listed blocks (read from the sorted lists): only
      those can cross the diagonal or the end of the keys, so the block count is exact.
    * Columns: `column_count x rows` per query block, an upper bound: a column inside the
      query block's own rows is counted for every row (at most `block_m (block_m - 1) / 2`
      pairs more per query block: `block_m / N` of the causal area, 0.4% at 32K with
      128-row blocks). A plan that is not `columns_disjoint` first drops the columns
      inside its listed blocks (`covered_columns`: O(B x Hq x Qb x width), the old exact
      count's cost; `fast` plans arrive disjoint wherever their lists fit the resolve
      budget, the reference's do not). So plans that are `equal` count the same pairs
      whichever package made them.

    Args:
        plan: a valid plan; its `dense_heads` are counted by their lists (the rule asks
            what the lists would cost).

    Returns:
        (block_pairs, column_pairs): int64 `[B, Hq]`.
    """
    n, bm, bn, p = plan.seqlen, plan.block_m, plan.block_n, plan.query_offset
    dev = plan.device
    qb = plan.num_query_blocks
    r0 = torch.arange(qb, device=dev, dtype=torch.int64) * bm + p
    r1 = torch.clamp(r0 + bm, max=p + n)
    rows = r1 - r0  # [Qb]
    bcount = plan.block_count.to(torch.int64)
    block = bcount * (rows * bn)
    width = int(plan.block_index.shape[3])
    if width and bcount.numel():
        t = min(width, cdiv(bm, bn) + 1)
        pos = bcount.unsqueeze(-1) - t + torch.arange(t, device=dev, dtype=torch.int64)  # [B, Hq, Qb, t]
        k0 = torch.gather(plan.block_index, 3, pos.clamp(min=0)).to(torch.int64) * bn
        k1 = torch.clamp(k0 + bn, max=plan.key_len)
        exact = causal_pairs(r0.view(1, 1, -1, 1), r1.view(1, 1, -1, 1), k0, k1)
        block = block + torch.where(pos >= 0, exact - (rows * bn).view(1, 1, -1, 1), 0).sum(dim=-1)
    ccount = plan.column_count.to(torch.int64)
    if plan.column_index.shape[3] and not plan.columns_disjoint:
        ccount = ccount - covered_columns(plan)
    column = ccount * rows
    return block.sum(dim=-1), column.sum(dim=-1)


@dataclass(frozen=True)
class HeadCosts:
    """The modelled time of every head's plan and of its dense options.

    Attributes:
        sparse_ms: float64 `[Hq]`, the plan's kernel time per head (batch rows summed).
        dense_ms: float64 `[Hq]`, the head dense through our kernel (its lists written
            full, in the launch with the sparse heads); inf where the table has no rate.
        layer_ms: the whole layer as ONE SDPA call over every head; None where that is
            not an option (a plan of part of a layer or of a chunk, no SDPA rate).
        marked: bool `[Hq]`, heads already dense (a calibrated config's, an early exit's):
            their cost is `dense_ms` whatever their lists; None: none.
    """

    sparse_ms: torch.Tensor
    dense_ms: torch.Tensor
    layer_ms: float | None = None
    marked: torch.Tensor | None = None

    @property
    def ours(self) -> torch.Tensor:
        """bool `[Hq]`: heads whose plan is not faster than our kernel's dense (or marked)."""
        flags = self.sparse_ms >= self.dense_ms
        return flags if self.marked is None else flags | self.marked

    @property
    def best_ms(self) -> torch.Tensor:
        """float64 `[Hq]`: each head's cheaper option (sparse, or dense through our kernel)."""
        return torch.where(self.ours, self.dense_ms, self.sparse_ms)

    @property
    def layer(self) -> torch.Tensor:
        """bool 0-dim (no host read): one SDPA call over every head is not slower than the
        heads' best options summed."""
        if self.layer_ms is None:
            return torch.zeros((), dtype=torch.bool, device=self.sparse_ms.device)
        return self.best_ms.sum() >= self.layer_ms

    @property
    def dense(self) -> torch.Tensor:
        """bool `[Hq]`: the heads to mark dense (every head when the layer goes to SDPA)."""
        return self.ours | self.layer


def dense_cost(rate: RatePoint) -> tuple[float, str]:
    """(picoseconds per causal pair, path) of the faster dense path of a rate point for a
    whole layer: "sdpa" (one call over every head) or "ours"."""
    options = [(rate.sdpa_ps, "sdpa"), (rate.dense_ps, "ours")]
    return min((c, name) for c, name in options if c > 0)


def _dense_options(rate: RatePoint, *, batch: int, heads: int, causal: float, like: torch.Tensor,
                   layer: bool) -> tuple[torch.Tensor, float | None]:
    """(our kernel's dense ms per head `[Hq]`, the one-call SDPA ms of the layer or None)."""
    ours = batch * causal * rate.dense_ps * 1e-9 if rate.dense_ps > 0 else math.inf
    layer_ms = batch * heads * causal * rate.sdpa_ps * 1e-9 if layer and rate.sdpa_ps > 0 else None
    return torch.full_like(like, ours), layer_ms


def head_costs(block_pairs: torch.Tensor, column_pairs: torch.Tensor, *, seqlen: int, key_len: int | None = None,
               block_m: int, head_dim: int, dtype: torch.dtype | str, rates: RateTable, layer: bool = False,
               marked: torch.Tensor | None = None) -> HeadCosts:
    """The cost model of the module doc, from pairs.

    Args:
        block_pairs, column_pairs: `[B, Hq]` pairs through blocks / columns (any real
            dtype: an estimate may be fractional).
        seqlen: N (queries); key_len: P + N (keys; None: N).
        block_m: the plan's query block (the kernel tile is `gcd(block_m, 128)`).
        head_dim, dtype: of q.
        rates: the table.
        layer: the heads are a whole layer of a whole prompt, so one SDPA call over all of
            them is an option (`HeadCosts.layer_ms`).
        marked: bool `[Hq]`, heads already dense, or None.

    Returns:
        `HeadCosts` on the pairs' device.
    """
    tile = kernel_tile(block_m)
    keys = seqlen if key_len is None else key_len
    rate = rates.at(keys, head_dim, dtype, tile)
    b, hq = int(block_pairs.shape[0]), int(block_pairs.shape[1])
    programs = b * cdiv(seqlen, tile)
    sparse = (block_pairs.to(torch.float64) * rate.block_ps + column_pairs.to(torch.float64) * rate.columns_ps) \
        .sum(dim=0) * 1e-9 + programs * rate.program_us * 1e-3
    p = keys - seqlen
    causal = float(causal_pairs(torch.tensor(p), torch.tensor(keys), torch.tensor(0), torch.tensor(keys)))
    dense, layer_ms = _dense_options(rate, batch=b, heads=hq, causal=causal, like=sparse, layer=layer and p == 0)
    return HeadCosts(sparse_ms=sparse, dense_ms=dense, layer_ms=layer_ms, marked=marked)


def plan_costs(plan: BlockColumnPlan, *, head_dim: int, dtype: torch.dtype | str, rates: RateTable,
               layer: bool = True) -> HeadCosts:
    """`head_costs` of a plan's own lists (`plan_pairs`), its `dense_heads` as marked.

    Args:
        layer: the plan holds every head of the layer (one SDPA call over them is an
            option where the plan is a whole prompt); False for a plan of a head group.
    """
    block, column = plan_pairs(plan)
    marked = plan.dense_head_mask() if plan.dense_heads else None
    return head_costs(block, column, seqlen=plan.seqlen, key_len=plan.key_len, block_m=plan.block_m,
                      head_dim=head_dim, dtype=dtype, rates=rates, layer=layer, marked=marked)


def break_even_heads(plan: BlockColumnPlan, *, head_dim: int, dtype: torch.dtype | str,
                     rates: RateTable, layer: bool = True) -> tuple[int, ...]:
    """The query heads the rule sends dense under `rates` (one host read of `[Hq]` flags),
    sorted: every head when the layer goes to one SDPA call, else those whose plan is not
    faster than our kernel's dense. `layer` as `plan_costs`."""
    return flagged(plan_costs(plan, head_dim=head_dim, dtype=dtype, rates=rates, layer=layer).dense)


def apply_rule(plan: BlockColumnPlan, q: torch.Tensor, *, rates: RateTable | None = None,
               layer: bool = True) -> BlockColumnPlan:
    """The plan with every head that the break-even rule sends dense marked in `dense_heads`.

    Args:
        plan: a plan for `q: [B, Hq, N, D]`.
        q: the queries (their head dim, dtype and device choose the rates).
        rates: the table to use; None: `active_rates(q)` (None there: the plan unchanged).
        layer: the plan holds every head of the layer (False for a head group: no SDPA
            call is then offered, only our kernel's dense).

    Returns:
        `plan.with_dense_heads(heads)`, or `plan` itself when the rule is off or sends no
        head dense.
    """
    table = active_rates(q) if rates is None else rates
    if table is None:
        return plan
    heads = break_even_heads(plan, head_dim=int(q.shape[-1]), dtype=q.dtype, rates=table, layer=layer)
    return plan.with_dense_heads(heads)


def _packed_model(rate: RatePoint, *, seqlen: int, tile: int, exact_pairs_per_row: int) -> tuple[float, float]:
    """(ms of phase 2's exact part and both launches' programs per batch row, ms of phase 1
    per kept key share per batch row) of packed-key attention (Delta-KV)."""
    causal = seqlen * (seqlen + 1) / 2
    fixed = min(exact_pairs_per_row, seqlen) * seqlen * rate.block_ps * 1e-9 \
        + 2 * cdiv(seqlen, tile) * rate.program_us * 1e-3
    return fixed, causal * rate.ragged_ps * 1e-9


def dense_keep_ratio(*, seqlen: int, head_dim: int, dtype: torch.dtype | str, rates: RateTable,
                     exact_pairs_per_row: int, block_m: int = 64) -> float:
    """The keep ratio at or above which packed-key attention (Delta-KV) is not faster than
    our kernel's dense for a KV head's query heads.

    Model per query head, as the module doc's: phase 1 reads `keep * N (N + 1) / 2` pairs
    of packed keys at the ragged rate, phase 2 `exact_pairs_per_row * N` pairs (its exact
    part: the critical diagonal) at the block rate, both launches cost their programs;
    dense costs the causal pairs at `dense_ps`. The break-even keep is the keep where the
    two are equal (clamped to [0, 1]); inf where the table has no `dense_ps` (no head goes
    dense through our kernel; the one-call SDPA option is `keep_dense_kv_heads`'s). The
    dense heads run apart from the packed launches, on `DENSE_TILE`-row tiles: `dense_ps`
    is read there.
    """
    tile = kernel_tile(block_m)
    rate = rates.at(seqlen, head_dim, dtype, tile)
    dense_ps = rates.at(seqlen, head_dim, dtype, DENSE_TILE).dense_ps
    if dense_ps <= 0:
        return math.inf
    fixed, per_keep = _packed_model(rate, seqlen=seqlen, tile=tile, exact_pairs_per_row=exact_pairs_per_row)
    dense = seqlen * (seqlen + 1) / 2 * dense_ps * 1e-9
    if per_keep <= 0:
        return 1.0
    return min(1.0, max(0.0, (dense - fixed) / per_keep))


def keep_dense_kv_heads(kept: torch.Tensor, *, q_heads: int, seqlen: int, block_m: int, block_n: int,
                        head_dim: int, dtype: torch.dtype | str, rates: RateTable) -> tuple[int, ...]:
    """The KV heads whose query heads run dense on a Delta-KV keep mask: every KV head when
    one SDPA call over the layer is not slower than the heads' best options summed, else
    those whose keep ratio is at or above `dense_keep_ratio`'s break-even (our kernel).

    The keep ratio of a KV head is its anchors over its keys, batch rows summed (the
    rule's costs are summed over the batch). Phase 2's exact part is taken as
    `block_m + block_n` keys per row: a row sees the keys of its own query block before
    it, and the critical diagonal starts at most one packed block's reach before the
    block (near break-even the break-even moves by about 0.01 between 0 and 192 keys a
    row). The per-head comparison is exact: integer anchors against `ratio * B * N` in
    float64; the layer's sum is one float64 expression of the same integers. So both
    packages, given the same keep mask (bit-identical by construction) and the same
    table, send the same heads dense. One host read of `[Hkv]` flags.

    Args:
        kept: int `[B, Hkv]`, anchors per (batch row, KV head) (the keep mask's sums).
        q_heads: Hq. seqlen: N. block_m: query rows per block. block_n: the packed key block.
        head_dim, dtype: of q. rates: the table.

    Returns:
        The KV heads to run dense, sorted.
    """
    b, hkv = int(kept.shape[0]), int(kept.shape[1])
    tile = kernel_tile(block_m)
    ratio = dense_keep_ratio(seqlen=seqlen, head_dim=head_dim, dtype=dtype, rates=rates,
                             exact_pairs_per_row=block_m + block_n, block_m=block_m)
    total = kept.to(torch.int64).sum(dim=0).to(torch.float64)
    ours = total >= ratio * b * seqlen
    rate = rates.at(seqlen, head_dim, dtype, tile)
    fixed, per_keep = _packed_model(rate, seqlen=seqlen, tile=tile, exact_pairs_per_row=block_m + block_n)
    sparse = total / seqlen * per_keep + b * fixed  # per query head of each KV head, batch rows summed
    causal = seqlen * (seqlen + 1) / 2
    dense, layer_ms = _dense_options(rates.at(seqlen, head_dim, dtype, DENSE_TILE), batch=b, heads=q_heads,
                                     causal=causal, like=sparse, layer=True)
    if layer_ms is not None:
        best = torch.where(ours, dense, sparse)
        ours = ours | (best.sum() * (q_heads // max(1, hkv)) >= layer_ms)
    return flagged(ours)


def packed_head_costs(exact_pairs: torch.Tensor, packed_pairs: torch.Tensor, *, seqlen: int, block_m: int,
                      head_dim: int, dtype: torch.dtype | str, rates: RateTable) -> HeadCosts:
    """The cost model of packed-key attention (DeltaXAttention): exact pairs through the
    block path, packed pairs (query rows x padded anchors) through the ragged launcher,
    two launches' programs; the dense options as `head_costs`, read at `DENSE_TILE`-row
    tiles (the dense heads run apart from the two launches; the layer's SDPA call always
    offered: the method runs whole layers of whole prompts).

    The pairs are summed over the batch rows as integers before the one float64
    expression, so the costs do not depend on a reduction order (both packages, on any
    device, compute the same bits from the same pairs).

    Args:
        exact_pairs, packed_pairs: int `[B, Hq]`.
        seqlen: N. block_m: the plan's query block (the kernel tile is `gcd(block_m, 128)`).
        head_dim, dtype: of q. rates: the table.

    Returns:
        `HeadCosts`, float64 `[Hq]`.
    """
    tile = kernel_tile(block_m)
    rate = rates.at(seqlen, head_dim, dtype, tile)
    b, hq = int(exact_pairs.shape[0]), int(exact_pairs.shape[1])
    programs = 2 * b * cdiv(seqlen, tile)
    sparse = exact_pairs.to(torch.int64).sum(dim=0).to(torch.float64) * rate.block_ps * 1e-9 \
        + packed_pairs.to(torch.int64).sum(dim=0).to(torch.float64) * rate.ragged_ps * 1e-9 \
        + programs * rate.program_us * 1e-3
    dense, layer_ms = _dense_options(rates.at(seqlen, head_dim, dtype, DENSE_TILE), batch=b, heads=hq,
                                     causal=seqlen * (seqlen + 1) / 2, like=sparse, layer=True)
    return HeadCosts(sparse_ms=sparse, dense_ms=dense, layer_ms=layer_ms)


def attend_dense_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: Sequence[int],
                       out: torch.Tensor | None, *, scale: float | None = None) -> torch.Tensor:
    """Full causal attention (`reference.attention`) of the query heads `heads`, written into
    `out`: what a method that is not one plan's attention (Delta-KV, DeltaXAttention) gives
    the heads the rule sends dense.

    Args:
        q: `[B, Hq, N, D]`; k, v: `[B, Hkv, N, D]`.
        heads: query heads (any order, distinct).
        out: `[B, Hq, N, D]` written at `heads`; None: a new tensor of every head (then
            `heads` must list them all).
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        `out` (or the new output), in q's dtype.
    """
    if out is None:
        if sorted(heads) != list(range(int(q.shape[1]))):
            raise ValueError("attend_dense_heads needs `out` unless every head is listed")
        return attention(q, k, v, scale=scale)
    if not heads:
        return out
    g = int(q.shape[1]) // int(k.shape[1])
    idx = torch.tensor(list(heads), device=q.device)
    kv = torch.tensor([h // g for h in heads], device=q.device)
    res = attention(q.index_select(1, idx), k.index_select(1, kv), v.index_select(1, kv), scale=scale)
    out[:, idx] = res.to(out.dtype)
    return out


def flagged(flags: torch.Tensor) -> tuple[int, ...]:
    """The indices of a bool `[H]` tensor's True entries (one host read), sorted."""
    return tuple(int(h) for h in flags.nonzero().flatten().tolist())


def query_heads_of(kv_heads: Sequence[int], q_heads: int, n_kv: int) -> tuple[int, ...]:
    """The query heads of the given KV heads (GQA groups `h // (Hq / Hkv)`), sorted."""
    g = q_heads // n_kv
    return tuple(h for j in sorted(kv_heads) for h in range(j * g, (j + 1) * g))


# -- early exit ------------------------------------------------------------------------


# Scores one probe step holds at once (fp32 elements: 64 MiB); the keys are read in chunks.
PROBE_CHUNK_ELEMENTS = 1 << 24


def _probe_queries(q: torch.Tensor, k: torch.Tensor, rows: int, block_n: int
                   ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(the last `rows` queries as float32 `[B, Hkv, G * r, D]`, their positions `[r]`, r, the
    key chunk: a multiple of `block_n` that keeps one step's scores within
    `PROBE_CHUNK_ELEMENTS`)."""
    b, hq, n, d = q.shape
    hkv, keys = int(k.shape[1]), int(k.shape[2])
    r = min(rows, n)
    qs = q[:, :, n - r:].reshape(b, hkv, (hq // hkv) * r, d).to(torch.float32)
    pos = torch.arange(keys - r, keys, device=q.device)
    chunk = max(block_n, PROBE_CHUNK_ELEMENTS // max(1, b * hq * r) // block_n * block_n)
    return qs, pos, r, chunk


def _probe_scores(qs: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, c0: int, c1: int, *, heads: int,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Scaled float32 scores of the probe rows against keys `[c0, c1)`, every KV head at
    once, non-causal entries -inf: `[B, Hkv, G, r, c1 - c0]`, and the causal mask `[r, c1 - c0]`."""
    b, hkv = int(qs.shape[0]), int(qs.shape[1])
    r = int(pos.shape[0])
    s = torch.matmul(qs, k[:, :, c0:c1].to(torch.float32).transpose(-1, -2)) * scale
    causal = torch.arange(c0, c1, device=qs.device)[None, :] <= pos[:, None]
    return s.view(b, hkv, heads // hkv, r, c1 - c0).masked_fill(~causal, -math.inf), causal


def probe_mass_density(q: torch.Tensor, k: torch.Tensor, *, block_n: int, mass: torch.Tensor,
                       scale: float, rows: int = PROBE_ROWS) -> torch.Tensor:
    """A cheap estimate of each head's kept share under a mass rule, from its last rows.

    The last `rows` queries (those that see the most keys) attend every causal key in
    float32; their softmax mass is pooled into key blocks of `block_n` and averaged over
    the rows; the estimate is the share of the causal key blocks the heaviest blocks
    take to reach `mass[h]` of it (the greedy tile / line selection that XAttention,
    DPXA and FlexPrefill make, seen from the last rows). Cost: `rows x (P + N)` scores
    per head, every KV head in one matmul per chunk of keys (the chunk's scores within
    `PROBE_CHUNK_ELEMENTS`); each key block's mass is kept as a logsumexp, so no chunk
    needs the row's total. K is read per chunk (a float32 copy of the chunk, never of K).

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, P + N, D]`.
        block_n: the key block of the pooling.
        mass: float `[Hq]` in (0, 1], the mass fraction per head.
        scale: softmax scale.
        rows: query rows read (capped at N).

    Returns:
        float64 `[B, Hq]` in (0, 1].
    """
    b, hq = int(q.shape[0]), int(q.shape[1])
    hkv, keys = int(k.shape[1]), int(k.shape[2])
    kb = cdiv(keys, block_n)
    qs, pos, r, chunk = _probe_queries(q, k, rows, block_n)
    block_lse = torch.empty(b, hkv, hq // hkv, r, kb, dtype=torch.float32, device=q.device)
    for c0 in range(0, keys, chunk):
        c1 = min(keys, c0 + chunk)
        s, _ = _probe_scores(qs, k, pos, c0, c1, heads=hq, scale=scale)
        nb = cdiv(c1 - c0, block_n)
        s = torch.nn.functional.pad(s, (0, nb * block_n - (c1 - c0)), value=-math.inf)
        block_lse[..., c0 // block_n:c0 // block_n + nb] = torch.logsumexp(s.view(*s.shape[:-1], nb, block_n), -1)
    total = torch.logsumexp(block_lse, dim=-1, keepdim=True)
    pooled = torch.exp(block_lse - total).nan_to_num(0.0).mean(dim=3)  # [B, Hkv, G, Kb]
    ordered = torch.sort(pooled, dim=-1, descending=True).values
    before = torch.cumsum(ordered, dim=-1) - ordered
    need = (before < mass.to(device=q.device, dtype=torch.float32).view(1, hkv, hq // hkv, 1)).sum(-1)
    return (need.to(torch.float64) / kb).reshape(b, hq).clamp(min=1.0 / kb, max=1.0)


def early_dense_heads(density: torch.Tensor, *, seqlen: int, block_m: int, head_dim: int,
                      dtype: torch.dtype | str, rates: RateTable,
                      margin: float = EARLY_EXIT_MARGIN) -> tuple[int, ...]:
    """The heads whose estimated density puts them clearly past break-even: the modelled
    block-path time of `density x` the causal pairs, times `1 - margin`, is still not below
    our kernel's dense time (one host read of `[Hq]` flags). Whether the layer then goes
    to one SDPA call is the rule's decision on the plan (`apply_rule`, the exited heads
    priced dense).

    Args:
        density: float `[B, Hq]`, an estimate of each head's kept share (a probe's).
        seqlen, block_m, head_dim, dtype, rates: as `head_costs`.
        margin: how far past break-even counts as clearly (0.15: 15%).
    """
    causal = seqlen * (seqlen + 1) / 2
    pairs = density.to(torch.float64) * causal
    costs = head_costs(pairs, torch.zeros_like(pairs), seqlen=seqlen, block_m=block_m, head_dim=head_dim,
                       dtype=dtype, rates=rates)
    flags = costs.sparse_ms * (1.0 - margin) >= costs.dense_ms
    return tuple(int(h) for h in flags.nonzero().flatten().tolist())


def kv_groups_of(heads: Sequence[int], q_heads: int, kv_heads: int) -> tuple[list[int], list[int]]:
    """(the KV heads that keep at least one query head not in `heads`, those KV heads' query
    heads in order): what an estimate still has to plan after an early exit."""
    g = q_heads // kv_heads
    gone = set(heads)
    kv = [j for j in range(kv_heads) if any(h not in gone for h in range(j * g, (j + 1) * g))]
    return kv, [h for j in kv for h in range(j * g, (j + 1) * g)]


def scatter_heads(sub: BlockColumnPlan, heads: Sequence[int], q_heads: int) -> BlockColumnPlan:
    """A plan of `q_heads` heads whose heads `heads` (in order) are `sub`'s and whose other
    heads list nothing (count 0), `dense_heads` of `sub` moved to their new indices.

    Expanded index views are materialised (`[B, Hq, ..., width]` int32).
    """
    idx = torch.tensor(list(heads), dtype=torch.long, device=sub.device)
    b = sub.batch

    def spread(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(b, q_heads, *t.shape[2:], dtype=t.dtype, device=t.device)
        out.index_copy_(1, idx, t.expand(b, len(heads), *t.shape[2:]).contiguous())
        return out

    plan = BlockColumnPlan(
        seqlen=sub.seqlen, block_m=sub.block_m, block_n=sub.block_n,
        block_count=spread(sub.block_count), block_index=spread(sub.block_index),
        column_count=spread(sub.column_count), column_index=spread(sub.column_index),
        columns_disjoint=sub.columns_disjoint, column_group=sub.column_group, query_offset=sub.query_offset,
        dense_heads=tuple(sorted(int(heads[h]) for h in sub.dense_heads)),
    )
    return plan.mark_valid() if sub._checked else plan


def empty_plan_like(q: torch.Tensor, k: torch.Tensor, *, block_m: int, block_n: int) -> BlockColumnPlan:
    """A valid plan for `q`, `k` that lists nothing (every count 0, no columns); with
    `with_dense_heads` it is the plan of a call whose every head exited early."""
    b, hq, n, _ = q.shape
    p = k.shape[2] - n
    qb = cdiv(n, block_m)
    zeros = torch.zeros(1, 1, 1, dtype=torch.int32, device=q.device).expand(b, hq, qb)
    return BlockColumnPlan(
        seqlen=n, block_m=block_m, block_n=block_n, block_count=zeros,
        block_index=torch.zeros(1, 1, 1, 0, dtype=torch.int32, device=q.device).expand(b, hq, qb, 0),
        column_count=zeros, column_index=torch.zeros(1, 1, 1, 0, dtype=torch.int32, device=q.device)
        .expand(b, hq, qb, 0), query_offset=p,
    ).mark_valid()


def plan_with_fallback(
    q: torch.Tensor,
    k: torch.Tensor,
    estimate: Callable[[list[int] | None], BlockColumnPlan],
    *,
    rates: RateTable | None,
    block_m: int,
    block_n: int,
    probe: Callable[[], torch.Tensor] | None = None,
) -> BlockColumnPlan:
    """An estimator's plan with the early exit and the break-even rule applied.

    1. No rates (the rule is off): `estimate(None)`, unchanged.
    2. Only where the early exit is on (`early_exit_enabled`: off by default):
       `probe()` (a cheap `[B, Hq]` density estimate, e.g. `probe_mass_density`) picks the
       heads clearly past break-even (`early_dense_heads`). Those heads are not estimated:
       the estimate runs on the KV groups that still have a head to plan
       (`estimate(heads)`, `heads` the query heads of those groups, in order), its plan is
       spread back over all heads (`scatter_heads`; a group with every head exited lists
       nothing) and the exited heads are marked dense. No head exits: `estimate(None)`.
    3. The break-even rule on the plan's own lists (`apply_rule`).

    A head that does not exit gets exactly the lists `estimate(None)` gives it when the
    estimator plans each head from its own queries, keys and knob value (every adaptive
    method here does).

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, P + N, D]`.
        estimate: `heads -> plan` of those query heads (None: all), the estimator with
            its per-head knobs cut to `heads`.
        rates: the table (None: the rule is off).
        block_m, block_n: the plan's block sizes (for the empty plan of a call whose every
            head exited, and the probe's cost model).
        probe: the early-exit estimate, or None (no early exit); called only where
            `early_exit_enabled()`.

    Returns:
        The plan; `dense_heads` holds the exited heads and those the rule sends dense.
    """
    if rates is None:
        return estimate(None)
    hq, hkv = int(q.shape[1]), int(k.shape[1])
    exited: tuple[int, ...] = ()
    if probe is not None and early_exit_enabled():
        exited = early_dense_heads(probe(), seqlen=int(k.shape[2]), block_m=block_m, head_dim=int(q.shape[3]),
                                   dtype=q.dtype, rates=rates)
    if not exited:
        plan = estimate(None)
    else:
        _, heads = kv_groups_of(exited, hq, hkv)
        if not heads:
            plan = empty_plan_like(q, k, block_m=block_m, block_n=block_n)
        elif len(heads) == hq:
            plan = estimate(None)
        else:
            plan = scatter_heads(estimate(heads), heads, hq)
        plan = plan.with_dense_heads(list(exited))
    return apply_rule(plan, q, rates=rates)


def heads_view(q: torch.Tensor, k: torch.Tensor, heads: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) of the query heads `heads` (whole KV groups, in order) and their KV heads:
    slices where the heads are one contiguous run, else gathered copies (an estimate
    after an early exit reads only the groups it still plans). None: q and k."""
    if heads is None:
        return q, k
    g = int(q.shape[1]) // int(k.shape[1])
    kv = sorted({h // g for h in heads})
    if heads == list(range(heads[0], heads[-1] + 1)):
        return q[:, heads[0]:heads[-1] + 1], k[:, kv[0]:kv[-1] + 1]
    hi = torch.tensor(heads, device=q.device)
    return q.index_select(1, hi), k.index_select(1, torch.tensor(kv, device=k.device))


def knob_heads(value: Any, heads: list[int] | None) -> Any:
    """A per-head knob (float64 `[Hq]` tensor) cut to `heads`; a scalar or None unchanged."""
    if heads is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    return value[torch.tensor(heads, device=value.device)]


def probe_gap_density(q: torch.Tensor, k: torch.Tensor, *, theta: torch.Tensor, scale: float,
                      rows: int = PROBE_ROWS) -> torch.Tensor:
    """A cheap estimate of each head's kept share under a score-gap rule (AnchorAttention's:
    keep a key whose scaled logit is within `theta[h]` of the row's largest), from the last
    `rows` queries in float32: the mean over those rows of the share of their causal keys
    within the gap. Two passes over chunks of keys (the row maxima, then the keys within
    the gap), every KV head in one matmul per chunk; K is read per chunk, never copied whole.

    Returns:
        float64 `[B, Hq]` in (0, 1].
    """
    b, hq = int(q.shape[0]), int(q.shape[1])
    hkv, keys = int(k.shape[1]), int(k.shape[2])
    qs, pos, r, chunk = _probe_queries(q, k, rows, 1)
    seen = (pos + 1).to(torch.float64)  # [r]
    top = torch.full((b, hkv, hq // hkv, r, 1), -math.inf, dtype=torch.float32, device=q.device)
    for c0 in range(0, keys, chunk):
        s, _ = _probe_scores(qs, k, pos, c0, min(keys, c0 + chunk), heads=hq, scale=scale)
        top = torch.maximum(top, s.amax(dim=-1, keepdim=True))
    gap = top - theta.to(device=q.device, dtype=torch.float32).view(1, hkv, hq // hkv, 1, 1)
    kept = torch.zeros(b, hkv, hq // hkv, r, dtype=torch.int64, device=q.device)
    for c0 in range(0, keys, chunk):
        s, causal = _probe_scores(qs, k, pos, c0, min(keys, c0 + chunk), heads=hq, scale=scale)
        kept += ((s >= gap) & causal).sum(dim=-1)
    return (kept.to(torch.float64) / seen).mean(dim=-1).reshape(b, hq).clamp(min=1.0 / keys, max=1.0)
