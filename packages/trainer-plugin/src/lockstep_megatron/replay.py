"""Replay: recompute every decision of a trace in Megatron (teacher forcing).

Admission first (contract fingerprint, model hash, adapter hash; the first mismatch is named),
then each sequence (prompt + sampled tokens) is teacher-forced in micro-batches of the
trainer's choosing, right-padded, and the logprob of every sampled token is gathered in the
trace's decision order. A trace drawn by a lane sampler records its sampling rule and seeds:
each sampled token must then be the rule's draw from the trainer's own row (``TokenRule``),
or the trace is refused naming the first decision that is not.

``replay`` runs in this process (``scoring.replay_in_process``) or, at ``tp`` or ``ep`` > 1,
in ``tp * ep`` ranks (``parallel.replay_tp``, whose ranks each run the in-process form); the
admission and scoring (``scoring``) are read here under their names too.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from .parallel import replay_tp
from .scoring import (  # noqa: F401 (replay's names, read as replay.X)
    LORA_SITES,
    AdmissionError,
    TokenMismatch,
    TokenRule,
    admit_invoked,
    admit_trace,
    check_hybrid_replay,
    check_replay_backend,
    pad_batch,
    replay_in_process,
    sampled_logprobs,
    score,
    sequences,
    share_of,
)


def replay(
    model_dir: Path,
    trace_dir: Path,
    adapter_dir: Path | None = None,
    backend: str = "cpu",
    micro_batch: int = 3,
    control: bool = False,
    tp: int = 1,
    ep: int = 1,
) -> tuple[torch.Tensor, float]:
    """(fp32 logprob per decision in trace order, seconds). ``tp`` or ``ep`` > 1: Megatron's
    tensor and expert parallelism in ``tp * ep`` processes (``parallel.replay_tp``): each
    expert-parallel rank scores its share of the micro-batches (``share_of``), its
    tensor-parallel peers must agree, and the shares are put back in trace order."""
    if tp * ep > 1 and not _inside_ranks(tp * ep):
        check_replay_backend(backend, tp * ep)
        check_hybrid_replay(model_dir, adapter_dir, backend, tp, ep)  # what the hybrid lane lacks
        return replay_tp(model_dir, trace_dir, adapter_dir, backend, micro_batch, control, tp, ep)
    return replay_in_process(
        model_dir, trace_dir, adapter_dir, backend, micro_batch, control, tp, ep
    )


def _inside_ranks(world: int) -> bool:
    """True in one of ``parallel.replay_tp``'s ranks (a process group of ``world`` is up)."""
    return dist.is_initialized() and dist.get_world_size() == world
