"""PEFT export in bf16 with contract, model and adapter hash; the loader refuses what is not
exact; adapters made by peft (a subset of modules, fused MoE experts) load too."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lockstep_exact.adapters import adapter_sha256, load_adapter
from lockstep_exact.lanes import qwen3
from lockstep_exact.model import ModelDir, lane_contract
from lockstep_megatron import adapters as AD
from lockstep_megatron.convert import build, load_hf_weights
from lockstep_megatron.export import AdapterError, export_peft, load_into, read_adapter


@pytest.fixture(scope="module")
def exported(dense_dir, tmp_path_factory):
    model = AD.attach(build(dense_dir), 8, 16.0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in AD.adapter_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model, export_peft(model, tmp_path_factory.mktemp("export") / "adapter", dense_dir)


def test_export_is_peft_bf16_with_contract_model_and_adapter_hash(exported, dense_dir):
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
    assert meta["lockstep_adapter_sha256"] == adapter_sha256(tensors, cfg)
    assert meta["lockstep_model_hash"] == ModelDir(dense_dir).model_hash


def test_exported_adapter_reloads_to_the_same_bytes(exported, dense_dir):
    model, out = exported
    fresh = build(dense_dir).eval()
    load_into(fresh, out, dense_dir)
    seq = torch.randint(0, model.geom.vocab, (12,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.eval()(seq[None])
        assert torch.equal(want, fresh(seq[None]))
        # input control: the reloaded adapter's o_proj B element 0 moved by 2^-9
        (site,) = [s for s in AD.sites(fresh) if s.hf_module == "model.layers.1.self_attn.o_proj"]
        site.linear.lora[site.part].B.view(-1)[0] += 2.0**-9
        assert not torch.equal(want, fresh(seq[None]))


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
    save_file(tensors, path, metadata=meta)
    with pytest.raises(AdapterError, match="is torch.float32; the exact lane takes bf16 only"):
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


def test_loader_refuses_an_export_for_another_base_model(exported, tmp_path):
    from trainer_support import make_model

    other = make_model(tmp_path / "other", "qwen3", seed=11)  # same shapes, other bytes
    with pytest.raises(AdapterError, match="made for base model .*; this base model is "):
        read_adapter(exported[1], other)


@pytest.mark.parametrize(
    "arch,targets",
    [
        ("qwen3", ["q_proj", "v_proj"]),
        ("qwen3-moe", ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]),
    ],
)
def test_a_peft_adapter_loads_on_the_modules_it_covers(arch, targets, dense_dir, moe_dir, tmp_path):
    from peft_support import peft_adapter

    model_dir = dense_dir if arch == "qwen3" else moe_dir
    ad = peft_adapter(model_dir, tmp_path / "p", seed=4, r=4, lora_alpha=8, target_modules=targets)
    model = build(model_dir).eval()
    got = load_into(model, ad, model_dir)
    adapter = load_adapter(ad, ModelDir(model_dir))
    assert got == adapter.sha256
    adapted = {s.hf_module + ".weight" for s in AD.sites(model) if s.part in s.linear.lora}
    assert adapted == set(adapter.modules)
    if arch == "qwen3":
        assert all(".self_attn.q_proj" in k or ".self_attn.v_proj" in k for k in adapted)
    seq = torch.randint(0, model.geom.vocab, (16,), generator=torch.Generator().manual_seed(6))
    weights = load_hf_weights(model_dir)
    with torch.no_grad():
        lp = model(seq[None])[0]
    assert torch.equal(lp, qwen3.forward_logprobs(weights, model.geom, seq, adapter.modules))
    ads = dict(adapter.modules)  # negative control: one bf16 ulp in one B factor is caught
    key = sorted(k for k in ads if ".self_attn.v_proj" in k)[-1]
    a, b, s = ads[key]
    b = b.clone()
    b.view(torch.int16).view(-1)[b.float().abs().argmax()] += 1
    ads[key] = (a, b, s)
    assert not torch.equal(lp, qwen3.forward_logprobs(weights, model.geom, seq, ads))


def test_a_loaded_peft_adapter_exports_with_its_ranks_and_alphas(dense_dir, tmp_path):
    from peft_support import peft_adapter

    ad = peft_adapter(
        dense_dir,
        tmp_path / "p",
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        rank_pattern={"v_proj": 2},
        alpha_pattern={"v_proj": 6},
    )
    model = build(dense_dir).eval()
    load_into(model, ad, dense_dir)
    out = export_peft(model, tmp_path / "again", dense_dir)
    before = load_adapter(ad, ModelDir(dense_dir))
    after = load_adapter(out, ModelDir(dense_dir))
    assert sorted(after.modules) == sorted(before.modules)
    for k, (a, b, s) in before.modules.items():
        a2, b2, s2 = after.modules[k]
        assert torch.equal(a, a2) and torch.equal(b, b2) and s == s2, k


def test_an_adapter_is_read_against_the_lane_of_the_backend_it_runs_on(
    dense_dir, tmp_path, monkeypatch
):
    """The trainer checks an adapter against the contract of the lane it runs (as the serving
    half does): one bound to the cuda lane loads for backend cuda and is refused for cpu, and
    the reverse. (The cuda contract's pins need the cuda backend; here each backend's
    fingerprint is stood in for, the binding logic is what is checked.)"""
    from types import SimpleNamespace

    from lockstep_exact.adapters import make_adapter

    real = ModelDir.contract

    def contract(self, backend="cpu", *a, **kw):
        if backend == "cuda":
            return SimpleNamespace(fingerprint="cuda-lane-" + real(self).fingerprint[:16])
        return real(self, backend, *a, **kw)

    monkeypatch.setattr(ModelDir, "contract", contract)
    cuda_lane = ModelDir(dense_dir).contract("cuda").fingerprint
    on_cuda = make_adapter(dense_dir, tmp_path / "cuda", rank=4, seed=1, contract=cuda_lane)
    on_cpu = make_adapter(dense_dir, tmp_path / "cpu", rank=4, seed=1)
    assert read_adapter(on_cuda, dense_dir, "cuda").sha256 == read_adapter(on_cpu, dense_dir).sha256
    for path, backend in ((on_cuda, "cpu"), (on_cpu, "cuda")):
        with pytest.raises(AdapterError, match="contract"):
            read_adapter(path, dense_dir, backend)
