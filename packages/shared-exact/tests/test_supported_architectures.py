"""A refusal of an unknown architecture names every architecture some exact lane runs, from
one table (``lanes.config.supported_architectures``), Qwen3-Next included."""

from __future__ import annotations

import json

import pytest

from lockstep_exact.app.cli import main
from lockstep_exact.lanes.config import (
    FAMILIES,
    HYBRID_FAMILIES,
    UnsupportedModel,
    check_config,
    supported_architectures,
)

ALL = ["Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM"]


def test_the_table_is_every_family_the_lanes_run():
    assert supported_architectures() == sorted({**FAMILIES, **HYBRID_FAMILIES}) == ALL


def test_check_config_names_every_supported_architecture():
    with pytest.raises(UnsupportedModel) as err:
        check_config({"architectures": ["LlamaForCausalLM"]})
    assert str(err.value) == (
        f"architecture ['LlamaForCausalLM'] has no exact lane; supported: {ALL}"
    )


def test_the_cli_refusal_names_qwen3_next(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert main(["contract", "show", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "has no exact lane" in err
    for arch in ALL:
        assert arch in err
