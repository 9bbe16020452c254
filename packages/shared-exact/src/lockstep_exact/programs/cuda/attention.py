"""attention.blocked on the GPU: causal GQA over absolute-position-aligned KV blocks.

The keys of a sequence are cut into blocks of ``block`` positions and the blocks into
segments of ``segment`` positions (both program parameters), aligned to absolute position 0.
A query row's state is built segment by segment; segments are merged in ascending order. A
prefill does this inside one kernel; a decode (few rows) computes the segments in parallel and
merges them in a second kernel with the same merge code, so the operation sequence of a row is
the same either way.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..cpu.attention import check_inputs, check_starts, check_tiling, default_scale, spans
from ..kernels import note
from . import attention_hopper
from .arith import (
    BF16,
    EXACT,
    F32,
    INDEX_DTYPES,
    index_tensor,
    next_pow2,
    require,
    require_cuda,
    trap_if,
)

# (query rows per tile, warps): 16 rows per warp in every tiling, so each row sees the same
# MMA instruction shape and the same reduction layout. One 64-row warpgroup per program (two
# programs fit on a multiprocessor, where one 128-row program of 8 warps did: 1.2-1.3x faster
# prefill on the H200, docs/gpu.md); the one-warp tile serves the paged decode, whose programs
# hold one token's query heads. Both are gated bitwise against each other
# (test_attention_prefill_chunked_and_decode_give_the_same_row_bytes,
# test_paged_decode_gives_each_request_the_contiguous_bytes). Two-warp tiles are not: a
# 32-row tile gave other bytes for a 100-row chunk on the H200.
_TILE = (64, 4)
_ONE_WARP_TILE = (16, 1)
_NUM_STAGES = 3
_TABLE_HELD_MAX = 64  # table entries the paged decode's 64-row tile holds (pages >= 16 at 512)
# The combine kernel's program: 4 rows (one token's query heads of a kv head, at 4 per group)
# by 32 columns of the head. Its merges run in sequence, so a long row's time is the chain of
# one program: few elements a thread keep each step short. Against 16 rows by the whole head,
# one request on the H200: 1.12-1.18x faster replayed among twenty calls, 64 requests the
# same (gated on the GPU, docs/gpu.md). Each column merges on its own: every cut, the same bytes.
_COMBINE_ROWS = 4
_COMBINE_COLS = 32
# The prefill without the split runs attention_hopper's kernel where it is usable (an sm_90
# GPU, heads of 64 or 128, blocks of 32 or 64): the same bytes, gated against this module's
# kernel (test_the_hopper_prefill_gives_the_triton_kernel_bytes, which turns this off).
_HOPPER_PREFILL = True


@functools.cache
def _default_scale(d: int) -> float:
    return float(default_scale(d).item())  # fp32 by construction (IEEE sqrt and division)


def _sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (the current device when it names no index)."""
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@triton.jit
def _page_rows(kpos, bt_ptr, stride_ks, stride_vs, stride_kp, stride_vp, PAGE: tl.constexpr):
    """Element offsets of the K and V rows of key positions ``kpos`` in a paged cache (64-bit:
    a cache may hold more than 2**31 elements)."""
    page = tl.load(bt_ptr + kpos // PAGE)
    return _rows_in(page, kpos, stride_ks, stride_vs, stride_kp, stride_vp, PAGE)


@triton.jit
def _rows_in(page, kpos, stride_ks, stride_vs, stride_kp, stride_vp, PAGE: tl.constexpr):
    """Element offsets of the K and V rows of key positions ``kpos``, which sit in ``page``."""
    page = page.to(tl.int64)
    row = (kpos % PAGE).to(tl.int64)
    return page * stride_kp + row * stride_ks, page * stride_vp + row * stride_vs


@triton.jit
def _decode_pos(positions_ptr, stride_p, seq_lens_ptr, stride_sl, r, reach):
    """Request r's query position and key count in a paged decode, read in the kernel (no
    host-side preparation kernels): keys past ``reach`` (the table's and the segments' reach)
    are never read, and a request with no keys, or whose position is negative or not below its
    key count, attends nothing (position -1)."""
    lens = tl.load(seq_lens_ptr + r * stride_sl).to(tl.int64)
    p = tl.load(positions_ptr + r * stride_p).to(tl.int64)
    kv_len = tl.minimum(lens, reach)
    p = tl.where((lens > 0) & (p >= 0) & (p < kv_len), p, -1)
    return p.to(tl.int32), kv_len.to(tl.int32)


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
    bt_ptr,
    stride_kp,
    stride_vp,
    PAGE: tl.constexpr,
    NP: tl.constexpr,
):
    """Online-softmax state of the rows over key blocks [j_lo, j_hi), ascending.

    Blocks below j_full are visible to every row of the tile and skip the masks; the masked
    loop computes the same values for such a block, so the split point moves no byte.
    ``PAGE`` > 0: the keys sit in a paged cache, key position p in page ``bt_ptr[p // PAGE]``
    (pages ``stride_kp``/``stride_vp`` apart), row p % PAGE; only the addresses differ, the
    arithmetic is the contiguous one's. ``NP`` > 0: the unmasked loop loads the segment's
    table entries once (``NP`` of them, at least the pages its keys span) and takes each
    block's pages from those registers (``tl.gather``), so no table load stands in the key
    loop (one request on the H200, pages of 16: 1.12-1.14x faster at 2048 and 8192 keys;
    pages of 32: 1.05x). ``NP`` = 0: it looks the next block's pages up one step early
    (1.16-1.20x against looking them up in place).
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    j_mid = tl.maximum(j_lo, tl.minimum(j_hi, j_full))
    k_next = offs_n.to(tl.int64)  # the paged rows of the next block (a placeholder unpaged)
    v_next = k_next
    if PAGE > 0:
        if NP > 0:
            first = (j_lo * BLOCK_N) // PAGE  # the segment's first page, and its entries:
            at = first + tl.arange(0, NP)
            held = tl.load(bt_ptr + at, mask=at <= (j_mid * BLOCK_N - 1) // PAGE, other=0)
        else:
            k_next, v_next = _page_rows(
                j_lo * BLOCK_N + offs_n, bt_ptr, stride_ks, stride_vs, stride_kp, stride_vp, PAGE
            )  # fmt: skip
    for j in range(j_lo, j_mid):
        kpos = j * BLOCK_N + offs_n
        if PAGE > 0:
            if NP > 0:
                k_row, v_row = _rows_in(
                    tl.gather(held, kpos // PAGE - first, 0), kpos, stride_ks, stride_vs,
                    stride_kp, stride_vp, PAGE,
                )  # fmt: skip
            else:
                k_row, v_row = k_next, v_next
                k_next, v_next = _page_rows(
                    tl.minimum(j + 1, j_mid - 1) * BLOCK_N + offs_n, bt_ptr, stride_ks,
                    stride_vs, stride_kp, stride_vp, PAGE,
                )  # fmt: skip
            k = tl.load(k_base + k_row[:, None] + offs_d[None, :])
            v = tl.load(v_base + v_row[:, None] + offs_d[None, :])
        else:
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
        if PAGE > 0:
            k_row, v_row = _page_rows(
                tl.where(kpos < kv_lim, kpos, 0), bt_ptr, stride_ks, stride_vs, stride_kp,
                stride_vp, PAGE,
            )  # fmt: skip
            k = tl.load(k_base + k_row[:, None] + offs_d[None, :], mask=in_kv, other=0.0)
            v = tl.load(v_base + v_row[:, None] + offs_d[None, :], mask=in_kv, other=0.0)
        else:
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
def _finish(o_ptr, t, head, stride_ot, stride_oh, l_g, a_g, row_ok, offs_d):
    """Write out = bf16(a_g / l_g) (IEEE division) at the rows' heads, columns ``offs_d``;
    ``l_g`` [ROWS, 1] or [ROWS, COLS] (broadcast against ``a_g``)."""
    num, den = tl.broadcast(a_g, l_g)
    out = tl.math.div_rn(num, den)
    out = tl.where(out == 0.0, 0.0, out)  # +0 for every zero: signs of zero terms move no byte
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
        scale, BLOCK_M, BLOCK_N, D, o_ptr, 0, 0, 0, 0,
    )  # fmt: skip
    m_g = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_g = tl.zeros([BLOCK_M], tl.float32)
    a_g = tl.zeros([BLOCK_M, D], tl.float32)
    m_g, l_g, a_g = _merge(m_g, l_g, a_g, m, l_s, acc, pos >= 0)
    _finish(o_ptr, t, head, stride_ot, stride_oh, l_g[:, None], a_g, row_ok, tl.arange(0, D))


@triton.jit(do_not_specialize=["n_rows", "kv_len"])
def _attn_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    pos_ptr,
    stride_p,
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
    # Axis 0 walks (tile, kv head) with the kv head fastest and the tiles longest first, so
    # programs start in order of length over all heads and the short tiles fill the last wave
    h = tl.program_id(0) % n_kv_heads
    tile = n_tiles - 1 - tl.program_id(0) // n_kv_heads
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    t = rows // G  # row = token * G + query head within the kv head's group
    head = h * G + rows % G
    pos = tl.load(pos_ptr + t * stride_p, mask=row_ok, other=-1)
    pos = (pos + trap_if(row_ok & ((pos < 0) | (pos >= kv_len)))).to(tl.int32)
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
        s_idx = tl.program_id(1)
        if s_idx * SEG <= pos_max:
            j_lo = s_idx * SEG_BLOCKS
            j_hi = tl.minimum(j_lo + SEG_BLOCKS, j_last + 1)
            m, l_s, acc = _segment(
                q, k_base, v_base, stride_ks, stride_vs, pos, kv_lim, j_lo, j_hi, j_full,
                scale, BLOCK_M, BLOCK_N, D, pos_ptr, 0, 0, 0, 0,
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
                scale, BLOCK_M, BLOCK_N, D, pos_ptr, 0, 0, 0, 0,
            )  # fmt: skip
            m_g, l_g, a_g = _merge(m_g, l_g, a_g, m, l_s, acc, pos >= s_idx * SEG)
        _finish(o_ptr, t, head, stride_ot, stride_oh, l_g[:, None], a_g, row_ok, tl.arange(0, D))


@triton.jit
def _take8(x):
    """The slices x[..., 0], ..., x[..., 7] of x [R, C, 8], in order: copies, no arithmetic."""
    e, o = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], 2, 2, 2]))  # index 4a + 2b + c
    e0, e1 = tl.split(e)
    o0, o1 = tl.split(o)
    s0, s4 = tl.split(e0)
    s2, s6 = tl.split(e1)
    s1, s5 = tl.split(o0)
    s3, s7 = tl.split(o1)
    return s0, s1, s2, s3, s4, s5, s6, s7


@triton.jit
def _merge_cols(m_g, l_g, a_g, m_s, l_s, a_s, active):
    """``_merge`` with every operand [ROWS, COLS]: a row's max and sum repeated along its
    columns, each computed as ``_merge`` computes it once for the row (the same bytes)."""
    m_new = tl.maximum(m_g, m_s)
    m_safe = tl.where(active, m_new, 0.0)
    alpha = tl.exp(m_g - m_safe)
    beta = tl.exp(m_s - m_safe)
    l_new = l_g * alpha + l_s * beta
    a_new = a_g * alpha + a_s * beta
    m_g = tl.where(active, m_new, m_g)
    l_g = tl.where(active, l_new, l_g)
    a_g = tl.where(active, a_new, a_g)
    return m_g, l_g, a_g


@triton.jit
def _load_chunk(
    m_buf, l_buf, a_buf, pos, chunk, h, n_kv_heads, n_rows, rows, offs_d,
    SEG: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """The states of segments 8 * chunk .. 8 * chunk + 7 of ``ROWS`` rows, ``COLS`` columns:
    m, l, acc and the active flags, [ROWS, COLS, 8] each; a segment past a row's position
    is not read (-inf, 0, 0, inactive)."""
    s_idx = chunk * 8 + tl.arange(0, 8)
    active = pos[:, None] >= s_idx[None, :] * SEG
    at = (s_idx[None, :] * n_kv_heads + h) * n_rows + rows[:, None]
    shape: tl.constexpr = [ROWS, COLS, 8]
    flags = tl.broadcast_to(active[:, None, :], shape)
    m = tl.load(m_buf + at, mask=active, other=float("-inf"))
    l_s = tl.load(l_buf + at, mask=active, other=0.0)
    acc = tl.load(a_buf + at[:, None, :] * D + offs_d[None, :, None], mask=flags, other=0.0)
    return (
        tl.broadcast_to(m[:, None, :], shape),
        tl.broadcast_to(l_s[:, None, :], shape),
        acc,
        flags.to(tl.int8),
    )


@triton.jit(do_not_specialize=["n_rows"])
def _combine_kernel(
    o_ptr,
    pos_ptr,
    stride_p,
    seq_lens_ptr,
    stride_sl,
    reach,
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
    PAGED: tl.constexpr,
    COLS: tl.constexpr,
):
    """Merge the segments' states of each row in ascending order and write the output, for
    ``ROWS`` rows and ``COLS`` columns of the head (program axis 2).
    ``PAGED``: the positions are the paged decode's raw ones, checked as its kernel checks
    them (``_decode_pos``); else ``pos_ptr`` holds the int32 or int64 positions that the
    attention kernel before it checked.

    The merges of a row run in sequence; each waited on its own loads when they were issued
    one segment at a time. The states are read eight segments to a load, the next eight
    while these merge, and taken apart by copies (``_take8``): the merges and their order
    are ``_merge``'s, so the bytes are too."""
    h = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    t = rows // G
    head = h * G + rows % G
    if PAGED:
        pos, _ = _decode_pos(
            pos_ptr, stride_p, seq_lens_ptr, stride_sl, tl.where(row_ok, t, 0), reach
        )
        pos = tl.where(row_ok, pos, -1)
    else:
        pos = tl.load(pos_ptr + t * stride_p, mask=row_ok, other=-1).to(tl.int32)
    offs_d = tl.program_id(2) * COLS + tl.arange(0, COLS)
    m_g = tl.full([ROWS, COLS], float("-inf"), tl.float32)
    l_g = tl.zeros([ROWS, COLS], tl.float32)
    a_g = tl.zeros([ROWS, COLS], tl.float32)
    m8, l8, a8, f8 = _load_chunk(
        m_buf, l_buf, a_buf, pos, 0, h, n_kv_heads, n_rows, rows, offs_d, SEG, D, ROWS, COLS
    )
    for c in range(0, tl.cdiv(tl.max(pos, 0) // SEG + 1, 8)):
        m_n, l_n, a_n, f_n = _load_chunk(
            m_buf, l_buf, a_buf, pos, c + 1, h, n_kv_heads, n_rows, rows, offs_d, SEG, D, ROWS,
            COLS,
        )  # fmt: skip
        ms = _take8(m8)
        ls = _take8(l8)
        accs = _take8(a8)
        fs = _take8(f8)
        for i in tl.static_range(8):
            m_g, l_g, a_g = _merge_cols(m_g, l_g, a_g, ms[i], ls[i], accs[i], fs[i] != 0)
        m8, l8, a8, f8 = m_n, l_n, a_n, f_n
    _finish(o_ptr, t, head, stride_ot, stride_oh, l_g, a_g, row_ok, offs_d)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: torch.Tensor | float | None = None,
    block: int,
    segment: int,
    split: bool | None = None,
) -> torch.Tensor:
    """Causal attention of the queries of ONE sequence (the cpu program's interface).

    q [T, Hq, D] bf16 at absolute ``positions`` [T]; k, v [S, Hkv, D] bf16 hold the keys and
    values of positions 0..S-1 (S > max(positions); keys past the largest query position are
    never read, so a cache may hold anything there). Query t attends to keys 0..t. Per row:

      for each segment of ``segment`` keys, ascending, a fresh state (m=-inf, l=0, acc=0) and for
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
    _tiling_ok(d, block, segment)
    if n_q == 0:
        return q.clone()
    pos = index_tensor(positions, q.device, "attention")  # checked in the kernel (trap_if)
    if not positions.is_cuda:  # a host tensor is checked here, with the cpu program's words
        require(int(positions.min()) >= 0, "attention: negative position")
        require(int(positions.max()) < s_len, "attention: a query position has no key in k/v")
    if scale is None:
        scale_f = _default_scale(d)
    else:
        scale_f = float(scale.item() if isinstance(scale, torch.Tensor) else scale)
        require(torch.tensor(scale_f, dtype=F32).item() == scale_f, "attention: scale must be fp32")
    require(max(q.numel(), k.numel()) < 2**31, "attention (cuda): tensor too large")
    g = h_q // h_kv
    qc = q.contiguous()
    kc = k.contiguous()
    vc = v.contiguous()
    out = torch.empty_like(qc)
    n_rows = n_q * g
    n_seg = triton.cdiv(s_len, segment)
    if split is None:
        split = n_seg > 1 and triton.cdiv(n_rows, _TILE[0]) * h_kv < _sm_count(q.device)
    block_m, num_warps = _TILE
    n_tiles = triton.cdiv(n_rows, block_m)
    if not split and _HOPPER_PREFILL and attention_hopper.usable(qc, kc, vc, block):
        note("cuda.attention:hopper")
        return attention_hopper.prefill(qc, kc, vc, pos, out, scale_f, block, segment)
    note("cuda.attention:split" if split else "cuda.attention:one-pass")
    if split:
        m_buf = torch.empty(n_seg, h_kv, n_rows, dtype=F32, device=q.device)
        l_buf = torch.empty_like(m_buf)
        a_buf = torch.empty(n_seg, h_kv, n_rows, d, dtype=F32, device=q.device)
        grid = (n_tiles * h_kv, n_seg)
    else:
        m_buf = l_buf = a_buf = out  # unused
        grid = (n_tiles * h_kv,)
    _attn_kernel[grid](
        qc, kc, vc, out, pos, pos.stride(0), m_buf, l_buf, a_buf,
        n_rows, h_kv, s_len, scale_f,
        qc.stride(0), qc.stride(1), kc.stride(0), kc.stride(1),
        vc.stride(0), vc.stride(1), out.stride(0), out.stride(1),
        G=g, D=d, BLOCK_M=block_m, BLOCK_N=block, SEG_BLOCKS=segment // block, SEG=segment,
        SPLIT=bool(split), ONE_SEG=n_seg == 1,
        num_warps=num_warps, num_stages=_NUM_STAGES, **EXACT,
    )  # fmt: skip
    if split:
        _combine(out, pos, m_buf, l_buf, a_buf, g, segment)
    return out


def _combine(out, positions, m_buf, l_buf, a_buf, g, segment, seq_lens=None, reach=0):
    """Launch the combine kernel over the segments' states ``m_buf``/``l_buf``/``a_buf``
    [n_seg, Hkv, rows(, D)] into ``out`` [T, Hq, D]: programs of ``_COMBINE_ROWS`` rows by
    ``_COMBINE_COLS`` columns of the head, per kv head. ``seq_lens`` (and the table's
    ``reach``): the paged decode's raw positions, checked in the kernel; None: positions
    the attention kernel before it checked."""
    _, h_kv, n_rows = m_buf.shape
    d = out.shape[-1]
    cols = min(_COMBINE_COLS, d)
    paged = seq_lens is not None
    lens = seq_lens if paged else positions
    _combine_kernel[(triton.cdiv(n_rows, _COMBINE_ROWS), h_kv, d // cols)](
        out, positions, positions.stride(0), lens, lens.stride(0) if paged else 0, reach,
        m_buf, l_buf, a_buf, n_rows, h_kv, out.stride(0), out.stride(1),
        G=g, D=d, ROWS=_COMBINE_ROWS, SEG=segment, PAGED=paged, COLS=cols, num_warps=4, **EXACT,
    )  # fmt: skip


@triton.jit(do_not_specialize=["n_reqs", "n_q", "n_k", "max_tiles"])
def _varlen_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, pos_ptr, stride_p, qs_ptr, ks_ptr,
    n_reqs, n_q, n_k, n_kv_heads, max_tiles, scale,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SEG_BLOCKS: tl.constexpr, SEG: tl.constexpr,
):  # fmt: skip
    """One (request, kv head, tile) of many sequences: ``_attn_kernel``'s one-pass body with
    every row of the tile from one request, its q, positions, keys, values and output reached
    through the request's row and key offsets. Axis 0 walks (request, kv head, tile) with the
    request fastest and each request's tiles from its last (longest) one; programs past a
    request's tiles do nothing. The offsets are checked in every program: rows from 0 to
    ``n_q`` in order, keys within ``n_k``, at most ``max_tiles`` tiles a request."""
    pid = tl.program_id(0)
    r = pid % n_reqs
    h = (pid // n_reqs) % n_kv_heads
    back = pid // n_reqs // n_kv_heads  # tiles before the request's last
    q_lo = tl.load(qs_ptr + r).to(tl.int64)
    q_hi = tl.load(qs_ptr + r + 1).to(tl.int64)
    k_lo = tl.load(ks_ptr + r).to(tl.int64)
    k_hi = tl.load(ks_ptr + r + 1).to(tl.int64)
    bad = (q_lo < 0) | (q_hi < q_lo) | (q_hi > n_q) | (k_lo < 0) | (k_hi < k_lo) | (k_hi > n_k)
    bad = bad | ((r == 0) & (q_lo != 0)) | ((r == n_reqs - 1) & (q_hi != n_q))
    bad = bad | ((q_hi - q_lo) * G > max_tiles * BLOCK_M)
    lanes = tl.zeros([BLOCK_M], tl.int32) + bad.to(tl.int32)
    q_lo = q_lo + tl.max(trap_if(lanes != 0), 0)
    n_rows = ((q_hi - q_lo) * G).to(tl.int32)
    kv_len = (k_hi - k_lo).to(tl.int32)
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    if back < n_tiles:
        tile = n_tiles - 1 - back
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        t = rows // G  # the request's row = token * G + query head within the group
        head = h * G + rows % G
        pos = tl.load(pos_ptr + (q_lo + t) * stride_p, mask=row_ok, other=-1)
        pos = (pos + trap_if(row_ok & ((pos < 0) | (pos >= kv_len)))).to(tl.int32)
        offs_d = tl.arange(0, D)
        q_src = q_ptr + q_lo * stride_qt
        q_src = q_src + t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_src, mask=row_ok[:, None], other=0.0)
        pos_max = tl.max(pos, 0)
        pos_min = tl.min(tl.where(row_ok, pos, 2147483647), 0)
        j_last = pos_max // BLOCK_N
        j_full = (pos_min + 1) // BLOCK_N
        kv_lim = tl.minimum(kv_len, pos_max + 1)  # keys past the last query are never loaded
        k_base = k_ptr + k_lo * stride_ks + h * stride_kh
        v_base = v_ptr + k_lo * stride_vs + h * stride_vh
        o_base = o_ptr + q_lo * stride_ot
        if j_last < SEG_BLOCKS:
            _one_segment(
                q, k_base, v_base, stride_ks, stride_vs, pos, kv_lim, j_last, j_full, scale,
                o_base, t, head, stride_ot, stride_oh, row_ok, BLOCK_M, BLOCK_N, D,
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
                    scale, BLOCK_M, BLOCK_N, D, pos_ptr, 0, 0, 0, 0,
                )  # fmt: skip
                m_g, l_g, a_g = _merge(m_g, l_g, a_g, m, l_s, acc, pos >= s_idx * SEG)
            _finish(o_base, t, head, stride_ot, stride_oh, l_g[:, None], a_g, row_ok, offs_d)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    q_starts: torch.Tensor,
    k_starts: torch.Tensor,
    *,
    max_rows: int,
    scale: torch.Tensor | float | None = None,
    block: int,
    segment: int,
) -> torch.Tensor:
    """attention.blocked for many sequences in one launch (the cpu program's interface).

    Request r's query rows are q[q_starts[r]:q_starts[r+1]] ([T, Hq, D] bf16, the requests'
    rows concatenated in order) at those ``positions``; its keys and values are
    k/v[k_starts[r]:k_starts[r+1]] ([S, Hkv, D] bf16), its positions 0, 1, ... Every row has
    the bytes ``attention`` gives on its request's rows and keys: a program's rows are all of
    one request and run ``_attn_kernel``'s one-pass code (the same 64-row tiles of 4 warps,
    blocks, segments and merge order; the split form is not used). ``max_rows`` (a host bound
    on every request's row count) fixes the launch grid, so nothing is read on the host from
    the device. The starts (int32 or int64, [R + 1]) and positions are checked in the kernel:
    q_starts runs from 0 to T without going down, each request's keys lie within S and its
    positions below its key count, no request has more than ``max_rows`` rows.
    """
    require_cuda(q, k, v)
    n_q, h_q, d, s_len, h_kv = check_inputs(q, k, v, positions)
    _tiling_ok(d, block, segment)
    check_starts(q_starts, k_starts)
    require(max_rows >= 0, "attention_varlen: max_rows must not be negative")
    n_reqs = q_starts.shape[0] - 1
    if n_q == 0 or n_reqs == 0:
        require(n_q == 0, "attention_varlen: rows but no request")
        return q.clone()
    pos = index_tensor(positions, q.device, "attention_varlen")
    qs = index_tensor(q_starts, q.device, "attention_varlen")
    ks = index_tensor(k_starts, q.device, "attention_varlen")
    if not q_starts.is_cuda and not k_starts.is_cuda:  # host offsets are checked here too
        spans(q_starts, k_starts, n_q, s_len, max_rows)
    if scale is None:
        scale_f = _default_scale(d)
    else:
        scale_f = float(scale.item() if isinstance(scale, torch.Tensor) else scale)
        require(torch.tensor(scale_f, dtype=F32).item() == scale_f, "attention: scale must be fp32")
    require(max(q.numel(), k.numel()) < 2**31, "attention (cuda): tensor too large")
    g = h_q // h_kv
    qc = q.contiguous()
    kc = k.contiguous()
    vc = v.contiguous()
    out = torch.empty_like(qc)
    block_m, num_warps = _TILE
    # No request has more than n_q rows: the bound is capped there (max_tiles * 64 < 2**31)
    max_tiles = triton.cdiv(max(min(max_rows, n_q), 1) * g, block_m)
    require(n_reqs * h_kv * max_tiles < 2**31, "attention_varlen (cuda): too many programs")
    _varlen_kernel[(n_reqs * h_kv * max_tiles,)](
        qc, kc, vc, out, pos, pos.stride(0), qs, ks,
        n_reqs, n_q, s_len, h_kv, max_tiles, scale_f,
        qc.stride(0), qc.stride(1), kc.stride(0), kc.stride(1),
        vc.stride(0), vc.stride(1), out.stride(0), out.stride(1),
        G=g, D=d, BLOCK_M=block_m, BLOCK_N=block, SEG_BLOCKS=segment // block, SEG=segment,
        num_warps=num_warps, num_stages=_NUM_STAGES, **EXACT,
    )  # fmt: skip
    return out


def _tiling_ok(d: int, block: int, segment: int) -> None:
    check_tiling(block, segment)
    require(d == next_pow2(d) and 16 <= d <= 256, f"attention (cuda): head dim {d} unsupported")
    require(
        block == next_pow2(block) and 16 <= block <= 128,
        f"attention (cuda): block must be a power of two in [16, 128], got {block}",
    )


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
    block: int,
    segment: int,
) -> torch.Tensor:
    """attention.blocked for ONE sequence whose keys and values sit in a paged cache.

    ``key_cache``/``value_cache`` [num_blocks, Hkv, page, D] bf16 (vLLM's pages, viewed per
    half), ``block_table`` the sequence's block ids, ``seq_len`` its keys in the cache. The
    pages are gathered into contiguous [seq_len, Hkv, D] copies and ``attention`` runs on
    them, so every row has the contiguous program's bytes by construction; a kernel reading
    the pages in place is not written yet."""
    k = gather_pages(key_cache, block_table, seq_len)
    v = gather_pages(value_cache, block_table, seq_len)
    return attention(q, k, v, positions, scale=scale, block=block, segment=segment)


@triton.jit
def _decode_paged_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, pos_ptr, stride_p, seq_lens_ptr, stride_sl, reach,
    m_buf, l_buf, a_buf, n_kv_heads, scale,
    stride_qt, stride_qh, stride_kp, stride_kh, stride_ks, stride_vp, stride_vh, stride_vs,
    stride_bt,
    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SEG_BLOCKS: tl.constexpr, SEG: tl.constexpr, PAGE: tl.constexpr, NP: tl.constexpr,
):  # fmt: skip
    """One (request, kv head, segment) of a batch of one-token decodes: the rows of the
    request's token in the kv head's group, the segment's state written for the combine."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    s_idx = tl.program_id(2)
    p, kv_len = _decode_pos(pos_ptr, stride_p, seq_lens_ptr, stride_sl, r, reach)
    if s_idx * SEG <= p:  # p = -1: the request attends nothing (padding)
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < G
        head = h * G + rows
        pos = tl.where(row_ok, p, -1)
        offs_d = tl.arange(0, D)
        q_src = q_ptr + r * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_src, mask=row_ok[:, None], other=0.0)
        kv_lim = tl.minimum(kv_len, p + 1)
        j_last = p // BLOCK_N
        j_full = (p + 1) // BLOCK_N
        j_lo = s_idx * SEG_BLOCKS
        j_hi = tl.minimum(j_lo + SEG_BLOCKS, j_last + 1)
        m, l_s, acc = _segment(
            q, kc_ptr + h * stride_kh, vc_ptr + h * stride_vh, stride_ks, stride_vs, pos,
            kv_lim, j_lo, j_hi, j_full, scale, BLOCK_M, BLOCK_N, D,
            bt_ptr + r.to(tl.int64) * stride_bt, stride_kp, stride_vp, PAGE, NP,
        )  # fmt: skip
        n_rows = tl.num_programs(0) * G
        at = (s_idx * n_kv_heads + h) * n_rows + r * G + rows
        tl.store(m_buf + at, m, mask=row_ok)
        tl.store(l_buf + at, l_s, mask=row_ok)
        tl.store(a_buf + at[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None])


