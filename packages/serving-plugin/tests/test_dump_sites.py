"""lockstep bisect, sampler half: engine op-site outputs equal the reference, site by site."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from lockstep_exact.lanes import qwen3
from lockstep_exact.plugins import manager
from lockstep_exact.requests import DumpRequest
from lockstep_exact.sites import recording
from lockstep_exact.testing import assert_same_bytes

pytestmark = pytest.mark.engine  # starts real vLLM engines

TOKENS = (5, 300, 17, 42, 999, 64, 128, 7, 260, 3, 511, 90, 33, 700, 21, 8, 44, 101, 6, 250)


@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe"])
def test_every_op_site_of_the_engine_equals_the_reference_forward(tiny_models, family):
    import lockstep_serving.vllm.hooks

    model_dir = tiny_models[family]
    pm = manager(load_entry_points=False)
    pm.register(lockstep_serving.vllm.hooks)
    position = 17
    request = DumpRequest(role="sampler", model_dir=model_dir, tokens=TOKENS, position=position)
    engine = pm.hook.lockstep_dump_sites(request=request)
    weights = load_file(str(model_dir / "model.safetensors"))
    geom = qwen3.Geometry.from_model_dir(model_dir)
    with recording() as reference:
        qwen3.forward_logprobs(weights, geom, torch.tensor(TOKENS[: position + 1]))
    assert sorted(engine) == sorted(reference)
    assert "layers.1.self_attn.core" in engine and "logprobs" in engine
    for site, want in reference.items():
        assert_same_bytes(want, engine[site], site)
    assert pm.hook.lockstep_dump_sites(request=DumpRequest("trainer", model_dir, TOKENS, 3)) is None
