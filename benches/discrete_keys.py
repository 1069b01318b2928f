"""Issue 21's table: the kernel time of every method's plan, before and after, beside cuDNN.

For each N the workload is the bench's (`sparseprefill.demo.synthetic_qkv`, bf16, B = 1,
32 query / 8 KV heads, D = 128 unless told), and each plan comes from the method's own
`*_plan` at its default: dense, sample_attention, vertical_slash 1000 / 6096,
flexprefill_vs gamma 0.9 and 0.95, anchor_attention (its own plan: anchor blocks plus
stripes as grouped columns, before `with_full_blocks`), and a random plan with about 20%
of its kept area in columns (`columns20`). Per plan: density, columns per query block,
kernel ms (`block_column_attention`, median of `triton.testing.do_bench`), TFLOP/s on
the kept causal pairs (`4 D` flops a pair), and the ratio to `density x cuDNN dense`.

One GPU run compares code versions: `run` is started once per installed version (each
in its own process, so two copies of the package never meet), with the same cached
workload, and `merge` prints the table and writes one JSON:

    python benches/discrete_keys.py run --label before --json /tmp/before.json   # old checkout
    python benches/discrete_keys.py run --label after --json /tmp/after.json     # this one
    python benches/discrete_keys.py merge /tmp/before.json /tmp/after.json --json OUT.json

(`benches/discrete_keys_gpu.sh compare ../before=before .=after` does this in one device
call; the packed-column variant measured in docs/plan-and-kernels.md is commit 5404984,
`SPARSEPREFILL_COLUMNS=pack`.)

`run` also keeps a few output rows of every plan (`--rows-dir`) so `merge` reports each
version's relative difference (Frobenius norm) from the first version's rows. `profile` runs the
column-dominant plans once each between `cudaProfilerStart/Stop`, for
`ncu --profile-from-start off`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

PLANS = ("dense", "sample_attention", "vertical_slash", "flexprefill_vs_0.9", "flexprefill_vs_0.95",
         "anchor_attention", "columns20")
# "blocks_like_NAME": a random block plan with NAME's block sizes and density (the block
# path's rate on the same kept area, for the column plans' ratio to it).
LIKE = "blocks_like_"


def workload(n: int, *, heads: int, kv_heads: int, head_dim: int, cache: Path) -> tuple[torch.Tensor, ...]:
    """The bench's q, k, v on the GPU, built once per size and cached on disk (float64 on the CPU
    is the slow part)."""
    from sparseprefill.demo import Shape, synthetic_qkv

    path = cache / f"sparseprefill-qkv-{n}-{heads}-{kv_heads}-{head_dim}.pt"
    if path.exists():
        q, k, v = torch.load(path)
    else:
        q, k, v = synthetic_qkv(Shape(1, heads, kv_heads, n, head_dim, torch.bfloat16),
                                device=torch.device("cpu"))
        part = path.with_suffix(".part")
        torch.save((q, k, v), part)
        os.replace(part, path)  # whole files only: another process may be waiting on it
    return tuple(t.cuda() for t in (q, k, v))


def column_plan(q: torch.Tensor, *, key_share: float = 0.02, block_share: float = 0.08,
                block: int = 64, seed: int = 0) -> Any:
    """A random plan whose kept area is about 20% columns: each causal 64 x 64 block kept with
    probability `block_share` (the diagonal always), plus `key_share * N` random causal key
    columns per query block (lists shared with no block, `columns_disjoint=False`)."""
    from sparseprefill.reference.plan import BlockColumnPlan, cdiv

    b, h, n = q.shape[0], q.shape[1], q.shape[2]
    dev = q.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    qb = cdiv(n, block)
    last = ((torch.arange(qb, device=dev) + 1) * block - 1).clamp(max=n - 1)
    kb = torch.arange(qb, device=dev)
    keep = torch.rand(b, h, qb, qb, generator=gen, device=dev) < block_share
    keep = (keep | (kb[None, :] == kb[:, None])) & (kb[None, :] <= kb[:, None])
    count = keep.sum(-1).to(torch.int32)
    index = torch.sort(torch.where(keep, kb, qb), dim=-1).values[..., : int(count.max())].to(torch.int32)
    width = max(1, int(key_share * n))
    cols = torch.sort(torch.randint(0, n, (b, h, qb, width), generator=gen, device=dev), dim=-1).values
    dup = torch.zeros_like(cols, dtype=torch.bool)
    dup[..., 1:] = cols[..., 1:] == cols[..., :-1]
    cols = torch.where(dup | (cols > last[None, None, :, None]), n, cols)
    cols = torch.sort(cols, dim=-1).values
    ccount = (cols < n).sum(-1).to(torch.int32)
    plan = BlockColumnPlan(seqlen=n, block_m=block, block_n=block, block_count=count, block_index=index,
                           column_count=ccount, column_index=cols.clamp(max=n - 1).to(torch.int32))
    return plan.validate()


def block_plan_like(plan: Any, density: float, *, seed: int = 1) -> Any:
    """A random causal block plan with `plan`'s block sizes and about `density` of the
    causal pairs: every diagonal block, each other causal block with one probability."""
    from sparseprefill.reference.plan import BlockColumnPlan, causal_pairs

    b, h, n, bm, bn = plan.batch, plan.num_heads, plan.seqlen, plan.block_m, plan.block_n
    qb, kb, dev = plan.num_query_blocks, plan.num_key_blocks, plan.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    first = torch.arange(kb, device=dev) * bn
    last = plan.last_rows()
    r0 = (torch.arange(qb, device=dev) * bm)[:, None]
    pairs = causal_pairs(r0, last[:, None] + 1, first[None, :], (first + bn).clamp(max=n)[None, :]).double()
    causal = pairs > 0
    diag = causal & (first[None, :] + bn - 1 >= r0)
    share = (density * pairs.sum() - pairs[diag].sum()).clamp(min=0) / pairs[causal & ~diag].sum().clamp(min=1)
    keep = (torch.rand(b, h, qb, kb, generator=gen, device=dev) < share) & causal | diag
    count = keep.sum(-1).to(torch.int32)
    index = torch.sort(torch.where(keep, torch.arange(kb, device=dev), kb), dim=-1).values
    index = index[..., : int(count.max())].clamp(max=kb - 1).to(torch.int32)
    empty = torch.zeros(b, h, qb, 0, dtype=torch.int32, device=dev)
    return BlockColumnPlan(seqlen=n, block_m=bm, block_n=bn, block_count=count, block_index=index,
                           column_count=torch.zeros_like(count), column_index=empty,
                           columns_disjoint=True).validate()


def method_plans(q: torch.Tensor, k: torch.Tensor, names: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    """Each named plan in turn (one at a time on the GPU); `blocks_like_X` right after X."""
    from sparseprefill import fast

    makers: dict[str, Callable[[], Any]] = {
        "dense": lambda: fast.dense_plan(q, k),
        "sample_attention": lambda: fast.sample_attention_plan(q, k),
        "vertical_slash": lambda: fast.vertical_slash_plan(q, k, vertical_size=1000, slash_size=6096),
        "flexprefill_vs_0.9": lambda: fast.flexprefill_vs_plan(q, k, gamma=0.9),
        "flexprefill_vs_0.95": lambda: fast.flexprefill_vs_plan(q, k, gamma=0.95),
        # Single lines (line_block 1, SharePrefill's setting; the default bands are blocks).
        "flexprefill_vs_0.95_lines": lambda: fast.flexprefill_vs_plan(q, k, gamma=0.95, line_block=1),
        "anchor_attention": lambda: fast.anchor_attention_plan(q, k),
        "columns20": lambda: column_plan(q),
    }
    for name in names:
        if name.startswith(LIKE):
            continue
        plan = makers[name]()
        yield name, plan
        if LIKE + name in names:
            dens = float(fast.density(plan).mean())
            like = block_plan_like(plan, dens)
            del plan
            yield LIKE + name, like


def columns_per_block(plan: Any) -> float:
    return float(plan.column_count.float().mean())


def _compiled() -> dict[int, Any]:
    """The compiled variants of the block/column kernel so far, by id."""
    from sparseprefill.fast.kernels import block_column as bc

    found: dict[int, Any] = {}
    for cache in getattr(bc._block_column_fwd, "device_caches", {}).values():
        kernels = cache[0] if isinstance(cache, tuple) else cache
        for kern in getattr(kernels, "values", lambda: [])():
            found[id(kern)] = kern
    return found


def _resources(kernels: list[Any]) -> list[dict[str, Any]]:
    return [{"n_regs": getattr(kern, "n_regs", None), "n_spills": getattr(kern, "n_spills", None),
             "shared": getattr(getattr(kern, "metadata", None), "shared", None),
             "num_warps": getattr(getattr(kern, "metadata", None), "num_warps", None)} for kern in kernels]


def _sample_rows(n: int) -> torch.Tensor:
    return torch.unique(torch.cat([torch.arange(0, n, max(1, n // 61)), torch.arange(n - 64, n)]))


def run(args: argparse.Namespace) -> int:
    import triton

    from sparseprefill import fast
    from sparseprefill.fast.kernels import block_column_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    rows: list[dict[str, Any]] = []
    names = tuple(re.split("[,+]", args.plans)) if args.plans else PLANS
    rows_dir = Path(args.rows_dir) if args.rows_dir else None
    for n in (int(x) for x in args.seqlens.split(",")):
        q, k, v = workload(n, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                           cache=Path(args.cache))
        b, hq, _, d = q.shape
        pairs = b * hq * n * (n + 1) / 2
        g = hq // k.shape[1]
        ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

        def cudnn() -> Any:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)

        ref = cudnn() if not args.sanitize else None
        cudnn_ms = math.nan
        if not args.sanitize:
            cudnn_ms = triton.testing.do_bench(cudnn, warmup=args.warmup, rep=args.rep, return_mode="median")
        del ke, ve
        print(f"[{args.label}] N={n}: cuDNN {cudnn_ms:.2f} ms", flush=True)
        rows.append({"label": args.label, "plan": "cuDNN SDPA", "seqlen": n, "density": 1.0,
                     "kernel_ms": cudnn_ms, "tflops": 4 * d * pairs / cudnn_ms / 1e9})
        for name, plan in method_plans(q, k, names):
            dens = float(fast.density(plan).mean())
            cols = columns_per_block(plan)

            # Plan-time resolution of covered columns (this checkout's front door does it
            # once per plan, cached): its cost, apart from the kernel's.
            resolve_ms = None
            try:
                from sparseprefill.fast.kernels.own_columns import resolve_covered_columns
            except ImportError:  # an older version of the package
                resolve_covered_columns = None
            if resolve_covered_columns is not None and plan.column_index.shape[3] and not plan.columns_disjoint:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                resolve_covered_columns(plan)
                torch.cuda.synchronize()
                resolve_ms = 1e3 * (time.perf_counter() - t0)

            def kernel(plan: Any = plan) -> Any:
                return block_column_attention(q, k, v, plan, validate_plan=False)

            before = set(_compiled())
            t0 = time.perf_counter()
            out, _ = kernel()
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            fresh = [kern for key, kern in _compiled().items() if key not in before]
            bad = int((~torch.isfinite(out)).sum())
            err_dense = None
            if name == "dense" and ref is not None:
                err_dense = float((out.float() - ref.float()).norm() / ref.float().norm())
            if args.sanitize:
                print(f"[{args.label}] N={n} {name}: ran under the sanitizer, {bad} non-finite", flush=True)
                continue
            ms = triton.testing.do_bench(kernel, warmup=args.warmup, rep=args.rep, return_mode="median")
            row = {"label": args.label, "plan": name, "seqlen": n, "density": dens,
                   "columns_per_query_block": cols, "block_m": plan.block_m, "block_n": plan.block_n,
                   "kernel_ms": ms, "first_call_s": first_s,
                   "tflops": 4 * d * dens * pairs / ms / 1e9, "vs_floor": ms / (dens * cudnn_ms),
                   "cudnn_ms": cudnn_ms, "nonfinite": bad, "rel_err_vs_cudnn": err_dense,
                   "compiled": _resources(fresh), "resolve_ms": resolve_ms}
            rows.append(row)
            _write(args, rows)
            if args.dump_dir:
                _dump(Path(args.dump_dir), f"{args.label}-{name}-{n}-d{d}", fresh)
            if rows_dir is not None:
                rows_dir.mkdir(parents=True, exist_ok=True)
                torch.save(out[:, :, _sample_rows(n).to(out.device)].cpu(),
                           rows_dir / f"{args.label}-{name}-{n}.pt")
            print(f"[{args.label}] N={n} {name}: density {dens:.4f}, {cols:.0f} cols/qblock, "
                  f"{ms:.2f} ms, {row['tflops']:.0f} TFLOP/s, {row['vs_floor']:.2f}x floor, "
                  f"compiled {row['compiled']}", flush=True)
            del out
        del q, k, v, ref
        torch.cuda.empty_cache()
    _write(args, rows)
    return 0


def _write(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """The JSON so far (rewritten after every row, so a run cut short keeps its rows)."""
    import triton

    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "head_dim": args.head_dim,
            "env": {k: v for k, v in os.environ.items() if k.startswith("SPARSEPREFILL_")}}
    Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def _dump(folder: Path, stem: str, kernels: list[Any]) -> None:
    """Each fresh kernel's TTGIR (gzip), and its column loop's async waits on stdout."""
    import gzip

    folder.mkdir(parents=True, exist_ok=True)
    for i, kern in enumerate(kernels):
        text = kern.asm.get("ttgir", "") if hasattr(kern, "asm") else ""
        if not text:
            continue
        (folder / f"{stem}-{i}.ttgir.gz").write_bytes(gzip.compress(text.encode()))
        waits = re.findall(r"async_wait[^{]*\{num = (\d+)", text)
        print(f"  ttgir {stem}-{i}: async_wait nums {waits}", flush=True)


def profile(args: argparse.Namespace) -> int:
    """Each plan's kernel once between cudaProfilerStart/Stop (after a warm-up that compiles)."""
    from sparseprefill.fast.kernels import block_column_attention

    names = tuple(re.split("[,+]", args.plans))
    for n in (int(x) for x in args.seqlens.split(",")):
        q, k, v = workload(n, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                           cache=Path(args.cache))
        for name, plan in method_plans(q, k, names):
            block_column_attention(q, k, v, plan, validate_plan=False)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            block_column_attention(q, k, v, plan, validate_plan=False)
            torch.cuda.synchronize()
            print(f"profile N={n} {name}: {1e3 * (time.perf_counter() - t0):.1f} ms unprofiled, "
                  f"{columns_per_block(plan):.0f} cols/qblock", flush=True)
            torch.cuda.cudart().cudaProfilerStart()
            block_column_attention(q, k, v, plan, validate_plan=False)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
    return 0


