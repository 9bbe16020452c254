"""The SGLang patch table: every SGLang symbol the SGLang half patches, registers, reads or
constructs (the counterpart of ``patches.py`` for vLLM).

SGLang's internals move between releases (the KV pool accessors, the forward context and the
sampler's signature all did), so there is one table per supported version, as for vLLM:
0.5.21 (the CPU machines, ``TARGETS``) and 0.5.17 (the newest that runs on the GPU machine's
torch 2.11, ``TARGETS_0_5_17``; docs/sglang.md, "SGLang 0.5.17 (the GPU)", lists what differs
between the two). ``TABLE`` is the installed SGLang's table, chosen on first use (importing
this module imports no SGLang); any other version gets a table whose only problem names both
supported versions, and a target that is missing or changed shape makes the lane refuse to
start (``LaneRefused``) naming each problem. Stock SGLang keeps working either way: the
general plugin (``plugin.register``) leaves SGLang untouched when the table has
problems, and only a lane model refuses.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from importlib import metadata
from typing import Any

from lockstep_exact.patching import PatchTable, PatchTableError, Target, installed_table

from ..common.errors import LaneRefused

SUPPORTED_SGLANG = ("0.5.17", "0.5.21")
GPU_SGLANG = "0.5.17"  # the newest SGLang whose wheels pin the GPU machine's torch (2.11)


# The replacements of the table's "patch" rows, by symbol. The functions that replace them live
# above this table (each calls through to ``TABLE.original``), so the general plugin hands them
# in (``plugin.register`` -> ``bind``) before it applies the table: this module imports none.
_REPLACEMENTS: dict[str, Callable[[], Any]] = {}


def bind(replacements: dict[str, Callable[[], Any]]) -> None:
    """Bind each "patch" row's replacement builder, by the row's symbol."""
    _REPLACEMENTS.update(replacements)


def _bound(symbol: str) -> Callable[[], Any]:
    def build():
        if symbol not in _REPLACEMENTS:
            raise PatchTableError(
                f"{symbol}: no replacement is bound (lockstep_serving.sglang.plugin.register "
                "binds them before it applies the table)"
            )
        return _REPLACEMENTS[symbol]()

    return build


# What the lane model reads of SGLang's server arguments (model._validate).
SERVER_ARGS = (
    "model_path",
    "device",
    "attention_backend",
    "sampling_backend",
    "dtype",
    "kv_cache_dtype",
    "quantization",
    "tp_size",
    "pp_size",
    "dp_size",
    "ep_size",
    "speculative_algorithm",
    "enable_lora_overlap_loading",
    "enable_torch_compile",
    "enable_dp_attention",
    "enable_deterministic_inference",
    "rl_on_policy_target",
    "disable_cuda_graph",
    "cuda_graph_config",
)
# What SGLang (0.5.17 and 0.5.21 alike) calls on its model runner's lora_manager, outside CUDA
# graphs and LoRA overlap loading (both refused on the lane).
LORA_MANAGER_CALLS = (
    "load_lora_adapter",
    "load_lora_adapter_from_tensors",
    "unload_lora_adapter",
    "validate_lora_batch",
    "fetch_new_loras",
    "prepare_lora_batch",
    "reset_lora_batch",
    "supports_prefill_cuda_graph",
)


TARGETS: tuple[Target, ...] = (
    Target(
        "sglang.srt.managers.tokenizer_manager",
        "TokenizerManager._create_tokenized_object",
        "patch",
        "a lane engine's front end refuses sampling parameters its rule lacks (and prompt "
        "logprobs), naming them: the request fails, the engine serves on",
        params=("self", "obj", "input_text", "input_ids"),
        replacement=_bound("TokenizerManager._create_tokenized_object"),
    ),
    Target(
        "sglang.srt.model_executor.model_runner",
        "ModelRunner.init_lora_manager",
        "patch",
        "a lane model's runner gets the lane's LoRA manager (adapters through the lane's checks, "
        "applied by lora.shrink/lora.expand), never SGLang's LoRA pool and kernels",
        params=("self",),
        replacement=_bound("ModelRunner.init_lora_manager"),
    ),
    Target(
        "sglang.srt.runtime_context",
        "get_lora",
        "read",
        "the engine's LoRA settings: max_loras_per_batch and the adapters given at start",
    ),
    Target(
        "sglang.srt.managers.io_struct",
        "LoRAUpdateOutput",
        "construct",
        "the lane's LoRA manager answers adapter loads with it (a refusal names its reason)",
        attrs=("success", "error_message", "loaded_adapters"),
    ),
    Target(
        "sglang.srt.models.registry",
        "ModelRegistry",
        "register",
        "LockstepQwen3ForCausalLM / LockstepQwen3MoeForCausalLM into ModelRegistry.models "
        "(selected per engine by json_model_override_args architectures)",
        attrs=("models",),
    ),
    Target(
        "sglang.srt.layers.sampler",
        "register_sampler_backend",
        "register",
        "the lane's sampler under the name 'pytorch' (SGLang forces that backend on CPU); it "
        "runs SGLang's own sampler for any model that is not a lane model",
        params=("backend", "factory"),
    ),
    Target(
        "sglang.srt.layers.sampler",
        "Sampler.forward",
        "construct",
        "LaneSampler overrides it: sample.gumbel_topp over log_softmax.tree rows, raw logprobs",
        params=(
            "self",
            "logits_output",
            "sampling_info",
            "return_logprob",
            "top_logprobs_nums",
            "token_ids_logprobs",
            "positions",
        ),
    ),
    Target(
        "sglang.srt.layers.logprob_processor",
        "OutputLogprobProcessor.compute_logprobs",
        "read",
        "sampled-token, top-k and requested-id logprobs gathered from the lane's raw rows "
        "(the Sampler's output_logprob_processor)",
        params=("self", "logprobs", "top_logprobs_nums", "token_ids_logprobs"),
    ),
    Target(
        "sglang.srt.sampling.sampling_batch_info",
        "SamplingBatchInfo.from_schedule_batch",
        "patch",
        "a lane engine's batch carries every request's seed (sampling_seed), and a random "
        "request without one gets a fresh seed for its whole life",
        params=("batch", "vocab_size"),
        replacement=_bound("SamplingBatchInfo.from_schedule_batch"),
    ),
    Target(
        "sglang.srt.sampling.sampling_batch_info",
        "SamplingBatchInfo",
        "read",
        "each row's temperature, top_p and seed, and every option the lane's rule refuses",
        attrs=(
            "temperatures",
            "top_ps",
            "top_ks",
            "min_ps",
            "sampling_seed",
            "grammars",
            "penalizer_orchestrator",
            "logit_bias",
            "has_custom_logit_processor",
        ),
    ),
    Target(
        "sglang.srt.sampling.sampling_params",
        "SamplingParams",
        "read",
        "the request's seed (sampling_seed) and the parameters the lane refuses",
        attrs=(
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "sampling_seed",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
            "min_new_tokens",
            "logit_bias",
        ),
    ),
    Target(
        "sglang.srt.layers.logits_processor",
        "LogitsProcessorOutput",
        "construct",
        "the lane model's forward returns it: next_token_logits are the lane's fp32 logits",
        attrs=("next_token_logits", "next_token_logprobs"),
    ),
    Target(
        "sglang.srt.model_executor.forward_context",
        "get_token_to_kv_pool",
        "read",
        "the KV pool of the running batch (the lane writes and reads its K/V rows there)",
    ),
    Target(
        "sglang.srt.model_executor.forward_context",
        "get_req_to_token_pool",
        "read",
        "each request's KV slots, position by position (radix-cache hits included)",
    ),
    Target(
        "sglang.srt.mem_cache.memory_pool",
        "MHATokenToKVPool",
        "read",
        "the only pool kind the lane accepts: per layer [slots, kv_heads, head_dim] bf16 buffers",
        attrs=("get_key_buffer", "get_value_buffer"),
    ),
    Target(
        "sglang.srt.model_executor.forward_batch_info",
        "ForwardBatch",
        "read",
        "the step: mode, rows per request, positions, cache slots, logprob requests",
        attrs=(
            "forward_mode",
            "batch_size",
            "input_ids",
            "req_pool_indices",
            "seq_lens",
            "out_cache_loc",
            "seq_lens_cpu",
            "positions",
            "extend_seq_lens_cpu",
            "extend_prefix_lens_cpu",
            "extend_logprob_start_lens_cpu",
            "return_logprob",
            "input_embeds",
            "lora_ids",
            "spec_info",
        ),
    ),
    Target(
        "sglang.srt.runtime_context",
        "get_server_args",
        "read",
        "the engine's settings, checked by the lane model (attention backend, parallelism...)",
    ),
    Target(
        "sglang.srt.server_args",
        "ServerArgs",
        "read",
        "the settings the lane model checks (device, backends, dtypes, parallelism, the "
        "modes it refuses, CUDA graphs) through get_server_args()",
        attrs=SERVER_ARGS,
    ),
    Target(
        "sglang.srt.lora.lora_registry",
        "LoRARef",
        "read",
        "an adapter SGLang hands the lane's LoRA manager: its id, name, directory, pinning",
        attrs=("lora_id", "lora_name", "lora_path", "pinned"),
    ),
    Target(
        "sglang.srt.lora.lora_manager",
        "LoRAManager",
        "read",
        "what SGLang's scheduler, worker and model runner call on a lora_manager; the lane's "
        "SglangLaneLoRAManager stands in for it (sglang/lora.py)",
        attrs=LORA_MANAGER_CALLS,
    ),
)


_OPTIONS = dict(
    error=LaneRefused,
    refusal="the Lockstep exact lane does not support this SGLang",
    source="lockstep_serving/sglang/patches.py",
)

# 0.5.17: every 0.5.21 row holds there unchanged (the same modules, symbols, parameters and
# fields: checked against the released 0.5.17 source by packages/serving-plugin/tests/
# test_sglang_patch_table.py); what differs between the two lies behind these rows and is
# listed in docs/sglang.md. The table is its own tuple so that a row that changes in one
# version changes in its table only.
TARGETS_0_5_17: tuple[Target, ...] = tuple(TARGETS)

TABLES: dict[str, PatchTable] = {
    "0.5.17": PatchTable("SGLang", "sglang", ("0.5.17",), TARGETS_0_5_17, **_OPTIONS),
    "0.5.21": PatchTable("SGLang", "sglang", ("0.5.21",), TARGETS, **_OPTIONS),
}
assert tuple(TABLES) == SUPPORTED_SGLANG


def unsupported(version: str) -> str:
    """The one problem of an SGLang version the plugin has no table for."""
    return (
        f"SGLang {version} is not among the supported {SUPPORTED_SGLANG} (the plugin has a "
        f"patch table for each: {GPU_SGLANG} on the GPU machine, 0.5.21 on CPU machines)"
    )


class _UnsupportedTable(PatchTable):
    """The table of an SGLang version the plugin has none for: one problem, naming both."""

    found: str = "?"  # the version it was made for

    def problems(self) -> list[str]:
        return [unsupported(self.found)]


def table_for(version: str) -> PatchTable:
    """The patch table of SGLang ``version``; for another version, a table that refuses."""
    if version in TABLES:
        return TABLES[version]
    table = _UnsupportedTable("SGLang", "sglang", SUPPORTED_SGLANG, TARGETS, **_OPTIONS)
    table.found = version
    return table


def installed_version() -> str:
    try:
        import sglang
    except ImportError as err:
        try:
            version = metadata.version("sglang")
        except metadata.PackageNotFoundError:  # the default environment: the table refuses
            return "(not installed)"
        # Installed but broken (a dependency missing, triton say): name the import that failed.
        raise LaneRefused(
            f"SGLang {version} is installed for {sys.executable} but does not import "
            f"({type(err).__name__}: {err}); rebuild its environment with "
            "`bash tools/setup --sglang`"
        ) from err
    return getattr(sglang, "__version__", "?")


# TABLE: the installed SGLang's table, chosen on first use.
__getattr__, _table = installed_table(globals(), lambda: table_for(installed_version()))


def problems() -> list[str]:
    """Every target that is missing or changed shape in the installed SGLang, as sentences."""
    return _table().problems()


def check() -> None:
    """Raise LaneRefused naming every target the installed SGLang lacks."""
    _table().check()
