"""`sparseprefill rates`: measure this GPU's kernel-path rates for the dense-fallback rule.

The break-even rule (`reference.dense_fallback`, docs/dense-fallback.md) compares each head's
modelled sparse kernel time with its share of dense attention. Its costs come from a
`RateTable`; this command measures one on the current CUDA device and writes it where the
rule looks first (`reference.dense_fallback.cache_path`: the user's cache folder, keyed by
the device name and the torch and triton versions), like an autotune cache. Without it the
rule uses the default table shipped with the package (an H200).

What is measured, per head dim, dtype, query tile (128 and 64 rows) and length (B = 1,
`--q-heads` / `--kv-heads`), each with `triton.testing.do_bench` (median) on random data:

* `sdpa_ps`: ONE torch SDPA call over every head, causal, GQA through `enable_gqa` (the
  call the rule offers when a whole layer goes dense; no call on a subset of heads is
  made, so none is measured);
* `dense_ps`: our kernel on the dense plan (what a head whose lists are written full costs
  in a launch with the sparse heads);
* `block_ps`, `program_us`: our kernel on two random block plans (about 5% and 20% of the
  causal blocks, the diagonal always kept): the slope and intercept of time against the
  pairs the rule counts (`reference.dense_fallback.plan_pairs`), the intercept over the
  programs (query tiles) of the launch;
* `columns_ps`: our kernel on a column plan (2% random key columns shared by every query
  block of a head, the diagonal block listed), its time less the programs' fixed cost
  and the block pairs' time, over its column pairs as the rule counts them (so the
  column path's own fixed cost lands in it: at 8K, where the plan holds few columns,
  that makes it several times the block rate);
* `ragged_ps`: not measured (the packed-key launcher needs a packing); taken as
  `dense_ps / 0.83`, the ratio measured for Delta-KV's phase 1 (docs/plan-and-kernels.md).

Run it once per machine (about 2-4 minutes on an H200 with the default lengths); `--print`
shows the table in force without measuring.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

DEFAULT_SEQLENS = (8192, 32768, 131072)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `sparseprefill rates`."""
    parser.add_argument("--seqlens", type=int, nargs="+", default=list(DEFAULT_SEQLENS),
                        help="lengths to measure (default 8192 32768 131072)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], help="head dims (default 64 128)")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=("bfloat16", "float16"),
                        help="dtypes (default bfloat16; float16 runs at the same rates, it is copied from it "
                             "when not measured)")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None,
                        help="also write the table here (default: only the cache file)")
    parser.add_argument("--no-cache", action="store_true", help="do not write the cache file")
    parser.add_argument("--print", dest="print_only", action="store_true",
                        help="print the table the rule would use on this device and exit")


def _causal_pairs(n: int) -> int:
    return n * (n + 1) // 2


def _random_block_plan(b: int, h: int, n: int, tile: int, share: float, device: torch.device) -> Any:
    from .reference.plan import BlockColumnPlan, cdiv

    qb = cdiv(n, tile)
    gen = torch.Generator(device=device).manual_seed(int(share * 1000) + tile)
    keep = torch.rand(b, h, qb, qb, generator=gen, device=device) < share
    keep |= torch.eye(qb, dtype=torch.bool, device=device)
    return BlockColumnPlan.from_masks(keep, None, seqlen=n, block_m=tile, block_n=tile)


def _column_plan(b: int, h: int, n: int, tile: int, share: float, device: torch.device) -> Any:
    from .reference.plan import BlockColumnPlan, cdiv

    qb = cdiv(n, tile)
    gen = torch.Generator(device=device).manual_seed(7 + tile)
    picked = torch.rand(b, h, n, generator=gen, device=device) < share
    width = int(picked.sum(-1).max())
    order = torch.sort((~picked).to(torch.int8), dim=-1, stable=True).indices[..., :width].to(torch.int32)
    counts_all = picked.sum(-1, keepdim=True)
    cols = torch.where(torch.arange(width, device=device) < counts_all, order, n - 1)
    cols = torch.sort(cols, dim=-1).values
    last = (torch.arange(qb, device=device) + 1) * tile - 1
    count = torch.searchsorted(cols.contiguous(), last.clamp(max=n - 1).to(torch.int32).expand(b, h, qb).contiguous(),
                               right=True).to(torch.int32)
    count = torch.minimum(count, counts_all.to(torch.int32))
    diag = torch.arange(qb, dtype=torch.int32, device=device).view(1, 1, qb, 1).expand(b, h, qb, 1)
    return BlockColumnPlan(seqlen=n, block_m=tile, block_n=tile,
                           block_count=torch.ones(b, h, qb, dtype=torch.int32, device=device),
                           block_index=diag.contiguous(), column_count=count.contiguous(),
                           column_index=cols.unsqueeze(2).expand(b, h, qb, width)).validate()


