"""Head-parallel and context-parallel attention on gloo (CPU), against one process.

The multi-process cases run in one `torch.multiprocessing` spawn per world size
(2 and 3 ranks): every rank runs every scenario, checks its own plan rows exactly
against the one-process plan, and rank 0 checks the gathered output under the
tolerance policy (`conformance/tolerance.py`) and the measured bytes against
`fetch_bytes`. Each test below reads one scenario's verdict. The single-process
tests check the layout, the plan split and the byte accounting without ranks.
"""

from __future__ import annotations

import functools
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparseprefill import distributed as D
from sparseprefill.conformance.registry import METHODS
from sparseprefill.conformance.tolerance import baseline_attention, check_attention, check_output, golden_attention
from sparseprefill.reference.plan import BlockColumnPlan

# -- shapes and parameters ----------------------------------------------------------

# N not a multiple of any block size; batch 2; GQA (2 query heads per KV head).
SEQLEN = {1: 203, 2: 203, 3: 229}
ALIGN = 32
CP_PARAMS: dict[str, dict[str, Any]] = {
    "dense": {"block_m": 32, "block_n": 32},
    "streaming": {"sink": 16, "window": 40, "block_m": 16, "block_n": 32},
    "vertical_slash": {"vertical_size": 12, "slash_size": 10, "last_q": 40, "block_m": 32, "block_n": 16,
                       "init_columns": 3, "local_diagonals": 5},
    "block_sparse": {"top_k": 3, "block_size": 32},
}
# Every query estimates (last_q > N): the last queries span every rank.
VS_ALL_ROWS = {**CP_PARAMS["vertical_slash"], "last_q": 10_000}
SAMPLE_PARAMS = {"alpha_c": 0.9, "alpha_s": 0.9, "chunk_n": 2, "block_size": 32}
ANCHOR_PARAMS = {"theta": 4.0, "step": 2, "block_m": 16, "block_n": 32}
FLEX_PARAMS = {"gamma": 0.9, "last_q": 40, "block_m": 32, "block_n": 16}


