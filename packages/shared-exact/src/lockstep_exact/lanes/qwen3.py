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
from ..contract import Contract, make_contract
from ..programs import Program
from ..programs.grouping import unsort
from ..sites import is_recording, record
from .config import UnsupportedModel, check_config
from .ops import AttentionSite, Ops

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3-moe"}


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
        """The lane's geometry from an HF ``config.json`` dict; ``UnsupportedModel`` naming
        any key or value the lane does not implement (the allow-list is ``lanes.config``)."""
        return cls(**check_config(cfg))

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Geometry:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UnsupportedModel(f"{model_dir} has no config.json: not an HF model directory")
        return cls.from_hf_config(json.loads(path.read_text()))


PROJECTIONS_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
PROJECTIONS_MLP = ("gate_proj", "up_proj", "down_proj")


# A row-parallel site (o_proj, down_proj: K is what tensor parallelism splits) reduces K over
# this many canonical partitions, or the largest power of two below it that divides its K. The
# layout enters the lane's identity only through these counts: any tensor-parallel size that
# divides a site's count gives that site the bytes of one device.
K_PARTS = 8
ROW_PARALLEL = ("self_attn.o_proj", "down_proj")


def k_parts(k_dim: int, limit: int = K_PARTS) -> int:
    """The partition count of a row-parallel site whose K is ``k_dim``."""
    p = limit
    while p > 1 and k_dim % p:
        p //= 2
    return p


def is_row_parallel(name: str) -> bool:
    """``name`` like ``self_attn.o_proj`` or ``mlp.experts.3.down_proj``."""
    return name.endswith(ROW_PARALLEL)


def op_sites(geom: Geometry) -> dict[str, Program]:
    """Every op site of the lane (its contract key) and the program, with parameters, run there.

    Keys are the paths the composition calls with every index replaced by ``*``
    (``lanes.ops.site_key``): one name per site, in the contract, in recorded sites and in
    errors. Each projection also has its LoRA sites (``<projection>.lora_shrink`` /
    ``.lora_expand``), run when an adapter covers it.
    """
    gemm = Program.of("gemm.kblock", bk=32, out="bf16")
    norm = Program.of("rmsnorm.qwen3", eps=geom.eps)
    rope = Program.of("rope.neox", base=geom.rope_theta)
    shrink, expand = Program.of("lora.shrink", bk=32), Program.of("lora.expand", bk=32)
    sites: dict[str, Program] = {"embed_tokens": Program.of("embedding.gather")}

    def proj(path: str, k_dim: int | None = None) -> None:
        """``k_dim``: a row-parallel site's K (its gemm is gemm.kpart)."""
        if k_dim is None:
            sites[path] = gemm
        else:
            sites[path] = Program.of("gemm.kpart", bk=32, parts=k_parts(k_dim), out="bf16")
        sites[f"{path}.lora_shrink"] = shrink
        sites[f"{path}.lora_expand"] = expand

    layer = "layers.*"
    sites[f"{layer}.input_layernorm"] = norm
    for p in ("q_proj", "k_proj", "v_proj"):
        proj(f"{layer}.self_attn.{p}")
    sites[f"{layer}.self_attn.q_norm"] = norm
    sites[f"{layer}.self_attn.k_norm"] = norm
    sites[f"{layer}.self_attn.q_rope"] = rope
    sites[f"{layer}.self_attn.k_rope"] = rope
    sites[f"{layer}.self_attn.core"] = Program.of("attention.blocked", block=32)
    proj(f"{layer}.self_attn.o_proj", geom.heads * geom.head_dim)
    sites[f"{layer}.residual_attn"] = Program.of("residual.add")
    sites[f"{layer}.post_attention_layernorm"] = norm
    if geom.is_moe:
        sites[f"{layer}.mlp.gate"] = gemm
        sites[f"{layer}.mlp.router"] = Program.of(
            "router.softmax_topk", k=geom.topk, normalize=geom.norm_topk
        )
        mlp = f"{layer}.mlp.experts.*"
        sites[f"{layer}.mlp.fold"] = Program.of("moe.fold", acc="bf16")
        inner = geom.moe_intermediate
    else:
        mlp = f"{layer}.mlp"
        inner = geom.intermediate
    proj(f"{mlp}.gate_proj")
    proj(f"{mlp}.up_proj")
    sites[f"{mlp}.act"] = Program.of("swiglu")
    proj(f"{mlp}.down_proj", inner)
    sites[f"{layer}.residual_mlp"] = Program.of("residual.add")
    sites["norm"] = norm
    sites["lm_head"] = Program.of("gemm.kblock", bk=32, out="fp32")
    sites["logprobs"] = Program.of("log_softmax.tree")
    sites["sample"] = Program.of("sample.gumbel_topp")  # the token drawn from the logprobs row
    return sites


