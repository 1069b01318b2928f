"""torch.compile and CUDA-graph checks of `sparseprefill.fast.ops` on a GPU (one line per check).

Checks, for the registered methods (`sparseprefill.methods`):

* `compile`: a small attention layer (projections, a method op on bf16 q, k, v,
  output projection) compiled with inductor, `fullgraph=True`, against the same
  layer in eager mode; the line gives the graph count and the largest difference
  (the op itself is the same code in both; the projections may round differently);
* `nosync`: the method's capture op (`ops.capture_op`: `<method>_static` or the op
  itself) under `torch.cuda.set_sync_debug_mode("error")`, which raises on any host
  synchronisation;
* `graph`: that op captured in a `torch.cuda.CUDAGraph` on static inputs, then new
  values copied into the inputs and the graph replayed: the output must equal an
  eager call on the new values bit for bit;
* `graph-default`: the same capture of the default op (informational: an estimator
  that reads its width uses its bound during capture; the others fail to capture);
* `reduce-overhead`: the layer under `torch.compile(mode="reduce-overhead")` with a
  capture-safe op (cudagraph trees used) and with a `cudagraph_unsafe` one (skipped,
  counted in `cudagraph_skips`); both must equal eager;
* `plan-graph`: a dense plan built by `fast.dense_plan` and `ops.sparse_attention`
  (no validation for an estimator's plan) captured and replayed.

Usage (the lead's batched GPU run):

    python benches/compile_check.py --json $OUT/compile_check.json

On CPU (`TRITON_INTERPRET=1 python benches/compile_check.py --device cpu --seqlen 80
--heads 2 1 --head-dim 16 --compile-methods dense`) only the compile checks run;
the CUDA checks print SKIP. Exit code 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from sparseprefill.methods import METHODS
from sparseprefill.fast import ops

RESULTS: list[dict[str, Any]] = []


def report(check: str, method: str, ok: bool | None, detail: str, seconds: float) -> None:
    """Print one line and keep it for the JSON file (ok None: skipped or informational)."""
    status = "SKIP" if ok is None else ("OK" if ok else "FAIL")
    print(f"{check:16s} {method:26s} {status:4s} {seconds:7.1f}s  {detail}", flush=True)
    RESULTS.append({"check": check, "method": method, "status": status, "detail": detail,
                    "seconds": round(seconds, 2)})


class Layer(torch.nn.Module):
    """Projections around one attention op: x `[B, N, hidden]` -> `[B, N, hidden]`."""

    def __init__(self, op: Callable[..., torch.Tensor], params: dict[str, Any], *, q_heads: int,
                 kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.op, self.params, self.dtype = op, params, dtype
        self.heads, self.head_dim = (q_heads, kv_heads), head_dim
        hidden = q_heads * head_dim
        self.qkv = torch.nn.Linear(hidden, (q_heads + 2 * kv_heads) * head_dim, bias=False)
        self.out = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        (hq, hkv), d = self.heads, self.head_dim
        q, k, v = self.qkv(x).split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = (t.view(b, n, -1, d).transpose(1, 2).to(self.dtype) for t in (q, k, v))
        o = self.op(q, k, v, **self.params)
        return self.out(o.transpose(1, 2).reshape(b, n, hq * d).to(x.dtype))  # type: ignore[no-any-return]


def _params(name: str, q: torch.Tensor) -> dict[str, Any]:
    spec = METHODS[name]
    return ops.op_params(name, spec.call_params(spec.demo_params(int(q.shape[2])), q))


def check_compile(name: str, static: bool, args: argparse.Namespace, x: torch.Tensor,
                  q: torch.Tensor) -> None:
    label = f"{name}_static" if static else name
    t0 = time.perf_counter()
    try:
        torch._dynamo.reset()
        torch.manual_seed(0)
        layer = Layer(ops.method_op(name, static=static), _params(name, q), q_heads=args.heads[0],
                      kv_heads=args.heads[1], head_dim=args.head_dim, dtype=args.dtype).to(x.device).eval()
        compiled = torch.compile(layer, backend="inductor", fullgraph=True)
        with torch.no_grad():
            explain = torch._dynamo.explain(layer)(x)
            want = layer(x)
            got = compiled(x)
        diff = (got - want).abs().max().item()
        scale = want.abs().max().item()
        ok = explain.graph_count == 1 and explain.graph_break_count == 0 and diff <= 1e-2 * max(scale, 1.0)
        report("compile", label, ok, f"graphs={explain.graph_count} breaks={explain.graph_break_count} "
               f"equal={torch.equal(got, want)} max|diff|={diff:.2e} max|out|={scale:.2e}",
               time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - every failure is one FAIL line
        report("compile", label, False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
               time.perf_counter() - t0)


def _capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up: Triton compiles, allocator pools settle
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def check_graph(check: str, label: str, fn: Callable[[], torch.Tensor],
                inputs: tuple[torch.Tensor, ...], expect_ok: bool | None) -> None:
    """Capture `fn` (reading `inputs`), refill the inputs, replay, compare with eager."""
    t0 = time.perf_counter()
    try:
        graph, out = _capture(fn)
        gen = torch.Generator(device=inputs[0].device).manual_seed(123)
        for t in inputs:
            t.copy_(torch.randn(t.shape, generator=gen, device=t.device, dtype=t.dtype))
        graph.replay()
        torch.cuda.synchronize()
        want = fn()
        equal = torch.equal(out, want)
        report(check, label, equal if expect_ok is not False else None,
               f"replayed on new inputs: equal={equal}", time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001
        try:
            torch.cuda.synchronize()
        except RuntimeError:
            pass
        detail = f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        report(check, label, False if expect_ok else None, detail, time.perf_counter() - t0)


def check_nosync(label: str, fn: Callable[[], torch.Tensor]) -> None:
    t0 = time.perf_counter()
    fn()  # compile the kernels first
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        fn()
        ok, detail = True, "no host synchronisation"
    except RuntimeError as exc:
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "sparseprefill" in f.filename
                  or "/fast/" in f.filename]
        where = f"{frames[-1].filename.split('/')[-1]}:{frames[-1].lineno}" if frames else "?"
        ok, detail = False, f"sync at {where}: {str(exc).splitlines()[0][:160]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    report("nosync", label, ok, detail, time.perf_counter() - t0)


def check_reduce_overhead(name: str, static: bool, args: argparse.Namespace, x: torch.Tensor,
                          q: torch.Tensor) -> None:
    from torch._dynamo.utils import counters

    label = f"{name}_static" if static else name
    t0 = time.perf_counter()
    try:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        layer = Layer(ops.method_op(name, static=static), _params(name, q), q_heads=args.heads[0],
                      kv_heads=args.heads[1], head_dim=args.head_dim, dtype=args.dtype).to(x.device).eval()
        compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
        with torch.no_grad():
            want = layer(x)
            for _ in range(3):  # warm-up, record, replay
                got = compiled(x)
            got = got.clone()
        diff = (got - want).abs().max().item()
        skips = sum(counters["inductor"].get(k, 0) for k in ("cudagraph_skips",))
        safe = torch.Tag.cudagraph_unsafe not in ops.method_op(name, static=static).default.tags
        # A cudagraph_unsafe op is either left out of the graphs (inductor's graph
        # partition, the default from torch 2.9) or makes inductor skip cudagraphs.
        ok = diff <= 1e-2 * max(want.abs().max().item(), 1.0)
        report("reduce-overhead", label, ok, f"op tagged {'safe' if safe else 'cudagraph_unsafe'}, "
               f"cudagraph_skips={skips}, max|diff|={diff:.2e}", time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001
        report("reduce-overhead", label, False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}",
               time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, nargs=2, default=[8, 2], metavar=("HQ", "HKV"))
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--methods", nargs="*", default=list(METHODS), help="methods for the CUDA-graph checks")
    parser.add_argument("--compile-methods", nargs="*", default=["vertical_slash", "minference", "dense"],
                        help="methods whose layer is compiled with inductor (default op and _static op)")
    parser.add_argument("--json", default=None, help="write every line's result here")
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    dev = torch.device(args.device)
    hq, hkv = args.heads
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(args.batch, args.seqlen, hq * args.head_dim, generator=gen, device=dev) * 0.5
    q, k, v = (torch.randn(args.batch, h, args.seqlen, args.head_dim, generator=gen, device=dev,
                           dtype=args.dtype) for h in (hq, hkv, hkv))
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else dev}, "
          f"B={args.batch} Hq={hq} Hkv={hkv} N={args.seqlen} D={args.head_dim} {args.dtype}", flush=True)

    for name in args.compile_methods:
        check_compile(name, False, args, x, q)
        if f"{name}_static" in ops._OPS:
            check_compile(name, True, args, x, q)

    cuda = dev.type == "cuda"
    if not cuda:
        report("graph", "*", None, "needs CUDA", 0.0)
    for name in args.methods if cuda else []:
        status = ops.sync_status(name)
        if not status.capture_safe:
            report("graph", name, None, f"not capture-safe: {status.note}", 0.0)
            continue
        op = ops.capture_op(name)
        label = op.default.name().split("::")[1]

        def run(op: Any = op, params: dict[str, Any] = _params(name, q)) -> torch.Tensor:
            return op(q, k, v, **params)  # type: ignore[no-any-return]

        check_nosync(label, run)
        check_graph("graph", label, run, (q, k, v), True)

    if cuda:
        from sparseprefill import fast

        def planned() -> torch.Tensor:
            plan = fast.dense_plan(q, k, block_m=128, block_n=128)
            return ops.sparse_attention(q, k, v, plan)

        check_graph("plan-graph", "dense_plan+sparse_attention", planned, (q, k, v), True)
        check_reduce_overhead("vertical_slash", True, args, x, q)
        check_reduce_overhead("vertical_slash", False, args, x, q)

    # Last: a refused capture may leave the device's capture state behind it.
    for name in args.methods if cuda else []:
        if ops.sync_status(name).syncs:
            default = ops.method_op(name)

            def run_default(op: Any = default, params: dict[str, Any] = _params(name, q)) -> torch.Tensor:
                return op(q, k, v, **params)  # type: ignore[no-any-return]

            check_graph("graph-default", name, run_default, (q, k, v), None)

    failed = sum(r["status"] == "FAIL" for r in RESULTS)
    print(f"failures: {failed} of {len(RESULTS)} checks", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"torch": torch.__version__, "device": str(dev), "seqlen": args.seqlen,
                       "heads": args.heads, "head_dim": args.head_dim, "dtype": str(args.dtype),
                       "results": RESULTS}, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
