"""DeltaXAttention (DeltaAttention thesis, sec. 4.2) as a method descriptor, with its report
view and benchmark suite."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import bench, fast, reference
from ..reference.delta_xattention import PACKED, SKIPPED
from ..reference.xattention import check_xattention_params
from ._common import keyword_check, tile_block
from ._core import Ablation, BenchSuite, Method, MethodView, SyncStatus, register

# The parameters of the tile selection and of the per-tile packing.
TILES = ("stride", "threshold", "exact_top", "block", "scoring", "unselected", "scale")
PACK = ("delta_threshold", "metric", "block", "packed_block")


def pick(params: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The entries of `params` named in `names`."""
    return {name: params[name] for name in names if name in params}


def modes(impl: Any, q: torch.Tensor, k: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """`impl`'s tile modes (skip / exact / packed) for the method's parameters."""
    out: torch.Tensor = impl.delta_xattention_tiles(q, k, **pick(params, TILES))
    return out


def packing(impl: Any, k: torch.Tensor, v: torch.Tensor, params: dict[str, Any]) -> Any:
    """`impl`'s per-tile packing (`TilePackedKV`) for the method's parameters."""
    return impl.delta_tile_pack(k, v, **pick(params, PACK))


def view(impl_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
         params: dict[str, Any]) -> MethodView:
    """Density (score entries of both launches), the exact tiles' plan to draw; no recall."""
    impl: Any = fast if impl_name == "fast" else reference
    tile_modes = modes(impl, q, k, params)
    packed = packing(impl, k, v, params)
    exact, _ = impl.delta_xattention_plans(q, tile_modes, packed)
    reduction = float(impl.delta_xattention_kv_reduction(tile_modes, packed).mean())
    share = float((tile_modes == PACKED).sum()) / max(1.0, float((tile_modes != 0).sum()))
    return MethodView(density=impl.delta_xattention_density(tile_modes, packed), recall=None, plan=exact,
                      notes=f"KV reduction {reduction:.3f}, packed tiles {share:.3f}")


def extras(impl_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: dict[str, Any],
           view: MethodView) -> dict[str, float]:
    """The thesis's KV reduction `f (1 - p)` (keys loaded relative to XAttention's same tiles),
    the tiles' keep ratio, the share of packed tiles among the computed ones, and the
    full-attention mass on the exact tiles and on the computed (exact or packed) tiles."""
    from ..fast.xattention import tiles_to_plan as fast_to_plan
    from ..reference.xattention import tiles_to_plan as reference_to_plan

    impl: Any = fast if impl_name == "fast" else reference
    tile_modes = modes(impl, q, k, params)
    packed = packing(impl, k, v, params)
    to_plan = fast_to_plan if impl_name == "fast" else reference_to_plan
    computed = to_plan(tile_modes != SKIPPED, seqlen=q.shape[2], block=int(params.get("block", 128)))
    assert view.plan is not None
    return {"kv_reduction": float(impl.delta_xattention_kv_reduction(tile_modes, packed).mean()),
            "keep_ratio": float(packed.keep_ratio().mean()),
            "packed_tiles": float((tile_modes == PACKED).sum()) / max(1.0, float((tile_modes != SKIPPED).sum())),
            "exact_mass": float(impl.recall(q, k, view.plan).double().mean()),
            "covered_mass": float(impl.recall(q, k, computed).double().mean())}


# The thesis's variants (`compare --ablations`, docs/delta_xattention.md): (label, exact_top,
# unselected), each over XAttention thresholds x cosine thresholds at stride 8, 128-token tiles.
VARIANTS = (("diag", 0.0, "skip"), ("tw10", 0.1, "skip"), ("tw10 fill", 0.1, "packed"), ("sketch", 1.0, "packed"))
def variant_grid(top: float, unselected: str) -> Callable[[int], list[dict[str, Any]]]:
    return lambda n: [{"stride": 8, "threshold": t, "exact_top": top, "unselected": unselected,
                       "delta_threshold": c, "metric": "cosine", "block": 128, "packed_block": 32}
                      for t in (0.8, 0.9, 0.95) for c in (0.95, 0.9, 0.85, 0.8, 0.75)]


ABLATIONS = tuple(
    Ablation(label, variant_grid(top, unselected),
             about={"diag": "only the diagonal exact", "tw10": "the heaviest 10% of selected tiles exact too",
                    "tw10 fill": "tw10, the unselected causal tiles packed instead of dropped",
                    "sketch": "every selected tile exact, every unselected causal tile packed"}[label])
    for label, top, unselected in VARIANTS)


# DeltaXAttention cases of `run_delta_xattention_suite`: (row name, parameters); stride 8.
DX_CASES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("delta_xattention cos0.9 tw10", {"delta_threshold": 0.9, "metric": "cosine", "threshold": 0.9,
                                       "exact_top": 0.1}),
    ("delta_xattention cos0.83 tw10", {"delta_threshold": 0.83, "metric": "cosine", "threshold": 0.9,
                                        "exact_top": 0.1}),
    ("delta_xattention cos0.83 diag", {"delta_threshold": 0.83, "metric": "cosine", "threshold": 0.9,
                                        "exact_top": 0.0}),
)