def measure_point(n: int, d: int, dtype: torch.dtype, tile: int, *, q_heads: int, kv_heads: int,
                  device: torch.device) -> dict[str, float]:
    """One `RatePoint`'s fields measured at (N, D, dtype, tile); see the module doc."""
    import triton.testing

    from . import fast
    from .fast.kernels import block_column_attention
    from .reference.dense_fallback import plan_pairs
    from .reference.plan import cdiv

    def ms(fn: Any) -> float:
        rep = 200 if n <= 32768 else 1500
        return float(triton.testing.do_bench(fn, warmup=max(25, rep // 8), rep=rep))

    gen = torch.Generator(device=device).manual_seed(n + d)
    q = torch.randn(1, q_heads, n, d, generator=gen, device=device, dtype=dtype)
    k = torch.randn(1, kv_heads, n, d, generator=gen, device=device, dtype=dtype)
    v = torch.randn(1, kv_heads, n, d, generator=gen, device=device, dtype=dtype)
    causal = q_heads * _causal_pairs(n)
    sdpa_ms = ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    dense = fast.dense_plan(q, k, block_m=tile, block_n=tile)
    dense_ms = ms(lambda: block_column_attention(q, k, v, dense, validate_plan=False))
    programs = q_heads * cdiv(n, tile)
    pts = []
    for share in (0.05, 0.2):
        plan = _random_block_plan(1, q_heads, n, tile, share, device)
        pairs = float(plan_pairs(plan)[0].sum())
        pts.append((pairs, ms(lambda plan=plan: block_column_attention(q, k, v, plan, validate_plan=False))))
        del plan
    (p0, t0), (p1, t1) = pts
    slope = (t1 - t0) / (p1 - p0)
    program_ms = max(0.0, t0 - slope * p0) / programs
    cols = _column_plan(1, q_heads, n, tile, 0.02, device)
    block, column = plan_pairs(cols)
    cols_ms = ms(lambda: block_column_attention(q, k, v, cols, validate_plan=False))
    col_time = cols_ms - programs * program_ms - float(block.sum()) * slope
    columns_ps = max(slope, col_time / max(1.0, float(column.sum()))) * 1e9
    del cols, q, k, v
    torch.cuda.empty_cache()
    print(f"  N={n} D={d} {str(dtype).removeprefix('torch.')} tile {tile}: sdpa {sdpa_ms:.3f} ms, ours dense "
          f"{dense_ms:.3f} ms, blocks {t0:.3f} / {t1:.3f} ms (density {p0 / causal:.3f} / {p1 / causal:.3f}), "
          f"columns {cols_ms:.3f} ms (density {float(block.sum() + column.sum()) / causal:.3f})", file=sys.stderr)
    return {"block_ps": slope * 1e9, "columns_ps": columns_ps, "ragged_ps": dense_ms / causal * 1e9 / 0.83,
            "program_us": program_ms * 1e3, "sdpa_ps": sdpa_ms / causal * 1e9, "dense_ps": dense_ms / causal * 1e9}


def run(args: argparse.Namespace) -> int:
    """Measure (or print) the rates table of the current CUDA device; returns the exit code."""
    from .reference import dense_fallback as rule

    if not torch.cuda.is_available():
        print("sparseprefill rates: needs a CUDA device (the rule is off on the CPU)", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    if args.print_only:
        print(json.dumps(rule.device_rates(device).to_json(), indent=1))
        print(f"cache file: {rule.cache_path(device)}", file=sys.stderr)
        return 0
    import triton

    start = time.perf_counter()
    points = []
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for d in args.head_dims:
            for tile in (128, 64):
                for n in args.seqlens:
                    fields = measure_point(n, d, dtype, tile, q_heads=args.q_heads, kv_heads=args.kv_heads,
                                           device=device)
                    points.append(rule.RatePoint(n, d, name, tile, **fields))
    measured = {p.dtype for p in points}
    for other in ("bfloat16", "float16"):
        if other not in measured:
            points += [rule.RatePoint(p.seqlen, p.head_dim, other, p.tile, p.block_ps, p.columns_ps, p.ragged_ps,
                                      p.program_us, p.sdpa_ps, p.dense_ps) for p in list(points)
                       if p.dtype == next(iter(measured))]
    name = torch.cuda.get_device_name(device)
    table = rule.RateTable(device=name, source=f"sparseprefill rates, {time.strftime('%Y-%m-%d')}, "
                                              f"Hq {args.q_heads} / Hkv {args.kv_heads}",
                           points=tuple(points), torch_version=str(torch.__version__),
                           triton_version=str(triton.__version__))
    payload = json.dumps(table.to_json(), indent=1)
    if not args.no_cache:
        path = rule.cache_path(device)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(payload)
        rule.forget_cached_rates()
        print(f"wrote {path}", file=sys.stderr)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(payload)
    print(f"{'N':>7} {'D':>4} {'dtype':>9} {'tile':>4} {'block ps':>8} {'cols ps':>8} {'prog us':>8} "
          f"{'sdpa ps':>8} {'dense ps':>8}")
    for p in points:
        print(f"{p.seqlen:>7} {p.head_dim:>4} {p.dtype:>9} {p.tile:>4} {p.block_ps:8.3f} {p.columns_ps:8.3f} "
              f"{p.program_us:8.3f} {p.sdpa_ps:8.3f} {p.dense_ps:8.3f}")
    print(f"measured in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 0
