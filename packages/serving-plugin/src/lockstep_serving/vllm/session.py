"""A long-lived vLLM engine on the exact lane, for ``lockstep train``.

One engine serves every step of a run. Each adapter directory it is handed is loaded into the
running engine under a new adapter id (keyed by the adapter's hash, so a directory rewritten in
place is never served from a stale copy) and the adapter of the previous call is removed: no
restart, and memory stays flat however many steps run. Every call returns a Trace exactly as
``lockstep capture`` writes one (raw FP32 logprobs, the invoked contract, the sampling rule
and seeds), so the trainer admits it the same way.
"""

from __future__ import annotations

from pathlib import Path

from lockstep_exact.trace import Trace

from ..common.capture import adapter_hash
from .capture import build_trace, check_model, engine_options, sampling_params
from .lora import lora_request_for
from .offline import engine_args, invoked_contract, lane_fingerprint

# vLLM accepts these adapter ranks as its engine-wide maximum.
_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _max_rank(rank: int) -> int:
    for r in _RANKS:
        if r >= rank:
            return r
    raise ValueError(f"adapter rank {rank} is above vLLM's largest ({_RANKS[-1]})")


class VllmSampler:
    def __init__(self, request):
        self.model = check_model(request)
        self.backend = request.backend  # adapters are checked against this backend's lane
        from vllm import LLM

        options = engine_options(self.model, request.options)
        options.setdefault("enable_lora", True)
        options.setdefault("max_loras", 1)
        options.setdefault("max_lora_rank", _max_rank(int(request.max_lora_rank)))
        self.llm = LLM(**engine_args(self.model.path, contract=request.contract, **options))
        self.starts = 1
        self.fingerprint = lane_fingerprint(self.llm)  # one contract across workers, or refuse
        self._ids: dict[tuple[str, str], int] = {}  # (path, adapter hash) -> lora_int_id
        self._active: int | None = None
        self.adapter_id: int | None = None  # the id the last call sampled with

    def _lora(self, adapter_dir: Path | None):
        if adapter_dir is None:
            self.adapter_id = None
            return None, None
        path = Path(adapter_dir).resolve()
        # refuses a damaged or foreign adapter, or one bound to another backend's lane
        digest = adapter_hash(path, self.model, self.backend)
        key = (str(path), digest)
        if key not in self._ids:
            self._ids[key] = len(self._ids) + 1
        lid = self._ids[key]
        if self._active is not None and self._active != lid:
            self.llm.llm_engine.remove_lora(self._active)  # the old one is never used again
        self._active = self.adapter_id = lid
        return lora_request_for(path, lora_int_id=lid), digest

    def sample(
        self,
        prompts,
        decisions: int,
        seed: int,
        adapter_dir: Path | None = None,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
    ) -> Trace:
        lora_request, digest = self._lora(adapter_dir)
        prompts = list(prompts)
        params = sampling_params(len(prompts), decisions, seed, temperature, top_p)
        outs = self.llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
        invoked = invoked_contract(self.llm)  # checked against the contract the engine runs
        return build_trace(
            outs, params, invoked, self.model, digest, prompts=prompts, seed=seed, batch=True
        )

    def encode(self, text: str, *, prompt: bool = True) -> list[int]:
        """Token ids of ``text``: as this engine tokenizes a prompt (``prompt``), or as a
        continuation (no special tokens added)."""
        return list(self.llm.get_tokenizer().encode(text, add_special_tokens=prompt))

    def decode(self, ids) -> str:
        return self.llm.get_tokenizer().decode(list(ids))

    def close(self) -> None:
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
