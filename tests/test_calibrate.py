"""`sparseprefill calibrate`: per-head choice, the dense fallback, the JSON round trip into `patch`.

Toy captures (tiny N, few heads) so each test runs in a few seconds on the CPU.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from sparseprefill import calibrate as cal
from sparseprefill import layer_stats as ls
from sparseprefill import reference
from sparseprefill.config import read_config
from sparseprefill.methods import METHODS

N, HQ, HKV, D = 192, 4, 2, 16


def toy_qkv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Heads 0-1 attend to their own neighbourhood (a few tokens back); heads 2-3 spread
    their mass evenly over the whole prefix (no local method can keep it)."""
    gen = torch.Generator().manual_seed(seed)
    pos = torch.arange(N, dtype=torch.float32)
    freqs = torch.arange(D // 2, dtype=torch.float32)
    angle = pos[:, None] * (0.35 / (1 + freqs))[None, :]
    rot = torch.cat([angle.cos(), angle.sin()], dim=-1)  # shared positional code: q.k large when near
    q = torch.zeros(1, HQ, N, D)
    k = torch.zeros(1, HKV, N, D)
    k[0, 0] = rot * 1.0
    q[0, 0] = rot * 4.0
    q[0, 1] = rot * 4.0
    k[0, 1] = 0.01 * torch.randn(N, D, generator=gen)
    q[0, 2] = 0.01 * torch.randn(N, D, generator=gen)
    q[0, 3] = 0.01 * torch.randn(N, D, generator=gen)
    v = torch.randn(1, HKV, N, D, generator=gen)
    return q, k, v


def toy_capture(tmp_path: Path, name: str = "toy.pt", layers: tuple[int, ...] = (0,)) -> Path:
    qs, ks, vs = zip(*(toy_qkv(seed) for seed, _ in enumerate(layers)))
    path = tmp_path / name
    torch.save({"layers": list(layers), "q": list(qs), "k": list(ks), "v": list(vs),
                "scale": [D ** -0.5] * len(layers), "meta": {"seqlen": N}}, path)
    return path


def test_with_dense_heads_makes_heads_full_causal() -> None:
    q, k, _ = toy_qkv()
    plan = reference.streaming_plan(q, k, sink=16, window=32, block_m=16, block_n=16)
    out = plan.with_dense_heads([2, 0])
    mask, before = out.to_dense_mask(), plan.to_dense_mask()
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    assert torch.equal(mask[0, 0], causal) and torch.equal(mask[0, 2], causal)
    assert torch.equal(mask[0, 1], before[0, 1]) and torch.equal(mask[0, 3], before[0, 3])
    out.validate()
    assert plan.with_dense_heads([]) is plan
    assert torch.equal(plan.with_dense_heads(torch.tensor([True, False, True, False])).to_dense_mask(), mask)
    with pytest.raises(ValueError, match="query head 4"):
        plan.with_dense_heads([4])
    with pytest.raises(TypeError, match="int"):
        plan.with_dense_heads([1.0])  # type: ignore[list-item]


def test_calibrate_layer_picks_per_head_and_falls_back_to_dense(tmp_path: Path) -> None:
    caps = ls.load_captures([toy_capture(tmp_path)])
    truths = [ls.row_truth(c, ls.sample_rows(N, 64, seed=1)) for c in caps]
    method = METHODS["streaming"]
    grid = [{"sink": 16, "window": w, "block_m": 16, "block_n": 16} for w in (16, 32, 48)]
    target = ls.Target(recall=0.97)
    res = cal.calibrate_layer(method, caps, truths, target, grid=grid)
    # The local heads take the smallest window; the spread heads are served by none: dense.
    assert res.picks[:2] == [0, 0] and res.picks[2:] == [None, None]
    assert min(res.recall_mean[:2]) >= 0.97
    assert res.recall_mean[2] == pytest.approx(1.0, abs=1e-5) and res.density[2] == pytest.approx(1.0)
    # The whole config's numbers equal a per-head measurement of the grid point it chose.
    plan = method.plan_fn("reference")(caps[0].q, caps[0].k, **grid[0])
    alone = ls.plan_stats(truths[0], plan, caps[0].v)
    assert res.density[0] == pytest.approx(float(alone.density[0]))
    assert float(alone.density[0]) == pytest.approx(float(reference.density(plan)[0, 0]))
    # Per layer: one point for all heads, the unserved heads dense.
    one = cal.calibrate_layer(method, caps, truths, target, grid=grid, granularity="layer")
    assert one.picks == [0, 0, None, None]
    # An output-error target works from v; an impossible one makes every head dense (layer -> SDPA).
    err = cal.calibrate_layer(method, caps, truths, ls.Target(recall=None, error=0.0), grid=grid)
    assert err.picks == [None] * HQ and err.spec is None


def test_layer_spec_forms() -> None:
    method = METHODS["streaming"]
    grid = [{"sink": 16, "window": w} for w in (32, 64)]
    assert ls.layer_spec(method, grid, [None, None]) is None
    same = ls.layer_spec(method, grid, [1, None, 1])
    assert same == {"sink": 16, "window": 64, "dense_heads": [1]}
    mixed = ls.layer_spec(method, grid, [0, 1, None])
    if "window" in ls.method_knobs(method):
        assert mixed == {"sink": 16, "window": [32, 64, 32], "dense_heads": [2]}
    else:
        assert mixed == [grid[0], grid[1], None]


def test_cli_json_round_trip_into_patch(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the `hf` extra is not installed")
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparseprefill.integrations.transformers import patch, unpatch

    capture = toy_capture(tmp_path, layers=(0, 1))
    out_dir = tmp_path / "cfg"
    rc = cal.main(["--qkv", str(capture), "--method", "streaming", "--rows", "48", "--target-recall", "0.97",
                   "--out-dir", str(out_dir), "--table", str(tmp_path / "table")])
    assert rc == 0
    path = out_dir / "streaming.json"
    data = json.loads(path.read_text())
    assert data["method"] == "streaming" and set(data["layers"]) == {"0", "1"}
    read = read_config(path, method="streaming")
    config = read.layers
    assert set(config) == {0, 1} and read.meta["complete"] is True and read.q_heads == HQ
    assert read.meta["grid"]["source"] == "calibration"
    table = json.loads((tmp_path / "table.json").read_text())
    assert {row["layer"] for row in table["summary"]} == {0, 1}
    with pytest.raises(ValueError, match="not 'xattention'"):
        read_config(path, method="xattention")
    # The held-out check reads the config back.
    assert cal.main(["--qkv", str(capture), "--eval", str(path), "--rows", "48"]) == 0

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=HQ, num_key_value_heads=HKV,
                                         max_position_embeddings=256)).eval()
    ids = torch.randint(0, 64, (1, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense = model(ids).logits
        patch(model, "streaming", config=path, backend="reference", min_seqlen=1)
        try:
            from_file = model(ids).logits
        finally:
            unpatch(model)
        patch(model, "streaming", config=config, backend="reference", min_seqlen=1)
        try:
            from_dict = model(ids).logits
        finally:
            unpatch(model)
    assert torch.equal(from_file, from_dict)
    assert torch.isfinite(from_file).all()


@pytest.mark.parametrize("method,params", [
    ("streaming", {"sink": 16, "window": 16, "block_m": 16, "block_n": 16}),      # plan-based: the plan step
    ("delta_kv", None),                             # no plan: the output splice
    ("shareprefill", {}),                           # own layer function: the output splice
])
def test_dense_heads_in_patch(method: str, params: dict[str, Any] | None) -> None:
    """Every head dense through `dense_heads` gives the SDPA model's logits, whatever the method."""
    pytest.importorskip("transformers", reason="the `hf` extra is not installed")
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparseprefill.integrations.transformers import patch, unpatch

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=HQ, num_key_value_heads=HKV,
                                         max_position_embeddings=256)).eval()
    ids = torch.randint(0, 64, (1, 80), generator=torch.Generator().manual_seed(2))
    base = dict(params if params is not None else METHODS[method].demo_params(80))
    with torch.no_grad():
        dense = model(ids).logits
        patch(model, method, {0: {**base, "dense_heads": list(range(HQ))}, 1: {**base, "dense_heads": [0, 1, 2, 3]}},
              backend="reference", min_seqlen=1)
        try:
            out = model(ids).logits
        finally:
            unpatch(model)
        patch(model, method, {0: {**base, "dense_heads": [1]}}, backend="reference", min_seqlen=1)
        try:
            some = model(ids).logits
        finally:
            unpatch(model)
    assert torch.allclose(out, dense, atol=1e-4)
    assert torch.isfinite(some).all()
    with pytest.raises(ValueError, match="dense_heads"):
        patch(model, method, {0: [{**base, "dense_heads": [0]}] + [None] * (HQ - 1)}, backend="reference")
    with pytest.raises(TypeError, match="dense_heads"):
        patch(model, method, {0: {**base, "dense_heads": "all"}}, backend="reference")


