"""sparseprefill.conformance: Hypothesis strategies, the tolerance policy and the
property checks that `fast` agrees with `reference`; also the method registry.

Run on a GPU: `python -m sparseprefill.conformance --device cuda --max-seqlen 16384`.
"""

from .registry import METHODS, MethodSpec, methods, register

__all__ = ["METHODS", "MethodSpec", "methods", "register"]
