"""gdn.chunked's chunk pass as one Triton kernel: the cpu program's bytes in one launch.

The cpu backend's ``_chunk`` (``programs/cpu/gdn.py``) is written from elementwise IEEE
operations, fixed adjacent-pair trees (``tree_sum``) and two left-to-right chains (the gate sum
G and the forward substitution). Run op by op on CUDA tensors it gives the cpu bytes but takes
thousands of launches a chunk (a 64-row chunk's substitution alone is 64 rounds of about ten
ops). This kernel performs the same operations in the same order, so its bytes are the cpu
backend's: one program per (value head, block of value columns), every value fp32, each
``*``, ``+``, ``-`` rounded on its own (contraction off: ``EXACT``), ``exp`` and the trees the
cpu helpers' own operations (``exactmath``: zeros padded to a power of two, element 2i added
to element 2i+1, level by level).

Value columns never interact (the state, u and the outputs are column by column over V), so a
program owns ``BV`` of them and recomputes the column-free parts (G, the decays, k_i . k_j) for
its head. Rows past ``m`` and key dims past ``K`` load as +0, as the cpu code's zero padding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..cpu.arith import F32
from .arith import EXACT, next_pow2, require, require_cuda
from .exactmath import exp as _exp
from .exactmath import round_bf16 as _round_bf16
from .exactmath import tree_cols as _tree_cols
from .exactmath import tree_rows as _tree_rows
from .exactmath import widen as _widen

_BV = 32  # value columns per program


@triton.jit
def _at(vec, rows, i):
    """Element i of a register vector (a sum of it and +0s: exact, but for the sign of a zero,
    which ``_exp`` maps to the same 1)."""
    return tl.sum(tl.where(rows == i, vec, 0.0), 0)


@triton.jit(do_not_specialize=["m_arg", "w_arg", "first_arg", "HR"])
def _chunk_kernel(
    s0_ptr, kc_ptr, kn_ptr, v_ptr, g_ptr, b_ptr, q_ptr, us_ptr, gs_ptr,
    u_ptr, gc_ptr, o_ptr, se_ptr, seq_ptr, sc_ptr, pv_ptr, pg_ptr, pb_ptr,
    m_arg, w_arg, first_arg, K, V, HR,
    ss_p, sse_p, skc_p, skc_t, skc_h, sk_t, sk_h, sv_t, sv_h, sg_t, sq_t, sq_h,
    sus_p, sus_t, sus_h, sgs_p, sgs_t, su_p, su_t, su_h, sgc_p, sgc_t, so_t, so_h,
    spv_p, spg_p,
    C: tl.constexpr, LOGC: tl.constexpr, KP: tl.constexpr, LOGK: tl.constexpr,
    BV: tl.constexpr, PAGED: tl.constexpr,
):  # fmt: skip
    """One chunk pass of one sequence (PAGED false: grid (H, V blocks), the sequence's
    ``m``/``w``/``first`` given, q scaled and v widened by the caller, fp32 outputs) or of
    sequence ``program_id(2)`` of a step (PAGED: its row start, rows, position and page read
    from ``seq_ptr``; w = first = position mod C). Chunk row i < w: the cached k at ``kc_ptr``
    and its solved u and G at ``us_ptr``/``gs_ptr``; row i >= w: the tensors' row
    ``row0 + i - w`` (q and the outputs: ``qrow0 + i - first``). Value head h reads key head
    h // HR. PAGED: the page is read and advanced in place (its state, the new rows' k, v
    bits, g, beta, u and G; the state at the chunk end where the chunk completes; the zero
    state for a sequence at position 0, whose page is not read), q is scaled here by
    ``sc_ptr``'s scale (the same IEEE product), v read as bf16 bits, the outputs rounded to
    bf16 bits here (``exactmath.round_bf16``: the cpu rounding)."""
    h = tl.program_id(0)
    vb = tl.program_id(1)
    if PAGED:
        seq = tl.program_id(2)
        row0 = tl.load(seq_ptr + seq * 4).to(tl.int64)
        n = tl.load(seq_ptr + seq * 4 + 1)
        p = tl.load(seq_ptr + seq * 4 + 2)
        w = p % C
        slot = tl.load(seq_ptr + seq * 4 + 3).to(tl.int64)
        m = w + n
        first = w
        qrow0 = row0
        live = p > 0  # a sequence at position 0 starts from the zero state: its page unread
        sc = tl.load(sc_ptr)
    else:
        m = m_arg
        w = w_arg
        first = first_arg
        row0 = w_arg
        qrow0 = 0
        slot = 0
        live = m_arg > 0
    hk = h // HR
    rows = tl.arange(0, C)
    ks = tl.arange(0, KP)
    vs = vb * BV + tl.arange(0, BV)
    kin = ks < K
    vin = vs < V
    cached = rows < w
    # k rows of the chunk [C, KP] (+0 past m and past K), the start state [KP, BV].
    kh = tl.where(
        cached[:, None],
        tl.load(
            kc_ptr + slot * skc_p + rows[:, None] * skc_t + hk * skc_h + ks[None, :],
            mask=cached[:, None] & kin[None, :],
            other=0.0,
        ),
        tl.load(
            kn_ptr + (row0 + rows[:, None] - w) * sk_t + hk * sk_h + ks[None, :],
            mask=(rows[:, None] >= w) & (rows[:, None] < m) & kin[None, :],
            other=0.0,
        ),
    )
    s_at = s0_ptr + slot * ss_p + h * K * V
    s_mask = (kin[:, None] & vin[None, :]) & live
    s0 = tl.load(s_at + ks[:, None] * V + vs[None, :], mask=s_mask, other=0.0)
    # G: the first w rows as solved before; then left to right from the last of them (or g_0).
    gs_at = gs_ptr + slot * sgs_p
    gcum = tl.load(gs_at + rows * sgs_t + h, mask=cached, other=0.0)
    g0 = tl.load(g_ptr + row0 * sg_t + h)
    acc = tl.where(w > 0, tl.load(gs_at + (w - 1) * sgs_t + h, mask=w > 0, other=0.0), g0)
    gcum = tl.where((rows == 0) & (w == 0), g0, gcum)
    for i in range(tl.maximum(w, 1), m):
        acc = acc + tl.load(g_ptr + (row0 + i - w) * sg_t + h)
        gcum = tl.where(rows == i, acc, gcum)
    new_rows = (rows < m) & (rows >= w)
    tl.store(gc_ptr + slot * sgc_p + rows * sgc_t + h, gcum, mask=new_rows & (vb == 0))
    # u: the first w rows as solved before, the rest solved below.
    u = tl.load(
        us_ptr + slot * sus_p + rows[:, None] * sus_t + h * sus_h + vs[None, :],
        mask=cached[:, None] & vin[None, :],
        other=0.0,
    )
    for i in range(w, m):
        gi = _at(gcum, rows, i)
        gam_i = _exp(gi)
        dec_i = tl.where(rows <= i, _exp(gi - gcum), 0.0)  # exp(G_i - G_j), j <= i
        at = row0 + i - w
        beta_i = tl.load(b_ptr + at * sg_t + h)
        k_i = tl.load(kn_ptr + at * sk_t + hk * sk_h + ks, mask=kin, other=0.0)
        kk_i = _tree_cols(k_i[None, :] * kh, C, KP, LOGK)  # k_i . k_j over K
        a_i = tl.where(rows < i, beta_i * (kk_i * dec_i), 0.0)
        sk_i = _tree_rows(s0 * k_i[:, None], KP, BV, LOGK)  # S0^T k_i
        if PAGED:
            v_bits = tl.load(v_ptr + at * sv_t + h * sv_h + vs, mask=vin, other=0)
            v_i = _widen(v_bits)
            # the new row into the page (rows no program of this step reads from the page)
            tl.store(pv_ptr + slot * spv_p + (i * tl.num_programs(0) + h) * V + vs, v_bits,
                     mask=vin)  # fmt: skip
            first_of_head = (vb == 0) & (h % HR == 0)
            tl.store(kc_ptr + slot * skc_p + i * skc_t + hk * skc_h + ks, k_i,
                     mask=kin & first_of_head)  # fmt: skip
            g_at = i * tl.num_programs(0) + h
            tl.store(pg_ptr + slot * spg_p + g_at, tl.load(g_ptr + at * sg_t + h), mask=vb == 0)
            tl.store(pb_ptr + slot * spg_p + g_at, beta_i, mask=vb == 0)
        else:
            v_i = tl.load(v_ptr + at * sv_t + h * sv_h + vs, mask=vin, other=0.0)
        r_i = beta_i * (v_i - gam_i * sk_i)
        prod = tl.where(rows[:, None] < i, a_i[:, None] * u, 0.0)
        u_i = r_i - _tree_rows(prod, C, BV, LOGC)
        u = tl.where(rows[:, None] == i, u_i[None, :], u)
        tl.store(u_ptr + slot * su_p + i * su_t + h * su_h + vs, u_i, mask=vin)
        if i >= first:
            # o_i = gamma_i * (S0^T q_i) + tree_C(q_i.k_j * exp(G_i - G_j) * u_j), j <= i
            qo = qrow0 + i - first
            q_i = tl.load(q_ptr + qo * sq_t + hk * sq_h + ks, mask=kin, other=0.0)
            if PAGED:
                q_i = q_i * sc
            qk_i = _tree_cols(q_i[None, :] * kh, C, KP, LOGK)
            p_i = tl.where(rows <= i, qk_i * dec_i, 0.0)
            intra = _tree_rows(tl.where(rows[:, None] <= i, p_i[:, None] * u, 0.0), C, BV, LOGC)
            sq_i = _tree_rows(s0 * q_i[:, None], KP, BV, LOGK)
            o_i = gam_i * sq_i + intra
            if PAGED:
                tl.store(o_ptr + qo * so_t + h * so_h + vs, _round_bf16(o_i), mask=vin)
            else:
                tl.store(o_ptr + qo * so_t + h * so_h + vs, o_i, mask=vin)
    if m == C:
        # S_end = gamma_last * S0 + tree_C((exp(G_last - G_j) * k_j) u_j^T), row by row of K.
        g_last = _at(gcum, rows, C - 1)
        gam_last = _exp(g_last)
        dec_last = _exp(g_last - gcum)
        se_at = se_ptr + slot * sse_p + h * K * V  # PAGED: the page's own state, in place
        if PAGED:
            tl.debug_barrier()  # every thread's start-state loads before any row is replaced
        for kk in range(0, K):
            k_col = tl.where(
                cached,
                tl.load(kc_ptr + slot * skc_p + rows * skc_t + hk * skc_h + kk, mask=cached,
                        other=0.0),
                tl.load(kn_ptr + (row0 + rows - w) * sk_t + hk * sk_h + kk, mask=rows >= w,
                        other=0.0),
            )  # fmt: skip
            upd = _tree_rows((dec_last * k_col)[:, None] * u, C, BV, LOGC)
            s_row = tl.load(s_at + kk * V + vs, mask=vin & live, other=0.0)
            if PAGED:
                tl.debug_barrier()  # the row read by every thread before it is replaced
            tl.store(se_at + kk * V + vs, gam_last * s_row + upd, mask=vin)
    if PAGED:  # noqa: SIM102 (a compile-time branch around a run-time one)
        # the zero state into the page of a sequence that starts here (a padding entry, no
        # rows, writes nothing)
        if (m < C) & (p == 0) & (n > 0):
            for kk in range(0, K):
                tl.store(s_at + kk * V + vs, tl.zeros([BV], tl.float32), mask=vin)


def _warps(c: int, kp: int) -> int:
    """8 warps hold a K = 128 chunk without spilling (ptxas, sm_90a: 188 registers; at 4,
    255 and spills); the bytes do not depend on it."""
    return 8 if c * kp >= 4096 else 4


def chunk(s0, q, k, v, g, beta, first, chunk_size, solved=None):
    """The cpu backend's ``_chunk`` (same arguments, same returns, same bytes) in one launch.

    s0 [H, K, V]; q [m-first, H, K] (scaled); k [m, H, K]; v [m, H, V]; g, beta [m, H]; all
    fp32 on one CUDA device; ``solved``: (u [w, H, V], G [w, H]) of the first w rows, or None.
    Returns (out [m-first, H, V], the state at the chunk end if m == C else None, u [m, H, V],
    G [m, H]).
    """
    require_cuda(s0, q, k, v, g, beta)
    return run(s0, q, k, v, g, beta, first, chunk_size, solved)


def run(s0, q, k, v, g, beta, first, chunk_size, solved=None):
    """``chunk`` without the device check: the launch itself (Triton's interpreter runs it on
    cpu tensors, for the checks of ``tools/gpu/interpret``)."""
    h, d_k, d_v = s0.shape
    m = k.shape[0]
    c = chunk_size
    require(1 <= m <= c and 0 <= first < m, f"gdn chunk: {m} rows from {first} in a chunk of {c}")
    dev = s0.device
    if solved is None:
        u_in = torch.zeros(0, h, d_v, dtype=F32, device=dev)
        g_in = torch.zeros(0, h, dtype=F32, device=dev)
    else:
        u_in, g_in = (t.contiguous() for t in solved)
    w = u_in.shape[0]
    require(w <= first, f"gdn chunk: {w} solved rows, outputs from row {first}")
    s0, q, k, v, g, beta = (t.contiguous() for t in (s0, q, k, v, g, beta))
    u = torch.empty(m, h, d_v, dtype=F32, device=dev)
    u[:w] = u_in
    gc = torch.empty(m, h, dtype=F32, device=dev)
    gc[:w] = g_in
    out = torch.empty(m - first, h, d_v, dtype=F32, device=dev)
    last = m == c
    s_end = torch.empty(h, d_k, d_v, dtype=F32, device=dev) if last else out
    kp = next_pow2(d_k)
    _chunk_kernel[(h, triton.cdiv(d_v, _BV))](
        s0, k, k, v, g, beta, q, u_in, g_in,
        u, gc, out, s_end, gc, gc, gc, gc, gc,
        m, w, first, d_k, d_v, 1,
        0, 0, 0, k.stride(0), k.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), q.stride(0), q.stride(1),
        0, u_in.stride(0), u_in.stride(1), 0, g_in.stride(0),
        0, u.stride(0), u.stride(1), 0, gc.stride(0), out.stride(0), out.stride(1), 0, 0,
        C=c, LOGC=c.bit_length() - 1, KP=kp, LOGK=kp.bit_length() - 1, BV=_BV, PAGED=False,
        num_warps=_warps(c, kp), **EXACT,
    )  # fmt: skip
    return out, (s_end if last else None), u, gc


def run_paged(q, k, v, g, beta, pages, seqs, scale):
    """The chunk pass of every sequence of ``seqs`` (``cpu.gdn.PagedSeqs``: each one's rows
    inside one chunk) in one launch, from and into its state page (``cpu.gdn.GdnPages``,
    advanced in place), without the device check. q, k [T, Hk, K] fp32 (gdn.l2norm's), v
    [T, Hv, V] bf16, g, beta [T, Hv] fp32, ``scale`` a 0-dim fp32 tensor (q's factor).
    Returns out bf16 [T, Hv, V]."""
    t, h_k, d_k = k.shape
    h_v, d_v = v.shape[1:]
    c = seqs.chunk
    for name in ("s", "k", "v", "g", "beta", "u", "gcum"):  # a page's rows indexed as packed
        one = getattr(pages, name)[0]
        require(one.is_contiguous(), f"gdn paged: page tensor {name!r} is not packed in its page")
    require(pages.g.stride(0) == pages.beta.stride(0), "gdn paged: g and beta pages differ")
    q, k, g, beta = (x.contiguous() for x in (q, k, g, beta))
    v = v.contiguous().view(torch.int16)
    out = torch.empty(t, h_v, d_v, dtype=torch.int16, device=v.device)
    kp = next_pow2(d_k)
    _chunk_kernel[(h_v, triton.cdiv(d_v, _BV), seqs.count)](
        pages.s, pages.k, k, v, g, beta, q, pages.u, pages.gcum,
        pages.u, pages.gcum, out, pages.s, seqs.table, scale, pages.v.view(torch.int16),
        pages.g, pages.beta,
        0, 0, 0, d_k, d_v, h_v // h_k,
        pages.s.stride(0), pages.s.stride(0), pages.k.stride(0), pages.k.stride(1),
        pages.k.stride(2), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0),
        q.stride(0), q.stride(1),
        pages.u.stride(0), pages.u.stride(1), pages.u.stride(2), pages.gcum.stride(0),
        pages.gcum.stride(1),
        pages.u.stride(0), pages.u.stride(1), pages.u.stride(2), pages.gcum.stride(0),
        pages.gcum.stride(1), out.stride(0), out.stride(1), pages.v.stride(0), pages.g.stride(0),
        C=c, LOGC=c.bit_length() - 1, KP=kp, LOGK=kp.bit_length() - 1, BV=_BV, PAGED=True,
        num_warps=_warps(c, kp), **EXACT,
    )  # fmt: skip
    return out.view(torch.bfloat16)


__all__ = ["chunk", "run", "run_paged"]
