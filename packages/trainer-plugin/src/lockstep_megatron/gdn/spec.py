"""Megatron's Qwen3-Next model for the qwen3-next lane: the fused weights' rows, megatron-core's
classes with the composition in their forward, the composition's slots over the modules, the
ModuleSpecs and TransformerConfig, and ``LockstepNext`` (the package docstring, ``gdn``, says
what Megatron builds and what runs)."""

from __future__ import annotations

import torch
from torch import nn

from lockstep_exact import programs as P
from lockstep_exact.lanes import qwen3_next as N
from lockstep_exact.lanes.ops import to_bf16
from lockstep_exact.model import geometry_contract

from .._release import check as check_release
from ..cpu import init_single_process
from ..moe import expert_linear, moe_config, moe_spec
from ..spec import (
    BF16,
    ExactBDA,
    ExactRMSNorm,
    _cols,
    attention_spec,
    base_config,
    fc1_parts,
    model_weight,
    parallel_linear,
)
from .bypass import _composition_only, _fla_check_passed
from .refusals import HybridRefused


# --- the fused weights' rows -------------------------------------------------------------------
def in_proj_parts(config) -> dict[str, torch.Tensor]:
    """Rows of GatedDeltaNet's in_proj, [q | k | v | z | beta | alpha] with every head of each
    part in head order, that give HF's two projections in their row order: in_proj_qkvz (per
    key head: its q, its k, then its r = Hv / Hk value heads' v and z) and in_proj_ba (per key
    head: its value heads' b (Megatron's beta), then their a (alpha))."""
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    r, kd, vd = hv // hk, hk * dk, hv * dv
    q0, k0, v0, z0, b0, a0 = 0, kd, 2 * kd, 2 * kd + vd, 2 * kd + 2 * vd, 2 * kd + 2 * vd + hv
    qkvz, ba = [], []
    for h in range(hk):
        qkvz += [
            _cols(q0 + h * dk, dk),
            _cols(k0 + h * dk, dk),
            _cols(v0 + h * r * dv, r * dv),
            _cols(z0 + h * r * dv, r * dv),
        ]
        ba += [_cols(b0 + h * r, r), _cols(a0 + h * r, r)]
    return {"in_proj_qkvz": torch.cat(qkvz), "in_proj_ba": torch.cat(ba)}


def gated_qkv_parts(config) -> dict[str, torch.Tensor]:
    """Rows of SelfAttention's linear_qkv with the output gate, per query group g
    [q heads of g | gate heads of g | k_g | v_g], that give HF's q_proj (per head: its query,
    then its gate), k_proj and v_proj."""
    d, groups = config.kv_channels, config.num_query_groups
    qpg = config.num_attention_heads // groups
    stride = (2 * qpg + 2) * d
    q = []
    for head in range(config.num_attention_heads):
        g, j = divmod(head, qpg)
        q += [_cols(g * stride + j * d, d), _cols(g * stride + (qpg + j) * d, d)]
    k = torch.cat([_cols(g * stride + 2 * qpg * d, d) for g in range(groups)])
    v = torch.cat([_cols(g * stride + (2 * qpg + 1) * d, d) for g in range(groups)])
    return {"q_proj": torch.cat(q), "k_proj": k, "v_proj": v}


class GdnInProj:
    """GatedDeltaNet's in_proj: Megatron's ColumnParallelLinear holding the fused weight, with
    HF's in_proj_qkvz / in_proj_ba as its parts."""

    def __new__(cls, input_size, output_size, *, config, **_):
        parts = in_proj_parts(config)
        assert sum(len(p) for p in parts.values()) == output_size
        return parallel_linear("column")(input_size, output_size, parts, config=config)


class GdnOutProj:
    """GatedDeltaNet's out_proj: Megatron's RowParallelLinear (gemm.kpart in the composition)."""

    def __new__(cls, input_size, output_size, *, config, **_):
        parts = {"out_proj": _cols(0, output_size)}
        return parallel_linear("row")(input_size, output_size, parts, config=config)


class GatedQKV:
    """SelfAttention's linear_qkv with the output gate's rows (attention_output_gate)."""

    def __new__(cls, input_size, output_size, *, config, **_):
        parts = gated_qkv_parts(config)
        assert sum(len(p) for p in parts.values()) == output_size
        return parallel_linear("column")(input_size, output_size, parts, config=config)


