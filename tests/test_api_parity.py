"""`reference` and `fast` expose the same API: names, signatures, docstrings."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

import pytest

from sparseprefill import fast, reference


def _signature(fn: Callable[..., Any]) -> tuple[object, ...]:
    """Names, kinds, defaults and annotations (as strings) of a callable's parameters."""
    sig = inspect.signature(fn)
    params = tuple(
        (p.name, p.kind, repr(p.default), str(p.annotation)) for p in sig.parameters.values()
    )
    return params, str(sig.return_annotation)


def test_same_exports() -> None:
    assert sorted(reference.__all__) == sorted(fast.__all__)
    assert len(set(reference.__all__)) == len(reference.__all__)
    for name in reference.__all__:
        assert hasattr(reference, name), f"reference.__all__ lists missing {name}"
        assert hasattr(fast, name), f"fast.__all__ lists missing {name}"


@pytest.mark.parametrize("name", sorted(reference.__all__))
def test_same_signature_and_docstring(name: str) -> None:
    ref, fst = getattr(reference, name), getattr(fast, name)
    if inspect.isclass(ref):
        # Classes (the plan format) are shared, not mirrored.
        assert ref is fst, f"{name}: fast and reference must export the same class"
        return
    assert callable(ref) and callable(fst), name
    assert _signature(ref) == _signature(fst), (
        f"{name}: reference{inspect.signature(ref)} != fast{inspect.signature(fst)}"
    )
    assert inspect.getdoc(ref), f"reference.{name} has no docstring"
    assert inspect.getdoc(fst), f"fast.{name} has no docstring"
    ref_overloads = [_signature(o) for o in typing.get_overloads(ref)]
    fast_overloads = [_signature(o) for o in typing.get_overloads(fst)]
    assert ref_overloads == fast_overloads, f"{name}: @overload variants differ"
