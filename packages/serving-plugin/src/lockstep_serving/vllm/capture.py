"""Capture: sample with the real vLLM engine on the exact lane and record a Trace.

The request's temperature and top-p (1 and 1 unless asked), one seed per prompt
(``seed + i``), exactly ``decisions`` tokens per prompt (EOS ignored), raw FP32 logprobs of
every sampled token. The lane's sampler draws every token with ``sample.gumbel_topp``; the
trace records its ident and each sequence's seed, so replay can check the tokens too.
"""

from __future__ import annotations

import os

import torch

from lockstep_exact.contract import ContractMismatch, check_layout
from lockstep_exact.model import ModelDir
from lockstep_exact.trace import SamplingSettings, Trace

from .. import __version__
from ..common.capture import TOKENIZERS, adapter_hash
from ..common.errors import LaneRefused
from .lora import lora_request_for
from .offline import engine_args, invoked_contract, lane_fingerprint, sampled_logprobs


def _default_max_model_len(model: ModelDir) -> int:
    """2048 tokens, or fewer where the model's ``max_position_embeddings`` says so (vLLM refuses
    a longer ``max_model_len`` than the config allows)."""
    limit = model.config.get("max_position_embeddings")
    return min(2048, int(limit)) if isinstance(limit, int) and limit > 0 else 2048


def _check_tokenizer(model: ModelDir) -> None:
    """A capture turns prompt texts into token ids: refuse a model directory without a
    tokenizer rather than let the engine guess one."""
    if not any((model.path / f).is_file() for f in TOKENIZERS):
        raise LaneRefused(
            f"{model.path} has no tokenizer ({', '.join(TOKENIZERS)}): copy the "
            "tokenizer files the model was trained with next to its config.json"
        )


BACKENDS = ("cpu", "cuda")


def check_backend(backend: str) -> None:
    """The lane runs the cpu programs in a CPU vLLM and the cuda programs in a CUDA one."""
    if backend not in BACKENDS:
        raise LaneRefused(f"backend {backend!r}: this plugin serves the {BACKENDS} lanes only")
    if backend == "cuda" and not torch.cuda.is_available():
        raise LaneRefused(
            "backend 'cuda': no CUDA device here (a CUDA vLLM, 0.26.0, serves the cuda lane)"
        )


def check_model(request) -> ModelDir:
    """What every engine start checks first: the backend, the model (refused, naming what
    the lane cannot run) and its tokenizer."""
    check_backend(request.backend)
    # The offline engine runs its core in this process unless the caller chose otherwise.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if request.backend == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    else:
        # The lane's sampler lives on vLLM's V1 model runner; vLLM 0.26 would put a dense
        # model on V2. An engine this plugin starts asks for V1 unless the caller chose (a
        # caller's VLLM_USE_V2_MODEL_RUNNER=1 is refused by the lane model, naming it).
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    model = ModelDir(request.model_dir, hybrid=True)  # next.py serves Qwen3-Next
    _check_tokenizer(model)
    return model


def engine_options(model: ModelDir, options: dict, tp: int = 1) -> dict:
    """vLLM engine arguments: the caller's, then the lane's defaults. ``tp`` > 1 runs vLLM's
    tensor parallelism (worker processes); a size the contract's partitions do not admit is
    refused here, naming both numbers, before any worker starts."""
    options = dict(options)
    if tp != 1:
        try:
            check_layout(model.contract(), tp=tp)
        except ContractMismatch as err:
            raise LaneRefused(f"Lockstep exact lane refused --tp {tp}: {err}") from err
        options.setdefault("tensor_parallel_size", tp)
        options.setdefault("distributed_executor_backend", "mp")
        # vLLM's CPU workers bind one NUMA node each by default; a one-node machine (this
        # kind of CI runner) cannot: leave the threads unbound unless the user chose.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    options.setdefault("max_model_len", _default_max_model_len(model))
    options.setdefault("use_tqdm_on_load", False)  # one engine per capture: keep output short
    # Chunked prefill is the caller's choice: the lane's sampler never rewinds a generator.
    options.setdefault("max_num_batched_tokens", options["max_model_len"])
    return options


def sampling_params(n: int, decisions: int, seed: int, temperature: float, top_p: float):
    """One SamplingParams per prompt: seed ``seed + i``, exactly ``decisions`` tokens."""
    from vllm import SamplingParams

    # No min_tokens: it masks EOS (even with ignore_eos), which the rule would not do.
    return [
        SamplingParams(
            temperature=float(temperature),
            top_p=float(top_p),
            max_tokens=decisions,
            ignore_eos=True,
            logprobs=0,
            seed=seed + i,
        )
        for i in range(n)
    ]


