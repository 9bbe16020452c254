"""The qwen3-next lane for vLLM: the shared Qwen3-Next composition over vLLM's hybrid cache.

Every floating-point op is a shared-exact byte program called through
``lockstep_exact.lanes.qwen3_next`` (``hidden`` for the layers, ``final_logits`` for the
head); this module only wires the composition into vLLM:

- the full-attention layers' K/V live in vLLM's paged KV cache, through the lane's attention
  backend (``attn_backend``), written and read per request by ``model.paged_attention``;
- each Gated DeltaNet layer's per-request state lives in vLLM's hybrid state cache: one page
  per request (``mamba_cache_mode`` "none") holding ``state_layout``'s tensors, declared by a
  ``next_state.LaneStateLayer``. At a step each GDN layer runs conv1d.causal and gdn.chunked
  for all requests at once, reading and advancing their pages in place
  (``programs.conv1d_paged``, ``programs.gdn_paged``: each row the bytes of its request's own
  call; one launch each on cuda): once where every request's rows stay inside one gdn chunk
  (every decode step), else a pass per chunk (``programs.paged_passes``: a prefill of 2048
  tokens is 32 passes, each over every request's piece of one chunk). A recording (``lockstep
  bisect``) instead reads each request's pages into the composition's ``NextCache``
  (``load_cache``), advances it and writes it back (``store_cache``): the same bytes.

What a page holds (``state_layout``), for a request whose next token is at position p, with
c = p - p mod chunk the start of p's gdn chunk and w = p - c: the GdnState at c (``s``,
fp32 [Hv, K, V]), the chunk's w cached rows so far (``k`` fp32, ``g`` and ``beta`` fp32,
``v`` bf16; the page has room for ``chunk`` rows) and what the program solved for them
(``u`` and ``gcum`` fp32: a decode step solves only its own row), the conv window (the last W-1 conv
inputs, bf16) and ``meta`` = (p, chunk) int32, which is checked before every read: a page
that does not belong to the request at that position is refused, never read. A request at
position 0 starts from the programs' zero state (vLLM does not clear a reused page).

On cuda (vLLM 0.26.0) a step of one-token decodes with no adapter takes the graph-safe path
(``_decode_step``): row r is request r, the state pages' table is made on the device from the
step's positions and pages (``programs.paged_decodes``: padding rows of a batch vLLM padded
to a captured size, slot mapping < 0, have no rows and write no page), the pages' marks are
checked and advanced on the device, attention runs one paged-decode call a layer; nothing is
read on the host, so vLLM captures these steps in CUDA graphs (``FULL_DECODE_ONLY``; the
state backend declares single-token decodes). Every other step runs eagerly.
docs/vllm-0.26.md, section 5, compares every vLLM touch point of this module and
``next_state`` with 0.26.0.

Refused at start, by name (``_validate``): prefix caching (vLLM resumes a hybrid request
from states it checkpoints at its own block boundaries, a state the lane does not keep; the
lane's engine arguments turn it off), tensor/pipeline/data/expert parallelism, a
mamba cache dtype, speculative decoding, and everything ``model._validate_config``
refuses for the other lanes.

LoRA: as on the dense lane, vLLM decides which request uses which adapter (``LoRARequest``)
and ``lora.LaneLoRAManager`` loads them and hands the model the per-token adapter ids
(``set_token_adapters``); a step runs once per adapter group, each group's rows through the
composition with that adapter in its slots, so no row's bytes depend on another group's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from lockstep_exact import programs as P
from lockstep_exact.contract import ContractMismatch
from lockstep_exact.lanes import qwen3_next as N
from lockstep_exact.lanes.config import UnsupportedModel
from lockstep_exact.lanes.qwen3 import stack_experts
from lockstep_exact.model import geometry_contract
from lockstep_exact.programs.cpu.gdn import default_scale
from lockstep_exact.sites import is_recording, paused

from .._release import check as check_release
from ..common.errors import LaneRefused, _refuse
from ..common.lane import lane_weights
from .model import (
    LIVE,
    DecodeAttention,
    _validate_config,
    lane_backend,
    paged_attention,
    step_places,
    unadapted_experts,
    up,
)

ARCH = "LockstepQwen3NextForCausalLM"
STATE_PREFIX = "model.layers.{}.linear_attn"  # the state layer of GDN layer i
ATTN_PREFIX = "model.layers.{}.self_attn.attn"  # the paged KV cache of attention layer i

F32, BF16 = torch.float32, torch.bfloat16


def state_layout(geom: N.Geometry) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    """(name, shape, dtype) of the tensors of one GDN layer's state page, in page order (the
    4-byte tensors first, so every view is aligned)."""
    c, hk, hv = geom.chunk, geom.linear_key_heads, geom.linear_value_heads
    dk, dv = geom.linear_key_dim, geom.linear_value_dim
    return (
        ("meta", (2,), torch.int32),  # (position of the next token, chunk)
        ("s", (hv, dk, dv), F32),  # GdnState.s at the chunk start
        ("k", (c, hk, dk), F32),  # the chunk's cached rows (first w of c)
        ("g", (c, hv), F32),
        ("beta", (c, hv), F32),
        ("u", (c, hv, dv), F32),  # the cached rows solved (GdnState.u, gcum): not solved again
        ("gcum", (c, hv), F32),
        ("v", (c, hv, dv), BF16),
        ("conv", (geom.conv_kernel - 1, geom.conv_dim), BF16),  # the conv window
    )


def _geometry(vllm_config) -> N.Geometry:
    model_dir = Path(vllm_config.model_config.model)
    try:
        return N.Geometry.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    except (OSError, UnsupportedModel) as err:
        _refuse(str(err))


def page_metas(
    pages: dict[int, dict[str, torch.Tensor]], slots: list[int]
) -> dict[int, dict[int, tuple[int, int]]]:
    """What the state pages ``slots`` of every GDN layer hold, (position, chunk) by slot and
    layer, read from their ``meta`` in one copy to the host: a step reads them once, not once
    a request and layer (each read of the device waits for the GPU to finish its work)."""
    if not pages or not slots:
        return {}
    first = next(iter(pages.values()))["meta"]
    idx = torch.tensor(slots, dtype=torch.int64).to(first.device)
    rows = torch.stack([p["meta"][idx] for p in pages.values()]).tolist()  # [L, R, 2]
    out: dict[int, dict[int, tuple[int, int]]] = {}
    for layer, per_slot in zip(pages, rows, strict=True):
        for slot, (held, chunk) in zip(slots, per_slot, strict=True):
            out.setdefault(slot, {})[layer] = (int(held), int(chunk))
    return out


def check_page(slot: int, layer: int, held: tuple[int, int], position: int, chunk: int) -> None:
    """Refuse a state page that does not hold the request's state at ``position``."""
    at, at_chunk = held
    if (at, at_chunk) != (position, chunk):
        raise LaneRefused(
            f"Lockstep exact lane: the state page {slot} of layer {layer} holds position {at} "
            f"(chunk {at_chunk}) but the request continues at position {position} (chunk "
            f"{chunk}): the page does not belong to this request's state"
        )


