"""Grouped experts and one-launch K partitions on the GPU: gemm.kblock and gemm.kpart in
other shapes of launch, with the bytes of the plain programs.

- ``gemm_grouped``: the rows of a step's expert plan (``programs.grouping``) through their
  experts' weights, one launch for all experts: each 64-pair tile of one expert is a program
  row. ``parts = 1`` is gemm.kblock; ``parts > 1`` is gemm.kpart on one device: each
  partition's K blocks in one accumulator, the partition sums folded over the balanced pair
  tree inside the kernel, then one rounding.
- ``kpart_partial``: the same kernel over plain rows (one weight): gemm.kpart's partitions and
  their fold in one launch instead of a launch per partition plus the adds.

Each output element's sequence is the plain programs': acc = 0; for the K blocks of its
partition, ascending, acc = mma(x_blk, w_blk, acc) in k16 steps (64-row tiles of 4 warps, the
wgmma of every tiling in ``gemm.TILINGS``); partitions folded as ``programs.fold_tree`` folds
them (element 2i plus element 2i+1, level by level). A row's bytes never depend on the other
rows of its tile or on which tile it lands in. Gated bitwise against the plain programs on the
GPU (test_programs_gpu.py: ``grouped``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..grouping import TILE_M, ExpertPlan
from ..kernels import note
from .arith import BF16, EXACT, F32, require, require_cuda, round_bf16
from .gemm import _SMS, _rows, gemm, k_step

_WARPS = 4
_STAGES = 4
# The fold is written out for up to this many partitions (the lanes use 8).
MAX_PARTS = 16


@triton.jit
def _fold_step(acc, t0, t1, t2, t3, P: tl.constexpr):
    """Partition ``P``'s sum into the running pair tree (a binary counter: a finished pair
    adds the left subtree, held in t_level, to the right one; ``programs.fold_tree``'s
    order). Returns the node and the updated holders."""
    if P % 2 == 1:
        acc = t0 + acc
        if P % 4 == 3:
            acc = t1 + acc
            if P % 8 == 7:
                acc = t2 + acc
                if P % 16 == 15:
                    acc = t3 + acc
                else:
                    t3 = acc
            else:
                t2 = acc
        else:
            t1 = acc
    else:
        t0 = acc
    return acc, t0, t1, t2, t3


@triton.jit(do_not_specialize=["M"])
def _grouped_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    tiles_ptr,
    M,
    N,
    SIZE,
    stride_xm,
    stride_we,
    stride_wn,
    stride_ym,
    PARTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    MODE: tl.constexpr,
):
    """MODE 0: plain rows (M of them, one weight); 1: a plan's tiles over rows in the plan's
    sorted order, each tile through its expert's weight."""
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    if MODE == 0:
        expert = tile * 0
        first = tile * BLOCK_M
        rows = tl.minimum(M - first, BLOCK_M)
    else:
        expert = tl.load(tiles_ptr + tile * 3)
        first = tl.load(tiles_ptr + tile * 3 + 1)
        rows = tl.load(tiles_ptr + tile * 3 + 2)
    if expert >= 0:
        rm = tl.arange(0, BLOCK_M)
        m_ok = rm < rows
        pos = (first + rm).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        x_rows = x_ptr + pos[:, None] * stride_xm
        w_cols = w_base + (rn % N)[None, :] * stride_wn
        t0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        t1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        t2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        t3 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for p in tl.static_range(PARTS):
            # Missing rows are zero-filled (never stored); a ragged last K block of a
            # partition is padded with +0 products, as the plain gemm pads it.
            a_ptrs = x_rows + p * SIZE + rk[None, :]
            b_ptrs = w_cols + p * SIZE + rk[:, None]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kb in range(0, tl.cdiv(SIZE, BLOCK_K)):
                if EVEN_K:
                    a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
                    b = tl.load(b_ptrs)
                else:
                    k_ok = rk < SIZE - kb * BLOCK_K
                    a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                    b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
                acc = tl.dot(a, b, acc)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
            if PARTS > 1:
                acc, t0, t1, t2, t3 = _fold_step(acc, t0, t1, t2, t3, p)
        y_ptrs = y_ptr + pos[:, None] * stride_ym + rn[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (rn[None, :] < N))


