"""Helpers of test_log_softmax_sharded.py that spawned processes import by name (a test
module collected in importlib mode is not importable from a child process)."""

from __future__ import annotations

import torch

from lockstep_exact import programs as P
from lockstep_exact.layout import DistGather

INF, NAN = float("inf"), float("nan")


def rows(vocab: int, seed: int = 0) -> torch.Tensor:
    """Random rows plus the edge rows: all -inf, a NaN, a +inf, some -inf, signed zeros at
    the max, a huge range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(9, vocab, generator=g) * 5.0
    x[1] = -INF
    x[2, vocab // 3] = NAN
    x[3, vocab - 1] = INF
    x[4, ::7] = -INF
    x[5] = x[5] - 50.0
    x[5, 0], x[5, vocab // 2] = 0.0, -0.0
    x[6] = x[6] * 1e4
    return x


def gloo_rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", world_size=2, rank=rank)
    try:
        vocab, bounds = 32003, [0, 12345, 32003]
        x = rows(vocab, seed=7)
        lo, hi = bounds[rank], bounds[rank + 1]
        gather = DistGather(dist.group.WORLD, 2)
        torch.save(
            P.log_softmax_sharded(x[:, lo:hi].contiguous(), lo, vocab, gather), f"{out}.{rank}"
        )
    finally:
        dist.destroy_process_group()
