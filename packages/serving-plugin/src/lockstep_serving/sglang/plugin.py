"""SGLang general plugin: registers the exact-lane architectures and the lane's sampler.

SGLang runs it in every one of its processes (entry point ``sglang.srt.plugins``), before
the model is built. It never changes what a stock model does: the lane is activated per
engine by naming its architecture (``json_model_override_args``, see ``model``); the
sampler registered under ``pytorch`` is SGLang's own for every other model, and the batch
patch (``sampler.from_schedule_batch``) is inert without a lane model. When the
installed SGLang does not fit the patch table (another version, a moved symbol), nothing is
registered and the lane refuses to start, naming each problem.

SGLang's CPU engine also needs ``sgl_kernel`` importable before any plugin runs (SGLang's
modules import it at their top): that comes from the ``lockstep-sglang-cpu-standins``
package the ``sglang`` extra installs, not from here. On a GPU (SGLang 0.5.17) the real
``sgl_kernel`` is installed and the stand-ins must not be.
"""

from __future__ import annotations

import logging

from . import model, patches
from .lora import init_lora_manager
from .sampler import create_tokenized_object, from_schedule_batch, lane_sampler_class

_state = {"registered": False}
log = logging.getLogger("lockstep_serving.sglang")


def _from_schedule_batch():
    return classmethod(from_schedule_batch)


def _init_lora_manager():
    return init_lora_manager


def _create_tokenized_object():
    return create_tokenized_object


# The replacement of each "patch" row of patches.TABLE, by symbol (``patches.bind``).
REPLACEMENTS = {
    "TokenizerManager._create_tokenized_object": _create_tokenized_object,
    "ModelRunner.init_lora_manager": _init_lora_manager,
    "SamplingBatchInfo.from_schedule_batch": _from_schedule_batch,
}


def register() -> None:
    if _state["registered"]:
        return
    _state["registered"] = True
    found = patches.TABLE.problems()
    if found:  # stock SGLang stays untouched; the lane refuses when asked for (model.py)
        log.warning("lockstep: SGLang lane not registered: %s", "; ".join(found))
        return
    from sglang.srt.layers.sampler import register_sampler_backend
    from sglang.srt.models.registry import ModelRegistry

    for cls in model.EntryClass:
        ModelRegistry.models[cls.__name__] = cls
    # SGLang's CPU platform forces sampling_backend "pytorch"; registered factories are looked
    # up before the built-in names, so this one is built (it is SGLang's own Sampler for any
    # model that is not a lane model).
    register_sampler_backend("pytorch", lane_sampler_class())
    patches.bind(REPLACEMENTS)
    patches.TABLE.apply()
