"""Traces: what the sampler decided, saved so that the trainer can replay it.

A trace is a directory with two files:

``payload.safetensors``, five 1-D tensors:

- ``prompt_tokens`` int64: every sequence's prompt token ids, concatenated;
- ``prompt_offsets`` int64, ``S + 1`` entries: sequence ``i``'s prompt is
  ``prompt_tokens[prompt_offsets[i]:prompt_offsets[i + 1]]`` (starts at 0, never decreases,
  ends at ``len(prompt_tokens)``);
- ``sampled_tokens`` int64 and ``sampled_offsets`` int64: the same for the sampled tokens;
- ``logprobs`` float32, one per sampled token: the log-probability the sampler reported for
  it, its raw bytes (never converted from another dtype on the way).

``manifest.json``: ``format`` (``"lockstep.trace"``), ``format_version`` (1), the contract
fingerprint, the model hash, the adapter hash (or null), the sampling settings (temperature,
top_p, seed), the engine (a free-form dict: name, version, ...), the creation time (UTC, ISO
8601), the prompt texts (or null), the sampler's invoked contract (or null; when present it must
carry ``kernels``, the kernels each op site ran), the number of sequences and decisions, and
``payload``: the sha256 of ``payload.safetensors`` and, per tensor, its dtype, shape and
``hashing.tensor_sha256``.

A trace holds at least one decision: one with none is refused when built, saved or loaded
(replaying it would prove nothing, yet report every decision exact).

``Trace.save`` writes atomically (``atomic.write_dir``: a temporary directory beside the
target, every file fsynced, then a rename). ``Trace.load`` checks everything and raises
``TraceError`` naming the first problem; a loaded trace is exactly what was saved or nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as safetensors_load

from .atomic import write_dir
from .contract import ContractMismatch, contract_from_json
from .hashing import sha256_bytes, tensor_sha256
from .safetensors_io import safetensors_bytes

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "NO_DECISIONS",
    "PAYLOAD",
    "Decision",
    "SamplingSettings",
    "Trace",
    "TraceError",
]

FORMAT = "lockstep.trace"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PAYLOAD = "payload.safetensors"
_DTYPES: dict[str, torch.dtype] = {
    "prompt_tokens": torch.int64,
    "prompt_offsets": torch.int64,
    "sampled_tokens": torch.int64,
    "sampled_offsets": torch.int64,
    "logprobs": torch.float32,
}
_DTYPE_NAMES = {torch.int64: "int64", torch.float32: "float32"}


class TraceError(ValueError):
    """A trace is malformed, inconsistent or corrupted."""


NO_DECISIONS = (
    "the trace has no decisions (no sampled tokens): there is nothing to replay, and an "
    "empty comparison would pass vacuously"
)


# ``sampling.rule`` of a reference whose tokens were given (teacher forcing), not drawn.
TEACHER_FORCED = "teacher-forced"
MISSING_RULE = (
    "the trace names no sampling rule (sampling.rule: the program that drew its tokens, or "
    f"{TEACHER_FORCED!r} for a teacher-forced reference); traces written before rules were "
    "recorded, or by hand without one, are refused: capture it again with `lockstep capture`"
)

MISSING_KERNELS = (
    "the trace's recorded contract has no kernel record (contract.kernels: the kernels each op "
    "site ran); traces written before kernels were recorded are refused: capture it again with "
    "`lockstep capture`"
)


@dataclass(frozen=True)
class SamplingSettings:
    """The sampling settings the trace was drawn with.

    ``seed`` is the base seed the caller asked for; ``seeds`` the seed each sequence was
    drawn with (one per sequence, left out of the manifest when unset), and ``rule`` what
    chose the tokens: the ident of the byte program that drew them
    (``sample.gumbel_topp@1{rounds=3}``), whose draws replay recomputes and checks token by
    token, or ``TEACHER_FORCED`` for a reference whose tokens were given, not drawn (replay
    then has no draw to check). Every trace names its rule: one without it (written before
    traces recorded it, or by hand) is refused when built or loaded.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    seeds: tuple[int, ...] | None = None
    rule: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
        }
        if self.seeds is not None:
            out["seeds"] = list(self.seeds)
        out["rule"] = self.rule
        return out

    @classmethod
    def from_json(cls, obj: Any) -> SamplingSettings:
        if not isinstance(obj, dict):
            raise TraceError(f"manifest 'sampling' must be an object, got {type(obj).__name__}")
        unknown = set(obj) - {"temperature", "top_p", "seed", "seeds", "rule"}
        if unknown:
            raise TraceError(f"manifest 'sampling' has unknown keys {sorted(unknown)}")
        try:
            temperature = obj["temperature"]
            top_p = obj["top_p"]
            seed = obj["seed"]
        except KeyError as e:
            raise TraceError(f"manifest 'sampling' lacks {e.args[0]!r}") from None
        for name, v in (("temperature", temperature), ("top_p", top_p)):
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise TraceError(f"manifest sampling.{name} must be a number, got {v!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TraceError(f"manifest sampling.seed must be an int or null, got {seed!r}")
        seeds = obj.get("seeds")
        if seeds is not None and (
            not isinstance(seeds, list)
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in seeds)
        ):
            raise TraceError(f"manifest sampling.seeds must be a list of ints, got {seeds!r}")
        if "rule" not in obj:
            raise TraceError(MISSING_RULE)
        rule = obj["rule"]
        if not isinstance(rule, str) or not rule:
            raise TraceError(f"manifest sampling.rule must be a non-empty string, got {rule!r}")
        return cls(
            float(temperature),
            float(top_p),
            seed,
            tuple(seeds) if seeds is not None else None,
            rule,
        )


