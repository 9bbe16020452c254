"""Megatron ModuleSpecs for the Qwen3 / Qwen3-MoE exact lanes, and the model they build.

The model is a real megatron-core ``GPTModel`` (wrapped in ``Float16Module``): its embedding,
``TransformerBlock`` and ``TransformerLayer`` (with its ``SelfAttention`` and MLP / MoE
submodules) are built by Megatron from the specs below and hold every parameter under
Megatron's names. The op order is not restated here: each layer's forward calls the lane
composition (``lockstep_exact.lanes.qwen3.Layer``), and the final norm, LM head and
log_softmax call its final pieces. This module only fills the composition's slots
(``MegatronSlots``): weights from Megatron's (fused) parameters, LoRA from the fp32 masters
rounded to bf16, attention per sequence over Megatron's [s, b] batch, expert dispatch. The
programs run through ``lanes.ops.Ops(grad=True)``: exact forward, textbook VJP backward.

Batches are Megatron's [s, b, h]: sequences right-padded to a common length, each starting at
position 0. The composition runs on the s*b rows; every program is row-invariant and attention
is causal per sequence, so padding rows never reach a real row's bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from lockstep_exact import programs as P
from lockstep_exact.lanes import qwen3
from lockstep_exact.lanes.ops import Ops, to_bf16
from lockstep_exact.lanes.qwen3 import Geometry
from lockstep_exact.layout import DistGather
from lockstep_exact.model import geometry_contract

from ._release import check as check_release
from .cpu import init_single_process
from .linear import (  # noqa: F401 (BF16, ExactLinear, LoRA, _Exact: read as spec.X too)
    BF16,
    ExactLinear,
    LoRA,
    _cols,
    _Exact,
    fc1_parts,
    parallel_linear,
    tp_size,
)
from .moe import expert_linear, moe_config, moe_spec


class _Slot(nn.Module):
    """A submodule Megatron builds and the lane composition replaces: it never runs itself."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            f"{type(self).__name__} runs inside the lane composition (ExactLayer), not alone"
        )


class ExactRMSNorm(nn.Module):
    """An rmsnorm.qwen3 weight (hidden, or head_dim for the q/k norms)."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **_):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=BF16))

    def forward(self, x):
        raise RuntimeError("ExactRMSNorm runs inside the lane composition (ExactLayer)")


class ExactBDA(_Slot):
    """Megatron's bias-dropout-add slot: residual.add runs in the composition."""


class ExactCoreAttention(_Slot):
    """Megatron's core-attention slot: rope + attention.blocked run in the composition."""


def qkv_parts(config) -> dict[str, torch.Tensor]:
    """Megatron's fused QKV rows: per query group g, [q heads of g | k_g | v_g] (this rank's
    groups under tensor parallelism)."""
    d, groups = config.kv_channels, config.num_query_groups // tp_size(config)
    qpg = config.num_attention_heads // config.num_query_groups
    stride = (qpg + 2) * d
    q = torch.cat([_cols(g * stride, qpg * d) for g in range(groups)])
    k = torch.cat([_cols(g * stride + qpg * d, d) for g in range(groups)])
    v = torch.cat([_cols(g * stride + (qpg + 1) * d, d) for g in range(groups)])
    return {"q_proj": q, "k_proj": k, "v_proj": v}


class ExactQKV:
    """SelfAttention's linear_qkv: column-parallel (this rank's query groups). A class (its
    instances are Megatron ``ColumnParallelLinear``s) because Megatron's ``build_module``
    returns a plain function uncalled."""

    def __new__(cls, input_size, output_size, *, config, **_):
        m = parallel_linear("column")(input_size, output_size, qkv_parts(config), config=config)
        assert m.weight.shape[0] == output_size // tp_size(config)
        return m


class ExactProj:
    """SelfAttention's linear_proj (o_proj): row-parallel (this rank's share of K)."""

    def __new__(cls, input_size, output_size, *, config, **_):
        parts = {"o_proj": _cols(0, output_size)}
        return parallel_linear("row")(input_size, output_size, parts, config=config)


