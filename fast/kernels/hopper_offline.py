"""Compile the Hopper path's Gluon kernel for sm90 without a GPU, and read what ptxas made of it.

A stand-in for Triton's driver reports an sm90 target, so `warmup` compiles (never
launches) `block_column_hopper._block_hopper_fwd` with Triton's own ptxas; the cubin's
registers and stack frame (`cuobjdump --dump-resource-usage`) and instruction counts
(`nvdisasm`: HGMMA warpgroup MMAs, LDL / STL local-memory spills, USETMAXREG register
reallocation, UTMALDG TMA loads, BAR.SYNC barriers) settle compile errors and register
pressure before any device time is spent:

    python -m sparseprefill.fast.kernels.hopper_offline            # the default variants, JSON
    python -m sparseprefill.fast.kernels.hopper_offline --dump /tmp/hk   # also the PTX / SASS

Triton's CPU interpreter (`TRITON_INTERPRET=1`) turns Gluon's library functions into
interpreted ones, so this runs in a process without it (the tests start one).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from . import block_column_hopper as hop

# (head dim, key tile, SPLIT, stages, columns): the shapes the launcher picks for 128- and
# 64-row plans, with and without column lists.
VARIANTS: tuple[tuple[int, int, bool, int, bool], ...] = (
    (128, 128, False, 3, False), (128, 64, True, 3, False), (64, 128, False, 4, False), (64, 64, True, 4, False),
    (128, 128, False, 3, True), (128, 64, True, 3, True), (64, 64, True, 4, True))
COUNTED = ("HGMMA", "LDL", "STL", "USETMAXREG", "UTMALDG", "LDGSTS", "BAR.SYNC", "SYNCS")


class _OfflineDriver:
    """Enough of Triton's driver for `warmup` to compile for sm90 on a machine without a GPU."""

    def __init__(self, real: Any) -> None:
        from triton.backends.compiler import GPUTarget

        self._real = real
        self._target = GPUTarget("cuda", 90, 32)

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
def _offline() -> Iterator[None]:
    from triton.runtime.driver import driver

    saved = driver._active
    try:
        active = driver.active
    except RuntimeError:  # no CUDA driver on this machine
        active = None
    driver.set_active(_OfflineDriver(active))
    try:
        yield
    finally:
        driver._active = saved


def compile_sm90(d: int, block_n: int, split: bool, stages: int, columns: bool = False) -> Any:
    """The compiled kernel (Triton's `CompiledKernel`) for one shape, with the module's switches."""
    if not hop._GLUON:
        raise RuntimeError("this Triton has no Gluon warp_specialize")
    n, hq, hkv = 1024, 4, 1
    q = torch.randn(1, hq, n, d).to(torch.bfloat16)
    k = torch.randn(1, hkv, n, d).to(torch.bfloat16)
    out = torch.empty_like(q)
    lse = torch.empty(1, hq, n)
    plan_m = 64 if split else 128
    qb = n // plan_m
    count = torch.ones(1, hq, qb, dtype=torch.int32)
    index = torch.zeros(1, hq, qb, 4, dtype=torch.int32)
    ccount = torch.ones(1, hq, qb, dtype=torch.int32)
    cindex = torch.zeros(1, hq, qb, 8 if columns else 0, dtype=torch.int32)
    descs = hop.descriptors(q, k, k, block_n)
    with _offline():
        return hop._block_hopper_fwd.warmup(
            *descs, out, lse, count, index,
            *count.stride(), *index.stride(), *out.stride()[:3], *lse.stride()[:2],
            0.1, n, 0, n // hop.BLOCK_M, hq, hq, hq // hkv, plan_m, 128, 4,
            k, k, ccount, cindex, *k.stride()[:3], *k.stride()[:3], *ccount.stride(), *cindex.stride(),
            1, cindex.shape[3], n, torch.zeros(4, dtype=torch.int32), 4,
            BLOCK_N=block_n, HEAD_DIM=d, SUB_N=128 // block_n, STAGES=stages, RETURN_LSE=True, SPLIT=split,
            NONFINITE=hop.NONFINITE, HAS_COLUMNS=columns,
            CONSUMER_REGS=hop.COLUMN_CONSUMER_REGS if columns else hop.CONSUMER_REGS,
            PRODUCER_REGS=hop.COLUMN_PRODUCER_REGS if columns else hop.PRODUCER_REGS,
            grid=(132,), num_warps=4, maxnreg=hop.MAXNREG)


def summary(kern: Any, dump: str = "", tag: str = "") -> dict[str, Any]:
    """Shared memory, warps, registers / stack (cuobjdump) and instruction counts (nvdisasm)."""
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    out: dict[str, Any] = {"shared": kern.metadata.shared, "num_warps": kern.metadata.num_warps}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as fh:
            fh.write(kern.asm["cubin"])
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "--dump-resource-usage", path],
                               capture_output=True, text=True, check=True).stdout
        for key, pat in (("regs", r"REG:(\d+)"), ("stack", r"STACK:(\d+)")):
            m = re.search(pat, usage)
            out[key] = int(m.group(1)) if m else -1
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", path], capture_output=True, text=True,
                              check=True).stdout
    out.update({name: sass.count(name) for name in COUNTED})
    if dump:
        os.makedirs(dump, exist_ok=True)
        for ext, text in (("ptx", kern.asm["ptx"]), ("sass", sass)):
            with open(os.path.join(dump, f"{tag}.{ext}"), "w") as fh:
                fh.write(text)
    return out


def variant_tag(d: int, block_n: int, split: bool, stages: int, columns: bool) -> str:
    return f"d{d}_bn{block_n}_{'split' if split else 'shared'}_s{stages}{'_columns' if columns else ''}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump", default="", help="folder for each variant's PTX and SASS")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("run without TRITON_INTERPRET=1 (the interpreter cannot compile Gluon)", file=sys.stderr)
        return 2
    rows = []
    for d, block_n, split, stages, columns in VARIANTS:
        tag = variant_tag(d, block_n, split, stages, columns)
        rows.append({"variant": tag, **summary(compile_sm90(d, block_n, split, stages, columns), args.dump, tag)})
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
