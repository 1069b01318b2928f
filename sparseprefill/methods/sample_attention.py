"""SampleAttention (Zhu et al.) as a method descriptor, with its distributed estimate and
benchmark suite."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .. import bench, fast, reference
from ..reference._checks import check_block_size
from ..reference.plan import BlockColumnPlan, cdiv
from ..reference.sample_attention import check_alpha_c, check_alpha_s
from ._common import MASS_CALIBRATION, knob_check
from ._core import Ablation, BenchSuite, DistributedEstimate, Method, MethodView, SyncStatus, register


def distributed_estimate(shard: Any, params: dict[str, Any], impl: str, scale: float | None,
                               comm: Any) -> BlockColumnPlan:
    from .. import distributed as D
    from ..reference._checks import per_head
    from ..reference.sample_attention import arg_topk, check_alpha_c, check_alpha_s, find_k, merge_index
    from ..reference.sample_attention import resolve_params, sampled_rows

    p = dict(params)
    unknown = set(p) - {"alpha_c", "alpha_s", "chunk_n", "block_size", "settings"}
    if unknown:
        raise TypeError(f"sample_attention got unexpected parameters {sorted(unknown)}")
    layout = shard.layout
    n = layout.seqlen
    bs = check_block_size("block_size", p.get("block_size", 128))
    a_c, a_s, c_n = resolve_params(n, alpha_c=p.get("alpha_c"), alpha_s=p.get("alpha_s"),
                                   chunk_n=p.get("chunk_n"), block_size=bs, settings=p.get("settings"))
    layout.check_blocks(bs, bs)
    device = shard.q.device
    b, hq, kb = shard.batch, shard.q_heads, cdiv(n, bs)
    a_c = per_head(a_c, "alpha_c", hq, check_alpha_c, device=device)
    a_s = per_head(a_s, "alpha_s", hq, check_alpha_s, device=device)
    sm_scale = 1.0 / math.sqrt(shard.head_dim) if scale is None else float(scale)
    # Alg. 1 line 2: the sampled rows, wherever they live.
    rows = torch.cat([torch.arange(a, z, device=device) for a, z in sampled_rows(n, c_n, bs)])
    q_rows = D.gather_rows(shard, rows, comm)
    # Alg. 1 lines 3-4: the sampled softmax over every rank's keys, reduced per block cell.
    scores = torch.zeros(2, b, hq, kb + 1, dtype=torch.float64, device=device)
    diag_of = (rows // bs)[:, None]

    def consume(a_hat: torch.Tensor, cols: torch.Tensor) -> None:
        blocks = cols // bs
        cells = torch.zeros(b, hq, rows.numel(), kb, dtype=torch.float64, device=device)
        cells.index_add_(3, blocks, a_hat)
        scores[0, ..., :kb] += cells.sum(dim=2)
        diag = diag_of - torch.arange(kb, device=device)[None, :]
        diag = torch.where(diag >= 0, diag, kb).expand(b, hq, -1, kb).reshape(b, hq, -1)
        scores[1].scatter_add_(2, diag, cells.reshape(b, hq, -1))

    D.global_softmax(shard, q_rows, rows, scale=sm_scale, comm=comm, consume=consume)
    # Column scores are complete on the block's holder, slash scores partial: one all-reduce.
    comm.all_reduce(scores, "estimate")
    column, slash = scores[0, ..., :kb], scores[1, ..., :kb]
    # Alg. 1 lines 6-9 on every rank (the scores are [B, Hq, Kb]: tiny).
    columns = arg_topk(column, find_k(column, a_c))
    slashes = arg_topk(slash, find_k(slash, a_s))
    if impl == "fast":
        from ..fast.kernels.sample_index import sample_attention_index

        return sample_attention_index(columns, slashes, seqlen=n, block_size=bs)
    plan: BlockColumnPlan = merge_index(columns, slashes, seqlen=n, block_size=bs)
    return plan



SAMPLE_ATTENTION_SETTINGS: tuple[tuple[float, float, int], ...] = (
    (0.95, 0.95, 1), (0.95, 0.95, 2), (0.9, 0.9, 1), (0.98, 0.98, 4))


def run_sample_attention_suite(
    seqlens: list[int], *, batch: int = 1, q_heads: int = 32, kv_heads: int = 8,
    head_dim: int = 128, dtype: torch.dtype = torch.bfloat16, with_recall: bool = True,
    settings: tuple[tuple[float, float, int], ...] = SAMPLE_ATTENTION_SETTINGS, block_size: int = 128,
    device: torch.device | None = None, time_ms: Callable[[Callable[[], Any]], float] | None = None,
    log: Callable[[str], None] = print,
) -> list[bench.Row]:
    """SampleAttention benchmark (issue 10) on the demo's structured workload.

    For each N: cuDNN SDPA (causal, dense) first, then for each `(alpha_c, alpha_s,
    chunk_n)` the time split into sampling (`sample_attention_scores`: the Triton
    estimate and its float64 block sums), filtering (`find_k` + `arg_topk` on the
    device and the Triton merge index, its one host sync included), the kernel
    (`block_column_attention` on that plan) and `fast.sample_attention` end to end.
    `extra` holds the stage times, the kernel's floor `density x cuDNN` and the
    ratios the issue's targets are stated in: (sampling + filtering) / cuDNN (target
    <= 5% at 128K) and kernel / floor (target <= 1.25).

    Args:
        device: where to run (default cuda); `time_ms` times a callable (default:
            `triton.testing.do_bench` median). On a CPU (tests, under the interpreter)
            the dense baseline is PyTorch's default SDPA instead of cuDNN.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    from .. import fast
    from ..workload import Shape, bench_qkv as synthetic_qkv
    from ..fast.kernels import block_column_attention
    from ..fast.kernels.sample_index import sample_attention_index
    from ..fast.sample_attention import sample_attention_scores
    from ..reference.sample_attention import arg_topk, find_k

    dev = device or torch.device("cuda")
    timer = time_ms or bench.bench_ms
    rows: list[bench.Row] = []
    for n in seqlens:
        q, k, v = synthetic_qkv(Shape(batch, q_heads, kv_heads, n, head_dim, dtype), device=dev)
        causal_pairs = batch * q_heads * n * (n + 1) / 2
        g = q_heads // kv_heads
        dense_ms = float("nan")
        impl = "cuDNN SDPA" if dev.type == "cuda" else "SDPA"
        try:
            ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

            def dense() -> Any:
                if dev.type != "cuda":
                    return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)

            dense_ms = timer(dense)
            del ke, ve
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            log(f"{impl} failed at N={n}: {exc}")
        rows.append(bench.Row("dense", impl, n, 1.0, 1.0, 1.0, dense_ms, None,
                        4 * head_dim * causal_pairs / dense_ms / 1e9, 1.0))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        for alpha_c, alpha_s, chunk_n in settings:
            params: dict[str, Any] = {"alpha_c": alpha_c, "alpha_s": alpha_s, "chunk_n": chunk_n,
                                      "block_size": block_size}

            def sampling() -> tuple[torch.Tensor, torch.Tensor]:
                return sample_attention_scores(q, k, chunk_n=chunk_n, block_size=block_size)

            column, slash = sampling()

            def filtering() -> BlockColumnPlan:
                cols = arg_topk(column, find_k(column, alpha_c))
                slashes = arg_topk(slash, find_k(slash, alpha_s))
                return sample_attention_index(cols, slashes, seqlen=n, block_size=block_size)

            plan = filtering()
            sample_ms, filter_ms = timer(sampling), timer(filtering)
            kernel_ms = timer(lambda: block_column_attention(q, k, v, plan, validate_plan=False))
            e2e_ms = timer(lambda: fast.sample_attention(q, k, v, **params))
            dens = float(fast.density(plan).mean())
            rec_mean = rec_min = None
            if with_recall:
                rec = fast.recall(q, k, plan)
                rec_mean, rec_min = float(rec.mean()), float(rec.min())
            floor_ms = dens * dense_ms
            extra = {"alpha_c": alpha_c, "alpha_s": alpha_s, "chunk_n": chunk_n, "block_size": block_size,
                     "sampling_ms": sample_ms, "filtering_ms": filter_ms, "kernel_ms": kernel_ms,
                     "floor_ms": floor_ms, "kernel_vs_floor": kernel_ms / floor_ms if floor_ms else None,
                     "overhead_vs_dense": (sample_ms + filter_ms) / dense_ms,
                     "block_width": int(plan.block_index.shape[3]), "plan_mb": plan.nbytes() / 2**20}
            name = f"sample_attention {alpha_c:g}/{alpha_s:g}/{chunk_n}"
            rows.append(bench.Row(name, "sparseprefill", n, dens, rec_mean, rec_min, e2e_ms, sample_ms + filter_ms,
                            4 * head_dim * dens * causal_pairs / e2e_ms / 1e9, dense_ms / e2e_ms, extra))
            log(f"N={n}: {name} {e2e_ms:.2f} ms (sampling {sample_ms:.2f}, filtering {filter_ms:.2f}, "
                f"kernel {kernel_ms:.2f}; floor {floor_ms:.2f}) density {dens:.4f}")
            del plan, column, slash
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        del q, k, v
    return rows


