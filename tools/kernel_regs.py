"""Registers and spills of the block/column kernel, compiled offline for a GPU target.

No GPU is needed: a stand-in Triton driver reports the target (sm_90 by default), the
launcher (`block_column._launch`) builds every argument exactly as it would for a real
call (on CPU tensors), and the kernel is compiled with `warmup` instead of launched.
The compiled kernel's `n_regs`, `n_spills` and shared memory come from ptxas (shipped
with Triton). Each variant is one launch signature (D, plan block sizes, columns,
disjoint or not, TMA) and optional tile override (`SPARSEPREFILL_TILE`):

    python tools/kernel_regs.py                      # the default table
    python tools/kernel_regs.py --json out.json

On a machine with a GPU it runs the same compile for the device's own target
(`--device`), so the local Triton's figures can be checked against the device's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any, Iterator

import torch


class _OfflineDriver:
    """Enough of Triton's driver interface for `JITFunction.warmup` to compile."""

    def __init__(self, real: Any, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self._real = real
        self._target = GPUTarget("cuda", arch, 32)

    def get_current_target(self) -> Any:
        return self._target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


@contextlib.contextmanager
def offline(arch: int) -> Iterator[None]:
    """Compile (not launch) `_block_column_fwd` for `arch`; TMA taken as available."""
    from triton.runtime.driver import driver

    from sparseprefill.fast.kernels import block_column as bc

    real_fn = bc._block_column_fwd
    real_tma = bc.tma_ok
    real_resolve = getattr(bc, "resolve_covered_columns", None)  # absent before 2026-11-25
    compiled: list[Any] = []

    class _Proxy:
        def __getitem__(self, grid: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                kern = real_fn.warmup(*args, grid=grid, **kwargs)
                compiled.append(kern)
                return kern  # noqa: RET504
            return call

    saved = driver._active
    try:
        active = driver.active
    except RuntimeError:  # no CUDA driver on this machine
        active = None
    driver.set_active(_OfflineDriver(active, arch))
    real_fn.device_caches.clear()
    bc._block_column_fwd = _Proxy()  # type: ignore[assignment]
    bc.tma_ok = lambda *t: os.environ.get("SPARSEPREFILL_TMA", "1") == "1"
    # Plans whose covered columns cannot be resolved keep the in-kernel test: compile that.
    bc.resolve_covered_columns = lambda plan: plan
    offline.compiled = compiled  # type: ignore[attr-defined]
    try:
        yield
    finally:
        bc._block_column_fwd = real_fn
        bc.tma_ok = real_tma
        if real_resolve is not None:
            bc.resolve_covered_columns = real_resolve
        real_fn.device_caches.clear()
        driver._active = saved


def _plan(n: int, bm: int, bn: int, *, columns: int, disjoint: bool, group: int, device: str) -> Any:
    from sparseprefill.reference.plan import BlockColumnPlan, cdiv

    qb = cdiv(n, bm)
    rows = cdiv(qb, group)
    bc = torch.ones(1, 2, qb, dtype=torch.int32, device=device)
    bi = torch.zeros(1, 2, qb, 4, dtype=torch.int32, device=device)
    cc = torch.zeros(1, 2, qb, dtype=torch.int32, device=device)
    ci = torch.zeros(1, 2, rows, columns, dtype=torch.int32, device=device)
    return BlockColumnPlan(seqlen=n, block_m=bm, block_n=bn, block_count=bc, block_index=bi,
                           column_count=cc, column_index=ci, columns_disjoint=disjoint,
                           column_group=group).mark_valid()


VARIANTS: dict[str, dict[str, Any]] = {
    # name: D, plan blocks, column width, disjoint, group
    "d128 blocks only 128x128": dict(d=128, bm=128, bn=128, columns=0, disjoint=True, group=1),
    "d128 cols disjoint g16 128x128 (anchor)": dict(d=128, bm=128, bn=128, columns=256, disjoint=True, group=16),
    "d128 cols shared 64x64 (columns20)": dict(d=128, bm=64, bn=64, columns=256, disjoint=False, group=1),
    "d128 cols disjoint 64x64 (flexprefill/vs)": dict(d=128, bm=64, bn=64, columns=256, disjoint=True, group=1),
    # A column-list width (the index rows' stride) that is not a multiple of 16.
    "d128 cols disjoint 64x64 width 1113": dict(d=128, bm=64, bn=64, columns=1113, disjoint=True, group=1),
    "d64 blocks only 128x128": dict(d=64, bm=128, bn=128, columns=0, disjoint=True, group=1),
    "d64 cols disjoint g16 128x128 (anchor)": dict(d=64, bm=128, bn=128, columns=256, disjoint=True, group=16),
    "d64 cols disjoint 64x64": dict(d=64, bm=64, bn=64, columns=256, disjoint=True, group=1),
}


def _device_arch() -> int:
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def compile_variant(spec: dict[str, Any], *, arch: int | None, device: str) -> list[dict[str, Any]]:
    """Compile one launch signature; return each compiled kernel's resources."""
    from sparseprefill.fast.kernels import block_column as bc

    d = spec["d"]
    n = 1024
    q = torch.randn(1, 2, n, d, device=device).to(torch.bfloat16)
    k = torch.randn(1, 1, n, d, device=device).to(torch.bfloat16)
    v = torch.randn(1, 1, n, d, device=device).to(torch.bfloat16)
    plan = _plan(n, spec["bm"], spec["bn"], columns=spec["columns"], disjoint=spec["disjoint"],
                 group=spec["group"], device=device)
    call = bc._KernelCall(q, k, v, plan, d ** -0.5, n, False)
    if arch is None:
        bc._launch(call)
        kernels = [kern for cache in bc._block_column_fwd.device_caches.values() for kern in cache[0].values()]
    else:
        with offline(arch):
            bc._launch(call)
            kernels = list(offline.compiled)  # type: ignore[attr-defined]
    out = []
    for kern in kernels:
        md = kern.metadata
        if os.environ.get("KERNEL_REGS_DUMP"):
            base = f"{os.environ['KERNEL_REGS_DUMP']}-{len(out)}"
            for ext in ("ttgir", "ptx"):
                with open(f"{base}.{ext}", "w") as fh:
                    fh.write(kern.asm[ext])
        import re

        waits = [int(x) for x in re.findall(r"async_wait[^{]*\{num = (\d+)", kern.asm["ttgir"])]
        out.append({**ptx_resources(kern.asm["ptx"], arch or _device_arch()), "async_waits": waits, "shared": md.shared,
                    "num_warps": md.num_warps, "num_stages": md.num_stages})
    return out


def ptx_resources(ptx: str, arch: int) -> dict[str, int]:
    """Registers, stack frame and spill bytes of a kernel's PTX, from `ptxas -v` (Triton's own)."""
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas-blackwell")
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as fh:
            fh.write(ptx)
        text = subprocess.run([tool, "-v", f"--gpu-name={gpu}", src, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, check=False)
        if text.returncode:
            raise RuntimeError(text.stderr[-2000:])
        text = text.stderr
    found = {}
    for key, pat in (("n_regs", r"Used (\d+) registers"), ("stack", r"(\d+) bytes stack frame"),
                     ("spill_stores", r"(\d+) bytes spill stores"), ("spill_loads", r"(\d+) bytes spill loads")):
        m = re.search(pat, text)
        found[key] = int(m.group(1)) if m else -1
    # Triton's `n_spills` is the local memory per thread (the stack frame) over 4.
    found["n_spills"] = found["stack"] // 4
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--device", action="store_true", help="compile on this machine's GPU instead")
    parser.add_argument("--only", default="", help="substring of the variant names to run")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    import triton

    rows = []
    for name, spec in VARIANTS.items():
        if args.only and args.only not in name:
            continue
        res = compile_variant(spec, arch=None if args.device else args.arch,
                              device="cuda" if args.device else "cpu")
        for r in res:
            rows.append({"variant": name, "tile": os.environ.get("SPARSEPREFILL_TILE", ""), **r})
            print(f"{name:45s} regs {r['n_regs']:4d} n_spills {r['n_spills']:4d} spill st/ld "
                  f"{r['spill_stores']:5d}/{r['spill_loads']:5d} waits {r['async_waits']} shared {r['shared']:7d} "
                  f"warps {r['num_warps']} stages {r['num_stages']}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"triton": triton.__version__, "arch": args.arch, "device": args.device,
                   "env": {k: v for k, v in os.environ.items() if k.startswith("SPARSEPREFILL_")},
                   "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
