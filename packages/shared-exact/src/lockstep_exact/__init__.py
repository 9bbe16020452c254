"""Lockstep byte programs, contracts, hooks, traces and the lockstep CLI."""

__version__ = "0.1.0"

from .hookspecs import hookimpl  # noqa: E402

__all__ = ["__version__", "hookimpl"]
