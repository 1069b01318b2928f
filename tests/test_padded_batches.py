"""Padded batches through the transformers integration (tiny random models on CPU).

A batch whose mask is causal with key padding (left, right, mixed, padding inside a
row) is packed into the varlen layout: each prompt is planned on its own and equals
that prompt run alone through the patched model; the query positions that are
padding get transformers' own SDPA rows; full attention through the patch equals
the unpatched model everywhere, pads included. Other masks still raise.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

for _module in ("transformers", "gguf", "accelerate"):
    pytest.importorskip(_module, reason="the `hf` extra is not installed: pip install 'sparseprefill[hf]'")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import sdpa_mask  # noqa: E402

from sparseprefill import reference  # noqa: E402
from sparseprefill.conformance.tolerance import nan_poisoned_empty  # noqa: E402
from sparseprefill.conformance.registry import METHODS  # noqa: E402
from sparseprefill.integrations.transformers import (  # noqa: E402
    SparsePrefillAttention,
    _stack_sequence_plans,
    key_padding,
    patch,
    patched_attention,
    unpatch,
)

# 2 layers, 4 query / 2 KV heads (GQA), head dim 16; `kv_heads=4` gives plain multi-head.
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
BLOCKS = {"block_m": 16, "block_n": 16}
STREAMING = {"sink": 8, "window": 16, **BLOCKS}
VERTICAL_SLASH = {"vertical_size": 4, "slash_size": 4, "last_q": 16, "init_columns": 1, "local_diagonals": 1, **BLOCKS}
# Reference backend: float64 math against float32 SDPA (measured max |diff| 7e-7 on hidden
# states, 2e-7 on logits). Fast backend: q, k, v in float16 (measured 7e-4 on hidden states,
# 1.3e-4 on logits; the bound is the one of test_integration_transformers' fast test).
ATOL = {"reference": 1e-5, "fast": 2e-2}

# (length, side) per batch row; side "left" or "right" padding up to the longest row.
LAYOUTS: dict[str, list[tuple[int, str]]] = {
    "left": [(70, "left"), (45, "left"), (20, "left")],
    "right": [(70, "right"), (51, "right"), (33, "right")],
    "mixed": [(37, "left"), (70, "right"), (52, "right"), (1, "left")],
    "one_row": [(41, "left")],
}


def _model(kv_heads: int = 2) -> Any:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, "num_key_value_heads": kv_heads})).eval()


@pytest.fixture
def llama() -> Iterator[Any]:
    model = _model()
    yield model
    if patched_attention(model) is not None:
        unpatch(model)


def _batch(rows: list[tuple[int, str]], n: int | None = None, seed: int = 1) -> dict[str, torch.Tensor]:
    """ids, attention_mask and position_ids (0 at each row's first real token, as
    `generate` makes them) of a padded batch."""
    n = n or max(length for length, _ in rows)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TINY["vocab_size"], (len(rows), n), generator=gen)
    mask = torch.zeros(len(rows), n, dtype=torch.long)
    for r, (length, side) in enumerate(rows):
        if side == "left":
            mask[r, n - length:] = 1
        else:
            mask[r, :length] = 1
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids}


def _forward(model: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Logits and every hidden state."""
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
    return (out.logits, *out.hidden_states)


def _left_pads(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """bool [B, N]: pads before a row's first real token (fully masked query rows)."""
    return batch["attention_mask"].cumsum(1) == 0


# -- full attention through the patch equals the unpatched model ------------------------------


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dense_padded_batch_equals_unpatched(llama: Any, layout: str) -> None:
    batch = _batch(LAYOUTS[layout])
    want = _forward(llama, batch)
    attn = patch(llama, "dense", BLOCKS, backend="reference", min_seqlen=1)
    with nan_poisoned_empty():  # every position of the output is written
        got = _forward(llama, batch)
    assert attn.calls == {"sparse": 2}
    pads = _left_pads(batch)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=ATOL["reference"])
        # A left pad attends to no key: SDPA's row (zeros) in both, so equal bit for bit.
        assert torch.equal(g[pads], w[pads])


