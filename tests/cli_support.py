"""Running the `lockstep` CLI as a user does, in a child process (tests import this)."""

from __future__ import annotations

import os
import subprocess
import sys


def start_cli(*args: str, cwd=None, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m lockstep_exact.app.cli ARGS`` with one torch thread (and ``env`` added), its
    output captured; several may run at once (``finish_cli`` each)."""
    full = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "lockstep_exact.app.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full,
        cwd=cwd,
    )


def finish_cli(child: subprocess.Popen, timeout: float = 600) -> tuple[str, str]:
    """(stdout, stderr) of a child that must exit 0 within ``timeout`` seconds."""
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
    assert child.returncode == 0, err[-4000:]
    return out, err
