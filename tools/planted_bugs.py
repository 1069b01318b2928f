"""Planted bugs: does the conformance suite alone catch realistic one-line bugs?

Every entry of `BUGS` is one realistic one-line change to the library (a file, an exact
source snippet, its replacement, a one-line description). For each bug the harness

1. copies the package sources (the folders `pyproject.toml` maps to `sparseprefill.*`)
   and `tests/` into a scratch folder, laid out as the installed package
   (`<tmp>/pkg/sparseprefill/...`), and plants the bug there;
2. runs only conformance properties (`tests/test_conformance.py`) at the CI example
   count (`SPARSEPREFILL_TEST_EXAMPLES`, 12 by default) with `PYTHONPATH=<tmp>/pkg`, so
   Python imports the scratch copy before the editable install of the work tree
   (the `_planted_probe` plugin checks that it did): first the bug's own properties
   (`target_select`: the target method's, or the kernel properties for the shared
   mechanism), and with `--fallback` every property (`test_method_property or
   test_kernel_property`) if those pass;
3. records whether the properties failed, which (method, property) rows failed and at
   which example each first failed (the plugin counts the examples of every row).

Results go to a JSON file, rewritten after every bug (a long run can be stopped and
resumed with `--resume`). The unmodified copy is run first (`--control`) to show the
properties pass without a bug.

    python tools/planted_bugs.py --list
    python tools/planted_bugs.py --check                # every snippet applies exactly once
    python tools/planted_bugs.py --json benches/results/planted-bugs.json [--methods vertical_slash,kernel]
    python tools/planted_bugs.py --bugs kernel-causal-off-by-one --examples 100

One bug costs one run of its own properties: about a minute on 2 idle CPU cores for a
method, two for the kernel (less when a property fails early). See docs/planted-bugs.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROPERTY_TESTS = "test_method_property or test_kernel_property"
# Targets in the shared mechanism: the kernel properties (random plans, masks, resumed
# state, block means, non-finite inputs, plan validation) are their conformance.
SHARED_TARGETS = ("kernel", "plan", "metrics", "state")


def target_select(target: str, also: str = "") -> str:
    """The pytest -k expression of a bug's own properties: the kernel properties for the
    shared mechanism, else the target method's properties (ids `[<method>-<property>]`),
    plus the properties of the methods in `also`."""
    if target in SHARED_TARGETS:
        own = "test_kernel_property"
    else:
        # pytest -k matches substrings: leave out the methods whose names contain the target's
        # (`xattention` in `delta_xattention`).
        from sparseprefill.conformance import METHODS

        longer = sorted(m for m in METHODS if target in m and m != target)
        own = f"(test_method_property and {target}{''.join(f' and not {m}' for m in longer)})"
    methods = [m for m in also.split(",") if m]
    if not methods:
        return own.strip("()")
    return f"{own} or (test_method_property and ({' or '.join(methods)}))"


@dataclass(frozen=True)
class Bug:
    """One planted bug.

    Attributes:
        name: a short id.
        target: the method whose code it changes ("kernel" for the shared block/column
            kernel, "plan" / "metrics" / "state" for shared reference code).
        file: repository-relative path of the file to change.
        snippet: exact source text (its `occurrence`-th appearance is replaced).
        replacement: the text put in its place (one line changes).
        description: one line, what the bug does.
        occurrence: which appearance of `snippet` (1-based); 0 requires exactly one.
        also: methods whose properties also run against it (a kernel feature only a
            method uses, e.g. the per-key bias of Delta-KV), comma-separated.
        kind: its class in the counts (`bug_class`); empty: from the file's place
            ("kernel" under fast/kernels/, "estimator" elsewhere in fast/, "reference"
            under reference/). "state": a bug in what is kept between calls (a host-side
            table, a state carried across layers), whatever its file.
        group: "core" (the harness's first list), or "recent": bugs planted in code
            changed since 2026-11-24 the way an outside check planted them (per-head
            knobs, head groups, online-softmax rescaling in the estimator kernels,
            batch and GQA maps, state between calls).
    """

    name: str
    target: str
    file: str
    snippet: str
    replacement: str
    description: str
    occurrence: int = 0
    also: str = ""
    kind: str = ""
    group: str = "core"


BUG_CLASSES = ("kernel", "estimator", "reference", "shared", "state")


def bug_class(bug: Bug) -> str:
    """The class a bug counts under: its `kind`, else by file ("kernel" for fast/kernels/,
    "shared" for the plan / metrics / state code both packages use, "estimator" for the
    rest of fast/, "reference" for the rest of reference/)."""
    if bug.kind:
        return bug.kind
    if bug.target in SHARED_TARGETS and bug.target != "kernel":
        return "shared"
    if bug.file.startswith("fast/kernels/"):
        return "kernel"
    return "estimator" if bug.file.startswith("fast/") else "reference"


K = "fast/kernels/block_column.py"
LQ = "fast/kernels/last_q_estimate.py"
VI = "fast/kernels/vertical_slash_index.py"
DP = "fast/kernels/delta_pack.py"
XS = "fast/kernels/xattention_score.py"
DS = "fast/kernels/delta_score.py"

BUGS: tuple[Bug, ...] = (
    # -- the block/column kernel ------------------------------------------------------
    Bug("kernel-causal-off-by-one", "kernel", K,
        "b_keep = o_key[None, :] <= o_m[:, None]",
        "b_keep = o_key[None, :] < o_m[:, None]",
        "causal mask of the masked block loop drops the diagonal key (< instead of <=)"),
    Bug("kernel-unmasked-diagonal", "kernel", K,
        "(tail * plan_block_n + plan_block_n - 1 > row0_g)",
        "(tail * plan_block_n > row0_g)",
        "a listed block that starts before the tile's first row but crosses it runs unmasked"),
    Bug("kernel-gqa-head-map", "kernel", K,
        "    i_hkv = i_h // group\n    row0 = i_m * BLOCK_M",
        "    i_hkv = i_h % (num_heads // group)\n    row0 = i_m * BLOCK_M",
        "GQA maps query head h to KV head h % Hkv (interleaved) instead of h // G"),
    Bug("kernel-no-softmax-rescale", "kernel", K,
        "acc = acc * alpha[:, None] + _dot(b_p.to(b_v.dtype), b_v, DOT_F32)",
        "acc = acc + _dot(b_p.to(b_v.dtype), b_v, DOT_F32)",
        "online softmax: the accumulator is not rescaled when the row max grows"),
    Bug("kernel-partial-column-tile-dropped", "kernel", K,
        "for c0 in range(c_start, ccount, BLOCK_N):",
        "for c0 in range(c_start, ccount - BLOCK_N + 1, BLOCK_N):",
        "column loop runs full tiles only: a partial last column tile is skipped"),
    Bug("kernel-subtile-offset", "kernel", K,
        "start_n = kb * plan_block_n + (t % SUB_N) * BLOCK_N",
        "start_n = kb * plan_block_n",
        "unmasked loop forgets the sub-tile offset when plan blocks are wider than the tile (SUB_N > 1)",
        occurrence=1),
    Bug("kernel-masked-loop-in-blocks", "kernel", K,
        "for t in range(n_full, count * SUB_N):",
        "for t in range(n_full, count):",
        "masked loop bound counted in plan blocks, not kernel tiles (SUB_N > 1)"),
    Bug("kernel-prefetch-next-block", "kernel", K,
        "kb_next = tl.load(p_bindex + ((t + 1) // SUB_N) * stride_bik, mask=t + 1 < n_full, other=0)",
        "kb_next = tl.load(p_bindex + (t // SUB_N + 1) * stride_bik, mask=t + 1 < n_full, other=0)",
        "prefetch loads the next plan block at every tile step, not only after the block's last sub-tile"),
    Bug("kernel-column-count-clamp", "kernel", K,
        "ccount = tl.minimum(tl.maximum(ccount, 0), column_width)",
        "ccount = tl.minimum(tl.maximum(ccount, 0), column_width - 1)",
        "column count clamped to width - 1: a full column list loses its last column"),
    Bug("kernel-key-block-clamp", "kernel", K,
        "kb = tl.minimum(tl.maximum(kb, 0), num_key_blocks - 1)",
        "kb = tl.minimum(tl.maximum(kb, 0), num_key_blocks - 2)",
        "masked-loop block index clamped one block short: the last key block is read as the one before"),
    Bug("kernel-column-index-clamp", "kernel", K,
        "i_col = tl.minimum(tl.maximum(i_col, 0), key_len - 1)",
        "i_col = tl.minimum(tl.maximum(i_col, 0), key_len - 2)",
        "column index clamped one key short: a column at the last key N - 1 reads key N - 2",
        occurrence=2),  # the masked tail loop, where a column at key N - 1 always falls
    Bug("kernel-column-group-row", "kernel", K,
        "i_crow = i_qb // column_group",
        "i_crow = i_qb",
        "grouped column lists (column_group > 1) read row i instead of i // g"),
    Bug("kernel-state-m-not-rescaled", "kernel", K,
        'm_i = tl.load(M_ST + o_st, mask=m_row, other=float("-inf")) * K_LOG2E',
        'm_i = tl.load(M_ST + o_st, mask=m_row, other=float("-inf"))',
        "AttentionState resume: m is loaded in natural-log units, not converted to log2"),
    Bug("kernel-lse-log-base", "kernel", K,
        '(m_i + tl.math.log2(l_safe)) * K_LN2)',
        '(m_i + tl.math.log(l_safe)) * K_LN2)',
        "lse adds a natural log of l to a log2 max"),
    Bug("kernel-block-mean-unmasked-sum", "kernel", K,
        "tile_sum = tl.sum(tl.sum(tl.where(b_keep, b_s, 0.0), 1), 0) * sm_scale",
        "tile_sum = tl.sum(tl.sum(b_s, 1), 0) * sm_scale",
        "block means of masked tiles sum the non-causal logits too"),
    Bug("kernel-block-mean-pair-count", "kernel", K,
        "r1 = torch.clamp(r0 + plan.block_m, max=plan.seqlen)",
        "r1 = torch.clamp(r0 + plan.block_m, max=plan.seqlen - 1)",
        "block means: pair count of the last query block misses the last row (off by one)"),
    Bug("kernel-nonfinite-poison-unkept", "kernel", K,
        "poison = tl.maximum(poison, tl.max((b_keep & (key_bad[None, :] > 0)).to(tl.int32), 1))",
        "poison = tl.maximum(poison, tl.max((key_bad[None, :] > 0).to(tl.int32), 1))",
        "a NaN value poisons every row of the tile, not only the rows that keep its key"),
    Bug("kernel-column-in-block-counted", "kernel", K,
        "m_new = m_c & ~covered",
        "m_new = m_c",
        "a column inside a listed block is attended twice (column-in-block test ignored)"),
    Bug("kernel-column-window-pointer", "kernel", K,
        "ptr = ptr + tl.sum((m_w & (b_win < last_blk)).to(tl.int32), 0)",
        "ptr = ptr + tl.sum((m_w & (b_win <= last_blk)).to(tl.int32), 0)",
        "column-in-block window pointer moves past the block the next column tile may fall in"),
    Bug("kernel-head-dim-mask", "kernel", K,
        "m_d = o_d < head_dim\n    m_row = o_l < seqlen",
        "m_d = o_d <= head_dim\n    m_row = o_l < seqlen",
        "head-dim mask off by one: a D that is not a power of two reads one element too many"),
    Bug("kernel-key-bias-dropped", "kernel", K,
        "b_s = b_s * qk_scale + b_bias[None, :]",
        "b_s = b_s * qk_scale",
        "per-key bias (Delta-KV's log run length, padding -inf) not applied", also="delta_kv"),
    # -- vertical-slash: estimate kernel, index kernel, method ---------------------------
    Bug("vs-estimate-no-scale", "vertical_slash", LQ,
        "qk_scale = resolve_scale(scale, shape.head_dim) * LOG2E",
        "qk_scale = (1.0 if scale is None else scale) * LOG2E",
        "last_q estimate without the default 1/sqrt(d) scale"),
    Bug("vs-estimate-vertical-not-causal", "vertical_slash", LQ,
        "m_keep = m_l[:, None] & m_c[None, :] & (o_c[None, :] <= o_r[:, None])",
        "m_keep = m_l[:, None] & m_c[None, :]",
        "vertical scores sum probabilities of keys after the row (no causal mask)", occurrence=1),
    # (Not "the slash kernel without its causal mask": its skewed gather reads only keys at
    # offsets >= 0, so that mask is redundant and the change an equivalent mutant.)
    Bug("vs-estimate-slash-first-row", "vertical_slash", LQ,
        "first = tl.maximum(o0 - (seqlen - rows), 0) // BLOCK_L * BLOCK_L",
        "first = tl.maximum(o0, 0) // BLOCK_L * BLOCK_L",
        "slash kernel skips rows by their estimate index, not their position: last_q < N loses rows"),
    Bug("vs-estimate-lse-not-causal", "vertical_slash", LQ,
        "m_keep = (o_c[None, :] <= o_r[:, None]) & (o_c[None, :] < seqlen)",
        "m_keep = o_c[None, :] < seqlen",
        "the lse pass normalises over every key, not the causal ones"),
    Bug("vs-estimate-lse-tile-short", "vertical_slash", LQ,
        "stop = tl.minimum(start + split_keys, seqlen - rows + i_l * BLOCK_L + BLOCK_L)",
        "stop = tl.minimum(start + split_keys, seqlen - rows + i_l * BLOCK_L)",
        "lse pass stops at the row tile's first row: the tile's own diagonal keys are left out"),
    Bug("vs-estimate-vertical-first-row", "vertical_slash", LQ,
        "first = tl.maximum(i_n * BLOCK_N - (seqlen - rows), 0) // BLOCK_L * BLOCK_L",
        "first = tl.maximum((i_n + 1) * BLOCK_N - (seqlen - rows), 0) // BLOCK_L * BLOCK_L",
        "vertical kernel starts at the first row that sees the key tile's last key, not its first"),
    Bug("vs-estimate-slash-window", "vertical_slash", LQ,
        "window_start = seqlen - rows + l0 - o0 - BLOCK_O + 1",
        "window_start = seqlen - rows + l0 - o0 - BLOCK_O",
        "slash kernel's key window is one key early (skew off by one)"),
    Bug("vs-estimate-split-combine", "vertical_slash", LQ,
        "lse = (m_all + torch.log2((s_part * torch.exp2(m_part - m_all)).sum(dim=1, keepdim=True)))",
        "lse = (m_all + torch.log2(s_part.sum(dim=1, keepdim=True)))",
        "lse of several key splits summed without rescaling each split to the common max"),
    Bug("vs-estimate-gqa-lse", "vertical_slash", LQ,
        "i_hkv = i_h // group",
        "i_hkv = i_h % (num_heads // group)",
        "the lse pass maps query head h to KV head h % Hkv", occurrence=1),
    Bug("vs-index-first-block-rounded-up", "vertical_slash", VI,
        "first = tl.maximum(r0 - off, 0) // block_n",
        "first = (tl.maximum(r0 - off, 0) + block_n - 1) // block_n",
        "slash range one block short: its first, partly covered key block is rounded away"),
    Bug("vs-index-range-blocks", "vertical_slash", VI,
        "RANGE_BLOCKS=(block_m - 1) // block_n + 2, CHUNK=_CHUNK, WRITE=True",
        "RANGE_BLOCKS=(block_m - 1) // block_n + 1, CHUNK=_CHUNK, WRITE=True",
        "fill pass writes one block too few per slash range (the count pass counts them)"),
    Bug("vs-index-vertical-last-row", "vertical_slash", VI,
        "last_row.expand(b, h, qb).contiguous(), right=True,",
        "last_row.expand(b, h, qb).contiguous(), right=False,",
        "a vertical on a query block's last row is forgotten (searchsorted left, not right)"),
    Bug("vs-index-bisect-strict", "vertical_slash", VI,
        "right = live & (v <= r1 - 1)",
        "right = live & (v < r1 - 1)",
        "the walk's bisection start skips a slash on the query block's last row"),
    Bug("vs-index-chunk-carry", "vertical_slash", VI,
        "last_before = tl.where(o_t == t0, last_prev, last_before)",
        "last_before = tl.where(o_t == 0, last_prev, last_before)",
        "the first slash of every later chunk forgets the previous chunk's last block"),
    Bug("vs-index-slash-reach", "vertical_slash", VI,
        "reach = m_t & (off <= r1 - 1)",
        "reach = m_t & (off < r1 - 1)",
        "a slash that reaches only the query block's last row is ignored"),
    Bug("vs-last-vertical-dropped", "vertical_slash", "fast/vertical_slash.py",
        "verticals = top_lines(vertical, n_vertical, init_columns)",
        "verticals = top_lines(vertical, n_vertical - 1, init_columns)",
        "one vertical fewer than the budget is kept"),
    Bug("vs-slashes-forced-by-init-columns", "vertical_slash", "fast/vertical_slash.py",
        "slashes = top_lines(slash, n_slash, local_diagonals)",
        "slashes = top_lines(slash, n_slash, init_columns)",
        "slashes forced with init_columns instead of local_diagonals (copy-paste)"),
    Bug("vs-head-group-kv-slice", "vertical_slash", "fast/vertical_slash.py",
        "kv0, kv1 = h0 // g, (h1 - 1) // g + 1",
        "kv0, kv1 = h0 // g, h1 // g",
        "planning heads in groups (plans over PLAN_BYTES): a group inside one KV head gets no keys"),
    Bug("vs-reference-estimate-diagonal", "vertical_slash", "reference/vertical_slash.py",
        "causal = torch.arange(n, device=q.device)[None, :] <= row_ids[:, None]",
        "causal = torch.arange(n, device=q.device)[None, :] < row_ids[:, None]",
        "reference estimate leaves out each row's own key"),
    # -- block-sparse -----------------------------------------------------------------
    Bug("bs-tail-mean", "block_sparse", "fast/block_sparse.py",
        "parts.append(tail.sum(dim=2, keepdim=True, dtype=torch.float32) / (n - full * block_size))",
        "parts.append(tail.sum(dim=2, keepdim=True, dtype=torch.float32) / block_size)",
        "the last, partial block is averaged over block_size tokens, not its real ones"),
    Bug("bs-gqa-pooled", "block_sparse", "fast/block_sparse.py",
        "q_pooled = mean_pooling(q, bs).reshape(b, hkv, g, nb, -1)",
        "q_pooled = mean_pooling(q, bs).reshape(b, g, hkv, nb, -1)",
        "pooled queries grouped [G, Hkv] instead of [Hkv, G] (interleaved GQA)"),
    Bug("bs-chunk-query-index", "block_sparse", "fast/block_sparse.py",
        "query_block = torch.arange(i0, i1, device=dev)[:, None]",
        "query_block = torch.arange(i1 - i0, device=dev)[:, None]",
        "score chunks (over _SCORE_BYTES) use chunk-local query-block indices for the causal mask"),
    Bug("bs-diagonal-pushed-out", "block_sparse", "fast/block_sparse.py",
        "picked = torch.where(picked > query_block, nb, picked)",
        "picked = torch.where(picked >= query_block, nb, picked)",
        "the diagonal block is treated as non-causal and dropped"),
    Bug("bs-count-off-by-one", "block_sparse", "fast/block_sparse.py",
        "count = torch.clamp(torch.arange(1, nb + 1, device=dev), max=width)",
        "count = torch.clamp(torch.arange(nb, device=dev), max=width)",
        "query block i lists min(top_k, i) blocks instead of min(top_k, i + 1)"),
    # -- streaming / A-shape ---------------------------------------------------------
    Bug("streaming-window-off-by-one", "streaming", "fast/streaming.py",
        "window_first = torch.clamp((first_row - window - bn + 1) // bn + 1, min=0)",
        "window_first = torch.clamp((first_row - window - bn) // bn + 1, min=0)",
        "window's first key block off by one when the window edge falls on a block's last key"),
    Bug("streaming-sink-rounded-down", "streaming", "fast/streaming.py",
        "sink_blocks = torch.clamp(torch.full_like(causal, cdiv(sink, bn)), max=causal)",
        "sink_blocks = torch.clamp(torch.full_like(causal, sink // bn), max=causal)",
        "a partial sink block is dropped (sink // bn instead of cdiv)"),
    Bug("streaming-last-row-unclamped", "streaming", "fast/streaming.py",
        "last_row = (first_row + bm - 1).clamp(max=n - 1)",
        "last_row = first_row + bm - 1",
        "last query block's last row not clamped to N - 1: blocks past N are listed"),
    Bug("streaming-reference-window", "streaming", "reference/streaming.py",
        "in_window = key_last > first_row - window",
        "in_window = key_last >= first_row - window",
        "reference keeps one key block too many at the window edge"),
    Bug("a-shape-block-sizes-swapped", "a_shape", "fast/a_shape.py",
        "return streaming(q, k, v, sink=sink, window=window, block_m=block_m, block_n=block_n, scale=scale)",
        "return streaming(q, k, v, sink=sink, window=window, block_m=block_n, block_n=block_m, scale=scale)",
        "a_shape passes block_m and block_n swapped"),
    Bug("a-shape-window-is-sink", "a_shape", "fast/a_shape.py",
        "return streaming_plan(q, k, sink=sink, window=window, block_m=block_m, block_n=block_n)",
        "return streaming_plan(q, k, sink=sink, window=sink, block_m=block_m, block_n=block_n)",
        "a_shape_plan passes sink as the window (copy-paste)"),
    # -- dense ------------------------------------------------------------------------
    Bug("dense-key-blocks-floor", "dense", "fast/dense.py",
        "qb, kb = cdiv(n, bm), cdiv(shape.key_len, bn)",
        "qb, kb = cdiv(n, bm), shape.key_len // bn",
        "dense plan counts key blocks with floor division: the partial last block is missing"),
    Bug("dense-last-row-one-past", "dense", "fast/dense.py",
        "last_row = ((torch.arange(qb, device=q.device) + 1) * bm - 1).clamp(max=n - 1)",
        "last_row = ((torch.arange(qb, device=q.device) + 1) * bm).clamp(max=n - 1)",
        "dense plan's causal horizon one row too far: a non-causal key block is listed"),
    # -- shared plan, metrics, state ---------------------------------------------------
    Bug("plan-validate-order", "plan", "reference/plan.py",
        "bad = step_valid & (index[..., 1:] <= index[..., :-1])",
        "bad = step_valid & (index[..., 1:] < index[..., :-1])",
        "validate() accepts repeated entries (checks order, not strict order)"),
    Bug("plan-validate-count-width", "plan", "reference/plan.py",
        "    bad = (count < 0) | (count > width)\n",
        "    bad = count < 0\n",
        "validate() checks list counts against 0 only, not against the list width"),
    Bug("plan-dense-mask-not-causal", "plan", "reference/plan.py",
        "        return rows & causal\n",
        "        return rows\n",
        "to_dense_mask() forgets causality (golden and reference see future keys)"),
    Bug("plan-causal-pairs", "plan", "reference/plan.py",
        "ramp = ramp_rows * (a + 1 - k0) + ramp_rows * (ramp_rows - 1) // 2",
        "ramp = ramp_rows * (a - k0) + ramp_rows * (ramp_rows - 1) // 2",
        "causal_pairs undercounts the diagonal (fast density and block means)"),
    Bug("metrics-recall-not-causal", "metrics", "reference/metrics.py",
        "probs = torch.softmax(scores.masked_fill(~causal, -math.inf), dim=-1)",
        "probs = torch.softmax(scores, dim=-1)",
        "reference recall normalises over every key, not the causal ones"),
    Bug("metrics-density-columns-inside", "metrics", "fast/metrics.py",
        "cvalid = cvalid & ~columns_inside_blocks(",
        "cvalid = cvalid & columns_inside_blocks(",
        "fast density counts the columns inside listed blocks instead of those outside"),
    Bug("metrics-recall-full-pass-scale", "metrics", "fast/metrics.py",
        "_, lse_full = block_column_attention(q, k, k, full, scale=scale, return_lse=True,",
        "_, lse_full = block_column_attention(q, k, k, full, return_lse=True,",
        "fast recall's full causal pass ignores an explicit scale"),
    Bug("state-reference-acc-not-rescaled", "state", "reference/attention.py",
        "acc_new = acc_all[:, :, :, start:stop].to(torch.float64) * rescale.unsqueeze(-1) \\",
        "acc_new = acc_all[:, :, :, start:stop].to(torch.float64) \\",
        "reference resume: the saved accumulator is not rescaled to the new max"),
    # -- MInference (per-head dispatch; the merge is shared by both packages) -------------
    Bug("minference-merge-shared-any", "minference", "reference/minference.py",
        "shared = all(t.shape[3] == 0 or t.stride(2) == 0 for t in indices)",
        "shared = any(t.shape[3] == 0 or t.stride(2) == 0 for t in indices)",
        "merge keeps one list row per head when any (not every) plan shares its lists over query blocks"),
    Bug("minference-merge-first-heads", "minference", "reference/minference.py",
        "index = torch.cat([padded[i][:, h0:h1] for h0, h1, i in runs], dim=1)",
        "index = torch.cat([padded[i][:, : h1 - h0] for h0, h1, i in runs], dim=1)",
        "merge copies a pattern's first heads' lists, not the heads it owns"),
    Bug("minference-merge-disjoint-any", "minference", "reference/minference.py",
        "columns_disjoint=all(p.columns_disjoint or p.column_index.shape[3] == 0 for p in used),",
        "columns_disjoint=any(p.columns_disjoint or p.column_index.shape[3] == 0 for p in used),",
        "merged plan promises disjoint columns when any (not every) part does"),
    Bug("minference-scale-not-forwarded", "minference", "reference/minference.py",
        'kwargs["scale"] = scale',
        'kwargs["scale"] = None',
        "vertical-slash heads estimate with the default scale, not the layer's"),
    Bug("minference-kernel-scale-dropped", "minference", "fast/minference.py",
        "return run_plan(q, k, v, plan, scale=scale)",
        "return run_plan(q, k, v, plan)",
        "fast MInference runs the kernel at the default scale"),
    # -- AnchorAttention ----------------------------------------------------------------
    Bug("anchor-window-from-block-0", "anchor_attention", "fast/anchor_attention.py",
        "start = torch.clamp((i // step) * step * block_m // block_n, min=1)",
        "start = torch.clamp((i // step) * step * block_m // block_n, min=0)",
        "the first group's window starts at block 0, which the anchor already lists (listed twice)"),
    Bug("anchor-pooled-anchor-tail", "anchor_attention", "fast/kernels/anchor_stripes.py",
        "return (padded.reshape(b, h, qb, block_m).sum(dim=3) / sizes.to(torch.float32)).contiguous()",
        "return (padded.reshape(b, h, qb, block_m).sum(dim=3) / block_m).contiguous()",
        "the last, partial query block's anchors are averaged over block_m rows"),
    Bug("anchor-stripes-in-initial-block", "anchor_attention", "fast/kernels/anchor_stripes.py",
        "m_key = (o_k >= block_n) & (o_k < end)",
        "m_key = (o_k >= 0) & (o_k < end)",
        "the stripe search region includes the initial block (its keys attended twice)"),
    Bug("anchor-first-group-skipped", "anchor_attention", "fast/kernels/anchor_stripes.py",
        "g_first = ((k0 // block_n + 1) * block_n + span - 1) // span",
        "g_first = ((k0 // block_n + 1) * block_n + span) // span",
        "the first group whose region reaches a key tile is skipped when its start divides evenly"),
    # (Not "stripe scores from the pooled query's high part only": that 16-bit rounding
    # stays inside the tie check's documented margin, which forgives it by design.)
    Bug("anchor-window-end-unclamped", "anchor_attention", "fast/anchor_attention.py",
        "end = (torch.clamp((i + 1) * block_m, max=seqlen) - 1) // block_n",
        "end = ((i + 1) * block_m - 1) // block_n",
        "the last query block's window is not clamped to N: key blocks past the end are listed"),
    Bug("anchor-reference-region-first-key", "anchor_attention", "reference/anchor_attention.py",
        "return (keys >= block_n) & (keys < end)",
        "return (keys > block_n) & (keys < end)",
        "reference search region leaves out the first key after the initial block"),
    # -- SampleAttention ----------------------------------------------------------------
    Bug("sample-mass-not-causal", "sample_attention", "fast/kernels/sampled_scores.py",
        "m_keep = m_r[:, None] & (o_c[None, :] <= o_r[:, None])",
        "m_keep = m_r[:, None] & (o_c[None, :] < stop_r)",
        "sampled mass of a row counts the later keys of its row tile (no causal mask)"),
    Bug("sample-row-tile-crosses-block", "sample_attention", "fast/kernels/sampled_scores.py",
        "end = min(stop, (r // block_size + 1) * block_size, r + block_l)",
        "end = min(stop, r + block_l)",
        "a row tile may cross a query block: its mass lands on the first block's diagonals"),
    Bug("sample-lse-split-combine", "sample_attention", "fast/kernels/sampled_scores.py",
        "lse = m_safe + torch.log2((s_part * torch.exp2(m_part - m_safe)).sum(dim=1, keepdim=True))",
        "lse = m_safe + torch.log2(s_part.sum(dim=1, keepdim=True))",
        "lse of several key splits summed without rescaling each split to the common max"),
    Bug("sample-slash-diagonal-dropped", "sample_attention", "fast/kernels/sampled_scores.py",
        "diag = torch.where(diag >= 0, diag, kb).expand(b * hq, num_tiles, kb)",
        "diag = torch.where(diag > 0, diag, kb).expand(b * hq, num_tiles, kb)",
        "the main block diagonal's sampled mass is dropped from the slash scores"),
    Bug("sample-index-diagonal-forgotten", "sample_attention", "fast/kernels/sample_index.py",
        "keep = (m_j & ((col != 0) | (slash != 0) | (o_j == i_m))).to(tl.int32)",
        "keep = (m_j & ((col != 0) | (slash != 0))).to(tl.int32)",
        "merge index forgets the always-kept diagonal block"),
    Bug("sample-index-chunk-range", "sample_attention", "fast/kernels/sample_index.py",
        "for j0 in range(0, i_m + 1, CHUNK):",
        "for j0 in range(0, i_m, CHUNK):",
        "merge index loop stops before key block i: query block 0, and one at a chunk multiple, lose the diagonal"),
    # -- Delta-KV -----------------------------------------------------------------------
    Bug("delta-keep-mask-strict", "delta_kv", DP,
        "drop = _tree_sum(diff * diff, LANES, HEAD_DIM) <= t2",
        "drop = _tree_sum(diff * diff, LANES, HEAD_DIM) < t2",
        "keep-mask kernel: a key exactly at the Euclidean threshold is kept (< instead of <=)"),
    Bug("delta-keep-mask-cosine-strict", "delta_kv", DP,
        "similar = tl.where(thr > 0, (dot > 0) & (dot2 >= rhs),",
        "similar = tl.where(thr > 0, (dot > 0) & (dot2 > rhs),",
        "keep-mask kernel: a key exactly at the cosine threshold is kept (> instead of >=)"),
    Bug("delta-reference-keep-strict", "delta_kv", "reference/delta_kv.py",
        "return tree_sum(diff * diff) <= t2",
        "return tree_sum(diff * diff) < t2",
        "reference keep mask: a key exactly at the Euclidean threshold is kept"),
    Bug("delta-safe-block-non-strict", "delta_kv", "fast/delta_kv.py",
        "safe = torch.searchsorted(reach.contiguous(), first_row.contiguous())",
        "safe = torch.searchsorted(reach.contiguous(), first_row.contiguous(), right=True)",
        "phase 1 takes a packed block whose reach equals the query block's first row (<= instead of <)"),
    Bug("delta-timestamps-off-by-one", "delta_kv", DP,
        "stamps = (csum - seg_base - 1).to(torch.int32)",
        "stamps = (csum - seg_base).to(torch.int32)",
        "packed timestamps are run ends + 1 (off by one)"),
    Bug("delta-phase2-last-column", "delta_kv", "fast/delta_kv.py",
        "torch.minimum(self.first_block * bs, last_row + 1) - cut",
        "torch.minimum(self.first_block * bs, last_row) - cut",
        "phase-2 columns stop one key before the query block's last row"),
    Bug("delta-ragged-offsets", "delta_kv", "fast/delta_kv.py",
        "packed.offsets[:-1].contiguous(), plan1,",
        "packed.offsets[1:].contiguous(), plan1,",
        "phase 1 reads each segment at the next segment's offset"),
    # -- XAttention (reference estimator; fast has its own kernels) ------------------------
    Bug("xattention-ref-antidiagonal-not-reversed", "xattention", "reference/xattention.py",
        "k_packed = kg.flip(3).reshape(b, hkv, -1, stride * d)",
        "k_packed = kg.reshape(b, hkv, -1, stride * d)",
        "reference scores the main diagonal of each stride group, not the antidiagonal"),
    Bug("xattention-ref-stride-scale", "xattention", "reference/xattention.py",
        "logit_scale = scale / stride",
        "logit_scale = scale",
        "reference antidiagonal logits not divided by the stride (sharper softmax)"),
    Bug("xattention-ref-group-sees-itself-not", "xattention", "reference/xattention.py",
        "visible = (start[None, :] <= start[:, None]).to(q.device)",
        "visible = (start[None, :] < start[:, None]).to(q.device)",
        "reference: a query group does not see its own key group (< instead of <=)"),
    Bug("xattention-ref-naive-last-token", "xattention", "reference/xattention.py",
        "q_packed = qg[:, :, :, 0]",
        "q_packed = qg[:, :, :, -1]",
        "reference naive ablation scores the last token of every query group, not the first"),
    Bug("xattention-ref-last-group-unclamped", "xattention", "reference/xattention.py",
        "end = torch.minimum(torch.arange(tiles)[:, None] * block + block, torch.tensor(seqlen))",
        "end = torch.arange(tiles)[:, None] * block + block",
        "reference: the last stride group runs past N (its size counts tokens that do not exist)"),
    # -- DPXA (reference anchor-pair scores; fast has its own kernel) ----------------------
    Bug("dpxa-ref-causal-strict", "dpxa", "reference/dpxa.py",
        "causal = torch.arange(r1, device=q.device)[None, :] <= rows[:, None]",
        "causal = torch.arange(r1, device=q.device)[None, :] < rows[:, None]",
        "reference anchor-pair scores drop the diagonal pair (< instead of <=)"),
    Bug("dpxa-ref-query-anchors-ignored", "dpxa", "reference/dpxa.py",
        "pair = q_anchors[:, :, r0:r1].reshape(b, hkv, g, r1 - r0, 1) & k_mask[..., :r1].unsqueeze(-2)",
        "pair = k_mask[..., :r1].unsqueeze(-2)",
        "reference scores every query against the key anchors (the query anchors are ignored)"),
    Bug("dpxa-ref-shift-per-row", "dpxa", "reference/dpxa.py",
        "row_max = scores.amax(dim=(-2, -1), keepdim=True)",
        "row_max = scores.amax(dim=-1, keepdim=True)",
        "reference shifts each query's scores by its own max, which the tile normalisation does not cancel"),
    Bug("dpxa-ref-scale-dropped", "dpxa", "reference/dpxa.py",
        "scores = torch.matmul(q_rows, k64[..., :r1, :].transpose(-1, -2)) * scale",
        "scores = torch.matmul(q_rows, k64[..., :r1, :].transpose(-1, -2))",
        "reference anchor-pair scores are not scaled"),
    Bug("dpxa-ref-gqa-interleaved", "dpxa", "reference/dpxa.py",
        "q_rows = q[:, :, r0:r1].to(torch.float64).reshape(b, hkv, g, r1 - r0, d)",
        "q_rows = q[:, :, r0:r1].to(torch.float64).reshape(b, g, hkv, r1 - r0, d).transpose(1, 2)",
        "reference maps query head h to KV head h % Hkv (interleaved) instead of h // G"),
    # -- DeltaXAttention --------------------------------------------------------------------
    Bug("dxa-fast-block-owner-left", "delta_xattention", "fast/delta_xattention.py",
        "owner = torch.searchsorted(ends, blocks.expand(*ends.shape[:2], width).contiguous(), right=True)",
        "owner = torch.searchsorted(ends, blocks.expand(*ends.shape[:2], width).contiguous())",
        "fast packed plan: a tile's first packed block is credited to the tile before it"),
    Bug("dxa-fast-count-weight-dropped", "delta_xattention", "fast/delta_xattention.py",
        "bias = torch.log(counts) if count_weighted else torch.where(counts > 0, 0.0, -math.inf)",
        "bias = torch.where(counts > 0, 0.0, -math.inf)",
        "fast packed tiles ignore the run lengths (no log-count bias) even when count_weighted"),
    Bug("dxa-fast-exact-tiles-also-packed", "delta_xattention", "fast/delta_xattention.py",
        "packed = modes[:, h0:h1, :, : packing.tiles] == PACKED  # [B, h, T, T - 1]",
        "packed = modes[:, h0:h1, :, : packing.tiles] != 0  # [B, h, T, T - 1]",
        "fast packed plan also lists the exact tiles' anchors (those keys counted twice)"),
    Bug("dxa-fast-packed-tiles-also-exact", "delta_xattention", "fast/delta_xattention.py",
        "exact = tiles_to_plan(modes == EXACT, seqlen=n, block=packing.block)",
        "exact = tiles_to_plan(modes != 0, seqlen=n, block=packing.block)",
        "fast exact plan also lists the packed tiles (their keys counted exactly and through anchors)"),
    Bug("dxa-ref-diagonal-key-dropped", "delta_xattention", "reference/delta_xattention.py",
        "exact = (modes[bi, h, i, key_tile] == EXACT)[None, :] & (pos[None, :] <= pos[r0:r1, None])",
        "exact = (modes[bi, h, i, key_tile] == EXACT)[None, :] & (pos[None, :] < pos[r0:r1, None])",
        "reference exact tiles drop each row's own key (< instead of <=)"),
    # -- FlexPrefill vertical-slash (reference lines; cover_threshold is shared, so not here) --
    Bug("flexvs-ref-slash-shares-unnormalised", "flexprefill_vs", "reference/flexprefill_vs.py",
        "return sum_vertical(a_hat) / total, sum_slash(a_hat) / total",
        "return sum_vertical(a_hat) / total, sum_slash(a_hat)",
        "reference slash shares are not divided by the total (they reach gamma too early)"),
    Bug("flexvs-ref-forced-counts-swapped", "flexprefill_vs", "reference/flexprefill_vs.py",
        "verticals = cover_bands(a_v, heads_gamma, init_columns, line_block)",
        "verticals = cover_bands(a_v, heads_gamma, local_diagonals, line_block)",
        "reference forces local_diagonals first columns instead of init_columns"),
    Bug("flexvs-ref-block-fully-covered", "flexprefill_vs", "reference/flexprefill_vs.py",
        "blocks = wide.reshape(b, h, qb, kb, block_n).any(dim=-1)",
        "blocks = wide.reshape(b, h, qb, kb, block_n).all(dim=-1)",
        "reference lists a key block only when kept slashes cover all of its keys"),
    Bug("flexvs-ref-unkept-slash-padding", "flexprefill_vs", "reference/flexprefill_vs.py",
        "padded = torch.where(slashes, offsets, n)",
        "padded = torch.where(slashes, offsets, 0)",
        "reference pads the slash lists with offset 0 (the main diagonal is always reached)"),
    Bug("flexvs-ref-estimate-default-scale", "flexprefill_vs", "reference/flexprefill_vs.py",
        "a_hat = approximate_attention(q, k, last_q=last_q, scale=resolve_scale(scale, shape.head_dim))",
        "a_hat = approximate_attention(q, k, last_q=last_q, scale=resolve_scale(None, shape.head_dim))",
        "reference estimate ignores an explicit scale"),
    # -- SharePrefill (fast estimate and layer plan) ---------------------------------------
    Bug("share-fast-last-block-not-causal", "shareprefill", "fast/shareprefill.py",
        "causal = torch.arange(start, n, device=q.device)[None, :] <= torch.arange(r0, n, device=q.device)[:, None]",
        "causal = torch.arange(start, n, device=q.device)[None, :] < n",
        "fast a^ pools the last query block's later keys too (no causal mask on the tail)"),
    Bug("share-fast-tail-mean-over-block", "shareprefill", "fast/shareprefill.py",
        "logits[..., full:] = sums / pairs",
        "logits[..., full:] = sums / block_m",
        "fast a^ averages the tail blocks' logits over block_m, not over their causal pairs"),
    Bug("share-fast-scale-on-full-blocks-dropped", "shareprefill", "fast/shareprefill.py",
        'logits[..., :full] = torch.einsum("bhgd,bhjd->bhgj", q_mean, k_mean.to(torch.float64)) * scale',
        'logits[..., :full] = torch.einsum("bhgd,bhjd->bhgj", q_mean, k_mean.to(torch.float64))',
        "fast a^ leaves the fully visible blocks' pooled logits unscaled"),
    Bug("share-fast-dense-heads-not-causal", "shareprefill", "fast/shareprefill.py",
        "masks &= (torch.arange(kb, device=q.device) * bn <= last_row[:, None])",
        "masks &= (torch.arange(kb, device=q.device) * bn <= last_row[:, None] + bn)",
        "fast dense / shared heads list one key block past the causal horizon"),
    Bug("share-fast-vs-last-q-block-n", "shareprefill", "fast/shareprefill.py",
        "q, k, gamma=state.gamma, last_q=state.block_m, init_columns=state.init_columns,",
        "q, k, gamma=state.gamma, last_q=state.block_n, init_columns=state.init_columns,",
        "fast vertical-slash heads estimate from block_n last queries, not block_m"),
    # -- code changed since 2026-11-24, planted the way an outside check did -------------
    Bug("sample-tile-table-key-block", "sample_attention", "fast/kernels/sampled_scores.py",
        "key = (tuple(spans), block_size, block_l, device)",
        "key = (tuple(spans), block_l, device)",
        "the kept tile table is keyed without the block size: a later call with the same "
        "sampled rows and another block size reuses tiles that cross its query blocks",
        kind="state", group="recent"),
    Bug("share-fast-pivot-batch-row", "shareprefill", "fast/shareprefill.py",
        "return {(state.cluster(decision.layer, h), row): construct_pivotal_pattern(",
        "return {(state.cluster(decision.layer, h), 0): construct_pivotal_pattern(",
        "fast pivots are kept under batch row 0: later layers share another row's pivot",
        kind="state", group="recent"),
    Bug("share-ref-pivot-gamma-head0", "shareprefill", "reference/shareprefill.py",
        'block_means[row, h], gamma=state.head_value("gamma", h), seqlen=n, block_m=state.block_m,',
        'block_means[row, h], gamma=state.head_value("gamma", 0), seqlen=n, block_m=state.block_m,',
        "reference pivots are built with query head 0's gamma (per-head gamma), seen by later layers",
        kind="state", group="recent"),
    Bug("anchor-head-group-theta", "anchor_attention", "fast/anchor_attention.py",
        "group_theta = theta[h0:h1] if isinstance(theta, torch.Tensor) else theta",
        "group_theta = theta[: h1 - h0] if isinstance(theta, torch.Tensor) else theta",
        "heads planned in groups (stripe plans over PLAN_BYTES) take the first heads' per-head theta",
        group="recent"),
    Bug("vs-head-group-width", "vertical_slash", "fast/vertical_slash.py",
        "block_width=max(widths[h0:h1]), seqlen=n, block_m=block_m, block_n=block_n))",
        "block_width=max(widths[: h1 - h0]), seqlen=n, block_m=block_m, block_n=block_n))",
        "heads run in groups (plans over PLAN_BYTES) size their block lists by the first heads' widths",
        group="recent"),
    Bug("kernel-col-split-start-rounded-up", "kernel", K,
        "c_start = ((ccount - n_late) // BLOCK_N) * BLOCK_N",
        "c_start = tl.cdiv(ccount - n_late, BLOCK_N) * BLOCK_N",
        "unmasked column tiles (COL_SPLIT) end at a rounded-up tile: a partial tile runs without masks",
        group="recent"),
    Bug("xattention-score-lse-not-rescaled", "xattention", XS,
        "l_i = l_i * tl.math.exp2(m_i - m_shift) + tl.sum(tl.math.exp2(t_lse - m_shift[:, None]), 1)",
        "l_i = l_i + tl.sum(tl.math.exp2(t_lse - m_shift[:, None]), 1)",
        "row log-sum-exp over key steps: the running sum is not rescaled when a later step raises the max",
        group="recent"),
    Bug("xattention-score-head-offset", "xattention", XS,
        "i_h = head0 + i_bh % num_heads",
        "i_h = i_bh % num_heads",
        "heads scored in groups (scratch over _SCRATCH_BYTES) read the first group's query heads",
        occurrence=1, group="recent"),
    Bug("xattention-select-tau-row-head", "xattention", "fast/xattention.py",
        'row_tau = tau[torch.div(row, tiles, rounding_mode="floor") % h][:, None]',
        'row_tau = tau[torch.div(row, tiles * b, rounding_mode="floor")][:, None]',
        "per-head thresholds indexed as if rows were [H, B] ordered (batch > 1 with per-head thresholds)",
        group="recent"),
    Bug("dpxa-anchor-acc-not-rescaled", "dpxa", DS,
        "acc = acc * tl.math.exp2(m_run - m_shift) + tl.sum(tl.where(hot, r_sum[:, None], 0.0), 0)",
        "acc = acc + tl.sum(tl.where(hot, r_sum[:, None], 0.0), 0)",
        "anchor-pair sums are not rescaled when a later chunk of anchors raises the running max",
        group="recent"),
    Bug("dpxa-score-gqa-interleaved", "dpxa", DS,
        "i_h = i_hkv * group + i_g",
        "i_h = i_g * num_kv_heads + i_hkv",
        "anchor scoring maps (KV head, group member) to query head G-major (interleaved GQA)",
        group="recent"),
    Bug("dpxa-score-batch-dropped", "dpxa", DS,
        "i_bh = i_b * num_heads + i_h",
        "i_bh = i_h",
        "anchor scoring reads and writes every batch row's anchors and weights at row 0's",
        group="recent"),
)


def bug_by_name() -> dict[str, Bug]:
    out: dict[str, Bug] = {}
    for bug in BUGS:
        if bug.name in out:
            raise ValueError(f"duplicate bug name {bug.name}")
        out[bug.name] = bug
    return out


# -- planting -----------------------------------------------------------------------------


def package_dirs(root: Path) -> dict[str, str]:
    """`[tool.setuptools.package-dir]` of pyproject.toml: package -> folder."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    dirs: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    return dirs


def packaged_path(rel: str, dirs: dict[str, str]) -> Path:
    """Where repository file `rel` lands in the installed layout (`sparseprefill/...`)."""
    best = max((folder for folder in dirs.values() if rel.startswith(folder + "/")), key=len)
    package = next(name for name, folder in dirs.items() if folder == best)
    return Path(*package.split(".")) / rel[len(best) + 1:]


def apply(text: str, bug: Bug) -> str:
    """`text` with the bug's snippet replaced; raises if the snippet is not where it should be."""
    count = text.count(bug.snippet)
    if bug.occurrence == 0 and count != 1:
        raise ValueError(f"{bug.name}: snippet found {count} times in {bug.file}, expected once")
    which = max(bug.occurrence, 1)
    if count < which:
        raise ValueError(f"{bug.name}: snippet found {count} times in {bug.file}, need occurrence {which}")
    at = -1
    for _ in range(which):
        at = text.index(bug.snippet, at + 1)
    return text[:at] + bug.replacement + text[at + len(bug.snippet):]


def make_copy(root: Path, dest: Path) -> Path:
    """Copy the package sources in the installed layout and tests/ into `dest`; return pkg root."""
    dirs = package_dirs(root)
    pkg = dest / "pkg"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name, folder in sorted(dirs.items(), key=lambda kv: kv[0].count(".")):
        target = pkg / Path(*name.split("."))
        src = root / folder
        target.mkdir(parents=True, exist_ok=True)
        for item in src.iterdir():
            if item.is_file() and item.suffix in (".py", ".typed"):
                shutil.copy2(item, target / item.name)
    shutil.copytree(root / "tests", dest / "tests", ignore=ignore)
    shutil.copy2(root / "pyproject.toml", dest / "pyproject.toml")
    return pkg


def plant(root: Path, dest: Path, bug: Bug | None) -> Path:
    pkg = make_copy(root, dest)
    if bug is not None:
        path = pkg / packaged_path(bug.file, package_dirs(root))
        path.write_text(apply(path.read_text(), bug))
    return pkg


# -- running -------------------------------------------------------------------------------


def run_one(root: Path, bug: Bug | None, *, examples: int, timeout: float, select: str,
            python: str, keep: bool) -> dict[str, Any]:
    """Plant `bug` (None: the control run) in a scratch copy and run the properties there."""
    tmp = Path(tempfile.mkdtemp(prefix="planted-"))
    try:
        pkg = plant(root, tmp, bug)
        probe = tmp / "probe.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pkg), str(ROOT / "tools")]),
               "TRITON_INTERPRET": "1", "SPARSEPREFILL_TEST_EXAMPLES": str(examples),
               "PLANTED_PROBE_OUT": str(probe), "PLANTED_PROBE_ROOT": str(pkg),
               "PYTHONDONTWRITEBYTECODE": "1"}
        cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_planted_probe",
               "tests/test_conformance.py", "-k", select, "-rf", "--tb=line"]
        t0 = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
            rc, out = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as err:
            rc = None
            out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        seconds = time.monotonic() - t0
        rows = json.loads(probe.read_text()) if probe.exists() else {}
        current = Path(str(probe) + ".current")
        running = current.read_text() if current.exists() else None
        caught = {key: rec for key, rec in rows.items() if rec["failed_at"] is not None}
        summary = [line for line in out.splitlines() if re.search(r"\d+ (passed|failed)", line)]
        result: dict[str, Any] = {
            "bug": bug.name if bug else "control",
            "rc": rc,
            "seconds": round(seconds, 1),
            "caught": bool(caught) or (rc not in (0, None) and rc != 5),
            "caught_by": {key: {"example": rec["failed_at"], "of": rec["examples"], "error": rec["error"]}
                          for key, rec in sorted(caught.items())},
            "first_example": min((rec["failed_at"] for rec in caught.values()), default=None),
            "rows_run": len(rows),
            "summary": summary[-1] if summary else out.strip().splitlines()[-1:] ,
        }
        if rc is None:
            result["timed_out_in"] = running
        elif rc < 0 or (rc not in (0, 1) and not caught):
            result["crashed_in"] = running
            result["tail"] = out[-2000:]
        return result
    finally:
        if keep:
            print(f"  kept {tmp}", flush=True)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def markdown_table(payload: dict[str, Any]) -> str:
    """The results of a `--json` file as a markdown table, in `BUGS` order: bug, target,
    verdict, the property that failed first (fewest examples), every property that
    failed (`method/property@example`), seconds."""
    bugs = payload["bugs"]
    order = {name: i for i, name in enumerate(bugs)}
    rows = ["| bug | target | caught | first property (examples) | every failing property@example | s |",
            "| --- | --- | --- | --- | --- | ---: |"]
    for r in sorted(payload["results"], key=lambda r: order.get(r["bug"], -1)):
        by = r["caught_by"]
        first = min(by.items(), key=lambda kv: (kv[1]["example"], kv[0]), default=None)
        first_s = f"{first[0]} ({first[1]['example']})" if first else "-"
        every = ", ".join(f"{k}@{v['example']}" for k, v in sorted(by.items())) or "-"
        target = bugs[r["bug"]]["target"] if r["bug"] in bugs else "-"
        verdict = ("yes" if r["caught"] else "**no**") if r["bug"] != "control" else \
            ("**failed**" if r["caught"] else "passed")
        rows.append(f"| `{r['bug']}` | {target} | {verdict} | {first_s} | {every} | {r['seconds']:.0f} |")
    return "\n".join(rows) + "\n"