def test_target_and_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ls.Target(recall=None)
    with pytest.raises(ValueError, match="recall"):
        ls.Target(recall=1.5)
    rows = ls.sample_rows(1000, 100, seed=3)
    assert rows.numel() == 100 and bool((rows[1:] > rows[:-1]).all()) and int(rows.max()) < 1000
    assert torch.equal(ls.sample_rows(10, 50), torch.arange(10))
    assert not math.isnan(float(rows.float().mean()))


def test_refine_bisects_each_heads_knob_to_a_cheaper_value(tmp_path: Path) -> None:
    """`refine`: per-head bisection between grid points keeps the target and never costs
    more than the grid's pick; `refine_top` serves heads no grid point serves."""
    caps = ls.load_captures([toy_capture(tmp_path)])
    truths = [ls.row_truth(c, ls.sample_rows(N, 64, seed=1)) for c in caps]
    method = METHODS["xattention"]
    grid = [{"stride": 4, "block": 16, "threshold": t} for t in (0.3, 0.6)]
    target = ls.Target(recall=0.9)
    assert cal.bisect_knob(grid) == "threshold" and cal.bisect_knob([{"window": 16}, {"window": 32}]) is None
    coarse = cal.calibrate_layer(method, caps, truths, target, grid=grid)
    fine = cal.calibrate_layer(method, caps, truths, target, grid=grid, refine=3, refine_top=1.0)
    for h in range(HQ):
        assert fine.recall_mean[h] >= 0.9
        if coarse.picks[h] is not None:
            assert fine.density[h] <= coarse.density[h] + 1e-12
            value = fine.chosen_params[h]["threshold"]  # type: ignore[index]
            assert value <= grid[coarse.picks[h]]["threshold"]  # type: ignore[index]
    # A head dense on the grid is bracketed by 0.6 and 1.0 and served.
    assert sum(p is None for p in fine.picks) < sum(p is None for p in coarse.picks)
    assert isinstance(fine.spec, dict) and isinstance(fine.spec["threshold"], list)


