"""Every command in the README is run by a test, and every path it links to exists.

Each command line of the README's fenced ``bash`` blocks is either run here (``RUN_HERE``: fast
ones, on a tiny model and with ``--print`` for the server) or mapped to the test that runs it
(``RUNNERS``: the test's node id and a piece of that test file's source that shows it runs the
command, through the CLI's ``main([...])`` or a subprocess). A README command with neither, a
table entry the README no longer has, or a runner that was renamed or moved fails here.
"""

from __future__ import annotations

import ast
import re
import shlex
from importlib.metadata import entry_points
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

# Commands this file runs (the test named beside each).
RUN_HERE = {
    "uv run lockstep tiny --arch qwen3 --out /tmp/m": "test_the_tiny_model_and_its_contract",
    "uv run lockstep contract show --model /tmp/m": "test_the_tiny_model_and_its_contract",
    "uv run lockstep serve --model DIR --backend cpu --print": (
        "test_the_serve_commands_print_vllms_server_on_the_lane"
    ),
    "uv run lockstep serve --model DIR --backend cpu -- --port 8000": (
        "test_the_serve_commands_print_vllms_server_on_the_lane"
    ),
}

ENGINE_RUNNER = "tests/test_readme.py::test_the_readmes_engine_commands_run_as_written"

# Commands run elsewhere: command -> (test node id, text the runner's file must contain).
RUNNERS = {
    "bash tools/setup": (
        "tests/test_setup.py::test_setup_links_the_wheel_from_the_folder_it_is_given",
        '["bash", "tools/setup"]',
    ),
    "uv run lockstep qualify": (
        "tests/test_qualify.py::test_the_ladder_qualifies_the_default_tiny_moe",
        'main(["qualify", "--out", str(tmp_path)])',
    ),
    "bash tools/check": (
        "tests/test_readme.py::test_tools_check_lints_then_runs_pytest",
        '"tools/check"',
    ),
    "uv run lockstep doctor": (
        "tests/test_doctor_quiet.py::test_doctor_is_quiet_by_default_and_verbose_streams_the_engines",
        'start_cli("doctor"',
    ),
    "uv run lockstep capture --model /tmp/m --decisions 8 --out /tmp/trace": (
        ENGINE_RUNNER,
        "def test_the_readmes_engine_commands_run_as_written",
    ),
    "uv run lockstep replay --model /tmp/m --trace /tmp/trace": (
        ENGINE_RUNNER,
        "def test_the_readmes_engine_commands_run_as_written",
    ),
    "uv run lockstep bisect --model /tmp/m --trace /tmp/trace --decision 0": (
        ENGINE_RUNNER,
        "def test_the_readmes_engine_commands_run_as_written",
    ),
    "uv run lockstep train --model /tmp/m --steps 10 --out /tmp/run": (
        ENGINE_RUNNER,
        "def test_the_readmes_engine_commands_run_as_written",
    ),
    "uv run lockstep serve --model DIR --backend cpu -- --port 8000": (
        "packages/serving-plugin/tests/test_openai_server.py::"
        "test_a_served_completion_has_the_logprobs_of_the_offline_capture",
        '"serve",',
    ),
    "uv run lockstep verify --model DIR --rollouts responses.jsonl": (
        "packages/serving-plugin/tests/test_openai_server.py::"
        "test_served_responses_verify_byte_for_byte_in_megatron",
        'main(["verify", "--model"',
    ),
    "uv run python examples/megatron_train_step.py --model /tmp/m --steps 2 --backend cpu "
    "--dump-rollouts /tmp/rollouts.jsonl --adapter-out /tmp/adapter": (
        "tests/test_integration_example.py::"
        "test_train_step_example_then_its_rollouts_check_byte_equal",
        '"megatron_train_step.py",',
    ),
    "uv run python examples/check_rollout.py --model /tmp/m --adapter /tmp/adapter "
    "--rollouts /tmp/rollouts.jsonl": (
        "tests/test_integration_example.py::"
        "test_train_step_example_then_its_rollouts_check_byte_equal",
        'check(["--model", str(dense), "--rollouts", str(rollouts), "--adapter", str(adapter)])',
    ),
}

# The engine commands, in the order the README gives them (each needs the one before).
ENGINE_ORDER = [c for c in RUNNERS if RUNNERS[c][0] == ENGINE_RUNNER]


def readme_commands(text: str | None = None) -> list[str]:
    """The command lines of the README's ```bash blocks, comments and spacing dropped."""
    text = README.read_text() if text is None else text
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(" ".join(words))
    return commands


def lockstep_main():
    """The function the ``lockstep`` console script runs (wherever the CLI module lives)."""
    (script,) = entry_points(group="console_scripts", name="lockstep")
    return script.load()


def substitute(command: str, tmp: Path, model: Path) -> list[str]:
    """The command's words after ``uv run``, with ``/tmp/...`` under ``tmp`` and ``DIR`` the
    model."""
    words = command.split()
    assert words[:2] == ["uv", "run"], command
    out = []
    for w in words[2:]:
        if w == "DIR":
            w = str(model)
        elif w.startswith("/tmp/"):
            w = str(tmp / w.removeprefix("/tmp/"))
        out.append(w)
    return out


# ----------------------------------------------------------------------------- the table


