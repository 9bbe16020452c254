"""First-divergence search: which op site's bytes part first between the two halves."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..parity import raw_bits, ulp_distance
from ..plugins import require_hook
from ..requests import DumpRequest
from ..trace import Trace


@dataclass(frozen=True)
class SiteDivergence:
    site: str
    elements: int
    differing: int
    max_ulp: int
    first_index: tuple[int, ...]
    sampler_value: float
    trainer_value: float

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return (
            f"first differing op site: {self.site} ({self.differing}/{self.elements} "
            f"elements differ, max {self.max_ulp} ulp; at {list(self.first_index)}: "
            f"sampler {self.sampler_value!r} vs trainer {self.trainer_value!r})"
        )


def first_divergence(
    sampler: dict[str, torch.Tensor], trainer: dict[str, torch.Tensor]
) -> tuple[SiteDivergence | None, list[str]]:
    """Walk the sampler's sites in execution order; return the first whose bytes differ.

    Also returns the sites present on one side only (a structural difference is reported,
    never skipped silently).
    """
    missing = [s for s in sampler if s not in trainer] + [s for s in trainer if s not in sampler]
    for site, a in sampler.items():
        b = trainer.get(site)
        if b is None:
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return SiteDivergence(
                site, a.numel(), a.numel(), -1, (), float("nan"), float("nan")
            ), missing
        diff = raw_bits(a) != raw_bits(b)
        if bool(diff.any()):
            idx = tuple(int(i) for i in diff.nonzero()[0])
            ulp = ulp_distance(a, b) if a.is_floating_point() else -1
            return SiteDivergence(
                site, a.numel(), int(diff.sum()), ulp, idx, float(a[idx]), float(b[idx])
            ), missing
    return None, missing


def decision_tokens(trace, index: int) -> tuple[tuple[int, ...], int]:
    """The token ids the model sees to score decision ``index``, and the scored position."""
    for i, d in enumerate(trace.decisions()):
        if i == index:
            prompt = trace.prompt(d.seq_index).tolist()
            sampled = trace.sampled(d.seq_index).tolist()
            context = prompt + sampled[: d.step]
            return tuple(context), len(context) - 1
    raise ValueError(
        f"the trace has {trace.num_decisions} decisions; no decision {index} "
        f"(choose --decision from 0 to {trace.num_decisions - 1})"
    )


def bisect(
    pm,
    trace_dir: Path,
    index: int,
    model_dir: Path,
    adapter_dir: Path | None = None,
    *,
    sampler_model: Path | None = None,
):
    """Ask both halves for every op site's output on decision ``index`` and compare them.

    ``sampler_model`` (default ``model_dir``) lets the sampler half read its own copy of the
    model, as when a serving fleet's copy is suspected to differ from the trainer's.
    """
    trace = Trace.load(trace_dir)
    tokens, position = decision_tokens(trace, index)
    hook = require_hook(pm, "lockstep_dump_sites", "sampler and trainer", "both plugins")
    dumps = {}
    for role in ("sampler", "trainer"):
        model = Path(sampler_model or model_dir) if role == "sampler" else Path(model_dir)
        req = DumpRequest(
            role=role,
            model_dir=model,
            tokens=tokens,
            position=position,
            adapter_dir=Path(adapter_dir) if adapter_dir else None,
        )
        dumps[role] = hook(request=req)
        if dumps[role] is None:
            raise RuntimeError(f"no installed plugin dumps op sites for the {role} half")
    return first_divergence(dumps["sampler"], dumps["trainer"])
