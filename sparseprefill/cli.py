"""The `sparseprefill` command: one subcommand per module.

Every subcommand lives in its own module exposing
`add_arguments(parser: argparse.ArgumentParser) -> None` and
`run(args: argparse.Namespace) -> int`, and is imported only when it is the one
asked for: `demo` must set `TRITON_INTERPRET` before Triton is imported, and
`bench` needs a GPU stack that `demo --help` should not pay for. Adding a command
(`search`, `show`, `eval`) is one module plus one `Command` line in `COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

from . import __version__


@dataclass(frozen=True)
class Command:
    """A subcommand: its name, one-line help and the module that implements it."""

    name: str
    help: str
    module: str

    def load(self) -> ModuleType:
        """Import the implementing module.

        Raises:
            SystemExit: the module is missing or lacks `add_arguments`/`run`.
        """
        try:
            mod = importlib.import_module(self.module)
        except ModuleNotFoundError as exc:
            if exc.name != self.module:
                raise
            raise SystemExit(f"sparseprefill {self.name}: not available in this build ({exc})") from exc
        for attr in ("add_arguments", "run"):
            if not callable(getattr(mod, attr, None)):
                raise SystemExit(f"sparseprefill {self.name}: {self.module}.{attr} is missing")
        return mod


COMMANDS: tuple[Command, ...] = (
    Command("demo", "run every method on a built-in workload; print a table, save a PNG of the masks",
            "sparseprefill.demo"),
    Command("bench", "GPU benchmark suites (kernels, methods, a method, estimates, floor, variants, serving, "
                     "scale, delta, peers, distributed), every row beside cuDNN SDPA",
            "sparseprefill.bench"),
    Command("search", "offline kernel-aware MInference pattern search (Alg. 1); writes a JSON config",
            "sparseprefill.search"),
    Command("tune", "offline SampleAttention tuning per length range (Table 6); writes a settings JSON",
            "sparseprefill.tune"),
    Command("calibrate", "per-layer, per-head settings of any method from captured q/k (target recall / "
            "error, dense fallback); writes a JSON config for patch, with a held-out check (--eval)",
            "sparseprefill.calibrate"),
    Command("eval", "accuracy on a real model (SmolLM2): q/k/v capture, method table, passkey, perplexity; "
            "unit bounds, held-out tables, every layer of one prefill", "sparseprefill.evaluate"),
    Command("cluster", "SharePrefill's offline head clustering (attention maps, autoencoder, fcluster); "
                       "writes a ClusterLayout JSON", "sparseprefill.cluster"),
    Command("compare", "every method's knob sweep on the same attention: recall, density, error, speed vs the "
            "oracle; equal recall, equal density", "sparseprefill.compare"),
    Command("workload", "the calibrated workload: fit it to a capture, accept it against the capture, table the fits",
            "sparseprefill.workload_cli"),
)


def _chosen(argv: Sequence[str]) -> Command | None:
    """The subcommand named in `argv` (its first non-option word), if any."""
    for word in argv:
        if not word.startswith("-"):
            return next((c for c in COMMANDS if c.name == word), None)
    return None


def build_parser(argv: Sequence[str] = ()) -> tuple[argparse.ArgumentParser, ModuleType | None]:
    """The argument parser, with full options only for the subcommand named in `argv`.

    Returns:
        (parser, the chosen subcommand's module or None).
    """
    parser = argparse.ArgumentParser(
        prog="sparseprefill",
        description="Training-free sparse attention for long-context prefill.",
    )
    parser.add_argument("--version", action="version", version=f"sparseprefill {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = _chosen(argv)
    module = None
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        if cmd is chosen:
            module = cmd.load()
            module.add_arguments(p)
    return parser, module


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `sparseprefill` console script; returns the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser, module = build_parser(args_list)
    args = parser.parse_args(args_list)
    assert module is not None, "argparse accepted a command that build_parser did not load"
    return int(module.run(args))


if __name__ == "__main__":
    sys.exit(main())
