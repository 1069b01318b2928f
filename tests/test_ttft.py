"""`sparseprefill eval ttft` end to end on the CPU at a tiny size (a random Llama)."""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from sparseprefill import ttft  # noqa: E402


def tiny_model() -> object:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_ttft_table_reports_every_method_beside_sdpa() -> None:
    model = tiny_model()
    ids = torch.randint(0, 128, (1, 192), generator=torch.Generator().manual_seed(1))
    rows = ttft.ttft_table(model, None, ids, methods=["streaming", "xattention"], configs={}, layers=None,
                           repeats=1, ppl_last=32, depths=0, backend="reference", log=lambda s: None)
    assert [r.method for r in rows] == ["sdpa", "streaming", "xattention"]
    base = rows[0]
    assert base.agreement == 1.0 and base.speedup == 1.0 and math.isnan(base.passkey)
    for r in rows:
        assert r.seqlen == 192 and r.prefill_ms > 0 and 0 < r.attention_share < 1 and math.isfinite(r.ppl)
        assert 0.0 <= r.agreement <= 1.0
    # Only layer 1 patched with defaults: layer 0 stays SDPA, the table still has every row.
    one = ttft.ttft_table(model, None, ids, methods=["streaming"], configs={}, layers=[1], repeats=1, ppl_last=32,
                          depths=0, backend="reference", log=lambda s: None)
    assert one[1].config == "defaults"
    assert "| streaming |" in ttft.format_table(one)
