"""Exact-lane model classes for SGLang: the shared Qwen3 composition over SGLang's KV pool.

Every floating-point op is a shared-exact byte program called through
``lockstep_exact.lanes.qwen3`` (the composition vLLM and Megatron run too); this module only
wires it into SGLang: weights from SGLang's loader, each step's K/V rows copied into the
engine's ``MHATokenToKVPool`` at the batch's ``out_cache_loc``, and each request's keys and
values read back through ``req_to_token`` (the radix cache: a prefix hit is simply a request
whose first positions were written by an earlier one), then the composition's attention site
over them. The forward returns SGLang's ``LogitsProcessorOutput`` holding the lane's fp32
logits of each request's last row; the lane's sampler (``sampler``) takes it from there.
LoRA: requests are grouped by the adapter SGLang assigned them (``ForwardBatch.lora_ids``), and
each group runs the composition with its adapter's factors, from the lane's LoRA manager
(``lora``).

The lane is selected per engine, as in vLLM, by naming its architecture::

    sglang.Engine(
        model_path=...,
        json_model_override_args='{"architectures": ["LockstepQwen3ForCausalLM"]}',
        device="cpu",
        attention_backend="torch_native",
        ...,
    )

(``capture.engine_args`` builds these). Everything the lane cannot run exactly is
refused when the model is built, naming the setting.

The lane's backend is the engine's device, as in vLLM: ``device="cpu"`` (SGLang's CPU engine,
``SGLANG_USE_CPU_ENGINE=1``; SGLang 0.5.21 on the CPU machines) runs the cpu programs and the
cpu lane's contract, ``device="cuda"`` (SGLang 0.5.17 on the GPU machine, CUDA graphs off)
the cuda programs and the cuda lane's contract; weights, adapters and every tensor the lane
makes live on that device, and an adapter must name that lane's contract.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from lockstep_exact import programs as P
from lockstep_exact.lanes import qwen3
from lockstep_exact.lanes.config import FAMILIES, HYBRID_FAMILIES
from lockstep_exact.lanes.ops import Ops
from lockstep_exact.model import lane_contract, model_hash
from lockstep_exact.sites import is_recording, paused

from .._release import check as check_release
from ..common.errors import LaneRefused, _refuse
from ..common.lane import (
    CONTRACT_OVERRIDE,
    _expected_names,
    admit_requested,
    lane_geometry,
    lane_weights,
)
from . import patches

# CONTRACT_OVERRIDE is also the json_model_override_args key carrying the fingerprint asked for.
REPORT_ENV = "LOCKSTEP_SGLANG_REPORT"  # a file the model keeps its invoked contract in

# Lane models alive in this process; while one lives, the lane's sampler applies its rule.
LIVE: weakref.WeakSet = weakref.WeakSet()
# Lane samplers built in this process (the lane model checks one exists).
SAMPLERS: weakref.WeakSet = weakref.WeakSet()

# The lanes SGLang serves: lockstep_exact's Qwen3 / Qwen3-MoE families (its one table); the
# hybrid families (Qwen3-Next) are served by the vLLM plugin only, and refused here by name.
LANE_OF_HF = {hf: f"Lockstep{hf}" for hf in FAMILIES}
# The engine settings the lane needs, and the values it accepts (server args name -> values).
# SGLang's torch_native attention backend on both devices: the lane attends itself (its
# attention site over the pool, ``pool_attention``); the backend only has to leave the pool's
# bytes alone, and on cuda it turns SGLang's CUDA graphs off.
REQUIRED = {
    "attention_backend": ("torch_native",),
    "dtype": ("bfloat16",),
    "kv_cache_dtype": ("auto", "bfloat16", "bf16"),
    "device": ("cpu", "cuda"),
}
# On cuda SGLang's sampling backend is the caller's (flashinfer by default); the lane's sampler
# is registered under this one (on cpu SGLang forces it).
LANE_SAMPLING_BACKEND = "pytorch"
# Settings that must be off: (server args name, what the lane would not cover).
MUST_BE_OFF = (
    ("speculative_algorithm", "speculative decoding (its draft/verify path is not exact)"),
    (
        "enable_lora_overlap_loading",
        "SGLang's LoRA overlap loading (it fills SGLang's LoRA memory pool, which the lane's "
        "LoRA manager replaces)",
    ),
    ("enable_torch_compile", "torch.compile of the model"),
    ("enable_dp_attention", "data-parallel attention"),
    ("enable_deterministic_inference", "SGLang's own deterministic kernels (GPU only)"),
    ("rl_on_policy_target", "SGLang's RL on-policy mode (its own logprob path)"),
)
ONE = ("tp_size", "pp_size", "dp_size", "ep_size")
ACCEPTED_MODES = ("EXTEND", "MIXED", "DECODE", "IDLE")


def lane_backend(sa) -> str:
    """The lane's backend on this engine's device (``ServerArgs.device``), or refuse: cpu on
    SGLang's CPU engine, cuda on a CUDA one whose steps run eagerly."""
    device = str(getattr(sa, "device", None)).split(":")[0]
    cpu_engine = os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"
    if device == "cpu" and not cpu_engine:
        _refuse(
            "SGLANG_USE_CPU_ENGINE=1 is not set: the lane's cpu backend runs on SGLang's CPU "
            "engine only"
        )
    if device == "cuda":
        if cpu_engine:
            _refuse("SGLANG_USE_CPU_ENGINE=1 with device='cuda': the engine would not run on cuda")
        if not torch.cuda.is_available():
            _refuse("device='cuda' but torch sees no CUDA device in the engine's process")
        backend = getattr(sa, "sampling_backend", None)
        if backend != LANE_SAMPLING_BACKEND:
            _refuse(
                f"sampling_backend={backend!r}; on cuda the lane needs "
                f"{LANE_SAMPLING_BACKEND!r} (the lane's sampler is registered under it)"
            )
        on = cuda_graph_phases(sa)
        if on:
            _refuse(
                f"CUDA graphs are on ({', '.join(on)}): the lane's forward reads the batch on "
                "the host every step; start the engine with disable_cuda_graph=True"
            )
    return device