class ExactMLP(nn.Module):
    """A dense layer's linear_fc1 (gate|up) and linear_fc2 (down) weights: Megatron's column-
    and row-parallel linears (fc1 holds [gate shard; up shard] on each rank). A MoE layer's
    experts are Megatron's own MLPs (moe.py)."""

    def __init__(self, config, **_):
        super().__init__()
        hidden, ffn, tp = config.hidden_size, config.ffn_hidden_size, tp_size(config)
        self.linear_fc1 = parallel_linear("column")(
            hidden, 2 * ffn, fc1_parts(ffn // tp), config=config
        )
        self.linear_fc2 = parallel_linear("row")(
            ffn, hidden, {"down_proj": _cols(0, hidden)}, config=config
        )

    def linear_for(self, part: str) -> ExactLinear:
        return self.linear_fc2 if part == "down_proj" else self.linear_fc1


def model_weight(gpt, name: str) -> torch.Tensor:
    """The model-level (not per-layer) HF weight ``name`` of Megatron's GPTModel ``gpt``."""
    return {
        "model.embed_tokens.weight": lambda: gpt.embedding.word_embeddings.weight,
        "model.norm.weight": lambda: gpt.decoder.final_layernorm.weight,
        "lm_head.weight": lambda: gpt.output_layer.weight,
    }[name]()


class MegatronSlots(qwen3.Slots):
    """The composition's slots over a Megatron model: weights by HF name, LoRA, attention."""

    def __init__(self, lane: LockstepGPT, s: int, b: int):
        self.lane, self.s, self.b = lane, s, b
        self.grad = torch.is_grad_enabled()
        self.gather = lane.gather  # the tensor-parallel group (one device: P.LOCAL)

    def _linear(self, layer: int, name: str) -> tuple[ExactLinear, str] | None:
        mod = self.lane.gpt.decoder.layers[layer]
        parts = name.split(".")
        part = parts[-1]
        if parts[0] == "self_attn":
            att = mod.self_attention
            return (att.linear_proj if part == "o_proj" else att.linear_qkv), part
        if parts[1] == "experts":  # a global expert id: this rank's expert (moe.py)
            moe = mod.mlp
            return expert_linear(
                moe.experts.local_experts[moe.local_index(int(parts[2]))], part
            ), part
        return mod.mlp.linear_for(part), part

    def weight(self, layer, name):
        gpt = self.lane.gpt
        if layer is None:
            if name == "model.embed_tokens.weight" and self.gather.size > 1:
                # Megatron's vocab-parallel shards, gathered in rank order: the whole table.
                return torch.cat(self.gather.all(gpt.embedding.word_embeddings.weight), dim=0)
            return model_weight(gpt, name)
        mod = gpt.decoder.layers[layer]
        plain = {
            "input_layernorm.weight": lambda: mod.input_layernorm.weight,
            "post_attention_layernorm.weight": lambda: mod.pre_mlp_layernorm.weight,
            "self_attn.q_norm.weight": lambda: mod.self_attention.q_layernorm.weight,
            "self_attn.k_norm.weight": lambda: mod.self_attention.k_layernorm.weight,
            "mlp.gate.weight": lambda: mod.mlp.router.weight,
        }
        if name in plain:
            return plain[name]()
        linear, part = self._linear(layer, name.removesuffix(".weight"))
        return linear.part_weight(part)

    def lora(self, layer, name):
        linear, part = self._linear(layer, name)
        if part not in linear.lora:
            return None
        ad = linear.lora[part]
        return to_bf16(ad.A, grad=self.grad), to_bf16(ad.B, grad=self.grad), ad.scale

    def attend(self, layer, q, k, v, positions, core):
        """One sequence per batch column: rows are [s, b]-ordered, each sequence from 0."""
        s, b = self.s, self.b
        pos = torch.arange(s, device=q.device)
        qs, ks, vs = (t.view(s, b, *t.shape[1:]) for t in (q, k, v))
        outs = [core(qs[:, i], ks[:, i], vs[:, i], pos) for i in range(b)]
        return torch.stack(outs, dim=1).reshape(q.shape)

    def dispatch(self, layer, h, ids, expert):
        """Megatron's MoELayer: at ep > 1 its token dispatcher moves the routed rows to the
        ranks owning their experts and back (moe.py)."""
        return self.lane.gpt.decoder.layers[layer].mlp.lane_dispatch(h, ids, expert)


def _layer_class():
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class ExactLayer(TransformerLayer):
        """Megatron's TransformerLayer whose forward is the lane composition's layer."""

        def forward(self, hidden_states, *args, **kwargs):
            lane: LockstepGPT = self.lane
            s, b, h = hidden_states.shape
            slots = MegatronSlots(lane, s, b)
            rows = hidden_states.reshape(s * b, h)
            positions = torch.arange(s, device=rows.device).repeat_interleave(b)
            ops = lane.ops(rows.device)
            out = qwen3.Layer(lane.geom, self.layer_number - 1, ops, slots)(rows, positions)
            return out.view(s, b, h), kwargs.get("context")

    return ExactLayer


class ExactFinalNorm(nn.Module):
    """TransformerBlock's final_layernorm slot: the composition's final norm."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **_):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=BF16))
        self.lane: LockstepGPT | None = None

    def forward(self, x):
        lane = self.lane
        slots = MegatronSlots(lane, x.shape[0], x.shape[1])
        rows = qwen3.final_norm(lane.ops(x.device), slots, x.reshape(-1, x.shape[-1]))
        return rows.view(x.shape)


def vocab_shard(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """(first column, rows) of tensor-parallel rank ``rank``'s share of the vocabulary, padded
    to a multiple of ``tp`` (Megatron's vocab-parallel embedding wants equal shards); columns
    from ``vocab`` on are padding, cut before log_softmax."""
    rows = -(-vocab // tp)
    return rank * rows, rows


def vocab_rows(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a whole [vocab, hidden] table, padding rows zero."""
    start, rows = vocab_shard(t.shape[0], tp, rank)
    out = t.new_zeros(rows, *t.shape[1:])
    real = t[start : start + rows]
    out[: real.shape[0]] = real
    return out


class _HeadSlots(MegatronSlots):
    """The LM head's slots under tensor parallelism: the tied embedding is this rank's own
    vocabulary rows (Megatron's vocab-parallel shard), not the gathered table."""

    def weight(self, layer, name):
        if layer is None and name == "model.embed_tokens.weight":
            return self.lane.gpt.embedding.word_embeddings.weight
        return super().weight(layer, name)


class _GatherVocab(torch.autograd.Function):
    """The ranks' log-probability shards (``real[r]`` columns each) concatenated in rank
    order: no arithmetic. Backward: this rank's columns of the gradient every rank holds
    (Megatron's gather-from-tensor-parallel-region rule)."""

    @staticmethod
    def forward(ctx, gather, lo, real, lp):
        ctx.lo, ctx.width = lo, lp.shape[-1]
        return gather.cat(lp, real)

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, grad[..., ctx.lo : ctx.lo + ctx.width]


class ExactOutputLayer(nn.Module):
    """The LM head slot: the composition's lm_head (gemm.kblock, fp32 out). At tp > 1 it is
    vocab-parallel: this rank's rows of lm_head (or of the tied embedding) give the logits of
    its vocabulary shard (gemm.kblock computes each output element alone, so these are the
    whole head's bytes for those columns), and ``LockstepGPT.forward`` runs the sharded
    log_softmax.tree on them."""

    def __init__(self, weight: nn.Parameter | None):
        super().__init__()
        self.weight = weight  # None when tied: GPTModel passes the embedding weight
        self.lane: LockstepGPT | None = None

    @classmethod
    def for_lane(cls, geom: Geometry, tp: int) -> ExactOutputLayer:
        """Untied: this rank's rows of lm_head (the whole head at tp 1)."""
        if geom.tie_embeddings:
            return cls(None)
        rows = vocab_shard(geom.vocab, tp, 0)[1]
        return cls(nn.Parameter(torch.zeros(rows, geom.hidden)))

    def forward(self, x, weight=None, runtime_gather_output=None):
        lane = self.lane
        slots = (MegatronSlots if lane.tp == 1 else _HeadSlots)(lane, x.shape[0], x.shape[1])
        rows = qwen3.lm_head(lane.ops(x.device), lane.geom, slots, x.reshape(-1, x.shape[-1]))
        return rows.view(*x.shape[:-1], rows.shape[-1]), None


# --- specs and model -----------------------------------------------------------------------------
def attention_spec(linear_qkv):
    """Megatron's causal SelfAttention with the lane's modules in its slots; ``linear_qkv``
    is the lane's QKV projection of the model at hand."""
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=linear_qkv,
            core_attention=ExactCoreAttention,
            linear_proj=ExactProj,
            q_layernorm=ExactRMSNorm,
            k_layernorm=ExactRMSNorm,
        ),
    )


