"""The one atomic writer: a directory or file appears whole, or the old one stays."""

from __future__ import annotations

import os

import pytest

import lockstep_exact.atomic as atomic
from lockstep_exact.atomic import write_dir, write_file


def _boom(*a, **k):
    raise OSError("disk full")


def test_write_dir_writes_files_then_fill(tmp_path):
    def fill(tmp):
        (tmp / "b.txt").write_bytes((tmp / "a.txt").read_bytes() + b"!")

    out = write_dir(tmp_path / "d", {"a.txt": b"one"}, fill=fill)
    assert sorted(os.listdir(out)) == ["a.txt", "b.txt"]
    assert (out / "b.txt").read_bytes() == b"one!"
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []


def test_write_dir_refuses_an_existing_directory_unless_overwrite(tmp_path):
    write_dir(tmp_path / "d", {"old.txt": b"old"})
    with pytest.raises(FileExistsError, match="exists \\(pass overwrite=True to replace it\\)"):
        write_dir(tmp_path / "d", {"new.txt": b"new"})
    write_dir(tmp_path / "d", {"new.txt": b"new"}, overwrite=True)
    assert os.listdir(tmp_path / "d") == ["new.txt"]  # replaced whole, never mixed
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []


def test_a_failed_write_dir_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "fsync_dir", _boom)
    with pytest.raises(OSError, match="disk full"):
        write_dir(tmp_path / "d", {"a.txt": b"a"})
    assert os.listdir(tmp_path) == []


def test_a_failed_replacement_puts_the_old_directory_back(tmp_path, monkeypatch):
    write_dir(tmp_path / "d", {"old.txt": b"old"})
    real_rename = os.rename

    def rename(src, dst):
        if ".tmp-" in str(src):  # the new directory moving into place
            raise OSError("rename failed")
        return real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", rename)
    with pytest.raises(OSError, match="rename failed"):
        write_dir(tmp_path / "d", {"new.txt": b"new"}, overwrite=True)
    assert os.listdir(tmp_path) == ["d"]
    assert (tmp_path / "d" / "old.txt").read_bytes() == b"old"


def test_write_file_replaces_and_leaves_no_temporary(tmp_path):
    write_file(tmp_path / "f", b"one")
    write_file(tmp_path / "f", b"two")
    assert (tmp_path / "f").read_bytes() == b"two"
    assert os.listdir(tmp_path) == ["f"]


def test_a_failed_write_file_keeps_the_old_file(tmp_path, monkeypatch):
    write_file(tmp_path / "f", b"one")
    monkeypatch.setattr(atomic.os, "replace", _boom)
    with pytest.raises(OSError, match="disk full"):
        write_file(tmp_path / "f", b"two")
    assert (tmp_path / "f").read_bytes() == b"one"
    assert os.listdir(tmp_path) == ["f"]
