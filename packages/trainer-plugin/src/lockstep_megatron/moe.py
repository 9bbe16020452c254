"""The exact lane's MoE layers as Megatron's own ``MoELayer``: its router class, token
dispatcher and experts container, with the lane's programs in their slots.

Megatron builds each MoE layer (``MoELayer`` with a ``TopKRouter`` and a ``SequentialMLP`` of
``MLP`` experts) and owns its parameters under Megatron's names and expert sharding: under
expert parallelism (``ep``) each rank holds the contiguous block ``local_expert_indices`` of
experts, under tensor parallelism each expert's fc1 / fc2 are Megatron's column- / row-parallel
linears over the expert tensor-parallel group (the tp group: Megatron's default). Nothing here
restates the op order: the layer's forward is the lane composition (``spec.ExactLayer``), which
reads the router weight for router.softmax_topk, runs each expert's gemm / swiglu / LoRA sites
through the slots, and calls ``ExactMoELayer.lane_dispatch`` for the rows routed to each expert.
That dispatch runs this rank's experts and takes each (row, slot) from the rank owning its
expert (``layout.select_owners``: an all-gather over Megatron's expert-parallel group and a
select, never a sum), so moe.fold then adds a token's slots in global expert order whatever
``ep`` is. Every rank holds the whole batch (replay gives every rank the same sequences), so
Megatron's token dispatcher is built but has nothing to move.
"""

from __future__ import annotations

from lockstep_exact import programs as P
from lockstep_exact.lanes.qwen3 import local_dispatch

from .spec import _cols, fc1_parts, parallel_linear


def expert_tp_size(config) -> int:
    """The expert tensor-parallel size (Megatron's default: the tensor-parallel size)."""
    etp = getattr(config, "expert_tensor_parallel_size", None)
    return int(etp or getattr(config, "tensor_model_parallel_size", 1) or 1)


class ExpertFC1:
    """An expert's linear_fc1 ([gate; up] rows of this expert-tp rank): Megatron's
    ColumnParallelLinear over the expert tensor-parallel group."""

    def __new__(cls, input_size, output_size, *, config, tp_group=None, **_):
        ffn = output_size // 2
        parts = fc1_parts(ffn // expert_tp_size(config))
        return parallel_linear("column")(
            input_size, output_size, parts, config=config, is_expert=True, tp_group=tp_group
        )


class ExpertFC2:
    """An expert's linear_fc2 (down_proj, this expert-tp rank's share of K): Megatron's
    RowParallelLinear over the expert tensor-parallel group."""

    def __new__(cls, input_size, output_size, *, config, tp_group=None, **_):
        parts = {"down_proj": _cols(0, output_size)}
        return parallel_linear("row")(
            input_size, output_size, parts, config=config, is_expert=True, tp_group=tp_group
        )


def expert_linear(expert, part: str):
    """The Megatron linear of an expert ``MLP`` holding ``part`` (gate/up: fc1, down: fc2)."""
    return expert.linear_fc2 if part == "down_proj" else expert.linear_fc1


_CLASSES: dict[str, type] = {}


def classes() -> dict[str, type]:
    """Megatron's MoE classes with the lane's forward (built once, Megatron imported lazily):
    ``router`` (a TopKRouter: its weight is the lane's router gemm's), ``experts`` (a
    SequentialMLP of Megatron MLPs) and ``layer`` (the MoELayer)."""
    if _CLASSES:
        return _CLASSES
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    def _composition_only(self, *args, **kwargs):
        raise RuntimeError(
            f"{type(self).__name__} runs inside the lane composition (ExactLayer), not alone"
        )

    class ExactRouter(TopKRouter):
        """Megatron's TopKRouter holding the router weight [experts, hidden]; the lane's
        gemm + router.softmax_topk run in the composition."""

        forward = _composition_only

    class ExactExperts(SequentialMLP):
        """Megatron's SequentialMLP: this rank's experts (``local_experts``, Megatron MLPs
        whose fc1 / fc2 are the exact parallel linears)."""

        forward = _composition_only

    class ExactMoELayer(MoELayer):
        """Megatron's MoELayer (router, token dispatcher, experts); the composition calls
        ``lane_dispatch`` and folds the result with moe.fold."""

        forward = _composition_only

        def local_index(self, expert: int) -> int:
            """This rank's index of global expert ``expert`` (refused if another rank owns it)."""
            first = self.local_expert_indices[0]
            if not first <= expert < first + self.num_local_experts:
                last = first + self.num_local_experts - 1
                raise RuntimeError(
                    f"expert {expert} is not on this rank (it holds {first}..{last})"
                )
            return expert - first

        def ep_gather(self) -> P.Gather:
            from megatron.core import utils

            size = utils.get_pg_size(self.ep_group)
            if size == 1:
                return P.LOCAL
            from lockstep_exact.layout import DistGather

            return DistGather(self.ep_group, size)

        def lane_dispatch(self, h, ids, expert):
            """[T, k, H] in slot order: this rank's experts on the rows routed to them, every
            other (row, slot) taken from the rank that owns its expert."""
            from lockstep_exact.layout import select_owners

            owned = self.local_expert_indices
            out = local_dispatch(h, ids, expert, owned=owned)
            return select_owners(out, ids, self.ep_gather(), self.num_local_experts)

    _CLASSES.update(router=ExactRouter, experts=ExactExperts, layer=ExactMoELayer)
    return _CLASSES


def moe_spec():
    """The MoE layer's ModuleSpec: Megatron's MoELayer / TopKRouter / SequentialMLP / MLP with
    the exact linears in the experts' fc1 / fc2 slots."""
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.moe_layer import MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    c = classes()
    experts = ModuleSpec(
        module=c["experts"],
        submodules=MLPSubmodules(linear_fc1=ExpertFC1, linear_fc2=ExpertFC2),
    )
    return ModuleSpec(
        module=c["layer"], submodules=MoESubmodules(experts=experts, router=c["router"])
    )


def moe_config(geom, ep: int) -> dict:
    """TransformerConfig fields of a MoE geometry: Megatron's own names for the lane's
    experts, top-k and expert width; no load-balancing loss (the lane's router has none)."""
    if not geom.is_moe:
        return {}
    return dict(
        num_moe_experts=geom.experts,
        moe_router_topk=geom.topk,
        moe_ffn_hidden_size=geom.moe_intermediate,
        moe_token_dispatcher_type="allgather",  # builds no CUDA streams
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        expert_model_parallel_size=ep,
    )


__all__ = [
    "ExpertFC1",
    "ExpertFC2",
    "classes",
    "expert_linear",
    "expert_tp_size",
    "moe_config",
    "moe_spec",
]
