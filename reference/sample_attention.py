"""SampleAttention (Zhu et al.; Alg. 1): adaptive column + slash blocks from chunked sampling.

Stage 1, query-guided chunked sampling (Alg. 1 lines 1-4):

* `sampled_rows`: the queries are cut into `chunk_n` equal chunks, chunk `i`
  ending at row `e_i = floor(i N / chunk_n)`; its last `block_size` rows,
  `[max(e_i - block_size, e_{i-1}), e_i)`, are sampled (a chunk shorter than a
  block is sampled whole, so the sampled rows never overlap; `chunk_n >= N /
  block_size` samples every row).
* `chunked_sampling`: each sampled row's exact causal softmax over its keys
  (`A_hat`, float64): every sampled row carries mass 1.
* `block_reduction`: `A_hat` is summed over each (sampled row, key block) cell of
  the `block_size` grid; column scores `A_c[j]` sum the cells of key block `j`, slash
  scores `A_s[d]` the cells on block diagonal `d = row // block_size - j`. The
  scores of all chunks are summed (Alg. 1 reduces one `A_hat` over all sampled
  rows), so each score is the sampled mass that keeping that block column or
  block diagonal keeps, and each kind sums to the number of sampled rows.

Stage 2, score-based filtering (Alg. 1 lines 6-9), per batch row and query head:

* `find_k`: `k` is the smallest count of the highest scores whose sum reaches
  `alpha` of the total: with `cumsum(sort(A))` in ascending order (Alg. 1 as
  written; `sort` ascends by default) the blocks dropped are the longest prefix of
  the smallest scores summing to at most `(1 - alpha) * total`. So `alpha = 0`
  keeps none and `alpha = 1` keeps every block of non-zero score, exactly.
* `arg_topk`: the `k` highest scores; ties go to the lower index (stable sort).

Merge (Alg. 1 line 11, `merge_index`): query block `i` keeps key block `j <= i` iff
`j` is a kept column block, or `i - j` is a kept slash (block diagonal), or
`j = i`: the block diagonal is always kept (not in Alg. 1; it guarantees every
query its own key, so no softmax row is empty, and it is the local window the
paper says the selection identifies). The plan has `block_m = block_n =
block_size`, key blocks only.

Parameters may come from a tuned `SampleAttentionSettings` file (one setting per
sequence-length range, Section 4.4 and Table 6), written by `sparseprefill tune`.
See docs/sample_attention.md for every choice and why.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ._checks import (
    PerHead,
    check_block_size,
    check_fraction,
    check_knob,
    check_positive_int,
    check_qk,
    check_qkv,
    per_head,
    resolve_scale,
)
from .attention import sparse_attention
from .dense_fallback import apply_rule
from .plan import BlockColumnPlan, cdiv

# Section 5.4's 32K setting, used when neither the call nor a settings file gives one.
DEFAULT_ALPHA = 0.95
DEFAULT_CHUNK_N = 1
_FORMAT = "sparseprefill.sample_attention"


@dataclass(frozen=True)
class LengthRange:
    """One row of a tuned settings file: the parameters for `min_seqlen <= N < max_seqlen`.

    Attributes:
        min_seqlen: first N of the range (>= 0).
        max_seqlen: first N past the range, or None for no upper end.
        alpha_c, alpha_s: CRA thresholds for column and slash blocks, in [0, 1].
        chunk_n: sampling chunks (>= 1).
        stats: what the tuner measured for this choice (density, recall, ...); free form.
    """

    min_seqlen: int
    max_seqlen: int | None
    alpha_c: float
    alpha_s: float
    chunk_n: int
    stats: dict[str, Any] | None = None

    def contains(self, seqlen: int) -> bool:
        return self.min_seqlen <= seqlen and (self.max_seqlen is None or seqlen < self.max_seqlen)

    def distance(self, seqlen: int) -> int:
        """How far N lies outside the range (0 inside)."""
        if seqlen < self.min_seqlen:
            return self.min_seqlen - seqlen
        if self.max_seqlen is not None and seqlen >= self.max_seqlen:
            return seqlen - self.max_seqlen + 1
        return 0


@dataclass(frozen=True)
class SampleAttentionSettings:
    """Tuned `(alpha_c, alpha_s, chunk_n)` per sequence-length range (Section 4.4, Table 6).

    Attributes:
        ranges: disjoint `LengthRange`s, sorted by `min_seqlen`.
        block_size: the block size the settings were tuned at; `sample_attention` with
            another block size refuses them.
        target: what the tuner aimed at (free form, for the record).
    """

    ranges: tuple[LengthRange, ...]
    block_size: int = 128
    target: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check_positive_int("settings.block_size", self.block_size)
        if not self.ranges:
            raise ValueError("settings.ranges must not be empty")
        previous: LengthRange | None = None
        for i, r in enumerate(self.ranges):
            check_positive_int(f"settings.ranges[{i}].min_seqlen", r.min_seqlen, minimum=0)
            if r.max_seqlen is not None:
                check_positive_int(f"settings.ranges[{i}].max_seqlen", r.max_seqlen, minimum=r.min_seqlen + 1)
            check_sample_attention_params(alpha_c=r.alpha_c, alpha_s=r.alpha_s, chunk_n=r.chunk_n,
                                          block_size=self.block_size, prefix=f"settings.ranges[{i}].")
            if previous is not None and (previous.max_seqlen is None or previous.max_seqlen > r.min_seqlen):
                raise ValueError(f"settings.ranges must be sorted and disjoint; range {i} starts at "
                                 f"{r.min_seqlen}, inside the range before it")
            previous = r

    def for_seqlen(self, seqlen: int) -> LengthRange:
        """The range holding N, else the nearest one (ties: the longer lengths).

        Section 5.4 reuses the 128K setting above 128K; nearest-range lookup does that
        for any gap or end of the tuned ranges.
        """
        n = check_positive_int("seqlen", seqlen)
        return min(self.ranges, key=lambda r: (r.distance(n), -r.min_seqlen))

    def to_json(self, *, indent: int | None = None) -> str:
        """JSON text: `{"format", "version", "block_size", "target", "ranges": [...]}`."""
        return json.dumps({"format": _FORMAT, "version": 1, "block_size": self.block_size,
                           "target": self.target, "ranges": [asdict(r) for r in self.ranges]},
                          indent=indent)

    @staticmethod
    def from_json(text: str) -> SampleAttentionSettings:
        """Parse `to_json`'s format.

        Raises:
            ValueError: malformed JSON, another format, or bad values.
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"settings are not valid JSON: {err}") from err
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise ValueError(f"settings must be an object with format {_FORMAT!r}")
        if data.get("version") != 1:
            raise ValueError(f"unsupported settings version {data.get('version')!r}")
        try:
            ranges = tuple(LengthRange(**r) for r in data["ranges"])
        except (KeyError, TypeError) as err:
            raise ValueError(f"malformed settings ranges: {err}") from err
        return SampleAttentionSettings(ranges, block_size=data.get("block_size", 128),
                                       target=data.get("target"))

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write `to_json` to `path`; return the path."""
        out = Path(path)
        out.write_text(self.to_json(indent=1) + "\n")
        return out

    @staticmethod
    def load(path: str | os.PathLike[str]) -> SampleAttentionSettings:
        """Read a file written by `save` (cached by path and modification time).

        Raises:
            TypeError: `path` is not a str or path.
            ValueError: the file cannot be read (missing, a directory, no permission,
                not UTF-8) or is not a valid settings file.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"settings path must be a str or os.PathLike, got {type(path).__name__}")
        try:
            p = Path(path).resolve()
            key = (str(p), p.stat().st_mtime_ns)
            if key not in _LOADED:
                _LOADED[key] = SampleAttentionSettings.from_json(p.read_text())
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"settings file {str(path)!r} cannot be read: {err}") from err
        return _LOADED[key]


