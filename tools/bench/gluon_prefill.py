"""A measurement probe, not a program: attention.blocked's prefill as a Gluon kernel (Hopper).

The committed cuda program (programs/cuda/attention.py) is Triton: its layouts, its
waits on the tensor cores and its register use are the compiler's. This kernel computes the
same arithmetic with each of them written out: the 64-row tile of one warpgroup (wgmma
m64n{block}k16 for QK from shared Q, m64n{D}k16 for PV with P in registers), the key block and
segment of the lanes' contract, the masked block's ``where``s, the in-order segment merges,
``div_rn`` at the end; K and V come by TMA into a ring of shared buffers (each block is
requested two blocks ahead). On the H200 it gives the Triton program's bytes (docs/gpu.md,
"The probes: a Gluon prefill and a split decode"), so it measures what a schedule buys before any
program carries it.

Variants (constexprs of the one tile, ``_tile``, run by one warpgroup a program or by the
warp-specialized kernel's two consumers):
- ``pair``: the unmasked blocks two at a time, both QK products issued before the first
  block's softmax, so the second product's latency hides behind it (4 stages).
- ``ag_global``: the running segment state's accumulator kept in global scratch between
  segments (read and written only by tiles with more than one segment), and the masked block
  split into an all-rows-see-a-key path (no ``where``) and a path that parks the old
  accumulator in scratch: fewer registers (165 against 246).
- ``block``: 64 or 128 keys a block (other lane contracts; compared with the program at the
  same block).
- ``ws``: warp-specialized, FlashAttention-3's division of work without its ping-pong: one
  warp issues every TMA copy into the ring (``empty``/``ready`` barriers), two consumer
  warpgroups each compute one 64-row tile (tiles 2c and 2c + 1 of one kv head, so they share
  K and V), with 240 registers each; ``stages`` 4.
- ``overlap``: FlashAttention-3's overlap inside one warpgroup, on the unmasked blocks: block
  j + 1's QK product is issued, then block j's PV product, and block j + 1's softmax runs
  while the PV product is in flight (``wait_group 1``); 4 stages. The products, sums and
  rescales are the program's, in its order.
- ``heads_fast``: the warp-specialized kernel's grid with the kv head fastest, so programs
  start in order of length over all heads (the longest tiles first, the short ones last).
- ``fast_exp``: NOT the contract, timing only: ``ex2.approx.ftz`` of scores pre-scaled by
  scale * log2(e) (what FlashAttention-3 computes), to show what the contract's exp costs.

The program carries the warp-specialized kernel with the overlap and ``heads_fast`` as its
Hopper prefill (programs/cuda/attention_hopper.py, which also covers what follows); this
probe keeps the variants for comparison.

Not covered here (the program's kernel has them): the device-side position check (trap),
head sizes other than 128, and zeros for the V rows in [pos_max + 1, S), which this probe
reads (the same bytes unless such a V is inf or NaN). Its reference is the program's Triton
kernel (``_HOPPER_PREFILL`` off).

    PYTHONPATH=packages/shared-exact/src python3 tools/bench/gluon_prefill.py [--json F]
    (add --only "A|B" to run the variants whose names contain A or B)
"""

from __future__ import annotations

import argparse
import importlib
import json
import math

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from lockstep_exact.programs import Program
from lockstep_exact.programs.cuda.attention_hopper import load_q_tile, wgmma_layout

# The contract's program parameters (programs.CATALOG), never restated here.
BLOCK = Program.of("attention.blocked").param("block")
SEGMENT = Program.of("attention.blocked").param("segment")