def test_generate_on_a_left_padded_batch(llama: Any) -> None:
    """`generate` pads on the left: the prefill takes the padded path, decode steps SDPA."""
    batch = _batch([(50, "left"), (31, "left")])
    args = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            "max_new_tokens": 4, "do_sample": False}
    with torch.no_grad():
        want = llama.generate(**args)
        attn = patch(llama, "dense", BLOCKS, backend="reference", min_seqlen=1)
        got = llama.generate(**args)
    assert attn.calls == {"sparse": 2, "sdpa": 6}
    assert torch.equal(got, want)


def test_dense_padded_batch_fast_backend_and_mha() -> None:
    """The fast backend (one varlen launch, float16) on a plain multi-head model."""
    model = _model(kv_heads=4)
    batch = _batch([(40, "left"), (48, "right"), (23, "right")])
    want = _forward(model, batch)
    attn = patch(model, "dense", BLOCKS, backend="fast", min_seqlen=1)
    with nan_poisoned_empty():
        got = _forward(model, batch)
    assert attn.calls == {"sparse": 2} and got[0].dtype == torch.float32
    pads = _left_pads(batch)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=ATOL["fast"])
        assert torch.equal(g[pads], w[pads])


# -- sparse methods: each prompt as if alone ----------------------------------------------------


def _alone(model: Any, batch: dict[str, torch.Tensor], r: int) -> torch.Tensor:
    real = batch["attention_mask"][r].bool()
    with torch.no_grad():
        out: torch.Tensor = model(batch["input_ids"][r : r + 1, real]).logits[0]
    return out


@pytest.mark.parametrize(("backend", "method", "params", "layout"), [
    ("reference", "streaming", STREAMING, "mixed"),
    ("reference", "vertical_slash", VERTICAL_SLASH, "left"),
    ("reference", "vertical_slash", VERTICAL_SLASH, "right"),
    ("fast", "vertical_slash", VERTICAL_SLASH, "fast"),
])
def test_sparse_padded_batch_equals_each_prompt_alone(
        llama: Any, backend: str, method: str, params: dict[str, int], layout: str) -> None:
    rows = [(29, "left"), (48, "right")] if layout == "fast" else LAYOUTS[layout]
    batch = _batch(rows)
    want = _forward(llama, batch)
    attn = patch(llama, method, params, backend=backend, min_seqlen=1)
    got = _forward(llama, batch)
    assert attn.calls == {"sparse": 2}
    for r in range(len(rows)):
        real = batch["attention_mask"][r].bool()
        # Measured: equal bit for bit (same per-sequence plans; the varlen launch equals
        # per-sequence launches); the bound allows for BLAS row blocking.
        torch.testing.assert_close(got[0][r, real], _alone(llama, batch, r), rtol=0, atol=ATOL["reference"])
    # Left pads are the unpatched model's bit for bit; the method really changed the rest.
    pads = _left_pads(batch)
    for g, w in zip(got, want):
        assert torch.equal(g[pads], w[pads])
    assert (got[0] - want[0]).abs().max() > 1e-3


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_with_demo_parameters(llama: Any, method: str) -> None:
    """Every registered method, its demo parameters at each prompt's own length."""
    batch = _batch([(150, "left"), (97, "right")])
    attn = patch(llama, method, None, backend="reference", min_seqlen=1)
    got = _forward(llama, batch)[0]
    assert attn.calls == {"sparse": 2}
    for r in range(2):
        real = batch["attention_mask"][r].bool()
        torch.testing.assert_close(got[r, real], _alone(llama, batch, r), rtol=0, atol=ATOL["reference"])


def test_per_head_mix_and_stateless_fallback_per_sequence(llama: Any) -> None:
    """A per-head mix (build_plan per sequence, stacked) and Delta-KV (no plan: one call
    per sequence) on a padded batch equal the prompts alone."""
    batch = _batch([(60, "left"), (35, "right")])
    mix = [STREAMING, None, {"method": "vertical_slash", **VERTICAL_SLASH}, STREAMING]
    for method, config in (("streaming", {0: mix, 1: mix}), ("delta_kv", None)):
        attn = patch(llama, method, config, backend="reference", min_seqlen=1)
        got = _forward(llama, batch)[0]
        assert attn.calls == {"sparse": 2}
        for r in range(2):
            real = batch["attention_mask"][r].bool()
            torch.testing.assert_close(got[r, real], _alone(llama, batch, r), rtol=0, atol=ATOL["reference"])
        unpatch(llama)


