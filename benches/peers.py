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

The peers and what of theirs runs (docs/workload.md, "Peers"):

* FlexPrefill (own code): MInference's `minference/modules/flexprefill.py`, estimate and kernel.
* MInference (own code): `minference/ops/pit_sparse_flash_attention_v2.py`, its index builder
  (`convert_vertical_slash_indexes`, MInference's CUDA extension `minference.cuda`, built from its
  csrc on first use) and its Triton vertical-slash kernel, K/V repeated to the query heads as its
  model patch does; the lines come from our `fast.vertical_slash_lines` (the same last-64-query
  rule): MInference's estimate lives inside its model patch (closures over the layer), not in a
  callable function. Slash count = `SLASH_PER_VERTICAL` x the vertical count.
* XAttention (own code): `xattn.src.Xattention` imports `block_sparse_attn` (a CUDA extension built
  from FlashAttention-2's sources) at module level; where it imports it runs end to end.
* XAttention estimate (own code) + our kernel: the `xattn_estimate` of MInference's packaging of
  XAttention (`minference/modules/xattention.py`, the same Triton kernels as XAttention's
  `xattn/src/kernels.py`), its block mask run by our `fast.sparse_attention`.

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
    # Instead of `blocks`: (module, q, k, v, knob, probs, rows) -> (density, recall) on the sampled rows.
    measure: Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor, torch.Tensor],
                      tuple[float, float]] | None = None
    # "bnhd": q, k, v passed as [B, N, H, D] (FlexPrefill's layout); "bhnd": as [B, H, N, D].
    layout: str = "bnhd"


def _flex_run(m: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: float) -> torch.Tensor:
    out: torch.Tensor = m.flex_prefill_attention(q, k, v, gamma, 0.1, block_size=BLOCK)
    return out


def _flex_blocks(m: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: float) -> list[list[torch.Tensor]]:
    n = q.shape[1]
    blocks: list[list[torch.Tensor]] = m.get_active_blocks(q, k, v, BLOCK, gamma, 1, math.ceil(n / BLOCK), 0.1, False)
    return blocks


SLASH_PER_VERTICAL = 4
VS_BLOCK = 64  # MInference's vertical-slash kernel and index builder block (M = N = 64)


