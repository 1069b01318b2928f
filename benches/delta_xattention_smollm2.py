"""DeltaXAttention on real attention: SmolLM2-135M layers captured at 8K (CPU, float64).

For each captured layer: XAttention's tile weights (stride 8, 128-token tiles) and its
greedy selection at a few thresholds, then on those tiles

* XAttention alone (every selected tile exact), over a threshold grid: the curve to
  compare with at matched density;
* DeltaXAttention (thesis 4.2): per-tile Delta-KV packing (cosine thresholds), the
  diagonal exact, `exact_top` in {0 ("diag kept"), 0.1 ("tw10")} of the selected
  off-diagonal tiles exact, the rest packed; `unselected="packed"` with `exact_top`
  0.1 ("tw10 fill": unselected tiles packed instead of dropped), and the lead's
  sketch (`exact_top=1`, `unselected="packed"`: every selected tile exact, every
  unselected causal tile packed);
* the thesis's ablation (4.2.2): XAttention skipping its lightest off-diagonal tiles
  (`skip_tiles`, which keeps XAttention's forced first tile), a grid of fractions,
  interpolated at every DeltaXAttention row's KV reduction; and, to show why the first
  tile is kept, the literal reading that may skip it too (`"first_tile": "skippable"`);
* Delta-KV alone (`reference.delta_kv_attention`, chunks of 512, blocks of 128, the
  same cosine thresholds): the curve to compare with at matched density.

Columns: the thesis's KV reduction (keys loaded relative to XAttention's same tiles,
`f (1 - p)`), density (score entries computed over the causal area: the kernel's
work, the axis every method shares), the full-attention mass on exact tiles and on
computed tiles (exact + packed), and the relative output error against dense attention.

Outputs are computed tile by tile from the listed keys only (exact tiles' keys, packed
tiles' anchors with the log-count bias): the same arithmetic as
`reference.delta_xattention_attention`, which masks every key instead; the script checks
the two agree on the first 1024 tokens of every layer before it starts.

    python benches/delta_xattention_smollm2.py --qkv /work/captures/qkv_smollm2_8k.pt \\
        --json benches/results/cpu-smollm2-delta_xattention-2026-11-23.json \\
        --png docs/img/delta_xattention_smollm2.png
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from sparseprefill import reference
from sparseprefill.reference.delta_xattention import (
    EXACT,
    PACKED,
    SKIPPED,
    TilePackedKV,
    rank_off_diagonal,
    share_of,
    tile_modes,
)
from sparseprefill.reference.plan import cdiv

BLOCK, STRIDE, PACKED_BLOCK = 128, 8, 32
X_GRID = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98)
DX_THRESHOLDS = (0.8, 0.9, 0.95)
COSINE = (0.95, 0.9, 0.85, 0.8, 0.75)
VARIANTS = (("diag", 0.0, "skip"), ("tw10", 0.1, "skip"), ("tw10 fill", 0.1, "packed"),
            ("sketch", 1.0, "packed"))
SKIPS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
DELTA_KV = (0.95, 0.9, 0.85, 0.8, 0.75, 0.7)


def tile_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, modes: torch.Tensor,
                 packing: TilePackedKV | None, scale: float) -> torch.Tensor:
    """float64 `[H, N, D]` of batch row 0: each row over its exact tiles' keys (causal) and its
    packed tiles' anchors (`+ log count`), one softmax; `packing` None means no packed tile."""
    _, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    t = cdiv(n, BLOCK)
    out = torch.empty(hq, n, d, dtype=torch.float64)
    for kv in range(hkv):
        keys, values = k[0, kv].double(), v[0, kv].double()
        if packing is not None and packing.tiles:
            rows = packing.region(0, kv)
            ak, av = packing.packed.k[rows].double(), packing.packed.v[rows].double()
            bias = torch.log(packing.packed.counts[rows].double())
            first, count = packing.tile_blocks()
            seg = [(int(first[0, kv, j]) * PACKED_BLOCK, int(first[0, kv, j] + count[0, kv, j]) * PACKED_BLOCK)
                   for j in range(packing.tiles)]
        for h in range(kv * g, (kv + 1) * g):
            for i in range(t):
                r0, r1 = i * BLOCK, min(n, (i + 1) * BLOCK)
                m = modes[0, h, i]
                exact = [j for j in range(i + 1) if m[j] == EXACT]
                packed = [j for j in range(i) if m[j] == PACKED]
                ek = torch.cat([keys[j * BLOCK:min(n, (j + 1) * BLOCK)] for j in exact])
                ev = torch.cat([values[j * BLOCK:min(n, (j + 1) * BLOCK)] for j in exact])
                pos = torch.cat([torch.arange(j * BLOCK, min(n, (j + 1) * BLOCK)) for j in exact])
                qs = q[0, h, r0:r1].double()
                s = (qs @ ek.T * scale).masked_fill(pos[None, :] > torch.arange(r0, r1)[:, None], -math.inf)
                vals = ev
                if packed:
                    assert packing is not None
                    pk = torch.cat([ak[seg[j][0]:seg[j][1]] for j in packed])
                    pv = torch.cat([av[seg[j][0]:seg[j][1]] for j in packed])
                    pb = torch.cat([bias[seg[j][0]:seg[j][1]] for j in packed])
                    s = torch.cat([s, qs @ pk.T * scale + pb], dim=-1)
                    vals = torch.cat([ev, pv])
                out[h, r0:r1] = torch.softmax(s, dim=-1) @ vals
    return out


