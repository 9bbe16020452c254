"""The hybrid lane's programs (Qwen3-Next) on the cuda backend: the cpu backend's bytes, each
program one Triton kernel.

gdn.chunked, gdn.gating, gdn.l2norm, conv1d.causal, rmsnorm.zero_centered, rmsnorm.gated,
gate.sigmoid and moe.shared_gate are written (``programs/cpu/gdn.py``, ``hybrid.py``) from
elementwise IEEE operations (+ - * / sqrt, comparisons, integer bit operations for exp, log and
the bf16 rounding) and explicit fixed trees. Their kernels here perform those operations in the
same order (``exactmath``: the cpu helpers as Triton functions; contraction off), so cuda bytes
== cpu bytes (checked in Triton's interpreter by ``tests/test_interpret.py`` and on a GPU by
``tests/test_hybrid_gpu.py``). gdn.chunked keeps the cpu code's calls and state and runs each
chunk pass as one kernel (``programs/cuda/gdn.py``). Each function checks that its tensors are
on a CUDA device and takes the cpu program's input checks.

rope.partial is the exception: the cuda backend's rope.neox is its own Triton program (its
bytes are not the cpu rope's), and rope.partial is that rope on the first ``rotary`` dims of
each head, the rest copied, as the cpu rope.partial is built on the cpu rope.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..cpu import gdn as _gdn
from ..cpu import hybrid as _hybrid
from ..cpu.arith import BF16, F32, as_f32, require
from ..cpu.gdn import GdnState, state_tensors
from ..cpu.rope import rotate_first
from . import exactmath as em
from .arith import EXACT, bits16, next_pow2, require_cuda
from .gdn import chunk as chunk_pass
from .gdn import run_paged as chunk_paged
from .rope import rope

_BLOCK = 1024  # elements per program of the elementwise kernels
_MAX_ROW = 65536  # the widest row a row kernel holds


def _row_block(n: int) -> tuple[int, int]:
    """(rows per program, width) of a row kernel over rows of ``n``: the width a power of two
    (the tree's padded length), a few thousand elements a program."""
    require(1 <= n <= _MAX_ROW, f"cuda row program: row length {n} unsupported")
    width = next_pow2(n)
    return max(1, min(16, 4096 // width)), width


def _leaf(width: int) -> int:
    """log2 of the squares one lane sums in ``_sum_squares``'s first stage: up to 32."""
    return min(5, width.bit_length() - 1)


# --- the kernels ----------------------------------------------------------------------------
@triton.jit(do_not_specialize=["N"])
def _gating_kernel(a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, N, HV, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    h = offs % HV
    a = em.widen(tl.load(a_ptr + offs, mask=ok, other=0))
    b = em.widen(tl.load(b_ptr + offs, mask=ok, other=0))
    sp = em.softplus(a + tl.load(dtb_ptr + h, mask=ok, other=0.0))
    g = em.neg(em.exp(tl.load(alog_ptr + h, mask=ok, other=0.0)) * sp)
    tl.store(g_ptr + offs, g, mask=ok)
    tl.store(beta_ptr + offs, em.sigmoid(b), mask=ok)


@triton.jit
def _sum_squares(xf, s_ptr, rows, R, ROWS: tl.constexpr, W: tl.constexpr, LOG: tl.constexpr,
                 LEAF: tl.constexpr):  # fmt: skip
    """[ROWS] tree_sum of each row's squares (the pair tree over W, padded with +0), in two
    stages of the same tree: the aligned subtrees of ``2**LEAF`` contiguous squares (the tree's
    own lower levels) one to a lane, their sums written to the scratch rows ``s_ptr``
    [rows, W >> LEAF] and read back for the upper levels. Without the round trip Triton's
    compiler lays every row out whole in every lane and computes it there."""
    G: tl.constexpr = W >> LEAF
    leaves = em.tree_cols(tl.reshape(xf * xf, (ROWS * G, 1 << LEAF)), ROWS * G, 1 << LEAF, LEAF)
    gs = tl.arange(0, G)
    spot = s_ptr + rows[:, None].to(tl.int64) * G + gs[None, :]
    live = rows[:, None] < R
    tl.store(spot, tl.reshape(leaves, (ROWS, G)), mask=live)
    tl.debug_barrier()
    return em.tree_cols(tl.load(spot, mask=live, other=0.0), ROWS, G, LOG - LEAF)


@triton.jit(do_not_specialize=["R"])
def _l2norm_kernel(
    x_ptr, o_ptr, s_ptr, R, D, eps,
    ROWS: tl.constexpr, W: tl.constexpr, LOG: tl.constexpr, LEAF: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, W)
    ok = (rows[:, None] < R) & (cols[None, :] < D)
    at = rows[:, None] * D + cols[None, :]
    xf = em.widen(tl.load(x_ptr + at, mask=ok, other=0))
    ss = _sum_squares(xf, s_ptr, rows, R, ROWS, W, LOG, LEAF)
    inv = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), tl.math.sqrt_rn(ss + eps))
    tl.store(o_ptr + at, xf * inv[:, None], mask=ok)


@triton.jit
def _conv1d_kernel(
    f_ptr, w_ptr, o_ptr, D, KERNEL, BD: tl.constexpr, WP: tl.constexpr, LOG: tl.constexpr
):
    t = tl.program_id(0)
    ds = tl.program_id(1) * BD + tl.arange(0, BD)
    ws = tl.arange(0, WP)
    ok = (ds[:, None] < D) & (ws[None, :] < KERNEL)
    taps = em.widen(tl.load(f_ptr + (t + ws[None, :]) * D + ds[:, None], mask=ok, other=0))
    wt = em.widen(tl.load(w_ptr + ds[:, None] * KERNEL + ws[None, :], mask=ok, other=0))
    acc = em.tree_cols(taps * wt, BD, WP, LOG)
    tl.store(o_ptr + t * D + ds, em.round_bf16(em.silu(acc)), mask=ds < D)


@triton.jit
def _window_or_rows(win, x_ptr, start, at, D, ds, mask, live, KERNEL):
    """Row ``at`` of a sequence's (window, rows): one of its window's W-1 rows (``win``: the
    page's window at columns ``ds``; zeros where ``live`` is false, a sequence at position 0)
    or, past them, its row ``at - (W-1)`` of the step's ``x_ptr`` from ``start``; the bits,
    masked to 0."""
    old = at < KERNEL - 1
    return tl.where(
        old,
        tl.load(win + at * D, mask=mask & old & live, other=0),
        tl.load(x_ptr + (start + at - (KERNEL - 1)) * D + ds[:, None],
                mask=mask & (at >= KERNEL - 1), other=0),
    )  # fmt: skip


@triton.jit
def _conv1d_paged_kernel(
    x_ptr, win_ptr, w_ptr, o_ptr, seq_ptr, D, KERNEL, s_win,
    BD: tl.constexpr, WP: tl.constexpr, LOG: tl.constexpr,
):  # fmt: skip
    """``_conv1d_kernel`` for the rows of sequence ``program_id(0)`` of a step (its row start,
    rows, position and page from ``seq_ptr``): the taps before its first row from its page's
    window (``win_ptr``, page stride ``s_win``; zeros at position 0), then its advanced window
    written over the page's (each program owns its page's columns ``ds``; a barrier between
    the last read and the first write). A sequence of no rows (padding) writes nothing."""
    seq = tl.program_id(0)
    start = tl.load(seq_ptr + seq * 4).to(tl.int64)
    n = tl.load(seq_ptr + seq * 4 + 1)
    live = tl.load(seq_ptr + seq * 4 + 2) > 0
    slot = tl.load(seq_ptr + seq * 4 + 3).to(tl.int64)
    ds = tl.program_id(1) * BD + tl.arange(0, BD)
    ws = tl.arange(0, WP)
    din = ds[:, None] < D
    tap = ws[None, :] < KERNEL
    win = win_ptr + slot * s_win + ds[:, None]
    wt = em.widen(tl.load(w_ptr + ds[:, None] * KERNEL + ws[None, :], mask=din & tap, other=0))
    for t in range(0, n):
        at = t + ws[None, :]  # the tap's row in (window, rows)
        taps = _window_or_rows(win, x_ptr, start, at, D, ds, din & tap, live, KERNEL)
        acc = em.tree_cols(em.widen(taps) * wt, BD, WP, LOG)
        tl.store(o_ptr + (start + t) * D + ds, em.round_bf16(em.silu(acc)), mask=ds < D)
    # the last W-1 inputs of (window, rows): the next call's window
    keep = ws[None, :] < KERNEL - 1
    new = _window_or_rows(win, x_ptr, start, n + ws[None, :], D, ds, din & keep, live, KERNEL)
    tl.debug_barrier()
    tl.store(win + ws[None, :] * D, new, mask=din & keep & (n > 0))  # padding: no window


@triton.jit(do_not_specialize=["R"])
def _rms_kernel(
    x_ptr, z_ptr, w_ptr, o_ptr, s_ptr, R, H, h_f32, eps,
    GATED: tl.constexpr, ROWS: tl.constexpr, W: tl.constexpr, LOG: tl.constexpr,
    LEAF: tl.constexpr,
):  # fmt: skip
    """rmsnorm.zero_centered (GATED false) or rmsnorm.gated over rows of H (the squares' tree:
    ``_sum_squares``)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, W)
    ok = (rows[:, None] < R) & (cols[None, :] < H)
    at = rows[:, None] * H + cols[None, :]
    xf = em.widen(tl.load(x_ptr + at, mask=ok, other=0))
    total = _sum_squares(xf, s_ptr, rows, R, ROWS, W, LOG, LEAF)
    var = tl.math.div_rn(total, tl.full([ROWS], h_f32, tl.float32))
    inv = tl.math.div_rn(tl.full([ROWS], 1.0, tl.float32), tl.math.sqrt_rn(var + eps))
    wf = em.widen(tl.load(w_ptr + cols, mask=cols < H, other=0))
    if GATED:
        y = (xf * inv[:, None]) * wf[None, :]
        zf = em.widen(tl.load(z_ptr + at, mask=ok, other=0))
        out = y * em.silu(zf)
    else:
        y = xf * inv[:, None]
        out = y * (wf[None, :] + 1.0)
    tl.store(o_ptr + at, em.round_bf16(out), mask=ok)


@triton.jit(do_not_specialize=["N"])
def _gate_kernel(x_ptr, g_ptr, s_ptr, o_ptr, N, H, SHARED: tl.constexpr, BLOCK: tl.constexpr):
    """gate.sigmoid (SHARED false: x * sigmoid(gate)) or moe.shared_gate (x = routed,
    routed + sigmoid(logit of the row) * shared)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    xf = em.widen(tl.load(x_ptr + offs, mask=ok, other=0))
    if SHARED:
        logit = em.widen(tl.load(g_ptr + offs // H, mask=ok, other=0))
        sf = em.widen(tl.load(s_ptr + offs, mask=ok, other=0))
        out = xf + em.sigmoid(logit) * sf
    else:
        out = xf * em.sigmoid(em.widen(tl.load(g_ptr + offs, mask=ok, other=0)))
    tl.store(o_ptr + offs, em.round_bf16(out), mask=ok)


# --- the programs ---------------------------------------------------------------------------
def gdn_chunked(q, k, v, g, beta, state: GdnState, *, position: int, chunk: int, scale=None):
    """gdn.chunked (docs/programs/gdn.chunked.md) on CUDA tensors; the state on the same device."""
    require_cuda(q, k, v, g, beta, *state_tensors(state))
    if isinstance(scale, torch.Tensor):
        require_cuda(scale)
    return _gdn.run_chunks(
        chunk_pass, q, k, v, g, beta, state, position=position, chunk=chunk, scale=scale
    )


def gdn_gating(a, b, a_log, dt_bias):
    require_cuda(a, b, a_log, dt_bias)
    return gating(a, b, a_log, dt_bias)


def gating(a, b, a_log, dt_bias):
    """gdn.gating's launch (no device check: the interpreter runs it on cpu tensors)."""
    _gdn.check_gating(a, b, a_log, dt_bias)
    g = torch.empty(a.shape, dtype=F32, device=a.device)
    beta = torch.empty(a.shape, dtype=F32, device=a.device)
    n = a.numel()
    if n:
        _gating_kernel[(triton.cdiv(n, _BLOCK),)](
            bits16(a), bits16(b), as_f32(a_log).contiguous(), as_f32(dt_bias).contiguous(),
            g, beta, n, a.shape[1], BLOCK=_BLOCK, **EXACT,
        )  # fmt: skip
    return g, beta


def l2norm(x, eps: float = 1e-6):
    require_cuda(x)
    return l2norm_rows(x, eps)


def l2norm_rows(x, eps: float = 1e-6):
    """gdn.l2norm's launch (no device check)."""
    require(x.dtype == BF16, f"gdn.l2norm: bf16 input required, got {x.dtype}")
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=F32, device=x.device)
    rows = x.numel() // d if d else 0
    if rows:
        per, width = _row_block(d)
        leaf = _leaf(width)
        scratch = torch.empty(rows, width >> leaf, dtype=F32, device=x.device)
        _l2norm_kernel[(triton.cdiv(rows, per),)](
            bits16(x), out, scratch, rows, d, float(eps), ROWS=per, W=width,
            LOG=width.bit_length() - 1, LEAF=leaf, **EXACT,
        )  # fmt: skip
    return out


def conv1d_causal(x, weight, window, *, kernel: int = 4):
    require_cuda(x, weight, window)
    return conv1d(x, weight, window, kernel=kernel)


def conv1d(x, weight, window, *, kernel: int = 4):
    """conv1d.causal's launch (no device check)."""
    _gdn.check_conv1d(x, weight, window, kernel)
    full = torch.cat([window, x], dim=0)
    n, d = x.shape
    out = torch.empty(n, d, dtype=torch.int16, device=x.device)
    if n and d:
        width = next_pow2(kernel)
        block = 128
        _conv1d_kernel[(n, triton.cdiv(d, block))](
            bits16(full), bits16(weight), out, d, kernel, BD=block, WP=width,
            LOG=width.bit_length() - 1, **EXACT,
        )  # fmt: skip
    return out.view(BF16), full[full.shape[0] - (kernel - 1) :].clone()


def gdn_paged(q, k, v, g, beta, pages, seqs, *, chunk: int, scale=None):
    """gdn.chunked for many sequences over state pages (``programs.gdn_paged``) in one
    launch: each row the bytes ``gdn_chunked`` gives on its sequence's state."""
    require_cuda(q, k, v, g, beta, pages.s, pages.k, seqs.table)
    return paged(q, k, v, g, beta, pages, seqs, chunk=chunk, scale=scale)


def paged(q, k, v, g, beta, pages, seqs, *, chunk: int, scale=None):
    """``gdn_paged``'s launch (no device check): one kernel, the pages advanced in place."""
    _gdn.check_paged(q, k, v, g, beta, pages, seqs, chunk)
    if scale is None:
        scale = _gdn.default_scale(k.shape[2], v.device)
    return chunk_paged(q, k, v, g, beta, pages, seqs, scale)


def conv1d_paged(x, weight, pages, seqs, *, kernel: int = 4):
    """conv1d.causal for many sequences over their pages' windows (``programs.conv1d_paged``)
    in one launch: each row the bytes ``conv1d_causal`` gives on its sequence."""
    require_cuda(x, weight, pages.conv, seqs.table)
    return conv1d_pages(x, weight, pages, seqs, kernel=kernel)


def conv1d_pages(x, weight, pages, seqs, *, kernel: int = 4):
    """``conv1d_paged``'s launch (no device check): one kernel, the windows advanced in
    place (a sequence at position 0 reads zeros, not its page)."""
    _gdn.check_conv1d_paged(x, weight, pages, seqs, kernel)
    win, d = pages.conv, x.shape[1]
    require(win[0].is_contiguous(), "conv1d paged: the window is not packed in its page")
    out = torch.empty(x.shape, dtype=torch.int16, device=x.device)
    width = next_pow2(kernel)
    block = 128
    _conv1d_paged_kernel[(seqs.count, triton.cdiv(d, block))](
        bits16(x.contiguous()), win.view(torch.int16), bits16(weight), out, seqs.table, d,
        kernel, win.stride(0), BD=block, WP=width, LOG=width.bit_length() - 1, **EXACT,
    )  # fmt: skip
    return out.view(BF16)


def _rms(x, z, weight, eps: float, gated: bool):
    h = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.int16, device=x.device)
    rows = x.numel() // h if h else 0
    if rows:
        per, width = _row_block(h)
        leaf = _leaf(width)
        scratch = torch.empty(rows, width >> leaf, dtype=F32, device=x.device)
        _rms_kernel[(triton.cdiv(rows, per),)](
            bits16(x), bits16(z), bits16(weight), out, scratch, rows, h, float(h), float(eps),
            GATED=gated, ROWS=per, W=width, LOG=width.bit_length() - 1, LEAF=leaf, **EXACT,
        )  # fmt: skip
    return out.view(BF16)


def rmsnorm_zero_centered(x, weight, eps: float):
    require_cuda(x, weight)
    return zero_centered(x, weight, eps)


def zero_centered(x, weight, eps: float):
    """rmsnorm.zero_centered's launch (no device check)."""
    _hybrid.check_zero_centered(x, weight)
    return _rms(x, x, weight, eps, gated=False)


def rmsnorm_gated(x, z, weight, eps: float):
    require_cuda(x, z, weight)
    return gated(x, z, weight, eps)


def gated(x, z, weight, eps: float):
    """rmsnorm.gated's launch (no device check)."""
    _hybrid.check_gated(x, z, weight)
    return _rms(x, z, weight, eps, gated=True)


def _gate(x, g, s, shared: bool):
    out = torch.empty(x.shape, dtype=torch.int16, device=x.device)
    n = x.numel()
    if n:
        _gate_kernel[(triton.cdiv(n, _BLOCK),)](
            bits16(x), bits16(g), bits16(s), out, n, x.shape[-1], SHARED=shared, BLOCK=_BLOCK,
            **EXACT,
        )  # fmt: skip
    return out.view(BF16)


def sigmoid_gate(x, gate):
    require_cuda(x, gate)
    return gate_sigmoid(x, gate)


def gate_sigmoid(x, gate):
    """gate.sigmoid's launch (no device check)."""
    _hybrid.check_sigmoid_gate(x, gate)
    return _gate(x, gate, x, shared=False)


def shared_expert_gate(routed, shared, logit):
    require_cuda(routed, shared, logit)
    return shared_gate(routed, shared, logit)


def shared_gate(routed, shared, logit):
    """moe.shared_gate's launch (no device check)."""
    _hybrid.check_shared_gate(routed, shared, logit)
    return _gate(routed, logit, shared, shared=True)


def rope_partial(x: torch.Tensor, positions: torch.Tensor, base: float, rotary: int):
    """rope.partial on cuda: the cuda rope.neox (tables for dim = ``rotary``) on the first
    ``rotary`` dims of each head, the other D - rotary dims copied unchanged. Positions are
    read as the cuda rope reads them (on the device under ``programs.position_bound``)."""
    require_cuda(x)
    return rotate_first(rope, x, positions, base, rotary)


__all__ = [
    "conv1d_causal",
    "conv1d_paged",
    "gdn_chunked",
    "gdn_paged",
    "gdn_gating",
    "l2norm",
    "rmsnorm_gated",
    "rmsnorm_zero_centered",
    "rope_partial",
    "shared_expert_gate",
    "sigmoid_gate",
]