CHECKED = object()  # load_cache's ``held`` when check_pages checked the step's pages


def check_positions(positions: torch.Tensor, steps, on_device: bool) -> None:
    """vLLM's positions of each request's rows (``steps``: ``(r, start, end, seq_len,
    first)``) are the cache's ``first .. seq_len - 1``: on cpu read on the host and refused by
    name; on cuda asserted on the device (no host read: one would make the host wait for the
    GPU every step; a failure stops the engine with a device-side assert)."""
    if not steps:
        return
    if on_device:
        idx = [x for _, start, end, _, _ in steps for x in (start, end - 1)]
        want = [x for *_, seq_len, first in steps for x in (first, seq_len - 1)]
        at, expected = up(torch.tensor([idx, want]), positions.device)
        torch._assert_async((positions[at] == expected).all())
        return
    pos = positions.tolist()
    for r, start, end, seq_len, first in steps:
        lo, hi = pos[start], pos[end - 1]
        if lo != first or hi != seq_len - 1:
            raise LaneRefused(
                f"request {r}: vLLM's positions {lo}..{hi} are not the "
                f"cache's {first}..{seq_len - 1}; the lane cannot continue its state there"
            )


def pages_hold(geom: N.Geometry, pages, ids, positions) -> torch.Tensor:
    """[layers, R] bool on the pages' device: whether page ``ids[r]`` of each GDN layer holds
    the state at ``positions[r]`` (``meta`` = (position, chunk)); nothing read on the host."""
    held = torch.stack([p["meta"][ids] for p in pages.values()]).to(torch.int64)  # [L, R, 2]
    pos = positions.to(torch.int64)
    want = torch.stack([pos, torch.full_like(pos, geom.chunk)], dim=-1)
    return (held == want).all(-1)