def skip_literal(weights: torch.Tensor, selected: torch.Tensor, skip: float) -> torch.Tensor:
    """`skip_tiles` with the first key tile a candidate too (the literal reading of 4.2.2)."""
    b, h, t, _ = weights.shape
    order, n = rank_off_diagonal(weights, selected, first=True)
    pos = torch.arange(t * t)
    dropped = (pos >= (n - share_of(skip, n)).unsqueeze(-1)) & (pos < n.unsqueeze(-1))
    gone = torch.zeros(b, h, t * t, dtype=torch.bool).scatter_(-1, order, dropped)
    return selected & ~gone.view(b, h, t, t)


def row_tile_mass(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 `[H, N, T]`: every row's full-attention probability on every key tile."""
    _, hq, n, _ = q.shape
    g = hq // k.shape[1]
    t = cdiv(n, BLOCK)
    key_tile = torch.arange(n) // BLOCK
    mass = torch.zeros(hq, n, t, dtype=torch.float64)
    kk = k[0].double().repeat_interleave(g, dim=0)
    for r0 in range(0, n, 512):
        r1 = min(n, r0 + 512)
        s = q[0, :, r0:r1].double() @ kk.transpose(-1, -2) * scale
        s = s.masked_fill(torch.arange(n)[None, :] > torch.arange(r0, r1)[:, None], -math.inf)
        mass[:, r0:r1] = torch.zeros(hq, r1 - r0, t, dtype=torch.float64).index_add_(
            -1, key_tile, torch.softmax(s, dim=-1))
    return mass


def masses(modes: torch.Tensor, mass: torch.Tensor) -> tuple[float, float]:
    """(mean mass on exact tiles, mean mass on computed tiles), mean over heads and rows."""
    n = mass.shape[1]
    m = modes[0][:, torch.arange(n) // BLOCK]  # [H, N, T]
    return float((mass * (m == EXACT)).sum(-1).mean()), float((mass * (m != SKIPPED)).sum(-1).mean())


def interpolate(x: float, xs: list[float], ys: list[float]) -> float | None:
    """Linear interpolation of `ys` at `x` on the points `(xs, ys)`; None outside their range."""
    pts = sorted(zip(xs, ys))
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def check_against_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> float:
    """`tile_outputs` against `reference.delta_xattention_attention` on the first 1024 tokens."""
    qs, ks, vs = q[:, :, :1024], k[:, :, :1024], v[:, :, :1024]
    modes = reference.delta_xattention_tiles(qs, ks, stride=STRIDE, threshold=0.9, exact_top=0.1, block=BLOCK,
                                             scale=scale)
    packing = reference.delta_tile_pack(ks, vs, delta_threshold=0.85, metric="cosine", block=BLOCK,
                                        packed_block=PACKED_BLOCK)
    want = reference.delta_xattention_attention(qs.double(), ks.double(), vs.double(), modes,
                                                reference.delta_tile_pack(ks.double(), vs.double(),
                                                                          delta_threshold=0.85, metric="cosine",
                                                                          block=BLOCK, packed_block=PACKED_BLOCK),
                                                scale=scale)
    got = tile_outputs(qs, ks, vs, modes, packing, scale)
    err = float((got - want[0]).abs().max())
    assert err < 1e-5, f"tile_outputs differs from the reference by {err}"
    return err


def run_layer(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> dict[str, Any]:
    started = time.time()
    check = check_against_reference(q, k, v, scale)
    n = q.shape[2]
    t = cdiv(n, BLOCK)
    exact_out = reference.attention(q.double(), k.double(), v.double(), scale=scale)[0]
    mass = row_tile_mass(q, k, scale)
    weights = reference.xattention_tile_weights(q, k, stride=STRIDE, block=BLOCK, scale=scale)
    print(f"layer {layer}: dense, tile masses and weights in {time.time() - started:.0f} s", flush=True)

    def err(out: torch.Tensor) -> float:
        return reference.relative_error(out, exact_out)

    def loads(modes: torch.Tensor) -> torch.Tensor:
        # Keys an exact or packed tile would load in full: per head, the plain XAttention cost.
        size = (n - torch.arange(t) * BLOCK).clamp(max=BLOCK).double()
        return ((modes[0] != SKIPPED).double() * size).sum(dim=(-2, -1))

    xatt, dx, skips, dkv = [], [], [], []
    for thr in sorted(set(X_GRID) | set(DX_THRESHOLDS)):
        selected = reference.select_tiles(weights, thr)
        modes = tile_modes(selected, selected, "skip")
        exact_mass, _ = masses(modes, mass)
        xatt.append({"threshold": thr, "density": _density(modes, n), "recall": exact_mass,
                     "output_error": err(tile_outputs(q, k, v, modes, None, scale))})
        if thr not in DX_THRESHOLDS:
            continue
        base_loads = loads(modes)
        for first, skip_fn in (("kept", reference.skip_tiles), ("skippable", skip_literal)):
            for frac in SKIPS:
                kept = skip_fn(weights, selected, frac)
                m = tile_modes(kept, kept, "skip")
                skips.append({"threshold": thr, "skip": frac, "first_tile": first,
                              "kv_reduction": float((1 - loads(m) / base_loads).mean()),
                              "density": _density(m, n), "recall": masses(m, mass)[0],
                              "output_error": err(tile_outputs(q, k, v, m, None, scale))})
        for cos in COSINE:
            packing = reference.delta_tile_pack(k, v, delta_threshold=cos, metric="cosine", block=BLOCK,
                                                packed_block=PACKED_BLOCK)
            for variant, top, unselected in VARIANTS:
                modes = tile_modes(selected, reference.exact_tiles(weights, selected, top), unselected)
                exact_mass, covered = masses(modes, mass)
                red = float(reference.delta_xattention_kv_reduction(modes, packing).mean())
                row = {"threshold": thr, "cosine": cos, "variant": variant, "exact_top": top,
                       "unselected": unselected, "keep_ratio": float(packing.keep_ratio().mean()),
                       "kv_reduction": red,
                       "density": float(reference.delta_xattention_density(modes, packing).mean()),
                       "packed_tiles": float((modes == PACKED).sum()) / float((modes != SKIPPED).sum()),
                       "exact_mass": exact_mass, "covered_mass": covered,
                       "output_error": err(tile_outputs(q, k, v, modes, packing, scale))}
                dx.append(row)
                print(json.dumps({"layer": layer, **row}), flush=True)
    for cos in DELTA_KV:
        keep = reference.delta_keep_mask(k, threshold=cos, metric="cosine", chunk=512)
        packed = reference.delta_pack(k, v, keep, block=BLOCK)
        out = reference.delta_kv_attention(q, k, v, packed, block_m=BLOCK, scale=scale)
        dkv.append({"cosine": cos, "keep_ratio": float(packed.keep_ratio().mean()),
                    "density": float(reference.delta_kv_density(q, packed, block_m=BLOCK).mean()),
                    "output_error": err(out[0])})
    xd, xe = [r["density"] for r in xatt], [r["output_error"] for r in xatt]
    kd, ke = [r["density"] for r in dkv], [r["output_error"] for r in dkv]
    for row in dx:
        sk = [s for s in skips if s["threshold"] == row["threshold"] and s["first_tile"] == "kept"]
        row["skip_error_at_kv_reduction"] = interpolate(row["kv_reduction"], [s["kv_reduction"] for s in sk],
                                                        [s["output_error"] for s in sk])
        row["skip_density_at_kv_reduction"] = interpolate(row["kv_reduction"], [s["kv_reduction"] for s in sk],
                                                          [s["density"] for s in sk])
        row["xattention_error_at_density"] = interpolate(row["density"], xd, xe)
        row["delta_kv_error_at_density"] = interpolate(row["density"], kd, ke)
    return {"layer": layer, "seqlen": n, "check_max_abs": check, "xattention": xatt, "delta_xattention": dx,
            "tile_skip": skips, "delta_kv": dkv, "seconds": time.time() - started}


def _density(modes: torch.Tensor, n: int) -> float:
    """Causal pairs of the computed (all exact) tiles over the causal area, mean over heads."""
    t = modes.shape[-1]
    size = (n - torch.arange(t) * BLOCK).clamp(max=BLOCK).double()
    pairs = (size[:, None] * size[None, :]).tril(-1) + torch.diag(size * (size + 1) / 2)
    return float(((modes[0] != SKIPPED).double() * pairs).sum(dim=(-2, -1)).mean() / (n * (n + 1) / 2))


def plot(layers: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(layers), figsize=(5.4 * len(layers), 4.6), sharey=False)
    axes = [axes] if len(layers) == 1 else list(axes)
    for ax, layer in zip(axes, layers):
        xs = layer["xattention"]
        ax.plot([r["density"] for r in xs], [r["output_error"] for r in xs], "k-o", ms=3, label="XAttention s8")
        kv = layer["delta_kv"]
        ax.plot([r["density"] for r in kv], [r["output_error"] for r in kv], "C7--s", ms=3, label="Delta-KV alone")
        sk = [r for r in layer["tile_skip"] if r["threshold"] == 0.9 and r["first_tile"] == "kept"]
        ax.plot([r["density"] for r in sk], [r["output_error"] for r in sk], "C2:^", ms=3,
                label="XAttention 0.9 + tile skip")
        for (variant, color) in (("diag", "C1"), ("tw10", "C3"), ("tw10 fill", "C0"), ("sketch", "C4")):
            rows = [r for r in layer["delta_xattention"] if r["variant"] == variant and r["threshold"] == 0.9]
            ax.plot([r["density"] for r in rows], [r["output_error"] for r in rows], "-D", color=color, ms=3,
                    label=f"DeltaXAttention 0.9 {variant}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_title(f"SmolLM2-135M layer {layer['layer']}, N = {layer['seqlen']}")
        ax.set_xlabel("density (score entries over the causal area)")
    axes[0].set_ylabel("relative output error vs dense")
    axes[-1].legend(fontsize=7)
    fig.suptitle("DeltaXAttention (cosine 0.95 ... 0.75) against XAttention, its tile skip and Delta-KV")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(layers: list[dict[str, Any]]) -> str:
    lines = ["| layer | variant | cos | KV red. | density | exact mass | covered | error | skip error at KV red. | "
             "XAttention error at density | Delta-KV error at density |", "|" + " --- |" * 11]

    def f(x: float | None, fmt: str = ".4f") -> str:
        return "-" if x is None else format(x, fmt)

    for layer in layers:
        for r in layer["delta_xattention"]:
            if r["threshold"] != 0.9:
                continue
            lines.append(f"| {layer['layer']} | {r['variant']} | {r['cosine']} | {r['kv_reduction']:.3f} | "
                         f"{r['density']:.3f} | {r['exact_mass']:.3f} | {r['covered_mass']:.3f} | "
                         f"{r['output_error']:.4f} | {f(r['skip_error_at_kv_reduction'])} | "
                         f"{f(r['xattention_error_at_density'])} | {f(r['delta_kv_error_at_density'])} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qkv", type=Path, default=Path("/work/captures/qkv_smollm2_8k.pt"))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--layers", type=int, nargs="*", default=None)
    parser.add_argument("--max-seqlen", type=int, default=None, help="use only the first tokens")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    data = torch.load(args.qkv)
    layers = []
    for li, layer in enumerate(data["layers"]):
        if args.layers and layer not in args.layers:
            continue
        q, k, v = (data[x][li].float() for x in "qkv")
        if args.max_seqlen:
            q, k, v = (x[:, :, : args.max_seqlen] for x in (q, k, v))
        layers.append(run_layer(int(layer), q, k, v, float(data["scale"][li])))
        if args.json is not None:
            args.json.write_text(json.dumps({
                "capture": str(args.qkv), "block": BLOCK, "stride": STRIDE, "packed_block": PACKED_BLOCK,
                "backend": "reference (float64, CPU)", "layers": layers}, indent=1))
    print(summary(layers))
    if args.png is not None:
        plot(layers, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
