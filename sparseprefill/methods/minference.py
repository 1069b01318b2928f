"""MInference's per-head dispatch (vertical-slash, A-shape, block-sparse heads in one plan) as a
method descriptor, with the MInference benchmark suite."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .. import bench, fast, reference
from ..reference.minference import HeadPattern, MInferenceConfig
from ..reference.plan import BlockColumnPlan
from ._common import block_sparse_top_k, sink_window, vertical_slash_defaults
from ._core import Adapter, BenchArgument, BenchSuite, Method, SyncStatus, register


def defaults(n: int) -> dict[str, Any]:
    """The three patterns at their MInference budgets, heads taking them in turn (`prepare`)."""
    return {"patterns": (
        HeadPattern("vertical_slash", {**vertical_slash_defaults(n), "block_m": 64, "block_n": 64}),
        HeadPattern("a_shape", {**sink_window(n), "window": min(4096, max(128, n // 8)),
                                "block_m": 64, "block_n": 64}),
        HeadPattern("block_sparse", {"top_k": block_sparse_top_k(n), "block_size": 64}),
    )}


def sweep(n: int) -> list[dict[str, Any]]:
    """The default three patterns with budgets scaled together: vertical-slash as its own grid,
    the A-shape window N/f, block-sparse top_k Kb/f (blocks of 64)."""
    blocks = -(-n // 64)
    return [{"patterns": (
        HeadPattern("vertical_slash", {"vertical_size": max(30, n // f), "slash_size": max(64, 2 * n // f),
                                       "block_m": 64, "block_n": 64}),
        HeadPattern("a_shape", {**sink_window(n), "window": max(128, n // f), "block_m": 64, "block_n": 64}),
        HeadPattern("block_sparse", {"top_k": max(2, blocks * 8 // f), "block_size": 64}),
    )} for f in (128, 64, 32, 16, 8)]


def prepare(params: dict[str, Any], q: torch.Tensor) -> dict[str, Any]:
    """Pattern `h % len(patterns)` for query head `h`: a one-layer `MInferenceConfig`."""
    patterns = tuple(params["patterns"])
    heads = tuple(patterns[h % len(patterns)] for h in range(int(q.shape[1])))
    out: dict[str, Any] = {"config": MInferenceConfig((heads,)), "layer": 0}
    if params.get("scale") is not None:
        out["scale"] = params["scale"]
    return out


@functools.lru_cache(maxsize=64)
def _config_from_json(text: str) -> MInferenceConfig:
    return MInferenceConfig.from_json(text)


def _config_to_json(config: object) -> object:
    return config.to_json() if isinstance(config, MInferenceConfig) else config


def _parse_blocks(text: str) -> tuple[tuple[int, int], ...]:
    """"64x64,128x64" -> ((64, 64), (128, 64))."""
    blocks = []
    for item in text.split(","):
        try:
            bm, bn = (int(x) for x in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"--vs-blocks: expected block_mxblock_n items like 64x64, got {item!r}") from None
        blocks.append((bm, bn))
    return tuple(blocks)


def run_minference_suite(
    seqlens: list[int], *, batch: int = 1, q_heads: int = 32, kv_heads: int = 8,
    head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, flex_max: int = 131072,
    with_recall: bool = True, log: Callable[[str], None] = print,
    vs_blocks: tuple[tuple[int, int], ...] = ((64, 64),),
) -> list[bench.Row]:
    """MInference benchmark (issue 3): vertical-slash (1000, 6096) and block-sparse
    (top_k=100) on the demo's structured workload, with time split into estimate /
    index / kernel, plus ANCHORS.md's fixed MInference plan (index + kernel), against
    cuDNN SDPA and FlexAttention given the same plan, in the same run.
    """
    from .. import fast
    from ..workload import Shape, bench_qkv as synthetic_qkv
    from ..fast.kernels import block_column_attention
    from ..fast.kernels.vertical_slash_index import vertical_slash_index
    from ..fast.vertical_slash import vertical_slash_lines, with_own_columns

    dev = torch.device("cuda")
    rows: list[bench.Row] = []
    flex_fn = None
    try:
        from torch.nn.attention.flex_attention import flex_attention

        flex_fn = torch.compile(flex_attention, dynamic=False)
    except Exception as exc:  # pragma: no cover - depends on the torch build
        log(f"FlexAttention unavailable: {exc}")
    vs_params = {"vertical_size": 1000, "slash_size": 6096}
    for n in seqlens:
        q, k, v = synthetic_qkv(Shape(batch, q_heads, kv_heads, n, head_dim, dtype), device=dev)
        causal_pairs = batch * q_heads * n * (n + 1) / 2
        base = bench.cudnn_row(q, k, v, log=log)
        cudnn_ms = base.ms
        rows.append(base)

        def add(name: str, impl: str, plan: BlockColumnPlan, ms: float, est_ms: float | None,
                extra: dict[str, Any]) -> None:
            dens = float(fast.density(plan).mean())
            rec_mean = rec_min = None
            if with_recall:
                rec = fast.recall(q, k, plan)
                rec_mean, rec_min = float(rec.mean()), float(rec.min())
            flops = 4 * head_dim * dens * causal_pairs
            rows.append(bench.Row(name, impl, n, dens, rec_mean, rec_min, ms, est_ms, flops / ms / 1e9,
                            cudnn_ms / ms, extra))
            log(f"N={n}: {name} {impl} {ms:.2f} ms density {dens:.4f} {extra}")

        def kernel(plan: BlockColumnPlan) -> Callable[[], Any]:
            return lambda: block_column_attention(q, k, v, plan, validate_plan=False)

        # Vertical-slash, end to end on the workload, and its stages.
        def lines() -> tuple[torch.Tensor, torch.Tensor]:
            return vertical_slash_lines(q, k, **vs_params)

        verticals, slashes = lines()
        est_ms = bench.bench_ms(lines)  # the estimate does not depend on the plan's block sizes
        for vs_block_m, vs_block_n in vs_blocks:
            def vs_index() -> BlockColumnPlan:
                # As fast.vertical_slash_plan builds it: disjoint columns where they fit.
                return with_own_columns(vertical_slash_index(verticals, slashes, seqlen=n,
                                                             block_m=vs_block_m, block_n=vs_block_n))

            def e2e() -> Any:
                return fast.vertical_slash(q, k, v, block_m=vs_block_m, block_n=vs_block_n, **vs_params)

            plan = vs_index()
            idx_ms, ker_ms = bench.bench_ms(vs_index), bench.bench_ms(kernel(plan))
            label = f"vertical_slash {vs_block_m}x{vs_block_n}"
            add(label, "sparseprefill", plan, bench.bench_ms(e2e), est_ms + idx_ms,
                {"estimate_ms": est_ms, "index_ms": idx_ms, "kernel_ms": ker_ms,
                 "plan_mb": plan.nbytes() / 2**20})
            if flex_fn is not None and n <= flex_max:
                bench.flex_row(flex_fn, label, plan, q, k, v, add, kernel)
            del plan
            torch.cuda.empty_cache()
        del verticals, slashes

        def index() -> BlockColumnPlan:
            return with_own_columns(vertical_slash_index(verticals, slashes, seqlen=n,
                                                         block_m=64, block_n=64))

        # ANCHORS.md's MInference plan: 1000 columns (30 first + random), 6096 nearest diagonals.
        verticals, slashes = bench.minference_anchor_lines(batch, q_heads, n, device=dev)
        plan = index()
        idx_ms, ker_ms = bench.bench_ms(index), bench.bench_ms(kernel(plan))
        add("MInference plan", "sparseprefill", plan, idx_ms + ker_ms, idx_ms,
            {"index_ms": idx_ms, "kernel_ms": ker_ms})
        if flex_fn is not None and n <= flex_max:
            bench.flex_row(flex_fn, "MInference plan", plan, q, k, v, add, kernel)
        del plan, verticals, slashes
        torch.cuda.empty_cache()

        # Block-sparse, top_k = 100 blocks of 64.
        def make() -> BlockColumnPlan:
            return fast.block_sparse_plan(q, k, top_k=100)

        plan = make()
        est_ms, ker_ms = bench.bench_ms(make), bench.bench_ms(kernel(plan))
        add("block_sparse", "sparseprefill", plan, est_ms + ker_ms, est_ms,
            {"estimate_ms": est_ms, "kernel_ms": ker_ms})
        if flex_fn is not None and n <= flex_max:
            bench.flex_row(flex_fn, "block_sparse", plan, q, k, v, add, kernel)
        del plan, q, k, v
        torch.cuda.empty_cache()
    return rows


def _suite(seqlens: list[int], *, flex: bool = True, vs_blocks: str = "64x64", **kwargs: Any) -> list[bench.Row]:
    return run_minference_suite(seqlens, flex_max=131072 if flex else 0, vs_blocks=_parse_blocks(vs_blocks),
                                **kwargs)


METHOD = register(Method(
    name="minference",
    notes="MInference per-head dispatch: each head its own pattern (vertical-slash, A-shape, "
          "block-sparse), one merged plan, one kernel launch",
    reference_plan=reference.minference_plan,
    fast_plan=fast.minference_plan,
    reference_run=reference.minference,
    fast_run=fast.minference,
    defaults=defaults,
    sweep=sweep,
    prepare=prepare,
    chunked="per head, its pattern's reading (vertical-slash: the chunk's last queries; A-shape: none; "
            "block-sparse: the chunk's blocks)",
    sync=SyncStatus(
        syncs=("vertical-slash heads: as vertical_slash",),
        static_bound="vertical-slash heads: as vertical_slash_static",
        note="mixed layers merge their head plans slice by slice on the device "
             "(reference.minference.merge_head_plans); vertical-slash heads need the static op"),
    adapters={"config": Adapter("str", _config_to_json, _config_from_json)},
    bench=BenchSuite(
        about="vertical-slash and block-sparse end to end (MInference's kernels and settings)",
        seqlens=(32768, 131072, 524288), run=_suite,
        arguments=(BenchArgument("--vs-blocks", "vs_blocks", str, "64x64",
                                 "minference: comma-separated vertical-slash plan block sizes "
                                 "block_mxblock_n (default 64x64, MInference's)"),)),
))
