"""`sparseprefill bench SUITE [SUITE ...]`: GPU benchmark suites, every row beside cuDNN SDPA.

Suites (`sparseprefill bench --help` lists them with their options):

* `kernels` (default): dense, streaming and random-block plans (5%, 20%): our kernel,
  FlexAttention on the same plan, cuDNN and flash SDPA dense;
* `methods`: every registered method at its defaults end to end, its plan and its kernel;
* a method's name: its own suite where `sparseprefill/bench/suites/<name>.py` exists
  (stage splits, a paper's settings), else its `methods` rows;
* `estimates`, `floor`, `variants`, `serving`, `scale`, `delta`, `peers`, `distributed`:
  see each module in `sparseprefill/bench/suites/`.

Every row has the method, N, density, recall, the time split (estimate / plan / kernel),
the speedup over cuDNN SDPA measured in the same run and the ratio to the floor
`density x cuDNN` (`common.Row`). Rows are printed as a table at the end and, with
`--json PATH`, written to PATH; each is also appended to `PATH` with the suffix
`.jsonl` as soon as it is measured, progress lines (elapsed, time left) go to stderr,
and `--resume` skips the pieces already in that file. `--plot PNG` draws the speedups.

`--device cpu` runs any suite at tiny sizes under `TRITON_INTERPRET=1` (wall-clock
times, math SDPA instead of cuDNN, said in every row): how the tests run them.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .common import (
    Context,
    Option,
    Row,
    Suite,
    Unit,
    bench_ms,
    cudnn_row,
    environment,
    flex_block_mask,
    format_table,
    log_stderr,
    minference_anchor_lines,
    random_block_plan,
)

# The suites every run offers, in `--help` order; a registered method's name is a suite too.
SUITES = ("kernels", "methods", "estimates", "floor", "variants", "serving", "scale", "delta", "peers",
          "distributed")
DEFAULT_SUITE = "kernels"
# Sizes of `--device cpu` when not given: enough for every kernel path, seconds in the interpreter.
CPU_SHAPE = {"seqlens": "128", "batch": 1, "q_heads": 2, "kv_heads": 1, "head_dim": 32, "dtype": "fp16"}
GPU_SHAPE = {"batch": 1, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16"}

__all__ = [
    "DEFAULT_SUITE",
    "SUITES",
    "Context",
    "Option",
    "Row",
    "Suite",
    "Unit",
    "add_arguments",
    "bench_ms",
    "cudnn_row",
    "environment",
    "flex_block_mask",
    "format_table",
    "load_suite",
    "main",
    "minference_anchor_lines",
    "random_block_plan",
    "run",
    "run_suite",
    "suite_names",
]


def suite_names() -> list[str]:
    """Every suite name: the shared suites, then each registered method."""
    from ..methods import methods

    return [*SUITES, *(name for name in methods() if name not in SUITES)]


def load_suite(name: str) -> Suite:
    """The suite called `name`.

    A shared suite is the module `sparseprefill.bench.suites.<name>`; a registered method's
    suite is the module of its name there when it exists, else the `methods` suite for that
    method alone. Each module defines `SUITE`.

    Raises:
        ValueError: neither a shared suite nor a registered method (the message lists them).
    """
    from ..methods import methods

    if name not in SUITES and name not in methods():
        raise ValueError(f"unknown suite {name!r}; suites: {', '.join(suite_names())}")
    module_name = f"{__name__}.suites.{name}"
    if name in SUITES or importlib.util.find_spec(module_name) is not None:
        suite: Suite = importlib.import_module(module_name).SUITE
        return suite
    from .suites.methods import for_method

    return for_method(name)


def _seqlens(text: str) -> list[int]:
    """"8K,32K,131072" -> [8192, 32768, 131072]."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        scale = {"k": 1024, "m": 1024 * 1024}.get(item[-1].lower(), 1)
        try:
            out.append(int(item[:-1] if scale > 1 else item) * scale)
        except ValueError:
            raise ValueError(f"--seqlens: expected lengths like 8K,32K,131072, got {item!r}") from None
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `sparseprefill bench` (each suite adds its own options, `Suite.options`)."""
    names = suite_names()
    parser.add_argument("suites", nargs="*", metavar="SUITE",
                        help=f"suites to run, in order (default {DEFAULT_SUITE}): {', '.join(names)}")
    parser.add_argument("--method", default=None, help="alias of the suite NAME (a registered method)")
    parser.add_argument("--distributed", action="store_true", help="alias of the suite `distributed`")
    parser.add_argument("--methods", default=None,
                        help="comma-separated registered methods the suites run (default: every one)")
    parser.add_argument("--seqlens", default=None,
                        help="comma-separated lengths, e.g. 8K,32K,128K (default: each suite's)")
    parser.add_argument("--batch", type=int, default=None, help="batch size B (default 1)")
    parser.add_argument("--q-heads", type=int, default=None, help="query heads Hq (default 32)")
    parser.add_argument("--kv-heads", type=int, default=None, help="KV heads Hkv, dividing Hq (default 8)")
    parser.add_argument("--head-dim", type=int, default=None, help="head dimension D (default 128)")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default=None, help="default bf16")
    parser.add_argument("--workload", choices=["synthetic", "calibrated"], default="synthetic",
                        help="inputs: synthetic (demo.synthetic_qkv, default) or calibrated (sparseprefill.workload, "
                             "fitted to captured attention)")
    parser.add_argument("--qkv", default=None,
                        help="inputs from a capture (sparseprefill eval capture): its layers as the batch, the "
                             "first N tokens (N <= the capture's)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="cuda (default) or cpu: tiny sizes under TRITON_INTERPRET=1, wall-clock times, math "
                             f"SDPA as the baseline (defaults then {CPU_SHAPE})")
    parser.add_argument("--rep", type=int, default=300,
                        help="milliseconds do_bench spends per measurement (default 300; 50 for a quick run)")
    parser.add_argument("--no-recall", action="store_true", help="skip recall (costly at long N)")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    parser.add_argument("--json", default=None,
                        help="write rows and environment as JSON here; rows are also appended to the same path "
                             "with the suffix .jsonl as they are measured")
    parser.add_argument("--resume", action="store_true",
                        help="skip the pieces already in the .jsonl of --json (same shape and workload)")
    parser.add_argument("--plot", default=None, help="draw each row's speedup over cuDNN and its floor ratio (PNG)")
    options: list[tuple[str, Option]] = []
    for name in names:
        try:
            suite = load_suite(name)
        except ImportError as exc:  # a suite whose module cannot import here: listed, not offered
            parser.epilog = (parser.epilog or "") + f" [{name}: {exc}]"
            continue
        options += [(name, opt) for opt in suite.options]
    seen: dict[str, Option] = {}
    for name, opt in options:
        if opt.flag in seen:
            if seen[opt.flag].dest != opt.dest:
                raise ValueError(f"suite {name}: option {opt.flag} means {opt.dest}, another suite's "
                                 f"{seen[opt.flag].dest}")
            continue
        seen[opt.flag] = opt
        shared = sum(o.flag == opt.flag for _, o in options) > 1
        default = "" if opt.default in (None, "") or shared else f" (default {opt.default})"
        parser.add_argument(opt.flag, dest=opt.dest, type=opt.type, default=None, help=opt.help + default)


def _chosen_suites(args: argparse.Namespace) -> list[str]:
    chosen = list(args.suites)
    if args.method:
        chosen.append(args.method)
    if args.distributed:
        chosen.append("distributed")
    return chosen or [DEFAULT_SUITE]


def _context(args: argparse.Namespace) -> Context:
    cpu = args.device == "cpu"
    shape: dict[str, Any] = dict(GPU_SHAPE)
    if cpu:
        shape.update((key, val) for key, val in CPU_SHAPE.items() if key != "seqlens")
    for key in shape:
        given = getattr(args, key)
        if given is not None:
            shape[key] = given
    dtype = torch.bfloat16 if shape["dtype"] == "bf16" else torch.float16
    methods = tuple(m for m in str(args.methods).split(",") if m) if args.methods else None
    return Context(device=torch.device("cpu" if cpu else "cuda"), batch=int(shape["batch"]),
                   q_heads=int(shape["q_heads"]), kv_heads=int(shape["kv_heads"]), head_dim=int(shape["head_dim"]),
                   dtype=dtype, workload=args.workload, qkv=args.qkv, methods=methods,
                   with_recall=not args.no_recall, flex=not args.no_flex, rep=int(args.rep))


def jsonl_path(json_path: str | Path) -> Path:
    """Where rows are appended as they are measured: `--json`'s path with the suffix `.jsonl`."""
    return Path(json_path).with_suffix(".jsonl")