def _inputs(world: int, *, q_heads: int = 4, kv_heads: int = 2, seqlen: int | None = None,
            head_dim: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    n = SEQLEN[world] if seqlen is None else seqlen

    def draw(h: int) -> torch.Tensor:
        return torch.randn(2, h, n, head_dim, generator=gen).to(torch.float16)

    return draw(q_heads), draw(kv_heads), draw(kv_heads)


def _one_process_plan(method: str, q: torch.Tensor, k: torch.Tensor, params: dict[str, Any]) -> BlockColumnPlan:
    spec = METHODS[method]
    plan: BlockColumnPlan = spec.plan_fn("reference")(q, k, **spec.call_params(params, q))
    return plan


def _policy(out: torch.Tensor, lse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            mask: torch.Tensor, context: str) -> None:
    golden = golden_attention(q, k, v, mask)
    baseline = baseline_attention(q, k, v, mask)
    check_attention(out, lse, golden, baseline, context=context)


# -- the scenarios (run on every rank) ------------------------------------------------


def _check_rank_plan(rp: D.RankPlan, plan: BlockColumnPlan, layout: D.ZigZagLayout, rank: int) -> None:
    """Rows of this rank equal the one-process plan's; other rows empty; own/remote split exact."""
    tokens = layout.tokens(rank)
    others = torch.ones(layout.seqlen, dtype=torch.bool)
    others[tokens] = False
    full = rp.plan.validate().to_dense_mask()
    want = plan.to_dense_mask()
    assert torch.equal(full[:, :, tokens], want[:, :, tokens]), "plan rows differ from the one-process plan"
    assert not bool(full[:, :, others].any()), "rows of other ranks are not empty"
    own, remote = rp.own.validate().to_dense_mask(), rp.remote.validate().to_dense_mask()
    assert torch.equal(own | remote, full) and not bool((own & remote).any()), "own/remote is not a split"
    held = torch.zeros(layout.seqlen, dtype=torch.bool)
    held[tokens] = True
    assert not bool(own[..., ~held].any()) and not bool(remote[..., held].any()), "split by the wrong owner"


def _cp_case(method: str, params: dict[str, Any], *, estimate: str = "auto",
             impl: str = "reference") -> Callable[[int, int], dict[str, Any]]:
    def case(rank: int, world: int) -> dict[str, Any]:
        q, k, v = _inputs(world)
        layout = D.ZigZagLayout(q.shape[2], world, ALIGN)
        res = D.context_parallel_attention(
            layout.shard(q, rank), layout.shard(k, rank), layout.shard(v, rank), method=method,
            params=params, layout=layout, impl=impl, estimate=estimate, gather_output=True)
        plan = _one_process_plan(method, q, k, params)
        _check_rank_plan(res.plan, plan, layout, rank)
        traffic = res.traffic.reduced()
        want = D.fetch_bytes([D.split_plan(plan, layout, r) for r in range(world)], layout, kv_heads=k.shape[1],
                             head_dim=k.shape[3], itemsize=2)
        assert (traffic.index, traffic.kv) == (want["index"], want["kv"]), (traffic, want)
        ring = D.ring_bytes(layout, batch=2, kv_heads=k.shape[1], head_dim=k.shape[3], itemsize=2)
        assert traffic.kv <= ring
        if rank == 0:
            _policy(res.out, res.lse, q, k, v, plan.to_dense_mask(), f"cp {method} W={world}")
        return {"estimate": res.plan.estimate, "traffic": traffic.as_dict(), "ring": ring}
    return case


def _cp_native_equals_gather(rank: int, world: int) -> dict[str, Any]:
    q, k, _ = _inputs(world, seed=3)
    layout = D.ZigZagLayout(q.shape[2], world, ALIGN)
    qs, ks = layout.shard(q, rank), layout.shard(k, rank)
    out = {}
    for method, params in (("vertical_slash", CP_PARAMS["vertical_slash"]), ("vertical_slash", VS_ALL_ROWS),
                           ("block_sparse", CP_PARAMS["block_sparse"]), ("sample_attention", SAMPLE_PARAMS),
                           ("sample_attention", {**SAMPLE_PARAMS, "chunk_n": 1000}),
                           ("flexprefill_vs", FLEX_PARAMS)):
        native = D.context_parallel_plan(qs, ks, method=method, params=params, layout=layout)
        gathered = D.context_parallel_plan(qs, ks, method=method, params=params, layout=layout,
                                           estimate="gather")
        assert (native.estimate, gathered.estimate) == ("native", "gather")
        assert native.plan.equal(gathered.plan), f"{method}: native estimate differs from the gathered one"
        out[method] = True
    return out


def _cp_dense_below_ring(rank: int, world: int) -> dict[str, Any]:
    """Dense moves each rank only the earlier chunks it needs; a sparse plan moves less."""
    q, k, v = _inputs(world, seqlen=256, seed=5)
    layout = D.ZigZagLayout(256, world, ALIGN)
    sizes = {}
    for method in ("dense", "streaming"):
        params = {"block_m": 32, "block_n": 32} if method == "dense" else \
            {"sink": 32, "window": 32, "block_m": 32, "block_n": 32}
        rp = D.context_parallel_plan(layout.shard(q, rank), layout.shard(k, rank), method=method, params=params,
                                     layout=layout)
        sizes[method] = D.rank_fetch_bytes(rp, layout, rank, kv_heads=2, head_dim=32, itemsize=2)["kv"]
    t = torch.tensor([sizes["dense"], sizes["streaming"]])
    dist.all_reduce(t)
    dense, streaming = (int(x) for x in t)
    # Zig-zag: rank r's late chunk follows every chunk of the ranks s > r and the early
    # chunk of the ranks s < r; its early chunk follows only early chunks of s < r.
    per_token = 2 * 2 * 32 * 2 * 2  # batch, KV heads, D, K and V, fp16

    def size(s: int) -> int:
        return layout.chunks[s][1] - layout.chunks[s][0]

    want = per_token * sum(size(s) + (size(2 * world - 1 - s) if s > r else 0)
                           for r in range(world) for s in range(world) if s != r)
    assert dense == want, (dense, want)
    assert streaming < dense < D.ring_bytes(layout, batch=2, kv_heads=2, head_dim=32, itemsize=2)
    return {"dense": dense, "streaming": streaming}


def _hp_case(method: str, params: dict[str, Any], *, replicated: bool = False,
             impl: str = "reference") -> Callable[[int, int], dict[str, Any]]:
    """W KV heads with 2 query heads each (split), or W query heads on one KV head (replicated)."""
    def case(rank: int, world: int) -> dict[str, Any]:
        q_heads, kv_heads = (world, 1) if replicated else (2 * world, world)
        q, k, v = _inputs(world, q_heads=q_heads, kv_heads=kv_heads, seqlen=111)
        ql, kl, vl = D.shard_heads(q, k, v, world=world, rank=rank)
        spec = METHODS[method]
        heads = D.head_slices(q_heads, kv_heads, world, rank)[0]
        local = D.head_parallel_attention(ql, kl, vl, method=method, params=params, impl=impl,
                                          gather_output=False)
        full = D.head_parallel_attention(ql, kl, vl, method=method, params=params, impl=impl)
        assert torch.equal(local, full[:, heads]), "the sharded output is not the gathered output's slice"
        if spec.plan_based:
            plan = _one_process_plan(method, q, k, params)
            mine = D.head_parallel_plan(ql, kl, method=method, params=params, impl=impl)
            sliced = BlockColumnPlan(
                seqlen=plan.seqlen, block_m=plan.block_m, block_n=plan.block_n,
                block_count=plan.block_count[:, heads], block_index=plan.block_index[:, heads],
                column_count=plan.column_count[:, heads], column_index=plan.column_index[:, heads],
                column_group=plan.column_group)
            assert mine.equal(sliced), "local plan differs from the one-process plan's heads"
            if rank == 0:
                _policy(full, None, q, k, v, plan.to_dense_mask(), f"hp {method} W={world}")
        elif rank == 0:
            assert spec.golden is not None
            golden, baseline = spec.golden(q, k, v, spec.call_params(params, q))
            check_output(full, golden, baseline, context=f"hp {method} W={world}")
        return {}
    return case


def _errors(rank: int, world: int) -> dict[str, Any]:
    q, k, v = _inputs(world)
    layout = D.ZigZagLayout(q.shape[2], world, ALIGN)
    qs, ks, vs = (layout.shard(x, rank) for x in (q, k, v))
    expect: list[tuple[str, Callable[[], Any]]] = [
        ("not a multiple of the plan's block_m=64",
         lambda: D.context_parallel_attention(qs, ks, vs, method="dense", params={"block_m": 64, "block_n": 32},
                                              layout=layout)),
        ("not a multiple of the plan's block_n=64",
         lambda: D.context_parallel_plan(qs, ks, method="vertical_slash",
                                         params={**CP_PARAMS["vertical_slash"], "block_n": 64}, layout=layout)),
        ("needs a method with plans",
         lambda: D.context_parallel_attention(qs, ks, vs, method="delta_kv", params={"threshold": 0.5},
                                              layout=layout)),
        ("must hold this rank's",
         lambda: D.context_parallel_attention(q, k, v, method="dense", layout=layout)),
        ("does not match the process group's size",
         lambda: D.context_parallel_attention(qs, ks, vs, method="dense",
                                              layout=D.ZigZagLayout(q.shape[2], world + 1, ALIGN))),
        ("method must be one of",
         lambda: D.head_parallel_attention(q, k, v, method="no_such_method")),
        (f"q_heads=5 divisible by the world size {world}",
         lambda: D.shard_heads(torch.zeros(1, 5, 8, 4), torch.zeros(1, 5, 8, 4), torch.zeros(1, 5, 8, 4),
                               world=world, rank=rank)),
        ("impl must be one of",
         lambda: D.context_parallel_plan(qs, ks, method="dense", layout=layout, impl="cuda")),
    ]
    for text, call in expect:
        with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)")):
            call()
    return {"checked": len(expect)}


