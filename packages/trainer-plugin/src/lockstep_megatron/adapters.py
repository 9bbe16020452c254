"""LoRA on the exact lane: where adapters sit, their HF/PEFT names, and the frozen backbone.

Fresh adapters (``attach``) cover the attention and MLP projections (q, k, v, o, gate, up,
down) of every layer (on the hybrid lane: the Gated DeltaNet's in_proj_qkvz, in_proj_ba and
out_proj in its layers, and the shared expert's gate/up/down too); in a MoE layer every
expert's gate/up/down gets its own adapter of rank ``r // topk`` (so the rank a token passes
through, summed over its k experts, is ``r``). A loaded adapter covers the sites it has, with
its own ranks and alphas. Every adapter has PEFT's scale ``alpha / its rank``
(``lockstep_exact.adapters``, shared with the sampler). Master weights are fp32; the forward
(and the export) sees them rounded to bf16.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from lockstep_exact import programs as P
from lockstep_exact.adapters import module_rank, module_shapes
from lockstep_exact.hashing import tensor_sha256

from .gdn.spec import NextSlots
from .spec import ExactLinear, LockstepGPT

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Site:
    """One adapted projection: its HF module name and where it lives in the Megatron model."""

    hf_module: str  # model.layers.N.self_attn.q_proj
    linear: ExactLinear
    part: str
    is_expert: bool


def sites(model: LockstepGPT) -> Iterator[Site]:
    if model.geom.family == "qwen3-next":
        yield from _next_sites(model)
        return
    for i, layer in enumerate(model.gpt.decoder.layers):
        p = f"model.layers.{i}."
        att = layer.self_attention
        for part in ATTN[:3]:
            yield Site(f"{p}self_attn.{part}", att.linear_qkv, part, False)
        yield Site(f"{p}self_attn.o_proj", att.linear_proj, "o_proj", False)
        if model.geom.is_moe:
            moe = layer.mlp  # this rank's experts, by global id (all of them at ep 1)
            for e, ex in zip(moe.local_expert_indices, moe.experts.local_experts, strict=True):
                for part, fc in zip(MLP, ("linear_fc1", "linear_fc1", "linear_fc2"), strict=True):
                    yield Site(f"{p}mlp.experts.{e}.{part}", getattr(ex, fc), part, True)
        else:
            for part, fc in zip(MLP, ("linear_fc1", "linear_fc1", "linear_fc2"), strict=True):
                yield Site(f"{p}mlp.{part}", getattr(layer.mlp, fc), part, False)


def _next_sites(model) -> Iterator[Site]:
    """The hybrid lane's (``gdn.LockstepNext``): every projection ``module_shapes`` lists for
    its geometry (GDN in_proj parts and out_proj, attention q/k/v/o, routed and shared
    experts' gate/up/down), on the Megatron linear that holds it (``gdn.NextSlots.proj``)."""
    slots = NextSlots(model)
    for module in module_shapes(model.geom):
        layer, name = module.removeprefix("model.layers.").split(".", 1)
        linear, part = slots.proj(int(layer), name)
        yield Site(module, linear, part, ".mlp.experts." in module)


def rank_of(model: LockstepGPT, site: Site, rank: int) -> int:
    return module_rank(model.geom, site.hf_module, rank)


def attach(
    model: LockstepGPT,
    rank: int,
    alpha: float,
    seed: int = 0,
    modules: dict[str, tuple[int, float]] | None = None,
) -> LockstepGPT:
    """Add fresh adapters (A random, B = 0: the model's bytes do not change).

    Without ``modules``, on every site with Lockstep's ranks (``module_rank``) and ``alpha``.
    With ``modules`` (HF weight name -> (rank, alpha), e.g. a loaded adapter's), only on those
    sites, with those ranks and alphas: an adapter covering q_proj and v_proj only gets
    LoRA on q_proj and v_proj only. ``rank``/``alpha`` are the adapter config's ``r`` and
    ``lora_alpha`` (what an export writes).
    """
    g = torch.Generator().manual_seed(seed)
    alphas = {}
    for s in sites(model):
        key = s.hf_module + ".weight"
        if modules is None:
            r, a = rank_of(model, s, rank), float(alpha)
        elif key in modules:
            r, a = modules[key]
        else:
            continue
        s.linear.add_lora(s.part, r, a, g)
        alphas[key] = float(a)
    model.lora_config = {"r": rank, "alpha": float(alpha), "alphas": alphas}
    return model


@contextmanager
def set_aside(model: LockstepGPT) -> Iterator[LockstepGPT]:
    """The model without its adapters for the block (the forward runs the base weights only,
    and its invoked contract names no LoRA site); they come back after, untouched."""
    linears = {id(s.linear): s.linear for s in sites(model)}.values()
    held = [(lin, lin.lora) for lin in linears]
    for lin, _ in held:
        lin.lora = torch.nn.ModuleDict()
    try:
        yield model
    finally:
        for lin, lora in held:
            lin.lora = lora


def adapter_parameters(model: LockstepGPT) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if ".lora." in n]


def backbone_hash(model: LockstepGPT) -> str:
    """sha256 over every non-adapter tensor of the model, by name (frozen means unchanged)."""
    h = hashlib.sha256(b"lockstep.backbone.v1\0")
    for name, t in sorted(model.gpt.state_dict().items()):
        if ".lora." in name or name.endswith("_extra_state"):
            continue
        h.update(name.encode() + b"\0" + tensor_sha256(t).encode() + b"\0")
    return h.hexdigest()


def bf16_adapters(model: LockstepGPT) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """``{hf_module.weight: (A, B, scale)}`` in bf16: the reference forward's ``adapters``."""
    out = {}
    for s in sites(model):
        if s.part in s.linear.lora:
            ad = s.linear.lora[s.part]
            out[s.hf_module + ".weight"] = (
                P.round_bf16(ad.A.detach()),
                P.round_bf16(ad.B.detach()),
                ad.scale,
            )
    return out
