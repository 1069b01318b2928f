"""Peers in the same run: MInference, FlexPrefill and XAttention's own code, when their
modules can be imported, at their own equal-recall setting.

Nothing of the peers ships with sparseprefill: point `--peer DIR` (or PYTHONPATH) at a
scratch copy or an installed package. For each peer that imports, its knob is swept on the
same q, k, v as our methods; its plan (the blocks it computes) gives density and recall
(the kept share of the full causal softmax, on `rows` query rows spread over the
sequence); per recall target the least-density knob reaching it is timed end to end (and
its estimate alone where the peer exposes it), beside cuDNN SDPA of the same run. A peer
that does not import is listed with the import error: it is not run, and said so.

    python benches/peers.py --seqlen 32768 --peer .carryE/peer --json $OUT/peers.json

`benches/equal_recall.py --measure --peer DIR` runs the same on each of its sources.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BLOCK = 128


@dataclass
class Peer:
    """One peer: the module to import, its knob values, and how to run it and read its blocks."""

    name: str
    module: str
    knob: str
    values: tuple[float, ...]
    # (module, q, k, v in [B, N, H, D], knob) -> output [B, N, H, D]
    run: Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (module, q, k, v, knob) -> per (batch, head) the kept blocks `row block * T + column block`
    blocks: Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor, float], list[list[torch.Tensor]]] | None
    estimate: Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor, float], Any] | None = None


def _flex_run(m: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: float) -> torch.Tensor:
    out: torch.Tensor = m.flex_prefill_attention(q, k, v, gamma, 0.1, block_size=BLOCK)
    return out


def _flex_blocks(m: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: float) -> list[list[torch.Tensor]]:
    n = q.shape[1]
    blocks: list[list[torch.Tensor]] = m.get_active_blocks(q, k, v, BLOCK, gamma, 1, math.ceil(n / BLOCK), 0.1, False)
    return blocks


def _minference_run(m: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, size: float) -> torch.Tensor:
    # MInference's vertical-slash kernel on [B, H, N, D]; vertical = size, slash = 2 size.
    fn = m.vertical_slash_sparse_attention
    out: torch.Tensor = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), int(size), int(2 * size))
    return out.transpose(1, 2)


def _xattention_run(m: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, threshold: float) -> torch.Tensor:
    out: torch.Tensor = m.Xattention_prefill(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), stride=8,
                                             threshold=threshold, causal=True)
    return out.transpose(1, 2)


PEERS = (
    Peer("FlexPrefill (own code)", "minference.modules.flexprefill", "gamma", (0.8, 0.85, 0.9, 0.95, 0.98),
         _flex_run, _flex_blocks,
         lambda m, q, k, v, g: m.get_active_blocks(q, k, v, BLOCK, g, 1, math.ceil(q.shape[1] / BLOCK), 0.1, False)),
    Peer("MInference (own code)", "minference.ops.pit_sparse_flash_attention_v2", "vertical_size", (256.0, 512.0, 1024.0, 2048.0),
         _minference_run, None),
    Peer("XAttention (own code)", "xattn.src.Xattention", "threshold", (0.8, 0.9, 0.95),
         _xattention_run, None),
)


def sampled_probs(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Causal softmax of `rows` (q, k `[B, H, N, D]` / `[B, Hkv, N, D]`): `[B, H, R, N]` float32."""
    g = q.shape[1] // k.shape[1]
    out = []
    for h in range(q.shape[1]):
        s = torch.matmul(q[:, h, rows].float(), k[:, h // g].float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        causal = torch.arange(k.shape[2], device=q.device)[None, :] <= rows[:, None]
        out.append(torch.softmax(s.masked_fill(~causal, -math.inf), dim=-1))
    return torch.stack(out, 1)


def block_recall(blocks: list[list[torch.Tensor]], probs: torch.Tensor, rows: torch.Tensor,
                 n: int) -> tuple[float, float]:
    """(density over the causal blocks, mean recall on `rows`) of a block list."""
    t = math.ceil(n / BLOCK)
    kept = 0
    recall = []
    for b, per_b in enumerate(blocks):
        for h, e in enumerate(per_b):
            e = e.to(probs.device).long()
            rb, cb = e // t, e % t
            causal = rb >= cb
            kept += int(causal.sum())
            grid = torch.zeros(t, t, dtype=torch.bool, device=probs.device)
            grid[rb[causal], cb[causal]] = True
            mask = grid[rows // BLOCK].repeat_interleave(BLOCK, dim=1)[:, :n]
            recall.append((probs[b, h] * mask).sum(-1).double().mean())
    heads = sum(len(x) for x in blocks)
    return kept / (heads * t * (t + 1) / 2), float(torch.stack(recall).mean())


def load(peer: Peer) -> tuple[Any, str | None]:
    """The peer's module, or None and why not."""
    try:
        return importlib.import_module(peer.module), None
    except Exception as exc:  # noqa: BLE001 - any import failure means "not present"
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"


def peer_points(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, source: str, targets: list[float],
                cudnn_ms: float, *, dense: torch.Tensor | None = None, rows: int = 256, rep: int = 40,
                log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Every importable peer's points on one input (see the module doc); a peer that is not
    importable gives one point with `status` saying why."""
    import triton.testing

    def ms(fn: Callable[[], Any]) -> float:
        return float(triton.testing.do_bench(fn, warmup=max(5, rep // 5), rep=rep, return_mode="median"))

    n = int(q.shape[2])
    idx = torch.linspace(0, n - 1, rows, device=q.device).round().long().unique()
    probs = sampled_probs(q, k, idx)
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    points: list[dict[str, Any]] = []
    for peer in PEERS:
        mod, why = load(peer)
        if mod is None:
            log(f"{source}: peer {peer.name} not run: {peer.module} does not import ({why})")
            points.append({"method": f"peer: {peer.name}", "source": source, "seqlen": n, "params": {},
                           "status": f"not importable: {why}", "density": None, "recall_mean": None, "gpu": {}})
            continue
        if peer.blocks is None:
            log(f"{source}: peer {peer.name} imports but its plan is not read here: not run")
            points.append({"method": f"peer: {peer.name}", "source": source, "seqlen": n, "params": {},
                           "status": "imports; plan reader not written", "density": None, "recall_mean": None,
                           "gpu": {}})
            continue
        mine = []
        for value in peer.values:
            try:
                density, recall = block_recall(peer.blocks(mod, qt, kt, vt, value), probs, idx, n)
            except Exception as exc:  # noqa: BLE001 - a peer failing is reported, not fatal
                log(f"{source}: peer {peer.name} {peer.knob}={value}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            mine.append({"method": f"peer: {peer.name}", "source": source, "seqlen": n,
                         "params": {peer.knob: value}, "density": density, "recall_mean": recall,
                         "recall_rows": int(idx.numel()), "status": "ran", "gpu": {}})
        picked: list[dict[str, Any]] = []
        for target in targets:
            ok = [p for p in mine if p["recall_mean"] >= target]
            if ok:
                pick = min(ok, key=lambda p: p["density"])
                if all(pick is not p for p in picked):
                    picked.append(pick)
        for p in picked:
            value = p["params"][peer.knob]
            e2e = ms(lambda: peer.run(mod, qt, kt, vt, value))
            gpu: dict[str, Any] = {"e2e_ms": e2e, "cudnn_ms": cudnn_ms, "speedup_vs_cudnn": cudnn_ms / e2e,
                                   "floor_ms": p["density"] * cudnn_ms}
            if peer.estimate is not None:
                gpu["estimate_plan_ms"] = ms(lambda: peer.estimate(mod, qt, kt, vt, value))  # type: ignore[misc]
                gpu["kernel_ms"] = None
            if dense is not None:
                out = peer.run(mod, qt, kt, vt, value).transpose(1, 2).float()
                p["output_error"] = float((out - dense.float()).norm() / dense.float().norm())
            p["gpu"] = gpu
            log(f"{source} peer {peer.name} {peer.knob}={value}: recall {p['recall_mean']:.3f} density "
                f"{p['density']:.4f} e2e {e2e:.2f} ms ({cudnn_ms / e2e:.2f}x cuDNN)")
        points += mine
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlen", type=int, default=32768)
    parser.add_argument("--workload", choices=("synthetic", "calibrated"), default="calibrated")
    parser.add_argument("--qkv", type=Path, default=None, help="a capture instead of a generated workload")
    parser.add_argument("--peer", default=None, help="folder to put first on sys.path (a scratch copy)")
    parser.add_argument("--targets", type=float, nargs="+", default=[0.95, 0.90])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.peer:
        sys.path.insert(0, os.path.abspath(args.peer))
    if not torch.cuda.is_available():
        print("peers.py times GPU kernels and needs a CUDA GPU", file=sys.stderr)
        return 2
    from sparseprefill import bench
    from sparseprefill.demo import Shape
    from sparseprefill.workload import workload_qkv

    q, k, v = workload_qkv(Shape(1, 16, 4, args.seqlen, 128, torch.bfloat16), device=torch.device("cuda"),
                           workload=args.workload, qkv=args.qkv)
    base = bench.cudnn_row(q, k, v, log=print)
    points = peer_points(q, k, v, f"{args.workload} N={args.seqlen}", args.targets, base.ms)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "points": points}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
