"""AnchorAttention's plan and its stages beside cuDNN SDPA dense, one version per run (issue 22).

On the bench workload (`estimator_stages.workload`: bf16, B = 1, 32 query / 8 KV heads)
at each N and head dim: cuDNN dense, then `anchor_attention_plan` at its bench default
(`do_bench` median), its share of dense and a hash of its lists (equal hashes, equal
plans across versions), and its stages: the anchor pass (`anchor_maxima`) and the
stripe identification (`stripe_index`: counting pass, one host read, fill pass). Where
the version has them (`fast.anchor_attention.ANCHOR_ROW_MAX`,
`fast.kernels.anchor_stripes.STRIPE_BITS`), every combination of the two switches is
timed, so the earlier designs are measured in the same run:

    PYTHONPATH=before python benches/anchor_plan_time.py --tag before --json before.json
    python benches/anchor_plan_time.py --tag after --json after.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import estimator_stages as es  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqlens", type=int, nargs="*", default=[32768, 131072])
    parser.add_argument("--head-dims", type=int, nargs="*", default=[128])
    parser.add_argument("--cache", default="/tmp/estimator_stages")
    parser.add_argument("--tag", default="after")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from sparseprefill.methods import METHODS

    fa = importlib.import_module("sparseprefill.fast.anchor_attention")
    st = importlib.import_module("sparseprefill.fast.kernels.anchor_stripes")
    switches = [(True, True)]
    if hasattr(fa, "ANCHOR_ROW_MAX") and hasattr(st, "STRIPE_BITS"):
        switches = [(True, True), (False, True), (True, False), (False, False)]
    spec = METHODS["anchor_attention"]
    rows: list[dict[str, Any]] = []
    dev = torch.device("cuda")
    for d in args.head_dims:
        for n in args.seqlens:
            q, k, v = es.workload(n, dev, args.cache, head_dim=d)
            dense_ms, _ = es.cudnn_ms(q, k, v)
            del v
            p = spec.call_params(spec.demo_params(n), q)
            print(f"N={n} D={d} cuDNN dense {dense_ms:.3f} ms; params {p}", flush=True)
            for row_max, bits in switches:
                if len(switches) > 1:
                    fa.ANCHOR_ROW_MAX, st.STRIPE_BITS = row_max, bits
                plan = spec.fast_plan(q, k, **p)
                plan_hash = es._plan_hash(plan)
                del plan
                plan_ms = es._ms(lambda: spec.fast_plan(q, k, **p))
                # The stages at the plan's own sizes.
                step = fa.group_step(p.get("step", fa.STEP), n, p.get("block_m", 128))
                bm, bn = p.get("block_m", 128), p.get("block_n", 128)
                scale = d ** -0.5
                anchor_ms = es._ms(lambda: fa.anchor_maxima(q, k, step=step, block_m=bm, block_n=bn, scale=scale))
                x_a = fa.anchor_maxima(q, k, step=step, block_m=bm, block_n=bn, scale=scale)
                theta = p.get("theta", fa.THETA)
                stripe_ms = es._ms(lambda: st.stripe_index(q, k, x_a, theta=theta, step=step, block_m=bm,
                                                           block_n=bn, scale=scale))
                del x_a
                row = {"tag": args.tag, "seqlen": n, "head_dim": d, "dense_ms": dense_ms,
                       "anchor_row_max": row_max, "stripe_bits": bits, "plan_ms": plan_ms,
                       "share": plan_ms / dense_ms, "anchor_ms": anchor_ms, "stripes_ms": stripe_ms,
                       "plan_hash": plan_hash, "device": torch.cuda.get_device_name()}
                rows.append(row)
                print(f"{args.tag} N={n} D={d} row_max={row_max} bits={bits}: plan {plan_ms:.3f} ms "
                      f"({100 * plan_ms / dense_ms:.1f}% of dense), anchor {anchor_ms:.3f}, "
                      f"stripes {stripe_ms:.3f}, hash {plan_hash[:12]}", flush=True)
                torch.cuda.empty_cache()
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=1)
            del q, k
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