def cuda_graph_phases(sa) -> list[str]:
    """The phases (decode, prefill) whose CUDA graph backend is not 'disabled' in SGLang's
    resolved settings (``cuda_graph_config``, 0.5.17 and 0.5.21 alike); with no such
    settings, both unless ``disable_cuda_graph``."""
    cfg = getattr(sa, "cuda_graph_config", None)
    if cfg is None:
        return [] if getattr(sa, "disable_cuda_graph", False) else ["decode", "prefill"]
    on = []
    for phase in ("decode", "prefill"):
        backend = getattr(getattr(cfg, phase, None), "backend", None)
        if backend != "disabled":
            on.append(f"{phase}: {backend}")
    return on


def _validate(config, quant_config, arch: str) -> tuple[qwen3.Geometry, Path, str]:
    """Everything the lane cannot cover exactly is refused here, by name; the lane's geometry,
    model directory and backend (the engine's device)."""
    from sglang.srt.runtime_context import get_server_args

    check_release()  # never start beside a lockstep-exact this release was not built against
    try:
        patches.check()
    except LaneRefused as err:
        _refuse(str(err))
    sa = get_server_args()
    if quant_config is not None or getattr(sa, "quantization", None):
        _refuse(f"quantized weights ({getattr(sa, 'quantization', None)!r}) have no exact lane")
    for name, accepted in REQUIRED.items():
        value = getattr(sa, name, None)
        if str(value) not in accepted:
            _refuse(f"{name}={value!r}; the lane needs {' or '.join(map(repr, accepted))}")
    backend = lane_backend(sa)
    for name, what in MUST_BE_OFF:
        if getattr(sa, name, None):
            _refuse(f"{name}={getattr(sa, name)!r}: {what} is not part of the lane")
    for name in ONE:
        value = getattr(sa, name, 1)
        if value not in (None, 1):
            _refuse(f"{name}={value}: the SGLang lane runs on one process (no parallelism yet)")
    model_dir = Path(sa.model_path)
    if not (model_dir / "config.json").is_file():
        _refuse(f"{sa.model_path!r} is not a local HF model directory (config.json missing)")
    if not any(True for _ in SAMPLERS):
        _refuse(
            "SGLang did not build the lane's sampler in this process (sampling_backend "
            f"{getattr(sa, 'sampling_backend', None)!r}); the lockstep SGLang plugin registers "
            "it under 'pytorch': is the plugin loaded (entry point sglang.srt.plugins, "
            "SGLANG_PLUGINS)?"
        )
    geom = lane_geometry(arch, model_dir)
    admit_requested(model_dir, backend, getattr(config, CONTRACT_OVERRIDE, None))
    return geom, model_dir, backend