class SharedFC1:
    """The shared expert's linear_fc1 ([gate; up])."""

    def __new__(cls, input_size, output_size, *, config, **_):
        parts = fc1_parts(output_size // 2)
        return parallel_linear("column")(input_size, output_size, parts, config=config)


class SharedFC2:
    """The shared expert's linear_fc2 (down_proj)."""

    def __new__(cls, input_size, output_size, *, config, **_):
        parts = {"down_proj": _cols(0, output_size)}
        return parallel_linear("row")(input_size, output_size, parts, config=config)


# --- megatron-core classes with the composition in their forward -------------------------------
_CLASSES: dict[str, type] = {}


def _sequence_rows(lane: LockstepNext, x: torch.Tensor):
    """Megatron's [s, b, h] as the composition's step: sequence-major rows, one segment per
    batch column (each a fresh sequence at position 0, its cache on x's device), and every
    row's position."""
    s, b, h = x.shape
    rows = x.transpose(0, 1).reshape(b * s, h)
    segs = [(i * s, s, N.NextCache.empty(lane.geom, x.device)) for i in range(b)]
    return rows, segs, torch.arange(s, device=x.device).repeat(b)


def _composition_layer(lane: LockstepNext, index: int, device) -> N.Layer:
    """The composition's layer ``index`` on this model's programs and weights."""
    return N.Layer(lane.geom, index, lane.ops(device), NextSlots(lane))


def _batch_rows(rows: torch.Tensor, shape) -> torch.Tensor:
    """Sequence-major rows back to Megatron's [s, b, h]."""
    s, b, h = shape
    return rows.view(b, s, h).transpose(0, 1).contiguous()


def classes() -> dict[str, type]:
    """megatron-core's GatedDeltaNet, SharedExpertMLP and TransformerLayer with the lane's
    forward (built once; Megatron is imported only when a model is built)."""
    if _CLASSES:
        return _CLASSES
    from megatron.core.ssm import gated_delta_net as mgdn
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.transformer_layer import TransformerLayer

    class ExactGatedDeltaNet(mgdn.GatedDeltaNet):
        """megatron-core's GatedDeltaNet: its parameters and submodules, built without fla.
        Its forward is the composition's Gated DeltaNet mixer (``Layer.gdn``: in_proj through
        out_proj) on its [s, b, h] input, each batch column a sequence from position 0; the
        layer (``ExactNextLayer``) reaches the same code through the composition's layer."""

        def __init__(self, *args, **kwargs):
            with _fla_check_passed(mgdn):
                super().__init__(*args, **kwargs)

        def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
            for name in ("inference_context", "inference_params", "packed_seq_params"):
                if kwargs.get(name) is not None:
                    raise HybridRefused(f"the hybrid lane's GatedDeltaNet takes no {name}")
            lane: LockstepNext = self.lane
            rows, segs, _ = _sequence_rows(lane, hidden_states)
            layer = _composition_layer(lane, self.layer_number - 1, rows.device)
            return _batch_rows(layer.gdn(rows, segs), hidden_states.shape), None

    class ExactSharedExperts(SharedExpertMLP):
        """Megatron's SharedExpertMLP (fc1, fc2, gate_weight); the composition runs it."""

        forward = _composition_only

    class ExactNextLayer(TransformerLayer):
        """Megatron's TransformerLayer whose forward is the qwen3-next composition's layer."""

        def forward(self, hidden_states, *args, **kwargs):
            lane: LockstepNext = self.lane
            rows, segs, positions = _sequence_rows(lane, hidden_states)
            layer = _composition_layer(lane, self.layer_number - 1, rows.device)
            out = layer(rows, segs, positions)
            return _batch_rows(out, hidden_states.shape), kwargs.get("context")

    _CLASSES.update(gdn=ExactGatedDeltaNet, shared=ExactSharedExperts, layer=ExactNextLayer)
    return _CLASSES


class NextSlots(N.Slots):
    """The composition's weights (by HF name) read from the Megatron model's modules; the
    attention's K/V stay in the sequences' ``NextCache`` (the composition's default)."""

    def __init__(self, lane: LockstepNext):
        self.lane = lane

    def weight(self, layer, name):
        gpt = self.lane.gpt
        if layer is None:
            return model_weight(gpt, name)
        mod = gpt.decoder.layers[layer]
        mixer, mlp = mod.self_attention, mod.mlp
        plain = {
            "input_layernorm.weight": lambda: mod.input_layernorm.weight,
            "post_attention_layernorm.weight": lambda: mod.pre_mlp_layernorm.weight,
            "linear_attn.conv1d.weight": lambda: mixer.conv1d.weight,
            "linear_attn.A_log": lambda: mixer.A_log,
            "linear_attn.dt_bias": lambda: mixer.dt_bias,
            "linear_attn.norm.weight": lambda: mixer.out_norm.weight,
            "linear_attn.out_proj.weight": lambda: mixer.out_proj.weight,
            "self_attn.q_norm.weight": lambda: mixer.q_layernorm.weight,
            "self_attn.k_norm.weight": lambda: mixer.k_layernorm.weight,
            "self_attn.o_proj.weight": lambda: mixer.linear_proj.weight,
            "mlp.gate.weight": lambda: mlp.router.weight,
            "mlp.shared_expert_gate.weight": lambda: mlp.shared_experts.gate_weight,
        }
        if name in plain:
            return plain[name]()
        linear, part = self.proj(layer, name.removesuffix(".weight"))
        return linear.part_weight(part)

    def lora(self, layer, name):
        """The adapter on projection ``name`` (``adapters.attach``), rounded to bf16, or None."""
        found = self.proj(layer, name) if name.endswith(N.ADAPTED) else None
        if found is None or found[1] not in found[0].lora:
            return None
        ad = found[0].lora[found[1]]
        # bf16 of the fp32 masters, straight-through under grad (as the dense lane's slots)
        return to_bf16(ad.A, grad=True), to_bf16(ad.B, grad=True), ad.scale

    def proj(self, layer: int, name: str):
        """(Megatron linear, part) holding the projection ``name`` (HF name after
        ``model.layers.N.``, without ``.weight``) of layer ``layer``."""
        mod = self.lane.gpt.decoder.layers[layer]
        mixer, mlp = mod.self_attention, mod.mlp
        path = name.split(".")
        part = path[-1]
        if name == "linear_attn.out_proj":
            return mixer.out_proj, part
        if name == "self_attn.o_proj":
            return mixer.linear_proj, part
        if path[0] == "linear_attn":
            linear = mixer.in_proj
        elif path[0] == "self_attn":
            linear = mixer.linear_qkv
        elif path[1] == "shared_expert":
            linear = mlp.shared_experts.linear_fc2 if part == "down_proj" else None
            linear = linear or mlp.shared_experts.linear_fc1
        else:  # mlp.experts.<e>.<part>
            expert = mlp.experts.local_experts[mlp.local_index(int(path[2]))]
            linear = expert_linear(expert, part)
        return linear, part


class NextFinalNorm(nn.Module):
    """TransformerBlock's final_layernorm: holds model.norm.weight. Its op runs in the output
    layer, where the composition's ``final_logits`` applies the final norm and the LM head
    together; here the rows pass through unchanged."""

    def __init__(self, config=None, hidden_size: int = 0, eps: float = 1e-6, **_):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=BF16))

    def forward(self, x):
        return x


