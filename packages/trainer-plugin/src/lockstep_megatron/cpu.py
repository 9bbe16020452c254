"""CPU support for megatron-core 0.16.1: every patch in one table, applied only without a GPU.

megatron-core assumes CUDA in a few places the exact lane reaches (RNG tracker, buffer
devices). On a machine without a GPU, ``ensure_cpu_megatron()`` applies the patches in
``PATCHES`` (idempotent) and ``init_single_process()`` starts gloo with world size 1 and
``parallel_state.initialize_model_parallel(1, 1)``. With a GPU present nothing is patched.
``PATCHES`` is a ``lockstep_exact.patching.PatchTable`` (the type the serving plugin's vLLM
table uses too): applying it first checks the megatron-core version and that every target
exists, so an upgrade that moves one fails closed instead of silently running unpatched;
``restore_cpu_megatron()`` takes the patches back.
"""

from __future__ import annotations

import tempfile
import types

import torch

from lockstep_exact.patching import PatchTable, Target

SUPPORTED_MEGATRON = ("0.16.1",)


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
PATCHES = PatchTable(
    "megatron-core",
    "megatron.core",
    SUPPORTED_MEGATRON,
    (
        Target(
            _RANDOM,
            "torch",
            "patch",
            "the RNG tracker calls torch.cuda.get_rng_state/manual_seed: give it the CPU generator",
            replacement=_TorchWithCpuCuda,
        ),
        Target(
            _RANDOM,
            "_get_cuda_rng_state",
            "patch",
            "CudaRNGStatesTracker.fork reads the cuda generator: read the CPU one",
            replacement=lambda: _get_cpu_rng_state,
        ),
        Target(
            _RANDOM,
            "_set_cuda_rng_state",
            "patch",
            "CudaRNGStatesTracker.fork and checkpoint set the cuda generator: set the CPU one",
            replacement=lambda: _set_cpu_rng_state,
        ),
        Target(
            "torch.cuda",
            "current_device",
            "patch",
            "stock megatron allocates buffers on torch.cuda.current_device(): map it to 'cpu'",
            replacement=lambda: lambda: "cpu",
        ),
        Target(
            "megatron.core.transformer.moe.moe_utils",
            "te_general_gemm",
            "patch",
            "without TransformerEngine the name is undefined and the stock router gemm reads it",
            replacement=lambda: None,
            may_be_absent=True,
        ),
    ),
    error=RuntimeError,
    refusal="lockstep_megatron's CPU patches do not fit this megatron-core (refusing to run "
    "unpatched)",
    source="lockstep_megatron/cpu.py",
)


def has_gpu() -> bool:
    return torch.cuda.is_available()


def check_targets() -> None:
    """Fail closed (RuntimeError naming each) if a patch target moved or megatron-core is not
    the supported version."""
    PATCHES.check()


def ensure_cpu_megatron() -> bool:
    """Apply the CPU patches once when there is no GPU. Returns True if they are active."""
    if has_gpu():
        return False
    PATCHES.apply()  # checks first; idempotent
    return True


def restore_cpu_megatron() -> None:
    """Take the CPU patches back (tests; a process that goes on without the lane)."""
    PATCHES.restore()


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
