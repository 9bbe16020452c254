"""LoRA adapters in PEFT layout, read and written the same way by both halves.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (bf16
factors, PEFT key names). The safetensors metadata records the lane contract fingerprint it
was made for and the sha256 of every payload byte; ``load_adapter`` checks both and refuses,
with a message naming the problem, a corrupted file, a dtype other than bf16, a factor of the
wrong shape, a module the lane does not cover, or another lane's contract.

Grouped expert adapters (MoE): each routed expert's projections carry rank ``r // topk``
(declared in ``rank_pattern``), so a token's k active experts together add rank r.
Every module's scale is ``lora_alpha / its rank`` (PEFT's convention).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .hashing import sha256_bytes, tensor_bytes
from .lanes.qwen3 import Geometry

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class AdapterError(ValueError):
    """The adapter cannot be applied exactly; nothing falls back."""


@dataclass(frozen=True)
class Adapter:
    path: Path
    rank: int
    alpha: float
    contract: str | None
    sha256: str
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]  # HF weight name -> (A, B, s)


def module_shapes(geom: Geometry) -> dict[str, tuple[int, int]]:
    """HF weight name (without ``.weight``) -> (out_features, in_features) of every target."""
    g = geom
    shapes = {}
    for i in range(g.layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj"] = (g.heads * g.head_dim, g.hidden)
        shapes[p + "self_attn.k_proj"] = (g.kv_heads * g.head_dim, g.hidden)
        shapes[p + "self_attn.v_proj"] = (g.kv_heads * g.head_dim, g.hidden)
        shapes[p + "self_attn.o_proj"] = (g.hidden, g.heads * g.head_dim)
        if g.is_moe:
            for e in range(g.experts):
                q = f"{p}mlp.experts.{e}."
                shapes[q + "gate_proj"] = (g.moe_intermediate, g.hidden)
                shapes[q + "up_proj"] = (g.moe_intermediate, g.hidden)
                shapes[q + "down_proj"] = (g.hidden, g.moe_intermediate)
        else:
            shapes[p + "mlp.gate_proj"] = (g.intermediate, g.hidden)
            shapes[p + "mlp.up_proj"] = (g.intermediate, g.hidden)
            shapes[p + "mlp.down_proj"] = (g.hidden, g.intermediate)
    return shapes


def module_rank(geom: Geometry, module: str, rank: int) -> int:
    """Routed-expert modules get rank r // topk (grouped expert LoRA); others rank r."""
    if ".mlp.experts." in module:
        if rank % geom.topk:
            raise AdapterError(f"rank {rank} is not divisible by top-k {geom.topk} (expert LoRA)")
        return rank // geom.topk
    return rank


def payload_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, raw bytes) of every tensor in sorted name order."""
    parts = []
    for name in sorted(tensors):
        t = tensors[name]
        parts.append(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode() + tensor_bytes(t))
    return sha256_bytes(b"".join(parts))


def write_adapter(
    out_dir,
    tensors: dict[str, torch.Tensor],
    *,
    rank: int,
    alpha: float,
    contract: str,
    geom: Geometry,
    base_model: str = "",
) -> Path:
    """Write a PEFT adapter atomically (temp dir, fsync, rename). Factors must be bf16."""
    out = Path(out_dir)
    for name, t in tensors.items():
        if t.dtype != torch.bfloat16:
            raise AdapterError(f"adapter factor {name} is {t.dtype}; exports are bf16 only")
    targets = sorted({k.split(".")[-3] for k in tensors})
    rank_pattern = {}
    if geom.is_moe and any(".mlp.experts." in k for k in tensors):
        rank_pattern = {
            r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj": rank // geom.topk
        }
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": targets,
        "rank_pattern": rank_pattern,
        "alpha_pattern": {},
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": base_model,
        "lockstep_contract": contract,
    }
    payload = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    meta = {
        "format": "pt",
        "lockstep_contract": contract,
        "lockstep_payload_sha256": payload_sha256(payload),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(payload, str(tmp / WEIGHTS), metadata=meta)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def make_adapter(
    model_dir,
    out_dir,
    *,
    rank: int = 8,
    alpha: float = 16.0,
    seed: int = 0,
    zero_b: bool = False,
    std: float = 0.05,
    contract: str | None = None,
) -> Path:
    """A deterministic adapter on every attention and MLP (or expert) projection.

    ``zero_b`` gives the all-zero update (B = 0, A random): exactly the base model's bytes.
    """
    from .contract import lane_contract

    geom = Geometry.from_model_dir(model_dir)
    contract = contract or lane_contract(model_dir).fingerprint
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (n_out, n_in) in sorted(module_shapes(geom).items()):
        r = module_rank(geom, module, rank)
        a = torch.randn(r, n_in, generator=gen) * std
        b = torch.zeros(n_out, r) if zero_b else torch.randn(n_out, r, generator=gen) * std
        tensors[f"{PREFIX}{module}.lora_A.weight"] = a.to(torch.bfloat16)
        tensors[f"{PREFIX}{module}.lora_B.weight"] = b.to(torch.bfloat16)
    return write_adapter(
        out_dir,
        tensors,
        rank=rank,
        alpha=alpha,
        contract=contract,
        geom=geom,
        base_model=str(model_dir),
    )


def perturb_adapter(adapter_dir, out_dir, key: str, delta: float = 2.0**-9) -> Path:
    """A copy with one factor's first element moved by ``delta`` (the perturbed control)."""
    src = Path(adapter_dir)
    config = json.loads((src / CONFIG).read_text())
    with safe_open(str(src / WEIGHTS), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no iter)
        meta = f.metadata() or {}
    if key not in tensors:
        raise AdapterError(f"adapter has no factor {key}")
    t = tensors[key].float().clone()
    t.view(-1)[0] += delta
    tensors[key] = t.to(torch.bfloat16)
    geom_cfg = Geometry.from_model_dir(config["base_model_name_or_path"])
    return write_adapter(
        out_dir,
        tensors,
        rank=config["r"],
        alpha=config["lora_alpha"],
        contract=meta.get("lockstep_contract", ""),
        geom=geom_cfg,
        base_model=config["base_model_name_or_path"],
    )


