"""The lockstep hooks answered by the vLLM serving plugin (role "sampler").

The lockstep CLI loads this module (entry point group ``lockstep``) for every command, in every
environment: it imports no engine, no torch, and the vLLM half (``capture``, ``session``,
``dump``, ``lora``: each runs vLLM) only inside the hook that needs it.
"""

from __future__ import annotations

import os

from lockstep_exact import hookimpl
from lockstep_exact.requests import EngineInfo

from .. import __version__
from .._release import check, problem
from .patches import problems

# Loaded by the lockstep CLI (never by vLLM itself): keep vLLM's per-engine INFO lines out of
# the ladder's progress output unless the user asked for them.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _backends() -> tuple[str, ...]:
    """The lane's backend is the engine's device: cuda under a CUDA vLLM (0.26.0 on the
    GPU machine), cpu under the CPU build (0.32.0)."""
    import torch

    return ("cuda",) if torch.cuda.is_available() else ("cpu",)


@hookimpl
def lockstep_engine_info():
    try:
        import vllm
    except Exception as err:  # any import failure means this half cannot run here
        return EngineInfo(
            plugin="lockstep-serving",
            role="sampler",
            engine="vllm",
            engine_version=None,
            plugin_version=__version__,
            problem=f"vllm is not importable: {err}",
            torch_version=_torch_version(),
        )
    found = problems() + [p for p in (problem(),) if p]
    return EngineInfo(
        plugin="lockstep-serving",
        role="sampler",
        engine="vllm",
        engine_version=vllm.__version__,
        plugin_version=__version__,
        backends=_backends(),
        problem="; ".join(found) if found else None,
        torch_version=_torch_version(),
    )


def _torch_version() -> str:
    import torch

    return torch.__version__


@hookimpl
def lockstep_sampler_contract(model_dir, adapter_dir, backend):
    from lockstep_exact.model import ModelDir

    return ModelDir(model_dir, hybrid=True).contract(backend)  # vllm/next.py serves Qwen3-Next


@hookimpl
def lockstep_capture(request):
    check()
    from .capture import capture

    return capture(request)


@hookimpl
def lockstep_sampler_session(request):
    check()
    from .session import VllmSampler

    return VllmSampler(request)


@hookimpl
def lockstep_load_adapter(adapter_dir, model_dir, role):
    if role != "sampler":
        return None
    from ..common.capture import adapter_hash

    return adapter_hash(adapter_dir, model_dir)


@hookimpl
def lockstep_dump_sites(request):
    if request.role != "sampler":
        return None
    from .dump import dump_sites

    return dump_sites(request)


@hookimpl
def lockstep_serve_command(request):
    from .server import server_argv, server_env

    argv = server_argv(
        request.model_dir,
        backend=request.backend,
        extra=list(request.extra),
        contract=request.contract,
    )
    return argv, server_env(request.backend)
