"""Errors of the content room. Each names the CID it is about and what went wrong."""

from __future__ import annotations

from agent.net.errors import NetError


class ContentError(NetError):
    """A content operation failed (bad input file, block missing from the store, ...)."""


class FetchError(ContentError):
    """A fetch could not complete. ``cid`` is the root asked for; ``missing`` the subtree roots
    still needed when it stopped (the first one is where it stopped); ``attempts`` one line per
    provider tried; ``refused`` when the file itself is refused (its size is over the fetch's bound),
    so trying again cannot help; ``corrupt`` the providers that sent a block that failed
    verification (a block that does not hash to its CID, or a DAG the root cannot name), ``invalid``
    that the root names a DAG that cannot be a file: the fault of who sent or named it, not of the
    network."""

    def __init__(self, cid: str, reason: str, *, missing: list[str] = (), attempts: list[str] = (),
                 refused: bool = False, corrupt: list[str] = (), invalid: bool = False) -> None:
        self.cid = cid
        self.refused = refused
        self.missing = list(missing)
        self.attempts = list(attempts)
        self.corrupt = list(corrupt)
        self.invalid = invalid
        where = f"; missing {len(self.missing)} subtree(s) from block {self.missing[0]}" if self.missing else ""
        tried = f" [{'; '.join(self.attempts)}]" if self.attempts else ""
        super().__init__(f"fetch {cid}: {reason}{where}{tried}")
