"""`sparseprefill.fast.ops`: custom ops under `torch.compile(fullgraph=True)`, their fake
implementations (`torch.library.opcheck`), host synchronisations and static widths.

CPU only, under `TRITON_INTERPRET=1`: inductor compiles the attention-layer module
(g++ is present on the CI image); functions compile with `backend="aot_eager"`, which
traces the same graph (dynamo + AOT autograd with the fake implementations) without
paying for C++ compilation per test. `fullgraph=True` everywhere: a graph break fails.
Sizes are tiny (N = 40 and 72): every op runs the Triton interpreter.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

from sparseprefill import fast  # noqa: E402
from sparseprefill.conformance import tolerance  # noqa: E402
from sparseprefill.conformance.registry import METHODS  # noqa: E402
from sparseprefill.methods import UNKNOWN_SYNC  # noqa: E402
from sparseprefill.fast import ops  # noqa: E402
from sparseprefill.fast.anchor_attention import anchor_attention_plan  # noqa: E402
from sparseprefill.fast.capture import static_widths  # noqa: E402
from sparseprefill.fast.kernels.anchor_stripes import search_width_bound  # noqa: E402
from sparseprefill.fast.kernels.vertical_slash_index import index_width_bound  # noqa: E402
from sparseprefill.reference.plan import cdiv  # noqa: E402

N = 40  # two and a half 16-row blocks; one block for the registry's 64-row demo sizes
SMALL_VS = {"vertical_size": 4, "slash_size": 8, "last_q": 16, "block_m": 16, "block_n": 16,
            "init_columns": 2, "local_diagonals": 4}

_REPO = Path(fast.__file__).resolve().parent.parent
_THIS = Path(__file__).resolve()
# Reads of CPU tensors built from sizes alone (host arithmetic, no device involved,
# so no synchronisation on a GPU): the streaming width and the anchor window width.
HOST_ARITHMETIC = {"streaming.py:streaming_plan",
                   "anchor_attention.py:anchor_block_lists"}


def _qkv(b: int = 2, hq: int = 2, hkv: int = 1, n: int = N, d: int = 16, *, seed: int = 0,
         dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    return q, k, v


def _params(name: str, q: torch.Tensor) -> dict[str, Any]:
    spec = METHODS[name]
    return spec.call_params(spec.demo_params(int(q.shape[2])), q)


def _site() -> str | None:
    """`file:function` of the innermost repository frame outside this file, or None."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if ".venv" not in path.parts and path != _THIS and _REPO in path.parents:
            return f"{path.name}:{frame.f_code.co_name}"
        frame = frame.f_back
    return None


@contextmanager
def host_reads() -> Iterator[set[str]]:
    """Record where sparseprefill code reads tensor data back to the host, or builds a
    tensor from host data.

    Patches the Python entry points of a read (`item`, `tolist`, `int`/`float`/`bool`
    of a tensor, `nonzero`, `repeat_interleave` without `output_size`): on a GPU each
    is a host synchronisation, site `file:function`. And `torch.tensor` (host data that
    a GPU run copies to the device, which CUDA-graph capture refuses), site
    `copy:file:function`. Yields the set of sites.
    """
    sites: set[str] = set()
    saved: list[tuple[object, str, Any]] = []

    def wrap(owner: object, attr: str, is_read: Callable[..., bool] = lambda *a, **k: True,
             prefix: str = "") -> None:
        original = getattr(owner, attr)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if is_read(*args, **kwargs):
                site = _site()
                if site is not None:
                    sites.add(prefix + site)
            return original(*args, **kwargs)

        saved.append((owner, attr, original))
        setattr(owner, attr, recorded)

    def sized_by_data(*args: Any, **kwargs: Any) -> bool:
        return kwargs.get("output_size") is None and any(isinstance(a, torch.Tensor) for a in args[1:])

    for attr in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero"):
        wrap(torch.Tensor, attr)
    wrap(torch, "nonzero")
    wrap(torch, "repeat_interleave", sized_by_data)
    wrap(torch.Tensor, "repeat_interleave", sized_by_data)
    wrap(torch, "tensor", prefix="copy:")
    try:
        yield sites
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


def ops_checks() -> tuple[str, ...]:
    """Every check `torch.library.opcheck` runs by default."""
    return ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _compiled(fn: Callable[..., Any], backend: str = "aot_eager") -> tuple[Callable[..., Any], Any]:
    # Each test's functions compile afresh (parametrized tests share code objects).
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    return torch.compile(fn, backend=counter, fullgraph=True), counter


# -- registration --------------------------------------------------------------------------


