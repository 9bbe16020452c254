"""The trainer's one training stack: long-lived Megatron models for ``lockstep train`` (the
policy, a reference, a teacher) and for the qualification ladder's training gate (``run.py``
opens a policy session and takes its steps through it).

``PolicySession`` builds the Megatron model once, holds its LoRA adapters (fp32 masters; the
forward and the export see them rounded to bf16) and one AdamW for the whole run. ``admit``
admits a trace against an adapter (hash), the lane (contract, then its own invoked contract
after a probe forward) and the sampling rule; ``logprobs(trace)`` admits against the adapter it
last exported and scores every decision. ``update`` takes AdamW steps on micro-batches and
refuses to run a backward pass unless the forward it is about to differentiate reproduces the
sampler's log-probabilities byte for byte. ``state_files`` / ``load_state_files`` are the one
trainer state format (adapters, AdamW, the micro-batch generator, the position).

``FrozenSession`` is a reference or a teacher: the model of another (or the same) directory,
no adapter, no gradient; its backbone hash is what the loop checks every step.

Where they run: cpu, dense / MoE and the hybrid lane (Qwen3-Next, ``gdn/``); cuda on one GPU
for Qwen3 / Qwen3-MoE (the model and adapters move to the device, the step runs under torch's
deterministic algorithms: ``deterministic``). The cuda path is the one the ladder's training
gate ran; it is not exercised by this repository's cpu-only tests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load

from lockstep_exact.model import ModelDir
from lockstep_exact.parity import same_bytes
from lockstep_exact.safetensors_io import safetensors_bytes
from lockstep_exact.trace import Trace

from . import adapters as AD
from . import export
from .convert import build
from .gdn.refusals import refuse_training
from .scoring import AdmissionError, admit_invoked, admit_trace, sampled_logprobs, score

STATE_FORMAT = "lockstep.megatron.session/2"


class BackwardRefused(AdmissionError):
    """The forward the update would differentiate is not the sampler's, byte for byte."""


def check_backend(backend: str) -> torch.device:
    """cpu, or cuda on one GPU (the programs dispatch on the tensors' device, as in replay);
    the device the model runs on."""
    if backend not in ("cpu", "cuda"):
        raise NotImplementedError(
            f"the Megatron exact lane trains on cpu or cuda, not {backend!r}: use --backend cpu"
        )
    if backend == "cuda" and not torch.cuda.is_available():
        raise NotImplementedError(
            "training on cuda: no CUDA device here (torch sees none); use --backend cpu"
        )
    return torch.device(backend)


def _open_model(request) -> tuple[torch.device, ModelDir]:
    """What every session checks before it builds: the backend (then a hybrid model on
    another, ``refuse_training``), the model directory (Qwen3, Qwen3-MoE, Qwen3-Next)."""
    device = check_backend(request.backend)
    refuse_training(request.model_dir, request.backend)  # the hybrid lane: cpu or cuda
    return device, ModelDir(request.model_dir, hybrid=True)


@contextmanager
def deterministic(device: torch.device) -> Iterator[None]:
    """On cuda, torch's deterministic algorithms for the step (the backward's accumulating
    index ops then add in a fixed order instead of by atomics; an op that has no such version
    raises, naming itself); the previous setting comes back after. On cpu nothing changes."""
    if torch.device(device).type != "cuda":
        yield
        return
    # cuBLAS needs a fixed workspace to repeat its results; torch refuses cuBLAS calls in this
    # mode without it. Set only when the caller has not chosen one.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was, warn = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)


