"""XAttention (antidiagonal tile scoring, DeltaAttention thesis sec. 2.5) as a method descriptor,
with the tile-method benchmark suite that DPXA shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import bench, fast, reference
from ..reference.plan import BlockColumnPlan, cdiv
from ._common import TILE_SWEEP, tile_block
from ._core import BenchSuite, Method, SyncStatus, register


# XAttention / DPXA cases of `run_tile_suite`: (row name, method, parameters).
TILE_CASES: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("xattention s8 0.9", "xattention", {"stride": 8, "threshold": 0.9}),
    ("xattention s16 0.9", "xattention", {"stride": 16, "threshold": 0.9}),
    ("naive s4 0.9", "xattention", {"stride": 4, "threshold": 0.9, "scoring": "naive"}),
    ("dpxa cos0.75 0.9", "dpxa", {"cos_threshold": 0.75, "threshold": 0.9}),
    ("dpxa cos0.75 0.75", "dpxa", {"cos_threshold": 0.75, "threshold": 0.75}),
    ("dpxa cos0.78 0.9", "dpxa", {"cos_threshold": 0.78, "threshold": 0.9}),
)


def run_tile_suite(
    seqlens: list[int], *, batch: int = 1, q_heads: int = 32, kv_heads: int = 8,
    head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, with_recall: bool = True,
    log: Callable[[str], None] = print, methods: tuple[str, ...] = ("xattention", "dpxa"),
    block: int = 128, cases: tuple[tuple[str, str, dict[str, Any]], ...] = TILE_CASES,
    device: str = "cuda",
) -> list[bench.Row]:
    """XAttention and DPXA (issue 9) on the demo's workload, cuDNN SDPA in the same run.

    Every case is timed end to end and in its stages: scoring (the tile weights: for
    DPXA the delta anchors of Q and K, `anchors_ms`, plus the anchor-pair scores),
    selection (greedy threshold and the plan's block lists) and the block kernel on the
    plan. `extra` holds the split, `scoring_vs_cudnn` (scoring time over cuDNN's dense
    time; XAttention's stride-8 scoring FLOPs are 1/16 of dense), `floor_ms`
    (`density x cuDNN`) and `kernel_over_floor`, the tiles computed and DPXA's measured
    scoring ratio `alpha * beta`.
    """
    from .. import fast
    from ..demo import Shape, synthetic_qkv
    from ..fast.kernels import block_column_attention
    from ..fast.kernels.delta_score import delta_anchor_lists
    from ..fast.xattention import select_tiles, tiles_to_plan

    dev = torch.device(device)
    rows: list[bench.Row] = []
    for n in seqlens:
        q, k, v = synthetic_qkv(Shape(batch, q_heads, kv_heads, n, head_dim, dtype), device=dev)
        causal_pairs = batch * q_heads * n * (n + 1) / 2
        base = bench.cudnn_row(q, k, v, log=log)
        cudnn_ms = base.ms
        rows.append(base)
        for name, method, params in cases:
            if method not in methods:
                continue
            params = {**params, "block": block}
            threshold = params["threshold"]
            tile_params = {key: val for key, val in params.items() if key != "threshold"}
            weights_fn = fast.xattention_tile_weights if method == "xattention" else fast.dpxa_tile_weights
            run_fn = fast.xattention if method == "xattention" else fast.dpxa

            def scoring() -> torch.Tensor:
                return weights_fn(q, k, **tile_params)

            weights = scoring()

            def selection() -> BlockColumnPlan:
                return tiles_to_plan(select_tiles(weights, threshold), seqlen=n, block=block)

            plan = selection()
            split: dict[str, Any] = {"scoring_ms": bench.bench_ms(scoring), "selection_ms": bench.bench_ms(selection),
                                     "kernel_ms": bench.bench_ms(lambda: block_column_attention(
                                         q, k, v, plan, validate_plan=False))}
            if method == "dpxa":
                cos = params["cos_threshold"]
                split["anchors_ms"] = bench.bench_ms(lambda: (
                    delta_anchor_lists(q, cos_threshold=cos, block=block),
                    delta_anchor_lists(k, cos_threshold=cos, block=block)))
                split["scoring_ratio"] = float(fast.dpxa_scoring_ratio(q, k, cos_threshold=cos,
                                                                       block=block).mean())
            else:
                stride = params["stride"]
                split["scoring_ratio"] = (1 / stride if params.get("scoring", "antidiagonal") == "antidiagonal"
                                          else (cdiv(block, stride) / block) ** 2)
            ms = bench.bench_ms(lambda: run_fn(q, k, v, **params))
            dens = float(fast.density(plan).mean())
            keep = plan.block_mask()
            causal_tiles = plan.num_query_blocks * (plan.num_query_blocks + 1) / 2
            split.update({
                "params": params, "tiles_computed": float(keep.sum()) / (batch * q_heads * causal_tiles),
                "scoring_vs_cudnn": split["scoring_ms"] / cudnn_ms, "floor_ms": dens * cudnn_ms,
                "kernel_over_floor": split["kernel_ms"] / (dens * cudnn_ms),
            })
            rec_mean = rec_min = None
            if with_recall:
                rec = fast.recall(q, k, plan)
                rec_mean, rec_min = float(rec.mean()), float(rec.min())
            rows.append(bench.Row(name, "sparseprefill", n, dens, rec_mean, rec_min, ms,
                            split["scoring_ms"] + split["selection_ms"],
                            4 * head_dim * dens * causal_pairs / ms / 1e9, cudnn_ms / ms, split))
            log(f"N={n}: {name} {ms:.2f} ms density {dens:.4f} {split}")
            del weights, plan, keep
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        del q, k, v
    return rows


def tile_suite(method: str) -> BenchSuite:
    """The tile suite (`run_tile_suite`) restricted to `method`'s cases."""
    def run(seqlens: list[int], *, flex: bool = True, **kwargs: Any) -> list[bench.Row]:
        return run_tile_suite(seqlens, methods=(method,), **kwargs)
    return BenchSuite(about=f"{method}: tile scoring / selection / kernel split", seqlens=(32768, 131072), run=run)


METHOD = register(Method(
    name="xattention",
    notes="XAttention: antidiagonal stride-level scores, row softmax summed into tiles, greedy "
          "threshold selection (thesis sec. 2.5)",
    reference_plan=reference.xattention_plan,
    fast_plan=fast.xattention_plan,
    reference_run=reference.xattention,
    fast_run=fast.xattention,
    defaults=lambda n: {"stride": 8, "threshold": 0.9, "block": tile_block(n)},
    sweep=lambda n: [{"stride": 8, "threshold": t, "block": tile_block(n)} for t in TILE_SWEEP],
    chunked="each query tile's antidiagonal scores against the keys: the chunk's own tiles",
    sync=SyncStatus(
        syncs=("tiles to plan: the most kept tiles of a row (reference.plan.mask_to_list, .max().item())",),
        static_bound="T = ceil(N / block) key blocks per query block"),
    bench=tile_suite("xattention"),
))
