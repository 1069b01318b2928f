"""GPU benchmark: our kernels against cuDNN SDPA, flash SDPA and FlexAttention.

Every row is measured in the same run on the same inputs (random normal q, k, v,
never zeros): the median of `triton.testing.do_bench` after warm-up. Speedups are
quoted against cuDNN SDPA (causal), the fastest dense kernel on Hopper. TFLOP/s
counts `4 * D` flops per kept (query, key) pair of the causal area, so a sparse
row's rate is comparable to dense attention's rate on the area it computes.

Run `sparseprefill bench --help`; `pytest benches/` runs the same cases under
pytest-benchmark.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from .reference.plan import BlockColumnPlan, cdiv, mask_to_list


@dataclass
class Row:
    """One benchmark result."""

    method: str
    impl: str
    seqlen: int
    density: float
    recall_mean: float | None
    recall_min: float | None
    ms: float
    estimate_ms: float | None
    tflops: float
    speedup_vs_cudnn: float | None
    extra: dict[str, Any] = field(default_factory=dict)


def random_block_plan(
    batch: int, heads: int, seqlen: int, *, density: float, block_m: int, block_n: int,
    device: torch.device, seed: int = 0,
) -> BlockColumnPlan:
    """A plan keeping each causal key block with probability ~`density` (diagonal kept).

    Blocks are drawn independently per (batch, head, query block); the diagonal block
    is always kept so that no row is empty. No columns.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    qb, kb = cdiv(seqlen, block_m), cdiv(seqlen, block_n)
    last_row = ((torch.arange(qb) + 1) * block_m - 1).clamp(max=seqlen - 1)
    causal_count = last_row // block_n + 1
    keys = torch.rand(batch, heads, qb, kb, generator=gen) < density
    diag = torch.arange(kb)[None, :] == (last_row // block_n)[:, None]
    keys = (keys | diag) & (torch.arange(kb)[None, :] < causal_count[:, None])
    count, index = mask_to_list(keys)
    zero_cols = torch.zeros(batch, heads, qb, dtype=torch.int32)
    return BlockColumnPlan(
        seqlen=seqlen, block_m=block_m, block_n=block_n,
        block_count=count.to(device),
        block_index=index.to(device),
        column_count=zero_cols.to(device),
        column_index=torch.zeros(batch, heads, qb, 0, dtype=torch.int32, device=device),
    )


def flex_block_mask(plan: BlockColumnPlan) -> Any:
    """The same plan as a FlexAttention `BlockMask`, as a careful Flex user would write it.

    Blocks entirely below the diagonal go in the "full" lists (no mask_mod call), the
    rest in the partial lists with a causal mask_mod. Columns have no Flex form, so a
    plan with columns is expressed as a per-head set of key columns (the union of its
    column lists: exact for vertical-slash plans, whose columns are one vertical set
    minus the keys its blocks already cover): every key block holding such a column
    becomes a partial block whose mask_mod looks the column up.
    """
    from torch.nn.attention.flex_attention import BlockMask

    bm, bn, n = plan.block_m, plan.block_n, plan.seqlen
    qb, kb = plan.num_query_blocks, plan.num_key_blocks
    b, h = plan.batch, plan.num_heads
    dev = plan.device
    keep = plan.block_mask()
    first_row = (torch.arange(qb, device=dev) * bm).view(qb, 1)
    last_row = ((torch.arange(qb, device=dev) + 1) * bm - 1).clamp(max=n - 1).view(qb, 1)
    key_first = (torch.arange(kb, device=dev) * bn)[None, :]
    key_last = key_first + bn - 1
    below = (key_last <= first_row) & (key_last < n)
    is_full = keep & below
    is_part = keep & ~below
    vertical = torch.zeros(b, h, n + 1, dtype=torch.bool, device=dev)
    has_columns = plan.column_index.shape[3] > 0
    if has_columns:
        width = plan.column_index.shape[3]
        valid = torch.arange(width, device=dev) < plan.column_count.unsqueeze(-1)
        cols = torch.where(valid, plan.query_block_columns().to(torch.int64), n).reshape(b, h, -1)
        vertical.scatter_(2, cols, True)
        vblocks = torch.zeros(b, h, kb + 1, dtype=torch.bool, device=dev)
        vblocks.scatter_(2, torch.where(cols < n, cols // bn, kb), True)
        causal_blocks = key_first <= last_row
        is_part = is_part | (vblocks[:, :, None, :kb] & causal_blocks & ~is_full)
    vertical = vertical[..., :n]
    block_keep = keep

    def compact(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # As create_block_mask does: every row a permutation of the key blocks, kept first.
        order = torch.sort((~sel).to(torch.int8), dim=-1, stable=True).indices
        return sel.sum(-1).to(torch.int32), order.to(torch.int32).contiguous()

    pc, pi = compact(is_part)
    fc, fi = compact(is_full)

    if has_columns:
        def mask_mod(bi: Any, hi: Any, q_idx: Any, kv_idx: Any) -> Any:
            listed = block_keep[bi, hi, q_idx // bm, kv_idx // bn] | vertical[bi, hi, kv_idx]
            return (q_idx >= kv_idx) & listed
    else:
        def mask_mod(bi: Any, hi: Any, q_idx: Any, kv_idx: Any) -> Any:
            return q_idx >= kv_idx

    return BlockMask.from_kv_blocks(pc, pi, fc, fi, BLOCK_SIZE=(bm, bn), mask_mod=mask_mod,
                                    seq_lengths=(n, n))


def bench_ms(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median"))


def run_suite(
    seqlens: list[int], *, batch: int = 1, q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16, flex: bool = True, with_recall: bool = True,
    log: Callable[[str], None] = print,
) -> list[Row]:
    """Run the kernel benchmark for each N; return the rows."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    from . import fast
    from .methods import DENSE

    dev = torch.device("cuda")
    rows: list[Row] = []
    flex_fn = None
    if flex:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            flex_fn = torch.compile(flex_attention, dynamic=False)
        except Exception as exc:  # pragma: no cover - depends on the torch build
            log(f"FlexAttention unavailable: {exc}")
    for n in seqlens:
        torch.manual_seed(n)
        q = torch.randn(batch, q_heads, n, head_dim, device=dev, dtype=dtype)
        k = torch.randn(batch, kv_heads, n, head_dim, device=dev, dtype=dtype)
        v = torch.randn(batch, kv_heads, n, head_dim, device=dev, dtype=dtype)
        causal_pairs = batch * q_heads * n * (n + 1) / 2
        dense_flops = 4 * head_dim * causal_pairs
        # SDPA baselines see K/V expanded to the query heads (outside the timed region).
        g = q_heads // kv_heads
        ke = k.repeat_interleave(g, 1)
        ve = v.repeat_interleave(g, 1)

        def sdpa(backend: SDPBackend) -> Callable[[], Any]:
            def f() -> Any:
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
            return f

        cudnn_ms = bench_ms(sdpa(SDPBackend.CUDNN_ATTENTION))
        ref_out = sdpa(SDPBackend.CUDNN_ATTENTION)()
        rows.append(Row("dense", "cuDNN SDPA", n, 1.0, 1.0, 1.0, cudnn_ms, None,
                        dense_flops / cudnn_ms / 1e9, 1.0))
        try:
            flash_ms = bench_ms(sdpa(SDPBackend.FLASH_ATTENTION))
            rows.append(Row("dense", "flash SDPA", n, 1.0, 1.0, 1.0, flash_ms, None,
                            dense_flops / flash_ms / 1e9, cudnn_ms / flash_ms))
        except RuntimeError as exc:
            log(f"flash SDPA failed at N={n}: {exc}")
        log(f"N={n}: cuDNN {cudnn_ms:.2f} ms")

        cases: list[tuple[str, Callable[[], BlockColumnPlan]]] = [
            (DENSE, lambda: fast.dense_plan(q, k)),
            ("streaming 1K+8K", lambda: fast.streaming_plan(q, k, sink=1024, window=8192)),
            ("random blocks 5%", lambda: random_block_plan(
                batch, q_heads, n, density=0.05, block_m=128, block_n=128, device=dev, seed=1)),
            ("random blocks 20%", lambda: random_block_plan(
                batch, q_heads, n, density=0.20, block_m=128, block_n=128, device=dev, seed=2)),
        ]
        for name, make_plan in cases:
            plan = make_plan()
            est_ms = bench_ms(make_plan) if not name.startswith("random") else None
            dens = float(fast.density(plan).mean())
            pairs = dens * causal_pairs
            flops = 4 * head_dim * pairs
            out = fast.sparse_attention(q, k, v, plan)
            err = None
            if name == DENSE:
                err = float((out.float() - ref_out.float()).norm() / ref_out.float().norm())
            ms = bench_ms(lambda: fast.sparse_attention(q, k, v, plan))
            rec_mean = rec_min = None
            if with_recall:
                rec = fast.recall(q, k, plan)
                rec_mean, rec_min = float(rec.mean()), float(rec.min())
            rows.append(Row(name, "sparseprefill", n, dens, rec_mean, rec_min, ms, est_ms,
                            flops / ms / 1e9, cudnn_ms / ms,
                            {"rel_err_vs_cudnn": err} if err is not None else {}))
            log(f"N={n}: {name} ours {ms:.2f} ms density {dens:.4f}")
            if flex_fn is not None:
                try:
                    bmask = flex_block_mask(plan)
                    fout = flex_fn(q, k, v, block_mask=bmask, enable_gqa=True)
                    # Same plan, so the outputs must agree: report how closely.
                    ferr = float((fout.float() - out.float()).norm() / out.float().norm())
                    fms = bench_ms(lambda: flex_fn(q, k, v, block_mask=bmask, enable_gqa=True))
                    rows.append(Row(name, "FlexAttention", n, dens, rec_mean, rec_min, fms, None,
                                    flops / fms / 1e9, cudnn_ms / fms,
                                    {"rel_diff_vs_ours": ferr}))
                    log(f"N={n}: {name} flex {fms:.2f} ms")
                except Exception as exc:  # noqa: BLE001 - report and go on
                    log(f"FlexAttention failed for {name} at N={n}: {type(exc).__name__}: {exc}")
            del plan
        del q, k, v, ke, ve, ref_out
        torch.cuda.empty_cache()
    return rows


def minference_anchor_lines(
    batch: int, heads: int, seqlen: int, *, vertical_size: int = 1000, slash_size: int = 6096,
    device: torch.device, seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lines of ANCHORS.md's MInference measurement: the first 30 columns plus
    random ones (`vertical_size` in all) and the `slash_size` nearest diagonals.

    Returns:
        (verticals, slashes) int32 `[B, H, count]`, sorted ascending.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    nv = min(vertical_size, seqlen)
    forced = min(30, nv)
    rest = torch.rand(batch, heads, max(seqlen - forced, 0), generator=gen).argsort(-1)[..., : nv - forced]
    verticals = torch.cat([torch.arange(forced).expand(batch, heads, forced), rest + forced], -1)
    slashes = torch.arange(min(slash_size, seqlen)).expand(batch, heads, -1)
    return (verticals.sort(-1).values.to(torch.int32).to(device),
            slashes.to(torch.int32).contiguous().to(device))


def cudnn_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, log: Callable[[str], None]) -> Row:
    """cuDNN SDPA (causal, K/V expanded to the query heads outside the timed region)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    b, hq, n, d = q.shape
    g = hq // k.shape[1]
    ms = float("nan")
    try:
        ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

        def cudnn() -> Any:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)

        ms = bench_ms(cudnn)
        del ke, ve
    except (RuntimeError, torch.OutOfMemoryError) as exc:
        log(f"cuDNN failed at N={n}: {exc}")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return Row("dense", "cuDNN SDPA", n, 1.0, 1.0, 1.0, ms, None, 4 * d * b * hq * n * (n + 1) / 2 / ms / 1e9, 1.0)


def flex_row(flex_fn: Any, name: str, plan: BlockColumnPlan, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor, add: Callable[..., None],
              kernel: Callable[[BlockColumnPlan], Callable[[], Any]]) -> None:
    try:
        bmask = flex_block_mask(plan)
        ours = kernel(plan)()[0]
        # Flex's tiles must divide the mask's blocks (its default tiles are 128 wide).
        opts = {"BLOCK_M": min(128, plan.block_m), "BLOCK_N": min(128, plan.block_n)}
        fout = flex_fn(q, k, v, block_mask=bmask, enable_gqa=True, kernel_options=opts)
        diff = float((fout.float() - ours.float()).norm() / ours.float().norm())
        fms = bench_ms(lambda: flex_fn(q, k, v, block_mask=bmask, enable_gqa=True,
                                        kernel_options=opts))
        add(name, "FlexAttention", plan, fms, None, {"rel_diff_vs_ours": diff})
    except Exception as exc:  # noqa: BLE001 - report and go on
        print(f"FlexAttention failed for {name}: {type(exc).__name__}: {exc}", file=sys.stderr)


def format_table(rows: list[Row]) -> str:
    """A fixed-width table of the rows."""
    head = (f"{'method':<28} {'impl':<14} {'N':>7} {'density':>8} {'recall':>13} "
            f"{'ms':>9} {'est ms':>7} {'TFLOP/s':>8} {'vs cuDNN':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        rec = "-" if r.recall_mean is None else f"{r.recall_mean:.3f}/{r.recall_min:.3f}"
        est = "-" if r.estimate_ms is None else f"{r.estimate_ms:.2f}"
        sp = "-" if r.speedup_vs_cudnn is None else f"{r.speedup_vs_cudnn:.2f}x"
        lines.append(f"{r.method:<28} {r.impl:<14} {r.seqlen:>7} {r.density:>8.4f} {rec:>13} "
                     f"{r.ms:>9.2f} {est:>7} {r.tflops:>8.0f} {sp:>8}")
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    """What the numbers were measured on."""
    import triton

    info: dict[str, Any] = {
        "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
    return info


def run_method_suite(
    method: str, seqlens: list[int], *, batch: int = 1, q_heads: int = 32, kv_heads: int = 8,
    head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, with_recall: bool = True,
    log: Callable[[str], None] = print, device: str = "cuda", params: dict[str, Any] | None = None,
    workload: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
) -> list[Row]:
    """Any registered method at its defaults (or `params`), beside cuDNN SDPA in the same run.

    The generic suite of `sparseprefill bench --method <name>` for a method whose descriptor
    has no suite of its own (`Method.bench`). Per N, on the selected workload (`--workload`):
    the cuDNN row, then the method's row: end to end (`ms`), its plan (`estimate_ms`:
    the `*_plan` call, estimate and index together) and the kernel on that plan
    (`extra["kernel_ms"]`), density and recall from the method's view, the speedup
    over cuDNN and `vs_floor`, end to end over `density x cuDNN` (`kernel_vs_floor`
    for the kernel alone). A method without a plan reports its end-to-end time only.
    """
    from . import fast
    from .workload import Shape, bench_qkv as synthetic_qkv
    from .methods import get

    spec = get(method)
    dev = torch.device(device)
    make = workload or synthetic_qkv
    rows: list[Row] = []
    for n in seqlens:
        q, k, v = make(Shape(batch, q_heads, kv_heads, n, head_dim, dtype), device=dev)
        base = cudnn_row(q, k, v, log=log) if dev.type == "cuda" else Row(
            "dense", "SDPA", n, 1.0, 1.0, 1.0, float("nan"), None, float("nan"), 1.0)
        rows.append(base)
        cudnn_ms = base.ms
        call = spec.call_params(spec.demo_params(n) if params is None else dict(params), q)
        run = spec.run_fn("fast")
        ms = bench_ms(lambda: run(q, k, v, **call))
        view = spec.method_view("fast", q, k, v, call, with_recall=with_recall)
        dens = float(view.density.mean())
        extra: dict[str, Any] = {"params": {key: repr(val) for key, val in call.items()}}
        plan_ms = None
        if spec.plan_based:
            plan_fn = spec.plan_fn("fast")
            plan_ms = bench_ms(lambda: plan_fn(q, k, **call))
            plan = plan_fn(q, k, **call)
            scale = call.get("scale")
            kernel_ms = bench_ms(lambda: fast.sparse_attention(q, k, v, plan, scale=scale))
            extra["kernel_ms"] = kernel_ms
            extra["kernel_vs_floor"] = kernel_ms / (dens * cudnn_ms) if dens > 0 and math.isfinite(cudnn_ms) else None
            del plan
        extra["floor_ms"] = dens * cudnn_ms
        extra["vs_floor"] = ms / (dens * cudnn_ms) if dens > 0 and math.isfinite(cudnn_ms) else None
        if view.notes:
            extra["notes"] = view.notes
        rec = view.recall
        pairs = dens * batch * q_heads * n * (n + 1) / 2
        rows.append(Row(method, "sparseprefill", n, dens, None if rec is None else float(rec.mean()),
                        None if rec is None else float(rec.min()), ms, plan_ms, 4 * head_dim * pairs / ms / 1e9,
                        cudnn_ms / ms if math.isfinite(cudnn_ms) else None, extra))
        log(f"N={n}: {method} {ms:.2f} ms (plan {plan_ms}) density {dens:.4f}")
        del q, k, v
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# `--method kernels`: the kernel suite's description and sequence lengths (the other
# choices are the registered methods, each with its descriptor's suite or the generic one).
KERNELS = ("dense/streaming/random plans (default)", (8192, 32768, 131072))
GENERIC = ("plan / kernel / end to end at the method's defaults, beside cuDNN", (32768, 131072))


def _suites() -> dict[str, tuple[str, tuple[int, ...]]]:
    from .methods import methods

    out: dict[str, tuple[str, tuple[int, ...]]] = {"kernels": KERNELS}
    for name, method in methods().items():
        out[name] = (method.bench.about, method.bench.seqlens) if method.bench is not None else GENERIC
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `sparseprefill bench` (a method's suite adds its own, `BenchSuite.arguments`)."""
    from .methods import methods

    suites = _suites()
    parser.add_argument("--method", choices=list(suites), default="kernels",
                        help="; ".join(f"{name}: {text}" for name, (text, _) in suites.items()))
    parser.add_argument("--seqlens", default=None,
                        help="comma-separated sequence lengths (default: the suite's, e.g. 8K,32K,128K for "
                             "kernels)")
    parser.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    parser.add_argument("--q-heads", type=int, default=32, help="query heads Hq (default 32)")
    parser.add_argument("--kv-heads", type=int, default=8, help="KV heads Hkv, dividing Hq (default 8)")
    parser.add_argument("--head-dim", type=int, default=128, help="head dimension D (default 128)")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="default bf16")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    seen: set[str] = set()
    for method in methods().values():
        for arg in method.bench.arguments if method.bench is not None else ():
            if arg.flag not in seen:
                seen.add(arg.flag)
                parser.add_argument(arg.flag, dest=arg.dest, type=arg.type, default=arg.default, help=arg.help)
    parser.add_argument("--no-recall", action="store_true", help="skip recall columns")
    parser.add_argument("--json", default=None, help="write rows and environment as JSON here")
    parser.add_argument("--workload", choices=["synthetic", "calibrated"], default="synthetic",
                        help="inputs of the method suites: synthetic (demo.synthetic_qkv, default) or "
                             "calibrated (sparseprefill.workload, fitted to captured attention)")
    parser.add_argument("--qkv", default=None,
                        help="inputs of the method suites from a capture (sparseprefill eval capture): its "
                             "layers as the batch, first N tokens (N <= the capture's)")
    from .distributed_bench import add_arguments as add_distributed_arguments

    add_distributed_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Entry point of `sparseprefill bench`."""
    if getattr(args, "distributed", False):
        from .distributed_bench import run_distributed

        return run_distributed(args)
    if not torch.cuda.is_available():
        print("sparseprefill bench needs a CUDA GPU (it times kernels against cuDNN SDPA).",
              file=sys.stderr)
        return 2
    from .methods import methods

    default = _suites()[args.method][1]
    seqlens = [int(s) for s in str(args.seqlens).split(",") if s] if args.seqlens else list(default)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    from .workload import select

    select(args.workload, args.qkv)
    common: dict[str, Any] = dict(batch=args.batch, q_heads=args.q_heads, kv_heads=args.kv_heads,
                                  head_dim=args.head_dim, dtype=dtype, with_recall=not args.no_recall, log=log)
    summary: Callable[[list[Any]], str] | None = None
    if args.method == "kernels":
        rows = run_suite(seqlens, flex=not args.no_flex, **common)
    else:
        suite = methods()[args.method].bench
        if suite is None:
            rows = run_method_suite(args.method, seqlens, **common)
        else:
            extra = {arg.dest: getattr(args, arg.dest) for arg in suite.arguments}
            rows = suite.run(seqlens, flex=not args.no_flex, **common, **extra)
            summary = suite.summary
    print(format_table(rows))
    if summary is not None:
        print(summary(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"environment": environment(), "rows": [asdict(r) for r in rows]}, fh,
                      indent=1, default=lambda o: None if isinstance(o, float) and math.isnan(o) else o)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparseprefill bench", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
