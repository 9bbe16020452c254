"""LoRA adapters in PEFT layout, read and written the same way by both halves.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` (bf16
factors, PEFT key names). ``load_adapter`` reads adapters made by the ``peft`` library
(``save_pretrained``) as well as Lockstep's own exports, and refuses, with a message naming the
problem: a dtype other than bf16, a corrupted or edited file, a lora_A without its lora_B (or
the reverse), a factor whose shape or rank does not match the model and the config, a module
the lane does not cover, a PEFT feature the lane does not implement (DoRA, rsLoRA, biases,
``modules_to_save``, ``layers_to_transform``, ...), another lane's contract, another base model.

The adapter hash (``Adapter.sha256``, what traces record) is computed on load over the tensors
and the config fields that change numbers (``r``, ``lora_alpha``, the targets,
``rank_pattern``, ``alpha_pattern``): the same factors under another alpha are another adapter.

Lockstep's exports also record, in the safetensors metadata, that hash, the lane contract they
were made for and the hash of the base model (``model.model_hash``); loading checks all three,
so an ``alpha`` edited in ``adapter_config.json`` alone, or the adapter applied to another base
model of the same shapes, is refused. An adapter made by ``peft`` carries no such record: its
base model cannot be checked, so its hash is recorded in the trace beside the model hash, and
the pair says which weights ran.

Ranks: a module's rank is its factors' (A's rows), checked against the config (``r``, or the
``rank_pattern`` entry PEFT would pick for that module); its scale is ``alpha / rank`` with
alpha from ``alpha_pattern`` or ``lora_alpha`` (PEFT's convention). Lockstep's grouped expert
adapters give each routed expert rank ``r // topk``, declared in ``rank_pattern``.

MoE experts: with transformers 5 a Qwen3-MoE layer keeps its experts as two fused 3-D
parameters (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]); PEFT adapts them through
``target_parameters`` (it turns ``gate_proj``/``up_proj``/``down_proj`` in ``target_modules``
into that), saving one factor pair per parameter under ``mlp.experts`` (nested wrappers add
``.base_layer``): A [r*E, in] holds expert e's rows at ``e*r:(e+1)*r``, B [out, r*E] holds its
columns at ``e, e+E, ...`` (PEFT's ``ParamWrapper``). The loader splits these into one adapter
per expert and projection; the fused gate/up pair shares its A, with B's first I rows on gate.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .atomic import write_dir
from .hashing import sha256_bytes, tensor_bytes
from .lanes.qwen3 import Geometry
from .lanes.qwen3_next import Geometry as NextGeometry
from .model import ModelDir
from .safetensors_io import write_safetensors

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
HASH_KEY = "lockstep_adapter_sha256"
OLD_HASH_KEY = "lockstep_payload_sha256"
MODEL_KEY = "lockstep_model_hash"
CONTRACT_KEY = "lockstep_contract"

# adapter_config.json fields that change the adapter's numbers: hashed with the tensors.
NUMERIC_FIELDS = (
    "r",
    "lora_alpha",
    "target_modules",
    "target_parameters",
    "rank_pattern",
    "alpha_pattern",
)
# Fields that never change a number at inference (bookkeeping, training-only, init-only: the
# factors are what they are). Every other field must be unset (null, false, empty), or is
# one of the checked ones below; a PEFT feature the lane lacks is refused by name.
NO_NUMERICS_FIELDS = frozenset(
    {
        "peft_type",
        "task_type",
        "base_model_name_or_path",
        "revision",
        "peft_version",
        "auto_mapping",
        "inference_mode",
        "lora_dropout",
        "exclude_modules",
        "layers_pattern",
        "megatron_core",
        "qalora_group_size",
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "ensure_weight_tying",
        CONTRACT_KEY,
    }
)
# init_lora_weights values that leave the base model's weights as they are.
PLAIN_INITS = (True, False, "gaussian")
FEATURES = {
    "use_dora": "DoRA",
    "use_rslora": "rsLoRA (scale alpha / sqrt(r))",
    "lora_bias": "a bias on lora_B",
    "modules_to_save": "fully trained copies of modules (modules_to_save)",
    "layers_to_transform": "a subset of layers (layers_to_transform)",
    "layer_replication": "layer replication",
    "trainable_token_indices": "trainable token embeddings",
    "fan_in_fan_out": "transposed (fan_in_fan_out) weights",
}
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts(?:\.base_layer)*")


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
    alphas: dict[str, float] = field(default_factory=dict)  # HF weight name -> its alpha
    base_model_hash: str | None = None  # recorded by Lockstep exports; None for foreign ones

    @property
    def foreign(self) -> bool:
        """Made elsewhere (e.g. by ``peft``): no base model binding to check."""
        return self.base_model_hash is None


def module_shapes(geom: Geometry) -> dict[str, tuple[int, int]]:
    """HF weight name (without ``.weight``) -> (out_features, in_features) of every target."""
    g = geom
    if g.family == "qwen3-next":
        return _next_shapes(g)
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


def _next_shapes(g) -> dict[str, tuple[int, int]]:
    """The qwen3-next lane's targets (``lanes.qwen3_next.ADAPTED``): per Gated DeltaNet layer
    in_proj_qkvz, in_proj_ba and out_proj, per attention layer q_proj (query and output gate
    rows), k_proj, v_proj and o_proj; in every layer each routed expert's and the shared
    expert's gate/up/down. Conv1d, the norms, the router and the shared expert's gate are
    not adapted."""
    shapes = {}
    for i, kind in enumerate(g.layer_types):
        p = f"model.layers.{i}."
        if kind == "linear_attention":
            shapes[p + "linear_attn.in_proj_qkvz"] = (2 * g.key_dim + 2 * g.value_dim, g.hidden)
            shapes[p + "linear_attn.in_proj_ba"] = (2 * g.linear_value_heads, g.hidden)
            shapes[p + "linear_attn.out_proj"] = (g.hidden, g.value_dim)
        else:
            shapes[p + "self_attn.q_proj"] = (2 * g.heads * g.head_dim, g.hidden)
            shapes[p + "self_attn.k_proj"] = (g.kv_heads * g.head_dim, g.hidden)
            shapes[p + "self_attn.v_proj"] = (g.kv_heads * g.head_dim, g.hidden)
            shapes[p + "self_attn.o_proj"] = (g.hidden, g.heads * g.head_dim)
        mlps = [(f"{p}mlp.experts.{e}.", g.moe_intermediate) for e in range(g.experts)]
        mlps.append((f"{p}mlp.shared_expert.", g.shared_intermediate))
        for q, inner in mlps:
            shapes[q + "gate_proj"] = (inner, g.hidden)
            shapes[q + "up_proj"] = (inner, g.hidden)
            shapes[q + "down_proj"] = (g.hidden, inner)
    return shapes


def module_rank(geom: Geometry, module: str, rank: int) -> int:
    """Lockstep's grouped expert LoRA: routed experts get rank r // topk; others rank r."""
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


