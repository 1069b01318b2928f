"""Per-head method choice (`headwise`): plans at finer blocks, merging heads of different units,
the grouped estimate in both packages, the config form, `patch`, and `calibrate --method headwise`.

Small sizes (N <= 300, a few heads): the interpreter runs the fast estimators in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from sparseprefill import calibrate as cal
from sparseprefill import fast, methods, reference
from sparseprefill.config import parse_config, read_config
from sparseprefill.reference.dense_fallback import RatePoint, RateTable, dense_fallback
from sparseprefill.reference.headwise import KNOBS, check_heads, estimate_share, head_calls, reference_estimators
from sparseprefill.reference.plan import BlockColumnPlan, merge_heads


def _random_plan(seed: int, *, n: int, bm: int, bn: int, offset: int = 0, heads: int = 3,
                 density: float = 0.4) -> BlockColumnPlan:
    gen = torch.Generator().manual_seed(seed)
    keys = offset + n
    qb, kb = -(-n // bm), -(-keys // bn)
    blocks = torch.rand(2, heads, qb, kb, generator=gen) < density
    columns = torch.rand(2, heads, qb, keys, generator=gen) < 0.1
    return BlockColumnPlan.from_masks(blocks, columns, seqlen=n, block_m=bm, block_n=bn, query_offset=offset)


# -- BlockColumnPlan.refined -----------------------------------------------------------------


@pytest.mark.parametrize("n,bm,bn,fm,fn,offset", [
    (300, 128, 128, 2, 2, 0), (300, 64, 128, 1, 2, 0), (257, 128, 64, 2, 1, 0), (257, 128, 128, 4, 8, 0),
    (200, 32, 64, 2, 4, 37), (65, 64, 64, 4, 2, 3), (1, 16, 16, 2, 2, 0),
])
def test_refined_keeps_every_row(n: int, bm: int, bn: int, fm: int, fn: int, offset: int) -> None:
    plan = _random_plan(n + bm + bn, n=n, bm=bm, bn=bn, offset=offset)
    fine = plan.refined(bm // fm, bn // fn)
    assert (fine.block_m, fine.block_n, fine.query_offset) == (bm // fm, bn // fn, offset)
    fine.validate()
    assert torch.equal(fine.to_dense_mask(), plan.to_dense_mask())
    if offset == 0:  # density counts a whole prompt
        assert torch.equal(reference.density(fine), reference.density(plan))
    assert fine.column_group == fm * plan.column_group and fine.column_index is plan.column_index


def test_refined_grouped_and_shared_columns_and_dense_marks() -> None:
    """Grouped column rows (AnchorAttention's) and a column list shared by every query block
    (a stride-0 view, vertical-slash's) are reused as they are; dense marks are kept."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 150, 16, generator=gen), torch.randn(1, 2, 150, 16, generator=gen)
    grouped = reference.anchor_attention_plan(q, k, block_m=32, block_n=32, step=3, theta=4.0)
    assert grouped.column_group == 3 and int(grouped.column_count.sum()) > 0
    fine = grouped.refined(16, 8).validate()
    assert torch.equal(fine.to_dense_mask(), grouped.to_dense_mask()) and fine.column_group == 6
    base = _random_plan(1, n=150, bm=32, bn=32, heads=2)
    cols = torch.tensor([0, 5, 40, 41, 97, 140], dtype=torch.int32)
    qb = base.num_query_blocks
    last = torch.clamp((torch.arange(qb) + 1) * 32 - 1, max=149)
    shared = BlockColumnPlan(
        seqlen=150, block_m=32, block_n=32, block_count=base.block_count, block_index=base.block_index,
        column_count=(cols[None, :] <= last[:, None]).sum(-1).to(torch.int32).expand(2, 2, qb),
        column_index=cols.view(1, 1, 1, -1).expand(2, 2, qb, 6), dense_heads=(1,)).validate()
    fine = shared.refined(16, 16).validate()
    assert torch.equal(fine.to_dense_mask(), shared.to_dense_mask()) and fine.dense_heads == (1,)
    assert fine.column_index.stride(2) == 0


def test_refined_identity_and_bad_sizes() -> None:
    plan = _random_plan(2, n=100, bm=32, bn=64)
    assert plan.refined(32, 64) is plan
    with pytest.raises(ValueError, match="block_n=48 must divide the plan's block_n=64"):
        plan.refined(32, 48)
    with pytest.raises(ValueError, match="block_m=64 must divide"):
        plan.refined(64, 64)
    with pytest.raises(TypeError):
        plan.refined(16.0, 64)  # type: ignore[arg-type]


# -- merge_heads -----------------------------------------------------------------------------


def _heads(plan: BlockColumnPlan, heads: list[int]) -> BlockColumnPlan:
    """The plan of some of a plan's heads (validated lists, sliced)."""
    idx = torch.tensor(heads)
    return BlockColumnPlan(
        seqlen=plan.seqlen, block_m=plan.block_m, block_n=plan.block_n,
        block_count=plan.block_count[:, idx], block_index=plan.block_index[:, idx],
        column_count=plan.column_count[:, idx], column_index=plan.column_index[:, idx],
        query_offset=plan.query_offset, dense_heads=tuple(i for i, h in enumerate(heads) if h in plan.dense_heads))


def test_merge_heads_at_the_finest_unit() -> None:
    a = _random_plan(3, n=130, bm=64, bn=64, heads=2)
    b = _random_plan(4, n=130, bm=32, bn=128, heads=3).with_dense_heads([2])
    merged = merge_heads([(a, [4, 0]), (_heads(b, [0, 2]), [1, 3])], num_heads=6, dense_heads=[2, 5])
    merged.validate()
    assert (merged.block_m, merged.block_n) == (32, 64) and merged.dense_heads == (2, 3, 5)
    mask = merged.to_dense_mask()
    assert torch.equal(mask[:, 4], a.to_dense_mask()[:, 0]) and torch.equal(mask[:, 0], a.to_dense_mask()[:, 1])
    assert torch.equal(mask[:, 1], b.to_dense_mask()[:, 0])
    causal = torch.ones(130, 130, dtype=torch.bool).tril()
    for h in (2, 3, 5):  # b's head 2 was marked dense: the mark moves with it
        assert torch.equal(mask[:, h], causal.expand(2, 130, 130))


def test_merge_heads_refuses() -> None:
    a = _random_plan(5, n=100, bm=32, bn=32, heads=2)
    with pytest.raises(ValueError, match=r"query heads \[2\] are given by no part"):
        merge_heads([(a, [0, 1])], num_heads=3)
    with pytest.raises(ValueError, match="query head 1 is given by parts"):
        merge_heads([(a, [0, 1]), (a, [1, 2])], num_heads=3)
    with pytest.raises(ValueError, match="differs from parts"):
        merge_heads([(a, [0, 1]), (_random_plan(6, n=90, bm=32, bn=32, heads=1), [2])], num_heads=3)
    with pytest.raises(ValueError, match="names 1 heads for a plan of 2"):
        merge_heads([(a, [0])], num_heads=2)
    with pytest.raises(ValueError, match="outside"):
        merge_heads([(a, [0, 7])], num_heads=2)


# -- headwise_plan ---------------------------------------------------------------------------

CHOICES: list[dict[str, Any] | None] = [
    {"method": "xattention", "stride": 4, "threshold": 0.9, "block": 64},
    {"method": "vertical_slash", "vertical_size": 20, "slash_size": 40, "block_m": 32, "block_n": 32},
    None,
    {"method": "xattention", "stride": 4, "threshold": 0.8, "block": 64},
    {"method": "streaming", "sink": 32, "window": 64, "block_m": 64, "block_n": 64},
    {"method": "sample_attention", "alpha_c": 0.9, "alpha_s": 0.9, "block_size": 64},
]


def _qk(n: int = 230, hq: int = 6, hkv: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(2, hq, n, 32, generator=gen), torch.randn(2, hkv, n, 32, generator=gen)


def _method_masks(impl: Any, q: torch.Tensor, k: torch.Tensor, choices: list[dict[str, Any] | None]
                  ) -> dict[int, torch.Tensor]:
    """Each head's keys under its own method's plan of the whole layer (knobs per head)."""
    hq = int(q.shape[1])
    out = {}
    for h in range(hq):
        choice = choices[h % len(choices)]
        if choice is None:
            continue
        params = {key: val for key, val in choice.items() if key != "method"}
        plan = getattr(impl, f"{choice['method']}_plan")(q, k, **params)
        out[h] = plan.to_dense_mask()[:, h]
    return out


def test_head_calls_split_uneven_groups() -> None:
    assert head_calls([0, 1, 2], 6, 2) == [([0, 1, 2], [0])]
    assert head_calls([0, 1, 3, 5], 6, 2) == [([0, 1, 3, 5], [0, 1])]
    assert head_calls([0, 1, 3], 6, 2) == [([3], [1]), ([0, 1], [0])]


def test_headwise_plan_gives_each_head_its_methods_plan() -> None:
    q, k = _qk()
    plan = reference.headwise_plan(q, k, heads=CHOICES)
    plan.validate()
    assert (plan.block_m, plan.block_n) == (32, 32) and plan.dense_heads == (2,)
    mask = plan.to_dense_mask()
    for h, want in _method_masks(reference, q, k, CHOICES).items():
        assert torch.equal(mask[:, h], want), h
    # A shorter list repeats over the heads; a dense-only list marks every head.
    short = reference.headwise_plan(q, k, heads=CHOICES[:2]).to_dense_mask()
    for h, want in _method_masks(reference, q, k, CHOICES[:2]).items():
        assert torch.equal(short[:, h], want), h
    assert reference.headwise_plan(q, k, heads=[None]).dense_heads == tuple(range(6))


def test_packages_agree() -> None:
    """fast and reference give every head its own package's method plan; where the two
    packages' method plans agree (no tie decided differently), so do their headwise plans."""
    q, k = _qk(n=200)
    qh, kh = q.half(), k.half()
    ref = reference.headwise_plan(qh.float(), kh.float(), heads=CHOICES).to_dense_mask()
    got = fast.headwise_plan(qh, kh, heads=CHOICES).to_dense_mask()
    ref_methods = _method_masks(reference, qh.float(), kh.float(), CHOICES)
    fast_methods = _method_masks(fast, qh, kh, CHOICES)
    compared = 0
    for h in range(6):
        if h in fast_methods:
            assert torch.equal(got[:, h], fast_methods[h]), h
            assert torch.equal(ref[:, h], ref_methods[h]), h
            if torch.equal(fast_methods[h], ref_methods[h]):
                assert torch.equal(got[:, h], ref[:, h]), h
                compared += 1
        else:
            assert bool(got[:, h].equal(ref[:, h]))
    assert compared >= 4
    v = torch.randn(2, 2, 200, 32, generator=torch.Generator().manual_seed(9)).half()
    out = fast.headwise(qh, kh, v, heads=CHOICES)
    want = reference.sparse_attention(qh.float(), kh.float(), v.float(),
                                      fast.headwise_plan(qh, kh, heads=CHOICES))
    torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=0)


def test_headwise_rule_marks_the_merged_plan() -> None:
    """The break-even rule runs on the merged plan: with a table where every pair costs more
    than dense, every sparse head is marked dense."""
    q, k = _qk(n=128)
    point = RatePoint(seqlen=128, head_dim=32, dtype="bfloat16", tile=64, block_ps=5.0, columns_ps=5.0,
                      ragged_ps=5.0, program_us=0.0, sdpa_ps=1.0, dense_ps=1.0)
    with dense_fallback(rates=RateTable(device="test", source="test", points=(point,))):
        plan = reference.headwise_plan(q, k, heads=CHOICES)
    assert plan.dense_heads == tuple(range(6))


def test_check_heads_and_descriptor_check() -> None:
    est = reference_estimators()
    with pytest.raises(ValueError, match=r"heads\[1\]\.method: expected one of"):
        check_heads([None, {"method": "delta_kv"}], est)
    with pytest.raises(ValueError, match=r"heads\[0\]\.threshold: one value for its own head"):
        check_heads([{"method": "xattention", "threshold": [0.9, 0.8]}], est)
    with pytest.raises(TypeError, match="xattention takes no parameter 'gamma'"):
        check_heads([{"method": "xattention", "gamma": 0.9}], est)
    with pytest.raises(TypeError, match="must be a list"):
        check_heads({"method": "xattention"}, est)
    method = methods.get("headwise")
    method.check_params(method.demo_params(4096))
    with pytest.raises(ValueError, match=r"heads\[1\] \(vertical_slash\)"):
        method.check_params({"heads": [None, {"method": "vertical_slash", "vertical_size": 0, "slash_size": 8}]})


def test_knobs_are_the_descriptors() -> None:
    for name, knobs in KNOBS.items():
        assert methods.get(name).knobs == knobs, name
        assert methods.get(name).coupled_heads == "" and methods.get(name).new_state is None, name


def test_estimate_share_model() -> None:
    assert estimate_share("vertical_slash", {}, seqlen=32768, head_dim=128) == pytest.approx(0.0980)
    assert estimate_share("vertical_slash", {}, seqlen=8192, head_dim=128) == pytest.approx(0.0980)
    assert estimate_share("vertical_slash", {}, seqlen=65536, head_dim=128) == pytest.approx((0.0980 + 0.0194) / 2)
    assert estimate_share("xattention", {"stride": 16}, seqlen=32768, head_dim=64) == pytest.approx(0.1519 / 2)
    assert estimate_share("streaming", {}, seqlen=32768, head_dim=64) == 0.0
    assert estimate_share("block_sparse", {}, seqlen=32768, head_dim=64) is None


# -- the config and patch --------------------------------------------------------------------


def test_config_names_a_method_per_head() -> None:
    base = {"format": "sparseprefill.calibrate/1", "method": "headwise", "q_heads": 3}
    spec = [{"method": "xattention", "threshold": 0.9}, None, {"method": "streaming", "sink": 16, "window": 32}]
    assert parse_config({**base, "layers": {"4": spec}}).layers[4] == spec
    with pytest.raises(ValueError, match=r"layers\['4'\]\[0\]\.method: every head of a 'headwise' config"):
        parse_config({**base, "layers": {"4": [{"threshold": 0.9}, None, None]}})
    with pytest.raises(ValueError, match=r"layers\['4'\]\[2\]\.method: expected a method one head can take"):
        parse_config({**base, "layers": {"4": [None, None, {"method": "shareprefill"}]}})
    with pytest.raises(ValueError, match=r"layers\['4'\]\[0\]: bad parameters for 'xattention'"):
        parse_config({**base, "layers": {"4": [{"method": "xattention", "threshold": 3.0}, None, None]}})
    # Another method's per-head list may name methods too.
    other = {**base, "method": "streaming", "layers": {"0": [{"method": "xattention"}, {"sink": 8}, None]}}
    assert parse_config(other).layers[0][1] == {"sink": 8}


def test_build_plan_merges_heads_of_different_blocks() -> None:
    """A per-head layer whose heads use different block sizes: one plan at the finest unit,
    each head as planned alone (before, such a layer was refused)."""
    from sparseprefill.integrations.transformers import Choice, build_plan

    q, k = _qk(n=150, hq=4)
    narrow = Choice("streaming", {"sink": 0, "window": 16, "block_m": 16, "block_n": 16})
    wide = Choice("streaming", {"sink": 32, "window": 48, "block_m": 32, "block_n": 64})
    plan = build_plan(q, k, [narrow, wide, Choice("dense", None), wide], fast_plans=False)
    assert (plan.block_m, plan.block_n) == (16, 16) and plan.dense_heads == (2,)
    mask = plan.to_dense_mask()
    for h, choice in ((0, narrow), (1, wide), (3, wide)):
        alone = build_plan(q[:, h:h + 1], k[:, h // 2:h // 2 + 1], [choice], fast_plans=False)
        assert torch.equal(mask[:, h:h + 1], alone.to_dense_mask())


# -- calibrate --method headwise -------------------------------------------------------------

N, HQ, HKV, D = 192, 4, 2, 16


def _capture(tmp_path: Path) -> Path:
    """Heads 0-1 local (a positional code), heads 2-3 near uniform."""
    gen = torch.Generator().manual_seed(0)
    pos = torch.arange(N, dtype=torch.float32)
    angle = pos[:, None] * (0.35 / (1 + torch.arange(D // 2, dtype=torch.float32)))[None, :]
    rot = torch.cat([angle.cos(), angle.sin()], dim=-1)
    q, k = torch.zeros(1, HQ, N, D), torch.zeros(1, HKV, N, D)
    k[0, 0], q[0, 0], q[0, 1] = rot, rot * 4.0, rot * 4.0
    k[0, 1] = 0.01 * torch.randn(N, D, generator=gen)
    q[0, 2:] = 0.01 * torch.randn(2, N, D, generator=gen)
    v = torch.randn(1, HKV, N, D, generator=gen)
    path = tmp_path / "toy.pt"
    torch.save({"layers": [0], "q": [q], "k": [k], "v": [v], "scale": [D ** -0.5], "meta": {"seqlen": N}}, path)
    return path


CANDIDATES = json.dumps([{"method": "streaming", "block_m": 16, "block_n": 16},
                         {"method": "xattention", "stride": 4, "block": 32}])


def test_choose_heads_prices_time_and_units() -> None:
    """Least modelled time per head; the finer unit where the layer gains by it; dense where
    no option beats dense; the density objective takes the fewest pairs whatever they cost."""
    point = RatePoint(seqlen=1000, head_dim=64, dtype="bfloat16", tile=128, block_ps=1.0, columns_ps=1.0,
                      ragged_ps=1.0, program_us=1e-4, sdpa_ps=1.0, dense_ps=1.0)
    rates = RateTable(device="test", source="test", points=(point,))

    def opt(family: int, block_m: int, pairs: float) -> cal.HeadOption:
        return cal.HeadOption(family, {"method": "streaming", "block_m": block_m}, block_m, pairs / 500500,
                              1.0, 1.0, pairs, 0.0)

    # ms per head: pairs * 1e-9, programs ceil(1000 / tile) * 1e-7, dense 500500 * 1e-9.
    options = [[opt(0, 128, 200e3), opt(0, 128, 100e3), opt(0, 128, 510e3)],
               [opt(1, 64, 190e3), opt(1, 64, 40e3), None]]
    dense = 500500e-9
    coarse = 200e3 * 1e-9 + 8e-7 + 100e3 * 1e-9 + 8e-7 + dense
    fine = 190e3 * 1e-9 + 16e-7 + 40e3 * 1e-9 + 16e-7 + dense
    assert fine < coarse
    picks, record = cal.choose_heads(options, seqlen=1000, batch=1, head_dim=64, dtype="bfloat16", rates=rates)
    assert record["unit"] == 64 and [None if p is None else p.family for p in picks] == [1, 1, None]
    assert record["total_ms"] == pytest.approx(fine) and record["dense_ms"] == pytest.approx(dense)
    # Without the fine family the coarse unit serves heads 0 and 1.
    picks, record = cal.choose_heads(options[:1], seqlen=1000, batch=1, head_dim=64, dtype="bfloat16", rates=rates)
    assert record["unit"] == 128 and record["total_ms"] == pytest.approx(coarse)
    assert [None if p is None else p.family for p in picks] == [0, 0, None]
    picks, record = cal.choose_heads(options, seqlen=1000, batch=1, head_dim=64, dtype="bfloat16", rates=rates,
                                     objective="density")
    assert [None if p is None else p.family for p in picks] == [1, 1, 0] and record["unit"] == 64
    with pytest.raises(ValueError, match="objective"):
        cal.choose_heads(options, seqlen=1000, batch=1, head_dim=64, dtype="bfloat16", rates=rates,
                         objective="speed")


def test_calibrate_headwise_config_into_patch(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the `hf` extra is not installed")
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparseprefill.integrations.transformers import patch, unpatch

    capture = _capture(tmp_path)
    args = ["--qkv", str(capture), "--method", "headwise", "--rows", "48", "--target-recall", "0.9",
            "--headwise-candidates", CANDIDATES, "--headwise-objective", "density", "--refine", "1",
            "--out-dir", str(tmp_path / "cfg"), "--table", str(tmp_path / "calib")]
    assert cal.main(args) == 0
    config = read_config(tmp_path / "cfg" / "headwise.json", method="headwise")
    spec = config.layers[0]
    assert isinstance(spec, list) and len(spec) == HQ
    assert all(h is None or h["method"] in ("streaming", "xattention") for h in spec)
    assert any(h is not None for h in spec)
    table = json.loads((tmp_path / "calib.json").read_text())
    record = table["layers"][0]["headwise"]
    assert record["objective"] == "density" and len(record["options"]) == 2
    assert table["summary"][0]["recall_min_head"] >= 0.9
    # Choose again from the measured options (another objective) without measuring them.
    again = [a if a != "density" else "time" for a in args]
    again[again.index(str(tmp_path / "cfg"))] = str(tmp_path / "cfg2")
    assert cal.main([*again, "--headwise-reuse", str(tmp_path / "calib.json")]) == 0
    assert cal.main(["--qkv", str(capture), "--eval", str(tmp_path / "cfg" / "headwise.json"), "--rows", "48"]) == 0

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=HQ, num_key_value_heads=HKV,
                                         max_position_embeddings=256)).eval()
    ids = torch.randint(0, 64, (1, 96), generator=torch.Generator().manual_seed(1))
    every = {0: [{"method": "streaming", "sink": 0, "window": 100, "block_m": 16, "block_n": 16},
                 {"method": "xattention", "stride": 4, "threshold": 1.0, "block": 32}, None,
                 {"method": "streaming", "sink": 100, "window": 1, "block_m": 32, "block_n": 32}]}
    with torch.no_grad():
        dense = model(ids).logits
        patch(model, "headwise", config=config, backend="reference", min_seqlen=1)
        try:
            out = model(ids).logits
        finally:
            unpatch(model)
        patch(model, "headwise", config=every, backend="reference", min_seqlen=1)
        try:
            full = model(ids).logits  # every head keeps every causal key: dense attention
        finally:
            unpatch(model)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(full, dense, atol=1e-4, rtol=0)


def test_headwise_heads_of_any_config() -> None:
    """Any method's config as the headwise method's heads: the same plan per head."""
    from sparseprefill.config import CalibratedConfig, headwise_heads

    q, k = _qk(n=150, hq=4)
    spec = {"stride": 4, "block": 32, "threshold": [0.9, 0.8, 0.95, 0.7], "dense_heads": [2]}
    config = CalibratedConfig("xattention", {3: spec, 4: None}, {"q_heads": 4})
    heads = headwise_heads(config, 3)
    assert heads[2] is None and heads[1] == {"method": "xattention", "stride": 4, "block": 32, "threshold": 0.8}
    want = reference.xattention_plan(q, k, stride=4, block=32, threshold=[0.9, 0.8, 0.95, 0.7]).with_dense_heads([2])
    assert torch.equal(reference.headwise_plan(q, k, heads=heads).to_dense_mask(), want.to_dense_mask())
    assert headwise_heads(config, 4) == [None] * 4 and headwise_heads(config, 7) == [None] * 4
    listed = CalibratedConfig("streaming", {0: [{"sink": 8, "window": 16}, None, {"method": "dense"}, None]},
                              {"q_heads": 4})
    assert headwise_heads(listed, 0) == [{"method": "streaming", "sink": 8, "window": 16}, None, {"method": "dense"},
                                         None]
    with pytest.raises(ValueError, match="no q_heads"):
        headwise_heads(CalibratedConfig("xattention", {0: spec}), 0)


def test_eval_modelled_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`sparseprefill eval modelled-time`: a config whose heads all run dense costs the dense
    time; a mixed one is priced head by head; its heads' methods and the unit are recorded;
    bad --config and --batch refused."""
    from sparseprefill.cli import main
    from sparseprefill.config import CalibratedConfig, write_config

    capture = _capture(tmp_path)
    dense_cfg = write_config(tmp_path / "dense.json", CalibratedConfig(
        "streaming", {0: {"sink": 16, "window": 32, "block_m": 16, "block_n": 16, "dense_heads": [0, 1, 2, 3]}},
        {"q_heads": HQ}))
    sparse_cfg = write_config(tmp_path / "sparse.json", CalibratedConfig(
        "headwise", {0: [{"method": "streaming", "sink": 16, "window": 16, "block_m": 16, "block_n": 16}, None,
                         {"method": "xattention", "stride": 4, "threshold": 0.5, "block": 32}, None]},
        {"q_heads": HQ}))
    out = tmp_path / "time.json"
    assert main(["eval", "modelled-time", "--qkv", str(capture), "--config", f"all dense={dense_cfg}",
                 "--config", f"mixed={sparse_cfg}", "--batch", "2", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| all dense | 0 |" in table and "| mixed | 0 |" in table
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    dense, mixed = rows["all dense"], rows["mixed"]
    assert dense["dense_heads"] == [0, 1, 2, 3] and dense["ms"] == pytest.approx(dense["dense_ms"])
    assert mixed["methods"] == ["streaming", None, "xattention", None] and {1, 3} <= set(mixed["dense_heads"])
    # Heads the config runs dense cost the dense time; a sparse head its kernel time (or dense, when the
    # rule sends it dense) plus its method's estimate, paid either way.
    per_head = dense["dense_ms"] / HQ
    assert mixed["head_ms"][1] == pytest.approx(per_head) and mixed["head_ms"][3] == pytest.approx(per_head)
    assert mixed["head_ms"][0] <= per_head and mixed["head_ms"][2] >= min(mixed["head_ms"][0], per_head)
    assert mixed["ms"] == pytest.approx(sum(mixed["head_ms"])) and mixed["dense_ms"] == pytest.approx(dense["dense_ms"])
    assert 0 < mixed["density"] < 1 and mixed["block_m"] == 16
    with pytest.raises(ValueError, match="LABEL=PATH"):
        main(["eval", "modelled-time", "--qkv", str(capture), "--config", str(dense_cfg)])
    with pytest.raises(ValueError, match="batch"):
        main(["eval", "modelled-time", "--qkv", str(capture), "--config", f"a={dense_cfg}", "--batch", "0"])
