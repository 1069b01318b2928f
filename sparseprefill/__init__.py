"""sparseprefill: training-free sparse attention for long-context prefill.

Subpackages: `sparseprefill.reference` (the specification in plain PyTorch),
`sparseprefill.fast` (the same API on Triton kernels) and
`sparseprefill.conformance` (Hypothesis properties that the two agree).
"""

__version__ = "0.1.0"
