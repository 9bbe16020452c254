"""The lane's own attention backend for vLLM: the paged KV cache of the lane, and no kernels.

The exact lane attends inside its model (``model.paged_attention`` calls the shared
``P.attention`` program), so vLLM needs an attention backend for the lane's layers only to
allocate and bind each layer's paged KV cache and to hand the model the batch's metadata.
vLLM's own backends check shapes against kernels the lane never runs (the CPU one refuses
head_dim 16 on a machine with AVX2 only); this backend declares no kernel limit, builds no
kernel state and refuses to be run as a kernel. The lane's ``Attention`` modules name it
through ``Attention(attn_backend=...)``; stock models keep the backend vLLM selects.

The layout. vLLM hands each layer a ``[num_blocks, kv_heads, block_size, 2 * head_dim]`` view
of the cache, whatever stride order it resolved (every order keeps the last axis innermost).
Token slot ``s`` lives at block ``s // block_size``, row ``s % block_size``; there, per KV
head, ``[:head_dim]`` holds K and ``[head_dim:]`` holds V, both bf16, exact copies of the
rows the lane computed. ``kv_halves`` is the one reader of that layout.

Nothing here assumes a CPU: the metadata keeps the engine's tensors on their device, with
host copies of the two vectors the lane walks in Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from ..common.errors import LaneRefused

BACKEND_PATH = f"{__name__}.LaneAttentionBackend"
KV_CACHE_DTYPES = ("auto", "bfloat16")
# vLLM 0.32 adds an enum member for a new backend name; 0.26 only lets a backend take the
# CUSTOM member it reserves for out-of-tree backends (``Attention`` looks ``get_name()`` up in
# the enum, so the name must be that member's).
NAMES_ADDED = "CUSTOM" not in AttentionBackendEnum.__members__ or hasattr(
    AttentionBackendEnum, "register"
)
BACKEND_NAME = "LOCKSTEP_LANE" if NAMES_ADDED else "CUSTOM"


def _refuse(msg: str):
    raise LaneRefused(f"Lockstep exact lane refused to start: {msg}")


@dataclass
class LaneAttentionMetadata:
    """What the lane reads of one batch: rows per request, cache lengths, pages, slots."""

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1], the request's rows in the batch
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor  # [num_reqs], tokens in the cache once this step has written
    seq_lens_cpu: torch.Tensor
    block_table: torch.Tensor  # [num_reqs, max_blocks], block ids of each request's pages
    slot_mapping: torch.Tensor  # [num_actual_tokens], cache slot of each row


def host_seq_lens(cm) -> torch.Tensor:
    """The batch's sequence lengths on the host: the runner's own host copy where vLLM hands
    it over (0.26: ``_seq_lens_cpu``, the values ``seq_lens`` was copied from; equal without
    speculative decoding, which the lane refuses), else a copy from the device. Reading the
    device tensor every step would wait for the previous step to finish, and under async
    scheduling the host could no longer prepare a step while the GPU runs one."""
    host = getattr(cm, "_seq_lens_cpu", None)
    if isinstance(host, torch.Tensor) and host.shape == cm.seq_lens.shape:
        return host.clone()  # a view of the runner's buffer, which the next step rewrites
    return cm.seq_lens.to("cpu")


class LaneAttentionMetadataBuilder(AttentionMetadataBuilder[LaneAttentionMetadata]):
    """Copies the batch's common metadata into ``LaneAttentionMetadata``; plans nothing.

    CUDA graphs: a step of one-token decodes runs the lane's graph-safe path (no host read,
    shapes fixed by the padded batch; ``model._decode_step``), so vLLM may capture those;
    any other step runs eager."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if vllm_config.kv_transfer_config is not None:
            _refuse(
                "a KV connector (kv_transfer_config) moves cache pages laid out for vLLM's "
                "kernels; the lane's cache layout is its own"
            )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> LaneAttentionMetadata:
        cm = common_attn_metadata
        if cm.causal is not True:
            _refuse(f"attention metadata with causal={cm.causal!r}: the lane attends causally only")
        return LaneAttentionMetadata(
            num_actual_tokens=cm.num_actual_tokens,
            num_reqs=cm.num_reqs,
            max_query_len=cm.max_query_len,
            max_seq_len=cm.max_seq_len,
            query_start_loc=cm.query_start_loc,
            query_start_loc_cpu=cm.query_start_loc_cpu,
            seq_lens=cm.seq_lens,
            seq_lens_cpu=host_seq_lens(cm),
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
        )