def check_pages(geom: N.Geometry, pages, slots, steps, on_device: bool) -> None:
    """Every continuing request's state page holds its state at its position (``meta`` =
    (position, chunk) in every GDN layer): on cpu read once (``page_metas``) and a page that
    does not is refused by name (``check_page``); on cuda asserted on the device, no host
    read. ``slots``: each request's page (the state metadata's, on the engine's device)."""
    cont = [(r, first) for r, *_, first in steps if first > 0]
    if not pages or not cont or slots is None:
        return
    if on_device:
        which, firsts = up(torch.tensor([[r for r, _ in cont], [f for _, f in cont]]), slots.device)
        torch._assert_async(pages_hold(geom, pages, slots[which], firsts).all())
        return
    host = slots.tolist()
    metas = page_metas(pages, [host[r] for r, _ in cont])
    for r, first in cont:
        for i in pages:
            check_page(host[r], i, metas[host[r]][i], first, geom.chunk)


def gdn_pages(page: dict[str, torch.Tensor]) -> P.GdnPages:
    """A GDN layer's state page views (``LaneStateLayer.pages``) as the paged programs' pages."""
    return P.GdnPages(**{name: t for name, t in page.items() if name != "meta"})


def load_cache(
    geom: N.Geometry,
    pages: dict[int, dict[str, torch.Tensor]],
    slot: int,
    position,
    held: dict[int, tuple[int, int]] | None = None,
):
    """The composition's ``NextCache`` of one request at ``position``, read from its state
    page ``slot`` of every GDN layer (``pages[layer]``: ``next_state.LaneStateLayer.pages``).
    ``held``: what each layer's page holds, (position, chunk) by layer, as ``page_metas``
    read it for the step (None: read here from the page; ``CHECKED``: the step's
    ``check_pages`` checked it)."""
    cache = N.NextCache(position=position)
    c = geom.chunk
    start = position - position % c
    w = position - start
    for i, p in pages.items():
        if position == 0:
            cache.gdn[i] = P.gdn_state(
                geom.linear_key_heads,
                geom.linear_value_heads,
                geom.linear_key_dim,
                geom.linear_value_dim,
                chunk=c,
                device=p["s"].device,  # the state pages' device: the model's
            )
            cache.conv[i] = P.conv1d_window(
                geom.conv_dim, kernel=geom.conv_kernel, device=p["s"].device
            )
            continue
        if held is not CHECKED:
            at, chunk = held[i] if held is not None else (int(x) for x in p["meta"][slot])
            check_page(slot, i, (at, chunk), position, c)
        cache.gdn[i] = P.GdnState(
            chunk=c,
            start=start,
            s=p["s"][slot].clone(),
            k=p["k"][slot, :w].clone(),
            v=p["v"][slot, :w].clone(),
            g=p["g"][slot, :w].clone(),
            beta=p["beta"][slot, :w].clone(),
            u=p["u"][slot, :w].clone(),
            gcum=p["gcum"][slot, :w].clone(),
        )
        cache.conv[i] = p["conv"][slot].clone()
    return cache


