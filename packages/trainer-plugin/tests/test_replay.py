"""Replay: every decision of a trace recomputed in Megatron, byte for byte; admission first."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from trainer_support import nudge_one_ulp, reference_trace

from lockstep_exact.k3 import compare
from lockstep_exact.plugins import manager
from lockstep_exact.requests import ReplayRequest
from lockstep_exact.trace import MANIFEST, TEACHER_FORCED, SamplingSettings, Trace, TraceError
from lockstep_megatron import plugin
from lockstep_megatron.replay import AdmissionError, replay


@pytest.mark.parametrize("micro_batch", [3, 7])
def test_replay_reproduces_every_decision_byte_for_byte_dense(dense_dir, dense_trace, micro_batch):
    lps, _ = replay(dense_dir, dense_trace, micro_batch=micro_batch)
    trace = Trace.load(dense_trace)
    cmp = compare(trace.logprobs, lps)
    assert cmp.byte_equal == cmp.n == trace.num_decisions and cmp.k3_max == 0.0


def test_replay_reproduces_every_decision_byte_for_byte_moe(moe_dir, moe_trace):
    lps, _ = replay(moe_dir, moe_trace, micro_batch=2)
    cmp = compare(Trace.load(moe_trace).logprobs, lps)
    assert cmp.byte_equal == cmp.n and cmp.k3_max == 0.0


def nudged_and_forged(model_dir, trace_dir, tmp_path):
    """The input control of a replay: a copy of the model with ``lm_head.weight[0]`` one bf16
    ulp off, and the trace's bytes (from the original model) admitted against that copy."""
    from lockstep_exact.model import model_hash as dir_hash

    nudged = nudge_one_ulp(model_dir, tmp_path / "nudged")
    original = Trace.load(trace_dir)
    forged = Trace.from_sequences(
        [original.prompt(i) for i in range(original.num_sequences)],
        [original.sampled(i) for i in range(original.num_sequences)],
        [original.sequence_logprobs(i) for i in range(original.num_sequences)],
        contract_fingerprint=original.contract_fingerprint,
        model_hash=dir_hash(nudged),
        sampling=SamplingSettings(rule=TEACHER_FORCED),
    ).save(tmp_path / "trace")
    return nudged, forged


def test_replay_through_the_plugin_hook(dense_dir, dense_trace, tmp_path):
    pm = manager(load_entry_points=False)
    pm.register(plugin)
    result = pm.hook.lockstep_replay(
        request=ReplayRequest(model_dir=dense_dir, trace_dir=dense_trace, micro_batch=4)
    )
    assert torch.equal(result.logprobs, Trace.load(dense_trace).logprobs)
    assert result.engine.startswith("megatron-core")
    # input control: through the same hook, the one-ulp copy parts from the trace's bytes
    nudged, forged = nudged_and_forged(dense_dir, dense_trace, tmp_path)
    moved = pm.hook.lockstep_replay(
        request=ReplayRequest(model_dir=nudged, trace_dir=forged, micro_batch=4)
    )
    assert not torch.equal(moved.logprobs, Trace.load(dense_trace).logprobs)


@pytest.mark.parametrize("arch", ["dense", "moe"])
def test_one_ulp_model_change_reports_the_first_differing_decision(arch, tmp_path, request):
    """The input control of the two byte-for-byte replays above (same model, same trace)."""
    model_dir = request.getfixturevalue(f"{arch}_dir")
    trace_dir = request.getfixturevalue(f"{arch}_trace")
    nudged, forged = nudged_and_forged(model_dir, trace_dir, tmp_path)
    lps, _ = replay(nudged, forged, micro_batch=2)
    cmp = compare(Trace.load(trace_dir).logprobs, lps)
    assert cmp.byte_equal < cmp.n and cmp.first_diff is not None


def test_replay_refuses_a_trace_from_another_model(dense_dir, dense_trace, tmp_path):
    nudged = nudge_one_ulp(dense_dir, tmp_path / "nudged")
    with pytest.raises(AdmissionError, match="model hash"):
        replay(nudged, dense_trace)