def layer_spec(geom: Geometry):
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    mlp = moe_spec() if geom.is_moe else ExactMLP
    return ModuleSpec(
        module=_layer_class(),
        submodules=TransformerLayerSubmodules(
            input_layernorm=ExactRMSNorm,
            self_attention=attention_spec(ExactQKV),
            self_attn_bda=ExactBDA,
            pre_mlp_layernorm=ExactRMSNorm,
            mlp=mlp,
            mlp_bda=ExactBDA,
        ),
    )


def block_spec(geom: Geometry):
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    return TransformerBlockSubmodules(
        layer_specs=[layer_spec(geom)] * geom.layers, layer_norm=ExactFinalNorm
    )


def base_config(geom, ffn_hidden_size: int, tp: int = 1) -> dict:
    """The TransformerConfig fields every lane's Megatron model shares: its sizes, RMSNorm with
    q/k norms, SwiGLU, bf16, no dropout and none of Megatron's fused kernels (the lane's
    programs run in their place)."""
    return dict(
        tensor_model_parallel_size=tp,
        num_layers=geom.layers,
        hidden_size=geom.hidden,
        num_attention_heads=geom.heads,
        num_query_groups=geom.kv_heads,
        kv_channels=geom.head_dim,
        ffn_hidden_size=ffn_hidden_size,
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


def transformer_config(geom: Geometry, tp: int = 1, ep: int = 1):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        **moe_config(geom, ep), **base_config(geom, geom.intermediate or geom.moe_intermediate, tp)
    )


