"""Settings files on disk (job specs, harness scenarios): read at most MAX_SPEC_BYTES + 1 bytes, every
failure a one-line SpecError naming the file. Decoding and validating the bytes is protocol/jobspec.py's."""

from __future__ import annotations

from pathlib import Path

from protocol.errors import SpecError
from protocol.jobspec import MAX_SPEC_BYTES, JobSpec, decode_text, parse_spec


def load_spec(path: str | Path) -> JobSpec:
    """Read and validate a job spec file; every failure, including I/O, is a SpecError."""
    return parse_spec(read_text(path), str(path))


def read_text(path: str | Path) -> str:
    """The UTF-8 text of a settings file (at most MAX_SPEC_BYTES); every failure is a SpecError."""
    source = str(path)
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_SPEC_BYTES + 1)
    except OSError as error:
        raise SpecError("", f"cannot read: {error.strerror or error}", source) from None
    return decode_text(data, source)
