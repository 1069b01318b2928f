"""tools/planted_bugs.py: every planted bug still applies to the code, and lands in the
scratch copy's installed layout (the harness itself runs outside CI; docs/conformance.md)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "planted_bugs.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("planted_bugs", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["planted_bugs"] = module
    spec.loader.exec_module(module)
    return module


pytestmark = pytest.mark.skipif(not TOOL.exists(), reason="tools/planted_bugs.py is not in this checkout")


def test_every_bug_applies_once_and_changes_one_line() -> None:
    """A code change that moves a planted bug's snippet fails here: update tools/planted_bugs.py."""
    tool = _tool()
    names = tool.bug_by_name()
    assert len(names) == len(tool.BUGS) >= 60
    for bug in tool.BUGS:
        text = (ROOT / bug.file).read_text()
        planted = tool.apply(text, bug)
        changed = [(a, b) for a, b in zip(text.splitlines(), planted.splitlines()) if a != b]
        assert len(planted.splitlines()) == len(text.splitlines()), bug.name
        assert len(changed) == 1, f"{bug.name} changes {len(changed)} lines"
        assert bug.description and bug.target


def test_apply_refuses_a_missing_or_ambiguous_snippet() -> None:
    tool = _tool()
    bug = tool.Bug("x", "kernel", "f.py", "a = 1", "a = 2", "d")
    assert tool.apply("a = 1\n", bug) == "a = 2\n"
    with pytest.raises(ValueError, match="found 0 times"):
        tool.apply("b = 1\n", bug)
    with pytest.raises(ValueError, match="found 2 times"):
        tool.apply("a = 1\na = 1\n", bug)
    second = tool.Bug("x", "kernel", "f.py", "a = 1", "a = 2", "d", occurrence=2)
    assert tool.apply("a = 1\na = 1\n", second) == "a = 1\na = 2\n"


def test_plant_writes_the_installed_layout(tmp_path: Path) -> None:
    tool = _tool()
    bug = tool.bug_by_name()["kernel-causal-off-by-one"]
    pkg = tool.plant(ROOT, tmp_path, bug)
    planted = pkg / "sparseprefill" / "fast" / "kernels" / "block_column.py"
    assert bug.replacement in planted.read_text()
    assert bug.snippet in (ROOT / bug.file).read_text()
    assert (pkg / "sparseprefill" / "reference" / "plan.py").exists()
    assert (pkg / "sparseprefill" / "conformance" / "properties.py").exists()
    assert (tmp_path / "tests" / "test_conformance.py").exists()


def test_each_bug_selects_its_own_properties() -> None:
    """Shared-mechanism bugs run the kernel properties, method bugs their method's (and the
    methods in `also`); every target is a registered method or a shared target."""
    from sparseprefill.conformance import METHODS

    tool = _tool()
    assert tool.target_select("kernel") == "test_kernel_property"
    assert tool.target_select("a_shape") == "test_method_property and a_shape"
    assert tool.target_select("xattention") == "test_method_property and xattention and not delta_xattention"
    assert tool.target_select("kernel", "delta_kv") == \
        "test_kernel_property or (test_method_property and (delta_kv))"
    for bug in tool.BUGS:
        assert bug.target in METHODS or bug.target in tool.SHARED_TARGETS, bug.name
        assert all(m in METHODS for m in bug.also.split(",") if m), bug.name


def test_bug_classes_and_summary() -> None:
    """Every bug has a class among `BUG_CLASSES`; `--summary` counts caught bugs per class over
    the bugs present in every payload (before / after), leaving the control out."""
    tool = _tool()
    assert {tool.bug_class(b) for b in tool.BUGS} <= set(tool.BUG_CLASSES)
    assert tool.bug_class(tool.bug_by_name()["kernel-causal-off-by-one"]) == "kernel"
    assert tool.bug_class(tool.bug_by_name()["plan-validate-order"]) == "shared"
    assert tool.bug_class(tool.bug_by_name()["vs-last-vertical-dropped"]) == "estimator"
    assert tool.bug_class(tool.bug_by_name()["sample-tile-table-key-block"]) == "state"
    assert {b.group for b in tool.BUGS} == {"core", "recent"}

    def result(name: str, caught: bool) -> dict[str, object]:
        return {"bug": name, "caught": caught, "caught_by": {}, "seconds": 1.0}

    before = {"commit": "a", "examples": 12, "results": [result("control", False),
              result("kernel-causal-off-by-one", True), result("sample-tile-table-key-block", False),
              result("vs-last-vertical-dropped", True)]}
    after = {"commit": "b", "examples": 12, "results": [result("kernel-causal-off-by-one", True),
             result("sample-tile-table-key-block", True)]}
    table = tool.summary_table([before, after])
    assert "| kernel | 1 | 1 | 1 |" in table and "| state | 1 | 0 | 1 |" in table
    assert "| all | 2 | 1 | 2 |" in table and "estimator" not in table
