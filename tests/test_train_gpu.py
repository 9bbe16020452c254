"""``lockstep train --backend cuda`` on one GPU: vLLM 0.26 samples (held to
``--sampler-memory`` of the device), Megatron on cuda recomputes and steps, exact at every step.

Run on the GPU machine with ``pytest -m gpu`` (skipped elsewhere by the repository conftest).
What is asserted, each on raw bytes: GRPO, SFT and OPD replay every step's decisions
byte-equal in the trainer (K3 = 0); a run stopped after step 2 and resumed gives the
uninterrupted run's adapters, AdamW state and log-probabilities byte for byte; a LoRA factor
moved by 2^-9 in the trainer stops the run before any update (the stop's control). The hybrid
lane (Qwen3-Next) on cuda: GRPO exact at every step and the same control.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

SMALL = dict(group=2, prompts=2, decisions=4, backend="cuda", sampler_memory=0.3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from lockstep_exact.app.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny") / "qwen3", arch="qwen3", seed=0)


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _exact_every_step(rows):
    assert rows
    for r in rows:
        assert r["decisions"] == r["equal"] > 0 and r["k3_max"] == 0.0, r


class Quiet:
    def say(self, *_):
        pass

    start = step = close = say


def _run(model, out, *, pm=None, resume=False, **config):
    from lockstep_exact.app.train_loop import TrainConfig, run_train
    from lockstep_exact.plugins import manager

    assert torch.cuda.is_available(), "a GPU test needs a CUDA device"
    return run_train(
        pm or manager(), model, out, TrainConfig(**config), progress=Quiet(), resume=resume
    )


def test_grpo_on_cuda_is_exact_at_every_step_and_resumes_byte_identically(tiny, tmp_path):
    from safetensors.torch import load_file

    from lockstep_exact.hashing import sha256_file, tensor_sha256
    from lockstep_exact.trace import Trace

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    _exact_every_step(_run(tiny, whole, steps=3, **SMALL))
    _run(tiny, parts, steps=2, **SMALL)
    _run(tiny, parts, steps=3, resume=True, **SMALL)
    step = 3
    for out in (whole, parts):
        assert (out / "checkpoints" / f"step-{step:04d}").is_dir()

    def files(out):
        adapter = out / "adapters" / f"step-{step:04d}"
        tensors = load_file(str(adapter / "adapter_model.safetensors"))
        ckpt = out / "checkpoints" / f"step-{step:04d}"
        return (
            {k: tensor_sha256(v) for k, v in tensors.items()},
            sha256_file(ckpt / "adapters.safetensors"),
            sha256_file(ckpt / "optimizer.safetensors"),
            Trace.load(out / "traces" / f"step-{step:04d}").sha256(),
        )

    assert files(whole) == files(parts)
    _exact_every_step(_rows(parts))
    assert json.loads((whole / "run.json").read_text())["setting.backend"] == "cuda"


def test_sft_and_opd_on_cuda_are_exact_at_every_step(tiny, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"p{i}", "completion": " a b c d"}) + "\n" for i in range(4))
    )
    _exact_every_step(_run(tiny, tmp_path / "sft", steps=2, algo="sft", data=str(data), **SMALL))
    _exact_every_step(_run(tiny, tmp_path / "opd", steps=2, algo="opd", teacher=str(tiny), **SMALL))


def test_a_moved_adapter_factor_stops_the_run_on_cuda(tiny, tmp_path):
    """The stop's control moves an input: one element of the policy's LoRA B factor by 2^-9 in
    the trainer's memory before the second trace it scores (the sampler was not given it)."""
    from train_support import AdapterMoved

    from lockstep_exact.app.train_loop import TrainStopped
    from lockstep_exact.plugins import manager

    pm = manager()
    pm.register(AdapterMoved(at=2))
    with pytest.raises(TrainStopped, match="step 2: the trainer's log-probability of decision"):
        _run(tiny, tmp_path, pm=pm, steps=3, **SMALL)
    assert not (tmp_path / "adapters" / "step-0002").exists()


def test_grpo_on_the_hybrid_lane_on_cuda_is_exact_at_every_step(tmp_path_factory, tmp_path):
    """``lockstep train --backend cuda`` on a tiny Qwen3-Next: GRPO exact at every step; the
    control: a LoRA factor moved in the trainer stops the run at step 2."""
    from train_support import AdapterMoved

    from lockstep_exact.app.tiny import make_tiny
    from lockstep_exact.app.train_loop import TrainStopped
    from lockstep_exact.plugins import manager

    model = make_tiny(tmp_path_factory.mktemp("tiny") / "next", arch="qwen3-next", seed=0)
    _exact_every_step(_run(model, tmp_path / "run", steps=2, **SMALL))
    pm = manager()
    pm.register(AdapterMoved(at=2))
    with pytest.raises(TrainStopped, match="step 2: the trainer's log-probability of decision"):
        _run(model, tmp_path / "moved", pm=pm, steps=3, **SMALL)
