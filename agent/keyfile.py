"""The agent's key file on disk: written with mode 0600 through a temp file and rename (never half
written), read only if group and others cannot read it. The bytes' format and their parse are
protocol/identity.py's (``Identity.private_key_protobuf`` / ``Identity.from_private_key_protobuf``)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from protocol.errors import KeyFileError
from protocol.identity import Identity


def save_identity(identity: Identity, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Write the key file with mode 0600, atomically. Refuse to replace an existing key unless asked."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise KeyFileError(f"{path}: a key file already exists; refusing to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(identity.private_key_protobuf())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def load_identity(path: str | os.PathLike[str]) -> Identity:
    """Read a key file written by :func:`save_identity`; refuse it if group/others can read it."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise KeyFileError(f"{path}: no key file here (create one with `infernet agent init`)") from None
    if not stat.S_ISREG(st.st_mode):
        raise KeyFileError(f"{path}: not a regular file")
    if st.st_mode & 0o077:
        raise KeyFileError(
            f"{path}: key file is accessible by others (mode {stat.S_IMODE(st.st_mode):04o}); "
            f"run `chmod 600 {path}`"
        )
    data = path.read_bytes()
    return Identity.from_private_key_protobuf(data, where=str(path))
