"""The exact linears: Megatron's own (column / row parallel) linear modules, or a whole weight,
holding the lane's weight and its named output parts, with LoRA per part and no forward of
their own (the composition reads the weight). Shared by the dense specs (``spec``), the MoE
experts (``moe``) and the hybrid lane (``gdn``).
"""

from __future__ import annotations

import torch
from torch import nn

BF16 = torch.bfloat16


# --- linear layers -------------------------------------------------------------------------------
class _Exact:
    """What every exact linear holds beside its weight: the named output parts (the HF
    projections of a fused weight, this rank's rows under tensor parallelism), LoRA per part,
    and no forward of its own (the composition reads the weight)."""

    def _exact_init(self, parts: dict[str, torch.Tensor], input_full: int) -> None:
        self.weight.requires_grad_(False)
        self.parts = dict(parts)
        self.input_full = input_full  # K of the whole matrix (a row-parallel LoRA A is whole)
        self.lora = nn.ModuleDict()

    def add_lora(self, part: str, rank: int, alpha: float, generator: torch.Generator):
        """A ~ kaiming-like uniform, B = 0 (PEFT's init): a new adapter changes no byte."""
        k = self.input_full
        bound = 1.0 / k**0.5
        a = (torch.rand(rank, k, generator=generator, dtype=torch.float32) * 2 - 1) * bound
        b = torch.zeros(len(self.parts[part]), rank, dtype=torch.float32)
        self.lora[part] = LoRA(a, b, alpha / rank)

    def part_weight(self, part: str) -> torch.Tensor:
        if len(self.parts) == 1:
            return self.weight
        return self.weight[self.parts[part].to(self.weight.device)]

    def forward(self, *args, **kwargs):
        raise RuntimeError("exact linears run inside the lane composition (ExactLayer)")


class ExactLinear(_Exact, nn.Module):
    """A (possibly fused) whole weight [N, K] (tensor-parallel size 1, and the experts)."""

    def __init__(self, input_size: int, parts: dict[str, torch.Tensor]):
        nn.Module.__init__(self)
        out = sum(len(c) for c in parts.values())
        self.weight = nn.Parameter(torch.zeros(out, input_size, dtype=BF16), requires_grad=False)
        self._exact_init(parts, input_size)


_PARALLEL: dict[str, type] = {}


def parallel_linear(kind: str) -> type:
    """Megatron's own ``ColumnParallelLinear`` / ``RowParallelLinear`` holding this rank's
    shard (Megatron allocates and marks it: ``partition_dim``, ``tensor_model_parallel``), with
    the exact-linear parts; built lazily (Megatron is imported only when a model is built)."""
    if kind not in _PARALLEL:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        base = ColumnParallelLinear if kind == "column" else RowParallelLinear

        # Column: the output stays split (the next op reads this rank's rows); row: the
        # input arrives split. Zero init: the weights are loaded right after.
        where = {"gather_output": False} if kind == "column" else {"input_is_parallel": True}

        def __init__(self, input_size, output_size, parts, *, config, **group):
            # group: is_expert / tp_group for an expert's linear (moe.py)
            base.__init__(
                self,
                input_size,
                output_size,
                config=config,
                init_method=nn.init.zeros_,
                bias=False,
                skip_bias_add=True,
                **where,
                **group,
            )
            self._exact_init(parts, input_size)

        methods = {"__init__": __init__, "forward": _Exact.forward}
        _PARALLEL[kind] = type(f"Exact{base.__name__}", (_Exact, base), methods)
    return _PARALLEL[kind]


def tp_size(config) -> int:
    return int(getattr(config, "tensor_model_parallel_size", 1) or 1)


class LoRA(nn.Module):
    """fp32 master weights A [r, K], B [N, r]; the forward sees them rounded to bf16."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, scale: float):
        super().__init__()
        self.A = nn.Parameter(a)
        self.B = nn.Parameter(b)
        self.scale = float(scale)


def _cols(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n)


def fc1_parts(ffn: int) -> dict[str, torch.Tensor]:
    """Megatron's gated fc1: [gate; up] along the output."""
    return {"gate_proj": _cols(0, ffn), "up_proj": _cols(ffn, ffn)}
