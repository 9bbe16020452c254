"""The plain data passed through the hooks (no engine types cross this boundary)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class EngineInfo:
    plugin: str
    role: str  # "sampler" or "trainer"
    engine: str
    engine_version: str | None
    plugin_version: str
    backends: tuple[str, ...] = ("cpu",)
    problem: str | None = None
    torch_version: str | None = None  # the torch this half runs on (reports name it)


@dataclass(frozen=True)
class CaptureRequest:
    model_dir: Path
    prompts: tuple[str, ...]
    decisions: int
    out_dir: Path | None = None
    adapter_dir: Path | None = None
    seed: int = 0
    contract: str | None = None  # expected fingerprint; None: the lane's own
    backend: str = "cpu"
    batch: bool = True  # submit all prompts at once (False: one at a time)
    options: dict = field(default_factory=dict)  # engine-specific knobs (chunked prefill, ...)
    temperature: float = 1.0  # the lane's sampling rule (sample.gumbel_topp): 0 is greedy
    top_p: float = 1.0
    tp: int = 1  # the sampler's tensor-parallel size (the bytes do not depend on it)


@dataclass(frozen=True)
class ReplayRequest:
    model_dir: Path
    trace_dir: Path
    adapter_dir: Path | None = None
    backend: str = "cpu"
    micro_batch: int = 3  # the trainer's own batching, deliberately unlike the sampler's
    tp: int = 1  # the trainer's tensor-parallel size (the bytes do not depend on it)
    ep: int = 1  # the trainer's expert-parallel size (nor on this)
    # Negative controls only: replay on an adapter other than the trace's (the adapter-hash
    # admission is skipped; the contract is still admitted). Reports record it.
    control: bool = False


@dataclass(frozen=True)
class ReplayResult:
    logprobs: object  # torch.float32 tensor, one per decision, trace order
    engine: str
    seconds: float


@dataclass(frozen=True)
class DumpRequest:
    role: str
    model_dir: Path
    tokens: tuple[int, ...]
    position: int
    adapter_dir: Path | None = None
    backend: str = "cpu"


@dataclass(frozen=True)
class TrainRequest:
    model_dir: Path
    trace_dir: Path
    adapter_in: Path | None
    adapter_out: Path
    steps: int = 1
    lr: float = 1e-3
    rank: int = 8
    alpha: float = 16.0
    seed: int = 0
    checkpoint_dir: Path | None = None
    backend: str = "cpu"
    # One advantage per trace sequence (GRPO); None: the trainer's deterministic toy reward.
    advantages: tuple[float, ...] | None = None
    micro_batch: int = 4  # sequences per AdamW step (the trainer session's micro-batch)


@dataclass(frozen=True)
class SamplerSessionRequest:
    """Start one long-lived sampling engine on the exact lane (``lockstep train``)."""

    model_dir: Path
    backend: str = "cpu"
    contract: str | None = None  # expected fingerprint; None: the lane's own
    max_lora_rank: int = 16  # the largest adapter rank the engine will be handed
    options: dict = field(default_factory=dict)  # engine-specific knobs


@dataclass(frozen=True)
class TrainerSessionRequest:
    """Build one long-lived trainer model: ``role="policy"`` (LoRA adapters and AdamW, the
    backbone frozen) or ``role="frozen"`` (a reference or teacher: no adapter, no grad)."""

    model_dir: Path
    role: str = "policy"
    backend: str = "cpu"
    adapter_in: Path | None = None  # start from this adapter (policy); None: fresh, B = 0
    rank: int = 8
    alpha: float = 16.0
    lr: float = 1e-3
    seed: int = 0
    micro_batch: int = 4


@dataclass(frozen=True)
class TrainResult:
    losses: tuple[float, ...]
    backbone_hash_before: str
    backbone_hash_after: str
    adapter_dir: Path


@dataclass(frozen=True)
class ServeRequest:
    """An OpenAI-compatible server on the lane: ``extra`` are the engine's own flags."""

    model_dir: Path
    backend: str = "cpu"
    extra: tuple[str, ...] = ()
    contract: str | None = None  # expected fingerprint; None: the lane's own


@dataclass(frozen=True)
class VerifyRequest:
    """A rollout file (``{"tokens", "prompt_len", "logprobs"}`` or ``{"prompt", "response"}``
    lines) to recompute in the trainer on ``model_dir`` (and ``adapter_dir``)."""

    model_dir: Path
    rollouts: Path
    adapter_dir: Path | None = None
    backend: str = "cpu"
