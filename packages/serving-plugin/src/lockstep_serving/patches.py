"""The patch table: every vLLM symbol the plugin patches, registers, reads or constructs.

One table, so the whole surface the plugin touches is visible in one place. ``check()``
verifies each target exists with the expected parameters in the installed vLLM; the exact lane
refuses to start (``LaneRefused``) when a target is missing, instead of running on whatever
vLLM happens to do there. Stock vLLM keeps working either way: only the lane fails closed.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, fields, is_dataclass

SUPPORTED_VLLM = ("0.32.0",)


class LaneRefused(RuntimeError):
    """The exact lane cannot run here as configured; nothing falls back to a non-exact path."""


@dataclass(frozen=True)
class Target:
    module: str
    symbol: str  # dotted inside the module: "Sampler.compute_logprobs"
    kind: str  # "patch" (replaced while a lane lives), "register", "read", "construct"
    why: str
    params: tuple[str, ...] = ()  # leading parameter names the plugin relies on (callables)
    attrs: tuple[str, ...] = ()  # dataclass fields the plugin reads
    versions: tuple[str, ...] = SUPPORTED_VLLM


TABLE: tuple[Target, ...] = (
    Target(
        "vllm.model_executor.models.registry",
        "_ModelRegistry.register_model",
        "register",
        "register LockstepQwen3ForCausalLM / LockstepQwen3MoeForCausalLM (lazy '<mod>:<cls>')",
        params=("self", "model_arch", "model_cls"),
    ),
    Target(
        "vllm.plugins.endpoint_plugins.interface",
        "EndpointPlugin",
        "register",
        "GET /lockstep/contract on the OpenAI server (entry point vllm.endpoint_plugins)",
        attrs=("attach_router", "init_state"),
    ),
    Target(
        "vllm.v1.sample.sampler",
        "Sampler.compute_logprobs",
        "patch",
        "raw logprobs of sampled and prompt tokens through log_softmax.tree while a lane lives",
        params=("logits",),
    ),
    Target(
        "vllm.v1.worker.lora_model_runner_mixin",
        "LoRAModelRunnerMixin.load_lora_model",
        "patch",
        "a lane model gets LaneLoRAManager (exact lora programs) instead of punica wrappers",
        params=("self", "model", "vllm_config", "device"),
    ),
    Target(
        "vllm.lora.layers.utils",
        "LoRAMapping",
        "read",
        "the token -> adapter-id mapping handed to lora_manager.set_active_adapters each step",
        attrs=("index_mapping", "prompt_mapping"),
    ),
    Target(
        "vllm.v1.worker.lora_model_runner_mixin",
        "LoRAModelRunnerMixin._set_active_loras",
        "read",
        "calls lora_manager.set_active_adapters(lora_requests, LoRAMapping) before each forward",
        params=("self", "prompt_lora_mapping", "token_lora_mapping", "lora_requests"),
    ),
    Target(
        "vllm.model_executor.layers.attention.attention",
        "Attention.__init__",
        "construct",
        "one Attention per layer so vLLM allocates and binds that layer's paged KV cache",
        params=("self", "num_heads", "head_size", "scale", "num_kv_heads"),
    ),
    Target(
        "vllm.model_executor.layers.attention.attention",
        "get_attention_context",
        "read",
        "per-layer attention metadata, the layer's kv_cache tensor and its slot mapping",
        params=("layer_name",),
    ),
    Target(
        "vllm.forward_context",
        "is_forward_context_available",
        "read",
        "tell a real step from a dummy/profile run (no metadata: nothing to attend to)",
    ),
    Target(
        "vllm.v1.attention.backends.cpu_attn",
        "CPUAttentionMetadata",
        "read",
        "query_start_loc / seq_lens / block_table / slot_mapping of the batch",
        attrs=("num_actual_tokens", "query_start_loc", "seq_lens", "block_table", "slot_mapping"),
    ),
    Target(
        "vllm.v1.attention.backends.cpu_attn",
        "CPUAttentionBackendImpl.forward",
        "read",
        "the cache layout: [blocks, kv_heads, block_size, 2*D] viewed as K rows then V rows",
        params=("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata"),
    ),
)


def resolve(target: Target):
    obj = importlib.import_module(target.module)
    for part in target.symbol.split("."):
        obj = getattr(obj, part)
    return obj


def problems(table: tuple[Target, ...] | None = None) -> list[str]:
    """Every target that is missing or changed shape in the installed vLLM, as sentences."""
    import vllm

    table = TABLE if table is None else table
    out = []
    version = getattr(vllm, "__version__", "?")
    for t in table:
        where = f"{t.module}.{t.symbol} ({t.kind}: {t.why})"
        if version not in t.versions:
            out.append(f"{where}: vLLM {version} is not among the supported {t.versions}")
            continue
        try:
            obj = resolve(t)
        except (ImportError, AttributeError) as err:
            out.append(f"{where}: missing ({err})")
            continue
        if t.params:
            try:
                names = tuple(inspect.signature(obj).parameters)
            except (TypeError, ValueError) as err:
                out.append(f"{where}: no signature ({err})")
                continue
            if names[: len(t.params)] != t.params:
                out.append(f"{where}: parameters {names} do not start with {t.params}")
        if t.attrs:
            have = ({f.name for f in fields(obj)} if is_dataclass(obj) else set(dir(obj))) | set(
                getattr(obj, "__annotations__", {})
            )
            missing = [a for a in t.attrs if a not in have]
            if missing:
                out.append(f"{where}: lacks field(s) {missing}")
    return out


def check() -> None:
    """Raise LaneRefused naming every target the installed vLLM lacks."""
    found = problems()
    if found:
        raise LaneRefused(
            "the Lockstep exact lane does not support this vLLM: "
            + "; ".join(found)
            + " (see lockstep_serving/patches.py)"
        )