def _paged_halves_ok(key_cache: torch.Tensor, value_cache: torch.Tensor, d: int) -> None:
    require_cuda(key_cache, value_cache)
    require(
        key_cache.dim() == 4 and key_cache.shape == value_cache.shape and key_cache.shape[3] == d,
        f"paged attention (cuda): caches [num_blocks, Hkv, page, {d}] of one shape, got "
        f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}",
    )
    require(
        key_cache.stride(3) == 1 and value_cache.stride(3) == 1,
        "paged attention (cuda): the head dim of the caches must be contiguous",
    )


def _paged_tile(programs: int, g: int, device: torch.device) -> tuple[int, int]:
    """The paged decode's tile: one warp for up to 16 query heads per kv head when the grid
    fills the GPU, the 64-row tile of 4 warps (more loads in flight per program) when it does
    not, and above 16 heads. H200, 4 heads per kv head, graph replays: 64 requests 1.04-1.06x
    faster on one warp, one request 1.30x faster on four at 2048 keys, 1.12x at 8192 (docs/
    gpu.md). Both tiles give the same bytes (gated on the GPU)."""
    if g > _ONE_WARP_TILE[0]:
        return _TILE
    return _ONE_WARP_TILE if programs >= _sm_count(device) else _TILE


def _table_held(segment: int, page: int, block_m: int) -> int:
    """How many table entries a paged decode program of ``block_m`` rows holds for a
    segment: for the 64-row tile a power of two covering the pages one segment's keys can
    span, or 0 (look pages up block by block) past ``_TABLE_HELD_MAX``. The one-warp tile
    always looks up: compiled for sm_90a, holding the entries took it to 255 registers with
    spills (it serves batches, whose programs fill the GPU, where the lookups' latency
    hides)."""
    if block_m != _TILE[0]:
        return 0
    held = triton.next_power_of_2(triton.cdiv(segment, page) + 1)
    return held if held <= _TABLE_HELD_MAX else 0


