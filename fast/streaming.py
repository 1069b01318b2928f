"""StreamingLLM / A-shape plan built arithmetically (see `reference.streaming`)."""

from __future__ import annotations

import torch

from ..reference._checks import PerHeadInt, check_block_size, check_count, check_qk, is_per_head, per_head
from ..reference.streaming import check_sink, check_streaming_params, check_window
from ..reference.plan import BlockColumnPlan, cdiv
from .dense import empty_columns
from .kernels import block_column_attention


def streaming_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    sink: PerHeadInt = 1024,
    window: PerHeadInt = 4096,
    block_m: int = 128,
    block_n: int = 128,
) -> BlockColumnPlan:
    """Plan of sink blocks plus local-window blocks (see `reference.streaming_plan`).

    Query block `i` lists key blocks `[0, sink_blocks)` then `[window_first, last]`;
    both ranges are computed per query block with integer arithmetic, and one
    `[Qb, width]` index is shared (expanded) by every batch row and head (`[Hq, Qb,
    width]` by every batch row, for a per-head sink or window). The width comes from the
    same arithmetic on the host: no host synchronisation.
    """
    shape = check_qk(q, k)
    check_streaming_params(sink=sink, window=window)
    n, b, h = shape.seqlen, shape.batch, shape.q_heads
    sinks: int | torch.Tensor
    windows: int | torch.Tensor
    if is_per_head(sink) or is_per_head(window):
        # Per-head values on the host (the width's arithmetic), shaped [Hq, 1] against [Qb].
        sinks = per_head(sink, "sink", h, check_sink(n), integer=True)[:, None]
        windows = per_head(window, "window", h, check_window(n), integer=True)[:, None]
    else:
        sinks = check_count("sink", sink, cap=n, minimum=0)
        windows = check_count("window", window, cap=n)
    bm = check_block_size("block_m", block_m)
    bn = check_block_size("block_n", block_n)
    qb = cdiv(n, bm)
    dev = q.device
    # The width from the same arithmetic on the host: no device read (capture-safe).
    width = int(_block_ranges(n, bm, bn, sinks, windows, torch.device("cpu"))[2].max())
    if isinstance(sinks, torch.Tensor):
        sinks, windows = sinks.to(dev), torch.as_tensor(windows).to(dev)
    sink_blocks, window_first, count = _block_ranges(n, bm, bn, sinks, windows, dev)
    j = torch.arange(width, device=dev, dtype=torch.int64)
    index = torch.where(j < sink_blocks[..., None], j, window_first[..., None] + j - sink_blocks[..., None])
    index = torch.where(j < count[..., None], index, 0)
    col_count, col_index = empty_columns(b, h, qb, dev)
    return BlockColumnPlan(
        seqlen=n,
        block_m=bm,
        block_n=bn,
        block_count=count.to(torch.int32).expand(b, h, qb),
        block_index=index.to(torch.int32).expand(b, h, qb, width),
        column_count=col_count,
        column_index=col_index,
    ).mark_valid()


def _block_ranges(
    n: int, bm: int, bn: int, sink: int | torch.Tensor, window: int | torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sink blocks, first window block, listed blocks) int64 `[Qb]` of every query block
    (`[Hq, Qb]` for per-head sink and window, int64 `[Hq, 1]`)."""
    first_row = torch.arange(cdiv(n, bm), device=device, dtype=torch.int64) * bm
    last_row = (first_row + bm - 1).clamp(max=n - 1)
    causal = last_row // bn + 1
    if isinstance(sink, torch.Tensor):
        sink_blocks = torch.minimum(((sink.to(device) + bn - 1) // bn).expand(-1, causal.shape[0]), causal)
        window = torch.as_tensor(window, device=device)
    else:
        sink_blocks = torch.clamp(torch.full_like(causal, cdiv(sink, bn)), max=causal)
    # First key block whose last key lies after first_row - window.
    window_first = torch.clamp((first_row - window - bn + 1) // bn + 1, min=0)
    window_first = torch.maximum(window_first, sink_blocks)
    window_count = torch.clamp(causal - window_first, min=0)
    return sink_blocks, window_first, sink_blocks + window_count


def streaming(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    sink: PerHeadInt = 1024,
    window: PerHeadInt = 4096,
    block_m: int = 128,
    block_n: int = 128,
    scale: float | None = None,
) -> torch.Tensor:
    """Sink + local-window attention (see `reference.streaming`; sink and window may be
    given per query head)."""
    plan = streaming_plan(q, k, sink=sink, window=window, block_m=block_m, block_n=block_n)
    out, _ = block_column_attention(q, k, v, plan, scale=scale, validate_plan=False)
    return out
