"""The expert plan (``programs.grouping.expert_plan``) as one Triton kernel.

The plan is integers only: the (row, slot) pairs of a router's ids sorted by expert, stably,
each expert's bounds, and the tiles of at most ``TILE_M`` pairs of one expert that the grouped
gemm runs. The torch form takes about 25 small launches (a stable argsort, searchsorted,
cumsums, gathers); this kernel computes the same tensors in one program: per expert counts,
their exclusive sums (the bounds), each pair's place (its expert's bound, the pairs of that
expert in earlier blocks, the pairs of that expert before it in its block) and the tiles.
Integer arithmetic is exact, so the plan is the torch form's, element for element
(``tests/test_interpret.py`` compares them in Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..grouping import TILE_M, ExpertPlan
from .arith import next_pow2, require, require_cuda

_BP = 64  # pairs per block of the placement loop (E <= 256; 32 above)


@triton.jit(do_not_specialize=["P", "NT"])
def _plan_kernel(
    ids_ptr, order_ptr, src_ptr, bounds_ptr, tiles_ptr, P, K, E, NT,
    EP: tl.constexpr, BP: tl.constexpr, BT: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    es = tl.arange(0, EP)
    lanes = tl.arange(0, BP)
    # counts per expert
    counts = tl.zeros([EP], tl.int32)
    for start in range(0, P, BP):
        i = start + lanes
        e = tl.load(ids_ptr + i, mask=i < P, other=-1).to(tl.int32)
        counts += tl.sum((e[:, None] == es[None, :]).to(tl.int32), 0)
    ends = tl.cumsum(counts, 0)
    firsts = ends - counts  # exclusive: expert e's pairs start here
    tl.store(bounds_ptr + es, firsts.to(tl.int64), mask=es < E)
    tl.store(bounds_ptr + E, tl.full([], P, tl.int64))
    # each pair's place: its expert's first place, its expert's pairs in earlier blocks, its
    # expert's pairs before it in this block (ascending pair index: a stable sort)
    seen = tl.zeros([EP], tl.int32)
    for start in range(0, P, BP):
        i = start + lanes
        ok = i < P
        e = tl.load(ids_ptr + i, mask=ok, other=-1).to(tl.int32)
        hit = e[:, None] == es[None, :]  # [BP, EP]
        base = tl.sum(tl.where(hit, (firsts + seen)[None, :], 0), 1)
        same = (e[:, None] == e[None, :]) & (lanes[None, :] < lanes[:, None])
        place = base + tl.sum(same.to(tl.int32), 1)
        tl.store(order_ptr + place, i.to(tl.int64), mask=ok)
        tl.store(src_ptr + place, (i // K).to(tl.int64), mask=ok)
        seen += tl.sum(hit.to(tl.int32), 0)
    # tiles: expert e has ceil(count / TILE) of them; tile b belongs to the first expert whose
    # running tile count passes b
    per = (counts + (TILE - 1)) // TILE
    tile_ends = tl.cumsum(per, 0)
    for start in range(0, NT, BT):
        b = start + tl.arange(0, BT)
        owner = tl.sum((tile_ends[None, :] <= b[:, None]).to(tl.int32), 1)  # searchsorted right
        used = owner < E
        pick = es[None, :] == tl.minimum(owner, E - 1)[:, None]  # [BT, EP]
        j = b - tl.sum(tl.where(pick, (tile_ends - per)[None, :], 0), 1)
        first = tl.sum(tl.where(pick, firsts[None, :], 0), 1) + j * TILE
        rows = tl.minimum(tl.sum(tl.where(pick, counts[None, :], 0), 1) - j * TILE, TILE)
        ok = b < NT
        tl.store(tiles_ptr + b * 3, tl.where(used, owner, -1), mask=ok)
        tl.store(tiles_ptr + b * 3 + 1, tl.where(used, first, 0), mask=ok)
        tl.store(tiles_ptr + b * 3 + 2, tl.where(used, rows, 0), mask=ok)


def expert_plan(ids: torch.Tensor, experts: int) -> ExpertPlan:
    """``grouping.expert_plan`` in one launch: the same tensors, on the ids' device."""
    require_cuda(ids)
    return plan(ids, experts)


def plan(ids: torch.Tensor, experts: int) -> ExpertPlan:
    """The launch without the device check (the interpreter runs it on cpu tensors)."""
    require(
        ids.dim() == 2 and not ids.is_floating_point(),
        f"expert_plan: integer ids [T, k] expected, got {ids.dtype} {tuple(ids.shape)}",
    )
    require(experts >= 1, f"expert_plan: {experts} experts")
    t, k = ids.shape
    pairs = t * k
    dev = ids.device
    n = -(-pairs // TILE_M) + min(experts, pairs)
    order = torch.empty(pairs, dtype=torch.int64, device=dev)
    src = torch.empty(pairs, dtype=torch.int64, device=dev)
    bounds = torch.empty(experts + 1, dtype=torch.int64, device=dev)
    tiles = torch.empty(max(n, 1), 3, dtype=torch.int32, device=dev)
    ep = next_pow2(experts)
    _plan_kernel[(1,)](
        ids.contiguous().view(-1), order, src, bounds, tiles, pairs, k, experts, max(n, 1),
        EP=ep, BP=_BP if ep <= 256 else 32, BT=64, TILE=TILE_M, num_warps=8,
    )  # fmt: skip
    return ExpertPlan(order, src, bounds, tiles, experts, k)


__all__ = ["expert_plan", "plan"]
