"""Helpers of the cross-package tests: drive a capture and a replay through the plugins' hooks.

8 prompts of different lengths, 8 decisions each; the trainer replays in padded micro-batches
of 3, so the two engines batch differently on purpose.
"""

from __future__ import annotations

from lockstep_exact.app.tiny import default_prompts
from lockstep_exact.requests import CaptureRequest, ReplayRequest
from lockstep_exact.trace import TEACHER_FORCED, SamplingSettings, Trace


def replay(pm, model, trace_dir, adapter=None, control=False, micro_batch=3):
    return pm.hook.lockstep_replay(
        request=ReplayRequest(
            model_dir=model,
            trace_dir=trace_dir,
            adapter_dir=adapter,
            micro_batch=micro_batch,
            control=control,
        )
    ).logprobs


def capture(pm, model, out, adapter=None, seed=3, tp=1, **options):
    """``options``: engine knobs for the sampler (``block_size``, ...); ``tp``: the sampler's
    tensor-parallel size."""
    pm.hook.lockstep_capture(
        request=CaptureRequest(
            model_dir=model,
            prompts=tuple(default_prompts(8)),
            decisions=8,
            out_dir=out,
            seed=seed,
            adapter_dir=adapter,
            options=options,
            tp=tp,
        )
    )
    return Trace.load(out)


def nudged_copy(model, out, key: str, index: int = 0):
    """A copy of the model directory with one element of weight ``key`` one bf16 ulp off."""
    from safetensors.torch import load_file, save_file

    from lockstep_exact.testing import nudge_ulp

    out.mkdir()
    for f in model.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    w = load_file(str(model / "model.safetensors"))
    w[key] = nudge_ulp(w[key], index)
    save_file(w, str(out / "model.safetensors"))
    return out


def forge(trace: Trace, out, *, sampled=None, keep_rule: bool = True, **fields):
    """``trace`` saved again at ``out`` with some of its content replaced: other sampled tokens,
    another model hash, ... ``keep_rule=False`` marks it teacher-forced (no token check)."""
    n = trace.num_sequences
    return Trace.from_sequences(
        [trace.prompt(i) for i in range(n)],
        sampled if sampled is not None else [trace.sampled(i) for i in range(n)],
        [trace.sequence_logprobs(i) for i in range(n)],
        **{
            "contract_fingerprint": trace.contract_fingerprint,
            "contract": trace.contract,
            "model_hash": trace.model_hash,
            **(
                {"sampling": trace.sampling, "engine": trace.engine}
                if keep_rule
                else {"sampling": SamplingSettings(rule=TEACHER_FORCED)}
            ),
            **fields,
        },
    ).save(out)


def merged_model(model, adapter, out):
    """A copy of the model directory with the adapter's deltas merged into its bf16 weights
    (``W + scale * B @ A`` in fp32, rounded once): a teacher that is the base model fine-tuned,
    as another model directory."""
    import torch
    from safetensors.torch import load_file, save_file

    from lockstep_exact.adapters import load_adapter
    from lockstep_exact.model import ModelDir

    out.mkdir()
    for f in model.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    w = load_file(str(model / "model.safetensors"))
    for key, (a, b, scale) in load_adapter(adapter, ModelDir(model)).modules.items():
        w[key] = (w[key].float() + scale * (b.float() @ a.float())).to(torch.bfloat16)
    save_file(w, str(out / "model.safetensors"))
    return out
