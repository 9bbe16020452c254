"""Finding plugins: the pluggy manager over the entry-point group ``lockstep``."""

from __future__ import annotations

import pluggy

from . import hookspecs


class MissingHalf(RuntimeError):
    """No installed plugin answers a hook the job needs."""


def manager(load_entry_points: bool = True) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if load_entry_points:
        pm.load_setuptools_entrypoints(hookspecs.PROJECT)
    return pm


def require_hook(pm: pluggy.PluginManager, name: str, half: str, package: str):
    """The hook caller for ``name``, or MissingHalf naming what to install."""
    caller = getattr(pm.hook, name)
    if not caller.get_hookimpls():
        raise MissingHalf(
            f"no installed plugin provides the {half} half ({name}); install {package}"
        )
    return caller