def _bench_rows(rank: int, world: int) -> dict[str, Any]:
    """`sparseprefill bench --distributed`'s rows, structurally (gloo, reference, N = 256)."""
    from sparseprefill.bench.suites.distributed import format_rows, run_rows

    rows = run_rows([256], ["dense", "vertical_slash"], modes=["head", "context"], batch=1, q_heads=2 * world,
                    kv_heads=world, head_dim=16, dtype=torch.float16, impl="reference", align=128, reps=1,
                    dense_max=256, device=torch.device("cpu"), log=lambda line: None)
    assert [r["method"] for r in rows] == ["dense", "vertical_slash"]
    for r in rows:
        for key in ("one_ms", "head_ms", "head_gather_ms", "context_ms", "head_efficiency", "context_efficiency",
                    "ring_bytes", "bytes_vs_ring"):
            assert r[key] > 0, key
        assert r["head_max_diff"] == 0 and r["context_max_diff"] < 1e-3
        assert r["bytes"]["kv"] <= r["ring_bytes"]
    assert "vertical_slash" in format_rows(rows)
    return {"bytes_vs_ring": [r["bytes_vs_ring"] for r in rows]}


SCENARIOS: dict[str, Callable[[int, int], dict[str, Any]]] = {
    **{f"cp_{m}": _cp_case(m, p) for m, p in CP_PARAMS.items()},
    "cp_vertical_slash_all_rows": _cp_case("vertical_slash", VS_ALL_ROWS),
    "cp_sample_attention": _cp_case("sample_attention", SAMPLE_PARAMS),
    "cp_flexprefill_vs": _cp_case("flexprefill_vs", FLEX_PARAMS),
    "cp_anchor_attention_gather": _cp_case("anchor_attention", ANCHOR_PARAMS),
    "cp_native_equals_gather": _cp_native_equals_gather,
    "cp_dense_below_ring": _cp_dense_below_ring,
    "hp_dense": _hp_case("dense", {"block_m": 16, "block_n": 32}),
    "hp_streaming": _hp_case("streaming", {"sink": 8, "window": 24, "block_m": 16, "block_n": 16}),
    "hp_vertical_slash": _hp_case("vertical_slash", {**CP_PARAMS["vertical_slash"], "last_q": 16}),
    "hp_block_sparse": _hp_case("block_sparse", {"top_k": 2, "block_size": 16}),
    # A per-head knob (4 query heads at W = 2): each rank takes its heads' values.
    "hp_block_sparse_per_head": _hp_case("block_sparse", {"top_k": [1, 3, 2, 4], "block_size": 16}),
    "hp_minference": _hp_case("minference", METHODS["minference"].demo_params(111)),
    "hp_delta_kv": _hp_case("delta_kv", {"threshold": 0.5, "metric": "cosine", "chunk": 16, "block_m": 16,
                                         "block_n": 16}),
    "hp_replicated_kv": _hp_case("vertical_slash", {**CP_PARAMS["vertical_slash"], "last_q": 16},
                                 replicated=True),
    "errors": _errors,
}
# Slower, in their own spawn: the Triton kernels under the interpreter, and the bench's rows.
SLOW_TWO_RANKS: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "cp_vertical_slash_fast": _cp_case("vertical_slash", CP_PARAMS["vertical_slash"], impl="fast"),
    "bench_rows": _bench_rows,
}
# Three ranks (slow: three processes share the CI's two cores): the methods and the errors.
THREE_RANKS = ["cp_dense", "cp_streaming", "cp_vertical_slash", "cp_vertical_slash_all_rows", "cp_block_sparse",
               "cp_sample_attention", "cp_native_equals_gather", "cp_dense_below_ring", "hp_dense", "hp_streaming",
               "hp_vertical_slash", "hp_replicated_kv",
               "errors"]


