"""`lockstep qualify`: the whole ladder passes on the tiny MoE; a one-ulp sampler copy fails it
at the base ruler, and the first-divergence search names the expert op site."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from lockstep_exact.app.cli import main
from lockstep_exact.app.tiny import default_prompts, make_tiny
from lockstep_exact.lanes import qwen3
from lockstep_exact.sites import recording
from lockstep_exact.testing import nudge_ulp

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
    # the backend (the lane's name ends in it) and every engine's version, torch's with it
    assert report["backend"] == "cpu" and report["lane"].endswith("/cpu")
    engines = {e["engine"]: e for e in report["engines"]}
    assert {"vllm", "megatron-core"} <= set(engines)
    assert all(engines[n]["torch_version"] == torch.__version__ for n in ("vllm", "megatron-core"))
    printed = capsys.readouterr().out
    assert "QUALIFIED" in printed and f"backend: cpu on {report['device']}" in printed
    assert f"trainer megatron-core {engines['megatron-core']['engine_version']}" in printed


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


@pytest.mark.slow  # the fast tier's 10-minute budget; CI's --all runs it
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
    import lockstep_serving.vllm.hooks
    from lockstep_exact.app.qualify import Ladder
    from lockstep_exact.plugins import MissingHalf, manager

    pm = manager(load_entry_points=False)
    pm.register(lockstep_serving.vllm.hooks)
    with pytest.raises(MissingHalf, match="trainer half.*install lockstep-megatron"):
        Ladder(pm, _tiny(tmp_path), tmp_path / "q")


def test_qualify_refuses_halves_whose_contracts_differ(tmp_path):
    from lockstep_exact import hookimpl
    from lockstep_exact.app.qualify import Ladder
    from lockstep_exact.contract import ContractMismatch, contract_from_json
    from lockstep_exact.model import lane_contract
    from lockstep_exact.plugins import manager

    class SkewedTrainer:  # a trainer configured with another attention block size
        @hookimpl(tryfirst=True)
        def lockstep_trainer_contract(self, model_dir, adapter_dir, backend):
            data = lane_contract(model_dir).to_json()
            data["sites"]["layers.*.self_attn.core"] = "attention.blocked@3{block=64,segment=512}"
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
    from lockstep_exact.app.qualify import Ladder
    from lockstep_exact.model import ModelDir
    from lockstep_exact.plugins import manager

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
    from lockstep_exact.app.qualify import Ladder
    from lockstep_exact.plugins import manager

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


@pytest.mark.slow
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


# --- the backend (issue 11): cpu here, cuda on the GPU machine (tests/test_qualify_gpu.py) ------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("source", ["tiny", "model"])
def test_qualify_refuses_cuda_without_a_device_before_anything_starts(tmp_path, capsys, source):
    out = tmp_path / "q"
    model = ["--model", str(_tiny(tmp_path))] if source == "model" else []
    assert main(["qualify", *model, "--out", str(out), "--backend", "cuda"]) == 2
    err = capsys.readouterr().err
    assert f"--backend cuda: torch {torch.__version__} sees no CUDA device on this machine" in err
    assert "--backend cpu" in err
    assert not out.exists()  # no tiny model made, no engine log, no trace


def test_the_ladder_refuses_a_backend_it_cannot_run_by_name(tmp_path, monkeypatch):
    from lockstep_exact.app.qualify import BackendRefused, Ladder
    from lockstep_exact.plugins import manager

    model = _tiny(tmp_path)
    with pytest.raises(BackendRefused, match=r"backend 'rocm': the ladder runs on cpu or cuda"):
        Ladder(manager(), model, tmp_path / "q", backend="rocm")
    # with a device, cuda still runs the trainer on one GPU (refused before the contract)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(BackendRefused, match=r"one GPU \(tp x ep = 1\), not tp 1 x ep 2"):
        Ladder(manager(), model, tmp_path / "q", backend="cuda", trainer_ep=2)


def test_the_ladder_hands_its_backend_to_every_request(tmp_path, monkeypatch):
    """``backend`` reaches both contract hooks and every capture, replay and train request
    (a first-called recorder stops each call before an engine starts; the cuda check and
    the cuda contract, which need a GPU and triton, are stood in for by the cpu ones)."""
    from lockstep_exact import hookimpl
    from lockstep_exact.app import qualify as Q
    from lockstep_exact.model import ModelDir
    from lockstep_exact.plugins import manager

    cpu_contract = ModelDir.contract
    monkeypatch.setattr(Q, "check_backend", lambda *args: None)
    monkeypatch.setattr(ModelDir, "contract", lambda self, backend="cpu": cpu_contract(self))

    class Stop(Exception):
        pass

    seen = {}

    class Recorder:
        @hookimpl(tryfirst=True)
        def lockstep_sampler_contract(self, model_dir, adapter_dir, backend):
            seen["sampler contract"] = backend
            return ModelDir(model_dir).contract(backend)

        @hookimpl(tryfirst=True)
        def lockstep_trainer_contract(self, model_dir, adapter_dir, backend):
            seen["trainer contract"] = backend
            return ModelDir(model_dir).contract(backend)

        @hookimpl(tryfirst=True)
        def lockstep_capture(self, request):
            seen["capture"] = request.backend
            raise Stop

        @hookimpl(tryfirst=True)
        def lockstep_replay(self, request):
            seen["replay"] = request.backend
            raise Stop

        @hookimpl(tryfirst=True)
        def lockstep_train_step(self, request):
            seen["train"] = request.backend
            raise Stop

    pm = manager()
    pm.register(Recorder())
    ladder = Q.Ladder(pm, _tiny(tmp_path), tmp_path / "q", backend="cuda")
    monkeypatch.setattr(ladder, "free_device", lambda: None)  # no device to free here
    ladder.admit_halves()
    with pytest.raises(Stop):
        ladder.capture("x", adapter=None, n_prompts=1, per_prompt=1)
    with pytest.raises(Stop):
        ladder.replay(tmp_path / "trace", adapter=None)
    ladder.adapter_a_trace, ladder.adapter_a_dir = tmp_path / "trace", tmp_path / "A"
    with pytest.raises(Stop):
        ladder.training(Q.Gate("training gate"))
    assert seen == dict.fromkeys(
        ["sampler contract", "trainer contract", "capture", "replay", "train"], "cuda"
    )


def test_the_report_names_the_backend_the_device_and_every_engines_version():
    from lockstep_exact.app import report as R
    from lockstep_exact.app.qualify import Report

    engines = [
        {"role": "sampler", "engine": "vllm", "engine_version": "0.26.0", "plugin": "p",
         "plugin_version": "1", "backends": ("cuda",), "torch_version": "2.11.0"},
        {"role": "trainer", "engine": "megatron-core", "engine_version": "0.16.1", "plugin": "q",
         "plugin_version": "1", "backends": ("cpu", "cuda"), "torch_version": "2.11.0"},
    ]  # fmt: skip
    rep = Report("m", None, "f" * 64, "qwen3/bf16/cuda", engines, "cuda", "NVIDIA H200")
    text = R.table(rep)
    assert "NOT QUALIFIED: qwen3/bf16/cuda" in text
    assert "backend: cuda on NVIDIA H200" in text
    assert (
        "engines: sampler vllm 0.26.0 (torch 2.11.0); trainer megatron-core 0.16.1 (torch 2.11.0)"
        in text
    )
    page = R.render_html(rep.as_json())
    assert "backend <b>cuda</b> on NVIDIA H200" in page
    assert "megatron-core 0.16.1 (plugin q 1, torch 2.11.0, backends cpu,cuda)" in page


def test_the_trainer_refuses_a_backend_it_cannot_train_on_by_name(tmp_path):
    from lockstep_exact.requests import TrainRequest
    from lockstep_megatron.plugin import lockstep_engine_info
    from lockstep_megatron.run import train

    req = TrainRequest(tmp_path / "model", tmp_path / "trace", None, tmp_path / "B")
    with pytest.raises(NotImplementedError, match="trains on cpu or cuda, not 'rocm'"):
        train(replace(req, backend="rocm"))
    info = lockstep_engine_info()
    assert info.torch_version == torch.__version__
    if torch.cuda.is_available():
        assert info.backends == ("cpu", "cuda")
        return
    assert info.backends == ("cpu",)
    with pytest.raises(NotImplementedError, match="training on cuda: no CUDA device here"):
        train(replace(req, backend="cuda"))  # refused before the trace or model is read


def test_the_training_step_is_deterministic_on_cuda_and_unchanged_on_cpu(monkeypatch):
    """``session.deterministic``: torch's deterministic algorithms on a cuda device only, the
    caller's cuBLAS workspace kept, the previous setting back afterwards (no device needed)."""
    from lockstep_megatron.session import deterministic

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    was = torch.are_deterministic_algorithms_enabled()
    with deterministic(torch.device("cpu")):
        assert torch.are_deterministic_algorithms_enabled() == was
    with deterministic(torch.device("cuda")):
        assert torch.are_deterministic_algorithms_enabled()
    assert torch.are_deterministic_algorithms_enabled() == was
    assert torch.is_deterministic_algorithms_warn_only_enabled() is False
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_a_failed_gate_on_cuda_says_its_first_divergence_search_was_not_run(tmp_path, monkeypatch):
    from lockstep_exact.app import qualify as Q
    from lockstep_exact.model import ModelDir
    from lockstep_exact.plugins import manager

    cpu_contract = ModelDir.contract
    monkeypatch.setattr(Q, "check_backend", lambda *args: None)
    monkeypatch.setattr(ModelDir, "contract", lambda self, backend="cpu": cpu_contract(self))
    ladder = Q.Ladder(manager(), _tiny(tmp_path), tmp_path / "q", backend="cuda")
    ladder._last = (tmp_path / "03-adapter-A", None)
    gate = Q.Gate("adapter A join", error="AdmissionError: model hash")
    ladder._bisect(gate)
    assert gate.bisect == {
        "error": "the first-divergence search dumps op sites on cpu only; not run for this cuda "
        "ladder (decision 0 of 03-adapter-A)"
    }