class Progress:
    """Progress lines: units done, elapsed time and an estimate of the time left."""

    def __init__(self, total: int, log: Callable[[str], None]) -> None:
        self.total, self.done, self.measured, self.log = total, 0, 0, log
        self.start = time.perf_counter()

    def step(self, suite: str, unit: Unit, seconds: float | None) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self.start
        if seconds is None:
            what = "from the earlier run"
        else:
            self.measured += 1
            what = f"{seconds:.1f} s"
        left = elapsed / self.measured * (self.total - self.done) if self.measured else math.nan
        self.log(f"[{suite} {self.done}/{self.total}] N={unit.seqlen} {unit.key.split('/', 1)[-1]}: {what}; "
                 f"elapsed {_clock(elapsed)}, left ~{_clock(left)}")


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}:{secs:02d}"


class Sink:
    """The `.jsonl` file rows go to as they are measured (nothing without `--json`).

    With `resume`, the pieces an earlier run finished are read back (`done`); otherwise
    the file starts empty. Only rank 0 of a distributed run writes.
    """

    def __init__(self, path: Path | None, arguments: dict[str, Any], *, resume: bool) -> None:
        self.path, self.arguments, self.resume = path, arguments, resume
        self.done: dict[tuple[str, str], list[Row]] = {}
        self._started = False
        if path is None or not (resume and path.exists()):
            return
        pending: dict[tuple[str, str], list[Row]] = {}
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            entry = json.loads(line)
            if "arguments" in entry:
                _check_resumable(entry["arguments"], arguments, path)
                continue
            key = (str(entry["suite"]), str(entry["unit"]))
            if "row" in entry:
                pending.setdefault(key, []).append(Row.from_json(entry["row"]))
            elif "done" in entry:
                self.done[key] = pending.pop(key, [])

    def _append(self, entry: dict[str, Any]) -> None:
        assert self.path is not None
        if not self._started:
            self._started = True
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not (self.resume and self.path.exists()):
                self.path.write_text("")
            self._append({"arguments": self.arguments})
        with self.path.open("a") as fh:
            fh.write(json.dumps(entry) + "\n")

    def write(self, ctx: Context, suite: str, key: str, rows: list[Row], seconds: float) -> None:
        """Append one finished piece's rows and its end marker (rank 0 only)."""
        if self.path is None or ctx.rank != 0:
            return
        for row in rows:
            self._append({"suite": suite, "unit": key, "row": row.as_json()})
        self._append({"suite": suite, "unit": key, "done": len(rows), "seconds": round(seconds, 3)})


