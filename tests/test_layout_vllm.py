"""Layout invariance with the real engines: vLLM at tensor-parallel size 2 (worker processes
over gloo, each rank holding its shard) samples the bytes that Megatron at size 1 replays, and
the bytes vLLM samples at size 1. One contract serves both layouts: the layout enters it only
through each row-parallel site's K partition count.
"""

from __future__ import annotations

import pytest
import torch
from cross_support import capture, forge, nudged_copy, replay

from lockstep_exact.adapters import make_adapter
from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.k3 import compare
from lockstep_exact.model import model_hash as dir_hash
from lockstep_exact.plugins import manager
from lockstep_exact.testing import perturb_adapter

O_PROJ_B = "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"

pytestmark = [pytest.mark.engine, pytest.mark.slow]


@pytest.fixture(scope="module")
def pm():
    return manager()


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def tp2(request, pm, tmp_path_factory):
    """A vLLM tp=2 capture (dense with a LoRA adapter: column sites take B by rows, row sites
    gather their input; MoE: every expert split by the tp ranks)."""
    root = tmp_path_factory.mktemp(f"tp2-{request.param}")
    model = make_tiny(root / "model", arch=request.param, seed=11)
    adapter = make_adapter(model, root / "A", seed=5) if request.param == "qwen3" else None
    trace = capture(pm, model, root / "tp2-trace", adapter=adapter, tp=2)
    return root, model, adapter, trace


def test_megatron_at_tp1_replays_vllm_at_tp2_byte_for_byte(pm, tp2):
    root, model, adapter, trace = tp2
    assert trace.engine["tp"] == 2 and trace.num_decisions == 64
    cmp = compare(trace.logprobs, replay(pm, model, root / "tp2-trace", adapter=adapter))
    assert cmp.exact and cmp.k3_max == 0.0, str(cmp)


def test_vllm_samples_the_same_bytes_at_tp1_and_tp2(pm, tp2):
    root, model, adapter, trace = tp2
    one = capture(pm, model, root / "tp1-trace", adapter=adapter)
    assert one.engine["tp"] == 1
    assert torch.equal(one.sampled_tokens, trace.sampled_tokens)
    assert compare(one.logprobs, trace.logprobs).exact
    assert one.contract_fingerprint == trace.contract_fingerprint  # one contract, two layouts
    # control: vLLM at tp 1 with one input moved parts from tp 2: with the adapter, one of its
    # factors by 2^-9 (a model copy would change the base model the adapter is bound to, and
    # be refused); without, a copy with one norm weight one bf16 ulp off
    if adapter is not None:
        moved_adapter = perturb_adapter(adapter, root / "A-moved", O_PROJ_B)
        moved = capture(pm, model, root / "tp1-moved-trace", adapter=moved_adapter)
    else:
        copy = nudged_copy(model, root / "nudged-tp1", "model.norm.weight")
        moved = capture(pm, copy, root / "tp1-nudged-trace")
    assert not compare(moved.logprobs, trace.logprobs).exact


def test_control_one_ulp_on_the_trainer_side_parts_from_the_tp2_bytes(pm, tp2):
    """Dense: the trainer on the adapter with one factor 2^-9 away; MoE: the trainer on a
    model copy with one weight one ulp away (the trace admitted as if sampled from it)."""
    root, model, adapter, trace = tp2
    if adapter is not None:
        from lockstep_exact.testing import perturb_adapter

        key = "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"
        pert = perturb_adapter(adapter, root / "A-pert", key)
        lps = replay(pm, model, root / "tp2-trace", adapter=pert, control=True)
    else:
        copy = nudged_copy(model, root / "nudged", "model.norm.weight")
        forged = forge(trace, root / "forged", keep_rule=False, model_hash=dir_hash(copy))
        lps = replay(pm, copy, forged, control=True)
    cmp = compare(trace.logprobs, lps)
    assert not cmp.exact and cmp.k3_max > 0.0


def test_a_tp_that_does_not_divide_the_partitions_is_refused_before_any_worker(pm, tmp_path):
    from lockstep_serving.vllm.patches import LaneRefused

    model = make_tiny(tmp_path / "m", arch="qwen3", seed=1)
    with pytest.raises(LaneRefused, match="refused --tp 3: layout: tp 3 does not divide the 8 K"):
        capture(pm, model, tmp_path / "t", tp=3)
    assert not (tmp_path / "t").exists()