def test_margin_calibrates_to_the_safe_side(tmp_path: Path) -> None:
    """`--margin`: the bounds tighten on the calibration prompt (recall + m, error - m), the
    config records the user's target and the margin, bad margins are refused."""
    target = ls.Target(recall=0.9, row_recall=0.5, error=0.1)
    safe = target.with_margin(0.05)
    assert safe.recall == pytest.approx(0.95) and safe.row_recall == pytest.approx(0.55)
    assert safe.error == pytest.approx(0.05) and target.with_margin(0) is target
    for bad in (-0.1, 1.0, True, "0.1"):
        with pytest.raises(ValueError, match="margin"):
            target.with_margin(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="above 1"):
        ls.Target(recall=0.97).with_margin(0.05)
    with pytest.raises(ValueError, match="below 0"):
        ls.Target(recall=None, error=0.01).with_margin(0.02)
    from sparseprefill.calibrate import main

    qkv = toy_capture(tmp_path)
    grid = json.dumps([{"stride": 4, "block": 16, "threshold": t} for t in (0.3, 0.6)])
    base = ["--qkv", str(qkv), "--method", "xattention", "--rows", "64", "--grid", grid,
            "--refine", "2", "--refine-top", "1.0", "--target-recall", "0.85"]
    assert main([*base, "--out-dir", str(tmp_path / "a"), "--table", str(tmp_path / "a")]) == 0
    assert main([*base, "--margin", "0.1", "--out-dir", str(tmp_path / "b"), "--table", str(tmp_path / "b")]) == 0
    plain = json.loads((tmp_path / "a.json").read_text())["layers"][0]
    safe_run = json.loads((tmp_path / "b.json").read_text())["layers"][0]
    served = [h for h in range(HQ) if safe_run["picks"][h] is not None]
    assert served and all(safe_run["recall_mean"][h] >= 0.95 for h in served)
    assert sum(safe_run["density"]) >= sum(plain["density"]) - 1e-12
    config = json.loads((tmp_path / "b" / "xattention.json").read_text())
    assert config["margin"] == 0.1 and config["target"]["recall"] == 0.85
    assert config["calibrated_to"]["recall"] == pytest.approx(0.95)
    assert main([*base, "--margin", "0.2", "--out-dir", str(tmp_path / "c")]) == 2