def _worker(rank: int, world: int, store: str, names: list[str], out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results: dict[str, Any] = {}
    try:
        for name in names:
            t0 = time.perf_counter()
            try:
                info = {**SCENARIOS, **SLOW_TWO_RANKS}[name](rank, world)
                results[name] = {"ok": True, "info": info}
            except Exception:  # noqa: BLE001 - the verdict carries the traceback to the test
                results[name] = {"ok": False, "error": traceback.format_exc()}
            results[name]["seconds"] = time.perf_counter() - t0
            dist.barrier()
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()


def run_scenarios(world: int, names: list[str], *, timeout: float = 600.0) -> list[dict[str, Any]]:
    """Run `names` on `world` gloo ranks; every rank's verdicts."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.spawn(_worker, args=(world, os.path.join(tmp, "store"), names, tmp), nprocs=world,
                       join=False)
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"{world} ranks did not finish {names} in {timeout:.0f} s")
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]


_CACHE: dict[tuple[int, str], list[dict[str, Any]]] = {}


def verdict(world: int, name: str) -> dict[str, Any]:
    """Run a scenario set once per world size (one spawn), then read `name`'s verdict."""
    group = "slow" if name in SLOW_TWO_RANKS else "main"
    if (world, group) not in _CACHE:
        names = list(SLOW_TWO_RANKS) if group == "slow" else THREE_RANKS if world == 3 else list(SCENARIOS)
        _CACHE[world, group] = run_scenarios(world, names)
    results = _CACHE[world, group]
    for rank, per_rank in enumerate(results):
        res = per_rank[name]
        if not res["ok"]:
            pytest.fail(f"rank {rank} of {world}, {name}:\n{res['error']}")
    return dict(results[0][name])


# -- multi-process tests ----------------------------------------------------------


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks(name: str) -> None:
    verdict(2, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", THREE_RANKS)
def test_three_ranks(name: str) -> None:
    verdict(3, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_TWO_RANKS))
def test_two_ranks_slow(name: str) -> None:
    verdict(2, name)


# -- single-process tests -----------------------------------------------------------


@pytest.mark.parametrize("seqlen,world,align", [(203, 2, 32), (229, 3, 32), (1, 2, 16), (1000, 4, 128), (64, 3, 16)])
def test_layout_partitions_aligned_and_balanced(seqlen: int, world: int, align: int) -> None:
    layout = D.ZigZagLayout(seqlen, world, align)
    chunks = layout.chunks
    assert len(chunks) == 2 * world and chunks[0][0] == 0 and chunks[-1][1] == seqlen
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert all(s % align == 0 and (e % align == 0 or e == seqlen) for s, e in chunks)
    sizes = [cdiv_units(e - s, align) for s, e in chunks]
    assert max(sizes) - min(sizes) <= 1
    owner = layout.owner()
    for r in range(world):
        tokens = layout.tokens(r)
        assert tokens.numel() == layout.local_length(r)
        assert bool((owner[tokens] == r).all())
    x = torch.arange(seqlen).view(1, 1, seqlen, 1).float()
    assert torch.equal(layout.unshard([layout.shard(x, r) for r in range(world)]), x)


def cdiv_units(n: int, align: int) -> int:
    return -(-n // align)


def test_layout_balances_causal_work() -> None:
    layout = D.ZigZagLayout(64 * 1024, 4, 128)
    work = [sum((e * (e + 1) - s * (s + 1)) // 2 for s, e in layout.rank_chunks(r)) for r in range(4)]
    assert max(work) / min(work) < 1.001


def test_layout_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="world must be >= 1"):
        D.ZigZagLayout(100, 0)
    with pytest.raises(TypeError, match="align must be an int"):
        D.ZigZagLayout(100, 2, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank must lie in"):
        D.ZigZagLayout(100, 2).rank_chunks(2)
    with pytest.raises(ValueError, match="align=48 is not a multiple of the plan's block_n=32"):
        D.ZigZagLayout(100, 2, 48).check_blocks(16, 32)


@pytest.mark.parametrize("q_heads,kv_heads,world,want", [
    (8, 4, 2, [(0, 4, 0, 2), (4, 8, 2, 4)]),
    (6, 3, 3, [(0, 2, 0, 1), (2, 4, 1, 2), (4, 6, 2, 3)]),
    (4, 1, 2, [(0, 2, 0, 1), (2, 4, 0, 1)]),
    (8, 2, 4, [(0, 2, 0, 1), (2, 4, 0, 1), (4, 6, 1, 2), (6, 8, 1, 2)]),
])
def test_head_slices_keep_groups_whole(q_heads: int, kv_heads: int, world: int,
                                       want: list[tuple[int, int, int, int]]) -> None:
    got = []
    for r in range(world):
        qs, ks = D.head_slices(q_heads, kv_heads, world, r)
        got.append((qs.start, qs.stop, ks.start, ks.stop))
        group = q_heads // kv_heads
        assert all(h // group in range(ks.start, ks.stop) for h in range(qs.start, qs.stop))
    assert got == want


@pytest.mark.parametrize("q_heads,kv_heads,world,text", [
    (3, 3, 2, "q_heads=3 divisible by the world size 2"),
    (12, 6, 4, "kv_heads=6 divisible by the world size 4"),
    (8, 4, 16, "q_heads=8 divisible by the world size 16"),
    (6, 4, 2, "q_heads=6 must be a multiple of kv_heads=4"),
])
def test_head_slices_reject_bad_counts(q_heads: int, kv_heads: int, world: int, text: str) -> None:
    with pytest.raises(ValueError, match=text):
        D.head_slices(q_heads, kv_heads, world, 0)


PLAN_CASES = [
    ("dense", {"block_m": 32, "block_n": 16}),
    ("streaming", {"sink": 20, "window": 50, "block_m": 16, "block_n": 32}),
    ("vertical_slash", CP_PARAMS["vertical_slash"]),
    ("block_sparse", {"top_k": 2, "block_size": 16}),
    ("anchor_attention", {"theta": 4.0, "step": 2, "block_m": 16, "block_n": 16}),
]


SPLIT_CASES = [("reference", m, p) for m, p in PLAN_CASES] + [
    # One column list shared by every query block (a group as large as the sequence).
    ("reference", "anchor_attention", {"theta": 4.0, "step": 16, "block_m": 16, "block_n": 16}),
    # fast plans keep expanded views: one list shared by every query block and head.
    ("fast", "dense", {"block_m": 32, "block_n": 16}),
    ("fast", "vertical_slash", CP_PARAMS["vertical_slash"]),
]


@functools.lru_cache(maxsize=None)
def _split_case_plan(case: int) -> BlockColumnPlan:
    impl, method, params = SPLIT_CASES[case]
    q, k, _ = _inputs(2, seqlen=173)
    plan: BlockColumnPlan = METHODS[method].plan_fn(impl)(q, k, **params)
    return plan


@pytest.mark.parametrize("case", range(len(SPLIT_CASES)),
                         ids=[f"{i}-{m}" for i, m, _ in SPLIT_CASES])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_split_plan_covers_the_plan_exactly(case: int, world: int) -> None:
    impl, method, _ = SPLIT_CASES[case]
    k = _inputs(2, seqlen=173)[1]
    plan = _split_case_plan(case)
    layout = D.ZigZagLayout(173, world, 32)
    union = torch.zeros_like(plan.to_dense_mask())
    for r in range(world):
        rp = D.split_plan(plan, layout, r)
        _check_rank_plan(rp, plan, layout, r)
        union |= rp.plan.to_dense_mask()
        # The keys to fetch: whole listed blocks and listed columns, per KV head.
        blocks = rp.remote.block_mask().repeat_interleave(plan.block_n, dim=3)[..., :173]
        listed = (blocks | rp.remote.column_mask()).reshape(2, 2, 2, -1, 173).any(dim=3).any(dim=2)
        assert torch.equal(D.needed_keys(rp.remote, k.shape[1]), listed)
        read = rp.remote.to_dense_mask().reshape(2, 2, 2, 173, 173).any(dim=3).any(dim=2)
        assert torch.equal(read, listed), "a remote block holds keys its rows do not read"
    assert torch.equal(union, plan.to_dense_mask())
    if impl == "fast" and method == "dense":
        # The fast dense plan is O(N): its split stays a shared list (stride 0).
        assert rp.remote.block_index.stride()[:3] == (0, 0, 0)


def test_fetch_bytes_counts_blocks_and_columns() -> None:
    # One query block of 16 rows at [32, 48) on rank 1 listing key block 0 and column 20.
    n, layout = 64, D.ZigZagLayout(64, 2, 16)
    assert layout.rank_chunks(1) == ((16, 32), (32, 48))
    bc = torch.zeros(1, 1, 4, dtype=torch.int32)
    bc[0, 0, 2] = 1
    cc = torch.zeros(1, 1, 4, dtype=torch.int32)
    cc[0, 0, 2] = 1
    plan = BlockColumnPlan(seqlen=n, block_m=16, block_n=16, block_count=bc,
                           block_index=torch.zeros(1, 1, 4, 1, dtype=torch.int32), column_count=cc,
                           column_index=torch.full((1, 1, 4, 1), 20, dtype=torch.int32)).validate()
    rps = [D.split_plan(plan, layout, r) for r in range(2)]
    # Key block 0 is rank 0's; column 20 lies in rank 1's own chunk. Each rank asks the
    # other for one bit per token that one holds (32 each: 4 bytes).
    assert D.rank_fetch_bytes(rps[1], layout, 1, kv_heads=1, head_dim=8, itemsize=2) == {
        "index": 4, "kv": 16 * 2 * 8 * 2}
    assert D.fetch_bytes(rps, layout, kv_heads=1, head_dim=8, itemsize=2) == {"index": 2 * 4, "kv": 16 * 2 * 8 * 2}


@pytest.mark.parametrize("n", [1, 7, 8, 9, 203])
def test_bit_packing_round_trips(n: int) -> None:
    mask = torch.rand(2, 3, n, generator=torch.Generator().manual_seed(n)) < 0.4
    packed = D._pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, -(-n // 8))
    assert torch.equal(D._unpack_bits(packed, n), mask)


def test_ring_bytes() -> None:
    layout = D.ZigZagLayout(1000, 4)
    assert D.ring_bytes(layout, batch=2, kv_heads=8, head_dim=128, itemsize=2) == 3 * 2 * 2 * 8 * 1000 * 128 * 2


def test_bench_distributed_needs_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    from sparseprefill import bench

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    parser = __import__("argparse").ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--distributed", "--dist-modes", "head,context", "--device", "cpu", "--seqlens", "256"])
    with pytest.raises(SystemExit, match="launch it with torchrun"):
        bench.run(args)


def test_estimate_kinds() -> None:
    assert D.estimate_kind("dense") == "shape"
    assert D.estimate_kind("vertical_slash") == "native"
    assert D.estimate_kind("vertical_slash", "gather") == "gather"
    assert D.estimate_kind("anchor_attention") == "gather"
    with pytest.raises(ValueError, match="estimate must be"):
        D.estimate_kind("dense", "ring")