_LOADED: dict[tuple[str, int], SampleAttentionSettings] = {}


def check_sample_attention_params(
    *, alpha_c: object, alpha_s: object, chunk_n: object, block_size: object, prefix: str = ""
) -> None:
    """Raise TypeError/ValueError naming the first bad SampleAttention parameter (the
    alphas: a scalar, or one per query head)."""
    check_knob(f"{prefix}alpha_c", alpha_c, lambda a: check_fraction(f"{prefix}alpha_c", a))
    check_knob(f"{prefix}alpha_s", alpha_s, lambda a: check_fraction(f"{prefix}alpha_s", a))
    check_positive_int(f"{prefix}chunk_n", chunk_n)
    check_block_size(f"{prefix}block_size", block_size)


def check_alpha_c(alpha: object) -> float:
    """An `alpha_c` in [0, 1], else TypeError/ValueError."""
    return check_fraction("alpha_c", alpha)


def check_alpha_s(alpha: object) -> float:
    """An `alpha_s` in [0, 1], else TypeError/ValueError."""
    return check_fraction("alpha_s", alpha)


def resolve_params(
    seqlen: int,
    *,
    alpha_c: PerHead | None,
    alpha_s: PerHead | None,
    chunk_n: int | None,
    block_size: int,
    settings: SampleAttentionSettings | str | os.PathLike[str] | None,
) -> tuple[float | torch.Tensor, float | torch.Tensor, int]:
    """The `(alpha_c, alpha_s, chunk_n)` of a call: explicit values first, then the
    settings' range for N, then `DEFAULT_ALPHA` / `DEFAULT_CHUNK_N`; all checked. An
    alpha given per head comes back as a float64 CPU tensor (its length is the caller's
    to check, `per_head`).

    Raises:
        TypeError, ValueError: a bad value, an unreadable settings file, or settings
            tuned at another block size.
    """
    check_block_size("block_size", block_size)
    tuned: LengthRange | None = None
    if settings is not None:
        if isinstance(settings, (str, os.PathLike)):
            settings = SampleAttentionSettings.load(settings)
        if not isinstance(settings, SampleAttentionSettings):
            raise TypeError(f"settings must be a SampleAttentionSettings, a path or None, "
                            f"got {type(settings).__name__}")
        if settings.block_size != block_size:
            raise ValueError(f"settings were tuned at block_size {settings.block_size}, "
                             f"called with block_size {block_size}")
        tuned = settings.for_seqlen(seqlen)
    a_c = alpha_c if alpha_c is not None else (tuned.alpha_c if tuned else DEFAULT_ALPHA)
    a_s = alpha_s if alpha_s is not None else (tuned.alpha_s if tuned else DEFAULT_ALPHA)
    c_n = chunk_n if chunk_n is not None else (tuned.chunk_n if tuned else DEFAULT_CHUNK_N)
    check_sample_attention_params(alpha_c=a_c, alpha_s=a_s, chunk_n=c_n, block_size=block_size)
    return (check_knob("alpha_c", a_c, check_alpha_c), check_knob("alpha_s", a_s, check_alpha_s),
            int(c_n))


