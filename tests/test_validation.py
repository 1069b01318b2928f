"""Bad inputs to every public function of `reference` and `fast` raise ValueError or
TypeError naming the offending argument, before any work (no kernel launch).

Functions are found from `__all__` and their signatures, so a method added to
both packages is covered here without editing this file: `(q, k, ...)` and
`(q, k, v, ...)` functions get every tensor check, and every int parameter of a
method gets a negative and a non-int value. Valid values for required method
parameters come from the registry's `demo_params`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from types import ModuleType
from typing import Any

import sys

import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from sparseprefill import fast, reference
from sparseprefill.conformance import METHODS
from sparseprefill.reference import BlockColumnPlan

PACKAGES: dict[str, ModuleType] = {"reference": reference, "fast": fast}
N = 40


class _NoLaunch:
    """Stands in for a Triton kernel: launching it means a check came too late."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getitem__(self, grid: object) -> Callable[..., None]:
        raise RuntimeError(f"kernel {self.name} launched before the inputs were rejected")


@pytest.fixture(autouse=True)
def no_kernel_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here expects rejection before any kernel runs: poison the kernels."""
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("sparseprefill.fast"):
            for attr, obj in list(vars(mod).items()):
                if isinstance(obj, (JITFunction, InterpretedFunction)):
                    monkeypatch.setattr(mod, attr, _NoLaunch(f"{mod_name}.{attr}"))


def _functions(first: tuple[str, ...]) -> list[tuple[str, str]]:
    out = []
    for pkg_name, pkg in PACKAGES.items():
        for name in pkg.__all__:
            fn = getattr(pkg, name)
            if inspect.isfunction(fn):
                params = tuple(inspect.signature(fn).parameters)
                if params[: len(first)] == first and (len(first) == 3 or params[2:3] != ("v",)):
                    out.append((pkg_name, name))
    return out


QK = _functions(("q", "k"))
QKV = _functions(("q", "k", "v"))
ALL_QK = QK + QKV


def valid_qkv(dtype: torch.dtype = torch.float16, n: int = N) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, n, 32, generator=gen).to(dtype)
    k = torch.randn(2, 2, n, 32, generator=gen).to(dtype)
    v = torch.randn(2, 2, n, 32, generator=gen).to(dtype)
    return q, k, v


def method_kwargs(name: str) -> dict[str, Any]:
    for spec in METHODS.values():
        if name in (spec.name, f"{spec.name}_plan"):
            return spec.call_params(spec.demo_params(N), valid_qkv()[0])
    return {}


def _minference_config() -> Any:
    from sparseprefill.reference.minference import HeadPattern, MInferenceConfig

    return MInferenceConfig.uniform(1, 4, HeadPattern("a_shape", {"sink": 16, "window": 32}))


def _packed(q: Any, k: Any, v: Any) -> Any:
    """Delta-KV anchors of k, v (of valid inputs when k, v are the bad argument under test)."""
    try:
        return reference.delta_pack(k, v, reference.delta_keep_mask(k, threshold=1.0, chunk=16), block=16)
    except (TypeError, ValueError, RuntimeError, AttributeError, IndexError):
        _, kk, vv = valid_qkv()
        return reference.delta_pack(kk, vv, reference.delta_keep_mask(kk, threshold=1.0, chunk=16), block=16)


# Valid values of required positional parameters other than tensors, by name.
FACTORIES: dict[str, Callable[[Any, Any, Any], Any]] = {
    "config": lambda q, k, v: _minference_config(),
    "packed": _packed,
    "state": lambda q, k, v: reference.SharePrefillState(),
}
# Valid values of required keyword-only parameters, by name.
REQUIRED_KEYWORDS: dict[str, Any] = {"layer": 0}


def call(pkg_name: str, name: str, q: Any, k: Any, v: Any = None, **overrides: Any) -> Any:
    """Call `pkg.name` with valid arguments except those overridden."""
    fn: Callable[..., Any] = getattr(PACKAGES[pkg_name], name)
    sig = inspect.signature(fn)
    kwargs = {**method_kwargs(name), **overrides}
    args: list[Any] = [q, k]
    names = list(sig.parameters)
    if names[2] == "v":
        args.append(v)
    for p in list(sig.parameters.values())[len(args):]:
        if p.kind is not p.POSITIONAL_OR_KEYWORD or p.name in kwargs:
            continue
        if p.name in FACTORIES:
            args.append(FACTORIES[p.name](q, k, v))
        elif p.name == "plan":
            args.append(reference.dense_plan(valid_qkv()[0], valid_qkv()[1], block_m=16, block_n=16))
        elif p.name == "mask":
            if p.default is inspect.Parameter.empty:
                args.append(torch.ones(N, N, dtype=torch.bool))
        elif p.default is inspect.Parameter.empty:
            pytest.skip(f"{pkg_name}.{name}: no valid value known for {p.name}")
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and p.default is inspect.Parameter.empty and p.name in REQUIRED_KEYWORDS:
            kwargs.setdefault(p.name, REQUIRED_KEYWORDS[p.name])
    missing = [p.name for p in sig.parameters.values()
               if p.kind is p.KEYWORD_ONLY and p.default is inspect.Parameter.empty
               and p.name not in kwargs]
    if missing:
        pytest.skip(f"{pkg_name}.{name}: no valid value known for {missing}")
    return fn(*args, **kwargs)


def expect(error: type[Exception] | tuple[type[Exception], ...], word: str,
           fn: Callable[[], Any]) -> None:
    with pytest.raises(error) as info:
        fn()
    assert word in str(info.value), f"message does not name {word!r}: {info.value}"


# Functions whose first arguments are not (q, k): their checks are tested in their
# method's own test module.
COVERED_ELSEWHERE = {
    "delta_keep_mask": "tests/test_delta_kv.py",
    "delta_pack": "tests/test_delta_kv.py",
    "delta_kv_plans": "tests/test_delta_kv.py",
    "delta_kv_density": "tests/test_delta_kv.py",
    "stack_plans": "tests/test_varlen.py",
    "varlen_plans": "tests/test_varlen.py",
    "varlen_attention": "tests/test_varlen.py",
    "shareprefill_stack": "tests/test_shareprefill.py",  # lists of per-layer q, k, v
    "select_tiles": "tests/test_xattention.py",
}


def test_every_function_is_covered() -> None:
    covered = {name for _, name in ALL_QK} | {"density", "relative_error"} | set(COVERED_ELSEWHERE)
    for pkg in PACKAGES.values():
        functions = {name for name in pkg.__all__ if inspect.isfunction(getattr(pkg, name))}
        assert functions <= covered, functions - covered


@pytest.mark.parametrize("pkg,name", [f for f in ALL_QK if f[0] == "reference"])
def test_valid_call_passes_checks(pkg: str, name: str) -> None:
    """The baseline of this file: with nothing overridden the checks pass (reference only:
    fast calls run kernels, which test_kernel and test_conformance cover)."""
    q, k, v = valid_qkv()
    call(pkg, name, q, k, v)


@pytest.mark.parametrize("pkg,name", ALL_QK)
def test_tensor_checks(pkg: str, name: str) -> None:
    q, k, v = valid_qkv()
    expect(ValueError, "q", lambda: call(pkg, name, q[0], k, v))
    expect(ValueError, "k", lambda: call(pkg, name, q, k.unsqueeze(0), v))
    expect(ValueError, "k", lambda: call(pkg, name, q, k[:, :, :-1], v[:, :, :-1]))
    expect(ValueError, "k", lambda: call(pkg, name, q, k[..., :16], v[..., :16]))
    expect(ValueError, "k", lambda: call(pkg, name, q, k[:1], v[:1]))
    expect(ValueError, "multiple", lambda: call(pkg, name, q[:, :3], k, v))
    expect(TypeError, "q", lambda: call(pkg, name, q.tolist(), k, v))
    expect(TypeError, "k", lambda: call(pkg, name, q, None, v))
    expect(TypeError, "q", lambda: call(pkg, name, q.to(torch.int32), k, v))
    expect(TypeError, "k", lambda: call(pkg, name, q, k.to(torch.bfloat16), v))
    expect(ValueError, "k", lambda: call(pkg, name, q, k.to("meta"), v))
    expect(ValueError, "q", lambda: call(pkg, name, q[:, :, :0], k[:, :, :0], v[:, :, :0]))
    expect(ValueError, "q", lambda: call(pkg, name, q[..., :0], k[..., :0], v[..., :0]))


@pytest.mark.parametrize("pkg,name", QKV)
def test_value_checks(pkg: str, name: str) -> None:
    q, k, v = valid_qkv()
    expect(ValueError, "v", lambda: call(pkg, name, q, k, v[:, :1]))
    expect(ValueError, "v", lambda: call(pkg, name, q, k, v[..., :16]))
    expect(TypeError, "v", lambda: call(pkg, name, q, k, v.to(torch.bfloat16)))
    expect(TypeError, "v", lambda: call(pkg, name, q, k, "v"))
    expect(ValueError, "v", lambda: call(pkg, name, q, k, v.to("meta")))


# Plan builders that read only shapes (dense_plan, streaming_plan) accept any float
# dtype, as in reference; everything that computes on values must refuse fp32.
@pytest.mark.parametrize("pkg,name", [f for f in QKV if f[0] == "fast"] + [("fast", "recall")])
def test_fast_rejects_float32_and_float64(pkg: str, name: str) -> None:
    for dtype in (torch.float32, torch.float64):
        q, k, v = valid_qkv(dtype)
        expect(TypeError, "q", lambda: call(pkg, name, q, k, v))


@pytest.mark.parametrize("pkg,name", [f for f in ALL_QK if f[0] == "reference"])
def test_reference_accepts_every_float_dtype(pkg: str, name: str) -> None:
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        q, k, v = valid_qkv(dtype)
        call(pkg, name, q, k, v)


SCALED = [f for f in ALL_QK if "scale" in inspect.signature(getattr(PACKAGES[f[0]], f[1])).parameters]


# Functions that check scale late (none now: minference_plan used to, when no head ran an estimate).
LATE_SCALE: set[str] = set()
SCALED_PARAMS = [
    pytest.param(pkg, name, marks=[pytest.mark.xfail(strict=True, reason="scale not checked")]
                 if name in LATE_SCALE else [])
    for pkg, name in SCALED
]


@pytest.mark.parametrize("pkg,name", SCALED_PARAMS)
def test_scale_checks(pkg: str, name: str) -> None:
    q, k, v = valid_qkv()
    for bad in (0.0, -1.0, math.nan, math.inf, 1e38, 2e6):
        expect(ValueError, "scale", lambda: call(pkg, name, q, k, v, scale=bad))
    expect(TypeError, "scale", lambda: call(pkg, name, q, k, v, scale="0.1"))


def _int_params(pkg: str, name: str) -> list[str]:
    sig = inspect.signature(getattr(PACKAGES[pkg], name))
    return [p.name for p in sig.parameters.values()
            if p.kind is p.KEYWORD_ONLY and p.annotation in ("int", int)]


# Int parameters without a type check (none now: `layer=2.5` used to give IndexError).
UNCHECKED_INT: set[str] = set()
INT_PARAMS = [
    pytest.param(pkg, name, p, marks=[pytest.mark.xfail(strict=True, reason=f"{p} type unchecked")]
                 if p in UNCHECKED_INT else [])
    for pkg, name in ALL_QK for p in _int_params(pkg, name)
]


@pytest.mark.parametrize("pkg,name,param", INT_PARAMS)
def test_int_parameter_checks(pkg: str, name: str, param: str) -> None:
    q, k, v = valid_qkv()
    # A layer index out of range is an IndexError, as for any Python sequence.
    out_of_range = (ValueError, IndexError) if param == "layer" else ValueError
    expect(out_of_range, param, lambda: call(pkg, name, q, k, v, **{param: -5}))
    expect(TypeError, param, lambda: call(pkg, name, q, k, v, **{param: 2.5}))
    expect(TypeError, param, lambda: call(pkg, name, q, k, v, **{param: True}))
    if "block" in param:
        # Block sizes past MAX_BLOCK_SIZE are refused (they hung or overflowed the kernels).
        for huge in (2**20, 2**40, 2**63):
            expect(ValueError, param, lambda: call(pkg, name, q, k, v, **{param: huge}))


@pytest.mark.parametrize("pkg,name", ALL_QK)
def test_meta_tensors_are_refused(pkg: str, name: str) -> None:
    q, k, v = (t.to("meta") for t in valid_qkv())
    expect(ValueError, "meta", lambda: call(pkg, name, q, k, v))


# Known bugs, reported: these reject the input only after a kernel has run. strict=True
# makes the mark fail once the check moves before the launch, so it gets removed.
LATE_CHECK = pytest.mark.xfail(raises=RuntimeError, strict=True,
                               reason="input rejected only after a kernel launch")
LATE_BLOCK_CHECKS: set[tuple[str, str]] = set()

RUNS_WITH_BLOCKS = [
    pytest.param(pkg, name, marks=[LATE_CHECK] if (pkg, name) in LATE_BLOCK_CHECKS else [])
    for pkg, name in QKV
    if pkg == "fast" and {"block_m", "block_n"} <= set(_int_params(pkg, name))
]


@pytest.mark.parametrize("pkg,name", RUNS_WITH_BLOCKS)
def test_fast_block_sizes_must_be_multiples_of_16(pkg: str, name: str) -> None:
    q, k, v = valid_qkv()
    expect(ValueError, "block_m", lambda: call(pkg, name, q, k, v, block_m=24))
    expect(ValueError, "block_n", lambda: call(pkg, name, q, k, v, block_n=8))


@pytest.mark.parametrize("pkg", PACKAGES)
def test_plan_checks(pkg: str) -> None:
    mod = PACKAGES[pkg]
    q, k, v = valid_qkv()
    plan = reference.dense_plan(q, k, block_m=16, block_n=16)
    expect(TypeError, "plan", lambda: mod.sparse_attention(q, k, v, "plan"))
    expect(ValueError, "plan", lambda: mod.sparse_attention(q[:1], k[:1], v[:1], plan))
    expect(ValueError, "plan", lambda: mod.sparse_attention(q[:, :2], k[:, :1], v[:, :1], plan))
    expect(ValueError, "plan", lambda: mod.sparse_attention(
        q[:, :, :-1], k[:, :, :-1], v[:, :, :-1], plan))
    expect(ValueError, "plan", lambda: mod.sparse_attention(q, k, v, plan.to("meta")))
    bad = BlockColumnPlan(seqlen=N, block_m=16, block_n=16, block_count=plan.block_count + 100,
                          block_index=plan.block_index, column_count=plan.column_count,
                          column_index=plan.column_index)
    expect(ValueError, "plan.block_count", lambda: mod.sparse_attention(q, k, v, bad))
    expect(ValueError, "plan.block_count", lambda: mod.density(bad))


def test_fast_plan_block_sizes() -> None:
    q, k, v = valid_qkv()
    for bm, bn, word in ((8, 16, "plan.block_m"), (16, 40, "plan.block_n")):
        plan = reference.dense_plan(q, k, block_m=bm, block_n=bn)
        expect(ValueError, word, lambda: fast.sparse_attention(q, k, v, plan))


def test_fast_head_dim_limit() -> None:
    q, k, v = (torch.zeros(1, 1, 4, 512, dtype=torch.float16) for _ in range(3))
    expect(ValueError, "D", lambda: fast.attention(q, k, v))


@pytest.mark.parametrize("pkg", PACKAGES)
def test_mask_checks(pkg: str) -> None:
    mod = PACKAGES[pkg]
    q, k, v = valid_qkv()
    ones = torch.ones(N, N, dtype=torch.bool)
    bad_masks(lambda m: mod.attention(q, k, v, m))
    expect(TypeError, "mask", lambda: mod.density(ones[None, None].float()))
    expect(ValueError, "mask", lambda: mod.density(ones))
    expect(ValueError, "mask", lambda: mod.density(ones[None, None, :-1]))
    expect(ValueError, "mask", lambda: mod.density(torch.ones(1, 1, 0, 0, dtype=torch.bool)))
    expect(TypeError, "mask", lambda: mod.density("mask"))


def bad_masks(fn: Callable[[Any], Any]) -> None:
    ones = torch.ones(N, N, dtype=torch.bool)
    expect(TypeError, "mask", lambda: fn(ones.float()))
    expect(TypeError, "mask", lambda: fn(ones.tolist()))
    expect(ValueError, "mask", lambda: fn(ones[:-1]))
    expect(ValueError, "mask", lambda: fn(ones[None]))
    expect(ValueError, "mask", lambda: fn(ones.expand(3, 4, N, N)))
    expect(ValueError, "mask", lambda: fn(ones.expand(2, 3, N, N)))
    expect(ValueError, "mask", lambda: fn(ones.to("meta")))


@pytest.mark.parametrize("pkg", PACKAGES)
def test_recall_checks(pkg: str) -> None:
    """recall checks the mask or plan before any work (fast: before its causal pass)."""
    mod = PACKAGES[pkg]
    q, k, _ = valid_qkv()
    bad_masks(lambda m: mod.recall(q, k, m))
    plan = reference.dense_plan(q, k, block_m=16, block_n=16)
    bad = BlockColumnPlan(seqlen=N, block_m=16, block_n=16, block_count=plan.block_count + 100,
                          block_index=plan.block_index, column_count=plan.column_count,
                          column_index=plan.column_index)
    expect(ValueError, "plan.block_count", lambda: mod.recall(q, k, bad))
    expect(TypeError, "mask", lambda: mod.recall(q, k, "plan"))


def test_fast_recall_plan_block_sizes() -> None:
    q, k, _ = valid_qkv()
    for bm, bn, word in ((8, 16, "plan.block_m"), (16, 40, "plan.block_n")):
        plan = reference.dense_plan(q, k, block_m=bm, block_n=bn)
        expect(ValueError, word, lambda: fast.recall(q, k, plan))


@pytest.mark.parametrize("pkg", PACKAGES)
def test_relative_error_checks(pkg: str) -> None:
    mod = PACKAGES[pkg]
    x = torch.zeros(2, 3)
    expect(TypeError, "out", lambda: mod.relative_error(x.tolist(), x))
    expect(TypeError, "ref", lambda: mod.relative_error(x, None))
    expect(ValueError, "shape", lambda: mod.relative_error(x, x[:1]))
    assert math.isnan(mod.relative_error(torch.full((2,), math.nan), torch.ones(2)))


def test_minference_checks_before_any_launch() -> None:
    from sparseprefill.reference.minference import HeadPattern, MInferenceConfig

    q, k, v = valid_qkv()
    mixed = MInferenceConfig(((HeadPattern("a_shape", {"sink": 16, "window": 16, "block_m": 32}),)
                              + (HeadPattern("block_sparse", {"top_k": 2, "block_size": 16}),) * 3,))
    for pkg in PACKAGES.values():
        expect(ValueError, "same block sizes", lambda: pkg.minference(q, k, v, mixed))
    expect(ValueError, "top_k", lambda: HeadPattern("block_sparse", {"top_k": -1}))
    expect(ValueError, "block_size", lambda: HeadPattern("block_sparse", {"top_k": 2, "block_size": 2**20}))
    odd = MInferenceConfig.uniform(1, 4, HeadPattern("block_sparse", {"top_k": 2, "block_size": 24}))
    expect(ValueError, "block_size", lambda: fast.minference(q, k, v, odd))
    candidate = HeadPattern("a_shape", {"sink": 16, "window": 16, "block_m": 24, "block_n": 24})
    expect(ValueError, "candidates[1]", lambda: fast.search_patterns(
        q, k, v, candidates=[HeadPattern("block_sparse", {"top_k": 2, "block_size": 16}), candidate]))
    expect(TypeError, "candidates[0]", lambda: fast.search_patterns(q, k, v, candidates=["a_shape"]))
    for pkg in PACKAGES.values():
        expect(TypeError, "tolerance", lambda: pkg.search_patterns(q, k, v, tolerance="x"))
        expect(TypeError, "target", lambda: pkg.search_patterns(q, k, v, target="x"))


def test_minference_config_messages() -> None:
    from sparseprefill.reference.minference import HeadPattern, MInferenceConfig

    expect(ValueError, "layers", lambda: MInferenceConfig.from_json(
        '{"format": "sparseprefill.minference", "version": 1}'))
    expect(ValueError, "layers", lambda: MInferenceConfig.from_json(
        '{"format": "sparseprefill.minference", "version": 1, "layers": [{"pattern": "a_shape"}]}'))
    expect(ValueError, "head entry", lambda: MInferenceConfig.from_json(
        '{"format": "sparseprefill.minference", "version": 1, "layers": [[3]]}'))
    expect(ValueError, "head numbers", lambda: MInferenceConfig.from_json('[{"x": ["vertical_and_slash", 1, 2, 0]}]'))
    expect(ValueError, "head 0", lambda: MInferenceConfig.from_json('[{"0": ["vertical_and_slash", "a", 2, 0]}]'))
    expect(TypeError, "pattern", lambda: MInferenceConfig.uniform(1, 4, "vertical_slash"))  # type: ignore[arg-type]
    expect(TypeError, "layers[0][1]", lambda: MInferenceConfig(((HeadPattern("a_shape"), "x"),)))  # type: ignore[arg-type]


def test_fast_block_sparse_names_block_size() -> None:
    q, k, v = valid_qkv()
    expect(ValueError, "block_size must be a multiple of 16", lambda: fast.block_sparse(q, k, v, top_k=2, block_size=100))