def attention_decode_paged(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    positions: torch.Tensor,
    *,
    max_seq_len: int,
    scale: torch.Tensor | float | None = None,
    block: int,
    segment: int,
) -> torch.Tensor:
    """attention.blocked for a batch of one-token decodes whose keys sit in a paged cache.

    Row r of ``q`` [R, Hq, D] is request r's token at ``positions[r]``; its keys are positions
    0..seq_lens[r]-1 of ``key_cache``/``value_cache`` [num_blocks, Hkv, page, D] through its
    row of ``block_table`` [>= R, width] (key p in page ``block_table[r, p // page]``, row
    p % page). Every row's bytes are those of ``attention`` on the request's contiguous keys:
    the same segment and block walk, 16 query rows a warp, the same merge code; only the key
    addresses and the tile differ (``_paged_tile``: one warp or four for up to 16 query heads
    per kv head, four up to 64; more are refused). The positions and lengths (int32 or int64)
    are read and checked in the kernels, so no preparation kernel runs. No host read and a
    launch grid fixed by (R, Hkv, ``max_seq_len``): the call can be captured in a CUDA graph.
    ``max_seq_len`` (a host bound on every seq_len) fixes the number of segments. A request
    with seq_len 0, or whose position is negative or not below its seq_len (and the table's
    reach), attends nothing: its output rows are unspecified.
    """
    require_cuda(q, block_table, seq_lens, positions)
    require(q.dtype == BF16 and q.dim() == 3, "paged attention (cuda): q [R, Hq, D] bf16")
    n, h_q, d = q.shape
    _paged_halves_ok(key_cache, value_cache, d)
    require(
        key_cache.dtype == BF16 and value_cache.dtype == BF16,
        "paged attention (cuda): bf16 caches required",
    )
    _, h_kv, page, _ = key_cache.shape
    require(h_q % h_kv == 0, f"paged attention: {h_q} query heads over {h_kv} kv heads")
    _tiling_ok(d, block, segment)
    g = h_q // h_kv
    # A program holds one token's g query heads of one kv head: one warp up to 16 of them.
    require(
        g <= _TILE[0],
        f"paged attention (cuda): {g} query heads per kv head unsupported (at most {_TILE[0]})",
    )
    require(
        block_table.dim() == 2 and block_table.shape[0] >= n and block_table.stride(1) == 1,
        "paged attention (cuda): block_table [>= R, width] with contiguous rows",
    )
    require(
        seq_lens.dim() == 1 and seq_lens.shape[0] >= n and positions.shape == (n,),
        "paged attention (cuda): seq_lens [>= R] and positions [R]",
    )
    require(
        seq_lens.dtype in INDEX_DTYPES and positions.dtype in INDEX_DTYPES,
        f"paged attention (cuda): seq_lens and positions must be int32 or int64, got "
        f"{seq_lens.dtype} and {positions.dtype}",
    )
    require(max_seq_len >= 1, "paged attention (cuda): max_seq_len must be positive")
    if n == 0:
        return q.clone()
    if scale is None:
        scale_f = _default_scale(d)
    else:
        scale_f = float(scale.item() if isinstance(scale, torch.Tensor) else scale)
        require(torch.tensor(scale_f, dtype=F32).item() == scale_f, "attention: scale must be fp32")
    n_seg = triton.cdiv(max_seq_len, segment)
    reach = min(block_table.shape[1] * page, n_seg * segment)
    require(reach < 2**31, "paged attention (cuda): the table reaches past 2**31 keys")
    block_m, num_warps = _paged_tile(n * h_kv * n_seg, g, q.device)
    qc = q.contiguous()
    out = torch.empty_like(qc)
    n_rows = n * g
    m_buf = torch.empty(n_seg, h_kv, n_rows, dtype=F32, device=q.device)
    l_buf = torch.empty_like(m_buf)
    a_buf = torch.empty(n_seg, h_kv, n_rows, d, dtype=F32, device=q.device)
    _decode_paged_kernel[(n, h_kv, n_seg)](
        qc, key_cache, value_cache, block_table, positions, positions.stride(0), seq_lens,
        seq_lens.stride(0), reach, m_buf, l_buf, a_buf, h_kv, scale_f,
        qc.stride(0), qc.stride(1), key_cache.stride(0), key_cache.stride(1),
        key_cache.stride(2), value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0),
        G=g, D=d, BLOCK_M=block_m, BLOCK_N=block, SEG_BLOCKS=segment // block, SEG=segment,
        PAGE=page, NP=_table_held(segment, page, block_m), num_warps=num_warps,
        num_stages=_NUM_STAGES, **EXACT,
    )  # fmt: skip
    _combine(out, positions, m_buf, l_buf, a_buf, g, segment, seq_lens, reach)
    return out


