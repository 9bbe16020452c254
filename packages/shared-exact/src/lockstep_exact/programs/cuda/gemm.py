"""gemm.kblock on the GPU: a tiled Triton matmul, fixed BLOCK_K, fp32 accumulator, no split-K."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..kernels import note
from .arith import BF16, F32, require, require_cuda


@dataclass(frozen=True)
class Tiles:
    """One output tiling. BLOCK_K is the program's ``bk``; these are free tuning axes."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    # One program per multiprocessor walking the output tiles, operands loaded by TMA (sm_90+,
    # where K and the operands' starts allow it; the pointer kernel with the same tile
    # otherwise). The tile order and the loads do not enter an element's sequence.
    persistent: bool = False
    flatten: bool = True  # persistent only: one software pipeline across tiles (Triton's flatten)
    # Stages with an fp32 output, where the tile's fp32 epilogue buffer must fit in shared
    # memory beside the pipeline's (None: num_stages).
    fp32_stages: int | None = None


# Every tiling gives the same bytes (each output element's sequence is: acc = 0; for the K
# blocks in ascending order, acc = mma(x_blk, w_blk, acc) in k16 steps): gated bitwise by
# test_gemm_every_tiling_gives_the_same_bytes. The choice below may therefore follow the shape.
TILINGS: dict[str, Tiles] = {
    "m128n256": Tiles(128, 256, 8, 3),
    "m128n256s4": Tiles(128, 256, 8, 4),
    "m256n128": Tiles(256, 128, 8, 3),
    "m128n128": Tiles(128, 128, 8, 4),
    "m128n128w4": Tiles(128, 128, 4, 4),
    "m64n128": Tiles(64, 128, 4, 4),
    "m64n64": Tiles(64, 64, 4, 4),
    "m64n64s6": Tiles(64, 64, 4, 6),
    "m64n32": Tiles(64, 32, 4, 5),
    "m64n32s8": Tiles(64, 32, 4, 8),
    # The small-M sweep (docs/gpu.md): deeper pipelines for the one-wave picks below.
    "m64n32s10": Tiles(64, 32, 4, 10),
    "m64n64s8": Tiles(64, 64, 4, 8),
    "m64n128s6": Tiles(64, 128, 4, 6),
    # Persistent, TMA-fed (M >= 512 ran at 0.63-0.80x cuBLAS with the tilings
    # above; these at 0.85-0.97x in the H200 sweep, docs/gpu.md). Gated like every other tiling.
    # A 128 x 256 tile with an fp32 output and 3 stages asks for 278,552 B of shared memory
    # (H200: 232,448 B per block), so those take 2 stages there.
    "p128n256": Tiles(128, 256, 8, 3, persistent=True, fp32_stages=2),
    "p128n128": Tiles(128, 128, 8, 4, persistent=True),
    "p128n128w4": Tiles(128, 128, 4, 4, persistent=True),
    "p256n128": Tiles(256, 128, 8, 3, persistent=True),
    "p128n256nf": Tiles(128, 256, 8, 3, persistent=True, flatten=False, fp32_stages=2),
    "p64n128": Tiles(64, 128, 4, 6, persistent=True),
}

# Multiprocessors of the H200 the small-M choice below was timed on (docs/gpu.md).
_SMS = 132


def pick_tiling(m: int, n: int, bk: int) -> str:
    """Shape-based choice among byte-identical tilings (timed on the H200, docs/gpu.md).

    Up to 256 rows the kernel streams the weight, and the choice is the tile that gives the
    most programs still inside one wave (at most one per multiprocessor): 64 x 32, 64 x 64,
    64 x 128, then 128 x 128, with deep pipelines. Narrower tiles than that re-read x more
    and start a second, ragged wave; wider ones idle multiprocessors. The 64 x 128 tile goes
    persistent and TMA-fed from 64 rows (TMA loads whole boxes; with fewer rows the pointer
    kernel's masked loads were faster); 128 x 128 is persistent. Past one wave at 128 x 128,
    persistent 64 x 128 tiles from 64 rows, the older tilings below. Above 256 rows, with 64
    columns of K per step, the persistent TMA tilings (128 x 128 up to 768 rows, 128 x 256
    above) where they give at least half a wave of tiles; a narrow output (a router's N =
    128, say) keeps the tilings that give it more programs.
    """
    wide = bk >= 64
    if wide and m > 256:
        name = "p128n128w4" if m <= 768 else "p128n256nf"
        t = TILINGS[name]
        if triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n) * 2 >= _SMS:
            return name
    if m <= 256:
        full = m >= 64
        for name in ("m64n32s10", "m64n64s8", "p64n128" if full else "m64n128s6", "p128n128w4"):
            t = TILINGS[name]
            if triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n) <= _SMS:
                return name
        if full:
            return "p64n128"
        if triton.cdiv(n, 128) >= 2 * _SMS:  # a vocabulary-wide N (the LM head, say)
            return "m64n128"
        return "m64n64" if wide and triton.cdiv(n, 64) >= 2 * _SMS else "m64n64s6"
    if m <= 2048:
        return "m256n128" if wide else "m128n128w4"
    return "m128n256" if wide else "m256n128"


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def _sms(device: torch.device) -> int:
    return _properties(_index(device)).multi_processor_count


