"""What the Megatron half of the hybrid lane (qwen3-next) refuses, by name, before it reads
anything else: training (the trainer session: the ladder's training gate and ``lockstep
train``) and replay on another backend than cpu or cuda (cuda: one GPU; vLLM 0.26's cuda
capture replayed byte-equal by ``tests/test_next_gpu.py``, GRPO and the qualify ladder exact
by ``tests/test_train_gpu.py`` and ``tests/test_qualify_gpu.py``); other layouts."""

from __future__ import annotations

import json
from pathlib import Path

from lockstep_exact.lanes import qwen3_next as N
from lockstep_exact.lanes.config import HYBRID_FAMILIES
from lockstep_exact.model import geometry_contract

BACKENDS = ("cpu", "cuda")
BACKEND_REFUSED = (
    "the hybrid lane (qwen3-next) runs in Megatron on cpu or cuda (one GPU), not {!r}: run it "
    "with --backend cpu or --backend cuda"
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
    other than cpu or cuda (``HybridRefused``)."""
    if is_hybrid(model_dir) and backend not in BACKENDS:
        raise HybridRefused(f"training: {BACKEND_REFUSED.format(backend)}")


def check_replay(model_dir, adapter_dir, backend: str, tp: int, ep: int) -> None:
    """What replay of a hybrid model refuses before reading anything else: a backend other
    than cpu or cuda, a layout other than tp 1 ep 1 (the contract's ``LayoutRefused``). An
    adapter is checked by replay's admission (``export.read_adapter``)."""
    if not is_hybrid(model_dir):
        return
    if backend not in BACKENDS:
        raise HybridRefused(
            f"the hybrid lane (qwen3-next) replays in Megatron on cpu or cuda, not {backend!r}"
        )
    geom = N.Geometry.from_model_dir(model_dir)
    geometry_contract(geom, backend=backend, tp=tp, ep=ep)  # refuses tp / ep > 1, naming both