class LaneAttentionImpl(AttentionImpl[LaneAttentionMetadata]):
    """Holds the layer's geometry; refuses every option the lane's attention does not have."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra,
    ) -> None:
        refused = {
            "alibi_slopes": alibi_slopes,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap,
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name,
            **extra,
        }
        for name, value in refused.items():
            if value is not None:
                _refuse(f"attention option {name}={value!r} is not part of the lane's attention")
        if attn_type != AttentionType.DECODER:
            _refuse(f"attention type {attn_type!r}: the lane has causal decoder attention only")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            _refuse(f"kv_cache_dtype {kv_cache_dtype!r}: the cache must hold the bf16 K/V bytes")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kw):
        raise LaneRefused(
            "Lockstep exact lane: vLLM asked the lane's attention backend to run attention; "
            "the lane attends inside its model (vllm/model.py: paged_attention) and has no kernel"
        )


class LaneAttentionBackend(AttentionBackend):
    """The backend of the lane's layers: any head size, any block size, bf16 only."""

    # vLLM never writes the cache for these layers: the lane writes its own K/V rows.
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list] = list(KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[LaneAttentionImpl]:
        return LaneAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[LaneAttentionMetadataBuilder]:
        return LaneAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]  # no kernel: every block size, never split

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # every head size the lane's programs take

    @classmethod
    def supported_kv_cache_layouts(cls):
        return None  # kv_halves reads by index, so every stride order vLLM resolves works

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False  # the builder refuses one (kv_transfer_config)

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        cache_dtype_str: str = "auto",
    ) -> tuple[int, ...]:
        """The lane's layout (vLLM 0.26 views each layer's cache with it; 0.32 never asks):
        ``[num_blocks, kv_heads, block_size, 2 * head_size]``, K then V in the last axis, with
        no stride order of its own (so contiguous in that shape), as ``kv_halves`` reads it."""
        if cache_dtype_str not in KV_CACHE_DTYPES:
            _refuse(f"kv_cache_dtype {cache_dtype_str!r}: the cache must hold the bf16 K/V bytes")
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)


def register() -> None:
    """Make the backend known to vLLM (``Attention`` looks it up by name); idempotent.

    vLLM 0.32: a new enum member LOCKSTEP_LANE. vLLM 0.26: the CUSTOM member, refused when
    another class already holds it (the lane would take its layers' slot from it)."""
    if NAMES_ADDED:
        if BACKEND_NAME not in AttentionBackendEnum.__members__:
            register_backend(BACKEND_NAME, BACKEND_PATH)
        return
    claim_custom(AttentionBackendEnum.CUSTOM, BACKEND_PATH, "attention", "the lane's backend", "")


def claim_custom(member, path: str, kind: str, holder: str, sort: str, **register_kw) -> None:
    """vLLM 0.26: put ``path`` in its reserved CUSTOM ``member`` (of the attention or the
    mamba backend enum), refused when another class already holds it (the lane would take
    that class's layers' slot); idempotent. ``sort``: "" or "mamba ", the words before
    "backend" in the refusal's last clause."""
    if member.is_overridden() and member.get_path() != path:
        _refuse(
            f"vLLM's CUSTOM {kind} backend is already registered to {member.get_path()!r}; "
            f"on this vLLM {holder} needs that slot (one out-of-tree {sort}backend per process)"
        )
    register_backend(member, path, **register_kw)


def kv_halves(kv_cache: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V views ``[num_blocks, kv_heads, block_size, head_dim]`` of one layer's cache.

    ``k`` is a ``[tokens, kv_heads, head_dim]`` block of the rows to be written; the cache must
    have its geometry and dtype, or the lane refuses (an index write would cast silently).
    """
    _, hkv, d = k.shape
    if kv_cache.dim() != 4 or kv_cache.shape[1] != hkv or kv_cache.shape[3] != 2 * d:
        raise LaneRefused(
            f"Lockstep exact lane: the layer's KV cache has shape {tuple(kv_cache.shape)}, "
            f"not the lane's layout [num_blocks, {hkv} kv_heads, block_size, 2*{d}]"
        )
    if kv_cache.dtype != k.dtype:
        raise LaneRefused(
            f"Lockstep exact lane: the layer's KV cache is {kv_cache.dtype} but the lane's "
            f"K/V rows are {k.dtype}; the cache must hold their bytes"
        )
    return kv_cache[..., :d], kv_cache[..., d:]
