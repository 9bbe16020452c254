"""The serving plugin's exception, raised by both engine rooms."""

from __future__ import annotations


class LaneRefused(RuntimeError):
    """The exact lane cannot run here as configured; nothing falls back to a non-exact path."""


def _refuse(msg: str):
    raise LaneRefused(f"Lockstep exact lane refused to start: {msg}")
