"""The lockstep-exact release this plugin was built against (tools/release.py writes it)."""

from __future__ import annotations

EXACT_VERSION = "0.1.0"


def check() -> None:
    """Refuse to run beside any other lockstep-exact: its programs could differ."""
    from lockstep_exact.release import require_exact

    from . import __version__

    require_exact("lockstep-serving", __version__, EXACT_VERSION)


def problem() -> str | None:
    from lockstep_exact.release import VersionSkew

    try:
        check()
    except VersionSkew as err:
        return str(err)
    return None
