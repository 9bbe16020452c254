"""Exact-lane model classes for vLLM: the shared Qwen3 composition over vLLM's paged KV cache.

Every floating-point op is a shared-exact byte program called through
``lockstep_exact.lanes.qwen3``; this module only wires them into vLLM: weights from the
loader, K/V written into the layer's paged cache through the slot mapping and read back per
sequence through its block table (exact copies), and the composition's attention site over them.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from lockstep_exact import programs as P
from lockstep_exact.contract import ContractMismatch, check_layout
from lockstep_exact.lanes import qwen3
from lockstep_exact.lanes.ops import Ops
from lockstep_exact.layout import DistGather, shard_lora, shard_weight
from lockstep_exact.model import lane_contract
from lockstep_exact.sites import is_recording, paused

from .._release import check as check_release
from ..common.errors import LaneRefused, _refuse
from ..common.lane import (
    CONTRACT_OVERRIDE,
    _expected_names,
    admit_requested,
    lane_geometry,
    lane_weights,
    model_contract,
)
from .patches import check

# Lane models alive in this process; while any lives, the Sampler's logprobs are exact.
LIVE: weakref.WeakSet = weakref.WeakSet()


def lane_backend(vllm_config) -> str:
    """The lane's backend on this engine's device: cpu programs on a cpu engine, cuda
    programs on a cuda one (bytes are compared within a backend only)."""
    device = vllm_config.device_config.device_type
    if device not in ("cpu", "cuda"):
        _refuse(f"device {device!r}: the lane's programs run on cpu and cuda only")
    return device


def _validate_config(vllm_config, arch: str) -> tuple[qwen3.Geometry, Path]:
    """Everything the lane cannot cover exactly is refused here, by name."""
    try:
        check()
    except LaneRefused as err:
        _refuse(str(err))
    if getattr(vllm_config, "use_v2_model_runner", False):
        # vLLM 0.26 runs a dense model on its V2 model runner by default on CUDA; the lane's
        # sampler and LoRA patches live on the V1 runner, so V2 would sample with its own rule.
        _refuse(
            "vLLM chose its V2 model runner, where the lane's sampler is not installed; "
            "start the engine with VLLM_USE_V2_MODEL_RUNNER=0 in its environment"
        )
    backend = lane_backend(vllm_config)
    mc = vllm_config.model_config
    model_dir = Path(mc.model)
    if not (model_dir / "config.json").is_file():
        _refuse(f"{mc.model!r} is not a local HF model directory (config.json missing)")
    if mc.quantization is not None or vllm_config.quant_config is not None:
        _refuse(f"quantized weights ({mc.quantization!r}) have no exact lane")
    if mc.dtype != torch.bfloat16:
        _refuse(f"dtype {mc.dtype} is not supported: the exact lane runs bf16 only")
    if vllm_config.speculative_config is not None:
        _refuse("speculative decoding is not supported (its draft/verify path is not exact)")
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", "bfloat16"):
        _refuse(f"kv_cache_dtype {cache_dtype!r}: the cache must hold the bf16 K/V bytes")
    par = vllm_config.parallel_config
    if par.pipeline_parallel_size != 1:
        _refuse(f"pipeline parallelism ({par.pipeline_parallel_size} stages) is not in the lane")
    if getattr(par, "enable_expert_parallel", False):
        _refuse("vLLM's expert parallelism is not part of the lane yet (tensor parallel only)")
    if par.data_parallel_size != 1:
        _refuse(f"data parallelism ({par.data_parallel_size}) is not part of the lane")
    if mc.logprobs_mode != "raw_logprobs":
        _refuse(f"logprobs_mode {mc.logprobs_mode!r}; start the engine with 'raw_logprobs'")
    _check_graphs(vllm_config)
    geom = lane_geometry(arch, model_dir)
    try:
        check_layout(model_contract(model_dir, backend), tp=par.tensor_parallel_size)
    except ContractMismatch as err:
        _refuse(str(err))
    admit_requested(model_dir, backend, getattr(mc.hf_config, CONTRACT_OVERRIDE, None))
    return geom, model_dir


def _check_graphs(vllm_config) -> None:
    """What the lane allows of vLLM's compilation and CUDA graphs, refused by name otherwise.

    The lane's model is never compiled: vLLM's own compilation only touches models marked for
    it, and ``torch.compile`` of the whole model (STOCK_TORCH_COMPILE) would let Inductor fuse
    and reorder the programs' arithmetic. CUDA graphs capture the lane's one-token decode
    batches (its attention backend declares that much); a graph holds no per-step adapter
    choice and no tensor-parallel gather, so LoRA and tp > 1 run eager."""
    from vllm.config import CompilationMode
    from vllm.config.compilation import CUDAGraphMode

    cc = vllm_config.compilation_config
    if cc.mode == CompilationMode.STOCK_TORCH_COMPILE:
        _refuse(
            "compilation mode STOCK_TORCH_COMPILE would torch.compile the lane's forward "
            "(Inductor may fuse and reorder its programs); use mode NONE (-cc.mode=0)"
        )
    if cc.cudagraph_mode in (None, CUDAGraphMode.NONE):
        return
    if vllm_config.lora_config is not None:
        _refuse(
            "LoRA with CUDA graphs: a captured step cannot choose adapters per request; "
            "start the engine with enforce_eager=True for LoRA"
        )
    if vllm_config.parallel_config.tensor_parallel_size != 1:
        _refuse(
            "CUDA graphs at tensor parallel size "
            f"{vllm_config.parallel_config.tensor_parallel_size}: the lane captures one-GPU "
            "decode steps only; start the engine with enforce_eager=True"
        )


class LockstepQwen3ForCausalLM(nn.Module):
    """Qwen3 on the exact lane (activate with hf_overrides architectures; see README)."""

    lane_arch = "LockstepQwen3ForCausalLM"
    # LoRA: vLLM's per-request plumbing, applied by LaneLoRAManager (lora.py), not punica.
    supports_lora = True
    embedding_modules: dict[str, str] = {}
    packed_modules_mapping: dict[str, list[str]] = {}

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        from vllm.model_executor.layers.attention import Attention

        from . import attn_backend  # imports vLLM: only ever inside an engine

        check_release()  # never start beside a lockstep-exact this release was not built against

        self.geom, self.model_dir = _validate_config(vllm_config, self.lane_arch)
        self.contract = lane_contract(self.model_dir, backend=lane_backend(vllm_config))
        self.ops = Ops(self.contract)  # every program call reads this contract
        g = self.geom
        # Tensor parallelism: this rank holds column-parallel projections by output rows and
        # row-parallel ones by K; their gemm.kpart folds the ranks' fp32 partials in the
        # contract's tree (never vLLM's all-reduce), so every tp gives one device's bytes.
        self.tp = vllm_config.parallel_config.tensor_parallel_size
        self.tp_rank = 0
        self.gather = P.LOCAL
        if self.tp > 1:
            from vllm.distributed import get_tensor_model_parallel_rank, get_tp_group

            self.tp_rank = get_tensor_model_parallel_rank()
            group = get_tp_group()  # gloo for a cpu engine, the device group otherwise
            on_cpu = vllm_config.device_config.device_type == "cpu"
            self.gather = DistGather(group.cpu_group if on_cpu else group.device_group, self.tp)
        self.weights: dict[str, torch.Tensor] = {}
        self.device = torch.device(vllm_config.device_config.device)
        # Every position vLLM schedules is below this: the bound of the graph-safe decode step.
        self.max_positions = int(vllm_config.model_config.max_model_len)
        self.decode_steps = 0
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(g.layers)]
        # vLLM's Attention modules own the paged KV cache; their forward is unused. They run on
        # the lane's own backend (attn_backend.py): no vLLM kernel, so no kernel's shape limits.
        attn_backend.register()
        self.attn = nn.ModuleList(
            Attention(
                num_heads=g.heads // self.tp,
                head_size=g.head_dim,
                scale=g.head_dim**-0.5,
                num_kv_heads=g.kv_heads // self.tp,
                cache_config=vllm_config.cache_config,
                prefix=name,
                attn_backend=attn_backend.LaneAttentionBackend,
            )
            for name in self.layer_names
        )
        self._layer_weights: list[dict[str, torch.Tensor]] = []
        self._experts: list[dict[str, torch.Tensor]] | None = None
        self._token_adapters: tuple[int, ...] = ()
        self._adapters: dict[int, dict] = {}
        LIVE.add(self)

    # --- weights ---------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, t in lane_weights(weights, _expected_names(self.geom)):
            shard = shard_weight(name, t.detach(), self.tp_rank, self.tp)
            self.weights[name] = shard.to(self.device, copy=True)  # the engine's device
        if self.geom.is_moe and self.tp == 1:
            # The experts run grouped (one launch a projection for all of them): stacked once
            # here; each expert's own entry becomes a view of its stack.
            self._experts = qwen3.stack_experts(self.weights, self.geom)
        self._layer_weights = qwen3.split_layers(self.weights, self.geom)
        if self.device.type == "cuda":
            self._warm_position_tables()
        return set()  # no nn.Parameters: the weights live outside vLLM's parameter tracking

    def _warm_position_tables(self) -> None:
        """Run rope once under the engine's position bound, so its table is on the device
        before any CUDA graph capture (a capture cannot copy from the host)."""
        g = self.geom
        base = self.ops.program("layers.0.self_attn.q_rope", "rope.neox").param("base")
        x = torch.zeros(1, 1, g.head_dim, dtype=torch.bfloat16, device=self.device)
        with P.position_bound(self.max_positions):
            P.rope(x, torch.zeros(1, dtype=torch.int64, device=self.device), base)

    def warm_up_lane(self, max_tokens: int, max_seqs: int) -> list[int]:
        """Compile the cuda backend's kernels before the first request: the lane's programs
        run once at each row count of ``warm_rows`` (steps of up to ``max_tokens`` rows, logits
        of up to ``max_seqs``), on dummy tokens, plus the prefill attention over a long prefix
        (per sequence and for many sequences in one call) and one sampler draw. vLLM's own
        warm-up runs the lane only to capture its decode graphs (its dummy steps carry no
        attention metadata), so without this the prefill and sampler kernels compiled during
        the first requests. The runs go through an Ops of their own: the record of what served
        (``self.ops``) stays that. Returns the row counts run; cpu (nothing to compile) and
        tensor parallelism run none."""
        if self.device.type != "cuda" or self.tp != 1:
            return []
        return self.warm(max_tokens, max_seqs)

    def warm(self, max_tokens: int, max_seqs: int) -> list[int]:
        """``warm_up_lane``'s runs on the model's device, whatever it is (a cpu test runs them
        to see what they touch)."""
        rows = warm_rows(max_tokens)
        ops = Ops(self.contract)
        slots = WarmSlots(self)
        dev = self.device
        with torch.no_grad(), paused(), P.position_bound(self.max_positions):
            for n in rows:
                ids = torch.zeros(n, dtype=torch.int64, device=dev)
                # positions inside the bound (a step of more rows than max_model_len holds
                # several sequences): the kernels check them and stop on one outside it
                pos = torch.arange(n, device=dev) % self.max_positions
                qwen3.layers(ops, self.geom, slots, qwen3.embed(ops, slots, ids), pos)
            for n in warm_rows(max_seqs):
                h = torch.zeros(n, self.geom.hidden, dtype=torch.bfloat16, device=dev)
                lp = qwen3.logprobs(ops, qwen3.final_logits(ops, self.geom, slots, h))
            ops.sample("sample", lp, temperature=1.0, top_p=1.0, seeds=[0] * lp.shape[0],
                       positions=list(range(lp.shape[0])))  # fmt: skip
            g = self.geom
            reqs = warm_attention_requests(self.max_positions)
            for queries, keys in reqs:
                q = torch.zeros(queries, g.heads, g.head_dim, dtype=torch.bfloat16, device=dev)
                kv = torch.zeros(keys, g.kv_heads, g.head_dim, dtype=torch.bfloat16, device=dev)
                pos = torch.arange(keys - queries, keys, device=dev)
                ops.attention("layers.0.self_attn.core", q, kv, kv, pos)
            if reqs:  # the same requests in one call: a prefill step's form (paged_attention)
                # offsets made as CachePlaces makes them (one dtype: one compiled kernel)
                q_starts = starts([n for n, _ in reqs], dev)
                k_starts = starts([s for _, s in reqs], dev)
                q = torch.zeros(int(q_starts[-1]), g.heads, g.head_dim, dtype=torch.bfloat16,
                                device=dev)  # fmt: skip
                kv = torch.zeros(int(k_starts[-1]), g.kv_heads, g.head_dim, dtype=torch.bfloat16,
                                 device=dev)  # fmt: skip
                pos = torch.cat([torch.arange(s - n, s, device=dev) for n, s in reqs])
                ops.attention_varlen("layers.0.self_attn.core", q, kv, kv, pos, q_starts,
                                     k_starts, max_rows=max(n for n, _ in reqs))  # fmt: skip
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.warm_ops = ops  # what the warm-up ran (tests read it)
        return rows

    # --- forward ---------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weights["model.embed_tokens.weight"][input_ids]  # embedding.gather

    def set_token_adapters(self, token_ids: tuple[int, ...], adapters: dict[int, dict]):
        """Called by LaneLoRAManager each step: adapter id per scheduled token (0 = base)."""
        self._token_adapters = token_ids
        if self.tp > 1:  # this rank's share of each adapter (column sites: B by rows)
            adapters = {
                lid: {k: shard_lora(k, v, self.tp_rank, self.tp) for k, v in mods.items()}
                for lid, mods in adapters.items()
            }
        self._adapters = adapters

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **_):
        from vllm.forward_context import get_forward_context, is_forward_context_available

        n = positions.shape[0]
        out = torch.zeros(n, self.geom.hidden, dtype=torch.bfloat16, device=positions.device)
        if not is_forward_context_available() or get_forward_context().attn_metadata is None:
            # A dummy/profile step: no sequence to attend over and its output is discarded.
            return out
        if inputs_embeds is not None:
            _refuse("inputs_embeds are not part of the lane (token ids only)")
        from vllm.model_executor.layers.attention.attention import get_attention_context

        md = get_attention_context(self.layer_names[0])[0]
        if md is None:
            return out
        if self._one_token_decodes(md, positions):
            return self._decode_step(input_ids, positions, md)
        # Requests sharing an adapter run together; rows never mix, so each equals its solo run.
        # The host copies of the batch's offsets and lengths: no wait for the device here.
        qsl = md.query_start_loc_cpu.tolist()
        ids = self._token_adapters
        groups: dict[int, list[tuple[int, int, int, int]]] = {}
        for r, seq_len in enumerate(md.seq_lens_cpu.tolist()):
            start, end = qsl[r], qsl[r + 1]
            if end > start:
                lid = ids[start] if start < len(ids) else 0
                groups.setdefault(lid, []).append((r, start, end, seq_len))
        # Positions stay below max_model_len: promised to rope (its kernel checks it), which
        # then reads no position on the host (a host read a layer stalls the step's launches).
        with P.position_bound(self.max_positions):
            for lid, reqs in groups.items():
                adapters = self._adapters.get(lid) if lid else None
                if lid and adapters is None:
                    _refuse(f"tokens of adapter id {lid} arrived before the adapter was loaded")
                rows = up(torch.cat([torch.arange(s, e) for _, s, e, _ in reqs]), positions.device)
                slots = PagedSlots(self, adapters, reqs, rows)
                h = qwen3.embed(self.ops, slots, input_ids[rows])
                out[rows] = qwen3.layers(self.ops, self.geom, slots, h, positions[rows])
        if is_recording():
            # lockstep bisect: the final sites of every row, through the lane's own programs.
            logits = qwen3.final_logits(self.ops, self.geom, self.slots(), out[: qsl[-1]])
            qwen3.logprobs(self.ops, logits)
        return out

    def _one_token_decodes(self, md, positions) -> bool:
        """A step of one-token decodes on cuda with no adapter: it takes the graph-safe path
        (the only kind of step vLLM captures in a CUDA graph for the lane)."""
        return (
            self.device.type == "cuda"
            and md.max_query_len == 1
            and md.num_reqs == positions.shape[0]
            and not any(self._token_adapters)
            and not is_recording()
        )

    def _decode_step(self, input_ids, positions, md):
        """Every row at once, shapes fixed by the batch: K/V written through the slot
        mapping, paged attention over each request's pages, the experts grouped; no host read
        at one device. Each row gets the bytes of the per-request path (the same programs)."""
        self.decode_steps += 1  # Python runs: a step replayed from a CUDA graph adds none
        slots = DecodeSlots(self, md)
        with P.position_bound(self.max_positions):
            h = qwen3.embed(self.ops, slots, input_ids)
            return qwen3.layers(self.ops, self.geom, slots, h, positions)

    def slots(self) -> qwen3.DictSlots:
        slots = qwen3.DictSlots(self.weights, self.geom, per_layer=self._layer_weights)
        slots.gather = self.gather
        return slots

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the lane: the composition's final norm + LM head."""
        with paused():  # bisect's final sites come from forward(), for every row
            return qwen3.final_logits(self.ops, self.geom, self.slots(), hidden_states)


