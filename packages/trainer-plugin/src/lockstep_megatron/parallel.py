"""Megatron's tensor parallelism on the exact lane: ``tp`` processes (gloo on cpu), Megatron's
own parallel state and column/row-parallel linears holding each rank's shard, the composition
gathering the row-parallel sites' fp32 partials over Megatron's tensor-parallel group.

``replay_tp`` replays a trace in ``tp`` ranks and returns their log-probabilities after
checking every rank holds the same bytes (they must: each ends with one device's bytes).
"""

from __future__ import annotations

import tempfile
import time

import torch

from lockstep_exact.contract import check_layout
from lockstep_exact.model import ModelDir
from lockstep_exact.parity import same_bytes


class RanksDisagree(RuntimeError):
    """Two tensor-parallel ranks computed different bytes (the lane promises they cannot)."""


def _rank(rank: int, tp: int, store: str, args: tuple, out: str) -> None:
    import torch.distributed as dist

    from .cpu import ensure_cpu_megatron

    ensure_cpu_megatron()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", world_size=tp, rank=rank)
    try:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import random as mrandom

        parallel_state.initialize_model_parallel(tp, 1)
        mrandom.model_parallel_cuda_manual_seed(0)
        from .replay import replay

        lps, seconds = replay(*args, tp=tp)
        torch.save({"logprobs": lps, "seconds": seconds}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def replay_tp(
    model_dir, trace_dir, adapter_dir, backend: str, micro_batch: int, control: bool, tp: int
) -> tuple[torch.Tensor, float]:
    import torch.multiprocessing as mp

    model = ModelDir(model_dir)
    check_layout(model.contract(backend), tp=tp)  # refuses, naming both numbers
    if model.geometry.is_moe:
        raise NotImplementedError(
            "Megatron MoE layers at tp > 1 are not wired to the lane yet (issue 14): replay "
            "MoE at tp 1"
        )
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lockstep-tp-") as tmp:
        adapter = str(adapter_dir) if adapter_dir is not None else None
        args = (str(model_dir), str(trace_dir), adapter, backend, micro_batch, control)
        mp.start_processes(
            _rank,
            args=(tp, f"{tmp}/store", args, f"{tmp}/out"),
            nprocs=tp,
            start_method="spawn",
        )
        results = [torch.load(f"{tmp}/out.{r}") for r in range(tp)]
    first = results[0]["logprobs"]
    for r, res in enumerate(results[1:], start=1):
        if not same_bytes(res["logprobs"], first):
            raise RanksDisagree(f"tensor-parallel rank {r} computed other bytes than rank 0")
    return first, time.perf_counter() - t0


__all__ = ["RanksDisagree", "replay_tp"]
