"""lockstep bisect, sampler half: every op site's output for one decision, from the engine.

The engine runs the decision's prefix as one request (no prefix cache, no chunking) while
``lockstep_exact.sites.recording()`` is active; the lane composition records each op site.
Needs the in-process engine core (the recording lives in this thread).
"""

from __future__ import annotations

import os

from lockstep_exact.sites import recording

from ..common.errors import LaneRefused
from .lora import lora_request_for
from .offline import engine_args


def dump_sites(request) -> dict:
    if request.backend != "cpu":
        raise LaneRefused(f"backend {request.backend!r}: this plugin serves the cpu lane only")
    if os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        raise LaneRefused("dump_sites needs VLLM_ENABLE_V1_MULTIPROCESSING=0 (in-process core)")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    tokens = list(request.tokens[: request.position + 1])
    length = max(512, -(-(len(tokens) + 8) // 32) * 32)
    options = {
        "enable_prefix_caching": False,
        "max_model_len": length,
        "max_num_batched_tokens": length,
        "use_tqdm_on_load": False,
    }
    lora_request = None
    if request.adapter_dir is not None:
        options["enable_lora"] = True
        lora_request = lora_request_for(request.adapter_dir)
    llm = LLM(**engine_args(request.model_dir, **options))
    try:
        with recording() as sites:
            llm.generate(
                [TokensPrompt(prompt_token_ids=tokens)],
                SamplingParams(max_tokens=1, temperature=0.0),
                lora_request=lora_request,
                use_tqdm=False,
            )
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return dict(sites)