# --- composition -----------------------------------------------------------------------------
LoRA = tuple[torch.Tensor, torch.Tensor, float]  # (A [r, K], B [N, r], scale)
# attend(path, q, k, v, positions, core): the engine's attention slot. q/k/v are this step's
# rows (after rope); the engine stores k/v in its own cache, gathers each sequence's keys and
# values, and calls core(q_rows, keys, values, positions_of_those_rows) per sequence, or
# core.varlen(...) once for all of them (``ops.AttentionSite``).
Core = AttentionSite
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Core], torch.Tensor]


class Slots:
    """What an engine supplies to the composition; the composition owns every op and its order.

    ``weight``: a backbone tensor by HF name (suffix after ``model.layers.N.``, or the full name
    for the embedding, final norm and LM head). ``lora``: the adapter factors covering a
    projection, already bf16, or None. ``attend``: attention over the engine's own cache.
    ``dispatch``: run ``expert(e, rows_hidden)`` for every routed (token, slot) and return
    [T, k, H] in slot order (the default runs the experts present, lowest id first, locally).
    """

    # The tensor-parallel group (``programs.Gather``): one device unless the engine shards.
    # Under tensor parallelism ``weight`` returns this rank's shard: column-parallel
    # projections (q, k, v, gate, up) by output rows, row-parallel ones (o, down) by K.
    gather = P.LOCAL

    def weight(self, layer: int | None, name: str) -> torch.Tensor:
        raise NotImplementedError

    def lora(self, layer: int, name: str) -> LoRA | None:
        return None

    def attend(self, layer, q, k, v, positions, core: Core) -> torch.Tensor:
        raise NotImplementedError

    def dispatch(self, layer: int, h, ids, expert: Callable[[int, torch.Tensor], torch.Tensor]):
        return local_dispatch(h, ids, expert)

    def experts(self, layer: int) -> Mapping[str, torch.Tensor] | None:
        """The layer's expert weights stacked ({"gate_proj": [E, I, H], "up_proj": [E, I, H],
        "down_proj": [E, H, I]}) where the engine runs its experts grouped (one launch a
        projection for all experts, ``Layer.moe``), or None for ``dispatch``. Only where no
        adapter covers an expert and the experts are not sharded over ranks."""
        return None


def grouped_experts(ops, site: str, h, ids, stacked, experts: int, mlp, pre: str):
    """Every expert at once: the (row, slot) pairs of router ``ids`` sorted by expert on the
    device, ``mlp(rows, pre, proj)`` over them with each projection one grouped call (a row's
    bytes are its expert's plain gemm's), then back to (row, slot): [T, k, H]. ``stacked``: the
    layer's experts' weights by projection ([E, N, K]); nothing is read on the host."""
    plan = P.expert_plan(ids, experts)

    def grouped(x, name):
        w = stacked[name.rsplit(".", 1)[1]]
        return ops.gemm_grouped(f"{site}.{name}", x, w, plan)

    return unsort(mlp(h[plan.src], pre, grouped), plan)


def local_dispatch(h, ids, expert, owned=None):
    """Every expert routed to by some row, in ascending id, on the rows that chose it; the
    results land at (row, slot) of a [T, k, H] tensor (out of place: autograd sees it).
    ``owned`` (a container of expert ids): only those run, other slots stay zero (expert
    parallelism: the other ranks fill them)."""
    # One host read per call: a stable sort of the (row, slot) pairs by expert keeps each
    # expert's pairs in ascending (row, slot) order, the order a per-expert nonzero gives.
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    chosen, counts = torch.unique_consecutive(flat[order], return_counts=True)
    rows_of, slots_of = order // ids.shape[1], order % ids.shape[1]
    rows_all, slots_all, outs = [], [], []
    start = 0
    for e, count in zip(*torch.stack([chosen, counts]).tolist(), strict=True):
        seg = slice(start, start + count)
        start += count
        if owned is not None and e not in owned:
            continue
        rows = rows_of[seg]
        outs.append(expert(e, h[rows]))
        rows_all.append(rows)
        slots_all.append(slots_of[seg])
    out = h.new_zeros(h.shape[0], ids.shape[1], h.shape[1])
    if not outs:
        return out
    return out.index_put((torch.cat(rows_all), torch.cat(slots_all)), torch.cat(outs))


