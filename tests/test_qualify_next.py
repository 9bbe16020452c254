"""`lockstep qualify --tiny qwen3-next`: the whole ladder passes on the hybrid lane (Gated
DeltaNet + gated attention + MoE), with LoRA on the GDN projections and grouped expert
adapters; a one-ulp GDN weight in the sampler's copy fails it, and the first-divergence search
names the GDN op site."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lockstep_exact.app.cli import main
from lockstep_exact.app.tiny import default_prompts, make_tiny
from lockstep_exact.lanes import qwen3_next
from lockstep_exact.parity import same_bytes
from lockstep_exact.sites import recording
from lockstep_exact.testing import nudge_ulp

pytestmark = [pytest.mark.engine, pytest.mark.slow]

GATES = ["base ruler", "adapter A join", "training gate", "adapter B join", "promotion"]
GDN = ("in_proj_qkvz", "in_proj_ba", "out_proj")


def test_the_ladder_qualifies_the_tiny_qwen3_next(tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["qualify", "--tiny", "qwen3-next", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] and [g["name"] for g in report["gates"]] == GATES
    assert report["lane"] == "qwen3-next/bf16/cpu" and report["notes"] == []
    promotion = report["gates"][-1]["checks"][0]
    assert promotion["decisions"] == promotion["byte_equal"] == 64
    assert promotion["k3"] == [0.0] * 64
    # the ladder's own controls (a 2^-9 change to one expert's adapter, on either half) differ
    controls = [c for g in report["gates"] for c in g["checks"] if not c["expect_exact"]]
    assert len(controls) == 2 and all(c["byte_equal"] < c["decisions"] for c in controls)
    assert all(c["passed"] for c in controls)
    # adapter A: LoRA on the GDN projections, grouped expert adapters (rank 8 // top-k 2)
    a_dir = out / "adapters" / "A"
    cfg = json.loads((a_dir / "adapter_config.json").read_text())
    assert set(GDN) <= set(cfg["target_modules"]) and cfg["r"] == 8
    assert list(cfg["rank_pattern"].values()) == [4]
    a = load_file(str(a_dir / "adapter_model.safetensors"))
    b = load_file(str(out / "adapters" / "B-run0" / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0"
    for proj in GDN:  # the training step moved each GDN projection's B factor
        key = f"{prefix}.linear_attn.{proj}.lora_B.weight"
        assert not same_bytes(a[key], b[key]), key
    assert a[f"{prefix}.mlp.experts.0.down_proj.lora_A.weight"].shape[0] == 4
    printed = capsys.readouterr().out
    assert "making tiny qwen3-next model" in printed and "QUALIFIED" in printed


def _gdn_nudge(model_dir, site="layers.0.linear_attn.out_proj"):
    """A one-ulp change to a GDN projection weight that moves that site's output bytes on the
    first prompt (tried against the reference composition, largest weights first)."""
    from tokenizers import Tokenizer

    geom = qwen3_next.Geometry.from_model_dir(model_dir)
    w = load_file(str(model_dir / "model.safetensors"))
    tokens = torch.tensor(
        Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(default_prompts(8)[0]).ids
    )
    with recording() as base:
        qwen3_next.forward_logprobs(w, geom, tokens)
    name = f"model.{site}.weight"
    for index in w[name].float().abs().flatten().argsort(descending=True)[:64].tolist():
        trial = dict(w)
        trial[name] = nudge_ulp(w[name], index)
        with recording() as sites:
            qwen3_next.forward_logprobs(trial, geom, tokens)
        if not torch.equal(sites[site].view(torch.int16), base[site].view(torch.int16)):
            return trial, site
    raise AssertionError(f"no single-ulp change moved {site}")


def test_a_one_ulp_gdn_weight_in_the_sampler_copy_fails_and_bisect_names_it(tmp_path, capsys):
    model = make_tiny(tmp_path / "model", arch="qwen3-next")
    copy = tmp_path / "sampler-copy"
    shutil.copytree(model, copy)
    weights, site = _gdn_nudge(model)
    save_file(weights, str(copy / "model.safetensors"))
    argv = ["qualify", "--model", str(model), "--sampler-model", str(copy)]
    assert main([*argv, "--out", str(tmp_path / "q")]) != 0
    report = json.loads((tmp_path / "q" / "report.json").read_text())
    assert not report["passed"] and report["lane"] == "qwen3-next/bf16/cpu"
    gate = report["gates"][0]
    assert len(report["gates"]) == 1 and gate["name"] == "base ruler"
    assert "model hash" in gate["error"]
    assert gate["bisect"]["divergence"]["site"] == site, gate["bisect"]
    assert "NOT QUALIFIED" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags", [["--sampler-tp", "2"], ["--trainer-tp", "2"], ["--trainer-ep", "2"]]
)
def test_qualify_refuses_a_layout_the_hybrid_lane_lacks_before_any_engine(tmp_path, capsys, flags):
    model = make_tiny(tmp_path / "model", arch="qwen3-next")
    out = tmp_path / "q"
    assert main(["qualify", "--model", str(model), "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert "the qwen3-next lane runs on one device so far (tp 1, ep 1)" in err
    assert not (out / "traces").exists()  # refused before the first capture
