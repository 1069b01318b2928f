"""`sparseprefill tune`: SampleAttention's offline hyperparameter tuning (Section 4.4, Table 6).

Reads q/k captures (`sparseprefill eval capture` files, one prompt each), groups
them by sequence-length range (Table 6's ranges by default: < 16K, [16K, 48K),
[48K, 80K), [80K, 112K), >= 112K), and for every range searches a grid of
`(alpha_c, alpha_s, chunk_n)` for the lowest density of the executed plan whose
attention recall (CRA) meets the target on every captured layer: the mean over a
layer's heads >= `--target-mean` (default 0.95) and every head >= `--target-min`
(default 0.85), a head's recall being the mean over its rows. It prints the
Pareto frontier it searched (density against worst-layer mean recall and worst
head) and writes a `SampleAttentionSettings` JSON that `sample_attention(...,
settings=path)` and `patch(model, "sample_attention", {"settings": path})` read.

The paper tunes on task accuracy against FlashAttention-2 (RULER subsets); this
tuner uses recall, the quantity the thresholds are defined on, so it needs no
model and no task data: only captures. Recall and density are exact for the
block plans: per layer, the full causal attention mass of every (query block,
key block) cell is computed once (rows chunked, no `[N, N]` tensor), and each
candidate plan's recall and density are sums over its kept cells.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

# Table 6's length ranges: < 16K, [16K, 48K), [48K, 80K), [80K, 112K), >= 112K.
TABLE6_BOUNDS = (16384, 49152, 81920, 114688)
DEFAULT_ALPHAS = (0.8, 0.85, 0.9, 0.92, 0.95, 0.98)
DEFAULT_CHUNKS = (1, 2, 4)
# Rows of full attention per chunk when computing cell masses (float64 [B, Hq, rows, N]).
_CELL_BYTES = 256 * 2**20


@dataclass
class Layer:
    """One captured layer of one prompt."""

    source: str
    layer: int
    q: torch.Tensor
    k: torch.Tensor
    scale: float | None

    @property
    def seqlen(self) -> int:
        return int(self.q.shape[2])


@dataclass
class Candidate:
    """One searched setting and what it measured on a length range."""

    alpha_c: float
    alpha_s: float
    chunk_n: int
    density: float
    recall_mean: float
    recall_worst_layer: float
    recall_min: float
    meets: bool = False
    pareto: bool = False
    per_layer: list[dict[str, Any]] = field(default_factory=list)


def cell_mass(q: torch.Tensor, k: torch.Tensor, block_size: int, *, scale: float | None,
              dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Full causal attention mass of every (query block, key block) cell, summed over its rows.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`. block_size: the cell grid.
        scale: softmax scale, `1/sqrt(D)` if None. dtype: math precision.

    Returns:
        `[B, Hq, Qb, Kb]` in `dtype`; each query block's cells sum to its row count.
    """
    from .reference._checks import check_qk, resolve_scale
    from .reference.plan import cdiv

    shape = check_qk(q, k)
    sm = resolve_scale(scale, shape.head_dim)
    b, hq, hkv, n, d, g = shape.batch, shape.q_heads, shape.kv_heads, shape.seqlen, shape.head_dim, shape.group
    nb = cdiv(n, block_size)
    out = torch.zeros(b, hq, nb, nb, dtype=dtype, device=q.device)
    kg = k.to(dtype).unsqueeze(2)
    rows_per = max(block_size, _CELL_BYTES // max(1, b * hq * n * 8) // block_size * block_size)
    for start in range(0, n, rows_per):
        stop = min(n, start + rows_per)
        rows = torch.arange(start, stop, device=q.device)
        qs = q[:, :, start:stop].to(dtype).reshape(b, hkv, g, stop - start, d)
        scores = torch.matmul(qs, kg.transpose(-1, -2)) * sm
        causal = torch.arange(n, device=q.device)[None, :] <= rows[:, None]
        probs = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1).reshape(b, hq, stop - start, n)
        padded = torch.nn.functional.pad(probs, (0, nb * block_size - n))
        per_key_block = padded.reshape(b, hq, stop - start, nb, block_size).sum(dim=-1)
        qblock = (rows // block_size).to(torch.int64)
        out.index_add_(2, qblock, per_key_block)
    return out


def cell_pairs(seqlen: int, block_size: int, device: torch.device) -> torch.Tensor:
    """Causal (row, key) pairs of every (query block, key block) cell: int64 `[Qb, Kb]`."""
    from .reference.plan import cdiv

    nb = cdiv(seqlen, block_size)
    start = torch.arange(nb, device=device) * block_size
    stop = (start + block_size).clamp(max=seqlen)
    # Row r sees keys [j0, min(j1, r + 1)) of key block j = [j0, j1).
    rows = torch.arange(seqlen, device=device)
    seen = (torch.minimum(stop[None, :], rows[:, None] + 1) - start[None, :]).clamp(min=0)
    out = torch.zeros(nb, nb, dtype=torch.int64, device=device)
    out.index_add_(0, rows // block_size, seen)
    return out


def _layers(paths: Sequence[Path], max_seqlen: int | None) -> list[Layer]:
    out = []
    for path in paths:
        data: dict[str, Any] = torch.load(path, map_location="cpu")
        for i, layer in enumerate(data["layers"]):
            q, k = data["q"][i], data["k"][i]
            if max_seqlen is not None:
                q, k = q[:, :, :max_seqlen], k[:, :, :max_seqlen]
            scale = data["scale"][i] if "scale" in data else None
            out.append(Layer(str(path), int(layer), q, k, None if scale is None else float(scale)))
    return out


def ranges_of(bounds: Sequence[int]) -> list[tuple[int, int | None]]:
    """`[0, b1), [b1, b2), ..., [bk, None)` from sorted bounds."""
    edges = [0, *bounds]
    return [(lo, hi) for lo, hi in zip(edges, [*bounds, None])]


def search_range(
    layers: Sequence[Layer],
    *,
    alphas_c: Sequence[float],
    alphas_s: Sequence[float],
    chunks: Sequence[int],
    block_size: int,
    target_mean: float,
    target_min: float,
    backend: str,
    device: torch.device,
    log: Any = None,
) -> list[Candidate]:
    """Measure every `(alpha_c, alpha_s, chunk_n)` on the layers of one length range.

    Returns:
        The candidates, `meets` and `pareto` set, sorted by density.
    """
    from .reference.sample_attention import arg_topk, find_k, merge_blocks

    impl: Any = importlib.import_module(f"sparseprefill.{backend}.sample_attention")
    dtype = torch.float16 if backend == "fast" else torch.float32
    math_dtype = torch.float32 if device.type == "cuda" else torch.float64
    measured: dict[tuple[float, float, int], list[tuple[float, torch.Tensor]]] = {}
    for layer in layers:
        q, k = layer.q.to(device=device, dtype=dtype), layer.k.to(device=device, dtype=dtype)
        n = layer.seqlen
        t0 = time.perf_counter()
        mass = cell_mass(q, k, block_size, scale=layer.scale, dtype=math_dtype).double()
        pairs = cell_pairs(n, block_size, q.device).double()
        for chunk_n in chunks:
            column, slash = impl.sample_attention_scores(q, k, chunk_n=chunk_n, block_size=block_size,
                                                         scale=layer.scale)
            cols = {a: arg_topk(column, find_k(column, a)) for a in alphas_c}
            slashes = {a: arg_topk(slash, find_k(slash, a)) for a in alphas_s}
            for a_c in alphas_c:
                for a_s in alphas_s:
                    keep = merge_blocks(cols[a_c], slashes[a_s])
                    keep = keep.to(mass.device).double()
                    recall = (keep * mass).sum(dim=(-1, -2)) / n  # [B, Hq]: mean over rows
                    density = float((keep * pairs).sum(dim=(-1, -2)).mean()) / (n * (n + 1) / 2)
                    measured.setdefault((a_c, a_s, chunk_n), []).append((density, recall.flatten().cpu()))
        if log is not None:
            print(f"  {Path(layer.source).name} layer {layer.layer} (N={n}): "
                  f"{time.perf_counter() - t0:.1f} s", file=log, flush=True)
    out = []
    for (a_c, a_s, chunk_n), per in measured.items():
        means = [float(r.mean()) for _, r in per]
        heads = torch.cat([r for _, r in per])
        cand = Candidate(
            alpha_c=a_c, alpha_s=a_s, chunk_n=chunk_n,
            density=sum(d for d, _ in per) / len(per),
            recall_mean=float(heads.mean()), recall_worst_layer=min(means), recall_min=float(heads.min()),
            per_layer=[{"source": Path(layer.source).name, "layer": layer.layer, "seqlen": layer.seqlen,
                        "density": d, "recall_mean": float(r.mean()), "recall_min": float(r.min())}
                       for layer, (d, r) in zip(layers, per)],
        )
        cand.meets = cand.recall_worst_layer >= target_mean and cand.recall_min >= target_min
        out.append(cand)
    out.sort(key=lambda c: (c.density, -c.recall_worst_layer, c.chunk_n))
    best_mean = best_min = -math.inf
    for c in out:  # in order of density: on the frontier iff it beats every cheaper one somewhere
        c.pareto = c.recall_worst_layer > best_mean or c.recall_min > best_min
        best_mean, best_min = max(best_mean, c.recall_worst_layer), max(best_min, c.recall_min)
    return out


def choose(candidates: Sequence[Candidate]) -> Candidate:
    """The cheapest candidate meeting the target (ties: more recall, fewer chunks); if none
    does, the one with the highest worst-layer mean recall (then the cheapest)."""
    meeting = [c for c in candidates if c.meets]
    if meeting:
        return min(meeting, key=lambda c: (c.density, -c.recall_worst_layer, c.chunk_n))
    return min(candidates, key=lambda c: (-c.recall_worst_layer, -c.recall_min, c.density))


def format_table(candidates: Sequence[Candidate], chosen: Candidate, *, everything: bool = False) -> str:
    """The Pareto frontier (or every candidate) as a Markdown table; the chosen row marked."""
    lines = ["| alpha_c | alpha_s | chunk_n | density | recall mean (worst layer) | recall mean | "
             "recall min (head) | meets target | |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in candidates:
        if not (everything or c.pareto or c is chosen):
            continue
        mark = "chosen" if c is chosen else ("pareto" if c.pareto else "")
        lines.append(f"| {c.alpha_c:g} | {c.alpha_s:g} | {c.chunk_n} | {c.density:.4f} | "
                     f"{c.recall_worst_layer:.4f} | {c.recall_mean:.4f} | {c.recall_min:.4f} | "
                     f"{'yes' if c.meets else 'no'} | {mark} |")
    return "\n".join(lines)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `sparseprefill tune`."""
    from .methods.sample_attention import METHOD

    tuned = METHOD.name  # the tuner is SampleAttention's offline search (its Table 6)
    parser.add_argument("--method", choices=[tuned], default=tuned,
                        help="method to tune (SampleAttention's alpha_c, alpha_s, chunk_n)")
    parser.add_argument("--qkv", type=Path, nargs="+", required=True,
                        help="capture files from `sparseprefill eval capture` (any lengths)")
    parser.add_argument("--bounds", default=",".join(str(b) for b in TABLE6_BOUNDS),
                        help="comma-separated length-range bounds (default: Table 6's 16K,48K,80K,112K)")
    parser.add_argument("--alphas", default=",".join(f"{a:g}" for a in DEFAULT_ALPHAS),
                        help="alpha values searched for both alpha_c and alpha_s")
    parser.add_argument("--alphas-c", default=None, help="alpha_c values (default: --alphas)")
    parser.add_argument("--alphas-s", default=None, help="alpha_s values (default: --alphas)")
    parser.add_argument("--chunks", default=",".join(str(c) for c in DEFAULT_CHUNKS), help="chunk_n values")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--target-mean", type=float, default=0.95,
                        help="least mean recall over a layer's heads, on every captured layer")
    parser.add_argument("--target-min", type=float, default=0.85, help="least recall of any head")
    parser.add_argument("--backend", choices=["fast", "reference"], default=None,
                        help="sampling backend (default: fast on a GPU, reference on CPU)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--max-seqlen", type=int, default=None, help="use only the first tokens of each capture")
    parser.add_argument("--all", action="store_true", help="print every candidate, not only the Pareto frontier")
    parser.add_argument("--out", type=Path, default=Path("sample-attention-settings.json"))
    parser.add_argument("--table", type=Path, default=None, help="also write every candidate as JSON here")


def run(args: argparse.Namespace) -> int:
    """Entry point of `sparseprefill tune`."""
    from .reference._checks import check_fraction, check_positive_int
    from .reference.sample_attention import LengthRange, SampleAttentionSettings

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backend = args.backend or ("fast" if device.type == "cuda" else "reference")
    if backend == "fast" and device.type != "cuda":
        from .demo import enable_interpreter

        enable_interpreter()
    try:
        alphas_c = _floats(args.alphas_c or args.alphas)
        alphas_s = _floats(args.alphas_s or args.alphas)
        chunks = _ints(args.chunks)
        bounds = sorted(_ints(args.bounds)) if args.bounds else []
        for i, a in enumerate([*alphas_c, *alphas_s]):
            check_fraction(f"alpha[{i}]", a)
        for c in chunks:
            check_positive_int("chunk_n", c)
        check_positive_int("block_size", args.block_size)
        check_fraction("target_mean", args.target_mean)
        check_fraction("target_min", args.target_min)
        if not (alphas_c and alphas_s and chunks):
            raise ValueError("alphas and chunks must not be empty")
    except (TypeError, ValueError) as err:
        print(f"sparseprefill tune: {err}", file=sys.stderr)
        return 2
    layers = _layers(args.qkv, args.max_seqlen)
    found: list[LengthRange] = []
    report: list[dict[str, Any]] = []
    for lo, hi in ranges_of(bounds):
        members = [layer for layer in layers if lo <= layer.seqlen and (hi is None or layer.seqlen < hi)]
        if not members:
            continue
        where = f"[{lo}, {hi if hi is not None else 'inf'})"
        print(f"range {where}: {len(members)} layer(s) from "
              f"{len({m.source for m in members})} capture(s), {len(alphas_c) * len(alphas_s) * len(chunks)} "
              f"settings ({backend} on {device.type})", flush=True)
        cands = search_range(members, alphas_c=alphas_c, alphas_s=alphas_s, chunks=chunks,
                             block_size=args.block_size, target_mean=args.target_mean,
                             target_min=args.target_min, backend=backend, device=device, log=sys.stderr)
        best = choose(cands)
        print(format_table(cands, best, everything=args.all))
        if not best.meets:
            print(f"range {where}: no setting meets recall mean >= {args.target_mean} and min >= "
                  f"{args.target_min}; keeping the most accurate one", flush=True)
        stats = {"density": best.density, "recall_mean": best.recall_mean,
                 "recall_worst_layer": best.recall_worst_layer, "recall_min": best.recall_min,
                 "meets_target": best.meets, "layers": len(members),
                 "captures": sorted({Path(m.source).name for m in members})}
        found.append(LengthRange(lo, hi, best.alpha_c, best.alpha_s, best.chunk_n, stats))
        report.append({"min_seqlen": lo, "max_seqlen": hi, "chosen": asdict(best),
                       "candidates": [asdict(c) for c in cands]})
    if not found:
        print("sparseprefill tune: no captured layers", file=sys.stderr)
        return 2
    settings = SampleAttentionSettings(
        tuple(found), block_size=args.block_size,
        target={"recall_mean": args.target_mean, "recall_min": args.target_min,
                "alphas_c": alphas_c, "alphas_s": alphas_s, "chunks": chunks, "backend": backend},
    )
    settings.save(args.out)
    print(f"wrote {args.out} ({len(found)} length range(s))")
    if args.table is not None:
        args.table.parent.mkdir(parents=True, exist_ok=True)
        args.table.write_text(json.dumps(report, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparseprefill tune", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
