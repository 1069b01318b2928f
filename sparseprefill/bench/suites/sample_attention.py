"""`sample_attention`: SampleAttention split into sampling / filtering / kernel, beside cuDNN SDPA.

Per N and setting `alpha_c/alpha_s/chunk_n` (`--settings`): sampling
(`sample_attention_scores`: the sampled rows' softmax and its float64 block sums,
`estimate_ms`), filtering (`find_k` + `arg_topk` on the device and the merge index, its
one host read included; `plan_ms` is sampling + filtering), the kernel on that plan
and `fast.sample_attention` end to end. `extra`: the stage times, the plan's widest
block list and MB, and `overhead_vs_dense` = (sampling + filtering) / cuDNN. The
summary prints the split against the floor.
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

SETTINGS = "0.95/0.95/1;0.95/0.95/2;0.9/0.9/1;0.98/0.98/4"


def parse_settings(text: str) -> list[tuple[float, float, int]]:
    """"0.95/0.95/1;0.9/0.9/2" -> [(0.95, 0.95, 1), (0.9, 0.9, 2)]."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(";"))):
        try:
            a_c, a_s, chunks = item.split("/")
            out.append((float(a_c), float(a_s), int(chunks)))
        except ValueError:
            raise ValueError(f"--settings: expected alpha_c/alpha_s/chunk_n items like 0.95/0.95/1, got "
                             f"{item!r}") from None
    return out


def setting_rows(ctx: Context, n: int, alpha_c: float, alpha_s: float, chunk_n: int, block_size: int) -> list[Row]:
    from ... import fast
    from ...fast.kernels import block_column_attention
    from ...fast.kernels.sample_index import sample_attention_index
    from ...fast.sample_attention import sample_attention_scores
    from ...reference.sample_attention import arg_topk, find_k

    q, k, v = ctx.inputs(n)
    params: dict[str, Any] = {"alpha_c": alpha_c, "alpha_s": alpha_s, "chunk_n": chunk_n, "block_size": block_size}

    def sampling() -> tuple[torch.Tensor, torch.Tensor]:
        return sample_attention_scores(q, k, chunk_n=chunk_n, block_size=block_size)

    column, slash = sampling()

    def filtering() -> Any:
        cols = arg_topk(column, find_k(column, alpha_c))
        slashes = arg_topk(slash, find_k(slash, alpha_s))
        return sample_attention_index(cols, slashes, seqlen=n, block_size=block_size)

    plan = filtering()
    sample_ms, filter_ms = ctx.time(sampling), ctx.time(filtering)
    kernel_ms = ctx.time(lambda: block_column_attention(q, k, v, plan, validate_plan=False))
    ms = ctx.time(lambda: fast.sample_attention(q, k, v, **params))
    base = ctx.baseline(n).ms
    name = f"sample_attention {alpha_c:g}/{alpha_s:g}/{chunk_n}"
    extra = {**params, "sampling_ms": sample_ms, "filtering_ms": filter_ms,
             "overhead_vs_dense": (sample_ms + filter_ms) / base,
             "block_width": int(plan.block_index.shape[3]), "plan_mb": plan.nbytes() / 2**20}
    row = ctx.row(name, "sparseprefill", n, ms=ms, density=float(fast.density(plan).mean()),
                  recall=ctx.recall(q, k, plan), estimate_ms=sample_ms, plan_ms=sample_ms + filter_ms,
                  kernel_ms=kernel_ms, extra=extra)
    ctx.log(f"N={n}: {name} {ms:.2f} ms (sampling {sample_ms:.2f}, filtering {filter_ms:.2f}, kernel "
            f"{kernel_ms:.2f}; floor {row.floor_ms})")
    return [row]


def format_stages(rows: list[Row]) -> str:
    """The stage split per setting against the floor `density x cuDNN`."""
    head = (f"{'setting':<30} {'N':>7} {'sampling':>9} {'filtering':>9} {'kernel':>9} {'floor':>9} "
            f"{'kernel/floor':>12} {'(s+f)/dense':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        x = r.extra
        if "sampling_ms" not in x:
            continue
        kf = "-" if r.kernel_vs_floor is None else f"{r.kernel_vs_floor:.2f}"
        floor = "-" if r.floor_ms is None else f"{r.floor_ms:.2f}"
        lines.append(f"{r.method:<30} {r.seqlen:>7} {x['sampling_ms']:>9.2f} {x['filtering_ms']:>9.2f} "
                     f"{r.kernel_ms or 0.0:>9.2f} {floor:>9} {kf:>12} {x['overhead_vs_dense']:>10.1%}")
    return "\n".join(lines)


def units(ctx: Context, seqlens: list[int], *, settings: str = SETTINGS, block: int | None = None) -> list[Unit]:
    size = block or (128 if ctx.on_gpu else 32)
    out: list[Unit] = []
    for n in seqlens:
        out.append(baseline_unit(ctx, n))
        for a_c, a_s, chunks in parse_settings(settings):
            label = f"sample_attention {a_c:g}/{a_s:g}/{chunks}"
            out.append(piece(ctx, label, n, setting_rows, ctx, n, a_c, a_s, chunks, size))
    return out


SUITE = Suite(
    name="sample_attention",
    about="SampleAttention split into sampling / filtering / kernel at the paper's settings",
    seqlens=(32768, 131072),
    units=units,
    options=(Option("--settings", "settings", str, SETTINGS,
                    "sample_attention: alpha_c/alpha_s/chunk_n settings, ';'-separated"), BLOCK),
    summary=format_stages,
)
