"""Check or regenerate tools/contracts.lock.

uv run python tools/contract_lock.py            # check (exit 1 naming each problem)
uv run python tools/contract_lock.py --update   # regenerate on purpose
uv run python tools/contract_lock.py --backend cuda [--update]   # on a GPU machine

The lock records the machine each backend's goldens were made on (for cuda: the architecture,
torch, triton and CUDA versions). A check on one backend also remakes the other backends'
lane fingerprints from those records, and an update brings them along, so a change to a lane's
contract shows on a machine without a GPU; the cuda goldens themselves need a GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lockstep_exact.app import lock

LOCK_PATH = Path(__file__).resolve().parent / "contracts.lock"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help="rewrite the lock from the code")
    parser.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--lock", type=Path, default=LOCK_PATH)
    args = parser.parse_args()
    if args.update:
        old = lock.read(args.lock) if args.lock.exists() else None
        lock.write(args.lock, lock.merge(old, lock.build(args.backend), args.backend))
        print(f"wrote {args.lock}")
        return 0
    problems = lock.check(lock.read(args.lock), args.backend)
    for p in problems:
        print(f"contract lock: {p}", file=sys.stderr)
    if not problems:
        print(f"contract lock: {args.backend} programs and lanes match {args.lock.name}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