def format_stages(rows: list[bench.Row]) -> str:
    """SampleAttention's stage split against the issue's targets, one line per setting."""
    head = (f"{'setting':<28} {'N':>7} {'sampling':>9} {'filtering':>9} {'kernel':>9} {'floor':>9} "
            f"{'kernel/floor':>12} {'(s+f)/dense':>11}")
    lines = [head, "-" * len(head)]
    for r in rows:
        x = r.extra
        if "sampling_ms" not in x:
            continue
        ratio = "-" if x["kernel_vs_floor"] is None else f"{x['kernel_vs_floor']:.2f}"
        lines.append(f"{r.method:<28} {r.seqlen:>7} {x['sampling_ms']:>9.2f} {x['filtering_ms']:>9.2f} "
                     f"{x['kernel_ms']:>9.2f} {x['floor_ms']:>9.2f} {ratio:>12} "
                     f"{x['overhead_vs_dense']:>10.1%}")
    return "\n".join(lines)


def _suite(seqlens: list[int], *, flex: bool = True, **kwargs: Any) -> list[bench.Row]:
    return run_sample_attention_suite(seqlens, **kwargs)


def extras(impl_name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: dict[str, Any],
           view: MethodView) -> dict[str, float]:
    """The heads (over batch rows) whose stage 2 keeps no slash block on the diagonal."""
    from ..fast.sample_attention import sample_attention_selection as fast_selection
    from ..reference.sample_attention import sample_attention_selection as reference_selection

    _, slashes = (fast_selection if impl_name == "fast" else reference_selection)(q, k, **params)
    return {"heads_without_selected_diagonal": float((~slashes[..., 0]).sum())}