class LockstepQwen3ForCausalLM(nn.Module):
    """Qwen3 on the exact lane, inside SGLang (select with json_model_override_args)."""

    lane_arch = "LockstepQwen3ForCausalLM"
    backend = "cpu"  # each model's is its engine's device (set in __init__)
    device = torch.device("cpu")

    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        self.geom, self.model_dir, self.backend = _validate(config, quant_config, self.lane_arch)
        # The engine's device: SGLang's model runner made its GPU the current one.
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "cuda"
            else torch.device("cpu")
        )
        self.contract = lane_contract(self.model_dir, backend=self.backend)
        self.ops = Ops(self.contract)  # every program call reads this contract
        self.weights: dict[str, torch.Tensor] = {}
        self._layer_weights: list[dict[str, torch.Tensor]] = []
        self._unsampled = 0  # steps whose logits no lane sampler consumed yet
        self._report = os.environ.get(REPORT_ENV)
        self._reported: tuple[int, int] | None = None
        self.steps = 0
        self.samples = 0
        self.lora_manager = None  # lora.SglangLaneLoRAManager, under --enable-lora
        LIVE.add(self)

    def model_hash(self) -> str:
        """The served model's hash (adapters bound to another base model are refused)."""
        if not hasattr(self, "_model_hash"):
            self._model_hash = model_hash(self.model_dir)
        return self._model_hash

    # --- weights ---------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]):
        for name, t in lane_weights(weights, _expected_names(self.geom)):
            self.weights[name] = t.detach().to(self.device, copy=True)  # the engine's device
        self._layer_weights = qwen3.split_layers(self.weights, self.geom)

    def slots(self) -> qwen3.DictSlots:
        return qwen3.DictSlots(self.weights, self.geom, per_layer=self._layer_weights)

    # --- the sampler's side of the run-time check ---------------------------------------------
    def sampled(self) -> None:
        """Called by the lane's sampler for every batch of logits it consumes."""
        self._unsampled = 0
        self.samples += 1
        self.write_report()

    # --- forward ---------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, *args, **kwargs):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput

        fb = forward_batch
        dev = input_ids.device
        if not self.check_step(fb) or input_ids.shape[0] == 0:
            return LogitsProcessorOutput(
                next_token_logits=torch.empty(0, self.geom.vocab, dtype=torch.float32, device=dev)
            )
        reqs = self._requests(fb)
        check_positions(positions, reqs)  # once per step (one host read), not per layer
        bound = position_bound(reqs)
        h = torch.empty(input_ids.shape[0], self.geom.hidden, dtype=torch.bfloat16, device=dev)
        # Requests sharing an adapter run together (the base model is one more group); rows
        # never mix, so each request's bytes are its solo run's. Positions stay below the
        # pool's width per request: promised to rope, which then reads none on the host.
        with P.position_bound(bound):
            for lora_id, group in self._adapter_groups(fb, reqs).items():
                adapters = self.lora_manager.adapter(lora_id) if lora_id is not None else None
                rows = torch.cat([torch.arange(start, end) for _, start, end, _ in group]).to(dev)
                local, at = [], 0
                for b, start, end, seq_len in group:
                    local.append((b, at, at + end - start, seq_len))
                    at += end - start
                slots = PoolSlots(self, fb, local, adapters=adapters, loc=fb.out_cache_loc[rows])
                hg = qwen3.embed(self.ops, slots, input_ids[rows])
                h[rows] = qwen3.layers(self.ops, self.geom, slots, hg, positions[rows])
        last = torch.tensor([end - 1 for _, _, end, _ in reqs], dtype=torch.int64, device=dev)
        with paused():  # bisect's final sites come from every row, below
            logits = qwen3.final_logits(self.ops, self.geom, self.slots(), h[last])
        if is_recording():
            qwen3.logprobs(self.ops, qwen3.final_logits(self.ops, self.geom, self.slots(), h))
        self._unsampled = 1
        self.steps += 1
        self.write_report()
        return LogitsProcessorOutput(next_token_logits=logits)

    def check_step(self, fb) -> bool:
        """Refuse a step the lane cannot run, naming why; False for an idle step."""
        mode = fb.forward_mode
        if mode.name not in ACCEPTED_MODES:
            raise LaneRefused(
                f"Lockstep exact lane: forward mode {mode.name} is not part of the lane "
                f"(it runs {', '.join(ACCEPTED_MODES)})"
            )
        if mode.name == "IDLE":
            return False
        if self._unsampled:
            raise LaneRefused(
                "Lockstep exact lane: the previous step's logits were not consumed by the "
                "lane's sampler; SGLang is sampling with another sampler (its sampling_backend "
                "must resolve to the lane's 'pytorch' registration)"
            )
        if fb.input_embeds is not None:
            raise LaneRefused("Lockstep exact lane: input embeddings are not part of the lane")
        if (
            fb.lora_ids is not None
            and any(x is not None for x in fb.lora_ids)
            and self.lora_manager is None
        ):
            raise LaneRefused(
                "Lockstep exact lane: a LoRA request reached the lane model but the engine's "
                "LoRA manager is not the lane's (start the engine with enable_lora)"
            )
        if fb.spec_info is not None:
            raise LaneRefused("Lockstep exact lane: speculative decoding is not part of the lane")
        return True

    @staticmethod
    def _adapter_groups(fb, reqs) -> dict:
        """The batch's requests by adapter id (None: the base model), in batch order."""
        ids = fb.lora_ids
        groups: dict = {}
        for req in reqs:
            lora_id = ids[req[0]] if ids is not None else None
            groups.setdefault(lora_id, []).append(req)
        return groups

    def _requests(self, fb) -> list[tuple[int, int, int, int]]:
        """(b, start, end, seq_len) per request: its rows in the batch and its cache length."""
        seq_lens = [int(x) for x in fb.seq_lens_cpu.tolist()]
        if fb.forward_mode.is_decode():
            return [(b, b, b + 1, s) for b, s in enumerate(seq_lens)]
        ext = [int(x) for x in fb.extend_seq_lens_cpu]
        if fb.return_logprob:
            starts = [int(x) for x in fb.extend_logprob_start_lens_cpu]
            for b, (n, s) in enumerate(zip(ext, starts, strict=True)):
                if n - s > 0:
                    raise LaneRefused(
                        f"Lockstep exact lane: request {b} asks for prompt logprobs "
                        "(logprob_start_len); the SGLang lane reports sampled-token logprobs only"
                    )
        out, start = [], 0
        for b, (n, s) in enumerate(zip(ext, seq_lens, strict=True)):
            out.append((b, start, start + n, s))
            start += n
        if start != fb.input_ids.shape[0]:
            raise LaneRefused(
                f"Lockstep exact lane: the batch has {fb.input_ids.shape[0]} rows but its "
                f"requests extend by {start}"
            )
        return out

    # --- what the engine actually ran --------------------------------------------------------
    def write_report(self) -> None:
        """Keep the invoked contract in ``$LOCKSTEP_SGLANG_REPORT`` (captures read it: the
        scheduler process holds the model, the capture's process does not)."""
        if not self._report:
            return
        key = (len(self.ops.invoked), self.samples)
        if key == self._reported:
            return
        body = {
            "pid": os.getpid(),
            "declared": self.contract.to_json(),
            "invoked": self.ops.invoked_contract().to_json(),
            "steps": self.steps,
            "samples": self.samples,
            "sampler": "lockstep",
        }
        tmp = f"{self._report}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(body, f, sort_keys=True)
        os.replace(tmp, self._report)
        self._reported = key


