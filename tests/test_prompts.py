"""Calibration on several kinds of text: `--prompts KIND=SOURCE`, the text sources, per-head
margins from the spread across kinds (`sparseprefill.margins`), the config's margin fields.

No Debian package is needed: the Debian sources are read from small files laid under a
temporary root (`SPARSEPREFILL_TEXT_ROOT`), and `Rscript` is a stand-in script.
"""

from __future__ import annotations

import gzip
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch

from sparseprefill import calibrate as cal
from sparseprefill import layer_stats as ls
from sparseprefill import prompts as pr
from sparseprefill.config import parse_config, read_config
from sparseprefill.margins import SpreadTarget, settle_coupled, tail_below_min_minus_range
from sparseprefill.methods import METHODS

N, HQ, HKV, D = 192, 4, 2, 16


def toy_qkv(seed: int, *, diffuse: tuple[int, ...] = (2, 3)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local heads (mass on a few recent tokens) except `diffuse`, whose mass spreads over the prefix."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.arange(N, dtype=torch.float32)
    angle = pos[:, None] * (0.35 / (1 + torch.arange(D // 2, dtype=torch.float32)))[None, :]
    rot = torch.cat([angle.cos(), angle.sin()], dim=-1)
    k = torch.stack([rot, rot])[None].clone()
    q = torch.stack([rot * 4.0] * HQ)[None].clone()
    for h in diffuse:
        q[0, h] = 0.01 * torch.randn(N, D, generator=gen)
    return q, k, torch.randn(1, HKV, N, D, generator=gen)


def save_capture(path: Path, seed: int, *, diffuse: tuple[int, ...] = (2, 3)) -> Path:
    q, k, v = toy_qkv(seed, diffuse=diffuse)
    torch.save({"layers": [0], "q": [q], "k": [k], "v": [v], "scale": [D ** -0.5], "meta": {"seqlen": N}}, path)
    return path


def stats(recall: list[float], *, error: list[float] | None = None) -> ls.HeadStats:
    r = torch.tensor(recall, dtype=torch.float64)
    return ls.HeadStats(density=torch.full_like(r, 0.5), recall_mean=r, recall_min=r - 0.1,
                         error=None if error is None else torch.tensor(error, dtype=torch.float64))


def combined(*parts: ls.HeadStats) -> ls.HeadStats:
    return ls.combine(list(parts))


# -- --prompts and the text sources --------------------------------------------------------------


def test_parse_prompts_defaults_names_and_errors(tmp_path: Path) -> None:
    assert pr.parse_prompts(None) == []
    assert [(p.kind, p.source) for p in pr.parse_prompts([])] == list(pr.DEFAULT_PROMPTS.items())
    assert [(p.kind, p.source) for p in pr.parse_prompts([], defaults=pr.DEFAULT_HELDOUT)] == [("quotes", "fortunes")]
    assert set(pr.DEFAULT_PROMPTS.values()).isdisjoint(pr.DEFAULT_HELDOUT.values())
    text = tmp_path / "play.txt"
    text.write_text("HAMLET. To be, or not to be.\n")
    got = pr.parse_prompts(["austen", f"dialogue={text}", "code=x.pt"])
    assert [(p.kind, p.source, p.is_capture) for p in got] == [
        ("novel", "austen", False), ("dialogue", str(text), False), ("code", "x.pt", True)]
    for bad, match in (("nosuch", "KIND=SOURCE"), ("Code=stdlib", "lower-case"), ("code=", "empty"),
                       ("code=/no/such/file.txt", "neither"), ("9x=stdlib", "lower-case")):
        with pytest.raises(ValueError, match=match):
            pr.parse_prompts([bad])
    with pytest.raises(ValueError, match="twice"):
        pr.parse_prompts(["a=stdlib", "b=stdlib"])


def fake_root(tmp_path: Path) -> Path:
    """Debian packages' files under a folder: two fortune files, the FAQ, janeaustenr, and a
    stand-in `Rscript` that prints the book it is asked for."""
    root = tmp_path / "root"
    fortunes = root / pr.FORTUNE_DIR
    fortunes.mkdir(parents=True)
    (fortunes / "literature").write_text("A horse!  A horse!\n\t\t-- Wm. Shakespeare\n%\nTo err is human.\n%\n")
    (fortunes / "riddles").write_text("Q: What is black and white?\nA: A newspaper.\n%\n")
    faq = root / pr.DEBIAN_FAQ
    faq.parent.mkdir(parents=True)
    faq.write_bytes(gzip.compress(b"The Debian GNU/Linux FAQ\n\n1. What is Debian?\n"))
    (root / "usr/lib/R/site-library/janeaustenr").mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "Rscript"
    script.write_text('#!/bin/sh\ncase "$3" in *prideprejudice*) echo "It is a truth universally acknowledged.";;\n'
                      '*) echo "Another book.";; esac\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return root


def test_text_sources_read_from_their_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_root(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    quotes = pr.read_text("fortunes", 10, root=root)
    # Whole files until long enough: literature alone, the `%` separators gone.
    assert quotes.startswith("A horse!  A horse!") and "%" not in quotes and "newspaper" not in quotes
    assert "Shakespeare\n\nTo err is human." in quotes
    everything = pr.read_text("fortunes", 10_000, root=root)  # fewer characters than asked: all of it
    assert "To err is human." in everything and "A newspaper." in everything
    assert everything.index("Shakespeare") < everything.index("newspaper")
    assert pr.read_text("debian-faq", 0, root=root).startswith("The Debian GNU/Linux FAQ")
    novel = pr.read_text("austen", 10, root=root)
    assert novel.startswith("It is a truth universally acknowledged.") and "Another" not in novel
    assert pr.read_text("austen", 10_000, root=root).count("Another book.") == len(pr.AUSTEN_BOOKS) - 1
    code = pr.read_text("stdlib", 1000)
    assert code.startswith("# file: ") and len(code) >= 1000
    assert "assert" in pr.read_text("pydoc", 100)
    empty = tmp_path / "empty"
    empty.mkdir()
    for name, package in (("fortunes", "fortunes"), ("debian-faq", "debian-faq"), ("austen", "r-cran-janeaustenr")):
        with pytest.raises(FileNotFoundError, match=f"apt-get install {package}"):
            pr.read_text(name, 10, root=empty)
    monkeypatch.setenv("SPARSEPREFILL_TEXT_ROOT", str(root))
    assert pr.read_text("fortunes", 10).startswith("A horse!")


class CharTokenizer:
    """One token a character (what `evaluate.text_ids` needs of a tokenizer)."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 64 for c in text]}


def test_capture_prompts_captures_text_once_and_passes_captures(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the `hf` extra is not installed")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=HQ, num_key_value_heads=HKV,
                                         max_position_embeddings=256)).eval()
    loads: list[str] = []

    def load(name: str, device: str) -> tuple[Any, Any]:
        loads.append(name)
        return model, CharTokenizer()

    play = tmp_path / "play.txt"
    play.write_text("HAMLET. To be, or not to be: that is the question. " * 8)
    given = save_capture(tmp_path / "given.pt", 0)
    prompts = pr.parse_prompts([f"code={given}", "manual=pydoc", f"dialogue={play}"])
    folder = tmp_path / "caps"
    paths = pr.capture_prompts(prompts, model="smollm2", seqlen=100, layers=[1], folder=folder, load=load)
    assert paths[0] == given and loads == ["smollm2"]
    assert paths[1].name == "qkv-smollm2-100-manual-pydoc.pt" and paths[2].name == "qkv-smollm2-100-dialogue-play.pt"
    data = torch.load(paths[2])
    assert data["layers"] == [1] and tuple(data["q"][0].shape) == (1, HQ, 100, 32 // HQ)
    assert data["meta"]["text"].startswith("dialogue: ")
    again = pr.capture_prompts(prompts, model="smollm2", seqlen=100, layers=[1], folder=folder, load=load)
    assert again == paths and loads == ["smollm2"]  # reused, no second model load
    with pytest.raises(ValueError, match="fewer than 1000"):
        pr.capture_prompts(pr.parse_prompts([f"dialogue={play}"]), model="smollm2", seqlen=1000, layers=[1],
                           folder=tmp_path / "short", load=load)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        pr.capture_prompts(pr.parse_prompts(["code=missing.pt"]), model="smollm2", seqlen=10, layers=[0],
                           folder=folder, load=load)
    with pytest.raises(ValueError, match="layers"):
        pr.capture_prompts(prompts, model="smollm2", seqlen=100, layers=[], folder=folder, load=load)


# -- per-head margins from the spread ------------------------------------------------------------


def test_spread_margin_per_head() -> None:
    """margin_h = max(floor, C x (max - min over kinds)), checked against every kind."""
    # Head 0 steady, head 1 moves by 0.04, head 2 by 0.10, head 3 steady but low.
    code = stats([0.97, 0.99, 1.00, 0.94])
    prose = stats([0.97, 0.95, 0.90, 0.94])
    both = combined(code, prose)
    target = SpreadTarget(recall=0.9, margin=0.01, spread=1.0, kinds=("code", "prose"))
    margins = target.margins(both)["recall"]
    assert margins.tolist() == pytest.approx([0.01, 0.04, 0.10, 0.01])
    # 0.97 >= 0.91; 0.95 >= 0.94; 0.90 < 1.00; 0.94 >= 0.91.
    assert target.serves(both).tolist() == [True, True, False, True]
    assert SpreadTarget(recall=0.9, margin=0.01, spread=0.5, kinds=("code", "prose")).serves(both).tolist() == [
        True, True, False, True]
    assert SpreadTarget(recall=0.9, spread=0.0, kinds=("code", "prose")).serves(both).tolist() == [True] * 4
    # Two prompts of one kind are averaged before the spread: one kind, no spread.
    same = SpreadTarget(recall=0.9, margin=0.02, kinds=("code", "code"))
    assert same.margins(both)["recall"].tolist() == pytest.approx([0.02] * 4)
    plain = ls.Target(recall=0.9).with_margin(0.02)
    assert same.serves(both).tolist() == plain.serves(ls.combine([code, prose])).tolist()
    # The worst row and the error take their own spreads; an error bound shrinks by the margin.
    err = combined(stats([0.99] * 4, error=[0.01, 0.01, 0.01, 0.05]), stats([0.99] * 4, error=[0.01, 0.04, 0.08, 0.05]))
    on_error = SpreadTarget(recall=None, error=0.1, margin=0.0, kinds=("a", "b"))
    assert on_error.margins(err)["error"].tolist() == pytest.approx([0.0, 0.03, 0.07, 0.0])
    assert on_error.serves(err).tolist() == [True, True, False, True]
    # Worst rows (recall - 0.1 here): 0.87 / 0.87 holds 0.85; 0.85 is below 0.85 + 0.04; 0.84 below 0.85.
    rows = SpreadTarget(recall=None, row_recall=0.85, kinds=("code", "prose"))
    assert rows.serves(both).tolist() == [True, False, False, False]
    with pytest.raises(ValueError, match="2 prompt"):
        SpreadTarget(recall=0.9, kinds=("a", "b", "c")).serves(both)
    for bad in ({"margin": -0.1}, {"margin": 1.0}, {"spread": -1.0}, {"spread": float("inf")},
                {"recall": 0.99, "margin": 0.02}):
        with pytest.raises(ValueError):
            SpreadTarget(**bad)  # type: ignore[arg-type]


def test_spread_rule_tail() -> None:
    """The chance a new kind falls below min - C x range shrinks with C and with the kinds seen."""
    three = [tail_below_min_minus_range(3, c, draws=40_000) for c in (0.0, 1.0, 2.0)]
    assert three[0] == pytest.approx(0.25, abs=0.01)  # below the least of 3: 1 / (K + 1)
    assert three[0] > three[1] > three[2]
    assert tail_below_min_minus_range(4, 1.0, draws=40_000) < three[1]


def test_calibrate_with_prompts_of_two_kinds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Head 1 is local on code and diffuse on prose: calibrated on code alone it takes a
    small window, with both kinds it runs wider or dense; the config records the prompts
    and each head's margin; --eval on a calibration kind says it is not held out."""
    code = save_capture(tmp_path / "code.pt", 0)
    prose = save_capture(tmp_path / "prose.pt", 1, diffuse=(1, 2, 3))
    grid = json.dumps([{"sink": 16, "window": w, "block_m": 16, "block_n": 16} for w in (16, 32, 64, 128)])
    base = ["--method", "streaming", "--rows", "64", "--grid", grid, "--target-recall", "0.9", "--margin", "0.01"]
    assert cal.main(["--qkv", str(code), *base, "--out-dir", str(tmp_path / "one")]) == 0
    assert cal.main(["--prompts", f"code={code}", f"prose={prose}", *base, "--out-dir", str(tmp_path / "two"),
                     "--table", str(tmp_path / "two")]) == 0
    one = read_config(tmp_path / "one" / "streaming.json")
    two = read_config(tmp_path / "two" / "streaming.json")
    assert "prompts" not in one.meta and "head_margins" not in one.meta

    def window(spec: Any, h: int) -> int:
        if spec is None or h in spec.get("dense_heads", []):
            return N
        w = spec["window"]
        return int(w[h] if isinstance(w, list) else w)

    assert window(one.layers[0], 1) < window(two.layers[0], 1)
    assert window(two.layers[0], 0) == window(one.layers[0], 0)  # steady on both kinds: same choice
    assert [p["kind"] for p in two.meta["prompts"]] == ["code", "prose"] and two.meta["margin_spread"] == 1.0
    margins = two.meta["head_margins"]["0"]
    assert len(margins) == HQ and margins[0] == pytest.approx(0.01)
    table = json.loads((tmp_path / "two.json").read_text())
    row = table["layers"][0]
    assert set(row["kind_recall"]) == {"code", "prose"}
    for h in range(HQ):
        if row["picks"][h] is not None:
            assert min(row["kind_recall"][k][h] for k in ("code", "prose")) >= 0.9 + margins[h] - 1e-9
    assert table["summary"][0]["kinds"]["prose"]["recall_min_head"] <= 1.0
    capsys.readouterr()
    assert cal.main(["--prompts", f"code={code}", "--eval", str(tmp_path / "two" / "streaming.json"),
                     "--rows", "64"]) == 0
    assert "not a held-out kind" in capsys.readouterr().err
    assert cal.main(["--method", "streaming", "--out-dir", str(tmp_path / "x")]) == 2
    assert "--prompts" in capsys.readouterr().err
    assert cal.main(["--prompts", f"code={code}", *base, "--margin-spread", "-1", "--out-dir", str(tmp_path / "y")]) == 2


@pytest.mark.slow
def test_coupled_heads_settle_on_whole_runs(tmp_path: Path) -> None:
    """SharePrefill: every head the chosen config keeps sparse meets target + its margin on
    every kind when the config runs as a whole (or has moved denser until it does)."""
    caps = ls.load_captures([save_capture(tmp_path / "a.pt", 0), save_capture(tmp_path / "b.pt", 1, diffuse=(1, 2))])
    truths = [ls.row_truth(c, ls.sample_rows(N, 48, seed=1)) for c in caps]
    method = METHODS["shareprefill"]
    target = SpreadTarget(recall=0.9, margin=0.01, kinds=("code", "prose"))
    res = cal.calibrate_layer(method, caps, truths, target)
    whole = ls.measure_spec(method, res.spec, caps, truths)
    served = target.serves(whole)
    assert all(bool(served[h]) for h, p in enumerate(res.picks) if p is not None)
    assert len(res.head_margin) == HQ and all((m is None) == (p is None) for m, p in zip(res.head_margin, res.picks))
    # A config that fails as a whole moves its failing heads denser.
    points = [{"gamma": g} for g in (0.3, 0.99)]
    density = torch.tensor([[0.1] * HQ, [0.5] * HQ])
    picks, spec, after = settle_coupled(method, caps, truths, target, points, [0] * HQ, density)
    ok = target.serves(after)
    assert all(bool(ok[h]) for h, p in enumerate(picks) if p is not None)


# -- the config's margin fields ------------------------------------------------------------------


def test_config_margin_fields_checked() -> None:
    base = {"format": "sparseprefill.calibrate/1", "method": "streaming", "q_heads": 2,
            "layers": {"0": {"sink": 16, "window": 32, "dense_heads": [1]}, "1": None}}
    good = {**base, "margin": 0.01, "margin_spread": 1.0,
            "prompts": [{"kind": "code", "source": "stdlib", "capture": "c.pt"}],
            "head_margins": {"0": [0.02, None], "1": [None, None]}}
    assert parse_config(good).meta["head_margins"]["0"] == [0.02, None]
    for change, field in (({"margin": 1.5}, "margin"), ({"margin": True}, "margin"),
                          ({"margin_spread": -1}, "margin_spread"), ({"prompts": "code"}, "prompts"),
                          ({"prompts": [{"kind": "code"}]}, r"prompts\[0\]"),
                          ({"head_margins": []}, "head_margins"),
                          ({"head_margins": {"5": [0.1, None]}}, "configured layer"),
                          ({"head_margins": {"0": [0.1]}}, "one margin"),
                          ({"head_margins": {"0": [2.0, None]}}, r"\[0\]"),
                          ({"head_margins": {"0": [0.1, 0.1]}}, "runs dense")):
        with pytest.raises(ValueError, match=field):
            parse_config({**good, **change}, source="cfg.json")
