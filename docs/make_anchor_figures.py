"""Draw the AnchorAttention figure under docs/img/ (run from the repository root).

    python docs/make_anchor_figures.py

One head of the demo's synthetic workload (sinks, local decay, slashes, heavy
key columns; `sparseprefill.demo.synthetic_qkv`) at N = 4096, then the plans of
`reference.anchor_attention_plan`: the anchor blocks alone, and anchor plus stripes
for two `step` values. CPU, about a minute.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from sparseprefill import reference
from sparseprefill._viz import attention_image, plan_image, save_mask_figure
from sparseprefill.demo import Shape, synthetic_qkv

IMG = Path(__file__).resolve().parent / "img"
N, BLOCK, THETA = 4096, 64, 6.0

anchor = importlib.import_module("sparseprefill.reference.anchor_attention")


def main() -> None:
    q, k, _ = synthetic_qkv(Shape(1, 1, 1, N, 64, torch.float16), device=torch.device("cpu"), seed=1)
    panels = [("attention, head 0 (log scale)", attention_image(q[0, 0], k[0, 0], size=512))]
    for step, with_stripes in ((4, False), (4, True), (1, True)):
        plan = reference.anchor_attention_plan(q, k, theta=THETA, step=step, block_m=BLOCK,
                                               block_n=BLOCK)
        if not with_stripes:
            empty = torch.zeros(1, 1, plan.num_column_rows, N, dtype=torch.bool)
            plan = anchor.anchor_plan_from_stripes(empty, seqlen=N, step=step, block_m=BLOCK,
                                                   block_n=BLOCK)
            title = f"anchor blocks only (step {step})"
        else:
            title = f"anchor + stripes, theta {THETA:g}, step {step}"
        dens = float(reference.density(plan)[0, 0])
        rec = float(reference.recall(q, k, plan)[0, 0].mean())
        panels.append((f"{title}\ndensity {dens:.1%}, recall {rec:.3f}", plan_image(plan, size=512)))
    save_mask_figure(panels, IMG / "anchor_attention.png",
                     title=f"AnchorAttention, N = {N}, blocks of {BLOCK}: initial block + group window "
                           "(blocks), stripes shared by each group of step query blocks (columns)")


if __name__ == "__main__":
    main()
