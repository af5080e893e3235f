"""Files a user hands the CLI or the agent: checked to be regular files and read within a bound.

A device (/dev/zero) or a FIFO handed where a file is expected was read forever: `ledger verify
/dev/zero` grew to 21 GB before the kernel killed it, `infer --dataset FIFO` hung (issue 25). Every
such input goes through ``input_file`` (a regular file, links followed) and, when read whole,
``read_bounded``; a mistake is one ``FileInputError`` line naming the file and what is wrong with it.
"""

from __future__ import annotations

import stat
from pathlib import Path


class FileInputError(ValueError):
    """A file input is missing, not a regular file, or too large; ``str()`` is the one line to show."""


def input_file(path: str | Path, what: str = "file", hint: str = "") -> Path:
    """``path`` if it names a regular file (links followed); FileInputError saying what it is instead."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise FileInputError(f"{what} {path}: no such file{hint}") from None
    except OSError as error:
        raise FileInputError(f"{what} {path}: {error.strerror or error}") from None
    if not stat.S_ISREG(mode):
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
                "a socket" if stat.S_ISSOCK(mode) else "not a file")
        raise FileInputError(f"{what} {path}: not a regular file ({kind}); give a file{hint}")
    return path


def read_bounded(path: str | Path, max_bytes: int, what: str = "file") -> bytes:
    """The bytes of regular file ``path``, at most ``max_bytes`` of them; FileInputError otherwise."""
    path = input_file(path, what)
    size = path.stat().st_size
    if size > max_bytes:
        raise FileInputError(f"{what} {path}: {size} bytes, more than the {max_bytes} it may hold")
    try:
        with open(path, "rb") as file:
            data = file.read(max_bytes + 1)
    except OSError as error:
        raise FileInputError(f"{what} {path}: {error.strerror or error}") from None
    if len(data) > max_bytes:  # it grew while we read it
        raise FileInputError(f"{what} {path}: more than the {max_bytes} bytes it may hold")
    return data