def store_cache(geom: N.Geometry, pages: dict[int, dict[str, torch.Tensor]], slot: int, cache):
    """Write a request's advanced ``NextCache`` back into its state page ``slot``."""
    for i, p in pages.items():
        st = cache.gdn[i]
        w = st.k.shape[0]
        if st.position != cache.position or st.chunk != geom.chunk:
            raise LaneRefused(
                f"Lockstep exact lane: layer {i}'s state is at position {st.position} (chunk "
                f"{st.chunk}), its sequence at {cache.position} (chunk {geom.chunk})"
            )
        p["s"][slot] = st.s
        p["k"][slot, :w] = st.k
        p["v"][slot, :w] = st.v
        p["g"][slot, :w] = st.g
        p["beta"][slot, :w] = st.beta
        if st.u is None:  # a state from the programs always carries them; a page must too
            raise LaneRefused(
                f"Lockstep exact lane: layer {i}'s state has no solved rows (u, gcum) to keep"
            )
        p["u"][slot, :w] = st.u
        p["gcum"][slot, :w] = st.gcum
        p["conv"][slot] = cache.conv[i]
        # filled on the page's device (a copy from a host tensor would wait for the GPU)
        p["meta"][slot, 0].fill_(cache.position)
        p["meta"][slot, 1].fill_(geom.chunk)


def check_decode_pages(geom: N.Geometry, pages, slots, positions, seq_lens, live) -> None:
    """A decode step's checks, on the device (no host read; a CUDA graph replays them): each
    live row r (``live``: its attention slot >= 0) is its request's last token (position =
    sequence length - 1), and a continuing request's page (``slots[r]``) holds its state at
    that position in every GDN layer (``meta`` = (position, chunk)). A failure stops the
    engine with a device-side assert, as ``check_positions`` / ``check_pages`` on cuda."""
    if not pages:
        return
    pos = positions.to(torch.int64)
    ok = ~live | (pos == seq_lens.to(torch.int64) - 1)
    held = pages_hold(geom, pages, torch.where(live, slots.to(torch.int64), 0), pos)
    skip = ~live | (pos == 0)  # padding, and a request that starts here (its page unread)
    torch._assert_async(ok.all() & (held | skip).all())


def advance_metas(geom: N.Geometry, pages, seqs: P.PagedSeqs, null_page: int) -> None:
    """Every page's ``meta`` after a paged step (``seqs``: ``P.paged_seqs``' or
    ``P.paged_decodes``' table): (the next position, chunk) for each sequence with rows, made
    from the table on the device. A padding entry (``paged_decodes``) writes (0, chunk) into
    ``null_page`` (vLLM's null block: a page no request is given), the same bytes for every
    padding entry, so the write order does not matter."""
    t = seqs.table
    live = t[:, 1] > 0
    metas = torch.stack([t[:, 2] + t[:, 1], torch.full_like(t[:, 1], geom.chunk)], dim=1)
    at = torch.where(live, seqs.slot_ids, null_page)
    for p in pages.values():
        p["meta"].index_copy_(0, at, metas.to(p["meta"].dtype))


def _validate(vllm_config) -> tuple[N.Geometry, Path]:
    """``model._validate_config`` plus what the hybrid lane does not cover, by name."""
    geom, model_dir = _validate_config(vllm_config, ARCH)
    check_hybrid(vllm_config, geom)
    return geom, model_dir


def check_hybrid(vllm_config, geom: N.Geometry) -> None:
    """What the qwen3-next lane refuses beyond the other lanes' checks, by name. It runs on
    cpu (vLLM 0.32) and on cuda (vLLM 0.26; decode steps in CUDA graphs where vLLM captures
    them)."""
    from vllm.config.compilation import CUDAGraphMode

    cc = vllm_config.cache_config
    par = vllm_config.parallel_config
    backend = lane_backend(vllm_config)
    graphs = vllm_config.compilation_config.cudagraph_mode if backend == "cuda" else None
    if graphs not in (None, CUDAGraphMode.NONE) and N.FULL not in geom.layer_types:
        # A captured decode step tells its padding rows by the attention layers' slot mapping.
        _refuse(
            f"CUDA graphs (cudagraph_mode {graphs.name}) on a qwen3-next model without a full "
            "attention layer: the lane's captured decode step reads which rows are padding "
            "from an attention layer's slot mapping; start the engine with enforce_eager=True"
        )
    try:
        geometry_contract(geom, backend=backend, tp=par.tensor_parallel_size)
    except ContractMismatch as err:
        _refuse(str(err))
    if cc.enable_prefix_caching:
        _refuse(
            "prefix caching on the qwen3-next lane: vLLM would resume a request from the Gated "
            "DeltaNet state it checkpoints at its own block boundaries, and the lane keeps only "
            "each request's state at its gdn chunk start plus that chunk's rows; start the "
            "engine with enable_prefix_caching=False (lockstep_serving.vllm.offline.engine_args "
            "does)"
        )
    if getattr(cc, "mamba_cache_dtype", "auto") != "auto":
        _refuse(
            f"mamba_cache_dtype {cc.mamba_cache_dtype!r}: the qwen3-next lane keeps its Gated "
            "DeltaNet state in the programs' dtypes (fp32 state, bf16 inputs)"
        )
    if getattr(cc, "mamba_ssm_cache_dtype", "auto") not in ("auto", "float32"):
        _refuse(
            f"mamba_ssm_cache_dtype {cc.mamba_ssm_cache_dtype!r}: the qwen3-next lane keeps "
            "its Gated DeltaNet state in fp32"
        )


