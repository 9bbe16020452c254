"""PEFT export in bf16 with contract + payload hash; the loader refuses what is not exact."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lockstep_exact.adapters import payload_sha256
from lockstep_exact.contract import lane_contract
from lockstep_megatron import adapters as AD
from lockstep_megatron.convert import build
from lockstep_megatron.export import AdapterError, export_peft, load_into, read_adapter


@pytest.fixture(scope="module")
def exported(dense_dir, tmp_path_factory):
    model = AD.attach(build(dense_dir), 8, 16.0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in AD.adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model, export_peft(model, tmp_path_factory.mktemp("export") / "adapter", dense_dir)


def test_export_is_peft_bf16_with_contract_and_payload_hash(exported, dense_dir):
    _, out = exported
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and cfg["lora_alpha"] == 16.0
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in tensors
    assert meta["lockstep_contract"] == lane_contract(dense_dir).fingerprint
    assert meta["lockstep_payload_sha256"] == payload_sha256(tensors)


def test_exported_adapter_reloads_to_the_same_bytes(exported, dense_dir):
    model, out = exported
    fresh = build(dense_dir).eval()
    load_into(fresh, out, dense_dir)
    seq = torch.randint(0, model.geom.vocab, (12,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model.eval()(seq[None]), fresh(seq[None]))


def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_loader_refuses_fp32_adapters(exported, dense_dir, tmp_path):
    bad = _copy(exported[1], tmp_path / "fp32")
    path = str(bad / "adapter_model.safetensors")
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    tensors = {k: v.float() for k, v in load_file(path).items()}
    meta["lockstep_payload_sha256"] = payload_sha256(tensors)  # well-formed, only fp32
    save_file(tensors, path, metadata=meta)
    with pytest.raises(AdapterError, match="bf16 only"):
        read_adapter(bad, dense_dir)


def test_loader_refuses_a_corrupted_adapter(exported, dense_dir, tmp_path):
    bad = _copy(exported[1], tmp_path / "flip")
    data = bytearray((bad / "adapter_model.safetensors").read_bytes())
    data[-2] ^= 0x01  # one payload bit
    (bad / "adapter_model.safetensors").write_bytes(bytes(data))
    with pytest.raises(AdapterError, match="corrupted"):
        read_adapter(bad, dense_dir)


def test_loader_refuses_an_adapter_of_another_contract(exported, moe_dir):
    with pytest.raises(AdapterError, match="contract"):
        read_adapter(exported[1], moe_dir)


def test_load_adapter_hook_returns_the_adapter_hash(exported, dense_dir):
    from lockstep_exact.plugins import manager
    from lockstep_megatron import plugin

    pm = manager(load_entry_points=False)
    pm.register(plugin)
    got = pm.hook.lockstep_load_adapter(
        adapter_dir=exported[1], model_dir=dense_dir, role="trainer"
    )
    assert got == read_adapter(exported[1], dense_dir).sha256
