"""Why calibrated densities sit 5-21x above the oracle's (issue 25): granularity oracles.

For captured layers (the first `--seqlen` tokens), every query head's full causal
attention (all rows, float64) and the sparsest selection reaching a share under
several granularities:

* `row`: per row the fewest keys reaching `share` (the oracle `calibrate` reports);
* `mean`: the fewest entries of the whole head whose mass is `share` of the head's
  (the target `--target-recall` sets: mean recall, rows may fall below);
* `block<B>`: the fewest causal `B x B` tiles of the head reaching mean recall `share`
  (tiles by mass per area, greedy): the best any block method with `B` tiles can do
  against a mean-recall target;
* `block<B>_rows`: the same, but every query block must keep `share` of its rows' mass
  (what a per-query-block threshold, XAttention's, aims at);
* `stripes<B>`: per query block of `B` rows, any key columns (a stripe: one key over
  the block's rows, AnchorAttention's and SampleAttention's unit), the fewest stripe
  entries of the head reaching mean recall `share` (stripes by mass per causal area,
  greedy): the best a method choosing key columns per `B`-row query block can do;
* `lines`: whole columns and diagonals of the head (a vertical-slash method with
  single lines) reaching mean recall `share`, the best pair of counts on a grid of
  the top columns and top diagonals by mass.

Writes one JSON (per layer and head, densities) and prints the table of means.

    python benches/calib_granularity.py --qkv /work/captures/qkv_smollm2_8k_all.pt \
        --layers 0 3 9 14 20 27 --seqlen 4096 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch


def head_probs(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax `[N, N]` float64 of one head (q, k `[N, D]`)."""
    n = q.shape[0]
    s = (q.double() @ k.double().T) * scale
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    return torch.softmax(s.masked_fill(~mask, -math.inf), dim=-1)


def row_oracle(p: torch.Tensor, share: float) -> float:
    n = p.shape[0]
    cum = torch.sort(p, dim=-1, descending=True).values.cumsum(dim=-1)
    need = ((cum < share - 1e-12).sum(dim=-1) + 1).clamp(max=torch.arange(1, n + 1))
    return float(need.sum()) / (n * (n + 1) / 2)


def mean_oracle(p: torch.Tensor, share: float) -> float:
    n = p.shape[0]
    flat = torch.sort(p.flatten(), descending=True).values
    need = int((flat.cumsum(0) < share * n - 1e-9).sum()) + 1
    return need / (n * (n + 1) / 2)


