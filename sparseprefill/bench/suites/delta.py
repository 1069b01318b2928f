"""`delta`: Delta-KV and DeltaXAttention at chosen keep ratios, beside cuDNN SDPA on the same inputs.

Keys come in runs of near-duplicates (`runs_keys`: cosine about 0.999 within a run, about
0 across), so the keep ratio of the keep mask at cosine 0.95 is about 1 / run: each
`--runs` entry is one run length (`2`: keep ~0.5) or a pattern repeated along the keys
(`2/2/1`: 3 anchors per 5 keys, keep ~0.6). q and v are random normal. Per N and entry:
the baseline on these q, k, v, then every method that reads packed keys (its suite module
has `keep_params`: Delta-KV, DeltaXAttention) packing at the cosine `--threshold`, end to
end, with the keep
ratio, the density both phases compute (so `density x cuDNN` is the floor), the output's
error against the baseline, and on a GPU the CUDA time per kernel of one call
(torch.profiler: keep mask, packing, plans, the two phases).
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
    method_hook,
    piece,
    profiled_kernels,
)

RUNS = "2;3;2/2/1"


def runs_keys(n: int, d: int, kv_heads: int, run: tuple[int, ...], *, batch: int = 1, seed: int = 0,
              device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Keys `[B, Hkv, N, D]` in runs of near-duplicates: runs of the lengths `run`, repeated."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    runs = len(run) * -(-n // sum(run))
    lengths = torch.tensor(run).repeat(runs // len(run))
    base = torch.randn(batch, kv_heads, runs, d, generator=gen)
    k = base[:, :, torch.repeat_interleave(torch.arange(runs), lengths)[:n]]
    return (k + 0.03 * torch.randn(k.shape, generator=gen)).to(device=device, dtype=dtype)


def _parse_runs(text: str) -> list[tuple[int, ...]]:
    out = []
    for item in filter(None, (x.strip() for x in text.split(";"))):
        try:
            out.append(tuple(int(x) for x in item.split("/")))
        except ValueError:
            raise ValueError(f"--runs: expected run lengths like 2 or 2/2/1, got {item!r}") from None
    return out


def keep_settings(ctx: Context, n: int, threshold: float, block: int | None) -> list[tuple[str, dict[str, Any]]]:
    """(method, parameters) of every method whose suite module says how to pack its keys at a
    cosine threshold (`keep_params(n, threshold, block)`): the methods that read packed keys."""
    out = []
    for name in ctx.method_names():
        keep_params = method_hook(name, "keep_params")
        if keep_params is not None:
            out.append((name, keep_params(n, threshold, block)))
    return out


def run_rows(ctx: Context, n: int, run: tuple[int, ...], threshold: float, block: int | None) -> list[Row]:
    from ... import fast
    from ...methods import get

    gen = torch.Generator(device="cpu").manual_seed(n)
    q = torch.randn(ctx.batch, ctx.q_heads, n, ctx.head_dim, generator=gen).to(ctx.device, ctx.dtype)
    v = torch.randn(ctx.batch, ctx.kv_heads, n, ctx.head_dim, generator=gen).to(ctx.device, ctx.dtype)
    k = runs_keys(n, ctx.head_dim, ctx.kv_heads, run, batch=ctx.batch, seed=n, device=ctx.device, dtype=ctx.dtype)
    dense = ctx.dense_attention(q, k, v)
    base = ctx.time(dense)
    exact = dense()
    label = "/".join(map(str, run))
    keep = float(fast.delta_keep_mask(k, threshold=threshold, metric="cosine").float().mean())
    rows = [ctx.row(f"runs {label}", ctx.baseline_name, n, ms=base, kernel_ms=base, density=1.0, baseline_ms=base,
                    extra={"keep_ratio": keep})]
    for name, params in keep_settings(ctx, n, threshold, block):
        spec = get(name)
        call = spec.call_params(params, q)
        run_fn = spec.run_fn("fast")
        out = run_fn(q, k, v, **call)
        ms = ctx.time(lambda: run_fn(q, k, v, **call))
        view = spec.method_view("fast", q, k, v, call, with_recall=False)
        extra: dict[str, Any] = {"runs": label, "keep_ratio": keep, "threshold": threshold, "notes": view.notes,
                                 "rel_err_vs_baseline": float((out.float() - exact.float()).norm()
                                                              / exact.float().norm()),
                                 "nonfinite": int((~torch.isfinite(out)).sum())}
        kernels = profiled_kernels(lambda: run_fn(q, k, v, **call))
        if kernels is not None:
            extra["kernels"] = kernels
        rows.append(ctx.row(f"{name} runs {label}", "sparseprefill", n, ms=ms, density=float(view.density.mean()),
                            baseline_ms=base, extra=extra))
        ctx.log(f"N={n} runs {label} (keep {keep:.3f}): {name} {ms:.2f} ms vs {base:.2f} ms ({base / ms:.2f}x)")
    return rows


def units(ctx: Context, seqlens: list[int], *, runs: str = RUNS, threshold: float = 0.95,
          block: int | None = None) -> list[Unit]:
    size = block if block is not None else (None if ctx.on_gpu else 16)
    out: list[Unit] = []
    for n in seqlens:
        for run in _parse_runs(runs):
            label = "/".join(map(str, run))
            out.append(piece(ctx, f"runs {label}", n, run_rows, ctx, n, run, threshold, size))
    return out


SUITE = Suite(
    name="delta",
    about="Delta-KV and DeltaXAttention at chosen keep ratios (keys in runs of near-duplicates) beside cuDNN",
    seqlens=(32768, 131072, 262144),
    units=units,
    options=(Option("--runs", "runs", str, RUNS, "delta: key run lengths, ';'-separated (2: keep ~0.5; 2/2/1: "
                                                 "~0.6)"),
             Option("--threshold", "threshold", float, 0.95, "delta: the keep mask's cosine threshold"),
             BLOCK),
)
