"""An adapter made by the ``peft`` library: real vLLM samples with it, real Megatron replays.

Dense: LoRA on q_proj and v_proj only (PEFT's common choice; the trainer adapts just those).
MoE: q_proj, v_proj and the routed experts, which PEFT (with transformers 5) adapts as the
fused 3-D expert parameters. The trace records the adapter hash computed on load, beside the
model hash; every decision's logprob bytes are equal, and one bf16 ulp in one factor is seen.
"""

from __future__ import annotations

import json

import pytest
from cross_support import capture, replay
from safetensors import safe_open
from safetensors.torch import save_file

from lockstep_exact.adapters import CONFIG, WEIGHTS, load_adapter
from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.k3 import compare
from lockstep_exact.model import ModelDir
from lockstep_exact.plugins import manager
from lockstep_exact.testing import nudge_ulp

pytest.importorskip("peft")
from peft_support import peft_adapter  # noqa: E402

pytestmark = pytest.mark.engine

TARGETS = {
    "qwen3": ["q_proj", "v_proj"],
    "qwen3-moe": ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
}


@pytest.fixture(scope="module")
def pm():
    return manager()


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def lane(request, pm, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"peft-{request.param}")
    model = make_tiny(root / "model", arch=request.param, seed=13)
    adapter = peft_adapter(
        model, root / "peft", seed=7, r=4, lora_alpha=8, target_modules=TARGETS[request.param]
    )
    trace = capture(pm, model, root / "trace", adapter=adapter)
    return root, model, adapter, trace


def one_ulp_copy(src, dst, key):
    """The PEFT adapter with one element of ``key`` (its largest) one bf16 ulp away."""
    dst.mkdir()
    (dst / CONFIG).write_text((src / CONFIG).read_text())
    with safe_open(str(src / WEIGHTS), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    t = tensors[key]
    tensors[key] = nudge_ulp(t, int(t.float().abs().argmax()))
    save_file(tensors, str(dst / WEIGHTS), metadata=meta)
    return dst


def test_the_trace_records_the_peft_adapter_hash_beside_the_model_hash(lane):
    _, model, adapter, trace = lane
    base = ModelDir(model)
    loaded = load_adapter(adapter, base)
    assert loaded.foreign and json.loads((adapter / CONFIG).read_text())["peft_type"] == "LORA"
    assert trace.adapter_hash == loaded.sha256
    assert trace.model_hash == base.model_hash


def test_megatron_replays_a_peft_adapter_byte_for_byte(pm, lane):
    root, model, adapter, trace = lane
    cmp = compare(trace.logprobs, replay(pm, model, root / "trace", adapter=adapter))
    assert cmp.exact and cmp.k3_max == 0.0, str(cmp)
    # control: the trainer on the adapter one bf16 ulp away (one v_proj lora_B element)
    key = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    nudged = one_ulp_copy(adapter, root / "one-ulp", key)
    assert load_adapter(nudged, ModelDir(model)).sha256 != trace.adapter_hash
    got = replay(pm, model, root / "trace", adapter=nudged, control=True)
    assert not compare(trace.logprobs, got).exact