def test_shareprefill_runs_one_state_per_sequence() -> None:
    model = _model()
    batch = _batch([(48, "left"), (33, "right")])
    config = {"tau": 0.5, "delta": 1.01, **BLOCKS}
    attn = patch(model, "shareprefill", config, backend="reference", min_seqlen=1)
    got = _forward(model, batch)[0]
    states = attn.last_state("shareprefill")
    assert isinstance(states, list) and len(states) == 2
    for r, state in enumerate(states):
        real = batch["attention_mask"][r].bool()
        assert [d.layer for d in state.decisions] == [0, 1]
        assert state.shape is not None and state.shape[2] == int(real.sum())
        torch.testing.assert_close(got[r, real], _alone(model, batch, r), rtol=0, atol=ATOL["reference"])
        alone = attn.last_state("shareprefill")  # the state of the prompt run alone
        assert [d.pattern.tolist() for d in alone.decisions] == [d.pattern.tolist() for d in state.decisions]
    unpatch(model)


def test_use_ops_runs_a_padded_batch_eagerly_per_sequence(llama: Any) -> None:
    """`use_ops=True`: one method op per sequence, the same values as the varlen launch."""
    batch = _batch([(29, "left"), (40, "right")])
    patch(llama, "streaming", STREAMING, backend="fast", min_seqlen=1)
    want = _forward(llama, batch)
    unpatch(llama)
    attn = patch(llama, "streaming", STREAMING, backend="fast", min_seqlen=1, use_ops=True)
    got = _forward(llama, batch)
    assert attn.calls == {"sparse": 2}
    assert all(torch.equal(g, w) for g, w in zip(got, want))


# -- min_seqlen per row, and the attention call itself ------------------------------------------


def test_min_seqlen_applies_to_each_rows_real_length(llama: Any) -> None:
    batch = _batch([(70, "right"), (30, "left"), (39, "right")])
    want = _forward(llama, batch)
    attn = patch(llama, "streaming", STREAMING, backend="reference", min_seqlen=40)
    got = _forward(llama, batch)
    assert attn.calls == {"sparse": 2}
    # Rows shorter than min_seqlen run transformers' SDPA on their own batch rows: the
    # unpatched model's values bit for bit (pads included); the long row is sparse.
    for g, w in zip(got, want):
        assert torch.equal(g[1:], w[1:])
    assert (got[0][0] - want[0][0]).abs().max() > 1e-3
    unpatch(llama)
    # No row long enough: the whole call is the unpatched SDPA call.
    short = _batch([(70, "right"), (30, "left")], n=80)
    want = _forward(llama, short)
    attn = patch(llama, "streaming", STREAMING, backend="reference", min_seqlen=71)
    got = _forward(llama, short)
    assert attn.calls == {"sdpa": 2}
    assert all(torch.equal(g, w) for g, w in zip(got, want))


