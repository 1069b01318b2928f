"""The docs: every relative link and picture resolves, and `docs/figures.py` draws a page's figures."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


@pytest.mark.skipif(not (ROOT / "docs").is_dir(), reason="not a source checkout")
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_and_pictures_resolve(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


@pytest.mark.skipif(not (ROOT / "docs" / "figures.py").exists(), reason="not a source checkout")
def test_figures_script_draws_a_page(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(ROOT / "docs" / "figures.py"), "dense", "streaming", "--out",
                          str(tmp_path)], check=False, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert {p.name for p in tmp_path.glob("*.png")} == {"dense.png", "streaming.png"}
    bad = subprocess.run([sys.executable, str(ROOT / "docs" / "figures.py"), "no_such_page"],
                         check=False, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "no_such_page" in bad.stderr


# -- every `sparseprefill ...` command the docs quote exists as written -------------------------

FENCE = re.compile(r"^ *```.*?^ *```", re.DOTALL | re.MULTILINE)
COMMAND = re.compile(r"(?:[A-Z_]+=\S*\s+)*(?:\S*/)?sparseprefill\s+(\S.*)")  # after VAR=value, a path
PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*|<[^>]*>|\.\.\.|…")


def quoted_commands(text: str) -> list[str]:
    """The argument lines of every `sparseprefill ...` command quoted in a Markdown text.

    Quoted means: a line of a fenced or indented code block (continuation lines joined,
    shell prompts and `&&` / `;` / `|` chains split), or an inline code span that starts
    with the command. `from sparseprefill import ...` is not a command.
    """
    found: list[str] = []

    def add(line: str) -> None:
        line = re.sub(r"^\s*\$\s+", "", line)
        for part in re.split(r"\s(?:&&|;|\|)\s", line):
            part = re.sub(r"^.*?\s-m\s+sparseprefill\.cli\s+", "sparseprefill ", part.strip())  # torchrun ...
            match = COMMAND.match(part)
            if match and not match.group(1).startswith("import "):
                found.append(match.group(1))

    for block in FENCE.findall(text):
        body = "\n".join(block.splitlines()[1:-1]).replace("\\\n", " ")
        for line in body.splitlines():
            add(line)
    rest = FENCE.sub("", text)
    for line in rest.splitlines():
        if line.startswith("    ") and not line.lstrip().startswith(("-", "*", "|")):
            add(line)
    for span in re.findall(r"`((?:[^`\n]|\n(?!\s*\n))+)`", rest):  # a span may wrap, not a paragraph
        span = " ".join(span.split())
        if COMMAND.match(span):
            add(span)
    return found


def _words(line: str) -> list[str]:
    line = re.sub(r"\s#.*", "", line)  # a trailing shell comment
    try:
        return shlex.split(line)
    except ValueError:  # an unclosed quote around a placeholder: split on blanks
        return line.split()


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def command_problems(line: str) -> list[str]:
    """What in one quoted `sparseprefill` argument line the real parser does not have.

    The subcommand (and the task of `eval` / `workload`) must exist, each `--flag` must be
    one of that parser's options, and the suites named to `bench` must exist and between them
    take every suite option given. Values, placeholders (`SUITE`, `<name>`, `...`) and
    positional files are not checked.
    """
    from sparseprefill.cli import build_parser

    words = _words(line)
    if not words or words[0].startswith("-"):
        top, _ = build_parser()
        return [f"no top-level option {w}" for w in words if w.startswith("--") and w.split("=")[0] not in _flags(top)]
    name = label = words[0]
    top, _ = build_parser([name])
    parser = _subparsers(top).get(name)
    if parser is None:
        return [f"no subcommand {name!r}"]
    problems: list[str] = []
    rest = words[1:]
    tasks = _subparsers(parser)
    if tasks and rest and not rest[0].startswith("-") and not PLACEHOLDER.fullmatch(rest[0]):
        if rest[0] not in tasks:
            return [f"no task {name} {rest[0]!r} (tasks: {', '.join(tasks)})"]
        label = f"{name} {rest[0]}"
        parser, rest = tasks[rest[0]], rest[1:]
    flags = {w.split("=")[0] for w in rest if w.startswith("--")}
    problems += [f"{label}: no option {flag}" for flag in sorted(flags - _flags(parser))]
    if name == "bench":
        problems += _bench_problems(rest, flags & _flags(parser))
    return problems


def _bench_problems(words: list[str], flags: set[str]) -> list[str]:
    """The `bench` suites named exist, and each suite option given belongs to one of them."""
    from sparseprefill.bench import load_suite, suite_names

    named = []
    for word in words:
        if word.startswith("-"):
            break
        if not PLACEHOLDER.fullmatch(word) and word not in ("/", "or"):
            named.append(word)
    unknown = [w for w in named if w not in suite_names()]
    if unknown:
        return [f"bench: no suite {w!r}" for w in unknown]
    suites = [load_suite(w) for w in named or ["kernels"]]
    if not named and any(PLACEHOLDER.fullmatch(w) for w in words[:1]):
        return []  # `bench SUITE --flag`: any suite's option
    label = f"bench {' '.join(named) or '(kernels)'}"
    suite_flags = {opt.flag for name in suite_names() for opt in load_suite(name).options}
    taken = {opt.flag for suite in suites for opt in suite.options}
    problems = [f"{label}: no suite named takes {flag}" for flag in sorted(flags & suite_flags - taken)]
    value = next((words[i + 1] for i, w in enumerate(words[:-1]) if w == "--methods"), None)
    if value is not None and not PLACEHOLDER.fullmatch(value):
        problems += _methods_problems(label, suites, tuple(value.split(",")))
    return problems


def _methods_problems(label: str, suites: list[Any], chosen: tuple[str, ...]) -> list[str]:
    """`--methods` names registered methods, and one of the suites named runs fewer pieces with it
    (a suite that ignores `--methods`, `kernels` or `variants`, would run as if it were absent)."""
    import torch

    from sparseprefill.bench.common import Context
    from sparseprefill.methods import methods

    unknown = [name for name in chosen if name not in methods()]
    if unknown:
        return [f"{label}: --methods names unregistered {unknown}"]

    def keys(suite: Any, names: tuple[str, ...] | None) -> list[str]:
        ctx = Context(device=torch.device("cpu"), q_heads=2, kv_heads=1, head_dim=32, dtype=torch.float16,
                      methods=names, log=lambda line: None)
        return [unit.key for unit in suite.units(ctx, [128])]

    if all(keys(suite, chosen) == keys(suite, None) for suite in suites):
        return [f"{label}: no suite named reads --methods"]
    return []


SCRIPT = re.compile(r"(?:[A-Z_]+=\S*\s+)*python3?\s+(docs/figures\.py|benches/\w+\.py|-m\s+sparseprefill\.conformance)"
                    r"(\s.*)?$")
SCRIPT_SOURCES = {"docs/figures.py": "docs/figures.py", "-m sparseprefill.conformance": "conformance/__main__.py"}


def quoted_script_commands(text: str) -> list[tuple[str, str]]:
    """(script, arguments) of every `python docs/figures.py ...`, `python benches/X.py ...` and
    `python -m sparseprefill.conformance ...` quoted in a Markdown text (as `quoted_commands`)."""
    found: list[tuple[str, str]] = []
    lines = [b for block in FENCE.findall(text) for b in
             "\n".join(block.splitlines()[1:-1]).replace("\\\n", " ").splitlines()]
    rest = FENCE.sub("", text)
    lines += [" ".join(span.split()) for span in re.findall(r"`((?:[^`\n]|\n(?!\s*\n))+)`", rest)]
    for line in lines:
        for part in re.split(r"\s(?:&&|;|\|)\s", line):
            part = re.sub(r"^.*?\s(?=python3?\s)", "", part.strip()) if "python" in part else part
            match = SCRIPT.match(part.strip())
            if match:
                found.append((" ".join(match.group(1).split()), (match.group(2) or "").strip()))
    return found


def script_problems(script: str, line: str) -> list[str]:
    """Options of a quoted script command that its parser lacks (from its `add_argument` calls),
    and for docs/figures.py pages it does not draw."""
    source = ROOT / SCRIPT_SOURCES.get(script, script)
    if not source.exists():
        return [f"no script {script}"]
    flags = set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", source.read_text())) | {"--help"}
    words = _words(line)
    problems = [f"{script}: no option {w}" for w in words if w.startswith("--") and w.split("=")[0] not in flags]
    takes_positional = re.search(r"add_argument\(\s*\"[a-z]", source.read_text()) is not None
    if not takes_positional:  # a bare word must be the value of the option before it
        problems += [f"{script}: takes no argument {w!r}" for i, w in enumerate(words)
                     if not w.startswith("-") and (i == 0 or not words[i - 1].startswith("--"))]
    if script == "docs/figures.py":
        pages = set(re.findall(r"^    \"(\w+)\": \[", source.read_text(), flags=re.MULTILINE)) | {"all"}
        positional = []
        for word in words:
            if word.startswith("-"):
                break
            positional.append(word)
        problems += [f"figures.py: no page {w!r}" for w in positional if w not in pages and not PLACEHOLDER.fullmatch(w)]
    return problems


def test_quoted_commands_are_found() -> None:
    text = ("Run `sparseprefill bench floor --seqlens 32K`; not `from sparseprefill import fast`.\n\n"
            "```bash\n$ sparseprefill compare --qkv q.pt \\\n    --json out.json   # a comment\n"
            "from sparseprefill import fast\nOMP_NUM_THREADS=1 sparseprefill eval capture && sparseprefill eval table\n"
            "torchrun --nproc-per-node 2 -m sparseprefill.cli bench distributed\n```\n\n"
            "    sparseprefill demo --seqlen 800\n")
    assert quoted_commands(text) == ["compare --qkv q.pt      --json out.json   # a comment", "eval capture",
                                     "eval table", "bench distributed", "demo --seqlen 800", "bench floor --seqlens 32K"]


def test_command_problems_are_reported() -> None:
    assert command_problems("bench floor --seqlens 32K,128K --json f.json") == []
    assert command_problems("eval passkey --config A --config B") == []
    assert command_problems("no_such_command --x") == ["no subcommand 'no_such_command'"]
    assert command_problems("compare --plot x.png") == ["compare: no option --plot"]
    [problem] = command_problems("eval summary --pair x")
    assert problem.startswith("no task eval 'summary' (tasks: ")
    assert all(task in problem for task in ("capture", "table", "passkey", "ppl", "granularity", "heldout",
                                            "layers", "ttft"))
    assert command_problems("bench no_such_suite") == ["bench: no suite 'no_such_suite'"]
    assert command_problems("bench floor --theta 1") == ["bench floor: no suite named takes --theta"]
    assert command_problems("bench floor --methods xattention") == []
    assert command_problems("bench kernels --methods dense") == ["bench kernels: no suite named reads --methods"]
    assert command_problems("bench floor --methods nope") == ["bench floor: --methods names unregistered ['nope']"]


@pytest.mark.skipif(not (ROOT / "docs").is_dir(), reason="not a source checkout")
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_quoted_command_exists(page: Path) -> None:
    bad = {line: problems for line in quoted_commands(page.read_text())
           if (problems := command_problems(line))}
    assert not bad, f"{page.name}: commands the CLI does not have: {bad}"


@pytest.mark.skipif(not (ROOT / "docs" / "figures.py").exists(), reason="not a source checkout")
def test_shareprefill_figure_reads_what_eval_layers_writes(tmp_path: Path) -> None:
    """docs/shareprefill.md's figure is drawn from `sparseprefill eval layers --json` output."""
    import importlib.util

    import torch
    from sparseprefill.reference import ClusterLayout

    from sparseprefill.cli import main

    spec = importlib.util.spec_from_file_location("docs_figures", ROOT / "docs" / "figures.py")
    assert spec is not None and spec.loader is not None
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    gen = torch.Generator().manual_seed(0)
    layers, hq, hkv, n, d = (0, 1), 4, 2, 128, 16
    torch.save({"layers": list(layers), "q": [torch.randn(1, hq, n, d, generator=gen) * 1.5 for _ in layers],
                "k": [torch.randn(1, hkv, n, d, generator=gen) for _ in layers],
                "v": [torch.randn(1, hkv, n, d, generator=gen) for _ in layers]}, tmp_path / "cap.pt")
    layout = ClusterLayout.uniform(len(layers), hq).save(tmp_path / "layout.json")
    setting = json.dumps({"layout": str(layout), "block_m": 32, "block_n": 32})
    assert main(["eval", "layers", "--qkv", str(tmp_path / "cap.pt"), "--method", "shareprefill", "--setting",
                 setting, "--report-layers", "1", "--json", str(tmp_path / "l.json")]) == 0
    new = figures._layers_result(json.loads((tmp_path / "l.json").read_text()))
    (_label, dist), = new["distribution"].items()
    assert [p["layer"] for p in dist["per_layer"]] == [0, 1]
    assert sum(dist["per_layer"][0].get(k, 0) for k in ("dense", "shared", "vertical_slash")) == hq
    assert list(new["frontier"]) == ["1"] and all("setting" in r for r in new["rows"])
    committed = figures._layers_result(json.loads((ROOT / "benches/results/shareprefill-smollm2-8k-cpu.json")
                                                  .read_text()))
    assert set(committed) == set(new) and all("setting" in r for r in committed["rows"])


