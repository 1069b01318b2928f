"""`sparseprefill._viz.plan_image`: the kept share of one head's plan, as the kernel runs it."""

from __future__ import annotations

import numpy as np
import torch

from sparseprefill import reference
from sparseprefill._viz import plan_image


def test_plan_image_draws_a_dense_marked_head_full_causal() -> None:
    n = 100
    q, k = torch.randn(2, 4, n, 16), torch.randn(2, 2, n, 16)
    plan = reference.streaming_plan(q, k, sink=16, window=16, block_m=16, block_n=16).with_dense_heads([1, 3])
    for b in range(2):
        for h in range(4):
            image = plan_image(plan, batch=b, head=h, size=n)
            kept = plan.to_dense_mask()[b, h].double().numpy()
            below = np.tril(np.ones((n, n), dtype=bool))
            assert np.array_equal(image[below], kept[below]), (b, h)
            assert np.isnan(image[~below]).all()
            assert (h in (1, 3)) == bool((image[below] == 1).all())
