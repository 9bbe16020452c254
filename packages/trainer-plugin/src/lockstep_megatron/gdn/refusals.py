"""What the Megatron half of the hybrid lane (qwen3-next) refuses, by name, before it reads
anything else: training (the trainer session: the ladder's training gate and ``lockstep
train``) on another backend than cpu; replay on another backend than cpu or cuda (cuda: one
GPU, shown byte-equal to vLLM 0.26's cuda capture by ``tests/test_next_gpu.py``); other
layouts."""

from __future__ import annotations

import json
from pathlib import Path

from lockstep_exact.lanes import qwen3_next as N
from lockstep_exact.lanes.config import HYBRID_FAMILIES
from lockstep_exact.model import geometry_contract

BACKEND_REFUSED = (
    "the hybrid lane (qwen3-next) runs in Megatron on cpu only so far, not {!r}: run it with "
    "--backend cpu"
)


class HybridRefused(NotImplementedError):
    """What the Megatron half of the hybrid lane does not do yet (named in the message)."""


def is_hybrid(model_dir: str | Path) -> bool:
    """True when ``model_dir``'s config.json names a hybrid (Qwen3-Next) architecture."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return False
    try:
        archs = json.loads(path.read_text()).get("architectures")
    except (json.JSONDecodeError, AttributeError):
        return False
    return isinstance(archs, list) and any(a in HYBRID_FAMILIES for a in archs)


def refuse_training(model_dir: str | Path, backend: str) -> None:
    """What a training job on a hybrid model refuses before reading anything else: a backend
    other than cpu (``HybridRefused``)."""
    if is_hybrid(model_dir) and backend != "cpu":
        raise HybridRefused(f"training: {BACKEND_REFUSED.format(backend)}")


REPLAY_BACKENDS = ("cpu", "cuda")


def check_replay(model_dir, adapter_dir, backend: str, tp: int, ep: int) -> None:
    """What replay of a hybrid model refuses before reading anything else: a backend other
    than cpu or cuda, a layout other than tp 1 ep 1 (the contract's ``LayoutRefused``). An
    adapter is checked by replay's admission (``export.read_adapter``)."""
    if not is_hybrid(model_dir):
        return
    if backend not in REPLAY_BACKENDS:
        raise HybridRefused(
            f"the hybrid lane (qwen3-next) replays in Megatron on cpu or cuda, not {backend!r}"
        )
    geom = N.Geometry.from_model_dir(model_dir)
    geometry_contract(geom, backend=backend, tp=tp, ep=ep)  # refuses tp / ep > 1, naming both
