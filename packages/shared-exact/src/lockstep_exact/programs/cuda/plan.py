"""The expert plan (``programs.grouping.expert_plan``) as one Triton kernel.

The plan is integers only: the (row, slot) pairs of a router's ids sorted by expert, stably,
each expert's bounds, and the tiles of at most ``TILE_M`` pairs of one expert that the grouped
gemm runs. The torch form takes about 25 small launches (a stable argsort, searchsorted,
cumsums, gathers); here two launches compute the same tensors, each over many programs (one
program walking every pair in turn took about 60 us a call at 64 rows x 8 on an H100): the
first counts each block of pairs per expert, the second sums those counts (per expert: in
all, and in the blocks before its own) and places its block's pairs (its expert's bound, the
pairs of that expert in earlier blocks, the pairs of that expert before it in its block) and
its share of the tiles.
Integer arithmetic is exact, so the plan is the torch form's, element for element
(``tests/test_interpret.py`` compares them in Triton's interpreter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..grouping import TILE_M, ExpertPlan
from .arith import next_pow2, require, require_cuda

_BP = 64  # pairs per block (E <= 256; 32 above)
_BH = 16  # block histograms per load of the placement kernel
_BT = 64  # tiles per program


@triton.jit(do_not_specialize=["P"])
def _count_kernel(ids_ptr, hist_ptr, P, EP: tl.constexpr, BP: tl.constexpr):
    """Block b of BP pairs: how many of its pairs each expert has (``hist[b, e]``)."""
    b = tl.program_id(0)
    es = tl.arange(0, EP)
    i = b * BP + tl.arange(0, BP)
    e = tl.load(ids_ptr + i, mask=i < P, other=-1).to(tl.int32)
    counts = tl.sum((e[:, None] == es[None, :]).to(tl.int32), 0)
    tl.store(hist_ptr + b.to(tl.int64) * EP + es, counts)


@triton.jit(do_not_specialize=["P", "NB", "NT"])
def _place_kernel(
    ids_ptr, hist_ptr, order_ptr, src_ptr, bounds_ptr, tiles_ptr, P, K, E, NB, NT,
    EP: tl.constexpr, BP: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    """Program b: the places of block b's pairs and tiles [b * BT, (b + 1) * BT).

    Every program sums the block histograms (per expert: the count over all blocks, and over
    the blocks before b). A pair's place is its expert's first place (the exclusive sum of the
    counts), its expert's pairs in earlier blocks, and its expert's pairs before it in its own
    block (ascending pair index: a stable sort). Tile j belongs to the first expert whose
    running tile count passes j."""
    b = tl.program_id(0)
    es = tl.arange(0, EP)
    counts = tl.zeros([EP], tl.int32)
    before = tl.zeros([EP], tl.int32)
    for start in range(0, NB, BH):
        r = start + tl.arange(0, BH)
        h = tl.load(hist_ptr + r[:, None].to(tl.int64) * EP + es[None, :],
                    mask=(r < NB)[:, None], other=0)  # fmt: skip
        counts += tl.sum(h, 0)
        before += tl.sum(tl.where((r < b)[:, None], h, 0), 0)
    ends = tl.cumsum(counts, 0)
    firsts = ends - counts  # exclusive: expert e's pairs start here
    if b == 0:
        tl.store(bounds_ptr + es, firsts.to(tl.int64), mask=es < E)
        tl.store(bounds_ptr + E, tl.full([], P, tl.int64))
    lanes = tl.arange(0, BP)
    i = b * BP + lanes
    ok = i < P
    e = tl.load(ids_ptr + i, mask=ok, other=-1).to(tl.int32)
    hit = e[:, None] == es[None, :]  # [BP, EP]
    base = tl.sum(tl.where(hit, (firsts + before)[None, :], 0), 1)
    same = (e[:, None] == e[None, :]) & (lanes[None, :] < lanes[:, None])
    place = base + tl.sum(same.to(tl.int32), 1)
    tl.store(order_ptr + place, i.to(tl.int64), mask=ok)
    tl.store(src_ptr + place, (i // K).to(tl.int64), mask=ok)
    # tiles: expert e has ceil(count / TILE) of them
    per = (counts + (TILE - 1)) // TILE
    tile_ends = tl.cumsum(per, 0)
    j = b * BT + tl.arange(0, BT)
    owner = tl.sum((tile_ends[None, :] <= j[:, None]).to(tl.int32), 1)  # searchsorted right
    used = owner < E
    pick = es[None, :] == tl.minimum(owner, E - 1)[:, None]  # [BT, EP]
    nth = j - tl.sum(tl.where(pick, (tile_ends - per)[None, :], 0), 1)
    first = tl.sum(tl.where(pick, firsts[None, :], 0), 1) + nth * TILE
    rows = tl.minimum(tl.sum(tl.where(pick, counts[None, :], 0), 1) - nth * TILE, TILE)
    keep = j < NT
    tl.store(tiles_ptr + j * 3, tl.where(used, owner, -1), mask=keep)
    tl.store(tiles_ptr + j * 3 + 1, tl.where(used, first, 0), mask=keep)
    tl.store(tiles_ptr + j * 3 + 2, tl.where(used, rows, 0), mask=keep)


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
    bp = _BP if ep <= 256 else 32
    nb = max(triton.cdiv(pairs, bp), 1)
    nt = max(n, 1)
    flat = ids.contiguous().view(-1)
    hist = torch.empty(nb, ep, dtype=torch.int32, device=dev)
    _count_kernel[(nb,)](flat, hist, pairs, EP=ep, BP=bp, num_warps=4)
    _place_kernel[(max(nb, triton.cdiv(nt, _BT)),)](
        flat, hist, order, src, bounds, tiles, pairs, k, experts, nb, nt,
        EP=ep, BP=bp, BH=_BH, BT=_BT, TILE=TILE_M, num_warps=8,
    )  # fmt: skip
    return ExpertPlan(order, src, bounds, tiles, experts, k)


__all__ = ["expert_plan", "plan"]
