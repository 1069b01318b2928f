"""`serving`: serving-shaped prefill: a packed mixed-length batch, chunked prefill, served shapes.

* `mixed`: sequences of `--lengths` tokens (default 4K + 16K + 60K) packed end to end,
  one `fast.varlen_attention` launch on per-sequence plans (`fast.varlen_plans` of the
  `--plan-methods`, default dense and vertical-slash, at their defaults for the longest),
  against the baseline run on each sequence in turn and our kernel per sequence; the
  output must equal the per-sequence outputs bit for bit (`extra["equal_to_per_sequence"]`).
* `chunked`: a prompt of each N cut into `--chunk`-token chunks (`plan.rows`: each chunk's
  queries against every key so far), the same methods' plans, against the same plan in
  one launch; the outputs must agree bit for bit (the same tiles in the same order).
* `shapes`: the kernel on the shapes users serve (`--shapes`: `serve64` B=2, 14/2 heads,
  D=64; `llama3_8b` 32/8/128; `qwen25_7b` 28/4/128) at each N: the baseline, our dense
  plan and random 5% plans of 128- and 64-blocks, with TFLOP/s on the computed area.

Inputs are random normal (timing does not depend on the values); each case's baseline is
measured on its own inputs in the same run.
"""

from __future__ import annotations

from typing import Any

import torch

from ..common import (
    BLOCK,
    Context,
    Option,
    Row,
    Suite,
    Unit,
    named_plan,
    piece,
    random_block_plan,
)

SHAPES: dict[str, tuple[int, int, int, int]] = {"serve64": (2, 14, 2, 64), "llama3_8b": (1, 32, 8, 128),
                                               "qwen25_7b": (1, 28, 4, 128)}


def _randn(shape: tuple[int, ...], ctx: Context, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device=ctx.device, dtype=ctx.dtype)


def _plans(names: list[str], n: int, block: int) -> list[tuple[str, Any, dict[str, Any]]]:
    """(name, `fast` plan function, parameters at N with `block`-sized blocks) per method."""
    from ...methods import get

    out = []
    for name in names:
        spec = get(name)
        params = spec.demo_params(n)
        if {"block_m", "block_n"} <= set(spec.parameters()):
            params.update(block_m=block, block_n=block)
        out.append((spec.name, spec.plan_fn("fast"), params))
    return out


