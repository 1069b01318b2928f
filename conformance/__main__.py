"""Conformance runner: every property for every registered method, with a table.

    python -m sparseprefill.conformance --device cuda --max-seqlen 16384 --examples 200
    python -m sparseprefill.conformance --device cpu --max-seqlen 128 --examples 5

Prints one row per (method, property): examples run, PASS/FAIL, the largest
error / allowance ratio (see `tolerance`), seconds; exits 1 if anything failed.
Kernel-only properties (random plans, dense masks) run once, as method "kernel".
On CPU the Triton kernels need `TRITON_INTERPRET=1` before triton is imported;
`--device cpu` sets it and restarts the interpreter process if triton was already
loaded without it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Result:
    """Outcome of one (method, property) run."""

    method: str
    prop: str
    examples: int = 0
    passed: bool = True
    max_ratio: float = 0.0
    seconds: float = 0.0
    error: str = ""
    notes: list[str] = field(default_factory=list)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sparseprefill.conformance",
                                description="Check that sparseprefill.fast agrees with reference.")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--max-seqlen", type=int, default=16384, help="largest N drawn")
    p.add_argument("--examples", type=int, default=200, help="Hypothesis examples per row")
    p.add_argument("--methods", default="", help="comma-separated method names (default: all)")
    p.add_argument("--properties", default="", help="comma-separated property names (default: all)")
    p.add_argument("--no-kernel", action="store_true", help="skip the kernel-only properties")
    p.add_argument("--seed", type=int, default=None,
                   help="Hypothesis seed (default: derandomized, the same examples every run)")
    p.add_argument("--shrink", action="store_true", help="shrink failing examples (slower)")
    p.add_argument("--max-mask-elements", type=int, default=2**30,
                   help="cap on B*Hq*N*N of the reference's dense masks")
    p.add_argument("--max-tile-steps", type=int, default=None,
                   help="cap on kernel tile steps per example (default: 100 on cpu, none on cuda)")
    p.add_argument("--row-budget", type=float, default=None,
                   help="seconds per (method, property) row: examples run in seeded chunks "
                        "of 10 and no chunk starts after the budget")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--list", action="store_true", help="list methods and properties, then exit")
    return p.parse_args(argv)


def _ensure_interpreter(argv: list[str] | None) -> bool:
    """Make the Triton kernels run in the CPU interpreter; False if that is impossible.

    `python -m` imports the package (and so triton) before this module runs, and
    triton reads TRITON_INTERPRET when a kernel is defined: set it and re-execute
    the command. Called as a function (`argv` given) there is no command to re-run.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
        return True
    if argv is not None:
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    os.execv(sys.executable, [sys.executable, "-m", "sparseprefill.conformance", *sys.argv[1:]])


def run_property(
    prop: Any, spec: Any, caps: Any, *, examples: int, seed: int | None, shrink: bool,
    budget_s: float | None = None,
) -> Result:
    """Run one property under Hypothesis and summarise it.

    Args:
        prop: a `properties.Property`. spec: its `MethodSpec` or None.
        caps: `strategies.Caps`. examples: Hypothesis `max_examples`.
        seed: Hypothesis seed, or None for derandomized runs. shrink: shrink failures.
        budget_s: with a budget, examples run in seeded chunks of 10 and no chunk
            starts after `budget_s` seconds (the result notes it).

    Returns:
        A `Result`; a failure keeps the exception text and Hypothesis's notes
        (the falsifying draws).
    """
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hyp_seed
    from hypothesis import strategies as st

    result = Result(method=spec.name if spec is not None else "kernel", prop=prop.name)
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])

    def hypothesis_run(max_examples: int, run_seed: int | None) -> None:
        @settings(max_examples=max_examples, deadline=None, derandomize=run_seed is None,
                  database=None, phases=phases, suppress_health_check=list(HealthCheck),
                  print_blob=False, report_multiple_bugs=False)
        @given(data=st.data())
        def check(data: Any) -> None:
            ratio = prop.run(data.draw, caps, spec)
            result.examples += 1
            result.max_ratio = max(result.max_ratio, ratio)

        (check if run_seed is None else hyp_seed(run_seed)(check))()

    start = time.perf_counter()
    try:
        if budget_s is None:
            hypothesis_run(examples, seed)
        else:
            # Seeded chunks keep every chunk reproducible while the budget cuts the row.
            for chunk, first in enumerate(range(0, examples, 10)):
                if time.perf_counter() - start > budget_s:
                    result.notes.append(f"the time budget ended the row after {first} examples")
                    break
                hypothesis_run(min(10, examples - first), (seed or 0) + chunk)
    except Exception as err:  # any exception of a property is a failure to report
        result.passed = False
        result.error = f"{type(err).__name__}: {err}"
        result.notes = [str(n) for n in getattr(err, "__notes__", [])]
        if not isinstance(err, AssertionError):
            result.notes.append(traceback.format_exc())
    result.seconds = time.perf_counter() - start
    return result