def test_quoted_script_commands_are_checked() -> None:
    text = "Run `python docs/figures.py dense --out x` and\n\n```\ncompute-sanitizer --tool memcheck python " \
           "benches/sanitize_kernels.py --packed\nPYTHONPATH=. python -m sparseprefill.conformance --examples 2\n```\n"
    assert quoted_script_commands(text) == [("benches/sanitize_kernels.py", "--packed"),
                                            ("-m sparseprefill.conformance", "--examples 2"),
                                            ("docs/figures.py", "dense --out x")]
    assert script_problems("docs/figures.py", "dense --out x") == []
    assert script_problems("docs/figures.py", "nope") == ["figures.py: no page 'nope'"]
    assert script_problems("benches/sanitize_kernels.py", "--packed --nope") == [
        "benches/sanitize_kernels.py: no option --nope"]
    assert script_problems("benches/gone.py", "") == ["no script benches/gone.py"]
    assert script_problems("benches/sanitize_kernels.py", "cuda --seqlen 1000") == [
        "benches/sanitize_kernels.py: takes no argument 'cuda'"]


@pytest.mark.skipif(not (ROOT / "docs").is_dir(), reason="not a source checkout")
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_quoted_script_command_exists(page: Path) -> None:
    bad = {f"{script} {line}": problems for script, line in quoted_script_commands(page.read_text())
           if (problems := script_problems(script, line))}
    assert not bad, f"{page.name}: script commands that do not exist as written: {bad}"


