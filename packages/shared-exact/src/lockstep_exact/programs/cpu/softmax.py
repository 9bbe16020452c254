"""softmax and log_softmax over a fixed tree, fp32."""

from __future__ import annotations

import torch

from .arith import F32, exp, log, require, tree_sum


def _shifted(x: torch.Tensor) -> torch.Tensor:
    require(x.dtype == F32, f"softmax programs take float32, got {x.dtype}")
    return x - x.amax(dim=-1, keepdim=True)  # max is exact in any order


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """s = x - max(x); out = s - log(tree_sum(exp(s)))."""
    s = _shifted(x)
    return s - log(tree_sum(exp(s)))[..., None]


def softmax(x: torch.Tensor) -> torch.Tensor:
    """e = exp(x - max(x)); out = e / tree_sum(e)."""
    e = exp(_shifted(x))
    return e / tree_sum(e)[..., None]


# --- the same tree, cut at shard boundaries (vocab-parallel log_softmax) -------------------------
def tree_width(vocab: int) -> int:
    """The leaf count of log_softmax.tree's sum: ``vocab`` padded with +0 to a power of two."""
    require(vocab >= 1, f"log_softmax.tree: vocabulary of {vocab} columns")
    return 1 << (vocab - 1).bit_length()


def tree_spans(lo: int, hi: int) -> list[tuple[int, int]]:
    """The maximal aligned power-of-two spans tiling columns [lo, hi), left to right, as
    (start, size): the nodes of the full tree that lie inside the range (at most about
    2 log2(hi) of them). Each is a whole subtree, so its sum is that tree node's value."""
    spans, p = [], lo
    while p < hi:
        size = p & -p if p else 1 << (hi.bit_length() - 1)
        while size > hi - p:
            size >>= 1
        spans.append((p, size))
        p += size
    return spans


def tree_node_count(vocab: int) -> int:
    """An upper bound on ``len(tree_spans(lo, hi))`` for any range inside the tree's width:
    what one rank sends, padded, so every rank's message has one shape."""
    return 2 * tree_width(vocab).bit_length()


def shard_tree_nodes(s: torch.Tensor, start: int, vocab: int) -> torch.Tensor:
    """fp32 [..., tree_node_count(vocab)]: for shifted values ``s`` [..., n] at columns
    [start, start + n) of the row, the sums of exp(s) over ``tree_spans(start, start + n)``
    (left to right, each the adjacent-pair tree of its span), then +0 up to the fixed count."""
    require(s.dtype == F32, f"softmax programs take float32, got {s.dtype}")
    n = s.shape[-1]
    require(start >= 0 and start + n <= vocab, f"columns [{start}, {start + n}) of {vocab}")
    e = exp(s)
    nodes = [
        tree_sum(e[..., p - start : p - start + size]) for p, size in tree_spans(start, start + n)
    ]
    out = s.new_zeros(*s.shape[:-1], tree_node_count(vocab))
    if nodes:
        out[..., : len(nodes)] = torch.stack(nodes, dim=-1)
    return out


def fold_tree_nodes(ranges: list[tuple[int, int]], nodes: list[torch.Tensor], vocab: int):
    """The root of log_softmax.tree's sum from every rank's nodes: ``ranges`` [(lo, hi)] tile
    [0, vocab) in rank order, ``nodes[r]`` is rank r's ``shard_tree_nodes``. The padding
    columns [vocab, width) contribute their +0 subtrees; sibling nodes are added left + right,
    lowest level first, which are the additions of the unsharded tree above these nodes."""
    width = tree_width(vocab)
    level: dict[tuple[int, int], torch.Tensor] = {}  # (start, size) -> node value
    for (lo, hi), values in zip(ranges, nodes, strict=True):
        for i, span in enumerate(tree_spans(lo, hi)):
            level[span] = values[..., i]
    zero = torch.zeros_like(nodes[0][..., 0])
    for span in tree_spans(vocab, width):
        level[span] = zero  # a subtree of +0 leaves sums to +0
    while len(level) > 1:
        size = min(sz for _, sz in level)
        lefts = sorted(p for p, sz in level if sz == size and p % (2 * size) == 0)
        for p in lefts:
            right = level.pop((p + size, size), None)
            require(right is not None, f"log_softmax.tree: no tree node at [{p + size}, +{size})")
            level[(p, 2 * size)] = level.pop((p, size)) + right
        stray = sorted(p for p, sz in level if sz == size)
        require(not stray, f"log_softmax.tree: tree nodes of {size} at {stray} have no sibling")
    ((span, root),) = level.items()
    require(span == (0, width), f"log_softmax.tree: the nodes fold to {span}, not (0, {width})")
    return root


def log_softmax_from_sum(s: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """out = s - log(total): the last step of log_softmax.tree on any columns of the row."""
    return s - log(total)[..., None]