@triton.jit
def _write_pages_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, n_slots,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kp, stride_kch, stride_ks, stride_vp, stride_vch, stride_vs,
    PAGE, D, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if (slot >= 0) & (slot < n_slots):
        page = slot // PAGE
        row = slot % PAGE
        d = tl.arange(0, BLOCK_D)
        ok = d < D
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=ok)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=ok)
        tl.store(kc_ptr + page * stride_kp + h * stride_kch + row * stride_ks + d, k, mask=ok)
        tl.store(vc_ptr + page * stride_vp + h * stride_vch + row * stride_vs + d, v, mask=ok)


def write_pages(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """Copy row t of ``k``/``v`` [T, Hkv, D] into cache slot ``slots[t]`` (page slot // page,
    row slot % page) of ``key_cache``/``value_cache`` [num_blocks, Hkv, page, D]; a slot < 0
    (padding) or past the cache is skipped. A copy: no byte moves. No host read, so it can be
    captured in a CUDA graph."""
    require_cuda(k, v, slots)
    require(k.dim() == 3 and v.shape == k.shape, "write_pages: k, v [T, Hkv, D] of one shape")
    n, h_kv, d = k.shape
    _paged_halves_ok(key_cache, value_cache, d)
    require(
        key_cache.shape[1] == h_kv and k.dtype == key_cache.dtype == value_cache.dtype == v.dtype,
        f"write_pages: rows [.., {h_kv}, {d}] {k.dtype} do not fit caches "
        f"{tuple(key_cache.shape)} {key_cache.dtype}",
    )
    require(slots.shape == (n,), "write_pages: one slot per row")
    if n == 0:
        return
    require(k.stride(2) == 1 and v.stride(2) == 1, "write_pages: rows must be contiguous")
    page = key_cache.shape[2]
    _write_pages_kernel[(n, h_kv)](
        k, v, key_cache, value_cache, slots, key_cache.shape[0] * page,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        page, d, BLOCK_D=next_pow2(d), num_warps=1,
    )  # fmt: skip
