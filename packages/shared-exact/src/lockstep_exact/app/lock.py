"""The contract lock: golden output hashes per program version, and lane fingerprints.

A kernel change that moves one output bit must come with a new program version, and a new
version must come with a regenerated lock. ``check`` says which program broke which rule.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..contract import environment_pins
from ..golden import case_hashes
from ..model import geometry_contract, geometry_of
from ..programs import CATALOG
from .tiny import tiny_config

LOCK_FORMAT = "lockstep.contracts-lock/1"

# The lanes whose fingerprints the lock pins: the geometries ``lockstep tiny`` makes by default.
LOCKED_ARCHES = ("qwen3", "qwen3-moe", "qwen3-next")


def machine_pins(backend: str) -> dict[str, str]:
    """The pins of ``backend`` on this machine that the code does not fix: the GPU
    architecture and compilers for cuda (``contract.environment_pins`` without the version)."""
    pins = environment_pins(backend)
    pins.pop("lockstep_exact")
    return pins


def lane_fingerprints(backend: str, has_golden, machine: dict | None = None) -> dict[str, str]:
    """The locked lanes' fingerprints on ``backend``, with ``machine``'s pins (this machine's
    when None). A lane is pinned only where ``has_golden(program)`` holds for every one of
    its programs (where the backend runs them all)."""
    lanes = {}
    for arch in LOCKED_ARCHES:
        contract = geometry_contract(
            geometry_of(tiny_config(arch)), backend=backend, machine=machine
        )
        if all(has_golden(prog.name) for prog in contract.sites.values()):
            lanes[f"tiny-{arch}"] = contract.fingerprint
    return lanes


def build(backend: str = "cpu") -> dict:
    hashes = case_hashes(backend)
    programs = {}
    for name, (version, params) in sorted(CATALOG.items()):
        programs[name] = {
            "version": version,
            "params": params,
            "golden": {backend: hashes.get(name, {})},
        }
    lock = {
        "format": LOCK_FORMAT,
        "programs": programs,
        # The machine the goldens were made on: with it, any machine recomputes this
        # backend's lane fingerprints (the cpu check catches a contract change on cuda).
        "machines": {backend: machine_pins(backend)},
    }
    lock["lanes"] = {backend: lane_fingerprints(backend, _has_golden(lock, backend))}
    return lock


def _has_golden(lock: dict, backend: str):
    """Whether the lock holds golden bytes of a program on ``backend``: where a lane's
    fingerprint is pinned (``lane_fingerprints``), as made and as recomputed."""
    return lambda name: bool(lock["programs"].get(name, {}).get("golden", {}).get(backend))


def recorded_lanes(lock: dict, backend: str) -> dict[str, str] | None:
    """``backend``'s lane fingerprints made with the machine the lock records for it (None
    where it records none): what the lock's lanes must be, computable on any machine."""
    machine = lock.get("machines", {}).get(backend)
    if machine is None:
        return None
    return lane_fingerprints(backend, _has_golden(lock, backend), machine)


def check(lock: dict, backend: str = "cpu") -> list[str]:
    """Every way the code disagrees with the lock, one sentence each naming the program."""
    if lock.get("format") != LOCK_FORMAT:
        return [f"lock format is {lock.get('format')!r}, expected {LOCK_FORMAT!r}"]
    now = build(backend)
    problems = []
    for name in sorted(set(lock["programs"]) | set(now["programs"])):
        old, new = lock["programs"].get(name), now["programs"].get(name)
        if old is None:
            problems.append(f"program {name} is not in the lock: regenerate it")
            continue
        if new is None:
            problems.append(f"program {name} is in the lock but no longer in the catalog")
            continue
        if old["version"] != new["version"] or old["params"] != new["params"]:
            problems.append(
                f"program {name} is {name}@{new['version']} {new['params']} but the lock has "
                f"@{old['version']} {old['params']}: regenerate the lock "
                "(python tools/contract_lock.py --update)"
            )
            continue
        locked = old["golden"].get(backend)
        if locked is None:
            continue  # this backend's hashes are checked where it runs
        for case in sorted(set(locked) | set(new["golden"][backend])):
            if locked.get(case) != new["golden"][backend].get(case):
                problems.append(
                    f"program {name}@{new['version']} changed its output bytes on golden case "
                    f"{case!r} ({backend}) without a version bump: bump its version in "
                    "programs.CATALOG and regenerate the lock"
                )
    machine = lock.get("machines", {}).get(backend)
    if machine is not None and machine != now["machines"][backend]:
        problems.append(
            f"the lock's {backend} goldens were made on {machine}, this machine is "
            f"{now['machines'][backend]}: regenerate the lock here on purpose "
            f"(python tools/contract_lock.py --backend {backend} --update)"
        )
    locked_lanes = lock.get("lanes", {}).get(backend)
    if locked_lanes is not None:
        for lane, fp in sorted(now["lanes"][backend].items()):
            if locked_lanes.get(lane) != fp:
                problems.append(
                    f"lane {lane} fingerprint is {fp} but the lock has "
                    f"{locked_lanes.get(lane)}: regenerate the lock"
                )
    # Other backends' lanes, from the machines the lock records: a change to a lane's
    # contract shows here without that backend's hardware.
    for other in sorted(set(lock.get("machines", {})) - {backend}):
        want = recorded_lanes(lock, other)
        have = lock.get("lanes", {}).get(other, {})
        for lane in sorted(set(want) | set(have)):
            if want.get(lane) != have.get(lane):
                problems.append(
                    f"lane {lane} on {other} (the lock's {other} machine) has fingerprint "
                    f"{want.get(lane)} but the lock has {have.get(lane)}: regenerate the "
                    f"lock (python tools/contract_lock.py --update refreshes {other}'s lanes)"
                )
    return problems


def merge(lock: dict | None, fresh: dict, backend: str) -> dict:
    """``fresh`` for ``backend``, keeping other backends' hashes for unchanged programs."""
    if not lock:
        return fresh
    out = json.loads(json.dumps(fresh))
    for name, entry in out["programs"].items():
        old = lock.get("programs", {}).get(name)
        if old and old["version"] == entry["version"] and old["params"] == entry["params"]:
            for other, hashes in old["golden"].items():
                entry["golden"].setdefault(other, hashes)
    for other, lanes in lock.get("lanes", {}).items():
        out["lanes"].setdefault(other, lanes)
    for other, machine in lock.get("machines", {}).items():
        out["machines"].setdefault(other, machine)
    # Other backends' lanes follow the code's contracts: remade with their recorded machines
    # (their goldens need their hardware and stay as they were).
    for other in set(out["machines"]) - {backend}:
        out["lanes"][other] = recorded_lanes(out, other)
    return out


def read(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def write(path: str | Path, lock: dict) -> None:
    Path(path).write_text(json.dumps(lock, indent=2, sort_keys=True) + "\n")