def test_eval_ppl_and_passkey_take_the_model() -> None:
    """`eval ppl` / `eval passkey` run a calibrated config on either model (Gemma 3's global layers)."""
    import argparse

    from sparseprefill import evaluate

    parser = argparse.ArgumentParser()
    evaluate.add_arguments(parser)
    for task in ("ppl", "passkey", "capture"):
        assert parser.parse_args([task, "--model", "gemma3-270m"]).model == "gemma3-270m"
        assert parser.parse_args([task]).model == "smollm2"
    with pytest.raises(SystemExit):
        parser.parse_args(["ppl", "--model", "llama"])


def test_passkey_prompt_without_chat_template() -> None:
    """Gemma 3's GGUF tokenizer has no chat template: the passkey prompt is then plain text."""
    from sparseprefill import evaluate

    class CharTokenizer:
        chat_template = None

        def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
            return {"input_ids": [ord(c) for c in text]}

    prompt, answer = evaluate.passkey_prompt(CharTokenizer(), 2000, 0.5, 12345)
    text = "".join(map(chr, prompt[0].tolist()))
    assert 1800 < prompt.shape[1] <= 2000 and "The pass key is 12345." in text
    assert text.endswith(evaluate.ANSWER_PREFIX) and "".join(map(chr, answer[0].tolist())) == " 12345"


def test_every_calibratable_method_has_a_calibration_grid() -> None:
    """`calibrate` searches each method's own grid; the sweep fallback is announced, never silent."""
    for method in METHODS.values():
        if cal.calibratable(method):
            label, points = cal.calibration_grid(method, 8192)
            assert label == "calibration", method.name
            assert len(points) >= len(method.sweep_params(8192)), method.name
            for p in points:
                method.check_params(p)
    streaming = METHODS["streaming"]
    label, points = cal.calibration_grid(streaming, 8192, [{"sink": 16, "window": 32}] * 2)
    assert label == "--grid" and points == [{"sink": 16, "window": 32}]  # repeats dropped
    text = cal.describe_grid("sweep", [{"sink": 16, "window": 32}, {"sink": 16, "window": 64}], 192)
    assert "no calibration grid" in text and "window 32, 64" in text and "sink=16" in text


def test_layers_written_as_they_finish_and_resumed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Each layer's result goes to the .jsonl (and the config) when it is measured; `--resume`
    keeps them and measures only the layers missing; other settings are refused."""
    capture = toy_capture(tmp_path, layers=(0, 1, 2))
    out_dir = tmp_path / "cfg"
    base = ["--qkv", str(capture), "--method", "streaming", "--rows", "32", "--out-dir", str(out_dir),
            "--table", str(tmp_path / "t")]
    assert cal.main(base) == 0
    err = capsys.readouterr().err
    assert "streaming: its calibration grid" in err and "[3/3 layers" in err and "left" in err
    rows = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert "header" in rows[0] and [r["layer"] for r in rows[1:]] == [0, 1, 2]
    full = json.loads((out_dir / "streaming.json").read_text())
    # A run stopped after layer 1: cut the rows file there, then resume.
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:3]) + "\n" + '{"kind": "la')
    assert cal.main([*base, "--resume"]) == 0
    err = capsys.readouterr().err
    assert "2 row(s) already measured" in err and "cut short" in err and "[1/1 layers" in err
    again = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert [r["layer"] for r in again[1:]] == [0, 1, 2]
    assert again[1]["seconds"] == rows[1]["seconds"]  # read back, not measured again
    assert json.loads((out_dir / "streaming.json").read_text())["layers"] == full["layers"]
    assert cal.main([*base, "--resume", "--rows", "16"]) == 2
    assert "rows = 32" in capsys.readouterr().err
    assert cal.main(["--qkv", str(capture), "--eval", str(out_dir / "streaming.json"), "--resume"]) == 2