def _expected_names(geom: N.Geometry) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not geom.tie_embeddings:
        names.add("lm_head.weight")
    gdn = ["in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "A_log", "dt_bias"]
    gdn += ["norm.weight", "out_proj.weight"]
    attn = [f"{p}_proj.weight" for p in "qkvo"] + ["q_norm.weight", "k_norm.weight"]
    mlp = ["gate.weight", "shared_expert_gate.weight"]
    mlp += [f"shared_expert.{p}_proj.weight" for p in ("gate", "up", "down")]
    for e in range(geom.experts):
        mlp += [f"experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
    for i, kind in enumerate(geom.layer_types):
        pre = f"model.layers.{i}."
        names.update(pre + n for n in ("input_layernorm.weight", "post_attention_layernorm.weight"))
        if kind == N.LINEAR:
            names.update(f"{pre}linear_attn.{n}" for n in gdn)
        else:
            names.update(f"{pre}self_attn.{n}" for n in attn)
        names.update(f"{pre}mlp.{n}" for n in mlp)
    return names


class LockstepQwen3NextForCausalLM(nn.Module):
    """Qwen3-Next on the exact lane (``offline.engine_args`` names it for a
    ``Qwen3NextForCausalLM`` model directory)."""

    lane_arch = ARCH
    # vLLM's hybrid model interface (IsHybrid, HasInnerState): attention pages + state pages.
    is_hybrid = True
    has_inner_state = True
    # LoRA: vLLM's per-request plumbing, applied by LaneLoRAManager (lora.py), not punica.
    supports_lora = True
    _token_adapters: tuple[int, ...] = ()  # adapter id per scheduled token (set_token_adapters)
    embedding_modules: dict[str, str] = {}
    packed_modules_mapping: dict[str, list[str]] = {}

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config):
        return tuple(shape for _, shape, _ in state_layout(_geometry(vllm_config)))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config):
        return tuple(dtype for _, _, dtype in state_layout(_geometry(vllm_config)))

    @classmethod
    def get_mamba_state_copy_func(cls):
        # Only vLLM's 'align' state mode (prefix caching) copies states; the lane refuses it.
        raise LaneRefused(
            "Lockstep exact lane: the qwen3-next lane's state pages are never copied by vLLM "
            "(mamba_cache_mode 'none'; prefix caching is refused)"
        )

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        from vllm.model_executor.layers.attention import Attention

        from . import attn_backend, next_state  # import vLLM: only ever inside an engine

        check_release()  # never start beside a lockstep-exact this release was not built against

        self.geom, self.model_dir = _validate(vllm_config)
        g = self.geom
        self.contract = geometry_contract(g, backend=lane_backend(vllm_config))
        self.ops = N.NextOps(self.contract)  # every program call reads this contract
        self.device = torch.device(vllm_config.device_config.device)
        # Every position vLLM schedules is below this: the bound of the graph-safe decode step.
        self.max_positions = int(vllm_config.model_config.max_model_len)
        self.decode_steps = 0  # decode steps the Python forward ran (a graph replay runs none)
        self.weights: dict[str, torch.Tensor] = {}
        self.gdn_layers = [i for i, k in enumerate(g.layer_types) if k == N.LINEAR]
        self.attn_layers = [i for i, k in enumerate(g.layer_types) if k == N.FULL]
        self.layer_names = {i: ATTN_PREFIX.format(i) for i in self.attn_layers}
        attn_backend.register()
        # vLLM's Attention modules own the attention layers' paged KV cache (forward unused).
        self.attn = nn.ModuleList(
            Attention(
                num_heads=g.heads,
                head_size=g.head_dim,
                scale=g.head_dim**-0.5,
                num_kv_heads=g.kv_heads,
                cache_config=vllm_config.cache_config,
                prefix=name,
                attn_backend=attn_backend.LaneAttentionBackend,
            )
            for name in self.layer_names.values()
        )
        # One state layer per GDN layer: vLLM allocates and binds its pages.
        layout = state_layout(g)
        self.state = nn.ModuleList(
            next_state.LaneStateLayer(STATE_PREFIX.format(i), layout, vllm_config)
            for i in self.gdn_layers
        )
        self._adapters: dict[int, dict] = {}
        self._experts: list[dict[str, torch.Tensor]] | None = None  # load_weights stacks them
        LIVE.add(self)

    # --- weights ---------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # skip "mtp.": the multi-token-prediction head drafts; the lane does not run it
        for name, t in lane_weights(weights, _expected_names(self.geom), skip=("mtp.",)):
            self.weights[name] = t.detach().to(self.device, copy=True)
        # The routed experts run grouped (one launch a projection for all of them): stacked
        # once here; each expert's own entry becomes a view of its stack.
        self._experts = stack_experts(self.weights, self.geom)
        self._slots = N.DictSlots(self.weights, self.geom)
        if self.device.type == "cuda":
            self._warm_tables()
        return set()  # no nn.Parameters: the weights live outside vLLM's parameter tracking

    def _warm_tables(self) -> None:
        """What the graph-safe decode step reads that is made on first use, made now, before
        any CUDA graph capture (a capture cannot copy from the host): rope.partial's tables
        under the engine's position bound and gdn.chunked's q scale."""
        g = self.geom
        if self.attn_layers:
            site = f"layers.{self.attn_layers[0]}.self_attn.q_rope"
            prog = self.ops.program(site, "rope.partial")
            x = torch.zeros(1, 1, g.head_dim, dtype=torch.bfloat16, device=self.device)
            with P.position_bound(self.max_positions):
                P.rope_partial(x, torch.zeros(1, dtype=torch.int64, device=self.device),
                               prog.param("base"), prog.param("rotary"))  # fmt: skip
        if self.gdn_layers:  # made once per device name: both the engine's and the tensors'
            for dev in (self.device, torch.empty(0, device=self.device).device):
                default_scale(g.linear_key_dim, dev)

    # --- forward ---------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.weights["model.embed_tokens.weight"][input_ids]  # embedding.gather

    def set_token_adapters(self, token_ids: tuple[int, ...], adapters: dict[int, dict]):
        """Called by LaneLoRAManager each step: adapter id per scheduled token (0 = base)."""
        self._token_adapters = token_ids
        self._adapters = adapters

    def _pages(self) -> dict[int, dict[str, torch.Tensor]]:
        return {i: layer.pages() for i, layer in zip(self.gdn_layers, self.state, strict=True)}

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **_):
        from vllm.forward_context import get_forward_context, is_forward_context_available

        from .next_state import NULL_PAGE

        n = positions.shape[0]
        out = torch.zeros(n, self.geom.hidden, dtype=torch.bfloat16, device=positions.device)
        if not is_forward_context_available():
            return out
        by_layer = get_forward_context().attn_metadata
        if by_layer is None:
            # A dummy/profile step: no sequence to run and its output is discarded.
            return out
        if inputs_embeds is not None:
            _refuse("inputs_embeds are not part of the lane (token ids only)")
        if not isinstance(by_layer, dict):
            _refuse(f"attention metadata of type {type(by_layer).__name__}, not one per layer")
        smd = by_layer.get(STATE_PREFIX.format(self.gdn_layers[0])) if self.gdn_layers else None
        amd = by_layer.get(self.layer_names[self.attn_layers[0]]) if self.attn_layers else None
        md = smd if smd is not None else amd
        if md is None:
            return out
        if self._one_token_decodes(amd, smd, positions):
            return self._decode_step(input_ids, positions, smd)
        qsl = md.query_start_loc_cpu.tolist()
        seq_lens = md.seq_lens_cpu.tolist()
        if amd is not None and smd is not None and amd.query_start_loc_cpu.tolist() != qsl:
            raise LaneRefused(
                "Lockstep exact lane: the attention and state metadata of one step place the "
                "requests' rows differently"
            )
        # Requests sharing an adapter run together (0: the base weights), each group a call of
        # the composition; groups run in order of first appearance.
        groups: dict[int, tuple[list, list, list]] = {}
        ids = self._token_adapters
        pages = self._pages()
        on_device = positions.is_cuda  # cuda: nothing of the step is read back to the host
        steps = []  # (r, start, end, seq_len, first) of each request with rows
        for r, seq_len in enumerate(seq_lens):
            start, end = qsl[r], qsl[r + 1]
            if end > start:
                steps.append((r, start, end, seq_len, seq_len - (end - start)))
        check_positions(positions, steps, on_device)
        slots_dev = smd.state_slots if smd is not None else None
        # what the continuing requests' pages hold: checked once for the step
        check_pages(self.geom, pages, slots_dev, steps, on_device)
        # The paged programs run all requests at once from and into their pages (a pass per
        # chunk where a request's rows cross a chunk's end: a prefill); a recording reads each
        # request's state into a NextCache and writes it back (the same bytes either way).
        paged = bool(pages) and not is_recording()
        # the per-request path indexes pages on the host (one read of the slots, then)
        host_slots = None if paged or slots_dev is None else slots_dev.tolist()
        for r, start, end, seq_len, first in steps:
            reqs, batch, slots = groups.setdefault(
                ids[start] if start < len(ids) else 0, ([], [], [])
            )
            reqs.append((r, start, end, seq_len))
            if paged:
                slots.append(r)  # the request's index: its page stays on the device
                batch.append((input_ids[start:end], N.NextCache(position=first)))
                continue
            slot = int(host_slots[r]) if host_slots is not None else -1
            slots.append(slot)
            cache = load_cache(self.geom, pages, slot, first, CHECKED)
            batch.append((input_ids[start:end], cache))
        for lid, (reqs, batch, slots) in groups.items():
            adapters = self._adapters.get(lid) if lid else None
            if lid and adapters is None:
                _refuse(f"tokens of adapter id {lid} arrived before the adapter was loaded")
            rows = up(torch.cat([torch.arange(s, e) for _, s, e, _ in reqs]), positions.device)
            slots_ = PagedNextSlots(self, reqs, rows, adapters)
            if paged:
                page_ids = slots_dev[up(torch.tensor(slots), slots_dev.device)]
                slots_.paged = self._paged_step(reqs, batch, page_ids, pages)
            h = N.hidden(self.ops, self.geom, slots_, batch)
            if paged:
                advance_metas(self.geom, pages, slots_.paged[1], NULL_PAGE)
            else:
                for slot, (_, cache) in zip(slots, batch, strict=True):
                    store_cache(self.geom, pages, slot, cache)
            out[rows] = h
        if not groups:
            return out
        if is_recording():
            # lockstep bisect: the final sites of every row, through the lane's own programs.
            logits = N.final_logits(self.ops, self.geom, self._slots, out[: qsl[-1]])
            self.ops.log_softmax("logprobs", logits)
        return out

    def _one_token_decodes(self, amd, smd, positions) -> bool:
        """A step of one-token decodes on cuda with no adapter, outside a recording: it takes
        the graph-safe path (the only kind of step vLLM captures in a CUDA graph for the
        lane). Row r is request r (a batch padded to a captured size included)."""
        return (
            self.device.type == "cuda"
            and amd is not None
            and smd is not None
            and amd.max_query_len == 1
            and amd.num_reqs == positions.shape[0] == smd.num_reqs
            and not any(self._token_adapters)
            and not is_recording()
        )

    def _decode_step(self, input_ids, positions, smd):
        """Every row at once, shapes fixed by the batch, nothing read on the host: which rows
        are live from the first attention layer's slot mapping (padding: < 0), the pages'
        marks checked and advanced on the device, the GDN layers over their pages
        (``programs.paged_decodes``), attention one paged-decode call a layer, the experts
        grouped. Each row gets the bytes of the request-by-request path (the same programs)."""
        from vllm.model_executor.layers.attention.attention import get_attention_context

        from .next_state import NULL_PAGE

        self.decode_steps += 1  # Python runs: a step replayed from a CUDA graph adds none
        n = positions.shape[0]
        first = self.layer_names[self.attn_layers[0]]
        amd, _layer, _kv, slot_mapping = get_attention_context(first)
        live = (slot_mapping if slot_mapping is not None else amd.slot_mapping)[:n] >= 0
        pages = self._pages()
        page_ids = smd.state_slots[:n]
        check_decode_pages(self.geom, pages, page_ids, positions, smd.seq_lens[:n], live)
        seqs = P.paged_decodes(positions, page_ids, live, chunk=self.geom.chunk)
        slots = DecodeNextSlots(self, ({i: gdn_pages(p) for i, p in pages.items()}, seqs))
        with P.position_bound(self.max_positions):
            h = N.hidden_rows(self.ops, self.geom, slots, input_ids, positions)
        advance_metas(self.geom, pages, seqs, NULL_PAGE)
        return h

    def _paged_step(self, reqs, batch, slots, pages):
        """The paged programs' pages (by GDN layer) and table for one adapter group: one
        call where every request stays inside its chunk, else passes (``P.paged_passes``)."""
        starts = [0]
        for _, start, end, _ in reqs:
            starts.append(starts[-1] + end - start)
        seqs = P.paged_passes(
            starts,
            [cache.position for _, cache in batch],
            slots,
            chunk=self.geom.chunk,
            upload=lambda t: up(t, self.device),
        )
        return {i: gdn_pages(p) for i, p in pages.items()}, seqs

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the lane: the composition's final norm + LM head."""
        with paused():  # bisect's final sites come from forward(), for every row
            return N.final_logits(self.ops, self.geom, self._slots, hidden_states)


