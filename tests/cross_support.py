"""Helpers of the cross-package tests: drive a capture and a replay through the plugins' hooks.

8 prompts of different lengths, 8 decisions each; the trainer replays in padded micro-batches
of 3, so the two engines batch differently on purpose.
"""

from __future__ import annotations

from lockstep_exact.requests import CaptureRequest, ReplayRequest
from lockstep_exact.tiny import default_prompts
from lockstep_exact.trace import Trace


def replay(pm, model, trace_dir, adapter=None, control=False):
    return pm.hook.lockstep_replay(
        request=ReplayRequest(
            model_dir=model,
            trace_dir=trace_dir,
            adapter_dir=adapter,
            micro_batch=3,
            control=control,
        )
    ).logprobs


def capture(pm, model, out, adapter=None, seed=3, **options):
    """``options``: engine knobs for the sampler (``block_size``, ...)."""
    pm.hook.lockstep_capture(
        request=CaptureRequest(
            model_dir=model,
            prompts=tuple(default_prompts(8)),
            decisions=8,
            out_dir=out,
            seed=seed,
            adapter_dir=adapter,
            options=options,
        )
    )
    return Trace.load(out)
