"""`lockstep qualify`: the whole ladder passes on the tiny MoE; a one-ulp sampler copy fails it
at the base ruler, and the first-divergence search names the expert op site."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lockstep_exact.cli import main
from lockstep_exact.lanes import qwen3
from lockstep_exact.parity import nudge_ulp
from lockstep_exact.sites import recording
from lockstep_exact.tiny import default_prompts, make_tiny

pytestmark = pytest.mark.engine


def test_the_ladder_qualifies_the_default_tiny_moe(tmp_path, capsys):
    assert main(["qualify", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] and [g["name"] for g in report["gates"]] == [
        "base ruler",
        "adapter A join",
        "training gate",
        "adapter B join",
        "promotion",
    ]
    promotion = report["gates"][-1]["checks"][0]
    assert promotion["decisions"] == promotion["byte_equal"] == 64
    assert promotion["k3"] == [0.0] * 64
    controls = [c for g in report["gates"] for c in g["checks"] if not c["expect_exact"]]
    assert len(controls) == 2 and all(c["byte_equal"] < c["decisions"] for c in controls)
    assert "<svg" in (tmp_path / "report.html").read_text()
    assert "QUALIFIED" in capsys.readouterr().out


def _expert_nudge(model_dir):
    """A layer-1 expert weight element whose one-ulp change moves that expert's output bytes
    on the first prompt (found by trying elements against the reference composition)."""
    from tokenizers import Tokenizer

    geom = qwen3.Geometry.from_model_dir(model_dir)
    w = load_file(str(model_dir / "model.safetensors"))
    tokens = torch.tensor(
        Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(default_prompts(8)[0]).ids
    )
    with recording() as base:
        qwen3.forward_logprobs(w, geom, tokens)
    expert = int(base["layers.1.mlp.router.ids"][0, 0])
    site = f"layers.1.mlp.experts.{expert}.down_proj"
    name = f"model.{site}.weight"
    for index in range(0, w[name].numel(), 7):
        trial = dict(w)
        trial[name] = nudge_ulp(w[name], index)
        with recording() as sites:
            qwen3.forward_logprobs(trial, geom, tokens)
        if not torch.equal(sites[site].view(torch.int16), base[site].view(torch.int16)):
            return trial, site
    raise AssertionError("no single-ulp change moved the expert's output")


def test_a_one_ulp_expert_weight_in_the_sampler_copy_fails_and_bisect_names_it(tmp_path, capsys):
    model = make_tiny(tmp_path / "model", arch="qwen3-moe")
    copy = tmp_path / "sampler-copy"
    shutil.copytree(model, copy)
    weights, site = _expert_nudge(model)
    save_file(weights, str(copy / "model.safetensors"))
    rc = main(
        [
            "qualify",
            "--model",
            str(model),
            "--sampler-model",
            str(copy),
            "--out",
            str(tmp_path / "q"),
        ]
    )
    assert rc != 0
    report = json.loads((tmp_path / "q" / "report.json").read_text())
    assert not report["passed"] and len(report["gates"]) == 1
    gate = report["gates"][0]
    assert gate["name"] == "base ruler" and "model hash" in gate["error"]
    assert gate["bisect"]["divergence"]["site"] == site, gate["bisect"]
    assert "NOT QUALIFIED" in capsys.readouterr().out


def _tiny(tmp_path):
    return make_tiny(tmp_path / "model", arch="qwen3-moe", hidden=64, vocab=400)


def test_qualify_without_the_trainer_plugin_names_the_missing_half(tmp_path):
    import lockstep_serving.plugin
    from lockstep_exact.plugins import MissingHalf, manager
    from lockstep_exact.qualify import Ladder

    pm = manager(load_entry_points=False)
    pm.register(lockstep_serving.plugin)
    with pytest.raises(MissingHalf, match="trainer half.*install lockstep-megatron"):
        Ladder(pm, _tiny(tmp_path), tmp_path / "q")


def test_qualify_refuses_halves_whose_contracts_differ(tmp_path):
    from lockstep_exact import hookimpl
    from lockstep_exact.contract import ContractMismatch, contract_from_json, lane_contract
    from lockstep_exact.plugins import manager
    from lockstep_exact.qualify import Ladder

    class SkewedTrainer:  # a trainer configured with another attention block size
        @hookimpl(tryfirst=True)
        def lockstep_trainer_contract(self, model_dir, adapter_dir, backend):
            data = lane_contract(model_dir).to_json()
            data["sites"]["layers.*.self_attn.core"] = "attention.blocked@1{block=64}"
            return contract_from_json(data)

    pm = manager()
    pm.register(SkewedTrainer())
    ladder = Ladder(pm, _tiny(tmp_path), tmp_path / "q")
    with pytest.raises(ContractMismatch, match=r"layers\.\*\.self_attn\.core.*block=32.*block=64"):
        ladder.run([])


@pytest.mark.parametrize("damage", ["corrupted", "fp32"])
def test_qualify_refuses_a_damaged_adapter_by_name(tmp_path, capsys, damage):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from lockstep_exact.adapters import WEIGHTS, make_adapter

    model = _tiny(tmp_path)
    adapter = make_adapter(model, tmp_path / "adapter")
    if damage == "corrupted":
        raw = bytearray((adapter / WEIGHTS).read_bytes())
        raw[-5] ^= 0x10
        (adapter / WEIGHTS).write_bytes(bytes(raw))
        expected = "corrupted"
    else:  # an export in fp32, with a payload hash that matches its (fp32) bytes
        from lockstep_exact.adapters import payload_sha256

        with safe_open(str(adapter / WEIGHTS), "pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k).float() for k in f.keys()}  # noqa: SIM118
        meta["lockstep_payload_sha256"] = payload_sha256(tensors)
        save_file(tensors, str(adapter / WEIGHTS), metadata=meta)
        expected = "float32"
    rc = main(
        ["qualify", "--model", str(model), "--adapter", str(adapter), "--out", str(tmp_path / "q")]
    )
    assert rc == 1
    gate = json.loads((tmp_path / "q" / "report.json").read_text())["gates"][0]
    assert not gate["passed"] and expected in gate["error"], gate["error"]
    assert "NOT QUALIFIED" in capsys.readouterr().out


def test_the_ladders_adapters_have_a_rank_an_odd_top_k_divides(tmp_path):
    from lockstep_exact.adapters import load_adapter, make_adapter
    from lockstep_exact.model import ModelDir
    from lockstep_exact.plugins import manager
    from lockstep_exact.qualify import Ladder

    moe = make_tiny(tmp_path / "m", arch="qwen3-moe", hidden=64, vocab=300, experts=4, topk=3)
    ladder = Ladder(manager(), moe, tmp_path / "q")
    assert ladder.rank == 9  # rank 8 raised to a multiple of 3: each expert gets rank 3
    a = make_adapter(moe, tmp_path / "A", rank=ladder.rank, seed=2)  # refused at rank 8
    assert load_adapter(a, ModelDir(moe)).rank == 9
    assert Ladder(manager(), _tiny(tmp_path), tmp_path / "q2").rank == 8


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--trainer-tp", "3"], "tp 3 does not divide"),
        (["--sampler-tp", "3"], "tp 3 does not divide"),
        (["--trainer-ep", "3"], "ep 3 does not divide the model's 8 experts"),
        (["--trainer-ep", "0"], "ep must be an int >= 1, got 0"),
    ],
)
def test_qualify_refuses_a_layout_that_does_not_divide_before_any_engine(
    tmp_path, capsys, flags, message
):
    model = _tiny(tmp_path)
    out = tmp_path / "q"
    assert main(["qualify", "--model", str(model), "--out", str(out), *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (out / "traces").exists()  # refused before the first capture


def test_the_ladder_hands_each_half_its_own_layout(tmp_path):
    """The sampler's layout reaches every capture request, the trainer's every replay request
    (a first-called recorder stops each call before an engine starts)."""
    from lockstep_exact import hookimpl
    from lockstep_exact.plugins import manager
    from lockstep_exact.qualify import Ladder

    class Stop(Exception):
        pass

    seen = {}

    class Recorder:
        @hookimpl(tryfirst=True)
        def lockstep_capture(self, request):
            seen["capture"] = request
            raise Stop

        @hookimpl(tryfirst=True)
        def lockstep_replay(self, request):
            seen["replay"] = request
            raise Stop

    pm = manager()
    pm.register(Recorder())
    ladder = Ladder(pm, _tiny(tmp_path), tmp_path / "q", sampler_tp=2, trainer_tp=2, trainer_ep=4)
    with pytest.raises(Stop):
        ladder.capture("x", adapter=None, n_prompts=1, per_prompt=1)
    with pytest.raises(Stop):
        ladder.replay(tmp_path / "trace", adapter=None)
    assert seen["capture"].tp == 2
    assert (seen["replay"].tp, seen["replay"].ep) == (2, 4)
    assert ladder.layouts == {"sampler": {"tp": 2}, "trainer": {"tp": 2, "ep": 4}}


def test_qualify_runs_the_trainer_at_its_own_layout(tmp_path, capsys):
    """The base ruler with the trainer at tp 2 (Megatron in two gloo ranks) against the sampler
    at tp 1: byte-equal replays, and the report names both layouts."""
    from lockstep_exact.adapters import make_adapter

    model = make_tiny(tmp_path / "dense", arch="qwen3", seed=3)
    adapter = make_adapter(model, tmp_path / "A", rank=8, seed=2)
    out = tmp_path / "q"
    argv = ["qualify", "--model", str(model), "--adapter", str(adapter), "--out", str(out)]
    assert main([*argv, "--decisions", "8", "--trainer-tp", "2"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["layouts"] == {"sampler": {"tp": 1}, "trainer": {"tp": 2, "ep": 1}}
    checks = report["gates"][0]["checks"]
    assert [c["passed"] for c in checks] == [True, True, True]
    assert checks[-1]["byte_equal"] == checks[-1]["decisions"] == 8
    assert "layouts: sampler tp 1; trainer tp 2 ep 1" in capsys.readouterr().out
    assert "layouts sampler tp 1; trainer tp 2 ep 1" in (out / "report.html").read_text()
