"""`sparseprefill search`: MInference's offline kernel-aware pattern search (Alg. 1).

Reads sample q, k, v of some layers (the file `sparseprefill eval capture` writes,
or the demo's synthetic workload), runs `search_patterns` on each layer, prints the
chosen pattern and output error per head, and writes an `MInferenceConfig` JSON
that `fast.minference` / `reference.minference` and the transformers integration
read. Layers that were not captured take the patterns of the nearest captured
layer (ties: the earlier one), so the config covers `--num-layers` layers.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `sparseprefill search`."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--qkv", type=Path, help="capture file from `sparseprefill eval capture`")
    src.add_argument("--synthetic", type=int, metavar="N",
                     help="search one layer of the demo's synthetic workload of N tokens")
    parser.add_argument("--backend", choices=["fast", "reference"], default=None,
                        help="default: fast on a GPU, reference on CPU")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="layers in the written config (default: up to the last captured)")
    parser.add_argument("--target", type=float, default=None,
                        help="kernel cost per head to match (default: A-shape 1024+4096)")
    parser.add_argument("--tolerance", type=float, default=0.05,
                        help="relative kernel-cost mismatch accepted while resizing candidates (default 0.05)")
    parser.add_argument("--out", type=Path, default=Path("minference-config.json"),
                        help="where the JSON config is written (default minference-config.json)")


def _layers(args: argparse.Namespace, device: torch.device, dtype: torch.dtype
            ) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, float | None]]:
    if args.qkv is not None:
        data: dict[str, Any] = torch.load(args.qkv, map_location="cpu")
        out: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, float | None]] = []
        for i, layer in enumerate(data["layers"]):
            q, k, v = (data[name][i].to(device=device, dtype=dtype) for name in ("q", "k", "v"))
            out.append((int(layer), q, k, v, float(data["scale"][i])))
        return out
    from .demo import Shape, synthetic_qkv

    shape = (Shape(1, 32, 8, args.synthetic, 128, dtype) if device.type == "cuda"
             else Shape(1, 4, 2, args.synthetic, 64, dtype))
    q, k, v = synthetic_qkv(shape, device=device)
    return [(0, q, k, v, None)]


def run(args: argparse.Namespace) -> int:
    """Entry point of `sparseprefill search`."""
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backend = args.backend or ("fast" if device.type == "cuda" else "reference")
    if backend == "fast" and device.type != "cuda":
        from .demo import enable_interpreter

        enable_interpreter()
    if backend == "fast":
        from .fast import search_patterns
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    else:
        from .reference import search_patterns
        dtype = torch.float32
    from .reference.minference import HeadPattern, MInferenceConfig

    found: dict[int, tuple[HeadPattern, ...]] = {}
    for layer, q, k, v, scale in _layers(args, device, dtype):
        t0 = time.perf_counter()
        result = search_patterns(q, k, v, target=args.target, tolerance=args.tolerance, scale=scale)
        seconds = time.perf_counter() - t0
        found[layer] = result.patterns
        print(f"layer {layer}: N={q.shape[2]}, {q.shape[1]} heads, target cost "
              f"{result.target:.3g}, {seconds:.1f} s ({backend} on {device.type})")
        for h, head in enumerate(result.patterns):
            c = result.candidates.index(head)
            print(f"  head {h:>2}: {head.pattern:<15} {head.params}  error {result.errors[c, h]:.4f}")
    captured = sorted(found)
    num_layers = args.num_layers or captured[-1] + 1
    layers = tuple(found[min(captured, key=lambda c: (abs(c - i), c))] for i in range(num_layers))
    MInferenceConfig(layers).save(args.out)
    print(f"wrote {args.out} ({num_layers} layers; searched {captured})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparseprefill search", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
