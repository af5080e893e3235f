"""An IPFS daemon (Kubo) reached through its HTTP API, as one more place to add and fetch content.

Rules of this file:
- The client is ``ipfshttpclient.Client(addr)``: ``ipfshttpclient.connect()`` refuses daemons newer
  than 0.7, and every current Kubo is newer. Calls are blocking HTTP, so each runs in a worker
  thread under a deadline (``timeout``).
- The daemon is not trusted more than a peer. ``add_file`` adds with CIDv1 raw leaves and checks
  that the daemon's CID equals the one protocol/unixfs computed; ``fetch_blocks`` asks for raw
  blocks (``block/get``) one by one, in the order the StreamVerifier expects, and every block is
  hash- and structure-checked before it is used.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from agent.content.errors import ContentError
from protocol.cid import CID, parse_cid
from protocol.errors import CIDError, FileSizeError
from protocol.unixfs import StreamVerifier


class IpfsDaemon:
    def __init__(self, api_addr: str, *, timeout: float = 120.0) -> None:
        import ipfshttpclient  # imported here: only agents configured with a daemon need it

        self.api_addr = api_addr
        self.timeout = timeout
        try:
            self._client = ipfshttpclient.Client(api_addr, timeout=timeout)
        except Exception as exc:  # bad multiaddr text, unsupported address form
            raise ContentError(f"ipfs api {api_addr!r}: {type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        self._client.close()

    async def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            with trio.fail_after(self.timeout):
                return await trio.to_thread.run_sync(fn, abandon_on_cancel=True)
        except trio.TooSlowError:
            raise ContentError(f"ipfs daemon at {self.api_addr}: {what}: no answer within {self.timeout:.0f} s") from None
        except Exception as exc:
            raise ContentError(f"ipfs daemon at {self.api_addr}: {what}: {type(exc).__name__}: {exc}") from None

    async def version(self) -> str:
        info = await self._call("version", self._client.version)
        return str(info["Version"])

    async def add_file(self, path: str | os.PathLike[str], *, expected: CID | None = None) -> CID:
        """``ipfs add --cid-version=1`` (raw leaves); ContentError unless it gives ``expected``."""
        path = Path(path)
        result = await self._call(f"add {path}", lambda: self._client.add(
            str(path), cid_version=1, raw_leaves=True, chunker="size-262144", pin=True))
        try:
            cid = parse_cid(str(result["Hash"]))
        except (CIDError, KeyError, TypeError) as exc:
            raise ContentError(f"ipfs daemon at {self.api_addr}: add {path}: bad answer ({exc})") from None
        if expected is not None and cid != expected:
            raise ContentError(f"ipfs daemon at {self.api_addr}: add {path} gave {cid}, we computed {expected}")
        return cid

    async def get_block(self, cid: CID) -> bytes:
        data = await self._call(f"block/get {cid}", lambda: self._client.block.get(str(cid)))
        if not isinstance(data, bytes):
            raise ContentError(f"ipfs daemon at {self.api_addr}: block/get {cid}: not bytes")
        return data

    async def fetch_blocks(self, verifier: StreamVerifier, on_block: Callable[[CID, bytes, bytes], None]) -> None:
        """Fetch every block the verifier still needs from the daemon, checking each on arrival."""
        while (cid := verifier.expected()) is not None:
            data = await self.get_block(cid)
            try:
                payload = verifier.feed(data)
            except FileSizeError:
                raise  # about the CID, not the daemon
            except CIDError as exc:
                raise ContentError(f"ipfs daemon at {self.api_addr}: {exc}") from None
            on_block(cid, data, payload)