def build_trace(
    outs,
    params,
    invoked,
    model: ModelDir,
    adapter_hash_: str | None,
    *,
    prompts,
    seed,
    batch,
    tp: int = 1,
) -> Trace:
    """The Trace of one generate call: raw FP32 logprobs, the invoked contract, the rule."""
    import vllm

    if "sample" not in invoked.sites:
        raise LaneRefused(
            "the engine produced tokens without running the lane's sampling rule (no 'sample' "
            "op site ran): its tokens and logprobs are not the lane's, so no trace is written"
        )
    temperature = params[0].temperature if params else 1.0
    return Trace.from_sequences(
        [list(o.prompt_token_ids) for o in outs],
        [list(o.outputs[0].token_ids) for o in outs],
        [sampled_logprobs(o.outputs[0]) for o in outs],
        contract_fingerprint=invoked.fingerprint,
        contract=invoked.to_json(),
        model_hash=model.model_hash,
        adapter_hash=adapter_hash_,
        # What the engine used: SamplingParams raises a temperature in (0, 1e-2) to 1e-2 and
        # sets top-p 1 for greedy requests.
        sampling=SamplingSettings(
            temperature=temperature,
            top_p=params[0].top_p if params else 1.0,
            seed=seed,
            seeds=tuple(sp.seed for sp in params),
            rule=invoked.sites["sample"].ident,  # the rule the engine ran
        ),
        engine={
            "name": "vllm",
            "version": vllm.__version__,
            "plugin": f"lockstep-serving {__version__}",
            "logprobs_mode": "raw_logprobs",
            "batch": batch,
            "tp": tp,
        },
        prompt_texts=list(prompts),
    )


# vLLM's smallest KV block on cuda: a bound on the blocks a sequence of n tokens can take.
_MIN_BLOCK = 16


def capture_options(model: ModelDir, request) -> dict:
    """The engine options of one capture: ``engine_options``, and on cuda a KV cache sized
    for this capture's sequences (each up to ``max_model_len`` tokens) unless the caller set
    ``num_gpu_blocks_override`` itself. Otherwise vLLM fills the GPU's free
    memory with blocks, and a tiny model's blocks are small: its block pool then holds
    millions of Python objects and starting it takes tens of seconds (a capture of the tiny
    model took 30-47 s on the H200). The bytes do not depend on the block count. A hybrid
    (qwen3-next) sequence also holds one state page per cache group of its GDN layers, drawn
    from the same pool (at most one group per GDN layer)."""
    options = engine_options(model, request.options, getattr(request, "tp", 1))
    if request.backend == "cuda" and "num_gpu_blocks_override" not in options:
        block = int(options.get("block_size") or _MIN_BLOCK)
        per_sequence = -(-options["max_model_len"] // block) + 1
        if model.family == "qwen3-next":
            per_sequence += sum(k == "linear_attention" for k in model.geometry.layer_types)
        options["num_gpu_blocks_override"] = max(1, len(request.prompts)) * per_sequence
    return options


def capture(request) -> Trace:
    model = check_model(request)  # refuses, naming it, what the lane cannot run
    from vllm import LLM

    options = capture_options(model, request)
    lora_request = None
    if request.adapter_dir is not None:
        options.setdefault("enable_lora", True)
        lora_request = lora_request_for(request.adapter_dir)
    llm = LLM(**engine_args(request.model_dir, contract=request.contract, **options))
    try:
        lane_fingerprint(llm)  # one contract across workers, or refuse
        prompts = list(request.prompts)
        params = sampling_params(
            len(prompts), request.decisions, request.seed, request.temperature, request.top_p
        )
        if request.batch:
            outs = llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
        else:
            outs = [
                llm.generate([p], [sp], lora_request=lora_request, use_tqdm=False)[0]
                for p, sp in zip(prompts, params, strict=True)
            ]
        invoked = invoked_contract(llm)  # what the engine ran, checked against the contract
        if invoked.backend != request.backend:
            raise LaneRefused(
                f"the engine ran the {invoked.backend} lane but backend {request.backend!r} "
                "was asked for (the lane's backend is the engine's device)"
            )
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    trace = build_trace(
        outs,
        params,
        invoked,
        model,
        adapter_hash(request.adapter_dir, model, request.backend) if request.adapter_dir else None,
        prompts=prompts,
        seed=request.seed,
        batch=request.batch,
        tp=int(options.get("tensor_parallel_size", 1)),
    )
    if request.out_dir is not None:
        trace.save(request.out_dir)
    return trace
