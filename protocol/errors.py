"""Error types of the protocol layer.

Every check in ``protocol/`` raises one of these, never a bare ValueError/KeyError/TypeError from
deep inside a library: callers (the agent, the CLI) catch ``ProtocolError`` and print its message
as the one line a user sees. Each message names what was wrong and where.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base of every error raised by ``protocol/``."""


class CodecError(ProtocolError):
    """Untrusted bytes were rejected. ``reason`` is a short machine-readable tag, ``str()`` the sentence."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class KeyFileError(ProtocolError):
    """An identity key file is missing, malformed or unsafe (readable by others)."""


class CIDError(ProtocolError):
    """A content identifier is malformed, or content does not match its CID."""


class FileSizeError(CIDError):
    """A file's verified root states a size its fetch does not allow (IPIP-0003 §size bounds).

    A fact about the CID, not about the peer that sent it: no other provider can do better.
    """


class SpecError(ProtocolError):
    """A job spec is invalid. ``path`` is the dotted field path, ``location`` the file:line if known."""

    def __init__(self, path: str, message: str, location: str = "") -> None:
        self.path = path
        self.message = message
        self.location = location
        where = f"{location}: " if location else ""
        field = f"{path}: " if path else ""
        super().__init__(f"{where}{field}{message}")


class StateError(ProtocolError):
    """An event is not allowed in the current state of a job or shard."""


class ProofError(ProtocolError):
    """A proof-of-training record is malformed or does not verify."""
