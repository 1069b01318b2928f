"""Run every Triton kernel once at small sizes (for `compute-sanitizer`; GPU only).

Each registered method's fast output function at its demo parameters (B = 2, GQA,
N not a multiple of any block size), plus the block/column kernel with a start
state, block means, a key bias and a dense mask. Prints one line per case; exits 1
if a fast output differs from the float64 reference beyond the tolerance policy.

    compute-sanitizer --tool memcheck --error-exitcode 9 python benches/sanitize_kernels.py [--seqlen 1000]

`--packed` (`python benches/sanitize_kernels.py --packed`): hostile packed
K/V instead. Valid packings (`fast.delta_pack`, `fast.delta_tile_pack`) edited in place
after validation, or built invalid and `mark_valid()`-ed (offsets past the end,
negative or reversed, lengths too long or negative, counts and timestamps at
`+-2**31`), run through `fast.delta_kv_attention` and `fast.delta_xattention_attention`;
and the ragged launcher itself on segments that start at or near the flat buffer's
end with a plan listing every causal block (only the kernel's clamp bounds those
reads). Each case either runs (wrong numbers allowed) or is refused on the host with
ValueError; memcheck must report 0 errors. With `SPARSEPREFILL_GUARD=0` (the kernel's
clamps compiled out) the ragged cases read out of bounds, which shows memcheck sees
them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from sparseprefill import fast, reference
from sparseprefill.methods import METHODS


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _copy_packed(p: fast.PackedKV) -> fast.PackedKV:
    """A deep copy of a packing, marked valid (as the packers leave it)."""
    return fast.PackedKV(k=p.k.clone(), v=p.v.clone(), counts=p.counts.clone(), timestamps=p.timestamps.clone(),
                         offsets=p.offsets.clone(), lengths=p.lengths.clone(), seqlen=p.seqlen,
                         block=p.block).mark_valid()


PACKED_EDITS: dict[str, Callable[[fast.PackedKV], object]] = {
    "offsets past the end": lambda p: p.offsets[1:].add_(10**6),
    "offsets negative": lambda p: p.offsets.sub_(10**6),
    "offsets reversed": lambda p: p.offsets.copy_(p.offsets.flip(0)),
    "offsets of one segment past the next": lambda p: p.offsets[1].add_(3 * p.block + 5),
    "lengths too long": lambda p: p.lengths.fill_(2**31 - 1),
    "lengths negative": lambda p: p.lengths.fill_(-(2**31)),
    "counts huge": lambda p: p.counts.fill_(2**31 - 1),
    "counts negative": lambda p: p.counts.fill_(-(2**31)),
    "timestamps negative": lambda p: p.timestamps.fill_(-(2**31)),
    "timestamps past N": lambda p: p.timestamps.fill_(2**31 - 1),
    "timestamps reversed": lambda p: p.timestamps.copy_(p.timestamps.flip(0)),
}


def _attempt(label: str, fn: Callable[[], torch.Tensor], dev: torch.device) -> None:
    try:
        out = fn()
        _sync(dev)
        print(f"{label:60s} ran, out finite={bool(torch.isfinite(out).all())}", flush=True)
    except ValueError as err:
        print(f"{label:60s} refused on the host: {str(err)[:90]}", flush=True)


def packed_cases(dev: torch.device, n: int) -> int:
    """The hostile packed K/V cases of `packed` mode (see the module doc)."""
    from sparseprefill.fast.kernels.block_column import ragged_block_column_attention
    from sparseprefill.reference.delta_xattention import EXACT, PACKED

    gen = torch.Generator(device="cpu").manual_seed(1)
    q = torch.randn(2, 4, n, 64, generator=gen).to(dev, torch.float16)
    base = torch.randn(2, 2, n // 4 + 1, 64, generator=gen).repeat_interleave(4, dim=2)[:, :, :n]
    k = (base + 0.05 * torch.randn(2, 2, n, 64, generator=gen)).to(dev, torch.float16)
    v = torch.randn(2, 2, n, 64, generator=gen).to(dev, torch.float16)
    packed = fast.delta_pack(k, v, fast.delta_keep_mask(k, threshold=2.0, chunk=64), block=64)
    _attempt("delta_kv, valid packing", lambda: fast.delta_kv_attention(q, k, v, packed, block_m=64), dev)
    for label, edit in PACKED_EDITS.items():
        p = _copy_packed(packed)
        edit(p)
        _attempt(f"delta_kv, {label}", lambda p=p: fast.delta_kv_attention(q, k, v, p, block_m=64), dev)
    tiles = fast.delta_tile_pack(k, v, delta_threshold=2.0, block=128, packed_block=32)
    t = -(-n // 128)
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    modes = torch.where(i == j, EXACT, torch.where(j < i, PACKED, 0)).to(torch.int8).to(dev).expand(2, 4, t, t)
    _attempt("delta_xattention, valid packing",
             lambda: fast.delta_xattention_attention(q, k, v, modes, tiles), dev)
    for label, edit in PACKED_EDITS.items():
        p = _copy_packed(tiles.packed)
        edit(p)
        hostile = fast.TilePackedKV(packed=p, batch=tiles.batch, kv_heads=tiles.kv_heads, seqlen=tiles.seqlen,
                                    block=tiles.block).mark_valid()
        _attempt(f"delta_xattention, {label}",
                 lambda h=hostile: fast.delta_xattention_attention(q, k, v, modes, h), dev)
    # The ragged launcher alone: its host check allows offsets in [0, T]; a plan over all
    # N keys of each segment then reaches past T unless the kernel bounds the reads.
    plan = fast.dense_plan(q, q, block_m=64, block_n=64)
    total = packed.k.shape[0]
    bias = torch.zeros(total, device=dev)
    for label, start in (("segments start at T", total), ("segments start at T - 1", total - 1),
                         ("segments start at T - 100", total - 100), ("segments start at 0", 0)):
        offs = torch.full((4,), start, dtype=torch.int64, device=dev)
        _attempt(f"ragged kernel, {label}, dense plan",
                 lambda o=offs: ragged_block_column_attention(q, packed.k, packed.v, o, plan, key_bias=bias)[0],
                 dev)
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu runs the same under TRITON_INTERPRET=1")
    parser.add_argument("--seqlen", type=int, default=1000, help="N, a multiple of no block size (default 1000)")
    parser.add_argument("--packed", action="store_true", help="the hostile packed K/V cases instead")
    args = parser.parse_args(argv)
    dev = torch.device(args.device)
    if args.packed:
        return packed_cases(dev, args.seqlen)
    gen = torch.Generator(device="cpu").manual_seed(0)
    n, bad = args.seqlen, 0
    q = torch.randn(2, 4, n, 64, generator=gen).to(dev, torch.float16)
    k = torch.randn(2, 2, n, 64, generator=gen).to(dev, torch.float16)
    v = torch.randn(2, 2, n, 64, generator=gen).to(dev, torch.float16)
    for spec in METHODS.values():
        params = spec.call_params(spec.demo_params(n), q)
        out = spec.run_fn("fast")(q, k, v, **params)
        _sync(dev)
        print(f"{spec.name:18s} out finite={bool(torch.isfinite(out).all())}", flush=True)
    # The slash kernel's other tiles and its memory skew (SLASH_CONFIG), and the index walk
    # without its bisection start (SKIP_UNREACHED): the defaults ran above.
    from sparseprefill.fast.kernels import last_q_estimate as lq
    from sparseprefill.fast.kernels import vertical_slash_index as vsi

    saved = lq.SLASH_CONFIG, vsi.SKIP_UNREACHED, vsi.INDEX_BY
    try:
        for config, skip, by in (((64, 64, 4, 2, 0), False, "walk"), ((32, 32, 4, 2, 3), True, "walk"),
                                 ((16, 16, 4, 2, 5), True, "blocks")):
            lq.SLASH_CONFIG, vsi.SKIP_UNREACHED, vsi.INDEX_BY = config, skip, by
            fast.vertical_slash_plan(q, k, vertical_size=64, slash_size=64, last_q=50, block_m=64, block_n=64)
            _sync(dev)
            print(f"slash config {config}, index {by} skip {skip} ran", flush=True)
    finally:
        lq.SLASH_CONFIG, vsi.SKIP_UNREACHED, vsi.INDEX_BY = saved
    plan = fast.vertical_slash_plan(q, k, vertical_size=64, slash_size=64, last_q=64, block_m=64, block_n=64)
    state = fast.AttentionState.empty(2, 4, n, 64, device=dev)
    means = torch.empty(2, 4, plan.num_query_blocks, plan.num_key_blocks, device=dev)
    fast.sparse_attention(q, k, v, plan, state=state, block_mean_out=means)
    bias = torch.randn(2, 2, n, generator=gen).to(dev)
    from sparseprefill.fast.kernels import block_column_attention

    block_column_attention(q, k, v, plan, key_bias=bias)
    # A NaN in V: the kernel copy with the non-finite step computes, the other leaves.
    v_nan = v.clone()
    v_nan[1, 0, 7, 3] = float("nan")
    out_nan, _ = block_column_attention(q, k, v_nan, plan)
    _sync(dev)
    print(f"non-finite V ran; {int(out_nan.isnan().any(-1).sum())} NaN rows", flush=True)
    # The column split's copy picked on the device (`_column_split`: many columns a query
    # block), V finite and not; shared lists past the budget launched in head chunks.
    from sparseprefill.fast.kernels import block_column as bc, own_columns

    wide = fast.vertical_slash_plan(q, k, vertical_size=512, slash_size=64, last_q=64, block_m=64, block_n=64)
    block_column_attention(q, k, v, wide)
    block_column_attention(q, k, v_nan, wide)
    budget = own_columns.DISJOINT_COLUMN_BYTES
    own_columns.DISJOINT_COLUMN_BYTES = 0  # the plan keeps its shared lists
    lines = fast.flexprefill_vs_plan(q, k, gamma=0.95, line_block=1)
    own_columns.DISJOINT_COLUMN_BYTES = lines.batch * lines.num_query_blocks * lines.column_index.shape[3] * 4
    chunk = bc._head_chunk(lines, bc._KernelCall(q, k, v, lines, 0.125, n, True))
    block_column_attention(q, k, v, lines, return_lse=True)
    own_columns.DISJOINT_COLUMN_BYTES = budget
    _sync(dev)
    print(f"column split by the device flag ran; head chunks of {chunk} ran", flush=True)
    # The row-max switch (AnchorAttention's anchors; a column plan too) and the stripe
    # fill from the counting pass's bits, then with the scores recomputed.
    from sparseprefill.fast.kernels import anchor_stripes, block_column_row_max

    fast.anchor_attention_plan(q, k, step=2, block_m=64, block_n=64)
    block_column_row_max(q, k, wide)
    anchor_stripes.STRIPE_BITS = False
    fast.anchor_attention_plan(q, k, step=2, block_m=64, block_n=64)
    anchor_stripes.STRIPE_BITS = True
    _sync(dev)
    print("row max (blocks, columns) and anchor stripes (bits, recomputed) ran", flush=True)
    # Chunked prefill (query_offset) and a packed varlen batch.
    fast.sparse_attention(q[:, :, 300:], k, v, fast.dense_plan(q[:, :, 300:], k))
    fast.sparse_attention(q[:, :, 320:], k, v, plan.rows(320))
    lengths = [100, 1, 400, 499]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    qp, kp, vp = (t[0].transpose(0, 1).contiguous() for t in (q, k, v))
    vplan = fast.varlen_plans(fast.vertical_slash_plan, qp, kp, cu, vertical_size=32, slash_size=32, last_q=32,
                              block_m=64, block_n=64)
    fast.varlen_attention(qp, kp, vp, cu, max(lengths), vplan, return_lse=True)
    _sync(dev)
    print("chunked and varlen ran", flush=True)
    mask = torch.rand(n, n, generator=gen).to(dev) < 0.5
    got = fast.attention(q, k, v, mask)
    want = reference.attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), mask.cpu())
    err = float((got.double().cpu() - want).abs().max())
    bad += err > 2e-2
    _sync(dev)
    print(f"state / block means / key bias / dense mask ran; mask max err {err:.2e}", flush=True)
    if dev.type == "cuda":
        bad += hopper_cases(dev, n)
    return 1 if bad else 0


def hopper_cases(dev: torch.device, n: int) -> int:
    """The Hopper path (`fast.kernels.block_column_hopper`, sm90 only): block plans of
    128- and 64-row blocks at D 128 and 64, a dense plan resumed at a query offset, NaN in
    V, and a column plan with the path's columns switched on; each against the portable
    kernel on the same call. Returns the number of mismatches."""
    from sparseprefill.bench.common import random_block_plan
    from sparseprefill.fast.kernels import block_column_attention, block_column_hopper as hop

    if torch.cuda.get_device_capability(dev)[0] != 9 or not hop._GLUON:
        print("hopper path: not on this GPU (sm90 with Gluon only)", flush=True)
        return 0
    gen = torch.Generator(device="cpu").manual_seed(2)
    bad = 0

    def both(label: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: reference.BlockColumnPlan,
             columns: bool = False) -> None:
        nonlocal bad
        outs = []
        for on in ("1", "0"):
            hop.apply_switches({"HOPPER": on, "HOPPER_COLUMNS": "1" if columns else "0"})
            out, lse = block_column_attention(q, k, v, plan, return_lse=True)
            _sync(dev)
            outs.append((out, lse))
        hop.apply_switches({})
        (a, la), (b, lb) = outs
        same = torch.equal(a.isnan(), b.isnan())
        err = float((a.float() - b.float()).nan_to_num().abs().max())
        if la is not None and lb is not None:
            err = max(err, float((la - lb).nan_to_num().abs().max()))
        bad += (not same) or err > 2e-2
        print(f"hopper {label:48s} max |hopper - portable| (out, lse) {err:.2e}, NaN places equal {same}",
              flush=True)

    for d, bm, bn in ((128, 128, 128), (128, 64, 64), (64, 128, 64)):
        q = torch.randn(2, 4, n, d, generator=gen).to(dev, torch.bfloat16)
        k = torch.randn(2, 2, n, d, generator=gen).to(dev, torch.bfloat16)
        v = torch.randn(2, 2, n, d, generator=gen).to(dev, torch.bfloat16)
        plan = random_block_plan(2, 4, n, density=0.3, block_m=bm, block_n=bn, device=dev, seed=d + bm)
        both(f"random 30% {bm}x{bn} D {d}", q, k, v, plan)
        v_nan = v.clone()
        v_nan[0, 1, n // 3, 5] = float("nan")
        v_nan[1, 0, n - 2, 0] = float("inf")
        both(f"random 30% {bm}x{bn} D {d}, NaN / inf in V", q, k, v_nan, plan)
    both("dense at query offset 300, D 64", q[:, :, 300:], k, v, fast.dense_plan(q[:, :, 300:], k))
    cols = fast.vertical_slash_plan(q, k, vertical_size=64, slash_size=64, last_q=64, block_m=64, block_n=64)
    both("vertical_slash plan, columns on the path", q, k, v, cols, columns=True)
    return bad


if __name__ == "__main__":
    sys.exit(main())