@dataclass(frozen=True)
class Decision:
    """One sampled token. Unpacks as ``(seq_index, step, position, token_id, logprob)``.

    ``step`` counts the sampled tokens of the sequence from 0; ``position`` is the token's
    position in the full sequence (prompt length + step).
    """

    seq_index: int
    step: int
    position: int
    token_id: int
    logprob: float

    def __iter__(self) -> Iterator[Any]:
        return iter((self.seq_index, self.step, self.position, self.token_id, self.logprob))


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _offsets(lengths: Sequence[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if lengths:
        out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return out


def _as_tokens(seq: Any, what: str) -> torch.Tensor:
    t = seq if isinstance(seq, torch.Tensor) else torch.tensor(list(seq), dtype=torch.int64)
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TraceError(f"{what} must be integer token ids, got dtype {t.dtype}")
    return t.detach().to("cpu", torch.int64).reshape(-1)


def _as_logprobs(lp: Any, what: str) -> torch.Tensor:
    if isinstance(lp, torch.Tensor):
        if lp.dtype != torch.float32:
            raise TraceError(
                f"{what} must be float32 (the sampler's raw bytes), got {lp.dtype}: "
                "a converted value is not the value the sampler reported"
            )
        return lp.detach().to("cpu").reshape(-1).contiguous()
    wide = torch.tensor(list(lp), dtype=torch.float64)
    narrow = wide.to(torch.float32)
    inexact = (narrow.to(torch.float64) != wide) & ~torch.isnan(wide)
    if bool(inexact.any()):
        i = int(torch.nonzero(inexact)[0].item())
        raise TraceError(
            f"{what}[{i}] = {wide[i].item()!r} is not a float32 value: storing it would round "
            "it; pass the sampler's float32 tensor"
        )
    return narrow


def _check_offsets(offsets: torch.Tensor, n_values: int, name: str) -> None:
    if offsets.numel() < 1:
        raise TraceError(f"{name} is empty: it needs at least the leading 0")
    if offsets[0].item() != 0:
        raise TraceError(f"{name} must start at 0, starts at {offsets[0].item()}")
    if offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any()):
        i = int(torch.nonzero(offsets[1:] < offsets[:-1])[0].item())
        raise TraceError(f"{name} decreases at index {i + 1}: inconsistent with the lengths")
    if offsets[-1].item() != n_values:
        raise TraceError(
            f"{name} ends at {offsets[-1].item()} but there are {n_values} tokens: "
            "offsets inconsistent with lengths"
        )


def _validate_tensors(tensors: Mapping[str, torch.Tensor]) -> None:
    missing = [k for k in _DTYPES if k not in tensors]
    if missing:
        raise TraceError(f"payload lacks tensor(s) {missing}")
    extra = sorted(set(tensors) - set(_DTYPES))
    if extra:
        raise TraceError(f"payload has unexpected tensor(s) {extra}")
    for name, dtype in _DTYPES.items():
        t = tensors[name]
        if t.dtype != dtype:
            hint = " (refusing: the raw sampler bytes are float32)" if name == "logprobs" else ""
            raise TraceError(f"tensor {name} has dtype {t.dtype}, expected {dtype}{hint}")
        if t.dim() != 1:
            raise TraceError(f"tensor {name} must be 1-D, has shape {tuple(t.shape)}")
    p_off, s_off = tensors["prompt_offsets"], tensors["sampled_offsets"]
    if p_off.numel() != s_off.numel():
        raise TraceError(
            f"prompt_offsets has {p_off.numel()} entries but sampled_offsets has "
            f"{s_off.numel()}: they must describe the same number of sequences"
        )
    _check_offsets(p_off, tensors["prompt_tokens"].numel(), "prompt_offsets")
    _check_offsets(s_off, tensors["sampled_tokens"].numel(), "sampled_offsets")
    lp = tensors["logprobs"]
    if lp.numel() != tensors["sampled_tokens"].numel():
        raise TraceError(
            f"logprobs has {lp.numel()} entries but there are "
            f"{tensors['sampled_tokens'].numel()} sampled tokens: one per decision expected"
        )
    for name in ("prompt_tokens", "sampled_tokens"):
        t = tensors[name]
        if t.numel() and bool((t < 0).any()):
            i = int(torch.nonzero(t < 0)[0].item())
            raise TraceError(f"{name}[{i}] = {t[i].item()} is a negative token id")
    bad = ~torch.isfinite(lp)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0].item())
        raise TraceError(f"logprobs[{i}] is {lp[i].item()}: NaN and infinite log-probs are refused")


