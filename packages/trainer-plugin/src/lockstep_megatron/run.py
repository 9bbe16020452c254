"""One training job as the ladder runs it: admit, build, (resume), train, checkpoint, export."""

from __future__ import annotations

from pathlib import Path

import torch

from lockstep_exact.model import ModelDir
from lockstep_exact.requests import TrainRequest, TrainResult
from lockstep_exact.trace import Trace

from . import adapters as AD
from . import export
from .checkpoint import check_resume, load_checkpoint, save_checkpoint
from .convert import build
from .gdn.refusals import refuse_training
from .scoring import admit_invoked, admit_trace
from .train import TrainConfig, Trainer


def latest_checkpoint(root: Path) -> Path | None:
    found = sorted(
        (p for p in root.glob("step-*") if (p / "manifest.json").is_file()),
        key=lambda p: int(p.name.split("-")[1]),
    )
    return found[-1] if found else None


def check_train_backend(backend: str) -> None:
    """cpu, or cuda on one GPU: the model and its adapters move to the device and the
    programs dispatch on the tensors' device, as in replay (the step is made deterministic
    there: ``train.deterministic``)."""
    if backend not in ("cpu", "cuda"):
        raise NotImplementedError(f"the Megatron exact lane trains on cpu or cuda, not {backend!r}")
    if backend == "cuda" and not torch.cuda.is_available():
        raise NotImplementedError("training on cuda: no CUDA device here")


def train(request: TrainRequest) -> TrainResult:
    check_train_backend(request.backend)  # before the trace or the model is read
    refuse_training(request.model_dir, request.backend)  # the hybrid lane trains on cpu only
    # Parsed and hashed once for every check below; the hybrid lane (Qwen3-Next) trains too.
    model_dir = ModelDir(request.model_dir, hybrid=True)
    adapter_in = Path(request.adapter_in) if request.adapter_in else None
    trace = Trace.load(request.trace_dir)
    admit_trace(trace, model_dir, adapter_in, request.backend)
    model = build(model_dir.path)
    if adapter_in is not None:
        export.load_into(model, adapter_in, model_dir, request.backend)
    if request.backend == "cuda":
        model = model.cuda()  # fresh adapters (no adapter_in) follow in Trainer
    admit_invoked(trace, model, model_dir, request.backend)  # before any backward pass
    before = AD.backbone_hash(model)
    trainer = Trainer(
        model,
        trace,
        TrainConfig(
            rank=request.rank,
            alpha=request.alpha,
            lr=request.lr,
            seed=request.seed,
            advantages=getattr(request, "advantages", None),
        ),
    )
    # What the job continues, beside the trainer's own settings (trace, lr, rank, ...).
    identity = {
        "contract": trace.contract_fingerprint,
        "model_hash": trace.model_hash,
        "adapter_in": (
            export.adapter_hash(adapter_in, model_dir, request.backend) if adapter_in else None
        ),
        "steps": request.steps,
        "backend": request.backend,
    }
    ckpt_root = Path(request.checkpoint_dir) if request.checkpoint_dir else None
    if ckpt_root is not None and (last := latest_checkpoint(ckpt_root)) is not None:
        state = load_checkpoint(last)
        check_resume(state["identity"], identity, str(last), free=("steps",))
        trainer.load_state(state, where=str(last))
    losses = tuple(trainer.step() for _ in range(request.steps))
    if ckpt_root is not None:
        state = {**trainer.state(), "identity": identity}
        save_checkpoint(state, ckpt_root / f"step-{trainer.position}")
    after = AD.backbone_hash(model)
    out = export.export_peft(model, request.adapter_out, model_dir, request.backend)
    return TrainResult(
        losses=losses, backbone_hash_before=before, backbone_hash_after=after, adapter_dir=out
    )
