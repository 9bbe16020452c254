"""LoRA on the hybrid lane (Qwen3-Next) across the two halves: real vLLM samples with adapter
A (``LoRARequest`` through ``LaneLoRAManager``), real Megatron (megatron-core's GatedDeltaNet,
gated attention and MoE with A in the composition's slots) replays, every decision's logprob
byte-equal; the replay on A with one factor of the GDN in_proj moved by 2^-9 is not.

A short plan keeps it small: 3 prompts of the default set, 4 decisions each, the trainer in
micro-batches of 2.
"""

from __future__ import annotations

import pytest
from cross_support import replay

from lockstep_exact.adapters import make_adapter
from lockstep_exact.app.tiny import default_prompts, make_tiny
from lockstep_exact.k3 import compare
from lockstep_exact.plugins import manager
from lockstep_exact.requests import CaptureRequest
from lockstep_exact.testing import perturb_adapter
from lockstep_exact.trace import Trace

pytestmark = pytest.mark.engine


def test_megatron_replays_vllm_lora_decisions_on_the_hybrid_lane_byte_for_byte(tmp_path):
    pm = manager()
    model = make_tiny(tmp_path / "model", arch="qwen3-next", seed=11)
    ad = make_adapter(model, tmp_path / "A", rank=8, seed=5)
    pm.hook.lockstep_capture(
        request=CaptureRequest(
            model_dir=model,
            prompts=tuple(default_prompts(3)),
            decisions=4,
            out_dir=tmp_path / "A-trace",
            seed=3,
            adapter_dir=ad,
        )
    )
    trace = Trace.load(tmp_path / "A-trace")
    assert trace.adapter_hash is not None and trace.num_decisions == 3 * 4
    assert any(".lora_shrink" in k for k in trace.contract["sites"])
    cmp = compare(trace.logprobs, replay(pm, model, tmp_path / "A-trace", ad, micro_batch=2))
    assert cmp.exact and cmp.k3_max == 0.0, str(cmp)
    # control: the trainer on an adapter one GDN factor 2^-9 away sees different bytes
    key = "base_model.model.model.layers.0.linear_attn.in_proj_qkvz.lora_B.weight"
    pert = perturb_adapter(ad, tmp_path / "A-pert", key)
    moved = replay(pm, model, tmp_path / "A-trace", pert, control=True, micro_batch=2)
    assert not compare(trace.logprobs, moved).exact
