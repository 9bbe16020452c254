"""LoRA on the exact lane: vLLM's per-request adapter plumbing, shared-exact's programs.

vLLM keeps deciding which request uses which adapter (``LoRARequest`` per request; the input
batch turns that into a token -> adapter-id mapping each step). For a lane model the runner's
``lora_manager`` is ``LaneLoRAManager`` instead of vLLM's punica-based manager: it loads PEFT
adapters with ``lockstep_exact.adapters.load_adapter`` and hands the model the token mapping;
the model applies them through ``lora_shrink``/``lora_expand`` in the shared composition.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from lockstep_exact.adapters import AdapterError, load_adapter
from lockstep_exact.model import model_hash

from ..common.errors import LaneRefused
from . import patches
from .model import LockstepQwen3ForCausalLM
from .next import LockstepQwen3NextForCausalLM


def lora_request_for(adapter_dir, lora_int_id: int = 1):
    """A vLLM LoRARequest for a PEFT adapter directory (name derived from the path)."""
    from vllm.lora.request import LoRARequest

    path = Path(adapter_dir).resolve()
    return LoRARequest(
        lora_name=f"lockstep-{path.name}", lora_int_id=lora_int_id, lora_path=str(path)
    )


class LaneLoRAManager:
    """What the model runner asks of its ``lora_manager``, for a lane model."""

    def __init__(self, model, max_loras: int):
        self.model = model
        self.max_loras = max_loras
        self.adapters: dict[int, dict] = {}  # lora_int_id -> {HF weight name: (A, B, scale)}
        self.paths: dict[int, str] = {}
        self._dummy: set[int] = set()

    # -- loading ---------------------------------------------------------------------------
    def _model_hash(self) -> str:
        """The served model's hash (adapters bound to another base model are refused)."""
        if not hasattr(self, "_hash"):
            self._hash = model_hash(self.model.model_dir)
        return self._hash

    def add_adapter(self, lora_request) -> bool:
        lid = lora_request.lora_int_id
        if lid in self.adapters and self.paths[lid] == lora_request.lora_path:
            return False
        try:
            adapter = load_adapter(
                lora_request.lora_path,
                self.model.geom,
                contract=self.model.contract.fingerprint,
                model_dir=getattr(self.model, "model_dir", None),
                model_hash=self._model_hash(),
            )
        except AdapterError as err:
            raise LaneRefused(
                f"Lockstep exact lane refused adapter {lora_request.lora_name}: {err}"
            ) from err
        dev = getattr(self.model, "device", None)  # the engine's device (cuda on the GPU)
        self.adapters[lid] = {
            name: (a.to(dev), b.to(dev), scale) if dev is not None else (a, b, scale)
            for name, (a, b, scale) in adapter.modules.items()
        }
        self.paths[lid] = lora_request.lora_path
        return True

    def add_dummy_lora(self, lora_request, rank: int) -> bool:
        self._dummy.add(lora_request.lora_int_id)
        return True

    @contextlib.contextmanager
    def dummy_lora_cache(self):
        yield

    def get_dummy_lora_warmup_rank(self, default_rank: int) -> int:
        return default_rank

    def remove_adapter(self, adapter_id: int) -> bool:
        self._dummy.discard(adapter_id)
        self.paths.pop(adapter_id, None)
        return self.adapters.pop(adapter_id, None) is not None

    def remove_all_adapters(self) -> None:
        self.adapters.clear()
        self.paths.clear()
        self._dummy.clear()

    def pin_adapter(self, adapter_id: int) -> bool:
        return adapter_id in self.adapters

    def list_adapters(self) -> set[int]:
        return set(self.adapters)

    def supports_tower_connector_lora(self) -> bool:
        return False

    @property
    def is_enabled(self) -> bool:
        return True

    # -- one step ----------------------------------------------------------------------------
    def set_active_adapters(self, requests, mapping) -> None:
        for req in requests:
            if req.lora_int_id not in self._dummy:
                self.add_adapter(req)
        ids = tuple(mapping.index_mapping) if mapping is not None else ()
        # Dummy (warm-up) adapters have no file: their tokens run on the base weights.
        self.model.set_token_adapters(
            ids, {i: a for i, a in self.adapters.items() if i not in self._dummy}
        )


def load_lora_model(self, model, vllm_config, device):
    """LoRAModelRunnerMixin.load_lora_model: lane models get LaneLoRAManager."""
    if isinstance(model, (LockstepQwen3ForCausalLM, LockstepQwen3NextForCausalLM)):
        self.lora_manager = LaneLoRAManager(model, vllm_config.lora_config.max_loras)
        return model
    return patches.TABLE.original("LoRAModelRunnerMixin.load_lora_model")(
        self, model, vllm_config, device
    )
