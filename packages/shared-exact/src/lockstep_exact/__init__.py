"""Lockstep byte programs, contracts, hooks, traces and the lockstep CLI."""

__version__ = "0.1.0"
