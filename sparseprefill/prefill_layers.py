"""`sparseprefill eval layers`: every captured layer of one prefill, in model order.

A method that shares what it learns across layers (SharePrefill's pivots: `Method.new_state`)
can only be measured on the whole stack: a layer's plan depends on what earlier layers
built. From a capture of every layer of one prompt (`sparseprefill eval capture --layers 0
1 ... L-1`, taken under dense attention), for each `--setting` of the method this runs
the layers in order on the reference backend: a stateful method through its own layer
function (`Method.reference_layer`, the state carried from layer to layer, as `patch` runs
it), any other method layer by layer. Per layer it records the seconds and, when the
state reports them, the method's per-layer decisions (`pattern_counts`).

On the `--report-layers`: density, attention recall (per-head mean over rows; mean and
min over heads) and output error against exact float64 attention of the layer's plan
(a stateful method's plan comes from its layer-plan function, `reference.<name>_layer_plan`,
on the state before the layer; a method without one reports the output error only),
each head's pattern when the decision has one, and beside it every `--match` method at the
same density (`compare.match_density`), each with the oracle's density at its recall.

    sparseprefill eval layers --qkv qkv_smollm2_8k_all.pt --method shareprefill \\
        --setting '{"layout": "clusters.json", "delta": 0.3}' '{"layout": "clusters.json", "delta": 1.01}' \\
        --report-layers 2 14 27 --match flexprefill_vs vertical_slash --json layers.json --png layers.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

FRONTIER = (0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 0.995)


def _label(setting: dict[str, Any]) -> str:
    return ", ".join(f"{k}={Path(v).name if k == 'layout' else v}" for k, v in setting.items()) or "defaults"


def plan_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Any, scale: float, exact: torch.Tensor,
             out: torch.Tensor | None = None) -> dict[str, Any]:
    """Density, recall (mean / min over heads of the per-head mean over rows), output error
    (of `out`, else of `sparse_attention` of the plan) and the per-head numbers."""
    from . import reference

    per_head = reference.recall(q, k, plan, scale=scale).double().mean(dim=2).mean(dim=0)
    dens = reference.density(plan).double().mean(dim=0)
    if out is None:
        out = reference.sparse_attention(q, k, v, plan, scale=scale)
    return {"density": float(dens.mean()), "recall_mean": float(per_head.mean()), "recall_min": float(per_head.min()),
            "output_error": reference.relative_error(out, exact),
            "recall_per_head": [round(float(x), 5) for x in per_head],
            "density_per_head": [round(float(x), 5) for x in dens]}


def run_layers(data: dict[str, Any], method: Any, settings: list[dict[str, Any]], *, report: list[int],
               match: list[str], max_seqlen: int | None = None, log: Any = print) -> dict[str, Any]:
    """The measurement of the module doc; returns the JSON-ready result."""
    from . import reference
    from .compare import match_density
    from .methods import METHODS
    from .oracle import oracle_density
    from .runlog import Progress

    layers = [int(x) for x in data["layers"]]
    if layers != sorted(layers):
        raise ValueError(f"the capture's layers must be in model order, got {layers}")
    missing = sorted(set(report) - set(layers))
    if missing:
        raise ValueError(f"--report-layers {missing} are not in the capture (it has {layers})")
    qkv = {layer: tuple(t[:, :, :max_seqlen].float() for t in (data["q"][i], data["k"][i], data["v"][i]))
           for i, layer in enumerate(layers)}
    scales = {layer: float(data["scale"][i]) if "scale" in data else float(qkv[layer][0].shape[-1]) ** -0.5
              for i, layer in enumerate(layers)}
    n = int(qkv[layers[0]][0].shape[2])
    layer_plan = getattr(reference, f"{method.name}_layer_plan", None) if method.new_state is not None else None
    result: dict[str, Any] = {"method": method.name, "seqlen": n, "layers": layers, "settings": [], "rows": [],
                              "frontier": {}}
    plans: dict[tuple[int, int], tuple[Any, Any, torch.Tensor | None]] = {}
    progress = Progress(len(settings) * len(layers), what="layer")
    for si, setting in enumerate(settings):
        state = method.new_state(setting) if method.new_state is not None else None
        per_layer = []
        for layer in layers:
            started = time.perf_counter()
            q, k, v = qkv[layer]
            entry: dict[str, Any] = {"layer": layer}
            if state is not None:
                assert method.reference_layer is not None
                plan, decision = (layer_plan(q, k, state, layer=layer, scale=scales[layer]) if layer_plan is not None
                                  else (None, None))
                out = method.reference_layer(q, k, v, state, layer=layer, scale=scales[layer])
                counts = getattr(state, "pattern_counts", None)
                if callable(counts):
                    entry["counts"] = {kind: x for kind, x in counts()[-1].items() if kind != "layer"}
                if layer in report:
                    pattern = getattr(decision, "pattern", None)
                    plans[(si, layer)] = (plan, pattern, out)
            elif layer in report:
                plan = method.plan_fn("reference")(q, k, **method.call_params(setting, q)) if method.plan_based else None
                out = method.run_fn("reference")(q, k, v, **method.call_params(setting, q), scale=scales[layer])
                plans[(si, layer)] = (plan, None, out)
            entry["seconds"] = round(time.perf_counter() - started, 2)
            per_layer.append(entry)
            progress.step(f"{_label(setting)} layer {layer}" + (f": {entry['counts']}" if "counts" in entry else ""))
        result["settings"].append({"label": _label(setting), "setting": setting, "per_layer": per_layer})
    for layer in report:
        q, k, v = qkv[layer]
        scale = scales[layer]
        exact = reference.attention(q.double(), k.double(), v.double(), scale=scale)
        rows: list[dict[str, Any]] = []
        for si, setting in enumerate(settings):
            plan, pattern, out = plans[(si, layer)]
            if plan is None:
                assert out is not None
                rows.append({"method": method.name, "setting": _label(setting), "layer": layer,
                             "output_error": reference.relative_error(out, exact)})
                continue
            row = {"method": method.name, "setting": _label(setting), "layer": layer,
                   **plan_row(q, k, v, plan, scale, exact, out)}
            if isinstance(pattern, torch.Tensor):
                row["pattern_per_head"] = [int(x) for x in pattern[0].tolist()]  # the decision's value per head
            rows.append(row)
            for name in match:
                spec = METHODS[name]
                params = match_density(spec, q, k, row["density"], backend="reference")
                mplan = spec.plan_fn("reference")(q, k, **spec.call_params(params, q))
                rows.append({"method": name, "setting": ", ".join(f"{a}={b}" for a, b in params.items()),
                             "layer": layer, "matched_to": row["setting"],
                             **plan_row(q, k, v, mplan, scale, exact)})
                log(f"layer {layer}: {name} at the density of {method.name} {row['setting']}: "
                    f"{rows[-1]['density']:.4f} (recall {rows[-1]['recall_mean']:.4f})")
        recalls = sorted({*FRONTIER, *(round(r["recall_mean"], 6) for r in rows if "recall_mean" in r)})
        oracle = oracle_density(q, k, recalls, scale=scale).mean(dim=(0, 1))
        frontier = {s: float(d) for s, d in zip(recalls, oracle.tolist())}
        for r in rows:
            if "recall_mean" in r:
                r["oracle_density_at_recall"] = frontier[round(r["recall_mean"], 6)]
        result["frontier"][str(layer)] = {str(s): d for s, d in frontier.items() if s in FRONTIER}
        result["rows"] += rows
    return result


def format_layers(result: dict[str, Any]) -> str:
    """The report rows, then per setting the decisions of every layer (when recorded)."""
    lines = ["| method | setting | layer | density | recall mean | recall min | output error | oracle density at recall |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def f(x: Any, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    for r in result["rows"]:
        lines.append(f"| {r['method']} | {r['setting']} | {r['layer']} | {f(r.get('density'), '.4f')} | "
                     f"{f(r.get('recall_mean'), '.4f')} | {f(r.get('recall_min'), '.4f')} | "
                     f"{f(r.get('output_error'), '.4f')} | {f(r.get('oracle_density_at_recall'), '.4f')} |")
    for r in result["rows"]:
        if "pattern_per_head" not in r:
            continue
        lines += ["", f"{r['method']} {r['setting']}, layer {r['layer']}: heads by their decision's value",
                  "| value | heads | recall | density |", "| --- | --- | --- | --- |"]
        for value in sorted(set(r["pattern_per_head"])):
            heads = [h for h, x in enumerate(r["pattern_per_head"]) if x == value]
            lines.append(f"| {value} | {len(heads)} | {sum(r['recall_per_head'][h] for h in heads) / len(heads):.4f} | "
                         f"{sum(r['density_per_head'][h] for h in heads) / len(heads):.4f} |")
    for s in result["settings"]:
        counted = [e for e in s["per_layer"] if "counts" in e]
        if counted:
            kinds = list(counted[0]["counts"])
            lines += ["", f"{result['method']} {s['label']}: heads per decision and layer",
                      "| layer | " + " | ".join(kinds) + " | seconds |", "| --- " * (len(kinds) + 2) + "|"]
            lines += [f"| {e['layer']} | " + " | ".join(str(e["counts"][kind]) for kind in kinds)
                      + f" | {e['seconds']} |" for e in counted]
    return "\n".join(lines)


def picture(result: dict[str, Any], path: Path) -> None:
    """Per setting the decisions per layer (stacked, when recorded), and per report layer
    recall vs density of every row beside the oracle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counted = [s for s in result["settings"] if any("counts" in e for e in s["per_layer"])]
    report = sorted({r["layer"] for r in result["rows"] if "density" in r})
    panels = len(counted) + len(report)
    if panels == 0:
        return
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.6), squeeze=False)
    for ax, s in zip(axes[0], counted):
        per = [e for e in s["per_layer"] if "counts" in e]
        bottom = [0] * len(per)
        for i, kind in enumerate(per[0]["counts"]):
            vals = [e["counts"][kind] for e in per]
            ax.bar([e["layer"] for e in per], vals, bottom=bottom, color=f"C{i}", label=kind.replace("_", "-"))
            bottom = [b + x for b, x in zip(bottom, vals)]
        ax.set_title(f"{result['method']} {s['label']}", fontsize=8)
        ax.set_xlabel("layer")
        ax.set_ylabel("query heads")
        ax.legend(fontsize=7)
    for ax, layer in zip(axes[0][len(counted):], report):
        frontier = result["frontier"][str(layer)]
        ax.plot(list(frontier.values()), [float(x) for x in frontier], "k--", lw=1, label="oracle (per row)")
        for i, r in enumerate(r for r in result["rows"] if r["layer"] == layer and "density" in r):
            ax.plot(r["density"], r["recall_mean"], "osD^v<>"[i % 7], label=f"{r['method']} {r['setting']}"[:40])
        ax.set_xlabel("density")
        ax.set_ylabel("mean recall")
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.legend(fontsize=6)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `sparseprefill eval layers`."""
    parser.add_argument("--qkv", type=Path, required=True, help="capture of every layer of one prompt")
    parser.add_argument("--method", required=True, help="a registered method")
    parser.add_argument("--setting", type=json.loads, nargs="+", default=[{}], metavar="JSON",
                        help="one run per setting: the state's parameters of a stateful method "
                             "(SharePrefill: layout, delta, ...), else the method's parameters (default: {})")
    parser.add_argument("--report-layers", type=int, nargs="+", default=[], help="layers measured in full")
    parser.add_argument("--match", nargs="+", default=[], metavar="METHOD",
                        help="on the report layers, these methods at the same density")
    parser.add_argument("--max-seqlen", type=int, default=None, help="use only the first tokens")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    """Entry point of `sparseprefill eval layers`."""
    from .methods import METHODS

    try:
        for name in [args.method, *args.match]:
            if name not in METHODS:
                raise ValueError(f"unknown method {name!r}; registered: {', '.join(METHODS)}")
        if not all(isinstance(s, dict) for s in args.setting):
            raise ValueError(f"--setting takes JSON objects, got {args.setting!r}")
        data = torch.load(args.qkv, map_location="cpu")
        result = run_layers(data, METHODS[args.method], list(args.setting), report=args.report_layers,
                            match=args.match, max_seqlen=args.max_seqlen,
                            log=lambda line: print(line, file=sys.stderr, flush=True))
    except (TypeError, ValueError, OSError) as exc:
        print(f"sparseprefill eval layers: {exc}", file=sys.stderr)
        return 2
    print(format_layers(result))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1, default=str))
    if args.png is not None:
        picture(result, args.png)
    return 0
