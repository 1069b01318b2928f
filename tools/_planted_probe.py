"""pytest plugin of `tools/planted_bugs.py`: counts examples per conformance property.

Loaded with `-p _planted_probe` in a scratch copy of the repository. It checks that
`sparseprefill` is imported from that copy (not the installed package), wraps every
`Property.run` to count the examples each (method, property) ran and the example at
which it first failed, and writes them to `$PLANTED_PROBE_OUT` (JSON) after every
test, so a run that crashes still leaves what it saw. `$PLANTED_PROBE_OUT.current`
names the test in progress (a crash is attributed to it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RESULTS: dict[str, dict[str, Any]] = {}


def _out() -> Path:
    return Path(os.environ["PLANTED_PROBE_OUT"])


def _wrap(prop: Any) -> None:
    real = prop.run

    def run(draw: Any, caps: Any, spec: Any) -> float:
        key = f"{spec.name if spec is not None else 'kernel'}/{prop.name}"
        rec = RESULTS.setdefault(key, {"examples": 0, "failed_at": None, "error": None})
        rec["examples"] += 1
        try:
            return float(real(draw, caps, spec))
        except Exception as err:  # any exception fails the property (AssertionError or a crash)
            if rec["failed_at"] is None:
                rec["failed_at"] = rec["examples"]
                rec["error"] = f"{type(err).__name__}: {str(err)[:400]}"
            raise

    object.__setattr__(prop, "run", run)


def pytest_configure(config: Any) -> None:
    import sparseprefill
    from sparseprefill.conformance import properties

    root = os.environ["PLANTED_PROBE_ROOT"]
    where = str(Path(sparseprefill.__file__).resolve())
    if not where.startswith(str(Path(root).resolve())):
        raise RuntimeError(f"sparseprefill was imported from {where}, not from the scratch copy {root}")
    for prop in properties.PROPERTIES:
        _wrap(prop)


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    Path(str(_out()) + ".current").write_text(nodeid)


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    _out().write_text(json.dumps(RESULTS, indent=1, sort_keys=True))
