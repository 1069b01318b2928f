"""The calibrated config: the one module that reads, validates, splits and writes it.

`sparseprefill calibrate` writes one JSON file per method (`write_config`);
`patch(model, method, config=path)`, `sparseprefill eval --config` and `calibrate --eval`
read it (`read_config`). The file:

    {"format": "sparseprefill.calibrate/1",
     "method": "xattention",                 # a registered method
     "q_heads": 9,                           # optional: query heads per layer (checks list lengths)
     ... other keys: how it was made (target, margin, grid, captures ...), kept as `meta`;
     the margin fields (`margin`, `margin_spread`, `prompts`, `head_margins`) are checked
     (`check_margin_fields`),
     "layers": {"0": SPEC, "5": SPEC, ...}}  # layers absent here run SDPA (full attention)

where a layer SPEC is one of

* `null`: the layer runs SDPA;
* a parameter dict of the method: one call for the whole layer. A knob of the method
  (`Method.knobs`) may be a list with one value per query head; `"dense_heads": [h, ...]`
  lists query heads that run full causal attention instead (the dense fallback);
* a list with one entry per query head, each a parameter dict or `null` (that head runs
  full causal attention): for a method whose varying parameters are not per-head knobs.
  An entry may name its own method, `{"method": "vertical_slash", ...}` (one of
  `head_methods()`: the heads' plans merge into one plan of the layer at their finest
  block sizes, one launch), its parameters then checked by that method; the heads of an
  `headwise` config (`sparseprefill calibrate --method headwise`) all name theirs.

Everything is checked when the file is read, before any model is touched: the format tag,
the method, layer indices, each spec's form, `dense_heads`, list lengths against
`q_heads`, and every parameter value through the method's own check
(`Method.check_params`). A bad file raises ValueError naming the file and the field
(`layers["5"].dense_heads[1]`).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "sparseprefill.calibrate/1"
DENSE_HEADS = "dense_heads"
# A head's own method in a per-head list (the heads of one layer taking different methods).
METHOD = "method"

LayerSpec = None | dict[str, Any] | list[dict[str, Any] | None]


@dataclass(frozen=True)
class CalibratedConfig:
    """One method's calibrated config.

    Attributes:
        method: the registered method every configured layer runs.
        layers: `{layer_idx: spec}` (see the module doc); absent layers run SDPA.
        meta: the file's other keys (how it was made), written back unchanged.
    """

    method: str
    layers: dict[int, LayerSpec]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def q_heads(self) -> int | None:
        """Query heads per layer, when the file records them."""
        value = self.meta.get("q_heads")
        return value if isinstance(value, int) and not isinstance(value, bool) else None


def split_dense_heads(spec: Mapping[str, Any]) -> tuple[dict[str, Any], list[int]]:
    """(the method's parameters, the query heads that run full causal attention) of one
    layer's parameter dict.

    Raises:
        TypeError: `dense_heads` that is not a list of non-negative ints.
        ValueError: a head listed twice.
    """
    rest = dict(spec)
    heads = rest.pop(DENSE_HEADS, None) or []
    if not isinstance(heads, (list, tuple)) or any(isinstance(h, bool) or not isinstance(h, int) for h in heads):
        raise TypeError(f"dense_heads must be a list of query-head indices, got {heads!r}")
    if any(h < 0 for h in heads):
        raise ValueError(f"dense_heads must hold query-head indices >= 0, got {list(heads)}")
    if len(set(heads)) != len(heads):
        raise ValueError(f"dense_heads lists a head twice: {list(heads)}")
    return rest, [int(h) for h in heads]


def check_layer_spec(method: str, spec: object, *, q_heads: int | None = None, where: str = "spec") -> None:
    """Check one layer's spec of a calibrated config for `method` (see the module doc).

    Args:
        method: a registered method name.
        spec: None, a parameter dict, or a per-head list of dicts / None.
        q_heads: the layer's query heads, when known: per-head lists and `dense_heads`
            must fit it.
        where: the field's name in messages.

    Raises:
        ValueError: any problem, the message naming `where` and the field.
    """
    from .methods import METHODS

    spec_ = METHODS[method]
    if spec is None:
        return
    if isinstance(spec, Mapping):
        try:
            params, dense = split_dense_heads(spec)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}.{DENSE_HEADS}: {exc}") from None
        if q_heads is not None:
            past = [h for h in dense if h >= q_heads]
            if past:
                raise ValueError(f"{where}.{DENSE_HEADS}: heads {past} are past the layer's {q_heads} query heads")
            for knob in spec_.knobs:
                value = params.get(knob)
                if isinstance(value, (list, tuple)) and len(value) != q_heads:
                    raise ValueError(f"{where}.{knob}: a per-head value needs {q_heads} entries (one per "
                                     f"query head), got {len(value)}")
        _check_params(spec_, params, where)
        return
    if isinstance(spec, (list, tuple)):
        if q_heads is not None and len(spec) != q_heads:
            raise ValueError(f"{where}: a per-head list needs {q_heads} entries (one per query head), "
                             f"got {len(spec)}")
        if not spec:
            raise ValueError(f"{where}: a per-head list must not be empty")
        for h, head in enumerate(spec):
            if head is None:
                continue
            if not isinstance(head, Mapping):
                raise ValueError(f"{where}[{h}]: expected a parameter dict or null, got {type(head).__name__}")
            if DENSE_HEADS in head:
                raise ValueError(f"{where}[{h}]: {DENSE_HEADS} belongs to a whole layer's dict; in a per-head "
                                 "list a dense head is null")
            params = dict(head)
            named = params.pop(METHOD, None)
            if named is None:
                if spec_.head_candidates is not None:
                    raise ValueError(f"{where}[{h}].{METHOD}: every head of a {method!r} config names its "
                                     f"method (one of {', '.join(head_methods())})")
                _check_params(spec_, params, f"{where}[{h}]")
            else:
                _check_params(METHODS[_head_method(named, f"{where}[{h}].{METHOD}")], params, f"{where}[{h}]")
        return
    raise ValueError(f"{where}: expected null, a parameter dict or a per-head list, got {type(spec).__name__}")


def head_methods() -> tuple[str, ...]:
    """The methods a head of a per-head list may name (`"method"`): those whose heads' plans
    merge into one plan of the layer (`reference.headwise`)."""
    from .reference.headwise import KNOBS

    return tuple(KNOBS)


def _head_method(name: object, where: str) -> str:
    from .methods import METHODS

    if not isinstance(name, str) or name not in METHODS or name not in head_methods():
        raise ValueError(f"{where}: expected a method one head can take ({', '.join(head_methods())}), "
                         f"got {name!r}")
    return name


def _check_params(method: Any, params: dict[str, Any], where: str) -> None:
    if not all(isinstance(key, str) for key in params):
        raise ValueError(f"{where}: parameter names must be strings, got {list(params)}")
    try:
        method.check_params(params)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: bad parameters for {method.name!r}: {exc}") from None


def parse_config(data: object, *, source: str = "config", method: str | None = None) -> CalibratedConfig:
    """A calibrated config from its decoded JSON, checked (see the module doc).

    Args:
        data: the decoded JSON object.
        source: what to call it in messages (the file's path).
        method: if given, the method the config must be for.

    Raises:
        ValueError: anything that is not a valid config, naming `source` and the field.
    """
    from .methods import METHODS

    if not isinstance(data, dict):
        raise ValueError(f"{source}: not a `sparseprefill calibrate` config (a JSON object with format "
                         f"{FORMAT!r}), got a JSON {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise ValueError(f"{source}: format: expected {FORMAT!r}, got {data.get('format')!r} (not a "
                         "`sparseprefill calibrate` config, or one of another version)")
    name = data.get("method")
    if not isinstance(name, str) or name not in METHODS:
        raise ValueError(f"{source}: method: expected a registered method ({', '.join(METHODS)}), got {name!r}")
    if method is not None and name != method:
        raise ValueError(f"{source}: method: a config for {name!r}, not {method!r}")
    q_heads = data.get("q_heads")
    if q_heads is not None and (isinstance(q_heads, bool) or not isinstance(q_heads, int) or q_heads < 1):
        raise ValueError(f"{source}: q_heads: expected an int >= 1, got {q_heads!r}")
    raw = data.get("layers")
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: layers: expected an object {{layer index: spec}}, got "
                         f"{type(raw).__name__ if raw is not None else 'nothing'}")
    layers: dict[int, LayerSpec] = {}
    for key, spec in raw.items():
        try:
            layer = int(key)
        except (TypeError, ValueError):
            layer = -1
        if layer < 0 or str(layer) != str(key).strip():
            raise ValueError(f"{source}: layers[{key!r}]: a layer index must be an int >= 0")
        check_layer_spec(name, spec, q_heads=q_heads, where=f"{source}: layers[{key!r}]")
        layers[layer] = spec
    check_margin_fields(data, layers, q_heads=q_heads, source=source)
    meta = {k: v for k, v in data.items() if k not in ("format", "method", "layers")}
    return CalibratedConfig(method=name, layers=dict(sorted(layers.items())), meta=meta)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_margin_fields(data: Mapping[str, Any], layers: Mapping[int, LayerSpec], *, q_heads: int | None = None,
                        source: str = "config") -> None:
    """Check how a config's margins were made (the fields are optional; see `sparseprefill.margins`):

    * `margin`: the global margin, or the floor of the per-head ones: a number in [0, 1);
    * `margin_spread`: C of the per-head margin max(margin, C x spread across kinds): a number >= 0;
    * `prompts`: the calibration prompts, `[{"kind": str, "source": str, "capture": str}, ...]`;
    * `head_margins`: `{layer: [margin or null per query head]}`, the margin each head was
      calibrated with (null: a dense head), for layers of `layers` only, each within [0, 1].

    Raises:
        ValueError: a field of another form, naming `source` and the field.
    """
    margin = data.get("margin")
    if margin is not None and not (_number(margin) and 0 <= margin < 1):
        raise ValueError(f"{source}: margin: expected a number in [0, 1), got {margin!r}")
    spread = data.get("margin_spread")
    if spread is not None and not (_number(spread) and spread >= 0):
        raise ValueError(f"{source}: margin_spread: expected a number >= 0, got {spread!r}")
    prompts = data.get("prompts")
    if prompts is not None:
        if not isinstance(prompts, list):
            raise ValueError(f"{source}: prompts: expected a list of {{kind, source}} objects, got "
                             f"{type(prompts).__name__}")
        for i, prompt in enumerate(prompts):
            if (not isinstance(prompt, dict) or not isinstance(prompt.get("kind"), str)
                    or not isinstance(prompt.get("source"), str)
                    or not isinstance(prompt.get("capture", ""), str)):
                raise ValueError(f"{source}: prompts[{i}]: expected {{\"kind\": str, \"source\": str, "
                                 f"\"capture\": str}}, got {prompt!r}")
    margins = data.get("head_margins")
    if margins is None:
        return
    if not isinstance(margins, dict):
        raise ValueError(f"{source}: head_margins: expected an object {{layer index: per-head list}}, got "
                         f"{type(margins).__name__}")
    for key, values in margins.items():
        where = f"{source}: head_margins[{key!r}]"
        layer = int(key) if isinstance(key, str) and key.strip().isdigit() else -1
        if layer not in layers:
            raise ValueError(f"{where}: not a configured layer ({sorted(layers)})")
        if not isinstance(values, list) or (q_heads is not None and len(values) != q_heads):
            raise ValueError(f"{where}: expected a list of one margin (or null) per query head"
                             + (f" ({q_heads})" if q_heads is not None else ""))
        dense = set(dense_heads_of(layers[layer], len(values)))
        for h, value in enumerate(values):
            if value is None:
                continue
            if not (_number(value) and 0 <= value <= 1):
                raise ValueError(f"{where}[{h}]: expected a number in [0, 1] or null, got {value!r}")
            if h in dense:
                raise ValueError(f"{where}[{h}]: head {h} runs dense: its margin must be null")


def read_config(path: str | os.PathLike[str], *, method: str | None = None) -> CalibratedConfig:
    """Read and check a calibrated config file.

    Args:
        path: a JSON file `sparseprefill calibrate` wrote.
        method: if given, the method the file must be for.

    Raises:
        ValueError: unreadable JSON or an invalid config (the message names the file and field).
        OSError: the file cannot be read.
    """
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{os.fspath(path)}: not JSON ({exc})") from None
    return parse_config(data, source=os.fspath(path), method=method)


def config_payload(config: CalibratedConfig) -> dict[str, Any]:
    """The JSON object of a config (what `write_config` writes)."""
    meta = {k: v for k, v in config.meta.items() if k not in ("format", "method", "layers")}
    return {"format": FORMAT, "method": config.method, **meta,
            "layers": {str(layer): spec for layer, spec in sorted(config.layers.items())}}


def write_config(path: str | os.PathLike[str], config: CalibratedConfig) -> Path:
    """Check a config and write it (a whole file at once: a reader never sees half of one).

    Raises:
        ValueError: an invalid config (nothing is written).
    """
    payload = config_payload(config)
    # What is written must read back: the same checks as `read_config`, on the JSON form.
    parse_config(json.loads(json.dumps(payload)), source=os.fspath(path))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(payload, fh, indent=1)
            fh.write("\n")
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def dense_heads_of(spec: LayerSpec, q_heads: int) -> list[int]:
    """The query heads of a layer spec that run full causal attention (every head for None)."""
    if spec is None:
        return list(range(q_heads))
    if isinstance(spec, Mapping):
        return split_dense_heads(spec)[1]
    return [h for h, head in enumerate(spec) if head is None]


def headwise_heads(config: CalibratedConfig, layer: int) -> list[dict[str, Any] | None]:
    """One layer of any config as the `headwise` method's `heads` (one `{"method": ..., **params}`
    or None per query head): what `sparseprefill bench headwise --params '{"heads": ...}'` runs,
    so configs of every method run through one path beside each other.

    A dict spec gives each head its element of every per-head knob (`Method.knobs`) and its
    `dense_heads` None; a per-head list gives each head the config's method unless it names
    its own; None (or a layer the file lacks) makes every head dense.

    Raises:
        ValueError: a config without `q_heads`, or whose method is not one a head can take.
    """
    from .methods import METHODS

    hq = config.q_heads
    if hq is None:
        raise ValueError(f"the {config.method!r} config records no q_heads")
    spec = config.layers.get(layer)
    if spec is None:
        return [None] * hq
    if isinstance(spec, Mapping):
        if config.method not in head_methods():
            raise ValueError(f"{config.method!r} is not a method one head can take ({', '.join(head_methods())})")
        params, dense = split_dense_heads(spec)
        out: list[dict[str, Any] | None] = []
        for h in range(hq):
            if h in dense:
                out.append(None)
                continue
            own = {key: (val[h] if key in METHODS[config.method].knobs and isinstance(val, (list, tuple)) else val)
                   for key, val in params.items()}
            out.append({METHOD: config.method, **own})
        return out
    heads: list[dict[str, Any] | None] = []
    for head in spec:
        if head is None:
            heads.append(None)
        else:
            named = dict(head)
            heads.append({METHOD: named.pop(METHOD, config.method), **named})
    return heads


def layer_specs(config: CalibratedConfig | Mapping[int, LayerSpec]) -> dict[int, LayerSpec]:
    """`{layer_idx: spec}` of a read config or of such a mapping already in memory."""
    if isinstance(config, CalibratedConfig):
        return dict(config.layers)
    return dict(config)


__all__ = [
    "DENSE_HEADS",
    "FORMAT",
    "METHOD",
    "CalibratedConfig",
    "LayerSpec",
    "check_layer_spec",
    "check_margin_fields",
    "config_payload",
    "dense_heads_of",
    "head_methods",
    "headwise_heads",
    "layer_specs",
    "parse_config",
    "read_config",
    "split_dense_heads",
    "write_config",
]
