"""The Qwen3 / Qwen3-MoE lane: geometry, op-site programs, and the layer composition.

The composition follows HF Qwen3 (pre-norm, q/k per-head RMSNorm before RoPE, SwiGLU MLP or
a softmax-top-k MoE). Engines supply weights and an ``attend`` callback (the serving engine
reads its paged KV cache there); every floating-point op goes through ``programs``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .. import programs as P
from ..programs import Program
from ..sites import record

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3-moe"}


class UnsupportedModel(ValueError):
    """The model uses a feature the exact lane does not cover; nothing falls back."""


@dataclass(frozen=True)
class Geometry:
    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    eps: float
    rope_theta: float
    tie_embeddings: bool
    experts: int = 0
    topk: int = 0
    moe_intermediate: int = 0
    norm_topk: bool = True

    @property
    def is_moe(self) -> bool:
        return self.family == "qwen3-moe"

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_hf_config(cls, cfg: Mapping) -> Geometry:
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch not in ARCHITECTURES:
            raise UnsupportedModel(
                f"architecture {arch!r} has no exact lane; supported: {sorted(ARCHITECTURES)}"
            )
        family = ARCHITECTURES[arch]
        checks = {
            "quantization_config": (cfg.get("quantization_config") is None, "quantized weights"),
            "rope_scaling": (not cfg.get("rope_scaling"), "rope_scaling"),
            "attention_bias": (not cfg.get("attention_bias", False), "attention bias"),
            "hidden_act": (
                cfg.get("hidden_act", "silu") == "silu",
                "an activation other than silu",
            ),
            "use_sliding_window": (not cfg.get("use_sliding_window", False), "sliding window"),
        }
        if family == "qwen3-moe":
            checks["decoder_sparse_step"] = (
                cfg.get("decoder_sparse_step", 1) == 1,
                "dense layers mixed into the MoE stack",
            )
            checks["mlp_only_layers"] = (not cfg.get("mlp_only_layers"), "mlp_only_layers")
        for key, (ok, what) in checks.items():
            if not ok:
                raise UnsupportedModel(
                    f"the exact lane does not support {what} ({key!r} = {cfg.get(key)!r})"
                )
        dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"
        if dtype != "bfloat16":
            raise UnsupportedModel(f"the exact lane runs bf16 checkpoints; config says {dtype!r}")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        return cls(
            family=family,
            hidden=hidden,
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab=int(cfg["vocab_size"]),
            intermediate=int(cfg.get("intermediate_size", 0)),
            eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 1000000.0)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            experts=int(cfg.get("num_experts", 0)) if family == "qwen3-moe" else 0,
            topk=int(cfg.get("num_experts_per_tok", 0)) if family == "qwen3-moe" else 0,
            moe_intermediate=int(cfg.get("moe_intermediate_size", 0))
            if family == "qwen3-moe"
            else 0,
            norm_topk=bool(cfg.get("norm_topk_prob", True)),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Geometry:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UnsupportedModel(f"{model_dir} has no config.json: not an HF model directory")
        return cls.from_hf_config(json.loads(path.read_text()))


def op_sites(geom: Geometry) -> dict[str, Program]:
    """Every op site of the lane and the program (with parameters) that runs there."""
    gemm = Program.of("gemm.kblock", bk=32, out="bf16")
    norm = Program.of("rmsnorm.qwen3", eps=geom.eps)
    sites = {
        "embed": Program.of("embedding.gather"),
        "layers.input_norm": norm,
        "layers.attn.qkv_proj": gemm,
        "layers.attn.qk_norm": norm,
        "layers.attn.rope": Program.of("rope.neox", base=geom.rope_theta),
        "layers.attn.core": Program.of("attention.blocked", block=32),
        "layers.attn.o_proj": gemm,
        "layers.residual": Program.of("residual.add"),
        "layers.post_norm": norm,
    }
    if geom.is_moe:
        sites.update(
            {
                "layers.moe.router_gemm": gemm,
                "layers.moe.router": Program.of(
                    "router.softmax_topk", k=geom.topk, normalize=geom.norm_topk
                ),
                "layers.moe.experts.gate_up_proj": gemm,
                "layers.moe.experts.act": Program.of("swiglu"),
                "layers.moe.experts.down_proj": gemm,
                "layers.moe.fold": Program.of("moe.fold", acc="bf16"),
            }
        )
    else:
        sites.update(
            {
                "layers.mlp.gate_up_proj": gemm,
                "layers.mlp.act": Program.of("swiglu"),
                "layers.mlp.down_proj": gemm,
            }
        )
    sites.update(
        {
            "final_norm": norm,
            "lm_head": Program.of("gemm.kblock", bk=32, out="fp32"),
            "logprobs": Program.of("log_softmax.tree"),
            "lora.shrink": Program.of("lora.shrink", bk=32),
            "lora.expand": Program.of("lora.expand", bk=32),
        }
    )
    return sites


# --- composition -----------------------------------------------------------------------------
LoRA = tuple[torch.Tensor, torch.Tensor, float]  # (A [r, K], B [N, r], scale)
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def linear(x: torch.Tensor, w: torch.Tensor, lora: LoRA | None = None) -> torch.Tensor:
    """gemm.kblock, plus lora.shrink/lora.expand when an adapter covers this projection."""
    y = P.gemm(x, w)
    if lora is not None:
        a, b, scale = lora
        y = P.lora_expand(y, P.lora_shrink(x, a), b, scale)
    return y


class Layer:
    """Weights of one decoder layer by HF name (suffix after ``model.layers.N.``)."""

    def __init__(
        self,
        geom: Geometry,
        index: int,
        weights: Mapping[str, torch.Tensor],
        adapters: Mapping[str, LoRA] | None = None,
    ):
        self.geom = geom
        self.index = index
        self.w = weights
        self.lora = adapters or {}

    def proj(self, x, name):
        out = linear(x, self.w[name], self.lora.get(name))
        return record(f"{self.site}.{name.removesuffix('.weight')}", out)

    @property
    def site(self) -> str:
        return f"layers.{self.index}"

    def attention(self, h, positions, attend: Attend):
        g = self.geom
        t = h.shape[0]
        q = self.proj(h, "self_attn.q_proj.weight").view(t, g.heads, g.head_dim)
        k = self.proj(h, "self_attn.k_proj.weight").view(t, g.kv_heads, g.head_dim)
        v = self.proj(h, "self_attn.v_proj.weight").view(t, g.kv_heads, g.head_dim)
        q = record(
            f"{self.site}.self_attn.q_norm", P.rmsnorm(q, self.w["self_attn.q_norm.weight"], g.eps)
        )
        k = record(
            f"{self.site}.self_attn.k_norm", P.rmsnorm(k, self.w["self_attn.k_norm.weight"], g.eps)
        )
        q = record(f"{self.site}.self_attn.q_rope", P.rope(q, positions, g.rope_theta))
        k = record(f"{self.site}.self_attn.k_rope", P.rope(k, positions, g.rope_theta))
        o = record(f"{self.site}.self_attn.core", attend(self.index, q, k, v))
        return self.proj(o.reshape(t, g.heads * g.head_dim), "self_attn.o_proj.weight")

    def mlp(self, h):
        if not self.geom.is_moe:
            gate = self.proj(h, "mlp.gate_proj.weight")
            up = self.proj(h, "mlp.up_proj.weight")
            act = record(f"{self.site}.mlp.act", P.swiglu(gate, up))
            return self.proj(act, "mlp.down_proj.weight")
        g = self.geom
        logits = record(f"{self.site}.mlp.gate", P.gemm(h, self.w["mlp.gate.weight"]))
        ids, weights = P.router_topk(logits, g.topk, normalize=g.norm_topk)
        record(f"{self.site}.mlp.router_ids", ids)
        record(f"{self.site}.mlp.router_weights", weights)
        out = torch.empty(h.shape[0], g.topk, g.hidden, dtype=h.dtype, device=h.device)
        for e in torch.unique(ids).tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            x = h[rows]
            pre = f"mlp.experts.{e}."
            act = P.swiglu(
                self.proj(x, pre + "gate_proj.weight"), self.proj(x, pre + "up_proj.weight")
            )
            record(f"{self.site}.{pre}act", act)
            out[rows, slot] = self.proj(act, pre + "down_proj.weight")
        return record(f"{self.site}.mlp.fold", P.moe_fold(out, weights))

    def __call__(self, h, positions, attend: Attend):
        g = self.geom
        x = record(
            f"{self.site}.input_layernorm", P.rmsnorm(h, self.w["input_layernorm.weight"], g.eps)
        )
        h = record(
            f"{self.site}.residual_attn", P.residual_add(h, self.attention(x, positions, attend))
        )
        x = P.rmsnorm(h, self.w["post_attention_layernorm.weight"], g.eps)
        m = self.mlp(record(f"{self.site}.post_attention_layernorm", x))
        return record(f"{self.site}.residual_mlp", P.residual_add(h, m))


def split_layers(
    weights: Mapping[str, torch.Tensor], geom: Geometry
) -> list[dict[str, torch.Tensor]]:
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(geom.layers)]
    for name, t in weights.items():
        if name.startswith("model.layers."):
            idx, rest = name[len("model.layers.") :].split(".", 1)
            layers[int(idx)][rest] = t
    return layers


def final_logits(h, weights: Mapping[str, torch.Tensor], geom: Geometry) -> torch.Tensor:
    """final norm, then the fp32 LM head: [T, V] float32 logits."""
    hn = record("norm", P.rmsnorm(h, weights["model.norm.weight"], geom.eps))
    head = (
        weights["model.embed_tokens.weight"] if geom.tie_embeddings else weights["lm_head.weight"]
    )
    return record("lm_head", P.gemm(hn, head, out_dtype=torch.float32))


def final_logprobs(h, weights: Mapping[str, torch.Tensor], geom: Geometry) -> torch.Tensor:
    """final_logits, then log_softmax: [T, V] float32 log-probabilities."""
    return record("logprobs", P.log_softmax(final_logits(h, weights, geom)))


def forward_logprobs(
    weights: Mapping[str, torch.Tensor],
    geom: Geometry,
    tokens: torch.Tensor,
    adapters: Mapping[str, LoRA] | None = None,
) -> torch.Tensor:
    """Reference forward of one sequence (contiguous K/V): [T, V] log-probabilities.

    Row t is the distribution of token t+1 given tokens 0..t.
    """
    positions = torch.arange(tokens.shape[0])
    h = record("embed_tokens", weights["model.embed_tokens.weight"][tokens])
    for i, lw in enumerate(split_layers(weights, geom)):
        prefix = f"model.layers.{i}."
        layer_ad = {
            k[len(prefix) :]: v for k, v in (adapters or {}).items() if k.startswith(prefix)
        }
        h = Layer(geom, i, lw, layer_ad)(
            h, positions, lambda _i, q, k, v: P.attention(q, k, v, positions)
        )
    return final_logprobs(h, weights, geom)
