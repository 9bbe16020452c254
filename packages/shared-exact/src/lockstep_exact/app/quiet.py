"""Quiet by default: engine output goes to a log file, the command's progress to the terminal.

vLLM prints a few hundred warning lines per engine start, some of them from C++ and from
child processes, and megatron-core adds its own warnings; none of that goes through one
Python logger. So ``engine_output(log_path)`` redirects the process's file descriptors 1 and 2
into the log file for the duration of the engine work (children inherit them), and hands back
a ``Console`` that writes to a duplicate of the original stdout: the command's progress lines
still reach the terminal. With ``verbose=True`` the engine output is copied to the terminal
(the original stderr) as well as into the log.

Python's ``sys.stdout`` / ``sys.stderr`` are left in place (they write to fds 1 and 2, so
what goes through them lands in the log); they and C's stdio buffers are flushed at both
edges so nothing written before lands in the log, or after in the terminal, by mistake.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

__all__ = ["Console", "engine_output"]


def _flush_all() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):  # C stdio buffers (C++ iostreams share them)
        ctypes.CDLL(None).fflush(None)


def _fd_of(stream: TextIO) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return None


class Console:
    """Where the command's own lines go while engine output is redirected."""

    def __init__(self, stream: TextIO, log_path: Path):
        self.stream = stream
        self.log_path = log_path

    def say(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()


def _pump(read_fd: int, log: TextIO, terminal_fd: int) -> None:
    """Copy the pipe into the log and the terminal until every writer has closed it."""
    with os.fdopen(read_fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(65536):
            log.buffer.write(chunk)
            log.flush()
            with contextlib.suppress(OSError):
                os.write(terminal_fd, chunk)


@contextlib.contextmanager
def engine_output(log_path: str | os.PathLike[str], *, verbose: bool = False) -> Iterator[Console]:
    """Send fds 1 and 2 to ``log_path`` (written anew; its directory is created) while the
    block runs; yields the ``Console`` for progress lines. ``verbose`` also streams the
    engine output to the terminal."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    _flush_all()
    out_fd = _fd_of(sys.stdout)
    saved_out, saved_err = os.dup(1), os.dup(2)
    if out_fd in (1, 2):  # a real terminal / pipe: progress goes to a copy of the original fd 1
        console_stream: TextIO = open(  # noqa: SIM115 (closed below)
            os.dup(saved_out), "w", buffering=1, encoding="utf-8", errors="replace"
        )
        own_stream = True
    else:  # sys.stdout is not fd 1 (a test's capture): the redirect does not touch it
        console_stream, own_stream = sys.stdout, False
    log = open(log_path, "w", encoding="utf-8", errors="replace")  # noqa: SIM115
    pump: threading.Thread | None = None
    write_fd = None
    try:
        if verbose:
            read_fd, write_fd = os.pipe()
            pump = threading.Thread(target=_pump, args=(read_fd, log, saved_err), daemon=True)
            pump.start()
            os.dup2(write_fd, 1)
            os.dup2(write_fd, 2)
        else:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
        yield Console(console_stream, log_path)
    finally:
        _flush_all()
        os.dup2(saved_out, 1)
        os.dup2(saved_err, 2)
        if write_fd is not None:
            os.close(write_fd)
        if pump is not None:
            pump.join(timeout=10)  # a child still holding the pipe must not hang the command
        if pump is None or not pump.is_alive():  # else the pump still writes to these
            os.close(saved_err)
            log.close()
        os.close(saved_out)
        if own_stream:
            console_stream.close()
