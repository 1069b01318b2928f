"""One method, one place: a descriptor is all a new method needs, and no tool keeps a table.

* A toy method (a descriptor and its two plan functions, written to a temporary module)
  is seen by the conformance properties, the demo, compare, bench, `patch` and the
  custom ops, without editing any other file.
* No tool module names a method in a table, a dispatch or a choice list (an AST scan).
* Serving a model imports no Hypothesis.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import EXAMPLES
from sparseprefill import bench, methods
from sparseprefill.conformance import METHODS as CONFORMANCE
from sparseprefill.conformance import properties as props
from sparseprefill.conformance.strategies import Caps

ROOT = Path(__file__).resolve().parents[1]
TOY = "toy_block_window"

TOY_MODULE = f'''
"""A toy method: each query block keeps its own key block and the `blocks - 1` before it."""

import torch

from sparseprefill.methods import Method, SyncStatus, register
from sparseprefill.reference._checks import check_block_size, check_positive_int, check_qk
from sparseprefill.reference.plan import BlockColumnPlan, cdiv


def reference_plan(q: torch.Tensor, k: torch.Tensor, *, blocks: int = 2, block_size: int = 16) -> BlockColumnPlan:
    shape = check_qk(q, k)
    check_positive_int("blocks", blocks)
    bs = check_block_size("block_size", block_size)
    nb = cdiv(shape.seqlen, bs)
    i, j = torch.arange(nb)[:, None], torch.arange(nb)[None, :]
    keep = ((j <= i) & (j > i - blocks)).expand(q.shape[0], q.shape[1], nb, nb).to(q.device)
    return BlockColumnPlan.from_masks(keep, None, seqlen=shape.seqlen, block_m=bs, block_n=bs)


def fast_plan(q: torch.Tensor, k: torch.Tensor, *, blocks: int = 2, block_size: int = 16) -> BlockColumnPlan:
    shape = check_qk(q, k, dtypes=(torch.float16, torch.bfloat16))
    check_positive_int("blocks", blocks)
    bs = check_block_size("block_size", block_size)
    nb = cdiv(shape.seqlen, bs)
    i = torch.arange(nb, device=q.device)
    first = (i - blocks + 1).clamp(min=0)
    index = (first[:, None] + torch.arange(min(blocks, nb), device=q.device)[None, :]).clamp(max=nb - 1)
    b, h = q.shape[0], q.shape[1]
    return BlockColumnPlan(
        seqlen=shape.seqlen, block_m=bs, block_n=bs,
        block_count=(i - first + 1).to(torch.int32).expand(b, h, nb).contiguous(),
        block_index=index.to(torch.int32).expand(b, h, nb, -1),
        column_count=torch.zeros(b, h, nb, dtype=torch.int32, device=q.device),
        column_index=torch.zeros(b, h, nb, 0, dtype=torch.int32, device=q.device),
    )


METHOD = register(Method(
    name="{TOY}",
    notes="toy: the diagonal key block and the blocks - 1 before it",
    reference_plan=reference_plan,
    fast_plan=fast_plan,
    defaults=lambda n: {{"blocks": 2, "block_size": 16}},
    sweep=lambda n: [{{"blocks": b, "block_size": 16}} for b in (1, 2, 4)],
    chunked="nothing: the blocks are positions",
    sync=SyncStatus(),
))
'''


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[methods.Method]:
    folder = tmp_path_factory.mktemp("toy")
    (folder / "toy_method.py").write_text(TOY_MODULE)
    sys.path.insert(0, str(folder))
    try:
        module = importlib.import_module("toy_method")
        yield module.METHOD
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("toy_method", None)
        if TOY in methods.METHODS:
            methods.unregister(TOY)


def _qkv(n: int = 72, hq: int = 4, hkv: int = 2, d: int = 32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, n, d, generator=gen).half()
    k = torch.randn(2, hkv, n, d, generator=gen).half()
    v = torch.randn(2, hkv, n, d, generator=gen).half()
    return q, k, v


def test_toy_is_registered_with_a_derived_runner(toy: methods.Method) -> None:
    assert methods.get(TOY) is toy and list(methods.METHODS)[-1] == TOY
    q, k, v = _qkv()
    out = toy.run_fn("fast")(q, k, v, blocks=3)
    ref = toy.run_fn("reference")(q.float(), k.float(), v.float(), blocks=3)
    assert out.shape == q.shape and torch.allclose(out.float(), ref, atol=2e-2)
    assert toy.parameters() == ("blocks", "block_size", "scale")
    toy.check_params({"blocks": 2})
    with pytest.raises(TypeError, match="width"):
        toy.check_params({"width": 2})


@settings(max_examples=max(3, EXAMPLES // 3), deadline=None)
@given(data=st.data())
def test_toy_passes_every_conformance_property(cpu_caps: Caps, toy: methods.Method, data: Any) -> None:
    spec = CONFORMANCE[TOY]
    assert spec.exact_plans and spec.method is toy
    cases = [p for p in props.PROPERTIES if p.per_method and TOY in [s.name for s in p.cases(CONFORMANCE)]]
    assert {p.name for p in cases} == {"plan", "end_to_end", "recall_density", "sequence"}, cases
    for prop in cases:
        prop.run(data.draw, cpu_caps, spec)


def test_toy_in_the_demo(toy: methods.Method, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sparseprefill.cli import main

    code = main(["demo", "--methods", TOY, "--seqlen", "96", "--out", str(tmp_path)])
    assert code == 0
    table = capsys.readouterr().out
    assert TOY in table and "plans differ" not in table


def test_toy_in_compare(toy: methods.Method, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from sparseprefill.cli import main

    q, k, v = _qkv(n=80, hq=2, hkv=1, d=16)
    capture = tmp_path / "tiny.pt"
    torch.save({"layers": [0], "q": [q[:1]], "k": [k[:1]], "v": [v[:1]], "scale": [0.25],
                "meta": {"seqlen": 80}}, capture)
    out = tmp_path / "cmp.json"
    code = main(["compare", "--qkv", str(capture), "--methods", TOY, "--device", "cpu", "--json", str(out),
                 "--png", str(tmp_path / "cmp.png")])
    assert code == 0
    points = [p for p in json.loads(out.read_text())["points"] if p["method"] == TOY]
    assert len(points) == 3 and all(0 < p["density"] <= 1 for p in points)


def test_toy_in_bench(toy: methods.Method) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args([TOY]).suites == [TOY] and parser.parse_args(["--method", TOY]).method == TOY
    suite = bench.load_suite(TOY)  # no suite module of its own: the `methods` suite for it alone
    ctx = bench.Context(device=torch.device("cpu"), batch=1, q_heads=2, kv_heads=1, head_dim=32,
                        dtype=torch.float16, log=lambda s: None, timer=lambda fn: (fn(), 1.0)[1])
    rows = bench.run_suite(suite, ctx, [96])
    row = rows[-1]
    assert (row.method, row.impl, row.suite) == (TOY, "sparseprefill", TOY)
    assert 0 < row.density < 1 and row.recall_mean is not None and row.plan_ms == row.kernel_ms == 1.0
    assert row.vs_floor == pytest.approx(1.0 / row.density)
    ctx.methods = None
    names = [r.method for r in bench.run_suite(bench.load_suite("estimates"), ctx, [96])]
    assert TOY in names


def test_toy_as_a_custom_op(toy: methods.Method) -> None:
    from sparseprefill.fast import ops

    q, k, v = _qkv()
    want = toy.run_fn("fast")(q, k, v, blocks=2)
    got = ops.call(TOY, q, k, v, blocks=2)
    assert torch.equal(got, want)
    op = getattr(torch.ops.sparseprefill, TOY).default
    assert torch.Tag.cudagraph_unsafe not in op.tags  # its descriptor says: no host reads
    assert ops.capture_op(TOY) is getattr(torch.ops.sparseprefill, TOY)


def test_toy_through_patch(toy: methods.Method) -> None:
    pytest.importorskip("transformers", reason="the `hf` extra is not installed")
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparseprefill.integrations.transformers import patch, unpatch

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense = model(ids).logits
        patch(model, TOY, {"blocks": 100, "block_size": 16}, backend="reference", min_seqlen=1)
        try:
            full = model(ids).logits  # 100 blocks cover the whole triangle: dense attention
            patch_obj = model.__dict__["_sparseprefill_attention"]
            assert patch_obj is not None
        finally:
            unpatch(model)
        patch(model, TOY, {"blocks": 1, "block_size": 16}, backend="reference", min_seqlen=1)
        try:
            local = model(ids).logits
        finally:
            unpatch(model)
    assert torch.allclose(full, dense, atol=1e-4)
    assert not torch.allclose(local, dense, atol=1e-3)


# -- no method tables outside the descriptors -------------------------------------------

# The modules of the tools: they read the descriptors and name no method themselves. A
# method's own benchmark suite (`sparseprefill/bench/suites/<method>.py`) may name that
# method, and only that one (`_own_name`).
TOOL_MODULES = sorted(
    [p for p in (ROOT / "sparseprefill").glob("*.py")]
    + list((ROOT / "sparseprefill" / "integrations").glob("*.py"))
    + list((ROOT / "sparseprefill" / "bench").rglob("*.py"))
    + [ROOT / "fast" / "ops.py", ROOT / "conformance" / "__main__.py", ROOT / "conformance" / "properties.py",
       ROOT / "conformance" / "strategies.py", ROOT / "conformance" / "tolerance.py"]
)


def _own_name(path: Path) -> str:
    """The method a module may name: its own, for a method's suite module."""
    return path.stem if path.parent.name == "suites" else ""


