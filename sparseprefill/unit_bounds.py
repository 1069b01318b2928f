"""`sparseprefill eval granularity`: the sparsest selection each unit of selection allows.

A calibrated method keeps more keys than the per-row oracle for two reasons: its unit
(128 x 128 tiles, whole columns and diagonals, stripes of a query block) and its
estimator's misses. For captured layers (the first `--seqlen` tokens), this takes each
query head's full causal attention (all rows, float64) and the sparsest selection
reaching a share of the mass under each unit:

* `row`: per row the fewest keys reaching `share` (the oracle `calibrate` reports);
* `mean`: the fewest entries of the whole head holding `share` of its mass (what a
  mean-recall target asks: rows may fall below);
* `block<B>`: the fewest causal `B x B` tiles reaching mean recall `share` (tiles by mass
  per causal area, greedy): the best any method with `B`-tiles can do;
* `block<B>_rows`: the same with every query block keeping `share` of its rows' mass
  (what a per-query-block threshold, XAttention's, aims at);
* `stripes<B>`: per query block of `B` rows any key columns (AnchorAttention's and
  SampleAttention's unit), greedy by mass per causal area, mean recall `share`;
* `lines`: whole columns and diagonals (a vertical-slash method with single lines): the
  least area over every pair (top `v` columns, top `s` diagonals by mass) reaching mean
  recall `share`;
* `vslines<B>` (`--vs-blocks B`): the same ideal lines indexed as vertical-slash indexes
  them (each kept diagonal keeps the `B x B` key blocks it touches), over a `(v, s)` grid:
  vertical-slash's own unit with a perfect estimate.

Writes one JSON (per layer and head, the densities; rewritten after each layer) and
prints the layer means. `sparseprefill eval heldout` reads it for the bound of each
method's unit.

    sparseprefill eval granularity --qkv qkv_smollm2_8k_all.pt --layers 0 9 27 --seqlen 4096 --json g.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch


def head_probs(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax of one head, float64 `[N, N]` (q, k: `[N, D]`)."""
    n = q.shape[0]
    scores = (q.double() @ k.double().T) * scale
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)


def _causal(n: int) -> float:
    return n * (n + 1) / 2


def row_bound(p: torch.Tensor, share: float) -> float:
    """Density of the fewest keys per row holding `share` of the row's mass."""
    n = p.shape[0]
    cum = torch.sort(p, dim=-1, descending=True).values.cumsum(dim=-1)
    need = ((cum < share - 1e-12).sum(dim=-1) + 1).clamp(max=torch.arange(1, n + 1))
    return float(need.sum()) / _causal(n)


def mean_bound(p: torch.Tensor, share: float) -> float:
    """Density of the fewest entries of the head holding `share` of its mass (N rows of mass 1)."""
    n = p.shape[0]
    flat = torch.sort(p.flatten(), descending=True).values
    need = int((flat.cumsum(0) < share * n - 1e-9).sum()) + 1
    return need / _causal(n)