class PagedNextSlots(N.DictSlots):
    """The composition's slots in vLLM: the engine's weights, this group's adapter (or none)
    and attention over vLLM's paged KV cache (``model.paged_attention``); the GDN state
    travels in the ``NextCache``."""

    def __init__(self, model: LockstepQwen3NextForCausalLM, reqs, rows, adapters=None):
        # The loaded weights, split by layer once (load_weights), not at every step.
        self.weights, self.per_layer = model._slots.weights, model._slots.per_layer
        self.adapters = adapters or {}
        self.model, self.reqs, self.rows = model, reqs, rows
        self.places = None  # the step's cache places (model.step_places), from its first layer
        self.paged = None  # (GdnPages by GDN layer, PagedSeqs): the step runs the paged programs

    def gdn_pages(self, layer):
        if self.paged is None:
            return None
        by_layer, seqs = self.paged
        return by_layer[layer], seqs

    def experts(self, layer):
        return unadapted_experts(self.model, self.adapters, layer)

    def attend(self, layer, q, k, v, segs, positions, core):
        from vllm.model_executor.layers.attention.attention import get_attention_context

        md, _layer, kv_cache, slot_mapping = get_attention_context(self.model.layer_names[layer])
        self.places = step_places(self.places, md, slot_mapping, self.rows, self.reqs,
                                  positions, kv_cache)  # fmt: skip
        return paged_attention(q, k, v, positions, md, kv_cache, self.places, core=core)


class DecodeNextSlots(N.DictSlots):
    """The composition's slots for a step of one-token decodes on cuda (``_decode_step``):
    the engine's weights, no adapter, every GDN layer over the state pages (``paged``: pages
    by layer and the step's ``P.paged_decodes`` table), attention one paged-decode call a
    layer (``model.DecodeAttention``), the experts grouped."""

    def __init__(self, model: LockstepQwen3NextForCausalLM, paged):
        self.weights, self.per_layer = model._slots.weights, model._slots.per_layer
        self.adapters = {}
        self.model, self.paged = model, paged
        self.attention = DecodeAttention(model.ops, model.layer_names)

    def gdn_pages(self, layer):
        by_layer, seqs = self.paged
        return by_layer[layer], seqs

    def experts(self, layer):
        return unadapted_experts(self.model, None, layer)

    def attend(self, layer, q, k, v, segs, positions, core):
        return self.attention(layer, q, k, v, positions, core)
