"""CPU support for megatron-core 0.16.1: every patch in one table, applied only without a GPU.

megatron-core assumes CUDA in a few places the exact lane reaches (RNG tracker, buffer
devices). On a machine without a GPU, ``ensure_cpu_megatron()`` applies the patches in
``PATCHES`` (idempotent) and ``init_single_process()`` starts gloo with world size 1 and
``parallel_state.initialize_model_parallel(1, 1)``. With a GPU present nothing is patched.
The test ``test_every_patch_target_exists_in_the_installed_megatron`` asserts each target
exists, so an upgrade that moves one fails closed instead of silently running unpatched.
"""

from __future__ import annotations

import importlib
import sys
import tempfile
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

SUPPORTED_MEGATRON = ("0.16.1",)


@dataclass(frozen=True)
class Patch:
    module: str
    symbol: str
    why: str
    value: Callable[[], object]  # what the symbol becomes
    may_be_absent: bool = False  # the symbol is only defined when an optional library is


def _cpu_cuda_namespace() -> types.SimpleNamespace:
    """What megatron's RNG module sees as ``torch.cuda``: the CPU default generator."""
    return types.SimpleNamespace(
        get_rng_state=lambda device=None: torch.get_rng_state(),
        set_rng_state=lambda state, device=None: torch.set_rng_state(state),
        manual_seed=torch.manual_seed,
        current_device=lambda: "cpu",
        device_count=lambda: 0,
        is_available=lambda: False,
        CUDAGraph=None,
        default_generators=(torch.default_generator,),
    )


class _TorchWithCpuCuda(types.ModuleType):
    """``torch`` for one megatron module, with ``torch.cuda`` replaced by the CPU namespace."""

    def __init__(self):
        super().__init__("torch")
        self.__dict__["cuda"] = _cpu_cuda_namespace()

    def __getattr__(self, name):
        return getattr(torch, name)


def _get_cpu_rng_state(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


_RANDOM = "megatron.core.tensor_parallel.random"

# Every megatron-core (and torch.cuda) symbol this plugin patches on a machine without a GPU.
# The exact lane itself needs only the RNG rows; current_device and te_general_gemm are for
# stock megatron modules in the same process (the benchmark's local-spec GPT and MoE).
PATCHES: tuple[Patch, ...] = (
    Patch(
        _RANDOM,
        "torch",
        "the RNG tracker calls torch.cuda.get_rng_state/manual_seed: give it the CPU generator",
        _TorchWithCpuCuda,
    ),
    Patch(
        _RANDOM,
        "_get_cuda_rng_state",
        "CudaRNGStatesTracker.fork reads the cuda generator: read the CPU one",
        lambda: _get_cpu_rng_state,
    ),
    Patch(
        _RANDOM,
        "_set_cuda_rng_state",
        "CudaRNGStatesTracker.fork and checkpoint set the cuda generator: set the CPU one",
        lambda: _set_cpu_rng_state,
    ),
    Patch(
        "torch.cuda",
        "current_device",
        "stock megatron allocates buffers on torch.cuda.current_device(): map it to 'cpu'",
        lambda: lambda: "cpu",
    ),
    Patch(
        "megatron.core.transformer.moe.moe_utils",
        "te_general_gemm",
        "without TransformerEngine the name is undefined and the stock router gemm reads it",
        lambda: None,
        may_be_absent=True,
    ),
)

_APPLIED = False


def has_gpu() -> bool:
    return torch.cuda.is_available()


def check_targets() -> None:
    """Fail closed if a patch target moved (a megatron-core other than the supported one)."""
    for patch in PATCHES:
        target = importlib.import_module(patch.module)
        if not patch.may_be_absent and not hasattr(target, patch.symbol):
            raise RuntimeError(f"patch target {patch.module}.{patch.symbol} is missing")


def ensure_cpu_megatron() -> bool:
    """Apply the CPU patches once when there is no GPU. Returns True if they are active."""
    global _APPLIED
    if has_gpu():
        return False
    if _APPLIED:
        return True
    import megatron.core

    version = getattr(megatron.core, "__version__", "?")
    if version not in SUPPORTED_MEGATRON:
        raise RuntimeError(
            f"lockstep_megatron's CPU patches target megatron-core {SUPPORTED_MEGATRON}, "
            f"found {version}; refusing to run unpatched"
        )
    check_targets()
    for patch in PATCHES:
        module = sys.modules.get(patch.module) or importlib.import_module(patch.module)
        setattr(module, patch.symbol, patch.value())
    _APPLIED = True
    return True


def init_single_process(seed: int = 0) -> None:
    """gloo, world size 1, TP = PP = 1; idempotent. Seeds Megatron's RNG tracker once
    (that call also seeds torch's default generator, as it does on GPU)."""
    ensure_cpu_megatron()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    if not torch.distributed.is_initialized():
        # A file store in a fresh temp dir: no port to collide with, nothing in os.environ.
        store = tempfile.mkdtemp(prefix="lockstep-gloo-")
        torch.distributed.init_process_group(
            backend="nccl" if has_gpu() else "gloo",
            init_method=f"file://{store}/store",
            world_size=1,
            rank=0,
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if not mrandom.get_cuda_rng_tracker().is_initialized():
        mrandom.model_parallel_cuda_manual_seed(seed)
