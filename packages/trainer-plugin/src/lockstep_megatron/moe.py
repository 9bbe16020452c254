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
At ep 1 that dispatch runs the experts in place (``local_dispatch``). At ep > 1 the expert-
parallel ranks hold different tokens (replay gives each its own share of the sequences) and
the rows move through Megatron's own token dispatcher (``LaneAllGatherDispatcher``, a
``MoEAllGatherTokenDispatcher``): its dispatch all-gathers every rank's rows, routing map and
probabilities over the expert-parallel group and permutes out the rows of this rank's experts;
the experts run on the rows this rank received (the lane's gemm programs are row-independent:
a row's bytes do not depend on which rows share the call); its combine sends each row back to
the rank that holds its token. The combine is the lane's where Megatron's would sum: each row
lands at its (token, slot) of a [T, k, H] tensor instead of being added to its token's other
slots, so moe.fold then adds a token's slots in global expert order, as at ep 1.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from lockstep_exact.lanes.qwen3 import local_dispatch

from .linear import _cols, fc1_parts, parallel_linear


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

# Rows this process's experts received of tokens another expert-parallel rank held (the
# dispatcher moved them); replay's ranks report it (``parallel.replay_tp``).
_MOVED = {"rows": 0}


def rows_received() -> int:
    """Rows of other ranks' tokens that this process's experts ran on since it started."""
    return _MOVED["rows"]


def _dispatcher_class() -> type:
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    class LaneAllGatherDispatcher(MoEAllGatherTokenDispatcher):
        """Megatron's all-gather token dispatcher over the expert-parallel group, with the
        lane's combine.

        Exchange: Megatron's ``token_dispatch`` (all-gather of rows, routing map and probs)
        and ``token_combine`` (reduce-scatter back to the token's rank). Two changes. Its
        tensor-parallel peers are left out of the exchange: Megatron's dispatcher treats the
        tp ranks' tokens as sequence-parallel shards, and the lane runs without sequence
        parallelism, so tp peers hold the same rows and each exchanges over the ep group
        alone (peers then receive the same rows in the same order, which the experts'
        row-parallel gemm.kpart needs). And ``combine_preprocess`` places each expert row at
        its (token, slot) of a [G, k, H] tensor whose other entries are -0.0, instead of
        Megatron's unpermute, which adds a token's slots together: the reduce-scatter then
        adds, per element, one row's value to -0.0 from every other rank, and x + (-0.0) is
        x for every x (IEEE), so what comes back is a select and moe.fold does the only sum.
        The probs the lane dispatches are each (token, expert)'s slot number, which is how
        the combine knows the slot of a row."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.tp_ep_group, self.tp_size, self.tp_rank = self.ep_group, 1, 0

        def combine_preprocess(self, hidden_states):
            tokens = self.reversed_local_input_permutation_mapping  # each row's token
            slots = self.local_probs.to(torch.long)  # each row's slot (the dispatched probs)
            g = self.hidden_shape_before_permute[0]
            out = hidden_states.new_full((g, self.router_topk, hidden_states.shape[-1]), -0.0)
            return out.index_put((tokens, slots), hidden_states)

        def combine_postprocess(self, hidden_states):
            return hidden_states  # [T, k, H]: moe.fold adds the slots

    return LaneAllGatherDispatcher


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

        def __init__(self, config, *args, **kwargs):
            kind = config.moe_token_dispatcher_type
            if kind != "allgather":  # alltoall's __init__ makes a torch.cuda.Stream
                raise NotImplementedError(
                    "the exact lane's MoE layer moves tokens with Megatron's allgather token "
                    f"dispatcher, not {kind!r}"
                )
            super().__init__(config, *args, **kwargs)
            old = self.token_dispatcher
            groups = SimpleNamespace(ep=old.ep_group, expt_tp=old.tp_group, tp_ep=old.tp_ep_group)
            self.token_dispatcher = dispatcher(
                self.num_local_experts,
                self.local_expert_indices,
                config=self.config,
                pg_collection=groups,
            )

        def local_index(self, expert: int) -> int:
            """This rank's index of global expert ``expert`` (refused if another rank owns it)."""
            first = self.local_expert_indices[0]
            if not first <= expert < first + self.num_local_experts:
                last = first + self.num_local_experts - 1
                raise RuntimeError(
                    f"expert {expert} is not on this rank (it holds {first}..{last})"
                )
            return expert - first

        def lane_dispatch(self, h, ids, expert):
            """[T, k, H] in slot order: every (row, slot) run by the expert it was routed to.
            At ep 1 in place; at ep > 1 through the token dispatcher (rows of every ep rank
            to this rank's experts and back)."""
            d = self.token_dispatcher
            if d.ep_size == 1:
                return local_dispatch(h, ids, expert)
            t, k = ids.shape
            # The all-gather takes as many rows from every rank: pad to the group's most with
            # rows routed to no expert (they are not dispatched).
            n = torch.tensor([t], dtype=torch.long)
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=d.ep_group)
            n = int(n)
            dev, experts = h.device, self.config.num_moe_experts
            rows = torch.arange(t, device=dev).unsqueeze(1).expand(t, k)
            routing = torch.zeros(n, experts, dtype=torch.bool, device=dev)
            routing[rows, ids] = True
            slot_of = torch.zeros(n, experts, dtype=torch.float32, device=dev)
            slot_of[rows, ids] = torch.arange(k, dtype=torch.float32, device=dev).expand(t, k)
            x = torch.cat([h, h.new_zeros(n - t, h.shape[1])]) if n > t else h
            x, p = d.dispatch_preprocess(x, routing, slot_of)
            x, p = d.token_dispatch(x, p)
            x, per_expert, _ = d.dispatch_postprocess(x, p)
            mine = d.ep_group.rank()
            _MOVED["rows"] += int((d.reversed_local_input_permutation_mapping // n != mine).sum())
            outs, start = [], 0
            for e, c in zip(self.local_expert_indices, per_expert.tolist(), strict=True):
                if c:
                    outs.append(expert(e, x[start : start + c]))
                start += c
            y = torch.cat(outs) if outs else x.new_zeros(0, h.shape[1])
            y = d.combine_postprocess(d.token_combine(d.combine_preprocess(y)))
            return y[:t]

    dispatcher = _dispatcher_class()
    _CLASSES.update(
        router=ExactRouter, experts=ExactExperts, layer=ExactMoELayer, dispatcher=dispatcher
    )
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
    "rows_received",
]
