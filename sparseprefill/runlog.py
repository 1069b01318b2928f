"""Long runs that report as they go: rows written as measured, progress, resume.

A long command (`compare`, `calibrate`) writes every row the moment it is measured as one
JSON line to `rows_path(PATH)` (`PATH` with the suffix `.jsonl`, beside the final JSON), so
a run stopped at any point keeps what it measured. The file's first line is a header:
the settings that decide what a row holds. `RowLog(..., resume=True)` reads the rows back
(refusing a file made with other settings) and the command skips what they cover;
without `resume` the file is started afresh. `Progress` prints each step with the time
spent and an estimate of the time left (rows read back do not count in the rate).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

HEADER = "header"


def rows_path(path: Path) -> Path:
    """Where the rows of a run whose final JSON is `path` go: `path` with suffix `.jsonl`."""
    return path.with_suffix(".jsonl")


def _plain(value: Any) -> Any:
    """`value` as JSON gives it back (tuples as lists, other objects as text)."""
    return json.loads(json.dumps(value, default=str))


class RowLog:
    """The rows of one run in a JSON-lines file (see the module doc).

    Attributes:
        path: the `.jsonl` file, or None (rows kept in memory only).
        header: the run's settings (JSON form).
        rows: the rows read back with `resume`, then every row appended.
    """

    def __init__(self, path: Path | None, header: Mapping[str, Any], *, resume: bool = False,
                 log: Callable[[str], None] | None = None) -> None:
        """Open the rows file.

        Args:
            path: the `.jsonl` file (None: nothing is written, `resume` must be False).
            header: the settings that decide what a row holds; a resumed file must have
                the same.
            resume: read the rows already in `path` (a missing file starts afresh).
            log: where notes go (default stderr).

        Raises:
            ValueError: `resume` without a path, a file that is not a rows file, or one
                whose header differs (the message names the first differing setting).
        """
        self.path = path
        self.header: dict[str, Any] = _plain(dict(header))
        self.rows: list[dict[str, Any]] = []
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        if resume and path is None:
            raise ValueError("--resume needs the output path (--json / --table): the rows are read from "
                             "the .jsonl beside it")
        if path is None:
            return
        if resume and path.exists():
            self.rows = self._read(path)
            self._log(f"resuming from {path}: {len(self.rows)} row(s) already measured")
            return
        if path.exists():
            self._log(f"{path} exists: starting it afresh (--resume keeps its rows)")
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as fh:
            fh.write(json.dumps({HEADER: self.header}) + "\n")

    def _read(self, path: Path) -> list[dict[str, Any]]:
        lines = path.read_text().splitlines()
        try:
            first = json.loads(lines[0]) if lines else None
        except json.JSONDecodeError:
            first = None
        if not isinstance(first, dict) or not isinstance(first.get(HEADER), dict):
            raise ValueError(f"{path}: not a rows file of this command (its first line must be a header)")
        old = first[HEADER]
        for key in sorted(set(old) | set(self.header)):
            if old.get(key) != self.header.get(key):
                raise ValueError(f"{path}: made with {key} = {old.get(key)!r}, this run has "
                                 f"{self.header.get(key)!r}; rerun with the same settings, or without --resume "
                                 "to start afresh")
        rows = []
        for i, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if i == len(lines):  # a run killed while writing its last line
                    self._log(f"{path}: line {i} is cut short (the run was stopped while writing it); dropped")
                    continue
                raise ValueError(f"{path}: line {i} is not JSON") from None
        # Rewrite without a cut-short tail, so the next appended row starts on a line of its own.
        with path.open("w") as fh:
            fh.write(json.dumps({HEADER: old}) + "\n")
            for row in rows:
                fh.write(json.dumps(row) + "\n")
        return rows

    def append(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """Write one row now (one line, flushed) and keep it; returns its JSON form."""
        plain: dict[str, Any] = _plain(dict(row))
        self.rows.append(plain)
        if self.path is not None:
            with self.path.open("a") as fh:
                fh.write(json.dumps(plain) + "\n")
                fh.flush()
        return plain

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        """The rows whose "kind" is `kind`."""
        return [row for row in self.rows if row.get("kind") == kind]


def duration(seconds: float) -> str:
    """`seconds` as `42s`, `3m05s` or `1h02m`."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Steps done of a known total, with the time spent and an estimate of the time left.

    The estimate is the mean time of the steps measured in this run times the steps
    left; steps skipped (rows read back by `--resume`) leave the total without counting
    in that mean.
    """

    def __init__(self, total: int, *, out: TextIO | None = None, clock: Callable[[], float] = time.perf_counter,
                 what: str = "step") -> None:
        self.total = max(0, int(total))
        self.done = 0
        self.measured = 0
        self._out = out
        self._clock = clock
        self._start = clock()
        self.what = what

    @property
    def elapsed(self) -> float:
        return self._clock() - self._start

    def left(self) -> float | None:
        """Seconds left by the estimate, None before the first measured step."""
        if self.measured == 0:
            return None
        return self.elapsed / self.measured * max(0, self.total - self.done)

    def status(self) -> str:
        """`[3/12 steps, 1m05s spent, ~4m20s left]`."""
        left = self.left()
        tail = "" if left is None else f", ~{duration(left)} left"
        return f"[{self.done}/{self.total} {self.what}s, {duration(self.elapsed)} spent{tail}]"

    def skip(self, n: int = 1) -> None:
        """`n` steps already done (read back): out of the total, out of the rate."""
        self.total = max(self.done, self.total - n)

    def step(self, note: str = "", n: int = 1) -> str:
        """`n` steps measured; prints and returns the status line with `note`."""
        self.done += n
        self.measured += n
        line = f"{self.status()} {note}".rstrip()
        print(line, file=self._out if self._out is not None else sys.stderr, flush=True)
        return line