def test_every_method_has_ops_and_a_sync_entry() -> None:
    for name in METHODS:
        status = ops.sync_status(name)
        assert status is not UNKNOWN_SYNC, f"{name}: its descriptor says nothing of its host reads (Method.sync)"
        op = getattr(torch.ops.sparseprefill, name).default
        assert (torch.Tag.cudagraph_unsafe in op.tags) == bool(status.syncs), name
        has_static = hasattr(torch.ops.sparseprefill, f"{name}_static")
        assert has_static == (status.static_bound is not None), name
        if has_static:
            static = getattr(torch.ops.sparseprefill, f"{name}_static").default
            assert (torch.Tag.cudagraph_unsafe in static.tags) == (not status.capture_safe), name
        if status.capture_safe:
            assert ops.capture_op(name) is getattr(torch.ops.sparseprefill,
                                                   f"{name}_static" if has_static else name)
        else:
            with pytest.raises(ValueError, match="not capture-safe"):
                ops.capture_op(name)
    with pytest.raises(ValueError, match="no _static op"):
        ops.method_op("dense", static=True)
    with pytest.raises(ValueError, match="no op"):
        ops.method_op("no_such_method")


def test_schema_follows_the_signature() -> None:
    schema, params = ops.method_schema("vertical_slash", fast.vertical_slash)
    assert schema == (
        "(Tensor q, Tensor k, Tensor v, *, SymInt vertical_size, SymInt slash_size, SymInt last_q=64, "
        "SymInt block_m=64, SymInt block_n=64, SymInt init_columns=30, SymInt local_diagonals=100, "
        "float? scale=None, SymInt[]? vertical_size_per_head=None, SymInt[]? slash_size_per_head=None) -> Tensor")
    assert [p.name for p in params][:3] == ["q", "k", "v"]
    # Per-head knobs (Method.knobs) keep their scalar argument and add a list beside it.
    assert "float? alpha_c=None" in ops.method_schema("sample_attention", fast.sample_attention)[0]
    assert "float[]? alpha_c_per_head=None" in ops.method_schema("sample_attention", fast.sample_attention)[0]
    # A union with str passes its str form; MInference's config its JSON text (an Adapter).
    assert "str? settings=None" in ops.method_schema("sample_attention", fast.sample_attention)[0]
    assert "str config, *" in ops.method_schema("minference", fast.minference)[0]
    assert 'str metric="euclidean"' in ops.method_schema("delta_kv", fast.delta_kv)[0]

    def no_op_type(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, table: dict[str, int]) -> torch.Tensor:
        return q

    with pytest.raises(TypeError, match="table.*has no op type"):
        ops.register_method_op("no_op_type", no_op_type)
    with pytest.raises(ValueError, match="already registered"):
        ops.register_method_op("dense", fast.dense)


# -- every method: compiled op == eager function, fake impl, host reads --------------------


@pytest.mark.parametrize("name", list(METHODS))
def test_method_op_compiles_and_matches_eager(name: str) -> None:
    """`fullgraph=True` around the op equals the eager fast function bit for bit (MInference's
    config travels as a constant JSON string, `ops.op_params`); the
    host reads of the eager run are where `Method.sync` says; the `_static` op reads nothing
    and gives the same output; the fake implementations match (`opcheck`)."""
    q, k, v = _qkv()
    params = _params(name, q)
    with torch.no_grad(), host_reads() as sites:
        want = METHODS[name].fast_run(q, k, v, **params)
    device_reads = {s for s in sites - HOST_ARITHMETIC if not s.startswith("copy:")}
    status = ops.sync_status(name)
    assert (len(device_reads) > 0) == bool(status.syncs), f"{name}: reads at {sorted(device_reads)}"
    assert len(device_reads) <= len(status.syncs), f"{name}: reads at {sorted(device_reads)}"

    op_params = ops.op_params(name, params)
    op = ops.method_op(name)

    def layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return op(q, k, v, **op_params).float() * 2.0

    compiled, counter = _compiled(layer)
    got = compiled(q, k, v)
    assert counter.frame_count == 1
    assert torch.equal(got, want.float() * 2.0)

    if status.static_bound is not None:
        with host_reads() as static_sites:
            static = ops.call(name, q, k, v, static=True, **params)
        static_reads = {s for s in static_sites - HOST_ARITHMETIC if not s.startswith("copy:")}
        assert not static_reads, f"{name}_static reads at {sorted(static_reads)}"
        # Capture-safe: neither a read nor host data copied in (SYNC says which are).
        assert (static_sites <= HOST_ARITHMETIC) == status.capture_safe, sorted(static_sites)
        assert torch.equal(static, want)
    elif not status.syncs:
        assert (sites <= HOST_ARITHMETIC) == status.capture_safe, sorted(sites)
    # The fake implementation matches the real output (every check of opcheck, schema,
    # autograd registration and AOT dispatch with dynamic shapes too, for one method:
    # the ops share one fake implementation and schemas built one way).
    checks = ops_checks() if name == "vertical_slash" else ("test_faketensor",)
    torch.library.opcheck(op.default, (q, k, v), op_params, test_utils=checks)
    if status.static_bound is not None:
        static_op = ops.method_op(name, static=True).default
        torch.library.opcheck(static_op, (q, k, v), op_params, test_utils=("test_faketensor",))


