"""Delta-KV (DeltaAttention thesis) as a method descriptor, with its report view and benchmark suite."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import bench, fast, reference
from ..reference._checks import check_knob
from ..reference.delta_kv import check_metric, check_threshold, kv_threshold
from ._core import Ablation, BenchSuite, Method, MethodView, SyncStatus, register


# The parameters of stage 1 (the keep mask).
STAGE1 = ("threshold", "metric", "chunk")


def stage1(params: dict[str, Any], heads: int, kv_heads: int) -> dict[str, Any]:
    """`delta_keep_mask`'s arguments from the method's parameters on `heads` query heads: a
    per-head threshold (one value per query head, equal within each KV group) becomes
    its one value per KV head (`reference.delta_kv.kv_threshold`)."""
    out = {name: params[name] for name in STAGE1 if name in params}
    if "threshold" in out:
        out["threshold"] = kv_threshold(out["threshold"], out.get("metric", "euclidean"), heads, kv_heads)
    return out


def check_params(params: Any) -> None:
    """`Method.check`: the metric, then the threshold (a scalar or one value per query head)
    under that metric (a Euclidean threshold is >= 0), before any work."""
    metric = check_metric(params.get("metric", "euclidean"))
    if params.get("threshold") is not None:
        check_knob("threshold", params["threshold"], lambda t: check_threshold(t, metric))


def packing(impl: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: dict[str, Any]) -> Any:
    """`impl`'s keep mask and packing (`PackedKV`) for the method's parameters."""
    keep = impl.delta_keep_mask(k, **stage1(params, int(q.shape[1]), int(k.shape[1])))
    return impl.delta_pack(k, v, keep, block=int(params.get("block_n", 64)))


def view(impl_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         params: dict[str, Any]) -> MethodView:
    """Density (score entries computed, both phases) and the phase-2 plan to draw; no recall."""
    impl: Any = fast if impl_name == "fast" else reference
    packed = packing(impl, q, k, v, params)
    block_m = int(params.get("block_m", 64))
    _, exact = impl.delta_kv_plans(q, packed, block_m=block_m)
    return MethodView(density=impl.delta_kv_density(q, packed, block_m=block_m), recall=None, plan=exact,
                      notes=f"keep ratio {float(packed.keep_ratio().mean()):.3f}")


def extras(impl_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: dict[str, Any],
           view: MethodView) -> dict[str, float]:
    """The keep ratio (anchors over keys) and the exact mass: the full-attention mass on the
    keys phase 2 computes exactly (per head the mean over rows; mean and min over heads)."""
    impl: Any = fast if impl_name == "fast" else reference
    assert view.plan is not None
    exact = impl.recall(q, k, view.plan).double().mean(dim=-1)
    return {"keep_ratio": float(packing(impl, q, k, v, params).keep_ratio().mean()),
            "exact_mass_mean": float(exact.mean()), "exact_mass_min": float(exact.min())}


# The thesis's two ablations (`compare --ablations`, docs/delta_kv.md) at these thresholds.
ABLATE = (("euclidean", 10.0), ("euclidean", 12.0), ("cosine", 0.85), ("cosine", 0.75))
ABLATIONS = (
    Ablation("euclidean", lambda n: [{"threshold": t, "metric": "euclidean"} for t in (8.0, 10.0, 12.0, 14.0)],
             about="the Euclidean metric"),
    Ablation("uniform anchors", lambda n: [{"threshold": t, "metric": m, "count_weighted": False} for m, t in ABLATE],
             about="anchors without the log-count bias"),
    Ablation("no exact diagonal", lambda n: [{"threshold": t, "metric": m, "exact_diagonal": False}
                                             for m, t in ABLATE],
             about="the critical diagonal packed too"),
    Ablation("block128", lambda n: [{"threshold": t, "metric": "cosine", "block_m": 128, "block_n": 128}
                                     for t in (0.95, 0.9, 0.85, 0.8, 0.75, 0.7)],
             about="DeltaXAttention's tiles (its yardstick, docs/delta_xattention.md)"),
)


DELTA_KV_THRESHOLDS = (0.9, 0.83, 0.78)


def run_delta_kv_suite(
    seqlens: list[int], *, batch: int = 1, q_heads: int = 32, kv_heads: int = 8,
    head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, with_recall: bool = True,
    log: Callable[[str], None] = print, thresholds: tuple[float, ...] = DELTA_KV_THRESHOLDS,
    device: str = "cuda",
) -> list[bench.Row]:
    """Delta-KV (issue 12) end to end on the demo's workload, cosine thresholds of the thesis.

    Split: keep mask, packing, phase 1 (packed anchors), phase 2 (critical diagonal);
    cuDNN SDPA in the same run; density is the score entries both phases compute, so
    `density x cuDNN` is the floor; the keep ratio is reported beside it.
    """
    from .. import fast
    from ..workload import Shape, bench_qkv as synthetic_qkv
    from ..fast.kernels import block_column_attention
    from ..fast.kernels.block_column import ragged_block_column_attention
    from ..fast.kernels.delta_pack import keep_mask, pack
    from ..reference.attention import AttentionState

    dev = torch.device(device)
    rows: list[bench.Row] = []
    for n in seqlens:
        q, k, v = synthetic_qkv(Shape(batch, q_heads, kv_heads, n, head_dim, dtype), device=dev)
        base = bench.cudnn_row(q, k, v, log=log)
        rows.append(base)
        for threshold in thresholds:
            def mask() -> Any:
                return keep_mask(k, threshold=threshold, cosine=True, chunk=512)

            keep, chunk_counts = mask()
            packed = pack(k, v, keep, chunk_counts, chunk=512, block=64)
            plan1, plan2 = fast.delta_kv_plans(q, packed, block_m=64)
            bias = torch.log(packed.counts.to(torch.float32))
            offsets = packed.offsets[:-1].contiguous()

            def phase1() -> Any:
                state = AttentionState.like(q)
                ragged_block_column_attention(q, packed.k, packed.v, offsets, plan1, key_bias=bias, state=state)
                return state

            state = phase1()

            def phase2() -> Any:
                return block_column_attention(q, k, v, plan2, state=state.clone(), validate_plan=False)

            def e2e() -> Any:
                return fast.delta_kv(q, k, v, threshold=threshold, metric="cosine")

            split = {"keep_mask_ms": bench.bench_ms(mask),
                     "pack_ms": bench.bench_ms(lambda: pack(k, v, keep, chunk_counts, chunk=512, block=64)),
                     "plans_ms": bench.bench_ms(lambda: fast.delta_kv_plans(q, packed, block_m=64)),
                     "phase1_ms": bench.bench_ms(phase1), "phase2_ms": bench.bench_ms(phase2),
                     "keep_ratio": float(packed.keep_ratio().mean()), "threshold": threshold}
            ms = bench.bench_ms(e2e)
            dens = float(fast.delta_kv_density(q, packed, block_m=64).mean())
            out = e2e()
            exact = block_column_attention(q, k, v, fast.dense_plan(q, k), validate_plan=False)[0]
            split["rel_err_vs_dense"] = float((out.float() - exact.float()).norm() / exact.float().norm())
            split["floor_ms"] = dens * base.ms
            rows.append(bench.Row(f"delta_kv cos {threshold}", "sparseprefill", n, dens, None, None, ms,
                            split["keep_mask_ms"] + split["pack_ms"] + split["plans_ms"],
                            4 * head_dim * dens * batch * q_heads * n * (n + 1) / 2 / ms / 1e9,
                            base.ms / ms, split))
            log(f"N={n}: delta_kv cos {threshold} {ms:.2f} ms {split}")
            del keep, packed, plan1, plan2, state
        del q, k, v
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _suite(seqlens: list[int], *, flex: bool = True, **kwargs: Any) -> list[bench.Row]:
    return run_delta_kv_suite(seqlens, **kwargs)


METHOD = register(Method(
    name="delta_kv",
    notes="Delta-KV: anchors of similar-key runs packed with counts; exact critical diagonal",
    reference_run=reference.delta_kv,
    fast_run=fast.delta_kv,
    defaults=lambda n: {"threshold": 0.83, "metric": "cosine"},
    knobs=("threshold",),
    kv_knobs=("threshold",),
    check=check_params,
    sweep=lambda n: [{"threshold": t, "metric": "cosine"} for t in (0.95, 0.9, 0.85, 0.8, 0.75, 0.7)],
    ablations=ABLATIONS,
    extras=extras,
    view=view,
    sync=SyncStatus(
        syncs=("packing: the packed buffer's size (offsets[-1].item())",
               "packing: repeat_interleave of segment ids (output size read back)",
               "phase 2: the block-list width (count2.max().item())",
               "phase 1: whether any query block reads packed keys (bool(...any()))",
               "phase 1: the ragged launcher's offset range check (int(kv_offsets.min()), .max())"),
        capture_safe=False,
        note="the packed keys' count is data-dependent; a static variant would size the buffer "
             "for no compression (B * Hkv * N keys)"),
    bench=BenchSuite(about="keep mask, packing and the two phases", seqlens=(32768, 131072, 262144), run=_suite),
))