class _Module(torch.nn.Module):
    """What the attention function reads from an attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.layer_idx, self.is_causal, self.num_key_value_groups = 0, True, groups


@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_attention_call_pads_are_sdpa_rows_and_real_rows_the_method(backend: str) -> None:
    """One attention call with padding left, right and inside a row."""
    n, hq, hkv, d = 50, 4, 2, 16
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, h, n, d, generator=gen) for h in (hq, hkv, hkv))
    real = torch.ones(3, n, dtype=torch.bool)
    real[0, :13] = False            # left
    real[1, 31:] = False            # right
    real[2, 20:24] = False          # inside (any key padding is causal & key-valid)
    real[2, :2] = False
    mask = sdpa_mask(batch_size=3, q_length=n, kv_length=n, attention_mask=real)
    assert mask is not None and torch.equal(key_padding(mask, n), real)
    # Whatever a pad token's row holds (its own key masked) is passed on to SDPA as it is.
    mask = mask.clone()
    mask[1, 0, 40, :45] = True
    mask[1, 0, 40, 40] = False
    assert torch.equal(key_padding(mask, n), real)
    assert torch.equal(key_padding(mask, n, rows_per_step=7), real)  # compared in slabs
    broken = mask.clone()
    broken[2, 0, 44, 30] = False  # a real token's row missing a real key
    assert key_padding(broken, n, rows_per_step=7) is None
    module = _Module(hq // hkv)
    attn = SparsePrefillAttention("streaming", STREAMING, backend=backend, min_seqlen=1)  # type: ignore[arg-type]
    out, _ = attn(module, q, k, v, mask, scaling=d**-0.5)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=d**-0.5)
    assert out.shape == want.shape == (3, n, hq, d)
    pads = ~real
    left = real.cumsum(1) == 0
    assert torch.equal(out[left], want[left]) and bool((out[left] == 0).all())
    # Other pad rows: transformers' SDPA on exactly those rows of q and of the mask (the
    # same values as its call on all rows up to the CPU kernel's row blocking).
    torch.testing.assert_close(out[pads], want[pads], rtol=0, atol=1e-6)
    for r in range(3):
        p = pads[r].nonzero().squeeze(1)
        rows, _ = sdpa_attention_forward(module, q[r:r + 1, :, p], k[r:r + 1], v[r:r + 1], mask[r:r + 1, :, p],
                                         scaling=d**-0.5)
        assert torch.equal(out[r, p], rows[0])
        # Real rows: the method on the real tokens alone.
        idx = real[r].nonzero().squeeze(1)
        qs, ks, vs = (t[r:r + 1, :, idx] for t in (q, k, v))
        if backend == "fast":
            qs, ks, vs = (t.half() for t in (qs, ks, vs))
            from sparseprefill import fast
            alone = fast.streaming(qs, ks, vs, **STREAMING, scale=d**-0.5).float()
        else:
            alone = reference.streaming(qs, ks, vs, **STREAMING, scale=d**-0.5)
        torch.testing.assert_close(out[r, idx], alone[0].transpose(0, 1), rtol=0, atol=1e-6)


def test_stack_sequence_plans_unifies_groups_and_refuses_other_block_sizes() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, 90, 16, generator=gen), torch.randn(1, 2, 90, 16, generator=gen)
    a = reference.anchor_attention_plan(q, k, step=2, block_m=16, block_n=16)
    b = reference.anchor_attention_plan(q[:, :, :40], k[:, :, :40], step=1, block_m=16, block_n=16)
    assert (a.column_group, b.column_group) == (2, 1)
    stacked = _stack_sequence_plans([a, b])
    assert stacked is not None and stacked.column_group == 1
    dense = stacked.to_dense_mask()
    assert torch.equal(dense[:1], a.to_dense_mask()) and torch.equal(dense[1:, :, :40, :40], b.to_dense_mask())
    other = reference.dense_plan(q[:, :, :40], k[:, :, :40], block_m=32, block_n=16)
    assert _stack_sequence_plans([a, other]) is None


# -- masks that are not causal with key padding still raise -----------------------------------


def test_packed_sequences_and_custom_masks_raise(llama: Any) -> None:
    patch(llama, "dense", BLOCKS, min_seqlen=1)
    ids = _batch([(60, "left")])["input_ids"]
    # Two sequences packed in one row (position_ids restart, no attention_mask, no cache):
    # transformers builds a block-diagonal mask.
    packed = torch.cat([torch.arange(25), torch.arange(35)])[None]
    with pytest.raises(ValueError, match="neither causal nor causal with key padding.*block-diagonal"):
        _forward(llama, {"input_ids": ids, "position_ids": packed, "use_cache": False})
    # A custom 4-D bool mask: causal but a key hidden from some queries only.
    custom = torch.ones(60, 60, dtype=torch.bool).tril()
    custom[40:, 5] = False
    with pytest.raises(ValueError, match="expected mask\\[b, :, i, j\\] == \\(j <= i and token j"):
        _forward(llama, {"input_ids": ids, "attention_mask": custom[None, None]})
    # The same mask as padding would make it: accepted.
    assert key_padding(custom[None, None], 60) is None
    custom[:, 5] = False
    custom[5, 5] = False
    assert torch.equal(key_padding(custom[None, None], 60), (torch.arange(60) != 5)[None])
