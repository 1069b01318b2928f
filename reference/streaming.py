"""StreamingLLM / MInference A-shape: attention sinks plus a local window.

Every query attends to the first `sink` tokens and to its `window` most recent
tokens (itself included). The plan works on blocks, so both regions are rounded
outward to whole key blocks: a key block is kept for query block `i` if it holds
a token `< sink`, or if its last key is within `window` of the block's first row.
The kept set is therefore a superset of the token-level sink + window mask, and
exactly what the kernel computes.
"""

from __future__ import annotations

import torch

from ._checks import check_block_size, check_count, check_qk
from .attention import sparse_attention
from .plan import BlockColumnPlan, cdiv


def streaming_block_mask(
    seqlen: int, *, sink: int, window: int, block_m: int, block_n: int, device: torch.device
) -> torch.Tensor:
    """Bool `[Qb, Kb]`: the sink blocks and the local-window blocks of each query block."""
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
    sink: int = 1024,
    window: int = 4096,
    block_m: int = 128,
    block_n: int = 128,
) -> BlockColumnPlan:
    """Plan of sink blocks plus local-window blocks (causal).

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]` (only their shapes are used).
        sink: initial tokens every query sees (>= 0).
        window: most recent tokens every query sees, itself included (>= 1).
        block_m, block_n: query rows and keys per block.

    Returns:
        The same `BlockColumnPlan` for every batch row and head, without columns.

    Raises:
        TypeError, ValueError: bad inputs.
    """
    shape = check_qk(q, k)
    sink = check_count("sink", sink, cap=shape.seqlen, minimum=0)
    window = check_count("window", window, cap=shape.seqlen)
    bm = check_block_size("block_m", block_m)
    bn = check_block_size("block_n", block_n)
    blocks = streaming_block_mask(
        shape.seqlen, sink=sink, window=window, block_m=bm, block_n=bn, device=q.device
    )
    blocks = blocks.expand(shape.batch, shape.q_heads, *blocks.shape)
    return BlockColumnPlan.from_masks(blocks, None, seqlen=shape.seqlen, block_m=bm, block_n=bn)


def streaming(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    sink: int = 1024,
    window: int = 4096,
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
