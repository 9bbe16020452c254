"""Adapters made by the ``peft`` library itself, on the tiny models (tests only).

``peft_adapter`` builds the transformers model of a model directory's config, wraps it with
``get_peft_model(LoraConfig(...))``, gives every factor seeded random values (a fresh PEFT
adapter has B = 0, which would test nothing), casts it to bf16 and saves it with
``save_pretrained``: what a user's fine-tuning run hands over.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


def peft_model(model_dir, *, seed: int = 0, std: float = 0.05, **lora):
    """The PEFT-wrapped transformers model (bf16) with seeded nonzero factors (the calling
    test is skipped where ``peft`` is not installed)."""
    pytest.importorskip("peft")
    import transformers
    from peft import LoraConfig, get_peft_model

    config = transformers.AutoConfig.from_pretrained(str(model_dir))
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_config(config)
    model = get_peft_model(base, LoraConfig(**lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    return model.to(torch.bfloat16)


def peft_adapter(model_dir, out_dir, *, seed: int = 0, std: float = 0.05, **lora) -> Path:
    """Save a PEFT adapter for ``model_dir`` at ``out_dir`` (``lora``: LoraConfig fields)."""
    peft_model(model_dir, seed=seed, std=std, **lora).save_pretrained(str(out_dir))
    return Path(out_dir)
