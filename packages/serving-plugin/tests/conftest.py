"""Fixtures for the serving tests (the environment is set by ``serving_support``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from serving_support import _ROOT, FAMILIES

from lockstep_exact.app.tiny import make_tiny


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    return {arch: make_tiny(_ROOT / "models" / arch, arch=arch) for arch in FAMILIES}
