"""`sparseprefill search` writes a config that MInferenceConfig reads back."""

from __future__ import annotations

from pathlib import Path

from sparseprefill.reference.minference import MInferenceConfig
from sparseprefill.search import main


def test_search_writes_a_loadable_config(tmp_path: Path, capsys: object) -> None:
    out = tmp_path / "cfg.json"
    # A small target forces the candidates to be resized well below dense.
    assert main(["--synthetic", "256", "--backend", "reference", "--device", "cpu",
                 "--target", "6000", "--num-layers", "3", "--out", str(out)]) == 0
    config = MInferenceConfig.load(out)
    assert len(config.layers) == 3
    assert all(len(layer) == 4 for layer in config.layers)
    assert config.layers[0] == config.layers[2]
    patterns = {head.pattern for layer in config.layers for head in layer}
    assert patterns <= {"a_shape", "vertical_slash", "block_sparse"}