def _tiles(p: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mass, causal area) of every `b x b` tile, float64 `[Qb, Kb]` each."""
    n = p.shape[0]
    nb = -(-n // b)
    pad = torch.zeros(nb * b, nb * b, dtype=p.dtype)
    pad[:n, :n] = p
    ones = torch.zeros(nb * b, nb * b, dtype=torch.float64)
    ones[:n, :n] = torch.ones(n, n, dtype=torch.float64).tril()
    return pad.view(nb, b, nb, b).sum(dim=(1, 3)), ones.view(nb, b, nb, b).sum(dim=(1, 3))


def _greedy(mass: torch.Tensor, area: torch.Tensor, want: float) -> float:
    """Area of the fewest units, taken by mass per area, whose mass reaches `want`."""
    order = torch.argsort(mass / area, descending=True)
    need = int((mass[order].cumsum(0) < want - 1e-9).sum()) + 1
    return float(area[order][:need].sum())


def block_bounds(p: torch.Tensor, b: int, share: float) -> tuple[float, float]:
    """(`block<B>`, `block<B>_rows`) densities (see the module doc)."""
    n = p.shape[0]
    mass, area = _tiles(p, b)
    ok = area > 0
    whole = _greedy(mass[ok], area[ok], share * n) / _causal(n)
    total = 0.0
    for i in range(mass.shape[0]):
        keep = area[i] > 0
        m, a = mass[i][keep], area[i][keep]
        order = torch.argsort(m, descending=True)
        rows = min(b, n - i * b)
        need = int((m[order].cumsum(0) < share * rows - 1e-9).sum()) + 1
        total += float(a[order][:need].sum())
    return whole, total / _causal(n)


def stripes_bound(p: torch.Tensor, b: int, share: float) -> float:
    """`stripes<B>` density: (query block of `b` rows, key) stripes (see the module doc)."""
    n = p.shape[0]
    nb = -(-n // b)
    pad = torch.zeros(nb * b, n, dtype=p.dtype)
    pad[:n] = p
    mass = pad.view(nb, b, n).sum(dim=1).flatten()
    end = torch.clamp(torch.arange(1, nb + 1) * b, max=n)  # one past each block's last row
    first = torch.maximum(torch.arange(nb)[:, None] * b, torch.arange(n)[None, :])
    area = (end[:, None] - first).clamp(min=0).flatten().double()
    ok = area > 0
    return _greedy(mass[ok], area[ok], share * n) / _causal(n)


def lines_bound(p: torch.Tensor, share: float) -> dict[str, float]:
    """`lines`: the least area of (top `v` columns) + (top `s` diagonals) holding mean recall
    `share`, exact union mass and area over every (v, s); returns density, v and s."""
    n = p.shape[0]
    c = torch.arange(n)
    rows = c[:, None] + c[None, :]  # entry [c, s] is p[c + s, c]: column c on diagonal s
    valid = rows < n
    m = p[rows.clamp(max=n - 1), c[:, None].expand(n, n)] * valid
    col_mass, diag_mass = m.sum(dim=1), m.sum(dim=0)
    cols = torch.argsort(col_mass, descending=True)
    diags = torch.argsort(diag_mass, descending=True)
    zero = torch.zeros(1, dtype=torch.float64)
    col_cum = torch.cat([zero, col_mass[cols].cumsum(0)])
    diag_cum = torch.cat([zero, diag_mass[diags].cumsum(0)])
    lengths = (n - c).double()
    col_area = torch.cat([zero, lengths[cols].cumsum(0)])
    diag_area = torch.cat([zero, lengths[diags].cumsum(0)])
    both = torch.zeros(n + 1, n + 1, dtype=torch.float64)
    both[1:, 1:] = m[cols][:, diags].cumsum(0).cumsum(1)
    mass = col_cum[:, None] + diag_cum[None, :] - both
    both.zero_()
    both[1:, 1:] = valid[cols][:, diags].double().cumsum(0).cumsum(1)
    area = col_area[:, None] + diag_area[None, :] - both
    area = torch.where(mass >= share * n - 1e-9, area, math.inf)
    best = int(torch.argmin(area))
    v, s = divmod(best, n + 1)
    return {"density": float(area.flatten()[best]) / _causal(n), "vertical": v, "slash": s}


# The line budgets `vs_lines_bound` tries: 0 and a geometric grid (x 1.25) up to N.
def _line_budgets(n: int) -> list[int]:
    out, x = [0], 1.0
    while x < n:
        out.append(int(round(x)))
        x *= 1.25
    return sorted(set(out + [n]))


def vs_lines_bound(p: torch.Tensor, share: float, block: int) -> dict[str, float]:
    """`vslines<B>`: vertical-slash's unit with an ideal estimate. The top `v` columns and top `s`
    diagonals by their true mass over every row (where the estimator sees only the last
    queries), indexed as the method's Alg. 4 does (a kept diagonal keeps every `B x B` key
    block it touches in a query block; a kept column outside those blocks is a column of the
    query block), the least density over a `(v, s)` grid (`_line_budgets`) reaching mean
    recall `share`. Against `lines` (the same lines, diagonals at token level) it measures
    what the block cover of the diagonals costs; against a calibrated vertical-slash, what
    its estimate costs."""
    n = p.shape[0]
    nb = -(-n // block)
    c = torch.arange(n)
    col_mass = p.sum(dim=0)
    diag = (c[:, None] - c[None, :]).clamp(min=0)  # offset row - col (non-causal entries are 0 in p)
    diag_mass = torch.zeros(n, dtype=torch.float64).index_add_(0, diag.flatten(), p.flatten())
    cols = torch.argsort(col_mass, descending=True)
    diags = torch.argsort(diag_mass, descending=True)
    mass, area = _tiles(p, block)  # [Qb, Kb] tile mass and causal area
    pad = torch.zeros(nb * block, n, dtype=p.dtype)
    pad[:n] = p
    col_q = pad.view(nb, block, n).sum(dim=1)  # [Qb, N] each column's mass per query block
    end = torch.clamp(torch.arange(1, nb + 1) * block, max=n)
    col_area = (end[:, None] - torch.maximum(torch.arange(nb)[:, None] * block, c[None, :])).clamp(min=0).double()
    r0 = torch.arange(nb)[:, None] * block
    lo = (r0 - c[None, :]).clamp(0, n)
    hi = (torch.clamp(r0 + block, max=n) - c[None, :]).clamp(0, n)
    key_block = c // block
    best = {"density": 1.0, "vertical": n, "slash": n}
    for s in _line_budgets(n):
        kept = torch.zeros(n + 1, dtype=torch.int64)
        kept[diags[:s]] = 1
        below = torch.cat([torch.zeros(1, dtype=torch.int64), kept[:n].cumsum(0)])
        reached = (below[hi] - below[lo]) > 0  # [Qb, N] keys a kept diagonal reaches per query block
        blocks = torch.zeros(nb, nb * block, dtype=torch.bool)
        blocks[:, :n] = reached
        blocks = blocks.view(nb, nb, block).any(dim=-1)
        block_mass, block_area = float((mass * blocks).sum()), float((area * blocks).sum())
        outside = ~blocks[:, key_block]  # [Qb, N] columns not inside a kept block
        gain_mass = (col_q * outside)[:, cols].sum(dim=0).cumsum(0)
        gain_area = (col_area * outside)[:, cols].sum(dim=0).cumsum(0)
        total = torch.cat([torch.zeros(1, dtype=torch.float64), gain_mass]) + block_mass
        room = torch.cat([torch.zeros(1, dtype=torch.float64), gain_area]) + block_area
        # The fewest columns reaching the share (more columns only add area).
        v = next((v for v in _line_budgets(n) if float(total[v]) >= share * n - 1e-9), None)
        if v is not None and float(room[v]) / _causal(n) < best["density"]:
            best = {"density": float(room[v]) / _causal(n), "vertical": v, "slash": s}
    return best


def head_bounds(p: torch.Tensor, share: float, *, blocks: list[int], stripes: list[int], lines: bool,
                oracles: bool = True, vs_blocks: list[int] | None = None) -> dict[str, Any]:
    """Every bound of one head's causal softmax `p` (see the module doc)."""
    out: dict[str, Any] = {}
    if oracles:
        out["row"], out["mean"] = row_bound(p, share), mean_bound(p, share)
    for b in blocks:
        out[f"block{b}"], out[f"block{b}_rows"] = block_bounds(p, b, share)
    for b in stripes:
        out[f"stripes{b}"] = stripes_bound(p, b, share)
    if lines:
        out["lines"] = lines_bound(p, share)
    for b in vs_blocks or []:
        out[f"vslines{b}"] = vs_lines_bound(p, share, b)
    return out