def _method_name_uses(path: Path, names: set[str]) -> list[str]:
    """Places where a method name is a dict key, an element of a list/tuple/set literal, or
    compared with (`==`, `!=`, `in`): a table or a dispatch of the module's own. `__all__`
    (the module's exported names) is not a table of methods."""
    tree = ast.parse(path.read_text())
    exported = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)}
    hits: list[str] = []

    def named(node: ast.AST | None) -> str | None:
        return node.value if isinstance(node, ast.Constant) and node.value in names else None

    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            hits += [f"{path.name}:{key.lineno} dict key {named(key)!r}" for key in node.keys
                     if key is not None and named(key)]
        elif isinstance(node, (ast.List, ast.Tuple, ast.Set)) and id(node) not in exported:
            hits += [f"{path.name}:{e.lineno} element {named(e)!r}" for e in node.elts if named(e)]
        elif isinstance(node, ast.Compare):
            hits += [f"{path.name}:{side.lineno} compared with {named(side)!r}"
                     for side in [node.left, *node.comparators] if named(side)]
    return hits


def test_no_method_table_outside_the_descriptors() -> None:
    names = set(methods.METHODS)
    assert TOOL_MODULES and "dense" in names
    assert (ROOT / "sparseprefill" / "bench" / "suites" / "xattention.py") in TOOL_MODULES
    hits = [hit for path in TOOL_MODULES for hit in _method_name_uses(path, names - {_own_name(path)})]
    assert not hits, "method names in a tool's own table or dispatch (move the fact into the method's " \
                     f"descriptor, sparseprefill/methods/): {hits}"


