"""`lockstep doctor` as a user runs it: quiet by default (what importing the engines prints,
vLLM's logger, megatron-core's and torch's warnings, goes to the engine log; the terminal gets
the report and the log's name), `--verbose` streams that output to the terminal as well. Both
run as subprocesses; no engine starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cli_support import finish_cli, start_cli

pytestmark = pytest.mark.slow  # two CLI processes that import vLLM and megatron-core

# A line of vLLM's logger ("INFO 12-04 17:10:01 [file.py:12] ...", any level), megatron-core's
# warnings.warn, torch's glog-style warning ("W1204 17:07:37.363000 123 torch/...").
ENGINE = re.compile(
    r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d |UserWarning|warnings\.warn|^[WIE]\d{4} "
)
# vLLM's logger at its loudest: none of it may reach the terminal of a quiet run
LOUDEST = {"VLLM_LOGGING_LEVEL": "DEBUG"}
REPORT = ("lockstep-exact ", "backends ", "plugin ", "missing ", "contract ", "refused ")


def _engine_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if ENGINE.search(line)]


def test_doctor_is_quiet_by_default_and_verbose_streams_the_engines(tmp_path):
    here = tmp_path / "here"
    here.mkdir()
    quiet = start_cli("doctor", cwd=here, env=LOUDEST)
    loud = start_cli(
        "doctor", "--verbose", "--log", str(tmp_path / "loud.log"), cwd=tmp_path, env=LOUDEST
    )

    out, err = finish_cli(quiet)
    lines = out.splitlines()
    assert err == ""
    assert not _engine_lines(out)
    assert all(line.startswith(REPORT) for line in lines[:-1]), out
    assert sum(line.startswith("contract ") for line in lines) == 2
    assert lines[-1].startswith("engine log: ")
    log = Path(lines[-1].removeprefix("engine log: "))
    assert log.name.startswith("lockstep-doctor-") and log.suffix == ".log"
    engine = _engine_lines(log.read_text())
    assert engine  # the import-time warnings are there, not on the terminal
    log.unlink()
    assert list(here.iterdir()) == []  # a quiet doctor writes nothing where it runs

    out, err = finish_cli(loud)
    assert out.splitlines()[:-1] == lines[:-1]  # the same report
    assert out.splitlines()[-1] == f"engine log: {tmp_path / 'loud.log'}"
    loud_engine = _engine_lines((tmp_path / "loud.log").read_text())
    assert loud_engine
    assert _engine_lines(err) == loud_engine  # the same engine lines, on the terminal too