class NextOutputLayer(nn.Module):
    """The LM head slot: the composition's ``final_logits`` (final norm, then lm_head's
    gemm.kblock with fp32 out) on the final block's rows."""

    def __init__(self, weight: nn.Parameter | None):
        super().__init__()
        self.weight = weight  # None when tied: the composition reads the embedding
        self.lane: LockstepNext | None = None

    def forward(self, x, weight=None, runtime_gather_output=None):
        lane = self.lane
        rows = x.reshape(-1, x.shape[-1])
        logits = N.final_logits(lane.ops(x.device), lane.geom, NextSlots(lane), rows)
        return logits.view(*x.shape[:-1], logits.shape[-1]), None


# --- specs and model -----------------------------------------------------------------------------
def gdn_spec():
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(
        module=classes()["gdn"],
        submodules=GatedDeltaNetSubmodules(
            in_proj=GdnInProj, out_norm=ExactRMSNorm, out_proj=GdnOutProj
        ),
    )


def mlp_spec():
    """The lane's MoELayer (moe.py) plus Megatron's SharedExpertMLP with the exact linears."""
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    spec = moe_spec()
    spec.submodules.shared_experts = ModuleSpec(
        module=classes()["shared"],
        submodules=MLPSubmodules(linear_fc1=SharedFC1, linear_fc2=SharedFC2),
    )
    return spec


