"""Issue 21, session 4: the ragged / varlen launchers on flat TMA descriptors, Delta-KV at keep
ratios <= 0.6, and dense short-prompt designs, each beside cuDNN SDPA in the same process.

Parts (`--parts`, comma-separated):
  ragged  the ragged launcher (flat `[T, D]` K / V, a segment per KV head, a key bias as
          Delta-KV's phase 1 passes) against the dense launcher on the same dense plan, with
          the flat TMA path on and off (`_FLAT_TMA`); outputs compared with the dense launcher's.
  varlen  a mixed 4K + 16K + 60K batch (dense plans) in one varlen launch, flat TMA on / off,
          against per-sequence launches and cuDNN per sequence; bit-equality with per-sequence.
  delta   `fast.delta_kv` end to end on keys built with runs of near-duplicates (keep ratio
          about 1 / run), at 32K, 128K and 262K, against cuDNN; the keep ratio reported.
  dense   dense plans at 8K / 32K (D 128, D 64) and 128K (D 128) under tile / warp-
          specialisation variants (`SPARSEPREFILL_TILE`, `_WARP_SPEC`) against cuDNN.
  ncu     one launch of our dense kernel and one of cuDNN's at 8K, D 128, inside
          `cudaProfilerStart/Stop` (run under `ncu --profile-from-start off`).
  small   ragged, varlen and delta once at small sizes (for compute-sanitizer), no timing;
          `--small` does the same for the parts listed.

Inputs are random normal (never zeros). Timings: `triton.testing.do_bench` medians.

    python benches/issue21_s4.py --parts ragged,varlen,delta,dense --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: `small` under TRITON_INTERPRET=1
ROWS: list[dict[str, Any]] = []
TMA_CASES = [True, False]  # the flat TMA path on, then off (`--flat-tma-only`: on only)
GRID_CASES: list[bool] = []  # `--varlen-grids`: the packed varlen grid on, then off
META: dict[str, Any] = {}


def _ms(fn: Callable[[], Any], rep: int = 100) -> float:
    import triton.testing

    fn()
    torch.cuda.synchronize()
    return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a32, b32 = a.float(), b.float()
    return float((a32 - b32).norm() / b32.norm().clamp(min=1e-30))


def _row(**kw: Any) -> None:
    ROWS.append(kw)
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in kw.items()), flush=True)


def _qkv(n: int, d: int, hq: int = 32, hkv: int = 8, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return tuple(torch.randn(1, h, n, d, device=DEV, dtype=torch.bfloat16, generator=g)
                 for h in (hq, hkv, hkv))


def part_ragged(small: bool) -> None:
    from sparseprefill import fast
    from sparseprefill.fast.kernels import block_column as bc

    n, d = (1000, 64) if small else (32768, 128)
    q, k, v = _qkv(n, d, *((4, 2) if small else (32, 8)))
    hkv = k.shape[1]
    pad = -n % 128
    # One segment per KV head, each padded to a multiple of the block (as Delta-KV pads).
    kf = torch.nn.functional.pad(k[0], (0, 0, 0, pad)).reshape(-1, d).contiguous()
    vf = torch.nn.functional.pad(v[0], (0, 0, 0, pad)).reshape(-1, d).contiguous()
    offs = torch.arange(hkv, device=DEV, dtype=torch.int64) * (n + pad)
    bias = torch.zeros(kf.shape[0], device=DEV, dtype=torch.float32)
    pairs = q.shape[1] * n * (n + 1) / 2
    cud = None if small else _ms(lambda: _cudnn(q, k, v))
    for bs in (64, 128):
        plan = fast.dense_plan(q, k, block_m=bs, block_n=bs)
        ref, _ = bc.block_column_attention(q, k, v, plan, validate_plan=False)
        dense_ms = None if small else _ms(lambda: bc.block_column_attention(q, k, v, plan, validate_plan=False))
        for tma in TMA_CASES:
            bc._FLAT_TMA = tma
            out, _ = bc.ragged_block_column_attention(q, kf, vf, offs, plan, key_bias=bias)
            diff = _rel(out, ref)
            ms = None if small else _ms(lambda: bc.ragged_block_column_attention(q, kf, vf, offs, plan,
                                                                                  key_bias=bias))
            row: dict[str, Any] = dict(part="ragged", seqlen=n, head_dim=d, block=bs, flat_tma=tma,
                                       rel_diff_vs_dense_launcher=diff)
            if ms is not None and dense_ms is not None and cud is not None:
                row.update(ragged_ms=ms, dense_launcher_ms=dense_ms, cudnn_ms=cud,
                           ragged_tflops=4 * d * pairs / ms / 1e9, dense_tflops=4 * d * pairs / dense_ms / 1e9,
                           ragged_vs_dense_rate=dense_ms / ms, ragged_vs_cudnn=cud / ms)
            _row(**row)
    bc._FLAT_TMA = True


def part_varlen(small: bool) -> None:
    from sparseprefill import fast
    from sparseprefill.fast.kernels import block_column as bc

    lengths = [200, 700, 1500] if small else [4096, 16384, 61440]
    hq, hkv, d = (4, 2, 64) if small else (32, 8, 128)
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(1)
    q = torch.randn(total, hq, d, device=DEV, dtype=torch.bfloat16, generator=g)
    k = torch.randn(total, hkv, d, device=DEV, dtype=torch.bfloat16, generator=g)
    v = torch.randn(total, hkv, d, device=DEV, dtype=torch.bfloat16, generator=g)
    b = cu.tolist()
    seqs = [tuple(t[x:y].transpose(0, 1).unsqueeze(0) for t in (q, k, v)) for x, y in zip(b, b[1:])]
    plan = fast.varlen_plans(fast.dense_plan, q, k, cu)
    per = [fast.dense_plan(s[0], s[1]) for s in seqs]
    alone = [fast.sparse_attention(*s, p)[0].transpose(0, 1) for s, p in zip(seqs, per)]
    cud = None if small else _ms(lambda: [_cudnn(*s) for s in seqs])
    per_ms = None if small else _ms(lambda: [fast.sparse_attention(*s, p) for s, p in zip(seqs, per)])
    grids = (True, False) if GRID_CASES else (bc._VARLEN_PACKED_GRID,)
    for tma, packed_grid in ((t, g) for t in TMA_CASES for g in grids):
        bc._FLAT_TMA = tma
        bc._VARLEN_PACKED_GRID = packed_grid
        out = fast.varlen_attention(q, k, v, cu, max(lengths), plan)
        same = all(torch.equal(out[b[i]:b[i + 1]], a) for i, a in enumerate(alone))
        diff = max(_rel(out[b[i]:b[i + 1]], a) for i, a in enumerate(alone))
        row: dict[str, Any] = dict(part="varlen", lengths=lengths, head_dim=d, flat_tma=tma, packed_grid=packed_grid,
                                   bit_equal_per_sequence=same, max_rel_diff=diff)
        if not small:
            one = _ms(lambda: fast.varlen_attention(q, k, v, cu, max(lengths), plan))
            row.update(varlen_ms=one, per_sequence_ms=per_ms, cudnn_per_sequence_ms=cud,
                       varlen_over_per_sequence=one / per_ms if per_ms else None,
                       speedup_vs_cudnn=cud / one if cud else None)
        _row(**row)
    bc._FLAT_TMA = True
    bc._VARLEN_PACKED_GRID = True


def _runs_keys(n: int, d: int, hkv: int, run: int | tuple[int, ...], seed: int) -> torch.Tensor:
    """Keys in runs of `run` near-duplicates (cosine ~0.999 within a run, ~0 across).

    `run` an int (every run that long: keep ratio about 1 / run) or a tuple of run lengths
    repeated along the keys (`(2, 2, 1)`: 3 anchors per 5 keys, keep ratio about 0.6)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    if isinstance(run, int):
        base = torch.randn(1, hkv, -(-n // run), d, device=DEV, generator=g)
        k = base.repeat_interleave(run, dim=2)[:, :, :n]
    else:
        runs = len(run) * -(-n // sum(run))
        lengths = torch.tensor(run, device=DEV).repeat(runs // len(run))
        base = torch.randn(1, hkv, runs, d, device=DEV, generator=g)
        k = base[:, :, torch.repeat_interleave(torch.arange(runs, device=DEV), lengths)[:n]]
    return (k + 0.03 * torch.randn(k.shape, device=DEV, generator=g)).to(torch.bfloat16)


def part_delta(small: bool, seqlens: list[int]) -> None:
    from sparseprefill import fast
    from sparseprefill.fast.kernels import block_column as bc

    hq, hkv, d = (4, 2, 64) if small else (32, 8, 128)
    for n in ([1000] if small else seqlens):
        for run in ((2,) if small or n > 131072 else (2, 3)):
            q, _, v = _qkv(n, d, hq, hkv, seed=n + run)
            k = _runs_keys(n, d, hkv, run, seed=n)
            thr = 0.95
            keep = fast.delta_keep_mask(k, threshold=thr, metric="cosine")
            ratio = float(keep.float().mean())
            out = fast.delta_kv(q, k, v, threshold=thr, metric="cosine")
            row: dict[str, Any] = dict(part="delta_kv", seqlen=n, head_dim=d, run=run, metric="cosine",
                                       threshold=thr, keep_ratio=ratio,
                                       nonfinite=int((~torch.isfinite(out)).sum()))
            if not small:
                rep = 40 if n > 131072 else 100
                cud = _ms(lambda: _cudnn(q, k, v), rep=rep)
                row["rel_diff_vs_cudnn"] = _rel(out, _cudnn(q, k, v))
                for tma in ((True,) if n > 131072 else (True, False)):
                    bc._FLAT_TMA = tma
                    ms = _ms(lambda: fast.delta_kv(q, k, v, threshold=thr, metric="cosine"), rep=rep)
                    row[f"delta_kv_ms_flat_tma_{int(tma)}"] = ms
                    row[f"speedup_vs_cudnn_flat_tma_{int(tma)}"] = cud / ms
                bc._FLAT_TMA = True
                row["cudnn_ms"] = cud
            _row(**row)
            del q, k, v, out
            torch.cuda.empty_cache()


DENSE_VARIANTS = {
    128: [("default", {}), ("t64x128w4s3", {"TILE": "64,128,4,3"}), ("warp_spec", {"WARP_SPEC": "1"})],
    64: [("default", {}), ("t64x128w4s4", {"TILE": "64,128,4,4"}), ("warp_spec", {"WARP_SPEC": "1"})],
}


def part_dense(cases: list[tuple[int, int]]) -> None:
    from sparseprefill import fast
    from sparseprefill.fast.kernels import block_column as bc

    for n, d in cases:
        q, k, v = _qkv(n, d)
        pairs = q.shape[1] * n * (n + 1) / 2
        cud = _ms(lambda: _cudnn(q, k, v))
        ref = _cudnn(q, k, v)
        plan = fast.dense_plan(q, k)
        for name, sets in DENSE_VARIANTS[d]:
            if "TILE" in sets:
                os.environ["SPARSEPREFILL_TILE"] = sets["TILE"]
            else:
                os.environ.pop("SPARSEPREFILL_TILE", None)
            bc._WARP_SPEC = sets.get("WARP_SPEC") == "1"
            try:
                out, _ = bc.block_column_attention(q, k, v, plan, validate_plan=False)
                ms = _ms(lambda: bc.block_column_attention(q, k, v, plan, validate_plan=False))
            except Exception as exc:  # a variant that does not compile or launch: say so
                _row(part="dense", seqlen=n, head_dim=d, variant=name, error=f"{type(exc).__name__}: {exc}"[:200])
                continue
            _row(part="dense", seqlen=n, head_dim=d, variant=name, kernel_ms=ms, cudnn_ms=cud,
                 vs_cudnn=cud / ms, tflops=4 * d * pairs / ms / 1e9, cudnn_tflops=4 * d * pairs / cud / 1e9,
                 rel_diff_vs_cudnn=_rel(out, ref))
        os.environ.pop("SPARSEPREFILL_TILE", None)
        bc._WARP_SPEC = False
        del q, k, v
        torch.cuda.empty_cache()


def part_ncu() -> None:
    from sparseprefill import fast
    from sparseprefill.fast.kernels import block_column as bc

    q, k, v = _qkv(8192, 128)
    plan = fast.dense_plan(q, k)
    for _ in range(3):  # compile and warm both outside the profiled range
        bc.block_column_attention(q, k, v, plan, validate_plan=False)
        _cudnn(q, k, v)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    bc.block_column_attention(q, k, v, plan, validate_plan=False)
    _cudnn(q, k, v)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def part_ncu_varlen() -> None:
    """The varlen batch in one launch and per sequence, once each between cudaProfilerStart/Stop."""
    from sparseprefill import fast

    lengths = [4096, 16384, 61440]
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(1)
    q, k, v = (torch.randn(total, h, 128, device=DEV, dtype=torch.bfloat16, generator=g) for h in (32, 8, 8))
    b = cu.tolist()
    seqs = [tuple(t[x:y].transpose(0, 1).unsqueeze(0) for t in (q, k, v)) for x, y in zip(b, b[1:])]
    plan = fast.varlen_plans(fast.dense_plan, q, k, cu)
    per = [fast.dense_plan(s[0], s[1]) for s in seqs]
    for _ in range(2):
        fast.varlen_attention(q, k, v, cu, max(lengths), plan)
        for s, p in zip(seqs, per):
            fast.sparse_attention(*s, p)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fast.varlen_attention(q, k, v, cu, max(lengths), plan)
    for s, p in zip(seqs, per):
        fast.sparse_attention(*s, p)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def part_ncu_delta(n: int = 32768) -> None:
    """One `fast.delta_kv` call at keep ratio 0.5 between cudaProfilerStart/Stop (every kernel)."""
    from sparseprefill import fast

    q, _, v = _qkv(n, 128, 32, 8, seed=n + 2)
    k = _runs_keys(n, 128, 8, 2, seed=n)
    for _ in range(2):
        fast.delta_kv(q, k, v, threshold=0.95, metric="cosine")
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fast.delta_kv(q, k, v, threshold=0.95, metric="cosine")
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def main(argv: list[str] | None = None) -> int:
    import triton

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="ragged,varlen,delta,dense")
    p.add_argument("--delta-seqlens", default="32768,131072,262144")
    p.add_argument("--dense", default="8192:128,32768:128,8192:64,32768:64,131072:128",
                   help="N:D pairs for the dense part")
    p.add_argument("--json", default="/tmp/issue21_s4.json")
    p.add_argument("--small", action="store_true", help="the listed parts at small sizes, untimed")
    p.add_argument("--flat-tma-only", action="store_true", help="ragged / varlen: the flat TMA path only")
    p.add_argument("--varlen-grids", action="store_true", help="varlen: the packed grid on, then off")
    args = p.parse_args(argv)
    if args.flat_tma_only:
        TMA_CASES[:] = [True]
    if args.varlen_grids:
        GRID_CASES[:] = [True]
    META.update(device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu", torch=torch.__version__,
                triton=triton.__version__)
    parts = args.parts.split(",")
    small = "small" in parts or args.small
    t0 = time.time()
    try:
        for part in parts:
            if part in ("ragged", "small"):
                part_ragged(small)
            if part in ("varlen", "small"):
                part_varlen(small)
            if part in ("delta", "small"):
                part_delta(small, [int(x) for x in args.delta_seqlens.split(",")])
            if part == "dense":
                part_dense([(int(a), int(b)) for a, b in (x.split(":") for x in args.dense.split(","))])
            if part == "ncu":
                part_ncu()
            if part == "ncu_varlen":
                part_ncu_varlen()
            if part == "ncu_delta":
                part_ncu_delta()
            Path(args.json).write_text(json.dumps({"meta": META, "rows": ROWS}, indent=1))
            print(f"[{part} done at {time.time() - t0:.0f} s]", flush=True)
    finally:
        Path(args.json).write_text(json.dumps({"meta": META, "rows": ROWS}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