def test_the_readme_has_bash_commands_and_the_parser_reads_them():
    sample = "x\n```bash\nbash a.sh   # note\n\nuv run b --c 'd e'\n```\n```text\nnot me\n```\n"
    assert readme_commands(sample) == ["bash a.sh", "uv run b --c d e"]
    commands = readme_commands()
    assert commands[:3] == ["bash tools/setup", "uv run lockstep qualify", "bash tools/check"]


def test_every_readme_command_is_run_here_or_has_a_runner():
    commands = readme_commands()
    missing = [c for c in commands if c not in RUN_HERE and c not in RUNNERS]
    assert not missing, f"README commands no test runs (add to RUN_HERE or RUNNERS): {missing}"
    stale = [c for c in [*RUN_HERE, *RUNNERS] if c not in commands]
    assert not stale, f"commands in this test's tables that the README no longer has: {stale}"


def _top_level_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


@pytest.mark.parametrize("command", sorted(RUNNERS))
def test_every_runner_exists_and_runs_its_command(command):
    node, evidence = RUNNERS[command]
    file, name = node.split("::")
    path = ROOT / file
    assert path.is_file(), f"{command!r}: runner file {file} is missing"
    assert name.startswith("test_") and name in _top_level_functions(path), (
        f"{command!r}: no test function {name} in {file}"
    )
    assert evidence in path.read_text(), f"{command!r}: {file} no longer contains {evidence!r}"


def test_every_test_named_in_run_here_exists():
    here = _top_level_functions(Path(__file__))
    assert set(RUN_HERE.values()) <= here


# ----------------------------------------------------------------------------- links


def test_every_relative_link_and_repository_path_in_the_readme_exists():
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links, "the README links its docs"
    paths = [link.split("#")[0] for link in links if "://" not in link and link[0] != "#"]
    # Paths in backquotes that name files of this repository.
    paths += [
        p.rstrip("/")
        for p in re.findall(r"`([^`\s]+)`", text)
        if re.match(r"(docs|tests|packages|examples|tools|\.ci)/", p)
    ]
    missing = sorted({p for p in paths if not (ROOT / p).exists()})
    assert not missing, f"README paths that do not exist: {missing}"


# ----------------------------------------------------------------------------- run here


def test_the_tiny_model_and_its_contract(tmp_path, capsys):
    main = lockstep_main()
    tiny, show = (
        c for c in RUN_HERE if c.startswith(("uv run lockstep tiny", "uv run lockstep contract"))
    )
    assert main(substitute(tiny, tmp_path, tmp_path / "m")[1:]) == 0
    assert (tmp_path / "m" / "config.json").is_file()
    capsys.readouterr()
    assert main(substitute(show, tmp_path, tmp_path / "m")[1:]) == 0
    out = capsys.readouterr().out
    assert "sha256:" in out and "qwen3" in out, out


def test_the_serve_commands_print_vllms_server_on_the_lane(tmp_path, capsys):
    from lockstep_exact.app.tiny import make_tiny

    model = make_tiny(tmp_path / "m", arch="qwen3", hidden=64, vocab=512)
    for command in (c for c in RUN_HERE if c.startswith("uv run lockstep serve")):
        words = substitute(command, tmp_path, model)
        assert words[:2] == ["lockstep", "serve"], command
        args = words[1:]
        if "--print" not in args:  # a command that starts the server: print it instead
            cut = args.index("--") if "--" in args else len(args)
            args = [*args[:cut], "--print", *args[cut:]]
        from lockstep_exact.app.cli import main

        assert main(args) == 0, capsys.readouterr().err
        out = shlex.split(capsys.readouterr().out)
        assert out[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
        assert "--hf-overrides" in out and "--enforce-eager" in out
        tail = args[args.index("--") + 1 :] if "--" in args else []
        assert out[len(out) - len(tail) :] == tail  # vLLM's own flags go through, last


# ----------------------------------------------------------------------------- run elsewhere


def test_tools_check_lints_then_runs_pytest(tmp_path):
    """``bash tools/check``: ruff, the format check, the import contracts, then pytest; here
    with pytest only collecting this file (the whole tier is what CI and users run)."""
    import subprocess

    run = subprocess.run(
        ["bash", "tools/check", "--collect-only", "-q", "tests/test_readme.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "All checks passed!" in run.stdout  # ruff check
    assert "tests/test_readme.py::test_tools_check_lints_then_runs_pytest" in run.stdout


@pytest.mark.slow
@pytest.mark.engine
def test_the_readmes_engine_commands_run_as_written(tmp_path, capsys):
    """capture, replay, bisect, then train, as the README writes them, on its tiny model."""
    main = lockstep_main()
    tiny = next(c for c in RUN_HERE if c.startswith("uv run lockstep tiny"))
    assert main(substitute(tiny, tmp_path, tmp_path / "m")[1:]) == 0
    assert [c.split()[3] for c in ENGINE_ORDER] == ["capture", "replay", "bisect", "train"]
    for command in ENGINE_ORDER:
        capsys.readouterr()
        rc = main(substitute(command, tmp_path, tmp_path / "m")[1:])
        out, err = capsys.readouterr()
        assert rc == 0, f"{command}: {err[-3000:]}"
        if " replay " in f" {command} ":
            assert "EXACT: 64/64 decisions byte-equal" in out, out
        if " train " in f" {command} ":
            assert "every decision byte-equal: True" in out, out