def unadapted_experts(model, adapters, layer: int):
    """A serving slots' ``experts(layer)``: the model's stacked expert weights of ``layer``
    (``qwen3.stack_experts``) for grouped experts, or None where an adapter is in play (its
    expert sites take the per-expert path, each projection with its own factors) or the
    model stacked none."""
    if adapters or model._experts is None:
        return None
    return model._experts[layer]


def warm_attention_requests(max_positions: int) -> list[tuple[int, int]]:
    """The (queries, keys) of the sequences the warm-up's prefill attention runs: one query
    after a prefix past the first 1,024 keys and 17 after a longer one (a prefix of several
    blocks and segments), each cut to the engine's ``max_positions``. Cut, not dropped: the
    many-sequence call compiles its one kernel at any length, and an engine of
    ``max_model_len`` 1024 that ran none compiled it during its first prefill of several
    requests."""
    out: list[tuple[int, int]] = []
    for queries, keys in ((1, 1025), (17, 1040)):
        keys = min(keys, max_positions)
        if (min(queries, keys), keys) not in out:
            out.append((min(queries, keys), keys))
    return out


def warm_rows(max_tokens: int) -> list[int]:
    """The row counts the lane's warm-up runs, up to ``max_tokens``: one row, then each of the
    cuda gemm's tiling buckets (``programs.cuda.gemm.pick_tiling``: fewer than 64 rows, 64-256,
    257-768, 769-2048, more) at a multiple of 16 and one past it (Triton compiles a multiple
    of 16 apart from other sizes), and ``max_tokens`` itself and one below it."""
    marks = [1, 2, 16, 17, 64, 65, 128, 129, 256, 257, 768, 769, 2048, 2049, 4096, 4097]
    return sorted({n for n in [*marks, max_tokens - 1, max_tokens] if 1 <= n <= max_tokens})