def tma_ok(x2: torch.Tensor, w: torch.Tensor) -> bool:
    """TMA can load both operands: sm_90 or later, a K that is a multiple of 16 bytes
    (K % 8 == 0 for bf16), and rows whose starts and byte strides are multiples of 16 (a
    K-slice of a wider tensor qualifies where its offset and the full row do)."""
    return (
        _properties(_index(x2.device)).major >= 9
        and x2.shape[1] % 8 == 0
        and all(
            t.data_ptr() % 16 == 0 and t.stride(0) % 8 == 0 and t.stride(0) >= t.shape[1]
            for t in (x2, w)
        )
    )


def _extent(t: torch.Tensor) -> int:
    """Elements from a non-empty 2-D operand's first to one past its last (its row stride
    included)."""
    return (t.shape[0] - 1) * t.stride(0) + t.shape[1]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where its last dimension is contiguous (a K-slice of a wider tensor, say:
    the kernels take a row stride), else a contiguous copy. The loads read the same values
    either way, so no byte depends on it."""
    return t if t.stride(-1) == 1 else t.contiguous()


def k_step(bk: int, k: int) -> int:
    """Columns of K per loop step: bk doubled while it stays <= 64 and divides K."""
    step = bk
    while step < 64 and k % (2 * step) == 0:
        step *= 2
    return step


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    FEW_M: tl.constexpr,
):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Rows/columns past the edge re-read valid ones; their results are never stored. With
    # fewer rows than the tile (FEW_M) the missing rows are zero-filled instead of re-read
    # (many copies of one row are slow to load). An output row sees only its own x row, so
    # neither moves a byte of it.
    m_ok = rm < M
    a_ptrs = x_ptr + (rm if FEW_M else rm % M)[:, None] * stride_xm + rk[None, :]
    b_ptrs = w_ptr + (rn % N)[None, :] * stride_wn + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            if FEW_M:  # noqa: SIM108 (a constexpr branch, not a ternary)
                a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = rk < K - kb * BLOCK_K  # a ragged last block is padded with +0 products
            if FEW_M:
                a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & (rn[None, :] < N))


@triton.jit(do_not_specialize=["M", "num_progs"])
def _gemm_tma_kernel(
    x_desc,
    w_desc,
    y_ptr,
    M,
    N,
    K,
    stride_ym,
    num_progs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    """The same output tiles as ``_gemm_kernel``, walked by ``num_progs`` resident programs;
    each tile's K blocks ascend as there, loaded by TMA. Past an edge TMA fills zeros: a
    ragged last K block adds +0 products, as the masked loads do, and rows or columns past
    M or N are never stored."""
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    k_blocks = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), grid_m * grid_n, num_progs, flatten=FLATTEN):
        first_m = (tile // width) * GROUP_M
        size_m = tl.minimum(grid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % width) % size_m
        pid_n = (tile % width) // size_m
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, k_blocks):
            a = x_desc.load([pid_m * BLOCK_M, kb * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, kb * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    bk: int,
    out_dtype=torch.bfloat16,
    tiling: str | None = None,
    block_k: int | None = None,
    out: torch.Tensor | None = None,
):
    """x [..., K] bf16 times w [N, K]^T bf16.

    Products of bf16 operands are exact in fp32. Per output element: acc = 0; for each block
    of ``bk`` consecutive k, ascending, acc = mma(x_blk, w_blk, acc): the tensor core adds the
    block's products into the fp32 accumulator in k16 steps (wgmma on sm_90; its order inside a
    step is the hardware's, fixed). A ragged last block is padded with +0 products. One RNE
    rounding to ``out_dtype`` at the end. No split-K, no atomics: an element's operation
    sequence depends on K and bk only, never on M, its row, or the tiling.

    A block of ``bk`` is bk/16 k16 steps into one accumulator, so two consecutive blocks are
    the steps of one block of 2*bk: where K allows, the kernel loads ``block_k`` (None: up to
    64) columns per loop step. Gated bitwise (test_gemm_wider_k_steps_give_the_same_bytes).
    ``out``: an [M, N] tensor of ``out_dtype`` with contiguous rows to write the result into
    (a slice of a stacked buffer, say); the bytes are the same.
    """
    require_cuda(x, w)
    require(x.dtype == BF16 and w.dtype == BF16, "gemm (cuda): bf16 x and w required")
    require(w.dim() == 2, "gemm: weight must be [N, K]")
    require(x.shape[-1] == w.shape[-1], f"gemm: K mismatch {tuple(x.shape)} x {tuple(w.shape)}")
    require(bk in (16, 32, 64), f"gemm (cuda): bk must be 16, 32 or 64, got {bk}")
    require(out_dtype in (BF16, F32), f"gemm: unsupported out_dtype {out_dtype}")
    k_dim = x.shape[-1]
    n_dim = w.shape[0]
    lead = x.shape[:-1]
    x2 = _rows(x.reshape(-1, k_dim))
    wc = _rows(w)
    m_dim = x2.shape[0]
    if out is None:
        y = torch.empty(m_dim, n_dim, dtype=out_dtype, device=x.device)
    else:
        require(
            out.shape == (m_dim, n_dim)
            and out.dtype == out_dtype
            and out.device == x.device
            and out.stride(1) == 1,
            f"gemm: out must be [{m_dim}, {n_dim}] {out_dtype} on {x.device} with contiguous "
            f"rows, got {tuple(out.shape)} {out.dtype}",
        )
        y = out
    if m_dim == 0 or n_dim == 0:
        return y.reshape(*lead, n_dim)
    if k_dim == 0:
        return y.zero_().reshape(*lead, n_dim)
    require(max(_extent(x2), _extent(wc), y.numel()) < 2**31, "gemm (cuda): tensor too large")
    if block_k is None:
        block_k = k_step(bk, k_dim)
    require(
        block_k in (bk, 2 * bk, 4 * bk)
        and block_k <= 64
        and (block_k == bk or k_dim % block_k == 0),
        f"gemm (cuda): block_k must be bk ({bk}) or a multiple of it up to 64 that divides "
        f"K ({k_dim}), got {block_k}",
    )
    t = TILINGS[tiling or pick_tiling(m_dim, n_dim, block_k)]
    tiles = triton.cdiv(m_dim, t.block_m) * triton.cdiv(n_dim, t.block_n)
    if t.persistent and tma_ok(x2, wc):
        note("cuda.gemm:tma")
        # Only where TMA runs (tma_ok): older triton builds lack the module.
        from triton.tools.tensor_descriptor import TensorDescriptor

        progs = min(tiles, _sms(x.device))
        _gemm_tma_kernel[(progs,)](
            TensorDescriptor.from_tensor(x2, [t.block_m, block_k]),
            TensorDescriptor.from_tensor(wc, [t.block_n, block_k]),
            y,
            m_dim,
            n_dim,
            k_dim,
            y.stride(0),
            progs,
            BLOCK_M=t.block_m,
            BLOCK_N=t.block_n,
            BLOCK_K=block_k,
            GROUP_M=t.group_m,
            FLATTEN=t.flatten,
            num_warps=t.num_warps,
            num_stages=t.fp32_stages if out_dtype == F32 and t.fp32_stages else t.num_stages,
        )
        return y.reshape(*lead, n_dim)
    note("cuda.gemm:pointer")
    grid = (tiles,)
    _gemm_kernel[grid](
        x2,
        wc,
        y,
        m_dim,
        n_dim,
        k_dim,
        x2.stride(0),
        wc.stride(0),
        y.stride(0),
        BLOCK_M=t.block_m,
        BLOCK_N=t.block_n,
        BLOCK_K=block_k,
        GROUP_M=t.group_m,
        EVEN_K=k_dim % block_k == 0,
        FEW_M=m_dim < t.block_m,
        num_warps=t.num_warps,
        num_stages=t.num_stages,
    )
    return y.reshape(*lead, n_dim)
