"""Release the three packages together.

uv run python tools/release.py bump 0.2.0   # versions, exact pins, lock file
uv run python tools/release.py build        # wheels + sdists into dist/
uv run python tools/release.py verify       # fresh venv, install wheels, lockstep doctor
uv run python tools/release.py all 0.2.0    # bump, build, verify
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {  # distribution -> (directory, import name)
    "lockstep-exact": ("packages/shared-exact", "lockstep_exact"),
    "lockstep-megatron": ("packages/trainer-plugin", "lockstep_megatron"),
    "lockstep-serving": ("packages/serving-plugin", "lockstep_serving"),
}
PLUGINS = ("lockstep-megatron", "lockstep-serving")
VERSION_RE = re.compile(r"^\d+\.\d+\.\d+([ab]\d+|rc\d+)?$")


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=True, **kw)


def uv_env() -> dict[str, str]:
    """The environment for uv: pip's local wheel folder as UV_FIND_LINKS, discovered (uv does
    not read pip's configuration, and torch's CPU build lies there on these machines)."""
    env = dict(os.environ)
    if env.get("UV_FIND_LINKS"):
        return env
    # The project venv has no pip: ask the machine's pip (the first on PATH that answers).
    for pip in (shutil.which("pip3"), shutil.which("pip"), sys.executable):
        if pip is None:
            continue
        cmd = [pip] if pip != sys.executable else [pip, "-m", "pip"]
        found = subprocess.run(
            [*cmd, "config", "get", "global.find-links"], capture_output=True, text=True
        ).stdout.strip()
        if found:
            env["UV_FIND_LINKS"] = found
            break
    return env


def _sub(path: Path, pattern: str, repl: str, count: int = 1) -> None:
    text = path.read_text()
    new, n = re.subn(pattern, repl, text, count=count, flags=re.M)
    if n == 0:
        raise SystemExit(f"release: pattern {pattern!r} not found in {path}")
    path.write_text(new)


def bump(version: str) -> None:
    if not VERSION_RE.match(version):
        raise SystemExit(f"release: {version!r} is not a version like 1.2.3")
    for dist, (folder, module) in PACKAGES.items():
        base = ROOT / folder
        _sub(base / "pyproject.toml", r'^version = "[^"]+"', f'version = "{version}"')
        _sub(
            base / "src" / module / "__init__.py",
            r'^__version__ = "[^"]+"',
            f'__version__ = "{version}"',
        )
        if dist in PLUGINS:
            _sub(base / "pyproject.toml", r'"lockstep-exact[^"]*"', f'"lockstep-exact=={version}"')
            _sub(
                base / "src" / module / "_release.py",
                r'^EXACT_VERSION = "[^"]+"',
                f'EXACT_VERSION = "{version}"',
            )
    _sub(ROOT / "pyproject.toml", r'^version = "[^"]+"', f'version = "{version}"')
    run([sys.executable, str(ROOT / "tools" / "contract_lock.py"), "--update"], cwd=ROOT)
    # The lock finds torch in .wheels/ (pyproject's find-links); an extra wheel folder in the
    # environment would be recorded as its source instead, a path of this machine.
    run(["uv", "lock"], cwd=ROOT, env={k: v for k, v in os.environ.items() if k != "UV_FIND_LINKS"})
    print(f"release: all packages at {version}; plugins pin lockstep-exact=={version}")


def build(out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("lockstep_*"):
        old.unlink()
    for dist in PACKAGES:
        run(["uv", "build", "--package", dist, "--out-dir", str(out)], cwd=ROOT)
    built = sorted(out.glob("lockstep_*"))
    wheels = [p for p in built if p.suffix == ".whl"]
    sdists = [p for p in built if p.name.endswith(".tar.gz")]
    if len(wheels) != 3 or len(sdists) != 3:
        raise SystemExit(f"release: expected 3 wheels and 3 sdists, got {[p.name for p in built]}")
    return wheels


def verify(out: Path) -> None:
    wheels = sorted(out.glob("lockstep_*.whl"))
    if len(wheels) != 3:
        raise SystemExit("release: build first (expected 3 wheels in dist/)")
    env = uv_env()
    with tempfile.TemporaryDirectory(prefix="lockstep-release-") as tmp:
        venv = Path(tmp) / "venv"
        run(["uv", "venv", "--quiet", "--python", "3.11", str(venv)], env=env)
        py = venv / "bin" / "python"
        overrides = Path(tmp) / "overrides.txt"
        overrides.write_text(
            "".join(
                f"{n}; sys_platform == 'never'\n"
                for n in ("torchvision", "torchaudio", "torchcodec", "triton")
            )
        )
        run(
            [
                "uv",
                "pip",
                "install",
                "--quiet",
                "--python",
                str(py),
                "--overrides",
                str(overrides),
                # lockstep-serving's engine is an extra (vllm or sglang: they conflict).
                *(
                    f"lockstep-serving[vllm] @ {w.as_uri()}"
                    if w.name.startswith("lockstep_serving-")
                    else str(w)
                    for w in wheels
                ),
            ],
            env=env,
        )
        doctor = subprocess.run(
            [str(venv / "bin" / "lockstep"), "doctor"], capture_output=True, text=True, env=env
        )
        print(doctor.stdout, end="")
        print(doctor.stderr, end="", file=sys.stderr)
        for plugin in ("lockstep-megatron (trainer)", "lockstep-serving (sampler)"):
            if plugin not in doctor.stdout:
                raise SystemExit(f"release: the installed wheels do not load plugin {plugin}")
        if doctor.returncode != 0:
            raise SystemExit(f"release: lockstep doctor exited {doctor.returncode}")
    print("release: the three wheels install into a fresh venv and both plugins load")


def main() -> None:
    parser = argparse.ArgumentParser(description="Release the three Lockstep packages together.")
    parser.add_argument("action", choices=("bump", "build", "verify", "all"))
    parser.add_argument("version", nargs="?")
    parser.add_argument("--out", type=Path, default=ROOT / "dist")
    args = parser.parse_args()
    if args.action in ("bump", "all"):
        if not args.version:
            parser.error(f"{args.action} needs a version")
        bump(args.version)
    if args.action in ("build", "all"):
        build(args.out)
    if args.action in ("verify", "all"):
        verify(args.out)


if __name__ == "__main__":
    main()
