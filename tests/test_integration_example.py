"""``lockstep_megatron.integration`` and the examples that use it, on a tiny Qwen3.

The train-step example runs as a user runs it (a subprocess) and its trained adapter's
logprobs check byte-equal through the rollout checker; each check has a control that changes
an input (no adapter, one weight one ulp off) and must report a difference, and a malformed
rollout file is refused by line. ``lane_logprobs`` gives replay's bytes for a trace's tokens.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_support import make_model, nudge_one_ulp, reference_trace

from lockstep_exact.trace import Trace

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(script: str, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("integ") / "dense", "qwen3")


@pytest.fixture(scope="module")
def trace(dense, tmp_path_factory) -> Path:
    """Logprobs of the reference composition (the sampler's programs, no Megatron)."""
    return reference_trace(dense, tmp_path_factory.mktemp("integ") / "trace")


def _trace_rollouts(trace_dir: Path):
    from lockstep_megatron.integration import Rollout

    t = Trace.load(trace_dir)
    return [
        Rollout(
            tuple(torch.cat([t.prompt(i), t.sampled(i)]).tolist()),
            len(t.prompt(i)),
            t.sequence_logprobs(i),
        )
        for i in range(t.num_sequences)
    ]


@pytest.mark.slow  # the fast tier's 10-minute budget; CI's --all runs it
def test_train_step_example_then_its_rollouts_check_byte_equal(dense, tmp_path, capsys):
    rollouts, adapter = tmp_path / "rollouts.jsonl", tmp_path / "adapter"
    run = _run(
        "megatron_train_step.py",
        "--model",
        dense,
        "--steps",
        2,
        "--backend",
        "cpu",
        "--dump-rollouts",
        rollouts,
        "--adapter-out",
        adapter,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [float(x.split()[-1]) for x in run.stdout.splitlines() if x.startswith("step ")]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert losses[1] != losses[0]  # the optimizer moved the adapter

    check = _example("check_rollout").main
    # The trained model's logprobs against the exported adapter loaded from disk: equal.
    assert (
        check(["--model", str(dense), "--rollouts", str(rollouts), "--adapter", str(adapter)]) == 0
    )
    assert capsys.readouterr().out.startswith("equal: ")
    # Control (an input changes: the adapter is left out): the check reports where.
    assert check(["--model", str(dense), "--rollouts", str(rollouts)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("DIFFERENT: ") and "first difference at sequence 0, position 4" in out


def test_sampler_logprobs_check_equal_and_a_one_ulp_weight_is_reported(dense, trace, tmp_path):
    from lockstep_megatron.integration import check_rollout, lane_model_provider, write_rollouts

    path = write_rollouts(tmp_path / "sampler.jsonl", _trace_rollouts(trace))
    report = check_rollout(lane_model_provider(dense)(), path)
    assert report.equal and report.first_difference is None
    assert report.byte_equal == report.decisions == Trace.load(trace).num_decisions

    # Control: the same file against a copy of the model with one weight one bf16 ulp off.
    nudged = nudge_one_ulp(dense, tmp_path / "nudged")
    report = check_rollout(lane_model_provider(nudged)(), path)
    assert not report.equal and report.byte_equal < report.decisions
    first = report.first_difference
    assert first is not None and first.sampler != first.trainer
    assert "DIFFERENT" in str(report)


def test_a_malformed_rollout_file_is_refused_by_line(dense, tmp_path):
    from lockstep_megatron.integration import RolloutFormatError, read_rollouts

    bad = tmp_path / "bad.jsonl"
    good = {"tokens": [1, 2, 3, 4], "prompt_len": 2, "logprobs": [-1.0, -2.0]}
    short = {**good, "logprobs": [-1.0]}  # one logprob for two completion tokens
    bad.write_text(json.dumps(good) + "\n" + json.dumps(short) + "\n")
    with pytest.raises(RolloutFormatError, match=r"bad\.jsonl:2: 1 logprobs for 2 completion"):
        read_rollouts(bad)
    run = _run("check_rollout.py", "--model", dense, "--rollouts", bad)
    assert run.returncode == 2 and "bad.jsonl:2: 1 logprobs for 2 completion" in run.stderr


def test_lane_logprobs_are_replays_bytes(dense, trace):
    from lockstep_megatron.integration import lane_logprobs, lane_model_provider
    from lockstep_megatron.replay import replay

    replayed, _ = replay(dense, trace, micro_batch=3)
    t = Trace.load(trace)
    seqs = [torch.cat([t.prompt(i), t.sampled(i)]) for i in range(t.num_sequences)]
    plens = [len(t.prompt(i)) for i in range(t.num_sequences)]
    model = lane_model_provider(dense)()
    with torch.no_grad():
        whole = torch.cat(lane_logprobs(model, seqs, plens))
        by_two = torch.cat(lane_logprobs(model, seqs, plens, micro_batch=2))
    assert whole.dtype == torch.float32
    assert torch.equal(whole, replayed) and torch.equal(by_two, replayed)
    assert torch.equal(whole, t.logprobs)


def test_a_gpt_model_from_lane_layer_spec_holds_the_providers_parameters(dense):
    from megatron.core.models.gpt import GPTModel

    from lockstep_megatron.integration import (
        lane_layer_spec,
        lane_model_provider,
        lane_transformer_config,
    )

    lane = lane_model_provider(dense)()
    geom = lane.geom
    own = GPTModel(
        config=lane_transformer_config(dense),
        transformer_layer_spec=lane_layer_spec(dense),
        vocab_size=geom.vocab,
        max_sequence_length=1 << 16,
        position_embedding_type="none",
        share_embeddings_and_output_weights=geom.tie_embeddings,
    )

    def shapes(m):
        return {k: tuple(v.shape) for k, v in m.state_dict().items() if "_extra_state" not in k}

    assert shapes(own) == shapes(lane.gpt)
    # Built outside LockstepGPT its layers are not wired to the lane: they do not run alone.
    with pytest.raises(AttributeError):
        own(input_ids=torch.zeros(1, 4, dtype=torch.long), position_ids=None, attention_mask=None)


def test_the_provider_refuses_pipeline_stages_and_other_backends(dense):
    from lockstep_megatron.integration import lane_model_provider

    with pytest.raises(NotImplementedError, match="pipeline"):
        lane_model_provider(dense)(pre_process=False, post_process=True)
    with pytest.raises(ValueError, match="cpu or cuda"):
        lane_model_provider(dense, backend="tpu")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
def test_which_megatron_forwards_run(arch, tmp_path, monkeypatch):
    """What docs/integration.md and the trainer README say Megatron runs in a forward: its
    wrappers, GPTModel, the embedding (whose output the lane's embed replaces) and
    TransformerBlock; never TransformerLayer's, SelfAttention's, MLP's, MoELayer's or a
    parallel linear's own forward (the lane composition runs in their place)."""
    from megatron.core.models.common.embeddings.language_model_embedding import (
        LanguageModelEmbedding,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )
    from megatron.core.transformer.attention import Attention, SelfAttention
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from lockstep_megatron.integration import lane_model_provider

    model = lane_model_provider(make_model(tmp_path / arch, arch))()
    ran: list[str] = []

    def count(cls):
        orig = cls.forward

        def forward(self, *args, **kwargs):
            ran.append(cls.__name__)
            return orig(self, *args, **kwargs)

        monkeypatch.setattr(cls, "forward", forward)

    watched = (Float16Module, GPTModel, LanguageModelEmbedding, VocabParallelEmbedding)
    watched += (TransformerBlock, TransformerLayer, Attention, SelfAttention, MLP, MoELayer)
    watched += (ColumnParallelLinear, RowParallelLinear)
    for cls in watched:
        count(cls)
    with torch.no_grad():
        model(torch.randint(0, model.geom.vocab, (2, 6)))
    assert sorted(ran) == sorted(
        [
            "Float16Module",
            "GPTModel",
            "LanguageModelEmbedding",
            "VocabParallelEmbedding",
            "TransformerBlock",
        ]
    )


def test_server_responses_are_read_as_rollouts_and_bad_ones_refused(tmp_path):
    from lockstep_megatron.integration import RolloutFormatError, read_rollouts

    good = {
        "prompt": [3, 4],
        "response": {
            "choices": [
                {
                    "logprobs": {
                        "tokens": ["token_id:9", "token_id:2"],
                        "token_logprobs": [-1.5, -0.25],
                    }
                }
            ]
        },
    }
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(good) + "\n")
    (r,) = read_rollouts(path)
    assert r.tokens == (3, 4, 9, 2) and r.prompt_len == 2
    assert r.logprobs.tolist() == [-1.5, -0.25]
    named = json.loads(json.dumps(good))
    named["response"]["choices"][0]["logprobs"]["tokens"] = ["Hello", "!"]
    path.write_text(json.dumps(named) + "\n")
    with pytest.raises(RolloutFormatError, match="return_tokens_as_token_ids"):
        read_rollouts(path)
    bare = json.loads(json.dumps(good))
    del bare["response"]["choices"][0]["logprobs"]
    path.write_text(json.dumps(bare) + "\n")
    with pytest.raises(RolloutFormatError, match='"logprobs": 0'):
        read_rollouts(path)