@pytest.mark.skipif(not (ROOT / "docs" / "figures.py").exists(), reason="not a source checkout")
def test_distributed_figure_reads_what_bench_distributed_writes(tmp_path: Path) -> None:
    """docs/distributed.md's bytes panel is drawn from `sparseprefill bench distributed --json` output."""
    import importlib.util

    import torch

    from sparseprefill.cli import main

    spec = importlib.util.spec_from_file_location("docs_figures", ROOT / "docs" / "figures.py")
    assert spec is not None and spec.loader is not None
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    gen = torch.Generator().manual_seed(0)
    torch.save({"layers": [2, 14], "q": [torch.randn(1, 4, 256, 16, generator=gen) for _ in range(2)],
                "k": [torch.randn(1, 2, 256, 16, generator=gen) for _ in range(2)],
                "v": [torch.randn(1, 2, 256, 16, generator=gen) for _ in range(2)]}, tmp_path / "cap.pt")
    out = tmp_path / "bytes.json"
    assert main(["bench", "distributed", "--device", "cpu", "--qkv", str(tmp_path / "cap.pt"), "--seqlens", "256",
                 "--methods", "streaming,xattention", "--worlds", "2,4", "--json", str(out)]) == 0
    names, kv, est = figures._bytes_vs_ring(json.loads(out.read_text()), 4)
    assert names == ["streaming", "xattention*"] and all(0 < x <= 1 for x in kv) and est == [0.0, 0.0]
    committed = figures._bytes_vs_ring(json.loads((ROOT / "benches/results/distributed-bytes-smollm2-8k-cpu.json")
                                                  .read_text()), 4)
    assert len(committed[0]) == len(committed[1]) == len(committed[2]) > 0


