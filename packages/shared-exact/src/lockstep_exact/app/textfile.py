"""The text files a user hands the CLI (prompts, JSONL data), read as UTF-8 with the line of
a decoding error named."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["read_lines"]


def read_lines(
    path: str | os.PathLike[str], what: str, error: type[Exception] = ValueError
) -> list[str]:
    """The lines of the UTF-8 text file ``path`` (``str.splitlines``). A file that is not
    UTF-8 raises ``error`` naming ``what`` (the flag), the file, the 1-based line and the
    byte where decoding failed."""
    p = Path(path)
    data = p.read_bytes()
    try:
        return data.decode("utf-8").splitlines()
    except UnicodeDecodeError as err:
        before = data[: err.start].decode("utf-8")  # decodes: the error is the first one
        line = len((before + "x").splitlines())  # "x": the line the bad byte starts or ends
        raise error(
            f"{what} {p}, line {line}: not UTF-8 text (byte 0x{data[err.start]:02x} at offset "
            f"{err.start}: {err.reason}); save the file as UTF-8"
        ) from None
