"""Vertical-slash against A-shape at equal density, on captured SmolLM2 layers.

For each captured layer and each vertical-slash budget, measure the vertical-slash
plan's density, then give A-shape (sink fixed, window searched in steps of 64
tokens) the window whose density is closest to it on that layer, and report
density, recall (mean / min over heads) and output error of both: the comparison
MInference's paper makes (issue 3, "against A-shape at equal density").

Usage:
    python benches/equal_density.py --qkv out/qkv_smollm2_8k.pt [--device cuda --backend fast]
        [--budgets 256:1024,128:512,64:256] [--sink 256] [--json out/equal_density.json]
Reference backend on the CPU: about 20 minutes at 8K on 2 cores; seconds on a GPU.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

import torch

from sparseprefill import reference
from sparseprefill.evaluate import LayerRow, format_table, method_table


def a_shape_density(n: int, sink: int, window: int, device: str) -> float:
    """Density of an A-shape plan at N (data-independent)."""
    q = torch.zeros(1, 1, n, 16, device=device)
    return float(reference.density(reference.a_shape_plan(q, q, sink=sink, window=window)).mean())


def matching_window(n: int, sink: int, target: float, device: str) -> int:
    """The window (a multiple of 64) whose A-shape density is closest to `target`."""
    lo, hi = 64, max(64, n)
    while hi - lo > 64:  # density grows with the window
        mid = (lo + hi) // 2 // 64 * 64
        if a_shape_density(n, sink, mid, device) < target:
            lo = mid
        else:
            hi = mid
    return min((lo, hi), key=lambda w: abs(a_shape_density(n, sink, w, device) - target))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qkv", default="out/qkv_smollm2_8k.pt")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", choices=("fast", "reference"), default="reference")
    parser.add_argument("--budgets", default="256:1024,128:512,64:256",
                        help="vertical_size:slash_size pairs, comma-separated")
    parser.add_argument("--sink", type=int, default=256)
    parser.add_argument("--max-seqlen", type=int, default=None, help="use only the first tokens")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    data = torch.load(args.qkv, map_location="cpu")
    if args.max_seqlen is not None:
        for key in ("q", "k", "v"):
            data[key] = [t[:, :, : args.max_seqlen] for t in data[key]]
    budgets = [tuple(int(x) for x in b.split(":")) for b in args.budgets.split(",")]
    rows: list[LayerRow] = []
    pairs: list[dict[str, Any]] = []
    for i, layer in enumerate(data["layers"]):
        one = {key: [data[key][i]] for key in ("q", "k", "v", "scale")} | {"layers": [layer]}
        n = int(data["q"][i].shape[2])
        for vertical, slash in budgets:
            vs = method_table(one, ["vertical_slash"], backend=args.backend, device=args.device,
                              overrides={"vertical_slash": {"vertical_size": vertical, "slash_size": slash}})[0]
            window = matching_window(n, args.sink, vs.density, args.device)
            a = method_table(one, ["a_shape"], backend=args.backend, device=args.device,
                             overrides={"a_shape": {"sink": args.sink, "window": window}})[0]
            rows += [vs, a]
            pairs.append({"layer": int(layer), "vertical_slash": asdict(vs), "a_shape": asdict(a)})
            print(f"layer {layer} vs({vertical},{slash}) density {vs.density:.3f} recall "
                  f"{vs.recall_mean:.4f}/{vs.recall_min:.4f} err {vs.output_error:.3g} | a_shape "
                  f"({args.sink},{window}) density {a.density:.3f} recall {a.recall_mean:.4f}/"
                  f"{a.recall_min:.4f} err {a.output_error:.3g}", flush=True)
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(pairs, fh, indent=1)


if __name__ == "__main__":
    main()