def mixed_rows(ctx: Context, lengths: list[int], names: list[str], block: int) -> list[Row]:
    from ... import fast

    hq, hkv, d = ctx.q_heads, ctx.kv_heads, ctx.head_dim
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=ctx.device)
    q, k, v = (_randn((total, h, d), ctx, seed) for seed, h in enumerate((hq, hkv, hkv)))
    bounds = cu.tolist()
    def one(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
        return t[a:b].transpose(0, 1).unsqueeze(0)

    seqs = [(one(q, a, b), one(k, a, b), one(v, a, b)) for a, b in zip(bounds, bounds[1:])]
    dense_calls = [ctx.dense_attention(*s) for s in seqs]
    base = ctx.time(lambda: [f() for f in dense_calls])
    pairs = sum(n * (n + 1) / 2 for n in lengths) * hq
    rows = [ctx.row("mixed batch", ctx.baseline_name + " per sequence", max(lengths), ms=base, density=1.0,
                    baseline_ms=base, pairs=pairs, extra={"lengths": lengths})]
    for name, fn, params in _plans(names, max(lengths), block):
        plan = fast.varlen_plans(fn, q, k, cu, **params)
        plan_ms = ctx.time(lambda: fast.varlen_plans(fn, q, k, cu, **params))
        one_ms = ctx.time(lambda: fast.varlen_attention(q, k, v, cu, max(lengths), plan))
        per = [fn(s[0], s[1], **params) for s in seqs]
        per_ms = ctx.time(lambda: [fast.sparse_attention(s[0], s[1], s[2], p) for s, p in zip(seqs, per)])
        got = fast.varlen_attention(q, k, v, cu, max(lengths), plan)
        out = got if isinstance(got, torch.Tensor) else got[0]
        same = all(torch.equal(out[bounds[i]:bounds[i + 1]],
                               fast.sparse_attention(s[0], s[1], s[2], p)[0].transpose(0, 1))
                   for i, (s, p) in enumerate(zip(seqs, per)))
        dens = sum(float(fast.density(p).mean()) * n * (n + 1) / 2 for p, n in zip(per, lengths)) / (pairs / hq)
        rows.append(ctx.row(f"mixed batch {name}", "sparseprefill varlen", max(lengths), ms=one_ms + plan_ms,
                            plan_ms=plan_ms, kernel_ms=one_ms, density=dens, baseline_ms=base, pairs=pairs,
                            extra={"lengths": lengths, "per_sequence_ms": per_ms, "equal_to_per_sequence": same}))
        ctx.log(f"mixed {lengths} {name}: varlen {one_ms:.2f} ms, per sequence {per_ms:.2f} ms, baseline per "
                f"sequence {base:.2f} ms, bit-equal {same}")
    return rows


def chunked_rows(ctx: Context, n: int, chunk: int, names: list[str], block: int) -> list[Row]:
    from ... import fast

    q, k, v = (_randn((1, h, n, ctx.head_dim), ctx, seed + 10) for seed, h in
               enumerate((ctx.q_heads, ctx.kv_heads, ctx.kv_heads)))
    base = ctx.time(ctx.dense_attention(q, k, v))
    rows = []
    for name, fn, params in _plans(names, n, block):
        plan = fn(q, k, **params)
        step = -(-chunk // plan.block_m) * plan.block_m  # chunks start on query blocks
        parts = [(s, min(n, s + step), plan.rows(s, min(n, s + step))) for s in range(0, n, step)]
        one_ms = ctx.time(lambda: fast.sparse_attention(q, k, v, plan))
        chunks_ms = ctx.time(lambda: [fast.sparse_attention(q[:, :, a:b], k[:, :, :b], v[:, :, :b], p)
                                      for a, b, p in parts])
        whole = fast.sparse_attention(q, k, v, plan)
        same = all(torch.equal(fast.sparse_attention(q[:, :, a:b], k[:, :, :b], v[:, :, :b], p), whole[:, :, a:b])
                   for a, b, p in parts)
        rows.append(ctx.row(f"chunked {name} ({len(parts)} x {step})", "sparseprefill", n, ms=chunks_ms,
                            kernel_ms=chunks_ms, density=float(fast.density(plan).mean()), baseline_ms=base,
                            pairs=ctx.causal_pairs(n, batch=1),
                            extra={"one_shot_ms": one_ms, "chunks_vs_one_shot": chunks_ms / one_ms,
                                   "bit_equal": same}))
        ctx.log(f"chunked N={n} {name}: one shot {one_ms:.2f} ms, {len(parts)} chunks {chunks_ms:.2f} ms, "
                f"bit-equal {same}")
    return rows


def shape_rows(ctx: Context, n: int, shape_name: str) -> list[Row]:
    from ... import fast
    from ...methods import DENSE

    if shape_name not in SHAPES:
        raise ValueError(f"--shapes: unknown shape {shape_name!r}; shapes: {', '.join(SHAPES)}")
    b, hq, hkv, d = SHAPES[shape_name]
    q, k, v = (_randn((b, h, n, d), ctx, seed + 20) for seed, h in enumerate((hq, hkv, hkv)))
    pairs = ctx.causal_pairs(n, hq, b)
    base = ctx.time(ctx.dense_attention(q, k, v))
    label = f"{shape_name} (B={b}, {hq}/{hkv} heads, D={d})"
    rows = [ctx.row(label, ctx.baseline_name, n, ms=base, kernel_ms=base, density=1.0, baseline_ms=base, pairs=pairs,
                    head_dim=d)]
    big, small = (128, 64) if ctx.on_gpu else (32, 16)
    plans = [(DENSE, named_plan(DENSE, q, k)),
             (f"random 5% {big}x{big}", random_block_plan(b, hq, n, density=0.05, block_m=big, block_n=big,
                                                            device=q.device)),
             (f"random 5% {small}x{small}", random_block_plan(b, hq, n, density=0.05, block_m=small,
                                                              block_n=small, device=q.device))]
    for name, plan in plans:
        ms = ctx.time(lambda: fast.sparse_attention(q, k, v, plan))
        rows.append(ctx.row(f"{label} {name}", "sparseprefill", n, ms=ms, kernel_ms=ms,
                            density=float(fast.density(plan).mean()), baseline_ms=base, pairs=pairs, head_dim=d))
    return rows


def units(ctx: Context, seqlens: list[int], *, lengths: str | None = None, chunk: int | None = None,
          shapes: str = ",".join(SHAPES), parts: str = "mixed,chunked,shapes",
          plan_methods: str = "dense,vertical_slash",
          block: int | None = None) -> list[Unit]:
    size = block or (64 if ctx.on_gpu else 16)
    names = [m for m in plan_methods.split(",") if m]
    mix = [int(x) for x in (lengths or ("4096,16384,61440" if ctx.on_gpu else "48,80,112")).split(",") if x]
    step = chunk or (8192 if ctx.on_gpu else 32)
    chosen = [p for p in parts.split(",") if p]
    bad = set(chosen) - {"mixed", "chunked", "shapes"}
    if bad:
        raise ValueError(f"--parts: unknown parts {sorted(bad)} (mixed, chunked, shapes)")
    out: list[Unit] = []
    if "mixed" in chosen:
        out.append(piece(ctx, f"mixed {'+'.join(map(str, mix))}", max(mix), mixed_rows, ctx, mix, names, size))
    for n in seqlens:
        if "chunked" in chosen:
            out.append(piece(ctx, f"chunked x{step}", n, chunked_rows, ctx, n, step, names, size))
        if "shapes" in chosen:
            for name in filter(None, shapes.split(",")):
                out.append(piece(ctx, f"shape {name}", n, shape_rows, ctx, n, name))
    return out


SUITE = Suite(
    name="serving",
    about="a packed mixed-length batch vs cuDNN per sequence, chunked vs one-shot prefill, the kernel on "
          "served shapes",
    seqlens=(32768, 131072),
    units=units,
    options=(Option("--lengths", "lengths", str, None, "serving: the mixed batch's lengths (default 4096,16384,"
                                                       "61440)"),
             Option("--chunk", "chunk", int, None, "serving: chunked prefill's chunk (default 8192)"),
             Option("--shapes", "shapes", str, ",".join(SHAPES), f"serving: served shapes ({', '.join(SHAPES)})"),
             Option("--parts", "parts", str, "mixed,chunked,shapes", "serving: which parts run"),
             Option("--plan-methods", "plan_methods", str, "dense,vertical_slash",
                    "serving: the methods whose plans the mixed batch and chunked prefill run"),
             BLOCK),
)
