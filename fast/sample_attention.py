"""SampleAttention on the GPU (see `reference.sample_attention` for the specification).

Checks run once, in the public functions; the private steps trust them.

Stage 1: `sampled_block_scores` (Triton; the `[R, N]` softmax of the sampled rows
is never stored), block scores summed in float64. Stage 2: `find_k` and
`arg_topk` of the reference on the block scores, on the device (`[B, Hq, Kb]`
float64, a sort of Kb values per head; nothing of length N is sorted). Merge:
`sample_attention_index` (Triton), then the block/column kernel.

The fp32 sampling differs from the float64 reference in the last bits, so where a
block's score ties (or nearly ties) the last kept one, or a cumulative sum lands
within rounding of `alpha`, the fast plan may keep one block more or less than the
reference; `conformance.ties.sample_attention_tie_check` accepts exactly those
differences.
"""

from __future__ import annotations

import os

import torch

from ..reference._checks import (
    HALF_DTYPES,
    PerHead,
    check_block_size,
    check_positive_int,
    check_qk,
    check_qkv,
    per_head,
    resolve_scale,
)
from ..reference.plan import BlockColumnPlan
from ..reference.sample_attention import (
    DEFAULT_CHUNK_N,
    SampleAttentionSettings,
    arg_topk,
    check_alpha_c,
    check_alpha_s,
    find_k,
    resolve_params,
    sampled_rows,
)
from .attention import run_plan
from .dense_fallback import apply_rule
from .kernels import check_forward_only
from .kernels.sample_index import sample_attention_index
from .kernels.sampled_scores import _sampled_block_scores, check_score_inputs


def check_kernel_block_size(block_size: object) -> int:
    """Raise TypeError/ValueError unless `block_size` is a block size (`check_block_size`)
    and a multiple of 16 (the kernels' tiles); before any launch."""
    bs = check_block_size("block_size", block_size)
    if bs % 16:
        raise ValueError(f"block_size must be a multiple of 16 for the fast kernels, got {bs}")
    return bs


def _check_sample(
    q: torch.Tensor, k: torch.Tensor, *, alpha_c: PerHead | None, alpha_s: PerHead | None, chunk_n: int | None,
    block_size: int, settings: SampleAttentionSettings | str | os.PathLike[str] | None, scale: float | None,
) -> tuple[float | torch.Tensor, float | torch.Tensor, int, int, float]:
    """Every check of the fast SampleAttention, once (the settings file is read once).

    Returns:
        (alpha_c, alpha_s, chunk_n, block_size, softmax scale); an alpha given per head
        as float64 `[Hq]` on q's device, a scalar as a float.

    Raises:
        TypeError, ValueError: bad inputs or parameters, before any launch.
    """
    shape = check_qk(q, k, dtypes=HALF_DTYPES)
    a_c, a_s, c_n = resolve_params(shape.seqlen, alpha_c=alpha_c, alpha_s=alpha_s, chunk_n=chunk_n,
                                   block_size=block_size, settings=settings)
    if isinstance(a_c, torch.Tensor):
        a_c = per_head(a_c, "alpha_c", shape.q_heads, check_alpha_c, device=q.device)
    if isinstance(a_s, torch.Tensor):
        a_s = per_head(a_s, "alpha_s", shape.q_heads, check_alpha_s, device=q.device)
    bs = check_kernel_block_size(block_size)
    sm_scale = resolve_scale(scale, shape.head_dim)
    check_score_inputs(q)
    return a_c, a_s, c_n, bs, sm_scale


