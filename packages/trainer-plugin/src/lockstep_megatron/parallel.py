"""Megatron's tensor and expert parallelism on the exact lane: ``tp * ep`` processes (gloo on
cpu), Megatron's own parallel state (``expert_model_parallel_size=ep``), column/row-parallel
linears holding each rank's shard, MoE layers holding each rank's experts (``moe.py``); the
composition gathers the row-parallel sites' fp32 partials over Megatron's tensor-parallel group
and the routed rows' expert outputs over its expert-parallel group.

``replay_tp`` replays a trace in ``tp * ep`` ranks. The expert-parallel ranks hold different
micro-batches (micro-batch i on ep rank i % ep, ``replay.share_of``; the MoE layers move their
rows through Megatron's token dispatcher, ``moe.py``); the tensor-parallel peers of one ep rank
hold the same ones and must compute the same bytes. The shares are put back in trace order.
"""

from __future__ import annotations

import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lockstep_exact.contract import check_layout
from lockstep_exact.model import ModelDir
from lockstep_exact.parity import same_bytes
from lockstep_exact.trace import Trace

from .cpu import ensure_cpu_megatron
from .moe import rows_received
from .scoring import replay_in_process, share_of


class RanksDisagree(RuntimeError):
    """Two ranks computed different bytes (the lane promises they cannot)."""


def _rank(rank: int, tp: int, ep: int, store: str, args: tuple, out: str) -> None:
    ensure_cpu_megatron()
    torch.set_num_threads(1)
    world = tp * ep
    dist.init_process_group("gloo", init_method=f"file://{store}", world_size=world, rank=rank)
    try:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import random as mrandom

        # Ranks ep_index * tp + tp_index (layout.Layout's numbering); experts whole per
        # expert-parallel rank, split by the tensor-parallel group (Megatron's default).
        parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
        mrandom.model_parallel_cuda_manual_seed(0)
        lps, seconds = replay_in_process(*args, tp=tp, ep=ep)
        result = {"logprobs": lps, "seconds": seconds, "rows_received": rows_received()}
        torch.save(result, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def replay_tp(
    model_dir,
    trace_dir,
    adapter_dir,
    backend: str,
    micro_batch: int,
    control: bool,
    tp: int,
    ep: int = 1,
    stats: dict | None = None,
) -> tuple[torch.Tensor, float]:
    """(logprobs in trace order, seconds). ``stats``, if given, receives ``rows_received``:
    per rank, the expert rows it ran of tokens another expert-parallel rank held."""
    model = ModelDir(model_dir)
    check_layout(model.contract(backend), tp=tp, ep=ep)  # refuses, naming both numbers
    world = tp * ep
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lockstep-tp-") as tmp:
        adapter = str(adapter_dir) if adapter_dir is not None else None
        args = (str(model_dir), str(trace_dir), adapter, backend, micro_batch, control)
        mp.start_processes(
            _rank,
            args=(tp, ep, f"{tmp}/store", args, f"{tmp}/out"),
            nprocs=world,
            start_method="spawn",
        )
        results = [torch.load(f"{tmp}/out.{r}") for r in range(world)]
    for r, res in enumerate(results):
        lead = r - r % tp  # tp index 0 of this rank's ep index
        if not same_bytes(res["logprobs"], results[lead]["logprobs"]):
            raise RanksDisagree(
                f"rank {r} (tp index {r % tp}, ep index {r // tp}) computed other bytes than "
                f"rank {lead}"
            )
    if stats is not None:
        stats["rows_received"] = [res["rows_received"] for res in results]
    if ep == 1:
        return results[0]["logprobs"], time.perf_counter() - t0
    trace = Trace.load(trace_dir)
    n, mb = trace.num_sequences, micro_batch
    decisions = [
        sum(trace.sampled(i).numel() for i in range(b * mb, min(n, (b + 1) * mb)))
        for b in range(-(-n // mb))
    ]
    pieces: dict[int, torch.Tensor] = {}
    for e in range(ep):
        mine = share_of(n, mb, e, ep)
        parts = torch.split(results[e * tp]["logprobs"], [decisions[b] for b in mine])
        pieces.update(zip(mine, parts, strict=True))
    lps = torch.cat([pieces[b] for b in sorted(pieces)]) if pieces else results[0]["logprobs"]
    return lps, time.perf_counter() - t0


__all__ = ["RanksDisagree", "replay_tp"]
