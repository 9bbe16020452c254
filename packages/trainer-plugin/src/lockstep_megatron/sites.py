"""Op-site dumps for ``lockstep bisect``: every site's output, under the lane's names.

The exact submodules record through ``lockstep_exact.sites.record`` under the names the lane
composition uses (``layers.0.self_attn.q_proj``, ``layers.1.mlp.experts.3.act``, ...), with
the composition's shapes ([T, ...] for the one sequence), so ``bisect.first_divergence``
compares the two halves site by site.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lockstep_exact.model import ModelDir
from lockstep_exact.sites import recording

from . import export
from .convert import build


def dump_sites(
    model_dir: Path, tokens: torch.Tensor, position: int, adapter_dir: Path | None = None
) -> dict[str, torch.Tensor]:
    base = ModelDir(model_dir, hybrid=True)  # a Qwen3-Next model dumps its sites too (gdn/)
    model = build(base.path).eval()
    if adapter_dir is not None:
        export.load_into(model, adapter_dir, base)
    with recording() as sites, torch.no_grad():
        model(tokens[None, : position + 1])
    return dict(sites)
