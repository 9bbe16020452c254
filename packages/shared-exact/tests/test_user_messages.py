"""User-visible text names no internal issue numbers (users never saw the tracker), and the
refusals that used to cite one say what is wrong and what to do instead."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lockstep_exact.app.tiny import make_tiny, tiny_config
from lockstep_exact.lanes.config import UnsupportedModel, check_config

ROOT = Path(__file__).resolve().parents[3]
ISSUE = re.compile(r"\bissues? #?\d+", re.IGNORECASE)


def test_no_source_text_cites_an_issue_number():
    hits = []
    for src in sorted(ROOT.glob("packages/*/src/**/*.py")):
        for n, line in enumerate(src.read_text().splitlines(), 1):
            if ISSUE.search(line):
                hits.append(f"{src.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_a_qwen3_next_model_where_it_is_not_taken_says_what_to_do(tmp_path):
    from lockstep_exact.model import ModelDir

    model = make_tiny(tmp_path / "m", arch="qwen3-next")
    with pytest.raises(UnsupportedModel) as err:
        ModelDir(model)
    msg = str(err.value)
    assert not ISSUE.search(msg)
    assert "use a Qwen3 or Qwen3-MoE model here" in msg
    assert "lockstep capture, replay, qualify and train take it" in msg


def test_check_config_sends_qwen3_next_to_the_hybrid_reader():
    with pytest.raises(UnsupportedModel) as err:
        check_config(tiny_config("qwen3-next"))
    msg = str(err.value)
    assert not ISSUE.search(msg)
    assert "ModelDir(path, hybrid=True)" in msg
