"""LoRA on the qwen3-next lane, in the composition: which projections an adapter covers,
that a zero adapter keeps every byte of the base model, that a one-ulp move of a factor is
seen, and what ``load_adapter`` refuses for this lane (by name)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from lockstep_exact.adapters import (
    AdapterError,
    load_adapter,
    make_adapter,
    module_shapes,
    write_adapter,
)
from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.lanes import qwen3_next as N
from lockstep_exact.model import ModelDir, geometry_contract
from lockstep_exact.parity import same_bytes
from lockstep_exact.testing import assert_same_bytes, perturb_adapter

TOKENS = torch.tensor([5, 17, 99, 3, 250, 41, 8, 77, 12, 600])


@pytest.fixture(scope="module")
def nxt(tmp_path_factory):
    root = tmp_path_factory.mktemp("next-lora")
    model = make_tiny(root / "m", arch="qwen3-next", seed=0)
    return {
        "dir": model,
        "base": ModelDir(model, hybrid=True),
        "weights": load_file(str(model / "model.safetensors")),
        "geom": N.Geometry.from_model_dir(model),
        "a": make_adapter(model, root / "a", rank=8),
        "zero": make_adapter(model, root / "zero", rank=8, zero_b=True),
        "root": root,
    }


def _run(nxt, adapter_dir=None):
    """(log-probabilities, the ops that ran them) of the reference forward."""
    geom = nxt["geom"]
    ops = N.default_ops(geom)
    mods = load_adapter(adapter_dir, nxt["base"]).modules if adapter_dir else None
    out = N.forward_logprobs(nxt["weights"], geom, TOKENS, ops=ops, adapters=mods)
    return out, ops


def test_the_adapter_covers_the_gdn_attention_and_expert_projections(nxt):
    geom = nxt["geom"]
    shapes = module_shapes(geom)
    kinds = {name.split(".", 3)[3] for name in shapes}
    mlps = [f"mlp.experts.{e}." for e in range(geom.experts)] + ["mlp.shared_expert."]
    assert kinds == {
        "linear_attn.in_proj_qkvz",
        "linear_attn.in_proj_ba",
        "linear_attn.out_proj",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        *(m + p for m in mlps for p in ("gate_proj", "up_proj", "down_proj")),
    }
    # Each shape is the base weight's: the adapter's update has the projection's shape.
    for name, (n_out, n_in) in shapes.items():
        assert tuple(nxt["weights"][name + ".weight"].shape) == (n_out, n_in), name
    ad = load_adapter(nxt["a"], nxt["base"])
    assert set(ad.modules) == {k + ".weight" for k in shapes}
    # grouped experts: rank r // topk for a routed expert, r for the shared one
    assert ad.modules["model.layers.0.mlp.experts.0.up_proj.weight"][0].shape[0] == 8 // geom.topk
    assert ad.modules["model.layers.0.mlp.shared_expert.up_proj.weight"][0].shape[0] == 8


def test_a_zero_adapter_gives_the_base_bytes_and_every_lora_site_runs(nxt):
    base, _ = _run(nxt)
    zero, ops = _run(nxt, nxt["zero"])
    assert_same_bytes(base, zero, "zero adapter vs base")
    # input control: the zero adapter with one GDN B factor element moved by 2^-9
    key = "base_model.model.model.layers.0.linear_attn.in_proj_qkvz.lora_B.weight"
    moved, _ = _run(nxt, perturb_adapter(nxt["zero"], nxt["root"] / "zero-moved", key))
    assert not same_bytes(base, moved), "the check misses a 2^-9 factor move"
    ran = set(ops.invoked_contract().sites)
    want = {k for k in geometry_contract(nxt["geom"]).sites if k.endswith(".lora_expand")}
    assert want and want <= ran  # every adapted projection ran its LoRA programs
    assert "layers.*.linear_attn.in_proj_qkvz.lora_shrink" in ran


def test_an_adapter_changes_the_bytes_and_a_one_ulp_factor_move_is_seen(nxt):
    base, _ = _run(nxt)
    a, _ = _run(nxt, nxt["a"])
    again, _ = _run(nxt, nxt["a"])
    assert_same_bytes(a, again, "adapter A twice")
    assert not same_bytes(a, base)
    key = "base_model.model.model.layers.0.linear_attn.in_proj_qkvz.lora_B.weight"
    nudged = perturb_adapter(nxt["a"], nxt["root"] / "nudged", key, delta=2.0**-9)
    moved, _ = _run(nxt, nudged)
    assert not same_bytes(a, moved)


def test_the_lane_without_an_adapter_runs_no_lora_site(nxt):
    _, ops = _run(nxt)
    assert not any(".lora_" in k for k in ops.invoked_contract().sites)


# --- refusals ----------------------------------------------------------------------------------
def test_an_adapter_of_another_contract_is_refused(nxt):
    bad = make_adapter(nxt["dir"], nxt["root"] / "other", rank=8, contract="sha256:" + "3" * 64)
    fp = nxt["base"].contract().fingerprint
    with pytest.raises(AdapterError, match=r"adapter was made for contract sha256:3{64}, this"):
        load_adapter(bad, nxt["base"], contract=fp)
    load_adapter(nxt["a"], nxt["base"], contract=fp)  # its own contract passes


def test_a_corrupted_adapter_is_refused(nxt, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(nxt["a"], bad)
    data = bytearray((bad / "adapter_model.safetensors").read_bytes())
    data[-3] ^= 0x01  # one bit of the last factor
    (bad / "adapter_model.safetensors").write_bytes(bytes(data))
    with pytest.raises(AdapterError, match=r"does not match its recorded adapter sha256"):
        load_adapter(bad, nxt["base"])


def test_a_dense_lane_adapter_is_refused_on_the_hybrid_lane(nxt, tmp_path):
    dense = make_tiny(tmp_path / "dense", arch="qwen3", seed=0)
    ad = make_adapter(dense, tmp_path / "dense-a", rank=8)
    with pytest.raises(AdapterError, match=r"adapter was made for contract sha256:"):
        load_adapter(ad, nxt["base"], contract=nxt["base"].contract().fingerprint)


@pytest.mark.parametrize(
    ("module", "shape"),
    [
        ("linear_attn.conv1d", (96, 4)),
        ("mlp.shared_expert_gate", (1, 64)),
        ("self_attn.q_norm", (16, 16)),
    ],
)
def test_a_module_the_lane_does_not_adapt_is_refused_by_name(nxt, tmp_path, module, shape):
    geom = nxt["geom"]
    name = f"base_model.model.model.layers.0.{module}"
    tensors = {
        f"{name}.lora_A.weight": torch.zeros(4, shape[1], dtype=torch.bfloat16),
        f"{name}.lora_B.weight": torch.zeros(shape[0], 4, dtype=torch.bfloat16),
    }
    out = write_adapter(tmp_path / "x", tensors, rank=4, alpha=8.0, contract="c", geom=geom)
    with pytest.raises(
        AdapterError, match=rf"adapter targets model\.layers\.0\.{module}, which the exact lane"
    ):
        load_adapter(out, geom)


def test_an_attention_adapter_on_a_gdn_layer_is_refused_by_name(nxt, tmp_path):
    geom = nxt["geom"]
    gdn = geom.layer_types.index(N.LINEAR)
    name = f"base_model.model.model.layers.{gdn}.self_attn.v_proj"
    tensors = {
        f"{name}.lora_A.weight": torch.zeros(4, geom.hidden, dtype=torch.bfloat16),
        f"{name}.lora_B.weight": torch.zeros(16, 4, dtype=torch.bfloat16),
    }
    out = write_adapter(tmp_path / "x", tensors, rank=4, alpha=8.0, contract="c", geom=geom)
    with pytest.raises(AdapterError, match=rf"adapter targets model\.layers\.{gdn}\.self_attn"):
        load_adapter(out, geom)


def test_the_contract_has_lora_sites_for_the_adapted_projections_only(nxt):
    sites = geometry_contract(nxt["geom"]).sites
    lora = {k.rsplit(".", 1)[0] for k in sites if k.endswith((".lora_shrink", ".lora_expand"))}
    assert lora == {k for k in sites if k.endswith(N.ADAPTED)}
    assert "layers.*.mlp.gate.lora_shrink" not in sites
    assert "layers.*.mlp.shared_expert_gate.lora_shrink" not in sites
    assert json.dumps(sorted(lora))  # the site names are plain strings


def test_a_peft_adapter_is_read_as_hf_peft_applies_it(nxt):
    """An adapter made by ``peft`` on HF's Qwen3Next (GDN projections, attention, the fused
    experts as 3-D parameters) runs in the composition as HF + PEFT run it in fp32: per row
    within bf16 error (the median; a router flip under bf16 may move a few rows), far below
    what the adapter itself moves."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from peft_support import peft_adapter

    targets = ["in_proj_qkvz", "in_proj_ba", "out_proj", "q_proj", "k_proj", "v_proj"]
    targets += ["o_proj", "gate_proj", "up_proj", "down_proj"]
    ad = peft_adapter(
        nxt["dir"], nxt["root"] / "peft", seed=7, std=0.2, r=4, lora_alpha=8, target_modules=targets
    )
    loaded = load_adapter(ad, nxt["base"])
    assert loaded.foreign
    assert any(".mlp.experts.3.down_proj" in k for k in loaded.modules)  # unfused
    hf = transformers.AutoModelForCausalLM.from_pretrained(nxt["dir"], dtype=torch.float32)
    toks = torch.randint(3, 1000, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf_base = torch.log_softmax(hf(toks[None]).logits[0].double(), -1)
        wrapped = peft.PeftModel.from_pretrained(hf, str(ad)).float()
        hf_a = torch.log_softmax(wrapped(toks[None]).logits[0].double(), -1)
    ours = N.forward_logprobs(nxt["weights"], nxt["geom"], toks, adapters=loaded.modules)

    def err(a, b):
        return (a.double() - b).abs().amax(-1).median().item()

    # Measured: 0.08 nat (the lane without adapter vs HF: 0.07); the adapter moves 9.4.
    assert err(ours, hf_a) < 0.25
    assert err(hf_a, hf_base) > 20 * err(ours, hf_a)
