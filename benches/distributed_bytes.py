"""Context-parallel bytes moved per method on captured SmolLM2 attention, against a dense ring.

For each captured layer (SmolLM2-135M, N = 8192, 9 query / 3 KV heads, D = 64, fp16)
and each plan-based registered method at its demo parameters for N = 8192:

* accounting (one process, W = 2, 4, 8, 16): the method's reference plan, split
  over a `ZigZagLayout(8192, W, 128)`; `rank_fetch_bytes` gives the K/V rows and
  the ask bits every rank would move; `ring_bytes` what ring attention moves;
* measured (gloo, W = 2 and 4 processes spawned here): `context_parallel_plan`
  (the distributed estimate, its bytes counted) and `KVFetch` (the real exchange)
  on the rank's shards; every rank checks that its plan rows equal the one-process
  plan's rows exactly, and the summed `Traffic` is checked against the accounting.

Long N (accounting only, no data needed): dense, streaming and A-shape at 256K and 1M
tokens with the GPU bench's shapes (32 / 8 heads, D = 128, bf16), W = 2, 4, 8.

Estimates: dense, streaming and A-shape move nothing; vertical-slash and
block-sparse have distributed estimates; the other methods all-gather q and k
(`estimate="gather"`), which costs more than a dense ring: their `kv` column is what
a distributed estimate of theirs would leave to move.

Usage (CPU, a few minutes on 2 cores):
    python benches/distributed_bytes.py --qkv /work/captures/qkv_smollm2_8k.pt \\
        --json benches/results/cpu-distributed-2026-11-23.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparseprefill import distributed as D
from sparseprefill.methods import METHODS
from sparseprefill.reference.metrics import density

ALIGN = 128
ACCOUNT_WORLDS = (2, 4, 8, 16)
MEASURED_WORLDS = (2, 4)
# Shape-only methods at the GPU bench's sizes (no data needed): B = 1, 32 / 8 heads, D = 128, bf16.
LONG_SEQLENS = (262144, 1048576)
LONG_METHODS = ("dense", "streaming", "a_shape")


def plan_methods() -> list[str]:
    return [name for name, spec in METHODS.items() if spec.plan_based]


def one_process_plan(method: str, q: torch.Tensor, k: torch.Tensor) -> Any:
    spec = METHODS[method]
    params = spec.call_params(spec.demo_params(q.shape[2]), q)
    return spec.plan_fn("reference")(q, k, **params)


def _worker(rank: int, world: int, store: str, qkv: str, methods: list[str], out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    data = torch.load(qkv)
    results: dict[str, Any] = {}
    for li, layer in enumerate(data["layers"]):
        q, k, v = data["q"][li], data["k"][li], data["v"][li]
        n = q.shape[2]
        layout = D.ZigZagLayout(n, world, ALIGN)
        qs, ks, vs = (layout.shard(x, rank) for x in (q, k, v))
        for method in methods:
            spec = METHODS[method]
            traffic = D.Traffic()
            t0 = time.perf_counter()
            try:
                rp = D.context_parallel_plan(qs, ks, method=method, params=spec.demo_params(n), layout=layout,
                                             traffic=traffic)
            except (TypeError, ValueError) as exc:  # the same on every rank: no collective is left hanging
                results[f"{layer}/{method}"] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            D.KVFetch(ks, vs, rp.remote, layout, traffic=traffic).finish(
                torch.zeros(1, k.shape[1], n, k.shape[3], dtype=k.dtype),
                torch.zeros(1, k.shape[1], n, k.shape[3], dtype=k.dtype))
            seconds = time.perf_counter() - t0
            want = D.split_plan(one_process_plan(method, q, k), layout, rank)
            same = bool(rp.plan.equal(want.plan))
            total = traffic.reduced()
            results[f"{layer}/{method}"] = {"traffic": total.as_dict(), "rows_equal": same,
                                            "estimate": rp.estimate, "seconds": seconds}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def measure(qkv: str, world: int, methods: list[str]) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "store"), qkv, methods, tmp), nprocs=world)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]


def long_accounting() -> dict[str, Any]:
    """Bytes of the shape-only plans at 256K and 1M (the `fast` O(N) plans), W = 2, 4, 8."""
    from sparseprefill import fast

    out: dict[str, Any] = {"shape": {"batch": 1, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "itemsize": 2},
                           "rows": []}
    for n in LONG_SEQLENS:
        q = torch.zeros((), dtype=torch.bfloat16).expand(1, 32, n, 128)
        k = torch.zeros((), dtype=torch.bfloat16).expand(1, 8, n, 128)
        for method in LONG_METHODS:
            params = METHODS[method].demo_params(n)
            plan = getattr(fast, f"{method}_plan")(q, k, **params)
            for world in (2, 4, 8):
                layout = D.ZigZagLayout(n, world, ALIGN)
                fetched = D.fetch_bytes([D.split_plan(plan, layout, r) for r in range(world)], layout,
                                        kv_heads=8, head_dim=128, itemsize=2)
                ring = D.ring_bytes(layout, batch=1, kv_heads=8, head_dim=128, itemsize=2)
                out["rows"].append({"method": method, "seqlen": n, "world": world, "params": params, **fetched,
                                    "ring": ring, "kv_vs_ring": fetched["kv"] / ring})
                print(f"N={n} {method} W={world}: kv/ring {fetched['kv'] / ring:.3f}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qkv", default="/work/captures/qkv_smollm2_8k.pt")
    parser.add_argument("--json", default="benches/results/cpu-distributed-2026-11-23.json")
    parser.add_argument("--methods", default=",".join(plan_methods()))
    parser.add_argument("--long-only", action="store_true",
                        help="only add the long-N shape-only accounting to an existing --json")
    args = parser.parse_args()
    if args.long_only:
        with open(args.json) as fh:
            existing = json.load(fh)
        existing["long_shape_only"] = long_accounting()
        with open(args.json, "w") as fh:
            json.dump(existing, fh, indent=1)
        print("wrote", args.json)
        return
    methods = [m for m in args.methods.split(",") if m]
    data = torch.load(args.qkv)
    layers = list(data["layers"])
    out: dict[str, Any] = {
        "setup": {"qkv": args.qkv, "seqlen": int(data["q"][0].shape[2]), "q_heads": int(data["q"][0].shape[1]),
                  "kv_heads": int(data["k"][0].shape[1]), "head_dim": int(data["q"][0].shape[3]),
                  "dtype": str(data["q"][0].dtype), "layers": layers, "align": ALIGN,
                  "bytes": "payload bytes sent, summed over ranks; all-reduce and all-gather counted as "
                           "their ring algorithms send (2(W-1)/W and W-1 times the tensor per rank)",
                  "ring": "ring attention: every rank's K and V shard sent to the W-1 others"},
        "torch": torch.__version__,
        "methods": {},
    }
    for method in methods:
        kind = D.estimate_kind(method)
        native = METHODS[method].distributed
        needs = native.needs if native is not None and kind != "gather" else D.GATHER_NEEDS
        out["methods"][method] = {"estimate": kind, "estimate_needs": needs,
                                  "params": {key: repr(val) for key, val in METHODS[method].demo_params(8192).items()},
                                  "layers": {}}
    for li, layer in enumerate(layers):
        q, k = data["q"][li], data["k"][li]
        n, hkv, d = q.shape[2], k.shape[1], k.shape[3]
        for method in methods:
            t0 = time.perf_counter()
            try:
                plan = one_process_plan(method, q, k)
                D.ZigZagLayout(n, 2, ALIGN).check_blocks(plan.block_m, plan.block_n)
            except (TypeError, ValueError) as exc:
                out["methods"][method]["error"] = f"{type(exc).__name__}: {exc}"
                print(f"layer {layer} {method}: {exc}", flush=True)
                continue
            entry: dict[str, Any] = {"density": float(density(plan).mean()), "worlds": {}}
            for world in ACCOUNT_WORLDS:
                layout = D.ZigZagLayout(n, world, ALIGN)
                fetched = D.fetch_bytes([D.split_plan(plan, layout, r) for r in range(world)], layout,
                                        kv_heads=hkv, head_dim=d, itemsize=q.element_size())
                ring = D.ring_bytes(layout, batch=1, kv_heads=hkv, head_dim=d, itemsize=q.element_size())
                entry["worlds"][str(world)] = {**fetched, "ring": ring, "kv_vs_ring": fetched["kv"] / ring}
            out["methods"][method]["layers"][str(layer)] = entry
            print(f"layer {layer} {method}: density {entry['density']:.3f}, kv/ring "
                  + ", ".join(f"W={w} {e['kv_vs_ring']:.3f}" for w, e in entry["worlds"].items())
                  + f" ({time.perf_counter() - t0:.1f} s)", flush=True)
    for world in MEASURED_WORLDS:
        t0 = time.perf_counter()
        ranks = measure(args.qkv, world, methods)
        print(f"measured W={world} in {time.perf_counter() - t0:.0f} s", flush=True)
        for key, res in ranks[0].items():
            layer, method = key.split("/")
            if "error" in res or "error" in out["methods"][method]:
                out["methods"][method].setdefault("error", res.get("error"))
                continue
            acc = out["methods"][method]["layers"][layer]["worlds"][str(world)]
            t = res["traffic"]
            assert all(r[key]["rows_equal"] for r in ranks), f"{key} W={world}: plan rows differ"
            assert (t["index"], t["kv"]) == (acc["index"], acc["kv"]), (key, world, t, acc)
            acc["measured"] = {**t, "total_vs_ring": t["total"] / acc["ring"],
                               "rows_equal_one_process": True, "estimate_kind": res["estimate"]}
    for method, entry in out["methods"].items():
        if "error" in entry:
            continue
        summary = {}
        for world in ACCOUNT_WORLDS:
            per = [lay["worlds"][str(world)] for lay in entry["layers"].values()]
            ring = sum(p["ring"] for p in per)
            row = {"kv_vs_ring": sum(p["kv"] for p in per) / ring}
            if all("measured" in p for p in per):
                row["estimate_vs_ring"] = sum(p["measured"]["estimate"] for p in per) / ring
                row["total_vs_ring"] = sum(p["measured"]["total"] for p in per) / ring
            summary[str(world)] = row
        entry["summary_all_layers"] = summary
        print(method, json.dumps(summary))
    out["long_shape_only"] = long_accounting()
    with open(args.json, "w") as fh:
        json.dump(out, fh, indent=1)
    print("wrote", args.json)


if __name__ == "__main__":
    main()