def _vs_lines(q: torch.Tensor, k: torch.Tensor, size: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(verticals ascending, slash offsets descending) int32 `[B, H, count]`, MInference's index format."""
    from sparseprefill.fast.vertical_slash import vertical_slash_lines

    vert, slash = vertical_slash_lines(q, k, vertical_size=int(size), slash_size=int(SLASH_PER_VERTICAL * size))
    return vert.to(torch.int32).contiguous(), slash.to(torch.int32).flip(-1).contiguous()


def _repeat_kv(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    g = q.shape[1] // x.shape[1]
    return x.repeat_interleave(g, dim=1) if g > 1 else x


def _minference_index(m: Any, q: torch.Tensor, k: torch.Tensor, size: float) -> tuple[torch.Tensor, ...]:
    vert, slash = _vs_lines(q, k, size)
    seqlens = torch.tensor([q.shape[2]] * q.shape[0], dtype=torch.int32, device=q.device)
    out: tuple[torch.Tensor, ...] = tuple(m.convert_vertical_slash_indexes(seqlens, vert, slash, q.shape[2],
                                                                           VS_BLOCK, VS_BLOCK))
    return out


def _minference_run(m: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, size: float) -> torch.Tensor:
    # MInference's own path from the lines on: index builder, padding, Triton kernel ([B, H, N, D]).
    vert, slash = _vs_lines(q, k, size)
    out: torch.Tensor = m.vertical_slash_sparse_attention(q, _repeat_kv(q, k), _repeat_kv(q, v), vert, slash)
    return out


def _minference_measure(m: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, size: float,
                        probs: torch.Tensor, rows: torch.Tensor) -> tuple[float, float]:
    """Density and recall of the keys MInference's index covers on the sampled rows: per row block,
    `block_count` 64-key ranges from `block_offset` (the slashes) and `column_count` columns."""
    count, offset, ccount, cindex = _minference_index(m, q, k, size)
    b_, h_, n = q.shape[0], q.shape[1], q.shape[2]
    rb = rows // VS_BLOCK
    keys = torch.arange(n, device=q.device)
    causal = keys[None, :] <= rows[:, None]
    kept, recall = 0, []
    for b in range(b_):
        for h in range(h_):
            off = offset[b, h, rb].long()
            valid = torch.arange(off.shape[-1], device=q.device)[None, :] < count[b, h, rb].long()[:, None]
            edge = torch.zeros(rows.numel(), n + VS_BLOCK + 1, device=q.device)
            edge.scatter_add_(1, off.clamp(0, n), valid.float())
            edge.scatter_add_(1, (off + VS_BLOCK).clamp(0, n + VS_BLOCK), -valid.float())
            mask = edge.cumsum(-1)[:, :n] > 0.5
            col = cindex[b, h, rb].long()
            cvalid = torch.arange(col.shape[-1], device=q.device)[None, :] < ccount[b, h, rb].long()[:, None]
            cols = torch.zeros(rows.numel(), n + 1, dtype=torch.bool, device=q.device)
            cols.scatter_(1, torch.where(cvalid, col.clamp(0, n - 1), n), True)
            mask = (mask | cols[:, :n]) & causal
            kept += int(mask.sum())
            recall.append((probs[b, h] * mask).sum(-1).double().mean())
    return kept / (b_ * h_ * float((rows + 1).sum())), float(torch.stack(recall).mean())


def _xattention_run(m: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, threshold: float) -> torch.Tensor:
    out: torch.Tensor = m.Xattention_prefill(q, _repeat_kv(q, k), _repeat_kv(q, v), stride=8,
                                             threshold=threshold, causal=True)
    return out


def _xattn_chunk(n: int) -> int:
    # XAttention's default estimate chunk for length n (as its `Xattention_prefill` picks it).
    p2 = 1 << (n - 1).bit_length()
    return int(max(min(max(2048, p2), 128 * 1024 * 2048 // p2), 2048))


def _xattn_tiles(m: Any, q: torch.Tensor, k: torch.Tensor, threshold: float) -> torch.Tensor:
    """XAttention's own estimate (stride 8, block 128): the kept causal tiles `[B, H, T, T]`."""
    n = q.shape[2]
    t = math.ceil(n / BLOCK)
    _, mask = m.xattn_estimate(q, _repeat_kv(q, k), block_size=BLOCK, stride=8, norm=1, threshold=threshold,
                               chunk_size=_xattn_chunk(n), select_mode="inverse", use_triton=True, causal=True)
    tiles: torch.Tensor = mask[:, :, :t, :t] & torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return tiles


def _xattn_est_run(m: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, threshold: float) -> torch.Tensor:
    from sparseprefill.fast import sparse_attention
    from sparseprefill.fast.xattention import tiles_to_plan

    plan = tiles_to_plan(_xattn_tiles(m, q, k, threshold), seqlen=q.shape[2], block=BLOCK)
    return sparse_attention(q, k, v, plan)


def _xattn_est_measure(m: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, threshold: float,
                       probs: torch.Tensor, rows: torch.Tensor) -> tuple[float, float]:
    tiles = _xattn_tiles(m, q, k, threshold)
    t = tiles.shape[-1]
    grid = torch.arange(t * t, device=q.device).view(t, t)
    blocks = [[grid[tiles[b, h]] for h in range(tiles.shape[1])] for b in range(tiles.shape[0])]
    return block_recall(blocks, probs, rows, q.shape[2])


PEERS = (
    Peer("FlexPrefill (own code)", "minference.modules.flexprefill", "gamma", (0.8, 0.85, 0.9, 0.95, 0.98),
         _flex_run, _flex_blocks,
         lambda m, q, k, v, g: m.get_active_blocks(q, k, v, BLOCK, g, 1, math.ceil(q.shape[1] / BLOCK), 0.1, False)),
    Peer("MInference (own code)", "minference.ops.pit_sparse_flash_attention_v2", "vertical_size",
         (250.0, 500.0, 1000.0, 2000.0, 4000.0, 8000.0), _minference_run, None,
         lambda m, q, k, v, s: _minference_index(m, q, k, s), measure=_minference_measure, layout="bhnd"),
    Peer("XAttention (own code)", "xattn.src.Xattention", "threshold", (0.8, 0.9, 0.95),
         _xattention_run, None, layout="bhnd"),
    Peer("XAttention estimate (own code) + our kernel", "minference.modules.xattention", "threshold",
         (0.8, 0.9, 0.95, 0.98), _xattn_est_run, None, lambda m, q, k, v, t: _xattn_tiles(m, q, k, t),
         measure=_xattn_est_measure, layout="bhnd"),
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
        a, b, c = (q, k, v) if peer.layout == "bhnd" else (qt, kt, vt)
        if peer.blocks is None and peer.measure is None:
            log(f"{source}: peer {peer.name} imports but its plan is not read here: not run")
            points.append({"method": f"peer: {peer.name}", "source": source, "seqlen": n, "params": {},
                           "status": "imports; plan reader not written", "density": None, "recall_mean": None,
                           "gpu": {}})
            continue
        mine = []
        for value in peer.values:
            try:
                if peer.measure is not None:
                    density, recall = peer.measure(mod, a, b, c, value, probs, idx)
                else:
                    assert peer.blocks is not None
                    density, recall = block_recall(peer.blocks(mod, a, b, c, value), probs, idx, n)
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
            try:
                e2e = ms(lambda: peer.run(mod, a, b, c, value))
            except Exception as exc:  # noqa: BLE001 - a peer failing is reported, not fatal
                p["status"] = f"run failed: {type(exc).__name__}: {str(exc)[:300]}"
                log(f"{source}: peer {peer.name} {peer.knob}={value}: {p['status']}")
                continue
            gpu: dict[str, Any] = {"e2e_ms": e2e, "cudnn_ms": cudnn_ms, "speedup_vs_cudnn": cudnn_ms / e2e,
                                   "floor_ms": p["density"] * cudnn_ms}
            if peer.estimate is not None:
                gpu["estimate_plan_ms"] = ms(lambda: peer.estimate(mod, a, b, c, value))  # type: ignore[misc]
                gpu["kernel_ms"] = None
            if dense is not None:
                out = peer.run(mod, a, b, c, value)
                out = (out if peer.layout == "bhnd" else out.transpose(1, 2)).float()
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