@gluon.jit
def _exp(x, FAST_EXP: gl.constexpr):
    if FAST_EXP:  # not the contract (see the module docstring): x is already in log2 units
        return gl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True, pack=1
        )
    else:
        return gl.exp(x)


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, bars, j, j_last, h, STAGES: gl.constexpr):
    """Request key block j (nothing past j_last) into stage j % STAGES."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = k_desc.block_type.shape[1]
    st = j % STAGES
    ok = j <= j_last
    mbarrier.expect(bars.index(st), 2 * BLOCK_N * D * 2, pred=ok)
    tma.async_copy_global_to_shared(
        k_desc, [j * BLOCK_N, h * D], bars.index(st), k_smem.index(st), pred=ok
    )
    tma.async_copy_global_to_shared(
        v_desc, [j * BLOCK_N, h * D], bars.index(st), v_smem.index(st), pred=ok
    )


@gluon.jit
def _soft(s, m, l_s, scale, FAST_EXP: gl.constexpr, p_op: gl.constexpr, row_o: gl.constexpr):
    """The unmasked step up to the PV product: the new max and sum, P in the PV operand's
    layout, and alpha in the accumulator's row layout."""
    s = s * scale
    m_new = gl.maximum(m, gl.max(s, 1))
    alpha = _exp(m - m_new, FAST_EXP)
    p = _exp(s - m_new[:, None], FAST_EXP)
    l_s = l_s * alpha + gl.sum(p, 1)
    return m_new, l_s, gl.convert_layout(p.to(gl.bfloat16), p_op), gl.convert_layout(alpha, row_o)


