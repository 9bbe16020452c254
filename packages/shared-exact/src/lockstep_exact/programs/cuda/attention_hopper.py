"""attention.blocked's prefill on Hopper (sm_90): a second kernel of the same program.

``attention``'s Triton kernel leaves the tensor-core waits, the register use and the loads to
the compiler. This kernel (Gluon, Triton's explicit-layout dialect) computes the same
arithmetic with the schedule written out, so it gives the same bytes; the GPU gate compares
the two kernels byte for byte (test_the_hopper_prefill_gives_the_triton_kernel_bytes).

- Warp-specialized, as FlashAttention-3 divides the work: one warp issues every TMA copy of
  K and V into a ring of 4 shared stages (``ready`` barriers for the bytes, ``empty`` barriers
  that both consumers arrive on); two consumer warpgroups of 240 registers each compute one
  64-row tile (tiles 2c and 2c + 1 of one kv head, so they share K and V).
- Inside a consumer, on the blocks every row sees whole: block j + 1's QK product is issued,
  then block j's PV product, and block j + 1's softmax runs while the PV product is in
  flight (``wait_group 1``). Each product, sum and rescale is the Triton kernel's, in its
  order: the same 16-row MMA shapes (m64n{block}k16 for QK from shared Q, m64n{D}k16 for PV
  with P in registers), the same masked-block ``where``s, segment merges and ``div_rn``.
- Programs walk (pair of tiles, kv head) with the kv head fastest and the longest tiles
  first, so the short tiles fill the last wave.
- Keys past a tile's last query (a cache may hold anything there, inf and NaN included) are
  read by TMA but never reach a product: the score is masked to -inf and the V rows of the
  masked blocks are copied, zeroed past the tile's last query, into the consumer's own buffer,
  as the Triton kernel loads zeros there. Keys past the tensor are TMA's zero fill.
- Positions (int32 or int64, any stride) are checked on the device, as the Triton kernel
  checks them: a negative one or one without a key stops the kernel.

``usable`` says when it runs: an sm_90 device, heads of 64 or 128, blocks of 32 or 64, a
prefill without the split (enough tiles to fill the GPU), 16-byte aligned K and V, and a
triton with Gluon's Hopper API. Everything else runs the Triton kernel, whose bytes these
are. H200 timings: docs/gpu.md ("Kernel speed").
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .arith import EXACT, TRAP_ASM

try:  # Gluon's Hopper API (triton >= 3.5); without it the Triton kernel runs (same bytes)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the installed triton
    gluon = None

STAGES = tl.constexpr(4)  # the K/V ring: a block is requested up to 3 ahead of the one in use
HEADS = (64, 128)  # head sizes compiled and gated (256 does not fit the consumer's registers)
BLOCKS = (32, 64)  # key blocks (128 would not fit the ring twice in shared memory)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int) -> bool:
    """Whether this kernel serves a prefill of q [T, Hq, D] over contiguous k, v [S, Hkv, D]."""
    if gluon is None or q.shape[-1] not in HEADS or block not in BLOCKS:
        return False
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if _capability(index) != (9, 0):
        return False
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (k, v))


if gluon is not None:

    @gluon.jit
    def _trap_if(bad):
        """Stop the kernel on any lane where ``bad`` (arith.trap_if, in Gluon); returns zeros
        to be added to a value the kernel uses."""
        return gl.inline_asm_elementwise(
            TRAP_ASM, "=r,r", [bad.to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1
        )

    @gluon.constexpr_function
    def wgmma_layout(n):
        """The accumulator layout of a 64-row wgmma product n columns wide (one warpgroup, 16
        rows a warp): the tile's scores (n = block) and its output (n = head size)."""
        return gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 16]
        )

    @gluon.jit
    def load_q_tile(q_ptr, q_smem, tile, h, n_rows, stride_qt, stride_qh, G: gl.constexpr):
        """Rows tile * 64 .. tile * 64 + 63 of kv head ``h``'s queries (row r: token r // G,
        query head h * G + r % G; zeros past ``n_rows``) into ``q_smem`` [64, D], visible to
        the warpgroup's products when it returns."""
        D: gl.constexpr = q_smem.shape[1]
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        rows = tile * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, ld))
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        src = (
            q_ptr
            + (rows // G)[:, None] * stride_qt
            + (h * G + rows % G)[:, None] * stride_qh
            + offs_d[None, :]
        )
        q_smem.store(gl.load(src, mask=(rows < n_rows)[:, None], other=0.0))
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _soft(s, m, l_s, scale, p_op: gl.constexpr, row_o: gl.constexpr):
        """An unmasked block up to its PV product: the new max and sum, P in the PV operand's
        layout, alpha in the accumulator's row layout (the Triton kernel's step)."""
        s = s * scale
        m_new = gl.maximum(m, gl.max(s, 1))
        alpha = gl.exp(m - m_new)
        p = gl.exp(s - m_new[:, None])
        l_s = l_s * alpha + gl.sum(p, 1)
        return (
            m_new,
            l_s,
            gl.convert_layout(p.to(gl.bfloat16), p_op),
            gl.convert_layout(alpha, row_o),
        )

    @gluon.jit
    def _tile_pos(pos_ptr, stride_p, tile, n_rows, kv_len, G: gl.constexpr, layout: gl.constexpr):
        """The positions of a 64-row tile's rows (-1 past the rows), checked: a negative
        position or one without a key stops the kernel."""
        rows = tile * 64 + gl.arange(0, 64, layout=layout)
        row_ok = rows < n_rows
        pos = gl.load(pos_ptr + (rows // G) * stride_p, mask=row_ok, other=-1)
        pos = pos + _trap_if(row_ok & ((pos < 0) | (pos >= kv_len)))
        return pos.to(gl.int32), row_ok

    @gluon.jit
    def _masked_v(v_buf, v_own, j, pos_max, BLOCK_N: gl.constexpr, D: gl.constexpr):
        """Copy key block j's V rows into this consumer's buffer, zeros past its last query
        (after every warp of the warpgroup is past the product that read the buffer last)."""
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        gl.thread_barrier()
        for c in gl.static_range(BLOCK_N // 16):
            part = v_buf.slice(c * 16, 16).load(ld)
            kpos = j * BLOCK_N + c * 16 + gl.arange(0, 16, layout=gl.SliceLayout(1, ld))
            v_own.slice(c * 16, 16).store(gl.where((kpos <= pos_max)[:, None], part, 0.0))
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _tile(
        q_ptr, o_ptr, pos_ptr, k_desc, v_desc, q_smem, k_smem, v_smem, v_own, ready, empty,
        tile, h, n_rows, kv_len, scale, stride_p, stride_qt, stride_qh, stride_ot, stride_oh,
        G: gl.constexpr, SEG_BLOCKS: gl.constexpr,
    ):  # fmt: skip
        """One consumer's 64-row tile of kv head ``h``; returns the key blocks it used."""
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

        load_q_tile(q_ptr, q_smem, tile, h, n_rows, stride_qt, stride_qh, G)

        pos, row_ok = _tile_pos(pos_ptr, stride_p, tile, n_rows, kv_len, G, row_s)
        pos_max = gl.max(pos, 0)
        pos_min = gl.min(gl.where(row_ok, pos, 2147483647), 0)
        j_last = pos_max // BLOCK_N
        j_full = (pos_min + 1) // BLOCK_N
        offs_n = gl.arange(0, BLOCK_N, layout=col_s)

        m_g = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_g = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        a_g = gl.zeros([BLOCK_M, D], gl.float32, layout=mma_o)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma_s)
        for s_idx in range(0, j_last // SEG_BLOCKS + 1):
            j_lo = s_idx * SEG_BLOCKS
            j_hi = gl.minimum(j_lo + SEG_BLOCKS, j_last + 1)
            m = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
            l_s = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
            acc = gl.zeros([BLOCK_M, D], gl.float32, layout=mma_o)
            # the blocks every row sees whole, block j's PV product in flight during block
            # j + 1's QK product and softmax
            j_mid = gl.maximum(j_lo, gl.minimum(j_hi, j_full))
            if j_mid > j_lo:
                mbarrier.wait(ready.index(j_lo % STAGES), (j_lo // STAGES) & 1)
                s = warpgroup_mma(
                    q_smem, k_smem.index(j_lo % STAGES).permute((1, 0)), s_zero, use_acc=False,
                    is_async=True,
                )  # fmt: skip
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                m, l_s, pb, alpha_o = _soft(s, m, l_s, scale, p_op, row_o)
                for j in range(j_lo, j_mid - 1):
                    mbarrier.wait(ready.index((j + 1) % STAGES), ((j + 1) // STAGES) & 1)
                    s = warpgroup_mma(
                        q_smem, k_smem.index((j + 1) % STAGES).permute((1, 0)), s_zero,
                        use_acc=False, is_async=True,
                    )  # fmt: skip
                    acc = warpgroup_mma(
                        pb, v_smem.index(j % STAGES), acc * alpha_o[:, None], is_async=True
                    )
                    s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
                    m, l_s, pb, alpha_o = _soft(s, m, l_s, scale, p_op, row_o)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    mbarrier.arrive(empty.index(j % STAGES), count=1)
                acc = warpgroup_mma(
                    pb, v_smem.index((j_mid - 1) % STAGES), acc * alpha_o[:, None], is_async=True
                )
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index((j_mid - 1) % STAGES), count=1)
            for j in range(j_mid, j_hi):  # the masked blocks (the Triton kernel's wheres)
                st = j % STAGES
                mbarrier.wait(ready.index(st), (j // STAGES) & 1)
                _masked_v(v_smem.index(st), v_own, j, pos_max, BLOCK_N, D)
                s = warpgroup_mma(
                    q_smem, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False,
                    is_async=True,
                )  # fmt: skip
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                s = s * scale
                kpos = j * BLOCK_N + offs_n
                s = gl.where(kpos[None, :] <= pos[:, None], s, float("-inf"))
                m_new = gl.maximum(m, gl.max(s, 1))
                active = pos >= j * BLOCK_N
                m_safe = gl.where(active, m_new, 0.0)
                alpha = gl.exp(m - m_safe)
                p = gl.exp(s - m_safe[:, None])
                l_new = l_s * alpha + gl.sum(p, 1)
                pb = gl.convert_layout(p.to(gl.bfloat16), p_op)
                alpha_o = gl.convert_layout(alpha, row_o)
                active_o = gl.convert_layout(active, row_o)
                acc_new = warpgroup_mma(pb, v_own, acc * alpha_o[:, None], is_async=True)
                acc_new = warpgroup_mma_wait(num_outstanding=0, deps=(acc_new,))
                acc = gl.where(active_o[:, None], acc_new, acc)
                m = gl.where(active, m_new, m)
                l_s = gl.where(active, l_new, l_s)
                mbarrier.arrive(empty.index(st), count=1)
            # fold the segment into the running state (the Triton kernel's _merge)
            active = pos >= s_idx * (SEG_BLOCKS * BLOCK_N)
            m_new = gl.maximum(m_g, m)
            m_safe = gl.where(active, m_new, 0.0)
            alpha = gl.exp(m_g - m_safe)
            beta = gl.exp(m - m_safe)
            l_g = gl.where(active, l_g * alpha + l_s * beta, l_g)
            m_g = gl.where(active, m_new, m_g)
            alpha_o = gl.convert_layout(alpha, row_o)
            beta_o = gl.convert_layout(beta, row_o)
            active_o = gl.convert_layout(active, row_o)
            a_g = gl.where(active_o[:, None], a_g * alpha_o[:, None] + acc * beta_o[:, None], a_g)
        # out = bf16(Ag / Lg) (IEEE division), zeros as +0 (the Triton kernel's _finish)
        r_o = gl.arange(0, BLOCK_M, layout=row_o)
        c_o = gl.arange(0, D, layout=col_o)
        num, den = gl.broadcast(a_g, gl.convert_layout(l_g, row_o)[:, None])
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
        return j_last + 1

    @gluon.jit
    def _work(n_rows, n_kv_heads):
        """This program's (kv head, longer tile of its pair): kv heads fastest, longest first."""
        pid = gl.program_id(0)
        return pid % n_kv_heads, gl.cdiv(n_rows, 64) - 1 - 2 * (pid // n_kv_heads)

    @gluon.jit
    def _last_block(pos_ptr, stride_p, t_a, n_rows, G: gl.constexpr, BLOCK_N: gl.constexpr,
                    layout: gl.constexpr):  # fmt: skip
        """The last key block the rows of tiles t_a - 1 and t_a use: the ring carries every
        block either tile needs (positions need not be sorted). Unchecked positions: the
        consumers check them."""
        rows = (t_a - 1) * 64 + gl.arange(0, 128, layout=layout)
        ok = (rows >= 0) & (rows < n_rows)
        pos = gl.load(pos_ptr + (rows // G) * stride_p, mask=ok, other=0)
        return (gl.max(pos, 0) // BLOCK_N).to(gl.int32)

    @gluon.jit
    def _consumer(args, WHICH: gl.constexpr):
        """Consumer ``WHICH``: tile 2c + WHICH from the longest; then it releases the blocks
        only the other tile needs (each block of the ring is released by both consumers)."""
        (
            q_ptr, o_ptr, pos_ptr, k_desc, v_desc, q_smem, k_smem, v_smem, v_own, ready, empty,
            n_rows, n_kv_heads, kv_len, scale, stride_p, stride_qt, stride_qh, stride_ot,
            stride_oh, G, SEG_BLOCKS,
        ) = args  # fmt: skip
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        h, t_a = _work(n_rows, n_kv_heads)
        tile = t_a - WHICH
        j_end = _last_block(pos_ptr, stride_p, t_a, n_rows, G, BLOCK_N, lay)
        j_next = 0
        if tile >= 0:
            j_next = _tile(
                q_ptr, o_ptr, pos_ptr, k_desc, v_desc, q_smem.index(WHICH), k_smem, v_smem,
                v_own.index(WHICH), ready, empty, tile, h, n_rows, kv_len, scale, stride_p,
                stride_qt, stride_qh, stride_ot, stride_oh, G, SEG_BLOCKS,
            )  # fmt: skip
        for j in range(j_next, j_end + 1):
            mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)
            mbarrier.arrive(empty.index(j % STAGES), count=1)

    @gluon.jit
    def _producer(pos_ptr, k_desc, v_desc, k_smem, v_smem, ready, empty, n_rows, n_kv_heads,
                  stride_p, G: gl.constexpr):  # fmt: skip
        """One warp: every key block either tile of the pair needs, into the ring, in order."""
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        D: gl.constexpr = k_desc.block_type.shape[1]
        lay: gl.constexpr = gl.BlockedLayout([4], [32], [1], [0])
        h, t_a = _work(n_rows, n_kv_heads)
        j_end = _last_block(pos_ptr, stride_p, t_a, n_rows, G, BLOCK_N, lay)
        for j in range(0, j_end + 1):
            st = j % STAGES
            mbarrier.wait(empty.index(st), ((j // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(st), 2 * BLOCK_N * D * 2)
            tma.async_copy_global_to_shared(
                k_desc, [j * BLOCK_N, h * D], ready.index(st), k_smem.index(st)
            )
            tma.async_copy_global_to_shared(
                v_desc, [j * BLOCK_N, h * D], ready.index(st), v_smem.index(st)
            )

    @gluon.jit
    def _prefill_kernel(
        q_ptr, k_desc, v_desc, o_ptr, pos_ptr, n_rows, n_kv_heads, kv_len, scale, stride_p,
        stride_qt, stride_qh, stride_ot, stride_oh, G: gl.constexpr, SEG_BLOCKS: gl.constexpr,
    ):  # fmt: skip
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
        D: gl.constexpr = k_desc.block_type.shape[1]
        q_sl: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=16, rank=2
        )
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 64, D], q_sl)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], k_desc.layout)
        v_own = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D], k_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        fence_async_shared()
        args = (
            q_ptr, o_ptr, pos_ptr, k_desc, v_desc, q_smem, k_smem, v_smem, v_own, ready, empty,
            n_rows, n_kv_heads, kv_len, scale, stride_p, stride_qt, stride_qh, stride_ot,
            stride_oh, G, SEG_BLOCKS,
        )  # fmt: skip
        loads = (
            pos_ptr, k_desc, v_desc, k_smem, v_smem, ready, empty, n_rows, n_kv_heads, stride_p, G,
        )  # fmt: skip
        gl.warp_specialize(
            [(_consumer, (args, 0)), (_consumer, (args, 1)), (_producer, loads)],
            [4, 1],
            [240, 32],
        )


@functools.cache
def _kv_layout(block: int, d: int):
    """The shared layout of a [block, d] bf16 K or V tile (built once: 5-8 us a call)."""
    return gl.NVMMASharedLayout.get_default_for([block, d], gl.bfloat16)


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    block: int,
    segment: int,
) -> torch.Tensor:
    """Write attention.blocked of q [T, Hq, D] (contiguous) over k, v [S, Hkv, D] (contiguous,
    ``usable``) at positions ``pos`` [T] (int32 or int64, on the device, checked in the kernel)
    into ``out`` [T, Hq, D]; returns ``out``."""
    n_q, h_q, d = q.shape
    s_len, h_kv, _ = k.shape
    g = h_q // h_kv
    n_rows = n_q * g
    lay = _kv_layout(block, d)
    k2, v2 = k.view(s_len, h_kv * d), v.view(s_len, h_kv * d)
    kd = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [block, d], lay)
    vd = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [block, d], lay)
    pairs = triton.cdiv(triton.cdiv(n_rows, 64), 2)
    _prefill_kernel[(pairs * h_kv,)](
        q, kd, vd, out, pos, n_rows, h_kv, s_len, scale, pos.stride(0), q.stride(0),
        q.stride(1), out.stride(0), out.stride(1), G=g, SEG_BLOCKS=segment // block,
        num_warps=4, maxnreg=168, **EXACT,
    )  # fmt: skip
    return out  # 168 registers at launch: the producer's 32 leave 240 to each consumer