def summary_table(payloads: list[dict[str, Any]]) -> str:
    """Caught / run per bug class (`bug_class`) of one results payload, or of several side by
    side (before and after a change): only bugs present in every payload count, so the
    columns compare the same bugs; the control run is left out."""
    names = bug_by_name()
    results = [{r["bug"]: r for r in p["results"] if r["bug"] != "control"} for p in payloads]
    common = [n for n in names if all(n in r for r in results)]
    head = "| class | bugs | " + " | ".join(f"caught ({p.get('commit', '?')}, {p.get('examples', '?')} ex.)"
                                           for p in payloads) + " |"
    rows = [head, "| --- | ---: |" + " ---: |" * len(payloads)]
    for cls in (*BUG_CLASSES, "all"):
        members = [n for n in common if cls == "all" or bug_class(names[n]) == cls]
        if not members:
            continue
        counts = [sum(bool(r[n]["caught"]) for n in members) for r in results]
        rows.append(f"| {cls} | {len(members)} | " + " | ".join(str(c) for c in counts) + " |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="list the bugs and exit")
    p.add_argument("--table", type=Path, default=None, help="print a --json file as a markdown table; exit")
    p.add_argument("--check", action="store_true", help="check every snippet applies; exit")
    p.add_argument("--bugs", default="", help="comma-separated bug names (default: all)")
    p.add_argument("--methods", default="", help="comma-separated targets (kernel, vertical_slash, ...)")
    p.add_argument("--group", default="", help="only the bugs of this group (core, recent)")
    p.add_argument("--classes", default="", help=f"only the bugs of these classes ({', '.join(BUG_CLASSES)})")
    p.add_argument("--scope", choices=("own", "all"), default="own",
                   help="own: each bug's own properties (`target_select`); all: every conformance "
                        "property, as `python -m sparseprefill.conformance` runs them (slower)")
    p.add_argument("--summary", type=Path, nargs="+", default=None,
                   help="print caught / run per bug class of one --json file, or of two (before, after); exit")
    p.add_argument("--examples", type=int, default=int(os.environ.get("SPARSEPREFILL_TEST_EXAMPLES", "12")))
    p.add_argument("--select", default="", help="pytest -k expression for every bug (default: the bug's "
                   "own properties first (`target_select`), every property if those miss it)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per bug")
    p.add_argument("--json", type=Path, default=None, help="write results here (after every bug)")
    p.add_argument("--resume", action="store_true", help="skip bugs already in --json")
    p.add_argument("--control", action="store_true", help="first run the unmodified copy")
    p.add_argument("--keep", action="store_true", help="keep the scratch copies")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--fallback", action="store_true",
                   help="run every property on a bug its own properties miss")
    p.add_argument("--snapshot", action="store_true",
                   help="plant into a copy of the checkout taken now (keep editing while it runs)")
    args = p.parse_args(argv)

    if args.table is not None:
        print(markdown_table(json.loads(args.table.read_text())), end="")
        return 0
    if args.summary is not None:
        print(summary_table([json.loads(path.read_text()) for path in args.summary]), end="")
        return 0
    bugs = list(BUGS)
    names = bug_by_name()
    if args.bugs:
        wanted = [b for b in args.bugs.split(",") if b]
        unknown = [b for b in wanted if b not in names]
        if unknown:
            print(f"unknown bugs: {unknown}", file=sys.stderr)
            return 2
        bugs = [names[b] for b in wanted]
    if args.methods:
        targets = set(args.methods.split(","))
        bugs = [b for b in bugs if b.target in targets]
    if args.group:
        bugs = [b for b in bugs if b.group == args.group]
    if args.classes:
        classes = set(args.classes.split(","))
        bugs = [b for b in bugs if bug_class(b) in classes]
    if args.list:
        for b in bugs:
            print(f"{b.name:<40} {b.target:<15} {b.file}: {b.description}")
        return 0
    root = ROOT
    dirs = package_dirs(root)
    for b in bugs:
        apply((root / b.file).read_text(), b)
        packaged_path(b.file, dirs)
    if args.check:
        print(f"{len(bugs)} bugs: every snippet applies")
        return 0

    results: list[dict[str, Any]] = []
    if args.json is not None and args.resume and args.json.exists():
        results = json.loads(args.json.read_text())["results"]
    done = {r["bug"] for r in results}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    if dirty:
        commit += "+uncommitted"
    if args.snapshot:
        snap = Path(tempfile.mkdtemp(prefix="planted-snapshot-"))
        for folder in {*dirs.values(), "tests"}:
            shutil.copytree(ROOT / folder, snap / folder, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        shutil.copy2(ROOT / "pyproject.toml", snap / "pyproject.toml")
        root = snap
        print(f"snapshot of {commit} in {snap}", flush=True)

    def save() -> None:
        if args.json is None:
            return
        payload = {"commit": commit, "examples": args.examples,
                   "select": args.select or ("every property" if args.scope == "all" else "per target"),
                   "bugs": {b.name: asdict(b) for b in BUGS}, "results": results}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=1) + "\n")

    todo: list[Bug | None] = ([None] if args.control and "control" not in done else [])
    todo += [b for b in bugs if b.name not in done]
    for bug in todo:
        name = bug.name if bug else "control"
        print(f"{name} ...", flush=True)
        own = PROPERTY_TESTS if bug is None or args.scope == "all" else target_select(bug.target, bug.also)
        select = args.select or own
        result = run_one(root, bug, examples=args.examples, timeout=args.timeout, select=select,
                         python=args.python, keep=args.keep)
        result["select"] = select
        result["commit"] = commit
        if bug is not None and args.fallback and not result["caught"] and not args.select \
                and select != PROPERTY_TESTS:
            print(f"  missed by {select!r}; every property ...", flush=True)
            result = run_one(root, bug, examples=args.examples, timeout=args.timeout,
                             select=PROPERTY_TESTS, python=args.python, keep=args.keep)
            result["select"] = PROPERTY_TESTS
            result["commit"] = commit
        results = [r for r in results if r["bug"] != name] + [result]
        save()
        by = ", ".join(f"{k}@{v['example']}" for k, v in result["caught_by"].items()) or "-"
        verdict = ("FAILED" if result["caught"] else "passed") if bug is None else \
            ("CAUGHT" if result["caught"] else "MISSED")
        print(f"  {verdict} in {result['seconds']} s by {by}", flush=True)
    if root is not ROOT:
        shutil.rmtree(root, ignore_errors=True)
    missed = [r["bug"] for r in results if r["bug"] != "control" and not r["caught"]]
    control = next((r for r in results if r["bug"] == "control"), None)
    if control is not None and control["caught"]:
        print("control run FAILED: the properties fail without a bug", flush=True)
        return 1
    print(f"{len(results)} runs, missed: {missed or 'none'}", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