def step_places(places, md, slot_mapping, rows, reqs, positions, kv_cache) -> CachePlaces:
    """``places`` where it fits this layer's metadata and cache, else this step's, built now
    (the first layer of a step builds them; the others reuse them)."""
    if places is not None and places.fits(md, kv_cache.shape[2], kv_cache.device):
        return places
    slots = slot_mapping if slot_mapping is not None else md.slot_mapping
    return CachePlaces(md, slots[rows], reqs, positions, kv_cache.shape[2], kv_cache.device)


class WarmSlots(qwen3.DictSlots):
    """The engine's weights, no adapter, the experts grouped as served: the slots of the lane's
    warm-up (``warm_up_lane``, contiguous attention over the dummy sequence) and the base of
    the graph-safe decode's (``DecodeSlots``)."""

    def __init__(self, model: LockstepQwen3ForCausalLM):
        super().__init__(model.weights, model.geom, None, per_layer=model._layer_weights)
        self.model = model
        self.gather = model.gather

    def experts(self, layer):
        return unadapted_experts(self.model, None, layer)


class PagedSlots(qwen3.DictSlots):
    """The composition's slots in vLLM: the engine's weights, this group's adapter, and
    attention over vLLM's paged KV cache (``paged_attention``)."""

    def __init__(self, model: LockstepQwen3ForCausalLM, adapters, reqs, rows):
        super().__init__(model.weights, model.geom, adapters, per_layer=model._layer_weights)
        self.model, self.reqs, self.rows = model, reqs, rows
        self.gather = model.gather
        self.places: CachePlaces | None = None  # the step's, from its first layer

    def experts(self, layer):
        return unadapted_experts(self.model, self.adapters, layer)

    def attend(self, layer, q, k, v, positions, core):
        from vllm.model_executor.layers.attention.attention import get_attention_context

        name = self.model.layer_names[layer]
        md, _layer, kv_cache, slot_mapping = get_attention_context(name)
        self.places = step_places(self.places, md, slot_mapping, self.rows, self.reqs,
                                  positions, kv_cache)  # fmt: skip
        return paged_attention(q, k, v, positions, md, kv_cache, self.places, core=core)


