"""The Qwen3-Next lane: geometry, op-site programs, the per-sequence cache and the
layer composition, on the cpu backend.

The composition follows HF Qwen3Next. Layers alternate Gated DeltaNet (``linear_attn``: the
in_proj_qkvz / in_proj_ba projections, a causal conv over q|k|v with its cached window, the
decay and write strength from gdn.gating, l2-normalized q and k, gdn.chunked with its GdnState,
the gated RMSNorm with z, out_proj) and gated full attention (``self_attn``: q_proj makes the
query and the output gate, zero-centered q/k norms, RoPE on the first ``rotary_dim`` dims,
attention.blocked, gate.sigmoid, o_proj). Every layer's MLP is a softmax-top-k MoE plus a
shared expert whose output is scaled by sigmoid(shared_expert_gate). All RMSNorms outside the
GDN layers are zero-centered (weights stored as w - 1).

A forward starts at any position: each sequence's ``NextCache`` holds the GdnState and conv
window of every GDN layer and the K/V of every attention layer. Because gdn.chunked aligns its
chunks to absolute positions, one prefill, any split into calls and token-by-token decode give
the same bytes. Row-wise ops (projections, norms, MLPs) run over all rows of a step; the
sequence-mixing ops (conv, GDN, attention) run per sequence.

LoRA: an adapter covering a projection (``ADAPTED``; ``Slots.lora``) adds lora.shrink and
lora.expand after its gemm, as on the dense lane (``qwen3.linear``).

Training: ``NextOps(grad=True)`` gives every program the VJP of its ideal op
(``programs.vjp``), the caches included. Not wired yet: tensor/expert parallelism beyond the
contract's K partitions. The vLLM half is ``lockstep_serving.vllm.next`` (``hidden``
and ``final_logits``, attention through ``Slots.attend`` over vLLM's paged cache).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .. import programs as P
from ..contract import Contract, ContractMismatch, LayoutRefused, make_contract
from ..programs import Program
from ..programs import vjp as V
from ..sites import is_recording, record
from .config import UnsupportedModel, check_next_config
from .ops import AttentionSite, Ops, site, site_key
from .qwen3 import K_PARTS, LoRA, grouped_experts, k_parts, linear, local_dispatch

ARCHITECTURES = {"Qwen3NextForCausalLM": "qwen3-next"}
GDN_CHUNK = 64  # the lane's gdn.chunked chunk (tests may build a geometry with another)
L2NORM_EPS = 1e-6  # HF Qwen3Next's l2norm of q and k (not rms_norm_eps)
LINEAR, FULL = "linear_attention", "full_attention"
# The projections an adapter may cover (``lockstep_exact.adapters``): the GDN's three, the
# gated attention's four, every routed expert's and the shared expert's gate/up/down.
ADAPTED = (
    "linear_attn.in_proj_qkvz",
    "linear_attn.in_proj_ba",
    "linear_attn.out_proj",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


@dataclass(frozen=True)
class Geometry:
    family: str
    hidden: int
    layers: int
    layer_types: tuple[str, ...]
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int
    vocab: int
    eps: float
    rope_theta: float
    tie_embeddings: bool
    linear_key_heads: int
    linear_value_heads: int
    linear_key_dim: int
    linear_value_dim: int
    conv_kernel: int
    experts: int
    topk: int
    norm_topk: bool
    moe_intermediate: int
    shared_intermediate: int
    chunk: int = GDN_CHUNK

    is_moe = True

    @property
    def key_dim(self) -> int:
        return self.linear_key_heads * self.linear_key_dim

    @property
    def value_dim(self) -> int:
        return self.linear_value_heads * self.linear_value_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def as_dict(self) -> dict:
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)  # as its JSON form reads back
        return d

    @classmethod
    def from_hf_config(cls, cfg: Mapping, *, chunk: int = GDN_CHUNK) -> Geometry:
        """The lane's geometry from an HF ``config.json`` dict; ``UnsupportedModel`` naming
        any key or value the lane does not implement (``lanes.config.check_next_config``)."""
        if chunk < 1 or chunk & (chunk - 1):
            raise UnsupportedModel(f"qwen3-next lane: gdn chunk {chunk} is not a power of two")
        return cls(**check_next_config(cfg), chunk=chunk)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Geometry:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise UnsupportedModel(f"{model_dir} has no config.json: not an HF model directory")
        return cls.from_hf_config(json.loads(path.read_text()))


def op_sites(geom: Geometry) -> dict[str, Program]:
    """Every op site of the lane (its contract key) and the program run there.

    Keys are the composition's paths with every index replaced by ``*``; GDN layers' sites
    are under ``layers.*.linear_attn``, attention layers' under ``layers.*.self_attn``.
    """
    gemm = Program.of("gemm.kblock", bk=32, out="bf16")
    norm = Program.of("rmsnorm.zero_centered", eps=geom.eps)

    def kpart(k_dim: int) -> Program:
        return Program.of("gemm.kpart", bk=32, parts=k_parts(k_dim), out="bf16")

    sites: dict[str, Program] = {"embed_tokens": Program.of("embedding.gather")}
    layer = "layers.*"
    sites[f"{layer}.input_layernorm"] = norm
    if LINEAR in geom.layer_types:
        g = f"{layer}.linear_attn"
        sites[f"{g}.in_proj_qkvz"] = gemm
        sites[f"{g}.in_proj_ba"] = gemm
        sites[f"{g}.conv1d"] = Program.of("conv1d.causal", kernel=geom.conv_kernel)
        sites[f"{g}.gating"] = Program.of("gdn.gating")
        sites[f"{g}.q_l2norm"] = Program.of("gdn.l2norm", eps=L2NORM_EPS)
        sites[f"{g}.k_l2norm"] = Program.of("gdn.l2norm", eps=L2NORM_EPS)
        sites[f"{g}.core"] = Program.of("gdn.chunked", chunk=geom.chunk)
        sites[f"{g}.norm"] = Program.of("rmsnorm.gated", eps=geom.eps)
        sites[f"{g}.out_proj"] = kpart(geom.value_dim)
    if FULL in geom.layer_types:
        a = f"{layer}.self_attn"
        rope = Program.of("rope.partial", base=geom.rope_theta, rotary=geom.rotary_dim)
        for p in ("q_proj", "k_proj", "v_proj"):
            sites[f"{a}.{p}"] = gemm
        sites[f"{a}.q_norm"] = norm
        sites[f"{a}.k_norm"] = norm
        sites[f"{a}.q_rope"] = rope
        sites[f"{a}.k_rope"] = rope
        sites[f"{a}.core"] = Program.of("attention.blocked", block=32)
        sites[f"{a}.gate"] = Program.of("gate.sigmoid")
        sites[f"{a}.o_proj"] = kpart(geom.heads * geom.head_dim)
    sites[f"{layer}.residual_attn"] = Program.of("residual.add")
    sites[f"{layer}.post_attention_layernorm"] = norm
    m = f"{layer}.mlp"
    sites[f"{m}.gate"] = gemm
    sites[f"{m}.router"] = Program.of("router.softmax_topk", k=geom.topk, normalize=geom.norm_topk)
    for mlp, inner in (
        (f"{m}.experts.*", geom.moe_intermediate),
        (f"{m}.shared_expert", geom.shared_intermediate),
    ):
        sites[f"{mlp}.gate_proj"] = gemm
        sites[f"{mlp}.up_proj"] = gemm
        sites[f"{mlp}.act"] = Program.of("swiglu")
        sites[f"{mlp}.down_proj"] = kpart(inner)
    sites[f"{m}.fold"] = Program.of("moe.fold", acc="bf16")
    sites[f"{m}.shared_expert_gate"] = gemm
    sites[f"{m}.shared_gate"] = Program.of("moe.shared_gate")
    sites[f"{layer}.residual_mlp"] = Program.of("residual.add")
    sites["norm"] = norm
    sites["lm_head"] = Program.of("gemm.kblock", bk=32, out="fp32")
    sites["logprobs"] = Program.of("log_softmax.tree")
    sites["sample"] = Program.of("sample.gumbel_topp")
    # Every adaptable projection's LoRA sites, run when an adapter covers it.
    shrink, expand = Program.of("lora.shrink", bk=32), Program.of("lora.expand", bk=32)
    for path in [p for p in sites if p.endswith(ADAPTED)]:
        sites[f"{path}.lora_shrink"] = shrink
        sites[f"{path}.lora_expand"] = expand
    return sites


LAYOUT = {"k_parts": K_PARTS}


# --- the hybrid programs, called by op site --------------------------------------------------
class NextOps(Ops):
    """``Ops`` plus the hybrid lane's programs. With ``grad=True`` each runs as the dense
    lane's do (``programs.vjp.exact``: the program's bytes forward, its ideal op's VJP
    backward), and the caches a call returns carry gradient into the next call: the conv
    window and the GdnState's cached tokens are copies of the inputs, its S has the VJP of
    the delta rule over the chunks it completed."""

    def __init__(self, contract, *, grad: bool = False):
        super().__init__(contract, grad=grad)

    @site
    def rmsnorm_zc(self, path, x, w):
        prog = self.program(path, "rmsnorm.zero_centered")
        eps = prog.param("eps")
        return self._call(
            path,
            prog,
            lambda a, b: P.rmsnorm_zero_centered(a, b, eps),
            V.rmsnorm_zero_centered(eps),
            x,
            w,
        )

    @site
    def rmsnorm_gated(self, path, x, z, w):
        prog = self.program(path, "rmsnorm.gated")
        eps = prog.param("eps")
        return self._call(
            path,
            prog,
            lambda a, b, c: P.rmsnorm_gated(a, b, c, eps),
            V.rmsnorm_gated(eps),
            x,
            z,
            w,
        )

    @site
    def sigmoid_gate(self, path, x, gate):
        prog = self.program(path, "gate.sigmoid")
        return self._call(path, prog, P.sigmoid_gate, V.sigmoid_gate, x, gate)

    @site
    def shared_gate(self, path, routed, shared, logit):
        prog = self.program(path, "moe.shared_gate")
        return self._call(path, prog, P.shared_expert_gate, V.shared_gate, routed, shared, logit)

    @site
    def rope_partial(self, path, x, positions):
        prog = self.program(path, "rope.partial")
        base, rotary = prog.param("base"), prog.param("rotary")
        return self._call(
            path,
            prog,
            lambda a: P.rope_partial(a, positions, base, rotary),
            V.rope_partial(positions, base, rotary),
            x,
        )

    @site
    def conv1d(self, path, x, w, window):
        """(out, window'): ``out`` recorded; under grad window' is a copy of the inputs'
        last rows (the program's bytes) through which gradient reaches the earlier call."""
        prog = self.program(path, "conv1d.causal")
        kernel = prog.param("kernel")
        kept = {}

        def fn(a, b, c):
            y, kept["window"] = P.conv1d_causal(a, b, c, kernel=kernel)
            return y

        y = self._call(path, prog, fn, V.conv1d_causal(kernel), x, w, window)
        win = kept["window"]
        if self.grad and (x.requires_grad or window.requires_grad):
            full = torch.cat([window, x], dim=0)
            win = full[full.shape[0] - (kernel - 1) :]
        return y, win

    @site
    def gating(self, path, a, b, a_log, dt_bias):
        """(g, beta), recorded as ``<path>.g`` and ``<path>.beta`` (under grad: g with the
        VJP of -exp(A_log) softplus(a + dt_bias), beta with that of sigmoid(b))."""
        prog = self.program(path, "gdn.gating")
        self._ran(path, prog)
        g, beta = P.gdn_gating(a.detach(), b.detach(), a_log.detach(), dt_bias.detach())
        if self.grad:
            g = V.exact(lambda *_: g, V.gdn_decay, a, a_log, dt_bias)
            beta = V.exact(lambda _b: beta, V.gdn_beta, b)
        return record(f"{path}.g", g), record(f"{path}.beta", beta)

    @site
    def l2norm(self, path, x):
        prog = self.program(path, "gdn.l2norm")
        eps = prog.param("eps")
        return self._call(path, prog, lambda a: P.l2norm(a, eps), V.l2norm(eps), x)

    def _serving(self, path: str, expect: str) -> Program:
        prog = self.program(path, expect)
        if self.grad:
            raise ContractMismatch(
                f"op site {site_key(path)!r}: the paged form serves many sequences; it has no "
                "VJP (a trainer runs the per-sequence form)"
            )
        self._ran(path, prog)
        return prog

    @site
    def conv1d_paged(self, path, x, w, pages, seqs):
        """conv1d.causal of every sequence of ``seqs`` over its page's window (serving)."""
        prog = self._serving(path, "conv1d.causal")
        return record(path, P.conv1d_paged(x, w, pages, seqs, kernel=prog.param("kernel")))

    @site
    def gdn_paged(self, path, q, k, v, g, beta, pages, seqs):
        """gdn.chunked of every sequence of ``seqs`` from and into its state page (serving)."""
        prog = self._serving(path, "gdn.chunked")
        return record(path, P.gdn_paged(q, k, v, g, beta, pages, seqs, chunk=prog.param("chunk")))

    @site
    def gdn(self, path, q, k, v, g, beta, state, position: int):
        """(out, state'): ``out`` recorded. Under grad both carry the delta rule's VJP: the
        output's to q, k, v, g, beta and the incoming state, state' S's to the tokens of the
        chunks it completed and the incoming state."""
        prog = self.program(path, "gdn.chunked")
        chunk = prog.param("chunk")
        kept = {}

        def fn(*xs):
            y, kept["state"] = P.gdn_chunked(*xs[:5], state, position=position, chunk=chunk)
            return y

        xs = (q, k, v, g, beta, state.s, state.k, state.v, state.g, state.beta)
        y = self._call(path, prog, fn, V.gdn_chunked, *xs)
        new = kept["state"]
        if self.grad and any(x.requires_grad for x in xs):
            keep, s_end = new.start - state.start, new.s
            cached = [torch.cat(p, dim=0)[keep:] for p in zip(xs[6:], xs[1:5], strict=True)]
            new = P.GdnState(
                chunk=new.chunk,
                start=new.start,
                s=V.exact(lambda *_: s_end, V.gdn_state(keep), *xs),
                k=cached[0],
                v=cached[1],
                g=cached[2],
                beta=cached[3],
            )
        return y, new


# --- the per-sequence cache ---------------------------------------------------------------------
@dataclass
class NextCache:
    """One sequence's cache: ``position`` (tokens seen), per GDN layer its GdnState and conv
    window, per attention layer its K (after norm and rope) and V, [S, Hkv, D] bf16."""

    position: int = 0
    gdn: dict[int, P.GdnState] = field(default_factory=dict)
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def empty(cls, geom: Geometry, device=None) -> NextCache:
        """A fresh sequence at position 0, its tensors on ``device`` (cpu if None): the
        device of the model that continues it (the programs refuse a cache on another)."""
        c = cls()
        kv = (0, geom.kv_heads, geom.head_dim)
        for i, kind in enumerate(geom.layer_types):
            if kind == LINEAR:
                c.gdn[i] = P.gdn_state(
                    geom.linear_key_heads,
                    geom.linear_value_heads,
                    geom.linear_key_dim,
                    geom.linear_value_dim,
                    chunk=geom.chunk,
                    device=device,
                )
                c.conv[i] = P.conv1d_window(geom.conv_dim, kernel=geom.conv_kernel, device=device)
            else:
                c.keys[i] = torch.zeros(kv, dtype=torch.bfloat16, device=device)
                c.values[i] = torch.zeros(kv, dtype=torch.bfloat16, device=device)
        return c


# --- composition -----------------------------------------------------------------------------
class Slots:
    """What an engine supplies: ``weight``, a tensor by HF name (suffix after
    ``model.layers.N.``, or the full name for the embedding, final norm and LM head), and
    ``attend``, attention over the engine's own K/V cache."""

    def weight(self, layer: int | None, name: str) -> torch.Tensor:
        raise NotImplementedError

    def lora(self, layer: int, name: str) -> LoRA | None:
        """The adapter factors (A, B, scale) covering projection ``name`` (e.g.
        ``linear_attn.in_proj_qkvz``), already bf16, or None: the base weights only."""
        return None

    def experts(self, layer: int) -> Mapping[str, torch.Tensor] | None:
        """The layer's routed experts' weights stacked ({"gate_proj": [E, I, H], "up_proj":
        [E, I, H], "down_proj": [E, H, I]}) where the engine runs them grouped (one launch a
        projection for every expert, ``Layer.moe``), or None: each expert on its rows in turn
        (``local_dispatch``). Only where no adapter covers an expert. The rows' bytes are the
        same either way (``programs.gemm_grouped``)."""
        return None

    def gdn_pages(self, layer: int) -> tuple[P.GdnPages, P.PagedSeqs | P.PagedPasses] | None:
        """GDN layer ``layer``'s state pages and the step's sequences over them, where the
        engine keeps every sequence's state in pages: where each sequence's rows of this step
        stay inside one chunk (``P.paged_seqs``) conv1d.causal and gdn.chunked run once for all
        sequences (``P.conv1d_paged``, ``P.gdn_paged``; each row the bytes of its sequence's
        own call), else a pass per chunk (``P.paged_passes``; the same programs take it), and
        the pages advance. None: per sequence, on its ``NextCache``."""
        return None

    def attend(self, layer: int, q, k, v, segs: Segments, positions, core) -> torch.Tensor:
        """This step's rows of attention layer ``layer``: q/k/v are every row's (after norm
        and rope); each sequence's k/v join its cache, then ``core(q_rows, keys, values,
        positions_of_those_rows)`` runs per sequence, in ``segs`` order. This default keeps
        K/V in the sequences' ``NextCache``; an engine keeps them in its own cache."""
        outs = []
        for lo, n, cache in segs:
            rows = slice(lo, lo + n)
            cache.keys[layer] = torch.cat([cache.keys[layer], k[rows]], dim=0)
            cache.values[layer] = torch.cat([cache.values[layer], v[rows]], dim=0)
            outs.append(core(q[rows], cache.keys[layer], cache.values[layer], positions[rows]))
        return torch.cat(outs, dim=0)


class DictSlots(Slots):
    """Weights (and ``adapters``: HF weight name -> LoRA) from HF-named dicts."""

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        geom: Geometry,
        adapters: Mapping[str, LoRA] | None = None,
    ):
        self.weights = weights
        self.adapters = adapters or {}
        self.per_layer: list[dict[str, torch.Tensor]] = [{} for _ in range(geom.layers)]
        for name, t in weights.items():
            if name.startswith("model.layers."):
                idx, rest = name[len("model.layers.") :].split(".", 1)
                self.per_layer[int(idx)][rest] = t

    def weight(self, layer, name):
        return self.weights[name] if layer is None else self.per_layer[layer][name]

    def lora(self, layer, name):
        return self.adapters.get(f"model.layers.{layer}.{name}.weight")


Segments = Sequence[tuple[int, int, NextCache]]  # (first row, row count, the sequence's cache)


class Layer:
    """One decoder layer: the only place its op order is written."""

    def __init__(self, geom: Geometry, index: int, ops: NextOps, slots: Slots):
        self.geom, self.index, self.ops, self.slots = geom, index, ops, slots
        self.site = f"layers.{index}"

    def w(self, name: str) -> torch.Tensor:
        return self.slots.weight(self.index, name)

    def gemm(self, x, name: str):
        """The projection's gemm, plus lora.shrink/lora.expand when an adapter covers it."""
        lora = self.slots.lora(self.index, name)
        return linear(self.ops, f"{self.site}.{name}", x, self.w(f"{name}.weight"), lora)

    def gdn(self, h, segs: Segments):
        g, ops, s, i = self.geom, self.ops, f"{self.site}.linear_attn", self.index
        t = h.shape[0]
        hk, hv, dk, dv = (
            g.linear_key_heads,
            g.linear_value_heads,
            g.linear_key_dim,
            g.linear_value_dim,
        )
        r = hv // hk
        qkvz = self.gemm(h, "linear_attn.in_proj_qkvz").view(t, hk, 2 * dk + 2 * r * dv)
        ba = self.gemm(h, "linear_attn.in_proj_ba").view(t, hk, 2 * r)
        # Per key head: q, k, then its r value heads' v and z; b then a for its r value heads.
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        b, a = ba[..., :r].reshape(t, hv), ba[..., r:].reshape(t, hv)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        conv_w = self.w("linear_attn.conv1d.weight").squeeze(1)
        gate, beta = ops.gating(
            f"{s}.gating",
            a.contiguous(),
            b.contiguous(),
            self.w("linear_attn.A_log"),
            self.w("linear_attn.dt_bias"),
        )
        paged = None if is_recording() else self.slots.gdn_pages(i)
        if paged is not None:  # every sequence at once, over the engine's state pages
            pages, seqs = paged
            x = ops.conv1d_paged(f"{s}.conv1d", mixed, conv_w, pages, seqs)
            qq, kk, vv = torch.split(x, [g.key_dim, g.key_dim, g.value_dim], dim=-1)
            o = ops.gdn_paged(
                f"{s}.core",
                ops.l2norm(f"{s}.q_l2norm", qq.reshape(t, hk, dk)),
                ops.l2norm(f"{s}.k_l2norm", kk.reshape(t, hk, dk)),
                vv.reshape(t, hv, dv).contiguous(),
                gate,
                beta,
                pages,
                seqs,
            )
        else:
            o = self._gdn_per_sequence(mixed, conv_w, gate, beta, segs)
        o = ops.rmsnorm_gated(
            f"{s}.norm", o, z.reshape(t, hv, dv).contiguous(), self.w("linear_attn.norm.weight")
        )
        return self.gemm(o.reshape(t, -1), "linear_attn.out_proj")

    def _gdn_per_sequence(self, mixed, conv_w, gate, beta, segs: Segments):
        """conv1d.causal and gdn.chunked a sequence at a time, on its ``NextCache``."""
        g, ops, s, i = self.geom, self.ops, f"{self.site}.linear_attn", self.index
        hk, hv, dk, dv = (
            g.linear_key_heads,
            g.linear_value_heads,
            g.linear_key_dim,
            g.linear_value_dim,
        )
        outs = []
        for lo, n, cache in segs:
            rows = slice(lo, lo + n)
            x, cache.conv[i] = ops.conv1d(f"{s}.conv1d", mixed[rows], conv_w, cache.conv[i])
            qq, kk, vv = torch.split(x, [g.key_dim, g.key_dim, g.value_dim], dim=-1)
            qn = ops.l2norm(f"{s}.q_l2norm", qq.reshape(n, hk, dk))
            kn = ops.l2norm(f"{s}.k_l2norm", kk.reshape(n, hk, dk))
            o, cache.gdn[i] = ops.gdn(
                f"{s}.core",
                qn,
                kn,
                vv.reshape(n, hv, dv).contiguous(),
                gate[rows],
                beta[rows],
                cache.gdn[i],
                cache.position,
            )
            outs.append(o)
        return torch.cat(outs, dim=0)

    def attention(self, h, segs: Segments, positions):
        g, ops, s, i = self.geom, self.ops, f"{self.site}.self_attn", self.index
        t = h.shape[0]
        qg = self.gemm(h, "self_attn.q_proj").view(t, g.heads, 2 * g.head_dim)
        q, gate = qg[..., : g.head_dim], qg[..., g.head_dim :].reshape(t, -1)
        k = self.gemm(h, "self_attn.k_proj").view(t, g.kv_heads, g.head_dim)
        v = self.gemm(h, "self_attn.v_proj").view(t, g.kv_heads, g.head_dim)
        q = ops.rmsnorm_zc(f"{s}.q_norm", q.contiguous(), self.w("self_attn.q_norm.weight"))
        k = ops.rmsnorm_zc(f"{s}.k_norm", k, self.w("self_attn.k_norm.weight"))
        q = ops.rope_partial(f"{s}.q_rope", q, positions)
        k = ops.rope_partial(f"{s}.k_rope", k, positions)
        core = AttentionSite(ops, f"{s}.core")
        o = record(f"{s}.core", self.slots.attend(i, q, k, v, segs, positions, core))
        o = o.reshape(t, -1)
        o = ops.sigmoid_gate(f"{s}.gate", o, gate.contiguous())
        return self.gemm(o, "self_attn.o_proj")

    def mlp(self, x, pre: str, proj=None):
        """``proj(x, name)``: the projections' form (default ``self.gemm``; grouped experts
        pass theirs)."""
        proj = proj or self.gemm
        gate = proj(x, f"{pre}.gate_proj")
        up = proj(x, f"{pre}.up_proj")
        act = self.ops.swiglu(f"{self.site}.{pre}.act", gate, up)
        return proj(act, f"{pre}.down_proj")

    def moe(self, h):
        ops, s = self.ops, f"{self.site}.mlp"
        ids, weights = ops.router(f"{s}.router", self.gemm(h, "mlp.gate"))
        stacked = None if is_recording() else self.slots.experts(self.index)
        if stacked is None:
            out = local_dispatch(h, ids, lambda e, x: self.mlp(x, f"mlp.experts.{e}"))
        else:  # every expert at once, as the Qwen3-MoE lane
            out = grouped_experts(
                ops, self.site, h, ids, stacked, self.geom.experts, self.mlp, "mlp.experts.*"
            )
        routed = ops.moe_fold(f"{s}.fold", out, weights)
        shared = self.mlp(h, "mlp.shared_expert")
        logit = self.gemm(h, "mlp.shared_expert_gate")
        return ops.shared_gate(f"{s}.shared_gate", routed, shared, logit)

    def __call__(self, h, segs: Segments, positions):
        ops, s = self.ops, self.site
        x = ops.rmsnorm_zc(f"{s}.input_layernorm", h, self.w("input_layernorm.weight"))
        if self.geom.layer_types[self.index] == LINEAR:
            mixed = self.gdn(x, segs)
        else:
            mixed = self.attention(x, segs, positions)
        h = ops.residual_add(f"{s}.residual_attn", h, mixed)
        x = ops.rmsnorm_zc(
            f"{s}.post_attention_layernorm", h, self.w("post_attention_layernorm.weight")
        )
        return ops.residual_add(f"{s}.residual_mlp", h, self.moe(x))


def forward(
    ops: NextOps, geom: Geometry, slots: Slots, batch: Sequence[tuple[torch.Tensor, NextCache]]
):
    """The lane over a step of several sequences: each (token ids [n], its cache) continues
    that sequence at ``cache.position``; the caches are advanced. Returns [sum n, V] fp32
    log-probabilities, the sequences' rows in order."""
    h = hidden(ops, geom, slots, batch)
    return ops.log_softmax("logprobs", final_logits(ops, geom, slots, h))


def hidden(
    ops: NextOps, geom: Geometry, slots: Slots, batch: Sequence[tuple[torch.Tensor, NextCache]]
) -> torch.Tensor:
    """The embedding and every layer over a step (``forward``'s batch); the caches are
    advanced. Returns the [sum n, hidden] bf16 rows before the final norm."""
    segs, pos, lo = [], [], 0
    for tokens, cache in batch:
        n = int(tokens.shape[0])
        segs.append((lo, n, cache))
        pos.append(torch.arange(cache.position, cache.position + n, device=tokens.device))
        lo += n
    h = _layers(ops, geom, slots, torch.cat([t for t, _ in batch]), segs, torch.cat(pos))
    for _, n, cache in segs:
        cache.position += n
    return h


def hidden_rows(
    ops: NextOps, geom: Geometry, slots: Slots, tokens: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """``hidden`` over a step given as rows, token ids and positions [T] on the device, whose
    sequences all run over the engine's state pages and attention cache: ``slots.gdn_pages``
    places every GDN layer's sequences (no ``NextCache``), ``slots.attend`` attends them.
    Nothing of the step is read on the host, so a CUDA graph can capture it. Returns the
    [T, hidden] bf16 rows; a row of no sequence (padding) carries no program's bytes."""
    linear = [i for i, kind in enumerate(geom.layer_types) if kind == LINEAR]
    if linear and (is_recording() or slots.gdn_pages(linear[0]) is None):
        raise ValueError(
            "hidden_rows: every GDN layer must run over the engine's state pages "
            "(slots.gdn_pages), outside a recording"
        )
    return _layers(ops, geom, slots, tokens, (), positions)


def _layers(ops: NextOps, geom: Geometry, slots: Slots, tokens, segs: Segments, positions):
    """The embedding, then every layer in order: ``hidden``'s and ``hidden_rows``' body."""
    h = ops.embed("embed_tokens", slots.weight(None, "model.embed_tokens.weight"), tokens)
    for i in range(geom.layers):
        h = Layer(geom, i, ops, slots)(h, segs, positions)
    return h


def final_logits(ops: NextOps, geom: Geometry, slots: Slots, h: torch.Tensor) -> torch.Tensor:
    """fp32 logits of ``hidden``'s rows: the final norm and the LM head."""
    hn = ops.rmsnorm_zc("norm", h, slots.weight(None, "model.norm.weight"))
    name = "model.embed_tokens.weight" if geom.tie_embeddings else "lm_head.weight"
    return ops.gemm("lm_head", hn, slots.weight(None, name))


def geometry_contract(
    geom: Geometry, *, backend: str = "cpu", tp: int = 1, ep: int = 1, machine=None
) -> Contract:
    """This lane's contract for ``geom`` (``model.geometry_contract`` picks the lane): one
    device so far."""
    if tp != 1 or ep != 1:
        raise LayoutRefused(
            f"layout: the qwen3-next lane runs on one device so far (tp 1, ep 1); asked for "
            f"tp {tp}, ep {ep}"
        )
    return make_contract(
        geom, op_sites(geom), k_parts=K_PARTS, backend=backend, tp=tp, ep=ep, machine=machine
    )


def default_ops(geom: Geometry, backend: str = "cpu") -> NextOps:
    return NextOps(geometry_contract(geom, backend=backend))


def forward_logprobs(
    weights: Mapping[str, torch.Tensor],
    geom: Geometry,
    tokens: torch.Tensor,
    cache: NextCache | None = None,
    *,
    ops: NextOps | None = None,
    adapters: Mapping[str, LoRA] | None = None,
) -> torch.Tensor:
    """Reference forward of one sequence: [T, V] log-probabilities of ``tokens`` continuing
    ``cache`` (a fresh sequence at position 0 when None; the cache is advanced), with
    ``adapters`` (HF weight name -> LoRA, ``adapters.load_adapter(...).modules``) if given."""
    ops = ops or default_ops(geom, tokens.device.type)
    cache = cache if cache is not None else NextCache.empty(geom, tokens.device)
    return forward(ops, geom, DictSlots(weights, geom, adapters), [(tokens, cache)])