# -- the plan kernel op ----------------------------------------------------------------------


def test_sparse_attention_op_opcheck_and_lse() -> None:
    q, k, v = _qkv(b=1, n=40)
    plan = fast.vertical_slash_plan(q, k, **SMALL_VS)
    args = (q, k, v, plan.block_count, plan.block_index, plan.column_count, plan.column_index,
            plan.seqlen, plan.block_m, plan.block_n, plan.columns_disjoint, plan.column_group)
    for op in (torch.ops.sparseprefill.sparse_attention, torch.ops.sparseprefill.sparse_attention_lse):
        torch.library.opcheck(op.default, args, {"validate": True})
    want, want_lse = fast.sparse_attention(q, k, v, plan, scale=0.3, return_lse=True)
    got, lse = ops.sparse_attention(q, k, v, plan, scale=0.3, return_lse=True)
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    assert torch.equal(ops.sparse_attention(q, k, v, plan, scale=0.3), want)


def test_sparse_attention_validates_unchecked_plans_only() -> None:
    q, k, v = _qkv()
    plan = fast.dense_plan(q, k, block_m=16, block_n=16)
    assert plan._checked
    hostile = type(plan)(seqlen=plan.seqlen, block_m=16, block_n=16,
                         block_count=plan.block_count + 1, block_index=plan.block_index,
                         column_count=plan.column_count, column_index=plan.column_index)
    with pytest.raises(ValueError, match="block_count"):
        ops.sparse_attention(q, k, v, hostile)  # not marked valid: checked
    with host_reads() as sites:
        out = ops.sparse_attention(q, k, v, plan)  # marked valid: no check, no read
    assert not sites
    assert torch.equal(out, fast.dense(q, k, v, block_m=16, block_n=16))
    with pytest.raises(TypeError, match="BlockColumnPlan"):
        ops.sparse_attention(q, k, v, "plan")  # type: ignore[call-overload]


def test_chunk_after_a_cached_prefix_and_meta_inputs() -> None:
    """A plan's `query_offset` travels through the op (queries `[P, P + N)` against keys
    `[0, P + N)`); the fake implementations take meta tensors."""
    q, k, v = _qkv(n=56)
    chunk = q[:, :, 32:]
    plan = fast.dense_plan(chunk, k, block_m=16, block_n=16)
    assert plan.query_offset == 32
    want = fast.sparse_attention(chunk, k, v, plan)
    assert torch.equal(ops.sparse_attention(chunk, k, v, plan), want)
    args = (chunk, k, v, plan.block_count, plan.block_index, plan.column_count, plan.column_index,
            plan.seqlen, plan.block_m, plan.block_n, plan.columns_disjoint, plan.column_group,
            plan.query_offset)
    torch.library.opcheck(torch.ops.sparseprefill.sparse_attention.default, args,
                          test_utils=("test_faketensor",))
    meta = [t.to("meta") for t in (chunk, k, v)]
    out = torch.ops.sparseprefill.vertical_slash(*meta, vertical_size=4, slash_size=8)
    assert out.device.type == "meta" and out.shape == chunk.shape and out.dtype == chunk.dtype
    with pytest.raises(ValueError, match="does not fit"):
        torch.ops.sparseprefill.dense(meta[0], meta[1][:, :, :10], meta[2][:, :, :10])


def test_plan_built_inside_the_compiled_graph() -> None:
    """A plan from shapes alone (dense, streaming) traces into the graph; the kernel op
    takes its tensors."""

    def layer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        plan = fast.dense_plan(q, k, block_m=16, block_n=16)
        return ops.sparse_attention(q, k, v, plan, scale=0.25)

    q, k, v = _qkv(b=1, n=33, d=64, dtype=torch.bfloat16)
    compiled, counter = _compiled(layer)
    assert torch.equal(compiled(q, k, v), fast.dense(q, k, v, block_m=16, block_n=16, scale=0.25))
    assert counter.frame_count == 1


# -- static widths ---------------------------------------------------------------------------