def linear(ops, path: str, x, w, lora: LoRA | None = None, gather=P.LOCAL):
    """The projection's gemm (gemm.kpart over ``gather`` on a row-parallel site), plus
    lora.shrink/lora.expand when an adapter covers it. Under tensor parallelism a row-parallel
    site's adapter sees the whole input (its shares gathered: exact, a copy) and its whole A."""
    y = ops.gemm(path, x, w, gather)
    if lora is not None:
        a, b, scale = lora
        xa = x if gather.size == 1 else torch.cat(gather.all(x), dim=-1)
        y = ops.lora_expand(
            f"{path}.lora_expand", y, ops.lora_shrink(f"{path}.lora_shrink", xa, a), b, scale
        )
    return y


class Layer:
    """One decoder layer of the lane: the only place its op order is written."""

    def __init__(self, geom: Geometry, index: int, ops, slots: Slots):
        self.geom, self.index, self.ops, self.slots = geom, index, ops, slots
        self.site = f"layers.{index}"

    def w(self, name: str) -> torch.Tensor:
        return self.slots.weight(self.index, name)

    def proj(self, x, name: str):
        """``name`` like ``self_attn.q_proj`` or ``mlp.experts.3.down_proj``."""
        lora = self.slots.lora(self.index, name)
        gather = self.slots.gather if is_row_parallel(name) else P.LOCAL
        return linear(self.ops, f"{self.site}.{name}", x, self.w(f"{name}.weight"), lora, gather)

    def attention(self, h, positions):
        g, ops, s = self.geom, self.ops, f"{self.site}.self_attn"
        t = h.shape[0]
        # Heads from the weights' rows: this rank's heads under tensor parallelism.
        q = self.proj(h, "self_attn.q_proj").view(t, -1, g.head_dim)
        k = self.proj(h, "self_attn.k_proj").view(t, -1, g.head_dim)
        v = self.proj(h, "self_attn.v_proj").view(t, -1, g.head_dim)
        q = ops.rmsnorm(f"{s}.q_norm", q, self.w("self_attn.q_norm.weight"))
        k = ops.rmsnorm(f"{s}.k_norm", k, self.w("self_attn.k_norm.weight"))
        q = ops.rope(f"{s}.q_rope", q, positions)
        k = ops.rope(f"{s}.k_rope", k, positions)

        core = AttentionSite(ops, f"{s}.core")
        o = self.slots.attend(self.index, q, k, v, positions, core)
        o = record(f"{s}.core", o)  # all rows of the step (core records per sequence)
        return self.proj(o.reshape(t, -1), "self_attn.o_proj")

    def mlp(self, h, pre: str = "mlp.", proj=None):
        """``proj(x, name)``: the projections' form (default ``self.proj``; grouped experts
        pass theirs)."""
        proj = proj or self.proj
        gate = proj(h, pre + "gate_proj")
        up = proj(h, pre + "up_proj")
        act = self.ops.swiglu(f"{self.site}.{pre}act", gate, up)
        return proj(act, pre + "down_proj")

    def moe(self, h):
        ops, s = self.ops, f"{self.site}.mlp"
        logits = ops.gemm(f"{s}.gate", h, self.w("mlp.gate.weight"))
        ids, weights = ops.router(f"{s}.router", logits)
        stacked = None if is_recording() else self.slots.experts(self.index)
        if stacked is None:
            out = self.slots.dispatch(
                self.index, h, ids, lambda e, x: self.mlp(x, f"mlp.experts.{e}.")
            )
        else:
            out = grouped_experts(
                ops, self.site, h, ids, stacked, self.geom.experts, self.mlp, "mlp.experts.*."
            )
        return ops.moe_fold(f"{s}.fold", out, weights)

    def __call__(self, h, positions):
        ops, s = self.ops, self.site
        x = ops.rmsnorm(f"{s}.input_layernorm", h, self.w("input_layernorm.weight"))
        h = ops.residual_add(f"{s}.residual_attn", h, self.attention(x, positions))
        x = ops.rmsnorm(
            f"{s}.post_attention_layernorm", h, self.w("post_attention_layernorm.weight")
        )
        m = self.moe(x) if self.geom.is_moe else self.mlp(x)
        return ops.residual_add(f"{s}.residual_mlp", h, m)


def embed(ops, slots: Slots, tokens):
    return ops.embed("embed_tokens", slots.weight(None, "model.embed_tokens.weight"), tokens)


def layers(ops, geom: Geometry, slots: Slots, h, positions):
    for i in range(geom.layers):
        h = Layer(geom, i, ops, slots)(h, positions)
    return h


