"""Megatron ModuleSpecs for the Qwen3 / Qwen3-MoE exact lanes, and the model they build.

The model is a real megatron-core ``GPTModel`` (wrapped in ``Float16Module``): its embedding,
``TransformerBlock``, ``TransformerLayer`` and ``SelfAttention`` run their own forward; the
submodules this spec supplies run the shared byte programs at every op site of
``lanes.qwen3.op_sites`` (through ``surrogate``: exact forward, fp32 VJP backward):

  input_layernorm / pre_mlp_layernorm / q,k_layernorm / final_layernorm  ExactRMSNorm
  linear_qkv / linear_proj / linear_fc1 / linear_fc2 / expert fcs        ExactLinear (+LoRA)
  core_attention (rope + attention.blocked per sequence)                ExactCoreAttention
  self_attn_bda / mlp_bda (residual.add)                                ExactBDA
  mlp: SwiGLU MLP or router + experts + moe.fold                        ExactMLP / ExactMoE
  output_layer (gemm.kblock, fp32 out)                                  ExactOutputLayer
  log_softmax                                                           LockstepGPT.forward

Batches are Megatron's [s, b, h]: sequences right-padded to a common length, each starting at
position 0. Every program is row-invariant, and attention is causal per sequence, so padding
rows never reach a real row's bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from lockstep_exact.lanes.qwen3 import Geometry
from lockstep_exact.sites import is_recording, record

from . import surrogate as S

BF16 = torch.bfloat16


def _rec(site: str | None, t: torch.Tensor, sb: bool = True) -> None:
    """Record an op site's output under the lane's name (``lockstep bisect``), one sequence:
    Megatron's [s, b=1, ...] becomes the composition's [T, ...]."""
    if site is None or not is_recording():
        return
    if sb:
        if t.shape[1] != 1:
            raise ValueError("op sites are recorded for one sequence at a time (b = 1)")
        t = t[:, 0]
    record(site, t)


# --- norms and residual ------------------------------------------------------------------------
class ExactRMSNorm(nn.Module):
    """rmsnorm.qwen3 over the last dim (hidden, or head_dim for the q/k norms)."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **_):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=BF16))
        self.site: str | None = None

    def forward(self, x):
        y = S.rmsnorm(x, self.weight, self.eps)
        _rec(self.site, y)
        return y


class ExactBDA(nn.Module):
    """Megatron's bias-dropout-add slot: no bias, no dropout (fail closed), residual.add."""

    def __init__(self):
        super().__init__()
        self.site: str | None = None

    def forward(self, training: bool = False, fused: bool = False):
        def bda(x_with_bias, residual, prob):
            x, bias = x_with_bias
            if bias is not None or (training and prob > 0):
                raise ValueError("the exact lane has no linear bias and no hidden dropout")
            y = S.residual_add(residual, x)
            _rec(self.site, y)
            return y

        return bda


# --- linear layers -------------------------------------------------------------------------------
class ExactLinear(nn.Module):
    """gemm.kblock over a (possibly fused) weight [N, K] whose output columns are split into
    named parts (the HF projections); LoRA, when added, is per part."""

    def __init__(self, input_size: int, parts: dict[str, torch.Tensor]):
        super().__init__()
        out = sum(len(c) for c in parts.values())
        self.weight = nn.Parameter(torch.zeros(out, input_size, dtype=BF16), requires_grad=False)
        self.parts = dict(parts)
        order = torch.cat(list(parts.values()))
        self.register_buffer("_inverse", torch.argsort(order), persistent=False)
        self.lora = nn.ModuleDict()
        self.site: str | None = None  # e.g. layers.0.self_attn; parts are recorded under it

    def add_lora(self, part: str, rank: int, alpha: float, generator: torch.Generator):
        """A ~ kaiming-like uniform, B = 0 (PEFT's init): a new adapter changes no byte."""
        k = self.weight.shape[1]
        bound = 1.0 / k**0.5
        a = (torch.rand(rank, k, generator=generator, dtype=torch.float32) * 2 - 1) * bound
        b = torch.zeros(len(self.parts[part]), rank, dtype=torch.float32)
        self.lora[part] = LoRA(a, b, alpha / rank)

    def forward(self, x):
        base = S.gemm(x, self.weight)
        recording = self.site is not None and is_recording()
        if not len(self.lora) and not recording:
            return base, None
        pieces = []
        for name, cols in self.parts.items():
            y = base[..., cols] if len(self.parts) > 1 else base
            if name in self.lora:
                ad = self.lora[name]
                a, b = S.to_bf16(ad.A), S.to_bf16(ad.B)
                y = S.lora_expand(y, S.lora_shrink(x, a), b, ad.scale)
            _rec(self.site and f"{self.site}.{name}", y, sb=x.dim() == 3)
            pieces.append(y)
        if len(pieces) == 1:
            return pieces[0], None
        return torch.cat(pieces, dim=-1)[..., self._inverse], None

    def set_site(self, site: str) -> None:
        self.site = site


