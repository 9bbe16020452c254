"""softmax and log_softmax on the GPU: one program per row, fp32."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..kernels import note
from .arith import EXACT, F32, next_pow2, require, require_cuda

# Rows up to this length are held in registers (one read); longer rows are visited in chunks
# of _CHUNK (three reads). Which path a row takes depends on its length only.
_ONE_BLOCK_MAX = 32768
_CHUNK = 8192
# A chunked row is either one program's work (many rows) or spread over three kernels with
# many programs per row (few rows: one program per row would leave most of the GPU idle). The
# operation sequence of every element is the same either way, so the choice is free and follows
# the row count; test_softmax_split_gives_the_same_bytes gates it bitwise.
_SPLIT_MAX_ROWS = 128
_LANES = 512  # lanes per program in the split sum pass (each lane's chain is elementwise)


@triton.jit
def _softmax_kernel(
    x_ptr, y_ptr, V, stride_x, stride_y, BLOCK: tl.constexpr, ONE: tl.constexpr, LOG: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    src = x_ptr + row * stride_x
    dst = y_ptr + row * stride_y
    offs = tl.arange(0, BLOCK)
    if ONE:
        ok = offs < V
        x = tl.load(src + offs, mask=ok, other=float("-inf"))
        m = tl.max(x, 0)
        s = x - m
        e = tl.where(ok, libdevice.exp(s), 0.0)
        total = tl.sum(e, 0)
        if LOG:  # noqa: SIM108 (a constexpr branch, not a ternary)
            out = s - libdevice.log(total)
        else:
            out = tl.math.div_rn(e, tl.zeros_like(e) + total)
        tl.store(dst + offs, out, mask=ok)
    else:
        # The max and the output visit the chunks last to first, the sum first to last (its
        # fixed order): each pass starts on the chunks the previous one read last, which may
        # still sit in L2 when many long rows stream at once. Max and the output are exact in
        # any order, so no byte moves.
        n_chunks = tl.cdiv(V, BLOCK)
        m_vec = tl.full([BLOCK], float("-inf"), tl.float32)
        for i in range(0, n_chunks):
            c = (n_chunks - 1 - i) * BLOCK
            x = tl.load(src + c + offs, mask=c + offs < V, other=float("-inf"))
            m_vec = tl.maximum(m_vec, x)
        m = tl.max(m_vec, 0)
        acc = tl.zeros([BLOCK], tl.float32)
        for c in range(0, V, BLOCK):
            ok = c + offs < V
            x = tl.load(src + c + offs, mask=ok, other=float("-inf"))
            acc += tl.where(ok, libdevice.exp(x - m), 0.0)
        total = tl.sum(acc, 0)
        lse = libdevice.log(total)
        for i in range(0, n_chunks):
            c = (n_chunks - 1 - i) * BLOCK
            ok = c + offs < V
            x = tl.load(src + c + offs, mask=ok, other=0.0)
            s = x - m
            if LOG:
                out = s - lse
            else:
                e = libdevice.exp(s)
                out = tl.math.div_rn(e, tl.zeros_like(e) + total)
            tl.store(dst + c + offs, out, mask=ok)


@triton.jit
def _chunk_max_kernel(x_ptr, pmax_ptr, V, stride_x, n_chunks, CHUNK: tl.constexpr):
    """Split pass 1: the max of one chunk of one row (max is exact in any order)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf"))
    tl.store(pmax_ptr + row * n_chunks + c, tl.max(x, 0))


@triton.jit
def _row_max(pmax_ptr, row, n_chunks, PB: tl.constexpr):
    pb = tl.arange(0, PB)
    return tl.max(
        tl.load(pmax_ptr + row * n_chunks + pb, mask=pb < n_chunks, other=float("-inf")), 0
    )


@triton.jit
def _lane_sum_kernel(
    x_ptr, pmax_ptr, acc_ptr, V, stride_x, n_chunks,
    CHUNK: tl.constexpr, LANES: tl.constexpr, PB: tl.constexpr,
):  # fmt: skip
    """Split pass 2: the one-program kernel's per-lane chunk sums, for LANES of its lanes."""
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.program_id(1) * LANES + tl.arange(0, LANES)
    m = _row_max(pmax_ptr, row, n_chunks, PB)
    src = x_ptr + row * stride_x
    acc = tl.zeros([LANES], tl.float32)
    for c in range(0, V, CHUNK):
        ok = c + lanes < V
        x = tl.load(src + c + lanes, mask=ok, other=float("-inf"))
        acc += tl.where(ok, libdevice.exp(x - m), 0.0)
    tl.store(acc_ptr + row * CHUNK + lanes, acc)


