"""PEFT adapters: the zero adapter is the base model's bytes; adapters made by peft load and are
hashed on load; bad adapters, and adapters of another base model, are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from peft_support import peft_adapter, peft_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lockstep_exact.adapters import (
    CONFIG,
    WEIGHTS,
    AdapterError,
    adapter_sha256,
    load_adapter,
    make_adapter,
)
from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.lanes import qwen3
from lockstep_exact.model import ModelDir, lane_contract
from lockstep_exact.parity import same_bytes
from lockstep_exact.testing import assert_same_bytes, perturb_adapter


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    d = make_tiny(tmp_path_factory.mktemp("moe"), arch="qwen3-moe", seed=5)
    return d, qwen3.Geometry.from_model_dir(d), load_file(str(d / "model.safetensors"))


def run(model, adapter_dir=None):
    _, geom, w = model
    toks = torch.arange(3, 40) * 7 % geom.vocab
    ad = load_adapter(adapter_dir, geom).modules if adapter_dir else None
    return qwen3.forward_logprobs(w, geom, toks, adapters=ad)


def test_zero_adapter_gives_the_base_bytes_and_a_2e_9_nudge_does_not(moe, tmp_path):
    base = run(moe)
    zero = make_adapter(moe[0], tmp_path / "zero", zero_b=True)
    assert_same_bytes(run(moe, zero), base, "zero adapter vs base")
    key = "base_model.model.model.layers.1.mlp.experts.3.down_proj.lora_B.weight"
    nudged = perturb_adapter(zero, tmp_path / "nudged", key)
    assert not same_bytes(run(moe, nudged), base)


def test_expert_factors_have_rank_r_over_topk(moe, tmp_path):
    ad = load_adapter(make_adapter(moe[0], tmp_path / "a", rank=8), moe[1])
    a, b, scale = ad.modules["model.layers.0.mlp.experts.5.up_proj.weight"]
    assert a.shape[0] == 4 and b.shape[1] == 4 and scale == 16.0 / 4
    a, b, scale = ad.modules["model.layers.0.self_attn.q_proj.weight"]
    assert a.shape[0] == 8 and scale == 2.0


def test_adapter_bytes_are_reproducible_for_a_seed(moe, tmp_path):
    one = load_adapter(make_adapter(moe[0], tmp_path / "1", seed=9), moe[1])
    two = load_adapter(make_adapter(moe[0], tmp_path / "2", seed=9), moe[1])
    assert one.sha256 == two.sha256


def _rewrite(src, dst, fn):
    dst.mkdir()
    (dst / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    with safe_open(str(src / WEIGHTS), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    tensors, meta = fn(tensors, meta)
    save_file(tensors, str(dst / WEIGHTS), metadata=meta)
    return dst


def test_fp32_adapter_is_refused_by_name(moe, tmp_path):
    good = make_adapter(moe[0], tmp_path / "good")
    bad = _rewrite(good, tmp_path / "fp32", lambda t, m: ({k: v.float() for k, v in t.items()}, m))
    with pytest.raises(AdapterError, match="is torch.float32; the exact lane takes bf16 only"):
        load_adapter(bad, moe[1])


def test_corrupted_adapter_is_refused(moe, tmp_path):
    good = make_adapter(moe[0], tmp_path / "good")
    raw = bytearray((good / WEIGHTS).read_bytes())
    raw[-3] ^= 0x01
    (good / WEIGHTS).write_bytes(bytes(raw))
    with pytest.raises(AdapterError, match="corrupted"):
        load_adapter(good, moe[1])
    (good / WEIGHTS).write_bytes(bytes(raw[: len(raw) // 2]))
    with pytest.raises(AdapterError, match="corrupted or truncated"):
        load_adapter(good, moe[1])


def test_adapter_for_another_contract_is_refused(moe, tmp_path):
    ad = make_adapter(moe[0], tmp_path / "a", contract="sha256:" + "1" * 64)
    with pytest.raises(AdapterError, match="made for contract"):
        load_adapter(ad, moe[1], contract=lane_contract(moe[0]).fingerprint)


def test_adapter_on_an_uncovered_module_is_refused(moe, tmp_path):
    good = make_adapter(moe[0], tmp_path / "good")

    def add_lm_head(t, m):
        t = dict(t)
        t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 128, dtype=torch.bfloat16)
        t["base_model.model.lm_head.lora_B.weight"] = torch.zeros(1024, 8, dtype=torch.bfloat16)
        return t, {}  # as a foreign adapter would come: no Lockstep record

    bad = _rewrite(good, tmp_path / "lm_head", add_lm_head)
    with pytest.raises(AdapterError, match="targets lm_head, which the exact lane does not cover"):
        load_adapter(bad, moe[1])


def test_dora_and_missing_files_are_refused(moe, tmp_path):
    good = make_adapter(moe[0], tmp_path / "good")
    cfg = json.loads((good / "adapter_config.json").read_text())
    (good / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora = True: DoRA is not part of the exact lane"):
        load_adapter(good, moe[1])
    with pytest.raises(AdapterError, match="not a PEFT adapter"):
        load_adapter(tmp_path, moe[1])


# --- adapters made by peft; hashes; bindings ---------------------------------------------------


EXPERTS = ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    d = make_tiny(tmp_path_factory.mktemp("dense"), arch="qwen3", hidden=64, vocab=300, seed=3)
    return d, qwen3.Geometry.from_model_dir(d), load_file(str(d / "model.safetensors"))


def test_a_peft_adapter_on_a_subset_loads_with_its_hash(dense, tmp_path):
    ad = peft_adapter(
        dense[0], tmp_path / "p", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]
    )
    got = load_adapter(ad, ModelDir(dense[0]))
    assert got.foreign and got.contract is None
    assert sorted(got.modules) == [
        f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(2) for p in "qv"
    ]
    a, b, scale = got.modules["model.layers.1.self_attn.v_proj.weight"]
    assert a.shape == (4, 64) and b.shape == (32, 4) and scale == 2.0
    with safe_open(str(ad / WEIGHTS), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    config = json.loads((ad / CONFIG).read_text())
    assert got.sha256 == adapter_sha256(tensors, config)
    for field, value in (("lora_alpha", 16), ("r", 8), ("target_modules", ["q_proj"])):
        assert adapter_sha256(tensors, {**config, field: value}) != got.sha256, field
    assert not same_bytes(run(dense), run(dense, ad))


def test_peft_fused_expert_factors_split_into_peft_own_delta(moe, tmp_path):
    """Per expert, the split factors' product is PEFT's own delta weight, bit for bit: bf16
    factors of rank <= 8 multiply and sum exactly in float64 (the scales are powers of 2)."""
    lora = dict(r=4, lora_alpha=8, target_modules=EXPERTS)
    model = peft_model(moe[0], seed=1, **lora)
    model.save_pretrained(str(tmp_path / "p"))
    got = load_adapter(tmp_path / "p", moe[1])
    model = model.double()
    wrappers = {
        m.parameter_name: m
        for n, m in model.named_modules()
        if n.startswith("base_model.model.model.layers.1.mlp.experts")
        and hasattr(m, "parameter_name")
    }
    assert set(wrappers) == {"gate_up_proj", "down_proj"}
    for param, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        delta = wrappers[param].get_delta_weight("default")  # [E, out, in], float64
        assert delta.dtype == torch.float64
        for e in range(moe[1].experts):
            mine = []
            for part in parts:
                a, b, scale = got.modules[f"model.layers.1.mlp.experts.{e}.{part}.weight"]
                mine.append((b.double() @ a.double()) * scale)
            assert torch.equal(torch.cat(mine), delta[e]), (param, e)
        assert not torch.equal(torch.cat(mine), delta[0])  # control: another expert's delta


def test_a_peft_adapter_means_in_the_lane_what_it_means_in_transformers(moe, tmp_path):
    """Not a parity check (transformers runs other arithmetic, in fp32): the adapter's effect
    on the logprobs agrees with HF + PEFT's to bf16 noise, and a wrong expert order does not."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ad = peft_adapter(
        moe[0],
        tmp_path / "p",
        seed=3,
        std=0.2,
        r=4,
        lora_alpha=8,
        target_modules=["o_proj", *EXPERTS],
    )
    got = load_adapter(ad, moe[1])
    _, geom, w = moe
    toks = torch.arange(3, 30) * 7 % geom.vocab
    hf = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(moe[0]), dtype=torch.float32), str(ad)
    ).eval()
    with torch.no_grad():
        hf_on = torch.log_softmax(hf(toks[None]).logits[0], -1)
        with hf.disable_adapter():
            hf_off = torch.log_softmax(hf(toks[None]).logits[0], -1)
    hf_effect = hf_on - hf_off
    base = qwen3.forward_logprobs(w, geom, toks).float()

    def error(modules):
        effect = qwen3.forward_logprobs(w, geom, toks, adapters=modules).float() - base
        return (effect - hf_effect).abs().mean().item() / hf_effect.abs().mean().item()

    assert error(got.modules) < 0.1
    swapped = dict(got.modules)
    for key in [k for k in swapped if ".mlp.experts.0." in k]:
        other = key.replace(".experts.0.", ".experts.1.")
        swapped[key], swapped[other] = got.modules[other], got.modules[key]
    assert error(swapped) > 0.2


