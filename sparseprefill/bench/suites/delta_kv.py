"""`delta_kv`: Delta-KV's keep mask, packing and two phases at the thesis's cosine thresholds.

Per N on the selected workload and cosine threshold (`--thresholds`): the keep mask,
the packing, the plans (`plan_ms` is the three together: everything before attention),
phase 1 (the packed anchors through the ragged launcher) and phase 2 (the critical
diagonal, resuming phase 1's state; `kernel_ms` is the two phases), and
`fast.delta_kv` end to end, beside cuDNN SDPA. Density counts the score entries both
phases compute (so `density x cuDNN` is the floor); the keep ratio and the output's
error against the dense kernel are in `extra`. No recall: the packed keys change the
attention.
"""

from __future__ import annotations

from typing import Any

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

THRESHOLDS = "0.9,0.83,0.78"


def keep_params(n: int, threshold: float, block: int | None) -> dict[str, Any]:
    """Delta-KV's parameters packing keys at the cosine `threshold` (the `delta` suite)."""
    return {"threshold": threshold, "metric": "cosine",
            **({} if block is None else {"block_m": block, "block_n": block})}


def threshold_rows(ctx: Context, n: int, threshold: float, *, chunk: int, block: int) -> list[Row]:
    from ... import fast
    from ...fast.kernels import block_column_attention
    from ...fast.kernels.block_column import ragged_block_column_attention
    from ...fast.kernels.delta_pack import keep_mask, pack
    from ...reference.attention import AttentionState

    q, k, v = ctx.inputs(n)

    def mask() -> Any:
        return keep_mask(k, threshold=threshold, cosine=True, chunk=chunk)

    keep, chunk_counts = mask()
    packed = pack(k, v, keep, chunk_counts, chunk=chunk, block=block)
    plan1, plan2 = fast.delta_kv_plans(q, packed, block_m=block)
    bias = packed.counts.float().log()
    offsets = packed.offsets[:-1].contiguous()

    def phase1() -> Any:
        state = AttentionState.like(q)
        ragged_block_column_attention(q, packed.k, packed.v, offsets, plan1, key_bias=bias, state=state)
        return state

    state = phase1()
    split = {"keep_mask_ms": ctx.time(mask),
             "pack_ms": ctx.time(lambda: pack(k, v, keep, chunk_counts, chunk=chunk, block=block)),
             "plans_ms": ctx.time(lambda: fast.delta_kv_plans(q, packed, block_m=block)),
             "phase1_ms": ctx.time(phase1),
             "phase2_ms": ctx.time(lambda: block_column_attention(q, k, v, plan2, state=state.clone(),
                                                                  validate_plan=False)),
             "keep_ratio": float(packed.keep_ratio().mean()), "threshold": threshold}
    params: dict[str, Any] = {"threshold": threshold, "metric": "cosine", "chunk": chunk, "block_m": block,
                              "block_n": block}
    ms = ctx.time(lambda: fast.delta_kv(q, k, v, **params))
    out = fast.delta_kv(q, k, v, **params)
    exact = block_column_attention(q, k, v, fast.dense_plan(q, k), validate_plan=False)[0]
    split["rel_err_vs_dense"] = float((out.float() - exact.float()).norm() / exact.float().norm())
    before = split["keep_mask_ms"] + split["pack_ms"] + split["plans_ms"]
    name = f"delta_kv cos {threshold}"
    dens = float(fast.delta_kv_density(q, packed, block_m=block).mean())
    row = ctx.row(name, "sparseprefill", n, ms=ms, density=dens,
                  estimate_ms=split["keep_mask_ms"], plan_ms=before,
                  kernel_ms=split["phase1_ms"] + split["phase2_ms"], extra=split)
    ctx.log(f"N={n}: {name} {ms:.2f} ms keep {split['keep_ratio']:.3f}")
    return [row]


def units(ctx: Context, seqlens: list[int], *, thresholds: str = THRESHOLDS, block: int | None = None) -> list[Unit]:
    size = block or (64 if ctx.on_gpu else 16)
    chunk = 512 if ctx.on_gpu else 32
    out: list[Unit] = []
    for n in seqlens:
        out.append(baseline_unit(ctx, n))
        for t in (float(x) for x in thresholds.split(",") if x):
            out.append(piece(ctx, f"delta_kv cos {t}", n, threshold_rows, ctx, n, t, chunk=chunk, block=size))
    return out


SUITE = Suite(
    name="delta_kv",
    about="Delta-KV: keep mask, packing and the two phases at cosine thresholds",
    seqlens=(32768, 131072, 262144),
    units=units,
    options=(Option("--thresholds", "thresholds", str, THRESHOLDS,
                    "delta_kv: comma-separated cosine thresholds of the keep mask"),
             BLOCK),
)