@gluon.jit
def _unmasked(s, m, l_s, acc, v_buf, scale, FAST_EXP: gl.constexpr, p_op: gl.constexpr,
              row_o: gl.constexpr):  # fmt: skip
    """One block every row sees whole: the program's unmasked step, PV issued and awaited."""
    m_new, l_s, pb, alpha_o = _soft(s, m, l_s, scale, FAST_EXP, p_op, row_o)
    acc = warpgroup_mma(pb, v_buf, acc * alpha_o[:, None], is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return m_new, l_s, acc


@gluon.jit
def _finish(o_ptr, tile, h, n_rows, stride_ot, stride_oh, a_g, l_g, r_o, c_o,
            G: gl.constexpr, BLOCK_M: gl.constexpr, row_o: gl.constexpr):  # fmt: skip
    l_o = gl.convert_layout(l_g, row_o)
    num, den = gl.broadcast(a_g, l_o[:, None])
    out = gl.div_rn(num, den)
    out = gl.where(out == 0.0, 0.0, out)
    rows_o = tile * BLOCK_M + r_o
    dst = (
        o_ptr
        + (rows_o // G)[:, None] * stride_ot
        + (h * G + rows_o % G)[:, None] * stride_oh
        + c_o[None, :]
    )
    gl.store(dst, out.to(gl.bfloat16), mask=(rows_o < n_rows)[:, None])


@gluon.jit
def _acquire(k_desc, v_desc, k_smem, v_smem, ready, j, j_last, h, STAGES: gl.constexpr,
             WS: gl.constexpr):  # fmt: skip
    """Wait until key block j sits in its stage. Without a producer warp (``WS`` False) this
    warpgroup first requests block j + 2 into the stage of block j - 2 (or j - 1 with 3
    stages), which every warp is past (the barrier)."""
    if not WS:
        gl.thread_barrier()
        _load_kv(k_desc, v_desc, k_smem, v_smem, ready, j + 2, j_last, h, STAGES)
    mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)


@gluon.jit
def _release(empty, j, STAGES: gl.constexpr, WS: gl.constexpr):
    """Hand key block j's stage back to the producer warp (one arrival per consumer)."""
    if WS:
        mbarrier.arrive(empty.index(j % STAGES), count=1)


@gluon.jit
def _pid(axis_of_tiles: gl.constexpr, HEADS_FAST: gl.constexpr):
    """program_id of the grid's tile axis (``axis_of_tiles`` 0) or kv head axis (1): the two
    are swapped when HEADS_FAST."""
    if (axis_of_tiles == 1) != (HEADS_FAST == 1):
        return gl.program_id(1)
    else:
        return gl.program_id(0)


@gluon.jit
def _tile(
    q_ptr, o_ptr, pos_ptr, k_desc, v_desc, q_smem, k_smem, v_smem, ready, empty, ag_ptr,
    park_ptr, slot, tile, n_rows, scale, stride_qt, stride_qh, stride_ot, stride_oh,
    G: gl.constexpr, SEG_BLOCKS: gl.constexpr, STAGES: gl.constexpr, PAIR: gl.constexpr,
    AG_GLOBAL: gl.constexpr, FAST_EXP: gl.constexpr, WS: gl.constexpr, OVERLAP: gl.constexpr,
    HEADS_FAST: gl.constexpr = 0,
):  # fmt: skip
    """The 64-row tile ``tile`` of kv head program_id(1) (program_id(0) with HEADS_FAST),
    written out; returns the key blocks it used (0 .. j_last)."""
    BLOCK_M: gl.constexpr = 64
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = k_desc.block_type.shape[1]
    mma_s: gl.constexpr = wgmma_layout(BLOCK_N)
    mma_o: gl.constexpr = wgmma_layout(D)
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
    col_s: gl.constexpr = gl.SliceLayout(0, mma_s)
    row_o: gl.constexpr = gl.SliceLayout(1, mma_o)
    col_o: gl.constexpr = gl.SliceLayout(0, mma_o)

    h = _pid(1, HEADS_FAST)
    r_o = gl.arange(0, BLOCK_M, layout=row_o)
    c_o = gl.arange(0, D, layout=col_o)
    sc_off = slot + r_o[:, None] * D + c_o[None, :]  # this tile's scratch, in mma_o layout

    load_q_tile(q_ptr, q_smem, tile, h, n_rows, stride_qt, stride_qh, G)

    rows = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
    row_ok = rows < n_rows
    pos = gl.load(pos_ptr + rows // G, mask=row_ok, other=-1).to(gl.int32)
    pos_max = gl.max(pos, 0)
    pos_min = gl.min(gl.where(row_ok, pos, 2147483647), 0)
    j_last = pos_max // BLOCK_N
    j_full = (pos_min + 1) // BLOCK_N
    offs_n = gl.arange(0, BLOCK_N, layout=col_s)
    if not WS:  # before block j is used, blocks up to j + 1 are requested
        for i in gl.static_range(2):
            _load_kv(k_desc, v_desc, k_smem, v_smem, ready, i, j_last, h, STAGES)

    m_g = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_g = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    a_g = gl.zeros([BLOCK_M, D], gl.float32, layout=mma_o)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_s)
    n_seg = j_last // SEG_BLOCKS + 1
    for s_idx in range(0, n_seg):
        j_lo = s_idx * SEG_BLOCKS
        j_hi = gl.minimum(j_lo + SEG_BLOCKS, j_last + 1)
        m = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_s = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        acc = gl.zeros([BLOCK_M, D], gl.float32, layout=mma_o)
        j_one = j_lo
        if PAIR:  # unmasked blocks two at a time, both QK products issued together
            n_pair = gl.maximum(gl.minimum(j_hi, j_full) - j_lo, 0) // 2
            for pi in range(0, n_pair):
                ja = j_lo + 2 * pi
                st_a = ja % STAGES
                st_b = (ja + 1) % STAGES
                if WS:
                    mbarrier.wait(ready.index(st_a), (ja // STAGES) & 1)
                else:  # requests ja + 2 and ja + 3, into the stages of ja - 2 and ja - 1
                    _acquire(k_desc, v_desc, k_smem, v_smem, ready, ja, j_last, h, STAGES, WS)
                    _load_kv(k_desc, v_desc, k_smem, v_smem, ready, ja + 3, j_last, h, STAGES)
                mbarrier.wait(ready.index(st_b), ((ja + 1) // STAGES) & 1)
                s_a = warpgroup_mma(
                    q_smem, k_smem.index(st_a).permute((1, 0)), s_zero, use_acc=False,
                    is_async=True,
                )  # fmt: skip
                s_b = warpgroup_mma(
                    q_smem, k_smem.index(st_b).permute((1, 0)), s_zero, use_acc=False,
                    is_async=True,
                )  # fmt: skip
                s_a = warpgroup_mma_wait(num_outstanding=1, deps=(s_a,))
                m, l_s, acc = _unmasked(
                    s_a, m, l_s, acc, v_smem.index(st_a), scale, FAST_EXP, p_op, row_o
                )
                _release(empty, ja, STAGES, WS)
                s_b = warpgroup_mma_wait(num_outstanding=0, deps=(s_b,))
                m, l_s, acc = _unmasked(
                    s_b, m, l_s, acc, v_smem.index(st_b), scale, FAST_EXP, p_op, row_o
                )
                _release(empty, ja + 1, STAGES, WS)
            j_one = j_lo + 2 * n_pair
        if OVERLAP:  # the unmasked blocks with block j's PV product in flight during block
            # j + 1's QK product and softmax (FlashAttention-3's overlap in one warpgroup)
            j_mid = gl.maximum(j_lo, gl.minimum(j_hi, j_full))
            if j_mid > j_lo:
                _acquire(k_desc, v_desc, k_smem, v_smem, ready, j_lo, j_last, h, STAGES, WS)
                s = warpgroup_mma(
                    q_smem, k_smem.index(j_lo % STAGES).permute((1, 0)), s_zero, use_acc=False,
                    is_async=True,
                )  # fmt: skip
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                m, l_s, pb, alpha_o = _soft(s, m, l_s, scale, FAST_EXP, p_op, row_o)
                for j in range(j_lo, j_mid - 1):
                    _acquire(k_desc, v_desc, k_smem, v_smem, ready, j + 1, j_last, h, STAGES, WS)
                    s = warpgroup_mma(
                        q_smem, k_smem.index((j + 1) % STAGES).permute((1, 0)), s_zero,
                        use_acc=False, is_async=True,
                    )  # fmt: skip
                    acc = warpgroup_mma(
                        pb, v_smem.index(j % STAGES), acc * alpha_o[:, None], is_async=True
                    )
                    s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
                    m, l_s, pb, alpha_o = _soft(s, m, l_s, scale, FAST_EXP, p_op, row_o)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    _release(empty, j, STAGES, WS)
                acc = warpgroup_mma(
                    pb, v_smem.index((j_mid - 1) % STAGES), acc * alpha_o[:, None], is_async=True
                )
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                _release(empty, j_mid - 1, STAGES, WS)
            j_one = j_mid
        for j in range(j_one, j_hi):
            st = j % STAGES
            _acquire(k_desc, v_desc, k_smem, v_smem, ready, j, j_last, h, STAGES, WS)
            s = warpgroup_mma(
                q_smem, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True
            )
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            if j < j_full:
                m, l_s, acc = _unmasked(
                    s, m, l_s, acc, v_smem.index(st), scale, FAST_EXP, p_op, row_o
                )
            elif AG_GLOBAL and pos_min >= j * BLOCK_N:  # every row sees a key of this block
                kpos = j * BLOCK_N + offs_n
                s = gl.where(kpos[None, :] <= pos[:, None], s, float("-inf"))  # then scaled
                m, l_s, acc = _unmasked(
                    s, m, l_s, acc, v_smem.index(st), scale, FAST_EXP, p_op, row_o
                )
            else:
                s = s * scale
                kpos = j * BLOCK_N + offs_n
                s = gl.where(kpos[None, :] <= pos[:, None], s, float("-inf"))
                m_new = gl.maximum(m, gl.max(s, 1))
                active = pos >= j * BLOCK_N
                m_safe = gl.where(active, m_new, 0.0)
                alpha = _exp(m - m_safe, FAST_EXP)
                p = _exp(s - m_safe[:, None], FAST_EXP)
                l_new = l_s * alpha + gl.sum(p, 1)
                pb = gl.convert_layout(p.to(gl.bfloat16), p_op)
                alpha_o = gl.convert_layout(alpha, row_o)
                active_o = gl.convert_layout(active, row_o)
                if AG_GLOBAL:  # park the old accumulator instead of holding two
                    gl.store(park_ptr + sc_off, acc)
                acc_new = warpgroup_mma(pb, v_smem.index(st), acc * alpha_o[:, None], is_async=True)
                acc_new = warpgroup_mma_wait(num_outstanding=0, deps=(acc_new,))
                if AG_GLOBAL:
                    acc = gl.load(park_ptr + sc_off, volatile=True)
                acc = gl.where(active_o[:, None], acc_new, acc)
                m = gl.where(active, m_new, m)
                l_s = gl.where(active, l_new, l_s)
            _release(empty, j, STAGES, WS)
        # fold the segment into the running state (the program's _merge)
        active = pos >= s_idx * (SEG_BLOCKS * BLOCK_N)
        m_new = gl.maximum(m_g, m)
        m_safe = gl.where(active, m_new, 0.0)
        alpha = _exp(m_g - m_safe, FAST_EXP)
        beta = _exp(m - m_safe, FAST_EXP)
        l_g = gl.where(active, l_g * alpha + l_s * beta, l_g)
        m_g = gl.where(active, m_new, m_g)
        alpha_o = gl.convert_layout(alpha, row_o)
        beta_o = gl.convert_layout(beta, row_o)
        active_o = gl.convert_layout(active, row_o)
        if AG_GLOBAL:
            if s_idx > 0:
                a_g = gl.load(ag_ptr + sc_off, volatile=True)
            else:
                a_g = gl.zeros([BLOCK_M, D], gl.float32, layout=mma_o)
        a_g = gl.where(active_o[:, None], a_g * alpha_o[:, None] + acc * beta_o[:, None], a_g)
        if AG_GLOBAL:
            if s_idx + 1 < n_seg:
                gl.store(ag_ptr + sc_off, a_g)
            else:
                _finish(o_ptr, tile, h, n_rows, stride_ot, stride_oh, a_g, l_g, r_o, c_o, G,
                        BLOCK_M, row_o)  # fmt: skip
    if not AG_GLOBAL:
        _finish(o_ptr, tile, h, n_rows, stride_ot, stride_oh, a_g, l_g, r_o, c_o, G, BLOCK_M, row_o)
    return j_last + 1


@gluon.jit
def _buffers(k_desc, STAGES: gl.constexpr, N_Q: gl.constexpr, EMPTY_COUNT: gl.constexpr):
    """Shared Q tiles, the K/V ring and its barriers (ready: TMA bytes landed; empty: every
    consumer is past the stage)."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    D: gl.constexpr = k_desc.block_type.shape[1]
    q_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [N_Q, 64, D], q_sl)
    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], k_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=EMPTY_COUNT)
    fence_async_shared()
    return q_smem, k_smem, v_smem, ready, empty


@gluon.jit
def _gl_attn(
    q_ptr, k_desc, v_desc, o_ptr, pos_ptr, ag_ptr, park_ptr, n_rows, scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    G: gl.constexpr, SEG_BLOCKS: gl.constexpr, STAGES: gl.constexpr, PAIR: gl.constexpr,
    AG_GLOBAL: gl.constexpr, FAST_EXP: gl.constexpr, OVERLAP: gl.constexpr,
):  # fmt: skip
    """One warpgroup a program: it requests its own K/V blocks."""
    D: gl.constexpr = k_desc.block_type.shape[1]
    q_smem, k_smem, v_smem, ready, empty = _buffers(k_desc, STAGES, 1, 1)
    n_tiles = gl.cdiv(n_rows, 64)
    slot = (gl.program_id(1) * n_tiles + gl.program_id(0)).to(gl.int64) * (64 * D)
    _tile(
        q_ptr, o_ptr, pos_ptr, k_desc, v_desc, q_smem.index(0), k_smem, v_smem, ready, empty,
        ag_ptr, park_ptr, slot, n_tiles - 1 - gl.program_id(0), n_rows, scale, stride_qt,
        stride_qh, stride_ot, stride_oh, G, SEG_BLOCKS, STAGES, PAIR, AG_GLOBAL, FAST_EXP, False,
        OVERLAP,
    )  # fmt: skip


@gluon.jit
def _last_block_of(pos_ptr, tile, n_rows, G: gl.constexpr, BLOCK_N: gl.constexpr,
                   layout: gl.constexpr):  # fmt: skip
    rows = tile * 64 + gl.arange(0, 64, layout=layout)
    return gl.max(gl.load(pos_ptr + rows // G, mask=rows < n_rows, other=-1), 0) // BLOCK_N


@gluon.jit
def _consumer(args, WHICH: gl.constexpr):
    """Consumer ``WHICH`` of a warp-specialized program: tile 2c + WHICH from the longest;
    then it releases the blocks only the other tile needs. ``args``: ``_ws_attn``'s."""
    (
        q_ptr, o_ptr, pos_ptr, k_desc, v_desc, q_smem, k_smem, v_smem, ready, empty, n_rows,
        scale, stride_qt, stride_qh, stride_ot, stride_oh, G, SEG_BLOCKS, STAGES, PAIR,
        FAST_EXP, OVERLAP, HEADS_FAST,
    ) = args  # fmt: skip
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    t_a = gl.cdiv(n_rows, 64) - 1 - 2 * _pid(0, HEADS_FAST)
    tile = t_a - WHICH
    j_end = _last_block_of(pos_ptr, t_a, n_rows, G, BLOCK_N, lay)
    j_next = 0
    if tile >= 0:
        j_next = _tile(
            q_ptr, o_ptr, pos_ptr, k_desc, v_desc, q_smem.index(WHICH), k_smem, v_smem, ready,
            empty, q_ptr, q_ptr, 0, tile, n_rows, scale, stride_qt, stride_qh, stride_ot,
            stride_oh, G, SEG_BLOCKS, STAGES, PAIR, False, FAST_EXP, True, OVERLAP, HEADS_FAST,
        )  # fmt: skip
    for j in range(j_next, j_end + 1):
        mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)
        _release(empty, j, STAGES, True)


@gluon.jit
def _producer(
    pos_ptr, k_desc, v_desc, k_smem, v_smem, ready, empty, n_rows, G: gl.constexpr,
    STAGES: gl.constexpr, HEADS_FAST: gl.constexpr,
):  # fmt: skip
    """One warp: every key block the longer tile needs, into the ring, in order."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    lay: gl.constexpr = gl.BlockedLayout([2], [32], [1], [0])
    t_a = gl.cdiv(n_rows, 64) - 1 - 2 * _pid(0, HEADS_FAST)
    j_end = _last_block_of(pos_ptr, t_a, n_rows, G, BLOCK_N, lay)
    for j in range(0, j_end + 1):
        mbarrier.wait(empty.index(j % STAGES), ((j // STAGES) & 1) ^ 1)
        _load_kv(k_desc, v_desc, k_smem, v_smem, ready, j, j_end, _pid(1, HEADS_FAST), STAGES)


@gluon.jit
def _ws_attn(
    q_ptr, k_desc, v_desc, o_ptr, pos_ptr, n_rows, scale, stride_qt, stride_qh, stride_ot,
    stride_oh, G: gl.constexpr, SEG_BLOCKS: gl.constexpr, STAGES: gl.constexpr,
    PAIR: gl.constexpr, FAST_EXP: gl.constexpr, OVERLAP: gl.constexpr, HEADS_FAST: gl.constexpr,
):  # fmt: skip
    """Warp-specialized: one TMA producer warp and two consumer warpgroups, tiles 2c and
    2c + 1 of one kv head, sharing the K/V ring (each consumer: 240 registers)."""
    q_smem, k_smem, v_smem, ready, empty = _buffers(k_desc, STAGES, 2, 2)
    args = (
        q_ptr, o_ptr, pos_ptr, k_desc, v_desc, q_smem, k_smem, v_smem, ready, empty, n_rows,
        scale, stride_qt, stride_qh, stride_ot, stride_oh, G, SEG_BLOCKS, STAGES, PAIR,
        FAST_EXP, OVERLAP, HEADS_FAST,
    )  # fmt: skip
    loads = (pos_ptr, k_desc, v_desc, k_smem, v_smem, ready, empty, n_rows, G, STAGES, HEADS_FAST)
    gl.warp_specialize(
        [(_consumer, (args, 0)), (_consumer, (args, 1)), (_producer, loads)],
        [4, 1],
        [240, 24],
    )


def gl_attention(q, k, v, positions, *, block=32, segment=512, stages=3, pair=False,
                 ag_global=False, fast_exp=False, ws=False, overlap=False, maxnreg=None,
                 scratch=None, heads_fast=False):  # fmt: skip
    """attention.blocked (prefill, no split) for q [T, Hq, D], k/v [S, Hkv, D] bf16 and int32
    positions [T], the default scale. ``scratch``: fp32, at least 2 * tiles * Hkv * 64 * D.
    ``ws``: the warp-specialized kernel (the accumulator stays in registers); ``heads_fast``:
    its grid with the kv head fastest, so programs start longest tile first over all heads."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from lockstep_exact.programs.cuda.attention import _default_scale

    assert stages >= (4 if pair or overlap else 3), "blocks requested 2 ahead (pair, overlap: 3)"
    assert not (pair and overlap), "pairs and the overlap do not combine"
    n_q, h_q, d = q.shape
    s_len, h_kv, _ = k.shape
    g = h_q // h_kv
    out = torch.empty_like(q)
    lay = gl.NVMMASharedLayout.get_default_for([block, d], gl.bfloat16)
    k2, v2 = k.reshape(s_len, h_kv * d), v.reshape(s_len, h_kv * d)
    kd = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [block, d], lay)
    vd = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [block, d], lay)
    n_rows = n_q * g
    n_tiles = triton.cdiv(n_rows, 64)
    scale = _default_scale(d) * (math.log2(math.e) if fast_exp else 1.0)
    if ws:
        assert not ag_global and maxnreg is None
        grid = (triton.cdiv(n_tiles, 2), h_kv)
        _ws_attn[grid[::-1] if heads_fast else grid](
            q, kd, vd, out, positions, n_rows, scale, q.stride(0), q.stride(1), out.stride(0),
            out.stride(1), G=g, SEG_BLOCKS=segment // block, STAGES=stages, PAIR=pair,
            FAST_EXP=fast_exp, OVERLAP=overlap, HEADS_FAST=int(heads_fast), num_warps=4,
            enable_fp_fusion=False, maxnreg=168,
        )  # fmt: skip
        return out  # 168 registers at launch: 3 warpgroups fill the register file
    half = n_tiles * h_kv * 64 * d
    if scratch is None or scratch.numel() < 2 * half:
        scratch = torch.empty(2 * half if ag_global else 2, dtype=torch.float32, device=q.device)
    _gl_attn[(n_tiles, h_kv)](
        q, kd, vd, out, positions, scratch, scratch[half:] if ag_global else scratch, n_rows,
        scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        G=g, SEG_BLOCKS=segment // block, STAGES=stages, PAIR=pair, AG_GLOBAL=ag_global,
        FAST_EXP=fast_exp, OVERLAP=overlap, num_warps=4, enable_fp_fusion=False,
        **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )  # fmt: skip
    return out


EXACT = {  # compared byte for byte with the program at the same block
    "gluon": {},
    "gluon, pairs of QK products, 4 stages": {"pair": True, "stages": 4},
    "gluon, accumulator of the segments in scratch": {"ag_global": True},
    "the same, maxnreg 168 (3 programs an SM)": {"ag_global": True, "maxnreg": 168},
    "the same, block 64": {"ag_global": True, "block": 64},
    "the same, block 128": {"ag_global": True, "block": 128},
    "warp-specialized: a TMA warp, two consumer warpgroups": {"ws": True, "stages": 4},
    "the same, pairs of QK products": {"ws": True, "stages": 4, "pair": True},
    "warp-specialized, block 64": {"ws": True, "stages": 4, "block": 64},
    "gluon, block j's PV product in flight during block j + 1's softmax": {
        "overlap": True,
        "stages": 4,
    },
    "warp-specialized, the same overlap": {"ws": True, "stages": 4, "overlap": True},
    "warp-specialized, the same overlap, block 64": {
        "ws": True,
        "stages": 4,
        "overlap": True,
        "block": 64,
    },
    "the same, kv heads fastest in the grid (longest tiles first)": {
        "ws": True,
        "stages": 4,
        "overlap": True,
        "block": 64,
        "heads_fast": True,
    },
    "warp-specialized, overlap, kv heads fastest, block 32": {
        "ws": True,
        "stages": 4,
        "overlap": True,
        "heads_fast": True,
    },
}
NOT_CONTRACT = {  # timing only; beside the scratch-accumulator variants they change
    "scratch accumulator, ex2.ftz with the scale folded (not the contract)": {
        "ag_global": True,
        "fast_exp": True,
    },
    "the same, block 64 (not the contract)": {"ag_global": True, "fast_exp": True, "block": 64},
    "warp-specialized, pairs, ex2.ftz (not the contract)": {
        "ws": True,
        "stages": 4,
        "pair": True,
        "fast_exp": True,
    },
    "warp-specialized, block 64, ex2.ftz (not the contract)": {
        "ws": True,
        "stages": 4,
        "block": 64,
        "fast_exp": True,
    },
}


def main() -> None:
    from triton.testing import do_bench

    from lockstep_exact.programs.cuda.attention import attention

    program = importlib.import_module("lockstep_exact.programs.cuda.attention")  # the module
    program._HOPPER_PREFILL = False  # the reference: the Triton kernel (set back for one row)

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--only", help="the variants whose names contain one of these |-cut texts")
    args = ap.parse_args()

    def chosen(name):
        return not args.only or any(part in name for part in args.only.split("|"))

    exact = {n: kw for n, kw in EXACT.items() if chosen(n)}
    not_contract = {n: kw for n, kw in NOT_CONTRACT.items() if chosen(n)}
    h, h_kv, d = 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    qp, kp, vp = (
        torch.randn(8192, n, d, device="cuda", generator=gen).to(torch.bfloat16)
        for n in (h, h_kv, h_kv)
    )

    def case(t, off, kind=""):
        if kind == "every second position":  # masked blocks where some rows see no key
            pos = torch.arange(off, 2 * t, 2, device="cuda", dtype=torch.int32)
            return qp[: pos.numel()], kp[: 2 * t], vp[: 2 * t], pos
        if kind == "scattered":
            pos = torch.tensor([3, 100, 511, 512, 513, 4000], device="cuda", dtype=torch.int32)
            return qp[:6], kp[:4100], vp[:4100], pos
        return qp[off:t], kp[:t], vp[:t], torch.arange(off, t, device="cuda", dtype=torch.int32)

    cases = [(700, 0), (2048, 0), (2048, 333), (1500, 1000), (8192, 0),
             (1300, 0, "every second position"), (6, 0, "scattered")]  # fmt: skip
    res: dict = {}
    for name, kw in exact.items():
        same = {}
        for c in cases:
            q, k, v, pos = case(*c)
            ref = attention(q, k, v, pos, block=kw.get("block", 32), split=False, segment=SEGMENT)
            same[" ".join(map(str, c))] = bool(torch.equal(ref, gl_attention(q, k, v, pos, **kw)))
        q, k, v, pos = case(700, 0)
        v = v.clone()
        before = gl_attention(q, k, v, pos, **kw)
        v.view(torch.int16)[650, 3, 7] += 1  # one ulp of one value a late row sees
        same["one ulp of V moves the bytes"] = not torch.equal(
            before, gl_attention(q, k, v, pos, **kw)
        )
        res[f"{name}: same bytes"] = same
        print(name, same, flush=True)
    for t in (2048, 8192):
        qkv = case(t, 0)
        scratch = torch.empty(2 * triton.cdiv(t * 4, 64) * h_kv * 64 * d, device="cuda")
        row = {
            "triton program": do_bench(
                lambda a=qkv: attention(*a, block=BLOCK, segment=SEGMENT), return_mode="median"
            )
        }
        program._HOPPER_PREFILL = True
        row["program's Hopper kernel"] = do_bench(
            lambda a=qkv: attention(*a, block=BLOCK, segment=SEGMENT), return_mode="median"
        )
        program._HOPPER_PREFILL = False
        for name, kw in {**exact, **not_contract}.items():
            row[name] = do_bench(
                lambda a=qkv, kw=kw, sc=scratch: gl_attention(*a, scratch=sc, **kw),
                return_mode="median",
            )
        q, k, v, _ = qkv
        heads_first = tuple(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        row["SDPA (GQA)"] = do_bench(
            lambda a=heads_first: torch.nn.functional.scaled_dot_product_attention(
                *a, is_causal=True, enable_gqa=True
            ),
            return_mode="median",
        )
        row = {key: round(ms * 1e3, 1) for key, ms in row.items()}  # us
        res[f"prefill T={t} (us)"] = row
        print(f"T={t}", row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