def test_peft_expert_ranks_follow_the_rank_pattern(moe, tmp_path):
    ad = peft_adapter(moe[0], tmp_path / "p", r=4, lora_alpha=8, target_modules=EXPERTS)
    cfg = json.loads((ad / CONFIG).read_text())
    assert cfg["target_parameters"]  # PEFT turned the expert names into fused parameters
    got = load_adapter(ad, moe[1])
    a, b, scale = got.modules["model.layers.0.mlp.experts.2.up_proj.weight"]
    assert a.shape == (8, 128) and b.shape == (128, 8) and scale == 16 / 8  # doubled by PEFT
    (ad / CONFIG).write_text(json.dumps({**cfg, "rank_pattern": {}}))
    with pytest.raises(
        AdapterError,
        match=r"experts.gate_up_proj: factors have rank 8 per expert, the config says 4",
    ):
        load_adapter(ad, moe[1])


def test_a_rank_that_disagrees_with_the_config_is_refused(dense, tmp_path):
    ad = peft_adapter(dense[0], tmp_path / "p", r=4, lora_alpha=8, target_modules=["q_proj"])
    cfg = json.loads((ad / CONFIG).read_text())
    (ad / CONFIG).write_text(json.dumps({**cfg, "r": 2}))
    with pytest.raises(AdapterError, match=r"layers.0.self_attn.q_proj: factors have rank 4, "):
        load_adapter(ad, dense[1])


