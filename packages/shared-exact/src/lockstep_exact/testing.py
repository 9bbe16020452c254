"""Test scaffolding and negative controls: what tests (and controls) use, not the lanes.

- ``assert_same_bytes``: the byte-equality assertion of the tests, naming the first element
  that differs and its ulp distance (over ``parity``'s comparisons);
- ``nudge_ulp``: a copy of a tensor with one element moved by some ulps, the negative control of
  every invariance test (a check that cannot see it proves nothing);
- ``perturb_adapter``: a copy of a LoRA adapter with one factor element moved, the perturbed
  adapter control;
- the reference engine of a parallel layout (``ShardedSlots``, ``select_owners``,
  ``reference_logprobs``): the lane's composition over sharded HF-named weights, one process
  per rank over ``torch.distributed``, which the engines' parallel layers are checked against.

Production library code never imports this module (an import-linter contract in the root
``pyproject.toml`` holds it). The application may: the qualify ladder
(``lockstep_exact.app.qualify``) runs ``perturb_adapter`` at run time as the negative control of
its adapter gates, which is why that control ships in the package instead of the tests.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import load_file

from . import programs as P
from .adapters import CONFIG, HASH_KEY, WEIGHTS, AdapterError, _write_dir, adapter_sha256
from .lanes.qwen3 import DictSlots, Geometry, LoRA, default_ops, forward, local_dispatch
from .layout import DistGather, Layout, _expert_of, check, shard_lora, shard_weight
from .model import ModelDir
from .parity import first_difference, raw_bits, ulp_distance

__all__ = [
    "ShardedSlots",
    "assert_same_bytes",
    "nudge_ulp",
    "perturb_adapter",
    "reference_logprobs",
    "select_owners",
]


def assert_same_bytes(a: torch.Tensor, b: torch.Tensor, what: str = "tensors") -> None:
    if a.dtype != b.dtype or a.shape != b.shape:
        raise AssertionError(f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
    where = first_difference(a, b)
    if where is not None:
        n = int((raw_bits(a) != raw_bits(b)).sum())
        raise AssertionError(
            f"{what}: {n} element(s) differ in bytes; first at {where}: {a[where].item()!r} vs "
            f"{b[where].item()!r} ({ulp_distance(a[where], b[where])} ulp)"
        )


def nudge_ulp(t: torch.Tensor, index: int = 0, ulps: int = 1) -> torch.Tensor:
    """A copy of ``t`` with one element moved by ``ulps`` units in the last place."""
    out = t.detach().clone().contiguous()
    bits = raw_bits(out).view(-1)
    bits[index] = bits[index] + ulps
    return out


def perturb_adapter(adapter_dir, out_dir, key: str, delta: float = 2.0**-9) -> Path:
    """A copy with one factor's first element moved by ``delta`` (the perturbed control).

    The config and the bindings are kept; a Lockstep export's recorded hash is renewed (the
    copy is a deliberate new adapter), a foreign adapter stays without one.
    """
    src = Path(adapter_dir)
    config = json.loads((src / CONFIG).read_text())
    with safe_open(str(src / WEIGHTS), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iter)
        meta = dict(f.metadata() or {})
    if key not in tensors:
        raise AdapterError(f"adapter has no factor {key}")
    t = tensors[key].float().clone()
    t.view(-1)[0] += delta
    tensors[key] = t.to(tensors[key].dtype)
    if HASH_KEY in meta:
        meta[HASH_KEY] = adapter_sha256(tensors, config)
    return _write_dir(Path(out_dir), tensors, config, meta)


class ShardedSlots(DictSlots):
    """The reference engine of one rank of a layout: HF-named weights, sharded."""

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        geom: Geometry,
        layout: Layout,
        rank: int,
        *,
        tp_gather: P.Gather = P.LOCAL,
        ep_gather: P.Gather = P.LOCAL,
        adapters: Mapping[str, LoRA] | None = None,
    ):
        self.layout, self.rank = layout, rank
        self.tp_index, self.ep_index = layout.indices(rank)
        per_expert = geom.experts // layout.ep if geom.is_moe else 0
        self.owned = range(self.ep_index * per_expert, (self.ep_index + 1) * per_expert)
        kept = {}
        for name, t in weights.items():
            if ".mlp.experts." in name and _expert_of(name) not in self.owned:
                continue  # another rank's expert
            kept[name] = shard_weight(name, t, self.tp_index, layout.tp)
        shards = {
            k: shard_lora(k, v, self.tp_index, layout.tp) for k, v in (adapters or {}).items()
        }
        super().__init__(kept, geom, shards)
        self.gather = tp_gather
        self.ep_gather = ep_gather
        self.per_expert = per_expert

    def dispatch(self, layer, h, ids, expert):
        """This rank's experts on the rows routed to them; each (row, slot) then takes the
        output of the rank that owns its expert (a select: no sum, no reordering)."""
        out = local_dispatch(h, ids, expert, owned=self.owned)
        return select_owners(out, ids, self.ep_gather, self.per_expert)


def select_owners(out: torch.Tensor, ids: torch.Tensor, ep_gather: P.Gather, per_expert: int):
    """Expert parallelism's exchange: ``out`` [T, k, H] holds this rank's experts' outputs
    (other slots zero); every rank's ``out`` is all-gathered over ``ep_gather`` in rank order
    and each (row, slot) takes the copy of the rank owning its expert (``ids // per_expert``):
    a select, so moe.fold sees one device's bytes in slot order at any ep. The reference
    engine's dispatch slot calls it; the trainer's MoELayer, whose ep ranks hold different
    tokens, moves rows through Megatron's token dispatcher instead (lockstep_megatron/moe.py)."""
    if ep_gather.size == 1:
        return out
    owners = torch.stack(ep_gather.all(out))  # [ep, T, k, H]
    pick = (ids // per_expert).to(torch.long)  # [T, k]: the owner's ep index
    return torch.gather(owners, 0, pick[None, :, :, None].expand(1, *out.shape)).squeeze(0)


def _rank_main(
    rank: int, layout: Layout, model_dir: str, tokens, port: int, out: str, nudge, device: str
):
    """One rank of ``reference_logprobs``: process groups (gloo on cpu, NCCL on cuda: one GPU
    per rank), sharded slots, the composition."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dev = torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=layout.world)
    try:
        groups = {}
        for make in (layout.tp_group, layout.ep_group):  # every rank creates every group
            for r in range(layout.world):
                members = tuple(make(r))
                if members not in groups:
                    groups[members] = dist.new_group(list(members))
        tp_members, ep_members = tuple(layout.tp_group(rank)), tuple(layout.ep_group(rank))
        model = ModelDir(model_dir)
        weights = {}
        for f in sorted(model.path.glob("*.safetensors")):
            weights.update(load_file(str(f), device=str(dev)))
        if nudge is not None and rank == nudge[0]:
            for name in [nudge[1]] if isinstance(nudge[1], str) else nudge[1]:
                if name.startswith("every:"):  # every element of the tensor one ulp up
                    t = weights[name[len("every:") :]]
                    weights[name[len("every:") :]] = (t.view(torch.int16) + 1).view(t.dtype)
                else:
                    weights[name] = nudge_ulp(weights[name], 0)
        contract = model.contract(device)
        check(contract, layout)
        slots = ShardedSlots(
            weights,
            model.geometry,
            layout,
            rank,
            tp_gather=DistGather(groups[tp_members], layout.tp) if layout.tp > 1 else P.LOCAL,
            ep_gather=DistGather(groups[ep_members], layout.ep) if layout.ep > 1 else P.LOCAL,
        )
        t = torch.tensor(tokens, dtype=torch.long, device=dev)
        ops = default_ops(model.geometry, device)
        lp = forward(ops, model.geometry, slots, t, torch.arange(len(t), device=dev))
        torch.save(lp.cpu(), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def reference_logprobs(
    model_dir,
    layout: Layout,
    tokens,
    *,
    nudge: tuple[int, str | list[str]] | None = None,
    device: str = "cpu",
) -> list[torch.Tensor]:
    """Every rank's [T, V] log-probabilities of ``tokens`` under ``layout`` (the reference
    engine in ``layout.world`` processes over gloo). ``nudge`` = (rank, weight name or names):
    that rank's copy of those weights one ulp off at element 0, or at every element for a name
    written ``every:NAME`` (negative controls). ``device="cuda"``: one GPU per rank, NCCL and
    the cuda programs (the result comes back on the cpu)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/lp"
        mp.start_processes(
            _rank_main,
            args=(layout, str(model_dir), list(tokens), port, out, nudge, device),
            nprocs=layout.world,
            start_method="spawn",
        )
        return [torch.load(f"{out}.{r}") for r in range(layout.world)]


def random_pages(n: int, heads, dims, chunk: int, conv_dim: int, kernel: int, gen):
    """``n`` state pages (``P.GdnPages``) of random bytes for (Hk, Hv) ``heads`` and (K, V)
    ``dims``: what a serving engine's pages hold before a request writes them."""
    hk, hv = heads
    dk, dv = dims
    return P.GdnPages(
        s=torch.randn(n, hv, dk, dv, generator=gen),
        k=torch.randn(n, chunk, hk, dk, generator=gen),
        v=torch.randn(n, chunk, hv, dv, generator=gen).bfloat16(),
        g=torch.randn(n, chunk, hv, generator=gen),
        beta=torch.randn(n, chunk, hv, generator=gen),
        u=torch.randn(n, chunk, hv, dv, generator=gen),
        gcum=torch.randn(n, chunk, hv, generator=gen),
        conv=torch.randn(n, kernel - 1, conv_dim, generator=gen).bfloat16(),
    )


def gdn_paged_case(
    heads: tuple[int, int],
    dims: tuple[int, int],
    chunk: int,
    seqs,
    *,
    pages: int = 8,
    kernel: int = 4,
    seed: int = 0,
):
    """A step of the paged GDN programs on cpu, made from the programs themselves: ``seqs`` is
    (position, rows, page) per sequence; each page holds the state the per-sequence program
    reached after ``position`` random tokens (its s, cached and solved rows, a random conv
    window), the unused pages random bytes. Returns (inputs, GdnPages, seq lists) where inputs
    is (q, k, v, g, beta) of gdn.chunked and (x, weight) of conv1d.causal; ``P.paged_seqs``
    makes the table on any device."""
    hk, hv = heads
    dk, dv = dims
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        q = P.l2norm(torch.randn(n, hk, dk, generator=gen).bfloat16())
        k = P.l2norm(torch.randn(n, hk, dk, generator=gen).bfloat16())
        v = torch.randn(n, hv, dv, generator=gen).bfloat16()
        g, beta = P.gdn_gating(
            torch.randn(n, hv, generator=gen).bfloat16(),
            torch.randn(n, hv, generator=gen).bfloat16(),
            torch.randn(hv, generator=gen) * 0.5,
            torch.randn(hv, generator=gen) * 0.5,
        )
        return q, k, v, g, beta

    d = 2 * hk * dk + hv * dv
    book = random_pages(pages, heads, dims, chunk, d, kernel, gen)
    for position, _, page in seqs:
        if position:
            state = P.gdn_state(hk, hv, dk, dv, chunk=chunk)
            _, state = P.gdn_chunked(*tokens(position), state, position=0, chunk=chunk)
            book.keep(page, state)
    starts = [0]
    for _, n, _ in seqs:
        starts.append(starts[-1] + n)
    x = torch.randn(starts[-1], d, generator=gen).bfloat16()
    weight = torch.randn(d, kernel, generator=gen).bfloat16()
    positions = [p for p, _, _ in seqs]
    slots = [page for _, _, page in seqs]
    return (*tokens(starts[-1]), x, weight), book, (starts, positions, slots)


def padded_decode_case(
    heads: tuple[int, int],
    dims: tuple[int, int],
    chunk: int,
    decodes,
    pads,
    *,
    pages: int = 10,
    kernel: int = 4,
    seed: int = 0,
):
    """A decode step padded as a CUDA graph of a larger batch pads it: ``decodes`` is
    (position, page) of one-row sequences (``gdn_paged_case``'s pages), then one padding entry
    per page of ``pads`` (padding may name any page, a live one too: it must write nothing).
    Returns (inputs: ``gdn_paged_case``'s with one more row per padding entry, copies of live
    rows; book; (positions, slots, live) tensors for ``P.paged_decodes``; the live step's
    (starts, positions, slots) for ``P.paged_seqs``)."""
    inputs, book, live_step = gdn_paged_case(
        heads, dims, chunk, [(p, 1, page) for p, page in decodes], pages=pages, kernel=kernel,
        seed=seed,
    )  # fmt: skip
    n = len(decodes)
    pick = torch.randint(0, n, (len(pads),), generator=torch.Generator().manual_seed(seed + 1))
    padded = tuple(torch.cat([t, t[pick]]) for t in inputs[:-1]) + (inputs[-1],)
    positions = torch.tensor([p for p, _ in decodes] + [3 * i + 1 for i in range(len(pads))])
    slots = torch.tensor([page for _, page in decodes] + list(pads))
    live = torch.tensor([True] * n + [False] * len(pads))
    return padded, book, (positions, slots, live), live_step


def pages_to(book, device):
    """A copy of ``book`` (``P.GdnPages``) on ``device``."""
    return P.GdnPages(**{f: getattr(book, f).clone().to(device) for f in book.__dataclass_fields__})


def own_calls(inputs, book, starts, positions, slots, *, chunk: int, kernel: int = 4):
    """What each sequence's own calls give, over all its rows at once on its page's state and
    window (zeros at position 0), in a copy of ``book``: ``gdn_chunked`` and
    ``conv1d_causal``, the definitions the paged programs must match however a step is cut.
    ``inputs``: ``gdn_paged_case``'s. Returns (out, conv out, the copy advanced)."""
    q, k, v, g, beta, x, weight = inputs
    book = pages_to(book, "cpu")
    hk, hv, dk, dv = k.shape[1], v.shape[1], k.shape[2], v.shape[2]
    out = torch.zeros(v.shape, dtype=torch.bfloat16)
    conv = torch.zeros(x.shape, dtype=torch.bfloat16)
    for r, (p, slot) in enumerate(zip(positions, slots, strict=True)):
        rows = slice(starts[r], starts[r + 1])
        if p == 0:
            state = P.gdn_state(hk, hv, dk, dv, chunk=chunk)
            window = P.conv1d_window(x.shape[1], kernel=kernel)
        else:
            state, window = book.state(slot, p, chunk), book.conv[slot].clone()
        o, new = P.gdn_chunked(
            q[rows], k[rows], v[rows], g[rows], beta[rows], state, position=p, chunk=chunk
        )
        out[rows] = o
        book.keep(slot, new)
        conv[rows], book.conv[slot] = P.conv1d_causal(x[rows], weight, window, kernel=kernel)
    return out, conv, book


def live_pages(book, slots, positions, chunk: int) -> dict[str, torch.Tensor]:
    """What pages ``slots`` hold that a sequence at ``positions`` reads (s, the conv window
    and the first position mod chunk rows of the cached ones), by tensor, on cpu: two books
    hold the same states when these are equal byte for byte."""
    out = {}
    for slot, p in zip(slots, positions, strict=True):
        w = p % chunk
        out[f"{slot}.s"], out[f"{slot}.conv"] = book.s[slot].cpu(), book.conv[slot].cpu()
        for f in ("k", "v", "g", "beta", "u", "gcum"):
            out[f"{slot}.{f}"] = getattr(book, f)[slot, :w].cpu()
    return out