# The arguments that must match for `--resume` to continue a run.
_SHAPE_KEYS = ("batch", "q_heads", "kv_heads", "head_dim", "dtype", "workload", "qkv", "device")


def _check_resumable(before: dict[str, Any], now: dict[str, Any], path: Path) -> None:
    differ = {key: (before.get(key), now.get(key)) for key in _SHAPE_KEYS if before.get(key) != now.get(key)}
    if differ:
        raise SystemExit(f"--resume: {path} was written with other inputs {differ} (before, now); "
                         "start a new --json or repeat the earlier run's options")


def run_suite(suite: Suite, ctx: Context, seqlens: Sequence[int], options: dict[str, Any] | None = None, *,
              sink: Sink | None = None, progress: Progress | None = None) -> list[Row]:
    """Run one suite's units in `ctx`; the rows (those of units done earlier read back from `sink`).

    Args:
        options: the suite's option values (missing ones take their defaults).
    """
    given = dict(options or {})
    opts = {opt.dest: given.get(opt.dest) if given.get(opt.dest) is not None else opt.default
            for opt in suite.options}
    unknown = set(given) - set(opts)
    if unknown:
        raise TypeError(f"suite {suite.name} has no options {sorted(unknown)}; it takes {sorted(opts)}")
    ctx.suite = suite.name
    if suite.prepare is not None:
        suite.prepare(ctx, opts)
    units = suite.units(ctx, list(seqlens), **opts)
    keys = [u.key for u in units]
    if len(set(keys)) != len(keys):
        raise ValueError(f"suite {suite.name}: unit keys repeat: {keys}")
    progress = progress or Progress(len(units), ctx.log if ctx.rank == 0 else (lambda line: None))
    rows: list[Row] = []
    for unit in units:
        earlier = None if sink is None else sink.done.get((suite.name, unit.key))
        if earlier is not None:
            for row in earlier:
                ctx.remember(row)
            rows += earlier
            progress.step(suite.name, unit, None)
            continue
        start = time.perf_counter()
        got = unit.run()
        for row in got:
            row.suite = row.suite or suite.name
        seconds = time.perf_counter() - start
        if sink is not None:
            sink.write(ctx, suite.name, unit.key, got, seconds)
        rows += got
        progress.step(suite.name, unit, seconds)
    return rows


