"""tools/setup on a machine without torch's CPU wheel stops at once, naming the wheel and where
to get it; given a folder that holds it (LOCKSTEP_WHEELS) it links it where uv.lock looks."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _tree(tmp_path: Path) -> Path:
    """A copy of what tools/setup reads before it syncs: the script and the lock."""
    root = tmp_path / "repo"
    (root / "tools").mkdir(parents=True)
    shutil.copy(REPO / "tools" / "setup", root / "tools" / "setup")
    shutil.copy(REPO / "uv.lock", root / "uv.lock")
    return root


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LOCKSTEP_WHEELS"}
    env["PIP_CONFIG_FILE"] = os.devnull  # no configured wheel folder
    env.update(extra)
    return env


def test_uv_lock_names_torch_in_the_repositorys_wheel_folder_and_no_machine_path():
    lock = (REPO / "uv.lock").read_text()
    assert 'source = { registry = ".wheels" }' in lock
    assert "/opt/" not in lock and "file:///" not in lock


def test_setup_without_the_cpu_torch_wheel_stops_naming_it(tmp_path):
    root = _tree(tmp_path)
    run = subprocess.run(
        ["bash", "tools/setup"], cwd=root, env=_env(), capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2
    assert "tools/setup: this environment needs torch-2.13.0+cpu-cp311" in run.stderr
    assert "https://download.pytorch.org/whl/cpu/torch/" in run.stderr
    assert not (root / ".venv").exists()


def test_setup_links_the_wheel_from_the_folder_it_is_given(tmp_path):
    root = _tree(tmp_path)
    wheel = next(
        line.split('"')[1]
        for line in (REPO / "uv.lock").read_text().splitlines()
        if '{ path = "torch-' in line
    )
    folder = tmp_path / "wheels"
    folder.mkdir()
    (folder / wheel).write_bytes(b"stand-in")
    # `uv` is replaced by a stub that records its arguments: only the linking is under test.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "uv").write_text('#!/bin/sh\necho "uv $*" >> "$UV_CALLS"\n')
    (bin_dir / "uv").chmod(0o755)
    env = _env(LOCKSTEP_WHEELS=str(folder), PATH=f"{bin_dir}:{os.environ['PATH']}")
    env["UV_CALLS"] = str(tmp_path / "calls")
    run = subprocess.run(
        ["bash", "tools/setup"], cwd=root, env=env, capture_output=True, text=True, timeout=60
    )
    # It stops after syncing, at tools/wheel_tags.py, which this copy does not have.
    assert (root / ".wheels" / wheel).read_bytes() == b"stand-in", run.stderr
    assert (tmp_path / "calls").read_text().splitlines() == ["uv sync --frozen"]
