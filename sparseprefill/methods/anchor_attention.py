"""AnchorAttention (Zhang et al.) as a method descriptor, with its benchmark suite."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import bench, fast, reference
from ..reference.anchor_attention import check_anchor_params
from ._common import keyword_check
from ._core import Ablation, BenchArgument, BenchSuite, Method, MethodView, SyncStatus, register


def defaults(n: int) -> dict[str, Any]:
    # The paper's theta and blocks; step 16 from 16K on, smaller below so that a
    # prompt has at least 8 groups (one group is all window, hence dense).
    return {"step": max(1, min(16, -(-n // 128) // 8))}


# AnchorAttention's headline claim (Zhang et al., 2025, Sections 1 and 4: A100, 128K,
# Llama-3.1-8B on RULER), quoted beside our measured ratios.
ANCHOR_PAPER_CLAIM = "4.6x over FlashAttention at 128K (paper, A100)"


def run_anchor_suite(
    seqlens: list[int], *, batch: int = 1, q_heads: int = 32, kv_heads: int = 8,
    head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, theta: float = 12.0, step: int = 16,
    block: int = 128, with_recall: bool = True, log: Callable[[str], None] = print,
    device: str = "cuda", timer: Callable[[Callable[[], Any]], float] | None = None,
) -> list[bench.Row]:
    """AnchorAttention benchmark (issue 11) on the demo's structured workload: end to end,
    and split into anchor pass / stripe identification / stripe kernel, against cuDNN
    SDPA and flash SDPA in the same run.

    Extras of the AnchorAttention row: the stage times; `anchor_density` (the anchor
    blocks' share of the causal area); `overhead_vs_cudnn`, the anchor pass and the
    identification beyond what the anchor blocks' own attention costs at cuDNN's rate,
    `(anchor_ms + identification_ms - anchor_density * cudnn_ms) / cudnn_ms` (target <=
    5% at 128K); `vs_floor`, end to end over `density * cudnn_ms` (target <= 1.25);
    `speedup_vs_flash`; the stripe plan's MB and widest list. The stages run on all
    heads at once (one plan); `fast.anchor_attention` (the end-to-end row) plans query
    heads in groups that fit `PLAN_BYTES`.

    `device` and `timer` exist so that the rows can be checked on a CPU (interpreter,
    tiny sizes, a fake timer); on a GPU leave them.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    from .. import fast
    from ..workload import Shape, bench_qkv as synthetic_qkv
    from ..fast.anchor_attention import _plans
    from ..fast.kernels import block_column_attention
    from ..fast.kernels.anchor_stripes import stripe_index
    from ..reference.attention import AttentionState

    dev = torch.device(device)
    timed = timer or bench.bench_ms
    rows: list[bench.Row] = []
    params: dict[str, Any] = {"theta": theta, "step": step, "block_m": block, "block_n": block}
    for n in seqlens:
        q, k, v = synthetic_qkv(Shape(batch, q_heads, kv_heads, n, head_dim, dtype), device=dev)
        causal_pairs = batch * q_heads * n * (n + 1) / 2
        dense_flops = 4 * head_dim * causal_pairs
        g = q_heads // kv_heads
        base_ms: dict[str, float] = {}
        reference_out = None
        for name, backend in (("cuDNN SDPA", SDPBackend.CUDNN_ATTENTION),
                              ("flash SDPA", SDPBackend.FLASH_ATTENTION)):
            try:
                ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

                def sdpa(backend: SDPBackend = backend) -> Any:
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)

                out = sdpa()
                if reference_out is None:
                    reference_out = out
                base_ms[name] = timed(sdpa)
                del ke, ve
            except (RuntimeError, torch.OutOfMemoryError) as exc:
                log(f"{name} failed at N={n}: {type(exc).__name__}: {exc}")
                base_ms[name] = float("nan")
        cudnn_ms, flash_ms = base_ms["cuDNN SDPA"], base_ms["flash SDPA"]
        for name, ms in base_ms.items():
            rows.append(bench.Row("dense", name, n, 1.0, 1.0, 1.0, ms, None, dense_flops / ms / 1e9,
                            cudnn_ms / ms))
        log(f"N={n}: cuDNN {cudnn_ms:.2f} ms, flash {flash_ms:.2f} ms")

        sizes = {"step": step, "block_m": block, "block_n": block}
        anchor_plan = _plans(batch, q_heads, n, **sizes, counts=None, index=None, device=dev,
                             with_blocks=True)

        def anchor() -> AttentionState:
            state = AttentionState.like(q)
            block_column_attention(q, k, v, anchor_plan, state=state, validate_plan=False)
            return state

        state = anchor()

        def identify() -> tuple[torch.Tensor, torch.Tensor]:
            return stripe_index(q, k, state.m, theta=theta, scale=head_dim ** -0.5, **sizes)

        counts, index = identify()
        stripe_plan = _plans(batch, q_heads, n, **sizes, counts=counts, index=index, device=dev,
                             with_blocks=False)
        work = state.clone()

        def stripes() -> Any:
            # Resumes from `work` (each timed call resumes again: the same work every time).
            return block_column_attention(q, k, v, stripe_plan, state=work, validate_plan=False)

        out_stages, _ = block_column_attention(q, k, v, stripe_plan, state=state.clone(),
                                               validate_plan=False)
        anchor_ms, ident_ms, stripe_ms = timed(anchor), timed(identify), timed(stripes)

        def e2e() -> Any:
            return fast.anchor_attention(q, k, v, **params)

        out = e2e()
        ms = timed(e2e)
        plan = _plans(batch, q_heads, n, **sizes, counts=counts, index=index, device=dev,
                      with_blocks=True)
        dens = float(fast.density(plan).mean())
        anchor_dens = float(fast.density(anchor_plan).mean())
        rec_mean = rec_min = None
        if with_recall:
            rec = fast.recall(q, k, plan)
            rec_mean, rec_min = float(rec.mean()), float(rec.min())
        err = None
        if reference_out is not None:
            err = float((out.float() - reference_out.float()).norm() / reference_out.float().norm())
        stages_vs_e2e = float((out_stages.float() - out.float()).abs().max())
        extra = {
            "params": params, "anchor_ms": anchor_ms, "identification_ms": ident_ms,
            "stripe_ms": stripe_ms, "stages_sum_ms": anchor_ms + ident_ms + stripe_ms,
            "anchor_density": anchor_dens,
            "overhead_vs_cudnn": (anchor_ms + ident_ms - anchor_dens * cudnn_ms) / cudnn_ms,
            "identification_vs_cudnn": ident_ms / cudnn_ms,
            "vs_floor": ms / (dens * cudnn_ms),
            "speedup_vs_flash": flash_ms / ms,
            "paper_claim": ANCHOR_PAPER_CLAIM,
            "rel_err_vs_cudnn": err,
            "stages_vs_e2e_max_abs_diff": stages_vs_e2e,
            "stripe_plan_mb": (stripe_plan.column_count.untyped_storage().nbytes()
                               + stripe_plan.column_index.untyped_storage().nbytes()) / 2**20,
            "stripe_width": int(index.shape[-1]),
        }
        rows.append(bench.Row("anchor_attention", "sparseprefill", n, dens, rec_mean, rec_min, ms,
                        anchor_ms + ident_ms, 4 * head_dim * dens * causal_pairs / ms / 1e9,
                        cudnn_ms / ms, extra))
        log(f"N={n}: anchor_attention {ms:.2f} ms (anchor {anchor_ms:.2f}, identification "
            f"{ident_ms:.2f}, stripes {stripe_ms:.2f}), density {dens:.4f}: {cudnn_ms / ms:.2f}x "
            f"over cuDNN, {flash_ms / ms:.2f}x over flash SDPA; {ANCHOR_PAPER_CLAIM}")
        del q, k, v, state, work, plan, stripe_plan, anchor_plan, out, out_stages, reference_out
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _suite(seqlens: list[int], *, flex: bool = True, **kwargs: Any) -> list[bench.Row]:
    return run_anchor_suite(seqlens, **kwargs)