def _table(results: list[Result]) -> str:
    head = ("method", "property", "examples", "result", "max err/allowed", "seconds")
    rows = [head] + [
        (r.method, r.prop, str(r.examples), "PASS" if r.passed else "FAIL",
         f"{r.max_ratio:.3f}", f"{r.seconds:.1f}")
        for r in results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the conformance suite; return the process exit code (0: all passed)."""
    args = _parse(argv)
    if args.device == "cpu" and not _ensure_interpreter(argv):
        print("--device cpu needs TRITON_INTERPRET=1 set before triton is imported",
              file=sys.stderr)
        return 2

    import torch

    from .properties import PROPERTIES
    from .registry import METHODS
    from .strategies import Caps

    if args.list:
        for name, spec in METHODS.items():
            print(f"method    {name}: {spec.notes}")
        for prop in PROPERTIES:
            print(f"property  {prop.name} ({'per method' if prop.per_method else 'kernel'}): "
                  f"{prop.summary}")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device; use --device cpu (Triton interpreter)", file=sys.stderr)
        return 2
    names = [m for m in args.methods.split(",") if m] or list(METHODS)
    unknown = [m for m in names if m not in METHODS]
    wanted = [p for p in args.properties.split(",") if p]
    unknown += [p for p in wanted if p not in {prop.name for prop in PROPERTIES}]
    if unknown:
        print(f"unknown methods/properties: {unknown}; see --list", file=sys.stderr)
        return 2
    tile_cap = args.max_tile_steps if args.max_tile_steps is not None else (
        100 if args.device == "cpu" else None)
    caps = Caps(device=args.device, max_seqlen=args.max_seqlen,
                max_mask_elements=args.max_mask_elements, max_tile_steps=tile_cap)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (TRITON_INTERPRET=1)"
    print(f"sparseprefill conformance on {device_name}: N <= {caps.max_seqlen}, "
          f"{args.examples} examples per row, methods {names}", flush=True)

    jobs: list[tuple[Any, Any]] = []
    for prop in PROPERTIES:
        if wanted and prop.name not in wanted:
            continue
        if prop.per_method:
            jobs += [(prop, METHODS[m]) for m in names if prop.applies(METHODS[m])]
        elif not args.no_kernel:
            jobs.append((prop, None))
    results = []
    for prop, spec in jobs:
        r = run_property(prop, spec, caps, examples=args.examples, seed=args.seed, shrink=args.shrink,
                         budget_s=args.row_budget)
        status = "PASS" if r.passed else "FAIL"
        print(f"  {r.method:>16} {r.prop:<22} {status} {r.examples:>5} examples "
              f"max ratio {r.max_ratio:.3f} {r.seconds:.1f}s", flush=True)
        if not r.passed:
            print("    " + r.error.replace("\n", "\n    "))
        for note in r.notes:
            print("    " + note.replace("\n", "\n    "))
        results.append(r)
    print()
    print(_table(results))
    failed = [r for r in results if not r.passed]
    print(f"\n{len(results) - len(failed)} passed, {len(failed)} failed")
    if args.json:
        payload = {"device": device_name, "max_seqlen": caps.max_seqlen, "examples": args.examples,
                   "seed": args.seed, "results": [asdict(r) for r in results]}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
