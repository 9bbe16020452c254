"""Op-site recording: what ``lockstep bisect`` compares between the two halves.

The lane composition calls ``record(name, tensor)`` after every op site. It costs nothing
unless a ``recording()`` block is active; then each site's output is kept, in execution
order, under a path such as ``layers.1.moe.experts.3.down_proj``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

_active: ContextVar[dict[str, torch.Tensor] | None] = ContextVar("lockstep_sites", default=None)


@contextmanager
def recording() -> Iterator[dict[str, torch.Tensor]]:
    sites: dict[str, torch.Tensor] = {}
    token = _active.set(sites)
    try:
        yield sites
    finally:
        _active.reset(token)


def record(name: str, tensor: torch.Tensor) -> torch.Tensor:
    sites = _active.get()
    if sites is not None:
        sites[name] = tensor.detach().to("cpu", copy=True)
    return tensor


def is_recording() -> bool:
    return _active.get() is not None


@contextmanager
def paused() -> Iterator[None]:
    """Record nothing inside (a computation whose sites were already recorded elsewhere)."""
    token = _active.set(None)
    try:
        yield
    finally:
        _active.reset(token)
