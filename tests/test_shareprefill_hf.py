"""SharePrefill through the transformers integration: one state per forward pass, layer order
from the model, decode steps untouched (tiny random Llama, reference and fast backends)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

for _module in ("transformers", "gguf", "accelerate"):
    pytest.importorskip(_module, reason="the `hf` extra is not installed: pip install 'sparseprefill[hf]'")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from sparseprefill.integrations.transformers import patch, unpatch  # noqa: E402
from sparseprefill.reference import ClusterLayout, SharePattern, SharePrefillState  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
DENSE, SHARED, VS = int(SharePattern.DENSE), int(SharePattern.SHARED), int(SharePattern.VERTICAL_SLASH)


def _model() -> Any:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def test_one_state_per_forward_and_pivots_flow_down_the_layers() -> None:
    model = _model()
    # One cluster; every head counts as "not sparse" (delta above 1) and close enough (tau
    # above 1): layer 0's head 0 is the pivot, its other heads take Alg. 5; later layers share.
    config = {"layout": ClusterLayout(((0,) * 4,) * 3), "tau": 1.01, "delta": 1.01,
              "block_m": 16, "block_n": 16}
    attn = patch(model, "shareprefill", config, backend="reference", min_seqlen=1)
    with torch.no_grad():
        first = model(_ids(80)).logits
    state = attn.last_state("shareprefill")
    assert isinstance(state, SharePrefillState)
    assert [d.layer for d in state.decisions] == [0, 1, 2]
    assert [d.pattern.tolist() for d in state.decisions] == [[[DENSE, VS, VS, VS]], [[SHARED] * 4],
                                                             [[SHARED] * 4]]
    assert list(state.pivots) == [(0, 0)]
    with torch.no_grad():
        again = model(_ids(80)).logits
    assert attn.last_state("shareprefill") is not state
    assert torch.equal(first, again)
    # Decode steps go to SDPA and leave the prefill's state alone.
    with torch.no_grad():
        model.generate(_ids(40), max_new_tokens=3, do_sample=False)
    latest = attn.last_state("shareprefill")
    assert [d.layer for d in latest.decisions] == [0, 1, 2]
    assert latest.shape is not None and latest.shape[2] == 40
    unpatch(model)


def test_fast_backend_matches_reference_decisions() -> None:
    model = _model()
    config = {"layout": ClusterLayout(((0, 0, 1, -1),) * 3), "delta": 1.01, "tau": 0.5,
              "block_m": 16, "block_n": 16}
    ids = _ids(48)
    patterns = {}
    for backend in ("reference", "fast"):
        attn = patch(model, "shareprefill", config, backend=backend, min_seqlen=1)
        with torch.no_grad():
            model(ids)
        patterns[backend] = [d.pattern.tolist() for d in attn.last_state("shareprefill").decisions]
        unpatch(model)
    assert patterns["fast"] == patterns["reference"]


def test_errors() -> None:
    model = _model()
    with pytest.raises(ValueError, match="layer index comes from the model"):
        patch(model, "shareprefill", {"layer": 3}, min_seqlen=1)
    with pytest.raises(ValueError, match="tau"):
        patch(model, "shareprefill", {"tau": -1.0}, min_seqlen=1)
    patch(model, "shareprefill", {1: [None, "shareprefill", None, None]}, backend="reference", min_seqlen=1)
    with pytest.raises(ValueError, match="every head"), torch.no_grad():
        model(_ids(40))
    unpatch(model)
