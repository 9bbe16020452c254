"""attention.blocked on the GPU: causal GQA over absolute-position-aligned KV blocks.

The keys of a sequence are cut into blocks of ``block`` positions and the blocks into
segments of SEGMENT positions, both aligned to absolute position 0. A query row's state is
built segment by segment; segments are merged in ascending order. A prefill does this inside
one kernel; a decode (few rows) computes the segments in parallel and merges them in a second
kernel with the same merge code, so the operation sequence of a row is the same either way.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..cpu.attention import check_inputs, default_scale
from .arith import EXACT, F32, next_pow2, require, require_cuda

SEGMENT = 2048  # keys per segment: part of the cuda program (moving it moves bytes)
# (query rows per tile, warps): 16 rows per warp either way, so each row sees the same MMA
# instruction shape and the same reduction layout; the decode tiling is gated bitwise against
# the prefill one (test_attention_prefill_chunked_and_decode_give_the_same_row_bytes).
_PREFILL_TILE = (128, 8)
_DECODE_TILE = (64, 4)
_NUM_STAGES = 3
_COMBINE_ROWS = 16


@functools.cache
def _default_scale(d: int) -> float:
    return float(default_scale(d).item())  # fp32 by construction (IEEE sqrt and division)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@triton.jit
def _segment(
    q,
    k_base,
    v_base,
    stride_ks,
    stride_vs,
    pos,
    kv_lim,
    j_lo,
    j_hi,
    j_full,
    scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
):
    """Online-softmax state of the rows over key blocks [j_lo, j_hi), ascending.

    Blocks below j_full are visible to every row of the tile and skip the masks; the masked
    loop computes the same values for such a block, so the split point moves no byte.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    j_mid = tl.maximum(j_lo, tl.minimum(j_hi, j_full))
    for j in range(j_lo, j_mid):
        kpos = j * BLOCK_N + offs_n
        k = tl.load(k_base + kpos[:, None] * stride_ks + offs_d[None, :])
        v = tl.load(v_base + kpos[:, None] * stride_vs + offs_d[None, :])
        s = tl.dot(q, tl.trans(k)) * scale
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
        m = m_new
    for j in range(j_mid, j_hi):
        kpos = j * BLOCK_N + offs_n
        in_kv = (kpos < kv_lim)[:, None]
        k = tl.load(k_base + kpos[:, None] * stride_ks + offs_d[None, :], mask=in_kv, other=0.0)
        v = tl.load(v_base + kpos[:, None] * stride_vs + offs_d[None, :], mask=in_kv, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(kpos[None, :] <= pos[:, None], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        active = pos >= j * BLOCK_N  # the row has at least one visible key in this block
        m_safe = tl.where(active, m_new, 0.0)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_new = l_sum * alpha + tl.sum(p, 1)
        acc_new = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
        m = tl.where(active, m_new, m)
        l_sum = tl.where(active, l_new, l_sum)
        acc = tl.where(active[:, None], acc_new, acc)
    return m, l_sum, acc


@triton.jit
def _merge(m_g, l_g, a_g, m_s, l_s, a_s, active):
    """Fold one segment's state into the running one (rows where ``active``)."""
    m_new = tl.maximum(m_g, m_s)
    m_safe = tl.where(active, m_new, 0.0)
    alpha = tl.exp(m_g - m_safe)
    beta = tl.exp(m_s - m_safe)
    l_new = l_g * alpha + l_s * beta
    a_new = a_g * alpha[:, None] + a_s * beta[:, None]
    m_g = tl.where(active, m_new, m_g)
    l_g = tl.where(active, l_new, l_g)
    a_g = tl.where(active[:, None], a_new, a_g)
    return m_g, l_g, a_g


@triton.jit
def _finish(o_ptr, t, head, stride_ot, stride_oh, l_g, a_g, row_ok, D: tl.constexpr):
    num, den = tl.broadcast(a_g, l_g[:, None])
    out = tl.math.div_rn(num, den)
    out = tl.where(out == 0.0, 0.0, out)  # +0 for every zero: signs of zero terms move no byte
    offs_d = tl.arange(0, D)
    dst = o_ptr + t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
    tl.store(dst, out.to(tl.bfloat16), mask=row_ok[:, None])


@triton.jit
def _one_segment(
    q, k_base, v_base, stride_ks, stride_vs, pos, kv_lim, j_last, j_full, scale,
    o_ptr, t, head, stride_ot, stride_oh, row_ok,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """Rows whose keys all lie in the first segment: the same merge from the initial state,
    with no second accumulator live across the key loop (the registers it would cost)."""
    m, l_s, acc = _segment(
        q, k_base, v_base, stride_ks, stride_vs, pos, kv_lim, 0, j_last + 1, j_full,
        scale, BLOCK_M, BLOCK_N, D,
    )  # fmt: skip
    m_g = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_g = tl.zeros([BLOCK_M], tl.float32)
    a_g = tl.zeros([BLOCK_M, D], tl.float32)
    m_g, l_g, a_g = _merge(m_g, l_g, a_g, m, l_s, acc, pos >= 0)
    _finish(o_ptr, t, head, stride_ot, stride_oh, l_g, a_g, row_ok, D)


@triton.jit
def _attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    pos_ptr,
    m_buf,
    l_buf,
    a_buf,
    n_rows,
    n_kv_heads,
    kv_len,
    scale,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEG_BLOCKS: tl.constexpr,
    SEG: tl.constexpr,
    SPLIT: tl.constexpr,
    ONE_SEG: tl.constexpr,
):
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    tile = n_tiles - 1 - tl.program_id(0)  # the longest rows first
    h = tl.program_id(1)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    t = rows // G  # row = token * G + query head within the kv head's group
    head = h * G + rows % G
    pos = tl.load(pos_ptr + t, mask=row_ok, other=-1)
    offs_d = tl.arange(0, D)
    q_src = q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_src, mask=row_ok[:, None], other=0.0)
    pos_max = tl.max(pos, 0)
    pos_min = tl.min(tl.where(row_ok, pos, 2147483647), 0)
    j_last = pos_max // BLOCK_N
    j_full = (pos_min + 1) // BLOCK_N
    kv_lim = tl.minimum(kv_len, pos_max + 1)  # keys past the last query are never loaded
    k_base = k_ptr + h * stride_kh
    v_base = v_ptr + h * stride_vh
    if SPLIT:
        s_idx = tl.program_id(2)
        if s_idx * SEG <= pos_max:
            j_lo = s_idx * SEG_BLOCKS
            j_hi = tl.minimum(j_lo + SEG_BLOCKS, j_last + 1)
            m, l_s, acc = _segment(
                q, k_base, v_base, stride_ks, stride_vs, pos, kv_lim, j_lo, j_hi, j_full,
                scale, BLOCK_M, BLOCK_N, D,
            )  # fmt: skip
            at = (s_idx * n_kv_heads + h) * n_rows + rows
            tl.store(m_buf + at, m, mask=row_ok)
            tl.store(l_buf + at, l_s, mask=row_ok)
            tl.store(a_buf + at[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None])
    elif ONE_SEG:
        # The cache holds no key past the first segment: only the one-segment path is
        # compiled, so no registers are reserved for the multi-segment loop.
        _one_segment(
            q, k_base, v_base, stride_ks, stride_vs, pos, kv_lim, j_last, j_full, scale,
            o_ptr, t, head, stride_ot, stride_oh, row_ok, BLOCK_M, BLOCK_N, D,
        )  # fmt: skip
    elif j_last < SEG_BLOCKS:
        _one_segment(
            q, k_base, v_base, stride_ks, stride_vs, pos, kv_lim, j_last, j_full, scale,
            o_ptr, t, head, stride_ot, stride_oh, row_ok, BLOCK_M, BLOCK_N, D,
        )  # fmt: skip
    else:
        m_g = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_g = tl.zeros([BLOCK_M], tl.float32)
        a_g = tl.zeros([BLOCK_M, D], tl.float32)
        for s_idx in range(0, j_last // SEG_BLOCKS + 1):
            j_lo = s_idx * SEG_BLOCKS
            j_hi = tl.minimum(j_lo + SEG_BLOCKS, j_last + 1)
            m, l_s, acc = _segment(
                q, k_base, v_base, stride_ks, stride_vs, pos, kv_lim, j_lo, j_hi, j_full,
                scale, BLOCK_M, BLOCK_N, D,
            )  # fmt: skip
            m_g, l_g, a_g = _merge(m_g, l_g, a_g, m, l_s, acc, pos >= s_idx * SEG)
        _finish(o_ptr, t, head, stride_ot, stride_oh, l_g, a_g, row_ok, D)


@triton.jit
def _combine_kernel(
    o_ptr,
    pos_ptr,
    m_buf,
    l_buf,
    a_buf,
    n_rows,
    n_kv_heads,
    stride_ot,
    stride_oh,
    G: tl.constexpr,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    SEG: tl.constexpr,
):
    h = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    t = rows // G
    head = h * G + rows % G
    pos = tl.load(pos_ptr + t, mask=row_ok, other=-1)
    offs_d = tl.arange(0, D)
    m_g = tl.full([ROWS], float("-inf"), tl.float32)
    l_g = tl.zeros([ROWS], tl.float32)
    a_g = tl.zeros([ROWS, D], tl.float32)
    for s_idx in range(0, tl.max(pos, 0) // SEG + 1):
        active = pos >= s_idx * SEG
        at = (s_idx * n_kv_heads + h) * n_rows + rows
        m = tl.load(m_buf + at, mask=active, other=float("-inf"))
        l_s = tl.load(l_buf + at, mask=active, other=0.0)
        acc = tl.load(a_buf + at[:, None] * D + offs_d[None, :], mask=active[:, None], other=0.0)
        m_g, l_g, a_g = _merge(m_g, l_g, a_g, m, l_s, acc, active)
    _finish(o_ptr, t, head, stride_ot, stride_oh, l_g, a_g, row_ok, D)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: torch.Tensor | float | None = None,
    block: int = 32,
    split: bool | None = None,
) -> torch.Tensor:
    """Causal attention of the queries of ONE sequence (the cpu program's interface).

    q [T, Hq, D] bf16 at absolute ``positions`` [T]; k, v [S, Hkv, D] bf16 hold the keys and
    values of positions 0..S-1 (S > max(positions); keys past the largest query position are
    never read, so a cache may hold anything there). Query t attends to keys 0..t. Per row:

      for each segment of SEGMENT keys, ascending, a fresh state (m=-inf, l=0, acc=0) and for
      each block of ``block`` keys in it, ascending:
        s = mma_D(q, k) * scale                masked (key > t) -> -inf
        m' = max(m, max_block(s)); a = exp(m - m'); p = exp(s - m')
        l' = l*a + sum_B(p);  acc' = mma_B(bf16(p), v, acc*a)
      then merged into the running state: M = max(Mg, m); a = exp(Mg - M); b = exp(m - M);
        Lg = Lg*a + l*b; Ag = Ag*a + acc*b
      out = bf16(Ag / Lg) (IEEE division), zeros as +0.

    exp is tl.exp (ex2.approx.f32 of x*log2(e): a fixed instruction, deterministic on one
    GPU arch). p is materialized in bf16 for the PV product (the tensor-core operand); l sums
    the fp32 p. The MMA shapes are fixed (16 query rows per warp, ``block`` keys), so the
    sequence is the same in a prefill, a chunk of a chunked prefill, and a decode step.
    ``split`` (None: by shape) only chooses where the merge runs; it moves no byte.
    """
    require_cuda(q, k, v)
    n_q, h_q, d, s_len, h_kv = check_inputs(q, k, v, positions)
    require(d == next_pow2(d) and 16 <= d <= 256, f"attention (cuda): head dim {d} unsupported")
    require(
        block == next_pow2(block) and 16 <= block <= 128,
        f"attention (cuda): block must be a power of two in [16, 128], got {block}",
    )
    if n_q == 0:
        return q.clone()
    if positions.is_cuda:
        torch._assert_async(((positions >= 0) & (positions < s_len)).all())
    else:
        require(int(positions.min()) >= 0, "attention: negative position")
        require(int(positions.max()) < s_len, "attention: a query position has no key in k/v")
    if scale is None:
        scale_f = _default_scale(d)
    else:
        scale_f = float(scale.item() if isinstance(scale, torch.Tensor) else scale)
        require(torch.tensor(scale_f, dtype=F32).item() == scale_f, "attention: scale must be fp32")
    require(max(q.numel(), k.numel()) < 2**31, "attention (cuda): tensor too large")
    g = h_q // h_kv
    pos = positions.to(device=q.device, dtype=torch.int32).contiguous()
    qc = q.contiguous()
    kc = k.contiguous()
    vc = v.contiguous()
    out = torch.empty_like(qc)
    n_rows = n_q * g
    n_seg = triton.cdiv(s_len, SEGMENT)
    if split is None:
        sms = _sm_count(
            q.device.index if q.device.index is not None else torch.cuda.current_device()
        )
        few = triton.cdiv(n_rows, _PREFILL_TILE[0]) * h_kv < sms
        split = n_seg > 1 and few
    else:
        few = False
    # Few rows (decode, short chunks) take the smaller tile, split or not: fewer idle rows
    # per program. Gated bitwise like the split (decode and chunks against the prefill).
    block_m, num_warps = _DECODE_TILE if split or few else _PREFILL_TILE
    n_tiles = triton.cdiv(n_rows, block_m)
    if split:
        m_buf = torch.empty(n_seg, h_kv, n_rows, dtype=F32, device=q.device)
        l_buf = torch.empty_like(m_buf)
        a_buf = torch.empty(n_seg, h_kv, n_rows, d, dtype=F32, device=q.device)
        grid = (n_tiles, h_kv, n_seg)
    else:
        m_buf = l_buf = a_buf = out  # unused
        grid = (n_tiles, h_kv)
    _attn_kernel[grid](
        qc, kc, vc, out, pos, m_buf, l_buf, a_buf,
        n_rows, h_kv, s_len, scale_f,
        qc.stride(0), qc.stride(1), kc.stride(0), kc.stride(1),
        vc.stride(0), vc.stride(1), out.stride(0), out.stride(1),
        G=g, D=d, BLOCK_M=block_m, BLOCK_N=block, SEG_BLOCKS=SEGMENT // block, SEG=SEGMENT,
        SPLIT=bool(split), ONE_SEG=n_seg == 1,
        num_warps=num_warps, num_stages=_NUM_STAGES, **EXACT,
    )  # fmt: skip
    if split:
        _combine_kernel[(triton.cdiv(n_rows, _COMBINE_ROWS), h_kv)](
            out, pos, m_buf, l_buf, a_buf, n_rows, h_kv, out.stride(0), out.stride(1),
            G=g, D=d, ROWS=_COMBINE_ROWS, SEG=SEGMENT, num_warps=4, **EXACT,
        )  # fmt: skip
    return out


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` rows of one sequence, copied out of a paged cache: ``cache``
    [num_blocks, Hkv, page, D] (a strided view is fine), ``block_table`` the sequence's block
    ids in position order; returns [seq_len, Hkv, D], position t read from block
    ``block_table[t // page]``, row ``t % page``. A copy: no arithmetic, so no byte moves."""
    require_cuda(cache)
    require(cache.dim() == 4, "gather_pages: cache [num_blocks, Hkv, page, D]")
    _, h_kv, page, d = cache.shape
    n_pages = triton.cdiv(seq_len, page)
    require(block_table.numel() >= n_pages, "gather_pages: the block table is too short")
    ids = block_table[:n_pages].to(device=cache.device, dtype=torch.int64)
    rows = cache[ids].transpose(1, 2).reshape(n_pages * page, h_kv, d)
    return rows[:seq_len]


def attention_paged(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    positions: torch.Tensor,
    *,
    scale: torch.Tensor | float | None = None,
    block: int = 32,
) -> torch.Tensor:
    """attention.blocked for ONE sequence whose keys and values sit in a paged cache.

    ``key_cache``/``value_cache`` [num_blocks, Hkv, page, D] bf16 (vLLM's pages, viewed per
    half), ``block_table`` the sequence's block ids, ``seq_len`` its keys in the cache. The
    pages are gathered into contiguous [seq_len, Hkv, D] copies and ``attention`` runs on
    them, so every row has the contiguous program's bytes by construction (issue 11); a
    kernel reading the pages in place is issue 12's work."""
    k = gather_pages(key_cache, block_table, seq_len)
    v = gather_pages(value_cache, block_table, seq_len)
    return attention(q, k, v, positions, scale=scale, block=block)
