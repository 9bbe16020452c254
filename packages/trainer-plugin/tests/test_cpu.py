"""The CPU patch table: every target exists in the installed megatron-core; applying is safe."""

from __future__ import annotations

import importlib

import torch

from lockstep_megatron import cpu


def test_every_patch_target_exists_in_the_installed_megatron():
    import megatron.core

    assert megatron.core.__version__ in cpu.SUPPORTED_MEGATRON
    cpu.check_targets()
    for patch in cpu.PATCHES:
        module = importlib.import_module(patch.module)
        assert patch.may_be_absent or hasattr(module, patch.symbol), patch
        assert patch.why


def test_patches_are_in_effect_after_ensure():
    cpu.ensure_cpu_megatron()
    from megatron.core.transformer.moe import moe_utils

    assert torch.cuda.current_device() == "cpu"
    assert moe_utils.te_general_gemm is None


def test_patches_apply_only_without_a_gpu_and_are_idempotent():
    assert not torch.cuda.is_available()
    assert cpu.ensure_cpu_megatron() is True
    assert cpu.ensure_cpu_megatron() is True
    cpu.init_single_process()
    cpu.init_single_process()
    from megatron.core import parallel_state

    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    assert torch.distributed.get_backend() == "gloo"


def test_megatron_rng_tracker_forks_the_cpu_generator():
    cpu.init_single_process()
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        inside = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # the fork restored the default state
    with get_cuda_rng_tracker().fork():
        again = torch.rand(4)
    assert not torch.equal(inside, again)  # the tracked stream advanced