class PoolSlots(qwen3.DictSlots):
    """The composition's slots in SGLang: the engine's weights, one adapter group's LoRA
    (None: the base model) and attention over SGLang's token-to-KV pool (``pool_attention``).
    ``reqs`` index the group's rows (``loc``: their cache slots)."""

    def __init__(self, model: LockstepQwen3ForCausalLM, fb, reqs, *, adapters=None, loc=None):
        super().__init__(model.weights, model.geom, adapters, per_layer=model._layer_weights)
        self.fb, self.reqs, self.loc = fb, reqs, loc

    def attend(self, layer, q, k, v, positions, core):
        from sglang.srt.model_executor.forward_context import (
            get_req_to_token_pool,
            get_token_to_kv_pool,
        )

        return pool_attention(
            layer,
            q,
            k,
            v,
            positions,
            self.fb,
            self.reqs,
            get_token_to_kv_pool(),
            get_req_to_token_pool().req_to_token,
            core=core,
            loc=self.loc,
            checked=True,  # the step's positions were checked once, in forward
        )


class LockstepQwen3MoeForCausalLM(LockstepQwen3ForCausalLM):
    """Qwen3-MoE on the exact lane (router, experts and fold are shared programs)."""

    lane_arch = "LockstepQwen3MoeForCausalLM"


