"""The lockstep CLI: tiny, contract show, and refusals that name what is missing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lockstep_exact.app.cli import main
from lockstep_exact.app.qualify import Ladder
from lockstep_exact.plugins import MissingHalf, manager

# Run in a fresh interpreter: this test process has torch imported long before.
_HELP_WITHOUT_TORCH = textwrap.dedent(
    """
    import contextlib, io, sys
    import lockstep_exact.app.cli as c

    c.build_parser().parse_args(["serve", "--model", "m", "--print", "--backend", "cpu"])
    commands = [[], ["contract", "show"], *([n] for n in (*c.QUIET_COMMANDS, "tiny", "serve"))]
    for argv in commands:
        with contextlib.redirect_stdout(io.StringIO()) as out:
            try:
                c.main([*argv, "--help"])
            except SystemExit as stop:
                assert stop.code == 0, (argv, stop.code)
        assert "usage: lockstep" in out.getvalue(), argv
    assert "torch" not in sys.modules, "parsing or --help imported torch"
    print("ok")
    """
)


def test_parsing_and_help_import_no_torch():
    """``lockstep --help`` (and every command's) answers without loading torch (seconds): the
    heavy modules are imported by the commands that use them."""
    done = subprocess.run(
        [sys.executable, "-c", _HELP_WITHOUT_TORCH], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == "ok"


def test_tiny_writes_a_model_and_prints_its_contract(tmp_path, capsys):
    out = tmp_path / "m"
    assert (
        main(
            [
                "tiny",
                "--arch",
                "qwen3-moe",
                "--out",
                str(out),
                "--hidden",
                "96",
                "--vocab",
                "1000",
                "--heads",
                "3",
                "--kv-heads",
                "1",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "contract sha256:" in printed
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hidden_size"] == 96 and cfg["vocab_size"] == 1000


def test_contract_show_lists_every_op_site(tmp_path, capsys):
    out = tmp_path / "m"
    main(["tiny", "--arch", "qwen3", "--out", str(out)])
    capsys.readouterr()
    assert main(["contract", "show", "--model", str(out), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["sites"]["layers.*.self_attn.core"] == "attention.blocked@3{block=32,segment=512}"
    assert data["sites"]["lm_head"] == "gemm.kblock@1{bk=32,out=fp32}"


def test_bad_input_exits_2_with_a_message(tmp_path, capsys):
    assert main(["contract", "show", "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert (
        main(
            [
                "tiny",
                "--arch",
                "qwen3",
                "--out",
                str(tmp_path / "x"),
                "--heads",
                "3",
                "--kv-heads",
                "2",
            ]
        )
        == 2
    )


def test_qualify_without_plugins_names_the_missing_half(tmp_path):
    main(["tiny", "--arch", "qwen3", "--out", str(tmp_path / "m")])
    with pytest.raises(MissingHalf, match="sampler half.*lockstep-serving"):
        Ladder(manager(load_entry_points=False), tmp_path / "m", tmp_path / "q")


def test_replay_of_a_trace_without_decisions_exits_2_naming_it(tmp_path, capsys):
    import torch

    from lockstep_exact.trace import MANIFEST, TEACHER_FORCED, SamplingSettings, Trace

    one = Trace.from_sequences(
        [[1, 2]],
        [[3]],
        [torch.tensor([-0.5], dtype=torch.float32)],
        contract_fingerprint="c" * 64,
        model_hash="m" * 64,
        sampling=SamplingSettings(rule=TEACHER_FORCED),
    )
    path = one.save(tmp_path / "trace")
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["num_decisions"] = 0  # what a capture of zero tokens would record
    (path / MANIFEST).write_text(json.dumps(manifest))
    assert main(["replay", "--model", str(tmp_path), "--trace", str(path)]) == 2
    captured = capsys.readouterr()
    assert "EXACT" not in captured.out
    assert (
        f"lockstep replay: error: {path}: the trace has no decisions (no sampled tokens): "
        "there is nothing to replay" in captured.err
    )


@pytest.mark.parametrize("index", ["1", "-1"])
def test_bisect_of_a_decision_the_trace_lacks_exits_2_naming_the_range(tmp_path, capsys, index):
    import torch

    from lockstep_exact.trace import TEACHER_FORCED, SamplingSettings, Trace

    one = Trace.from_sequences(
        [[1, 2]],
        [[3]],
        [torch.tensor([-0.5], dtype=torch.float32)],
        contract_fingerprint="c" * 64,
        model_hash="m" * 64,
        sampling=SamplingSettings(rule=TEACHER_FORCED),
    )
    path = one.save(tmp_path / "trace")
    argv = ["bisect", "--model", str(tmp_path), "--trace", str(path), "--decision", index]
    assert main(argv) == 2
    assert (
        f"lockstep bisect: error: the trace has 1 decisions; no decision {index} "
        "(choose --decision from 0 to 0)" in capsys.readouterr().err
    )


@pytest.mark.parametrize("extra", [[], ["--backend", "cuda", "--engine", "sglang"]])
def test_capture_with_cuda_graphs_needs_the_cuda_backend_and_vllm(tmp_path, capsys, extra):
    """--cuda-graphs is the vLLM lane's GPU decode path; elsewhere it is refused, by name,
    before any engine starts."""
    argv = ["capture", "--model", str(tmp_path), "--out", str(tmp_path / "t"), "--cuda-graphs"]
    assert main(argv + extra) == 2
    err = capsys.readouterr().err
    assert (
        "lockstep capture: error: --cuda-graphs captures the vLLM lane's decode steps on a GPU: "
        "it needs --backend cuda and the vLLM sampler" in err
    )
    assert not (tmp_path / "t").exists()


def test_capture_refuses_an_existing_out_before_any_engine(tmp_path, capsys):
    """A trace is never replaced: an existing --out (a trace, or any folder) is refused by
    name at once, and the engine log beside it is left as it was."""
    out = tmp_path / "t"
    out.mkdir()
    log = tmp_path / "t.log"
    log.write_text("the first capture's engine output\n")
    assert main(["capture", "--model", str(tmp_path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert (
        f"lockstep capture: error: --out {out} exists: a capture writes a new trace and never "
        "replaces one; choose another --out (or remove that one first)" in err
    )
    assert "overwrite=True" not in err and "engine log" not in err
    assert log.read_text() == "the first capture's engine output\n"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--decisions", "-3"], "--decisions must be an int >= 1, got -3"),
        (["--decisions", "0"], "--decisions must be an int >= 1, got 0"),
        (["--prompts", "EMPTY"], "--prompts EMPTY holds no prompts (one prompt per line"),
    ],
)
def test_capture_refuses_no_decisions_or_no_prompts_before_any_engine(
    tmp_path, capsys, monkeypatch, extra, message
):
    monkeypatch.chdir(tmp_path)
    Path("EMPTY").write_text("\n  \n")
    assert main(["capture", "--model", str(tmp_path), "--out", "t", *extra]) == 2
    assert f"lockstep capture: error: {message}" in capsys.readouterr().err
    assert not Path("t").exists() and not Path("t.log").exists()


def test_capture_names_the_line_of_a_prompts_file_that_is_not_utf8(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("first\r\nsecond é\n\nthe third \xff\n".encode("latin-1"))
    argv = ["capture", "--model", str(tmp_path), "--prompts", str(prompts)]
    assert main([*argv, "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert (
        f"lockstep capture: error: --prompts {prompts}, line 2: not UTF-8 text (byte 0xe9 at "
        "offset 14: invalid continuation byte); save the file as UTF-8" in err
    )
    assert "codec" not in err


def test_train_help_shows_the_defaults(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # one line per option: no default is wrapped apart
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    lines = {}  # each option's help, its wrapped lines joined
    for line in capsys.readouterr().out.split("options:")[1].splitlines():
        if line.startswith("  -"):
            flag = line.split()[0]
            lines[flag] = line
        elif line.strip():
            lines[flag] += " " + line.strip()
    for flag, default in [
        ("--algo", "grpo"),
        ("--steps", "10"),
        ("--group", "8"),
        ("--kl-coef", "0.05"),
        ("--micro-batch", "4"),
        ("--checkpoint-every", "1"),
        ("--clip", "0.2"),
        ("--seed", "0"),
        ("--out", "lockstep-train"),
    ]:
        assert f"(default: {default})" in lines[flag], lines[flag]
    assert "(default: grpo 2e-2, opd and sft 5e-3)" in lines["--lr"]
    assert "(default: 8, raised to a multiple of an MoE's top-k)" in lines["--rank"]
    assert "(default: None)" not in str(lines) and "(default: False)" not in str(lines)