def test_an_alpha_edited_in_the_config_of_an_export_is_refused(moe, tmp_path):
    ad = make_adapter(moe[0], tmp_path / "a")
    cfg = json.loads((ad / CONFIG).read_text())
    (ad / CONFIG).write_text(json.dumps({**cfg, "lora_alpha": 32.0}))
    with pytest.raises(AdapterError, match="does not match its recorded adapter sha256"):
        load_adapter(ad, moe[1])


def test_an_export_is_bound_to_its_base_model(moe, tmp_path):
    other = make_tiny(tmp_path / "other", arch="qwen3-moe", seed=6)  # same shapes, other bytes
    ad = make_adapter(moe[0], tmp_path / "a")
    mine, theirs = ModelDir(moe[0]).model_hash, ModelDir(other).model_hash
    assert load_adapter(ad, ModelDir(moe[0])).base_model_hash == mine
    with pytest.raises(
        AdapterError, match=f"made for base model {mine}; this base model is {theirs}"
    ):
        load_adapter(ad, ModelDir(other))


def test_an_older_export_without_the_config_in_its_hash_is_refused(moe, tmp_path):
    good = make_adapter(moe[0], tmp_path / "good")
    old = _rewrite(good, tmp_path / "old", lambda t, m: (t, {"lockstep_payload_sha256": "x"}))
    with pytest.raises(AdapterError, match="exported by an older Lockstep"):
        load_adapter(old, moe[1])


@pytest.mark.parametrize("drop", ["lora_A", "lora_B"])
def test_an_orphan_factor_is_refused_naming_its_module(dense, tmp_path, drop):
    ad = peft_adapter(dense[0], tmp_path / "p", r=4, lora_alpha=8, target_modules=["k_proj"])
    key = f"base_model.model.model.layers.1.self_attn.k_proj.{drop}.weight"
    bad = _rewrite(ad, tmp_path / "bad", lambda t, m: ({k: v for k, v in t.items() if k != key}, m))
    kept = "lora_B" if drop == "lora_A" else "lora_A"
    with pytest.raises(
        AdapterError, match=f"has {kept} but no {drop} for model.layers.1.self_attn.k_proj"
    ):
        load_adapter(bad, dense[1])


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("use_rslora", True, r"use_rslora = True: rsLoRA"),
        ("bias", "all", r"bias = 'all': LoRA biases"),
        ("lora_bias", True, r"lora_bias = True: a bias on lora_B"),
        ("modules_to_save", ["lm_head"], r"modules_to_save = \['lm_head'\]: fully trained"),
        ("layers_to_transform", [0], r"layers_to_transform = \[0\]: a subset of layers"),
        ("fan_in_fan_out", True, r"fan_in_fan_out = True"),
        ("init_lora_weights", "pissa", r"init_lora_weights = 'pissa' changes the base weights"),
        ("peft_type", "IA3", r"adapter type 'IA3' is not LoRA"),
        ("arrow_config", {"top_k": 2}, r"PEFT field 'arrow_config' = .* not implemented"),
    ],
)
def test_peft_features_the_lane_lacks_are_refused_by_name(dense, tmp_path, field, value, message):
    ad = peft_adapter(dense[0], tmp_path / "p", r=4, lora_alpha=8, target_modules=["q_proj"])
    cfg = json.loads((ad / CONFIG).read_text())
    (ad / CONFIG).write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(AdapterError, match=message):
        load_adapter(ad, dense[1])


