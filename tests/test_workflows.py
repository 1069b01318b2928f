"""The GPU workflow and `benches/gpu.sh` say the same thing.

`.github/workflows/gpu.yml` runs each GPU step as `bash benches/gpu.sh STEP`; the script
holds the commands and their time limits. These checks keep the two in step: the
workflow runs exactly the script's workflow steps, in its order; every step the script
names has a command and a limit; the workflow's steps fit its job's time limit; and the
commands name only suites, options and files that exist.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benches" / "gpu.sh"
WORKFLOW = ROOT / ".github" / "workflows" / "gpu.yml"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def script_array(name: str) -> list[str]:
    match = re.search(rf"^{name}=\(([^)]*)\)", SCRIPT.read_text(), re.M)
    assert match, name
    return match.group(1).split()


def listed() -> dict[str, tuple[int, str]]:
    """`gpu.sh --list`: step -> (limit in seconds, command)."""
    out = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True, check=True).stdout
    steps = {}
    for line in out.splitlines():
        step, limit, command = re.match(r"(\S+)\s+(\d+)s\s+(.*)", line).groups()  # type: ignore[union-attr]
        steps[step] = (int(limit), command)
    return steps


def workflow_steps() -> list[str]:
    return re.findall(r"run: bash benches/gpu\.sh (\S+)\s*$", WORKFLOW.read_text(), re.M)


def test_the_workflow_runs_the_scripts_workflow_steps_in_order() -> None:
    assert workflow_steps() == script_array("WORKFLOW")
    # Nothing GPU-side runs in the workflow except through the script.
    runs = re.findall(r"^\s+run: (.*)$", WORKFLOW.read_text(), re.M)
    assert all(r.startswith("bash benches/gpu.sh ") or r == "|" for r in runs), runs


def test_every_step_has_a_command_and_a_limit_and_the_workflow_fits() -> None:
    steps = listed()
    assert set(script_array("WORKFLOW")) | set(script_array("EXTRA")) <= set(steps)
    for step, (limit, command) in steps.items():
        assert 0 < limit <= 600 and command, step  # one device call runs at most 10 minutes
    total = sum(steps[s][0] for s in script_array("WORKFLOW"))
    job = int(re.search(r"timeout-minutes: (\d+)", WORKFLOW.read_text()).group(1))  # type: ignore[union-attr]
    # The steps' limits leave a quarter of the job's limit for checkout, install and artifacts.
    assert total <= 0.75 * job * 60, (total, job)


def test_the_commands_name_what_exists() -> None:
    from sparseprefill import bench

    names = set(bench.suite_names())
    parser = __import__("argparse").ArgumentParser()
    bench.add_arguments(parser)
    flags = {flag for action in parser._actions for flag in action.option_strings}
    for step, (_, command) in listed().items():
        for part in command.split("&&"):
            words = part.split()
            if "sparseprefill.cli" in words and words[words.index("sparseprefill.cli") + 1] == "bench":
                args = words[words.index("sparseprefill.cli") + 2:]
                suites = [w for w in args if not w.startswith("-") and not w.startswith("$") and "/" not in w
                          and not re.fullmatch(r"[\d.K,M]+", w)]
                assert set(suites) <= names | {"SUITES"}, (step, suites)
                assert {w for w in args if w.startswith("--")} <= flags, step
            for word in words:
                if word.startswith(("benches/", "tests")) and not word.startswith("tests"):
                    assert (ROOT / word.rstrip("/")).exists(), (step, word)


def test_unknown_steps_are_refused_before_anything_runs() -> None:
    proc = subprocess.run(["bash", str(SCRIPT), "no-such-step"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": "true"})
    assert proc.returncode == 2 and "unknown step" in proc.stderr and "===" not in proc.stdout
