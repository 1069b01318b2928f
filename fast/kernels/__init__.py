"""Triton kernel families; one file each, ordered kernel -> launcher."""

from ._common import (
    check_device_memory,
    check_forward_only,
    check_kernel_block_sizes,
    check_kernel_device,
    interpreter_active,
)
from .block_column import block_column_attention, block_column_row_max, varlen_block_column_attention

__all__ = [
    "block_column_attention",
    "block_column_row_max",
    "check_device_memory",
    "check_forward_only",
    "check_kernel_block_sizes",
    "check_kernel_device",
    "interpreter_active",
    "varlen_block_column_attention",
]