def _scores(q: torch.Tensor, k: torch.Tensor, *, chunk_n: int, block_size: int,
            sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    spans = sampled_rows(q.shape[2], chunk_n, block_size)
    return _sampled_block_scores(q, k, spans=spans, block_size=block_size, sm_scale=sm_scale)


def _selection(q: torch.Tensor, k: torch.Tensor, *, alpha_c: float | torch.Tensor,
               alpha_s: float | torch.Tensor, chunk_n: int,
               block_size: int, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    column, slash = _scores(q, k, chunk_n=chunk_n, block_size=block_size, sm_scale=sm_scale)
    return arg_topk(column, find_k(column, alpha_c)), arg_topk(slash, find_k(slash, alpha_s))


def _plan(q: torch.Tensor, k: torch.Tensor, *, alpha_c: float | torch.Tensor, alpha_s: float | torch.Tensor,
          chunk_n: int,
          block_size: int, sm_scale: float) -> BlockColumnPlan:
    columns, slashes = _selection(q, k, alpha_c=alpha_c, alpha_s=alpha_s, chunk_n=chunk_n,
                                  block_size=block_size, sm_scale=sm_scale)
    return apply_rule(sample_attention_index(columns, slashes, seqlen=q.shape[2], block_size=block_size), q)


def sample_attention_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    chunk_n: int = DEFAULT_CHUNK_N,
    block_size: int = 128,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 (Alg. 1 lines 1-4): (column, slash) float64 `[B, Hq, Kb]`.

    Raises:
        TypeError, ValueError: bad inputs.
    """
    shape = check_qk(q, k, dtypes=HALF_DTYPES)
    c_n = check_positive_int("chunk_n", chunk_n)
    bs = check_kernel_block_size(block_size)
    sm_scale = resolve_scale(scale, shape.head_dim)
    check_score_inputs(q)
    return _scores(q, k, chunk_n=c_n, block_size=bs, sm_scale=sm_scale)


def sample_attention_selection(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    alpha_c: PerHead | None = None,
    alpha_s: PerHead | None = None,
    chunk_n: int | None = None,
    block_size: int = 128,
    settings: SampleAttentionSettings | str | os.PathLike[str] | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stages 1 and 2: kept (column blocks, block diagonals), bool `[B, Hq, Kb]`.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    a_c, a_s, c_n, bs, sm_scale = _check_sample(q, k, alpha_c=alpha_c, alpha_s=alpha_s, chunk_n=chunk_n,
                                                block_size=block_size, settings=settings, scale=scale)
    return _selection(q, k, alpha_c=a_c, alpha_s=a_s, chunk_n=c_n, block_size=bs, sm_scale=sm_scale)


def sample_attention_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    alpha_c: PerHead | None = None,
    alpha_s: PerHead | None = None,
    chunk_n: int | None = None,
    block_size: int = 128,
    settings: SampleAttentionSettings | str | os.PathLike[str] | None = None,
    scale: float | None = None,
) -> BlockColumnPlan:
    """SampleAttention plan (see `reference.sample_attention_plan`).

    Args:
        q: `[B, Hq, N, D]` float16/bfloat16; k: `[B, Hkv, N, D]`. Each query head
            samples its own queries against its KV head's keys and selects its own blocks.
        alpha_c: CRA threshold of the column blocks, in [0, 1].
        alpha_s: CRA threshold of the slash blocks (block diagonals), in [0, 1].
        chunk_n: sampling chunks (>= 1); more than `N / block_size` samples every row.
        block_size: the block grid of sampling, selection and plan (a multiple of 16 here).
        settings: tuned per-length settings (`SampleAttentionSettings` or a path to its
            JSON); they supply whichever of alpha_c, alpha_s, chunk_n is None. Without
            settings those default to 0.95, 0.95 and 1.
        scale: softmax scale of the sampling, `1/sqrt(D)` if None.

    Returns:
        A `BlockColumnPlan` with `block_m = block_n = block_size` and no columns; its
        block lists are as wide as the largest `k_c + k_s + 1` (one host sync).

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    a_c, a_s, c_n, bs, sm_scale = _check_sample(q, k, alpha_c=alpha_c, alpha_s=alpha_s, chunk_n=chunk_n,
                                                block_size=block_size, settings=settings, scale=scale)
    return _plan(q, k, alpha_c=a_c, alpha_s=a_s, chunk_n=c_n, block_size=bs, sm_scale=sm_scale)


def sample_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    alpha_c: PerHead | None = None,
    alpha_s: PerHead | None = None,
    chunk_n: int | None = None,
    block_size: int = 128,
    settings: SampleAttentionSettings | str | os.PathLike[str] | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """SampleAttention sparse attention (see `reference.sample_attention`).

    Host synchronisation: one, the plan width from the kept counts (`Kb` inside
    `fast.capture.static_widths()`, `torch.ops.sparseprefill.sample_attention_static`,
    and during CUDA-graph capture: no sync; stage 1 builds its row-tile table on the
    device, so the static op is capture-safe, docs/serving.md).

    Args:
        q, k, alpha_c, alpha_s, chunk_n, block_size, settings, scale: as in
            `sample_attention_plan`. v: `[B, Hkv, N, D]`.

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    check_qkv(q, k, v, dtypes=HALF_DTYPES)
    check_forward_only(q, k, v)
    a_c, a_s, c_n, bs, sm_scale = _check_sample(q, k, alpha_c=alpha_c, alpha_s=alpha_s, chunk_n=chunk_n,
                                                block_size=block_size, settings=settings, scale=scale)
    plan = _plan(q, k, alpha_c=a_c, alpha_s=a_s, chunk_n=c_n, block_size=bs, sm_scale=sm_scale)
    return run_plan(q, k, v, plan, scale=sm_scale)