def layer_means(heads: list[dict[str, Any]]) -> dict[str, float]:
    """The mean over heads of every bound (`lines` by its density)."""
    keys = list(heads[0])
    return {key: sum(h[key]["density"] if isinstance(h[key], dict) else h[key] for h in heads) / len(heads)
            for key in keys}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `sparseprefill eval granularity`."""
    parser.add_argument("--qkv", type=Path, required=True, help="capture (sparseprefill eval capture)")
    parser.add_argument("--layers", type=int, nargs="+", required=True, help="captured layers to use")
    parser.add_argument("--seqlen", type=int, default=4096, help="the first tokens used (default 4096)")
    parser.add_argument("--share", type=float, default=0.95, help="the mass share (default 0.95)")
    parser.add_argument("--blocks", type=int, nargs="*", default=[128, 64, 32, 16], help="tile sizes")
    parser.add_argument("--stripes", type=int, nargs="*", default=[128],
                        help="query-block heights of the stripes bound (none: skip)")
    parser.add_argument("--no-lines", action="store_true", help="skip the lines bound (N^2 memory per head)")
    parser.add_argument("--vs-blocks", type=int, nargs="*", default=[],
                        help="block sizes of the vertical-slash unit bound (vslines<B>: ideal lines, diagonals "
                             "covered by B x B blocks as the method's index does; default none)")
    parser.add_argument("--no-oracles", action="store_true", help="skip the row and mean oracles")
    parser.add_argument("--json", type=Path, required=True, help="per layer and head (rewritten after each layer)")


def run(args: argparse.Namespace) -> int:
    """Entry point of `sparseprefill eval granularity`."""
    from .layer_stats import load_captures
    from .reference._checks import check_fraction, resolve_scale
    from .runlog import Progress

    try:
        check_fraction("--share", args.share)
        if args.seqlen < 1:
            raise ValueError(f"--seqlen must be >= 1, got {args.seqlen}")
        caps = load_captures([args.qkv], layers=args.layers, max_seqlen=args.seqlen)
    except (TypeError, ValueError, OSError) as exc:
        print(f"sparseprefill eval granularity: {exc}", file=sys.stderr)
        return 2
    out: dict[str, Any] = {"qkv": str(args.qkv), "seqlen": caps[0].seqlen, "share": args.share, "layers": {}}
    progress = Progress(sum(int(c.q.shape[1]) for c in caps), what="head")
    lines = ["| layer | " + " | ".join(["row", "mean"] * (not args.no_oracles)
                                       + [x for b in args.blocks for x in (f"block{b}", f"block{b}_rows")]
                                       + [f"stripes{b}" for b in args.stripes] + ["lines"] * (not args.no_lines)
                                       + [f"vslines{b}" for b in args.vs_blocks])
             + " |"]
    lines.append("| --- " * (lines[0].count("|") - 1) + "|")
    for cap in caps:
        started = time.perf_counter()
        q, k = cap.q[0], cap.k[0]
        scale = resolve_scale(cap.scale, int(q.shape[-1]))
        hq, hkv = int(q.shape[0]), int(k.shape[0])
        heads = []
        for h in range(hq):
            p = head_probs(q[h], k[h // (hq // hkv)], scale)
            heads.append(head_bounds(p, args.share, blocks=args.blocks, stripes=args.stripes,
                                     lines=not args.no_lines, oracles=not args.no_oracles,
                                     vs_blocks=args.vs_blocks))
            progress.step(f"layer {cap.layer} head {h}")
        out["layers"][str(cap.layer)] = heads
        means = layer_means(heads)
        lines.append(f"| {cap.layer} | " + " | ".join(f"{v:.4f}" for v in means.values()) + " |")
        print(f"layer {cap.layer} ({time.perf_counter() - started:.0f} s): "
              + " ".join(f"{key} {v:.4f}" for key, v in means.items()), file=sys.stderr, flush=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1))
    print(f"mean density over heads at share {args.share} (N = {caps[0].seqlen}):")
    print("\n".join(lines))
    return 0