@triton.jit(do_not_specialize=["n", "stride_p"])
def _fold_kernel(s_ptr, y_ptr, n, stride_p, PARTS: tl.constexpr, BLOCK: tl.constexpr):
    """``programs.fold_tree`` over the leading axis of stacked fp32 partials, in registers."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    t0 = tl.zeros((BLOCK,), dtype=tl.float32)
    t1 = tl.zeros((BLOCK,), dtype=tl.float32)
    t2 = tl.zeros((BLOCK,), dtype=tl.float32)
    t3 = tl.zeros((BLOCK,), dtype=tl.float32)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for p in tl.static_range(PARTS):
        acc = tl.load(s_ptr + p * stride_p + offs, mask=ok, other=0.0)
        if PARTS > 1:
            acc, t0, t1, t2, t3 = _fold_step(acc, t0, t1, t2, t3, p)
    tl.store(y_ptr + offs, acc, mask=ok)


_FOLD_BLOCK = 1024


def fold_stacked(stacked: torch.Tensor) -> torch.Tensor:
    """``programs.fold_tree`` of ``list(stacked)`` in one launch: [P, ...] fp32 (P a power of
    two up to ``MAX_PARTS``) -> [...] fp32, element 2i plus element 2i+1, level by level."""
    require_cuda(stacked)
    return folded(stacked)


def folded(stacked: torch.Tensor) -> torch.Tensor:
    """``fold_stacked``'s launch on the partials' device."""
    require(stacked.dtype == F32, f"fold: fp32 partials required, got {stacked.dtype}")
    parts = stacked.shape[0] if stacked.dim() else 0
    require(
        1 <= parts <= MAX_PARTS and parts & (parts - 1) == 0,
        f"fold: {parts} partials; a power of two up to {MAX_PARTS} is required",
    )
    s = stacked.contiguous()
    n = s[0].numel()
    y = torch.empty(s.shape[1:], dtype=F32, device=s.device)
    if n:
        _fold_kernel[(triton.cdiv(n, _FOLD_BLOCK),)](
            s, y, n, n, PARTS=parts, BLOCK=_FOLD_BLOCK, num_warps=4, **EXACT
        )
    return y


def _block_n(tiles_m: int, n_dim: int) -> int:
    """64 columns a program, or 32 where 64 would leave multiprocessors idle (the same
    one-wave reasoning as ``gemm.pick_tiling``; no byte depends on it)."""
    return 32 if tiles_m * triton.cdiv(n_dim, 64) < _SMS else 64


def _check(x, w, bk: int, parts: int, what: str) -> int:
    require_cuda(x, w)
    require(x.dtype == BF16 and w.dtype == BF16, f"{what} (cuda): bf16 x and w required")
    require(x.dim() == 2, f"{what}: x must be [rows, K], got {tuple(x.shape)}")
    require(x.shape[-1] == w.shape[-1], f"{what}: K mismatch {tuple(x.shape)} x {tuple(w.shape)}")
    require(bk in (16, 32, 64), f"{what} (cuda): bk must be 16, 32 or 64, got {bk}")
    k_dim = x.shape[-1]
    require(
        1 <= parts <= MAX_PARTS and parts & (parts - 1) == 0 and k_dim % parts == 0,
        f"{what}: {parts} partitions must be a power of two up to {MAX_PARTS} dividing K = {k_dim}",
    )
    return k_dim // parts


def _launch(
    x, w3, y, tiles, m_dim, n_tiles_m, size, bk, parts, mode, *, block_n=None, stages=_STAGES
):
    """One launch of ``_grouped_kernel``. ``block_n`` (default: ``_block_n``) and ``stages``
    are forms: an element's K order does not depend on them (tools/bench/bench_gpu.py times
    them and checks the bytes)."""
    block_k = k_step(bk, size)
    block_n = block_n or _block_n(n_tiles_m, y.shape[1])
    grid = (n_tiles_m, triton.cdiv(y.shape[1], block_n))
    _grouped_kernel[grid](
        x,
        w3,
        y,
        tiles,
        m_dim,
        y.shape[1],
        size,
        x.stride(0),
        w3.stride(0),
        w3.stride(1),
        y.stride(0),
        PARTS=parts,
        BLOCK_M=TILE_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_K=size % block_k == 0,
        MODE=mode,
        num_warps=_WARPS,
        num_stages=stages,
    )


def gemm_grouped(
    x: torch.Tensor,
    w: torch.Tensor,
    plan: ExpertPlan,
    *,
    bk: int,
    parts: int,
    out_dtype=torch.bfloat16,
) -> torch.Tensor:
    """Per sorted pair i of ``plan``: x[i] times w[expert(i)]^T -> [P, N].

    ``x``: [P, K] rows in the plan's sorted order; ``w``: [E, N, K] bf16, the experts' weights
    stacked. ``parts = 1``: gemm.kblock{bk}, one rounding to ``out_dtype``; ``parts > 1``:
    gemm.kpart{bk, parts} on one device (fp32 fold, then one RNE when ``out_dtype`` is bf16).
    """
    size = _check(x, w, bk, parts, "gemm_grouped")
    require(w.dim() == 3, f"gemm_grouped: weights [E, N, K] expected, got {tuple(w.shape)}")
    require(
        w.shape[0] == plan.experts,
        f"gemm_grouped: {w.shape[0]} experts' weights for a plan of {plan.experts}",
    )
    require(out_dtype in (BF16, F32), f"gemm_grouped: unsupported out_dtype {out_dtype}")
    require(
        x.shape[0] == plan.pairs,
        f"gemm_grouped: {x.shape[0]} rows for a plan of {plan.pairs} pairs",
    )
    require(plan.tiles.is_cuda, "gemm_grouped: the plan must be on the weights' device")
    x2, w3 = _rows(x), w if w.stride(-1) == 1 else w.contiguous()
    n_dim = w3.shape[1]
    direct = parts == 1 and out_dtype == BF16
    y = torch.empty(plan.pairs, n_dim, dtype=BF16 if direct else F32, device=x.device)
    if plan.pairs and n_dim:
        _launch(x2, w3, y, plan.tiles, plan.pairs, plan.tiles.shape[0], size, bk, parts, 1)
    if direct or out_dtype == F32:
        return y
    return round_bf16(y)


def kpart_partial(x: torch.Tensor, w: torch.Tensor, *, bk: int, parts: int):
    """gemm.kpart's partial over plain rows: fp32 [..., N], the balanced pair tree over
    ``parts`` equal contiguous K partitions, each a gemm.kblock fp32 sum. Two forms, the same
    bytes (gated): up to ``ONE_KERNEL_ROWS`` rows the partitions and their fold in one launch
    (``one-launch``); above, each partition through the plain gemm's wide tilings into one
    stacked buffer, then the fold in one launch (``folded``: the pointer kernel's 64-row
    tiles are slow at prefill sizes, and the pair tree as torch adds was a launch and a pass
    over memory per add)."""
    lead = x.shape[:-1]
    x2 = _rows(x.reshape(-1, x.shape[-1]))
    size = _check(x2, w, bk, parts, "gemm.kpart")
    require(w.dim() == 2, "gemm.kpart: weight must be [N, K]")
    wc = _rows(w)
    m_dim, n_dim = x2.shape[0], wc.shape[0]
    if m_dim > ONE_KERNEL_ROWS and parts > 1:
        note("cuda.kpart_partial:folded")
        stacked = torch.empty(parts, m_dim, n_dim, dtype=F32, device=x.device)
        for p in range(parts):
            cols = slice(p * size, (p + 1) * size)
            gemm(x2[:, cols], wc[:, cols], bk=bk, out_dtype=F32, out=stacked[p])
        return fold_stacked(stacked).reshape(*lead, n_dim)
    note("cuda.kpart_partial:one-launch")
    y = torch.empty(m_dim, n_dim, dtype=F32, device=x.device)
    if m_dim and n_dim:
        w3 = wc.unsqueeze(0)
        _launch(x2, w3, y, y, m_dim, triton.cdiv(m_dim, TILE_M), size, bk, parts, 0)
    return y.reshape(*lead, n_dim)


# Up to this many rows ``kpart_partial`` runs its one-launch form, above it the folded form.
ONE_KERNEL_ROWS = 256


__all__ = [
    "MAX_PARTS",
    "ONE_KERNEL_ROWS",
    "fold_stacked",
    "folded",
    "gemm_grouped",
    "kpart_partial",
]