def tile_sums(p: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mass, causal area) of every `b x b` tile, `[Qb, Kb]`."""
    n = p.shape[0]
    nb = -(-n // b)
    pad = torch.zeros(nb * b, nb * b, dtype=p.dtype)
    pad[:n, :n] = p
    mass = pad.view(nb, b, nb, b).sum(dim=(1, 3))
    ones = torch.zeros(nb * b, nb * b)
    ones[:n, :n] = torch.ones(n, n).tril()
    area = ones.view(nb, b, nb, b).sum(dim=(1, 3)).double()
    return mass, area


def block_oracle(p: torch.Tensor, b: int, share: float) -> tuple[float, float]:
    """(mean-target tile oracle, per-query-block tile oracle) densities."""
    n = p.shape[0]
    mass, area = tile_sums(p, b)
    causal = n * (n + 1) / 2
    ok = area > 0
    m, a = mass[ok], area[ok]
    order = torch.argsort(m / a, descending=True)
    cum = m[order].cumsum(0)
    need = int((cum < share * n - 1e-9).sum()) + 1
    mean_d = float(a[order][:need].sum()) / causal
    # Per query block: its rows' mass, the fewest tiles (by mass, all causal tiles
    # of a block row have area b*b but the diagonal one) reaching `share` of it.
    total = 0.0
    for i in range(mass.shape[0]):
        rows = min(b, n - i * b)
        mi, ai = mass[i], area[i]
        sel = ai > 0
        mi, ai = mi[sel], ai[sel]
        o = torch.argsort(mi, descending=True)
        c = mi[o].cumsum(0)
        k = int((c < share * rows - 1e-9).sum()) + 1
        total += float(ai[o][:k].sum())
    return mean_d, total / causal


def stripes_oracle(p: torch.Tensor, b: int, share: float) -> float:
    """Density of the fewest (query block of `b` rows, key) stripes reaching mean recall
    `share`, greedy by mass per causal area (the causal rows of the block at that key)."""
    n = p.shape[0]
    nb = -(-n // b)
    pad = torch.zeros(nb * b, n, dtype=p.dtype)
    pad[:n] = p
    mass = pad.view(nb, b, n).sum(dim=1).flatten()
    last = torch.clamp(torch.arange(1, nb + 1) * b, max=n)  # one past the block's last row
    area = (last[:, None] - torch.maximum(torch.arange(nb)[:, None] * b, torch.arange(n)[None, :])).clamp(min=0)
    area = area.flatten().double()
    ok = area > 0
    m, a = mass[ok], area[ok]
    order = torch.argsort(m / a, descending=True)
    need = int((m[order].cumsum(0) < share * n - 1e-9).sum()) + 1
    return float(a[order][:need].sum()) / (n * (n + 1) / 2)


def lines_oracle(p: torch.Tensor, share: float) -> dict[str, float]:
    """Whole columns and diagonals: the least area reaching mean recall `share` over every
    pair (top `v` columns by mass, top `s` diagonals by mass), exact union mass and area."""
    n = p.shape[0]
    causal = n * (n + 1) / 2
    c = torch.arange(n)
    r = c[:, None] + c[None, :]  # M[c, s] = p[c + s, c]: column c, diagonal offset s
    valid = r < n
    m = p[r.clamp(max=n - 1), c[:, None].expand(n, n)] * valid
    col_mass, diag_mass = m.sum(dim=1), m.sum(dim=0)
    cols = torch.argsort(col_mass, descending=True)
    diags = torch.argsort(diag_mass, descending=True)
    col_cum = torch.cat([torch.zeros(1, dtype=p.dtype), col_mass[cols].cumsum(0)])
    diag_cum = torch.cat([torch.zeros(1, dtype=p.dtype), diag_mass[diags].cumsum(0)])
    lengths = (n - c).double()
    col_area = torch.cat([torch.zeros(1, dtype=torch.float64), lengths[cols].cumsum(0)])
    diag_area = torch.cat([torch.zeros(1, dtype=torch.float64), lengths[diags].cumsum(0)])
    sub = m[cols][:, diags]
    over = torch.zeros(n + 1, n + 1, dtype=p.dtype)
    over[1:, 1:] = sub.cumsum(0).cumsum(1)
    del sub
    mass = col_cum[:, None] + diag_cum[None, :] - over
    del over
    suba = valid[cols][:, diags].double()
    over_a = torch.zeros(n + 1, n + 1, dtype=torch.float64)
    over_a[1:, 1:] = suba.cumsum(0).cumsum(1)
    del suba
    area = col_area[:, None] + diag_area[None, :] - over_a
    area = torch.where(mass >= share * n - 1e-9, area, math.inf)
    best = int(torch.argmin(area))
    v, s = divmod(best, n + 1)
    return {"density": float(area.flatten()[best]) / causal, "vertical": v, "slash": s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qkv", required=True)
    ap.add_argument("--layers", type=int, nargs="+", required=True)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--share", type=float, default=0.95)
    ap.add_argument("--blocks", type=int, nargs="*", default=[128, 64, 32, 16])
    ap.add_argument("--stripes", type=int, nargs="*", default=[128],
                    help="query-block heights of the stripes bound (none: skip)")
    ap.add_argument("--no-lines", action="store_true")
    ap.add_argument("--no-oracles", action="store_true",
                    help="skip the row and mean oracles (a run adding granularities to an earlier JSON)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    data: dict[str, Any] = torch.load(args.qkv, map_location="cpu")
    out: dict[str, Any] = {"qkv": args.qkv, "seqlen": args.seqlen, "share": args.share, "layers": {}}
    for li, layer in enumerate(data["layers"]):
        if int(layer) not in args.layers:
            continue
        t0 = time.time()
        q = data["q"][li][0, :, :args.seqlen]
        k = data["k"][li][0, :, :args.seqlen]
        scale = float(data["scale"][li]) if "scale" in data else 1 / math.sqrt(q.shape[-1])
        hq, hkv = q.shape[0], k.shape[0]
        heads = []
        for h in range(hq):
            p = head_probs(q[h], k[h // (hq // hkv)], scale)
            row: dict[str, Any] = {}
            if not args.no_oracles:
                row = {"row": row_oracle(p, args.share), "mean": mean_oracle(p, args.share)}
            for b in args.blocks:
                row[f"block{b}"], row[f"block{b}_rows"] = block_oracle(p, b, args.share)
            for b in args.stripes:
                row[f"stripes{b}"] = stripes_oracle(p, b, args.share)
            if not args.no_lines:
                row["lines"] = lines_oracle(p, args.share)
            heads.append(row)
            del p
        out["layers"][str(layer)] = heads
        keys = [key for key in heads[0] if key != "lines"]
        means = {key: sum(h[key] for h in heads) / hq for key in keys}
        if not args.no_lines:
            means["lines"] = sum(h["lines"]["density"] for h in heads) / hq
        print(f"layer {layer} ({time.time() - t0:.0f} s): " + " ".join(f"{key} {v:.4f}" for key, v in means.items()),
              flush=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