def test_the_scan_finds_a_table() -> None:
    """The scan is not blind: it flags each form it looks for."""
    sample = textwrap.dedent('''
        SUITES = {"dense": 1}
        CHOICES = ["vertical_slash"]
        if method == "xattention":
            pass
    ''')
    path = Path(os.environ.get("TMPDIR", "/tmp")) / "sparseprefill_scan_sample.py"
    path.write_text(sample)
    try:
        hits = _method_name_uses(path, set(methods.METHODS))
    finally:
        path.unlink()
    assert len(hits) == 3, hits


def test_serving_imports_no_hypothesis() -> None:
    code = ("import sys; import sparseprefill.integrations.transformers as t; import sparseprefill.fast.ops; "
            "import sparseprefill.distributed, sparseprefill.bench, sparseprefill.compare, sparseprefill.evaluate; "
            "assert callable(t.patch); "
            "sys.exit('hypothesis imported' if 'hypothesis' in sys.modules else 0)")
    pytest.importorskip("transformers", reason="the `hf` extra is not installed")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@settings(max_examples=max(4, EXAMPLES), deadline=None)
@given(data=st.data())
def test_per_head_knobs_drawn_pass_the_method_check(data: Any) -> None:
    """Every per-head value the conformance strategy draws passes the method's parameter
    check beside the other parameters (the strategy falls back to the scalar where the
    check refuses a head's value, so the check must refuse what the run would: see the
    Delta-KV test below, found on an H200 as a cosine redraw of -1.0 kept under the
    Euclidean metric)."""
    from sparseprefill.conformance.strategies import draw_per_head_knobs

    n = 80
    for name in sorted(n for n, s in CONFORMANCE.items() if s.method.knobs):
        spec = CONFORMANCE[name]
        params = dict(spec.params(data.draw, n))
        out, _ = draw_per_head_knobs(data.draw, spec, params, n, heads=4, kv_heads=2)
        spec.method.check_params(out)


def test_delta_kv_check_refuses_a_negative_euclidean_threshold_per_head() -> None:
    method = methods.get("delta_kv")
    method.check_params({"threshold": [0.5, 0.5], "metric": "euclidean"})
    method.check_params({"threshold": -1.0, "metric": "cosine"})
    with pytest.raises(ValueError, match=r"threshold\[1\].*euclidean"):
        method.check_params({"threshold": [0.5, -1.0], "metric": "euclidean"})
    with pytest.raises(ValueError, match="metric"):
        method.check_params({"threshold": 0.5, "metric": "manhattan"})
