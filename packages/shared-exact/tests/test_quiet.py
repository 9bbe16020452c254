"""Quiet by default: engine output (Python, C stdio, child processes) goes to the log; the
command's own lines reach the terminal; --verbose copies the engine output there too."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import ctypes, os, subprocess, sys, warnings
from lockstep_exact.app.quiet import engine_output

print("before", flush=True)
with engine_output(sys.argv[1], verbose=sys.argv[2] == "1") as console:
    console.say("progress line")
    print("engine python stdout")
    print("engine python stderr", file=sys.stderr)
    warnings.warn("engine warning")
    os.write(1, b"engine fd1\n")
    os.write(2, b"engine fd2\n")
    ctypes.CDLL(None).printf(b"engine C stdio\n")
    subprocess.run([sys.executable, "-c", "print('engine child')"], check=True)
print("after", flush=True)
"""

ENGINE_LINES = (
    "engine python stdout",
    "engine python stderr",
    "engine warning",
    "engine fd1",
    "engine fd2",
    "engine C stdio",
    "engine child",
)


def _run(tmp_path, verbose: bool):
    log = tmp_path / "out" / "engine.log"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(log), "1" if verbose else "0"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return done.stdout, done.stderr, log.read_text()


def test_engine_output_goes_to_the_log_and_progress_to_the_terminal(tmp_path):
    out, err, log = _run(tmp_path, verbose=False)
    assert out.splitlines() == ["before", "progress line", "after"]
    assert err == ""
    for line in ENGINE_LINES:
        assert line in log, line
    assert "progress line" not in log and "before" not in log and "after" not in log


def test_verbose_streams_the_engine_output_to_the_terminal_as_well(tmp_path):
    out, err, log = _run(tmp_path, verbose=True)
    assert out.splitlines() == ["before", "progress line", "after"]
    for line in ENGINE_LINES:
        assert line in log, line
        assert line in err, line  # the copy goes to the original stderr
