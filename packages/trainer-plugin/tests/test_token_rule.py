"""Replay's token check: the trace's sampling rule recomputed on rows, refusals named."""

from __future__ import annotations

import json

import pytest
import torch

from lockstep_exact import programs as P
from lockstep_exact.contract import Contract
from lockstep_exact.lanes.ops import Ops
from lockstep_exact.trace import MANIFEST, TEACHER_FORCED, SamplingSettings, Trace, TraceError
from lockstep_megatron.replay import TokenMismatch
from lockstep_megatron.replay import TokenRule as _TokenRule

RULE = "sample.gumbel_topp@1{rounds=3}"
# A contract whose sample site is the rule: the trainer reads its rule from its contract.
OPS = Ops(Contract("t", "bf16", "cpu", {}, {}, {"sample": P.Program.of("sample.gumbel_topp")}))


def TokenRule(trace):  # noqa: N802 (reads like the class under test)
    return _TokenRule(trace, OPS)


def _trace(sampling: SamplingSettings) -> Trace:
    return Trace.from_sequences(
        [[1, 2, 3], [4, 5]],
        [[6, 7], [8]],
        [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])],
        contract_fingerprint="sha256:" + "0" * 64,
        model_hash="m" * 64,
        sampling=sampling,
    )


def _rows(n: int, v: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(n)
    return P.log_softmax(torch.randn(n, v, generator=g) * 2)


def test_a_teacher_forced_reference_has_no_draw_to_check():
    assert not TokenRule(_trace(SamplingSettings(1.0, 1.0, 0, rule=TEACHER_FORCED)))


def test_a_trace_naming_no_rule_is_refused_when_built_and_when_loaded(tmp_path):
    with pytest.raises(TraceError, match="names no sampling rule"):
        _trace(SamplingSettings(1.0, 1.0, 0))
    # A manifest written without the rule (an older trace, or one made by hand): refused on
    # load, naming the field, not replayed with its tokens unchecked.
    path = _trace(SamplingSettings(1.0, 1.0, 0, rule=RULE, seeds=(1, 2))).save(tmp_path / "t")
    manifest = json.loads((path / MANIFEST).read_text())
    del manifest["sampling"]["rule"]
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(TraceError, match="names no sampling rule"):
        Trace.load(path)


def test_a_trace_drawn_by_another_rule_is_refused():
    other = SamplingSettings(1.0, 1.0, 0, seeds=(1, 2), rule="sample.gumbel_topp@1{rounds=2}")
    with pytest.raises(TokenMismatch, match=r"drawn by sample.gumbel_topp@1\{rounds=2\}; this"):
        TokenRule(_trace(other))


def test_a_random_trace_without_per_sequence_seeds_is_refused():
    with pytest.raises(TokenMismatch, match="records no per-sequence seeds"):
        TokenRule(_trace(SamplingSettings(1.0, 1.0, 0, rule=RULE)))


def test_the_rules_draws_pass_and_a_changed_token_is_named():
    rule = TokenRule(_trace(SamplingSettings(0.8, 0.9, 5, seeds=(5, 6), rule=RULE)))
    rows = _rows(4)
    drawn = P.sample(rows, temperature=0.8, top_p=0.9, seeds=[6] * 4, positions=[7, 8, 9, 10])
    rule.check(1, rows, drawn, 7)
    forged = drawn.clone()
    forged[2] = (forged[2] + 1) % 64
    with pytest.raises(TokenMismatch) as err:
        rule.check(1, rows, forged, 7)
    assert str(err.value).startswith(
        f"sampled token: sequence 1, position 9 (step 2): the trace has token {int(forged[2])} "
        f"but {RULE} draws {int(drawn[2])} (seed 6, temperature 0.8, top_p 0.9)"
    )


def test_a_greedy_trace_needs_no_seeds_and_checks_the_argmax():
    rule = TokenRule(_trace(SamplingSettings(0.0, 1.0, None, rule=RULE)))
    rows = _rows(3)
    rule.check(0, rows, rows.argmax(-1), 3)
    with pytest.raises(TokenMismatch, match="sequence 0, position 3 \\(step 0\\)"):
        rule.check(0, rows, (rows.argmax(-1) + 1) % 64, 3)
