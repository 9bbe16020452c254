"""Parallel layouts of the lane: which shard of each weight a rank holds, and the collectives
the composition runs through its slots, so every layout gives the bytes of one device.

Tensor parallelism (``tp``) splits column-parallel projections (q, k, v, gate, up) by output
rows and row-parallel ones (o, down) by K; a row-parallel site runs gemm.kpart, whose
canonical K partitions each rank folds as a whole subtree before an all-gather of fp32
partials and the top of the same tree (``programs.gemm_kpart``). Expert parallelism (``ep``)
gives each rank a contiguous block of experts; the routed rows' expert outputs are gathered
from their owners (a select, never a sum) before moe.fold adds them in slot order. Norms,
embeddings, the router and the LM head stay whole. Ranks are numbered ``ep_index * tp +
tp_index``.

``ShardedSlots`` is the reference engine of a layout (the composition over sharded HF-named
weights, ``torch.distributed`` for the collectives); the engines' own parallel layers fill the
same slots.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from . import programs as P
from .contract import check_layout
from .lanes.qwen3 import DictSlots, Geometry, LoRA, is_row_parallel, local_dispatch

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.ep

    def indices(self, rank: int) -> tuple[int, int]:
        """(tp_index, ep_index) of a global rank."""
        return rank % self.tp, rank // self.tp

    def tp_group(self, rank: int) -> list[int]:
        _, e = self.indices(rank)
        return [e * self.tp + j for j in range(self.tp)]

    def ep_group(self, rank: int) -> list[int]:
        t, _ = self.indices(rank)
        return [i * self.tp + t for i in range(self.ep)]


def _chunk(t: torch.Tensor, dim: int, index: int, parts: int) -> torch.Tensor:
    if t.shape[dim] % parts:
        raise ValueError(f"cannot split dimension {dim} of {tuple(t.shape)} into {parts}")
    return t.chunk(parts, dim=dim)[index].contiguous()


def shard_name(name: str) -> str | None:
    """'column', 'row' or None (whole) for an HF weight name's suffix."""
    stem = name.removesuffix(".weight")
    if is_row_parallel(stem):
        return "row"
    if stem.endswith(COLUMN):
        return "column"
    return None


def shard_weight(name: str, t: torch.Tensor, tp_index: int, tp: int) -> torch.Tensor:
    kind = shard_name(name)
    if tp == 1 or kind is None:
        return t
    return _chunk(t, 0 if kind == "column" else 1, tp_index, tp)


def shard_lora(name: str, lora: LoRA, tp_index: int, tp: int) -> LoRA:
    """A column-parallel site's adapter: B split by output rows (A whole); a row-parallel
    site's adapter stays whole (the composition gathers its input)."""
    a, b, scale = lora
    if tp == 1 or shard_name(name) != "column":
        return lora
    return a, _chunk(b, 0, tp_index, tp), scale


def _expert_of(name: str) -> int:
    return int(name.split(".mlp.experts.")[1].split(".")[0])


class DistGather(P.Gather):
    """An all-gather over a ``torch.distributed`` group (gloo or NCCL), in rank order."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def all(self, t: torch.Tensor) -> list[torch.Tensor]:
        import torch.distributed as dist

        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t, group=self.group)
        return out


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


def check(contract, layout: Layout) -> None:
    check_layout(contract, tp=layout.tp, ep=layout.ep)


def _rank_main(
    rank: int, layout: Layout, model_dir: str, tokens, port: int, out: str, nudge, device: str
):
    """One rank of ``reference_logprobs``: process groups (gloo on cpu, NCCL on cuda: one GPU
    per rank), sharded slots, the composition."""
    import os

    import torch.distributed as dist

    from .lanes.qwen3 import default_ops, forward
    from .model import ModelDir

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
        from safetensors.torch import load_file

        weights = {}
        for f in sorted(model.path.glob("*.safetensors")):
            weights.update(load_file(str(f), device=str(dev)))
        if nudge is not None and rank == nudge[0]:
            from .parity import nudge_ulp

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
    import socket
    import tempfile

    import torch.multiprocessing as mp

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