class DecodeSlots(WarmSlots):
    """The composition's slots for a step of one-token decodes on cuda (``_decode_step``):
    one paged-attention call for all requests and the experts grouped (routing read on the
    device), so the step reads nothing on the host and a CUDA graph can capture it. Under
    tensor parallelism the experts take the routed dispatch, eagerly (graphs are refused
    there)."""

    def __init__(self, model: LockstepQwen3ForCausalLM, md):
        super().__init__(model)
        self.md = md
        self.attention = DecodeAttention(model.ops, model.layer_names)

    def attend(self, layer, q, k, v, positions, core):
        return self.attention(layer, q, k, v, positions, core)


class DecodeAttention:
    """``decode_attention`` for the attention layers of one decode step (``layer_names``: by
    layer index), vLLM's invariant checked at the step's first call only."""

    def __init__(self, ops, layer_names):
        self.ops, self.layer_names = ops, layer_names
        self.checked = False

    def __call__(self, layer: int, q, k, v, positions, core):
        out = decode_attention(
            self.ops, self.layer_names[layer], q, k, v, positions, core, check=not self.checked
        )
        self.checked = True
        return out


def decode_attention(ops, layer_name: str, q, k, v, positions, core, *, check: bool):
    """Attention layer ``layer_name`` of a step of one-token decodes (row r is request r; a
    batch vLLM padded to a captured size has padding rows, slot < 0, which attend nothing): the
    rows' K/V written through the slot mapping, one paged-attention call over every request's
    pages; nothing read on the host. ``check``: assert on the device (no host read) that each
    row that writes a slot is its request's last token, vLLM's invariant the lane places
    queries by (once a step is enough: every layer reads the same metadata)."""
    from vllm.model_executor.layers.attention.attention import get_attention_context

    from .attn_backend import LaneAttentionMetadata, kv_halves

    md, _layer, kv_cache, slot_mapping = get_attention_context(layer_name)
    if not isinstance(md, LaneAttentionMetadata):
        raise LaneRefused(
            f"Lockstep exact lane: attention metadata of type {type(md).__name__}; the "
            "lane's layers must run on its own backend (attn_backend.LaneAttentionBackend)"
        )
    n = q.shape[0]
    slots = (slot_mapping if slot_mapping is not None else md.slot_mapping)[:n]
    seq_lens = md.seq_lens[:n]
    if check:
        ok = (slots < 0) | ((seq_lens > 0) & (positions == seq_lens - 1))
        torch._assert_async(ok.all())
    key_cache, value_cache = kv_halves(kv_cache, k)
    P.write_pages(key_cache, value_cache, k, v, slots)
    return ops.attention_decode_paged(
        core.site, q, key_cache, value_cache, md.block_table, seq_lens, positions,
        max_seq_len=md.max_seq_len,
    )  # fmt: skip


