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

The reference engine of a layout (the composition over sharded HF-named weights,
``torch.distributed`` for the collectives) is test scaffolding: ``testing.ShardedSlots`` and
``testing.reference_logprobs``; the engines' own parallel layers fill the same slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import programs as P
from .contract import check_layout
from .lanes.qwen3 import LoRA, is_row_parallel

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
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t, group=self.group)
        return out


def check(contract, layout: Layout) -> None:
    check_layout(contract, tp=layout.tp, ep=layout.ep)
