"""Traces: round trip, atomic save, and refusal of every kind of damage."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from lockstep_exact.hashing import sha256_bytes, tensor_sha256
from lockstep_exact.trace import (
    FORMAT_VERSION,
    MANIFEST,
    PAYLOAD,
    Decision,
    SamplingSettings,
    Trace,
    TraceError,
)

FP = "c" * 64
MODEL = "m" * 64


def _trace(**kw) -> Trace:
    args = dict(
        prompts=[[5, 6, 7], [8], [9, 10]],
        sampled=[[11, 12], [13, 14, 15], []],
        logprobs=[
            torch.tensor([-0.5, -1.25], dtype=torch.float32),
            torch.tensor([-2.0, -0.0, -7.123456], dtype=torch.float32),
            torch.zeros(0, dtype=torch.float32),
        ],
        contract_fingerprint=FP,
        model_hash=MODEL,
        adapter_hash=None,
        sampling=SamplingSettings(
            temperature=0.7, top_p=0.9, seed=42, rule="sample.gumbel_topp@1{rounds=3}"
        ),
        engine={"name": "vllm", "version": "0.x", "plugin": "lockstep-serving"},
        prompt_texts=["a b c", "d", "e f"],
    )
    args.update(kw)
    return Trace.from_sequences(**args)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.fixture
def saved(tmp_path):
    return _trace().save(tmp_path / "trace")


def _rewrite_payload(path, mutate) -> None:
    """Change the payload tensors and re-record every hash, so only the content check remains."""
    tensors = st_load((path / PAYLOAD).read_bytes())
    mutate(tensors)
    data = st_save(tensors)
    (path / PAYLOAD).write_bytes(data)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["payload"]["sha256"] = sha256_bytes(data)
    for name, t in tensors.items():
        rec = manifest["payload"]["tensors"].setdefault(name, {})
        rec.update(
            dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape), sha256=tensor_sha256(t)
        )
    (path / MANIFEST).write_text(json.dumps(manifest))


def _edit_manifest(path, edit) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    edit(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


# ----------------------------------------------------------------------------- round trip


def test_trace_round_trips_every_field_and_the_raw_logprob_bytes(saved):
    original = _trace()
    loaded = Trace.load(saved)
    for name, t in original.tensors().items():
        assert loaded.tensors()[name].dtype == t.dtype
        assert torch.equal(loaded.tensors()[name].view(torch.uint8), t.view(torch.uint8)), name
    # -0.0 survives as -0.0 (a value comparison would not notice).
    assert _bits(loaded.logprobs)[3].item() == _bits(torch.tensor([-0.0]))[0].item()
    assert loaded.contract_fingerprint == FP and loaded.model_hash == MODEL
    assert loaded.adapter_hash is None
    assert loaded.sampling == SamplingSettings(0.7, 0.9, 42, rule="sample.gumbel_topp@1{rounds=3}")
    assert loaded.engine["name"] == "vllm"
    assert loaded.prompt_texts == ["a b c", "d", "e f"]
    assert loaded.created == original.created or loaded.created.endswith("Z")


def test_manifest_records_payload_and_per_tensor_sha256(saved):
    manifest = json.loads((saved / MANIFEST).read_text())
    assert manifest["format"] == "lockstep.trace"
    assert manifest["format_version"] == FORMAT_VERSION
    assert manifest["payload"]["sha256"] == sha256_bytes((saved / PAYLOAD).read_bytes())
    tensors = st_load((saved / PAYLOAD).read_bytes())
    for name, t in tensors.items():
        assert manifest["payload"]["tensors"][name]["sha256"] == tensor_sha256(t)
    assert manifest["payload"]["tensors"]["logprobs"]["dtype"] == "float32"
    assert (manifest["num_sequences"], manifest["num_decisions"]) == (3, 5)


def test_decisions_yield_sequence_step_position_token_and_logprob():
    trace = _trace()
    decisions = list(trace.decisions())
    assert trace.num_decisions == len(decisions) == 5
    assert trace.num_sequences == 3
    assert tuple(decisions[0]) == (0, 0, 3, 11, -0.5)
    assert tuple(decisions[1]) == (0, 1, 4, 12, -1.25)
    seq, step, pos, tok, lp = decisions[4]
    assert (seq, step, pos, tok) == (1, 2, 3, 15)
    assert lp == torch.tensor(-7.123456, dtype=torch.float32).item()  # the float32 value exactly
    assert isinstance(decisions[0], Decision)
    assert torch.equal(trace.prompt(2), torch.tensor([9, 10]))
    assert torch.equal(trace.sampled(1), torch.tensor([13, 14, 15]))
    assert trace.sampled(2).numel() == 0


def test_a_sequence_without_decisions_is_kept_beside_others():
    trace = _trace()
    assert trace.sampled(2).numel() == 0 and trace.num_decisions == 5


NO_DECISIONS_MSG = re.escape(
    "the trace has no decisions (no sampled tokens): there is nothing to replay"
)


@pytest.mark.parametrize(
    "prompts, sampled", [([], []), ([[5, 6]], [[]]), ([[5], [6, 7]], [[], []])]
)
def test_a_trace_without_decisions_is_refused_when_built(prompts, sampled):
    logprobs = [torch.zeros(0, dtype=torch.float32) for _ in sampled]
    with pytest.raises(TraceError, match=NO_DECISIONS_MSG):
        Trace.from_sequences(prompts, sampled, logprobs, contract_fingerprint=FP, model_hash=MODEL)


def test_a_trace_without_decisions_is_refused_when_saved(tmp_path):
    trace = _trace()
    object.__setattr__(trace, "sampled_tokens", torch.zeros(0, dtype=torch.int64))
    with pytest.raises(TraceError, match="refusing to save: " + NO_DECISIONS_MSG):
        trace.save(tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_a_trace_without_decisions_is_refused_when_loaded(saved):
    def drop_decisions(tensors):
        tensors["sampled_tokens"] = torch.zeros(0, dtype=torch.int64)
        tensors["sampled_offsets"] = torch.zeros(4, dtype=torch.int64)
        tensors["logprobs"] = torch.zeros(0, dtype=torch.float32)

    _rewrite_payload(saved, drop_decisions)
    _edit_manifest(saved, lambda m: m.update(num_decisions=0))
    with pytest.raises(TraceError, match=re.escape(f"{saved}: ") + NO_DECISIONS_MSG):
        Trace.load(saved)


# ----------------------------------------------------------------------------- atomic save


def test_save_refuses_an_existing_directory_unless_overwrite(saved):
    with pytest.raises(FileExistsError):
        _trace().save(saved)
    other = _trace(adapter_hash="a" * 64)
    other.save(saved, overwrite=True)
    assert Trace.load(saved).adapter_hash == "a" * 64
    assert sorted(os.listdir(saved)) == [MANIFEST, PAYLOAD]
    assert [p for p in os.listdir(saved.parent) if p.startswith(".")] == []  # no temp left


def test_a_failed_save_leaves_no_partial_trace(tmp_path, monkeypatch):
    import lockstep_exact.atomic as atomic_mod

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(atomic_mod, "fsync_dir", boom)
    with pytest.raises(OSError, match="disk full"):
        _trace().save(tmp_path / "t")
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- refusals


def test_corrupted_trace_payload_is_refused(saved):
    data = bytearray((saved / PAYLOAD).read_bytes())
    data[-3] ^= 0x01  # one bit of the last logprob
    (saved / PAYLOAD).write_bytes(bytes(data))
    with pytest.raises(TraceError, match="does not match its recorded sha256: corrupted"):
        Trace.load(saved)


def test_truncated_trace_payload_is_refused(saved):
    data = (saved / PAYLOAD).read_bytes()
    (saved / PAYLOAD).write_bytes(data[:-4])
    with pytest.raises(TraceError, match="corrupted or truncated"):
        Trace.load(saved)


def test_a_one_ulp_change_in_a_logprob_is_caught_by_its_tensor_sha(saved):
    def bump(t):
        t["logprobs"].view(torch.int32)[0] += 1

    before = json.loads((saved / MANIFEST).read_text())["payload"]["tensors"]["logprobs"]
    _rewrite_payload(saved, bump)
    assert Trace.load(saved).logprobs[0].item() != -0.5  # consistent after re-recording ...

    def restore_old_sha(m):
        m["payload"]["tensors"]["logprobs"] = before

    _edit_manifest(saved, restore_old_sha)
    with pytest.raises(TraceError, match="logprobs does not match its recorded sha256"):
        Trace.load(saved)  # ... and the old per-tensor sha no longer matches


def test_per_tensor_sha_mismatch_is_refused(saved):
    def swap(m):
        m["payload"]["tensors"]["prompt_tokens"]["sha256"] = "0" * 64

    _edit_manifest(saved, swap)
    with pytest.raises(TraceError, match="prompt_tokens does not match its recorded sha256"):
        Trace.load(saved)


def test_logprobs_that_are_not_float32_are_refused(saved, tmp_path):
    _rewrite_payload(saved, lambda t: t.update(logprobs=t["logprobs"].to(torch.float64)))
    with pytest.raises(TraceError, match="logprobs has dtype torch.float64.*float32"):
        Trace.load(saved)
    with pytest.raises(TraceError, match="must be float32"):
        _trace(logprobs=[torch.tensor([-0.5, -1.0], dtype=torch.bfloat16), [-1.0] * 3, []])


def test_nan_logprob_is_refused(saved):
    _rewrite_payload(saved, lambda t: t["logprobs"].__setitem__(2, float("nan")))
    with pytest.raises(TraceError, match=r"logprobs\[2\] is nan"):
        Trace.load(saved)
    with pytest.raises(TraceError, match="NaN"):
        _trace(logprobs=[[-0.5, float("nan")], [-1.0] * 3, []])


def test_offsets_inconsistent_with_lengths_are_refused(saved, tmp_path):
    _rewrite_payload(saved, lambda t: t["sampled_offsets"].__setitem__(slice(2, None), 4))
    with pytest.raises(TraceError, match="sampled_offsets ends at 4 but there are 5 tokens"):
        Trace.load(saved)
    other = _trace().save(tmp_path / "other")
    _rewrite_payload(other, lambda t: t.update(prompt_offsets=torch.tensor([0, 4, 3, 6])))
    with pytest.raises(TraceError, match="prompt_offsets decreases at index 2"):
        Trace.load(other)


def test_a_logprob_count_that_differs_from_the_sampled_count_is_refused():
    with pytest.raises(TraceError, match="sequence 0: 2 sampled tokens but 1 logprobs"):
        _trace(logprobs=[[-0.5], [-1.0] * 3, []])


def test_missing_files_are_refused(saved, tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        Trace.load(tmp_path / "nowhere")
    (saved / PAYLOAD).unlink()
    with pytest.raises(TraceError, match=f"{PAYLOAD} is missing"):
        Trace.load(saved)
    (saved / MANIFEST).unlink()
    with pytest.raises(TraceError, match=f"{MANIFEST} is missing"):
        Trace.load(saved)


def test_bad_json_is_refused(saved):
    (saved / MANIFEST).write_text('{"format": "lockstep.trace", ')
    with pytest.raises(TraceError, match="not valid JSON"):
        Trace.load(saved)


@pytest.mark.parametrize("version", [0, 2, "1", True, None])
def test_wrong_format_version_is_refused(saved, version):
    _edit_manifest(saved, lambda m: m.update(format_version=version))
    with pytest.raises(TraceError, match="unsupported trace format_version"):
        Trace.load(saved)


def test_wrong_format_name_and_missing_keys_are_refused(saved):
    _edit_manifest(saved, lambda m: m.update(format="something.else"))
    with pytest.raises(TraceError, match="format is 'something.else'"):
        Trace.load(saved)
    _edit_manifest(saved, lambda m: (m.update(format="lockstep.trace"), m.pop("model_hash")))
    with pytest.raises(TraceError, match="lacks the key 'model_hash'"):
        Trace.load(saved)


def test_an_extra_or_missing_payload_tensor_is_refused(saved, tmp_path):
    _rewrite_payload(saved, lambda t: t.update(extra=torch.zeros(1)))
    with pytest.raises(TraceError, match="unexpected tensor"):
        Trace.load(saved)
    other = _trace().save(tmp_path / "other")
    _rewrite_payload(other, lambda t: t.pop("logprobs"))
    with pytest.raises(TraceError):
        Trace.load(other)


def test_negative_token_ids_are_refused():
    with pytest.raises(TraceError, match="negative token id"):
        _trace(prompts=[[5, -1, 7], [8], [9, 10]])


def test_python_float_logprobs_that_float32_would_round_are_refused():
    with pytest.raises(TraceError, match=r"logprobs\[0\]\[1\] = -0.1 is not a float32 value"):
        _trace(logprobs=[[-0.5, -0.1], [-1.0] * 3, []])
    exact = torch.tensor([-0.1], dtype=torch.float32).item()  # a float32 value as a Python float
    assert _trace(logprobs=[[-0.5, exact], [-1.0] * 3, []]).logprobs[1].item() == exact


def test_trace_sha256_covers_content_and_survives_a_round_trip(saved):
    original = _trace()
    assert Trace.load(saved).sha256() == original.sha256()
    assert _trace(created="2000-01-01T00:00:00Z").sha256() == original.sha256()
    assert _trace(adapter_hash="a" * 64).sha256() != original.sha256()
    nudged = [
        torch.tensor([-0.5, -1.25], dtype=torch.float32),
        torch.tensor([-2.0, -0.0, -7.123456], dtype=torch.float32),
        torch.zeros(0, dtype=torch.float32),
    ]
    nudged[0].view(torch.int32)[0] += 1  # one ulp in one logprob
    assert _trace(logprobs=nudged).sha256() != original.sha256()
