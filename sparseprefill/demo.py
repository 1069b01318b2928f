"""`sparseprefill demo`: every registered method on one built-in workload.

The workload is synthetic but shaped like real prefill attention, so that methods
differ in recall: a few attention-sink keys every query favours, rotary position
terms that make attention local and add periodic diagonals ("slashes"), a few
heavy-hitter keys that form vertical stripes, and noise. Each query head of a
GQA group mixes these with its own weights.

For every method the demo runs the `reference` and `fast` estimators and
end-to-end functions and prints density, recall, output error and time; it saves
a picture of every method's mask. On a CPU the fast kernels run in Triton's
interpreter at a small N; on a GPU the demo runs at 32K tokens, where the float64
reference (dense `[N, N]` masks) is too large, so there the golden output is
float32 SDPA and recall comes from the kernel's log-sum-exp.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

CPU_SEQLEN = 800
GPU_SEQLEN = 32768
# Above this N the float64 reference (dense [B, Hq, N, N] masks) is not run.
REFERENCE_MAX_SEQLEN = 8192


@dataclass(frozen=True)
class Shape:
    """Workload sizes: `q: [batch, q_heads, seqlen, head_dim]`, k and v with kv_heads."""

    batch: int
    q_heads: int
    kv_heads: int
    seqlen: int
    head_dim: int
    dtype: torch.dtype


@dataclass
class Row:
    """One line of the demo table (None: not measured, see `notes`)."""

    method: str
    backend: str
    seqlen: int
    density: float | None
    recall_mean: float | None
    recall_min: float | None
    same_plan: bool | None
    error_vs_full: float | None
    error_vs_ref64: float | None
    ms: float | None
    notes: str = ""


def default_shape(device: torch.device, seqlen: int | None) -> Shape:
    """The demo's sizes: small fp16 on CPU, a Llama-3-8B-like bf16 head set on GPU."""
    if device.type == "cuda":
        return Shape(1, 32, 8, GPU_SEQLEN if seqlen is None else seqlen, 128, torch.bfloat16)
    return Shape(1, 4, 2, CPU_SEQLEN if seqlen is None else seqlen, 64, torch.float16)


