"""What every kernel file shares: constants, the interpreter-safe dot, device and input checks.

Kernels fold `log2(e)` into their scale and use `exp2` (the fused-attention tutorial's
habit); `LOG2E` / `LN2` are the host-side floats, `K_LOG2E` / `K_LN2` the same numbers
as `tl.constexpr` for use inside `@triton.jit` code (Triton reads only constexpr globals).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
K_LOG2E = tl.constexpr(LOG2E)
K_LN2 = tl.constexpr(LN2)


@triton.jit
def dot(a, b, DOT_F32: tl.constexpr):
    # Triton's CPU interpreter multiplies bfloat16 tiles wrongly (seen with triton 3.9):
    # there, upcast the operands first; the products of 16-bit floats are exact in fp32.
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def dot_f32(dtype: torch.dtype) -> bool:
    """The `DOT_F32` flag of `dot` for tiles of `dtype` on the current backend."""
    return interpreter_active() and dtype == torch.bfloat16


def check_kernel_device(q: torch.Tensor) -> None:
    """Raise unless the kernels can run on q's device (CUDA, or CPU under the interpreter)."""
    if q.device.type == "cuda":
        return
    if q.device.type == "cpu" and interpreter_active():
        return
    raise ValueError(
        f"q is on {q.device}: sparseprefill.fast runs on CUDA tensors, or on CPU tensors "
        "with TRITON_INTERPRET=1 set before triton is imported; use sparseprefill.reference "
        "otherwise"
    )


def check_forward_only(*tensors: torch.Tensor) -> None:
    """Raise unless no input needs a gradient: the fast kernels have no backward pass.

    Raises:
        ValueError: grad mode is on and an input requires grad.
    """
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise ValueError(
            "sparseprefill.fast is forward-only (no backward kernels) and an input requires grad: "
            "run it under torch.no_grad() / torch.inference_mode(), or pass detached tensors; "
            "sparseprefill.reference supports autograd"
        )


def check_kernel_block_sizes(
    block_m: int, block_n: int, *, prefix: str = "", names: tuple[str, str] | None = None
) -> None:
    """Raise ValueError unless both block sizes are multiples of 16 (the kernel's tiles).

    Estimators call this before any estimate runs, so a bad size never costs a launch.

    Args:
        block_m, block_n: the plan's block sizes.
        prefix: prepended to the default names `block_m`, `block_n` in messages.
        names: the caller's own argument names for the two sizes (e.g. `block_size`).
    """
    label_m, label_n = names if names is not None else (f"{prefix}block_m", f"{prefix}block_n")
    for name, size in ((label_m, block_m), (label_n, block_n)):
        if size % 16 != 0:
            raise ValueError(f"{name} must be a multiple of 16 for the fast kernels, got {size}")


MAX_HEAD_DIM = 256


def check_head_dim(d: int) -> None:
    """Raise ValueError unless the fast kernels take head dim `d` (registers bound it)."""
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head dim D must be <= {MAX_HEAD_DIM} for the fast kernels, got {d}")


try:
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401

    _HOST_DESCRIPTORS = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    _HOST_DESCRIPTORS = False

_CAPABILITY: dict[int, tuple[int, int]] = {}


def _capability(device: torch.device) -> tuple[int, int]:
    """A CUDA device's compute capability, read once per device (launchers ask on every call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index]


def tma_ok(*tensors: torch.Tensor) -> bool:
    """True if Hopper tensor descriptors can load these tensors' tiles.

    Needs a CUDA device of compute capability >= 9, a contiguous last dimension,
    16-byte aligned base pointers and strides. `SPARSEPREFILL_TMA=0` turns it off
    (to compare the two load paths); nothing turns it on where it cannot work.
    """
    if os.environ.get("SPARSEPREFILL_TMA", "1") == "0" or interpreter_active():
        return False
    t0 = tensors[0]
    if t0.device.type != "cuda" or _capability(t0.device)[0] < 9 or not _HOST_DESCRIPTORS:
        return False
    for t in tensors:
        size = t.element_size()
        if t.stride(-1) != 1 or t.data_ptr() % 16 != 0:
            return False
        if any((st * size) % 16 != 0 for st in t.stride()[:-1]):
            return False
    return True


# Stages below this many bytes are never checked (no driver call on the common path).
MEMORY_CHECK_FLOOR = 2**30


def check_device_memory(what: str, nbytes: int, device: torch.device, *, hint: str = "") -> None:
    """Refuse, before allocating, a stage whose buffers cannot fit on `device`.

    For the stages whose memory grows with the square of the tokens (tile weights and
    tile lists `[B, H, T, T]`, per-block masks `[Qb, Kb]`): `nbytes` is what the stage
    would hold at its peak. Compared with the device's free memory after torch's cache
    has given back what it holds unused (`empty_cache`, only when `nbytes` exceeds what
    is free without it); below `MEMORY_CHECK_FLOOR` or off CUDA nothing is checked.

    Raises:
        MemoryError: naming the stage, the bytes it needs, what is free, and `hint`
            (what to change: a larger block, fewer heads per call).
    """
    if nbytes < MEMORY_CHECK_FLOOR or device.type != "cuda":
        return
    free, total = torch.cuda.mem_get_info(device)
    if nbytes > free:
        # What torch's cache holds unused is free for a buffer this large only once
        # released: memory reserved in partly used segments cannot serve it (at 1M tokens
        # a 62.5 GiB list failed with 53 GiB free and 11 GiB reserved unused, H100).
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
    available = free
    if nbytes > available:
        raise MemoryError(f"{what} needs {nbytes / 2**30:.1f} GiB on {device}, but only {available / 2**30:.1f} "
                          f"GiB of its {total / 2**30:.0f} GiB are free; nothing was allocated"
                          + (f". {hint}" if hint else ""))


__all__ = [
    "MEMORY_CHECK_FLOOR",
    "K_LN2",
    "K_LOG2E",
    "LN2",
    "LOG2E",
    "MAX_HEAD_DIM",
    "check_device_memory",
    "check_forward_only",
    "check_head_dim",
    "check_kernel_block_sizes",
    "check_kernel_device",
    "dot",
    "dot_f32",
    "head_group",
    "interpreter_active",
    "tma_ok",
]


def head_group(q_heads: int, group: int, fit: int) -> int:
    """Query heads planned or launched at once: at most `fit` (at least 1), whole KV heads or a divisor of G."""
    if fit >= q_heads:
        return q_heads
    if fit >= group:
        return fit // group * group
    return max(d for d in range(1, group + 1) if group % d == 0 and d <= max(fit, 1))
