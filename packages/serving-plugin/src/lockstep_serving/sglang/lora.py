"""LoRA on the SGLang lane: SGLang's per-request adapter plumbing, shared-exact's programs.

SGLang keeps deciding which request runs which adapter: ``lora_path`` per request (an adapter
name), ``--enable-lora``, ``--lora-paths`` or ``Engine.load_lora_adapter`` to load one,
``--max-loras-per-batch`` and its scheduler's admission, the radix cache keyed by adapter.
Each step's ``ForwardBatch.lora_ids`` names every request's adapter. For a lane model the model
runner's ``lora_manager`` is ``SglangLaneLoRAManager`` instead of SGLang's ``LoRAManager``
(``ModelRunner.init_lora_manager`` is patched, inert for other models): it loads adapters with
``lockstep_exact.adapters.load_adapter`` (bf16 factors, the recorded hash, this lane's
contract, this base model; anything else refused by name: the lane's contract is its
backend's, so a cuda engine takes adapters made for the cuda lane) and hands the model the
loaded adapters, on the engine's device; the model applies each request's through
``lora.shrink`` / ``lora.expand`` in the shared composition (``model``). SGLang's
LoRA memory pool, backends and kernels are never built.

An adapter that fails the checks is never loaded: given at start (``--lora-paths``), the
engine does not start; loaded later, ``load_lora_adapter`` answers ``success=False`` with the
reason, and requests naming it are refused by SGLang's front end (never served on the base).
"""

from __future__ import annotations

from lockstep_exact.adapters import AdapterError, load_adapter

from ..common.errors import LaneRefused
from . import patches
from .model import LockstepQwen3ForCausalLM


def _result(success: bool, message: str, refs: dict):
    from sglang.srt.managers.io_struct import LoRAUpdateOutput

    return LoRAUpdateOutput(
        success=success,
        error_message=message,
        loaded_adapters={ref.lora_name: ref.lora_path for ref in refs.values()},
    )


class SglangLaneLoRAManager:
    """What SGLang's scheduler, worker and model runner ask of their ``lora_manager``, for a
    lane model. Adapters are keyed by SGLang's ``lora_id``."""

    # Read by SGLang's model runner, scheduler and metrics: no DP attention, no memory pool,
    # no prefill CUDA graph (0.5.17 and 0.5.21 ask before capturing one under --enable-lora).
    enable_dp_attention = False
    enable_lora_overlap_loading = False
    memory_pool = None
    supports_prefill_cuda_graph = False

    def __init__(self, model, max_loras_per_batch: int, lora_paths=None):
        self.model = model
        self.max_loras_per_batch = int(max_loras_per_batch)
        self.lora_refs: dict = {}  # lora_id -> LoRARef
        self.adapters: dict[str, dict] = {}  # lora_id -> {HF weight name: (A, B, scale)}
        self.hashes: dict[str, str] = {}  # lora_id -> adapter sha256
        self.num_pinned_loras = 0
        model.lora_manager = self
        for ref in lora_paths or ():
            message = self._load(ref)
            if message is not None:  # an adapter given at start: the engine does not start
                raise LaneRefused(message)

    # -- loading ----------------------------------------------------------------------------
    def _load(self, ref) -> str | None:
        """Load one adapter through the lane's checks; the refusal text, or None."""
        if ref.lora_id in self.adapters:
            return f"Lockstep exact lane: adapter {ref.lora_name} is already loaded"
        if any(r.lora_name == ref.lora_name for r in self.lora_refs.values()):
            return f"Lockstep exact lane: an adapter named {ref.lora_name} is already loaded"
        try:
            adapter = load_adapter(
                ref.lora_path,
                self.model.geom,
                contract=self.model.contract.fingerprint,
                model_dir=getattr(self.model, "model_dir", None),
                model_hash=self.model.model_hash(),
            )
        except AdapterError as err:
            return f"Lockstep exact lane refused adapter {ref.lora_name}: {err}"
        dev = getattr(self.model, "device", None)  # the engine's device (cuda on the GPU)
        self.adapters[ref.lora_id] = {
            name: (a.to(dev), b.to(dev), scale) if dev is not None else (a, b, scale)
            for name, (a, b, scale) in adapter.modules.items()
        }
        self.hashes[ref.lora_id] = adapter.sha256
        self.lora_refs[ref.lora_id] = ref
        self.num_pinned_loras += int(bool(ref.pinned))
        return None

    def load_lora_adapter(self, lora_ref):
        message = self._load(lora_ref)
        return _result(message is None, message or "", self.lora_refs)

    def load_lora_adapter_from_tensors(self, lora_ref, tensors, config_dict, *args, **kwargs):
        return _result(
            False,
            f"Lockstep exact lane refused adapter {lora_ref.lora_name}: adapters from tensors "
            "carry no adapter file to check (hash, contract, base model); load it from a "
            "directory",
            self.lora_refs,
        )

    def unload_lora_adapter(self, lora_ref):
        ref = self.lora_refs.pop(lora_ref.lora_id, None)
        self.adapters.pop(lora_ref.lora_id, None)
        self.hashes.pop(lora_ref.lora_id, None)
        if ref is not None:
            self.num_pinned_loras -= int(bool(ref.pinned))
        return _result(True, "", self.lora_refs)

    # -- one step ---------------------------------------------------------------------------
    def validate_lora_batch(self, lora_ids) -> bool:
        """Whether a batch with these adapters fits (SGLang's scheduler asks before adding a
        request; ``None`` is the base model, counted as SGLang counts it)."""
        return len(set(lora_ids)) <= self.max_loras_per_batch

    def fetch_new_loras(self, new_loras, running_loras=frozenset()) -> None:
        """Every adapter of the batch must be loaded: the lane has no memory pool to fill."""
        self.check_loaded(set(new_loras) | set(running_loras))

    def check_loaded(self, lora_ids) -> None:
        missing = sorted(str(i) for i in lora_ids if i is not None and i not in self.adapters)
        if missing:
            raise LaneRefused(
                f"Lockstep exact lane: the batch names adapter id(s) {', '.join(missing)} the "
                "lane never loaded (nothing runs them on the base model)"
            )

    def prepare_lora_batch(self, forward_batch) -> None:
        ids = forward_batch.lora_ids
        if ids is not None:
            self.check_loaded(ids)

    def reset_lora_batch(self) -> None:
        return None

    def adapter(self, lora_id):
        """The modules of a loaded adapter (None for the base model), or refuse."""
        if lora_id is None:
            return None
        self.check_loaded([lora_id])
        return self.adapters[lora_id]


def init_lora_manager(self):
    """ModelRunner.init_lora_manager: a lane model gets SglangLaneLoRAManager; any other
    model SGLang's own LoRAManager."""
    from sglang.srt.runtime_context import get_lora

    if not isinstance(self.model, LockstepQwen3ForCausalLM):
        return patches.TABLE.original("ModelRunner.init_lora_manager")(self)
    cfg = get_lora()
    self.lora_manager = SglangLaneLoRAManager(self.model, cfg.max_loras_per_batch, cfg.lora_paths)
