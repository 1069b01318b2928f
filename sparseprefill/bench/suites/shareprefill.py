"""`shareprefill`: SharePrefill over a synthetic multi-layer prefill, per layer, beside cuDNN SDPA.

`share_layers` makes `--layers` layers from one workload: layer `l` rolls the query and
KV heads by `l` (heads meet other keys), adds seeded noise to q, and scales every
eighth query head down to near-uniform attention (the non-sparse heads SharePrefill
computes densely, as a cluster's pivot, or shares). `share_layout` puts those flat heads
in cluster 0 and the others in three clusters by head. Per layer, on one state carried
across the layers:

* `dense L<l>`: the baseline on that layer's q, k, v;
* `shareprefill L<l>`: end to end (`fast.shareprefill_layer` from the state the earlier
  layers left), split into decision (Alg. 3: pooled estimate, distances, head walk;
  `estimate_ms`), plan (Alg. 5 lines and index, shared masks; `plan_ms` is decision +
  plan), sparse heads (one kernel pass; `kernel_ms`), dense pivots and pivot
  construction (Alg. 2), with the heads per pattern;
* `flexprefill_vs L<l>`: the Alg. 5 fallback alone on every head;

then `shareprefill total`: the sum over layers against the baseline's sum.
"""

from __future__ import annotations

from typing import Any

import torch

from ..common import BLOCK, Context, Option, Row, Suite, Unit, piece


def share_layers(base: tuple[torch.Tensor, torch.Tensor, torch.Tensor], layers: int, *, flat_every: int = 8,
                 seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`layers` layers from one workload (see the module doc); cheap to make at 128K."""
    q0, k0, v0 = base
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for layer in range(layers):
        q = q0.roll(layer, dims=1).clone()
        noise = torch.randn(q.shape[1], q.shape[3], generator=gen).to(q.device, q.dtype)
        q += 0.1 * noise[None, :, None, :]
        q[:, ::flat_every] *= 0.02
        out.append((q, k0.roll(layer, dims=1).contiguous(), v0.roll(layer, dims=1).contiguous()))
    return out


def share_layout(layers: int, q_heads: int, *, flat_every: int = 8) -> Any:
    """The cluster layout of `share_layers`: the flat heads form cluster 0, the others 3 clusters by head."""
    from ...reference.shareprefill import ClusterLayout

    row = tuple(0 if h % flat_every == 0 else 1 + h % 3 for h in range(q_heads))
    return ClusterLayout((row,) * layers, meta={"source": "sparseprefill bench shareprefill (synthetic)"})


def stack_rows(ctx: Context, n: int, layers: int, block: int) -> list[Row]:
    """Every layer's rows and the total (see the module doc)."""
    from ... import fast
    from ...fast.kernels import block_column_attention
    from ...fast.shareprefill import (
        build_pivots,
        decide_layer,
        dense_pivot_attention,
        layer_plan,
    )
    from ...reference.shareprefill import SharePattern, SharePrefillState

    stack = share_layers(ctx.inputs(n), layers)
    state = SharePrefillState(share_layout(layers, ctx.q_heads), block_m=block, block_n=block)
    scale = ctx.head_dim ** -0.5
    rows: list[Row] = []
    totals = {"ours": 0.0, "baseline": 0.0}
    for layer, (q, k, v) in enumerate(stack):
        dense_ms = ctx.time(ctx.dense_attention(q, k, v))
        rows.append(ctx.row(f"dense L{layer}", ctx.baseline_name, n, ms=dense_ms, kernel_ms=dense_ms, density=1.0,
                            baseline_ms=dense_ms))
        before = state.clone()
        before.bind(q, layer)
        decision = decide_layer(q, k, before.clone(), layer=layer, scale=scale)
        decide_ms = ctx.time(lambda: decide_layer(q, k, before.clone(), layer=layer, scale=scale))
        plan = layer_plan(q, k, before, decision, scale=scale, with_dense=False)
        plan_ms = ctx.time(lambda: layer_plan(q, k, before, decision, scale=scale, with_dense=False))
        sparse_ms = ctx.time(lambda: block_column_attention(q, k, v, plan, validate_plan=False))
        pairs = [(r, h) for r, h in (decision.pattern == SharePattern.DENSE).nonzero().tolist()]
        dense_pivots_ms = pivot_ms = 0.0
        if pairs:
            scratch = torch.empty_like(q)
            means = dense_pivot_attention(q, k, v, before, pairs, scratch, scale=scale)
            dense_pivots_ms = ctx.time(lambda: dense_pivot_attention(q, k, v, before, pairs, scratch, scale=scale))
            pivot_ms = ctx.time(lambda: build_pivots(means, before, decision, pairs))
        ms = ctx.time(lambda: fast.shareprefill_layer(q, k, v, before.clone(), layer=layer, scale=scale))
        fast.shareprefill_layer(q, k, v, state, layer=layer, scale=scale)
        full = layer_plan(q, k, before, decision, scale=scale)
        counts = decision.counts()
        rows.append(ctx.row(f"shareprefill L{layer}", "sparseprefill", n, ms=ms,
                            density=float(fast.density(full).mean()), recall=ctx.recall(q, k, full, scale=scale),
                            estimate_ms=decide_ms, plan_ms=decide_ms + plan_ms, kernel_ms=sparse_ms,
                            baseline_ms=dense_ms,
                            extra={"decision_ms": decide_ms, "plan_only_ms": plan_ms, "sparse_heads_ms": sparse_ms,
                                   "dense_pivots_ms": dense_pivots_ms, "pivot_build_ms": pivot_ms, **counts}))
        ctx.log(f"N={n} layer {layer}: shareprefill {ms:.2f} ms (decision {decide_ms:.2f}, plan {plan_ms:.2f}, "
                f"sparse {sparse_ms:.2f}, dense {dense_pivots_ms:.2f}, pivots {pivot_ms:.2f}) {counts}")
        totals["ours"] += ms
        totals["baseline"] += dense_ms

        def flex_plan() -> Any:
            return fast.flexprefill_vs_plan(q, k, gamma=state.gamma, last_q=state.block_m, block_m=state.block_m,
                                            block_n=state.block_n, line_block=1, scale=scale)

        fplan = flex_plan()
        est_ms = ctx.time(flex_plan)
        ker_ms = ctx.time(lambda: block_column_attention(q, k, v, fplan, validate_plan=False))
        rows.append(ctx.row(f"flexprefill_vs L{layer}", "sparseprefill", n, ms=est_ms + ker_ms,
                            density=float(fast.density(fplan).mean()), recall=ctx.recall(q, k, fplan, scale=scale),
                            plan_ms=est_ms, kernel_ms=ker_ms, baseline_ms=dense_ms))
        ctx.free()
    rows.append(ctx.row(f"shareprefill total ({layers} layers)", "sparseprefill", n, ms=totals["ours"],
                        baseline_ms=totals["baseline"], extra={"pattern_counts": state.pattern_counts()}))
    return rows


def units(ctx: Context, seqlens: list[int], *, layers: int = 8, block: int | None = None) -> list[Unit]:
    size = block or (64 if ctx.on_gpu else 16)
    return [piece(ctx, f"shareprefill x{layers}", n, stack_rows, ctx, n, layers, size) for n in seqlens]


SUITE = Suite(
    name="shareprefill",
    about="a synthetic multi-layer prefill per layer: decision / plan / sparse heads / dense pivots / pivot build, "
          "the FlexPrefill-style fallback, cuDNN",
    seqlens=(32768, 131072),
    units=units,
    options=(Option("--layers", "layers", int, 8, "shareprefill: layers of the stack"), BLOCK),
)
