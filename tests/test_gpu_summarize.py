"""``tools/gpu/summarize.py``: the chunked GPU suite's summaries merged into one, which passes
only when every chunk of the steps file is there, exited 0 and had no failure (run here on
summaries written by hand; no GPU needed)."""

from __future__ import annotations

import io
import json
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = {"torch": "2.11.0", "triton": "3.6.0", "vllm": "0.26.0", "megatron-core": "0.16.1"}


def _tool():
    from tool_support import load_tool

    return load_tool("tools/gpu/summarize.py")


def _chunk(folder: Path, name: str, passed=3, failed=0, skipped=0, exit=0, versions=None, bad=()):
    (folder / name).mkdir(parents=True)
    summary = {
        "exit": exit,
        "args": [f"tests/test_{name}.py"],
        "counts": {"passed": passed, "failed": failed, "error": 0, "skipped": skipped},
        "versions": versions or VERSIONS,
        "not_passed": [{"test": t, "state": "failed", "why": "boom", "s": 1.0} for t in bad],
        "seconds": 10.0,
    }
    (folder / name / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def steps(tmp_path):
    f = tmp_path / "two.steps"
    f.write_text("# a comment\na 100 bash tools/gpu/suite x\nb 100 bash tools/gpu/suite y\n")
    return f


def test_every_chunk_present_and_passing_is_ok(tmp_path, steps, capsys):
    run = tmp_path / "run"
    _chunk(run / "call1" / "steps", "a", passed=5)
    _chunk(run / "call2" / "steps", "b", passed=2, skipped=1)
    assert _tool().main([str(run), "--steps", str(steps), "--json", str(tmp_path / "s.json")]) == 0
    got = json.loads((tmp_path / "s.json").read_text())
    assert got["ok"] and got["missing"] == [] and got["versions_agree"]
    assert got["totals"] == {"passed": 7, "failed": 0, "error": 0, "skipped": 1}
    assert got["chunks"]["a"]["args"] == ["tests/test_a.py"]
    assert json.loads(capsys.readouterr().out) == got


def test_a_failing_chunk_a_missing_one_and_other_versions_are_named(tmp_path, steps):
    tool = _tool()
    run = tmp_path / "run"
    _chunk(run, "a", passed=4, failed=1, exit=1, bad=["tests/test_a.py::test_x"])
    got = tool.summarize(tool.chunks_in([run]), tool.step_names(steps))
    assert not got["ok"] and got["missing"] == ["b"]
    assert got["not_passed"][0]["chunk"] == "a"
    assert got["not_passed"][0]["test"] == "tests/test_a.py::test_x"
    # control on an input: the same chunk passing, and b present with other versions
    good = tmp_path / "good"
    _chunk(good, "a", passed=5)
    _chunk(good, "b", versions={**VERSIONS, "vllm": "0.32.0"})
    again = tool.summarize(tool.chunks_in([good]), tool.step_names(steps))
    assert again["ok"] and not again["versions_agree"]
    assert again["versions"]["vllm"] == ["0.26.0", "0.32.0"]
    assert tool.main([str(run), "--steps", str(steps)]) == 1


def test_a_chunk_found_twice_or_an_empty_run_is_not_ok(tmp_path, steps):
    tool = _tool()
    _chunk(tmp_path / "x", "a")
    _chunk(tmp_path / "y", "a")
    with pytest.raises(SystemExit, match="chunk 'a' twice"):
        tool.chunks_in([tmp_path / "x", tmp_path / "y"])
    (tmp_path / "empty").mkdir()
    assert not tool.summarize(tool.chunks_in([tmp_path / "empty"]), [])["ok"]


def _marks_gpu(path: Path) -> bool:
    """Whether the file's code (not its strings) names ``pytest.mark.gpu``."""
    names = [
        t.string
        for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        if t.type in (tokenize.NAME, tokenize.OP)
    ]
    return any(names[i : i + 5] == ["pytest", ".", "mark", ".", "gpu"] for i in range(len(names)))


def test_the_committed_suite_steps_name_the_chunks_summarize_expects():
    steps = ROOT / "tools/gpu/suite.steps"
    names = _tool().step_names(steps)
    assert names and len(names) == len(set(names))
    assert {"programs", "vllm", "training", "next", "sglang-dense", "sglang-cross"} <= set(names)
    # every file with GPU tests is in one of the calls, but the one that needs two GPUs
    text = steps.read_text()
    elsewhere = {"test_layout_gpu.py"}
    for path in sorted([*ROOT.glob("tests/test_*.py"), *ROOT.glob("packages/*/tests/test_*.py")]):
        marked = _marks_gpu(path)
        if marked and path.name not in elsewhere:
            assert str(path.relative_to(ROOT)) in text, f"{path.name} is in no call of {steps.name}"


def test_a_side_by_side_step_expects_each_of_its_selections(tmp_path):
    """A step running tools/gpu/side-by-side leaves one summary per selection, so those are
    the chunks a whole run must hold."""
    tool = _tool()
    f = tmp_path / "together.steps"
    f.write_text(
        "one 500 bash tools/gpu/side-by-side 'x tests/a.py' 'y tests/b.py -k \"not slow\"'\n"
        "two 500 bash tools/gpu/suite tests/c.py\n"
    )
    assert tool.step_names(f) == ["x", "y", "two"]
    run = tmp_path / "run"
    _chunk(run, "x")
    _chunk(run, "two")
    assert tool.summarize(tool.chunks_in([run]), tool.step_names(f))["missing"] == ["y"]
