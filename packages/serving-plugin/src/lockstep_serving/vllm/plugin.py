"""vLLM general plugin: registers the exact-lane architectures and the exact logprob patch.

Runs in every vLLM process (entry point ``vllm.general_plugins``). It never changes what a
stock model does: the lane is activated explicitly, per engine, by naming its architecture::

    LLM(model_dir, hf_overrides={"architectures": ["LockstepQwen3ForCausalLM"]},
        dtype="bfloat16", logprobs_mode="raw_logprobs")

(``LockstepQwen3MoeForCausalLM`` for Qwen3-MoE, ``LockstepQwen3NextForCausalLM`` for
Qwen3-Next, in ``next``; ``lockstep_serving.vllm.offline.engine_args`` builds these
arguments). The Sampler's logprob computation is log_softmax.tree while a lane model lives in
the process (a stock engine sharing that process would get it too); otherwise
the original runs. The LoRA patch acts on lane models only, and so does the sampler patch
(``sampler.py``): a lane model's tokens are drawn by ``sample.gumbel_topp``, and a lane engine
admits only the sampling parameters that rule implements.
"""

from __future__ import annotations

import importlib

import torch

from lockstep_exact.sites import paused

from . import patches
from .architectures import ARCHITECTURES, LANE_OF_HF  # noqa: F401 (read here by tests and tools)
from .lora import load_lora_model
from .model import LIVE
from .sampler import checked_output, lane_sample, process_inputs

_state = {"registered": False}


def exact_compute_logprobs(logits):
    """Sampler.compute_logprobs while a lane lives: log_softmax.tree on the fp32 logits."""
    if len(LIVE):
        # The lane's logprobs site, read from a live lane model's contract (log_softmax.tree
        # has no parameters, so any live lane gives these bytes; its log records the call).
        model = next(iter(LIVE))
        with paused():  # bisect records this site from the model's forward, for every row
            return model.ops.log_softmax("logprobs", logits.to(torch.float32))
    return patches.TABLE.original("Sampler.compute_logprobs")(logits)


def _exact_compute_logprobs():
    return staticmethod(exact_compute_logprobs)


def _lane_load_lora_model():
    return load_lora_model


def _lane_sample():
    return lane_sample


def _checked_output():
    return checked_output


def _lane_process_inputs():
    return process_inputs


def _original_kernel_warmup():
    return patches.TABLE.original("kernel_warmup")


def _lane_kernel_warmup():
    """vLLM's kernel warm-up, then the lane's (``warm_up_lane``) when the worker's model is a
    lane model: the lane's Triton kernels compile before the engine serves."""

    def kernel_warmup(worker, *args, **kwargs):
        out = _original_kernel_warmup()(worker, *args, **kwargs)
        model = worker.get_model()
        warm = getattr(model, "warm_up_lane", None)
        if warm is not None:
            sched = worker.scheduler_config
            warm(int(sched.max_num_batched_tokens), int(sched.max_num_seqs))
        return out

    return kernel_warmup


# The replacement of each "patch" row of patches.TABLE, by symbol (``patches.bind``).
REPLACEMENTS = {
    "Sampler.compute_logprobs": _exact_compute_logprobs,
    "GPUModelRunner._sample": _lane_sample,
    "AsyncGPUModelRunnerOutput.get_output": _checked_output,
    "InputProcessor.process_inputs": _lane_process_inputs,
    "LoRAModelRunnerMixin.load_lora_model": _lane_load_lora_model,
    "kernel_warmup": _lane_kernel_warmup,
}


def register() -> None:
    if _state["registered"]:
        return
    from vllm import ModelRegistry

    # Classes, not lazy "<mod>:<cls>" strings: a lazy entry makes vLLM inspect it in a
    # subprocess (15-35 s per architecture on a cold cache); the modules import no vLLM.
    for arch, target in ARCHITECTURES.items():
        module, name = target.split(":")
        ModelRegistry.register_model(arch, getattr(importlib.import_module(module), name))
    # A missing target leaves stock vLLM untouched; the lane then refuses at start (patches.check).
    # Every patch is a row of patches.TABLE; its replacement is bound here (REPLACEMENTS: the
    # functions live above the table), and applying records originals.
    patches.bind(REPLACEMENTS)
    if not patches.TABLE.problems():
        patches.TABLE.apply()
    _state["registered"] = True
