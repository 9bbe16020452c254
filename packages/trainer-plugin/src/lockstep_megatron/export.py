"""PEFT export of the trained adapter and its loader, through ``lockstep_exact.adapters``.

The format (bf16 factors under PEFT names; the contract, the base model hash and the adapter
hash in the safetensors metadata; experts at rank ``r // topk``; scale ``alpha / rank``) and
every refusal (fp32, corrupted or edited, orphan factors, another contract or base model, wrong
shape or rank, uncovered module, PEFT features the lane lacks) are the shared module's, so the
trainer writes and reads exactly what the sampler reads and writes. Adapters made by ``peft``
load too, on the sites they cover (e.g. q_proj and v_proj only).
"""

from __future__ import annotations

from pathlib import Path

import torch

from lockstep_exact import programs as P
from lockstep_exact.adapters import PREFIX, Adapter, AdapterError, load_adapter, write_adapter
from lockstep_exact.layout import shard_lora
from lockstep_exact.model import ModelDir

from . import adapters as AD
from .spec import LockstepGPT

__all__ = ["AdapterError", "adapter_hash", "export_peft", "load_into", "read_adapter"]


def peft_tensors(model: LockstepGPT) -> dict[str, torch.Tensor]:
    """The bf16 factors the trainer's forward used, under PEFT names."""
    out = {}
    for s in AD.sites(model):
        if s.part in s.linear.lora:
            ad = s.linear.lora[s.part]
            out[f"{PREFIX}{s.hf_module}.lora_A.weight"] = P.round_bf16(ad.A.detach()).contiguous()
            out[f"{PREFIX}{s.hf_module}.lora_B.weight"] = P.round_bf16(ad.B.detach()).contiguous()
    return out


def export_peft(
    model: LockstepGPT,
    out_dir: str | Path,
    model_dir: str | Path | ModelDir,
    backend: str = "cpu",
) -> Path:
    """Write the trained adapter, bound to ``model_dir``'s model hash and to the contract of
    the lane it was trained on (``backend``'s: a cuda-trained adapter names the cuda lane, as
    the serving half checks an adapter against the lane it serves)."""
    if getattr(model, "tp", 1) > 1:
        raise NotImplementedError(
            "exporting an adapter from Megatron at tp > 1 is not wired yet: the "
            "column-parallel B factors would need gathering; train and export at tp 1"
        )
    if getattr(model, "ep", 1) > 1:
        raise NotImplementedError(
            "exporting an adapter from Megatron at ep > 1 is not wired yet: each "
            "rank holds its own experts' adapters; train and export at ep 1"
        )
    cfg = model.lora_config
    base = _base(model_dir)
    return write_adapter(
        out_dir,
        peft_tensors(model),
        rank=cfg["r"],
        alpha=cfg["alpha"],
        contract=base.contract(backend).fingerprint,
        geom=model.geom,
        base_model=str(base.path),
        model_hash=base.model_hash,
        alphas=cfg.get("alphas"),
    )


def _base(model_dir: str | Path | ModelDir) -> ModelDir:
    """The base model directory; the Megatron plugin runs the hybrid lane too (Qwen3-Next)."""
    return model_dir if isinstance(model_dir, ModelDir) else ModelDir(model_dir, hybrid=True)


def read_adapter(
    adapter_dir: str | Path, model_dir: str | Path | ModelDir, backend: str = "cpu"
) -> Adapter:
    """The validated adapter for this lane on ``backend``, or ``AdapterError`` naming the
    problem (one bound to another backend's lane among them)."""
    base = _base(model_dir)
    return load_adapter(adapter_dir, base, contract=base.contract(backend).fingerprint)


def adapter_hash(
    adapter_dir: str | Path, model_dir: str | Path | ModelDir, backend: str = "cpu"
) -> str:
    return read_adapter(adapter_dir, model_dir, backend).sha256


def load_into(
    model: LockstepGPT,
    adapter_dir: str | Path,
    model_dir: str | Path | ModelDir,
    backend: str = "cpu",
) -> str:
    """Attach the adapter in ``adapter_dir`` (bound to ``backend``'s lane) to ``model`` (fp32
    masters holding the bf16 values exactly); returns the adapter hash."""
    adapter = read_adapter(adapter_dir, model_dir, backend)
    ranks = {k: (int(a.shape[0]), adapter.alphas[k]) for k, (a, _, _) in adapter.modules.items()}
    AD.attach(model, adapter.rank, adapter.alpha, modules=ranks)
    seen = set()
    for s in AD.sites(model):
        key = s.hf_module + ".weight"
        if key not in adapter.modules:
            continue  # not adapted: this site runs the base weights only
        ad = s.linear.lora[s.part]
        a, b, scale = adapter.modules[key]
        tp = getattr(model, "tp", 1)
        if tp > 1:  # this rank's rows of a column-parallel site's B (A and row sites whole)
            a, b, scale = shard_lora(key, (a, b, scale), model.tp_rank, tp)
        if scale != ad.scale:
            raise AdapterError(f"{s.hf_module}: scale {scale} vs the lane's {ad.scale}")
        with torch.no_grad():
            ad.A.copy_(a.to(torch.float32))
            ad.B.copy_(b.to(torch.float32))
        seen.add(key)
    # load_adapter refused modules the lane lacks; under expert parallelism other ranks hold
    # the other experts' adapters
    held = {s.hf_module + ".weight" for s in AD.sites(model)}
    assert seen == {k for k in adapter.modules if ".mlp.experts." not in k or k in held}
    return adapter.sha256
