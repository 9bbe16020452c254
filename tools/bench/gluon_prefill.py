"""A measurement probe, not a program: attention.blocked's prefill as a Gluon kernel (Hopper).

Issue 12, tenth session. The committed cuda program (programs/cuda/attention.py) is Triton:
its layouts, its waits on the tensor cores and its register use are the compiler's. This
kernel computes the same arithmetic with each of them written out: the 64-row tile of one
warpgroup (wgmma m64n32k16 for QK, m64n128k16 for PV, the P operand from registers), the
32-key block and 512-key segment of the lanes' contract, the masked block's ``where``s, the
in-order segment merges, ``div_rn`` at the end; K and V come by TMA into a ring of shared
buffers. On the H200 it gave the Triton program's bytes in every case tried (docs/gpu.md,
"A Gluon prefill"), so it is a base for the Hopper-specific work the prefill target needs
(producer/consumer warps, asynchronous products) without leaving the program's bytes.

Not covered (a program would need them): the device-side position check (trap), head sizes
other than 128 and blocks other than 32 are untested, and keys in [pos_max + 1, S) are
read where the Triton program reads zeros (the same bytes unless such a V is inf or NaN).

    PYTHONPATH=packages/shared-exact/src python3 tools/bench/gluon_prefill.py [--json F]

``OVERLAP`` issues the next block's QK product before this block's softmax; ``PV_ASYNC``
also leaves the PV product in flight across the loop (ptxas then serializes the products:
its warning C7515). Both were slower on the H200 (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)


@gluon.jit
def _merge(m_g, l_g, a_g, m_s, l_s, a_s, active, row_o: gl.constexpr):
    m_new = gl.maximum(m_g, m_s)
    m_safe = gl.where(active, m_new, 0.0)
    alpha = gl.exp(m_g - m_safe)
    beta = gl.exp(m_s - m_safe)
    l_new = l_g * alpha + l_s * beta
    alpha_o = gl.convert_layout(alpha, row_o)
    beta_o = gl.convert_layout(beta, row_o)
    a_new = a_g * alpha_o[:, None] + a_s * beta_o[:, None]
    m_g = gl.where(active, m_new, m_g)
    l_g = gl.where(active, l_new, l_g)
    a_g = gl.where(gl.convert_layout(active, row_o)[:, None], a_new, a_g)
    return m_g, l_g, a_g


@gluon.jit
def _load_kv(
    k_desc,
    v_desc,
    k_smem,
    v_smem,
    bars,
    j,
    j_last,
    h,
    BLOCK_N: gl.constexpr,
    D: gl.constexpr,
    STAGES: gl.constexpr,
):
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
def _gl_attn(
    q_ptr,
    k_desc,
    v_desc,
    o_ptr,
    pos_ptr,
    n_rows,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    G: gl.constexpr,
    D: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    SEG_BLOCKS: gl.constexpr,
    STAGES: gl.constexpr,
    OVERLAP: gl.constexpr,
    PV_ASYNC: gl.constexpr,
):
    mma_s: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    mma_o: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16]
    )
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_o, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, mma_s)
    col_s: gl.constexpr = gl.SliceLayout(0, mma_s)
    row_o: gl.constexpr = gl.SliceLayout(1, mma_o)
    col_o: gl.constexpr = gl.SliceLayout(0, mma_o)
    ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    q_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

    n_tiles = gl.cdiv(n_rows, BLOCK_M)
    tile = n_tiles - 1 - gl.program_id(0)
    h = gl.program_id(1)

    rows_l = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld))
    offs_dl = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
    ok_l = rows_l < n_rows
    q_src = (
        q_ptr
        + (rows_l // G)[:, None] * stride_qt
        + (h * G + rows_l % G)[:, None] * stride_qh
        + offs_dl[None, :]
    )
    q = gl.load(q_src, mask=ok_l[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, D], q_sl, q)

    rows = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
    row_ok = rows < n_rows
    pos = gl.load(pos_ptr + rows // G, mask=row_ok, other=-1).to(gl.int32)
    pos_max = gl.max(pos, 0)
    pos_min = gl.min(gl.where(row_ok, pos, 2147483647), 0)
    j_last = pos_max // BLOCK_N
    j_full = (pos_min + 1) // BLOCK_N
    offs_n = gl.arange(0, BLOCK_N, layout=col_s)

    k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, D], v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    for i in gl.static_range(STAGES - 1):
        _load_kv(k_desc, v_desc, k_smem, v_smem, bars, i, j_last, h, BLOCK_N, D, STAGES)

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
        if OVERLAP:
            acc = warpgroup_mma_init(acc)
            st0 = j_lo % STAGES
            mbarrier.wait(bars.index(st0), (j_lo // STAGES) & 1)
            s_next = warpgroup_mma(
                q_smem, k_smem.index(st0).permute((1, 0)), s_zero, use_acc=False, is_async=True
            )
            for j in range(j_lo, j_hi):
                st = j % STAGES
                s, acc_t = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, acc))
                s = s * scale
                masked = j >= j_full
                kpos = j * BLOCK_N + offs_n
                s = gl.where((kpos[None, :] <= pos[:, None]) | (not masked), s, float("-inf"))
                m_new = gl.maximum(m, gl.max(s, 1))
                active = (pos >= j * BLOCK_N) | (not masked)
                m_safe = gl.where(active, m_new, 0.0)
                alpha = gl.exp(m - m_safe)
                alpha_o = gl.convert_layout(alpha, row_o)
                acc_in = acc_t * alpha_o[:, None]
                gl.thread_barrier()
                nxt = j + STAGES - 1  # into the stage of block j - 1, whose products are done
                _load_kv(k_desc, v_desc, k_smem, v_smem, bars, nxt, j_last, h, BLOCK_N, D, STAGES)
                if j + 1 < j_hi:
                    st1 = (j + 1) % STAGES
                    mbarrier.wait(bars.index(st1), ((j + 1) // STAGES) & 1)
                    s_next = warpgroup_mma(
                        q_smem,
                        k_smem.index(st1).permute((1, 0)),
                        s_zero,
                        use_acc=False,
                        is_async=True,
                    )
                p = gl.exp(s - m_safe[:, None])
                l_new = l_s * alpha + gl.sum(p, 1)
                pb = gl.convert_layout(p.to(gl.bfloat16), p_op)
                if PV_ASYNC:
                    acc = warpgroup_mma(pb, v_smem.index(st), acc_in, is_async=True)
                else:
                    acc = warpgroup_mma_init(
                        warpgroup_mma(pb, v_smem.index(st), acc_in, is_async=False)
                    )
                if masked:
                    acc_new = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    active_o = gl.convert_layout(active, row_o)
                    acc = warpgroup_mma_init(gl.where(active_o[:, None], acc_new, acc_t))
                    m = gl.where(active, m_new, m)
                    l_s = gl.where(active, l_new, l_s)
                else:
                    m = m_new
                    l_s = l_new
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        else:
            for j in range(j_lo, j_hi):
                st = j % STAGES
                gl.thread_barrier()
                nxt = j + STAGES - 1  # into the stage of block j - 1, whose products are done
                _load_kv(k_desc, v_desc, k_smem, v_smem, bars, nxt, j_last, h, BLOCK_N, D, STAGES)
                mbarrier.wait(bars.index(st), (j // STAGES) & 1)
                s = warpgroup_mma(
                    q_smem, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True
                )
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                s = s * scale
                if j < j_full:
                    m_new = gl.maximum(m, gl.max(s, 1))
                    alpha = gl.exp(m - m_new)
                    p = gl.exp(s - m_new[:, None])
                    l_s = l_s * alpha + gl.sum(p, 1)
                    pb = gl.convert_layout(p.to(gl.bfloat16), p_op)
                    alpha_o = gl.convert_layout(alpha, row_o)
                    acc = warpgroup_mma(pb, v_smem.index(st), acc * alpha_o[:, None], is_async=True)
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    m = m_new
                else:
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
                    acc_new = warpgroup_mma(
                        pb, v_smem.index(st), acc * alpha_o[:, None], is_async=True
                    )
                    acc_new = warpgroup_mma_wait(num_outstanding=0, deps=(acc_new,))
                    active_o = gl.convert_layout(active, row_o)
                    m = gl.where(active, m_new, m)
                    l_s = gl.where(active, l_new, l_s)
                    acc = gl.where(active_o[:, None], acc_new, acc)
        m_g, l_g, a_g = _merge(
            m_g, l_g, a_g, m, l_s, acc, pos >= s_idx * (SEG_BLOCKS * BLOCK_N), row_o
        )
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    l_o = gl.convert_layout(l_g, row_o)
    num, den = gl.broadcast(a_g, l_o[:, None])
    out = gl.div_rn(num, den)
    out = gl.where(out == 0.0, 0.0, out)
    rows_o = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_o)
    offs_do = gl.arange(0, D, layout=col_o)
    dst = (
        o_ptr
        + (rows_o // G)[:, None] * stride_ot
        + (h * G + rows_o % G)[:, None] * stride_oh
        + offs_do[None, :]
    )
    gl.store(dst, out.to(gl.bfloat16), mask=(rows_o < n_rows)[:, None])


def kv_layout(block_n: int, d: int):
    return gl.NVMMASharedLayout.get_default_for([block_n, d], gl.bfloat16)


def gl_attention(q, k, v, positions, *, block=32, segment=512, stages=3, overlap=False,
                 pv_async=False):  # fmt: skip
    """attention.blocked (prefill, no split) for q [T, Hq, D], k/v [S, Hkv, D] bf16 and int32
    positions [T], the default scale."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from lockstep_exact.programs.cuda.attention import _default_scale

    n_q, h_q, d = q.shape
    s_len, h_kv, _ = k.shape
    g = h_q // h_kv
    out = torch.empty_like(q)
    lay = kv_layout(block, d)
    k2, v2 = k.reshape(s_len, h_kv * d), v.reshape(s_len, h_kv * d)
    kd = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [block, d], lay)
    vd = TensorDescriptor(v2, list(v2.shape), list(v2.stride()), [block, d], lay)
    n_rows = n_q * g
    _gl_attn[(triton.cdiv(n_rows, 64), h_kv)](
        q, kd, vd, out, positions, n_rows, _default_scale(d),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        G=g, D=d, BLOCK_M=64, BLOCK_N=block, SEG_BLOCKS=segment // block, STAGES=stages,
        OVERLAP=overlap, PV_ASYNC=pv_async, num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return out


VARIANTS = {
    "gluon": {},
    "gluon 4 stages": {"stages": 4},
    "gluon QK ahead": {"overlap": True},
    "gluon QK ahead, PV in flight": {"overlap": True, "pv_async": True},
}


def main() -> None:
    from triton.testing import do_bench

    from lockstep_exact.programs.cuda.attention import attention

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    h, h_kv, d = 32, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    qp, kp, vp = (
        torch.randn(8192, n, d, device="cuda", generator=gen).to(torch.bfloat16)
        for n in (h, h_kv, h_kv)
    )
    res: dict = {}
    for name, kw in VARIANTS.items():
        same = {}
        for t, off in ((700, 0), (2048, 0), (2048, 333), (1500, 1000), (8192, 0)):
            q, k, v = qp[off:t], kp[:t], vp[:t]
            pos = torch.arange(off, t, device="cuda", dtype=torch.int32)
            same[f"T={t} from {off}"] = bool(
                torch.equal(attention(q, k, v, pos), gl_attention(q, k, v, pos, **kw))
            )
        res[f"{name}: same bytes"] = same
        print(name, same, flush=True)
    for t in (2048, 8192):
        q, k, v = qp[:t], kp[:t], vp[:t]
        pos = torch.arange(t, device="cuda", dtype=torch.int32)
        qkv = (q, k, v, pos)
        row = {"triton program": do_bench(lambda a=qkv: attention(*a), return_mode="median")}
        for name, kw in VARIANTS.items():
            row[name] = do_bench(lambda a=qkv, kw=kw: gl_attention(*a, **kw), return_mode="median")
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
