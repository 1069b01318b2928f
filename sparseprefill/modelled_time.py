"""`sparseprefill eval modelled-time`: modelled GPU time of calibrated configs on captured layers.

Runs on a CPU (no GPU needed).

For every config (any method's, through `sparseprefill.config.headwise_heads`) and captured
layer, the layer's plan is built with the reference estimators on the capture and priced
with the cost model `sparseprefill calibrate --method headwise` chooses by
(`reference.headwise`): each head's kept pairs at the rates of the plan's kernel tile plus
its method's estimate share, a head whose sparse time is not below dense (the break-even
rule) or that the config runs dense at the dense time. Prints one row per config and
layer (density, heads dense, modelled ms against the layer's dense ms) and writes JSON.

    sparseprefill eval modelled-time --qkv qkv_prose.pt --max-seqlen 4096 --layers 0 9 20 27 \\
        --config headwise=cfg/headwise.json --config xattention=cfg/xattention.json --json time.json

The rates: `--rates` (a `sparseprefill rates` JSON), else the break-even rule's default
table (one H200); `--batch` and `--dtype` are the deployment's (the capture's heads, N and
D are used as they are). A model, not a measurement: `sparseprefill bench headwise
--params` times a layer on a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from .config import headwise_heads, read_config
from .layer_stats import load_captures, plan_density
from .reference import headwise_plan
from .reference.dense_fallback import DEFAULT_TABLE, RateTable, kept_pairs, kernel_tile
from .reference.headwise import dense_ms, estimate_ms, head_kernel_ms


def layer_time(heads: list[dict[str, Any] | None], q: torch.Tensor, k: torch.Tensor, *, batch: int, dtype: str,
               rates: RateTable) -> dict[str, Any]:
    """One layer's plan under the cost model: per head its time, the layer's total and dense time."""
    n, d = int(q.shape[2]), int(q.shape[3])
    plan = headwise_plan(q, k, heads=heads)
    blocks, columns = kept_pairs(plan)
    scale = batch / int(q.shape[0])  # the capture's rows stand for the deployment's batch
    kernel = head_kernel_ms(blocks.sum(0, keepdim=True) * scale, columns.sum(0, keepdim=True) * scale,
                            seqlen=n, tile=kernel_tile(plan.block_m), head_dim=d, dtype=dtype, rates=rates)
    dense = dense_ms(seqlen=n, batch=batch, head_dim=d, dtype=dtype, rates=rates)
    hq = int(q.shape[1])
    per_head, runs_dense = [], []
    for h in range(hq):
        choice = heads[h % len(heads)]
        if choice is None:
            per_head.append(dense)
            runs_dense.append(h)
            continue
        params = {key: val for key, val in choice.items() if key != "method"}
        est = estimate_ms(choice["method"], params, seqlen=n, batch=batch, head_dim=d, dtype=dtype, rates=rates)
        sparse = float(kernel[h])
        if h in plan.dense_heads or sparse >= dense:
            runs_dense.append(h)
            sparse = dense
        per_head.append(sparse + (est or 0.0))
    density = plan_density(plan).mean(0)
    return {"density": float(density.mean()), "block_m": plan.block_m, "dense_heads": runs_dense,
            "head_ms": per_head, "ms": sum(per_head), "dense_ms": dense * hq,
            "methods": [None if c is None else c["method"] for c in (heads[h % len(heads)] for h in range(hq))]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `sparseprefill eval modelled-time`."""
    parser.add_argument("--qkv", type=Path, required=True, help="a capture (sparseprefill eval capture)")
    parser.add_argument("--config", action="append", required=True, metavar="LABEL=PATH",
                        help="a calibrated config (repeatable)")
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="captured layers (default: all)")
    parser.add_argument("--max-seqlen", type=int, default=None, help="use only the first tokens of the capture")
    parser.add_argument("--batch", type=int, default=1, help="the deployment's batch (default 1)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--rates", type=Path, default=None,
                        help="a `sparseprefill rates` JSON (default: the break-even rule's default table)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")


def _configs(items: list[str]) -> list[tuple[str, Any]]:
    """`LABEL=PATH` items read through `sparseprefill.config.read_config`."""
    configs = []
    for item in items:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise ValueError(f"--config takes LABEL=PATH, got {item!r}")
        configs.append((label, read_config(path)))
    labels = [label for label, _ in configs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--config labels must differ, got {labels}")
    return configs


def run(args: argparse.Namespace) -> int:
    """Entry point of `sparseprefill eval modelled-time`: one table row per config and layer."""
    if isinstance(args.batch, bool) or args.batch < 1:
        raise ValueError(f"--batch must be an integer >= 1, got {args.batch}")
    rates = DEFAULT_TABLE if args.rates is None else RateTable.from_json(json.loads(args.rates.read_text()))
    configs = _configs(args.config)
    caps = load_captures([args.qkv], layers=args.layers, max_seqlen=args.max_seqlen)
    rows = []
    print("| config | layer | density | heads dense | modelled ms | dense ms | vs dense | unit |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, config in configs:
        for cap in caps:
            if cap.layer not in config.layers:
                continue
            heads = headwise_heads(config, cap.layer)
            row = {"config": label, "layer": cap.layer, "seqlen": cap.seqlen,
                   **layer_time(heads, cap.q.float(), cap.k.float(), batch=args.batch, dtype=args.dtype,
                                rates=rates)}
            rows.append(row)
            print(f"| {label} | {cap.layer} | {row['density']:.4f} | {len(row['dense_heads'])}/{len(heads)} | "
                  f"{row['ms']:.4g} | {row['dense_ms']:.4g} | {row['dense_ms'] / row['ms']:.2f}x | "
                  f"{row['block_m']} |", flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": "sparseprefill " + " ".join(sys.argv[1:]), "rates": rates.device,
                                         "dtype": args.dtype, "batch": args.batch, "rows": rows}, indent=1))
    return 0
