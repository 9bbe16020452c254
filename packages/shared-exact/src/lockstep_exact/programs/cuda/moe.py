"""router.softmax_topk and moe.fold on the GPU.

The router is one Triton kernel: the definition's softmax (the cpu softmax program's
operations: the cuda backend has always run the cpu definition here, and its lock goldens are
the cpu ones), the top k with ties to the lowest expert id in ascending id order, the pair-tree
normalization and the bf16 rounding. moe.fold is one Triton kernel. Both perform the operations
of the shared definitions (``cpu/moe.py``: ``router_topk``, ``fold``, ``fold_fp32``) in their
order, with the cpu helpers' Triton forms (``exactmath``); the rounding to bf16 is RNE with NaNs
as 0x7FC0, this backend's ``round_bf16``. Checked against the definitions in Triton's interpreter
(``tests/test_interpret.py``) and on a GPU by the cuda lock's goldens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..cpu.arith import BF16, F32, require
from . import exactmath as em
from .arith import EXACT, next_pow2, require_cuda

_BLOCK_H = 256  # hidden columns per fold program


def router_warps(ep: int) -> int:
    """Warps per router program (one row of ``ep`` padded experts): one warp up to 128 experts,
    so the row's max, top-k picks and sums stay inside a warp (no barrier between them; each
    is exact in any order, so the bytes do not depend on it); four above, where one warp's
    registers would not hold the row (sm_90: 182 registers and no spill at 128 experts)."""
    return 1 if ep <= 128 else 4


@triton.jit
def _router_kernel(
    x_ptr, ids_ptr, w_ptr, s_ptr, E, K, stride_x,
    BF16_IN: tl.constexpr, EP: tl.constexpr, LOGE: tl.constexpr, KP: tl.constexpr,
    LOGK: tl.constexpr, NORMALIZE: tl.constexpr,
):  # fmt: skip
    """One row of router.softmax_topk: p = exp(x - max x) / tree_sum(...) with the cpu exp;
    the K largest p (the definition's stable sort on -p: a NaN after every number, ties to the
    lowest id) in ascending id order; normalized by the pair tree over them; to bf16."""
    row = tl.program_id(0).to(tl.int64)
    es = tl.arange(0, EP)
    real = es < E
    if BF16_IN:
        x = em.widen(tl.load(x_ptr + row * stride_x + es, mask=real, other=0))
    else:
        x = tl.load(x_ptr + row * stride_x + es, mask=real, other=0.0)
    # max over the row (torch.amax: a NaN anywhere makes it NaN; max is exact in any order)
    nan_in = tl.max(tl.where(real & (x != x), 1, 0), 0)
    m = tl.max(tl.where(real, x, -em.INF), 0)
    m = tl.where(nan_in > 0, em.nan_like(m), m)
    e = tl.where(real, em.exp(x - m), 0.0)  # +0 past E: tree_sum's padding
    # The pair tree reads e back from this row's scratch: its reshapes want every value in
    # each lane, and without the round trip the compiler recomputes the whole exp chain in
    # that layout (the row's 128 exps in every lane) instead of moving the values once.
    tl.store(s_ptr + row * EP + es, e)
    tl.debug_barrier()
    total = em.tree_cols(tl.reshape(tl.load(s_ptr + row * EP + es), (1, EP)), 1, EP, LOGE)
    p = tl.math.div_rn(e, tl.broadcast_to(total, (EP,)))
    key = tl.where(real, tl.where(p != p, -1.0, p), -2.0)  # p >= +0 or NaN
    chosen = es < 0
    for _ in range(K):
        best = tl.argmax(tl.where(chosen, -3.0, key), 0, tie_break_left=True)
        chosen = chosen | (es == best)
    # ascending ids: slot j takes the j-th smallest chosen id, and its p comes along (a sum of
    # it and +0s); every reduction here is over the row's own layout, one value a lane
    ks = tl.arange(0, KP)
    ids = tl.full((KP,), -1, tl.int32)
    w = tl.zeros((KP,), tl.float32)  # +0 past K
    last = -1
    for j in range(K):
        nxt = tl.min(tl.where(chosen & (es > last), es, EP), 0)
        pj = tl.sum(tl.where(es == nxt, p, 0.0), 0)
        ids = tl.where(ks == j, nxt, ids)
        w = tl.where(ks == j, pj, w)
        last = nxt
    if NORMALIZE:
        norm = em.tree_cols(tl.reshape(w, (1, KP)), 1, KP, LOGK)
        w = tl.math.div_rn(w, tl.broadcast_to(norm, (KP,)))
    tl.store(ids_ptr + row * K + ks, ids.to(tl.int64), mask=ks < K)
    tl.store(w_ptr + row * K + ks, em.round_bf16(w), mask=ks < K)


@triton.jit
def _fold_kernel(
    y_ptr, w_ptr, o_ptr, H, K,
    KP: tl.constexpr, LOGK: tl.constexpr, BH: tl.constexpr, ACC_BF16: tl.constexpr,
):  # fmt: skip
    """One row's block of hidden columns: c_i = w_i * y_i (bf16 after the product and after
    every add of the pair tree over i, or fp32 throughout and one rounding)."""
    row = tl.program_id(0).to(tl.int64)
    hs = tl.program_id(1) * BH + tl.arange(0, BH)
    ks = tl.arange(0, KP)
    ok = (ks[:, None] < K) & (hs[None, :] < H)
    y = em.widen(tl.load(y_ptr + (row * K + ks[:, None]) * H + hs[None, :], mask=ok, other=0))
    w = em.widen(tl.load(w_ptr + row * K + ks, mask=ks < K, other=0))
    c = w[:, None] * y  # padded slots: 0 * 0 = +0, the definition's +0 padding
    if ACC_BF16:
        c = em.widen(em.round_bf16(c))
        for lvl in tl.static_range(LOGK):
            a, b = tl.split(tl.permute(tl.reshape(c, (KP >> (lvl + 1), 2, BH)), (0, 2, 1)))
            c = em.widen(em.round_bf16(a + b))
        out = tl.reshape(c, (BH,))
    else:
        out = em.tree_rows(c, KP, BH, LOGK)
    tl.store(o_ptr + row * H + hs, em.round_bf16(out), mask=hs < H)


def router_topk(logits: torch.Tensor, k: int, *, normalize: bool = True):
    """logits [T, E] (bf16 or fp32) -> (expert ids [T, k] ascending, weights [T, k] bf16).

    The definition's bytes (``cpu/moe.py: router_topk``: its softmax is the cpu softmax
    program's operations, exp(x - max x) over the pair tree; the cuda lock's goldens are the
    cpu ones), as one kernel (``route``).
    """
    require_cuda(logits)
    return route(logits, k, normalize)


def route(logits: torch.Tensor, k: int, normalize: bool = True):
    """router.softmax_topk's launch, one program per row (no device check: the interpreter
    runs it on cpu tensors)."""
    require(logits.dim() == 2, "router_topk: logits [T, E]")
    require(logits.dtype in (BF16, F32), f"router_topk: bf16 or fp32 logits, got {logits.dtype}")
    t, e = logits.shape
    require(1 <= k <= e, f"router_topk: top-{k} of {e} experts")
    x = logits.contiguous()
    bf16 = x.dtype == BF16
    ids = torch.empty(t, k, dtype=torch.int64, device=x.device)
    w = torch.empty(t, k, dtype=torch.int16, device=x.device)
    if t:
        ep, kp = next_pow2(e), next_pow2(k)
        scratch = torch.empty(t, ep, dtype=F32, device=x.device)
        _router_kernel[(t,)](
            x.view(torch.int16) if bf16 else x, ids, w, scratch, e, k, e, BF16_IN=bf16, EP=ep,
            LOGE=ep.bit_length() - 1, KP=kp, LOGK=kp.bit_length() - 1, NORMALIZE=normalize,
            num_warps=router_warps(ep), **EXACT,
        )  # fmt: skip
    return ids, w.view(BF16)


def _fold(expert_out: torch.Tensor, weights: torch.Tensor, acc_bf16: bool) -> torch.Tensor:
    require(expert_out.dtype == BF16 and weights.dtype == BF16, "moe_fold: bf16 inputs")
    require(expert_out.dim() == 3 and weights.shape == expert_out.shape[:2], "moe_fold: shapes")
    t, k, h = expert_out.shape
    out = torch.empty(t, h, dtype=torch.int16, device=expert_out.device)
    if t and h:
        kp = next_pow2(k)
        _fold_kernel[(t, triton.cdiv(h, _BLOCK_H))](
            expert_out.contiguous().view(torch.int16), weights.contiguous().view(torch.int16),
            out, h, k, KP=kp, LOGK=kp.bit_length() - 1, BH=_BLOCK_H, ACC_BF16=acc_bf16,
            **EXACT,
        )  # fmt: skip
    return out.view(BF16)


def fold(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """moe.fold (bf16 per add) without the device check."""
    return _fold(expert_out, weights, acc_bf16=True)


def fold_fp32(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """moe.fold{acc=fp32} without the device check."""
    return _fold(expert_out, weights, acc_bf16=False)


def moe_fold(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """moe.fold (bf16 per add): expert_out [T, k, H] bf16 in ascending expert id order,
    weights [T, k] bf16 -> [T, H]; one kernel."""
    require_cuda(expert_out, weights)
    return fold(expert_out, weights)


def moe_fold_fp32(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """moe.fold{acc=fp32}: products and tree adds in fp32, one rounding; one kernel."""
    require_cuda(expert_out, weights)
    return fold_fp32(expert_out, weights)
