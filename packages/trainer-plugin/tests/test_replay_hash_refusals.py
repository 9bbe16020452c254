"""Replay's model-hash and adapter-hash refusals say what to do and name the command that
prints the hashes they compare (``lockstep contract show``), and where the trace's are."""

from __future__ import annotations

import re

import pytest
from trainer_support import make_model, reference_trace

from lockstep_exact.adapters import make_adapter
from lockstep_exact.app.cli import main
from lockstep_exact.trace import Trace
from lockstep_megatron.replay import AdmissionError, admit_trace


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("hashes")
    model = make_model(root / "m", "qwen3")
    other = make_model(root / "other", "qwen3", seed=1)
    adapter = make_adapter(model, root / "adapter", rank=4)
    trace = reference_trace(model, root / "trace", adapter_dir=adapter)
    return model, other, adapter, Trace.load(trace)


def test_an_adapter_other_than_the_traces_is_refused_naming_the_command(setup, capsys):
    model, _, adapter, trace = setup
    with pytest.raises(AdmissionError) as err:
        admit_trace(trace, model, None)
    msg = str(err.value)
    assert f"sampled with adapter {trace.adapter_hash}, the trainer has None" in msg
    assert "replay with the adapter the trace was captured with" in msg
    assert "adapter_hash in its manifest.json" in msg
    argv = re.search(r"`lockstep contract show ([^`]*)`", msg).group(1).split()
    assert argv == ["--model", str(model), "--adapter", "DIR"]
    assert main(["contract", "show", "--model", str(model), "--adapter", str(adapter)]) == 0
    assert f"adapter hash {trace.adapter_hash}\n" in capsys.readouterr().out


def test_another_model_is_refused_naming_the_command(setup, capsys):
    _, other, adapter, trace = setup
    with pytest.raises(AdmissionError) as err:
        admit_trace(trace, other, adapter)
    msg = str(err.value)
    this = re.search(r"hashes to (\w+)", msg).group(1)
    assert "replay with the model the trace was captured from" in msg
    assert "`lockstep contract show --model DIR --model-hash`" in msg
    assert "model_hash in its manifest.json" in msg
    assert main(["contract", "show", "--model", str(other), "--model-hash"]) == 0
    assert f"model hash   {this}\n" in capsys.readouterr().out
