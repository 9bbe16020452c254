"""Release pinning: a plugin runs only beside the lockstep-exact it was released against."""

from __future__ import annotations

from . import __version__


class VersionSkew(RuntimeError):
    """The installed lockstep-exact is not the one a plugin was released against."""


def require_exact(plugin: str, plugin_version: str, released_against: str) -> None:
    """Refuse to start a plugin beside another lockstep-exact: its programs could differ."""
    if __version__ != released_against:
        raise VersionSkew(
            f"{plugin} {plugin_version} was released against lockstep-exact "
            f"{released_against}, but lockstep-exact {__version__} is installed; install "
            f"lockstep-exact=={released_against} (or the {plugin} release made for "
            f"{__version__})"
        )


def skew_problem(plugin: str, plugin_version: str, released_against: str) -> str | None:
    """``require_exact``'s refusal as a sentence for ``lockstep doctor``, or None."""
    try:
        require_exact(plugin, plugin_version, released_against)
    except VersionSkew as err:
        return str(err)
    return None
