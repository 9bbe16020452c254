"""A model directory, parsed once: its config, the lane geometry, its contract and its hash.

``ModelDir(path)`` reads ``config.json`` once (``lanes.config`` refuses, naming the key, what
the lane does not implement) and gives the geometry, the family, the lane contract and the
model hash. The model hash (``model_hash``) covers the weights, ``config.json`` and the
tokenizer files, so a trace made with another tokenizer (same weights) is told apart: the
token ids a trace records mean nothing without the tokenizer that made them.
"""

from __future__ import annotations

import json
import os
from functools import cached_property
from pathlib import Path
from typing import Any

from .hashing import dir_sha256
from .lanes.qwen3 import Geometry, UnsupportedModel

TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
MODEL_PATTERNS: tuple[str, ...] = ("*.safetensors", "config.json", *TOKENIZER_FILES)


def model_hash(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a model directory: weights, ``config.json`` and the tokenizer files
    present (``hashing.dir_sha256`` over ``MODEL_PATTERNS``). Every model hash in Lockstep
    (traces, adapter bindings, replay checks) is this one."""
    return dir_sha256(path, MODEL_PATTERNS)


class ModelDir:
    """An HF model directory the exact lane runs; raises ``UnsupportedModel`` otherwise.

    ``path``, ``config`` (the ``config.json`` dict), ``geometry``, ``family``, ``model_hash``
    and ``contract(backend)``. ``ModelDir(m)`` of a ModelDir ``m`` is ``m`` parsed again;
    ``ModelDir.of(x)`` takes a path or a ModelDir and parses only a path.
    """

    def __init__(self, model_dir: str | os.PathLike[str]):
        self.path = Path(model_dir)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise UnsupportedModel(f"{model_dir} has no config.json: not an HF model directory")
        try:
            self.config: dict[str, Any] = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as err:
            raise UnsupportedModel(f"{cfg_path} is not valid JSON ({err})") from err
        self.geometry = Geometry.from_hf_config(self.config)

    @classmethod
    def of(cls, model: str | os.PathLike[str] | ModelDir) -> ModelDir:
        return model if isinstance(model, ModelDir) else cls(model)

    def __repr__(self) -> str:
        return f"ModelDir({str(self.path)!r}, {self.family})"

    @property
    def family(self) -> str:
        return self.geometry.family

    @cached_property
    def model_hash(self) -> str:
        """See ``model_hash``: computed once per object (the weights are read in full)."""
        return model_hash(self.path)

    def contract(self, backend: str = "cpu"):
        """The lane contract for this model on ``backend``."""
        from .contract import geometry_contract

        return geometry_contract(self.geometry, backend=backend)

    def __fspath__(self) -> str:
        return str(self.path)