def pool_buffers(pool, layer: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's K and V buffers ``[slots, kv_heads, head_dim]``, refused unless they hold
    exactly the lane's rows (an index write into another dtype would cast silently)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if type(pool) is not MHATokenToKVPool:
        raise LaneRefused(
            f"Lockstep exact lane: the KV pool is {type(pool).__name__}, not MHATokenToKVPool "
            "(quantized, hybrid or offloaded KV caches are not part of the lane)"
        )
    kb, vb = pool.get_key_buffer(layer), pool.get_value_buffer(layer)
    _, hkv, d = k.shape
    for name, buf in (("key", kb), ("value", vb)):
        if buf.dim() != 3 or tuple(buf.shape[1:]) != (hkv, d) or buf.dtype != k.dtype:
            raise LaneRefused(
                f"Lockstep exact lane: the layer's {name} buffer is {tuple(buf.shape)} "
                f"{buf.dtype}, not [slots, {hkv}, {d}] {k.dtype}; the pool must hold the "
                "lane's K/V bytes"
            )
    return kb, vb


def position_bound(reqs) -> int:
    """The engine's fixed bound on positions: the width of SGLang's request-to-token table
    (a request holds at most that many cache slots). A request longer than it is refused."""
    from sglang.srt.model_executor.forward_context import get_req_to_token_pool

    width = int(get_req_to_token_pool().req_to_token.shape[1])
    longest = max((seq_len for *_, seq_len in reqs), default=0)
    if longest > width:
        raise LaneRefused(
            f"a request of {longest} positions is longer than SGLang's request-to-token table "
            f"({width} slots a request); the lane cannot place its queries in the cache"
        )
    return width


def check_positions(positions, reqs) -> None:
    """Each request's last query position is its cache length - 1, or refuse (one host read
    of the step's positions: on cuda a sync per step, not per request and layer)."""
    if not reqs:
        return
    last = torch.tensor([end - 1 for _, _, end, _ in reqs], dtype=torch.int64)
    got = positions.reshape(-1)[last.to(positions.device)].tolist()
    for (b, _, _, seq_len), pos in zip(reqs, got, strict=True):
        if int(pos) != seq_len - 1:
            raise LaneRefused(
                f"request {b}: last query position {int(pos)} is not seq_len-1 "
                f"({seq_len - 1}); the lane cannot place its queries in the cache"
            )


def pool_attention(
    layer, q, k, v, positions, fb, reqs, pool, req_to_token, *, core, loc=None, checked=False
):
    """Write this step's K/V rows into the pool, then attend each request over its slots.

    ``reqs`` = [(b, start, end, seq_len)]: request ``b`` of the batch owns rows start..end-1
    (its newest positions) and, once they are written, ``seq_len`` positions in the cache,
    whose slots are ``req_to_token[req_pool_indices[b], :seq_len]`` (a radix-cache hit filled
    the first ones in an earlier step, possibly for another request). Every cache access is an
    exact copy; ``core(q_rows, keys, values, positions)`` is the composition's attention site.
    ``loc``: the rows' cache slots when they are a subset of the batch (one adapter group's;
    their ``reqs`` then index the subset), else the batch's ``out_cache_loc``. ``checked``:
    the query positions were already checked for this step (``check_positions``).
    """
    kb, vb = pool_buffers(pool, layer, k)
    loc = (fb.out_cache_loc if loc is None else loc).to(torch.int64)
    if loc.shape[0] != k.shape[0]:
        raise LaneRefused(
            f"Lockstep exact lane: {k.shape[0]} K/V rows but {loc.shape[0]} cache slots"
        )
    kb[loc] = k
    vb[loc] = v
    out = torch.empty_like(q)
    if not checked:
        check_positions(positions, reqs)
    pool_rows = fb.req_pool_indices.tolist()
    for b, start, end, seq_len in reqs:
        pos = positions[start:end]
        at = req_to_token[pool_rows[b], :seq_len].to(torch.int64)
        out[start:end] = core(q[start:end], kb[at], vb[at], pos)
    return out


def architecture_for(model_dir) -> str:
    """The lane architecture serving ``model_dir`` (from its config.json), or refuse."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch in HYBRID_FAMILIES:
        _refuse(
            f"architecture {arch!r}: its exact lane is served by the vLLM plugin "
            "(lockstep_serving.vllm.next), not SGLang: SGLang keeps a hybrid model's recurrent "
            "state in its MambaPool through HybridLinearAttnBackend's own Gated DeltaNet "
            "kernels, and the lane has no state backend there to run the exact gdn.chunked at "
            f"absolute chunk positions; SGLang serves {sorted(LANE_OF_HF)}"
        )
    if arch not in LANE_OF_HF:
        _refuse(f"architecture {arch!r} has no exact lane; supported: {sorted(LANE_OF_HF)}")
    return LANE_OF_HF[arch]


EntryClass = [LockstepQwen3ForCausalLM, LockstepQwen3MoeForCausalLM]
assert {c.lane_arch for c in EntryClass} == set(LANE_OF_HF.values()), "a lane has no SGLang class"
