"""vLLM general plugin: registers the exact-lane architectures and the exact logprob patch.

Runs in every vLLM process (entry point ``vllm.general_plugins``). It never changes what a
stock model does: the lane is activated explicitly, per engine, by naming its architecture::

    LLM(model_dir, hf_overrides={"architectures": ["LockstepQwen3ForCausalLM"]},
        dtype="bfloat16", logprobs_mode="raw_logprobs")

(``LockstepQwen3MoeForCausalLM`` for Qwen3-MoE, ``LockstepQwen3NextForCausalLM`` for
Qwen3-Next, in ``vllm_next``; ``lockstep_serving.offline.engine_args`` builds these
arguments). The Sampler's logprob computation is log_softmax.tree while a lane model lives in
the process (a stock engine sharing that process would get it too); otherwise
the original runs. The LoRA patch acts on lane models only, and so does the sampler patch
(``sampler.py``): a lane model's tokens are drawn by ``sample.gumbel_topp``, and a lane engine
admits only the sampling parameters that rule implements.
"""

from __future__ import annotations

from lockstep_exact.lanes.config import supported_architectures

ARCHITECTURES = {
    "LockstepQwen3ForCausalLM": "lockstep_serving.vllm_model:LockstepQwen3ForCausalLM",
    "LockstepQwen3MoeForCausalLM": "lockstep_serving.vllm_model:LockstepQwen3MoeForCausalLM",
    "LockstepQwen3NextForCausalLM": "lockstep_serving.vllm_next:LockstepQwen3NextForCausalLM",
}
# Every architecture lockstep_exact has a lane for (its one table), served as Lockstep<arch>.
LANE_OF_HF = {hf: f"Lockstep{hf}" for hf in supported_architectures()}
assert set(LANE_OF_HF.values()) == set(ARCHITECTURES), "a lane architecture has no vLLM class"

_state = {"registered": False}


def exact_compute_logprobs(logits):
    """Sampler.compute_logprobs while a lane lives: log_softmax.tree on the fp32 logits."""
    import torch

    from .vllm_model import LIVE

    if len(LIVE):
        # The lane's logprobs site, read from a live lane model's contract (log_softmax.tree
        # has no parameters, so any live lane gives these bytes; its log records the call).
        from lockstep_exact.sites import paused

        model = next(iter(LIVE))
        with paused():  # bisect records this site from the model's forward, for every row
            return model.ops.log_softmax("logprobs", logits.to(torch.float32))
    from .patches import TABLE

    return TABLE.original("Sampler.compute_logprobs")(logits)


def register() -> None:
    if _state["registered"]:
        return
    import importlib

    from vllm import ModelRegistry

    from .patches import TABLE

    # Classes, not lazy "<mod>:<cls>" strings: a lazy entry makes vLLM inspect it in a
    # subprocess (15-35 s per architecture on a cold cache); the modules import no vLLM.
    for arch, target in ARCHITECTURES.items():
        module, name = target.split(":")
        ModelRegistry.register_model(arch, getattr(importlib.import_module(module), name))
    # A missing target leaves stock vLLM untouched; the lane then refuses at start (patches.check).
    # Every patch is a row of patches.TABLE (with its replacement); applying records originals.
    if not TABLE.problems():
        TABLE.apply()
    _state["registered"] = True
