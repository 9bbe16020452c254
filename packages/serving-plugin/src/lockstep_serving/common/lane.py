"""The lane model's side that vLLM's and SGLang's model classes share: the family each lane
class serves, the contract fingerprint the engine was asked for, the checkpoint's tensors.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from lockstep_exact.contract import ContractMismatch, admit
from lockstep_exact.lanes import qwen3, qwen3_next
from lockstep_exact.model import geometry_contract, geometry_of

from .errors import _refuse

CONTRACT_ENV = "LOCKSTEP_CONTRACT"
CONTRACT_OVERRIDE = "lockstep_contract"  # hf_overrides key carrying the requested fingerprint


# The lane's model classes (one name in vLLM and in SGLang) and the family each serves.
FAMILY_OF = {
    "LockstepQwen3ForCausalLM": "qwen3",
    "LockstepQwen3MoeForCausalLM": "qwen3-moe",
    "LockstepQwen3NextForCausalLM": "qwen3-next",  # vllm/next.py (vLLM only)
}


def lane_geometry(arch: str, model_dir: Path) -> qwen3.Geometry:
    """The lane geometry of ``model_dir`` served as the lane class ``arch``; refuses, by name,
    a model the lane cannot run and one of another family than ``arch`` serves."""
    want = FAMILY_OF[arch]
    try:
        if want == "qwen3-next":
            geom = qwen3_next.Geometry.from_model_dir(model_dir)
        else:
            geom = qwen3.Geometry.from_model_dir(model_dir)
    except qwen3.UnsupportedModel as err:
        _refuse(str(err))
    if geom.family != want:
        _refuse(f"{arch} serves the {want} family but {model_dir} is {geom.family}")
    return geom


def admit_requested(model_dir: Path, backend: str, requested: str | None) -> None:
    """The contract fingerprint the engine was asked for (its config override, else
    LOCKSTEP_CONTRACT), admitted against this model's lane contract; nothing asked, nothing
    checked."""
    requested = requested or os.environ.get(CONTRACT_ENV)
    if requested:
        try:
            admit(model_contract(model_dir, backend), requested)
        except ContractMismatch as err:
            _refuse(str(err))


def model_contract(model_dir: Path, backend: str):
    """The lane contract of ``model_dir``, of its family's lane (``lane_contract`` for Qwen3
    and Qwen3-MoE, the qwen3-next lane's for Qwen3-Next)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return geometry_contract(geometry_of(config), backend=backend)


def lane_weights(weights: Iterable[tuple[str, torch.Tensor]], expected: set[str], skip=()):
    """The checkpoint's (name, tensor) pairs, each refused by name unless it is one of
    ``expected`` and bf16 (names starting with a ``skip`` prefix are passed over); once all
    are read, a checkpoint lacking an expected tensor is refused, naming the first."""
    seen: set[str] = set()
    for name, t in weights:
        if skip and name.startswith(tuple(skip)):
            continue
        if name not in expected:
            _refuse(f"unexpected tensor {name!r} in the checkpoint (not part of the lane)")
        if t.dtype != torch.bfloat16:
            _refuse(f"tensor {name!r} is {t.dtype}; the exact lane loads bf16 weights only")
        seen.add(name)
        yield name, t
    missing = sorted(expected - seen)
    if missing:
        _refuse(f"checkpoint lacks {len(missing)} tensor(s), first {missing[0]!r}")


def _expected_names(geom: qwen3.Geometry) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not geom.tie_embeddings:
        names.add("lm_head.weight")
    per = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
    ]
    if geom.is_moe:
        per.append("mlp.gate.weight")
        for e in range(geom.experts):
            per += [f"mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up", "down")]
    else:
        per += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    for i in range(geom.layers):
        names.update(f"model.layers.{i}.{p}" for p in per)
    return names