class LockstepGPT(nn.Module):
    """``Float16Module(GPTModel)`` with the exact spec, then log_softmax: tokens -> logprobs."""

    def __init__(self, geom: Geometry, tp: int = 1, ep: int = 1):
        super().__init__()
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.module import Float16Module

        check_release()  # never run beside a lockstep-exact this release was not built against
        self.gather = P.LOCAL
        self.tp, self.ep, self.tp_rank = tp, ep, 0
        if tp == 1 and ep == 1:
            init_single_process()
        else:  # the caller's ranks (parallel.py): Megatron's parallel groups are set up
            from megatron.core import parallel_state

            have = parallel_state.get_tensor_model_parallel_world_size()
            if have != tp:
                raise RuntimeError(f"Megatron's tensor-parallel group has {have} ranks, not {tp}")
            have = parallel_state.get_expert_model_parallel_world_size()
            if have != ep:
                raise RuntimeError(f"Megatron's expert-parallel group has {have} ranks, not {ep}")
            if tp > 1:
                self.gather = DistGather(parallel_state.get_tensor_model_parallel_group(), tp)
                self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.geom = geom
        config = transformer_config(geom, tp, ep)
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=block_spec(geom),
            vocab_size=vocab_shard(geom.vocab, tp, 0)[1] * tp,  # geom.vocab at tp 1
            max_sequence_length=1 << 16,
            position_embedding_type="none",
            share_embeddings_and_output_weights=geom.tie_embeddings,
            parallel_output=True,
        )
        gpt.output_layer = ExactOutputLayer.for_lane(geom, tp)
        for p in gpt.parameters():
            p.requires_grad_(False)
        self.model = Float16Module(config, gpt)
        self._ops: dict[str, Ops] = {}
        self._wire()

    def _wire(self) -> None:
        """Point every slot module at this model (its ops, geometry and weights)."""
        gpt = self.gpt
        for layer in gpt.decoder.layers:
            object.__setattr__(layer, "lane", self)  # not a submodule: no cycle in the tree
        object.__setattr__(gpt.decoder.final_layernorm, "lane", self)
        object.__setattr__(gpt.output_layer, "lane", self)

        def embed(_module, args, kwargs, _out):
            ids = kwargs.get("input_ids", args[0] if args else None)
            slots = MegatronSlots(self, ids.shape[1], ids.shape[0])
            rows = qwen3.embed(self.ops(ids.device), slots, ids.t().reshape(-1))
            return rows.view(ids.shape[1], ids.shape[0], -1)

        gpt.embedding.register_forward_hook(embed, with_kwargs=True)

    def ops(self, device: torch.device) -> Ops:
        """The lane's programs on ``device``'s backend, read from that backend's contract."""
        backend = torch.device(device).type
        if backend not in self._ops:
            self._ops[backend] = Ops(geometry_contract(self.geom, backend=backend), grad=True)
        return self._ops[backend]

    def invoked_contract(self, device: torch.device | str = "cpu"):
        """What this model actually ran on ``device`` (after at least one forward)."""
        return self.ops(torch.device(device)).invoked_contract()

    @property
    def gpt(self):
        return self.model.module

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] (right-padded, each sequence from position 0) -> [b, s, V] float32."""
        logits = self.model(input_ids=tokens, position_ids=None, attention_mask=None)
        b, s, v = logits.shape
        ops = self.ops(logits.device)
        if self.tp == 1:
            return qwen3.logprobs(ops, logits.reshape(b * s, v)).view(b, s, v)
        # Vocab-parallel head: this rank's shard of the logits -> its log-probabilities (the
        # unsharded bytes), then every rank's shard in rank order: the whole [b, s, V] row.
        vocab, tp = self.geom.vocab, self.tp
        start, rows = vocab_shard(vocab, tp, self.tp_rank)
        lp = qwen3.logprobs(
            ops, logits.reshape(b * s, v), start=start, vocab=vocab, gather=self.gather
        )
        real = [max(0, min(rows, vocab - vocab_shard(vocab, tp, r)[0])) for r in range(tp)]
        full = _GatherVocab.apply(self.gather, min(start, vocab), real, lp)
        return full.view(b, s, vocab)
