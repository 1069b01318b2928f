"""SampleAttention (Alg. 1): reference steps by hand, edge cases, fast against reference.

Hand-checked tiny cases of each algorithm step, then fast against reference:
integer things (selections, plans) exactly, float things under
`conformance.tolerance`; the tie check accepts what differs only by rounding and
rejects a real difference. Sizes stay tiny: the fast kernels run in Triton's CPU
interpreter here.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from sparseprefill import fast, reference  # noqa: E402
from sparseprefill.conformance import METHODS  # noqa: E402
from sparseprefill.conformance import properties as props  # noqa: E402
from sparseprefill.conformance.ties import (  # noqa: E402
    check_threshold_topk,
    sample_attention_tie_check,
    sample_tolerance,
)
from sparseprefill.fast.kernels.sample_index import sample_attention_index  # noqa: E402
from sparseprefill.fast.kernels import sampled_scores  # noqa: E402
from sparseprefill.fast.kernels.sampled_scores import row_tile_table, row_tiles, tile_table  # noqa: E402
from sparseprefill.reference.plan import BlockColumnPlan  # noqa: E402
from sparseprefill.reference.sample_attention import (  # noqa: E402
    LengthRange,
    SampleAttentionSettings,
    arg_topk,
    block_reduction,
    chunked_sampling,
    find_k,
    merge_index,
    resolve_params,
    sample_attention_scores,
    sample_attention_selection,
    sampled_rows,
)

fast_sa = importlib.import_module("sparseprefill.fast.sample_attention")


def _inputs(b: int, hq: int, hkv: int, n: int, d: int, dtype: torch.dtype = torch.float16,
            seed: int = 0, magnitude: float = 2.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, hq, n, d, generator=gen) * magnitude).to(dtype)
    k, v = (torch.randn(b, hkv, n, d, generator=gen).to(dtype) for _ in range(2))
    return q, k, v


def _lists(plan: BlockColumnPlan, b: int = 0, h: int = 0) -> list[list[int]]:
    return [plan.block_index[b, h, i, : int(plan.block_count[b, h, i])].tolist()
            for i in range(plan.num_query_blocks)]


# -- stage 1 by hand -----------------------------------------------------------------


def test_sampled_rows_by_hand() -> None:
    # Alg. 1: chunk i ends at floor(i N / chunk_n); its last block of rows is sampled.
    assert sampled_rows(1000, 1, 128) == [(872, 1000)]
    assert sampled_rows(1000, 2, 128) == [(372, 500), (872, 1000)]
    assert sampled_rows(1000, 3, 100) == [(233, 333), (566, 666), (900, 1000)]
    # N not a multiple of the block, one chunk shorter than a block: the rows before it are not borrowed.
    assert sampled_rows(129, 1, 64) == [(65, 129)]
    # Chunks of at most a block (chunk_n >= N / block, or more chunks than rows): every row.
    assert sampled_rows(300, 4, 128) == [(0, 300)]
    assert sampled_rows(5, 10**12, 128) == [(0, 5)]
    assert sampled_rows(1, 1, 16) == [(0, 1)]


def test_row_tiles_stay_inside_query_blocks() -> None:
    tiles = row_tiles([(50, 200), (300, 310)], 64, 32)
    assert tiles == [(50, 64), (64, 96), (96, 128), (128, 160), (160, 192), (192, 200), (300, 310)]


@pytest.mark.parametrize("n, chunk_n, block, block_l", [(1000, 3, 128, 64), (4097, 5, 48, 64), (300, 4, 128, 64),
                                                        (777, 7, 16, 32), (200, 1, 80, 64)])
def test_device_tile_table_is_row_tiles(n: int, chunk_n: int, block: int, block_l: int) -> None:
    """The capture-safe table built on the device holds exactly `row_tiles`' tiles."""
    spans = sampled_rows(n, chunk_n, block)
    table, count = row_tile_table(spans, block, torch.device("cpu"), block_l)
    want = row_tiles(spans, block, block_l)
    assert count == len(want)
    assert table.dtype == torch.int32 and table.tolist() == [list(t) for t in want]