class LoRA(nn.Module):
    """fp32 master weights A [r, K], B [N, r]; the forward sees them rounded to bf16."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scale: float):
        super().__init__()
        self.A = nn.Parameter(a)
        self.B = nn.Parameter(b)
        self.scale = float(scale)


def _cols(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n)


def qkv_parts(config) -> dict[str, torch.Tensor]:
    """Megatron's fused QKV rows: per query group g, [q heads of g | k_g | v_g]."""
    d, groups = config.kv_channels, config.num_query_groups
    qpg = config.num_attention_heads // groups
    stride = (qpg + 2) * d
    q = torch.cat([_cols(g * stride, qpg * d) for g in range(groups)])
    k = torch.cat([_cols(g * stride + qpg * d, d) for g in range(groups)])
    v = torch.cat([_cols(g * stride + (qpg + 1) * d, d) for g in range(groups)])
    return {"q_proj": q, "k_proj": k, "v_proj": v}


class ExactQKV(ExactLinear):
    def __init__(self, input_size, output_size, *, config, **_):
        super().__init__(input_size, qkv_parts(config))
        assert self.weight.shape[0] == output_size


class ExactProj(ExactLinear):
    def __init__(self, input_size, output_size, *, config=None, **_):
        super().__init__(input_size, {"o_proj": _cols(0, output_size)})


def fc1_parts(ffn: int) -> dict[str, torch.Tensor]:
    """Megatron's gated fc1: [gate; up] along the output."""
    return {"gate_proj": _cols(0, ffn), "up_proj": _cols(ffn, ffn)}


class ExactMLP(nn.Module):
    """linear_fc1 (gate|up), swiglu, linear_fc2 (down)."""

    def __init__(self, config=None, hidden: int = 0, ffn: int = 0, **_):
        super().__init__()
        hidden = hidden or config.hidden_size
        ffn = ffn or config.ffn_hidden_size
        self.ffn = ffn
        self.linear_fc1 = ExactLinear(hidden, fc1_parts(ffn))
        self.linear_fc2 = ExactLinear(ffn, {"down_proj": _cols(0, hidden)})
        self.site: str | None = None

    def set_site(self, site: str) -> None:
        self.site = site
        self.linear_fc1.site = self.linear_fc2.site = site

    def rows(self, x):
        gu, _ = self.linear_fc1(x)
        act = S.swiglu(gu[..., : self.ffn], gu[..., self.ffn :])
        _rec(self.site and f"{self.site}.act", act, sb=x.dim() == 3)
        return self.linear_fc2(act)[0]

    def forward(self, x, padding_mask=None):
        return self.rows(x), None


class ExactRouter(nn.Module):
    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden, dtype=BF16), requires_grad=False)


class _Experts(nn.Module):
    def __init__(self, hidden: int, ffn: int, experts: int):
        super().__init__()
        self.local_experts = nn.ModuleList(ExactMLP(hidden=hidden, ffn=ffn) for _ in range(experts))


class ExactMoE(nn.Module):
    """router gemm, router.softmax_topk, per-expert SwiGLU MLP, moe.fold (EP = 1)."""

    geometry: Geometry | None = None  # set by the spec (the class is built per geometry)

    def __init__(self, config=None, **_):
        super().__init__()
        g = self.geometry
        self.topk, self.norm_topk = g.topk, g.norm_topk
        self.router = ExactRouter(g.hidden, g.experts)
        self.experts = _Experts(g.hidden, g.moe_intermediate, g.experts)
        self.site: str | None = None

    def set_site(self, site: str) -> None:
        self.site = site
        for e, expert in enumerate(self.experts.local_experts):
            expert.set_site(f"{site}.experts.{e}")

    def _rec(self, name: str, t: torch.Tensor) -> None:
        _rec(self.site and f"{self.site}.{name}", t, sb=False)

    def forward(self, x, padding_mask=None):
        shape = x.shape
        h = x.reshape(-1, shape[-1])
        logits = S.gemm(h, self.router.weight)
        self._rec("gate", logits)
        ids, weights = S.router_weights(logits, self.topk, self.norm_topk)
        self._rec("router_ids", ids)
        self._rec("router_weights", weights)
        rows_all, slots_all, outs = [], [], []
        for e in torch.unique(ids).tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            outs.append(self.experts.local_experts[e].rows(h[rows]))
            rows_all.append(rows)
            slots_all.append(slot)
        out = h.new_zeros(h.shape[0], self.topk, h.shape[1]).index_put(
            (torch.cat(rows_all), torch.cat(slots_all)), torch.cat(outs)
        )
        y = S.moe_fold(out, weights)
        self._rec("fold", y)
        return y.reshape(shape), None


