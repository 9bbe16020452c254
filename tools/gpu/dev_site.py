"""Make the workspace's three packages importable from the tree, with their entry points.

On the GPU machine the packages run from the carried tree (so a fix between two device calls
is picked up), but vLLM's and SGLang's plugin loaders, and the ``lockstep`` CLI's hooks, read
entry points from installed ``*.dist-info``. This writes, into SITE (a folder on PYTHONPATH,
after the tree's source folders), one ``.dist-info`` per package: METADATA, entry_points.txt
and an empty RECORD. ``python3 tools/gpu/dev_site.py SITE``; tools/gpu/env.sh runs it.
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shared-exact", "trainer-plugin", "serving-plugin")


def entry_points(project: dict) -> str:
    groups = dict(project.get("entry-points", {}))
    if project.get("scripts"):
        groups["console_scripts"] = project["scripts"]
    lines = []
    for group, entries in groups.items():
        lines.append(f"[{group}]")
        lines.extend(f"{name} = {target}" for name, target in entries.items())
        lines.append("")
    return "\n".join(lines)


def _put(path: Path, text: str) -> None:
    """Write ``text`` unless the file holds it already, through a rename: suite streams run
    side by side on one machine, and a reader must never see a half-written entry-point file."""
    if path.exists() and path.read_text() == text:
        return
    part = path.with_name(f".{path.name}.{os.getpid()}")
    part.write_text(text)
    os.replace(part, path)


def write(site: Path) -> list[str]:
    site.mkdir(parents=True, exist_ok=True)
    written = []
    for folder in PACKAGES:
        pkg = ROOT / "packages" / folder
        project = tomllib.loads((pkg / "pyproject.toml").read_text())["project"]
        name, version = project["name"], project["version"]
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(exist_ok=True)
        _put(info / "METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        _put(info / "entry_points.txt", entry_points(project))
        _put(info / "RECORD", "")
        written.append(f"{name} {version}")
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python3 tools/gpu/dev_site.py SITE")
    for line in write(Path(sys.argv[1])):
        print(f"dev_site: {line} -> {sys.argv[1]}")
