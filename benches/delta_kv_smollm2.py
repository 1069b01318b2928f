"""Delta-KV on real attention: SmolLM2-135M layers captured at 8K (CPU, reference backend).

For each captured layer, metric and threshold (and the thesis's two ablations at a
few thresholds): the keep ratio (anchors / keys), the density (score entries both
phases compute over the causal area: the kernel's work), the exact-mass recall
(full-attention mass on the keys phase 2 computes exactly), and the relative output
error against dense attention. The reference runs in float64.

    python benches/delta_kv_smollm2.py --qkv out/qkv_smollm2_8k.pt \
        --json benches/results/cpu-smollm2-delta-kv-2026-11-23.json

(`sparseprefill eval capture --seqlen 8192` makes the capture.)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from sparseprefill import reference

GRID = {"euclidean": [8.0, 10.0, 12.0, 14.0], "cosine": [0.9, 0.85, 0.8, 0.75, 0.7]}
ABLATE = {"euclidean": [10.0, 12.0], "cosine": [0.85, 0.75]}


def run(qkv: Path, out: Path | None, layers: list[int] | None, block: int) -> list[dict[str, Any]]:
    data = torch.load(qkv)
    rows: list[dict[str, Any]] = []
    for li, layer in enumerate(data["layers"]):
        if layers and layer not in layers:
            continue
        q, k, v = (data[x][li].float() for x in "qkv")
        scale = data["scale"][li]
        exact = reference.attention(q.double(), k.double(), v.double(), scale=scale)
        for metric, grid in GRID.items():
            for threshold in grid:
                keep = reference.delta_keep_mask(k, threshold=threshold, metric=metric, chunk=512)
                packed = reference.delta_pack(k, v, keep, block=block)
                _, phase2 = reference.delta_kv_plans(q, packed, block_m=block)
                exact_mass = reference.recall(q, k, phase2, scale=scale).double().mean(dim=-1)
                variants = [(True, True)]
                if threshold in ABLATE[metric]:
                    variants += [(False, True), (True, False)]
                for weighted, diagonal in variants:
                    start = time.perf_counter()
                    o = reference.delta_kv_attention(q, k, v, packed, block_m=block, count_weighted=weighted,
                                                     exact_diagonal=diagonal, scale=scale)
                    row = {
                        "layer": layer, "metric": metric, "threshold": threshold,
                        "count_weighted": weighted, "exact_diagonal": diagonal,
                        "keep_ratio": float(packed.keep_ratio().mean()),
                        "density": float(reference.delta_kv_density(q, packed, block_m=block).mean()),
                        "exact_mass_mean": float(exact_mass.mean()), "exact_mass_min": float(exact_mass.min()),
                        "output_error": reference.relative_error(o, exact),
                        "seconds": time.perf_counter() - start,
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if out is not None:
                        out.write_text(json.dumps({"capture": str(qkv), "block": block, "chunk": 512,
                                                   "backend": "reference (float64, CPU)", "rows": rows},
                                                  indent=1))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qkv", type=Path, default=Path("out/qkv_smollm2_8k.pt"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--layers", type=int, nargs="*", default=None)
    parser.add_argument("--block", type=int, default=64, help="block_m = block_n (default 64)")
    args = parser.parse_args()
    run(args.qkv, args.json, args.layers, args.block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
