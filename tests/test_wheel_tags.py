"""tools/wheel_tags.py: installed WHEEL tags aligned with the wheel's file name, in new files."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path


def _tool():
    from tool_support import load_tool

    return load_tool("tools/wheel_tags.py")


def _dist(root: Path, tag: str) -> Path:
    info = root / "foo-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: foo\nVersion: 1.0\n")
    (info / "WHEEL").write_text(f"Wheel-Version: 1.0\nTag: {tag}\n")
    (info / "RECORD").write_text(
        "foo-1.0.dist-info/METADATA,,\nfoo-1.0.dist-info/WHEEL,sha256=x,10\n"
        "foo-1.0.dist-info/RECORD,,\n"
    )
    return info


def test_mismatched_tags_are_rewritten_without_touching_a_hard_linked_copy(tmp_path):
    tool = _tool()
    info = _dist(tmp_path, "cp312-cp312-linux_x86_64")
    cache = tmp_path / "cache-copy"
    cache.hardlink_to(info / "WHEEL")
    dist = metadata.PathDistribution(info)
    assert tool.fix(dist, "foo-1.0-cp38-abi3-manylinux_2_28_x86_64.whl")
    assert (info / "WHEEL").read_text().splitlines()[-1] == "Tag: cp38-abi3-manylinux_2_28_x86_64"
    assert "cp312-cp312-linux_x86_64" in cache.read_text()  # uv's cached file is unchanged
    record = (info / "RECORD").read_text()
    assert "foo-1.0.dist-info/WHEEL,sha256=x," not in record
    # a second run changes nothing (the control: matching tags are left alone)
    again = metadata.PathDistribution(info)
    assert not tool.fix(again, "foo-1.0-cp38-abi3-manylinux_2_28_x86_64.whl")