def sampled_rows(seqlen: int, chunk_n: int, block_size: int) -> list[tuple[int, int]]:
    """Alg. 1 line 2, `Q_slice`: the sampled query rows as sorted, disjoint `[start, stop)`.

    Chunk `i` (1-based) is `[floor((i - 1) N / chunk_n), floor(i N / chunk_n))`; its
    last `block_size` rows are sampled, or all of it if it is shorter. Empty chunks
    (`chunk_n > N`) sample nothing; the last chunk always ends at N.
    """
    n = check_positive_int("seqlen", seqlen)
    c = check_positive_int("chunk_n", chunk_n)
    b = check_block_size("block_size", block_size)
    if cdiv(n, c) <= b:
        return [(0, n)]  # every chunk is at most a block: every row is sampled
    out = []
    for i in range(1, c + 1):
        first, end = (i - 1) * n // c, i * n // c
        out.append((max(end - b, first), end))
    return out


def chunked_sampling(
    q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor, *, scale: float
) -> torch.Tensor:
    """Alg. 1 line 3: `A_hat = softmax(Q_slice K^T / sqrt(d) + m_causal)`.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`; rows: int64 `[R]`, the sampled rows.
        scale: softmax scale.

    Returns:
        float64 `[B, Hq, R, N]`; non-causal entries 0, every row sums to 1.
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    q_rows = q[:, :, rows].to(torch.float64).reshape(b, hkv, g, rows.numel(), d)
    scores = torch.matmul(q_rows, k.to(torch.float64).unsqueeze(2).transpose(-1, -2)) * scale
    causal = torch.arange(n, device=q.device)[None, :] <= rows[:, None]
    scores = scores.masked_fill(~causal, -math.inf)
    return torch.softmax(scores, dim=-1).reshape(b, hq, rows.numel(), n)


def block_reduction(
    a_hat: torch.Tensor, rows: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Alg. 1 line 4, `block_reduction(A_hat, blk)`: (column `A_c`, slash `A_s`) scores.

    Args:
        a_hat: float64 `[B, H, R, N]` from `chunked_sampling`; rows: int64 `[R]`.
        block_size: the block grid.

    Returns:
        float64 `[B, H, Kb]` each: `A_c[j]` the sampled mass on key block `j`, `A_s[d]`
        the sampled mass on block diagonal `d = row // block_size - j`.
    """
    b, h, r, n = a_hat.shape
    kb = cdiv(n, block_size)
    padded = torch.zeros(b, h, r, kb * block_size, dtype=a_hat.dtype, device=a_hat.device)
    padded[..., :n] = a_hat
    cells = padded.reshape(b, h, r, kb, block_size).sum(dim=-1)  # [B, H, R, Kb]
    column = cells.sum(dim=2)
    # Cells right of a row's block are 0 (causal); park them on an extra slot.
    diag = (rows // block_size)[:, None] - torch.arange(kb, device=a_hat.device)[None, :]
    diag = torch.where(diag >= 0, diag, kb).expand(b, h, r, kb).reshape(b, h, r * kb)
    slash = torch.zeros(b, h, kb + 1, dtype=a_hat.dtype, device=a_hat.device)
    slash.scatter_add_(2, diag, cells.reshape(b, h, r * kb))
    return column, slash[..., :kb]


def find_k(scores: torch.Tensor, alpha: float | torch.Tensor) -> torch.Tensor:
    """Alg. 1 lines 6 and 8, `find_k(cumsum(sort(A)), alpha)`: int64 `[B, H]`.

    The smallest `k` whose `k` highest scores sum to at least `alpha` of the total,
    computed as `L - m` with `m` the most of the smallest scores whose sum (an
    ascending `cumsum`) is at most `(1 - alpha) * total`; float64. `alpha`: a float,
    or float64 `[H]` (one per head).
    """
    if isinstance(alpha, torch.Tensor):
        alpha = alpha.to(device=scores.device, dtype=torch.float64).unsqueeze(-1)
    tail = torch.sort(scores.to(torch.float64), dim=-1).values.cumsum(dim=-1)
    total = tail[..., -1:]
    dropped = (tail <= (1.0 - alpha) * total).sum(dim=-1)
    return scores.shape[-1] - dropped


def arg_topk(scores: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Alg. 1 lines 7 and 9, `arg_topk(A, k)`: bool `[B, H, L]`, the `k` highest per row.

    Ties: the lower index wins (a stable descending sort keeps equal scores in order).
    """
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    rank = torch.argsort(order, dim=-1)  # the inverse permutation: each index's place
    return rank < k.unsqueeze(-1)


def merge_blocks(columns: torch.Tensor, slashes: torch.Tensor) -> torch.Tensor:
    """Alg. 1 line 11, the extension: bool `[B, H, Kb, Kb]`, query block `i` x key block `j`.

    Key block `j <= i` is kept iff `columns[j]`, `slashes[i - j]` or `j = i` (the
    diagonal is always kept); `columns`, `slashes` are bool `[B, H, Kb]`.
    """
    kb = columns.shape[-1]
    i = torch.arange(kb, device=columns.device)[:, None]
    j = torch.arange(kb, device=columns.device)[None, :]
    diag = (i - j).clamp(min=0)
    by_slash = slashes[:, :, diag.reshape(-1)].reshape(*slashes.shape[:2], kb, kb)
    return (columns[:, :, None, :] | by_slash | (i == j)) & (j <= i)


def merge_index(columns: torch.Tensor, slashes: torch.Tensor, *, seqlen: int, block_size: int) -> BlockColumnPlan:
    """Alg. 1 line 11, `merge_index(I_c, I_s)`: extend the kept blocks over the matrix.

    Args:
        columns: bool `[B, H, Kb]`, kept column blocks `I_c`.
        slashes: bool `[B, H, Kb]`, kept block diagonals `I_s` (`d = i - j`).
        seqlen: N. block_size: the block grid.

    Returns:
        The plan of `merge_blocks`: for query block `i`, key block `j <= i` iff
        `columns[j]`, `slashes[i - j]` or `j = i`.
    """
    keep = merge_blocks(columns, slashes)
    return BlockColumnPlan.from_masks(keep, None, seqlen=seqlen, block_m=block_size, block_n=block_size)


def sample_attention_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    chunk_n: int = DEFAULT_CHUNK_N,
    block_size: int = 128,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 (Alg. 1 lines 1-4): (column `A_c`, slash `A_s`) float64 `[B, Hq, Kb]`.

    Raises:
        TypeError, ValueError: bad inputs.
    """
    shape = check_qk(q, k)
    check_positive_int("chunk_n", chunk_n)
    check_block_size("block_size", block_size)
    spans = sampled_rows(shape.seqlen, chunk_n, block_size)
    rows = torch.cat([torch.arange(a, z, device=q.device) for a, z in spans])
    a_hat = chunked_sampling(q, k, rows, scale=resolve_scale(scale, shape.head_dim))
    return block_reduction(a_hat, rows, block_size)


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
    """Stages 1 and 2 (Alg. 1 lines 1-9): kept (column blocks, block diagonals), bool `[B, Hq, Kb]`.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k)
    a_c, a_s, c_n = resolve_params(shape.seqlen, alpha_c=alpha_c, alpha_s=alpha_s, chunk_n=chunk_n,
                                   block_size=block_size, settings=settings)
    a_c = per_head(a_c, "alpha_c", shape.q_heads, check_alpha_c, device=q.device)
    a_s = per_head(a_s, "alpha_s", shape.q_heads, check_alpha_s, device=q.device)
    column, slash = sample_attention_scores(q, k, chunk_n=c_n, block_size=block_size, scale=scale)
    return arg_topk(column, find_k(column, a_c)), arg_topk(slash, find_k(slash, a_s))


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
    """SampleAttention plan (Alg. 1 up to `merge_index`); see the module doc.

    Args:
        q: `[B, Hq, N, D]`; k: `[B, Hkv, N, D]`. Each query head samples its own
            queries against its KV head's keys and selects its own blocks.
        alpha_c: CRA threshold of the column blocks, in [0, 1]; a scalar, or one per
            query head (a list or `[Hq]` tensor).
        alpha_s: CRA threshold of the slash blocks (block diagonals), in [0, 1]; the same.
        chunk_n: sampling chunks (>= 1); more than `N / block_size` samples every row.
        block_size: the block grid of sampling, selection and plan (>= 1).
        settings: tuned per-length settings (`SampleAttentionSettings` or a path to its
            JSON); they supply whichever of alpha_c, alpha_s, chunk_n is None. Without
            settings those default to 0.95, 0.95 and 1.
        scale: softmax scale of the sampling, `1/sqrt(D)` if None.

    Returns:
        A `BlockColumnPlan` with `block_m = block_n = block_size` and no columns.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    shape = check_qk(q, k)
    columns, slashes = sample_attention_selection(
        q, k, alpha_c=alpha_c, alpha_s=alpha_s, chunk_n=chunk_n, block_size=block_size,
        settings=settings, scale=scale,
    )
    return apply_rule(merge_index(columns, slashes, seqlen=shape.seqlen, block_size=block_size), q)


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
    """SampleAttention sparse attention through `sample_attention_plan` (Alg. 1).

    Args:
        q, k, alpha_c, alpha_s, chunk_n, block_size, settings, scale: as in
            `sample_attention_plan`. v: `[B, Hkv, N, D]`.

    Returns:
        `[B, Hq, N, D]` in q's dtype.

    Raises:
        TypeError, ValueError: bad inputs or parameters.
    """
    check_qkv(q, k, v)
    plan = sample_attention_plan(q, k, alpha_c=alpha_c, alpha_s=alpha_s, chunk_n=chunk_n,
                                 block_size=block_size, settings=settings, scale=scale)
    return sparse_attention(q, k, v, plan, scale=scale)
