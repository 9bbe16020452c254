"""`lockstep capture` as a user runs it: quiet by default (vLLM's output goes to the engine
log beside the trace, the terminal gets the progress and the result), `--verbose` streams the
engine output to the terminal as well."""

from __future__ import annotations

import subprocess

import pytest
from cli_support import finish_cli, start_cli

from lockstep_exact.app.tiny import make_tiny

pytestmark = [pytest.mark.engine, pytest.mark.slow]


def _start(model, out, *extra) -> subprocess.Popen:
    return start_cli(
        "capture", "--model", str(model), "--decisions", "2", "--out", str(out), *extra
    )


def _engine_lines(text: str) -> list[str]:
    """Lines only an engine prints: vLLM's log lines (with their pid tag) and torch's."""
    return [line for line in text.splitlines() if "WARNING" in line or "pid=" in line]


def test_capture_is_quiet_by_default_and_verbose_streams_the_engine(tmp_path):
    model = make_tiny(tmp_path / "m", arch="qwen3", hidden=64, vocab=512)

    # both captures at once (one engine thread each): the two engine starts overlap
    quiet = _start(model, tmp_path / "quiet")
    loud = _start(model, tmp_path / "loud", "--verbose")
    out, err = finish_cli(quiet)
    log = tmp_path / "quiet.log"
    assert out.splitlines() == [
        "capturing 2 decisions per prompt from 8 prompts",
        f"captured 16 decisions from 8 prompts -> {tmp_path / 'quiet'}",
        f"engine log: {log}",
    ]
    assert err == ""
    assert len(_engine_lines(log.read_text())) >= 3  # vLLM's start-up warnings are there

    out, err = finish_cli(loud)
    log = tmp_path / "loud.log"
    assert out.splitlines()[-1] == f"engine log: {log}"
    engine = _engine_lines(log.read_text())
    assert len(engine) >= 3
    assert _engine_lines(err) == engine  # the same engine lines, on the terminal too
