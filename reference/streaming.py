"""StreamingLLM / MInference A-shape: attention sinks plus a local window.

Every query attends to the first `sink` tokens and to its `window` most recent
tokens (itself included). The plan works on blocks, so both regions are rounded
outward to whole key blocks: a key block is kept for query block `i` if it holds
a token `< sink`, or if its last key is within `window` of the block's first row.
The kept set is therefore a superset of the token-level sink + window mask, and
exactly what the kernel computes.

`sink` and `window` may be given per query head (a list or `[Hq]` int tensor): each
head gets its own sink and window blocks.
"""

from __future__ import annotations

import torch

from collections.abc import Callable

from ._checks import PerHeadInt, check_block_size, check_count, check_knob, check_positive_int, check_qk, per_head
from .attention import sparse_attention
from .plan import BlockColumnPlan, cdiv


def check_sink(seqlen: int) -> Callable[[object], int]:
    """The scalar check of `sink` at length N: an int >= 0 (past N means N)."""
    return lambda value: check_count("sink", value, cap=seqlen, minimum=0)


def check_window(seqlen: int) -> Callable[[object], int]:
    """The scalar check of `window` at length N: an int >= 1 (past N means N)."""
    return lambda value: check_count("window", value, cap=seqlen)


def check_streaming_params(*, sink: object, window: object) -> None:
    """Raise TypeError/ValueError naming a bad `sink` or `window` (a scalar or one per head)."""
    check_knob("sink", sink, lambda v: check_positive_int("sink", v, minimum=0), integer=True)
    check_knob("window", window, lambda v: check_positive_int("window", v), integer=True)


def streaming_block_mask(
    seqlen: int, *, sink: int | torch.Tensor, window: int | torch.Tensor, block_m: int, block_n: int,
    device: torch.device
) -> torch.Tensor:
    """Bool `[Qb, Kb]`: the sink blocks and the local-window blocks of each query block
    (`[H, Qb, Kb]` for per-head int64 `[H]` sink and window)."""
    if isinstance(sink, torch.Tensor) or isinstance(window, torch.Tensor):
        sink = torch.as_tensor(sink, device=device).reshape(-1, 1, 1)
        window = torch.as_tensor(window, device=device).reshape(-1, 1, 1)
    qb, kb = cdiv(seqlen, block_m), cdiv(seqlen, block_n)
    first_row = torch.arange(qb, device=device)[:, None] * block_m
    key_first = torch.arange(kb, device=device)[None, :] * block_n
    key_last = key_first + block_n - 1
    is_sink = key_first < sink
    # The first row of the block needs keys (first_row - window, first_row]; later rows
    # of the block need later keys, which lie in the window or the diagonal block.
    in_window = key_last > first_row - window
    return is_sink | in_window


def streaming_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    sink: PerHeadInt = 1024,
    window: PerHeadInt = 4096,
    block_m: int = 128,
    block_n: int = 128,
) -> BlockColumnPlan:
    """Plan of sink blocks plus local-window blocks (causal).

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]` (only their shapes are used).
        sink: initial tokens every query sees (>= 0); a scalar, or one per query head.
        window: most recent tokens every query sees, itself included (>= 1); a scalar,
            or one per query head.
        block_m, block_n: query rows and keys per block.

    Returns:
        The same `BlockColumnPlan` for every batch row (and every head, unless sink or
        window is given per head), without columns.

    Raises:
        TypeError, ValueError: bad inputs.
    """
    shape = check_qk(q, k)
    check_streaming_params(sink=sink, window=window)
    n, hq = shape.seqlen, shape.q_heads
    sinks = per_head(sink, "sink", hq, check_sink(n), integer=True, device=q.device)
    windows = per_head(window, "window", hq, check_window(n), integer=True, device=q.device)
    bm = check_block_size("block_m", block_m)
    bn = check_block_size("block_n", block_n)
    blocks = streaming_block_mask(n, sink=sinks, window=windows, block_m=bm, block_n=bn, device=q.device)
    blocks = blocks.expand(shape.batch, hq, *blocks.shape[-2:])
    return BlockColumnPlan.from_masks(blocks, None, seqlen=shape.seqlen, block_m=bm, block_n=bn)


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
    """Sink + local-window attention through `streaming_plan`.

    Returns:
        `[B, Hq, N, D]` in q's dtype.
    """
    plan = streaming_plan(q, k, sink=sink, window=window, block_m=block_m, block_n=block_n)
    return sparse_attention(q, k, v, plan, scale=scale)
