"""`peers`: peers' own code in the same run, on the same inputs, where their modules import.

Nothing of the peers ships with sparseprefill: `--peer DIR` (or PYTHONPATH) points at a
scratch copy or an installed package. For each peer that imports, its knob is swept on
the run's q, k, v; its blocks give density and recall (the kept share of the full
causal softmax on `--recall-rows` query rows spread over the sequence); for each recall
target (`--targets`) the least-density setting reaching it is timed end to end (and its
estimate alone where the peer exposes one), beside the baseline of the same run. A peer
that does not import gives one row saying why, and is not run.

* FlexPrefill (own code): MInference's `minference/modules/flexprefill.py`, estimate and kernel.
* MInference (own code): `minference/ops/pit_sparse_flash_attention_v2.py`: its index builder
  (`convert_vertical_slash_indexes`, MInference's CUDA extension) and its Triton vertical-slash
  kernel, K/V repeated to the query heads as its model patch does; the lines come from our
  `fast.vertical_slash_lines` (the same last-64-query rule: MInference's estimate lives inside
  its model patch, not in a callable); slashes = `SLASH_PER_VERTICAL` x verticals.
* XAttention (own code): `xattn.src.Xattention` (it imports `block_sparse_attn`, a CUDA
  extension built from FlashAttention-2's sources); where it imports it runs end to end.
* XAttention estimate (own code) + our kernel: `xattn_estimate` of MInference's packaging of
  XAttention (`minference/modules/xattention.py`), its block mask run by `fast.sparse_attention`.

`peer_points` is the same measurement for other tools (`sparseprefill compare`).
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..common import Context, Option, Row, Suite, Unit, baseline_unit

BLOCK = 128
SLASH_PER_VERTICAL = 4
VS_BLOCK = 64  # MInference's vertical-slash kernel and index builder block (M = N = 64)


@dataclass
class Peer:
    """One peer: the module to import, its knob values, and how to run it and read its blocks.

    Attributes:
        run: `(module, q, k, v, knob) -> output`, q, k, v in the peer's `layout`.
        blocks: `(module, q, k, v, knob) -> per (batch, head) the kept blocks `row * T + column``.
        estimate: `(module, q, k, v, knob) -> anything`, the peer's estimate alone, or None.
        measure: instead of `blocks`: `(module, q, k, v, knob, probs, rows) -> (density, recall)`.
        layout: "bnhd" (q, k, v as `[B, N, H, D]`) or "bhnd".
    """

    name: str
    module: str
    knob: str
    values: tuple[float, ...]
    run: Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    blocks: Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor, float], list[list[torch.Tensor]]] | None
    estimate: Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor, float], Any] | None = None
    measure: Callable[[Any, torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor, torch.Tensor],
                      tuple[float, float]] | None = None
    layout: str = "bnhd"


def _flex_run(m: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: float) -> torch.Tensor:
    out: torch.Tensor = m.flex_prefill_attention(q, k, v, gamma, 0.1, block_size=BLOCK)
    return out


def _flex_blocks(m: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gamma: float) -> list[list[torch.Tensor]]:
    blocks: list[list[torch.Tensor]] = m.get_active_blocks(q, k, v, BLOCK, gamma, 1, math.ceil(q.shape[1] / BLOCK),
                                                           0.1, False)
    return blocks


def _vs_lines(q: torch.Tensor, k: torch.Tensor, size: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(verticals ascending, slash offsets descending) int32 `[B, H, count]`, MInference's index format."""
    from ...fast.vertical_slash import vertical_slash_lines

    vert, slash = vertical_slash_lines(q, k, vertical_size=int(size), slash_size=int(SLASH_PER_VERTICAL * size))
    return vert.to(torch.int32).contiguous(), slash.to(torch.int32).flip(-1).contiguous()


