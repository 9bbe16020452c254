"""The trainer half's answers to the lockstep hooks (entry point ``lockstep: megatron``)."""

from __future__ import annotations

from pathlib import Path

import torch

from lockstep_exact import hookimpl
from lockstep_exact.model import ModelDir
from lockstep_exact.requests import EngineInfo, ReplayResult, TrainResult

from . import __version__
from ._release import problem as skew
from .gdn.refusals import check_replay

ROLE = "trainer"


@hookimpl
def lockstep_engine_info():
    try:
        import megatron.core

        version, problem = megatron.core.__version__, skew()
    except ImportError as err:
        version, problem = None, f"megatron-core is not importable: {err}"
    return EngineInfo(
        plugin="lockstep-megatron",
        role=ROLE,
        engine="megatron-core",
        engine_version=version,
        plugin_version=__version__,
        # cuda: replay and the training step on one GPU (tp x ep = 1)
        backends=("cpu", "cuda") if torch.cuda.is_available() else ("cpu",),
        problem=problem,
        torch_version=torch.__version__,
    )


@hookimpl
def lockstep_trainer_contract(model_dir, adapter_dir, backend):

    check_replay(model_dir, adapter_dir, backend, 1, 1)  # what the hybrid lane lacks (gdn/)
    model = ModelDir(model_dir, hybrid=True)  # the trainer scores Qwen3-Next (forward only)
    contract = model.contract(backend)
    if adapter_dir is not None:
        from .export import read_adapter

        read_adapter(adapter_dir, model)
    return contract


@hookimpl
def lockstep_replay(request):
    from .replay import replay

    lps, seconds = replay(
        Path(request.model_dir),
        Path(request.trace_dir),
        Path(request.adapter_dir) if request.adapter_dir else None,
        backend=request.backend,
        micro_batch=request.micro_batch,
        control=getattr(request, "control", False),
        tp=getattr(request, "tp", 1),
        ep=getattr(request, "ep", 1),
    )
    return ReplayResult(
        logprobs=lps, engine=f"megatron-core {_megatron_version()}", seconds=seconds
    )


@hookimpl
def lockstep_dump_sites(request):
    if request.role != ROLE:
        return None
    from .sites import dump_sites

    return dump_sites(
        Path(request.model_dir),
        torch.tensor(request.tokens, dtype=torch.long),
        request.position,
        Path(request.adapter_dir) if request.adapter_dir else None,
    )


@hookimpl
def lockstep_train_step(request):
    from .run import train

    return train(request)


@hookimpl
def lockstep_trainer_session(request):
    from .session import open_session

    return open_session(request)


@hookimpl
def lockstep_load_adapter(adapter_dir, model_dir, role):
    if role != ROLE:
        return None
    from .export import read_adapter

    return read_adapter(adapter_dir, model_dir).sha256


def _megatron_version() -> str:
    import megatron.core

    return megatron.core.__version__


__all__ = ["TrainResult"]


@hookimpl
def lockstep_verify(request):
    import dataclasses

    from .integration import check_rollout, lane_model_provider, read_rollouts

    rollouts = read_rollouts(request.rollouts)  # a malformed file fails before the model
    model = lane_model_provider(
        request.model_dir, backend=request.backend, adapter=request.adapter_dir
    )()
    return dataclasses.asdict(check_rollout(model, rollouts))