def _rotate(x: torch.Tensor, pos: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `x: [..., N, 2P]` (pairs `(2f, 2f+1)` turned by `pos * theta[f]`)."""
    angle = pos[:, None] * theta[None, :]
    cos, sin = torch.cos(angle), torch.sin(angle)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * sin
    out[..., 1::2] = x0 * sin + x1 * cos
    return out


def synthetic_qkv(shape: Shape, *, device: torch.device, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Deterministic q, k, v with sinks, local decay, slashes and vertical stripes.

    Built in float64 on the CPU (so every device gets the same inputs); the scaled
    logit of query `i` and key `j` is the sum of
    * sinks: the first 4 keys get +6 to +9 (plus `log(N / 1000)` beyond 1000 tokens,
      so sinks keep a similar share of the mass at any N);
    * vertical stripes: about N/100 random keys get +1 to +6;
    * local decay: rotary pairs whose weights sum to a bump of width about N/40 around
      `j = i` (+1.5 to +4.5 at its peak);
    * slashes: harmonics of one period (N/12 to N/5, per KV head) summing to thin
      diagonals at `i - j = period, 2 period, ...` (+3 for one query head per group);
    * Gaussian noise; the weights differ per query head.

    Args:
        shape: sizes and dtype; `head_dim >= 16` and even.
        device: where the tensors go.
        seed: all randomness comes from a generator seeded with it.

    Returns:
        `(q, k, v)`: `q: [B, Hq, N, D]`, `k, v: [B, Hkv, N, D]` in `shape.dtype`.

    Raises:
        ValueError: head_dim too small or odd, or q_heads not a multiple of kv_heads.
    """
    b, hq, hkv, n, d = shape.batch, shape.q_heads, shape.kv_heads, shape.seqlen, shape.head_dim
    if d < 16 or d % 2:
        raise ValueError(f"head_dim must be even and >= 16, got {d}")
    if hq % hkv:
        raise ValueError(f"q_heads ({hq}) must be a multiple of kv_heads ({hkv})")
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    root_d = math.sqrt(d)
    group = hq // hkv
    pos = torch.arange(n, dtype=f64)

    k = torch.randn(b, hkv, n, d, generator=gen, dtype=f64) * 0.3
    v = torch.randn(b, hkv, n, d, generator=gen, dtype=f64)
    q = torch.randn(b, hq, n, d, generator=gen, dtype=f64) * 0.3
    mix = torch.rand(hq, 3, generator=gen, dtype=f64)

    # Channel 0: sinks. Channel 1: heavy hitters. Channels 2, 3: noise only.
    k[..., 0] = 0.0
    k[..., :4, 0] = 1.0
    q[..., 0] = ((6.0 + 3.0 * mix[:, 0] + math.log(max(n, 1000) / 1000)) * root_d)[None, :, None]
    heavy = torch.rand(b, hkv, n, generator=gen) < 0.01
    k[..., 1] = torch.where(heavy, 1.0 + torch.rand(b, hkv, n, generator=gen, dtype=f64), 0.0)
    q[..., 1] = (2.0 * (0.5 + mix[:, 1]) * root_d)[None, :, None]

    # Channels 4..: rotary pairs. Pair f turned by theta_f in both q and k contributes
    # a_f b_f cos(theta_f (i - j)), so the weights shape the logit as a function of i - j.
    pairs = (d - 4) // 2
    local_pairs = pairs // 2
    slash_pairs = pairs - local_pairs
    f = torch.arange(1, local_pairs + 1, dtype=f64)
    # Frequencies 2 pi f / N: the bump repeats only at i - j = N, outside the sequence.
    local_theta = 2 * math.pi * f / n
    local_weight = torch.exp(-0.5 * (f / (local_pairs / 2.5)) ** 2)
    m = torch.arange(1, slash_pairs + 1, dtype=f64)
    # A Hann taper on the harmonics keeps the side lobes between the diagonals low.
    slash_weight = torch.cos(0.5 * math.pi * m / (slash_pairs + 1)) ** 2
    periods = torch.randint(max(8, n // 12), max(9, n // 5), (hkv,), generator=gen).to(f64)
    rot = slice(4, 4 + 2 * pairs)
    for h in range(hkv):
        theta = torch.cat([local_theta, 2 * math.pi * m / periods[h]])
        weight = torch.cat([local_weight, slash_weight])
        turned = _rotate(torch.stack([weight.sqrt(), torch.zeros_like(weight)], -1).reshape(1, -1)
                         .expand(n, 2 * pairs), pos, theta)
        k[:, h, :, rot] += turned
        for g in range(group):
            i = h * group + g
            local_bonus = 1.5 + 3.0 * float(mix[i, 2])
            slash_bonus = 3.0 if g == 0 else 0.3
            scale = torch.cat([
                torch.full((local_pairs,), local_bonus / float(local_weight.sum())),
                torch.full((slash_pairs,), slash_bonus / float(slash_weight.sum())),
            ]).to(f64) * root_d
            q[:, i, :, rot] += turned * scale.repeat_interleave(2)
    return tuple(t.to(device=device, dtype=shape.dtype) for t in (q, k, v))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `sparseprefill demo`."""
    parser.add_argument("--seqlen", type=int, default=None,
                        help=f"tokens (default {CPU_SEQLEN} on CPU, {GPU_SEQLEN} on GPU)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: cuda if available, else cpu (fast kernels interpreted)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated subset of the registered methods (default: all)")
    parser.add_argument("--out", default="out/sparseprefill-demo.png",
                        help="PNG of every method's plan for batch 0, head 0 (default "
                             "out/sparseprefill-demo.png; out/ is git-ignored)")
    parser.add_argument("--json", default=None, help="also write the table as JSON here (default: none)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")


def resolve_device(name: str) -> torch.device:
    """`auto` -> cuda if torch sees a GPU, else cpu."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but torch sees no CUDA device")
    return torch.device(name)


def enable_interpreter() -> None:
    """Make Triton run kernels on the CPU; must happen before the kernels are defined.

    Raises:
        RuntimeError: the kernels were already imported without the interpreter.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "sparseprefill.fast.kernels.block_column" in sys.modules:
        raise RuntimeError(
            "sparseprefill.fast was imported without TRITON_INTERPRET=1; run the CPU demo in "
            "a fresh process (or set TRITON_INTERPRET=1 before importing it)"
        )
    os.environ["TRITON_INTERPRET"] = "1"


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> tuple[Any, float]:
    """Result of `fn()` and its wall time in ms (on GPU: median of `repeats`, after a warm-up)."""
    if device.type != "cuda":
        start = time.perf_counter()
        result = fn()
        return result, (time.perf_counter() - start) * 1e3
    result = fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return result, statistics.median(times)


def _sdpa_full(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Causal SDPA in `dtype` with K and V repeated per query head (a baseline, not a kernel)."""
    group = q.shape[1] // k.shape[1]
    return torch.nn.functional.scaled_dot_product_attention(
        q.to(dtype), k.to(dtype).repeat_interleave(group, dim=1),
        v.to(dtype).repeat_interleave(group, dim=1), is_causal=True,
    )


def _explain_difference(spec: Any, q: torch.Tensor, k: torch.Tensor, params: dict[str, Any],
                         ref_plan: Any, plan: Any) -> tuple[str, bool]:
    """(note, is a failure) for a fast plan that differs from the reference plan.

    Methods with `exact_plans` must match; others may differ only where a top-k met
    an exactly tied score, which their conformance `tie_check` verifies (the checks
    live in `sparseprefill.conformance`, imported only here).
    """
    from .conformance.registry import checks_for

    checks = checks_for(spec.name)
    if checks.exact_plans or checks.tie_check is None:
        return "plans differ", True
    try:
        checks.tie_check(q, k, params, ref_plan, plan)
    except AssertionError as exc:
        return f"plans differ beyond ties: {exc}", True
    return "plans differ at exact ties only", False


def _fmt(x: float | bool | None, spec: str) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    return format(x, spec)


def format_table(rows: list[Row]) -> str:
    """The demo table as aligned text."""
    head = ("method", "backend", "N", "density", "recall mean", "recall min", "same plan",
            "err vs full", "err vs ref64", "time ms")
    body = [
        (r.method, r.backend, str(r.seqlen), _fmt(r.density, ".1%"), _fmt(r.recall_mean, ".4f"),
         _fmt(r.recall_min, ".4f"), _fmt(r.same_plan, ""), _fmt(r.error_vs_full, ".2e"),
         _fmt(r.error_vs_ref64, ".2e"), _fmt(r.ms, ".1f"))
        for r in rows
    ]
    widths = [max(len(h), *(len(line[i]) for line in body)) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip(),
             "  ".join("-" * w for w in widths)]
    for r, line in zip(rows, body):
        text = "  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip()
        lines.append(text + (f"  ({r.notes})" if r.notes else ""))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the demo; print the table; save the PNG (and JSON). Exit code 0, or 1 on a failure."""
    try:
        device = resolve_device(args.device)
    except ValueError as exc:
        print(f"sparseprefill demo: error: {exc}", file=sys.stderr)
        return 2
    if device.type == "cpu":
        enable_interpreter()
    # Imported only now: importing `fast` defines the Triton kernels, which must see
    # TRITON_INTERPRET on a CPU.
    from . import fast, reference
    from ._viz import attention_image, plan_image, save_mask_figure
    from .methods import METHODS

    shape = default_shape(device, args.seqlen)
    names = list(METHODS) if args.methods is None else [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if shape.seqlen < 1:
        print(f"sparseprefill demo: error: --seqlen must be >= 1, got {shape.seqlen}", file=sys.stderr)
        return 2
    if unknown or not names:
        what = f"unknown {', '.join(unknown)}" if unknown else "no method given"
        print(f"sparseprefill demo: error: --methods: {what}; registered: {', '.join(METHODS)}",
              file=sys.stderr)
        return 2
    n = shape.seqlen
    with_reference = n <= REFERENCE_MAX_SEQLEN
    repeats = 3
    q, k, v = synthetic_qkv(shape, device=device, seed=args.seed)
    q64, k64, v64 = (t.to(torch.float64) if with_reference else t for t in (q, k, v))

    if with_reference:
        golden = reference.attention(q64, k64, v64)
        golden_name = "float64 reference.attention (full causal)"
    else:
        golden = _sdpa_full(q, k, v, torch.float32)
        golden_name = "float32 SDPA (full causal)"
    backend = "fast" if device.type == "cuda" else "fast (interpreter)"
    print(f"sparseprefill demo: device {device}, q [{shape.batch}, {shape.q_heads}, {n}, "
          f"{shape.head_dim}], k/v {shape.kv_heads} heads, {str(shape.dtype).removeprefix('torch.')}",
          flush=True)

    rows: list[Row] = []
    panels = [("workload: attention of head 0\n(log scale, 1e-4 .. 1)",
               attention_image(q[0, 0], k[0, 0]))]
    started = time.perf_counter()
    failed = False
    for name in names:
        spec = METHODS[name]
        params = spec.call_params(spec.demo_params(n), q)
        ref_plan = None
        ref_view = None
        if with_reference:
            try:
                ref_view = spec.method_view("reference", q, k, v, params)
                ref_plan = ref_view.plan if spec.plan_based else None
                ref_out, ms = _timed(lambda: spec.run_fn("reference")(q, k, v, **params), device, 1)
                ref64 = spec.run_fn("reference")(q64, k64, v64, **params)
                rec = ref_view.recall
                rows.append(Row(
                    name, "reference", n, float(ref_view.density.mean()),
                    None if rec is None else float(rec.mean()), None if rec is None else float(rec.min()), None,
                    reference.relative_error(ref_out, golden), reference.relative_error(ref_out, ref64), ms,
                    ref_view.notes,
                ))
            except Exception as exc:  # a broken method must not hide the others
                failed = True
                rows.append(Row(name, "reference", n, None, None, None, None, None, None, None,
                                f"failed: {type(exc).__name__}: {exc}"))
        try:
            view = spec.method_view("fast", q, k, v, params, with_recall=False)
            plan = view.plan
            out, ms = _timed(lambda: spec.run_fn("fast")(q, k, v, **params), device, repeats)
            rec = None
            if spec.plan_based and plan is not None:
                rec = reference.recall(q, k, plan) if with_reference else fast.recall(q, k, plan)
            same = None if ref_plan is None or plan is None else plan.equal(ref_plan)
            notes = view.notes
            if same is False:
                notes, bad = _explain_difference(spec, q, k, params, ref_plan, plan)
                failed = failed or bad
            rows.append(Row(
                name, backend, n, float(view.density.mean()),
                None if rec is None else float(rec.mean()), None if rec is None else float(rec.min()),
                same, reference.relative_error(out, golden),
                reference.relative_error(out, ref64) if with_reference and ref_view is not None else None,
                ms, notes,
            ))
            d0 = float(view.density[0, 0])
            if plan is not None:
                what = f"recall {float(rec[0, 0].mean()):.3f}" if rec is not None else "exact keys shown"
                panels.append((f"{name} (head 0)\ndensity {d0:.1%}, {what}", plan_image(plan)))
        except Exception as exc:
            failed = True
            rows.append(Row(name, backend, n, None, None, None, None, None, None, None,
                            f"failed: {type(exc).__name__}: {exc}"))
        print(f"  {name}: done at {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)

    if device.type == "cuda":
        try:
            out, ms = _timed(lambda: _sdpa_full(q, k, v, shape.dtype), device, repeats)
            rows.append(Row("(causal SDPA)", "torch", n, 1.0, 1.0, 1.0, None,
                            reference.relative_error(out, golden), None, ms,
                            "K/V repeated per head; default SDPA backend"))
        except RuntimeError as exc:
            rows.append(Row("(causal SDPA)", "torch", n, None, None, None, None, None, None, None,
                            f"failed: {exc}"))

    print()
    print(format_table(rows))
    print()
    print(f"err vs full: relative L2 error against {golden_name}.")
    if with_reference:
        print("err vs ref64: against the same method's reference run in float64. "
              "recall mean: float64 reference.recall of the row's plan, mean over rows and heads; "
              "recall min: the worst single query row of any head (a row whose mass lies in blocks "
              "or lines the method did not pick: block_sparse with its small top_k at this N keeps "
              "the diagonal block and one more, so a row that attends mostly to a sink or a slash "
              "far back can keep only a few percent).")
    else:
        print("err vs ref64 and reference rows: skipped above N = "
              f"{REFERENCE_MAX_SEQLEN} (dense masks); recall: fast.recall (kernel lse).")
    print("same plan: fast plan == reference plan (plan.equal). time: "
          + ("median of 3 synchronised wall-clock runs after a warm-up (estimator + attention)." if device.type == "cuda"
             else "one wall-clock run; the fast kernels are interpreted on CPU, so their times "
                  "say nothing about speed."))
    path = save_mask_figure(panels, args.out, seqlen=n,
                            title=f"batch 0, head 0, N = {n}: the workload, then every method's fast plan "
                                  "(panel titles: head 0's density and mean recall; the table: means over heads)")
    print(f"masks: {path}")
    if args.json:
        payload = {
            "device": str(device),
            "shape": {**asdict(shape), "dtype": str(shape.dtype).removeprefix("torch.")},
            "golden": golden_name,
            "rows": [asdict(r) for r in rows],
        }
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2)
        print(f"json: {args.json}")
    return 1 if failed else 0