def load_adapter(adapter_dir, geom: Geometry, contract: str | None = None) -> Adapter:
    """Read and validate an adapter; ``modules`` maps HF weight names to (A, B, scale)."""
    path = Path(adapter_dir)
    for name in (CONFIG, WEIGHTS):
        if not (path / name).is_file():
            raise AdapterError(f"{path} has no {name}: not a PEFT adapter directory")
    try:
        config = json.loads((path / CONFIG).read_text())
    except json.JSONDecodeError as err:
        raise AdapterError(f"{path / CONFIG} is not valid JSON ({err})") from err
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter type {config.get('peft_type')!r} is not LoRA")
    if config.get("bias", "none") != "none" or config.get("use_dora") or config.get("use_rslora"):
        raise AdapterError("LoRA bias, DoRA and rsLoRA are not part of the exact lane")
    try:
        with safe_open(str(path / WEIGHTS), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except Exception as err:  # safetensors raises several types for damaged files
        raise AdapterError(
            f"{path / WEIGHTS} cannot be read: corrupted or truncated ({err})"
        ) from err
    recorded = meta.get("lockstep_payload_sha256")
    if recorded is None:
        raise AdapterError(
            f"{path / WEIGHTS} has no lockstep_payload_sha256: not a Lockstep export"
        )
    if payload_sha256(tensors) != recorded:
        raise AdapterError(
            f"{path / WEIGHTS} does not match its recorded payload sha256: corrupted"
        )
    made_for = meta.get("lockstep_contract")
    if contract is not None and made_for != contract:
        raise AdapterError(f"adapter was made for contract {made_for}, this lane is {contract}")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    shapes = module_shapes(geom)
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for key, t in tensors.items():
        if t.dtype != torch.bfloat16:
            raise AdapterError(f"adapter factor {key} is {t.dtype}; the exact lane takes bf16 only")
        if not key.startswith(PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
            raise AdapterError(f"adapter tensor {key} is not a PEFT LoRA factor")
    for key in sorted(k for k in tensors if k.endswith(".lora_A.weight")):
        module = key[len(PREFIX) : -len(".lora_A.weight")]
        if module not in shapes:
            raise AdapterError(f"adapter targets {module}, which the exact lane does not cover")
        b_key = f"{PREFIX}{module}.lora_B.weight"
        if b_key not in tensors:
            raise AdapterError(f"adapter has lora_A but no lora_B for {module}")
        a, b = tensors[key], tensors[b_key]
        r = module_rank(geom, module, rank)
        n_out, n_in = shapes[module]
        if a.shape != (r, n_in) or b.shape != (n_out, r):
            raise AdapterError(
                f"{module}: factors {tuple(a.shape)}/{tuple(b.shape)}, expected "
                f"({r}, {n_in})/({n_out}, {r})"
            )
        modules[module + ".weight"] = (a, b, alpha / r)
    # Hash the content, not the file: safetensors writes its metadata in no fixed order.
    identity = json.dumps(config, sort_keys=True) + "\0" + recorded + "\0" + str(made_for)
    return Adapter(
        path=path,
        rank=rank,
        alpha=alpha,
        contract=made_for,
        sha256=sha256_bytes(identity.encode()),
        modules=modules,
    )