# Options of other tools that the pages quote (pip, pytest, torchrun, compute-sanitizer, ncu,
# mypy, a peer's own script): not ours to check.
OTHER_TOOLS_FLAGS = {"--no-deps", "--index-url", "--benchmark-json", "--durations", "--standalone",
                     "--nproc-per-node", "--tool", "--error-exitcode", "--clock-control", "--strict", "--pattern"}


def _all_our_flags() -> set[str]:
    """Every option of every `sparseprefill` subcommand and task (bench with every suite's
    options), of docs/figures.py, the conformance runner, benches/*.py and tools/*.py."""
    from sparseprefill.cli import COMMANDS, build_parser

    flags: set[str] = set()
    for command in COMMANDS:
        top, _ = build_parser([command.name])
        parser = _subparsers(top)[command.name]
        for p in [parser, *_subparsers(parser).values()]:
            flags |= _flags(p)
    sources = [ROOT / "docs" / "figures.py", ROOT / "conformance" / "__main__.py",
               *(ROOT / "benches").glob("*.py"), *(ROOT / "tools").glob("*.py")]
    for source in sources:
        if source.exists():
            flags |= set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", source.read_text()))
    return flags


@pytest.mark.skipif(not (ROOT / "docs").is_dir(), reason="not a source checkout")
def test_every_option_named_in_the_pages_exists() -> None:
    """An option quoted anywhere in a page (prose included, where a command line test cannot
    see it) is one of ours, or another tool's from OTHER_TOOLS_FLAGS."""
    ours = _all_our_flags() | OTHER_TOOLS_FLAGS
    unknown = {}
    for page in PAGES:
        found = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", page.read_text())) - ours
        if found:
            unknown[page.name] = sorted(found)
    assert not unknown, f"options no parser has: {unknown}"


