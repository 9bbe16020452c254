"""The patch table names every vLLM symbol the plugin touches, and each exists as expected."""

from __future__ import annotations

import pytest

from lockstep_serving import patches


def test_every_patch_table_target_exists_with_its_expected_signature():
    assert patches.problems() == []


def test_a_missing_target_is_reported_by_name():
    gone = patches.Target("vllm.v1.sample.sampler", "Sampler.no_such_method", "patch", "test")
    (problem,) = patches.problems((gone,))
    assert "Sampler.no_such_method" in problem and "missing" in problem


def test_a_changed_signature_is_reported():
    moved = patches.Target(
        "vllm.v1.sample.sampler", "Sampler.compute_logprobs", "patch", "test", params=("x",)
    )
    (problem,) = patches.problems((moved,))
    assert "do not start with ('x',)" in problem


def test_an_unsupported_vllm_version_is_reported():
    old = patches.Target("vllm.v1.sample.sampler", "Sampler", "read", "test", versions=("0.1",))
    (problem,) = patches.problems((old,))
    assert "not among the supported" in problem


def test_check_fails_closed_naming_the_missing_target(monkeypatch):
    gone = patches.Target("vllm.nowhere", "Nothing", "read", "test")
    monkeypatch.setattr(patches, "TABLE", patches.TABLE + (gone,))
    with pytest.raises(patches.LaneRefused, match=r"vllm\.nowhere\.Nothing"):
        patches.check()


def test_the_plugin_patches_only_what_the_table_lists():
    from vllm.v1.sample.sampler import Sampler

    from lockstep_serving import vllm_plugin

    vllm_plugin.register()
    patched = {(t.module, t.symbol) for t in patches.TABLE if t.kind == "patch"}
    assert {
        ("vllm.v1.sample.sampler", "Sampler.compute_logprobs"),
        ("vllm.v1.worker.lora_model_runner_mixin", "LoRAModelRunnerMixin.load_lora_model"),
    } <= patched
    for t in patches.TABLE:  # every patch row is in effect after register()
        if t.kind == "patch":
            assert t.resolve() is not patches.TABLE.original(t.name), t.name
    assert Sampler.compute_logprobs is vllm_plugin.exact_compute_logprobs


def test_the_vllm_table_is_the_shared_type_and_restores_what_it_patched():
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    from lockstep_exact.patching import PatchTable
    from lockstep_serving import lora, vllm_plugin

    assert isinstance(patches.TABLE, PatchTable)
    vllm_plugin.register()
    stock = patches.TABLE.original("Sampler.compute_logprobs")
    try:
        patches.TABLE.restore()
        assert Sampler.compute_logprobs is stock
        assert LoRAModelRunnerMixin.load_lora_model is not lora.load_lora_model
    finally:
        patches.TABLE.apply()
    assert Sampler.compute_logprobs is vllm_plugin.exact_compute_logprobs
    assert LoRAModelRunnerMixin.load_lora_model is lora.load_lora_model
    assert patches.TABLE.original("Sampler.compute_logprobs") is stock