# `compare --ablations` (docs/sample_attention.md): alpha_c = alpha_s over this grid for each
# chunk_n and block size (64-token blocks show what block granularity costs).
def alpha_grid(chunk_n: int, block_size: int) -> Callable[[int], list[dict[str, Any]]]:
    return lambda n: [{"alpha_c": a, "alpha_s": a, "chunk_n": chunk_n, "block_size": block_size}
                      for a in (0.8, 0.9, 0.95, 0.98)]


ABLATIONS = tuple(Ablation(f"chunk_n {c}, block {b}", alpha_grid(c, b)) for b in (128, 64) for c in (1, 2, 4))

METHOD = register(Method(
    check=knob_check(alpha_c=check_alpha_c, alpha_s=check_alpha_s),
    name="sample_attention",
    knobs=("alpha_c", "alpha_s"),
    notes="SampleAttention: chunked sampling, CRA-threshold column and slash blocks (Alg. 1)",
    reference_plan=reference.sample_attention_plan,
    fast_plan=fast.sample_attention_plan,
    reference_run=reference.sample_attention,
    fast_run=fast.sample_attention,
    # Section 5.4's 32K setting; 64-token blocks below 4K so short prompts keep several blocks.
    defaults=lambda n: {"alpha_c": 0.95, "alpha_s": 0.95, "chunk_n": 1, "block_size": 128 if n >= 4096 else 64},
    sweep=lambda n: [{"alpha_c": a, "alpha_s": a, "chunk_n": 1} for a in (0.8, 0.9, 0.95, 0.98)],
    calibration=lambda n: [{"alpha_c": a, "alpha_s": a, "chunk_n": 1} for a in MASS_CALIBRATION],
    ablations=ABLATIONS,
    extras=extras,
    sync=SyncStatus(
        syncs=("merge index: the most kept column + slash blocks ((...).max().item())",),
        static_bound="Kb key blocks per query block (every block)",
        note="stage 1's sampled-row tile table depends on parameters only: built once and kept "
             "(sampled_scores.tile_table); during a capture without a kept one it is built on the device "
             "(sampled_scores.row_tile_table), as a host copy is refused there"),
    distributed=DistributedEstimate(
        "native",
        "the sampled query rows (`chunk_n` chunks' last `block_size` rows; broadcast or all-reduced "
        "from their holders); per-row softmax max and sum (two all-reduces of `[B, Hq, R]`); one "
        "all-reduce of the float64 column and block-diagonal scores `[2, B, Hq, N / block_size]`",
        distributed_estimate),
    bench=BenchSuite(about="SampleAttention split into sampling / filtering / kernel", seqlens=(32768, 131072),
                     run=_suite, summary=format_stages),
))