# --- attention -----------------------------------------------------------------------------------
class ExactCoreAttention(nn.Module):
    """rope.neox then attention.blocked, one sequence at a time (contiguous K/V, from 0)."""

    geometry: Geometry | None = None  # set by the spec (the class is built per geometry)

    def __init__(self, config=None, layer_number=1, attn_mask_type=None, **_):
        super().__init__()
        self.base = self.geometry.rope_theta
        self.site: str | None = None  # layers.N.self_attn

    def forward(self, query, key, value, attention_mask=None, **_):
        s, b = query.shape[:2]
        positions = torch.arange(s, device=query.device)
        site = self.site if b == 1 else None
        outs = []
        for i in range(b):
            q = S.rope(query[:, i], positions, self.base)
            k = S.rope(key[:, i], positions, self.base)
            _rec(site and f"{site}.q_rope", q, sb=False)
            _rec(site and f"{site}.k_rope", k, sb=False)
            o = S.attention(q, k, value[:, i], positions)
            _rec(site and f"{site}.core", o, sb=False)
            outs.append(o.reshape(s, -1))
        return torch.stack(outs, dim=1)


class ExactOutputLayer(nn.Module):
    """The LM head: gemm.kblock with an fp32 result (replaces GPTModel's ColumnParallelLinear)."""

    def __init__(self, weight: nn.Parameter | None):
        super().__init__()
        self.weight = weight  # None when tied: GPTModel passes the embedding weight

    def forward(self, x, weight=None, runtime_gather_output=None):
        w = weight if weight is not None else self.weight
        logits = S.gemm(x, w, out_dtype=torch.float32)
        _rec("lm_head", logits)
        return logits, None


# --- specs and model -----------------------------------------------------------------------------
def layer_spec(geom: Geometry):
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    mlp = type("ExactMoE", (ExactMoE,), {"geometry": geom}) if geom.is_moe else ExactMLP
    core = type("ExactCoreAttention", (ExactCoreAttention,), {"geometry": geom})
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=ExactRMSNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ExactQKV,
                    core_attention=core,
                    linear_proj=ExactProj,
                    q_layernorm=ExactRMSNorm,
                    k_layernorm=ExactRMSNorm,
                ),
            ),
            self_attn_bda=ExactBDA,
            pre_mlp_layernorm=ExactRMSNorm,
            mlp=mlp,
            mlp_bda=ExactBDA,
        ),
    )


def block_spec(geom: Geometry):
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    return TransformerBlockSubmodules(
        layer_specs=[layer_spec(geom)] * geom.layers, layer_norm=ExactRMSNorm
    )


def transformer_config(geom: Geometry):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=geom.layers,
        hidden_size=geom.hidden,
        num_attention_heads=geom.heads,
        num_query_groups=geom.kv_heads,
        kv_channels=geom.head_dim,
        ffn_hidden_size=geom.intermediate or geom.moe_intermediate,
        normalization="RMSNorm",
        layernorm_epsilon=geom.eps,
        qk_layernorm=True,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=BF16,
        use_cpu_initialization=True,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


class LockstepGPT(nn.Module):
    """``Float16Module(GPTModel)`` with the exact spec, then log_softmax: tokens -> logprobs."""

    def __init__(self, geom: Geometry):
        super().__init__()
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.module import Float16Module

        from ._release import check
        from .cpu import init_single_process

        check()  # never run beside a lockstep-exact this release was not built against
        init_single_process()
        self.geom = geom
        config = transformer_config(geom)
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=block_spec(geom),
            vocab_size=geom.vocab,
            max_sequence_length=1 << 16,
            position_embedding_type="none",
            share_embeddings_and_output_weights=geom.tie_embeddings,
            parallel_output=True,
        )
        gpt.output_layer = ExactOutputLayer(
            None if geom.tie_embeddings else nn.Parameter(torch.zeros(geom.vocab, geom.hidden))
        )
        for p in gpt.parameters():
            p.requires_grad_(False)
        self.model = Float16Module(config, gpt)
        self._name_sites()

    def _name_sites(self) -> None:
        """Give every exact submodule the op-site name the lane composition records."""
        gpt = self.gpt
        gpt.embedding.register_forward_hook(lambda _m, _i, out: _rec("embed_tokens", out))
        for i, layer in enumerate(gpt.decoder.layers):
            p = f"layers.{i}"
            att = layer.self_attention
            layer.input_layernorm.site = f"{p}.input_layernorm"
            att.linear_qkv.site = att.linear_proj.site = att.core_attention.site = f"{p}.self_attn"
            att.q_layernorm.site = f"{p}.self_attn.q_norm"
            att.k_layernorm.site = f"{p}.self_attn.k_norm"
            layer.self_attn_bda.site = f"{p}.residual_attn"
            layer.pre_mlp_layernorm.site = f"{p}.post_attention_layernorm"
            layer.mlp.set_site(f"{p}.mlp")
            layer.mlp_bda.site = f"{p}.residual_mlp"
        gpt.decoder.final_layernorm.site = "norm"

    @property
    def gpt(self):
        return self.model.module

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] (right-padded, each sequence from position 0) -> [b, s, V] float32."""
        logits = self.model(input_ids=tokens, position_ids=None, attention_mask=None)
        lp = S.log_softmax(logits)
        if tokens.shape[0] == 1 and is_recording():
            record("logprobs", lp[0])
        return lp
