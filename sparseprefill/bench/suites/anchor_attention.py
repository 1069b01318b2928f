"""`anchor_attention`: AnchorAttention end to end and per stage, beside cuDNN and flash SDPA.

Per N on the selected workload: cuDNN SDPA and flash SDPA dense, then AnchorAttention
(`--theta`, `--step`, `--block`) end to end (`fast.anchor_attention`, which plans query
heads in groups that fit its plan budget) and split into its stages, run on all heads
at once: the anchor pass (the initial block and each group's window through the block
kernel, `estimate_ms`), the stripe identification (`plan_ms` is the two together) and
the stripe pass resuming the anchor state (`kernel_ms`).

`extra`: the stage times; `anchor_density` (the anchor blocks' share of the causal
area); `overhead_vs_cudnn`, the anchor pass and the identification beyond what the
anchor blocks' own attention costs at cuDNN's rate, `(anchor + identification -
anchor_density x cuDNN) / cuDNN`; `speedup_vs_flash`; the stripe plan's MB and widest
list; the largest difference between the staged output and the end-to-end one (0:
they are the same computation) and the output's error against the baseline.
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
    baseline_unit,
    piece,
)

# AnchorAttention's headline claim (Zhang et al., 2025, Sections 1 and 4: A100, 128K,
# Llama-3.1-8B on RULER), quoted beside the measured ratios.
PAPER_CLAIM = "4.6x over FlashAttention at 128K (paper, A100)"


def _flash_ms(ctx: Context, n: int) -> float | None:
    if not ctx.on_gpu:
        return None
    q, k, v = ctx.inputs(n)
    try:
        return ctx.time(ctx.dense_attention(q, k, v, backend="flash"))
    except RuntimeError as exc:
        ctx.log(f"N={n}: flash SDPA failed: {exc}")
        return None


def anchor_rows(ctx: Context, n: int, *, theta: float, step: int, block: int) -> list[Row]:
    """The flash SDPA row (GPU) and the AnchorAttention row at N (see the module doc)."""
    from ... import fast
    from ...fast.anchor_attention import _plans
    from ...fast.kernels import block_column_attention
    from ...fast.kernels.anchor_stripes import stripe_index
    from ...reference.attention import AttentionState

    q, k, v = ctx.inputs(n)
    b, hq, _, d = q.shape
    rows: list[Row] = []
    flash_ms = _flash_ms(ctx, n)
    if flash_ms is not None:
        rows.append(ctx.row("dense", "flash SDPA", n, ms=flash_ms, kernel_ms=flash_ms, density=1.0,
                            recall_mean=1.0, recall_min=1.0))
    sizes = {"step": step, "block_m": block, "block_n": block}
    anchor_plan = _plans(b, hq, n, **sizes, counts=None, index=None, device=q.device, with_blocks=True)

    def anchor() -> AttentionState:
        state = AttentionState.like(q)
        block_column_attention(q, k, v, anchor_plan, state=state, validate_plan=False)
        return state

    state = anchor()

    def identify() -> tuple[torch.Tensor, torch.Tensor]:
        return stripe_index(q, k, state.m, theta=theta, scale=d ** -0.5, **sizes)

    counts, index = identify()
    stripe_plan = _plans(b, hq, n, **sizes, counts=counts, index=index, device=q.device, with_blocks=False)
    work = state.clone()

    def stripes() -> Any:
        # Resumes from `work`: every timed call does the same work.
        return block_column_attention(q, k, v, stripe_plan, state=work, validate_plan=False)

    staged, _ = block_column_attention(q, k, v, stripe_plan, state=state.clone(), validate_plan=False)
    anchor_ms, ident_ms, stripe_ms = ctx.time(anchor), ctx.time(identify), ctx.time(stripes)
    params: dict[str, Any] = {"theta": theta, **sizes}
    out = fast.anchor_attention(q, k, v, **params)
    ms = ctx.time(lambda: fast.anchor_attention(q, k, v, **params))
    plan = _plans(b, hq, n, **sizes, counts=counts, index=index, device=q.device, with_blocks=True)
    dens = float(fast.density(plan).mean())
    anchor_dens = float(fast.density(anchor_plan).mean())
    dense_out = ctx.dense_attention(q, k, v)()
    base = ctx.baseline(n).ms
    extra = {
        "params": params, "anchor_ms": anchor_ms, "identification_ms": ident_ms, "stripe_ms": stripe_ms,
        "anchor_density": anchor_dens,
        "overhead_vs_cudnn": (anchor_ms + ident_ms - anchor_dens * base) / base,
        "speedup_vs_flash": None if flash_ms is None else flash_ms / ms,
        "paper_claim": PAPER_CLAIM,
        "rel_err_vs_baseline": float((out.float() - dense_out.float()).norm() / dense_out.float().norm()),
        "stages_vs_e2e_max_abs_diff": float((staged.float() - out.float()).abs().max()),
        "stripe_plan_mb": (stripe_plan.column_count.untyped_storage().nbytes()
                           + stripe_plan.column_index.untyped_storage().nbytes()) / 2**20,
        "stripe_width": int(index.shape[-1]),
    }
    rows.append(ctx.row("anchor_attention", "sparseprefill", n, ms=ms, density=dens, recall=ctx.recall(q, k, plan),
                        estimate_ms=anchor_ms, plan_ms=anchor_ms + ident_ms, kernel_ms=stripe_ms, extra=extra))
    ctx.log(f"N={n}: anchor_attention {ms:.2f} ms (anchor {anchor_ms:.2f}, identification {ident_ms:.2f}, "
            f"stripes {stripe_ms:.2f}) density {dens:.4f}; {PAPER_CLAIM}")
    return rows


def units(ctx: Context, seqlens: list[int], *, theta: float = 12.0, step: int | None = None,
          block: int | None = None) -> list[Unit]:
    size = block or (128 if ctx.on_gpu else 32)
    out: list[Unit] = []
    for n in seqlens:
        groups = max(1, min(16, -(-n // size) // 8))
        out.append(baseline_unit(ctx, n))
        out.append(piece(ctx, "anchor_attention", n, anchor_rows, ctx, n, theta=theta, step=step or groups,
                         block=size))
    return out


SUITE = Suite(
    name="anchor_attention",
    about="AnchorAttention end to end and per stage (anchor pass / identification / stripes), beside cuDNN and "
          "flash SDPA",
    seqlens=(32768, 131072),
    units=units,
    options=(Option("--theta", "theta", float, 12.0, "anchor_attention: theta"),
             Option("--step", "step", int, None, "anchor_attention: query blocks per group (default: the "
                                                 "method's, 16 from 16K on)"),
             BLOCK),
)