def numeric_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config fields that change numbers, normalized (target lists sorted)."""
    out = {}
    for key in NUMERIC_FIELDS:
        value = config.get(key)
        if isinstance(value, list):
            value = sorted(value)
        if key in ("rank_pattern", "alpha_pattern"):
            value = dict(value or {})
        if key == "lora_alpha" and value is not None:
            value = float(value)
        out[key] = value
    return out


def adapter_sha256(tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> str:
    """The adapter hash: the numeric config fields and every tensor (``payload_sha256``)."""
    cfg = json.dumps(numeric_config(config), sort_keys=True, separators=(",", ":"))
    return sha256_bytes(
        b"lockstep.adapter.v2\0" + cfg.encode() + b"\0" + payload_sha256(tensors).encode()
    )


def adapter_record(adapter_dir) -> dict[str, str | None]:
    """What an adapter directory says about itself, checked against no model: ``sha256``, its
    hash computed as ``load_adapter`` computes it (what traces record), and what a Lockstep
    export recorded: ``recorded_sha256``, ``contract`` (the lane fingerprint it was made for)
    and ``model_hash`` (its base model's), each None where absent (a peft-made adapter).
    ``lockstep contract show --adapter`` prints it; ``AdapterError`` if the files cannot be read.
    """
    config, tensors, meta = _read(Path(adapter_dir))
    return {
        "sha256": adapter_sha256(tensors, config),
        "recorded_sha256": meta.get(HASH_KEY),
        "contract": meta.get(CONTRACT_KEY),
        "model_hash": meta.get(MODEL_KEY),
    }


def show_command(adapter_dir, model_dir=None) -> str:
    """The command that prints an adapter's hashes beside a model's (named by refusals)."""
    return f"`lockstep contract show --model {model_dir or 'MODEL'} --adapter {adapter_dir}`"


def _pattern_value(patterns: dict[str, Any], key: str, default):
    """PEFT's rule: the first pattern ``p`` with ``(.*\\.)?(p)$`` matching ``key`` wins."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _write_dir(out: Path, payload: dict, config: dict, meta: dict) -> Path:
    """Write the two files atomically (atomic.write_dir: temp dir, fsync, rename)."""

    def fill(tmp: Path) -> None:
        write_safetensors(tmp / WEIGHTS, payload, meta)
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    return write_dir(out, fill=fill, overwrite=True)


def write_adapter(
    out_dir,
    tensors: dict[str, torch.Tensor],
    *,
    rank: int,
    alpha: float,
    contract: str,
    geom: Geometry,
    base_model: str = "",
    model_hash: str | None = None,
    alphas: dict[str, float] | None = None,
) -> Path:
    """Write a PEFT adapter atomically. Factors must be bf16 (2-D, PEFT names).

    Modules whose rank is not ``rank`` get a ``rank_pattern`` entry (grouped experts one
    pattern for all), modules whose alpha (``alphas``, by module name) is not ``alpha`` an
    ``alpha_pattern`` entry. The metadata records the adapter hash, the contract and, given
    ``model_hash``, the base model it is bound to.
    """
    for name, t in tensors.items():
        if t.dtype != torch.bfloat16:
            raise AdapterError(f"adapter factor {name} is {t.dtype}; exports are bf16 only")
    targets = sorted({k.split(".")[-3] for k in tensors})
    group = r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj"
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, float] = {}
    for key, t in sorted(tensors.items()):
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[len(PREFIX) : -len(".lora_A.weight")]
        r = int(t.shape[0])
        grouped = geom.is_moe and ".mlp.experts." in module and r * geom.topk == rank
        if grouped:
            rank_pattern[group] = r
        elif r != rank:
            rank_pattern[re.escape(module)] = r
        a = (alphas or {}).get(module + ".weight", alpha)
        if float(a) != float(alpha):
            alpha_pattern[re.escape(module)] = float(a)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": targets,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "base_model_name_or_path": base_model,
        CONTRACT_KEY: contract,
    }
    payload = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    meta = {"format": "pt", CONTRACT_KEY: contract, HASH_KEY: adapter_sha256(payload, config)}
    if model_hash is not None:
        meta[MODEL_KEY] = model_hash
    return _write_dir(Path(out_dir), payload, config, meta)


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
    The adapter is bound to ``model_dir``'s model hash.
    """
    model = model_dir if isinstance(model_dir, ModelDir) else ModelDir(model_dir, hybrid=True)
    geom = model.geometry
    contract = contract or model.contract().fingerprint
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
        base_model=str(model.path),
        model_hash=model.model_hash,
    )


def _check_config(path: Path, config: dict[str, Any]) -> tuple[int, float]:
    where = path / CONFIG
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: adapter type {config.get('peft_type')!r} is not LoRA")
    if config.get("bias", "none") != "none":
        raise AdapterError(
            f"{where}: bias = {config['bias']!r}: LoRA biases are not part of the exact lane"
        )
    init = config.get("init_lora_weights", True)
    if init not in PLAIN_INITS:
        raise AdapterError(
            f"{where}: init_lora_weights = {init!r} changes the base weights; the exact lane "
            f"runs adapters over unchanged base weights ({', '.join(map(repr, PLAIN_INITS))})"
        )
    for key, what in FEATURES.items():
        if config.get(key):
            raise AdapterError(
                f"{where}: {key} = {config[key]!r}: {what} is not part of the exact lane"
            )
    checked = NO_NUMERICS_FIELDS | set(NUMERIC_FIELDS) | set(FEATURES)
    checked |= {"bias", "init_lora_weights"}
    for key, value in config.items():
        if key not in checked and value not in (None, False, "", [], {}):
            raise AdapterError(
                f"{where}: PEFT field {key!r} = {value!r} is not implemented by the exact lane"
            )
    try:
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError) as err:
        raise AdapterError(f"{where}: needs an integer 'r' and a number 'lora_alpha'") from err
    for name in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(name) or {}, dict):
            raise AdapterError(f"{where}: {name} must be a mapping")
    return rank, alpha


def _read(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, str]]:
    for name in (CONFIG, WEIGHTS):
        if not (path / name).is_file():
            raise AdapterError(f"{path} has no {name}: not a PEFT adapter directory")
    try:
        config = json.loads((path / CONFIG).read_text())
    except json.JSONDecodeError as err:
        raise AdapterError(f"{path / CONFIG} is not valid JSON ({err})") from err
    try:
        with safe_open(str(path / WEIGHTS), "pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    except Exception as err:  # safetensors raises several types for damaged files
        raise AdapterError(
            f"{path / WEIGHTS} cannot be read: corrupted or truncated ({err})"
        ) from err
    return config, tensors, meta


def _pairs(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, ...]]:
    """module name -> (A, B); refuses non-LoRA tensors, other dtypes, orphan factors."""
    for key, t in sorted(tensors.items()):
        if t.dtype != torch.bfloat16:
            raise AdapterError(f"adapter factor {key} is {t.dtype}; the exact lane takes bf16 only")
        if not key.startswith(PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
            raise AdapterError(f"adapter tensor {key} is not a PEFT LoRA factor")
        if t.dim() != 2:
            raise AdapterError(f"adapter factor {key} has shape {tuple(t.shape)}; 2-D expected")
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        module, part = key[len(PREFIX) : -len(".weight")].rsplit(".", 1)
        found.setdefault(module, {})[part] = t
    pairs = {}
    for module, parts in sorted(found.items()):
        for have, lacks in (("lora_A", "lora_B"), ("lora_B", "lora_A")):
            if have in parts and lacks not in parts:
                raise AdapterError(f"adapter has {have} but no {lacks} for {module}")
        pairs[module] = (parts["lora_A"], parts["lora_B"])
    return pairs


def _unfuse(
    module: str, a: torch.Tensor, b: torch.Tensor, geom: Geometry, config: dict, rank: int
) -> tuple[str, int, list[tuple[str, torch.Tensor, torch.Tensor]]]:
    """Split a PEFT fused-expert factor pair into (expert module, A, B) per expert."""
    layer = int(_FUSED.fullmatch(module).group(1))
    g = geom
    n_exp, inter, hidden = g.experts, g.moe_intermediate, g.hidden
    io = (a.shape[1], b.shape[0])
    if io == (hidden, 2 * inter):
        param, parts = "gate_up_proj", (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter))
    elif io == (inter, hidden):
        param, parts = "down_proj", (("down_proj", 0, hidden),)
    else:
        raise AdapterError(
            f"{module}: factors {tuple(a.shape)}/{tuple(b.shape)} fit neither fused expert "
            f"parameter (gate_up_proj: in {hidden}, out {2 * inter}; down_proj: in {inter}, "
            f"out {hidden})"
        )
    rows = a.shape[0]
    if rows % n_exp or b.shape[1] != rows:
        raise AdapterError(
            f"{module} ({param}): factors {tuple(a.shape)}/{tuple(b.shape)} are not rank x "
            f"{n_exp} experts"
        )
    r = rows // n_exp
    key = f"model.layers.{layer}.mlp.experts.{param}"
    declared = int(_pattern_value(config.get("rank_pattern") or {}, key, rank))
    if r != declared:
        raise AdapterError(f"{key}: factors have rank {r} per expert, the config says {declared}")
    a3 = a.reshape(n_exp, r, a.shape[1])  # PEFT ParamWrapper: (experts, rank, in)
    b3 = b.reshape(b.shape[0], r, n_exp)  # (out, rank, experts)
    out = []
    for e in range(n_exp):
        for name, lo, hi in parts:
            out.append(
                (
                    f"model.layers.{layer}.mlp.experts.{e}.{name}",
                    a3[e].contiguous(),
                    b3[lo:hi, :, e].contiguous(),
                )
            )
    return key, r, out


def load_adapter(
    adapter_dir,
    model,
    contract: str | None = None,
    model_hash: str | None = None,
    model_dir: str | Path | None = None,
) -> Adapter:
    """Read and validate an adapter for ``model`` (a ``ModelDir`` or a ``Geometry`` of the
    qwen3 or the qwen3-next lane). ``model_dir``: the directory a refusal names for a
    ``Geometry`` (a ``ModelDir`` names its own).

    ``modules`` maps HF weight names to (A, B, scale). Given a ``ModelDir`` (or
    ``model_hash``), a Lockstep export bound to another base model is refused; given
    ``contract``, one made for another contract. ``AdapterError`` names every problem.
    """
    bare = isinstance(model, (Geometry, NextGeometry))
    geom = model if bare else model.geometry
    shown = model_dir if bare else model.path
    if model_hash is None and not bare:
        model_hash = model.model_hash
    path = Path(adapter_dir)
    config, tensors, meta = _read(path)
    rank, alpha = _check_config(path, config)
    pairs = _pairs(path, tensors)
    digest = adapter_sha256(tensors, config)
    if HASH_KEY in meta:
        if meta[HASH_KEY] != digest:
            raise AdapterError(
                f"{path} does not match its recorded adapter sha256 (tensors and the numeric "
                f"fields of {CONFIG}): corrupted or edited"
            )
    elif OLD_HASH_KEY in meta:
        raise AdapterError(
            f"{path / WEIGHTS} was exported by an older Lockstep whose hash left out "
            f"{CONFIG}; export it again"
        )
    made_for = meta.get(CONTRACT_KEY)
    if contract is not None and made_for is not None and made_for != contract:
        raise AdapterError(
            f"adapter was made for contract {made_for}, this lane is {contract}: it was trained "
            "for another lane (another model family, geometry or backend); "
            f"{show_command(path, shown)} prints both"
        )
    bound_to = meta.get(MODEL_KEY)
    if bound_to is not None and model_hash is not None and bound_to != model_hash:
        raise AdapterError(
            f"adapter was made for base model {bound_to}; this base model is {model_hash}: "
            f"use the adapter with the model it was trained on; {show_command(path, shown)} "
            "prints both"
        )
    shapes = module_shapes(geom)
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    alphas: dict[str, float] = {}
    fused_seen: set[str] = set()

    def add(name: str, key: str, a: torch.Tensor, b: torch.Tensor, r: int) -> None:
        if name + ".weight" in modules:
            raise AdapterError(f"adapter adapts {name} twice")
        n_out, n_in = shapes[name]
        if a.shape != (r, n_in) or b.shape != (n_out, r):
            raise AdapterError(
                f"{name}: factors {tuple(a.shape)}/{tuple(b.shape)}, expected "
                f"({r}, {n_in})/({n_out}, {r}): the adapter was made for a base model of "
                "other shapes"
            )
        a_m = float(_pattern_value(alpha_pattern, key, alpha))
        modules[name + ".weight"] = (a, b, a_m / r)
        alphas[name + ".weight"] = a_m

    for module, (a, b) in pairs.items():
        if geom.is_moe and _FUSED.fullmatch(module):
            key, r, split = _unfuse(module, a, b, geom, config, rank)
            if key in fused_seen:
                raise AdapterError(f"adapter adapts {key} twice")
            fused_seen.add(key)
            for name, a_e, b_e in split:
                add(name, key, a_e, b_e, r)
            continue
        if module not in shapes:
            raise AdapterError(f"adapter targets {module}, which the exact lane does not cover")
        r = int(a.shape[0])
        declared = int(_pattern_value(rank_pattern, module, rank))
        if r != declared:
            raise AdapterError(f"{module}: factors have rank {r}, the config says {declared}")
        add(module, module, a, b, r)
    if not modules:
        raise AdapterError(f"{path / WEIGHTS} holds no LoRA factors")
    return Adapter(
        path=path,
        rank=rank,
        alpha=alpha,
        contract=made_for,
        sha256=digest,
        modules=modules,
        alphas=alphas,
        base_model_hash=bound_to,
    )
