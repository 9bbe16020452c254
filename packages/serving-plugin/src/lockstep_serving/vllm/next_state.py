"""The qwen3-next lane's Gated DeltaNet state in vLLM's hybrid cache (imports vLLM: engine only).

vLLM keeps a hybrid model's recurrent state in pages of its KV cache pool, one page per request
and per state layer (``MambaSpec``, ``mamba_cache_mode`` "none"), next to the attention
layers' pages. Each GDN layer of the lane is a ``LaneStateLayer`` here: it declares the page
(``next.state_layout``: the layer's GdnState, its current chunk's cached rows and the conv
window), vLLM allocates and binds it, and ``LaneStateBackend``'s metadata hands the model each
request's page index. No kernel runs here: the model reads and writes the pages itself
(``next.load_cache`` / ``store_cache``), exact copies of the programs' tensors.

Two vLLM versions (docs/vllm-0.26.md, section 5). The layer's ``mamba_type`` is a member of
vLLM's ``MambaAttentionBackendEnum``: vLLM 0.32 adds one for a new name
(``MambaAttentionBackendEnum.register``); 0.26 has no ``register`` and lets an out-of-tree
backend take only the ``CUSTOM`` member it reserves (``register_backend(..., is_mamba=True)``).
The binding: 0.32 hands the layer one raw ``[num_pages, 1, 1, page_bytes]`` int8 view and
``MambaBase.bind_kv_cache`` (inherited) cuts it into one view per state; 0.26's runner makes
those views itself (``GPUModelRunner._reshape_kv_cache_tensors``, same packing: the states in
order, back to back from the page start) and sets ``layer.kv_cache`` to their list. Either way
``kv_cache`` holds one ``[num_pages, *shape]`` view per tensor of the layout, which ``pages``
checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

from ..common.errors import LaneRefused
from .attn_backend import claim_custom, host_seq_lens

BACKEND_PATH = f"{__name__}.LaneStateBackend"
# vLLM 0.32 adds an enum member for a new mamba backend name; 0.26 only lets an out-of-tree
# backend take the CUSTOM member (register_backend(..., is_mamba=True)).
NAMES_ADDED = hasattr(MambaAttentionBackendEnum, "register")
BACKEND_NAME = "LOCKSTEP_GDN_STATE" if NAMES_ADDED else "CUSTOM"
# vLLM's null block: the page its padded requests' block table rows name, given to no request
# (a padded decode step's padding entries write their page mark there).
NULL_PAGE = NULL_BLOCK_ID


def _refuse(msg: str):
    raise LaneRefused(f"Lockstep exact lane refused to start: {msg}")


@dataclass
class LaneStateMetadata:
    """What the lane reads of one batch for its state layers: each request's rows, its cache
    length once this step is computed, and the index of its state page."""

    num_reqs: int
    num_actual_tokens: int
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1]
    seq_lens_cpu: torch.Tensor  # [num_reqs]
    state_slots: torch.Tensor  # [num_reqs] int64, on the engine's device (not read by the host)
    seq_lens: torch.Tensor  # [num_reqs], on the engine's device (the decode step's checks)


class LaneStateMetadataBuilder(AttentionMetadataBuilder[LaneStateMetadata]):
    """Copies the batch's rows and each request's state page; plans nothing.

    CUDA graphs: a step of one-token decodes runs the lane's graph-safe path
    (``next.LockstepQwen3NextForCausalLM._decode_step``), so vLLM may capture those. The
    pages' indices go into one buffer made here, the same memory every step (a captured graph
    reads the addresses it was captured with); vLLM's block table names the null block for a
    padded batch's padding requests."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        mode = vllm_config.cache_config.mamba_cache_mode
        if mode != "none":
            _refuse(
                f"mamba_cache_mode {mode!r}: the qwen3-next lane keeps one state page per "
                "request (mode 'none'); vLLM's per-block state checkpoints are not part of it"
            )
        # Room for every batch vLLM can build: a padded batch has at most as many requests as
        # tokens, and never more tokens than the scheduler's budget or a captured size.
        sched = vllm_config.scheduler_config
        size = max(
            sched.max_num_seqs,
            sched.max_num_batched_tokens,
            vllm_config.compilation_config.max_cudagraph_capture_size or 0,
        )
        self._slots = torch.zeros(size, dtype=torch.int64, device=device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> LaneStateMetadata:
        cm = common_attn_metadata
        n = cm.num_reqs
        # Mode "none": one page per request, the first (only) entry of its block table; kept
        # on the device (a copy to the host would wait for the GPU every step), always in the
        # builder's buffer (a captured graph reads the memory it was captured with).
        if n > self._slots.shape[0]:
            raise LaneRefused(
                f"Lockstep exact lane: a batch of {n} requests, more than the state metadata's "
                f"buffer of {self._slots.shape[0]} (the scheduler's max_num_seqs and "
                "max_num_batched_tokens, the largest captured size)"
            )
        slots = self._slots[:n]
        slots.copy_(cm.block_table_tensor[:n, 0])
        return LaneStateMetadata(
            num_reqs=n,
            num_actual_tokens=cm.num_actual_tokens,
            query_start_loc_cpu=cm.query_start_loc_cpu[: n + 1].clone(),
            seq_lens_cpu=host_seq_lens(cm)[:n],
            state_slots=slots,
            seq_lens=cm.seq_lens[:n],
        )


class LaneStateBackend(AttentionBackend):
    """The state layers' backend: metadata only, no kernel (``is_ssm``: vLLM sizes its pages
    from the layers' ``MambaSpec`` and pads them to the attention page size)."""

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_builder_cls() -> type[LaneStateMetadataBuilder]:
        return LaneStateMetadataBuilder

    @staticmethod
    def get_impl_cls():
        raise LaneRefused(
            "Lockstep exact lane: the qwen3-next state backend has no kernel (the lane runs "
            "Gated DeltaNet inside its model)"
        )

    @classmethod
    def is_ssm(cls) -> bool:
        return True


def register() -> MambaAttentionBackendEnum:
    """The backend's member of vLLM's mamba backend enum, registered once per process.

    vLLM 0.32: a new member LOCKSTEP_GDN_STATE. vLLM 0.26: the CUSTOM member, refused when
    another class already holds it (the lane would take that class's layers' slot)."""
    if NAMES_ADDED:
        if BACKEND_NAME not in MambaAttentionBackendEnum.__members__:
            MambaAttentionBackendEnum.register(BACKEND_NAME, BACKEND_PATH)
        return MambaAttentionBackendEnum[BACKEND_NAME]
    custom = MambaAttentionBackendEnum.CUSTOM
    claim_custom(
        custom,
        BACKEND_PATH,
        "mamba",
        "the qwen3-next lane's state backend",
        "mamba ",
        is_mamba=True,
    )
    return custom


class LaneStateLayer(nn.Module, MambaBase):
    """One GDN layer's state page in vLLM's cache: ``layout`` is ``next.state_layout``
    ((name, shape, dtype) per tensor); after binding, ``kv_cache`` holds one
    ``[num_pages, *shape]`` view per tensor, in that order."""

    def __init__(self, prefix: str, layout, vllm_config):
        super().__init__()
        self.prefix = prefix
        self.layout = tuple(layout)
        self.kv_cache = tuple(torch.empty(0) for _ in self.layout)
        self._type = register()
        ctx = vllm_config.compilation_config.static_forward_context
        if prefix in ctx:
            raise ValueError(f"duplicate layer name {prefix!r}")
        ctx[prefix] = self

    def get_state_shape(self):
        return tuple(shape for _, shape, _ in self.layout)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return tuple(dtype for _, _, dtype in self.layout)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return self._type

    def get_attn_backend(self) -> type[AttentionBackend]:
        return LaneStateBackend

    def pages(self) -> dict[str, torch.Tensor]:
        """The bound views by tensor name, refused if vLLM bound another layout."""
        if len(self.kv_cache) != len(self.layout):
            raise LaneRefused(
                f"Lockstep exact lane: {self.prefix} was bound {len(self.kv_cache)} state "
                f"tensors, not the lane's {len(self.layout)}"
            )
        out = {}
        for (name, shape, dtype), t in zip(self.layout, self.kv_cache, strict=True):
            if t.dtype != dtype or tuple(t.shape[1:]) != tuple(shape):
                raise LaneRefused(
                    f"Lockstep exact lane: {self.prefix} state {name!r} is bound as {t.dtype} "
                    f"{tuple(t.shape[1:])}, not the lane's {dtype} {tuple(shape)}"
                )
            out[name] = t
        return out
