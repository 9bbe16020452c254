"""OpenAI-compatible server: every response names the lane it was served by.

``GET /lockstep/contract`` answers ``{"lane_active": true, "fingerprint": "sha256:...",
"lane": ...}``, and every HTTP response of a server on the lane carries the fingerprint in its
``X-Lockstep-Contract`` header, so a saved completion can be matched to its contract. The
engine refused to start unless its lane matched any fingerprint requested
(``LOCKSTEP_CONTRACT`` / hf_overrides ``lockstep_contract``), so this is what it runs.

vLLM loads endpoint plugins only when named in ``VLLM_PLUGINS``; ``lockstep serve`` (the CLI)
sets it, with the flags that put the server on the lane (``vllm/server.py``).
"""

# No ``from __future__ import annotations``: FastAPI must see the real ``Request`` class.

from ..common.lane import model_contract
from .architectures import ARCHITECTURES

CONTRACT_HEADER = "X-Lockstep-Contract"


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

        @app.middleware("http")
        async def contract_header(request: Request, call_next):
            response = await call_next(request)
            info = getattr(request.app.state, "lockstep_contract", None) or {}
            if info.get("lane_active"):
                response.headers[CONTRACT_HEADER] = info["fingerprint"]
            return response

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
