"""Long-lived trainer models for ``lockstep train``: the policy, a reference, a teacher.

``PolicySession`` builds the Megatron model once, holds its LoRA adapters (fp32 masters; the
forward and the export see them rounded to bf16) and one AdamW for the whole run. Its
``logprobs(trace)`` admits the trace against the adapter it last exported (hash), the lane
(contract, then its own invoked contract after a probe forward) and the sampling rule, then
scores every decision. ``update`` refuses to run a backward pass unless the forward it is about
to differentiate reproduces the sampler's log-probabilities byte for byte.

``FrozenSession`` is a reference or a teacher: the model of another (or the same) directory,
no adapter, no gradient; its backbone hash is what the loop checks every step.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
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
from .gdn.refusals import refuse_session
from .scoring import AdmissionError, admit_invoked, admit_trace, sampled_logprobs, score

STATE_FORMAT = "lockstep.megatron.session/1"


class BackwardRefused(AdmissionError):
    """The forward the update would differentiate is not the sampler's, byte for byte."""


def _check_backend(backend: str) -> None:
    if backend != "cpu":
        raise NotImplementedError(f"the Megatron exact lane trains on cpu here, not {backend!r}")


class PolicySession:
    role = "policy"

    def __init__(self, request):
        _check_backend(request.backend)
        self.backend = request.backend
        self.base = ModelDir(request.model_dir)
        self.model = build(self.base.path)
        if request.adapter_in is not None:
            export.load_into(self.model, request.adapter_in, self.base)
        else:
            AD.attach(self.model, request.rank, request.alpha, seed=request.seed)
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
        self.adapter_dir: Path | None = None
        self.adapter_hash: str | None = None
        self._probed: set[str] = set()
        self._backbone = AD.backbone_hash(self.model)

    # -- the adapter the sampler serves ----------------------------------------------------
    def export(self, out_dir) -> tuple[Path, str]:
        """Write the adapter as the forward sees it (PEFT, bf16); the next ``logprobs`` admits
        traces sampled with exactly this adapter."""
        path = export.export_peft(self.model, out_dir, self.base)
        self.adapter_dir, self.adapter_hash = path, export.adapter_hash(path, self.base)
        return path, self.adapter_hash

    def logprobs(self, trace: Trace) -> torch.Tensor:
        if self.adapter_dir is None:
            raise RuntimeError(
                "the policy has not exported its adapter: the sampler must serve the bytes "
                "the trainer holds (call export first)"
            )
        admit_trace(trace, self.base, self.adapter_dir, self.backend)
        self.model.eval()
        if trace.contract_fingerprint not in self._probed:
            admit_invoked(trace, self.model, self.base, self.backend)
            self._probed.add(trace.contract_fingerprint)
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
        for k in range(inner_steps):
            idx = torch.sort(torch.randperm(n, generator=self.data)[:size]).values.tolist()
            lps = sampled_logprobs(self.model, [seqs[i] for i in idx])
            if k == 0 and old is not None:
                for i, lp in zip(idx, lps, strict=True):
                    if not same_bytes(lp.detach(), old[i]):
                        raise BackwardRefused(
                            f"sequence {i}: the forward the update would differentiate is not "
                            "byte-equal to the sampler's log-probabilities; no backward pass "
                            "was run"
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

    # -- checkpoints ------------------------------------------------------------------------------
    def state_files(self) -> dict[str, bytes]:
        """The fp32 adapter masters, AdamW's state and the micro-batch generator, as files."""
        named = dict(self.model.named_parameters())
        names = {id(p): n for n, p in named.items()}
        adapters = {n: p.detach().contiguous() for n, p in named.items() if ".lora." in n}
        optimizer = {}
        for p in self.params:
            for key, v in self.optimizer.state.get(p, {}).items():
                t = v if torch.is_tensor(v) else torch.tensor(v)
                optimizer[f"{names[id(p)]}::{key}"] = t.contiguous()
        meta = {"format": STATE_FORMAT, "adapter_hash": self.adapter_hash}
        return {
            "adapters.safetensors": safetensors_bytes(adapters),
            "optimizer.safetensors": safetensors_bytes(optimizer),
            "rng.safetensors": safetensors_bytes({"data": self.data.get_state()}),
            "trainer.json": (json.dumps(meta, indent=2, sort_keys=True) + "\n").encode(),
        }

    def load_state_files(self, files: dict[str, bytes], adapter_dir: Path) -> None:
        """Continue from ``state_files()``; ``adapter_dir`` is the export the checkpoint's
        step made (its hash must be the one the checkpoint records)."""
        meta = json.loads(files["trainer.json"])
        if meta.get("format") != STATE_FORMAT:
            raise ValueError(f"trainer state is {meta.get('format')!r}, not {STATE_FORMAT!r}")
        own = dict(self.model.named_parameters())
        adapters = load(files["adapters.safetensors"])
        if set(adapters) != {n for n in own if ".lora." in n}:
            raise ValueError("the checkpoint's adapter tensors are not this policy's")
        with torch.no_grad():
            for n, t in adapters.items():
                own[n].copy_(t)
        for p in self.params:
            self.optimizer.state[p] = {}
        for key, t in load(files["optimizer.safetensors"]).items():
            n, k = key.split("::")
            self.optimizer.state[own[n]][k] = t.clone()
        self.data.set_state(load(files["rng.safetensors"])["data"])
        digest = export.adapter_hash(adapter_dir, self.base)
        if digest != meta.get("adapter_hash"):
            raise ValueError(
                f"{adapter_dir} hashes to {digest}, the checkpoint recorded "
                f"{meta.get('adapter_hash')}"
            )
        self.adapter_dir, self.adapter_hash = Path(adapter_dir), digest

    def close(self) -> None:
        pass


class FrozenSession:
    """A reference or teacher model: scores traces of another sampler, never trains."""

    role = "frozen"

    def __init__(self, request):
        _check_backend(request.backend)
        self.base = ModelDir(request.model_dir)
        self.model = build(self.base.path).eval()
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
    refuse_session(request.model_dir)  # before anything is read or built
    if request.role == "policy":
        return PolicySession(request)
    if request.role == "frozen":
        return FrozenSession(request)
    raise ValueError(f"trainer session role {request.role!r}: expected 'policy' or 'frozen'")
