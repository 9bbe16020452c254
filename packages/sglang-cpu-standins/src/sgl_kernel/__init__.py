"""Stand-in for SGLang's CPU kernel package (``sgl_kernel``), for the Lockstep exact lane.

SGLang's CPU engine imports these names at module level when ``SGLANG_USE_CPU_ENGINE=1``; the
CPU build of the package that defines them is not on PyPI. The Lockstep lane serves its own
model, attention, logits and sampler, so none of them is ever needed: each name here raises,
naming itself and the SGLang feature that reached it, which the lane does not support.

The module deliberately defines nothing else: SGLang's AMX probe looks for
``torch.ops.sgl_kernel.convert_weight_packed``, finds nothing, and keeps its own native paths.
Install this only in a CPU environment without the real package (the ``sglang`` extra does);
on a GPU machine ``sgl_kernel`` is SGLang's real CUDA package.
"""

from __future__ import annotations

STANDIN = True

# name -> the SGLang feature whose code path calls it
FEATURES = {
    "copy_all_layer_kv_cache_cpu": "KV page compaction (enable_kv_cache_copy)",
    "assign_req_to_token_pool_cpu": "speculative decoding",
    "assign_extend_cache_locs_cpu": "speculative decoding",
    "assign_draft_cache_locs_contiguous_cpu": "EAGLE speculative decoding",
    "fill_accept_out_cache_loc_cpu": "EAGLE speculative decoding",
    "fill_bonus_tokens_cpu": "EAGLE speculative decoding",
    "build_tree_kernel_efficient_cpu": "EAGLE speculative decoding",
    "verify_tree_greedy_cpu": "EAGLE speculative decoding",
    "rotate_input_ids_cpu": "multi-layer EAGLE speculative decoding",
}


class StandInCalled(RuntimeError):
    """SGLang reached a CPU kernel the stand-in does not implement."""


def _standin(name: str, feature: str):
    def call(*args, **kwargs):
        raise StandInCalled(
            f"sgl_kernel.{name} was called, but this sgl_kernel is the Lockstep exact lane's "
            f"import-time stand-in (SGLang's CPU kernel package is not installed): {feature} "
            "is not supported on the lane"
        )

    call.__name__ = call.__qualname__ = name
    return call


for _name, _feature in FEATURES.items():
    globals()[_name] = _standin(_name, _feature)
del _name, _feature