class LockstepQwen3MoeForCausalLM(LockstepQwen3ForCausalLM):
    """Qwen3-MoE on the exact lane (router, experts and fold are shared programs)."""

    lane_arch = "LockstepQwen3MoeForCausalLM"


class CachePlaces:
    """Where a step's rows and keys lie in the paged cache, worked out once a step: every layer
    of the lane reads the same block table and slot mapping, so the layers share it.

    ``reqs`` = [(r, start, end, seq_len)] (batch indices; their rows are concatenated in this
    order) and ``positions``/``slots`` hold those rows. For the requests' keys, concatenated in
    the same order (request r's positions 0..seq_len-1): the page and page offset of each
    (``key_pages``/``key_offsets``, one gather reads them all); per request its local rows
    [lo, hi) (``spans``) and keys (``key_spans``), and the same as offsets on the device
    (``q_starts``/``k_starts`` [R + 1], ``max_rows`` the most rows of one request) for the
    one-launch attention; for the rows: the page and offset their K/V are written to.

    Every request's last query position must be its sequence length - 1 (vLLM's invariant: the
    lane places its queries by it). On cpu one host read checks it and refuses the request by
    name; on cuda the check runs on the device (``torch._assert_async``, as the decode step's)
    and the index tensors go up from pinned memory without a wait: a host read, or a blocking
    copy, would make the host wait for the GPU to finish the previous step, and under vLLM's
    async scheduling the host prepares the next step meanwhile."""

    def __init__(self, md, slots, reqs, positions, block_size: int, device):
        from .attn_backend import LaneAttentionMetadata  # imports vLLM: engine only

        if not isinstance(md, LaneAttentionMetadata):
            raise LaneRefused(
                f"Lockstep exact lane: attention metadata of type {type(md).__name__}; the "
                "lane's layers must run on its own backend (attn_backend.LaneAttentionBackend)"
            )
        self.key = (id(md), id(md.block_table), block_size, device)
        bs = block_size
        spans, local = [], 0
        for _r, start, end, _seq_len in reqs:
            spans.append((local, local + (end - start)))
            local += end - start
        last = torch.tensor([hi - 1 for _, hi in spans], dtype=torch.int64)
        want = torch.tensor([seq_len - 1 for *_, seq_len in reqs], dtype=torch.int64)
        check_last_positions(positions, last, want, reqs)
        table = md.block_table.to(device=device, dtype=torch.int64)
        self.spans = spans
        lens = [seq_len for *_, seq_len in reqs]
        k_starts = starts(lens, "cpu")
        self.key_spans = list(itertools.pairwise(k_starts.tolist()))
        at, table_rows = key_places([r for r, *_ in reqs], lens)
        at = up(at, device)
        self.key_pages = table[up(table_rows, device), at // bs]
        self.key_offsets = at % bs
        self.q_starts = up(starts([hi - lo for lo, hi in spans], "cpu"), device)
        self.k_starts = up(k_starts, device)
        self.max_rows = max((hi - lo for lo, hi in spans), default=0)
        # Every request's rows are all its keys (a whole prompt, no cached prefix): the keys
        # and values to attend are the step's own rows, in this order.
        self.fresh = all(
            hi - lo == k_hi - k_lo
            for (lo, hi), (k_lo, k_hi) in zip(spans, self.key_spans, strict=True)
        )
        slots = slots.to(device=device, dtype=torch.int64)
        self.write_pages, self.write_offsets = slots // bs, slots % bs

    def fits(self, md, block_size: int, device) -> bool:
        return self.key == (id(md), id(md.block_table), block_size, device)


def key_places(rows: list[int], lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """For requests of these batch rows and sequence lengths, their keys end to end: each
    key's position in its request (0..seq_len-1) and its request's batch row, int64 on the host.
    Worked out in numpy: torch's ``repeat_interleave`` on host tensors took 6.5 ms a call
    inside a serving engine (H100 machine, under cProfile), on this host 0.03 ms."""
    n = np.asarray(lens, dtype=np.int64)
    first = np.cumsum(n) - n  # where each request's keys begin
    at = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(first, n)
    return torch.from_numpy(at), torch.from_numpy(np.repeat(np.asarray(rows, np.int64), n))


def up(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on ``device``: on cuda from pinned memory without a wait (a copy from
    pageable memory makes the host wait for the stream), elsewhere a plain copy."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def check_last_positions(positions, last, want, reqs, on_device: bool | None = None) -> None:
    """Each request's last query position (``positions[last]``) is its sequence length - 1
    (``want``): on cpu read on the host and refused by name, on cuda (``on_device``, by
    default where ``positions`` lie) asserted on the device (no host read; a failure stops
    the engine with a device-side assert, as in the decode step)."""
    if positions.is_cuda if on_device is None else on_device:
        at, expected = up(torch.stack([last, want]), positions.device)  # one copy up
        torch._assert_async((positions[at] == expected).all())
        return
    got = positions[last].tolist()
    for (r, *_), p, w in zip(reqs, got, want.tolist(), strict=True):
        if int(p) != w:
            raise LaneRefused(
                f"request {r}: last query position {int(p)} is not seq_len-1 "
                f"({w}); the lane cannot place its queries in the cache"
            )


def starts(counts, device) -> torch.Tensor:
    """[0, c0, c0 + c1, ...] int64 on ``device``: where each of items of these counts starts
    when they lie end to end, and where the last ends (the one-launch attention's q_starts and
    k_starts; the warm-up makes its own the same way, so it compiles the kernel that serves)."""
    return torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int64, device=device)


def paged_attention(q, k, v, positions, md, kv_cache, places: CachePlaces, *, core, one_call=None):
    """Write these rows' K/V into the paged cache, then attend every request over its cache.

    q/k/v/positions hold the rows of the step's requests in ``places``'s order (a
    ``CachePlaces`` of this step, built from ``md``; one of another step is refused). ``md``
    is the batch's ``LaneAttentionMetadata`` and ``kv_cache`` the layer's cache in the lane's
    layout (``attn_backend``: [num_blocks, kv_heads, block_size, K|V]); both come from the
    lane's own attention backend. Every cache access is an exact copy.
    ``core`` is the composition's attention op site (the contract's program and parameters:
    there is no default). Every request's keys and values are gathered at once. ``one_call``
    (None: on cuda, for more than one request): all requests attend in one call of the
    site's many-sequence form (``core.varlen``, ``lanes.ops.AttentionSite``: one launch on
    cuda), else
    ``core(q_rows, keys, values, positions)`` runs per request. Either way each row has the
    bytes of the site's program on its request alone. On cpu the per-request calls are the cpu
    program of many sequences itself, and record the reference forward's kernel
    (``cpu.attention``), so a cpu trace's kernel record is the reference's.
    """
    from .attn_backend import kv_halves  # imports vLLM: engine only

    if not places.fits(md, kv_cache.shape[2], kv_cache.device):
        raise LaneRefused(
            "Lockstep exact lane: the cache places were worked out for another step's "
            "attention metadata or cache; the lane cannot place this layer's rows"
        )
    key_cache, value_cache = kv_halves(kv_cache, k)
    key_cache[places.write_pages, :, places.write_offsets] = k
    value_cache[places.write_pages, :, places.write_offsets] = v
    if places.fresh:  # what the gather would read back: these rows' K/V, copied exactly
        ks, vs = k, v
    else:
        ks = key_cache[places.key_pages, :, places.key_offsets]
        vs = value_cache[places.key_pages, :, places.key_offsets]
    if one_call is None:  # one request alone keeps the per-request call (sm_90: Hopper's kernel)
        one_call = q.is_cuda and len(places.spans) > 1
    if one_call:
        return core.varlen(
            q, ks, vs, positions, places.q_starts, places.k_starts, max_rows=places.max_rows
        )
    # A core of one sequence a call: each request over its slice of the gathered keys.
    out = torch.empty_like(q)
    for (lo, hi), (k_lo, k_hi) in zip(places.spans, places.key_spans, strict=True):
        out[lo:hi] = core(q[lo:hi], ks[k_lo:k_hi], vs[k_lo:k_hi], positions[lo:hi])
    return out