class PolicySession:
    role = "policy"

    def __init__(self, request):
        self.device, self.base = _open_model(request)
        self.backend = request.backend
        self.model = build(self.base.path)
        if request.adapter_in is not None:
            export.load_into(self.model, request.adapter_in, self.base, self.backend)
        else:
            AD.attach(self.model, request.rank, request.alpha, seed=request.seed)
        self.model.to(self.device)  # fresh adapters are drawn on cpu; the optimizer follows
        self.params = AD.adapter_parameters(self.model)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        if len(trainable) != len(self.params):
            raise RuntimeError(
                f"{len(trainable) - len(self.params)} backbone tensors would train; "
                "the backbone is frozen"
            )
        self.optimizer = torch.optim.AdamW(self.params, lr=request.lr, foreach=False)
        self.data = torch.Generator().manual_seed(request.seed)
        self.micro_batch = request.micro_batch
        self.position = 0  # micro-batches consumed (AdamW steps taken)
        self.adapter_dir: Path | None = None
        self.adapter_hash: str | None = None
        self._probed: set[tuple[str, bool]] = set()
        self._backbone = AD.backbone_hash(self.model)

    # -- the adapter the sampler serves ----------------------------------------------------
    def export(self, out_dir) -> tuple[Path, str]:
        """Write the adapter as the forward sees it (PEFT, bf16); the next ``logprobs`` admits
        traces sampled with exactly this adapter."""
        path = export.export_peft(self.model, out_dir, self.base, self.backend)
        self.adapter_dir = path
        self.adapter_hash = export.adapter_hash(path, self.base, self.backend)
        return path, self.adapter_hash

    def admit(self, trace: Trace, adapter_dir: Path | None) -> None:
        """Admit ``trace``, sampled with ``adapter_dir`` (None: the base model), or refuse
        (``AdmissionError``) naming what differs: contract, model, adapter hash, then what this
        model runs (a probe forward, once per contract) and the sampling rule's draws.

        A trace of the base model is admitted only while the policy's adapters are fresh
        (B = 0: the bytes are the base model's); its probe runs with them set aside, so the
        invoked contract is the base model's, as the sampler's."""
        admit_trace(trace, self.base, adapter_dir, self.backend)
        base_only = adapter_dir is None
        if base_only and any(bool(b.detach().any()) for b in self._lora_b()):
            raise AdmissionError(
                "adapter hash: the trace was sampled without an adapter, the policy's adapter "
                "has trained (B != 0): sample with the adapter the policy exported"
            )
        key = (trace.contract_fingerprint, base_only)
        if key in self._probed:
            return
        self.model.eval()
        with AD.set_aside(self.model) if base_only else _nothing():
            admit_invoked(trace, self.model, self.base, self.backend)
        self._probed.add(key)

    def _lora_b(self) -> list[torch.nn.Parameter]:
        named = self.model.named_parameters()
        return [p for n, p in named if ".lora." in n and n.endswith(".B")]

    def logprobs(self, trace: Trace) -> torch.Tensor:
        if self.adapter_dir is None:
            raise RuntimeError(
                "the policy has not exported its adapter: the sampler must serve the bytes "
                "the trainer holds (call export first)"
            )
        self.admit(trace, self.adapter_dir)
        self.model.eval()
        return score(self.model, trace, self.micro_batch)

    # -- training ------------------------------------------------------------------------------
    def update(
        self,
        seqs: Sequence[tuple[torch.Tensor, int]],
        old: Sequence[torch.Tensor] | None,
        loss: Callable[[list[torch.Tensor], list[int]], torch.Tensor],
        inner_steps: int,
        micro_batch: int | None = None,
    ) -> list[float]:
        """``inner_steps`` AdamW steps, each on a micro-batch drawn from ``seqs`` (prompt +
        completion ids, prompt length); ``loss(logprobs, indices)`` gives its scalar loss.
        With ``old`` (the sampler's logprobs per sequence), the first micro-batch's forward
        must equal them byte for byte before its backward runs (``BackwardRefused``)."""
        n = len(seqs)
        size = min(micro_batch or self.micro_batch, n)
        losses = []
        self.model.train()
        with deterministic(self.device):
            for k in range(inner_steps):
                idx = torch.sort(torch.randperm(n, generator=self.data)[:size]).values.tolist()
                self.position += 1
                lps = sampled_logprobs(self.model, [seqs[i] for i in idx])
                if k == 0 and old is not None:
                    for i, lp in zip(idx, lps, strict=True):
                        if not same_bytes(lp.detach(), old[i]):
                            raise BackwardRefused(
                                f"sequence {i}: the forward the update would differentiate is "
                                "not byte-equal to the sampler's log-probabilities; no backward "
                                "pass was run"
                            )
                value = loss(lps, idx)
                self.optimizer.zero_grad(set_to_none=True)
                value.backward()
                self.optimizer.step()
                losses.append(float(value.detach()))
        if AD.backbone_hash(self.model) != self._backbone:
            raise RuntimeError("the backbone changed during the update (it is frozen)")
        return losses

    def backbone_hash(self) -> str:
        return AD.backbone_hash(self.model)

    # -- the one trainer state format -----------------------------------------------------------
    def state_files(self) -> dict[str, bytes]:
        """The fp32 adapter masters, AdamW's state, the micro-batch generator and the position,
        as files (``STATE_FORMAT``)."""
        named = dict(self.model.named_parameters())
        names = {id(p): n for n, p in named.items()}
        adapters = {n: p.detach().contiguous() for n, p in named.items() if ".lora." in n}
        optimizer = {}
        for p in self.params:
            for key, v in self.optimizer.state.get(p, {}).items():
                t = v if torch.is_tensor(v) else torch.tensor(v)
                optimizer[f"{names[id(p)]}::{key}"] = t.contiguous()
        meta = {
            "format": STATE_FORMAT,
            "adapter_hash": self.adapter_hash,
            "position": self.position,
        }
        return {
            "adapters.safetensors": safetensors_bytes(adapters),
            "optimizer.safetensors": safetensors_bytes(optimizer),
            "rng.safetensors": safetensors_bytes({"data": self.data.get_state()}),
            "trainer.json": (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode(),
        }

    def load_state_files(self, files: dict[str, bytes], adapter_dir: Path | None = None) -> None:
        """Continue from ``state_files()``. ``adapter_dir``: the export the checkpoint's step
        made (its hash must be the one the checkpoint records; the sampler serves it next);
        None for a job that serves no sampler (the ladder's gate: it exports at the end)."""
        meta = json.loads(files["trainer.json"])
        if meta.get("format") != STATE_FORMAT:
            raise ValueError(f"trainer state is {meta.get('format')!r}, not {STATE_FORMAT!r}")
        own = dict(self.model.named_parameters())
        adapters = load(files["adapters.safetensors"])
        if set(adapters) != {n for n in own if ".lora." in n}:
            raise ValueError("the checkpoint's adapter tensors are not this policy's")
        if adapter_dir is not None:
            digest = export.adapter_hash(adapter_dir, self.base, self.backend)
            if digest != meta.get("adapter_hash"):
                raise ValueError(
                    f"{adapter_dir} hashes to {digest}, the checkpoint recorded "
                    f"{meta.get('adapter_hash')}"
                )
        with torch.no_grad():
            for n, t in adapters.items():
                own[n].copy_(t)
        for p in self.params:
            self.optimizer.state[p] = {}
        for key, t in load(files["optimizer.safetensors"]).items():
            n, k = key.split("::")
            # the moments live beside their parameter; AdamW keeps its step count on cpu
            self.optimizer.state[own[n]][k] = t.clone().to(own[n].device if t.dim() else "cpu")
        self.data.set_state(load(files["rng.safetensors"])["data"])
        self.position = int(meta["position"])
        if adapter_dir is not None:
            self.adapter_dir, self.adapter_hash = Path(adapter_dir), meta["adapter_hash"]

    def close(self) -> None:
        pass


@contextmanager
def _nothing() -> Iterator[None]:
    yield


class FrozenSession:
    """A reference or teacher model: scores traces of another sampler, never trains."""

    role = "frozen"

    def __init__(self, request):
        self.device, self.base = _open_model(request)
        self.model = build(self.base.path).to(self.device).eval()
        self.micro_batch = request.micro_batch

    def logprobs(self, trace: Trace) -> torch.Tensor:
        """This model's fp32 logprob of every decision of ``trace`` (sampled by another
        model: no sampling-rule check), through its own exact lane."""
        vocab = self.base.geometry.vocab
        for name in ("prompt_tokens", "sampled_tokens"):
            ids = getattr(trace, name)
            if ids.numel() and int(ids.max()) >= vocab:
                raise AdmissionError(
                    f"{name} holds id {int(ids.max())}, past {self.base.path}'s vocabulary "
                    f"({vocab} ids)"
                )
        return score(self.model, trace, self.micro_batch, control=True)

    def backbone_hash(self) -> str:
        return AD.backbone_hash(self.model)

    def close(self) -> None:
        pass


def open_session(request):
    if request.role == "policy":
        return PolicySession(request)
    if request.role == "frozen":
        return FrozenSession(request)
    raise ValueError(f"trainer session role {request.role!r}: expected 'policy' or 'frozen'")
