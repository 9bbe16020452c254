"""Adapter refusals name hashes; ``lockstep contract show --model M --adapter A`` prints the
same hashes (the adapter's, the contract and base model it was made for, this lane's and this
model's), and each refusal names that command."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from lockstep_exact.adapters import AdapterError, load_adapter, make_adapter
from lockstep_exact.app.cli import main
from lockstep_exact.app.tiny import make_tiny
from lockstep_exact.model import ModelDir

OTHER_CONTRACT = "sha256:" + "3" * 64


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("show")
    mine = make_tiny(root / "mine", arch="qwen3", hidden=64, vocab=512, seed=0)
    theirs = make_tiny(root / "theirs", arch="qwen3", hidden=64, vocab=512, seed=1)
    adapter = make_adapter(mine, root / "adapter", rank=4)
    return mine, theirs, adapter


def _show(capsys, *argv) -> str:
    assert main(["contract", "show", *argv]) == 0
    return capsys.readouterr().out


def _named_command(message: str) -> list[str]:
    """The `lockstep contract show ...` a refusal names, as argv after 'contract show'."""
    found = re.search(r"`lockstep contract show ([^`]*)`", message)
    assert found, message
    return found.group(1).split()


def test_a_refusal_for_another_base_model_names_the_command_that_prints_both(models, capsys):
    mine, theirs, adapter = models
    with pytest.raises(AdapterError) as err:
        load_adapter(adapter, ModelDir(theirs))
    msg = str(err.value)
    bound_to, this = re.search(r"made for base model (\w+); this base model is (\w+)", msg).groups()
    argv = _named_command(msg)
    assert argv == ["--model", str(theirs), "--adapter", str(adapter)]
    out = _show(capsys, *argv)
    assert f"model hash   {this}\n" in out
    assert f"  for model  {bound_to} (NOT this one)\n" in out
    # the hash traces record is the one load_adapter gives with the right model
    assert f"adapter hash {load_adapter(adapter, ModelDir(mine)).sha256}\n" in out


def test_a_refusal_for_another_contract_names_the_command_that_prints_both(models, capsys):
    mine, _, adapter = models
    with pytest.raises(AdapterError) as err:
        load_adapter(adapter, ModelDir(mine), contract=OTHER_CONTRACT)
    msg = str(err.value)
    made_for = re.search(r"made for contract (sha256:\w+)", msg).group(1)
    out = _show(capsys, *_named_command(msg))
    assert f"fingerprint  {made_for}\n" in out  # the lane it was made for is mine on cpu
    assert f"  for lane   {made_for} (this one)\n" in out
    assert f"  for model  {ModelDir(mine).model_hash} (this one)\n" in out


def test_a_refusal_on_a_bare_geometry_names_the_model_dir_given(models):
    mine, theirs, adapter = models
    with pytest.raises(AdapterError, match=f"--model {theirs} --adapter {adapter}`"):
        load_adapter(
            adapter,
            ModelDir(theirs).geometry,
            model_hash=ModelDir(theirs).model_hash,
            model_dir=theirs,
        )


def test_an_adapter_without_records_and_an_edited_one(models, tmp_path, capsys):
    mine, _, adapter = models
    # peft's own files carry no Lockstep metadata: nothing recorded, the hash still shown
    from safetensors.torch import load_file, save_file

    bare = tmp_path / "peft"
    bare.mkdir()
    shutil.copy(adapter / "adapter_config.json", bare / "adapter_config.json")
    save_file(
        load_file(str(adapter / "adapter_model.safetensors")),
        str(bare / "adapter_model.safetensors"),
    )
    out = _show(capsys, "--model", str(mine), "--adapter", str(bare))
    assert f"adapter hash {load_adapter(bare, ModelDir(mine)).sha256}\n" in out
    assert "  for lane   none recorded (not a Lockstep export)\n" in out
    assert "  for model  none recorded (not a Lockstep export)\n" in out
    # an alpha edited in the config alone: the recorded hash differs from the files'
    edited = tmp_path / "edited"
    shutil.copytree(adapter, edited)
    cfg = json.loads((edited / "adapter_config.json").read_text())
    cfg["lora_alpha"] = float(cfg["lora_alpha"]) * 2
    (edited / "adapter_config.json").write_text(json.dumps(cfg))
    out = _show(capsys, "--model", str(mine), "--adapter", str(edited))
    assert "(DIFFERS: the files were edited)" in out


def test_model_hash_alone_and_json_refuses_the_extras(models, capsys):
    mine, _, adapter = models
    out = _show(capsys, "--model", str(mine), "--model-hash")
    assert f"model hash   {ModelDir(mine).model_hash}\n" in out
    assert "adapter" not in out
    assert (
        main(["contract", "show", "--model", str(mine), "--adapter", str(adapter), "--json"]) == 2
    )
    assert "--json prints the contract's canonical JSON only" in capsys.readouterr().err
