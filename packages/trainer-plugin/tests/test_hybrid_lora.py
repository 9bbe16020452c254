"""LoRA on the hybrid lane (Qwen3-Next) in Megatron: the adapter sits on megatron-core's
GatedDeltaNet in_proj / out_proj, the gated attention's linear_qkv / linear_proj and the
experts' and shared expert's fc1 / fc2, and the composition runs it (``gdn.NextSlots.lora``).

The claim: replay with adapter A of a trace whose logprobs are the composition's with A is
byte-exact (sequences across the 64-token GDN chunk and not); the same replay on A with one
factor moved by 2^-9 is not; a zero adapter keeps the base model's bytes; an adapter of
another contract is refused by name. The vLLM capture of an adapter trace replayed here is
``tests/test_next_lora.py``.
"""

from __future__ import annotations

import pytest
import torch
from trainer_support import next_composition_trace

from lockstep_exact.adapters import AdapterError, load_adapter, make_adapter
from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.k3 import compare
from lockstep_exact.model import ModelDir
from lockstep_exact.parity import same_bytes
from lockstep_exact.testing import assert_same_bytes, perturb_adapter
from lockstep_exact.trace import Trace
from lockstep_megatron import adapters as AD
from lockstep_megatron import export
from lockstep_megatron.convert import build
from lockstep_megatron.replay import replay

PLAN = ((70, 4), (5, 62), (3, 5))  # (prompt, sampled): across the 64-token chunk and not


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("next-lora")
    model = make_tiny(root / "m", arch="qwen3-next")
    return {
        "root": root,
        "model": model,
        "a": make_adapter(model, root / "a", rank=8, seed=3),
        "zero": make_adapter(model, root / "zero", rank=8, zero_b=True),
    }


def adapter_trace(model_dir, adapter_dir, out):
    """A trace of ``PLAN`` whose logprobs are the composition's with the adapter."""
    return next_composition_trace(model_dir, out, PLAN, adapter_dir)


def test_the_adapter_sits_on_every_projection_the_lane_adapts(setup):
    model = build(setup["model"]).eval()
    export.load_into(model, setup["a"], ModelDir(setup["model"], hybrid=True))
    sites = {s.hf_module: s for s in AD.sites(model)}
    assert set(sites) == {k.removesuffix(".weight") for k in load_adapter(
        setup["a"], ModelDir(setup["model"], hybrid=True)).modules}  # fmt: skip
    gdn = sites["model.layers.0.linear_attn.in_proj_qkvz"]
    assert gdn.linear is model.gpt.decoder.layers[0].self_attention.in_proj
    assert set(gdn.linear.lora) == {"in_proj_qkvz", "in_proj_ba"}
    assert sites["model.layers.1.self_attn.q_proj"].part == "q_proj"
    assert sites["model.layers.0.mlp.shared_expert.down_proj"].part == "down_proj"


def test_megatron_replay_with_an_adapter_is_exact_and_sees_a_2_to_the_minus_9_move(setup):
    root = setup["root"]
    out = adapter_trace(setup["model"], setup["a"], root / "t")
    trace = Trace.load(out)
    lps, _ = replay(setup["model"], out, adapter_dir=setup["a"], micro_batch=2)
    cmp = compare(trace.logprobs, lps)
    assert cmp.n == trace.num_decisions == sum(n for _, n in PLAN)
    assert cmp.byte_equal == cmp.n and cmp.k3_max == 0.0
    key = "base_model.model.model.layers.0.linear_attn.in_proj_qkvz.lora_B.weight"
    moved = perturb_adapter(setup["a"], root / "moved", key)
    lps, _ = replay(setup["model"], out, adapter_dir=moved, micro_batch=2, control=True)
    assert compare(trace.logprobs, lps).byte_equal < trace.num_decisions


def test_a_zero_adapter_keeps_the_base_bytes_in_megatron(setup):
    model = build(setup["model"]).eval()
    tokens = torch.randint(0, 1000, (2, 70), generator=torch.Generator().manual_seed(1))
    base = model(tokens)
    export.load_into(model, setup["zero"], ModelDir(setup["model"], hybrid=True))
    model.requires_grad_(False)
    ran = model(tokens)
    assert_same_bytes(base, ran, "zero adapter vs base")
    assert any(".lora_expand" in k for k in model.invoked_contract().sites)
    # input control: the loaded zero adapter's GDN in_proj_qkvz B element 0 moved by 2^-9
    (site,) = [
        s for s in AD.sites(model) if s.hf_module == "model.layers.0.linear_attn.in_proj_qkvz"
    ]
    with torch.no_grad():
        site.linear.lora[site.part].B.view(-1)[0] += 2.0**-9
    assert not same_bytes(base, model(tokens))


def test_an_adapter_of_another_contract_is_refused_by_the_trainer(setup, tmp_path):
    from lockstep_megatron import plugin

    bad = make_adapter(setup["model"], tmp_path / "bad", rank=8, contract="sha256:" + "3" * 64)
    with pytest.raises(AdapterError, match=r"adapter was made for contract sha256:3{64}"):
        plugin.lockstep_trainer_contract(setup["model"], bad, "cpu")
    contract = plugin.lockstep_trainer_contract(setup["model"], setup["a"], "cpu")
    assert contract.lane == "qwen3-next/bf16/cpu"
