"""The lockstep-exact release this plugin was built against (tools/release.py writes it)."""

from __future__ import annotations

from lockstep_exact import release

from . import __version__

EXACT_VERSION = "0.1.0"


def check() -> None:
    """Refuse to run beside any other lockstep-exact: its programs could differ."""
    release.require_exact("lockstep-serving", __version__, EXACT_VERSION)


def problem() -> str | None:
    return release.skew_problem("lockstep-serving", __version__, EXACT_VERSION)
