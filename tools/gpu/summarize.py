"""One summary of a GPU suite run in chunks: the `summary.json` of every chunk, merged.

`tools/gpu/suite` writes one `summary.json` per run (counts, every test that did not pass with
its reason, the versions); `tools/gpu/suite.steps` runs the suite in chunks, one device call
each, so a whole run leaves several. Given the folders the device calls brought back (each
`steps.tgz` unpacked, or any folder holding `NAME/summary.json`), this prints one JSON object:
each chunk's counts, exit status, seconds and versions, the totals, every test that did not
pass (with its chunk), the chunks of the steps file that no folder holds (`missing`), and
whether the versions agree across chunks. It exits 0 only when every chunk of the steps file is
present, every chunk exited 0 and nothing failed or errored.

    python3 tools/gpu/summarize.py [--steps tools/gpu/suite.steps] [--json OUT] FOLDER...
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

STATES = ("passed", "failed", "error", "skipped")
DEFAULT_STEPS = Path(__file__).with_name("suite.steps")


def step_names(steps_file: Path) -> list[str]:
    """The chunk names of a steps file (`NAME SECONDS COMMAND` lines), in order: a step's
    NAME, or where the step runs `tools/gpu/side-by-side`, the NAME of each of its
    selections (each writes its own `NAME/summary.json`)."""
    names = []
    for line in steps_file.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _secs, command = line.split(maxsplit=2)
            words = shlex.split(command)
            tool = next((i for i, w in enumerate(words) if w.endswith("side-by-side")), None)
            if tool is None:
                names.append(name)
            else:
                names.extend(sel.split(maxsplit=1)[0] for sel in words[tool + 1 :])
    return names


def chunks_in(folders: list[Path]) -> dict[str, dict]:
    """chunk name -> its summary, for every `*/summary.json` under the folders (the name is
    the summary's folder; a name found twice is an error, naming both places)."""
    found: dict[str, tuple[Path, dict]] = {}
    for folder in folders:
        if not folder.is_dir():
            raise SystemExit(f"summarize: {folder} is not a folder")
        for path in sorted(folder.rglob("summary.json")):
            name = path.parent.name
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise SystemExit(f"summarize: {path} is not JSON ({err})") from err
            if "counts" not in data:
                continue  # another kind of summary (tools/gpu/steps' own files are .tsv)
            if name in found:
                raise SystemExit(f"summarize: chunk {name!r} twice: {found[name][0]} and {path}")
            found[name] = (path, data)
    return {name: data for name, (_, data) in found.items()}


def summarize(chunks: dict[str, dict], expected: list[str]) -> dict:
    totals = dict.fromkeys(STATES, 0)
    not_passed, versions = [], {}
    per_chunk = {}
    for name, data in chunks.items():
        counts = {s: int(data["counts"].get(s, 0)) for s in STATES}
        for s in STATES:
            totals[s] += counts[s]
        per_chunk[name] = {
            "args": data.get("args"),  # the pytest selection the chunk ran
            "exit": data.get("exit"),
            "counts": counts,
            "seconds": data.get("seconds"),
            "versions": data.get("versions", {}),
        }
        for case in data.get("not_passed", []):
            not_passed.append({"chunk": name, **case})
        for dist, version in data.get("versions", {}).items():
            versions.setdefault(dist, set()).add(version)
    missing = [n for n in expected if n not in chunks]
    ok = (
        not missing
        and bool(chunks)
        and all(c["exit"] == 0 for c in per_chunk.values())
        and totals["failed"] == 0
        and totals["error"] == 0
    )
    return {
        "ok": ok,
        "totals": totals,
        "chunks": per_chunk,
        "missing": missing,
        "not_passed": not_passed,
        "versions": {d: sorted(str(v) for v in vs) for d, vs in sorted(versions.items())},
        "versions_agree": all(len(vs) == 1 for vs in versions.values()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folders", nargs="+", type=Path, help="folders the device calls brought back")
    ap.add_argument(
        "--steps",
        type=Path,
        default=DEFAULT_STEPS,
        help="the steps file whose chunks a whole run holds (default: tools/gpu/suite.steps); "
        "'none' names no chunk as missing",
    )
    ap.add_argument("--json", type=Path, help="write the summary here too")
    args = ap.parse_args(argv)
    expected = [] if str(args.steps) == "none" else step_names(args.steps)
    result = summarize(chunks_in(args.folders), expected)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
