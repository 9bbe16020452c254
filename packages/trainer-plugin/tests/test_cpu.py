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


def test_the_cpu_table_is_the_shared_patch_table_type():
    from lockstep_exact.patching import PatchTable

    assert isinstance(cpu.PATCHES, PatchTable)
    assert {t.kind for t in cpu.PATCHES} == {"patch"}


def test_restore_takes_the_cpu_patches_back_and_they_apply_again():
    cpu.ensure_cpu_megatron()
    original = cpu.PATCHES.original("torch.cuda.current_device")
    from megatron.core.tensor_parallel import random as mrandom

    try:
        cpu.restore_cpu_megatron()
        assert torch.cuda.current_device is original
        assert mrandom.torch is torch  # the module-level name is the real torch again
    finally:
        assert cpu.ensure_cpu_megatron() is True
    assert torch.cuda.current_device() == "cpu" and mrandom.torch is not torch


def test_an_unsupported_megatron_is_refused_naming_the_version():
    import pytest

    from lockstep_exact.patching import PatchTable

    t = cpu.PATCHES
    other = PatchTable(
        t.engine, t.version_module, ("0.0.1",), t.targets, error=t.error, refusal=t.refusal
    )
    with pytest.raises(RuntimeError) as err:
        other.apply()
    message = str(err.value)
    assert message.startswith(
        "lockstep_megatron's CPU patches do not fit this megatron-core (refusing to run "
        "unpatched): megatron.core.tensor_parallel.random.torch (patch: "
    )
    assert "megatron-core 0.16.1 is not among the supported ('0.0.1',)" in message
    assert not other.applied


def test_a_moved_megatron_target_is_refused_naming_it():
    import pytest

    from lockstep_exact.patching import Target

    gone = Target("megatron.core.parallel_state", "no_such_fn", "patch", "test", replacement=int)
    with pytest.raises(RuntimeError, match=r"megatron\.core\.parallel_state\.no_such_fn .*missing"):
        (cpu.PATCHES + (gone,)).check()
