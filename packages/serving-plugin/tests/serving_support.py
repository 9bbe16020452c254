"""Helpers for the serving tests: real vLLM, in-process, on tiny models.

The environment is set before vLLM is imported: in-process engine core (no spawn), 1 GiB KV
cache, offline hub, and every cache and temporary file under one directory of this session.
"""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path

from lockstep_serving.vllm.offline import isolate

_ROOT = Path(tempfile.mkdtemp(prefix="lockstep-serving-"))
isolate(_ROOT, override=True, tmp=True)

FAMILIES = {"qwen3": "LockstepQwen3ForCausalLM", "qwen3-moe": "LockstepQwen3MoeForCausalLM"}


def start_engine(model_dir, **overrides):
    from vllm import LLM

    from lockstep_serving.vllm.offline import engine_args

    args = engine_args(model_dir, **overrides)
    args.setdefault("max_model_len", 512)
    args.setdefault("block_size", 32)
    return LLM(**args)


def stop_engine(llm) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def flip_lowest_bit(t):
    """A copy of the float32 tensor ``t`` whose element 0 is one ulp away."""
    out = t.clone()
    out.view(__import__("torch").int32)[0] ^= 1
    return out


def assert_same_bytes_and_control(a, b, what: str) -> None:
    """a and b are byte-identical, and the check would catch a one-ulp change of b."""
    from lockstep_exact.parity import same_bytes
    from lockstep_exact.testing import assert_same_bytes

    assert_same_bytes(a, b, what)
    assert not same_bytes(a, flip_lowest_bit(b)), f"{what}: the check misses a one-ulp change"
