"""The calibrated config file (`sparseprefill.config`): round trip, and bad files refused
with a ValueError that names the file and the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sparseprefill.config import (
    FORMAT,
    CalibratedConfig,
    dense_heads_of,
    parse_config,
    read_config,
    split_dense_heads,
    write_config,
)


def good() -> dict[str, Any]:
    return {"format": FORMAT, "method": "streaming", "q_heads": 4, "target": {"recall": 0.95},
            "layers": {"0": {"sink": 16, "window": [16, 32, 16, 64], "dense_heads": [2]},
                       "3": None,
                       "5": [{"sink": 16, "window": 32}, None, {"sink": 16, "window": 48}, None]}}


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps(good()))
    config = read_config(path, method="streaming")
    assert config.method == "streaming" and set(config.layers) == {0, 3, 5} and config.q_heads == 4
    assert config.meta["target"] == {"recall": 0.95}
    assert config.layers[0] == {"sink": 16, "window": [16, 32, 16, 64], "dense_heads": [2]}
    again = tmp_path / "d.json"
    write_config(again, config)
    assert read_config(again) == config
    assert json.loads(again.read_text())["layers"]["5"][1] is None
    assert dense_heads_of(config.layers[0], 4) == [2]
    assert dense_heads_of(config.layers[3], 4) == [0, 1, 2, 3]
    assert dense_heads_of(config.layers[5], 4) == [1, 3]
    assert split_dense_heads({"window": 8, "dense_heads": [1, 0]}) == ({"window": 8}, [1, 0])


def bad(edit: Any) -> dict[str, Any]:
    data = good()
    edit(data)
    return data


@pytest.mark.parametrize("edit,field", [
    (lambda d: d.update(format="sparseprefill.calibrate/0"), "format"),
    (lambda d: d.pop("format"), "format"),
    (lambda d: d.update(method="nope"), "method"),
    (lambda d: d.update(method=3), "method"),
    (lambda d: d.update(layers=[1, 2]), "layers"),
    (lambda d: d.pop("layers"), "layers"),
    (lambda d: d.update(q_heads=0), "q_heads"),
    (lambda d: d["layers"].update({"x": None}), "layers['x']"),
    (lambda d: d["layers"].update({"-1": None}), "layers['-1']"),
    (lambda d: d["layers"].update({"1": "streaming"}), "layers['1']"),
    (lambda d: d["layers"]["0"].update(dense_heads="all"), "layers['0'].dense_heads"),
    (lambda d: d["layers"]["0"].update(dense_heads=[1, 1]), "layers['0'].dense_heads"),
    (lambda d: d["layers"]["0"].update(dense_heads=[4]), "layers['0'].dense_heads"),
    (lambda d: d["layers"]["0"].update(dense_heads=[-1]), "layers['0'].dense_heads"),
    (lambda d: d["layers"]["0"].update(window=[16, 32]), "layers['0'].window"),
    (lambda d: d["layers"]["0"].update(window=-5), "window"),
    (lambda d: d["layers"]["0"].update(windw=16), "windw"),
    (lambda d: d["layers"]["5"].pop(), "layers['5']"),
    (lambda d: d["layers"]["5"].__setitem__(0, 7), "layers['5'][0]"),
    (lambda d: d["layers"]["5"].__setitem__(0, {"sink": 16, "window": 32, "dense_heads": [0]}),
     "layers['5'][0]"),
    (lambda d: d["layers"]["5"].__setitem__(2, {"sink": 16, "window": 0}), "layers['5'][2]"),
])
def test_bad_configs_name_the_field(tmp_path: Path, edit: Any, field: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad(edit)))
    with pytest.raises(ValueError) as info:
        read_config(path)
    message = str(info.value)
    assert str(path) in message and field in message, message


def test_not_json_and_wrong_method(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        read_config(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a `sparseprefill calibrate` config"):
        read_config(path)
    path.write_text(json.dumps(good()))
    with pytest.raises(ValueError, match="not 'xattention'"):
        read_config(path, method="xattention")
    with pytest.raises(ValueError, match="dense_heads"):
        parse_config(bad(lambda d: d["layers"]["0"].update(dense_heads=[9])))


def test_write_refuses_a_bad_config_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "out" / "c.json"
    with pytest.raises(ValueError, match="window"):
        write_config(path, CalibratedConfig("streaming", {0: {"sink": 16, "window": -1}}))
    assert not path.exists()
    write_config(path, CalibratedConfig("streaming", {2: {"sink": 16, "window": 32}}, {"note": "x"}))
    assert json.loads(path.read_text())["note"] == "x"
    assert [p.name for p in path.parent.iterdir()] == ["c.json"]


def test_patch_reads_the_file_once_and_refuses_bad_ones(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the `hf` extra is not installed")
    from sparseprefill.integrations import transformers as hf

    path = tmp_path / "c.json"
    path.write_text(json.dumps(good()))
    attn = hf.SparsePrefillAttention("streaming", path)
    assert attn.layer_choices(3, 4) is None
    choices = attn.layer_choices(0, 4)
    assert choices is not None and choices[0].dense_heads == (2,)
    assert hf.SparsePrefillAttention("streaming", read_config(path)).layer_choices(5, 4) is not None
    with pytest.raises(ValueError, match="not 'xattention'"):
        hf.SparsePrefillAttention("xattention", path)
    with pytest.raises(ValueError, match="not 'xattention'"):
        hf.SparsePrefillAttention("xattention", read_config(path))
    path.write_text(json.dumps(bad(lambda d: d["layers"]["0"].update(dense_heads=[4]))))
    with pytest.raises(ValueError, match=r"layers\['0'\].dense_heads"):
        hf.SparsePrefillAttention("streaming", path)
