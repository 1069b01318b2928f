"""XAttention (antidiagonal tile scoring, DeltaAttention thesis sec. 2.5) as a method descriptor,
with the tile-method benchmark suite that DPXA shares."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import bench, fast, reference
from ..reference.plan import BlockColumnPlan, cdiv
from ..reference.xattention import check_xattention_params
from ._common import (
    EVIDENCE_BLOCK,
    TILE_CALIBRATION,
    TILE_EVIDENCE,
    TILE_SWEEP,
    keyword_check,
    tile_block,
    tile_grid,
    tiles_computed,
)
from ._core import Ablation, BenchSuite, Method, MethodView, SyncStatus, register


def exact_tile_mass_plan(q: torch.Tensor, k: torch.Tensor, *, threshold: float, block: int = EVIDENCE_BLOCK,
                         scale: float | None = None) -> BlockColumnPlan:
    """XAttention's greedy rule on the ideal scorer: the true attention mass of every tile
    (summed over the query tile's rows, float64), normalised per query tile, so that the
    distance to the oracle splits into what `block`-token tiles cost and what scoring costs.

    q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`. Memory O(256 * N) per head.
    """
    import math

    b, hq, n, d = q.shape
    g = hq // k.shape[1]
    t = cdiv(n, block)
    sm = 1.0 / math.sqrt(d) if scale is None else float(scale)
    key_tile = torch.arange(n, device=q.device) // block
    mass = torch.zeros(b, hq, t, t, dtype=torch.float64, device=q.device)
    k64 = k.to(torch.float64).repeat_interleave(g, dim=1)
    for r0 in range(0, n, 256):
        r1 = min(n, r0 + 256)
        rows = torch.arange(r0, r1, device=q.device)
        s = torch.matmul(q[:, :, r0:r1].to(torch.float64), k64.transpose(-1, -2)) * sm
        p = torch.softmax(s.masked_fill(torch.arange(n, device=q.device)[None, :] > rows[:, None], -math.inf), -1)
        per_row = torch.zeros(b, hq, r1 - r0, t, dtype=torch.float64, device=q.device).index_add_(-1, key_tile, p)
        mass.index_add_(2, rows // block, per_row)
    from ..reference.xattention import normalize_rows, tiles_to_plan

    return tiles_to_plan(reference.select_tiles(normalize_rows(mass), threshold), seqlen=n, block=block)


def skip_plan(q: torch.Tensor, k: torch.Tensor, *, threshold: float, skip: float, stride: int = 8,
              block: int = EVIDENCE_BLOCK, first_tile: str = "kept", scale: float | None = None) -> BlockColumnPlan:
    """The thesis's ablation (sec. 4.2.2): XAttention's tiles with the lightest `skip` share of
    the selected off-diagonal tiles dropped (`reference.skip_tiles`, which keeps the first key
    tile); `first_tile="skippable"` is the literal reading that may drop the first tile too."""
    from ..reference.delta_xattention import rank_off_diagonal, share_of
    from ..reference.xattention import tiles_to_plan

    weights = reference.xattention_tile_weights(q, k, stride=stride, block=block, scale=scale)
    selected = reference.select_tiles(weights, threshold)
    if first_tile == "kept":
        kept = reference.skip_tiles(weights, selected, skip)
    else:
        bsz, h, t, _ = weights.shape
        order, count = rank_off_diagonal(weights, selected, first=True)
        pos = torch.arange(t * t, device=weights.device)
        dropped = (pos >= (count - share_of(skip, count)).unsqueeze(-1)) & (pos < count.unsqueeze(-1))
        gone = torch.zeros(bsz, h, t * t, dtype=torch.bool, device=weights.device).scatter_(-1, order, dropped)
        kept = selected & ~gone.view(bsz, h, t, t)
    return tiles_to_plan(kept, seqlen=q.shape[2], block=block)


def scoring_ratio(params: dict[str, Any]) -> float:
    """The share of a full tile's score cells the scoring computes (thesis "Score%"): 1/S for
    antidiagonal scoring, `(ceil(block / S) / block)^2` for naive, 1 for the exact tile mass."""
    if "stride" not in params:
        return 1.0
    stride, block = int(params["stride"]), int(params.get("block", 128))
    if params.get("scoring", "antidiagonal") == "antidiagonal":
        return 1.0 / stride
    return (cdiv(block, stride) / block) ** 2


def extras(impl_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: dict[str, Any],
           view: MethodView) -> dict[str, float]:
    return {"tiles_computed": tiles_computed(view), "scoring_ratio": scoring_ratio(params)}


SKIPS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)


def skip_grid(threshold: float, first_tile: str) -> Callable[[int], list[dict[str, Any]]]:
    return lambda n: [{"stride": 8, "threshold": threshold, "skip": f, "block": EVIDENCE_BLOCK,
                       "first_tile": first_tile} for f in SKIPS]


ABLATIONS = (
    Ablation("s8", tile_grid(stride=8), about="stride 8 over the wide threshold grid"),
    Ablation("s16", tile_grid(stride=16)),
    Ablation("naive s3", tile_grid(stride=3, scoring="naive"),
             about="thesis 4.3: the first token of each group, no head-dim expansion"),
    Ablation("naive s4", tile_grid(stride=4, scoring="naive")),
    Ablation("exact tile mass", lambda n: [{"threshold": t, "block": EVIDENCE_BLOCK} for t in TILE_EVIDENCE],
             reference_plan=exact_tile_mass_plan, about="the ideal scorer for the same greedy rule"),
    *(Ablation(f"skip{t}{'' if first == 'kept' else '-literal'}", skip_grid(t, first),
               reference_plan=skip_plan, about="thesis 4.2.2: XAttention dropping its lightest tiles")
      for first in ("kept", "skippable") for t in (0.8, 0.9, 0.95)),
)


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
    from ..workload import Shape, bench_qkv as synthetic_qkv
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
    check=keyword_check(check_xattention_params),
    name="xattention",
    knobs=("threshold",),
    notes="XAttention: antidiagonal stride-level scores, row softmax summed into tiles, greedy "
          "threshold selection (thesis sec. 2.5)",
    reference_plan=reference.xattention_plan,
    fast_plan=fast.xattention_plan,
    reference_run=reference.xattention,
    fast_run=fast.xattention,
    defaults=lambda n: {"stride": 8, "threshold": 0.9, "block": tile_block(n)},
    sweep=lambda n: [{"stride": 8, "threshold": t, "block": tile_block(n)} for t in TILE_SWEEP],
    calibration=lambda n: [{"stride": 8, "threshold": t, "block": tile_block(n)} for t in TILE_CALIBRATION],
    ablations=ABLATIONS,
    extras=extras,
    chunked="each query tile's antidiagonal scores against the keys: the chunk's own tiles",
    sync=SyncStatus(
        syncs=("tiles to plan: the widest row of the selection kernel's lists (count.max().item()); the "
               "torch path (T > 4096 or CPU) uses mask_to_list",),
        static_bound="T = ceil(N / block) key blocks per query block"),
    bench=tile_suite("xattention"),
))