def test_kept_tile_table_is_built_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tile_table` keeps the table per spans and block size: row_tiles' tiles, the same
    tensor on the next call, a new one for other spans, none kept beyond the cap."""
    monkeypatch.setattr(sampled_scores, "_TABLES", {})
    spans, cpu = sampled_rows(1000, 3, 128), torch.device("cpu")
    table, count = tile_table(spans, 128, cpu)
    assert table.dtype == torch.int32 and table.tolist() == [list(t) for t in row_tiles(spans, 128)]
    assert count == len(row_tiles(spans, 128))
    assert tile_table(spans, 128, cpu)[0] is table
    other = sampled_rows(1000, 4, 128)
    assert tile_table(other, 128, cpu)[0].tolist() == [list(t) for t in row_tiles(other, 128)]
    monkeypatch.setattr(sampled_scores, "TILE_TABLE_CACHE", 2)
    third = sampled_rows(777, 7, 16)
    assert tile_table(third, 16, cpu)[0].tolist() == [list(t) for t in row_tiles(third, 16)]
    assert len(sampled_scores._TABLES) == 2


def test_block_reduction_by_hand() -> None:
    """Rows 2 and 3 of N = 4 with blocks of 2: cells, columns and block diagonals."""
    a_hat = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.125, 0.125, 0.25, 0.5]], dtype=torch.float64)
    column, slash = block_reduction(a_hat[None, None], torch.tensor([2, 3]), 2)
    # Row 2 (query block 1): key block 0 holds 0.75, block 1 holds 0.25; row 3: 0.25 and 0.75.
    assert column[0, 0].tolist() == [1.0, 1.0]
    # Block diagonal 0 is (1, 1): 0.25 + 0.75; diagonal 1 is (1, 0): 0.75 + 0.25.
    assert slash[0, 0].tolist() == [1.0, 1.0]
    a_hat = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]], dtype=torch.float64)
    column, slash = block_reduction(a_hat[None, None], torch.tensor([0, 3]), 2)
    # Row 0 is in query block 0 (its mass is on diagonal 0); row 3 in block 1, mass on diagonal 1.
    assert column[0, 0].tolist() == [2.0, 0.0]
    assert slash[0, 0].tolist() == [1.0, 1.0]


def test_first_rows_are_sampled_like_any_other() -> None:
    """N = 2 samples both rows; row 0 sees only key 0 and carries mass 1 like row 1."""
    q, k, _ = _inputs(1, 1, 1, 2, 16, torch.float32)
    column, slash = sample_attention_scores(q, k, chunk_n=1, block_size=16)
    assert column.shape == (1, 1, 1)
    assert column[0, 0, 0].item() == pytest.approx(2.0, abs=1e-12)
    assert slash[0, 0, 0].item() == pytest.approx(2.0, abs=1e-12)
    # chunk_n = 2 at N = 40, block 16: chunk 1 is rows [0, 20), sampled from row 4 on.
    q, k, _ = _inputs(1, 1, 1, 40, 16, torch.float32)
    rows = torch.arange(4, 20)
    a_hat = chunked_sampling(q, k, rows, scale=0.25)
    assert float(a_hat[0, 0, 0, :5].sum()) == pytest.approx(1.0)  # row 4 sees keys 0..4 only


def test_scores_sum_to_the_sampled_rows() -> None:
    q, k, _ = _inputs(2, 4, 2, 111, 32, torch.float32)
    for chunk_n, block in ((1, 16), (3, 16), (2, 48), (1000, 32)):
        rows = sum(z - a for a, z in sampled_rows(111, chunk_n, block))
        column, slash = sample_attention_scores(q, k, chunk_n=chunk_n, block_size=block)
        torch.testing.assert_close(column.sum(-1), torch.full((2, 4), float(rows), dtype=torch.float64))
        torch.testing.assert_close(slash.sum(-1), torch.full((2, 4), float(rows), dtype=torch.float64))


# -- stage 2 by hand -----------------------------------------------------------------


def test_find_k_by_hand() -> None:
    # Dyadic scores: every sum below is exact, so "reaches alpha" is decided exactly.
    s = torch.tensor([[[0.125, 0.5, 0.0, 0.25, 0.125]]], dtype=torch.float64)
    want = {0.0: 0, 0.4: 1, 0.5: 1, 0.6: 2, 0.75: 2, 0.8: 3, 0.875: 3, 0.9: 4, 1.0: 4}
    for alpha, k in want.items():
        assert int(find_k(s, alpha)) == k, alpha
    # alpha = 1 keeps every block of non-zero score, and only those.
    assert int(find_k(torch.tensor([[[1e-300, 0.0, 1.0]]], dtype=torch.float64), 1.0)) == 2


def test_arg_topk_ties_go_to_the_lower_index() -> None:
    s = torch.tensor([[[0.25, 0.5, 0.25, 0.25]]], dtype=torch.float64)
    assert arg_topk(s, torch.tensor([[2]]))[0, 0].tolist() == [True, True, False, False]
    assert arg_topk(s, torch.tensor([[0]]))[0, 0].tolist() == [False] * 4
    assert arg_topk(s, torch.tensor([[4]]))[0, 0].tolist() == [True] * 4


def test_merge_index_by_hand() -> None:
    cols = torch.tensor([[[True, False, False, False]]])
    slashes = torch.tensor([[[False, False, True, False]]])
    plan = merge_index(cols, slashes, seqlen=60, block_size=16)
    # Column block 0 everywhere, block diagonal 2, and the diagonal (always).
    assert _lists(plan) == [[0], [0, 1], [0, 2], [0, 1, 3]]
    assert plan.column_count.sum() == 0 and (plan.block_m, plan.block_n) == (16, 16)
    fast_plan = sample_attention_index(cols, slashes, seqlen=60, block_size=16)
    assert fast_plan.validate().equal(plan) and fast_plan.columns_disjoint


def test_fast_merge_index_equals_reference_on_random_selections() -> None:
    gen = torch.Generator().manual_seed(3)
    for n, bs, width in ((1, 16, None), (63, 16, None), (500, 16, None), (700, 32, 30)):
        kb = -(-n // bs)
        cols = torch.rand(2, 2, kb, generator=gen) < 0.2
        slashes = torch.rand(2, 2, kb, generator=gen) < 0.3
        expected = merge_index(cols, slashes, seqlen=n, block_size=bs)
        if width is not None:
            width = max(width, int(expected.block_count.max()))
        got = sample_attention_index(cols, slashes, seqlen=n, block_size=bs, width=width)
        props.check_plans_equal(expected, got, context=f"N={n}")


# -- edge cases of the whole plan -----------------------------------------------------------


def _planted(dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """N = D = 64, one KV head of one-hot keys: query head 0 attends to itself, head 1 to key 3.

    Logits are 20 (scaled) on the chosen key and 0 elsewhere, so each row puts all but
    ~1e-7 of its mass there.
    """
    n = 64
    k = torch.eye(n)[None, None]
    q = torch.zeros(1, 2, n, n)
    q[0, 0] = 160.0 * torch.eye(n)
    q[0, 1, :, 3] = 160.0
    return q.to(dtype), k.to(dtype)


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_planted_self_and_sink(impl: str) -> None:
    """chunk_n = 2, blocks of 16: rows 16..31 (query block 1) and 48..63 (block 3) are sampled.

    Head 0 (self): column blocks 1 and 3 hold 16 each, block diagonal 0 all 32. Head 1
    (key 3): column block 0 holds all; seen from query blocks 1 and 3 the sink lies on
    block diagonals 1 and 3, 16 each, so alpha_s = 0.9 keeps both.
    """
    q, k = _planted()
    mod = fast if impl == "fast" else reference
    select = fast_sa.sample_attention_selection if impl == "fast" else sample_attention_selection
    params: dict[str, Any] = {"alpha_c": 0.9, "alpha_s": 0.9, "chunk_n": 2, "block_size": 16}
    cols, slashes = select(q, k, **params)
    assert [c.nonzero().flatten().tolist() for c in cols[0]] == [[1, 3], [0]]
    assert [s.nonzero().flatten().tolist() for s in slashes[0]] == [[0], [1, 3]]
    plan = mod.sample_attention_plan(q, k, **params).to("cpu")
    assert _lists(plan, 0, 0) == [[0], [1], [1, 2], [1, 3]]
    assert _lists(plan, 0, 1) == [[0], [0, 1], [0, 1, 2], [0, 2, 3]]


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_alpha_extremes(impl: str) -> None:
    q, k, _ = _inputs(2, 1, 1, 111, 32)
    mod = fast if impl == "fast" else reference
    # alpha 0: nothing selected; the forced block diagonal alone.
    plan = mod.sample_attention_plan(q, k, alpha_c=0.0, alpha_s=0.0, block_size=16)
    assert all(_lists(plan, b, 0) == [[i] for i in range(7)] for b in range(2))
    # alpha_c 1: every key block with sampled mass (all of them: the last block sees every key).
    plan = mod.sample_attention_plan(q, k, alpha_c=1.0, alpha_s=0.0, block_size=16)
    assert plan.equal(reference.dense_plan(q, k, block_m=16, block_n=16).to(plan.device))
    # alpha_s 1 with every row sampled: every block diagonal has mass, so dense again.
    plan = mod.sample_attention_plan(q, k, alpha_c=0.0, alpha_s=1.0, chunk_n=200, block_size=16)
    assert plan.equal(reference.dense_plan(q, k, block_m=16, block_n=16).to(plan.device))


@pytest.mark.parametrize("shape", [(1, 1, 1, 1, 64), (2, 4, 2, 63, 64), (1, 3, 1, 129, 128),
                                   (2, 2, 2, 111, 16), (1, 2, 1, 200, 64)])
def test_fast_plan_equals_reference(shape: tuple[int, ...]) -> None:
    b, hq, hkv, n, d = shape
    q, k, _ = _inputs(b, hq, hkv, n, d, seed=n)
    for alpha_c, alpha_s, chunk_n, block in ((0.9, 0.8, 3, 16), (0.99, 0.3, 1000, 64)):
        params = dict(alpha_c=alpha_c, alpha_s=alpha_s, chunk_n=chunk_n, block_size=block)
        props.check_plans_equal(reference.sample_attention_plan(q, k, **params),
                                fast.sample_attention_plan(q, k, **params), context=f"{shape} {params}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fast_scores_within_tolerance(dtype: torch.dtype) -> None:
    q, k, _ = _inputs(2, 2, 1, 100, 64, dtype, magnitude=4.0)
    for chunk_n, block in ((3, 16), (1000, 48)):
        rows = sum(z - a for a, z in sampled_rows(100, chunk_n, block))
        want = sample_attention_scores(q, k, chunk_n=chunk_n, block_size=block)
        got = fast_sa.sample_attention_scores(q, k, chunk_n=chunk_n, block_size=block)
        for w, g in zip(want, got):
            assert g.dtype == torch.float64 and g.shape == w.shape
            err = float((g - w).abs().sum(dim=-1).max())
            assert err < sample_tolerance(rows) / 10, (chunk_n, block, err)


def test_end_to_end_under_the_policy() -> None:
    q, k, v = _inputs(2, 2, 1, 111, 64)
    props.check_method_end_to_end(METHODS["sample_attention"], q, k, v,
                                  {"alpha_c": 0.9, "alpha_s": 0.9, "chunk_n": 2, "block_size": 32})


# -- the tie check --------------------------------------------------------------------------


def test_threshold_topk_check_accepts_ties_and_rejects_wrong_sets() -> None:
    s = torch.tensor([[[0.25, 0.5, 0.25, 0.0]]], dtype=torch.float64)
    ok = torch.tensor([[[True, True, False, False]]])
    tied = torch.tensor([[[False, True, True, False]]])  # the other of two tied blocks
    check_threshold_topk(s, ok, alpha=0.7, tolerance=1e-9, what="x")
    check_threshold_topk(s, tied, alpha=0.7, tolerance=1e-9, what="x")
    with pytest.raises(AssertionError, match="dropped score exceeds"):
        check_threshold_topk(s, torch.tensor([[[True, False, True, False]]]), alpha=0.4, tolerance=1e-9, what="x")
    with pytest.raises(AssertionError, match="does not reach"):
        check_threshold_topk(s, torch.tensor([[[False, True, False, False]]]), alpha=0.7, tolerance=1e-9,
                             what="x")
    with pytest.raises(AssertionError, match="not minimal"):
        check_threshold_topk(s, torch.tensor([[[True, True, True, False]]]), alpha=0.7, tolerance=1e-9,
                             what="x")
    # Within the tolerance of alpha, one block more or less is a tie.
    check_threshold_topk(s, ok, alpha=0.75 + 1e-7, tolerance=1e-6, what="x")
    check_threshold_topk(s, torch.tensor([[[True, True, True, False]]]), alpha=0.75 - 1e-7,
                         tolerance=1e-6, what="x")


def test_tie_check_passes_the_fast_plan_and_catches_a_wrong_one() -> None:
    q, k, _ = _inputs(1, 2, 1, 64, 32)
    params: dict[str, Any] = {"alpha_c": 0.8, "alpha_s": 0.8, "chunk_n": 2, "block_size": 16}
    expected = reference.sample_attention_plan(q, k, **params)
    got = fast.sample_attention_plan(q, k, **params)
    sample_attention_tie_check(q, k, params, expected, got)
    cols, slashes = fast_sa.sample_attention_selection(q, k, **params)
    cols = cols.clone()
    cols[0, 0, cols[0, 0].nonzero()[0]] = False  # drop one kept column block
    wrong = merge_index(cols, slashes, seqlen=64, block_size=16)
    with pytest.raises(AssertionError, match="not merge_index of the fast selection"):
        sample_attention_tie_check(q, k, params, expected, wrong)


# -- parameters, settings and validation ----------------------------------------------------------


def _settings() -> SampleAttentionSettings:
    return SampleAttentionSettings(
        (LengthRange(0, 100, 0.5, 0.6, 1), LengthRange(100, 200, 0.7, 0.8, 2),
         LengthRange(400, None, 0.9, 0.95, 4, {"density": 0.1})), block_size=16, target={"recall_mean": 0.95})


def test_settings_lookup_and_json(tmp_path: Path) -> None:
    s = _settings()
    assert s.for_seqlen(1).alpha_c == 0.5 and s.for_seqlen(99).alpha_c == 0.5
    assert s.for_seqlen(100).chunk_n == 2
    # Gaps and ends take the nearest range (ties: the longer lengths), as Section 5.4 reuses 128K above it.
    assert s.for_seqlen(250).chunk_n == 2 and s.for_seqlen(300).chunk_n == 4 and s.for_seqlen(10**7).chunk_n == 4
    path = s.save(tmp_path / "tuned.json")
    assert SampleAttentionSettings.load(path) == s
    assert json.loads(path.read_text())["format"] == "sparseprefill.sample_attention"
    with pytest.raises(ValueError, match="disjoint"):
        SampleAttentionSettings((LengthRange(0, 100, 0.5, 0.5, 1), LengthRange(50, None, 0.5, 0.5, 1)))
    with pytest.raises(ValueError, match="alpha_s"):
        SampleAttentionSettings((LengthRange(0, None, 0.5, 1.5, 1),))
    with pytest.raises(ValueError, match="format"):
        SampleAttentionSettings.from_json('{"ranges": []}')


def test_parameters_resolve_explicit_then_settings_then_defaults(tmp_path: Path) -> None:
    s = _settings()
    assert resolve_params(150, alpha_c=None, alpha_s=None, chunk_n=None, block_size=16, settings=s) == (0.7, 0.8, 2)
    assert resolve_params(150, alpha_c=0.1, alpha_s=None, chunk_n=None, block_size=16, settings=s) == (0.1, 0.8, 2)
    assert resolve_params(150, alpha_c=None, alpha_s=None, chunk_n=None, block_size=16, settings=None) == (
        0.95, 0.95, 1)
    with pytest.raises(ValueError, match="block_size 16"):
        resolve_params(150, alpha_c=None, alpha_s=None, chunk_n=None, block_size=32, settings=s)
    path = str(s.save(tmp_path / "tuned.json"))
    q, k, v = _inputs(1, 2, 1, 150, 32)
    for mod in (reference, fast):
        by_file = mod.sample_attention_plan(q, k, block_size=16, settings=path)
        explicit = mod.sample_attention_plan(q, k, alpha_c=0.7, alpha_s=0.8, chunk_n=2, block_size=16)
        assert by_file.equal(explicit)


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_bad_parameters_raise_before_any_work(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    mod = fast if impl == "fast" else reference

    def no_launch(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(fast_sa, "_sampled_block_scores", no_launch)
    monkeypatch.setattr(fast_sa, "block_column_attention", no_launch)
    q, k, v = _inputs(1, 2, 1, 64, 32)
    bad: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"alpha_c": -0.1}, ValueError, "alpha_c"), ({"alpha_s": 1.5}, ValueError, "alpha_s"),
        ({"alpha_c": math.nan}, ValueError, "alpha_c"), ({"alpha_s": True}, TypeError, "alpha_s"),
        ({"alpha_c": "0.9"}, TypeError, "alpha_c"), ({"chunk_n": 0}, ValueError, "chunk_n"),
        ({"chunk_n": 2.0}, TypeError, "chunk_n"), ({"block_size": 0}, ValueError, "block_size"),
        ({"settings": 3}, TypeError, "settings"), ({"scale": -1.0}, ValueError, "scale"),
    ]
    if impl == "fast":
        bad.append(({"block_size": 24}, ValueError, "multiple of 16"))
    for params, exc, match in bad:
        with pytest.raises(exc, match=match):
            mod.sample_attention(q, k, v, **params)
    with pytest.raises(ValueError, match="v must have the shape"):
        mod.sample_attention(q, k, v[:, :, :10])
    if impl == "fast":
        with pytest.raises(TypeError, match="dtype"):
            mod.sample_attention_plan(q.float(), k.float())


# -- the transformers route for tuned settings ------------------------------------------------------


def test_patch_loads_tuned_settings(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the `hf` extra is not installed")
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparseprefill.integrations.transformers import patch, unpatch

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(1))
    path = str(_settings().save(tmp_path / "tuned.json"))
    outs = []
    for config in ({"settings": path, "block_size": 16},
                   {"alpha_c": 0.7, "alpha_s": 0.8, "chunk_n": 2, "block_size": 16}):
        attn = patch(model, "sample_attention", config, backend="reference", min_seqlen=64)
        with torch.no_grad():
            outs.append(model(ids).logits)
        assert attn.calls == {"sparse": 2}
        unpatch(model)
    assert torch.equal(outs[0], outs[1])
