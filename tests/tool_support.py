"""Loading a script of ``tools/`` as a module (tests import this): the tools are scripts, not
packages, so a test reaches their functions through the file."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_tool(relpath: str) -> ModuleType:
    """The script ``ROOT/relpath`` as a fresh module; its own folder is on ``sys.path`` while
    it loads (a bench imports its sibling benches), and only then."""
    path = ROOT / relpath
    folder = str(path.parent)
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module
