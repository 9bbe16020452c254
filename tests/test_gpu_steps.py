"""``tools/gpu/steps``: the GPU machine's step runner keeps each step's output, status and files
in one archive, after every step, and runs only the steps asked for (run here with bash; no
GPU is needed to run steps that need none)."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path, text, **env):
    tmp_path.mkdir(parents=True, exist_ok=True)
    steps = tmp_path / "s.steps"
    steps.write_text(text)
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(ROOT / "tools/gpu/steps"), str(steps)],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "OUT": str(out), **env},
        timeout=60,
    )
    return done, out


def test_each_step_leaves_its_log_status_and_files_in_the_archive(tmp_path):
    done, out = _run(
        tmp_path,
        "# a comment\n\n"
        'first 20 echo hello; echo data > "$STEPS_DIR/first.json"\n'
        "fails 20 echo about to fail; exit 3\n"
        "broken\n"
        "slow 1 sleep 30\n"
        "last 20 pwd\n",
    )
    assert done.returncode == 124  # the last failing step's status: a time limit
    assert "'broken': a step is NAME SECONDS COMMAND" in done.stderr
    rows = [line.split("\t") for line in (out / "steps/summary.tsv").read_text().splitlines()]
    assert [(name, rc) for name, rc, _ in rows] == [
        ("first", "0"), ("fails", "3"), ("slow", "124"), ("last", "0")
    ]  # fmt: skip
    with tarfile.open(out / "steps.tgz") as tar:
        names = set(tar.getnames())
        assert {"steps/first.log", "steps/first.json", "steps/fails.log", "steps/last.log"} <= names
        log = tar.extractfile("steps/last.log").read().decode().strip()
    assert log == str(ROOT)  # every step runs from the repository root
    assert (out / "steps/fails.log").read_text() == "about to fail\n"


def test_steps_runs_only_the_named_steps_and_refuses_a_missing_file(tmp_path):
    done, out = _run(tmp_path, "a 20 true\nb 20 exit 5\nc 20 true\n", STEPS="a,c")
    assert done.returncode == 0
    names = [line.split("\t")[0] for line in (out / "steps/summary.tsv").read_text().splitlines()]
    assert names == ["a", "c"]
    # control: without the filter, step b runs and its status is the exit status
    done, _ = _run(tmp_path / "all", "a 20 true\nb 20 exit 5\nc 20 true\n")
    assert done.returncode == 5
    missing = subprocess.run(
        ["bash", str(ROOT / "tools/gpu/steps"), str(tmp_path / "nothing.steps")],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "no steps file" in missing.stderr


def test_the_committed_steps_files_name_steps_and_files_that_exist():
    """Every step of tools/gpu/*.steps and tools/bench/*.steps is NAME SECONDS COMMAND, its
    name is unique, and every repository path it names exists (a renamed test file would
    otherwise surface only on the GPU machine)."""
    files = sorted(ROOT.glob("tools/gpu/*.steps")) + sorted(ROOT.glob("tools/bench/*.steps"))
    assert files
    for f in files:
        names = []
        for line in f.read_text().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            name, secs, cmd = line.split(maxsplit=2)
            assert secs.isdigit() and int(secs) <= 600, (f.name, line)
            names.append(name)
            for word in cmd.split():
                word = word.strip("'\"")  # quoted arguments (a side-by-side selection's)
                if word.startswith(("tests/", "packages/", "tools/")):
                    assert (ROOT / word).exists(), (f.name, word)
        assert len(names) == len(set(names)), (f.name, names)