def run(args: argparse.Namespace) -> int:
    """Entry point of `sparseprefill bench`."""
    chosen = _chosen_suites(args)
    if args.device is None:
        args.device = "cuda"
    if args.device == "cpu":
        from ..demo import enable_interpreter

        enable_interpreter()
    elif not torch.cuda.is_available():
        print("sparseprefill bench times kernels against cuDNN SDPA and needs a CUDA GPU "
              "(`--device cpu` runs the suites at tiny sizes under the Triton interpreter).", file=sys.stderr)
        return 2
    suites = [load_suite(name) for name in chosen]
    ctx = _context(args)
    ctx.method_names()  # an unknown --methods name fails before anything runs
    arguments = {key: val for key, val in vars(args).items() if not callable(val)}
    arguments.update(device=args.device, dtype=str(ctx.dtype), batch=ctx.batch, q_heads=ctx.q_heads,
                     kv_heads=ctx.kv_heads, head_dim=ctx.head_dim)
    rows: list[Row] = []
    summaries: list[str] = []
    sink = Sink(jsonl_path(args.json) if args.json else None, arguments, resume=args.resume)
    for suite in suites:
        text = args.seqlens or (CPU_SHAPE["seqlens"] if ctx.device.type == "cpu" else None)
        seqlens = _seqlens(str(text)) if text else list(suite.seqlens)
        options = {opt.dest: getattr(args, opt.dest, None) for opt in suite.options}
        got = run_suite(suite, ctx, seqlens, options, sink=sink)
        rows += got
        if suite.summary is not None:
            summaries.append(suite.summary(got))
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # a suite under torchrun joined a process group
        dist.barrier()
        dist.destroy_process_group()
    if ctx.rank != 0:
        return 0
    print(format_table(rows))
    for text in summaries:
        print(text)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        payload = {"environment": environment(), "arguments": arguments,
                   "suites": {s.name: s.about for s in suites}, "rows": [r.as_json() for r in rows]}
        out.write_text(json.dumps(payload, indent=1))
        log_stderr(f"wrote {out} and {jsonl_path(out)}")
    if args.plot:
        log_stderr(f"wrote {plot_rows(rows, args.plot)}")
    return 0


def plot_rows(rows: Sequence[Row], path: str | Path) -> Path:
    """Each row's speedup over the baseline (bars) and its ratio to the floor (text), one panel
    per N; rows without a time (a failure, a stage) are left out.

    Returns:
        The path written.

    Raises:
        ValueError: no row has a speedup to draw.
    """
    drawn = [r for r in rows if r.speedup_vs_cudnn is not None and r.impl != r.baseline]
    if not drawn:
        raise ValueError("--plot: no row has a speedup over the baseline to draw")
    import matplotlib

    matplotlib.use("Agg")  # no display on GPU servers and CI
    import matplotlib.pyplot as plt

    lengths = sorted({r.seqlen for r in drawn})
    height = max(2.5, 0.28 * max(sum(r.seqlen == n for r in drawn) for n in lengths) + 1.2)
    fig, axes = plt.subplots(1, len(lengths), figsize=(6.5 * len(lengths), height), squeeze=False,
                             layout="constrained")
    for ax, n in zip(axes[0], lengths):
        mine = [r for r in drawn if r.seqlen == n]
        labels = [f"{r.method} ({r.impl})" if r.impl != "sparseprefill" else r.method for r in mine]
        speed = [float(r.speedup_vs_cudnn or 0.0) for r in mine]
        ax.barh(range(len(mine)), speed, color=["#4c72b0" if r.impl == "sparseprefill" else "#999999" for r in mine])
        for i, r in enumerate(mine):
            if r.vs_floor is not None:
                ax.text(speed[i], i, f" {r.vs_floor:.2f}x floor", va="center", fontsize=7)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_yticks(range(len(mine)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(f"speedup over {mine[0].baseline} (same run)")
        ax.set_title(f"N = {n}", fontsize=9)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparseprefill bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