def final_norm(ops, slots: Slots, h):
    return ops.rmsnorm("norm", h, slots.weight(None, "model.norm.weight"))


def lm_head(ops, geom: Geometry, slots: Slots, hn):
    """fp32 logits [T, V] from the normed hidden states."""
    name = "model.embed_tokens.weight" if geom.tie_embeddings else "lm_head.weight"
    return ops.gemm("lm_head", hn, slots.weight(None, name))


def final_logits(ops, geom: Geometry, slots: Slots, h):
    """final norm, then the fp32 LM head: [T, V] float32 logits."""
    return lm_head(ops, geom, slots, final_norm(ops, slots, h))


def logprobs(ops, logits, **shard):
    """fp32 log-probabilities of the logits rows; ``shard`` (start, vocab, gather) when the
    head is vocab-parallel: this rank's columns, with the unsharded bytes (Ops.log_softmax)."""
    return ops.log_softmax("logprobs", logits, **shard)


def forward(ops, geom: Geometry, slots: Slots, tokens, positions):
    """The whole lane over rows: token ids [T] at ``positions`` -> [T, V] log-probabilities."""
    h = layers(ops, geom, slots, embed(ops, slots, tokens), positions)
    return logprobs(ops, final_logits(ops, geom, slots, h))


def split_layers(
    weights: Mapping[str, torch.Tensor], geom: Geometry
) -> list[dict[str, torch.Tensor]]:
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(geom.layers)]
    for name, t in weights.items():
        if name.startswith("model.layers."):
            idx, rest = name[len("model.layers.") :].split(".", 1)
            layers[int(idx)][rest] = t
    return layers


def stack_experts(weights: dict[str, torch.Tensor], geom: Geometry):
    """Each layer's expert weights stacked per projection ([E, N, K], for ``Slots.experts``);
    ``weights`` (HF names) is updated in place so that every expert's entry is a view of its
    stack: one copy of the experts in memory, the same bytes under both names."""
    stacked: list[dict[str, torch.Tensor]] = []
    for i in range(geom.layers):
        layer = {}
        for p in PROJECTIONS_MLP:
            names = [f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for e in range(geom.experts)]
            stack = torch.stack([weights.pop(n) for n in names])
            for e, n in enumerate(names):
                weights[n] = stack[e]
            layer[p] = stack
        stacked.append(layer)
    return stacked


class DictSlots(Slots):
    """Weights and adapters from HF-named dicts; contiguous K/V of one sequence from 0.

    The reference engine (``forward_logprobs``) and the base of the serving engine's slots.
    ``adapters`` maps HF weight names (``model.layers.0.self_attn.q_proj.weight``) to LoRA.
    """

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        geom: Geometry,
        adapters: Mapping[str, LoRA] | None = None,
        *,
        per_layer: list[dict[str, torch.Tensor]] | None = None,
    ):
        self.weights = weights
        self.per_layer = per_layer if per_layer is not None else split_layers(weights, geom)
        self.adapters = adapters or {}

    def weight(self, layer, name):
        return self.weights[name] if layer is None else self.per_layer[layer][name]

    def lora(self, layer, name):
        return self.adapters.get(f"model.layers.{layer}.{name}.weight")

    def attend(self, layer, q, k, v, positions, core):
        return core(q, k, v, positions)


def geometry_contract(
    geom: Geometry, *, backend: str = "cpu", tp: int = 1, ep: int = 1, machine=None
) -> Contract:
    """This lane's contract for ``geom`` (``model.geometry_contract`` picks the lane)."""
    return make_contract(
        geom, op_sites(geom), k_parts=K_PARTS, backend=backend, tp=tp, ep=ep, machine=machine
    )


def default_ops(geom: Geometry, backend: str = "cpu"):
    return Ops(geometry_contract(geom, backend=backend))


def forward_logprobs(
    weights: Mapping[str, torch.Tensor],
    geom: Geometry,
    tokens: torch.Tensor,
    adapters: Mapping[str, LoRA] | None = None,
    *,
    ops=None,
) -> torch.Tensor:
    """Reference forward of one sequence (contiguous K/V): [T, V] log-probabilities.

    Row t is the distribution of token t+1 given tokens 0..t. ``ops`` defaults to the lane's
    own contract on the tokens' backend.
    """
    ops = ops or default_ops(geom, tokens.device.type)
    positions = torch.arange(tokens.shape[0], device=tokens.device)
    return forward(ops, geom, DictSlots(weights, geom, adapters), tokens, positions)