def _repeat_kv(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    g = q.shape[1] // x.shape[1]
    return x.repeat_interleave(g, dim=1) if g > 1 else x


def _minference_index(m: Any, q: torch.Tensor, k: torch.Tensor, size: float) -> tuple[torch.Tensor, ...]:
    vert, slash = _vs_lines(q, k, size)
    seqlens = torch.tensor([q.shape[2]] * q.shape[0], dtype=torch.int32, device=q.device)
    return tuple(m.convert_vertical_slash_indexes(seqlens, vert, slash, q.shape[2], VS_BLOCK, VS_BLOCK))


def _minference_run(m: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, size: float) -> torch.Tensor:
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
    out: torch.Tensor = m.Xattention_prefill(q, _repeat_kv(q, k), _repeat_kv(q, v), stride=8, threshold=threshold,
                                             causal=True)
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
    from ...fast import sparse_attention
    from ...fast.xattention import tiles_to_plan

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
         _flex_run, _flex_blocks, _flex_blocks),
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
    """Causal softmax of `rows` (q `[B, H, N, D]`, k `[B, Hkv, N, D]`): `[B, H, R, N]` float32."""
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
                log: Callable[[str], None] = print,
                timer: Callable[[Callable[[], Any]], float] | None = None) -> list[dict[str, Any]]:
    """Every peer's points on one input (see the module doc): one per knob value that ran, with
    `gpu` timings for the settings picked at the recall targets; a peer that does not import
    gives one point whose `status` says why.

    Args:
        dense: the dense output, for each timed point's output error; None: not measured.
        timer: times a callable in ms (default: `do_bench` median with `rep` ms).
    """
    def ms(fn: Callable[[], Any]) -> float:
        if timer is not None:
            return float(timer(fn))
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=max(5, rep // 5), rep=rep, return_mode="median"))

    n = int(q.shape[2])
    idx = torch.unique(torch.linspace(0, n - 1, min(rows, n), device=q.device).round().long())
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
                           "status": "imports; its plan is not read here", "density": None, "recall_mean": None,
                           "gpu": {}})
            continue
        mine: list[dict[str, Any]] = []
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
                estimate = peer.estimate
                gpu["estimate_plan_ms"] = ms(lambda: estimate(mod, a, b, c, value))
            if dense is not None:
                out = peer.run(mod, a, b, c, value)
                out = (out if peer.layout == "bhnd" else out.transpose(1, 2)).float()
                p["output_error"] = float((out - dense.float()).norm() / dense.float().norm())
            p["gpu"] = gpu
            log(f"{source} peer {peer.name} {peer.knob}={value}: recall {p['recall_mean']:.3f} density "
                f"{p['density']:.4f} e2e {e2e:.2f} ms ({cudnn_ms / e2e:.2f}x cuDNN)")
        points += mine
    return points


def peer_rows(ctx: Context, n: int, targets: list[float], recall_rows: int) -> list[Row]:
    q, k, v = ctx.inputs(n)
    dense = ctx.dense_attention(q, k, v)()
    base = ctx.baseline(n).ms
    points = peer_points(q, k, v, f"{ctx.workload} N={n}", targets, base, dense=dense, rows=recall_rows,
                         log=ctx.log, timer=ctx.time)
    rows = []
    for p in points:
        gpu = p.get("gpu") or {}
        extra: dict[str, Any] = {key: p[key] for key in ("params", "status", "recall_rows", "output_error") if key in p}
        if "e2e_ms" in gpu:
            rows.append(ctx.row(p["method"], "peer", n, ms=gpu["e2e_ms"], density=p["density"],
                                recall_mean=p["recall_mean"], plan_ms=gpu.get("estimate_plan_ms"), extra=extra))
        else:
            rows.append(Row(p["method"], "peer", n, density=p["density"], recall_mean=p["recall_mean"],
                            suite=ctx.suite, extra=extra))
    return rows


def units(ctx: Context, seqlens: list[int], *, peer: str | None = None, targets: str = "0.95,0.9",
          recall_rows: int = 256) -> list[Unit]:
    if peer:
        sys.path.insert(0, os.path.abspath(peer))
    wanted = [float(x) for x in targets.split(",") if x]
    out: list[Unit] = []
    for n in seqlens:
        out.append(baseline_unit(ctx, n))
        out.append(Unit(f"{n}/peers", n, functools.partial(peer_rows, ctx, n, wanted, recall_rows)))
    return out


SUITE = Suite(
    name="peers",
    about="peers' own code (FlexPrefill, MInference, XAttention) on the same inputs, each that imports; says why "
          "not otherwise",
    seqlens=(32768,),
    units=units,
    options=(Option("--peer", "peer", str, None, "peers: a folder to put first on sys.path (a scratch copy)"),
             Option("--targets", "targets", str, "0.95,0.9", "peers: recall targets"),
             Option("--recall-rows", "recall_rows", int, 256, "peers: query rows recall is measured on")),
)
