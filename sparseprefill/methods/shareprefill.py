"""SharePrefill (Peng et al.) as a method descriptor: its cross-layer state, and its
multi-layer benchmark suite."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import bench, fast, reference
from ..reference.plan import BlockColumnPlan
from ._common import MASS_CALIBRATION, keyword_check
from ..reference.shareprefill import check_share_params
from ._core import BenchArgument, BenchSuite, Method, SyncStatus, register

# The parameters of one prefill's state (the layer index comes from the model).
STATE_KEYS = ("layout", "tau", "delta", "gamma", "block_m", "block_n", "init_columns", "local_diagonals")


def new_state(params: Mapping[str, Any]) -> reference.SharePrefillState:
    """The per-prefill state from SharePrefill's parameters (the layer comes from the model)."""
    unknown = sorted(set(params) - set(STATE_KEYS))
    if unknown:
        raise ValueError(f"shareprefill in a model takes {STATE_KEYS}; got also {unknown} "
                         "(the layer index comes from the model)")
    return reference.SharePrefillState(**params)


def share_layers(
    base: tuple[torch.Tensor, torch.Tensor, torch.Tensor], layers: int, *, flat_every: int = 8,
    seed: int = 0,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """A synthetic stack of `layers` layers from one demo workload (cheap to make at 128K).

    Layer `l` rolls the query heads by `l` and the KV heads by `l` (so heads meet other
    keys), adds seeded noise to q, and scales every `flat_every`-th query head down to
    near-uniform attention: those heads are the non-sparse ones SharePrefill makes
    dense (the first of their cluster) or shares; the others are highly sparse.
    """
    q0, k0, v0 = base
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = []
    for layer in range(layers):
        q = q0.roll(layer, dims=1).clone()
        noise = torch.randn(q.shape[1], q.shape[3], generator=gen).to(q.device, q.dtype)
        q += 0.1 * noise[None, :, None, :]
        q[:, ::flat_every] *= 0.02
        out.append((q, k0.roll(layer, dims=1).contiguous(), v0.roll(layer, dims=1).contiguous()))
    return out


def share_layout(layers: int, q_heads: int, *, flat_every: int = 8) -> Any:
    """The bench's cluster layout: the flat heads form cluster 0, the others 3 clusters by head."""
    from ..reference.shareprefill import ClusterLayout

    row = tuple(0 if h % flat_every == 0 else 1 + h % 3 for h in range(q_heads))
    return ClusterLayout((row,) * layers, meta={"source": "sparseprefill bench (synthetic)"})


def run_shareprefill_suite(
    seqlens: list[int], *, batch: int = 1, q_heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16, layers: int = 8, with_recall: bool = True,
    log: Callable[[str], None] = print, device: str = "cuda",
    timer: Callable[[Callable[[], Any]], float] | None = None, share_params: dict[str, Any] | None = None,
) -> list[bench.Row]:
    """SharePrefill over a synthetic multi-layer prefill (issue 13), per layer, same run:

    * `shareprefill L<l>`: end to end (`fast.shareprefill_layer` from the state the
      earlier layers left), with `extra` splitting it into decision (Alg. 3: pooled
      estimate, distances, head walk), plan (Alg. 5 lines and index, shared masks),
      sparse heads (one kernel pass over the vertical-slash and shared heads), dense
      pivots (the dense heads' kernel passes with block means) and pivot construction
      (Alg. 2), plus the heads per pattern;
    * `flexprefill_vs L<l>`: the Alg. 5 fallback alone on every head (gamma 0.9);
    * `dense L<l>`: cuDNN SDPA on the same q, k, v;
    * `shareprefill total`: the sum over layers against cuDNN's sum.

    `device="cpu"` with a `timer` runs it under the Triton interpreter (tests check the
    rows there; no cuDNN, its times are NaN).
    """
    from .. import fast
    from ..workload import Shape, bench_qkv as synthetic_qkv
    from ..fast.kernels import block_column_attention
    from ..fast.shareprefill import build_pivots, decide_layer, dense_pivot_attention, layer_plan
    from ..reference.shareprefill import SharePattern, SharePrefillState

    dev = torch.device(device)
    timed = timer or bench.bench_ms
    rows: list[bench.Row] = []
    params = dict(share_params or {})
    for n in seqlens:
        q0, k0, v0 = synthetic_qkv(Shape(batch, q_heads, kv_heads, n, head_dim, dtype), device=dev)
        stack = share_layers((q0, k0, v0), layers)
        del q0, k0, v0
        layout = share_layout(layers, q_heads)
        state = SharePrefillState(layout, **params)
        causal_pairs = batch * q_heads * n * (n + 1) / 2
        scale = head_dim ** -0.5
        totals = {"ours": 0.0, "cudnn": 0.0}
        for layer, (q, k, v) in enumerate(stack):
            cudnn_ms = bench.cudnn_row(q, k, v, log=log).ms if dev.type == "cuda" else float("nan")
            rows.append(bench.Row(f"dense L{layer}", "cuDNN SDPA", n, 1.0, 1.0, 1.0, cudnn_ms, None,
                            4 * head_dim * causal_pairs / cudnn_ms / 1e9, 1.0))
            before = state.clone()
            before.bind(q, layer)
            decision = decide_layer(q, k, before.clone(), layer=layer, scale=scale)
            decide_ms = timed(lambda: decide_layer(q, k, before.clone(), layer=layer, scale=scale))
            plan = layer_plan(q, k, before, decision, scale=scale, with_dense=False)
            plan_ms = timed(lambda: layer_plan(q, k, before, decision, scale=scale, with_dense=False))
            sparse_ms = timed(lambda: block_column_attention(q, k, v, plan, validate_plan=False))
            pairs = [(r, h) for r, h in (decision.pattern == SharePattern.DENSE).nonzero().tolist()]
            dense_ms = pivot_ms = 0.0
            if pairs:
                scratch = torch.empty_like(q)
                means = dense_pivot_attention(q, k, v, before, pairs, scratch, scale=scale)
                dense_ms = timed(lambda: dense_pivot_attention(q, k, v, before, pairs, scratch, scale=scale))
                pivot_ms = timed(lambda: build_pivots(means, before, decision, pairs))
                del scratch, means
            e2e_ms = timed(lambda: fast.shareprefill_layer(q, k, v, before.clone(), layer=layer, scale=scale))
            fast.shareprefill_layer(q, k, v, state, layer=layer, scale=scale)
            full_plan = layer_plan(q, k, before, decision, scale=scale)
            dens = float(fast.density(full_plan).mean())
            rec_mean = rec_min = None
            if with_recall:
                rec = fast.recall(q, k, full_plan, scale=scale)
                rec_mean, rec_min = float(rec.mean()), float(rec.min())
            counts = decision.counts()
            extra = {"decision_ms": decide_ms, "plan_ms": plan_ms, "sparse_heads_ms": sparse_ms,
                     "dense_pivots_ms": dense_ms, "pivot_build_ms": pivot_ms, **counts}
            rows.append(bench.Row(f"shareprefill L{layer}", "sparseprefill", n, dens, rec_mean, rec_min, e2e_ms,
                            decide_ms + plan_ms, 4 * head_dim * dens * causal_pairs / e2e_ms / 1e9,
                            cudnn_ms / e2e_ms, extra))
            log(f"N={n} layer {layer}: shareprefill {e2e_ms:.2f} ms (decision {decide_ms:.2f}, plan "
                f"{plan_ms:.2f}, sparse {sparse_ms:.2f}, dense {dense_ms:.2f}, pivots {pivot_ms:.2f}) "
                f"{counts} density {dens:.4f}; cuDNN {cudnn_ms:.2f} ms")
            totals["ours"] += e2e_ms
            totals["cudnn"] += cudnn_ms
            del plan, full_plan

            def flex_plan() -> BlockColumnPlan:
                return fast.flexprefill_vs_plan(q, k, gamma=state.gamma, last_q=state.block_m,
                                                block_m=state.block_m, block_n=state.block_n, line_block=1,
                                                scale=scale)

            fplan = flex_plan()
            est_ms = timed(flex_plan)
            ker_ms = timed(lambda: block_column_attention(q, k, v, fplan, validate_plan=False))
            fdens = float(fast.density(fplan).mean())
            frec_mean = frec_min = None
            if with_recall:
                rec = fast.recall(q, k, fplan, scale=scale)
                frec_mean, frec_min = float(rec.mean()), float(rec.min())
            rows.append(bench.Row(f"flexprefill_vs L{layer}", "sparseprefill", n, fdens, frec_mean, frec_min,
                            est_ms + ker_ms, est_ms, 4 * head_dim * fdens * causal_pairs / (est_ms + ker_ms) / 1e9,
                            cudnn_ms / (est_ms + ker_ms), {"estimate_index_ms": est_ms, "kernel_ms": ker_ms}))
            del fplan
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(bench.Row(f"shareprefill total ({layers} layers)", "sparseprefill", n,
                        float("nan"), None, None, totals["ours"], None, float("nan"),
                        totals["cudnn"] / totals["ours"], {"cudnn_ms": totals["cudnn"],
                                                           "pattern_counts": state.pattern_counts()}))
        del stack
    return rows


def _suite(seqlens: list[int], *, flex: bool = True, **kwargs: Any) -> list[bench.Row]:
    return run_shareprefill_suite(seqlens, **kwargs)


METHOD = register(Method(
    check=keyword_check(check_share_params),
    name="shareprefill",
    knobs=("gamma", "tau", "delta"),
    notes="SharePrefill (one layer, fresh state: first head per cluster dense, others Alg. 5); "
          "layers share pivots through SharePrefillState",
    reference_plan=reference.shareprefill_plan,
    fast_plan=fast.shareprefill_plan,
    reference_run=reference.shareprefill,
    fast_run=fast.shareprefill,
    defaults=lambda n: {},
    sweep=lambda n: [{"gamma": g} for g in (0.8, 0.85, 0.9, 0.95, 0.98)],
    calibration=lambda n: [{"gamma": g} for g in MASS_CALIBRATION],
    new_state=new_state,
    coupled_heads="each cluster's first head with d_sparse < delta runs dense and pivots the cluster's other "
                  "heads (Alg. 3/4): one head's gamma changes what its cluster shares",
    reference_layer=reference.shareprefill_layer,
    fast_layer=fast.shareprefill_layer,
    sync=SyncStatus(
        syncs=("decision: the per-head walk of Alg. 3/4 on the host reads the [B, Hq] distances, both "
               "in one transfer (reference choose_patterns); its patterns stay on the host for the dispatch "
               "(fast HostLayerDecision)",
               "plan: both padded line widths in one transfer (padded_lines_many)",
               "plan: the dense and shared heads' block lists (mask_to_list)",
               "vertical-slash heads: the index width (counting pass)",
               "plan and attention: which heads are dense or shared (nonzero().tolist(), int()) from the host "
               "copy of the patterns: a read of a CPU tensor, no device read on a GPU"),
        capture_safe=False,
        note="the pattern of each head is decided on the host from the data (and copied to the device "
             "from pinned memory); the dense heads' passes depend on it"),
    bench=BenchSuite(
        about="a synthetic multi-layer prefill, per layer, split into decision / plan / sparse heads / dense "
              "pivots / pivot build, with the FlexPrefill-style fallback and cuDNN",
        seqlens=(32768, 131072), run=_suite,
        arguments=(BenchArgument("--layers", "layers", int, 8, "shareprefill: layers of the stack"),)),
))
