"""The tiny-model maker: reproducible bytes, HF-loadable names and configs, exact vocab."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from lockstep_exact.app.tiny import (
    SPECIAL_TOKENS,
    TinyArgumentError,
    default_prompts,
    make_tiny,
    tiny_config,
    train_tokenizer,
)
from lockstep_exact.hashing import dir_sha256, sha256_file

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("dense") / "m", arch="qwen3", seed=0)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("moe") / "m", arch="qwen3-moe", seed=0)


def _one_ulp_up(t: torch.Tensor) -> torch.Tensor:
    """The same bf16 tensor with its first element moved one ulp."""
    out = t.clone()
    bits = out.reshape(-1).view(torch.int16)
    bits[0] += 1
    return out


# ----------------------------------------------------------------------------- reproducibility


def test_tiny_model_bytes_are_reproducible_for_a_seed(dense, tmp_path):
    again = make_tiny(tmp_path / "again", arch="qwen3", seed=0)
    for name in FILES:
        assert (dense / name).read_bytes() == (again / name).read_bytes(), name
    assert dir_sha256(dense) == dir_sha256(again)


def test_moe_model_bytes_are_reproducible_for_a_seed(moe, tmp_path):
    again = make_tiny(tmp_path / "again", arch="qwen3-moe", seed=0)
    assert sorted(os.listdir(moe)) == sorted(FILES)
    for name in FILES:
        assert sha256_file(moe / name) == sha256_file(again / name), name


def test_another_seed_gives_other_weights_and_the_same_tokenizer(dense, tmp_path):
    other = make_tiny(tmp_path / "seed1", arch="qwen3", seed=1)
    assert dir_sha256(other) != dir_sha256(dense)
    a, b = load_file(dense / "model.safetensors"), load_file(other / "model.safetensors")
    assert all(not torch.equal(a[k], b[k]) for k in a)
    assert (other / "tokenizer.json").read_bytes() == (dense / "tokenizer.json").read_bytes()


def test_model_hash_detects_a_one_ulp_change_in_one_weight(dense, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "config.json").write_bytes((dense / "config.json").read_bytes())
    weights = load_file(dense / "model.safetensors")
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    assert dir_sha256(copy) == dir_sha256(dense)  # the same tensors re-saved: same hash
    name = "model.layers.1.self_attn.k_norm.weight"
    weights[name] = _one_ulp_up(weights[name])
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    assert dir_sha256(copy) != dir_sha256(dense)


def test_a_layers_weights_do_not_depend_on_the_depth(dense, tmp_path):
    deeper = make_tiny(tmp_path / "deep", arch="qwen3", seed=0, layers=3)
    a, b = load_file(dense / "model.safetensors"), load_file(deeper / "model.safetensors")
    assert torch.equal(
        a["model.layers.0.mlp.up_proj.weight"], b["model.layers.0.mlp.up_proj.weight"]
    )
    # Output projections are scaled by depth, so they do differ.
    assert not torch.equal(
        a["model.layers.0.mlp.down_proj.weight"], b["model.layers.0.mlp.down_proj.weight"]
    )


_TRAIN_IN_CHILD = """
import hashlib, sys
from lockstep_exact.app.tiny import train_tokenizer
print(hashlib.sha256(train_tokenizer(int(sys.argv[1])).to_str(pretty=True).encode()).hexdigest())
"""


def test_tokenizer_training_is_reproducible_across_processes_and_thread_counts():
    import hashlib

    here = hashlib.sha256(train_tokenizer(1024).to_str(pretty=True).encode()).hexdigest()
    env = dict(os.environ, PYTHONHASHSEED="12345", RAYON_NUM_THREADS="3")
    env.pop("TOKENIZERS_PARALLELISM", None)
    child = subprocess.run(
        [sys.executable, "-c", _TRAIN_IN_CHILD, "1024"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert child == here
    # Negative control: another vocab size is another tokenizer.
    other = hashlib.sha256(train_tokenizer(1023).to_str(pretty=True).encode()).hexdigest()
    assert other != here


# ----------------------------------------------------------------------------- format


def test_weights_are_bf16_under_hf_qwen3_names(dense):
    w = load_file(dense / "model.safetensors")
    cfg = json.loads((dense / "config.json").read_text())
    assert {t.dtype for t in w.values()} == {torch.bfloat16}
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        expected |= {
            f"{p}.input_layernorm.weight",
            f"{p}.post_attention_layernorm.weight",
            *(f"{p}.self_attn.{x}_proj.weight" for x in "qkvo"),
            f"{p}.self_attn.q_norm.weight",
            f"{p}.self_attn.k_norm.weight",
            *(f"{p}.mlp.{x}_proj.weight" for x in ("gate", "up", "down")),
        }
    assert set(w) == expected
    assert w["model.embed_tokens.weight"].shape == (1024, 128)
    assert w["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 128)
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 128)
    assert w["model.layers.0.mlp.gate_proj.weight"].shape == (3 * 128, 128)


def test_moe_weights_have_one_tensor_per_expert_and_a_router(moe):
    w = load_file(moe / "model.safetensors")
    for i in range(2):
        assert w[f"model.layers.{i}.mlp.gate.weight"].shape == (8, 128)
        for e in range(8):
            for x in ("gate", "up"):
                assert w[f"model.layers.{i}.mlp.experts.{e}.{x}_proj.weight"].shape == (128, 128)
            assert w[f"model.layers.{i}.mlp.experts.{e}.down_proj.weight"].shape == (128, 128)
    assert not any(k.endswith("mlp.up_proj.weight") for k in w)


def test_norm_weights_are_near_one_but_not_one(dense):
    w = load_file(dense / "model.safetensors")
    for name, t in w.items():
        if name.endswith("norm.weight"):
            t = t.float()
            assert (t != 1).float().mean() > 0.9, name
            assert 0.9 < t.mean() < 1.1 and 0.03 < t.std() < 0.3, name


def test_config_has_the_keys_vllm_and_transformers_read(dense, moe):
    cfg = json.loads((dense / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    assert cfg["head_dim"] == 32 and cfg["hidden_act"] == "silu"
    assert cfg["attention_bias"] is False and cfg["tie_word_embeddings"] is False
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 1000000.0
    m = json.loads((moe / "config.json").read_text())
    assert m["architectures"] == ["Qwen3MoeForCausalLM"] and m["model_type"] == "qwen3_moe"
    assert (m["num_experts"], m["num_experts_per_tok"], m["moe_intermediate_size"]) == (8, 2, 128)
    assert m["norm_topk_prob"] is True and m["decoder_sparse_step"] == 1
    assert m["mlp_only_layers"] == [] and m["output_router_logits"] is False


def test_tied_embeddings_drop_lm_head(tmp_path):
    d = make_tiny(tmp_path / "tied", tie_embeddings=True, vocab=300, hidden=32, heads=2, kv_heads=1)
    assert "lm_head.weight" not in load_file(d / "model.safetensors")
    assert json.loads((d / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.parametrize("vocab", [259, 1000, 1024, 2000])
def test_tokenizer_has_exactly_vocab_entries(vocab):
    tok = train_tokenizer(vocab)
    assert tok.get_vocab_size(with_added_tokens=True) == vocab
    assert len(tok.get_vocab(with_added_tokens=True)) == vocab
    assert sorted(tok.get_vocab(with_added_tokens=True).values()) == list(range(vocab))
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2]


# ----------------------------------------------------------------------------- HF loading


def test_transformers_loads_config_and_tokenizer_offline(dense):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(dense)
    assert cfg.model_type == "qwen3" and cfg.vocab_size == 1024 and cfg.head_dim == 32
    tok = AutoTokenizer.from_pretrained(dense)
    assert len(tok) == 1024
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0 and tok.pad_token_id == 0
    for text in default_prompts():
        ids = tok(text)["input_ids"]
        assert 0 < len(ids) < len(text.encode()) + 1
        assert tok.decode(ids) == text
    ids = tok("<|im_start|>user\nhi<|im_end|>")["input_ids"]
    assert ids[0] == 1 and ids[-1] == 2


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(arch="qwen3"),
        dict(arch="qwen3-moe"),
        dict(arch="qwen3", hidden=96, heads=3, kv_heads=1, vocab=1000, layers=3),
        dict(
            arch="qwen3-moe",
            hidden=96,
            heads=3,
            kv_heads=3,
            vocab=1000,
            experts=5,
            topk=3,
            moe_intermediate=40,
            tie_embeddings=True,
        ),
    ],
    ids=["dense", "moe", "dense-odd", "moe-odd-tied"],
)
def test_transformers_model_loads_every_tensor_and_runs(tmp_path, kwargs):
    from transformers import AutoConfig, AutoModelForCausalLM

    d = make_tiny(tmp_path / "m", **kwargs)
    model, info = AutoModelForCausalLM.from_pretrained(
        d, output_loading_info=True, dtype=torch.float32
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"] and not info["error_msgs"]
    assert model.config.vocab_size == AutoConfig.from_pretrained(d).vocab_size
    if kwargs.get("tie_embeddings"):
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor([[5, 17, 300, 42, 7]])).logits
    assert logits.shape[-1] == model.config.vocab_size
    assert torch.isfinite(logits).all()
    assert 0.5 < logits.std().item() < 10  # neither flat nor blown up


# ----------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(heads=4, kv_heads=3), "divisible by kv_heads"),
        (dict(arch="qwen3-moe", experts=4, topk=5), "topk (5) must be <= experts (4)"),
        (dict(hidden=100, heads=3, kv_heads=1), "pass head_dim"),
        (dict(head_dim=7), "head_dim must be even"),
        (dict(vocab=100), "vocab must be >= 259"),
        (dict(arch="llama"), "arch must be one of"),
        (dict(layers=0), "layers must be >= 1"),
        (dict(hidden=128.0), "hidden must be an int"),
        (dict(rope_theta=-1.0), "rope_theta must be a finite number > 0"),
        (dict(seed=-1), "seed must be >= 0"),
    ],
)
def test_bad_arguments_are_refused_with_a_clear_message(tmp_path, kwargs, message):
    with pytest.raises(TinyArgumentError) as e:
        make_tiny(tmp_path / "bad", **kwargs)
    assert message in str(e.value)
    assert isinstance(e.value, ValueError)
    assert not (tmp_path / "bad").exists()


def test_explicit_head_dim_allows_hidden_not_divisible_by_heads():
    cfg = tiny_config("qwen3", hidden=100, heads=3, kv_heads=1, head_dim=32)
    assert cfg["head_dim"] == 32 and cfg["intermediate_size"] == 300


def test_default_prompts_are_fixed_english_of_different_lengths():
    prompts = default_prompts()
    assert len(prompts) == 8 and prompts == default_prompts(8)
    assert len({len(p) for p in prompts}) == 8
    assert all(p.isascii() and p for p in prompts)
    assert default_prompts(3) == prompts[:3]
    with pytest.raises(ValueError):
        default_prompts(9)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
def test_drawing_tensors_on_threads_gives_the_bytes_of_drawing_them_in_turn(arch, monkeypatch):
    from lockstep_exact.app import tiny

    config = tiny.tiny_config(arch, hidden=96, layers=2, heads=3, kv_heads=1, vocab=515)
    monkeypatch.setattr(tiny, "_PARALLEL_NUMEL", 1 << 62)
    in_turn = tiny.tiny_state_dict(config, seed=5)
    monkeypatch.setattr(tiny, "_PARALLEL_NUMEL", 0)
    monkeypatch.setattr(tiny.os, "cpu_count", lambda: 4)
    threaded = tiny.tiny_state_dict(config, seed=5)
    assert list(threaded) == list(in_turn)
    assert all(
        torch.equal(threaded[k].view(torch.int16), in_turn[k].view(torch.int16)) for k in in_turn
    )
    # input control: threaded with seed 6 draws other bytes
    other = tiny.tiny_state_dict(config, seed=6)
    emb = "model.embed_tokens.weight"
    assert not torch.equal(other[emb].view(torch.int16), in_turn[emb].view(torch.int16))
