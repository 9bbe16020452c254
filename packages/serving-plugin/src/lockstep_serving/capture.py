"""Capture: sample with the real vLLM engine on the exact lane and record a Trace.

Temperature 1, top-p 1, one seed per prompt (``seed + i``), exactly ``decisions`` tokens per
prompt (EOS ignored), raw FP32 logprobs of every sampled token.
"""

from __future__ import annotations

import os

from lockstep_exact.hashing import dir_sha256
from lockstep_exact.trace import SamplingSettings, Trace

from . import __version__
from .lora import adapter_hash
from .offline import engine_args, lane_fingerprint, sampled_logprobs
from .patches import LaneRefused


def capture(request) -> Trace:
    if request.backend != "cpu":
        raise LaneRefused(f"backend {request.backend!r}: this plugin serves the cpu lane only")
    # The offline capture runs the engine core in this process unless the caller chose otherwise.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    from vllm import LLM, SamplingParams

    options = dict(request.options)
    options.setdefault("max_model_len", 2048)
    options.setdefault("use_tqdm_on_load", False)  # one engine per capture: keep output short
    # vLLM 0.32 on CPU crashes when a seeded request's prefill is chunked: never chunk here.
    options.setdefault("enable_chunked_prefill", False)
    options.setdefault("max_num_batched_tokens", options["max_model_len"])
    lora_request = None
    if request.adapter_dir is not None:
        from .lora import lora_request_for

        options.setdefault("enable_lora", True)
        lora_request = lora_request_for(request.adapter_dir)
    llm = LLM(**engine_args(request.model_dir, contract=request.contract, **options))
    try:
        fingerprint = lane_fingerprint(llm)
        params = [
            SamplingParams(
                temperature=1.0,
                top_p=1.0,
                max_tokens=request.decisions,
                min_tokens=request.decisions,
                ignore_eos=True,
                logprobs=0,
                seed=request.seed + i,
            )
            for i in range(len(request.prompts))
        ]
        prompts = list(request.prompts)
        if request.batch:
            outs = llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
        else:
            outs = [
                llm.generate([p], [sp], lora_request=lora_request, use_tqdm=False)[0]
                for p, sp in zip(prompts, params, strict=True)
            ]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    trace = Trace.from_sequences(
        [list(o.prompt_token_ids) for o in outs],
        [list(o.outputs[0].token_ids) for o in outs],
        [sampled_logprobs(o.outputs[0]) for o in outs],
        contract_fingerprint=fingerprint,
        model_hash=dir_sha256(request.model_dir),
        adapter_hash=adapter_hash(request.adapter_dir, request.model_dir)
        if request.adapter_dir
        else None,
        sampling=SamplingSettings(temperature=1.0, top_p=1.0, seed=request.seed),
        engine={
            "name": "vllm",
            "version": vllm.__version__,
            "plugin": f"lockstep-serving {__version__}",
            "logprobs_mode": "raw_logprobs",
            "batch": request.batch,
        },
        prompt_texts=prompts,
    )
    if request.out_dir is not None:
        trace.save(request.out_dir)
    return trace