def run_delta_xattention_suite(
    seqlens: list[int], *, batch: int = 1, q_heads: int = 32, kv_heads: int = 8,
    head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, with_recall: bool = True,
    log: Callable[[str], None] = print, block: int = 128, packed_blocks: tuple[int, ...] = (32, 64),
    cases: tuple[tuple[str, dict[str, Any]], ...] = DX_CASES, device: str = "cuda",
) -> list[bench.Row]:
    """DeltaXAttention (issue 12, thesis 4.2) on the demo's workload, cuDNN SDPA in the same run.

    Per case and packed block: the stages (XAttention scoring and selection, the
    exact/packed split, per-tile packing, plans, the packed launch and the exact launch),
    end to end; beside it XAttention's kernel on the same selected tiles (one row per
    threshold, "(same tiles)") and the thesis's ablation, XAttention skipping the same
    fraction of its lightest off-diagonal tiles (`skip_tiles` with `skip` = the measured
    KV reduction). `extra` has the KV reduction `f (1 - p)`, the keep ratio of the tiles,
    the share of packed tiles, `kernel_vs_xattention` (both launches over XAttention's
    kernel) and `floor_ms = density x cuDNN`; every output's relative error against the
    dense kernel. No recall: a packed tile changes the keys (`with_recall` is ignored).
    """
    from .. import fast
    from ..workload import Shape, bench_qkv as synthetic_qkv
    from ..fast.kernels import block_column_attention
    from ..fast.kernels.block_column import ragged_block_column_attention
    from ..fast.xattention import select_tiles, tiles_to_plan
    from ..reference.attention import AttentionState
    from ..reference.delta_xattention import tile_modes

    del with_recall
    dev = torch.device(device)
    rows: list[bench.Row] = []

    def rel_err(out: torch.Tensor, exact: torch.Tensor) -> float:
        return float((out.float() - exact.float()).norm() / exact.float().norm())

    for n in seqlens:
        q, k, v = synthetic_qkv(Shape(batch, q_heads, kv_heads, n, head_dim, dtype), device=dev)
        causal_pairs = batch * q_heads * n * (n + 1) / 2
        base = bench.cudnn_row(q, k, v, log=log)
        rows.append(base)
        exact_out = block_column_attention(q, k, v, fast.dense_plan(q, k), validate_plan=False)[0]
        weights = fast.xattention_tile_weights(q, k, stride=8, block=block)
        scoring_ms = bench.bench_ms(lambda: fast.xattention_tile_weights(q, k, stride=8, block=block))
        baselines: dict[float, tuple[float, torch.Tensor]] = {}
        for name, params in cases:
            threshold = float(params["threshold"])
            top = float(params["exact_top"])
            selected = select_tiles(weights, threshold)
            if threshold not in baselines:
                plan_x = tiles_to_plan(selected, seqlen=n, block=block)
                x_ms = bench.bench_ms(lambda: block_column_attention(q, k, v, plan_x, validate_plan=False))
                dens_x = float(fast.density(plan_x).mean())
                out_x = block_column_attention(q, k, v, plan_x, validate_plan=False)[0]
                rows.append(bench.Row(f"xattention s8 {threshold} (same tiles)", "sparseprefill", n, dens_x, None, None,
                                x_ms, scoring_ms, 4 * head_dim * dens_x * causal_pairs / x_ms / 1e9,
                                base.ms / x_ms, {"kernel_ms": x_ms, "rel_err_vs_dense": rel_err(out_x, exact_out),
                                                 "floor_ms": dens_x * base.ms}))
                baselines[threshold] = (x_ms, selected)
                del plan_x, out_x
            x_ms = baselines[threshold][0]

            def split() -> torch.Tensor:
                return tile_modes(selected, fast.exact_tiles(weights, selected, top), "skip")

            modes = split()
            selection_ms = bench.bench_ms(lambda: select_tiles(weights, threshold))
            split_ms = bench.bench_ms(split)
            for pb in packed_blocks:
                pack_args = {"delta_threshold": params["delta_threshold"], "metric": params["metric"],
                             "block": block, "packed_block": pb}
                packing = fast.delta_tile_pack(k, v, **pack_args)
                exact_plan, packed_plan = fast.delta_xattention_plans(q, modes, packing)
                counts = packing.packed.counts.to(torch.float32)
                bias = torch.log(counts)
                offsets = packing.region_offsets()

                def packed_launch() -> AttentionState:
                    state = AttentionState.like(q)
                    ragged_block_column_attention(q, packing.packed.k, packing.packed.v, offsets, packed_plan,
                                                  key_bias=bias, state=state)
                    return state

                state = packed_launch()

                def exact_launch() -> Any:
                    return block_column_attention(q, k, v, exact_plan, state=state.clone(), validate_plan=False)

                def e2e() -> torch.Tensor:
                    return fast.delta_xattention(q, k, v, stride=8, block=block, packed_block=pb, **params)

                reduction = fast.delta_xattention_kv_reduction(modes, packing)
                skip = float(reduction.mean())
                skip_plan = tiles_to_plan(fast.skip_tiles(weights, selected, skip), seqlen=n, block=block)
                extra: dict[str, Any] = {
                    "params": {**params, "stride": 8, "block": block, "packed_block": pb},
                    "scoring_ms": scoring_ms,
                    "selection_ms": selection_ms, "split_ms": split_ms,
                    "packing_ms": bench.bench_ms(lambda: fast.delta_tile_pack(k, v, **pack_args)),
                    "plans_ms": bench.bench_ms(lambda: fast.delta_xattention_plans(q, modes, packing)),
                    "packed_ms": bench.bench_ms(packed_launch), "exact_ms": bench.bench_ms(exact_launch),
                    "xattention_kernel_ms": x_ms,
                    "skip_kernel_ms": bench.bench_ms(lambda: block_column_attention(q, k, v, skip_plan,
                                                                               validate_plan=False)),
                    "skip_density": float(fast.density(skip_plan).mean()),
                    "kv_reduction": skip, "keep_ratio": float(packing.keep_ratio().mean()),
                    "packed_tiles": float((modes == 1).sum()) / max(1.0, float((modes != 0).sum())),
                    "packed_rows_loaded": float(packed_plan.block_count.to(torch.float64).sum()) * pb,
                }
                extra["kernel_vs_xattention"] = (extra["packed_ms"] + extra["exact_ms"]) / x_ms
                ms = bench.bench_ms(e2e)
                dens = float(fast.delta_xattention_density(modes, packing).mean())
                extra["floor_ms"] = dens * base.ms
                extra["rel_err_vs_dense"] = rel_err(e2e(), exact_out)
                extra["skip_rel_err_vs_dense"] = rel_err(
                    block_column_attention(q, k, v, skip_plan, validate_plan=False)[0], exact_out)
                estimate = sum(extra[key] for key in ("scoring_ms", "selection_ms", "split_ms", "packing_ms",
                                                     "plans_ms"))
                rows.append(bench.Row(f"{name} pb{pb}", "sparseprefill", n, dens, None, None, ms, estimate,
                                4 * head_dim * dens * causal_pairs / ms / 1e9, base.ms / ms, extra))
                log(f"N={n}: {name} pb{pb} {ms:.2f} ms density {dens:.4f} {extra}")
                del packing, exact_plan, packed_plan, state, skip_plan
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        del q, k, v, weights, exact_out, baselines
    return rows