def build_workloads(args: argparse.Namespace) -> int:
    """Fill the workload cache (CPU only), e.g. while the GPU does something else."""
    from sparseprefill.demo import Shape, synthetic_qkv

    for d in (int(x) for x in args.head_dims.split(",")):
        for n in (int(x) for x in args.seqlens.split(",")):
            path = Path(args.cache) / f"sparseprefill-qkv-{n}-{args.heads}-{args.kv_heads}-{d}.pt"
            if not path.exists():
                t0 = time.perf_counter()
                qkv = synthetic_qkv(Shape(1, args.heads, args.kv_heads, n, d, torch.bfloat16),
                                    device=torch.device("cpu"))
                part = path.with_suffix(".part")
                torch.save(qkv, part)
                os.replace(part, path)
                print(f"workload N={n} D={d}: {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


def merge(args: argparse.Namespace) -> int:
    runs = [json.loads(Path(p).read_text()) for p in args.inputs]
    rows = [r for run_ in runs for r in run_["rows"]]
    labels = [run_["rows"][0]["label"] for run_ in runs if run_["rows"]]
    if args.rows_dir:
        base = labels[0]
        for r in rows:
            if r["label"] == base or r["plan"] == "cuDNN SDPA":
                continue
            a = Path(args.rows_dir) / f"{base}-{r['plan']}-{r['seqlen']}.pt"
            bpath = Path(args.rows_dir) / f"{r['label']}-{r['plan']}-{r['seqlen']}.pt"
            if a.exists() and bpath.exists():
                x, y = torch.load(a).float(), torch.load(bpath).float()
                r["rel_diff_vs_" + base] = float((x - y).norm() / x.norm().clamp(min=1e-30))
    out = {"meta": [run_["meta"] for run_ in runs], "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    def order(plan: str) -> float:
        base = plan[len(LIKE):] if plan.startswith(LIKE) else plan
        return (PLANS.index(base) + (0.5 if base != plan else 0.0)) if base in PLANS else -1.0

    keys = sorted({(r["seqlen"], r["plan"]) for r in rows}, key=lambda x: (x[0], order(x[1])))
    head = f"{'N':>7} {'plan':<20} {'density':>7} {'cols':>6}"
    for lab in labels:
        head += f" | {lab[:12]:>12} ms {'TF/s':>5} {'floor':>5}"
    print(head)
    for n, plan in keys:
        sel = {r["label"]: r for r in rows if r["seqlen"] == n and r["plan"] == plan}
        first = next(iter(sel.values()))
        line = f"{n:>7} {plan:<20} {first['density']:>7.4f} {first.get('columns_per_query_block', 0):>6.0f}"
        for lab in labels:
            r = sel.get(lab)
            if r is None:
                line += f" | {'-':>15} {'':>5} {'':>5}"
                continue
            fl = r.get("vs_floor")
            line += f" | {r['kernel_ms']:>15.2f} {r['tflops']:>5.0f} {fl if fl is not None else math.nan:>5.2f}"
        diffs_txt = [f"{k[12:]}={v:.1e}" for r in sel.values() for k, v in r.items() if k.startswith("rel_diff_vs_")]
        print(line + ("  diff " + " ".join(diffs_txt) if diffs_txt else ""))
    # Column plans against the block path on the same kept area (same label, same N).
    ratios = []
    for r in rows:
        like = next((x for x in rows if x["label"] == r["label"] and x["seqlen"] == r["seqlen"]
                     and x["plan"] == LIKE + r["plan"]), None)
        if like is not None:
            r["vs_block_path"] = r["tflops"] / like["tflops"]
            ratios.append(f"{r['label']} N={r['seqlen']} {r['plan']}: {r['tflops']:.0f} / "
                          f"{like['tflops']:.0f} TFLOP/s = {r['vs_block_path']:.2f} of the block path")
    if ratios:
        print("\n".join(ratios))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("run", "profile"):
        p = sub.add_parser(name)
        p.add_argument("--label", default="current")
        p.add_argument("--seqlens", default="32768,131072")
        p.add_argument("--plans", default=os.environ.get("DK_PLANS") or (",".join(PLANS) if name == "run" else
                       "anchor_attention,flexprefill_vs_0.95"))
        p.add_argument("--heads", type=int, default=32)
        p.add_argument("--kv-heads", type=int, default=8)
        p.add_argument("--head-dim", type=int, default=128)
        p.add_argument("--cache", default="/tmp")
        p.add_argument("--json", default="/tmp/discrete_keys.json")
        p.add_argument("--rows-dir", default=None)
        p.add_argument("--dump-dir", default=None, help="save each fresh kernel's TTGIR here")
        p.add_argument("--warmup", type=int, default=50)
        p.add_argument("--rep", type=int, default=300)
        p.add_argument("--sanitize", action="store_true",
                       help="one launch per plan, no timing and no cuDNN (for compute-sanitizer)")
    w = sub.add_parser("workload", help="build and cache the workloads only (no GPU needed)")
    w.add_argument("--seqlens", default="32768,131072")
    w.add_argument("--head-dims", default="128,64")
    w.add_argument("--heads", type=int, default=32)
    w.add_argument("--kv-heads", type=int, default=8)
    w.add_argument("--cache", default="/tmp")
    m = sub.add_parser("merge")
    m.add_argument("inputs", nargs="+")
    m.add_argument("--json", default=None)
    m.add_argument("--rows-dir", default=None)
    args = parser.parse_args(argv)
    return {"run": run, "profile": profile, "merge": merge, "workload": build_workloads}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
