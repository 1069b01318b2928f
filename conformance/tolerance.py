"""The one tolerance policy of sparseprefill: how close `fast` must be to the truth.

Nothing else in the project defines a tolerance; tests, the GPU conformance runner
and the demo all compare through this module.

Policy for attention outputs and log-sum-exps:

* golden: `reference` run on the inputs upcast to float64 (exact up to float64
  rounding; the inputs themselves are the fp16/bf16 values, so rounding of the
  inputs is not counted as error);
* baseline: plain PyTorch attention computed the way a user would write it, in
  the input dtype with the same dense mask: `q @ k^T` and `p @ v` matmuls in
  fp16/bf16, softmax and log-sum-exp in fp32 as `torch.softmax` does
  (`baseline_attention`);
* error: the largest absolute elementwise difference from golden;
* allowed: `factor * baseline_error + floor`; NaN and +inf never pass, and -inf
  lse must sit exactly where golden has -inf (rows with no kept key), with the
  output there exactly 0.

Numbers (measured with `TRITON_INTERPRET=1`, triton 3.9, torch 2.13 CPU, 60 random
block/column plans with N in 1..200, D in 16..128, |q| scaled 0.5-4, fp16 and bf16):

* output: the kernel's error / baseline error ranged 0.14-2.1. Above 1 only in
  bf16, where both errors are the final rounding of the output (the kernel made
  1/2 ulp of the largest output, 1.56e-2 for |out| ~ 4, where the baseline was
  6.8e-3). So `OUT_FACTOR = 2` (as flash-attention's tests use) and a floor of
  one dtype epsilon times the largest golden magnitude (`OUT_FLOOR_EPS = 1`,
  i.e. twice the output's own rounding). Tiny cases (N = 1, 2) make zero error
  in both. Over 400 conformance examples (N <= 200, `--seed 7`: end_to_end,
  sparse_attention, masked_attention) the worst output or lse error used 44% of
  its allowance.
* lse: the kernel computes scores from exact fp16/bf16 products in fp32; its error
  was <= 5.7e-6 with |lse| <= 18 (3.7e-7 relative); the baseline's scores are
  rounded to the input dtype, 3e-4 to 7e-2. `LSE_FACTOR = 2` and a floor of
  `2**-16 * max(1, max |lse|)`, 40x the kernel's measured relative error, because
  the baseline is sometimes exact (N = 1 with an exactly representable score).
* recall (`fast.recall` is `exp(lse_kept - lse_full)` from two kernel passes, in
  fp32): at most 5.7e-6 from the float64 reference, growing with |lse| (about
  3.7e-7 * |lse|). Allowed: `RECALL_FLOOR + RECALL_PER_LOGIT * max(1, max |lse|)
  + RECALL_PER_TILE * ceil(N / 64)`, 1e-5 + 2e-6 * |lse| + 2**-23 per 64-key tile;
  the last term is for the sequential fp32 sum over key tiles at long N on the
  GPU (the allowance is 8e-5 at N = 16K with |lse| = 20). Over 100 examples
  the worst recall error used 13% of the allowance. A kept/dropped key
  mix-up moves recall by that key's probability, so the check catches any
  mix-up of a key carrying more than about 1e-4 of a row's mass.

* block means (`sparse_attention(..., block_mean_out=)`): the kernel sums exact
  fp16/bf16 products in fp32 and divides by the pair count; the
  worst error used 0.03% of its allowance over 100 CPU examples (`TRITON_INTERPRET=1`). Allowed:
  `BLOCK_MEAN_REL * max(1, max |logit|)` with `BLOCK_MEAN_REL = 2**-16`, the lse's
  relative floor; -inf must sit exactly where the reference has it (unlisted blocks).

* estimates (`MethodSpec.estimate`: a method's numbers before any top-k, e.g. the
  vertical-slash scores, sums of up to `last_q` fp32 probabilities, or block-sparse
  pooled means, fp32 means of `block_size` fp16/bf16 values): each `Estimate` says
  how many summands (`terms`) of what magnitude (`bound`) make an entry. Allowed:
  `ESTIMATE_REL * terms * bound` with `ESTIMATE_REL = 2**-16` (1.5e-5 per summand).
  Measured over 300 conformance examples per method (`TRITON_INTERPRET=1`, N <= 200,
  D 16 to 256, random, planted-line and lattice inputs, `last_q` 1 to N, lowered key
  splits): the vertical-slash scores erred by at most 1.1e-6 per row (7% of the
  allowance; fp32 `exp2` of logits up to ~50 in log2 units), the pooled means by less
  than 1e-9 relative (fp32 sums of 16-bit values are nearly exact). The allowance
  equals the tie check's margin (`ties.line_tolerance`, 1e-5 per row): an estimate
  that erred more could flip a top-k decision the tie check would forgive. Sums of
  probabilities take `bound = max(1, 2**-8 * scale * max|q| * max|k| * D)`
  (`registry._probability_bound`): a probability of fp32 logits errs by about
  `2**-24 |s - m|` relative, so past logits of 2**8 the allowance grows with the
  largest possible one (a vertical-slash slash sum of six rows at D 192, |q| x 2,
  scale 0.4 and a planted late peak erred by 1.2e-4: 1.27x the flat allowance). The same
  rule covers the other estimators (30 examples each, same inputs, explicit scales
  0.05 and 0.4 among them): AnchorAttention's anchors `x_a` (row maxima of D-term fp32
  dot products, `bound = scale max|q| max|k|`), their block means and the pooled
  queries erred by at most 0.3% of the allowance; SampleAttention's sampled column
  and slash block scores (sums of one probability per sampled row) 1.5%; MInference's
  per-pattern estimates 1.3% (the single methods in the same run: vertical-slash 3.0%,
  block-sparse 0.05%).

Re-measure with `python -m sparseprefill.conformance --device cuda` (its table
prints the largest error / allowed ratio of every property).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..reference.attention import attention as reference_attention

OUT_FACTOR = 2.0
OUT_FLOOR_EPS = 1.0
LSE_FACTOR = 2.0
LSE_FLOOR_REL = 2.0**-16
RECALL_FLOOR = 1e-5
RECALL_PER_LOGIT = 2e-6
RECALL_PER_TILE = 2.0**-23
BLOCK_MEAN_REL = 2.0**-16
ESTIMATE_REL = 2.0**-16

# Chunks of the baseline's fp32 scores: about 256 MiB, so N = 16K fits anywhere.
_CHUNK_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Comparison:
    """One measured error against its allowance.

    Attributes:
        name: what was compared ("out", "lse", "recall").
        error: largest absolute difference from golden.
        baseline_error: the same for the baseline (NaN where there is no baseline).
        allowed: the allowance the error must not exceed.
    """

    name: str
    error: float
    baseline_error: float
    allowed: float

    @property
    def ratio(self) -> float:
        """`error / allowed` (<= 1 passes); 0 when both are 0."""
        if self.error == 0:
            return 0.0
        return self.error / self.allowed if self.allowed > 0 else math.inf

    def describe(self) -> str:
        return (f"{self.name}: max abs error {self.error:.3e}, baseline {self.baseline_error:.3e}, "
                f"allowed {self.allowed:.3e} (ratio {self.ratio:.3f})")


def dtype_eps(dtype: torch.dtype) -> float:
    """Machine epsilon of a floating dtype (the ulp at 1.0)."""
    return float(torch.finfo(dtype).eps)


def upcast(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Float64 copies of `tensors` (the golden computation's inputs)."""
    return tuple(t.to(torch.float64) for t in tensors)