def block_spec(geom: N.Geometry):
    """One TransformerLayer spec per HF layer: GatedDeltaNet or gated SelfAttention as its
    mixer (``layer_types``), the MoE with the shared expert as its MLP. The input norm is its
    own module (megatron-core's TE spec fuses it into in_proj / linear_qkv instead)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    def layer(kind: str):
        return ModuleSpec(
            module=classes()["layer"],
            submodules=TransformerLayerSubmodules(
                input_layernorm=ExactRMSNorm,
                self_attention=gdn_spec() if kind == N.LINEAR else attention_spec(GatedQKV),
                self_attn_bda=ExactBDA,
                pre_mlp_layernorm=ExactRMSNorm,
                mlp=mlp_spec(),
                mlp_bda=ExactBDA,
            ),
        )

    return TransformerBlockSubmodules(
        layer_specs=[layer(kind) for kind in geom.layer_types], layer_norm=NextFinalNorm
    )


def transformer_config(geom: N.Geometry):
    """Megatron's names for the geometry: its hybrid fields (experimental_attention_variant
    gated_delta_net, the per-layer linear_attention_freq, the linear_* head counts and dims),
    the attention's output gate, zero-centered norms and the shared expert with its gate."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        **moe_config(geom, 1),
        moe_shared_expert_intermediate_size=geom.shared_intermediate,
        moe_shared_expert_gate=True,
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[int(kind == N.LINEAR) for kind in geom.layer_types],
        linear_conv_kernel_dim=geom.conv_kernel,
        linear_key_head_dim=geom.linear_key_dim,
        linear_value_head_dim=geom.linear_value_dim,
        linear_num_key_heads=geom.linear_key_heads,
        linear_num_value_heads=geom.linear_value_heads,
        attention_output_gate=True,
        layernorm_zero_centered_gamma=True,
        perform_initialization=False,  # every tensor is loaded (convert.load_into is strict)
        **base_config(geom, geom.moe_intermediate),
    )


class LockstepNext(nn.Module):
    """``Float16Module(GPTModel)`` of a Qwen3-Next geometry with the hybrid spec, then the
    lane's log_softmax: tokens [b, s] -> [b, s, V] fp32 log-probabilities, differentiable
    (the ops run with ``grad=True``)."""

    def __init__(self, geom: N.Geometry, tp: int = 1, ep: int = 1):
        super().__init__()
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer.module import Float16Module

        check_release()
        geometry_contract(geom, tp=tp, ep=ep)  # LayoutRefused for tp / ep > 1, naming both
        init_single_process()
        self.geom, self.tp, self.ep, self.tp_rank, self.gather = geom, 1, 1, 0, P.LOCAL
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
        head = None if geom.tie_embeddings else nn.Parameter(torch.zeros(geom.vocab, geom.hidden))
        gpt.output_layer = NextOutputLayer(head)
        for p in gpt.parameters():
            p.requires_grad_(False)
        self.model = Float16Module(config, gpt)
        self._ops: dict[str, N.NextOps] = {}
        self._wire()

    def _wire(self) -> None:
        gpt = self.gpt
        for layer in gpt.decoder.layers:
            object.__setattr__(layer, "lane", self)  # not a submodule: no cycle in the tree
            object.__setattr__(layer.self_attention, "lane", self)
        object.__setattr__(gpt.output_layer, "lane", self)

        def embed(_module, args, kwargs, _out):
            ids = kwargs.get("input_ids", args[0] if args else None)
            table = NextSlots(self).weight(None, "model.embed_tokens.weight")
            rows = self.ops(ids.device).embed("embed_tokens", table, ids.t().reshape(-1))
            return rows.view(ids.shape[1], ids.shape[0], -1)

        gpt.embedding.register_forward_hook(embed, with_kwargs=True)

    @property
    def gpt(self):
        return self.model.module

    def ops(self, device: torch.device) -> N.NextOps:
        """The lane's programs on ``device``'s backend, read from that backend's contract."""
        backend = torch.device(device).type
        if backend not in self._ops:
            contract = geometry_contract(self.geom, backend=backend)
            # grad=True: exact forward, the ideal ops' VJPs backward (``programs.vjp``); with
            # no tensor requiring grad the programs run alone, as for inference.
            self._ops[backend] = N.NextOps(contract, grad=True)
        return self._ops[backend]

    def invoked_contract(self, device: torch.device | str = "cpu"):
        """What this model actually ran on ``device`` (after at least one forward)."""
        return self.ops(torch.device(device)).invoked_contract()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [b, s] (right-padded, each sequence from position 0) -> [b, s, V] float32."""
        logits = self.model(input_ids=tokens, position_ids=None, attention_mask=None)
        b, s, v = logits.shape
        ops = self.ops(logits.device)
        return ops.log_softmax("logprobs", logits.reshape(b * s, v)).view(b, s, v)