def extras(impl_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: dict[str, Any],
           view: MethodView) -> dict[str, float]:
    """`stripe_width`: the widest stripe list (the plan's column width, the static bound's rival)."""
    assert view.plan is not None
    return {"stripe_width": float(view.plan.column_index.shape[-1])}


METHOD = register(Method(
    check=keyword_check(check_anchor_params),
    name="anchor_attention",
    knobs=("theta",),
    notes="AnchorAttention: initial block + group window as anchor, difference-aware stripes "
          "per group of step query blocks, stripe pass resuming the anchor state",
    reference_plan=reference.anchor_attention_plan,
    fast_plan=fast.anchor_attention_plan,
    reference_run=reference.anchor_attention,
    fast_run=fast.anchor_attention,
    defaults=defaults,
    sweep=lambda n: [{**defaults(n), "theta": t} for t in (3.0, 6.0, 9.0, 12.0, 15.0)],
    calibration=lambda n: [{**defaults(n), "theta": t} for t in (3.0, 6.0, 9.0, 12.0, 15.0, 20.0)],
    ablations=(Ablation("theta x step", lambda n: [{"theta": t, "step": s, "block_m": 128, "block_n": 128}
                                                   for t in (6.0, 9.0, 12.0, 15.0) for s in (1, 4, 16)],
                        about="the paper's theta against the group size step (docs/anchor_attention.md)"),),
    extras=extras,
    chunked="each query block's anchor and its group's stripes: the chunk's own rows (chunks start on a "
            "group of `step` query blocks)",
    sync=SyncStatus(
        syncs=("stripe identification: the longest stripe list (tile_count.sum(2).max().item())",
               "stripe pass: promoting whole stripe blocks to blocks (BlockColumnPlan.with_full_blocks: "
               "bool(promote.any()), mask_to_list width, new column width)"),
        static_bound="the last group's search region (about N keys per group); no block promotion",
        note="static stripe lists: 4 * B * Hq * G * N bytes (heads in groups above 256 MB); the stripes "
             "stay column gathers (the whole method on an H200 at 128K: 1185 ms so, 610 ms promoted)"),
    bench=BenchSuite(
        about="AnchorAttention end to end and per stage",
        seqlens=(32768, 131072),
        run=_suite,
        arguments=(BenchArgument("--theta", "theta", float, 12.0, "anchor_attention: theta"),
                   BenchArgument("--step", "step", int, 16, "anchor_attention: step"))),
))
