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

from safetensors import safe_open

from .contract import Contract
from .hashing import dir_sha256
from .lanes import qwen3, qwen3_next
from .lanes.config import HYBRID_FAMILIES
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


# The files that define which text a token id stands for (not its padding side or length cap).
VOCABULARY_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def tokenizer_hash(path: str | os.PathLike[str]) -> str | None:
    """sha256 of a model directory's vocabulary files (``VOCABULARY_FILES``), or None when it
    has none: two models whose token ids mean the same text hash the same."""
    root = Path(path)
    if not any((root / f).is_file() for f in VOCABULARY_FILES):
        return None
    return dir_sha256(root, VOCABULARY_FILES)


def _check_tokenizer_ids(path: Path, config: dict[str, Any]) -> None:
    """Refuse a ``tokenizer.json`` whose token ids reach past the model's ``vocab_size``: the
    engines would index the embedding out of bounds on the first such prompt token."""
    tok_path = path / "tokenizer.json"
    vocab_size = config.get("vocab_size")
    if not tok_path.is_file() or not isinstance(vocab_size, int):
        return
    try:
        tok = json.loads(tok_path.read_text())
    except json.JSONDecodeError as err:
        raise UnsupportedModel(f"{tok_path} is not valid JSON ({err})") from err
    vocab = (tok.get("model") or {}).get("vocab")
    ids = list(vocab.values()) if isinstance(vocab, dict) else []
    ids += [t["id"] for t in tok.get("added_tokens") or () if isinstance(t.get("id"), int)]
    ids = [i for i in ids if isinstance(i, int)]
    if ids and max(ids) >= vocab_size:
        raise UnsupportedModel(
            f"{tok_path} has token id {max(ids)} but config.json vocab_size is {vocab_size}: "
            "the tokenizer belongs to another model; use the tokenizer the model was made with"
        )


def _check_weight_files(path: Path) -> None:
    """Refuse a ``*.safetensors`` file that cannot be read (truncated, damaged header) or that
    holds floating-point tensors other than bf16; only the headers are read."""
    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                dtypes = {k: st.get_slice(k).get_dtype() for k in st.keys()}  # noqa: SIM118
        except Exception as err:  # safetensors raises several types for damaged files
            raise UnsupportedModel(
                f"{f} cannot be read: corrupted or truncated ({err}); copy the weights again"
            ) from err
        bad = sorted(k for k, d in dtypes.items() if d.startswith("F"))  # BF16 passes
        if bad:
            raise UnsupportedModel(
                f"{f}: {bad[0]} is {dtypes[bad[0]]} ({len(bad)} tensor(s) not bf16); the exact "
                "lane runs bf16 weights: save the model with torch_dtype=bfloat16"
            )


HYBRID_NOT_SERVED = (
    "architecture 'Qwen3NextForCausalLM': its exact lane (qwen3-next, the composition "
    "lockstep_exact.lanes.qwen3_next) is served by the vLLM plugin (lockstep_serving.vllm.next) "
    "and scored and trained by the Megatron plugin (lockstep_megatron.gdn): lockstep capture, "
    "replay, qualify and train take it; this command and the SGLang plugin do not take it yet: "
    "use a Qwen3 or Qwen3-MoE model here, or capture with the vLLM engine (--engine vllm)"
)


def geometry_of(config: dict[str, Any]):
    """The lane geometry of an HF config: ``lanes.qwen3_next.Geometry`` for Qwen3-Next, the
    Qwen3 / Qwen3-MoE ``Geometry`` otherwise (each refuses, naming the key, what it lacks)."""
    archs = config.get("architectures")
    if isinstance(archs, list) and len(archs) == 1 and archs[0] in HYBRID_FAMILIES:
        return qwen3_next.Geometry.from_hf_config(config)
    return Geometry.from_hf_config(config)


def geometry_contract(
    geom, *, backend: str = "cpu", tp: int = 1, ep: int = 1, machine=None
) -> Contract:
    """The contract of the Qwen3-family exact lane for a ``lanes.qwen3.Geometry`` (or the
    qwen3-next lane for a ``lanes.qwen3_next.Geometry``); ``machine``: recorded environment
    pins in place of this machine's (``contract.environment_pins``)."""
    lane = qwen3_next if geom.family == "qwen3-next" else qwen3
    return lane.geometry_contract(geom, backend=backend, tp=tp, ep=ep, machine=machine)


def lane_contract(model_dir, *, backend: str = "cpu", tp: int = 1, ep: int = 1) -> Contract:
    """The contract of the Qwen3-family exact lane for an HF model directory."""
    return geometry_contract(
        qwen3.Geometry.from_model_dir(model_dir), backend=backend, tp=tp, ep=ep
    )


class ModelDir:
    """An HF model directory the exact lane runs; raises ``UnsupportedModel`` otherwise.

    ``path``, ``config`` (the ``config.json`` dict), ``geometry``, ``family``, ``model_hash``
    and ``contract(backend)``. ``ModelDir(m)`` of a ModelDir ``m`` is ``m`` parsed again;
    ``ModelDir.of(x)`` takes a path or a ModelDir and parses only a path.
    """

    def __init__(self, model_dir: str | os.PathLike[str], *, hybrid: bool = False):
        """``hybrid``: also admit a Qwen3-Next model (the vLLM plugin serves its lane; the
        other engines' plugins leave it False and refuse such a model by name)."""
        self.path = Path(model_dir)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise UnsupportedModel(f"{model_dir} has no config.json: not an HF model directory")
        try:
            self.config: dict[str, Any] = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as err:
            raise UnsupportedModel(f"{cfg_path} is not valid JSON ({err})") from err
        self.geometry = geometry_of(self.config)
        if self.geometry.family == "qwen3-next" and not hybrid:
            raise UnsupportedModel(HYBRID_NOT_SERVED)
        _check_tokenizer_ids(self.path, self.config)
        _check_weight_files(self.path)

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
        return geometry_contract(self.geometry, backend=backend)

    def __fspath__(self) -> str:
        return str(self.path)
