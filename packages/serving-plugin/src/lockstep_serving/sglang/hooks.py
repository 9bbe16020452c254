"""The lockstep hooks answered by the SGLang half of the serving plugin (role "sampler").

Registered under the entry-point name ``sglang`` (group ``lockstep``), beside the vLLM half
(``vllm``). Where SGLang is not installed (the default, vLLM environment) every hook answers
None, so the vLLM half answers alone; ``lockstep capture --engine sglang`` picks this half by
name in the SGLang environment. Nothing here imports SGLang until a capture runs.
"""

from __future__ import annotations

from importlib import metadata

from lockstep_exact import hookimpl
from lockstep_exact.requests import EngineInfo

from .. import __version__
from .._release import check, problem
from .patches import SUPPORTED_SGLANG, unsupported


def sglang_version() -> str | None:
    """The installed SGLang's version (read from its metadata: importing SGLang takes
    seconds), or None."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def _backends() -> tuple[str, ...]:
    """The lane's backend is the engine's device: cuda where SGLang runs on a GPU (0.5.17 on
    the GPU machine), cpu on its CPU engine (0.5.21)."""
    import torch

    return ("cuda",) if torch.cuda.is_available() else ("cpu",)


@hookimpl
def lockstep_engine_info():
    version = sglang_version()
    if version is None:
        return None  # not installed here: the vLLM half speaks for the plugin
    found = [p for p in (problem(),) if p]
    if version not in SUPPORTED_SGLANG:
        found.append(unsupported(version))
    return EngineInfo(
        plugin="lockstep-serving",
        role="sampler",
        engine="sglang",
        engine_version=version,
        plugin_version=__version__,
        backends=_backends(),
        problem="; ".join(found) if found else None,
    )


@hookimpl
def lockstep_capture(request):
    if sglang_version() is None:
        return None
    check()
    from .capture import capture

    return capture(request)