@pytest.mark.skipif(not (ROOT / "docs" / "figures.py").exists(), reason="not a source checkout")
def test_passkey_figure_reads_what_eval_passkey_writes() -> None:
    """docs/integration.md's heatmap takes the cells of `sparseprefill eval passkey --json`."""
    import importlib.util
    from dataclasses import asdict

    from sparseprefill.evaluate import PasskeyCell

    spec = importlib.util.spec_from_file_location("docs_figures", ROOT / "docs" / "figures.py")
    assert spec is not None and spec.loader is not None
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    cells = [asdict(PasskeyCell("sdpa", 1024, 0.5, 2, 3, [0.1, -0.2, 0.3], [1, 2, 3]))]
    written = json.loads(json.dumps({"cells": cells, "check": []}))
    assert figures._passkey_cells(written) == cells
    committed = figures._passkey_cells(json.loads((ROOT / "benches/results/passkey-smollm2-h200.json").read_text()))
    assert {"method", "seqlen", "depth", "correct", "trials"} <= set(committed[0])


@pytest.mark.skipif(not (ROOT / "docs" / "figures.py").exists(), reason="not a source checkout")
def test_compare_and_calibrate_figures_read_what_their_commands_write(tmp_path: Path) -> None:
    """docs/compare.md's table and picture take `compare --json`'s points; the calibrate pictures
    a `calibrate --table` JSON (keyed by a label)."""
    import importlib.util

    import torch

    from sparseprefill.cli import main

    spec = importlib.util.spec_from_file_location("docs_figures", ROOT / "docs" / "figures.py")
    assert spec is not None and spec.loader is not None
    figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(figures)
    gen = torch.Generator().manual_seed(0)
    torch.save({"layers": [2, 14], "q": [torch.randn(1, 4, 192, 16, generator=gen) * 2 for _ in range(2)],
                "k": [torch.randn(1, 2, 192, 16, generator=gen) for _ in range(2)],
                "v": [torch.randn(1, 2, 192, 16, generator=gen) for _ in range(2)], "scale": [0.25, 0.25]},
               tmp_path / "cap.pt")
    assert main(["compare", "--qkv", str(tmp_path / "cap.pt"), "--methods", "streaming", "--device", "cpu",
                 "--backend", "reference", "--json", str(tmp_path / "c.json"), "--png", str(tmp_path / "c.png")]) == 0
    table = figures.compare_table(json.loads((tmp_path / "c.json").read_text())["points"])
    assert table.splitlines()[0] == "| method | layer 2 | layer 14 |" and "| streaming |" in table
    assert main(["calibrate", "--qkv", str(tmp_path / "cap.pt"), "--method", "streaming", "--rows", "16",
                 "--out-dir", str(tmp_path / "cfg"), "--table", str(tmp_path / "t")]) == 0
    drawn = figures._density_per_head({"streaming": json.loads((tmp_path / "t.json").read_text())},
                                      tmp_path / "d.png", "title")
    assert drawn.exists()
