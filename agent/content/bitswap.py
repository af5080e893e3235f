"""Bitswap (/ipfs/bitswap/1.2.0, 1.1.0, 1.0.0) over the agent's blockstore, so IPFS nodes can fetch our CIDs.

Rules of this file:
- py-libp2p's BitswapClient serves and receives blocks; its block store is our on-disk BlockStore
  (``_StoreAdapter``), so every block we hold is served and every block it receives is hash-checked
  by ``BlockStore.put`` before it is stored. py-libp2p's MerkleDag builder is never used: its DAGs are
  not Kubo's (see protocol/unixfs.py); our blocks come from protocol/unixfs.
- Fetching never calls py-libp2p's ``fetch_file`` (it retries forever). ``fetch_from_peer`` is our
  own want-loop: it asks for a window of the blocks the StreamVerifier will need next, waits at most
  ``idle_timeout`` for each window, then feeds the verifier in DFS order from the store. A window
  that brings nothing ends the attempt with PeerProtocolError naming the block still missing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio
from libp2p.bitswap.block_store import BlockStore as Libp2pBlockStore
from libp2p.bitswap.cid import cid_to_bytes
from libp2p.bitswap.client import BitswapClient
from libp2p.bitswap.config import BITSWAP_PROTOCOL_V120
from libp2p.peer.id import ID

from agent.content.blockstore import BlockStore
from agent.net.errors import PeerProtocolError
from agent.net.host import Host
from protocol.cid import CID
from protocol.errors import CIDError
from protocol.unixfs import StreamVerifier

log = logging.getLogger(__name__)
# py-libp2p 0.8.1 logs every received block at INFO, several lines each
logging.getLogger("libp2p.bitswap.client").setLevel(logging.WARNING)

WINDOW = 32  # blocks wanted at once (8 MiB of 256 KiB chunks)


def _our_cid(cid: Any) -> CID:
    return CID.from_bytes(cid_to_bytes(cid))


class _StoreAdapter(Libp2pBlockStore):
    """py-libp2p's BlockStore interface over our BlockStore."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        self.rejected = 0

    async def get_block(self, cid: Any) -> bytes | None:
        try:
            return self.store.get(_our_cid(cid))
        except CIDError:
            return None

    async def put_block(self, cid: Any, data: bytes) -> None:
        try:
            self.store.put(_our_cid(cid), data)
        except CIDError as exc:  # never store what does not match; the want-loop will notice
            self.rejected += 1
            log.warning("bitswap: rejected a block: %s", exc)

    async def has_block(self, cid: Any) -> bool:
        try:
            return self.store.has(_our_cid(cid))
        except CIDError:
            return False

    async def delete_block(self, cid: Any) -> None:
        self.store.delete(_our_cid(cid))

    def get_all_cids(self) -> list[bytes]:
        # we key blocks by digest; their CIDs (codec) are not recorded, so none can be listed
        return []


class BitswapExchange:
    def __init__(self, host: Host, store: BlockStore) -> None:
        self.host = host
        self.store = store
        self.adapter = _StoreAdapter(store)
        self.client = BitswapClient(host.libp2p, block_store=self.adapter, protocol_version=BITSWAP_PROTOCOL_V120)

    async def start(self) -> None:
        self.client.set_nursery(self.host.nursery)
        await self.client.start()

    async def stop(self) -> None:
        with trio.move_on_after(5):
            await self.client.stop()

    async def fetch_from_peer(self, peer: str, verifier: StreamVerifier,
                              on_block: Callable[[CID, bytes, bytes], None], *,
                              idle_timeout: float = 30.0, window: int = WINDOW) -> bool:
        """Fetch the verifier's remaining blocks from ``peer`` over Bitswap; True when complete."""
        session = self.client.new_session()
        peer_id = ID.from_base58(peer)
        while not verifier.done:
            need = [cid for cid in verifier.remaining()[:window] if not self.store.has(cid)]
            if need:
                with trio.move_on_after(idle_timeout + 1):
                    await session.get_blocks_batch([cid.to_bytes() for cid in need], peer_id=peer_id,
                                                   timeout=idle_timeout, batch_size=window)
            progressed = False
            while (cid := verifier.expected()) is not None:
                data = self.store.get(cid)
                if data is None:
                    break
                on_block(cid, data, verifier.feed(data))
                progressed = True
            if not progressed:
                raise PeerProtocolError(f"bitswap: {peer} did not send block {verifier.expected()} "
                                        f"within {idle_timeout:.0f} s")
        return True