@triton.jit
def _split_out_kernel(
    x_ptr, y_ptr, pmax_ptr, acc_ptr, V, stride_x, stride_y, n_chunks,
    CHUNK: tl.constexpr, PB: tl.constexpr, LOG: tl.constexpr,
):  # fmt: skip
    """Split pass 3: tl.sum over the CHUNK lane sums (the one-program kernel's tree: same block,
    same warps), then one chunk of the output."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * CHUNK
    m = _row_max(pmax_ptr, row, n_chunks, PB)
    offs = tl.arange(0, CHUNK)
    total = tl.sum(tl.load(acc_ptr + row * CHUNK + offs), 0)
    ok = c + offs < V
    x = tl.load(x_ptr + row * stride_x + c + offs, mask=ok, other=0.0)
    s = x - m
    if LOG:
        out = s - libdevice.log(total)
    else:
        e = libdevice.exp(s)
        out = tl.math.div_rn(e, tl.zeros_like(e) + total)
    tl.store(y_ptr + row * stride_y + c + offs, out, mask=ok)


def _warps(block: int) -> int:
    return max(1, min(16, block // 512))


def _launch(x: torch.Tensor, log: bool, split: bool | None = None) -> torch.Tensor:
    require_cuda(x)
    require(x.dtype == F32, f"softmax programs take float32, got {x.dtype}")
    n = x.shape[-1]
    require(n >= 1, "softmax over an empty dimension")
    x2 = x.reshape(-1, n).contiguous()
    y = torch.empty_like(x2)
    rows = x2.shape[0]
    one = n <= _ONE_BLOCK_MAX
    # Triton compiles a row length that is a multiple of 16 apart from one that is not, and
    # the one-program kernel's lane sums are then summed in another order; the split kernels
    # reproduce the first order only (measured on the H200: equal bytes for V = 50000, 151936
    # and 262144, not for 32769).
    can_split = not one and n % 16 == 0
    if split is None:
        split = can_split and rows <= _SPLIT_MAX_ROWS
    require(
        not split or can_split,
        f"softmax (cuda): the split path takes rows longer than {_ONE_BLOCK_MAX} whose length "
        f"is a multiple of 16, got {n}",
    )
    if rows == 0:
        return y.reshape(x.shape)
    note(f"cuda.{'log_softmax' if log else 'softmax'}:{'split' if split else 'one-program'}")
    if split:
        n_chunks = triton.cdiv(n, _CHUNK)
        pb = next_pow2(n_chunks)
        pmax = torch.empty(rows, n_chunks, dtype=F32, device=x.device)
        acc = torch.empty(rows, _CHUNK, dtype=F32, device=x.device)
        _chunk_max_kernel[(rows, n_chunks)](
            x2, pmax, n, x2.stride(0), n_chunks, CHUNK=_CHUNK, num_warps=8, **EXACT
        )
        _lane_sum_kernel[(rows, _CHUNK // _LANES)](
            x2, pmax, acc, n, x2.stride(0), n_chunks,
            CHUNK=_CHUNK, LANES=_LANES, PB=pb, num_warps=4, **EXACT,
        )  # fmt: skip
        _split_out_kernel[(rows, n_chunks)](
            x2, y, pmax, acc, n, x2.stride(0), y.stride(0), n_chunks,
            CHUNK=_CHUNK, PB=pb, LOG=log, num_warps=_warps(_CHUNK), **EXACT,
        )  # fmt: skip
        return y.reshape(x.shape)
    block = next_pow2(n) if one else _CHUNK
    _softmax_kernel[(rows,)](
        x2,
        y,
        n,
        x2.stride(0),
        y.stride(0),
        BLOCK=block,
        ONE=one,
        LOG=log,
        num_warps=_warps(block),
        **EXACT,
    )
    return y.reshape(x.shape)


def log_softmax(x: torch.Tensor, *, split: bool | None = None) -> torch.Tensor:
    """s = x - max(x); out = s - log(sum(exp(s))).

    exp and log are libdevice's __nv_expf / __nv_logf (fixed instruction sequences). The sum
    is a fixed order set by the row length alone: rows up to 32768 use Triton's tl.sum tree
    over one [next_pow2(n)] block; longer rows add chunk by chunk (8192 lanes, ascending
    chunks) and then tl.sum over the lanes. max is exact in any order. Few long rows are
    spread over many programs per row (the same operations per element); ``split`` (None: by
    the row count) only chooses that, and moves no byte.
    """
    return _launch(x, log=True, split=split)


def softmax(x: torch.Tensor, *, split: bool | None = None) -> torch.Tensor:
    """e = exp(x - max(x)); out = e / sum(e) (IEEE division); the sum as in log_softmax."""
    return _launch(x, log=False, split=split)