@dataclass(eq=False)
class Trace:
    """A sampler's decisions. Build one with ``Trace.from_sequences`` or ``Trace.load``.

    ``eq=False``: two traces are compared through their tensors and hashes, not ``==``."""

    prompt_tokens: torch.Tensor
    prompt_offsets: torch.Tensor
    sampled_tokens: torch.Tensor
    sampled_offsets: torch.Tensor
    logprobs: torch.Tensor
    contract_fingerprint: str
    model_hash: str
    adapter_hash: str | None = None
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    engine: dict[str, Any] = field(default_factory=dict)
    created: str = field(default_factory=_now)
    prompt_texts: list[str] | None = None
    # The sampler's invoked contract (``Contract.to_json()`` of the sites it ran, with the
    # kernels each ran), whose fingerprint is ``contract_fingerprint``; replay compares it with
    # its own, site by site, and refuses a kernel no test gates.
    contract: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _validate_tensors(self.tensors())
        if self.num_decisions == 0:
            raise TraceError(NO_DECISIONS)
        for name in ("contract_fingerprint", "model_hash"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise TraceError(f"{name} must be a non-empty string")
        if self.adapter_hash is not None and not isinstance(self.adapter_hash, str):
            raise TraceError("adapter_hash must be a string or None")
        if not isinstance(self.sampling, SamplingSettings):
            raise TraceError("sampling must be a SamplingSettings")
        if not isinstance(self.sampling.rule, str) or not self.sampling.rule:
            raise TraceError(MISSING_RULE)
        seeds = self.sampling.seeds
        if seeds is not None and len(seeds) != self.num_sequences:
            raise TraceError(
                f"sampling.seeds has {len(seeds)} entries for {self.num_sequences} sequences"
            )
        if not isinstance(self.engine, dict):
            raise TraceError("engine must be a dict")
        if self.contract is not None:
            self._check_contract()
        if self.prompt_texts is not None:
            if not isinstance(self.prompt_texts, list) or not all(
                isinstance(x, str) for x in self.prompt_texts
            ):
                raise TraceError("prompt_texts must be a list of strings or None")
            if len(self.prompt_texts) != self.num_sequences:
                raise TraceError(
                    f"{len(self.prompt_texts)} prompt texts for {self.num_sequences} sequences"
                )

    def _check_contract(self) -> None:
        if not isinstance(self.contract, Mapping) or not self.contract.get("kernels"):
            raise TraceError(MISSING_KERNELS)
        try:
            fingerprint = contract_from_json(self.contract).fingerprint
        except (ContractMismatch, KeyError, TypeError, ValueError, AttributeError) as e:
            raise TraceError(f"the recorded contract is malformed ({e})") from None
        if fingerprint != self.contract_fingerprint:
            raise TraceError(
                f"the recorded contract hashes to {fingerprint}, not the trace's "
                f"contract_fingerprint {self.contract_fingerprint}"
            )

    # -------------------------------------------------------------- construction

    @classmethod
    def from_sequences(
        cls,
        prompts: Sequence[Sequence[int] | torch.Tensor],
        sampled: Sequence[Sequence[int] | torch.Tensor],
        logprobs: Sequence[Sequence[float] | torch.Tensor],
        *,
        contract_fingerprint: str,
        model_hash: str,
        adapter_hash: str | None = None,
        sampling: SamplingSettings | None = None,
        engine: Mapping[str, Any] | None = None,
        prompt_texts: Sequence[str] | None = None,
        created: str | None = None,
        contract: Mapping[str, Any] | None = None,
    ) -> Trace:
        """Build a trace from per-sequence lists. ``logprobs[i]`` must be a float32 tensor (the
        sampler's raw values) or a list of Python floats that are exactly float32 values."""
        if not len(prompts) == len(sampled) == len(logprobs):
            raise TraceError(
                f"{len(prompts)} prompts, {len(sampled)} sampled lists and {len(logprobs)} "
                "logprob lists: one of each per sequence expected"
            )
        p = [_as_tokens(x, f"prompts[{i}]") for i, x in enumerate(prompts)]
        s = [_as_tokens(x, f"sampled[{i}]") for i, x in enumerate(sampled)]
        lp = [_as_logprobs(x, f"logprobs[{i}]") for i, x in enumerate(logprobs)]
        for i, (si, li) in enumerate(zip(s, lp, strict=True)):
            if si.numel() != li.numel():
                raise TraceError(
                    f"sequence {i}: {si.numel()} sampled tokens but {li.numel()} logprobs"
                )
        empty_i = torch.zeros(0, dtype=torch.int64)
        return cls(
            prompt_tokens=torch.cat(p) if p else empty_i,
            prompt_offsets=_offsets([x.numel() for x in p]),
            sampled_tokens=torch.cat(s) if s else empty_i,
            sampled_offsets=_offsets([x.numel() for x in s]),
            logprobs=torch.cat(lp) if lp else torch.zeros(0, dtype=torch.float32),
            contract_fingerprint=contract_fingerprint,
            model_hash=model_hash,
            adapter_hash=adapter_hash,
            sampling=sampling if sampling is not None else SamplingSettings(),
            engine=dict(engine or {}),
            prompt_texts=list(prompt_texts) if prompt_texts is not None else None,
            created=created if created is not None else _now(),
            contract=dict(contract) if contract is not None else None,
        )

    # -------------------------------------------------------------- access

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in _DTYPES}

    @property
    def num_sequences(self) -> int:
        return self.prompt_offsets.numel() - 1

    @property
    def num_decisions(self) -> int:
        return self.sampled_tokens.numel()

    def prompt(self, i: int) -> torch.Tensor:
        a, b = self.prompt_offsets[i].item(), self.prompt_offsets[i + 1].item()
        return self.prompt_tokens[a:b]

    def sampled(self, i: int) -> torch.Tensor:
        a, b = self.sampled_offsets[i].item(), self.sampled_offsets[i + 1].item()
        return self.sampled_tokens[a:b]

    def sequence_logprobs(self, i: int) -> torch.Tensor:
        a, b = self.sampled_offsets[i].item(), self.sampled_offsets[i + 1].item()
        return self.logprobs[a:b]

    def sha256(self) -> str:
        """The trace's identity: a sha256 over every tensor's bytes and what the decisions were
        drawn from (contract, model, adapter, sampling settings). The creation time, the engine
        description and the prompt texts are descriptions, not content, and are left out."""
        content = {
            "tensors": {name: tensor_sha256(t) for name, t in self.tensors().items()},
            "contract_fingerprint": self.contract_fingerprint,
            "model_hash": self.model_hash,
            "adapter_hash": self.adapter_hash,
            "sampling": self.sampling.to_json(),
        }
        return sha256_bytes(json.dumps(content, sort_keys=True).encode())

    def decisions(self) -> Iterator[Decision]:
        """Every decision in order: sequence by sequence, step by step."""
        p_off = self.prompt_offsets.tolist()
        s_off = self.sampled_offsets.tolist()
        tokens = self.sampled_tokens.tolist()
        lps = self.logprobs.tolist()  # float32 -> Python float is exact
        for i in range(self.num_sequences):
            prompt_len = p_off[i + 1] - p_off[i]
            for step, k in enumerate(range(s_off[i], s_off[i + 1])):
                yield Decision(i, step, prompt_len + step, tokens[k], lps[k])

    # -------------------------------------------------------------- files

    def _manifest(self, payload_sha: str) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "contract_fingerprint": self.contract_fingerprint,
            "model_hash": self.model_hash,
            "adapter_hash": self.adapter_hash,
            "sampling": self.sampling.to_json(),
            "engine": self.engine,
            "created": self.created,
            "prompt_texts": self.prompt_texts,
            "contract": self.contract,
            "num_sequences": self.num_sequences,
            "num_decisions": self.num_decisions,
            "payload": {
                "file": PAYLOAD,
                "sha256": payload_sha,
                "tensors": {
                    name: {
                        "dtype": _DTYPE_NAMES[t.dtype],
                        "shape": list(t.shape),
                        "sha256": tensor_sha256(t),
                    }
                    for name, t in self.tensors().items()
                },
            },
        }

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write the trace directory at ``path`` atomically; returns ``path``.

        Refuses an existing ``path`` unless ``overwrite`` (then the old directory is replaced
        as a whole, never mixed with the new files)."""
        if self.num_decisions == 0:
            raise TraceError(f"refusing to save: {NO_DECISIONS}")
        payload = safetensors_bytes(
            {k: v.contiguous() for k, v in self.tensors().items()},
            metadata={"format": FORMAT, "format_version": str(FORMAT_VERSION)},
        )
        manifest = self._manifest(sha256_bytes(payload))
        manifest_bytes = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
        return write_dir(path, {PAYLOAD: payload, MANIFEST: manifest_bytes}, overwrite=overwrite)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trace:
        """Read and verify a trace directory; raises ``TraceError`` naming the problem."""
        root = Path(path)
        if not root.is_dir():
            raise TraceError(f"trace directory {root} does not exist")
        manifest = _read_manifest(root / MANIFEST)
        if manifest["num_decisions"] == 0:
            raise TraceError(f"{root}: {NO_DECISIONS}")
        payload_path = root / PAYLOAD
        if not payload_path.is_file():
            raise TraceError(f"{PAYLOAD} is missing from {root}")
        payload = payload_path.read_bytes()
        info = manifest["payload"]
        if sha256_bytes(payload) != info["sha256"]:
            raise TraceError(
                f"{PAYLOAD} does not match its recorded sha256: corrupted or truncated"
            )
        try:
            tensors = safetensors_load(payload)
        except Exception as e:  # the sha matched, so the writer wrote garbage
            raise TraceError(f"{PAYLOAD} is not a readable safetensors file: {e}") from e
        listed = info["tensors"]
        if set(listed) != set(tensors):
            raise TraceError(
                f"manifest lists tensors {sorted(listed)} but {PAYLOAD} holds {sorted(tensors)}"
            )
        _validate_tensors(tensors)
        for name, t in tensors.items():
            rec = listed[name]
            if not isinstance(rec, dict):
                raise TraceError(f"manifest payload.tensors.{name} must be an object")
            if rec.get("dtype") != _DTYPE_NAMES[t.dtype] or rec.get("shape") != list(t.shape):
                raise TraceError(
                    f"tensor {name} is {_DTYPE_NAMES[t.dtype]}{list(t.shape)} but the manifest "
                    f"records {rec.get('dtype')}{rec.get('shape')}"
                )
            if rec.get("sha256") != tensor_sha256(t):
                raise TraceError(f"tensor {name} does not match its recorded sha256")
        for key, value in (
            ("num_sequences", tensors["prompt_offsets"].numel() - 1),
            ("num_decisions", tensors["sampled_tokens"].numel()),
        ):
            if manifest[key] != value:
                raise TraceError(f"manifest {key} is {manifest[key]}, the payload has {value}")
        try:
            return cls(
                **tensors,
                contract_fingerprint=manifest["contract_fingerprint"],
                model_hash=manifest["model_hash"],
                adapter_hash=manifest["adapter_hash"],
                sampling=SamplingSettings.from_json(manifest["sampling"]),
                engine=manifest["engine"],
                created=manifest["created"],
                prompt_texts=manifest["prompt_texts"],
                contract=manifest.get("contract"),
            )
        except TraceError as e:
            raise TraceError(f"{root}: {e}") from None


_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "format": str,
    "format_version": int,
    "contract_fingerprint": str,
    "model_hash": str,
    "adapter_hash": (str, type(None)),
    "sampling": dict,
    "engine": dict,
    "created": str,
    "prompt_texts": (list, type(None)),
    "num_sequences": int,
    "num_decisions": int,
    "payload": dict,
}


def _read_manifest(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise TraceError(f"{MANIFEST} is missing from {path.parent}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"{MANIFEST} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise TraceError(f"{MANIFEST} must hold a JSON object, holds {type(manifest).__name__}")
    if manifest.get("format") != FORMAT:
        raise TraceError(f"{MANIFEST} format is {manifest.get('format')!r}, expected {FORMAT!r}")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION or isinstance(version, bool):
        raise TraceError(
            f"unsupported trace format_version {version!r} (this reader knows {FORMAT_VERSION})"
        )
    for key, types in _REQUIRED.items():
        if key not in manifest:
            raise TraceError(f"{MANIFEST} lacks the key {key!r}")
        if not isinstance(manifest[key], types) or isinstance(manifest[key], bool):
            raise TraceError(f"{MANIFEST} key {key!r} has the wrong type")
    payload = manifest["payload"]
    if payload.get("file") != PAYLOAD:
        raise TraceError(f"manifest payload.file is {payload.get('file')!r}, expected {PAYLOAD!r}")
    if not isinstance(payload.get("sha256"), str) or not isinstance(payload.get("tensors"), dict):
        raise TraceError("manifest payload needs a 'sha256' string and a 'tensors' object")
    return manifest
