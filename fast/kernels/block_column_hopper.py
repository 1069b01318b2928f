"""Hopper (sm90) path of the block/column kernel: warp-specialised, persistent, in Gluon.

A sibling of the portable kernel (`block_column.py`), for the calls it supports
(`eligible`): a `BlockColumnPlan` with key blocks (and, with `COLUMNS` on, column lists
disjoint from them), `block_m` and `block_n` multiples of 64, head dim 64 or 128, no
dense mask, state, block means, key bias, ragged or varlen K/V, and K/V tiles that TMA
can read. Anything else runs the
portable kernel, which stays the reference this path is checked against (tests, the
CPU interpreter, other GPUs). docs/hopper-path.md has the picture and the figures.

One program per SM (persistent) walks the 128-row query tiles in a fixed longest-first
order (every head's last query tile first: causal and sorted plans list the most key
tiles there) and splits into partitions (`gl.warp_specialize`):

* producer warps that issue TMA copies: the query tile's two 64-row halves, then the
  listed key tiles' K and V into a ring of `STAGES` shared-memory slots, each with a
  "ready" mbarrier per operand and one "empty" mbarrier; then the listed columns' K and V
  rows, gathered into the same ring with 16-byte `cp.async` copies (TMA has no row gather
  on sm90), each slot released a tile late (`wait_group`, proxy fence, mbarrier);
* two consumer warpgroups, each owning 64 query rows (the default partition and one
  worker), that run S = Q Kᵀ and O += P V on the tensor cores (`wgmma`, P from registers)
  with the online softmax in registers, and release a slot once their P V is done. The
  two warpgroups run independently, so one's softmax overlaps the other's products.
  Where a plan block holds the whole 128-row tile both walk one key stream (one producer,
  slots released by both); with 64-row plan blocks (`SPLIT`) each reads its own plan row
  through its own producer and ring. The query buffer is released after a tile's last
  Q Kᵀ and the output stored from registers, so the next tile's query loads under the
  last P V.

Only the last listed key tiles of a sorted causal list can cross the diagonal: a tile is
masked (key <= row) only where its last key is after the warpgroup's first row.

Non-finite V, the portable kernel's rule (a row that keeps a NaN / inf value reads NaN,
a row that skips its key does not): one pass over V before the kernel (`_nonfinite_parts`,
one word per program, no zeroed flag) says whether V holds one at all; only then do the
consumers test the value tiles some rows skip, in shared memory (one multiply-add per
value), and a tile that holds one has its bad values zeroed in place and the rows that keep
one of its keys poisoned (`_v_repair`). No portable copy, no host synchronisation.

The launcher keeps each compiled kernel and launches it directly (`CompiledKernel.run`),
so a call costs its TMA descriptors and two launches, not Triton's argument binding.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ._common import _capability, tma_ok

try:  # Gluon's Hopper API as shipped in Triton 3.6 (its names moved in later versions).
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Triton 3.6 names the TMA copies `async_copy_*`; later versions `async_load` / `async_store`.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # A barrier of the calling partition's threads: `thread_barrier` in 3.6, `barrier` later.
    _barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    # cp.async gathers: `async_copy_global_to_shared` in 3.6, `async_load` later.
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    _GLUON = hasattr(gl, "warp_specialize")
except ImportError:  # pragma: no cover - depends on the installed Triton
    _GLUON = False

# `SPARSEPREFILL_HOPPER=0` runs the portable kernel everywhere (timing, bisecting).
ENABLED = os.environ.get("SPARSEPREFILL_HOPPER", "1") == "1"
# Tuning switch (docs/hopper-path.md): slots per ring; 0: by head dim (3 slots of 128-key
# K and V tiles fill an H200's shared memory at D 128).
STAGES = int(os.environ.get("SPARSEPREFILL_HOPPER_STAGES", "0"))
# Benchmarking switch only (as the portable kernel's `SPARSEPREFILL_NONFINITE`): `0` drops
# the test of value tiles for NaN / inf. Never turn it off in use.
NONFINITE = os.environ.get("SPARSEPREFILL_NONFINITE", "1") == "1"
# Column plans on this path (`1`), bit-identical to the portable kernel on the H200 but
# slower there on vertical_slash's default plan at 32K (22.65 against 21.11 ms,
# benches/results/hopper-path-h200.json): off, the portable kernel runs them.
COLUMNS = os.environ.get("SPARSEPREFILL_HOPPER_COLUMNS", "0") == "1"
# Registers per thread: every thread's cap at entry (3 warpgroups share 64K), then the
# consumer worker's and the producer's after reallocation (`setmaxnreg`).
# The three warpgroups' counts sum to 3 x MAXNREG (the register file). With column lists
# the producer warp computes a gather's addresses: 56 registers for it, 224 for the
# consumers (at 24 the producer spilled ~1.3 KiB per thread; offline, ptxas 3.6).
MAXNREG = 168
CONSUMER_REGS = int(os.environ.get("SPARSEPREFILL_HOPPER_CONSUMER_REGS", "240"))
PRODUCER_REGS = 3 * MAXNREG - 2 * CONSUMER_REGS
COLUMN_CONSUMER_REGS = 224
COLUMN_PRODUCER_REGS = 3 * MAXNREG - 2 * COLUMN_CONSUMER_REGS

WG_M = 64  # query rows per consumer warpgroup (wgmma's M is 64 per warpgroup)
BLOCK_M = 2 * WG_M
# Programs of the one pass over V that says whether it holds a NaN / inf (`_nonfinite_parts`):
# each writes one word, which every program of the Hopper kernel reads (a 1024-wide load).
MAX_PARTS = 1024
_NONFINITE_BLOCK = 4096


def _flag(text: str) -> bool:
    return text == "1"


# `apply_switches` keys -> (the module attribute each sets, its default, how its text reads).
_SWITCH_SPECS: dict[str, tuple[str, str, Any]] = {
    "HOPPER": ("ENABLED", "1", _flag), "HOPPER_STAGES": ("STAGES", "0", int),
    "HOPPER_NONFINITE": ("NONFINITE", "1", _flag), "HOPPER_COLUMNS": ("COLUMNS", "0", _flag)}
# `apply_switches` keys -> the module attribute each sets.
SWITCHES = {key: attr for key, (attr, _, _) in _SWITCH_SPECS.items()}


def apply_switches(sets: dict[str, str]) -> None:
    """Set this path's switches from a kernel-variant spec (`sparseprefill bench variants
    --variants "name:HOPPER=0"`; `benches/sanitize_kernels.py`).

    Keys (absent: the default): `HOPPER` 1 / 0 (the path on or off: the same call timed on
    the portable kernel), `HOPPER_STAGES` (slots per ring, 0: by shared memory),
    `HOPPER_NONFINITE` 1 / 0 (the value tiles' NaN / inf test; timing only), `HOPPER_COLUMNS`
    1 / 0 (column plans on this path, or the portable kernel: the default). Each setting
    is a constexpr of the kernel or a host decision, so variants compile their own kernels.
    """
    for key, (attr, default, read) in _SWITCH_SPECS.items():
        globals()[attr] = read(sets.get(key, default))


@triton.jit(do_not_specialize=["numel"])
def _nonfinite_parts(X, PARTS, numel, BLOCK: tl.constexpr):
    """`PARTS[p]` = 1 where program p's share of the `numel` values at X holds a NaN or an
    infinity, else 0: no zeroed flag to launch first, no atomics."""
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(tl.program_id(0) * BLOCK, numel, tl.num_programs(0) * BLOCK):
        o_x = tl.arange(0, BLOCK).to(tl.int64) + start  # numel may pass 2**31 (V at 1M tokens)
        # Compared in fp32: Triton's CPU interpreter holds bf16 as raw bits.
        b_x = tl.load(X + o_x, mask=o_x < numel, other=0.0).to(tl.float32)
        bad = bad | ((b_x != b_x) | (tl.abs(b_x) == float("inf"))).to(tl.int32)
    tl.store(PARTS + tl.program_id(0), tl.max(bad, 0))


if _GLUON:
    _K_MAX_PARTS = gl.constexpr(MAX_PARTS)

    @gluon.jit
    def _tile_of(it, num_bh, num_m):
        """Query tile `it` of the longest-first order: every head's last tile, then the one before."""
        i_m = num_m - 1 - it // num_bh
        i_bh = it % num_bh
        return i_m, i_bh

    @gluon.jit
    def _gather_tile(K, V, k_dst, v_dst, k_base, v_base, p_cindex, stride_cik, stride_kn, stride_vn, c0, ccount,
                     key_len, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, GATHER_ROWS: gl.constexpr,
                     g_layout: gl.constexpr):
        """Start copying the K and V rows of columns `c0 ..` of a column list into a slot.

        `cp.async` copies of 16 bytes, `GATHER_ROWS` key rows at a time (TMA has no row
        gather on sm90); columns past the count arrive as zeros (masked copies), and a
        listed index is clamped into the keys, so an edited plan reads wrong rows, never
        out of bounds.
        """
        o_g = gl.arange(0, GATHER_ROWS, layout=gl.SliceLayout(1, g_layout))
        o_gd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, g_layout))
        for r in gl.static_range(BLOCK_N // GATHER_ROWS):
            o_c = c0 + r * GATHER_ROWS + o_g
            m_c = o_c < ccount
            i_col = gl.load(p_cindex + o_c * stride_cik, mask=m_c, other=0)
            i_col = gl.minimum(gl.maximum(i_col, 0), key_len - 1).to(gl.int64)
            # Rows start on 16 bytes (`tma_ok` checked the strides): 16-byte copies.
            k_row = gl.multiple_of(k_base + i_col * stride_kn, 8)
            v_row = gl.multiple_of(v_base + i_col * stride_vn, 8)
            _cp_async(
                k_dst.slice(r * GATHER_ROWS, GATHER_ROWS), K + k_row[:, None] + o_gd[None, :], mask=m_c[:, None])
            _cp_async(
                v_dst.slice(r * GATHER_ROWS, GATHER_ROWS), V + v_row[:, None] + o_gd[None, :], mask=m_c[:, None])

    @gluon.jit
    def _release_gathered(k_ready, v_ready, s):
        """A gathered slot is complete: make its generic-proxy writes visible to the tensor
        cores' (async-proxy) reads, then tell the consumers."""
        fence_async_shared()
        mbarrier.arrive(k_ready.index(s), count=1)
        mbarrier.arrive(v_ready.index(s), count=1)

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty,
                  BLOCK_COUNT, BLOCK_INDEX, stride_bcb, stride_bch, stride_bcm,
                  stride_bib, stride_bih, stride_bim, stride_bik,
                  seqlen, num_m, num_bh, num_heads, group, plan_block_m, plan_block_n, block_width,
                  K, V, COLUMN_COUNT, COLUMN_INDEX, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                  stride_ccb, stride_cch, stride_ccm, stride_cib, stride_cih, stride_cim, stride_cik,
                  column_group, column_width, key_len,
                  BLOCK_N: gl.constexpr, SUB_N: gl.constexpr, STAGES: gl.constexpr, SPLIT: gl.constexpr,
                  HAS_COLUMNS: gl.constexpr, WG: gl.constexpr):
        """Issue the copies: the query halves, the listed key tiles (TMA), then the listed
        columns' rows (gathered, `_gather_tile`) into the ring.

        Shared stream (not SPLIT): both query halves and one key list (both warpgroups' rows
        lie in one plan block). SPLIT: warpgroup WG's half and its own plan row's list, into
        its own ring.
        """
        WG_ROWS: gl.constexpr = q_smem.shape[3]
        HEAD_DIM: gl.constexpr = q_smem.shape[4]
        RING: gl.constexpr = WG * STAGES if SPLIT else 0
        GATHER_ROWS: gl.constexpr = 8
        g_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8],
                                                  threads_per_warp=[32 * 8 // HEAD_DIM, HEAD_DIM // 8],
                                                  warps_per_cta=[1, 1], order=[1, 0])
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        num_tiles = num_m * num_bh
        c = 0
        n_iter = 0
        for it in range(pid, num_tiles, nprog):
            i_m, i_bh = _tile_of(it, num_bh, num_m)
            i_b = i_bh // num_heads
            i_h = i_bh % num_heads
            i_hkv = i_h // group
            row0 = i_m * (2 * WG_ROWS)
            wg_row0 = row0 + WG * WG_ROWS
            # The plan row this stream reads: the warpgroup's own (SPLIT), else the tile's,
            # which both consumers must walk to the end (they release every slot together).
            list_row0 = wg_row0 if SPLIT else row0
            i_qb = list_row0 // plan_block_m
            # The consumers must be done with the previous tile's query buffers.
            mbarrier.wait(q_empty.index(WG), (n_iter & 1) ^ 1)
            if SPLIT:
                mbarrier.expect(q_ready.index(WG), q_desc.block_type.nbytes)
                _tma_load(q_desc, [i_b, i_h, wg_row0, 0], q_ready.index(WG), q_smem.index(WG))
            else:
                mbarrier.expect(q_ready.index(0), 2 * q_desc.block_type.nbytes)
                _tma_load(q_desc, [i_b, i_h, row0, 0], q_ready.index(0), q_smem.index(0))
                _tma_load(q_desc, [i_b, i_h, row0 + WG_ROWS, 0], q_ready.index(0), q_smem.index(1))
            count = 0
            if list_row0 < seqlen:  # a SPLIT tile's second half may lie past the sequence
                count = gl.load(BLOCK_COUNT + i_b * stride_bcb + i_h * stride_bch + i_qb * stride_bcm)
                count = gl.minimum(gl.maximum(count, 0), block_width)
            p_bindex = BLOCK_INDEX + i_b.to(gl.int64) * stride_bib + i_h.to(gl.int64) * stride_bih \
                + i_qb.to(gl.int64) * stride_bim
            for t in range(count * SUB_N):
                kb = gl.load(p_bindex + (t // SUB_N) * stride_bik)
                start_n = kb * plan_block_n + (t % SUB_N) * BLOCK_N
                s = RING + c % STAGES
                ph = (c // STAGES) & 1
                mbarrier.wait(kv_empty.index(s), ph ^ 1)
                mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                _tma_load(k_desc, [i_b, i_hkv, start_n, 0], k_ready.index(s), k_smem.index(s))
                mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                _tma_load(v_desc, [i_b, i_hkv, start_n, 0], v_ready.index(s), v_smem.index(s))
                c += 1
            if HAS_COLUMNS:
                ccount = 0
                if list_row0 < seqlen:
                    ccount = gl.load(COLUMN_COUNT + i_b * stride_ccb + i_h * stride_cch + i_qb * stride_ccm)
                    ccount = gl.minimum(gl.maximum(ccount, 0), column_width)
                p_cindex = COLUMN_INDEX + i_b.to(gl.int64) * stride_cib + i_h.to(gl.int64) * stride_cih \
                    + (i_qb // column_group).to(gl.int64) * stride_cim
                k_base = i_b.to(gl.int64) * stride_kb + i_hkv.to(gl.int64) * stride_kh
                v_base = i_b.to(gl.int64) * stride_vb + i_hkv.to(gl.int64) * stride_vh
                # A slot is released to the consumers one tile late: its copies are awaited
                # (`wait_group(1)`) while the next tile's are in flight.
                s_prev = 0
                for c0 in range(0, ccount, BLOCK_N):
                    s = RING + c % STAGES
                    ph = (c // STAGES) & 1
                    mbarrier.wait(kv_empty.index(s), ph ^ 1)
                    _gather_tile(K, V, k_smem.index(s).reshape([BLOCK_N, HEAD_DIM]),
                                 v_smem.index(s).reshape([BLOCK_N, HEAD_DIM]), k_base, v_base, p_cindex,
                                 stride_cik, stride_kn, stride_vn, c0, ccount, key_len, BLOCK_N, HEAD_DIM,
                                 GATHER_ROWS, g_layout)
                    async_copy.commit_group()
                    if c0 > 0:
                        async_copy.wait_group(1)
                        _release_gathered(k_ready, v_ready, s_prev)
                    s_prev = s
                    c += 1
                if ccount > 0:
                    async_copy.wait_group(0)
                    _release_gathered(k_ready, v_ready, s_prev)
            n_iter += 1

    @gluon.jit
    def _softmax(b_s, m_i, l_i, qk_scale, p_layout: gl.constexpr, dtype: gl.constexpr):
        """One online-softmax step on a key tile's scores `b_s` (skipped keys already -inf).

        Returns P as the P V product's register operand, the rescale `alpha` of the rows'
        output, and the new `(m_i, l_i)`.
        """
        m_new = gl.maximum(m_i, gl.max(b_s, 1) * qk_scale)
        # A row whose kept logits are all -inf so far keeps m = -inf: shift by 0 so exp2 gives 0.
        m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
        b_p = gl.exp2(b_s * qk_scale - m_shift[:, None])
        alpha = gl.exp2(m_i - m_shift)
        l_new = l_i * alpha + gl.sum(b_p, 1)
        return gl.convert_layout(b_p.to(dtype), p_layout), alpha, m_new, l_new

    @gluon.jit
    def _key_start(p_bindex, stride_bik, t, plan_block_n, BLOCK_N: gl.constexpr, SUB_N: gl.constexpr):
        kb = gl.load(p_bindex + (t // SUB_N) * stride_bik)
        return kb * plan_block_n + (t % SUB_N) * BLOCK_N

    @gluon.jit
    def _v_nonfinite(v_buf, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, CHUNK: gl.constexpr,
                     v_layout: gl.constexpr):
        """1 where the value tile in shared memory holds a NaN or an infinity, else 0.

        `x * 0` is NaN exactly for a NaN or an infinity, and NaN survives any sum: one
        multiply-add per value, a chunk of rows at a time, and one test at the end.
        """
        z = gl.zeros([CHUNK, HEAD_DIM], v_buf.dtype, v_layout)
        for i in gl.static_range(BLOCK_N // CHUNK):
            x = v_buf.slice(i * CHUNK, CHUNK).load(v_layout)
            z = z + x * 0.0
        return gl.max(gl.max((z != z).to(gl.int32), 1), 0)

    @gluon.jit
    def _v_repair(v_buf, poison, key_pos, key_ok, o_m, nf_bar, n_rare, BLOCK_N: gl.constexpr,
                  CHUNK: gl.constexpr, SHARED: gl.constexpr, v_layout: gl.constexpr, s_layout: gl.constexpr):
        """A value tile with a NaN / inf: poison the rows that keep one of its keys, zero the bad values.

        The portable kernel's rule for masked tiles: a row that keeps a non-finite value reads
        NaN (`poison`, applied at the end), a row that skips its key must not see it, which
        the P V product would (0 x NaN): the values are zeroed in shared memory first. Keys
        are at positions `key_pos` (a block's range, or a tile's listed columns), `key_ok`
        where listed. With a shared key stream the other warpgroup reads the same slot:
        neither writes before both have read it (`nf_bar`, two arrivals; both warpgroups take
        this branch on the same tiles, as they test the same values). Runs only where V holds
        a non-finite value.
        """
        x = v_buf.load(v_layout)
        z = x * 0.0
        key_bad = gl.convert_layout(gl.max((z != z).to(gl.int32), 1), gl.SliceLayout(0, s_layout))
        keeps_bad = ((key_pos[None, :] <= o_m[:, None]) & key_ok[None, :]) & (key_bad[None, :] > 0)
        poison = gl.maximum(poison, gl.max(keeps_bad.to(gl.int32), 1))
        if SHARED:
            mbarrier.arrive(nf_bar, count=1)
            mbarrier.wait(nf_bar, n_rare & 1)
        for i in gl.static_range(BLOCK_N // CHUNK):
            part = v_buf.slice(i * CHUNK, CHUNK)
            y = part.load(v_layout)
            w = y * 0.0
            part.store(gl.where(w != w, gl.zeros_like(y), y))
        # The zeros are generic-proxy writes the P V product (async proxy) must see.
        fence_async_shared()
        _barrier()
        return poison

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, nf_bar,
                  O, LSE, BLOCK_COUNT, BLOCK_INDEX, stride_bcb, stride_bch, stride_bcm,
                  stride_bib, stride_bih, stride_bim, stride_bik, stride_ob, stride_oh, stride_on,
                  stride_lb, stride_lh,
                  qk_scale, seqlen, q_offset, num_m, num_bh, num_heads, plan_block_m, plan_block_n, block_width,
                  COLUMN_COUNT, COLUMN_INDEX, stride_ccb, stride_cch, stride_ccm, stride_cib, stride_cih, stride_cim,
                  stride_cik, column_group, column_width, V_BAD_PARTS, v_bad_parts,
                  WG: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, SUB_N: gl.constexpr,
                  STAGES: gl.constexpr, RETURN_LSE: gl.constexpr, SPLIT: gl.constexpr, NONFINITE: gl.constexpr,
                  HAS_COLUMNS: gl.constexpr):
        WG_ROWS: gl.constexpr = q_smem.shape[3]
        # SPLIT: this warpgroup's own query barrier pair and ring; else the shared ones.
        RING: gl.constexpr = WG * STAGES if SPLIT else 0
        QB: gl.constexpr = WG if SPLIT else 0
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        # Value tiles read into registers (the non-finite test): 16-byte vectors along D.
        v_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8],
                                                  threads_per_warp=[32 * 8 // HEAD_DIM, HEAD_DIM // 8],
                                                  warps_per_cta=[4, 1], order=[1, 0])
        CHUNK: gl.constexpr = 32
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = q_smem.dtype
        pid = gl.program_id(0)
        nprog = gl.num_programs(0)
        num_tiles = num_m * num_bh
        o_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        o_r = gl.arange(0, WG_ROWS, layout=row_layout)
        o_ro = gl.arange(0, WG_ROWS, layout=o_row_layout)
        o_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        # Does V hold a NaN / inf at all (the launcher's one pass, one word per program of it)?
        # Only then are value tiles tested; read once, the same answer in every partition.
        v_bad = 0
        if NONFINITE:
            p_layout_1d: gl.constexpr = gl.BlockedLayout(size_per_thread=[8], threads_per_warp=[32],
                                                         warps_per_cta=[4], order=[0])
            o_p = gl.arange(0, _K_MAX_PARTS, layout=p_layout_1d)
            v_bad = gl.max(gl.load(V_BAD_PARTS + o_p, mask=o_p < v_bad_parts, other=0), 0)
        c = 0
        n_iter = 0
        n_rare = 0
        for it in range(pid, num_tiles, nprog):
            i_m, i_bh = _tile_of(it, num_bh, num_m)
            i_b = i_bh // num_heads
            i_h = i_bh % num_heads
            row0 = i_m * (2 * WG_ROWS)
            wg_row0 = row0 + WG * WG_ROWS
            # As the producer: with a shared stream both warpgroups walk the tile's list, also
            # the second one where its rows lie past the sequence (nothing of it is stored).
            list_row0 = wg_row0 if SPLIT else row0
            i_qb = list_row0 // plan_block_m
            o_m = q_offset + wg_row0 + o_r
            count = 0
            if list_row0 < seqlen:
                count = gl.load(BLOCK_COUNT + i_b * stride_bcb + i_h * stride_bch + i_qb * stride_bcm)
                count = gl.minimum(gl.maximum(count, 0), block_width)
            p_bindex = BLOCK_INDEX + i_b.to(gl.int64) * stride_bib + i_h.to(gl.int64) * stride_bih \
                + i_qb.to(gl.int64) * stride_bim
            first_row = q_offset + wg_row0
            # Value tiles that some rows of the stream skip (the portable kernel's masked
            # tiles) are tested for NaN / inf: the stream's first row decides, so both
            # warpgroups of a shared stream test the same tiles.
            test_row = q_offset + list_row0
            m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, layout=row_layout)
            l_i = gl.full([WG_ROWS], 0.0, gl.float32, layout=row_layout)
            poison = gl.zeros([WG_ROWS], gl.int32, layout=row_layout)
            acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, layout=o_layout)
            s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, layout=s_layout)
            q_buf = q_smem.index(WG).reshape([WG_ROWS, HEAD_DIM])
            mbarrier.wait(q_ready.index(QB), n_iter & 1)
            for t in range(count * SUB_N):
                s = RING + c % STAGES
                ph = (c // STAGES) & 1
                mbarrier.wait(k_ready.index(s), ph)
                k_buf = k_smem.index(s).reshape([BLOCK_N, HEAD_DIM])
                b_s = warpgroup_mma(q_buf, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                b_s = warpgroup_mma_wait(0, deps=(b_s,))
                start_n = _key_start(p_bindex, stride_bik, t, plan_block_n, BLOCK_N, SUB_N)
                # Sorted causal lists: only a tile whose last key is after the warpgroup's
                # first row needs the causal mask.
                if start_n + BLOCK_N - 1 > first_row:
                    b_s = gl.where((start_n + o_n)[None, :] <= o_m[:, None], b_s, float("-inf"))
                p_op, alpha, m_i, l_i = _softmax(b_s, m_i, l_i, qk_scale, p_layout, dtype)
                acc = acc * gl.convert_layout(alpha, o_row_layout)[:, None]
                mbarrier.wait(v_ready.index(s), ph)
                v_buf = v_smem.index(s).reshape([BLOCK_N, HEAD_DIM])
                if NONFINITE:
                    if v_bad != 0 and start_n + BLOCK_N - 1 > test_row:
                        if _v_nonfinite(v_buf, BLOCK_N, HEAD_DIM, CHUNK, v_layout) != 0:
                            poison = _v_repair(v_buf, poison, start_n + o_n, o_n >= 0, o_m, nf_bar, n_rare,
                                               BLOCK_N, CHUNK, not SPLIT, v_layout, s_layout)
                            n_rare += 1
                acc = warpgroup_mma(p_op, v_buf, acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(kv_empty.index(s), count=1)
                c += 1
            if HAS_COLUMNS:
                # The listed columns, gathered by the producer a tile at a time, after the
                # blocks (the portable kernel's order); each tile masked by the list's count
                # and causality (key <= row).
                ccount = 0
                if list_row0 < seqlen:
                    ccount = gl.load(COLUMN_COUNT + i_b * stride_ccb + i_h * stride_cch + i_qb * stride_ccm)
                    ccount = gl.minimum(gl.maximum(ccount, 0), column_width)
                p_cindex = COLUMN_INDEX + i_b.to(gl.int64) * stride_cib + i_h.to(gl.int64) * stride_cih \
                    + (i_qb // column_group).to(gl.int64) * stride_cim
                for c0 in range(0, ccount, BLOCK_N):
                    s = RING + c % STAGES
                    ph = (c // STAGES) & 1
                    o_c = c0 + o_n
                    m_c = o_c < ccount
                    i_col = gl.load(p_cindex + o_c * stride_cik, mask=m_c, other=0)
                    mbarrier.wait(k_ready.index(s), ph)
                    k_buf = k_smem.index(s).reshape([BLOCK_N, HEAD_DIM])
                    b_s = warpgroup_mma(q_buf, k_buf.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                    b_s = warpgroup_mma_wait(0, deps=(b_s,))
                    b_s = gl.where(m_c[None, :] & (i_col[None, :] <= o_m[:, None]), b_s, float("-inf"))
                    p_op, alpha, m_i, l_i = _softmax(b_s, m_i, l_i, qk_scale, p_layout, dtype)
                    acc = acc * gl.convert_layout(alpha, o_row_layout)[:, None]
                    mbarrier.wait(v_ready.index(s), ph)
                    v_buf = v_smem.index(s).reshape([BLOCK_N, HEAD_DIM])
                    if NONFINITE:
                        # Rows of the stream skip a listed column only past its first row
                        # (unlisted slots arrive as zeros).
                        if v_bad != 0 and gl.max(gl.where(m_c, i_col, -1), 0) > test_row:
                            if _v_nonfinite(v_buf, BLOCK_N, HEAD_DIM, CHUNK, v_layout) != 0:
                                poison = _v_repair(v_buf, poison, i_col, m_c, o_m, nf_bar, n_rare, BLOCK_N,
                                                   CHUNK, not SPLIT, v_layout, s_layout)
                                n_rare += 1
                    acc = warpgroup_mma(p_op, v_buf, acc, is_async=True)
                    acc = warpgroup_mma_wait(0, deps=(acc,))
                    mbarrier.arrive(kv_empty.index(s), count=1)
                    c += 1
            # Every Q Kᵀ of this tile is done: the next tile's query may load (under this
            # tile's last P V); the output is stored from registers.
            mbarrier.arrive(q_empty.index(QB), count=1)
            if NONFINITE:
                acc = gl.where(gl.convert_layout(poison, o_row_layout)[:, None] > 0, float("nan"), acc)
            # Rows with no kept key: output 0 and lse -inf (as the portable kernel).
            l_zero = l_i == 0.0
            l_safe = gl.where(l_zero, 1.0, l_i)
            inv = gl.convert_layout(gl.where(l_zero, 0.0, 1.0 / l_safe), o_row_layout)
            b_o = acc * inv[:, None]
            # A finite input never gives an infinite output (a convex combination of values).
            b_o = gl.where(gl.abs(b_o) == float("inf"), float("nan"), b_o)
            o_l = wg_row0 + o_ro
            p_o = O + i_b.to(gl.int64) * stride_ob + i_h.to(gl.int64) * stride_oh \
                + o_l.to(gl.int64)[:, None] * stride_on + o_d[None, :]
            gl.store(p_o, b_o.to(dtype), mask=(o_l < seqlen)[:, None])
            if RETURN_LSE:
                lse = gl.where(l_zero, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
                o_l2 = wg_row0 + o_r
                p_lse = LSE + i_b.to(gl.int64) * stride_lb + i_h.to(gl.int64) * stride_lh + o_l2
                gl.store(p_lse, lse, mask=o_l2 < seqlen)
            n_iter += 1

    # Integer arguments equal to 1 would be specialised into constants, which cannot be
    # handed to the worker partitions: none is specialised.
    @gluon.jit(do_not_specialize=[
        "stride_bcb", "stride_bch", "stride_bcm", "stride_bib", "stride_bih", "stride_bim", "stride_bik",
        "stride_ob", "stride_oh", "stride_on", "stride_lb", "stride_lh", "seqlen", "q_offset", "num_m",
        "num_bh", "num_heads", "group", "plan_block_m", "plan_block_n", "block_width", "stride_kb", "stride_kh",
        "stride_kn", "stride_vb", "stride_vh", "stride_vn", "stride_ccb", "stride_cch", "stride_ccm",
        "stride_cib", "stride_cih", "stride_cim", "stride_cik", "column_group", "column_width", "key_len",
        "v_bad_parts"])
    def _block_hopper_fwd(q_desc, k_desc, v_desc, O, LSE, BLOCK_COUNT, BLOCK_INDEX,
                          stride_bcb, stride_bch, stride_bcm, stride_bib, stride_bih, stride_bim, stride_bik,
                          stride_ob, stride_oh, stride_on, stride_lb, stride_lh,
                          qk_scale, seqlen, q_offset, num_m, num_bh, num_heads, group,
                          plan_block_m, plan_block_n, block_width,
                          K, V, COLUMN_COUNT, COLUMN_INDEX, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                          stride_vn, stride_ccb, stride_cch, stride_ccm, stride_cib, stride_cih, stride_cim,
                          stride_cik, column_group, column_width, key_len, V_BAD_PARTS, v_bad_parts,
                          BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, SUB_N: gl.constexpr,
                          STAGES: gl.constexpr, RETURN_LSE: gl.constexpr, SPLIT: gl.constexpr,
                          NONFINITE: gl.constexpr, HAS_COLUMNS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                          PRODUCER_REGS: gl.constexpr):
        dtype: gl.constexpr = q_desc.dtype
        # SPLIT (plan blocks of 64 query rows): each consumer warpgroup reads its own plan
        # row, so each has its own producer warp, ring and query barriers.
        RINGS: gl.constexpr = 2 if SPLIT else 1
        q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [RINGS * STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [RINGS * STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [RINGS * STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [RINGS * STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [RINGS * STAGES, 1], mbarrier.MBarrierLayout())
        # The two warpgroups of a shared stream meet here before repairing a value tile.
        nf_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=3 - RINGS)  # a shared buffer waits for both warpgroups
        for i in gl.static_range(RINGS * STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=3 - RINGS)
        mbarrier.init(nf_bar, count=2)
        # (Tuples of partition arguments are written out: a concatenated tuple loses its
        # constexprs in Gluon's front end.)
        if SPLIT:
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, nf_bar,
                             O, LSE, BLOCK_COUNT, BLOCK_INDEX, stride_bcb, stride_bch, stride_bcm,
                             stride_bib, stride_bih, stride_bim, stride_bik, stride_ob, stride_oh, stride_on,
                             stride_lb, stride_lh, qk_scale, seqlen, q_offset, num_m, num_bh, num_heads,
                             plan_block_m, plan_block_n, block_width,
                             COLUMN_COUNT, COLUMN_INDEX, stride_ccb, stride_cch, stride_ccm, stride_cib, stride_cih,
                             stride_cim, stride_cik, column_group, column_width, V_BAD_PARTS, v_bad_parts,
                             0, BLOCK_N, HEAD_DIM, SUB_N, STAGES, RETURN_LSE, SPLIT, NONFINITE,
                             HAS_COLUMNS)),
                (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, nf_bar,
                             O, LSE, BLOCK_COUNT, BLOCK_INDEX, stride_bcb, stride_bch, stride_bcm,
                             stride_bib, stride_bih, stride_bim, stride_bik, stride_ob, stride_oh, stride_on,
                             stride_lb, stride_lh, qk_scale, seqlen, q_offset, num_m, num_bh, num_heads,
                             plan_block_m, plan_block_n, block_width,
                             COLUMN_COUNT, COLUMN_INDEX, stride_ccb, stride_cch, stride_ccm, stride_cib, stride_cih,
                             stride_cim, stride_cik, column_group, column_width, V_BAD_PARTS, v_bad_parts,
                             1, BLOCK_N, HEAD_DIM, SUB_N, STAGES, RETURN_LSE, SPLIT, NONFINITE,
                             HAS_COLUMNS)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                             kv_empty, BLOCK_COUNT, BLOCK_INDEX, stride_bcb, stride_bch, stride_bcm,
                             stride_bib, stride_bih, stride_bim, stride_bik,
                             seqlen, num_m, num_bh, num_heads, group, plan_block_m, plan_block_n, block_width,
                             K, V, COLUMN_COUNT, COLUMN_INDEX, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                             stride_vn, stride_ccb, stride_cch, stride_ccm, stride_cib, stride_cih, stride_cim,
                             stride_cik, column_group, column_width, key_len,
                             BLOCK_N, SUB_N, STAGES, SPLIT, HAS_COLUMNS, 0)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                             kv_empty, BLOCK_COUNT, BLOCK_INDEX, stride_bcb, stride_bch, stride_bcm,
                             stride_bib, stride_bih, stride_bim, stride_bik,
                             seqlen, num_m, num_bh, num_heads, group, plan_block_m, plan_block_n, block_width,
                             K, V, COLUMN_COUNT, COLUMN_INDEX, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                             stride_vn, stride_ccb, stride_cch, stride_ccm, stride_cib, stride_cih, stride_cim,
                             stride_cik, column_group, column_width, key_len,
                             BLOCK_N, SUB_N, STAGES, SPLIT, HAS_COLUMNS, 1)),
            ], [4, 1, 1], [CONSUMER_REGS, PRODUCER_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, nf_bar,
                             O, LSE, BLOCK_COUNT, BLOCK_INDEX, stride_bcb, stride_bch, stride_bcm,
                             stride_bib, stride_bih, stride_bim, stride_bik, stride_ob, stride_oh, stride_on,
                             stride_lb, stride_lh, qk_scale, seqlen, q_offset, num_m, num_bh, num_heads,
                             plan_block_m, plan_block_n, block_width,
                             COLUMN_COUNT, COLUMN_INDEX, stride_ccb, stride_cch, stride_ccm, stride_cib, stride_cih,
                             stride_cim, stride_cik, column_group, column_width, V_BAD_PARTS, v_bad_parts,
                             0, BLOCK_N, HEAD_DIM, SUB_N, STAGES, RETURN_LSE, SPLIT, NONFINITE,
                             HAS_COLUMNS)),
                (_consumer, (q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, nf_bar,
                             O, LSE, BLOCK_COUNT, BLOCK_INDEX, stride_bcb, stride_bch, stride_bcm,
                             stride_bib, stride_bih, stride_bim, stride_bik, stride_ob, stride_oh, stride_on,
                             stride_lb, stride_lh, qk_scale, seqlen, q_offset, num_m, num_bh, num_heads,
                             plan_block_m, plan_block_n, block_width,
                             COLUMN_COUNT, COLUMN_INDEX, stride_ccb, stride_cch, stride_ccm, stride_cib, stride_cih,
                             stride_cim, stride_cik, column_group, column_width, V_BAD_PARTS, v_bad_parts,
                             1, BLOCK_N, HEAD_DIM, SUB_N, STAGES, RETURN_LSE, SPLIT, NONFINITE,
                             HAS_COLUMNS)),
                (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                             kv_empty, BLOCK_COUNT, BLOCK_INDEX, stride_bcb, stride_bch, stride_bcm,
                             stride_bib, stride_bih, stride_bim, stride_bik,
                             seqlen, num_m, num_bh, num_heads, group, plan_block_m, plan_block_n, block_width,
                             K, V, COLUMN_COUNT, COLUMN_INDEX, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh,
                             stride_vn, stride_ccb, stride_cch, stride_ccm, stride_cib, stride_cih, stride_cim,
                             stride_cik, column_group, column_width, key_len,
                             BLOCK_N, SUB_N, STAGES, SPLIT, HAS_COLUMNS, 0)),
            ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


_LAYOUTS: dict[tuple[tuple[int, ...], torch.dtype], Any] = {}


def _smem_layout(block: list[int], dtype: torch.dtype) -> Any:
    key = (tuple(block), dtype)
    if key not in _LAYOUTS:
        _LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16
                                                             else gl.float16)
    return _LAYOUTS[key]


def descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_n: int) -> tuple[Any, ...]:
    """TMA descriptors of q, k and v (`[B, H, N, D]` each, rows past N read as zeros)."""
    d = q.shape[3]
    q_block = [1, 1, WG_M, d]
    kv_block = [1, 1, block_n, d]
    return (TensorDescriptor(q, list(q.shape), list(q.stride()), q_block, _smem_layout(q_block, q.dtype)),
            TensorDescriptor(k, list(k.shape), list(k.stride()), kv_block, _smem_layout(kv_block, k.dtype)),
            TensorDescriptor(v, list(v.shape), list(v.stride()), kv_block, _smem_layout(kv_block, v.dtype)))


_SM_COUNT: dict[int, int] = {}
# An H200's / H100's shared memory per block (227 KiB), less room for the barriers and the
# compiler's scratch; a launch that still does not fit retries with one slot fewer.
_SMEM_BYTES = 227 * 1024 - 2048


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _is_sm90(device: torch.device) -> bool:
    return _capability(device) == (9, 0)


def eligible(call: Any, plan: Any) -> bool:
    """The dispatch rule's host-only part: the call's features and the plan's shapes.

    Never the method and never a device read: head dim 64 or 128, `block_m` a multiple
    of 64 (128: both consumer warpgroups share one key stream; 64: SPLIT, a stream each)
    and `block_n` of 64, column lists only with `COLUMNS` on and where disjoint from the
    blocks (the launcher's `resolve_covered_columns` makes most so), and none of mask, state, block
    means, key bias, ragged or varlen K/V, row max or a head chunk's destination.
    """
    if call.q.shape[3] not in (64, 128):
        return False
    if plan.column_index.shape[3] != 0 and not (COLUMNS and plan.columns_disjoint):
        return False
    if plan.block_m % WG_M != 0 or plan.block_n % 64 != 0:
        return False
    return (call.mask is None and call.state is None and call.block_mean_out is None and call.key_bias is None
            and call.kv_offsets is None and call.varlen is None and call.row_max is None and call.dest is None)


def supports(call: Any, plan: Any) -> bool:
    """Whether this path runs a checked launch (`block_column._KernelCall`) of `plan`.

    `eligible`, on an sm90 GPU with Gluon, `ENABLED`, and q, k, v tiles TMA can read
    (`_common.tma_ok`, the portable launcher's own test).
    """
    if not (_GLUON and ENABLED and call.q.is_cuda):
        return False
    return _is_sm90(call.q.device) and eligible(call, plan) and tma_ok(call.q, call.k, call.v)


# Compiled kernels by everything their compilation depends on (`_launch_key`), launched
# directly; the first call of a key compiles through Triton's JIT.
_COMPILED: dict[tuple[Any, ...], Any] = {}
_INT32 = 2**31


def _launch_key(device: int, dtype: torch.dtype, constexprs: tuple[Any, ...], pointers: tuple[torch.Tensor, ...],
                ints: tuple[int, ...]) -> tuple[Any, ...]:
    """What Triton specialises this kernel on beyond its constexprs: the pointers' 16-byte
    alignment and whether an integer argument needs 64 bits (the descriptors' types follow
    from the dtype and the constexprs; no integer is specialised on its value)."""
    aligned = tuple(t.data_ptr() % 16 == 0 for t in pointers)
    wide = any(not -_INT32 <= x < _INT32 for x in ints)
    return (device, dtype, constexprs, aligned, wide)


def _direct(jit_fn: Any, key: tuple[Any, ...], grid: int, device: int, args: tuple[Any, ...], **options: Any) -> None:
    """Launch `jit_fn` on `grid` programs: the kernel compiled for `key` directly, else through
    Triton's JIT (which compiles it) and keep what it returns for the next call."""
    kernel = _COMPILED.get(key)
    if kernel is not None and triton.knobs.runtime.launch_enter_hook is None:
        kernel.run(grid, 1, 1, triton.runtime.driver.active.get_current_stream(device), kernel.function,
                   kernel.packed_metadata, None, None, None, *args)
        return
    _COMPILED[key] = jit_fn[(grid,)](*args, **options)


def nonfinite_parts(v: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The "V holds a NaN / inf" words the Hopper kernel reads: (int32 `[P]`, P), no host sync.

    One pass over a contiguous V (`_nonfinite_parts`, one launch, no zeroed flag); any other
    layout gets a single word 1, so the kernel tests its value tiles everywhere (correct,
    slower).
    """
    if not v.is_contiguous():
        return torch.ones(1, dtype=torch.int32, device=v.device), 1
    device = v.device.index if v.device.index is not None else torch.cuda.current_device()
    programs = max(1, min(triton.cdiv(v.numel(), _NONFINITE_BLOCK), 4 * _sm_count(v.device), MAX_PARTS))
    parts = torch.empty(programs, dtype=torch.int32, device=v.device)
    flat = v.reshape(-1)
    key = ("parts", device, v.dtype, _launch_key(device, v.dtype, (), (flat,), (v.numel(),)))
    _direct(_nonfinite_parts, key, programs, device, (flat, parts, v.numel(), _NONFINITE_BLOCK), num_warps=8)
    return parts, programs


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
           plan: Any, sm_scale: float) -> None:
    """Launch the Hopper kernel on inputs `supports` accepted; it writes `out` (and `lse`).

    Args:
        q: `[B, Hq, N, D]`; k, v: `[B, Hkv, key_len, D]`; out: `[B, Hq, N, D]` contiguous.
        lse: float32 `[B, Hq, N]` or None.
        plan: the checked `BlockColumnPlan` (column lists disjoint from its blocks).
        sm_scale: the softmax scale.
    """
    b, hq, n, d = q.shape
    split = plan.block_m % BLOCK_M != 0
    # Two rings of 128-key slots would leave one slot each at D 128: SPLIT walks 64-key tiles.
    block_n = 128 if plan.block_n % 128 == 0 and not split else 64
    # Shared memory (227 KiB): the query halves and STAGES slots of a K and a V tile per ring.
    slot = 2 * block_n * d * q.element_size()
    stages = STAGES or min(4, (_SMEM_BYTES - 2 * WG_M * d * q.element_size()) // (slot * (2 if split else 1)))
    stages = max(2, stages)
    descs = descriptors(q, k, v, block_n)
    num_m = triton.cdiv(n, BLOCK_M)
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    grid = min(num_m * b * hq, _sm_count(q.device))
    lse_arg = lse if lse is not None else out
    lse_strides = tuple(lse.stride()[:2]) if lse is not None else (0, 0)
    columns = plan.column_index.shape[3] > 0
    ints = (*plan.block_count.stride(), *plan.block_index.stride(), *out.stride()[:3], *lse_strides,
            n, plan.query_offset, num_m, b * hq, hq, hq // k.shape[1], plan.block_m, plan.block_n,
            plan.block_index.shape[3], *k.stride()[:3], *v.stride()[:3], *plan.column_count.stride(),
            *plan.column_index.stride(), plan.column_group, plan.column_index.shape[3], k.shape[2])
    parts, n_parts = nonfinite_parts(v) if NONFINITE else (plan.block_count, 0)
    ints = (*ints, n_parts)
    pointers = (out, lse_arg, plan.block_count, plan.block_index, k, v, plan.column_count, plan.column_index, parts)
    while True:
        constexprs = (block_n, d, plan.block_n // block_n, stages, lse is not None, split, NONFINITE, columns,
                      COLUMN_CONSUMER_REGS if columns else CONSUMER_REGS,
                      COLUMN_PRODUCER_REGS if columns else PRODUCER_REGS)
        args = (*descs, *pointers[:4], *ints[:12], sm_scale * 1.4426950408889634, *ints[12:21], *pointers[4:8],
                *ints[21:37], parts, n_parts, *constexprs)
        key = _launch_key(device, q.dtype, constexprs, pointers, ints)
        try:
            _direct(_block_hopper_fwd, key, grid, device, args, num_warps=4, maxnreg=MAXNREG)
            return
        except OutOfResources:
            if stages <= 2:
                raise
            stages -= 1