def test_a_peft_adapter_on_a_module_the_lane_lacks_is_refused(dense, tmp_path):
    ad = peft_adapter(dense[0], tmp_path / "p", r=4, lora_alpha=8, target_modules=["lm_head"])
    with pytest.raises(AdapterError, match="lm_head.base_layer.weight is not a PEFT LoRA factor"):
        load_adapter(ad, dense[1])


def test_an_fp32_peft_adapter_is_refused_naming_the_dtype(dense, tmp_path):
    model = peft_model(dense[0], r=4, lora_alpha=8, target_modules=["q_proj"]).float()
    model.save_pretrained(str(tmp_path / "p"))
    with pytest.raises(AdapterError, match="is torch.float32; the exact lane takes bf16 only"):
        load_adapter(tmp_path / "p", dense[1])


def _foreign(path, tensors, **config):
    """A hand-made adapter in PEFT's layout (no Lockstep record)."""
    path.mkdir()
    cfg = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": [], **config}
    (path / CONFIG).write_text(json.dumps(cfg))
    save_file(tensors, str(path / WEIGHTS))
    return path


def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


FUSED = "base_model.model.model.layers.0.mlp.experts"


@pytest.mark.parametrize(
    "tensors,message",
    [
        (
            {f"{FUSED}.lora_A.weight": _bf16(64, 100), f"{FUSED}.lora_B.weight": _bf16(128, 64)},
            r"experts: factors \(64, 100\)/\(128, 64\) fit neither fused expert parameter",
        ),
        (
            {f"{FUSED}.lora_A.weight": _bf16(12, 128), f"{FUSED}.lora_B.weight": _bf16(256, 12)},
            r"\(gate_up_proj\): factors \(12, 128\)/\(256, 12\) are not rank x 8 experts",
        ),
        (
            {
                f"{FUSED}.lora_A.weight": _bf16(64, 128),
                f"{FUSED}.lora_B.weight": _bf16(256, 64),
                f"{FUSED}.base_layer.lora_A.weight": _bf16(64, 128),
                f"{FUSED}.base_layer.lora_B.weight": _bf16(256, 64),
            },
            r"adapts model.layers.0.mlp.experts.gate_up_proj twice",
        ),
        (
            {f"{FUSED}.lora_A.weight": _bf16(1, 64, 128), f"{FUSED}.lora_B.weight": _bf16(256, 64)},
            r"lora_A.weight has shape \(1, 64, 128\); 2-D expected",
        ),
        ({}, r"holds no LoRA factors"),
    ],
)
def test_foreign_expert_factors_the_lane_cannot_run_are_refused(moe, tmp_path, tensors, message):
    bad = _foreign(tmp_path / "bad", tensors)
    with pytest.raises(AdapterError, match=message):
        load_adapter(bad, moe[1])


@pytest.mark.parametrize(
    "config,message",
    [
        ({"r": "eight"}, r"needs an integer 'r' and a number 'lora_alpha'"),
        ({"rank_pattern": ["q_proj"]}, r"rank_pattern must be a mapping"),
    ],
)
def test_a_malformed_adapter_config_is_refused(moe, tmp_path, config, message):
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{q}.lora_A.weight": _bf16(8, 128), f"{q}.lora_B.weight": _bf16(128, 8)}
    bad = _foreign(tmp_path / "bad", tensors, **config)
    with pytest.raises(AdapterError, match=message):
        load_adapter(bad, moe[1])


def test_a_peft_adapter_of_a_base_model_of_other_shapes_is_refused(dense, tmp_path):
    wide = make_tiny(tmp_path / "wide", arch="qwen3", hidden=96, heads=6, head_dim=16, vocab=300)
    ad = peft_adapter(wide, tmp_path / "p", r=3, lora_alpha=5, target_modules=["q_proj"])
    with pytest.raises(
        AdapterError,
        match=r"self_attn\.q_proj: factors \(3, 96\)/.*, expected \(3, 64\)/.*: the "
        "adapter was made for a base model of other shapes",
    ):
        load_adapter(ad, ModelDir(dense[0]))