def _suite(seqlens: list[int], *, flex: bool = True, **kwargs: Any) -> list[bench.Row]:
    return run_delta_xattention_suite(seqlens, **kwargs)


def _params(n: int, delta_threshold: float) -> dict[str, Any]:
    return {"stride": 8, "threshold": 0.9, "exact_top": 0.1, "delta_threshold": delta_threshold,
            "metric": "cosine", "block": tile_block(n), "packed_block": 32}


METHOD = register(Method(
    check=keyword_check(check_xattention_params),
    name="delta_xattention",
    knobs=("threshold",),
    notes="DeltaXAttention: XAttention's tiles, the diagonal and top tiles exact, the other "
          "selected tiles through per-tile Delta-KV anchors (thesis sec. 4.2)",
    reference_run=reference.delta_xattention,
    fast_run=fast.delta_xattention,
    defaults=lambda n: _params(n, 0.83),
    sweep=lambda n: [_params(n, t) for t in (0.95, 0.9, 0.85, 0.8, 0.75)],
    ablations=ABLATIONS,
    extras=extras,
    view=view,
    sync=SyncStatus(
        syncs=("exact tiles to plan: as xattention",
               "packing: each group's packed buffer size (offsets[-1].item()) and repeat_interleave of segment "
               "ids; merging groups (int(p.offsets[-1]))",
               "packed plan: the widest packed region (int(ends[..., -1].max())), the list width (mask_to_list)",
               "packed launch: whether any tile is packed (bool(...any()))",
               "packed launch: the ragged launcher's offset range check, as delta_kv"),
        capture_safe=False,
        note="the packed keys' count is data-dependent, as delta_kv"),
    bench=BenchSuite(
        about="DeltaXAttention stages, against XAttention's kernel on the same tiles and the tile-skip ablation",
        seqlens=(32768, 131072), run=_suite),
))