def golden_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.attention` on float64 copies of the inputs.

    Args:
        q: `[B, Hq, N, D]`; k, v: `[B, Hkv, N, D]`, any float dtype.
        mask: bool, broadcastable to `[B, Hq, N, N]`, or None (causal).
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        (out float64 `[B, Hq, N, D]`, lse float32 `[B, Hq, N]`).
    """
    q64, k64, v64 = upcast(q, k, v)
    return reference_attention(q64, k64, v64, mask, scale=scale, return_lse=True)


def baseline_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain PyTorch causal attention in the input dtype (the error yardstick).

    `q @ k^T` and `p @ v` run in q's dtype, the softmax and log-sum-exp in fp32
    (as `torch.softmax` of half scores is usually written), a chunk of query rows
    at a time. Rows with no kept key give 0 and -inf, as in `reference`.

    Args:
        q: `[B, Hq, N, D]`; k, v: `[B, Hkv, N, D]`, same dtype.
        mask: bool, broadcastable to `[B, Hq, N, N]`, or None (causal).
        scale: softmax scale, `1/sqrt(D)` if None.

    Returns:
        (out `[B, Hq, N, D]` in q's dtype, lse float32 `[B, Hq, N]`).
    """
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    sm_scale = 1.0 / math.sqrt(d) if scale is None else scale
    dense_mask = None
    if mask is not None:
        dense_mask = mask.reshape((1, 1, n, n) if mask.dim() == 2 else mask.shape)
    qg = q.reshape(b, hkv, g, n, d)
    kg = k.unsqueeze(2)
    vg = v.unsqueeze(2)
    out = torch.empty(b, hkv, g, n, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hkv, g, n, dtype=torch.float32, device=q.device)
    chunk = max(1, min(n, _CHUNK_BYTES // max(1, b * hq * n * 4)))
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        rows = torch.arange(start, stop, device=q.device)
        keep = torch.arange(stop, device=q.device)[None, :] <= rows[:, None]
        if dense_mask is not None:
            part = dense_mask[:, :, start:stop, :stop]
            bm, hm = part.shape[:2]
            part = part.reshape(bm, 1, 1, *part.shape[2:]) if hm == 1 else \
                part.reshape(bm, hkv, g, *part.shape[2:])
            keep = keep & part
        scores = torch.matmul(qg[:, :, :, start:stop], kg[:, :, :, :stop].transpose(-1, -2)) * sm_scale
        scores32 = scores.float().masked_fill(~keep, -math.inf)
        lse[:, :, :, start:stop] = torch.logsumexp(scores32, dim=-1)
        probs = torch.softmax(scores32, dim=-1).nan_to_num_(0.0).to(q.dtype)
        out[:, :, :, start:stop] = torch.matmul(probs, vg[:, :, :, :stop])
    return out.reshape(b, hq, n, d), lse.reshape(b, hq, n)


def _max_abs(a: torch.Tensor, b: torch.Tensor, where: torch.Tensor | None = None) -> float:
    diff = (a.to(torch.float64) - b.to(torch.float64)).abs()
    if where is not None:
        diff = diff[where]
    return float(diff.max().item()) if diff.numel() else 0.0


def _fail(context: str, message: str) -> AssertionError:
    prefix = f"[{context}] " if context else ""
    return AssertionError(prefix + message)


def check_output(
    out: torch.Tensor,
    golden: torch.Tensor,
    baseline: torch.Tensor,
    *,
    context: str = "",
) -> Comparison:
    """Check an attention output against golden under the policy.

    Args:
        out: `[B, Hq, N, D]` fp16/bf16, the result under test.
        golden: the same shape, float64 (`golden_attention`).
        baseline: the same shape, `baseline_attention`'s output.
        context: words prefixed to the failure message (shape, dtype, plan).

    Returns:
        The `Comparison` (its ratio feeds the conformance table).

    Raises:
        AssertionError: shape mismatch, NaN/inf anywhere, or error above allowance;
            the message gives error, baseline error, allowance and the worst index.
    """
    if out.shape != golden.shape:
        raise _fail(context, f"out has shape {tuple(out.shape)}, golden {tuple(golden.shape)}")
    bad = ~torch.isfinite(out)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise _fail(context, f"out has {int(bad.sum())} non-finite values (NaN/inf never passes); "
                             f"first at {where}: {out[where].item()}")
    error = _max_abs(out, golden)
    base = _max_abs(baseline, golden)
    magnitude = max(1.0, float(golden.abs().max().item()) if golden.numel() else 0.0)
    allowed = OUT_FACTOR * base + OUT_FLOOR_EPS * dtype_eps(out.dtype) * magnitude
    cmp = Comparison("out", error, base, allowed)
    if error > allowed:
        diff = (out.to(torch.float64) - golden).abs()
        where = tuple(int(i) for i in (diff == diff.max()).nonzero()[0].tolist())
        raise _fail(context, f"{cmp.describe()}; worst at {where}: got {out[where].item():.6g}, "
                             f"golden {golden[where].item():.6g}")
    return cmp


def check_lse(
    lse: torch.Tensor,
    golden: torch.Tensor,
    baseline: torch.Tensor,
    *,
    context: str = "",
) -> Comparison:
    """Check a log-sum-exp `[B, Hq, N]` against golden under the policy.

    -inf must appear exactly where golden is -inf (rows with no kept key); NaN and
    +inf never pass; finite entries are compared as in `check_output`.

    Raises:
        AssertionError: with the numbers and the first offending index.
    """
    if lse.shape != golden.shape:
        raise _fail(context, f"lse has shape {tuple(lse.shape)}, golden {tuple(golden.shape)}")
    if lse.dtype != torch.float32:
        raise _fail(context, f"lse must be float32, got {lse.dtype}")
    bad = torch.isnan(lse) | (lse == math.inf)
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise _fail(context, f"lse has NaN or +inf; first at {where}: {lse[where].item()}")
    golden_empty = golden == -math.inf
    mismatch = golden_empty != (lse == -math.inf)
    if bool(mismatch.any()):
        where = tuple(int(i) for i in mismatch.nonzero()[0].tolist())
        raise _fail(context, f"lse is -inf exactly where a row keeps no key; at {where} got "
                             f"{lse[where].item()}, golden {golden[where].item()}")
    finite = ~golden_empty
    error = _max_abs(lse, golden, finite)
    base_finite = finite & torch.isfinite(baseline)
    base = _max_abs(baseline, golden, base_finite)
    magnitude = max(1.0, float(golden[finite].abs().max().item()) if bool(finite.any()) else 0.0)
    allowed = LSE_FACTOR * base + LSE_FLOOR_REL * magnitude
    cmp = Comparison("lse", error, base, allowed)
    if error > allowed:
        diff = torch.where(finite, (lse.double() - golden.double()).abs(), 0.0)
        where = tuple(int(i) for i in (diff == diff.max()).nonzero()[0].tolist())
        raise _fail(context, f"{cmp.describe()}; worst at {where}: got {lse[where].item():.8g}, "
                             f"golden {golden[where].item():.8g}")
    return cmp


def check_attention(
    out: torch.Tensor,
    lse: torch.Tensor | None,
    golden: tuple[torch.Tensor, torch.Tensor],
    baseline: tuple[torch.Tensor, torch.Tensor],
    *,
    context: str = "",
) -> float:
    """Check output (and lse if given) and the zero output of rows with no kept key.

    Args:
        out, lse: the result under test (lse may be None).
        golden: `golden_attention`'s (out, lse). baseline: `baseline_attention`'s.
        context: prefix for failure messages.

    Returns:
        The largest error / allowance ratio of the comparisons made.

    Raises:
        AssertionError: any comparison fails.
    """
    ratios = [check_output(out, golden[0], baseline[0], context=context).ratio]
    empty = golden[1] == -math.inf
    if bool(empty.any()):
        rows = out[empty]
        if bool((rows != 0).any()):
            where = tuple(int(i) for i in empty.nonzero()[0].tolist())
            raise _fail(context, f"rows with no kept key must give output exactly 0; row {where} "
                                 f"has max |out| {float(rows.abs().max()):.3e}")
    if lse is not None:
        ratios.append(check_lse(lse, golden[1], baseline[1], context=context).ratio)
    return max(ratios)


def recall_allowance(max_abs_lse: float, seqlen: int) -> float:
    """Allowed absolute recall error (see the module doc for the measurement)."""
    return (RECALL_FLOOR + RECALL_PER_LOGIT * max(1.0, max_abs_lse)
            + RECALL_PER_TILE * math.ceil(seqlen / 64))


def check_recall(
    got: torch.Tensor,
    expected: torch.Tensor,
    *,
    max_abs_lse: float,
    context: str = "",
) -> Comparison:
    """Check `fast.recall` against `reference.recall` (both float32 `[B, Hq, N]`).

    Args:
        got, expected: recall per row; `expected` from `reference.recall`.
        max_abs_lse: largest |lse| of full causal attention on these inputs (the
            fp32 error of `fast.recall` grows with it).
        context: prefix for failure messages.

    Raises:
        AssertionError: shape, NaN, a value outside [0, 1], or error above allowance.
    """
    if got.shape != expected.shape:
        raise _fail(context, f"recall has shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    if bool((~torch.isfinite(got)).any()):
        raise _fail(context, "recall has NaN or inf")
    if bool(((got < 0) | (got > 1)).any()):
        raise _fail(context, f"recall must lie in [0, 1], got range [{float(got.min())}, {float(got.max())}]")
    error = _max_abs(got, expected)
    allowed = recall_allowance(max_abs_lse, int(got.shape[-1]))
    cmp = Comparison("recall", error, math.nan, allowed)
    if error > allowed:
        diff = (got.double() - expected.double()).abs()
        where = tuple(int(i) for i in (diff == diff.max()).nonzero()[0].tolist())
        raise _fail(context, f"{cmp.describe()}; worst at {where}: got {got[where].item():.8f}, "
                             f"reference {expected[where].item():.8f}")
    return cmp


def check_block_means(
    got: torch.Tensor,
    expected: torch.Tensor,
    *,
    max_abs_logit: float,
    context: str = "",
) -> Comparison:
    """Check `block_mean_out` of `fast` against the reference's (float32 `[B, Hq, Qb, Kb]`).

    Args:
        got, expected: block means; -inf marks blocks the plan does not list.
        max_abs_logit: largest |scaled logit| of the inputs (the fp32 sums' error
            grows with it).
        context: prefix for failure messages.

    Raises:
        AssertionError: shape, NaN/+inf, -inf in other places, or error above allowance.
    """
    if got.shape != expected.shape:
        raise _fail(context, f"block means have shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    if bool((torch.isnan(got) | (got == math.inf)).any()):
        raise _fail(context, "block means have NaN or +inf")
    listed = expected != -math.inf
    mismatch = listed != (got != -math.inf)
    if bool(mismatch.any()):
        where = tuple(int(i) for i in mismatch.nonzero()[0].tolist())
        raise _fail(context, f"block means are -inf exactly on unlisted blocks; at {where} got "
                             f"{got[where].item()}, reference {expected[where].item()}")
    error = _max_abs(got, expected, listed)
    allowed = BLOCK_MEAN_REL * max(1.0, max_abs_logit)
    cmp = Comparison("block_mean", error, math.nan, allowed)
    if error > allowed:
        diff = torch.where(listed, (got.double() - expected.double()).abs(), 0.0)
        where = tuple(int(i) for i in (diff == diff.max()).nonzero()[0].tolist())
        raise _fail(context, f"{cmp.describe()}; worst at {where}: got {got[where].item():.8g}, "
                             f"reference {expected[where].item():.8g}")
    return cmp


@dataclass(frozen=True)
class Estimate:
    """A method's intermediate numbers (before any top-k), with what bounds their rounding.

    Attributes:
        values: the numbers (any shape); -inf / +inf allowed where they mean something
            (they must then sit at the same places in both packages).
        terms: the most summands any entry is made of.
        bound: the largest magnitude of one summand (of a partial sum for a mean).
    """

    values: torch.Tensor
    terms: int
    bound: float


def estimate_allowance(terms: int, bound: float) -> float:
    """Allowed absolute error of an estimate (see the module doc for the measurement)."""
    return ESTIMATE_REL * max(1, terms) * max(bound, 2.0**-24)


def check_estimate(
    got: torch.Tensor,
    expected: Estimate,
    *,
    name: str = "estimate",
    context: str = "",
) -> Comparison:
    """Check one `fast` estimate against the reference's.

    Args:
        got: the fast values, the shape of `expected.values`.
        expected: the reference's `Estimate` (its `terms` and `bound` set the allowance).
        name: what is compared (for messages).
        context: prefix for failure messages.

    Raises:
        AssertionError: shape, NaN where the reference has a number, infinities at other
            places, or error above `estimate_allowance`.
    """
    want = expected.values
    if tuple(got.shape) != tuple(want.shape):
        raise _fail(context, f"{name} has shape {tuple(got.shape)}, reference {tuple(want.shape)}")
    got64 = got.detach().to(torch.float64).cpu()
    want64 = want.detach().to(torch.float64).cpu()
    nan_bad = torch.isnan(got64) != torch.isnan(want64)
    inf_bad = (torch.isinf(got64) | torch.isinf(want64)) & (got64 != want64)
    bad = nan_bad | inf_bad
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0].tolist())
        raise _fail(context, f"{name}: NaN or infinity where the reference differs; first at {where}: "
                             f"got {got64[where].item()}, reference {want64[where].item()}")
    finite = torch.isfinite(want64)
    error = _max_abs(got64, want64, finite)
    allowed = estimate_allowance(expected.terms, expected.bound)
    cmp = Comparison(name, error, math.nan, allowed)
    if error > allowed:
        diff = torch.where(finite, (got64 - want64).abs(), 0.0)
        where = tuple(int(i) for i in (diff == diff.max()).nonzero()[0].tolist())
        raise _fail(context, f"{cmp.describe()} ({expected.terms} terms of at most {expected.bound:.3g}); "
                             f"worst at {where}: got {got64[where].item():.8g}, reference "
                             f"{want64[where].item():.8g}")
    return cmp


@contextmanager
def nan_poisoned_empty() -> Iterator[None]:
    """Make `torch.empty` return NaN-filled float tensors inside the block.

    The fast launchers allocate outputs with `torch.empty`; poisoning them makes an
    unwritten output element (or lse entry) NaN, which no property lets pass.
    """
    real = torch.empty

    def poisoned(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = real(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(math.nan)
        return t

    setattr(torch, "empty", poisoned)
    try:
        yield
    finally:
        setattr(torch, "empty", real)
