"""On-disk blockstore: one file per block, named by its multihash, in the agent's data directory.

Rules of this file:
- Layout: ``<root>/<2 hex>/<sha256 hex>`` where the file holds the block's bytes exactly. Blocks are
  keyed by digest, as Kubo keys by multihash: a CIDv0 and a CIDv1 of the same bytes share a file.
- ``put`` hash-checks the bytes against the CID before anything touches the disk (verify_block:
  digest and size limit), then writes a temp file in the same directory and renames it over the
  final name, so a block file is either absent or whole. Putting a block that is present is a no-op.
- ``get`` re-checks the hash (disk rot, an edited file): a corrupt block file is deleted and reported
  as missing rather than served. ``get_unchecked`` is for a caller about to check it anyway.
- File I/O is synchronous: a block is at most ~1 MiB and lands in the page cache, cheaper than a
  thread hop per block.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from agent.content.errors import ContentError
from protocol.cid import CID
from protocol.unixfs import verify_block

_TMP_SEQ = itertools.count()


class BlockStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._root = str(self.root)
        self._subdirs: set[str] = set()  # <2 hex> subdirectories known to exist

    def path_for(self, cid: CID) -> Path:
        digest = cid.digest.hex()
        return self.root / digest[:2] / digest

    def has(self, cid: CID) -> bool:
        return self.path_for(cid).is_file()

    def put(self, cid: CID, data: bytes) -> None:
        """Store ``data`` as the block ``cid``; CIDError naming the CID if it does not match."""
        verify_block(cid, data)
        self.put_verified(cid, data)

    def put_verified(self, cid: CID, data: bytes) -> None:
        """Store a block the caller has just hash-checked against ``cid`` (e.g. a StreamVerifier).

        Plain string paths and the known subdirectories remembered: a fetch stores every block from
        its checker thread, and every microsecond of Python here holds the GIL the network loop needs.
        """
        digest = cid.digest.hex()
        sub = os.path.join(self._root, digest[:2])
        path = os.path.join(sub, digest)
        if os.path.exists(path):
            return
        if sub not in self._subdirs:
            os.makedirs(sub, exist_ok=True)
            self._subdirs.add(sub)
        # unique per writer: two threads of this process may put the same block at once (a fetch's
        # checker thread and an add, say); a shared temp name would let one rename the other's file away
        tmp = os.path.join(sub, f".{digest}.tmp{os.getpid()}-{threading.get_ident()}-{next(_TMP_SEQ)}")
        try:
            try:
                fh = open(tmp, "wb")
            except FileNotFoundError:  # the subdirectory was removed behind our back
                os.makedirs(sub, exist_ok=True)
                fh = open(tmp, "wb")
            with fh:
                fh.write(data)
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise

    def get_unchecked(self, cid: CID) -> bytes | None:
        digest = cid.digest.hex()
        try:
            with open(os.path.join(self._root, digest[:2], digest), "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None

    def get(self, cid: CID) -> bytes | None:
        """The block's bytes, hash-checked; None if absent (or corrupt on disk, then removed)."""
        data = self.get_unchecked(cid)
        if data is not None and hashlib.sha256(data).digest() != cid.digest:
            self.path_for(cid).unlink(missing_ok=True)
            return None
        return data

    def require(self, cid: CID) -> bytes:
        data = self.get(cid)
        if data is None:
            raise ContentError(f"block {cid} is not in the blockstore at {self.root}")
        return data

    def delete(self, cid: CID) -> None:
        self.path_for(cid).unlink(missing_ok=True)

    def digests(self) -> Iterator[bytes]:
        """Digests of every stored block (for listing; order unspecified)."""
        for sub in self.root.iterdir():
            if sub.is_dir() and len(sub.name) == 2:
                for f in sub.iterdir():
                    if len(f.name) == 64 and not f.name.startswith("."):
                        yield bytes.fromhex(f.name)
