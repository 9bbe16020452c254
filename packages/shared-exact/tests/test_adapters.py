"""PEFT adapters: the zero adapter is the base model's bytes; bad adapters are refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from lockstep_exact.adapters import (
    WEIGHTS,
    AdapterError,
    load_adapter,
    make_adapter,
    perturb_adapter,
)
from lockstep_exact.contract import lane_contract
from lockstep_exact.lanes import qwen3
from lockstep_exact.parity import assert_same_bytes, same_bytes
from lockstep_exact.tiny import make_tiny


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
    with pytest.raises(AdapterError, match="payload sha256|float32"):
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
        from lockstep_exact.adapters import payload_sha256

        t = dict(t)
        t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 128, dtype=torch.bfloat16)
        t["base_model.model.lm_head.lora_B.weight"] = torch.zeros(1024, 8, dtype=torch.bfloat16)
        return t, {**m, "lockstep_payload_sha256": payload_sha256(t)}

    bad = _rewrite(good, tmp_path / "lm_head", add_lm_head)
    with pytest.raises(AdapterError, match="does not cover"):
        load_adapter(bad, moe[1])


def test_dora_and_missing_files_are_refused(moe, tmp_path):
    good = make_adapter(moe[0], tmp_path / "good")
    cfg = json.loads((good / "adapter_config.json").read_text())
    (good / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(AdapterError, match="DoRA"):
        load_adapter(good, moe[1])
    with pytest.raises(AdapterError, match="not a PEFT adapter"):
        load_adapter(tmp_path, moe[1])