def test_replay_refuses_a_trace_of_another_contract(dense_dir, moe_dir, moe_trace, tmp_path):
    with pytest.raises(AdmissionError, match="contract fingerprint"):
        replay(dense_dir, moe_trace)


def test_replay_refuses_a_trace_sampled_with_another_adapter(dense_dir, dense_trace, tmp_path):
    data = json.loads((dense_trace / "manifest.json").read_text())
    data["adapter_hash"] = "0" * 64
    bad = tmp_path / "trace"
    bad.mkdir()
    (bad / "payload.safetensors").write_bytes((dense_trace / "payload.safetensors").read_bytes())
    (bad / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(AdmissionError, match="adapter hash"):
        replay(dense_dir, bad)


def test_replay_refuses_a_corrupted_trace(dense_dir, dense_trace, tmp_path):
    bad = tmp_path / "trace"
    bad.mkdir()
    payload = bytearray((dense_trace / "payload.safetensors").read_bytes())
    payload[-1] ^= 1
    (bad / "payload.safetensors").write_bytes(bytes(payload))
    (bad / "manifest.json").write_text((dense_trace / "manifest.json").read_text())
    with pytest.raises(TraceError):
        replay(dense_dir, bad)


def test_reference_trace_helper_is_deterministic(dense_dir, tmp_path):
    a = reference_trace(dense_dir, tmp_path / "a")
    b = reference_trace(dense_dir, tmp_path / "b")
    assert torch.equal(Trace.load(a).logprobs, Trace.load(b).logprobs)
    # input control: the same helper on a one-ulp copy of the model gives other bytes
    c = reference_trace(nudge_one_ulp(dense_dir, tmp_path / "nudged"), tmp_path / "c")
    assert not torch.equal(Trace.load(c).logprobs, Trace.load(a).logprobs)


def test_lockstep_replay_cli_reports_every_decision_exact(dense_dir, dense_trace, tmp_path):
    from lockstep_exact.app.cli import main

    rc = main(
        [
            "replay",
            "--model",
            str(dense_dir),
            "--trace",
            str(dense_trace),
            "--out",
            str(tmp_path / "r.json"),
        ]
    )
    report = json.loads((tmp_path / "r.json").read_text())
    assert rc == 0 and report["byte_equal"] == report["decisions"] == 50
    assert report["k3_max"] == 0.0 and report["first_difference"] is None
    # input control: the CLI on the one-ulp copy (the trace admitted against it) says so
    nudged, forged = nudged_and_forged(dense_dir, dense_trace, tmp_path)
    args = ["replay", "--model", str(nudged), "--trace", str(forged)]
    assert main([*args, "--out", str(tmp_path / "moved.json")]) == 1
    moved = json.loads((tmp_path / "moved.json").read_text())
    assert moved["byte_equal"] < moved["decisions"] == 50
    assert moved["first_difference"] is not None


def test_a_trainer_call_behind_the_contracts_back_is_refused_naming_the_site(
    dense_dir, dense_trace, monkeypatch
):
    """The trainer's fingerprint is what it ran in its probe forward, not what it declares."""
    from lockstep_exact.lanes.ops import Ops, site_key
    from lockstep_exact.programs import Program
    from lockstep_megatron.spec import LockstepGPT

    class Skewed(Ops):
        def program(self, path, expect):
            if site_key(path) == "layers.*.mlp.down_proj":
                return Program.of("gemm.kblock", bk=64, out="bf16")
            return super().program(path, expect)

    honest = LockstepGPT.ops

    def skewed(self, device):
        ops = honest(self, device)
        if not isinstance(ops, Skewed):
            ops = self._ops[torch.device(device).type] = Skewed(ops.contract, grad=True)
        return ops

    monkeypatch.setattr(LockstepGPT, "ops", skewed)
    with pytest.raises(AdmissionError, match=r"bk=64.*'layers\.\*\.mlp\.down_proj'.*bk=32"):
        replay(dense_dir, dense_trace)
    monkeypatch.undo()
    lps, _ = replay(dense_dir, dense_trace)  # the control: the honest trainer is admitted
    assert torch.equal(lps, Trace.load(dense_trace).logprobs)


def test_a_trace_whose_sampler_ran_another_program_is_refused_naming_the_site(
    dense_dir, dense_trace, tmp_path
):
    from lockstep_exact.contract import contract_from_json

    original = Trace.load(dense_trace)
    data = dict(original.contract)
    data["sites"] = {
        **data["sites"],
        "layers.*.self_attn.core": "attention.blocked@3{block=64,segment=512}",
    }
    skewed = contract_from_json(data)
    forged = Trace.from_sequences(
        [original.prompt(i) for i in range(original.num_sequences)],
        [original.sampled(i) for i in range(original.num_sequences)],
        [original.sequence_logprobs(i) for i in range(original.num_sequences)],
        contract_fingerprint=skewed.fingerprint,
        contract=skewed.to_json(),
        model_hash=original.model_hash,
        sampling=SamplingSettings(rule=TEACHER_FORCED),
    ).save(tmp_path / "trace")
    with pytest.raises(AdmissionError, match=r"block=64.*'layers\.\*\.self_attn\.core'"):
        replay(dense_dir, forged)


def _with_contract(original, contract_json, tmp_path):
    return Trace.from_sequences(
        [original.prompt(i) for i in range(original.num_sequences)],
        [original.sampled(i) for i in range(original.num_sequences)],
        [original.sequence_logprobs(i) for i in range(original.num_sequences)],
        contract_fingerprint=original.contract_fingerprint,
        contract=contract_json,
        model_hash=original.model_hash,
        sampling=original.sampling,
    ).save(tmp_path / "trace")


def test_replay_refuses_a_trace_whose_site_ran_a_kernel_no_test_gates(
    dense_dir, dense_trace, tmp_path
):
    """The sampler's record says one site ran a kernel its program has no gate for (here the
    attention kernel at a projection); the fingerprint is unchanged, so only the kernel record
    can refuse it. The unedited record replays (the first call)."""
    original = Trace.load(dense_trace)
    lps, _ = replay(dense_dir, _with_contract(original, original.contract, tmp_path / "a"))
    assert torch.equal(lps, original.logprobs)
    data = json.loads(json.dumps(original.contract))
    data["kernels"]["layers.*.self_attn.q_proj"].append("cpu.attention")
    forged = _with_contract(original, data, tmp_path / "b")
    with pytest.raises(
        AdmissionError, match=r"kernels: the sampler: op site 'layers\.\*\.self_attn\.q_proj'"
    ):
        replay(dense_dir, forged)


def test_a_trace_without_a_kernel_record_is_refused_by_name(dense_trace, tmp_path):
    original = Trace.load(dense_trace)
    data = dict(original.contract)
    del data["kernels"]
    with pytest.raises(TraceError, match="no kernel record"):
        _with_contract(original, data, tmp_path)
    # and on load: the same trace's manifest with the record taken out
    manifest = json.loads((dense_trace / MANIFEST).read_text())
    del manifest["contract"]["kernels"]
    edited = tmp_path / "edited"
    shutil.copytree(dense_trace, edited)
    (edited / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(TraceError, match="no kernel record"):
        Trace.load(edited)


@pytest.mark.parametrize("field", ["prompt_tokens", "sampled_tokens"])
def test_replay_refuses_a_token_id_past_the_vocabulary(dense_dir, dense_trace, tmp_path, field):
    import dataclasses

    from lockstep_exact.lanes.qwen3 import Geometry

    original = Trace.load(dense_trace)
    vocab = Geometry.from_model_dir(dense_dir).vocab
    ids = getattr(original, field).clone()
    ids[1] = vocab  # a consistent, hashed trace with an id the embedding has no row for
    forged = dataclasses.replace(original, **{field: ids}).save(tmp_path / "trace")
    with pytest.raises(
        AdmissionError,
        match=rf"{field}\[1\] = {vocab} is past the model's vocabulary \({vocab} ids\): the "
        "trace was edited or made for another model",
    ):
        replay(dense_dir, forged)