def test_static_widths_give_the_same_plans_wider() -> None:
    """vertical-slash, AnchorAttention, SampleAttention and XAttention (DPXA shares its
    `tiles_to_plan`) under `static_widths()`: as wide as the bound, the same plan."""
    q, k, v = _qkv(b=1, n=72)
    n = 72
    # Two slashes (the diagonal and one more) reach at most 4 of the 5 key blocks.
    lines = {**SMALL_VS, "slash_size": 2, "local_diagonals": 1}
    cases = [
        (lambda: fast.vertical_slash_plan(q, k, **lines),
         index_width_bound(2, seqlen=n, block_m=16, block_n=16), "block_index"),
        # theta = 0 keeps only keys as strong as the pooled anchor: short stripe lists.
        (lambda: anchor_attention_plan(q, k, theta=0.0, step=2, block_m=16, block_n=16),
         search_width_bound(n, step=2, block_m=16, block_n=16), "column_index"),
        (lambda: fast.sample_attention_plan(q, k, alpha_c=0.2, alpha_s=0.2, block_size=16), cdiv(n, 16),
         "block_index"),
        (lambda: fast.xattention_plan(q, k, stride=4, threshold=0.3, block=16), cdiv(n, 16), "block_index"),
    ]
    for build, bound, field in cases:
        tight = build()
        with static_widths(), host_reads() as sites:
            loose = build()
        reads = {s for s in sites - HOST_ARITHMETIC if not s.startswith("copy:")}
        assert not reads, sorted(reads)
        assert getattr(loose, field).shape[3] == bound > getattr(tight, field).shape[3]
        assert loose.equal(tight)


def test_anchor_static_keeps_stripes_as_columns() -> None:
    """Every search key kept (theta huge): the default run promotes whole stripe blocks
    to blocks (host reads), the static op keeps them as columns (none); both are full
    causal attention under the tolerance policy."""
    q, k, v = _qkv(b=1, n=72)
    params = {"theta": 1e9, "step": 2, "block_m": 16, "block_n": 16}
    with host_reads() as sites:
        default = fast.anchor_attention(q, k, v, **params)
    assert "plan.py:mask_to_list" in sites  # reached only when a block was promoted
    with host_reads() as sites:
        static = ops.call("anchor_attention", q, k, v, static=True, **params)
    assert sites <= HOST_ARITHMETIC, sorted(sites)
    golden, _ = tolerance.golden_attention(q, k, v, None)
    baseline, _ = tolerance.baseline_attention(q, k, v, None)
    for out in (default, static):
        tolerance.check_output(out, golden, baseline, context="anchor_attention, theta 1e9")


# -- models ----------------------------------------------------------------------------------


class TinyAttention(torch.nn.Module):
    """One attention layer: fp32 projections, a sparse op on fp16 q, k, v (GQA)."""

    def __init__(self, op: Callable[..., torch.Tensor], params: dict[str, Any], *, hidden: int = 32,
                 q_heads: int = 2, kv_heads: int = 1, head_dim: int = 16) -> None:
        super().__init__()
        self.op, self.params = op, params
        self.heads, self.head_dim = (q_heads, kv_heads), head_dim
        self.qkv = torch.nn.Linear(hidden, (q_heads + 2 * kv_heads) * head_dim, bias=False)
        self.out = torch.nn.Linear(q_heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        (hq, hkv), d = self.heads, self.head_dim
        q, k, v = self.qkv(x).split([hq * d, hkv * d, hkv * d], dim=-1)
        q, k, v = (t.view(b, n, -1, d).transpose(1, 2).half() for t in (q, k, v))
        o = self.op(q, k, v, **self.params)
        return self.out(o.transpose(1, 2).reshape(b, n, hq * d).float())  # type: ignore[no-any-return]


def test_attention_layer_compiles_with_inductor() -> None:
    """Inductor (C++ on CPU) around a vertical-slash layer: one graph, equal to eager."""
    torch.manual_seed(0)
    layer = TinyAttention(torch.ops.sparseprefill.vertical_slash, SMALL_VS).eval()
    x = torch.randn(1, 72, 32)
    compiled, counter = _compiled(layer, "inductor")
    with torch.no_grad():
        want = layer(x)
        got = compiled(x)
    assert counter.frame_count == 1
    assert torch.equal(got, want)


def test_transformers_patch_with_ops_compiles_in_one_graph() -> None:
    """A patched tiny Llama with `use_ops=True`: the same logits as without, and the
    whole model (an unpadded prefill) is one graph."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from sparseprefill.integrations.transformers import patch, unpatch

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256)).eval()
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    blocks = {"block_m": 16, "block_n": 16}
    with torch.no_grad():
        patch(model, "dense", blocks, backend="fast", min_seqlen=1)
        want = model(ids).logits
        unpatch(model)
        attn = patch(model, "dense", blocks, backend="fast", min_seqlen=1, use_ops=True)
        compiled, counter = _compiled(model)
        got = compiled(ids).logits
        unpatch(model)
    assert counter.frame_count == 1 and attn.calls["sparse"] == 2
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
