"""sparseprefill.conformance: Hypothesis strategies, the tolerance policy and the
property checks that `fast` agrees with `reference`, for every method registered in
`sparseprefill.methods`.

Run on a GPU: `python -m sparseprefill.conformance --device cuda --max-seqlen 16384`.

Modules: `registry` (`CHECKS`, what conformance knows of each method by name, and
`METHODS`, each registered method's descriptor with its checks), `strategies` (Hypothesis draws within `Caps`),
`tolerance` (the project's one tolerance policy), `properties` (the checks and
`PROPERTIES`, each with its draws).
"""

from .properties import PROPERTIES, Property, check_method_end_to_end, check_method_plan
from .properties import check_plans_equal, check_recall_density, check_sparse_attention
from .registry import CHECKS, METHODS, Checks, MethodSpec, methods
from .strategies import Caps
from .tolerance import check_attention, check_output, check_recall

__all__ = [
    "CHECKS",
    "Checks",
    "METHODS",
    "PROPERTIES",
    "Caps",
    "MethodSpec",
    "Property",
    "check_attention",
    "check_method_end_to_end",
    "check_method_plan",
    "check_output",
    "check_plans_equal",
    "check_recall",
    "check_recall_density",
    "check_sparse_attention",
    "methods",
]
